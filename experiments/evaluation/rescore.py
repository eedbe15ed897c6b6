"""
Score anew the greedy answers a ``experiments.compare`` results file keeps, without running the model:

    python -m experiments.evaluation.rescore results/compare_default.json                  # the accuracies again
    python -m experiments.evaluation.rescore results/compare_default.json --metric accuracy exact_match --json out.json

Each record's samples are made again from its task, its length and the run's seed (``provenance.seed`` in the
file, plus the sample's index), with the tokenizer of the checkpoint the run named (``--checkpoint`` in
``provenance.command``, else compare's default); ``metrics.rescore`` checks that each sample has the record's
references and scores the kept answer. Printed: one row per record, the value the file stores beside the one
scored now (``-`` for a metric the file does not store).

A results file is data from anywhere, so every record is checked before any work: each field the command reads
is there and of its type, the length is one the model's positions hold, there are as many references as
predictions, at most ``compare.MAX_SAMPLES``; a failure is one line naming the record and the field. A file
written before ``experiments.compare`` kept the answers has nothing to rescore, and is refused so.
"""

from __future__ import annotations

import argparse
import json
import reprlib
import shlex
from pathlib import Path

from experiments import moved
from nanollm import cli
from nanollm.cli.provenance import provenance
from nanollm.data.evaluate import MODES
from nanollm.io.chat import chat_template, chat_wrap
from nanollm.io.checkpoint import load_config, load_tokenizer, resolve, weights_sha256
from nanollm.io.files import atomic_write_text, read_json

from . import compare, report
from .chat import ChatTask
from .metrics import METRICS, Metric, rescore, task_of
from .outside import answer_metric
from .task import TASKS
from .task_file import exact_match, file_sha256

# The answer-level metrics this command offers: the task's own score, which the records store, and five
# added after the run (examples): on the answer's text, its token ids, and the full cache's answer beside it.
# exact_match is a task file's "exact_match" scorer (the answer is one of the references); target_match
# compares with the teacher-forced target.
SCORES: dict[str, Metric] = {m.name: m for m in [
    next(m for m in METRICS if m.name == "accuracy"),
    Metric("exact_match", lambda f, m, task, s: float(exact_match(m.prediction, s.answers)), answer=True),
    Metric("target_match", lambda f, m, task, s: float(m.prediction.strip() == s.target.strip()), answer=True),
    Metric("answer_words", lambda f, m, task, s: float(len(m.prediction.split())), answer=True),
    Metric("answer_tokens", lambda f, m, task, s: float(len(m.prediction_ids)), answer=True),
    Metric("same_as_full", lambda f, m, task, s: float(f is not None and m.prediction == f.prediction), answer=True),
]}


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def shown(x) -> str:
    """A value from the file, for an error line: its repr, cut short (``reprlib``) however large it is."""
    return reprlib.repr(x)


def run_settings(data: dict, path: Path) -> tuple[int, str]:
    """The run's seed and checkpoint, from the file's ``provenance`` (its seed, and its command's
    ``--checkpoint``)."""
    prov = data.get("provenance")
    if not isinstance(prov, dict):
        cli.fail(f"{path}: no provenance object, which holds the run's seed")
    seed, command = prov.get("seed"), prov.get("command")
    if not is_int(seed):
        cli.fail(f"{path}: provenance.seed must be an integer, got {shown(seed)}")
    if not isinstance(command, str):
        cli.fail(f"{path}: provenance.command must be the run's command line, got {shown(command)}")
    try:
        words = shlex.split(command)
    except ValueError as e:
        cli.fail(f"{path}: provenance.command cannot be read ({e})")
    if "experiments.compare" not in map(moved, words):                # methods.compare: its name before
        cli.fail(f"{path}: not a experiments.compare results file (provenance.command: {shown(command)})")
    checkpoint = compare.parser().get_default("checkpoint")
    for word, value in zip(words, words[1:] + [None]):
        if word == "--checkpoint" and value is not None:
            checkpoint = value
        elif word.startswith("--checkpoint="):
            checkpoint = word.partition("=")[2]
    return seed, checkpoint


