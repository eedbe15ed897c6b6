"""
H2O's decode step over fixed-capacity buffers: attend, add what each entry received to its score, empty the
lowest. Four launches a layer, the keys read once.

Implements the eviction of H2O (Zhang et al., 2023, Algorithm 1) for the fused step (``fastpath/fused.py``): the
split kernel of ``decode_attention.py`` also writes each slot's scores, the merge gives the output, a kernel
over blocks of slots turns the scores into probabilities, adds them to each slot's score and proposes the
block's lowest outside the recent window, and a last kernel empties the lowest where a head is over budget.

    out = heavy_attend_triton(q, kb, vb, pos, slot, score, position, n_recent, budget)    # (B, H, d)

Tested against ``reference_heavy_attend`` (the same arguments and in-place updates in PyTorch, any device).

How it works, step by step: kernels/inside.md, section "heavy_hitters.py".
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

    FP32_MAX = tl.constexpr(3.4028234663852886e38)     # torch.finfo(torch.float32).max: nan_to_num's +inf

    @triton.jit
    def lowest_latest(v, p, c, C):
        """Of candidates with scores v, positions p and slots c (each a vector): the lowest score, the latest
        position holding it, and its slot (the smallest, should two hold it): ``select_lowest``'s order. A
        lexicographic choice, so choosing per block and then among the blocks gives the same slot."""
        low = tl.min(v, axis=0)
        low_pos = tl.max(tl.where(v == low, p, -2), axis=0)
        return low, low_pos, tl.min(tl.where((v == low) & (p == low_pos), c, C), axis=0)


def check_heavy_args(q: Tensor, kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, score: Tensor,
                     position: Tensor) -> None:
    """One-line errors for shapes and dtypes that do not fit (the values are not checked: that would need
    the host to read them, which a CUDA graph cannot)."""
    check_decode_args(q, kb, vb)
    B, H_kv, C = kb.shape[:3]
    want = {"pos": (pos.shape, (B, H_kv, C)), "score": (score.shape, (B, H_kv, C)),
            "slot": (slot.shape, (B, H_kv)), "position": (position.shape, (1,))}
    for name, (got, shape) in want.items():
        if tuple(got) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)} (after kb's {tuple(kb.shape)}), got {tuple(got)}")
    if pos.dtype != torch.long or slot.dtype != torch.long or position.dtype != torch.long:
        raise ValueError(f"pos, slot and position must be int64 (torch.long), got {pos.dtype}, {slot.dtype}, "
                         f"{position.dtype}")
    if score.dtype != torch.float32:
        raise ValueError(f"score must be fp32 (H2O's sums), got {score.dtype}")


# ----------------------------------------------------------------------------------------------------------
# The reference

def reference_heavy_attend(q: Tensor, kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, score: Tensor,
                           position: Tensor, n_recent: int, budget: int, scale: float | None = None) -> Tensor:
    """q (B, H, d) over the slots of kb, vb (B, H_kv, C, d) whose position in pos (B, H_kv, C) is >= 0; the
    slot each head just wrote is ``slot`` (B, H_kv), the step's position ``position`` (1,). Updates in place:
    score (B, H_kv, C) fp32 (the written slot's reset to 0, then every slot's mean probability over its
    group added), pos (the emptied slot at -1) and slot (where the next token goes). Returns (B, H, d)."""
    check_heavy_args(q, kb, vb, pos, slot, score, position)
    B, H, d = q.shape
    H_kv = kb.shape[1]
    s = q.float().view(B, H_kv, H // H_kv, d) @ kb.float().transpose(-1, -2) * default_scale(scale, d)
    probs = torch.softmax(s.masked_fill((pos < 0)[:, :, None], float("-inf")), dim=-1)   # (B, H_kv, G, C)
    out = (probs @ vb.float()).view(B, H, d).to(q.dtype)
    score.scatter_(2, slot[:, :, None], 0.0)                              # the new entry starts at 0...
    score += probs.mean(dim=2)                                            # ...and every entry adds its share
    stays = (pos < 0) | (pos >= position + 1 - n_recent)                  # empty, or in the recent window
    lowest = torch.where(stays, float("inf"), torch.nan_to_num(score, nan=float("-inf"), neginf=float("-inf")))
    ties = lowest == lowest.amin(dim=-1, keepdim=True)
    reference_empty_one(pos, slot, torch.where(ties, pos, -1).argmax(dim=-1), budget)   # the latest lowest
    return out


# ----------------------------------------------------------------------------------------------------------
# The kernels: after the split and merge, one program per block of a head's slots, then one per head

if HAS_TRITON:

    @triton.jit
    def _heavy_score_kernel(
        s_ptr, m_ptr, l_ptr, score_ptr, pos_ptr, slot_ptr, position_ptr,
        low_ptr, low_pos_ptr, low_slot_ptr, held_ptr,   # (B * H_kv, n_blocks) each: a block's candidate, count
        n_splits, C, n_recent, n_blocks,
        stride_cb, stride_ch,                       # score (B, H_kv, C), last stride 1
        stride_pb, stride_ph,                       # pos (B, H_kv, C), last stride 1
        stride_sb, stride_sh,                       # slot (B, H_kv)
        H_kv: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)         # int64: offsets into large buffers
        blk = tl.program_id(1)                     # this program's block of the head's slots
        b, h = bh // H_kv, bh % H_kv
        g = tl.arange(0, G_PAD)
        real = g < G                               # the group's query heads (G_PAD: a power of two)
        M, L = softmax_totals(m_ptr, l_ptr, bh, n_splits, G, G_PAD, BLOCK_S)   # (G_PAD,) each

        written = tl.load(slot_ptr + b * stride_sb + h * stride_sh)         # the slot this step wrote
        recent_from = tl.load(position_ptr) + 1 - n_recent                  # positions >= this stay
        c = blk * BLOCK_C + tl.arange(0, BLOCK_C)
        inside = c < C
        s = tl.load(s_ptr + (bh * G + g)[:, None] * C + c[None, :], mask=real[:, None] & inside[None, :],
                    other=float("-inf"))                                              # (G_PAD, BLOCK_C)
        received = tl.sum(tl.exp(s - M[:, None]) / L[:, None], axis=0) / G             # empty slot: 0
        at = score_ptr + b * stride_cb + h * stride_ch + c
        total = tl.where(c == written, 0.0, tl.load(at, mask=inside, other=0.0)) + received
        tl.debug_barrier()                         # every thread's loads before any store: a block smaller
        tl.store(at, total, mask=inside)           # than the threads holds each slot in several of them
        p = tl.load(pos_ptr + b * stride_pb + h * stride_ph + c, mask=inside, other=-2)   # -2: past C
        stays = (p < 0) | (p >= recent_from)
        # as select_lowest's torch.nan_to_num(total, nan=-inf, neginf=-inf): NaN -> -inf, +inf -> the largest
        # finite fp32 (sums of probabilities are finite: this only keeps the reference's order)
        v = tl.where(total == float("inf"), FP32_MAX, total)
        v = tl.where(stays, float("inf"), tl.where(total != total, float("-inf"), v))
        low, low_pos, victim = lowest_latest(v, p, c, C)                    # the block's candidate
        out = bh * n_blocks + blk
        tl.store(low_ptr + out, low)
        tl.store(low_pos_ptr + out, low_pos)
        tl.store(low_slot_ptr + out, victim)
        tl.store(held_ptr + out, tl.sum((p >= 0).to(tl.int32), axis=0))

    @triton.jit
    def _heavy_evict_kernel(
        low_ptr, low_pos_ptr, low_slot_ptr, held_ptr, pos_ptr, slot_ptr,
        n_blocks, C, budget,
        stride_pb, stride_ph,                       # pos (B, H_kv, C), last stride 1
        stride_sb, stride_sh,                       # slot (B, H_kv)
        H_kv: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H_kv, bh % H_kv
        k = tl.arange(0, BLOCK_K)                  # the head's blocks (BLOCK_K: a power of two >= n_blocks)
        there = k < n_blocks
        at = bh * n_blocks + k
        v = tl.load(low_ptr + at, mask=there, other=float("inf"))
        p = tl.load(low_pos_ptr + at, mask=there, other=-2)
        c = tl.load(low_slot_ptr + at, mask=there, other=C)
        victim = lowest_latest(v, p, c, C)[2]                               # among the blocks' candidates
        over = tl.sum(tl.load(held_ptr + at, mask=there, other=0), axis=0) > budget
        written = tl.load(slot_ptr + b * stride_sb + h * stride_sh)
        tl.store(pos_ptr + b * stride_pb + h * stride_ph + victim, -1, mask=over)
        tl.store(slot_ptr + b * stride_sb + h * stride_sh, tl.where(over, victim, written + 1))


def heavy_attend_triton(q: Tensor, kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, score: Tensor,
                        position: Tensor, n_recent: int, budget: int, scale: float | None = None,
                        splits: int | None = None) -> Tensor:
    """``reference_heavy_attend`` in four launches (the split kernel keeping the scores, the merge,
    ``_heavy_score_kernel`` over blocks of slots, ``_heavy_evict_kernel``): always the kernels, on a CUDA
    tensor or, under ``TRITON_INTERPRET=1``, a CPU one. pos, score and slot are updated in place; pos and
    score must have stride 1 in their last dimension. ``splits``: ranges per (sequence, KV head), None for the
    split kernel's default."""
    if not HAS_TRITON:
        raise RuntimeError("heavy_attend_triton needs triton; use reference_heavy_attend")
    check_heavy_args(q, kb, vb, pos, slot, score, position)
    if pos.stride(-1) != 1 or score.stride(-1) != 1:
        raise ValueError("pos and score must have stride 1 in their last dimension (they are updated in place)")
    B, H, d = q.shape
    H_kv, C = kb.shape[1], kb.shape[2]
    G = H // H_kv
    s = torch.empty(B * H_kv, G, C, device=q.device, dtype=torch.float32)
    m, l, acc = decode_partials_triton(q, kb, vb, scale=scale, splits=splits, pos=pos, scores=s)
    out = merge_splits_triton(m, l, acc, q.dtype).view(B, H, d)
    BLOCK_C = min(256, max(16, next_pow2(C)))
    n_blocks = triton.cdiv(C, BLOCK_C)
    low = torch.empty(B * H_kv, n_blocks, device=q.device, dtype=torch.float32)      # each block's candidate:
    low_pos = torch.empty(B * H_kv, n_blocks, device=q.device, dtype=torch.long)     # its score, position,
    low_slot = torch.empty(B * H_kv, n_blocks, device=q.device, dtype=torch.int32)   # slot, and the block's
    held = torch.empty(B * H_kv, n_blocks, device=q.device, dtype=torch.int32)       # entries held
    _heavy_score_kernel[(B * H_kv, n_blocks)](
        s, m, l, score, pos, slot, position, low, low_pos, low_slot, held, m.shape[1], C, int(n_recent), n_blocks,
        score.stride(0), score.stride(1), pos.stride(0), pos.stride(1), slot.stride(0), slot.stride(1),
        H_kv=H_kv, G=G, G_PAD=next_pow2(G), BLOCK_S=32, BLOCK_C=BLOCK_C)
    _heavy_evict_kernel[(B * H_kv,)](
        low, low_pos, low_slot, held, pos, slot, n_blocks, C, int(budget),
        pos.stride(0), pos.stride(1), slot.stride(0), slot.stride(1), H_kv=H_kv, BLOCK_K=max(16, next_pow2(n_blocks)))
    return out
