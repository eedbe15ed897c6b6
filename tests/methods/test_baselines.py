"""
Per-baseline tests: the pure selection functions on small hand-computed tensors (derivations in the
docstrings), one paper property each, and "kept = top-scored" through recording subclasses.
"""

from __future__ import annotations

import pytest
import torch

from methods import make_policy
from methods.adakv import adaptive_keep_mask, mask_to_indices
from methods.h2o import STATE, H2OPolicy, received_attention
from methods.snapkv import SnapKVPolicy, pool1d, window_vote
from methods.streaming_llm import StreamingLLMPolicy
from nanollm import KVCache, LayerKV, Transformer, decode_step, extend, prefill, preset
from nanollm.attention import attend
from nanollm.policy import select_topk
from tests.held import held
from tests.methods.hand import hand_ctx


def streaming_llm_keep(pos, seen, budget, n_sink):
    """StreamingLLM's rule on hand-made positions: its rank (protected +inf), then each head's top budget."""
    return select_topk(StreamingLLMPolicy(budget, n_sink).rank(pos.float(), pos, seen), budget)


def h2o_keep(scores, pos, seen, budget, n_recent):
    return select_topk(H2OPolicy(budget, n_recent).rank(scores, pos, seen), budget)


def snapkv_keep(scores, pos, seen, budget, window):
    return select_topk(SnapKVPolicy(budget, window).rank(scores, pos, seen), budget)


@pytest.fixture(scope="module")
def tiny(make_model) -> Transformer:
    """GQA (4 query heads, 2 KV heads), weights scaled so attention is peaked (not decided by ties)."""
    return make_model(preset("TINY"), seed=0)


def prompt(n: int, seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------
# StreamingLLM

def sinks_and_recent(T: int, budget: int, n_sink: int) -> list[int]:
    """StreamingLLM's kept slots of one head, by hand: [0..S-1] ∪ [T-R..T-1], S = min(n_sink, budget - 1)."""
    if T <= budget:
        return list(range(T))
    S = min(n_sink, budget - 1)
    return list(range(S)) + list(range(T - (budget - S), T))


def test_streaming_llm_keep_hand():
    """keep = [0..S-1] ∪ [T-R..T-1]; if budget <= n_sink the sinks shrink so the newest token fits."""
    def keep(T, budget, n_sink):
        return streaming_llm_keep(torch.arange(T).view(1, 1, T), T, budget, n_sink).flatten().tolist()
    assert keep(10, 6, 4) == [0, 1, 2, 3, 8, 9]    # S=4, R=2
    assert keep(10, 3, 4) == [0, 1, 9]             # S=2, R=1
    assert keep(10, 1, 4) == [9]                   # S=0, R=1
    assert keep(10, 5, 0) == [5, 6, 7, 8, 9]       # pure sliding window
    assert keep(5, 6, 4) == [0, 1, 2, 3, 4]        # within budget: all


def test_streaming_llm_keeps_sinks_and_recent(tiny):
    policy = StreamingLLMPolicy(budget=10, n_sink=4)
    cache = KVCache(tiny.config, policy)
    prefill(tiny, prompt(30), cache)
    for step in range(3):
        expected = [0, 1, 2, 3] + list(range(cache.seen - 6, cache.seen))
        for layer in cache.layers:
            assert held(layer.pos) == [[expected] * 2] * 2, f"step {step}: {layer.pos[0, 0].tolist()}"
        decode_step(tiny, prompt(1, seed=step)[:, 0], cache)


def test_streaming_llm_rejects_bad_options():
    with pytest.raises(ValueError, match="n_sink"):
        StreamingLLMPolicy(budget=8, n_sink=-1)


# ---------------------------------------------------------------------------------------------------------
# H2O

def test_h2o_keep_hand():
    """scores [5, 1, 3, .5, 2, .1], budget 4, n_recent 2: recent = slots 4, 5; heavy = top 2 of slots
    0..3 = slot 0 (5) and slot 2 (3)."""
    scores, pos = torch.tensor([5.0, 1.0, 3.0, 0.5, 2.0, 0.1]).view(1, 1, 6), torch.arange(6).view(1, 1, 6)
    assert h2o_keep(scores, pos, 6, budget=4, n_recent=2).tolist() == [[[0, 2, 4, 5]]]
    assert h2o_keep(scores, pos, 6, budget=4, n_recent=0).tolist() == [[[0, 1, 2, 4]]]   # heavy only
    assert h2o_keep(scores, pos, 6, budget=4, n_recent=4).tolist() == [[[2, 3, 4, 5]]]   # sliding window


def test_h2o_prefill_then_decode_hand():
    """Prefill, 4 tokens, one head, causal attention rows:
        [1, 0, 0, 0], [.5, .5, 0, 0], [.2, .2, .6, 0], [.1, .3, .2, .4]
    column sums = [1.8, 1.0, 0.8, 0.4] (they add up to 4 queries). budget 3, n_recent 1: keep slot 3
    (recent) + top 2 of slots 0..2 = positions [0, 1, 3], scores [1.8, 1.0, 0.4].
    Decode, token at position 4 with attention [0, 0, .9, .1] over positions [0, 1, 3, 4]:
    scores [1.8, 1.0, 1.3, 0.1]; keep position 4 (recent) + top 2 of the others = positions [0, 3, 4]
    with scores [1.8, 1.3, 0.1]: position 3 overtook position 1 by attention received while decoding."""
    probs = torch.tensor([[1, 0, 0, 0], [.5, .5, 0, 0], [.2, .2, .6, 0], [.1, .3, .2, .4]]).view(1, 1, 4, 4)
    policy = H2OPolicy(budget=3, n_recent=1)
    ctx = hand_ctx(probs)
    policy.on_prefill(ctx)
    assert ctx.kv.pos.tolist() == [[[0, 1, 3]]]
    torch.testing.assert_close(ctx.kv.state[STATE], torch.tensor([[[1.8, 1.0, 0.4]]]))
    ctx.kv.append(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2), torch.tensor([4]))
    policy.on_decode(hand_ctx(torch.tensor([0, 0, .9, .1]).view(1, 1, 1, 4), kv=ctx.kv, seen=5))
    assert ctx.kv.pos.tolist() == [[[0, -1, 3, 4]]]          # position 1's slot emptied in place, nothing moved
    held_slots = ctx.kv.pos >= 0
    torch.testing.assert_close(ctx.kv.state[STATE][held_slots], torch.tensor([1.8, 1.3, 0.1]))
    ctx.kv.append(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2), torch.tensor([5]))
    assert ctx.kv.pos.tolist() == [[[0, 5, 3, 4]]] and ctx.kv.state[STATE][0, 0, 1] == 0   # the next token: there


