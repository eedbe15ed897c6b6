"""The bundled checkpoint: it loads, it solves its default suite as its card says, and methods rank sensibly."""

import pytest

from methods import make_policy
from nanollm import load
from nanollm.evaluate import accuracy

N = 8          # samples per task: the first N of the card's own evaluation samples (same seeds)


@pytest.fixture(scope="module")
def bundled():
    return load("retrieval-llama")


def test_card_describes_the_model(bundled):
    model, tok, card = bundled
    assert card["model_config"] == model.config.to_dict()
    assert card["n_params"] == model.num_params() and tok.vocab_size == model.config.vocab_size
    assert model.config.flavour == "llama" and model.config.n_kv_head < model.config.n_head
    assert model.config.max_seq_len >= 1024 and card["n_samples"] >= 200
    assert card["default_suite"], "the model solves no task"
    for task in card["default_suite"]:
        threshold = 0.80 if task in ("vt", "cwe") else 0.95
        assert all(a >= threshold for per_len in card["accuracy"][task].values() for a in per_len.values())


def test_accuracy_as_stated_in_the_card(bundled):
    model, tok, card = bundled
    L = max(int(x) for x in card["accuracy"][card["default_suite"][0]])
    for task in card["default_suite"]:
        acc = accuracy(model, tok, task, L, N, "question_in_prompt", seed=card["eval_seed"])
        stated = card["accuracy"][task][str(L)]["question_in_prompt"]
        assert acc >= stated - 0.15, f"{task}: {acc:.2f} on {N} samples, card says {stated:.3f}"


def test_snapkv_at_least_streaming_llm_on_niah_at_keep_ratio_0_1(bundled):
    """Query-aware selection (SnapKV) keeps the needle that a recency window drops (issue 4's ordering check)."""
    model, tok, card = bundled
    L = 512
    budget = round(0.1 * L)
    tasks = [t for t in card["default_suite"] if t.startswith("niah")]
    acc = {}
    for name in ("snapkv", "streaming_llm"):
        acc[name] = sum(accuracy(model, tok, t, L, N, "question_in_prompt", lambda: make_policy(name, budget=budget),
                                 seed=card["eval_seed"]) for t in tasks) / len(tasks)
    assert acc["snapkv"] >= acc["streaming_llm"], acc
