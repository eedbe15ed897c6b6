"""Scissorhands: the counters and the drop rule by hand, the oracle case, the counter and recent-window
invariants on a model, the hypothesis measurements, and the theory (bound, Monte Carlo, single-head model)."""

from __future__ import annotations

import math

import pytest
import torch

from experiments.analysis.persistence import (
    AttentionRecorder,
    block_cosine,
    heavy,
    persistence_by_layer,
    persistence_halves,
    persistence_step,
    record_attention,
)
from experiments.analysis.scissorhands_theory import (
    dropped_mass,
    dropped_mass_bound,
    failure_probability,
    fit_power_law,
    intermediate_dropped_mass_bound,
    make_toy_model,
    power_law_mean_factor,
    run_toy,
    sample_power_law,
    simulate_dropped_mass,
    theorem41_bound,
)
from methods import make_policy
from methods.scissorhands import (
    ATTN,
    COUNT,
    LOW,
    ScissorhandsPolicy,
    group_mean,
    keep_score,
    low_flags,
    n_dropped,
    push_history,
    scissorhands_keep,
    unimportance,
)
from nanollm import KVCache, LayerKV, StepContext, decode_step, extend, prefill, preset
from tests.methods.hand import hand_ctx


@pytest.fixture(scope="module")
def tiny(make_model):
    """GQA (4 query heads, 2 KV heads), weights scaled so attention is peaked (not decided by ties)."""
    return make_model(preset("TINY"), seed=0)


