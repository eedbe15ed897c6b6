"""
What keeps a graded copy's code away from its grade (Linux; elsewhere the first three do nothing):

* ``subreaper``: a process that leaves its parent (a daemon, started in a session of its own) becomes the
  grader's child instead of init's, so ``end`` still finds it;
* ``undumpable``: another process of the same user can neither attach to the grader nor read its memory and
  pipes through ``/proc/<pid>/``;
* ``end``: a test process and every process below it, and any process that left its parent (a daemon, now
  the grader's child), are frozen (SIGSTOP, so none can start another), then killed and reaped, before the
  grader reads the outcome or writes anything;
* ``scratch_copy``: the copy's files (no links, no .git, no virtual environment, no tests) in a folder of
  their own, readable by the user ``nobody``, who runs the student's code when the grader runs as root.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36
NOBODY = 65534
SKIP = {".git", "__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".ruff_cache", "node_modules"}


def prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


LOCK = threading.Lock()
RUNS = {"active": 0, "spare": set(), "tests": set()}    # this process's grading runs (threads may run several)


@contextmanager
def confined():
    """Within: this process is a subreaper and not dumpable (restored when its last run ends)."""
    with LOCK:
        if RUNS["active"] == 0:
            RUNS["spare"] = children(os.getpid())     # what was there before is none of ours
            prctl(PR_SET_CHILD_SUBREAPER, 1)
            prctl(PR_SET_DUMPABLE, 0)
        RUNS["active"] += 1
    try:
        yield
    finally:
        reap_strays()
        with LOCK:
            RUNS["active"] -= 1
            if RUNS["active"] == 0:
                prctl(PR_SET_DUMPABLE, 1)
                prctl(PR_SET_CHILD_SUBREAPER, 0)


def start(cmd: list[str], **popen) -> subprocess.Popen:
    """Start a test process (registered, so that ending another run spares it)."""
    with LOCK:
        proc = subprocess.Popen(cmd, **popen)
        RUNS["tests"].add(proc.pid)
    return proc


def end(proc: subprocess.Popen) -> None:
    """End a test process and every process below it, and any process that left its parent to become ours
    (a daemon: it can only come from a graded copy); other runs' test processes are spared."""
    reap_strays()                                    # what an earlier run's processes left
    with LOCK:
        RUNS["tests"].discard(proc.pid)
        alive = {proc.pid} if proc.poll() is None else set()    # once reaped, its pid may be another's
        for pid in alive:
            os.kill(pid, signal.SIGSTOP)             # it stays, so what it started stays below it
        me, found = os.getpid(), set()
        for _ in range(200):
            table = parents()
            strays = {pid for pid, ppid in table.items() if ppid == me} - RUNS["spare"] - RUNS["tests"]
            new = (below(table, alive | strays) | strays | alive) - found   # and what is below a stray (the
            #    room's process 1 below its wrapper, whose test process ended first): else it dies unreaped
            if not new:
                break
            for pid in new:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except (ProcessLookupError, PermissionError):
                    pass
            found |= new
            time.sleep(0.002)
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait()
    deadline = time.monotonic() + 5
    for pid in found - {proc.pid}:                   # reap the strays (orphans became ours, as a subreaper)
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:                # not our child yet (its killed parent is not reaped), or
                if not os.path.exists(f"/proc/{pid}"):       # gone: its parent reaped it
                    break
                done = 0
            if done:
                break
            time.sleep(0.005)


def reap_strays() -> None:
    """Reap the processes that ended after becoming ours (as a subreaper's: a student's process whose parents
    were killed first) and that no ``Popen`` waits for: none is left a zombie by a long run of many grades
    (``course.mutants``). Other runs' test processes are spared: their ``Popen`` reaps them."""
    me = os.getpid()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) in RUNS["tests"] | RUNS["spare"]:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                state, ppid = f.read().decode(errors="replace").rsplit(")", 1)[1].split()[:2]
            if state == "Z" and int(ppid) == me:
                os.waitpid(int(entry), os.WNOHANG)
        except (OSError, ValueError, ChildProcessError):
            continue


def children(pid: int) -> set[int]:
    return {p for p, parent in parents().items() if parent == pid}


def below(table: dict[int, int], roots: set[int]) -> set[int]:
    """Every process below ``roots`` in the pid -> parent ``table``."""
    found, frontier = set(), set(roots)
    while frontier:
        frontier = {pid for pid, ppid in table.items() if ppid in frontier and pid not in found}
        found |= frontier
    return found


