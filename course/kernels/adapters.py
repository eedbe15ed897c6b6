"""The adapters of the ``kernels`` assignment: the tests' only door into your code (see
course/model_adapters.py). If you move or rename things in the library, change these functions so they reach
your code.

Each adapter imports the library module it needs when it is called, so a file of yours that fails to import
fails only the tasks that use it. The online softmax lives in two kernels (kernels/decode_attention.py, and
the fused sketch attention of kernels/count_sketch.py, in base 2); the merge of the ranges in four places
(``merge_splits`` in PyTorch, and the merge kernels of decode_attention.py, count_sketch.py and
tensor_decode.py). The adapters give them all one shape: partials m, l (R, splits, G), acc (R, splits, G, d).
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import Tensor

LOG2E = math.log2(math.e)


def module(name: str):
    return importlib.import_module(f"kernels.{name}")


def pad_to(x: Tensor, dim: int, size: int) -> Tensor:
    """x zero-padded along ``dim`` to ``size``."""
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


# -- task online_softmax -------------------------------------------------------------------------------------

def decode_partials(q: Tensor, k: Tensor, v: Tensor, idx: Tensor | None, block_n: int,
                    splits: int) -> tuple[Tensor, Tensor, Tensor]:
    """The split kernel of decode_attention.py alone: q (B, H, d), k, v (B, H_kv, S, d), idx (B, H_kv, K) rows
    of each KV head (-1: padding) or None -> each range's m, l (B * H_kv, splits, G), acc (..., G, d): the
    running max of the scores q k / sqrt(d), the sum of exp(score - m), the sum of exp(score - m) v."""
    return module("decode_attention").decode_partials_triton(q, k, v, idx, block_n=block_n, splits=splits)


def sketch_partials(q: Tensor, k: Tensor, v: Tensor, scale: float, block_n: int,
                    splits: int) -> tuple[Tensor, Tensor, Tensor]:
    """The fused kernel of count_sketch.py over raw tokens only (an empty sketch): q (H, d), k, v (H_kv, n, d)
    -> m, l (H_kv, splits, G), acc (H_kv, splits, G, d), in base 2: m is the running max of the scores times
    scale * log2(e), l the sum of 2^(that - m), acc the same weights times v."""
    cs = module("count_sketch")
    H, d = q.shape
    H_kv = k.shape[0]
    cells = torch.zeros(1, 1, H_kv, d)                              # one row of one cell, never read
    no_token = torch.zeros(1, 0, dtype=torch.int32)
    m, l, acc = cs.sketch_decode_partials_triton(q, k, v, cells, cells.clone(), no_token, no_token.float(),
                                                 scale, block_n=block_n, num_splits=splits)
    G = H // H_kv
    return m[:, :, :G], l[:, :, :G], acc[:, :, :G, :d]


# -- task merge_splits ----------------------------------------------------------------------------------------

def merge(m: Tensor, l: Tensor, acc: Tensor) -> Tensor:
    """``merge_splits`` (PyTorch): m, l (R, splits, G), acc (R, splits, G, d) -> (R, G, d)."""
    return module("decode_attention").merge_splits(m, l, acc)


def merge_kernel(m: Tensor, l: Tensor, acc: Tensor) -> Tensor:
    """The same with decode_attention.py's ``_merge_splits_kernel``."""
    return module("decode_attention").merge_splits_triton(m.contiguous(), l.contiguous(), acc.contiguous())


def merge_sketch_kernel(m: Tensor, l: Tensor, acc: Tensor) -> Tensor:
    """The same with count_sketch.py's ``_merge_splits_kernel`` (base 2: m given in base e is multiplied by
    log2(e); rows R play the KV heads; G and d padded to powers of two)."""
    cs = module("count_sketch")
    R, S, G, d = acc.shape
    G_PAD, D_PAD = cs.next_pow2(G), cs.next_pow2(d)
    m2, l2 = (pad_to(x, 2, G_PAD).contiguous() for x in (m * LOG2E, l))
    acc2 = pad_to(pad_to(acc, 2, G_PAD), 3, D_PAD).contiguous()
    out = torch.empty(R * G, d)
    return cs.merge_sketch_splits_triton(m2, l2, acc2, out).view(R, G, d)


def merge_tensor_kernel(m: Tensor, l: Tensor, acc: Tensor) -> Tensor:
    """The same with tensor_decode.py's ``tensor_decode_combine_kernel`` (partials (R * G, splits), acc
    (R * G, splits, BLOCK_D) with d padded to BLOCK_D)."""
    td = module("tensor_decode")
    R, S, G, d = acc.shape
    BLOCK_D = td._block_d(d)
    m2, l2 = (x.transpose(1, 2).reshape(R * G, S).contiguous() for x in (m, l))
    acc2 = pad_to(acc.transpose(1, 2).reshape(R * G, S, d), 2, BLOCK_D).contiguous()
    out = torch.empty(R * G, d)
    td.tensor_decode_combine_kernel[(R * G,)](m2, l2, acc2, out, d, SPLITS=S, SPLITS_P2=td.next_pow2(S),
                                              BLOCK_D=BLOCK_D)
    return out.view(R, G, d)
