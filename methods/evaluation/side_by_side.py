"""
Many caches, one pass: how ``methods.compare`` runs the full cache and every method on a sample without
running the model once per method, and still gives each cache exactly the numbers of a run on its own.

* ``FanOut``: the policy of one prompt pass that serves many caches. The prompt's attention is exact
  whatever the method, so one pass computes the keys, values and outputs for all of them; at each layer
  every cache gets its own copy of the storage and the statistics its policy asks for.
* ``step_many``: one decode step for many caches. The element-wise work (embedding, RMSNorm, RoPE, SiLU,
  residual adds) treats every row on its own, so it runs once over all rows; the matrix products and the
  attention run per cache, with the arithmetic of ``LeanDecoder.step`` (``LeanDecoder.forward``).

Why not the products too? A product over many rows may sum in another order than the same product over one
row (it does here), and then a method's numbers would depend on which other methods ran beside it.
``tests/methods/evaluation/test_side_by_side.py`` and ``test_harness.py`` check the bit-for-bit equality.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from fastpath.lean import LeanDecoder
from nanollm.attention import prompt_statistics, rope_cos_sin
from nanollm.cache import KVCache, LayerKV
from nanollm.policy import CachePolicy, Needs, StepContext


class SharedPrefillUnsupported(Exception):
    """A policy or model the shared prompt pass cannot serve (``traces`` then runs the prompts one by one)."""


class FanOut(CachePolicy):
    """The policy of one prompt pass that serves many caches (``harness.traces``).

    The prompt's attention is exact whatever the method (a policy compresses only after a layer's prompt
    attention), so every method's prompt pass computes the same keys, values and outputs, layer after
    layer; only the policies' hooks differ. This policy lets the pass compute the outputs alone, and at
    each layer hands every cache its own copy of the layer's storage and the statistics its policy asks
    for (``prompt_statistics`` with that policy's ``needs``: the very call ``attention.attend_prompt`` makes for
    it), then runs that policy's ``on_prefill``. Each policy sees exactly what its own prompt pass would
    show it (a test compares them bit for bit), for one forward pass instead of one per method.

    Two assumptions, which every registered method meets: a policy's prefill hook does not draw from the
    global random generator (the hooks of different policies now interleave, layer by layer), and
    ``reset()`` forgets everything (the fallback starts every policy again).
    """

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = caches

    def needs(self, phase: str) -> Needs:
        return Needs()                                   # the shared pass computes only the output

    def on_prefill(self, ctx: StepContext) -> None:
        store = ctx.kv
        if not isinstance(store, LayerKV) or not torch.equal(store.pos, ctx.q_pos.expand_as(store.pos)):
            raise SharedPrefillUnsupported("not a plain causal prompt over LayerKV storage")
        stats: dict[Needs, tuple] = {}
        for cache in self.caches:
            own = copy.deepcopy(store)
            if cache.policy.attend_kv(ctx.layer, own) is not own:
                raise SharedPrefillUnsupported("a policy attends to rebuilt entries at prefill")
            needs = cache.policy.needs("prefill")
            if needs not in stats:                       # (probs, col_sums), as attend() computes them
                stats[needs] = (None, None) if needs == Needs() else prompt_statistics(ctx.q, own.k, needs)
            probs, col_sums = (None if t is None else t.clone() for t in stats[needs])
            cache.policy.on_prefill(replace(ctx, q=ctx.q.clone(), out=ctx.out.clone(), kv=own, probs=probs,
                                            col_sums=col_sums, attended_pos=own.pos))
            cache.layers[ctx.layer] = own


@torch.no_grad()
def step_many(lean: LeanDecoder, tokens: list[Tensor], caches: list[KVCache],
              own_seconds: list[float] | None = None) -> tuple[Tensor, Tensor]:
    """One decode step for each of several independent sequences, side by side: ``tokens[n]`` (B_n,) onto
    ``caches[n]`` (each cache with its own policy, length and position). Returns the logits (sum B_n, V)
    and hidden states (sum B_n, D), the caches' rows one after the other.

    Each cache's numbers are exactly those of ``lean.step(tokens[n], caches[n])`` on its own (tested bit
    for bit on CPU): the element-wise work runs once over all rows, the matrix products and the attention
    per cache (see the module docstring).

    ``own_seconds[n]``, if given, gets the time of cache n's attention added (its storage, attention and
    policy hooks: the work that differs between caches); the rest of the step is the same work for every
    row.
    """
    model = lean.model
    if not caches or len(tokens) != len(caches):
        raise ValueError(f"one token tensor per cache: {len(tokens)} token tensors, {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("a cache appears twice: each cache takes one step")
    for cache in caches:
        lean.check_step(cache)
    tokens = [t.view(-1) for t in tokens]
    ids = torch.cat(tokens)                                                            # (R,) all rows
    rows, row_pos, first = [], [], 0                     # each cache's rows; every row's position
    for t, cache in zip(tokens, caches):
        rows.append(slice(first, first + len(t)))
        row_pos += [cache.seen] * len(t)
        first += len(t)
    x = F.embedding(ids, model.tok_emb.weight)                                         # (R, D): one position each
    cos, sin = rope_cos_sin(torch.tensor(row_pos, device=ids.device), lean.inv_freq, x.dtype)   # (R, d) each
    cos, sin = cos[:, None], sin[:, None]                                              # (R, 1, d) each
    pos = [torch.arange(c.seen, c.seen + 1, device=ids.device) for c in caches]       # (1,) per cache

    def linear(t: Tensor, w: Tensor) -> Tensor:          # a product per cache, on its own rows
        return torch.cat([F.linear(t[r], w) for r in rows])

    def attend(i: int, attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:               # (R, H, 1, d)
        outs = []
        for n, (cache, r) in enumerate(zip(caches, rows)):
            t0 = time.perf_counter()
            outs.append(lean.attend(cache, i, attn, q[r], k[r], v[r], pos[n]))
            if own_seconds is not None:
                own_seconds[n] += time.perf_counter() - t0
        return torch.cat(outs)

    logits, h = lean.forward(x, cos, sin, linear, attend)
    for cache in caches:
        cache.seen += 1
    return logits, h
