"""
Evicting in place (issue: decode-time eviction at the speed of the bytes it saves) changes where entries sit,
never which: a method that drops a token at every decode step (``ScoringPolicy.evict``: the freed slot takes
the next token) keeps, step after step, the same set of (position, key, value) as the same method compacting
the storage at every step (``LayerKV.keep``, what every step did before), gives the same greedy answer and
logits equal up to the order the attention sums its entries in (fp32, 1e-4 on logits of size ~10). On the
bundled model here, on SmolLM2 in the slow tier. KVReviver's swaps, now decided all at once, against the
loop of Algorithm 3.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from methods import make_policy
from methods.kvreviver import KVReviverPolicy
from nanollm import KVCache, LayerKV, decode_step, prefill
from nanollm.policy import ScoringPolicy, select_topk
from nanollm.slots import select_lowest
from tests.held import by_position, held

DECODE_METHODS = [("streaming_llm", {}), ("h2o", {}), ("h2o", {"n_recent": 0}), ("scissorhands", {}),
                  ("scissorhands", {"history_window": 8, "n_recent": 2}), ("scissorhands", {"drop": 3})]


@pytest.fixture(scope="module")
def bundled_model(bundled):
    return bundled[0]


def greedy(model, policy, prompt: torch.Tensor, steps: int) -> tuple[list, list, list]:
    """Greedy decoding from ``prompt`` (1, T): every step's logits, the tokens, and every layer's entries by
    position after every step."""
    cache = KVCache(model.config, policy)
    logits, tokens, entries = [prefill(model, prompt, cache)[:, -1]], [], []
    for _ in range(steps):
        tokens.append(logits[-1].argmax(-1))
        logits.append(decode_step(model, tokens[-1], cache))
        entries.append([by_position(layer) for layer in cache.layers])
    return logits, tokens, entries


def compare(model, spec: str, opts: dict, prompt: torch.Tensor, budget: int, steps: int, monkeypatch) -> None:
    in_place = greedy(model, make_policy(spec, budget, **opts), prompt, steps)
    with monkeypatch.context() as m:
        m.setattr(ScoringPolicy, "evicts_in_place", False)              # every decode step compacts
        compacting = greedy(model, make_policy(spec, budget, **opts), prompt, steps)
    for step, (a, b) in enumerate(zip(in_place[1], compacting[1])):
        assert torch.equal(a, b), f"{spec}: the greedy answers part at step {step}"
    for step, (a, b) in enumerate(zip(in_place[0], compacting[0])):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=f"{spec}: logits at step {step}")
    for step, (a, b) in enumerate(zip(in_place[2], compacting[2])):
        for layer, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x[2], y[2]), f"{spec}: step {step}, layer {layer}: the positions held differ"
            for name, s, t in zip(("keys", "values"), x, y):     # past layer 0: from outputs equal to ~1e-6
                torch.testing.assert_close(s, t, rtol=1e-5, atol=1e-4, msg=f"{spec}: step {step}, {layer}: {name}")


@pytest.mark.parametrize("spec,opts", DECODE_METHODS, ids=lambda x: str(x))
def test_in_place_keeps_what_compacting_keeps_bundled(bundled_model, spec, opts, monkeypatch):
    prompt = torch.randint(3, 500, (1, 96), generator=torch.Generator().manual_seed(1))
    compare(bundled_model, spec, opts, prompt, budget=24, steps=40, monkeypatch=monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["streaming_llm", "h2o", "scissorhands"])
def test_in_place_keeps_what_compacting_keeps_smollm2(smollm2, spec, monkeypatch):
    model, tok = smollm2
    text = "The storage keeps keys and values of every token it has seen, and evicts the least useful ones. " * 4
    compare(model, spec, {}, torch.tensor([tok.encode(text)[:80]]), budget=32, steps=24, monkeypatch=monkeypatch)


def test_an_evicted_slot_takes_the_next_token(bundled_model):
    """The mechanism itself: after a decode step's eviction, the storage has one free slot per head and the
    next token is written there; the number of slots in use stops growing."""
    cache = KVCache(bundled_model.config, make_policy("h2o", 16))
    prefill(bundled_model, torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(2)), cache)
    decode_step(bundled_model, torch.tensor([7]), cache)
    layer = cache.layers[0]
    n, free = layer.n, layer.free.clone()                                # (B, H_kv, 1) the emptied slots
    assert free.shape[-1] == 1 and bool((layer.pos.gather(-1, free) == -1).all())
    decode_step(bundled_model, torch.tensor([8]), cache)
    assert layer.n == n, "a decode step after an eviction must not add a slot"
    assert bool((layer.pos.gather(-1, free) == cache.seen - 1).all()), "the new token must take the emptied slot"


class LoopSwaps(KVReviverPolicy):
    """KVReviver with Algorithm 3's swap loop as written: one swap at a time, C's minimum against V's maximum
    (the implementation before the swaps were taken at once)."""

    def _swap(self, sketch, scores, k, v, p, recent_from, approx, max_swaps):
        in_raw = torch.zeros(scores.shape[0], dtype=torch.bool)
        in_raw[p] = True
        copied = False
        for _ in range(max_swaps):
            cand, vague = (p < recent_from).nonzero().flatten(), (~in_raw).nonzero().flatten()
            if cand.numel() == 0 or vague.numel() == 0:
                break
            c, j = cand[scores[p[cand]].argmin()], vague[scores[vague].argmax()]
            if not scores[p[c]] * self.replace_rate < scores[j]:
                break
            if not copied:
                k, v, p, copied = k.clone(), v.clone(), p.clone(), True
            jk, jv = sketch.query(j.view(1))
            sketch.delete(j.view(1), jk, jv)
            sketch.insert(p[c].view(1), k[:, c].unsqueeze(0), v[:, c].unsqueeze(0))
            in_raw[p[c]], in_raw[j] = False, True
            k[:, c], v[:, c], p[c] = jk[0].to(k.dtype), jv[0].to(v.dtype), j
            approx[j] = True
            self.swaps += 1
        if copied:
            order = p.argsort()
            k, v, p = k[:, order], v[:, order], p[order]
        return k, v, p


@pytest.mark.parametrize("opts", [{"replace_rate": 1.0}, {"replace_rate": 1.1, "per_kv_head": True},
                                  {"injective_hash": True, "sketch_width": 512, "replace_rate": 1.0,
                                   "candidate_share": 0.6}])
def test_kvreviver_swaps_at_once_are_the_loops(bundled_model, opts):
    """The same swaps, step after step (how many, which tokens revived), the same entries held, the same
    logits, bit for bit: the swaps are decided at once and the sketch updated in the loop's order."""
    prompt = torch.randint(3, 500, (1, 96), generator=torch.Generator().manual_seed(3))
    a_policy, b_policy = KVReviverPolicy(40, **opts), LoopSwaps(40, **opts)
    a, b = greedy(bundled_model, a_policy, prompt, 30), greedy(bundled_model, b_policy, prompt, 30)
    assert a_policy.swaps == b_policy.swaps > 0
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1])), "the greedy answers differ"
    for step, (x, y) in enumerate(zip(a[2], b[2])):
        assert all(torch.equal(s, t) for u, w in zip(x, y) for s, t in zip(u, w)), f"step {step}: entries differ"
    for step, (x, y) in enumerate(zip(a[0], b[0])):
        assert torch.equal(x, y), f"step {step}: logits differ"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("rate", [1.0, 1.5])
