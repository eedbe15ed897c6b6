"""The adapters of the ``cache`` assignment: the tests' only door into your code (see course/model_adapters.py).
If you move or rename things in the library, change these functions so they reach your code.

Each adapter imports the library module it needs when it is called, so a file of yours that fails to import
fails only the tasks that use it: ``append`` lives in nanollm/storage.py, ``group_scores`` and ``mask`` in
nanollm/attention.py (which imports storage.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from contextlib import contextmanager

import torch
from torch import Tensor


def nanollm(name: str):
    """The copy's module ``nanollm.<name>``. If the package does not import (a mistake in another of its files),
    the module is imported with the package's ``__init__`` skipped: only what it imports itself must work."""
    try:
        return importlib.import_module(f"nanollm.{name}")
    except Exception:
        if "nanollm" in sys.modules or (spec := importlib.util.find_spec("nanollm")) is None:
            raise
        sys.modules["nanollm"] = importlib.util.module_from_spec(spec)       # the package, its __init__ not run
        return importlib.import_module(f"nanollm.{name}")


# -- task append: the storage (nanollm/storage.py) --------------------------------------------------------

def new_storage():
    """An empty layer storage (``LayerKV``)."""
    return nanollm("storage").LayerKV()


def storage_append(store, k: Tensor, v: Tensor, pos: Tensor) -> None:
    """Append k (B, H_kv, Tn, d), v (B, H_kv, Tn, dv) at positions pos (Tn,)."""
    store.append(k, v, pos)


def storage_contents(store) -> tuple[Tensor, Tensor, Tensor]:
    """The stored (k, v, pos): (B, H_kv, T, d), (B, H_kv, T, dv), (B, H_kv, T); T = the slots in use."""
    return store.k, store.v, store.pos


def storage_room_positions(store) -> Tensor:
    """The positions in the buffers' room, past the slots in use (B, H_kv, capacity - T)."""
    return store._pos[:, :, len(store):]


def storage_capacity(store) -> int:
    """Slots the buffers hold, in use or not."""
    return store.capacity()


def storage_keep(store, idx: Tensor) -> None:
    """Keep the slots idx (B, H_kv, K) of each head, in that order; -1 makes an empty slot (not your code)."""
    store.keep(idx)


def storage_set_state(store, name: str, values: Tensor, fill: float) -> None:
    """Per-slot numbers (B, H_kv, T, ...) kept beside the entries; slots added later start at ``fill``."""
    store.set_state(name, values, fill)


def storage_state(store, name: str) -> Tensor:
    return store.state[name]


def tiny_model(flavour: str = "llama", seed: int = 0):
    """A seeded random model in fp32 (TINY: 2 layers, 4 query heads over 2 KV heads in the Llama flavour; TINY_GPT2:
    multi-head), weight matrices drawn with std 0.1."""
    gen = torch.Generator().manual_seed(seed)
    model = nanollm("model").Transformer(nanollm("config").preset("TINY" if flavour == "llama" else "TINY_GPT2"))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.float().eval()


def new_cache(model):
    """An empty plain cache (no policy) for ``model``."""
    return nanollm("cache").KVCache(model.config)


def layer_storage(cache, layer: int):
    """Layer ``layer``'s storage in the cache (what ``new_storage`` makes)."""
    return cache.layers[layer]


def kept_positions(cache, layer: int) -> Tensor:
    """Positions layer ``layer`` holds (B, H_kv, T)."""
    return cache.layers[layer].pos


def run_prefill(model, ids: Tensor, cache) -> Tensor:
    """Logits (B, T, V) of the prompt, filling the cache."""
    return nanollm("generation").prefill(model, ids, cache)


def run_extend(model, ids: Tensor, cache) -> Tensor:
    """Logits (B, Tn, V) of a chunk appended to the cache."""
    return nanollm("generation").extend(model, ids, cache)


def run_decode(model, token: Tensor, cache) -> Tensor:
    """Next-token logits (B, V) after feeding token (B,)."""
    return nanollm("generation").decode_step(model, token, cache)


@torch.no_grad()
def uncached_logits(model, ids: Tensor) -> Tensor:
    """One forward pass over the whole sequence without a cache (B, T, V): it never touches the cache."""
    return model(ids)


@contextmanager
def attention_over_entries(fn):
    """Within: the decoder's attention over stored entries (every step after the prompt) is ``fn(q, k, v, q_pos,
    k_pos) -> out`` (B, H, Tq, d), the tests' own, so decoding grades the storage alone."""
    attention = nanollm("attention")
    saved = attention.attend
    attention.attend = lambda q, k, v, q_pos, k_pos, needs=None, chunk=None: (fn(q, k, v, q_pos, k_pos), None, None)
    try:
        yield
    finally:
        attention.attend = saved


# -- tasks group_scores and mask: the attention (nanollm/attention.py) ------------------------------------

def scores(q: Tensor, k: Tensor) -> Tensor:
    """q k^T / sqrt(d) per KV head: q (B, H, C, d), k (B, H_kv, T, d) -> (B, H_kv, G, C, T)."""
    return nanollm("attention").group_scores(q, k)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, group_scores,
                     chunk: int | None = None, rows: int = 0) -> tuple[Tensor, Tensor | None]:
    """``attend`` with the mask built from positions, its scores from ``group_scores`` (the tests' own, so the
    mask is graded alone): q (B, H, Tq, d), k, v (B, H_kv, Tk, d), q_pos (Tq,), k_pos (B, H_kv, Tk) with -1 for an
    empty slot; queries in chunks of ``chunk``. Returns out (B, H, Tq, d) and the probabilities of the last
    ``rows`` queries (B, H, rows, Tk), or None when rows is 0."""
    attention, policy = nanollm("attention"), nanollm("policy")
    saved = attention.group_scores
    attention.group_scores = group_scores
    try:
        out, probs, _ = attention.attend(q, k, v, q_pos, k_pos, policy.Needs(rows=rows), chunk=chunk)
    finally:
        attention.group_scores = saved
    return out, probs
