"""
The adapters: the tests' only door into a student's code (as in Stanford CS336's assignments). The tests
call the functions of their assignment's ``course/<name>/adapters.py`` and nothing else; if you move or
rename things in the library, change the adapters so they reach your code, never the tests.

This file holds the adapters every assignment shares: a tiny model, a cache run by a method, prefill /
extend / decode, and the uncached forward pass the tests use as their oracle. Each ``adapters.py``
imports what it needs from here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from methods import make_policy
from nanollm import KVCache, Transformer, decode_step, extend, prefill, preset
from nanollm.storage import LayerKV


def tiny_model(flavour: str = "llama", seed: int = 0) -> Transformer:
    """A seeded random model in fp32 (TINY: 2 layers, 4 query heads over 2 KV heads in the Llama flavour)
    with peaked attention: weight matrices drawn with std 0.1."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(preset("TINY" if flavour == "llama" else "TINY_GPT2"))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.float().eval()


def new_cache(model: Transformer, method: str | None = None, budget: int = 0, **options) -> KVCache:
    """A plain cache, or one run by the named method (a name of ``methods.METHODS``) at ``budget``."""
    return KVCache(model.config, None if method is None else make_policy(method, budget, **options))


def new_storage() -> LayerKV:
    """An empty layer storage."""
    return LayerKV()


def storage_append(store: LayerKV, k: Tensor, v: Tensor, pos: Tensor) -> None:
    """Append k, v (B, H_kv, Tn, d) at positions pos (Tn,)."""
    store.append(k, v, pos)


def storage_contents(store: LayerKV) -> tuple[Tensor, Tensor, Tensor]:
    """The stored (k, v, pos): (B, H_kv, T, d), (B, H_kv, T, d), (B, H_kv, T)."""
    return store.k, store.v, store.pos


def kept_positions(cache: KVCache, layer: int) -> Tensor:
    """Positions a layer holds (B, H_kv, T); -1 = empty slot."""
    return cache.layers[layer].pos


def run_prefill(model: Transformer, ids: Tensor, cache: KVCache) -> Tensor:
    """Logits (B, T, V) of the prompt, filling the cache."""
    return prefill(model, ids, cache)


def run_extend(model: Transformer, ids: Tensor, cache: KVCache) -> Tensor:
    """Logits (B, Tn, V) of a chunk appended to the cache."""
    return extend(model, ids, cache)


def run_decode(model: Transformer, token: Tensor, cache: KVCache) -> Tensor:
    """Next-token logits (B, V) after feeding token (B,)."""
    return decode_step(model, token, cache)


@torch.no_grad()
def uncached_logits(model: Transformer, ids: Tensor) -> Tensor:
    """The oracle: one forward pass over the whole sequence without a cache (B, T, V)."""
    return model(ids)
