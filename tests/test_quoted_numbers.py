"""
Every number the README quotes from a measurement is in the committed output it cites.

Two kinds of quotes are checked:

* a fenced block introduced as a results file ("the block below is `results/NAME.txt`"): it is one
  contiguous part of that file;
* the claims tables ("What the papers claim, what we measure"): in each row, every decimal number of the
  cell that gives our measurement ("ours ...") appears in an output the row cites: a notebook
  (``NN_name``: its committed outputs and its code, where parameters such as a keep ratio are set) or a
  results file (``results/...``; a JSON file's numbers may be quoted rounded). "(same runs)" cites the
  row above's sources. A row with numbers that cites nothing fails.

A number written in another precision than the output's (0.3 for 0.30) or computed by hand (a ratio of two
printed numbers) fails on purpose: quote what the output prints, or make the output print it. What this
does not check: that a number sits on the line it is quoted from (two swapped numbers of one output pass),
integers, and the prose outside the claims tables.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
NUMBER = re.compile(r"(?<![\w.§])-?\d+\.\d+(?![\w.])")   # decimals: 0.77, -0.12 (not 3.11.7, 1e-7, §6.3)
NOTEBOOK = re.compile(r"\b(0\d_[a-z0-9_]+)")
RESULTS = re.compile(r"results/[\w.\-{},*]+")


def output_text(cells: list[dict]) -> str:
    """A notebook's code and outputs (stream text and plain-text results), from its cells as JSON."""
    parts = []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        parts.append("".join(cell["source"]))
        for out in cell.get("outputs", []):
            if "text" in out:
                parts.append("".join(out["text"]))
            elif "text/plain" in out.get("data", {}):
                parts.append("".join(out["data"]["text/plain"]))
    return "\n".join(parts)


def notebook_text(name: str) -> str:
    """A committed notebook's code and outputs."""
    path = ROOT / "notebooks" / f"{name}.ipynb"
    if not path.exists():                                   # a lab: notebooks/labs/NN_name.ipynb
        path = ROOT / "notebooks" / "labs" / f"{name}.ipynb"
    assert path.exists(), f"README cites notebook {name}, which does not exist"
    return output_text(json.loads(path.read_text())["cells"])


def expand(pattern: str) -> list[Path]:
    """``results/a_{x,y}.txt`` -> the files it names (braces expanded, globs matched)."""
    m = re.search(r"\{([^}]*)\}", pattern)
    if m:
        return [p for alt in m.group(1).split(",") for p in expand(pattern[:m.start()] + alt + pattern[m.end():])]
    return sorted(ROOT.glob(pattern.rstrip(".,;)")))


def json_numbers(value) -> list[float]:
    """Every number in a parsed JSON value, however deeply nested."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in json_numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in json_numbers(v)]
    return [float(value)] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def results_text(pattern: str) -> str:
    """A results file's text; for JSON, also each number rounded to 1-4 decimals (the README rounds what
    the JSON keeps at full precision)."""
    paths = expand(pattern)
    assert paths, f"README cites {pattern}, which matches no file"
    parts = []
    for p in paths:
        if p.suffix in (".txt", ".md"):
            parts.append(p.read_text())
        elif p.suffix == ".json":
            numbers = json_numbers(json.loads(p.read_text()))
            parts.append(" ".join(f"{x:.{d}f}" for x in numbers for d in (1, 2, 3, 4)))
    return "\n".join(parts)


def claims_rows() -> list[tuple[str, str, str]]:
    """(table header, claim, our-measurement cell) for every row of the claims tables."""
    section = README[README.index("## What the papers claim"):]
    section = section[:section.index("\n## ", 5)]
    rows, header, col = [], None, None
    for line in section.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            col = next((i for i, c in enumerate(cells) if c.lower().startswith("ours")), None)
            assert col is not None, f"a claims table without an 'ours ...' column: {line[:80]}"
        elif not set(line) <= set("|-: "):
            rows.append((" | ".join(header[:2]), f"{cells[0]}: {cells[1][:60]}", cells[col]))
    return rows


ROWS = claims_rows()


def test_the_claims_tables_are_found():
    assert len(ROWS) >= 25


@pytest.mark.parametrize("row", range(len(ROWS)), ids=lambda i: ROWS[i][1][:50])
def test_claims_row_quotes_its_outputs(row):
    sources: list[str] = []
    for i in range(row, -1, -1):                  # "(same runs)": the sources of the row above
        _, _, ours = ROWS[i]
        sources = NOTEBOOK.findall(ours) + RESULTS.findall(ours)
        if sources or "same runs" not in ours:
            break
    _, claim, ours = ROWS[row]
    if not NUMBER.search(ours):                   # nothing measured to quote (e.g. "does not apply")
        return
    assert sources, f"{claim}: the row cites no notebook or results file for its numbers"
    text = "\n".join(notebook_text(s) if not s.startswith("results/") else results_text(s) for s in set(sources))
    missing = [n for n in NUMBER.findall(ours) if not re.search(rf"(?<![\d.]){re.escape(n)}(?!\d)", text)]
    assert not missing, f"{claim}: {missing} are not in {sorted(set(sources))}"


def quoted_blocks() -> list[tuple[str, str]]:
    """(results file, block) for every fenced block whose introduction says it is that file."""
    out = []
    for m in re.finditer(r"the block below is `(results/[^`]+)`(?:(?!```).)*?```[a-z]*\n(.*?)```", README, re.S):
        out.append((m.group(1), m.group(2)))
    return out


def test_quoted_blocks_are_their_results_files():
    blocks = quoted_blocks()
    assert blocks, "no block introduced as 'the block below is `results/...`'"
    for name, block in blocks:
        text = (ROOT / name).read_text()
        stale = [ln for ln in block.splitlines() if ln.strip() and ln not in text.splitlines()]
        assert not stale, f"README's block from {name} has lines that file does not: {stale[:3]}"
        assert block.strip("\n") in text, f"README's block from {name} is not one contiguous part of that file"
