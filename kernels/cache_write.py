"""
Cache write: a decode step's new key, value and position into each head's slot of fixed-capacity buffers.

One launch a layer where PyTorch's scatters take three, for the graph and fused steps' buffers
(``fastpath/graph.py``, ``fastpath/fused.py``); the copy is exact. The slot is not checked: one outside [0, C)
writes out of bounds.

    write_entry_triton(kb, vb, pos, slot, k, v, position)    # in place; shapes as reference_write_entry

Tested against ``reference_write_entry`` (the three scatters, any device).

Why one launch matters, and how it works: kernels/inside.md, section "cache_write.py".
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl


def check_write_args(kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, k: Tensor, v: Tensor,
                     position: Tensor) -> None:
    """One-line errors for shapes, dtypes and devices that do not fit (the values are not checked: a slot
    outside [0, C) would need the host to read it, which a CUDA graph cannot)."""
    if slot.dtype != torch.long or pos.dtype != torch.long or position.dtype != torch.long:
        raise ValueError(f"slot, pos and position must be int64 (torch.long), got {slot.dtype}, {pos.dtype}, "
                         f"{position.dtype}")
    B, H_kv, C, d = kb.shape
    want = {"vb": (vb.shape[:3], (B, H_kv, C)), "pos": (pos.shape, (B, H_kv, C)),
            "slot": (slot.shape, (B, H_kv)), "k": (k.shape, (B, H_kv, 1, d)),
            "v": (v.shape, (B, H_kv, 1, vb.shape[-1])), "position": (position.shape, (1,))}
    for name, (got, shape) in want.items():
        if tuple(got) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)} (after kb's {tuple(kb.shape)}), got {tuple(got)}")
    if k.dtype != kb.dtype or v.dtype != vb.dtype:
        raise ValueError(f"the new entry's dtypes ({k.dtype}, {v.dtype}) must be the buffers' ({kb.dtype}, {vb.dtype})")
    if len({t.device for t in (kb, vb, pos, slot, k, v, position)}) != 1:
        raise ValueError("the buffers, the slot, the entry and the position must be on one device")


# ----------------------------------------------------------------------------------------------------------
# The reference

def reference_write_entry(kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, k: Tensor, v: Tensor,
                          position: Tensor) -> None:
    """kb (B, H_kv, C, d), vb (B, H_kv, C, d_v), pos (B, H_kv, C) and slot (B, H_kv), updated in place: each
    head's new entry k (B, H_kv, 1, d), v (B, H_kv, 1, d_v) into its slot ``slot``, and ``position`` (1,)
    into pos there."""
    B, H_kv, _, d = kb.shape
    at = slot[:, :, None]                                                  # (B, H_kv, 1)
    kb.scatter_(2, at[..., None].expand(B, H_kv, 1, d), k)
    vb.scatter_(2, at[..., None].expand(B, H_kv, 1, vb.shape[-1]), v)
    pos.scatter_(2, at, position.expand(B, H_kv, 1))


# ----------------------------------------------------------------------------------------------------------
# The kernel: one program per (sequence, KV head)

if HAS_TRITON:

    @triton.jit
    def _write_entry_kernel(
        kb_ptr, vb_ptr, pos_ptr, slot_ptr, k_ptr, v_ptr, position_ptr,
        stride_kbb, stride_kbh, stride_kbs,         # kb (B, H_kv, C, d), last stride 1
        stride_vbb, stride_vbh, stride_vbs,         # vb likewise
        stride_pb, stride_ph,                       # pos (B, H_kv, C), last stride 1
        stride_sb, stride_sh,                       # slot (B, H_kv)
        stride_kb, stride_kh, stride_vb, stride_vh,  # k, v (B, H_kv, 1, d), last stride 1
        H_kv: tl.constexpr, D: tl.constexpr, D_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)         # int64: offsets into large buffers
        b, h = bh // H_kv, bh % H_kv
        s = tl.load(slot_ptr + b * stride_sb + h * stride_sh)                 # this head's slot (int64)
        dk = tl.arange(0, BLOCK_D)                 # d rounded up to a power of two (tl.arange's sizes)
        key = tl.load(k_ptr + b * stride_kb + h * stride_kh + dk, mask=dk < D)
        tl.store(kb_ptr + b * stride_kbb + h * stride_kbh + s * stride_kbs + dk, key, mask=dk < D)
        dv = tl.arange(0, BLOCK_DV)
        value = tl.load(v_ptr + b * stride_vb + h * stride_vh + dv, mask=dv < D_V)
        tl.store(vb_ptr + b * stride_vbb + h * stride_vbh + s * stride_vbs + dv, value, mask=dv < D_V)
        tl.store(pos_ptr + b * stride_pb + h * stride_ph + s, tl.load(position_ptr))


def write_entry_triton(kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, k: Tensor, v: Tensor,
                       position: Tensor) -> None:
    """``reference_write_entry`` as one launch of ``_write_entry_kernel`` (always the kernel: on a CUDA tensor
    or, under ``TRITON_INTERPRET=1``, a CPU one). The buffers' last dimension must have stride 1 (they are
    written in place, so they are not copied to make it so); k and v are copied where theirs is not."""
    if not HAS_TRITON:
        raise RuntimeError("write_entry_triton needs triton; use reference_write_entry")
    check_write_args(kb, vb, pos, slot, k, v, position)
    if kb.stride(-1) != 1 or vb.stride(-1) != 1 or pos.stride(-1) != 1:
        raise ValueError("the buffers kb, vb and pos must have stride 1 in their last dimension")
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    B, H_kv, _, d = kb.shape
    d_v = vb.shape[-1]
    _write_entry_kernel[(B * H_kv,)](
        kb, vb, pos, slot, k, v, position,
        kb.stride(0), kb.stride(1), kb.stride(2), vb.stride(0), vb.stride(1), vb.stride(2),
        pos.stride(0), pos.stride(1), slot.stride(0), slot.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H_kv=H_kv, D=d, D_V=d_v, BLOCK_D=next_pow2(d), BLOCK_DV=next_pow2(d_v))
