"""
Hostile inputs, round six (issue 96), for the evaluation's files: no output over an input, nothing read before
it is checked, one line for every bad value in a task file.

* ``compare --task-file T --json T`` (or ``--plot T``, or T spelled through ``..``) replaced the task file;
  ``rescore R --json T`` where T is the task file R's records name, too: both are refused before any work.
* a FIFO as the task file hung (it was hashed before its checks); a link to /dev/zero was read to the
  memory limit; a sparse file larger than the limit was read whole before the size check.
* an item nested 2,000 deep, or holding an integer of thousands of digits, was a traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from experiments.evaluation import compare, rescore, task_file
from tests.commands import refused

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = ROOT / "results" / "compare_default.json"
ITEM = {"context": "The capital of France is Paris. " * 4, "question": "What is the capital of France?",
        "answers": ["Paris"]}


def tasks(tmp_path: Path, text: str | None = None, name: str = "mine.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(text if text is not None else json.dumps(ITEM) + "\n")
    return path


def untouched(path: Path, before: bytes) -> None:
    assert path.read_bytes() == before, f"{path} was written over"


@pytest.mark.parametrize("flag", ["--json", "--plot"])
@pytest.mark.parametrize("spelling", ["plain", "dotdot", "link"])
def test_compare_never_writes_over_its_task_file(tmp_path, capsys, monkeypatch, flag, spelling):
    path = tasks(tmp_path, name="mine.png" if flag == "--plot" else "mine.jsonl")    # any name is a task file's
    before = path.read_bytes()
    (tmp_path / "sub").mkdir()
    out = {"plain": path, "dotdot": tmp_path / "sub" / ".." / path.name,
           "link": tmp_path / f"link{path.suffix}"}[spelling]
    if spelling == "link":
        out.symlink_to(path)
    monkeypatch.setattr(compare, "load_config", lambda *a: pytest.fail("the check came after work began"))
    err = refused(capsys, compare.main, ["--task-file", str(path), flag, str(out), "--quiet"])
    assert "would overwrite" in err and path.name in err, err
    untouched(path, before)


def test_rescore_never_writes_over_the_task_file_its_records_name(tmp_path, capsys):
    path = tasks(tmp_path)
    before = path.read_bytes()
    data = json.loads(COMMITTED.read_text())
    data["records"][0].update(task_file=str(path), task_file_sha256=hashlib.sha256(before).hexdigest())
    results = tmp_path / "run.json"
    results.write_text(json.dumps(data))
    err = refused(capsys, rescore.main, [str(results), "--json", str(path)])
    assert "would overwrite" in err and str(path) in err, err
    untouched(path, before)


def special(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / "mine.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "sparse":                              # larger than the limit, nothing on disk
        with open(path, "wb") as f:
            f.truncate(task_file.MAX_BYTES + 1)
    elif kind == "folder":
        path.mkdir()
    return path


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "sparse", "folder"])
def test_a_task_file_is_checked_before_its_first_byte_is_read(tmp_path, capsys, kind):
    """Through the library (``FileTask``) and through the command: one line, within seconds."""
    path = special(tmp_path, kind)
    with pytest.raises((ValueError, OSError)) as e:
        task_file.FileTask(path)
    assert str(path) in str(e.value) and ("regular file" in str(e.value) or "MB" in str(e.value)
                                          or "directory" in str(e.value).lower()), e.value
    err = refused(capsys, compare.main, ["--task-file", str(path), "--quiet"], seconds=20)
    assert err.startswith("error: --task-file") and "mine.jsonl" in err, err


@pytest.mark.parametrize("line, message", [
    ('{"context": ' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
    (json.dumps(ITEM)[:-1] + ', "n": ' + "9" * 5000 + "}", "line 1"),
])
def test_a_hostile_item_is_one_line_naming_its_line(tmp_path, line, message):
    path = tasks(tmp_path, line + "\n")
    with pytest.raises(ValueError, match=message) as e:
        task_file.read_items(path)
    assert "mine.jsonl, line 1" in str(e.value) and "\n" not in str(e.value)


def test_the_check_lets_a_good_file_through(tmp_path):
    """A check of the checks: an ordinary file reads, hashes and runs as before."""
    path = tasks(tmp_path)
    assert task_file.file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert task_file.FileTask(path).items == [ITEM]
    shutil.copy(path, tmp_path / "copy.jsonl")
    assert task_file.read_items(tmp_path / "copy.jsonl") == [ITEM]


def test_kvreviver_rounding_never_writes_over_its_task_file(tmp_path, capsys):
    """The analysis runs the main job's command (``compare.main``): the same check."""
    from experiments.analysis import kvreviver_rounding
    path = tasks(tmp_path)
    before = path.read_bytes()
    err = refused(capsys, kvreviver_rounding.main, ["--task-file", str(path), "--json", str(path)])
    assert "would overwrite" in err, err
    untouched(path, before)


def test_rescore_reads_no_byte_of_a_record_s_task_file_over_the_limit(tmp_path, capsys):
    """A record naming a sparse file larger than a task file may be: refused in one line, within seconds."""
    big = special(tmp_path, "sparse")
    data = json.loads(COMMITTED.read_text())
    data["records"][0].update(task_file=str(big), task_file_sha256="0" * 64)
    results = tmp_path / "run.json"
    results.write_text(json.dumps(data))
    err = refused(capsys, rescore.main, [str(results)], seconds=20)
    assert "record 0" in err and "more than the" in err, err


def test_a_run_that_fails_at_a_sample_writes_what_finished_marked_incomplete(tmp_path, capsys, monkeypatch):
    """A sample that fails after others finished (here: the fourth of six jobs raises) was a traceback and no
    file; now the finished samples' records are written, the run marked incomplete with the failing sample
    named, and the command ends in one line (status 2)."""
    from experiments.evaluation import workers
    real, calls = workers.run_jobs, []

    def fails_fourth(*args):
        calls.append(args[-1])
        if len(calls) == 4:
            raise RuntimeError("a bug in sample 1")
        return real(*args)
    monkeypatch.setattr(workers, "run_jobs", fails_fourth)
    out = tmp_path / "run.json"
    err = refused(capsys, compare.main, ["--methods", "snapkv", "--keep-ratios", "0.5", "--tasks", "niah_multikey",
                                         "--samples", "3", "--workers", "1", "--quiet", "--json", str(out)])
    assert "the run stopped at sample 1 of niah_multikey [question_after_context]" in err, err
    assert "RuntimeError: a bug in sample 1" in err and "marked incomplete" in err, err
    data = json.loads(out.read_text())
    assert data["run"]["complete"] is False and data["run"]["failed"]["sample"] == 1
    counts = {(r["method"], r["mode"]): r["n_samples"] for r in data["records"]}
    assert counts == {("full", "question_in_prompt"): 2, ("snapkv", "question_in_prompt"): 2,
                      ("full", "question_after_context"): 1, ("snapkv", "question_after_context"): 1}


def test_a_run_that_fails_at_its_first_sample_is_one_line_and_no_file(tmp_path, capsys, monkeypatch):
    from experiments.evaluation import workers
    monkeypatch.setattr(workers, "run_jobs", lambda *a: (_ for _ in ()).throw(RuntimeError("at once")))
    out = tmp_path / "run.json"
    err = refused(capsys, compare.main, ["--methods", "snapkv", "--keep-ratios", "0.5", "--tasks", "niah_multikey",
                                         "--samples", "1", "--workers", "1", "--quiet", "--json", str(out)])
    assert "sample 0 of niah_multikey" in err and "nothing was written" in err, err
    assert not out.exists()
