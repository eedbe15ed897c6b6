"""
Model cards: measure a checkpoint's full-cache accuracy on every task, length and mode, and write it down.

    python -m nanollm.card runs/retrieval-llama --out nanollm/checkpoints/retrieval-llama --samples 200

exports the training run as a checkpoint folder (if given a run), evaluates it with the full cache (greedy
decoding, ``string_match_all``, both modes), and writes ``card.json`` + ``README.md`` beside the weights:
architecture, tokenizer, the exact training command, steps, wall time, hardware, the accuracy table, and
the *default suite*: the tasks the model solves (>= 95% for the NIAH tasks, >= 80% for vt and cwe, at
every evaluated length, in both modes), which is what ``methods.compare`` runs by default.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
from pathlib import Path

import torch
from tqdm import tqdm

from .evaluate import MODES, accuracy
from .tasks import TASKS

THRESHOLDS = {t: (0.80 if t in ("vt", "cwe") else 0.95) for t in TASKS}


def _work(args):
    folder, task, length, mode, n, seed = args
    torch.set_num_threads(1)
    from .checkpoint import load
    model, tok, _ = load(folder)
    return task, length, mode, accuracy(model, tok, task, length, n, mode, seed=seed)


def measure(folder: str, tasks: list[str], lengths: list[int], n_samples: int, seed: int,
            workers: int = 1) -> dict:
    """accuracy[task][str(length)][mode] with the full cache, n_samples per cell (seeds seed..seed+n-1)."""
    jobs = [(str(folder), t, L, m, n_samples, seed) for t in tasks for L in lengths for m in MODES]
    acc: dict = {}
    if workers > 1:
        with mp.get_context("fork").Pool(workers) as pool:
            results = list(tqdm(pool.imap_unordered(_work, jobs), total=len(jobs), desc="card"))
    else:
        results = [_work(job) for job in tqdm(jobs, desc="card")]
    for task, length, mode, a in results:
        acc.setdefault(task, {}).setdefault(str(length), {})[mode] = a
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
             "| task | " + " | ".join(f"{L} in-prompt | {L} after-context" for L in lengths) + " | threshold | in default suite |",
             "|---|" + "---|---|" * len(lengths) + "---|---|"]
    for t in [t for t in TASKS if t in acc]:
        cells = [f"{acc[t][str(L)][m]:.3f}" for L in lengths for m in MODES]
        lines.append(f"| {t} | " + " | ".join(cells) +
                     f" | {THRESHOLDS[t]:.2f} | {'yes' if t in card['default_suite'] else 'no'} |")
    lines += ["", f"Measured with: `{card['eval_command']}`", "", card.get("limitations", ""), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m nanollm.card",
                                 description="Measure a checkpoint's full-cache accuracy per task, length and mode "
                                             "and write its model card (card.json + README.md).")
    ap.add_argument("source", help="a training run folder (state.pt) or a checkpoint folder")
    ap.add_argument("--out", default=None, help="checkpoint folder to write (default: SOURCE, which must then "
                                               "already be a checkpoint)")
    ap.add_argument("--name", default="retrieval-llama", help="model name in the card (default %(default)s)")
    ap.add_argument("--tasks", nargs="+", default=TASKS, help="tasks to evaluate (default: all)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[256, 512, 1024],
                    help="sample lengths in tokens (default %(default)s)")
    ap.add_argument("--samples", type=int, default=200, help="samples per task, length and mode (default %(default)s)")
    ap.add_argument("--seed", type=int, default=1 << 41, help="first sample seed (default 2**41, outside training's)")
    ap.add_argument("--workers", type=int, default=2, help="processes (default %(default)s)")
    ap.add_argument("--train-command", default="", help="the exact command that trained the model")
    ap.add_argument("--notes", default="", help="training notes (markdown) for the card")
    args = ap.parse_args(argv)

    from .checkpoint import export_run, load, write_card
    src = Path(args.source)
    out = Path(args.out or src)
    info = {}
    if (src / "state.pt").exists():
        export_run(src, out)
        st = torch.load(src / "state.pt", map_location="cpu", weights_only=True)
        info = {"steps": st["step"], "wall_time_s": st["elapsed"]}
    model, tok, old = load(out)
    acc = measure(str(out), args.tasks, args.lengths, args.samples, args.seed, args.workers)
    card = {**old, **info}
    card.update(
        name=args.name, model_config=model.config.to_dict(), n_params=model.num_params(),
        tokenizer=f"byte-level BPE, {tok.vocab_size} tokens (incl. <|endoftext|>), trained by nanollm.tokenizer on "
                  "task text; digits are single tokens",
        train_command=args.train_command or old.get("train_command", ""),
        training_notes=args.notes or old.get("training_notes", ""),
        hardware=old.get("hardware") or f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
                                          f"torch {torch.__version__}",
        accuracy=acc, n_samples=args.samples, eval_seed=args.seed, default_suite=default_suite(acc),
        eval_command=f"python -m nanollm.card {args.source} --out {out} --samples {args.samples} --lengths "
                     + " ".join(map(str, args.lengths)) + f" --workers {args.workers}")
    card["markdown"] = markdown(card)
    write_card(out, card)
    print(card["markdown"])


if __name__ == "__main__":
    main()
