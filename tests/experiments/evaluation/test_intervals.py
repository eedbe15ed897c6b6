"""95% intervals of the compare table: Wilson for a row, the paired stratified bootstrap for a difference, and
the exact paired test (McNemar) between methods."""

from __future__ import annotations

import random

import pytest
import torch

from experiments.evaluation.intervals import (
    best_and_ties,
    bootstrap_means,
    interval,
    paired_difference,
    sign_test,
    wilson,
    within_noise,
)
from experiments.evaluation.report import format_intervals, format_pairwise, format_tables, pairwise


def test_wilson_known_values():
    assert wilson(0.0, 20) == pytest.approx((0.0, 0.1611), abs=1e-4)        # 0 of 20 is not certainty
    assert wilson(0.5, 20) == pytest.approx((0.2993, 0.7007), abs=1e-4)
    assert wilson(1.0, 10)[0] == pytest.approx(0.7225, abs=1e-4)
    with pytest.raises(ValueError):
        wilson(0.5, 0)


def test_wilson_covers_the_true_proportion_95_percent_of_the_time():
    rng, p, n = random.Random(0), 0.7, 30
    hits = 0
    for _ in range(2000):
        lo, hi = wilson(sum(rng.random() < p for _ in range(n)) / n, n)
        hits += lo <= p <= hi
    assert 0.92 <= hits / 2000 <= 0.98


def test_bootstrap_is_deterministic_stratified_and_centred():
    groups = [[0.0, 1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]          # task 2 always right: only task 1 varies
    a, b = bootstrap_means(groups), bootstrap_means(groups)
    assert torch.equal(a, b)
    assert a.min() >= 0.5 and a.max() <= 1.0                          # (0 + 1) / 2 .. (1 + 1) / 2
    assert a.mean().item() == pytest.approx((0.6 + 1.0) / 2, abs=0.01)
    lo, hi = interval(groups)
    assert lo < 0.8 < hi
    with pytest.raises(ValueError):
        bootstrap_means([[1.0], []])


def test_paired_difference_sees_what_the_rows_own_intervals_hide():
    rng = random.Random(1)
    hard = [[rng.random() for _ in range(10)] for _ in range(2)]       # a per-sample difficulty both rows share
    better = [[min(1.0, x + 0.05) for x in g] for g in hard]
    d, lo, hi = paired_difference(better, hard)
    assert 0 < lo <= d <= hi                                           # small, consistent: not within noise
    assert not within_noise(lo, hi)
    assert within_noise(*paired_difference(hard, hard)[1:])            # identical rows: [0, 0]
    shuffled = [g[::-1] for g in hard]                                 # same scores, unrelated samples
    assert within_noise(*paired_difference(shuffled, hard)[1:])
    with pytest.raises(ValueError):
        paired_difference([[1.0]], [[1.0, 0.0]])


def test_format_intervals_names_the_ties():
    def rec(method, keep, task, accs):
        return {"method": method, "keep_ratio": keep, "task": task, "mode": "question_in_prompt",
                "accuracies": accs}
    ones, zeros = [1.0] * 10, [0.0] * 10
    mixed = [1.0, 0.0] * 5
    records = [rec("full", 1.0, t, ones) for t in ("passkey", "niah_single_docs")] + \
        [rec("a", 0.5, t, ones) for t in ("passkey", "niah_single_docs")] + \
        [rec("b", 0.5, t, ones[:9] + zeros[:1]) for t in ("passkey", "niah_single_docs")] + \
        [rec("c", 0.5, t, mixed) for t in ("passkey", "niah_single_docs")]
    text = format_intervals(records)
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln and ln.split()[0] in "abc"}
    assert "within noise" in lines["a"] and lines["a"].split()[2] == "1.00"
    assert lines["c"].endswith("lower")
    assert "keep 0.50: best a (1.00); not distinguishable from it (exact paired test, p >= 0.05): b (p=0.50)" in text
    table = format_tables([dict(r, budget=None if r["method"] == "full" else 10, length=20, accuracy=sum(
        r["accuracies"]) / 10, kl=0.0, perturbation=0.0, lost_mass=0.0, kv_bytes=0, decode_ms_per_token=0.0)
        for r in records])
    marks = {ln.split()[0]: ln.split("  ")[-1].strip() for ln in table.splitlines() if ln and ln.split()[0] in "abc"}
    assert marks == {"a": "best", "b": "tie p=0.50", "c": "p=2e-03"}      # b loses 2 of 20 samples to a, c 10