def test_kvreviver_many_swaps_in_one_step(seed, rate):
    """One call of the swap step on random tables, where many swaps happen at once (scores drawn so that V
    often beats C): the same tokens revived, the same entries returned, the same sketch cells (an injective
    hash here; the bundled-model test above covers shared cells)."""
    g = torch.Generator().manual_seed(seed)
    N, G, d = 60, 2, 4
    p = torch.randperm(N, generator=g)[:24].sort().values                     # raw positions (R and C)
    recent_from = int(p[-6])                                                  # the last 6 raw are Recent
    scores = torch.rand(N, generator=g)
    k, v = torch.randn(G, 24, d, generator=g), torch.randn(G, 24, d, generator=g)
    results = []
    for cls in (KVReviverPolicy, LoopSwaps):
        policy = cls(40, replace_rate=rate, injective_hash=True, sketch_width=N)
        sketch = policy.sketch_class(3, N, G, d, seed=0, injective=True)
        vague = torch.tensor([j for j in range(N) if j not in set(p.tolist())])
        sketch.insert(vague, torch.randn(len(vague), G, d, generator=torch.Generator().manual_seed(9)),
                      torch.randn(len(vague), G, d, generator=torch.Generator().manual_seed(10)))
        approx = torch.zeros(N, dtype=torch.bool)
        out = policy._swap(sketch, scores, k, v, p, recent_from, approx, max_swaps=18)
        results.append((out, approx, sketch.key.clone(), sketch.value.clone(), policy.swaps))
    (a, a_approx, a_key, a_value, a_swaps), (b, b_approx, b_key, b_value, b_swaps) = results
    assert a_swaps == b_swaps and torch.equal(a_approx, b_approx)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(a_key, b_key) and torch.equal(a_value, b_value)
    if rate == 1.0:
        assert a_swaps > 1, "the case must swap more than once in a step"


