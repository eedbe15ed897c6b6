"""
The grader against a hostile student (README: the course's threat model). Each test is an attack that forged
a grade, reached the grader's files or destroyed data before the grader ran the student's code in a process
of its own; each now scores what the work deserves, and the ``--json`` on disk says what the grader printed.

* Files the student controls that Python or pytest would run (``sitecustomize.py``, ``usercustomize.py``, a
  ``.pth`` file, ``conftest.py``) never run.
* A daemon (its own session, escaping the process group) is gone before the grade is written.
* Library code cannot import the grader's tests or oracle, write the test process's results, or pass its
  checks by patching torch; it has no capabilities when the grader runs as root without a Python the user
  ``nobody`` can read, and runs as ``nobody`` when it can.
* ``--json`` is written whole, never over a file that appeared meanwhile; Ctrl-C and SIGTERM end in one line
  with no folder and no process left behind; ``course.handout`` leaves no half-written folder.
"""

from __future__ import annotations

import base64
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import pytest

from course import grade, gradescope
from course.assignments import ASSIGNMENTS, ROOT
from course.sandbox import confine, remote
from tests.commands import refused
from tests.course.test_grader import graded_here, put, reference, student_copy, toy_connection

pytestmark = pytest.mark.slow


def graded(capsys, copy: Path, out: Path, *flags: str) -> tuple[dict, str]:
    """``course.grade cache`` of ``copy`` with ``--json out``: (the JSON on disk, what was printed)."""
    grade.main(["cache", "--student", str(copy), "--json", str(out), *flags])
    return json.loads(out.read_text()), capsys.readouterr().out


def public_in_its_room(capsys, copy: Path, out: Path, task: str) -> list[str]:
    """The public tests' messages of ``task`` graded in the room (the test skips where no room can be built)."""
    results, _ = graded(capsys, copy, out, "-k", task)
    if "UNCONFINED" in results["output"]:
        pytest.skip("no room can be built here")
    return [t["output"] for t in results["tests"] if t["visibility"] == "visible"]


def same_as_printed(results: dict, printed: str) -> None:
    """The JSON's score and each test's status are the ones the table printed."""
    assert f"score: {results['score']:g} / " in printed, (results["score"], printed[-300:])
    for t in results["tests"]:
        name = t["name"].split(": ", 1)[1].split(" (task")[0]
        line = next(s for s in printed.splitlines() if s.strip().startswith(name + " "))
        assert ("pass" if t["status"] == "passed" else "FAIL") in line.split(), (t, line)


def marker_folder() -> Path:
    """A folder any user may write in (the student's code may run as nobody): a marker there proves it ran."""
    folder = Path(tempfile.mkdtemp(prefix="hostile-"))
    folder.chmod(0o777)
    return folder


FORGE = """
import atexit, builtins, glob, json, os, sys
builtins.FORGED = getattr(builtins, "FORGED", []) + [{name!r}]     # seen by the graded code, if this ran there
try:
    open({marker!r} + "/" + {name!r}, "w").write("ran")            # seen by this test, if this ran outside a room
except OSError:
    pass
def forge():
    for path in glob.glob("/tmp/grade-results-*/*") + [a for a in sys.argv if a.endswith(".json")]:
        try:
            open(path, "a").write(json.dumps({{"kind": "passed", "name": "test_append_then_read", "message": ""}}))
        except OSError:
            pass
    os._exit(0)
atexit.register(forge)
"""


def test_files_python_or_pytest_would_run_never_run(tmp_path, capsys):
    """The copy holds every file that Python's start-up or pytest would import and run, each forging the
    results at exit: none runs, the untouched copy scores 0."""
    copy, markers = student_copy(tmp_path), marker_folder()
    for rel in ("sitecustomize.py", "usercustomize.py", "conftest.py", "course/conftest.py",
                "course/cache/conftest.py", "course/cache/sitecustomize.py", "nanollm/sitecustomize.py"):
        (copy / rel).write_text(FORGE.format(marker=str(markers), name=rel.replace("/", "_")))
    (copy / "forge.pth").write_text("import builtins; builtins.FORGED = getattr(builtins, 'FORGED', []) + ['pth']\n")
    put(copy / "nanollm" / "attention.py", "group_scores", [
        "import builtins",
        "raise NotImplementedError(f'start-up files that ran here: {getattr(builtins, \"FORGED\", [])}')"])
    results, printed = graded(capsys, copy, tmp_path / "r.json")
    assert results["score"] == 0 and all(t["status"] == "failed" for t in results["tests"]), printed
    assert not list(markers.iterdir()), f"ran: {sorted(p.name for p in markers.iterdir())}"
    said = [t["output"] for t in results["tests"] if "group_scores" in t["name"] and t["visibility"] == "visible"]
    assert said and all("start-up files that ran here: []" in o for o in said), said
    same_as_printed(results, printed)


