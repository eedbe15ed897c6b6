"""
Causal self-attention with rotary positions and grouped-query attention, over the entries of a cache.

One attend per phase: ``attend_prompt``, the prompt over itself (plain causal attention), and ``attend``,
every later step over stored entries, with the mask built from the entries' *positions* (never their slot
index), so it stays right after any eviction. Query head h reads KV head h // G: the G query heads of a KV
head are rows of one product with its keys, so K and V are never repeated.

An attention module provides ``forward(x, pos, rope, cache)``, ``new_storage(config)`` (an empty layer of
the cache) and ``attend_entries(q, entries, q_pos, needs) -> (out, probs, col_sums)``; ``config.attention``
names one in ``ATTENTION`` or as ``"package.module:Class"``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .checks import check_attention_path
from .config import ModelConfig
from .policy import Needs
from .storage import LayerKV

SCORE_ELEMENTS = 1 << 24    # attention scores computed at once (64 MiB in fp32): queries are taken in chunks

# Rotary position embeddings (RoPE, Su et al. 2021, arXiv 2104.09864, §3.4.2), "rotate half" layout as in
# Hugging Face Llama: dimension i is paired with dimension i + d/2.

def rope_inv_freq(config: ModelConfig) -> Tensor:
    """theta_i = base^(-2i/d), i = 0..d/2-1, (d/2,) in float64; ``rope_scaling`` type "llama3" stretches the
    long wavelengths as Llama 3.1 does (divided by ``factor``, a smooth ramp between the two bounds)."""
    d, scaling = config.head_dim, config.rope_scaling
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if scaling is None or scaling.get("rope_type", scaling.get("type")) == "default":   # (checks.check_config)
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)                # 0 at the low end, 1 at the high end
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > old_ctx / low, inv_freq / factor,    # long waves: stretched
                       torch.where(wavelen < old_ctx / high, inv_freq, blended))  # short waves: unchanged


def rope_cos_sin(pos: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles pos * theta_i, each (T, d), for positions pos (T,)."""
    angles = pos.to(torch.float64)[:, None] * inv_freq[None, :]      # (T, d/2)
    angles = torch.cat([angles, angles], dim=-1)                      # (T, d)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate every (x_i, x_{i+d/2}) pair of x (B, H, T, d) by its angle."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019), computed in fp32 as Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


# Attention over (key, value, position) entries, and the statistics a policy asks for (``policy.Needs``).

