"""
What the assignments' tests compare against: full attention in a few lines of PyTorch, written without the
library; greedy decoding through a cache checked step by step against the uncached forward pass; the
``points`` decorator; ``assert_close``, the one comparison every test makes (shape and dtype first, then the
values, NaN and infinity included); and ``generator``, the random inputs of each test drawn from the grading
run's seed (``COURSE_SEED``). The grader copies this file next to the tests, so a student's copy of the library
can never change the oracle.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor


def points(n: float, task: str | None = None):
    """Mark a test with its points and the task it grades (the grader reads both from the source)."""
    def mark(test):
        test.points, test.task = n, task
        return test
    return mark


def mismatches(got: Tensor, want: Tensor, atol: float | Tensor = 0.0, rtol: float = 0.0) -> Tensor:
    """A bool tensor of the places where ``got`` is wrong: off ``want`` by more than ``atol + rtol * |want|``,
    or NaN / inf where ``want`` does not hold the same NaN or the same infinity (a comparison such as
    ``(got - want).abs() > tol`` is False for NaN, so it would pass a NaN answer)."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    if not (got.is_floating_point() or want.is_floating_point()):
        return got != want
    got, want = got.double(), want.double()
    special = (got.isnan() & want.isnan()) | (got.isinf() & (got == want))    # the same NaN or infinity
    close = got.isfinite() & want.isfinite() & ((got - want).abs() <= atol + rtol * want.abs())
    return ~(close | special)


def check_tensor(got, shape: tuple[int, ...], dtype: torch.dtype, what: str = "the answer") -> None:
    """``got`` is a tensor of exactly this shape and dtype, or an AssertionError saying which differs. Checked
    before any value: an answer of shape (0, *shape) broadcasts against the expected one, so a comparison of
    values alone (``torch.allclose``, ``mismatches(...).any()``) finds nothing wrong in it."""
    if not isinstance(got, Tensor):
        raise AssertionError(f"{what}: expected a tensor of shape {tuple(shape)} ({dtype}), got "
                             f"{type(got).__name__}")
    if tuple(got.shape) != tuple(shape):
        raise AssertionError(f"{what}: expected shape {tuple(shape)}, got {tuple(got.shape)}")
    if got.dtype != dtype:
        raise AssertionError(f"{what}: expected dtype {dtype}, got {got.dtype} (shape {tuple(shape)})")


def number(x) -> str:
    """One entry of a tensor, short: 0.1235, 3, True, nan, inf."""
    x = x.item() if isinstance(x, Tensor) else x
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def assert_close(got, want: Tensor, atol: float | Tensor = 0.0, rtol: float = 0.0, what: str = "the answer",
                 detail: Callable[[tuple[int, ...]], str] | None = None) -> None:
    """``got`` equals ``want`` within ``atol + rtol * |want|`` (exactly, by default: integers, booleans, values
    exact in binary), with ``want``'s shape and dtype; NaN and infinity only where ``want`` has the same
    (``mismatches``). ``atol`` may be a tensor of ``want``'s shape: each entry's own bound. Otherwise an
    AssertionError that says what was checked (``what``, the tolerance), how many places differ and the first
    one, and ``detail(index)`` of it if given (what that entry means: its query, its slot, the numbers that make
    it). Every test compares through this function, so no answer of another shape or dtype passes by
    broadcasting or by a comparison that is False for NaN."""
    want = torch.as_tensor(want)
    check_tensor(got, want.shape, want.dtype, what)
    bad = mismatches(got, want, atol, rtol)
    if bad.any():
        at = tuple(int(i) for i in bad.nonzero()[0])
        each = isinstance(atol, Tensor)
        bound = f"(each entry's own, {float(atol[at]):.3g} there)" if each else f"{atol:g}"
        tol = "exactly" if not each and atol == rtol == 0 else f"within atol {bound} + rtol {rtol:g} * |expected|"
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} entries differ (compared {tol}); the "
                             f"first at {list(at)}: got {number(got[at])}, expected {number(want[at])}"
                             + (f" ({detail(at)})" if detail else ""))