def check_checkpoint(data: dict, path: Path, checkpoint: str, given: bool) -> None:
    """The checkpoint is here and, where the file keeps the run's weights' SHA-256 (``run.weights_sha256``), it
    is the one that ran: its tokenizer made the samples, another model's would rebuild other ones."""
    try:
        resolve(checkpoint)
    except ValueError as e:
        cli.fail(str(e) if given else f"{path}: the run's checkpoint {checkpoint!r} (as its command named it) is "
                 "not here: give it with --checkpoint PATH")
    ran = data.get("run")
    want = ran.get("weights_sha256") if isinstance(ran, dict) else None
    if isinstance(want, dict) and want and sorted(weights_sha256(checkpoint).values()) != sorted(want.values()):
        cli.fail(f"{checkpoint}: not the weights the run used (their SHA-256 differ from {path}'s "
                 "run.weights_sha256): the samples need the run's own tokenizer")


def check_records(records, path: Path, max_length: int, scores: list[str]) -> None:
    """Every record holds what rescoring reads, of the right types and sizes; else one line naming the record
    and the field."""
    if not isinstance(records, list) or not records:
        cli.fail(f"{path}: 'records' must be a non-empty list of records, got {shown(records)}")
    if not any(isinstance(r, dict) and "predictions" in r for r in records):
        cli.fail(f"{path}: its records keep no predictions (written before experiments.compare kept every answer): "
                 "nothing to rescore")
    for i, r in enumerate(records):
        where = f"{path}: record {i}"
        if not isinstance(r, dict):
            cli.fail(f"{where}: must be an object, got {shown(r)}")
        for name in ("method", "task", "mode", "keep_ratio", "length", "predictions", "references"):
            if name not in r:
                cli.fail(f"{where}: no {name!r}")
        if not isinstance(r["method"], str):
            cli.fail(f"{where}: 'method' must be a string, got {shown(r['method'])}")
        if "task_file" in r:
            if not isinstance(r["task_file"], str) or not Path(r["task_file"]).is_file():
                cli.fail(f"{where}: 'task_file' {shown(r['task_file'])} is not a file here")
        elif not isinstance(r["task"], str) or r["task"] not in TASKS:
            cli.fail(f"{where}: 'task' {shown(r['task'])} is not a task here; the tasks are {', '.join(TASKS)}")
        if "seed" in r and not is_int(r["seed"]):
            cli.fail(f"{where}: 'seed' must be an integer, got {shown(r['seed'])}")
        if not isinstance(r["mode"], str) or r["mode"] not in MODES:
            cli.fail(f"{where}: 'mode' {shown(r['mode'])} is not one of {', '.join(MODES)}")
        if not is_number(r["keep_ratio"]):
            cli.fail(f"{where}: 'keep_ratio' must be a number, got {shown(r['keep_ratio'])}")
        if not is_int(r["length"]) or not 0 < r["length"] <= max_length:
            cli.fail(f"{where}: 'length' must be an integer in [1, {max_length}] (the model's positions), "
                     f"got {shown(r['length'])}")
        predictions, references = r["predictions"], r["references"]
        if not isinstance(predictions, list) or not all(isinstance(p, str) for p in predictions):
            cli.fail(f"{where}: 'predictions' must be a list of answers (strings), got {shown(predictions)}")
        if not 0 < len(predictions) <= compare.MAX_SAMPLES:
            cli.fail(f"{where}: 'predictions' holds {len(predictions)} answers; a record has 1 to "
                     f"{compare.MAX_SAMPLES}")
        if not isinstance(references, list) or not all(
                isinstance(refs, list) and all(isinstance(a, str) for a in refs) for refs in references):
            cli.fail(f"{where}: 'references' must be a list of lists of strings, got {shown(references)}")
        if len(references) != len(predictions):
            cli.fail(f"{where}: {len(predictions)} predictions but {len(references)} references; "
                     "each sample has both")
        ids = r.get("prediction_ids")
        if ids is not None and not (isinstance(ids, list) and len(ids) == len(r["predictions"]) and all(
                isinstance(a, list) and all(is_int(t) for t in a) for a in ids)):
            cli.fail(f"{where}: 'prediction_ids' must be a list of token-id lists, one per prediction")
        for name in scores:
            metric = SCORES[name]
            if name in r and not is_number(r[name]):
                cli.fail(f"{where}: {name!r} must be a number, got {shown(r[name])}")
            kept = r.get(metric.keep) if metric.keep else None
            if kept is not None and not (isinstance(kept, list) and len(kept) == len(predictions)
                                         and all(is_number(x) for x in kept)):
                cli.fail(f"{where}: {metric.keep!r} must be a list of {len(predictions)} numbers, got {shown(kept)}")