def group_scores(q: Tensor, k: Tensor) -> Tensor:
    """q k^T / sqrt(d) per KV head: q (B, H, C, d), k (B, H_kv, T, d) -> (B, H_kv, G, C, T)."""
    # BEGIN SOLUTION [cache:group_scores] Vaswani §3.2.1's scaled scores; GQA §2: query head h reads KV head h // G
    B, H, C, d = q.shape
    H_kv = k.shape[1]
    qg = q.reshape(B, H_kv, H // H_kv * C, d) / math.sqrt(d)           # the G query heads as rows
    return (qg @ k.transpose(-1, -2)).view(B, H_kv, H // H_kv, C, k.shape[2])
    # END SOLUTION


def attend_prompt(q: Tensor, k: Tensor, v: Tensor, needs: Needs = Needs()) -> tuple[Tensor, Tensor | None,
                                                                                      Tensor | None]:
    """The prompt over itself, q (B, H, T, d), k, v (B, H_kv, T, d): causal attention in one fused call, which
    never builds the (T, T) matrix, and what ``needs`` asks for (``prompt_statistics``). Returns as ``attend``."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return (out, *prompt_statistics(q, k, needs))


def prompt_statistics(q: Tensor, k: Tensor, needs: Needs) -> tuple[Tensor | None, Tensor | None]:
    """The last ``needs.rows`` rows (B, H, R, T) and the column sums (B, H, T) of the prompt's causal
    attention, chunk by chunk: queries [i, j) see keys [0, j). Only the asked rows are computed."""
    B, H, T, d = q.shape
    chunk = max(1, SCORE_ELEMENTS // max(1, B * H * T))
    keep_rows = T if needs.rows is None else min(needs.rows, T)
    col_sums = q.new_zeros(B, H, T, dtype=torch.float32) if needs.col_sums else None
    rows = []
    for i in range(0 if needs.col_sums else T - keep_rows, T, chunk):
        j = min(i + chunk, T)
        scores = group_scores(q[:, :, i:j], k[:, :, :j])                        # (B, H_kv, G, C, j)
        future = torch.ones(j - i, j - i, dtype=torch.bool, device=q.device).triu(1)   # key i+b after query i+a
        scores[..., i:].masked_fill_(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(B, H, j - i, j)
        if col_sums is not None:
            col_sums[..., :j] += probs.float().sum(dim=2)
        if j > T - keep_rows:
            rows.append(F.pad(probs[:, :, max(0, T - keep_rows - i):], (0, T - j)))
    return (torch.cat(rows, dim=2) if keep_rows else None), col_sums


def attend(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, needs: Needs = Needs(),
           chunk: int | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """softmax(q k^T / sqrt(d) + mask) v over stored entries, the mask from positions.

    q (B, H, Tq, d) at positions q_pos (Tq,); k, v (B, H_kv, Tk, d) at k_pos (B, H_kv, Tk), -1 = empty slot.
    A query at position p sees an entry at position s iff 0 <= s <= p. Queries go in chunks of ``chunk``
    (default: as many as keep the scores under ``SCORE_ELEMENTS``). Returns out (B, H, Tq, d), the last
    ``needs.rows`` rows of the probabilities (B, H, R, Tk) or None, the column sums (B, H, Tk) or None.
    """
    B, H, Tq, d = q.shape
    Tk = k.shape[2]
    chunk = chunk or max(1, SCORE_ELEMENTS // max(1, B * H * Tk))
    first_kept = 0 if needs.rows is None else Tq - min(needs.rows, Tq)     # rows before it are not returned
    outs, rows = [], []
    col_sums = q.new_zeros(B, H, Tk, dtype=torch.float32) if needs.col_sums else None
    for i in range(0, Tq, chunk):
        qc, pc = q[:, :, i:i + chunk], q_pos[i:i + chunk]                  # (B, H, C, d), (C,)
        C = qc.shape[2]
        scores = group_scores(qc, k)                                       # (B, H_kv, G, C, Tk)
        kp = k_pos[:, :, None, None, :]                                    # (B, H_kv, 1, 1, Tk)
        # BEGIN SOLUTION [cache:mask] Vaswani §3.2.1 (Eq. 1) with the mask from positions; GQA §2: G heads per KV head
        visible = (kp <= pc[:, None]) & (kp >= 0)                          # (B, H_kv, 1, C, Tk)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        outs.append((probs.view(B, -1, C * H // k.shape[1], Tk) @ v).view(B, H, C, d))
        # END SOLUTION
        probs = probs.view(B, H, C, Tk)
        if col_sums is not None:
            col_sums += probs.float().sum(dim=2)
        if i + C > first_kept:
            rows.append(probs[:, :, max(0, first_kept - i):])
    return torch.cat(outs, dim=2), (torch.cat(rows, dim=2) if rows else None), col_sums


class CausalSelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention. Weight names follow Hugging Face Llama (q/k/v/o_proj)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        H, H_kv, d, D = config.n_head, config.n_kv_head, config.head_dim, config.d_model
        self.q_proj = nn.Linear(D, H * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(D, H_kv * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(D, H_kv * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(H * d, D, bias=config.bias)            # W_O, shape (D, H*d)
        if config.qk_norm:                                              # Qwen3: weights (d,), shared by the heads
            self.q_norm, self.k_norm = RMSNorm(d, config.norm_eps), RMSNorm(d, config.norm_eps)

    @classmethod
    def new_storage(cls, config: ModelConfig) -> LayerKV:
        return LayerKV()

    @staticmethod
    def attend_entries(q: Tensor, entries: LayerKV, q_pos: Tensor,
                       needs: Needs = Needs()) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The step's queries (B, H, Tq, d) over stored (or rebuilt) entries: ``attend_prompt`` when the
        entries are exactly these queries' (the prompt, nothing before it), else ``attend``."""
        if q.shape[2] == len(entries) and torch.equal(entries.pos, q_pos.expand_as(entries.pos)):
            return attend_prompt(q, entries.k, entries.v, needs)
        return attend(q, entries.k, entries.v, q_pos, entries.pos, needs)

    def forward(self, x: Tensor, pos: Tensor, rope: tuple[Tensor, Tensor] | None, cache=None) -> Tensor:
        """x (B, T, D) at positions pos (T,); rope = (cos, sin) or None; cache a ``KVCache`` or None."""
        B, T, _ = x.shape
        H, H_kv, d = self.config.n_head, self.config.n_kv_head, self.config.head_dim
        q = self.q_proj(x).view(B, T, H, d).transpose(1, 2)             # (B, H, T, d)
        k = self.k_proj(x).view(B, T, H_kv, d).transpose(1, 2)          # (B, H_kv, T, d)
        v = self.v_proj(x).view(B, T, H_kv, d).transpose(1, 2)          # (B, H_kv, T, d)
        if self.config.qk_norm:                                         # each head's q and k normalised, then RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)           # keys are cached after RoPE
        if cache is None:                                               # training: the sequence over itself
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H_kv != H)
        else:
            y = cache.attend(self.layer_idx, self, q, pos, (k, v))      # store, attend, run the policy
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * d))


ATTENTION: dict[str, type[nn.Module]] = {"causal": CausalSelfAttention}


def attention_class(name: str) -> type[nn.Module]:
    """The module ``config.attention`` names: a key of ``ATTENTION`` or ``"package.module:Class"``."""
    if name in ATTENTION:
        return ATTENTION[name]
    return check_attention_path(name, ATTENTION)     # "package.module:Class", imported and checked
