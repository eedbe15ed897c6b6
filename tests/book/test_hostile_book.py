"""
Hostile inputs to the book's build (``python book/build.py``): it writes nothing but ``--out`` (not myst-nb's
``jupyter_execute`` beside it, not a temporary file, never into the bundled checkpoints), shows a notebook's
HTML and JavaScript outputs as text rather than running them, refuses a page that is a FIFO or a device
before reading it, and a failure, a full disk or Ctrl-C leaves nothing behind: ``--out`` as it was, one line.

A small book (a home page and one notebook) is built from a temporary source folder
(``build.main(argv, source=...)``). The refusals that come before Sphinx starts run in this process (the fast
tier); the builds, Ctrl-C and a full disk run in subprocesses (the slow tier, ``--runslow``). The tests that
need the book's extra (``pip install -e ".[book]" && npm ci --prefix book``) skip without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests import commands

SECONDS = 60          # a refusal comes at once; a page that hangs the build fails the test instead
ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("book_build_hostile", ROOT / "book" / "build.py")
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)

needs_the_book = pytest.mark.skipif(bool(build.missing()), reason="the book's tests need "
                                    + " and ".join(build.missing() or ["nothing"]))

# A notebook output of each kind a browser would run, and the markers that would show it ran.
PLANTED = [
    {"output_type": "display_data", "metadata": {},
     "data": {"text/html": ['<b>table</b><script src="https://evil.example/steal.js"></script>',
                            "<script>window.plantedInline = 1</script>"]}},
    {"output_type": "display_data", "metadata": {}, "data": {"application/javascript": ["window.plantedJs = 1"]}},
    {"output_type": "execute_result", "execution_count": 1, "metadata": {}, "data": {"text/plain": ["2"]}},
]
MARKERS = ("evil.example", "plantedInline", "plantedJs")


def tiny_book(source: Path, outputs: list | None = None) -> Path:
    """A book of two pages under ``source`` (laid out as the repository is: book/index.md and a lesson)."""
    (source / "book").mkdir(parents=True)
    (source / "notebooks").mkdir()
    (source / "book" / "index.md").write_text("# Tiny\n\n```{toctree}\n../notebooks/00_tiny\n```\n")
    notebook = {"cells": [{"cell_type": "markdown", "id": "a", "metadata": {}, "source": ["# A lesson\n", "$x^2$"]},
                          {"cell_type": "code", "id": "b", "metadata": {}, "execution_count": 1,
                           "source": ["1 + 1"], "outputs": outputs if outputs is not None else PLANTED}],
                "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
                "nbformat": 4, "nbformat_minor": 5}
    (source / "notebooks" / "00_tiny.ipynb").write_text(json.dumps(notebook))
    return source


SCRIPT = """
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("book_build", sys.argv[1])
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
build.main(sys.argv[3:], source=Path(sys.argv[2]))
"""


def command(source: Path, *argv: str) -> list[str]:
    """``python book/build.py ARGV`` with the pages of ``source``."""
    return [sys.executable, "-c", SCRIPT, str(ROOT / "book" / "build.py"), str(source), *argv]


def run_build(source: Path, *argv: str, tmpdir: Path, timeout: float = 240, **kwargs):
    tmpdir.mkdir(exist_ok=True)
    return subprocess.run(command(source, *argv), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TMPDIR": str(tmpdir)}, **kwargs)


def one_error_line(done) -> str:
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.endswith("\n") and done.stderr.splitlines()[-1].startswith("error: "), done.stderr[-3000:]
    return done.stderr.splitlines()[-1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny book built into DIR/site, where DIR already holds a user's ``jupyter_execute/`` (the name
    myst-nb writes beside the site), with TMPDIR an empty folder of its own."""
    if build.missing():
        pytest.skip("the book's tests need " + " and ".join(build.missing()))
    top = tmp_path_factory.mktemp("built")
    source = tiny_book(top / "source")
    folder = top / "dir"
    mine = folder / "jupyter_execute" / "notebooks" / "00_tiny.ipynb"
    mine.parent.mkdir(parents=True)
    mine.write_text("the user's own file")
    done = run_build(source, "--out", str(folder / "site"), tmpdir=top / "tmp")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return {"top": top, "source": source, "dir": folder, "done": done, "mine": mine}


