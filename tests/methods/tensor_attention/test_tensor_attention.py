"""Tensor attention (methods/tensor_attention/attention.py): three decode paths over two cache layouts, one module."""

import math

import pytest
import torch

from methods.tensor_attention import (
    LAYOUTS,
    TENSOR_ATTENTION,
    FourCache,
    TwoCache,
    causal_tensor_attention,
    four_cache_attention,
    kron_rows,
    naive_four_cache_attention,
    tensor_cache,
    two_cache_attention,
)
from nanollm.attention import attend
from nanollm.cache import KVCache
from nanollm.config import preset
from nanollm.generation import decode_step, extend, generate, prefill
from nanollm.model import Transformer


def factors(n, d=6, lead=(2, 3), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*lead, n, d, generator=g, dtype=dtype) for _ in range(4)]


def explicit(q, K1, K2, V1, V2, scale):
    """Definition 3.7 of Chen et al. written as loops over pairs: the reference of every path."""
    n = K1.shape[-2]
    s = torch.stack([torch.stack([(q * K1[..., a, :] * K2[..., b, :]).sum(-1) * scale for b in range(n)], -1)
                     for a in range(n)], -2)                                   # (..., n, n)
    p = torch.softmax(s.flatten(-2), -1).view(s.shape)
    return sum(p[..., a, b, None] * V1[..., a, :] * V2[..., b, :] for a in range(n) for b in range(n))


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_three_paths_agree(dtype, atol):
    K1, K2, V1, V2 = factors(9, dtype=dtype)
    q = torch.randn(2, 3, 1, 6, dtype=dtype, generator=torch.Generator().manual_seed(1))
    scale = 1 / math.sqrt(6)
    naive = naive_four_cache_attention(q, K1, K2, V1, V2, scale)
    factored = four_cache_attention(q, K1, K2, V1, V2, scale)
    two = two_cache_attention(q, kron_rows(K1, K2), kron_rows(V1, V2), scale)
    ref = explicit(q[..., 0, :], K1, K2, V1, V2, scale)[..., None, :]
    for out in (naive, factored, two):
        torch.testing.assert_close(out, ref, rtol=0, atol=atol)


def test_kron_rows_is_definition_3_1():
    A, B = torch.randn(3, 4), torch.randn(5, 4)
    out = kron_rows(A, B)
    assert out.shape == (15, 4)
    for a in range(3):
        for b in range(5):
            assert torch.equal(out[a * 5 + b], A[a] * B[b])