def test_received_attention_averages_gqa_group():
    """2 query heads share 1 KV head: head 0 gives token 0 all its mass, head 1 token 1 -> [.5, .5]."""
    probs = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 2, 1, 2)
    torch.testing.assert_close(received_attention(probs.sum(2), n_kv_head=1), torch.tensor([[[0.5, 0.5]]]))


def test_h2o_scores_sum_to_number_of_queries(tiny):
    """Un-normalised, group-averaged: every query adds 1 to each KV head's scores (before eviction)."""
    policy = H2OPolicy(budget=64)
    cache = KVCache(tiny.config, policy)
    prefill(tiny, prompt(20), cache)
    for layer in range(tiny.config.n_layer):
        torch.testing.assert_close(cache.layers[layer].state[STATE].sum(-1), torch.full((2, 2), 20.0))
    extend(tiny, prompt(3, seed=1), cache)
    for layer in range(tiny.config.n_layer):
        torch.testing.assert_close(cache.layers[layer].state[STATE].sum(-1), torch.full((2, 2), 23.0))


def assert_same_kept(model, policy_a, policy_b, n_prompt: int) -> None:
    """Prefill, one decode step, a 4-token extend: both policies keep the same positions in every layer."""
    caches = [KVCache(model.config, policy_a), KVCache(model.config, policy_b)]
    for cache in caches:
        prefill(model, prompt(n_prompt), cache)
        decode_step(model, prompt(1, seed=1)[:, 0], cache)
        extend(model, prompt(4, seed=2), cache)
    for a, b in zip(*[c.layers for c in caches]):
        assert held(a.pos) == held(b.pos)


def test_h2o_all_recent_equals_sliding_window(tiny):
    """With no heavy hitters H2O is a pure sliding window (StreamingLLM without sinks)."""
    assert_same_kept(tiny, H2OPolicy(budget=8, n_recent=8), StreamingLLMPolicy(budget=8, n_sink=0), 24)


