"""``python -m nanollm.cli.timed``: the median of the runs, the load beside each, other entries kept."""

from __future__ import annotations

import json
import sys

import pytest

from nanollm.cli.timed import main


@pytest.mark.slow
def test_records_the_median_and_keeps_other_entries(tmp_path, capsys):
    record = tmp_path / "timings.json"
    record.write_text(json.dumps({"install": {"median_s": 60.0}}))
    main(["--name", "noop", "--repeats", "3", "--record", str(record), "--", sys.executable, "-c", "pass"])
    entries = json.loads(record.read_text())
    assert entries["install"] == {"median_s": 60.0}
    noop = entries["noop"]
    assert len(noop["runs"]) == 3 and all(run["s"] >= 0 and run["load"] >= 0 for run in noop["runs"])
    assert noop["median_s"] == sorted(run["s"] for run in noop["runs"])[1]
    assert noop["command"].endswith("-c pass") and noop["cores"] >= 1 and noop["date"]


@pytest.mark.parametrize("args, message", [
    (["--repeats", "0"], "--repeats must be 1 to 20"),
    (["--record", "/no/such/folder/t.json"], "no folder"),
    ([], "give the command"),
])
def test_bad_arguments_end_in_one_line_before_any_run(tmp_path, capsys, args, message):
    base = {"--name": "x", "--record": str(tmp_path / "t.json")}
    argv = [w for k, v in base.items() if k not in args for w in (k, v)] + args
    command = [] if not args else ["--", sys.executable, "-c", "pass"]
    with pytest.raises(SystemExit):
        main(argv + command)
    assert message in capsys.readouterr().err and not (tmp_path / "t.json").exists()


@pytest.mark.slow
def test_a_failing_command_records_nothing(tmp_path):
    record = tmp_path / "t.json"
    with pytest.raises(SystemExit, match="exited with 3"):
        main(["--name", "x", "--repeats", "2", "--record", str(record), "--", sys.executable, "-c", "exit(3)"])
    assert not record.exists()
