"""Ctrl-C in a command's first second (issue 96): while the command imports torch and the project, SIGINT gave
a KeyboardInterrupt traceback (or a C++ abort inside torch's start-up); now one ``error: interrupted`` line and
exit status 130, from the package's first line (``nanollm/interrupt.py``). Once the command runs, Ctrl-C is a
KeyboardInterrupt again, so its cleanups run (``cli.errors`` puts Python's handler back)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanollm import interrupt

ROOT = Path(__file__).resolve().parents[3]
COMMANDS = [("experiments.compare", ["--quiet", "--samples", "1"]),
            ("experiments.evaluation.agree", ["results/compare_default.json", "results/compare_default.json"]),
            ("experiments.evaluation.rescore", ["results/compare_default.json"]),
            ("nanollm.cli.timed", ["--name", "x", "--", "true"])]


def wait_for_torch(proc: subprocess.Popen, limit_s: float = 60.0) -> None:
    """Until ``proc`` has mapped torch's library: it is importing torch, so its package's first line has run.
    (A fixed delay was not enough: on a loaded machine, a SIGINT 0.2 s after the start came before Python had put
    any handler in place, and the process died of it without a word, as any program would.)"""
    maps, deadline = Path(f"/proc/{proc.pid}/maps"), time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if "libtorch" in maps.read_text():
                return
        except OSError:
            pass
        time.sleep(0.002)
    pytest.fail(f"the command did not start importing torch within {limit_s:.0f} s (exit {proc.poll()})")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps (Linux)")
@pytest.mark.parametrize("module, args", COMMANDS, ids=[m for m, _ in COMMANDS])
@pytest.mark.parametrize("delay", [0.0, 0.4])
def test_ctrl_c_while_a_command_starts_is_one_line(module, args, delay):
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_torch(proc)
    time.sleep(delay)                                  # torch, then the project, are being imported
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err == "error: interrupted\n", (proc.returncode, err[-1500:])


def test_a_library_import_keeps_python_s_ctrl_c():
    """Imported by a test, a notebook or a script (not ``python -m``), nothing changes: KeyboardInterrupt."""
    assert signal.getsignal(signal.SIGINT) is not interrupt._exit_at_once
    interrupt.running()                                # and putting Python's back is harmless there
    assert signal.getsignal(signal.SIGINT) is not interrupt._exit_at_once
