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
import re
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


# -- lessons and labs: a short set-up, no course words; lessons: short cells, a notation list ----------------

LESSONS = [p for p in build.lessons() if p.with_suffix(".ipynb").exists()]
SETUP_LINES, CELL_LINES = 12, 25
SHARED_NOTATION = NOTEBOOKS / "README.md"
COURSE_WORDS = re.compile(r"\bassignments?\b|student copy|tests/\S+\.py|course\.(?:grade|handout)|"
                          r"research this lesson grew|SOLUTION|# needs:|"
                          # linter and test-runner comments, the build machine, a project's targets
                          r"# noqa|\bpytest\b|machine that built|committed run|(?-i:\bNOT met\b)|"
                          # how long the build's run took: "took 284 s", "in 114 s", "(169 s)", "run time: 60 s"
                          r"\btook \d[\d.,]* s\b|\bin \d[\d.,]* (?-i:s)\b|\(\d[\d.,]* (?-i:s)\)|run time: \d",
                          flags=re.I)


def code_lines(cell) -> int:
    return sum(1 for line in cell.source.splitlines() if line.strip())


def shown_text(cell) -> str:
    """What the reader sees of a cell: its source, and the text its outputs print (an answer's are hidden)."""
    if cell.metadata.get("jupyter", {}).get("outputs_hidden"):
        return cell.source
    return cell.source + "\n" + "\n".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
                                          for o in cell.get("outputs", []))


HEADING_IN_CODE = re.compile(r"^# #{1,4} \S", flags=re.M)     # '# ## 5. Title': prose left in a code cell


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_no_heading_sits_in_a_code_cell(source):
    """A markdown heading written as comments inside a code cell: a '# %% [markdown]' marker left out, so the
    section's prose runs on under the code, unrendered."""
    for i, cell in enumerate(committed(source).cells):
        if cell.cell_type == "code" and (m := HEADING_IN_CODE.search(cell.source)):
            raise AssertionError(f"{source.stem} cell {i}: the heading {m.group(0)!r}... is in a code cell: put "
                                 "'# %% [markdown]' above it")


def test_the_heading_rule_sees_prose_under_code():
    assert HEADING_IN_CODE.search("print(1)\n#\n# ## 5. When a method acts")
    assert not HEADING_IN_CODE.search("x = 1   # ## not at the line's start\n# a comment")


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_a_notebook_opens_with_one_short_set_up_cell(source):
    """Lessons and labs alike: the first code cell is the set-up, at most 12 lines, its first line the
    preamble's import (the rest of what every notebook needs is in ``notebooks/preamble.py``)."""
    first = next(c for c in committed(source).cells if c.cell_type == "code")
    assert "setup" in first.metadata.get("tags", []) and first.source.startswith("from preamble import TINY"), \
        f"{source.stem}: the first code cell is the set-up, tagged setup, importing notebooks/preamble.py"
    assert code_lines(first) <= SETUP_LINES, f"{source.stem}: a {code_lines(first)}-line set-up cell"


@pytest.mark.parametrize("source", LESSONS, ids=lambda p: p.stem)
def test_no_code_cell_of_a_lesson_is_long(source):
    long = {i: code_lines(c) for i, c in enumerate(committed(source).cells)
            if c.cell_type == "code" and code_lines(c) > CELL_LINES}
    assert not long, f"{source.stem}: cells over {CELL_LINES} non-blank lines (cell: lines): {long}"


LABS = [p for p in build.sources() if p.parent == build.LABS and p.with_suffix(".ipynb").exists()]
TABLE_LINES = 30


def printed_lines(cell) -> int:
    """Lines a code cell prints as text (its streams and plain-text results)."""
    return sum(len(str(o.get("text", "") or o.get("data", {}).get("text/plain", "")).splitlines())
               for o in cell.get("outputs", []) if o.output_type in ("stream", "execute_result"))


