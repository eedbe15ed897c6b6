"""
The batched engine (``experiments/evaluation/batched.py``): caches stepped together in shared buffers give each
cache what its own lean step gives it, to float rounding, and keep the positions it would keep, through
evictions, a policy that compacts its storage, a cache that outgrows its group, and a change of caches.
"""

from __future__ import annotations

import pytest
import torch

from experiments.evaluation import compare
from experiments.evaluation.batched import BatchedEngine, Group, OneGroupEngine, bucket
from experiments.evaluation.engines import make_engine
from fastpath.lean import LeanDecoder
from methods import make_policy
from nanollm import KVCache, load, prefill, preset
from nanollm.data.evaluate import MODES
from tests.experiments.evaluation.test_records import assert_same_records

# (method, prompt tokens, budget): evicting in place, compacting (adakv(h2o) keeps at every step), rebuilding
# from a sketch (kvreviver attends alone), none, and a plain cache of 63 that fills its group of 64 slots
SETUPS = [(None, 63, 0), ("full", 9, None), ("h2o", 30, 12), ("streaming_llm", 20, 12), ("snapkv", 25, 12),
          ("scissorhands", 17, 12), ("adakv(h2o)", 22, 12), ("kvreviver", 40, 30), ("h2o", 50, 20)]
STEPS = 10


def fresh(model, setups):
    caches, streams = [], []
    for name, n_prompt, budget in setups:
        ids = torch.randint(0, 512, (1, n_prompt + STEPS), generator=torch.Generator().manual_seed(n_prompt))
        cache = KVCache(model.config, make_policy(name, budget=budget) if name else None)
        prefill(model, ids[:, :n_prompt], cache)
        caches.append(cache), streams.append(ids[0, n_prompt:].tolist())
    return caches, streams


