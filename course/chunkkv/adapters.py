"""The adapters of the ``chunkkv`` assignment, the functions its tests call: see course/model_adapters.py.

Each adapter imports the library inside the function, so a library file that fails to import fails only the
tests that reach it. ``using`` lets a test run the policy with its own reference in place of a task it does
not grade, so that each task is graded alone.
"""

from __future__ import annotations

from contextlib import contextmanager

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


@contextmanager
def using(**functions):
    """Inside the block, ``methods.chunkkv`` calls these functions (names from ``FUNCTIONS``) in place of its own:
    a test passes its references for the tasks it does not grade."""
    import methods.chunkkv as module
    saved = {name: getattr(module, name) for name in functions}
    try:
        for name, f in functions.items():
            setattr(module, name, f)
        yield
    finally:
        for name, f in saved.items():
            setattr(module, name, f)


def tiny_model(flavour: str = "llama", seed: int = 0):
    from course.model_adapters import tiny_model
    return tiny_model(flavour, seed)


def new_cache(model, method: str | None = None, budget: int = 0, **options):
    from course.model_adapters import new_cache
    return new_cache(model, method, budget, **options)


def run_prefill(model, ids: Tensor, cache) -> Tensor:
    from course.model_adapters import run_prefill
    return run_prefill(model, ids, cache)


def run_decode(model, token: Tensor, cache) -> Tensor:
    from course.model_adapters import run_decode
    return run_decode(model, token, cache)


def kept_positions(cache, layer: int) -> Tensor:
    from course.model_adapters import kept_positions
    return kept_positions(cache, layer)