def prompt(n: int, seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


def t(values, *shape) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(*shape)


# ---------------------------------------------------------------------------------------------------------
# The rule by hand

def test_low_flags_hand():
    """One query over 4 tokens, attention [.5, .1, .3, .1]: tau = 1/4, so tokens 1 and 3 are low. A token
    the query did not attend (not visible) is never low, and tau counts only the visible ones."""
    attn = t([.5, .1, .3, .1], 1, 1, 1, 4)
    visible = torch.ones(1, 1, 1, 4, dtype=torch.bool)
    assert low_flags(attn, visible).int().flatten().tolist() == [0, 1, 0, 1]
    assert low_flags(attn, visible, threshold=0.35).int().flatten().tolist() == [0, 1, 1, 1]
    # token 3 not attended: tau = 1/3, and .3 < 1/3 is now low too; token 3 never
    visible[..., 3] = False
    assert low_flags(attn, visible).int().flatten().tolist() == [0, 1, 1, 0]


def test_group_mean_gqa():
    """Two query heads of one KV head: token 0 gets .9 / .1 (mean .5), token 1 .1 / .9. A token low for one
    head of the group is not low for the KV head if the group's mean is above tau."""
    probs = t([.9, .1, .1, .9], 1, 2, 1, 2)
    attn = group_mean(probs, n_kv_head=1)
    torch.testing.assert_close(attn, t([.5, .5], 1, 1, 1, 2))
    assert not low_flags(attn, torch.ones(1, 1, 1, 2, dtype=torch.bool)).any()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_group_mean_rounds_as_one_division_on_every_device(device):
    """Three query heads giving each of 19 tokens exactly 1/19: their mean is the sum divided by 3, which
    rounds an ulp below 1/19 (every token low) on every device. CUDA's ``mean``, and CUDA's division by a
    Python number, multiply by 1/3 and get 1/19 (no token low): the lean step would flag otherwise than the
    graph step and the kernel there."""
    probs = torch.full((1, 3, 1, 19), 1 / 19, device=device)
    attn = group_mean(probs, n_kv_head=1)
    assert torch.equal(attn.cpu(), probs.cpu().sum(1, keepdim=True) / 3)      # a CPU divides by a number
    assert low_flags(attn, torch.ones_like(attn, dtype=torch.bool)).all()


def test_history_is_a_sliding_window_of_w_queries():
    """w = 3, 2 tokens. Flags of token 0 at queries 4, 5, 6, 7: low, low, high, low; token 1: high, low,
    low, low. Query q writes column q % 3, so query 7 overwrites query 4: the counter covers 5, 6, 7:
    token 0 -> 1 + 0 + 1 = 2, token 1 -> 3."""
    history = torch.zeros(1, 1, 2, 3, dtype=torch.bool)
    flags = {4: [1, 0], 5: [1, 1], 6: [0, 1], 7: [1, 1]}
    for q, f in flags.items():
        push_history(history, torch.tensor(f, dtype=torch.bool).view(1, 1, 1, 2), torch.tensor([q]))
    assert unimportance(history).flatten().tolist() == [2, 3]
    # a chunk of 4 queries at once (an extend step) keeps only its last 3 rows: the same counters
    chunk = torch.zeros(1, 1, 2, 3, dtype=torch.bool)
    push_history(chunk, torch.tensor(list(flags.values()), dtype=torch.bool).view(1, 1, 4, 2), torch.arange(4, 8))
    assert torch.equal(chunk, history)


def test_keep_score_is_lexicographic():
    """counters [2, 0, 2, 1], last attention [.1, .05, .3, .2]: keep order slot 1 (I = 0), slot 3 (I = 1),
    slot 2 (I = 2, attention .3), slot 0 (I = 2, .1). An empty slot (pos -1) scores -inf."""
    counts = torch.tensor([2, 0, 2, 1]).view(1, 1, 4)
    attn = t([.1, .05, .3, .2], 1, 1, 4)
    score = keep_score(counts, attn, torch.arange(4).view(1, 1, 4))
    assert torch.argsort(score.flatten(), descending=True).tolist() == [1, 3, 2, 0]
    # a counter always outranks attention: 1 low flag with attention .99 loses to 0 flags with .0
    score = keep_score(torch.tensor([1, 0]).view(1, 1, 2), t([.99, 0.], 1, 1, 2), torch.arange(2).view(1, 1, 2))
    assert score[0, 0, 1] > score[0, 0, 0]
    score = keep_score(counts, attn, torch.tensor([0, 1, -1, 3]).view(1, 1, 4))
    assert score[0, 0, 2] == float("-inf")


@pytest.mark.parametrize("n_slots,budget,drop,n_recent,expected", [
    (8, 8, 1, 0, 0),        # within budget: nothing
    (10, 8, 1, 0, 2),       # m = 1: exactly back to B
    (10, 8, 3, 0, 3),       # m = 3: one compression of 3 (the cache holds B - 1 = 7)
    (13, 8, 4, 0, 8),       # 5 too many: two compressions of 4
    (10, 8, 4, 6, 2),       # m cut to B - r = 2
])
def test_n_dropped_hand(n_slots, budget, drop, n_recent, expected):
    assert n_dropped(n_slots, budget, drop, n_recent) == expected


def test_scissorhands_keep_hand():
    """6 tokens (positions 0..5, seen 6), B = 4, r = 1: counters [3, 0, 3, 1, 2, 0], last attention
    [.1, .3, .2, .1, .2, .1]. Two must go (m = 1): slot 5 is recent; the largest counters are slots 0 and 2
    (3 each). With m = 3 three go: slot 4 (I = 2) too. With r = 3 slots 3, 4, 5 are safe and m = 3 is cut
    to B - r = 1: drop 2 -> slots 0, 2 again."""
    counts = torch.tensor([3, 0, 3, 1, 2, 0]).view(1, 1, 6)
    attn = t([.1, .3, .2, .1, .2, .1], 1, 1, 6)
    pos = torch.arange(6).view(1, 1, 6)
    assert scissorhands_keep(counts, attn, pos, 6, budget=4, drop=1, n_recent=1).flatten().tolist() == [1, 3, 4, 5]
    assert scissorhands_keep(counts, attn, pos, 6, budget=4, drop=3, n_recent=1).flatten().tolist() == [1, 3, 5]
    assert scissorhands_keep(counts, attn, pos, 6, budget=4, drop=3, n_recent=3).flatten().tolist() == [1, 3, 4, 5]
    # a tie on the counter goes to the attention: counters all 1, slot 2 has the lowest attention
    ones = torch.ones(1, 1, 6, dtype=torch.long)
    assert scissorhands_keep(ones, t([.2, .3, .01, .2, .2, .1], 1, 1, 6), pos, 6, budget=5).flatten().tolist() \
        == [0, 1, 3, 4, 5]


@pytest.mark.parametrize("budget,w,r,m", [(4, 3, 1, 1), (4, 12, 0, 1), (6, 5, 2, 3), (3, 1, 0, 1)])
def test_policy_equals_rule(budget, w, r, m):
    """Prefill of 12 tokens (causal rows): the policy keeps what the pure rule computes from the counters of
    the last w rows."""
    g = torch.Generator().manual_seed(budget * 7 + w)
    probs = torch.softmax(torch.randn(1, 2, 12, 12, generator=g) * 3, -1) * torch.tril(torch.ones(12, 12))
    probs = probs / probs.sum(-1, keepdim=True)
    attn = group_mean(probs, 1)                                               # (1, 1, 12, 12)
    visible = torch.tril(torch.ones(12, 12, dtype=torch.bool)).view(1, 1, 12, 12)
    counts = low_flags(attn, visible)[:, :, -w:].sum(2)                        # the last w rows, by hand
    expected = scissorhands_keep(counts, attn[:, :, -1], torch.arange(12).view(1, 1, 12), 12, budget, m, r)
    ctx = hand_ctx(probs)
    ScissorhandsPolicy(budget=budget, history_window=w, n_recent=r, drop=m).on_prefill(ctx)
    assert torch.equal(ctx.kv.pos, expected)
    assert torch.equal(unimportance(ctx.kv.state[LOW]), counts.gather(-1, expected))   # moved with the entries


# ---------------------------------------------------------------------------------------------------------
# The policy on a model

class RecordingScissorhands(ScissorhandsPolicy):
    """Records, at every compression, the positions before and after and the step's last-query attention."""

    def select(self, ctx):
        before = ctx.kv.pos.clone()
        attn = group_mean(ctx.probs, ctx.kv.pos.shape[1])[:, :, -1]              # (B, H_kv, T)
        idx = super().select(ctx)
        self.events = getattr(self, "events", []) + [(ctx.phase, before, attn, before.gather(-1, idx))]
        return idx

    def evict(self, ctx):                                   # a decode step: the slots idx are emptied in place
        before = ctx.kv.pos.clone()
        attn = group_mean(ctx.probs, ctx.kv.pos.shape[1])[:, :, -1]              # (B, H_kv, T)
        idx = super().evict(ctx)
        after = before.scatter(-1, idx, -1)
        self.events = getattr(self, "events", []) + [(ctx.phase, before, attn, after[after >= 0]
                                                      .view(*after.shape[:2], -1))]
        return idx


def test_decode_eviction_is_the_one_compaction_drops_nan_attention_included():
    """A one-token drop in place (``evict``) empties the slot ``select`` leaves out: the most low flags, then
    the least attention (NaN ranked last), then the latest position, never a recent one. Here the two slots
    with the most flags both have NaN attention: one of them still goes (the later), not a finite one."""
    store = LayerKV()
    store.append(torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2), torch.arange(5))
    store.set_state(COUNT, torch.tensor([[[3, 3, 1, 0, 0]]], dtype=torch.int32), fill=0)
    store.set_state(ATTN, torch.tensor([[[float("nan"), float("nan"), 0.1, 0.2, 0.3]]]), fill=0.0)
    policy = ScissorhandsPolicy(budget=4, n_recent=1)
    ctx = StepContext(layer=0, phase="decode", q=torch.zeros(1, 1, 1, 2), q_pos=torch.tensor([4]), probs=None,
                      out=torch.zeros(1, 1, 1, 2), kv=store, attn=None, config=None, seen=5)
    kept = policy.select(ctx)[0, 0].tolist()
    assert policy.evict(ctx)[0, 0].tolist() == [1] and kept == [0, 2, 3, 4]
    store.state[ATTN].copy_(torch.tensor([[[float("nan"), 0.5, 0.1, 0.2, 0.3]]]))   # NaN beside a number
    assert policy.evict(ctx)[0, 0].tolist() == [1] and policy.select(ctx)[0, 0].tolist() == [0, 2, 3, 4]


