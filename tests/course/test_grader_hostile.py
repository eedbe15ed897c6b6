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

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from course import confine, grade, remote
from course.assignments import ROOT
from tests.course.test_grader import put, refused, student_copy

pytestmark = pytest.mark.slow


def graded(capsys, copy: Path, out: Path, *flags: str) -> tuple[dict, str]:
    """``course.grade cache`` of ``copy`` with ``--json out``: (the JSON on disk, what was printed)."""
    grade.main(["cache", "--student", str(copy), "--json", str(out), *flags])
    return json.loads(out.read_text()), capsys.readouterr().out


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
import atexit, glob, json, os, sys
open({marker!r} + "/" + {name!r}, "w").write("ran")
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
    (copy / "forge.pth").write_text(f"import os; open({str(markers / 'pth')!r}, 'w').write('ran')\n")
    results, printed = graded(capsys, copy, tmp_path / "r.json")
    assert results["score"] == 0 and all(t["status"] == "failed" for t in results["tests"]), printed
    assert not list(markers.iterdir()), f"ran: {sorted(p.name for p in markers.iterdir())}"
    same_as_printed(results, printed)


def test_a_daemon_is_gone_before_the_grade_is_written(tmp_path, capsys):
    """The student's code starts a daemon (double fork, a session of its own) that waits for the results file
    and writes full marks into it: it is killed with the run, and the file on disk keeps what was printed."""
    copy, markers, out = student_copy(tmp_path), marker_folder(), tmp_path / "r.json"
    forged = json.dumps({"score": 27, "tests": []})
    put(copy / "nanollm" / "storage.py", "append", [
        "import os, time",
        "if os.fork() == 0:",
        "    os.setsid()",
        "    if os.fork() == 0:",
        f"        open({str(markers / 'pid')!r}, 'w').write(str(os.getpid()))",
        "        while True:",
        "            time.sleep(0.05)",
        f"            if os.path.exists({str(out)!r}):",
        f"                open({str(out)!r}, 'w').write({forged!r})",
        "    os._exit(0)",
        "raise NotImplementedError('not done')"])
    results, printed = graded(capsys, copy, out, "-k", "append")
    assert (markers / "pid").exists(), "the daemon never started: the test proves nothing"
    pid = int((markers / "pid").read_text())
    time.sleep(2)
    assert json.loads(out.read_text()) == results and results["score"] == 0, out.read_text()[:200]
    same_as_printed(results, printed)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


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


def test_a_public_message_never_quotes_the_hidden_tests(tmp_path, capsys):
    """Code that finds the hidden tests on disk (readable to it unless it runs as nobody) and raises them as the
    message of a public test, whose output the student sees: the message is withheld."""
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores", [
        "import glob",
        f"found = glob.glob('/tmp/grade-*/round-*/test_hidden.py') + [{str(ROOT / 'course/cache/test_hidden.py')!r}]",
        "raise RuntimeError(open(found[0]).read()[1200:2700])"])
    results, printed = graded(capsys, copy, tmp_path / "r.json", "-k", "group_scores")
    public = [t for t in results["tests"] if t["visibility"] == "visible"]
    assert public and all(t["output"] == "(the message quoted the grader's hidden tests: withheld)" for t in public)
    same_as_printed(results, printed)


def test_the_students_process_holds_no_capabilities_as_root(tmp_path, capsys):
    """As root with a Python the user nobody cannot read (this machine's), the student's process runs without
    capabilities: it cannot open its parent's pipes or memory through /proc."""
    if os.geteuid() != 0:
        pytest.skip("the grader runs as root only on Gradescope-like machines; here it is an ordinary user")
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores", [
        "import os",
        "caps = [s.split()[1] for s in open('/proc/self/status') if s.startswith('CapEff')][0]",
        "parent = 'closed'",
        "for name in [f'fd/{n}' for n in os.listdir(f'/proc/{os.getppid()}/fd')] + ['mem']:",
        "    try:",
        "        os.close(os.open(f'/proc/{os.getppid()}/{name}', os.O_WRONLY | os.O_NONBLOCK))",
        "        parent = 'open'",
        "    except OSError:",
        "        pass",
        "raise RuntimeError(f'uid {os.getuid()} caps {caps} parent fds {parent}')"])
    results, printed = graded(capsys, copy, tmp_path / "r.json", "-k", "group_scores")
    said = results["tests"][0]["output"]
    if "uid 65534" in said:
        assert "parent fds closed" in said, said
    else:
        assert "caps 0000000000000000 parent fds closed" in said, said


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


def test_json_is_never_written_over_a_file_that_appeared(tmp_path, capsys):
    """A file created at the ``--json`` path while grading (another run's) is left as it is; the grade ends
    in one line instead of 'wrote'."""
    copy, out = student_copy(tmp_path), tmp_path / "r.json"
    threading.Timer(1.0, lambda: out.write_text("another run's results")).start()
    with pytest.raises(SystemExit) as e:
        grade.main(["cache", "--student", str(copy), "--json", str(out), "-k", "mask"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "appeared while grading" in err and err.count("\n") == 1, err
    assert out.read_text() == "another run's results"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".r.json")], "a temporary file was left"
    assert "name" in refused(capsys, grade.main, ["cache", "--json", str(tmp_path / ("x" * 300 + ".json"))])


def leftovers(prefixes: tuple[str, ...]) -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(prefixes)}


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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_grade_leaves_nothing_behind(tmp_path, sig):
    """Ctrl-C or SIGTERM during grading: ``error: interrupted`` (exit 130), and neither scratch folders nor
    the test and student processes remain."""
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores", ["import time", "time.sleep(600)"])
    before = leftovers(("grade-",))
    proc = subprocess.Popen([sys.executable, "-m", "course.grade", "cache", "--student", str(copy), "-k",
                             "group_scores"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 45                # well inside the sleeping test's 60 s limit (PER_TEST_S)
    student = (ROOT / "course" / "student_process.py").read_text()[:200]    # its command line holds its code
    while not [p for p in processes_naming(student) if p != proc.pid] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert time.monotonic() < deadline, "the student's process did not start within 45 s"
    time.sleep(5)                                   # the student's process imports and reaches its sleep
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "error: interrupted", (proc.returncode, err[-500:])
    assert leftovers(("grade-",)) <= before, leftovers(("grade-",)) - before
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
