"""
``python -m nanollm.cli.timed`` used against itself (issue 59).

* ``--record`` must be a timings record: a bundled file (``nanollm/checkpoints/``,
  ``methods/tensor_attention/checkpoints/``, however the path is spelled or linked), a results file of another
  kind, or any file that is not a JSON object of timings entries is refused before the command runs, and left
  as it was; a new or empty file is fine.
* Entries are merged under a lock: two runs with different names and the same record both keep theirs.
* Every mistake is one ``error:`` line with exit status 2 and no ``usage:``: the arguments, a missing or
  non-executable command, a write that fails (a full disk, a read-only mount). Ctrl-C or SIGTERM ends in
  ``error: interrupted`` (130), with the command and what it started stopped.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nanollm.cli import timed
from nanollm.io import files
from tests.commands import refused
from tests.nanollm.cli.test_cli import ROOT, cli_env, run_cli

CARD = ROOT / "nanollm" / "checkpoints" / "retrieval-llama" / "card.json"
CONFIG = ROOT / "nanollm" / "checkpoints" / "retrieval-llama" / "nanollm_config.json"
MATCH3_CARD = ROOT / "methods" / "tensor_attention" / "checkpoints" / "match3-tensor" / "card.json"
ENTRY = {"median_s": 1.5, "runs": [{"s": 1.5, "load": 0.1}], "command": "true", "date": "2026-01-01",
         "cores": 2, "commit": "abc"}


@pytest.fixture
def no_runs(monkeypatch):
    """Make running the command fail the test: a refusal comes before it."""
    monkeypatch.setattr(timed, "time_runs", lambda *a, **kw: pytest.fail("the command ran"))


@pytest.fixture
def quick_runs(monkeypatch):
    """One run of 1.5 s without starting a process, and no git (the fast tier starts no process)."""
    monkeypatch.setattr(timed, "time_runs", lambda command, repeats: [{"s": 1.5, "load": 0.1}] * repeats)
    monkeypatch.setattr(timed, "git_commit", lambda *a: "abc")


def timed_argv(record, name: str = "x", command=("true",)) -> list[str]:
    return ["--name", name, "--repeats", "1", "--record", str(record), "--", *command]


# ----------------------------------------------------------------------------------------------------------
# 1. --record must be a timings record, never a bundled file

def bundled_spellings(tmp_path: Path) -> list[Path]:
    """Paths that lead to a bundled file: as given, with '..', through a linked file or folder, a hard link."""
    (tmp_path / "card_link.json").symlink_to(CARD)
    (tmp_path / "checkpoints_link").symlink_to(CARD.parent.parent)
    paths = [CARD.relative_to(ROOT), CONFIG, CARD.parent / ".." / "retrieval-llama" / "card.json", MATCH3_CARD,
             tmp_path / "card_link.json", tmp_path / "checkpoints_link" / "retrieval-llama" / "nanollm_config.json"]
    try:
        os.link(CARD, tmp_path / "card_hard.json")
        paths.append(tmp_path / "card_hard.json")
    except OSError:                                 # another file system: no hard link to make
        pass
    return paths


def test_a_bundled_file_is_refused_and_left_as_it_was(tmp_path, capsys, no_runs, monkeypatch):
    monkeypatch.chdir(ROOT)
    before = {p: p.read_bytes() for p in (CARD, CONFIG, MATCH3_CARD)}
    for path in bundled_spellings(tmp_path):
        err = refused(capsys, timed.main, seconds=20, argv=timed_argv(path))
        assert "bundled checkpoints" in err or "not a timings record" in err, (path, err)
    assert {p: p.read_bytes() for p in before} == before


@pytest.mark.parametrize("content", [
    json.dumps({"name": "retrieval-llama", "summary": "a card"}),            # a model card
    (ROOT / "results" / "compare_default.json").read_text(),                  # another command's results
    "[1, 2]", "3", '"text"', "null", "not json", "{" * 100_000,
    json.dumps({"x": 1.5}),
    json.dumps({"x": {"runs": []}}),                                          # no median_s
    json.dumps({"x": {**ENTRY, "median_s": "1.5"}}),
    json.dumps({"x": {**ENTRY, "median_s": True}}),
    json.dumps({"x": {**ENTRY, "runs": "fast"}}),
    json.dumps({"x": {**ENTRY, "command": ["true"]}}),
    json.dumps({"x": {**ENTRY, "weights": "a tensor"}}),                      # a field no entry has
], ids=["card", "compare-results", "list", "number", "string", "null", "not-json", "deep", "number-entry",
        "no-median", "string-median", "bool-median", "string-runs", "list-command", "unknown-field"])
def test_a_file_that_is_not_a_timings_record_is_refused(tmp_path, capsys, no_runs, content):
    record = tmp_path / "t.json"
    record.write_text(content)
    err = refused(capsys, timed.main, seconds=20, argv=timed_argv(record))
    assert "timings record" in err and str(record) in err
    assert record.read_text() == content


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("kind", ["fifo", "zero", "folder"])
def test_a_record_that_is_not_a_regular_file_is_refused_by_kind(tmp_path, capsys, no_runs, kind):
    record = tmp_path / "t.json"
    {"fifo": os.mkfifo, "zero": lambda p: p.symlink_to("/dev/zero"), "folder": os.mkdir}[kind](record)
    err = refused(capsys, timed.main, seconds=20, argv=timed_argv(record))
    assert str(record) in err


@pytest.mark.parametrize("content", ["", "  \n"], ids=["empty", "blank"])
def test_an_empty_file_takes_the_entry(tmp_path, quick_runs, content):
    """An empty file is a record without entries (as a new one is; one with entries: the merge tests)."""
    record = tmp_path / "t.json"
    record.write_text(content)
    timed.main(timed_argv(record, name="noop"))
    entry = json.loads(record.read_text())["noop"]
    assert entry["median_s"] == 1.5 and entry["command"] == "true" and entry["commit"] == "abc"


# ----------------------------------------------------------------------------------------------------------
# 2. Entries are merged under a lock

def test_runs_at_the_same_time_merge_their_entries(tmp_path, monkeypatch):
    """Runs in threads that each read the record before their run and write after it: with the record read
    again under the lock, every entry is kept (before: the last writer's alone)."""
    record = tmp_path / "t.json"
    record.write_text(json.dumps({"install": ENTRY}))
    monkeypatch.setattr(timed, "git_commit", lambda *a: "abc")
    monkeypatch.setattr(timed, "time_runs", lambda command, repeats: time.sleep(0.5) or [{"s": 0.5, "load": 0}])
    names = [f"run{i}" for i in range(4)]
    threads = [threading.Thread(target=timed.main, args=(timed_argv(record, name=n),)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(json.loads(record.read_text())) == sorted(["install", *names])


@pytest.mark.slow
def test_two_timed_processes_with_the_same_record_keep_both_entries(tmp_path):
    record = tmp_path / "t.json"
    runs = [subprocess.Popen([sys.executable, "-m", "nanollm.cli.timed", *timed_argv(
        record, name=name, command=(sys.executable, "-c", "import time; time.sleep(1)"))],
        env=cli_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in "ab"]
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
    assert sorted(json.loads(record.read_text())) == ["a", "b"]


# ----------------------------------------------------------------------------------------------------------
# 3. One line for every mistake

R = "{record}"
ARGUMENT_ERRORS = {
    "nothing": [],
    "no-name": ["--record", R, "--", "true"],
    "no-record": ["--name", "x", "--", "true"],
    "name-without-value": ["--record", R, "--name"],
    "empty-name": ["--name", " ", "--record", R, "--", "true"],
    "repeats-not-a-number": ["--name", "x", "--repeats", "abc", "--record", R, "--", "true"],
    "repeats-fraction": ["--name", "x", "--repeats", "1.5", "--record", R, "--", "true"],
    "repeats-zero": ["--name", "x", "--repeats", "0", "--record", R, "--", "true"],
    "repeats-negative": ["--name", "x", "--repeats", "-3", "--record", R, "--", "true"],
    "repeats-too-many": ["--name", "x", "--repeats", "21", "--record", R, "--", "true"],
    "repeats-huge": ["--name", "x", "--repeats", "1" + "0" * 30, "--record", R, "--", "true"],
    "unknown-flag": ["--name", "x", "--bogus", "--record", R, "--", "true"],
    "no-command": ["--name", "x", "--record", R],
    "nothing-after-dashes": ["--name", "x", "--record", R, "--"],
    "no-folder": ["--name", "x", "--record", "/no/such/folder/t.json", "--", "true"],
    "name-too-long": ["--name", "x", "--record", "{tmp}/" + "n" * 300 + ".json", "--", "true"],
    "record-a-folder": ["--name", "x", "--record", "{tmp}", "--", "true"],
}


@pytest.mark.parametrize("argv", ARGUMENT_ERRORS.values(), ids=ARGUMENT_ERRORS.keys())
def test_argument_errors_are_one_line_without_usage(tmp_path, capsys, no_runs, argv):
    argv = [a.replace(R, str(tmp_path / "t.json")).replace("{tmp}", str(tmp_path)) for a in argv]
    refused(capsys, timed.main, seconds=20, argv=argv)
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("command", ["no-such-command-59", "{tmp}/not_executable.sh", "{tmp}", "/dev/null"])
def test_a_missing_or_non_executable_command_is_one_line(tmp_path, capsys, no_runs, command):
    (tmp_path / "not_executable.sh").write_text("#!/bin/sh\ntrue\n")
    command = command.replace("{tmp}", str(tmp_path))
    err = refused(capsys, timed.main, seconds=20, argv=timed_argv(tmp_path / "t.json", command=(command,)))
    assert command in err and not (tmp_path / "t.json").exists()


def test_a_record_that_cannot_be_written_is_one_line(tmp_path, capsys, quick_runs, monkeypatch):
    """A read-only mount (EROFS where the temporary file is made; tests run as root, for whom a 0o555 folder
    is writable): one line naming the record, which is left as it was."""
    record = tmp_path / "t.json"
    record.write_text(json.dumps({"install": ENTRY}))

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(files.tempfile, "mkstemp", read_only)
    err = refused(capsys, timed.main, seconds=20, argv=timed_argv(record))
    assert str(record) in err and "Read-only file system" in err
    assert json.loads(record.read_text()) == {"install": ENTRY}


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_leaves_the_record(tmp_path):
    record = tmp_path / "t.json"
    record.write_text("{}")
    result = run_cli(["-m", "nanollm.cli.timed", *timed_argv(record)], cwd=tmp_path, file_size_limit=100)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"error: --record {record}: cannot write it") and result.stderr.count("error:") == 1
    assert record.read_text() == "{}" and sorted(os.listdir(tmp_path)) == ["t.json"]


def gone(pid: int) -> bool:
    """No process ``pid`` runs (a zombie, ended but not yet reaped by whoever adopted it, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("sh") or not shutil.which("sleep"), reason="needs sh and sleep")
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, id="ctrl-c"),       # SIGTERM with --runheavy
                                 pytest.param(signal.SIGTERM, id="sigterm", marks=pytest.mark.heavy)])
def test_an_interrupted_run_is_one_line_and_stops_the_command(tmp_path, sig):
    """The command is a shell that starts ``sleep`` and waits for it: both are stopped, nothing is recorded."""
    pidfile, record = tmp_path / "sleep.pid", tmp_path / "t.json"
    command = ("sh", "-c", f"sleep 120 & echo $! > {pidfile}; wait")
    errfile = tmp_path / "stderr.txt"      # a file, not a pipe: a sleep left running would hold a pipe open
    with errfile.open("w") as err_out:
        proc = subprocess.Popen([sys.executable, "-m", "nanollm.cli.timed", *timed_argv(record, command=command)],
                                env=cli_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err_out)
    sleep_pid = None
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        sleep_pid = int(pidfile.read_text())
        proc.send_signal(sig)
        proc.wait(timeout=60)
        err = errfile.read_text()
        assert proc.returncode == 130 and err == "error: interrupted\n", (proc.returncode, err[-2000:])
        deadline = time.monotonic() + 10
        while not gone(sleep_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(sleep_pid), "the command's sleep was left running"
        assert not record.exists()
    finally:
        proc.kill()
        if sleep_pid is not None and not gone(sleep_pid):
            os.kill(sleep_pid, signal.SIGKILL)


class StartedWhileInterrupted:
    """A stand-in for ``subprocess.Popen``: Ctrl-C comes while it is being started (the race that left a
    real command running), after the process exists."""

    def __init__(self, command, **kwargs):
        self.pid = 12345
        signal.raise_signal(signal.SIGINT)
        self.command = command


def test_ctrl_c_while_the_command_starts_still_stops_it(monkeypatch):
    stopped = []
    monkeypatch.setattr(timed.subprocess, "Popen", StartedWhileInterrupted)
    monkeypatch.setattr(timed, "stop", stopped.append)
    with pytest.raises(KeyboardInterrupt):
        timed.run_once(["true"])
    assert len(stopped) == 1 and stopped[0].command == ["true"], "the started command was not stopped"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "Ctrl-C's handler was not given back"
