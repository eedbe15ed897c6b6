"""
Perturbation-constrained selection (``methods/critical_kv.py``): the bound of Theorem 2 on random inputs,
Theorem 1's masked-softmax identity, Algorithm 1 on hand-computed tensors (derivations in the
docstrings), and the wrapper (Algorithm 2) against its host: alpha = 1 is the host, equal value norms are
attention top-k, every kept entry is where its stage puts it, AdaKV's per-head budgets are respected.
"""

from __future__ import annotations

import pytest
import torch

from methods import make_policy
from methods.critical_kv import (
    CriticalKVPolicy,
    assumption1_sigma,
    output_perturbation,
    perturbation_bound,
    perturbation_constrained_select,
    projected_output_l1,
    projected_value_norms,
    renormalized_attention,
    two_stage_masks,
)
from methods.snapkv import SnapKVPolicy
from nanollm import KVCache, StepContext, Transformer, decode_step, extend, prefill, preset
from nanollm.policy import select_topk
from tests.held import held
from tests.methods.hand import hand_ctx


@pytest.fixture(scope="module")
def tiny(make_model) -> Transformer:
    """GQA (4 query heads, 2 KV heads), weights scaled so attention is peaked (not decided by ties)."""
    return make_model(preset("TINY"), seed=0)


def prompt(n: int, seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------
# The perturbation, its bound, the masked softmax

def random_case(g: torch.Generator):
    """One random head: attention over n entries (flat to peaked), values, W_O slice, a non-empty mask."""
    n, d, D = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in [(2, 40), (1, 8), (1, 16)])
    temperature = float(torch.empty(1).uniform_(-2, 2, generator=g).exp())
    attn = torch.softmax(torch.randn(n, generator=g, dtype=torch.float64) * temperature, -1)
    v = torch.randn(n, d, generator=g, dtype=torch.float64) * float(torch.rand(1, generator=g) * 5)
    w_o = torch.randn(d, D, generator=g, dtype=torch.float64)
    keep = torch.rand(n, generator=g) < float(torch.rand(1, generator=g))
    keep[int(torch.randint(0, n, (1,), generator=g))] = True                   # at least one entry kept
    return attn, v @ w_o, keep


def test_perturbation_never_exceeds_the_bound():
    """Theorem 2 holds for *any* mask (it is the triangle inequality): L <= theta on 2,000 random heads."""
    g = torch.Generator().manual_seed(0)
    gaps = []
    for _ in range(2000):
        attn, projected, keep = random_case(g)
        vnorm = projected.abs().sum(-1)
        L, theta = output_perturbation(attn, keep, projected), perturbation_bound(attn, keep, vnorm)
        gaps.append(float(theta - L))
    assert min(gaps) >= -1e-12, f"bound violated by {-min(gaps):.3g}"
    assert max(gaps) > 0.1                                   # a real inequality, not an identity


def test_keeping_everything_has_no_perturbation_and_a_zero_bound():
    g = torch.Generator().manual_seed(1)
    attn, projected, keep = random_case(g)
    keep = torch.ones_like(keep)
    assert float(output_perturbation(attn, keep, projected)) == pytest.approx(0.0, abs=1e-12)
    assert float(perturbation_bound(attn, keep, projected.abs().sum(-1))) == pytest.approx(0.0, abs=1e-12)


