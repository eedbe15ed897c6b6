"""
Skinny q/k/v: a layer's q/k/v product with RoPE and the cache's write in its epilogue, one launch.

``skinny_matmul.py``'s ``norm_linear`` over the stacked q/k/v weight, where each program holds both halves of
every RoPE pair it computes, rotates q's and k's heads in registers, returns q (M, H, d) and stores k, v and the
step's position into each KV head's slot of the buffers, as ``cache_write.py`` would (``fastpath/skinny.py``).

    q = norm_qkv_rope_write_triton(x, g, eps, w, cos, sin, kb, vb, pos, slot, position)   # beside
    q = reference_norm_qkv_rope_write(x, g, eps, w, cos, sin, kb, vb, pos, slot, position)

Within ``skinny_matmul.TOLERANCE``; the slot is not checked (one outside [0, C) writes out of bounds). Launch
settings in ``SKINNY_TUNED[("qkv_rope_write", N, K, dtype)]``.

How it works, step by step: kernels/inside.md, section "skinny_qkv.py".
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON
from .cache_write import check_write_args, reference_write_entry
from .skinny_matmul import BLOCK_M, DEFAULT_LAUNCH, SKINNY_TUNED, SkinnyLaunch, check_product, reference_norm_linear

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .skinny_matmul import _products


# ----------------------------------------------------------------------------------------------------------
# The reference: norm_linear, then RoPE and the write as the fused step does them

def reference_norm_qkv_rope_write(x: Tensor, g: Tensor, eps: float, w: Tensor, cos: Tensor, sin: Tensor,
                                  kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, position: Tensor) -> Tensor:
    """x (M, K), the norm's g (K,), w ((H + 2 H_kv) d, K) q's rows then k's then v's, cos and sin (1, d) the
    step's angles, the buffers kb, vb (M, H_kv, C, d), pos (M, H_kv, C) and slot (M, H_kv), position (1,).
    Returns q (M, H, d), rotated; the new k (rotated) and v go into each KV head's slot, the position beside
    them (kb, vb and pos updated in place)."""
    M, H_kv, d = x.shape[0], kb.shape[1], kb.shape[-1]
    heads = reference_norm_linear(x, g, eps, w).view(M, -1, d)                      # (M, H + 2 H_kv, d)
    H = heads.shape[1] - 2 * H_kv
    qk, v = heads[:, :H + H_kv], heads[:, H + H_kv:]
    half = d // 2
    qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin     # RoPE, as apply_rope
    reference_write_entry(kb, vb, pos, slot, qk[:, H:, None], v[:, :, None], position)
    return qk[:, :H]


# ----------------------------------------------------------------------------------------------------------
# The kernel: one program per BLOCK_N rows of the weight, BLOCK_N / 2 pairs (and per 16 rows of x)

if HAS_TRITON:

    @triton.jit
    def _qkv_rope_write_kernel(
        x_ptr, g_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, kb_ptr, vb_ptr, pos_ptr, slot_ptr, position_ptr,
        M, K, eps,
        stride_xm, stride_wn, stride_qm,              # x (M, K), w ((H + 2 H_kv) D, K), q (M, H * D); last strides 1
        stride_kbb, stride_kbh, stride_kbs,           # kb (M, H_kv, C, D), last stride 1
        stride_vbb, stride_vbh, stride_vbs,           # vb likewise
        stride_pb, stride_ph, stride_sb, stride_sh,   # pos (M, H_kv, C), last stride 1; slot (M, H_kv)
        H: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        HALF: tl.constexpr = D // 2
        N_PAIRS = (H + 2 * H_KV) * HALF
        # the program's BLOCK_N rows of the weight are BLOCK_N / 2 pairs, each pair's two rows side by side: row
        # 2p + j of the tile is pair p's row head * D + i + j * HALF (j = 0 the first half, 1 the second)
        r = tl.arange(0, BLOCK_N)
        pair = tl.program_id(0) * (BLOCK_N // 2) + r // 2
        w_rows = w_ptr + ((pair // HALF) * D + pair % HALF + (r % 2) * HALF).to(tl.int64)[:, None] * stride_wn
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)            # its rows (the step's sequences)
        mask_m = rm < M
        acc, _ = _products(x_ptr, g_ptr, w_rows, 0, rm, mask_m, pair < N_PAIRS, K, eps, stride_xm,
                           True, False, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)            # (BLOCK_M, BLOCK_N)
        lo, hi = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))    # each pair's halves: (BLOCK_M, BLOCK_N / 2)
        c = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)    # the pairs (head, i), in order
        head, i = c // HALF, c % HALF
        mask_n = c < N_PAIRS
        # RoPE on q's and k's heads; v's as they are
        cos_lo = tl.load(cos_ptr + i).to(tl.float32)[None, :]
        cos_hi = tl.load(cos_ptr + HALF + i).to(tl.float32)[None, :]
        sin_lo = tl.load(sin_ptr + i).to(tl.float32)[None, :]
        sin_hi = tl.load(sin_ptr + HALF + i).to(tl.float32)[None, :]
        rotated = (head < H + H_KV)[None, :]
        lo, hi = (tl.where(rotated, lo * cos_lo - hi * sin_lo, lo),
                  tl.where(rotated, hi * cos_hi + lo * sin_hi, hi))
        lo, hi = lo.to(q_ptr.dtype.element_ty), hi.to(q_ptr.dtype.element_ty)
        is_q, is_k, is_v = head < H, (head >= H) & (head < H + H_KV), head >= H + H_KV
        rows = rm.to(tl.int64)[:, None]                                    # int64: offsets into large buffers
        # q's heads into q (M, H * D)
        q_at = q_ptr + rows * stride_qm + (head * D + i)[None, :]
        store = mask_m[:, None] & (mask_n & is_q)[None, :]
        tl.store(q_at, lo, mask=store)
        tl.store(q_at + HALF, hi, mask=store)
        # k's and v's into their KV head's slot
        h = tl.where(is_k, head - H, tl.where(is_v, head - H - H_KV, 0))[None, :]   # (1, BLOCK_N / 2) KV head
        kv = mask_m[:, None] & (mask_n & (head >= H))[None, :]
        s = tl.load(slot_ptr + rows * stride_sb + h * stride_sh, mask=kv, other=0)  # (BLOCK_M, BLOCK_N / 2) int64
        k_at = kb_ptr + rows * stride_kbb + h * stride_kbh + s * stride_kbs + i[None, :]
        tl.store(k_at, lo, mask=kv & is_k[None, :])
        tl.store(k_at + HALF, hi, mask=kv & is_k[None, :])
        v_at = vb_ptr + rows * stride_vbb + h * stride_vbh + s * stride_vbs + i[None, :]
        tl.store(v_at, lo, mask=kv & is_v[None, :])
        tl.store(v_at + HALF, hi, mask=kv & is_v[None, :])
        first = kv & (is_k & (i == 0))[None, :]                            # one store of the position a head
        tl.store(pos_ptr + rows * stride_pb + h * stride_ph + s, tl.zeros_like(s) + tl.load(position_ptr), mask=first)


def norm_qkv_rope_write_triton(x: Tensor, g: Tensor, eps: float, w: Tensor, cos: Tensor, sin: Tensor, kb: Tensor,
                               vb: Tensor, pos: Tensor, slot: Tensor, position: Tensor,
                               launch: SkinnyLaunch | None = None) -> Tensor:
    """``reference_norm_qkv_rope_write`` in one launch (always the kernel: a CUDA tensor or, under
    ``TRITON_INTERPRET=1``, a CPU one): q (M, H, d) returned, kb, vb and pos written in place."""
    if not HAS_TRITON:
        raise RuntimeError("the skinny q/k/v kernel needs triton; use reference_norm_qkv_rope_write")
    check_product(x, w, 1, "norm_qkv_rope_write")
    M, K = x.shape
    H_kv, d = kb.shape[1], kb.shape[-1]
    if d % 2 or vb.shape[-1] != d:
        raise ValueError(f"norm_qkv_rope_write: keys and values must share an even head size, got {d} and "
                         f"{vb.shape[-1]}")
    if w.shape[0] % d or w.shape[0] // d <= 2 * H_kv:
        raise ValueError(f"norm_qkv_rope_write: w must have (H + 2 H_kv) d rows for H_kv={H_kv} and d={d}, got "
                         f"{w.shape[0]}")
    H = w.shape[0] // d - 2 * H_kv
    if g.shape != (K,) or cos.shape[-1] != d or sin.shape != cos.shape or cos.numel() != d:
        raise ValueError(f"norm_qkv_rope_write: g must be ({K},) and cos, sin one row of {d}, got {tuple(g.shape)}, "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    if len({t.device for t in (x, g, cos, sin, kb)}) != 1:
        raise ValueError("norm_qkv_rope_write: x, g, cos, sin and the buffers must be on one device")
    entry = x[:, :1, None, None].expand(M, H_kv, 1, d)      # a view standing in for k and v: their shape, dtype
    check_write_args(kb, vb, pos, slot, entry, entry, position)
    if kb.stride(-1) != 1 or vb.stride(-1) != 1 or pos.stride(-1) != 1:
        raise ValueError("the buffers kb, vb and pos must have stride 1 in their last dimension")
    launch = launch or SKINNY_TUNED.get(("qkv_rope_write", w.shape[0], K, w.dtype), DEFAULT_LAUNCH)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    cos, sin = cos.reshape(d).contiguous(), sin.reshape(d).contiguous()
    q = torch.empty(M, H, d, device=x.device, dtype=x.dtype)
    dot_fp32 = w.dtype == torch.float32 or not w.is_cuda         # as skinny_matmul's launches
    grid = (triton.cdiv((H + 2 * H_kv) * d, launch.block_n), triton.cdiv(M, BLOCK_M))
    _qkv_rope_write_kernel[grid](
        x, g, w, cos, sin, q, kb, vb, pos, slot, position, M, K, float(eps),
        x.stride(0), w.stride(0), q.stride(0), kb.stride(0), kb.stride(1), kb.stride(2),
        vb.stride(0), vb.stride(1), vb.stride(2), pos.stride(0), pos.stride(1), slot.stride(0), slot.stride(1),
        H=H, H_KV=H_kv, D=d, DOT_FP32=dot_fp32, BLOCK_M=BLOCK_M, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    return q
