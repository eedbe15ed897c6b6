"""
Checks of option values, shared by the decoder and every method: one line each at the top of a constructor
or function, and an error that names the option, says what it must be and shows what it got.

Python's ``bool`` is an ``int`` (``True == 1``), so every check below refuses booleans where it expects
numbers: ``budget=True`` is a mistake, not a budget of one.
"""

from __future__ import annotations

import math


def is_int(value) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_budget(budget: int) -> int:
    """A per-head token budget: a positive int (tokens kept per layer per KV head)."""
    if not is_int(budget):
        raise TypeError(f"budget must be an int (tokens kept per layer per KV head), got {budget!r}")
    if budget <= 0:
        raise ValueError(f"budget must be positive (tokens kept per layer per KV head), got {budget}")
    return budget


def check_int(name: str, value, low: int = 1, what: str = "", high: int | None = None) -> int:
    """An int (not a bool) >= ``low`` (and <= ``high`` if given); the error names the option."""
    if not is_int(value) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {bound}{what}, got {value!r}")
    return value


def check_number(name: str, value, low: float = -math.inf, high: float = math.inf, what: str = "",
                 open_low: bool = False, open_high: bool = False) -> float:
    """An int or float (not a bool, not NaN) from ``low`` to ``high``, ends included unless ``open_low`` /
    ``open_high`` (``high=math.inf, open_high=True``: a finite number); the error names the option."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value) \
        and (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
    if not ok:
        if high == math.inf:                         # "a number >= 1", "a finite number >= 0"
            bound = f"{'a finite number' if open_high else 'a number'} {'>' if open_low else '>='} {low:g}"
        else:
            bound = f"a number in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        raise ValueError(f"{name} must be {bound}{what}, got {value!r}")
    return value


def check_flag(name: str, value) -> bool:
    """True or False (not 0/1, not None)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value
