"""The adapters of the ``kernels`` assignment: the tests' only door into your Python code (see
course/model_adapters.py). If you move or rename things in the library, change these functions so they reach
your code.

Each adapter imports the library module it needs when it is called, so a file of yours that fails to import
fails only the tasks that use it. The online softmax lives in two kernels (kernels/decode_attention.py, and
the fused sketch attention of kernels/count_sketch.py, in base 2); the merge of the ranges in four places
(``merge_splits`` in PyTorch, and the merge kernels of decode_attention.py, count_sketch.py and
tensor_decode.py). The kernels need no adapter: the grader launches your ``@triton.jit`` functions itself,
with its own grids and buffers (course/launchers.py), so keep their names and arguments as they are.
"""

from __future__ import annotations

import importlib

from torch import Tensor


def module(name: str):
    return importlib.import_module(f"kernels.{name}")


# -- task merge_splits ----------------------------------------------------------------------------------------

def merge(m: Tensor, l: Tensor, acc: Tensor) -> Tensor:
    """``merge_splits`` (PyTorch): m, l (R, splits, G), acc (R, splits, G, d) -> (R, G, d)."""
    return module("decode_attention").merge_splits(m, l, acc)
