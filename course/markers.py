"""
Solution regions: the lines of the library (and of the notebooks) a student copy replaces.

A region is two comment lines around the lines a student writes::

    def group_scores(q, k):
        # BEGIN SOLUTION [cache] scale the queries by 1/sqrt(d), one matrix product per KV head
        ...the reference solution...
        # END SOLUTION

The id in brackets names the assignment, and after a colon the graded task (``[baselines:window_vote]``; a
region without a task is not graded). The rest of the BEGIN line is the hint the student copy shows as
``raise NotImplementedError("<id>, task <task>: <hint>")`` at the BEGIN line's indentation. In Markdown a
region is ``<!-- BEGIN SOLUTION [id] -->`` ... ``<!-- END SOLUTION -->`` and becomes ``*(your answer)*``.
Regions never nest; every BEGIN has its END; an error names the file and the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TAG = r"\[(?P<id>[a-z0-9_]+)(?::(?P<task>[a-z0-9_]+))?\]"      # [assignment] or [assignment:task]
PY_BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION " + TAG + r"\s*(?P<hint>.*?)\s*$")
PY_END = re.compile(r"^[ \t]*# END SOLUTION\s*$")
MD_BEGIN = re.compile(r"^(?P<indent>[ \t]*)<!-- BEGIN SOLUTION " + TAG + r"\s*(?P<hint>.*?)\s*-->\s*$")
MD_END = re.compile(r"^[ \t]*<!-- END SOLUTION -->\s*$")
LOOSE = re.compile(r"(BEGIN|END) SOLUTION")           # anything that looks like a marker must parse as one


class MarkerError(ValueError):
    """A malformed, unbalanced or nested marker; the message starts with ``file:line:``."""


@dataclass(frozen=True)
class Region:
    path: Path
    assignment: str
    hint: str
    begin: int          # 1-based line of the BEGIN marker
    end: int            # 1-based line of the END marker
    indent: str
    task: str | None = None     # the graded task it belongs to (None: an ungraded exercise or answer)

    @property
    def label(self) -> str:
        """What the student copy's stub names: ``"baselines, task window_vote"`` or ``"baselines"``."""
        return self.assignment if self.task is None else f"{self.assignment}, task {self.task}"

    def body(self, lines: list[str]) -> list[str]:
        """The solution lines between the markers."""
        return lines[self.begin:self.end - 1]


def syntax(path: Path) -> tuple[re.Pattern, re.Pattern]:
    """The (BEGIN, END) patterns of a file: Markdown comments for .md, Python comments otherwise."""
    return (MD_BEGIN, MD_END) if path.suffix == ".md" else (PY_BEGIN, PY_END)


def find_regions(path: str | Path, text: str | None = None) -> list[Region]:
    """Every region of a file, in order. Raises ``MarkerError`` (``file:line: what is wrong``) on a BEGIN
    inside a region, an END outside one, a region left open, or a line that mentions a marker but is not one."""
    path = Path(path)
    lines = (path.read_text() if text is None else text).splitlines()
    begin_re, end_re = syntax(path)
    regions, open_ = [], None
    for n, line in enumerate(lines, 1):
        begin, end = begin_re.match(line), end_re.match(line)
        if begin:
            if open_ is not None:
                raise MarkerError(f"{path}:{n}: BEGIN SOLUTION inside the region opened at line {open_[0]} "
                                  "(regions do not nest)")
            if not begin["hint"]:
                raise MarkerError(f"{path}:{n}: BEGIN SOLUTION [{begin['id']}] has no hint for the student")
            open_ = (n, begin)
        elif end:
            if open_ is None:
                raise MarkerError(f"{path}:{n}: END SOLUTION without a BEGIN SOLUTION before it")
            start, m = open_
            regions.append(Region(path, m["id"], m["hint"], start, n, m["indent"], m["task"]))
            open_ = None
        elif LOOSE.search(line) and line.lstrip().startswith(("#", "<!--")):
            raise MarkerError(f"{path}:{n}: cannot parse the marker {line.strip()!r} (expected "
                              f"'{'<!-- ' if path.suffix == '.md' else '# '}BEGIN SOLUTION [id] hint' or "
                              f"'{'<!-- ' if path.suffix == '.md' else '# '}END SOLUTION')")
    if open_ is not None:
        raise MarkerError(f"{path}:{open_[0]}: BEGIN SOLUTION [{open_[1]['id']}] is never closed by END SOLUTION")
    return regions


def stub_lines(r: Region, path: Path, own: bool, stub: str = "raise") -> list[str]:
    """What a student copy holds in place of region ``r``: for the handed-out assignment (``own``) a stub with
    the region's hint (``stub="pass"``: a do-nothing body, which the tests use to check that doing nothing
    scores nothing), for any other a stub saying ``not handed out yet``; ``*(your answer)*`` in Markdown."""
    if path.suffix == ".md":
        return [f"{r.indent}*(your answer)*" if own else f"{r.indent}*({NOT_HANDED_OUT})*"]
    if own and stub == "pass":
        return [f"{r.indent}pass"]
    hint, note = (r.hint, "# your code here") if own else (NOT_HANDED_OUT, f"# assignment {r.assignment}")
    return [f"{r.indent}raise NotImplementedError({f'{r.label}: {hint}'!r})   {note}"]


def rewrite(path: str | Path, text: str | None, replace) -> str:
    """The file's text with each region's lines (markers included) replaced by ``replace(region, lines)``."""
    path = Path(path)
    text = path.read_text() if text is None else text
    lines = text.splitlines()
    out, last = [], 0
    for r in find_regions(path, text):
        out += lines[last:r.begin - 1] + replace(r, lines)
        last = r.end
    out += lines[last:]
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def strip(path: str | Path, assignment: str, text: str | None = None, stub: str = "raise") -> str:
    """The file's text with ``assignment``'s regions replaced by what a student gets (``stub_lines``; other
    regions kept, markers and all)."""
    path = Path(path)
    return rewrite(path, text, lambda r, lines: stub_lines(r, path, True, stub) if r.assignment == assignment
                   else lines[r.begin - 1:r.end])


NOT_HANDED_OUT = "not handed out yet"       # the hint of a stub a copy holds for a later assignment's region


def hand_out(path: str | Path, assignment: str, released: set[str] | frozenset[str] = frozenset(),
             text: str | None = None, stub: str = "raise") -> str:
    """The file's text as a student copy of ``assignment`` holds it, with no marker left: ``assignment``'s
    regions are stubs with their hints (as ``strip`` writes them); the regions of the ``released`` assignments
    (already due, so their solutions are no secret) keep their code without the markers; every other
    assignment's regions are stubs too, whose hint says ``not handed out yet`` (``stub_lines``)."""
    path = Path(path)

    def replace(r: Region, lines: list[str]) -> list[str]:
        if r.assignment in released and r.assignment != assignment:
            return r.body(lines)
        return stub_lines(r, path, r.assignment == assignment, stub)
    return rewrite(path, text, replace)
