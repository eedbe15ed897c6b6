"""
The evaluation harness: a method against full attention, on the same model, samples and decoding.

For one sample and one mode, ``trace`` runs the prompt and then feeds the *reference* answer one token at
a time through ``decode_step`` (teacher forcing), so the full cache and every method see exactly the same
tokens. From two traces (full and method) ``compare_traces`` computes:

* ``kl``: mean next-token KL(full || method) over the answer positions;
* ``perturbation``: relative error ||h_full - h|| / ||h_full|| of the final hidden state at the first
  decode step (the step that feeds the first answer token: the first moment a prefill compression can
  show up, since prompt attention itself is always exact);
* ``attn_l1``: per layer and query head, ||o_full - o||_1 of the attention output at that step;
* ``lost_mass``: the full-attention probability mass, at that step, on positions the method does not
  attend to *exactly*, i.e. whose raw key and value are not in its storage (mean over layers and heads).
  An entry a method rebuilds in ``attend_kv`` (an approximation of an evicted token, e.g. from a sketch)
  counts as lost here: its error shows in ``attn_l1``, ``perturbation`` and ``kl`` instead. Otherwise a
  method that attends to approximations of everything would report no loss at all;
* ``kv_bytes``: peak K/V bytes stored over all layers, with the slots a policy keeps outside the storage
  (``policy.slot_nbytes()``: a sketch's cells); ``extra_bytes``: peak bytes of what the method
  keeps besides: per-slot state in the storage (H2O's scores) plus ``policy.extra_nbytes()`` (side tables
  such as KVReviver's per-token scores);
* ``compress_ms``: time spent in the policy's hooks; ``decode_ms_per_token``: time per decode step (when
  ``traces`` steps several methods side by side: the method's own work plus an equal share of the
  work done once for all, see ``answer_traces``).

Accuracy is RULER's ``string_match_all`` of the greedy answer. Greedy decoding that starts from the same
prefix produces the same logits as the teacher-forced trace, so as long as the trace's argmax reproduces
the reference answer, greedy decoding *is* the trace. At the first answer position where it does not, the
trace keeps a copy of the cache (policy included): the greedy answer is the reference up to there, then
the method generates freely from that copy. This is the answer a fresh ``evaluate.answer`` gives (a test
checks it token for token), without running the prompt a second time; the decode step's products round a
little differently from ``evaluate.answer``'s (``side_by_side``), which changes a token only where two logits
tie to float rounding.

Speed. ``methods.compare`` traces the full cache and every method on each sample, so ``traces`` runs the
prompt once for all of them (``side_by_side.FanOut``) and feeds each answer token to all their caches in one
``side_by_side.step_many``; ``greedy_from_traces`` continues the wrong answers side by side the same way.
Each trace's numbers are exactly those of a run on its own, whichever other traces ran beside it (tests
compare them bit for bit).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fastpath.lean import LeanDecoder
from nanollm.cache import KVCache, LayerKV
from nanollm.data.evaluate import answer_length, cut_at, digits_per_token
from nanollm.data.tasks import Sample, match_settled, string_match_all
from nanollm.generation import extend, generate, prefill
from nanollm.policy import CachePolicy, FullCache, Needs, StepContext
from nanollm.wrapper import PolicyWrapper

from .side_by_side import FanOut, SharedPrefillUnsupported, step_many


class Probe(PolicyWrapper):
    """Wraps a policy: times its hooks and records what the first decode step attended to (everything else,
    the declarations included, is the inner policy's).

    While ``recording`` is True, ``on_decode`` stores, per layer, the attention output of the last query
    ``out`` (H, d), the positions stored exactly ``pos`` (H_kv, T: the storage when the step attended)
    and, with ``record_probs``, the attention probabilities ``probs`` (H, T) over the positions attended
    ``attended`` (H_kv, T), all for batch row 0.
    """

    def __init__(self, inner: CachePolicy, record_probs: bool = False) -> None:
        self.inner = inner
        self.record_probs = record_probs
        self.recording = False
        self.compress_s = 0.0
        self.outs: dict[int, Tensor] = {}
        self.pos: dict[int, Tensor] = {}
        self.attended: dict[int, Tensor] = {}
        self.probs: dict[int, Tensor] = {}

    def needs(self, phase: str) -> Needs:
        """The inner policy's needs, plus the last query's row while recording (with ``record_probs``)."""
        needs = self.inner.needs(phase)
        return needs | Needs(rows=1) if self.record_probs and self.recording else needs

    def attend_kv(self, layer: int, store: LayerKV) -> LayerKV:
        if self.recording:                                                 # (H_kv, T) stored exactly
            self.pos[layer] = self.inner.exact_positions(layer, store)[0].clone()
        return self.inner.attend_kv(layer, store)

    def on_prefill(self, ctx: StepContext) -> None:
        t0 = time.perf_counter()
        self.inner.on_prefill(ctx)
        self.compress_s += time.perf_counter() - t0

    def on_decode(self, ctx: StepContext) -> None:
        if self.recording:
            self.outs[ctx.layer] = ctx.out[0, :, -1].clone()               # (H, d)
            if self.record_probs:
                self.probs[ctx.layer] = ctx.probs[0, :, -1].clone()        # (H, T)
                self.attended[ctx.layer] = ctx.attended_pos[0].clone()     # (H_kv, T) aligned with probs
        t0 = time.perf_counter()
        self.inner.on_decode(ctx)
        self.compress_s += time.perf_counter() - t0


@dataclass
class Trace:
    logits: Tensor                 # (n_answer, V) logits predicting each reference answer token
    hidden: Tensor                 # (D,) final hidden state at the first decode step
    outs: dict                     # layer -> (H, d) attention output at the first decode step
    pos: dict                      # layer -> (H_kv, T) positions stored exactly at that step
    probs: dict                    # layer -> (H, T) attention probabilities (full-cache trace only)
    attended: dict                 # layer -> (H_kv, T) positions those probabilities refer to
    kv_bytes: int                  # peak K/V bytes over all layers
    extra_bytes: int               # peak bytes of the policy's own structures (0 if it reports none)
    compress_ms: float
    decode_ms_per_token: float
    fork: tuple | None = None      # (m, cache): the cache greedy decoding has after the answer's first m
                                   # tokens; m = the first position whose argmax leaves the reference, else
                                   # the last position
    lean: LeanDecoder | None = None   # the decode step the trace used (greedy decoding reuses it)


def lean_decoder(model) -> LeanDecoder | None:
    """A ``LeanDecoder`` of the model (its stacked weights copied now), or None for a model it does not
    take. It gives the same logits as ``model(token, cache=cache)`` (``tests/nanollm/test_lean.py``); the harness
    uses it because an evaluation is hundreds of thousands of decode steps of a tiny, dispatch-bound model."""
    try:
        return LeanDecoder(model)
    except ValueError:
        return None


@torch.no_grad()
def trace(model, sample: Sample, mode: str, policy: CachePolicy | None = None,
          record_probs: bool = False) -> Trace:
    """Prompt (in ``mode``), then the reference answer token by token; see the module docstring."""
    return traces(model, sample, mode, [policy], [record_probs], share_prompt=False)[0]


@torch.no_grad()
def traces(model, sample: Sample, mode: str, policies: list[CachePolicy | None], record_probs: list[bool],
           share_prompt: bool = True) -> list[Trace]:
    """``trace`` of one sample for several policies (None: the full cache). With ``share_prompt`` the first
    prompt chunk (the prompt, or the context in question_after_context) runs once for all of them
    (``FanOut``); the traces are the same as separate ``trace`` calls, timings aside. Every trace, with the
    cache copy its greedy continuation starts from, is held until the call returns: fine at the lengths
    of ``methods.compare``; for long contexts call ``trace`` per policy."""
    if mode not in ("question_in_prompt", "question_after_context"):
        raise ValueError(f"unknown mode {mode!r}")
    if len(record_probs) != len(policies):
        raise ValueError(f"one record_probs flag per policy: {len(policies)} policies, {len(record_probs)} flags")
    if not policies:
        return []
    dev = next(model.parameters()).device
    first = sample.prompt_ids if mode == "question_in_prompt" else sample.context_ids
    first = torch.tensor([first], device=dev)

    def fresh() -> tuple[list[Probe], list[KVCache]]:   # a new cache resets its policy
        probes = [Probe(p if p is not None else FullCache(), r) for p, r in zip(policies, record_probs)]
        return probes, [KVCache(model.config, policy=probe) for probe in probes]

    probes, caches = fresh()
    shared = None
    if share_prompt and len(caches) > 1:
        try:
            shared = prefill(model, first, KVCache(model.config, policy=FanOut(caches)))
            for cache in caches:
                cache.seen = first.shape[1]
        except SharedPrefillUnsupported:                # start again, one prompt pass per policy
            probes, caches = fresh()
    prompt_logits = []
    for cache in caches:
        logits = shared if shared is not None else prefill(model, first, cache)
        if mode == "question_after_context":
            logits = extend(model, torch.tensor([sample.question_ids], device=dev), cache)
        prompt_logits.append(logits)
    return answer_traces(model, sample, probes, caches, prompt_logits, lean_decoder(model))


class AnswerTrace:
    """What one trace collects while the reference answer is fed to its cache (``answer_traces``)."""

    def __init__(self, probe: Probe, cache: KVCache, logits: Tensor) -> None:
        self.probe, self.cache = probe, cache
        self.step_logits = [logits[0, -1]]             # step_logits[m] predicts target_ids[m]
        self.fork = None
        self.kv_bytes, self.extra_bytes = self.kv(), self.extra()
        self.decode_s, self.hidden = 0.0, None

    def kv(self) -> int:                               # stored K/V + slots kept outside the storage
        return self.cache.nbytes() + self.probe.inner.slot_nbytes()

    def extra(self) -> int:
        return self.cache.state_nbytes() + self.probe.inner.extra_nbytes()

    def check_fork(self, target_ids: list[int]) -> None:
        """Keep a copy of the cache at the first answer position where greedy leaves the reference."""
        m = len(self.step_logits) - 1
        if self.fork is None and int(self.step_logits[m].argmax()) != target_ids[m]:
            self.fork = (m, copy.deepcopy(self.cache))
            self.fork[1].policy = self.fork[1].policy.inner   # without the probe: a plain cache with the method

    def add_step(self, logits: Tensor, hidden: Tensor, seconds: float, target_ids: list[int]) -> None:
        if self.hidden is None:
            self.hidden = hidden                       # the first decode step's
        self.step_logits.append(logits)
        self.decode_s += seconds
        self.check_fork(target_ids)
        self.kv_bytes, self.extra_bytes = max(self.kv_bytes, self.kv()), max(self.extra_bytes, self.extra())

    def done(self, lean: LeanDecoder | None) -> Trace:
        if self.fork is None:                          # greedy follows the whole reference: continue from here
            self.cache.policy = self.probe.inner
            self.fork = (len(self.step_logits) - 1, self.cache)
        p = self.probe
        n_steps = len(self.step_logits) - 1
        return Trace(torch.stack(self.step_logits), self.hidden, p.outs, p.pos, p.probs, p.attended,
                     self.kv_bytes, self.extra_bytes, p.compress_s * 1e3, self.decode_s * 1e3 / max(1, n_steps),
                     self.fork, lean)


def answer_traces(model, sample: Sample, probes: list[Probe], caches: list[KVCache], prompt_logits: list[Tensor],
                  lean: LeanDecoder | None) -> list[Trace]:
    """The reference answer token by token on caches that hold the prompt (``prompt_logits``: each one's
    prompt logits), all caches side by side: each answer token goes to every cache in one
    ``side_by_side.step_many`` (lean None: the model's own forward, cache by cache). A trace's numbers are
    exactly those of its cache stepped alone, so a trace does not depend on the others beside it.

    ``decode_ms_per_token`` is a trace's own work in each step (its attention: storage, attention, policy
    hooks) plus an equal share of the rest of the step, which is the same work for every trace (the
    matrix products and the element-wise operations, once for all rows): the traces' times
    add up to the time of the steps. The share shrinks as more traces run together, so compare these
    times within one run, not across runs with other methods or budgets. Without a lean decoder, each
    trace's own time is its whole forward pass.

    The policies' hooks interleave, cache after cache and layer after layer, so (as for ``FanOut``) a
    policy must not draw from the global random generator; no registered method does."""
    dev = prompt_logits[0].device
    runs = [AnswerTrace(probe, cache, logits) for probe, cache, logits in zip(probes, caches, prompt_logits)]
    for run in runs:
        run.check_fork(sample.target_ids)
    for j, token in enumerate(sample.target_ids[:-1]):
        for probe in probes:
            probe.recording = j == 0
        own = [0.0] * len(runs)
        t0 = time.perf_counter()
        if lean is not None:                           # the same step with fewer operations (fastpath/lean.py)
            logits, hidden = step_many(lean, [torch.tensor([token], device=dev)] * len(runs), caches, own)
        else:
            logits, hidden = [], []
            for n, cache in enumerate(caches):
                t1 = time.perf_counter()
                lg, h = model(torch.tensor([[token]], device=dev), cache=cache, return_hidden=True)
                own[n] = time.perf_counter() - t1
                logits.append(lg[0, -1]), hidden.append(h[0, -1])
        shared = (time.perf_counter() - t0 - sum(own)) / len(runs)
        for n, run in enumerate(runs):
            run.add_step(logits[n], hidden[n], own[n] + shared, sample.target_ids)
    return [run.done(lean) for run in runs]


def lost_mass(full: Trace, method: Trace, group_size: int) -> float:
    """Mean over layers and query heads of the full attention mass on positions the method did not attend
    exactly (not in its storage; rebuilt entries count as lost, see the module docstring)."""
    lost = []
    for layer, probs in full.probs.items():                      # probs (H, T) over full positions
        full_pos = full.attended[layer][0]                       # (T,) the full cache attends every position
        kept = method.pos[layer]                                 # (H_kv, Tm) stored exactly, -1 = empty
        keeps = [torch.isin(full_pos, kept_h) for kept_h in kept]   # per KV head: (T,) stored exactly
        for h in range(probs.shape[0]):
            lost.append(float(probs[h][~keeps[h // group_size]].sum()))
    return sum(lost) / len(lost)


def compare_traces(full: Trace, method: Trace, group_size: int) -> dict:
    """Metrics of a method's trace against the full cache's trace of the same sample and mode."""
    p_log = torch.log_softmax(full.logits.double(), -1)
    q_log = torch.log_softmax(method.logits.double(), -1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1).mean()
    L = len(full.outs)
    attn_l1 = torch.stack([(full.outs[i] - method.outs[i]).abs().sum(-1) for i in range(L)])   # (L, H)
    return {
        "kl": float(kl),
        "perturbation": float((full.hidden - method.hidden).norm() / full.hidden.norm()),
        "attn_l1": attn_l1.tolist(),
        "lost_mass": lost_mass(full, method, group_size),
        "kv_bytes": method.kv_bytes,
        "extra_bytes": method.extra_bytes,
        "compress_ms": method.compress_ms,
        "decode_ms_per_token": method.decode_ms_per_token,
    }


def greedy_from_traces(model, tok, sample: Sample, trs: list[Trace], until_scored: bool = False) -> list[list[int]]:
    """Each trace's greedy answer token ids (up to the end-of-text token), continued from its fork.

    The continuations run side by side (``side_by_side.step_many``, when every trace has the lean step),
    each exactly as ``generate`` would run it alone: greedy, stopping after the end-of-text token or at
    the task's answer length.

    ``until_scored``: an answer also stops as soon as no continuation within its tokens left can change its
    ``string_match_all`` score (``tasks.match_settled``; e.g. a 5-digit answer not yet started with 4
    tokens left, on a tokenizer that writes one digit per token). The ids may then be cut short, but their
    score is that of the whole greedy answer. A wrong answer usually runs to the answer length, so this
    saves its last few decode steps. (Without one shared lean step, the answers go one by one through
    ``generate`` and are checked only at their fork token.)"""
    if not trs:
        return []
    n_new = answer_length(model, sample)
    digit_run = digits_per_token(tok, model.config.vocab_size) if until_scored else 0

    def settled(ids: list[int], left: int) -> bool:  # the score of ids can no longer change
        return until_scored and match_settled(tok.decode(ids), sample.answers, left * digit_run)
    outs, running = [], []                             # running: [trace index, cache, next token, tokens left]
    for i, tr in enumerate(trs):
        m, cache = tr.fork
        if m >= n_new:                                 # greedy follows the reference for its whole length
            outs.append(sample.target_ids[:n_new])
            continue
        first = int(tr.logits[m].argmax())             # greedy's token m (where it leaves the reference)
        outs.append(sample.target_ids[:m] + [first])
        if first != tok.eot_id and len(outs[i]) < n_new and not settled(outs[i], n_new - len(outs[i])):
            running.append([i, copy.deepcopy(cache), first, n_new - len(outs[i])])
    if len({id(tr.lean) for tr in trs}) > 1 or trs[0].lean is None:   # not one shared lean step: one by one
        for i, cache, first, left in running:
            token = torch.tensor([[first]], device=trs[i].logits.device)
            step = None if trs[i].lean is None else trs[i].lean.step
            outs[i] += generate(model, token, left, cache=cache, stop_ids=[tok.eot_id], step=step)[0].tolist()
        running = []
    while running:                                     # feed each its last token, take the argmax
        logits, _ = step_many(trs[0].lean, [torch.tensor([r[2]], device=trs[0].logits.device) for r in running],
                              [r[1] for r in running])
        for r, lg in zip(running, logits):
            r[2] = int(lg.argmax())
            r[3] -= 1
            outs[r[0]].append(r[2])
        running = [r for r in running if r[2] != tok.eot_id and r[3] > 0 and not settled(outs[r[0]], r[3])]
    return [cut_at(out, tok.eot_id) for out in outs]


def greedy_from_trace(model, tok, sample: Sample, tr: Trace) -> list[int]:
    """The greedy answer's token ids (up to the end-of-text token), continued from the trace's fork."""
    return greedy_from_traces(model, tok, sample, [tr])[0]


def greedy_accuracies(model, tok, sample: Sample, trs: list[Trace],
                      until_scored: bool = False) -> list[tuple[float, str]]:
    """string_match_all of the greedy answer under each traced method, and the answer (see the module doc;
    ``until_scored``: answers stop once their score is settled, see ``greedy_from_traces``)."""
    predictions = [tok.decode(ids) for ids in greedy_from_traces(model, tok, sample, trs, until_scored)]
    return [(string_match_all(p, sample.answers), p) for p in predictions]


def greedy_accuracy(model, tok, sample: Sample, tr: Trace) -> tuple[float, str]:
    """string_match_all of the greedy answer under the traced method, and the answer (see the module doc)."""
    return greedy_accuracies(model, tok, sample, [tr])[0]


@dataclass
class Cell:
    """Running means of one (method, budget, task, mode) cell, and each sample's accuracy (for intervals)."""
    n: int = 0
    sums: dict = field(default_factory=dict)
    accuracies: list = field(default_factory=list)
    attn_l1: Tensor | None = None
    kv_bytes: int = 0
    extra_bytes: int = 0

    def add(self, metrics: dict) -> None:
        self.n += 1
        for k, v in metrics.items():
            if k == "attn_l1":
                t = torch.tensor(v)
                self.attn_l1 = t if self.attn_l1 is None else self.attn_l1 + t
            elif k in ("kv_bytes", "extra_bytes"):             # peaks: the largest over samples
                setattr(self, k, max(getattr(self, k), v))
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v
        if "accuracy" in metrics:
            self.accuracies.append(metrics["accuracy"])

    def means(self) -> dict:
        out = {k: v / self.n for k, v in self.sums.items()}
        out.update(kv_bytes=self.kv_bytes, extra_bytes=self.extra_bytes, n_samples=self.n,
                   accuracies=list(self.accuracies),
                   attn_l1=(self.attn_l1 / self.n).tolist() if self.attn_l1 is not None else None)
        return out
