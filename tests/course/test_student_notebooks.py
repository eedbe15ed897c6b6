"""
The student copy teaches: its notebook keeps the committed outputs, a cell that needs an unfinished task
stops at its first line with a ``NotImplementedError`` naming the task (``course.lesson.needs``), every
other cell runs, and the copy has a writeup template with the sheet's written questions.

The fast tests read and write files only; the slow ones execute each student notebook in quick mode
(``NANOLLM_TINY=1``), one kernel per notebook.
"""

from __future__ import annotations

import json
import os
import re
import time

import nbformat
import pytest

from course import handout, lesson
from course.assignments import ASSIGNMENTS, ROOT
from course.markers import find_regions
from tests.notebooks.test_notebooks import missing_model

NAMES = sorted(ASSIGNMENTS)
CELL_TIMEOUT_S = 120
CALL = re.compile(r'^from course\.lesson import needs; needs\("(?P<name>\w+)", (?P<tasks>"\w+"(?:, "\w+")*)\)$')


def tasks_of(name: str) -> list[str]:
    return list(dict.fromkeys(r.task for r in ASSIGNMENTS[name].regions() if r.task))


def needed(source: str) -> list[str] | None:
    """The tasks a student cell's first line waits for, or None where it has no ``needs`` call."""
    m = CALL.match(source.split("\n", 1)[0])
    return None if m is None else re.findall(r'"(\w+)"', m["tasks"])


def reference_cells(name: str) -> tuple[list, list]:
    """(the cells of the notebook's source, with the course's markers; the committed notebook's cells)."""
    source = ROOT / "notebooks" / f"{ASSIGNMENTS[name].notebook}.py"
    return (handout.notebook_builder().read_percent(source, page=False).cells,
            nbformat.read(source.with_suffix(".ipynb"), 4).cells)


def exercise(name: str, source: str) -> bool:
    """Whether a reference cell holds a region of the assignment (a notebook exercise, stripped in the copy)."""
    return any(r.assignment == name for r in find_regions("cell.py", source))


# -- fast: the stripped notebook, needs, the writeup ------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_needs_lines_open_code_cells_and_name_the_assignments_tasks(name):
    source = ROOT / "notebooks" / f"{ASSIGNMENTS[name].notebook}.py"
    text = handout.needs_calls(ASSIGNMENTS[name], source)       # refuses a misplaced line or an unknown task
    assert "# needs:" not in text
    cells, _ = reference_cells(name)
    marked = [c for c in cells if c.cell_type == "code" and lesson.needed(c.metadata.get("tags", []))]
    assert marked, f"{source.name}: no cell needs a task of {name!r}"
    assert not lesson.needed(next(c for c in cells if c.cell_type == "code").metadata.get("tags", [])), \
        "the set-up cell needs no task"
    assert not [c for c in cells if c.cell_type == "code" and c.source.startswith("# needs:")], \
        "a course marker is a cell tag, not a comment the reader has to read past"
    numbers = [lesson.sheet_number(name, t) for t in tasks_of(name)]
    assert None not in numbers and len(set(numbers)) == len(numbers), \
        f"the sheet's task list gives each task its own item: {dict(zip(tasks_of(name), numbers))}"


def test_a_misplaced_or_unknown_needs_line_is_refused(tmp_path):
    a = ASSIGNMENTS["baselines"]
    for text, what in [("# %%\nx = 1\n# needs: window_vote\n", "'# needs:' comment: name the tasks in the cell's tags"),
                       ('# %% [markdown] tags=["needs:window_vote"]\n# text\n', "is on a markdown cell"),
                       ('# %% tags=["needs:window_votes"]\nx = 1\n', "'window_votes', not a task of 'baselines'")]:
        path = tmp_path / "nb.py"
        path.write_text(text)
        with pytest.raises(SystemExit, match=rf"^error: {re.escape(str(path))}:\d+: .*{re.escape(what)}"):
            handout.needs_calls(a, path)
    path.write_text('# %% tags=["raises-exception", "needs:window_vote"]\nx = 1\n')
    assert handout.needs_calls(a, path).splitlines()[1:3] == lesson.call("baselines", ["window_vote"])