def parents() -> dict[int, int]:
    """pid -> parent pid of every process (from /proc; empty where there is none)."""
    out = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    text = f.read().decode(errors="replace")
                out[int(entry)] = int(text[text.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue                            # gone meanwhile
    return out


# -- the room the student's code runs in (course/sandbox/jail.py) ---------------------------------------------------

JAIL = Path(__file__).with_name("jail.py")
PROJECT = ("nanollm", "methods", "kernels", "course", "tests")     # the library and its tests, in site-packages


def is_inside(path: str, folder: str) -> bool:
    path, folder = os.path.normpath(path), os.path.normpath(folder)
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def installed_library(site_dirs: list[str], root: Path) -> list[str]:
    """What site-packages holds of this project: its packages installed as files, the editable install's
    finder, ``.pth`` and metadata (``direct_url.json`` names the instructor's checkout), and their caches."""
    found = []
    for folder in site_dirs:
        for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            path = os.path.join(folder, entry)
            ours = entry in PROJECT or entry.startswith(("__editable__", "nanokv-", "nanokv.")) \
                or entry.endswith(".egg-link")
            if not ours and entry.endswith((".pth", ".dist-info", ".egg-info")):
                try:
                    text = open(path).read(1 << 16) if os.path.isfile(path) else \
                        open(os.path.join(path, "direct_url.json")).read(1 << 16)
                    ours = str(root) in text
                except OSError:
                    pass
            if ours:
                found.append(path)
        cache = os.path.join(folder, "__pycache__")
        if os.path.isdir(cache):
            found += [os.path.join(cache, e) for e in sorted(os.listdir(cache)) if e.startswith("__editable__")]
    return found


def jail_spec(root: str, read: list[str], write: list[str], hide: list[str], user: str) -> dict:
    """What course/sandbox/jail.py builds: ``read`` and ``write`` bound into a new root (under the empty folder
    ``root``), and of ``hide`` what one of them would show (a path inside a bound folder) masked."""
    mask = [h for h in hide if any(is_inside(h, folder) for folder in [*read, *write, *JAIL_SYSTEM])]
    return {"root": root, "read": read, "write": write, "mask": mask, "user": user}


JAIL_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")   # as jail.SYSTEM


def jailed(cmd: list[str]) -> list[str]:
    """``cmd`` run inside a room: the room's spec goes to this command's standard input (``spec_bytes``)."""
    return [sys.executable, "-I", "-S", "-B", "-c", JAIL.read_text(), "--", *cmd]


def spec_bytes(spec: dict) -> bytes:
    """What course/sandbox/jail.py reads on its standard input (never an argument: ``/proc/1/cmdline`` is readable)."""
    return json.dumps(spec).encode()


def jail_works(spec: dict) -> str | None:
    """None if a room like ``spec`` can be built here and Python runs in it, reading its packages (as
    ``spec["user"]``); else why not, in one line."""
    if not sys.platform.startswith("linux"):
        return f"no private file system on {sys.platform}"
    check = "import os, sys; [os.listdir(p) for p in sys.argv[1:]]"
    probe = {**spec, "root": tempfile.mkdtemp(prefix="jail-probe-", dir=os.path.dirname(spec["root"]))}
    cmd = jailed([sys.executable, "-I", "-S", "-B", "-c", check, *spec["read"]])
    try:                          # registered as a run's process: another run's ``end`` must not take it for a stray
        proc = start(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     cwd=spec["write"][0] if spec["write"] else "/", env={"PATH": "/usr/bin:/bin"})
    except OSError as e:
        return f"jail: {e}"
    try:
        _, err = proc.communicate(spec_bytes(probe), timeout=60)
    except subprocess.TimeoutExpired as e:
        proc.kill()
        proc.communicate()
        return f"jail: {e}"
    finally:
        with LOCK:
            RUNS["tests"].discard(proc.pid)
    if proc.returncode == 0:
        return None
    lines = [s for s in err.decode(errors="replace").splitlines() if s.strip()]
    return lines[-1] if lines else f"the probe exited with code {proc.returncode}"


def room(parent: Path, copy: Path, home: Path, site_dirs: list[str], root: Path) -> tuple[dict | None, str]:
    """The room for a student's process (course/sandbox/jail.py): (its spec, how the code runs there), or (None, why it
    cannot be built here). ``copy`` is bound read-only, ``home`` writable, Python and ``site_dirs`` read-only;
    the instructor's checkout ``root`` and the library installed in site-packages are hidden. As root the code
    runs as nobody, which must be able to read Python's files in the room; never as root."""
    python = [sys.base_prefix, sys.prefix, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"],
              os.path.dirname(os.path.realpath(sys.executable))]
    read = list(dict.fromkeys([*python, *site_dirs, str(copy)]))
    hide = list(dict.fromkeys([str(root), str(root.resolve()), *installed_library(site_dirs, root)]))
    user, who = ("nobody", "nobody") if os.geteuid() == 0 else ("keep", "the grader's user")
    if user == "nobody":
        os.chown(home, NOBODY, NOBODY)
    folder = Path(tempfile.mkdtemp(prefix="room-", dir=parent))
    spec = jail_spec(str(folder), read, [str(home)], hide, user)
    why = jail_works(spec)
    if why is None:
        return spec, f"{who}, in a private file system (the copy and Python only)"
    if user == "nobody":
        os.chown(home, 0, 0)
    return None, why


def readable_unconfined(root: Path, nobody: bool) -> list[str]:
    """What of the grader's a student's code outside the room can read: the instructor's checkout (the
    solutions, the hidden tests) unless it runs as nobody and the checkout is closed to others."""
    secret = root / "course" / "oracle.py"
    return [str(root)] if not nobody or readable_by_others(secret) else []


def unconfined(root: Path, nobody: bool, why: str) -> str:
    """How the student's code runs where no room can be built (``why``), and what it can read, in a line (never
    as root: ``as_root_refusal``)."""
    who = "as nobody" if nobody else "as the grader's user"
    seen = readable_unconfined(root, nobody)
    return (f"{who} (no private file system: {why}): it could read " +
            (f"{', '.join(seen)} (the solutions and the hidden tests)" if seen else "what every user may") +
            ("" if nobody else ", and write what that user may"))


def readable_by_others(path: Path) -> bool:
    """Whether a user with no relation to the owner can reach ``path`` (every folder above it searchable by
    others, the file readable)."""
    path = Path(path).resolve()
    try:
        return all(p.stat().st_mode & 0o001 for p in path.parents) and bool(path.stat().st_mode & 0o004)
    except OSError:
        return False


def unreadable_by_others(paths: list[str]) -> str | None:
    """The first of ``paths``, or of the folders above one, that a user with no relation to its owner cannot
    read or search (with its mode), else None. Inside a folder it looks one level deep (a site-packages of
    mode 755 whose packages are 700 is found by its first package)."""
    for p in paths:
        path = Path(p).resolve()
        inside = sorted(path.iterdir())[:50] if path.is_dir() and os.access(path, os.R_OK) else []
        for q in [*reversed(path.parents), path, *inside]:
            try:
                mode = q.stat().st_mode
            except OSError:
                continue
            if not mode & (0o005 if stat.S_ISDIR(mode) else 0o004):
                return f"{q} (mode {stat.S_IMODE(mode):o})"
    return None


def as_root_refusal(python_paths: list[str], why: str) -> str:
    """Why a grader running as root refuses to grade (the student's code would have to run as root), and what to
    change, in a line (``why``: why no room was built)."""
    blocked = unreadable_by_others(python_paths)
    return (f"the grader runs as root and the student's code never does: no room was built ({why}), and outside "
            f"one the user nobody cannot read Python and its packages{f': {blocked}' if blocked else ''}; make them "
            "readable to other users "
            "(chmod o+rx on each folder above them, chmod -R o+rX on Python's prefix and site-packages; a "
            "virtual environment made under umask 022), or grade as an ordinary user")


def can_run_as_nobody(paths: list[str]) -> bool:
    """Root can run the student's code as ``nobody`` when nobody can read Python and its packages."""
    return os.geteuid() == 0 and all(readable_by_others(Path(p)) for p in paths)


def not_for_the_graded_code(rel: Path) -> bool:
    """The copy's tests and the course's oracle and tests (``rel``: a path in the copy): they hold reference
    implementations, so the graded code is not given them at all (the import guard in course/sandbox/student_process.py
    stops an honest import only: the student's code can take it off)."""
    return (rel.parts[0] == "tests" or rel.name == "conftest.py" or rel == Path("course", "oracle.py")
            or (rel.parts[0] == "course" and rel.name.startswith("test_") and rel.suffix == ".py"))


def scratch_copy(student: Path, out: Path, max_bytes: int = 2 << 30) -> Path:
    """The copy's regular files under ``out`` (readable by every user), without links, caches, .git, virtual
    environments, and the tests and oracle (``not_for_the_graded_code``); at most ``max_bytes`` in all."""
    total = 0
    for src in sorted(student.rglob("*")) if student != out else []:
        rel = src.relative_to(student)
        if SKIP & set(rel.parts) or any(p.endswith(".egg-info") for p in rel.parts) or not_for_the_graded_code(rel):
            continue
        if any((student / Path(*rel.parts[:i]) / "pyvenv.cfg").exists() for i in range(1, len(rel.parts))):
            continue                                # inside a virtual environment
        try:
            mode = src.lstat().st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode):
            (out / rel).mkdir(parents=True, exist_ok=True)
        elif stat.S_ISREG(mode):
            total += src.lstat().st_size
            if total > max_bytes:
                raise SystemExit(f"error: {student} holds more than {max_bytes >> 20} MB of files")
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, out / rel)
    for path in [out, *out.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return out
