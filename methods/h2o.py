"""
H2O: heavy hitters (by accumulated attention) and a recent window, evicted greedily while decoding.

Paper: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
NeurIPS 2023, https://arxiv.org/abs/2306.14048 (the eviction policy: Algorithm 1).

A few tokens receive most of the attention, and a token attended a lot so far tends to stay important.
So every cached token carries the attention it has received; the cache keeps the highest sums and the
most recent tokens (which have had little time to receive any). Algorithm 1 drops the lowest-scored
non-recent token at each step, which is keeping each head's top ``budget`` with the recent ones protected
(an ``extend`` chunk of Tn tokens drops Tn at once). Prefill scores are the prompt attention's raw column
sums; the G query heads of a KV head are averaged, so each query adds exactly 1 to a head's scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from nanollm.checks import check_budget, check_int
from nanollm.policy import Needs, ScoringPolicy, StepContext
from nanollm.slots import select_lowest

from .rules import DecodeRule, own_hooks

STATE = "h2o_score"      # name of the per-slot accumulated attention in the storage


def received_attention(col_sums: Tensor, n_kv_head: int) -> Tensor:
    """(B, H, T) attention each slot received in a step, summed over its queries -> (B, H_kv, T) float32, the mean
    over each KV head's G query heads, per batch row:  r_{j,n} = mean_{h in group j} sum_i A_h[i, n], group j
    being the consecutive query heads jG .. jG + G - 1 (head h reads KV head h // G)."""
    # BEGIN SOLUTION [baselines:h2o_observe] Algorithm 1: attention received, per KV head from its G query heads
    B, H, T = col_sums.shape
    return col_sums.float().view(B, n_kv_head, H // n_kv_head, T).mean(dim=2)     # (B, H_kv, T)
    # END SOLUTION


def evict_lowest(score: Tensor, pos: Tensor, recent_from: int | Tensor) -> Tensor:
    """The slot each head drops at a one-token decode step (B, H_kv, 1): the lowest score among the held
    slots before ``recent_from`` (an int, or (B, 1, 1) for rows of their own), NaN lowest, the latest position
    on a tie (``select_lowest``). score, pos (B, H_kv, T), -1 in pos for an empty slot."""
    return select_lowest(score, pos, (pos < 0) | (pos >= recent_from), 1)


@dataclass
class H2OPolicy(ScoringPolicy):
    """budget: tokens kept per KV head, the recent ones included; n_recent: the recent window, None =
    budget // 2 (the authors' equal heavy / recent split), 0 = heavy hitters only, budget = a sliding window."""

    budget: int
    n_recent: int | None = None      # None -> budget // 2 (equal heavy / recent split, see module doc)
    compress_on: ClassVar[tuple[str, ...]] = ("prefill", "decode")   # Algorithm 1: every step

    def __post_init__(self) -> None:
        check_budget(self.budget)
        if self.n_recent is None:
            self.n_recent = self.budget // 2
        check_int("n_recent", self.n_recent, 0, high=self.budget, what=" (at most the budget)")

    def observe(self, ctx: StepContext) -> None:
        """Algorithm 1's scores, per slot in ``ctx.kv.state[STATE]`` (B, H_kv, T) so they move with their slot
        (``LayerKV.set_state``): at prefill what each slot received; at every later step they grow by what it
        received, a new slot starting at 0."""
        # BEGIN SOLUTION [baselines:h2o_observe] Algorithm 1: the scores accumulate the attention received
        received = received_attention(ctx.col_sums, ctx.kv.pos.shape[1])  # (B, H_kv, T)
        if ctx.phase == "prefill":      # the prompt attention's column sums (raw, not normalised)
            ctx.kv.set_state(STATE, received, fill=0.0)
        else:                           # score_j += r_j; a new token starts at 0
            ctx.kv.state[STATE].add_(received)
        # END SOLUTION

    def needs(self, phase: str) -> Needs:
        return Needs(col_sums=True)                                        # what each entry received

    def score(self, ctx: StepContext) -> Tensor:
        return ctx.kv.state[STATE]                                         # (B, H_kv, T)

    def protected(self, n_prompt: int, seen: int) -> list[range]:
        return [range(max(0, seen - self.n_recent), seen)]                 # the n_recent most recent

    def evict(self, ctx: StepContext) -> Tensor:
        """A decode step that drops one token per head: ``evict_lowest``, the rule every path runs."""
        if len(ctx.kv) - self.n_keep(ctx) != 1:
            return super().evict(ctx)
        return evict_lowest(ctx.kv.state[STATE], ctx.kv.pos, ctx.seen - self.n_recent)

    def decode_rule(self) -> DecodeRule | str:
        """The decode step's rule for the fast paths (``methods/rules.py``), or why this policy has none."""
        if not self.evicts_in_place or not own_hooks(self, H2OPolicy, "observe", "evict", "score", "protected"):
            return "its class changes H2O's hooks"
        return DecodeRule("heavy", self.budget, n_recent=self.n_recent)
