"""
The prompt's compression with many layers at once, in the fast engines' shared prompt pass (``FanOut``).

After each layer's attention over the prompt, ``FanOut`` gives every cache its own copy of the layer's
storage and runs that cache's prefill hook: for SmolLM2's 30 layers and a job's 24 compressed caches, 720
hooks of a few dozen small operations each (on a GPU, a kernel launch each). A layer's compression changes
nothing a later layer's prompt pass reads (the prompt's attention is exact, over the uncompressed keys), so
a hook may wait. Here the caches of the methods in ``METHODS`` wait, layer after layer, and then one hook
takes a run of layers at once, each layer a batch row of one ``LayerKV``:

    k, v, pos   the run's layers' storage, side by side   (L, H_kv, T, d), (L, H_kv, T)
    probs       their statistics (the rows or the column sums the method needs), side by side

The method's own ``on_prefill`` runs over those rows (H2O: its scores, then each head's top ``budget``;
SnapKV: the window's votes; Scissorhands: its low flags; StreamingLLM: the sinks and the recent window).
Every operation there treats a batch row on its own, and every layer holds as many slots (the whole prompt)
and keeps as many, so each layer gets the entries, state and buffers its own hook gives it, to the last bit
(``tests/methods/evaluation/test_prefill_layers.py`` compares the storage and the records). Each layer's
storage then views its row of the run's buffers.

The statistics wait with the layers: a run ends at the last layer or when what it holds (each layer's
storage and statistics, which the hook copies) reaches ``HELD_BYTES``, so a method that reads many rows
(Scissorhands' 400) takes a few layers a run, and a long prompt fewer. The run's context has ``layer`` set
to its first layer and ``q``, ``out`` and ``attn`` set to None: these methods read none of them at prefill
(StreamingLLM drops a layer's ring of slots when it compacts, and a new cache has none), and a method that
did would fail rather than read one layer's. Any other cache (the wrappers, whose kept slots are padded to
the longest head of the whole batch; KVReviver; a ``Probe`` that records) runs its hook layer by layer.
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
from nanollm.policy import Needs, StepContext
from nanollm.storage import LayerKV

from .protocol import Probe

METHODS = (H2OPolicy, ScissorhandsPolicy, SnapKVPolicy, StreamingLLMPolicy)
HELD_BYTES = 128 << 20      # what a run holds before its hook runs: the layers' storage and statistics
ENABLED = True              # False: every cache runs its hook layer by layer (the tests compare the two)


def waits(cache: KVCache) -> bool:
    """Whether the cache's prefill hook is one of ``METHODS``' own, bare or in a ``Probe`` that times it only."""
    policy = cache.policy
    if isinstance(policy, Probe):
        if policy.recording:
            return False
        policy = policy.inner
    return ENABLED and type(policy) in METHODS


@dataclass
class Run:
    """Consecutive layers of the prompt pass, waiting for one hook: their storage (the shared pass's, which
    no one changes) and the statistics ``needs`` asks for."""
    needs: Needs
    layers: list[int] = field(default_factory=list)
    stores: list[LayerKV] = field(default_factory=list)
    stats: list[tuple[Tensor | None, Tensor | None]] = field(default_factory=list)
    held: int = 0               # bytes: the storage's buffers and the statistics

    def add(self, layer: int, store: LayerKV, stats: tuple[Tensor | None, Tensor | None]) -> None:
        self.layers.append(layer)
        self.stores.append(store)
        self.stats.append(stats)
        self.held += sum(t.nbytes for t in (store._k, store._v, store._pos, *stats) if t is not None)


def stacked(stores: list[LayerKV]) -> LayerKV:
    """A new ``LayerKV`` holding the layers' storage as batch rows: buffers (L, H_kv, capacity, ...), room
    included, as a copy of each would hold it."""
    first = stores[0]
    if any(s._k.shape[0] != 1 or s.n != first.n or s.capacity() != first.capacity() or s.free is not None
           or s._state for s in stores):
        raise ValueError("a run of layers needs one sequence, as many slots in each, none emptied, no state")
    out = LayerKV()
    out._k, out._v, out._pos = (torch.cat([getattr(s, name) for s in stores]) for name in ("_k", "_v", "_pos"))
    out.n = first.n
    return out


def row(store: LayerKV, j: int) -> LayerKV:
    """Batch row j of ``store``, as a storage of its own that views the row (writes go to the row)."""
    out = LayerKV()
    out._k, out._v, out._pos = store._k[j:j + 1], store._v[j:j + 1], store._pos[j:j + 1]
    out.n, out.free = store.n, None if store.free is None else store.free[j:j + 1]
    out._state = {name: t[j:j + 1] for name, t in store._state.items()}
    out.fill = dict(store.fill)
    return out


def compress(caches: list[KVCache], run: Run, ctx: StepContext) -> None:
    """Each cache's prefill hook over the run's layers at once (``ctx``: the run's last layer's context,
    for the fields every layer shares); each layer of the cache then views its row."""
    probs, col_sums = (None if run.stats[0][n] is None else torch.cat([s[n] for s in run.stats]) for n in (0, 1))
    for cache in caches:
        own = stacked(run.stores)
        cache.policy.on_prefill(replace(
            ctx, layer=run.layers[0], q=None, out=None, attn=None, kv=own, attended_pos=own.pos,
            probs=None if probs is None else probs.clone(), col_sums=None if col_sums is None else col_sums.clone()))
        for j, layer in enumerate(run.layers):
            cache.layers[layer] = row(own, j)
