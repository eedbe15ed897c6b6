"""The adapters of the ``scissorhands`` assignment, the functions its tests call: see course/model_adapters.py.

Each adapter imports the library inside the function, so a library file that fails to import fails only the
tests that reach it. (The hidden tests of the evictions run the instructor's policy in their own process and
call your functions through these adapters, so each task is graded alone.)
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

FUNCTIONS = ("low_flags", "keep_score", "n_dropped")      # the library functions the tasks write


def unimportant(attn: Tensor, visible: Tensor, threshold: float | None = None) -> Tensor:
    """(B, H_kv, Tn, T) bool: which attended slots were below the threshold for each query."""
    from methods.scissorhands import low_flags
    return low_flags(attn, visible, threshold)


def tokens_to_drop(n_slots: int, budget: int, drop: int, n_recent: int) -> int:
    """How many tokens a layer holding ``n_slots`` drops."""
    from methods.scissorhands import n_dropped
    return n_dropped(n_slots, budget, drop, n_recent)


def keep_order(counts: Tensor, attn: Tensor, pos: Tensor) -> Tensor:
    """(B, H_kv, T) scores, higher = keep."""
    from methods.scissorhands import keep_score
    return keep_score(counts, attn, pos)


def counters(steps: list[Tensor], n_kv_head: int, history_window: int, threshold: float | None = None) -> Tensor:
    """The counters I (B, H_kv, T) after Scissorhands observed a prompt and decode steps (nothing evicted).

    steps[0] : (B, H, Tn, T) the probabilities of the prompt's last Tn queries over positions 0..T-1;
    steps[s] : (B, H, 1, T + s) those of decode step s, which added position T + s - 1.
    """
    from methods.scissorhands import COUNT, ScissorhandsPolicy
    from nanollm import LayerKV

    policy = ScissorhandsPolicy(budget=1 << 20, history_window=history_window, threshold=threshold)
    B, _, _, T = steps[0].shape
    kv = LayerKV()
    for s, probs in enumerate(steps):
        new = torch.arange(T) if s == 0 else torch.tensor([T + s - 1])
        kv.append(torch.zeros(B, n_kv_head, len(new), 2), torch.zeros(B, n_kv_head, len(new), 2), new)
        seen = len(kv)
        policy.observe(SimpleNamespace(kv=kv, probs=probs, q_pos=torch.arange(seen - probs.shape[2], seen),
                                       phase="prefill" if s == 0 else "decode", seen=seen))
    return kv.state[COUNT]
