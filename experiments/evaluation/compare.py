"""
Compare every KV-cache method with full attention: ``python -m experiments.compare --help``.

For each task, sample and mode, the full cache and every method at every budget run on the identical
sample (``protocol.run_job``: teacher forcing, then greedy answers) on one engine (``--engine``: the plain
one, the fast one of ``side_by_side.py``, or the batched ones of ``batched.py``: one group is the default on a GPU), and
``metrics.measure`` measures each against the full cache.
Results are reduced per (method, budget, task, mode) (``metrics.reduce``), printed as tables, and
optionally written as JSON records, with every greedy answer, and an accuracy-vs-keep-ratio plot.
Everything is deterministic for a seed.

The (task, sample, mode) jobs are independent, so ``--workers`` processes run them side by side (one
torch thread each: a tiny model is dispatch-bound). The results come back in job order and are averaged
in that order, so the records are the same as a single process's, number for number, except the two
timings (``compress_ms``, ``decode_ms_per_token``), which no two runs share anyway. ``--together K`` has
each process step K samples side by side (``together.run_jobs``): fewer operations a sample, the same
records (to float rounding on the batched engines).

Add a method by registering it (``methods/__init__.py``), a task by one class (``task.py``), a metric by one
entry (``metrics.py``); ``experiments/evaluation/README.md`` shows each.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import multiprocessing
import os
import pickle
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from tqdm import tqdm

from methods import METHODS, method_chain
from methods.presets import PRESETS, preset_options
from nanollm import cli, load
from nanollm.cli.provenance import header, provenance
from nanollm.data.evaluate import MODES
from nanollm.data.tasks import ALL_TASKS, LM_TASKS
from nanollm.io.chat import chat_template, chat_wrap
from nanollm.io.checkpoint import load_card, load_config, load_tokenizer, weights_sha256
from nanollm.io.files import atomic_write_text

from . import budget_for, keep_ratio, shards
from .chat import ChatTask
from .engines import ENGINES, make_engine
from .intervals import ALPHA, best_and_ties, paired_difference, sign_test, signed, verdict, wilson
from .metrics import METRICS, reduce
from .protocol import Variant
from .task import TASKS, Task
from .task_file import TRUNCATE, FileTask, metadata
from .together import run_jobs

# Used when the checkpoint's card names no default suite: the tasks the bundled model solves.
DEFAULT_TASKS = ["niah_single_prose", "niah_multikey", "niah_multivalue", "niah_multiquery"]
DEFAULT_KEEP_RATIOS = [0.1, 0.25, 0.5]
DEFAULT_LENGTH = 512
DEFAULT_SAMPLES = 10
MAX_SAMPLES = 10_000    # per task and mode: the default run takes 10, the real model's 30; 10,000 is days of work


_ENGINE: dict = {}      # per process: the engine of the last model, built once (the fast one copies weights)


def engine_for(name: str, alone: bool = False, model=None):
    if _ENGINE.get("key") != (name, alone, id(model)):
        _ENGINE.update(key=(name, alone, id(model)), engine=make_engine(name, model, alone))
    return _ENGINE["engine"]


def some_jobs(model, tok, variants: list[Variant], budgets: list[int], length: int, seed: int,
              engine: tuple[str, bool], jobs: list[tuple[str, int, str]]) -> list[list[tuple[tuple, dict]]]:
    """``together.run_jobs``: the jobs side by side on this process's engine, each one's result. On a GPU that
    processes share, each gives back the memory it no longer uses after each batch (``give_back``), and a
    batch whose memory runs out is run once more, from its start, after giving back what the failed try
    held (the others' peaks may have passed: their jobs' numbers do not depend on when they run); a second
    time is one line from the command (``cli.errors``), not a traceback from each worker."""
    for last in (False, True):
        try:
            return run_jobs(engine_for(*engine, model=model), tok, variants, budgets, length, seed, jobs)
        except torch.OutOfMemoryError:
            if last:
                raise cli.UsageError(out_of_memory(_WORKER.get("workers", 1), len(jobs), engine[0])) from None
        finally:
            give_back()


def give_back() -> None:
    """Where this process has used a GPU: the engine's last buffers dropped and the CUDA allocator's free
    blocks returned, so that the processes sharing the GPU hold what they use, not each its own peak."""
    if torch.cuda.is_initialized():
        if hasattr(_ENGINE.get("engine"), "release"):     # the batched engines: the last step's groups
            _ENGINE["engine"].release()
        gc.collect()                                  # a failed try's tensors, held in reference cycles
        torch.cuda.empty_cache()


_WORKER: dict = {}      # in a worker process: the arguments every job shares, set once by _init_worker


def _init_worker(threads: int, shared: str, workers: int = 1) -> None:
    cli.worker_leaves_on_sigterm()
    torch.set_num_threads(threads)
    _WORKER["workers"] = workers
    with open(shared, "rb") as f:
        _WORKER["shared"] = pickle.load(f)


def _run_jobs_in_worker(jobs: list[tuple[str, int, str]]) -> list[list[tuple[tuple, dict]]]:
    return some_jobs(*_WORKER["shared"], jobs)


def out_of_memory(workers: int, together: int = 1, engine: str = "one-group") -> str:
    """What to do when a worker's GPU memory runs out: the processes share the GPU, each holding the model,
    its caches and CUDA's own memory (SmolLM2's main job with one group held 7 to 10 GiB a worker on an H200:
    fastpath/README.md), each sample stepped together with others holding its own caches; one group pads
    every cache to the largest, where groups by size (``--engine batched``) pad less."""
    held = f", this one holding {torch.cuda.memory_reserved() / 2**30:.1f} GiB" if torch.cuda.is_available() else ""
    other = [f"a smaller --together (each process holds {together} samples' caches)"] if together > 1 else []
    other += ["--engine batched, whose groups by size pad less than one group"] if engine == "one-group" else []
    if workers <= 1:
        return (f"the GPU ran out of memory{held}: the model and its caches do not fit ("
                + ", ".join(other + ["a shorter --length, fewer --methods or --budgets"]) + ")")
    return (f"the GPU ran out of memory with {workers} worker processes sharing it{held}: run with fewer "
            f"--workers" + (f" (or {'; or '.join(other)})" if other else ""))


def in_workers(batches: list[list[tuple]], shared: tuple, workers: int, tick) -> list:
    """``some_jobs`` of every batch of jobs in ``workers`` processes, in order however they finish (passed
    through ``tick``, the progress bar).

    The processes are fresh interpreters ("spawn": safe with torch threads). The model travels as plain
    pickled bytes (a few MB), not through torch's shared-memory files, in a temporary file each worker reads
    as it starts: passed in the pool's arguments, the bytes would go down a pipe that the pool writes until
    the worker has read them, after its imports, so the workers would start one after the other.

    They are started without Ctrl-C (``cli.workers_without_ctrl_c``): on Ctrl-C or SIGTERM this process
    stops them (``Pool.terminate``, by the ``with`` block), removes the file and prints the one
    ``error: interrupted`` line."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="compare-") as folder, ExitStack() as stack:
        blob = os.path.join(folder, "shared.pickle")
        with open(blob, "wb") as f:
            pickle.dump(shared, f)
        with cli.workers_without_ctrl_c():         # a Ctrl-C that came meanwhile is raised at its end,
            pool = stack.enter_context(ctx.Pool(workers, initializer=_init_worker, initargs=(1, blob, workers)))
        return list(tick(pool.imap(_run_jobs_in_worker, batches)))   # ... with the pool in the stack


