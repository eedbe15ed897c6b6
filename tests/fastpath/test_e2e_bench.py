"""``python -m fastpath.bench --e2e`` in its tiny mode on a CPU: every case, both paths, the report with its
provenance (the GPU run is ``fastpath/gpu_check.sh``)."""

import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastpath import bench, e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_e2e_quick_runs_on_a_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    written, write = [], bench.files.atomic_write_text

    def recorded(path, text):                         # each write of the report: after the first length, at the end
        written.append(json.loads(text)["complete"])
        write(path, text)
    monkeypatch.setattr(bench.files, "atomic_write_text", recorded)
    out = tmp_path / "e2e.json"
    bench.main(["--e2e", "--quick", "--json", str(out)])
    text = capsys.readouterr().out
    assert "no CUDA device" in text and "measured on CPU (cpu)" in text
    assert written == [False, True]
    assert "skinny: its kernels did not serve here" in text
    assert "skinny: its first step's logits differ from lean's by at most" in text
    assert "skinny: its last step's logits differ from lean's by at most" in text
    report = json.loads(out.read_text())
    assert all(r["skinny_kernels"] is False for r in report["rows"] if r["path"] == "skinny")
    assert report["device"] == "cpu" and report["quick"] and report["fused_backend"] == "eager"
    assert report["provenance"]["command"].endswith(str(out))
    cases = {(r["path"], r["method"], r["length"]) for r in report["rows"]}
    assert cases == {(p, m, S) for p in e2e.PATHS for m in e2e.METHODS_TIMED for S in e2e.QUICK_LENGTHS}
    for r in report["rows"]:
        assert r["ms"] > 0 and r["bytes"] == r["weight_bytes"] + r["kv_bytes"] > 0
        assert r["at_copy_bw_ms"] == pytest.approx(r["bytes"] / report["copy_bandwidth"] * 1e3)
        assert r["entries"] == (r["length"] if r["method"] == "full" else max(8, int(0.1 * r["length"])))
        assert r["warm_s"] > 0
        if r["path"] == "lean":                       # the first path: the others' logits are compared with its
            assert "logits_vs" not in r
        else:
            assert r["logits_vs"]["path"] == "lean" and r["logits_vs"]["max_diff"] <= 1e-5
            if r["method"] in e2e.RANKED_BY_ATTENTION:     # their caches may part: the first step alone
                assert "last_max_diff" not in r["logits_vs"]
            else:
                assert r["logits_vs"]["last_max_diff"] <= 1e-5
        if r["path"] != "lean":                       # the evicting methods: budget + 1 slots once full
            evicting = r["method"] in ("streaming_llm", "h2o", "scissorhands")
            assert r["capacity"] == r["entries"] + (1 if evicting else e2e.ROOM)
    if importlib.util.find_spec("transformers"):
        assert [r["path"] for r in report["transformers"]] == ["transformers_static"] * 2
    else:
        assert all(r.startswith("skipped: transformers") for r in report["transformers"])


def test_a_path_whose_logits_are_not_the_first_path_s_is_named():
    """The summary names, per path, its largest gap from the first path's first-step logits, and says where it
    is more than the tests allow between two paths (a kernel that computes another step: its time means
    nothing)."""
    rows = [{"path": "fused", "method": "full", "length": 8},
            {"path": "skinny", "method": "full", "length": 8, "logits_vs": {"path": "fused", "max_diff": 0.004}},
            {"path": "skinny", "method": "h2o", "length": 8, "logits_vs": {"path": "fused", "max_diff": 0.3}}]
    report = {"rows": rows, "dtype": str(torch.bfloat16)}
    assert e2e.logits_summary(report) == [
        "skinny: its first step's logits differ from fused's by at most 0.3 of the largest |logit| (h2o, S=8): "
        "more than the 0.02 the tests allow, not the same step"]
    rows[2]["logits_vs"]["max_diff"] = 0.001
    assert e2e.logits_summary(report)[0].endswith("by at most 0.004 of the largest |logit| (full, S=8)")
    assert e2e.logits_summary({"rows": rows, "dtype": str(torch.float32)})[0].endswith("not the same step")
    rows[1]["logits_vs"]["max_diff"] = float("inf")          # what ours records where a path's logits hold a NaN
    assert e2e.logits_summary(report)[0].endswith("(full, S=8): more than the 0.02 the tests allow, not the same step")
    assert e2e.logits_summary({"rows": rows[:1]}) == []


