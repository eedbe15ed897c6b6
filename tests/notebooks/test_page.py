"""
The page holds the lesson: what a reader sees in a committed notebook (JupyterLab, the book) is the lesson's
code and prose, not the course's machinery, and an exercise's answer stays out of sight until it is opened.

* No course marker (``# BEGIN SOLUTION [...]``, ``# END SOLUTION``) in a committed notebook's code: the build
  moves them into cell tags (``solution:cache:append``); the student copy is cut from the ``.py``.
* Every exercise's answer cell (a cell past ``## Exercises`` that holds a region) is collapsed with its output
  (``metadata.jupyter.source_hidden`` and ``outputs_hidden``): an answer's check often prints the answer.
* Each committed notebook's cell tags and collapsed state are what the build gives its ``.py`` now.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
_spec = importlib.util.spec_from_file_location("notebook_build", NOTEBOOKS / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

SOURCES = [p for p in build.sources() if p.with_suffix(".ipynb").exists()]


def committed(source: Path) -> nbformat.NotebookNode:
    return nbformat.read(source.with_suffix(".ipynb"), as_version=4)


def answers(nb: nbformat.NotebookNode) -> list[int]:
    """Indices of the code cells past the ``## Exercises`` heading that hold a course region."""
    out, exercises = [], False
    for i, cell in enumerate(nb.cells):
        lines = cell.source.splitlines()
        if cell.cell_type == "markdown" and build.EXERCISES in (line.strip() for line in lines):
            exercises = True
        elif cell.cell_type == "markdown" and any(line.startswith("## ") for line in lines):
            exercises = False
        elif cell.cell_type == "code" and exercises and any(
                t.startswith(build.SOLUTION_TAG) for t in cell.metadata.get("tags", [])):
            out.append(i)
    return out


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_no_course_marker_on_the_page(source):
    for i, cell in enumerate(committed(source).cells):
        assert "BEGIN SOLUTION" not in cell.source and "END SOLUTION" not in cell.source, \
            f"{source.stem} cell {i}: a course marker on the page; rebuild it (python notebooks/build.py)"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_answers_are_collapsed_with_their_outputs(source):
    nb = committed(source)
    for i in answers(nb):
        hidden = nb.cells[i].metadata.get("jupyter", {})
        assert hidden.get("source_hidden") and hidden.get("outputs_hidden"), \
            f"{source.stem} cell {i}: an exercise's answer shows its code or its output"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_tags_and_collapsed_cells_are_the_builds(source):
    def state(nb):
        return [(c.cell_type, sorted(c.metadata.get("tags", [])), c.metadata.get("jupyter", {})) for c in nb.cells]
    assert state(committed(source)) == state(build.read_percent(source)), \
        f"{source.stem}: rebuild it (python notebooks/build.py {source.relative_to(NOTEBOOKS.parent)})"


def test_the_page_moves_markers_into_tags_and_hides_answers(tmp_path):
    """What the build does with a lesson's markers, on a three-cell source."""
    src = tmp_path / "00_x.py"
    src.write_text("# %% [markdown]\n# # 00 X\n\n# %%\ndef f():\n"
                   "    # BEGIN SOLUTION [cache:append] hint\n    return 1\n    # END SOLUTION\n\n"
                   "# %% [markdown]\n# ## Exercises\n\n# %%\n# BEGIN SOLUTION [cache] n\nprint(2)\n# END SOLUTION\n")
    nb = build.read_percent(src)
    assert nb.cells[1].source == "def f():\n    return 1" and nb.cells[1].metadata["tags"] == ["solution:cache:append"]
    assert nb.cells[3].metadata["jupyter"] == {"source_hidden": True, "outputs_hidden": True}
    assert answers(nb) == [3]
    raw = build.read_percent(src, page=False)
    assert "# BEGIN SOLUTION [cache:append] hint" in raw.cells[1].source and "tags" not in raw.cells[1].metadata