def processes_naming(text: str) -> list[int]:
    """Processes whose command line holds ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def test_a_daemon_is_gone_before_the_grade_is_written(tmp_path, capsys):
    """The student's code starts a daemon (double fork, a session of its own, a program of its own) that waits
    for the results file and writes full marks into it. In a room no process starts at all (the fork fails);
    without one, it is seen running while the copy is graded and gone once the grade is written. Either way the
    file on disk keeps what was printed."""
    copy, out, token = student_copy(tmp_path), tmp_path / "r.json", f"daemon-{os.getpid()}-{time.time_ns()}"
    forged = json.dumps({"score": 27, "tests": []})
    waits = (f"import os, time\nwhile True:\n    time.sleep(0.05)\n    if os.path.exists({str(out)!r}):\n"
             f"        open({str(out)!r}, 'w').write({forged!r})\n")
    put(copy / "nanollm" / "storage.py", "append", [
        "import os, sys",
        "if os.fork() == 0:",
        "    os.setsid()",
        "    if os.fork() == 0:",
        f"        os.execv(sys.executable, [sys.executable, '-c', {waits!r}, {token!r}])",
        "    os._exit(0)",
        "raise NotImplementedError('not done')"])
    seen, done = [], threading.Event()

    def look():
        while not done.is_set() and not seen:
            seen.extend(processes_naming(token))
            time.sleep(0.05)
    watcher = threading.Thread(target=look)
    watcher.start()
    try:
        results, printed = graded(capsys, copy, out, "-k", "append")
    finally:
        done.set()
        watcher.join()
    if "UNCONFINED" not in results["output"]:
        public = [t["output"] for t in results["tests"] if t["visibility"] == "visible"]
        assert not seen and public and all("Operation not permitted" in t for t in public), public
    else:
        assert seen, "the daemon never ran: the test proves nothing"
    time.sleep(1)
    assert not processes_naming(token), "the daemon outlived the grade"
    assert json.loads(out.read_text()) == results and results["score"] == 0, out.read_text()[:200]
    same_as_printed(results, printed)


def test_library_code_cannot_reach_the_tests_or_the_results(tmp_path, capsys):
    """The graded code tries the grader's modules, writes passing records into every file descriptor it can
    find (its own and, through /proc, its parent's), and patches torch's comparisons to always agree: its
    wrong answer still fails, and the imports are refused."""
    copy = student_copy(tmp_path)
    record = json.dumps({"kind": "passed", "name": "test_decode_step_scores_with_gqa", "message": ""}) + "\n"
    put(copy / "nanollm" / "attention.py", "group_scores", [
        "import glob, os, sys",
        "import torch",
        "found = []",
        "for name in ('test_public', 'test_hidden', 'oracle', 'conftest', 'remote', 'course.oracle'):",
        "    try:",
        "        __import__(name)",
        "        found.append(name)",
        "    except ImportError:",
        "        pass",
        "found += [n for n in sys.modules if n.startswith('test_') or n in ('oracle', 'conftest')]",
        "fds = [f'/proc/self/fd/{n}' for n in range(3, 64)] + glob.glob(f'/proc/{os.getppid()}/fd/*')",
        "for path in fds:",
        "    try:",
        "        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)",
        f"        os.write(fd, {record!r}.encode() * 50)",
        "        os.close(fd)",
        "    except OSError:",
        "        pass",
        "torch.testing.assert_close = lambda *a, **k: None",
        "torch.allclose = torch.equal = lambda *a, **k: True",
        "if found:",
        "    raise RuntimeError(f'imported the grader: {found}')",
        "return torch.zeros(1)"])
    results, printed = graded(capsys, copy, tmp_path / "r.json", "-k", "group_scores")
    assert results["tests"] and results["score"] == 0, printed
    assert not any("imported the grader" in t["output"] for t in results["tests"]), printed
    same_as_printed(results, printed)


# A walk of the whole file system, less the kernel's folders and the system's and Python's own packages (to
# keep the tests short; site-packages is searched through its finder and metadata instead).
WALK_SKIP = "SKIP = ('/proc', '/sys', '/dev', '/usr/share', '/usr/include', '/usr/lib', '/usr/lib64')"
WALK_PRUNE = "    subfolders[:] = [s for s in subfolders if os.path.join(folder, s) not in SKIP and 'site-packages' " \
             "not in folder]"
LOOK_FOR_HIDDEN_TESTS = [
    "import base64, glob, os",
    WALK_SKIP,
    "found = glob.glob('/tmp/grade-*/round-*/test_hidden.py') + [{hidden!r}]",
    "for folder, subfolders, files in os.walk('/'):",
    WALK_PRUNE,
    "    found += [os.path.join(folder, f) for f in files if f == 'test_hidden.py']",
    "for path in found:",
    "    try:",
    "        text = open(path).read()",
    "    except (OSError, ValueError):",
    "        continue",
    "    raise RuntimeError(base64.b64encode(text[1200:2400].encode()).decode())",
    "raise RuntimeError('found no hidden tests')"]


def leaks(results: dict) -> list[str]:
    """The public messages that quote the cache's hidden tests, as they are or in base64 or hex."""
    words = " ".join((ROOT / "course" / "cache" / "test_hidden.py").read_text().split())
    quotes = {words[i:i + grade.QUOTE] for i in range(len(words) - grade.QUOTE + 1)}
    return [t["output"] for t in results["tests"] if t["visibility"] == "visible"
            for said in map(lambda x: " ".join(x.split()), grade.decodings(t["output"]))
            if any(said[i:i + grade.QUOTE] in quotes for i in range(len(said) - grade.QUOTE + 1))]


def test_the_hidden_tests_cannot_leave_through_a_public_message(tmp_path, capsys):
    """Code that looks for the hidden tests everywhere (the grader's scratch folders, the instructor's checkout,
    the whole file system) and raises them base64-encoded as the message of a public test, which the student
    sees: in its room it finds none; where it runs unconfined, the message is withheld."""
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores",
        [line.format(hidden=str(ROOT / "course" / "cache" / "test_hidden.py")) for line in LOOK_FOR_HIDDEN_TESTS])
    results, printed = graded(capsys, copy, tmp_path / "r.json", "-k", "group_scores")
    public = [t for t in results["tests"] if t["visibility"] == "visible"]
    assert public and not leaks(results), leaks(results)[:1]
    if "UNCONFINED" not in results["output"]:
        assert all("found no hidden tests" in t["output"] for t in public), public[0]["output"]
    same_as_printed(results, printed)