# -- 1. nothing written outside what the user named -----------------------------------------------------------

@pytest.mark.slow
@needs_the_book
def test_the_build_writes_the_site_and_nothing_beside_it(built):
    """myst-nb's jupyter_execute/ went beside --out, over a user's files there: now the site alone is written,
    and TMPDIR is left as it was."""
    assert sorted(p.name for p in built["dir"].iterdir()) == ["jupyter_execute", "site"]
    assert [p.relative_to(built["dir"]).as_posix() for p in (built["dir"] / "jupyter_execute").rglob("*")] == \
        ["jupyter_execute/notebooks", "jupyter_execute/notebooks/00_tiny.ipynb"]
    assert built["mine"].read_text() == "the user's own file"
    assert (built["dir"] / "site" / "notebooks" / "00_tiny.html").is_file()
    assert build.is_a_book(built["dir"] / "site")
    assert list((built["top"] / "tmp").iterdir()) == []


def bundled_spellings(tmp_path) -> list[str]:
    link = tmp_path / "link"
    link.symlink_to(build.ROOT / "nanollm" / "checkpoints")
    return ["nanollm/checkpoints/site", str(build.ROOT / "nanollm" / "checkpoints" / "new" / "site"),
            "nanollm/../nanollm/checkpoints/./site", str(link / "site")]


def test_out_in_the_bundled_checkpoints_is_refused(tmp_path, capsys, monkeypatch):
    """--out nanollm/checkpoints/site wrote the site (and jupyter_execute/) into the bundled checkpoints."""
    before = sorted(os.listdir(build.ROOT / "nanollm" / "checkpoints"))
    monkeypatch.setattr(build, "missing", lambda: ["nothing: a build past the checks stops here"])   # never builds
    for out in bundled_spellings(tmp_path):
        with pytest.raises(SystemExit) as stop:
            build.main(["--out", out])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and "bundled checkpoints" in err, (out, err)
    assert sorted(os.listdir(build.ROOT / "nanollm" / "checkpoints")) == before


# -- 2. data shown as data ------------------------------------------------------------------------------------

@pytest.mark.slow
@needs_the_book
def test_html_and_javascript_outputs_are_shown_as_text_and_the_build_says_so(built):
    page = (built["dir"] / "site" / "notebooks" / "00_tiny.html").read_text()
    scripts = [s for s in page.split("<script")[1:] if any(m in s.split("</script>")[0] for m in MARKERS)]
    assert scripts == []
    assert "window.plantedJs = 1" in page                    # the JavaScript is there, as text
    lines = [line for line in built["done"].stdout.splitlines() if line.startswith("book:")]
    assert lines == ["book: notebooks/00_tiny.ipynb: 2 output(s) a browser would run "
                     "(application/javascript, text/html) shown as text instead"], built["done"].stdout


