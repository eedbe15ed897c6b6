"""
The graph step with its small operations fused: what is left of a step's fixed cost.

``FusedGraphDecoder`` compiles the element-wise work between a layer's matrix products with ``torch.compile``
(inductor), one function before the attention and one after it; a layer's write into the buffers is one Triton
launch (``kernels/cache_write.py``), and H2O's, Scissorhands' and StreamingLLM's attention and eviction run on
kernels of their own where ``kernels.serves`` says so. The whole step is captured and replayed as
``GraphDecoder`` does it. Logits equal the lean step's to float rounding (``tests/fastpath/test_fused.py``).

    fused = FusedGraphDecoder(model)                     # as GraphDecoder; backend=None is inductor
    fused.start(cache, max_new_tokens=32)
    logits = fused.step(token)

How it works: fastpath/inside.md, section "fused.py: the small operations fused".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

import kernels
from kernels.cache_write import write_entry_triton
from kernels.heavy_hitters import heavy_attend_triton
from kernels.scissorhands import scissors_attend_triton
from kernels.streaming import sinks_attend_triton
from nanollm.attention import apply_rope, rope_cos_sin
from nanollm.model import Transformer

from .graph import GraphDecoder, attend_heavy, evict_sinks, write_entry


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``nanollm.attention.RMSNorm`` as a function: normalised in fp32, rounded back, times the weight."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def before_attention(x: Tensor, norm_w: Tensor, wqkv: Tensor, cos: Tensor, sin: Tensor, eps: float, H: int,
                     H_kv: int) -> tuple[Tensor, Tensor, Tensor]:
    """x (R, D) -> q (R, H, 1, d), k, v (R, H_kv, 1, d): ``LeanDecoder.forward`` up to its attention."""
    return heads_with_rope(F.linear(rms_norm(x, norm_w, eps), wqkv), cos, sin, H, H_kv)


def heads_with_rope(qkv: Tensor, cos: Tensor, sin: Tensor, H: int, H_kv: int) -> tuple[Tensor, Tensor, Tensor]:
    """The stacked product qkv (R, (H + 2 H_kv) d) -> q (R, H, 1, d), k, v (R, H_kv, 1, d), q and k rotated."""
    qkv = qkv.view(qkv.shape[0], H + 2 * H_kv, -1)                                  # (R, H + 2 H_kv, d)
    qk = apply_rope(qkv[:, :H + H_kv], cos, sin)
    return qk[:, :H, None], qk[:, H:, None], qkv[:, H + H_kv:, None]


def after_attention(x: Tensor, y: Tensor, wo: Tensor, norm_w: Tensor, wgu: Tensor, wd: Tensor,
                    eps: float) -> Tensor:
    """x (R, D), the heads' outputs y (R, H*d) -> x (R, D): the rest of the layer."""
    x = x + F.linear(y, wo)
    gate, up = F.linear(rms_norm(x, norm_w, eps), wgu).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, wd)


def write_in_one_launch(kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, k: Tensor, v: Tensor,
                        position: Tensor) -> None:
    """``graph.write_entry`` (three scatters, three kernels) as one Triton kernel where ``kernels.serves``
    says so (``kernels/cache_write.py``; the same buffers bit for bit)."""
    if kernels.serves(kb):
        write_entry_triton(kb, vb, pos, slot, k, v, position)
    else:
        write_entry(kb, vb, pos, slot, k, v, position)


def head(x: Tensor, norm_w: Tensor, w: Tensor, eps: float) -> Tensor:
    """The final norm and the LM head: x (R, D) -> logits (R, V)."""
    return F.linear(rms_norm(x, norm_w, eps), w)


