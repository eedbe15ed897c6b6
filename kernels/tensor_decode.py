"""
A fused decode kernel for tensor attention over the four-matrix cache (Triton, tutorial style).

One query attends to the pairs (a, b) of the n cached tokens (Chen et al., arXiv 2503.11108, Definitions
3.6-3.8; ``methods/tensor_attention/``). The kernel tiles the pair grid with one online softmax over all
pairs, FlashAttention-style, and writes neither the n x n scores nor a Kronecker product.

    reference_tensor_decode    the PyTorch reference (equal to ``four_cache_attention`` with one query token)
    tensor_decode_triton       the launcher; ``fastpath/tensor.py`` calls it where ``kernels.serves`` says so
    peak_memory_bytes          analytic working memory of the three paths, for the benchmark

All take q (B, H, d) and K1, K2, V1, V2 (B, H, n, d) and return (B, H, d) in q's dtype.

How it works (the math, tiling, split grid, traffic): kernels/inside.md, section "tensor_decode.py".
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import HAS_TRITON, default_scale, interpreting, next_pow2, sm_count, split_ranges

if HAS_TRITON:
    import triton
    import triton.language as tl


# ----------------------------------------------------------------------------------------------------------
# Input checks shared by every path: clear errors instead of a silent zero output or an index error.


def _check_inputs(q: Tensor, K1: Tensor, K2: Tensor, V1: Tensor, V2: Tensor) -> tuple[int, int, int, int]:
    """Validate q (B, H, d) and the factors (B, H, n, d); return (B, H, n, d)."""
    if q.dim() != 3:
        raise ValueError(f"q must be (B, H, d) (one decode query per head), got shape {tuple(q.shape)}")
    B, H, d = q.shape
    names = ("K1", "K2", "V1", "V2")
    for name, f in zip(names, (K1, K2, V1, V2)):
        if f.dim() != 4:
            raise ValueError(f"{name} must be (B, H, n, d), got shape {tuple(f.shape)}")
    if len({tuple(f.shape) for f in (K1, K2, V1, V2)}) != 1:
        raise ValueError("K1, K2, V1, V2 must have the same shape (B, H, n, d), got "
                         + ", ".join(f"{n}{tuple(f.shape)}" for n, f in zip(names, (K1, K2, V1, V2))))
    Bk, Hk, n, dk = K1.shape
    if (Bk, Hk, dk) != (B, H, d):
        raise ValueError(f"q {tuple(q.shape)} and the factors {tuple(K1.shape)} disagree: q must be (B, H, d) "
                         f"for factors (B, H, n, d)")
    if n == 0:
        raise ValueError("the cache is empty (n = 0): a softmax over no pairs is undefined")
    if d == 0:
        raise ValueError("the head dimension d is 0")
    if any(f.dtype != q.dtype for f in (K1, K2, V1, V2)):
        raise ValueError(f"q and the factors must share one dtype, got q {q.dtype} and "
                         + ", ".join(f"{n} {f.dtype}" for n, f in zip(names, (K1, K2, V1, V2))))
    if any(f.device != q.device for f in (K1, K2, V1, V2)):
        raise ValueError("q and the factors must be on one device")
    return B, H, n, d


def _block_d(d: int) -> int:
    """The kernel's block over the head dimension: a power of two, at least tl.dot's 16."""
    return max(16, next_pow2(d))


# ----------------------------------------------------------------------------------------------------------
# The reference.


def reference_tensor_decode(q: Tensor, K1: Tensor, K2: Tensor, V1: Tensor, V2: Tensor,
                            scale: float | None = None) -> Tensor:
    """Tensor attention of one query per head over the pairs (a, b) of the n cached tokens: q (B, H, d),
    factors (B, H, n, d) -> (B, H, d) in q's dtype. ``scale`` defaults to 1/sqrt(d), as in
    ``TensorAttention``. Materialises the (n, n) scores. (In the einsums the pair is (a, c): b is the batch.)"""
    _, _, _, d = _check_inputs(q, K1, K2, V1, V2)
    S = torch.einsum("bhj,bhaj,bhcj->bhac", q * default_scale(scale, d), K1, K2)   # (B, H, n, n): S[a, c]
    P = torch.softmax(S.flatten(-2), dim=-1).view_as(S)                             # over all n^2 pairs
    return torch.einsum("bhac,bhcd,bhad->bhd", P, V2, V1)          # sum_{a,c} P[a, c] V1[a] * V2[c]: (B, H, d)


# ----------------------------------------------------------------------------------------------------------
# The kernels.

if HAS_TRITON:

    @triton.jit
    def tensor_decode_kernel(
        q_ptr, k1_ptr, k2_ptr, v1_ptr, v2_ptr,          # q (B, H, d); factors (B, H, n, d), one set of strides
        m_ptr, l_ptr, acc_ptr,                          # partials: (B*H, SPLITS), (B*H, SPLITS), (B*H, SPLITS, BLOCK_D)
        scale,
        H, n, d,
        tiles_per_split,                                # a-tiles per program along the split axis
        sq_b, sq_h, sq_d,                               # strides of q
        sf_b, sf_h, sf_n, sf_d,                         # strides of K1, K2, V1, V2 (equal; the launcher ensures it)
        SPLITS: tl.constexpr,
        BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,                  # "ieee" for fp32 inputs (no TF32 rounding), else "tf32"
    ):
        """One program: the pairs (a, b) with a in its range of a-tiles and any b. Writes a partial (m, l, acc)."""
        pid_bh = tl.program_id(0).to(tl.int64)          # int64: B*H*n*d can pass 2^31 for long caches
        pid_s = tl.program_id(1)
        batch = pid_bh // H
        head = pid_bh % H

        offs_d = tl.arange(0, BLOCK_D)                  # (BLOCK_D,)
        mask_d = offs_d < d
        q = tl.load(q_ptr + batch * sq_b + head * sq_h + offs_d * sq_d, mask=mask_d, other=0.0).to(tl.float32)
        q = q * scale                                   # (BLOCK_D,), fp32

        f_base = batch * sf_b + head * sf_h             # this (batch, head)'s rows in every factor
        n_b_tiles = tl.cdiv(n, BLOCK_B)
        a_tile_start = pid_s * tiles_per_split
        a_tile_end = tl.minimum(a_tile_start + tiles_per_split, tl.cdiv(n, BLOCK_A))

        m = tl.full([], float("-inf"), tl.float32)      # running maximum of the scores seen, over all pairs
        l = tl.full([], 0.0, tl.float32)                # running sum of exp(score - m)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)     # running sum of exp(score - m) * V1[a] * V2[b]

        for ta in range(a_tile_start, a_tile_end):
            offs_a = ta * BLOCK_A + tl.arange(0, BLOCK_A)                                 # (BLOCK_A,)
            mask_a = offs_a < n
            a_ptrs = f_base + offs_a[:, None] * sf_n + offs_d[None, :] * sf_d            # (BLOCK_A, BLOCK_D)
            a_mask = mask_a[:, None] & mask_d[None, :]
            k1 = tl.load(k1_ptr + a_ptrs, mask=a_mask, other=0.0)                         # (BLOCK_A, BLOCK_D)
            v1 = tl.load(v1_ptr + a_ptrs, mask=a_mask, other=0.0).to(tl.float32)          # (BLOCK_A, BLOCK_D)
            # the query scaled by each K1 row: row a of qk1 @ K2^T is < q, K1[a] * K2[b] > for every b
            qk1 = (q[None, :] * k1.to(tl.float32)).to(k1.dtype)                           # (BLOCK_A, BLOCK_D)

            for tb in range(0, n_b_tiles):
                offs_b = tb * BLOCK_B + tl.arange(0, BLOCK_B)                             # (BLOCK_B,)
                mask_b = offs_b < n
                b_ptrs = f_base + offs_b[:, None] * sf_n + offs_d[None, :] * sf_d        # (BLOCK_B, BLOCK_D)
                b_mask = mask_b[:, None] & mask_d[None, :]
                k2 = tl.load(k2_ptr + b_ptrs, mask=b_mask, other=0.0)                     # (BLOCK_B, BLOCK_D)
                v2 = tl.load(v2_ptr + b_ptrs, mask=b_mask, other=0.0)                     # (BLOCK_B, BLOCK_D)

                s = tl.dot(qk1, tl.trans(k2), input_precision=INPUT_PRECISION)          # (BLOCK_A, BLOCK_B)
                s = tl.where(mask_a[:, None] & mask_b[None, :], s, float("-inf"))       # pairs past n: -inf

                # online softmax over all pairs: one maximum for the whole grid (the tile has a real pair)
                m_new = tl.maximum(m, tl.max(tl.max(s, axis=1), axis=0))                # scalar
                p = tl.exp(s - m_new)                                                     # (BLOCK_A, BLOCK_B)
                alpha = tl.exp(m - m_new)                                                 # 0 on the first tile
                l = l * alpha + tl.sum(tl.sum(p, axis=1), axis=0)

                pv2 = tl.dot(p.to(v2.dtype), v2, input_precision=INPUT_PRECISION)       # (BLOCK_A, BLOCK_D)
                acc = acc * alpha + tl.sum(v1 * pv2, axis=0)                              # (BLOCK_D,)
                m = m_new

        part = pid_bh * SPLITS + pid_s
        tl.store(m_ptr + part, m)
        tl.store(l_ptr + part, l)
        tl.store(acc_ptr + part * BLOCK_D + offs_d, acc)

    @triton.jit
    def tensor_decode_combine_kernel(
        m_ptr, l_ptr, acc_ptr,                          # partials, as written by tensor_decode_kernel
        out_ptr,                                        # (B, H, d), contiguous
        d,
        SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,  # SPLITS_P2: SPLITS rounded up to a power of two
        BLOCK_D: tl.constexpr,
    ):
        """One program per (batch, head): merge the splits' softmax pieces, o = sum w_s acc_s / sum w_s l_s,
        with w_s = exp(m_s - M) and M the largest m_s."""
        # BEGIN SOLUTION [kernels:merge_splits] FlashAttention sec. 3.1: the softmax of all ranges from their m, l, acc
        pid_bh = tl.program_id(0).to(tl.int64)
        offs_s = tl.arange(0, SPLITS_P2)                                                  # (SPLITS_P2,)
        mask_s = offs_s < SPLITS
        offs_d = tl.arange(0, BLOCK_D)                                                    # (BLOCK_D,)
        part = pid_bh * SPLITS + offs_s
        m = tl.load(m_ptr + part, mask=mask_s, other=float("-inf"))                      # (SPLITS_P2,)
        l = tl.load(l_ptr + part, mask=mask_s, other=0.0)                                 # (SPLITS_P2,)
        acc = tl.load(acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :],
                      mask=mask_s[:, None], other=0.0)                                    # (SPLITS_P2, BLOCK_D)

        w = tl.exp(m - tl.max(m, axis=0))                 # (SPLITS_P2,); the split 0 is never empty: M finite
        o = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)                      # (BLOCK_D,)
        tl.store(out_ptr + pid_bh * d + offs_d, o.to(out_ptr.dtype.element_ty), mask=offs_d < d)
        # END SOLUTION


# ----------------------------------------------------------------------------------------------------------
# The launcher.


KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _default_splits(q: Tensor, BH: int, n_a_tiles: int) -> int:
    """Enough programs to give every streaming multiprocessor a few (CUDA); one split elsewhere (the CPU
    interpreter runs programs one after another, so splitting only adds the combine work)."""
    if not q.is_cuda:
        return 1
    sms = sm_count(q)
    splits = max(1, min(n_a_tiles, triton.cdiv(4 * sms, BH)))
    # SPLITS is a compile-time constant: rounded down to a power of two, a growing cache triggers a handful
    # of compilations (1, 2, 4, ...) instead of one per new a-tile
    return 1 << (splits.bit_length() - 1)


def tensor_decode_triton(q: Tensor, K1: Tensor, K2: Tensor, V1: Tensor, V2: Tensor, scale: float | None = None,
                         block_a: int | None = None, block_b: int | None = None, splits: int | None = None,
                         num_stages: int | None = None) -> Tensor:
    """Tensor-attention decode with the Triton kernels: q (B, H, d), K1, K2, V1, V2 (B, H, n, d) -> (B, H, d).

    ``block_a`` x ``block_b`` is the pair tile (powers of two >= 16; None: 32 x 64 for 16-bit inputs, 16 x 32
    for fp32, whose IEEE ``tl.dot`` spills registers with the larger tile at d = 128 on an H100). ``splits``
    is the number of programs per (batch, head) along the a axis (None: ``_default_splits``); it is capped so
    that no program gets an empty range of a-tiles. Scores, softmax and accumulation run in fp32; fp16/bf16
    inputs go into ``tl.dot`` as they are (fp32 accumulation), fp32 inputs in full IEEE precision. Needs CUDA
    tensors or TRITON_INTERPRET=1.

    ``num_stages`` (software pipelining of the K2/V2 loads) defaults to 3 for 16-bit inputs and to 2 (1 for
    d > 128) for fp32, whose IEEE ``tl.dot`` stages its operands in shared memory: with the default tiles
    and d = 128 that is about 90 KB at 2 stages and 156 KB at 3 (sm_90), d = 256 needs 164 KB at 1 stage.
    """
    if not HAS_TRITON:
        raise RuntimeError("tensor_decode_triton needs triton; use reference_tensor_decode")
    if block_a is None or block_b is None:     # fp32's IEEE tl.dot spills with 32 x 64 tiles at d = 128 (sm_90)
        small = q.dtype == torch.float32
        block_a, block_b = block_a or (16 if small else 32), block_b or (32 if small else 64)
    B, H, n, d = _check_inputs(q, K1, K2, V1, V2)
    if not (q.is_cuda or interpreting()):
        raise RuntimeError("tensor_decode_triton needs CUDA tensors, or TRITON_INTERPRET=1 (set before the "
                           "kernels are imported) for the CPU interpreter")
    for name, blk in (("block_a", block_a), ("block_b", block_b)):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot needs tiles of at least 16), got {blk}")
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"tensor_decode_triton takes float32, float16 or bfloat16 inputs, got {q.dtype}")
    if q.dtype == torch.bfloat16 and not q.is_cuda:
        raise NotImplementedError("the Triton interpreter multiplies the raw bits of bfloat16 tl.dot operands "
                                  "(triton-lang/triton#11584, unsupported upstream): run bfloat16 on CUDA")

    BH = B * H
    n_a_tiles = triton.cdiv(n, block_a)
    if splits is None:
        splits = _default_splits(q, BH, n_a_tiles)
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    tiles_per_split, splits = split_ranges(n_a_tiles, splits)   # every program gets at least one a-tile

    factors = (K1, K2, V1, V2)
    if len({f.stride() for f in factors}) != 1:               # the kernel takes one set of factor strides
        factors = tuple(f.contiguous() for f in factors)
    BLOCK_D = _block_d(d)
    if num_stages is None:
        num_stages = 3 if q.dtype != torch.float32 else 2 if BLOCK_D <= 128 else 1

    m_part = torch.empty(BH, splits, device=q.device, dtype=torch.float32)
    l_part = torch.empty(BH, splits, device=q.device, dtype=torch.float32)
    acc_part = torch.empty(BH, splits, BLOCK_D, device=q.device, dtype=torch.float32)
    out = torch.empty(B, H, d, device=q.device, dtype=q.dtype)

    tensor_decode_kernel[(BH, splits)](
        q, *factors, m_part, l_part, acc_part,
        default_scale(scale, d), H, n, d, tiles_per_split,
        *q.stride(), *factors[0].stride(),
        SPLITS=splits, BLOCK_A=block_a, BLOCK_B=block_b, BLOCK_D=BLOCK_D,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_stages=num_stages,
    )
    tensor_decode_combine_kernel[(BH,)](
        m_part, l_part, acc_part, out, d,
        SPLITS=splits, SPLITS_P2=next_pow2(splits), BLOCK_D=BLOCK_D,
    )
    return out


# ----------------------------------------------------------------------------------------------------------
# Working memory, for the benchmark.

PATHS = ("naive", "reference", "kernel")


def peak_memory_bytes(n: int, d: int, path: str, *, splits: int = 1, itemsize: int = 4) -> int:
    """Peak working memory of one decode step, per query and per head, in bytes: the largest set of
    intermediates alive at once, *not* counting the cache (4 n d numbers) or the output (d numbers), which
    every path shares. O(d) temporaries are left out. Multiply by B * H for a batch.

    ``"naive"``      ``naive_four_cache_attention``: K1 (/) K2 and V1 (/) V2 (n^2 d numbers each) are both
                     alive while the scores (n^2) are soft-maxed into a new n^2 tensor:
                     2 n^2 d + 2 n^2 numbers of ``itemsize`` bytes.
    ``"reference"``  ``four_cache_attention``, three phases: q * K1 (n d) next to the scores (n^2); the scores
                     next to their softmax (2 n^2); P next to P @ V2 and V1 * (P @ V2) (n^2 + 2 n d). Peak
                     n^2 + max(n^2, 2 n d) numbers of ``itemsize`` bytes.
    ``"kernel"``     ``tensor_decode_triton``: only the partials m, l, acc of its ``splits`` programs,
                     splits * (BLOCK_D + 2) fp32 numbers with BLOCK_D = max(16, next power of two >= d);
                     the tiles live in registers and shared memory. Independent of n.
    """
    if n < 0 or d < 1:
        raise ValueError(f"need n >= 0 and d >= 1, got n={n}, d={d}")
    if path == "naive":
        return (2 * n * n * d + 2 * n * n) * itemsize
    if path == "reference":
        return (n * n + max(n * n, 2 * n * d)) * itemsize
    if path == "kernel":
        if splits < 1:
            raise ValueError(f"splits must be >= 1, got {splits}")
        return splits * (_block_d(d) + 2) * 4
    raise ValueError(f"unknown path {path!r}; choose one of {PATHS}")
