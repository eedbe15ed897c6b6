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

# The library is imported inside each function, when a test first needs it: a student file that does not
# import then fails only the tests that use it, and an assignment's adapters can re-export these at their top.


def tiny_model(flavour: str = "llama", seed: int = 0):
    """A seeded random model in fp32 (TINY: 2 layers, 4 query heads over 2 KV heads in the Llama flavour)
    with peaked attention: weight matrices drawn with std 0.1."""
    from nanollm import Transformer, preset
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(preset("TINY" if flavour == "llama" else "TINY_GPT2"))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.float().eval()


def new_cache(model, method: str | None = None, budget: int = 0, **options):
    """A plain cache, or one run by the named method (a name of ``methods.METHODS``) at ``budget``."""
    from methods import make_policy
    from nanollm import KVCache
    return KVCache(model.config, None if method is None else make_policy(method, budget, **options))


def new_storage():
    """An empty layer storage."""
    from nanollm.storage import LayerKV
    return LayerKV()


def storage_append(store, k: Tensor, v: Tensor, pos: Tensor) -> None:
    """Append k, v (B, H_kv, Tn, d) at positions pos (Tn,)."""
    store.append(k, v, pos)


def storage_contents(store) -> tuple[Tensor, Tensor, Tensor]:
    """The stored (k, v, pos): (B, H_kv, T, d), (B, H_kv, T, d), (B, H_kv, T)."""
    return store.k, store.v, store.pos


def kept_positions(cache, layer: int) -> Tensor:
    """Positions a layer holds (B, H_kv, T); -1 = empty slot."""
    return cache.layers[layer].pos


def run_prefill(model, ids: Tensor, cache) -> Tensor:
    """Logits (B, T, V) of the prompt, filling the cache."""
    from nanollm import prefill
    return prefill(model, ids, cache)


def run_extend(model, ids: Tensor, cache) -> Tensor:
    """Logits (B, Tn, V) of a chunk appended to the cache."""
    from nanollm import extend
    return extend(model, ids, cache)


def run_decode(model, token: Tensor, cache) -> Tensor:
    """Next-token logits (B, V) after feeding token (B,)."""
    from nanollm import decode_step
    return decode_step(model, token, cache)


@torch.no_grad()
def uncached_logits(model, ids: Tensor) -> Tensor:
    """The oracle: one forward pass over the whole sequence without a cache (B, T, V)."""
    return model(ids)
