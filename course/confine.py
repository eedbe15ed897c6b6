"""
What keeps a graded copy's code away from its grade (Linux; elsewhere the first three do nothing):

* ``subreaper``: a process that leaves its parent (a daemon, started in a session of its own) becomes the
  grader's child instead of init's, so ``end`` still finds it;
* ``undumpable``: another process of the same user can neither attach to the grader nor read its memory and
  pipes through ``/proc/<pid>/``;
* ``end``: a test process and every process below it, and any process that left its parent (a daemon, now
  the grader's child), are frozen (SIGSTOP, so none can start another), then killed and reaped, before the
  grader reads the outcome or writes anything;
* ``scratch_copy``: the copy's files (no links, no .git, no virtual environment) in a folder of their own,
  readable by the user ``nobody``, who runs the student's code when the grader runs as root.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import stat
import subprocess
import sys
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
    with LOCK:
        RUNS["tests"].discard(proc.pid)
        alive = {proc.pid} if proc.poll() is None else set()    # once reaped, its pid may be another's
        for pid in alive:
            os.kill(pid, signal.SIGSTOP)             # it stays, so what it started stays below it
        me, found = os.getpid(), set()
        for _ in range(200):
            table = parents()
            strays = {pid for pid, ppid in table.items() if ppid == me} - RUNS["spare"] - RUNS["tests"]
            new = (below(table, alive) | strays | alive) - found
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
            except ChildProcessError:
                break                                # not our child: its parent reaps it
            if done:
                break
            time.sleep(0.005)


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


def readable_by_others(path: Path) -> bool:
    """Whether a user with no relation to the owner can reach ``path`` (every folder above it searchable by
    others, the file readable)."""
    path = Path(path).resolve()
    try:
        return all(p.stat().st_mode & 0o001 for p in path.parents) and bool(path.stat().st_mode & 0o004)
    except OSError:
        return False


def can_run_as_nobody(paths: list[str]) -> bool:
    """Root can run the student's code as ``nobody`` when nobody can read Python and its packages."""
    return os.geteuid() == 0 and all(readable_by_others(Path(p)) for p in paths)


def scratch_copy(student: Path, out: Path, max_bytes: int = 2 << 30) -> Path:
    """The copy's regular files under ``out`` (readable by every user), without links, caches, .git and virtual
    environments; at most ``max_bytes`` in all."""
    total = 0
    for src in sorted(student.rglob("*")) if student != out else []:
        rel = src.relative_to(student)
        if SKIP & set(rel.parts) or any(p.endswith(".egg-info") for p in rel.parts):
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
