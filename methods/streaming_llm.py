"""
StreamingLLM: attention sinks and a rolling window of recent tokens.

Paper: Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
https://arxiv.org/abs/2309.17453 (the rolling KV cache with attention sinks: §3.2).

Softmax must put its mass somewhere, and LLMs learn to dump the surplus on the first few tokens
("attention sinks"), whatever they say. Evicting them wrecks the model; keeping them and a window of the
most recent tokens gives a fixed-size cache that streams forever:

    keep = [0, S)  ∪  [seen - R, seen)          S = n_sink sinks, R = budget - S recent tokens

A scorer whose score is the position, the sinks and the window protected. How it evicts while decoding, small
budgets: ``methods/README.md``, "How each method is built"; positions (original, as kvpress): its choices table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from nanollm.checks import check_budget, check_int
from nanollm.policy import ScoringPolicy, StepContext

from .rules import DecodeRule, own_hooks


def sinks_and_recent(budget: int, n_sink: int, seen: int) -> list[range]:
    """The two position ranges §3.2 keeps after ``seen`` tokens: the S sinks from position 0 and the R most
    recent, S + R = budget, S < budget (the newest token always fits); only positions in [0, seen)."""
    # BEGIN SOLUTION [baselines:sinks_and_recent] §3.2: the sinks (fewer if the budget is small), then the window
    S = min(n_sink, budget - 1)
    R = budget - S
    return [range(0, min(S, seen)), range(max(0, seen - R), seen)]
    # END SOLUTION


def evict_oldest(pos: Tensor, n_sink: int, n: int = 1) -> Tensor:
    """The slots each head drops at a decode step (B, H_kv, n): the n oldest positions at or after the
    ``n_sink`` sinks (an empty slot, at -1, is never one). pos (B, H_kv, T)."""
    after_sinks = pos.masked_fill(pos < n_sink, torch.iinfo(pos.dtype).max)
    if n == 1:                                                           # a decode step: one pass
        return after_sinks.argmin(dim=-1, keepdim=True)
    return after_sinks.topk(n, dim=-1, largest=False).indices           # oldest first


@dataclass
class StreamingLLMPolicy(ScoringPolicy):
    """budget: tokens kept per KV head, sinks included; n_sink: initial tokens always kept (§3.2: 4)."""

    budget: int
    n_sink: int = 4
    compress_on: ClassVar[tuple[str, ...]] = ("prefill", "decode")   # the window rolls every step

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_int("n_sink", self.n_sink, low=0, what=" (attention sinks kept)")

    def score(self, ctx: StepContext) -> Tensor:
        return ctx.kv.pos.float()                                        # recency

    def protected(self, n_prompt: int, seen: int) -> list[range]:
        return sinks_and_recent(self.budget, self.n_sink, seen)

    def evict(self, ctx: StepContext) -> Tensor:
        """(B, H_kv, E) the slots of the E oldest tokens after the sinks (``evict_oldest``)."""
        sinks = sinks_and_recent(self.budget, self.n_sink, ctx.seen)[0]
        return evict_oldest(ctx.kv.pos, sinks.stop, len(ctx.kv) - self.n_keep(ctx))

    def decode_rule(self) -> DecodeRule | str:
        """The decode step's rule for the fast paths (``methods/rules.py``), or why this policy has none."""
        if not self.evicts_in_place or not own_hooks(self, StreamingLLMPolicy, "evict", "score", "protected"):
            return "its class changes StreamingLLM's hooks"
        sinks = sinks_and_recent(self.budget, self.n_sink, self.budget + 1)[0]          # S = min(n_sink, budget - 1)
        return DecodeRule("sinks", self.budget, n_sink=sinks.stop)
