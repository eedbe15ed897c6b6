"""The adapters of the ``kvreviver`` assignment: the tests' only door into your code (see
course/model_adapters.py). If you move or rename things in the library, change these functions so they reach
your code.

Each adapter imports the library module it needs when it is called, so a file of yours that fails to import
fails only the tasks that use it. Each task has three implementations: the sketch's method in
methods/kvreviver_sketch.py (``VagueSketch``), the plain function of kernels/count_sketch.py (``reference_*``) and its
Triton kernel (``_sketch_insert_kernel``, ``_sketch_query_kernel``), which needs no adapter: the grader launches
your ``@triton.jit`` functions itself, with its own grids and buffers (course/launchers.py, in Triton's CPU
interpreter), so keep their names and arguments as they are.
"""

from __future__ import annotations

import importlib

from torch import Tensor


def kvreviver_sketch():
    return importlib.import_module("methods.kvreviver_sketch")


def count_sketch():
    return importlib.import_module("kernels.count_sketch")


# -- the sketch's method (methods/kvreviver_sketch.py) ----------------------------------------------------------

def new_sketch(rows: int, width: int, n_kv_head: int, head_dim: int, seed: int = 0, injective: bool = False):
    """An empty count sketch (``VagueSketch``): ``rows`` rows of ``width`` cells, each cell a key and a value
    (n_kv_head, d); its hashes' coefficients drawn from ``seed``."""
    return kvreviver_sketch().VagueSketch(rows, width, n_kv_head, head_dim, seed, injective)


def hashes(sketch, pos: Tensor) -> tuple[Tensor, Tensor]:
    """(cells h_i(J), signs g_i(J)), both (rows, n), of positions pos (n,) (given code, not a task)."""
    return sketch.buckets(pos), sketch.signs(pos)


def cells(sketch) -> tuple[Tensor, Tensor]:
    """The sketch's key and value cells, (rows, width, n_kv_head, d) each (the tensors themselves: writing
    into them changes the sketch)."""
    return sketch.key, sketch.value


def insert(sketch, pos: Tensor, k: Tensor, v: Tensor) -> None:
    """Add tokens at positions pos (n,) with k, v (n, n_kv_head, d)."""
    sketch.insert(pos, k, v)


def delete(sketch, pos: Tensor, k: Tensor, v: Tensor) -> None:
    """Subtract tokens that were added (given code: an insert of -k, -v)."""
    sketch.delete(pos, k, v)


def query(sketch, pos: Tensor) -> tuple[Tensor, Tensor]:
    """Estimates of k and v, (n, n_kv_head, d) each."""
    return sketch.query(pos)


# -- the plain functions (kernels/count_sketch.py) ---------------------------------------------------------

def reference_insert(key: Tensor, value: Tensor, cells: Tensor, signs: Tensor, k: Tensor, v: Tensor) -> None:
    """Add n tokens k, v (n, H_kv, d) into key, value (r, b, H_kv, d) in place, at cells (r, n) with signs."""
    count_sketch().reference_sketch_insert(key, value, cells, signs, k, v)


def reference_query(key: Tensor, value: Tensor, cells: Tensor, signs: Tensor) -> tuple[Tensor, Tensor]:
    """Estimates (n, H_kv, d) of the tokens at cells (r, n) with signs (r, n)."""
    return count_sketch().reference_sketch_query(key, value, cells, signs)