def test_w1_r0_m1_evicts_the_smallest_current_attention(tiny):
    """w = 1, r = 0, m = 1: at every decode step the one token dropped is the one the step attended least
    (the oracle of Theorem 4.1's proof)."""
    policy = RecordingScissorhands(budget=10, history_window=1, n_recent=0, drop=1)
    cache = KVCache(tiny.config, policy)
    prefill(tiny, prompt(10), cache)                                          # exactly the budget: no drop
    for step in range(6):
        decode_step(tiny, prompt(1, seed=step + 1)[:, 0], cache)
    decode_events = [e for e in policy.events if e[0] == "decode"]
    assert len(decode_events) == 6 * tiny.config.n_layer
    for _, before, attn, after in decode_events:
        assert after.shape[-1] == 10
        for b in range(2):
            for h in range(2):
                gone = set(before[b, h].tolist()) - set(after[b, h].tolist())
                assert gone == {int(before[b, h, attn[b, h].argmin()])}


def test_counters_stay_within_window_and_age(tiny):
    """0 <= I[j] <= min(w, seen - pos_j) after every step, through prefill, decode and extend; and the
    incrementally kept counter always equals the ring buffer's sum (flags in minus flags out)."""
    w = 5
    cache = KVCache(tiny.config, ScissorhandsPolicy(budget=12, history_window=w, n_recent=3, drop=2))

    def check():
        for layer in cache.layers:
            counts = unimportance(layer.state[LOW])
            assert torch.equal(layer.state[COUNT].long(), counts)
            age = cache.seen - layer.pos
            assert bool((counts >= 0).all()) and bool((counts <= age.clamp(max=w)).all())
            assert layer.state[LOW].shape[:3] == layer.pos.shape == layer.state[ATTN].shape

    prefill(tiny, prompt(30), cache)
    check()
    for step in range(8):
        decode_step(tiny, prompt(1, seed=step + 1)[:, 0], cache)
        check()
    extend(tiny, prompt(7, seed=20), cache)
    check()
    assert max(int(unimportance(layer.state[LOW]).max()) for layer in cache.layers) > 0   # not all zero


