"""
ChunkKV's observation behind layer-wise index reuse (Liu et al., NeurIPS 2025, arXiv 2502.00299, §3.3): the
positions adjacent layers keep are similar, so one layer's selection can serve the next. These functions
measure it on any cache: the kept positions per layer, and the Jaccard similarity of adjacent layers'.
"""

from __future__ import annotations

from torch import Tensor

from nanollm.cache import KVCache


def kept_positions(cache: KVCache) -> list[Tensor]:
    """Per layer, the positions batch row 0 keeps: a list of (H_kv, K) tensors (-1 = empty slot)."""
    return [layer.pos[0].clone() for layer in cache.layers]


def jaccard(a: Tensor, b: Tensor, below: int | None = None) -> float:
    """|a ∩ b| / |a ∪ b| of two sets of positions (-1 entries ignored; only positions < ``below`` if given,
    e.g. to leave out a window every layer keeps anyway)."""
    a, b = set(a[a >= 0].tolist()), set(b[b >= 0].tolist())
    if below is not None:
        a, b = {p for p in a if p < below}, {p for p in b if p < below}
    return len(a & b) / max(1, len(a | b))


def adjacent_layer_jaccard(kept: list[Tensor], below: int | None = None) -> list[float]:
    """Jaccard similarity of the kept positions of layers l and l+1, averaged over KV heads (head h of one
    layer against head h of the next); one value per adjacent pair. ``below`` as in ``jaccard``."""
    return [sum(jaccard(a[h], b[h], below) for h in range(a.shape[0])) / a.shape[0]
            for a, b in zip(kept, kept[1:])]
