"""
Answering task samples with a model and a cache policy, in both modes, and scoring the answers.

    pred = answer(model, tok, sample, mode="question_after_context", policy=SnapKVPolicy(budget=64))
    acc  = string_match_all(pred, sample.answers)

Modes (``MODES``):

* ``question_in_prompt``: prefill(context + question), then decode. Query-aware methods see the
  question in their observation window.
* ``question_after_context``: prefill(context) (the cache is compressed here, before the question is
  known), then extend(question), then decode.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from ..cache import KVCache
from ..generation import generate, prefill
from .tasks import make_sample, string_match_all

MODES = ["question_in_prompt", "question_after_context"]

# How many tokens an answer may take (RULER's tokens_to_generate, scaled down), per task: comfortably more
# than the longest target (a multi-query answer names four keys and their values: about 60 tokens).
ANSWER_TOKENS = {"niah_single_noise": 16, "niah_single_prose": 16, "niah_single_needle": 16, "niah_multikey": 16,
                 "niah_multivalue": 48, "niah_multiquery": 96, "vt": 48, "cwe": 48,
                 "passkey": 16, "niah_single_docs": 16, "niah_multikey_docs": 16, "niah_multivalue_docs": 48,
                 "niah_multiquery_docs": 96}
DEFAULT_ANSWER_TOKENS = 96


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    return mode


def cut_at(ids: list[int], stop_id: int | None) -> list[int]:
    """The ids before the first ``stop_id`` (all of them if it does not occur, or is None)."""
    return ids[:ids.index(stop_id)] if stop_id is not None and stop_id in ids else ids


def answer_length(model, sample, max_new_tokens: int | None = None) -> int:
    """How many tokens the greedy answer to ``sample`` may take: the task's allowance, cut to the room left."""
    room = model.config.max_seq_len - len(sample.prompt_ids) + 1   # the last generated token needs no position
    return min(max_new_tokens or ANSWER_TOKENS.get(sample.task, DEFAULT_ANSWER_TOKENS), room)


@torch.no_grad()
def answer_ids(model, sample, mode: str, policy=None, max_new_tokens: int | None = None,
               stop_id: int | None = None) -> list[int]:
    """Greedy answer token ids for ``sample`` (a tokenized ``tasks.Sample``) under ``policy``."""
    check_mode(mode)
    dev = next(model.parameters()).device
    prompt = sample.prompt_ids
    n_new = answer_length(model, sample, max_new_tokens)
    stop = [stop_id] if stop_id is not None else []
    cache = KVCache(model.config, policy=policy)
    if mode == "question_in_prompt":
        ids = torch.tensor([prompt], device=dev)
    else:
        prefill(model, torch.tensor([sample.context_ids], device=dev), cache)
        ids = torch.tensor([sample.question_ids], device=dev)           # extended onto the compressed cache
    out = generate(model, ids, n_new, cache=cache, stop_ids=stop)[0].tolist()
    return cut_at(out, stop_id)


def answer(model, tok, sample, mode: str, policy=None, max_new_tokens: int | None = None) -> str:
    """The decoded greedy answer (up to the end-of-text token)."""
    return tok.decode(answer_ids(model, sample, mode, policy, max_new_tokens, stop_id=tok.eot_id))


def accuracy(model, tok, task: str, length: int, n_samples: int, mode: str, policy_factory=None,
             seed: int = 1 << 41, progress: bool = False) -> float:
    """Mean string_match_all over ``n_samples`` samples (seeds seed..seed+n-1) of one task and length.

    The default seeds start at 2**41, outside the range training draws its sample seeds from ([0, 2**40)).

    ``policy_factory`` makes a fresh policy per sample (None = full cache).
    """
    scores = []
    for i in tqdm(range(n_samples), disable=not progress, desc=f"{task} {length} {mode}", leave=False):
        sample = make_sample(task, tok, length, seed=seed + i)
        policy = policy_factory() if policy_factory is not None else None
        scores.append(string_match_all(answer(model, tok, sample, mode, policy), sample.answers))
    return sum(scores) / len(scores)
