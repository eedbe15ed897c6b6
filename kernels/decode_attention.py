"""
Decode attention: one query token per sequence over a KV cache (GQA), split along the sequence (flash-decoding).

A decode step is memory-bound: it reads every cached key and value once, so a KV-cache method speeds it up
exactly by reading fewer bytes. One split kernel and its merge serve three launchers, q (B, H, d) -> (B, H, d):

    out = decode_attention_triton(q, k, v)                   # k, v (B, H_kv, S, d), contiguous
    out = selected_decode_attention_triton(q, k, v, idx)     # idx (B, H_kv, K) rows per head, -1 = padding
    out = masked_decode_attention_triton(q, k, v, pos)       # pos (B, H_kv, S): -1 marks an empty slot

tested against ``reference_decode_attention``, ``reference_selected_decode_attention`` and
``reference_masked_decode_attention`` (same arguments, any device). Launch settings come from the caller or
``TUNED`` (filled by ``fastpath/tune.py``).

How it works, step by step: kernels/inside.md, section "decode_attention.py".
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import HAS_TRITON, default_scale, fill_splits, next_pow2, split_ranges

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
    scale = default_scale(scale, d)
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
    scale = default_scale(scale, d)
    rows = idx.clamp(min=0)[..., None].expand(-1, -1, -1, d)
    ks, vs = k.float().gather(2, rows), v.float().gather(2, rows)         # (B, H_kv, K, d)
    s = q.float().view(B, H_kv, H // H_kv, d) @ ks.transpose(-1, -2) * scale
    s = s.masked_fill((idx < 0)[:, :, None, :], float("-inf"))          # padding is never attended
    return (torch.softmax(s, dim=-1) @ vs).view(B, H, d).to(q.dtype)


def reference_masked_decode_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor,
                                      scale: float | None = None) -> Tensor:
    """The same over the slots of k, v whose position ``pos`` (B, H_kv, S) is >= 0 (-1: an empty slot, never
    attended). Every (sequence, KV head) must hold at least one entry."""
    check_decode_args(q, k, v)
    if pos.shape != k.shape[:3]:
        raise ValueError(f"pos must have shape (B, H_kv, S) = {tuple(k.shape[:3])}, got {tuple(pos.shape)}")
    B, H, d = q.shape
    H_kv = k.shape[1]
    scale = default_scale(scale, d)
    s = q.float().view(B, H_kv, H // H_kv, d) @ k.float().transpose(-1, -2) * scale     # (B, H_kv, G, S)
    s = s.masked_fill((pos < 0)[:, :, None, :], float("-inf"))
    return (torch.softmax(s, dim=-1) @ v.float()).view(B, H, d).to(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# The kernel: one program per (sequence, KV head, range of tokens)

if HAS_TRITON:

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, idx_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, s_ptr, ev_ptr,
        n_tokens, tokens_per_split, scale, n_sink,
        stride_qb, stride_qh,                       # q (B, H, d), last stride 1
        stride_kb, stride_kh, stride_ks,            # k (B, H_kv, S, d), last stride 1
        stride_vb, stride_vh, stride_vs,            # v likewise
        stride_ib, stride_ih,                       # idx (B, H_kv, K), last stride 1 (GATHER only)
        stride_pb, stride_ph,                       # pos (B, H_kv, S), last stride 1 (MASKED only)
        H_kv: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
        BLOCK_N: tl.constexpr, GATHER: tl.constexpr, MASKED: tl.constexpr, DOT_FP32: tl.constexpr,
        SCORES: tl.constexpr, EVICT: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)         # which (sequence, KV head); int64: large caches
        split = tl.program_id(1)                   # which range of tokens
        b, h = bh // H_kv, bh % H_kv
        g = tl.arange(0, G_PAD)                    # query heads of this group, padded to >= 16 rows for tl.dot
        dim = tl.arange(0, D)
        q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + dim[None, :],
                    mask=(g < G)[:, None], other=0.0).to(tl.float32) * scale          # (G_PAD, D)
        if not DOT_FP32:                           # fp16/bf16 caches: the tensor cores' input type
            q = q.to(k_ptr.dtype.element_ty)

        m = tl.full([G_PAD], float("-inf"), tl.float32)                              # running max
        l = tl.zeros([G_PAD], tl.float32)                                            # running sum
        acc = tl.zeros([G_PAD, D], tl.float32)                                       # running output
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, n_tokens)
        # EVICT, per column of the blocks (reduced once, after the loop): the oldest position after the
        # sinks (2^63 - 1: none), its slot (0, the head's first slot, where there is none) and the entries
        oldest = tl.full([BLOCK_N], 2**63 - 1, tl.int64)
        oldest_slot = tl.zeros([BLOCK_N], tl.int32)
        held = tl.zeros([BLOCK_N], tl.int32)
        for first in range(start, end, BLOCK_N):
            n = first + tl.arange(0, BLOCK_N)                                         # (BLOCK_N,)
            valid = n < end
            if GATHER:                            # the cache rows this head selected; -1 is padding
                rows = tl.load(idx_ptr + b * stride_ib + h * stride_ih + n, mask=valid, other=-1)
                valid = valid & (rows >= 0)
                rows = tl.where(valid, rows, 0)
            else:
                rows = n
                if MASKED:                        # a slot whose position is -1 is empty
                    slot_pos = tl.load(pos_ptr + b * stride_pb + h * stride_ph + n, mask=valid, other=-1)
                    valid = valid & (slot_pos >= 0)
                    if EVICT:                     # StreamingLLM's choice, from the positions read anyway
                        later = tl.where(valid & (slot_pos >= n_sink), slot_pos, 2**63 - 1)
                        oldest_slot = tl.where(later < oldest, n, oldest_slot)     # the earlier slot on a tie
                        oldest = tl.minimum(later, oldest)
                        held += valid.to(tl.int32)
            kb = tl.load(k_ptr + b * stride_kb + h * stride_kh + rows[:, None] * stride_ks + dim[None, :],
                         mask=valid[:, None], other=0.0)                              # (BLOCK_N, D)
            vb = tl.load(v_ptr + b * stride_vb + h * stride_vh + rows[:, None] * stride_vs + dim[None, :],
                         mask=valid[:, None], other=0.0)                              # (BLOCK_N, D)
            # BEGIN SOLUTION [kernels:online_softmax] FlashAttention sec. 3.1 (Algorithm 1) for one block of K, V
            if DOT_FP32:
                kb, vb = kb.to(tl.float32), vb.to(tl.float32)
                s = tl.dot(q, tl.trans(kb), input_precision="ieee")                   # (G_PAD, BLOCK_N)
            else:
                s = tl.dot(q, tl.trans(kb))
            s = tl.where(valid[None, :], s, float("-inf"))                            # padding: never attended
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # a range with no valid token so far keeps m = -inf; exp(-inf - -inf) would be nan
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)                                                # rescale the old sums
            p = tl.exp(s - m_safe[:, None])                                           # (G_PAD, BLOCK_N)
            l = l * alpha + tl.sum(p, axis=1)
            if DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, vb, input_precision="ieee")    # (G_PAD, D)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
            m = m_new
            # END SOLUTION
            if SCORES:                            # kept for H2O (heavy_hitters.py): the block's scores s, fp32
                tl.store(s_ptr + (bh * G + g)[:, None] * n_tokens + n[None, :], s,
                         mask=(g < G)[:, None] & (n < end)[None, :])                  # (B * H_kv, G, n_tokens)

        out = (bh * tl.num_programs(1) + split) * G + g                              # partials' rows
        tl.store(m_ptr + out, m, mask=g < G)                                          # the G real heads
        tl.store(l_ptr + out, l, mask=g < G)
        tl.store(acc_ptr + out[:, None] * D + dim[None, :], acc, mask=(g < G)[:, None])
        if EVICT:                                  # (B * H_kv, splits, 3): oldest, its slot, entries held
            part = (bh * tl.num_programs(1) + split) * 3
            low = tl.min(oldest, axis=0)
            at = tl.min(tl.where(oldest == low, oldest_slot, n_tokens), axis=0)    # the first slot of the oldest
            tl.store(ev_ptr + part, low)
            tl.store(ev_ptr + part + 1, at.to(tl.int64))
            tl.store(ev_ptr + part + 2, tl.sum(held, axis=0).to(tl.int64))


def default_block_n(dtype: torch.dtype) -> int:
    """Tokens per block: 64 for 16-bit caches, 32 for fp32 (whose IEEE ``tl.dot`` stages wider operands)."""
    return 32 if dtype == torch.float32 else 64


class Launch(NamedTuple):
    """How the split kernel is launched: tokens per block, programs per SM (the number of ranges follows
    from it, ``fill_splits``), and Triton's ``num_warps`` and ``num_stages`` (None: Triton's defaults)."""
    block_n: int
    per_sm: int
    num_warps: int | None = None
    num_stages: int | None = None


DEFAULT_PER_SM = 2
# Launch settings by (head dimension, cache dtype, slots) that a caller above timed on the GPU at hand and
# chose (``fastpath/tune.py``); a launch whose settings are not given explicitly takes them from here (those
# timed on the nearest number of slots), else the defaults (``default_launch``).
TUNED: dict[tuple[int, torch.dtype, int], Launch] = {}


def default_launch(dtype: torch.dtype) -> Launch:
    """``default_block_n`` tokens a block, ``DEFAULT_PER_SM`` programs per SM, Triton's warps and stages."""
    return Launch(default_block_n(dtype), DEFAULT_PER_SM)


