"""
The peer check against kvpress (``experiments/evaluation/peer_kvpress.py``) on one SmolLM2-135M prompt at keep
0.25: the methods that keep kvpress's positions on every (layer, KV head) still do, and ChunkKV differs only
where its known difference says (kvpress takes the chunk that straddles the start of SnapKV's window whole).

Optional: skipped, saying so, where kvpress is not installed (``pip install -e .[peer]``, which pins
kvpress 0.5.5 and the transformers 5.2.x it needs) or the model has not been fetched; slow tier.
"""

from __future__ import annotations

import pytest
import torch

from experiments.evaluation import peer_kvpress as peer
from methods import make_policy
from methods.presets import preset_options
from nanollm.data.tasks import make_sample

kvpress = pytest.importorskip("kvpress", reason="the peer check needs kvpress: pip install -e .[peer]")

pytestmark = pytest.mark.slow
KEEP = 0.25
MATCHING = ["snapkv", "streaming_llm", "adakv(snapkv)", "critical_kv(snapkv)", "critical_kv(adakv(snapkv))"]


@pytest.fixture(scope="module")
def hf_model(smollm2_file):
    return peer.load_reference(smollm2_file)


@pytest.fixture(scope="module")
def prompt(smollm2) -> torch.Tensor:
    sample = make_sample("passkey", smollm2[1], peer.DEFAULT_LENGTH, seed=0)
    return torch.tensor([sample.prompt_ids])


def kept_both(smollm2, hf_model, spec: str, ids: torch.Tensor):
    """Our kept masks and kvpress's, per layer, (H_kv, T) bool each, at kvpress's budget for KEEP."""
    budget = peer.kvpress_budget(ids.shape[1], KEEP)
    ours, _ = peer.our_run(smollm2[0], make_policy(spec, budget, **preset_options(spec, "kvpress")), ids, 0, None)
    theirs, _ = peer.kvpress_run(hf_model, peer.make_press(kvpress, spec, 1 - KEEP), ids, 0, None)
    assert len(ours) == len(theirs) == smollm2[0].config.n_layer
    return ours, theirs


@pytest.mark.parametrize("spec", MATCHING)
def test_same_kept_positions_as_kvpress(smollm2, hf_model, prompt, spec):
    ours, theirs = kept_both(smollm2, hf_model, spec, prompt)
    for layer, (a, b) in enumerate(zip(ours, theirs)):
        for head in range(a.shape[0]):
            diff = (a[head] ^ b[head]).nonzero().flatten().tolist()
            assert not diff, f"layer {layer} KV head {head}: kept sets differ at positions {diff}"


def test_chunkkv_differs_only_in_the_chunk_straddling_the_window(smollm2, hf_model, prompt):
    """kvpress chunks the whole prompt, window included, so the chunk holding the window's first token
    outranks every other and is kept whole; ours chunks only the tokens outside the window. Every other
    choice (which whole chunks) is the same."""
    ours, theirs = kept_both(smollm2, hf_model, "chunkkv(snapkv)", prompt)
    T, window, chunk = prompt.shape[1], 64, 20
    straddling = range((T - window) // chunk * chunk, T - window)
    for layer, (a, b) in enumerate(zip(ours, theirs)):
        assert not bool((a & ~b).any()), f"layer {layer}: we keep a position kvpress does not"
        extra = set((b & ~a).nonzero()[:, 1].tolist())
        assert extra <= set(straddling), f"layer {layer}: kvpress also keeps {sorted(extra - set(straddling))}"