def default_workers() -> int:
    """The CPUs this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def engine_and_workers(engine: str | None, workers: int | None, device: str, world: int, time_alone: bool,
                       that_fit: int | None = None) -> tuple[str, int]:
    """The engine and the worker processes of a run whose command names none. On a CPU: the fast engine, a
    worker per CPU. On a GPU: the one-group engine (the fewest operations; faster than groups by size on an
    H200, fastpath/README.md; unless ``--time-alone``, which it refuses) and a worker per CPU too, processes
    sharing the GPU, since a step of these small models is bound by launching operations from the host, one
    core each; but no more workers than ``that_fit`` (``workers_that_fit``: a large model gets one, whose
    steps are the GPU's work anyway). Under torchrun (``world`` > 1): one worker per rank."""
    gpu = str(device).startswith("cuda")
    engine = engine or ("one-group" if gpu and not time_alone else "fast")
    if workers or world > 1:
        return engine, workers or 1
    if gpu and that_fit is not None:
        return engine, max(1, min(default_workers(), that_fit))
    return engine, default_workers()


def without_mps(device, workers: int) -> str | None:
    """A line for a run of several processes on one GPU without NVIDIA's Multi-Process Service: their kernels
    then take turns in time slices, where through MPS they run side by side (on an H200 the bundled model's
    suite took less time through it: fastpath/README.md). None where MPS's control daemon is running (its
    pipe ``control`` in ``CUDA_MPS_PIPE_DIRECTORY``, else ``/tmp/nvidia-mps``) or the run is not such a run."""
    if not str(device).startswith("cuda") or workers <= 1:
        return None
    if (Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps") / "control").exists():
        return None
    return (f"note: {workers} worker processes share the GPU without NVIDIA's MPS, so their kernels take turns; "
            "start its daemon (nvidia-cuda-mps-control -d) to run them side by side (fastpath/README.md)")


# What a worker holds on the GPU besides its weights, in multiples of its caches' K/V: one group pads every
# cache to the largest and holds its old and new buffers while it regroups, the question's pass and
# KVReviver's rebuilt entries add more. SmolLM2-135M's main job (25 caches of 2,048 tokens, fp32) held up to
# 10.21 GiB a worker on an H200, four times its caches' K/V and CUDA's own memory (fastpath/README.md); 12
# workers of it ran there, 16 ran out. An estimate from that job, with a tenth of the GPU left spare.
HELD_PER_CACHE, CUDA_OWN, SPARE = 4, 2**30, 0.1


def caches_per_worker(variants: list[Variant], budgets: list[int], together: int = 1) -> int:
    """The caches a worker holds at once: a sample's rows of ``protocol.run_job`` (the full cache, then every
    other variant at every budget), ``together`` samples of them."""
    return (1 + sum(v.spec != "full" for v in variants) * len(budgets)) * together


def workers_that_fit(model, device, caches: int, length: int) -> int:
    """How many workers the GPU's memory holds, each with the model's weights and ``caches`` caches of
    ``length`` tokens in the model's dtype (``HELD_PER_CACHE`` times their K/V, and ``CUDA_OWN``); at least one."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = cfg.kv_bytes_per_token(next(model.parameters()).element_size()) * length
    worker = weights + HELD_PER_CACHE * caches * kv + CUDA_OWN
    return max(1, int((1 - SPARE) * torch.cuda.get_device_properties(torch.device(device)).total_memory // worker))


def run(model, tok, methods: list[str | Variant], budgets: list[int], tasks: list[str | Task], modes: list[str],
        samples: int, length: int, seed: int = 0, progress: bool = True, workers: int = 1,
        rank: int = 0, world: int = 1, engine: str = "fast", time_alone: bool = False,
        together: int = 1) -> list[dict]:
    """All records: one per (method, budget, task, mode), plus method "full" per (task, mode).

    ``methods`` are method specs (``"snapkv"``, ``"adakv(h2o)"``), recorded under their spelling, or
    ``Variant``s, recorded under their label; ``tasks`` are names of ``TASKS`` or ``Task``s (``FileTask``).
    ``workers`` > 1 runs the jobs in that many processes (one torch thread each); the records are the same
    (see the module docstring). Under ``torchrun``, process
    ``rank`` of ``world`` runs its share of the jobs and rank 0 returns every record (``shards``); the
    other ranks return []. ``engine``: "fast", "batched" or "plain" (the same records to float rounding);
    ``time_alone``: the fast engine steps each cache alone, so that ``decode_ms_per_token`` is its own (else a
    share). ``together``: each process steps that many samples side by side (``together.run_jobs``: the same
    records, bit for bit on the fast engine, to float rounding on the batched ones; the step times shared by
    more caches).
    Every record names the engine and says how its step time was taken (``step_timing``)."""
    variants = [m if isinstance(m, Variant) else Variant(m, m) for m in methods]
    shared = (model, tok, variants, budgets, length, seed, (engine, time_alone))
    jobs = [(t, i, m) for t in tasks for i in range(samples) for m in modes]
    mine = shards.share(jobs, rank, world)
    batches = [mine[i:i + together] for i in range(0, len(mine), together)]         # stepped side by side
    workers = min(workers, len(batches))
    # a with block: the bar is closed before the line of an error or Ctrl-C, not after it
    with tqdm(total=len(mine), disable=not progress, desc="compare", unit="sample", dynamic_ncols=True) as bar:
        def tick(results):
            for batch_results in results:
                bar.update(len(batch_results))
                yield from batch_results

        if workers <= 1:
            results = list(tick(some_jobs(*shared, batch) for batch in batches))
        else:
            results = in_workers(batches, shared, workers, tick)
    results = shards.gather(results, len(jobs), rank, world)
    if results is None:                                  # not rank 0: its results went there
        return []
    cells: dict[tuple, list[dict]] = {}                  # per record, its samples' metrics in job order
    for job_results in results:
        for key, metrics in job_results:
            cells.setdefault(key, []).append(metrics)
    timing = "alone" if engine == "plain" or time_alone else "share"
    records = [{"method": name, "budget": budget, "keep_ratio": keep_ratio(budget, length), "task": task,
                "mode": mode, "length": length, **reduce(values), "engine": engine, "step_timing": timing}
               for (name, budget, task, mode), values in cells.items()]
    for r in records:                 # the share of the compressed tokens the budget keeps, sample by sample
        n = r["compressed_tokens"]
        r["realised_keep_ratio"] = round(sum(min(1.0, (r["budget"] or t) / t) for t in n) / len(n), 4)
    return records


def answers_by_row(records: list[dict], mode: str) -> dict[tuple[str, float], list[float]]:
    """Per (method, keep ratio) in ``mode``: every sample's accuracy, tasks one after the other in a fixed
    order, for the rows that ran every task (the pairs of the exact tests)."""
    rows = [r for r in records if r["mode"] == mode]
    tasks = sorted({r["task"] for r in rows}, key=lambda t: ALL_TASKS.index(t) if t in ALL_TASKS else 99)
    by_key: dict[tuple, dict] = {}
    for r in rows:
        by_key.setdefault((r["method"], r["keep_ratio"]), {})[r["task"]] = r["accuracies"]
    return {k: [a for t in tasks for a in v[t]] for k, v in by_key.items() if set(v) == set(tasks)}


# Below this mean accuracy of the full cache on a (task, mode), the task says nothing of the methods: what they
# lose cannot show (every record of that cell is flagged "degenerate" and a warning line printed). 0.1 is two
# right answers in twenty; the bundled model's default suite scores 0.70-1.00 with the full cache.
DEGENERATE = 0.1


def degenerate_cells(records: list[dict]) -> dict[tuple[str, str], float]:
    """{(task, mode): the full cache's mean accuracy} where it is below ``DEGENERATE``."""
    return {(r["task"], r["mode"]): r["accuracy"] for r in records
            if r["method"] == "full" and r["accuracy"] < DEGENERATE}


def flag_degenerate(records: list[dict]) -> list[str]:
    """Marks every record ``degenerate`` (True or False) and returns a warning line per degenerate cell."""
    bad = degenerate_cells(records)
    for r in records:
        r["degenerate"] = (r["task"], r["mode"]) in bad
    return [f"warning: the full cache scores {acc:.2f} on {task} [{mode}], below {DEGENERATE}: the methods' "
            "accuracies there say nothing of what they lose (records flagged degenerate)"
            for (task, mode), acc in bad.items()]


# What the tables show of METRICS; the others are named in one line as JSON-only.
SHOWN = {"accuracy", "kl", "perturbation", "lost_mass", "kv_bytes", "decode_ms_per_token"}


def json_only() -> str:
    return "in the JSON only: " + ", ".join(m.name for m in METRICS if m.name not in SHOWN)


def p_value(p: float) -> str:
    """A p-value in a table: two decimals, or one significant digit below 0.01 ("5e-04"); never rounded up
    to the level ``ALPHA`` when below it (0.0499 is "<0.05", not "0.05")."""
    text = f"{p:.2f}" if p >= 0.01 else f"{p:.0e}"
    return f"<{ALPHA}" if p < ALPHA <= float(text) else text


def versus_best(records: list[dict], mode: str) -> dict[tuple[str, float], str]:
    """Per (method, keep ratio) of the methods (not the full cache): "best" for each keep ratio's best mean
    accuracy, "tie p=.." for a method the exact paired test cannot tell from it (p >= 0.05), else "p=..".
    Keep ratios with a single method get no mark."""
    answers = answers_by_row(records, mode)
    marks = {}
    for ratio in sorted({k[1] for k in answers if k[0] != "full"}):
        at = {k[0]: v for k, v in answers.items() if k[1] == ratio and k[0] != "full"}
        if len(at) < 2:
            continue
        best, p = best_and_ties(at)
        if not any(at[best]):                          # every answer wrong: no best among ties at zero
            continue
        marks[(best, ratio)] = "best"
        for name, pv in p.items():
            marks[(name, ratio)] = f"tie p={p_value(pv)}" if pv >= ALPHA else f"p={p_value(pv)}"
    return marks


def pairwise(records: list[dict]) -> list[dict]:
    """Every pair of methods at every keep ratio, per mode: the exact paired test of their answers
    (``intervals.sign_test``): wins of each on the samples where they differ, and the two-sided p-value."""
    out = []
    for mode in [m for m in MODES if any(r["mode"] == m for r in records)]:
        answers = answers_by_row(records, mode)
        for ratio in sorted({k[1] for k in answers if k[0] != "full"}):
            names = sorted(k[0] for k in answers if k[1] == ratio and k[0] != "full")
            for i, a in enumerate(names):
                for b in names[i + 1:]:
                    wa, wb, p = sign_test(answers[(a, ratio)], answers[(b, ratio)])
                    out.append({"mode": mode, "keep_ratio": ratio, "a": a, "b": b, "wins_a": wa, "wins_b": wb,
                                "p": p, "n": len(answers[(a, ratio)])})
    return out


def format_pairwise(records: list[dict]) -> str:
    """Per mode and keep ratio, a matrix of the exact paired tests between methods: "w:l p" is how many
    samples the row's method answered better than the column's, how many worse, and the p-value."""
    lines = []
    tests = pairwise(records)
    for mode in [m for m in MODES if any(t["mode"] == m for t in tests)]:
        for ratio in sorted({t["keep_ratio"] for t in tests if t["mode"] == mode}):
            at = [t for t in tests if t["mode"] == mode and t["keep_ratio"] == ratio]
            names = sorted({t["a"] for t in at} | {t["b"] for t in at})
            cell = {}
            for t in at:
                cell[(t["a"], t["b"])] = f"{t['wins_a']}:{t['wins_b']} {p_value(t['p'])}"
                cell[(t["b"], t["a"])] = f"{t['wins_b']}:{t['wins_a']} {p_value(t['p'])}"
            w = max(14, 1 + max(map(len, names)))
            cw = max(11, 2 + max(len(c) for c in cell.values()))
            head = f"{'':<{w}}" + "".join(f"{n[:cw - 2]:>{cw}}" for n in names)
            lines += [f"\n[{mode}] keep {ratio:.2f}: exact paired tests over {at[0]['n']} answers "
                      "(row wins:column wins on the samples they differ, two-sided p)", head, "-" * len(head)]
            for a in names:
                lines.append(f"{a:<{w}}" + "".join(f"{cell.get((a, b), '-'):>{cw}}" for b in names))
    return "\n".join(lines)


def format_tables(records: list[dict]) -> str:
    """One table per mode: rows method @ keep ratio (and the share of the compressed tokens kept, mean over
    tasks), columns accuracy per task, then mean metrics, and (with per-sample accuracies) how each method
    stands against its keep ratio's best (``versus_best``)."""
    lines = []
    tasks = sorted({r["task"] for r in records}, key=lambda t: ALL_TASKS.index(t) if t in ALL_TASKS else 99)
    for mode in [m for m in MODES if any(r["mode"] == m for r in records)]:
        rows = [r for r in records if r["mode"] == mode]
        keys = sorted({(r["method"], r["keep_ratio"], r["budget"]) for r in rows},
                      key=lambda k: (k[0] != "full", k[0], k[1]))
        short = [t.replace("niah_", "").replace("single_", "s_")[:10] for t in tasks]
        marks = versus_best(records, mode) if all("accuracies" in r for r in rows) else {}
        w = max(14, 1 + max(len(k[0]) for k in keys))                 # the method column fits every name
        head = f"{'method':<{w}}{'keep':>6}{'kept':>6}{'budget':>7} " + "".join(f"{s:>11}" for s in short) + \
            f"{'mean acc':>9}{'KL':>8}{'pert':>7}{'lost':>6}{'KV KiB':>8}{'step ms':>8}" + \
            ("  vs best" if marks else "")
        lines += [f"\n[{mode}]", head, "-" * len(head)]
        for method, ratio, budget in keys:
            sel = {r["task"]: r for r in rows if (r["method"], r["keep_ratio"], r["budget"]) == (method, ratio, budget)}
            accs = [sel[t]["accuracy"] if t in sel else float("nan") for t in tasks]
            mean = lambda k: sum(r[k] for r in sel.values()) / len(sel)   # noqa: E731
            kept = mean("realised_keep_ratio") if all("realised_keep_ratio" in r for r in sel.values()) else ratio
            lines.append(f"{method:<{w}}{ratio:>6.2f}{kept:>6.2f}{budget if budget is not None else '-':>7} "
                         + "".join(f"{a:>11.2f}" for a in accs)
                         + f"{sum(accs) / len(accs):>9.2f}{mean('kl'):>8.3f}{mean('perturbation'):>7.3f}"
                         f"{mean('lost_mass'):>6.2f}{max(r['kv_bytes'] for r in sel.values()) / 1024:>8.0f}"
                         f"{mean('decode_ms_per_token'):>8.1f}"
                         + (f"  {marks.get((method, ratio), ''):<11}".rstrip() if marks else ""))
    return "\n".join(lines)


def format_intervals(records: list[dict]) -> str:
    """Per mode: each row's mean accuracy with its 95% Wilson interval, its paired difference from the
    full cache (95% bootstrap interval), and per keep ratio the methods the exact paired test cannot tell
    from that keep ratio's best (see ``intervals``). Needs the per-sample ``accuracies`` of each record."""
    lines = []
    for mode in [m for m in MODES if any(r["mode"] == m for r in records)]:
        rows = [r for r in records if r["mode"] == mode]
        tasks = sorted({r["task"] for r in rows}, key=lambda t: ALL_TASKS.index(t) if t in ALL_TASKS else 99)
        by_key: dict[tuple, dict] = {}
        for r in rows:
            by_key.setdefault((r["method"], r["keep_ratio"]), {})[r["task"]] = r["accuracies"]
        groups = {k: [v[t] for t in tasks] for k, v in by_key.items() if set(v) == set(tasks)}
        full = next((g for (m, _), g in groups.items() if m == "full"), None)
        keys = sorted(groups, key=lambda k: (k[0] != "full", k[0], k[1]))
        w = max(14, 1 + max(len(k[0]) for k in keys))
        head = f"{'method':<{w}}{'keep':>6}{'mean acc':>9}   {'95% interval':<14}" + \
            ("   vs full (paired): difference [95% interval]" if full else "")
        lines += [f"\n[{mode}] mean accuracy: 95% Wilson interval over its answers; "
                  "difference from the full cache: 95% paired bootstrap interval (each task's samples resampled)", head,
                  "-" * len(head)]
        means = {}
        for k in keys:
            g = groups[k]
            means[k] = sum(sum(x) / len(x) for x in g) / len(g)
            lo, hi = wilson(means[k], sum(len(x) for x in g))
            line = f"{k[0]:<{w}}{k[1]:>6.2f}{means[k]:>9.2f}   [{lo:.2f}, {hi:.2f}]  "
            if full is not None and k[0] != "full":
                d, dlo, dhi = paired_difference(g, full)
                line += f"   {signed(d)} [{signed(dlo)}, {signed(dhi)}]  {verdict(dlo, dhi)}"
            lines.append(line.rstrip())
        answers = answers_by_row(records, mode)
        for ratio in sorted({k[1] for k in keys if k[0] != "full"}):
            at = {k[0]: answers[k] for k in keys if k[1] == ratio and k[0] != "full"}
            if len(at) < 2:
                continue
            best, p = best_and_ties(at)
            if not any(at[best]):
                lines.append(f"keep {ratio:.2f}: no best, every method answers nothing right")
                continue
            ties = [f"{name} (p={p_value(pv)})" for name, pv in sorted(p.items(), key=lambda x: -x[1]) if pv >= ALPHA]
            lines.append(f"keep {ratio:.2f}: best {best} ({means[(best, ratio)]:.2f}); not distinguishable from it "
                         "(exact paired test, p >= 0.05): " + (", ".join(ties) if ties else "none"))
    return "\n".join(lines)


def format_summary(records: list[dict]) -> str:
    """What ``--quiet`` prints instead of the tables: per mode and keep ratio, the best method and those the
    exact paired test cannot tell from it (``format_intervals``' verdict lines)."""
    lines, mode = [], ""
    for line in format_intervals(records).splitlines():
        if line.startswith("["):
            mode = line.split("]")[0] + "]"
        elif line.startswith("keep "):
            lines.append(f"{mode} {line}")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    """Mean accuracy over tasks vs keep ratio, one line per method with its 95% Wilson interval over the
    row's answers, one panel per mode, the legend beside the panels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = [m for m in MODES if any(r["mode"] == m for r in records)]
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes) + 1.6, 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rows = [r for r in records if r["mode"] == mode]
        full = [r["accuracy"] for r in rows if r["method"] == "full"]
        if full:
            ax.axhline(sum(full) / len(full), color="black", ls="--", label="full")
        for method in sorted({r["method"] for r in rows} - {"full"}):
            ratios = sorted({r["keep_ratio"] for r in rows if r["method"] == method})
            cells = [[r for r in rows if r["method"] == method and r["keep_ratio"] == k] for k in ratios]
            accs = [sum(r["accuracy"] for r in c) / len(c) for c in cells]
            answers = [sum(r.get("n_samples", 1) for r in c) for c in cells]
            bounds = [wilson(min(1.0, max(0.0, a)), n) for a, n in zip(accs, answers)]
            err = [[a - lo for a, (lo, _) in zip(accs, bounds)], [hi - a for a, (_, hi) in zip(accs, bounds)]]
            ax.errorbar(ratios, accs, yerr=err, marker="o", capsize=3, label=method)
        ax.set(title=mode.replace("_", " "), xlabel="keep ratio (budget / --length)",
               ylabel="accuracy (mean over tasks, 95% interval)", ylim=(-0.03, 1.03))
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    cli.save_figure(fig, path)                  # png/pdf/svg by suffix; the old figure stays if writing fails


def samples_flag(text: str) -> int | str:
    """``--samples``: a positive integer, at most ``MAX_SAMPLES`` (a larger count is refused before the list of
    jobs is made, which for 10^12 samples alone would not fit in memory), or ``all``: every item of the task
    files from ``--seed`` on."""
    if text == "all":
        return text
    value = cli.positive_int(text)
    if value > MAX_SAMPLES:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SAMPLES}, got {value}")
    return value


def results_bytes(config, jobs: int, caches: int) -> int:
    """About the memory the per-sample results of a run hold before they are reduced to records: per job and
    cache, 2 KiB of metrics and answers, and the attention error per layer and query head (32 bytes each)."""
    return jobs * caches * (2048 + 32 * config.n_layer * config.n_head)


def check_methods_flag(specs: list[str]) -> None:
    """``--methods``: a one-line error naming the first bad method spec, before any work starts."""
    for m in specs:
        try:
            method_chain(m)
        except ValueError as e:
            cli.fail(f"--methods: {e}")


def parser() -> cli.ArgumentParser:
    """The command line (also read back by the tests from a results file's recorded command)."""
    ap = cli.ArgumentParser(
        prog="python -m experiments.compare",
        description="Run KV-cache methods side by side with full attention on synthetic long-context tasks "
                    "and report accuracy, KL(full || method), output perturbation, attention mass lost, "
                    "KV bytes and decode time per (method, budget, task, mode).")
    ap.add_argument("--checkpoint", default="retrieval-llama",
                    help="bundled checkpoint name, fetched model's name (smollm2-135m), nanollm checkpoint folder, "
                         "local Hugging Face folder or GGUF file (default %(default)s)")
    ap.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                    help=f"methods to run: registered names ({', '.join(METHODS)}) or a wrapper around a "
                         "scorer, e.g. 'adakv(h2o)'; the records name them as written (default: every "
                         "registered name)")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--keep-ratios", nargs="+", type=float, default=None, metavar="R",
                       help="keep ratios, each in (0, 1]: budget = round(R * --length) entries per layer and KV "
                            "head, one budget for every sample; the records keep R and the share of each sample's "
                            "compressed tokens kept (realised_keep_ratio, larger: a prompt is shorter than "
                            f"--length) (default {' '.join(map(str, DEFAULT_KEEP_RATIOS))})")
    group.add_argument("--budgets", nargs="+", type=int, default=None, metavar="B",
                       help="budgets in tokens per layer per KV head, instead of --keep-ratios")
    ap.add_argument("--tasks", nargs="+", default=None, metavar="TASK",
                    help=f"tasks (default: the checkpoint card's default suite, else {' '.join(DEFAULT_TASKS)}; "
                         f"all: {', '.join(TASKS)}; for real language models: {', '.join(LM_TASKS)}; "
                         "docs_continuation is read from real text, experiments/evaluation/task.py)")
    ap.add_argument("--task-file", nargs="+", default=[], metavar="PATH",
                    help="tasks read from JSON Lines files (context, question, answers; optionally scorer and "
                         "answer_tokens: experiments/evaluation/task_file.py), each named file:<its stem>, run after "
                         "the --tasks (none by default when a file is given); sample i is item --seed + i")
    ap.add_argument("--truncate", choices=TRUNCATE, default="refuse",
                    help="a task file's context longer than --length allows beside its question and answer: refused "
                         "before any work (default), or cut in its middle (its first and last halves kept) or on its "
                         "left (its end kept); the run says how many items it cut, and which lost every answer")
    ap.add_argument("--chat-template", action="store_true",
                    help="wrap every prompt in the checkpoint's chat template (an instruct model's, read from its "
                         "folder or GGUF file): context and question one user message, the answer the "
                         "assistant's turn (experiments/evaluation/chat.py); refused for a checkpoint without one")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the weights' and the caches' dtype (default %(default)s); bfloat16 halves the memory and "
                         "moves the logits by bf16's rounding (see nanollm/README.md)")
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES,
                    help="question_in_prompt: the question is in the prompt when the cache is compressed; "
                         "question_after_context: the context is compressed first and the question arrives "
                         "later through extend (default: both)")
    ap.add_argument("--samples", type=samples_flag, default=None,
                    help=f"samples per task and mode, at most {MAX_SAMPLES} (default: the checkpoint card's, 30 for "
                         f"smollm2-135m, else {DEFAULT_SAMPLES}), or 'all': every item of the --task-file files from "
                         "--seed on (files of one size, no built-in --tasks)")
    ap.add_argument("--length", type=int, default=None,
                    help="tokens per sample, context + question + answer (default: the checkpoint card's, 2048 "
                         f"for smollm2-135m, else {DEFAULT_LENGTH}, or the model's maximum positions if smaller; "
                         "--length 4096 runs the real model at 4k)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="ours",
                    help="the methods' options: ours (the papers' settings, methods/README.md) or kvpress (the "
                         "defaults of NVIDIA's kvpress 0.5.5 for the methods it has: SnapKV window 64, kernel 5, "
                         "average pooling; ChunkKV chunks of 20, no reuse; CriticalKV alpha 0.5 of the budget, "
                         "epsilon 1e-4; see methods/presets.py) (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="first sample seed (default %(default)s)")
    ap.add_argument("--device", type=cli.device, default="cpu", help="torch device (default %(default)s)")
    ap.add_argument("--threads", type=cli.threads_or_workers, default=1,
                    help="torch CPU threads of a single-process run, at most the CPU cores (default 1: a tiny "
                         "model is dispatch-bound, so more threads only add synchronisation)")
    ap.add_argument("--engine", choices=sorted(ENGINES), default=None,
                    help="fast: one prompt pass for all the caches of a sample and their decode steps side by side "
                         "(side_by_side.py); batched: the fast engine with the caches' attention batched too, "
                         "their entries in shared buffers (batched.py: fewer, larger operations, for a GPU); "
                         "one-group: the batched engine with every cache in one group, padded to the largest (fewer "
                         "operations still, more bytes: the fastest measured on a GPU); "
                         "plain: nanollm's own prefill and forward, one cache at a time (engine.py), slower; the "
                         "records agree to float rounding (default: one-group on a GPU, fast on a CPU or with "
                         "--time-alone)")
    ap.add_argument("--time-alone", action="store_true",
                    help="the fast engine steps each cache alone, so that step ms is the cache's own decode time "
                         "(slower; the same records otherwise); by default the caches share a step and each "
                         "gets its own attention's time plus an equal share of the rest")
    ap.add_argument("--workers", type=cli.threads_or_workers, default=None,
                    help="processes running samples side by side, one torch thread each, at most the CPU cores; "
                         "the records are the same as with 1, timings aside; on a GPU they share it, each with "
                         "its own copy of the model there (default: the CPUs available, here "
                         f"{default_workers()}; on a GPU no more than its memory holds by an estimate, "
                         "workers_that_fit; "
                         "one per rank under torchrun)")
    ap.add_argument("--together", type=cli.positive_int, default=1, metavar="K",
                    help="samples each process steps side by side: one decode step of the model for every cache of "
                         "K samples, so that each operation serves more caches (a GPU launches each); the same "
                         "records, bit for bit with the fast engine, to float rounding with the batched ones, the "
                         "step times shared by more caches; K samples' caches held at once (default %(default)s)")
    ap.add_argument("--json", type=cli.output_file, default=None, metavar="PATH",
                    help="write the records as a JSON list to PATH (default: none)")
    ap.add_argument("--plot", type=cli.figure_file, default=None, metavar="PATH",
                    help="write an accuracy-vs-keep-ratio figure to PATH, a "
                         f"{cli.FIGURE_HELP} file (default: none)")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress bar, and a short summary instead of the tables: per mode and keep ratio, the "
                         "best method and those the paired test cannot tell from it (--json keeps every number)")
    return ap


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """The command; ``prog`` names it in its errors and records where another module runs it."""
    ap = parser()
    ap.prog = prog or ap.prog
    args = ap.parse_args(argv)

    with cli.errors(args.debug):
        # every argument is checked before the model loads
        cli.check_outputs({"--json": args.json, "--plot": args.plot}, inputs=[args.checkpoint])
        methods = args.methods or list(METHODS)
        check_methods_flag(methods)
        config, card = load_config(args.checkpoint), load_card(args.checkpoint)
        tok = load_tokenizer(args.checkpoint)
        if tok is None:
            cli.fail(f"--checkpoint {args.checkpoint} has no supported tokenizer, which the synthetic tasks need")
        file_tasks = []
        for path in args.task_file:
            try:
                file_tasks.append(FileTask(path, args.truncate))
                if extra := metadata(file_tasks[-1].items):      # a benchmark's own fields: kept, not read
                    print(f"{file_tasks[-1].name}: fields kept as metadata, not read: {', '.join(extra)}",
                          file=sys.stderr)
            except (OSError, ValueError) as e:
                cli.fail(f"--task-file: {e}")
        names = args.tasks or ([] if file_tasks else card.get("default_suite") or DEFAULT_TASKS)
        bad = [t for t in names if t not in TASKS]
        if bad:
            cli.fail(f"--tasks: unknown task(s) {bad}; choose from {list(TASKS)}")
        tasks = [TASKS[t] for t in names] + file_tasks
        if args.chat_template:
            template = chat_template(args.checkpoint)
            if template is None:
                cli.fail(f"--chat-template: checkpoint {args.checkpoint} has no chat template")
            try:
                prefix, suffix = chat_wrap(template, **special_tokens(tok))
            except Exception as e:                     # a template is code of the checkpoint's: any error, one line
                cli.fail(f"--chat-template: the checkpoint's template does not render ({e})")
            tasks = [ChatTask(t, tok, prefix, suffix) for t in tasks]
        if len({t.name for t in tasks}) < len(tasks):
            cli.fail(f"--task-file: two tasks share a name: {[t.name for t in tasks]}")
        length = args.length if args.length is not None else \
            min(card.get("default_length") or DEFAULT_LENGTH, config.max_seq_len)
        if args.samples == "all":                      # every item of the files, from --seed on
            sizes = {len(t.items) for t in file_tasks}
            if not file_tasks or len(tasks) > len(file_tasks) or len(sizes) > 1:
                cli.fail("--samples all takes every item of the --task-file files: give files of one size "
                         f"and no built-in --tasks (sizes {sorted(sizes)}, {len(tasks) - len(file_tasks)} built-in)")
            args.samples = min(sizes.pop() - args.seed, MAX_SAMPLES)
            if args.samples < 1:
                cli.fail(f"--samples all from --seed {args.seed}: the files hold fewer items")
        samples = args.samples or card.get("default_samples") or DEFAULT_SAMPLES
        if not isinstance(samples, int) or not 0 < samples <= MAX_SAMPLES:
            cli.fail(f"--samples must be in [1, {MAX_SAMPLES}], got {samples!r} (the checkpoint card's default)")
        if not 0 < length <= config.max_seq_len:
            cli.fail(f"--length must be in [1, {config.max_seq_len}] (the model's maximum positions), got {length}")
        for task in tasks:
            if file_task(task) and not \
                    0 <= args.seed <= args.seed + samples - 1 < len(task.items):
                cli.fail(f"--samples {samples} from --seed {args.seed} asks for items {args.seed} to "
                         f"{args.seed + samples - 1} of {task.path}, which holds {len(task.items)}")
            try:
                if file_task(task):                    # every item of the run, before the first is made
                    check_cuts(task, tok, length, range(args.seed, args.seed + samples), args.truncate)
                task.sample(tok, length, args.seed)
            except ValueError as e:
                cli.fail(f"--length {length}: {e}")
        if args.budgets is not None:
            budgets = args.budgets
        else:
            ratios = args.keep_ratios or DEFAULT_KEEP_RATIOS
            if any(not 0 < r <= 1 for r in ratios):
                cli.fail(f"--keep-ratios must lie in (0, 1], got {ratios}")
            budgets = [budget_for(r, length) for r in ratios]
        if any(b <= 0 for b in budgets):
            cli.fail(f"--budgets must be positive, got {budgets}")
        variants = [Variant(m, m, preset_options(m, args.preset)) for m in methods]
        caches = caches_per_worker(variants, budgets)
        cli.check_fits(f"--samples {samples} ({len(tasks)} task(s), {len(args.modes)} mode(s), {caches} caches "
                       "each)", results_bytes(config, samples * len(tasks) * len(args.modes), caches))
        torch.set_num_threads(args.threads)
        rank, world, device = shards.start(args.device) if shards.launched() else (0, 1, args.device)
        try:
            run_main(args, ap, argv, variants, tasks, budgets, length, samples, rank, world, device)
        finally:
            shards.stop()


