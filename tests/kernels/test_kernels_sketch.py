"""The count-sketch kernels (kernels/count_sketch.py) against their references and KVReviver's own sketch
(arXiv 2512.17917, Algorithms 1, 2 and 4): insert, query (median of rows), fused rebuild-then-attend.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1), which costs a few ms per
program and block: the shapes are tiny (d = 16, a handful of tokens, blocks of 4 or 16 tokens so that several
blocks and ragged tails are exercised). With CUDA the same tests also run on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from fastpath.attention import attend_step
from kernels import HAS_TRITON, interpreting
from kernels import count_sketch as cs
from methods.kvreviver import KVReviverPolicy
from methods.kvreviver_sketch import VagueSketch
from nanollm.storage import LayerKV

DEVICES = ([pytest.param("cpu", id="interpreter")] if interpreting() else []) + \
          ([pytest.param("cuda", id="cuda")] if torch.cuda.is_available() else [])
if not HAS_TRITON or not DEVICES:
    pytest.skip("no way to run a Triton kernel: Triton is not installed, or there is no CUDA device and "
                "TRITON_INTERPRET is not 1 (the references are checked against VagueSketch in "
                "tests/methods/test_kvreviver.py)", allow_module_level=True)

H_KV, D, WIDTH = 2, 16, 5
ATOL = 1e-5                  # fp32: the kernels and references differ only by the order of sums
FP16_ATOL = 2e-3             # fp16 in and out: the output is rounded to fp16 (relative step 2^-11 ~ 5e-4)


def randn(*shape, seed: int, device="cpu", dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def filled_sketch(device, n: int = 12, rows: int = 3, seed: int = 1) -> tuple[VagueSketch, torch.Tensor]:
    """A VagueSketch (rows x WIDTH cells, H_KV heads, head dim D) holding tokens at positions 0..n-1, which
    collide (n > WIDTH)."""
    s = VagueSketch(rows=rows, width=WIDTH, n_kv_head=H_KV, head_dim=D, seed=seed, device=device)
    pos = torch.arange(n, device=device)
    s.insert(pos, randn(n, H_KV, D, seed=seed, device=device), randn(n, H_KV, D, seed=seed + 1, device=device))
    return s, pos


def hashes(s: VagueSketch, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return s.buckets(pos).to(torch.int32), s.signs(pos)


# ---------------------------------------------------------------------------------------------------------
# Insert

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_n", [None, 4])
def test_insert_equals_reference_and_vague_sketch(device, block_n):
    """12 tokens into 5 cells per row (collisions within a block and across programs), on top of cells that
    already hold tokens: the atomic adds equal index_add_ and VagueSketch.insert."""
    s, _ = filled_sketch(device, n=6, seed=3)                          # cells not empty
    pos = torch.arange(100, 112, device=device)
    cells, signs = hashes(s, pos)
    assert any(row.unique().numel() < row.numel() for row in cells)   # collisions happen
    k, v = randn(12, H_KV, D, seed=4, device=device), randn(12, H_KV, D, seed=5, device=device)
    key, value = s.key.clone(), s.value.clone()
    cs.sketch_insert_triton(key, value, cells, signs, k, v, block_n=block_n)
    ref_key, ref_value = s.key.clone(), s.value.clone()
    cs.reference_sketch_insert(ref_key, ref_value, cells, signs, k, v)
    s.insert(pos, k, v)
    for got, ref, own in ((key, ref_key, s.key), (value, ref_value, s.value)):
        torch.testing.assert_close(got, ref, rtol=0, atol=ATOL)
        # on the CPU VagueSketch.insert (the method's own PyTorch) adds in the reference's order; on CUDA it
        # takes the kernel, whose atomic adds land in any order (equal up to rounding, like the kernel above)
        torch.testing.assert_close(ref, own, rtol=0, atol=0 if device == "cpu" else ATOL)


@pytest.mark.parametrize("device", DEVICES)
def test_insert_fp16_tokens_and_delete(device):
    """fp16 tokens are added in fp32 (as VagueSketch.insert's k.float()); inserting -k, -v deletes them."""
    s, _ = filled_sketch(device, seed=6)
    before = (s.key.clone(), s.value.clone())
    pos = torch.arange(40, 47, device=device)
    cells, signs = hashes(s, pos)
    k = randn(7, H_KV, D, seed=7, device=device, dtype=torch.float16)
    v = randn(7, H_KV, D, seed=8, device=device, dtype=torch.float16)
    key, value = s.key.clone(), s.value.clone()
    cs.sketch_insert_triton(key, value, cells, signs, k, v)
    s.insert(pos, k, v)
    torch.testing.assert_close(key, s.key, rtol=0, atol=ATOL)
    torch.testing.assert_close(value, s.value, rtol=0, atol=ATOL)
    cs.sketch_insert_triton(key, value, cells, signs, -k, -v)
    torch.testing.assert_close(key, before[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(value, before[1], rtol=0, atol=ATOL)


def test_insert_rejects_a_non_fp32_or_misshaped_sketch():
    key = torch.zeros(3, WIDTH, H_KV, D, dtype=torch.float16)
    cells, signs = torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
    k = torch.zeros(2, H_KV, D)
    with pytest.raises(ValueError, match="fp32"):
        cs.sketch_insert_triton(key, key.clone(), cells, signs, k, k)
    with pytest.raises(ValueError, match=r"\(n=2, H_kv=2, d=16\)"):
        cs.sketch_insert_triton(key.float(), key.float(), cells, signs, k[:1], k[:1])
    with pytest.raises(ValueError, match="cells and signs"):
        cs.reference_sketch_insert(key.float(), key.float(), cells[:2], signs[:2], k, k)


@pytest.mark.parametrize("device", DEVICES)
def test_one_token_of_a_wider_head_in_and_out(device):
    """One token at a time, as KVReviver's swaps query and insert (blocks of one token), with SmolLM2's
    3 KV heads of 64 dimensions (192 features a token, not a power of two: a masked block of 256)."""
    s = VagueSketch(rows=3, width=WIDTH, n_kv_head=3, head_dim=64, seed=2, device=device)
    s.insert(torch.arange(9, device=device), randn(9, 3, 64, seed=6, device=device),
             randn(9, 3, 64, seed=7, device=device))
    pos = torch.tensor([40], device=device)
    cells, signs = hashes(s, pos)
    k, v = randn(1, 3, 64, seed=8, device=device), randn(1, 3, 64, seed=9, device=device)
    key, value, ref_key, ref_value = s.key.clone(), s.value.clone(), s.key.clone(), s.value.clone()
    cs.sketch_insert_triton(key, value, cells, signs, k, v)
    cs.reference_sketch_insert(ref_key, ref_value, cells, signs, k, v)
    torch.testing.assert_close(key, ref_key, rtol=0, atol=ATOL)
    torch.testing.assert_close(value, ref_value, rtol=0, atol=ATOL)
    got, want = cs.sketch_query_triton(key, value, cells, signs), cs.reference_sketch_query(key, value, cells, signs)
    for g, r in zip(got, want):
        assert g.shape == (1, 3, 64)
        torch.testing.assert_close(g, r, rtol=0, atol=ATOL)


# ---------------------------------------------------------------------------------------------------------
# Query

@pytest.mark.parametrize("device", DEVICES)
def test_query_equals_reference_and_vague_sketch(device):
    s, pos = filled_sketch(device, n=13)
    pos = torch.cat([pos, torch.tensor([50, 51], device=device)])      # and two tokens never inserted
    cells, signs = hashes(s, pos)
    got = cs.sketch_query_triton(s.key, s.value, cells, signs, block_n=4)   # 15 tokens: a ragged last block
    ref = cs.reference_sketch_query(s.key, s.value, cells, signs)
    own = s.query(pos)
    for g, r, o in zip(got, ref, own):
        assert g.shape == (15, H_KV, D) and g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=0, atol=ATOL)
        torch.testing.assert_close(r, o, rtol=0, atol=0)               # a median selects: VagueSketch.query


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_query_median_any_row_count_with_ties(device, rows):
    """Cells with many ties (small integers): r = 1, 3 by formula, other r by rank (the lower median for
    even r, as torch.median)."""
    key = torch.randint(-2, 3, (rows, WIDTH, H_KV, D), generator=torch.Generator().manual_seed(rows)).float()
    value = randn(rows, WIDTH, H_KV, D, seed=rows).round()
    cells = torch.randint(0, WIDTH, (rows, 9), generator=torch.Generator().manual_seed(9), dtype=torch.int32)
    signs = 1.0 - 2.0 * torch.randint(0, 2, (rows, 9), generator=torch.Generator().manual_seed(10)).float()
    key, value, cells, signs = (t.to(device) for t in (key, value, cells, signs))
    got = cs.sketch_query_triton(key, value, cells, signs, block_n=4)
    ref = cs.reference_sketch_query(key, value, cells, signs)
    gathered = key[torch.arange(rows, device=device)[:, None], cells.long()]        # (r, n, H_kv, d)
    assert torch.equal(ref[0], gathered.median(dim=0).values)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)


def test_kernels_reject_too_many_rows():
    r = cs.MAX_ROWS + 1
    key = torch.zeros(r, 2, 1, 4)
    cells, signs = torch.zeros(r, 1, dtype=torch.int32), torch.ones(r, 1)
    with pytest.raises(ValueError, match="sketch rows"):
        cs.sketch_query_triton(key, key, cells, signs)
    with pytest.raises(ValueError, match="sketch rows"):
        cs.sketch_decode_attention_triton(torch.zeros(1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), key, key,
                                          cells, signs, 0.5)
    assert cs.reference_sketch_query(key, key, cells, signs)[0].shape == (1, 1, 4)   # the reference: any r


# ---------------------------------------------------------------------------------------------------------
# Fused rebuild-then-attend

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("H, n_raw, n_v, num_splits", [
    (4, 23, 37, 1),        # GQA G = 2; ragged raw and sketch blocks (block 16)
    (4, 23, 37, 3),        # the same split over 3 programs per KV head, merged
    (6, 17, 9, 8),         # G = 3 (padded to 4); more splits asked than blocks
    (2, 1, 0, None),       # MHA; a single raw token, no sketch token
    (4, 0, 21, 2),         # no raw token: all from the sketch
])
def test_fused_decode_equals_rebuild_then_attend(device, H, n_raw, n_v, num_splits):
    s, _ = filled_sketch(device, n=14)
    pos = torch.arange(n_v, device=device) * 3 + 1                     # some never inserted: estimates anyway
    cells, signs = hashes(s, pos)
    q = randn(H, D, seed=20, device=device)
    k_raw, v_raw = randn(H_KV, n_raw, D, seed=21, device=device), randn(H_KV, n_raw, D, seed=22, device=device)
    scale = 1 / math.sqrt(D)
    got = cs.sketch_decode_attention_triton(q, k_raw, v_raw, s.key, s.value, cells, signs, scale, block_n=16,
                                            num_splits=num_splits)
    ref = cs.reference_sketch_decode_attention(q, k_raw, v_raw, s.key, s.value, cells, signs, scale)
    assert got.shape == (H, D) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=ATOL)
    # the reference is plain attention over the rebuilt tokens
    k_hat, v_hat = s.query(pos)
    k = torch.cat([k_raw, k_hat.transpose(0, 1)], dim=1)[None]
    v = torch.cat([v_raw, v_hat.transpose(0, 1)], dim=1)[None]
    plain = attend_step(q.view(1, H, 1, D), k, v)[0].view(H, D)
    torch.testing.assert_close(ref, plain, rtol=0, atol=ATOL)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_decode_equals_kvreviver_attend_kv(device):
    """Positions 0..15 of one sequence: 7 raw (the newest included), 9 in the sketch. KVReviverPolicy.attend_kv
    rebuilds the cache in position order and attend_step attends over it; the fused kernel, raw tokens
    first then sketch tokens, gives the same output (softmax attention ignores the order)."""
    N, H = 16, 4
    raw_pos = torch.tensor([0, 3, 4, 9, 12, 14, 15], device=device)
    vague = torch.tensor([p for p in range(N) if p not in raw_pos.tolist()], device=device)
    sketch = VagueSketch(rows=3, width=WIDTH, n_kv_head=H_KV, head_dim=D, seed=2, device=device)
    sketch.insert(vague, randn(len(vague), H_KV, D, seed=30, device=device),
                  randn(len(vague), H_KV, D, seed=31, device=device))
    k_raw, v_raw = randn(H_KV, 7, D, seed=32, device=device), randn(H_KV, 7, D, seed=33, device=device)
    policy = KVReviverPolicy(budget=64, sketch_width=WIDTH)
    policy._sketch[0] = [sketch]
    policy._compressed_at[0] = (N, 7)       # what a compression leaves: N positions seen, 7 of them raw
    store = LayerKV(k_raw[None], v_raw[None], raw_pos.view(1, 1, -1).expand(1, H_KV, -1))
    rebuilt = policy.attend_kv(0, store)
    q = randn(H, D, seed=34, device=device)
    expected = attend_step(q.view(1, H, 1, D), rebuilt.k, rebuilt.v)[0].view(H, D)
    cells, signs = hashes(sketch, vague)
    got = cs.sketch_decode_attention_triton(q, k_raw, v_raw, sketch.key, sketch.value, cells, signs,
                                            1 / math.sqrt(D), block_n=16)
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_decode_strided_raw_tokens(device):
    """k_raw, v_raw may be views (here of a (n_raw, H_kv, d) buffer): read through their strides."""
    s, pos = filled_sketch(device, n=5)
    cells, signs = hashes(s, pos)
    q = randn(2, D, seed=40, device=device)
    k_raw = randn(6, H_KV, D, seed=41, device=device).transpose(0, 1)
    v_raw = randn(6, H_KV, D, seed=42, device=device).transpose(0, 1)
    assert not k_raw.is_contiguous()
    got = cs.sketch_decode_attention_triton(q, k_raw, v_raw, s.key, s.value, cells, signs, 0.3, block_n=16)
    ref = cs.reference_sketch_decode_attention(q, k_raw, v_raw, s.key, s.value, cells, signs, 0.3)
    torch.testing.assert_close(got, ref, rtol=0, atol=ATOL)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_decode_fp16(device):
    """fp16 q and raw tokens (fp32 cells): fp32 inside, fp16 out. Tolerance FP16_ATOL: the output's own
    rounding (outputs are O(1)); attend_kv would also round the rebuilt tokens to fp16, the kernel does not."""
    s, pos = filled_sketch(device, n=7)
    cells, signs = hashes(s, pos)
    q = randn(4, D, seed=50, device=device, dtype=torch.float16)
    k_raw = randn(H_KV, 5, D, seed=51, device=device, dtype=torch.float16)
    v_raw = randn(H_KV, 5, D, seed=52, device=device, dtype=torch.float16)
    got = cs.sketch_decode_attention_triton(q, k_raw, v_raw, s.key, s.value, cells, signs, 0.25, block_n=16)
    ref = cs.reference_sketch_decode_attention(q.float(), k_raw, v_raw, s.key, s.value, cells, signs, 0.25)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), ref, rtol=0, atol=FP16_ATOL)


@pytest.mark.parametrize("fn", [cs.sketch_decode_attention_triton, cs.reference_sketch_decode_attention])
def test_fused_decode_rejects_bad_inputs(fn):
    key = torch.zeros(3, WIDTH, H_KV, D)
    none = torch.zeros(3, 0, dtype=torch.int32), torch.zeros(3, 0)
    empty = torch.zeros(H_KV, 0, D)
    with pytest.raises(ValueError, match="nothing to attend to"):
        fn(torch.zeros(4, D), empty, empty, key, key, *none, 0.25)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        fn(torch.zeros(3, D), torch.zeros(H_KV, 1, D), torch.zeros(H_KV, 1, D), key, key, *none, 0.25)
