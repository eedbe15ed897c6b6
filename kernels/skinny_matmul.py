"""
Skinny matmul: the product of a few rows (a decode step's B sequences) with a weight matrix, its neighbours fused.

A decode step's products are bound by reading the weights; this kernel reads each weight once and fuses the
small kernels around the product (``fastpath/skinny.py``), in fp32 or bf16:

    norm_linear     rms_norm(x) * g @ W^T          x (M, K), g (K,), W (N, K) -> (M, N)   the LM head
    norm_swiglu     silu(h @ Wg^T) * (h @ Wu^T)    h = rms_norm(x) * g, W = [Wg; Wu] (2N, K) -> (M, N)
    linear_add      x + y @ W^T                    y (M, K), W (N, K), x (M, N) -> (M, N)   o_proj, down

The launchers ``norm_linear_triton(x, g, eps, w)``, ``norm_swiglu_triton(x, g, eps, w_gate_up)`` and
``linear_add_triton(y, w, x)`` are tested against ``reference_norm_linear``, ``reference_norm_swiglu`` and
``reference_linear_add`` within ``TOLERANCE``; launch settings in ``SKINNY_TUNED`` (``fastpath/tune.py``).

How it works (the folded norm, the grid, rounding): kernels/inside.md, section "skinny_matmul.py".
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

BLOCK_M = 16                # rows per program: tl.dot's smallest tile (fewer rows are masked)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}   # of max |reference|


# ----------------------------------------------------------------------------------------------------------
# The references: the arithmetic of fastpath/fused.py's layer, rounding where it rounds

def _rms_norm(x: Tensor, g: Tensor, eps: float) -> Tensor:
    """``nanollm.attention.RMSNorm``: normalised in fp32, rounded back to x's dtype, times the weight g (K,)."""
    return g * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def reference_norm_linear(x: Tensor, g: Tensor, eps: float, w: Tensor) -> Tensor:
    """x (M, K), g (K,), w (N, K) -> rms_norm(x) * g @ w^T (M, N)."""
    return F.linear(_rms_norm(x, g, eps), w)


def reference_norm_swiglu(x: Tensor, g: Tensor, eps: float, w: Tensor) -> Tensor:
    """x (M, K), g (K,), w (2N, K) the gate's rows then the up's -> silu(gate) * up (M, N)."""
    gate, up = F.linear(_rms_norm(x, g, eps), w).chunk(2, dim=-1)
    return F.silu(gate) * up


def reference_linear_add(y: Tensor, w: Tensor, x: Tensor) -> Tensor:
    """y (M, K), w (N, K), x (M, N) -> x + y @ w^T (M, N): a product and its residual."""
    return x + F.linear(y, w)


# ----------------------------------------------------------------------------------------------------------
# The kernel: one program per BLOCK_N output columns and 16 rows

