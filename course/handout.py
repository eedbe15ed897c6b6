"""
Write an assignment's student copy, or its instructor pack.

    python -m course.handout cache --out ~/hw-cache                 # the student copy
    python -m course.handout cache --solutions --out ~/hw-cache-key # the instructor pack

The student copy is the files git tracks with this assignment's solution regions replaced by
``raise NotImplementedError("<hint>")`` (``course.markers``), the sheets' model answers, the hidden tests and
the hand-written mutants left out, and ``course/<name>/writeup.md`` for the written answers; its topic notebook
is stripped the same way, and a cell tagged ``needs:TASK`` stops with the task's name until the task is done
(``course.lesson``). The instructor pack holds the solution notebook, the sheet with its model answers, the
adapters, the public and hidden tests, the hand-written mutants, the writeup with its rubric and
``solutions.md`` (every region, how to grade, the surviving mutants and why each is acceptable).
What each holds: course/README.md, section "For instructors", and section "The course's files".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from . import lesson
from .assignments import ASSIGNMENTS, ROOT, Assignment, check_name, command_line, get, refuse, scanned_files
from .markers import MD_BEGIN, find_regions, hand_out, strip

INSTRUCTOR_ONLY = ("test_hidden.py", "mutants.py")      # in each assignment's folder: never in a student copy
MUTANTS_REPORT = ROOT / "results" / "course_mutants.txt"    # ``python -m course.mutants all --out``'s report


def repository_files() -> list[str]:
    """The files of the repository, relative to the root: what git tracks plus new files it does not
    ignore (so an uncommitted change is handed out as it is); without git, every file but what .gitignore names."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split("\n")
        return sorted({f for f in out if f and (ROOT / f).is_file()})
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "__pycache__", ".pytest_cache", ".ipynb_checkpoints", ".ruff_cache", "node_modules", "_build"}
        top = {"runs", "build", ".gpu_cache"}                  # ignored at the root only (.gitignore)
        files = [p.relative_to(ROOT) for p in ROOT.rglob("*") if p.is_file()]
        return sorted(str(f) for f in files if not skip & set(f.parts) and f.parts[0] not in top
                      and not any(s.endswith(".egg-info") for s in f.parts))


def notebook_builder():
    """``notebooks/build.py`` as a module (it is a script, not part of a package)."""
    spec = importlib.util.spec_from_file_location("notebook_build", ROOT / "notebooks" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_out(out: Path) -> Path:
    """The output folder, made absolute; a one-line error if a name in it is longer than the file system takes,
    if it is not empty or if it lies inside the repository (where the repository's own tests and linter would
    pick the copy up)."""
    check_name(out.expanduser(), "--out")
    out = out.expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"error: {out} exists and is not empty; name a new folder (nothing is overwritten)")
    if out == ROOT or ROOT in out.parents:
        raise SystemExit(f"error: {out} is inside the repository {ROOT}; write the copy outside it")
    return out


def needs_calls(assignment: Assignment, source: Path) -> str:
    """The notebook source with a call at the top of each code cell tagged ``needs:TASK``, which stops the cell
    until the tasks are done, and a note saying so (``course.lesson``). A task of another assignment is tagged
    ``needs:OTHER:TASK`` (a cell of lesson 00 that runs StreamingLLM: ``needs:baselines:sinks_and_recent``); in
    a copy that holds that assignment's code the call does nothing. A ``needs:`` tag on a markdown cell, a task
    the assignment does not have, or a leftover ``# needs:`` comment is an error with its file and line."""
    build = notebook_builder()
    out, tasks_of = [], {}
    for n, line in enumerate(source.read_text().splitlines(), 1):
        out.append(line)
        if line.startswith("# needs:"):
            raise SystemExit(f"error: {source}:{n}: '# needs:' comment: name the tasks in the cell's tags "
                             '(# %% tags=["needs:TASK"])')
        m = build.MARKER.match(line) if line.startswith("# %%") else None
        names = lesson.needed(json.loads(m["tags"])) if m and m["tags"] else []
        if not names:
            continue
        by_assignment: dict[str, list[str]] = {}
        for name in names:
            owner, _, task = name.rpartition(":")
            by_assignment.setdefault(owner or assignment.name, []).append(task)
        for owner, wanted in by_assignment.items():
            if owner not in tasks_of:                 # each assignment's tasks read once, not per cell
                tasks_of[owner] = list(dict.fromkeys(r.task for r in ASSIGNMENTS[owner].regions() if r.task)) \
                    if owner in ASSIGNMENTS else []
            tasks = tasks_of[owner]
            wrong = [t for t in wanted if t not in tasks]
            if m["kind"] or wrong:
                listed = f" (its tasks: {', '.join(tasks)})" if tasks else ""
                why = "is on a markdown cell" if m["kind"] else f"names {wrong[0]!r}, not a task of {owner!r}{listed}"
                raise SystemExit(f"error: {source}:{n}: the tag 'needs:' {why}")
        for owner, wanted in by_assignment.items():
            out += lesson.call(owner, wanted)
    return "\n".join(out) + "\n"


