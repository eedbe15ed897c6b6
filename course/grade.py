"""
Grade one assignment: run its public and hidden tests against a student copy and score them.

    python -m course.grade cache                                  # this repository (the reference: full marks)
    python -m course.grade cache --student ~/hw-cache --json results.json
    python -m course.grade baselines -k window_vote               # one task's tests

Three processes, so that nothing the student's code does can reach the grade: this one (the grader) starts the
test process, which runs the tests and asks the student's process (course/sandbox/student_process.py), which
runs the copy's code (course/README.md, section "Threat model", and section "The course's files").

Each test has a time limit enforced from outside (``--per-test-s``): one that runs over it or crashes fails alone.

Output: a table of each task's points and tests (public or hidden, outcome, the first line of a failure), the
total, and with ``--json`` Gradescope's results file; in a student copy, without the hidden tests, the total is
out of the public points.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import math
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .assignments import ASSIGNMENTS, COURSE, ROOT, Assignment, check_name, command_line, get, refuse
from .sandbox import confine

PER_TEST_S = 60          # one test's time limit, enforced by the grader from outside the test process
RUN_BASE_S = 60          # the whole run: this, plus (the per-test limit + RESTART_S) per test
RESTART_S = 5            # what a fresh test process costs (starting Python, importing torch)
START_S = 60             # a test process may take this long to import and collect the tests
POLL_S = 0.05            # how often the grader reads the results pipe
MIN_PER_TEST_S = 10 * POLL_S    # the shortest time limit the grader enforces: it sees a test run over its limit
#                                 up to one poll late, a tenth of this (so 5e-324 s or 1e-9 s are refused, not
#                                 noise that lets some tests through)
DUMP_TAIL = 1 << 20      # bytes of the end of the student's output read to find where a stopped test was
LOG_HEAD, LOG_TAIL = 64 << 10, 1 << 20      # what the grader reads of pytest's output (its start and its end)
MESSAGE_LINES, MESSAGE_CHARS = 10, 1500     # a failure's message in the JSON
SEEDS = 1 << 31          # ``--seed`` takes 0 <= N < SEEDS; without it, a fresh one each run (``new_seed``)
PUBLIC_CHARS = 800       # a public test's message, which the student sees (it may quote values the code returned)
STUDENT_CHARS = 160      # a line of the student's own exception in a public test's message (two lines at most)

# The scratch folder's conftest.py. The tests run here, in a process that never runs the student's code:
# ``adapters`` is course/sandbox/remote.py's stand-in, which asks the student's process
# (course/sandbox/student_process.py);
# each test's start and outcome go to the grader over a pipe this process alone holds; a failure is recorded
# as its exception's type and message (the student's exceptions with the student's file and line).
CONFTEST = '''\
"""Written by course.grade."""
import json
import os
import sys
import traceback

import pytest
import remote

RESULTS_FD = {results_fd!r}
DUMP = {dump!r}
sys.modules["adapters"] = remote.connect({student!r}, {adapters!r}, {site_dirs!r}, DUMP, {per_dump_s!r}, {home!r},
                                         {nobody!r}, jail={jail!r}, room={room!r})


def printable(text):
    """Text the grader can print and write: a lone surrogate as its escape (it stopped the printing of the table,
    and so the whole grade), a control character other than a line break or a tab (a terminal's escape sequence
    could redraw the table) as its escape."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(c if c.isprintable() or c in "\\n\\t" else c.encode("unicode_escape").decode() for c in text)


def record(kind, name, message="", cause=""):
    message = printable(message[:20000])
    data = (json.dumps({{"kind": kind, "name": name, "message": message, "cause": cause}}) + "\\n").encode()
    while data:
        data = data[os.write(RESULTS_FD, data):]


def describe(excinfo, public=False):
    """An exception as its type and message (the student's: with the file and line it came from; in a public
    test, whose message the student sees, an excerpt of {student_chars} characters a line, two lines)."""
    e = excinfo.value
    if isinstance(e, pytest.Collector.CollectError) and e.__cause__ is not None:
        e = e.__cause__                                  # the error behind "could not import the test file"
    if getattr(e, "course_text", None):
        lines = e.course_text.splitlines()
        if public:
            lines = [s[:{student_chars}] for s in lines[:1] + lines[1:][-1:]]    # its first and last lines, cut
        return "\\n".join(lines)
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    lines = text.splitlines()
    said = next((i for i, line in enumerate(lines) if i and line.startswith("assert ")), None)
    if isinstance(e, AssertionError) and said:           # the test's message, not pytest's rewrite of the assert
        text = "\\n".join(lines[:said])
    return text


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.excinfo is not None:
        report.course_message = describe(call.excinfo, public=item.path.name == "test_public.py")
        report.course_cause = cause(call.excinfo)
    return report