def test_masked_softmax_identity():
    """Theorem 1: softmax(a + M) == N*A / sum(N*A), M = -inf where N = 0, over random logits and masks."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 30, generator=g, dtype=torch.float64) * 3
    keep = torch.rand(64, 30, generator=g) < 0.4
    keep[:, 7] = True
    masked = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)
    torch.testing.assert_close(renormalized_attention(torch.softmax(logits, -1), keep), masked, rtol=0, atol=1e-14)


def hand_head():
    """A = [.5, .2, .18, .12]; V = [[1], [.1], [-2], [1]] (d = 1); W_O = [[1, .5]] (D = 2), so the projected
    values are V W_O = [[1, .5], [.1, .05], [-2, -1], [1, .5]], P = ||V W_O||_1 = [1.5, .15, 3, 1.5] and
    A * P = [.75, .03, .54, .18]. The full output is o = sum_i A_i (V W_O)_i = [.28, .14]."""
    attn = torch.tensor([0.5, 0.2, 0.18, 0.12], dtype=torch.float64)
    v = torch.tensor([[1.0], [0.1], [-2.0], [1.0]], dtype=torch.float64)
    w_o = torch.tensor([[1.0, 0.5]], dtype=torch.float64)
    return attn, v, w_o


def test_two_stage_beats_attention_top_k_by_hand():
    """Budget b = 2. Attention top-2 keeps {0, 1}: kept mass .7, o' = (.5 [1, .5] + .2 [.1, .05]) / .7
    = [.742857, .371429], L = |.28 - .742857| + |.14 - .371429| = .694286.
    Algorithm 1 with alpha = .5: stage 1 takes entry 0 (top-1 attention); stage 2 the best A * P of the rest,
    entry 2 (.54 > .18 > .03): keeps {0, 2}, mass .68, o' = (.5 [1, .5] + .18 [-2, -1]) / .68 = [.205882,
    .102941], L = .074118 + .037059 = .111176: entry 2's large value, ignored by attention alone, matters.
    Bounds (C = sum A * P = 1.5): top-k 1.5 - (2 - 1/.7) * .78 = 1.054286; two-stage 1.5 - (2 - 1/.68) * 1.29
    = .817059. alpha = .25 gives b' = 0, stage 2 alone, and the same {0, 2}."""
    attn, v, w_o = hand_head()
    projected, vnorm = v @ w_o, (v @ w_o).abs().sum(-1)
    torch.testing.assert_close(vnorm, torch.tensor([1.5, 0.15, 3.0, 1.5], dtype=torch.float64))
    top_k = perturbation_constrained_select(attn, vnorm, 2, alpha=1.0)
    two_stage = perturbation_constrained_select(attn, vnorm, 2, alpha=0.5)
    assert top_k.tolist() == [0, 1] and two_stage.tolist() == [0, 2]
    assert perturbation_constrained_select(attn, vnorm, 2, alpha=0.25).tolist() == [0, 2]

    def mask(idx):
        return torch.zeros(4, dtype=torch.bool).index_fill(0, idx, True)

    L_top, L_two = (float(output_perturbation(attn, mask(i), projected)) for i in (top_k, two_stage))
    assert L_top == pytest.approx(0.694286, abs=1e-6) and L_two == pytest.approx(0.111176, abs=1e-6)
    assert L_two < L_top
    theta_top, theta_two = (float(perturbation_bound(attn, mask(i), vnorm)) for i in (top_k, two_stage))
    assert theta_top == pytest.approx(1.054286, abs=1e-6) and theta_two == pytest.approx(0.817059, abs=1e-6)
    assert float(assumption1_sigma(attn, mask(torch.tensor([0])))) == pytest.approx(0.5)   # stage 1's mass


def test_projected_value_norms_per_query_head_by_hand():
    """GQA, 2 query heads on 1 KV head, d = 2, D = 2. W_O = [[1, 0, 2, 0], [0, 1, 0, -3]]: head 0's slice
    (columns 0-1, transposed) is the identity, head 1's (columns 2-3) is diag(2, -3). Values [1, 1] and
    [1, -2]: head 0 norms |1| + |1| = 2 and |1| + |-2| = 3; head 1 norms 2 + 3 = 5 and 2 + 6 = 8."""
    v = torch.tensor([[1.0, 1.0], [1.0, -2.0]]).view(1, 1, 2, 2)
    w_o = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 1.0, 0.0, -3.0]])
    assert projected_value_norms(v, w_o, n_head=2).tolist() == [[[2.0, 3.0], [5.0, 8.0]]]
    # 4 query heads on 2 KV heads (d = D = 1, W_O = [[1, 2, 3, 4]]): heads 0, 1 read KV head 0 (value 1),
    # heads 2, 3 read KV head 1 (value -10): norms 1 * 1, 1 * 2, 10 * 3, 10 * 4.
    v = torch.tensor([1.0, -10.0]).view(1, 2, 1, 1)
    w_o = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert projected_value_norms(v, w_o, n_head=4).tolist() == [[[1.0], [2.0], [30.0], [40.0]]]