class RecordingH2O(H2OPolicy):
    """H2O that checks, at every eviction, that what it kept outscored what it dropped."""

    def select(self, ctx):
        scores, pos = ctx.kv.state[STATE], ctx.kv.pos                               # (B, H_kv, T)
        idx = super().select(ctx)
        new_pos = pos.gather(-1, idx)
        old = pos[..., : pos.shape[-1] - self.n_recent]                             # non-recent slots
        s_old = scores[..., : pos.shape[-1] - self.n_recent]
        kept = (old[..., :, None] == new_pos[..., None, :]).any(-1)                 # (B, H_kv, T - r)
        assert int(kept.sum(-1).min()) == self.budget - self.n_recent
        lowest_kept = s_old.masked_fill(~kept, float("inf")).min(-1).values
        highest_dropped = s_old.masked_fill(kept, float("-inf")).max(-1).values
        assert bool((lowest_kept >= highest_dropped).all())
        self.evictions = getattr(self, "evictions", 0) + 1
        return idx

    def evict(self, ctx):                   # a decode step: the slots emptied held the lowest non-recent scores
        scores, pos = ctx.kv.state[STATE], ctx.kv.pos                               # (B, H_kv, T)
        idx = super().evict(ctx)
        dropped = torch.zeros_like(pos, dtype=torch.bool).scatter(-1, idx, True)
        others = (pos >= 0) & (pos < ctx.seen - self.n_recent)                      # held, not recent
        assert not bool((dropped & ~others).any()), "a recent entry or an empty slot was evicted"
        lowest_kept = scores.masked_fill(~others | dropped, float("inf")).min(-1).values
        highest_dropped = scores.masked_fill(~dropped, float("-inf")).max(-1).values
        assert bool((lowest_kept >= highest_dropped).all())
        self.evictions = getattr(self, "evictions", 0) + 1
        return idx


def test_h2o_keeps_top_scored(tiny):
    policy = RecordingH2O(budget=10, n_recent=3)
    cache = KVCache(tiny.config, policy)
    prefill(tiny, prompt(30), cache)
    decode_step(tiny, prompt(1, seed=1)[:, 0], cache)
    extend(tiny, prompt(5, seed=2), cache)
    assert policy.evictions == 3 * tiny.config.n_layer
    for layer in range(tiny.config.n_layer):    # scores stay aligned with the storage
        assert cache.layers[layer].state[STATE].shape == cache.layers[layer].pos.shape


def test_h2o_rejects_bad_options():
    with pytest.raises(ValueError, match="n_recent"):
        H2OPolicy(budget=8, n_recent=9)
    with pytest.raises(ValueError, match="n_recent"):
        H2OPolicy(budget=8, n_recent=-1)


# ---------------------------------------------------------------------------------------------------------
# SnapKV

# A 10-token prompt, window w = 2 (queries 8 and 9). Their attention over the 8 prefix tokens:
#   row 8: [0, .5, 0, 0, .1, 0, 0, 0]  (+ .4 on token 8)
#   row 9: [0, .4, 0, 0, 0, 0, .5, 0]  (+ .05 on tokens 8, 9)
#   vote = [0, .9, 0, 0, .1, 0, .5, 0]
def ten_token_probs() -> torch.Tensor:
    probs = torch.tril(torch.ones(10, 10))
    probs = probs / probs.sum(-1, keepdim=True)                     # rows 0..7: uniform causal (unused)
    probs[8] = torch.tensor([0, .5, 0, 0, .1, 0, 0, 0, .4, 0])
    probs[9] = torch.tensor([0, .4, 0, 0, 0, 0, .5, 0, .05, .05])
    return probs.view(1, 1, 10, 10)


def test_pool1d_hand():
    vote = torch.tensor([0, .9, 0, 0, .1, 0, .5, 0])
    torch.testing.assert_close(pool1d(vote, 1, "max"), vote)
    torch.testing.assert_close(pool1d(vote, 3, "max"), torch.tensor([.9, .9, .9, .1, .1, .5, .5, .5]))
    # avg counts the zero padding: the edges are divided by 3 too
    torch.testing.assert_close(pool1d(vote, 3, "avg"), torch.tensor([.9, .9, .9, .1, .1, .6, .5, .5]) / 3)