def cause(excinfo):
    """The kind of a failure, a word the grader turns into a hidden test's message of its own: the student's
    code raised, the test's check failed, or anything else."""
    e = excinfo.value
    return "raised" if getattr(e, "course_text", None) else "wrong" if isinstance(e, AssertionError) else "error"


def pytest_exception_interact(node, call, report):
    if not isinstance(node, pytest.Item):               # a test file that could not be imported
        record("collect", node.nodeid.split("::")[0], describe(call.excinfo))


def pytest_runtest_logstart(nodeid, location):
    record("start", nodeid.split("::")[-1])             # first: a student's process that never answers below
    sys.modules["adapters"]._connection.output.clear()  # stops this test, not the record of its start
    try:                                                # (the student's process writes where it is near the limit)
        sys.modules["adapters"].harness("test_started")
    except Exception:
        pass                                            # a process that died will be restarted by the test


def pytest_runtest_logreport(report):
    name = report.nodeid.split("::")[-1]
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        record("failed", name, getattr(report, "course_message", None)
               or (crash.message if crash is not None else str(report.longrepr).splitlines()[-1]),
               getattr(report, "course_cause", "error"))
    elif report.skipped:
        record("failed", name, f"the test was skipped: {{report.longrepr}}")
    elif report.when == "call" and report.passed:
        record("passed", name)


def pytest_collection_finish(session):
    sys.modules["adapters"]._connection.start()        # the tests are read: now the student's process may run


def pytest_sessionfinish(session, exitstatus):
    sys.modules["adapters"]._connection.close()
'''

# How the test process starts: ``python -I -S -B -c BOOT``: no site module (no .pth, sitecustomize), the tests'
# folder and the grader's site-packages on the path, and not dumpable (another process of the same user can
# neither read its memory or pipes through /proc nor attach to it).
BOOT = '''\
import sys
sys.path[:0] = [{tests!r}]
sys.path += {site_dirs!r} + {reference!r}          # last: the instructor's library (oracle.reference), where the
#                                                   hidden tests are: a student copy has none, nor a reference
try:
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)            # PR_SET_DUMPABLE = 0
except Exception:
    pass
