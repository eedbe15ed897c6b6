"""
Decode attention: one query token per sequence over a KV cache, split along the sequence.

A decode step reads every cached key and value once and does two multiply-adds per element it reads:
its arithmetic intensity is about G / bytes-per-element FLOP per byte (G query heads per KV head), far
below what a GPU can compute per byte it loads. So the step is memory-bound, its floor is

    time >= 2 * B * H_kv * S * d * bytes_per_element / bandwidth

and a KV-cache method speeds decoding up exactly by reading fewer bytes. Two kernels show it:

* over a **contiguous** cache k, v (B, H_kv, S, d): the full cache, or a compressed one stored compactly;
* over **selected indices** idx (B, H_kv, K): each KV head reads only its K chosen rows of the full cache,
  gathered inside the kernel (no compacted copy is written; -1 entries are padding, as AdaKV's ragged
  per-head budgets leave them).

How the work is split (flash-decoding). One query token gives too little parallelism per (sequence, KV
head) for a long cache, so the tokens are cut into ``splits`` ranges and each program handles one
(sequence, KV head, range): it loads the G query heads of its group once, walks its range in blocks of
BLOCK_N tokens keeping an online softmax (a running max m, running sum l and output accumulator per query
head), and writes (m, l, acc). A small reduction then merges the ranges:

    M = max_s m_s,   o = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s

The scores are computed with broadcasts and sums rather than ``tl.dot``: a group holds 1-8 query heads,
below the 16 rows a tensor-core tile needs, and the step is bound by loading K and V, not by arithmetic.

    out = decode_attention(q, k, v)                        # q (B, H, d), k, v (B, H_kv, S, d) -> (B, H, d)
    out = selected_decode_attention(q, k, v, idx)          # idx (B, H_kv, K) rows of k, v per head
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl


# ----------------------------------------------------------------------------------------------------------
# References


def check_decode_args(q: Tensor, k: Tensor, v: Tensor, idx: Tensor | None = None) -> None:
    """One-line errors for shapes the kernels cannot take, before anything runs."""
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q (B, H, d) and k, v (B, H_kv, S, d) of equal shapes, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, H, d = q.shape
    if k.shape[0] != B or k.shape[3] != d or H % k.shape[1] != 0:
        raise ValueError(f"q {tuple(q.shape)} does not match k {tuple(k.shape)}: batch and head dim must agree "
                         "and the query heads must be a multiple of the KV heads")
    if k.shape[2] == 0:
        raise ValueError("the cache is empty: a decode step needs at least one cached token")
    if idx is not None:
        if idx.dim() != 3 or idx.shape[:2] != k.shape[:2]:
            raise ValueError(f"idx must have shape (B, H_kv, K) = {tuple(k.shape[:2])} + (K,), got {tuple(idx.shape)}")
        if idx.shape[2] == 0:
            raise ValueError("empty selection: idx selects no token (K = 0)")
        if not bool((idx >= 0).any(-1).all()):
            raise ValueError("empty selection: some (sequence, KV head) selects no token (all -1)")
        if bool((idx >= k.shape[2]).any()):
            raise ValueError(f"idx has entries >= the cache length {k.shape[2]}")


def reference_decode_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Softmax attention of one query per sequence over the whole cache, in fp32. Query head h reads KV head
    h // G. q (B, H, d), k, v (B, H_kv, S, d) -> (B, H, d) in q's dtype."""
    check_decode_args(q, k, v)
    B, H, d = q.shape
    H_kv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.float().view(B, H_kv, H // H_kv, d)                            # (B, H_kv, G, d)
    s = qg @ k.float().transpose(-1, -2) * scale                          # (B, H_kv, G, S)
    out = torch.softmax(s, dim=-1) @ v.float()                            # (B, H_kv, G, d)
    return out.view(B, H, d).to(q.dtype)


def reference_selected_decode_attention(q: Tensor, k: Tensor, v: Tensor, idx: Tensor,
                                        scale: float | None = None) -> Tensor:
    """The same over the rows ``idx`` (B, H_kv, K) of each KV head (-1: padding, skipped): gathered, then
    attended. (A materialised copy: what the kernel avoids.)"""
    check_decode_args(q, k, v, idx)
    B, H, d = q.shape
    H_kv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rows = idx.clamp(min=0)[..., None].expand(-1, -1, -1, d)
    ks, vs = k.float().gather(2, rows), v.float().gather(2, rows)         # (B, H_kv, K, d)
    s = q.float().view(B, H_kv, H // H_kv, d) @ ks.transpose(-1, -2) * scale
    s = s.masked_fill((idx < 0)[:, :, None, :], float("-inf"))          # padding is never attended
    return (torch.softmax(s, dim=-1) @ vs).view(B, H, d).to(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# The kernel: one program per (sequence, KV head, range of tokens)

if HAS_TRITON:

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, idx_ptr, m_ptr, l_ptr, acc_ptr,
        n_tokens, tokens_per_split, scale,
        stride_qb, stride_qh,                       # q (B, H, d), last stride 1
        stride_kb, stride_kh, stride_ks,            # k (B, H_kv, S, d), last stride 1
        stride_vb, stride_vh, stride_vs,            # v likewise
        stride_ib, stride_ih,                       # idx (B, H_kv, K), last stride 1 (GATHER only)
        H_kv: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
        BLOCK_N: tl.constexpr, GATHER: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)         # which (sequence, KV head); int64: large caches
        split = tl.program_id(1)                   # which range of tokens
        b, h = bh // H_kv, bh % H_kv
        g = tl.arange(0, G_PAD)                    # query heads of this group (padded to a power of 2)
        dim = tl.arange(0, D)
        q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + dim[None, :],
                    mask=(g < G)[:, None], other=0.0).to(tl.float32) * scale          # (G_PAD, D)

        m = tl.full([G_PAD], float("-inf"), tl.float32)                              # running max
        l = tl.zeros([G_PAD], tl.float32)                                            # running sum
        acc = tl.zeros([G_PAD, D], tl.float32)                                       # running output
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, n_tokens)
        for first in range(start, end, BLOCK_N):
            n = first + tl.arange(0, BLOCK_N)                                         # (BLOCK_N,)
            valid = n < end
            if GATHER:                            # the cache rows this head selected; -1 is padding
                rows = tl.load(idx_ptr + b * stride_ib + h * stride_ih + n, mask=valid, other=-1)
                valid = valid & (rows >= 0)
                rows = tl.where(valid, rows, 0)
            else:
                rows = n
            kb = tl.load(k_ptr + b * stride_kb + h * stride_kh + rows[:, None] * stride_ks + dim[None, :],
                         mask=valid[:, None], other=0.0).to(tl.float32)               # (BLOCK_N, D)
            vb = tl.load(v_ptr + b * stride_vb + h * stride_vh + rows[:, None] * stride_vs + dim[None, :],
                         mask=valid[:, None], other=0.0).to(tl.float32)               # (BLOCK_N, D)
            s = tl.sum(q[:, None, :] * kb[None, :, :], axis=2)                        # (G_PAD, BLOCK_N)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # a range with no valid token so far keeps m = -inf; exp(-inf - -inf) would be nan
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)                                                # rescale the old sums
            p = tl.exp(s - m_safe[:, None])                                           # (G_PAD, BLOCK_N)
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vb[None, :, :], axis=1)
            m = m_new

        out = (bh * tl.num_programs(1) + split) * G_PAD + g                          # partials' rows
        tl.store(m_ptr + out, m)
        tl.store(l_ptr + out, l)
        tl.store(acc_ptr + out[:, None] * D + dim[None, :], acc)


