"""Decode-attention kernels (kernels/decode_attention.py) against their PyTorch references.

Without a GPU the kernels run in Triton's interpreter (``tests/conftest.py`` sets TRITON_INTERPRET=1): exact
and slow (milliseconds per program and block), so the shapes are tiny but ragged: lengths that are not a
multiple of the block, GQA groups > 1, a single cached token, several ranges per head, padding (-1).
"""

import pytest
import torch

import kernels
import kernels.decode_attention as dec
from kernels.decode_attention import (
    decode_attention_triton,
    masked_decode_attention_triton,
    reference_decode_attention,
    reference_masked_decode_attention,
    reference_selected_decode_attention,
    selected_decode_attention_triton,
)

pytestmark = pytest.mark.skipif(not kernels.HAS_TRITON or not (kernels.interpreting() or torch.cuda.is_available()),
                                reason="no way to run a Triton kernel: triton is not installed, or there is no "
                                       "CUDA device and TRITON_INTERPRET is not 1")
DEVICES = (["cpu"] if kernels.interpreting() else []) + (["cuda"] if torch.cuda.is_available() else [])
# low precision: inputs rounded to 8 (bf16) or 11 (fp16) mantissa bits, sums in fp32 in both paths
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def cache(B, H, H_kv, S, d, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g).to(device, dtype) for shape in
               ((B, H, d), (B, H_kv, S, d), (B, H_kv, S, d)))
    return q, k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,H,H_kv,S,block_n,splits", [
    (2, 4, 2, 37, 16, None),      # ragged, GQA group 2
    (1, 8, 2, 50, 16, 3),         # group 4, three ranges (the last one short)
    (1, 2, 2, 1, 16, None),       # a single cached token
    (1, 4, 1, 20, 16, 4),         # multi-query (one KV head), more ranges requested than blocks
])
def test_contiguous_matches_reference(device, B, H, H_kv, S, block_n, splits):
    q, k, v = cache(B, H, H_kv, S, 16, device=device)
    out = decode_attention_triton(q, k, v, block_n=block_n, splits=splits)
    torch.testing.assert_close(out, reference_decode_attention(q, k, v), rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_cache_views(device):
    """The cache's k, v are views of larger buffers (nanollm.storage.LayerKV): strides, not copies."""
    q, k, v = cache(2, 4, 2, 40, 16, device=device)
    k, v = k[:, :, :29], v[:, :, :29]
    torch.testing.assert_close(decode_attention_triton(q, k, v, block_n=16), reference_decode_attention(q, k, v),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [None, 3])
def test_selected_matches_reference_and_a_compacted_cache(device, splits):
    q, k, v = cache(2, 4, 2, 45, 16, device=device)
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.stack([torch.randperm(45, generator=g)[:19] for _ in range(2)]) for _ in range(2)])
    idx[0, 1, 10:] = -1                           # a shorter head, padded (AdaKV's ragged budgets)
    idx = idx.to(device)
    out = selected_decode_attention_triton(q, k, v, idx, block_n=16, splits=splits)
    torch.testing.assert_close(out, reference_selected_decode_attention(q, k, v, idx), rtol=0, atol=1e-5)
    # without padding, the same as the contiguous kernel over a compacted copy of the selected rows
    full = idx.clone()
    full[0, 1, 10:] = full[0, 0, 10:]
    rows = full[..., None].expand(-1, -1, -1, 16)
    torch.testing.assert_close(selected_decode_attention_triton(q, k, v, full, block_n=16),
                               decode_attention_triton(q, k.gather(2, rows), v.gather(2, rows), block_n=16),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_range_of_padding_only(device):
    """With several ranges, one may hold only -1 entries: its partial must not poison the merge."""
    q, k, v = cache(1, 2, 1, 40, 16, device=device)
    idx = torch.full((1, 1, 48), -1, device=device)
    idx[0, 0, :8] = torch.arange(8)
    out = selected_decode_attention_triton(q, k, v, idx, block_n=16, splits=3)
    torch.testing.assert_close(out, reference_decode_attention(q, k[:, :, :8], v[:, :, :8]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [None, 3])
def test_masked_matches_reference_and_the_filled_slots(device, splits):
    """A fixed-capacity buffer (fastpath/graph.py): slots at position -1 are empty (the room not yet written,
    a slot an eviction emptied, a whole range of them), and the rest equals the contiguous kernel over the
    filled slots alone."""
    q, k, v = cache(2, 4, 2, 45, 16, device=device)
    pos = torch.arange(45).repeat(2, 2, 1)
    pos[:, :, 30:] = -1                           # room not yet written
    pos[0, 1, 3] = pos[1, 0, 17] = -1             # emptied by an eviction
    pos[1, 1, :16] = -1                           # a range of empty slots only (block_n 16)
    pos = pos.to(device)
    out = masked_decode_attention_triton(q, k, v, pos, block_n=16, splits=splits)
    torch.testing.assert_close(out, reference_masked_decode_attention(q, k, v, pos), rtol=0, atol=1e-5)
    strided = torch.full((2, 2, 45, 2), -7, device=device)[..., 0]       # the same positions, not contiguous
    strided.copy_(pos)
    torch.testing.assert_close(masked_decode_attention_triton(q, k, v, strided, block_n=16, splits=splits), out,
                               rtol=0, atol=0)
    for b in range(2):
        for h in range(2):
            kept = (pos[b, h] >= 0).nonzero()[:, 0]
            one = masked_decode_attention_triton(q[b:b + 1, 2 * h:2 * h + 2], k[b:b + 1, h:h + 1],
                                                 v[b:b + 1, h:h + 1], pos[b:b + 1, h:h + 1], block_n=16)
            ref = decode_attention_triton(q[b:b + 1, 2 * h:2 * h + 2], k[b:b + 1, h:h + 1, kept],
                                          v[b:b + 1, h:h + 1, kept], block_n=16)
            torch.testing.assert_close(one, ref, rtol=0, atol=1e-5)
            torch.testing.assert_close(out[b, 2 * h:2 * h + 2], ref[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_loose(device, dtype):
    q, k, v = cache(1, 4, 2, 33, 16, dtype=dtype, device=device)
    out = decode_attention_triton(q, k, v, block_n=16)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference_decode_attention(q, k, v).float(), rtol=0, atol=TOL[dtype])


def test_clear_errors():
    q, k, v = cache(1, 4, 2, 10, 16)
    with pytest.raises(ValueError, match="empty selection"):
        selected_decode_attention_triton(q, k, v, torch.zeros(1, 2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="selects no token"):
        selected_decode_attention_triton(q, k, v, torch.tensor([[[0, 1], [-1, -1]]]))
    with pytest.raises(ValueError, match="cache is empty"):
        decode_attention_triton(q, k[:, :, :0], v[:, :, :0])
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        decode_attention_triton(q[:, :3], k, v)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention_triton(*cache(1, 2, 2, 4, 12))
    with pytest.raises(ValueError, match=">= the cache length"):
        selected_decode_attention_triton(q, k, v, torch.tensor([[[0, 10], [1, 2]]]))
    with pytest.raises(ValueError, match=">= the cache length"):
        reference_selected_decode_attention(q, k, v, torch.tensor([[[0, 10], [1, 2]]]))
    with pytest.raises(ValueError, match="pos must have shape"):
        masked_decode_attention_triton(q, k, v, torch.zeros(1, 2, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="pos must have shape"):
        reference_masked_decode_attention(q, k, v, torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="not both"):
        dec.decode_partials_triton(q, k, v, idx=torch.zeros(1, 2, 3, dtype=torch.long),
                                   pos=torch.zeros(1, 2, 10, dtype=torch.long))


@pytest.mark.parametrize("device", DEVICES)
def test_merge_kernel_equals_merge_splits(device):
    """The one-launch merge equals the PyTorch merge, with more ranges than one block of the merge (32) and
    empty ranges (m = -inf, l = 0, acc = 0: a range of padding only)."""
    g = torch.Generator().manual_seed(2)
    R, splits, G, d = 3, 45, 4, 16
    m, l, acc = torch.randn(R, splits, G, generator=g), torch.rand(R, splits, G, generator=g) + 0.5, \
        torch.randn(R, splits, G, d, generator=g)
    m[:, 7], l[:, 7], acc[:, 7] = float("-inf"), 0.0, 0.0
    m, l, acc = m.to(device), l.to(device), acc.to(device)
    out = torch.empty(R, G, d, device=device)
    dec._merge_splits_kernel[(R, G)](m, l, acc, out, splits, G=G, D=d, BLOCK_S=32)
    torch.testing.assert_close(out, dec.merge_splits(m, l, acc), rtol=0, atol=1e-6)
