"""
KVReviver's count sketch on the Triton kernels of ``kernels/count_sketch.py``.

    policy = make_policy("kvreviver", budget=256)
    use_kernels(policy)          # its sketches insert and query with the kernels where kernels.serves says so
    use_kernels_on(policies, t)  # the same for each of them, when kernels.serves(t) (the evaluation's engines)

``KernelSketch`` is ``methods.kvreviver_sketch.VagueSketch`` with ``insert`` and ``query`` taken by the kernels on a
CUDA tensor (atomic adds; a gather and a median in registers), and the sketch's own PyTorch elsewhere.
``tests/fastpath/`` checks the two against each other.
"""

from __future__ import annotations

from torch import Tensor

import kernels
from methods.kvreviver import KVReviverPolicy
from methods.kvreviver_sketch import VagueSketch
from nanollm.policy import CachePolicy


class KernelSketch(VagueSketch):
    def cover(self, n: int) -> None:
        """``VagueSketch.cover``, the bucket table also kept as int32, the kernels' type: a lookup is then
        one launch, not a lookup and a conversion."""
        covered = self.covered
        super().cover(n)
        if self.covered != covered:
            self.cells32 = self.cell_table.int()

    def cells(self, pos: Tensor) -> Tensor:
        """``buckets(pos).int()``: (r, n) int32."""
        if self.covered:
            return self.cells32.index_select(1, pos.view(-1).long())
        return self.buckets(pos).int()

    def insert(self, pos: Tensor, k: Tensor, v: Tensor, sign: float = 1.0) -> None:
        if not kernels.serves(self.key):
            return super().insert(pos, k, v, sign)
        from kernels.count_sketch import sketch_insert_triton
        if sign != 1.0:                           # the kernel reads k and v in their own dtype, as fp32
            k, v = sign * k.float(), sign * v.float()
        sketch_insert_triton(self.key, self.value, self.cells(pos), self.signs(pos), k, v)

    def query(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        if not kernels.serves(self.key):
            return super().query(pos)
        from kernels.count_sketch import MAX_ROWS, sketch_query_triton
        if self.rows > MAX_ROWS:
            return super().query(pos)
        return sketch_query_triton(self.key, self.value, self.cells(pos), self.signs(pos))


def use_kernels(policy: CachePolicy) -> CachePolicy:
    """Let ``policy``, or the ``KVReviverPolicy`` it wraps (``inner``, as ``PolicyWrapper`` holds it), build
    its sketches as ``KernelSketch`` (before its first compression). Only the plain sketch is replaced: a
    subclass's own (an ablation's) stays as it is. Any other policy is returned untouched."""
    inner = policy
    while not isinstance(inner, KVReviverPolicy):
        inner = getattr(inner, "inner", None)
        if inner is None:
            return policy
    if inner.sketch_class is VagueSketch:
        inner.use_sketch(KernelSketch)
    return policy


def use_kernels_on(policies: list[CachePolicy], t: Tensor) -> None:
    """``use_kernels`` on every policy when ``kernels.serves(t)`` (a tensor of the device they will run on):
    how the evaluation's fast engines take the sketch's kernels on a GPU, and leave it alone elsewhere."""
    if kernels.serves(t):
        for policy in policies:
            use_kernels(policy)