def default_splits(q: Tensor, B: int, H_kv: int, n_tokens: int, block_n: int) -> int:
    """Ranges per (sequence, KV head): enough programs to give every SM of the GPU two (one range in the
    interpreter, which runs programs one after another), never a range shorter than one block."""
    programs = 2 * torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
    return max(1, min(triton.cdiv(n_tokens, block_n), triton.cdiv(programs, B * H_kv)))


def default_block_n(G: int, d: int) -> int:
    """Tokens per block: the (G_PAD, BLOCK_N, d) products of a block live in registers; about 8K of them
    keeps a program from spilling (checked by compiling for an H100: G = 4, d = 128 -> 16 tokens)."""
    return max(16, min(64, 8192 // (triton.next_power_of_2(G) * d)))


def merge_splits(m: Tensor, l: Tensor, acc: Tensor) -> Tensor:
    """The reduction: partials m, l (R, splits, G) and acc (R, splits, G, d) -> (R, G, d)."""
    M = m.max(dim=1, keepdim=True).values                                  # (R, 1, G)
    w = torch.exp(m - M)                                                   # a range with no token: exp(-inf) = 0
    return (w[..., None] * acc).sum(1) / (w * l).sum(1)[..., None]


def _launch(q: Tensor, k: Tensor, v: Tensor, idx: Tensor | None, scale: float | None, block_n: int | None,
            splits: int | None) -> Tensor:
    if not HAS_TRITON:
        raise RuntimeError("the decode kernels need triton; decode_attention() falls back to the reference")
    B, H, d = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    block_n = block_n or default_block_n(G, d)
    if d & (d - 1) or d < 16:
        raise ValueError(f"the kernels take a head dimension that is a power of two >= 16, got {d}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q = q.contiguous() if q.stride(-1) != 1 else q
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    n_tokens = idx.shape[2] if idx is not None else k.shape[2]
    splits = splits or default_splits(q, B, H_kv, n_tokens, block_n)
    per_split = block_n * triton.cdiv(triton.cdiv(n_tokens, splits), block_n)   # whole blocks per range
    splits = triton.cdiv(n_tokens, per_split)
    G_PAD = triton.next_power_of_2(G)
    m = torch.empty(B * H_kv, splits, G_PAD, device=q.device, dtype=torch.float32)
    l, acc = torch.empty_like(m), torch.empty(B * H_kv, splits, G_PAD, d, device=q.device, dtype=torch.float32)
    if idx is not None and (idx.dtype != torch.int32 or not idx.is_contiguous()):
        idx = idx.to(torch.int32).contiguous()
    ix = idx if idx is not None else m                                        # any pointer when not gathering
    _decode_split_kernel[(B * H_kv, splits)](
        q, k, v, ix, m, l, acc, n_tokens, per_split, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        ix.stride(0) if idx is not None else 0, ix.stride(1) if idx is not None else 0,
        H_kv=H_kv, G=G, G_PAD=G_PAD, D=d, BLOCK_N=block_n, GATHER=idx is not None)
    out = merge_splits(m, l, acc)[:, :G]                                    # (B * H_kv, G, d)
    return out.reshape(B, H, d).to(q.dtype)


def decode_attention_triton(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None,
                            block_n: int | None = None, splits: int | None = None) -> Tensor:
    """The kernel over a contiguous cache (always the Triton path). Shapes as ``reference_decode_attention``."""
    check_decode_args(q, k, v)
    return _launch(q, k, v, None, scale, block_n, splits)


def selected_decode_attention_triton(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, scale: float | None = None,
                                     block_n: int | None = None, splits: int | None = None,
                                     validate: bool = True) -> Tensor:
    """The kernel over the rows ``idx`` (B, H_kv, K) of each KV head, gathered in-kernel. ``validate=False``
    skips the checks of the indices' values (they synchronise with the GPU): for timing, with an int32
    ``idx`` the caller knows is valid."""
    if validate:
        check_decode_args(q, k, v, idx)
    return _launch(q, k, v, idx, scale, block_n, splits)


# ----------------------------------------------------------------------------------------------------------
# The switch


def decode_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Decode attention: the Triton kernel where ``kernels.use_triton`` allows, else the reference."""
    if use_triton(q):
        return decode_attention_triton(q, k, v, scale)
    return reference_decode_attention(q, k, v, scale)


def selected_decode_attention(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, scale: float | None = None) -> Tensor:
    """Decode attention over selected rows: the Triton kernel where allowed, else the reference."""
    if use_triton(q):
        return selected_decode_attention_triton(q, k, v, idx, scale)
    return reference_selected_decode_attention(q, k, v, idx, scale)
