"""AdaKV's allocation as the authors' repository runs it (experiments/analysis/adakv_allocation.py): the blend
round((1 - alpha) c_j + floor(alpha b')) by hand and against the repository's loop written out, its two ends
(alpha 0: the layer-wide top, kvpress's reading with no safeguard; alpha 1: every head its own budget), a layer
never over its budget, and the policy in a model as a ``MODULE:CLASS`` method spec."""

from __future__ import annotations

import pytest
import torch

from experiments.analysis.adakv_allocation import (
    AdaKVAlphaHalf,
    RepositoryAdaKV,
    RepositoryAdaKVAlphaHalf,
    blended_keep_mask,
)
from methods import make_policy
from methods.adakv import AdaKVPolicy, adaptive_keep_mask
from nanollm import KVCache, decode_step, prefill
from nanollm.config import preset

SPEC = "experiments.analysis.adakv_allocation:RepositoryAdaKV"
INF = float("inf")


def four_heads(seed: int = 0) -> torch.Tensor:
    """(1, 4, 30) scores whose heads run from strong to weak, the last 4 slots protected (SnapKV's window)."""
    scale = torch.tensor([[1.0], [0.5], [0.1], [0.01]])
    scores = (torch.rand(4, 30, generator=torch.Generator().manual_seed(seed)) * scale)[None]
    scores[..., -4:] = INF
    return scores


def test_the_blend_by_hand():
    """Budget 12, a window of 3: b' = 9 per head outside it, a pool of 36, which the first head's 27 and the
    second head's best 9 fill (c = 27, 9, 0, 0). alpha 0.2: floor(1.8) = 1 each, (1 - 0.2) c = 21.6, 7.2, 0, 0,
    so the heads keep 23, 8, 1 and 1 of their own best (22.6, 8.2, 1, 1 rounded), plus the window: 45 of the
    layer's 48 (the floor drops 0.8 of an entry a head, as in the repository). Counting the window in the blend
    instead (c = 30, 12, 3, 3 and floor(0.2 * 12) = 2) would give 26, 12, 4, 4."""
    g = torch.Generator().manual_seed(0)
    scores = torch.cat([100 + torch.rand(1, 27, generator=g), 50 + torch.rand(1, 27, generator=g),
                        10 + torch.rand(2, 27, generator=g)])
    scores = torch.cat([scores, torch.full((4, 3), INF)], dim=-1)[None]     # (1, 4, 30)
    assert adaptive_keep_mask(scores, 12, 0).sum(-1).tolist() == [[27 + 3, 9 + 3, 3, 3]]   # c_j + the window
    mask = blended_keep_mask(scores, 12, 0.2)
    assert mask.sum(-1).tolist() == [[23 + 3, 8 + 3, 1 + 3, 1 + 3]]
    for h, n in enumerate([23, 8, 1, 1]):
        best = torch.sort(scores[0, h, :-3], descending=True).indices[:n]
        assert mask[0, h, best].all() and mask[0, h, -3:].all()


def test_the_blend_is_taken_in_float32_as_in_the_repository():
    """Five heads, budget 4, a window of 1 (b' = 3), alpha 0.7, the first head holding the whole pool of 15:
    int(0.7 * 3) = 2, and 15 * (1 - 0.7) is 4.5 in float32 (4.500000000000001 in float64), so the first head's
    6.5 rounds half to even to 6: it keeps 6 + 1, the others 2 + 1."""
    scores = torch.rand(1, 5, 20, generator=torch.Generator().manual_seed(0))
    scores[0, 0, :15] += 10
    scores[..., -1] = INF
    assert blended_keep_mask(scores, 4, 0.7).sum(-1).tolist() == [[7, 3, 3, 3, 3]]


