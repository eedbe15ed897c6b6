"""The adapters of the ``cache`` assignment, the functions its tests call: see course/model_adapters.py."""

from __future__ import annotations

import torch
from torch import Tensor

from course.model_adapters import (  # noqa: F401  (re-exported for the tests)
    kept_positions,
    new_cache,
    new_storage,
    run_decode,
    run_extend,
    run_prefill,
    storage_append,
    storage_contents,
    tiny_model,
    uncached_logits,
)
from nanollm.attention import attend, group_scores


def decode_probs(q: Tensor, k: Tensor) -> Tensor:
    """One decode step's attention probabilities: q (B, H, 1, d), k (B, H_kv, Tk, d) -> (B, H_kv, G, Tk)."""
    return torch.softmax(group_scores(q, k)[:, :, :, 0], dim=-1)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """Attention with the mask built from positions: q (B, H, Tq, d), k, v (B, H_kv, Tk, d), q_pos (Tq,),
    k_pos (B, H_kv, Tk) with -1 for an empty slot. Returns (B, H, Tq, d)."""
    return attend(q, k, v, q_pos, k_pos)[0]
