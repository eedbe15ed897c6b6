"""
A task read from a file: a researcher's own items (or a RULER or LongBench subset exported to it) run through
the same protocol as the built-in tasks, in both modes, with the same metrics and intervals.

    python -m experiments.compare --task-file experiments/evaluation/examples/niah_single_noise.jsonl --samples 8
    python -m experiments.evaluation.task_file niah_single_noise --out mine.jsonl    # a built-in task's items

The file is JSON Lines, one item a line::

    {"context": "...", "question": "...", "answers": ["Paris"], "scorer": "string_match_part", "answer_tokens": 8}

``context``, ``question`` and ``answers`` are required; ``id``, ``target``, ``scorer`` and ``answer_tokens``
are optional, other fields metadata. A context longer than ``--length`` allows is refused, or cut
(``--truncate middle | left``). The fields, the modes and the cuts in full: ``task_files.md``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from nanollm.data.tasks import Sample, string_match_all
from nanollm.io.files import MB, open_data_file, parse_json

from .task import TASKS, Task


def string_match_part(prediction: str, answers: list[str]) -> float:
    """RULER's question-answering score: 1 if any reference occurs in the prediction (case-insensitive)."""
    return float(any(string_match_all(prediction, [a]) == 1.0 for a in answers))


def exact_match(prediction: str, answers: list[str]) -> float:
    """1 if the prediction, stripped, equals a reference, stripped (case-sensitive)."""
    return float(prediction.strip() in {a.strip() for a in answers})


SCORERS = {"string_match_all": string_match_all, "string_match_part": string_match_part, "exact_match": exact_match}
FIELDS = {"context": str, "question": str, "answers": list, "target": str, "scorer": str, "answer_tokens": int,
          "id": (str, int)}     # id: the item's own name, kept in every record (item_ids); other fields are metadata
MAX_ITEMS, MAX_BYTES = 100_000, 1 << 30
TRUNCATE = ("refuse", "middle", "left")  # what a context longer than the run's length gets (--truncate)
ROOM = 8                                 # answer tokens beyond the longest reference, unless an item says


def open_task_file(path: str | Path):
    """``path`` opened for reading once it is checked to be a regular file of at most ``MAX_BYTES``, links
    followed, through the open descriptor (``open_data_file``): a FIFO, a link to /dev/zero or a huge sparse
    file is one line before a byte is read."""
    return open_data_file(path, "task file", MAX_BYTES / MB)


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a task file, read in blocks after ``open_task_file``'s checks."""
    digest = hashlib.sha256()
    with open_task_file(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_items(path: Path) -> list[dict]:
    """The file's items, every field checked before any work; a bad one is one line naming its line number."""
    items = []
    with open_task_file(path) as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}, line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            item = parse_json(line, where, "task file's item")
            if not isinstance(item, dict):
                raise ValueError(f"{where}: an item is a JSON object, not {type(item).__name__}")
            for key in ("context", "question", "answers"):
                if key not in item:
                    raise ValueError(f"{where}: no {key!r}")
            for key, value in item.items():
                if key in FIELDS and (not isinstance(value, FIELDS[key]) or isinstance(value, bool)):
                    kind = " or ".join(t.__name__ for t in FIELDS[key]) if isinstance(FIELDS[key], tuple) \
                        else FIELDS[key].__name__
                    raise ValueError(f"{where}: {key!r} is a {kind}, not {type(value).__name__}")
            for key in ("context", "question"):
                if not item[key].strip():
                    raise ValueError(f"{where}: {key!r} is empty")
            if not item["answers"] or not all(isinstance(a, str) and a.strip() for a in item["answers"]):
                raise ValueError(f"{where}: 'answers' is a list of one or more non-empty strings")
            if item.get("scorer", "string_match_all") not in SCORERS:
                raise ValueError(f"{where}: unknown scorer {item['scorer']!r}; choose from {', '.join(SCORERS)}")
            if not 1 <= item.get("answer_tokens", 1) <= 4096:
                raise ValueError(f"{where}: 'answer_tokens' is from 1 to 4096")
            items.append(item)
            if len(items) > MAX_ITEMS:
                raise ValueError(f"{path}: more than {MAX_ITEMS} items")
    if not items:
        raise ValueError(f"{path}: no items")
    ids = [item["id"] for item in items if "id" in item]
    if len(set(ids)) < len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{path}: id {twice!r} names more than one item")
    return items


