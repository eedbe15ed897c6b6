"""
KVReviver's count sketch on the Triton kernels of ``kernels/count_sketch.py``.

    policy = make_policy("kvreviver", budget=256)
    use_kernels(policy)          # its sketches insert and query with the kernels where kernels.serves says so

``KernelSketch`` is ``methods.kvreviver.VagueSketch`` with ``insert`` and ``query`` taken by the kernels on a
CUDA tensor (atomic adds; a gather and a median in registers), and the sketch's own PyTorch elsewhere.
``tests/fastpath/`` checks the two against each other.
"""

from __future__ import annotations

from torch import Tensor

import kernels
from methods.kvreviver import KVReviverPolicy, VagueSketch


class KernelSketch(VagueSketch):
    def insert(self, pos: Tensor, k: Tensor, v: Tensor, sign: float = 1.0) -> None:
        if not kernels.serves(self.key):
            return super().insert(pos, k, v, sign)
        from kernels.count_sketch import sketch_insert_triton
        sketch_insert_triton(self.key, self.value, self.buckets(pos).int(), self.signs(pos),
                             sign * k.float(), sign * v.float())

    def query(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        if not kernels.serves(self.key):
            return super().query(pos)
        from kernels.count_sketch import MAX_ROWS, sketch_query_triton
        if self.rows > MAX_ROWS:
            return super().query(pos)
        return sketch_query_triton(self.key, self.value, self.buckets(pos).int(), self.signs(pos))


def use_kernels(policy: KVReviverPolicy) -> KVReviverPolicy:
    """Let ``policy`` build its sketches as ``KernelSketch`` (before its first compression)."""
    policy.sketch_class = KernelSketch
    return policy
