"""
Compare every KV-cache method with full attention: ``python -m experiments.compare --help``.

For each task, sample and mode, the full cache and every method at every budget run on the identical
sample (``protocol.run_job``: teacher forcing, then greedy answers) on one engine (``--engine``), and
``metrics.measure`` measures each against the full cache; the results are reduced per (method, budget,
task, mode) into records (``run``, from a ``RunSpec``), which ``report.py`` prints as tables and a plot.
Everything is deterministic for a seed. The jobs are independent, so ``--workers`` processes
(``workers.py``) run them side by side, their results averaged in job order: the records are those of one
process, number for number, but the timings. ``--together K`` steps K samples side by side.

Add a method by registering it (``methods/__init__.py``), a task by one class (``task.py``), a metric by one
entry (``metrics.py``); ``experiments/evaluation/README.md`` shows each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from methods import METHODS, method_chain
from methods.presets import PRESETS, preset_options
from nanollm import cli, load
from nanollm.cli.provenance import header, provenance
from nanollm.data.evaluate import MODES
from nanollm.data.tasks import LM_TASKS
from nanollm.io.chat import chat_template, chat_wrap
from nanollm.io.checkpoint import load_card, load_config, load_tokenizer, weights_sha256
from nanollm.io.files import atomic_write_text

from . import budget_for, keep_ratio, shards
from .chat import ChatTask
from .engines import ENGINES
from .metrics import reduce
from .outside import answer_metric, score_records
from .protocol import Variant
from .report import (
    flag_degenerate,
    format_intervals,
    format_pairwise,
    format_scored,
    format_summary,
    format_tables,
    json_only,
    pairwise,
    plot,
    shown,
)
from .task import TASKS, Task
from .task_file import TRUNCATE, FileTask, metadata
from .workers import (
    caches_per_worker,
    default_workers,
    engine_and_workers,
    engine_for,
    in_workers,
    some_jobs,
    without_mps,
    workers_that_fit,
)

# Used when the checkpoint's card names no default suite: the tasks the bundled model solves.
DEFAULT_TASKS = ["niah_single_prose", "niah_multikey", "niah_multivalue", "niah_multiquery"]
DEFAULT_KEEP_RATIOS = [0.1, 0.25, 0.5]
DEFAULT_LENGTH = 512
DEFAULT_SAMPLES = 10
MAX_SAMPLES = 10_000    # per task and mode: the default run takes 10, the real model's 30; 10,000 is days of work


@dataclass
class RunSpec:
    """What a run of the main job measures, and how it runs it.

    ``methods``: method specs (``"snapkv"``, ``"adakv(h2o)"``), recorded under their spelling, or ``Variant``s,
    recorded under their label; ``budgets``: tokens kept per layer and KV head; ``tasks``: names of ``TASKS``
    or ``Task``s (``FileTask``); ``modes``: of ``MODES``; ``samples`` per task and mode, of ``length`` tokens,
    from ``seed`` on. ``engine``: "fast", "batched", "one-group" or "plain" (the same records to float
    rounding); ``time_alone``: the fast engine steps each cache alone, so that ``decode_ms_per_token`` is its
    own (else a share); ``together``: each process steps that many samples side by side (``together.run_jobs``:
    the same records, bit for bit on the fast engine, to float rounding on the batched ones); ``workers`` > 1:
    that many processes (``workers.py``), the same records; under ``torchrun``, process ``rank`` of ``world``
    runs its share of the jobs (``shards``); ``progress``: a progress bar."""

    methods: list
    budgets: list[int]
    tasks: list
    modes: list[str]
    samples: int
    length: int
    seed: int = 0
    engine: str = "fast"
    time_alone: bool = False
    together: int = 1
    workers: int = 1
    rank: int = 0
    world: int = 1
    progress: bool = True


def run(model, tok, spec: RunSpec) -> list[dict]:
    """All records of ``spec``: one per (method, budget, task, mode), plus method "full" per (task, mode);
    rank 0 returns every rank's, the other ranks []. Every record names the engine and says how its step
    time was taken (``step_timing``)."""
    methods, budgets, length, seed, engine = spec.methods, spec.budgets, spec.length, spec.seed, spec.engine
    time_alone, together, rank, world = spec.time_alone, spec.together, spec.rank, spec.world
    variants = [m if isinstance(m, Variant) else Variant(m, m) for m in methods]
    shared = (model, tok, variants, budgets, length, seed, (engine, time_alone))
    jobs = [(t, i, m) for t in spec.tasks for i in range(spec.samples) for m in spec.modes]
    mine = shards.share(jobs, rank, world)
    batches = [mine[i:i + together] for i in range(0, len(mine), together)]         # stepped side by side
    workers = min(spec.workers, len(batches))
    done: list = []                                      # each finished batch's results, in job order
    # a with block: the bar is closed before the line of an error or Ctrl-C, not after it
    with tqdm(total=len(mine), disable=not spec.progress, desc="compare (task x sample x mode)", unit="job",
              dynamic_ncols=True) as bar:
        def tick(results):
            for batch_results in results:
                bar.update(len(batch_results))
                done.append(batch_results)
                yield from batch_results

        try:
            if workers <= 1:
                results = list(tick(some_jobs(*shared, batch) for batch in batches))
            else:
                results = in_workers(batches, shared, workers, tick)
        except Exception as e:                           # a sample failed: what finished is kept (not under torchrun)
            if world > 1:
                raise
            finished = [r for batch in done for r in batch]
            raise Incomplete(records_of(finished, spec), batches[len(done)], e) from e
    results = shards.gather(results, len(jobs), rank, world)
    if results is None:                                  # not rank 0: its results went there
        return []
    return records_of(results, spec)


def records_of(results: list, spec: RunSpec) -> list[dict]:
    """The records of the jobs' results (each a list of (key, metrics)), reduced per (method, budget, task,
    mode) over the samples in job order."""
    cells: dict[tuple, list[dict]] = {}                  # per record, its samples' metrics in job order
    for job_results in results:
        for key, metrics in job_results:
            cells.setdefault(key, []).append(metrics)
    timing = "alone" if spec.engine == "plain" or spec.time_alone else "share"
    records = [{"method": name, "budget": budget, "keep_ratio": keep_ratio(budget, spec.length), "task": task,
                "mode": mode, "length": spec.length, **reduce(values), "engine": spec.engine,
                "step_timing": timing}
               for (name, budget, task, mode), values in cells.items()]
    for r in records:                 # the share of the compressed tokens the budget keeps, sample by sample
        n = r["compressed_tokens"]
        r["realised_keep_ratio"] = round(sum(min(1.0, (r["budget"] or t) / t) for t in n) / len(n), 4)
    return records


class Incomplete(cli.UsageError):
    """A run that stopped at a sample: the records of the samples that finished (``records``), the jobs of the
    batch that failed (``failed``: (task, sample, mode) each, the task a name or a ``Task``) and why
    (``error``). Inside ``cli.errors`` it is its one line."""

    def __init__(self, records: list[dict], failed: list[tuple], error: BaseException) -> None:
        self.records, self.failed, self.error = records, failed, error
        super().__init__(self.line())

    def line(self) -> str:
        task, sample, mode = self.failed[0]
        name = getattr(task, "name", task)
        why = str(self.error) if isinstance(self.error, cli.UsageError) else \
            f"{type(self.error).__name__}: {self.error}"
        return f"the run stopped at sample {sample} of {name} [{mode}] ({why})"


def metric_spec(text: str) -> str:
    """``--metric``: MODULE:FUNCTION, imported and tried on one answer (``outside.answer_metric``)."""
    try:
        answer_metric(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


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
                    help=f"methods to run: registered names ({', '.join(METHODS)}), a wrapper around a "
                         "scorer, e.g. 'adakv(h2o)', or MODULE:CLASS, a policy class of your own; the records "
                         "name them as written (default: every registered name)")
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
    ap.add_argument("--metric", nargs="+", default=[], type=metric_spec, metavar="MODULE:FUNCTION",
                    help="metrics of your own, fn(prediction, answers) -> a number, imported from the folder the "
                         "command runs in and tried on one answer before any work (the contract: "
                         "experiments/evaluation/task_files.md); every answer is scored after the run, the records "
                         "keep the mean and each sample's (NAME_each), and the report (without --quiet) gives "
                         "their intervals (default: none)")
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
                    help="write the run to PATH as JSON: an object of its provenance, preset, run (engine, weights), "
                         "records (one per method, keep ratio, task and mode) and pairwise tests (default: none)")
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
        cli.check_outputs({"--json": args.json, "--plot": args.plot}, inputs=[args.checkpoint, *args.task_file])
        methods = args.methods or list(METHODS)
        check_methods_flag(methods)
        config, card = load_config(args.checkpoint), load_card(args.checkpoint)
        tok = load_tokenizer(args.checkpoint)
        if tok is None:
            cli.fail(f"--checkpoint {args.checkpoint} has no supported tokenizer, which every task needs (a folder's "
                     "tokenizer.json, or vocab.json and merges.txt)")
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
                    check_cuts(task, tok, length, range(args.seed, args.seed + samples), args.truncate,
                               config.max_seq_len)
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
        run(model, tok, RunSpec(variants, budgets, tasks, args.modes, samples, length, args.seed, progress=False,
            workers=workers, rank=rank, world=world, engine=args.engine,
            time_alone=args.time_alone, together=args.together))
        return
    if note := without_mps(device, workers):
        print(note, file=sys.stderr)
    options = "; ".join(f"{v.label}: {', '.join(f'{k}={x}' for k, x in v.options.items()) or 'defaults'}"
                        for v in variants)
    print(header(prov) + f"\n# methods' options: {args.preset} ({options})", flush=True)
    stopped = None                           # a run that failed at a sample: what finished is still reported
    try:
        records = run(model, tok, RunSpec(variants, budgets, tasks, args.modes, samples, length, args.seed,
                      progress=not args.quiet, workers=workers, rank=rank, world=world, engine=args.engine,
                      time_alone=args.time_alone, together=args.together))
    except Incomplete as stop:
        if args.debug:
            raise stop.error
        if not stop.records:
            cli.fail(stop.line() + "; no sample had finished, nothing was written")
        records, stopped = stop.records, stop
        print(f"incomplete: {stop.line()}; below, the samples that finished before it", flush=True)
    files = {t.name: file_task(t) for t in tasks if file_task(t)}
    for r in records:
        r.update(preset=args.preset, checkpoint=args.checkpoint, seed=args.seed, dtype=args.dtype,
                 chat_template=args.chat_template)
        if r["task"] in files:
            items = files[r["task"]].items
            r.update(task_file=files[r["task"]].path, task_file_sha256=files[r["task"]].sha256,
                     truncate=args.truncate, cuts=getattr(files[r["task"]], "cut_items", []),
                     item_ids=[items[args.seed + i].get("id", args.seed + i)
                               for i in range(r.get("n_samples", samples))])
    for spec in args.metric:                 # checked at parse time; scored on the answers the records keep
        score_records(records, spec, answer_metric(spec))
    for line in flag_degenerate(records):
        print(line, file=sys.stderr)
    named, own = shown(records)      # a class of one's own by its name; the records keep MODULE:CLASS
    for line in own:
        print(line)
    if args.quiet:                  # a short summary; every number is in the records (--json)
        print(format_summary(named))
    else:
        print(format_tables(named))
        print(json_only())
        print(format_intervals(named))
        print(format_pairwise(named))
        if args.metric:
            print(format_scored(named, {spec: [r[f"{spec}_each"] for r in records] for spec in args.metric}))
    legend = ("keep = budget / --length; kept = the share of each sample's compressed tokens the budget keeps (mean "
              "over the samples and tasks); acc = the task's score of the greedy answer (string_match_all for RULER's "
              "tasks, a task file's own scorer for its column); KL = mean next-token KL(full || method) over the "
              "answer, in nats; KV KiB = the most K/V bytes the cache held at once, all layers, over the samples "
              "and tasks (KVReviver's sketch included); pert = relative error of the final "
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
    for name, task in files.items():                # said on stderr before the run; the results say it too
        if cut := getattr(task, "cut_items", []):
            lost = sum(not c["answers_kept"] for c in cut)
            print(f"note: {name}: {len(cut)} of {samples} items were cut to fit --length {length} (--truncate "
                  f"{args.truncate})" + (f", {lost} of them losing every answer" if lost else ""))
    if args.json:
        ran = {"engine": args.engine, "weights_sha256": weights_sha256(args.checkpoint)}    # what ran, exactly
        if args.chat_template:
            ran["chat_template_sha256"] = hashlib.sha256(chat_template(args.checkpoint).encode()).hexdigest()
        if stopped is not None:                # marked incomplete, the failing sample named
            task, sample, mode = stopped.failed[0]
            ran.update(complete=False, failed={"task": getattr(task, "name", task), "sample": sample,
                                               "mode": mode, "error": stopped.line()})
        atomic_write_text(args.json, json.dumps({"provenance": prov, "preset": args.preset, "run": ran,
                                                 "records": records, "pairwise": pairwise(records)},
                                                indent=1))
        print(f"records written to {args.json}" + (" (incomplete)" if stopped is not None else ""))
    if args.plot:
        plot(named, args.plot)
        print(f"plot written to {args.plot}")
    if stopped is not None:
        cli.fail(stopped.line() + (f"; the samples that finished are in {args.json}, marked incomplete"
                                   if args.json else "; the samples that finished are in the tables above"))


def check_cuts(task: Task, tok, length: int, seeds: range, truncate: str, most: int) -> None:
    """The items of a file task the run would cut (``FileTask.cuts``, at the length the task's own prompt
    leaves: a chat template's tokens first): none with ``--truncate refuse``, else said in a line (on stderr)
    before the run, with the items whose cut lost every answer; kept on the task for its records (``cuts``).
    Items are named by their line in the file (and ``id``); ``most`` is the model's longest ``--length``."""
    inner = file_task(task)
    room = length - (len(task.prefix_ids) + len(task.suffix_ids) if task is not inner else 0)
    cuts = inner.cuts(tok, room, seeds)
    if cuts and truncate == "refuse":
        worst = max(cuts, key=lambda c: c["context_tokens"])
        raise ValueError(f"{inner.path}: {len(cuts)} of {len(seeds)} items have a context longer than --length "
                         f"allows (the longest, {item_line(worst)}: {worst['context_tokens']} tokens, "
                         f"{worst['kept_tokens']} fit); --truncate middle or left cuts them"
                         + (", or raise --length" if length < most else
                            f" (--length {length} is already the model's most)"))
    inner.cut_items = cuts
    if cuts:
        lost = ", ".join(item_line(c) for c in cuts if not c["answers_kept"])
        print(f"{task.name}: {len(cuts)} of {len(seeds)} items cut to fit --length {length} (--truncate {truncate})"
              + (f"; the cut took every answer out of the prompt of {lost}" if lost else
                 "; every answer the context held is still in the prompt"), file=sys.stderr, flush=True)


def item_line(cut: dict) -> str:
    """A cut item (``FileTask.cuts``) as a reader finds it: its line in the file, and its id where it has one."""
    return f"line {cut['item'] + 1}" + (f" (id {cut['id']!r:.40})" if "id" in cut else "")


def file_task(task: Task) -> FileTask | None:
    """The task read from a file behind ``task`` (itself, or the one a ``ChatTask`` wraps), else None."""
    inner = getattr(task, "task", task)
    return inner if isinstance(inner, FileTask) else None


def special_tokens(tok) -> dict:
    """The special tokens a chat template may name (``bos_token``, ``eos_token``), as text: the end-of-text
    token's, the only one nanollm's tokenizers know by role."""
    eot = tok.decode([tok.eot_id]) if getattr(tok, "eot_id", None) is not None else ""
    return {"bos_token": "", "eos_token": eot}
