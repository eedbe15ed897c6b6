"""
How sure is a table's accuracy? 95% intervals (Wilson, bootstrap), and which differences are within noise.

    wilson               a row's own interval (Wilson, 1927)
    paired_difference    a difference's interval: a paired, stratified bootstrap (Efron, 1979)
    verdict, describe    the noise rule: distinguishable when that interval excludes 0
    sign_test            the exact paired test between two rows (McNemar's, for right/wrong answers)
    best_and_ties        a keep ratio's best method and those the test cannot tell from it

The reasoning behind each, and how to read them: ``inside.md``, "intervals.py".
"""

from __future__ import annotations

import math

import torch

N_RESAMPLES = 2000
ALPHA = 0.05                # the exact paired test's level: distinguishable when p < ALPHA


def bootstrap_means(groups: list[list[float]], n_resamples: int = N_RESAMPLES, seed: int = 0) -> torch.Tensor:
    """(n_resamples,) means over groups of each group's resampled mean. ``groups``: per task, the per-sample
    scores (a difference of two rows when paired). Group sizes may differ; every group needs a sample."""
    if not groups or any(len(g) == 0 for g in groups):
        raise ValueError("bootstrap_means needs at least one group and one sample per group")
    gen = torch.Generator().manual_seed(seed)
    means = torch.zeros(n_resamples, dtype=torch.float64)
    for g in groups:                                              # stratified: each task from its own samples
        x = torch.tensor(g, dtype=torch.float64)                  # (n,)
        draw = torch.randint(len(g), (n_resamples, len(g)), generator=gen)    # (R, n) indices with replacement
        means += x[draw].mean(dim=1)
    return means / len(groups)


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% score interval for a proportion ``p`` observed over ``n`` answers."""
    if n <= 0 or not 0 <= p <= 1:
        raise ValueError(f"wilson needs n > 0 and p in [0, 1], got p={p}, n={n}")
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5
    return max(0.0, centre - half), min(1.0, centre + half)


def interval(groups: list[list[float]], level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean over groups of each group's mean."""
    means = bootstrap_means(groups, seed=seed)
    tail = (1 - level) / 2
    lo, hi = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return lo, hi


def paired_difference(a: list[list[float]], b: list[list[float]], level: float = 0.95,
                      seed: int = 0) -> tuple[float, float, float]:
    """(mean of a - b, low, high): the paired difference of two rows scored on the same samples, in the
    same order per group."""
    if [len(g) for g in a] != [len(g) for g in b]:
        raise ValueError("paired_difference needs the same samples in both rows")
    diff = [[x - y for x, y in zip(ga, gb)] for ga, gb in zip(a, b)]
    lo, hi = interval(diff, level, seed)
    return sum(sum(g) / len(g) for g in diff) / len(diff), lo, hi


def sign_test(a: list[float], b: list[float]) -> tuple[int, int, float]:
    """(wins of a, wins of b, two-sided exact p-value): McNemar's exact test of two rows' scores on the same
    samples in the same order (the paired sign test when scores are partial). p is 1 when no sample
    tells them apart."""
    if len(a) != len(b):
        raise ValueError(f"sign_test needs the same samples in both rows, got {len(a)} and {len(b)} scores")
    wins_a = sum(x > y for x, y in zip(a, b))
    wins_b = sum(x < y for x, y in zip(a, b))
    n = wins_a + wins_b
    probs = [math.comb(n, k) / 2 ** n for k in range(n + 1)]                 # Binomial(n, 1/2)
    p = sum(q for q in probs if q <= probs[wins_a] * (1 + 1e-9))          # outcomes no likelier than observed
    return wins_a, wins_b, min(1.0, p)


def best_and_ties(rows: dict[str, list[float]], spelled: dict[str, str] | None = None) -> tuple[str, dict[str, float]]:
    """The best row (highest mean score; among equal means, the last name in alphabetical order, as ``spelled``
    writes it where a report shows a shorter one) and, for every other row, the sign test's p-value against it:
    ``(best, {name: p})``. Rows with p >= ``ALPHA`` are not distinguishable from the best."""
    if not rows or len({len(v) for v in rows.values()}) != 1:
        raise ValueError("best_and_ties needs rows scored on the same samples")
    spelled = spelled or {}
    best = max(rows, key=lambda k: (sum(rows[k]), spelled.get(k, k)))
    return best, {k: sign_test(v, rows[best])[2] for k, v in rows.items() if k != best}


def within_noise(lo: float, hi: float) -> bool:
    """A difference whose interval contains 0 (with a hair of float slack: identical rows give [0, 0])."""
    return lo <= 1e-12 and hi >= -1e-12


# Fewer paired answers than this in a task, and the compare report prints a difference's bootstrap interval
# without a verdict: resampling a handful of answers (each task's apart) gives an interval that only looks
# sure (two answers both lost give [-1.00, -1.00]). The exact paired test (``sign_test``) has no such floor;
# ``verdict`` and ``describe``, which the notebooks call on the intervals they print, have none either.
MIN_PAIRED = 10


def verdict(lo: float, hi: float) -> str:
    """The noise rule: "within noise" when the 95% interval [lo, hi] of a difference a - b contains 0, else
    "higher" (a above b) or "lower" (a below b)."""
    if lo > hi:
        raise ValueError(f"an interval needs lo <= hi, got [{lo}, {hi}]")
    return "within noise" if within_noise(lo, hi) else ("higher" if lo > 0 else "lower")


def signed(x: float, decimals: int = 2) -> str:
    """``x`` with a sign and ``decimals`` decimals, or more (up to 6) where those would print a non-zero
    number as 0: ``signed(0.004)`` is "+0.004", not "+0.00"."""
    while decimals < 6 and abs(x) > 1e-12 and round(abs(x), decimals) == 0:
        decimals += 1
    return f"{x:+.{decimals}f}"


def describe(d: float, lo: float, hi: float, decimals: int = 2) -> str:
    """A difference, its 95% interval and the noise rule's verdict in one phrase:
    "+0.10 [+0.004, +0.20] higher", "-0.05 [-0.15, +0.05] within noise"."""
    return f"{signed(d, decimals)} [{signed(lo, decimals)}, {signed(hi, decimals)}] {verdict(lo, hi)}"
