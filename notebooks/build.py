"""
Build the notebooks: convert each percent source, the lessons ``notebooks/NN_*.py`` and their labs
``notebooks/labs/NN_*.py``, into a ``.ipynb`` and execute it.

The ``.py`` files are the source of truth (they diff and lint like code); the ``.ipynb`` files are
generated from them, executed, and committed with their outputs. The format is jupytext's ``py:percent``
(the cell syntax of Triton's tutorials), read here with a few lines of code so jupytext is not a
dependency::

    # %% [markdown]
    # # A title
    # Markdown lines are comments: "# " is stripped.

    # %%
    x = 1 + 1          # a code cell runs until the next "# %%" line

    # %% tags=["raises-exception"]
    1 / 0              # optional cell tags, as JSON, on the marker line

Usage::

    python notebooks/build.py                       # every lesson and lab, executed normally
    python notebooks/build.py notebooks/00_nanollm_kv_cache.py --tiny   # quick check in tiny mode (writes nothing)
    python notebooks/build.py --no-execute           # convert only (no outputs)
    python notebooks/build.py notebooks/04_perturbation_selection.py --prose-only   # new markdown, same run

``--prose-only`` takes the markdown cells of the ``.py`` into the committed ``.ipynb`` and keeps its code cells
with their outputs, without running anything: for an edit of the prose of a notebook whose run takes minutes.
It refuses when a code cell differs (its source, its tags, or the number and order of code cells), since the
outputs would then no longer be the code's.

A lesson aims at an hour of work for a reader new to the topic. Its minutes are measured, not computed: cold
readings of the executed notebook (a reader works through it and its exercises and notes the minutes), kept in
``readings.json`` with the notebook's size when it was read (``size_minutes``, a formula that only serves to
notice a notebook that grew since; ``tests/notebooks/test_teaching.py`` asks for new readings then; record them
with ``--reading``). The lesson holds the paper's question and equation, the method
built by hand and checked against the library, a toy picture, the method on the real model, exercises. The
research behind a lesson (variants, ablations, audits of the paper's claims) lives in its lab,
``labs/NN_*.py``, built and tested the same way. An
exercise's code cell that holds its answer (a ``# BEGIN SOLUTION`` region past the ``## Exercises`` heading)
is written collapsed, its code and its output (``metadata.jupyter.source_hidden`` and ``outputs_hidden``): a
reader sees the exercise, not its answer, until they open the cell; it still runs and checks itself. The
course's region markers stay in the ``.py`` (the student copy is cut from it) and become cell tags on the page
(``solution:cache:append``), so the lesson shows only its code.

Each ``.ipynb`` is written atomically (a temporary file, then renamed), and only after its notebook ran
without an error; tiny mode never writes, so the committed notebooks keep their full-size outputs.

Whatever stops a build or ``--table`` ends in one ``error:`` line naming the file: a cell that raises (the cell
and its error), a cell past ``--timeout``, a kernel that dies, cell tags that are not a list of strings, a source
without cells, a committed notebook that is not a valid one or has no title, a ``build_record.json`` that is not
an object of runs with ``run_s`` seconds. Ctrl-C or SIGTERM stops the kernel and ends in ``error: interrupted``
(exit status 130). Every file is read through ``nanollm.io.files``: a FIFO or a link to ``/dev/zero`` is
refused before a byte is read. Any ``.py`` in the percent format can be built (``--tiny`` to run it without
writing); only the notebooks under ``notebooks/`` are noted in ``build_record.json``.

``tests/notebooks/test_notebooks.py`` uses ``read_percent`` to check that each committed ``.ipynb`` still has the
cells of its ``.py`` source, and ``execute`` to run it headlessly with ``NANOLLM_TINY=1``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from nanollm import cli
from nanollm.io import files

NOTEBOOKS = Path(__file__).resolve().parent
ROOT = NOTEBOOKS.parent
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
MARKER = re.compile(r"^# %%(?P<title>[^\[]*?)?\s*(?P<kind>\[markdown\])?\s*(?:tags=(?P<tags>\[.*\]))?\s*$")


LABS = NOTEBOOKS / "labs"
EXERCISES = "## Exercises"


def sources() -> list[Path]:
    """The notebook sources: the lessons ``notebooks/NN_*.py``, then their labs ``notebooks/labs/NN_*.py``."""
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py")) + sorted(LABS.glob("[0-9][0-9]_*.py"))


def lessons() -> list[Path]:
    """The lessons' sources, 00 to 07 (their minutes of work: ``readings.json``); the research lives in their labs."""
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def _uncomment(line: str) -> str:
    """A markdown line of the percent format: '# text' -> 'text', '#' -> ''."""
    if line.startswith("# "):
        return line[2:]
    return line[1:] if line.startswith("#") else line


