"""
The grader and the handout against sizes, a full disk and odd names (issue 59), and the assignment sheets
against what the student copy holds.

* What the student's code prints reaches the grader through a bounded window (``remote.Output``): 300 MB of
  it leaves the dump at about 2 MiB and TMPDIR and the grader's memory where they were; a file the code
  writes stops at ``FILE_BYTES`` where it runs unconfined too.
* The wire between the test process and the student's (``student_process``): a message costs its reader
  about its size once, a header announcing more than ``MAX_MESSAGE`` is refused before anything is
  allocated, an answer over the bound fails its test in one line, and a few bytes never make a large tensor.
* ``grade --json`` on a full disk, a 300-byte ``--out``, ``--student`` or ``--json`` name, and a
  ``--per-test-s`` below what the grader enforces end in one line, before any work where they can.
* The table's "why" column wraps a hint at words, nothing cut; the notes name the README and its section.
* Each sheet states every task's public and hidden points as its tests give them, calls a task "whole" only
  where the copy keeps none of that function, and names what the lines after a stub read that the stub sets.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from course import grade, gradescope, handout
from course.assignments import ASSIGNMENTS, ROOT
from course.sandbox import jail, remote
from course.sandbox import student_process as wire
from tests.commands import refused
from tests.course.test_grader import put, student_copy, toy_connection

MB = 1 << 20


# -- what the student's code prints and writes --------------------------------------------------------------

def folder_bytes(folder: Path) -> int:
    total = 0
    for where, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(where, f)).st_blocks * 512
            except OSError:
                pass
    return total


def unconfined_here() -> bool:
    """Whether the grader may run a student's code outside its room here: not as root with a Python the user
    nobody cannot read (it would have to run as root: refused)."""
    from course.sandbox import confine
    python = [sys.executable, *grade.site_dirs()]
    return os.geteuid() != 0 or confine.unreadable_by_others(python) is None


@pytest.mark.slow
def test_300_mb_of_output_leave_the_dump_tmpdir_and_memory_bounded(tmp_path):
    """The graded code prints 150 MB to standard output and 150 MB to standard error, unconfined where it may run so
    (as root, the grader refuses unconfined code nobody can run: then in its room, whose output reaches the grader
    through the same pipe). Before, all 300 MB landed in TMPDIR (the dump file); now the dump keeps the first 64 KiB
    and the last 1 to 2 MiB, so TMPDIR grows by the scratch copy and about 2 MiB, and no process of the grader's
    holds more than a few hundred MB (torch's own); the test fails on the code's own exception. The grader's own
    peak is its ``VmHWM``, not ``ru_maxrss``: Linux keeps, across exec, the peak of the process that started it
    (this pytest process, which earlier tests in it may have taken past a GB), where ``VmHWM`` starts at the exec;
    its children's ``ru_maxrss`` carries the grader's peak at their start, which is bounded the same way."""
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores", [
        "import sys",
        "chunk = 'x' * (1 << 20)",
        "for _ in range(150):",
        "    sys.stdout.write(chunk)",
        "    sys.stderr.write(chunk)",
        "sys.stdout.flush()",
        "raise RuntimeError('wrote it all')"])
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    code = ("import json, resource, sys\nfrom pathlib import Path\n"
            "from course import grade\nfrom course.sandbox import confine\n"
            + ("confine.jail_works = lambda spec: 'jail: no room in this test'\n" if unconfined_here() else "")
            + f"s = grade.grade('cache', Path({str(copy)!r}), tasks=('group_scores',), hidden=False)\n"
            "own = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM:'))\n"
            "peak = max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
            "print(json.dumps({'results': s['results'], 'runs_as': s['runs_as'], 'log': len(s['log']), "
            "'peak_kib': peak}))\n")
    baseline = [0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            baseline[0] = max(baseline[0], folder_bytes(tmp))
            time.sleep(0.02)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "TMPDIR": str(tmp)})
    finally:
        done.set()
        watcher.join()
    assert run.returncode == 0, run.stderr[-2000:]
    said = json.loads(run.stdout.splitlines()[-1])
    assert said["runs_as"].startswith("UNCONFINED") == unconfined_here(), said["runs_as"]
    assert said["results"] and all("RuntimeError: wrote it all" in r["output"] for r in said["results"]), said
    copied = folder_bytes(copy)
    assert baseline[0] < copied + 16 * MB, f"TMPDIR reached {baseline[0] / MB:.0f} MB (the copy: {copied / MB:.0f})"
    assert said["peak_kib"] < 1 << 20, f"a process of the grader's reached {said['peak_kib'] >> 10} MB"
    assert said["log"] < grade.LOG_HEAD + grade.LOG_TAIL + 200


def test_the_dump_keeps_the_start_and_the_end_of_the_output(tmp_path):
    """``remote.Output`` drained from a pipe: 45 MB in writes of any size leave a file of at most
    ``HEAD_BYTES + 2 * TAIL_BYTES`` and a line: the first bytes as written, the count of those left out, the
    last ones as written; ``clear`` (a test starts) empties it."""
    path = tmp_path / "dump.txt"
    output = remote.Output(str(path))
    read, write = os.pipe()
    drain = threading.Thread(target=output.drain, args=(read,))
    drain.start()
    data = b"".join(b"line %09d\n" % i for i in range(3_000_000))
    sizes = [1, 70_000, 3, 1 << 20, 200_000] * 1000
    view, largest = memoryview(data), 0
    for n in sizes:
        if not view:
            break
        os.write(write, view[:n])
        view = view[n:]
        largest = max(largest, path.stat().st_size)
    os.write(write, view)
    os.close(write)
    drain.join()
    text = path.read_bytes()
    assert largest <= remote.HEAD_BYTES + 2 * remote.TAIL_BYTES + 100, largest
    assert text.startswith(data[:remote.HEAD_BYTES]) and text.endswith(data[-remote.TAIL_BYTES:]), text[-100:]
    left_out = int(re.search(rb"\[\.\.\. (\d+) bytes of output left out", text)[1])
    assert left_out + len(text) - len(output.note()) == len(data)
    output.clear()
    assert path.read_bytes() == b""


@pytest.mark.slow
def test_a_file_the_code_writes_stops_at_the_limit_where_it_runs_unconfined(tmp_path):
    """Outside the room (a container that forbids namespaces) the student's process limits its own files to
    ``FILE_BYTES`` before any of the code runs: a 300 MB file stops with ``File too large`` (before: written
    whole into the grader's TMPDIR)."""
    folder = tmp_path / "copy"
    (folder / "course" / "x").mkdir(parents=True)
    big = tmp_path / "home" / "big.bin"
    big.parent.mkdir()
    (folder / "course" / "x" / "adapters.py").write_text(
        "def fill(path):\n"
        "    chunk = b'x' * (1 << 20)\n"
        "    try:\n"
        "        with open(path, 'wb') as f:\n"
        f"            for _ in range({(jail.FILE_BYTES >> 20) + 44}):\n"
        "                f.write(chunk)\n"
        "    except OSError as e:\n"
        "        return f'{e.strerror} at {os.path.getsize(path)} bytes'\n"
        "    finally:\n"
        "        os.remove(path)\n"
        "    return 'written whole'\n"
        "import os\n")
    connection = toy_connection(tmp_path, folder, big.parent)
    try:
        said = remote.Adapters(connection).fill(str(big))
    finally:
        connection.close()
    assert said == f"File too large at {jail.FILE_BYTES} bytes", said


# -- the wire ----------------------------------------------------------------------------------------------

READER = """
import os, sys
sys.path.insert(0, {root!r})
import torch
from course.sandbox import student_process as wire


def kib(field):
    return int(next(s for s in open("/proc/self/status") if s.startswith(field)).split()[1])


fd = int(sys.argv[1])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                                    # the peak (VmHWM) starts again from here
before = kib("VmRSS:")
message = wire.receive(fd)
t = wire.unpack(message["tensor"])
assert t.shape == (12 << 20,) and float(t[-1]) == 1.0
print((kib("VmHWM:") - before) << 10)
"""


@pytest.mark.slow
def test_a_message_costs_its_reader_about_its_size_once(tmp_path):
    """A 48 MiB tensor crosses: the reader's peak memory (``VmHWM``, reset before the message) grows by about
    48 MiB (before: by about 100 MiB, the chunks and their join, then the pickle's copy of the bytes and the
    tensor's)."""
    import torch
    read, write = os.pipe()
    reader = subprocess.Popen([sys.executable, "-c", READER.format(root=str(ROOT)), str(read)], pass_fds=(read,),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(read)
    size = 48 * MB
    try:
        wire.send(write, {"tensor": wire.pack(torch.ones(size // 4))})
    finally:
        os.close(write)
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err[-2000:]
    grew = int(out.split()[-1])
    assert grew < 1.4 * size, f"reading a {size >> 20} MiB message took {grew / MB:.0f} MiB more memory"


def test_a_header_over_the_bound_is_refused_before_anything_is_read():
    """A header announcing more than ``MAX_MESSAGE`` bytes, or more parts than ``MAX_PARTS``, is refused from
    its lengths alone, in one line naming the bound (the rest of the message is never read, nor allocated);
    ``MAX_MESSAGE`` is the documented 64 MiB, 200 times the tests' largest message."""
    assert wire.MAX_MESSAGE == 64 * MB and "`MAX_MESSAGE` = 64 MiB" in (ROOT / "course" / "README.md").read_text()
    for header, said in [(struct.pack("<QQQ", 2, 100, wire.MAX_MESSAGE), "more than MAX_MESSAGE = 64 MiB"),
                         (struct.pack("<QQ", 1, 1 << 40), "more than MAX_MESSAGE = 64 MiB"),
                         (struct.pack("<Q", wire.MAX_PARTS + 1), "parts (1 to 65536)"),
                         (struct.pack("<Q", 0), "parts (1 to 65536)")]:
        read, write = os.pipe()
        os.write(write, header)                       # the write end stays open: a reader that read on would hang
        try:
            with pytest.raises(EOFError, match="more than MAX_MESSAGE = 64 MiB|parts") as e:
                wire.receive(read)
        finally:
            os.close(read)
            os.close(write)
        assert said in str(e.value) and "\n" not in str(e.value) and isinstance(e.value, wire.MessageRefused)


def test_a_few_bytes_never_make_a_large_tensor():
    """A tensor's bytes must be what its shape and type take: a message of a few bytes claiming a shape of 8 GB
    is refused (before: ``torch.empty`` of it)."""
    for shape, data in [([1 << 31], b""), ([4], b"\0" * 12), ([-1, 4], b"\0" * 16)]:
        with pytest.raises(ValueError, match="a tensor of shape"):
            wire.unpack({"dtype": "float32", "shape": shape, "bytes": data})
    assert wire.unpack({"dtype": "float32", "shape": [0, 3], "bytes": b""}).shape == (0, 3)



def refused_when_read(data: bytes, said: str) -> None:
    """``data`` written into a pipe by a thread while ``wire.receive`` reads it: refused, saying ``said``."""
    read, write = os.pipe()
    writer = threading.Thread(target=wire.write_all, args=(write, data))
    writer.start()
    try:
        with pytest.raises(wire.MessageRefused, match=said):
            wire.receive(read)
    finally:
        writer.join()
        os.close(read)
        os.close(write)


def framed(obj) -> bytes:
    """A message as the student's process could write it by hand: its header, then a pickle with no buffer."""
    body = pickle.dumps(obj, protocol=5)
    return struct.pack("<QQ", 1, len(body)) + body


def test_a_message_that_names_a_part_twice_is_refused():
    """A pickle may name one part many times at a few bytes each (its memo): one 48 MiB buffer under 40 tensors
    cost the test process 40 copies (6 GiB), lists nested as ``x = [x, x]`` 2 ** 22 walks from 157 bytes. Each
    list, dict or buffer may be reached once, at most ``MAX_DEPTH`` deep, and a tensor's bytes travel out of
    band; what the tests send (empty tensors, empty tuples among them) still reads."""
    x = [0]
    for _ in range(22):
        x = [x, x]
    shared = b"\0" * (1 << 19)                       # under PICKLE_BYTES: read, then refused for repeating
    deep = [0]
    for _ in range(wire.MAX_DEPTH + 1):
        deep = [deep]
    tensors = [{"tensor": {"dtype": "uint8", "shape": [1 << 19], "bytes": shared}, "key": k} for k in range(40)]
    for message, said in [({"ok": x}, "repeat"), ({"ok": tensors}, "repeat"), ({"ok": deep}, "nested more than")]:
        refused_when_read(framed(message), said)
    with pytest.raises(ValueError, match="out of band"):
        wire.unpack(tensors[0]["tensor"])
    import torch
    read, write = os.pipe()
    legit = {"ok": [(), (), {"a": wire.pack(torch.ones(0)), "b": wire.pack(torch.ones(0)),
                             "c": wire.pack(torch.ones(3))}]}
    writer = threading.Thread(target=wire.send, args=(write, legit))
    writer.start()
    try:
        got = wire.receive(read)
    finally:
        writer.join()
        os.close(read)
        os.close(write)
    assert wire.unpack(got["ok"][2]["c"]).tolist() == [1.0, 1.0, 1.0]


def test_a_pickle_that_allocates_more_than_it_holds_is_refused():
    """A pickle whose few bytes make the reader allocate far more (a security review's findings): a
    ``LONG_BINPUT`` of index 2 ** 27 made the C unpickler allocate a memo of 2 GiB from 7 bytes, and a megabyte
    of empty dicts costs about 145 times its size once read. Memo stores by index are refused (protocol 5
    memoises with ``MEMOIZE``), so are more than ``MAX_CONTAINERS`` containers and more than ``PICKLE_BYTES``
    of plain data; what the tests send still reads (the test above)."""
    body = pickle.dumps({"ok": 41}, protocol=5)
    memo = body[:2] + b"N" + b"r" + struct.pack("<I", 1 << 27) + b"0" + body[2:]      # None, LONG_BINPUT, POP
    dicts = b"\x80\x05(" + b"}" * (wire.MAX_CONTAINERS + 1) + b"l."                   # a list of empty dicts
    read, write = os.pipe()                           # refused from its header: the rest is never read
    os.write(write, struct.pack("<QQ", 1, wire.PICKLE_BYTES + 1))
    try:
        with pytest.raises(wire.MessageRefused, match="bytes of plain data, more than"):
            wire.receive(read)
    finally:
        os.close(read)
        os.close(write)
    for raw, said in [(memo, "uses LONG_BINPUT"), (dicts, "containers, more than")]:
        refused_when_read(struct.pack("<QQ", 1, len(raw)) + raw, said)


@pytest.mark.slow
def test_an_answer_over_the_bound_fails_its_call_in_one_line(tmp_path):
    """The student's code returns a tensor of 68 MB, more than a message may hold: the call fails saying so,
    nothing of it crosses, and the same process answers the next call. Code that writes a header announcing
    1 TiB on the answer pipe itself (bypassing that check) is refused by the test process from the header
    alone: the call fails saying so, its process is stopped, and the next call gets a fresh one."""
    folder = tmp_path / "copy"
    (folder / "course" / "x").mkdir(parents=True)
    (folder / "course" / "x" / "adapters.py").write_text(
        "import os, struct, sys, time, torch\n"
        "def big():\n    return torch.zeros(17 << 20)\n"
        "RUN = os.urandom(8).hex()\n"                  # this process's own mark (in a room, every pid is 2)
        "def small():\n    return [torch.ones(3), RUN]\n"
        "def forged():\n    os.write(int(sys.argv[5]), struct.pack('<QQ', 1, 1 << 40))\n    time.sleep(600)\n")
    connection = toy_connection(tmp_path, folder)
    adapters = remote.Adapters(connection)
    try:
        _, pid = adapters.small()
        with pytest.raises(ValueError) as e:
            adapters.big()
        assert str(e.value).startswith("your code's answer was refused (a message of "), str(e.value)
        assert "more than MAX_MESSAGE = 64 MiB" in str(e.value) and "\n" not in str(e.value)
        t, same = adapters.small()
        assert t.tolist() == [1.0, 1.0, 1.0] and same == pid, "the process that refused to send goes on"
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as e:
            adapters.forged()
        assert str(e.value).startswith(f"your code's answer was refused (a message of {1 << 40} bytes, more than "
                                       "MAX_MESSAGE = 64 MiB); the process running it was stopped"), str(e.value)
        assert time.monotonic() - t0 < 60
        t, other = adapters.small()
        assert t.tolist() == [1.0, 1.0, 1.0] and other != pid
    finally:
        connection.close()


# -- one line for each failure -----------------------------------------------------------------------------

FULL_DISK = """
import resource, signal, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))     # a disk that takes 1000 bytes a file
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from course import grade
grade.run_tests = lambda *a, **kw: ([grade.Result("test_append_then_read", "public", 2.0, 0.0, "failed",
                                                  "NotImplementedError: " + "x" * 3000, "append")], 1.0, "", "a room")
sys.exit(grade.main(["cache", "--json", sys.argv[1]]))
"""


@pytest.mark.slow
def test_grade_json_on_a_full_disk_is_one_line_and_leaves_no_file(tmp_path):
    """``grade --json`` where the disk takes no more (a file size limit: writes fail with ``File too large``):
    one ``error:`` line after the table, exit status 2, no grade and no temporary file left (before: an
    ``OSError`` traceback)."""
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "-B", "-c", FULL_DISK, str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.count("\n") == 1 and run.stderr.startswith(f"error: --json {out}: writing the grade failed"), \
        run.stderr
    assert "File too large" in run.stderr and "test_append_then_read" in run.stdout
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_a_name_longer_than_the_file_system_takes_is_one_line_before_work(tmp_path, capsys, monkeypatch):
    """A 300-byte name (the file system takes 255) in ``handout --out``, ``gradescope --out``,
    ``grade --student`` and ``grade --json`` (its folder too): one line naming the flag, before any work
    (before: ``OSError: File name too long`` tracebacks)."""
    long = tmp_path / ("n" * 300)
    monkeypatch.setattr(handout, "write_new_folder", lambda *a: pytest.fail("wrote despite a bad --out"))
    monkeypatch.setattr(grade, "run_tests", lambda *a, **kw: pytest.fail("graded despite a bad flag"))
    for main, argv, flag in [(handout.main, ["cache", "--out", str(long)], "--out"),
                             (handout.main, ["cache", "--out", str(long / "copy")], "--out"),
                             (handout.main, ["cache", "--solutions", "--out", str(long)], "--out"),
                             (gradescope.main, ["cache", "--out", str(long)], "--out"),
                             (grade.main, ["cache", "--student", str(long)], "--student"),
                             (grade.main, ["cache", "--json", str(long / "r.json")], "--json")]:
        err = refused(capsys, main, argv)
        assert err.startswith(f"error: {flag}: the name nnnn") and "has 300 bytes" in err, (argv, err)
    assert list(tmp_path.iterdir()) == []


def test_a_time_limit_below_what_the_grader_enforces_is_refused(capsys, monkeypatch):
    """``--per-test-s`` below ``MIN_PER_TEST_S`` (ten of the grader's 50 ms looks at the running test) is
    refused in one line naming the minimum, from the command line and from ``grade.grade`` (``course.mutants``);
    before, 5e-324 graded 2 / 2 where 1e-9 graded 0 / 2."""
    monkeypatch.setattr(grade, "run_tests", lambda *a, **kw: pytest.fail("graded despite a bad --per-test-s"))
    assert grade.MIN_PER_TEST_S == 0.5
    for value in ["5e-324", "1e-9", "0.049", "0.4999"]:
        err = refused(capsys, grade.main, ["cache", "--public-only", "--per-test-s", value])
        assert "is below 0.5 s, the shortest limit the grader enforces" in err, err
    with pytest.raises(SystemExit, match="is below 0.5 s"):
        grade.grade("cache", ROOT, per_test_s=1e-9)
    monkeypatch.setattr(grade, "run_tests", lambda *a, **kw: ([], 0.0, "", "a room"))
    grade.main(["cache", "--public-only", "--per-test-s", "0.5"])
    assert "score: 0 / 0" in capsys.readouterr().out


# -- what the grade says ------------------------------------------------------------------------------------

HINT = ("NotImplementedError: cache, task mask: Vaswani §3.2.1 (Eq. 1) with the mask from positions; GQA §2: G heads "
        "per KV head")


def test_the_why_column_wraps_a_hint_at_words():
    """The table's "why" column (90 characters) wraps a long hint onto the lines below it, under the column, at
    whole words: nothing of it is cut (before: "... with the mask from pos...")."""
    rows = grade.table([grade.Result("test_masked_attention_sees_only_the_past", "public", 2.0, 0.0, "failed", HINT,
                                     "mask")]).splitlines()
    first = next(i for i, row in enumerate(rows) if "FAIL" in row)
    column = rows[first].index("FAIL") + len("FAIL")
    column += len(rows[first][column:]) - len(rows[first][column:].lstrip())
    why = [rows[first][column:]] + [row[column:] for row in rows[first + 1:]]
    assert len(why) > 1 and all(len(line) <= 90 for line in why), why
    assert all(not row[:column].strip() for row in rows[first + 1:]), "continued under the column, nothing else"
    assert " ".join(why) == HINT and "…" not in " ".join(why)
    assert grade.shorten("short", 90) == "short"
    assert grade.shorten("x" * 200, 90) == "x" * 89 + "…"        # one word longer than the width: cut in it


def test_the_notes_say_which_readme_and_which_section():
    """The UNCONFINED note and the modules' docstrings (``--help``) name ``course/README.md`` and its section
    "Threat model", which exists there (before: "see the README's threat model")."""
    note = grade.notes({"hidden_tests": True, "runs_as": "UNCONFINED: as nobody (...)", "changed_adapters": []})
    assert any('see course/README.md, section "Threat model"' in line for line in note), note
    readme = (ROOT / "course" / "README.md").read_text()
    assert re.search(r"^#+ Threat model$", readme, flags=re.M)
    for module in ("grade.py", "sandbox/remote.py", "sandbox/student_process.py", "sandbox/confine.py",
                   "sandbox/jail.py"):
        text = (ROOT / "course" / module).read_text()
        assert "the README's threat model" not in " ".join(text.split()), module


# -- the sheets against the tests and the student copy ---------------------------------------------------------

def task_item(sheet: Path, task: str) -> str:
    """The numbered item of the sheet's Tasks section that gives ``task``'s points, on one line."""
    tasks = sheet.read_text().split("## Tasks")[1].split("\n## ")[0]
    items = [" ".join(i.split()) for i in re.split(r"^(?=\d+\. \*\*)", tasks, flags=re.M)]
    return next(i for i in items if f"task `{task}`," in i)


@pytest.mark.parametrize("name", list(ASSIGNMENTS))
def test_the_sheet_gives_each_tasks_public_and_hidden_points(name):
    """The sheet's table of points per task holds each task's public and hidden points as its tests'
    ``@points`` give them (before: only the totals; the cache sheet's "13 points" for a task the public grade
    shows as "0 / 2")."""
    a = ASSIGNMENTS[name]
    split: dict[str, list[float]] = {}
    for t in a.tests():
        for _, (points, task) in grade.marks_of(t).items():
            split.setdefault(task, [0.0, 0.0])[t.name == "test_hidden.py"] += points
    text = a.sheet.read_text()
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \| (\d+) \| (\d+) \|$", text, flags=re.M)
    assert {task: [float(p), float(h)] for task, p, h, _ in rows} == split, f"{a.sheet}: {rows} != {split}"
    assert all(int(p) + int(h) == int(n) for _, p, h, n in rows)
    assert f"python -m course.grade {name}` runs in your copy" in text


def enclosing(tree: ast.AST, line: int):
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and n.lineno <= line <= n.end_lineno]
    return max(found, key=lambda n: n.lineno)


def body_without_docstring(f) -> list[ast.stmt]:
    body = f.body
    first = body[0]
    return body[1:] if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else body


def set_in(nodes, lines: range) -> set[str]:
    """Names a region assigns, or fills in place (``x.append``, ``x[i] =``), on ``lines``."""
    out = set()
    for n in (n for node in nodes for n in ast.walk(node) if getattr(n, "lineno", 0) in lines):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
                and n.func.attr in ("append", "extend", "update", "add", "insert"):
            out.add(n.func.value.id)
    return out


def read_after(nodes, after: int) -> set[str]:
    """Names the lines after ``after`` read before they assign them (on one line, the right side first)."""
    seen, out = set(), set()
    names = sorted((n for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name) and n.lineno > after),
                   key=lambda n: (n.lineno, isinstance(n.ctx, ast.Store), n.col_offset))
    for n in names:
        if n.id not in seen:
            seen.add(n.id)
            if isinstance(n.ctx, ast.Load):
                out.add(n.id)
    return out


@pytest.mark.parametrize("name", list(ASSIGNMENTS))
def test_the_sheet_says_what_the_copy_keeps_around_each_stub(name):
    """For each graded region of the library: a task the sheet calls "the whole `f`" (or "`f` whole") is all
    of ``f``'s body in the copy (before: the cache's "whole `LayerKV.append`", whose copy keeps its first
    lines; AdaKV's and CriticalKV's "whole of"); and every name the lines after the stub read that the stub
    sets is named in the task's item (before: the mask's `probs` and `outs`)."""
    a = ASSIGNMENTS[name]
    wrong = []
    for r in a.regions():
        if r.path.suffix != ".py" or r.path.parent.name == "notebooks":
            continue
        f = enclosing(ast.parse(r.path.read_text()), r.begin)
        body = body_without_docstring(f)
        whole = r.begin < body[0].lineno and body[-1].end_lineno < r.end
        item = task_item(a.sheet, r.task)
        said_whole = re.search(rf"whole (?:function |of )?`(?:\w+\.)?{f.name}`|`(?:\w+\.)?{f.name}`(?: \([^)]*\))? "
                               rf"whole", item)
        if said_whole and not whole:
            wrong.append(f"{r.task}: says {said_whole[0]!r}, the copy keeps lines of {f.name} around the stub")
        needed = set_in(body, range(r.begin, r.end + 1)) & read_after(body, r.end)
        missing = sorted(n for n in needed if f"`{n}`" not in item)
        if missing:
            wrong.append(f"{r.task}: the lines after the stub in {f.name} read {missing}, which the sheet never names")
    assert not wrong, f"{a.sheet}: {wrong}"
