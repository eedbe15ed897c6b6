"""
A lean decode step: the same decoder and cache, fewer and larger operations.

A decode step of a tiny model does almost no arithmetic: the bundled model's step is about a thousand
small tensor operations at a few microseconds of dispatch each, plus the Python around them (module calls,
bookkeeping), and that, not the weights or the cache, is what it costs on a CPU. ``model.py`` keeps one
module per concept so it can be read; this file does the same step with less per-call work, for when
speed matters (benchmarks, long generations):

* the q, k and v projections of a layer are one matrix multiply (their weights stacked), and so are the
  MLP's gate and up projections: 4 linear calls per layer instead of 7;
* no ``nn.Module`` calls (weights are used directly), no id checks after the first token, RoPE from the
  model's table and applied to q and k in one call;
* with a plain cache (no policy) the step appends to the dense storage and calls ``attention.attend_step``
  itself; with a policy it goes through ``KVCache.attend``, so every policy's hooks run unchanged.

It computes the same function: logits agree with ``decode_step`` to float rounding (the stacked matrix
multiplies may sum in another order), tested in fp32 at 1e-5. The weights are copied when the decoder is
built: build it after loading or training, not before.

    lean = LeanDecoder(model)
    logits = prefill(model, ids, cache)[:, -1]           # the prompt: the readable path
    logits = lean.step(token, cache)                     # each new token: the lean one
    out = lean.generate(ids, max_new_tokens=32)          # greedy, like nanollm.generate
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import CausalSelfAttention, apply_rope, attend_step
from .cache import KVCache
from .generation import generate
from .model import RMSNorm, Transformer


class LeanDecoder:
    """Decode steps of a Llama-flavour ``Transformer`` with the standard attention, with stacked weights."""

    def __init__(self, model: Transformer) -> None:
        cfg = model.config
        if cfg.flavour != "llama" or not all(type(b.attn) is CausalSelfAttention for b in model.blocks):
            raise ValueError("LeanDecoder takes a llama-flavour model with the standard attention "
                             f"(got flavour {cfg.flavour!r}, attention {cfg.attention!r})")
        self.model, self.config = model, cfg
        with torch.no_grad():
            self.layers = []
            for b in model.blocks:
                a, m = b.attn, b.mlp
                self.layers.append((
                    b.attn_norm,
                    torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous(),   # (H+2H_kv)d x D
                    a.o_proj.weight, b.mlp_norm,
                    torch.cat([m.gate_proj.weight, m.up_proj.weight]).contiguous(),                # 2F x D
                    m.down_proj.weight, a))

    @staticmethod
    def _norm(norm: RMSNorm, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:            # RMSNorm's fp32 round trip is a no-op here: skip two calls
            return norm.weight * F.rms_norm(x, (x.shape[-1],), eps=norm.eps)
        return norm(x)

    def step(self, token: Tensor, cache: KVCache) -> Tensor:
        """Logits (B, V) after feeding ``token`` (B,) or (B, 1) to ``cache``: what ``decode_step`` returns."""
        return self.step_with_hidden(token, cache)[0]

    @torch.no_grad()
    def step_with_hidden(self, token: Tensor, cache: KVCache) -> tuple[Tensor, Tensor]:
        """Logits (B, V) and the final normalised hidden state (B, D) of one decode step (what
        ``model(token, cache=cache, return_hidden=True)`` returns, for its one position)."""
        model, cfg = self.model, self.config
        ids = token.view(-1, 1)
        start = cache.seen
        if start == 0:
            raise ValueError("a decode step needs a cache that already holds a prefix; use prefill() first")
        if start + 1 > cfg.max_seq_len:
            raise ValueError(f"{start} tokens seen + 1 new exceeds the model's max_seq_len={cfg.max_seq_len}")
        B = ids.shape[0]
        H, H_kv, d = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        pos = torch.arange(start, start + 1, device=ids.device)                       # (1,)
        x = F.embedding(ids, model.tok_emb.weight)                                     # (B, 1, D)
        cos, sin = model.rope(start, 1, ids.device, x.dtype)                           # (1, d) each
        plain = cache.policy is None
        for i, (norm1, wqkv, wo, norm2, wgu, wd, attn) in enumerate(self.layers):
            qkv = F.linear(self._norm(norm1, x), wqkv).view(B, H + 2 * H_kv, d)       # (B, H + 2 H_kv, d)
            qk = apply_rope(qkv[:, :H + H_kv], cos, sin)          # q and k rotated together (element-wise)
            q = qk[:, :H, None]                                                        # (B, H, 1, d)
            k, v = qk[:, H:, None], qkv[:, H + H_kv:, None]                            # (B, H_kv, 1, d)
            store = cache.layers[i]
            if plain and store.dense:                           # the plain cache: store, attend, no hooks
                store.append(k, v, pos)
                y, _, _ = attend_step(q, store.k, store.v)                             # (B, H, 1, d)
            else:
                y = cache.attend(i, attn, q, pos, (k, v))                              # policies: their hooks
            x = x + F.linear(y.transpose(1, 2).reshape(B, 1, H * d), wo)
            gate, up = F.linear(self._norm(norm2, x), wgu).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, wd)
        h = self._norm(model.final_norm, x)                                           # (B, 1, D)
        logits = F.linear(h, model.lm_head.weight)                                    # (B, 1, V)
        cache.seen += 1
        return logits[:, -1], h[:, -1]

    def generate(self, ids: Tensor, max_new_tokens: int, cache: KVCache | None = None,
                 stop_ids: list[int] | tuple = ()) -> Tensor:
        """Greedy continuation (B, n) of ids (B, T), as ``nanollm.generate`` (same checks, same stopping),
        with every new token fed through ``step``."""
        return generate(self.model, ids, max_new_tokens, cache=cache, stop_ids=stop_ids, step=self.step)
