"""
Triton kernels for the memory-bound path of decoding, each beside the PyTorch reference it must match.

Each file is a leaf: the PyTorch reference (``reference_*``, any device), the ``@triton.jit`` kernel, and the
launcher (``*_triton``, always the kernel: on a CUDA tensor, or on a CPU one under ``TRITON_INTERPRET=1``).
The files decide nothing; ``tests/kernels/`` compares each launcher with its reference.

The reading path (``nanollm/``) never calls a kernel. The fast paths (``fastpath/attention.py``, ``sketch.py``,
``fused.py``, ``skinny.py``, ``tensor.py``) take one where ``serves(tensor)`` is true: a CUDA tensor of an
sm_80 or newer GPU, Triton importable, and ``NANOKV_NO_TRITON`` not set to 1; never a CPU tensor.

What each file computes, and how: kernels/inside.md, section "__init__.py".
"""

from __future__ import annotations

import functools
import math
import os
import re

import torch

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:            # macOS, or a minimal install: the library runs its own PyTorch
    HAS_TRITON = False


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def major_minor(version: str) -> tuple[int, int] | None:
    """"3.6.0+git1234" -> (3, 6); None where the version does not start with two numbers ("dev")."""
    m = re.match(r"v?(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else None


def interpreter_problem(triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """Why Triton's CPU interpreter cannot run these kernels here, in one line, or None where it can, or where
    Triton or numpy is missing, or a version does not say (the installed versions, unless given). Triton before
    3.7 takes a loop's bound as an int in a way numpy 2.4 refuses (triton-lang/triton#9171, fixed in 3.7), so
    every kernel with a loop fails in its interpreter with "only 0-dimensional arrays can be converted to
    Python scalars"."""
    if triton_version is None:
        if not HAS_TRITON:                          # macOS, or a minimal install: not this clash
            return None
        triton_version = triton.__version__
    if numpy_version is None:
        try:
            import numpy
        except ImportError:
            return None
        numpy_version = numpy.__version__
    triton_at, numpy_at = major_minor(triton_version), major_minor(numpy_version)
    if triton_at and numpy_at and triton_at < (3, 7) and numpy_at >= (2, 4):
        return (f"Triton {triton_version}'s CPU interpreter cannot run under numpy {numpy_version} "
                f"(triton-lang/triton#9171): install triton>=3.7 or numpy<2.4")
    return None


# Triton's masked memory operations, with the place of their mask among the builder's arguments
MASKED_OPS = (("create_masked_load", 1), ("create_masked_store", 2), ("create_atomic_rmw", 3))


def mask_as_a_gpu_takes(op, at: int):
    """``op``, one of the interpreter's MASKED_OPS, taking any integer mask as a GPU's i1: nonzero is true."""
    from triton.runtime.interpreter import TensorHandle

    def masked(self, *args):
        mask = args[at]
        if mask.data.dtype != bool:
            args = (*args[:at], TensorHandle(mask.data != 0, triton.language.int1), *args[at + 1:])
        return op(self, *args)
    masked.unmended = op
    return masked


def take_any_mask() -> None:
    """Make Triton's CPU interpreter take a mask as a GPU does. Its comparison of two scalars (``t < n``) keeps
    the operands' type, int32 where a GPU makes an i1, so such a mask splatted over a block (``mask=t < n`` on
    a block's load) or joined to a block's (``(col < d) & (t < n)``) reaches a load, a store or an atomic as
    int32, which Triton 3.9's interpreter refuses ("mask has unsupported dtype"). Once per process; the
    grader's kernel process does the same (``course/sandbox/student_process.as_on_a_gpu``)."""
    from triton.runtime.interpreter import InterpreterBuilder
    for name, at in MASKED_OPS:
        op = getattr(InterpreterBuilder, name)
        if not hasattr(op, "unmended"):
            setattr(InterpreterBuilder, name, mask_as_a_gpu_takes(op, at))


if HAS_TRITON:
    take_any_mask()


def serves(t: torch.Tensor) -> bool:
    """Whether the library's hot paths take a kernel for tensor ``t`` (see the module docstring): a CUDA
    tensor of an sm_80+ GPU with Triton importable, and ``NANOKV_NO_TRITON`` not set to 1."""
    if not HAS_TRITON or os.environ.get("NANOKV_NO_TRITON") == "1" or not t.is_cuda:
        return False
    # sm_80 or newer: the kernels load bf16 and use tl.dot shapes older GPUs do not compile
    return _properties(t.device.index)[0] >= 8


# ----------------------------------------------------------------------------------------------------------
# Small pieces the kernel files share


@functools.cache
def _properties(index: int | None) -> tuple[int, int]:
    """(compute capability major, streaming multiprocessors) of a CUDA device, read once: the hot paths
    ask at every layer of every decode step."""
    props = torch.cuda.get_device_properties(index)
    return props.major, props.multi_processor_count


def sm_count(t: torch.Tensor) -> int:
    """Streaming multiprocessors of the GPU holding ``t``: how many programs a launch needs to fill it."""
    return _properties(t.device.index)[1]


def fill_splits(t: torch.Tensor, rows: int, per_sm: int = 2) -> int:
    """Ranges per row (per (sequence, KV head)) that give every SM of the GPU holding ``t`` ``per_sm``
    programs; one in the interpreter, which runs programs one after another. ``split_ranges`` then keeps every
    range at least one block long. (How much the count matters on a GPU: the README's kernel section.)"""
    programs = per_sm * sm_count(t) if t.is_cuda else 1
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


def reference_empty_one(pos: torch.Tensor, slot: torch.Tensor, victim: torch.Tensor, budget: int) -> None:
    """The evicting references' last step, in place: where a head holds more than ``budget`` entries (pos
    (B, H_kv, C) >= 0), its slot ``victim`` (B, H_kv) is emptied (position -1) and ``slot`` (B, H_kv) points
    there for the next token; elsewhere ``slot`` moves to the next slot."""
    over = (pos >= 0).sum(-1) > budget
    pos.scatter_(2, victim[..., None], torch.where(over[..., None], -1, pos.gather(2, victim[..., None])))
    slot.copy_(torch.where(over, victim, slot + 1))


def default_scale(scale: float | None, d: int) -> float:
    """The attention scale: 1 / sqrt(d) unless given."""
    return 1.0 / math.sqrt(d) if scale is None else float(scale)
