"""AdaKV's allocation as the authors' repository runs it (experiments/analysis/adakv_allocation.py): the blend
round((1 - alpha) c_j + floor(alpha b')) by hand, its two ends (alpha 0: the layer-wide top, kvpress's reading
with no safeguard; alpha 1: every head its own budget), a layer never over its budget, and the policy in a model
as a ``MODULE:CLASS`` method spec."""

from __future__ import annotations

import pytest
import torch

from experiments.analysis.adakv_allocation import RepositoryAdaKV, blended_keep_mask
from methods import make_policy
from methods.adakv import adaptive_keep_mask
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
    second head's best 9 fill (c = 27, 9, 0, 0). alpha 0.5: floor(4.5) = 4 each, (1 - 0.5) c = 13.5, 4.5, 0, 0,
    so the heads keep 18 and 8 (17.5 and 8.5 rounded half to even), 4 and 4 of their own best, plus the window:
    46 of the layer's 48 (the floor drops half an entry a head, as in the repository). Counting the window in
    the blend instead (c = 30, 12, 3, 3 and floor(0.5 * 12) = 6) would give 21, 12, 8, 8."""
    g = torch.Generator().manual_seed(0)
    scores = torch.cat([100 + torch.rand(1, 27, generator=g), 50 + torch.rand(1, 27, generator=g),
                        10 + torch.rand(2, 27, generator=g)])
    scores = torch.cat([scores, torch.full((4, 3), INF)], dim=-1)[None]     # (1, 4, 30)
    assert adaptive_keep_mask(scores, 12, 0).sum(-1).tolist() == [[27 + 3, 9 + 3, 3, 3]]   # c_j + the window
    mask = blended_keep_mask(scores, 12, 0.5)
    assert mask.sum(-1).tolist() == [[18 + 3, 8 + 3, 4 + 3, 4 + 3]]
    for h, n in enumerate([18, 8, 4, 4]):
        best = torch.sort(scores[0, h, :-3], descending=True).indices[:n]
        assert mask[0, h, best].all() and mask[0, h, -3:].all()


def test_alpha_zero_is_the_layer_wide_top_and_alpha_one_each_head_its_budget():
    scores = four_heads(seed=1)
    assert torch.equal(blended_keep_mask(scores, 12, 0.0), adaptive_keep_mask(scores, 12, 0))
    mask = blended_keep_mask(scores, 12, 1.0)
    assert torch.equal(mask, adaptive_keep_mask(scores, 12, 12))
    assert mask.sum(-1).tolist() == [[12] * 4]


def test_halves_rounded_up_give_back_what_would_put_the_layer_over():
    """Three heads, nothing protected, budget 4, alpha 0.5: c = 3, 3, 6 gives shares 3.5, 3.5, 5; rounded half to
    even, 4 + 4 + 5 = 13 entries in a pool of 12. The first head that rounded up gives one back."""
    scores = torch.zeros(1, 3, 10)
    scores[0, 0, :3] = scores[0, 1, :3] = 1.0 + torch.arange(3.0)
    scores[0, 2, :6] = 10.0 + torch.arange(6.0)
    assert adaptive_keep_mask(scores, 4, 0).sum(-1).tolist() == [[3, 3, 6]]
    assert blended_keep_mask(scores, 4, 0.5).sum(-1).tolist() == [[3, 4, 5]]


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
    w = int(torch.randint(0, budget + 1, (1,), generator=g))
    scores[..., T - w:] = INF
    scores[..., 0] = float("-inf")                                     # an empty slot, never kept
    mask = blended_keep_mask(scores, budget, alpha)
    slack = RepositoryAdaKV(budget=budget, alpha_safeguard=alpha).head_slack(H)
    assert (mask.sum((-1, -2)) <= H * budget).all()
    assert (mask.sum(-1) <= budget + slack).all()
    assert not mask[..., 0].any()
    if w:
        assert mask[..., T - w:].all()
    kept = scores.masked_fill(~mask, INF).amin(-1)                     # the lowest score a head keeps
    dropped = scores.masked_fill(mask | (scores == float("-inf")), float("-inf")).amax(-1)
    assert (dropped <= kept).all()


def test_in_a_model_as_a_method_spec(make_model):
    """Named as ``MODULE:CLASS``: the layer keeps what ``blended_keep_mask`` says, every head its window, and
    decoding on goes through the cache as AdaKV's does."""
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