def samples_bytes(records: list[dict]) -> int:
    """About the memory of the samples ``metrics.rescore`` makes and keeps: one per (task, length, seed), each
    2 KiB and 64 bytes per token (its text and its ids)."""
    most: dict[tuple, int] = {}
    for r in records:
        key = (r["task"], r["length"])
        most[key] = max(most.get(key, 0), len(r["predictions"]))
    return sum(n * (2048 + 64 * length) for (_, length), n in most.items())


def check_lengths(records: list[dict], path: Path, tok, seed: int) -> None:
    """Each (task, length) of the file makes a sample (its first, for the run's seed), before the work: a
    length too short for its task, or a task whose text this Python lacks, is one line now."""
    seen = set()
    for i, r in enumerate(records):
        key = (r["task"], r["length"])
        if key in seen:
            continue
        seen.add(key)
        if r.get("chat_template"):                  # its samples are shorter by the template: made when scored
            continue
        try:
            task_of(r).sample(tok, r["length"], r.get("seed", seed))
        except ValueError as e:
            cli.fail(f"{path}: record {i}: 'length' {r['length']}: {e}")


def printable(text: str, width: int = 30) -> str:
    """A name from the file, for the table: escaped if it holds control characters, cut to ``width``."""
    text = text if text.isprintable() else ascii(text)
    return text if len(text) <= width else text[:width - 3] + "..."


def agrees(r: dict, name: str, values: list[float]) -> bool | None:
    """Whether the values scored now are the record's: sample by sample where it keeps each sample's
    (``accuracies``), else its mean; None when the record stores none."""
    keep = SCORES[name].keep
    if keep and keep in r:
        return r[keep] == values
    if name in r:
        return abs(r[name] - sum(values) / len(values)) <= 1e-9
    return None


def format_table(records: list[dict], scored: dict[str, list[list[float]]]) -> str:
    """One row per record: method, keep ratio, task, mode, samples, then per metric the stored mean and the
    rescored one; ``differs`` marks a row where they disagree."""
    w = min(30, max(14, 1 + max(len(printable(r["method"])) for r in records)))
    cw = {name: max(20, len(name) + 8) for name in scored}                       # a space before each title
    head = f"{'method':<{w}}{'keep':>6}  {'task':<20}{'mode':<24}{'n':>5}" + \
        "".join(f"{name + ' stored':>{cw[name]}}{'rescored':>10}" for name in scored)
    lines = [head, "-" * len(head)]
    for i, r in enumerate(records):
        cells, differs = "", False
        for name, values in scored.items():
            mean = sum(values[i]) / len(values[i])
            was = r.get(name)
            cells += (f"{was:>{cw[name]}.4f}" if was is not None else f"{'-':>{cw[name]}}") + f"{mean:>10.4f}"
            differs |= agrees(r, name, values[i]) is False
        lines.append(f"{printable(r['method'], w - 1):<{w}}{r['keep_ratio']:>6.2f}  {r['task'][:19]:<20}"
                     f"{r['mode']:<24}{len(r['predictions']):>5}{cells}" + ("  differs" if differs else ""))
    return "\n".join(lines)


