"""
A lesson's by-hand build is checked against the library, and the check is strong enough to refuse the slips a
reader makes (``wrong_by_hand.py``): an empty slot attended, a mask read from slot numbers, a round for a floor.

The fast tests read the sources: every by-hand region has slips, each written once into its region. The slow
one runs the lessons in quick mode (``python -m tests.notebooks.by_hand``, one process for all): clean, each
runs through its checks; with a slip, each stops at or after the slip's cell.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from course.mutants import Mutant
from tests.notebooks import by_hand
from tests.notebooks.wrong_by_hand import SLIPS

ROOT = Path(__file__).resolve().parents[2]
LESSONS = [p.stem for p in by_hand.build.lessons()]


def test_every_by_hand_region_has_slips_and_every_slip_a_region():
    for stem in LESSONS:
        regions = {r.task for r in by_hand.by_hand_regions(by_hand.code_cells(stem))}
        slipped = {s.task for s in SLIPS.get(stem, [])}
        assert regions <= slipped, f"{stem}: no slip for {sorted(regions - slipped)} in wrong_by_hand.py"
        assert slipped <= regions, f"{stem}: slips for {sorted(slipped - regions)}, not a by-hand region"


@pytest.mark.parametrize("stem", sorted(SLIPS))
def test_each_slip_changes_its_region_once_and_compiles(stem):
    cells = by_hand.code_cells(stem)
    regions = by_hand.by_hand_regions(cells)
    for slip in SLIPS[stem]:
        changed = [(i, s) for (i, s), (_, before) in zip(by_hand.with_slip(cells, regions, slip), cells) if s != before]
        assert len(changed) == 1, f"{stem}, {slip.name}: changes {len(changed)} cells"
        compile(changed[0][1], f"{stem}:cell {changed[0][0]}", "exec")


def test_a_slip_that_is_not_in_its_region_once_is_refused():
    cells = by_hand.code_cells("07_kernels")
    regions = by_hand.by_hand_regions(cells)
    with pytest.raises(ValueError, match="occurs 0 times"):
        by_hand.with_slip(cells, regions, Mutant("x", "merge_splits", "y", "not in the code"))
    with pytest.raises(ValueError, match="no by-hand region"):
        by_hand.with_slip(cells, regions, Mutant("x", "nothing", "y", "m"))


def test_the_run_sees_a_check_too_weak_for_its_slip():
    """A toy lesson whose check reads only part of the answer: the slip runs through, which the slow test
    reports as a survivor."""
    cells = [(0, "def double(x):\n    # BEGIN SOLUTION [toy:double] twice x\n    return 2 * x\n    # END SOLUTION\n"),
             (1, "assert double(0) == 0"), (2, "assert double(3) == 6")]
    regions = by_hand.by_hand_regions(cells)
    assert [(r.task, r.cell, r.last) for r in regions] == [("double", 0, 2)]
    slip = Mutant("squares", "double", "x * x", "2 * x")
    assert by_hand.run(by_hand.with_slip(cells, regions, slip), 1)["error"] is None                   # survives
    caught = by_hand.run(by_hand.with_slip(cells, regions, slip), 2)
    assert caught["cell"] == 2 and caught["checked"]                                               # caught
    crash = by_hand.run(by_hand.with_slip(cells, regions, Mutant("a crash", "double", "x / 0", "2 * x")), 2)
    assert crash["cell"] == 1 and not crash["checked"]          # ZeroDivisionError: not a check's refusal


@pytest.fixture(scope="module")
def reports():
    env = {**os.environ, "NANOLLM_TINY": "1", "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, "-m", "tests.notebooks.by_hand"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("stem", sorted(SLIPS))
def test_the_lesson_refuses_every_slip(stem, reports):
    report = reports[stem]
    assert report["clean"]["error"] is None, f"{stem} fails without a slip, cell {report['clean']['cell']}: " \
                                             f"{report['clean']['error']}"
    survived = [f"{s['task']}: {s['why']}" for s in report["slips"] if s["error"] is None]
    assert not survived, f"{stem}: the lesson's checks pass these slips:\n  " + "\n  ".join(survived)
    early = [f"{s['task']}: {s['why']} stopped at cell {s['cell']}, before the region's cell {s['region_cell']}: "
             f"{s['error']}" for s in report["slips"] if s["error"] and s["cell"] < s["region_cell"]]
    assert not early, "\n".join(early)
    crashed = [f"{s['task']}: {s['why']}: {s['error']}" for s in report["slips"] if s["error"] and not s["checked"]]
    assert not crashed, "a slip must be refused by a check's assert, with its message, not by a crash:\n  " + \
        "\n  ".join(crashed)
