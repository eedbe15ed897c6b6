"""
The policy protocol: the one boundary between the decoder and every KV-cache method.

A cache carries a policy, and the policy decides what each layer keeps. ``KVCache.attend`` calls three
hooks inside every layer's attention:

    attend_kv(layer, store) -> entries   what the step's queries attend to (default: the storage itself)
    on_prefill(ctx)                      after the layer attended over the whole prompt
    on_decode(ctx)                       after the layer attended in a decode step or an extend chunk

``needs(phase)`` says what a method reads from the attention (a ``Needs``), so nothing else is computed.
``budget`` means tokens kept per layer per KV head, protected tokens (sinks, windows) included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .checks import check_budget, check_needs, check_scores
from .config import ModelConfig
from .slots import select_lowest
from .storage import LayerKV


@dataclass(frozen=True)
class Needs:
    """What a policy reads from one step's attention."""

    rows: int | None = 0        # the last ``rows`` queries' probabilities, ctx.probs; None = every query's
    col_sums: bool = False      # ctx.col_sums: the attention each entry received, summed over the queries

    def __post_init__(self) -> None:
        check_needs(self.rows, self.col_sums)

    def __or__(self, other: "Needs") -> "Needs":          # everything either asks for
        rows = None if self.rows is None or other.rows is None else max(self.rows, other.rows)
        return Needs(rows, self.col_sums or other.col_sums)


@dataclass
class StepContext:
    """What a policy sees after one layer's attention in one step."""

    layer: int
    phase: str                  # "prefill" (the cache was empty) or "decode" (a token or an extend chunk)
    q: Tensor                   # (B, H, Tn, d) the step's queries, after RoPE
    q_pos: Tensor               # (Tn,) their positions
    probs: Tensor | None        # (B, H, R, T) the last R queries' probabilities over the entries attended
    out: Tensor                 # (B, H, Tn, d) the attention output per head, before W_O
    kv: LayerKV                 # the layer's storage, already holding the step's new entries
    attn: torch.nn.Module       # the attention module: attn.o_proj.weight is W_O, (D, H*d)
    config: ModelConfig
    seen: int                   # tokens seen including this step
    attended_pos: Tensor | None = None     # (B, H_kv, T) positions of the entries attended (None: kv.pos)
    col_sums: Tensor | None = None         # (B, H, T) fp32 attention each attended entry received


class CachePolicy:
    """Base class of every method; by itself it keeps everything. A method compresses right after a layer's
    attention (the prompt's own attention is always exact). Its declarations are what the contract tests
    check and what the evaluation counts as its memory."""

    def needs(self, phase: str) -> Needs:
        return Needs()

    def attend_kv(self, layer: int, store: LayerKV) -> LayerKV:
        return store                    # or new storage holding rebuilt entries (KVReviver)

    def on_prefill(self, ctx: StepContext) -> None:
        pass

    def on_decode(self, ctx: StepContext) -> None:
        pass

    def reset(self) -> None:
        pass                            # forget the sequence, to serve a new one

    # -- declarations ----------------------------------------------------------------------------------------
    def slack(self, n_prompt: int, n_decoded: int) -> int:
        return 0                        # entries per KV head beyond budget (SnapKV keeps what follows the prompt)

    def head_slack(self, n_kv_head: int) -> int:
        return 0                        # more for one head when a layer's heads share a budget (AdaKV)

    def protected_positions(self, n_prompt: int, seen: int) -> list[int]:
        return []                       # positions every KV head still holds after a step

    def extra_nbytes(self) -> int:
        return 0                        # side tables kept outside the storage

    def slot_nbytes(self) -> int:
        return 0                        # K/V slots kept outside the storage (a sketch's cells)

    def exact_positions(self, layer: int, store: LayerKV) -> Tensor:
        return store.pos                # (B, H_kv, T) positions held raw, -1 where approximated


class FullCache(CachePolicy):
    """Keep every token: the reference every method is compared with."""


def select_topk(scores: Tensor, budget: int, pos: Tensor | None = None) -> Tensor:
    """(B, H_kv, T) scores -> (B, H_kv, min(budget, T)) indices of each head's best, ascending. NaN counts as
    -inf; on equal scores the earlier slot wins (a stable sort), or the earlier position given ``pos`` (slots
    evicted in place hold later tokens), so the choice is deterministic."""
    check_budget(budget)
    s = torch.nan_to_num(scores.float(), nan=float("-inf"), neginf=float("-inf"))   # -inf: not made finite
    by_pos = None if pos is None else pos.masked_fill(pos < 0, torch.iinfo(pos.dtype).max).argsort(stable=True)
    order = torch.sort(s if by_pos is None else s.gather(-1, by_pos), dim=-1, descending=True, stable=True).indices
    order = order if by_pos is None else by_pos.gather(-1, order)                # back to slots
    return order[..., :budget].sort(dim=-1).values


