"""
Every method on the real model (SmolLM2-135M-Instruct, 30 layers, 9 query heads sharing 3 KV heads): with a
budget covering the whole sequence it keeps every token and its logits equal the full cache's, bit for bit,
through prefill, decode steps, an extend and more decode steps of real text. Skipped, saying so, where the
model has not been fetched.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from methods import METHODS, make_policy, scorers, wrappers
from nanollm import FullCache, KVCache, decode_step, extend, prefill

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
N_PROMPT, N_CHUNK = 48, 6
TOTAL = N_PROMPT + 2 + N_CHUNK + 2


def specs() -> list[str]:
    return [*METHODS, *(f"{w}({s})" for w in wrappers() for s in scorers())]


@pytest.fixture(scope="module")
def script(smollm2) -> dict:
    ids = torch.tensor([smollm2[1].encode((ROOT / "README.md").read_text()[:2000])[:TOTAL]])
    return {"prompt": ids[:, :N_PROMPT], "dec1": ids[:, N_PROMPT:N_PROMPT + 2],
            "chunk": ids[:, N_PROMPT + 2:N_PROMPT + 2 + N_CHUNK], "dec2": ids[:, -2:]}


def run(model, cache: KVCache, seq: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    out = [prefill(model, seq["prompt"], cache)]
    out += [decode_step(model, t, cache) for t in seq["dec1"].T]
    out.append(extend(model, seq["chunk"], cache))
    out += [decode_step(model, t, cache) for t in seq["dec2"].T]
    return out, [layer.pos.clone() for layer in cache.layers]


@pytest.fixture(scope="module")
def reference(smollm2, script):
    return run(smollm2[0], KVCache(smollm2[0].config, FullCache()), script)


@pytest.mark.parametrize("spec", specs())
def test_a_covering_budget_is_the_full_cache(smollm2, script, reference, spec):
    model = smollm2[0]
    logits, kept = run(model, KVCache(model.config, make_policy(spec, TOTAL)), script)
    for step, (a, b) in enumerate(zip(reference[0], logits)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max().item():.3g}"
    for a, b in zip(reference[1], kept):
        assert torch.equal(a, b), "a budget covering every token must keep every token, in order"
