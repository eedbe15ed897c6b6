"""
How long a command takes here, recorded with the machine's state: ``python -m nanollm.cli.timed --name
fast_tier --repeats 3 --record results/timings.json -- python -m pytest -q``.

The command runs ``--repeats`` times in a row; each run's wall time is kept with the one-minute load average
read just before it, and the entry ``--name`` of the JSON file ``--record`` gets the median, the runs, the
command, the date, the core count and the commit. Other entries of the file stay as they are. The README's
measured times (install, test tiers, the main job) are read from this file, so a time on a page is a median
of runs someone made, on a machine whose load is written beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from ..io.files import atomic_write_text
from .provenance import git_commit


def load_average() -> float:
    """The one-minute load average (0.0 where the OS does not say)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return 0.0


def time_runs(command: list[str], repeats: int) -> list[dict]:
    """Run ``command`` ``repeats`` times; each run's seconds and the load before it. A failing run ends it all."""
    runs = []
    for i in range(repeats):
        load = load_average()
        t0 = time.perf_counter()
        code = subprocess.run(command).returncode
        seconds = round(time.perf_counter() - t0, 1)
        print(f"run {i + 1}/{repeats}: {seconds} s (load {load}), exit {code}", file=sys.stderr)
        if code != 0:
            raise SystemExit(f"error: the command exited with {code}; nothing recorded")
        runs.append({"s": seconds, "load": load})
    return runs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m nanollm.cli.timed", description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--name", required=True, help="the entry of the record this measurement replaces or adds")
    p.add_argument("--repeats", type=int, default=3, help="runs of the command, one after another (default 3)")
    p.add_argument("--record", required=True, help="the JSON file to add the entry to (created if absent; its "
                                                   "other entries are kept)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command to time")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    record = Path(args.record)
    if not command:
        p.error("give the command to time after --")
    if not 1 <= args.repeats <= 20:
        p.error(f"--repeats must be 1 to 20, not {args.repeats}")
    if not record.parent.is_dir():
        p.error(f"--record: no folder {record.parent}")
    if record.exists() and not record.is_file():
        p.error(f"--record: {record} is not a file")
    try:
        entries = json.loads(record.read_text()) if record.exists() else {}
    except (ValueError, UnicodeDecodeError):
        p.error(f"--record: {record} is not JSON")
    if not isinstance(entries, dict):
        p.error(f"--record: {record} is not a JSON object of entries")
    runs = time_runs(command, args.repeats)
    entries[args.name] = {"median_s": statistics.median(r["s"] for r in runs), "runs": runs,
                          "command": shlex.join(command), "date": date.today().isoformat(),
                          "cores": os.cpu_count(), "commit": git_commit()}
    atomic_write_text(record, json.dumps(entries, indent=1) + "\n")
    print(f"{args.name}: median {entries[args.name]['median_s']} s of {len(runs)} run(s) -> {record}")


if __name__ == "__main__":
    main()