@pytest.mark.parametrize("kernel,pooling,budget,expected", [
    (1, "max", 5, [1, 4, 6, 8, 9]),      # top 3 of the raw vote: .9 (1), .5 (6), .1 (4)
    (3, "max", 5, [0, 1, 2, 8, 9]),      # max-pooled [.9, .9, .9, .1, .1, .5, .5, .5]: the cluster at 1
    (3, "avg", 6, [0, 1, 2, 5, 8, 9]),   # avg-pooled [.3, .3, .3, .03, .03, .2, .17, .17]: top 4
    (3, "max", 2, [8, 9]),               # budget <= window: the window only
    (3, "max", 1, [9]),                  # budget < window: its last `budget` tokens
])
def test_snapkv_kept_set_ten_tokens(kernel, pooling, budget, expected):
    ctx = hand_ctx(ten_token_probs())
    SnapKVPolicy(budget=budget, window=2, kernel=kernel, pooling=pooling).on_prefill(ctx)
    assert ctx.kv.pos.tolist() == [[expected]]


def test_snapkv_within_budget_is_untouched():
    ctx = hand_ctx(ten_token_probs())
    k = ctx.kv.k
    SnapKVPolicy(budget=10, window=2, kernel=3).on_prefill(ctx)
    assert ctx.kv.k.data_ptr() == k.data_ptr() and len(ctx.kv) == 10  # within budget: no gather, no reorder


def test_window_vote_gqa_mean():
    """Two query heads of one KV head vote for different tokens; the KV head gets the mean."""
    probs = torch.zeros(1, 2, 2, 4)
    probs[0, 0, :, 1] = 0.5                                         # head 0: token 1 (vote 1.0)
    probs[0, 1, :, 3] = 1.0                                         # head 1: token 3 (vote 2.0)
    scores = window_vote(probs, n_kv_head=1, kernel=1, pooling="max")
    torch.testing.assert_close(scores, torch.tensor([[[0.0, 0.5, 0.0, 1.0]]]))
    with_window = torch.cat([scores, torch.zeros(1, 1, 2)], dim=-1)      # slots 4, 5: the window, kept anyway
    assert snapkv_keep(with_window, torch.arange(6).view(1, 1, 6), 6, budget=4, window=2).tolist() == [[[1, 3, 4, 5]]]


class RecordingSnapKV(SnapKVPolicy):
    def score(self, ctx):
        scores = super().score(ctx)
        self.recorded = getattr(self, "recorded", []) + [scores[..., :len(ctx.kv) - self.window]]   # prefix
        return scores


def test_snapkv_keeps_top_scored(tiny):
    policy = RecordingSnapKV(budget=12, window=4, kernel=3)
    cache = KVCache(tiny.config, policy)
    prefill(tiny, prompt(30), cache)
    for scores, layer in zip(policy.recorded, cache.layers):        # scores (B, H_kv, 26)
        kept = torch.zeros(*scores.shape[:2], 27, dtype=torch.bool)   # prefix slots 0..25, + 1 for the window
        kept = kept.scatter(-1, layer.pos.clamp(max=26), True)[..., :26]
        assert (kept.sum(-1) == 8).all()                            # budget - window
        assert bool((scores.masked_fill(~kept, float("inf")).min(-1).values
                     >= scores.masked_fill(kept, float("-inf")).max(-1).values).all())
        assert (layer.pos[..., -4:] == torch.arange(26, 30)).all()  # the window is kept


def test_snapkv_rejects_bad_options():
    for bad in [{"kernel": 4}, {"kernel": 0}, {"pooling": "mean"}, {"window": 0}]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            SnapKVPolicy(budget=8, **bad)


# ---------------------------------------------------------------------------------------------------------
# AdaKV

def test_adaptive_keep_mask_hand():
    """Two heads, 6 slots, budget 3 (the layer keeps 6), safeguard n_safe = 1.
    head 0: [.9, .8, .7, .6, .5, .4] (attention spread out), head 1: [.05, .01, .02, .03, .04, .10].
    Safeguard: head 0 slot 0, head 1 slot 5 -> +inf. The 4 remaining global picks are all head 0's
    (.8, .7, .6, .5 beat .05): head 0 keeps 5, head 1 keeps 1; total 6 = H_kv * budget."""
    scores = torch.tensor([[.9, .8, .7, .6, .5, .4], [.05, .01, .02, .03, .04, .10]]).view(1, 2, 6)
    mask = adaptive_keep_mask(scores, budget=3, n_safe=1)
    assert mask.int().tolist() == [[[1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]]]
    assert mask_to_indices(mask).tolist() == [[[0, 1, 2, 3, 4], [5, -1, -1, -1, -1]]]
    # n_safe = budget: every head keeps exactly its own top 3 (uniform budgets, i.e. SnapKV)
    mask = adaptive_keep_mask(scores, budget=3, n_safe=3)
    assert mask.int().tolist() == [[[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 1, 1]]]


