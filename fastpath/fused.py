"""
The graph step with its small operations fused: what is left of a step's fixed cost.

A CUDA graph removes the host from a decode step (``graph.py``) but not the step's number of kernels: per
layer two norms, RoPE, the residual adds and SiLU-times-up are a dozen element-wise kernels over a few
kilobytes (B rows of d_model), each a few microseconds however little it reads. Over 22 layers that is a
fixed cost of the order of a millisecond, which a compressed cache does not shrink. Here the element-wise
work between two matrix products is compiled by ``torch.compile`` (inductor: one generated kernel for each
run of element-wise operations; the products stay cuBLAS's), one function before a layer's attention and
one after it:

    before   x (R, D) -> q (R, H, 1, d), k, v (R, H_kv, 1, d):  norm, the stacked q/k/v product, RoPE
    after    x, y (R, H*d) -> x:  + o_proj(y), norm, gate/up product, silu(gate) * up, down product, + x

Every layer has the same shapes, so each function compiles once (the first eager step, seconds on a GPU)
and serves all layers, every method and every length of a run. The attention between them is the graph
step's own (``GraphDecoder._attend``). Where the kernels serve, an evicting method's layer is three
launches whose eviction uses what the attention kernel read: H2O's (``kernels/heavy_hitters.py``: the split
kernel keeps its scores, the merge, one update kernel), Scissorhands' (``kernels/scissorhands.py``: the same
scores, the merge, one kernel for its flags, ring buffer, counters and eviction) and StreamingLLM's
(``kernels/streaming.py``: the split kernel keeps each range's oldest entry, the merge, one kernel that
empties the oldest). Elsewhere H2O's and StreamingLLM's small pieces are compiled: StreamingLLM's eviction,
H2O's probabilities, the scores it adds up and the slot it empties, which compile once per capacity C;
Scissorhands' step stays the graph step's, uncompiled: its writes go into a ring buffer of w flags per slot,
which compiled would be copied whole. Not the writes into the buffers: compiled, an
in-place write into a view of a large buffer becomes a copy of the whole buffer; the three scatters of a
layer's write are one Triton launch instead (``kernels/cache_write.py``). The split-K kernel is the graph
step's (for the evicting methods, its variants that keep the scores or the oldest entries), and the whole
step is still captured and replayed as ``GraphDecoder`` does. The arithmetic
is the lean step's, in the same order within each operation, so the logits agree to float rounding
(tested in fp32 at 1e-5 with the ``eager`` backend on a CPU, which traces the same functions without
generating code).

Each compiled function specialises on its shapes and on the Python numbers it is given (a budget, a recent
window, C): dynamo compiles it again for each new combination, up to its recompile limit (8 by default),
after which that function runs uncompiled, still correct.

    fused = FusedGraphDecoder(model)                     # as GraphDecoder; backend=None is inductor
    fused.start(cache, max_new_tokens=32)
    logits = fused.step(token)
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
    """``nanollm.model.RMSNorm`` as a function: normalised in fp32, rounded back, times the weight."""
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
