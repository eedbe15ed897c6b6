"""
The protocol: one sample through the full cache and every method, on one engine (``engine.py``).

1. **Teacher forcing** (``teacher_force``): every cache gets the same prompt, then the *reference* answer one
   token at a time, so all see the same tokens and their next-token distributions compare position by
   position. A ``Probe`` around each policy records the first decode step (where a compression first shows).
2. **Greedy answers from forks** (``continue_greedy``): while the trace's argmax is the reference token,
   greedy decoding *is* the trace. Where it first is not, teacher forcing keeps a copy of the cache
   (``Trace.fork``); the greedy answer is the reference up to there, then the method's own tokens from that
   copy, to the end-of-text token or the answer length: a fresh ``evaluate.answer``'s (tested).

``run_job``, the main loop of ``experiments.compare``: one (task, sample, mode), every method at every budget.
Each phase is a generator of the decode steps it asks for (``Steps``), which ``drive`` runs on the engine,
so that ``together.py`` can run several jobs' steps as one.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from methods import make_policy
from nanollm.cache import KVCache, LayerKV
from nanollm.data.evaluate import cut_at
from nanollm.policy import CachePolicy, Needs, StepContext
from nanollm.wrapper import PolicyWrapper

from .metrics import measure
from .task import TASKS, Task


class Probe(PolicyWrapper):
    """Wraps a policy: times its hooks and, while ``recording``, keeps per layer, for batch row 0, the last
    query's attention output ``outs`` (H, d), the positions stored exactly ``pos`` (H_kv, T) and, with
    ``record_probs``, the probabilities ``probs`` (H, T) over the positions ``attended`` (H_kv, T)."""

    def __init__(self, inner: CachePolicy, record_probs: bool = False) -> None:
        self.inner, self.record_probs, self.recording, self.compress_s = inner, record_probs, False, 0.0
        self.outs, self.pos, self.probs, self.attended = {}, {}, {}, {}

    def needs(self, phase: str) -> Needs:
        needs = self.inner.needs(phase)
        return needs | Needs(rows=1) if self.record_probs and self.recording else needs

    def attend_kv(self, layer: int, store: LayerKV) -> LayerKV:
        if self.recording:
            self.pos[layer] = self.inner.exact_positions(layer, store)[0].clone()
        return self.inner.attend_kv(layer, store)

    def reset(self) -> None:
        self.inner.reset()
        self.compress_s = 0.0

    def on_prefill(self, ctx: StepContext) -> None:
        t0 = time.perf_counter()
        self.inner.on_prefill(ctx)
        self.compress_s += time.perf_counter() - t0

    def on_decode(self, ctx: StepContext) -> None:
        if self.recording:
            self.outs[ctx.layer] = ctx.out[0, :, -1].clone()
            if self.record_probs:
                self.probs[ctx.layer] = ctx.probs[0, :, -1].clone()
                self.attended[ctx.layer] = ctx.attended_pos[0].clone()
        t0 = time.perf_counter()
        self.inner.on_decode(ctx)
        self.compress_s += time.perf_counter() - t0


@dataclass
class Trace:
    """One cache's teacher-forced answer; ``continue_greedy`` adds its greedy answer."""
    probe: Probe
    cache: KVCache | None              # while teacher forcing
    logits: list = field(default_factory=list)   # logits[m] (V,) predicts the reference's token m; stacked at the end
    hidden: Tensor | None = None       # (D,) final hidden state at the first decode step
    kv_bytes: int = 0                  # peak K/V bytes, with the slots a policy keeps outside the storage
    extra_bytes: int = 0               # peak bytes of the policy's own structures (H2O's scores, side tables)
    step_s: float = 0.0
    fork: tuple | None = None          # (m, cache): greedy's cache after the answer's first m tokens
    engine: object = None
    compressed: int = 0                # the prompt tokens the method compresses (the first chunk)
    prompt_passes: int = 0             # the engine's prompt passes for this sample (the fast engine: 1, shared)
    caches_per_step: int = 0           # the most caches a teacher-forced step ran at once (step_s is their share)
    prediction_ids: list | None = None   # the greedy answer's ids, up to the end-of-text token
    prediction: str | None = None        # ... and its text

    outs, pos = property(lambda self: self.probe.outs), property(lambda self: self.probe.pos)
    probs, attended = property(lambda self: self.probe.probs), property(lambda self: self.probe.attended)
    compress_ms = property(lambda self: self.probe.compress_s * 1e3)
    decode_ms_per_token = property(lambda self: self.step_s * 1e3 / max(1, len(self.logits) - 1))

    def measure_bytes(self) -> None:
        self.kv_bytes = max(self.kv_bytes, self.cache.nbytes() + self.probe.inner.slot_nbytes())
        self.extra_bytes = max(self.extra_bytes, self.cache.state_nbytes() + self.probe.inner.extra_nbytes())

    def add(self, logits: Tensor, top: int, reference: list[int]) -> None:
        """The next logits and their argmax; keep a copy of the cache where greedy leaves the reference."""
        self.logits.append(logits)
        m = len(self.logits) - 1
        if self.fork is None and top != reference[m]:
            self.fork = (m, self.engine.fork(self.cache))
            self.fork[1].policy = self.fork[1].policy.inner      # a plain cache with the method


# A job's decode steps: it yields (caches, tokens), a token per cache, and is sent that step's (logits (N, V), hidden
# states (N, D), seconds per cache), or yields BARRIER (together.py) and is sent None; it returns its result.
Steps = Generator[tuple[list[KVCache], list[int]] | None, tuple[Tensor, Tensor, list[float]] | None, object]
BARRIER = None