def cell_tags(text: str | None, where: str) -> list[str]:
    """The tags of a cell marker's ``tags=[...]``: a JSON list of distinct strings without commas (what a
    notebook's cell tags may be); a ValueError naming ``where`` (file:line) otherwise."""
    if not text:
        return []
    try:
        tags = json.loads(text)
    except ValueError:
        tags = None
    if not (isinstance(tags, list) and all(isinstance(t, str) and t and "," not in t for t in tags)
            and len(set(tags)) == len(tags)):
        raise ValueError(f"{where}: cell tags must be a JSON list of distinct strings without commas, "
                         f'like tags=["raises-exception"], not {text[:80]}')
    return tags


SOLUTION_LINE = re.compile(r"^[ \t]*# (?:BEGIN SOLUTION \[(?P<id>[a-z0-9_:]+)\].*|END SOLUTION)\s*$")
SOLUTION_TAG = "solution:"            # a page cell that holds a region of the course: "solution:cache:append"


def on_the_page(cell: nbformat.NotebookNode) -> None:
    """A code cell as the reader sees it: the course's region markers (``# BEGIN SOLUTION [cache:append] hint``,
    ``# END SOLUTION``) are taken out of its code and become cell tags (``solution:cache:append``), out of the
    reader's way, as ``needs:`` tags are. The student copy is cut from the ``.py``, which keeps the markers."""
    kept, ids = [], []
    for line in cell.source.splitlines():
        m = SOLUTION_LINE.match(line)
        if m is None:
            kept.append(line)
        elif m["id"]:
            ids.append(m["id"])
    if ids:
        cell.source = "\n".join(kept)
        cell.metadata["tags"] = [*cell.metadata.get("tags", []), *dict.fromkeys(SOLUTION_TAG + i for i in ids)]


def read_percent(path: str | Path, page: bool = True) -> nbformat.NotebookNode:
    """Parse a ``py:percent`` file into a notebook (no outputs). Cell ids are deterministic: cell-0, cell-1, ...

    ``page``: the cells as the committed ``.ipynb`` shows them (``on_the_page``); ``page=False`` keeps the
    course's region markers in the code, for the course's tools that cut a student copy.

    The file is read through ``nanollm.io.files`` (a FIFO or a link to /dev/zero is refused before a byte is
    read); a file without cells, or with a marker or tags that do not parse, is a ValueError naming the line."""
    lines = files.read_text(path, "notebook source").splitlines()
    cells: list[tuple[str, list[str], list[str]]] = []     # (kind, lines, tags)
    for n, line in enumerate(lines, 1):
        if line.startswith("# %%"):
            m = MARKER.match(line)
            if m is None:
                raise ValueError(f"{path}:{n}: cannot parse cell marker {line!r}")
            cells.append(("markdown" if m["kind"] else "code", [], cell_tags(m["tags"], f"{path}:{n}")))
        elif cells:
            cells[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"{path}:{n}: text before the first '# %%' cell marker")
    if not cells:
        raise ValueError(f"{path}: no cells: a notebook source has '# %%' cell markers (py:percent format)")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    exercises = False                                      # past the '## Exercises' heading
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, body, tags) in enumerate(cells):
        while body and not body[-1].strip():               # blank lines separate cells; not content
            body.pop()
        while body and not body[0].strip():
            body.pop(0)
        if kind == "markdown":
            cell = nbformat.v4.new_markdown_cell("\n".join(_uncomment(line) for line in body))
        else:
            cell = nbformat.v4.new_code_cell("\n".join(body))
        cell.id = f"cell-{i}"
        if tags:
            cell.metadata["tags"] = tags
        if kind == "markdown" and any(line.strip() == EXERCISES for line in cell.source.splitlines()):
            exercises = True
        elif kind == "markdown" and any(line.startswith("## ") for line in cell.source.splitlines()):
            exercises = False
        if kind == "code" and exercises and "# BEGIN SOLUTION" in cell.source:
            # an exercise's answer: its code and what it prints stay collapsed until the reader opens them
            cell.metadata["jupyter"] = {"source_hidden": True, "outputs_hidden": True}
        if kind == "code" and page:
            on_the_page(cell)
        nb.cells.append(cell)
    return nb