def test_projected_output_l1_is_the_per_head_output_difference():
    g = torch.Generator().manual_seed(3)
    H, d, D = 4, 3, 5
    out_full, out = torch.randn(H, d, generator=g), torch.randn(H, d, generator=g)
    w_o = torch.randn(D, H * d, generator=g)
    expected = [float(((out_full[h] - out[h]) @ w_o[:, h * d:(h + 1) * d].T).abs().sum()) for h in range(H)]
    torch.testing.assert_close(projected_output_l1(out_full, out, w_o), torch.tensor(expected))


# ---------------------------------------------------------------------------------------------------------
# Algorithm 1

def test_equal_value_norms_give_attention_top_k():
    """With every P_i equal, A * P ranks like A: both stages pick by attention, for every alpha."""
    g = torch.Generator().manual_seed(4)
    attn = torch.softmax(torch.randn(3, 5, 50, generator=g), -1)
    for alpha in (0.0, 0.25, 0.5, 1.0):
        for budget in (1, 7, 20, 50, 60):
            picked = perturbation_constrained_select(attn, torch.full_like(attn, 2.5), budget, alpha)
            assert torch.equal(picked, select_topk(attn, budget)), (alpha, budget)


def test_two_stage_masks_by_hand():
    """Two heads, 6 slots. Head 0: budget 4, stage 1 takes 2 (slot 5 protected at +inf, then the best
    first score, slot 1); stage 2 the best second scores of the rest: slots 4 (.9) and 0 (.8).
    Head 1: slot 2 is empty (never kept, whatever its scores); budget 3, stage 1 takes 1 (slot 3, the best
    valid first score, .7); stage 2: slots 5 (.6) and 0 (.5)."""
    inf = float("inf")
    first = torch.tensor([[[.1, .6, .5, .2, .3, inf], [.1, .2, .9, .7, .3, .2]]])
    second = torch.tensor([[[.8, .1, .2, .3, .9, .0], [.5, .4, .95, .1, .3, .6]]])
    valid = torch.ones(1, 2, 6, dtype=torch.bool)
    valid[0, 1, 2] = False
    stage1, keep = two_stage_masks(first, second, torch.tensor([[4, 3]]), torch.tensor([[2, 1]]), valid)
    assert stage1.int().tolist() == [[[0, 1, 0, 0, 0, 1], [0, 0, 0, 1, 0, 0]]]
    assert keep.int().tolist() == [[[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 0, 1]]]


# ---------------------------------------------------------------------------------------------------------
# Algorithm 2: the wrapper

def ten_token_ctx(values: torch.Tensor | None = None) -> StepContext:
    """One head, 10 tokens, d = 1, W_O = [[1]] (so P_i = |v_i|). Both window queries (slots 8, 9) attend
    [.40, .10, .06, .05, .04, .03, .02, .01 | .19, .10]; values 1 everywhere but slot 7 (8)."""
    row = torch.tensor([.40, .10, .06, .05, .04, .03, .02, .01, .19, .10])
    probs = torch.zeros(1, 1, 10, 10)
    probs[0, 0, 8:] = row
    if values is None:
        values = torch.ones(10).index_fill(0, torch.tensor([7]), 8.0)
    return hand_ctx(probs, v=values.view(1, 1, 10, 1), w_o=torch.ones(1, 1))


