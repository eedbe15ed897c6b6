"""
What the assignments' tests compare against, written without the library: full attention in a few lines
of PyTorch, and the ``points`` decorator. The grader copies this file next to the tests, so a student's
copy of the library can never change the oracle.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def points(n: float):
    """Mark a test with its points (the grader reads them from the source)."""
    def mark(test):
        test.points = n
        return test
    return mark


def full_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(d) + mask) v, the mask from positions: a query at p sees a key at s iff
    0 <= s <= p. q (B, H, Tq, d); k, v (B, H_kv, Tk, d); q_pos (Tq,); k_pos (B, H_kv, Tk) (-1: empty slot).
    GQA: query head h reads KV head h // (H // H_kv). Returns (B, H, Tq, d)."""
    B, H, Tq, d = q.shape
    G = H // k.shape[1]
    k, v, k_pos = (t.repeat_interleave(G, dim=1) for t in (k, v, k_pos))     # (B, H, Tk, ...)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)                             # (B, H, Tq, Tk)
    visible = (k_pos[:, :, None, :] <= q_pos[None, None, :, None]) & (k_pos[:, :, None, :] >= 0)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


def tiny_config(flavour: str = "llama", **overrides) -> dict:
    """Keyword arguments of a tiny ``ModelConfig`` (GQA in the Llama flavour): fast enough for a test."""
    base = dict(n_layer=2, n_head=4, n_kv_head=2 if flavour == "llama" else 4, d_model=32, vocab_size=64,
                max_seq_len=128)
    if flavour == "gpt2":
        base.update(pos_emb="learned", norm="layernorm", mlp="gelu")
    base.update(overrides)
    return base
