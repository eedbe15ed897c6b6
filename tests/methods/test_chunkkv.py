"""ChunkKV: whole-chunk selection (Algorithm 1) and layer-wise index reuse (Algorithm 2)."""

from __future__ import annotations

import pytest
import torch

from experiments.analysis.layer_similarity import adjacent_layer_jaccard, jaccard, kept_positions
from methods import make_policy
from methods.chunkkv import ChunkKVPolicy, chunk_keep_mask, holds_position
from nanollm import KVCache, decode_step, prefill, preset


@pytest.fixture(scope="module")
def model4(make_model):
    """TINY with 4 layers (two reuse groups of 2), weights scaled so attention is peaked."""
    return make_model(preset("TINY", n_layer=4), seed=0)


def prompt(n: int, seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


def run(model, spec: str, budget: int, n: int = 60, seed: int = 0, **opts) -> KVCache:
    cache = KVCache(model.config, make_policy(spec, budget, **opts))
    prefill(model, prompt(n, seed), cache)
    return cache


# ---------------------------------------------------------------------------------------------------------
# Algorithm 1 by hand

def test_chunk_keep_mask_hand():
    """12 free tokens, c = 4 -> chunks [0..3], [4..7], [8..11] with votes
        [.1 .1 .1 .1 | .5 0 0 0 | .2 .2 .2 .1]   chunk sums .4, .5, .7
    n_free 9: chunk 2 (.7, 4 tokens) fits, chunk 1 (.5) fits (8), chunk 0 does not (12 > 9);
    remainder 1 token: the best single token of chunk 0 (a tie of .1: the earliest, 0)."""
    votes = torch.tensor([.1, .1, .1, .1, .5, 0, 0, 0, .2, .2, .2, .1]).view(1, 1, 12)
    pos = torch.arange(12).view(1, 1, 12)
    free = torch.ones(1, 1, 12, dtype=torch.bool)
    n_free = torch.tensor([[9]])
    keep = chunk_keep_mask(votes, pos, free, n_free, 4, shared=True, remainder="tokens")
    assert keep[0, 0].nonzero().flatten().tolist() == [0, 4, 5, 6, 7, 8, 9, 10, 11]
    keep = chunk_keep_mask(votes, pos, free, n_free, 4, shared=True, remainder="none")
    assert keep[0, 0].nonzero().flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # token-level selection keeps the 9 best single tokens instead: .5 then the .2s and .1s (earliest first)
    keep = chunk_keep_mask(votes, pos, free, n_free, 1, shared=True, remainder="none")
    assert keep[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11]


def test_chunk_scores_are_shared_over_heads_or_per_head():
    """Head 0 votes for chunk 0, head 1 (more strongly) for chunk 1: shared keeps chunk 1 in both heads,
    per head each head keeps its own."""
    votes = torch.tensor([[1., 1, 0, 0], [0, 0, 2, 2]]).view(1, 2, 4)
    pos = torch.arange(4).expand(1, 2, 4)
    free = torch.ones(1, 2, 4, dtype=torch.bool)
    n_free = torch.tensor([[2, 2]])
    shared = chunk_keep_mask(votes, pos, free, n_free, 2, shared=True, remainder="none")
    assert shared.int().tolist() == [[[0, 0, 1, 1], [0, 0, 1, 1]]]
    per_head = chunk_keep_mask(votes, pos, free, n_free, 2, shared=False, remainder="none")
    assert per_head.int().tolist() == [[[1, 1, 0, 0], [0, 0, 1, 1]]]


# ---------------------------------------------------------------------------------------------------------
# Properties on a model

@pytest.mark.parametrize("n,c", [(60, 10), (57, 10), (61, 4)])          # lengths that are not multiples of c
@pytest.mark.parametrize("remainder", ["none", "tokens"])
def test_kept_prefix_is_whole_aligned_chunks(model4, n, c, remainder):
    window, budget = 8, 30
    cache = run(model4, "chunkkv", budget, n=n, window=window, chunk_size=c, reuse=1, remainder=remainder)
    prefix_end = n - window
    for layer in cache.layers:
        counts = layer.counts()
        if remainder == "tokens":
            assert bool((counts == budget).all())                       # exact budget
        for b in range(2):
            for h in range(2):
                kept = set(layer.pos[b, h][layer.pos[b, h] >= 0].tolist())
                assert set(range(prefix_end, n)) <= kept                # the window, always
                partial = 0
                for start in range(0, prefix_end, c):
                    chunk = set(range(start, min(start + c, prefix_end)))
                    inside = len(chunk & kept)
                    if 0 < inside < len(chunk):
                        partial += inside
                if remainder == "none":
                    assert partial == 0, "a kept chunk was cut"
                else:
                    assert partial < c, "more than the remainder (< one chunk) came from cut chunks"


def test_shared_index_set_per_layer(model4):
    for layer in run(model4, "chunkkv", 24, window=8, reuse=1).layers:
        assert torch.equal(layer.pos[:, 0], layer.pos[:, 1])            # one set for both KV heads
    differs = any(not torch.equal(layer.pos[:, 0], layer.pos[:, 1])
                  for layer in run(model4, "chunkkv", 24, window=8, reuse=1, per_head=True).layers)
    assert differs, "per-head ranking should let the heads of this model choose differently"


@pytest.mark.parametrize("budget", [12, 20, 40])
def test_chunk_size_one_without_pooling_is_snapkv_without_pooling(model4, budget):
    a = run(model4, "chunkkv", budget, window=8, kernel=1, chunk_size=1, reuse=1, per_head=True)
    b = run(model4, "snapkv", budget, window=8, kernel=1)
    for x, y in zip(a.layers, b.layers):
        assert torch.equal(x.pos, y.pos)


def test_reuse_groups(model4):
    L = model4.config.n_layer
    one = kept_positions(run(model4, "chunkkv", 24, window=8, reuse=1))
    two = kept_positions(run(model4, "chunkkv", 24, window=8, reuse=2))
    all_ = kept_positions(run(model4, "chunkkv", 24, window=8, reuse=L))
    assert len({tuple(p.flatten().tolist()) for p in one}) > 1, "layers should choose differently without reuse"
    # within a group every layer keeps the first layer's indices
    assert torch.equal(two[1], two[0]) and torch.equal(two[3], two[2])
    assert all(torch.equal(p, all_[0]) for p in all_)
    # the first layer of a group selects exactly as without reuse (prompt attention is exact, so its
    # input does not depend on what earlier layers kept): reuse 1 is Algorithm 1 in every layer
    assert torch.equal(two[0], one[0]) and torch.equal(two[2], one[2]) and torch.equal(all_[0], one[0])


def test_reuse_follows_decode_time_compression(model4):
    """Over a scorer that compresses every step (H2O), reusing layers follow their group's current choice."""
    cache = KVCache(model4.config, make_policy("chunkkv(h2o)", 16, chunk_size=4, reuse=2))
    prefill(model4, prompt(40), cache)
    for t in range(3):
        decode_step(model4, prompt(1, seed=20 + t)[:, 0], cache)
        assert torch.equal(cache.layers[1].pos, cache.layers[0].pos)
        assert bool((cache.layers[0].counts() <= 16).all())


# ---------------------------------------------------------------------------------------------------------
# Edge cases and errors

def test_fewer_tokens_than_a_chunk(model4):
    """A 12-token prompt, window 8: the 4 prefix tokens are less than one chunk of 10."""
    cache = run(model4, "chunkkv", 10, n=12, window=8)
    for layer in cache.layers:
        assert layer.pos[0, 0].tolist() == [0, 1, 4, 5, 6, 7, 8, 9, 10, 11] or (layer.counts() == 10).all()
        assert set(range(4, 12)) <= set(layer.pos[0, 0].tolist())


def test_budget_smaller_than_the_window(model4):
    cache = run(model4, "chunkkv", 5, n=40, window=8)
    for layer in cache.layers:
        assert bool((layer.pos == torch.arange(35, 40)).all())          # the window's last 5 tokens


def test_adjacent_layer_jaccard():
    a, b = torch.tensor([[0, 1, 2, -1]]), torch.tensor([[1, 2, 3, 4]])
    assert jaccard(a[0], b[0]) == pytest.approx(2 / 5)
    assert adjacent_layer_jaccard([a, b, b]) == pytest.approx([0.4, 1.0])
    assert jaccard(a[0], b[0], below=3) == pytest.approx(2 / 3)          # {0, 1, 2} vs {1, 2}


@pytest.mark.parametrize("bad", [{"chunk_size": 0}, {"reuse": 0}, {"reuse": 1.5}, {"per_head": "yes"},
                                 {"remainder": "fill"}])
def test_rejects_bad_options(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        make_policy("chunkkv", 16, **bad)


def test_default_inner_is_unpooled_snapkv_and_wrappers_keep_their_inner():
    assert make_policy("chunkkv", 16).inner.kernel == 1                 # the paper: raw window attention
    assert ChunkKVPolicy(16).inner.kernel == 1
    assert make_policy("chunkkv(snapkv)", 16).inner.kernel == 7         # SnapKV as configured
    assert make_policy("chunkkv", 16, kernel=5).inner.kernel == 5


def test_holds_position_equals_the_pairwise_comparison():
    """The position table used by index reuse == comparing every slot with every chosen position."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        B, H, T, K, seen = 2, 3, 20, 8, 25
        pos = torch.stack([torch.randperm(seen, generator=g)[:T].sort().values for _ in range(B * H)]).view(B, H, T)
        pos[0, 0, -3:] = -1                                                  # empty slots
        chosen = torch.stack([torch.randperm(seen, generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
        chosen[1, 2, :2] = -1                                                # padding
        pairwise = (pos[..., :, None] == chosen[..., None, :]).any(-1) & (pos >= 0)
        assert torch.equal(holds_position(chosen, pos, seen), pairwise)
