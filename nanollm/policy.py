"""
The policy protocol: the one boundary between the decoder and every KV-cache method.

The model knows only that it has a cache (``cache.KVCache``). The cache carries a *policy*, and the policy
owns what each layer stores. Three hooks, called by ``KVCache.attend`` inside every layer's attention:

    attend_kv(layer, store) -> (k, v, pos)   what the step's queries attend to (default: the storage)
    on_prefill(ctx)                          after layer ctx.layer attended over the whole prompt
    on_decode(ctx)                           after layer ctx.layer attended in a decode or extend step

A method is a subclass that overrides one or more of them; ``ctx`` (a ``StepContext``) carries everything
a method may need, so nothing is recomputed inside a hook.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .cache import LayerKV
from .config import ModelConfig


@dataclass
class StepContext:
    """What a policy sees after one layer's attention in one step.

    layer  : layer index
    phase  : "prefill" (the cache was empty: the prompt) or "decode" (one token, or an ``extend`` chunk)
    q      : (B, H, Tn, d) the step's queries after RoPE (at prefill: every prompt position)
    q_pos  : (Tn,) their absolute positions
    probs  : (B, H, Tn, T) attention probabilities over the entries attended to, in storage order, or None
             unless the policy sets ``needs_probs = True``
    out    : (B, H, Tn, d) the attention output per head (before W_O)
    kv     : this layer's ``LayerKV`` storage, already holding the step's new entries
    attn   : the layer's attention module (``attn.o_proj.weight`` is W_O, shape (D, H*d))
    config : the model config
    seen   : tokens seen including this step (the next token gets position ``seen``)
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


class CachePolicy:
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

    needs_probs: bool = False   # set True to receive ctx.probs (costs a (B, H, Tn, T) tensor per layer)

    def attend_kv(self, layer: int, store: LayerKV) -> tuple[Tensor, Tensor, Tensor]:
        """Entries the next query attends to: (k, v) (B, H_kv, T, d) and pos (B, H_kv, T)."""
        return store.k, store.v, store.pos

    def on_prefill(self, ctx: StepContext) -> None:
        """Called once per layer after prefill attention. Default: keep everything."""

    def on_decode(self, ctx: StepContext) -> None:
        """Called once per layer after each decode/extend step's attention. Default: keep everything."""

    def reset(self) -> None:
        """Forget per-sequence state so the policy can serve a new sequence."""


class FullCache(CachePolicy):
    """The identity policy: every token is kept. The reference every method is compared with."""


def check_budget(budget: int) -> int:
    """Validate a per-head token budget: a positive int."""
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"budget must be an int (tokens kept per layer per KV head), got {budget!r}")
    if budget <= 0:
        raise ValueError(f"budget must be positive (tokens kept per layer per KV head), got {budget}")
    return budget


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
