"""
What the reading path calls by what it does, and need not read: two fast paths over a layer's slots, and the
views of its per-slot state.

    gather_slots(ts, idx)                 the slots idx of every head of each t: ``LayerKV.keep`` compacting
    select_lowest(scores, pos, stays, n)  the slots ``select_topk`` would drop, without a sort:
                                          ``ScoringPolicy.evict`` at a one-token decode step
    to_device(values, device)             slot numbers from the host, without the host waiting for a GPU
    StateViews                            ``LayerKV.state``: assigning to a name writes into the buffer
"""

from __future__ import annotations

import torch
from torch import Tensor


def gather_slots(ts: list[Tensor], idx: Tensor) -> list[Tensor]:
    """Each t of ts (B, H_kv, S, ...) -> (B, H_kv, K, ...): the slots idx (B, H_kv, K) of every head, as rows
    of a flat (B*H_kv*S, -1) view: one index_select per tensor (on CPU much faster than gather with an
    expanded index), the rows computed once for all of them (on a GPU, three launches fewer a tensor)."""
    B, H_kv, S = ts[0].shape[:3]
    rows = (torch.arange(B * H_kv, device=idx.device).view(B, H_kv, 1) * S + idx).reshape(-1)
    return [t.reshape(B * H_kv * S, -1).index_select(0, rows).view(B, H_kv, idx.shape[-1], *t.shape[3:])
            for t in ts]


def select_lowest(scores: Tensor, pos: Tensor, stays: Tensor, n: int) -> Tensor:
    """(B, H_kv, T) scores -> (B, H_kv, n) slots of each head's n lowest, never one where ``stays``: what
    ``select_topk`` drops (NaN as -inf), ties to the later position, as ``select_topk`` on slots in position
    order. No sort: the n-th lowest score, the slots below it, then the latest positions tied on it."""
    s = torch.nan_to_num(scores.float(), nan=float("-inf"), neginf=float("-inf")).masked_fill(stays, float("inf"))
    if n == 1:                                                           # a decode step: no host wait
        higher = s != s.amin(dim=-1, keepdim=True)                       # (B, H_kv, T) all but the lowest
        return pos.masked_fill(higher, -1).argmax(dim=-1, keepdim=True)  # (B, H_kv, 1) the latest lowest
    nth = s.topk(n, dim=-1, largest=False).values[..., -1:]               # (B, H_kv, 1) the n-th lowest
    out = s < nth                                                        # (B, H_kv, T) all of these go
    missing = n - out.sum(-1, keepdim=True)                              # (B, H_kv, 1) the rest: tied on nth
    latest = torch.where(s == nth, pos, -1).topk(n, dim=-1).indices      # (B, H_kv, n) tied, latest first
    first = torch.arange(n, device=s.device) < missing                   # (B, H_kv, n) the first `missing`
    out.scatter_(-1, latest, first | out.gather(-1, latest))
    return out.nonzero()[:, -1].view(*s.shape[:2], n)                    # exactly n per head, ascending


def to_device(values: list, device) -> Tensor:
    """Host integers (a list, or a list of equal lists) as an int64 tensor on ``device``. To a GPU through
    pinned memory, without waiting: a copy from ordinary host memory makes the host wait until every kernel
    launched before it has run."""
    t = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class StateViews(dict):
    """name -> (B, H_kv, T, ...) view of a state's buffer. Assigning to a name writes into the buffer, so
    ``kv.state[name] += x`` and ``kv.state[name] = x`` both update the storage (a new name: ``set_state``)."""

    def __setitem__(self, name: str, value: Tensor) -> None:
        if value is not self[name]:
            self[name].copy_(value)
