"""The adapters of the ``tensor_attention`` assignment, the functions its tests call: see course/model_adapters.py."""

from __future__ import annotations

import torch
from torch import Tensor

from course.model_adapters import run_decode, run_prefill, uncached_logits  # noqa: F401  (for the tests)
from methods.tensor_attention import (
    TENSOR_ATTENTION,
    factored_output,
    four_cache_attention,
    pair_scores,
    pair_softmax,
    tensor_cache,
)
from nanollm import KVCache, Transformer, preset


def scores(q: Tensor, K1: Tensor, K2: Tensor, scale: float) -> Tensor:
    """(..., Tq, n1, n2): scale * <q_t, K1[a] * K2[b]>."""
    return pair_scores(q, K1, K2, scale)


def softmax_over_pairs(S: Tensor, allowed: Tensor | None = None) -> Tensor:
    return pair_softmax(S, allowed)


def output(P: Tensor, V1: Tensor, V2: Tensor) -> Tensor:
    """(..., Tq, d): sum over pairs of P[t, a, b] V1[a] * V2[b]."""
    return factored_output(P, V1, V2)


def attention(q: Tensor, K1: Tensor, K2: Tensor, V1: Tensor, V2: Tensor, scale: float,
              allowed: Tensor | None = None) -> Tensor:
    """Tensor attention from the four factor matrices."""
    return four_cache_attention(q, K1, K2, V1, V2, scale, allowed)


def tiny_tensor_model(seed: int = 0) -> Transformer:
    """A seeded random tensor-attention decoder (GPT-2 flavour, 2 layers, 4 heads), weights with std 0.1."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(preset("TINY_GPT2", attention=TENSOR_ATTENTION, max_seq_len=64))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.float().eval()


def new_tensor_cache(model: Transformer, layout: str) -> KVCache:
    """An empty cache with the "four" (factored) or "two" (pair rows) layout."""
    return tensor_cache(model.config, layout)
