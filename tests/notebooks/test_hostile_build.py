"""
``notebooks/build.py`` against hostile inputs (issue 59): each ends in one ``error:`` line naming the file,
never a traceback or a hang.

* ``--table``: a ``build_record.json`` that is not an object of runs (a list, a string ``run_s``, ...), a
  committed notebook with no cells or no title, and either of them a FIFO or a link to ``/dev/zero`` (refused by
  kind before a byte is read). The table is built here from a copy of the project's layout in ``tmp_path``
  (the module's ``NOTEBOOKS``, ``LABS`` and ``RECORD`` pointed at it).
* The build: cell tags that are not a list of strings, a source without cells, a notebook without code (the
  figure rules have nowhere to go); and, in a kernel (slow tier), a failing cell, a dead kernel, Ctrl-C and
  SIGTERM during a cell (``error: interrupted``, exit status 130, the kernel stopped). The notebooks run are
  one-cell ``.py`` files in ``tmp_path``, built with ``--tiny`` (nothing written).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from tests.commands import refused

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("notebook_build", ROOT / "notebooks" / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

SOURCE = "# %% [markdown]\n# # 00 A title\n# Some words.\n\n# %%\nx = 1\n"


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """``notebooks/`` in ``tmp_path``: one lesson (source and committed notebook), its run in the record."""
    folder = tmp_path / "notebooks"
    (folder / "labs").mkdir(parents=True)
    (folder / "00_lesson.py").write_text(SOURCE)
    nbformat.write(build.read_percent(folder / "00_lesson.py"), folder / "00_lesson.ipynb")
    (folder / "build_record.json").write_text(json.dumps({"00_lesson": {"run_s": 60.0}}))
    (folder / "readings.json").write_text(json.dumps({"00_lesson": {"minutes": [40, 50], "size": 1.0}}))
    monkeypatch.setattr(build, "NOTEBOOKS", folder)
    monkeypatch.setattr(build, "READINGS", folder / "readings.json")
    monkeypatch.setattr(build, "LABS", folder / "labs")
    monkeypatch.setattr(build, "RECORD", folder / "build_record.json")
    return folder


def test_the_table_of_the_copy(project, capsys):
    build.main(["--table"])
    assert "| [`00_lesson`](notebooks/00_lesson.ipynb) | A title | 45 (40-50, 2) | 1.0 |" in capsys.readouterr().out


@pytest.mark.parametrize("readings", [{"00_lesson": {"minutes": [], "size": 1}},
                                      {"00_lesson": {"minutes": [-5], "size": 1}},
                                      {"00_lesson": {"minutes": [40]}}, {"00_lesson": 40}, [40]],
                         ids=["no-minutes", "negative", "no-size", "number-entry", "list"])
def test_readings_that_are_not_minutes_are_one_line(project, capsys, readings):
    (project / "readings.json").write_text(json.dumps(readings))
    assert "readings.json" in refused(capsys, build.main, seconds=20, argv=["--table"])


# ----------------------------------------------------------------------------------------------------------
# --table

@pytest.mark.parametrize("record", [
    [1, 2], "runs", 3, None,
    {"00_lesson": {"run_s": "60"}}, {"00_lesson": {"run_s": True}}, {"00_lesson": {"run_s": -1}},
    {"00_lesson": {"run_s": 1e400}}, {"00_lesson": {}}, {"00_lesson": 60}, {"00_lesson": [60]},
], ids=["list", "string", "number", "null", "string-run_s", "bool-run_s", "negative-run_s", "infinite-run_s",
        "no-run_s", "number-entry", "list-entry"])
def test_a_record_that_is_not_an_object_of_runs_is_one_line(project, capsys, record):
    (project / "build_record.json").write_text(json.dumps(record))
    assert "build_record.json" in refused(capsys, build.main, seconds=20, argv=["--table"])


@pytest.mark.parametrize("cells", [[], [""], ["# 00"], ["# 00 "], ["#"], ["\n# 00 A title"]],
                         ids=["no-cells", "empty-cell", "number-only", "number-and-space", "hash-only", "blank-line"])
def test_a_notebook_without_a_title_is_one_line(project, capsys, cells):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(c) for c in cells])
    nbformat.write(nb, project / "00_lesson.ipynb")
    assert "00_lesson.py: no title" in refused(capsys, build.main, seconds=20, argv=["--table"])


@pytest.mark.parametrize("text", ["[1, 2]", '"x"', "{}", '{"nbformat": 4}', "not json",
                                  json.dumps({"nbformat": 4, "nbformat_minor": "5", "cells": [], "metadata": {}})],
                         ids=["list", "string", "empty-object", "no-cells", "not-json", "string-minor"])
def test_a_notebook_that_is_not_one_is_one_line(project, capsys, text):
    (project / "00_lesson.ipynb").write_text(text)
    assert "00_lesson.ipynb" in refused(capsys, build.main, seconds=20, argv=["--table"])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("name", ["build_record.json", "00_lesson.ipynb"])
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_fifo_or_dev_zero_is_refused_by_kind(project, capsys, name, kind):
    """A FIFO would block the read until a writer comes (forever), /dev/zero would be read until memory ends."""
    path = project / name
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.symlink_to("/dev/zero")
    assert f"{path}: not a regular file" in refused(capsys, build.main, seconds=20, argv=["--table"])


# ----------------------------------------------------------------------------------------------------------
# The build, before a kernel starts

@pytest.mark.parametrize("tags", ['[{"a":1}]', '["x",1]', '["a,b"]', '["x","x"]', "[x]"])
def test_cell_tags_that_are_not_strings_are_one_line(tmp_path, capsys, tags):
    source = tmp_path / "nb.py"
    source.write_text(f"# %% tags={tags}\nx = 1\n")
    err = refused(capsys, build.main, seconds=20, argv=[str(source), "--no-execute"])
    assert f"{source}:1: cell tags" in err and not source.with_suffix(".ipynb").exists()


@pytest.mark.parametrize("text", ["", "\n\n"], ids=["empty", "blank"])
def test_a_source_without_cells_is_one_line(tmp_path, capsys, text):
    source = tmp_path / "nb.py"
    source.write_text(text)
    assert str(source) in refused(capsys, build.main, seconds=20, argv=[str(source), "--tiny"])


def test_a_notebook_without_code_gets_no_figure_rules():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 00 Prose only")])
    with build.figure_rules(nb):
        assert [c.cell_type for c in nb.cells] == ["markdown"]


# ----------------------------------------------------------------------------------------------------------
# The build, in a kernel (slow tier: the kernel is a process)

def one_cell(tmp_path: Path, code: str) -> Path:
    source = tmp_path / "nb.py"
    source.write_text(f"# %%\n{code}\n")
    return source


@pytest.mark.slow
@pytest.mark.parametrize("code, message", [
    ("1 / 0", "nb.py: cell 0: ZeroDivisionError: division by zero; nothing written"),
    ("import os; os._exit(1)", "nb.py: the kernel died"),
], ids=["failing-cell", "dead-kernel"])
def test_a_cell_that_fails_or_kills_the_kernel_is_one_line(tmp_path, capsys, code, message):
    """In this process's main thread, as the command runs (nbclient sets its signal handlers there)."""
    source = one_cell(tmp_path, code)
    with pytest.raises(SystemExit) as e:
        build.main([str(source), "--tiny", "--timeout", "60"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert sorted(os.listdir(tmp_path)) == ["nb.py"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, id="ctrl-c"),       # SIGTERM with --runheavy
                                 pytest.param(signal.SIGTERM, id="sigterm", marks=pytest.mark.heavy)])
def test_an_interrupted_cell_is_one_line_and_stops_the_kernel(tmp_path, sig):
    started = tmp_path / "kernel.pid"
    code = f"import os, pathlib, time\npathlib.Path({str(started)!r}).write_text(str(os.getpid()))\ntime.sleep(120)"
    source = one_cell(tmp_path, code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p))
    proc = subprocess.Popen([sys.executable, str(ROOT / "notebooks" / "build.py"), str(source), "--tiny"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kernel = None
    try:
        deadline = time.monotonic() + 120
        while not (started.exists() and started.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        kernel = int(started.read_text())
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and err == "error: interrupted\n", (proc.returncode, err[-3000:])
        deadline = time.monotonic() + 20
        while alive(kernel) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(kernel), "the kernel was left running"
    finally:
        proc.kill()
        if kernel is not None and alive(kernel):
            os.kill(kernel, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Process ``pid`` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