@pytest.mark.parametrize("drop", [1, 4])
def test_recent_tokens_are_never_dropped_and_m_at_a_time(tiny, drop):
    r, budget = 5, 12
    policy = ScissorhandsPolicy(budget=budget, n_recent=r, drop=drop)
    cache = KVCache(tiny.config, policy)
    prefill(tiny, prompt(30), cache)
    sizes = []
    for step in range(10):
        decode_step(tiny, prompt(1, seed=step + 1)[:, 0], cache)
        sizes.append(len(cache.layers[0]))
        for layer in cache.layers:
            for b in range(2):
                for h in range(2):
                    assert set(range(cache.seen - r, cache.seen)) <= set(layer.pos[b, h].tolist())
    assert max(sizes) <= budget
    if drop == 1:
        assert set(sizes) == {budget}                                         # once full, always B
    else:                                                                     # B - m + 1 .. B, by one per step
        assert min(sizes) == budget - drop + 1 and len(set(sizes)) == drop


def test_prompt_longer_than_budget_drops_to_budget_in_multiples_of_m(tiny):
    """30-token prompt, B = 12, r = 2: m = 1 keeps 12; m = 4 drops ceil(18 / 4) * 4 = 20 and keeps 10; with
    the default r = 10, m = 4 is cut to B - r = 2 and 18 go, leaving 12."""
    for drop, r, kept in [(1, 2, 12), (4, 2, 10), (4, None, 12)]:
        cache = KVCache(tiny.config, ScissorhandsPolicy(budget=12, drop=drop, n_recent=r))
        prefill(tiny, prompt(30), cache)
        assert all(len(layer) == kept for layer in cache.layers)


def test_defaults_and_bad_options():
    p = ScissorhandsPolicy(budget=128)
    assert (p.history_window, p.n_recent, p.drop, p.threshold) == (400, 10, 1, None)
    assert ScissorhandsPolicy(budget=4).n_recent == 3                        # the window fits the budget
    assert ScissorhandsPolicy(budget=1).n_recent == 0
    for bad, name in [({"history_window": 0}, "history_window"), ({"drop": 0}, "drop"),
                      ({"drop": 1.5}, "drop"), ({"n_recent": 8}, "n_recent"), ({"n_recent": -1}, "n_recent"),
                      ({"threshold": 0.0}, "threshold"), ({"threshold": 2}, "threshold")]:
        with pytest.raises(ValueError, match=name):
            make_policy("scissorhands", 8, **bad)