def test_a_public_message_is_bounded_and_never_quotes_the_hidden_tests():
    """What the student sees of a public test: at most ``PUBLIC_CHARS``; a message quoting the hidden tests
    verbatim, in base64 or in hex is withheld; the test's own words stay."""
    hidden = (ROOT / "course" / "cache" / "test_hidden.py").read_text()[1500:1700]
    said = {"plain": hidden, "base64": base64.b64encode(hidden.encode()).decode(),
            "urlsafe": base64.urlsafe_b64encode(hidden.encode()).decode().rstrip("="), "hex": hidden.encode().hex(),
            "long": "x" * 5000, "honest": "AssertionError: expected [0, 2, 5], got [0, 2, 4]"}
    results = [grade.Result(name, "public", 1, 0, "failed", text) for name, text in said.items()]
    grade.withhold_hidden_text(results, ASSIGNMENTS["cache"])
    out = {r.name: r.output for r in results}
    for name in ("plain", "base64", "urlsafe", "hex"):
        assert out[name] == "(the message quoted the grader's hidden tests: withheld)", (name, out[name][:100])
    assert len(out["long"]) == grade.PUBLIC_CHARS and out["honest"] == said["honest"]


def test_the_students_process_never_runs_as_root(tmp_path, capsys):
    """As root, the student's process runs as nobody (never as uid 0, with or without capabilities): it holds no
    capability and cannot open its parent's pipes or memory through /proc."""
    if os.geteuid() != 0:
        pytest.skip("the grader runs as root only on Gradescope-like machines; here it is an ordinary user")
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores", [
        "import os",
        "caps = [s.split()[1] for s in open('/proc/self/status') if s.startswith('CapEff')][0]",
        "parent, proc = 'closed', f'/proc/{os.getppid()}'",
        "try:",
        "    fds = [f'fd/{n}' for n in os.listdir(f'{proc}/fd')]",
        "except OSError:",
        "    fds = []",
        "for name in fds + ['mem']:",
        "    try:",
        "        os.close(os.open(f'/proc/{os.getppid()}/{name}', os.O_WRONLY | os.O_NONBLOCK))",
        "        parent = 'open'",
        "    except OSError:",
        "        pass",
        "raise RuntimeError(f'uid {os.getuid()} caps {caps} parent fds {parent}')"])
    results, printed = graded(capsys, copy, tmp_path / "r.json", "-k", "group_scores")
    said = results["tests"][0]["output"]
    assert "uid 65534 caps 0000000000000000 parent fds closed" in said, said


