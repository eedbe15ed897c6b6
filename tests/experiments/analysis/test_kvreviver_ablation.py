"""Why KVReviver collapses (experiments/analysis/kvreviver_ablation.py): the ablation variants do what their names
say, the protocol is the language-modelling one, the appendix's Fisher budgets (methods/kvreviver_budgets.py) keep the
total, and the repair of ours (not the paper's) reduces the error of keys with a nonzero mean. Fast tier on the
bundled retrieval-llama; SmolLM2 ones are slow."""

from __future__ import annotations

import math

import pytest
import torch

from experiments.analysis import kvreviver_ablation as ab
from experiments.analysis.kvreviver_ablation import (
    LEMMA2,
    CentredKeySketch,
    CentredSketch,
    NoSwaps,
    SwapsAtOnce,
    TrueKeys,
    TrueKV,
    TrueValues,
    lm_ablation,
)
from experiments.evaluation.language_modelling import run as lm_run
from methods.kvreviver import KVReviverPolicy
from methods.kvreviver_budgets import allocate, fisher_information, fisher_layer_budgets
from methods.kvreviver_sketch import VagueSketch
from nanollm import KVCache, decode_step, prefill


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 500, (1, n), generator=torch.Generator().manual_seed(seed))


def script(model, policy, n_prompt: int = 60, steps: int = 12, check=None):
    """A prompt, then ``steps`` decode steps; ``check(cache)`` after each. Returns the logits and the cache."""
    cache = KVCache(model.config, policy)
    out = [prefill(model, ids(n_prompt), cache)[:, -1]]
    for t in range(steps):
        out.append(decode_step(model, ids(1, seed=100 + t)[:, 0], cache))
        if check:
            check(cache)
    return out, cache


# ---------------------------------------------------------------------------------------------------------
# The ablations

def test_true_kv_attends_exactly_the_full_cache(bundled):
    """With every slot's true key and value the rebuilt cache *is* the full cache at every step (the shadow
    follows the new tokens): bit for bit in layer 0, whose keys and values depend on the tokens only, within
    rounding after it (the attention's order of summation differs), and so are the logits, while the
    bookkeeping runs: tokens really live in the sketch and get revived."""
    model, _, _ = bundled
    full_out, full = script(model, None)
    policy = TrueKV(40, replace_rate=1.0)
    reference = KVCache(model.config)
    prefill(model, ids(60), reference)
    steps = iter(range(12))

    def check(cache):
        decode_step(model, ids(1, seed=100 + next(steps))[:, 0], reference)
        for layer, store in enumerate(cache.layers):
            entries, want = policy.attend_kv(layer, store), reference.layers[layer]
            assert torch.equal(entries.pos, want.pos)
            if layer == 0:
                assert torch.equal(entries.k, want.k) and torch.equal(entries.v, want.v)
            torch.testing.assert_close(entries.k, want.k, rtol=0, atol=1e-5)
            torch.testing.assert_close(entries.v, want.v, rtol=0, atol=1e-5)
            assert policy.parts(layer, store)["V"] > 0
    out, _ = script(model, policy, check=check)
    for a, b in zip(full_out, out):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert policy.swaps > 0, "the swap loop should run in this setting"


def test_true_kv_keeps_the_bookkeeping_of_an_exact_sketch(bundled):
    """TrueKV keeps the positions, scores and swaps of KVReviver with an exact (injective) sketch: the shadow
    changes what is attended, nothing of Algorithm 3."""
    model, _, _ = bundled
    kw = dict(sketch_width=100, injective_hash=True, replace_rate=1.0)
    exact, shadow = KVReviverPolicy(40, **kw), TrueKV(40, **kw)
    _, a = script(model, exact)
    _, b = script(model, shadow)
    assert exact.swaps == shadow.swaps > 0
    for layer in range(model.config.n_layer):
        assert torch.equal(a.layers[layer].pos, b.layers[layer].pos)
        torch.testing.assert_close(exact._scores[layer], shadow._scores[layer], rtol=0, atol=1e-5)


