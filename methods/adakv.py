"""
AdaKV: head-adaptive budgets. The heads of a layer share one pool of H_kv * budget entries.

Paper: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient
LLM Inference", NeurIPS 2025, https://arxiv.org/abs/2407.11550. Restated from kvpress's ``AdaKVPress``
in specs/methods.md §4.4 (the paper's own section/algorithm numbers were not re-checked for this file).

Idea. A uniform per-head budget wastes entries: a head whose attention is concentrated on a few tokens
needs few, a head whose attention is spread out needs many. AdaKV bounds the eviction loss by the
attention mass the evicted entries would have received, and that bound is smallest when the layer keeps
the *globally* highest scores across heads, whatever head they belong to. A safeguard keeps every head
from being starved: each head first keeps its own top ``alpha * budget`` entries.

Key equations (spec §4.4), as the code computes them, with per-head scores s_j from SnapKV's window
vote (``methods/snapkv.py``; the observation window scores +inf, so it is always kept):
    n_safe  = int(alpha_safeguard * budget)
    s_j[top_{n_safe}(s_j)] = +inf                          # safeguard: each head's own top n_safe
    keep    = top_{H_kv * budget} over all (j, t) pairs    # one pool for the whole layer

Storage. Heads now keep unequal counts; ``LayerKV.keep`` pads the shorter heads with empty slots
(index -1, position -1, never attended) up to the longest head's count K. kvpress instead keeps the full
cache and masks the evicted entries (spec §0.3); the outputs are the same (G-1). Stored bytes include
the padding (H_kv * K slots, K >= budget), so the memory saving is smaller than H_kv * budget suggests.

Slack, precisely (``slack``/``head_slack`` below; checked by tests/test_policy_contract.py). With
m = max(n_safe, window) (every head keeps at least its safeguard and the whole window), after prefill:
    valid entries of the layer, summed over KV heads  = H_kv * budget          (when T > budget)
    valid entries of one KV head                      in [m, H_kv * budget - (H_kv - 1) * m]
so one head may exceed ``budget`` by ``head_slack = (H_kv - 1) * (budget - m)``. Decoding adds one entry
per head per token, as in SnapKV (``slack = n_decoded``). ``budget <= window`` falls back to SnapKV's
"last ``budget`` tokens" for every head (no adaptivity, no padding).

Defaults: ``alpha_safeguard = 0.20`` (kvpress ``AdaKVPress``, spec §4.4); window, kernel and pooling as
SnapKV (spec §3.3: 32, 7, "max"; the CriticalKV paper, seed 003 §4.2, runs AdaKV with these "as
originally defined").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .snapkv import SnapKVPolicy


def adaptive_keep_mask(scores: Tensor, budget: int, n_safe: int) -> Tensor:
    """Which (head, slot) pairs AdaKV keeps: each head's top ``n_safe``, then the layer-wide top.

    Parameters
    ----------
    scores : (B, H_kv, T) per-head scores (higher = keep; +inf = always keep). NaN counts as -inf.
    budget : average entries per head; the layer keeps ``H_kv * budget`` in total (all if fewer).
    n_safe : safeguard, entries every head keeps from its own top scores (0 <= n_safe <= budget).

    Returns
    -------
    mask : (B, H_kv, T) bool, ``min(H_kv * budget, H_kv * T)`` True per row.

    Ties, in both stages, go to the earlier flat (head, slot) index (a stable sort), so it is
    deterministic.
    """
    B, H_kv, T = scores.shape
    s = torch.nan_to_num(scores.float(), nan=float("-inf"))
    if n_safe > 0:     # safeguard: force each head's top n_safe to the front of the global ranking
        safe = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :n_safe]  # (B, H_kv, n_safe)
        s = s.scatter(-1, safe, float("inf"))
    flat = s.reshape(B, H_kv * T)                                       # one pool for the whole layer
    top = torch.sort(flat, dim=-1, descending=True, stable=True).indices[:, :H_kv * budget]
    mask = torch.zeros(B, H_kv * T, dtype=torch.bool, device=scores.device)
    return mask.scatter(1, top, True).view(B, H_kv, T)


def mask_to_indices(mask: Tensor) -> Tensor:
    """Per-head kept slots, ascending, padded with -1 to the longest head: (B, H_kv, T) -> (B, H_kv, K)."""
    counts = mask.sum(dim=-1, keepdim=True)                             # (B, H_kv, 1)
    K = int(counts.max())
    # a stable sort on "not kept" lists the kept slots first, in ascending slot order
    order = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices[..., :K]   # (B, H_kv, K)
    slot = torch.arange(K, device=mask.device)
    return torch.where(slot < counts, order, torch.full_like(order, -1))


@dataclass
class AdaKVPolicy(SnapKVPolicy):
    """SnapKV scoring with AdaKV's head-adaptive budget allocation (prefill only, like SnapKV).

    Parameters
    ----------
    budget : average prompt entries kept per layer per KV head (the layer keeps H_kv * budget).
    window, kernel, pooling : SnapKV's scorer (see ``SnapKVPolicy``).
    alpha_safeguard : fraction of ``budget`` every head keeps from its own top scores (spec §4.4: 0.20).
        1.0 gives every head exactly ``budget``, i.e. plain SnapKV.
    """

    alpha_safeguard: float = 0.20    # spec §4.4: kvpress AdaKVPress

    def __post_init__(self) -> None:
        super().__post_init__()
        a = self.alpha_safeguard
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ValueError(f"alpha_safeguard must be a number in [0, 1], got {a!r}")

    @property
    def n_safe(self) -> int:
        return int(self.alpha_safeguard * self.budget)

    def select(self, prefix_scores: Tensor) -> Tensor:
        """Kept slots (B, H_kv, K), padded with -1, from the prefix scores (B, H_kv, T - window)."""
        B, H_kv, _ = prefix_scores.shape                                # (B, H_kv, T - window)
        window = torch.full((B, H_kv, self.window), float("inf"), device=prefix_scores.device)
        scores = torch.cat([prefix_scores.float(), window], dim=-1)   # (B, H_kv, T) window always kept
        return mask_to_indices(adaptive_keep_mask(scores, self.budget, self.n_safe))

    # -- contract declarations (tests/test_policy_contract.py) -------------------------------------------
    def head_slack(self, n_kv_head: int) -> int:
        """Entries one KV head may hold beyond ``budget`` (the layer total is unaffected)."""
        if self.budget <= self.window:
            return 0
        return (n_kv_head - 1) * (self.budget - max(self.n_safe, self.window))
