"""
StreamingLLM: attention sinks + a rolling window of recent tokens.

Paper: Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
https://arxiv.org/abs/2309.17453  (method: §3.2 "Rolling KV Cache with Attention Sinks").

Idea. Softmax attention must put its mass somewhere, and LLMs learn to dump the surplus on the first few
tokens ("attention sinks"), whatever they say. Evicting those sinks wrecks the model; keeping them plus
a window of the most recent tokens gives a fixed-size cache that streams forever. No attention
probabilities are needed: the kept set depends only on positions.

Key rule (§3.2), over the T stored slots in position order:
    keep = [0 .. S-1]  ∪  [T-R .. T-1]          S = n_sink sinks, R = budget - S recent tokens

As a scorer (``nanollm.policy.ScoringPolicy``) this is "newer is better": score = position, the S sinks
and the R most recent tokens protected. The protected set fills the whole budget, so StreamingLLM keeps
exactly it, and a wrapper around it (``adakv(streaming_llm)``, ``chunkkv(streaming_llm)``) changes
nothing. Applied at prefill and after every
decode/extend step, so the cache never holds more than ``budget`` entries per layer and KV head between
steps (one step's new tokens are attended before eviction).

Simplifications vs the paper:
* Positions. The paper assigns rotary positions *within the cache* (a token's position is its slot index
  in the rolling cache; keys are cached before RoPE and re-rotated). We keep every token's original
  position, as NVIDIA's kvpress library does: keys are cached after RoPE at their true positions, so once
  eviction starts the outputs legitimately differ from the paper's re-indexed variant.
* Tiny budgets. If ``budget <= n_sink`` the sinks are cut to ``budget - 1`` so that the newest token is
  always kept (budget 1 = keep only the newest token).

Defaults: ``n_sink = 4`` (the paper's four initial tokens, §3.2; kvpress uses 4 too). ``budget`` has no
default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from nanollm.checks import check_budget, check_int
from nanollm.policy import ScoringPolicy, StepContext, select_topk


def sink_and_recent(budget: int, n_sink: int) -> tuple[int, int]:
    """Split ``budget`` into (sinks S, recent R) with S + R = budget; the newest token always fits."""
    S = min(n_sink, budget - 1)
    return S, budget - S


def sinks_and_recent_mask(pos: Tensor, seen: int, budget: int, n_sink: int) -> Tensor:
    """(B, H_kv, T) bool: the S sinks (positions 0..S-1) and the R most recent positions (seen-R..seen-1).
    pos (B, H_kv, T), -1 = empty slot."""
    # BEGIN SOLUTION [baselines] True on the S sinks (positions 0..S-1) and the R most recent positions
    S, R = sink_and_recent(budget, n_sink)
    return ((pos >= 0) & (pos < S)) | (pos >= seen - R)
    # END SOLUTION


def streaming_llm_keep(pos: Tensor, seen: int, budget: int, n_sink: int) -> Tensor:
    """The rule (§3.2): the sinks and the recent window, as a top-k where the score is the position and the
    sinks and window are protected (they fill the budget, so exactly they are kept).

    Returns
    -------
    idx : (B, H_kv, min(budget, T)) slots to keep, ascending. All slots if ``T <= budget``.
    """
    return select_topk(pos.float(), budget, sinks_and_recent_mask(pos, seen, budget, n_sink))


@dataclass
class StreamingLLMPolicy(ScoringPolicy):
    """Keep ``n_sink`` attention sinks and the ``budget - n_sink`` most recent tokens.

    Parameters
    ----------
    budget : tokens kept per layer per KV head, sinks included.
    n_sink : number of initial tokens always kept (§3.2: 4).
    """

    budget: int
    n_sink: int = 4          # §3.2: four initial tokens as attention sinks
    compress_on: ClassVar[tuple[str, ...]] = ("prefill", "decode")   # §3.2: the window rolls every step

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_int("n_sink", self.n_sink, low=0, what=" (attention sinks kept)")

    def score(self, ctx: StepContext) -> Tensor:
        """Recency: the position itself (newer = higher)."""
        return ctx.kv.pos.float()                                        # (B, H_kv, T)

    def protected(self, ctx: StepContext) -> Tensor:
        """The sinks (positions 0..S-1) and the R most recent positions."""
        return sinks_and_recent_mask(ctx.kv.pos, ctx.seen, self.budget, self.n_sink)

    def select(self, ctx: StepContext) -> Tensor:
        return streaming_llm_keep(ctx.kv.pos, ctx.seen, self.budget, self.n_sink)

    # -- contract declarations -------------------------------------------------------------------------
    def protected_positions(self, n_prompt: int, seen: int) -> list[int]:
        """The sinks and the recent window, by original position."""
        S, R = sink_and_recent(self.budget, self.n_sink)
        return sorted(set(range(min(S, seen))) | set(range(max(0, seen - R), seen)))
