"""
Side by side: ``step_many`` steps many caches at once and gives each exactly what ``LeanDecoder.step`` gives
it alone (the evaluation's ``traces`` rely on it; ``test_harness.py`` checks the traces themselves).
"""

from __future__ import annotations

import pytest
import torch

from fastpath.lean import LeanDecoder
from methods import make_policy
from methods.evaluation.side_by_side import step_many
from nanollm import KVCache, prefill, preset


def test_step_many_is_each_cache_stepped_alone(make_model):
    """step_many over caches of different methods, lengths, batch sizes and positions gives every cache
    exactly (bit for bit) what LeanDecoder.step gives it alone, for any number of caches side by side: a trace must
    not depend on which others ran beside it. (Stacking any of the matrix products over all rows makes
    this test fail on the development machine: a product over many rows rounds differently.)"""
    model = make_model(preset("TINY"), seed=3)
    lean = LeanDecoder(model)
    setups = [(None, 1, 9, 12), ("h2o", 1, 20, 12), ("snapkv", 2, 14, 12), (None, 2, 5, 12),
              ("kvreviver", 1, 40, 30), ("scissorhands", 1, 17, 12), ("adakv", 1, 25, 12)]   # kvreviver: a sketch

    def fresh(k):                                    # the first k setups, each prefilled with its own prompt
        caches, streams = [], []
        for name, B, n_prompt, budget in setups[:k]:
            ids = torch.randint(0, 512, (B, n_prompt + 8), generator=torch.Generator().manual_seed(n_prompt))
            cache = KVCache(model.config, make_policy(name, budget=budget) if name else None)
            prefill(model, ids[:, :n_prompt], cache)
            caches.append(cache), streams.append(ids[:, n_prompt:])
        return caches, streams

    for k in (1, 2, 3, len(setups)):
        alone, streams = fresh(k)
        together, _ = fresh(k)
        for t in range(8):
            ref = [lean.step_with_hidden(s[:, t], c) for s, c in zip(streams, alone)]
            logits, hidden = step_many(lean, [s[:, t] for s in streams], together)
            assert torch.equal(logits, torch.cat([r[0] for r in ref]))
            assert torch.equal(hidden, torch.cat([r[1] for r in ref]))
        for a, b in zip(alone, together):
            assert a.seen == b.seen
            for la, lb in zip(a.layers, b.layers):
                assert torch.equal(la.k, lb.k) and torch.equal(la.v, lb.v) and torch.equal(la.pos, lb.pos)
                assert la.state.keys() == lb.state.keys()
                assert all(torch.equal(la.state[n], lb.state[n]) for n in la.state)
    assert all(together[4].policy._sketch.values())   # KVReviver stepped over entries rebuilt from its sketch

    c = alone[0]
    seen, k0 = c.seen, c.layers[0].k.clone()
    with pytest.raises(ValueError, match="already holds a prefix"):     # checked before any cache changes
        step_many(lean, [torch.tensor([1]), torch.tensor([2])], [c, KVCache(model.config)])
    assert c.seen == seen and torch.equal(c.layers[0].k, k0)
    with pytest.raises(ValueError, match="one token tensor per cache"):
        step_many(lean, [torch.tensor([1])], [c, alone[1]])
    with pytest.raises(ValueError, match="appears twice"):
        step_many(lean, [torch.tensor([1]), torch.tensor([2])], [c, c])