def launch_settings(k: Tensor, block_n: int | None = None, slots: int | None = None) -> Launch:
    """The settings a launch over the cache ``k`` (..., slots, d) takes when none are given: ``TUNED``'s for
    its head size and dtype, timed on the number of slots nearest its own (``slots``: the rows the kernel
    walks, all of ``k``'s unless given; by ratio: 900 slots take the settings of 819 before those of 8,192),
    or the defaults; with ``block_n`` given, the defaults for it (the tuned warps and stages go with the
    tuned block)."""
    if block_n is not None:
        return Launch(block_n, DEFAULT_PER_SM)
    slots = max(1, k.shape[-2] if slots is None else slots)
    timed = [key for key in TUNED if key[:2] == (k.shape[-1], k.dtype)]
    if not timed:
        return default_launch(k.dtype)
    return TUNED[min(timed, key=lambda key: (abs(math.log(slots / key[2])), key[2]))]


def merge_splits(m: Tensor, l: Tensor, acc: Tensor) -> Tensor:
    """The reduction in PyTorch (the reference): partials m, l (R, splits, G) and acc (R, splits, G, d) ->
    (R, G, d) in fp32. A range with no token (m = -inf, l = 0, acc = 0) adds nothing."""
    # BEGIN SOLUTION [kernels:merge_splits] FlashAttention sec. 3.1: the softmax of all ranges from their m, l, acc
    M = m.max(dim=1, keepdim=True).values                                  # (R, 1, G)
    w = torch.exp(m - M)                                                   # a range with no token: exp(-inf) = 0
    return (w[..., None] * acc).sum(1) / (w * l).sum(1)[..., None]
    # END SOLUTION


