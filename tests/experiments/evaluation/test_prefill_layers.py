"""``prefill_layers``: in the shared prompt pass, H2O's, Scissorhands', SnapKV's and StreamingLLM's prefill hooks
take a run of layers at once, each layer a batch row, and so do the question's hooks after it (H2O's and
Scissorhands'), and give every cache the storage and the records its hooks give it layer by layer, bit for
bit."""

from __future__ import annotations

import pytest
import torch

from experiments.evaluation import compare, prefill_layers
from experiments.evaluation.engines import make_engine
from experiments.evaluation.protocol import Probe
from methods import make_policy
from nanollm.data.evaluate import MODES

TIMES = {"compress_ms", "decode_ms_per_token"}
WAIT = ("h2o", "scissorhands", "snapkv", "streaming_llm")


@pytest.fixture
def runs(monkeypatch):
    """Each hook over layers at once: (its method, its layers)."""
    seen, compress = [], prefill_layers.compress

    def counted(caches, run, ctx):
        seen.extend((type(c.policy.inner if isinstance(c.policy, Probe) else c.policy).__name__, tuple(run.layers))
                    for c in caches)
        return compress(caches, run, ctx)
    monkeypatch.setattr(prefill_layers, "compress", counted)
    return seen


@pytest.fixture
def question(monkeypatch):
    """Each hook over the question's layers: (its method, its layers)."""
    seen, run = [], prefill_layers.Later.run

    def counted(later):
        if later.contexts:
            seen.append((type(later.policy.inner if isinstance(later.policy, Probe) else later.policy).__name__,
                         tuple(c.layer for c in later.contexts)))
        return run(later)
    monkeypatch.setattr(prefill_layers.Later, "run", counted)
    return seen


@pytest.fixture
def stacks(monkeypatch):
    """The layers each stacked storage takes (a run's, at prefill or at the question)."""
    seen, stacked = [], prefill_layers.stacked
    monkeypatch.setattr(prefill_layers, "stacked", lambda stores: seen.append(len(stores)) or stacked(stores))
    return seen


def storage(cache) -> list[tuple]:
    """Everything a layer's storage holds: its entries, its room (positions -1; the keys and values there are
    never read, and unset where the storage grew), per-slot state and fill values."""
    return [(s.n, s.capacity(), s.k, s.v, s.buffers()[2], s.free, s.buffers()[3], dict(s.fill)) for s in cache.layers]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("held", [None, 1, 300_000], ids=["every layer at once", "a layer a run", "runs by bytes"])
