"""
AdaKV: head-adaptive budgets. The heads of a layer share one pool of H_kv * budget entries.

Paper: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient
LLM Inference", NeurIPS 2025, https://arxiv.org/abs/2407.11550 (the adaptive allocation: Algorithm 1,
as kvpress's ``AdaKVPress`` realises it). A head whose attention sits on a few tokens needs few entries, one
whose attention is spread out needs many. The eviction loss is bounded by the attention mass of the evicted
entries, smallest when the layer keeps its globally best scores; a safeguard keeps each head's own best first.
With the inner scorer's per-head scores s_j:

    s_j[top_{n_safe}(s_j)] = +inf,  n_safe = floor(alpha * budget)      # safeguard: each head's own best
    keep = top_{H_kv * budget} over all (j, t)                         # one pool for the layer

Protected entries (SnapKV's window, +inf) count in n_safe, as in kvpress (the authors' repository allocates
otherwise: ``experiments/analysis/adakv_allocation.py`` runs its reading as an ablation);
padding the shorter heads, ``head_slack``: ``methods/README.md``, "How each method is built".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from nanollm.checks import check_budget, check_number
from nanollm.policy import ScoringPolicy, StepContext
from nanollm.wrapper import PolicyWrapper


def adaptive_keep_mask(scores: Tensor, budget: int, n_safe: int) -> Tensor:
    """Which (head, slot) pairs AdaKV keeps: each head's top ``n_safe``, then the layer-wide top.

    Parameters
    ----------
    scores : (B, H_kv, T) per-head scores (higher = keep; +inf = kept before any finite score, after the
        safeguard's entries). NaN counts as -inf.
    budget : average entries per head; the layer keeps ``H_kv * budget`` in total (all if fewer).
    n_safe : safeguard, entries every head keeps from its own top scores (0 <= n_safe <= budget).

    Returns
    -------
    mask : (B, H_kv, T) bool, ``min(H_kv * budget, H_kv * T)`` True per row.

    Ties, in both stages, go to the earlier flat (head, slot) index (a stable sort), so it is
    deterministic.
    """
    B, H_kv, T = scores.shape
    # BEGIN SOLUTION [baselines:adakv] Algorithm 1: the safeguard first, then one pool for the whole layer
    # NaN and -inf tie (nan_to_num's default would make -inf finite, above NaN); +inf becomes the largest
    # float, so a safeguarded entry (+inf below) ranks before a protected one
    s = torch.nan_to_num(scores.float(), nan=float("-inf"), neginf=float("-inf"))
    if n_safe > 0:     # safeguard: force each head's top n_safe to the front of the global ranking
        safe = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :n_safe]  # (B, H_kv, n_safe)
        s = s.scatter(-1, safe, float("inf"))
    flat = s.reshape(B, H_kv * T)                                       # one pool for the whole layer
    top = torch.sort(flat, dim=-1, descending=True, stable=True).indices[:, :H_kv * budget]
    mask = torch.zeros(B, H_kv * T, dtype=torch.bool, device=scores.device)
    return mask.scatter(1, top, True).view(B, H_kv, T)
    # END SOLUTION


def mask_to_indices(mask: Tensor) -> Tensor:
    """Per-head kept slots, ascending, padded with -1 to the longest head: (B, H_kv, T) -> (B, H_kv, K)."""
    counts = mask.sum(dim=-1, keepdim=True)                             # (B, H_kv, 1)
    K = int(counts.max())
    # a stable sort on "not kept" lists the kept slots first, in ascending slot order
    order = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices[..., :K]   # (B, H_kv, K)
    slot = torch.arange(K, device=mask.device)
    return torch.where(slot < counts, order, torch.full_like(order, -1))


@dataclass
class AdaKVPolicy(PolicyWrapper):
    """Head-adaptive budget allocation over an inner scorer (SnapKV by default).

    Parameters
    ----------
    budget : average entries kept per layer per KV head (the layer keeps H_kv * budget).
    alpha_safeguard : fraction of ``budget`` every head keeps from its own top scores (kvpress: 0.20).
        1.0 gives every head exactly ``budget``, i.e. the inner scorer alone.
    inner : the scoring policy that ranks entries, with the same ``budget``; None = ``SnapKVPolicy``
        with its defaults. ``make_policy("adakv(h2o)", ...)`` builds other pairings by name.
    """

    budget: int
    alpha_safeguard: float = 0.20    # kvpress AdaKVPress
    inner: ScoringPolicy | None = None
    default_inner: ClassVar[str] = "snapkv"

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_number("alpha_safeguard", self.alpha_safeguard, 0, 1)
        from .snapkv import SnapKVPolicy  # the default inner, imported here: adaptive_keep_mask needs no scorer
        self.check_inner(lambda: SnapKVPolicy(budget=self.budget))

    @property
    def n_safe(self) -> int:
        return int(self.alpha_safeguard * self.budget)

    def over_budget(self, ctx: StepContext) -> bool:
        """The layer as a whole holds more than ``H_kv * budget`` valid entries (in some batch row)."""
        H_kv = ctx.kv.pos.shape[1]
        return int(ctx.kv.counts().sum(-1).max()) > H_kv * self.budget

    def keep_mask(self, ctx: StepContext) -> Tensor:
        """(B, H_kv, T) bool: AdaKV's choice over the inner scores (protected +inf, empty slots -inf)."""
        return adaptive_keep_mask(self.inner.keep_scores(ctx), self.budget, self.n_safe)

    def head_budgets(self, ctx: StepContext) -> Tensor:
        """(B, H_kv): entries each head gets from the shared pool (what ``select`` keeps per head)."""
        return self.keep_mask(ctx).sum(-1)

    def select(self, ctx: StepContext) -> Tensor:
        """Kept slots (B, H_kv, K), padded with -1."""
        return mask_to_indices(self.keep_mask(ctx))

    # -- contract declarations (the rest comes from the inner scorer) ----------------------------------
    def head_slack(self, n_kv_head: int) -> int:
        """Entries one KV head may hold beyond ``budget`` (the layer total is unaffected)."""
        return (n_kv_head - 1) * (self.budget - self.n_safe)
