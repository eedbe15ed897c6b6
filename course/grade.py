"""
Grade one assignment: run its public and hidden tests against a student copy and score them.

    python -m course.grade cache                                  # this repository (the reference: full marks)
    python -m course.grade cache --student ~/hw-cache --json results.json

The tests run in a fresh Python process, in a scratch folder that holds only the tests and ``oracle.py``,
with the student copy first on the import path: ``nanollm``, ``methods`` and ``kernels`` are the
student's, reached only through the student's ``course/<name>/adapters.py``; nothing of the student copy
or of this repository is written to. An installed checkout cannot fill in what the copy lacks, and a
test fails if it imported a module of the library from anywhere but the copy. Each test's outcome is
recorded as it finishes, under a time limit (``--per-test-s``): a test that crashes the interpreter or
hangs fails alone, and the tests after it run in a fresh process. Each test's points are in its
``@points(n)`` decorator, read from the test file's source (not from the run, which a student's code could
disturb).

Output: a table (test, public or hidden, points, outcome, the first line of the failure), the total, and
with ``--json`` a results file in Gradescope's format (``score``, ``execution_time``, ``tests``: ``name``,
``score``, ``max_score``, ``status``, ``output``, ``visibility``; hidden tests are ``after_published``).
In a student copy the hidden tests are absent: the table says so, and the score is out of the public points.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .assignments import ASSIGNMENTS, COURSE, ROOT, Assignment, command_line, get

TIMEOUT_S = 300          # the whole run
PER_TEST_S = 60          # one test (a Python-level alarm; a loop inside one long torch call ends at the next)

# The scratch folder's conftest.py: the library must come from the student copy; each test's outcome is
# appended to a results file as it finishes (so a crash or a timeout keeps the outcomes before it); each
# test has a time limit.
CONFTEST = '''\
"""Written by course.grade."""
import os
import signal
import sys
from pathlib import Path

import pytest

STUDENT = Path({student!r})
RESULTS = Path(os.environ["COURSE_GRADE_RESULTS"])
PACKAGES = ("nanollm", "methods", "kernels", "course")

# an editable install of another checkout (pip install -e) must not fill in what the copy lacks
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]


def outside(name):
    """Whether an imported module of the library (or the course) comes from outside the student copy."""
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    return path is not None and STUDENT not in Path(path).resolve().parents


def record(*fields):
    with RESULTS.open("a") as f:
        f.write("\\t".join(str(x).replace("\\t", " ").replace("\\n", "\\\\n") for x in fields) + "\\n")


def pytest_runtest_logstart(nodeid, location):
    record("start", nodeid.split("::")[-1])


def pytest_runtest_logreport(report):
    name = report.nodeid.split("::")[-1]
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        record("failed", name, crash.message if crash is not None else str(report.longrepr).splitlines()[-1])
    elif report.when == "call" and report.passed:
        record("passed", name, "")


def alarm(signum, frame):
    raise TimeoutError("the test ran over {per_test} s")


@pytest.fixture(autouse=True)
def the_library_is_the_students_and_time_is_limited():
    if hasattr(signal, "SIGALRM"):
        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, {per_test})
    yield
    if hasattr(signal, "SIGALRM"):
        signal.setitimer(signal.ITIMER_REAL, 0)
    wrong = sorted(n for n in list(sys.modules) if n.split(".")[0] in PACKAGES and outside(n))
    if wrong:
        raise RuntimeError(f"imported from outside the student copy {{STUDENT}}: {{wrong[:3]}}")
'''


@dataclass
class Result:
    name: str
    visibility: str        # "public" or "hidden"
    max_score: float
    score: float
    status: str            # "passed" or "failed"
    output: str            # the failure's message ("" when passed)
    task: str = ""         # the sheet's task the test grades


def marks_of(path: Path) -> dict[str, tuple[float, str | None]]:
    """test name -> (points, task), from the ``@points(n, task=...)`` decorators of a test file's source."""
    found = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            for dec in node.decorator_list:
                if (isinstance(dec, ast.Call) and getattr(dec.func, "id", None) == "points"
                        and isinstance(dec.args[0], ast.Constant)):
                    task = next((k.value.value for k in dec.keywords
                                 if k.arg == "task" and isinstance(k.value, ast.Constant)), None)
                    found[node.name] = (float(dec.args[0].value), task)
            if node.name not in found:
                raise SystemExit(f"error: {path}:{node.lineno}: {node.name} has no @points(n)")
    return found


