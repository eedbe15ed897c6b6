"""
How long a command takes here, recorded with the machine's state: ``python -m nanollm.cli.timed --name
fast_tier --repeats 3 --record results/timings.json -- python -m pytest -q``.

The command runs ``--repeats`` times in a row; each run's wall time is kept with the one-minute load average
read just before it, and the entry ``--name`` of the JSON file ``--record`` gets the median, the runs, the
command, the date, the core count and the commit; other entries stay as they are (merged under a lock on the
record's folder, ``add_entry``). The README's measured times are read from this file. ``--record`` must be a
timings record (``read_record``): anything else is refused before the command runs. The command's standard
input is empty, and it runs in a process group of its own: Ctrl-C or SIGTERM stops it and whatever it
started, then ends in ``error: interrupted`` (exit status 130).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from contextlib import suppress
from datetime import date
from pathlib import Path

from .. import cli
from ..io import files
from .provenance import ROOT, git_commit

# The folders a timings record may never be in: the checkpoints shipped with the package and with the
# tensor-attention method.
BUNDLED = (cli.bundled_dir(), ROOT / "methods" / "tensor_attention" / "checkpoints")

# The fields of a timings entry and their JSON types; ``median_s`` is the one every entry has.
ENTRY_FIELDS = {"median_s": (int, float), "runs": list, "command": str, "date": str, "cores": int,
                "commit": str, "note": str}

STOP_GRACE_S = 5          # after SIGTERM, the seconds an interrupted command gets before SIGKILL


def load_average() -> float:
    """The one-minute load average (0.0 where the OS does not say)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return 0.0


# ----------------------------------------------------------------------------------------------------------
# The record

def json_kind(value) -> str:
    """What JSON calls the kind of a value read from it: object, array, string, number, true/false, null."""
    kinds = {dict: "object", list: "array", str: "string", bool: "true/false", int: "number", float: "number"}
    return kinds.get(type(value), "null")


def entry_problem(entry) -> str | None:
    """What keeps ``entry`` (a value of a record read back) from being a timings entry; None if nothing."""
    if not isinstance(entry, dict):
        return f"is a JSON {json_kind(entry)}, not an object"
    median = entry.get("median_s")
    if isinstance(median, bool) or not isinstance(median, (int, float)):
        return "has no number median_s"
    if not all(math.isfinite(v) for v in entry.values() if isinstance(v, float)):
        return "holds NaN or an infinity, which JSON has no number for"
    for field, value in entry.items():
        if field not in ENTRY_FIELDS:
            return f"has a field {field!r} that no timings entry has"
        if isinstance(value, bool) or not isinstance(value, ENTRY_FIELDS[field]):
            return f"has a {field} of the wrong kind (a JSON {json_kind(value)})"
    return None


def read_record(path: Path) -> dict:
    """The entries of the timings record ``path``: {} for a new or empty file. A file that is not a timings
    record (see the module's docstring), or not a regular file (a FIFO, a link to /dev/zero: refused before
    a byte is read), is a one-line error naming it."""
    if not path.exists():
        return {}
    text = files.read_text(path, "timings record")
    if not text.strip():
        return {}
    try:
        entries = files.parse_json(text, f"--record {path}", "timings record")
    except ValueError as e:
        cli.fail(f"{e}: not a timings record; give a new file or a timings record")
    if not isinstance(entries, dict):
        cli.fail(f"--record {path}: holds a JSON {json_kind(entries)}, not a timings record (an object of "
                 "entries)")
    for name, entry in entries.items():
        problem = entry_problem(entry)
        if problem:
            cli.fail(f"--record {path}: not a timings record: its entry {name!r} {problem}")
    return entries


def check_record_path(path: Path) -> None:
    """Before any run: ``--record`` can be written (its folder exists and is writable, its name fits) and is
    neither in the bundled checkpoints (links followed) nor anything but a regular file."""
    if not path.parent.is_dir():
        cli.fail(f"--record {path}: no folder {path.parent}")
    for folder in BUNDLED:
        if cli._overlap(path, folder) or cli._linked_into(path, folder):
            cli.fail(f"--record {path} lies in the bundled checkpoints ({folder}); give another path")
    try:
        cli.output_file(str(path))
    except argparse.ArgumentTypeError as e:
        cli.fail(f"--record {e}")


