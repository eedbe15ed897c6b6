"""The adapters of the ``baselines`` assignment: the functions its tests call (see course/model_adapters.py).

Each imports the library module it needs when called, through ``method``, which skips
``methods/__init__.py`` (it imports every method): a file that does not import fails only the tasks that
use it. So nothing here goes through ``methods.make_policy``; the policies are built from their classes.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import SimpleNamespace

import torch
from torch import Tensor

from course.model_adapters import (  # noqa: F401  (re-exported for the tests)
    kept_positions,
    run_decode,
    run_extend,
    run_prefill,
    uncached_logits,
)


def method(name: str):
    """The module ``methods.<name>`` of the copy, imported without running ``methods/__init__.py``."""
    if "methods" not in sys.modules:
        spec = importlib.util.find_spec("methods")
        sys.modules["methods"] = importlib.util.module_from_spec(spec)      # the package, its __init__ not run
    return importlib.import_module(f"methods.{name}")


# -- the model, a cache, prefill and decode (only nanollm) -----------------------------------------------

def tiny_model(seed: int = 0):
    """A seeded random TINY Llama in fp32 (2 layers, 4 query heads over 2 KV heads), weights of std 0.1 so
    that attention is peaked (as course/model_adapters.py's)."""
    from nanollm import Transformer, preset
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(preset("TINY"))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.float().eval()


def new_cache(model, policy=None):
    """A cache run by ``policy`` (None: keep everything)."""
    from nanollm import KVCache
    return KVCache(model.config, policy)


def new_storage(k: Tensor, v: Tensor, pos: Tensor):
    """A layer's storage holding k, v (B, H_kv, T, d) at positions pos (T,)."""
    from nanollm.storage import LayerKV
    store = LayerKV()
    store.append(k, v, pos)
    return store


def storage_append(store, k: Tensor, v: Tensor, pos: Tensor) -> None:
    """Append k, v (B, H_kv, Tn, d) at positions pos (Tn,)."""
    store.append(k, v, pos)


def storage_positions(store) -> Tensor:
    """The positions a storage holds (B, H_kv, T); -1 = empty slot."""
    return store.pos


def received_by_step(model, ids: Tensor, chunks: list[int]) -> list[list[Tensor]]:
    """Per layer, the attention each slot received at each step, (B, H, T) summed over the step's queries, with
    nothing evicted: a prompt of ``chunks[0]`` tokens of ``ids``, then a step per further chunk (1 token: a
    decode step; more: an extend). Recorded by a policy that keeps everything (no code of the assignment)."""
    from nanollm.policy import CachePolicy, Needs

    class Record(CachePolicy):
        def __init__(self):
            self.sums = {}

        def needs(self, phase):
            return Needs(col_sums=True)

        def on_prefill(self, ctx):
            self.sums.setdefault(ctx.layer, []).append(ctx.col_sums.clone())

        on_decode = on_prefill

    record = Record()
    cache = new_cache(model, record)
    run_prefill(model, ids[:, :chunks[0]], cache)
    seen = chunks[0]
    for chunk in chunks[1:]:
        if chunk == 1:
            run_decode(model, ids[:, seen], cache)
        else:
            run_extend(model, ids[:, seen:seen + chunk], cache)
        seen += chunk
    return [record.sums[layer] for layer in range(model.config.n_layer)]


# -- StreamingLLM ---------------------------------------------------------------------------------------

def streaming_ranges(budget: int, n_sink: int, seen: int) -> list[range]:
    """The position ranges StreamingLLM protects after ``seen`` tokens (sinks, recent window)."""
    return list(method("streaming_llm").sinks_and_recent(budget, n_sink, seen))


def streaming_mask(pos: Tensor, seen: int, budget: int, n_sink: int) -> Tensor:
    """(B, H_kv, T) bool: the slots StreamingLLM keeps (pos (B, H_kv, T), -1 = empty slot)."""
    policy = method("streaming_llm").StreamingLLMPolicy(budget, n_sink)
    return policy.rank(torch.zeros(pos.shape), pos, seen) == float("inf")


def streaming_policy(budget: int, n_sink: int):
    return method("streaming_llm").StreamingLLMPolicy(budget, n_sink)


# -- H2O ------------------------------------------------------------------------------------------------

def h2o_policy(budget: int, n_recent: int | None = None):
    return method("h2o").H2OPolicy(budget, n_recent)


def h2o_scores(store) -> Tensor:
    """H2O's accumulated scores (B, H_kv, T) of a layer's storage (a cache's ``cache.layers[l]``)."""
    return store.state[method("h2o").STATE]


def h2o_observe(policy, store, col_sums: Tensor, phase: str, seen: int) -> Tensor:
    """Let H2O observe one step's attention (col_sums (B, H, T): attention each slot received, summed over
    the step's queries), nothing evicted; return its per-slot scores (B, H_kv, T) afterwards."""
    policy.observe(SimpleNamespace(col_sums=col_sums, kv=store, phase=phase, seen=seen))
    return h2o_scores(store)


def h2o_step(policy, store, col_sums: Tensor, phase: str, seen: int, n_new: int = 1) -> None:
    """One step of H2O as the cache runs it, for ``n_new`` new tokens: observe the step's attention, then evict
    down to the budget."""
    ctx = SimpleNamespace(col_sums=col_sums, kv=store, phase=phase, seen=seen, q=col_sums.new_empty(0, 0, n_new, 0))
    (policy.on_prefill if phase == "prefill" else policy.on_decode)(ctx)


# -- SnapKV ---------------------------------------------------------------------------------------------

def snapkv_pool(x: Tensor, kernel: int, pooling: str) -> Tensor:
    """SnapKV's stride-1 pooling along the last axis (..., T) -> (..., T)."""
    return method("snapkv").pool1d(x, kernel, pooling)


def snapkv_vote(probs_window: Tensor, n_kv_head: int, kernel: int, pooling: str) -> Tensor:
    """SnapKV's pooled votes (B, H_kv, Tp) from the window's attention (B, H, w, Tp)."""
    return method("snapkv").window_vote(probs_window, n_kv_head, kernel, pooling)


def snapkv_scores(probs: Tensor, n_kv_head: int, window: int, kernel: int, pooling: str) -> Tensor:
    """SnapKV's scores (B, H_kv, T) from the prompt's last rows of attention (B, H, R, T)."""
    return method("snapkv").snapkv_scores(probs, n_kv_head, window, kernel, pooling)


def snapkv_select(probs: Tensor, n_kv_head: int, budget: int, window: int, kernel: int, pooling: str) -> Tensor:
    """The positions SnapKV keeps (B, H_kv, K), ascending, after a prompt of T tokens at positions 0..T-1
    whose last rows of attention are probs (B, H, R, T): its prefill hook on a storage of the prompt."""
    B, H, R, T = probs.shape
    store = new_storage(torch.zeros(B, n_kv_head, T, 2), torch.zeros(B, n_kv_head, T, 2), torch.arange(T))
    policy = method("snapkv").SnapKVPolicy(budget, window, kernel, pooling)
    policy.on_prefill(SimpleNamespace(probs=probs, kv=store, phase="prefill", seen=T, col_sums=None))
    return store.pos


# -- AdaKV ----------------------------------------------------------------------------------------------

def adakv_mask(scores: Tensor, budget: int, n_safe: int) -> Tensor:
    """(B, H_kv, T) bool: the (head, slot) pairs AdaKV keeps."""
    return method("adakv").adaptive_keep_mask(scores, budget, n_safe)