def test_nan_counts_as_minus_infinity_in_both_selections():
    """NaN ties with -inf, as both docstrings say (the earlier slot wins), and +inf stays above every finite
    score: ``nan_to_num``'s defaults turn -inf into the lowest float and +inf into the largest, which ranked a
    -inf above a NaN (a reader's correct AdaKV lost the hidden test that meant to check the tie)."""
    nan, inf = float("nan"), float("inf")
    assert select_topk(torch.tensor([[[nan, -inf, -inf]]]), 1).tolist() == [[[0]]]
    assert select_topk(torch.tensor([[[-inf, nan, -3.0e38]]]), 1).tolist() == [[[2]]]
    assert adaptive_keep_mask(torch.tensor([[[nan, -inf]]]), 1, 0).tolist() == [[[True, False]]]
    assert adaptive_keep_mask(torch.tensor([[[-inf, nan]], [[-3.0e38, nan]]]), 1, 0).tolist() == \
        [[[True, False]], [[True, False]]]
    # a safeguarded entry ranks before a protected (+inf) one: head 1's best is kept over head 0's second +inf
    assert adaptive_keep_mask(torch.tensor([[[inf, inf, 0.0], [0.5, 0.1, 0.2]]]), 1, 1).tolist() == \
        [[[True, False, False], [True, False, False]]]


def test_adakv_budget_split(tiny):
    """After prefill: layer total = H_kv * budget; every head >= max(n_safe, window); <= budget + head_slack."""
    policy = make_policy("adakv", 12, window=4, kernel=3, alpha_safeguard=0.5)   # n_safe = 6
    cache = KVCache(tiny.config, policy)
    prefill(tiny, prompt(40), cache)
    H_kv = tiny.config.n_kv_head
    for layer in cache.layers:
        counts = layer.counts()                                      # (B, H_kv)
        assert (counts.sum(-1) == H_kv * 12).all()
        assert int(counts.min()) >= 6 and int(counts.max()) <= 12 + policy.head_slack(H_kv)
        for b in range(2):
            for h in range(H_kv):
                assert set(range(36, 40)) <= set(layer.pos[b, h].tolist())   # the window, every head


def test_adakv_safeguard_counts_the_window_as_kvpress_does():
    """The safeguard's floor(alpha * budget) entries count SnapKV's window (+inf), as kvpress's AdaKVPress counts
    them (the window at the top score): a window of 4 fills a safeguard of 3 (budget 12, alpha 0.25), so the
    weak head keeps what it keeps with no safeguard, its window alone; a safeguard of 6 (alpha 0.5) gives it 2
    of its own best past the window."""
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([[1.0], [0.5], [0.1], [0.01]])              # the last head loses the pool to the others
    scores = (torch.rand(4, 30, generator=g) * scale)[None]
    scores[..., -4:] = float("inf")                                  # SnapKV protects its window
    masks = {alpha: adaptive_keep_mask(scores, 12, make_policy("adakv", 12, window=4, alpha_safeguard=alpha).n_safe)
             for alpha in (0.0, 0.25, 0.5)}
    assert torch.equal(masks[0.25], masks[0.0])
    assert masks[0.0][0, 3].sum() == 4 and masks[0.5][0, 3].sum() == 6
    best = torch.sort(scores[0, 3, :-4], descending=True).indices[:2]
    assert masks[0.5][0, 3, best].all()


def test_adakv_head_budgets_are_what_it_keeps(tiny):
    """The allocation a wrapper can read (``head_budgets``) is exactly what AdaKV's selection keeps per head;
    a plain scorer's allocation is uniform."""

    class Record(type(make_policy("adakv", 12))):
        def select(self, ctx):
            self.budgets = self.__dict__.get("budgets", []) + [self.head_budgets(ctx)]
            uniform = self.inner.head_budgets(ctx)
            assert bool((uniform == self.budget).all())
            return super().select(ctx)

    policy = Record(budget=12, inner=SnapKVPolicy(budget=12, window=4, kernel=3))
    cache = KVCache(tiny.config, policy)
    prefill(tiny, prompt(40), cache)
    for budgets, layer in zip(policy.budgets, cache.layers):
        assert torch.equal(budgets, layer.counts())
        assert bool((budgets.sum(-1) == 12 * tiny.config.n_kv_head).all())


