"""The benchmarks' one clock (``nanollm/cli/timing.py``): a call's time and result, the median after the
warm-up calls, and the quartiles of a median's spread."""

from __future__ import annotations

import time

from nanollm.cli import timing


def test_elapsed_is_the_call_s_time_and_result():
    seconds, out = timing.elapsed_s(lambda: (time.sleep(0.02), 7)[1])
    assert out == 7 and 0.02 <= seconds < 1


def test_the_median_leaves_the_warm_up_untimed():
    calls = []

    def slow_first():
        calls.append(None)
        time.sleep(0.2 if len(calls) == 1 else 0.001)
    assert timing.median_ms(slow_first, repeats=3, warmup=1) < 100 and len(calls) == 4


def test_quartiles():
    assert timing.quartiles([3.0]) == (3.0, 3.0)
    assert timing.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0)