@pytest.mark.skipif(os.geteuid() != 0 or not confine.readable_by_others(Path("/usr/bin/python3")),
                    reason="needs root and a Python the user nobody can read (/usr/bin/python3)")
def test_as_root_the_students_process_runs_as_nobody(tmp_path):
    """Where nobody can read the Python (a system Python: Gradescope's), the student's process runs as
    nobody: a file only root may read stays closed to it. (Plain data only: that Python has no torch.)"""
    folder = Path(tempfile.mkdtemp(prefix="nobody-"))
    folder.chmod(0o755)
    (folder / "course" / "x").mkdir(parents=True)
    (folder / "course" / "x" / "adapters.py").write_text(
        "import os\n"
        "def who():\n    return os.getuid()\n"
        "def read(path):\n    return open(path).read()\n")
    for p in [folder, *folder.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    secret = tmp_path / "secret.txt"
    secret.write_text("the hidden tests")
    secret.chmod(0o600)
    connection = remote.Connection(str(folder), str(folder / "course" / "x" / "adapters.py"), [],
                                   str(tmp_path / "dump.txt"), 60.0, None, nobody=True,
                                   python="/usr/bin/python3")
    adapters = remote.Adapters(connection)
    try:
        assert adapters.who() == confine.NOBODY
        with pytest.raises(PermissionError):
            adapters.read(str(secret))
    finally:
        connection.close()


def test_a_results_file_that_appears_while_grading_fails_the_grade(tmp_path, capsys):
    """A file created at the ``--json`` path while grading (by code that reached it, or another run) is not the
    grader's: it is removed and the grade fails in one line; nothing is left at the path."""
    copy, out = student_copy(tmp_path), tmp_path / "r.json"
    threading.Timer(1.0, lambda: out.write_text('{"score": 27}')).start()
    with pytest.raises(SystemExit) as e:
        grade.main(["cache", "--student", str(copy), "--json", str(out), "-k", "mask"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "appeared while grading" in err and "removed it" in err and err.count("\n") == 1, err
    assert not out.exists(), "the planted results were kept"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".r.json")], "a temporary file was left"
    assert "name" in refused(capsys, grade.main, ["cache", "--json", str(tmp_path / ("x" * 300 + ".json"))])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_grade_leaves_nothing_behind(tmp_path, sig):
    """Ctrl-C or SIGTERM during grading: ``error: interrupted`` (exit 130), and neither scratch folders nor
    the test and student processes remain."""
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores", ["import time", "time.sleep(600)"])
    scratch = Path(tempfile.mkdtemp(prefix="interrupted-"))     # this grade's own temporary folder: another test's
    scratch.chmod(0o755)                                        # grade running beside it writes elsewhere
    proc = subprocess.Popen([sys.executable, "-m", "course.grade", "cache", "--student", str(copy), "-k",
                             "group_scores"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(scratch)})
    deadline = time.monotonic() + 45                # well inside the sleeping test's 60 s limit (PER_TEST_S)
    student = (ROOT / "course" / "sandbox" / "student_process.py").read_text()[:200]   # its command line: its code
    while not [p for p in processes_naming(student) if p != proc.pid] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert time.monotonic() < deadline, "the student's process did not start within 45 s"
    time.sleep(5)                                   # the student's process imports and reaches its sleep
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "error: interrupted", (proc.returncode, err[-500:])
    left = [p.name for p in scratch.iterdir()]
    shutil.rmtree(scratch, ignore_errors=True)
    assert not left, left
    time.sleep(0.5)
    assert not [p for p in processes_naming(str(tmp_path)) if p != proc.pid], "a grading process was left"


def test_an_interrupted_handout_leaves_no_half_written_folder(tmp_path):
    """SIGTERM while ``course.handout`` writes: ``error: interrupted``, and neither the copy nor its hidden
    temporary folder is left."""
    out = tmp_path / "hw"
    proc = subprocess.Popen([sys.executable, "-m", "course.handout", "cache", "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not [p for p in tmp_path.iterdir() if p.name.startswith(".hw.")] and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the copy was written before the signal arrived (a fast machine): nothing to check")
    assert proc.returncode == 130 and err.strip() == "error: interrupted", (proc.returncode, err[-500:])
    assert not list(tmp_path.iterdir()), sorted(p.name for p in tmp_path.iterdir())


# -- round two: what the student's process can reach, and what the tests hand it -----------------------------

def solution_seeker(needle: str, call: str) -> list[str]:
    """Graded code that looks for the instructor's file holding ``needle`` (a line of the reference solution):
    through the editable install's finder and ``direct_url.json`` in site-packages (never imported, so no import
    check sees them), at the checkout's own path, and by walking the whole file system; it runs the file it
    finds and answers with it (``call``), else raises 'no solution found'."""
    return [
        "import glob, os, re, sys",
        WALK_SKIP,
        "places = [" + repr(str(ROOT)) + "]",
        "for folder in [p for p in sys.path if p.endswith('site-packages')]:",
        "    for name in glob.glob(folder + '/__editable__*') + glob.glob(folder + '/*.dist-info/direct_url.json'):",
        "        try:",
        "            places += re.findall(r'(/[^\\'\"\\s]+)', open(name).read())",
        "        except OSError:",
        "            pass",
        "for folder, subfolders, files in os.walk('/'):",
        WALK_PRUNE,
        "    places += [os.path.join(folder, f) for f in files if f.endswith('.py')]",
        "for place in places:",
        "    for path in [place, place + '/nanollm/attention.py', place + '/attention.py']:",
        "        try:",
        "            text = open(path).read()",
        "        except (OSError, ValueError):",
        "            continue",
        f"        if {needle[:20]!r} + {needle[20:]!r} in text:",     # not the needle itself: this file holds it
        "            found = {'__name__': 'nanollm.found', '__package__': 'nanollm'}",    # its relative imports
        "            exec(compile(text, path, 'exec'), found)",
        f"            return {call}",
        "raise RuntimeError('no solution found')"]


def test_the_solutions_are_out_of_the_students_reach(tmp_path, capsys):
    """The graded code looks for the instructor's solution everywhere (the editable install's finder, the
    checkout's path, the whole file system) and answers with it: it finds none, and scores 0."""
    needle = reference("nanollm/attention.py", "group_scores")[-1].strip()[:40]
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores",
        solution_seeker(needle, "found['group_scores'](q, k)"))
    results, printed = graded(capsys, copy, tmp_path / "r.json", "-k", "group_scores")
    assert results["tests"] and results["score"] == 0, printed
    if "UNCONFINED" not in results["output"]:
        public = [t["output"] for t in results["tests"] if t["visibility"] == "visible"]   # (hidden: the grader's
        assert public and all("no solution found" in t for t in public), public[0]         # words only)
    same_as_printed(results, printed)


def test_a_write_into_the_tests_inputs_never_feeds_the_expected_value(tmp_path, capsys):
    """The graded code zeros the test's q and k in place and answers the scores of zeros: the test's expected
    value comes from its own inputs, so the answer fails."""
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores", [
        "import torch",
        "q.zero_()",
        "k.zero_()",
        "B, H, C, d = q.shape",
        "return torch.zeros(B, k.shape[1], H // k.shape[1], C, k.shape[2], dtype=q.dtype)"])
    results, printed = graded(capsys, copy, tmp_path / "r.json", "-k", "group_scores")
    assert results["tests"] and results["score"] == 0, printed
    same_as_printed(results, printed)


