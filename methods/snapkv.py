"""
SnapKV: the last prompt tokens vote for the earlier tokens worth keeping, once, at prefill.

Paper: Li et al., "SnapKV: LLM Knows What You Are Looking for Before Generation", NeurIPS 2024,
https://arxiv.org/abs/2404.14469  (method: §4.1, voting from the observation window, and §4.2, clustering
by pooling).

Idea. Each attention head attends to a stable set of prompt positions during generation, and that set
can already be read off the attention of the last ``window`` prompt queries (the "observation window",
which typically holds the question). So after the prompt's attention: sum the window's attention over
each earlier token (a vote), smooth the votes with a 1-D pooling so that neighbours of a strong token
are kept with it (clusters keep their context), and keep each head's top-voted prefix tokens plus the
whole window. Decoding then runs on the compressed cache.

Key equations, as the code computes them, for a prompt of T tokens and window w:
    vote_h  = sum_{i in last w queries} A_h[i, :T-w]          # (H, T-w)  attention received
    vote_h  = pool1d(vote_h, kernel, stride 1, pad kernel//2)  # max or avg over neighbours
    score_j = mean_{h in group j} vote_h                       # GQA: per KV head
    keep_j  = sorted(top_{budget - w}(score_j)) ∪ {T-w, ..., T-1}

As a scorer (``nanollm.policy.ScoringPolicy``): ``score`` is the pooled vote over the prefix and the
window's (un-pooled) vote for its own tokens; ``protected`` is the window. Wrappers (AdaKV, ChunkKV) read
the same two things.

Choices and simplifications:
* GQA: the pooled votes are averaged over the G query heads of each KV head, as NVIDIA's kvpress library
  does; the authors' code instead repeats K/V per query head. Selection is per KV head; K and V are
  never repeated.
* Votes are summed over the window (the paper); kvpress averages, which keeps the same set.
* Average pooling counts PyTorch's zero padding in the mean (``count_include_pad``, as the authors'
  ``avg_pool1d`` call does), which dilutes the first/last ``kernel // 2`` prefix positions; max pooling
  does not.
* ``budget <= window``: only the last ``budget`` prompt tokens are kept, no vote needed.
* Decoding: SnapKV compresses the prompt only. Tokens decoded or ``extend``-ed afterwards are appended
  and kept, so the cache grows by one entry per head per token: the declared slack is ``n_decoded``
  (``slack`` below), as in the paper and kvpress.

Defaults: ``window = 32``, ``kernel = 7``, ``pooling = "max"``: the authors' LongBench script
(``ablation_c4096_w32_k7_maxpool``), also the settings the perturbation-constrained selection paper
(arXiv 2502.03805, §4.2) reports keeping for SnapKV. The authors' class defaults (window 64, kernel 5, avg)
and kvpress's (window 64, kernel 5, avg, mean votes) differ; ``methods/README.md`` has the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from nanollm.checks import check_budget, check_int
from nanollm.policy import Needs, ScoringPolicy, StepContext, group_mean, select_topk

POOLINGS = ("max", "avg")


def pool1d(x: Tensor, kernel: int, pooling: str) -> Tensor:
    """Stride-1 pooling along the last axis with padding ``kernel // 2``: (..., T) -> (..., T). Odd kernel."""
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1])                                  # (N, 1, T)
    if pooling == "max":
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:   # zero padding counted in the mean, as the SnapKV repo
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    return out.view(shape)


def window_vote(probs_window: Tensor, n_kv_head: int, kernel: int, pooling: str) -> Tensor:
    """SnapKV scores of the prefix tokens (§4.1 votes, §4.2 pooling), one row per KV head.

    Parameters
    ----------
    probs_window : (B, H, w, Tp) attention of the last w prompt queries over the Tp = T - w prefix tokens.
    n_kv_head : H_kv; query head h reads KV head h // (H // H_kv).
    kernel : odd pooling width (1 = no pooling).
    pooling : "max" or "avg".

    Returns
    -------
    scores : (B, H_kv, Tp) float32, higher = keep.
    """
    # BEGIN SOLUTION [baselines] sum the window's rows, pool along the tokens, mean over each GQA group
    B, H, _, Tp = probs_window.shape                                    # (B, H, w, Tp)
    vote = probs_window.float().sum(dim=2)                              # (B, H, Tp) summed over the window
    vote = pool1d(vote, kernel, pooling)                                # (B, H, Tp) clusters neighbours
    return group_mean(vote, n_kv_head)                                  # (B, H_kv, Tp) GQA group mean
    # END SOLUTION


