"""
A benchmark's rows as a task file: a LongBench or RULER subset, converted once, runs through ``--task-file``.

    python -m experiments.evaluation.convert longbench hotpotqa.jsonl --out hotpotqa_tasks.jsonl
    python -m experiments.evaluation.convert ruler niah_single_1.jsonl --out niah_tasks.jsonl

LongBench rows (``context``, ``input``, ``answers``, ``_id``, ...) map field to field: the ``input`` is the
question, ``_id`` the item's id, the other fields stay as metadata; a row whose ``input`` is empty (the
summarisation sets ask no question) is refused, naming it. RULER rows hold the whole prompt in ``input``: its
last line is the question (RULER's templates end so), with the row's ``answer_prefix`` after it, and the rest
the context; ``outputs`` are the answers, ``index`` the id. The scorer: RULER's ``string_match_all`` for RULER,
``string_match_part`` (any reference) for LongBench's question answering, or ``--scorer``. Each row written is
checked as ``--task-file`` checks it (``task_file.read_items``).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from .task_file import SCORERS, open_task_file, read_items

FORMATS = ("longbench", "ruler")
DEFAULT_SCORER = {"longbench": "string_match_part", "ruler": "string_match_all"}


def longbench_item(row: dict, where: str) -> dict:
    """A LongBench row as a task file's item (``where`` names the row in an error)."""
    for key in ("context", "input", "answers"):
        if key not in row:
            raise ValueError(f"{where}: no {key!r}, so not a LongBench row")
    if not isinstance(row["input"], str) or not row["input"].strip():
        raise ValueError(f"{where}: an empty 'input': a row that asks no question (LongBench's summarisation "
                         "sets) has no answer to check")
    item = {"context": row["context"], "question": row["input"], "answers": row["answers"]}
    if "_id" in row:
        item["id"] = row["_id"]
    return item | {k: v for k, v in row.items() if k not in ("context", "input", "answers", "_id")}


def ruler_item(row: dict, where: str) -> dict:
    """A RULER row as a task file's item: its ``input``'s last line the question, the rest the context."""
    for key in ("input", "outputs"):
        if key not in row:
            raise ValueError(f"{where}: no {key!r}, so not a RULER row")
    text = row["input"] if isinstance(row["input"], str) else ""
    context, _, question = text.rstrip().rpartition("\n")
    if not context.strip() or not question.strip():
        raise ValueError(f"{where}: its 'input' has no context before a last line that asks the question")
    prefix = row.get("answer_prefix") or ""
    item = {"context": context, "question": question + (" " + prefix.strip() if prefix.strip() else ""),
            "answers": row["outputs"]}
    if "index" in row:
        item["id"] = row["index"]
    return item | {k: v for k, v in row.items() if k not in ("input", "outputs", "index", "answer_prefix")}


def convert(path: str | Path, fmt: str, scorer: str | None = None) -> list[dict]:
    """The rows of the JSON Lines file ``path`` in the benchmark's format ``fmt`` as task file items."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    scorer = scorer or DEFAULT_SCORER[fmt]
    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; one of {', '.join(SCORERS)}")
    item_of = longbench_item if fmt == "longbench" else ruler_item
    items = []
    with open_task_file(path) as f:                    # a regular file of a task file's size, checked first
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                raise ValueError(f"{where}: not a JSON row ({type(e).__name__})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a row is a JSON object")
            items.append(item_of(row, where) | {"scorer": scorer})
    if not items:
        raise ValueError(f"{path}: no rows")
    return items


def main(argv: list[str] | None = None) -> None:
    from nanollm import cli
    from nanollm.io.files import atomic_write_text

    ap = cli.ArgumentParser(prog="python -m experiments.evaluation.convert",
                            description="Convert a LongBench or RULER subset (JSON Lines) into a task file, the "
                                        "format the main job's task-file option reads.")
    ap.add_argument("format", choices=FORMATS, help="the benchmark the rows come from")
    ap.add_argument("rows", help="the benchmark's .jsonl file")
    ap.add_argument("--out", type=cli.output_file, required=True, help="the task file to write (.jsonl)")
    ap.add_argument("--scorer", choices=sorted(SCORERS), default=None,
                    help="how an answer is scored (default: string_match_part for LongBench, string_match_all "
                         "for RULER)")
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        cli.check_outputs({"--out": args.out}, inputs=[args.rows])
        items = convert(args.rows, args.format, args.scorer)
        text = "".join(json.dumps(item) + "\n" for item in items)
        with tempfile.TemporaryDirectory() as folder:     # what --task-file will check, checked before writing
            check = Path(folder) / "items.jsonl"
            check.write_text(text)
            try:
                read_items(check)
            except ValueError as e:
                cli.fail(f"{args.rows}: the converted rows are not a task file "
                         f"({str(e).replace(str(check), 'converted')}); nothing was written")
        atomic_write_text(args.out, text)
        print(f"{len(items)} items of {args.format} written to {args.out}")


if __name__ == "__main__":
    main()
