"""The adapters of the ``tensor_attention`` assignment: the tests' only door into your code (see
course/model_adapters.py). If you move or rename things in the library, change these functions so they reach
your code.

Each adapter imports methods/tensor_attention/attention.py when it is called (not when the tests are
collected), without running ``methods/__init__.py`` (it imports every method), so a mistake elsewhere in the
repository fails only the tasks that use it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from torch import Tensor


def library():
    """The copy's methods/tensor_attention/attention.py, imported without running ``methods/__init__.py``."""
    if "methods" not in sys.modules:
        spec = importlib.util.find_spec("methods")
        sys.modules["methods"] = importlib.util.module_from_spec(spec)      # the package, its __init__ not run
    return importlib.import_module("methods.tensor_attention.attention")


# -- tasks pair_scores, pair_softmax, factored_output --------------------------------------------------------

def scores(q: Tensor, K1: Tensor, K2: Tensor, scale: float) -> Tensor:
    """(..., Tq, n1, n2): scale * <q_t, K1[a] * K2[b]>."""
    return library().pair_scores(q, K1, K2, scale)


def softmax_over_pairs(S: Tensor, allowed: Tensor | None = None) -> Tensor:
    """(..., Tq, n1, n2): the softmax over all pairs of each query; ``allowed`` (bool, broadcast to S) masks."""
    return library().pair_softmax(S, allowed)


def output(P: Tensor, V1: Tensor, V2: Tensor) -> Tensor:
    """(..., Tq, d): sum over pairs of P[t, a, b] V1[a] * V2[b]."""
    return library().factored_output(P, V1, V2)


# -- task two_cache_append: the two-matrix cache -----------------------------------------------------------

def new_two_cache():
    """An empty two-matrix cache (one layer's storage)."""
    return library().TwoCache()


def two_cache_append(cache, k1: Tensor, k2: Tensor, v1: Tensor, v2: Tensor, pos: Tensor) -> None:
    """Store m new tokens: factors (B, H, m, d) each, positions pos (m,)."""
    cache.append(k1, k2, v1, v2, pos)


def two_cache_pairs(cache) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The stored pair rows K~, V~ (B, H, P, d) and each row's token positions (a, b), (P,) each."""
    pos_a, pos_b = cache.pair_pos()
    return cache.kt.t, cache.vt.t, pos_a, pos_b


def two_cache_attend(cache, q: Tensor, q_pos: Tensor) -> Tensor:
    """Tensor attention of queries q (B, H, Tq, d) at positions q_pos (Tq,) over the stored pairs (not your code:
    ordinary attention over the pair rows, a pair (a, b) seen by a query at p iff a, b <= p)."""
    return cache.attend(q, q_pos)
