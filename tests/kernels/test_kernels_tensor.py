"""The tensor-attention decode kernel (kernels/tensor_decode.py) against the PyTorch references.

Without CUDA the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before any kernel is defined), which costs a few ms per (program x tile) iteration, so the shapes are tiny:
blocks of 16 and at most a few tiles per axis.
"""

import math

import pytest
import torch

from kernels import interpreting
from kernels.tensor_decode import HAS_TRITON, peak_memory_bytes, reference_tensor_decode, tensor_decode_triton
from methods.tensor_attention import four_cache_attention, naive_four_cache_attention

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")

# where the kernel can run: CUDA when present, the CPU interpreter when TRITON_INTERPRET=1
KERNEL_DEVICES = (["cuda"] if torch.cuda.is_available() else []) + \
                 (["cpu"] if interpreting() else [])
kernel_device = pytest.mark.parametrize("dev", KERNEL_DEVICES or [pytest.param("cpu", marks=pytest.mark.skip(
    reason="no CUDA device and TRITON_INTERPRET is not 1"))])

BLOCKS = dict(block_a=16, block_b=16)              # the smallest tiles tl.dot takes: few interpreter iterations


def make(n, d=16, B=1, H=1, dtype=torch.float32, dev="cpu", seed=0):
    """q (B, H, d) and factors K1, K2, V1, V2 (B, H, n, d), standard normal."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, d, generator=g)
    factors = [torch.randn(B, H, n, d, generator=g) for _ in range(4)]
    return [t.to(dev, dtype) for t in (q, *factors)]


def naive(q, K1, K2, V1, V2, scale):
    """The Kronecker-product path (n^2 d memory), a second reference."""
    return naive_four_cache_attention(q.unsqueeze(-2), K1, K2, V1, V2, scale).squeeze(-2)


def assert_matches(out, ref, rel=1e-5):
    """fp32 agreement: absolute tolerance ``rel`` times the output's scale."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=rel * max(1.0, ref.abs().max().item()))


# ----------------------------------------------------------------------------------------------------------
# fp32 agreement


@needs_triton
@kernel_device
@pytest.mark.parametrize("n", [1, 5, 37])           # one partial tile, one ragged tile, 3 x 3 tiles (ragged)
def test_kernel_matches_references_ragged_n(dev, n):
    q, K1, K2, V1, V2 = make(n, dev=dev)
    scale = 1 / math.sqrt(16)
    out = tensor_decode_triton(q, K1, K2, V1, V2, scale, splits=1, **BLOCKS)
    assert_matches(out, reference_tensor_decode(q, K1, K2, V1, V2, scale))
    assert_matches(out, naive(q, K1, K2, V1, V2, scale))


@needs_triton
@kernel_device
@pytest.mark.parametrize("splits", [2, 3, 8])       # 3 a-tiles: uneven ranges (2 + 1), one each, capped at 3
def test_splits_along_a_combine_exactly(dev, splits):
    q, K1, K2, V1, V2 = make(37, dev=dev, seed=1)
    q = q * 4                                       # peaked scores: the splits' maxima differ a lot
    out = tensor_decode_triton(q, K1, K2, V1, V2, 0.25, splits=splits, **BLOCKS)
    assert_matches(out, reference_tensor_decode(q, K1, K2, V1, V2, 0.25))


@needs_triton
@kernel_device
def test_batch_heads_strides_and_rectangular_tiles(dev):
    q, K1, K2, V1, V2 = make(20, B=2, H=3, dev=dev, seed=2)
    ref = reference_tensor_decode(q, K1, K2, V1, V2)
    assert_matches(tensor_decode_triton(q, K1, K2, V1, V2, splits=2, **BLOCKS), ref)
    assert_matches(tensor_decode_triton(q, K1, K2, V1, V2, block_a=16, block_b=32, splits=1), ref)
    # views into a larger buffer (as the cache's growing rows are) and a factor with other strides
    buf = torch.zeros(4, 2, 3, 32, 16, device=dev)
    buf[:, :, :, :20] = torch.stack([K1, K2, V1, V2])
    views = list(buf[:, :, :, :20].unbind(0))
    views[3] = V2.transpose(-1, -2).contiguous().transpose(-1, -2)        # same values, d-major strides
    assert_matches(tensor_decode_triton(q[:, :, None, :].expand(2, 3, 5, 16)[:, :, 2], *views, splits=2,
                                        **BLOCKS), ref)