def test_true_keys_and_true_values_replace_one_each(bundled):
    """TrueKeys: the true keys and Algorithm 4's rebuilt values; TrueValues the other way round. Layer 0's
    keys and values depend on the tokens only, so there the true ones are the full cache's, bit for bit; the
    sketch really is used (its estimates differ from the true entries)."""
    model, _, _ = bundled
    _, full = script(model, None)
    for cls, true_part, sketch_part in ((TrueKeys, "k", "v"), (TrueValues, "v", "k")):
        policy = cls(40)
        _, cache = script(model, policy)
        for layer, store in enumerate(cache.layers):
            mixed = policy.attend_kv(layer, store)
            rebuilt = KVReviverPolicy.attend_kv(policy, layer, store)           # the shipped Algorithm 4
            assert torch.equal(getattr(mixed, sketch_part), getattr(rebuilt, sketch_part))
            assert torch.equal(mixed.pos, rebuilt.pos) and mixed.pos.shape[-1] == cache.seen
        true, first = getattr(policy.attend_kv(0, cache.layers[0]), true_part), getattr(full.layers[0], true_part)
        assert torch.equal(true, first)
        assert not torch.equal(getattr(KVReviverPolicy.attend_kv(policy, 0, cache.layers[0]), true_part), first)


def test_no_swaps_revives_nothing_and_still_sketches(bundled):
    """Where the shipped policy revives tokens, NoSwaps revives none (no approximate raw slot) while its
    evicted tokens still go into the sketch; the other parts of Algorithm 3 are the shipped ones."""
    model, _, _ = bundled
    shipped, none = KVReviverPolicy(40, replace_rate=1.0), NoSwaps(40, replace_rate=1.0)
    _, a = script(model, shipped)
    _, b = script(model, none)
    assert shipped.swaps > 0 and none.swaps == 0
    for layer, store in enumerate(b.layers):
        assert not none._approx[layer].any()
        assert torch.equal(none.exact_positions(layer, store), store.pos)
        parts = none.parts(layer, store)
        assert parts["V"] > 0 and parts["C"] == none.candidate_budget


@pytest.mark.parametrize("injective", [True, False])
def test_swaps_at_once_read_every_estimate_before_the_swaps(injective):
    """One swap step on random tables where many swaps happen: SwapsAtOnce revives the same tokens into the
    same slots as the shipped loop. With an injective hash no swap touches another's cells, so the entries
    and the cells come out the same bit for bit; with 2 cells per row the tokens share cells, and the loop's
    later estimates (read after the earlier swaps) differ from those read at once, which are the step's
    first queries of the sketch."""
    g = torch.Generator().manual_seed(4)
    N, G, d, width = 60, 2, 4, (60 if injective else 2)
    p = torch.randperm(N, generator=g)[:24].sort().values                     # raw positions (R and C)
    recent_from = int(p[-6])                                                  # the last 6 raw are Recent
    scores = torch.rand(N, generator=g)
    k, v = torch.randn(G, 24, d, generator=g), torch.randn(G, 24, d, generator=g)
    vague = torch.tensor([j for j in range(N) if j not in set(p.tolist())])
    results = []
    for cls in (KVReviverPolicy, SwapsAtOnce):
        policy = cls(40, replace_rate=1.0, injective_hash=injective, sketch_width=width)
        sketch = policy.sketch_class(3, width, G, d, seed=0, injective=injective)
        sketch.insert(vague, torch.randn(len(vague), G, d, generator=torch.Generator().manual_seed(9)),
                      torch.randn(len(vague), G, d, generator=torch.Generator().manual_seed(10)))
        before = [t.clone() for t in sketch.query(vague)]                     # every estimate, before the step
        approx = torch.zeros(N, dtype=torch.bool)
        out = policy._swap(sketch, scores, k, v, p, recent_from, approx, max_swaps=18)
        results.append((out, approx, sketch.key.clone(), policy.swaps, before))
    (a, a_approx, a_key, a_swaps, before), (b, b_approx, b_key, b_swaps, _) = results
    assert a_swaps == b_swaps > 1 and torch.equal(a_approx, b_approx) and torch.equal(a[2], b[2])
    revived = [int((b[2] == j).nonzero()) for j in a_approx.nonzero().flatten().tolist()]
    rows = [int((vague == j).nonzero()) for j in b[2][revived].tolist()]
    for entries, estimates in zip(b[:2], before):                             # keys, then values
        assert torch.equal(entries[:, revived].transpose(0, 1), estimates[rows])   # read before any swap
    same = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a_key, b_key)
    assert same == injective


# ---------------------------------------------------------------------------------------------------------
# The protocol

def test_protocol_is_the_language_modelling_run(bundled):
    """lm_ablation on the shipped policy gives the perplexity, KL and agreement of
    ``language_modelling.run`` on "kvreviver", and the same full cache."""
    model, tok, _ = bundled
    theirs = lm_run(model, tok, ["full", "kvreviver"], [0.2, 0.5], 96, progress=False)
    ours = lm_ablation(model, tok, [ab.VARIANTS[0]], [0.2, 0.5], 96)
    for keep in (0.2, 0.5):
        t = next(r for r in theirs if r["method"] == "kvreviver" and r["keep_ratio"] == keep)
        o = next(r for r in ours if r["variant"] == "shipped" and r["keep_ratio"] == keep)
        assert (o["budget"], o["scored_tokens"]) == (t["budget"], t["scored_tokens"])
        for key in ("perplexity", "ppl_ratio", "kl", "top1_agreement"):
            assert o[key] == pytest.approx(t[key], rel=1e-9, abs=1e-12), key
    assert ours[0]["perplexity"] == pytest.approx(theirs[0]["perplexity"], rel=1e-12)


