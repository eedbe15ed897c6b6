"""
Triton kernels for the memory-bound path of decoding, each beside the PyTorch reference it must match.

    decode_attention.py   one query token per sequence over a KV cache (GQA), split along the sequence:
                          over a contiguous cache, and over per-head selected indices (gathered in-kernel)
    count_sketch.py       KVReviver's count sketch: insert, query (median of rows), and a fused
                          rebuild-then-attend that never writes the rebuilt keys and values
    tensor_decode.py      factored tensor-attention decode over a four-matrix cache: pairs scored in tiles
                          with an online softmax, no i x i score matrix, no Kronecker product
    bench.py              ``python -m kernels.bench``: kernel vs reference (vs SDPA), bytes/s, JSON

The switch. Every public function takes the Triton path when ``use_triton(tensor)`` says so and the
PyTorch reference otherwise, so nothing in the library needs Triton (it is optional at run time):

* on a CUDA tensor, when Triton is importable;
* on a CPU tensor only under ``TRITON_INTERPRET=1`` (Triton's interpreter: slow and exact, how the tests
  check the kernels on a machine without a GPU; ``tests/conftest.py`` sets it there);
* never when ``NANOKV_NO_TRITON=1`` (to compare or debug).

Each kernel file follows the Triton tutorials: the reference, the ``@triton.jit`` kernel, the launcher
(``*_triton``: always the kernel), the dispatcher, and tests in ``tests/test_kernels_*.py``.
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:            # macOS, or a minimal install: the references serve everything
    HAS_TRITON = False


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton path serves a call on tensor ``t`` (see the module docstring)."""
    if not HAS_TRITON or os.environ.get("NANOKV_NO_TRITON") == "1":
        return False
    return t.is_cuda or (t.device.type == "cpu" and interpreting())


def serves(t: torch.Tensor) -> bool:
    """Whether the library's own hot paths take a kernel for tensor ``t``: the decode step of
    ``nanollm.attention.attend_step``, a tensor-attention decode step over the four-matrix cache
    (``methods/tensor_attention.py``), KVReviver's sketch insert and query (``methods/kvreviver.py``).
    Only on CUDA: the interpreter is for the kernel tests, far too slow for a model (the tests patch this
    function to route those paths through it)."""
    # sm_80 or newer: the kernels load bf16 and use tl.dot shapes older GPUs do not compile
    return t.is_cuda and use_triton(t) and _properties(t.device.index)[0] >= 8


# ----------------------------------------------------------------------------------------------------------
# Small pieces the three kernel files share


@functools.cache
def _properties(index: int | None) -> tuple[int, int]:
    """(compute capability major, streaming multiprocessors) of a CUDA device, read once: the hot paths
    ask at every layer of every decode step."""
    props = torch.cuda.get_device_properties(index)
    return props.major, props.multi_processor_count


def sm_count(t: torch.Tensor) -> int:
    """Streaming multiprocessors of the GPU holding ``t``: how many programs a launch needs to fill it."""
    return _properties(t.device.index)[1]


def fill_splits(t: torch.Tensor, rows: int) -> int:
    """Ranges per row (per (sequence, KV head)) that give every SM of the GPU holding ``t`` two programs;
    one in the interpreter, which runs programs one after another. ``split_ranges`` then keeps every range
    at least one block long. (On an H100, 1 to 16 programs per SM land within a few percent of each other
    once the products go through tl.dot.)"""
    programs = 2 * sm_count(t) if t.is_cuda else 1
    return -(-programs // rows)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): Triton blocks are powers of two. Plain Python, so
    callers that only size things (``tensor_decode.peak_memory_bytes``) need no Triton."""
    return 1 << max(0, int(x) - 1).bit_length()


def split_ranges(n_units: int, splits: int) -> tuple[int, int]:
    """Cut ``n_units`` (blocks, tiles) into at most ``splits`` ranges of equal length, none empty:
    (units per range, number of ranges)."""
    per = -(-n_units // max(1, min(splits, n_units)))
    return per, -(-n_units // per)


def default_scale(scale: float | None, d: int) -> float:
    """The attention scale: 1 / sqrt(d) unless given."""
    return 1.0 / math.sqrt(d) if scale is None else float(scale)
