"""The adapters of the ``baselines`` assignment, the functions its tests call: see course/model_adapters.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from course.model_adapters import (  # noqa: F401  (re-exported for the tests)
    kept_positions,
    new_cache,
    new_storage,
    run_decode,
    run_prefill,
    storage_append,
    tiny_model,
    uncached_logits,
)
from methods import make_policy
from methods.adakv import adaptive_keep_mask
from methods.h2o import STATE, H2OPolicy
from methods.snapkv import SnapKVPolicy, snapkv_scores, window_vote
from methods.streaming_llm import StreamingLLMPolicy
from nanollm.policy import select_topk
from nanollm.storage import LayerKV


def h2o_scores(cache, layer: int) -> Tensor:
    """H2O's accumulated scores (B, H_kv, T) of a layer of a cache it runs."""
    return cache.layers[layer].state[STATE]


def streaming_mask(pos: Tensor, seen: int, budget: int, n_sink: int) -> Tensor:
    """(B, H_kv, T) bool: the slots StreamingLLM keeps (pos (B, H_kv, T), -1 = empty slot)."""
    return StreamingLLMPolicy(budget, n_sink).rank(torch.zeros(pos.shape), pos, seen) == float("inf")


def h2o_policy(budget: int) -> H2OPolicy:
    return make_policy("h2o", budget)


def h2o_observe(policy: H2OPolicy, store: LayerKV, col_sums: Tensor, phase: str, seen: int) -> Tensor:
    """Let H2O observe one step's attention (col_sums (B, H, T): attention each slot received, summed over
    the step's queries); return its per-slot scores (B, H_kv, T) afterwards."""
    policy.observe(SimpleNamespace(col_sums=col_sums, kv=store, phase=phase, seen=seen))
    return store.state[STATE]


def snapkv_vote(probs_window: Tensor, n_kv_head: int, kernel: int, pooling: str) -> Tensor:
    """SnapKV's pooled votes (B, H_kv, Tp) from the window's attention (B, H, w, Tp)."""
    return window_vote(probs_window, n_kv_head, kernel, pooling)


def snapkv_select(probs: Tensor, pos: Tensor, seen: int, budget: int, window: int, kernel: int,
                  pooling: str) -> Tensor:
    """The slots SnapKV keeps (B, H_kv, K), ascending, from the prompt's last rows of attention (B, H, R, T)."""
    scores = snapkv_scores(probs, pos.shape[1], window, kernel, pooling)
    return select_topk(SnapKVPolicy(budget, window, kernel, pooling).rank(scores, pos, seen), budget)


def adakv_mask(scores: Tensor, budget: int, n_safe: int) -> Tensor:
    """(B, H_kv, T) bool: the (head, slot) pairs AdaKV keeps."""
    return adaptive_keep_mask(scores, budget, n_safe)
