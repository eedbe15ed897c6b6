"""
What every command line of the project shares: one way to report a mistake, and checks of argument values
that run before any model loads.

``ArgumentParser`` (argparse whose errors are one ``error: ...`` line, exit status 2, plus ``--debug``),
``errors(debug)`` (the same line for a ``UsageError``, ``ValueError`` or ``OSError``), ``type=`` checks
(``positive_int``, ``device``, ``output_file`` ...), ``check_outputs`` (no output over an input or into the
bundled checkpoints), ``workers_without_ctrl_c`` and ``save_figure``.

    ap = cli.ArgumentParser(prog="python -m nanollm.tool", description="...")
    ap.add_argument("--samples", type=cli.positive_int, default=10, help="...")
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        ...                                  # cli.fail("--out ...: ...") for a mistake found here

Details (each check): nanollm/inside.md, section "cli/__init__.py: what the commands share".
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import select
import signal
import sys
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path

from .. import interrupt
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
    interrupt.running()                         # Ctrl-C from here on: a KeyboardInterrupt, as below
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
        if isinstance(e, BrokenPipeError) and _reader_gone():
            raise SystemExit(141) from None     # `... | head` took what it wanted: stop quietly, as a shell tool
        exit_with_error(str(e) or type(e).__name__)
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)


def _reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (then it is pointed at /dev/null, so that
    Python's own flush at exit does not fail again); False for a broken pipe elsewhere, which stays an error."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, ValueError, OSError):          # no poll (Windows), or no real stdout
        return False
    if gone:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return gone


def _terminated(signum, frame):
    raise KeyboardInterrupt      # so that `finally` blocks and temporary files clean up, as for Ctrl-C


def imported(module: str, name: str):
    """``name`` of ``module`` (a ``MODULE:NAME`` of one's own: a policy class, a metric), the module found in
    the folder the command runs in (put on the path first) or on the Python path. Raises what importing raises."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return getattr(importlib.import_module(module), name)


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


def threads_or_workers(text: str) -> int:
    """``--threads`` / ``--workers``: a positive integer, at most this machine's CPU cores (``os.cpu_count()``).
    Each thread or process beyond them only waits for a core, and a huge count dies allocating thread stacks."""
    value = positive_int(text)
    cores = os.cpu_count() or 1
    if value > cores:
        raise argparse.ArgumentTypeError(f"must be at most {cores}, the CPU cores of this machine, got {value}")
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


# What ``nanollm.io.files.atomic_open`` adds to a file's name for its temporary file: ".{name}." + 8 random
# characters + ".tmp". A name that fits the file system but not with these would fail at the end of the run.
TEMPORARY_NAME_EXTRA = 14


def _name_max(folder: Path) -> int:
    """The longest file name, in bytes, that the file system of ``folder`` (an existing folder) takes."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (AttributeError, ValueError, OSError):          # no pathconf (Windows): the usual limit
        return 255


def _short(path: Path) -> str:
    """A path for an error line: the first 80 characters of a longer one."""
    return str(path) if len(str(path)) <= 80 else str(path)[:80] + "..."


def _check_output_file(path: Path) -> None:
    """The checks of ``output_file``; an OSError from looking the path up (a name longer than the file
    system takes: ENAMETOOLONG) is one of them, not a traceback."""
    try:
        folder = path.parent
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{path} is a folder; give a file name")
        if path.exists() and not path.is_file():
            raise argparse.ArgumentTypeError(f"{path} exists and is not a regular file")
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(f"{path}: the folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            raise argparse.ArgumentTypeError(f"{path}: the folder {folder} is not writable")
        limit = _name_max(folder) - TEMPORARY_NAME_EXTRA
        if len(os.fsencode(path.name)) > limit:
            raise argparse.ArgumentTypeError(f"{_short(path)}: file name too long, at most {limit} bytes here "
                                             "(the file system's limit, less what the temporary file adds)")
        if _overlap(path, bundled_dir()):
            raise argparse.ArgumentTypeError(f"{path} lies in the bundled checkpoints ({bundled_dir()}); "
                                             "give another path")
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{_short(path)}: {e.strerror or e}") from None


def output_file(text: str) -> Path:
    """A file the command will write: its folder exists and is writable, it is not a folder, its name fits
    the file system (with room for the atomic write's temporary name), and it is not in the bundled
    checkpoints. Whether it is one of the command's inputs is ``check_outputs``'s to say."""
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
    kind it writes, whose files it then replaces. Its nearest existing parent must be a writable folder,
    and its name must fit the file system."""
    path = Path(path)
    try:
        if path.exists():
            if not path.is_dir():
                fail(f"{flag} {path} exists and is not a folder")
            if any(path.iterdir()) and not (may_hold is not None and may_hold(path)):
                fail(f"{flag} {path} is a folder that already holds other files; give a new or empty folder")
        parent = path.parent
        while not parent.exists():
            parent = parent.parent
    except OSError as e:                          # a name longer than the file system takes, ...
        fail(f"{flag} {_short(path)}: {e.strerror or e}")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        fail(f"{flag} {path}: cannot create it in {parent}")
    return path


# ----------------------------------------------------------------------------------------------------------
# No output may be an input: ``--json CK/model.safetensors`` would replace the weights by the results.

def bundled_dir() -> Path:
    """``nanollm/checkpoints/``, the checkpoints shipped with the package."""
    from ..io.checkpoint import BUNDLED_DIR
    return BUNDLED_DIR


def input_paths(names) -> list[Path]:
    """The files and folders behind a command's checkpoint arguments, found without reading them: a path as
    given, a bundled checkpoint's folder, a fetchable model's file (fetched or not). Names that are none of
    these (and None, a flag not given) are skipped: the command refuses them itself."""
    from ..io import fetch
    paths = []
    for name in names:
        if name is None:
            continue
        if Path(name).exists():
            paths.append(Path(name))
        elif (bundled_dir() / str(name)).is_dir():
            paths.append(bundled_dir() / str(name))
        elif str(name) in fetch.REMOTES:
            paths.append(fetch.target(str(name)))
    return paths


def _overlap(a: str | Path, b: str | Path) -> bool:
    """``a`` and ``b`` are the same file or folder, or one lies inside the other, symbolic links followed
    (``os.path.realpath``); or they are one file under two names (a hard link: ``os.path.samefile``)."""
    ra, rb = os.path.realpath(a), os.path.realpath(b)
    if ra == rb or ra.startswith(rb.rstrip(os.sep) + os.sep) or rb.startswith(ra.rstrip(os.sep) + os.sep):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:                                 # one of them does not exist (yet)
        return False


def _linked_into(path: str | Path, folder: Path) -> bool:
    """``path``, an existing file outside ``folder``, is also one of the files in it (a hard link)."""
    if not (os.path.isfile(path) and folder.is_dir()):
        return False
    st = os.stat(path)
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                other = os.stat(os.path.join(root, name))
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                return True
    return False


def not_an_input(path: str | Path, inputs, flag: str) -> None:
    """Refuse, before any work, an output ``path`` that is one of the command's ``inputs`` (checkpoint names
    or paths: ``input_paths``), lies inside one (a checkpoint folder), or holds one (an output folder), or
    that lies in the bundled checkpoints. Links are followed although the atomic writes would replace a link
    rather than the file it leads to: an output named after an input is a mistake however it is spelled."""
    for source in input_paths(inputs):
        if _overlap(path, source) or _linked_into(path, source):
            fail(f"{flag} {path}: writing there would overwrite {source}, which this command reads; "
                 "give another path")
    if _overlap(path, bundled_dir()):
        fail(f"{flag} {path} lies in the bundled checkpoints ({bundled_dir()}); give another path")


def check_outputs(outputs: dict[str, Path | None], inputs=()) -> None:
    """Before any work: the output files of a command (``{"--json": args.json, "--plot": args.plot}``, None
    for a flag not given) are not its ``inputs`` (``not_an_input``) and no two name the same file."""
    given = [(flag, path) for flag, path in outputs.items() if path is not None]
    for i, (flag, path) in enumerate(given):
        not_an_input(path, inputs, flag)
        for other, other_path in given[:i]:
            if _overlap(path, other_path):
                fail(f"{other} and {flag} name the same file")


@contextmanager
def interrupts_deferred():
    """Inside this block a Ctrl-C or SIGTERM is noted, not raised; once the block is over it raises
    ``KeyboardInterrupt``. For work that must not be cut half-way, such as starting a process whose handle the
    caller needs in order to stop it. Off the main thread (where no handler can be set) it defers nothing."""
    noted = []
    on_main = threading.current_thread() is threading.main_thread()      # where signal handlers can be set
    with _signals_held():                      # a signal between the two swaps would leave one handler swapped
        previous = {s: signal.signal(s, lambda signum, frame: noted.append(signum))
                    for s in (signal.SIGINT, signal.SIGTERM)} if on_main else {}
    try:
        yield
    finally:
        with _signals_held():
            for s, handler in previous.items():
                signal.signal(s, handler)
    if noted:
        raise KeyboardInterrupt


@contextmanager
def _signals_held():
    """Ctrl-C and SIGTERM held back (delivered when the block ends) where the platform can hold them."""
    held = {signal.SIGINT, signal.SIGTERM}
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextmanager
def workers_without_ctrl_c():
    """Start worker processes inside this block: they leave Ctrl-C to the command.

    Ctrl-C in a terminal interrupts the whole process group, so each worker would print its own
    ``KeyboardInterrupt`` traceback. Inside the block SIGINT is blocked, and processes inherit the blocked
    signal (it stays blocked in them). This process notes a Ctrl-C or SIGTERM that comes meanwhile (another
    of its threads may take it) and raises ``KeyboardInterrupt`` once the block is over, not half-way
    through starting the workers (``interrupts_deferred``): then the command stops them (``Pool.terminate``:
    SIGTERM, which they do not block) and ``errors`` prints ``error: interrupted``.

    multiprocessing's resource tracker unblocks SIGINT once it has started its own process, which it does
    when the first pool starts: it is started before the block, or the workers would get Ctrl-C again.
    """
    if not hasattr(signal, "pthread_sigmask"):           # Windows: no process group to share Ctrl-C with
        yield
        return
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    with interrupts_deferred():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextmanager
def worker_pool(context, workers: int, initializer, initargs: tuple):
    """A pool of ``workers`` processes of ``context``, started inside ``workers_without_ctrl_c``. When the block
    ends well the pool is closed and joined: the workers leave on the pool's own last message and get no
    SIGTERM (one that reached another thread of a worker, not the one waiting for the pool's lock, hung the
    command). On an error or Ctrl-C, ``Pool.terminate`` stops them."""
    with ExitStack() as stack:
        with workers_without_ctrl_c():             # a Ctrl-C meanwhile is raised at its end, the pool in the stack
            pool = stack.enter_context(context.Pool(workers, initializer=initializer, initargs=initargs))
        yield pool
        pool.close()
        pool.join()


def worker_leaves_on_sigterm() -> None:
    """In a pool's worker process (its initializer calls this): SIGTERM ends it by ``SystemExit``, which
    unwinds the worker's stack, instead of by the default action, which ends it on the spot.

    An idle worker waits for its next job holding the pool's queue lock. Ended on the spot (a SIGTERM to the
    whole process group, as ``kill -- -PGID`` or a job scheduler sends) it never releases that lock, and
    ``Pool.terminate`` in the command waits for the lock for ever: the command hangs instead of printing
    ``error: interrupted``. Unwinding releases it (the lock is held in a ``with`` block). A SIGTERM that comes
    once the worker has left its loop, and a second one, are ignored: the worker is leaving already, and an
    exception raised in its exit handlers would only print their traceback. (A run that ends well closes its
    pool, ``worker_pool``: its workers get no SIGTERM.)"""
    def leave(signum, frame):
        signal.signal(signum, signal.SIG_IGN)
        while frame is not None:                    # only inside the pool's worker loop: past it, the worker is
            code = frame.f_code                     # leaving already, and an exception in its exit handlers
            if code.co_name == "worker" and code.co_filename.endswith(os.path.join("multiprocessing", "pool.py")):
                raise SystemExit(128 + signum)      # would only print their traceback
            frame = frame.f_back
    signal.signal(signal.SIGTERM, leave)


def save_figure(fig, path: str | Path, dpi: int = 120) -> None:
    """Write a matplotlib figure atomically in the format its suffix names (png without one), and close
    it: a failed write leaves the old figure."""
    import io

    import matplotlib.pyplot as plt
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=dpi, format=Path(path).suffix.lstrip(".").lower() or "png")
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
