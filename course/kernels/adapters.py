"""The adapters of the ``kernels`` assignment, the functions its tests call: see course/model_adapters.py."""

from __future__ import annotations

from torch import Tensor

from kernels.decode_attention import decode_attention_triton, merge_splits, selected_decode_attention_triton


def merge(m: Tensor, l: Tensor, acc: Tensor) -> Tensor:
    """Combine per-range partials: m, l (R, splits, G), acc (R, splits, G, d) -> (R, G, d)."""
    return merge_splits(m, l, acc)


def decode(q: Tensor, k: Tensor, v: Tensor, block_n: int, splits: int) -> Tensor:
    """The split-K kernel: q (B, H, d), k, v (B, H_kv, S, d) -> (B, H, d)."""
    return decode_attention_triton(q, k, v, block_n=block_n, splits=splits)


def decode_selected(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, block_n: int, splits: int) -> Tensor:
    """The kernel over the rows idx (B, H_kv, K) of each KV head (-1: padding)."""
    return selected_decode_attention_triton(q, k, v, idx, block_n=block_n, splits=splits)
