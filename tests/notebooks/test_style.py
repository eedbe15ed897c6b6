"""
The notebooks read as one course: one heading style (``# NN Title``, ``## N. Section``, ``### N.M
Subsection``, a last ``## Exercises`` with ``### Exercise N: title``, then at most an ``## Appendix: title``
with ``### A.N Subsection``), a pointer to the metrics glossary
wherever the method tables' metrics appear (``notebooks/README.md#metrics``), and at least one exercise whose
reference, a solution region of the topic's assignment, runs the exercise's check.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from course.assignments import ASSIGNMENTS
from course.markers import find_regions

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
_spec = importlib.util.spec_from_file_location("notebook_build", NOTEBOOKS / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)
SOURCES, LABS = build.lessons(), sorted(build.LABS.glob("[0-9][0-9]_*.py"))


def headings(path: Path) -> list[str]:
    return [line for cell in build.read_percent(path).cells if cell.cell_type == "markdown"
            for line in cell.source.splitlines() if line.startswith("#")]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.stem)
def test_one_heading_style(path):
    found = headings(path)
    assert re.fullmatch(rf"# {path.stem[:2]} \S.*", found[0]), f"title: '# {path.stem[:2]} Title', got {found[0]!r}"
    rules = [r"## \d+\. \S.*", r"## Exercises", r"### \d+\.\d+ \S.*", r"### Exercise \d+: \S.*",
             r"## Appendix: \S.*", r"### A\.\d+ \S.*"]
    wrong = [h for h in found[1:] if not any(re.fullmatch(rule, h) for rule in rules)]
    assert not wrong, f"{path.name}: headings off the style: {wrong}"
    sections = [h for h in found if h.startswith("## ") and not h.startswith("## Appendix: ")]
    assert sections[-1] == "## Exercises", \
        f"{path.name}: the last section must be '## Exercises' (an appendix may follow)"
    appendix = [i for i, h in enumerate(found) if h.startswith("## Appendix: ")]
    assert not appendix or appendix[0] > found.index("## Exercises"), \
        f"{path.name}: the appendix comes after the exercises"


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_a_lab_keeps_the_heading_style_and_holds_no_solution(path):
    """A lab: '# NN Lab: Title', numbered sections, an optional appendix; exercises are the lesson's, and no
    course solution region (a student copy strips only its own lesson)."""
    found = headings(path)
    assert re.fullmatch(rf"# {path.stem[:2]} Lab: \S.*", found[0]), f"title: '# {path.stem[:2]} Lab: Title'"
    rules = [r"## \d+\. \S.*", r"### \d+\.\d+ \S.*", r"## Appendix: \S.*", r"### A\.\d+ \S.*"]
    wrong = [h for h in found[1:] if not any(re.fullmatch(rule, h) for rule in rules)]
    assert not wrong, f"{path.name}: headings off the style: {wrong}"
    assert not find_regions(path), f"{path.name}: a lab holds no course region"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.stem)
def test_a_self_checking_exercise(path):
    """The topic's assignment strips at least one exercise's reference, and each such cell runs the exercise's
    check on its answer (``test_exercises.py`` has the rest of the rules)."""
    assignment = next(a.name for a in ASSIGNMENTS.values() if a.notebook == path.stem)
    regions = [r for r in find_regions(path) if r.assignment == assignment]
    assert regions, f"{path.name}: no exercise with a solution region [{assignment}]"
    lines = path.read_text().splitlines()
    exercises = lines.index("# ## Exercises")
    for r in regions:
        rest = []
        for line in lines[r.end:]:
            if line.startswith("# %%"):
                break
            rest.append(line)
        if r.begin > exercises:
            assert re.search(r"^check_\w+\(reference_\w+", "\n".join(rest), flags=re.M), \
                f"{path.name}:{r.begin}: the reference's cell must run the exercise's check on its answer"
        else:                                           # a build-it cell: checked against the library
            assert re.search(r"^\s*assert .+,", "\n".join(rest), flags=re.M), \
                f"{path.name}:{r.begin}: the region's cell must check the answer with an assert and a message"


GLOSSARY = "README.md#metrics"


@pytest.mark.parametrize("path", SOURCES + LABS, ids=lambda p: p.stem)
def test_metrics_point_to_the_glossary(path):
    """A page that prints the tables' metrics links the book's glossary, ``notebooks/README.md#metrics``."""
    text = path.read_text()
    if re.search(r"\bKL\b", text) and re.search(r"\b(acc|keep ratio)\b", text):
        link = GLOSSARY if path.parent.name == "notebooks" else "../" + GLOSSARY
        assert f"]({link})" in text, f"{path.name} uses the tables' metrics: link the glossary, ]({link})"


def wrapped_into_a_list(markdown: str) -> list[str]:
    """Lines that Markdown reads as a new list item though the sentence goes on: a line wrapped inside a code
    span (the line before leaves a backtick open) that starts with '- ', '+ ', '* ' or '1. '."""
    lines = markdown.splitlines()
    return [f"{before[-30:]} | {line[:30]}" for before, line in zip(lines, lines[1:])
            if before.count("`") % 2 and re.match(r"\s*([-+*]|1[.)])\s", line)]


@pytest.mark.parametrize("path", SOURCES + LABS, ids=lambda p: p.stem)
def test_no_wrapped_line_starts_a_list(path):
    wrong = [w for cell in build.read_percent(path).cells if cell.cell_type == "markdown"
             for w in wrapped_into_a_list(cell.source)]
    assert not wrong, f"{path.name}: a line wrapped inside `code` starts with a list marker: {wrong}"


def test_the_wrap_check_finds_the_list_a_wrap_made():
    assert wrapped_into_a_list("more than `N\n- p` low flags\n\nand `x`\n- a list") == ["more than `N | - p` low flags"]


def changing_letters() -> list[tuple[str, list[str]]]:
    """The rows of ``notebooks/README.md``'s "Letters that change meaning": (the symbol cell, its lessons)."""
    text = (NOTEBOOKS / "README.md").read_text().split("## Letters that change meaning", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| $")]
    return [(symbol.strip(), re.findall(r"\d\d", lessons)) for symbol, lessons in rows]


def test_the_book_lists_only_letters_its_lessons_use():
    """Each letter the book's table says a lesson uses in its own sense is in that lesson (a renamed letter
    leaves no stale row behind)."""
    assert changing_letters()
    for symbol, lessons in changing_letters():
        first = re.match(r"\$[^$]+\$", symbol).group(0)
        for number in lessons:
            source = next(NOTEBOOKS.glob(f"{number}_*.py")).read_text()
            assert first in source, f"notebooks/README.md lists {first} for lesson {number}, which does not use it"
