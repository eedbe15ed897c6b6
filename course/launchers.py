"""
The grader's own wrappers of the copy's Triton kernels: the grid, the buffers and the arguments each kernel
takes, computed here in the test process, and the copy's ``@triton.jit`` function launched with them in a
process that imports none of the copy's modules (``adapters.launch``, course/sandbox/student_process.py
``KernelsAlone``). So a kernel earns its points only by what it computes in Triton's language: a Python wrapper
of the copy's that answers in PyTorch is never called. The arguments are those of the library's wrappers
(kernels/decode_attention.py, count_sketch.py, tensor_decode.py), which the copy must keep. The grader copies
this file beside the tests, as it does ``oracle.py``.
"""

from __future__ import annotations

import math

import torch
from oracle import written
from torch import Tensor

DECODE, SKETCH, TENSOR = "kernels/decode_attention.py", "kernels/count_sketch.py", "kernels/tensor_decode.py"
LOG2E = math.log2(math.e)


def unset(*shape: int) -> Tensor:
    """An output buffer the kernel fills, NaN until it does: ``torch.empty`` handed the kernels' process whatever
    the test process's memory held there, the oracle's answers among what it had computed (round fifteen)."""
    return torch.full(shape, float("nan"))


GUARD = 4                    # numbers past each merge output (NaN, as ``unset`` leaves them) no kernel may write


def untouched(guard: Tensor, where: str) -> None:
    """The numbers past an output (its padding columns, the memory after it) still NaN: a store that a kernel
    does not mask to the output's d columns writes there (on a GPU, into another row's output or another tensor;
    the interpreter's programs run one after another, so the next row hid it)."""
    if not bool(guard.isnan().all()):
        raise AssertionError(f"{where}: the kernel wrote past its output; mask the store to the output's columns "
                             "(a head dimension below the kernel's power-of-two block)")


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pad_to(x: Tensor, dim: int, size: int) -> Tensor:
    """x zero-padded along ``dim`` to ``size``."""
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def split_ranges(blocks: int, splits: int) -> tuple[int, int]:
    """(blocks per range, ranges): at most ``splits`` ranges of whole blocks, none empty."""
    per = cdiv(blocks, max(1, min(splits, blocks)))
    return per, cdiv(blocks, per)


# -- the online softmax: the split kernels -----------------------------------------------------------------