def test_a_path_with_nan_logits_is_recorded_as_infinitely_far(monkeypatch):
    """``ours`` records inf where a path's first logits hold a NaN (a broken kernel's usual output), which the
    summary then names; a NaN gap would compare as neither more nor less than the tolerance."""
    nan = torch.tensor([[1.0, float("nan"), 1.0], [1.0, 1.0, 1.0]])
    calls = iter([(torch.ones(2, 3), torch.ones(2, 3)), (nan, torch.ones(2, 3))])      # (first, last) a path
    monkeypatch.setattr(e2e, "weight_bytes", lambda *a: 0)
    monkeypatch.setattr(e2e, "one_path", lambda path, *a: ({"path": path, "method": "full", "length": 8},
                                                           *next(calls)))
    decoders = {"fused": SimpleNamespace(forget=lambda: None), "skinny": SimpleNamespace(forget=lambda: None)}
    cfg = SimpleNamespace(vocab_size=10)
    rows = e2e.ours(cfg, None, decoders, 2, 8, torch.float32, "cpu", 1.0, ["full"], True)
    assert "logits_vs" not in rows[0]
    assert rows[1]["logits_vs"] == {"path": "fused", "max_diff": float("inf"), "last_max_diff": 0.0}


@pytest.mark.slow
def test_e2e_times_the_paths_it_is_given(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    out = tmp_path / "e2e.json"
    bench.main(["--e2e", "--quick", "--paths", "fused", "skinny", "--length", "64", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["paths"] == ["fused", "skinny"] and report["complete"]
    assert {r["path"] for r in report["rows"]} == {"fused", "skinny"} and report["lengths"] == [64]


def test_the_bench_offers_every_path():
    assert bench.PATHS_ALL == e2e.PATHS


@pytest.mark.parametrize("flags", [["--hf-only"], ["--hf-compile"], ["--length", "64"], ["--paths", "fused"]])
def test_e2e_flags_are_checked(capsys, flags):
    with pytest.raises(SystemExit):
        bench.main(flags)
    assert "go with --e2e" in capsys.readouterr().err


@pytest.mark.parametrize("flags,says", [(["--tune", "--e2e"], "times the split kernel alone"),
                                        (["--tune"], "on a GPU")])
def test_tune_flags_are_checked(capsys, flags, says):
    if "--e2e" not in flags and torch.cuda.is_available():
        pytest.skip("a GPU tunes")
    with pytest.raises(SystemExit):
        bench.main(flags)
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


def test_the_fit_draws_a_line_through_two_lengths():
    rows = [{"method": "full", "path": "graph", "bytes": b, "ms": 1.0 + b / 1e9} for b in (1e9, 3e9)]
    rows += [{"method": "h2o", "path": "lean", "bytes": b, "ms": 5.0} for b in (1e9, 3e9)]
    got = e2e.fit(rows)
    assert got["full graph"]["fixed_ms"] == pytest.approx(1.0) and got["full graph"]["GB_per_s"] == pytest.approx(1e3)
    assert got["h2o lean"]["fixed_ms"] is None


def test_the_summary_of_the_committed_gpu_run():
    """``--summary`` computes the ratios the pages quote from the committed H100 report's step times: the
    full cache's fraction of the copy bandwidth, keep 0.1's speed-ups, transformers, and the targets."""
    report = json.loads((ROOT / "results" / "decode_e2e_h100.json").read_text())
    lines = e2e.summary(report)
    fused = {r["length"]: r for r in report["rows"] if r["path"] == "fused" and r["method"] == "full"}
    assert f"S=8192   fused: full {fused[8192]['ms']:.3f} ms = 58% of the copy bandwidth" in "\n".join(lines)
    snap = [r["ms"] for r in report["rows"] if (r["path"], r["method"], r["length"]) == ("fused", "snapkv", 8192)]
    assert f"snapkv {fused[8192]['ms'] / snap[0]:.2f}x" in lines[2]
    targets = {line.split(":")[0]: line for line in lines if line.startswith("targets ")}
    assert sorted(targets) == ["targets S=32768 fused", "targets S=32768 graph", "targets S=8192 fused",
                               "targets S=8192 graph"]
    assert "snapkv 1.567x >= 1.5x: met" in targets["targets S=8192 fused"]
    assert "h2o 1.123x >= 1.3x: not met" in targets["targets S=8192 fused"]
    assert "full 46.9% >= 50% of copy bw: not met" in targets["targets S=8192 graph"]
    assert "snapkv 2.836x >= 3.0x: not met" in targets["targets S=32768 fused"]


def test_a_cpu_run_prints_times_and_no_speed_up():
    """On a CPU the tiny shapes' times are per-call overhead: the summary says so in one line and prints the
    times, with no ratio, no "faster than" and no target verdict."""
    report = json.loads((ROOT / "results" / "decode_e2e_h100.json").read_text())
    report = {**report, "device": "cpu", "device_name": "CPU"}
    lines = e2e.summary(report)
    text = "\n".join(lines)
    assert any(line.startswith("on CPU: the times below are per-call overhead") for line in lines)
    assert "faster than" not in text and "x;" not in text and "targets" not in text and " ms" in text
    assert not any(re.search(r"\d\.\d+x", line) for line in lines if line.startswith("S="))


@pytest.mark.parametrize("summary", ["decode_e2e_h200_summary.txt", "decode_e2e_h100_summary.txt"])
def test_the_committed_summaries_are_what_summary_prints(summary, capsys):
    """Each committed summary holds, after each of its ``$ python -m fastpath.bench --summary REPORT`` lines,
    exactly what that command prints now: a change to the ratios' code (or a report) without the summary
    made again fails here."""
    text = (ROOT / "results" / summary).read_text()
    runs = re.findall(r"^\$ python -m fastpath\.bench --summary (\S+)\n(.*?)(?=^\$ |\Z)", text, re.M | re.S)
    assert len(runs) >= 3, summary
    for report, printed in runs:
        bench.main(["--summary", str(ROOT / report)])
        assert capsys.readouterr().out.strip() == printed.strip(), report


def test_the_summary_refuses_what_is_not_a_report(tmp_path, capsys):
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"rows": [{"path": "lean"}]}))
    with pytest.raises(SystemExit):
        bench.main(["--summary", str(bad)])
    assert "is not a report of python -m fastpath.bench --e2e" in capsys.readouterr().err


