"""
A lean decode step: the same decoder and cache, fewer and larger operations.

``LeanDecoder`` stacks a layer's q/k/v weights and its gate/up weights (4 linear calls a layer instead of 7),
calls no modules and attends with ``fastpath.attention``; a policy's hooks run unchanged through
``KVCache.attend``. It is for tiny models, whose step costs dispatch rather than bytes. Logits agree with
``decode_step``'s to float rounding (``tests/fastpath/test_lean.py``). The weights are copied when the decoder
is built: build it after loading or training.

    lean = LeanDecoder(model)
    logits = prefill(model, ids, cache)[:, -1]           # the prompt: the reading path
    logits = lean.step(token, cache)                     # each new token: the lean one

How it works: fastpath/inside.md, section "lean.py: fewer, larger operations".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from nanollm.attention import CausalSelfAttention, RMSNorm, apply_rope, rope_cos_sin
from nanollm.cache import KVCache
from nanollm.generation import generate
from nanollm.model import Transformer

from .attention import SPLIT_HEADS_FROM, FastAttention, attend_heads, attend_step


def _plus(t: Tensor, bias: Tensor | None) -> Tensor:
    """A product's bias added after it (the same sum as ``F.linear`` with the bias, to float rounding)."""
    return t if bias is None else t + bias