def test_command_refuses_bad_input_before_any_work(capsys, tmp_path):
    """One ``error:`` line, exit status 2, before any model loads; nothing is written."""
    out = tmp_path / "a.txt"
    for argv, says in ((["--keep-ratios", "0"], "--keep-ratios"), (["--lemma-keep", "2"], "--lemma-keep"),
                       (["--variants", "nope"], "--variants"), (["--out", str(out), "--json", str(out)], "same file"),
                       (["--out", str(tmp_path / "missing" / "a.txt")], "does not exist"),
                       (["--checkpoint", "retrieval-llama", "--length", "100000"], "--length")):
        with pytest.raises(SystemExit) as e:
            ab.main(argv + ["--quiet"])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and says in err and "\n" not in err, err
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------
# Lemma 2 and the appendix's Fisher budgets

def test_lemma2_constant_is_the_variance_of_a_median_of_three_normals():
    x = torch.randn(2_000_000, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert LEMMA2 == pytest.approx(float(x.median(dim=1).values.var()), abs=2e-3)
    assert LEMMA2 == pytest.approx(0.448, abs=1e-3)                        # the paper's value


def test_allocate_is_proportional_with_a_floor_and_keeps_the_total():
    assert allocate([1, 1, 2], 4) == (3, 3, 6)                              # 12 slots: 1 each, then 9 by 1:1:2
    assert allocate([0, 0, 1], 5) == (1, 1, 13)
    got = allocate([0.3, 0.1, 0.6, 0.2], 7)
    assert sum(got) == 28 and min(got) >= 1 and got == allocate([0.3, 0.1, 0.6, 0.2], 7)
    with pytest.raises(ValueError):
        allocate([1.0, float("nan")], 4)


def test_fisher_information_is_the_squared_gradient_of_wk_and_wv(bundled):
    """One chunk: F_l = ||dL/dW_K||^2 + ||dL/dW_V||^2 of the mean NLL, computed here with backward(); the
    model's flags are left as they were."""
    model, _, _ = bundled
    x = ids(33, seed=5)[0]
    flags = [p.requires_grad for p in model.parameters()]
    got = fisher_information(model, x, chunk=32)
    assert [p.requires_grad for p in model.parameters()] == flags
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x[None, :-1])[0], x[1:])
    loss.backward()
    want = [float(b.attn.k_proj.weight.grad.pow(2).sum() + b.attn.v_proj.weight.grad.pow(2).sum())
            for b in model.blocks]
    model.zero_grad(set_to_none=True)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-4)


def test_fisher_budgets_sum_to_the_uniform_total_and_are_deterministic(bundled):
    model, _, _ = bundled
    x = ids(200, seed=3)[0]
    budgets = fisher_layer_budgets(model, x, 40)
    assert budgets == fisher_layer_budgets(model, x, 40)
    assert sum(budgets) == 40 * model.config.n_layer and min(budgets) >= 1 and len(set(budgets)) > 1


def test_each_layer_keeps_to_its_own_budget(bundled):
    """With layer_budgets, every layer splits its own budget (R + C + cells <= it), and uniform budgets
    given explicitly are the default, bit for bit."""
    model, _, _ = bundled
    L = model.config.n_layer
    own = [20, 40, 30, 70][:L]
    policy = KVReviverPolicy(40, layer_budgets=own)

    def check(cache):
        for layer, store in enumerate(cache.layers):
            split, parts = policy.layer_split(layer), policy.parts(layer, store)
            assert parts["C"] <= split.candidate and parts["cells"] in (0, policy.rows * split.width)
            assert parts["R"] + parts["C"] + parts["cells"] <= own[layer]
            assert store.pos.shape[-1] <= own[layer]
    script(model, policy, check=check)
    a, _ = script(model, KVReviverPolicy(40))
    b, _ = script(model, KVReviverPolicy(40, layer_budgets=[40] * L))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="layer_budgets"):
        script(model, KVReviverPolicy(40, layer_budgets=[40] * (L - 1)))
    with pytest.raises(ValueError, match="layer_budgets"):
        KVReviverPolicy(40, layer_budgets="fisher")


