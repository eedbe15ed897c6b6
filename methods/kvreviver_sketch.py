"""
KVReviver's Vague sketch: a count sketch of whole tokens, which adds each evicted token into r cells and
estimates it back as a median over them.

Paper: Yuan et al., "KVReviver: Reversible KV Cache Compression with Sketch-Based Token Reconstruction", 2025,
https://arxiv.org/abs/2512.17917 (Algorithm 1: insert; Algorithm 2: query; Lemmas 1-2: its error), after the
count sketch of Charikar et al., 2002. Per row i, with a bucket hash h_i and a sign hash g_i:
    insert:  cell[i, h_i(J)].key += k_J          cell[i, h_i(J)].value += g_i(J) v_J
    query:   k^_J = median_i cell[i, h_i(J)].key    v^_J = median_i g_i(J) cell[i, h_i(J)].value
The policy that fills and reads it is ``methods/kvreviver.py``; ``kernels/count_sketch.py`` has the same two
steps as Triton kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

PRIME = 2_147_483_647          # 2^31 - 1, modulus of the universal hashes


def lower_median(x: Tensor) -> Tensor:
    """(r, ...) -> (...): the element-wise median over dim 0, the lower of the two middle values for an even r
    (as ``torch.median``), by sorting the r rows with element-wise min / max (odd-even transposition: r rounds
    of compare-exchange), ~20x faster than ``median``. For the paper's r = 3, the middle of three directly:
    max(min(a, b), min(max(a, b), c)), 4 element-wise passes. A median only selects: no rounding either way."""
    if x.shape[0] == 3:
        a, b, c = x.unbind(0)
        return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))
    rows = list(x.unbind(0))
    for i in range(len(rows)):
        for j in range(i % 2, len(rows) - 1, 2):
            rows[j], rows[j + 1] = torch.minimum(rows[j], rows[j + 1]), torch.maximum(rows[j], rows[j + 1])
    return rows[(len(rows) - 1) // 2]


class VagueSketch:
    """A count sketch of whole tokens for one sequence and layer (Yuan et al., arXiv 2512.17917, Algorithms
    1-2), batched over tokens.

    cells: key, value (r, b, H_kv, d), fp32 (sums of many tokens). Tokens are identified by position J.
    (``fastpath/sketch.py`` runs insert and query on the Triton kernels of ``kernels/count_sketch.py``.)
    """

    def __init__(self, rows: int, width: int, n_kv_head: int, head_dim: int, seed: int, injective: bool = False,
                 device=None) -> None:
        if width < 1:
            raise ValueError(f"a sketch needs at least one cell per row, got width {width}")
        self.rows, self.width, self.injective = rows, width, injective
        self.key = torch.zeros(rows, width, n_kv_head, head_dim, device=device)
        self.value = torch.zeros_like(self.key)
        g = torch.Generator().manual_seed(seed)
        self.coef = torch.randint(1, PRIME, (4, rows, 1), generator=g).to(device)   # a, c (bucket); a', c' (sign)
        self.covered = 0                    # positions below it are hashed once, in the tables (``cover``)
        self.cell_table = self.sign_table = None

    def buckets(self, pos: Tensor) -> Tensor:
        """h_i(J) for every row i: pos (n,) -> (r, n)."""
        J = pos.view(1, -1).long()
        if self.injective:
            return J.expand(self.rows, -1)
        if self.covered:        # the caller promised every J < covered (else an IndexError; on a GPU, an assert)
            return self.cell_table.index_select(1, J[0])
        return self.hash_cells(J)

    def signs(self, pos: Tensor) -> Tensor:
        """g_i(J) in {+1, -1}: (n,) -> (r, n)."""
        J = pos.view(1, -1).long()
        if self.injective:
            return torch.ones(self.rows, J.shape[1], device=J.device)
        if self.covered:
            return self.sign_table.index_select(1, J[0])
        return self.hash_signs(J)

    def hash_cells(self, J: Tensor) -> Tensor:
        """The bucket hash h_i(J) = ((a_i J + c_i) mod p) mod b: J (1, n) int64 -> (r, n)."""
        return (self.coef[0] * J + self.coef[1]) % PRIME % self.width

    def hash_signs(self, J: Tensor) -> Tensor:
        """The sign hash g_i(J) = 1 - 2 (((a'_i J + c'_i) mod p) mod 2): J (1, n) int64 -> (r, n) of +-1."""
        return 1.0 - 2.0 * ((self.coef[2] * J + self.coef[3]) % PRIME % 2).float()

    def cover(self, n: int) -> None:
        """Hash every position below ``n`` once, into tables that ``buckets`` and ``signs`` then read: one
        lookup each instead of 4 and 7 operations (on a GPU each is a kernel launch, and a decode step hashes
        every evicted position again to rebuild it). The caller promises to ask for no position at or above
        ``n`` until it covers more: ``n`` is a count the host knows (positions seen), so no host wait. The
        tables grow by doubling; their values are the formulas', so nothing else changes. They are not counted
        in the method's memory (``slot_nbytes``, ``extra_nbytes``): like RoPE's angles, a cache of a function of
        the position, which a fused kernel could compute from the four coefficients instead."""
        if self.injective or n <= self.covered:
            return
        J = torch.arange(max(n, 2 * self.covered, 256), device=self.coef.device).view(1, -1)
        self.cell_table, self.sign_table = self.hash_cells(J), self.hash_signs(J)   # (r, n) each
        self.covered = J.shape[1]

    def insert(self, pos: Tensor, k: Tensor, v: Tensor, sign: float = 1.0) -> None:
        """Algorithm 1: add tokens at positions pos (n,) with k, v (n, H_kv, d) to every row (sign -1:
        subtract): cell[i, h_i(J)].key += k_J, cell[i, h_i(J)].value += g_i(J) v_J for every row i. Tokens
        that share a cell are all summed into it. h and g are ``self.buckets(pos)`` and ``self.signs(pos)``,
        which know an injective sketch and the cover table."""
        # BEGIN SOLUTION [kvreviver:insert] KVReviver Algorithm 1 (a count sketch, Charikar et al. 2002), every row
        cells, signs = self.buckets(pos), self.signs(pos)                        # (r, n) each
        k, v = sign * k.float(), sign * v.float()                                # (n, H_kv, d)
        (r, n), (H_kv, d) = cells.shape, self.key.shape[2:]
        flat = (-1, H_kv, d)                                                     # the cells as (r * b) rows
        rows = torch.arange(self.rows, device=cells.device).view(-1, 1)
        idx = (rows * self.width + cells.long()).reshape(-1)                     # (r * n,): row i's cell c
        g = signs.to(self.value.dtype)[..., None, None]                          # (r, n, 1, 1): g_i(J)
        k_rows = k.to(self.key.dtype).unsqueeze(0).expand(r, n, H_kv, d)        # (r, n, H_kv, d): k_J
        v_rows = v.to(self.value.dtype).unsqueeze(0) * g                         # (r, n, H_kv, d): g_i(J) v_J
        # index_add_ sums every token sent to a cell (an indexed += would keep only one of them)
        self.key.view(flat).index_add_(0, idx, k_rows.reshape(flat))
        self.value.view(flat).index_add_(0, idx, v_rows.reshape(flat))
        # END SOLUTION

    def query(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Algorithm 2: estimates (n, H_kv, d) of k and v, the element-wise median over the r rows:
        k^_J = median_i cell[i, h_i(J)].key, v^_J = median_i g_i(J) cell[i, h_i(J)].value; for an even r the
        lower of the two middle values (as ``torch.median``, ties included). h and g are ``self.buckets`` and
        ``self.signs``, as in ``insert``."""
        # BEGIN SOLUTION [kvreviver:query] KVReviver Algorithm 2: the count sketch's estimate, a median over rows
        cells, signs = self.buckets(pos), self.signs(pos)                        # (r, n) each
        (r, n), (H_kv, d) = cells.shape, self.key.shape[2:]
        flat = (-1, H_kv, d)                                                     # the cells as (r * b) rows
        rows = torch.arange(self.rows, device=cells.device).view(-1, 1)
        idx = (rows * self.width + cells.long()).reshape(-1)                     # (r * n,): row i's cell c
        g = signs.to(self.value.dtype)[..., None, None]                          # (r, n, 1, 1): g_i(J)
        k = self.key.reshape(flat).index_select(0, idx).view(r, n, H_kv, d)     # (r, n, H_kv, d): cells
        v = self.value.reshape(flat).index_select(0, idx).view(r, n, H_kv, d) * g   # signed cells
        return lower_median(k), lower_median(v)                                  # the lower median for even r
        # END SOLUTION

    def delete(self, pos: Tensor, k: Tensor, v: Tensor) -> None:
        """Remove tokens by subtracting what is known of them (in a swap: their estimates)."""
        self.insert(pos, k, v, sign=-1.0)

    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes
