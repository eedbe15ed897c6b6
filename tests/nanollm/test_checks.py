"""The shared option checks (nanollm/checks.py): what passes, and a one-line error naming the option."""

from __future__ import annotations

import math

import pytest

from nanollm.checks import check_budget, check_flag, check_int, check_number


def test_budget():
    assert check_budget(3) == 3
    with pytest.raises(TypeError, match="budget must be an int"):
        check_budget(True)                                   # a bool is not a budget of one
    with pytest.raises(ValueError, match="budget must be positive"):
        check_budget(0)


def test_int():
    assert check_int("window", 1) == 1 and check_int("n", 0, low=0) == 0 and check_int("n", 4, 0, high=4) == 4
    for bad in (0, 2.0, True, None, "3"):
        with pytest.raises(ValueError, match=r"window must be an int >= 1 \(observation window\), got"):
            check_int("window", bad, what=" (observation window)")
    with pytest.raises(ValueError, match=r"n_recent must be an int in \[0, 4\], got 5"):
        check_int("n_recent", 5, 0, high=4)


def test_number():
    assert check_number("alpha", 0.0, 0, 1) == 0.0 and check_number("alpha", 1, 0, 1) == 1
    for bad in (-0.1, 1.5, math.nan, True, "0.5", None):
        with pytest.raises(ValueError, match=r"alpha must be a number in \[0, 1\], got"):
            check_number("alpha", bad, 0, 1)
    with pytest.raises(ValueError, match=r"threshold must be a number in \(0, 1\], got 0"):
        check_number("threshold", 0, 0, 1, open_low=True)
    with pytest.raises(ValueError, match="replace_rate must be a number >= 1, got 0.5"):
        check_number("replace_rate", 0.5, 1)
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0, got inf"):
        check_number("epsilon", math.inf, 0, math.inf, open_high=True)


def test_flag():
    assert check_flag("per_head", False) is False
    for bad in (0, 1, None, "yes"):
        with pytest.raises(ValueError, match="per_head must be True or False"):
            check_flag("per_head", bad)
