"""
Run a lesson's by-hand builds with a slip written in (``wrong_by_hand.py``) and say where the lesson stopped.

A by-hand region is a course region with a task in a lesson's code cell. The lesson runs, in one namespace and
in quick mode, from its first code cell through the last one that uses a function the region defines; the first
exception ends the run. Without a slip the run must end with no exception; with one it must stop at or after
the region's cell.

    python -m tests.notebooks.by_hand            # every lesson with slips: a JSON report on stdout
"""

from __future__ import annotations

import ast
import json
import os
import sys
from dataclasses import dataclass

from course.markers import find_regions
from course.mutants import Mutant
from tests.notebooks.test_exercises import NOTEBOOKS, build
from tests.notebooks.wrong_by_hand import SLIPS


@dataclass
class ByHand:
    """One by-hand region of a lesson: where it is and how far the lesson runs to check it."""
    task: str            # its task: "mask" of "[cache:mask]"
    cell: int            # the code cell that holds it (index among all cells)
    last: int            # the last code cell that uses a function it defines
    body: str            # the region's lines, as the source has them


def code_cells(stem: str) -> list[tuple[int, str]]:
    """(index, source) of the lesson's code cells, the course's markers kept."""
    nb = build.read_percent(NOTEBOOKS / f"{stem}.py", page=False)
    return [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def by_hand_regions(cells: list[tuple[int, str]]) -> list[ByHand]:
    """The regions with a task, each with the last code cell that names a function it defines (or lies in)."""
    found = []
    for i, source in cells:
        lines = source.splitlines()
        for r in find_regions("cell.py", source):
            if not r.task:
                continue
            body = "\n".join(r.body(lines))
            defined = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)
                       and n.lineno <= r.end and n.end_lineno >= r.begin}     # in the region, or around it
            users = [j for j, s in cells if j >= i and any(isinstance(n, ast.Name) and n.id in defined
                                                             for n in ast.walk(ast.parse(s)))]
            found.append(ByHand(r.task, i, max(users, default=i), body))
    return found


def with_slip(cells: list[tuple[int, str]], regions: list[ByHand], slip: Mutant) -> list[tuple[int, str]]:
    """The cells with ``slip`` written into its region: ``old`` must occur exactly once in the region."""
    region = next((r for r in regions if r.task == slip.task), None)
    if region is None:
        raise ValueError(f"no by-hand region of task {slip.task}")
    if region.body.count(slip.old) != 1:
        raise ValueError(f"{slip.task}: {slip.old!r} occurs {region.body.count(slip.old)} times in the region")
    out = []
    for i, source in cells:
        if i == region.cell:
            source = source.replace(region.body, region.body.replace(slip.old, slip.new), 1)
        out.append((i, source))
    return out


def run(cells: list[tuple[int, str]], last: int, name: str = "lesson") -> dict:
    """Execute the cells through index ``last`` in a fresh namespace, the global seed reset: {"cell": where it
    stopped or None, "error": "Type: message" or None, "checked": whether an assert stopped it}. Modules the
    lessons import stay loaded between runs (the preamble's one thread and first seed hold for every run)."""
    import torch
    torch.manual_seed(0)
    namespace = {"__name__": "__main__"}
    for i, source in cells:
        if i > last:
            break
        try:
            exec(compile(source, f"{name}:cell {i}", "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - any exception stops the lesson; the report names it
            return {"cell": i, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300],
                    "checked": isinstance(e, AssertionError)}          # a check's assert, not a crash
        finally:
            close_figures()
    return {"cell": None, "error": None, "checked": False}


def close_figures() -> None:
    """Close the figures a run drew (matplotlib keeps every open one), where matplotlib is loaded."""
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")


def report(stem: str) -> dict:
    """The lesson run through every by-hand region's checks without a slip, then once per slip."""
    cells = code_cells(stem)
    regions = by_hand_regions(cells)
    last = max(r.last for r in regions)
    out = {"clean": run(cells, last, stem), "slips": []}
    for slip in SLIPS.get(stem, []):
        region = next(r for r in regions if r.task == slip.task)
        result = run(with_slip(cells, regions, slip), region.last, stem)
        out["slips"].append({"task": slip.task, "why": slip.name, "region_cell": region.cell, **result})
    return out


def main() -> None:
    os.environ["NANOLLM_TINY"] = "1"           # before the lessons import preamble
    os.environ.setdefault("MPLBACKEND", "Agg")
    sys.path[:0] = [str(NOTEBOOKS)]
    os.chdir(NOTEBOOKS)
    stdout, sys.stdout = sys.stdout, sys.stderr          # what the lessons print goes to stderr
    try:
        reports = {stem: report(stem) for stem in sorted(SLIPS)}
    finally:
        sys.stdout = stdout
    print(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
