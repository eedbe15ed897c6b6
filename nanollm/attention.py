"""
Causal self-attention with explicit positions, rotary embeddings, and grouped-query attention; and the
seam through which the decoder takes another attention module.

Two paths, one module:

* ``cache is None`` (training, plain forward): every token attends to every earlier token of the same
  sequence; ``scaled_dot_product_attention`` with a causal mask does it in one fused call.
* ``cache`` given (generation): the new keys/values are stored in the cache, the query attends to what
  the cache's policy says it may see, and the policy is told what happened. See ``cache.KVCache.attend``.

The heart of the cached path is :func:`attend`, written out in plain tensor ops so it can be read:
the causal mask is built from the *stored positions* of the keys, never from their slot index, so it stays
right after any eviction; and when nothing needs a mask (a decode step, or a prompt with nothing cached
before it) it takes a fast path that builds none.

An attention module, for the decoder (``model.Block`` builds the one ``config.attention`` names):

    Module(config, layer_idx)                 an ``nn.Module``
    forward(x, pos, rope, cache) -> y         x (B, T, D) at positions pos (T,); rope = (cos, sin) or None;
                                              with a cache: ``cache.attend(layer_idx, self, q, pos, new)``
    new_storage(config)  (classmethod)        an empty per-layer storage (``storage.LayerKV`` here)
    attend_entries(q, entries, q_pos, needs=Needs()) -> (out, probs, col_sums)
                                              attention of the step's queries over a storage's entries,
                                              with the statistics a policy asked for (``policy.Needs``)

``config.attention`` is a name registered in ``ATTENTION`` ("causal") or a ``"package.module:Class"``
path, so a module defined outside nanollm plugs in without nanollm importing it.
"""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .config import ModelConfig
from .policy import Needs
from .storage import LayerKV

# ----------------------------------------------------------------------------------------------------------
# Rotary position embeddings (RoPE, Su et al. 2021, arXiv 2104.09864, §3.4.2), "rotate half" layout as in
# Hugging Face Llama: dimension i is paired with dimension i + d/2.

def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies theta_i = base^(-2i/d), i = 0..d/2-1, shape (d/2,), float64 for exactness.

    With ``config.rope_scaling = {"rope_type": "llama3", ...}`` the low frequencies are stretched as in
    Llama 3.1 (long wavelengths divided by ``factor``, a smooth ramp between ``low_freq_factor`` and
    ``high_freq_factor``).
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: 'llama3' (or none)")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    smooth = (old_ctx / wavelen - low) / (high - low)                # 0 at the low end, 1 at the high end
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > low_wavelen, inv_freq / factor,      # long waves: stretched
                       torch.where(wavelen < high_wavelen, inv_freq, blended))  # short waves: unchanged


