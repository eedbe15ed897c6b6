"""
StreamingLLM's decode step over fixed-capacity buffers: attend, then empty the oldest entry after the sinks,
the choice made from the positions the attention reads anyway.

Implements the eviction of StreamingLLM (Xiao et al., 2024, sec. 3.2) for the fused step (``fastpath/fused.py``)
in three launches: the split kernel of ``decode_attention.py`` also keeps each range's oldest entry at or after
``n_sink``, the merge gives the output, and one small kernel empties the oldest where a head is over budget.

    out = sinks_attend_triton(q, kb, vb, pos, slot, n_sink, budget)     # (B, H, d); pos, slot updated

Tested against ``reference_sinks_attend`` (the same in PyTorch, any device).

How it works, step by step: kernels/inside.md, section "streaming.py".
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, reference_empty_one
from .decode_attention import (
    check_decode_args,
    decode_partials_triton,
    merge_splits_triton,
    reference_masked_decode_attention,
    split_plan,
)

if HAS_TRITON:
    import triton
    import triton.language as tl


def check_sinks_args(q: Tensor, kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor) -> None:
    """One-line errors for shapes and dtypes that do not fit (the values are not checked: that would need
    the host to read them, which a CUDA graph cannot)."""
    check_decode_args(q, kb, vb)
    B, H_kv, C = kb.shape[:3]
    if tuple(pos.shape) != (B, H_kv, C) or tuple(slot.shape) != (B, H_kv):
        raise ValueError(f"pos must have shape {(B, H_kv, C)} and slot {(B, H_kv)} (after kb's "
                         f"{tuple(kb.shape)}), got {tuple(pos.shape)} and {tuple(slot.shape)}")
    if pos.dtype != torch.long or slot.dtype != torch.long:
        raise ValueError(f"pos and slot must be int64 (torch.long), got {pos.dtype} and {slot.dtype}")


# ----------------------------------------------------------------------------------------------------------
# The reference

def reference_sinks_attend(q: Tensor, kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, n_sink: int,
                           budget: int, scale: float | None = None) -> Tensor:
    """q (B, H, d) over the slots of kb, vb (B, H_kv, C, d) whose position in pos (B, H_kv, C) is >= 0. Then,
    in place, where a head holds more than ``budget`` entries: its oldest position at or after ``n_sink``
    (the head's slot 0 if it holds none, as ``argmin`` gives) set to -1, and ``slot`` (B, H_kv) pointed
    there; elsewhere ``slot`` moves to the next slot. Returns (B, H, d)."""
    check_sinks_args(q, kb, vb, pos, slot)
    out = reference_masked_decode_attention(q, kb, vb, pos, scale)
    later = pos.masked_fill(pos < n_sink, torch.iinfo(pos.dtype).max)  # sinks and empty slots never go
    reference_empty_one(pos, slot, later.argmin(dim=-1), budget)         # the oldest after them
    return out


# ----------------------------------------------------------------------------------------------------------
# The kernel: one program per (sequence, KV head), after the split and merge kernels

if HAS_TRITON:

    @triton.jit
    def _evict_oldest_kernel(ev_ptr, pos_ptr, slot_ptr, n_splits, budget,
                             stride_pb, stride_ph, stride_sb, stride_sh,
                             H_kv: tl.constexpr, BLOCK_S: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H_kv, bh % H_kv
        sp = tl.arange(0, BLOCK_S)
        oldest = tl.full([BLOCK_S], 2**63 - 1, tl.int64)       # per lane: the oldest of its ranges...
        at = tl.zeros([BLOCK_S], tl.int64)                      # ...its slot...
        held = tl.zeros([BLOCK_S], tl.int64)                    # ...and their entries
        for first in range(0, n_splits, BLOCK_S):               # ranges in slot order: the earlier wins a tie
            part = (bh * n_splits + first + sp) * 3
            ok = first + sp < n_splits
            o = tl.load(ev_ptr + part, mask=ok, other=2**63 - 1)
            at = tl.where(o < oldest, tl.load(ev_ptr + part + 1, mask=ok, other=0), at)
            oldest = tl.minimum(o, oldest)
            held += tl.load(ev_ptr + part + 2, mask=ok, other=0)
        low = tl.min(oldest, axis=0)
        victim = tl.min(tl.where(oldest == low, at, 2**62), axis=0)        # one lane, or slot 0 if none
        over = tl.sum(held, axis=0) > budget
        tl.store(pos_ptr + b * stride_pb + h * stride_ph + victim, -1, mask=over)
        at_slot = slot_ptr + b * stride_sb + h * stride_sh
        tl.store(at_slot, tl.where(over, victim, tl.load(at_slot) + 1))


def sinks_attend_triton(q: Tensor, kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, n_sink: int, budget: int,
                        scale: float | None = None, splits: int | None = None) -> Tensor:
    """``reference_sinks_attend`` in three launches (the split kernel keeping each range's oldest entry, the
    merge, ``_evict_oldest_kernel``): always the kernels, on a CUDA tensor or, under ``TRITON_INTERPRET=1``,
    a CPU one. pos and slot are updated in place; pos must have stride 1 in its last dimension. ``splits``:
    ranges per (sequence, KV head), None for the split kernel's default."""
    if not HAS_TRITON:
        raise RuntimeError("sinks_attend_triton needs triton; use reference_sinks_attend")
    check_sinks_args(q, kb, vb, pos, slot)
    if pos.stride(-1) != 1:
        raise ValueError("pos must have stride 1 in its last dimension (it is updated in place)")
    B, H, d = q.shape
    H_kv, C = kb.shape[1], kb.shape[2]
    splits = split_plan(q, kb, C, splits=splits)[2]                     # the ranges the split kernel cuts
    ev = torch.empty(B * H_kv, splits, 3, device=q.device, dtype=torch.long)
    m, l, acc = decode_partials_triton(q, kb, vb, scale=scale, splits=splits, pos=pos, evict=ev, n_sink=n_sink)
    out = merge_splits_triton(m, l, acc, q.dtype).view(B, H, d)
    _evict_oldest_kernel[(B * H_kv,)](ev, pos, slot, splits, int(budget), pos.stride(0), pos.stride(1),
                                      slot.stride(0), slot.stride(1), H_kv=H_kv, BLOCK_S=32)
    return out
