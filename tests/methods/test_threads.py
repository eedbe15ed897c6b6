"""
What a method keeps does not depend on the number of CPU threads: every method, after a prompt pass and a
few decode steps, keeps the same positions in every layer and head with 1 and with 2 torch threads, on the
bundled model and on SmolLM2-135M. (Scores may differ in their last bits between thread counts; the
selections break ties by position, ``nanollm.policy.select_topk``, so equal scores cannot flip them.)
A committed results file records its threads, but its kept sets, and so its accuracies, must not need it.
"""

from __future__ import annotations

import pytest
import torch

from methods import METHODS, make_policy
from nanollm import KVCache, decode_step, load, prefill
from nanollm.data.tasks import make_sample
from nanollm.io.checkpoint import load_config


def kept_positions(model, ids: torch.Tensor, method: str, budget: int, threads: int) -> list[torch.Tensor]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cache = KVCache(model.config, make_policy(method, budget))
        prefill(model, ids, cache)
        for t in range(4):
            decode_step(model, torch.tensor([100 + t]), cache)
        return [layer.pos.clone() for layer in cache.layers]
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint, length", [("retrieval-llama", 512), ("smollm2-135m", 256)])
def test_kept_sets_do_not_depend_on_threads(checkpoint, length):
    try:
        load_config(checkpoint)
    except (OSError, ValueError) as e:
        pytest.skip(f"{checkpoint} is not here ({e})")
    model, tok, card = load(checkpoint)
    task = (card.get("default_suite") or ["niah_multikey"])[0]
    ids = torch.tensor([make_sample(task, tok, length, seed=0).prompt_ids])
    for method in [m for m in METHODS if m != "full"]:
        one, two = (kept_positions(model, ids, method, length // 4, t) for t in (1, 2))
        differ = [i for i, (a, b) in enumerate(zip(one, two)) if not torch.equal(a, b)]
        assert not differ, f"{method} on {checkpoint}: layers {differ} keep other positions with 2 threads"