def test_adakv_alpha_one_is_snapkv(tiny):
    opts = {"budget": 10, "window": 4, "kernel": 3}
    caches = [KVCache(tiny.config, make_policy("adakv", alpha_safeguard=1.0, **opts)),
              KVCache(tiny.config, SnapKVPolicy(**opts))]
    for cache in caches:
        prefill(tiny, prompt(30), cache)
    for a, b in zip(*[c.layers for c in caches]):
        assert torch.equal(a.pos, b.pos)


@pytest.mark.parametrize("scorer", ["streaming_llm", "h2o", "snapkv"])
def test_adakv_alpha_one_is_its_inner_scorer(tiny, scorer):
    """With the safeguard covering the whole budget, every head keeps exactly its own top ``budget``: the
    wrapper selects what the scorer alone selects, at prefill and at every decode / extend step."""
    assert_same_kept(tiny, make_policy(f"adakv({scorer})", 10, alpha_safeguard=1.0), make_policy(scorer, 10), 30)


def test_adakv_gather_equals_mask():
    """Gather == mask: attention over the padded, gathered storage == attention over everything with the evicted
    entries masked (pos = -1), which is how kvpress realises AdaKV."""
    g = torch.Generator().manual_seed(0)
    B, H, H_kv, T, d = 2, 4, 2, 16, 8
    k, v = torch.randn(B, H_kv, T, d, generator=g), torch.randn(B, H_kv, T, d, generator=g)
    q = torch.randn(B, H, 1, d, generator=g)
    mask = adaptive_keep_mask(torch.rand(B, H_kv, T, generator=g), budget=5, n_safe=1)
    gathered = LayerKV()
    gathered.append(k, v, torch.arange(T))
    gathered.keep(mask_to_indices(mask))
    masked_pos = torch.arange(T).expand(B, H_kv, T).masked_fill(~mask, -1)
    q_pos = torch.tensor([T])
    out_gather, _, _ = attend(q, gathered.k, gathered.v, q_pos, gathered.pos)
    out_mask, _, _ = attend(q, k, v, q_pos, masked_pos)
    torch.testing.assert_close(out_gather, out_mask, rtol=0, atol=1e-6)


def test_adakv_rejects_bad_options():
    for bad in [1.5, -0.1]:
        with pytest.raises(ValueError, match="alpha_safeguard"):
            make_policy("adakv", 8, alpha_safeguard=bad)
    with pytest.raises(ValueError, match="kernel"):
        make_policy("adakv", 8, kernel=2)


# ---------------------------------------------------------------------------------------------------------
# The pure rules and the scorer policies select the same entries

@pytest.mark.parametrize("T,budget,n_sink", [(10, 6, 4), (10, 3, 4), (10, 1, 4), (10, 5, 0), (30, 12, 4)])
def test_streaming_llm_policy_equals_rule(T, budget, n_sink):
    ctx = hand_ctx(torch.full((1, 2, T, T), 1.0 / T), n_kv_head=2)
    StreamingLLMPolicy(budget=budget, n_sink=n_sink).on_prefill(ctx)
    assert ctx.kv.pos.tolist() == [[sinks_and_recent(T, budget, n_sink)] * 2]


@pytest.mark.parametrize("budget,n_recent", [(4, 2), (4, 0), (4, 4), (9, 3)])
def test_h2o_policy_equals_rule(budget, n_recent):
    probs = torch.softmax(torch.randn(1, 2, 12, 12, generator=torch.Generator().manual_seed(budget)), -1)
    probs = probs * torch.tril(torch.ones(12, 12))
    probs = probs / probs.sum(-1, keepdim=True)                       # causal rows
    ctx = hand_ctx(probs, n_kv_head=2)
    expected = h2o_keep(received_attention(probs.sum(2), 2), torch.arange(12).expand(1, 2, 12), 12, budget, n_recent)
    H2OPolicy(budget=budget, n_recent=n_recent).on_prefill(ctx)
    assert torch.equal(ctx.kv.pos, expected)


@pytest.mark.parametrize("kernel,pooling,budget", [(1, "max", 5), (3, "max", 5), (3, "avg", 6), (3, "max", 4)])
def test_snapkv_policy_equals_rule(kernel, pooling, budget):
    probs = ten_token_probs()
    ctx = hand_ctx(probs)
    top = select_topk(window_vote(probs[:, :, 8:, :8], 1, kernel, pooling), budget - 2)   # the prefix's best
    expected = torch.cat([top, torch.tensor([[[8, 9]]])], dim=-1)                       # then the window
    SnapKVPolicy(budget=budget, window=2, kernel=kernel, pooling=pooling).on_prefill(ctx)
    assert torch.equal(ctx.kv.pos, expected)
