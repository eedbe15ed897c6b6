"""
Tensor attention's decode step on the Triton kernel: ``tensor_cache(config)`` is the library's four-matrix cache
(``methods.tensor_attention.tensor_cache``) whose unmasked decode steps go through
``kernels/tensor_decode.py`` wherever ``kernels.serves`` says a kernel runs (a CUDA tensor of a recent GPU);
elsewhere, or for a dtype or a graph the kernel does not take, the library's PyTorch path computes the step.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels
from kernels.tensor_decode import tensor_decode_triton
from methods.tensor_attention import tensor_cache as library_tensor_cache
from nanollm.cache import KVCache
from nanollm.config import ModelConfig


def kernel_step(q: Tensor, k1: Tensor, k2: Tensor, v1: Tensor, v2: Tensor, scale: float) -> Tensor | None:
    """q (B, H, d) and the factors (B, H, n, d) -> the step's output (B, H, d) from the kernel, or None where
    it does not serve (the cache then attends in PyTorch)."""
    if (q.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and not (torch.is_grad_enabled() and q.requires_grad) and kernels.serves(q)):
        return tensor_decode_triton(q, k1, k2, v1, v2, scale)
    return None


def tensor_cache(config: ModelConfig) -> KVCache:
    """An empty factored four-matrix cache whose decode steps run on the kernel where it serves."""
    return library_tensor_cache(config, "four", decode_step=kernel_step)
