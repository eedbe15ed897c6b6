"""
A decode step's attention without the reading path's mask, and with the Triton kernel where it serves.

``nanollm.attention.attend`` builds a mask from positions at every step, which keeps it right after any
eviction. A decode step needs less: its one query (the newest entry) sees every stored entry but the empty
slots (position -1) and any after its own position (a storage never holds one, but the rule is the reading
path's), so the step is two products and a softmax, with the hidden entries' scores set to -inf. That mask
is applied whether or not an entry is hidden: asking first would make the host wait for the device at every
layer of every step. The arithmetic is that of ``attend``, so the numbers are the same bit for bit on CPU.

On a CUDA tensor where ``kernels.serves`` says so, the output comes from the split-K kernel of
``kernels/decode_attention.py`` (the probabilities a policy asks for are still computed here).
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels
from nanollm.attention import CausalSelfAttention, group_scores
from nanollm.policy import Needs
from nanollm.storage import LayerKV

SPLIT_HEADS_FROM = 4096     # cached tokens from which a CPU step with several threads goes head by head


def step_probs(q: Tensor, k: Tensor, pos: Tensor | None = None) -> Tensor:
    """q (B, H, 1, d), k (B, H_kv, T, d) -> (B, H_kv, G, T): one query per head over every entry, but those
    where ``pos`` (B, H_kv, T), the query's visibility of each entry, is -1 (no mask without pos)."""
    scores = group_scores(q, k)[:, :, :, 0]                                      # (B, H_kv, G, T)
    if pos is not None:
        scores = scores.masked_fill((pos < 0)[:, :, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)


def attend_step(q: Tensor, k: Tensor, v: Tensor, needs: Needs = Needs(),
                pos: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One query per row over entries it may all see, but those where ``pos`` (B, H_kv, T), if given, is -1
    (an empty slot, or one the caller hides): q (B, H, 1, d); k, v (B, H_kv, T, d). Returns as
    ``nanollm.attention.attend``."""
    B, H, _, d = q.shape
    if d >= 16 and d & (d - 1) == 0 and not q.requires_grad and kernels.serves(q):
        from kernels.decode_attention import decode_attention_triton, masked_decode_attention_triton
        out = (decode_attention_triton(q[:, :, 0], k, v) if pos is None              # (B, H, 1, d)
               else masked_decode_attention_triton(q[:, :, 0], k, v, pos)).unsqueeze(2)
        probs = step_probs(q, k, pos) if needs != Needs() else None
    else:
        probs = step_probs(q, k, pos)                                            # (B, H_kv, G, T)
        out = (probs @ v).view(B, H, 1, d)
    if probs is None:
        return out, None, None
    probs = probs.view(B, H, 1, -1)
    col_sums = probs.sum(dim=2, dtype=torch.float32) if needs.col_sums else None
    return out, (probs if needs.rows != 0 else None), col_sums


def attend_heads(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``attend_step``'s output one (row, KV head) at a time, (B, H, 1, d). One batched product shares its
    B * H_kv small matrices among the CPU threads (3 KV heads on 2 threads: one idles a third of the time);
    a product per head shares its T entries instead. Worth it only on long caches with several threads."""
    B, H, _, d = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    out = torch.empty(B, H_kv, G, d, dtype=q.dtype, device=q.device)
    for b in range(B):
        for h in range(H_kv):
            probs = step_probs(q[b:b + 1, h * G:(h + 1) * G], k[b:b + 1, h:h + 1])       # (1, 1, G, T)
            torch.matmul(probs[0, 0], v[b, h], out=out[b, h])                             # (G, d)
    return out.view(B, H, 1, d)


def attend_entries(q: Tensor, entries: LayerKV, q_pos: Tensor,
                   needs: Needs = Needs()) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``CausalSelfAttention.attend_entries`` with the decode step above (or its kernel) where it applies."""
    if q.shape[2] == 1:               # one query: it sees every entry at 0 <= position <= its own
        visible = entries.pos.masked_fill(entries.pos > q_pos, -1)       # (B, H_kv, T): -1 hides an entry
        return attend_step(q, entries.k, entries.v, needs, visible)
    return CausalSelfAttention.attend_entries(q, entries, q_pos, needs)


class FastAttention:
    """A layer's attention module as ``KVCache.attend`` sees it, with the fast ``attend_entries``; every
    other attribute (``o_proj``, which CriticalKV reads from ``ctx.attn``) is the module's."""

    def __init__(self, module: CausalSelfAttention) -> None:
        self.module = module

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "module":
            raise AttributeError(name)
        return getattr(self.module, name)

    attend_entries = staticmethod(attend_entries)