REFERENCE_CELL = ["# The reference answer of this exercise is not in your copy: write yours in the cell where its",
                  "# names are None, and run the check cell below it, which says whether it is right."]


def quiet_reference_cells(text: str, name: str) -> str:
    """The notebook source (py:percent) with each exercise's reference cell, a region of ``name`` followed by
    the check's call on ``reference_*`` names, replaced by a note (``REFERENCE_CELL``): in the copy its stub
    would stop a "run all" half-way, where the learner's own cells and the checks run on."""
    build = notebook_builder()
    out, cell = [], []

    def flush():
        regions = find_regions("cell.py", "\n".join(cell)) if cell else []
        body = "\n".join(cell)
        if any(r.assignment == name and r.task is None for r in regions) and re.search(r"^check_\w+\(reference_",
                                                                                      body, flags=re.M):
            out.extend([cell[0], *REFERENCE_CELL, ""])
        else:
            out.extend(cell)

    for line in text.splitlines():
        if line.startswith("# %%") and build.MARKER.match(line):
            flush()
            cell = [line]
        elif cell:
            cell.append(line)
        else:
            out.append(line)
    flush()
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def solution_lines(assignment: Assignment) -> set[str]:
    """The code lines of the assignment's solutions in its Python files, stripped, long enough (16 characters)
    to be told apart from ordinary code: what a committed output must not show."""
    out = set()
    for path in assignment.sources():
        if path.suffix == ".py" and path.exists():
            lines = path.read_text().splitlines()
            for r in find_regions(path):
                if r.assignment == assignment.name:
                    out |= {t for t in (line.strip() for line in r.body(lines)) if len(t) >= 16 and t[0] != "#"}
    return out


def printed(cell) -> str:
    """What a code cell's committed outputs show as text."""
    return "\n".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", "")) for o in cell.outputs)


