"""
How sure is a table's accuracy? 95% intervals (Wilson, bootstrap), and which differences are within noise.

A cell of the compare table averages a handful of answers (10 samples per task and mode by default), each
scored 0..1 by ``string_match_all``. Its mean accuracy moves with the samples drawn, so two methods 0.1
apart may be the same method seen through different luck. The bootstrap (Efron, 1979) estimates that
spread from the samples themselves: draw the samples again with replacement, recompute the mean, repeat,
and read the 2.5% and 97.5% quantiles of the recomputed means.

A row's own interval is Wilson's score interval (Wilson, 1927) for n answers with mean accuracy p. It is an
approximate interval made for right/wrong answers (Clopper-Pearson's would be exact), and conservative
for partly right ones (a 0..1 score varies
at most as much as a right/wrong one with the same mean). Unlike the bootstrap it does not collapse to a
point when every sample scored the same: 0 right out of 20 gives [0.00, 0.16], not [0, 0].

Differences between two rows use the bootstrap, with two choices that keep them honest for this table:

* *Stratified*: a row's mean accuracy is the mean over tasks of each task's mean, so each resample draws
  every task's samples from that task only (the number of samples per task stays fixed).
* *Paired*: the full cache and every method answer the very same samples, so a difference between two rows
  is resampled sample by sample (one draw picks sample j for both rows). A hard sample hurts both rows
  together; pairing removes that shared part of the noise, so paired intervals are narrower than the two
  rows' own intervals suggest.

**The noise rule** (one for the whole project: the compare tables, every notebook and the README): two rows
are *distinguishable* when the paired 95% interval of their difference excludes 0, and *within noise* when
it contains 0. ``verdict`` applies it and ``describe`` prints a difference with it; ``describe`` writes a
bound that excludes 0 with as many decimals as it takes not to print it as 0.00, so the printed interval
always agrees with the verdict printed beside it. Within noise means the two rows cannot be told apart with
these samples, which is not the same as being equal. With few samples the percentile bootstrap is on the
lenient side (a gap carried by four samples that all went one way can come out beyond noise), and a table
makes dozens of comparisons without correction, so read a lone "beyond noise" with care. The bootstrap
intervals are percentile intervals from a fixed seed: the same records always give the same intervals.
When both rows score the same on every sample the difference's interval is [0, 0]: the rows cannot be told
apart, which is what "within noise" reports.

**Methods against each other: an exact paired test.** To rank methods at one keep ratio, ``sign_test`` asks
of two rows answered on the same samples: of the samples where they differ, does one win more often than a
fair coin would let it? Samples both get right, or both wrong, say nothing about which is better; only
the n discordant samples count, and under "no difference" the k samples the first row wins follow a
Binomial(n, 1/2). The two-sided p-value sums the probabilities of every outcome at most as likely as the
one observed. With right/wrong answers this is McNemar's exact test (McNemar, 1947); with partly right
answers a sample counts for the row that scored higher on it (the paired sign test). It is exact at any
sample count, where the bootstrap is only approximate with few samples. Two rows are *distinguishable* at
p < 0.05; the compare table marks each keep ratio's best method and the methods not distinguishable from
it (``best_and_ties``). These are many tests without correction: a lone p just under 0.05 is weak evidence.
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


def best_and_ties(rows: dict[str, list[float]]) -> tuple[str, dict[str, float]]:
    """The best row (highest mean score; among equal means, the last name in alphabetical order) and, for
    every other row, the sign test's p-value against it: ``(best, {name: p})``. Rows with p >= ``ALPHA``
    are not distinguishable from the best."""
    if not rows or len({len(v) for v in rows.values()}) != 1:
        raise ValueError("best_and_ties needs rows scored on the same samples")
    best = max(rows, key=lambda k: (sum(rows[k]), k))
    return best, {k: sign_test(v, rows[best])[2] for k, v in rows.items() if k != best}


def within_noise(lo: float, hi: float) -> bool:
    """A difference whose interval contains 0 (with a hair of float slack: identical rows give [0, 0])."""
    return lo <= 1e-12 and hi >= -1e-12


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
