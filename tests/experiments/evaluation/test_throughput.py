"""
``python -m experiments.evaluation.throughput``: both ways of decoding many caches, side by side, on the bundled
model (the SmolLM2 numbers are in the README, from the command's default run).
"""

from __future__ import annotations

import json

import pytest

from experiments.evaluation import throughput


def test_both_ways_run_side_by_side_and_agree(tmp_path, capsys):
    out = tmp_path / "t.json"
    r = throughput.main(["--checkpoint", "retrieval-llama", "--methods", "snapkv", "h2o", "kvreviver",
                         "--keep-ratios", "0.25", "0.5", "--length", "160", "--steps", "3", "--repeats", "2",
                         "--bandwidth-mib", "64", "--quiet", "--json", str(out)])
    assert r["caches"] == 1 + 3 * 2 and r["configurations"][:2] == ["full", "snapkv@40"]
    assert r["prompt_tokens"] <= 160 - 3 and r["steps"] == 3
    assert r["speedup"] == pytest.approx(r["one_by_one_ms_per_step"] / r["batched_ms_per_step"])
    assert 0 < r["batched_own_attention_ms"] < r["batched_ms_per_step"]
    assert sorted(r["own_attention_ms_by_method"]) == ["full", "h2o", "kvreviver", "snapkv"]
    assert all(ms > 0 for ms in r["own_attention_ms_by_method"].values())
    bound = r["one_by_one_ms_per_step"] / r["batched_own_attention_ms"]     # Amdahl: the shared part at no cost
    assert r["speedup_if_shared_were_free"] == pytest.approx(bound)
    assert r["speedup_if_shared_were_free"] > r["speedup"]
    assert r["weight_read_ms_one_by_one"] == pytest.approx(7 * r["weight_read_ms_batched"])    # 7 caches, 1 block
    assert r["max_logit_difference"] < 1e-4                     # the same step, products rounded in blocks
    saved = json.loads(out.read_text())
    assert saved["provenance"]["command"].startswith("python -m experiments.evaluation.throughput")
    assert saved["speedup"] == r["speedup"]
    assert "faster per step" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--methods", "nope"], "--methods"),
    (["--keep-ratios", "0"], "--keep-ratios"),
    (["--task", "nope"], "--task"),
    (["--length", "3", "--steps", "8"], "--length"),
])
def test_bad_flags_fail_in_one_line_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        throughput.main(["--checkpoint", "retrieval-llama", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