def lesson_notebook(assignment: Assignment, out: Path, handed: str, released: frozenset[str]) -> list[Path]:
    """Write ``assignment``'s notebook into ``out/notebooks`` as a copy of ``handed`` holds it: its source and
    the committed ``.ipynb``, with no marker left.

    * The handed-out assignment's notebook and a later one's (not in ``released``): their regions are stubs
      (``markers.hand_out``) and a cell tagged ``needs:`` starts with a ``course.lesson.needs`` call, which
      stops it until the task is done (or, for a later assignment, says it is not handed out yet). Every cell
      keeps its committed outputs, the ones the prose refers to, but a stripped exercise (its outputs would
      show the answer) and a cell whose outputs print a line of the solution (``solution_lines``): run, it
      prints the student's own.
    * A released assignment's notebook (already due): its code as it is, markers removed, outputs kept."""
    import nbformat
    build = notebook_builder()
    source = ROOT / "notebooks" / f"{assignment.notebook}.py"
    dst = out / "notebooks" / source.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    open_ = assignment.name not in released
    text = needs_calls(assignment, source) if open_ else source.read_text()
    text = quiet_reference_cells(text, assignment.name) if open_ else text
    dst.write_text(hand_out(source, handed, released, text=text))
    reference, student = build.read_percent(source).cells, build.read_percent(dst).cells
    committed = source.with_suffix(".ipynb")
    nb = nbformat.read(committed, as_version=4) if committed.exists() else build.read_percent(source)
    if [(c.cell_type, c.source) for c in nb.cells] != [(c.cell_type, c.source) for c in reference]:
        raise SystemExit(f"error: {committed} does not have the cells of {source.name}; rebuild it with "
                         f"`python notebooks/build.py notebooks/{source.name}`")
    solution = solution_lines(assignment) if open_ else set()
    for cell, old, new in zip(nb.cells, reference, student):
        tags = [t for t in old.metadata.get("tags", []) if t.startswith(build.SOLUTION_TAG)]
        if open_ and cell.cell_type == "code" and any(t.split(":")[1] == assignment.name for t in tags):
            cell.outputs, cell.execution_count = [], None          # a stripped exercise
            if new.source.startswith(REFERENCE_CELL[0]):           # its reference, now a note: shown, not collapsed
                cell.metadata.get("jupyter", {}).pop("source_hidden", None)
        elif cell.cell_type == "code" and any(line in printed(cell) for line in solution):
            cell.outputs, cell.execution_count = [], None          # it printed a solution (07 prints its kernel)
        cell.source = new.source
    nbformat.write(nb, dst.with_suffix(".ipynb"))
    return [dst, dst.with_suffix(".ipynb")]


def written_questions(sheet: Path) -> list[dict]:
    """The sheet's written questions, each {number, title, points, question, rubric, answer}: the question's
    lines, its rubric's lines and its model answer's lines (the region's body), without their indentation."""
    text = sheet.read_text()
    if "## Written questions" not in text:
        return []
    section = text.split("## Written questions", 1)[1].split("\n## ", 1)[0]
    items = re.split(r"^(?=\d+\. \*\*)", section, flags=re.M)[1:]
    questions = []
    for item in items:
        head = re.match(r"(\d+)\. \*\*(.+?)\*\* \((\d+) points?\)\.?[ \t]*", item)
        if head is None:
            continue
        parts = {"question": [], "rubric": [], "answer": []}
        part = "question"
        for line in item[head.end():].splitlines():
            line = line.strip()
            if MD_BEGIN.match(line) or line == "<!-- END SOLUTION -->":
                part = "answer" if MD_BEGIN.match(line) else "after"
            elif line.startswith("Rubric:"):
                part = "rubric"
                parts[part].append(line.removeprefix("Rubric:").strip())
            elif part in parts and (line or parts[part]):
                parts[part].append(line)
        for lines in parts.values():
            while lines and not lines[-1]:
                lines.pop()
        questions.append({"number": int(head[1]), "title": head[2], "points": int(head[3]), **parts})
    return questions


def writeup(assignment: Assignment, rubric: bool = False) -> str:
    """The writeup template: the sheet's written questions (title, points, text), each with room for the
    answer, and the total; with ``rubric``, the instructor's version: each question's rubric and model answer."""
    questions = written_questions(assignment.sheet)
    total = sum(q["points"] for q in questions)
    lines = [f"# Written part: {assignment.title}", "",
             f"The written questions of `course/{assignment.name}/sheet.md`: {len(questions)} questions, {total} "
             "points, graded by hand." + ("" if rubric else " Write each answer below its question, in a few "
                                          "sentences; the sheet's section Handing in says how this file is handed "
                                          "in."), ""]
    for q in questions:
        question = "\n".join(q["question"]).split("\n\n")              # its paragraphs, each on one line
        lines += [f"## {q['number']}. {q['title']} ({q['points']} points)", ""]
        lines += [line for paragraph in question for line in (" ".join(paragraph.split("\n")), "")]
        if rubric:
            lines += ["**Rubric.** " + " ".join(q["rubric"]), "", "**Model answer.**", "", *q["answer"], ""]
        else:
            if "python -m course.measure" in " ".join(q["question"]):     # its figure, where course.measure puts it
                lines += ["![your figure](measure/figure.png)", ""]
            lines += ["**Answer.**", "", "*(your answer)*", ""]
    lines.append(f"Total: {total} points.")
    return "\n".join(lines) + "\n"