def test_the_noise_rule_is_one_helper_whose_printed_interval_agrees_with_its_verdict():
    from experiments.evaluation.intervals import describe, signed, verdict
    assert verdict(0.0, 0.30) == "within noise"                  # a bound at 0 does not exclude 0
    assert verdict(0.004, 0.02) == "higher" and verdict(-0.3, -0.01) == "lower"
    assert verdict(0.0, 0.0) == "within noise"                   # identical rows
    assert describe(0.01, 0.004, 0.02) == "+0.01 [+0.004, +0.02] higher"     # never "[+0.00, +0.02] higher"
    assert describe(0.1, 0.0, 0.3) == "+0.10 [+0.00, +0.30] within noise"
    assert signed(-0.00004) == "-0.00004" and signed(0.0) == "+0.00" and signed(1.234, 1) == "+1.2"
    with pytest.raises(ValueError):
        verdict(0.2, 0.1)
    # the rule on a real paired difference: a gap carried by every sample excludes 0, a coin flip does not
    a, b = [[1.0] * 10], [[0.0] * 10]
    assert verdict(*paired_difference(a, b)[1:]) == "higher"
    assert verdict(*paired_difference([[1.0, 0.0] * 5], [[0.0, 1.0] * 5])[1:]) == "within noise"


def test_sign_test_is_mcnemars_exact_test():
    """Known values (two-sided, Binomial(n, 1/2) over the discordant samples), concordant samples ignored,
    symmetric, partial scores counted by which row scored higher."""
    assert sign_test([1] * 10, [0] * 10) == (10, 0, pytest.approx(2 / 1024))
    assert sign_test([1] * 7 + [0], [0] * 7 + [1])[2] == pytest.approx(2 * 9 / 256)     # 7:1 -> 0.0703
    assert sign_test([1] * 7 + [0] + [1] * 20, [0] * 7 + [1] + [1] * 20)[2] == pytest.approx(2 * 9 / 256)
    assert sign_test([1, 0] * 5, [0, 1] * 5) == (5, 5, 1.0)
    assert sign_test([1.0, 1.0], [1.0, 1.0]) == (0, 0, 1.0)                      # nothing tells them apart
    assert sign_test([0.5, 0.2, 1.0], [0.25, 0.2, 0.0]) == (2, 0, 0.5)
    a, b = [1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1, 0], [0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0]
    assert sign_test(a, b)[2] == sign_test(b, a)[2] == pytest.approx(2 * (1 + 8) / 2 ** 8, rel=1e-12)   # 7:1
    with pytest.raises(ValueError):
        sign_test([1], [1, 0])


def test_the_exact_test_rejects_at_its_level():
    """Two rows answering right with the same probability, independently per sample: the test calls them
    distinguishable at most 5% of the time (it is exact, so conservative); one clearly better row is found."""
    rng = random.Random(0)
    trials, rejected = 1000, 0
    for _ in range(trials):
        a = [float(rng.random() < 0.6) for _ in range(30)]
        b = [float(rng.random() < 0.6) for _ in range(30)]
        rejected += sign_test(a, b)[2] < 0.05
    assert rejected / trials <= 0.05
    better = [float(rng.random() < 0.9) for _ in range(60)]
    worse = [x if rng.random() < 0.5 else 0.0 for x in better]
    assert sign_test(better, worse)[2] < 0.05


def test_p_values_print_on_the_right_side_of_the_level():
    from experiments.evaluation.report import p_value
    assert [p_value(p) for p in (1.0, 0.12, 0.0703125, 0.0499, 0.05, 0.00996, 0.0005)] == \
        ["1.00", "0.12", "0.07", "<0.05", "0.05", "1e-02", "5e-04"]


def test_best_and_ties_and_the_pairwise_matrix():
    rows = {"a": [1.0] * 10, "b": [1.0] * 9 + [0.0], "c": [1.0, 0.0] * 5}
    best, p = best_and_ties(rows)
    assert best == "a" and p["b"] == 1.0 and p["c"] == pytest.approx(2 / 32)
    with pytest.raises(ValueError):
        best_and_ties({"a": [1.0], "b": [1.0, 0.0]})

    def rec(method, keep, task, accs):
        return {"method": method, "keep_ratio": keep, "task": task, "mode": "question_in_prompt", "accuracies": accs}
    records = [rec(m, 0.5, t, v[:5] if t == "passkey" else v[5:]) for m, v in rows.items()
               for t in ("passkey", "niah_single_docs")] + [rec("full", 1.0, t, [1.0] * 5) for t in ("passkey",
                                                                                                   "niah_single_docs")]
    tests = {(t["a"], t["b"]): t for t in pairwise(records)}
    assert set(tests) == {("a", "b"), ("a", "c"), ("b", "c")}                     # every pair once, no full cache
    assert (tests[("a", "c")]["wins_a"], tests[("a", "c")]["wins_b"], tests[("a", "c")]["n"]) == (5, 0, 10)
    text = format_pairwise(records)
    assert "keep 0.50: exact paired tests over 10 answers" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("c "))
    assert line.split()[1:] == ["0:5", "0.06", "0:4", "0.12", "-"]              # c against a, b, itself