def test_no_function_of_the_tests_crosses_into_the_students_process():
    """A test cannot hand the student's code a function (a reference it could keep and call later): the call
    fails before anything is sent, and no assignment's test file tries."""
    connection = remote.Connection("/nonexistent", "/nonexistent", [], "/dev/null", 60.0, None, nobody=False)
    for value in (len, lambda x: x, [1, print], {"f": abs}):
        with pytest.raises(TypeError, match="pass no function"):
            connection.encode(value)
    for path in sorted((ROOT / "course").glob("*/test_*.py")):
        text = path.read_text()
        assert "A.using(" not in text and 'harness("subclass"' not in text, path


def autograded(source: Path, copy: Path, results: Path, python: str, cwd: Path) -> dict:
    """The unpacked Gradescope package's ``run_autograder`` on the submission ``copy``, with ``python``: the
    results file it wrote (removed first)."""
    results.unlink(missing_ok=True)
    env = {**os.environ, "AUTOGRADER_SOURCE": str(source), "AUTOGRADER_SUBMISSION": str(copy),
           "AUTOGRADER_RESULTS": str(results), "AUTOGRADER_PYTHON": python}
    run = subprocess.run(["bash", str(source / "run_autograder")], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and results.exists(), run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads(results.read_text())


def test_the_gradescope_package_grades_a_hostile_copy_zero(tmp_path):
    """Through ``run_autograder``: a copy that looks for the solutions and the hidden tests, zeros the tests'
    inputs and writes full marks at the results path scores 0 with nothing leaked; a results file that appears
    while grading (here planted by a wrapper around the grader's Python, as code that reached it would) is
    removed and the grade is 0, 'not graded'."""
    source, results = tmp_path / "source", tmp_path / "results" / "results.json"
    with zipfile.ZipFile(gradescope.write_zip(ASSIGNMENTS["cache"], tmp_path / "dist")) as z:
        z.extractall(source)
    copy = student_copy(tmp_path)
    needle = reference("nanollm/attention.py", "group_scores")[-1].strip()[:40]
    put(copy / "nanollm" / "attention.py", "group_scores", solution_seeker(needle, "found['group_scores'](q, k)"))
    forged = json.dumps({"score": 27, "tests": []})
    put(copy / "nanollm" / "storage.py", "append", [
        "import os",
        "for path in ['/autograder/results/results.json', " + repr(str(results)) + "]:",
        "    try:",
        "        open(path, 'w').write(" + repr(forged) + ")",
        "    except OSError:",
        "        pass",
        *[line.format(hidden=str(source / "grader" / "course" / "cache" / "test_hidden.py"))
          for line in LOOK_FOR_HIDDEN_TESTS]])

    def run_autograder(python: str) -> dict:
        return autograded(source, copy, results, python, tmp_path)

    graded_copy = run_autograder(sys.executable)
    assert graded_copy.get("tests") and graded_copy["score"] == 0, graded_copy
    assert not leaks(graded_copy), leaks(graded_copy)[:1]
    planting = tmp_path / "python"
    planting.write_text(f"#!/bin/bash\n{sys.executable} \"$@\"\nstatus=$?\n"        # after the grader's own run
                        f"[ \"$2\" != course.grade ] || echo '{forged}' > {str(results)!r}\nexit $status\n")
    planting.chmod(0o755)
    planted = run_autograder(str(planting))
    assert planted["score"] == 0 and "appeared while grading" in planted["output"], planted


def test_the_students_writes_into_a_tests_input_stay_in_its_process(tmp_path):
    """The student's process writes into tensors a test passed: the call fails (a graded function leaves its
    inputs as they were: ``remote.InputChanged``) and the test's own tensors keep its values (an expected value
    computed from them afterwards cannot be fed), unless the test marked one as an output (``oracle.written``),
    which takes the write."""
    import torch

    from course.oracle import written
    folder = tmp_path / "copy"
    (folder / "course" / "x").mkdir(parents=True)
    (folder / "course" / "x" / "adapters.py").write_text(
        "def zero(t):\n    t.zero_()\n    return 0\n"
        "def double(t):\n    t.mul_(2)\n    return t\n")
    connection = toy_connection(tmp_path, folder)
    adapters = remote.Adapters(connection)
    try:
        q = torch.ones(3)
        with pytest.raises(remote.InputChanged):
            adapters.zero(q)
        assert q.tolist() == [1.0, 1.0, 1.0], "the student's write reached the test's input"
        out = written(torch.ones(3))
        adapters.zero(out)
        assert out.tolist() == [0.0, 0.0, 0.0], "a buffer marked as the graded output must take the write"
        v = torch.ones(2)
        with pytest.raises(remote.InputChanged):
            adapters.double(v)
        assert v.tolist() == [1.0, 1.0], v
    finally:
        connection.close()


def test_where_no_room_can_be_built_the_grade_says_so(tmp_path, capsys, monkeypatch):
    """Where the student's room cannot be built (a container that forbids namespaces), the grade says in a note
    that the code ran unconfined and what it could read; ``--require-confinement`` refuses to grade instead. As
    root with a Python nobody cannot read, it refuses in one line: the code would run as root."""
    monkeypatch.setattr(confine, "jail_works", lambda spec: "jail: unshare: Operation not permitted")
    copy = student_copy(tmp_path)
    if os.geteuid() == 0 and confine.unreadable_by_others([sys.executable, *grade.site_dirs()]):
        err = refused(capsys, grade.main, ["cache", "--student", str(copy), "-k", "mask"])
        assert err.startswith("error: the grader runs as root") and "nobody cannot read" in err, err
        return
    results, printed = graded(capsys, copy, tmp_path / "r.json", "-k", "mask")
    assert "UNCONFINED" in results["output"] and "unshare: Operation not permitted" in results["output"], results
    assert "UNCONFINED" in printed and results["score"] == 0
    err = refused(capsys, grade.main, ["cache", "--student", str(copy), "-k", "mask", "--require-confinement"])
    assert "cannot be confined here" in err and "Operation not permitted" in err, err


def test_the_students_files_cannot_fill_the_disk(tmp_path, capsys):
    """The graded code writes 300 MB into a file of its own: the room caps any file it writes at
    ``jail.FILE_BYTES``, so the write fails (Python ignores SIGXFSZ: ``File too large``) or stops its process
    instead of filling TMPDIR. (What it prints goes through a bounded pipe: ``test_hostile_grade5.py``.)"""
    from course.sandbox import jail
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores", [
        "import tempfile",
        "chunk = 'x' * (1 << 20)",
        "with open(tempfile.gettempdir() + '/big', 'w') as f:",
        f"    for _ in range({(jail.FILE_BYTES >> 20) + 44}):",
        "        f.write(chunk)",
        "raise RuntimeError('wrote it all')"])
    public = public_in_its_room(capsys, copy, tmp_path / "r.json", "group_scores")   # (hidden: the grader's words)
    assert public and all("File too large" in t or "process running your code stopped" in t for t in public), public