if HAS_TRITON:

    @triton.jit
    def _merge_splits_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, n_splits,
                             G: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
        """``merge_splits`` as one launch (its PyTorch form is eight small kernels, tens of microseconds
        next to a decode step of a few hundred): one program per (row, query head) of the partials, out
        (R, G, D) in its own dtype, BLOCK_S ranges at a time."""
        # BEGIN SOLUTION [kernels:merge_splits] FlashAttention sec. 3.1: the softmax of all ranges from their m, l, acc
        r = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        sp = tl.arange(0, BLOCK_S)
        dim = tl.arange(0, D)
        M = tl.full([BLOCK_S], float("-inf"), tl.float32)
        for first in range(0, n_splits, BLOCK_S):                              # pass 1: the overall max
            M = tl.maximum(M, tl.load(m_ptr + (r * n_splits + first + sp) * G + g,
                                      mask=first + sp < n_splits, other=float("-inf")))
        M_all = tl.max(M, axis=0)
        l_sum = tl.zeros([BLOCK_S], tl.float32)
        o = tl.zeros([D], tl.float32)
        for first in range(0, n_splits, BLOCK_S):                              # pass 2: weighted sums
            row = (r * n_splits + first + sp) * G + g                          # (BLOCK_S,)
            ok = first + sp < n_splits
            w = tl.exp(tl.load(m_ptr + row, mask=ok, other=float("-inf")) - M_all)   # empty range: 0
            l_sum += w * tl.load(l_ptr + row, mask=ok, other=0.0)
            acc = tl.load(acc_ptr + row[:, None] * D + dim[None, :], mask=ok[:, None], other=0.0)
            o += tl.sum(w[:, None] * acc, axis=0)
        o = o / tl.sum(l_sum, axis=0)
        tl.store(out_ptr + (r * G + g) * D + dim, o.to(out_ptr.dtype.element_ty))
        # END SOLUTION

    @triton.jit
    def softmax_totals(m_ptr, l_ptr, bh, n_splits, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_S: tl.constexpr):
        """Each query head's softmax max M and sum L over all ranges of row ``bh`` of the partials m, l
        (R, splits, G), as the merge combines them: (G_PAD,) each, the padding heads at 0 and 1. For the
        kernels that need the probabilities themselves, exp(s - M) / L (``heavy_hitters.py``,
        ``scissorhands.py``)."""
        g = tl.arange(0, G_PAD)
        real = g < G                               # the group's query heads (G_PAD: a power of two)
        sp = tl.arange(0, BLOCK_S)
        M = tl.full([G_PAD], float("-inf"), tl.float32)
        for first in range(0, n_splits, BLOCK_S):
            ok = ((first + sp) < n_splits)[:, None] & real[None, :]
            rows = (bh * n_splits + first + sp)[:, None] * G + g[None, :]               # (BLOCK_S, G_PAD)
            M = tl.maximum(M, tl.max(tl.load(m_ptr + rows, mask=ok, other=float("-inf")), axis=0))
        M = tl.where(real, M, 0.0)                 # padding rows: any finite number
        L = tl.zeros([G_PAD], tl.float32)
        for first in range(0, n_splits, BLOCK_S):
            ok = ((first + sp) < n_splits)[:, None] & real[None, :]
            rows = (bh * n_splits + first + sp)[:, None] * G + g[None, :]
            w = tl.exp(tl.load(m_ptr + rows, mask=ok, other=float("-inf")) - M[None, :])  # empty range: 0
            L += tl.sum(w * tl.load(l_ptr + rows, mask=ok, other=0.0), axis=0)
        return M, tl.where(real, L, 1.0)


