"""
A metric of one's own: ``MODULE:FUNCTION``, a function ``fn(prediction, answers) -> number`` imported from the
folder the command runs in, for ``rescore --metric`` and ``experiments.compare --metric``; its contract is in
experiments/evaluation/README.md. ``answer_metric`` imports it and tries it on one answer, so a wrong name or
a function that breaks the contract is one line before any work.
"""

from __future__ import annotations

import math

from nanollm import cli


def answer_metric(spec: str):
    """The function ``spec`` (``MODULE:FUNCTION``) names, checked: a ValueError in one line otherwise."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{spec!r}: a metric of your own is MODULE:FUNCTION")
    try:
        fn = cli.imported(module, name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{spec!r}: cannot import it ({e})") from None
    try:
        value = fn(" Paris", ["Paris"])
    except Exception as e:                          # the user's code: any error, in one line
        raise ValueError(f"{spec!r}: fn(' Paris', ['Paris']) raised {type(e).__name__}: {e}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{spec!r}: fn(' Paris', ['Paris']) returned {str(value)[:40]!r}, not a finite number")
    return fn


def score_records(records: list[dict], spec: str, fn) -> None:
    """Each record's answers scored by ``fn``: its mean under ``spec`` and each sample's under ``spec_each``."""
    for r in records:
        values = [float(fn(p, list(refs))) for p, refs in zip(r["predictions"], r["references"])]
        r[spec], r[f"{spec}_each"] = sum(values) / len(values), values