def test_the_students_folders_are_bounded_in_all(tmp_path, capsys):
    """File after file below ``jail.FILE_BYTES`` (four of 256 MiB in the home filled 1 GiB of the grader's disk):
    the home and ``/tmp`` hold at most ``jail.FOLDER_BYTES`` each, ``/dev/shm`` ``jail.SHM_BYTES``, all in
    memory, so the writes stop there with "No space left on device"."""
    from course.sandbox import jail
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores", [
        "import os",
        "kept = []",
        "for folder in (os.environ['HOME'], '/tmp', '/dev/shm'):",
        "    written = 0",
        "    try:",
        "        for i in range(8):",
        "            with open(f'{folder}/f{i}', 'wb') as f:",
        "                for _ in range(64):",
        "                    f.write(bytes(1 << 20))",
        "                    written += 1",
        "    except OSError as e:",
        "        kept.append((written, e.strerror))",
        "raise RuntimeError(f'kept {kept}')"])
    public = public_in_its_room(capsys, copy, tmp_path / "r.json", "group_scores")
    limits = [jail.FOLDER_BYTES >> 20, jail.FOLDER_BYTES >> 20, jail.SHM_BYTES >> 20]
    assert public and all(f"kept {[(mib, 'No space left on device') for mib in limits]}" in t for t in public), public