def decode_partials(A, q: Tensor, k: Tensor, v: Tensor, idx: Tensor | None, block_n: int, splits: int,
                    dot_fp32: bool | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """decode_attention.py's ``_decode_split_kernel``: q (B, H, d), k, v (B, H_kv, S, d), idx (B, H_kv, K) rows
    of each KV head (-1: padding) or None -> m, l (B * H_kv, splits, G), acc (..., G, d), and the scores it
    stores for H2O (``SCORES`` on), s (B * H_kv, G, n), fp32. ``dot_fp32``: the products in fp32, by default
    for fp32 and bfloat16 caches as the library does on a CPU (False: a bfloat16 cache as a GPU takes it)."""
    B, H, d = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    n = idx.shape[2] if idx is not None else k.shape[2]
    per, splits = split_ranges(cdiv(n, block_n), splits)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    m = written(unset(B * H_kv, splits, G))
    l, acc = written(unset(B * H_kv, splits, G)), written(unset(B * H_kv, splits, G, d))
    s = written(unset(B * H_kv, G, n))
    ix = idx.to(torch.int32).contiguous() if idx is not None else torch.zeros(1, 1, 1, dtype=torch.int32)
    unused = torch.zeros(1)                            # the pointers of the options these tests leave off
    if dot_fp32 is None:
        dot_fp32 = k.dtype in (torch.float32, torch.bfloat16)      # on a CPU (the library's rule)
    A.launch(DECODE, "_decode_split_kernel", (B * H_kv, splits),
             q, k, v, ix, unused, m, l, acc, s, torch.zeros(1, dtype=torch.long), n, block_n * per,
             1 / math.sqrt(d), 0, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
             v.stride(0), v.stride(1), v.stride(2), ix.stride(0) if idx is not None else 0,
             ix.stride(1) if idx is not None else 0, 0, 0,
             H_kv=H_kv, G=G, G_PAD=max(16, next_pow2(G)), D=d, BLOCK_N=block_n, GATHER=idx is not None,
             MASKED=False, DOT_FP32=dot_fp32, SCORES=True, EVICT=False)
    return m, l, acc, s


def sketch_partials(A, q: Tensor, k: Tensor, v: Tensor, scale: float, block_n: int,
                    splits: int) -> tuple[Tensor, Tensor, Tensor]:
    """count_sketch.py's ``_sketch_attention_kernel`` over raw tokens only (an empty sketch): q (H, d), k, v
    (H_kv, n, d) -> m, l (H_kv, splits, G), acc (H_kv, splits, G, d), in base 2."""
    H, d = q.shape
    H_kv, n = k.shape[0], k.shape[1]
    G = H // H_kv
    G_PAD, D_PAD = next_pow2(G), next_pow2(d)
    per, S = split_ranges(cdiv(n, block_n), splits)
    cells = torch.zeros(1, 1, H_kv, d)                              # one row of one cell, never read
    no_token = torch.zeros(1, 0, dtype=torch.int32)
    m = written(unset(H_kv, S, G_PAD))
    l, acc = written(unset(H_kv, S, G_PAD)), written(unset(H_kv, S, G_PAD, D_PAD))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    A.launch(SKETCH, "_sketch_attention_kernel", (H_kv, S),
             q, k, v, cells, cells.clone(), no_token, no_token.float(), m, l, acc, float(scale) * LOG2E,
             n, 0, 1, per, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
             v.stride(0), v.stride(1), v.stride(2),
             H_KV=H_kv, G=G, D=d, R=1, G_PAD=G_PAD, D_PAD=D_PAD, BLOCK_N=block_n)
    return m[:, :, :G], l[:, :, :G], acc[:, :, :G, :d]


# -- the merge of the ranges: the merge kernels -------------------------------------------------------------

def merge_kernel(A, m: Tensor, l: Tensor, acc: Tensor) -> Tensor:
    """decode_attention.py's ``_merge_splits_kernel``: m, l (R, splits, G), acc (R, splits, G, d) -> (R, G, d)."""
    R, splits, G, d = acc.shape
    out = written(unset(R, G, d))
    A.launch(DECODE, "_merge_splits_kernel", (R, G), m.contiguous(), l.contiguous(), acc.contiguous(), out,
             splits, G=G, D=d, BLOCK_S=32)
    return out


def merge_sketch_kernel(A, m: Tensor, l: Tensor, acc: Tensor) -> Tensor:
    """count_sketch.py's ``_merge_splits_kernel`` (base 2: m in base e times log2(e); rows R play the KV heads;
    G and d padded to powers of two)."""
    R, S, G, d = acc.shape
    G_PAD, D_PAD = next_pow2(G), next_pow2(d)
    m2, l2 = (pad_to(x, 2, G_PAD).contiguous() for x in (m * LOG2E, l))
    acc2 = pad_to(pad_to(acc, 2, G_PAD), 3, D_PAD).contiguous()
    wide = written(unset(R * G, D_PAD + GUARD))           # out: its first d columns (out.stride(0) = D_PAD + 4)
    A.launch(SKETCH, "_merge_splits_kernel", (R, G), m2, l2, acc2, wide, wide.stride(0), wide.stride(1), S,
             G=G, D=d, G_PAD=G_PAD, D_PAD=D_PAD, BLOCK_S=32)
    untouched(wide[:, d:], f"count_sketch.py's _merge_splits_kernel, d = {d}: columns {d}.. of each output row "
              f"(out.stride(0) = {wide.stride(0)})")
    return wide[:, :d].reshape(R, G, d)


def merge_tensor_kernel(A, m: Tensor, l: Tensor, acc: Tensor) -> Tensor:
    """tensor_decode.py's ``tensor_decode_combine_kernel`` (partials (R * G, splits), acc (R * G, splits,
    BLOCK_D) with d padded to BLOCK_D)."""
    R, S, G, d = acc.shape
    BLOCK_D = max(16, next_pow2(d))
    m2, l2 = (x.transpose(1, 2).reshape(R * G, S).contiguous() for x in (m, l))
    acc2 = pad_to(acc.transpose(1, 2).reshape(R * G, S, d), 2, BLOCK_D).contiguous()
    flat = written(unset(R * G * d + BLOCK_D + GUARD))    # out: its first R * G * d numbers
    A.launch(TENSOR, "tensor_decode_combine_kernel", (R * G,), m2, l2, acc2, flat, d, SPLITS=S,
             SPLITS_P2=next_pow2(S), BLOCK_D=BLOCK_D)
    untouched(flat[R * G * d:], f"tensor_decode.py's tensor_decode_combine_kernel, d = {d}: the numbers after "
              f"its output of {R * G} rows of {d}")
    return flat[:R * G * d].view(R, G, d)


# -- the count sketch: insert and query (KVReviver Algorithms 1-2) -------------------------------------------

def token_blocks(n: int, HD: int, block_n: int | None) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_F) as the library's wrappers choose them."""
    BLOCK_F = min(next_pow2(HD), 1024)
    return block_n or max(1, min(next_pow2(n), 4096 // BLOCK_F)), BLOCK_F


def sketch_insert(A, key: Tensor, value: Tensor, cells: Tensor, signs: Tensor, k: Tensor, v: Tensor,
                  block_n: int | None = None) -> None:
    """count_sketch.py's ``_sketch_insert_kernel``, in place on ``key`` and ``value`` (r, b, H_kv, d) fp32
    (mark them ``written``); cells, signs (r, n); k, v (n, H_kv, d)."""
    r, b, H_kv, d = key.shape
    n = cells.shape[1]
    if n == 0:
        return
    HD = H_kv * d
    BLOCK_N, BLOCK_F = token_blocks(n, HD, block_n)
    A.launch(SKETCH, "_sketch_insert_kernel", (cdiv(n, BLOCK_N), r, cdiv(HD, BLOCK_F)), key, value,
             cells.to(torch.int32).contiguous(), signs.to(torch.float32).contiguous(), k.contiguous(),
             v.contiguous(), n, b, HD, BLOCK_N=BLOCK_N, BLOCK_F=BLOCK_F)


def sketch_query(A, key: Tensor, value: Tensor, cells: Tensor, signs: Tensor,
                 block_n: int | None = None) -> tuple[Tensor, Tensor]:
    """count_sketch.py's ``_sketch_query_kernel``: the estimates k^, v^ (n, H_kv, d) fp32."""
    r, b, H_kv, d = key.shape
    n = cells.shape[1]
    k_hat, v_hat = written(unset(n, H_kv, d)), written(unset(n, H_kv, d))
    if n == 0:
        return k_hat, v_hat
    HD = H_kv * d
    BLOCK_N, BLOCK_F = token_blocks(n, HD, block_n)
    A.launch(SKETCH, "_sketch_query_kernel", (cdiv(n, BLOCK_N), cdiv(HD, BLOCK_F)), key.contiguous(),
             value.contiguous(), cells.to(torch.int32).contiguous(), signs.to(torch.float32).contiguous(),
             k_hat, v_hat, n, b, HD, R=r, BLOCK_N=BLOCK_N, BLOCK_F=BLOCK_F)
    return k_hat, v_hat
