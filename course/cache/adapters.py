"""
The tests' only door into your code for the ``cache`` assignment (as in Stanford CS336's assignments): the
tests call these functions and nothing else. If you move or rename things in the library, change these
functions so they reach your code; never change the tests.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nanollm import KVCache, Transformer, decode_step, extend, prefill, preset
from nanollm.attention import attend_masked, step_probs
from nanollm.storage import LayerKV


def new_storage() -> LayerKV:
    """An empty layer storage."""
    return LayerKV()


def storage_append(store: LayerKV, k: Tensor, v: Tensor, pos: Tensor) -> None:
    """Append k, v (B, H_kv, Tn, d) at positions pos (Tn,)."""
    store.append(k, v, pos)


def storage_contents(store: LayerKV) -> tuple[Tensor, Tensor, Tensor]:
    """The stored (k, v, pos): (B, H_kv, T, d), (B, H_kv, T, d), (B, H_kv, T)."""
    return store.k, store.v, store.pos


def decode_probs(q: Tensor, k: Tensor) -> Tensor:
    """One decode step's attention probabilities: q (B, H, 1, d), k (B, H_kv, Tk, d) -> (B, H_kv, G, Tk)."""
    return step_probs(q, k)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """Attention with the mask built from positions: q (B, H, Tq, d), k, v (B, H_kv, Tk, d), q_pos (Tq,),
    k_pos (B, H_kv, Tk) with -1 for an empty slot. Returns (B, H, Tq, d)."""
    return attend_masked(q, k, v, q_pos, k_pos)[0]


def tiny_model(flavour: str = "llama", seed: int = 0) -> Transformer:
    """A seeded random model in fp32 with peaked attention (weights drawn with std 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(preset("TINY" if flavour == "llama" else "TINY_GPT2"))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.float().eval()


def new_cache(model: Transformer) -> KVCache:
    return KVCache(model.config)


def cache_storage(cache: KVCache, layer: int) -> LayerKV:
    return cache.layers[layer]


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