# ---------------------------------------------------------------------------------------------------------
# Measuring the hypothesis

def test_heavy_and_persistence_hand():
    """One head, 4 queries. Rows (query s attends tokens 0..s, uniform level 1/(s+1)):
        s=0: [1]             heavy {0}
        s=1: [.6, .4]        heavy {0}         (level .5)
        s=2: [.5, .1, .4]    heavy {0, 2}      (level 1/3)
        s=3: [.1, .5, .1, .3] heavy {1, 3}     (level .25)
    persistence_step(delta=1, start=1): s=1: {0} -> {0, 2}: 1/1; s=2: {0, 2} -> {1, 3}: 0/2. Mean .5.
    Base: s=1: 1 of 2 tokens <= 1 heavy at s=2; s=2: 1 of 3 at s=3. Mean (1/2 + 1/3) / 2.
    persistence_halves(split=2): early = heavy before query 2 among tokens 0, 1 = {0}; late = {0} ∪ {1} =
    {0, 1}; ratio 1/2, base |early| / 2 = .5, late size 2 / 2 = 1."""
    attn = torch.tensor([[1, 0, 0, 0], [.6, .4, 0, 0], [.5, .1, .4, 0], [.1, .5, .1, .3]]).view(1, 4, 4)
    hv = heavy(attn)
    assert hv[0].int().tolist() == [[1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]]
    ratio, base = persistence_step(hv, delta=1, start=1)
    torch.testing.assert_close(ratio, torch.tensor([0.5]))
    torch.testing.assert_close(base, torch.tensor([(1 / 2 + 1 / 3) / 2]))
    ratio, base, size = persistence_halves(hv, split=2)
    assert (ratio.item(), base.item(), size.item()) == (0.5, 0.5, 1.0)


def test_record_attention_is_the_model_attention(tiny):
    """Rows sum to 1 over 0..s and are causal; recorded over prefill + extend + decode steps, the matrix
    is the one a single prefill of the whole sequence records (attention with a full cache is exact)."""
    ids = prompt(20, batch=1)
    maps = record_attention(tiny, ids)
    assert len(maps) == tiny.config.n_layer and maps[0].shape == (tiny.config.n_head, 20, 20)
    torch.testing.assert_close(maps[1].sum(-1), torch.ones(tiny.config.n_head, 20))
    assert bool((maps[1].triu(1) == 0).all())
    recorder = AttentionRecorder()
    cache = KVCache(tiny.config, recorder)
    prefill(tiny, ids[:, :15], cache)
    extend(tiny, ids[:, 15:18], cache)
    for i in (18, 19):
        decode_step(tiny, ids[:, i], cache)
    for layer in range(tiny.config.n_layer):
        torch.testing.assert_close(recorder.matrix(layer), maps[layer], atol=1e-5, rtol=0)


def test_persistence_by_layer_is_the_mean_of_the_measurements_over_heads_then_prompts(tiny):
    """The table's every column is the measurement of one layer averaged over its query heads (checked by hand
    for both layers at level 1 and 2), and two prompts give the mean of their two tables."""
    a, b = prompt(70, seed=1, batch=1)[0].tolist(), prompt(70, seed=2, batch=1)[0].tolist()
    one = persistence_by_layer(tiny, [a], levels=(1, 2), start=4)
    assert set(one) == {1, 2} and one[1].shape == (tiny.config.n_layer, 7)
    maps = record_attention(tiny, torch.tensor([a]))
    for level in (1, 2):
        for layer, attn in enumerate(maps):
            hv = heavy(attn, level)
            r50, b50 = persistence_step(hv, 50, start=4)
            rh, bh, _ = persistence_halves(hv, 35)
            share = (hv.sum(-1) / torch.arange(1, 71))[:, 4:].mean(-1)
            want = torch.stack([*persistence_step(hv, 1, start=4), r50, b50, rh, bh, share]).mean(-1)
            torch.testing.assert_close(one[level][layer], want)
    two = persistence_by_layer(tiny, [a, b], levels=(1,), start=4)
    torch.testing.assert_close(two[1], (one[1] + persistence_by_layer(tiny, [b], levels=(1,), start=4)[1]) / 2)