def release_plan(assignment: Assignment, released: list[str] | tuple[str, ...] = ()) -> frozenset[str]:
    """The assignments whose solutions a copy of ``assignment`` holds: its prerequisites (``requires``: the code
    its tests and notebook run) and the ``released`` ones (already due); never itself."""
    for name in released:
        get(name)                                          # a one-line error for a name that is no assignment
    return frozenset((set(assignment.prerequisites()) | set(released)) - {assignment.name})


def student_page(assignment: Assignment, kept: frozenset[str]) -> str:
    """``STUDENT.md``, the copy's first page for the student: what to do, how to check, how to hand in."""
    a = assignment
    held = ", ".join(f"`{n}`" for n in sorted(kept))
    others = 'Every other assignment\'s code is a stub saying "not handed out yet".'
    if held:
        others = f"The code of {held} is here in full: your code runs on it (or it is already due).\n   {others}"
    return f"""# Your copy for assignment `{a.name}`: {a.title}

This folder is the course's repository handed out for one assignment. Start here; the repository's own
README (`README.md`) is for its developers, and its test suite is not your grade.

1. **Set up** (once, in this folder, with Python 3.11): `python -m venv .venv && . .venv/bin/activate`
   (Windows: `.venv\\Scripts\\activate`), then `pip install -r requirements-student.txt && pip install -e .`:
   what the course needs, a few minutes (`requirements.txt` is the developers' larger set). Triton, which
   `kernels` and `kvreviver` run, installs on Linux only: on macOS or Windows work in the Linux container
   of `course/Dockerfile` (its first lines say how), or under WSL on Windows.
2. **Read** `course/{a.name}/sheet.md`: the goal, what to read, the tasks with their points, the written
   questions. The lesson is `notebooks/{a.notebook}.ipynb` (`jupyter lab notebooks/`): its outputs are there
   before you write anything; a cell that needs your code says which task it waits for.
3. **Write** each task in place of the line `raise NotImplementedError(...)   # your code here`; its message
   names the task and gives a hint. {others}
4. **Check** with the public tests: `python -m course.grade {a.name}` (or `-k TASK` for one task; `--log`
   prints each failing test's whole message, which the table cuts). The hidden tests, which hold most of the
   points, run only when you hand in: passing every public test is not full marks.
5. **Measure** once your tasks pass: `python -m course.measure {a.name}` runs your code as the sheet's
   last written question says and writes its figure to `course/{a.name}/measure/figure.png`.
6. **Answer** every written question, the measurement's included, in `course/{a.name}/writeup.md`, the one
   place for answers (it shows the figure).
7. **Hand in** twice: `python -m course.submit {a.name}` writes `{a.name}-submission.zip` (your library files,
   adapters, writeup and figure) for the autograded assignment; the written part goes as the sheet's section
   Handing in says (by default a PDF of `writeup.md`). Nothing else you change is graded.
"""