class LeanDecoder:
    """Decode steps of a Llama-flavour ``Transformer`` with the standard attention, with stacked weights."""

    def __init__(self, model: Transformer) -> None:
        cfg = model.config
        if cfg.flavour != "llama" or not all(type(b.attn) is CausalSelfAttention for b in model.blocks):
            raise ValueError("LeanDecoder takes a llama-flavour model with the standard attention "
                             f"(got flavour {cfg.flavour!r}, attention {cfg.attention!r})")
        self.model, self.config = model, cfg
        self.inv_freq = model.inv_freq.to(model.tok_emb.weight.device)                # RoPE's theta_i, (d/2,)
        with torch.no_grad():
            self.layers = []
            for b in model.blocks:
                a, m = b.attn, b.mlp
                self.layers.append((
                    b.attn_norm,
                    torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous(),   # (H+2H_kv)d x D
                    a.o_proj.weight, b.mlp_norm,
                    torch.cat([m.gate_proj.weight, m.up_proj.weight]).contiguous(),                # 2F x D
                    m.down_proj.weight, FastAttention(a)))
            # the biases of the same products (Qwen2's on q, k, v; a llama with attention_bias), else None
            self.biases = [(torch.cat([b.attn.q_proj.bias, b.attn.k_proj.bias, b.attn.v_proj.bias])
                            if cfg.qkv_bias else None,
                            b.attn.o_proj.bias, torch.cat([b.mlp.gate_proj.bias, b.mlp.up_proj.bias])
                            if cfg.bias else None, b.mlp.down_proj.bias) for b in model.blocks]
        self.biased = bool(cfg.bias or cfg.qkv_bias)
        # Qwen3's RMSNorm of each head's query and key (weights (d,)), per layer, else None
        self.qk_norms = [(b.attn.q_norm, b.attn.k_norm) for b in model.blocks] if cfg.qk_norm else None

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
        self.check_step(cache)
        ids = token.view(-1)                                                           # (B,)
        x = F.embedding(ids, self.model.tok_emb.weight)                                # (B, D): one position each
        pos = torch.arange(cache.seen, cache.seen + 1, device=ids.device)             # (1,)
        cos, sin = rope_cos_sin(pos, self.inv_freq, x.dtype)                          # (1, d) each
        logits, h = self.forward(x, cos, sin, F.linear,
                                 lambda i, attn, q, k, v: self.attend(cache, i, attn, q, k, v, pos))
        cache.seen += 1
        return logits, h

    def check_step(self, cache: KVCache) -> None:
        """A decode step needs a cache that holds a prefix and has room for one more position."""
        if cache.seen == 0:
            raise ValueError("a decode step needs a cache that already holds a prefix; use prefill() first")
        if cache.seen + 1 > self.config.max_seq_len:
            raise ValueError(f"{cache.seen} tokens seen + 1 new exceeds the model's max_seq_len="
                             f"{self.config.max_seq_len}")

    @staticmethod
    def attend(cache: KVCache, i: int, attn: FastAttention, q: Tensor, k: Tensor, v: Tensor,
               pos: Tensor) -> Tensor:
        """Layer i's attention of one step: q (B, H, 1, d), the new k, v (B, H_kv, 1, d) at position pos (1,).
        Returns (B, H, 1, d)."""
        store = cache.layers[i]
        if cache.policy is None:                        # the plain cache: store, attend, no hooks
            store.append(k, v, pos)
            split = (q.device.type == "cpu" and torch.get_num_threads() > 1          # see attend_heads
                     and store.k.shape[2] >= SPLIT_HEADS_FROM)
            return attend_heads(q, store.k, store.v) if split else attend_step(q, store.k, store.v)[0]
        return cache.attend(i, attn, q, pos, (k, v))   # policies: their hooks

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, linear, attend,
                logits_of: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The layers of one decode step over R rows (one position each): x (R, D) embedded tokens, cos and
        sin their rotations ((1, d) for one shared position, or (R, 1, d)). Returns logits (R, V), or only of
        the rows ``logits_of`` (the vocabulary's product is the largest: skipped for rows nobody reads), and
        the final normalised hidden states (R, D).

        ``linear(t, w)`` computes every matrix product and ``attend(i, attn, q, k, v)`` layer i's attention;
        ``step_with_hidden`` passes ``F.linear`` and its cache's attention. Everything else here is
        element-wise or row by row, so an evaluation can step many sequences at once by passing functions
        that run the attention per sequence and the products over all rows in fixed-size blocks
        (``experiments/evaluation/side_by_side.py``).
        """
        cfg = self.config
        H, H_kv, d = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        R = x.shape[0]
        for i, (norm1, wqkv, wo, norm2, wgu, wd, attn) in enumerate(self.layers):
            bqkv, bo, bgu, bd = self.biases[i]                                         # None: no bias
            h = self._norm(norm1, x)                                                   # (R, D)
            qkv = _plus(linear(h, wqkv), bqkv).view(R, H + 2 * H_kv, d)
            qk = qkv[:, :H + H_kv]                                                     # (R, H + H_kv, d)
            if self.qk_norms is not None:                         # Qwen3: each head normalised, before RoPE
                (qn, kn), (q, k) = self.qk_norms[i], qk.split([H, H_kv], dim=1)
                qk = torch.cat([self._norm(qn, q), self._norm(kn, k)], dim=1)
            qk = apply_rope(qk, cos, sin)                         # q and k rotated together (element-wise)
            q = qk[:, :H, None]                                                        # (R, H, 1, d)
            k, v = qk[:, H:, None], qkv[:, H + H_kv:, None]                            # (R, H_kv, 1, d)
            y = attend(i, attn, q, k, v).reshape(R, H * d)      # (R, H, 1, d): the heads side by side
            x = x + _plus(linear(y, wo), bo)
            h = self._norm(norm2, x)
            gate, up = _plus(linear(h, wgu), bgu).chunk(2, dim=-1)
            x = x + _plus(linear(F.silu(gate) * up, wd), bd)
        h = self._norm(self.model.final_norm, x)                                      # (R, D)
        wanted = h if logits_of is None else h[logits_of]
        return linear(wanted, self.model.lm_head.weight), h                           # (R, V), (R, D)

    def generate(self, ids: Tensor, max_new_tokens: int, cache: KVCache | None = None,
                 stop_ids: list[int] | tuple = ()) -> Tensor:
        """Greedy continuation (B, n) of ids (B, T), as ``nanollm.generate`` (same checks, same stopping),
        with every new token fed through ``step``."""
        return generate(self.model, ids, max_new_tokens, cache=cache, stop_ids=stop_ids, step=self.step)