def test_block_cosine_is_one_without_an_mlp(make_model):
    """With the MLP's output projection zeroed, F(h) = h: cosine 1 and equal norms; otherwise below 1."""
    model = make_model(preset("TINY"), seed=0)
    ids = prompt(16, batch=1)
    before = block_cosine(model, ids)
    assert all(-1 <= r["cos_mlp"] < 1 - 1e-4 for r in before)
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.down_proj.weight.zero_()
    for r in block_cosine(model, ids):
        assert r["cos_mlp"] == pytest.approx(1.0, abs=1e-6) and r["norm_in"] == pytest.approx(r["norm_out"])


# ---------------------------------------------------------------------------------------------------------
# The theory: the bound, its failure probability, the Monte Carlo, the single-head model

def test_bounds_hand_values():
    """B/T = .5, k = 3, eps = .05: (1 - eps)/(B/T - eps) = .95/.45 = 2.11111, its square root 1.452966, so
    the shared factor is 3 - 2 * 1.452966 = .094067.
    Delta_max = .5 / (.98 * .9025) * .094067 = .053178;  Theorem 4.1: 2.1 * .5 / .9025 * .094067 = .109440.
    Intermediate (b = 1, u = 5): gamma = 1.452966 - 1 = .452966; D = (1 - 2/5 + 1/25) / (1 - 1/25) = 2/3;
    (.5 - 2 * .45 * .452966) / (2/3 * .9025) = .092331 / .601667 = .153459.
    B/T = .9: 3 - 2 sqrt(.95/.85) = .88562; Delta_max = .1 / .88445 * .88562 = .10013."""
    assert dropped_mass_bound(0.5, 3, 0.05) == pytest.approx(0.053178, abs=2e-6)
    assert theorem41_bound(0.5, 3, 0.05) == pytest.approx(0.109440, abs=2e-6)
    assert power_law_mean_factor(3, 1, 5) == pytest.approx(2 / 3)
    assert intermediate_dropped_mass_bound(0.5, 3, 0.05, 1, 5) == pytest.approx(0.153459, abs=2e-6)
    assert dropped_mass_bound(0.9, 3, 0.05) == pytest.approx(0.100133, abs=2e-6)
    # k = 3, eps = .1, B/T = .5: (.9/.4)^(1/2) = 1.5 exactly, so the factor is 0; below it is negative
    assert dropped_mass_bound(0.5, 3, 0.1) == pytest.approx(0.0, abs=1e-12)
    assert theorem41_bound(0.4, 3, 0.1) < 0


def test_bounds_reject_keep_at_most_eps():
    for keep in [0.05, 0.01]:
        with pytest.raises(ValueError, match="B / T_max"):
            theorem41_bound(keep, 3, 0.05)
        with pytest.raises(ValueError, match="B / T_max"):
            dropped_mass_bound(keep, 3, 0.05)
    with pytest.raises(ValueError, match="k"):
        theorem41_bound(0.5, 2, 0.05)
    with pytest.raises(ValueError, match="eps"):
        theorem41_bound(0.5, 3, 1.0)


def test_failure_probability_hand():
    """k = 3, eps = .1, b = 1, u = 5, B/T = .5: the first term is T_max exp(-.01 (T_min - 1) / 16).
    T_min = 10^4, T_max = 2 10^4: 2e4 * exp(-6.249) = 38.6 (vacuous); T_min = 10^6: negligible."""
    p = failure_probability(10 ** 4, 2 * 10 ** 4, 0.5, 3, 0.1, 1, 5)
    first = 2e4 * math.exp(-0.01 * (10 ** 4 - 1) / 16)
    second = 2e4 * math.exp(-2 * (10 ** 4 - 1) * 0.25 / 0.81)
    assert p == pytest.approx(first + second) and p > 1
    assert failure_probability(10 ** 6, 2 * 10 ** 6, 0.5, 3, 0.1, 1, 5) < 1e-100