def snapkv_scores(probs: Tensor, n_kv_head: int, window: int, kernel: int, pooling: str) -> Tensor:
    """Scores of all T prompt slots from the observation window's attention: the pooled votes for the prefix
    (``window_vote``), then the window's (unpooled) votes for its own tokens.

    probs : (B, H, R, T) attention of the prompt's last R >= min(window, T) queries over its T tokens.
    Returns (B, H_kv, T) float32.
    """
    T = probs.shape[-1]
    w = min(window, T)
    rows = probs[:, :, -w:, :]                                          # (B, H, w, T) the window's rows
    own = window_vote(rows[..., T - w:], n_kv_head, 1, pooling)         # (B, H_kv, w) not pooled
    if w == T:                                                          # a prompt no longer than the window
        return own
    prefix = window_vote(rows[..., :T - w], n_kv_head, kernel, pooling)   # (B, H_kv, T - w)
    return torch.cat([prefix, own], dim=-1)


def observation_window(pos: Tensor, seen: int, budget: int, window: int) -> Tensor:
    """(B, H_kv, T) bool: the observation window (its last ``budget`` tokens if ``budget <= window``)."""
    return pos >= seen - min(window, budget)


def snapkv_keep(scores: Tensor, pos: Tensor, seen: int, budget: int, window: int) -> Tensor:
    """The rule (§4.1): the whole observation window, then each head's top-scored prefix tokens.

    scores : (B, H_kv, T) ``snapkv_scores``; pos : (B, H_kv, T) positions; seen : tokens seen (the window is
    the last ``window`` positions).

    Returns
    -------
    idx : (B, H_kv, min(budget, T)) ascending (ties: the earlier slot wins, ``select_topk``).
    """
    return select_topk(scores, budget, protected=observation_window(pos, seen, budget, window))


@dataclass
class SnapKVPolicy(ScoringPolicy):
    """Compress the prompt once with SnapKV's observation-window vote; keep every later token.

    Parameters
    ----------
    budget : prompt entries kept per layer per KV head, the observation window included.
    window : observation window w, the last prompt queries that vote (default 32, see module doc).
    kernel : pooling width, odd (default 7). 1 disables pooling.
    pooling : "max" or "avg" (default "max").
    """

    budget: int
    window: int = 32         # the authors' LongBench script (see module doc)
    kernel: int = 7          # same source
    pooling: str = "max"     # same source ("maxpool")
    compress_on: ClassVar[tuple[str, ...]] = ("prefill",)   # the prompt only; later tokens are all kept

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_int("window", self.window, what=" (observation window)")
        check_int("kernel", self.kernel, what=" and odd (pooling width)")
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an int >= 1 and odd (pooling width), got {self.kernel!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")

    def needs(self, phase: str) -> Needs:
        """The observation window's rows of the prompt's attention (nothing later: SnapKV then keeps all)."""
        return Needs(rows=self.window) if phase in self.compress_on else Needs()

    def score(self, ctx: StepContext) -> Tensor:
        """(B, H_kv, T): pooled window votes for the prefix, then the window's votes for its own tokens."""
        return snapkv_scores(ctx.probs, ctx.kv.pos.shape[1], self.window, self.kernel, self.pooling)

    def protected(self, ctx: StepContext) -> Tensor:
        """The observation window (its last ``budget`` tokens if ``budget <= window``)."""
        return observation_window(ctx.kv.pos, ctx.seen, self.budget, self.window)

    def select(self, ctx: StepContext) -> Tensor:
        return snapkv_keep(self.score(ctx), ctx.kv.pos, ctx.seen, self.budget, self.window)

    # on_decode: SnapKV never evicts after the prompt (``compress_on``; see the module docstring).

    # -- contract declarations -------------------------------------------------------------------------
    def slack(self, n_prompt: int, n_decoded: int) -> int:
        """Every token after the prompt is kept: the cache grows by one entry per head per token."""
        return n_decoded

    def protected_positions(self, n_prompt: int, seen: int) -> list[int]:
        """The observation window (or its last ``budget`` tokens) and every token after the prompt."""
        if n_prompt <= self.budget:
            return list(range(seen))
        return list(range(n_prompt - min(self.window, self.budget), seen))
