"""The adapters of the ``critical_kv`` assignment, the functions its tests call: see course/model_adapters.py."""

from __future__ import annotations

from torch import Tensor

from course.model_adapters import (  # noqa: F401  (re-exported for the tests)
    kept_positions,
    new_cache,
    run_decode,
    run_prefill,
    tiny_model,
)
from methods.critical_kv import output_perturbation, perturbation_bound, perturbation_constrained_select


def perturbation(attn: Tensor, keep: Tensor, projected: Tensor) -> Tensor:
    """Eq. 5: ||(A - A') V W_O||_1 for attn (..., n), keep (..., n) bool, projected = V W_O (..., n, D)."""
    return output_perturbation(attn, keep, projected)


def bound(attn: Tensor, keep: Tensor, vnorm: Tensor) -> Tensor:
    """Theorem 2's upper bound theta for attn, keep (..., n) and vnorm P_i = ||V_i W_O||_1 (..., n)."""
    return perturbation_bound(attn, keep, vnorm)


def select(attn: Tensor, vnorm: Tensor, budget: int, alpha: float) -> Tensor:
    """Algorithm 1: the kept entries (..., min(budget, n)), ascending."""
    return perturbation_constrained_select(attn, vnorm, budget, alpha)
