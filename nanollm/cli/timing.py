"""
One clock for the benchmarks: a call's wall time with the device's queued work waited for on both sides (a
GPU runs asynchronously: without the waits a time measures the launches, not the work), the median of
repeated calls, and the quartiles that give a median its spread. Every command that times a step takes its
times here (``experiments/``, ``fastpath/bench.py`` on a CPU; a GPU's kernels are timed by Triton's own
``do_bench`` there).
"""

from __future__ import annotations

import statistics
import time

import torch


def wait_for(device) -> None:
    """Wait until ``device``'s queued work has run (a CUDA device; a CPU's work is done when a call returns)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def elapsed_s(fn, device="cpu"):
    """(the seconds ``fn()`` took, what it returned), the device's queued work waited for before and after."""
    wait_for(device)
    t0 = time.perf_counter()
    out = fn()
    wait_for(device)
    return time.perf_counter() - t0, out


def median_ms(fn, repeats: int = 5, warmup: int = 1, device="cpu") -> float:
    """The median milliseconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(elapsed_s(fn, device)[0] * 1e3 for _ in range(repeats))


def quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles of ``values`` (both the value itself for a single one): the spread a
    median is drawn with."""
    if len(values) < 2:
        return (values[0], values[0])
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q1, q3)