def seed(*salt) -> int:
    """The seed of one test's random inputs: the grading run's ``COURSE_SEED`` (``course.grade`` draws a fresh one
    each run unless ``--seed N``; 0 where it is not set) mixed with ``salt`` (the test's name, a case number), so
    that no two tests draw the same numbers and no copy can know the inputs before the run: a table of answers
    recorded from an earlier run's calls earns nothing on another seed."""
    run = int(os.environ.get("COURSE_SEED", "0"))
    digest = hashlib.sha256(repr((run, *salt)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2          # below 2**62: any seed torch or Python takes


def generator(*salt) -> torch.Generator:
    """A ``torch.Generator`` seeded with ``seed(*salt)``: draw every random input of a test from it."""
    return torch.Generator().manual_seed(seed(*salt))


def written(t: Tensor) -> Tensor:
    """Mark a tensor the test passes as one the student's code is graded for writing into (an output buffer, a
    sketch's cells): its writes come back into ``t``. Any other tensor a test passes keeps the test's values
    whatever the student's code does to its copy. Compute the expected values before the call, from a clone."""
    t.takes_writes = True
    return t


def reference(module: str):
    """A module of the instructor's own library (the reference solution), imported here in the test process,
    which never runs the student's code: a test runs the reference policy with the student's function in
    place of the graded one (``with patched(reference("methods.x"), f=A.adapter)``), so no reference function
    ever reaches the student's process."""
    import importlib
    import sys
    if not any((Path(p) / "course" / "oracle.py").exists() for p in sys.path[1:]):
        raise ImportError("no reference library: the hidden tests' grader has it, a student copy does not (a "
                          "public test must not use oracle.reference)")
    return importlib.import_module(module)


@contextmanager
def patched(module, **functions):
    """Within: the reference library ``module`` (a module object) calls these functions in place of its own
    (the student's, through the adapters: each call is answered by the student's process)."""
    saved = {name: getattr(module, name) for name in functions}
    try:
        for name, f in functions.items():
            setattr(module, name, f)
        yield
    finally:
        for name, f in saved.items():
            setattr(module, name, f)


def whole_copy_s(nbytes: int) -> float:
    """The CPU seconds this process takes to copy ``nbytes`` into fresh memory (the least of three): the unit in
    which the growth tests bound what the student's process spends."""
    times = []
    for _ in range(3):
        src = torch.ones(nbytes // 4)
        t0 = time.process_time()
        src.clone()
        times.append(time.process_time() - t0)
    return max(min(times), 1e-3)


def address(t: Tensor) -> int:
    """Where the student's code holds the tensor ``t`` (its ``data_ptr`` there: the tests get copies)."""
    return getattr(t, "student_address", None) or t.data_ptr()


@contextmanager
def taken_away(adapters, *names):
    """Within: the library functions ``names`` ("kernels.<file>.<function>") raise when called, so another
    implementation of the same task is graded alone (a file that does not import has nothing taken)."""
    adapters.harness("take_away", *names)
    try:
        yield
    finally:
        adapters.harness("give_back")


def full_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(d) + mask) v, the mask from positions: a query at p sees a key at s iff
    0 <= s <= p. q (B, H, Tq, d); k, v (B, H_kv, Tk, d); q_pos (Tq,); k_pos (B, H_kv, Tk) (-1: empty slot).
    GQA: query head h reads KV head h // (H // H_kv). Returns (B, H, Tq, d)."""
    B, H, Tq, d = q.shape
    G = H // k.shape[1]
    k, v, k_pos = (t.repeat_interleave(G, dim=1) for t in (k, v, k_pos))     # (B, H, Tk, ...)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)                             # (B, H, Tq, Tk)
    visible = (k_pos[:, :, None, :] <= q_pos[None, None, :, None]) & (k_pos[:, :, None, :] >= 0)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


def greedy(adapters, model, ids: Tensor, cache, n_new: int):
    """Greedy decoding through a student's cache, by the adapters' ``run_prefill`` and ``run_decode``: yields
    (logits (B, V) of the token after ``seq``, seq (B, T)) after the prefill and after each of ``n_new``
    decode steps."""
    logits = adapters.run_prefill(model, ids, cache)[:, -1]
    yield logits, ids
    for _ in range(n_new):
        token = logits.argmax(-1)
        ids = torch.cat([ids, token[:, None]], dim=1)
        logits = adapters.run_decode(model, token, cache)
        yield logits, ids


def assert_greedy_is_uncached(adapters, model, ids: Tensor, cache, n_new: int, what: str = "") -> None:
    """Every greedy step's logits through the cache equal one uncached forward pass over the sequence (the
    oracle for the cache: the uncached pass never touches it)."""
    for step, (logits, seq) in enumerate(greedy(adapters, model, ids, cache, n_new)):
        assert_close(logits, adapters.uncached_logits(model, seq)[:, -1], rtol=1e-4, atol=1e-5,
                     what=f"{what} step {step} (0 = prefill): the logits through the cache against the uncached pass")
