"""
ChunkKV: keep whole chunks of consecutive tokens, chosen by their summed votes; reuse indices across layers.

Paper: Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM
Inference", NeurIPS 2025, https://arxiv.org/abs/2502.00299 (chunk selection: Algorithm 1; layer-wise
index reuse: Algorithm 2; why chunks: the appendix's in-context-learning argument).

Token-level selection can keep the key of a fact and drop the digits of its value; ranking chunks of ``c``
consecutive tokens keeps what it keeps intact. Algorithm 1, for one layer, with s_j the inner scorer's votes (by
default the window's un-pooled attention) summed over the layer's KV heads (one index set per layer):
    S_k  = sum of s_j over chunk k = [k c, (k + 1) c)       (its free tokens: not protected)
    keep = protected ∪ the best chunks by S_k while they fit whole in budget - |protected|
                     ∪ the remainder (< c) as the best single tokens of the other chunks
Algorithm 2: layer l selects if l % N_reuse == 0, else reuses the indices of the layer before. Why the window is
protected first: ``methods/README.md``, "How each method is built"; heads, sums, defaults: its choices table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from nanollm.checks import check_budget, check_flag, check_int
from nanollm.policy import ScoringPolicy, StepContext
from nanollm.wrapper import PolicyWrapper

from .adakv import mask_to_indices
from .snapkv import SnapKVPolicy

REMAINDERS = ("tokens", "none")


def chunk_keep_mask(scores: Tensor, pos: Tensor, free: Tensor, n_free: Tensor, chunk_size: int,
                    shared: bool, remainder: str) -> Tensor:
    """Algorithm 1's choice among the free (unprotected) slots of one layer: chunk k holds the positions
    [k c, (k + 1) c); its score S_k is the sum of the votes of its free slots (per KV head, or summed over the
    layer's KV heads when ``shared``: then every head ranks the chunks alike). Chunks are taken whole (all
    their free slots), best first (equal scores: the earlier chunk first), while the head's kept slots stay
    within ``n_free``; the first chunk that does not fit ends the choice, and a chunk without a free slot is
    never taken. What is left (less than a chunk) is the remainder.

    Parameters
    ----------
    scores : (B, H_kv, T) token votes (higher = keep).
    pos : (B, H_kv, T) positions of the slots, -1 in an empty slot (never free); chunk of a free slot =
        pos // chunk_size.
    free : (B, H_kv, T) bool, slots that compete (valid and not protected).
    n_free : (B, H_kv) long, how many free slots each head may keep.
    chunk_size : c.
    shared : rank chunks once per layer (votes summed over KV heads) instead of per KV head.
    remainder : "tokens" fills what is left after the whole chunks with the best single tokens of the
        other chunks (exact budget); "none" leaves it empty.

    Returns
    -------
    keep : (B, H_kv, T) bool, at most ``n_free`` per head, True only on free slots.
    """
    B, H_kv, T = scores.shape
    # BEGIN SOLUTION [chunkkv:chunk_ranking] §3, Algorithm 1: chunk scores from the free votes; whole chunks, best first
    s = torch.where(free, scores.float(), torch.zeros((), device=scores.device))   # votes of free slots
    chunk = torch.where(free, pos // chunk_size, torch.zeros_like(pos))            # (B, H_kv, T)
    C = int(chunk.max()) + 1
    chunk_score = s.new_zeros(B, H_kv, C).scatter_add_(-1, chunk, s)               # (B, H_kv, C) S_k
    chunk_size_free = s.new_zeros(B, H_kv, C).scatter_add_(-1, chunk, free.float())   # free tokens per chunk
    if shared:
        chunk_score = chunk_score.sum(dim=1, keepdim=True).expand(B, H_kv, C)       # one ranking per layer
    chunk_score = chunk_score.masked_fill(chunk_size_free == 0, float("-inf"))
    order = torch.sort(chunk_score, dim=-1, descending=True, stable=True).indices  # earlier chunk wins ties
    sizes = chunk_size_free.gather(-1, order)                                      # in ranking order
    fits = (sizes.cumsum(-1) <= n_free[..., None]) & (sizes > 0)                   # whole chunks that fit
    kept_chunk = torch.zeros(B, H_kv, C, dtype=torch.bool, device=scores.device).scatter(-1, order, fits)
    keep = kept_chunk.gather(-1, chunk) & free                                     # (B, H_kv, T)
    # END SOLUTION
    if remainder == "tokens":
        s = torch.where(free, scores.float(), torch.zeros((), device=scores.device))   # votes of free slots
        left = n_free - keep.sum(-1)                                               # (B, H_kv) < one chunk
        token_score = s.sum(dim=1, keepdim=True).expand(B, H_kv, T) if shared else s   # same ranking rule
        rest = token_score.masked_fill(~free | keep, float("-inf"))
        rank = torch.sort(rest, dim=-1, descending=True, stable=True).indices      # best single tokens
        take = torch.arange(T, device=scores.device) < left[..., None]
        take &= rest.gather(-1, rank) > float("-inf")
        keep |= torch.zeros_like(keep).scatter(-1, rank, take)
    return keep


@dataclass
class ChunkKVPolicy(PolicyWrapper):
    """Whole-chunk selection over an inner scorer, with layer-wise index reuse.

    Parameters
    ----------
    budget : entries kept per layer per KV head, the inner scorer's protected entries (window) included.
    chunk_size : c, tokens per chunk (the paper: 10). 1 = token-level selection.
    reuse : N_reuse, layers per group sharing the first layer's indices (the paper: 2). 1 = no reuse.
    per_head : rank chunks per KV head instead of once per layer (default False: one index set per layer).
    remainder : "tokens" (fill the last < c slots with the best single tokens: exact budget) or "none".
    inner : the scorer giving token votes, same ``budget``; None = SnapKV without pooling (the paper's
        raw window attention). By name: ``make_policy("chunkkv(h2o)", ...)``.
    """

    budget: int
    chunk_size: int = 10             # the paper's chunk size for all models (Algorithm 1)
    reuse: int = 2                   # the paper's reuse depth (Algorithm 2)
    per_head: bool = False           # one index set per layer (see module doc)
    remainder: str = "tokens"
    inner: ScoringPolicy | None = None
    default_inner: ClassVar[str] = "snapkv"
    default_inner_options: ClassVar[dict] = {"kernel": 1}   # the paper scores with un-pooled attention
    # what the first layer of each reuse group kept: layer -> (tokens seen at that step, positions (B, H_kv, K))
    _reused: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_int("chunk_size", self.chunk_size)
        check_int("reuse", self.reuse)
        check_flag("per_head", self.per_head)
        if self.remainder not in REMAINDERS:
            raise ValueError(f"remainder must be one of {REMAINDERS}, got {self.remainder!r}")
        self.check_inner(lambda: SnapKVPolicy(budget=self.budget, **self.default_inner_options))

    def select(self, ctx: StepContext) -> Tensor:
        """Kept slots (B, H_kv, K), ascending (-1 pads heads with fewer entries under per-head budgets)."""
        group_first = ctx.layer - ctx.layer % self.reuse
        seen, reused = self._reused.get(group_first, (None, None))
        if group_first != ctx.layer and seen == ctx.seen:                   # Algorithm 2: reuse this step's
            keep = holds_position(reused, ctx.kv.pos, ctx.seen)            # choice of the first layer
        else:                                                              # Algorithm 1: select
            scores = self.inner.keep_scores(ctx)                           # protected +inf, empty -inf
            valid, protected = ctx.kv.pos >= 0, scores == float("inf")
            n_free = (self.inner.head_budgets(ctx) - protected.sum(-1)).clamp(min=0)
            keep = protected | chunk_keep_mask(scores, ctx.kv.pos, valid & ~protected, n_free,
                                               self.chunk_size, not self.per_head, self.remainder)
        idx = mask_to_indices(keep)
        if self.reuse > 1 and ctx.layer == group_first:
            self._reused[ctx.layer] = (ctx.seen, ctx.kv.pos.gather(-1, idx.clamp(min=0)).masked_fill(idx < 0, -1))
        return idx

    def reset(self) -> None:
        self._reused = {}
        self.inner.reset()


def holds_position(chosen: Tensor, pos: Tensor, seen: int) -> Tensor:
    """(B, H_kv, T) bool: whether each slot's position is among ``chosen`` (B, H_kv, K) of the same head
    (-1 in either = nothing), through a table indexed by position: O(T + K) per head, not O(T * K). ``seen``:
    the tokens seen so far, so every position is below it (the table's size)."""
    # BEGIN SOLUTION [chunkkv:holds_position] §3, Algorithm 2 (index reuse): a table per head indexed by position
    table = torch.zeros(*pos.shape[:2], seen + 1, dtype=torch.bool, device=pos.device)   # column seen: -1
    table.scatter_(-1, torch.where(chosen < 0, seen, chosen), True)
    table[..., seen] = False
    return table.gather(-1, torch.where(pos < 0, seen, pos))
    # END SOLUTION
