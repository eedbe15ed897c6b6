"""The adapters of the ``scissorhands`` assignment, the functions its tests call: see course/model_adapters.py."""

from __future__ import annotations

from torch import Tensor

from course.model_adapters import (  # noqa: F401  (re-exported for the tests)
    kept_positions,
    new_cache,
    run_decode,
    run_prefill,
    tiny_model,
    uncached_logits,
)
from methods.scissorhands import keep_score, low_flags, n_dropped, scissorhands_keep


def unimportant(attn: Tensor, visible: Tensor, threshold: float | None = None) -> Tensor:
    """(B, H_kv, Tn, T) bool: which attended slots were below the threshold for each query."""
    return low_flags(attn, visible, threshold)


def tokens_to_drop(n_slots: int, budget: int, drop: int, n_recent: int) -> int:
    return n_dropped(n_slots, budget, drop, n_recent)


def keep_order(counts: Tensor, attn: Tensor, pos: Tensor) -> Tensor:
    """(B, H_kv, T) scores, higher = keep."""
    return keep_score(counts, attn, pos)


def keep(counts: Tensor, attn: Tensor, pos: Tensor, seen: int, budget: int, drop: int, n_recent: int) -> Tensor:
    """The slots Scissorhands keeps (B, H_kv, K), ascending."""
    return scissorhands_keep(counts, attn, pos, seen, budget, drop, n_recent)
