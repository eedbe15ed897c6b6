"""The adapters of the ``critical_kv`` assignment, the functions its tests call: see course/model_adapters.py.

Each adapter imports the library inside the function, so a library file that fails to import fails only the
tests that reach it. ``using`` lets a test run the policy with its own reference in place of a task it does
not grade, so that each task is graded alone.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import Tensor

FUNCTIONS = ("renormalized_attention", "output_perturbation", "perturbation_bound", "two_stage_masks")


def renormalized(attn: Tensor, keep: Tensor) -> Tensor:
    """Theorem 1: the attention renormalised over the kept entries, (..., n)."""
    from methods.critical_kv import renormalized_attention
    return renormalized_attention(attn, keep)


def perturbation(attn: Tensor, keep: Tensor, projected: Tensor) -> Tensor:
    """Eq. 5: ||(A - A') V W_O||_1 for attn (..., n), keep (..., n) bool, projected = V W_O (..., n, D)."""
    from methods.critical_kv import output_perturbation
    return output_perturbation(attn, keep, projected)


def bound(attn: Tensor, keep: Tensor, vnorm: Tensor) -> Tensor:
    """Theorem 2's upper bound theta for attn, keep (..., n) and vnorm P_i = ||V_i W_O||_1 (..., n)."""
    from methods.critical_kv import perturbation_bound
    return perturbation_bound(attn, keep, vnorm)


def stages(first: Tensor, second: Tensor, budgets, n_first, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Algorithm 1's two stages: (stage1, keep), (..., T) bool each."""
    from methods.critical_kv import two_stage_masks
    return two_stage_masks(first, second, budgets, n_first, valid)


def select(attn: Tensor, vnorm: Tensor, budget: int, alpha: float) -> Tensor:
    """Algorithm 1: the kept entries (..., min(budget, n)), ascending."""
    from methods.critical_kv import perturbation_constrained_select
    return perturbation_constrained_select(attn, vnorm, budget, alpha)


@contextmanager
def using(**functions):
    """Inside the block, ``methods.critical_kv`` calls these functions (names from ``FUNCTIONS``) in place of its
    own: a test passes its references for the tasks it does not grade."""
    import methods.critical_kv as module
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