class FusedGraphDecoder(GraphDecoder):
    """``GraphDecoder`` whose layers run ``before_attention`` and ``after_attention`` compiled."""

    def __init__(self, model: Transformer, backend: str | None = None) -> None:
        super().__init__(model)
        if self.lean.biased or self.lean.qk_norms is not None:   # before_attention has neither
            raise ValueError(f"the fused step takes a model without {'biases' if self.lean.biased else 'q/k norms'} "
                             "(Qwen2's q/k/v biases, a llama's attention_bias, Qwen3's q/k norms); decode it with "
                             "GraphDecoder")
        options = {"dynamic": False} if backend is None else {"dynamic": False, "backend": backend}
        self.compile_options = options                  # a subclass compiles its own pieces with the same
        self.before, self.after, self.head = (torch.compile(f, **options)
                                              for f in (before_attention, after_attention, head))
        # the attention's own small pieces (graph.py) where no kernel serves (_attend_written below): StreamingLLM's
        # eviction, H2O's probabilities and eviction. Not the writes: compiled, an in-place scatter into a layer's view
        # of the buffers became a copy of that whole view (results/decode_profile_h100_32k.txt, 16-25 us twice a layer);
        # nor Scissorhands' step, whose writes go into its ring buffer, w times the size of H2O's scores (inductor on a
        # CPU copied the whole buffer three times a layer)
        self.evict_sinks, self.attend_heavy = (torch.compile(f, **options) for f in (evict_sinks, attend_heavy))
        self.write = write_in_one_launch            # the writes: one Triton kernel a layer instead of three

    def _attend_written(self, i: int, attn, q: Tensor) -> Tensor:
        """``GraphDecoder._attend_written``, but for H2O, Scissorhands and StreamingLLM where ``kernels.serves``
        says so: after the write, the attention and the eviction in three launches (H2O's four), the eviction's
        choice made from what the attention kernel reads (``kernels/heavy_hitters.py`` and ``kernels/scissorhands.py``:
        the scores, not a second pass over the keys; ``kernels/streaming.py``: the positions, each range's
        oldest reduced from them as they are loaded)."""
        d = q.shape[-1]
        if self.rule.kind not in ("heavy", "scissors", "sinks") or d < 16 or d & (d - 1) or not kernels.serves(q):
            return super()._attend_written(i, attn, q)
        kv, rule = self.current.kv, self.rule
        kb, vb, pos, slot = kv.k[i], kv.v[i], kv.pos[i], kv.slot[i]       # views (B, H_kv, C, d), (B, H_kv, C)
        if rule.kind == "heavy":
            out = heavy_attend_triton(q[:, :, 0], kb, vb, pos, slot, kv.score[i], kv.position, rule.n_recent,
                                      rule.budget)
        elif rule.kind == "scissors":
            out = scissors_attend_triton(q[:, :, 0], kb, vb, pos, slot, kv.low[i], kv.count[i], kv.attn[i],
                                         kv.position, rule.n_recent, rule.budget, rule.threshold)
        else:
            out = sinks_attend_triton(q[:, :, 0], kb, vb, pos, slot, rule.n_sink, rule.budget)
        return out.unsqueeze(2)                                                            # (B, H, 1, d)

    def decode(self, token: Tensor) -> Tensor:
        """``GraphDecoder.decode`` with the compiled pieces: logits (B, V), ``self.kv`` updated in place."""
        kv, cfg = self.current.kv, self.config
        x = F.embedding(token, self.model.tok_emb.weight)                             # (B, D)
        cos, sin = rope_cos_sin(kv.position, self.lean.inv_freq, x.dtype)            # (1, d) each
        for i, (norm1, wqkv, wo, norm2, wgu, wd, attn) in enumerate(self.lean.layers):
            q, k, v = self.before(x, norm1.weight, wqkv, cos, sin, norm1.eps, cfg.n_head, cfg.n_kv_head)
            y = self._attend(i, attn, q, k, v).reshape(x.shape[0], -1)               # (B, H*d)
            x = self.after(x, y, wo, norm2.weight, wgu, wd, norm2.eps)
        logits = self.head(x, self.model.final_norm.weight, self.model.lm_head.weight, self.model.final_norm.eps)
        self.advance(kv)
        return logits