def launcher(world: int, prog: str) -> str:
    """How the command was started, for its provenance: ``prog``, or torchrun with the process counts."""
    if world == 1:
        return prog
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", max(1, world // local)))          # torchrun's machine count
    nodes = f"--nnodes {nodes} " if local != world else ""
    return f"torchrun {nodes}--nproc-per-node {local} -m " + prog.removeprefix("python -m ")


def run_main(args, ap, argv, variants, tasks, budgets, length, samples, rank, world, device) -> None:
    """``main`` after every argument is checked: load, run (this rank's share under torchrun), report."""
    model, tok, card = load(args.checkpoint, device=device, dtype=getattr(torch, args.dtype))
    caches = caches_per_worker(variants, budgets, args.together)
    room = workers_that_fit(model, device, caches, length) if str(device).startswith("cuda") else None
    args.engine, workers = engine_and_workers(args.engine, args.workers, device, world, args.time_alone, room)
    try:
        engine_for(args.engine, args.time_alone, model)   # a model the fast engine does not take: one line, now
    except ValueError as e:
        cli.fail(str(e))
    t0 = time.time()
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    prov = provenance(argv, prog=launcher(world, ap.prog), threads=args.threads if workers <= 1 else 1,
                      dtype=dtype, seed=args.seed)
    if rank != 0:                            # the other ranks run their share and send it to rank 0
        run(model, tok, variants, budgets, tasks, args.modes, samples, length, args.seed, progress=False,
            workers=workers, rank=rank, world=world, engine=args.engine,
            time_alone=args.time_alone, together=args.together)
        return
    if note := without_mps(device, workers):
        print(note, file=sys.stderr)
    options = "; ".join(f"{v.label}: {', '.join(f'{k}={x}' for k, x in v.options.items()) or 'defaults'}"
                        for v in variants)
    print(header(prov) + f"\n# methods' options: {args.preset} ({options})", flush=True)
    records = run(model, tok, variants, budgets, tasks, args.modes, samples, length, args.seed,
                  progress=not args.quiet, workers=workers, rank=rank, world=world, engine=args.engine,
                  time_alone=args.time_alone, together=args.together)
    files = {t.name: file_task(t) for t in tasks if file_task(t)}
    for r in records:
        r.update(preset=args.preset, checkpoint=args.checkpoint, seed=args.seed, dtype=args.dtype,
                 chat_template=args.chat_template)
        if r["task"] in files:
            items = files[r["task"]].items
            r.update(task_file=files[r["task"]].path, task_file_sha256=files[r["task"]].sha256,
                     truncate=args.truncate, cuts=getattr(files[r["task"]], "cut_items", []),
                     item_ids=[items[args.seed + i].get("id", args.seed + i) for i in range(samples)])
    for line in flag_degenerate(records):
        print(line, file=sys.stderr)
    if args.quiet:                  # a short summary; every number is in the records (--json)
        print(format_summary(records))
    else:
        print(format_tables(records))
        print(json_only())
        print(format_intervals(records))
        print(format_pairwise(records))
    legend = ("keep = budget / --length; kept = the share of each sample's compressed tokens the budget keeps (mean "
              "over the samples and tasks); acc = the task's score of the greedy answer (string_match_all for RULER's "
              "tasks); KL = mean next-token KL(full || method) over the answer; pert = relative error of the final "
              "hidden state at the first decode step; lost = full-attention mass on entries the method dropped at "
              "that step; step ms = the engine's decode step time given to the cache per answer token ("
              + ("its own step, timed alone)." if args.engine == "plain" or args.time_alone else
                 "a share: its own attention plus an equal share of the step all the caches shared; compare within "
                 "one run, or time each cache alone with --time-alone)."))
    if args.quiet:
        legend = "The tables: the same command without --quiet, or the records of --json."
    print(f"\n{samples} samples per task and mode, {length} tokens, seed {args.seed}, "
          f"{time.time() - t0:.0f} s with {workers} worker(s)"
          + (f" in each of {world} processes" if world > 1 else "")
          + (f", {args.together} samples stepped together" if args.together > 1 else "")
          + f", {args.engine} engine. {legend}")
    if args.json:
        ran = {"engine": args.engine, "weights_sha256": weights_sha256(args.checkpoint)}    # what ran, exactly
        if args.chat_template:
            ran["chat_template_sha256"] = hashlib.sha256(chat_template(args.checkpoint).encode()).hexdigest()
        atomic_write_text(args.json, json.dumps({"provenance": prov, "preset": args.preset, "run": ran,
                                                 "records": records, "pairwise": pairwise(records)},
                                                indent=1))
        print(f"records written to {args.json}")
    if args.plot:
        plot(records, args.plot)
        print(f"plot written to {args.plot}")