def test_all_ones_k2_v2_is_standard_attention():
    K1, _, V1, _ = factors(11)
    q = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    ones = torch.ones_like(K1)
    scale = 1 / math.sqrt(6)
    pos = torch.arange(11).expand(2, 3, 11)                        # (B, H_kv, T) as the storage keeps it
    out = four_cache_attention(q, K1, ones, V1, ones, scale)
    ref, _, _ = attend(q, K1, V1, torch.full((4,), 10), pos)          # the nanollm attention, 1/sqrt(d) too
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_pair_order_and_token_order_do_not_matter():
    K1, K2, V1, V2 = factors(7)
    q = torch.randn(2, 3, 1, 6, dtype=torch.float64)
    Kt, Vt = kron_rows(K1, K2), kron_rows(V1, V2)
    perm = torch.randperm(49, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(two_cache_attention(q, Kt[..., perm, :], Vt[..., perm, :], 0.5),
                               two_cache_attention(q, Kt, Vt, 0.5), rtol=0, atol=1e-12)
    tok = torch.randperm(7, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(four_cache_attention(q, *(f[..., tok, :] for f in (K1, K2, V1, V2)), 0.5),
                               four_cache_attention(q, K1, K2, V1, V2, 0.5), rtol=0, atol=1e-12)


def test_token_eviction_is_a_pair_mask_over_kept_rows_and_columns():
    """Dropping a token from the four matrices removes its row and its column of pairs: the same output as
    the two-matrix cache with only the pairs of kept tokens allowed."""
    K1, K2, V1, V2 = factors(9)
    q = torch.randn(2, 3, 1, 6, dtype=torch.float64)
    kept = torch.tensor([0, 2, 3, 7])
    dropped = four_cache_attention(q, *(f[..., kept, :] for f in (K1, K2, V1, V2)), 0.5)
    keep = torch.zeros(9, dtype=torch.bool)
    keep[kept] = True
    allowed = (keep[:, None] & keep[None, :]).flatten()
    torch.testing.assert_close(dropped, two_cache_attention(q, kron_rows(K1, K2), kron_rows(V1, V2), 0.5, allowed),
                               rtol=0, atol=1e-12)


def test_causal_path_matches_per_query_reference_and_chunks():
    g = torch.Generator().manual_seed(5)
    q, k1, k2, v1, v2 = (torch.randn(2, 2, 10, 4, generator=g, dtype=torch.float64) for _ in range(5))
    out = causal_tensor_attention(q, k1, k2, v1, v2)
    for t in range(10):
        ref = four_cache_attention(q[:, :, t:t + 1], k1[:, :, :t + 1], k2[:, :, :t + 1], v1[:, :, :t + 1],
                                   v2[:, :, :t + 1], 0.5)
        torch.testing.assert_close(out[:, :, t:t + 1], ref, rtol=0, atol=1e-12)
    small = causal_tensor_attention(q, k1, k2, v1, v2, max_elements=64)          # 2 queries, then 1 per chunk
    torch.testing.assert_close(small, out, rtol=0, atol=1e-12)


def test_causal_path_chunks_that_start_mid_sequence():
    g = torch.Generator().manual_seed(6)
    q, k1, k2, v1, v2 = (torch.randn(1, 2, 23, 4, generator=g, dtype=torch.float64) for _ in range(5))
    whole = causal_tensor_attention(q, k1, k2, v1, v2, max_elements=1 << 30)     # one chunk
    chunked = causal_tensor_attention(q, k1, k2, v1, v2, max_elements=2000)     # several queries per chunk
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# The module in the nanollm decoder


def tensor_model(seed=0, n_layer=2):
    torch.manual_seed(seed)
    model = Transformer(preset("TINY_GPT2", attention=TENSOR_ATTENTION, n_layer=n_layer, max_seq_len=64)).eval()
    with torch.no_grad():                    # larger weights than the init, so pairs really matter
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cached_decoding_equals_uncached_forward(layout):
    model = tensor_model()
    x = torch.randint(0, 512, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(x)
        cache = tensor_cache(model.config, layout)
        steps = [prefill(model, x[:, :12], cache), extend(model, x[:, 12:16], cache)]
        steps += [decode_step(model, x[:, t:t + 1], cache)[:, None] for t in range(16, 21)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)
    assert cache.seen == 21 and all(len(layer) == 21 for layer in cache.layers)


def test_cached_decoding_fp64_tight():
    model = tensor_model().double()
    x = torch.randint(0, 512, (1, 15), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x)
        for layout in LAYOUTS:
            cache = tensor_cache(model.config, layout)
            steps = [prefill(model, x[:, :5], cache), extend(model, x[:, 5:9], cache)]
            steps += [decode_step(model, x[:, t:t + 1], cache)[:, None] for t in range(9, 15)]
            torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)


def test_greedy_generation_identical_for_every_layout():
    model = tensor_model(seed=2)
    x = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(2))
    outs = [generate(model, x, 10, cache=tensor_cache(model.config, layout)) for layout in LAYOUTS]
    outs.append(generate(model, x, 10))                                 # the module's default storage
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_later_tokens_do_not_change_earlier_outputs():
    model = tensor_model()
    x = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(3))
    y = x.clone()
    y[0, 9:] = (y[0, 9:] + 7) % 512
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_zero_k2_v2_projections_make_the_standard_decoder():
    """k2 = 1 + k2_proj(x) and v2 = 1 + v2_proj(x): zero projections leave standard attention over (q, k1, v1)."""
    tensor = tensor_model(n_layer=2)
    standard = Transformer(preset("TINY_GPT2", n_layer=2, max_seq_len=64)).eval()
    state = {}
    for k, v in tensor.state_dict().items():
        if ".k2_proj." in k or ".v2_proj." in k:
            continue
        state[k.replace(".k1_proj.", ".k_proj.").replace(".v1_proj.", ".v_proj.")] = v
    standard.load_state_dict(state)
    with torch.no_grad():
        for block in tensor.blocks:
            for proj in (block.attn.k2_proj, block.attn.v2_proj):
                proj.weight.zero_()
                proj.bias.zero_()
        x = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(4))
        torch.testing.assert_close(tensor(x), standard(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("i", [1, 5, 17, 40])
def test_stored_bytes_match_the_formulas(i):
    model = tensor_model(n_layer=1)
    cfg = model.config
    H, d, B = cfg.n_head, cfg.head_dim, 2
    x = torch.randint(0, 512, (B, i), generator=torch.Generator().manual_seed(i))
    caches = {layout: tensor_cache(cfg, layout) for layout in LAYOUTS}
    with torch.no_grad():
        for cache in caches.values():
            prefill(model, x[:, :1], cache)
            if i > 1:
                extend(model, x[:, 1:], cache)
    per_number = 4 * B * H                                         # fp32 bytes, every row and head
    assert caches["four"].nbytes() == caches["four-naive"].nbytes() == 4 * i * d * per_number
    two = caches["two"].layers[0]
    assert isinstance(two, TwoCache) and two.pairs() == i * i
    assert two.pair_nbytes() == 2 * i * i * d * per_number
    assert two.factor_nbytes() == 4 * i * d * per_number
    assert caches["two"].nbytes() == (2 * i * i + 4 * i) * d * per_number
    pa, pb = two.pair_pos()                                         # every pair (a, b) exactly once
    assert sorted(zip(pa.tolist(), pb.tolist())) == [(a, b) for a in range(i) for b in range(i)]


def test_default_storage_is_the_four_matrix_cache():
    cfg = tensor_model().config
    assert all(type(layer) is FourCache for layer in KVCache(cfg).layers)


def test_clear_errors():
    with pytest.raises(ValueError, match="learned absolute positions"):
        Transformer(preset("TINY", attention=TENSOR_ATTENTION))
    with pytest.raises(ValueError, match="n_kv_head"):
        Transformer(preset("TINY_GPT2", attention=TENSOR_ATTENTION, n_kv_head=2))
    cfg = tensor_model().config
    with pytest.raises(ValueError, match="unknown tensor-attention cache layout 'three'"):
        tensor_cache(cfg, "three")
    with pytest.raises(ValueError, match="tensor-attention models"):
        tensor_cache(preset("TINY_GPT2"), "two")
    from methods import make_policy
    from methods.tensor_attention import TensorAttention
    from nanollm.policy import Needs
    with pytest.raises(ValueError, match="does not report attention statistics"):
        TensorAttention.attend_entries(torch.zeros(1, 4, 1, 16), FourCache(), torch.tensor([0]), Needs(rows=1))
    model = tensor_model()
    with pytest.raises(ValueError, match="no eviction policy"):
        prefill(model, torch.zeros(1, 4, dtype=torch.long), KVCache(cfg, make_policy("full", 8)))


# ---------------------------------------------------------------------------------------------------------
# The measurement (no timing asserted: only the byte counts and the command line)


def test_bench_bytes_and_slopes():
    from experiments.tensor_attention_bench import measure, table
    r = measure([16, 32, 64], steps=2)
    d, H = 16, 4
    for i, n in enumerate(r["lengths"]):
        assert r["four"]["bytes"][i] == r["four-naive"]["bytes"][i] == 4 * n * d * H * 4
        assert r["two"]["bytes"][i] == (2 * n * n + 4 * n) * d * H * 4
    assert r["four"]["bytes_slope"] == pytest.approx(1.0)
    assert 1.8 < r["two"]["bytes_slope"] < 2.0
    assert "slopes" in table(r)


def test_bench_command_line_errors(capsys):
    from experiments.tensor_attention_bench import main
    for argv, message in ((["--lengths", "64", "32"], "increasing"), (["--lengths", "4"], "exceed --steps"),
                          (["--lengths", "0"], "positive integer")):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err
