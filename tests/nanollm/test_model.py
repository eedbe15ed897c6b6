"""
Model correctness: the cached decoder must compute exactly what the plain forward computes.

The reference everywhere is the uncached forward ``model(ids)`` (causal ``scaled_dot_product_attention``),
in fp32 on a tiny random-init model (see conftest.py), with ``atol = 1e-5``: caching reorders no sums
that matter in fp32, so anything larger is a bug, not noise (in bf16 it would be noise, see
transformers #25420). Sections:

1. cached decoding == full forward (step by step, chunked prefill, both flavours, GQA, batch 2)
2. the policy path with ``FullCache`` == the plain cache path, bit for bit
3. eviction (``LayerKV.keep``) == masking the dropped entries; positions stay true
4. ``select_topk`` on hand-computed examples
5. bad input: clear errors, and the cache is left untouched
6. ``generate``: golden tokens, sampling, stop ids, batching, policies
7. Llama-3 RoPE frequency scaling
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from nanollm import (
    FullCache,
    KVCache,
    LayerKV,
    ModelConfig,
    Transformer,
    decode_step,
    extend,
    generate,
    prefill,
    preset,
    select_topk,
)
from nanollm.attention import attend, rope_inv_freq
from nanollm.policy import CachePolicy, Needs


def assert_close(actual: Tensor, expected: Tensor, atol: float, what: str = "") -> None:
    """assert_close with rtol=0 and a message giving the max and mean absolute difference."""
    diff = (actual - expected).abs()
    assert diff.max() <= atol, f"{what}: max abs diff {diff.max():.3g}, mean {diff.mean():.3g} > atol {atol}"


def random_ids(config: ModelConfig, B: int, T: int, seed: int = 1) -> Tensor:
    return torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["llama", "gpt2", "qwen3"])
def model(request, tiny_model: Transformer, tiny_gpt2_model: Transformer, make_model) -> Transformer:
    """Both flavours: Llama (RoPE, GQA 4 query / 2 KV heads) and GPT-2 (learned positions, MHA); and a Llama
    with Qwen3's RMSNorm of each head's q and k (weights drawn, not ones) and a head size of its own."""
    if request.param == "qwen3":
        qwen3 = make_model(preset("TINY", qk_norm=True, d_head=32), seed=3)
        with torch.no_grad():
            for i, (name, p) in enumerate(qwen3.named_parameters()):
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.copy_(1 + torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
        return qwen3
    return tiny_model if request.param == "llama" else tiny_gpt2_model


# ----------------------------------------------------------------------------------------------------------
# 1. Cached decoding reproduces the uncached forward

def test_stepwise_decode_matches_full_forward(model: Transformer) -> None:
    ids = random_ids(model.config, B=2, T=40)
    with torch.no_grad():
        full = model(ids)                                                 # (B, T, V)
    cache = KVCache(model.config)
    steps = [prefill(model, ids[:, :1], cache)[:, -1]]
    for t in range(1, ids.shape[1]):
        steps.append(decode_step(model, ids[:, t], cache))                # (B, V)
    assert cache.seen == ids.shape[1]
    assert_close(torch.stack(steps, dim=1), full, atol=1e-5, what="stepwise decode vs full forward")


def test_chunked_prefill_matches_single_prefill(model: Transformer) -> None:
    ids = random_ids(model.config, B=2, T=30)
    with torch.no_grad():
        full = model(ids)
    one = prefill(model, ids, KVCache(model.config))
    cache = KVCache(model.config)
    chunks = [prefill(model, ids[:, :11], cache), extend(model, ids[:, 11:20], cache),
              extend(model, ids[:, 20:], cache)]
    chunked = torch.cat(chunks, dim=1)
    assert_close(chunked, one, atol=1e-5, what="prefill(a) + extend(b) vs prefill(a + b)")
    assert_close(chunked, full, atol=1e-5, what="prefill(a) + extend(b) vs uncached forward")
    # the cache holds every token at its true position, shared by every row and KV head
    kv = cache.layers[0]
    assert len(kv) == 30 and torch.equal(kv.pos[1, 1], torch.arange(30))


# ----------------------------------------------------------------------------------------------------------
# 2. FullCache through the policy hooks is the plain cache, bit for bit

def test_fullcache_policy_is_bit_identical_to_plain_cache(model: Transformer) -> None:
    ids = random_ids(model.config, B=2, T=24)
    plain, hooked = KVCache(model.config, policy=None), KVCache(model.config, policy=FullCache())
    assert torch.equal(prefill(model, ids[:, :12], plain), prefill(model, ids[:, :12], hooked))
    assert torch.equal(extend(model, ids[:, 12:18], plain), extend(model, ids[:, 12:18], hooked))
    for t in range(18, 24):
        assert torch.equal(decode_step(model, ids[:, t], plain), decode_step(model, ids[:, t], hooked))
    for a, b in zip(plain.layers, hooked.layers):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.pos, b.pos)


# ----------------------------------------------------------------------------------------------------------
# 3. Eviction: attending over the kept entries == attending over all of them with the rest masked out

def reference_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, allowed: Tensor) -> Tensor:
    """Plain masked attention, written independently of ``attend``: K/V repeated per query head.

    q (B, H, Tq, d); k, v, (B, H_kv, T, d); k_pos (B, H_kv, T); allowed (B, H_kv, T) bool.
    """
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)          # (B, H, T, d)
    visible = (k_pos[:, :, None, :] <= q_pos[:, None]) & allowed[:, :, None, :]   # (B, H_kv, Tq, T)
    visible = visible.repeat_interleave(G, dim=1)                                 # (B, H, Tq, T)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


def random_layer(B: int = 2, H_kv: int = 2, T: int = 10, d: int = 8, seed: int = 0) -> LayerKV:
    gen = torch.Generator().manual_seed(seed)
    kv = LayerKV()
    kv.append(torch.randn(B, H_kv, T, d, generator=gen), torch.randn(B, H_kv, T, d, generator=gen),
              torch.arange(T))
    return kv


# Per-head kept slots (B=2, H_kv=2, K=6): heads keep different tokens and different *numbers* of tokens
# (row 1 head 0 keeps 4 and is padded with two empty slots, -1).
KEEP_IDX = torch.tensor([[[0, 2, 3, 5, 8, 9], [1, 2, 4, 6, 7, 9]],
                         [[0, 4, 5, 9, -1, -1], [0, 1, 2, 3, 8, 9]]])


def test_keep_equals_masking_the_dropped_entries() -> None:
    B, H, H_kv, T, d = 2, 4, 2, 10, 8
    kv = random_layer(B, H_kv, T, d)
    k0, v0, pos0 = kv.k.clone(), kv.v.clone(), kv.pos.clone()
    q = torch.randn(B, H, 3, d, generator=torch.Generator().manual_seed(1))
    q_pos = torch.tensor([7, 8, 9])                 # the queries are the last 3 tokens (causal mask matters)
    allowed = torch.zeros(B, H_kv, T, dtype=torch.bool)
    for b in range(B):
        for h in range(H_kv):
            allowed[b, h, KEEP_IDX[b, h][KEEP_IDX[b, h] >= 0]] = True

    kv.keep(KEEP_IDX)
    out, probs, _ = attend(q, kv.k, kv.v, q_pos, kv.pos, Needs(rows=None))
    expected = reference_attention(q, k0, v0, q_pos, pos0, allowed)
    assert_close(out, expected, atol=1e-6, what="attention over kept entries vs masked full attention")
    assert torch.equal(kv.counts(), torch.tensor([[6, 6], [4, 6]]))
    # the kept keys are the original (already rotated) keys and keep their original positions
    for b in range(B):
        for h in range(H_kv):
            idx = KEEP_IDX[b, h][KEEP_IDX[b, h] >= 0]
            n = len(idx)
            assert torch.equal(kv.pos[b, h, :n], pos0[b, h, idx])
            assert torch.equal(kv.k[b, h, :n], k0[b, h, idx]) and torch.equal(kv.v[b, h, :n], v0[b, h, idx])
    # padded slots: position -1 and zero attention probability (query heads 0 and 1 read KV head 0)
    assert torch.equal(kv.pos[1, 0, 4:], torch.tensor([-1, -1]))
    assert (probs[1, :2, :, 4:] == 0).all()


def test_padded_slot_is_never_attended() -> None:
    """An empty slot (pos = -1) holding huge keys and values changes nothing, even for a query at position 0."""
    kv = random_layer(B=1, H_kv=2, T=4, d=8)
    q = torch.randn(1, 4, 2, 8, generator=torch.Generator().manual_seed(2))
    q_pos = torch.tensor([0, 3])
    before, _, _ = attend(q, kv.k, kv.v, q_pos, kv.pos)
    k = torch.cat([kv.k, torch.full((1, 2, 1, 8), 1e4)], dim=2)
    v = torch.cat([kv.v, torch.full((1, 2, 1, 8), 1e4)], dim=2)
    pos = torch.cat([kv.pos, torch.full((1, 2, 1), -1)], dim=2)
    after, probs, _ = attend(q, k, v, q_pos, pos, Needs(rows=None))
    assert (probs[..., -1] == 0).all()
    assert_close(after, before, atol=1e-6, what="attention with an extra empty slot")


class EvictAtPrefill(CachePolicy):
    """Keeps the slots ``idx`` (B, H_kv, K) of every layer right after prefill."""

    def __init__(self, idx: Tensor) -> None:
        self.idx = idx

    def on_prefill(self, ctx) -> None:
        ctx.kv.keep(self.idx)


class MaskAtPrefill(CachePolicy):
    """Keeps everything but hides the prompt slots outside ``idx`` from every later query."""

    def __init__(self, idx: Tensor, n_prompt: int) -> None:
        self.hidden = torch.ones(*idx.shape[:2], n_prompt, dtype=torch.bool)    # (B, H_kv, T0)
        for b in range(idx.shape[0]):
            for h in range(idx.shape[1]):
                self.hidden[b, h, idx[b, h][idx[b, h] >= 0]] = False

    def attend_kv(self, layer: int, store: LayerKV):
        T0 = self.hidden.shape[-1]
        if len(store) <= T0:                        # the prompt itself: nothing is hidden yet
            return store
        pos = store.pos.clone()                     # decode steps: the prompt's dropped slots are hidden
        pos[..., :T0] = pos[..., :T0].masked_fill(self.hidden, -1)
        return LayerKV(store.k, store.v, pos)


def test_model_decodes_after_eviction_as_if_masked(tiny_model: Transformer) -> None:
    """Evicting prompt tokens == masking them: the model keeps true positions (RoPE, mask) after keep()."""
    ids = random_ids(tiny_model.config, B=2, T=16)
    evict = KVCache(tiny_model.config, policy=EvictAtPrefill(KEEP_IDX))
    mask = KVCache(tiny_model.config, policy=MaskAtPrefill(KEEP_IDX, n_prompt=10))
    assert torch.equal(prefill(tiny_model, ids[:, :10], evict), prefill(tiny_model, ids[:, :10], mask))
    for t in range(10, 16):
        assert_close(decode_step(tiny_model, ids[:, t], evict), decode_step(tiny_model, ids[:, t], mask),
                     atol=1e-5, what=f"decode step {t} after eviction vs masking")
    # new tokens got positions 10..15 (tokens seen), not slot numbers 6..11
    assert len(evict.layers[0]) == 12 and evict.seen == 16
    assert torch.equal(evict.layers[0].pos[0, 0, 6:], torch.arange(10, 16))


# ----------------------------------------------------------------------------------------------------------
# 4. select_topk

def test_select_topk_hand_computed() -> None:
    scores = torch.tensor([[[0.1, 0.9, 0.2, 0.8, 0.3, 0.4]]])        # (B=1, H_kv=1, T=6)
    # top 4 scores: 0.9 (1), 0.8 (3), 0.4 (5), 0.3 (4) -> sorted by position
    assert select_topk(scores, 4).tolist() == [[[1, 3, 4, 5]]]
    # protect the sink (0) and the most recent token (5), as a scorer's rank does (+inf): two slots left for
    # 0.9 (1) and 0.8 (3)
    protected = torch.tensor([True, False, False, False, False, True])
    assert select_topk(scores.masked_fill(protected, float("inf")), 4).tolist() == [[[0, 1, 3, 5]]]
    # per head: each head picks its own tokens
    per_head = torch.tensor([[[3.0, 1.0, 2.0], [1.0, 3.0, 2.0]]])     # (1, 2, 3)
    assert select_topk(per_head, 2).tolist() == [[[0, 2], [1, 2]]]
    # NaN counts as -inf
    assert select_topk(torch.tensor([[[float("nan"), 0.0, -5.0]]]), 2).tolist() == [[[1, 2]]]


def test_select_topk_ties_sorting_and_budget() -> None:
    ties = torch.tensor([[[1.0, 2.0, 2.0, 2.0, 0.0]]])
    assert select_topk(ties, 2).tolist() == [[[1, 2]]]                # earlier position wins the tie
    idx = select_topk(torch.randn(2, 3, 20, generator=torch.Generator().manual_seed(0)), 7)
    assert idx.shape == (2, 3, 7) and idx.dtype == torch.long
    assert (idx[..., 1:] > idx[..., :-1]).all()                       # ascending within each head
    assert torch.equal(select_topk(torch.randn(1, 2, 5), 5), torch.arange(5).expand(1, 2, 5))
    assert torch.equal(select_topk(torch.randn(1, 2, 5), 99), torch.arange(5).expand(1, 2, 5))


@pytest.mark.parametrize("budget, error, match", [
    (0, ValueError, "budget must be positive"),
    (-3, ValueError, "budget must be positive"),
    (2.0, TypeError, "budget must be an int"),
    (True, TypeError, "budget must be an int"),
])
def test_select_topk_rejects_bad_budgets(budget, error, match) -> None:
    with pytest.raises(error, match=match):
        select_topk(torch.zeros(1, 1, 4), budget)


# ----------------------------------------------------------------------------------------------------------
# 5. Bad input: a clear error, and nothing half-updated

def snapshot(cache: KVCache) -> tuple:
    return cache.seen, [(kv.k.clone(), kv.v.clone(), kv.pos.clone()) for kv in cache.layers]


def assert_unchanged(cache: KVCache, snap: tuple) -> None:
    seen, layers = snap
    assert cache.seen == seen, "cache.seen changed by a call that raised"
    for kv, (k, v, pos) in zip(cache.layers, layers):
        assert torch.equal(kv.k, k) and torch.equal(kv.v, v) and torch.equal(kv.pos, pos), \
            "layer storage changed by a call that raised"


@pytest.fixture
def used_cache(tiny_model: Transformer) -> KVCache:
    """A cache holding a 6-token prefix: errors must leave it exactly as it is."""
    cache = KVCache(tiny_model.config, policy=FullCache())
    prefill(tiny_model, random_ids(tiny_model.config, B=1, T=6), cache)
    return cache


def bad_calls(model: Transformer, cache: KVCache) -> dict:
    V, L = model.config.vocab_size, model.config.max_seq_len
    ok = torch.tensor([[1, 2, 3]])
    return {
        "empty prompt (generate)": (lambda: generate(model, ok[:, :0], 4, cache=cache),
                                    ValueError, "at least one token"),
        "empty chunk (extend)": (lambda: extend(model, ok[:, :0], cache), ValueError, "at least one token"),
        "id >= vocab_size": (lambda: extend(model, torch.tensor([[1, V]]), cache), ValueError,
                             rf"token ids must lie in \[0, {V}\)"),
        "negative id": (lambda: generate(model, torch.tensor([[-1, 2]]), 2, cache=cache), ValueError,
                        "token ids must lie in"),
        "too long (generate)": (lambda: generate(model, ok, L, cache=cache), ValueError, "max_seq_len"),
        "too long (extend)": (lambda: extend(model, torch.ones(1, L - 5, dtype=torch.long), cache),
                              ValueError, "max_seq_len"),
        "float ids": (lambda: extend(model, ok.float(), cache), TypeError, "integer tensor"),
        "float token (decode_step)": (lambda: decode_step(model, torch.tensor([1.0]), cache), TypeError,
                                      "integer tensor"),
        "ids on meta device": (lambda: generate(model, ok.to("meta"), 2, cache=cache), ValueError,
                               "ids are on meta but the model is on cpu"),
        "negative max_new_tokens": (lambda: generate(model, ok, -1, cache=cache), ValueError,
                                    "max_new_tokens must be an int >= 0"),
    }


BAD_CASES = ["empty prompt (generate)", "empty chunk (extend)", "id >= vocab_size", "negative id",
             "too long (generate)", "too long (extend)", "float ids", "float token (decode_step)",
             "ids on meta device", "negative max_new_tokens"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_raises_and_leaves_cache_untouched(case: str, tiny_model: Transformer,
                                                     used_cache: KVCache) -> None:
    call, error, match = bad_calls(tiny_model, used_cache)[case]
    snap = snapshot(used_cache)
    with pytest.raises(error, match=match):
        call()
    assert_unchanged(used_cache, snap)


def test_bad_input_on_a_fresh_cache(tiny_model: Transformer) -> None:
    """generate() without a cache validates before prefilling; prefill rejects an empty prompt too."""
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(tiny_model, torch.ones(1, 250, dtype=torch.long), max_new_tokens=10)
    cache = KVCache(tiny_model.config)
    with pytest.raises(ValueError, match="at least one token"):
        prefill(tiny_model, torch.zeros(2, 0, dtype=torch.long), cache)
    assert cache.seen == 0 and all(len(kv) == 0 for kv in cache.layers)


def test_config_rejects_n_head_not_divisible_by_n_kv_head() -> None:
    with pytest.raises(ValueError, match=r"n_head \(4\) must be divisible by n_kv_head \(3\)"):
        ModelConfig(n_head=4, n_kv_head=3)


@pytest.mark.parametrize("fields, match", [
    (dict(d_head=-1), r"d_head must be an int >= 0 \(0: d_model // n_head\), got -1"),
    (dict(d_head=7), "RoPE needs an even head dimension, got 7"),
    (dict(qk_norm="yes"), "qk_norm must be True or False"),
    (dict(flavour="gpt2", n_kv_head=4, qk_norm=True), "d_head and qk_norm are for llama-flavour models"),
    (dict(d_model=30), r"d_model \(30\) must be divisible by n_head \(4\), or give d_head"),
])
def test_config_rejects_bad_head_sizes_and_qk_norms(fields, match) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig(**fields)
    assert ModelConfig(d_model=30, d_head=8).head_dim == 8          # a head size of its own: Qwen3's way


# ----------------------------------------------------------------------------------------------------------
# 6. generate

# Recorded once with: tiny_model (conftest.make_model(preset("TINY"), seed=0), weights ~ N(0, 0.1²)),
#   generate(tiny_model, random_ids(cfg, B=2, T=8, seed=1), max_new_tokens=12)   # greedy
# on torch 2.13 CPU, fp32. If this changes, something in the forward pass or greedy decoding changed.
# The smallest top-1 vs top-2 logit gap along these 24 steps is 0.02, far above fp32 noise.
GOLDEN_GREEDY = torch.tensor([[211, 211, 211, 491, 109, 109, 109, 109, 109, 198, 173, 109],
                              [100, 469, 280, 211, 211, 211, 211, 211, 211, 211, 211, 211]])


def test_greedy_golden(tiny_model: Transformer) -> None:
    out = generate(tiny_model, random_ids(tiny_model.config, B=2, T=8, seed=1), max_new_tokens=12)
    assert torch.equal(out, GOLDEN_GREEDY), f"greedy tokens changed:\n{out}"


def test_greedy_matches_argmax_of_uncached_forward(model: Transformer) -> None:
    ids = random_ids(model.config, B=2, T=8, seed=3)
    out = generate(model, ids, max_new_tokens=10)
    seq = ids
    with torch.no_grad():
        for _ in range(10):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq[:, 8:])


def test_batch_rows_match_single_rows(tiny_model: Transformer) -> None:
    ids = random_ids(tiny_model.config, B=2, T=8, seed=4)
    both = generate(tiny_model, ids, max_new_tokens=10)
    for b in range(2):
        assert torch.equal(both[b:b + 1], generate(tiny_model, ids[b:b + 1], max_new_tokens=10))


def test_sampling_is_reproducible_and_respects_top_k(tiny_model: Transformer) -> None:
    ids = random_ids(tiny_model.config, B=2, T=8, seed=5)

    def sample(seed: int) -> Tensor:
        return generate(tiny_model, ids, max_new_tokens=16, temperature=0.8, top_k=5,
                        generator=torch.Generator().manual_seed(seed))

    a, b, c = sample(0), sample(0), sample(1)
    assert torch.equal(a, b), "same seed, different samples"
    assert not torch.equal(a, c), "different seeds gave identical samples"
    assert not torch.equal(a, generate(tiny_model, ids, max_new_tokens=16)), "sampling looks greedy"
    # every sampled token is among the 5 most likely ones given what came before
    with torch.no_grad():
        logits = tiny_model(torch.cat([ids, a], dim=1))[:, 7:-1]         # (B, 16, V): predicts a
    top5 = logits.topk(5, dim=-1).indices
    assert (top5 == a[..., None]).any(-1).all()


def test_stop_ids_pad_rows_and_end_early(tiny_model: Transformer) -> None:
    ids = random_ids(tiny_model.config, B=2, T=8, seed=1)
    free = generate(tiny_model, ids, max_new_tokens=12)                  # (2, 12) without stop ids
    stop_ids = [int(free[0, 2]), int(free[1, 5])]
    # where each row first produces a stop id
    first = [next(i for i, t in enumerate(row.tolist()) if t in stop_ids) for row in free]
    out = generate(tiny_model, ids, max_new_tokens=12, stop_ids=stop_ids)
    assert out.shape == (2, max(first) + 1) and out.shape[1] < 12, "generation did not end early"
    for b in range(2):
        n = first[b] + 1
        assert torch.equal(out[b, :n], free[b, :n])
        assert (out[b, n:] == free[b, first[b]]).all(), "a stopped row is not padded with its stop id"


def test_generate_with_fullcache_policy_equals_plain(model: Transformer) -> None:
    ids = random_ids(model.config, B=2, T=8, seed=6)
    assert torch.equal(generate(model, ids, 10, policy=FullCache()), generate(model, ids, 10))


# ----------------------------------------------------------------------------------------------------------
# 7. Llama-3 RoPE frequency scaling

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def llama3_scaled(freq: float) -> float:
    """One frequency, scaled as in Meta's reference ``apply_scaling`` (llama-models, Llama 3.1), scalar code."""
    factor, low, high, old_ctx = 8.0, 1.0, 4.0, 8192.0
    wavelen = 2 * math.pi / freq
    if wavelen < old_ctx / high:          # short waves (< 2048 positions): unchanged
        return freq
    if wavelen > old_ctx / low:           # long waves (> 8192 positions): slowed down by `factor`
        return freq / factor
    smooth = (old_ctx / wavelen - low) / (high - low)
    return (1 - smooth) * freq / factor + smooth * freq


