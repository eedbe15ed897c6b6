"""
Notebooks: each lesson ``notebooks/NN_*.ipynb`` and lab ``notebooks/labs/NN_*.ipynb`` runs headlessly in tiny
mode, and still matches its ``.py`` source.

The ``.py`` percent files are the source; ``notebooks/build.py`` generates and executes the ``.ipynb``.
These tests execute each committed notebook in a fresh ``python3`` kernel (nbclient + ipykernel) with
``NANOLLM_TINY=1`` and a per-cell timeout, and check that its cells were not edited apart from the source.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from experiments.evaluation.viz import QUICK_MODE
from tests.conftest import smollm2_missing
from tests.notebooks.test_exercises import probe_findings, with_probes

pytestmark = pytest.mark.slow        # notebooks in a kernel: the fast tier (-m "not slow") skips them

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
CELL_TIMEOUT_S = 120

_spec = importlib.util.spec_from_file_location("notebook_build", NOTEBOOKS / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

# the committed notebooks: those with a .py source (a student's copy saved beside them, e.g.
# my_02_scissorhands.ipynb or 02_scissorhands-Copy1.ipynb, is not one of them and is not tested)
IPYNBS = [p.with_suffix(".ipynb") for p in build.sources() if p.with_suffix(".ipynb").exists()]


def missing_model(path: Path) -> str | None:
    """Why ``path`` cannot run here: it loads SmolLM2-135M, whose file is not fetched (as on a machine that got the
    tree without it); None where it can. The README's set-up fetches it, so CI runs every notebook."""
    if '"smollm2-135m"' in path.with_suffix(".py").read_text() and (why := smollm2_missing()):
        return f"it loads smollm2-135m: {why}"
    return None


def cells(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in nb.cells]


@pytest.mark.parametrize("path", IPYNBS, ids=lambda p: str(p.relative_to(NOTEBOOKS)))
def test_notebook_matches_its_py_source(path: Path) -> None:
    source = path.with_suffix(".py")
    assert source.exists(), f"{path.name} has no {source.name} source; write the .py and run notebooks/build.py"
    committed, expected = nbformat.read(path, as_version=4), build.read_percent(source)
    assert cells(committed) == cells(expected), \
        f"{path.name} differs from {source.name}: rebuild it with `python notebooks/build.py {source}`"
    assert not build.error_outputs(committed), f"{path.name} was committed with errors"


FIGURE_RULES = build.FIGURE_RULES.read_text()


LESSONS = [p.with_suffix(".ipynb") for p in build.lessons()]


def tiny_run(path: Path) -> tuple[nbformat.NotebookNode, BaseException | None, float]:
    """``path`` run in tiny mode with the figure rules, as a normal build runs them, and a lesson with a probe
    after each exercise (``test_exercises.with_probes``): (the notebook with its outputs, the error that stopped
    it or None, seconds)."""
    nb = nbformat.read(path, as_version=4)
    if path in LESSONS:
        nb = with_probes(nb, path.stem)
    t0 = time.perf_counter()
    try:
        with build.figure_rules(nb):
            build.execute(nb, tiny=True, timeout=CELL_TIMEOUT_S, folder=path.parent)
    except Exception as e:                                       # raised again by the notebook's own test
        return nb, e, time.perf_counter() - t0
    return nb, None, time.perf_counter() - t0


@pytest.fixture(scope="module")
def tiny_runs(request) -> dict:
    """Every notebook the session's tiny-mode tests name, run at once, one kernel per core (a kernel computes on
    one thread), the longest first: the notebooks are most of the slow tier's time, and a core each halves it
    on two. Each test then checks its own notebook's run."""
    chosen = list(dict.fromkeys(
        item.callspec.params["path"] for item in request.session.items
        if getattr(item, "originalname", None) in ("test_notebook_runs_in_tiny_mode",
                                                    "test_each_exercise_checks_the_learner")
        and not missing_model(item.callspec.params["path"])))
    runs = json.loads(build.RECORD.read_text())
    chosen.sort(key=lambda p: -runs.get(build.name_of(p.with_suffix(".py")), {}).get("run_s", 0))
    with ThreadPoolExecutor(max_workers=max(1, min(os.cpu_count() or 1, len(chosen)))) as pool:
        return dict(zip(chosen, pool.map(tiny_run, chosen)))