@pytest.mark.parametrize("name", NAMES)
def test_student_notebook_keeps_outputs_and_starts_cells_with_needs(name, tmp_path):
    written = handout.lesson_notebook(ASSIGNMENTS[name], tmp_path, name, handout.release_plan(ASSIGNMENTS[name]))
    py, ipynb = written
    student = nbformat.read(ipynb, 4).cells
    reference, committed = reference_cells(name)
    assert [(c.cell_type, c.source) for c in student] == \
        [(c.cell_type, c.source) for c in handout.notebook_builder().read_percent(py).cells], \
        "the copy's .py and .ipynb have the same cells"
    assert len(student) == len(committed)
    for i, (new, old, ref) in enumerate(zip(student, committed, reference)):
        assert new.cell_type == old.cell_type and new.get("id") == old.get("id")
        if new.cell_type != "code":
            assert new.source == old.source
            continue
        tasks = lesson.needed(ref.metadata.get("tags", []))
        own = [t for t in tasks if ":" not in t]                    # others' tasks: a call of their own after
        if new.source.startswith(handout.REFERENCE_CELL[0]):         # an exercise's reference: a note instead
            assert exercise(name, ref.source) and new.outputs == [], f"cell {i}"
            assert not new.metadata.get("jupyter", {}).get("source_hidden"), f"cell {i}: the note is shown"
            continue
        if tasks:
            assert needed(new.source) == own, f"cell {i}: {new.source[:200]!r}"
            note = new.source.split("\n")[1]
            assert note.startswith("# runs once task") and all(t in note for t in own)
            calls = 2 * len({t.rpartition(":")[0] for t in tasks})  # a call and a note per assignment
            rest = "\n".join(new.source.split("\n")[calls:])
            ref_rest = ref.source
        else:
            assert needed(new.source) is None
            rest, ref_rest = new.source, ref.source
        if exercise(name, ref.source):
            assert "raise NotImplementedError(" in rest and rest != ref_rest
            assert new.outputs == [] and new.execution_count is None, f"cell {i}: a stripped exercise keeps no output"
        else:
            assert rest == ref_rest, f"cell {i} changed beyond its needs line"
            if any(line in shown(old) for line in solution_lines(name)):
                assert new.outputs == [] and new.execution_count is None, f"cell {i} printed a solution line"
            else:
                assert new.outputs == old.outputs and new.execution_count == old.execution_count, \
                    f"cell {i}: the committed outputs are kept"
    assert any(c.get("outputs") for c in student if c.cell_type == "code")
    text = json.dumps([c.get("outputs", []) for c in student])      # the kept outputs show no solution line
    for line in solution_lines(name):
        assert line not in text and json.dumps(line)[1:-1] not in text, \
            f"the student notebook's outputs show {line!r} of a solution"


def solution_lines(name: str) -> set[str]:
    """The assignment's solution lines (code, comments cut, 16 characters or more) in its Python files."""
    out = set()
    for path in (p for p in ASSIGNMENTS[name].sources() if p.suffix == ".py" and p.exists()):
        lines = path.read_text().splitlines()
        for r in (r for r in find_regions(path) if r.assignment == name):
            out |= {t for t in (re.sub(r"\s+#.*$", "", line).strip() for line in r.body(lines))
                    if len(t) >= 16 and not t.startswith("#")}
    return out


def shown(cell) -> str:
    """A code cell's committed outputs as text."""
    return json.dumps(cell.get("outputs", [])) + "".join(str(o.get("text", "")) for o in cell.get("outputs", []))


def test_needs_raises_until_the_task_is_done(tmp_path):
    """In a copy, ``needs`` names each unfinished task and its sheet number, and is silent once it is done."""
    for rel in ["course/baselines/sheet.md", *ASSIGNMENTS["baselines"].library]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(handout.strip(ROOT / rel, "baselines"))
    with pytest.raises(NotImplementedError, match=r"^runs once tasks h2o_observe \(sheet task 2\) and window_vote "
                                                  r"\(sheet task 3\) are done: methods/h2o.py, methods/snapkv.py"):
        lesson.needs("baselines", "h2o_observe", "window_vote", root=tmp_path)
    (tmp_path / "methods" / "snapkv.py").write_text((ROOT / "methods" / "snapkv.py").read_text())
    with pytest.raises(NotImplementedError, match=r"^runs once task h2o_observe \(sheet task 2\) is done"):
        lesson.needs("baselines", "h2o_observe", "window_vote", root=tmp_path)
    lesson.needs("baselines", "window_vote", root=tmp_path)
    lesson.needs("baselines", *tasks_of("baselines"))              # the reference: every task done


def sheet_questions(name: str) -> list[tuple[str, str]]:
    """(title, points) of each written question, as the sheet gives them."""
    written = ASSIGNMENTS[name].sheet.read_text().split("## Written questions")[1].split("\n## ")[0]
    return re.findall(r"^\d+\. \*\*(.+?)\*\* \((\d+) points\)", written, flags=re.M)


@pytest.mark.parametrize("name", NAMES)
def test_writeup_template_lists_the_questions_without_answers(name):
    a = ASSIGNMENTS[name]
    template, key = handout.writeup(a), handout.writeup(a, rubric=True)
    questions = sheet_questions(name)
    assert questions
    for n, (title, points) in enumerate(questions, 1):
        assert f"## {n}. {title} ({points} points)" in template and f"## {n}. {title} ({points} points)" in key
    assert f"Total: {sum(int(p) for _, p in questions)} points." in template
    assert template.count("*(your answer)*") == len(questions)
    assert "Rubric" not in template and key.count("**Rubric.**") == len(questions)
    sheet = a.sheet.read_text().splitlines()
    for r in find_regions(a.sheet):                               # the model answers: only in the key
        for line in r.body(sheet):
            if len(line.strip()) > 20:
                assert line.strip() not in template and line.strip() in key


