"""
Scissorhands' decode step over fixed-capacity buffers: attend, push the step's low flags into each entry's
ring buffer, empty the entry with the most. Three launches a layer, the keys read once.

Implements the eviction of Scissorhands (Liu et al., 2023, Algorithm 2) for the fused step
(``fastpath/fused.py``): the split kernel of ``decode_attention.py`` also writes each slot's scores, the merge
gives the output, and one kernel per (sequence, KV head) flags the slots whose mean probability is below
1/n (or a given threshold), updates the ring buffers and counters, and empties the slot with the most flags.

    out = scissors_attend_triton(q, kb, vb, pos, slot, low, count, attn, position, n_recent, budget, threshold)

Tested against ``reference_scissors_attend`` (the same arguments and in-place updates in PyTorch, any device).

How it works, and how it rounds where a flag is a decision: kernels/inside.md, section "scissorhands.py".
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, default_scale, next_pow2, reference_empty_one
from .decode_attention import check_decode_args, decode_partials_triton, merge_splits_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .decode_attention import softmax_totals  # a Triton function: defined only with triton


def check_scissors_args(q: Tensor, kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, low: Tensor, count: Tensor,
                        attn: Tensor, position: Tensor) -> None:
    """One-line errors for shapes and dtypes that do not fit (the values are not checked: that would need
    the host to read them, which a CUDA graph cannot)."""
    check_decode_args(q, kb, vb)
    B, H_kv, C = kb.shape[:3]
    want = {"pos": (pos.shape, (B, H_kv, C)), "count": (count.shape, (B, H_kv, C)),
            "attn": (attn.shape, (B, H_kv, C)), "slot": (slot.shape, (B, H_kv)), "position": (position.shape, (1,))}
    for name, (got, shape) in want.items():
        if tuple(got) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)} (after kb's {tuple(kb.shape)}), got {tuple(got)}")
    if low.dim() != 4 or tuple(low.shape[:2]) != (B, H_kv) or low.shape[3] != C or low.shape[2] < 1:
        raise ValueError(f"low must have shape (B, H_kv, w, C) = ({B}, {H_kv}, w, {C}) with w >= 1, "
                         f"got {tuple(low.shape)}")
    if pos.dtype != torch.long or slot.dtype != torch.long or position.dtype != torch.long:
        raise ValueError(f"pos, slot and position must be int64 (torch.long), got {pos.dtype}, {slot.dtype}, "
                         f"{position.dtype}")
    if low.dtype != torch.bool or count.dtype != torch.int32 or attn.dtype != torch.float32:
        raise ValueError(f"low must be bool, count int32 and attn fp32 (Scissorhands' ring buffer, counters and "
                         f"last attention), got {low.dtype}, {count.dtype}, {attn.dtype}")


# ----------------------------------------------------------------------------------------------------------
# The reference

def reference_scissors_attend(q: Tensor, kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, low: Tensor,
                              count: Tensor, attn: Tensor, position: Tensor, n_recent: int, budget: int,
                              threshold: float | None = None, scale: float | None = None) -> Tensor:
    """q (B, H, d) over the slots of kb, vb (B, H_kv, C, d) whose position in pos (B, H_kv, C) is >= 0; the
    slot each head just wrote is ``slot`` (B, H_kv), the step's position ``position`` (1,). Updates in place:
    low (B, H_kv, w, C) bool and count (B, H_kv, C) int32 (the written slot's cleared, then row
    ``position mod w`` replaced by the step's flags, each counter moved by its flag in minus the flag out),
    attn (B, H_kv, C) fp32 (the step's mean probability over each group), pos (the emptied slot at -1) and
    slot (where the next token goes). Returns (B, H, d)."""
    check_scissors_args(q, kb, vb, pos, slot, low, count, attn, position)
    B, H, d = q.shape
    H_kv, w = kb.shape[1], low.shape[2]
    s = q.float().view(B, H_kv, H // H_kv, d) @ kb.float().transpose(-1, -2) * default_scale(scale, d)
    probs = torch.softmax(s.masked_fill((pos < 0)[:, :, None], float("-inf")), dim=-1)   # (B, H_kv, G, C)
    out = (probs @ vb.float()).view(B, H, d).to(q.dtype)
    by = torch.full((), probs.shape[2], dtype=probs.dtype, device=probs.device)  # G as a tensor: CUDA divides
    received = probs.sum(dim=2) / by                                      # (B, H_kv, C), empty slots 0
    count.scatter_(2, slot[:, :, None], 0)                                # the new entry starts empty...
    low.scatter_(3, slot[:, :, None, None].expand(B, H_kv, w, 1), False)  # ...in every row of its ring
    held = pos >= 0
    tau = 1.0 / held.sum(-1, keepdim=True).clamp(min=1) if threshold is None else threshold
    flags = held & (received < tau)                                       # (B, H_kv, C)
    row = low.gather(2, (position % w).view(1, 1, 1, 1).expand(B, H_kv, 1, low.shape[3]))[:, :, 0]
    count += flags.int() - row.int()                                      # flags in, minus the flags out
    low.scatter_(2, (position % w).view(1, 1, 1, 1).expand(B, H_kv, 1, low.shape[3]), flags[:, :, None])
    attn.copy_(received)
    # the slot to empty: among the held entries before the recent window, the most low flags, then the
    # lowest attention (NaN last), then the latest position
    ruled_out = ~held | (pos >= position + 1 - n_recent)
    most = count.masked_fill(ruled_out, -1)
    ruled_out |= most != most.amax(dim=-1, keepdim=True)
    least = attn.nan_to_num(nan=float("inf")).masked_fill(ruled_out, float("inf"))
    ruled_out |= least != least.amin(dim=-1, keepdim=True)
    reference_empty_one(pos, slot, pos.masked_fill(ruled_out, -1).argmax(dim=-1), budget)
    return out


# ----------------------------------------------------------------------------------------------------------
# The kernel: one program per (sequence, KV head), after the split and merge kernels

if HAS_TRITON:

    @triton.jit
    def _scissors_update_kernel(
        s_ptr, m_ptr, l_ptr, low_ptr, count_ptr, attn_ptr, pos_ptr, slot_ptr, position_ptr,
        n_splits, C, w, n_recent, budget, tau,
        stride_lb, stride_lh, stride_lw,            # low (B, H_kv, w, C) as uint8, last stride 1
        stride_cb, stride_ch,                       # count (B, H_kv, C), last stride 1
        stride_ab, stride_ah,                       # attn (B, H_kv, C), last stride 1
        stride_pb, stride_ph,                       # pos (B, H_kv, C), last stride 1
        stride_sb, stride_sh,                       # slot (B, H_kv)
        H_kv: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, UNIFORM: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)         # int64: offsets into large buffers
        b, h = bh // H_kv, bh % H_kv
        g = tl.arange(0, G_PAD)
        real = g < G                               # the group's query heads (G_PAD: a power of two)
        M, L = softmax_totals(m_ptr, l_ptr, bh, n_splits, G, G_PAD, BLOCK_S)   # (G_PAD,) each

        pos_row = pos_ptr + b * stride_pb + h * stride_ph
        held = tl.zeros([BLOCK_C], tl.int32)       # the entries the head holds (the new one included)
        for first in range(0, C, BLOCK_C):
            c = first + tl.arange(0, BLOCK_C)
            held += (tl.load(pos_row + c, mask=c < C, other=-1) >= 0).to(tl.int32)
        n = tl.sum(held, axis=0)
        if UNIFORM:                                # the uniform level 1 / n, rounded as PyTorch divides
            tau = tl.div_rn(1.0, tl.maximum(n, 1).to(tl.float32))

        written = tl.load(slot_ptr + b * stride_sb + h * stride_sh)         # the slot this step wrote
        position = tl.load(position_ptr)
        row = position % w                                                  # this step's row of the ring
        low_head = low_ptr + b * stride_lb + h * stride_lh
        r = tl.arange(0, BLOCK_W)
        for first in range(0, w, BLOCK_W):         # the new entry's flags cleared in the other rows; its own
            rr = first + r                         # row is written below, with the step's flag
            tl.store(low_head + rr * stride_lw + written, tl.zeros([BLOCK_W], tl.uint8), mask=(rr < w) & (rr != row))

        recent_from = position + 1 - n_recent                               # positions >= this stay
        # per column of the blocks (reduced once, after the loop): the best candidate so far to empty (the
        # most flags, then the least attention, then the latest position) and its slot; typed as the loop
        # makes them (a GPU compiler rejects a loop-carried value whose type changes)
        best_n = tl.full([BLOCK_C], -1, tl.int32)
        best_a = tl.full([BLOCK_C], float("inf"), tl.float32)
        best_pos = tl.full([BLOCK_C], -2, tl.int64)
        best_slot = tl.zeros([BLOCK_C], tl.int32)
        for first in range(0, C, BLOCK_C):
            c = first + tl.arange(0, BLOCK_C)
            inside = c < C
            s = tl.load(s_ptr + (bh * G + g)[:, None] * C + c[None, :], mask=real[:, None] & inside[None, :],
                        other=float("-inf"))                                          # (G_PAD, BLOCK_C)
            p = tl.div_rn(tl.exp(s - M[:, None]), tl.broadcast_to(L[:, None], (G_PAD, BLOCK_C)))
            a = tl.div_rn(tl.sum(p, axis=0), tl.full([BLOCK_C], G, tl.float32))     # empty slot: 0
            slot_pos = tl.load(pos_row + c, mask=inside, other=-1)
            flag = ((slot_pos >= 0) & (a < tau)).to(tl.int32)
            at_low = low_head + row * stride_lw + c
            was = tl.where(c == written, 0, tl.load(at_low, mask=inside, other=0).to(tl.int32))
            at_count = count_ptr + b * stride_cb + h * stride_ch + c
            k = tl.where(c == written, 0, tl.load(at_count, mask=inside, other=0)) + flag - was
            tl.debug_barrier()                     # every thread's loads before any store: a block smaller
            tl.store(at_count, k, mask=inside)     # than the threads holds each slot in several of them
            tl.store(at_low, flag.to(tl.uint8), mask=inside)
            tl.store(attn_ptr + b * stride_ab + h * stride_ah + c, a, mask=inside)
            a = tl.where(a != a, float("inf"), a)                           # NaN: ranked last
            cand = (slot_pos >= 0) & (slot_pos < recent_from)
            take = cand & ((k > best_n) | ((k == best_n) & ((a < best_a) | ((a == best_a) & (slot_pos > best_pos)))))
            best_n = tl.where(take, k, best_n)
            best_a = tl.where(take, a, best_a)
            best_pos = tl.where(take, slot_pos, best_pos)
            best_slot = tl.where(take, c, best_slot)
        top_n = tl.max(best_n, axis=0)                                      # the most flags...
        top_a = tl.min(tl.where(best_n == top_n, best_a, float("inf")), axis=0)   # ...the least attention...
        tied = (best_n == top_n) & (best_a == top_a)
        top_pos = tl.max(tl.where(tied, best_pos, -2), axis=0)             # ...the latest position: its slot
        victim = tl.min(tl.where(tied & (best_pos == top_pos), best_slot, C), axis=0)
        over = n > budget
        tl.store(pos_row + victim, -1, mask=over)
        tl.store(slot_ptr + b * stride_sb + h * stride_sh, tl.where(over, victim, written + 1))


def scissors_attend_triton(q: Tensor, kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, low: Tensor,
                           count: Tensor, attn: Tensor, position: Tensor, n_recent: int, budget: int,
                           threshold: float | None = None, scale: float | None = None,
                           splits: int | None = None) -> Tensor:
    """``reference_scissors_attend`` in three launches (the split kernel keeping the scores, the merge,
    ``_scissors_update_kernel``): always the kernels, on a CUDA tensor or, under ``TRITON_INTERPRET=1``, a
    CPU one. low, count, attn, pos and slot are updated in place; each must have stride 1 in its last
    dimension. ``splits``: ranges per (sequence, KV head), None for the split kernel's default.

    The update kernel walks a head's C slots in one program: B * H_kv programs (H2O's is split over blocks of
    slots, ``heavy_hitters.py``; this one's flags need the head's count of entries before any block)."""
    if not HAS_TRITON:
        raise RuntimeError("scissors_attend_triton needs triton; use reference_scissors_attend")
    check_scissors_args(q, kb, vb, pos, slot, low, count, attn, position)
    if any(t.stride(-1) != 1 for t in (pos, low, count, attn)):
        raise ValueError("pos, low, count and attn must have stride 1 in their last dimension (they are updated "
                         "in place)")
    B, H, d = q.shape
    H_kv, C, w = kb.shape[1], kb.shape[2], low.shape[2]
    G = H // H_kv
    s = torch.empty(B * H_kv, G, C, device=q.device, dtype=torch.float32)
    m, l, acc = decode_partials_triton(q, kb, vb, scale=scale, splits=splits, pos=pos, scores=s)
    out = merge_splits_triton(m, l, acc, q.dtype).view(B, H, d)
    flags = low.view(torch.uint8)                                     # the same bytes, a type Triton stores
    _scissors_update_kernel[(B * H_kv,)](
        s, m, l, flags, count, attn, pos, slot, position, m.shape[1], C, w, int(n_recent), int(budget),
        0.0 if threshold is None else float(threshold),              # tau; with UNIFORM the kernel's 1/n
        flags.stride(0), flags.stride(1), flags.stride(2), count.stride(0), count.stride(1),
        attn.stride(0), attn.stride(1), pos.stride(0), pos.stride(1), slot.stride(0), slot.stride(1),
        H_kv=H_kv, G=G, G_PAD=next_pow2(G), BLOCK_S=32, BLOCK_C=min(256, max(16, next_pow2(C))),
        BLOCK_W=min(256, max(16, next_pow2(w))), UNIFORM=threshold is None)
    return out