def points_of(path: Path) -> dict[str, float]:
    """test name -> points, from the ``@points(n)`` decorators of a test file's source."""
    return {name: pts for name, (pts, _) in marks_of(path).items()}


def first_line(text: str, width: int = 200) -> str:
    """The first non-empty line of a failure, and the line saying how far off a tensor was, if there is one."""
    lines = [s.strip() for s in text.replace("\\n", "\n").splitlines() if s.strip()]
    line = " ".join(lines[:1] + [s for s in lines[1:] if s.startswith("Greatest absolute difference")][:1])
    return line if len(line) <= width else line[:width - 3] + "..."


def read_results(path: Path) -> tuple[dict[str, tuple[str, str]], str | None]:
    """test name -> (status, message) from the conftest's results file; and the test that started last
    without an outcome (where a crash or timeout happened), or None."""
    outcomes, running = {}, None
    if path.exists():
        for line in path.read_text().splitlines():
            kind, name, *rest = line.split("\t") + [""]
            if kind == "start":
                running = name
            elif outcomes.get(name, ("",))[0] != "failed":          # the first failure of a test is its outcome
                outcomes[name] = (kind, first_line(rest[0]) if kind == "failed" else "")
                running = None if name == running else running
    return outcomes, running


def run_tests(assignment: Assignment, student: Path, hidden: bool = True, per_test_s: float = PER_TEST_S,
              tasks: tuple[str, ...] | None = None) -> tuple[list[Result], float, str]:
    """Run the assignment's tests against ``student`` (only those of ``tasks`` if given); (results, seconds,
    pytest's output)."""
    tests = assignment.tests(hidden)
    adapters = student / "course" / assignment.name
    if not (adapters / "adapters.py").exists():
        raise SystemExit(f"error: {student} has no course/{assignment.name}/adapters.py; is it a student copy "
                         f"of {assignment.name!r}?")
    with tempfile.TemporaryDirectory(prefix=f"grade-{assignment.name}-") as tmp, \
            tempfile.TemporaryDirectory(prefix="grade-results-") as out:
        tmp, results_file = Path(tmp), Path(out) / "results.tsv"
        for t in tests:
            shutil.copy2(t, tmp / t.name)
        shutil.copy2(COURSE / "oracle.py", tmp / "oracle.py")
        (tmp / "conftest.py").write_text(CONFTEST.format(student=str(student), per_test=per_test_s))
        (tmp / "pytest.ini").write_text("[pytest]\naddopts =\n")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(adapters), str(student)]),
               "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "COURSE_GRADE_RESULTS": str(results_file)}
        env.setdefault("TRITON_INTERPRET", "1")      # no GPU: the kernels run in Triton's interpreter
        node = {n: f"{t.name}::{n}" for t in tests for n, (_, task) in marks_of(t).items()   # name -> node id
                if tasks is None or task in tasks}
        outcomes, logs, t0 = {}, [], time.perf_counter()
        while True:        # a crash or a timeout fails its test; the tests after it run in a fresh process
            remaining = [n for n in node if n not in outcomes]
            left = TIMEOUT_S - (time.perf_counter() - t0)
            if not remaining:
                break
            if left <= 1:
                outcomes.update({n: ("failed", f"not run: the whole run took over {TIMEOUT_S} s") for n in remaining})
                break
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(tmp / "pytest.ini"),
                   "--rootdir", str(tmp), *[node[n] for n in remaining]]
            try:
                run = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=left)
                log, code = run.stdout + run.stderr, run.returncode
            except subprocess.TimeoutExpired as e:
                text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
                log, code = f"timed out after {TIMEOUT_S} s in all\n{text}", None
            logs.append(log)
            found, running = read_results(results_file)
            new = {n: found[n] for n in remaining if n in found}
            errors = [line[1:].strip() for line in log.splitlines() if line.startswith("E ")]
            if code not in (0, 1, None) and not new and running not in remaining:   # the tests could not be imported
                why = f"the tests could not be collected: {errors[0] if errors else log.splitlines()[-1:]}"
                outcomes.update({n: ("failed", why) for n in remaining})
                break
            if code in (0, 1):
                if set(new) != set(remaining) or (code == 0) != all(o[0] == "passed" for o in new.values()):
                    new = {n: ("failed", f"pytest's exit code {code} disagrees with the recorded outcomes")
                           for n in remaining}
            elif running in remaining and running not in new:    # this test crashed or timed out
                why = "the whole run timed out" if code is None else f"the test process stopped (exit code {code})"
                new[running] = ("failed", f"{why} in this test")
            if not new:                                          # no progress: stop rather than loop
                why = "did not run: " + first_line(log.splitlines()[-1] if log else "")
                new = {n: ("failed", why) for n in remaining}
            outcomes.update(new)
        seconds = time.perf_counter() - t0
    results = []
    for t in tests:
        visibility = "hidden" if t.name == "test_hidden.py" else "public"
        for name, (pts, task) in marks_of(t).items():
            if name in outcomes:
                status, message = outcomes[name]
                results.append(Result(name, visibility, pts, pts if status == "passed" else 0.0, status, message,
                                      task or ""))
    return results, seconds, "\n".join(logs)


