"""
Ctrl-C while a command starts: one ``error: interrupted`` line and exit status 130, as once it runs.

Importing torch takes a second or two, and a SIGINT then printed a KeyboardInterrupt traceback, or aborted
inside torch's C++ start-up. So a command (``python -m ...``) puts ``early`` in place before any heavy
import, from its package's ``__init__`` (this module imports nothing but the standard library), and the
command puts Python's own handler back once it runs (``running``, from ``cli.errors``), so that Ctrl-C
there raises KeyboardInterrupt and the command's cleanups run. A library import (a notebook, a test) is
left alone: only ``python -m`` sets ``sys.argv[0]`` to "-m" while the command's package is imported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _exit_at_once(signum, frame) -> None:
    sys.stderr.write("error: interrupted\n")
    sys.stderr.flush()
    os._exit(130)                         # nothing to clean up yet: the command has not started its work


def early() -> None:
    """Where a command is starting, Ctrl-C ends it at once in one line (see the module docstring)."""
    if (sys.argv[:1] == ["-m"] and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, _exit_at_once)


def running() -> None:
    """Python's own Ctrl-C again (a KeyboardInterrupt, so that cleanups run), where ``early`` put its own."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _exit_at_once:
        signal.signal(signal.SIGINT, signal.default_int_handler)


early()