def rope_cos_sin(pos: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotation angles pos * theta_i, each (T, d), for positions ``pos`` (T,)."""
    angles = pos.to(torch.float64)[:, None] * inv_freq[None, :]      # (T, d/2)
    angles = torch.cat([angles, angles], dim=-1)                      # (T, d)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate every (x_i, x_{i+d/2}) pair of ``x`` (B, H, T, d) by its angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)      # "rotate_half"
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------------------------------------
# Attention over an explicit set of (key, value, position) entries.
#
# Three paths, one result. The general path (``attend_masked``) builds the mask from the stored positions
# and works for anything: evicted, per-head, padded entries. Two fast paths skip the mask when the
# storage is ``dense`` (every slot holds an entry that came in through ``append``, see ``storage.py``):
#
#   one new query (a decode step)        it sees every stored entry: no mask at all (``attend_step``)
#   the whole prompt (nothing stored     plain causal attention: ``scaled_dot_product_attention`` with
#   before it)                           is_causal, which never materialises the (T, T) probabilities
#
# A policy may ask for statistics of the attention (``policy.Needs``): the probabilities of the step's
# last rows, or column sums. The output never depends on what is asked (a method at a budget covering the
# sequence stays bit-for-bit the full cache); the statistics are computed beside it, chunk by chunk.

SCORE_ELEMENTS = 1 << 24    # the general path computes at most this many scores at once (64 MiB in fp32)


def attend(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, needs: Needs = Needs(),
           dense: bool = False, chunk: int | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """softmax(q k^T / sqrt(d) + mask) v, with the mask built from positions; and what ``needs`` asks for.

    Parameters
    ----------
    q : (B, H, Tq, d) queries, already rotated.
    k, v : (B, H_kv, Tk, d) stored keys (rotated at their own positions) and values.
    q_pos : (Tq,) absolute position of every query.
    k_pos : (B, H_kv, Tk) absolute position of every stored entry; -1 marks an empty slot (never attended).
    needs : which statistics to return besides the output (``policy.Needs``).
    dense : the entries are a dense storage whose newest entries are these queries (``LayerKV.dense``):
        allows the fast paths. False is always correct.
    chunk : queries per chunk in the general path (default: as many as keep the scores under
        ``SCORE_ELEMENTS``).

    Returns
    -------
    out : (B, H, Tq, d)
    probs : (B, H, R, Tk) probabilities of the last R = min(needs.rows, Tq) queries (all if rows is None),
        or None when ``needs.rows == 0``.
    col_sums : (B, H, Tk) fp32 attention each entry received, summed over the Tq queries, or None.

    A query at position p sees an entry at position s iff 0 <= s <= p. Query head h reads KV head h // G:
    the G query heads of a KV head are stacked as G * Tq rows of one matrix product with that head's keys,
    so K and V are read once and never repeated in memory.
    """
    Tq, Tk = q.shape[2], k.shape[2]
    if dense and Tq == 1:
        return attend_step(q, k, v, needs)
    if dense and Tq == Tk and torch.equal(k_pos, q_pos.expand_as(k_pos)):     # the prompt, nothing before it
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        if needs.rows == 0 and not needs.col_sums:
            return out, None, None
        return (out, *prompt_statistics(q, k, needs, chunk))
    return attend_masked(q, k, v, q_pos, k_pos, needs, chunk)


def queries_per_chunk(B: int, H: int, Tk: int, chunk: int | None) -> int:
    """``chunk`` if given, else as many queries as keep a chunk's (B, H, C, Tk) scores under SCORE_ELEMENTS."""
    return chunk if chunk is not None else max(1, SCORE_ELEMENTS // max(1, B * H * Tk))


def kernel_serves(t: Tensor) -> bool:
    """Whether a Triton kernel of ``kernels/`` takes this call (CUDA and Triton; see ``kernels.serves``).
    Imported lazily: nanollm runs without the kernels package's Triton."""
    if not t.is_cuda:
        return False
    import kernels
    return kernels.serves(t)


def attend_step(q: Tensor, k: Tensor, v: Tensor, needs: Needs = Needs()) -> tuple[Tensor, Tensor | None,
                                                                                  Tensor | None]:
    """One query per row over entries it may all see (a decode step on dense storage): no mask.

    This is the memory-bound heart of decoding: it reads every stored key and value once, and does two
    small matrix-vector products. q (B, H, 1, d); k, v (B, H_kv, Tk, d). Returns as ``attend``.
    """
    d = q.shape[-1]
    if (d >= 16 and d & (d - 1) == 0 and not (torch.is_grad_enabled() and q.requires_grad)
            and kernel_serves(q)):                  # a GPU with Triton: the split-K kernel of kernels/
        return kernel_step(q, k, v, needs)
    B, H = q.shape[:2]
    probs = step_probs(q, k)                                            # (B, H_kv, G, Tk)
    out = (probs @ v).view(B, H, 1, d)                                  # (B, H, 1, d)
    return (out, *step_statistics(probs, needs))


def step_probs(q: Tensor, k: Tensor) -> Tensor:
    """Attention probabilities of one query per row: q (B, H, 1, d), k (B, H_kv, Tk, d) -> (B, H_kv, G, Tk),
    the G query heads of each KV head side by side (GQA without repeating k)."""
    # BEGIN SOLUTION [cache] q as (B, H_kv, G, d) scaled by 1/sqrt(d); one matmul with k^T per KV head; softmax
    B, H, _, d = q.shape
    H_kv = k.shape[1]
    qg = q.view(B, H_kv, H // H_kv, d) / math.sqrt(d)                   # (B, H_kv, G, d): G query rows
    return torch.softmax(qg @ k.transpose(-1, -2), dim=-1)              # (B, H_kv, G, Tk)
    # END SOLUTION


def step_statistics(probs: Tensor, needs: Needs) -> tuple[Tensor | None, Tensor | None]:
    """What a policy asked for (``needs``) of a decode step's probabilities (B, H_kv, G, Tk): the rows
    (B, H, 1, Tk) and the column sums (B, H, Tk), or None for what it did not ask for."""
    B, H_kv, G, Tk = probs.shape
    probs = probs.view(B, H_kv * G, 1, Tk)                              # (B, H, 1, Tk)
    col_sums = probs.sum(dim=2, dtype=torch.float32) if needs.col_sums else None     # (B, H, Tk), a copy
    return (probs if needs.rows != 0 else None), col_sums


def kernel_step(q: Tensor, k: Tensor, v: Tensor, needs: Needs = Needs()) -> tuple[Tensor, Tensor | None,
                                                                                  Tensor | None]:
    """``attend_step`` with its output from the split-K decode kernel (``kernels/decode_attention.py``), and
    the statistics a policy asked for, if any, from the same probabilities ``attend_step`` computes."""
    from kernels.decode_attention import decode_attention_triton
    out = decode_attention_triton(q[:, :, 0], k, v).unsqueeze(2)                            # (B, H, 1, d)
    if needs == Needs():
        return out, None, None
    return (out, *step_statistics(step_probs(q, k), needs))


def prompt_statistics(q: Tensor, k: Tensor, needs: Needs, chunk: int | None = None) -> tuple[Tensor | None,
                                                                                             Tensor | None]:
    """The probabilities' last rows and column sums of a prompt attending to itself, chunk by chunk.

    q (B, H, T, d), k (B, H_kv, T, d): the prompt's queries and keys, key slot s at position s. The output
    comes from ``scaled_dot_product_attention``; this only computes what a policy asked for (``needs``),
    without the values and without the (T, T) matrix: a chunk of queries [i, j) sees only the keys
    [0, j), and only the chunk's own keys [i, j) need a (triangular) mask. Without column sums, only the
    asked rows are computed at all. Returns (probs (B, H, R, T) or None, col_sums (B, H, T) or None) as
    ``attend`` does.
    """
    B, H, T, d = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    chunk = queries_per_chunk(B, H, T, chunk)
    keep_rows = T if needs.rows is None else min(needs.rows, T)
    first_kept = T - keep_rows                                         # rows before it are not returned
    col_sums = q.new_zeros(B, H, T, dtype=torch.float32) if needs.col_sums else None
    rows = []
    for i in range(0 if needs.col_sums else first_kept, T, chunk):
        j = min(i + chunk, T)
        C = j - i
        qg = q[:, :, i:j].reshape(B, H_kv, G * C, d) / math.sqrt(d)   # (B, H_kv, G*C, d)
        scores = (qg @ k[:, :, :j].transpose(-1, -2)).view(B, H_kv, G, C, j)
        future = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)   # key i+b after query i+a
        scores[..., i:].masked_fill_(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(B, H, C, j)         # (B, H, C, j)
        if col_sums is not None:
            col_sums[..., :j] += probs.float().sum(dim=2)
        if j > first_kept:                                             # padded with zeros: keys after j
            rows.append(F.pad(probs[:, :, max(0, first_kept - i):], (0, T - j)))
    return (torch.cat(rows, dim=2) if keep_rows else None), col_sums


def attend_masked(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, needs: Needs = Needs(),
                  chunk: int | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The general path: the mask from positions, the queries in chunks. Arguments and result as ``attend``.

    A chunk of C queries costs a (B, H, C, Tk) score tensor, so a long prompt never holds the (Tq, Tk)
    matrix: the outputs of the chunks are concatenated, the column sums added up, and only the rows a
    policy asked for are kept.
    """
    B, H, Tq, d = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    G = H // H_kv
    chunk = queries_per_chunk(B, H, Tk, chunk)
    keep_rows = Tq if needs.rows is None else min(needs.rows, Tq)   # the last `keep_rows` rows are returned
    first_kept = Tq - keep_rows                                     # rows before it are not returned
    kp = k_pos[:, :, None, None, :]                                     # (B, H_kv, 1, 1, Tk)
    outs, kept_probs = [], []
    col_sums = q.new_zeros(B, H, Tk, dtype=torch.float32) if needs.col_sums else None
    for i in range(0, Tq, chunk):
        qc, pc = q[:, :, i:i + chunk], q_pos[i:i + chunk]              # (B, H, C, d), (C,)
        C = qc.shape[2]
        qg = qc.reshape(B, H_kv, G * C, d) / math.sqrt(d)              # (B, H_kv, G*C, d) rows per KV head
        scores = (qg @ k.transpose(-1, -2)).view(B, H_kv, G, C, Tk)    # (B, H_kv, G, C, Tk)
        # BEGIN SOLUTION [cache] may query c (position pc[c]) see slot s (position kp[..., s]; -1 = empty slot)?
        visible = (kp <= pc[:, None]) & (kp >= 0)                      # (B, H_kv, 1, C, Tk)
        # END SOLUTION
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)                          # (B, H_kv, G, C, Tk)
        outs.append((probs.view(B, H_kv, G * C, Tk) @ v).view(B, H, C, d))
        probs = probs.view(B, H, C, Tk)
        if col_sums is not None:
            col_sums += probs.float().sum(dim=2)
        if i + C > first_kept:
            kept_probs.append(probs[:, :, max(0, first_kept - i):])
    return torch.cat(outs, dim=2), (torch.cat(kept_probs, dim=2) if keep_rows else None), col_sums


class CausalSelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention. Weight names follow Hugging Face Llama (q/k/v/o_proj)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        H, H_kv, d, D = config.n_head, config.n_kv_head, config.head_dim, config.d_model
        self.q_proj = nn.Linear(D, H * d, bias=config.bias)
        self.k_proj = nn.Linear(D, H_kv * d, bias=config.bias)
        self.v_proj = nn.Linear(D, H_kv * d, bias=config.bias)
        self.o_proj = nn.Linear(H * d, D, bias=config.bias)            # W_O, shape (D, H*d)

    @classmethod
    def new_storage(cls, config: ModelConfig) -> LayerKV:
        """An empty layer of the cache: k, v (B, H_kv, T, d), pos (B, H_kv, T), per-slot state."""
        return LayerKV()

    @staticmethod
    def attend_entries(q: Tensor, entries: LayerKV, q_pos: Tensor,
                       needs: Needs = Needs()) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The step's queries (B, H, Tq, d) over stored (or rebuilt) entries; see :func:`attend`."""
        return attend(q, entries.k, entries.v, q_pos, entries.pos, needs, dense=entries.dense)

    def forward(self, x: Tensor, pos: Tensor, rope: tuple[Tensor, Tensor] | None,
                cache=None) -> Tensor:
        """x (B, T, D) at positions ``pos`` (T,); rope = (cos, sin) for those positions or None; ``cache`` a
        ``KVCache`` or None (not annotated: ``cache.py`` imports this module, not the other way round)."""
        B, T, _ = x.shape
        H, H_kv, d = self.config.n_head, self.config.n_kv_head, self.config.head_dim
        q = self.q_proj(x).view(B, T, H, d).transpose(1, 2)             # (B, H, T, d)
        k = self.k_proj(x).view(B, T, H_kv, d).transpose(1, 2)          # (B, H_kv, T, d)
        v = self.v_proj(x).view(B, T, H_kv, d).transpose(1, 2)          # (B, H_kv, T, d)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)           # keys are cached after RoPE
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H_kv != H)
        else:
            y = cache.attend(self.layer_idx, self, q, pos, (k, v))      # store, attend, run the policy
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * d))


# ----------------------------------------------------------------------------------------------------------
# The registry of attention modules the config can name.

ATTENTION: dict[str, type[nn.Module]] = {"causal": CausalSelfAttention}


def attention_class(name: str) -> type[nn.Module]:
    """The attention module ``config.attention`` names: a key of ``ATTENTION`` or ``"package.module:Class"``."""
    if name in ATTENTION:
        return ATTENTION[name]
    if ":" not in name:
        raise ValueError(f"unknown attention module {name!r}; choose one of {sorted(ATTENTION)} or give "
                         "'package.module:Class'")
    module_name, _, class_name = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"attention module {name!r} cannot be imported: {e}") from e
    for method in ("new_storage", "attend_entries", "forward"):
        if not hasattr(cls, method):
            raise ValueError(f"attention module {name!r} has no {method}(); see nanollm/attention.py")
    return cls