def test_window_stage_two_by_hand():
    """The literal reading of Algorithm 2 (``stage2="window"``). SnapKV (window 2, kernel 1, budget 6) keeps
    the window {8, 9} and the top-4 votes {0, 1, 2, 3}. CriticalKV, alpha = .25: free budget 4, stage 1 =
    floor(.25 * 4) = 1 entry by the vote (slot 0); stage 2 on Abar * P over slots 1-7 = [.10, .06, .05, .04,
    .03, .02, .08]: slots 1, 7, 2. Slot 7's value (norm 8) outweighs its small attention (.01)."""
    snap = SnapKVPolicy(budget=6, window=2, kernel=1)
    ctx = ten_token_ctx()
    snap.on_prefill(ctx)
    assert ctx.kv.pos.tolist() == [[[0, 1, 2, 3, 8, 9]]]
    ctx = ten_token_ctx()
    critical = CriticalKVPolicy(budget=6, stage2="window", inner=SnapKVPolicy(budget=6, window=2, kernel=1))
    critical.on_prefill(ctx)
    assert ctx.kv.pos.tolist() == [[[0, 1, 2, 7, 8, 9]]]
    last = critical.last[0]
    assert (last["stage1_pos"][last["stage1_pos"] >= 0]).tolist() == [0, 8, 9]     # stage 1 + the window
    assert (last["stage2_pos"][last["stage2_pos"] >= 0]).tolist() == [1, 2, 7]
    assert float(last["sigma"]) == pytest.approx(0.40 + 0.19 + 0.10)                  # Assumption 1 on Abar


