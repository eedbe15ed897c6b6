"""
The metrics: one ``Metric`` entry each, in ``METRICS``: what it reads (its function gets the full cache's
trace, the method's trace, the task and the sample), how its per-sample values reduce to a record's, and
whether it needs the greedy answer or only the teacher-forced trace. A new metric is one entry here.

    accuracy, kl, perturbation, attn_l1, lost_mass          against the full cache
    kv_bytes, extra_bytes, compress_ms, decode_ms_per_token  what the method costs
    compressed_tokens, prompt_passes, caches_per_step       how the engine ran it
    predictions, prediction_ids, references                 each sample's answers, to score anew

What each measures: ``inside.md``, "metrics.py".
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
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
        keeps = torch.stack([torch.isin(full_pos, kept_h) for kept_h in kept])[:, None]   # (H_kv, 1, T) stored
        lost.append(torch.where(keeps, 0, probs.view(len(kept), group_size, -1)).sum(-1))  # (H_kv, G): h = j*G + g
    lost = torch.cat(lost).flatten().tolist()                    # layer by layer, query head by head: one read
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
    Metric("compressed_tokens", lambda f, m, task, s: m.compressed, reduce="list"),
    Metric("prompt_passes", lambda f, m, task, s: m.prompt_passes, reduce="max"),
    Metric("caches_per_step", lambda f, m, task, s: m.caches_per_step, reduce="max"),
    Metric("predictions", lambda f, m, task, s: m.prediction, reduce="list", answer=True),
    Metric("prediction_ids", lambda f, m, task, s: m.prediction_ids, reduce="list", answer=True),
    Metric("references", lambda f, m, task, s: s.answers, reduce="list", answer=True),
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
            total = 0.0
            for x in xs:                                     # in sample order (sum() may round otherwise)
                total += x
            out[m.name] = total / len(xs)
        elif m.reduce == "max":
            out[m.name] = max(xs)
        elif m.reduce == "mean_each":                        # summed in float32 in sample order, as recorded
            total = torch.tensor(xs[0])
            for x in xs[1:]:
                total = total + torch.tensor(x)
            out[m.name] = (total / len(xs)).tolist()
        elif m.reduce == "list":
            out[m.name] = xs
        else:
            raise ValueError(f"metric {m.name!r}: unknown reduce {m.reduce!r}")
        if m.keep:
            out[m.keep] = xs
    return out


def task_of(record: dict):
    """The record's task: a name of ``TASKS``, or the file the record names (``task_file``), which must be the
    one the run read (its SHA-256)."""
    if "task_file" not in record:
        return TASKS[record["task"]]
    from .task_file import FileTask
    task = FileTask(record["task_file"], record.get("truncate", "middle"))     # before --truncate: the middle
    if task.sha256 != record.get("task_file_sha256"):
        raise ValueError(f"{record['task_file']} is not the task file the run read (its SHA-256 differs)")
    return task


def rescore(records: list[dict], tok, seed: int, metric: Metric = METRICS[0], chat=None) -> list[list]:
    """Per record of ``experiments.compare``: an answer-level ``metric`` of each sample's kept answer, from the
    records alone. Each sample is made again from its task, length and seed (the record's ``seed``, else
    the run's ``seed``, plus its index) and must have the record's ``references`` (else a ValueError: this
    code or tokenizer makes other samples). ``metric.value`` gets what a live run hands it of the answers:
    the method's and the full cache's (the "full" record of the same task, mode and length; None without
    one), each with ``prediction`` and ``prediction_ids`` (kept, or the text encoded again in files written
    before the ids were kept). ``chat(task)``: the task in the chat template, for records run with one."""
    if not metric.answer:
        raise ValueError(f"metric {metric.name!r} reads the traces, which a records file does not keep")
    out, samples, tasks = [], {}, {}           # samples: (task, length, seed) -> each made once for all records
    full = {(r["task"], r["mode"], r["length"]): r for r in records if r["method"] == "full"}

    def answers(r: dict, i: int) -> SimpleNamespace:
        ids = r["prediction_ids"][i] if "prediction_ids" in r else tok.encode(r["predictions"][i])
        return SimpleNamespace(prediction=r["predictions"][i], prediction_ids=ids)

    for r in records:
        if len(r["references"]) != len(r["predictions"]):
            raise ValueError(f"a record has {len(r['predictions'])} predictions but {len(r['references'])} references")
        key = (r["task"], bool(r.get("chat_template")))
        if key not in tasks:
            if key[1] and chat is None:
                raise ValueError(f"record of {r['task']} ran in a chat template: rescoring it needs chat=")
            tasks[key] = chat(task_of(r)) if key[1] else task_of(r)
        task, first = tasks[key], r.get("seed", seed)
        keys = [(r["task"], r["length"], first + i) for i in range(len(r["predictions"]))]
        for key, refs in zip(keys, r["references"]):
            if key not in samples:
                samples[key] = task.sample(tok, key[1], key[2])
            if samples[key].answers != refs:
                raise ValueError(f"sample {key} is not the one the records were made from: {refs}")
        base = full.get((r["task"], r["mode"], r["length"]))
        out.append([metric.value(answers(base, i) if base else None, answers(r, i), task, samples[k])
                    for i, k in enumerate(keys)])
    return out
