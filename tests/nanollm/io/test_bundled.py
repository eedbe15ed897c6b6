"""The bundled checkpoint: it loads, it solves its default suite as its card says, and methods rank sensibly."""

import pytest
import torch

from methods import make_policy
from nanollm import KVCache, prefill
from nanollm.cli.card import THRESHOLDS
from nanollm.data.evaluate import accuracy
from nanollm.data.tasks import make_sample

N = 8          # samples per task: the first N of the card's own evaluation samples (same seeds)


def test_card_describes_the_model(bundled):
    model, tok, card = bundled
    assert card["model_config"] == model.config.to_dict()
    assert card["n_params"] == model.num_params() and tok.vocab_size == model.config.vocab_size
    assert model.config.flavour == "llama" and model.config.n_kv_head < model.config.n_head
    assert model.config.max_seq_len >= 1024 and card["n_samples"] >= 200
    assert card["default_suite"], "the model solves no task"
    for task in card["default_suite"]:
        assert all(a >= THRESHOLDS[task] for per_len in card["accuracy"][task].values() for a in per_len.values())


@pytest.mark.slow
def test_accuracy_as_stated_in_the_card(bundled):
    model, tok, card = bundled
    L = max(int(x) for x in card["accuracy"][card["default_suite"][0]])
    for task in card["default_suite"]:
        acc = accuracy(model, tok, task, L, N, "question_in_prompt", seed=card["eval_seed"])
        stated = card["accuracy"][task][str(L)]["question_in_prompt"]
        assert acc >= stated - 0.15, f"{task}: {acc:.2f} on {N} samples, card says {stated:.3f}"


def _niah_tasks(card):
    return [t for t in card["default_suite"] if t.startswith("niah")]


@pytest.mark.xfail(strict=True, reason="does not hold on the bundled model (20,000 steps): at keep ratio 0.1 both are "
                                       "near 0 (SnapKV 0.00, StreamingLLM 0.01 on these samples); see the README")
@pytest.mark.slow
def test_snapkv_at_least_streaming_llm_on_niah_at_keep_ratio_0_1(bundled):
    """Issue 4's ordering check: query-aware selection (SnapKV) >= a recency window (StreamingLLM) in accuracy.

    Strict xfail: the test fails as soon as the ordering holds again, so the README's claim gets updated."""
    model, tok, card = bundled
    L = 512
    budget = round(0.1 * L)
    tasks = _niah_tasks(card)
    acc = {}
    for name in ("snapkv", "streaming_llm"):
        acc[name] = sum(accuracy(model, tok, t, L, N, "question_in_prompt", lambda: make_policy(name, budget=budget),
                                 seed=card["eval_seed"]) for t in tasks) / len(tasks)
    assert acc["snapkv"] >= acc["streaming_llm"], acc


def _find(seq: list[int], sub: list[int]) -> int:
    return next(i for i in range(len(seq) - len(sub) + 1) if seq[i:i + len(sub)] == sub)


@pytest.mark.slow
def test_snapkv_keeps_more_of_the_needle_than_streaming_llm_at_keep_ratio_0_1(bundled):
    """The mechanism behind the ordering: with the question in the observation window, SnapKV keeps some of the
    needle's value tokens (in some heads); a sink + recency window rarely holds a needle at a random depth."""
    model, tok, card = bundled
    L = 512
    budget = round(0.1 * L)
    kept = {}
    for name in ("snapkv", "streaming_llm"):
        fractions = []
        for task in _niah_tasks(card):
            for i in range(N):
                s = make_sample(task, tok, L, seed=card["eval_seed"] + i)
                value_pos = []                                              # context positions of the answers
                for a in s.answers:
                    ids = tok.encode(a)
                    start = _find(s.context_ids, ids)
                    value_pos += range(start, start + len(ids))
                value_pos = torch.tensor(value_pos)
                cache = KVCache(model.config, policy=make_policy(name, budget=budget))
                prefill(model, torch.tensor([s.prompt_ids]), cache)
                for layer in cache.layers:
                    for head_pos in layer.pos[0]:                           # (T,) positions kept by one KV head
                        fractions.append(torch.isin(value_pos, head_pos).float().mean().item())
        kept[name] = sum(fractions) / len(fractions)
    assert kept["snapkv"] > kept["streaming_llm"], kept
