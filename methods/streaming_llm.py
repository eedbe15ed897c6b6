"""
StreamingLLM: attention sinks + a rolling window of recent tokens.

Paper: Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
https://arxiv.org/abs/2309.17453  (method: §3.2 "Rolling KV Cache with Attention Sinks").
Spec: specs/methods.md §4.1.

Idea. Softmax attention must put its mass somewhere, and LLMs learn to dump the surplus on the first few
tokens ("attention sinks"), whatever they say. Evicting those sinks wrecks the model; keeping them plus
a window of the most recent tokens gives a fixed-size cache that streams forever. No scores, no
attention probabilities: the kept set depends only on positions.

Key rule (§3.2; spec §4.1 pseudocode), as the code computes it, over the T stored slots:
    keep = [0 .. S-1]  ∪  [T-R .. T-1]          S = n_sink sinks, R = budget - S recent tokens

Applied at prefill and after every decode/extend step, so the cache never holds more than ``budget``
entries per layer and KV head between steps (one step's new tokens are attended before eviction).

Simplifications vs the paper:
* Positions. The paper assigns rotary positions *within the cache* (a token's position is its slot index
  in the rolling cache; keys are cached before RoPE and re-rotated). We keep every token's original
  position, as kvpress's ``StreamingLLMPress`` does (spec §4.1): keys are cached after RoPE at their true
  positions, so once eviction starts the outputs legitimately differ from the paper's re-indexed variant.
* Tiny budgets. If ``budget <= n_sink`` the sinks are cut to ``budget - 1`` so that the newest token is
  always kept (budget 1 = keep only the newest token).

Defaults: ``n_sink = 4`` (paper, and kvpress ``n_sink = 4``; spec §4.1). ``budget`` has no default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nanollm.policy import CachePolicy, StepContext, check_budget


def sink_and_recent(budget: int, n_sink: int) -> tuple[int, int]:
    """Split ``budget`` into (sinks S, recent R) with S + R = budget; the newest token always fits."""
    S = min(n_sink, budget - 1)
    return S, budget - S


def sink_recent_indices(n_slots: int, budget: int, n_sink: int) -> Tensor:
    """Slots to keep out of ``n_slots`` stored in position order: the first S and the last R.

    Returns
    -------
    idx : (min(budget, n_slots),) long, ascending. All slots if ``n_slots <= budget``.
    """
    if n_slots <= budget:
        return torch.arange(n_slots)
    S, R = sink_and_recent(budget, n_sink)
    return torch.cat([torch.arange(S), torch.arange(n_slots - R, n_slots)])   # (S + R,)


@dataclass
class StreamingLLMPolicy(CachePolicy):
    """Keep ``n_sink`` attention sinks and the ``budget - n_sink`` most recent tokens.

    Parameters
    ----------
    budget : tokens kept per layer per KV head, sinks included.
    n_sink : number of initial tokens always kept (paper default 4, spec §4.1).
    """

    budget: int
    n_sink: int = 4          # §4.1 of the spec: paper default, also kvpress's

    def __post_init__(self) -> None:
        check_budget(self.budget)
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise ValueError(f"n_sink must be a non-negative int (attention sinks kept), got {self.n_sink!r}")

    def _evict(self, ctx: StepContext) -> None:
        T = len(ctx.kv)                       # stored slots; positions ascending, sinks in slots 0..S-1
        if T <= self.budget:                  # G-2: nothing to evict, storage untouched
            return
        B, H_kv = ctx.kv.pos.shape[:2]
        idx = sink_recent_indices(T, self.budget, self.n_sink).to(ctx.kv.pos.device)   # (budget,)
        ctx.kv.keep(idx.expand(B, H_kv, -1))  # same slots for every row and head: (B, H_kv, budget)

    def on_prefill(self, ctx: StepContext) -> None:
        self._evict(ctx)

    def on_decode(self, ctx: StepContext) -> None:
        # §3.2: the rolling window moves by one slot per generated token (by Tn for an extend chunk)
        self._evict(ctx)

    # -- contract declarations (tests/test_policy_contract.py) -------------------------------------------
    def slack(self, n_prompt: int, n_decoded: int) -> int:
        """Never more than ``budget`` entries per head between steps."""
        return 0

    def protected_positions(self, n_prompt: int, seen: int) -> list[int]:
        """The sinks and the recent window, by original position."""
        S, R = sink_and_recent(self.budget, self.n_sink)
        return sorted(set(range(min(S, seen))) | set(range(max(0, seen - R), seen)))