@pytest.mark.parametrize("path", IPYNBS, ids=lambda p: str(p.relative_to(NOTEBOOKS)))
def test_notebook_runs_in_tiny_mode(path: Path, tiny_runs) -> None:
    """The notebook runs in tiny mode, and every figure it draws keeps ``figure_rules.py``'s rules."""
    if why := missing_model(path):
        pytest.skip(why)
    nb, error, seconds = tiny_runs[path]
    if error is not None:
        raise error
    assert not build.error_outputs(nb)
    first_code = next(cell for cell in nb.cells if cell.cell_type == "code")
    printed = "".join(out.get("text", "") for out in first_code.outputs)
    assert QUICK_MODE in printed, f"{path.name}: the first cell must say, in quick mode, that the text describes " \
                                  "another run (notebooks/preamble.py does)"
    print(f"{path.name}: {seconds:.1f} s in tiny mode")


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_each_exercise_checks_the_learner(path: Path, tiny_runs) -> None:
    """In the lesson's tiny run, each exercise's check said "not answered yet" on the untouched stub, passed with
    the reference's answer in the learner's names, and refused a plausible wrong one with a hint that does not
    print the answer (``test_exercises.probe_findings``)."""
    if why := missing_model(path):
        pytest.skip(why)
    nb, error, _ = tiny_runs[path]
    if error is not None:
        raise error
    assert not (found := probe_findings(nb)), f"{path.name}:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("path", build.sources(), ids=lambda p: str(p.relative_to(NOTEBOOKS)))
def test_no_notebook_prints_how_long_its_build_ran(path: Path) -> None:
    """How long a build took is the README's table (``build_record.json``), not a lesson's page."""
    nb = nbformat.read(path.with_suffix(".ipynb"), as_version=4)
    printed = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
               and any("ran in" in str(o.get("text", "")) for o in c.outputs)]
    assert not printed, f"{path.name}: cells {printed} print the run's time"


def test_the_readmes_notebook_table_is_the_build_record() -> None:
    """The README's table of lessons and labs (reading minutes, minutes of the committed run) is what
    ``build.py --table`` makes of the committed notebooks and ``build_record.json``, not a remembered figure."""
    readme = (NOTEBOOKS.parent / "README.md").read_text()
    assert build.table() in readme, "the README's notebook table is stale: paste `python notebooks/build.py --table`"
    runs = json.loads(build.RECORD.read_text())
    assert sorted(runs) == sorted(build.name_of(p) for p in build.sources()), \
        "build_record.json has a run of every lesson and lab, and of nothing else"


def test_every_py_source_has_a_notebook() -> None:
    missing = [p.name for p in build.sources() if not p.with_suffix(".ipynb").exists()]
    assert not missing, f"no .ipynb built for {missing}: run `python notebooks/build.py`"


def test_prose_only_keeps_the_outputs_and_refuses_changed_code(tmp_path: Path) -> None:
    """``build.py --prose-only``: new markdown into the committed notebook, code cells and outputs as they were;
    a changed code cell is refused (its outputs would not be the code's)."""
    source = tmp_path / "07_kernels.py"
    text = (NOTEBOOKS / "07_kernels.py").read_text()
    source.write_text(text.replace("# # 07 Kernels:", "# # 07 Kernels, reworded:", 1))
    (tmp_path / "07_kernels.ipynb").write_bytes((NOTEBOOKS / "07_kernels.ipynb").read_bytes())
    before = nbformat.read(tmp_path / "07_kernels.ipynb", as_version=4)
    after = nbformat.read(build.prose_only(source), as_version=4)
    assert after.cells[0].source.startswith("# 07 Kernels, reworded:")
    assert [(c.source, c.outputs) for c in after.cells if c.cell_type == "code"] == \
           [(c.source, c.outputs) for c in before.cells if c.cell_type == "code"]
    source.write_text(text.replace("print(", "print('changed'); print(", 1))
    with pytest.raises(ValueError, match="code cell 0 .*differs"):
        build.prose_only(source)


def test_a_normal_build_runs_the_figure_rules_and_leaves_no_trace() -> None:
    """``build.figure_rules`` adds the rules after the first code cell and their check at the end while the
    notebook runs, then takes both away and numbers the code cells as if they had never been there."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# T"), nbformat.v4.new_code_cell("a = 1"),
                                         nbformat.v4.new_code_cell("print(a)")])
    with build.figure_rules(nb):
        sources = [cell.source for cell in nb.cells]
        assert sources[2] == FIGURE_RULES and sources[-1].startswith("assert not _FIGURE_PROBLEMS")
        for count, cell in enumerate((c for c in nb.cells if c.cell_type == "code"), start=1):
            cell.execution_count = count                                  # as a kernel would number them
            cell.outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "1"},
                                                   execution_count=count)]
    assert [cell.source for cell in nb.cells] == ["# T", "a = 1", "print(a)"]
    assert [(c.execution_count, c.outputs[0].execution_count) for c in nb.cells[1:]] == [(1, 1), (2, 2)]
