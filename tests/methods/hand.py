"""A step's context by hand: what the methods' tests give a policy's hooks instead of a model's attention."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nanollm.policy import StepContext
from nanollm.storage import LayerKV


def hand_ctx(probs: torch.Tensor, kv: LayerKV | None = None, n_kv_head: int = 1, seen: int | None = None,
             v: torch.Tensor | None = None, w_o: torch.Tensor | None = None) -> StepContext:
    """A ``StepContext`` around hand-made probabilities probs (B, H, Tn, T), a prefill when Tn == T, else a
    step of Tn queries ending at ``seen`` (T by default). The storage: ``kv``, or a fresh ``LayerKV`` at
    positions 0..T-1 with random keys and values of 2 dims, or zero keys and the values ``v`` (B, H_kv, T, d).
    ``w_o`` (D, H * d): an attention module that holds only W_O (CriticalKV reads it)."""
    B, H, Tn, T = probs.shape
    d = 2 if v is None else v.shape[-1]
    if kv is None:
        kv = LayerKV()
        if v is None:
            kv.append(torch.randn(B, n_kv_head, T, 2), torch.randn(B, n_kv_head, T, 2), torch.arange(T))
        else:
            kv.append(torch.zeros_like(v), v, torch.arange(T))
    seen = T if seen is None else seen
    attn = None if w_o is None else SimpleNamespace(o_proj=SimpleNamespace(weight=w_o))
    return StepContext(layer=0, phase="prefill" if Tn == T else "decode", q=torch.zeros(B, H, Tn, d),
                       q_pos=torch.arange(seen - Tn, seen), probs=probs, out=torch.zeros(B, H, Tn, d),
                       kv=kv, attn=attn, config=None, seen=seen, col_sums=probs.float().sum(dim=2))
