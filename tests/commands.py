"""What the tests of the command lines share: a call that must end in time, and a command that must refuse."""

from __future__ import annotations

import threading
import time

import pytest


def within(seconds: float, fn):
    """``fn()``'s result or exception, failing the test if it takes longer than ``seconds`` (it runs in a
    daemon thread, so a hang fails here instead of hanging the suite)."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:          # noqa: BLE001  (handed back to the test)
            box["error"] = e
    t0 = time.perf_counter()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s"
    return box, time.perf_counter() - t0


def refused(capsys, main, *args, seconds: float | None = None, **kwargs) -> str:
    """The one ``error:`` line a command prints when it refuses: ``main(*args, **kwargs)`` exits with status 2,
    its stderr one line, no ``usage:``. With ``seconds``, within that time (in a thread: a hang fails the test);
    without, in the test's own thread (a command that sets signal handlers needs the main thread)."""
    if seconds is None:
        with pytest.raises(SystemExit) as e:
            main(*args, **kwargs)
        error = e.value
    else:
        box, _ = within(seconds, lambda: main(*args, **kwargs))
        error = box.get("error")
    err = capsys.readouterr().err
    assert isinstance(error, SystemExit) and error.code == 2, (error, err[-3000:])
    assert err.startswith("error: ") and err.count("\n") == 1 and "usage:" not in err, err[-3000:]
    return err