@pytest.mark.parametrize("source", LABS, ids=lambda p: p.stem)
def test_a_lab_keeps_short_cells_and_short_tables(source):
    """A lab too: at most 25 non-blank lines of code a cell, and no cell printing more than 30 lines."""
    cells = committed(source).cells
    long = {i: code_lines(c) for i, c in enumerate(cells) if c.cell_type == "code" and code_lines(c) > CELL_LINES}
    assert not long, f"{source.stem}: cells over {CELL_LINES} non-blank lines (cell: lines): {long}"
    tall = {i: printed_lines(c) for i, c in enumerate(cells) if c.cell_type == "code"
            and printed_lines(c) > TABLE_LINES}
    assert not tall, f"{source.stem}: cells printing over {TABLE_LINES} lines (cell: lines): {tall}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_no_course_machinery_on_the_page(source):
    found = [(i, m.group(0)) for i, c in enumerate(committed(source).cells)
             for m in COURSE_WORDS.finditer(shown_text(c))]
    assert not found, f"{source.stem}: course or build words a reader sees (cell, words): {found[:8]}"


def notation(text: str) -> dict[str, str]:
    """The rows of the ``| symbol | meaning | in the code |`` tables in ``text``: symbol -> code names (a
    norm's ``\\|`` inside a cell is not a column's edge)."""
    rows = {}
    for table in re.findall(r"^\| symbol \| meaning \| in the code \|\n\|[-| ]+\|\n((?:\|.*\|\n?)+)", text, re.M):
        for row in table.strip().splitlines():
            cols = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
            if len(cols) == 3:
                rows[cols[0]] = cols[2]
    return rows


# LaTeX that names no symbol of the lesson: words (\text{...}), operators and functions, delimiters, spacing,
# accents, set and order relations, and two constants (e and pi)
WORDS = re.compile(r"\\(?:text|operatorname|mathrm|textbf|mathbf|mathbb)\{[^{}]*\}")
NOT_SYMBOLS = set("""exp log ln max min sum prod frac tfrac dfrac sqrt left right big Big bigg Bigg quad qquad cdot
    cdots ldots dots le leq ge geq ne neq in notin to mid infty approx lfloor rfloor lceil rceil begin end cases
    arg argmax argmin top hat tilde bar vec odot oslash otimes times sim Vert vert lvert rvert langle rangle pm
    forall cup cap setminus subseteq subset emptyset lbrace rbrace circ colon displaystyle mathrel mathcal
    overline underbrace overbrace equiv propto gg ll rightarrow leftarrow Rightarrow iff implies partial Pr
    limits nolimits prime mod bmod pmod binom choose softmax pi e""".split())


def equation_symbols(latex: str) -> set[str]:
    """The symbols of some LaTeX: single letters (a subscript's too), Greek letters and calligraphic letters."""
    found = set()
    for m in re.finditer(r"\\mathcal\{([A-Za-z])\}|\\([A-Za-z]+)|(?<![\\A-Za-z])([A-Za-z])(?![A-Za-z])",
                         WORDS.sub(" ", latex)):
        name = "mathcal " + m.group(1) if m.group(1) else m.group(2) or m.group(3)
        if name not in NOT_SYMBOLS:
            found.add(name)
    return found


def undefined_symbols(markdown: list[str], shared: str) -> list[tuple[int, str]]:
    """(markdown cell, symbol) for each symbol of a displayed equation that neither the lesson's notation list
    nor the shared table names."""
    defined = set().union(*[equation_symbols(symbol) for text in markdown + [shared] for symbol in notation(text)])
    return sorted({(i, name) for i, text in enumerate(markdown) for eq in re.findall(r"\$\$(.+?)\$\$", text, re.S)
                   for name in equation_symbols(eq) - defined})


@pytest.mark.parametrize("source", LESSONS, ids=lambda p: p.stem)
def test_every_symbol_of_a_displayed_equation_is_in_a_notation_list(source):
    markdown = [c.source for c in committed(source).cells if c.cell_type == "markdown"]
    missing = undefined_symbols(markdown, SHARED_NOTATION.read_text())
    assert not missing, f"{source.stem}: symbols of displayed equations that no notation list names (markdown " \
                        f"cell, symbol): {missing[:10]}"


