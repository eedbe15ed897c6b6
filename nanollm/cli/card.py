"""
Model cards: measure a checkpoint's full-cache accuracy on every task, length and mode, and write it down.

    python -m nanollm.cli.card runs/retrieval-llama --out nanollm/checkpoints/retrieval-llama --samples 200

evaluates a training run or a checkpoint with the full cache (greedy decoding, ``string_match_all``, both
modes) and makes its card: architecture, tokenizer, the exact training command, steps, wall time,
hardware, the accuracy table, and the *default suite*: the tasks the model solves (>= 95% for the NIAH
tasks, >= 80% for vt and cwe, at every evaluated length, in both modes), which is what ``experiments.compare``
runs by default. The card is written only where the command says: ``--out DIR`` writes a checkpoint folder
(weights, config, tokenizer, ``card.json``, ``README.md``); ``--in-place`` replaces the card of the
checkpoint SOURCE; with neither, it is only printed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import tempfile
from contextlib import ExitStack
from pathlib import Path

import torch
from tqdm import tqdm

from ..data.evaluate import MODES, accuracy
from ..data.tasks import TASKS
from ..io.checkpoint import MAX_SAMPLES

THRESHOLDS = {t: (0.80 if t in ("vt", "cwe") else 0.95) for t in TASKS}


def _work(args):
    folder, task, length, mode, n, seed = args
    torch.set_num_threads(1)
    from ..io.checkpoint import load
    model, tok, _ = load(folder)
    return task, length, mode, accuracy(model, tok, task, length, n, mode, seed=seed)


def _init_worker(tqdm_lock) -> None:
    from .. import cli
    cli.worker_leaves_on_sigterm()
    tqdm.set_lock(tqdm_lock)


def measure(folder: str, tasks: list[str], lengths: list[int], n_samples: int, seed: int,
            workers: int = 1) -> dict:
    """accuracy[task][str(length)][mode] with the full cache, n_samples per cell (seeds seed..seed+n-1).

    ``workers`` > 1 measures the cells in that many processes, started without Ctrl-C
    (``cli.worker_pool``): on Ctrl-C or SIGTERM this process stops them (``Pool.terminate``, by
    the ``with`` block) and prints its one ``error: interrupted`` line, not a traceback from each worker.
    They are fresh interpreters ("spawn"): a forked worker would keep this process's signal handlers, and
    inside ``workers_without_ctrl_c`` those note SIGTERM instead of stopping, so ``terminate`` would wait
    for ever. Their tqdm lock is this process's (tqdm's way for worker processes): one each would be a
    semaphore that a stopped worker leaves to the resource tracker, which then warns of it after the
    ``error: interrupted`` line.
    """
    from .. import cli
    jobs = [(str(folder), t, L, m, n_samples, seed) for t in tasks for L in lengths for m in MODES]
    acc: dict = {}
    # the bar is closed (and the workers stopped) before the line of an error or Ctrl-C, not after it
    with tqdm(total=len(jobs), desc="card") as bar, ExitStack() as stack:
        if workers > 1:
            ctx = mp.get_context("spawn")
            pool = stack.enter_context(cli.worker_pool(ctx, workers, _init_worker, (ctx.RLock(),)))
            results = pool.imap_unordered(_work, jobs)
        else:
            results = map(_work, jobs)
        for task, length, mode, a in results:
            acc.setdefault(task, {}).setdefault(str(length), {})[mode] = a
            bar.update(1)
    return acc


def default_suite(acc: dict) -> list[str]:
    """Tasks at or above their threshold at every length, in both modes."""
    return [t for t in TASKS if t in acc and
            all(a >= THRESHOLDS[t] for per_len in acc[t].values() for a in per_len.values())]


def markdown(card: dict) -> str:
    acc = card["accuracy"]
    lengths = sorted({int(L) for t in acc.values() for L in t}, key=int)
    lines = [f"# {card['name']}", "", card.get("summary", ""), "",
             "## Architecture", "", "```json", json.dumps(card["model_config"], indent=1), "```", "",
             f"Parameters: {card['n_params']:,}. Tokenizer: {card['tokenizer']}.", "",
             "## Training", "", f"Command: `{card['train_command']}`", "",
             f"Steps: {card.get('steps', '?')}; wall time: {card.get('wall_time_s', 0) / 60:.0f} min; "
             f"hardware: {card['hardware']}.",
             "", card.get("training_notes", ""), "",
             f"## Full-cache accuracy ({card['n_samples']} samples per cell, greedy, string_match_all)", "",
             "| task | " + " | ".join(f"{L} in-prompt | {L} after-context" for L in lengths)
             + " | threshold | in default suite |",
             "|---|" + "---|---|" * len(lengths) + "---|---|"]
    for t in [t for t in TASKS if t in acc]:
        cells = [f"{acc[t][str(L)][m]:.3f}" for L in lengths for m in MODES]
        lines.append(f"| {t} | " + " | ".join(cells) +
                     f" | {THRESHOLDS[t]:.2f} | {'yes' if t in card['default_suite'] else 'no'} |")
    lines += ["", f"Measured with: `{card['eval_command']}`", "", card.get("limitations", ""), ""]
    return "\n".join(lines)


def samples(text: str) -> int:
    """``--samples``: a positive integer, at most ``MAX_SAMPLES`` (a card of more would take days to measure)."""
    from .. import cli
    value = cli.positive_int(text)
    if value > MAX_SAMPLES:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SAMPLES:,}, got {value}")
    return value


def workers(text: str) -> int:
    """``--workers``: a positive integer, at most this machine's CPU cores: a process more only waits for a
    core, and hundreds of processes, each with a model, could exhaust the memory."""
    from .. import cli
    value, cores = cli.positive_int(text), os.cpu_count() or 1
    if value > cores:
        raise argparse.ArgumentTypeError(f"must be at most {cores}, the CPU cores of this machine, got {value}")
    return value


def main(argv: list[str] | None = None) -> None:
    from .. import cli
    ap = cli.ArgumentParser(prog="python -m nanollm.cli.card",
                            description="Measure a checkpoint's full-cache accuracy per task, length and mode and "
                                        "make its model card (card.json + README.md). It is written with --out "
                                        "or --in-place only; without either it is printed and nothing is "
                                        "written.")
    ap.add_argument("source", help="a training run folder (state.pt), a nanollm checkpoint folder, or the name "
                                   "of a bundled checkpoint")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--out", default=None, metavar="DIR",
                       help="write the checkpoint (weights, config, tokenizer) and its card to DIR: a new or empty "
                            "folder, or a checkpoint folder whose files are replaced (default: none)")
    where.add_argument("--in-place", action="store_true",
                       help="replace the card (card.json, README.md) of SOURCE, which must be a checkpoint folder")
    ap.add_argument("--name", default=None,
                    help="model name in the card (default: the name in the card being replaced, else the folder name)")
    ap.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS, metavar="TASK",
                    help=f"tasks to evaluate (default: all: {', '.join(TASKS)})")
    ap.add_argument("--lengths", nargs="+", type=cli.positive_int, default=[256, 512, 1024], metavar="TOKENS",
                    help="sample lengths in tokens, at most the model's maximum positions (default 256 512 1024)")
    ap.add_argument("--samples", type=samples, default=200,
                    help=f"samples per task, length and mode, at most {MAX_SAMPLES:,} (default %(default)s)")
    ap.add_argument("--seed", type=int, default=1 << 41,
                    help="first sample seed (default 2**41, outside the seeds training draws from)")
    ap.add_argument("--workers", type=workers, default=min(2, os.cpu_count() or 1),
                    help="processes evaluating in parallel, at most the CPU cores (os.cpu_count(), here "
                         f"{os.cpu_count() or 1}) (default %(default)s)")
    ap.add_argument("--train-command", default="",
                    help="the exact command that trained the model (default: the one in the card being replaced)")
    ap.add_argument("--notes", default="",
                    help="training notes (markdown) for the card (default: those in the card being replaced)")
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        card, written = make_card(args)
    print(card["markdown"])
    print(f"card written to {written}" if written else
          "(the card was not written: give --out DIR or --in-place to write it)")


def make_card(args) -> tuple[dict, Path | None]:
    """Check every argument of ``main``, then measure and write; returns the card and where it was written."""
    from .. import cli
    from ..data.tasks import make_sample
    from ..io.checkpoint import (
        export_run,
        is_checkpoint,
        is_run,
        load,
        load_card,
        load_config,
        load_run_state,
        load_tokenizer,
        resolve,
        save,
        write_card,
    )

    src = resolve(args.source)
    if not (is_run(src) or is_checkpoint(src)):
        cli.fail(f"{args.source} is neither a training run (state.pt) nor a nanollm checkpoint (nanollm_config.json)")
    if args.in_place and is_run(src):
        cli.fail(f"--in-place replaces the card of a checkpoint; {args.source} is a training run: give --out DIR")
    out = Path(args.out) if args.out else None
    if out is not None:
        if out.exists() and is_run(src) and os.path.samefile(out, src):
            cli.fail(f"--out {out} is the training run itself: give a checkpoint folder")
        cli.output_folder(out, "--out", may_hold=is_checkpoint)
    config = load_config(src)
    for length in args.lengths:
        if length > config.max_seq_len:
            cli.fail(f"--lengths {length} exceeds the model's maximum positions ({config.max_seq_len})")
    tok = load_tokenizer(src)
    for task in args.tasks:                    # every task fits the shortest length: fail now, not after hours
        try:
            make_sample(task, tok, min(args.lengths), seed=args.seed)
        except ValueError as e:
            cli.fail(f"--lengths {min(args.lengths)}: {e}")
    # the card being replaced lends its notes, summary and limitations to the new one
    old = load_card(out) if out is not None and is_checkpoint(out) else load_card(src)
    name = args.name or old.get("name") or (out or src).resolve().name
    eval_command = (f"python -m nanollm.cli.card {args.source}" + (f" --out {out}" if out else "")
                    + (" --in-place" if args.in_place else "") + f" --tasks {' '.join(args.tasks)} --lengths "
                    + " ".join(map(str, args.lengths)) + f" --samples {args.samples} --seed {args.seed} "
                    f"--workers {args.workers}")

    with tempfile.TemporaryDirectory() as tmp:
        info, folder = {}, src
        if is_run(src):                        # measure a checkpoint exported to a temporary folder
            export_run(src, tmp)
            st = load_run_state(src / "state.pt")
            info, folder = {"steps": st["step"], "wall_time_s": st["elapsed"]}, Path(tmp)
        model, tok, _ = load(folder)
        acc = measure(str(folder), args.tasks, args.lengths, args.samples, args.seed, args.workers)
    card = {**old, **info}
    card.update(
        name=name, model_config=model.config.to_dict(), n_params=model.num_params(),
        tokenizer=f"byte-level BPE, {tok.vocab_size} tokens (incl. <|endoftext|>), trained by nanollm.io.tokenizer on "
                  "task text; digits are single tokens",
        train_command=args.train_command or old.get("train_command", ""),
        training_notes=args.notes or old.get("training_notes", ""),
        hardware=old.get("hardware") or f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
                                          f"torch {torch.__version__}",
        accuracy=acc, n_samples=args.samples, eval_seed=args.seed, default_suite=default_suite(acc),
        eval_command=eval_command)
    card["markdown"] = markdown(card)
    if out is not None:
        save(model, tok, out, card)
        return card, out
    if args.in_place:
        write_card(src, card)
        return card, src
    return card, None


if __name__ == "__main__":
    main()