# ---------------------------------------------------------------------------------------------------------
# The repair (ours)

def tokens(n: int, mean: float, seed: int = 0, H_kv: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H_kv, d, generator=g) + mean, torch.randn(n, H_kv, d, generator=g) + mean


@pytest.mark.parametrize("cls", [CentredKeySketch, CentredSketch])
def test_repair_reduces_the_error_of_keys_with_a_nonzero_mean(cls):
    """Keys of mean 3, 12 per cell: the plain sketch's key error carries the others' mean, the repair's not."""
    k, v = tokens(96, mean=3.0)
    pos = torch.arange(96)
    plain, fixed = VagueSketch(3, 8, 2, 8, seed=1), cls(3, 8, 2, 8, seed=1)
    for s in (plain, fixed):
        s.insert(pos, k, v)
    err = lambda s: float(((s.query(pos)[0] - k) ** 2).mean())              # noqa: E731
    assert err(fixed) < err(plain) / 20


def test_repair_is_exact_for_equal_tokens_and_lone_ones():
    """Tokens all equal come back exactly whatever the load (the centred error is 0); a token alone in its
    cells comes back exactly (no shrinking: nothing to shrink)."""
    c = torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(4)).expand(50, -1, -1)
    s = CentredSketch(3, 4, 2, 8, seed=2)
    s.insert(torch.arange(50), c + 1.0, c - 2.0)
    k, v = s.query(torch.arange(50))
    torch.testing.assert_close(k, c + 1.0, rtol=0, atol=1e-4)
    torch.testing.assert_close(v, c - 2.0, rtol=0, atol=1e-4)
    k, v = tokens(20, mean=2.0, seed=5)
    s = CentredSketch(3, 64, 2, 8, seed=0, injective=True)
    s.insert(torch.arange(20), k, v)
    kh, vh = s.query(torch.arange(20))
    torch.testing.assert_close(kh, k, rtol=0, atol=1e-5)
    torch.testing.assert_close(vh, v, rtol=0, atol=1e-5)


def test_repair_shrinks_crowded_estimates_towards_the_mean():
    """With many tokens per cell the estimate is mostly noise: the shrunk one has a smaller error than the
    unshrunk centred one, and about the error of the mean itself."""
    k, v = tokens(400, mean=1.0, seed=6)
    pos = torch.arange(400)
    centred, shrunk = CentredKeySketch(3, 4, 2, 8, seed=3), CentredSketch(3, 4, 2, 8, seed=3)
    for s in (centred, shrunk):
        s.insert(pos, k, v)
    mse = lambda est, true: float(((est - true) ** 2).mean())               # noqa: E731
    assert mse(shrunk.query(pos)[0], k) < mse(centred.query(pos)[0], k) / 10
    assert mse(shrunk.query(pos)[0], k) < 1.2 * mse(k.mean(0), k)


# ---------------------------------------------------------------------------------------------------------
# SmolLM2

@pytest.mark.slow
@pytest.mark.heavy
def test_smollm2_true_kv_is_the_full_cache_and_no_swaps_swaps_nothing(smollm2):
    model, tok = smollm2
    variants = [v for v in ab.VARIANTS if v.name in ("true K/V", "no swaps", "shipped")]
    records = {r["variant"]: r for r in lm_ablation(model, tok, variants, [0.5], 128)}   # 32 slots: 1 cell per row
    assert records["true K/V"]["ppl_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert records["true K/V"]["kl"] < 1e-4
    assert records["no swaps"]["swaps"] == 0 and records["shipped"]["swaps"] > 0


@pytest.mark.slow
def test_smollm2_lemma2_values_follow_the_lemma_keys_do_not(smollm2):
    """At 512 tokens and a 10% budget: the values' error is within a factor 3 of Lemma 2's prediction, the keys'
    far above it (their mean is summed too), and the repair brings both down to about one variance."""
    model, tok = smollm2
    rows = ab.lemma2(model, tok, 512, 0.1, {"shipped": KVReviverPolicy, "centred+shrunk": ab.CentredShrunk})
    shipped = [r for r in rows if r["policy"] == "shipped"]
    repaired = [r for r in rows if r["policy"] == "centred+shrunk"]
    median = lambda xs: sorted(xs)[len(xs) // 2]                             # noqa: E731
    assert 1 / 3 < median([r["value_mse"] / r["predicted"] for r in shipped]) < 3
    assert median([r["key_mse"] / r["predicted"] for r in shipped]) > 10
    assert median([r["key_mse"] for r in repaired]) < 2 and median([r["value_mse"] for r in repaired]) < 2
    assert all(math.isfinite(r["key_mean_ratio"]) for r in shipped)