def adapter_changes(assignment: Assignment, student: Path) -> list[str]:
    """The adapter files of the student copy that differ from this repository's (worth a look: the tests
    reach the student's code only through them)."""
    files = [f"course/{assignment.name}/adapters.py", "course/model_adapters.py"]
    return [f for f in files if (student / f).exists() and (ROOT / f).exists()
            and (student / f).read_bytes() != (ROOT / f).read_bytes()]


def table(results: list[Result]) -> str:
    """The results grouped by task: a line per task with its points, then its tests."""
    if not results:
        return "(no test)"
    width = max(len(r.name) for r in results) + 2
    lines = [f"{'task / test':<{width}}  {'kind':<6}  {'points':>9}  outcome  why", "-" * (width + 40)]
    for task in dict.fromkeys(r.task for r in results):
        group = [r for r in results if r.task == task]
        got, of = sum(r.score for r in group), sum(r.max_score for r in group)
        lines.append(f"{'task ' + (task or '(none)'):<{width}}  {'':<6}  {got:>4g} / {of:<3g}")
        for r in group:
            lines.append(f"  {r.name:<{width - 2}}  {r.visibility:<6}  {r.score:>4g} / {r.max_score:<3g}  "
                         f"{'pass' if r.status == 'passed' else 'FAIL':<7}  {r.output[:90]}")
    return "\n".join(lines)


def gradescope(results: list[Result], seconds: float, note: str) -> dict:
    """The results in Gradescope's autograder format."""
    return {
        "score": sum(r.score for r in results),
        "execution_time": round(seconds, 1),
        "output": note,
        "visibility": "visible",
        "stdout_visibility": "hidden",
        "tests": [{"name": f"{r.visibility}: {r.name}", "score": r.score, "max_score": r.max_score,
                   "status": r.status, "output": r.output,
                   "visibility": "visible" if r.visibility == "public" else "after_published"} for r in results],
    }


