"""
KVReviver's count sketch on the GPU: insert, query, and a fused rebuild-then-attend decode step.

Paper: Yuan et al., "KVReviver: Reversible KV Cache Compression with Sketch-Based Token Reconstruction",
arXiv 2512.17917 (the Vague sketch: Algorithms 1-2; rebuilding the cache before attention: Algorithm 4). The
method is ``methods/kvreviver.py``, its sketch ``methods/kvreviver_sketch.py``; ``fastpath/sketch.py`` runs its insert
and query on these kernels.

    sketch_insert_triton             atomic adds of tokens into r rows x b fp32 cells, key/value (r, b, H_kv, d)
    sketch_query_triton              each token rebuilt as the median over rows of its cells
    sketch_decode_attention_triton   one query (H, d) over raw tokens and sketch tokens rebuilt in-kernel

each beside its reference (``reference_sketch_insert``, ``reference_sketch_query``,
``reference_sketch_decode_attention``). Per sequence (no batch axis); ``cells`` must lie in [0, b) (unchecked).

How it works, step by step: kernels/inside.md, section "count_sketch.py".
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import HAS_TRITON, fill_splits, next_pow2, split_ranges

if HAS_TRITON:
    import triton
    import triton.language as tl

MAX_ROWS = 16          # the kernels unroll r^2 comparisons for r other than 1 and 3


# ---------------------------------------------------------------------------------------------------------
# Checks shared by both paths

def _check_sketch(key: Tensor, value: Tensor, cells: Tensor, signs: Tensor) -> tuple[int, int, int, int, int]:
    """(r, b, H_kv, d, n) of a sketch and the hashes of n tokens, or a ValueError."""
    if key.dim() != 4 or key.shape != value.shape:
        raise ValueError(f"key and value must both be (r, b, H_kv, d), got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    r, b, H_kv, d = key.shape
    if cells.dim() != 2 or cells.shape[0] != r or signs.shape != cells.shape:
        raise ValueError(f"cells and signs must both be (r={r}, n), got {tuple(cells.shape)} and "
                         f"{tuple(signs.shape)}")
    if cells.dtype.is_floating_point or cells.dtype == torch.bool:
        raise ValueError(f"cells must be an integer tensor, got {cells.dtype}")
    return r, b, H_kv, d, cells.shape[1]


def _check_tokens(name: str, t: Tensor, n: int, H_kv: int, d: int) -> None:
    if t.shape != (n, H_kv, d):
        raise ValueError(f"{name} must be (n={n}, H_kv={H_kv}, d={d}), got {tuple(t.shape)}")


def _need_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed: use the reference_* functions")


def _rows_for_kernel(r: int) -> None:
    if not 1 <= r <= MAX_ROWS:
        raise ValueError(f"the Triton kernels support 1 to {MAX_ROWS} sketch rows, got r = {r} (use the "
                         "reference_* functions)")


def _token_blocks(n: int, HD: int, block_n: int | None) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_F) of the insert and query kernels: features of one token in blocks of at most 1024,
    tokens so that a program holds about 4096 numbers (``block_n`` overrides, for the tests)."""
    BLOCK_F = min(next_pow2(HD), 1024)
    return block_n or max(1, min(next_pow2(n), 4096 // BLOCK_F)), BLOCK_F


# ---------------------------------------------------------------------------------------------------------
# 1. Insert (Algorithm 1)

def reference_sketch_insert(key: Tensor, value: Tensor, cells: Tensor, signs: Tensor, k: Tensor,
                            v: Tensor) -> None:
    """Add n tokens to every row, in place: key[i, cells[i, j]] += k[j], value[i, cells[i, j]] +=
    signs[i, j] v[j] (Algorithm 1; a delete is an insert of -k, -v). key, value (r, b, H_kv, d); cells,
    signs (r, n); k, v (n, H_kv, d)."""
    r, b, H_kv, d, n = _check_sketch(key, value, cells, signs)
    _check_tokens("k", k, n, H_kv, d)
    _check_tokens("v", v, n, H_kv, d)
    # BEGIN SOLUTION [kvreviver:insert] KVReviver Algorithm 1 on given hashes (cells, signs), in place
    for i in range(r):                                     # index_add_ sums tokens that share a cell
        g = signs[i].to(value.dtype)[:, None, None]                                       # (n, 1, 1)
        key[i].index_add_(0, cells[i].long(), k.to(key.dtype))                            # (b, H_kv, d)
        value[i].index_add_(0, cells[i].long(), g * v.to(value.dtype))
    # END SOLUTION


if HAS_TRITON:
    @triton.jit
    def _sketch_insert_kernel(key_ptr, value_ptr,          # (r, b, HD) fp32 cells, updated in place
                              cells_ptr, signs_ptr,        # (r, n) int32 buckets, float signs
                              k_ptr, v_ptr,                # (n, HD) tokens, any float dtype
                              n, width, HD,                # HD = H_kv * d: a cell is one row of HD floats
                              BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
        """Program (t, i, f) adds tokens t * BLOCK_N, ... (< n) to row i, features f * BLOCK_F, ... (< HD):
        k to key[i, cells[i, j]] and signs[i, j] v to value[i, cells[i, j]], summing every collision."""
        # BEGIN SOLUTION [kvreviver:insert] KVReviver Algorithm 1 for one block: masked loads, then atomic adds
        i = tl.program_id(1)                                           # sketch row
        tok = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)       # (BLOCK_N,) tokens (axis 0: no 65535 cap)
        col = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)       # (BLOCK_F,) features
        tok_ok, col_ok = tok < n, col < HD
        mask = tok_ok[:, None] & col_ok[None, :]                       # (BLOCK_N, BLOCK_F)
        c = tl.load(cells_ptr + i * n + tok, mask=tok_ok, other=0)                          # h_i(J)
        g = tl.load(signs_ptr + i * n + tok, mask=tok_ok, other=0.0).to(tl.float32)        # g_i(J)
        src = tok.to(tl.int64)[:, None] * HD + col[None, :]
        kx = tl.load(k_ptr + src, mask=mask, other=0.0).to(tl.float32)
        vx = tl.load(v_ptr + src, mask=mask, other=0.0).to(tl.float32)
        dst = (i * width + c).to(tl.int64)[:, None] * HD + col[None, :]                     # cell (i, h_i(J))
        # Atomic: two tokens of this block (or of another program) may hash to the same cell.
        tl.atomic_add(key_ptr + dst, kx, mask=mask, sem="relaxed")
        tl.atomic_add(value_ptr + dst, vx * g[:, None], mask=mask, sem="relaxed")
        # END SOLUTION


def sketch_insert_triton(key: Tensor, value: Tensor, cells: Tensor, signs: Tensor, k: Tensor, v: Tensor,
                         *, block_n: int | None = None) -> None:
    """The atomic-add kernel: ``reference_sketch_insert`` on contiguous fp32 cells, in place; k, v in any
    float dtype. ``block_n``: tokens per program (tests)."""
    _need_triton()
    r, b, H_kv, d, n = _check_sketch(key, value, cells, signs)
    _check_tokens("k", k, n, H_kv, d)
    _check_tokens("v", v, n, H_kv, d)
    if key.dtype != torch.float32 or value.dtype != torch.float32 or not (key.is_contiguous()
                                                                          and value.is_contiguous()):
        raise ValueError("the sketch's key and value must be contiguous fp32 tensors (updated in place)")
    if n == 0:
        return
    HD = H_kv * d
    BLOCK_N, BLOCK_F = _token_blocks(n, HD, block_n)
    grid = (triton.cdiv(n, BLOCK_N), r, triton.cdiv(HD, BLOCK_F))
    _sketch_insert_kernel[grid](key, value, cells.to(torch.int32).contiguous(),
                                signs.to(torch.float32).contiguous(), k.contiguous(), v.contiguous(),
                                n, b, HD, BLOCK_N=BLOCK_N, BLOCK_F=BLOCK_F)


# ---------------------------------------------------------------------------------------------------------
# 2. Query (Algorithm 2)

def reference_sketch_query(key: Tensor, value: Tensor, cells: Tensor, signs: Tensor) -> tuple[Tensor, Tensor]:
    """Estimates k^, v^ (n, H_kv, d) of the n tokens hashed to ``cells`` (r, n) with ``signs`` (r, n)
    (Algorithm 2): the element-wise median over the r rows of the gathered cells, values times their signs;
    the lower median for an even r, as ``torch.median``, equal values among the rows included. Any r >= 1."""
    r, b, H_kv, d, n = _check_sketch(key, value, cells, signs)
    # BEGIN SOLUTION [kvreviver:query] KVReviver Algorithm 2 on given hashes (cells, signs)
    rows = torch.arange(r, device=cells.device)[:, None]                                  # (r, 1)
    k = key[rows, cells.long()]                                                           # (r, n, H_kv, d)
    v = value[rows, cells.long()] * signs.to(value.dtype)[..., None, None]                # (r, n, H_kv, d)
    k_hat, v_hat = k.median(dim=0).values, v.median(dim=0).values                         # (n, H_kv, d) each
    return k_hat, v_hat
    # END SOLUTION


if HAS_TRITON:
    @triton.jit
    def _sketch_row(cell_ptr, cells_ptr, signs_ptr, i, tok, tok_ok, col, col_ok, n, width, HD,
                    SIGNED: tl.constexpr):
        """Row i's cell of each token, (BLOCK_N, BLOCK_F) fp32: cell_ptr[i, cells[i, tok], col], times
        signs[i, tok] if SIGNED (values)."""
        # BEGIN SOLUTION [kvreviver:query] KVReviver Algorithm 2: row i's cell h_i(J) of each token (times g_i(J))
        c = tl.load(cells_ptr + i * n + tok, mask=tok_ok, other=0)                          # (BLOCK_N,)
        ptr = cell_ptr + (i * width + c).to(tl.int64)[:, None] * HD + col[None, :]
        x = tl.load(ptr, mask=tok_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        if SIGNED:
            x = x * tl.load(signs_ptr + i * n + tok, mask=tok_ok, other=0.0).to(tl.float32)[:, None]
        return x
        # END SOLUTION

    @triton.jit
    def _sketch_estimate(cell_ptr, cells_ptr, signs_ptr, tok, tok_ok, col, col_ok, n, width, HD,
                         R: tl.constexpr, SIGNED: tl.constexpr):
        """The median over the R rows of each token's cells, (BLOCK_N, BLOCK_F) fp32, in registers (the lower
        median for an even R, as ``torch.median``), without sorting."""
        # BEGIN SOLUTION [kvreviver:query] KVReviver Algorithm 2: the median over the R rows, element by element
        # r = 1: the cell itself; r = 3: max(min(a, b), min(max(a, b), c)); any other r by rank: x_a is the
        # (lower) median when at most MID rows are below it and more than MID rows are at or below it
        est = _sketch_row(cell_ptr, cells_ptr, signs_ptr, 0, tok, tok_ok, col, col_ok, n, width, HD, SIGNED)
        if R == 3:                                           # max(min(a, b), min(max(a, b), c))
            b = _sketch_row(cell_ptr, cells_ptr, signs_ptr, 1, tok, tok_ok, col, col_ok, n, width, HD, SIGNED)
            c = _sketch_row(cell_ptr, cells_ptr, signs_ptr, 2, tok, tok_ok, col, col_ok, n, width, HD, SIGNED)
            est = tl.maximum(tl.minimum(est, b), tl.minimum(tl.maximum(est, b), c))
        elif R != 1:                                         # by rank: the lower median, as torch.median
            MID: tl.constexpr = (R - 1) // 2                 # its index in sorted order
            for a in tl.static_range(R):
                xa = _sketch_row(cell_ptr, cells_ptr, signs_ptr, a, tok, tok_ok, col, col_ok, n, width, HD,
                                 SIGNED)
                below = tl.zeros_like(xa)                    # rows < xa
                at_or_below = tl.zeros_like(xa)              # rows <= xa
                for j in tl.static_range(R):
                    xj = _sketch_row(cell_ptr, cells_ptr, signs_ptr, j, tok, tok_ok, col, col_ok, n, width,
                                     HD, SIGNED)
                    below += tl.where(xj < xa, 1.0, 0.0)
                    at_or_below += tl.where(xj <= xa, 1.0, 0.0)
                est = tl.where((below <= MID) & (at_or_below > MID), xa, est)
        return est
        # END SOLUTION

    @triton.jit
    def _sketch_query_kernel(key_ptr, value_ptr,           # (r, b, HD) fp32 cells
                             cells_ptr, signs_ptr,         # (r, n) int32, float
                             k_out_ptr, v_out_ptr,         # (n, HD) fp32 estimates
                             n, width, HD,
                             R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
        tok = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        tok_ok, col_ok = tok < n, col < HD
        k_hat = _sketch_estimate(key_ptr, cells_ptr, signs_ptr, tok, tok_ok, col, col_ok, n, width, HD, R, False)
        v_hat = _sketch_estimate(value_ptr, cells_ptr, signs_ptr, tok, tok_ok, col, col_ok, n, width, HD, R, True)
        dst = tok.to(tl.int64)[:, None] * HD + col[None, :]
        mask = tok_ok[:, None] & col_ok[None, :]
        tl.store(k_out_ptr + dst, k_hat, mask=mask)
        tl.store(v_out_ptr + dst, v_hat, mask=mask)


def sketch_query_triton(key: Tensor, value: Tensor, cells: Tensor, signs: Tensor, *,
                        block_n: int | None = None) -> tuple[Tensor, Tensor]:
    """The gather-and-median kernel: ``reference_sketch_query`` as (k^, v^), each (n, H_kv, d) fp32; r in
    [1, MAX_ROWS]. ``block_n``: tokens per program (tests)."""
    _need_triton()
    r, b, H_kv, d, n = _check_sketch(key, value, cells, signs)
    _rows_for_kernel(r)
    k_hat = torch.empty(n, H_kv, d, device=key.device, dtype=torch.float32)
    v_hat = torch.empty_like(k_hat)
    if n == 0:
        return k_hat, v_hat
    HD = H_kv * d
    BLOCK_N, BLOCK_F = _token_blocks(n, HD, block_n)
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(HD, BLOCK_F))
    _sketch_query_kernel[grid](key.contiguous(), value.contiguous(), cells.to(torch.int32).contiguous(),
                               signs.to(torch.float32).contiguous(), k_hat, v_hat, n, b, HD,
                               R=r, BLOCK_N=BLOCK_N, BLOCK_F=BLOCK_F)
    return k_hat, v_hat


# ---------------------------------------------------------------------------------------------------------
# 3. Fused rebuild-then-attend for one decode query (Algorithm 4 + attention)

def _check_attention(q: Tensor, k_raw: Tensor, v_raw: Tensor, key: Tensor, value: Tensor, cells: Tensor,
                     signs: Tensor) -> tuple[int, int, int, int, int, int]:
    """(H, H_kv, d, n_raw, n_v, r), or a ValueError."""
    r, b, H_kv, d, n_v = _check_sketch(key, value, cells, signs)
    if q.dim() != 2 or q.shape[1] != d:
        raise ValueError(f"q must be (H, d={d}), got {tuple(q.shape)}")
    H = q.shape[0]
    if H % H_kv != 0:
        raise ValueError(f"query heads H = {H} must be a multiple of the KV heads H_kv = {H_kv}")
    if k_raw.dim() != 3 or k_raw.shape[0] != H_kv or k_raw.shape[2] != d or v_raw.shape != k_raw.shape:
        raise ValueError(f"k_raw and v_raw must both be (H_kv={H_kv}, n_raw, d={d}), got {tuple(k_raw.shape)} "
                         f"and {tuple(v_raw.shape)}")
    n_raw = k_raw.shape[1]
    if n_raw + n_v == 0:
        raise ValueError("nothing to attend to: no raw token and no sketch token (n_raw + n_v == 0)")
    return H, H_kv, d, n_raw, n_v, r


def reference_sketch_decode_attention(q: Tensor, k_raw: Tensor, v_raw: Tensor, key: Tensor, value: Tensor,
                                      cells: Tensor, signs: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale) v over the raw tokens and the sketch's estimates, in fp32; out (H, d) in q's
    dtype. q (H, d), query head h reading KV head h // G (G = H / H_kv); k_raw, v_raw (H_kv, n_raw, d);
    the sketch key, value (r, b, H_kv, d) and its n_v tokens' cells, signs (r, n_v)."""
    H, H_kv, d, n_raw, n_v, r = _check_attention(q, k_raw, v_raw, key, value, cells, signs)
    k_hat, v_hat = reference_sketch_query(key, value, cells, signs)                   # (n_v, H_kv, d)
    k = torch.cat([k_raw.float(), k_hat.float().transpose(0, 1)], dim=1)               # (H_kv, N, d)
    v = torch.cat([v_raw.float(), v_hat.float().transpose(0, 1)], dim=1)
    qg = q.float().view(H_kv, H // H_kv, d)                                            # (H_kv, G, d)
    probs = torch.softmax(qg @ k.transpose(1, 2) * scale, dim=-1)                      # (H_kv, G, N)
    return (probs @ v).reshape(H, d).to(q.dtype)


if HAS_TRITON:
    @triton.jit
    def _online_softmax_step(q, k, v, tok_ok, m_i, l_i, acc):
        """One block: q (G_PAD, D_PAD) pre-scaled by scale * log2(e); k, v (BLOCK_N, D_PAD); the running
        max m_i, sum l_i (G_PAD,) and output acc (G_PAD, D_PAD), updated; in base 2 (exp2), tokens where
        tok_ok (BLOCK_N,) is false left out."""
        # BEGIN SOLUTION [kernels:online_softmax] FlashAttention sec. 3.1 (Algorithm 1) for one block, in base 2
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                    # (G_PAD, BLOCK_N), base-2 logits
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))                          # finite: a block has >= 1 token
        alpha = tl.exp2(m_i - m_new)                                        # rescales what came before
        p = tl.exp2(s - m_new[:, None])                                     # (G_PAD, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        return m_new, l_i, acc
        # END SOLUTION

    @triton.jit
    def _sketch_attention_kernel(
            q_ptr, kr_ptr, vr_ptr,                 # q (H, d); raw k, v (H_kv, n_raw, d), strided
            key_ptr, value_ptr,                    # sketch cells (r, b, H_kv, d) fp32, contiguous
            cells_ptr, signs_ptr,                  # (r, n_v) int32, float
            m_ptr, l_ptr, acc_ptr,                 # partials (H_kv, S, G_PAD), (H_kv, S, G_PAD, D_PAD) fp32
            qk_scale,                              # scale * log2(e)
            n_raw, n_v, width, blocks_per_split,
            stride_qh, stride_qd, stride_kh, stride_kn, stride_kd, stride_vh, stride_vn, stride_vd,
            H_KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
            G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
        h = tl.program_id(0)                                                 # KV head
        split = tl.program_id(1)
        n_splits = tl.num_programs(1)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        d_ok = offs_d < D
        q = tl.load(q_ptr + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=(offs_g < G)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)   # (G_PAD, D_PAD)
        q = q * qk_scale
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D_PAD), tl.float32)

        nb_raw = tl.cdiv(n_raw, BLOCK_N)                                     # blocks: raw ones, then sketch
        nb = nb_raw + tl.cdiv(n_v, BLOCK_N)
        lo = split * blocks_per_split
        hi = tl.minimum(lo + blocks_per_split, nb)
        # raw blocks: read k, v as stored
        for blk in range(lo, tl.minimum(hi, nb_raw)):
            tok = blk * BLOCK_N + offs_n                                     # (BLOCK_N,)
            tok_ok = tok < n_raw
            mask = tok_ok[:, None] & d_ok[None, :]
            k = tl.load(kr_ptr + h * stride_kh + tok[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                        mask=mask, other=0.0).to(tl.float32)                 # (BLOCK_N, D_PAD)
            v = tl.load(vr_ptr + h * stride_vh + tok[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                        mask=mask, other=0.0).to(tl.float32)
            m_i, l_i, acc = _online_softmax_step(q, k, v, tok_ok, m_i, l_i, acc)
        # sketch blocks: rebuild k^, v^ in registers (gather r cells, median, sign), never stored
        col = h * D + offs_d                                                 # head h's features in a cell
        for blk in range(tl.maximum(lo, nb_raw), hi):
            tok = (blk - nb_raw) * BLOCK_N + offs_n
            tok_ok = tok < n_v
            k = _sketch_estimate(key_ptr, cells_ptr, signs_ptr, tok, tok_ok, col, d_ok, n_v, width, H_KV * D,
                                 R, False)
            v = _sketch_estimate(value_ptr, cells_ptr, signs_ptr, tok, tok_ok, col, d_ok, n_v, width, H_KV * D,
                                 R, True)
            m_i, l_i, acc = _online_softmax_step(q, k, v, tok_ok, m_i, l_i, acc)

        part = h * n_splits + split
        tl.store(m_ptr + part * G_PAD + offs_g, m_i)
        tl.store(l_ptr + part * G_PAD + offs_g, l_i)
        tl.store(acc_ptr + (part * G_PAD + offs_g)[:, None] * D_PAD + offs_d[None, :], acc)

    @triton.jit
    def _merge_splits_kernel(m_ptr, l_ptr, acc_ptr,        # partials (H_kv, S, G_PAD[, D_PAD])
                             out_ptr, stride_oh, stride_od,  # out (H, d)
                             n_splits,
                             G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
                             BLOCK_S: tl.constexpr):
        """out = sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) l_s, M = max_s m_s; one program per query
        head (KV head h, member g of its group), BLOCK_S splits at a time."""
        # BEGIN SOLUTION [kernels:merge_splits] FlashAttention sec. 3.1: the softmax of all ranges from their m, l, acc
        h = tl.program_id(0)
        g = tl.program_id(1)
        sp = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, D_PAD)
        M = tl.full((BLOCK_S,), float("-inf"), tl.float32)
        for first in range(0, n_splits, BLOCK_S):                           # pass 1: the overall max
            M = tl.maximum(M, tl.load(m_ptr + (h * n_splits + first + sp) * G_PAD + g,
                                      mask=first + sp < n_splits, other=float("-inf")))
        M_all = tl.max(M, axis=0)
        l_sum = tl.zeros((BLOCK_S,), tl.float32)
        out = tl.zeros((D_PAD,), tl.float32)
        for first in range(0, n_splits, BLOCK_S):                           # pass 2: weighted sums
            row = (h * n_splits + first + sp) * G_PAD + g                   # (BLOCK_S,)
            ok = first + sp < n_splits
            w = tl.exp2(tl.load(m_ptr + row, mask=ok, other=float("-inf")) - M_all)
            l_sum += w * tl.load(l_ptr + row, mask=ok, other=0.0)
            out += tl.sum(w[:, None] * tl.load(acc_ptr + row[:, None] * D_PAD + offs_d[None, :],
                                               mask=ok[:, None], other=0.0), axis=0)
        out = out / tl.sum(l_sum, axis=0)
        tl.store(out_ptr + (h * G + g) * stride_oh + offs_d * stride_od, out.to(out_ptr.dtype.element_ty),
                 mask=offs_d < D)
        # END SOLUTION


def sketch_decode_attention_triton(q: Tensor, k_raw: Tensor, v_raw: Tensor, key: Tensor, value: Tensor,
                                   cells: Tensor, signs: Tensor, scale: float, *, block_n: int | None = None,
                                   num_splits: int | None = None) -> Tensor:
    """The fused kernel: ``reference_sketch_decode_attention`` without writing the rebuilt tokens, out (H, d)
    in q's dtype; r in [1, MAX_ROWS]. ``block_n``: tokens per block;
    ``num_splits``: programs per KV head along the tokens (default: enough to fill the GPU, 1 in the
    interpreter); both are capped by the number of blocks."""
    m, l, acc = sketch_decode_partials_triton(q, k_raw, v_raw, key, value, cells, signs, scale, block_n=block_n,
                                              num_splits=num_splits)
    return merge_sketch_splits_triton(m, l, acc, torch.empty(q.shape[0], q.shape[1], device=q.device,
                                                             dtype=q.dtype))


def sketch_decode_partials_triton(q: Tensor, k_raw: Tensor, v_raw: Tensor, key: Tensor, value: Tensor,
                                  cells: Tensor, signs: Tensor, scale: float, *, block_n: int | None = None,
                                  num_splits: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The fused kernel's first launch alone (arguments as ``sketch_decode_attention_triton``): each (KV head,
    split)'s running max m and sum l (H_kv, S, G_PAD) and output acc (H_kv, S, G_PAD, D_PAD), fp32, in base 2
    (m is a maximum of scores times scale * log2(e)); query rows >= G and features >= d are padding."""
    _need_triton()
    H, H_kv, d, n_raw, n_v, r = _check_attention(q, k_raw, v_raw, key, value, cells, signs)
    _rows_for_kernel(r)
    G = H // H_kv
    G_PAD, D_PAD = next_pow2(G), next_pow2(d)
    # the (G_PAD, BLOCK_N, D_PAD) product of a block lives in registers: keep it around 8K elements (not
    # tl.dot in IEEE fp32, the cells' type: the rebuild, not the products, bounds it; README, kernels)
    BLOCK_N = block_n or max(16, min(64, 8192 // (G_PAD * D_PAD)))
    n_blocks = triton.cdiv(n_raw, BLOCK_N) + triton.cdiv(n_v, BLOCK_N)
    if num_splits is None:
        num_splits = fill_splits(q, H_kv)
    per_split, S = split_ranges(n_blocks, num_splits)                    # every split gets >= 1 block
    dev = q.device
    m = torch.empty(H_kv, S, G_PAD, device=dev, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(H_kv, S, G_PAD, D_PAD, device=dev, dtype=torch.float32)
    _sketch_attention_kernel[(H_kv, S)](
        q, k_raw, v_raw, key.contiguous(), value.contiguous(), cells.to(torch.int32).contiguous(),
        signs.to(torch.float32).contiguous(), m, l, acc, float(scale) * math.log2(math.e),
        n_raw, n_v, key.shape[1], per_split,
        q.stride(0), q.stride(1), k_raw.stride(0), k_raw.stride(1), k_raw.stride(2),
        v_raw.stride(0), v_raw.stride(1), v_raw.stride(2),
        H_KV=H_kv, G=G, D=d, R=r, G_PAD=G_PAD, D_PAD=D_PAD, BLOCK_N=BLOCK_N)
    return m, l, acc


def merge_sketch_splits_triton(m: Tensor, l: Tensor, acc: Tensor, out: Tensor) -> Tensor:
    """The fused kernel's second launch: the partials of ``sketch_decode_partials_triton`` (base 2) merged into
    out (H, d), written in place and returned."""
    _need_triton()
    H_kv, S, G_PAD = m.shape
    H, d = out.shape
    _merge_splits_kernel[(H_kv, H // H_kv)](m, l, acc, out, out.stride(0), out.stride(1), S,
                                            G=H // H_kv, D=d, G_PAD=G_PAD, D_PAD=acc.shape[-1], BLOCK_S=32)
    return out
