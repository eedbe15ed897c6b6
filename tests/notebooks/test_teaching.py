"""
The notebooks teach the way the course promises: each method notebook builds its method's core before it
uses the library's, shows each paper's equation beside its idea, says what every figure shows, and quotes
only numbers its own committed run printed.

* **Build it**: each method notebook (01-06) has a *build-it cell*: a solution region of its assignment
  tagged with a graded task (``# BEGIN SOLUTION [baselines:window_vote] hint``), so the student's copy
  strips it and the task's cells say they run once it is done. The region is a short from-scratch version
  of the task's code, and the rest of its cell asserts that it gives what the library gives. The notebook
  run (``test_notebooks.py``) executes that assert; here we check that the cell exists, is short, names a
  graded task, and compares with the library.
* **Equations**: every paper a notebook teaches has a displayed equation (``$$ ... $$``) in the markdown
  cell that names it, with the paper's section, equation or algorithm number.
* **Takeaways**: in the committed notebook, every cell that draws a figure is followed by a markdown cell
  that starts with a sentence (what the figure shows), not by a heading or more code.
* **Quoted numbers**: every number the prose states (a decimal, a percentage, or an integer of three or
  more digits) is in the committed notebook's code or outputs, so a number from another run, or from a
  quick-mode run, cannot sit in the text. Not checked: numbers that name something (sections, equations,
  tables, figures, algorithms, theorems, cells, years, arXiv ids), headings, numbers in math, code spans or
  links, and numbers in a sentence that quotes a source ("the paper reports ...", "its data sheet").
* **Counts**: a fraction of things ("7 of the 8 cells", in words or digits) is printed as a fraction by an
  output that names the things, and a maximum ("one or two heads at best") as a maximum.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import nbformat
import pytest

from course.assignments import ASSIGNMENTS
from course.markers import find_regions
from course.mutants import graded_regions
from tests.quoting import in_text, output_text, prose_numbers, sentence_numbers, sentences

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
_spec = importlib.util.spec_from_file_location("notebook_build", NOTEBOOKS / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)
SOURCES = build.lessons()
NAMES = [str(p.relative_to(NOTEBOOKS).with_suffix("")) for p in build.sources()]     # lessons, then labs
GROWN = 1.1                                  # a notebook 10% larger than when it was read is read again
LESSON_SIZE, COURSE_SIZE = 55, 420            # size_minutes: a lesson, and all eight (the readings are the minutes)

# the papers each method notebook teaches, by the name its markdown uses
PAPERS = {
    "00_nanollm_kv_cache": ["Vaswani"],
    "01_baselines": ["StreamingLLM", "H2O", "SnapKV", "AdaKV"],
    "02_scissorhands": ["Scissorhands"],
    "03_tensor_attention": ["tensor attention"],
    "04_perturbation_selection": ["CriticalKV"],
    "05_chunkkv": ["ChunkKV"],
    "06_kvreviver": ["KVReviver"],
    "07_kernels": ["FlashAttention"],
}
METHOD_NOTEBOOKS = sorted(PAPERS)
BUILD_IT_LINES = (4, 25)          # lines of code in a build-it function: a readable core, not the library's file
COMPARES = re.compile(r"^\s*(assert |torch\.testing\.assert_close\()", flags=re.M)    # the check after the region


def assignment_of(stem: str):
    return next(a for a in ASSIGNMENTS.values() if a.notebook == stem)


def cells_of(stem: str) -> list:
    return build.read_percent(NOTEBOOKS / f"{stem}.py", page=False).cells       # with the course's markers


def enclosing_function(source: str, region) -> ast.FunctionDef | None:
    """The top-level function whose body holds the region (its signature and docstring above the BEGIN line)."""
    return next((n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)
                 and n.lineno < region.begin <= n.end_lineno), None)


def build_it_cells(stem: str) -> list[tuple[int, str, str, list[str], ast.FunctionDef | None]]:
    """(cell index, task, the cell's code after the region, the build-it function's lines (the region's where it
    lies in none), the function around the region or None) of every build-it cell."""
    a = assignment_of(stem)
    found = []
    for i, cell in enumerate(cells_of(stem)):
        if cell.cell_type != "code":
            continue
        lines = cell.source.splitlines()
        for r in find_regions("cell.py", cell.source):
            if r.assignment == a.name and r.task:
                fn = enclosing_function(cell.source, r)
                code = lines[fn.lineno - 1:r.end] if fn else r.body(lines)
                found.append((i, r.task, "\n".join(lines[r.end:]), code, fn))
    return found


@pytest.mark.parametrize("stem", METHOD_NOTEBOOKS)
def test_each_method_notebook_builds_its_method_and_checks_it_against_the_library(stem):
    a = assignment_of(stem)
    cells = build_it_cells(stem)
    assert cells, f"{stem}: no build-it cell (a region '# BEGIN SOLUTION [{a.name}:TASK] hint' in a code cell)"
    graded = {r.task for r in graded_regions(a)}
    n_cells = len(cells_of(stem))
    for i, task, rest, body, fn in cells:
        assert task in graded, f"{stem} cell {i}: task {task!r} is not a graded task of {a.name!r} ({sorted(graded)})"
        code = [ln for ln in body if ln.strip() and not ln.strip().startswith("#")]
        lo, hi = BUILD_IT_LINES
        assert lo <= len(code) <= hi, f"{stem} cell {i}: the build-it function has {len(code)} lines of code, " \
                                      f"want {lo}-{hi}: the method's core, readable at a glance"
        assert COMPARES.search(rest), \
            f"{stem} cell {i}: after the region the cell must assert that the built version equals the library's"
    first = min(i for i, *_ in cells)
    assert first < n_cells // 2, f"{stem}: the first build-it cell (cell {first} of {n_cells}) comes right after " \
                                 "the idea, in the first half of the notebook"


def test_a_build_it_cell_that_never_compares_is_refused():
    """The check above on a cell whose region names a graded task but never compares with the library."""
    a = ASSIGNMENTS["baselines"]
    graded = {r.task for r in graded_regions(a)}
    assert "window_vote" in graded and "window_votes" not in graded
    text = "x = 1\n# BEGIN SOLUTION [baselines:window_vote] hint\ny = 2\n# END SOLUTION\nprint(y)\n"
    (r,) = find_regions("cell.py", text)
    rest = "\n".join(text.splitlines()[r.end:])
    assert not COMPARES.search(rest)


@pytest.mark.parametrize("stem", METHOD_NOTEBOOKS)
def test_a_build_it_region_is_a_function_body_under_its_signature_and_docstring(stem):
    """The student copy replaces the region with a stub: what stays above it, the ``def`` line with its
    arguments and the docstring with the shapes, is what the reader builds to."""
    for i, task, _, body, fn in build_it_cells(stem):
        assert fn is not None, f"{stem} cell {i}: the region of {task} is not inside a function: put the def line " \
                               "and the docstring above its BEGIN line"
        assert ast.get_docstring(fn), f"{stem} cell {i}: {fn.name} has no docstring (the shapes it takes and returns)"
        marker = next(j for j, line in enumerate(body) if "BEGIN SOLUTION" in line)
        assert fn.body[0].end_lineno - fn.lineno < marker, f"{stem} cell {i}: {fn.name}'s docstring is in the region"


def test_the_signature_check_sees_a_region_around_the_def():
    text = "# BEGIN SOLUTION [cache:mask] hint\ndef f(x):\n    \"\"\"x -> x.\"\"\"\n    return x\n# END SOLUTION\n"
    (r,) = find_regions("cell.py", text)
    assert enclosing_function(text, r) is None
    inside = "def f(x):\n    \"\"\"x -> x.\"\"\"\n    # BEGIN SOLUTION [cache:mask] hint\n    return x\n" \
             "    # END SOLUTION\n"
    (r,) = find_regions("cell.py", inside)
    assert enclosing_function(inside, r).name == "f"


DISPLAY = re.compile(r"\$\$.+?\$\$", re.S)
CITE = re.compile(r"(§\s?\d|\bEq(?:uation|s?\.)\s?\(?\d|\bAlgorithm \d|\bSection \d|\bTheorem \d|\bDefinition \d)")


@pytest.mark.parametrize("stem", METHOD_NOTEBOOKS)
def test_each_paper_has_a_displayed_equation_beside_its_idea(stem):
    markdown = [c.source for c in cells_of(stem) if c.cell_type == "markdown"]
    for paper in PAPERS[stem]:
        beside = [m for m in markdown if paper.lower() in m.lower() and DISPLAY.search(m) and CITE.search(m)]
        assert beside, f"{stem}: no markdown cell names {paper} with a displayed equation ($$ ... $$) and the " \
                       "paper's section, equation or algorithm number"


def committed(name: str) -> list[dict]:
    """The committed cells of a lesson ('04_perturbation_selection') or a lab ('labs/04_...')."""
    return json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())["cells"]


def draws(cell: dict) -> bool:
    return cell["cell_type"] == "code" and any("image/png" in out.get("data", {}) for out in cell.get("outputs", []))


@pytest.mark.parametrize("stem", NAMES)
def test_every_figure_is_followed_by_its_takeaway(stem):
    cells = committed(stem)
    bare = []
    for i, cell in enumerate(cells):
        if not draws(cell):
            continue
        after = cells[i + 1] if i + 1 < len(cells) else None
        text = "".join(after["source"]).strip() if after and after["cell_type"] == "markdown" else ""
        if not text or text.startswith("#") or not re.search(r"[.!?](\s|$)", text.split("\n\n")[0]):
            bare.append(i)
    assert not bare, f"{stem}: the figures of cells {bare} are not followed by a markdown sentence saying what " \
                     "they show"


def prints_table(out: dict) -> bool:
    """An output that is a table: a data frame, or printed text with three or more rows of columns."""
    text = "".join(out.get("text", "")) or "".join(out.get("data", {}).get("text/plain", ""))
    return "text/html" in out.get("data", {}) or sum(" | " in line for line in text.splitlines()) >= 3


def tables_before_pictures(cells: list[dict]) -> list[tuple[int, int]]:
    """(section, cell) of the first table of each section or subsection (a '## ' or '### ' heading) that draws
    a figure only after it; a section is numbered by the cell that starts it."""
    first_table, drew, wrong, sec = {}, set(), [], 0
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            if re.search(r"^###? ", "".join(cell["source"]), re.M):
                sec = i
            continue
        for out in cell.get("outputs", []):
            if "image/png" in out.get("data", {}):
                drew.add(sec)
                if sec in first_table:
                    wrong.append((sec, first_table[sec]))
            elif prints_table(out) and sec not in drew:
                first_table.setdefault(sec, i)
    return sorted(set(wrong))


@pytest.mark.parametrize("stem", NAMES)
def test_a_section_shows_its_picture_before_its_tables(stem):
    wrong = tables_before_pictures(committed(stem))
    assert not wrong, f"{stem}: (section, cell) of tables printed before their section's figure: {wrong}; " \
                      "draw the picture first, then the table that details it"


def test_the_picture_rule_sees_a_table_first():
    table = {"output_type": "stream", "text": ["a | b\n", "1 | 2\n", "3 | 4\n"]}
    picture = {"output_type": "display_data", "data": {"image/png": "x"}}
    cells = [{"cell_type": "markdown", "source": ["## 1. Results"]},
             {"cell_type": "code", "source": ["t"], "outputs": [table]},
             {"cell_type": "code", "source": ["f"], "outputs": [picture]}]
    assert tables_before_pictures(cells) == [(0, 1)]
    cells[1], cells[2] = cells[2], cells[1]
    assert tables_before_pictures(cells) == []


# -- a lesson's length, and its lab ------------------------------------------------------------------------

def size(path: Path) -> float:
    return build.size_minutes(nbformat.read(path.with_suffix(".ipynb"), as_version=4))


@pytest.mark.parametrize("path", build.sources(), ids=lambda p: build.name_of(p))
def test_a_notebook_is_read_again_once_it_grew(path):
    """The README's minutes of work are cold readings (``notebooks/readings.json``) of the notebook as it is: every
    lesson and lab has them, and one whose size (``size_minutes``) grew by more than 10% since needs new ones."""
    entry = build.read_readings().get(build.name_of(path))
    assert entry, f"{build.name_of(path)}: no cold reading in notebooks/readings.json"
    now = size(path)
    assert now <= GROWN * entry["size"], \
        f"{build.name_of(path)} grew since it was read ({now:.0f} nominal minutes against {entry['size']:.0f}): " \
        "have it read cold again and update notebooks/readings.json"


@pytest.mark.parametrize("stem", [p.stem for p in SOURCES])
def test_no_lesson_grows_past_its_size(stem):
    """A lesson's nominal size (``size_minutes``) stays at most 55, and the eight at most 420: a yardstick
    against growth; the minutes a reader takes are the readings, which ran about twice the size."""
    assert size(NOTEBOOKS / f"{stem}.py") <= LESSON_SIZE, f"{stem}: move the research to its lab (notebooks/labs/)"


def test_the_eight_lessons_keep_their_size():
    took = {p.stem: round(size(p), 1) for p in SOURCES}
    assert len(took) == 8 and sum(took.values()) <= COURSE_SIZE, took


def test_the_course_guide_quotes_the_lessons_readings():
    """course/GUIDE.md's plan gives each lesson's minutes: the median of its cold readings, as the README's table
    (a guide that kept old minutes planned the instructor's weeks on them)."""
    readings = build.read_readings()
    guide = (NOTEBOOKS.parent / "course" / "GUIDE.md").read_text()
    rows = re.findall(r"^\| \d+ \| (\d\d) [^|]*\((\d+)\) \|", guide, re.M)      # | week | NN title (minutes) |
    assert len(rows) == 8, f"course/GUIDE.md: the plan's table has {len(rows)} lessons with their minutes, not 8"
    for number, minutes in rows:
        stem = next(p.stem for p in SOURCES if p.stem.startswith(number))
        want = build.median_minutes(readings[stem])
        assert int(minutes) == want, f"course/GUIDE.md: lesson {stem} ({minutes} min); its readings' median is {want}"


def test_a_reading_is_recorded_with_the_size_of_the_notebook_read(tmp_path, monkeypatch):
    """``build.py --reading M...`` writes one notebook's readings and its size; the table shows their median,
    range and count; bad minutes and two notebooks are refused in one line."""
    monkeypatch.setattr(build, "READINGS", tmp_path / "readings.json")
    source = NOTEBOOKS / "00_nanollm_kv_cache.py"
    build.main([str(source), "--reading", "50", "58", "44"])
    entry = json.loads((tmp_path / "readings.json").read_text())["00_nanollm_kv_cache"]
    assert entry["minutes"] == [50, 58, 44] and entry["size"] == round(size(source), 1)
    assert build.work(entry) == "50 (44-58, 3)" and build.work(None) == "not read"
    build.main([str(NOTEBOOKS / "01_baselines.py"), "--reading", "61"])           # beside the first
    assert sorted(json.loads((tmp_path / "readings.json").read_text())) == ["00_nanollm_kv_cache", "01_baselines"]
    for argv in ([str(source), "--reading", "0"], [str(source), str(source), "--reading", "5"]):
        with pytest.raises(SystemExit):
            build.main(argv)


GO_FURTHER = re.compile(r"\*\*Go further\*\*.*?\]\((labs/[0-9]{2}_[a-z0-9_]+\.ipynb)\)", re.S)


@pytest.mark.parametrize("stem", [p.stem for p in SOURCES])
def test_a_lesson_points_at_its_lab_and_the_lab_at_its_lesson(stem):
    labs = sorted(build.LABS.glob(f"{stem[:2]}_*.py"))
    markdown = [c.source for c in cells_of(stem) if c.cell_type == "markdown"]
    pointers = [m.group(1) for text in markdown for m in GO_FURTHER.finditer(text)]
    assert [f"labs/{p.stem}.ipynb" for p in labs] == sorted(set(pointers)), \
        f"{stem}: a '**Go further**' paragraph links each of its labs, and only those: labs {labs}, links {pointers}"
    for lab in labs:
        title = build.read_percent(lab).cells[0].source.splitlines()[0]
        assert re.fullmatch(rf"# {stem[:2]} Lab: \S.*", title), f"{lab.name}: title '# {stem[:2]} Lab: ...'"
        markdown = [c.source for c in build.read_percent(lab).cells if c.cell_type == "markdown"]
        assert any(f"../{stem}.ipynb" in text for text in markdown), \
            f"{lab.name} links back to its lesson ../{stem}.ipynb"


# -- quoted numbers -----------------------------------------------------------------------------------------

SECTION_CUE = re.compile(r"(?:§|\bsections?\s)\s*(\d+)", re.I)


def section_of(line: str, current: int) -> int:
    """The section a heading line starts (N for '## N. Title', -1 for '## Exercises' and what follows), or
    ``current`` for any other line."""
    if m := re.match(r"## (\d+)\. ", line):
        return int(m.group(1))
    return -1 if line.startswith("## ") else current


def parts(cells: list[dict]) -> list[tuple[int, int, str]]:
    """(cell, section, text) for every cell, a markdown cell cut at its '## ' headings: the title's section
    is 0, the exercises' and appendix's -1."""
    current, out = 0, []
    for i, cell in enumerate(cells):
        text = "".join(cell["source"])
        if cell["cell_type"] != "markdown":
            out.append((i, current, text))
            continue
        lines = []
        for line in text.splitlines():
            if section_of(line, current) != current:
                out.append((i, current, "\n".join(lines)))
                current, lines = section_of(line, current), []
            lines.append(line)
        out.append((i, current, "\n".join(lines)))
    return out


def unquoted(stem: str, cells: list[dict] | None = None) -> list[tuple[int, str]]:
    """(cell, number) for every number the prose states that no code cell of its section printed or set, nor
    of a section its sentence names (§4, section 4); the exercises and appendix answer to the whole notebook.
    A percentage must be printed as one (a '25%' is not vouched for by a printed 0.25, which may be a keep
    ratio): quote what the output prints."""
    cells = committed(stem) if cells is None else cells
    pieces = parts(cells)
    code = {sec: output_text([cells[i] for i, s, _ in pieces if s == sec and cells[i]["cell_type"] == "code"])
            for _, sec, _ in pieces}
    code[-1] = output_text(cells)           # the exercises and the appendix may refer to any section
    missing = []
    for i, sec, text in pieces:
        if cells[i]["cell_type"] != "markdown":
            continue
        for sentence in sentences(text):
            named = {sec} | {int(n) for n in SECTION_CUE.findall(sentence)}
            scope = "\n".join(code.get(s, "") for s in named)
            missing += [(i, n) for n in sentence_numbers(sentence) if not in_text(n, scope)]
    return missing


@pytest.mark.parametrize("stem", NAMES)
def test_the_prose_quotes_only_numbers_its_section_printed(stem):
    missing = unquoted(stem)
    assert not missing, f"{stem}: the prose quotes numbers that the code cells of their section (or of the " \
                        f"section the sentence names) do not print or set (cell, number): {missing[:12]}; print " \
                        "them (a sentence from variables), name the section that prints them, or correct the text"


def test_the_quoted_number_check_catches_a_number_from_another_run():
    cells = [{"cell_type": "code", "source": ["print(f'{n} prompt tokens, {0.92:.2f}')"],
              "outputs": [{"output_type": "stream", "text": ["494 prompt tokens, 0.92\n"]}]},
             {"cell_type": "markdown", "source": ["The prompt has 244 tokens and SnapKV answers 0.92 of them."]}]
    text = output_text(cells)
    found = prose_numbers("".join(cells[1]["source"]))
    assert found == ["244", "0.92"]
    assert [n for n in found if not in_text(n, text)] == ["244"]
    assert prose_numbers("Section 6.3 and §4.1, sections 6.1 and 6.2 (Table 2, 2024; arXiv 2306.14048).") == []
    assert prose_numbers("The paper reports 45.09 on LongBench. We measure 0.71.") == ["0.71"]
    assert prose_numbers("It keeps 3 of the 5 samples.") == ["3", "5"]          # small integers count


def test_a_number_counts_only_in_its_own_section_or_one_its_sentence_names():
    """A keep ratio printed everywhere does not vouch for a '25%' its section never printed (04 said 25% where
    its table printed 0.26); a sentence that names the section that printed a number passes."""
    def code(text, out):
        return {"cell_type": "code", "source": [text], "outputs": [{"output_type": "stream", "text": [out]}]}

    def md(text):
        return {"cell_type": "markdown", "source": [text]}
    cells = [md("## 1. Setup"), code("keep = 0.25", "ratio 0.25\n"), md("## 2. Results"), code("t", "kept 26%\n"),
             md("About 25% of the needle survives."), md("About 26% survives."), md("Section 1 keeps 0.25 of it."),
             md("It keeps 3 of them.\n\n## Exercises\n\nTry 26% again, then 0.27.")]
    assert unquoted("", cells) == [(4, "25%"), (7, "3"), (7, "0.27")]      # the exercises may quote any section
    assert in_text("70.5%", "share 70.5 %") and in_text("1,024", "1024 heads") and not in_text("0.7", "0.71")
    assert not in_text("6", "atol=1e-6") and not in_text("5", "2.5e5") and in_text("6", "B_TOY = 6")
    assert not in_text("25%", "keep ratio 0.25")                 # a percentage is quoted as printed


# -- counts: "3 of the 5 samples", "one or two heads at best" ---------------------------------------------------
# A presence check cannot vouch for a count: 05 once said "3 of the 5 samples" where its section printed
# "value 3/5" (digits of a passkey), and "one or two heads of a layer at best" where its printed counts reached
# three. Two shapes of count are therefore held to more than presence:
# * a fraction of things ("N of the M cells", words or digits) must be printed as a fraction ("N of M", "N/M")
#   in one cell's output that also names the things; a threshold ("in at least two of the three rows") is a
#   rule, not a count, and is not checked;
# * a maximum of a count ("N heads at best", "at most N layers") must be printed as a maximum: a cell's output
#   with "max", "most", "best", "largest" or "highest" shortly before N.

NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()
COUNT = rf"(?:\d+|{'|'.join(NUMBER_WORDS)})"
GLUE = {"the", "of", "a", "an", "in", "and", "or", "at", "to", "its", "their", "by", "for", "with", "on", "is",
        "are", "was", "were", "per", "that", "which", "from", "as", "than", "all", "each", "every", "it", "them"}
FRACTION = re.compile(rf"(?<!at least )(?<![\w.-])({COUNT})\s+(?:out\s+)?of\s+(?:the\s+|its\s+|their\s+)?"
                      rf"({COUNT})(?![\w.,-]\d)((?:\s+[\w'-]+){{1,3}})", re.I)
MAXIMUM = re.compile(rf"\b(?:at best|at most|no more than|never more than)\s+({COUNT})(?:\s+or\s+({COUNT}))?\s+[a-z]|"
                     rf"(?<![\w.-])({COUNT})(?:\s+or\s+({COUNT}))?\s+[a-z][\w ,'-]{{0,40}}?\bat best\b", re.I)


def count_value(count: str) -> str:
    """'seven' -> '7'; digits as they are."""
    return str(NUMBER_WORDS.index(count.lower())) if count.lower() in NUMBER_WORDS else count


def things(words: str) -> list[str]:
    """The words a count counts ('cells', 'prompt tokens'), singular, up to the first glue word."""
    out = []
    for word in words.split():
        word = word.strip("()'").lower()
        if word in GLUE or not word.isalpha():
            break
        out.append(word[:-1] if word.endswith("s") else word)
    return out


def unprinted_counts(sentence: str, outputs: list[str]) -> list[str]:
    """The fractions and maxima of counts in ``sentence`` that no single output in ``outputs`` prints as such."""
    missing = []
    for m in FRACTION.finditer(sentence):
        part, whole, nouns = count_value(m.group(1)), count_value(m.group(2)), things(m.group(3))
        fraction = re.compile(rf"(?<![\d.]){part}\s*(?:of(?: the| its)?|/)\s*{whole}(?![\d])")
        if nouns and not any(fraction.search(out) and any(n in out.lower() for n in nouns) for out in outputs):
            missing.append(" ".join(m.group().split()))
    for m in MAXIMUM.finditer(sentence):
        top = max(int(count_value(g)) for g in m.groups() if g)
        most = re.compile(rf"(?:max|most|best|largest|highest)\D{{0,40}}(?<![\d.]){top}(?![\d])", re.I)
        if not any(most.search(out) for out in outputs):
            missing.append(" ".join(m.group().split()))
    return missing


def unprinted(cells: list[dict]) -> list[tuple[int, str]]:
    """(cell, count) for every fraction or maximum the prose states that no output of its section prints as
    such (nor of a section its sentence names; the exercises and appendix answer to the whole notebook)."""
    pieces = parts(cells)
    outputs: dict[int, list[str]] = {-1: []}
    for i, sec, _ in pieces:
        if cells[i]["cell_type"] == "code":
            printed = "\n".join("".join(out.get("text", "")) or "".join(out.get("data", {}).get("text/plain", ""))
                                for out in cells[i].get("outputs", []))
            outputs.setdefault(sec, []).append(printed)
            outputs[-1].append(printed)
    missing = []
    for i, sec, text in pieces:
        if cells[i]["cell_type"] == "markdown":
            for sentence in sentences(text):
                named = {sec} | {int(n) for n in SECTION_CUE.findall(sentence)}
                scope = [out for s in named for out in outputs.get(s, [])]
                missing += [(i, count) for count in unprinted_counts(sentence, scope)]
    return missing


@pytest.mark.parametrize("stem", NAMES)
def test_a_count_the_prose_states_is_printed_as_a_count(stem):
    missing = unprinted(committed(stem))
    assert not missing, f"{stem}: fractions or maxima of counts that no output of their section prints as such " \
                        f"(cell, words): {missing[:8]}; print the count, or say what the output shows"


def test_the_count_check_catches_counts_read_off_a_figure_or_another_count():
    def code(out):
        return {"cell_type": "code", "source": ["..."], "outputs": [{"output_type": "stream", "text": [out]}]}

    def md(text):
        return {"cell_type": "markdown", "source": [text]}
    heads = "KV heads (of 3) holding the value whole, per layer:\n  snapkv 0 1 2 3 2 1\n"
    cells = [md("## 1. Needle"), code("L0 KV0: '___815'   value 3/5\n" + heads),
             md("SnapKV holds it in one or two heads of a layer at best."),          # the printed counts reach 3
             md("In 3 of the 5 samples the needle lies in the window."),              # 3/5 counts digits, not samples
             md("Alone in at least two of the three rows, a token comes back."),      # a threshold: not checked
             md("## 2. Table"), code("lower in 7 of 8 cells\nmax heads per layer: 3\n"),
             md("Accuracy is lower in seven of the eight cells."), md("Three heads at best."),
             md("Lower in three of the eight cells.")]
    assert unprinted(cells) == [(2, "one or two heads of a layer at best"), (3, "3 of the 5 samples the needle"),
                                (9, "three of the eight cells")]