@pytest.mark.slow
def test_the_gpu_scripts_parse_and_refuse_an_unknown_stage(tmp_path):
    """The scripts a lent GPU runs parse here, and a misspelt stage stops before any work with one line."""
    import subprocess
    for script in ("fastpath/gpu_check.sh", "fastpath/gpu_wheels.sh"):
        assert subprocess.run(["bash", "-n", script], cwd=ROOT).returncode == 0, script
    run = subprocess.run(["bash", "fastpath/gpu_check.sh", str(tmp_path / "x.json"), "bench", "compre"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout.strip().startswith("unknown stage 'compre'")
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_gpu_script_refuses_a_misspelt_device(tmp_path):
    """``GPU_CHECK_DEVICE=gpu`` (a typo) took the CPU's path at full shapes; now one line, before any work."""
    import os
    import subprocess
    run = subprocess.run(["bash", "fastpath/gpu_check.sh", str(tmp_path / "x.json"), "bench"], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "GPU_CHECK_DEVICE": "gpu"})
    assert run.returncode == 2 and run.stdout.strip().startswith("GPU_CHECK_DEVICE=gpu: cuda"), run.stdout
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_signal_to_the_gpu_script_ends_its_stage(tmp_path):
    """``kill -TERM`` to gpu_check.sh ended the script and left its stage running (and writing its report);
    now the stage's whole session ends with it. Dry run on the CPU, the tests stage (pytest on one file)."""
    import os
    import signal
    import subprocess
    import time
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "TESTS": "tests/kernels"}
    proc = subprocess.Popen(["bash", "fastpath/gpu_check.sh", str(tmp_path / "x.json"), "tests"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = str(tmp_path / "x.json")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (tmp_path / "x.tests.txt").exists():
        time.sleep(0.2)
    time.sleep(2)                                     # pytest is running its tests
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert proc.returncode == 143 and not left, (proc.returncode, left)


def test_the_profile_counts_kernels_not_the_host_s_calls_that_launch_them():
    """On a GPU the profiler also records each Triton launch's ``cuLaunchKernelEx`` (a host call, given device
    time of its own) and its buffer requests: counted as kernels, they made the H200's full cache at 8,192
    tokens 476 "kernels" a step where the other profiles count 320. Rows as that profile recorded them."""
    from fastpath import profile
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(key, count, us, device_type):
        return SimpleNamespace(key=key, count=count, self_device_time_total=us, device_type=device_type)
    recorded = [event("_decode_split_kernel", 44, 2428.0, cuda),
                event("Memcpy DtoD (Device -> Device)", 88, 98.2, cuda),
                event("cuLaunchKernelEx", 310, 69.8, cpu), event("cudaLaunchKernel", 200, 3.0, cpu),
                event("Activity Buffer Request", 1, 6.2, cuda), event("aten::mm", 88, 0.0, cpu),
                event("nvjet_sm90_tst_128x16_64x11_4x1_v_bz_TNT", 44, 604.0, cpu)]
    kernels = profile.kernels_of(SimpleNamespace(key_averages=lambda: recorded), "cuda")
    assert sorted(kernels) == ["Memcpy DtoD (Device -> Device)", "_decode_split_kernel",
                               "nvjet_sm90_tst_128x16_64x11_4x1_v_bz_TNT"]
    assert kernels["_decode_split_kernel"] == (44, 2428.0)


@pytest.mark.slow
def test_the_profile_names_each_method_s_operations(tmp_path):
    """``python -m fastpath.profile --quick`` on the CPU (its dry run): a table per method whose rows add up,
    H2O's step doing more than the full cache's (its scores and its eviction), and the provenance in --out."""
    from fastpath import profile
    out = tmp_path / "profile.txt"
    profile.main(["--quick", "--device", "cpu", "--methods", "full", "h2o", "--out", str(out)])
    text = out.read_text()
    assert text.startswith("# command: ") and "full at 64 tokens" in text and "h2o at 64 tokens" in text
    per_step = {m: float(re.search(rf"{m} at 64 tokens: (\d+) operators", text).group(1)) for m in ("full", "h2o")}
    assert per_step["h2o"] > per_step["full"] > 0
    assert "aten::mm" in text and "aten::view " not in text


@pytest.mark.slow                  # torch.compile of transformers' step: seconds on a CPU
def test_transformers_compiled_step_copies_the_kv_heads():
    """What ``fastpath/README.md`` says of transformers' compiled ``StaticCache`` step, on the installed version:
    under ``torch.compile`` its decode step hands ``scaled_dot_product_attention`` keys and values copied out to
    every query head (H, not H_kv, heads), with a mask over the cache's slots. A version that keeps the heads
    grouped there fails this test, and the README's account of that baseline's time is then to be redone."""
    transformers = pytest.importorskip("transformers")
    import inspect
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).eval()
    cache = transformers.StaticCache(config=cfg, max_cache_len=40)
    cache.update(torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8), 0)       # a prompt of 16: (B, H_kv, T, d)
    calls = []

    def backend(gm, example_inputs):                    # the traced graph's attention calls, their shapes
        for node in gm.graph.nodes:
            if "scaled_dot_product" in str(node.target):
                shape = lambda a: tuple(a.meta["example_value"].shape)          # noqa: E731
                calls.append(([shape(a) for a in node.args[:3]], shape(node.kwargs["attn_mask"])))
        return gm.forward
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    step = torch.compile(model.forward, fullgraph=True, backend=backend)
    with torch.no_grad():
        step(input_ids=torch.zeros(2, 1, dtype=torch.long), use_cache=True, **{name: cache})
    assert calls == [([(2, 8, 1, 8), (2, 8, 40, 8), (2, 8, 40, 8)], (2, 1, 1, 40))]