def student_copy(assignment: Assignment, out: Path, stub: str = "raise", released: list[str] | tuple[str, ...] = ()
                 ) -> list[Path]:
    """Write the student copy into ``out`` (new or empty). Returns the files that were changed or added.

    No solution marker reaches the copy: this assignment's regions are stubs with their hints; the regions of
    its prerequisites and of the ``released`` assignments keep their code; every other assignment's regions
    are stubs that say "not handed out yet" (``release_plan``, ``markers.hand_out``)."""
    kept = release_plan(assignment, released)
    withheld = {str(p.relative_to(ROOT)) for a in ASSIGNMENTS.values() for name in INSTRUCTOR_ONLY
                for p in a.folder.glob(name)}
    withheld.add(str(MUTANTS_REPORT.relative_to(ROOT)))      # quotes the mutated solution lines: instructors only
    notebooks = {f"notebooks/{a.notebook}.{ext}" for a in ASSIGNMENTS.values() for ext in ("py", "ipynb")}
    scanned = {str(p.relative_to(ROOT)) for p in scanned_files() if p.suffix == ".py"}
    changed = []
    for rel in repository_files():
        if rel in withheld or rel in notebooks:                  # the notebooks: below
            continue
        src, dst = ROOT / rel, out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel in scanned and find_regions(src):
            dst.write_text(hand_out(src, assignment.name, kept, stub=stub))
            changed.append(dst)
        elif src.name == "sheet.md" and src.parent.parent == ROOT / "course" and find_regions(src):
            dst.write_text(strip(src, find_regions(src)[0].assignment))     # no sheet's model answers
            changed.append(dst)
        else:
            shutil.copy2(src, dst)
    for a in ASSIGNMENTS.values():
        if (ROOT / "notebooks" / f"{a.notebook}.py").exists():
            changed += lesson_notebook(a, out, assignment.name, kept)
    report = out / MUTANTS_REPORT.relative_to(ROOT)          # a note in its place, so the pages' links resolve
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("# The mutants' report quotes the solutions' lines: not in a student copy. Each assignment's\n"
                      "# part is in its instructor pack's solutions.md (python -m course.handout "
                      f"{assignment.name} --solutions).\n")
    changed.append(report)
    (out / "STUDENT.md").write_text(student_page(assignment, kept))
    changed.append(out / "STUDENT.md")
    if (out / "README.md").exists():                       # the repository's page points the student to theirs
        readme = out / "README.md"
        readme.write_text(f"> **Student copy of assignment `{assignment.name}`: start with [STUDENT.md](STUDENT.md).**"
                          "\n\n" + readme.read_text())
        changed.append(readme)
    if assignment.sheet.exists() and written_questions(assignment.sheet):
        template = out / "course" / assignment.name / "writeup.md"
        template.parent.mkdir(parents=True, exist_ok=True)
        template.write_text(writeup(assignment))
        changed.append(template)
    return changed


def mutants_section(assignment: Assignment, report: Path | None = None) -> list[str]:
    """The assignment's section of the mutants report (default ``MUTANTS_REPORT``): its counts, its survivors
    and why each is acceptable; nothing where the report does not exist or has no section for it."""
    report = MUTANTS_REPORT if report is None else report
    if not report.exists():
        return []
    lines = report.read_text().splitlines()
    start = next((n for n, line in enumerate(lines) if line.startswith(f"== {assignment.name}:")), None)
    if start is None:
        return []
    end = next((n for n in range(start + 1, len(lines)) if not lines[n].strip() or lines[n].startswith("== ")),
               len(lines))
    return lines[start:end]


