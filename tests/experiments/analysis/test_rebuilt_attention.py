"""experiments/analysis/rebuilt_attention.py: attention mass on rebuilt (sketch) entries, and their key norms."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from experiments.analysis.rebuilt_attention import key_norm_ratio, rebuilt_attention_mass, rebuilt_mask
from experiments.evaluation.harness import traces
from methods import make_policy
from nanollm import KVCache, extend, prefill, preset
from nanollm.data.tasks import Sample


def hand_trace(probs: torch.Tensor, attended: torch.Tensor, exact: torch.Tensor) -> SimpleNamespace:
    """What the analysis reads of a one-layer ``Trace``: the first step's probabilities (H, T), attended and
    exact positions."""
    return SimpleNamespace(pos={0: exact}, probs={0: probs}, attended={0: attended})


def test_masses_by_hand():
    """Two query heads share one KV head; positions 0..3 attended, 0 and 3 raw, 1 and 2 rebuilt."""
    attended = torch.arange(4).view(1, 4)
    method = hand_trace(torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.3, 0.3, 0.3, 0.1]]), attended,
                        torch.tensor([[0, 3]]))
    full = hand_trace(torch.tensor([[0.4, 0.1, 0.0, 0.5], [0.2, 0.2, 0.2, 0.4]]), attended, torch.arange(4).view(1, 4))
    assert rebuilt_mask(method, 0).tolist() == [[False, True, True, False]]
    (row,) = rebuilt_attention_mass(full, method, group_size=2)
    assert row["layer"] == 0 and row["n_rebuilt"] == 2
    assert row["method_mass"] == pytest.approx((0.7 + 0.6) / 2)
    assert row["full_mass"] == pytest.approx((0.1 + 0.4) / 2)
    assert row["method_heads"] == pytest.approx([0.7, 0.6]) and row["full_heads"] == pytest.approx([0.1, 0.4])


@pytest.fixture(scope="module")
def model(make_model):
    return make_model(preset("TINY"), seed=0)


def sample(n_context: int = 60) -> Sample:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (n_context + 9,), generator=g).tolist()
    return Sample(task="random", context="", question="", answers=[], target="", context_ids=ids[:n_context],
                  question_ids=ids[n_context:n_context + 5], target_ids=ids[n_context + 5:])


def test_an_exact_sketch_gets_the_full_caches_mass(model):
    """An injective sketch rebuilds every entry exactly: the method's mass on the rebuilt positions is the full
    cache's (up to rounding), and the rebuilt keys are as long as the real ones."""
    policy = make_policy("kvreviver", 24, sketch_width=128, injective_hash=True)
    full, method = traces(model, sample(), "question_after_context", [None, policy], [True, True])
    rows = rebuilt_attention_mass(full, method, model.config.group_size)
    assert len(rows) == model.config.n_layer and all(r["n_rebuilt"] > 0 for r in rows)
    for r in rows:
        assert r["method_mass"] == pytest.approx(r["full_mass"], abs=1e-4)
    ids = torch.tensor([sample().prompt_ids])
    cache, full_cache = KVCache(model.config, policy), KVCache(model.config)
    for c in (cache, full_cache):
        prefill(model, ids[:, :60], c)
        extend(model, ids[:, 60:], c)
    ratios = key_norm_ratio(policy, cache, full_cache)
    assert ratios[0] == pytest.approx(1.0, abs=1e-6)                  # layer 0: the very same keys
    assert all(r == pytest.approx(1.0, abs=1e-3) for r in ratios)


def test_eviction_rebuilds_nothing(model):
    """H2O attends to its raw entries only: nothing is rebuilt, no mass on rebuilt entries."""
    full, method = traces(model, sample(), "question_after_context", [None, make_policy("h2o", 24)], [True, True])
    for r in rebuilt_attention_mass(full, method, model.config.group_size):
        assert r["n_rebuilt"] == 0 and r["method_mass"] == 0 and r["full_mass"] == 0


def test_a_collision_sketch_rebuilds_and_masses_are_probabilities(model):
    """KVReviver at its paper split (40 slots: 37 raw, 3 cells), both granularities: every position outside R
    and C is rebuilt, i.e. the context's 60 + 5 question tokens + the first answer token, minus the 37 raw
    slots and that new token; masses lie in [0, 1]."""
    for per_kv_head in (False, True):
        policy = make_policy("kvreviver", 40, per_kv_head=per_kv_head)
        full, method = traces(model, sample(), "question_after_context", [None, policy], [True, True])
        for r in rebuilt_attention_mass(full, method, model.config.group_size):
            assert r["n_rebuilt"] == 66 - policy.raw_budget - 1
            assert 0 <= r["method_mass"] <= 1 + 1e-6 and 0 <= r["full_mass"] <= 1 + 1e-6
