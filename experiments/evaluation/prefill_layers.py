"""
The prompt's compression, and the question's hooks, with many layers at once, in the fast engines' fill.

A layer's compression changes nothing a later layer's prompt pass reads, so the hooks of the methods in
``METHODS`` wait and one hook takes a run of layers at once, each layer a batch row of one ``LayerKV``
(storage (L, H_kv, T, d), statistics beside it); every operation treats a row on its own, so each layer
gets what its own hook gives it (``tests/experiments/evaluation/test_prefill_layers.py``). What waits is
bounded by ``HELD_BYTES``. How it works: ``inside.md``, "prefill_layers.py".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from methods.h2o import H2OPolicy
from methods.scissorhands import ScissorhandsPolicy
from methods.snapkv import SnapKVPolicy
from methods.streaming_llm import StreamingLLMPolicy
from nanollm.cache import KVCache
from nanollm.policy import CachePolicy, Needs, StepContext
from nanollm.storage import LayerKV

from .protocol import Probe

METHODS = (H2OPolicy, ScissorhandsPolicy, SnapKVPolicy, StreamingLLMPolicy)   # at the prompt
CHUNK_METHODS = (H2OPolicy, ScissorhandsPolicy)     # at the question (SnapKV's hook does nothing there)
HELD_BYTES = 128 << 20      # a run ends at the layer whose storage and statistics bring it to this many bytes
ENABLED = True              # False: every cache runs its hook layer by layer (the tests compare the two)


def waits(cache: KVCache, phase: str = "prefill") -> bool:
    """Whether the cache's hook of ``phase`` is the own hook of one of ``METHODS`` (a prompt) or of
    ``CHUNK_METHODS`` (a later chunk), bare or in a ``Probe`` that only times it."""
    policy = cache.policy
    if isinstance(policy, Probe):
        if policy.recording:
            return False
        policy = policy.inner
    return ENABLED and type(policy) in (METHODS if phase == "prefill" else CHUNK_METHODS)


@dataclass
class Run:
    """Consecutive layers of the prompt pass, waiting for one hook: their storage (the shared pass's, which
    no one changes) and the statistics the waiting caches' ``needs`` ask for."""
    layers: list[int] = field(default_factory=list)
    stores: list[LayerKV] = field(default_factory=list)
    stats: list[tuple[Tensor | None, Tensor | None]] = field(default_factory=list)
    held: int = 0               # bytes: the storage's buffers and the statistics

    def add(self, layer: int, store: LayerKV, stats: tuple[Tensor | None, Tensor | None]) -> None:
        self.layers.append(layer)
        self.stores.append(store)
        self.stats.append(stats)
        self.held += nbytes(store, *stats)


def nbytes(store: LayerKV, *stats: Tensor | None) -> int:
    """What a layer adds to a run: its storage's buffers (which the hook copies) and its statistics."""
    k, v, pos, state = store.buffers()
    return sum(t.nbytes for t in (k, v, pos, *state.values(), *stats) if t is not None)


def stackable(stores: list[LayerKV]) -> bool:
    """Whether the layers' storage can be batch rows of one: one sequence each, as many slots, the same room,
    none emptied, the same per-slot state."""
    first = stores[0]

    def kind(s: LayerKV) -> tuple:
        k, v, pos, state = s.buffers()
        return (s.n, s.fill, *((t.shape, t.dtype) for t in (k, v, pos)),
                {name: (t.shape, t.dtype) for name, t in state.items()})
    return first.k.shape[0] == 1 and all(s.free is None and kind(s) == kind(first) for s in stores)


def stacked(stores: list[LayerKV]) -> LayerKV:
    """A new ``LayerKV`` holding the layers' storage (``stackable``) as batch rows: buffers (L, H_kv,
    capacity, ...), room included, as a copy of each would hold it."""
    first, buffers = stores[0], [s.buffers() for s in stores]
    out = LayerKV()
    out.adopt(*(torch.cat([b[j] for b in buffers]) for j in range(3)),
              {name: torch.cat([b[3][name] for b in buffers]) for name in first.state})
    out.n, out.fill = first.n, dict(first.fill)
    return out


def row(store: LayerKV, j: int) -> LayerKV:
    """Batch row j of ``store``, as a storage of its own that views the row (writes go to the row)."""
    k, v, pos, state = store.buffers()
    out = LayerKV()
    out.adopt(k[j:j + 1], v[j:j + 1], pos[j:j + 1], {name: t[j:j + 1] for name, t in state.items()})
    out.n, out.free = store.n, None if store.free is None else store.free[j:j + 1]
    out.fill = dict(store.fill)
    return out


def over_rows(cache: KVCache, hook, stores: list[LayerKV], layers: list[int], ctx: StepContext, **rows) -> None:
    """``hook`` (the cache's policy's) once over the layers' storage stacked (``stacked``), with ``ctx``'s
    fields every layer shares and the layers' tensors ``rows`` side by side; each layer then views its row."""
    own = stacked(stores)
    hook(replace(ctx, layer=layers[0], attn=None, kv=own, attended_pos=own.pos, **rows))
    for j, layer in enumerate(layers):
        cache.layers[layer] = row(own, j)


def compress(caches: list[KVCache], run: Run, ctx: StepContext) -> None:
    """Each cache's prefill hook over the run's layers at once (``ctx``: the run's last layer's context,
    for the fields every layer shares), without the queries and outputs."""
    if not stackable(run.stores) or run.stores[0].state:
        raise ValueError("a run of the prompt's layers holds one sequence, as many slots in each, no state")
    probs, col_sums = (None if run.stats[0][n] is None else torch.cat([s[n] for s in run.stats]) for n in (0, 1))
    for cache in caches:
        probs_, col_sums_ = (None if t is None else t.clone() for t in (probs, col_sums))   # the cache's own
        over_rows(cache, cache.policy.on_prefill, run.stores, run.layers, ctx, q=None, out=None, probs=probs_,
                  col_sums=col_sums_)


class Later(CachePolicy):
    """A cache's policy while ``extend_many`` passes a chunk (the question) over it: it attends as the
    policy would and keeps each layer's context; when what they hold reaches ``HELD_BYTES``, and after the
    pass (``run``), the policy's hook runs once over the kept layers."""

    def __init__(self, cache: KVCache) -> None:
        self.cache, self.policy, self.contexts, self.held = cache, cache.policy, [], 0

    def needs(self, phase: str) -> Needs:
        return self.policy.needs(phase)

    def attend_kv(self, layer: int, store: LayerKV) -> LayerKV:
        return self.policy.attend_kv(layer, store)

    def on_decode(self, ctx: StepContext) -> None:
        self.contexts.append(ctx)
        self.held += nbytes(ctx.kv, ctx.q, ctx.out, ctx.probs, ctx.col_sums)
        if self.held >= HELD_BYTES:
            self.run()

    def run(self) -> None:
        """The policy's hook over the kept layers: at once where their storage stacks (each layer then views
        its row), else a hook a layer."""
        contexts, stores = self.contexts, [c.kv for c in self.contexts]
        self.contexts, self.held = [], 0
        if len(contexts) < 2 or not stackable(stores):
            for ctx in contexts:
                self.policy.on_decode(ctx)
            return

        def cat(name: str) -> Tensor | None:            # the layers' tensors side by side, as their storage
            return None if getattr(contexts[0], name) is None else torch.cat([getattr(c, name) for c in contexts])
        over_rows(self.cache, self.policy.on_decode, stores, [c.layer for c in contexts], contexts[-1],
                  **{name: cat(name) for name in ("q", "out", "probs", "col_sums")})