@needs_triton
@kernel_device
def test_single_token_cache_is_the_value_product(dev):
    q, K1, K2, V1, V2 = make(1, B=2, H=2, dev=dev, seed=3)
    out = tensor_decode_triton(q, K1, K2, V1, V2, **BLOCKS)
    # one pair: its softmax weight is 1 whatever the score, o = V1[0] * V2[0]
    assert_matches(out, (V1 * V2)[:, :, 0])
    assert_matches(out, reference_tensor_decode(q, K1, K2, V1, V2))


@needs_triton
@kernel_device
def test_all_ones_k2_v2_is_standard_softmax_attention(dev):
    q, K1, _, V1, _ = make(21, dev=dev, seed=4)
    ones = torch.ones_like(K1)
    out = tensor_decode_triton(q, K1, ones, V1, ones, splits=2, **BLOCKS)
    p = torch.softmax((K1 @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(16), dim=-1)  # (B, H, n)
    assert_matches(out, (p.unsqueeze(-2) @ V1).squeeze(-2))


@needs_triton
@kernel_device
@pytest.mark.parametrize("d", [8, 24])               # padded in registers to 16 and 32 (masked d axis)
def test_head_dim_not_a_power_of_two(dev, d):
    q, K1, K2, V1, V2 = make(19, d=d, dev=dev, seed=5)
    out = tensor_decode_triton(q, K1, K2, V1, V2, splits=2, **BLOCKS)
    assert_matches(out, reference_tensor_decode(q, K1, K2, V1, V2))       # default scale 1/sqrt(d)
    assert_matches(out, naive(q, K1, K2, V1, V2, 1 / math.sqrt(d)))


# ----------------------------------------------------------------------------------------------------------
# 16-bit inputs


@needs_triton
@kernel_device
def test_fp16_inputs(dev):
    """fp16 factors go into tl.dot as fp16 (fp32 accumulation); q * K1 and the probabilities are rounded to
    fp16 before their matmuls and the output is stored in fp16, each a relative error of 2^-11 ~ 5e-4:
    tolerance 5e-3 of the output scale, against the fp32 reference on the same (fp16-rounded) numbers."""
    q, K1, K2, V1, V2 = make(37, dev=dev, dtype=torch.float16, seed=6)
    out = tensor_decode_triton(q, K1, K2, V1, V2, splits=2, **BLOCKS)
    assert out.dtype == torch.float16
    ref = reference_tensor_decode(*(t.float() for t in (q, K1, K2, V1, V2)))
    assert_matches(out.float(), ref, rel=5e-3)


@needs_triton
@kernel_device
def test_bf16_inputs(dev):
    """bf16 has 8 mantissa bits (relative rounding 2^-9 ~ 2e-3 per step): tolerance 4e-2 of the output scale.
    The CPU interpreter computes bf16 tl.dot on the raw bits (triton-lang/triton#11584): there the launcher
    refuses (the library never calls it on a CPU) and the bf16 reference meets the same tolerance."""
    q, K1, K2, V1, V2 = make(37, dev=dev, dtype=torch.bfloat16, seed=7)
    ref32 = reference_tensor_decode(*(t.float() for t in (q, K1, K2, V1, V2)))
    if dev == "cpu":
        with pytest.raises(NotImplementedError, match="bfloat16"):
            tensor_decode_triton(q, K1, K2, V1, V2, **BLOCKS)
        out = reference_tensor_decode(q, K1, K2, V1, V2)
    else:
        out = tensor_decode_triton(q, K1, K2, V1, V2, splits=2, **BLOCKS)
    assert out.dtype == torch.bfloat16
    assert_matches(out.float(), ref32, rel=4e-2)


# ----------------------------------------------------------------------------------------------------------
# The reference is the library's tensor attention


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_reference_is_four_cache_attention(dtype, atol):
    """The kernel file's own reference (the definition in two einsums) equals the library's factored decode
    step, ``four_cache_attention`` with one query per head, and the materialising path; default scale
    1/sqrt(d). (The sums run in another order: equal up to rounding.)"""
    q, K1, K2, V1, V2 = make(23, d=8, B=2, H=3, dtype=dtype, seed=9)
    out = reference_tensor_decode(q, K1, K2, V1, V2)
    assert out.shape == (2, 3, 8) and out.dtype == dtype
    library = four_cache_attention(q.unsqueeze(-2), K1, K2, V1, V2, 1 / math.sqrt(8)).squeeze(-2)
    torch.testing.assert_close(out, library, rtol=0, atol=atol)
    torch.testing.assert_close(out, naive(q, K1, K2, V1, V2, 1 / math.sqrt(8)), rtol=0, atol=atol)
    torch.testing.assert_close(reference_tensor_decode(q, K1, K2, V1, V2, 0.5),
                               four_cache_attention(q.unsqueeze(-2), K1, K2, V1, V2, 0.5).squeeze(-2),
                               rtol=0, atol=atol)


# ----------------------------------------------------------------------------------------------------------
# Errors


def error_paths():
    return [reference_tensor_decode] + ([tensor_decode_triton] if HAS_TRITON else [])


def test_empty_cache_is_an_error():
    q, K1, K2, V1, V2 = make(0)
    for fn in error_paths():
        with pytest.raises(ValueError, match="empty"):
            fn(q, K1, K2, V1, V2)


def test_mismatched_shapes_are_errors():
    q, K1, K2, V1, V2 = make(5, B=2, H=2)
    bad = [
        ((q, K1, K2[:, :, :4], V1, V2), "same shape"),                     # K2 shorter than K1
        ((q, K1, K2, V1, V2[..., :8]), "same shape"),                      # V2 with another head dim
        ((q[..., :8], K1, K2, V1, V2), "disagree"),                        # q's d is not the factors'
        ((q[:1], K1, K2, V1, V2), "disagree"),                             # q's batch is not the factors'
        ((q.unsqueeze(-2), K1, K2, V1, V2), r"\(B, H, d\)"),               # (B, H, 1, d): not a decode query
        ((q, K1[0], K2, V1, V2), r"\(B, H, n, d\)"),
        ((q, K1, K2.double(), V1, V2), "dtype"),
    ]
    for fn in error_paths():
        for args, msg in bad:
            with pytest.raises(ValueError, match=msg):
                fn(*args)


@needs_triton
@kernel_device
def test_bad_kernel_options_are_errors(dev):
    q, K1, K2, V1, V2 = make(5, dev=dev)
    for opts, msg in [(dict(block_a=8), "block_a"), (dict(block_b=24), "block_b"), (dict(splits=0), "splits")]:
        with pytest.raises(ValueError, match=msg):
            tensor_decode_triton(q, K1, K2, V1, V2, **{**BLOCKS, **opts})


# ----------------------------------------------------------------------------------------------------------
# The analytic working memory


def test_peak_memory_bytes():
    n, d = 10, 4
    assert peak_memory_bytes(n, d, "naive") == (2 * 100 * 4 + 2 * 100) * 4
    assert peak_memory_bytes(n, d, "reference") == 2 * 100 * 4                 # scores and their softmax
    assert peak_memory_bytes(n, 64, "reference") == (100 + 2 * 10 * 64) * 4    # P, P @ V2, V1 * (P @ V2)
    assert peak_memory_bytes(n, d, "reference", itemsize=2) == 2 * 100 * 2
    assert peak_memory_bytes(n, d, "kernel") == (16 + 2) * 4                   # d padded to 16
    assert peak_memory_bytes(n, 24, "kernel", splits=3) == 3 * (32 + 2) * 4
    assert peak_memory_bytes(4096, 128, "kernel") == peak_memory_bytes(16, 128, "kernel")   # no n in it
    assert peak_memory_bytes(4096, 128, "naive") > peak_memory_bytes(4096, 128, "reference") \
        > peak_memory_bytes(4096, 128, "kernel")
    with pytest.raises(ValueError, match="unknown path"):
        peak_memory_bytes(n, d, "two")
