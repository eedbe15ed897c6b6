"""
An engine: the two things an evaluation asks of the model, for a list of caches (one per policy).

    caches, logits = engine.fill(policies, chunks)           # each cache holds the prompt; logits (N, V)
    logits, hidden, seconds = engine.step(caches, tokens)    # one more token into each cache
    copy = engine.fork(cache)                                # a cache to go on with apart (greedy's fork)

``PlainEngine``: nanollm's reading path (``prefill``, ``extend``, the model's forward), one cache after
another; ``side_by_side.FastEngine`` and ``batched.BatchedEngine``: the same numbers to float rounding,
faster (on a CPU, and on a GPU). ``--engine`` picks one.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import Tensor

from nanollm.cache import KVCache
from nanollm.generation import extend, prefill
from nanollm.policy import CachePolicy


class PlainEngine:
    """``prompt_passes``: how many prompt passes the last ``fill`` ran; ``caches_per_step``: how many caches
    the last ``step`` ran at once (their time is shared among them when more than one)."""
    name = "plain"

    def __init__(self, model) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.prompt_passes, self.caches_per_step = 0, 0

    @torch.no_grad()
    def fill(self, policies: list[CachePolicy], chunks: list[list[int]]) -> tuple[list[KVCache], Tensor]:
        """A cache per policy holding the prompt (``chunks[0]`` prefilled, the rest extended); last logits (N, V)."""
        caches, last = [], []
        self.prompt_passes = len(policies)
        for policy in policies:
            cache = KVCache(self.model.config, policy=policy)
            logits = prefill(self.model, torch.tensor([chunks[0]], device=self.device), cache)
            caches.append(cache)
            last.append(self.extend_rest(cache, logits, chunks))
        return caches, torch.stack(last)

    def extend_rest(self, cache: KVCache, logits: Tensor, chunks: list[list[int]]) -> Tensor:
        """``extend`` the chunks after the first onto a cache that holds the first; the last logits (V,)."""
        for chunk in chunks[1:]:
            logits = extend(self.model, torch.tensor([chunk], device=self.device), cache)
        return logits[0, -1]

    @torch.no_grad()
    def step(self, caches: list[KVCache], tokens: list[int]) -> tuple[Tensor, Tensor, list[float]]:
        """``tokens[n]`` into ``caches[n]``: logits (N, V), final hidden states (N, D), each cache's seconds."""
        logits, hidden, seconds = [], [], []
        self.caches_per_step = 1
        for cache, token in zip(caches, tokens):
            t0 = time.perf_counter()
            lg, h = self.model(torch.tensor([[token]], device=self.device), cache=cache, return_hidden=True)
            seconds.append(time.perf_counter() - t0)
            logits.append(lg[0, -1])
            hidden.append(h[0, -1])
        return torch.stack(logits), torch.stack(hidden), seconds

    def fork(self, cache: KVCache) -> KVCache:
        """A copy of ``cache`` that shares nothing with it (``protocol.Trace``: greedy goes on from it)."""
        return copy.deepcopy(cache)
