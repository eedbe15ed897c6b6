"""KVReviver: the Vague sketch (Algorithms 1-2), the Recent / Candidate / Vague storage (Algorithm 3) and the
rebuilt cache (Algorithm 4)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastpath.lean import LeanDecoder
from kernels.count_sketch import reference_sketch_insert, reference_sketch_query
from methods import make_policy
from methods.kvreviver import KVReviverPolicy
from methods.kvreviver_sketch import VagueSketch
from nanollm import CachePolicy, KVCache, decode_step, extend, prefill, preset


def tokens(n: int, seed: int = 0, H_kv: int = 2, d: int = 4, mean: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H_kv, d, generator=g) + mean, torch.randn(n, H_kv, d, generator=g) + mean


# ---------------------------------------------------------------------------------------------------------
# The sketch

def test_median_over_rows_by_hand():
    """Three rows of one cell each hold key sums 1, 5, 3 for token J: the estimate is the median 3."""
    s = VagueSketch(rows=3, width=1, n_kv_head=1, head_dim=1, seed=0)
    s.key[:, 0, 0, 0] = torch.tensor([1.0, 5.0, 3.0])
    k, _ = s.query(torch.tensor([7]))
    assert k.item() == 3.0


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_sketch_arithmetic_is_the_kernels_reference(rows):
    """VagueSketch.insert and .query (the method's own PyTorch, Algorithms 1-2) equal the plain definitions in
    kernels/count_sketch.py that the kernels are tested against, so the two cannot drift apart: two inserts
    with collisions (the second of fp16 tokens), a delete, then a query of inserted and never-inserted
    positions. Inserts sum the same numbers (in the same order here: atol only for rounding); a median only
    selects, so queries agree exactly."""
    s = VagueSketch(rows=rows, width=5, n_kv_head=2, head_dim=4, seed=rows)
    key, value = s.key.clone(), s.value.clone()
    for first, n, seed, dtype in ((0, 12, 1, torch.float32), (30, 7, 2, torch.float16)):
        pos = torch.arange(first, first + n)
        k, v = (t.to(dtype) for t in tokens(n, seed=seed))
        s.insert(pos, k, v)
        reference_sketch_insert(key, value, s.buckets(pos).int(), s.signs(pos), k, v)
    s.delete(pos, k, v)
    reference_sketch_insert(key, value, s.buckets(pos).int(), s.signs(pos), -k, -v)
    torch.testing.assert_close(s.key, key, rtol=0, atol=1e-6)
    torch.testing.assert_close(s.value, value, rtol=0, atol=1e-6)
    pos = torch.arange(45)
    for own, ref in zip(s.query(pos), reference_sketch_query(s.key, s.value, s.buckets(pos).int(), s.signs(pos))):
        assert torch.equal(own, ref)


def test_covered_hashes_are_the_formulas():
    """``cover(n)`` hashes positions 0..n-1 once into tables; ``buckets`` and ``signs`` then read them, to the
    same values as the formulas, at the table's first and last positions too, and after it grows."""
    plain = VagueSketch(rows=3, width=7, n_kv_head=1, head_dim=2, seed=5)
    tabled = VagueSketch(rows=3, width=7, n_kv_head=1, head_dim=2, seed=5)
    for n in (1, 300, 1000):
        tabled.cover(n)
        assert tabled.covered >= n
        pos = torch.cat([torch.arange(n), torch.tensor([0, n - 1])])
        assert torch.equal(tabled.buckets(pos), plain.buckets(pos))
        assert torch.equal(tabled.signs(pos), plain.signs(pos))


def test_insert_then_delete_restores_the_cells():
    s = VagueSketch(rows=3, width=5, n_kv_head=2, head_dim=4, seed=1)
    k, v = tokens(20, seed=1)
    s.insert(torch.arange(20), k, v)
    before = (s.key.clone(), s.value.clone())
    k2, v2 = tokens(3, seed=2)
    s.insert(torch.tensor([30, 31, 32]), k2, v2)
    s.delete(torch.tensor([30, 31, 32]), k2, v2)
    torch.testing.assert_close(s.key, before[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(s.value, before[1], rtol=0, atol=1e-6)


def test_injective_hash_reconstructs_exactly():
    s = VagueSketch(rows=3, width=64, n_kv_head=2, head_dim=4, seed=0, injective=True)
    k, v = tokens(40, seed=3)
    s.insert(torch.arange(40), k, v)
    k_hat, v_hat = s.query(torch.arange(40))
    assert torch.equal(k_hat, k) and torch.equal(v_hat, v)


def test_values_unbiased_keys_biased_over_seeds():
    """Many tokens with mean 1 collide: averaged over hash seeds the value error is ~0 (signs), the key
    error is not (keys are summed without signs, so collisions add the others' mean)."""
    k, v = tokens(60, seed=4, mean=1.0)
    k_err, v_err = [], []
    for seed in range(200):
        s = VagueSketch(rows=3, width=8, n_kv_head=2, head_dim=4, seed=seed)
        s.insert(torch.arange(60), k, v)
        k_hat, v_hat = s.query(torch.arange(60))
        k_err.append((k_hat - k).mean()), v_err.append((v_hat - v).mean())
    assert abs(float(torch.stack(v_err).mean())) < 0.15
    assert float(torch.stack(k_err).mean()) > 2.0


def test_error_decreases_with_width():
    k, v = tokens(200, seed=5)
    errors = []
    for width in [4, 16, 64, 256]:
        mse = []
        for seed in range(5):
            s = VagueSketch(rows=3, width=width, n_kv_head=2, head_dim=4, seed=seed)
            s.insert(torch.arange(200), k, v)
            mse.append(float((s.query(torch.arange(200))[1] - v).pow(2).mean()))
        errors.append(sum(mse) / len(mse))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors


# ---------------------------------------------------------------------------------------------------------
# The policy on a model

@pytest.fixture(scope="module")
def model(make_model):
    return make_model(preset("TINY"), seed=0)


def ids(n: int, seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


def script(model, policy: CachePolicy | None, check=None):
    cache = KVCache(model.config, policy)
    out = [prefill(model, ids(40), cache)]
    if check:
        check(cache)
    for t in range(4):
        out.append(decode_step(model, ids(1, seed=10 + t)[:, 0], cache))
        if check:
            check(cache)
    out.append(extend(model, ids(5, seed=20), cache))
    if check:
        check(cache)
    return out, cache


def test_the_policy_hashes_through_tables_to_the_same_cache(model):
    """A decode with a sketch hashes through the tables (covered up to the positions seen), and its outputs and
    kept entries are those of the same policy hashing by the formulas (a sketch that never covers)."""
    policy = KVReviverPolicy(budget=16, sketch_width=4)
    out, cache = script(model, policy)
    sketches = [s for layer in policy._sketch.values() for s in layer]
    assert sketches and all(s.covered >= 49 for s in sketches)
    formulas = KVReviverPolicy(budget=16, sketch_width=4)
    formulas.use_sketch(type("Formulas", (VagueSketch,), {"cover": lambda self, n: None}))
    out_f, cache_f = script(model, formulas)
    assert all(torch.equal(a, b) for a, b in zip(out, out_f))
    assert all(torch.equal(a.k, b.k) and torch.equal(a.pos, b.pos) for a, b in zip(cache.layers, cache_f.layers))


def test_a_sketch_class_is_chosen_before_the_policy_runs(model):
    """``use_sketch`` sets the class of the sketches a policy builds, and is refused once it has built some
    (a policy whose layers held sketches of two classes would rebuild its entries two ways)."""
    policy = KVReviverPolicy(budget=16, sketch_width=4)
    mine = type("Mine", (VagueSketch,), {})
    policy.use_sketch(mine)
    script(model, policy)
    assert {type(s) for layer in policy._sketch.values() for s in layer} == {mine}
    with pytest.raises(RuntimeError, match="before it runs"):
        policy.use_sketch(VagueSketch)


def test_budget_covering_the_sequence_is_the_full_cache(model):
    full, _ = script(model, None)
    out, cache = script(model, make_policy("kvreviver", 49))
    assert all(torch.equal(a, b) for a, b in zip(full, out))
    assert cache.policy.slot_nbytes() == 0                    # the sketch was never needed


def test_injective_sketch_gives_the_full_cache_within_rounding(model):
    """Everything outside R and C goes to a sketch whose hash is injective: reconstruction is exact, so only
    the order of summation differs from the full cache."""
    full, _ = script(model, None)
    policy = make_policy("kvreviver", 20, sketch_width=64, injective_hash=True)
    out, cache = script(model, policy)
    assert policy.parts(0, cache.layers[0])["V"] > 0           # tokens really live in the sketch
    for a, b in zip(full, out):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_rebuilding_by_chunks_is_rebuilding_at_once(model, monkeypatch, per_kv_head):
    """Algorithm 4 rebuilds the vague positions ``REBUILD_CHUNK`` at a time (the cells gathered for a chunk
    stay in the CPU's cache); each position's estimate depends on its own cells only, so any chunk size gives
    the same rebuilt entries and the same logits, bit for bit: chunks of 3 (several per layer, the last one
    short) against one chunk for everything."""
    runs = []
    for chunk in (3, 10**9):
        monkeypatch.setattr("methods.kvreviver.REBUILD_CHUNK", chunk)
        out, cache = script(model, make_policy("kvreviver", 20, sketch_width=4, per_kv_head=per_kv_head))
        runs.append((out, [cache.policy.attend_kv(i, layer) for i, layer in enumerate(cache.layers)]))
    (out_a, rebuilt_a), (out_b, rebuilt_b) = runs
    assert all(torch.equal(a, b) for a, b in zip(out_a, out_b))
    assert cache.policy.parts(0, cache.layers[0])["V"] > 2 * 3                # several chunks of vague positions
    for a, b in zip(rebuilt_a, rebuilt_b):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.pos, b.pos)


def test_accounting_swaps_and_scores_after_every_step(model):
    H = model.config.n_head
    policy = make_policy("kvreviver", 30, recent_slack=2)
    totals = []

    def check(cache):
        for layer, store in enumerate(cache.layers):
            parts = policy.parts(layer, store)
            assert parts["R"] <= policy.recent_budget + policy.slack_in_effect
            assert parts["C"] <= policy.candidate_budget
            assert parts["cells"] == policy.rows * policy.width
            assert parts["R"] + parts["C"] + parts["cells"] <= policy.budget
            assert parts["R"] + parts["C"] + parts["V"] == cache.seen
            scores = policy._scores[layer]                                  # (B, N)
            for b in range(scores.shape[0]):                               # swap invariant (Algorithm 3)
                raw = store.pos[b, 0]
                recent_from = cache.seen - policy._recent[layer]
                cand = scores[b, raw[raw < recent_from]]
                vague = torch.ones(cache.seen, dtype=torch.bool)
                vague[raw] = False
                if cand.numel() and vague.any():
                    assert float(cand.min()) * policy.replace_rate >= float(scores[b, vague].max()) - 1e-6
        totals.append(policy._scores[0].sum(-1))

    script(model, policy, check)
    # every attention row sums to 1: each step adds (query heads x query rows) to a layer's scores
    steps = [40, 1, 1, 1, 1, 5]
    expected = torch.tensor(steps).cumsum(0) * H
    for total, want in zip(totals, expected):
        torch.testing.assert_close(total, torch.full_like(total, float(want)), rtol=1e-5, atol=1e-3)
    assert policy.swaps >= 0


INF, LOWEST = float("inf"), torch.finfo(torch.float32).min


@pytest.mark.parametrize("c_scores, v_scores, rate, recent_from, swapped", [
    ([1.0, 2.0], [0.5, 1.1 + 1e-5], 1.1, 2, [4]),    # V's best beats C's lowest by the rate, barely: one swap
    ([1.0, 2.0], [0.5, 1.1], 1.1, 2, []),            # ties the test: no swap
    ([1.0, 2.0], [2.3, 2.4], 1.1, 2, [3, 4]),        # both pairs win (C's i-th lowest with V's i-th highest)
    ([float("nan"), 1.0], [0.5, 1.2], 1.1, 2, [4]),  # C's NaN ranks after every number: 1.0 is its lowest
    ([1.0, 2.0], [float("nan"), 5.0], 1.1, 2, []),   # V's NaN ranks first, and no number beats it: no swap
    ([-INF, 2.0], [LOWEST, -INF], 1.0, 2, [3]),      # -inf in C: beaten by any number, the lowest float too
    ([1.0, 2.0], [INF, 0.5], 1.0, 2, [3]),           # +inf in V beats C's lowest
    ([1.0, 2.0], [INF, 0.5], 1.0, 0, []),            # ... but C is empty (every raw slot in R): no pair to test
])
def test_the_swap_decision_by_hand(c_scores, v_scores, rate, recent_from, swapped):
    """Algorithm 3's swap loop on one group: C holds positions 0, 1 (none where ``recent_from`` is 0), R
    position 2 (its score 0.0, below every other, is never C's lowest), V positions 3, 4. The positions
    revived are those expected."""
    policy = KVReviverPolicy(budget=64, replace_rate=rate)
    sketch = VagueSketch(rows=3, width=4, n_kv_head=1, head_dim=2, seed=0)
    sketch.cover(5)
    scores = torch.tensor(c_scores + [0.0] + v_scores)                   # (N,) by position
    p = torch.tensor([0, 1, 2])                                          # raw positions, in slot order
    k, v = torch.zeros(1, 3, 2), torch.zeros(1, 3, 2)
    approx = torch.zeros(5, dtype=torch.bool)
    _, _, p_new = policy._swap(sketch, scores, k, v, p, recent_from, approx, max_swaps=2)
    assert sorted(set(p_new.tolist()) - {0, 1, 2}) == swapped
    assert approx.nonzero().view(-1).tolist() == swapped


def test_memory_reports(model):
    policy = make_policy("kvreviver", 30)
    _, cache = script(model, policy)
    L, H_kv, d = model.config.n_layer, model.config.n_kv_head, model.config.head_dim
    assert policy.slot_nbytes() == L * 2 * (2 * policy.rows * policy.width * H_kv * d * 4)   # B=2, K and V
    assert policy.extra_nbytes() == L * 2 * cache.seen * 4                                    # dense scores
    assert policy.rebuilt_nbytes == 2 * 2 * H_kv * cache.seen * d * 4                         # one layer, all tokens


@pytest.mark.parametrize("bad", [{"rows": 0}, {"vague_share": 1.5}, {"candidate_share": -0.1},
                                 {"replace_rate": 0.9}, {"recent_slack": -1}, {"sketch_width": -2},
                                 {"injective_hash": "yes"}, {"candidate_share": 0.95, "vague_share": 0.1}])
def test_rejects_bad_options(bad):
    with pytest.raises(ValueError, match="|".join(bad)):
        make_policy("kvreviver", 40, **bad)


def test_split_of_the_budget():
    p = KVReviverPolicy(100)
    assert (p.width, p.candidate_budget, p.recent_budget) == (3, 45, 46)       # 0.1 / 0.45 / the rest
    assert KVReviverPolicy(1).recent_budget == 1                                # tiny budgets: Recent only


def test_revived_tokens_are_not_counted_as_exact(model):
    """A token revived from the sketch sits in a raw slot with its estimate: ``exact_positions`` marks it -1
    (the harness then counts its attention as lost), and only it."""
    policy = make_policy("kvreviver", 30, replace_rate=1.0)
    _, cache = script(model, policy)
    assert policy.swaps > 0, "this setting should revive tokens"
    marked = 0
    for layer, store in enumerate(cache.layers):
        exact = policy.exact_positions(layer, store)
        revived = policy._approx[layer].gather(1, store.pos[:, 0])[:, None, :].expand_as(store.pos)
        assert torch.equal(exact == -1, revived)
        assert torch.equal(exact[~revived], store.pos[~revived])
        marked += int(revived.sum())
    assert marked > 0


# ---------------------------------------------------------------------------------------------------------
# per_kv_head: each KV head keeps its own Recent / Candidate selection and its own sketch

def test_per_kv_head_budget_covering_the_sequence_is_the_full_cache(model):
    full, full_cache = script(model, None)
    out, cache = script(model, make_policy("kvreviver", 49, per_kv_head=True))
    assert all(torch.equal(a, b) for a, b in zip(full, out))
    assert all(torch.equal(a.pos, b.pos) for a, b in zip(full_cache.layers, cache.layers))
    assert cache.policy.slot_nbytes() == 0


def test_per_kv_head_injective_sketch_reconstructs_exactly(model):
    """Per KV head, an injective sketch holds every token outside that head's R and C alone in its cells: the
    rebuilt cache is the full cache's. Layer 0's keys and values depend on the tokens only, so there they
    are equal bit for bit; the logits differ only by the order of summation."""
    full, full_cache = script(model, None)
    policy = make_policy("kvreviver", 20, sketch_width=64, injective_hash=True, per_kv_head=True)
    out, cache = script(model, policy)
    assert all(policy.parts(0, cache.layers[0], head=h)["V"] > 0 for h in range(model.config.n_kv_head))
    rebuilt = policy.attend_kv(0, cache.layers[0])
    assert torch.equal(rebuilt.k, full_cache.layers[0].k) and torch.equal(rebuilt.v, full_cache.layers[0].v)
    for a, b in zip(full, out):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_per_kv_head_heads_keep_different_positions(model):
    """The shared selection keeps one set of positions per layer; per KV head, at least one layer's heads
    keep different ones, each head's Candidates being the best of its own scores (the swap invariant)."""
    shared, per_head = make_policy("kvreviver", 20), make_policy("kvreviver", 20, per_kv_head=True)
    _, c_shared = script(model, shared)
    _, c_head = script(model, per_head)
    assert all(bool((layer.pos == layer.pos[:, :1]).all()) for layer in c_shared.layers)
    assert any(not bool((layer.pos == layer.pos[:, :1]).all()) for layer in c_head.layers)
    for layer, store in enumerate(c_head.layers):
        scores = per_head._scores[layer]                                      # (B, H_kv, N)
        recent_from = c_head.seen - per_head._recent[layer]
        for b in range(scores.shape[0]):
            for h in range(scores.shape[1]):
                raw = store.pos[b, h]
                vague = torch.ones(c_head.seen, dtype=torch.bool)
                vague[raw] = False
                cand = scores[b, h, raw[raw < recent_from]]
                if cand.numel() and vague.any():
                    assert float(cand.min()) * per_head.replace_rate >= float(scores[b, h, vague].max()) - 1e-6


@pytest.mark.parametrize("preset_name", ["TINY", "TINY_GPT2"])
@pytest.mark.parametrize("budget", [1, 3, 12, 30])
def test_per_kv_head_accounting_after_every_step(make_model, preset_name, budget):
    """Every KV head: R + C raw slots + its r x b cells within the budget, R + C + V = every token seen, Recent
    kept, positions increasing; each step adds G x (query rows) to every head's scores; the sketch's bytes
    are those of the shared mode (H_kv sketches of one head = one of H_kv heads)."""
    m = make_model(preset(preset_name), seed=0)
    H_kv, G = m.config.n_kv_head, m.config.n_head // m.config.n_kv_head
    policy = make_policy("kvreviver", budget, per_kv_head=True, recent_slack=2 if budget > 12 else 0)
    totals = []

    def check(cache):
        for layer, store in enumerate(cache.layers):
            assert store.pos.shape[1] == H_kv
            for h in range(H_kv):
                parts = policy.parts(layer, store, head=h)
                assert parts["R"] <= policy.recent_budget + policy.slack_in_effect
                assert parts["C"] <= policy.candidate_budget
                assert parts["cells"] == policy.rows * policy.width     # this head's cells (all heads: the same)
                assert parts["R"] + parts["C"] + parts["cells"] <= policy.budget
                assert parts["R"] + parts["C"] + parts["V"] == cache.seen
                p = store.pos[:, h]
                assert bool((p[:, 1:] > p[:, :-1]).all()) and int(p.max()) < cache.seen
                assert set(policy.protected_positions(40, cache.seen)) <= set(p[0].tolist())
        totals.append(policy._scores[0].sum(-1))                                  # (B, H_kv)

    out, cache = script(m, policy, check)
    assert all(torch.isfinite(x).all() for x in out)
    steps = torch.tensor([40, 1, 1, 1, 1, 5]).cumsum(0) * G
    for total, want in zip(totals, steps):
        torch.testing.assert_close(total, torch.full_like(total, float(want)), rtol=1e-5, atol=1e-3)
    _, shared = script(m, make_policy("kvreviver", budget))
    assert policy.slot_nbytes() == shared.policy.slot_nbytes()
    assert policy.extra_nbytes() == H_kv * shared.policy.extra_nbytes()      # one score table per KV head


def test_per_kv_head_revived_tokens_are_not_counted_as_exact(model):
    policy = make_policy("kvreviver", 30, replace_rate=1.0, per_kv_head=True)
    _, cache = script(model, policy)
    assert policy.swaps > 0, "this setting should revive tokens"
    for layer, store in enumerate(cache.layers):
        revived = policy._approx[layer].gather(2, store.pos)                  # (B, H_kv, T)
        exact = policy.exact_positions(layer, store)
        assert torch.equal(exact == -1, revived)
        assert torch.equal(exact[~revived], store.pos[~revived])


def test_per_kv_head_rows_are_independent(model):
    """Each row of a batch keeps, per head, what it would keep alone, with the same logits."""
    policy = make_policy("kvreviver", 20, per_kv_head=True)
    out, cache = script(model, policy)
    cache_1 = KVCache(model.config, make_policy("kvreviver", 20, per_kv_head=True))
    out_1 = [prefill(model, ids(40)[1:], cache_1)]
    for t in range(4):
        out_1.append(decode_step(model, ids(1, seed=10 + t)[1:, 0], cache_1))
    out_1.append(extend(model, ids(5, seed=20)[1:], cache_1))
    for a, b in zip(out, out_1):
        torch.testing.assert_close(a[1:], b, rtol=0, atol=1e-5)
    assert all(torch.equal(a.pos[1:], b.pos) for a, b in zip(cache.layers, cache_1.layers))


class Reads(TorchDispatchMode):
    """Counts the operations whose result the host reads (on a GPU, a wait)."""
    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        mask = name == "index" and any(getattr(t, "dtype", None) == torch.bool for t in args[1])
        self.n += name in ("_local_scalar_dense", "nonzero", "masked_select") or mask
        return func(*args, **(kwargs or {}))


def test_a_decode_step_reads_the_device_once_a_layer_and_once_more_where_a_swap_wins(make_model):
    """On a GPU the host waits wherever it reads a tensor (``int(t)``, ``.item()``, ``nonzero``, a boolean
    mask's index). KVReviver's decode step reads one number per layer, whether V's best beats C's lowest, and a
    second where it does (how many swaps win): with swaps happening, more than one read a layer and step and at
    most one more per swap (the full cache's step reads none): counted on the CPU, operation by operation."""
    model = make_model(preset("TINY"), seed=3)
    lean = LeanDecoder(model)
    ids = torch.randint(0, 512, (1, 80), generator=torch.Generator().manual_seed(0))
    reads = {}
    for name, options in (("full", {"budget": None}), ("kvreviver", {"budget": 40, "replace_rate": 1.0})):
        cache = KVCache(model.config, make_policy(name, **options))
        prefill(model, ids[:, :60], cache)
        swaps = getattr(cache.policy, "swaps", 0)
        with Reads() as r:
            for t in range(60, 80):
                lean.step(ids[:, t], cache)
        reads[name], swaps = r.n, getattr(cache.policy, "swaps", 0) - swaps
    L = model.config.n_layer
    assert swaps > 0 and len(cache.policy._sketch) == L
    assert reads["full"] == 0 and 20 * L < reads["kvreviver"] <= 20 * L + swaps
