"""
The decode benchmark (``python -m experiments.bench``), run quickly at small sizes.

Timing tests are opt-in (``python -m pytest -m bench``): on a busy shared CPU a timing can be off by a
lot, so they stay out of the default run. The byte count and the line fit are exact and run by default, and
so does the comparison with Hugging Face transformers when it is installed (no timing asserted: only that
both run the same model).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from experiments.bench import (
    fit_line,
    format_result,
    format_vs_transformers,
    main,
    quartiles,
    run_bench,
    run_vs_transformers,
)
from nanollm import KVCache, Transformer, prefill, preset


def test_fit_line_recovers_a_line() -> None:
    a, b = fit_line([1, 2, 3, 4], [2.5, 4.5, 6.5, 8.5])     # y = 0.5 + 2 x
    assert a == pytest.approx(0.5) and b == pytest.approx(2.0)


@pytest.mark.parametrize("name", ["TINY", "TINY_GPT2"])
def test_cache_bytes_match_formula(name: str) -> None:
    """cache.nbytes() == 2 * n_layer * n_kv_head * head_dim * 4 bytes * tokens * batch, in fp32."""
    cfg = preset(name)
    model = Transformer(cfg).eval()
    cache = KVCache(cfg)
    prefill(model, torch.zeros(2, 10, dtype=torch.long), cache)
    assert cache.nbytes() == 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 4 * 10 * 2
    assert cache.nbytes() == cfg.kv_bytes_per_token() * 10 * 2


@pytest.mark.bench
def test_cached_decode_beats_recompute() -> None:
    result = run_bench(preset("TINY", max_seq_len=512), contexts=[32, 384], repeats=3, steps=4)
    print("\n" + format_result(result, name="TINY"))
    assert all(row.kv_bytes == row.kv_bytes_formula for row in result.rows)
    assert result.rows[-1].speedup > 1, f"cached decode not faster at {result.rows[-1].context} tokens"


@pytest.mark.bench
def test_command_line_writes_json(tmp_path) -> None:
    path = tmp_path / "bench.json"
    main(["--contexts", "16", "64", "--repeats", "2", "--steps", "2", "--max-seq-len", "128",
          "--json", str(path)])
    data = json.loads(path.read_text())
    assert [row["context"] for row in data["rows"]] == [16, 64]
    assert set(data["fit"]) == {"cached", "recompute"}


@pytest.mark.slow
def test_vs_transformers_runs_the_same_model() -> None:
    """nanollm's decode step vs transformers' on the exported bundled checkpoint: same logits, times recorded."""
    pytest.importorskip("transformers")
    result = run_vs_transformers("retrieval-llama", contexts=(16, 64), repeats=2, warmup=1)
    assert [row["context"] for row in result["rows"]] == [16, 64]
    for row in result["rows"]:
        assert row["nanollm_ms"] > 0 and row["transformers_ms"] > 0
        assert row["ratio_hf_over_nanollm"] == pytest.approx(row["transformers_ms"] / row["nanollm_ms"])
        assert row["max_logit_diff"] < 1e-3
    assert "hf / nanollm" in format_vs_transformers(result)


def test_vs_transformers_is_skipped_without_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)     # `import transformers` fails
    assert run_vs_transformers() is None
    assert "skipped" in format_vs_transformers(None)


def test_each_median_comes_with_the_quartiles_of_its_repeats() -> None:
    assert quartiles([5.0, 1.0, 4.0, 2.0, 3.0]) == (2.0, 4.0) and quartiles([7.0]) == (7.0, 7.0)
    result = run_bench(preset("TINY", max_seq_len=64), contexts=[8, 16], repeats=3, steps=1)
    for row in result.rows:
        for mode in ("cached", "recompute"):
            q1, q3 = getattr(row, f"{mode}_iqr_ms")
            assert q1 <= getattr(row, f"{mode}_ms") <= q3, (mode, row)
