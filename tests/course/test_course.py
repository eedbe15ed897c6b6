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

from course import grade, handout
from course.assignments import ASSIGNMENTS, ROOT, scanned_files
from course.markers import MarkerError, find_regions, strip

NAMES = sorted(ASSIGNMENTS)
GRADE_LIMIT_S = 90
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
    task_points = sum(int(n) for n in re.findall(r"\((\d+) points", tasks))
    tested = sum(public.values()) + sum(hidden.values())
    assert task_points == tested, f"{a.sheet}: the tasks give {task_points} points, the tests {tested:g}"
    assert f"Autograded: {tested:g} points ({sum(public.values()):g} public, {sum(hidden.values()):g} hidden)" in tasks
    written = text.split("## Written questions")[1].split("\n## ")[0]
    questions = re.findall(r"^\d+\. \*\*.+?\*\* \((\d+) points\)", written, flags=re.M)
    assert questions, f"{a.sheet}: written questions give their points as '1. **Title** (N points)'"
    assert written.count("Rubric:") == len(questions), f"{a.sheet}: every written question needs a rubric"
    assert len([r for r in a.regions() if r.path == a.sheet]) == len(questions), "a model answer per question"


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


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_reference_solution_gets_full_marks(name):
    t0 = time.perf_counter()
    summary = grade.grade(name)
    elapsed = time.perf_counter() - t0
    failed = [(r["name"], r["output"]) for r in summary["results"] if r["status"] != "passed"]
    assert not failed, f"{name}: the reference fails {failed}\n{summary['log'][-3000:]}"
    assert summary["score"] == summary["max_score"] > 0 and summary["hidden_tests"]
    assert elapsed < GRADE_LIMIT_S, f"grading {name} took {elapsed:.0f} s"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_student_copy_gets_zero_and_leaks_nothing(name, tmp_path):
    out = tmp_path / "copy"
    handout.main([name, "--out", str(out)])
    t0 = time.perf_counter()
    summary = grade.grade(name, out)
    elapsed = time.perf_counter() - t0
    assert summary["score"] == 0 and summary["max_score"] > 0
    wrong = [(r["name"], r["output"]) for r in summary["results"] if "NotImplementedError" not in r["output"]]
    assert not wrong, f"{name}: student-copy tests must fail with NotImplementedError, got {wrong}"
    assert elapsed < GRADE_LIMIT_S, f"grading {name}'s student copy took {elapsed:.0f} s"

    assert not list(out.rglob("test_hidden.py")), "hidden tests must not be in a student copy"
    for path, lines in region_lines(name).items():
        rel = path.relative_to(ROOT)
        copied = (out / rel).read_text()
        leaked = [s for s in lines if s in copied]
        assert not leaked, f"{rel} in the student copy still has solution lines: {leaked[:3]}"
        if path.suffix == ".py" and path.parent.name == "notebooks":
            notebook = json.loads((out / rel.with_suffix(".ipynb")).read_text())
            code = "\n".join("".join(c["source"]) for c in notebook["cells"])
            assert not [s for s in lines if s in code], f"{rel.with_suffix('.ipynb')} leaks solution lines"
            assert not any(c.get("outputs") for c in notebook["cells"]), "a student notebook has no outputs"
    for rel in handout.repository_files():                # everything else is the library unchanged
        src = ROOT / rel
        if src not in ASSIGNMENTS[name].sources() and not rel.endswith(("test_hidden.py", ".ipynb", "sheet.md")):
            assert (out / rel).read_bytes() == src.read_bytes(), f"{rel} changed in the student copy"


@pytest.mark.slow
def test_instructor_pack_has_every_solution(tmp_path):
    handout.main(["cache", "--solutions", "--out", str(tmp_path / "key")])
    text = (tmp_path / "key" / "solutions.md").read_text()
    for lines in region_lines("cache").values():
        assert all(s in text for s in lines)
    assert (tmp_path / "key" / "test_hidden.py").exists() and (tmp_path / "key" / "sheet.md").exists()


# -- command lines ------------------------------------------------------------------------------------------