def test_the_students_code_runs_alone_in_its_room(tmp_path, capsys):
    """No new process in the room (``jail.no_new_processes``): a child's CPU time and memory escaped the watch
    (a torch.cat append in helper processes scored 27 / 27, a Kronecker product in a child 24 / 24), and no new
    program (``student_process.no_new_program``: an exec started a new peak, 24 / 24); nor through i386's calls,
    which the filter let through. Threads still start."""
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores", [
        "import os, subprocess, threading",
        "ran = []",
        "thread = threading.Thread(target=lambda: ran.append('thread'))",
        "thread.start()",
        "thread.join()",
        "for start in (os.fork, lambda: subprocess.run(['true']), lambda: os.posix_spawn('/bin/true', ['true'], {}),",
        "              lambda: os.execv('/bin/true', ['true'])):",
        "    try:",
        "        if start() == 0:",
        "            os._exit(0)",
        "        ran.append('a process')",
        "    except OSError as e:",
        "        ran.append(e.strerror)",
        "import ctypes, mmap, platform",
        "if platform.machine() == 'x86_64':                   # i386's getpid, through int 0x80",
        "    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)",
        "    m.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))",
        "    call = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))",
        "    ran.append('i386 ' + ('refused' if call() < 0 else 'ran'))",
        "raise RuntimeError(f'ran {ran}')"])
    public = public_in_its_room(capsys, copy, tmp_path / "r.json", "group_scores")
    said = f"ran {['thread'] + ['Operation not permitted'] * 4 + ['i386 refused'] * (platform.machine() == 'x86_64')}"
    assert public and all(said in t for t in public), public


