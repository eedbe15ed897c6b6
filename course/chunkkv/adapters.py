"""The adapters of the ``chunkkv`` assignment, the functions its tests call: see course/model_adapters.py.

Each adapter imports the library inside the function, so a library file that fails to import fails only the
tests that reach it. (The hidden tests of the kept chunks and of the reused layers run the instructor's policy
in their own process and call your functions through these adapters, so each task is graded alone.)
"""

from __future__ import annotations

from torch import Tensor

FUNCTIONS = ("chunk_keep_mask", "holds_position")      # the library functions the tasks write


def chunk_mask(scores: Tensor, pos: Tensor, free: Tensor, n_free: Tensor, chunk_size: int, shared: bool,
               remainder: str) -> Tensor:
    """(B, H_kv, T) bool: the free slots Algorithm 1 keeps (at most n_free (B, H_kv) per head)."""
    from methods.chunkkv import chunk_keep_mask
    return chunk_keep_mask(scores, pos, free, n_free, chunk_size, shared, remainder)


def holds(chosen: Tensor, pos: Tensor, seen: int) -> Tensor:
    """(B, H_kv, T) bool: whether each slot's position is among ``chosen`` (B, H_kv, K) of its head."""
    from methods.chunkkv import holds_position
    return holds_position(chosen, pos, seen)
