"""LongBench and RULER rows, written here by hand in their formats, converted into task files (issue 97)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.evaluation import convert
from experiments.evaluation.task_file import FileTask, read_items
from tests.commands import refused

LONGBENCH = [
    {"input": "Which city is the capital of France?", "context": "Paris is the capital of France. " * 3,
     "answers": ["Paris"], "length": 18, "dataset": "hotpotqa", "language": "en", "all_classes": None,
     "_id": "a1b2"},
    {"input": "Who wrote it?", "context": "The book was written by Ada.", "answers": ["Ada", "Ada L."],
     "length": 7, "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": "c3d4"},
]
RULER = [
    {"index": 0, "input": "Some special magic numbers are hidden within the following text.\n"
                          "One of the special magic numbers for cat is: 1234.\nSome filler.\n"
                          "What is the special magic number for cat mentioned in the provided text?",
     "outputs": ["1234"], "length": 40, "length_w_model_temp": 52,
     "answer_prefix": " The special magic number for cat mentioned in the provided text is"},
]


def rows(tmp_path: Path, items: list[dict], name: str = "rows.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def test_longbench_rows_map_field_to_field(tmp_path):
    items = convert.convert(rows(tmp_path, LONGBENCH), "longbench")
    first = items[0]
    assert (first["question"], first["context"], first["answers"], first["id"], first["scorer"]) == \
        (LONGBENCH[0]["input"], LONGBENCH[0]["context"], ["Paris"], "a1b2", "string_match_part")
    assert first["dataset"] == "hotpotqa" and "input" not in first and "_id" not in first   # the rest: metadata


def test_ruler_rows_split_at_the_question_and_keep_the_answer_prefix(tmp_path):
    item = convert.convert(rows(tmp_path, RULER), "ruler")[0]
    assert item["context"].endswith("Some filler.") and "1234." in item["context"]
    assert item["question"] == ("What is the special magic number for cat mentioned in the provided text? "
                                "The special magic number for cat mentioned in the provided text is")
    assert (item["answers"], item["id"], item["scorer"]) == (["1234"], 0, "string_match_all")


def test_the_command_writes_a_task_file_that_runs(tmp_path, capsys):
    out = tmp_path / "tasks.jsonl"
    convert.main(["longbench", str(rows(tmp_path, LONGBENCH)), "--out", str(out)])
    assert "2 items of longbench" in capsys.readouterr().out
    assert [i["id"] for i in read_items(out)] == ["a1b2", "c3d4"] and len(FileTask(out).items) == 2


@pytest.mark.parametrize("fmt, row, message", [
    ("longbench", {**LONGBENCH[0], "input": ""}, "an empty 'input'"),
    ("longbench", {"context": "x"}, "no 'input', so not a LongBench row"),
    ("ruler", {"input": "one line only", "outputs": ["x"]}, "no context before a last line"),
    ("ruler", {**RULER[0], "outputs": []}, "'answers' is a list of one or more"),
])
def test_a_row_that_cannot_be_a_task_is_one_line_and_nothing_is_written(tmp_path, capsys, fmt, row, message):
    out = tmp_path / "tasks.jsonl"
    err = refused(capsys, convert.main, [fmt, str(rows(tmp_path, [row])), "--out", str(out)])
    assert message in err and "\n" == err[-1], err
    assert not out.exists()
