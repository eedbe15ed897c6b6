"""The adapters of the ``chunkkv`` assignment, the functions its tests call: see course/model_adapters.py."""

from __future__ import annotations

from torch import Tensor

from course.model_adapters import (  # noqa: F401  (re-exported for the tests)
    kept_positions,
    new_cache,
    run_prefill,
    tiny_model,
)
from methods.chunkkv import chunk_keep_mask, holds_position


def chunk_mask(scores: Tensor, pos: Tensor, free: Tensor, n_free: Tensor, chunk_size: int, shared: bool,
               remainder: str) -> Tensor:
    """(B, H_kv, T) bool: the free slots Algorithm 1 keeps (at most n_free (B, H_kv) per head)."""
    return chunk_keep_mask(scores, pos, free, n_free, chunk_size, shared, remainder)


def holds(chosen: Tensor, pos: Tensor, seen: int) -> Tensor:
    """(B, H_kv, T) bool: whether each slot's position is among ``chosen`` (B, H_kv, K) of its head."""
    return holds_position(chosen, pos, seen)
