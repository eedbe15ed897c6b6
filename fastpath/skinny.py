"""
The fused step with its matrix products in the skinny kernel: a layer in six launches instead of fourteen.

What the fused step (``fused.py``) leaves of a step's fixed cost is mostly its matrix products and the small
kernels beside them. Per layer, on an H200 (``results/decode_profile_h200.txt``): the norm before the q/k/v
product and before the gate/up product, the q/k/v, o, gate/up and down products (cuBLAS's, one of them split
along K and followed by a reduction), the residual copied before each product that adds it, SiLU-times-up,
RoPE, the write, the split attention and its merge: 14 launches. ``kernels/skinny_matmul.py`` reads each
weight once for the step's few rows and takes in what surrounds it, so a layer becomes

    norm_qkv_rope_write   x -> q; k, v into the buffers   the norm, RoPE and the cache's write folded into the
                                                          product (``kernels/skinny_qkv.py``)
    the split attention and its merge                     as in the fused step (and its evictions' kernels)
    linear_add            x + o_proj(y)                   the residual added in the product's epilogue
    norm_swiglu           x -> silu(gate) * up            the norm and SiLU-times-up around the gate/up product
    linear_add            x + down(...)

and the LM head is ``norm_linear`` with the final norm. Everything else is the fused step's, captured and
replayed as the graph step is. Where the kernels do not serve (a CPU, ``NANOKV_NO_TRITON=1``), and for an fp16
model (``kernels/skinny_matmul.py`` says why), the step is the fused step's, unchanged. The logits equal the
lean step's to float rounding: fp32 within 1e-5 (the tests route the kernels through Triton's interpreter on a
CPU); bf16 within ``BF16_TOL``, as the fused step's (the kernel rounds in other places:
``kernels/skinny_matmul.py``).

Each product's launch (columns per program, the step along K, warps, stages) is the one ``fastpath.tune``'s
``tune_skinny`` timed fastest on the step's shapes, else the kernel's default; ``python -m fastpath.bench
--e2e`` tunes before it times the ``skinny`` path, and records the products' times beside cuBLAS's.

    skinny = SkinnyGraphDecoder(model)                   # as FusedGraphDecoder
    skinny.start(cache, max_new_tokens=32)
    logits = skinny.step(token)
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
