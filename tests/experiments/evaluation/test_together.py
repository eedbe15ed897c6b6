"""
Samples stepped side by side (``together.run_jobs``, ``experiments.compare --together``): each job's records are
those of the job run alone, bit for bit on the fast engine (timings aside), to float rounding on the
batched engines; the jobs' steps go through one ``engine.step`` each round.
"""

from __future__ import annotations

import pytest
import torch

from experiments.evaluation import compare, protocol, together
from experiments.evaluation.engines import make_engine
from experiments.evaluation.protocol import Variant
from nanollm.data.evaluate import MODES
from tests.experiments.evaluation.test_records import assert_same_records

TIMINGS = ("compress_ms", "decode_ms_per_token", "caches_per_step")   # how the step time was shared
# the two modes of one task and two tasks: answers of different lengths, so the jobs end at different rounds
JOBS = [("niah_single_noise", 0, MODES[0]), ("niah_multikey", 1, MODES[1]), ("niah_single_noise", 2, MODES[1])]
VARIANTS = [Variant(m, m) for m in ("h2o", "snapkv", "kvreviver", "scissorhands")]


def without_timings(results):
    return [[(key, {k: v for k, v in metrics.items() if k not in TIMINGS}) for key, metrics in job]
            for job in results]


def test_jobs_stepped_together_give_each_job_its_own_records(bundled, monkeypatch):
    """The fast engine: three jobs together, every metric of every record equal to the job's run alone; each
    round is one engine.step over every running job's caches (fewer steps than the jobs alone)."""
    model, tok, _ = bundled
    engine = make_engine("fast", model)
    steps, real = [], engine.step
    monkeypatch.setattr(engine, "step", lambda caches, tokens: (steps.append(len(caches)), real(caches, tokens))[1])
    args = (tok, VARIANTS, [40, 96], 256, 0)
    alone = [protocol.drive(engine, protocol.run_job(engine, *args, job)) for job in JOBS]
    n_alone, sizes_alone = len(steps), list(steps)
    steps.clear()
    stepped = together.run_jobs(engine, *args, JOBS)
    assert without_timings(stepped) == without_timings(alone)
    assert len(steps) < n_alone and max(steps) > max(sizes_alone)       # rounds over more caches, fewer of them
    assert sum(steps) == sum(sizes_alone)                               # every cache's every step, once
    assert len({len(job) for job in stepped}) == 1 and len(stepped) == len(JOBS)


def test_a_job_with_no_step_left_returns_at_once():
    """A generator that asks for no step returns its result in the first round; the others go on."""
    def none():
        return "done"
        yield                                                           # unreachable: it makes a generator

    def two(log):
        for t in range(2):
            logits, _, _ = yield [f"cache{t}"], [t]
            log.append(logits.tolist())
        return "two"

    class Engine:
        def step(self, caches, tokens):
            return torch.tensor(tokens, dtype=torch.float), torch.zeros(len(tokens), 1), [0.0] * len(tokens)
    log = []
    assert together.run_together(Engine(), [none(), two(log), two(log)]) == ["done", "two", "two"]
    assert log == [[0.0], [0.0], [1.0], [1.0]]                          # each job its own row


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fast", "one-group"])
def test_compare_together_gives_the_records_of_compare_alone(bundled, engine):
    """``compare.run(together=2)`` against ``together=1`` on the bundled model, both modes: bit for bit but the
    timings with the fast engine; the same answers and bytes, floats within 1e-5, with one group."""
    model, tok, _ = bundled
    kw = dict(methods=["h2o", "kvreviver", "streaming_llm"], budgets=[51, 128], tasks=["niah_multikey"], modes=MODES,
              samples=3, length=512, progress=False, engine=engine)
    alone = compare.run(model, tok, compare.RunSpec(**kw))
    together = compare.run(model, tok, compare.RunSpec(together=2, **kw))
    if engine == "fast":
        strip = [{k: v for k, v in r.items() if k not in TIMINGS} for r in alone]
        assert strip == [{k: v for k, v in r.items() if k not in TIMINGS} for r in together]
    assert_same_records(together, alone, ("method", "budget", "mode"))
    assert any(r["kl"] > 0.1 for r in together)
