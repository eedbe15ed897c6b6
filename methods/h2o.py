"""
H2O: heavy hitters (by accumulated attention) + a recent window, evicted greedily while decoding.

Paper: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023, https://arxiv.org/abs/2306.14048  (eviction policy: Algorithm 1).
Spec: specs/methods.md §4.2.

Idea. A small set of tokens ("heavy hitters") receives most of the attention mass, and a token that was
attended to a lot so far tends to stay important. So every cached token carries a running sum of the
attention it has received; the cache keeps the highest sums plus the most recent tokens (which have had
little time to accumulate anything), and when it overflows it drops the lowest-scoring old token.

Key equations (spec §4.2), as the code computes them, per layer and KV head j = query group g:
    score_j += mean_{h in g} sum_{queries i of the step} A_h[i, j]   # attention token j received
    keep     = top_{budget - n_recent}(score over non-recent slots) ∪ last n_recent slots

Algorithm 1 evicts one token per step, the one whose removal keeps the largest remaining score sum, i.e.
the minimum-score non-recent token. Keeping the top ``budget - n_recent`` is the same thing, and also
covers an ``extend`` chunk of Tn tokens (Tn evictions in one go; scores don't change in between).

Choices the paper leaves open, and ours:
* Prefill score = column sums of the causal prompt attention, *not* normalised by the number of
  queries that could attend (T - j). Early tokens are favoured (they received more queries), as in the
  paper; kvpress's ``ObservedAttentionPress`` divides by T - j instead (spec §4.2). We keep raw sums
  because decoding then adds raw probabilities: one unit of score per query, the same unit throughout.
* GQA: the G query heads of a KV group are *averaged* (kvpress averages too). With the mean, each query
  adds exactly 1 to the scores of a KV head, so after prefill (before any eviction) a head's scores sum
  to T, the number of queries (tests/test_baselines.py). A sum would add G per query instead, and
  select the same tokens.
* Scores live in the policy, one (B, H_kv, T) tensor per layer, gathered with the same indices as the
  storage at every eviction so slot j of the scores is always slot j of ``LayerKV``.

Defaults: the H2O scripts use ``heavy_ratio = recent_ratio = 0.1`` of the sequence length (spec §4.2),
an equal split between heavy hitters and recent tokens; with a token budget that is
``n_recent = budget // 2`` (the default when ``n_recent`` is None).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from nanollm.policy import CachePolicy, StepContext, check_budget, select_topk


def received_attention(probs: Tensor, n_kv_head: int) -> Tensor:
    """Attention each stored entry received in one step, averaged over each GQA group.

    Parameters
    ----------
    probs : (B, H, Tn, T) attention probabilities of the step's Tn queries over the T stored slots.
    n_kv_head : H_kv; query head h belongs to group h // (H // H_kv).

    Returns
    -------
    (B, H_kv, T) float32: sum over the Tn queries, mean over the G query heads of each group.
    """
    B, H, _, T = probs.shape                                         # (B, H, Tn, T)
    per_head = probs.float().sum(dim=2)                              # (B, H, T)
    return per_head.view(B, n_kv_head, H // n_kv_head, T).mean(dim=2)  # (B, H_kv, T)


def h2o_keep(scores: Tensor, budget: int, n_recent: int) -> Tensor:
    """Slots kept by H2O: the last ``n_recent`` slots plus the top-scored of the others.

    Parameters
    ----------
    scores : (B, H_kv, T) accumulated attention, slots in position order (the last slot is the newest).
    budget : entries kept per head, recent window included.
    n_recent : size of the recent window (0 <= n_recent <= budget).

    Returns
    -------
    idx : (B, H_kv, min(budget, T)) ascending; ties go to the earlier slot (``select_topk``).
    """
    T = scores.shape[-1]
    recent = torch.arange(T, device=scores.device) >= T - n_recent   # (T,) the protected window
    return select_topk(scores, budget, protected=recent)


@dataclass
class H2OPolicy(CachePolicy):
    """Heavy-hitter oracle: accumulated-attention heavy hitters + recent window, within ``budget``.

    Parameters
    ----------
    budget : tokens kept per layer per KV head, recent window included.
    n_recent : size of the recent window; None = ``budget // 2`` (equal heavy/recent split of the H2O
        scripts, spec §4.2). 0 = heavy hitters only; ``budget`` = a pure sliding window.
    """

    budget: int
    n_recent: int | None = None      # None -> budget // 2 (spec §4.2: heavy_ratio = recent_ratio)
    needs_probs: ClassVar[bool] = True
    # per-layer accumulated scores, layer -> (B, H_kv, T), aligned slot-for-slot with LayerKV
    _scores: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_budget(self.budget)
        if self.n_recent is None:
            self.n_recent = self.budget // 2
        if isinstance(self.n_recent, bool) or not isinstance(self.n_recent, int) \
                or not 0 <= self.n_recent <= self.budget:
            raise ValueError(f"n_recent must be an int in [0, budget={self.budget}], got {self.n_recent!r}")

    def on_prefill(self, ctx: StepContext) -> None:
        # spec §4.2: prefill scores = column sums of the causal attention (raw, not normalised)
        self._scores[ctx.layer] = received_attention(ctx.probs, ctx.kv.pos.shape[1])
        self._evict(ctx)

    def on_decode(self, ctx: StepContext) -> None:
        old = self._scores[ctx.layer]                                     # (B, H_kv, T - Tn)
        Tn = ctx.q.shape[2]
        new = torch.zeros(*old.shape[:2], Tn, dtype=old.dtype, device=old.device)
        scores = torch.cat([old, new], dim=-1)                            # (B, H_kv, T)
        # Alg. 1: add this step's attention to every kept token (the new ones start from what they got)
        self._scores[ctx.layer] = scores + received_attention(ctx.probs, ctx.kv.pos.shape[1])
        self._evict(ctx)

    def _evict(self, ctx: StepContext) -> None:
        if len(ctx.kv) <= self.budget:             # G-2: within budget, storage untouched
            return
        scores = self._scores[ctx.layer]
        idx = h2o_keep(scores, self.budget, self.n_recent)                # (B, H_kv, budget)
        ctx.kv.keep(idx)
        self._scores[ctx.layer] = scores.gather(-1, idx)                  # stay aligned with storage

    def reset(self) -> None:
        self._scores = {}

    def extra_nbytes(self) -> int:
        """Bytes of the accumulated scores: one float per stored entry (reported apart from K/V bytes)."""
        return sum(s.nbytes for s in self._scores.values())

    # -- contract declarations (tests/test_policy_contract.py) -------------------------------------------
    def slack(self, n_prompt: int, n_decoded: int) -> int:
        """Never more than ``budget`` entries per head between steps."""
        return 0

    def protected_positions(self, n_prompt: int, seen: int) -> list[int]:
        """The ``n_recent`` most recent positions."""
        return list(range(max(0, seen - self.n_recent), seen))