@pytest.mark.parametrize("engine_class, slots_made", [(BatchedEngine, [64, 64, 128]), (OneGroupEngine, [64, 128])])
def test_a_batched_step_is_each_cache_s_own_step(make_model, monkeypatch, engine_class, slots_made):
    """Every cache's logits and final hidden state within 1e-5 of ``LeanDecoder.step_with_hidden`` on the same
    cache alone, and the same positions in every slot of every layer after every step (the slot each entry
    is written to, the slots each policy empties). A storage a hook compacts (adakv(h2o)) is copied back into
    its row, not regrouped with the others; a cache that outgrows its row regroups them; a step over fewer
    caches narrows each group to the rows still stepped (``Group.narrowed``: no group made anew). The
    one-group engine: the same, every cache that shares storage in one group."""
    torch.manual_seed(0)
    model = make_model(preset("TINY"), seed=3)
    lean, engine = LeanDecoder(model), engine_class(model)
    made, init = [], Group.__init__
    monkeypatch.setattr(Group, "__init__", lambda self, *a: (made.append(a[1]), init(self, *a))[1])
    ours, streams = fresh(model, SETUPS)
    theirs, _ = fresh(model, SETUPS)
    grew = False
    for t in range(STEPS):
        stepped = range(len(SETUPS)) if t < STEPS - 3 else range(0, len(SETUPS), 2)   # then every other one
        logits, hidden, seconds = engine.step([ours[j] for j in stepped], [streams[j][t] for j in stepped])
        assert len(seconds) == len(stepped) and all(s >= 0 for s in seconds)
        grew |= any(g.C > bucket(63) for g in engine.groups)
        for row, j in enumerate(stepped):
            want, want_h = lean.step_with_hidden(torch.tensor([streams[j][t]]), theirs[j])
            torch.testing.assert_close(logits[row], want[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(hidden[row], want_h[0], rtol=1e-5, atol=1e-5)
            a, b = ours[j], theirs[j]
            assert a.seen == b.seen
            for la, lb in zip(a.layers, b.layers):
                assert torch.equal(la.pos, lb.pos), (SETUPS[j], t)
                torch.testing.assert_close(la.k, lb.k, rtol=1e-5, atol=1e-5)
                assert len(la) == len(lb) and la.state.keys() == lb.state.keys()
                for name in la.state:                         # H2O's scores, Scissorhands' counts
                    torch.testing.assert_close(la.state[name], lb.state[name], rtol=1e-5, atol=1e-5)
    assert grew                                              # the plain cache of 63 outgrew its 64 slots
    assert made == slots_made                 # the groups' slots, two arrangements: the first, the plain cache's
    #                                           growth (none per step for adakv(h2o)'s compaction, nor fewer caches)
    grouped = [c for g in engine.groups for c in g.caches]   # fewer caches: the groups narrowed to those stepped
    assert {id(c) for c in grouped} == {id(ours[j]) for j in range(0, len(SETUPS), 2) if j != 7}   # (7: KVReviver)
    assert (len(engine.groups) == 1) == (engine_class is OneGroupEngine)   # by size, or all in one
    assert all(ours[7].policy._sketch.values())              # KVReviver stepped over entries rebuilt from its sketch
    assert any(len(la) < la.n for la in ours[2].layers)      # H2O emptied slots in place, refilled by the writes


def test_a_fork_shares_nothing_and_copies_the_used_slots(make_model):
    model = make_model(preset("TINY"), seed=3)
    engine = BatchedEngine(model)
    caches, streams = fresh(model, SETUPS[:3])
    engine.step(caches, [s[0] for s in streams])
    cache = caches[2]
    fork = engine.fork(cache)
    for a, b in zip(cache.layers, fork.layers):
        assert b.capacity() == a.n < a.capacity()            # the used slots, not the group's buffers
        assert torch.equal(a.k, b.k) and torch.equal(a.pos, b.pos) and a.state.keys() == b.state.keys()
        assert b.k.data_ptr() != a.k.data_ptr()
        for name, t in a.state.items():                     # the state too: its used slots, its own memory
            assert b.buffers()[3][name].shape[2] == a.n and torch.equal(b.state[name], t)
            assert b.buffers()[3][name].data_ptr() != t.data_ptr()
    engine.step(caches, [s[1] for s in streams])              # the original goes on; the fork does not move
    assert fork.seen == cache.seen - 1 and cache.layers[0].k.data_ptr() != fork.layers[0].k.data_ptr()


def test_the_batched_engine_refuses_to_time_caches_alone(make_model):
    with pytest.raises(ValueError) as e:
        make_engine("batched", make_model(preset("TINY"), seed=0), alone=True)
    assert "--engine fast" in str(e.value) and "\n" not in str(e.value)
    assert [bucket(n) for n in (1, 51, 63, 64, 205, 1030, 2060)] == [64, 64, 64, 128, 256, 1280, 2560]


@pytest.mark.slow
def test_the_batched_and_fast_engines_give_the_same_records():
    """``--engine batched`` against ``--engine fast`` on the bundled model, every method at two budgets, both
    modes: the same answers and bytes, KL, perturbation, lost mass and attention error within 1e-5."""
    torch.set_num_threads(1)
    model, tok, _ = load("retrieval-llama")
    kw = dict(methods=list(compare.METHODS), budgets=[51, 128], tasks=["niah_multikey"], modes=MODES, samples=2,
              length=512, progress=False)
    fast = compare.run(model, tok, compare.RunSpec(**kw))
    batched = compare.run(model, tok, compare.RunSpec(engine="batched", **kw))
    assert_same_records(batched, fast, ("method", "budget", "mode"))
    assert batched[0]["engine"] == "batched" and any(r["kl"] > 0.1 for r in batched)
    one = compare.run(model, tok, compare.RunSpec(engine="one-group", **kw))
    assert_same_records(one, fast, ("method", "budget", "mode"))
    assert one[0]["engine"] == "one-group"


@pytest.mark.slow
def test_launches_counts_the_work_the_batched_engine_shares():
    """``launches.count`` on one job of the bundled model: the policies' hooks run the same operations under
    the fast and batched engines (each hook on its own cache, alone), and the batched engine runs fewer in
    the attention and storage (a write and an attention per group, not per cache) and in the model (no
    padded blocks); with one group, H2O's and Scissorhands' hooks run fewer (their caches at once,
    ``row_hooks.py``), the others the same."""
    from experiments.evaluation.launches import count, report
    torch.set_num_threads(1)
    model, tok, _ = load("retrieval-llama")
    counters = [count(model, tok, e, "niah_multikey", MODES[1], 512, 0) for e in ("fast", "batched", "one-group")]
    fast, batched, one = (c.counts for c in counters)
    hooks = {key for key in fast if key[1].startswith("policy: ")}
    assert {"policy: KVReviverLayersAtOnce", "policy: H2OPolicy"} <= {w for _, w in hooks}   # (fastpath/reviver.py)
    assert all(fast[key] == batched[key] for key in hooks)
    at_once = {("step", "policy: H2OPolicy"), ("step", "policy: ScissorhandsPolicy")}
    assert all(one[key] < batched[key] for key in at_once) and at_once <= hooks
    assert all(one[key] == batched[key] for key in hooks - at_once)
    assert fast["fill", ""] == batched["fill", ""] == one["fill", ""] > 0
    for who in ("attention and storage", "model"):
        assert batched["step", who] < fast["step", who], who
    assert one["step", "attention and storage"] < batched["step", "attention and storage"]   # one group, not 3-7
    total = next(line for line in report(counters[0]) if "operations that compute" in line)
    waits = sum(counters[0].waits.values())
    assert total.split()[4:6] == [f"{sum(fast.values()):,d}", f"{waits:,d}"]
    assert sum(counters[1].waits.values()) > 0 and counters[1].seconds > 0


def test_a_storage_compacted_by_a_hook_goes_back_into_its_row(make_model):
    """``Group.refit``: a layer whose storage a hook compacted (``keep``: new buffers of fewer slots) is copied
    back into its row, the slots after its last emptied (they held the dropped entries), and is a view again."""
    model = make_model(preset("TINY"), seed=3)
    engine = BatchedEngine(model)
    caches, streams = fresh(model, SETUPS[1:3])
    engine.step(caches, [s[0] for s in streams])
    group, store = engine.groups[0], caches[0].layers[1]
    n = store.n
    store.keep(torch.arange(0, n, 3).expand(1, store.k.shape[1], -1))          # every third entry
    assert store.k.data_ptr() != group.k[1][0].data_ptr()
    assert group.refit()
    assert store.k.data_ptr() == group.k[1][0].data_ptr() and store.n == len(range(0, n, 3))
    assert torch.equal(group.pos[1][0, :, :store.n], store.pos[0]) and (group.pos[1][0, :, store.n:] == -1).all()