def test_only_text_and_pictures_are_left_in_a_notebook_s_outputs():
    """Every output type but text and pictures is dropped; an output left with nothing shows it as text."""
    pytest.importorskip("nbformat", reason="the book's reader needs nbformat (pip install -e \".[book]\")")
    import reader  # book/reader.py (build.py put book/ on the path)
    notebook = reader.parse(json.dumps({"cells": [
        {"cell_type": "code", "id": "c", "metadata": {}, "execution_count": 1, "source": [], "outputs": [
            *PLANTED,
            {"output_type": "display_data", "metadata": {}, "data": {"text/markdown": ["<script>x()</script>"],
                                                                     "image/png": "iVBORw0KGgo="}},
            {"output_type": "display_data", "metadata": {},
             "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "</script><script>x()"}}}]}],
        "metadata": {"widgets": {"application/vnd.jupyter.widget-state+json": {"state": {}}}},
        "nbformat": 4, "nbformat_minor": 5}), "x.ipynb")
    dropped = reader.show_as_data(notebook)
    assert dropped == ["text/html", "application/javascript", "text/markdown",
                       "application/vnd.jupyter.widget-view+json", "widget state"]
    outputs = notebook.cells[0].outputs
    assert [sorted(o.data) for o in outputs] == [["text/plain"]] * 3 + [["image/png"], ["text/plain"]]
    assert "evil.example" in outputs[0].data["text/plain"] and "widgets" not in notebook.metadata


# -- 3. special files, and a page nbformat cannot read (checked before Sphinx starts: in this process) --------

SPECIAL = {"fifo": lambda path: os.mkfifo(path), "dev-zero": lambda path: path.symlink_to("/dev/zero"),
           "dev-null": lambda path: path.symlink_to("/dev/null")}


def refused(capsys, source: Path, out: Path) -> str:
    """The one ``error:`` line of a build of ``source`` refused within SECONDS (a hang fails the test)."""
    return commands.refused(capsys, build.main, ["--out", str(out)], source=source, seconds=SECONDS).strip()


@needs_the_book
@pytest.mark.parametrize("kind, page", [("fifo", "notebooks/01_x.ipynb"), ("dev-zero", "notebooks/01_x.ipynb"),
                                        ("dev-null", "book/index.md")])
def test_a_page_that_is_a_special_file_is_refused_by_kind(tmp_path, capsys, kind, page):
    """A FIFO page hung the build (182 s); one linked to /dev/zero allocated about 7 GB."""
    source = tiny_book(tmp_path / "source", outputs=[])
    (source / page).unlink(missing_ok=True)
    SPECIAL[kind](source / page)
    assert refused(capsys, source, tmp_path / "dir" / "site") == \
        f"error: {source / page}: not a regular file (a book page must be one)"
    assert not (tmp_path / "dir").exists()


@needs_the_book
def test_a_notebook_nbformat_cannot_read_is_one_line_and_leaves_no_log(tmp_path, capsys, monkeypatch):
    """A malformed notebook ended in Sphinx's report, its traceback saved as sphinx-err-*.log in TMPDIR."""
    source = tiny_book(tmp_path / "source")
    (source / "notebooks" / "01_bad.ipynb").write_text('{"cells": "x"')
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    assert refused(capsys, source, tmp_path / "dir" / "site").startswith(
        f"error: {source / 'notebooks' / '01_bad.ipynb'}: not a notebook nbformat can read (")
    assert not (tmp_path / "dir").exists() and list((tmp_path / "tmp").iterdir()) == []


# -- 4. no leftovers: Ctrl-C, a full disk (in a subprocess) ---------------------------------------------------

@pytest.mark.slow
@needs_the_book
@pytest.mark.parametrize("how", [pytest.param(signal.SIGINT, id="ctrl-c"),       # SIGTERM with --runheavy
                                 pytest.param(signal.SIGTERM, id="sigterm", marks=pytest.mark.heavy)])
def test_an_interrupted_build_leaves_the_earlier_book_as_it_was(built, tmp_path, how):
    """Ctrl-C left a half-written --out (no .buildinfo yet) that the next build refused to write over."""
    folder = tmp_path / "dir"
    shutil.copytree(built["dir"] / "site", folder / "site")
    before = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))
    (tmp_path / "tmp").mkdir()
    with subprocess.Popen(command(built["source"], "--out", str(folder / "site")), cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env={**os.environ, "TMPDIR": str(tmp_path / "tmp")}) as job:
        deadline = time.monotonic() + 180
        while not list(folder.glob(".book-build-*/site")) and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)                                    # until Sphinx has started writing
        job.send_signal(how)
        out, err = job.communicate(timeout=60)
    assert job.returncode == 130 and err == "error: interrupted\n", (out, err[-3000:])
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == before
    assert build.is_a_book(folder / "site") and list((tmp_path / "tmp").iterdir()) == []


def full_disk(limit: int):
    """In the child: writes past ``limit`` bytes of one file fail with EFBIG, as on a full disk."""
    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return limited


@pytest.mark.slow
@needs_the_book
def test_a_full_disk_leaves_nothing_behind(built, tmp_path):
    """On a full disk the build left site/ and jupyter_execute/ behind."""
    done = run_build(built["source"], "--out", str(tmp_path / "dir" / "site"), tmpdir=tmp_path / "tmp",
                     preexec_fn=full_disk(64 << 10))
    one_error_line(done)
    assert not (tmp_path / "dir").exists() and list((tmp_path / "tmp").iterdir()) == []
