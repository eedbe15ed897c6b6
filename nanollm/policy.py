"""
The policy protocol: the one boundary between the decoder and every KV-cache method.

The model knows only that it has a cache (``cache.KVCache``). The cache carries a *policy*, and the policy
owns what each layer stores. Three hooks, called by ``KVCache.attend`` inside every layer's attention:

    attend_kv(layer, store) -> entries   what the step's queries attend to (default: the storage itself;
                                         a method may return rebuilt entries, e.g. from a sketch)
    on_prefill(ctx)                      after layer ctx.layer attended over the whole prompt
    on_decode(ctx)                       after layer ctx.layer attended in a decode or extend step

A method is a subclass that overrides one or more of them; ``ctx`` (a ``StepContext``) carries everything
a method may need, so nothing is recomputed inside a hook. What a method reads from the attention itself
it declares with ``needs(phase)`` (a ``Needs``): the probabilities of the step's last query rows (SnapKV's
observation window), the column sums over all queries (H2O's accumulated attention), or nothing, which
lets the attention take its fast paths. A long prompt's (T, T) probability matrix is never built: rows
are kept only where asked, and column sums are added up chunk by chunk (``attention.attend_masked``).

Besides the hooks, a policy *declares* (``PolicyContract``) what it promises (``slack``, ``head_slack``,
``protected_positions``) and what it holds besides the storage (``extra_nbytes``, ``slot_nbytes``,
``exact_positions``): the contract tests and the evaluation harness read these declarations.

Three layers of reuse, from general to specific:

* ``CachePolicy``: the hooks (and the declarations of ``PolicyContract``), all with "keep everything"
  defaults.
* ``ScoringPolicy``: a selection method. It only says how important each entry is (``score``) and which
  entries must stay (``protected``); the base class does the rest once for everyone: when to compress
  (``compress_on``), whether the layer is over budget, ``select_topk``, ``keep``.
* ``PolicyWrapper``: a policy built around an ``inner`` scoring policy. It forwards everything to the
  inner one and overrides what it changes (AdaKV replaces the per-head top-k with a layer-wide one;
  ChunkKV turns token scores into chunk scores).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .checks import check_budget, check_flag, check_int
from .config import ModelConfig
from .storage import LayerKV


@dataclass(frozen=True)
class Needs:
    """What a policy reads from one step's attention (``CachePolicy.needs``).

    rows     : how many of the step's *last* queries' probability rows it needs, ``ctx.probs``
               (B, H, min(rows, Tn), T); None = every row (costs a (B, H, Tn, T) tensor: only for short
               sequences and analysis); 0 = none.
    col_sums : whether it needs ``ctx.col_sums`` (B, H, T): the attention each entry received, summed over
               the step's Tn queries (fp32), accumulated chunk by chunk without the full matrix.
    """

    rows: int | None = 0
    col_sums: bool = False

    def __post_init__(self) -> None:
        if self.rows is not None:
            check_int("Needs.rows", self.rows, 0, what=" or None (every row)")
        check_flag("Needs.col_sums", self.col_sums)

    def __or__(self, other: "Needs") -> "Needs":
        """Everything either asks for (a wrapper that adds its own needs to its inner policy's)."""
        rows = None if self.rows is None or other.rows is None else max(self.rows, other.rows)
        return Needs(rows, self.col_sums or other.col_sums)


@dataclass
class StepContext:
    """What a policy sees after one layer's attention in one step.

    layer  : layer index
    phase  : "prefill" (the cache was empty: the prompt) or "decode" (one token, or an ``extend`` chunk)
    q      : (B, H, Tn, d) the step's queries after RoPE (at prefill: every prompt position)
    q_pos  : (Tn,) their absolute positions
    probs  : (B, H, R, T) attention probabilities of the step's last R queries over the entries they
             attended (``attend_kv``'s result, in its slot order), R = min(needs.rows, Tn); None if the
             policy's ``needs(phase)`` asked for no rows
    col_sums : (B, H, T) fp32 attention each attended entry received, summed over the step's Tn queries;
             None unless ``needs(phase).col_sums``
    out    : (B, H, Tn, d) the attention output per head (before W_O)
    kv     : this layer's storage, already holding the step's new entries
    attn   : the layer's attention module (``attn.o_proj.weight`` is W_O, shape (D, H*d))
    config : the model config
    seen   : tokens seen including this step (the next token gets position ``seen``)
    attended_pos : (B, H_kv, T) positions of the entries the queries attended, aligned with the last axis
             of ``probs``. It is ``kv.pos`` (as it was during attention) unless ``attend_kv`` rebuilt
             entries; None in hand-made contexts means the same as ``kv.pos``.
    """

    layer: int
    phase: str
    q: Tensor
    q_pos: Tensor
    probs: Tensor | None
    out: Tensor
    kv: LayerKV
    attn: torch.nn.Module
    config: ModelConfig
    seen: int
    attended_pos: Tensor | None = None
    col_sums: Tensor | None = None


class PolicyContract:
    """What a policy *declares*, apart from what it does: the promises the contract tests check
    (``tests/methods/test_policy_contract.py``) and what the evaluation harness counts as the method's
    memory. Every declaration defaults to "keep everything, hold nothing else"; ``CachePolicy`` adds the
    hooks.
    """

    def slack(self, n_prompt: int, n_decoded: int) -> int:
        """Entries per KV head allowed beyond ``budget`` after a prompt of ``n_prompt`` tokens and
        ``n_decoded`` later tokens (e.g. SnapKV keeps every token after the prompt). The layer total must
        stay within ``H_kv * (budget + slack)``. Default 0."""
        return 0

    def head_slack(self, n_kv_head: int) -> int:
        """Extra entries one KV head may hold when the heads of a layer share one budget (AdaKV); the
        layer total is unaffected. Default 0."""
        return 0

    def protected_positions(self, n_prompt: int, seen: int) -> list[int]:
        """Positions every KV head must still hold after a step (sinks, windows). Default: none."""
        return []

    def extra_nbytes(self) -> int:
        """Bytes of side tables the policy keeps *outside* the storage (e.g. per-token scores), reported
        apart from K and V. Per-slot state kept in the storage is counted by the cache
        (``KVCache.state_nbytes``)."""
        return 0

    def slot_nbytes(self) -> int:
        """Bytes of key/value slots the policy keeps outside the storage (a sketch's cells, which stand in
        for evicted tokens): counted *with* the K/V bytes. Default 0."""
        return 0

    def exact_positions(self, layer: int, store: LayerKV) -> Tensor:
        """(B, H_kv, T) positions whose *raw* key and value the storage holds (-1 elsewhere). Default: every
        stored entry. A method that writes approximations into its storage (KVReviver's revived tokens)
        marks them -1, so the harness counts their attention as lost, not as kept."""
        return store.pos


class CachePolicy(PolicyContract):
    """Base class of every KV-cache method. By itself it keeps everything.

    When compression happens, relative to attention: the prompt's attention is always exact (every
    query sees every earlier prompt token); a prefill method compresses the prompt's cache once, right
    after each layer's prefill attention (``on_prefill``); a decode method brings each layer back within
    budget right after that layer's attention in every decode or extend step (``on_decode``), so the next
    step's queries see only what was kept, and the current step's new tokens were appended before its
    attention.

    ``budget`` everywhere in the project means tokens kept per layer per KV head, protected tokens
    (sinks, windows) included; ``keep_ratio = budget / tokens_seen``.
    """

    def needs(self, phase: str) -> Needs:
        """What the hooks of ``phase`` ("prefill" or "decode") read from the attention: ``ctx.probs`` rows,
        ``ctx.col_sums`` (see ``Needs``). Default: nothing, so the attention takes its fast path."""
        return Needs()

    def attend_kv(self, layer: int, store: LayerKV) -> LayerKV:
        """Entries the step's queries attend to. Default: the storage itself.

        A method that rebuilds entries (approximations of evicted tokens) returns a new storage object
        of the same kind holding them, e.g. ``LayerKV(k, v, pos)``; ``ctx.probs`` and
        ``ctx.attended_pos`` then refer to those entries, not to the storage.
        """
        return store

    def on_prefill(self, ctx: StepContext) -> None:
        """Called once per layer after prefill attention. Default: keep everything."""

    def on_decode(self, ctx: StepContext) -> None:
        """Called once per layer after each decode/extend step's attention. Default: keep everything."""

    def reset(self) -> None:
        """Forget per-sequence state so the policy can serve a new sequence."""


class FullCache(CachePolicy):
    """The identity policy: every token is kept. The reference every method is compared with."""


def group_mean(x: Tensor, n_kv_head: int) -> Tensor:
    """Mean over the G query heads of each KV head: (B, H, ...) -> (B, H_kv, ...). Query head h belongs to
    KV head h // G (the GQA convention); this is how every scorer reduces per-query-head numbers."""
    B, H = x.shape[:2]
    return x.view(B, n_kv_head, H // n_kv_head, *x.shape[2:]).mean(dim=2)


def select_topk(scores: Tensor, budget: int, protected: Tensor | None = None) -> Tensor:
    """Indices of the ``budget`` highest-scoring entries of every head, sorted ascending.

    Parameters
    ----------
    scores : (B, H_kv, T) importance of every stored entry (higher = keep). NaN counts as -inf.
    budget : entries to keep per head, protected ones included. ``budget >= T`` keeps everything.
    protected : bool, broadcastable to (B, H_kv, T): entries that are kept before any other (sinks,
        observation or recent windows).

    Returns
    -------
    idx : (B, H_kv, min(budget, T)) long, ascending within each head.

    Tie-break: on equal scores the *earlier* position wins (a stable sort on descending scores), so the
    result is deterministic. If more entries are protected than ``budget``, the earliest protected ones
    are kept; a method that prefers otherwise gives them different scores.
    """
    check_budget(budget)
    B, H, T = scores.shape
    K = min(budget, T)
    s = torch.nan_to_num(scores.float(), nan=float("-inf"))
    if protected is not None:
        s = s.masked_fill(protected.expand(B, H, T), float("inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices   # stable: earlier wins ties
    return order[..., :K].sort(dim=-1).values


class ScoringPolicy(CachePolicy):
    """A selection method: score every stored entry, keep the ``budget`` best per KV head.

    A subclass is a dataclass with a ``budget`` field and implements ``score`` (and, when it needs them,
    ``protected``, ``observe`` and ``compress_on``). Everything else is shared:

        on each hook:  observe(ctx)                        update per-slot state, every step
                       if the phase is in compress_on and the layer is over budget:
                           ctx.kv.keep(select(ctx))        select = select_topk(score, budget, protected)

    A layer within budget is never touched, so at a budget that covers the sequence every method is
    bit-for-bit the full cache.
    """

    budget: int
    compress_on: ClassVar[tuple[str, ...]] = ("prefill",)   # phases after which the layer is compressed

    def observe(self, ctx: StepContext) -> None:
        """Update what the method accumulates (e.g. per-slot scores in ``ctx.kv.state``). Default: nothing."""

    def score(self, ctx: StepContext) -> Tensor:
        """(B, H_kv, T) importance of every stored slot, higher = keep."""
        raise NotImplementedError

    def protected(self, ctx: StepContext) -> Tensor | None:
        """bool, broadcastable to (B, H_kv, T): slots kept whatever their score (None: no such slots)."""
        return None

    def over_budget(self, ctx: StepContext) -> bool:
        """Whether this layer holds more than ``budget`` slots per head (then it is compressed)."""
        return len(ctx.kv) > self.budget

    def head_budgets(self, ctx: StepContext) -> Tensor:
        """(B, H_kv) long: how many entries each KV head keeps when this layer is compressed. Uniform
        (``budget``) here; a head-adaptive allocation (AdaKV) overrides it, and a wrapper that selects
        within each head (perturbation-constrained selection) reads it from its inner policy."""
        B, H_kv, T = ctx.kv.pos.shape
        return torch.full((B, H_kv), min(self.budget, T), dtype=torch.long, device=ctx.kv.pos.device)

    def select(self, ctx: StepContext) -> Tensor:
        """Slots to keep (B, H_kv, K), ascending per head (-1 = empty slot, for unequal heads)."""
        return select_topk(self.score(ctx), self.budget, self.protected(ctx))

    def compress(self, ctx: StepContext) -> None:
        if self.over_budget(ctx):
            ctx.kv.keep(self.select(ctx))

    def on_prefill(self, ctx: StepContext) -> None:
        self.observe(ctx)
        if "prefill" in self.compress_on:
            self.compress(ctx)

    def on_decode(self, ctx: StepContext) -> None:
        self.observe(ctx)
        if "decode" in self.compress_on:
            self.compress(ctx)


class PolicyWrapper(ScoringPolicy):
    """A scoring policy built around an ``inner`` one: forwards everything, overrides what it changes.

    A subclass is a dataclass with ``budget`` and ``inner`` fields (and its own options); it overrides
    ``score``, ``select``, ``over_budget`` or ``head_budgets``. The inner policy's attention needs,
    per-slot state, timing (``compress_on``), budget allocation, rebuilt entries and contract
    declarations are passed through unchanged.
    """

    inner: ScoringPolicy

    def check_inner(self, default) -> None:
        """Build the default inner policy (``default()``) if none was given, and check the one given: a
        scoring policy with the wrapper's budget. Wrappers call this from ``__post_init__``."""
        if self.inner is None:
            self.inner = default()
        if not isinstance(self.inner, ScoringPolicy):
            raise ValueError(f"inner must be a scoring policy (a ScoringPolicy), got {type(self.inner).__name__}")
        if self.inner.budget != self.budget:
            raise ValueError(f"inner budget {self.inner.budget} differs from the wrapper's budget {self.budget}")

    def needs(self, phase: str) -> Needs:
        return self.inner.needs(phase)

    @property
    def compress_on(self) -> tuple[str, ...]:
        return self.inner.compress_on

    def attend_kv(self, layer: int, store: LayerKV) -> LayerKV:
        return self.inner.attend_kv(layer, store)

    def observe(self, ctx: StepContext) -> None:
        self.inner.observe(ctx)

    def score(self, ctx: StepContext) -> Tensor:
        return self.inner.score(ctx)

    def protected(self, ctx: StepContext) -> Tensor | None:
        return self.inner.protected(ctx)

    def over_budget(self, ctx: StepContext) -> bool:
        return self.inner.over_budget(ctx)

    def head_budgets(self, ctx: StepContext) -> Tensor:
        return self.inner.head_budgets(ctx)

    def reset(self) -> None:
        self.inner.reset()

    # -- the inner policy's declarations (PolicyContract), unchanged --------------------------------------
    def slack(self, n_prompt: int, n_decoded: int) -> int:
        return self.inner.slack(n_prompt, n_decoded)

    def head_slack(self, n_kv_head: int) -> int:
        return self.inner.head_slack(n_kv_head)

    def protected_positions(self, n_prompt: int, seen: int) -> list[int]:
        return self.inner.protected_positions(n_prompt, seen)

    def extra_nbytes(self) -> int:
        return self.inner.extra_nbytes()

    def slot_nbytes(self) -> int:
        return self.inner.slot_nbytes()

    def exact_positions(self, layer: int, store: LayerKV) -> Tensor:
        return self.inner.exact_positions(layer, store)
