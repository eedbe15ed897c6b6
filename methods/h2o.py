"""
H2O: heavy hitters (by accumulated attention) + a recent window, evicted greedily while decoding.

Paper: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023, https://arxiv.org/abs/2306.14048  (eviction policy: Algorithm 1).

Idea. A small set of tokens ("heavy hitters") receives most of the attention mass, and a token that was
attended to a lot so far tends to stay important. So every cached token carries a running sum of the
attention it has received; the cache keeps the highest sums plus the most recent tokens (which have had
little time to accumulate anything), and when it overflows it drops the lowest-scoring old token.

Key equations, as the code computes them, per layer and KV head j = query group g:
    score_j += mean_{h in g} sum_{queries i of the step} A_h[i, j]   # attention token j received
    keep     = top_{budget - n_recent}(score over non-recent slots) ∪ the n_recent most recent tokens

Algorithm 1 evicts one token per step, the one whose removal keeps the largest remaining score sum, i.e.
the minimum-score non-recent token. Keeping the top ``budget - n_recent`` is the same thing, and also
covers an ``extend`` chunk of Tn tokens (Tn evictions in one go; scores don't change in between).

The accumulated scores live in the storage's per-slot state (``ctx.kv.state["h2o_score"]``), so they move
with the entries they belong to whatever keeps or pads them (including AdaKV's padded heads).

Choices the paper leaves open, and ours:
* Prefill score = column sums of the causal prompt attention, *not* normalised by the number of
  queries that could attend (T - j). Early tokens are favoured (they received more queries), as in the
  paper's accumulation; NVIDIA's kvpress (``ObservedAttentionPress``) divides by T - j instead. We keep
  raw sums because decoding then adds raw probabilities: one unit of score per query throughout.
* GQA: the G query heads of a KV group are *averaged* (kvpress averages too). With the mean, each query
  adds exactly 1 to the scores of a KV head, so after prefill (before any eviction) a head's scores sum
  to T, the number of queries (tested). A sum would add G per query instead, and select the same tokens.

Defaults: the authors' scripts use ``heavy_ratio = recent_ratio = 0.1`` of the sequence length, an equal
split between heavy hitters and recent tokens; with a token budget that is ``n_recent = budget // 2`` (the
default when ``n_recent`` is None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from nanollm.checks import check_budget, check_int
from nanollm.policy import Needs, ScoringPolicy, StepContext, group_mean, select_topk

STATE = "h2o_score"      # name of the per-slot accumulated attention in the storage


def received_attention(col_sums: Tensor, n_kv_head: int) -> Tensor:
    """Attention each stored entry received in one step, averaged over each GQA group.

    Parameters
    ----------
    col_sums : (B, H, T) attention probabilities of the step's Tn queries over the T stored slots, summed
        over the queries (``ctx.col_sums``: the attention adds them up chunk by chunk, so a long prompt
        never holds its (Tn, T) matrix).
    n_kv_head : H_kv; query head h belongs to group h // (H // H_kv).

    Returns
    -------
    (B, H_kv, T) float32: mean over the G query heads of each group.
    """
    return group_mean(col_sums.float(), n_kv_head)                   # (B, H_kv, T)


def h2o_keep(scores: Tensor, pos: Tensor, seen: int, budget: int, n_recent: int) -> Tensor:
    """The rule (Algorithm 1): the ``n_recent`` most recent tokens plus the top-scored of the others.

    scores : (B, H_kv, T) accumulated attention; pos : (B, H_kv, T) positions (-1 = empty slot); seen : tokens
    seen (the recent window is positions seen - n_recent .. seen - 1).

    Returns
    -------
    idx : (B, H_kv, min(budget, T)) ascending; ties go to the earlier slot (``select_topk``).
    """
    return select_topk(scores, budget, protected=recent_window(pos, seen, n_recent))


def recent_window(pos: Tensor, seen: int, n_recent: int) -> Tensor:
    """(B, H_kv, T) bool: the ``n_recent`` most recent positions (seen - n_recent .. seen - 1)."""
    return pos >= seen - n_recent


@dataclass
class H2OPolicy(ScoringPolicy):
    """Heavy-hitter oracle: accumulated-attention heavy hitters + recent window, within ``budget``.

    Parameters
    ----------
    budget : tokens kept per layer per KV head, recent window included.
    n_recent : size of the recent window; None = ``budget // 2`` (the authors' equal heavy/recent split).
        0 = heavy hitters only; ``budget`` = a pure sliding window.
    """

    budget: int
    n_recent: int | None = None      # None -> budget // 2 (equal heavy / recent split, see module doc)
    compress_on: ClassVar[tuple[str, ...]] = ("prefill", "decode")   # Algorithm 1: evict every step

    def __post_init__(self) -> None:
        check_budget(self.budget)
        if self.n_recent is None:
            self.n_recent = self.budget // 2
        check_int("n_recent", self.n_recent, 0, high=self.budget, what=" (at most the budget)")

    def observe(self, ctx: StepContext) -> None:
        # BEGIN SOLUTION [baselines] prefill: what each slot received is its score (set_state); decode: add to it
        received = received_attention(ctx.col_sums, ctx.kv.pos.shape[1])  # (B, H_kv, T)
        if ctx.phase == "prefill":      # column sums of the causal prompt attention (raw, not normalised)
            ctx.kv.set_state(STATE, received, fill=0.0)
        else:                           # Alg. 1: every kept token adds what it received; new ones start at 0
            ctx.kv.state[STATE] += received
        # END SOLUTION

    def needs(self, phase: str) -> Needs:
        """Column sums of the attention at every step: what each entry received (Algorithm 1)."""
        return Needs(col_sums=True)

    def score(self, ctx: StepContext) -> Tensor:
        return ctx.kv.state[STATE]                                         # (B, H_kv, T)

    def protected(self, ctx: StepContext) -> Tensor:
        """The ``n_recent`` most recent tokens."""
        return recent_window(ctx.kv.pos, ctx.seen, self.n_recent)

    def select(self, ctx: StepContext) -> Tensor:
        return h2o_keep(ctx.kv.state[STATE], ctx.kv.pos, ctx.seen, self.budget, self.n_recent)

    # -- contract declarations -------------------------------------------------------------------------
    def protected_positions(self, n_prompt: int, seen: int) -> list[int]:
        """The ``n_recent`` most recent positions."""
        return list(range(max(0, seen - self.n_recent), seen))
