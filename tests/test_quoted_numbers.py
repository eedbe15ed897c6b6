"""
Every number a Markdown page quotes from a measurement is in the committed output it cites.

The pages are every ``*.md`` file of the repository (``PAGES``). Three kinds of quotes are checked:

* a fenced block introduced as a results file ("the block below is `results/NAME.txt`"): it is one
  contiguous part of that file;
* a claims table (a table with columns headed "claim" and "ours ..."): in each row, every decimal number of that cell
  appears in an output the row cites: a notebook (``NN_name``: its committed outputs and its code, where
  parameters such as a keep ratio are set) or a results file (``results/...``; a JSON file's numbers may be
  quoted rounded). "(same runs)" cites the row above's sources. A row with numbers that cites nothing fails;
* the prose: every number a section (a ``## `` heading and what follows it up to the next) states, a
  decimal, a percentage or an integer of three or more digits (``tests/quoting.py`` says which numbers are
  not statements: section numbers, years, code spans, a sentence that quotes a paper ...), appears in a
  source the section cites, or in the section's own commands and code (``--keep 0.1``). On the front page
  (``README.md``) every integer counts.

A number written in another precision than the output's (0.3 for 0.30) or computed by hand (a ratio of two
printed numbers) fails on purpose: quote what the output prints, or make the output print it. What this
does not check: that a number sits on the line it is quoted from (two swapped numbers of one output pass),
and small integers on pages other than the front page.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path

import pytest

from tests.quoting import in_text, output_text, sentence_numbers, sentences

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".ipynb_checkpoints", "node_modules", "_build", "site", ".pytest_cache"}
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.md")
               if not SKIP_DIRS & set(p.relative_to(ROOT).parts) and ".egg-info" not in str(p))
# an assignment sheet's numbers are the givens of its questions (a model's shape, a GPU's data sheet), not
# measurements; a model card (a README.md beside its card.json) is written from its card.json by code, which
# test_a_model_card_is_what_its_card_json_renders checks
CARDS = [page for page in PAGES if (ROOT / page).with_name("card.json").exists()]
MEASURED = [page for page in PAGES if not re.fullmatch(r"course/\w+/sheet\.md", page) and page not in CARDS]
VERSION = re.compile(r"\b(Python|torch|PyTorch|transformers|Triton|kvpress|numpy|jupytext|CUDA|commit|version)"
                     r"\s+v?\d[\w.]*")                       # a name's version, a commit: not a measurement
HASH = re.compile(r"\b[0-9a-f]{7,40}\b")
README = (ROOT / "README.md").read_text()
NUMBER = re.compile(r"(?<![\w.§])-?\d+\.\d+(?![\w.])")   # decimals: 0.77, -0.12 (not 3.11.7, 1e-7, §6.3)
NOTEBOOK = re.compile(r"\b(0\d_[a-z0-9_]+)")
RESULTS = re.compile(r"results/[\w.\-{},*]+")
FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)


@functools.cache                                  # pages cite the same files: read each once
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


@functools.cache
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


def claims_rows(page: str) -> list[tuple[str, str, str]]:
    """(table header, claim, our-measurement cell) for every row of the page's claims tables (a table with
    columns headed 'claim' and 'ours ...')."""
    rows, header, col = [], None, None
    for line in FENCE.sub("", (ROOT / page).read_text()).splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            col = next((i for i, c in enumerate(cells) if c.lower().startswith("ours")), None)
            col = col if "claim" in [c.lower() for c in cells] else None
        elif col is not None and not set(line) <= set("|-: "):
            rows.append((" | ".join(header[:2]), f"{cells[0]}: {cells[1][:60]}", cells[col]))
    return rows


ROWS = [(page, i) for page in PAGES for i in range(len(claims_rows(page)))]


def test_the_claims_tables_are_found():
    assert len(ROWS) >= 15


@pytest.mark.parametrize("page,row", ROWS, ids=lambda x: str(x)[:40])
def test_claims_row_quotes_its_outputs(page, row):
    rows = claims_rows(page)
    sources: list[str] = []
    for i in range(row, -1, -1):                  # "(same runs)": the sources of the row above
        _, _, ours = rows[i]
        sources = NOTEBOOK.findall(ours) + RESULTS.findall(ours)
        if sources or "same runs" not in ours:
            break
    _, claim, ours = rows[row]
    if not NUMBER.search(ours):                   # nothing measured to quote (e.g. "does not apply")
        return
    assert sources, f"{page}: {claim}: the row cites no notebook or results file for its numbers"
    text = "\n".join(notebook_text(s) if not s.startswith("results/") else results_text(s) for s in set(sources))
    missing = [n for n in NUMBER.findall(ours) if not re.search(rf"(?<![\d.]){re.escape(n)}(?!\d)", text)]
    assert not missing, f"{page}: {claim}: {missing} are not in {sorted(set(sources))}"


def quoted_blocks(page: str) -> list[tuple[str, str]]:
    """(results file, block) for every fenced block whose introduction says it is that file."""
    text = (ROOT / page).read_text()
    pattern = r"the block below is `(results/[^`]+)`(?:(?!```).)*?```[a-z]*\n(.*?)```"
    return [(m.group(1), m.group(2)) for m in re.finditer(pattern, text, re.S)]


def test_quoted_blocks_are_their_results_files():
    blocks = [(page, name, block) for page in PAGES for name, block in quoted_blocks(page)]
    assert blocks, "no block introduced as 'the block below is `results/...`'"
    for page, name, block in blocks:
        text = (ROOT / name).read_text()
        stale = [ln for ln in block.splitlines() if ln.strip() and ln not in text.splitlines()]
        assert not stale, f"{page}: the block from {name} has lines that file does not: {stale[:3]}"
        assert block.strip("\n") in text, f"{page}: the block from {name} is not one contiguous part of that file"


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, text) of every '## ' section of a page, the part before the first one included."""
    out, heading, lines = [], "(top)", []
    for line in text.splitlines():
        if line.startswith("## "):
            out.append((heading, "\n".join(lines)))
            heading, lines = line, []
        else:
            lines.append(line)
    return out + [(heading, "\n".join(lines))]


