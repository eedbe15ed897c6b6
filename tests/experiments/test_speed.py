"""
experiments.speed on the bundled model (small and quick): every number it reports is present and consistent
(tokens/s = 1 / ms, the roofline's bytes = weights + K/V of the context), arguments are checked before work,
and the dtype cost of bf16 is measured against fp32.
"""

from __future__ import annotations

import pytest
import torch

from experiments import speed
from experiments.bench import decode_weight_bytes
from nanollm.config import preset
from nanollm.io.checkpoint import load


@pytest.mark.slow
def test_run_speed_numbers_are_consistent():
    result = speed.run_speed("retrieval-llama", contexts=[48, 96], threads=1, repeats=1, steps=2, warmup=1,
                             vs_transformers=False, progress=False)
    model = load("retrieval-llama")[0]
    assert result["weight_bytes"] == decode_weight_bytes(model)
    assert [r["context"] for r in result["rows"]] == [48, 96]
    for r in result["rows"]:
        assert set(r["decode_ms"]) == {"nanollm", "nanollm-lean"} and set(r["prefill_tok_s"]) == {"nanollm"}
        for name, ms in r["decode_ms"].items():
            assert ms > 0 and r["decode_tok_s"][name] == pytest.approx(1e3 / ms)
            assert r["of_roofline"][name] == pytest.approx(r["ideal_ms"] / ms)
        c = model.config                                                # K and V, fp32, every layer and KV head
        kv = 2 * c.n_layer * c.n_kv_head * c.head_dim * 4 * (r["context"] - 1 - result["steps"] // 2)
        assert r["bytes_per_step"] == result["weight_bytes"] + kv
    text = speed.format_speed(result)
    assert "roofline: nanollm" in text and "target decode step >= 50% of its roofline at 96: nanollm" in text


@pytest.mark.parametrize("tied", [True, False])
def test_decode_weight_bytes_by_hand(make_model, tied):
    """TINY: 2 layers, 4 heads sharing 2 KV heads of 16 (d_model 64); counted by hand from its sizes."""
    config = preset("TINY", tie_embeddings=tied)
    V, D, F, L, kv = config.vocab_size, config.d_model, config.d_ff, config.n_layer, config.n_kv_head * 16
    per_layer = D * D + 2 * D * kv + D * D + 3 * D * F + 2 * D        # q, k + v, o, gate + up + down, 2 norms
    head = V * D                                                        # the LM head reads its whole matrix
    expected = 4 * (L * per_layer + D + head)                           # + the final norm; fp32
    assert decode_weight_bytes(make_model(config)) == expected          # an untied embedding: one row read


def test_format_speed_says_which_targets_are_met():
    row = {"context": 2048, "prefill_tok_s": {"nanollm": 99.0, "transformers": 100.0},
           "decode_tok_s": {"nanollm": 23.9, "nanollm-lean": 24.1, "transformers": 20.0},
           "decode_ms": {"nanollm": 41.8, "nanollm-lean": 41.5, "transformers": 50.0},
           "of_roofline": {"nanollm": 0.499, "nanollm-lean": 0.51}, "bytes_per_step": 600e6, "ideal_ms": 20.8}
    result = {"checkpoint": "x", "dtype": "float32", "threads": 2, "repeats": 3, "steps": 8, "warmup": 2,
              "transformers": "5", "weight_bytes": 5e8, "kv_bytes_per_token": 4, "bandwidth_gb_s": 25.0,
              "rows": [row]}
    text = speed.format_speed(result)
    assert "target prefill >= 1.0x transformers at 2k: 0.990x, NOT met" in text
    assert "2k, nanollm: 1.195x, NOT met" in text and "2k, nanollm-lean: 1.205x, met" in text
    assert "at 2048: nanollm 49.9% NOT met, nanollm-lean 51.0% met" in text


def test_bad_contexts_fail_before_any_work(capsys):
    with pytest.raises(SystemExit):
        speed.main(["--checkpoint", "retrieval-llama", "--contexts", "5", "--no-transformers"])
    assert "--contexts [5]: each must lie in (10," in capsys.readouterr().err


def test_dtype_cost_of_bf16():
    cost = speed.dtype_cost("retrieval-llama", torch.bfloat16, "the needle is 1234. " * 20, tokens=64)
    assert cost["dtype"] == "bfloat16" and 0 <= cost["kl"] < 0.5 and 0.5 < cost["top1_agreement"] <= 1