def refused(capsys, main, argv) -> str:
    """The one ``error:`` line a command prints when it refuses, with exit status 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, (e.value.code, err)
    return err


def test_command_line_errors(tmp_path, capsys):
    assert "no assignment 'nope'; choose one of: cache" in refused(capsys, handout.main,
                                                                   ["nope", "--out", str(tmp_path / "x")])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("")
    assert "exists and is not empty" in refused(capsys, handout.main, ["cache", "--out", str(tmp_path / "full")])
    assert "inside the repository" in refused(capsys, handout.main, ["cache", "--out", str(ROOT / "course" / "x")])
    (tmp_path / "r.json").write_text("{}")
    assert "exists; name a new file" in refused(capsys, grade.main, ["cache", "--json", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match="no course/cache/adapters.py"):
        grade.grade("cache", tmp_path)


@pytest.mark.slow
def test_grader_writes_gradescope_json(tmp_path, capsys):
    grade.main(["cache", "--json", str(tmp_path / "results.json")])
    results = json.loads((tmp_path / "results.json").read_text())
    tests = results["tests"]
    assert results["score"] == sum(t["max_score"] for t in tests) > 0
    assert {t["visibility"] for t in tests} == {"visible", "after_published"}
    assert all(t["status"] == "passed" and set(t) >= {"name", "score", "max_score", "output"} for t in tests)
    printed = capsys.readouterr().out
    assert "public" in printed and "hidden" in printed and f"score: {results['score']:g} / " in printed


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_doing_nothing_scores_nothing(name, tmp_path):
    """Every solution replaced by ``pass``: no test may pass (each checks that the work was done)."""
    handout.student_copy(ASSIGNMENTS[name], tmp_path / "copy", stub="pass")
    summary = grade.grade(name, tmp_path / "copy")
    passed = [r["name"] for r in summary["results"] if r["status"] == "passed"]
    assert not passed, f"{name}: these tests pass with empty solutions: {passed}"


def solved_copy(tmp_path: Path) -> Path:
    """A student copy of ``cache`` with ``LayerKV.append`` solved (the reference pasted back)."""
    out = tmp_path / "copy"
    handout.main(["cache", "--out", str(out)])
    storage = ROOT / "nanollm" / "storage.py"
    (out / "nanollm" / "storage.py").write_text(storage.read_text())
    return out


def stub_in(path: Path, hint_start: str, body: str) -> None:
    """Replace the ``raise NotImplementedError('<hint_start>...`` line of a student file by ``body``."""
    lines = path.read_text().splitlines()
    i = next(n for n, line in enumerate(lines) if f"raise NotImplementedError('{hint_start}" in line)
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    lines[i:i + 1] = [indent + b for b in body.splitlines()]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.slow
def test_a_crash_and_a_hang_fail_alone(tmp_path):
    out = solved_copy(tmp_path)
    attention = out / "nanollm" / "attention.py"
    stub_in(attention, "cache: q as", "import os\n"                        # one query crashes the process
            "if q.shape[2] == 1:\n    os.abort()\n"                          # (the decode-probs test), more do not
            "B, H, C, d = q.shape\nH_kv = k.shape[1]\n"
            "return (q.reshape(B, H_kv, -1, d) / d ** 0.5 @ k.transpose(-1, -2)).view(B, H_kv, H // H_kv, C, -1)")
    stub_in(attention, "cache: may query", "while True:\n    pass")          # the mask hangs
    summary = grade.grade("cache", out, per_test_s=2)
    by_name = {r["name"]: r for r in summary["results"]}
    assert by_name["test_append_then_read"]["status"] == "passed", "a test before the crash keeps its pass"
    assert "stopped (exit code" in by_name["test_decode_probs_match_full_attention"]["output"]
    assert "TimeoutError" in by_name["test_masked_attention_sees_only_the_past"]["output"]
    assert all(r["output"] for r in summary["results"] if r["status"] == "failed"), "every failure says why"
    assert summary["score"] == 2


@pytest.mark.slow
def test_a_missing_module_is_not_borrowed_from_an_installed_checkout(tmp_path):
    out = solved_copy(tmp_path)
    (out / "nanollm" / "storage.py").unlink()
    summary = grade.grade("cache", out)
    assert summary["score"] == 0
    assert all("could not be collected" in r["output"] for r in summary["results"]), summary["results"][0]