def _launch(q: Tensor, k: Tensor, v: Tensor, idx: Tensor | None, scale: float | None, block_n: int | None,
            splits: int | None, num_warps: int | None = None, num_stages: int | None = None,
            pos: Tensor | None = None) -> Tensor:
    m, l, acc = decode_partials_triton(q, k, v, idx, scale, block_n, splits, num_warps, num_stages, pos)
    return merge_splits_triton(m, l, acc, q.dtype).view(q.shape)      # rows (b, h_kv, g) = (b, h)


def split_plan(q: Tensor, k: Tensor, n_tokens: int, block_n: int | None = None,
               splits: int | None = None) -> tuple[int, int, int]:
    """How the split kernel cuts n_tokens: (tokens per block, blocks per range, ranges), every range whole
    blocks and at least one (``split_ranges``); None takes ``launch_settings`` (tuned, or the defaults), the
    ranges from its programs per SM (``fill_splits``). A caller sizing a buffer per range asks here, as the
    launcher does."""
    settings = launch_settings(k, block_n, n_tokens)
    block_n = settings.block_n
    blocks_per_split, splits = split_ranges(triton.cdiv(n_tokens, block_n),
                                            splits or fill_splits(q, q.shape[0] * k.shape[1], settings.per_sm))
    return block_n, blocks_per_split, splits


