"""
Side by side: ``step_many`` steps many caches at once and gives each exactly what it gives that cache
alone, and what ``LeanDecoder.step`` gives it to float rounding (the evaluation's ``traces`` rely on it;
``test_harness.py`` checks the traces themselves).
"""

from __future__ import annotations

import pytest
import torch

from experiments.evaluation.side_by_side import ROWS, blocked_linear, extend_many, step_many
from fastpath.lean import LeanDecoder
from methods import make_policy
from nanollm import KVCache, extend, prefill, preset


def test_step_many_is_each_cache_stepped_alone(make_model):
    """step_many over caches of different methods, lengths, batch sizes and positions gives every cache
    exactly (bit for bit) what step_many gives it alone, for any number of caches side by side and any
    place in the block of rows: a trace must not depend on which others ran beside it. Each also agrees with
    LeanDecoder.step (one cache, unblocked products) to float rounding. (Stacking the products over the
    rows without padding them to a fixed block makes this test fail on the development machine: a single
    row runs a matrix-vector kernel that rounds differently.)"""
    model = make_model(preset("TINY"), seed=3)
    lean = LeanDecoder(model)
    setups = [(None, 1, 9, 12), ("h2o", 1, 20, 12), ("snapkv", 2, 14, 12), (None, 2, 5, 12),
              ("kvreviver", 1, 40, 30), ("scissorhands", 1, 17, 12), ("adakv", 1, 25, 12)]   # kvreviver: a sketch

    def fresh(order):                                # the setups in ``order``, each prefilled with its own prompt
        caches, streams = [], []
        for name, B, n_prompt, budget in [setups[j] for j in order]:
            ids = torch.randint(0, 512, (B, n_prompt + 8), generator=torch.Generator().manual_seed(n_prompt))
            cache = KVCache(model.config, make_policy(name, budget=budget) if name else None)
            prefill(model, ids[:, :n_prompt], cache)
            caches.append(cache), streams.append(ids[:, n_prompt:])
        return caches, streams

    everything = list(range(len(setups)))
    alone = [fresh([j]) for j in everything]                          # each cache on its own
    singles = [[step_many(lean, [s[0][:, t]], c) for t in range(8)] for c, s in alone]
    lean_caches, streams = fresh(everything)                           # the reference step, one cache at a time
    for t in range(8):
        for j, (s, c) in enumerate(zip(streams, lean_caches)):
            logits, hidden = lean.step_with_hidden(s[:, t], c)
            torch.testing.assert_close(singles[j][t][0], logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(singles[j][t][1], hidden, rtol=1e-5, atol=1e-5)
    n_rows = sum(B for _, B, _, _ in setups)
    for order in ([1, 2], everything, everything[::-1], [4, 0, 6, 3]):          # other rows, other places
        together, streams = fresh(order)
        extra, _ = fresh([0] * (ROWS - n_rows + 2)) if order == everything else ([], None)   # > one block
        extra_streams = [torch.zeros(1, 8, dtype=torch.long)] * len(extra)
        for t in range(8):
            logits, hidden = step_many(lean, [s[:, t] for s in streams + extra_streams], together + extra)
            first = 0
            for j, s in zip(order, streams):
                rows = slice(first, first + s.shape[0])
                assert torch.equal(logits[rows], singles[j][t][0]), (order, j, t)
                assert torch.equal(hidden[rows], singles[j][t][1]), (order, j, t)
                first += s.shape[0]
        for j, b in zip(order, together):
            a = alone[j][0][0]
            assert a.seen == b.seen
            for la, lb in zip(a.layers, b.layers):
                assert torch.equal(la.k, lb.k) and torch.equal(la.v, lb.v) and torch.equal(la.pos, lb.pos)
                assert la.state.keys() == lb.state.keys()
                assert all(torch.equal(la.state[n], lb.state[n]) for n in la.state)
    assert all(alone[4][0][0].policy._sketch.values())   # KVReviver stepped over entries rebuilt from its sketch

    c, others = alone[0][0][0], alone[1][0]
    seen, k0 = c.seen, c.layers[0].k.clone()
    with pytest.raises(ValueError, match="already holds a prefix"):     # checked before any cache changes
        step_many(lean, [torch.tensor([1]), torch.tensor([2])], [c, KVCache(model.config)])
    assert c.seen == seen and torch.equal(c.layers[0].k, k0)
    with pytest.raises(ValueError, match="one token tensor per cache"):
        step_many(lean, [torch.tensor([1])], [c, others[0]])
    with pytest.raises(ValueError, match="appears twice"):
        step_many(lean, [torch.tensor([1]), torch.tensor([2])], [c, c])


def test_extend_many_is_each_cache_extended_alone(make_model):
    """extend_many (the question after a shared prompt, onto every cache at once) gives each cache exactly what
    it gives that cache alone, beside any others in any order (logits, entries, per-slot state, bit for bit),
    and agrees with ``extend``, the model's own pass, to float rounding with the same entries kept; a chunk of
    one token too."""
    model = make_model(preset("TINY"), seed=3)
    lean = LeanDecoder(model)
    names = [None, "h2o", "snapkv", "kvreviver", "scissorhands", "streaming_llm"]
    ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(1))
    prompt, chunk = ids[:, :36], ids[0, 36:]                                    # a 12-token question

    def fresh(order):
        caches = [KVCache(model.config, make_policy(names[j], budget=20) if names[j] else None) for j in order]
        for cache in caches:
            prefill(model, prompt, cache)
        return caches

    alone = [(fresh([j]), None) for j in range(len(names))]
    alone = [(c, extend_many(lean, chunk, c)) for c, _ in alone]
    for order in ([1, 2], list(range(len(names))), [5, 3, 0, 4]):
        caches = fresh(order)
        logits = extend_many(lean, chunk, caches)
        for row, (j, b) in enumerate(zip(order, caches)):
            a = alone[j][0][0]
            assert torch.equal(logits[row], alone[j][1][0]), (order, j)
            assert a.seen == b.seen == 48
            for la, lb in zip(a.layers, b.layers):
                assert torch.equal(la.k, lb.k) and torch.equal(la.v, lb.v) and torch.equal(la.pos, lb.pos)
                assert all(torch.equal(la.state[n], lb.state[n]) for n in la.state)
    for j in range(len(names)):                                                 # the model's own pass
        [cache] = fresh([j])
        want = extend(model, chunk[None], cache)[0, -1]
        torch.testing.assert_close(alone[j][1][0], want, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(a.pos, b.pos) for a, b in zip(alone[j][0][0].layers, cache.layers))
    assert alone[3][0][0].policy._sketch                                        # KVReviver compressed into its sketch
    for j in range(len(names)):                                                 # one token
        [a], [b] = fresh([j]), fresh([j])
        torch.testing.assert_close(extend_many(lean, chunk[:1], [a])[0], extend(model, chunk[None, :1], b)[0, -1],
                                   rtol=1e-5, atol=1e-5)


