"""
The Markdown pages read as the repository's documentation should: the front page short enough to read top to
bottom, every other page short enough to read in one sitting, every link leading somewhere, and no page or
notebook telling the story of earlier runs (the current measurement, its command and its date; the history
is git's).

The numbers the pages quote are checked against their sources in ``tests/test_quoted_numbers.py``; the
commands and code blocks they show, in ``tests/test_readme.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_quoted_numbers import FENCE, PAGES, ROOT

FRONT_PAGE_LINES, PAGE_LINES = 300, 400
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)|!\[[^\]\n]*\]\(([^)\s]+)\)")      # [text](target), ![alt](image)

# Sentences that narrate a page's or a result's past rather than say what holds now
HISTORY = re.compile(
    r"\b(?:the run before|the build before|before this (?:work|change|commit|fix|issue|session)|"
    r"used to (?:be|take|print|give|run|have|say|show)|previously|"
    r"earlier (?:run|runs|version|versions|build|builds|day|days|measurement|measurements|commit|session|"
    r"result|results|one|reading of this|draft|table)|an earlier (?:run|version|build|measurement|commit)|"
    r"in the last (?:run|build)|the earlier \"|"
    r"(?:was|were) (?:\d[\d.,]*\s*\w*\s+)?before (?:the|this|we)|we aimed for)\b", re.I)


def test_the_front_page_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= FRONT_PAGE_LINES, f"README.md has {lines} lines, more than {FRONT_PAGE_LINES}: move depth " \
                                      "into the folder's README it describes"


@pytest.mark.parametrize("page", [p for p in PAGES if p != "README.md"])
def test_every_other_page_reads_in_one_sitting(page):
    lines = len((ROOT / page).read_text().splitlines())
    assert lines <= PAGE_LINES, f"{page} has {lines} lines, more than {PAGE_LINES}: split it into pages it links"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lstrip("#").strip()).lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(line) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def broken_links(page: str, text: str | None = None) -> list[str]:
    """The links of ``page`` whose file, or heading in that file, does not exist."""
    path = ROOT / page
    text = FENCE.sub("", path.read_text() if text is None else text)
    text = re.sub(r"`[^`\n]*`", "", text)
    wrong = []
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z]+:", target):                   # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            wrong.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            wrong.append(target)
    return wrong


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    wrong = broken_links(page)
    assert not wrong, f"{page} links to files or headings that do not exist: {wrong}"


def test_the_link_check_sees_a_missing_file_and_a_missing_heading():
    text = "See [the decoder](nanollm/README.md), [gone](course/nothing.md), [here](#no-such-heading).\n# Title\n"
    assert broken_links("README.md", text) == ["course/nothing.md", "#no-such-heading"]
    assert slug("## The main job: `python -m experiments.compare`") == "the-main-job-python--m-experimentscompare"


def notebook_markdown() -> dict[str, str]:
    """The markdown cells of every lesson and lab source, by file."""
    found = {}
    for path in sorted((ROOT / "notebooks").rglob("[0-9][0-9]_*.py")):
        cells = re.split(r"^# %%", path.read_text(), flags=re.M)
        found[path.relative_to(ROOT).as_posix()] = "\n".join(c for c in cells if c.startswith(" [markdown]"))
    return found


TEXTS = {**{page: (ROOT / page).read_text() for page in PAGES}, **notebook_markdown()}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_no_history_of_earlier_runs(name):
    found = [m.group() for m in HISTORY.finditer(FENCE.sub("", TEXTS[name]))]
    assert not found, f"{name} tells the history of earlier runs or versions ({found[:5]}): say what holds " \
                      "now, with its command and date; git keeps the history"


def test_the_history_check_catches_a_changelog_and_spares_earlier_tokens():
    for text in ("took 110 s; the run before took 782 s", "an earlier version of this notebook found",
                 "this used to take 20 minutes", "9.2x in the earlier run", "not the 20 minutes we aimed for"):
        assert HISTORY.search(text), text
    for text in ("attends to earlier tokens", "the earlier position wins", "keys of earlier layers"):
        assert not HISTORY.search(text), text
