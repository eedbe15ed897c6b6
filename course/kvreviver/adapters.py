"""The adapters of the ``kvreviver`` assignment, the functions its tests call: see course/model_adapters.py."""

from __future__ import annotations

from torch import Tensor

from course.model_adapters import (  # noqa: F401  (re-exported for the tests)
    kept_positions,
    new_cache,
    run_decode,
    run_prefill,
    tiny_model,
    uncached_logits,
)
from methods.kvreviver import VagueSketch


def new_sketch(rows: int, width: int, n_kv_head: int, head_dim: int, seed: int = 0,
               injective: bool = False) -> VagueSketch:
    """An empty count sketch: ``rows`` rows of ``width`` cells, each cell a key and a value (n_kv_head, d)."""
    return VagueSketch(rows, width, n_kv_head, head_dim, seed, injective)


def hashes(sketch: VagueSketch, pos: Tensor) -> tuple[Tensor, Tensor]:
    """(cells h_i(J), signs g_i(J)), both (rows, n), of positions pos (n,)."""
    return sketch.buckets(pos), sketch.signs(pos)


def cells(sketch: VagueSketch) -> tuple[Tensor, Tensor]:
    """The sketch's key and value cells, (rows, width, n_kv_head, d) each."""
    return sketch.key, sketch.value


def insert(sketch: VagueSketch, pos: Tensor, k: Tensor, v: Tensor) -> None:
    """Add tokens at positions pos (n,) with k, v (n, n_kv_head, d)."""
    sketch.insert(pos, k, v)


def delete(sketch: VagueSketch, pos: Tensor, k: Tensor, v: Tensor) -> None:
    sketch.delete(pos, k, v)


def query(sketch: VagueSketch, pos: Tensor) -> tuple[Tensor, Tensor]:
    """Estimates of k and v, (n, n_kv_head, d) each."""
    return sketch.query(pos)
