"""
What every command line of the project shares: one way to report a mistake, and checks of argument values
that run before any model loads.

* ``ArgumentParser``: argparse whose errors are one line, ``error: <what is wrong>``, on stderr, with exit
  status 2 and no traceback; every command gets ``--debug`` (show the traceback instead).
* ``errors(debug)``: a ``with`` block around a command's work; a ``UsageError`` (raised by ``fail``), or a
  ``ValueError`` / ``OSError`` from the library, becomes such a line.
* argparse ``type=`` checks: ``positive_int``, ``positive_float``, ``non_negative_float``, ``device``,
  ``output_file``, ``figure_file``; ``output_folder`` for folders a command fills with several files.
* ``save_figure``: a ``--plot`` figure, written atomically (``nanollm.io.files``).

    ap = cli.ArgumentParser(prog="python -m nanollm.tool", description="...")
    ap.add_argument("--samples", type=cli.positive_int, default=10, help="...")
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        ...                                  # cli.fail("--out ...: ...") for a mistake found here
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from ..io.files import atomic_write_bytes

FIGURE_FORMATS = (".png", ".pdf", ".svg")     # what ``--plot`` writes (matplotlib picks the format by suffix)
FIGURE_HELP = "/".join(s.lstrip(".") for s in FIGURE_FORMATS)      # "png/pdf/svg", for --plot's help


class UsageError(Exception):
    """A mistake in the command line or in a file it names: reported as one ``error:`` line, exit status 2."""


def fail(message: str):
    """Stop the command: ``error: <message>`` (raised as a ``UsageError``, printed by ``errors``)."""
    raise UsageError(message)


def exit_with_error(message: str):
    """Print ``error: <message>`` as a single line on stderr and exit with status 2."""
    sys.stderr.write("error: " + " ".join(str(message).split()) + "\n")
    raise SystemExit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's error format (one ``error:`` line, exit status 2) and a ``--debug`` flag."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true",
                          help="on an error, show the full Python traceback instead of one line")

    def error(self, message: str):          # argparse calls this for unknown flags, bad values, missing ones
        exit_with_error(message)


@contextmanager
def errors(debug: bool = False):
    """Turn a UsageError, ValueError or OSError raised inside the block into ``error: ...`` (exit status 2),
    and Ctrl-C or SIGTERM into ``error: interrupted`` (exit status 130) once the block's cleanups have run.

    Anything else is a bug and keeps its traceback; ``debug=True`` keeps every traceback.
    """
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if on_main else None
    try:
        yield
    except KeyboardInterrupt:                   # Ctrl-C, or SIGTERM: the blocks' cleanups have run
        if debug:
            raise
        sys.stderr.write("error: interrupted\n")
        raise SystemExit(130) from None
    except (UsageError, ValueError, OSError) as e:
        if debug:
            raise
        exit_with_error(str(e) or type(e).__name__)
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)


def _terminated(signum, frame):
    raise KeyboardInterrupt      # so that `finally` blocks and temporary files clean up, as for Ctrl-C


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits(what: str, need_bytes: float) -> None:
    """Refuse, before any work, what would need more memory than this machine has."""
    memory = machine_memory()
    if memory is not None and need_bytes > memory:
        fail(f"{what} needs about {need_bytes / 2**30:,.1f} GiB of memory; this machine has {memory / 2**30:.1f} GiB")


# ----------------------------------------------------------------------------------------------------------
# Checks of argument values, as argparse ``type=`` functions: argparse names the flag in the message.

def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _int(text, "a positive integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def device(text: str) -> str:
    """A torch device this machine has: ``cpu``, ``cuda``, ``cuda:N`` (with a CUDA build and a GPU) or ``mps``."""
    import torch
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cpu":
        return text
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: no CUDA device here (torch {torch.__version__}); use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: there are {torch.cuda.device_count()} CUDA device(s)")
        return text
    if dev.type == "mps" and torch.backends.mps.is_available():
        return text
    raise argparse.ArgumentTypeError(f"device {text!r} is not available here; use cpu"
                                     + (" or cuda" if torch.cuda.is_available() else ""))


def _check_output_file(path: Path) -> None:
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; give a file name")
    if path.exists() and not path.is_file():
        raise argparse.ArgumentTypeError(f"{path} exists and is not a regular file")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{path}: the folder {folder} is not writable")


def output_file(text: str) -> Path:
    """A file the command will write: its folder exists and is writable, and it is not a folder."""
    path = Path(text)
    _check_output_file(path)
    return path


def figure_file(text: str) -> Path:
    """An output file whose suffix names a figure format (``FIGURE_FORMATS``)."""
    path = Path(text)
    _check_output_file(path)
    if path.suffix.lower() not in FIGURE_FORMATS:
        raise argparse.ArgumentTypeError(f"{text}: unknown figure format {path.suffix or '(no suffix)'!r}; "
                                         f"end the name with {', '.join(FIGURE_FORMATS)}")
    return path


def output_folder(path: str | Path, flag: str, may_hold=None) -> Path:
    """A folder a command will fill with files: new, empty, or (when ``may_hold(path)`` is true) one of the
    kind it writes, whose files it then replaces. Its nearest existing parent must be a writable folder."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            fail(f"{flag} {path} exists and is not a folder")
        if any(path.iterdir()) and not (may_hold is not None and may_hold(path)):
            fail(f"{flag} {path} is a folder that already holds other files; give a new or empty folder")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        fail(f"{flag} {path}: cannot create it in {parent}")
    return path


def save_figure(fig, path: str | Path, dpi: int = 120) -> None:
    """Write a matplotlib figure atomically in the format its suffix names (png without one), and close
    it: a failed write leaves the old figure."""
    import io

    import matplotlib.pyplot as plt
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=dpi, format=Path(path).suffix.lstrip(".").lower() or "png")
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
