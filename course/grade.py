"""
Grade one assignment: run its public and hidden tests against a student copy and score them.

    python -m course.grade cache                                  # this repository (the reference: full marks)
    python -m course.grade cache --student ~/hw-cache --json results.json

The tests run in a fresh Python process, in a scratch folder that holds only the tests and ``oracle.py``,
with the student copy first on the import path: ``nanollm``, ``methods`` and ``kernels`` are the
student's, reached only through the student's ``course/<name>/adapters.py``; nothing of the student copy
or of this repository is written to. A check at start-up stops the run if the library would be imported
from anywhere but the student copy. Each test's points are in its ``@points(n)`` decorator, read from the
test file's source (not from the run, which a student's code could disturb).

Output: a table (test, public or hidden, points, outcome, the first line of the failure), the total, and
with ``--json`` a results file in Gradescope's format (``score``, ``execution_time``, ``tests``: ``name``,
``score``, ``max_score``, ``status``, ``output``, ``visibility``; hidden tests are ``after_published``).
In a student copy the hidden tests are absent: the table says so, and the score is out of the public points.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

from .assignments import ASSIGNMENTS, COURSE, ROOT, Assignment, get

TIMEOUT_S = 300          # the whole run; a student's infinite loop fails every test still pending

CONFTEST = '''\
"""Written by course.grade: the library must come from the student copy."""
from pathlib import Path

import nanollm

STUDENT = Path({student!r})
if STUDENT not in Path(nanollm.__file__).resolve().parents:
    raise RuntimeError(f"nanollm was imported from {{nanollm.__file__}}, not from the student copy {{STUDENT}}")
'''


@dataclass
class Result:
    name: str
    visibility: str        # "public" or "hidden"
    max_score: float
    score: float
    status: str            # "passed" or "failed"
    output: str            # the failure's message ("" when passed)


def points_of(path: Path) -> dict[str, float]:
    """test name -> points, from the ``@points(n)`` decorators of a test file's source."""
    found = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            for dec in node.decorator_list:
                if (isinstance(dec, ast.Call) and getattr(dec.func, "id", None) == "points"
                        and isinstance(dec.args[0], ast.Constant)):
                    found[node.name] = float(dec.args[0].value)
            if node.name not in found:
                raise SystemExit(f"error: {path}:{node.lineno}: {node.name} has no @points(n)")
    return found


def first_line(text: str, width: int = 200) -> str:
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line if len(line) <= width else line[:width - 3] + "..."


def read_junit(path: Path) -> dict[str, tuple[str, str]]:
    """test name -> (status, message) from pytest's JUnit XML."""
    out = {}
    if not path.exists():
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
        if not bad:
            out[case.get("name")] = ("passed", "")
        else:
            c = bad[0]
            why = "skipped: " if c.tag == "skipped" else ""
            out[case.get("name")] = ("failed", why + first_line(c.get("message") or c.text or c.tag))
    return out


def run_tests(assignment: Assignment, student: Path, hidden: bool = True) -> tuple[list[Result], float, str]:
    """Run the assignment's tests against ``student``; (results, seconds, pytest's output)."""
    tests = assignment.tests(hidden)
    adapters = student / "course" / assignment.name
    if not (adapters / "adapters.py").exists():
        raise SystemExit(f"error: {student} has no course/{assignment.name}/adapters.py; is it a student copy "
                         f"of {assignment.name!r}?")
    with tempfile.TemporaryDirectory(prefix=f"grade-{assignment.name}-") as tmp:
        tmp = Path(tmp)
        for t in tests:
            shutil.copy2(t, tmp / t.name)
        shutil.copy2(COURSE / "oracle.py", tmp / "oracle.py")
        (tmp / "conftest.py").write_text(CONFTEST.format(student=str(student)))
        (tmp / "pytest.ini").write_text("[pytest]\naddopts =\n")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(adapters), str(student)]),
               "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        env.setdefault("TRITON_INTERPRET", "1")      # no GPU: the kernels run in Triton's interpreter
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(tmp / "pytest.ini"),
               "--rootdir", str(tmp), "--junitxml", str(tmp / "junit.xml"), *[t.name for t in tests]]
        t0 = time.perf_counter()
        try:
            run = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
            log = run.stdout + run.stderr
        except subprocess.TimeoutExpired as e:
            log = f"timed out after {TIMEOUT_S} s\n{e.stdout or ''}"
        seconds = time.perf_counter() - t0
        outcomes = read_junit(tmp / "junit.xml")
    results = []
    for t in tests:
        visibility = "hidden" if t.name == "test_hidden.py" else "public"
        for name, pts in points_of(t).items():
            status, message = outcomes.get(name, ("failed", first_line(log.splitlines()[-1] if log else "")
                                                  or "did not run"))
            results.append(Result(name, visibility, pts, pts if status == "passed" else 0.0, status, message))
    return results, seconds, log


def table(results: list[Result]) -> str:
    width = max(len(r.name) for r in results)
    lines = [f"{'test':<{width}}  {'kind':<6}  {'points':>9}  outcome  why", "-" * (width + 40)]
    for r in results:
        lines.append(f"{r.name:<{width}}  {r.visibility:<6}  {r.score:>4g} / {r.max_score:<3g}  "
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


def grade(name: str, student: Path | None = None, hidden: bool = True) -> dict:
    """Grade ``name`` against ``student`` (default: this repository). Returns a summary dict."""
    assignment = get(name)
    student = (student or ROOT).expanduser().resolve()
    if not student.is_dir():
        raise SystemExit(f"error: no folder {student}")
    results, seconds, log = run_tests(assignment, student, hidden)
    has_hidden = any(r.visibility == "hidden" for r in results)
    return {"assignment": name, "student": str(student), "results": [asdict(r) for r in results],
            "score": sum(r.score for r in results), "max_score": sum(r.max_score for r in results),
            "seconds": seconds, "hidden_tests": has_hidden, "log": log}


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
    p.add_argument("--log", action="store_true", help="print pytest's own output after the table")
    args = p.parse_args(argv)
    if args.json is not None and args.json.exists():
        raise SystemExit(f"error: {args.json} exists; name a new file (nothing is overwritten)")
    summary = grade(args.assignment, args.student, hidden=not args.public_only)
    results = [Result(**r) for r in summary["results"]]
    print(f"assignment {args.assignment!r}, student copy {summary['student']}\n")
    print(table(results))
    note = "" if summary["hidden_tests"] or args.public_only else \
        "hidden tests: not in this copy (the instructor's grader has them); the score is out of the public points"
    print(f"\nscore: {summary['score']:g} / {summary['max_score']:g} in {summary['seconds']:.1f} s")
    if note:
        print(note)
    if args.log:
        print("\n" + summary["log"])
    if args.json is not None:
        args.json.write_text(json.dumps(gradescope(results, summary["seconds"], note), indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