def repository_counts(scores: torch.Tensor, budget: int, alpha: float) -> list[int]:
    """The entries each head keeps outside its window, as the repository's loop allocates them, written out for
    one row whose heads share one window (+inf): pool, counts, blend, rounding."""
    H, T = scores.shape
    w = int((scores[0] == INF).sum())
    own = budget - w                                                   # b'
    flat = sorted(((float(scores[h, t]), h) for h in range(H) for t in range(T - w)), reverse=True)
    c = [sum(1 for _, h in flat[:H * own] if h == j) for j in range(H)]
    share = torch.tensor(c) * (1 - alpha) + int(own * alpha)          # float32, as the repository's tensor
    return [min(int(torch.round(x)), T - w) for x in share]


@pytest.mark.parametrize("seed", range(30))
def test_the_counts_are_the_repository_s(seed):
    """Continuous scores (no ties), one window for all heads: each head keeps the counts the repository's
    allocation gives, its window and its own best, wherever those counts fit the layer's budget."""
    g = torch.Generator().manual_seed(seed)
    H, T = int(torch.randint(2, 7, (1,), generator=g)), int(torch.randint(10, 40, (1,), generator=g))
    budget, w = int(torch.randint(2, T, (1,), generator=g)), int(torch.randint(0, 5, (1,), generator=g))
    w = min(w, budget - 1)
    alpha = [0.2, 0.5, 0.7, 0.9, 0.25, 0.1][seed % 6]
    scores = torch.rand(H, T, generator=g) * torch.rand(H, 1, generator=g)       # heads of unequal weight
    scores[:, T - w:] = INF
    expected = repository_counts(scores, budget, alpha)
    if sum(expected) > H * (budget - w):
        pytest.skip("the repository's rounding goes over the budget here (the trimming's test)")
    mask = blended_keep_mask(scores[None], budget, alpha)[0]
    assert (mask.sum(-1) - w).tolist() == expected
    for h, n in enumerate(expected):
        best = torch.sort(scores[h, :T - w], descending=True).indices[:n]
        assert mask[h, best].all() and mask[h, T - w:].all()


def test_alpha_zero_is_the_layer_wide_top_and_alpha_one_each_head_its_budget():
    scores = four_heads(seed=1)
    assert torch.equal(blended_keep_mask(scores, 12, 0.0), adaptive_keep_mask(scores, 12, 0))
    mask = blended_keep_mask(scores, 12, 1.0)
    assert torch.equal(mask, adaptive_keep_mask(scores, 12, 12))
    assert mask.sum(-1).tolist() == [[12] * 4]


@pytest.mark.parametrize("counts, budget, alpha, kept", [
    ([3, 3, 6], 4, 0.5, [3, 4, 5]),        # shares 3.5, 3.5, 5: halves to even, 4 + 4 + 5 = 13 of 12
    ([7, 7, 1], 5, 0.2, [6, 7, 2]),        # shares 6.6, 6.6, 1.8: 7 + 7 + 2 = 16 of 15
])
def test_heads_that_rounded_up_give_back_what_would_put_the_layer_over(counts, budget, alpha, kept):
    """Nothing protected; head j holds ``counts[j]`` of the pool's entries (scores above 10, the rest below 1).
    Rounded, the shares exceed the pool; the first heads that rounded up give one entry back each."""
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(1, len(counts), 10, generator=g)
    for h, n in enumerate(counts):
        scores[0, h, :n] += 10
    assert adaptive_keep_mask(scores, budget, 0).sum(-1).tolist() == [counts]
    assert blended_keep_mask(scores, budget, alpha).sum(-1).tolist() == [kept]


def test_a_head_whose_budget_is_all_protected_still_draws_from_the_pool():
    """Two heads, budget 2, alpha 0.25: the first protects 2 entries (b' = 0) yet scores highest outside them,
    so it takes both entries of the pool (the second head's b' = 2) and keeps round(0.75 * 2) = 2 of them: 4 in
    all, which ``head_slack`` allows (the worst protected count, not none, bounds a head)."""
    scores = torch.tensor([[[9.0, 8.0, 7.0, INF, INF], [1.0, 2.0, 3.0, 4.0, 5.0]]])
    mask = blended_keep_mask(scores, 2, 0.25)
    assert mask.sum(-1).tolist() == [[4, 0]]
    assert 4 <= 2 + RepositoryAdaKV(budget=2, alpha_safeguard=0.25).head_slack(2)


