"""What ran, recorded: every record of ``experiments.compare`` names its engine, how its step time was taken, how
many prompt passes served it (the fast engine's fallback: one per cache) and how many caches shared a step;
``--time-alone`` gives each cache its own step time and the same records otherwise; the fast engine refuses a
policy that draws from the global random generator instead of assuming none does."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from experiments.evaluation import compare
from experiments.evaluation.engines import make_engine
from experiments.evaluation.protocol import drive, teacher_force
from experiments.evaluation.task import TASKS
from methods import make_policy
from nanollm.data.evaluate import MODES

TIMES = {"compress_ms", "decode_ms_per_token", "step_timing", "caches_per_step"}


def run(bundled, methods, **kw):
    model, tok, _ = bundled
    return compare.run(model, tok, compare.RunSpec(methods, [64], ["niah_single_noise"], MODES[:1], 2, 256,
                                                   progress=False, **kw))


def test_records_name_the_engine_its_passes_and_the_caches_sharing_a_step(bundled):
    shared = run(bundled, ["snapkv", "h2o"])
    assert {(r["engine"], r["step_timing"], r["prompt_passes"], r["caches_per_step"]) for r in shared} == \
        {("fast", "share", 1, 3)}
    alone = run(bundled, ["snapkv", "h2o"], time_alone=True)
    assert {(r["step_timing"], r["prompt_passes"], r["caches_per_step"]) for r in alone} == {("alone", 1, 1)}
    for a, b in zip(shared, alone):
        assert {k: v for k, v in a.items() if k not in TIMES} == {k: v for k, v in b.items() if k not in TIMES}
    plain = run(bundled, ["snapkv"], engine="plain")
    assert {(r["engine"], r["step_timing"], r["prompt_passes"], r["caches_per_step"]) for r in plain} == \
        {("plain", "alone", 2, 1)}


def subclassed(hook: str, body):
    """SnapKV's policy with ``body(self, ctx_or_store)`` run before its own ``hook``."""
    policy = make_policy("snapkv", budget=64)
    base = type(policy)

    def hooked(self, *args):
        body(self, *args)
        return getattr(base, hook)(self, *args)
    policy.__class__ = type("Changed", (base,), {hook: hooked})
    return policy


def traces(bundled, engine, policy, mode=MODES[0]):
    model, tok, _ = bundled
    task = TASKS["niah_single_noise"]
    engine = make_engine(engine, model)
    return drive(engine, teacher_force(engine, task, task.sample(tok, 256, 0), mode,
                                       [make_policy("full", budget=None), policy], [True, False]))


def test_the_fast_engine_s_fallback_is_recorded(bundled):
    """A policy that attends to other storage than it holds at prefill cannot share the prompt pass: the fast
    engine runs one pass per cache, and the traces (so the records) say so."""
    rebuilt = make_policy("snapkv", budget=64)
    rebuilt.__class__ = type("Rebuilds", (type(rebuilt),),
                             {"attend_kv": lambda self, layer, store: copy.deepcopy(store)})
    assert [tr.prompt_passes for tr in traces(bundled, "fast", rebuilt)] == [2, 2]
    assert [tr.prompt_passes for tr in traces(bundled, "fast", make_policy("snapkv", budget=64))] == [1, 1]


@pytest.mark.parametrize("hook, python", [("on_prefill", False), ("on_decode", False), ("on_decode", True)])
def test_the_fast_engine_refuses_a_policy_that_draws_from_the_global_generator(bundled, hook, python):
    def draw(self, ctx):
        random.random() if python else torch.rand(1)
    with pytest.raises(RuntimeError, match="drew from the global random generator during"):
        traces(bundled, "fast", subclassed(hook, draw))
    traces(bundled, "plain", subclassed(hook, draw))                # one cache at a time: no refusal
    traces(bundled, "fast", subclassed(hook, lambda self, ctx: None))  # the same hook, drawing nothing


def test_a_draw_in_the_pass_over_the_question_is_refused_there(bundled):
    """With the question after the context, the fast engine extends every cache at once (``extend_many``), the
    hooks interleaved cache by cache: a draw there is refused before any decode step."""
    with pytest.raises(RuntimeError, match="during the pass over the question"):
        traces(bundled, "fast", subclassed("on_decode", lambda self, ctx: torch.rand(1)), MODES[1])


def test_records_keep_the_ratio_asked_and_the_share_of_each_prompt_kept(bundled):
    """``keep_ratio`` is budget / --length; ``realised_keep_ratio`` the mean over samples of budget / tokens
    compressed (the prompt, or only the context when the question comes after it), from the samples by hand."""
    model, tok, _ = bundled
    records = compare.run(model, tok, compare.RunSpec(["snapkv"], [64], ["niah_single_noise"], MODES, 3, 256,
                                                      progress=False))
    task = TASKS["niah_single_noise"]
    for r in records:
        samples = [task.sample(tok, 256, i) for i in range(3)]
        n = [len(s.prompt_ids) if r["mode"] == MODES[0] else len(s.context_ids) for s in samples]
        assert r["compressed_tokens"] == n
        want = 1.0 if r["method"] == "full" else sum(min(1.0, 64 / t) for t in n) / 3
        assert r["realised_keep_ratio"] == round(want, 4)
        assert r["keep_ratio"] == (1.0 if r["method"] == "full" else 0.25)
    kept = {r["mode"]: r["realised_keep_ratio"] for r in records if r["method"] == "snapkv"}
    assert 0.25 < kept[MODES[0]] < kept[MODES[1]]            # a prompt is shorter than 256; a context shorter still