def notebook_table() -> str:
    """The table ``python notebooks/build.py --table`` writes (test_notebooks.py checks the README holds it)."""
    spec = importlib.util.spec_from_file_location("notebook_build", ROOT / "notebooks" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build.table()


def stated(prose: str, every_integer: bool) -> list[str]:
    """The numbers the prose states (``tests/quoting.py``): decimals, percentages and integers of three or more
    digits, or every integer."""
    numbers = [n for s in sentences(prose) for n in sentence_numbers(s)]
    return [n for n in numbers if every_integer or "." in n or "%" in n or len(n.replace(",", "").lstrip("-")) >= 3]


def unquoted_on(page: str, text: str | None = None) -> list[tuple[str, str]]:
    """(section, number) for every number a section states that no source it cites, nor its own code, holds."""
    text = (ROOT / page).read_text() if text is None else text
    missing = []
    for heading, body in sections(text):
        code = [m.group() for m in FENCE.finditer(body)] + re.findall(r"`[^`\n]+`", body)
        prose = FENCE.sub("", body)
        prose = HASH.sub(" ", VERSION.sub(" ", prose))
        cited = set(NOTEBOOK.findall(body)), set(RESULTS.findall(body))
        sources = [notebook_text(s) for s in cited[0]] + [results_text(s) for s in cited[1] if expand(s)]
        if page == "README.md" and "notebooks/build.py --table" in body:     # the generated notebook table,
            sources.append(notebook_table())                                 # checked by test_notebooks.py
        scope = "\n".join(code + sources)
        missing += [(heading, n) for n in stated(prose, page == "README.md") if not in_text(n, scope)]
    return missing


@pytest.mark.parametrize("page", MEASURED)
def test_a_page_quotes_only_numbers_its_sources_hold(page):
    missing = unquoted_on(page)
    assert not missing, f"{page}: numbers its section's cited results files, notebooks and commands do not " \
                        f"hold (section, number): {missing[:12]}; cite the file that has them (results/...), " \
                        "quote what it prints, or correct the text"


def test_the_page_check_catches_a_number_its_sources_do_not_hold():
    page = "## Speed\n\nDecoding takes 12.5 ms a token and 3,000 tokens fit (`results/kernels_bench_h100.json`).\n"
    assert unquoted_on("x.md", page) == [("## Speed", "12.5"), ("## Speed", "3,000")]
    cmd = "## Run\n\n```bash\npython -m experiments.compare --keep 0.37\n```\nIt keeps 0.37 of the cache.\n"
    assert unquoted_on("x.md", cmd) == []
    assert unquoted_on("README.md", "## A\n\nIt keeps 3 of the 5 samples.\n") == [("## A", "3"), ("## A", "5")]


@pytest.mark.parametrize("page", CARDS)
def test_a_model_card_is_what_its_card_json_renders(page):
    """A checkpoint's README.md is its card.json rendered (``nanollm.cli.card`` or Match3's), not edited by hand."""
    from methods.tensor_attention.match3 import card_markdown
    from nanollm.cli.card import markdown
    card = json.loads((ROOT / page).with_name("card.json").read_text())
    render = card_markdown if "attention" in card and "parameters" in card else markdown
    assert (ROOT / page).read_text().strip() == render(card).strip(), f"{page} is not what its card.json renders"
