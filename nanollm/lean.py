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
  itself; with a policy it goes through ``KVCache.attend``, so every policy's hooks run unchanged;
* ``step_many`` steps several independent caches side by side (an evaluation's methods on one sample):
  the element-wise work runs once over all their rows, the matrix products and attention per cache, so
  each cache gets exactly the numbers it would get alone.

It computes the same function: logits agree with ``decode_step`` to float rounding (the stacked matrix
multiplies may sum in another order), tested in fp32 at 1e-5. The weights are copied when the decoder is
built: build it after loading or training, not before.

    lean = LeanDecoder(model)
    logits = prefill(model, ids, cache)[:, -1]           # the prompt: the readable path
    logits = lean.step(token, cache)                     # each new token: the lean one
    logits, hidden = lean.step_many([t1, t2], [c1, c2])  # two sequences side by side, each as alone
    out = lean.generate(ids, max_new_tokens=32)          # greedy, like nanollm.generate
"""

from __future__ import annotations

import time

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

    def step_with_hidden(self, token: Tensor, cache: KVCache) -> tuple[Tensor, Tensor]:
        """Logits (B, V) and the final normalised hidden state (B, D) of one decode step (what
        ``model(token, cache=cache, return_hidden=True)`` returns, for its one position)."""
        return self.step_many([token], [cache])

    @torch.no_grad()
    def step_many(self, tokens: list[Tensor], caches: list[KVCache],
                  own_seconds: list[float] | None = None) -> tuple[Tensor, Tensor]:
        """One decode step for each of several independent sequences, side by side: ``tokens[n]`` (B_n,)
        onto ``caches[n]`` (each cache with its own policy, length and position). Returns the logits
        (sum B_n, V) and hidden states (sum B_n, D), the caches' rows one after the other.

        Each cache's numbers are exactly those of ``step(tokens[n], caches[n])`` on its own (tested bit
        for bit on CPU), which is what lets an evaluation step all its methods together and still give
        each the same trace as a run of that method alone. The two kinds of work are treated differently:

        * element-wise work and row-wise reductions (embedding, RMSNorm, RoPE, SiLU, residual adds)
          compute every row independently, so they run once over all rows: one call instead of one per
          sequence, which is most of what a tiny model's step costs;
        * matrix products run per cache: a product over many rows may sum in another order than the
          same product over one row (it does here), which would make a sequence's numbers depend on which
          others happened to run beside it. Attention (storage, policy hooks) is per cache anyway.

        ``own_seconds[n]``, if given, gets the time of cache n's attention added (its storage, attention
        and policy hooks: the work that differs between caches); the rest of the step is the same work
        for every row.
        """
        model, cfg = self.model, self.config
        H, H_kv, d = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        if not caches or len(tokens) != len(caches):
            raise ValueError(f"one token tensor per cache: {len(tokens)} token tensors, {len(caches)} caches")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a cache appears twice: each cache takes one step")
        for cache in caches:
            if cache.seen == 0:
                raise ValueError("a decode step needs a cache that already holds a prefix; use prefill() first")
            if cache.seen + 1 > cfg.max_seq_len:
                raise ValueError(f"{cache.seen} tokens seen + 1 new exceeds the model's max_seq_len={cfg.max_seq_len}")
        tokens = [t.view(-1) for t in tokens]
        ids = torch.cat(tokens) if len(tokens) > 1 else tokens[0]                     # (R,) all rows
        rows, row_pos, first = [], [], 0                 # each cache's rows; every row's position
        for t, cache in zip(tokens, caches):
            rows.append(slice(first, first + len(t)))
            row_pos += [cache.seen] * len(t)
            first += len(t)
        one = len(caches) == 1                          # one cache: its rows are all the rows, one position
        x = F.embedding(ids, model.tok_emb.weight)                                     # (R, D): one position each
        if one:
            cos, sin = model.rope(caches[0].seen, 1, ids.device, x.dtype)             # (1, d) each
        else:
            cos, sin = model.rope(0, cfg.max_seq_len, ids.device, x.dtype)           # (max_seq_len, d) tables
            row_pos = torch.tensor(row_pos, device=ids.device)
            cos, sin = cos[row_pos, None], sin[row_pos, None]                          # (R, 1, d) each
        pos = [torch.arange(c.seen, c.seen + 1, device=ids.device) for c in caches]   # (1,) per cache

        def of(t: Tensor, n: int) -> Tensor:           # cache n's rows of t
            return t if one else t[rows[n]]

        timing = own_seconds is not None

        def per_cache(f, timed: bool = False) -> Tensor:   # f(n) for every cache, their rows stacked
            outs = []
            for n in range(len(caches)):
                t0 = time.perf_counter()
                outs.append(f(n))
                if timed and timing:
                    own_seconds[n] += time.perf_counter() - t0
            return outs[0] if one else torch.cat(outs)

        def attend(n: int, i: int, attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            cache, q, k, v = caches[n], of(q, n), of(k, n), of(v, n)
            store = cache.layers[i]
            if cache.policy is None and store.dense:    # the plain cache: store, attend, no hooks
                store.append(k, v, pos[n])
                return attend_step(q, store.k, store.v)[0]                             # (B_n, H, 1, d)
            return cache.attend(i, attn, q, pos[n], (k, v))                           # policies: their hooks

        R = ids.shape[0]
        for i, (norm1, wqkv, wo, norm2, wgu, wd, attn) in enumerate(self.layers):
            h = self._norm(norm1, x)                                                   # (R, D)
            qkv = per_cache(lambda n: F.linear(of(h, n), wqkv)).view(R, H + 2 * H_kv, d)
            qk = apply_rope(qkv[:, :H + H_kv], cos, sin)          # q and k rotated together (element-wise)
            q = qk[:, :H, None]                                                        # (R, H, 1, d)
            k, v = qk[:, H:, None], qkv[:, H + H_kv:, None]                            # (R, H_kv, 1, d)
            y = per_cache(lambda n: attend(n, i, attn, q, k, v), timed=True)           # (R, H, 1, d)
            y = y.reshape(R, H * d)                             # the heads side by side (one position)
            x = x + per_cache(lambda n: F.linear(of(y, n), wo))
            h = self._norm(norm2, x)
            gate, up = per_cache(lambda n: F.linear(of(h, n), wgu)).chunk(2, dim=-1)
            m = F.silu(gate) * up
            x = x + per_cache(lambda n: F.linear(of(m, n), wd))
        h = self._norm(model.final_norm, x)                                           # (R, D)
        logits = per_cache(lambda n: F.linear(of(h, n), model.lm_head.weight))      # (R, V)
        for cache in caches:
            cache.seen += 1
        return logits, h

    def generate(self, ids: Tensor, max_new_tokens: int, cache: KVCache | None = None,
                 stop_ids: list[int] | tuple = ()) -> Tensor:
        """Greedy continuation (B, n) of ids (B, T), as ``nanollm.generate`` (same checks, same stopping),
        with every new token fed through ``step``."""
        return generate(self.model, ids, max_new_tokens, cache=cache, stop_ids=stop_ids, step=self.step)