def test_power_law_sampler_matches_its_distribution():
    """Inverse-CDF draws: inside [0, u - b], with the law's mean D / (k - 2) and its CDF at one point."""
    v = sample_power_law((200_000,), k=3, b=1, u=5, generator=torch.Generator().manual_seed(0))
    assert float(v.min()) >= 0 and float(v.max()) <= 4
    assert float(v.mean()) == pytest.approx(power_law_mean_factor(3, 1, 5) / 1, rel=0.01)
    cdf = (1 - 2 ** -2) / (1 - 5 ** -2)                                       # P(v <= 1)
    assert float((v <= 1).double().mean()) == pytest.approx(cdf, abs=0.005)
    assert dropped_mass(torch.tensor([[4.0, 3, 2, 1]]), 2).item() == pytest.approx(0.3)


# the paper's parameter rows for the dropped-mass experiment: (u / b, k, eps, B / T), b = 1
PAPER_ROWS = [(5, 3, 0.05, 0.5), (5, 3, 0.05, 0.7), (5, 3, 0.05, 0.9), (1000, 3, 0.05, 0.5), (5, 3, 0.10, 0.5)]


@pytest.mark.parametrize("u,k,eps,keep", PAPER_ROWS)
def test_monte_carlo_dropped_mass_is_below_the_intermediate_bound(u, k, eps, keep):
    mean, stderr = simulate_dropped_mass(keep, k, 1.0, float(u), T=2000, seeds=100)
    assert 0 < mean < intermediate_dropped_mass_bound(keep, k, eps, 1.0, float(u)) - 3 * stderr


def test_closed_form_is_not_an_upper_bound_at_half_budget():
    """The honest counterpart: at B/T = .5 (k = 3, u = 5b) the simulated dropped mass exceeds Delta_max."""
    mean, stderr = simulate_dropped_mass(0.5, 3, 1.0, 5.0, T=2000, seeds=100)
    assert mean - 3 * stderr > dropped_mass_bound(0.5, 3, 0.05)


def test_fit_power_law_recovers_k():
    v = sample_power_law((20_000,), k=4, b=1, u=50, generator=torch.Generator().manual_seed(1))
    k, b, u = fit_power_law(v)
    assert k == pytest.approx(4, abs=0.4) and u == pytest.approx(b + float(v.max()))


def test_toy_model_satisfies_the_spectral_assumption_and_budget_caches():
    model = make_toy_model(d=8, p=8, hidden=16, qk_norm=50.0, seed=0)
    assert model.spectral_product() == pytest.approx(0.5)
    x0 = torch.randn(6, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    full = run_toy(model, x0, 40, "full")
    assert torch.allclose(full["x"].norm(dim=-1), torch.ones(40, dtype=torch.float64))
    assert float(full["dropped"][5:].abs().max()) < 1e-12
    # a budget covering every token is the full model, for both budget caches
    for cache in ["oracle", "counter"]:
        same = run_toy(model, x0, 40, cache, budget=39)
        assert torch.allclose(same["x"], full["x"])
    # under budget: the oracle drops the least mass any B-subset can, the counter cache at least as much
    oracle = run_toy(model, x0, 40, "oracle", budget=10)
    counter = run_toy(model, x0, 40, "counter", budget=10, history_window=4, n_recent=2)
    assert float(oracle["dropped"][20:].min()) > 0
    beta = oracle["beta"][39, :39]
    assert oracle["dropped"][39].item() == pytest.approx(1 - beta.topk(10).values.sum().item())
    for t in range(20, 40):         # the counter cache holds <= B tokens: it drops at least the top-B remainder
        least = 1 - counter["beta"][t, :t].topk(10).values.sum()
        assert counter["dropped"][t].item() >= least.item() - 1e-12
    # without normalisation x_{t+1} = F(a_t) shrinks: ||x|| <= (1 + l1 l2) lV lO < 1/2 (the assumptions clash)
    raw = run_toy(model, x0, 40, "full", normalize=False)
    assert float(raw["x"][6:].norm(dim=-1).max()) < 0.5
