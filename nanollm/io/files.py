"""
Files written atomically: ``atomic_open``, ``atomic_write_bytes``, ``atomic_write_text``.

Each writes to a temporary file in the same folder, flushes it to disk, then ``os.replace``-s it onto the
target. The rename is atomic, so a failure part-way (a full disk, a crash, Ctrl-C) leaves the previous file,
or none, never half of one. Every file the project writes (checkpoints, tokenizers, results, figures) goes
through here.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


def new_file_mode(path: Path) -> int:
    """The permission bits the written file gets: those of the file it replaces, else the umask's default."""
    if path.exists():
        return path.stat().st_mode & 0o7777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextmanager
def atomic_open(path: str | Path, mode: str = "wb"):
    """``with atomic_open(path) as f: f.write(...)``: ``path`` is replaced only once the block succeeds.

    The data goes to a temporary file in the same folder (same file system, so the rename is atomic), which
    is flushed to disk and renamed onto ``path``. On any error the temporary file is removed and ``path``
    is left as it was.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open writes a whole new file: mode 'wb' or 'w', not {mode!r}")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with open(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, new_file_mode(path))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:                                   # make the rename itself durable (not possible on every system)
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)
