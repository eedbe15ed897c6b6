"""The adapters of the ``chunkkv`` assignment, the functions its tests call: see course/model_adapters.py.

Each adapter imports the library inside the function, so a library file that fails to import fails only the
tests that reach it. ``using`` lets a test run the policy with its own reference in place of a task it does
not grade, so that each task is graded alone.
"""

from __future__ import annotations

from functools import partial

from torch import Tensor

from course.model_adapters import (  # noqa: F401  (re-exported for the tests)
    kept_positions,
    new_cache,
    patched,
    run_decode,
    run_prefill,
    tiny_model,
)

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


using = partial(patched, "methods.chunkkv")   # with A.using(name=reference): course/model_adapters.patched
