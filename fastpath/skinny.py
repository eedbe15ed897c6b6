"""
The fused step with its matrix products in the skinny kernel: a layer in six launches instead of fourteen.

``SkinnyGraphDecoder`` runs each product of a layer as one launch of ``kernels/skinny_matmul.py`` (the weight
read once for the step's few rows) that takes in the small operations around it (a norm, SwiGLU, a residual
add); the q/k/v product (``kernels/skinny_qkv.py``) also applies RoPE and writes k, v into the buffers. Where the
kernels do not serve (a CPU, ``NANOKV_NO_TRITON=1``) and for fp16 models, it is the fused step, unchanged.
Each product's launch is the one ``tune.tune_skinny`` chose, else the kernel's default. Logits equal the lean
step's to float rounding (``tests/fastpath/test_skinny.py``).

    skinny = SkinnyGraphDecoder(model)                   # as FusedGraphDecoder
    skinny.start(cache, max_new_tokens=32)
    logits = skinny.step(token)

How it works: fastpath/inside.md, section "skinny.py: the matrix products in kernels for a few rows".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

import kernels
from kernels.skinny_matmul import linear_add_triton, norm_linear_triton, norm_swiglu_triton
from kernels.skinny_qkv import norm_qkv_rope_write_triton
from nanollm.attention import rope_cos_sin
from nanollm.model import Transformer

from .fused import FusedGraphDecoder


def kernels_serve(model: Transformer) -> bool:
    """Whether the skinny step runs its kernels for ``model``: where ``kernels.serves`` its weights, and not in
    fp16, where the kernel's folded norm could overflow (elsewhere it is the fused step)."""
    w = model.tok_emb.weight
    return kernels.serves(w) and w.dtype != torch.float16


class SkinnyGraphDecoder(FusedGraphDecoder):
    """``FusedGraphDecoder`` whose products are the skinny kernel's where ``kernels.serves`` says so."""

    def decode(self, token: Tensor) -> Tensor:
        """``FusedGraphDecoder.decode`` with the products in the skinny kernel: logits (B, V), ``self.kv``
        updated in place."""
        if not kernels_serve(self.model):
            return super().decode(token)
        kv = self.current.kv
        x = F.embedding(token, self.model.tok_emb.weight)                             # (B, D)
        cos, sin = rope_cos_sin(kv.position, self.lean.inv_freq, x.dtype)            # (1, d) each
        for i, (norm1, wqkv, wo, norm2, wgu, wd, attn) in enumerate(self.lean.layers):
            q = norm_qkv_rope_write_triton(x, norm1.weight, norm1.eps, wqkv, cos, sin, kv.k[i], kv.v[i], kv.pos[i],
                                           kv.slot[i], kv.position)                  # (B, H, d), k and v written
            y = self._attend_written(i, attn, q[:, :, None]).reshape(x.shape[0], -1)  # (B, H*d)
            x = linear_add_triton(y, wo, x)                                          # x + o_proj(y)
            x = linear_add_triton(norm_swiglu_triton(x, norm2.weight, norm2.eps, wgu), wd, x)
        norm = self.model.final_norm
        logits = norm_linear_triton(x, norm.weight, norm.eps, self.model.lm_head.weight)   # (B, V)
        self.advance(kv)
        return logits