WORDS_PER_MINUTE, CODE_LINES_PER_MINUTE, MINUTES_PER_EXERCISE = 180, 10, 5
EXERCISE = re.compile(r"^### Exercise \d", flags=re.M)


def size_minutes(nb: nbformat.NotebookNode) -> float:
    """A notebook's size in nominal minutes: its markdown words at 180 a minute, its non-blank lines of code at 10
    a minute, and 5 minutes for each exercise (a ``### Exercise N`` heading). Cold readings took about 1.5 times
    this; it is not the README's "work, min" (``readings.json`` is), only a yardstick for a notebook's growth."""
    words = sum(len(cell.source.split()) for cell in nb.cells if cell.cell_type == "markdown")
    code = sum(1 for cell in nb.cells if cell.cell_type == "code" for line in cell.source.splitlines() if line.strip())
    exercises = sum(len(EXERCISE.findall(cell.source)) for cell in nb.cells if cell.cell_type == "markdown")
    return words / WORDS_PER_MINUTE + code / CODE_LINES_PER_MINUTE + MINUTES_PER_EXERCISE * exercises


def kernel_env(tiny: bool) -> dict[str, str]:
    """The kernel's environment: the repo root importable (nanollm, methods), and the tiny switch."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["NANOLLM_TINY"] = "1" if tiny else "0"
    return env


def last_words(kernel_log) -> str:
    """The last line a dead kernel wrote to its stderr (``kernel_log``), leaving out the kernel application's own
    log lines ("[IPKernelApp] WARNING | ..."): what a crash printed, or ""."""
    kernel_log.seek(0)
    lines = [line.strip() for line in kernel_log.read().decode(errors="replace").splitlines()]
    said = [line for line in lines if line and not line.startswith("[IPKernelApp]")]
    return said[-1][:200] if said else ""


def execute(nb: nbformat.NotebookNode, tiny: bool = False, timeout: int = 600,
            folder: Path = NOTEBOOKS) -> nbformat.NotebookNode:
    """Run every cell in a fresh ``python3`` kernel started in ``folder`` (the notebook's own, as Jupyter
    does); raises on the first error (nbclient's ``CellExecutionError``, ``DeadKernelError``, ...).

    ``timeout`` is per cell, in seconds. Returns the notebook with its outputs (also filled in place).

    Ctrl-C or SIGTERM is a ``KeyboardInterrupt``, as anywhere else. nbclient catches both signals itself while
    it runs: it stops the kernel (so the running cell fails as if the kernel died, and its second cleanup then
    trips an assertion), and removes its handlers afterwards, leaving SIGTERM's default; the handlers that were
    set before are put back here. The kernel's own log (its stderr: a warning on every start, a traceback
    when it is stopped mid-cell) goes to a temporary file, whose last words a dead kernel's error quotes.
    """
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(folder)}})
    on_main = threading.current_thread() is threading.main_thread()     # where signal handlers can be set
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if on_main else {}
    with tempfile.TemporaryFile() as kernel_log:
        try:
            client.execute(env=kernel_env(tiny), stderr=kernel_log)
        except DeadKernelError:
            if not stopped_by_a_signal(client):
                words = last_words(kernel_log)
                raise DeadKernelError("the kernel died" + (f" ({words})" if words else "")) from None
        except Exception:
            if not stopped_by_a_signal(client):
                raise
        finally:
            for s, handler in handlers.items():
                if handler is not None:
                    signal.signal(s, handler)
    if stopped_by_a_signal(client):                      # whatever the run ended in, or if it ended well
        raise KeyboardInterrupt
    return nb


def stopped_by_a_signal(client: NotebookClient) -> bool:
    """Whether nbclient's own handler of Ctrl-C or SIGTERM ran: it keeps the kernel's shutdown it started as
    ``_async_cleanup_kernel_future`` (a private name, as of nbclient 0.11: the Ctrl-C tests of
    ``tests/notebooks/test_hostile_build.py`` fail if it changes)."""
    return getattr(client, "_async_cleanup_kernel_future", None) is not None


def error_outputs(nb: nbformat.NotebookNode) -> list[str]:
    """'cell i: Name: message' for every error output stored in the notebook."""
    return [f"cell {i}: {out.get('ename')}: {out.get('evalue')}"
            for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            for out in cell.get("outputs", []) if out.get("output_type") == "error"]


RECORD = NOTEBOOKS / "build_record.json"


def name_of(path: Path) -> str:
    """'04_perturbation_selection' for a lesson, 'labs/04_critical_kv_readings' for a lab."""
    return str(path.resolve().relative_to(NOTEBOOKS).with_suffix(""))


def read_notebook(path: Path) -> nbformat.NotebookNode:
    """A committed ``.ipynb``, read through ``nanollm.io.files`` (a FIFO or a link to /dev/zero is refused before a
    byte is read) and checked against nbformat's schema: a ValueError naming the file if it is not a valid
    version-4 notebook."""
    data = files.read_json(path, "notebook")
    if not (isinstance(data, dict) and data.get("nbformat") == 4 and type(data.get("nbformat_minor")) is int):
        raise ValueError(f'{path}: not a Jupyter notebook of version 4 (a JSON object with "nbformat": 4 and '
                         'an integer "nbformat_minor")')
    try:
        nbformat.validate(nbformat.from_dict(data))
    except nbformat.ValidationError as e:
        raise ValueError(f"{path}: not a valid notebook: {e.message[:200]}") from None
    return nbformat.reads(json.dumps(data), as_version=4)


def read_runs() -> dict:
    """``build_record.json``'s entries ({} where there is none), read through ``nanollm.io.files`` and checked:
    a JSON object whose every value is an object with ``run_s``, a number of seconds >= 0. A ValueError naming
    the file and the entry otherwise."""
    if not RECORD.exists():
        return {}
    runs = files.read_json(RECORD, "build record")
    if not isinstance(runs, dict):
        raise ValueError(f"{RECORD}: holds a JSON {type(runs).__name__}, not an object of the notebooks' runs")
    for name, run in runs.items():
        seconds = run.get("run_s") if isinstance(run, dict) else None
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
            raise ValueError(f"{RECORD}: the entry {name!r} is not an object with run_s, a number of seconds >= 0")
    return runs


def record(path: Path, seconds: float) -> None:
    """Note a normal run of ``path`` in ``build_record.json``: seconds, date, the machine's load (1-minute
    average at the end: a run beside other work takes longer) and cores. The README's table is made from it.
    Only the project's own notebooks (those under ``notebooks/``) are noted."""
    if not path.resolve().is_relative_to(NOTEBOOKS):
        return
    runs = read_runs()
    runs[name_of(path)] = {"run_s": round(seconds, 1), "date": time.strftime("%Y-%m-%d"),
                           "load": round(os.getloadavg()[0], 1), "cores": os.cpu_count()}
    files.atomic_write_text(RECORD, json.dumps(dict(sorted(runs.items())), indent=1) + "\n")


