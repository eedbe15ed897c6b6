"""
The Markdown pages as written: README.md's set-up is what CI runs and the package then imports from anywhere;
on every page (``PAGES``), the Python blocks run, the commands name only flags the commands have, the sample
output of ``python -m experiments.bench`` is what the bench prints for those numbers, and a notebook section a
page points at exists.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.bench import BenchResult, BenchRow, fit_line, format_result
from nanollm.config import preset
from tests.test_quoted_numbers import PAGES

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ALL = "\n".join((ROOT / page).read_text() for page in PAGES)         # every page, the front page first


def code_blocks(language: str, text: str = ALL) -> list[str]:
    """The fenced blocks of ``text`` (every page) opened with ```language (``""``: blocks without a language)."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines(keepends=True):
        if not line.startswith("```"):
            lines.append(line)
        elif lang is None:                       # an opening fence
            lang, lines = line[3:].strip(), []
        else:                                    # a closing fence
            if lang == language:
                blocks.append("".join(lines))
            lang = None
    return blocks


def python(args: list[str], cwd: Path, importable: bool = True) -> subprocess.CompletedProcess:
    """A fresh interpreter in ``cwd``; ``importable``: with this checkout on PYTHONPATH (else as installed)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    if importable:
        env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_ci_runs_the_readme_setup_and_tests():
    required, optional = code_blocks("bash", README)[:2]             # what everyone runs, then the optional lines
    setup = [line.split("#")[0].strip() for line in (required + optional).splitlines()]
    assert "pip install -r requirements.txt && pip install -e ." in required and "python -m pytest -q" in required
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for line in ("pip install -r requirements.txt && pip install -e .", "python -m nanollm.cli.fetch smollm2-135m",
                 'pip install -e ".[book]" && npm ci --prefix book',
                 "python -m pytest -q -n 2 --dist loadfile --runslow"):
        assert line in setup and (line in ci or f"{line} || exit 1" in ci), line


def test_the_timings_table_is_the_record():
    """The README's table of measured times says what ``results/timings.json`` holds: each step's median and
    runs with their load, as the record's entry of that step has them."""
    record = json.loads((ROOT / "results" / "timings.json").read_text())
    steps = {"install": "install", "fast tier": "fast_tier", "slow tier (CI)": "slow_tier", "main job": "main_job",
             "fetch": "fetch", "book": "book", "real-model example": "generate"}
    rows = {m[0]: m[1:] for m in re.findall(r"^\| ([^|]+?) \| [^|]+ \| ([\d.]+) s \| ([^|]+?) \|$", README, flags=re.M)}
    assert sorted(rows) == sorted(steps), rows
    for step, key in steps.items():
        entry = record[key]
        runs = ", ".join(f"{r['s']} s at load {r['load']}" for r in entry["runs"])
        assert rows[step] == (f"{entry['median_s']}", runs), f"README's {step!r} row: {rows[step]}, the record: {entry}"


@pytest.mark.slow
def test_package_imports_from_anywhere(tmp_path):
    """After the README's set-up (``pip install -e .``), nanollm and methods import from any folder."""
    result = python(["-c", "import nanollm, methods; print(nanollm.__file__)"], tmp_path, importable=False)
    assert result.returncode == 0, f"run the README's set-up (pip install -e .): {result.stderr[-300:]}"
    if not Path(result.stdout.strip()).is_relative_to(ROOT):
        pytest.skip(f"nanollm is installed from another checkout: {result.stdout.strip()}")


