"""KVReviver's decode-time compression and rebuild run once per step for every layer (``fastpath/reviver.py``):
the same storage, sketch, scores, revived flags and outputs as ``KVReviverPolicy``, to the last bit."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

import fastpath.sketch
import kernels
from experiments.analysis.kvreviver_ablation import SwapsAtOnce
from fastpath import reviver
from fastpath.lean import LeanDecoder
from fastpath.reviver import KVReviverLayersAtOnce, RoutedKernelSketch, every_layer_at_once, every_layer_at_once_on
from fastpath.sketch import KernelSketch, use_kernels
from methods import kvreviver, make_policy
from methods.kvreviver import KVReviverPolicy
from nanollm import KVCache, decode_step, extend, prefill, preset
from tests.methods.test_kvreviver import Reads


@pytest.fixture(scope="module")
def model(make_model):
    return make_model(dataclasses.replace(preset("TINY"), n_layer=3), seed=0)


def ids(n: int, seed: int, batch: int) -> torch.Tensor:
    return torch.randint(0, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


def state(policy: KVReviverPolicy, cache: KVCache) -> list:
    """Everything a step leaves: each layer's stored entries, the exact positions, the sketches' cells, the
    scores and revived flags, and the swaps counted."""
    L = cache.config.n_layer
    return [[(s.k.clone(), s.v.clone(), s.pos.clone(), policy.exact_positions(i, s).clone())
             for i, s in enumerate(cache.layers)],
            [[(sk.key.clone(), sk.value.clone()) for sk in policy._sketch.get(i, [])] for i in range(L)],
            [(policy._scores[i].clone(), policy._approx[i].clone()) for i in range(L)], policy.swaps]


def script(model, policy: KVReviverPolicy, batch: int, lean: bool = False) -> list:
    """A prompt, decode steps, a chunk extended, more steps; the outputs and the state after each."""
    cache, step = KVCache(model.config, policy), LeanDecoder(model).step if lean else \
        (lambda t, c: decode_step(model, t, c))
    seen = [prefill(model, ids(50, 0, batch), cache)]
    for t in range(10):
        seen += [step(ids(1, 10 + t, batch)[:, 0], cache), state(policy, cache)]
    seen += [extend(model, ids(5, 20, batch), cache), state(policy, cache)]
    for t in range(6):
        seen += [step(ids(1, 30 + t, batch)[:, 0], cache), state(policy, cache)]
    return seen


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture
def batched(monkeypatch):
    """Counts the steps that compressed more than one layer at once, and the rebuilds served from them."""
    counts = {"steps": 0, "rebuilt": 0}
    swaps, attend_kv = KVReviverLayersAtOnce._swaps, KVReviverPolicy.attend_kv

    def counted_swaps(self, layers, *a, **k):
        counts["steps"] += len(layers) > 1
        return swaps(self, layers, *a, **k)

    def counted_attend_kv(self, layer, store):                  # the parent's: rebuilt on the spot
        counts["rebuilt"] += bool(self._sketch.get(layer))
        return attend_kv(self, layer, store)
    monkeypatch.setattr(KVReviverLayersAtOnce, "_swaps", counted_swaps)
    monkeypatch.setattr(KVReviverPolicy, "attend_kv", counted_attend_kv)
    return counts


@pytest.mark.parametrize("options, batch", [
    ({"budget": 30, "replace_rate": 1.0}, 1),
    ({"budget": 30, "replace_rate": 1.0}, 2),
    ({"budget": 40, "replace_rate": 1.0, "rows": 2}, 2),
    ({"budget": 60, "replace_rate": 1.0, "per_kv_head": True}, 2),
    ({"budget": 40, "replace_rate": 1.0, "recent_slack": 3}, 1),
    ({"budget": 30}, 1),
])
def test_every_layer_at_once_is_the_policy_to_the_last_bit(model, batched, options, batch):
    """After every step (decode, an extended chunk, decode again): the outputs, each layer's entries, exact
    positions, sketch cells, scores and revived flags are those of ``KVReviverPolicy``, bit for bit; the steps
    were compressed and rebuilt for every layer at once, and the settings that revive tokens revived some."""
    plain = script(model, make_policy("kvreviver", **options), batch)
    rebuilt_plain, batched["rebuilt"] = batched["rebuilt"], 0
    policy = every_layer_at_once(make_policy("kvreviver", **options))
    assert type(policy) is KVReviverLayersAtOnce
    assert equal(script(model, policy, batch), plain)
    assert batched["steps"] >= 5                        # the steps past the budget, all but the first at once
    assert batched["rebuilt"] <= 2 * model.config.n_layer < rebuilt_plain   # the step after the prompt, after extend
    if options.get("replace_rate") == 1.0 and batch == 2:
        assert policy.swaps > 0, "this setting should revive tokens"


@pytest.mark.parametrize("chunk, ahead", [(7, False), (1 << 62, True)])
def test_rebuilt_ahead_where_the_rebuild_takes_every_position_at_once(model, monkeypatch, batched, chunk, ahead):
    """Where a rebuild takes every position at once (a GPU, or a CPU whose ``REBUILD_CHUNK`` covers the sketch's
    positions), every layer's entries are rebuilt at the step's end; else each layer's just before its
    attention, as ``KVReviverPolicy`` does (on a CPU, in chunks that stay in its cache): the same entries."""
    options = {"budget": 30, "replace_rate": 1.0}
    plain = script(model, make_policy("kvreviver", **options), 2)
    monkeypatch.setattr(kvreviver, "REBUILD_CHUNK", chunk)
    batched["rebuilt"] = 0
    assert equal(script(model, every_layer_at_once(make_policy("kvreviver", **options)), 2), plain)
    assert (batched["rebuilt"] <= 2 * model.config.n_layer) == ahead


def test_the_lean_step_and_a_fork(model):
    """Through ``LeanDecoder.step`` as the engines run it, and from a copy made between two steps (greedy's
    fork): the copy goes on as the policy would, and the original is untouched by it."""
    options = {"budget": 30, "replace_rate": 1.0}
    assert equal(script(model, every_layer_at_once(make_policy("kvreviver", **options)), 1, lean=True),
                 script(model, make_policy("kvreviver", **options), 1, lean=True))
    lean, steps = LeanDecoder(model), [ids(1, 40 + t, 1)[:, 0] for t in range(6)]
    caches = []
    for policy in (make_policy("kvreviver", **options), every_layer_at_once(make_policy("kvreviver", **options))):
        cache = KVCache(model.config, policy)
        prefill(model, ids(50, 0, 1), cache)
        for t in steps[:3]:
            lean.step(t, cache)
        fork = copy.deepcopy(cache)
        before = state(cache.policy, cache)
        outs = [lean.step(t, fork) for t in steps[3:]]
        assert equal(state(cache.policy, cache), before)
        caches.append((outs, state(fork.policy, fork)))
    assert equal(caches[0], caches[1])


def test_one_host_wait_a_step(make_model, monkeypatch):
    """``KVReviverPolicy`` reads one bool per layer and step (its swap test) and one more where a swap wins;
    every layer at once reads one list a step (``tolist``, not an aten operation: counted apart), and only
    the rows whose test passes read more (their own ``_swap``)."""
    model = make_model(dataclasses.replace(preset("TINY"), n_layer=4), seed=3)
    lean, prompt = LeanDecoder(model), ids(80, 0, 1)
    lists, tolist = [0], torch.Tensor.tolist

    def counted(t, *a, **k):
        lists[0] += 1
        return tolist(t, *a, **k)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    reads = {}
    for name, policy in (("plain", make_policy("kvreviver", budget=40, replace_rate=1.0)),
                         ("at once", every_layer_at_once(make_policy("kvreviver", budget=40, replace_rate=1.0)))):
        cache = KVCache(model.config, policy)
        prefill(model, prompt[:, :60], cache)
        lean.step(prompt[:, 60], cache)                                          # the first: rebuilt here
        swaps, lists[0] = policy.swaps, 0
        with Reads() as r:
            for t in range(61, 80):
                lean.step(prompt[:, t], cache)
        reads[name] = (r.n, lists[0], policy.swaps - swaps)
    L, (plain, _, swaps), (at_once, listed, swaps_too) = model.config.n_layer, reads["plain"], reads["at once"]
    assert swaps == swaps_too > 0
    assert 19 * L < plain <= 19 * L + swaps                                      # a bool a layer, an int a swap
    assert listed == 19 and at_once <= 2 * swaps                                 # a list a step; rows that swap


def test_what_is_not_batched_stays_as_it_was(model):
    """Per-layer budgets and an ablation's subclass are left to ``KVReviverPolicy``'s own hooks (the first is
    made the class but compresses each layer as it comes), and the other methods are untouched."""
    budgets = (30, 40, 30)
    policy = every_layer_at_once(make_policy("kvreviver", budget=30, layer_budgets=budgets))
    assert equal(script(model, policy, 1), script(model, make_policy("kvreviver", budget=30,
                                                                       layer_budgets=budgets), 1))
    assert policy._waiting == [] and policy._buffers is None
    ablation, h2o = SwapsAtOnce(budget=30), make_policy("h2o", budget=30)
    every_layer_at_once_on([ablation, h2o])
    assert type(ablation) is SwapsAtOnce and type(h2o) is type(make_policy("h2o", budget=30))
    assert reviver.every_layer_at_once(h2o) is h2o


@pytest.mark.skipif(not kernels.HAS_TRITON or not (kernels.interpreting() or torch.cuda.is_available()),
                    reason="no way to run a Triton kernel: triton is not installed, or there is no CUDA device "
                           "and TRITON_INTERPRET is not 1")
def test_the_sketch_kernels_insert_and_rebuild_every_layer_at_once(model, monkeypatch):
    """With the sketch on its Triton kernels (``fastpath/sketch.py``; here through Triton's interpreter), every
    layer's tokens go into the sketches by one kernel insert, and the next step's estimates come from one
    kernel query: the entries, cells and outputs of the PyTorch sketch within float rounding (atomic adds)."""
    monkeypatch.setattr(fastpath.sketch, "kernels",
                        SimpleNamespace(serves=lambda t: t.is_cuda or kernels.interpreting()))
    calls = []
    for name in ("insert", "query"):
        def counted(self, *a, _name=name, _f=getattr(KernelSketch, name), **k):
            calls.append((_name, type(self)))
            return _f(self, *a, **k)
        monkeypatch.setattr(KernelSketch, name, counted)
    options = {"budget": 30, "replace_rate": 1.0}
    plain = script(model, make_policy("kvreviver", **options), 2)
    policy = every_layer_at_once(use_kernels(make_policy("kvreviver", **options)))
    at_once = script(model, policy, 2)
    assert ("insert", RoutedKernelSketch) in calls and ("query", RoutedKernelSketch) in calls
    assert policy.swaps == plain[-1][-1] > 0
    flat = [t for t in torch.utils._pytree.tree_leaves(at_once) if isinstance(t, torch.Tensor)]
    expected = [t for t in torch.utils._pytree.tree_leaves(plain) if isinstance(t, torch.Tensor)]
    assert len(flat) == len(expected)
    for a, b in zip(flat, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
