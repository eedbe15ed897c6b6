"""
What keeps a graded copy's code away from its grade (Linux; elsewhere the first three do nothing):

* ``subreaper``: a process that leaves its parent (a daemon, started in a session of its own) becomes the
  grader's child instead of init's, so ``end_descendants`` still finds it;
* ``undumpable``: another process of the same user can neither attach to the grader nor read its memory and
  pipes through ``/proc/<pid>/``;
* ``end_descendants``: every process the grading started is frozen (SIGSTOP, so none can start another), then
  killed and reaped, before the grader writes anything;
* ``scratch_copy``: the copy's files (no links, no .git, no virtual environment) in a folder of their own,
  readable by the user ``nobody``, who runs the student's code when the grader runs as root.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import stat
import sys
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


@contextmanager
def confined():
    """Within: this process is a subreaper and not dumpable; on leaving, every process started within is gone.
    Yields the processes that were there before (to spare)."""
    before = descendants(os.getpid())
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_DUMPABLE, 0)
    try:
        yield before
    finally:
        end_descendants(before)
        prctl(PR_SET_DUMPABLE, 1)
        prctl(PR_SET_CHILD_SUBREAPER, 0)


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


def descendants(root: int) -> set[int]:
    """Every process below ``root``."""
    table, found, frontier = parents(), set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in table.items() if ppid in frontier and pid not in found}
        found |= frontier
    return found


def end_descendants(spare: set[int] = frozenset(), rounds: int = 200) -> None:
    """Freeze, kill and reap every process below this one but ``spare`` (those that were there before)."""
    me, killed = os.getpid(), set()
    for _ in range(rounds):
        found = descendants(me) - set(spare)
        new = found - killed
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass
        killed |= new
        time.sleep(0.005)
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 5
    for pid in killed:                              # reap our children (orphans became ours, as a subreaper)
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break                               # not our child (its parent reaps it) or already reaped
            if done:
                break
            time.sleep(0.005)


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