class Indifferent(ScoringPolicy):
    """A scorer to which every entry is worth the same (score 0), evicting at every step: every choice is a
    tie, broken by position (the earlier is kept) however the slots are ordered."""

    compress_on = ("prefill", "decode")

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def score(self, ctx):
        return torch.zeros(ctx.kv.pos.shape)


def test_a_compaction_after_in_place_steps_breaks_ties_by_position():
    """Slots evicted in place hold newer tokens than the slots after them (here slot 1 holds position 5). A
    compaction that follows (an extend chunk) must keep, among equal scores, the earlier positions, as the
    compacting path always did, not the earlier slots."""
    pos = torch.tensor([[[0, 5, 2, 3]]])                                     # (B, H_kv, T) after a reuse
    kv = LayerKV(torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2), pos)
    ctx = SimpleNamespace(kv=kv, seen=6, phase="decode")
    assert held(kv.pos.gather(-1, Indifferent(2).select(ctx))) == [[[0, 2]]]
    assert held(kv.pos.gather(-1, Indifferent(3).select(ctx))) == [[[0, 2, 3]]]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_select_lowest_drops_what_select_topk_drops(n):
    """``select_lowest`` (the decode step's eviction, no sort; for one slot no host wait either) against
    ``select_topk``'s complement, on scores full of ties, NaNs and -infs (NaN counts as -inf), slots in any
    position order, some staying: the same slots every time."""
    g = torch.Generator().manual_seed(n)
    for _ in range(200):
        B, H_kv, T = 2, 3, 9
        scores = torch.randint(0, 3, (B, H_kv, T), generator=g).float()          # many ties
        scores[torch.rand(B, H_kv, T, generator=g) < 0.1] = float("nan")
        scores[torch.rand(B, H_kv, T, generator=g) < 0.1] = float("-inf")
        pos = torch.stack([torch.randperm(T, generator=g) for _ in range(B * H_kv)]).view(B, H_kv, T)
        stays = torch.rand(B, H_kv, T, generator=g) < 0.3
        stays[..., :n + 1] = False                                               # room for n to go
        ranked = scores.masked_fill(stays, float("inf"))                          # select_topk maps NaN
        kept = select_topk(ranked, T - n, pos)                                   # (B, H_kv, T - n) ascending
        dropped = torch.ones(B, H_kv, T, dtype=torch.bool).scatter(-1, kept, False)
        got = select_lowest(scores, pos, stays, n)
        assert torch.equal(torch.zeros_like(dropped).scatter(-1, got, True), dropped)