def decode_partials_triton(q: Tensor, k: Tensor, v: Tensor, idx: Tensor | None = None, scale: float | None = None,
                           block_n: int | None = None, splits: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, pos: Tensor | None = None,
                           scores: Tensor | None = None, evict: Tensor | None = None,
                           n_sink: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """The split kernel alone (no checks of the arguments): each (sequence, KV head) row's ranges' running max
    m and sum l (B * H_kv, splits, G) and output acc (B * H_kv, splits, G, d), fp32; a range with no valid
    token has m = -inf, l = 0, acc = 0. ``pos`` (B, H_kv, S), if given, masks the slots at -1 (not with idx).
    ``scores``, if given (B * H_kv, G, S), contiguous fp32, receives every token's scaled score q.k / sqrt(d)
    as the kernel computed it, -inf where masked: what H2O needs beside the output (``heavy_hitters.py``).
    ``evict``, if given (B * H_kv, splits, 3), contiguous int64, with pos: each range's oldest position at or
    after ``n_sink`` (2^63 - 1 where none), its slot, and the entries it holds: StreamingLLM's choice of the
    slot to empty, read from the positions the kernel loads anyway (``streaming.py``)."""
    if not HAS_TRITON:
        raise RuntimeError("the decode kernels need triton; use reference_decode_attention, "
                           "reference_selected_decode_attention or reference_masked_decode_attention")
    B, H, d = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    n_tokens = idx.shape[2] if idx is not None else k.shape[2]
    settings = launch_settings(k, block_n, n_tokens)                         # before block_n takes its value
    block_n, blocks_per_split, splits = split_plan(q, k, n_tokens, block_n, splits)
    if d & (d - 1) or d < 16:
        raise ValueError(f"the kernels take a head dimension that is a power of two >= 16, got {d}")
    if block_n & (block_n - 1) or block_n < 16:
        raise ValueError(f"block_n must be a power of two >= 16 (tl.dot needs tiles of at least 16), got {block_n}")
    scale = default_scale(scale, d)
    q = q.contiguous() if q.stride(-1) != 1 else q
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    per_split = block_n * blocks_per_split                                     # whole blocks per range
    G_PAD = max(16, next_pow2(G))                                              # tl.dot's smallest tile
    # fp32 caches multiply in IEEE fp32; so does bf16 in the CPU interpreter, whose bf16 tl.dot multiplies
    # the operands' raw bits (triton-lang/triton#11584)
    dot_fp32 = k.dtype == torch.float32 or (k.dtype == torch.bfloat16 and not k.is_cuda)
    m = torch.empty(B * H_kv, splits, G, device=q.device, dtype=torch.float32)
    l, acc = torch.empty_like(m), torch.empty(B * H_kv, splits, G, d, device=q.device, dtype=torch.float32)
    if idx is not None and (idx.dtype != torch.int32 or not idx.is_contiguous()):
        idx = idx.to(torch.int32).contiguous()
    ix = idx if idx is not None else m                                        # any pointer when not gathering
    if pos is not None and idx is not None:
        raise ValueError("give idx (selected rows) or pos (empty slots masked), not both")
    if pos is not None and pos.stride(-1) != 1:
        pos = pos.contiguous()
    px = pos if pos is not None else m                                        # any pointer when not masking
    if scores is not None and (scores.shape != (B * H_kv, G, n_tokens) or scores.dtype != torch.float32
                               or not scores.is_contiguous()):
        raise ValueError(f"scores must be a contiguous fp32 tensor of shape {(B * H_kv, G, n_tokens)}")
    sx = scores if scores is not None else m                                  # any pointer when not keeping them
    if evict is not None and (pos is None or evict.shape != (B * H_kv, splits, 3) or evict.dtype != torch.long
                              or not evict.is_contiguous()):
        raise ValueError(f"evict needs pos and a contiguous int64 tensor of shape {(B * H_kv, splits, 3)}")
    ex = evict if evict is not None else m                                    # any pointer when not evicting
    num_warps, num_stages = num_warps or settings.num_warps, num_stages or settings.num_stages
    launch = {k_: v_ for k_, v_ in (("num_warps", num_warps), ("num_stages", num_stages)) if v_ is not None}
    _decode_split_kernel[(B * H_kv, splits)](
        q, k, v, ix, px, m, l, acc, sx, ex, n_tokens, per_split, scale, int(n_sink),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        ix.stride(0) if idx is not None else 0, ix.stride(1) if idx is not None else 0,
        px.stride(0) if pos is not None else 0, px.stride(1) if pos is not None else 0,
        H_kv=H_kv, G=G, G_PAD=G_PAD, D=d, BLOCK_N=block_n, GATHER=idx is not None, MASKED=pos is not None,
        DOT_FP32=dot_fp32, SCORES=scores is not None, EVICT=evict is not None, **launch)
    return m, l, acc


def merge_splits_triton(m: Tensor, l: Tensor, acc: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``merge_splits`` as one launch of ``_merge_splits_kernel``: m, l (R, splits, G), acc (R, splits, G, d),
    contiguous fp32 -> (R, G, d) in ``dtype``."""
    R, splits, G, d = acc.shape
    out = torch.empty(R, G, d, device=acc.device, dtype=dtype)
    _merge_splits_kernel[(R, G)](m, l, acc, out, splits, G=G, D=d, BLOCK_S=32)
    return out


def decode_attention_triton(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None,
                            block_n: int | None = None, splits: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None) -> Tensor:
    """The kernel over a contiguous cache (always the Triton path). Shapes as ``reference_decode_attention``.
    ``block_n`` tokens per block, ``splits`` ranges per (sequence, KV head), ``num_warps`` and
    ``num_stages`` (Triton's launch options): None takes ``launch_settings`` (``TUNED``'s, or the defaults)."""
    check_decode_args(q, k, v)
    return _launch(q, k, v, None, scale, block_n, splits, num_warps, num_stages)


def selected_decode_attention_triton(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, scale: float | None = None,
                                     block_n: int | None = None, splits: int | None = None,
                                     validate: bool = True, num_warps: int | None = None,
                                     num_stages: int | None = None) -> Tensor:
    """The kernel over the rows ``idx`` (B, H_kv, K) of each KV head, gathered in-kernel. ``validate=False``
    skips the checks of the indices' values (they synchronise with the GPU): for timing, with an int32
    ``idx`` the caller knows is valid."""
    if validate:
        check_decode_args(q, k, v, idx)
    return _launch(q, k, v, idx, scale, block_n, splits, num_warps, num_stages)


def masked_decode_attention_triton(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float | None = None,
                                   block_n: int | None = None, splits: int | None = None) -> Tensor:
    """The kernel over a contiguous buffer whose slots at position -1 in ``pos`` (B, H_kv, S) are empty.
    Shapes as ``reference_masked_decode_attention``. Only the shapes are checked (the values would need the
    host to wait for the GPU, which a CUDA graph cannot): a (sequence, KV head) with no entry gets NaN."""
    check_decode_args(q, k, v)
    if pos.shape != k.shape[:3]:
        raise ValueError(f"pos must have shape (B, H_kv, S) = {tuple(k.shape[:3])}, got {tuple(pos.shape)}")
    return _launch(q, k, v, None, scale, block_n, splits, pos=pos)