def test_llama3_rope_scaling_matches_reference_formula() -> None:
    # Llama-3 head size 128 and base 500000: the 64 frequencies cover all three regimes
    cfg = ModelConfig(n_head=2, n_kv_head=1, d_model=256, rope_base=500000.0, rope_scaling=LLAMA3_SCALING)
    got = rope_inv_freq(cfg)
    plain = [500000.0 ** (-2 * i / 128) for i in range(64)]
    assert got.shape == (64,)
    for i in (0, 34, 63):      # short wave, in the blended band (wavelength ~6695), long wave
        assert got[i].item() == pytest.approx(llama3_scaled(plain[i]), rel=1e-12)
    assert got[0].item() == 1.0 and got[63].item() == pytest.approx(plain[63] / 8, rel=1e-12)
    assert plain[34] / 8 < got[34].item() < plain[34]
    assert torch.allclose(got, torch.tensor([llama3_scaled(f) for f in plain], dtype=torch.float64),
                          rtol=1e-12, atol=0)


def test_rope_scaling_types() -> None:
    plain = rope_inv_freq(ModelConfig())
    assert torch.equal(rope_inv_freq(ModelConfig(rope_scaling={"rope_type": "default"})), plain)
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0})     # refused before any model is built


def test_llama3_scaled_model_still_caches_exactly(make_model) -> None:
    model = make_model(preset("TINY", rope_scaling=LLAMA3_SCALING))
    ids = random_ids(model.config, B=1, T=12)
    with torch.no_grad():
        full = model(ids)
    cache = KVCache(model.config)
    steps = torch.cat([prefill(model, ids[:, :5], cache), extend(model, ids[:, 5:], cache)], dim=1)
    assert_close(steps, full, atol=1e-5, what="llama3-scaled RoPE, chunked vs full")