def printed_after(block: str) -> str | None:
    """The output a page shows for a Python block: a ```text block that follows it, with only a paragraph
    ending in a colon between them (None if the page shows none)."""
    after = ALL[ALL.index(block) + len(block):].split("```", 2)
    m = re.fullmatch(r"\n\n([^#]*?:)\n\n", after[1]) if len(after) == 3 else None
    if m is None or not after[2].startswith("text\n"):
        return None
    return after[2][len("text\n"):].split("```", 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("block", code_blocks("python"), ids=lambda b: b.splitlines()[0][:40])
def test_python_block_runs(block, tmp_path):
    """Each block runs; where the page shows what it prints, it prints that."""
    result = python(["-c", block], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    if (shown := printed_after(block)) is not None:
        assert result.stdout == shown, result.stdout


def test_the_readme_shows_what_its_example_prints():
    assert any(printed_after(b) for b in code_blocks("python", README))


def readme_commands() -> list[list[str]]:
    """Every ``python -m ...`` command of every page, from its shell blocks and its inline code."""
    lines = [line for block in code_blocks("bash") for line in block.splitlines()]
    lines += re.findall(r"`(python -m [^`]+)`", ALL)
    commands = []
    for line in lines:
        line = line.split(" #")[0].strip()
        for part in re.split(r"&&|, then ", line):        # "a && b", a model card's "a, then b"
            words = shlex.split(part)
            if words[:2] == ["python", "-m"] and words[2] != "pytest":
                commands.append(words[2:])
    return commands


HELP_TEXTS = """
import contextlib, io, json, runpy, sys
out = {}
for name in sys.argv[1:]:                       # "module" or "module subcommand"
    sys.argv, text = [*name.split(), "--help"], io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(io.StringIO()):
        try:
            runpy.run_module(name.split()[0], run_name="__main__")
        except SystemExit:
            pass
    out[name] = text.getvalue()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_commands_use_flags_that_exist(tmp_path):
    """A command's flags are in its ``--help``, or in its subcommand's (``match3 train --attention``)."""
    commands = readme_commands()
    modules = sorted({c[0] for c in commands})
    assert {"experiments.compare", "nanollm.cli.train", "nanollm.cli.card", "experiments.bench"} <= set(modules)
    subcommands = sorted({f"{c[0]} {c[1]}" for c in commands if len(c) > 1 and re.fullmatch(r"[a-z]+", c[1])})
    result = python(["-c", HELP_TEXTS, *modules, *subcommands], tmp_path)
    assert result.returncode == 0, result.stderr
    helps = json.loads(result.stdout)
    for module, *args in commands:
        assert helps[module].startswith("usage:"), f"{module} printed no help"
        sub = helps.get(f"{module} {args[0]}", "") if args else ""
        for flag in (a.split("=")[0] for a in args if a.startswith("--")):
            assert re.search(rf"(?<![\w-]){flag}(?![\w-])", helps[module] + sub), \
                f"`python -m {module}` has no flag {flag}"


def test_bench_output_is_what_the_bench_prints():
    """The README's bench sample, printed again by ``format_result`` from its own rows, is the same text."""
    block = next(b for b in code_blocks("") if b.startswith("model TINY:"))
    head = re.match(r"model (\w+): .*batch (\d+), fp32, (\d+) thread\(s\); median of (\d+) repeats x (\d+) steps",
                    block)
    name, batch, threads, repeats, steps = head[1], *map(int, head.groups()[1:])
    rows = [BenchRow(int(c), float(a), float(b), int(k.replace(",", "")), int(f.replace(",", "")))
            for c, a, b, k, f in re.findall(r"^ *(\d+) \| +([\d.]+) \| +([\d.]+) \|.*\| +([\d,]+) \| +([\d,]+)$",
                                            block, flags=re.M)]
    result = BenchResult(config=preset(name, max_seq_len=2048), batch=batch, threads=threads, repeats=repeats,
                         steps=steps, rows=rows)
    for mode in ("cached", "recompute"):
        result.fit[mode] = fit_line([r.context for r in rows], [getattr(r, f"{mode}_ms") for r in rows])
    assert len(rows) == 4 and format_result(result, name=name) == block.rstrip("\n")


def notebook_sections() -> dict[str, set[str]]:
    """Section numbers of every lesson and lab ("4", "4.1", ...), from its headings."""
    found = {}
    lessons, labs = ROOT / "notebooks", ROOT / "notebooks" / "labs"
    for path in sorted(lessons.glob("[0-9][0-9]_*.py")) + sorted(labs.glob("[0-9][0-9]_*.py")):
        numbers = (re.match(r"# #{2,3} (\d+(?:\.\d+)?)[. ]", line) for line in path.read_text().splitlines())
        found[path.stem] = {m.group(1) for m in numbers if m}
    return found


def test_section_references_exist():
    """"`04_perturbation_selection` §7.4" and "notebook 06 section 6" point at headings that exist."""
    sections, wrong = notebook_sections(), []
    patterns = [r"`(\d\d_[a-z_]+)`,? (?:§|section )(\d+(?:\.\d+)?[a-z]?)",
                r"[Nn]otebook (\d\d),? (?:§|section )(\d+(?:\.\d+)?[a-z]?)"]
    for pattern in patterns:
        for page in PAGES:
            text = (ROOT / page).read_text()
            for m in re.finditer(pattern, text):
                name = next((k for k in sections if k.startswith(m.group(1))), m.group(1))
                if m.group(2) not in sections.get(name, set()):
                    wrong.append(f"{page}: {m.group(0)} (line {text[:m.start()].count(chr(10)) + 1})")
    assert not wrong, f"pages point at sections the notebooks do not have: {wrong}"
