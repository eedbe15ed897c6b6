"""
Generation with an explicit KV cache.

    cache = KVCache(model.config, policy=SomePolicy(budget=64))
    logits = prefill(model, prompt_ids, cache)        # the whole prompt, exact causal attention
    logits = extend(model, question_ids, cache)       # a chunk on top of the (possibly compressed) cache
    logits = decode_step(model, next_token, cache)    # one token
    out = generate(model, prompt_ids, max_new_tokens=20, policy=SomePolicy(budget=64))
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .cache import KVCache
from .checks import check_extend, check_generation, check_one_token, check_prefill
from .model import Transformer
from .policy import CachePolicy


@torch.no_grad()
def prefill(model: Transformer, ids: Tensor, cache: KVCache) -> Tensor:
    """Run the prompt ids (B, T) through an empty cache. Returns logits (B, T, vocab)."""
    check_prefill(cache)
    return model(ids, cache=cache)


@torch.no_grad()
def extend(model: Transformer, ids: Tensor, cache: KVCache) -> Tensor:
    """Append a chunk ids (B, Tn) to an existing cache (positions continue from cache.seen). Logits (B, Tn, V)."""
    check_extend(cache)
    return model(ids, cache=cache)


@torch.no_grad()
def decode_step(model: Transformer, token: Tensor, cache: KVCache) -> Tensor:
    """Feed one token per row, token (B,) or (B, 1). Returns the next-token logits (B, vocab)."""
    token = token[:, None] if token.dim() == 1 else token
    check_one_token(token)
    return extend(model, token, cache)[:, -1]


def sample_next(logits: Tensor, temperature: float = 0.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """Pick the next token (B,) from logits (B, V): greedy at temperature 0, else softmax sampling."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]          # (B, 1) smallest kept logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model: Transformer, ids: Tensor, max_new_tokens: int, policy: CachePolicy | None = None,
             cache: KVCache | None = None, temperature: float = 0.0, top_k: int | None = None,
             stop_ids: list[int] | tuple = (), generator: torch.Generator | None = None, step=None) -> Tensor:
    """Continue ids (B, T) by up to ``max_new_tokens`` tokens; returns them (B, n). ``policy`` serves a fresh
    cache (None: the plain full cache), or ``cache`` is continued. Temperature 0 is greedy, else sampling
    among the ``top_k`` likeliest. A row stops after one of ``stop_ids`` and repeats it until all have stopped.
    ``step(token (B,), cache) -> logits`` feeds each new token (default ``decode_step``; or the faster
    ``fastpath.lean.LeanDecoder.step``)."""
    cache = cache if cache is not None else KVCache(model.config, policy=policy)
    model.check_ids(ids, cache.seen)             # the whole request is checked before anything is stored
    check_generation(model.config, cache.seen, ids.shape[1], max_new_tokens, temperature, top_k)
    B = ids.shape[0]
    if max_new_tokens == 0:
        return ids.new_zeros(B, 0)
    step = step if step is not None else functools.partial(decode_step, model)   # (token (B,), cache) -> (B, V)
    if cache.seen > 0 and ids.shape[1] == 1:                           # one token onto a cache: a decode step
        logits = step(ids[:, 0], cache)                                 # (B, V)
    else:
        logits = (prefill if cache.seen == 0 else extend)(model, ids, cache)[:, -1]  # (B, V)
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=ids.device)
    done = torch.zeros(B, dtype=torch.bool, device=ids.device)
    out = []
    for i in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, generator)                  # (B,)
        if out:                                    # rows that already stopped repeat their stop id
            token = torch.where(done, out[-1], token)
        out.append(token)
        done = done | torch.isin(token, stop)
        if bool(done.all()) or i == max_new_tokens - 1:
            break
        logits = step(token, cache)
    return torch.stack(out, dim=1)