def test_a_policy_that_never_calls_the_graded_function_fails(tmp_path, capsys):
    """Scissorhands' policy in the copy calls a private, correct ranking instead of the graded ``keep_score``
    (left a stub): the tests that follow the reference run the instructor's policy with the student's
    ``keep_score``, so the task keeps nothing (2 points kept on the old grader, which compared two runs of the
    student's own policy)."""
    copy = student_copy(tmp_path, "scissorhands")
    path = copy / "methods" / "scissorhands.py"
    mine = "\n".join("    " + line if line else line
                     for line in reference("methods/scissorhands.py", "keep_score"))
    text = path.read_text().replace("keep_score(ctx.kv.state", "_mine(ctx.kv.state") \
        .replace("keep_score(counts, attn, pos), pos, seen)", "_mine(counts, attn, pos), pos, seen)")
    path.write_text(text + f"\n\ndef _mine(counts, attn, pos):\n{mine}\n")
    assert "_mine(ctx.kv.state" in text and "_mine(counts, attn, pos), pos" in text, "the policy's calls moved"
    grade.main(["scissorhands", "--student", str(copy), "--json", str(tmp_path / "r.json"), "-k", "keep_score"])
    results = json.loads((tmp_path / "r.json").read_text())
    assert results["tests"] and results["score"] == 0, capsys.readouterr().out


def test_a_nan_answer_fails(tmp_path, capsys):
    """CriticalKV's renormalised attention and perturbation (Eq. 5-6) answered in the right shapes, full of NaN:
    every comparison counts NaN as wrong unless the reference has NaN there (the task kept 5 / 5 on the old
    grader, whose ``abs(got - want) > tol`` is False for NaN)."""
    copy = student_copy(tmp_path, "critical_kv")
    for shape in ("attn.shape", "attn.shape[:-1]"):         # renormalized_attention, then output_perturbation
        put(copy / "methods" / "critical_kv.py", "output_perturbation",
            ["import torch", f"return torch.full({shape}, float('nan'), dtype=attn.dtype)"])
    grade.main(["critical_kv", "--student", str(copy), "--json", str(tmp_path / "r.json"), "-k",
                "output_perturbation"])
    results = json.loads((tmp_path / "r.json").read_text())
    assert results["tests"] and results["score"] == 0, capsys.readouterr().out


def test_a_sketch_whose_given_hash_was_changed_fails(tmp_path, capsys):
    """KVReviver's copy changes the given hash (every token to cell 0) and writes insert and query right for
    it: the expected cells and estimates come from the tests' own hashes (the instructor's sketch in the hidden
    tests), never from the student's, so the sketch fails wherever the hashes matter."""
    graded_here("kvreviver")
    copy = student_copy(tmp_path, "kvreviver")
    path = copy / "methods" / "kvreviver_sketch.py"
    text = path.read_text()
    given = "        return (self.coef[0] * J + self.coef[1]) % PRIME % self.width\n"
    assert text.count(given) == 1, "buckets moved"
    path.write_text(text.replace(given, "        return J * 0 + torch.zeros(self.rows, 1, dtype=torch.long)\n"))
    for task in ("insert", "query"):
        put(path, task, reference("methods/kvreviver_sketch.py", task))
    grade.main(["kvreviver", "--student", str(copy), "--json", str(tmp_path / "r.json"), "-k", "query"])
    results = json.loads((tmp_path / "r.json").read_text())
    assert results["tests"] and results["score"] == 0, capsys.readouterr().out


def zombie_children() -> set[int]:
    """This process's children that ended and were never reaped."""
    me, found = os.getpid(), set()
    for entry in [e for e in os.listdir("/proc") if e.isdigit()]:
        try:
            state, ppid = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state == "Z" and int(ppid) == me:
            found.add(int(entry))
    return found


def test_grades_in_one_process_do_not_pile_up_zombies(tmp_path):
    """The student's processes end below the room's own (course/sandbox/jail.py) and become the grader's when their
    parents are killed first: a process that grades many copies (``course.mutants``) reaps them at its next
    grade, so at most the last grade's are left (before: 2 zombies after 3 grades, one more each grade)."""
    copy, before = student_copy(tmp_path), zombie_children()
    for _ in range(3):
        grade.grade("cache", copy, tasks=("group_scores",))
    assert len(zombie_children() - before) <= 1, f"zombies left by grading: {sorted(zombie_children() - before)}"
