"""Hostile inputs, round six (issue 96), for the readers of data files and the sizes commands allocate: one
JSON reader (``files.parse_json``) refuses in one line what was a traceback later; ``agree`` a record key that
is a list; ``timed`` a record holding NaN or 1e400 (and never writes one); ``fastpath.bench --summary ''``
ran the kernels' benchmark; ``--e2e``, ``fastpath.profile`` took sizes and step counts no machine holds."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from experiments.evaluation import agree
from fastpath import bench, profile
from nanollm.cli import timed
from nanollm.io import files
from tests.commands import refused, within

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = ROOT / "results" / "compare_default.json"


@pytest.mark.parametrize("text, message", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"n": ' + "9" * 400 + "}", "an integer of 400 digits"),
    ('{"n": ' + "9" * 5000 + "}", "an integer of 5000 digits"),
    ('{"x": 1e400}', "beyond a float"),
    ('{"x": ', "not valid JSON"),
])
def test_one_json_reader_refuses_in_one_line(text, message):
    with pytest.raises(ValueError, match=message) as e:
        files.parse_json(text, "f.json")
    assert str(e.value).startswith("f.json: ") and "\n" not in str(e.value)


def test_the_reader_reads_what_the_project_writes():
    """A check of the check: every committed results file reads, NaN included (a missing metric)."""
    for path in (ROOT / "results").glob("*.json"):
        files.read_json(path, "results file", max_mb=None)
    assert math.isnan(files.parse_json('{"kl": NaN}', "f")["kl"])
    assert files.parse_json(str(2**63 - 1), "f") == 2**63 - 1


def test_agree_refuses_a_record_whose_key_is_a_list(tmp_path, capsys):
    data = json.loads(COMMITTED.read_text())
    data["records"][0]["task"] = ["a", "list"]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(data))
    err = refused(capsys, agree.main, [str(path), str(COMMITTED)])
    assert "record 0" in err and "strings or numbers" in err, err


@pytest.mark.parametrize("median", ["NaN", "1e400", "Infinity"])
def test_timed_refuses_a_record_beyond_json_numbers(tmp_path, capsys, monkeypatch, median):
    monkeypatch.setattr(timed, "time_runs", lambda *a, **kw: pytest.fail("the command ran"))
    record = tmp_path / "t.json"
    record.write_text('{"x": {"median_s": ' + median + "}}")
    err = refused(capsys, timed.main, ["--name", "x", "--repeats", "1", "--record", str(record), "--", "true"])
    assert "--record" in err and ("NaN" in err or "beyond a float" in err), err


def test_bench_summary_of_an_empty_name_is_a_file_name(capsys, monkeypatch):
    monkeypatch.setattr(bench, "end_to_end", lambda *a: pytest.fail("ran the benchmarks"))
    err = refused(capsys, bench.main, ["--summary", ""])
    assert "No such file" in err, err


@pytest.mark.parametrize("main, argv, message", [
    (bench.main, ["--e2e", "--quick", "--length", "1000000000000"], "needs about"),
    (bench.main, ["--e2e", "--batch", "1000000000000"], "needs about"),
    (profile.main, ["--quick", "--steps", "1000000000"], "--steps 1000000000: at most"),
    (profile.main, ["--length", "1000000000000"], "needs about"),
])
def test_sizes_are_checked_before_anything_is_allocated(capsys, monkeypatch, main, argv, message):
    from fastpath import e2e
    monkeypatch.setattr(e2e, "random_model", lambda *a, **kw: pytest.fail("allocated before the check"))
    err = refused(capsys, main, argv)
    assert message in err, err


def test_a_good_record_still_reads(tmp_path):
    record = tmp_path / "t.json"
    shutil.copy(ROOT / "results" / "timings.json", record)
    assert timed.read_record(record)


def test_timed_waits_for_the_record_s_lock_with_a_bound_and_says_whose(tmp_path, capsys, monkeypatch):
    """A folder locked by another process (here: this one, through a second descriptor) is one line after
    ``LOCK_WAIT_S`` with a line while it waits, not a wait without end."""
    import fcntl
    import os
    monkeypatch.setattr(timed, "LOCK_WAIT_S", 1.5)
    monkeypatch.setattr(timed, "time_runs", lambda command, repeats: [{"s": 1.5, "load": 0.1}] * repeats)
    monkeypatch.setattr(timed, "git_commit", lambda: "0" * 7, raising=False)
    fd = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        box, _ = within(20, lambda: timed.main(["--name", "x", "--repeats", "1", "--record",
                                                  str(tmp_path / "t.json"), "--", "true"]))
    finally:
        os.close(fd)
    err = capsys.readouterr().err
    assert isinstance(box.get("error"), SystemExit) and box["error"].code == 2, (box, err)
    waiting, error = err.splitlines()                   # a line while it waits, then the one error line
    assert waiting.startswith(f"waiting for {tmp_path}, locked by another process"), err
    assert error.startswith("error: ") and "still locked by another process" in error, err