def pooled_by_hand(probs, v, w_o, budget, window, kernel, alpha, epsilon, alpha_of="free"):
    """The default stage 2 (the host's pooled score, as the authors' code), one row at a time in plain Python:
    SnapKV's vote per query head summed over the window's queries, average-pooled (zero padding counted),
    averaged over the KV head's group; its per-query mean plus epsilon times the group's mean projected value
    norm. Returns the kept positions per KV head, sorted."""
    B, H, T, _ = probs.shape
    H_kv, d = v.shape[1], v.shape[-1]
    G, n_prefix = H // H_kv, T - window
    kept = []
    for j in range(H_kv):
        votes, norms = [0.0] * n_prefix, [0.0] * T
        for h in range(j * G, (j + 1) * G):
            raw = [sum(float(probs[0, h, r, i]) for r in range(T - window, T)) for i in range(n_prefix)]
            for i in range(n_prefix):
                near = [raw[i + o] for o in range(-(kernel // 2), kernel // 2 + 1) if 0 <= i + o < n_prefix]
                votes[i] += sum(near) / kernel / G
            w_h = w_o[:, h * d:(h + 1) * d]
            for i in range(T):
                norms[i] += float((w_h @ v[0, j, i]).abs().sum()) / G
        free = budget - window
        n1 = int(alpha * free) if alpha_of == "free" else max(0, int(alpha * budget) - window)
        stage1 = sorted(range(n_prefix), key=lambda i: (-votes[i], i))[:n1]
        second = {i: (votes[i] / window + epsilon) * norms[i] for i in range(n_prefix) if i not in stage1}
        stage2 = sorted(second, key=lambda i: (-second[i], i))[:free - n1]
        kept.append(sorted(stage1 + stage2 + list(range(n_prefix, T))))
    return kept


@pytest.mark.parametrize("alpha, alpha_of", [(0.25, "free"), (0.5, "free"), (0.0, "free"), (0.5, "budget")])
def test_default_stage_two_is_the_pooled_host_score_by_hand(alpha, alpha_of):
    """The default (``stage2="host"``) against ``pooled_by_hand`` on random attention and values (4 query
    heads, 2 KV heads, 30 tokens, window 5, kernel 5, average pooling) with an epsilon large enough to move
    the selection: it must be added to the window's *mean* score, as kvpress adds it, not to the sum."""
    g = torch.Generator().manual_seed(11)
    B, H, H_kv, T, d, D = 1, 4, 2, 30, 3, 6
    probs = torch.softmax(torch.randn(B, H, T, T, generator=g) * 2, -1)
    v = torch.randn(B, H_kv, T, d, generator=g) * torch.rand(B, H_kv, T, 1, generator=g) * 3
    w_o = torch.randn(D, H * d, generator=g)
    for epsilon in (0.0, 0.02):
        ctx = hand_ctx(probs, v=v, w_o=w_o)
        policy = make_policy("critical_kv", 14, window=5, kernel=5, pooling="avg", alpha=alpha,
                             alpha_of=alpha_of, epsilon=epsilon)
        policy.on_prefill(ctx)
        expected = pooled_by_hand(probs, v, w_o, 14, 5, 5, alpha, epsilon, alpha_of)
        assert [sorted(ctx.kv.pos[0, j].tolist()) for j in range(H_kv)] == expected, (epsilon, alpha)


def test_the_two_readings_differ_by_hand():
    """A check that can fail: on the same inputs the literal reading keeps another set than the default."""
    g = torch.Generator().manual_seed(11)
    probs = torch.softmax(torch.randn(1, 4, 30, 30, generator=g) * 2, -1)
    v, w_o = torch.randn(1, 2, 30, 3, generator=g), torch.randn(6, 12, generator=g)
    kept = []
    for stage2 in ("host", "window"):
        ctx = hand_ctx(probs, v=v, w_o=w_o)
        make_policy("critical_kv", 14, window=5, kernel=5, stage2=stage2).on_prefill(ctx)
        kept.append(ctx.kv.pos.clone())
    assert not torch.equal(*kept)


def test_equal_value_norms_host_mode_is_the_host():
    """All values equal: stage 2 in host mode ranks by the host's own score, so every alpha keeps SnapKV's
    set; in window mode it ranks by the un-pooled window attention (here kernel 1: the same order)."""
    for alpha in (0.0, 0.25, 0.5):
        for stage2 in ("host", "window"):
            ctx = ten_token_ctx(values=torch.full((10,), 3.0))
            make_policy("critical_kv", 6, window=2, kernel=1, alpha=alpha, stage2=stage2).on_prefill(ctx)
            assert ctx.kv.pos.tolist() == [[[0, 1, 2, 3, 8, 9]]], (alpha, stage2)


HOSTS = ["snapkv", "adakv(snapkv)", "h2o", "adakv(h2o)", "streaming_llm", "adakv(streaming_llm)"]


def run_steps(model, policy) -> KVCache:
    cache = KVCache(model.config, policy)
    prefill(model, prompt(40), cache)
    decode_step(model, prompt(1, seed=1)[:, 0], cache)
    extend(model, prompt(4, seed=2), cache)
    decode_step(model, prompt(1, seed=3)[:, 0], cache)
    return cache


@pytest.mark.parametrize("stage2", ["window", "host"])
@pytest.mark.parametrize("host", HOSTS)
def test_alpha_one_is_the_host(tiny, host, stage2):
    """alpha = 1: stage 1 takes each head's whole free budget by the host's ranking: the host's selection,
    at prefill and after every decode / extend step (where the host compresses then)."""
    caches = [run_steps(tiny, make_policy(f"critical_kv({host})", 12, alpha=1.0, stage2=stage2)),
              run_steps(tiny, make_policy(host, 12))]
    for a, b in zip(*[c.layers for c in caches]):
        assert held(a.pos) == held(b.pos)


@pytest.mark.parametrize("alpha", [0.0, 0.25])
def test_streaming_llm_host_is_unchanged(tiny, alpha):
    """Under StreamingLLM every kept entry is protected (sinks + recent = budget): nothing is left to choose."""
    caches = [run_steps(tiny, make_policy("critical_kv(streaming_llm)", 12, alpha=alpha)),
              run_steps(tiny, make_policy("streaming_llm", 12))]
    for a, b in zip(*[c.layers for c in caches]):
        assert held(a.pos) == held(b.pos)


def test_the_selection_differs_from_the_host(tiny):
    """A check that can fail: at alpha = .25 the wrapper keeps other entries than SnapKV in some head."""
    caches = [run_steps(tiny, make_policy("critical_kv", 12, window=4)),
              run_steps(tiny, make_policy("snapkv", 12, window=4))]
    assert any(not torch.equal(a.pos, b.pos) for a, b in zip(*[c.layers for c in caches]))


class Recording(CriticalKVPolicy):
    def select(self, ctx):
        self.recorded = getattr(self, "recorded", []) + [(self.stage_scores(ctx), ctx.kv.pos.clone())]
        return super().select(ctx)


@pytest.mark.parametrize("host", ["snapkv", "adakv(snapkv)"])
@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5])
def test_each_stage_keeps_its_top_scored(tiny, host, alpha):
    """After prefill (40 tokens, budget 16, window 4), per layer, row and KV head: the head keeps its budget
    b (AdaKV: its share), the window, floor(alpha * (b - 4)) more entries that the host ranks above every
    other non-window entry, and fills the rest with entries whose stage-2 score is at least that of every
    entry evicted."""
    policy = Recording(budget=16, alpha=alpha, inner=make_policy(host, 16, window=4, kernel=3))
    cache = KVCache(tiny.config, policy)
    prefill(tiny, prompt(40), cache)
    for layer, (scores, pos_before) in enumerate(policy.recorded):
        kept_pos, last = cache.layers[layer].pos, policy.last[layer]
        for b in range(2):
            for j in range(tiny.config.n_kv_head):
                budget = int(scores["budgets"][b, j])
                kept = set(kept_pos[b, j].tolist()) - {-1}
                assert len(kept) == budget and set(range(36, 40)) <= kept
                first, second = scores["first"][b, j], scores["second"][b, j]
                stage1 = set(last["stage1_pos"][b, j].tolist()) - {-1} - set(range(36, 40))
                assert len(stage1) == int(alpha * (budget - 4))
                others = [p for p in range(36) if p not in stage1]
                if stage1:
                    assert min(first[p] for p in stage1) >= max(first[p] for p in others)
                stage2 = kept - stage1 - set(range(36, 40))
                evicted = set(range(40)) - kept
                assert min(second[p] for p in stage2) >= max(second[p] for p in evicted)


def test_critical_adakv_keeps_adakvs_head_budgets(tiny):
    """CriticalAdaKV: each head keeps exactly AdaKV's allocation (its share of the layer's pool)."""
    caches = [KVCache(tiny.config, make_policy(spec, 12, window=4, alpha_safeguard=0.2))
              for spec in ("critical_kv(adakv(snapkv))", "adakv(snapkv)")]
    for cache in caches:
        prefill(tiny, prompt(40), cache)
    for a, b in zip(*[c.layers for c in caches]):
        assert torch.equal(a.counts(), b.counts())
        assert bool((a.counts().sum(-1) == 12 * tiny.config.n_kv_head).all())
    assert any(not torch.equal(a.pos, b.pos) for a, b in zip(*[c.layers for c in caches]))


def test_window_is_read_from_the_innermost_scorer():
    assert make_policy("critical_kv", 16).window == 32
    assert make_policy("critical_kv", 16, window=8).window == 8
    assert make_policy("critical_kv(adakv(snapkv))", 16, window=4).window == 4
    assert make_policy("critical_kv(h2o)", 16).window is None
    assert make_policy("critical_kv(adakv(h2o))", 16).window is None


def test_reset_forgets_the_diagnostics(tiny):
    policy = make_policy("critical_kv", 12, window=4)
    cache = KVCache(tiny.config, policy)
    prefill(tiny, prompt(40), cache)
    assert set(policy.last) == set(range(tiny.config.n_layer))
    cache.reset()
    assert policy.last == {}


def test_rejects_bad_options():
    for bad in [{"alpha": 1.5}, {"alpha": -0.1}, {"alpha": True}, {"alpha": "0.25"}]:
        with pytest.raises(ValueError, match="alpha"):
            make_policy("critical_kv", 8, **bad)
    with pytest.raises(ValueError, match="stage2") as e:
        make_policy("critical_kv", 8, stage2="pooled")
    assert "window" in str(e.value) and "host" in str(e.value)
    for bad in [-1e-4, float("inf"), float("nan")]:
        with pytest.raises(ValueError, match="epsilon"):
            make_policy("critical_kv", 8, epsilon=bad)
    with pytest.raises(ValueError, match="inner budget"):
        CriticalKVPolicy(budget=8, inner=SnapKVPolicy(budget=9))
    with pytest.raises(ValueError, match="scoring policy"):
        CriticalKVPolicy(budget=8, inner=make_policy("full", 8))