if HAS_TRITON:

    @triton.jit
    def _products(
        x_ptr, g_ptr, w_rows, up_offset, rm, mask_m, mask_n, K, eps, stride_xm,
        NORM: tl.constexpr, TWO: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """A program's products, walking K: rows rm of x (M, K) times the weight's rows at ``w_rows`` (BLOCK_N, 1
        pointers), and with TWO, times the rows ``up_offset`` further on too (a second accumulator over the same
        x); with NORM, x times g and each output scaled by its row's 1 / rms(x). Returns two (BLOCK_M, BLOCK_N)
        fp32 accumulators (the second zeros without TWO)."""
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        two = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)                        # each row's sum of squares (NORM)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            mask_k = kk < K
            a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0).to(tl.float32)                                          # (BLOCK_M, BLOCK_K)
            if NORM:
                ss += tl.sum(a * a, axis=1)
                a = a * tl.load(g_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            w = tl.load(w_rows + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
            if DOT_FP32:
                acc += tl.dot(a, tl.trans(w.to(tl.float32)), input_precision="ieee")        # (BLOCK_M, BLOCK_N)
            else:
                acc += tl.dot(a.to(w.dtype), tl.trans(w))
            if TWO:                                                       # the second rows, up_offset further on
                wu = tl.load(w_rows + up_offset + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                if DOT_FP32:
                    two += tl.dot(a, tl.trans(wu.to(tl.float32)), input_precision="ieee")
                else:
                    two += tl.dot(a.to(wu.dtype), tl.trans(wu))
        if NORM:                                                          # 1 / rms(x), one scale per row
            inv = 1.0 / tl.sqrt_rn(ss / K + eps)                        # IEEE square root, as torch's
            acc = acc * inv[:, None]
            two = two * inv[:, None]
        return acc, two

    @triton.jit
    def _skinny_kernel(
        x_ptr, g_ptr, w_ptr, r_ptr, out_ptr,
        M, N, K, eps,
        stride_xm, stride_wn, stride_rm, stride_om,   # x (M, K), w (N or 2N, K), r and out (M, N); last strides 1
        up_offset,                                    # SwiGLU: N * stride_wn, where the up rows start (int64 if large)
        NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)            # this program's output columns
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)            # its rows
        mask_m, mask_n = rm < M, rn < N
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn             # (BLOCK_N, 1): int64, large weights
        acc, up = _products(x_ptr, g_ptr, w_rows, up_offset, rm, mask_m, mask_n, K, eps, stride_xm,
                            NORM, SWIGLU, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)               # up: SwiGLU's half
        if SWIGLU:
            acc = acc / (1.0 + tl.exp(-acc)) * up                         # silu(gate) * up
        out_mask = mask_m[:, None] & mask_n[None, :]
        if RESIDUAL:
            acc += tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=out_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


class SkinnyLaunch(NamedTuple):
    """How a skinny product is cut: output columns per program, the step along K, Triton's warps and stages."""
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_LAUNCH = SkinnyLaunch(16, 256, 4, 3)   # 16 columns: the most programs a product of few columns gets
# the launch timed fastest per (variant, N, K, dtype) by fastpath.tune.tune_skinny; others take DEFAULT_LAUNCH
SKINNY_TUNED: dict[tuple[str, int, int, torch.dtype], SkinnyLaunch] = {}


def check_product(x: Tensor, w: Tensor, rows_of_w: int, name: str) -> None:
    """One-line errors for operands a launch cannot take: x (M, K) and w (N, K), N a multiple of ``rows_of_w``,
    one dtype (fp32 or bf16) and one device."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: x (M, K) and w (N, K) must share K, got {tuple(x.shape)} and {tuple(w.shape)}")
    if w.shape[0] % rows_of_w:
        raise ValueError(f"{name}: w must have an even number of rows (the gate's, then the up's), got {w.shape[0]}")
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"{name}: x and w must share a dtype and a device, got {x.dtype} on {x.device} and "
                         f"{w.dtype} on {w.device}")
    if x.dtype not in TOLERANCE:
        raise ValueError(f"{name}: the kernel takes fp32 or bf16, got {x.dtype} (in fp16 the norm, folded in after "
                         "the product, would let x * g overflow where the normalised x does not)")


def _launch(variant: str, x: Tensor, w: Tensor, g: Tensor | None, eps: float, r: Tensor | None,
            launch: SkinnyLaunch | None) -> Tensor:
    if not HAS_TRITON:
        raise RuntimeError("the skinny kernel needs triton; use reference_norm_linear, reference_norm_swiglu or "
                           "reference_linear_add")
    M, K = x.shape
    N = w.shape[0] // (2 if variant == "norm_swiglu" else 1)
    launch = launch or SKINNY_TUNED.get((variant, N, K, w.dtype), DEFAULT_LAUNCH)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    if r is not None and r.stride(-1) != 1:
        r = r.contiguous()
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    # fp32 multiplies in IEEE fp32; so does bf16 in the CPU interpreter, whose bf16 tl.dot multiplies the
    # operands' raw bits (as in decode_attention.py)
    dot_fp32 = w.dtype == torch.float32 or not w.is_cuda
    grid = (triton.cdiv(N, launch.block_n), triton.cdiv(M, BLOCK_M))
    _skinny_kernel[grid](
        x, g if g is not None else x, w, r if r is not None else out, out, M, N, K, float(eps),
        x.stride(0), w.stride(0), r.stride(0) if r is not None else 0, out.stride(0), N * w.stride(0),
        NORM=g is not None, SWIGLU=variant == "norm_swiglu", RESIDUAL=r is not None, DOT_FP32=dot_fp32,
        BLOCK_M=BLOCK_M, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    return out


def norm_linear_triton(x: Tensor, g: Tensor, eps: float, w: Tensor, launch: SkinnyLaunch | None = None) -> Tensor:
    """``reference_norm_linear`` in one launch (always the kernel: a CUDA tensor or, under
    ``TRITON_INTERPRET=1``, a CPU one)."""
    check_product(x, w, 1, "norm_linear")
    if g.shape != (x.shape[1],):
        raise ValueError(f"norm_linear: the norm's weight must have shape ({x.shape[1]},), got {tuple(g.shape)}")
    return _launch("norm_linear", x, w, g, eps, None, launch)


def norm_swiglu_triton(x: Tensor, g: Tensor, eps: float, w: Tensor, launch: SkinnyLaunch | None = None) -> Tensor:
    """``reference_norm_swiglu`` in one launch: w (2N, K), the gate's N rows then the up's."""
    check_product(x, w, 2, "norm_swiglu")
    if g.shape != (x.shape[1],):
        raise ValueError(f"norm_swiglu: the norm's weight must have shape ({x.shape[1]},), got {tuple(g.shape)}")
    return _launch("norm_swiglu", x, w, g, eps, None, launch)


def linear_add_triton(y: Tensor, w: Tensor, x: Tensor, launch: SkinnyLaunch | None = None) -> Tensor:
    """``reference_linear_add`` in one launch: x + y @ w^T, the residual x (M, N) added before the rounding."""
    check_product(y, w, 1, "linear_add")
    if x.shape != (y.shape[0], w.shape[0]) or x.dtype != y.dtype:
        raise ValueError(f"linear_add: the residual must be ({y.shape[0]}, {w.shape[0]}) in {y.dtype}, got "
                         f"{tuple(x.shape)} in {x.dtype}")
    return _launch("linear_add", y, w, None, 0.0, x, launch)
