"""The adapters of the ``scissorhands`` assignment, the functions its tests call: see course/model_adapters.py.

Each adapter imports the library inside the function, so a library file that fails to import fails only the
tests that reach it. (The hidden tests of the evictions run the instructor's policy in their own process and
call your functions through these adapters, so each task is graded alone.)
"""

from __future__ import annotations

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