LOCK_WAIT_S = 60         # the longest add_entry waits for the record's folder


def add_entry(path: Path, name: str, entry: dict) -> None:
    """Write ``entry`` as ``name`` into the record ``path``, keeping the entries it holds now: read again
    under the lock, just before the (atomic) write, so an entry another run added meanwhile stays."""
    # another timed's merge takes milliseconds: a lock held for a minute is not one, and waiting on is no answer
    with files.locked_folder(path.parent, wait_s=LOCK_WAIT_S, what="another process (a timed adding its entry?)"):
        entries = read_record(path)
        entries[name] = entry
        try:
            files.atomic_write_text(path, json.dumps(entries, indent=1, allow_nan=False) + "\n")
        except OSError as e:                        # a full disk, a read-only mount
            cli.fail(f"--record {path}: cannot write it: {e.strerror or e}")


# ----------------------------------------------------------------------------------------------------------
# The runs

def check_command(command: list[str]) -> None:
    """Before any run: the command's program exists and may be run."""
    if shutil.which(command[0]) is None:
        cli.fail(f"{command[0]}: no such command (not found, or not an executable file)")


def stop(process: subprocess.Popen) -> None:
    """End ``process`` and what it started (its process group): SIGTERM, then SIGKILL after a grace time."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(STOP_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    finally:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def run_once(command: list[str]) -> int:
    """Run ``command`` to its end in a process group of its own; its exit status. Interrupted (Ctrl-C,
    SIGTERM), it is stopped with all it started before the interruption goes on."""
    process = None
    try:
        with cli.interrupts_deferred():   # cut inside Popen, the started command would run on, untracked
            try:
                process = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as e:                    # which() found it, yet it cannot be started
                cli.fail(f"{command[0]}: cannot run it: {e.strerror or e}")
        return process.wait()
    except BaseException:
        if process is not None:
            stop(process)
        raise


def time_runs(command: list[str], repeats: int) -> list[dict]:
    """Run ``command`` ``repeats`` times; each run's seconds and the load before it. A failing run ends it all."""
    runs = []
    for i in range(repeats):
        load = load_average()
        t0 = time.perf_counter()
        code = run_once(command)
        seconds = round(time.perf_counter() - t0, 1)
        print(f"run {i + 1}/{repeats}: {seconds} s (load {load}), exit {code}", file=sys.stderr)
        if code != 0:
            raise SystemExit(f"error: the command exited with {code}; nothing recorded")
        runs.append({"s": seconds, "load": load})
    return runs


def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(prog="python -m nanollm.cli.timed", description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--name", required=True, help="the entry of the record this measurement replaces or adds")
    p.add_argument("--repeats", type=int, default=3, help="runs of the command, one after another (default 3)")
    p.add_argument("--record", required=True, help="the timings record (JSON) to add the entry to (created if "
                                                   "absent; its other entries are kept)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command to time")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    record = Path(args.record)
    with cli.errors(args.debug):
        if not args.name.strip():
            cli.fail("--name must not be empty")
        if not command:
            cli.fail("give the command to time after --")
        if not 1 <= args.repeats <= 20:
            cli.fail(f"--repeats must be 1 to 20, not {args.repeats}")
        check_record_path(record)
        read_record(record)                         # refused now, not after the runs
        check_command(command)
        runs = time_runs(command, args.repeats)
        entry = {"median_s": statistics.median(r["s"] for r in runs), "runs": runs,
                 "command": shlex.join(command), "date": date.today().isoformat(),
                 "cores": os.cpu_count(), "commit": git_commit()}
        add_entry(record, args.name, entry)
    print(f"{args.name}: median {entry['median_s']} s of {len(runs)} run(s) -> {record}")


if __name__ == "__main__":
    main()