def test_instructor_pack_has_the_mutants_and_their_report(tmp_path, monkeypatch):
    report = tmp_path / "course_mutants.txt"
    report.write_text("== cache: 3 mutants, 2 killed\n   survivors:\n   [mask] '<' for '<='\n"
                      "       acceptable: equal positions never meet\n\n== baselines: 1 mutants\n\n1 killed\n")
    monkeypatch.setattr(handout, "MUTANTS_REPORT", report)
    assert handout.mutants_section(ASSIGNMENTS["cache"], report)[-1].strip() == "acceptable: equal positions never meet"
    files = handout.instructor_pack(ASSIGNMENTS["cache"], tmp_path / "key")
    names = {f.name for f in files}
    assert {"solutions.md", "writeup_rubric.md", "test_hidden.py", "sheet.md"} <= names
    assert ("mutants.py" in names) == (ASSIGNMENTS["cache"].folder / "mutants.py").exists()
    solutions = (tmp_path / "key" / "solutions.md").read_text()
    assert "## Mutants that survive the tests" in solutions and "equal positions never meet" in solutions
    assert "== baselines" not in solutions


# -- slow: each student notebook executed in quick mode ---------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", [n if n in ("cache", "baselines") else pytest.param(n, marks=pytest.mark.heavy)
                                  for n in NAMES])           # two in the slow tier, all eight with --runheavy
def test_student_notebook_runs_but_the_cells_of_unfinished_tasks(name, tmp_path):
    from nbclient import NotebookClient

    a = ASSIGNMENTS[name]
    if why := missing_model(ROOT / "notebooks" / f"{a.notebook}.py"):
        pytest.skip(why)
    copy = tmp_path / "copy"
    handout.student_copy(a, copy)
    assert not list(copy.glob("course/*/test_hidden.py")) and not list(copy.glob("course/*/mutants.py"))
    writeup = (copy / "course" / name / "writeup.md").read_text()
    for n, (title, points) in enumerate(sheet_questions(name), 1):
        assert f"## {n}. {title} ({points} points)" in writeup

    nb = nbformat.read(copy / "notebooks" / f"{a.notebook}.ipynb", 4)
    # the copy first, before what PYTHONPATH already names (where packages may live, as the kernel's ipykernel)
    path = os.pathsep.join([str(copy)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = {**os.environ, "NANOLLM_TINY": "1", "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=True, record_timing=False,
                   resources={"metadata": {"path": str(copy / "notebooks")}}).execute(env=env)
    print(f"{a.notebook}: the student copy's notebook in {time.perf_counter() - t0:.1f} s (quick mode)")

    reference, _ = reference_cells(name)                 # the source's cells, with the course's markers
    for i, (cell, ref) in enumerate(zip(nb.cells, reference)):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        tasks = needed(cell.source)
        if tasks is not None:
            assert errors, f"cell {i} needs {tasks} but ran"
            e = errors[0]
            assert e.ename == "NotImplementedError" and e.evalue.startswith("runs once task"), (i, e.ename, e.evalue)
            assert all(t in e.evalue for t in tasks), f"cell {i}: {e.evalue!r} does not name all of {tasks}"
        elif cell.source.startswith(handout.REFERENCE_CELL[0]):     # an exercise's reference: a note, it runs
            assert not errors and exercise(name, ref.source), f"cell {i}: {errors}"
        elif exercise(name, ref.source):
            assert errors and errors[0].ename == "NotImplementedError" and \
                errors[0].evalue.startswith((f"{name}: ", f"{name}, task ")), \
                f"cell {i}: a stripped exercise stops at its stub, got {[(e.ename, e.evalue) for e in errors]}"
        else:
            assert not errors, f"cell {i} needs no task but failed: {errors[0].ename}: {errors[0].evalue[:300]}"


@pytest.mark.slow
def test_a_later_assignments_cells_say_it_is_not_handed_out(tmp_path):
    # In a copy of `cache`, the baselines are not handed out: their code is a stub, and a cell of their
    # notebook that needs it stops saying so, not asking the student to write it.
    out = tmp_path / "copy"
    handout.student_copy(ASSIGNMENTS["cache"], out)
    text = (out / "notebooks" / "01_baselines.py").read_text()
    assert 'needs("baselines", ' in text and "BEGIN SOLUTION" not in text
    with pytest.raises(NotImplementedError, match="baselines's task window_vote .*not handed out yet"):
        lesson.needs("baselines", "window_vote", root=out)
    lesson.needs("cache", "append", root=ROOT)                  # the reference: nothing to wait for
    own = (out / "notebooks" / "00_nanollm_kv_cache.py").read_text()   # its own lesson's StreamingLLM cell
    assert 'needs("baselines", "sinks_and_recent")' in own
    released = tmp_path / "released"
    handout.student_copy(ASSIGNMENTS["cache"], released, released=["baselines"])
    lesson.needs("baselines", "sinks_and_recent", root=released)    # released: the cell runs
