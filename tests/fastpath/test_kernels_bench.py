"""``python -m fastpath.bench`` on a machine without a GPU: a clear message, the references' timings, JSON."""

import json

import pytest

from fastpath import bench


@pytest.mark.slow
def test_bench_runs_the_references_on_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    out = tmp_path / "k.json"
    bench.main(["--quick", "--cases", "dense", "tensor", "--json", str(out)])
    text = capsys.readouterr().out
    assert "no CUDA device" in text and "dense B=" in text and "tensor i=128" in text
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["targets"] == {}
    dense = report["rows"][0]
    assert set(dense["ms"]) == {"reference", "sdpa"} and dense["bytes"] > 0
    assert report["rows"][-1]["flops"] == 4 * 8 * 128 * 128 * 64


def test_bench_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--cases", "nope"])
    assert "invalid choice" in capsys.readouterr().err
