"""
StreamingLLM: attention sinks and a rolling window of recent tokens.

Paper: Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
https://arxiv.org/abs/2309.17453 (the rolling KV cache with attention sinks: §3.2).

Softmax must put its mass somewhere, and LLMs learn to dump the surplus on the first few tokens
("attention sinks"), whatever they say. Evicting them wrecks the model; keeping them and a window of the
most recent tokens gives a fixed-size cache that streams forever:

    keep = [0, S)  ∪  [seen - R, seen)          S = n_sink sinks, R = budget - S recent tokens

As a scorer, newer is better (score = position) and the sinks and the window are protected; they fill the
budget, so exactly they are kept, and a wrapper around StreamingLLM changes nothing. While decoding, the
token to drop is always the oldest one after the sinks, so no score is needed: each layer keeps a ring of
its non-sink slots, oldest first; a step pops the slot it empties and pushes it back at the recent end,
since the next token is written there (``LayerKV.append``): O(1) work per token (every KV head and row holds
the same positions in the same slots). Tokens keep their original positions (as kvpress; the paper
re-indexes positions inside the cache). If budget <= n_sink the sinks are cut to budget - 1, so the newest
token is always kept.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from torch import Tensor

from nanollm.checks import check_budget, check_int
from nanollm.policy import ScoringPolicy, StepContext
from nanollm.slots import to_device


def sinks_and_recent(budget: int, n_sink: int, seen: int) -> list[range]:
    """The two position ranges §3.2 keeps after ``seen`` tokens: the S sinks from position 0 and the R most
    recent, S + R = budget, S < budget (the newest token always fits); only positions in [0, seen)."""
    # BEGIN SOLUTION [baselines:sinks_and_recent] §3.2: the sinks (fewer if the budget is small), then the window
    S = min(n_sink, budget - 1)
    R = budget - S
    return [range(0, min(S, seen)), range(max(0, seen - R), seen)]
    # END SOLUTION


@dataclass
class StreamingLLMPolicy(ScoringPolicy):
    """budget: tokens kept per KV head, sinks included; n_sink: initial tokens always kept (§3.2: 4)."""

    budget: int
    n_sink: int = 4
    compress_on: ClassVar[tuple[str, ...]] = ("prefill", "decode")   # the window rolls every step
    _ring: dict = field(default_factory=dict, init=False, repr=False, compare=False)   # layer -> deque of slots

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_int("n_sink", self.n_sink, low=0, what=" (attention sinks kept)")

    def score(self, ctx: StepContext) -> Tensor:
        return ctx.kv.pos.float()                                        # recency

    def protected(self, n_prompt: int, seen: int) -> list[range]:
        return sinks_and_recent(self.budget, self.n_sink, seen)

    def select(self, ctx: StepContext) -> Tensor:
        self._ring.pop(ctx.layer, None)     # compacting moves every slot: the next eviction rebuilds the ring
        return super().select(ctx)

    def evict(self, ctx: StepContext) -> Tensor:
        """(B, H_kv, E) the slots of the E oldest tokens after the sinks, from the layer's ring."""
        ring = self._ring.get(ctx.layer)
        if ring is None:        # the layer's first eviction: its non-sink slots by position, once
            pos = ctx.kv.pos[0, 0]
            order = pos.argsort()
            sinks = sinks_and_recent(self.budget, self.n_sink, ctx.seen)[0]
            ring = self._ring[ctx.layer] = deque(order[pos[order] >= sinks.stop].tolist())
        B, H_kv = ctx.kv.pos.shape[:2]
        out = [ring.popleft() for _ in range(len(ctx.kv) - self.n_keep(ctx))]
        ring.extend(out)        # the recent end: the next tokens are written into the emptied slots
        return to_device(out, ctx.kv.pos.device).expand(B, H_kv, -1)     # (B, H_kv, E); no wait on a GPU

    def reset(self) -> None:
        self._ring = {}
