"""The adapters of the ``critical_kv`` assignment, the functions its tests call: see course/model_adapters.py.

Each adapter imports the library inside the function, so a library file that fails to import fails only the
tests that reach it. (The hidden test of the kept entries runs the instructor's policy in its own process and
calls your two_stage_masks through these adapters, so that task is graded alone.)
"""

from __future__ import annotations

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