@pytest.mark.parametrize("seed", range(40))
def test_a_layer_never_keeps_more_than_its_budget(seed):
    """Random scores, ties, protected slots and empty ones: at most H_kv * budget kept in the layer, every head
    within ``head_slack``, every protected entry kept (up to the budget), and what a head keeps is a top of its
    own scores."""
    g = torch.Generator().manual_seed(seed)
    B, H, T = 2, int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(8, 40, (1,), generator=g))
    budget = int(torch.randint(1, T, (1,), generator=g))
    alpha = [0.0, 0.2, 0.25, 0.5, 0.7, 1.0][seed % 6]
    scores = torch.randint(0, 6, (B, H, T), generator=g).float()        # small integers: many ties
    w = torch.randint(0, budget + 1, (B, H), generator=g)             # protected counts, unequal across heads
    protected = (torch.arange(T) >= T - w[..., None]) & (torch.arange(T) >= 2)
    scores[protected] = INF
    scores[..., 0] = float("-inf")                                     # an empty slot, never kept
    scores[..., 1] = float("nan")                                      # so is a NaN
    mask = blended_keep_mask(scores, budget, alpha)
    slack = RepositoryAdaKV(budget=budget, alpha_safeguard=alpha).head_slack(H)
    assert (mask.sum((-1, -2)) <= H * budget).all()
    assert (mask.sum(-1) <= budget + slack).all()
    assert not mask[..., :2].any()
    assert mask[protected].all()
    valid = torch.nan_to_num(scores, nan=float("-inf"))
    kept = valid.masked_fill(~mask, INF).amin(-1)                      # the lowest score a head keeps
    dropped = valid.masked_fill(mask, float("-inf")).amax(-1)
    assert (dropped <= kept).all()


def test_in_a_model_as_a_method_spec(make_model):
    """Named as ``MODULE:CLASS``: each layer within its budget, its heads' shares unequal, every head its
    window, and decoding on goes through the cache as AdaKV's does."""
    model = make_model(preset("TINY_GPT2"), seed=0)
    H = model.config.n_kv_head
    policy = make_policy(SPEC, 12, window=4, kernel=3, alpha_safeguard=0.5)
    assert type(policy) is RepositoryAdaKV and policy.inner.window == 4
    cache = KVCache(model.config, policy)
    ids = torch.randint(model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    prefill(model, ids, cache)
    for layer in cache.layers:
        counts = layer.counts()                                         # (B, H_kv)
        assert (counts.sum(-1) <= H * 12).all() and (counts <= 12 + policy.head_slack(H)).all()
        assert len(set(counts.flatten().tolist())) > 1                   # the heads got unequal shares
        for b in range(2):
            for h in range(H):
                assert set(range(36, 40)) <= set(layer.pos[b, h].tolist())
    logits = decode_step(model, ids[:, -1:], cache)
    assert torch.isfinite(logits).all()


def test_the_two_readings_at_the_repository_s_alpha():
    """The classes the alpha 0.5 run names are the two readings with only alpha changed."""
    assert make_policy("experiments.analysis.adakv_allocation:AdaKVAlphaHalf", 16) == AdaKVAlphaHalf(budget=16)
    assert vars(AdaKVAlphaHalf(budget=16)) == vars(AdaKVPolicy(budget=16, alpha_safeguard=0.5))
    assert vars(RepositoryAdaKVAlphaHalf(budget=16)) == vars(RepositoryAdaKV(budget=16, alpha_safeguard=0.5))
    assert RepositoryAdaKVAlphaHalf.keep_mask is RepositoryAdaKV.keep_mask