class ScoringPolicy(CachePolicy):
    """A method that ranks entries. A subclass (a dataclass with a ``budget`` field) implements ``score``,
    and ``observe``, ``needs``, ``protected`` when it has them; the rest is shared:

        every hook:  observe(ctx)
                     if ctx.phase in compress_on and a head holds more than budget:
                         ctx.kv.keep(select(ctx))    each head's top ``n_keep`` by ``keep_scores``, or at
                         ctx.kv.evict(evict(ctx))    a one-token step: the others, emptied in place

    The two keep the same set (ties: the earlier position). A layer within budget is never touched: a budget
    covering the sequence is the full cache.
    """

    budget: int
    compress_on: ClassVar[tuple[str, ...]] = ("prefill",)
    evicts_in_place: ClassVar[bool] = True      # decode steps evict in place (``PolicyWrapper``: it compacts)

    def observe(self, ctx: StepContext) -> None:
        pass                            # update what the method accumulates (ctx.kv.state)

    def score(self, ctx: StepContext) -> Tensor:
        raise NotImplementedError       # (B, H_kv, T) importance of every slot, higher = keep

    def protected(self, n_prompt: int, seen: int) -> list[range]:
        """Position ranges kept whatever their score (sinks, windows); the contract checks they stay."""
        return []

    def rank(self, scores: Tensor, pos: Tensor, seen: int) -> Tensor:
        """``scores`` (B, H_kv, T) as selection ranks them: protected slots +inf, empty slots -inf. Every held
        position is below ``seen`` (the tokens seen), so a protected range up to ``seen`` is tested from its start."""
        ranked, inf = scores.float(), float("inf")
        for r in self.protected(seen, seen):
            ranked = ranked.masked_fill((pos >= r.start) & (pos < r.stop) if r.stop < seen else pos >= r.start, inf)
        return ranked.masked_fill(pos < 0, -inf)

    def keep_scores(self, ctx: StepContext) -> Tensor:
        return self.rank(check_scores(self, self.score(ctx), ctx.kv.pos), ctx.kv.pos, ctx.seen)

    def head_budgets(self, ctx: StepContext) -> Tensor:
        """(B, H_kv): entries each KV head keeps when the layer is compressed."""
        B, H_kv, T = ctx.kv.pos.shape
        return torch.full((B, H_kv), min(self.budget, T), dtype=torch.long, device=ctx.kv.pos.device)

    def over_budget(self, ctx: StepContext) -> bool:
        return len(ctx.kv) > self.budget

    def n_keep(self, ctx: StepContext) -> int:
        """Entries each head keeps when the layer is compressed."""
        return min(self.budget, len(ctx.kv))

    def select(self, ctx: StepContext) -> Tensor:   # slots to keep (B, H_kv, K), ascending; -1 = empty
        return select_topk(self.keep_scores(ctx), self.n_keep(ctx), ctx.kv.pos)

    def evict(self, ctx: StepContext) -> Tensor:    # slots to empty (B, H_kv, E): the ones select drops
        pos = ctx.kv.pos
        stays = pos < 0                                               # empty slots and protected entries
        for r in self.protected(ctx.seen, ctx.seen):             # (every held position is < seen)
            stays |= (pos >= r.start) if r.stop >= ctx.seen else (pos >= r.start) & (pos < r.stop)
        return select_lowest(check_scores(self, self.score(ctx), pos), pos, stays, len(ctx.kv) - self.n_keep(ctx))

    def step(self, ctx: StepContext) -> None:
        self.observe(ctx)
        if ctx.phase in self.compress_on and self.over_budget(ctx):
            if ctx.phase == "decode" and ctx.q.shape[2] == 1 and self.evicts_in_place:
                ctx.kv.evict(self.evict(ctx))       # no copy: the next tokens take these slots
            else:                                   # the prompt, or an extend chunk: the storage shrinks
                ctx.kv.keep(self.select(ctx))       # to the kept slots, once per chunk

    on_prefill = on_decode = step               # the same rule after the prompt and after every later step

    def slack(self, n_prompt: int, n_decoded: int) -> int:
        return 0 if "decode" in self.compress_on else n_decoded      # a prefill method keeps what follows

    def protected_positions(self, n_prompt: int, seen: int) -> list[int]:
        return sorted({p for r in self.protected(n_prompt, seen) for p in r})
