"""
AdaKV's other reading: the allocation its authors' repository runs, against the one kvpress runs.

Ada-KV (Feng et al., NeurIPS 2025, arXiv 2407.11550) shares one pool of entries among a layer's heads and
guards each head with a fraction alpha of the budget. ``methods/adakv.py`` follows kvpress: each head's own
top floor(alpha b) first (protected entries, SnapKV's window, among them), then the layer-wide top. The
authors' repository (FFY0/AdaKV, ``AdaptiveSnapKVCluster``) keeps the window apart and blends two
allocations: with b' = b - w entries per head outside the window and c_j the entries of head j in the
layer-wide top H b' of the scores outside it, head j keeps its own top

    round((1 - alpha) c_j + floor(alpha b'))      plus its window.

``RepositoryAdaKV`` is that rule as a policy; compare the two on the same runs with

    python -m experiments.compare --methods adakv experiments.analysis.adakv_allocation:RepositoryAdaKV

(``AdaKVAlphaHalf`` and ``RepositoryAdaKVAlphaHalf``: the two at alpha 0.5, the repository's script's value.)

What the repository's rounding would do to the budget and how we keep it: experiments/README.md, section
"analysis/adakv_allocation.py: AdaKV's allocation, two readings".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from methods.adakv import AdaKVPolicy
from nanollm.policy import StepContext


def blended_keep_mask(scores: Tensor, budget: int, alpha: float) -> Tensor:
    """Which (head, slot) pairs the repository's AdaKV keeps, over the KV heads (its ``--gqa_support`` path;
    without it the repository repeats the KV heads and shares the pool among the query heads).

    Parameters
    ----------
    scores : (B, H_kv, T) per-head scores (+inf = protected, kept apart; -inf or NaN = an empty slot).
    budget : entries per head on average, protected ones included; the layer keeps at most ``H_kv * budget``.
    alpha : the share of each head's own budget outside its protected entries that it keeps whatever the
        other heads score (the repository's ``floor_alpha``).

    Returns
    -------
    mask : (B, H_kv, T) bool.

    Where this goes beyond the repository, which meets none of it at SnapKV's prefill: heads with different
    protected counts p_j share a pool of sum_j (budget - p_j); ties go to the earlier head and slot (a stable
    sort, where the repository's sort and topk are unstable); and where rounding up puts the layer over its
    pool, the first heads that rounded up give one entry back each, so the layer never exceeds its budget.
    """
    s = torch.nan_to_num(scores.float(), nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    B, H_kv, T = s.shape
    protected = s == float("inf")                                        # (B, H_kv, T)
    p = protected.sum(-1).clamp(max=budget)                              # (B, H_kv) protected entries per head
    own = budget - p                                                     # b' per head: its budget outside them
    # c_j: head j's entries in the layer-wide top of the unprotected scores (a pool of sum_j b'_j)
    free = s.masked_fill(protected, float("-inf")).reshape(B, H_kv * T)     # (B, H_kv * T): the layer's pool
    ranked, top = torch.sort(free, dim=-1, descending=True, stable=True)    # (B, H_kv * T) each
    in_pool = (torch.arange(H_kv * T, device=s.device) < own.sum(-1, keepdim=True)) & (ranked > float("-inf"))
    c = torch.zeros(B, H_kv, dtype=torch.long, device=s.device).scatter_add_(1, top // T, in_pool.long())  # (B, H_kv)
    # the blend as the repository computes it: floor(alpha b') by Python's int(), the rest in float32 (an int64
    # tensor times a Python float), rounded half to even by torch.round
    floor_cap = torch.tensor([int(alpha * b) for b in range(budget + 1)], device=s.device)[own]   # (B, H_kv)
    share = c * (1 - alpha) + floor_cap                                  # (B, H_kv) float32
    keep = torch.round(share).long()
    # where rounding up puts the layer over its pool, the first heads that rounded up give one back each
    over = (keep.sum(-1, keepdim=True) - own.sum(-1, keepdim=True)).clamp(min=0)   # (B, 1)
    up = keep > share
    keep = keep - (up & (torch.cumsum(up.long(), -1) <= over)).long()
    # each head: its protected entries, then its own best keep_j of the rest (empty slots never)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices  # (B, H_kv, T), protected first
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(T, device=s.device).expand_as(order))
    return (rank < (p + keep)[..., None]) & (s > float("-inf"))


@dataclass
class RepositoryAdaKV(AdaKVPolicy):
    """AdaKV with the authors' repository's allocation (``blended_keep_mask``) in place of kvpress's; every other
    part (the inner scorer, ``alpha_safeguard`` as the repository's ``floor_alpha``, the padding of the shorter
    heads) is ``methods.adakv.AdaKVPolicy``'s."""

    def keep_mask(self, ctx: StepContext) -> Tensor:
        """(B, H_kv, T) bool: the blend over the inner scores."""
        return blended_keep_mask(self.inner.keep_scores(ctx), self.budget, self.alpha_safeguard)

    def head_slack(self, n_kv_head: int) -> int:
        """Entries one head may hold beyond ``budget``: its p protected ones and, at most, the whole pool the
        others leave (H b - p, when they protect nothing) blended with its floor; the worst p of 0 .. budget."""
        H, b, a = n_kv_head, self.budget, self.alpha_safeguard
        return max(p + math.ceil((1 - a) * (H * b - p)) + int(a * (b - p)) for p in range(b + 1)) - b


@dataclass
class AdaKVAlphaHalf(AdaKVPolicy):
    """kvpress's reading (``methods.adakv``) at alpha 0.5, the ``--floor_alpha`` of the repository's LongBench
    script (``experiments/LongBench/runall.sh``), to compare the two readings there too."""

    alpha_safeguard: float = 0.5


@dataclass
class RepositoryAdaKVAlphaHalf(RepositoryAdaKV):
    """The repository's reading at its script's alpha 0.5."""

    alpha_safeguard: float = 0.5