def summary(records: list[dict], scored: dict[str, list[list[float]]]) -> str:
    parts = []
    for name, values in scored.items():
        same = [agrees(r, name, v) for r, v in zip(records, values)]
        compared = [s for s in same if s is not None]
        parts.append(f"{name}: the same as stored in {sum(compared)} of {len(compared)} records" if compared
                     else f"{name}: not stored in the file (new scores)")
    return f"{len(records)} records; " + "; ".join(parts)


def parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(
        prog="python -m experiments.evaluation.rescore",
        description="Score the greedy answers a experiments.compare results file keeps (--json of a run since the "
                    "answers are kept, e.g. results/compare_default.json) with answer-level metrics, without "
                    "running the model: each sample is made again from its task, length and the run's seed, "
                    "and must have the record's references. Prints each record's stored and rescored values.")
    ap.add_argument("results", type=Path, metavar="RESULTS.json", help="a experiments.compare results file")
    ap.add_argument("--metric", nargs="+", type=metric_flag, default=["accuracy"], metavar="NAME",
                    help=f"answer-level metrics: {', '.join(SCORES)}, or MODULE:FUNCTION, a function of your own "
                         "(fn(prediction: str, answers: list[str]) -> a number; MODULE importable from here, e.g. "
                         "a file mine.py in this folder: mine:first_word), checked on one answer before any work "
                         "(accuracy: the task's own score, which the "
                         "records store; exact_match: the answer is one of the references, stripped, as a task "
                         "file's exact_match scorer says; target_match: it is the teacher-forced target's text; "
                         "answer_words, answer_tokens: the answer's words, its tokens; same_as_full: the answer is "
                         "the full cache's) (default: accuracy)")
    ap.add_argument("--checkpoint", default=None,
                    help="the checkpoint whose tokenizer made the samples (default: the one the file's "
                         "provenance.command names, else experiments.compare's default)")
    ap.add_argument("--json", type=cli.output_file, default=None, metavar="PATH",
                    help="write the rescored values, per record and sample, to PATH (default: none)")
    ap.add_argument("--task-file", nargs="+", type=Path, default=[], metavar="PATH",
                    help="where the task files the records name are here, when not at the path the run recorded "
                         "or beside the results file; each is matched by its SHA-256, so a different file is "
                         "refused (default: none)")
    return ap


def outside_metric(spec: str) -> Metric:
    """``MODULE:FUNCTION`` as an answer-level metric: ``FUNCTION(prediction, answers)``, a number per answer
    (``outside.answer_metric``: imported and tried on one answer now)."""
    fn = answer_metric(spec)
    return Metric(spec, lambda f, m, task, s: float(fn(m.prediction, list(s.answers))), answer=True)


