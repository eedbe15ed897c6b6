"""
The compression-speedup benchmark (``python -m experiments.evaluation.bench``) at tiny sizes.

No timing is asserted (a shared machine is noisy): what is checked is that the command line runs and records
every number, that the bytes it says a step reads are what the storage holds, that the hand-built prefill
compresses a cache to the method's budget, that a failing method is reported rather than hidden, and that
bad arguments stop it with one ``error:`` line before any work.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.evaluation.bench import (
    BenchCase,
    bench_config,
    bench_context,
    compress_as_prefill,
    filled_cache,
    format_result,
    main,
    random_entries,
    random_queries,
)
from methods import make_policy
from nanollm import Transformer, cli

ROOT = Path(__file__).resolve().parents[3]
CONFIG = bench_config(max_seq_len=1024)


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CONFIG).eval()


def entry_bytes(config) -> int:
    """K/V bytes of one token in one layer and every KV head (fp32)."""
    return 2 * config.n_kv_head * config.head_dim * 4


@pytest.mark.slow
def test_command_line_writes_every_number(tmp_path) -> None:
    """The real command, as a user runs it (a subprocess, so the prefill children are spawned from it)."""
    out, fig = tmp_path / "bench.json", tmp_path / "bench.png"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "experiments.evaluation.bench", "--contexts", "256", "512",
                             "--steps", "2", "--warmup", "1", "--methods", "snapkv", "h2o", "--keep-ratios", "0.25",
                             "--prefill-context", "128", "--bandwidth-mib", "16", "--quiet",
                             "--json", str(out), "--plot", str(fig)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["config"]["n_kv_head"] == 8 and data["threads"] == 1
    assert data["bandwidth"]["gb_per_s"] > 0 and data["fixed_context"] == 64
    assert [(r["context"], r["method"], r["keep_ratio"]) for r in data["rows"]] == [
        (c, m, k) for c in (256, 512) for m, k in (("full", None), ("snapkv", 0.25), ("h2o", 0.25))]
    for r in data["rows"]:
        assert r["status"] == "ok", r
        assert len(r["step_ms_all"]) == 2 and r["step_ms"] > 0 and r["gb_per_s"] > 0 and r["speedup"] > 0
        assert r["fixed_ms"] > 0 and r["bound_speedup"] >= 1.0
        assert r["ideal_speedup"] == (1.0 if r["keep_ratio"] is None else 4.0)
        if r["keep_ratio"] is not None:
            assert r["budget"] == round(0.25 * r["context"]) and r["compress_ms"] >= 0
            assert r["kv_bytes"] < data["rows"][0]["kv_bytes"] * r["context"] / 256      # compressed
    prefill = data["prefill"]
    assert prefill["context"] == 128 and [r["method"] for r in prefill["rows"]] == ["full", "snapkv", "h2o"]
    for r in prefill["rows"]:
        assert "error" not in r, r
        assert r["wall_s"] > 0 and r["cache_bytes"] > 0
        if sys.platform.startswith("linux"):
            assert r["peak_bytes"] >= r["baseline_bytes"] > 0 and r["beyond_bytes"] is not None
    assert "speedup" in result.stdout and "real prefill of 128 tokens" in result.stdout
    assert fig.stat().st_size > 0


def test_bytes_read_are_what_the_storage_holds(model) -> None:
    """kv_bytes is the storage at the moment a step attends: the whole cache for the full cache and SnapKV
    (nothing is evicted after the prompt), one entry per head more than what H2O keeps after its eviction."""
    T, warmup, steps = 256, 1, 2
    variants = [BenchCase("full"), BenchCase("snapkv", 0.25), BenchCase("h2o", 0.25)]
    rows, fixed_ms = bench_context(model, CONFIG, T, variants, prompt_queries=16, warmup=warmup, steps=steps,
                                   seed=0, time_limit_s=60.0)
    full, snap, h2o = rows
    assert all(r.status == "ok" and len(r.step_ms_all) == steps for r in rows) and fixed_ms > 0
    tokens = T + warmup + steps + 1                                   # + the step that counted the bytes
    assert full.kv_bytes == full.cache.nbytes() == CONFIG.kv_bytes_per_token() * tokens
    assert snap.kv_bytes == snap.cache.nbytes() == CONFIG.n_layer * entry_bytes(CONFIG) * (64 + warmup + steps + 1)
    assert h2o.kv_bytes == h2o.cache.nbytes() + CONFIG.n_layer * entry_bytes(CONFIG) == \
        CONFIG.n_layer * entry_bytes(CONFIG) * (64 + 1)
    assert all(r.attended_bytes == r.kv_bytes for r in rows)         # none of them rebuilds entries
    assert full.entries_per_head == tokens and h2o.entries_per_head == 65


@pytest.mark.parametrize("spec", ["snapkv", "h2o", "streaming_llm", "adakv", "scissorhands"])
def test_hand_built_prefill_compresses_to_the_budget(model, spec) -> None:
    """After the on_prefill hooks, every layer holds about ``budget`` entries per KV head: the layer total
    is between H_kv * budget and H_kv * (budget + slack), and no head exceeds budget + slack + head_slack."""
    T, budget = 512, 128
    gen = torch.Generator().manual_seed(0)
    policy = make_policy(spec, budget=budget)
    cache = filled_cache(CONFIG, random_entries(CONFIG, T, gen), policy)
    assert cache.seen == T and all(len(layer) == T and bool((layer.pos >= 0).all()) for layer in cache.layers)
    ms = compress_as_prefill(model, cache, random_queries(CONFIG, 32, gen))
    assert ms >= 0 and cache.seen == T
    H_kv, slack = CONFIG.n_kv_head, policy.slack(T, 0)
    for layer in cache.layers:
        counts = layer.counts()[0]                                   # (H_kv,) occupied slots per head
        assert H_kv * budget <= int(counts.sum()) <= H_kv * (budget + slack), (spec, counts)
        assert int(counts.max()) <= budget + slack + policy.head_slack(H_kv)
        kept = layer.pos[layer.pos >= 0]
        assert int(kept.max()) == T - 1                               # the newest token is always kept


def test_a_failing_method_is_reported_not_hidden(model, monkeypatch) -> None:
    class Broken(type(make_policy("snapkv", budget=8))):
        def on_decode(self, ctx):
            raise RuntimeError("broken on purpose")

    monkeypatch.setattr("experiments.evaluation.bench.make_policy", lambda spec, budget: Broken(budget=budget))
    rows, _ = bench_context(model, CONFIG, 128, [BenchCase("full"), BenchCase("snapkv", 0.25)], prompt_queries=8,
                            warmup=1, steps=1, seed=0, time_limit_s=60.0)
    assert rows[0].status == "ok"
    assert rows[1].status == "error" and "broken on purpose" in rows[1].note and rows[1].cache is None


def test_a_slow_method_is_stopped_and_reported(model) -> None:
    rows, _ = bench_context(model, CONFIG, 128, [BenchCase("full"), BenchCase("h2o", 0.5)], prompt_queries=8,
                            warmup=0, steps=3, seed=0, time_limit_s=1e-9)     # every step is "too slow"
    assert all(r.status == "skipped" and "--time-limit" in r.note and len(r.step_ms_all) == 1 for r in rows)


def test_format_shows_errors_and_skips() -> None:
    row = dict(context=64, method="h2o", keep_ratio=0.1, budget=6, status="error", note="ValueError: boom",
               compress_ms=None, step_ms=None, step_ms_all=[], kv_bytes=None, attended_bytes=None,
               slot_bytes=None, read_bytes=None,
               entries_per_head=None, fixed_ms=None, gb_per_s=None, ideal_speedup=10.0, speedup=None,
               bound_speedup=None)
    result = {"config": CONFIG.to_dict(), "weight_bytes": 1, "kv_bytes_per_token": 4096, "threads": 1,
              "bandwidth": {"gb_per_s": 10.0, "tensor_mib": 16}, "fixed_context": 64, "steps": 1,
              "warmup": 0, "prompt_queries": 8, "contexts": [64], "rows": [row],
              "prefill": {"context": 0, "rows": []}}
    text = format_result(result)
    assert "ERROR: ValueError: boom" in text and "no full-cache measurement" in text


@pytest.mark.parametrize("args, names", [
    (["--keep-ratios", "1.5"], ["--keep-ratios", "(0, 1]"]),
    (["--keep-ratios", "0"], ["--keep-ratios"]),
    (["--methods", "nosuch"], ["--methods", "nosuch"]),
    (["--methods", "snapkv(streaming)"], ["--methods", "streaming"]),
    (["--contexts", "256", "--prompt-queries", "300"], ["--prompt-queries", "256"]),
    (["--steps", "0"], ["--steps"]),
    (["--warmup", "-1"], ["--warmup"]),
    (["--prefill-context", "x"], ["--prefill-context"]),
    (["--json", "{tmp}/no/such/folder/out.json"], ["--json", "does not exist"]),
    (["--plot", "{tmp}/out.txt"], ["--plot", "figure format"]),
    (["--json", "{tmp}/same.png", "--plot", "{tmp}/same.png"], ["--json", "--plot"]),
])
def test_bad_arguments_give_one_error_line(args, names, tmp_path, capsys) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    with pytest.raises(SystemExit) as e:
        main(args + ["--quiet"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    assert list(tmp_path.iterdir()) == []                              # nothing written


def test_help_explains_every_flag(monkeypatch) -> None:
    """As tests/nanollm/cli/test_cli.py checks every command: each flag has a help that gives its default, and the help
    names no flag the command does not have."""
    class Parsed(Exception):
        pass

    def stop(self, *args, **kwargs):
        raise Parsed(self)

    monkeypatch.setattr(cli.ArgumentParser, "parse_args", stop)       # build the parser, parse nothing
    with pytest.raises(Parsed) as e:
        main([])
    parser = e.value.args[0]
    flags = [f for a in parser._actions for f in a.option_strings]
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help"
            if action.default not in (None, False):
                assert "default" in action.help.lower(), f"{action.option_strings}: help gives no default"
    for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", parser.format_help()):
        assert flag in flags, f"--help mentions {flag}, which the command does not have"
