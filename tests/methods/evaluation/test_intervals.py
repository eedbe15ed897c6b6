"""95% intervals of the compare table: Wilson for a row, the paired stratified bootstrap for a difference."""

from __future__ import annotations

import random

import pytest
import torch

from methods.evaluation.compare import format_intervals
from methods.evaluation.intervals import bootstrap_means, interval, paired_difference, wilson, within_noise


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
    assert "keep 0.50: best a (1.00); within noise of it: b" in text


def test_the_noise_rule_is_one_helper_whose_printed_interval_agrees_with_its_verdict():
    from methods.evaluation.intervals import describe, signed, verdict
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