def test_the_symbol_check_catches_an_undefined_symbol():
    table = "| symbol | meaning | in the code |\n|---|---|---|\n| $W_O^{(h)}$, $\\|x\\|_1$ | a norm | `w` |\n"
    assert notation(table) == {"$W_O^{(h)}$, $\\|x\\|_1$": "`w`"}
    eq = "$$\\mathcal{L} = \\big\\|(A - A') W_O^{(h)} x\\big\\|_1 \\quad \\text{(Eq. 5)}, \\; e^{\\lambda}$$"
    assert equation_symbols(eq[2:-2]) == {"mathcal L", "A", "W", "O", "h", "x", "lambda"}
    assert undefined_symbols([table, eq], "") == [(1, "A"), (1, "lambda"), (1, "mathcal L")]


@pytest.mark.parametrize("source", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_s_notation_comes_before_its_math_and_names_its_code(source):
    cells = committed(source).cells
    markdown = [c.source for c in cells if c.cell_type == "markdown"]
    table_at = next((i for i, text in enumerate(markdown) if notation(text)), None)
    math_at = next((i for i, text in enumerate(markdown) if "$$" in text), None)
    assert table_at is not None, f"{source.stem}: no notation list (| symbol | meaning | in the code |)"
    assert math_at is None or table_at <= math_at, f"{source.stem}: the notation list comes after the first equation"
    code = "\n".join(c.source for c in cells if c.cell_type == "code")
    for symbol, names in notation(markdown[table_at]).items():
        for name in re.findall(r"`([A-Za-z_][\w.]*)", names):
            assert re.search(rf"\b{re.escape(name.split('.')[-1])}\b", code), \
                f"{source.stem}: the notation maps {symbol} to `{name}`, which no code cell uses"


def test_the_shared_notation_table_parses():
    rows = notation(SHARED_NOTATION.read_text())
    assert {"$B$", "$T$", "$d$", "$H_{kv}$"} <= set(rows), sorted(rows)


# -- figures a reader can read ----------------------------------------------------------------------------------

SMALL_TEXT = re.compile(r"\b(?:fontsize|labelsize)\s*=\s*(?:(\d+(?:\.\d+)?)\b|[\"'](?:xx-small|x-small|small)[\"'])")
PANELS = re.compile(r"\bsubplots\(\s*(\d+)\s*,\s*(\d+)\b")


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_no_figure_text_under_9_points(source):
    """Every size a notebook sets for a figure's text is at least 9 points (matplotlib's "small" is 8.3)."""
    small = [m.group(0) for m in SMALL_TEXT.finditer(source.read_text()) if m.group(1) is None or float(m.group(1)) < 9]
    assert not small, f"{source.stem}: figure text under 9 points: {small}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_no_figure_of_more_than_four_panels(source):
    """A grid of subplots written with numbers holds at most four panels (grids sized by a variable are not
    checked here)."""
    big = [m.group(0) for m in PANELS.finditer(source.read_text()) if int(m.group(1)) * int(m.group(2)) > 4]
    assert not big, f"{source.stem}: figures of more than four panels: {big}"


def test_the_figure_checks_catch_small_text_and_big_grids():
    assert [m.group(0) for m in SMALL_TEXT.finditer('ax.legend(fontsize=8); ax.tick_params(labelsize="small")')] \
        == ["fontsize=8", 'labelsize="small"']
    assert PANELS.search("plt.subplots(3, 2, figsize=(9, 9))").groups() == ("3", "2")


def test_the_course_words_catch_run_times_not_shapes():
    found = [m.group(0) for m in COURSE_WORDS.finditer("120 rows in 114 s; (169 s); run time: 342 s; took 21 s")]
    assert found == ["in 114 s", "(169 s)", "run time: 3", "took 21 s"]
    assert not COURSE_WORDS.search("torch.randint(N, (1000, S)) in 3 Steps")


def test_the_course_words_catch_linter_comments_and_targets_not_prose():
    found = [m.group(0) for m in COURSE_WORDS.finditer("x = 1  # noqa: E731; run pytest; SnapKV 2.4x: NOT met")]
    assert found == ["# noqa", "pytest", "NOT met"]
    assert not COURSE_WORDS.search("the paper's 5x is not met on this model")