def metric_flag(text: str) -> str:
    """``--metric``: a name of ``SCORES``, or ``MODULE:FUNCTION`` (``outside_metric``), added to ``SCORES``."""
    if text in SCORES:
        return text
    if ":" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a metric: {', '.join(SCORES)}, or MODULE:FUNCTION")
    try:
        SCORES[text] = outside_metric(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def find_task_files(records: list, path: Path, given: list[Path]) -> None:
    """Point each record's ``task_file`` at a file here with the SHA-256 the run recorded: one of ``given``
    (``--task-file``), the recorded path, or a file of that name beside the results file; else one line."""
    digests: dict[Path, str] = {}
    why: dict[Path, str] = {}                       # why a candidate could not be read as a task file

    def digest(candidate: Path) -> str | None:
        if candidate not in digests:
            try:
                digests[candidate] = file_sha256(candidate)            # a regular file of a task file's size
            except (OSError, ValueError) as e:
                digests[candidate], why[candidate] = None, str(e)
        return digests[candidate]

    for p in given:
        if not p.is_file():
            cli.fail(f"--task-file {p}: not a file")
    for i, r in enumerate(records):
        if not isinstance(r, dict) or not isinstance(r.get("task_file"), str):
            continue
        recorded, want = Path(r["task_file"]), r.get("task_file_sha256")
        candidates = list(dict.fromkeys([*given, recorded, path.parent / recorded.name]))
        found = next((c for c in candidates if c.is_file() and digest(c) == want), None)
        if found is None:
            unreadable = [why[c] for c in candidates if c in why]
            held = [str(c) for c in candidates if c.is_file() and c not in why]
            sha = f"SHA-256 {want[:12]}..." if isinstance(want, str) else "no SHA-256 recorded"
            cli.fail(f"{path}: record {i}: 'task_file' {r['task_file']} ({sha}) is not here"
                     + (f"; {', '.join(held)} differ from it" if held else "")
                     + (f"; {'; '.join(unreadable)}" if unreadable else "")
                     + ": give it with --task-file PATH")
        r["task_file"] = str(found)



def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        cli.check_outputs({"--json": args.json}, inputs=[args.results, args.checkpoint, *args.task_file])
        names = list(dict.fromkeys(args.metric))
        data = read_json(args.results, "results file")
        if not isinstance(data, dict) or "records" not in data:
            cli.fail(f"{args.results}: not a experiments.compare results file (a JSON object with 'records')")
        seed, checkpoint = run_settings(data, args.results)
        checkpoint = args.checkpoint or checkpoint
        check_checkpoint(data, args.results, checkpoint, given=args.checkpoint is not None)
        records = data["records"]
        if isinstance(records, list):
            find_task_files(records, args.results, args.task_file)
        read = [r["task_file"] for r in records if isinstance(r, dict) and isinstance(r.get("task_file"), str)] \
            if isinstance(records, list) else []
        cli.check_outputs({"--json": args.json}, inputs=[args.results, checkpoint, *args.task_file, *read])
        config = load_config(checkpoint)
        check_records(records, args.results, config.max_seq_len, names)
        cli.check_fits(f"{args.results}: the samples of its records", samples_bytes(records))
        tok = load_tokenizer(checkpoint)
        if tok is None:
            cli.fail(f"checkpoint {checkpoint} has no supported tokenizer, which the samples need")
        check_lengths(records, args.results, tok, seed)
        print(f"# rescoring the {len(records)} records of {args.results} (seed {seed}, the tokenizer of "
              f"{checkpoint}): {', '.join(names)}", flush=True)
        chat = None
        if any(r.get("chat_template") for r in records):          # the run wrapped its prompts: so do we
            template = chat_template(checkpoint)
            if template is None:
                cli.fail(f"{args.results}: its records ran in a chat template, which {checkpoint} lacks")
            prefix, suffix = chat_wrap(template, **compare.special_tokens(tok))
            chat = lambda task: ChatTask(task, tok, prefix, suffix)           # noqa: E731
        scored = {name: rescore(records, tok, seed, SCORES[name], chat) for name in names}
        named, own = report.shown(records)          # a class of one's own by its name, as compare prints it
        for line in own:
            print(line)
        print(format_table(named, scored))
        print(summary(named, scored))
        print(report.format_scored(named, scored))
        if args.json:
            prov = provenance(argv, prog=ap.prog, threads=1, dtype=None, seed=seed)
            out = [{**{k: r.get(k) for k in ("method", "budget", "keep_ratio", "task", "mode", "length")},
                    **{name: sum(v[i]) / len(v[i]) for name, v in scored.items()},
                    **{f"{name}_each": v[i] for name, v in scored.items()}} for i, r in enumerate(records)]
            atomic_write_text(args.json, json.dumps({"provenance": prov, "source": str(args.results),
                                                     "checkpoint": checkpoint, "records": out}, indent=1))
            print(f"written to {args.json}")


if __name__ == "__main__":
    main()