def task_names(assignment: Assignment, hidden: bool = True) -> list[str]:
    """The tasks the assignment's tests grade, in the order they first appear."""
    return list(dict.fromkeys(task for t in assignment.tests(hidden) for _, task in marks_of(t).values() if task))


def grade(name: str, student: Path | None = None, hidden: bool = True, per_test_s: float = PER_TEST_S,
          tasks: tuple[str, ...] | None = None) -> dict:
    """Grade ``name`` against ``student`` (default: this repository), only ``tasks`` if given. Returns a
    summary dict."""
    assignment = get(name)
    student = (student or ROOT).expanduser().resolve()
    if not student.is_dir():
        raise SystemExit(f"error: no folder {student}")
    if tasks is not None and set(tasks) - set(task_names(assignment, hidden)):
        raise SystemExit(f"error: no task {sorted(set(tasks) - set(task_names(assignment, hidden)))[0]!r} in "
                         f"{name!r}; its tasks: {', '.join(task_names(assignment, hidden))}")
    results, seconds, log = run_tests(assignment, student, hidden, per_test_s, tasks)
    has_hidden = any(r.visibility == "hidden" for r in results)
    return {"assignment": name, "student": str(student), "results": [asdict(r) for r in results],
            "score": sum(r.score for r in results), "max_score": sum(r.max_score for r in results),
            "seconds": seconds, "hidden_tests": has_hidden, "log": log,
            "changed_adapters": adapter_changes(assignment, student)}


@command_line
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m course.grade", description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="assignments: " + ", ".join(ASSIGNMENTS))
    p.add_argument("assignment", help="which assignment: " + ", ".join(ASSIGNMENTS))
    p.add_argument("--student", type=Path, default=None,
                   help="the student copy to grade (default: this repository, whose reference solutions get "
                        "full marks)")
    p.add_argument("--json", type=Path, default=None,
                   help="write Gradescope-style results here (refuses to overwrite an existing file)")
    p.add_argument("--public-only", action="store_true", help="run only the public tests")
    p.add_argument("--per-test-s", type=float, default=PER_TEST_S,
                   help=f"time limit of one test in seconds (default {PER_TEST_S}); the whole run stops after "
                        f"{TIMEOUT_S} s")
    p.add_argument("-k", "--task", action="append", default=None, metavar="TASK",
                   help="grade only this task's tests (repeatable); the tasks are the sheet's (e.g. window_vote)")
    p.add_argument("--log", action="store_true", help="print pytest's own output after the table")
    args = p.parse_args(argv)
    if args.json is not None and args.json.exists():
        raise SystemExit(f"error: {args.json} exists; name a new file (nothing is overwritten)")
    if args.json is not None and not args.json.parent.is_dir():
        raise SystemExit(f"error: --json {args.json}: the folder {args.json.parent} does not exist")
    if not math.isfinite(args.per_test_s) or args.per_test_s <= 0:
        raise SystemExit(f"error: --per-test-s must be a positive, finite number of seconds, got {args.per_test_s}")
    summary = grade(args.assignment, args.student, hidden=not args.public_only, per_test_s=args.per_test_s,
                    tasks=None if args.task is None else tuple(args.task))
    results = [Result(**r) for r in summary["results"]]
    print(f"assignment {args.assignment!r}, student copy {summary['student']}\n")
    print(table(results))
    note = "" if summary["hidden_tests"] or args.public_only else \
        "hidden tests: not in this copy (the instructor's grader has them); the score is out of the public points"
    print(f"\nscore: {summary['score']:g} / {summary['max_score']:g} in {summary['seconds']:.1f} s")
    if note:
        print(note)
    for f in summary["changed_adapters"]:
        print(f"note: the student's {f} differs from this repository's: read it (the tests reach the code "
              "only through the adapters)")
    if args.log:
        print("\n" + summary["log"])
    if args.json is not None:
        args.json.write_text(json.dumps(gradescope(results, summary["seconds"], note), indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