def title_of(nb: nbformat.NotebookNode, path: Path) -> str:
    """A notebook's title for the table: its first cell's heading, ``# NN Title``, without the number; a
    ValueError naming the notebook where there is none."""
    heading = nb.cells[0].source.splitlines()[0] if nb.cells and nb.cells[0].source.strip() else ""
    number_and_title = heading.lstrip("# ").split(" ", 1)
    if len(number_and_title) < 2 or not number_and_title[1].strip():
        raise ValueError(f"{path}: no title: its first cell must begin with a heading '# NN Title'")
    return number_and_title[1]


READINGS = NOTEBOOKS / "readings.json"


def read_readings() -> dict:
    """``readings.json``: per notebook, ``minutes`` (a list: each cold reading's minutes of work, exercises
    included), ``size`` (``size_minutes`` of the notebook that was read) and ``date``. A ValueError naming the
    file and the entry where it is not that."""
    data = files.read_json(READINGS, "readings") if READINGS.exists() else {}
    if not isinstance(data, dict):
        raise ValueError(f"{READINGS}: an object of notebooks and their readings, not {type(data).__name__}")
    for name, entry in data.items():
        ok = isinstance(entry, dict) and isinstance(entry.get("minutes"), list) and entry["minutes"] and all(
            isinstance(m, (int, float)) and m > 0 for m in entry["minutes"]) and isinstance(
            entry.get("size"), (int, float))
        if not ok:
            raise ValueError(f"{READINGS}: {name!r} needs minutes (a list of positive numbers) and size (a number)")
    return data


