"""
The course (``course/``): markers, student copies, the grader. What must hold for every assignment:

* the reference solution (this repository) gets full marks;
* its student copy gets zero, every test failing with ``NotImplementedError`` (not an import or syntax
  error), and no line of a solution leaks into the copy;
* grading one assignment takes less than 90 s on 2 cores;
* unbalanced or nested markers are reported with file and line.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from course import grade, handout, mutants
from course.assignments import ASSIGNMENTS, ROOT, scanned_files
from course.markers import MarkerError, find_regions, hand_out, strip
from tests.course.test_grader import graded_here

NAMES = sorted(ASSIGNMENTS)
GRADE_LIMIT_S = 90


def some_in_the_slow_tier(*kept: str) -> list:
    """Every assignment, those not ``kept`` marked heavy: the slow tier grades the library's assignment (cache)
    and at most one method's, ``--runheavy`` all of them (run it after changing an assignment's tests)."""
    return [n if n in kept else pytest.param(n, marks=pytest.mark.heavy) for n in NAMES]
SHEET_SECTIONS = ("## Goal", "## Read", "## Tasks", "## Budget", "## Written questions")


# -- markers ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, line, what", [
    ("x = 1\n# BEGIN SOLUTION [a] h\ny = 2\n# BEGIN SOLUTION [a] h\n# END SOLUTION\n", 4, "nest"),
    ("x = 1\n# END SOLUTION\n", 2, "without a BEGIN"),
    ("x = 1\n\n# BEGIN SOLUTION [a] h\ny = 2\n", 3, "never closed"),
    ("# BEGIN SOLUTION [a]\ny = 2\n# END SOLUTION\n", 1, "no hint"),
    ("#  BEGIN SOLUTION a h\n", 1, "cannot parse"),
])
def test_bad_markers_are_reported_with_file_and_line(tmp_path, text, line, what):
    path = tmp_path / "f.py"
    path.write_text(text)
    with pytest.raises(MarkerError, match=rf"^{re.escape(str(path))}:{line}: .*{what}"):
        find_regions(path)


def test_markdown_markers(tmp_path):
    path = tmp_path / "sheet.md"
    path.write_text("Q1\n<!-- BEGIN SOLUTION [a] model answer -->\nthe answer\n<!-- END SOLUTION -->\nQ2\n")
    assert strip(path, "a") == "Q1\n*(your answer)*\nQ2\n"
    path.write_text("<!-- END SOLUTION -->\n")
    with pytest.raises(MarkerError, match=r":1: END SOLUTION without"):
        find_regions(path)


def test_strip_replaces_one_assignments_regions_at_their_indentation(tmp_path):
    path = tmp_path / "f.py"
    path.write_text("def f(x):\n    # BEGIN SOLUTION [a] double it\n    return 2 * x\n    # END SOLUTION\n\n"
                    "def g(x):\n    # BEGIN SOLUTION [b] halve it\n    return x / 2\n    # END SOLUTION\n")
    out = strip(path, "a")
    assert "    raise NotImplementedError('a: double it')" in out and "2 * x" not in out
    assert "return x / 2" in out and "# BEGIN SOLUTION [b] halve it" in out     # another assignment's region stays
    namespace = {}
    exec(compile(out, "f.py", "exec"), namespace)
    with pytest.raises(NotImplementedError, match="a: double it"):
        namespace["f"](1)


def test_every_marker_in_the_repository_parses_and_belongs_to_its_assignment():
    for path in scanned_files():
        for r in find_regions(path):                      # raises, with file and line, on a bad marker
            assert r.assignment in ASSIGNMENTS, f"{path}:{r.begin}: unknown assignment {r.assignment!r}"
            assert path in ASSIGNMENTS[r.assignment].sources(), \
                f"{path}:{r.begin}: a region of {r.assignment!r} outside its files (course/assignments.py)"


# -- what every assignment has ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_assignment_has_regions_sheet_adapters_and_tests(name):
    a = ASSIGNMENTS[name]
    library = [r for r in a.regions() if str(r.path.relative_to(ROOT)) in a.library]
    assert library, f"{name}: no solution region in its library files {a.library}"
    for section in SHEET_SECTIONS:
        assert section in a.sheet.read_text(), f"{a.sheet}: no '{section}' section"
    assert (a.folder / "adapters.py").exists()
    public, hidden = (grade.points_of(a.folder / f) for f in ("test_public.py", "test_hidden.py"))
    assert public and hidden, f"{name}: needs public and hidden tests"
    text = a.sheet.read_text()
    tasks = text.split("## Tasks")[1].split("\n## ")[0]
    task_points = sum(int(n) for n in re.findall(r"(\d+) points?\)", tasks))
    tested = sum(public.values()) + sum(hidden.values())
    assert task_points == tested, f"{a.sheet}: the tasks give {task_points} points, the tests {tested:g}"
    assert f"Autograded: {tested:g} points ({sum(public.values()):g} public, {sum(hidden.values()):g} hidden)" in tasks
    written = text.split("## Written questions")[1].split("\n## ")[0]
    questions = re.findall(r"^\d+\. \*\*.+?\*\* \((\d+) points\)", written, flags=re.M)
    assert questions, f"{a.sheet}: written questions give their points as '1. **Title** (N points)'"
    assert written.count("Rubric:") == len(questions), f"{a.sheet}: every written question needs a rubric"
    assert len([r for r in a.regions() if r.path == a.sheet]) == len(questions), "a model answer per question"


@pytest.mark.parametrize("name", NAMES)
def test_every_test_grades_one_task_and_every_task_is_graded(name):
    """Each region of the library names its task; each test names the task it grades; the two sets agree, and
    the sheet gives each task the points of its tests."""
    a = ASSIGNMENTS[name]
    library = [r for r in a.regions() if str(r.path.relative_to(ROOT)) in a.library]
    assert all(r.task for r in library), [f"{r.path}:{r.begin}" for r in library if not r.task]
    marks = {n: m for t in a.tests() for n, m in grade.marks_of(t).items()}
    assert all(task for _, task in marks.values()), [n for n, (_, task) in marks.items() if not task]
    assert {task for _, task in marks.values()} == {r.task for r in library}
    tasks = a.sheet.read_text().split("## Tasks")[1].split("\n## ")[0]
    for task in {r.task for r in library}:
        points = sum(p for p, t in marks.values() if t == task)
        assert re.search(rf"task `{task}`, {points:g} points?\b", tasks), \
            f"{a.sheet}: the task list must say 'task `{task}`, {points:g} points'"


# -- grading: reference full marks, student copy zero, no leaks, time ---------------------------------------

def code(line: str) -> str:
    """A line without its trailing comment and indentation."""
    return re.sub(r"\s+#.*$", "", line).strip()


def region_lines(name: str) -> dict[Path, set[str]]:
    """Per file, the solution lines of ``name`` worth checking for a leak (their code, comments stripped):
    long enough to be distinctive and not also written elsewhere in the same file, outside the regions."""
    out = {}
    for path in ASSIGNMENTS[name].sources():
        if not path.exists():
            continue
        lines = path.read_text().splitlines()
        regions = [r for r in find_regions(path) if r.assignment == name]
        inside = {n for r in regions for n in range(r.begin - 1, r.end)}
        outside = "\n".join(lines[n] for n in range(len(lines)) if n not in inside)
        strip_ = str.strip if path.suffix == ".md" else code
        body = {strip_(line) for r in regions for line in r.body(lines)}
        out[path] = {s for s in body if len(s) >= 16 and s not in outside and not s.startswith("#")}
    return out


@pytest.mark.parametrize("name", NAMES)
def test_no_hint_quotes_its_solution(name):
    """A hint says what to do, not the code: no solution line (or its right-hand side) of 12 characters or
    more appears in the hint of its region."""
    for path in ASSIGNMENTS[name].sources():
        if not path.exists() or path.suffix == ".md":
            continue
        lines = path.read_text().splitlines()
        for r in find_regions(path):
            for line in r.body(lines) if r.assignment == name else []:
                c = code(line)
                for part in {c, c.split("=", 1)[-1].strip()}:
                    assert len(part) < 12 or part not in r.hint, f"{path}:{r.begin}: the hint quotes {part!r}"


def message_texts(path: Path) -> list[str]:
    """The text a test file's messages can print: its string literals and f-strings' literal parts (each as
    the grader compares them, whitespace collapsed), less the docstrings, which no failure prints."""
    import ast
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
           and id(node) not in docs]                       # f-strings' literal parts are Constants too
    return [" ".join(t.split()) for t in out]


@pytest.mark.parametrize("name", NAMES)
def test_no_public_message_quotes_the_hidden_tests(name):
    """The grader withholds a public test's message that shares grade.QUOTE characters in a row with the hidden
    tests (``grade.withhold_hidden_text``): a public message copied from a hidden one would reach the student as
    "withheld" instead of its hint."""
    hidden = " ".join((ROOT / "course" / name / "test_hidden.py").read_text().split())
    quotes = {hidden[i:i + grade.QUOTE] for i in range(len(hidden) - grade.QUOTE + 1)}
    shared = [t for t in message_texts(ROOT / "course" / name / "test_public.py")
              if any(t[i:i + grade.QUOTE] in quotes for i in range(len(t) - grade.QUOTE + 1))]
    assert not shared, f"{name}: public messages that the hidden tests also say (reword one): {shared[:3]}"


def test_the_quote_check_sees_a_shared_message(tmp_path):
    f = tmp_path / "t.py"
    f.write_text('"""A docstring the grader never prints, shared with the hidden tests word for word."""\n'
                 'x = f"{1}: the keep mask (B, H_kv, T), True at the slots of the sinks"\n')
    texts = message_texts(f)
    assert texts == [": the keep mask (B, H_kv, T), True at the slots of the sinks"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_reference_solution_gets_full_marks(name):
    graded_here(name)
    t0 = time.perf_counter()
    summary = grade.grade(name)
    elapsed = time.perf_counter() - t0
    failed = [(r["name"], r["output"]) for r in summary["results"] if r["status"] != "passed"]
    assert not failed, f"{name}: the reference fails {failed}\n{summary['log'][-3000:]}"
    assert summary["score"] == summary["max_score"] > 0 and summary["hidden_tests"]
    assert elapsed < GRADE_LIMIT_S, f"grading {name} took {elapsed:.0f} s"


@pytest.mark.slow
@pytest.mark.parametrize("name", some_in_the_slow_tier("cache", "chunkkv"))
def test_student_copy_gets_zero(name, tmp_path):
    graded_here(name)
    out = tmp_path / "copy"
    handout.main([name, "--out", str(out)])
    t0 = time.perf_counter()
    summary = grade.grade(name, out)
    elapsed = time.perf_counter() - t0
    assert summary["score"] == 0 and summary["max_score"] > 0
    wrong = [(r["name"], r["output"]) for r in summary["results"] if "NotImplementedError" not in r["output"]]
    assert not wrong, f"{name}: student-copy tests must fail with NotImplementedError, got {wrong}"
    assert elapsed < GRADE_LIMIT_S, f"grading {name}'s student copy took {elapsed:.0f} s"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_student_copy_leaks_nothing(name, tmp_path):
    out = tmp_path / "copy"
    handout.main([name, "--out", str(out)])
    assert not list(out.rglob("test_hidden.py")), "hidden tests must not be in a student copy"
    assert "instructor pack" in (out / "results" / "course_mutants.txt").read_text(), \
        "the mutants' report quotes solution lines: a student copy holds a note in its place"
    for path, lines in region_lines(name).items():
        rel = path.relative_to(ROOT)
        copied = (out / rel).read_text()
        leaked = [s for s in lines if s in copied]
        assert not leaked, f"{rel} in the student copy still has solution lines: {leaked[:3]}"
        if path.suffix == ".py" and path.parent.name == "notebooks":
            notebook = json.loads((out / rel.with_suffix(".ipynb")).read_text())
            code = "\n".join("".join(c["source"]) for c in notebook["cells"])
            assert not [s for s in lines if s in code], f"{rel.with_suffix('.ipynb')} leaks solution lines"
    solution = {s for lines in region_lines(name).values() for s in lines}
    for notebook in sorted((out / "notebooks").glob("*.ipynb")):    # committed outputs are kept in the copy:
        cells = json.loads(notebook.read_text())["cells"]            # none may print a solution line
        printed = "\n".join(str(o.get("text", "")) + json.dumps(o.get("data", {}).get("text/plain", ""))
                            for c in cells if c["cell_type"] == "code" for o in c.get("outputs", []))
        assert not [s for s in solution if s in printed], \
            f"{notebook.name}'s outputs print solution lines of {name}: {[s for s in solution if s in printed][:3]}"
    with_regions = {p for p in scanned_files() if find_regions(p)}
    for rel in handout.repository_files():                # everything else is the library unchanged
        src = ROOT / rel
        instructor_only = rel.endswith(("test_hidden.py", "mutants.py", ".ipynb", "sheet.md", "course_mutants.txt"))
        if src not in with_regions and not instructor_only and rel != "README.md":   # README: points to STUDENT.md
            assert (out / rel).read_bytes() == src.read_bytes(), f"{rel} changed in the student copy"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_a_copy_holds_no_later_assignment_and_no_marker(name, tmp_path):
    # The copy of one assignment holds the code of its prerequisites (and of --released ones), a stub for
    # every other assignment's regions, and no marker: handing out `baselines` must not hand out ChunkKV.
    out = tmp_path / "copy"
    handout.main([name, "--out", str(out)])
    kept = handout.release_plan(ASSIGNMENTS[name])
    for path in scanned_files():
        rel = path.relative_to(ROOT)
        if path.suffix == ".py" and (out / rel).exists():
            assert find_regions(out / rel) == [], f"{rel}: a solution marker in the student copy"
    for other in NAMES:
        leaked = {str(p.relative_to(ROOT)): [s for s in lines if s in (out / p.relative_to(ROOT)).read_text()]
                  for p, lines in region_lines(other).items() if p.suffix == ".py"}
        leaked = {k: v[:2] for k, v in leaked.items() if v}
        if other in kept:
            assert leaked, f"{other}: a prerequisite of {name}, its code should be in the copy"
        elif other != name:
            assert not leaked, f"{other} is not handed out with {name}, yet the copy holds its solution: {leaked}"
    page = (out / "STUDENT.md").read_text()                  # the student's first page: do, check, hand in
    assert all(f"python -m course.{c} {name}" in page for c in ("grade", "submit", "measure"))
    assert f"course/{name}/sheet.md" in page
    assert "pip install -r requirements-student.txt" in page and (out / "requirements-student.txt").is_file()
    assert "course/Dockerfile" in page and (out / "course" / "Dockerfile").is_file()
    assert "[STUDENT.md](STUDENT.md)" in (out / "README.md").read_text().split("\n", 1)[0]
    later = [n for n in NAMES if n not in kept and n != name][:1]
    if later:
        again = tmp_path / "released"
        handout.main([name, "--out", str(again), "--released", later[0]])
        assert any(s in (again / p.relative_to(ROOT)).read_text()
                   for p, lines in region_lines(later[0]).items() if p.suffix == ".py" for s in lines)


@pytest.mark.slow
@pytest.mark.parametrize("name", some_in_the_slow_tier("critical_kv"))
def test_the_prerequisites_are_enough_to_pass(name, tmp_path):
    # `requires` is right when the handed-out assignment's reference, put into its copy (every later
    # assignment a stub), gets full marks: its tests run no code the copy does not hold.
    graded_here(name)
    out = tmp_path / "copy"
    handout.student_copy(ASSIGNMENTS[name], out)
    kept = handout.release_plan(ASSIGNMENTS[name]) | {name}
    for rel in ASSIGNMENTS[name].library:
        (out / rel).write_text(hand_out(ROOT / rel, "", kept))
    summary = grade.grade(name, out)
    failed = [(r["name"], r["output"][:300]) for r in summary["results"] if r["status"] != "passed"]
    assert not failed, f"{name} needs more than {sorted(kept - {name})}: {failed[:3]}"


def test_without_git_a_copy_takes_every_file_but_what_git_ignores(tmp_path, monkeypatch):
    """A tree without git (a copy of it sent to a lent GPU machine): the handout copies its files, not the caches,
    the carried wheels or a training run that ``.gitignore`` keeps out of a checkout."""
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")
    kept = ["README.md", "nanollm/model.py", "notebooks/build/figure.py"]         # a folder named build below the root
    ignored = [".gpu_cache/wheels/torch.whl", "runs/tiny/ckpt.pt", "build/lib/x.py", "nanollm/__pycache__/m.pyc",
               "book/node_modules/a/index.js", "nanokv.egg-info/PKG-INFO", "book/_build/index.html"]
    for rel in kept + ignored:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    monkeypatch.setattr(handout, "ROOT", tmp_path)
    monkeypatch.setattr(handout.subprocess, "run", no_git)
    assert handout.repository_files() == sorted(kept)


@pytest.mark.slow
@pytest.mark.parametrize("name", some_in_the_slow_tier())          # a mutants run: all with --runheavy
def test_a_call_to_a_shipped_function_scores_nothing(name):
    """The hand-written mutants that make a region call a function shipped with the copy (a reference, a kernel,
    another method's helper): each is killed (its task loses at least half its points). A function that
    computes the answer is a region of the same task, so in a student copy it raises too; graded here on the
    reference, the points such a mutant keeps are those of the task's other implementations' tests (kvreviver:
    2 of 8), or the call computes something else (baselines: CriticalKV's mean window attention keeps 3 of 10)."""
    graded_here(name)
    calls = [m for m in mutants.hand(name) if " calls " in f" {m.name} "]
    if not calls:
        pytest.skip(f"course/{name}/mutants.py: no function shipped with the copy computes a task's answer")
    planned = [p for p in mutants.mutants_of(name, only="hand") if p.mutant in calls]
    report = mutants.run_mutants(name, planned, progress=False)
    assert not report.reference_failures
    kept = [(o.mutant.name, o.kept, o.max_score, o.passing) for o in report.outcomes if not o.killed]
    assert not kept, f"{name}: a region that calls a shipped function keeps half its task's points: {kept}"


@pytest.mark.slow
def test_instructor_pack_has_every_solution(tmp_path):
    handout.main(["cache", "--solutions", "--out", str(tmp_path / "key")])
    text = (tmp_path / "key" / "solutions.md").read_text()
    for lines in region_lines("cache").values():
        assert all(s in text for s in lines)
    assert (tmp_path / "key" / "test_hidden.py").exists() and (tmp_path / "key" / "sheet.md").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", some_in_the_slow_tier("cache", "baselines"))
def test_doing_nothing_scores_nothing(name, tmp_path):
    """Every solution replaced by ``pass``: no test may pass (each checks that the work was done)."""
    graded_here(name)
    handout.student_copy(ASSIGNMENTS[name], tmp_path / "copy", stub="pass")
    summary = grade.grade(name, tmp_path / "copy")
    passed = [r["name"] for r in summary["results"] if r["status"] == "passed"]
    assert not passed, f"{name}: these tests pass with empty solutions: {passed}"


@pytest.mark.slow
def test_a_pack_holds_only_the_graded_files_and_grades_as_the_whole_copy(tmp_path, capsys):
    # course.submit packs the library files, adapters and writeup; the grader lays the pack over a pristine
    # copy: the solved pack gets full marks, the untouched one nothing, and a pack of another assignment is refused.
    from course import submit
    name = "critical_kv"
    graded_here(name)
    copy = tmp_path / "copy"
    handout.main([name, "--out", str(copy)])
    submit.main([name, "--copy", str(copy), "--out", str(tmp_path / "untouched.zip")])
    assert "stub(s) of the handed-out tasks are still" in capsys.readouterr().out
    kept = handout.release_plan(ASSIGNMENTS[name]) | {name}
    for rel in ASSIGNMENTS[name].library:
        (copy / rel).write_text(hand_out(ROOT / rel, "", kept))
    (copy / "README.md").write_text("changed by the student: not graded, not packed\n")
    submit.main([name, "--copy", str(copy), "--out", str(tmp_path / "solved.zip")])
    import zipfile
    for zip_name, expected in (("solved.zip", None), ("untouched.zip", 0)):
        with zipfile.ZipFile(tmp_path / zip_name) as z:
            figure = f"course/{name}/measure/figure.png"                           # not made here: left out
            assert sorted(z.namelist()) == sorted(n for n in [submit.MANIFEST, *submit.graded_files(
                ASSIGNMENTS[name])] if n != figure)
            z.extractall(tmp_path / zip_name.removesuffix(".zip"))
        summary = grade.grade(name, tmp_path / zip_name.removesuffix(".zip"))
        assert summary["score"] == (summary["max_score"] if expected is None else expected) and summary["max_score"] > 0
    with pytest.raises(SystemExit, match="is a pack of 'critical_kv', not of 'chunkkv'"):
        grade.grade("chunkkv", tmp_path / "solved")


def test_the_students_requirements_are_the_developers_own_pins_minus_the_tools():
    # requirements-student.txt (a copy's set-up, course/Dockerfile's) takes each package with the same
    # specifier and marker as requirements.txt, so a student runs what the tests ran; it leaves out the
    # development tools (linter, notebook runner, real-model references) and keeps what a copy imports.
    def specs(path):
        lines = [line.split("#")[0].strip() for line in (ROOT / path).read_text().splitlines()]
        return {re.split(r"[=<>~;! ]", line, maxsplit=1)[0]: line for line in lines if line}
    student, developer = specs("requirements-student.txt"), specs("requirements.txt")
    assert all(developer.get(name) == line for name, line in student.items()), student
    assert {"torch", "numpy", "tiktoken", "tqdm", "matplotlib", "pytest", "jupyterlab", "triton"} == set(student)
    assert not {"ruff", "transformers", "nbclient", "pytest-xdist"} & set(student)
    docker = (ROOT / "course" / "Dockerfile").read_text()
    assert "requirements-student.txt" in docker and "TRITON_INTERPRET=1" in docker