def instructor_pack(assignment: Assignment, out: Path) -> list[Path]:
    """Write the solution notebook, the sheet with answers, every test, the hand-written mutants, the writeup
    with its rubric and ``solutions.md`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    notebook = ROOT / "notebooks" / f"{assignment.notebook}.ipynb"
    for src in [notebook, assignment.sheet, assignment.folder / "adapters.py", *assignment.tests(),
                assignment.folder / "mutants.py"]:
        if src.exists():
            shutil.copy2(src, out / src.name)
            written.append(out / src.name)
    if written_questions(assignment.sheet):
        (out / "writeup_rubric.md").write_text(writeup(assignment, rubric=True))
        written.append(out / "writeup_rubric.md")
    lines = [f"# Solutions: {assignment.title}", ""]
    for r in assignment.regions():
        text = r.path.read_text().splitlines()
        fence = "markdown" if r.path.suffix == ".md" else "python"
        lines += [f"## `{r.path.relative_to(ROOT)}`, lines {r.begin + 1}-{r.end - 1}", "", f"Hint: {r.hint}", "",
                  f"```{fence}", *r.body(text), "```", ""]
    lines += ["## Grading", "",
              "From a checkout of the repository (the grader takes its tests from there, never from the copy):", "",
              "```bash", f"python -m course.handout {assignment.name} --out hw   # the copy to hand out",
              f"python -m course.grade {assignment.name} --student SUBMISSION --json results.json", "```", "",
              "The written questions are graded by hand from the rubric in sheet.md (writeup_rubric.md has it with "
              f"the model answers); the student hands in course/{assignment.name}/writeup.md.", ""]
    section = mutants_section(assignment)
    lines += ["## Mutants that survive the tests", ""]
    if section:
        lines += ["From `results/course_mutants.txt` (`python -m course.mutants all --out "
                  "results/course_mutants.txt`): each survivor, the tests that passed, and why its survival "
                  "is acceptable (`ACCEPTABLE` in mutants.py).", "", "```text", *section, "```", ""]
    else:
        lines += [f"No report: run `python -m course.mutants {assignment.name}` (mutants.py holds the hand-written "
                  "ones).", ""]
    (out / "solutions.md").write_text("\n".join(lines))
    written.append(out / "solutions.md")
    return written


def write_new_folder(out: Path, write) -> list[Path]:
    """``write(folder)`` into a hidden folder beside ``out``, renamed to ``out`` only once complete: an error
    (a file in the way, a read-only place, a full disk) is one line and leaves nothing behind."""
    # named before it exists, so that a signal at any moment from here on finds what to remove
    tmp = out.parent / f".{out.name}.{secrets.token_hex(6)}"
    try:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(tmp, 0o700)
        except OSError as e:
            raise SystemExit(f"error: --out {out}: cannot write there ({e.strerror or e})") from None
        files = write(tmp)
        if out.exists():
            out.rmdir()                                   # check_out let it through: it is empty
        os.rename(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"error: --out {out}: writing the copy failed ({e.strerror or e}); nothing was left "
                         "behind") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / f.relative_to(tmp) for f in files]


@command_line
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m course.handout", description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="assignments: " + "; ".join(f"{a.name} ({a.title})" for a in ASSIGNMENTS.values()))
    p.error = refuse
    p.add_argument("assignment", help="which assignment: " + ", ".join(ASSIGNMENTS))
    p.add_argument("--out", required=True, type=Path,
                   help="a new (or empty) folder outside the repository; nothing is overwritten")
    p.add_argument("--solutions", action="store_true",
                   help="write the instructor pack (solution notebook, sheet with answers, public and hidden "
                        "tests, hand-written mutants, the writeup's rubric, solutions.md) instead of the student copy")
    p.add_argument("--released", default="", metavar="NAMES",
                   help="comma-separated assignments already due, whose solutions the copy may hold (besides the "
                        "handed-out one's prerequisites, which it always holds); every other assignment's code is "
                        "a stub in the copy. Default: none")
    p.add_argument("--json", action="store_true", help="print the written files as JSON (for scripts)")
    args = p.parse_args(argv)
    assignment = get(args.assignment)
    released = [n.strip() for n in args.released.split(",") if n.strip()]
    if args.solutions and released:
        raise SystemExit("error: --released shapes a student copy; the instructor pack (--solutions) takes none")
    kept = release_plan(assignment, released)
    out = check_out(args.out)
    if not assignment.regions():
        raise SystemExit(f"error: assignment {assignment.name!r} has no solution regions")
    files = write_new_folder(out, lambda tmp: instructor_pack(assignment, tmp) if args.solutions
                             else student_copy(assignment, tmp, released=released))
    if args.json:
        print(json.dumps([str(f) for f in files]))
        return
    if args.solutions:
        print(f"instructor pack for {assignment.name!r} in {out}:")
        for f in files:
            print(f"  {f.relative_to(out)}")
    else:
        print(f"student copy of {assignment.name!r} in {out} ({len(assignment.regions())} regions replaced in "
              f"{len(files)} files; solutions held: {', '.join(sorted(kept)) or 'none'}; every other assignment's "
              "code is a stub):")
        for f in files:
            print(f"  {f.relative_to(out)}")
        print(f"next: cd {out}, read course/{assignment.name}/sheet.md, run notebooks/{assignment.notebook}.ipynb "
              f"(its cells say which task they wait for), write the tasks (`python -m course.grade {assignment.name}` "
              f"runs the public tests) and answer course/{assignment.name}/writeup.md")


if __name__ == "__main__":
    sys.exit(main())
