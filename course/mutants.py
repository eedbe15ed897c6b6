"""
Mutation testing of the graded tests: does each task's grade fall when its code is plausibly wrong?

    python -m course.mutants baselines            # every mutant of one assignment
    python -m course.mutants all --out results/course_mutants.txt

A mutant is one plausible student mistake written into one solution region of the reference: an
off-by-one, a sum for a mean, a dropped sign, a mis-ordered GQA grouping, a call to a shipped function that
already computes the answer. Two sources:

* the catalogue (``catalogue``): operators applied mechanically to every site of every graded region;
* each assignment's hand-written mutants, ``MUTANTS`` in ``course/<name>/mutants.py`` (instructor-only, like
  ``test_hidden.py``: not in a student copy), for the mistakes the catalogue cannot write.

A mutant is *killed* when the task whose region it changes loses at least half of that task's points.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    """One mistake in one region: in the region of ``task`` (``[assignment:task]``), the text ``old`` (exactly
    once in the region's body) becomes ``new``; with ``old=None`` ``new`` replaces the whole body (written
    without indentation: it is indented to the region's)."""
    name: str            # what the mistake is, in a few words ("H2O's GQA groups as view(B, G, H_kv, T)")
    task: str            # the graded task whose region it changes
    new: str
    old: str | None = None
    source: str = "hand"     # "hand", or the catalogue operator that wrote it