def record_reading(path: Path, minutes: list[float]) -> str:
    """Write ``path``'s cold readings into ``readings.json`` (atomically), with the committed notebook's size."""
    data = read_readings()
    size = size_minutes(read_notebook(path.with_suffix(".ipynb")))
    data[name_of(path)] = {"minutes": [round(m, 1) for m in minutes], "size": round(size, 1),
                           "date": time.strftime("%Y-%m-%d")}
    files.atomic_write_text(READINGS, json.dumps(dict(sorted(data.items())), indent=1) + "\n")
    return f"{name_of(path)}: {work(data[name_of(path)])} minutes (size {size:.1f}) in {READINGS.name}"


def median_minutes(entry: dict) -> int:
    """The median of a notebook's readings, rounded half up to whole minutes."""
    m = sorted(entry["minutes"])
    return math.floor((m[(len(m) - 1) // 2] + m[len(m) // 2]) / 2 + 0.5)


def work(entry: dict | None) -> str:
    """A table cell: the median of the readings, their range and how many ("55 (48-60, 3)"); "not read"."""
    if not entry:
        return "not read"
    m = sorted(entry["minutes"])
    return f"{median_minutes(entry)}" + (f" ({m[0]:.0f}-{m[-1]:.0f}, {len(m)})" if len(m) > 1 else " (1)")


def table() -> str:
    """The README's notebook table: each lesson and lab, its title, the minutes of work its cold readings took
    (``readings.json``: median, range, number of readings) and the minutes of its last normal run
    (``build_record.json``); then a line with the medians added up, the lessons' and the labs'."""
    runs, readings = read_runs(), read_readings()
    rows = ["| notebook | what it is | work, min (range, readings) | normal run, min |", "|---|---|---|---|"]
    total, unread = {"lessons": 0, "labs": 0}, {"lessons": 0, "labs": 0}
    for path in sources():
        nb = read_notebook(path.with_suffix(".ipynb"))
        run = runs.get(name_of(path))
        minutes = f"{run['run_s'] / 60:.1f}" if run else "not recorded"
        entry = readings.get(name_of(path))
        rows.append(f"| [`{name_of(path)}`](notebooks/{name_of(path)}.ipynb) | {title_of(nb, path)} | "
                    f"{work(entry)} | {minutes} |")
        kind = "labs" if name_of(path).startswith("labs/") else "lessons"
        total[kind] += median_minutes(entry) if entry else 0
        unread[kind] += not entry
    said = {kind: f"{total[kind]} minutes ({total[kind] / 60:.1f} hours"
                  + (f"; {unread[kind]} not read" if unread[kind] else "") + ")" for kind in total}
    return "\n".join(rows) + (f"\n\nWork in all, the medians added up: the lessons {said['lessons']}, "
                              f"the labs {said['labs']}.")


FIGURE_RULES = NOTEBOOKS.parent / "tests" / "notebooks" / "figure_rules.py"


@contextlib.contextmanager
def figure_rules(nb: nbformat.NotebookNode):
    """Run ``nb`` with the figure rules the tests hold it to (titles, labels, intervals, at most five series a
    panel: ``tests/notebooks/figure_rules.py``), so a normal build fails on a figure that breaks one, as the
    quick-mode test does. The two cells it adds are gone afterwards, and the execution counts as if they had
    never been."""
    first = next((i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"), None)
    if not FIGURE_RULES.exists() or first is None:        # a copy without the tests; a notebook without code
        yield
        return
    nb.cells.insert(first + 1, nbformat.v4.new_code_cell(FIGURE_RULES.read_text()))
    nb.cells.append(nbformat.v4.new_code_cell("assert not _FIGURE_PROBLEMS, _FIGURE_PROBLEMS"))
    try:
        yield
    finally:
        del nb.cells[-1], nb.cells[first + 1]
        for count, cell in enumerate((c for c in nb.cells if c.cell_type == "code"), start=1):
            if cell.get("execution_count") is not None:
                cell.execution_count = count
                for out in cell.outputs:
                    if "execution_count" in out:
                        out.execution_count = count


def failure(nb: nbformat.NotebookNode, error: Exception, timeout: int) -> str:
    """What stopped a run, in a line: the cell that raised (its error, as stored in its outputs), the cell that
    ran out of time, or the kernel's death."""
    if isinstance(error, CellExecutionError):
        raised = [line for line in error_outputs(nb) if line.endswith(f": {error.ename}: {error.evalue}")]
        if not raised:                                 # the figure rules' cells, gone again: a figure broke them
            return f"a figure breaks the figure rules: {error.evalue}"[:300]
        return raised[-1][:300]                        # an earlier one may be a "raises-exception" cell's
    if isinstance(error, CellTimeoutError):
        return f"a cell ran longer than --timeout {timeout} s"
    return f"{error}, so the notebook stopped (a cell ended Python: os._exit, a crash, or memory ran out)"


def build(path: str | Path, run: bool = True, tiny: bool = False, timeout: int = 600) -> Path | None:
    """Convert ``path`` (.py) to the .ipynb beside it, executing it unless ``run`` is False.

    ``tiny``: execute in tiny mode as a check only; nothing is written and None is returned.
    """
    path = Path(path)
    nb = read_percent(path)
    if run:
        t0 = time.perf_counter()
        try:
            with figure_rules(nb):
                execute(nb, tiny=tiny, timeout=timeout, folder=path.resolve().parent)
        except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
            raise ValueError(f"{path}: {failure(nb, e, timeout)}; nothing written") from None
        seconds = time.perf_counter() - t0
        print(f"{path.name}: executed{' (tiny mode)' if tiny else ''} in {seconds:.1f} s")
    if tiny:
        return None
    out = path.with_suffix(".ipynb")
    nbformat.validate(nb)
    text = nbformat.writes(nb)
    files.atomic_write_text(out, text if text.endswith("\n") else text + "\n")    # as nbformat.write does
    if run:
        record(path, seconds)
    return out


def code_cells(nb: nbformat.NotebookNode) -> list[tuple[str, list]]:
    """(source, tags) of each code cell, in order: what the outputs of a run depend on."""
    return [(cell.source, list(cell.metadata.get("tags", []))) for cell in nb.cells if cell.cell_type == "code"]


def prose_only(path: str | Path) -> Path:
    """The committed ``.ipynb`` beside ``path`` rewritten with the markdown of ``path`` and its own code cells,
    outputs included; nothing runs. A ValueError if the code cells differ from the source's."""
    path = Path(path)
    out = path.with_suffix(".ipynb")
    nb, committed = read_percent(path), read_notebook(out)
    if code_cells(nb) != code_cells(committed):
        changed = next((i for i, (a, b) in enumerate(zip(code_cells(nb), code_cells(committed))) if a != b),
                       min(len(code_cells(nb)), len(code_cells(committed))))
        raise ValueError(f"{out}: code cell {changed} (counting code cells from 0) differs from {path.name}'s: "
                         "its outputs would not be the code's; run it (build.py without --prose-only)")
    ran = iter(cell for cell in committed.cells if cell.cell_type == "code")
    for cell in nb.cells:
        if cell.cell_type == "code":
            old = next(ran)
            cell.outputs, cell.execution_count = old.outputs, old.execution_count
    nb.metadata = committed.metadata
    nbformat.validate(nb)
    text = nbformat.writes(nb)
    files.atomic_write_text(out, text if text.endswith("\n") else text + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = cli.ArgumentParser(prog="python notebooks/build.py",
                            description="Convert notebooks/*.py (py:percent) to .ipynb and execute them.")
    ap.add_argument("paths", nargs="*",
                    help="notebook sources, .py files in py:percent format (default: every lesson "
                         "notebooks/NN_*.py, then every lab notebooks/labs/NN_*.py)")
    ap.add_argument("--no-execute", action="store_true", help="convert only; the .ipynb gets no outputs")
    ap.add_argument("--tiny", action="store_true",
                    help="execute with NANOLLM_TINY=1 as a quick check; nothing is written (commit notebooks "
                         "built without it)")
    ap.add_argument("--prose-only", action="store_true",
                    help="take the markdown of each .py into its committed .ipynb, keeping the code cells and "
                         "their outputs; runs nothing, and refuses if a code cell changed")
    ap.add_argument("--table", action="store_true",
                    help="print the README's notebook table (minutes of work from the cold readings in "
                         "notebooks/readings.json, minutes of the last normal run from notebooks/build_record.json) "
                         "and the line under it (the medians added up), and exit")
    ap.add_argument("--reading", type=float, nargs="+", metavar="MINUTES",
                    help="record cold readings of the one notebook named: each reading's minutes of work, "
                         "exercises included (written to notebooks/readings.json with the notebook's size; it "
                         "replaces that notebook's readings) and exit")
    ap.add_argument("--timeout", type=cli.positive_int, default=600,
                    help="per-cell timeout in seconds (default %(default)s)")
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        if args.table:
            print(table())
            return
        if args.reading:
            if len(args.paths) != 1 or not Path(args.paths[0]).with_suffix(".ipynb").is_file():
                cli.fail("--reading records the readings of one built notebook: name its .py source")
            if min(args.reading) <= 0:
                cli.fail(f"--reading: minutes must be positive, got {min(args.reading):g}")
            print(record_reading(Path(args.paths[0]), args.reading))
            return
        if args.tiny + args.no_execute + args.prose_only > 1:
            cli.fail("--tiny, --no-execute and --prose-only are three different builds: give one of them")
        paths = [Path(p) for p in args.paths] or sources()
        for path in paths:                    # every source parses before the first one runs
            if not path.is_file() or path.suffix != ".py" or path.resolve() == Path(__file__).resolve():
                cli.fail(f"{path}: not a notebook source (a .py file in py:percent format)")
            read_percent(path)
        if args.prose_only:                   # every notebook checked before the first one is written
            missing = [str(p.with_suffix(".ipynb")) for p in paths if not p.with_suffix(".ipynb").is_file()]
            if missing:
                cli.fail(f"--prose-only updates committed notebooks; none at {', '.join(missing)}")
            for path in paths:
                if code_cells(read_percent(path)) != code_cells(read_notebook(path.with_suffix(".ipynb"))):
                    prose_only(path)          # raises the one-line error naming the first changed cell
            for path in paths:
                print(f"wrote {prose_only(path)} (its outputs kept)")
            return
        if not (args.tiny or args.no_execute):
            read_runs()                       # a broken build_record.json is refused before the first run
        for path in paths:
            out = build(path, run=not args.no_execute, tiny=args.tiny, timeout=args.timeout)
            print(f"wrote {out}" if out else f"{path.name}: ran in tiny mode; nothing written")


if __name__ == "__main__":
    sys.exit(main())