def metadata(items: list[dict]) -> list[str]:
    """The fields of the items that the task does not read (a benchmark's ``_id``, ``dataset``, ``length``):
    kept in the file, listed once by the run, used by nothing."""
    return sorted({key for item in items for key in item} - set(FIELDS))


_ITEMS: dict[tuple[str, str], list[dict]] = {}     # per process: (path, sha256) -> items, read once
_BY_SAMPLE: dict[tuple[str, str], dict] = {}       # ... and (question, answers) -> its item, for scoring


class FileTask(Task):
    """The items of a JSON Lines file as a task named after the file (``capitals.jsonl``: ``file:capitals``).
    It pickles as its path and digest (a worker process reads the file itself) and refuses a file that
    changed since the run began."""

    def __init__(self, path: str | Path, truncate: str = "refuse") -> None:
        if truncate not in TRUNCATE:
            raise ValueError(f"truncate is one of {', '.join(TRUNCATE)}, not {truncate!r}")
        self.path, self.truncate = str(path), truncate
        self.sha256 = file_sha256(path)
        super().__init__("file:" + Path(path).stem)
        self.items                                             # read and checked now, before any work

    @property
    def items(self) -> list[dict]:
        key = (self.path, self.sha256)
        if key not in _ITEMS:
            if file_sha256(self.path) != self.sha256:
                raise ValueError(f"{self.path}: the task file changed since the run began")
            _ITEMS[key] = read_items(Path(self.path))
        return _ITEMS[key]

    def parts(self, tok, length: int, seed: int) -> tuple[dict, list[int], str, list[int], list[int], int]:
        """Item ``seed`` tokenized: (item, question ids, target, target ids, the whole context's ids, the
        context tokens that fit in ``length`` beside the question and the target)."""
        if not 0 <= seed < len(self.items):
            raise ValueError(f"{self.path} holds {len(self.items)} items; sample {seed} asked for (seed + index)")
        item = self.items[seed]
        question_ids = tok.encode(item["question"])
        first = item["answers"][0]
        target = item.get("target") or (first if item["question"][-1:].isspace() else " " + first)
        target_ids = tok.encode(target) + [tok.eot_id]
        room = length - len(question_ids) - len(target_ids)
        if room < 1:
            raise ValueError(f"{self.path}: item {seed}'s question and answer take {length - room} tokens, "
                             f"more than --length {length}")
        return item, question_ids, target, target_ids, tok.encode(item["context"]), room

    def cut(self, context_ids: list[int], room: int) -> list[int]:
        """``context_ids`` within ``room`` tokens as ``truncate`` says (``refuse``: as they are)."""
        if len(context_ids) <= room or self.truncate == "refuse":
            return context_ids
        if self.truncate == "left":                              # the end, where the question follows
            return context_ids[len(context_ids) - room:]
        return context_ids[:room // 2] + context_ids[len(context_ids) - (room - room // 2):]   # both halves

    def cuts(self, tok, length: int, seeds: range) -> list[dict]:
        """The items of ``seeds`` whose context does not fit ``length``: each one's context tokens, the tokens
        kept, and whether an answer string the whole context held is still in the kept prompt."""
        out = []
        for seed in seeds:
            item, question_ids, _, _, context_ids, room = self.parts(tok, length, seed)
            if len(context_ids) <= room:
                continue
            kept = tok.decode(self.cut(context_ids, room)[:room]) + item["question"]
            held = [a for a in item["answers"] if a in item["context"] + item["question"]]
            out.append({"item": seed, "context_tokens": len(context_ids), "kept_tokens": room,
                        "answers_kept": not held or any(a in kept for a in held),
                        **({"id": item["id"]} if item.get("id") is not None else {})})
        return out

    def sample(self, tok, length: int, seed: int) -> Sample:
        item, question_ids, target, target_ids, context_ids, room = self.parts(tok, length, seed)
        if len(context_ids) > room and self.truncate == "refuse":
            raise ValueError(f"{self.path}: line {seed + 1}'s context is {len(context_ids)} tokens and {room} fit in "
                             f"--length {length} beside its question and answer; --truncate middle or left cuts it")
        context_ids = self.cut(context_ids, room)
        return Sample(self.name, tok.decode(context_ids), item["question"], list(item["answers"]), target,
                      context_ids=context_ids, question_ids=question_ids, target_ids=target_ids)

    def item_of(self, sample: Sample) -> dict:
        """The item a sample was made from (a dict lookup: scoring runs once per answer)."""
        key = (self.path, self.sha256)
        if key not in _BY_SAMPLE:
            _BY_SAMPLE[key] = {(item["question"], tuple(item["answers"])): item for item in reversed(self.items)}
        return _BY_SAMPLE[key][(sample.question, tuple(sample.answers))]

    def answer_length(self, model, sample: Sample) -> int:
        item = self.item_of(sample)
        allowed = item.get("answer_tokens") or len(sample.target_ids) + ROOM
        return min(allowed, model.config.max_seq_len - len(sample.prompt_ids) + 1)

    def score(self, prediction: str, sample: Sample) -> float:
        return SCORERS[self.item_of(sample).get("scorer", "string_match_all")](prediction, sample.answers)

    def __getstate__(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "name": self.name, "truncate": self.truncate}



def export(task: Task, model, tok, length: int, seeds: range) -> list[dict]:
    """A built-in task's samples ``seeds`` at ``length`` tokens as a task file's items, each with the answer
    length ``task`` gives it on ``model``: a file task of these items runs as the built-in task does."""
    return [{"context": s.context, "question": s.question, "answers": s.answers, "target": s.target,
             "scorer": "string_match_all", "answer_tokens": task.answer_length(model, s)}
            for s in (task.sample(tok, length, seed) for seed in seeds)]


def main(argv: list[str] | None = None) -> None:
    from nanollm import cli, load
    from nanollm.io.files import atomic_write_text

    ap = cli.ArgumentParser(prog="python -m experiments.evaluation.task_file",
                            description="Write a built-in task's samples as a task file (JSON Lines), the "
                                        "format --task-file reads: a start for a file of one's own.")
    ap.add_argument("task", choices=sorted(TASKS), help="the built-in task")
    ap.add_argument("--out", type=cli.output_file, required=True, help="the .jsonl file to write")
    ap.add_argument("--checkpoint", default="retrieval-llama", help="whose tokenizer and positions (default "
                    "%(default)s)")
    ap.add_argument("--length", type=cli.positive_int, default=512, help="tokens per sample (default %(default)s)")
    ap.add_argument("--samples", type=cli.positive_int, default=8, help="items, seeds 0 up (default %(default)s)")
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        cli.check_outputs({"--out": args.out}, inputs=[args.checkpoint])
        if args.samples > MAX_ITEMS:
            cli.fail(f"--samples: at most {MAX_ITEMS}")
        model, tok, _ = load(args.checkpoint)
        try:
            items = export(TASKS[args.task], model, tok, args.length, range(args.samples))
        except ValueError as e:
            cli.fail(f"--length {args.length}: {e}")
        atomic_write_text(args.out, "".join(json.dumps(item) + "\n" for item in items))
        print(f"{len(items)} items of {args.task} at {args.length} tokens written to {args.out}")


if __name__ == "__main__":
    main()