def drive(engine, steps: Steps):
    """Run one job's steps on ``engine``, each step as it asks; its result."""
    sent = None
    while True:
        try:
            request = steps.send(sent)
        except StopIteration as done:
            return done.value
        sent = None if request is BARRIER else engine.step(*request)


@torch.no_grad()
def teacher_force(engine, task: Task, sample, mode: str, policies: list[CachePolicy],
                  record_probs: list[bool]) -> Steps:
    """Each policy's trace: the prompt, then the reference answer token by token (see the module doc); steps,
    its result the traces: ``drive(engine, teacher_force(engine, ...))``."""
    if len(record_probs) != len(policies):
        raise ValueError(f"one record_probs flag per policy: {len(policies)} policies, {len(record_probs)} flags")
    probes = [Probe(p, r) for p, r in zip(policies, record_probs)]
    chunks = task.chunks(sample, mode)
    caches, logits = engine.fill(probes, chunks)
    reference = task.reference(sample)
    trs = [Trace(probe, cache, engine=engine, compressed=len(chunks[0]), prompt_passes=engine.prompt_passes)
           for probe, cache in zip(probes, caches)]
    for tr, lg, top in zip(trs, logits, logits.argmax(-1).tolist()):      # one wait for the device per step
        tr.measure_bytes()
        tr.add(lg, top, reference)
    for j, token in enumerate(reference[:-1]):
        for probe in probes:
            probe.recording = j == 0
        logits, hidden, seconds = yield caches, [token] * len(caches)
        for n, (tr, top) in enumerate(zip(trs, logits.argmax(-1).tolist())):
            tr.hidden = hidden[n] if tr.hidden is None else tr.hidden
            tr.step_s += seconds[n]
            tr.caches_per_step = max(tr.caches_per_step, engine.caches_per_step)
            tr.add(logits[n], top, reference)
            tr.measure_bytes()
    for tr in trs:
        tr.probe.recording = False
        for records in (tr.probe.outs, tr.probe.pos, tr.probe.probs, tr.probe.attended):   # once, for the
            records.update({layer: t.cpu() for layer, t in records.items()})     # metrics' sums (no GPU waits)
        tr.logits = torch.stack(tr.logits)                      # (n_answer, V)
        if tr.fork is None:                                     # greedy follows the whole reference
            tr.cache.policy = tr.probe.inner
            tr.fork = (len(tr.logits) - 1, tr.cache)
        tr.cache = None                                         # greedy needs only the fork
    return trs


@torch.no_grad()
def continue_greedy(task: Task, sample, trs: list[Trace], tok) -> Steps:
    """Each trace's greedy answer ids, continued from its fork, all of them stepped together on their engine
    (each cache's numbers do not depend on the others); kept on the trace, so a second call costs nothing.
    Steps, its result the ids: ``drive(trs[0].engine, continue_greedy(...))``."""
    todo = [tr for tr in trs if tr.prediction_ids is None]
    n_new = task.answer_length(trs[0].engine.model, sample) if todo else 0
    reference, running = task.reference(sample), []       # running: [trace, its cache, its answer so far]
    for tr in todo:
        m, cache = tr.fork
        answer = reference[:n_new] if m >= n_new else reference[:m] + [int(tr.logits[m].argmax())]
        if m < n_new and answer[-1] != tok.eot_id and len(answer) < n_new:
            running.append((tr, cache, answer))
        tr.prediction_ids, tr.fork = answer, None               # the fork is used once, as it is
    while running:
        logits, _, _ = yield [r[1] for r in running], [r[2][-1] for r in running]
        for (tr, _, answer), top in zip(running, logits.argmax(-1).tolist()):
            answer.append(top)
        running = [r for r in running if r[2][-1] != tok.eot_id and len(r[2]) < n_new]
    for tr in todo:
        tr.prediction_ids = cut_at(tr.prediction_ids, tok.eot_id)
        tr.prediction = tok.decode(tr.prediction_ids)
    return [tr.prediction_ids for tr in trs]


@dataclass(frozen=True)
class Variant:      # a method with options, under its own name: Variant("chunkkv c=5", "chunkkv", {"chunk_size": 5})
    label: str
    spec: str
    options: dict = field(default_factory=dict)


FULL = Variant("full", "full")


def run_job(engine, tok, variants: list[Variant], budgets: list[int], length: int, seed: int,
            job: tuple[str | Task, int, str]) -> Steps:
    """One (task, sample index, mode) of ``experiments.compare``: the full cache, then every other variant at
    every budget, on one sample. The task is a name of ``TASKS`` or a ``Task`` (one read from a file). Steps,
    its result [(cell key, one sample's metrics)] in a fixed order: ``drive(engine, run_job(engine, ...))``."""
    task, i, mode = job
    task = TASKS[task] if isinstance(task, str) else task
    sample = task.sample(tok, length, seed + i)
    rows = [(FULL, None)] + [(v, b) for v in variants if v.spec != "full" for b in budgets]
    policies = [make_policy(v.spec, budget=b, **v.options) for v, b in rows]
    trs = yield from teacher_force(engine, task, sample, mode, policies, [True] + [False] * (len(policies) - 1))
    yield BARRIER                                       # jobs run together: their forks join at one round
    yield from continue_greedy(task, sample, trs, tok)
    return [((v.label, b, task.name, mode), measure(trs[0], tr, task, sample)) for (v, b), tr in zip(rows, trs)]