def test_extend_many_checks_before_any_cache_changes(make_model):
    model = make_model(preset("TINY"), seed=3)
    lean = LeanDecoder(model)
    a, b, pair = KVCache(model.config), KVCache(model.config), KVCache(model.config)
    prefill(model, torch.arange(10)[None], a)
    prefill(model, torch.arange(12)[None], b)
    prefill(model, torch.arange(20).view(2, 10), pair)
    k0 = a.layers[0].k.clone()
    for caches, chunk in (([a, b], torch.arange(3)), ([a, pair], torch.arange(3)), ([a, a], torch.arange(3)),
                          ([a], torch.arange(0)), ([a, KVCache(model.config)], torch.arange(3)),
                          ([a], torch.tensor([model.config.vocab_size])),
                          ([a], torch.zeros(model.config.max_seq_len, dtype=torch.long)), ([], torch.arange(3))):
        with pytest.raises(ValueError, match="extend_many|at least one token|exceeds|must lie in"):
            extend_many(lean, chunk, caches)
    assert a.seen == 10 and torch.equal(a.layers[0].k, k0)


def test_a_step_reads_each_weight_once_per_block_of_rows(make_model, monkeypatch):
    """The point of step_many: 5 caches (7 rows) take one product per weight, not one per cache; ROWS + 1
    rows take two."""
    import experiments.evaluation.side_by_side as sbs
    model = make_model(preset("TINY"), seed=3)
    lean, calls = LeanDecoder(model), []
    real = sbs.F.linear
    monkeypatch.setattr(sbs.F, "linear", lambda t, w, *b: calls.append(t.shape[0]) or real(t, w, *b))
    per_step = 4 * model.config.n_layer + 1                  # qkv, o, gate-up, down per layer; the LM head
    for n_caches, B in [(5, [1, 2, 1, 2, 1]), (ROWS + 1, [1] * (ROWS + 1))]:
        caches = []
        for b in B:
            cache = KVCache(model.config, make_policy("h2o", budget=6))
            prefill(model, torch.randint(0, 512, (b, 9)), cache)
            caches.append(cache)
        calls.clear()
        step_many(lean, [torch.zeros(b, dtype=torch.long) for b in B], caches)
        blocks = -(-sum(B) // ROWS)
        assert len(calls) == blocks * per_step and set(calls) == {ROWS}, (n_caches, len(calls))


def test_blocked_linear_is_a_product_whose_rows_ignore_each_other():
    """blocked_linear equals F.linear to float rounding for any row count, and a row's result is bit for bit
    the same whatever rows surround it and wherever it sits (across blocks too)."""
    g = torch.Generator().manual_seed(0)
    w, row = torch.randn(48, 40, generator=g), torch.randn(40, generator=g)
    ref = blocked_linear(row[None], w)[0]
    torch.testing.assert_close(ref, row @ w.T, rtol=1e-5, atol=1e-5)
    for R, at in [(2, 1), (ROWS, 0), (ROWS, ROWS - 1), (ROWS + 3, ROWS + 1), (3 * ROWS, 2 * ROWS - 1)]:
        t = torch.randn(R, 40, generator=g)
        t[at] = row
        out = blocked_linear(t, w)
        assert out.shape == (R, 48)
        assert torch.equal(out[at], ref), (R, at)
        torch.testing.assert_close(out, t @ w.T, rtol=1e-5, atol=1e-5)
