"""
What the notebooks' and the Markdown pages' number checks share: the numbers a sentence states, and the text
of a committed notebook they may be quoted from.

A *stated number* is a decimal, a percentage or an integer in a sentence of prose. Not stated: numbers that
name something (sections, equations, tables, figures, algorithms, theorems, cells, years, arXiv ids),
headings, numbers in math, code spans or links, and numbers in a sentence that quotes a source ("the paper
reports ...", "its data sheet").
"""

from __future__ import annotations

import re


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


QUOTED = re.compile(r"(?<![\w.§$/^+-])-?\d(?:[\d,]*\d)?(?:\.\d+)?%?(?![\w])")
NAMING = re.compile(r"(?:§|\b(?:sections?|eqs?\.|equations?|tables?|figures?|figs?\.|algorithms?|theorems?|"
                    r"lemmas?|remarks?|assumptions?|corollar(?:y|ies)|appendix|app\.|definitions?|def\.|cells?|arxiv:?|exercises?|steps?|"
                    r"notebooks?|lessons?|labs?))\s*$",
                    re.I)
SKIP = [re.compile(p, re.S) for p in (r"\$\$.*?\$\$", r"\$[^$\n]+\$", r"`[^`]*`", r"\]\([^)]*\)", r"https?://\S+")]



def sentences(markdown: str) -> list[str]:
    """A markdown cell's sentences about a run: headings, math, code spans, links and sentences that quote a
    source dropped."""
    markdown = "\n".join(re.sub(r"^\s*\d+\.\s", " ", line) for line in markdown.splitlines()
                         if not line.startswith("#"))              # headings, and list items' numbers
    for pattern in SKIP:
        markdown = pattern.sub(" ", markdown)
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(*])|\n\n|\n(?=\|)|(?<=\|)\n", markdown)   # a table row: one
            if not re.search(r"\b(?:the paper|paper's|papers'|the authors|et al|data ?sheet)", s, re.I)]


def sentence_numbers(sentence: str) -> list[str]:
    """The numbers a sentence states (a decimal, a percentage or an integer), less those that name something."""
    found = []
    for m in QUOTED.finditer(sentence):
        number = m.group().rstrip("%").replace(",", "")
        if re.match(r"[-–]\d+(?:\.\d+)?%", sentence[m.end():]) and not m.group().endswith("%"):
            number += "%"                                 # "83-84%": a range of percentages
        if number.rstrip(".") in ("", "-") or re.fullmatch(r"(19|20)\d\d", number):
            continue                                      # a year
        head = sentence[:m.start()]
        while (shorter := re.sub(r"\d[\d.]*\s*(?:,|and|or|-|–|to)\s*$", "", head)) != head:
            head = shorter                                # "sections 6.1 and 6.2": the cue before the list
        if NAMING.search(head):
            continue                                      # "§6.3", "section 2.3", "Table 2", "arXiv 2306.14048"
        found.append(m.group() if not number.endswith("%") or m.group().endswith("%") else m.group() + "%")
    return found


def prose_numbers(markdown: str) -> list[str]:
    """The numbers a markdown cell states about a run (see the module's docstring for what is skipped)."""
    return [n for sentence in sentences(markdown) for n in sentence_numbers(sentence)]


def in_text(number: str, text: str) -> bool:
    """``number`` as the prose writes it (0.92, 1,024, 70.5%) is printed or set somewhere in ``text``: as
    written (1,024 also as 1024), a percentage as a percentage (70.5% or 70.5 %)."""
    plain = number.rstrip("%").replace(",", "")
    forms = {plain, number.rstrip("%")}
    end = r"\s?%" if number.endswith("%") else r"(?![\d])"
    return any(re.search(rf"(?<![\d.])(?<![eE][-+])(?<![eE]){re.escape(f)}{end}", text)   # not 1e-6's exponent
               for f in forms)