@pytest.mark.parametrize("probe", [True, False], ids=["in probes", "bare"])
def test_each_layer_holds_what_its_own_hook_leaves(bundled, monkeypatch, runs, question, stacks, held, probe):
    """After the fill, every layer of every cache holds the same entries, positions, per-slot state, slots
    of room and fill values as with each layer's own hook (compressed, or within its budget at 160), for
    runs of every layer, of one, and of as many as ``HELD_BYTES`` allows (300 kB: H2O's layers, about 115 kB
    each here, in runs of three and one, Scissorhands', with 150 rows of probabilities each, alone); the
    other caches (AdaKV, a recording probe) take no part. The question's hooks (9 tokens, after the prompt's
    150: H2O's and Scissorhands') go by the same bound, over smaller storage."""
    model, _, _ = bundled
    prompt = torch.randint(0, model.config.vocab_size, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    L = model.config.n_layer

    def filled(enabled: bool) -> list:
        monkeypatch.setattr(prefill_layers, "ENABLED", enabled)
        if held is not None:
            monkeypatch.setattr(prefill_layers, "HELD_BYTES", held)
        policies = [make_policy(m, budget=b) for m in (*WAIT, "adakv") for b in (40, 72, 160)]   # 160: no compression
        policies = [Probe(p) if probe else p for p in policies]
        recording = Probe(make_policy("h2o", budget=40))
        recording.recording = True
        caches, logits = make_engine("one-group", model).fill([*policies, recording], [prompt, prompt[:9]])
        return [logits] + [storage(c) for c in caches]

    together = filled(True)
    for hooks, methods in ((runs, WAIT), (question, ("h2o", "scissorhands"))):
        by_method: dict = {}
        for name, layers in hooks:
            by_method.setdefault(name, []).append(layers)
        assert sorted(by_method) == sorted(type(make_policy(m, budget=40)).__name__ for m in methods)
        for name, layers in by_method.items():      # each cache's layers once, in runs of consecutive layers
            assert sorted(i for run in layers for i in run) == sorted(list(range(L)) * 3)
            assert all(run == tuple(range(run[0], run[0] + len(run))) for run in layers)
        lengths = {name: sorted({len(r) for r in layers}) for name, layers in by_method.items()}
        if held is None:
            assert all(n == [L] for n in lengths.values())
        elif held == 1:
            assert all(n == [1] for n in lengths.values())
        elif hooks is runs:
            assert lengths["H2OPolicy"] == [1, 3] and lengths["ScissorhandsPolicy"] == [1]
        else:                                       # the question's storage: smaller, Scissorhands' ring buffer
            assert lengths["H2OPolicy"] == [1, 3, 4] and 2 in lengths["ScissorhandsPolicy"]
    several = [len(layers) for _, layers in question if len(layers) > 1]
    assert sorted(stacks) == sorted([len(layers) for _, layers in runs] + several)   # the question: runs of several
    runs.clear(), question.clear(), stacks.clear()
    alone = filled(False)
    assert runs == question == stacks == []
    assert len(together) == len(alone) == 1 + 5 * 3 + 1
    for a, b in zip(together, alone):
        assert same(a, b)


@pytest.mark.parametrize("engine", ["one-group", pytest.param("fast", marks=pytest.mark.slow)])
def test_the_records_are_those_of_a_hook_per_layer(bundled, monkeypatch, runs, engine):
    """``experiments.compare``'s records, every field but the times, with the layers at once and with a hook per
    layer, both modes, on the engines that share the prompt pass."""
    model, tok, _ = bundled

    def records() -> list[dict]:
        out = compare.run(model, tok, compare.RunSpec([*WAIT, "adakv", "kvreviver"], [40, 72], ["niah_single_noise"],
                                                      MODES, 1, 256, engine=engine, progress=False))
        return [{k: v for k, v in r.items() if k not in TIMES} for r in out]
    monkeypatch.setattr(prefill_layers, "ENABLED", True)
    runs.clear()
    together = records()
    assert len(runs) == len(MODES) * len(WAIT) * 2                # each cache once: every layer in one run
    monkeypatch.setattr(prefill_layers, "ENABLED", False)
    runs.clear()
    alone = records()
    assert runs == [] and together == alone


def test_a_hook_that_reads_one_layers_queries_fails_rather_than_read_them(bundled, monkeypatch):
    """The run's context holds no queries, outputs or attention module: a method that read them at prefill
    (one layer's, for every row) would fail loudly, not compress every layer by one layer's numbers."""
    model, _, _ = bundled
    policy = make_policy("h2o", budget=40)
    observe = type(policy).observe
    monkeypatch.setattr(type(policy), "observe", lambda self, ctx: observe(self, ctx) or ctx.q.shape)
    with pytest.raises(AttributeError):
        make_engine("one-group", model).fill([policy], [list(range(100))])


@pytest.mark.parametrize("odd", ["state", "room"])
def test_a_question_over_layers_that_do_not_stack_takes_a_hook_a_layer(bundled, monkeypatch, question, stacks, odd):
    """Where the layers' storage differs (one layer's H2O scores set again in float64, or its buffers with 8
    slots more room), the question's hooks run layer by layer for that cache, the others' at once, each
    cache's storage still what its own hooks leave."""
    model, _, _ = bundled
    prompt = torch.randint(0, model.config.vocab_size, (150,), generator=torch.Generator().manual_seed(2)).tolist()

    def extended(enabled: bool) -> list:
        monkeypatch.setattr(prefill_layers, "ENABLED", enabled)
        engine = make_engine("one-group", model)
        caches, logits = engine.fill([make_policy("h2o", budget=b) for b in (40, 72)], [prompt])
        store = caches[0].layers[1]
        if odd == "state":
            store.set_state("h2o_score", store.state["h2o_score"].double(), fill=0.0)
        else:                                       # the buffers of a storage that grew: more room, positions -1
            more = lambda t, value: torch.cat([t, t.new_full((*t.shape[:2], 8, *t.shape[3:]), value)], 2)  # noqa: E731
            k, v, pos, state = store.buffers()
            store.adopt(more(k, 0.0), more(v, 0.0), more(pos, -1),
                        {name: more(t, store.fill[name]) for name, t in state.items()})
        logits = engine.extend_all(caches, logits, [prompt, prompt[:9]])
        return [logits] + [storage(c) for c in caches]

    together = extended(True)
    L = model.config.n_layer
    assert question == [("H2OPolicy", tuple(range(L)))] * 2 and stacks == [L] * 3    # the prompt's two, one question
    question.clear(), stacks.clear()
    assert same(together, extended(False)) and question == stacks == []


def test_several_chunks_then_decode_steps_as_with_a_hook_per_layer(bundled, monkeypatch, question):
    """A question in chunks of 1 and 70 tokens after the prompt, then decode steps, the runs' ends moving as
    the storage grows (``HELD_BYTES`` two and a half of a layer's): every cache's positions and the logits
    are those of a hook per layer. StreamingLLM waits at the prompt only (``CHUNK_METHODS``)."""
    model, _, _ = bundled
    prompt = torch.randint(0, model.config.vocab_size, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    one, _ = make_engine("fast", model).fill([make_policy("h2o", budget=40)], [prompt])
    monkeypatch.setattr(prefill_layers, "HELD_BYTES", int(2.5 * prefill_layers.nbytes(one[0].layers[0])))

    def decoded(enabled: bool) -> list:
        monkeypatch.setattr(prefill_layers, "ENABLED", enabled)
        engine = make_engine("fast", model)
        policies = [make_policy(m, budget=40) for m in ("h2o", "scissorhands", "streaming_llm")]
        caches, logits = engine.fill(policies, [prompt, prompt[:1], prompt[10:80]])
        out = [logits]
        for _ in range(4):
            logits, _, _ = engine.step(caches, logits.argmax(-1).tolist())
            out += [logits] + [s.pos.clone() for c in caches for s in c.layers]
        return out

    together = decoded(True)
    assert {name for name, _ in question} == {"H2OPolicy", "ScissorhandsPolicy"}
    assert any(1 < len(layers) < bundled[0].config.n_layer for _, layers in question)
    assert same(together, decoded(False))