def check_cuts(task: Task, tok, length: int, seeds: range, truncate: str) -> None:
    """The items of a file task the run would cut (``FileTask.cuts``, at the length the task's own prompt
    leaves: a chat template's tokens first): none with ``--truncate refuse``, else said in a line (on stderr)
    before the run, with the items whose cut lost every answer; kept on the task for its records (``cuts``)."""
    inner = file_task(task)
    room = length - (len(task.prefix_ids) + len(task.suffix_ids) if task is not inner else 0)
    cuts = inner.cuts(tok, room, seeds)
    if cuts and truncate == "refuse":
        worst = max(cuts, key=lambda c: c["context_tokens"])
        raise ValueError(f"{inner.path}: {len(cuts)} of {len(seeds)} items have a context longer than --length "
                         f"allows (the longest, item {worst['item']}: {worst['context_tokens']} tokens, "
                         f"{worst['kept_tokens']} fit); --truncate middle or left cuts them, or raise --length")
    inner.cut_items = cuts
    if cuts:
        lost = [c["item"] for c in cuts if not c["answers_kept"]]
        print(f"{task.name}: {len(cuts)} of {len(seeds)} items cut to fit --length {length} (--truncate {truncate})"
              + (f"; the cut took every answer out of the prompt of items {lost}" if lost else
                 "; every answer the context held is still in the prompt"), file=sys.stderr, flush=True)


def file_task(task: Task) -> FileTask | None:
    """The task read from a file behind ``task`` (itself, or the one a ``ChatTask`` wraps), else None."""
    inner = getattr(task, "task", task)
    return inner if isinstance(inner, FileTask) else None


def special_tokens(tok) -> dict:
    """The special tokens a chat template may name (``bos_token``, ``eos_token``), as text: the end-of-text
    token's, the only one nanollm's tokenizers know by role."""
    eot = tok.decode([tok.eot_id]) if getattr(tok, "eot_id", None) is not None else ""
    return {"bos_token": "", "eos_token": eot}
