"""
The metrics: one ``Metric`` entry each, in ``METRICS``. An entry says what it reads (its function gets
the full cache's trace, the method's trace, the task and the sample), how its per-sample values reduce to
a record's value, and whether it needs the greedy answer (``protocol.continue_greedy``) or only the
teacher-forced trace. A new metric is one entry here; it lands in every record of ``methods.compare``.

* ``accuracy``: the task's score of the greedy answer (``Task.score``: RULER's ``string_match_all`` for
  the synthetic tasks); its per-sample values are kept too (``accuracies``, for the intervals and tests);
* ``kl``: mean next-token KL(full || method) over the answer positions;
* ``perturbation``: relative error ||h_full - h|| / ||h_full|| of the final hidden state at the first
  decode step (the first moment a prompt compression can show: prompt attention itself is exact);
* ``attn_l1``: per layer and query head, ||o_full - o||_1 of the attention output at that step;
* ``lost_mass``: the full-attention probability mass, at that step, on positions whose raw key and value
  the method does not hold (mean over layers and heads). An entry a method *rebuilds* (KVReviver's sketch)
  counts as lost: its error shows in ``attn_l1``, ``perturbation`` and ``kl`` instead;
* ``kv_bytes``: peak K/V bytes over all layers, with the slots a policy keeps outside the storage (a
  sketch's cells); ``extra_bytes``: peak bytes of what else it keeps (H2O's scores, side tables);
* ``compress_ms``: time in the policy's hooks; ``decode_ms_per_token``: the engine's step time given to
  this cache per answer token. The plain engine steps each cache alone; the fast one steps them together
  and gives each its own attention plus an equal share of the rest: a shared-step time, to compare
  within one run, not a benchmark (that is ``bench.py``);
* ``predictions``: the greedy answers' text, to score anew from a records file (``rescore``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .task import TASKS


def kl(full, method) -> float:
    p_log = torch.log_softmax(full.logits.double(), -1)
    q_log = torch.log_softmax(method.logits.double(), -1)
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


def lost_mass(full, method, group_size: int) -> float:
    """Mean over layers and query heads of the full attention mass on positions the method did not attend
    exactly (not in its storage)."""
    lost = []
    for layer, probs in full.probs.items():                      # probs (H, T) over full positions
        full_pos = full.attended[layer][0]                       # (T,) the full cache attends every position
        kept = method.pos[layer]                                 # (H_kv, Tm) stored exactly, -1 = empty
        keeps = [torch.isin(full_pos, kept_h) for kept_h in kept]   # per KV head: (T,) stored exactly
        for h in range(probs.shape[0]):
            lost.append(float(probs[h][~keeps[h // group_size]].sum()))
    return sum(lost) / len(lost)


def attn_l1(full, method) -> list:
    return torch.stack([(full.outs[i] - method.outs[i]).abs().sum(-1) for i in range(len(full.outs))]).tolist()


@dataclass(frozen=True)
class Metric:
    name: str
    value: Callable          # (full trace, method trace, task, sample) -> one sample's value
    reduce: str = "mean"     # over a record's samples: "mean", "max" (a peak), "mean_each" (of lists), "list"
    answer: bool = False     # reads the greedy answer (else only the teacher-forced trace)
    keep: str | None = None  # also keep every sample's value under this key


METRICS = [
    Metric("accuracy", lambda f, m, task, s: task.score(m.prediction, s), answer=True, keep="accuracies"),
    Metric("kl", lambda f, m, task, s: kl(f, m)),
    Metric("perturbation", lambda f, m, task, s: float((f.hidden - m.hidden).norm() / f.hidden.norm())),
    Metric("attn_l1", lambda f, m, task, s: attn_l1(f, m), reduce="mean_each"),
    Metric("lost_mass", lambda f, m, task, s: lost_mass(f, m, f.outs[0].shape[0] // m.pos[0].shape[0])),
    Metric("kv_bytes", lambda f, m, task, s: m.kv_bytes, reduce="max"),
    Metric("extra_bytes", lambda f, m, task, s: m.extra_bytes, reduce="max"),
    Metric("compress_ms", lambda f, m, task, s: m.compress_ms),
    Metric("decode_ms_per_token", lambda f, m, task, s: m.decode_ms_per_token),
    Metric("predictions", lambda f, m, task, s: m.prediction, reduce="list", answer=True),
]


def measure(full, method, task=None, sample=None, metrics: list[Metric] = METRICS) -> dict:
    """One sample's value of every metric, for a method's trace against the full cache's. Without a task
    and sample, only the metrics of the teacher-forced trace."""
    return {m.name: m.value(full, method, task, sample) for m in metrics if task is not None or not m.answer}


def reduce(values: list[dict], metrics: list[Metric] = METRICS) -> dict:
    """A record's values from its samples' (``measure``'s dicts, in sample order)."""
    out = {"n_samples": len(values)}
    for m in metrics:
        xs = [v[m.name] for v in values]
        if m.reduce == "mean":
            out[m.name] = sum(xs) / len(xs)
        elif m.reduce == "max":
            out[m.name] = max(xs)
        elif m.reduce == "mean_each":                        # summed in float32 in sample order, as recorded
            total = torch.tensor(xs[0])
            for x in xs[1:]:
                total = total + torch.tensor(x)
            out[m.name] = (total / len(xs)).tolist()
        else:
            out[m.name] = xs
        if m.keep:
            out[m.keep] = xs
    return out


def rescore(records: list[dict], tok, seed: int, metric: Metric = METRICS[0]) -> list[list]:
    """Per record of ``methods.compare`` (with its ``predictions``): ``metric`` of each sample's answer,
    from the records alone: each sample is made again from its task, length and seed (the run's ``seed``
    plus the sample's index), and ``metric.value`` gets a trace that holds only the prediction."""
    class Answer:
        def __init__(self, text: str) -> None:
            self.prediction = text
    samples: dict = {}                         # (task, length, seed): each sample made once for all its records
    for r in records:
        for i in range(len(r["predictions"])):
            if (r["task"], r["length"], seed + i) not in samples:
                samples[r["task"], r["length"], seed + i] = TASKS[r["task"]].sample(tok, r["length"], seed + i)
    return [[metric.value(None, Answer(text), TASKS[r["task"]], samples[r["task"], r["length"], seed + i])
             for i, text in enumerate(r["predictions"])] for r in records]
