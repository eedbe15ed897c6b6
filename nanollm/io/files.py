"""
Files written atomically: ``atomic_open``, ``atomic_write_bytes``, ``atomic_write_text``; files read safely:
``open_data_file``, ``read_text``, ``read_json``.

Each writes to a temporary file in the same folder, flushes it to disk, then ``os.replace``-s it onto the
target. The rename is atomic, so a failure part-way (a full disk, a crash, Ctrl-C) leaves the previous file,
or none, never half of one. Every file the project writes (checkpoints, tokenizers, results, figures) goes
through here.

Every data file a loader reads (configs, cards, tokenizers, weights, training states) is opened through
``open_data_file``: it must be a regular file once its links are followed, and at most a size that suits its
kind. A FIFO named ``model.safetensors`` would block the read forever, and a ``tokenizer.json`` linked to
``/dev/zero`` would be read until memory runs out; both are refused, in one line that names the file, before a
byte is read. ``read_json`` also turns JSON nested too deeply for Python's parser into such a line.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:           # Windows: no lock (one writer at a time by hand)
    fcntl = None


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


# ----------------------------------------------------------------------------------------------------------
# Reading

MB = 1 << 20
MAX_JSON_MB = 64       # a JSON file read whole (config, card, tokenizer, index): the largest real ones, tokenizer
                       # files of 250k-token vocabularies, are about 35 MB


def open_data_file(path: str | Path, kind: str, max_mb: float | None = None):
    """``path`` opened for binary reading, after checking that it is a regular file (links followed) of at most
    ``max_mb`` MB (no limit if None); ``kind`` ("tokenizer file") is what the error calls it.

    It is opened without blocking and checked through the open descriptor, so a FIFO cannot stall the open and
    the file checked is the file read.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file (a {kind} must be one)")
        if max_mb is not None and info.st_size > max_mb * MB:
            raise ValueError(f"{path}: is {info.st_size / MB:,.1f} MB, more than the {max_mb:g} MB a {kind} may be")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_text(path: str | Path, kind: str, max_mb: float | None = MAX_JSON_MB) -> str:
    """A UTF-8 text file's content (``open_data_file``'s checks first); a ValueError naming the file if not UTF-8."""
    with open_data_file(path, kind, max_mb) as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


MAX_DIGITS = 19          # an integer in this project's files fits in 64 bits: a longer one is not data of ours


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits")
    return int(text)


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:20]} is beyond a float")
    return value


def parse_json(text: str, where: str, kind: str = "file"):
    """JSON text's value, or a one-line ValueError starting with ``where``: malformed, nested deeper than
    Python's parser goes, an integer longer than ``MAX_DIGITS`` digits or a number beyond a float (each a
    traceback, later, from the code that reads it). Every reader of the project's JSON data goes through it.
    NaN, which Python writes for a missing metric, reads as NaN."""
    try:
        return json.loads(text, parse_int=_integer, parse_float=_finite)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply to be a {kind}") from None
    except ValueError as e:                        # _integer, _finite, or Python's own limit on digits
        raise ValueError(f"{where}: {e}") from None


def read_json(path: str | Path, kind: str, max_mb: float | None = MAX_JSON_MB):
    """A JSON file's value, or a one-line ValueError naming the file: not a regular file, too large, not UTF-8,
    empty, or what ``parse_json`` refuses."""
    text = read_text(path, kind, max_mb)
    if not text.strip():
        raise ValueError(f"{path}: the file is empty, expected JSON")
    return parse_json(text, str(path), kind)


# ----------------------------------------------------------------------------------------------------------
# Undoing a failed command's new files

@contextmanager
def removed_on_failure(folder: str | Path, names, keep=None):
    """``with removed_on_failure(folder, ["a.json", "b.bin"]):`` around writing those files into ``folder``.

    If the block fails (an error, a full disk, Ctrl-C), what it created is removed: the files of ``names``
    that were not there before, then ``folder`` and the parents that did not exist before, if they are empty.
    What the user had stays: a folder that existed, a file of ``names`` that existed (replaced whole or not at
    all, by ``atomic_open``), any other file. ``keep()``, if given, is asked after the failure: true keeps
    everything (a training run whose saved state can be resumed).
    """
    folder = Path(folder)
    made, parent = [], folder
    while not os.path.lexists(parent) and parent != parent.parent:      # deepest first
        made.append(parent)
        parent = parent.parent
    new = [folder / name for name in names if not os.path.lexists(folder / name)]
    try:
        yield
    except BaseException:
        if keep is None or not keep():
            for path in new:
                try:
                    path.unlink()
                except OSError:                       # never created
                    pass
            for path in made:
                try:
                    path.rmdir()
                except OSError:                       # never created, or it holds other files
                    pass
        raise


@contextmanager
def locked_folder(folder: str | Path, wait_s: float | None = None, what: str = "another process"):
    """Hold an exclusive lock on ``folder`` (``flock`` on the folder itself, so no lock file is left behind):
    another process taking the same lock waits for it. Used by a fetch and by ``timed``'s merge of a record.
    With ``wait_s``, a lock still held after that many seconds is a ``TimeoutError`` naming the folder and
    ``what`` holds it (a line saying so is printed once a wait passes a second)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        if fcntl is not None:
            start, said = time.monotonic(), False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if wait_s is not None else 0))
                    break
                except BlockingIOError:
                    waited = time.monotonic() - start
                    if waited > wait_s:
                        raise TimeoutError(f"{folder}: still locked by {what} after {wait_s:g} s") from None
                    if waited > 1 and not said:
                        print(f"waiting for {folder}, locked by {what} (at most {wait_s:g} s)", file=sys.stderr)
                        said = True
                    time.sleep(0.1)
        yield
    finally:
        os.close(fd)                                  # closing releases the lock
