"""
H2O's decode step over fixed-capacity buffers: attend, add what each entry received to its score, empty the
lowest. Three launches a layer, the keys read once.

H2O (Zhang et al., 2023, Algorithm 1) keeps, beside each cached entry, the attention it has received so far,
and when the cache is over its budget it evicts the entry with the lowest sum outside a window of recent
ones. So a decode step needs the attention's probabilities themselves, not only its output. Computed
beside the split-K kernel in PyTorch (``fastpath/graph.py``'s ``attend_heavy``), they cost a second read of
every key (the scores again, as a C x G product), a softmax over the slots, a mean over each group's query
heads, the update of the scores and the choice of the slot to empty: half a dozen kernels a layer, which a
graph still pays, and twice the keys' bytes. Here:

1. the split kernel (``decode_attention.py``) attends as before and also writes each slot's scaled score
   s = q.k / sqrt(d) for each query head of the group into S (B * H_kv, G, C), fp32, -inf where the slot
   is empty;
2. the merge kernel turns the ranges' partials into the output, as before;
3. one program per (sequence, KV head) of ``_heavy_update_kernel`` takes each query head's softmax max M
   and sum L from the same partials (the merge's formula), then walks the slots once: the probability
   p = exp(s - M) / L of each query head, their mean over the group (what the slot received), added to the
   slot's score (the slot just written starts from 0), and the running choice of the slot to empty: the
   lowest score among the entries outside the ``n_recent`` latest positions, the latest position on a tie
   (``nanollm.slots.select_lowest``). Where the head holds more than ``budget`` entries, that slot's
   position becomes -1 and the next token goes there; elsewhere the next token takes the next slot.

S is G x C fp32 numbers a head, written once and read once, instead of the C x d keys read again.

    out = heavy_attend_triton(q, kb, vb, pos, slot, score, position, n_recent, budget)    # (B, H, d)

beside its reference ``reference_heavy_attend`` (the same arguments and updates in PyTorch, any device).
``fastpath/fused.py`` calls it for H2O where ``kernels.serves`` says so.
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
    lowest = torch.where(stays, float("inf"), torch.nan_to_num(score, nan=float("-inf")))
    ties = lowest == lowest.amin(dim=-1, keepdim=True)
    reference_empty_one(pos, slot, torch.where(ties, pos, -1).argmax(dim=-1), budget)   # the latest lowest
    return out


# ----------------------------------------------------------------------------------------------------------
# The kernel: one program per (sequence, KV head), after the split and merge kernels

if HAS_TRITON:

    @triton.jit
    def _heavy_update_kernel(
        s_ptr, m_ptr, l_ptr, score_ptr, pos_ptr, slot_ptr, position_ptr,
        n_splits, C, n_recent, budget,
        stride_cb, stride_ch,                       # score (B, H_kv, C), last stride 1
        stride_pb, stride_ph,                       # pos (B, H_kv, C), last stride 1
        stride_sb, stride_sh,                       # slot (B, H_kv)
        H_kv: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)         # int64: offsets into large buffers
        b, h = bh // H_kv, bh % H_kv
        g = tl.arange(0, G_PAD)
        real = g < G                               # the group's query heads (G_PAD: a power of two)
        M, L = softmax_totals(m_ptr, l_ptr, bh, n_splits, G, G_PAD, BLOCK_S)   # (G_PAD,) each

        written = tl.load(slot_ptr + b * stride_sb + h * stride_sh)         # the slot this step wrote
        recent_from = tl.load(position_ptr) + 1 - n_recent                  # positions >= this stay
        # per column of the blocks (reduced once, after the loop): the lowest score so far, its position and
        # slot, and the entries held; typed as the loop makes them (a GPU compiler rejects a loop-carried
        # value whose type changes, which the interpreter would not notice)
        best = tl.full([BLOCK_C], float("inf"), tl.float32)
        best_pos = tl.full([BLOCK_C], -2, tl.int64)
        best_slot = tl.zeros([BLOCK_C], tl.int32)
        held = tl.zeros([BLOCK_C], tl.int32)
        for first in range(0, C, BLOCK_C):
            c = first + tl.arange(0, BLOCK_C)
            inside = c < C
            s = tl.load(s_ptr + (bh * G + g)[:, None] * C + c[None, :], mask=real[:, None] & inside[None, :],
                        other=float("-inf"))                                          # (G_PAD, BLOCK_C)
            received = tl.sum(tl.exp(s - M[:, None]) / L[:, None], axis=0) / G         # empty slot: 0
            at = score_ptr + b * stride_cb + h * stride_ch + c
            total = tl.where(c == written, 0.0, tl.load(at, mask=inside, other=0.0)) + received
            tl.debug_barrier()                     # every thread's loads before any store: a block smaller
            tl.store(at, total, mask=inside)       # than the threads holds each slot in several of them
            p = tl.load(pos_ptr + b * stride_pb + h * stride_ph + c, mask=inside, other=-2)   # -2: past C
            held += (p >= 0).to(tl.int32)
            stays = (p < 0) | (p >= recent_from)
            # as torch.nan_to_num(total, nan=-inf) (select_lowest's): NaN -> -inf, +-inf -> the largest and
            # lowest finite fp32 (sums of probabilities are finite: this only keeps the reference's order)
            v = tl.where(total == float("inf"), FP32_MAX, tl.where(total == float("-inf"), -FP32_MAX, total))
            v = tl.where(stays, float("inf"), tl.where(total != total, float("-inf"), v))
            take = (v < best) | ((v == best) & (p > best_pos))              # lower, or as low and later
            best = tl.where(take, v, best)
            best_pos = tl.where(take, p, best_pos)
            best_slot = tl.where(take, c, best_slot)
        low = tl.min(best, axis=0)                                          # the lowest score...
        low_pos = tl.max(tl.where(best == low, best_pos, -2), axis=0)       # ...the latest position holding it...
        victim = tl.min(tl.where((best == low) & (best_pos == low_pos), best_slot, C), axis=0)   # ...its slot
        over = tl.sum(held, axis=0) > budget
        tl.store(pos_ptr + b * stride_pb + h * stride_ph + victim, -1, mask=over)
        tl.store(slot_ptr + b * stride_sb + h * stride_sh, tl.where(over, victim, written + 1))


def heavy_attend_triton(q: Tensor, kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, score: Tensor,
                        position: Tensor, n_recent: int, budget: int, scale: float | None = None,
                        splits: int | None = None) -> Tensor:
    """``reference_heavy_attend`` in three launches (the split kernel keeping the scores, the merge,
    ``_heavy_update_kernel``): always the kernels, on a CUDA tensor or, under ``TRITON_INTERPRET=1``, a CPU
    one. pos, score and slot are updated in place; pos and score must have stride 1 in their last
    dimension. ``splits``: ranges per (sequence, KV head), None for the split kernel's default.

    The update kernel walks a head's C slots in one program, so it has B * H_kv programs: enough at the
    benchmark's 16 sequences, few for one sequence of a long cache (not timed yet; splitting the slots over
    programs with a second reduction would be the next step)."""
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
    _heavy_update_kernel[(B * H_kv,)](
        s, m, l, score, pos, slot, position, m.shape[1], C, int(n_recent), int(budget),
        score.stride(0), score.stride(1), pos.stride(0), pos.stride(1), slot.stride(0), slot.stride(1),
        H_kv=H_kv, G=G, G_PAD=next_pow2(G), BLOCK_S=32, BLOCK_C=min(256, max(16, next_pow2(C))))
    return out
