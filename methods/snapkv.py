"""
SnapKV: the last prompt tokens vote for the earlier tokens worth keeping, once, at prefill.

Paper: Li et al., "SnapKV: LLM Knows What You Are Looking for Before Generation", NeurIPS 2024,
https://arxiv.org/abs/2404.14469 (votes from the observation window: §4.1; clustering by pooling: §4.2).

Each head attends to a stable set of prompt positions during generation, and that set can be read off the
attention of the last ``window`` prompt queries, which typically hold the question. So the window votes,
neighbours of a strong token are kept with it (pooling), and each KV head keeps its best-voted prefix tokens
plus the whole window. Later tokens are all kept. Defaults and where they come from: ``methods/README.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from nanollm.checks import check_budget, check_int
from nanollm.policy import Needs, ScoringPolicy, StepContext

POOLINGS = ("max", "avg")


def pool1d(x: Tensor, kernel: int, pooling: str) -> Tensor:
    """Stride-1 pooling of width ``kernel`` (odd) along the last axis, padding kernel // 2: (..., T) -> (..., T).
    Average pooling counts the zero padding, as the authors' ``avg_pool1d`` call does."""
    # BEGIN SOLUTION [baselines:window_vote] §4.2: each token's neighbourhood of width kernel, centred, its max or mean
    flat = x.reshape(-1, 1, x.shape[-1])                                # (N, 1, T)
    if pooling == "max":
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    return out.view(x.shape)
    # END SOLUTION


def window_vote(probs_window: Tensor, n_kv_head: int, kernel: int, pooling: str) -> Tensor:
    """The votes of §4.1-4.2: (B, H, w, Tp) attention of the w window queries over Tp tokens -> (B, H_kv, Tp), in
    float32 whatever the attention's dtype.

        vote_h = pool(sum_{i in window} A_h[i, :])      score_j = mean_{h in group j} vote_h

    with group j the consecutive query heads jG .. jG + G - 1 (head h reads KV head h // G). The pooling sees
    only these Tp tokens (zero padding beyond them, counted in an average)."""
    # BEGIN SOLUTION [baselines:window_vote] §4.1's vote of each query head, §4.2's pooling, one score per KV head
    vote = probs_window.float().sum(dim=2)                              # (B, H, Tp) summed over the window
    vote = pool1d(vote, kernel, pooling)                                # neighbours of a strong token
    B, H, Tp = vote.shape
    return vote.view(B, n_kv_head, H // n_kv_head, Tp).mean(dim=2)      # (B, H_kv, Tp) per KV head
    # END SOLUTION


def snapkv_scores(probs: Tensor, n_kv_head: int, window: int, kernel: int, pooling: str) -> Tensor:
    """(B, H_kv, T) float32: the pooled votes of the T - w prefix tokens, then the window's own (un-pooled) votes.
    probs (B, H, R, T): the last R >= min(window, T) prompt queries."""
    # BEGIN SOLUTION [baselines:window_vote] §4.1: the last w queries vote; prefix votes pooled, the window's own not
    T = probs.shape[-1]
    w = min(window, T)
    rows = probs[:, :, -w:, :]                                          # (B, H, w, T) the window's rows
    own = window_vote(rows[..., T - w:], n_kv_head, 1, pooling)         # (B, H_kv, w)
    if w == T:
        return own
    return torch.cat([window_vote(rows[..., :T - w], n_kv_head, kernel, pooling), own], dim=-1)
    # END SOLUTION


@dataclass
class SnapKVPolicy(ScoringPolicy):
    """SnapKV at prefill. budget: prompt entries kept per KV head, the window included; window: the voting
    queries w; kernel: pooling width (odd, 1 = none); pooling: "max" or "avg"."""

    budget: int
    window: int = 32         # the authors' LongBench script (methods/README.md)
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_int("window", self.window, what=" (observation window)")
        check_int("kernel", self.kernel, what=" and odd (pooling width)")
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an int >= 1 and odd (pooling width), got {self.kernel!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")

    def needs(self, phase: str) -> Needs:
        return Needs(rows=self.window) if phase in self.compress_on else Needs()   # the window's rows

    def score(self, ctx: StepContext) -> Tensor:
        return snapkv_scores(ctx.probs, ctx.kv.pos.shape[1], self.window, self.kernel, self.pooling)

    def protected(self, n_prompt: int, seen: int) -> list[range]:
        """The window (its last ``budget`` tokens if budget <= window), and every token after the prompt."""
        return [range(n_prompt - min(self.window, self.budget) if n_prompt > self.budget else 0, seen)]