import pytest
sys.exit(pytest.main({args!r}))
'''


@dataclass
class Result:
    name: str
    visibility: str        # "public" or "hidden"
    max_score: float
    score: float
    status: str            # "passed" or "failed"
    output: str            # the failure's message, a few lines ("" when passed)
    task: str = ""         # the sheet's task the test grades
    cause: str = ""        # a failure's kind (``HIDDEN_SAYS``): what a hidden test's JSON says instead of output


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


def message(text: str) -> str:
    """A failure in a few lines for the JSON: its first lines (at most ``MESSAGE_LINES`` and
    ``MESSAGE_CHARS``), keeping the line that says how far off a tensor was."""
    lines = [s.rstrip() for s in text.splitlines() if s.strip()]
    keep = lines[:MESSAGE_LINES]
    off = [s for s in lines if s.lstrip().startswith("Greatest absolute difference")][:1]
    if off and off[0] not in keep:
        keep[-1] = off[0]
    out = "\n".join(keep)
    return out if len(out) <= MESSAGE_CHARS else out[:MESSAGE_CHARS - 3] + "..."


def first_line(text: str, width: int = 200) -> str:
    """The first non-empty line of a failure, the line saying how far off a tensor was and the student's line
    the exception was raised in (``student_process``), where there are such, in at most ``width`` characters
    (cut at a word: ``shorten``)."""
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    said = [[s for s in lines[1:] if s.startswith(start)][:1] for start in ("Greatest absolute difference",
                                                                           "(raised in ")]
    return shorten(" ".join(lines[:1] + said[0] + said[1]), width)


def shorten(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: cut after the last whole word that fits, then "…" (mid-word
    only where one word fills more than half the width)."""
    if len(text) <= width:
        return text
    cut = text[:width - 1]
    space = cut.rfind(" ")
    if space > width // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:.") + "…"


def read_bounded(path: Path, head: int = LOG_HEAD, tail: int = LOG_TAIL) -> str:
    """A file's first ``head`` and last ``tail`` bytes, with a line counting what lies between: what a
    process wrote costs the grader a bounded read, however long it is."""
    if not path.exists():
        return ""
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        if size <= head + tail:
            return f.read().decode(errors="replace")
        start = f.read(head)
        f.seek(size - tail)
        end = f.read(tail)
    return (start.decode(errors="replace") + f"\n[... {size - head - tail} bytes left out ...]\n"
            + end.decode(errors="replace"))


@dataclass
class Progress:
    """What the test processes have recorded so far."""
    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)    # test -> (status, message)
    running: str | None = None          # the test that started last and has no outcome (a crash or a stop)
    starts: int = 0                     # how many tests have started, in all
    collect: dict[str, str] = field(default_factory=dict)                 # test file -> why it did not import
    causes: dict[str, str] = field(default_factory=dict)    # test -> "raised", "wrong" or "error" (its failure)


def parse_results(text: str) -> Progress:
    """What the test process sent so far (one JSON object a line)."""
    p = Progress()
    for line in text.splitlines():
        try:
            rec = json.loads(line)
            kind, name, text, why = rec["kind"], rec["name"], rec["message"], rec.get("cause", "")
        except (ValueError, KeyError, TypeError):
            continue                                    # a line cut short by a kill
        if kind == "start":
            p.running, p.starts = name, p.starts + 1
        elif kind == "collect":
            p.collect.setdefault(name, text)
        elif p.outcomes.get(name, ("",))[0] != "failed":          # the first failure of a test is its outcome
            p.outcomes[name] = (kind, message(text) if kind == "failed" else "")
            if kind == "failed" and why in HIDDEN_SAYS:
                p.causes.setdefault(function(name), why)
            p.running = None if name == p.running else p.running
    return p


def read_results(path: Path) -> Progress:
    """``parse_results`` of a file."""
    return parse_results(path.read_text() if path.exists() else "")


def escaped(text: str) -> str:
    """``text`` with each character a terminal would act on (a control or format character) as its escape."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def where_it_was(dump: Path, student: Path) -> str:
    """The deepest line of the student's code in the last traceback dump (written just before a test's time
    limit), as ", in FILE, line N (FUNCTION)"; "" if there is none. Escaped: the student's process writes the
    dump, and a file name it wrote there in a fake traceback redrew the grader's table (round fifteen)."""
    text = ""
    if dump.exists():                                     # its end only: the student's output may be huge
        with dump.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - DUMP_TAIL))
            text = f.read(DUMP_TAIL).decode(errors="replace")
    for filename, line, function in re.findall(r'File "(.+?)", line (\d+) in (\S+)', text.split("Timeout (")[-1]):
        path = Path(filename)
        if student in path.parents:
            return escaped(f", in {path.relative_to(student)}, line {line} ({function})")
    return ""


class Pipe:
    """The results pipe: the test process writes each line, the grader reads what has come."""

    def __init__(self):
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.text = b""

    def read(self) -> str:
        while True:
            try:
                chunk = os.read(self.read_fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            self.text += chunk
        return self.text.decode(errors="replace")

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def watch(cmd: list[str], cwd: Path, env: dict, results: Pipe, log: Path, per_test_s: float,
          deadline: float) -> tuple[int | None, str | None]:
    """Run one test process, stopping it when its running test passes ``per_test_s`` (counted from the test's
    start line), when collecting the tests passes ``START_S``, or at ``deadline`` (``time.monotonic``); then
    end every process it started. Returns (its exit code, None) or (None, "test" | "collect" | "run"): why
    it was stopped."""
    with log.open("w") as out:
        proc = confine.start(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, pass_fds=(results.write_fd,))
    base = starts = parse_results(results.read()).starts
    since, why = time.monotonic(), None
    try:
        while proc.poll() is None:
            time.sleep(POLL_S)
            now, n = time.monotonic(), parse_results(results.read()).starts
            if n != starts:
                starts, since = n, now
            if now > deadline:
                why = "run"
            elif now - since > (per_test_s if starts > base else START_S):
                why = "test" if starts > base else "collect"
            if why:
                break
    finally:
        confine.end(proc)                  # the test process, the student's, and all they started
    results.read()
    return (None, why) if why else (proc.returncode, None)


def run_limit_s(n_tests: int, per_test_s: float) -> float:
    """The whole run's time limit: it grows with the number of tests."""
    return RUN_BASE_S + n_tests * (per_test_s + RESTART_S)


def site_dirs() -> list[str]:
    """The folders the grader's own packages (torch, pytest) come from, without what ``.pth`` files add."""
    return [p for p in dict.fromkeys(site.getsitepackages()) if Path(p).is_dir()]


def tests_folder(parent: Path, tests: list[Path], conftest: str) -> Path:
    """A new folder (only this user can read it) holding the tests, the oracle, the stand-in for the adapters,
    the grader's wrappers of the copy's kernels (``launchers.py``), the conftest and an empty pytest.ini."""
    here = Path(tempfile.mkdtemp(prefix="round-", dir=parent))
    for t in tests:
        shutil.copy2(t, here / t.name)
    for f in ("oracle.py", "sandbox/remote.py", "sandbox/student_process.py", "launchers.py"):
        shutil.copy2(COURSE / f, here / Path(f).name)
    (here / "conftest.py").write_text(conftest)
    (here / "pytest.ini").write_text("[pytest]\naddopts =\n")
    return here


def child_version(name: str) -> str | None:
    """The version of package ``name`` that the test and student processes import (from ``site_dirs``, the
    first found), or None where they find none."""
    for dist in importlib.metadata.distributions(path=site_dirs()):
        if (dist.metadata["Name"] or "").lower() == name:
            return dist.version
    return None


def interpreter_refusal(assignment: Assignment) -> str | None:
    """Why the assignment cannot be graded here, in one line, where its tests would run Triton kernels in an
    interpreter that cannot run them (``kernels.interpreter_problem``, for the Triton and numpy the test and
    student processes import: a known clash of the two); None elsewhere. It imports this repository's
    ``kernels`` (and torch) into the grader's process, for these assignments only."""
    if not assignment.interpreter or os.environ.get("TRITON_INTERPRET", "1") != "1":
        return None
    versions = child_version("triton"), child_version("numpy")
    if None in versions:                            # no Triton (macOS) or no numpy: not this clash
        return None
    import kernels
    problem = kernels.interpreter_problem(*versions)
    return (f"the {assignment.name} assignment's tests run Triton kernels in its CPU interpreter, and {problem}"
            if problem else None)


def check_interpreter(assignment: Assignment) -> None:
    """``interpreter_refusal`` as a one-line error, before any test runs."""
    if why := interpreter_refusal(assignment):
        raise SystemExit(f"error: {why}")


def run_tests(assignment: Assignment, student: Path, hidden: bool = True, per_test_s: float = PER_TEST_S,
              tasks: tuple[str, ...] | None = None, require_room: bool = False,
              seed: int | None = None) -> tuple[list[Result], float, str, str]:
    """Run the assignment's tests against ``student`` (only those of ``tasks`` if given) on inputs drawn from
    ``seed`` (``COURSE_SEED`` in the test process; ``oracle.seed``); (results, seconds, pytest's output, the
    user the student's code ran as)."""
    check_interpreter(assignment)
    tests = assignment.tests(hidden)
    reference = [str(ROOT)] if any(t.name == "test_hidden.py" for t in tests) else []     # oracle.reference
    with tempfile.TemporaryDirectory(prefix=f"grade-{assignment.name}-") as tmp, \
            tempfile.TemporaryDirectory(prefix="grade-results-") as out, \
            tempfile.TemporaryDirectory(prefix="grade-copy-") as copy, \
            tempfile.TemporaryDirectory(prefix="grade-home-") as home, confine.confined():
        tmp, out, copy, home = Path(tmp), Path(out), Path(copy), Path(home)
        copy.chmod(0o755)
        scratch = confine.scratch_copy(student, copy / "copy")
        spec, runs_as = confine.room(tmp, scratch, home, site_dirs(), ROOT)   # course/sandbox/jail.py
        python = [sys.executable, sysconfig.get_paths()["stdlib"], *site_dirs()]
        nobody = spec is None and os.geteuid() == 0 and confine.unreadable_by_others(python) is None
        if spec is None and os.geteuid() == 0 and not nobody:      # never as root: refused, saying what to change
            raise SystemExit(f"error: {confine.as_root_refusal(python, runs_as)}")
        if spec is None:                       # no room here: the student's code runs unconfined
            if require_room:
                raise SystemExit(f"error: the student's code cannot be confined here ({runs_as}); it could read "
                                 f"{', '.join(confine.readable_unconfined(ROOT, nobody))}")
            runs_as = "UNCONFINED: " + confine.unconfined(ROOT, nobody, runs_as)
        if nobody:                             # the student's process runs as nobody: its own home, nothing else
            os.chown(home, confine.NOBODY, confine.NOBODY)
        dump = out / "dump.txt"
        dump.touch()
        results = Pipe()
        conftest = CONFTEST.format(
            results_fd=results.write_fd, dump=str(dump), student=str(scratch), student_chars=STUDENT_CHARS,
            adapters=str(scratch / "course" / assignment.name / "adapters.py"), site_dirs=site_dirs(),
            per_dump_s=per_test_s * 0.8, home=str(home), nobody=nobody,
            jail=confine.jailed([]) if spec else None, room=confine.spec_bytes(spec).decode() if spec else None)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
        env.update({"OMP_NUM_THREADS": "1", "COURSE_SEED": str(new_seed() if seed is None else seed)})
        env.setdefault("TRITON_INTERPRET", "1")      # no GPU: the kernels run in Triton's interpreter
        node = {n: f"{t.name}::{n}" for t in tests for n, (_, task) in marks_of(t).items()   # name -> node id
                if tasks is None or task in tasks}
        limit = run_limit_s(len(node), per_test_s)
        outcomes, causes, logs, t0 = {}, {}, [], time.monotonic()
        try:
            while remaining := [n for n in node if n not in outcomes]:
                if time.monotonic() - t0 > limit - 1:
                    outcomes.update({n: ("failed", f"not run: the whole run reached its limit of {limit:g} s")
                                     for n in remaining})
                    break
                here = tests_folder(tmp, tests, conftest)    # a fresh one each round: nothing left from the last
                args = ["-q", "-p", "no:cacheprovider", "-c", str(here / "pytest.ini"), "--rootdir", str(here),
                        "--continue-on-collection-errors", *[node[n] for n in remaining]]
                cmd = [sys.executable, "-I", "-S", "-B", "-c",
                       BOOT.format(tests=str(here), site_dirs=site_dirs(), reference=reference, args=args)]
                before = len(results.read())
                code, why = watch(cmd, here, env, results, out / "log.txt", per_test_s, t0 + limit)
                log = read_bounded(out / "log.txt")
                logs.append(log if why is None else f"{log}\n(stopped by the grader: {why})")
                found = parse_results(results.read()[before:])
                causes.update({n: c for n, c in found.causes.items() if n not in causes})
                outcomes.update(round_outcomes(remaining, node, found, code, why, log, per_test_s, limit,
                                               where_it_was(dump, scratch)))
        finally:
            results.close()
        seconds = time.monotonic() - t0
    results = []
    for t in tests:
        visibility = "hidden" if t.name == "test_hidden.py" else "public"
        for name, (pts, task) in marks_of(t).items():
            if name in outcomes:
                status, text = outcomes[name]
                results.append(Result(name, visibility, pts, pts if status == "passed" else 0.0, status, text,
                                      task or "", causes.get(name, "") if status == "failed" else ""))
    return results, seconds, "\n".join(logs), runs_as


def new_seed() -> int:
    """A seed no copy can know in advance: the tests' random inputs are drawn from it (``oracle.seed``), so a
    table of answers recorded from an earlier run earns nothing."""
    import secrets
    return secrets.randbelow(SEEDS)


def function(test: str) -> str:
    """The test function of a recorded test: ``test_x[llama]`` (a parametrized case) -> ``test_x``."""
    return test.split("[")[0]


def round_outcomes(remaining: list[str], node: dict[str, str], found: Progress, code: int | None,
                   why: str | None, log: str, per_test_s: float, limit: float, where: str) -> dict:
    """The outcomes one test process settled, of the test functions it was given (a parametrized one passes
    when all its cases pass): what it recorded; the test it was running when it crashed or was stopped; the
    tests of a file that did not import. Tests it never reached are left for a fresh process (if it made no
    progress at all, they fail, so the grader never loops)."""
    new = {}
    for case, (status, text) in found.outcomes.items():
        name = function(case)
        if name in remaining and new.get(name, ("",))[0] != "failed":
            new[name] = (status, f"{case[len(name):]} {text}" if case != name and text else text)
    running = found.running
    if running is not None and function(running) in remaining and running not in found.outcomes:
        label = running[len(function(running)):] + " " if running != function(running) else ""
        if why == "test":
            new[function(running)] = ("failed", f"{label}ran over {per_test_s:g} s{where}: the grader stopped it "
                                                "(a loop that never ends, or far too much work?)")
        elif why == "run":
            new[function(running)] = ("failed", f"{label}still running when the whole run reached its limit of "
                                                f"{limit:g} s")
        elif code not in (0, 1):
            new[function(running)] = ("failed", f"{label}the test process stopped (exit code {code}) in this test")
    for n in remaining:
        file = node[n].split("::")[0]
        if n not in new and file in found.collect:
            new[n] = ("failed", message(f"{file} could not be collected: {found.collect[file]}"))
    if why is None and code in (0, 1):               # pytest finished: its exit code must agree with the record
        if new and (code == 0) != all(o[0] == "passed" for o in new.values()):
            return {n: ("failed", f"pytest's exit code {code} disagrees with the recorded outcomes")
                    for n in remaining}
    last = [s for s in log.splitlines() if s.strip()][-1:]
    if why is None and code in (0, 1) or not new:    # what pytest did not run will not run (never loop)
        reason = {"collect": f"the tests did not start within {START_S} s (a loop at import time?)",
                  "run": f"the whole run reached its limit of {limit:g} s"}.get(why, first_line(last[0] if last
                                                                                                else "no output"))
        new.update({n: ("failed", f"did not run: {reason}") for n in remaining if n not in new})
    return new


def adapter_changes(assignment: Assignment, student: Path) -> list[str]:
    """The adapter files of the student copy that differ from this repository's (worth a look: the tests
    reach the student's code only through them)."""
    files = [f"course/{assignment.name}/adapters.py", "course/model_adapters.py"]
    return [f for f in files if (student / f).exists() and (ROOT / f).exists()
            and (student / f).read_bytes() != (ROOT / f).read_bytes()]


def notes(summary: dict, public_only: bool = False) -> list[str]:
    """What the grade comes with: the hidden tests' absence, adapters that differ from the repository's."""
    out = [] if summary["hidden_tests"] or public_only else \
        ["hidden tests: not in this copy (the instructor's grader has them); the score is out of the public points"]
    if summary.get("runs_as", "").startswith("UNCONFINED"):
        out.append(f"note: the student's code ran {summary['runs_as']}; see course/README.md, section \"Threat "
                   "model\"")
    return out + [f"note: the student's {f} differs from this repository's: read it (the tests reach the code "
                  "only through the adapters)" for f in summary["changed_adapters"]]


WHY_WIDTH, WHY_CHARS = 90, 360       # the table's "why": lines of at most 90 characters, 4 lines at most


def table(results: list[Result]) -> str:
    """The results grouped by task: a line per task with its points, then its tests, one line each."""
    if not results:
        return "(no test)"
    width = max(len(r.name) for r in results) + 2
    lines = [f"{'task / test':<{width}}  {'kind':<6}  {'points':>9}  outcome  why", "-" * (width + 40)]
    for task in dict.fromkeys(r.task for r in results):
        group = [r for r in results if r.task == task]
        got, of = sum(r.score for r in group), sum(r.max_score for r in group)
        lines.append(f"{'task ' + (task or '(none)'):<{width}}  {'':<6}  {got:>4g} / {of:<3g}")
        for r in group:
            why = textwrap.wrap(first_line(r.output, width=WHY_CHARS), WHY_WIDTH) or [""]   # wrapped, not cut
            head = (f"  {r.name:<{width - 2}}  {r.visibility:<6}  {r.score:>4g} / {r.max_score:<3g}  "
                    f"{'pass' if r.status == 'passed' else 'FAIL':<7}  ")
            lines += [head + why[0], *(" " * len(head) + more for more in why[1:])]   # under the first "why"
    return "\n".join(lines)


HIDDEN_VISIBILITY = ("after_published", "after_due_date")    # Gradescope's settings a hidden test may take


def gradescope(results: list[Result], seconds: float, note: str, hidden: str = "after_published") -> dict:
    """The results in Gradescope's autograder format (``note``: the top-level output; ``hidden``: when students
    see the hidden tests, once grades are published or once the due date has passed)."""
    return {
        "score": sum(r.score for r in results),
        "execution_time": round(seconds, 1),
        "output": note,
        "visibility": "visible",
        "stdout_visibility": "hidden",
        "tests": [{"name": f"{r.visibility}: {r.name}" + (f" (task {r.task})" if r.task else ""),
                   "score": r.score, "max_score": r.max_score, "status": r.status,
                   "output": r.output if r.visibility == "public" else hidden_output(r),
                   "visibility": "visible" if r.visibility == "public" else hidden} for r in results],
    }


HIDDEN_SAYS = {"raised": "your code raised an exception in this test",
               "wrong": "wrong answer: the test's check failed",
               "error": "the test failed on what your code returned"}


def hidden_output(r: Result) -> str:
    """What the student sees of a hidden test once grades are published: words the grader writes (the kind of
    failure; the test's name and points stand beside it), never text or bytes the student's code produced (its
    exception, the values it returned, the inputs it was given). The full message stays in the grader's table,
    for the instructor."""
    if r.status == "passed":
        return ""
    if r.cause in HIDDEN_SAYS:
        return HIDDEN_SAYS[r.cause]
    if "ran over" in r.output or "reached its limit" in r.output:
        return "ran over its time limit: the grader stopped it"
    if "stopped" in r.output:
        return "a process stopped in this test (the one running your code, or the test's)"
    return "failed: the test could not run to its end"


QUOTE = 40      # characters in a row of the hidden tests' text that withhold a public test's message


def decodings(text: str) -> list[str]:
    """``text`` and what its base64 and hex runs decode to (a message that carries a file encoded)."""
    import base64
    import binascii
    out = [text]
    for run in re.findall(r"[A-Za-z0-9+/=_-]{24,}", text):
        for decode in (lambda r: base64.b64decode(r + "=" * (-len(r) % 4), altchars=b"-_" if "-" in r or "_" in r
                                                  else None), binascii.unhexlify):
            try:
                out.append(decode(run).decode(errors="replace"))
            except (ValueError, binascii.Error):
                pass
    return out


def withhold_hidden_text(results: list[Result], assignment: Assignment) -> None:
    """A public test's message is shown to the student: it is cut to ``PUBLIC_CHARS`` (with at most two short
    lines of the student's own exception: the conftest), and one that quotes the hidden tests, as they are or
    in base64 or hex (code that read them and raised them), is replaced by a note. The student's process cannot
    read them in its room (course/sandbox/jail.py); this holds where it runs unconfined."""
    words = [" ".join(t.read_text().split()) for t in assignment.tests(hidden=True) if t.name == "test_hidden.py"]
    quotes = {w[i:i + QUOTE] for w in words for i in range(len(w) - QUOTE + 1)}
    for r in results:
        if r.visibility != "public":
            continue
        r.output = r.output if len(r.output) <= PUBLIC_CHARS else r.output[:PUBLIC_CHARS - 3] + "..."
        for said in map(lambda t: " ".join(t.split()), decodings(r.output)):
            if any(said[i:i + QUOTE] in quotes for i in range(len(said) - QUOTE + 1)):
                r.output = "(the message quoted the grader's hidden tests: withheld)"
                break


def task_names(assignment: Assignment, hidden: bool = True) -> list[str]:
    """The tasks the assignment's tests grade, in the order they first appear."""
    return list(dict.fromkeys(task for t in assignment.tests(hidden) for _, task in marks_of(t).values() if task))


def grade(name: str, student: Path | None = None, hidden: bool = True, per_test_s: float = PER_TEST_S,
          tasks: tuple[str, ...] | None = None, require_room: bool = False, seed: int | None = None) -> dict:
    """Grade ``name`` against ``student`` (default: this repository), only ``tasks`` if given, on inputs drawn
    from ``seed`` (default: a fresh one). Returns a summary dict."""
    assignment = get(name)
    student = Path(student or ROOT).expanduser()
    check_name(student, "--student")
    student = student.resolve()
    if not student.is_dir():
        raise SystemExit(f"error: no folder {student}")
    from . import submit  # a pack (course.submit) is laid over a pristine copy
    if submit.is_pack(student):
        with tempfile.TemporaryDirectory(prefix="grade-pack-") as laid:
            summary = grade(name, submit.lay_over(student, name, Path(laid) / "copy"), hidden, per_test_s, tasks,
                            require_room, seed)
        return {**summary, "student": str(student)}
    if not (student / "course" / name / "adapters.py").exists():
        raise SystemExit(f"error: {student} has no course/{name}/adapters.py; is it a student copy of {name!r}?")
    check_per_test_s(per_test_s)
    if tasks is not None and set(tasks) - set(task_names(assignment, hidden)):
        raise SystemExit(f"error: no task {sorted(set(tasks) - set(task_names(assignment, hidden)))[0]!r} in "
                         f"{name!r}; its tasks: {', '.join(task_names(assignment, hidden)) or '(none)'}")
    check_seed(seed)
    seed = new_seed() if seed is None else seed
    results, seconds, log, runs_as = run_tests(assignment, student, hidden, per_test_s, tasks, require_room, seed)
    withhold_hidden_text(results, assignment)
    has_hidden = any(r.visibility == "hidden" for r in results)
    return {"assignment": name, "student": str(student), "results": [asdict(r) for r in results],
            "score": sum(r.score for r in results), "max_score": sum(r.max_score for r in results),
            "seconds": seconds, "hidden_tests": has_hidden, "log": log,
            "changed_adapters": adapter_changes(assignment, student), "runs_as": runs_as, "seed": seed}


def check_seed(seed: int | None) -> None:
    """``--seed``: an integer 0 <= N < ``SEEDS``."""
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < SEEDS):
        raise SystemExit(f"error: --seed must be an integer from 0 to {SEEDS - 1}, got {seed}")


def check_per_test_s(per_test_s: float) -> None:
    """``--per-test-s``: a finite number of seconds the grader can enforce (``MIN_PER_TEST_S`` or more)."""
    if not (math.isfinite(per_test_s) and per_test_s > 0):
        raise SystemExit(f"error: --per-test-s must be a positive, finite number of seconds, got {per_test_s}")
    if per_test_s < MIN_PER_TEST_S:
        raise SystemExit(f"error: --per-test-s {per_test_s:g} is below {MIN_PER_TEST_S:g} s, the shortest limit the "
                         f"grader enforces (it checks the running test every {POLL_S:g} s)")


def check_new_file(path: Path) -> None:
    """``--json``: a new file in an existing, writable folder, with a name the file system takes."""
    check_name(path, "--json")
    if not path.parent.is_dir():
        raise SystemExit(f"error: --json {path}: the folder {path.parent} does not exist")
    if path.exists() or path.is_symlink():
        raise SystemExit(f"error: {path} exists; name a new file (nothing is overwritten)")
    if not os.access(path.parent, os.W_OK):
        raise SystemExit(f"error: --json {path}: the folder {path.parent} is not writable")


def write_new_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all, and never over a file. A file that appeared there while
    grading was not written by this grader (it was not there when the flags were checked): it is removed, so no
    grade but the grader's is ever found at ``path``, and the command fails in one line."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:100]}.", dir=path.parent)
    except OSError as e:
        raise SystemExit(f"error: --json {path}: cannot write there ({e.strerror or e}); no grade was written") \
            from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.link(tmp, path)                        # fails if the name exists: atomic, and never replaces
    except FileExistsError:
        try:
            path.unlink()
            what = "removed it"
        except OSError as e:
            what = f"could not remove it ({e.strerror}): do not use it"
        raise SystemExit(f"error: {path} appeared while grading, not written by this grader (the student's code, or "
                         f"another run): {what}; no grade was written") from None
    except OSError as e:                          # a full disk, a file size limit, a folder gone read-only
        raise SystemExit(f"error: --json {path}: writing the grade failed ({e.strerror or e}); no grade was "
                         "written (the table above is the grade)") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


@command_line
def main(argv: list[str] | None = None) -> None:
    parts = __doc__.strip().split("\n\n")       # the first line, examples, the copy, time, output
    p = argparse.ArgumentParser(prog="python -m course.grade", description=parts[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(parts[1:] + ["assignments: " + ", ".join(ASSIGNMENTS)]))
    p.error = refuse
    p.add_argument("assignment", help="which assignment: " + ", ".join(ASSIGNMENTS))
    p.add_argument("--student", type=Path, default=None,
                   help="the student copy to grade (default: this repository, whose reference solutions get "
                        "full marks)")
    p.add_argument("--json", type=Path, default=None,
                   help="write Gradescope-style results here: a new file in an existing folder")
    p.add_argument("--public-only", action="store_true", help="run only the public tests")
    p.add_argument("--hidden-visibility", choices=HIDDEN_VISIBILITY, default=HIDDEN_VISIBILITY[0],
                   help="in --json, when Gradescope shows students the hidden tests: once grades are published "
                        "(default) or once the due date has passed")
    p.add_argument("--per-test-s", type=float, default=PER_TEST_S,
                   help=f"time limit of one test in seconds, {MIN_PER_TEST_S:g} or more (default {PER_TEST_S}); the "
                        f"grader stops a test that runs over it, and the whole run after {RUN_BASE_S} s + "
                        f"(this + {RESTART_S} s) per test")
    p.add_argument("-k", "--task", action="append", default=None, metavar="TASK",
                   help="grade only this task's tests (repeatable); the tasks are the sheet's (e.g. window_vote)")
    p.add_argument("--seed", type=int, default=None,
                   help=f"draw the tests' random inputs from this seed (0 to {SEEDS - 1}; default: a fresh one each "
                        "run, printed with the score, so a failure can be run again on the same inputs)")
    p.add_argument("--log", action="store_true", help="print pytest's own output after the table")
    p.add_argument("--require-confinement", action="store_true",
                   help="refuse to grade, in one line naming what the student's code could read, where its private "
                        "file system cannot be built (without it, such a grade says it ran unconfined)")
    args = p.parse_args(argv)
    if args.json is not None:                       # every flag is checked before any test runs
        check_new_file(args.json)
    check_per_test_s(args.per_test_s)
    check_seed(args.seed)
    summary = grade(args.assignment, args.student, hidden=not args.public_only, per_test_s=args.per_test_s,
                    tasks=None if args.task is None else tuple(args.task), require_room=args.require_confinement,
                    seed=args.seed)
    results = [Result(**r) for r in summary["results"]]
    print(f"assignment {args.assignment!r}, student copy {summary['student']}\n")
    print(table(results))
    print(f"\nscore: {summary['score']:g} / {summary['max_score']:g} in {summary['seconds']:.1f} s (inputs from "
          f"--seed {summary['seed']})")
    said = notes(summary, args.public_only)
    for line in said:
        print(line)
    if args.log:
        print("\n" + summary["log"])
    if args.json is not None:
        write_new_file(args.json, json.dumps(gradescope(results, summary["seconds"], "\n".join(said),
                                                        args.hidden_visibility), indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
