"""What a storage holds, whatever slots it sits in: methods that evict while decoding reuse the emptied slots,
so two caches holding the same entries may order them differently."""

from __future__ import annotations

import torch


def held(pos: torch.Tensor) -> list:
    """pos (B, H_kv, T) -> per row and KV head, the positions held, ascending (empty slots left out)."""
    return [[sorted(p[p >= 0].tolist()) for p in row] for row in pos]


def by_position(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v, pos of a storage whose heads hold the same number of entries, each head's in position order
    (B, H_kv, K, ...), empty slots left out."""
    pos = layer.pos
    K = int((pos >= 0).sum(-1).max())
    order = pos.masked_fill(pos < 0, torch.iinfo(pos.dtype).max).argsort(dim=-1)[..., :K]    # (B, H_kv, K)
    take = lambda t: t.gather(2, order.view(*order.shape, *[1] * (t.dim() - 3)).expand(-1, -1, -1, *t.shape[3:]))  # noqa: E731
    return take(layer.k), take(layer.v), take(pos)
