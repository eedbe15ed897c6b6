"""The split kernel's launch settings: ``kernels.decode_attention.TUNED`` read by every launch that gives none, and
``fastpath.tune`` choosing them (in Triton's interpreter on a CPU, with a timer of the test's own)."""

import json

import pytest
import torch

import kernels
import kernels.decode_attention as dec
from fastpath import e2e, tune
from kernels.decode_attention import Launch, masked_decode_attention_triton, reference_masked_decode_attention

pytestmark = pytest.mark.skipif(not kernels.HAS_TRITON or not (kernels.interpreting() or torch.cuda.is_available()),
                                reason="no way to run a Triton kernel: triton is not installed, or there is no "
                                       "CUDA device and TRITON_INTERPRET is not 1")
DEVICE = "cpu" if kernels.interpreting() else "cuda"
SHAPE = dict(B=2, H=4, H_kv=2, S=40, d=16, dtype=torch.float32, device=DEVICE, room=5)
KEY = (16, torch.float32, 45)                # SHAPE's head size, dtype and slots: where its sweep is recorded


@pytest.fixture(autouse=True)
def untuned(monkeypatch):
    """Every test starts and ends with nothing tuned."""
    monkeypatch.setattr(dec, "TUNED", {})
    monkeypatch.setattr(tune, "TUNED", dec.TUNED)


def fake_timer(costs: dict):
    """A timer that reads which launch is being timed from ``TUNED`` (the tuner sets it before each call) and
    returns that launch's cost in ``costs`` (by tokens per block), after running the call once."""
    def time_ms(fn):
        fn()
        return costs[dec.TUNED[KEY].block_n]
    return time_ms


def test_a_launch_without_settings_reads_them_from_tuned():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 16, generator=g).to(DEVICE)
    k, v = (torch.randn(1, 2, 70, 16, generator=g).to(DEVICE) for _ in range(2))
    pos = torch.arange(70, device=DEVICE).expand(1, 2, 70).clone()
    pos[..., 60:] = -1
    assert dec.split_plan(q, k, 70)[0] == 32                                      # the default for fp32
    dec.TUNED[(16, torch.float32, 70)] = Launch(16, 2)
    assert dec.split_plan(q, k, 70)[0] == 16                                      # 5 blocks of 16 tokens
    assert dec.split_plan(q, k, 70, block_n=64)[0] == 64                         # given settings win
    assert dec.launch_settings(k, 64) == Launch(64, dec.DEFAULT_PER_SM)           # with the defaults, not TUNED's
    assert dec.split_plan(q.to(torch.bfloat16), k.to(torch.bfloat16), 70)[0] == 64   # another dtype: untouched
    torch.testing.assert_close(masked_decode_attention_triton(q, k, v, pos),
                               reference_masked_decode_attention(q, k, v, pos), rtol=0, atol=1e-5)


def test_a_cache_takes_the_launch_timed_on_the_nearest_number_of_slots():
    """Settings are kept by the slots they were timed on (a full cache's and a tenth's differ); a cache takes
    those of the nearest number by ratio, the defaults where none was timed for its head size and dtype."""
    dec.TUNED[(16, torch.float32, 40)] = Launch(16, 8)
    dec.TUNED[(16, torch.float32, 400)] = Launch(64, 1)
    slots = lambda n, dtype=torch.float32: torch.empty(1, 2, n, 16, dtype=dtype)   # noqa: E731
    assert dec.launch_settings(slots(40)) == Launch(16, 8)
    assert dec.launch_settings(slots(100)) == Launch(16, 8)                       # 2.5x from 40, 4x from 400
    assert dec.launch_settings(slots(150)) == Launch(64, 1)                       # 3.75x from 40, 2.7x from 400
    assert dec.launch_settings(slots(5000)) == Launch(64, 1)
    assert dec.launch_settings(slots(40, torch.bfloat16)) == dec.default_launch(torch.bfloat16)
    assert dec.launch_settings(slots(5000), slots=45) == Launch(16, 8)          # the rows a gather walks


def test_a_sweep_that_fails_leaves_the_defaults_for_its_slots(monkeypatch):
    """Not the settings another number of slots chose: a tenth's caches whose sweep failed would otherwise
    take the full cache's."""
    dec.TUNED[(16, torch.float32, 400)] = Launch(16, 8)
    monkeypatch.setattr(tune, "serves", lambda t: True)
    monkeypatch.setattr(tune, "tune_attention", lambda *a, **k: 1 / 0)
    sweep = tune.tune_or_say_why(2, 4, 2, 40, 16, torch.float32, DEVICE, room=5)
    assert "ZeroDivisionError" in sweep["error"]
    assert dec.launch_settings(torch.empty(1, 2, 45, 16)) == dec.default_launch(torch.float32)


def test_a_sweep_keeps_what_other_numbers_of_slots_chose():
    """Tuning one cache's slots leaves another's settings, and its default row and reference are the
    defaults, not the settings tuned on other slots."""
    dec.TUNED[(16, torch.float32, 400)] = Launch(16, 8)
    sweep = tune.tune_attention(**SHAPE, candidates=(Launch(16, 1),), time_ms=fake_timer({32: 2.0, 16: 1.0}))
    assert sweep["default"]["block_n"] == 32 and dec.TUNED[KEY] == Launch(16, 1)
    assert dec.TUNED[(16, torch.float32, 400)] == Launch(16, 8)


def test_the_fastest_correct_launch_is_chosen_and_recorded():
    candidates = (Launch(16, 1, 4, 2), Launch(64, 2, 4, 3))
    sweep = tune.tune_attention(**SHAPE, candidates=candidates, time_ms=fake_timer({32: 3.0, 16: 1.0, 64: 2.0}))
    assert dec.TUNED[KEY] == Launch(16, 1, 4, 2)
    assert [r["block_n"] for r in sweep["rows"]] == [32, 16, 64]                 # the default first
    assert sweep["default"]["default"] and sweep["best"]["ms"] == 1.0
    assert all(r["max_diff"] <= 1e-5 for r in sweep["rows"])
    assert sweep["kv_bytes"] == 2 * 2 * 2 * 40 * 16 * 4                          # the S entries' K and V
    json.dumps(sweep)                                                             # it goes into a report
    lines = tune.summary(sweep)
    assert "16 tokens a block" in lines[2] and "3.00x the default's speed" in lines[3]


def test_a_launch_that_fails_is_recorded_not_chosen():
    """block_n 24 is not a power of two: the launcher refuses it. The timer would rank it fastest."""
    sweep = tune.tune_attention(**SHAPE, candidates=(Launch(24, 1),), time_ms=fake_timer({32: 2.0, 24: 0.1}))
    assert dec.TUNED[KEY].block_n == 32
    assert "power of two" in sweep["rows"][1]["error"] and "ms" not in sweep["rows"][1]


def test_a_launch_whose_output_differs_is_not_timed(monkeypatch):
    """A launch that computed something else must not win on its speed: here every launch with 16 tokens a
    block is made to return a wrong output."""
    real = tune.masked_decode_attention_triton

    def wrong_at_16(q, k, v, pos):
        out = real(q, k, v, pos)
        tuned = dec.TUNED.get(KEY)               # the launch being tried (the default's first)
        return out + 1e-3 if tuned is not None and tuned.block_n == 16 else out
    monkeypatch.setattr(tune, "masked_decode_attention_triton", wrong_at_16)
    sweep = tune.tune_attention(**SHAPE, candidates=(Launch(16, 1),), time_ms=fake_timer({32: 2.0, 16: 0.1}))
    assert dec.TUNED[KEY].block_n == 32
    assert "differs from the default launch's" in sweep["rows"][1]["error"]


def test_nothing_that_runs_leaves_tuned_as_it_was():
    dec.TUNED[KEY] = Launch(16, 4)
    with pytest.raises(RuntimeError, match="no launch"):
        tune.tune_attention(**SHAPE, candidates=(), time_ms=lambda fn: 1 / 0)   # the default's timing fails too
    assert dec.TUNED[KEY] == Launch(16, 4)


def test_a_cpu_has_nothing_to_time():
    with pytest.raises(ValueError, match="on a GPU"):
        tune.tune_attention(1, 2, 1, 8, 16, torch.float32, "cpu")


def test_the_e2e_summary_says_what_was_tuned():
    sweep = tune.tune_attention(**SHAPE, candidates=(Launch(16, 1, 4, 2),), time_ms=fake_timer({32: 3.0, 16: 1.5}))
    report = {"tuned": {"40": sweep}, "rows": [], "lengths": [], "preset": "x", "batch": 2, "quick": True}
    assert e2e.summary(report) == ["S=40     tuned: 16 tokens a block, 1 programs per SM, 4 warps, 2 stages: the "
                                   "split kernel alone 1500.0 us against the default launch's 3000.0 us"]
    kv = sweep["kv_bytes"]                                  # with the copy bandwidth: each launch's share of it
    sweep = tune.tune_attention(**SHAPE, candidates=(Launch(16, 1, 4, 2),), time_ms=fake_timer({32: 3.0, 16: 1.5}),
                                bandwidth=kv / 2e-3)        # the bytes in 2 ms: 1.5 ms is 133%, 3 ms 67%
    report["tuned"]["40"] = sweep
    assert e2e.summary(report)[0].endswith("alone 1500.0 us (133% of the copy bandwidth) against the default "
                                           "launch's 3000.0 us (67% of the copy bandwidth)")
    report["tuned"]["400 keep"] = sweep                     # a tenth of 400 tokens kept: SHAPE's 40 entries
    assert e2e.summary(report)[1].startswith("S=400    tuned at 40 entries: 16 tokens a block")


def test_where_the_kernels_do_not_serve_a_bench_goes_on_untuned():
    """On a CPU (or NANOKV_NO_TRITON=1) the e2e bench's tuning says why it did not tune, in its report and its
    summary, and leaves the defaults; so does a sweep that fails."""
    sweep = tune.tune_or_say_why(1, 2, 1, 8, 16, torch.float32, "cpu", room=0)
    assert "do not serve" in sweep["error"] and not dec.TUNED
    assert tune.summary(sweep) == [f"the split kernel's launch: {sweep['error']}"]
    report = {"tuned": {"8": sweep}, "rows": [], "lengths": [], "preset": "x", "batch": 1, "quick": True}
    assert e2e.summary(report) == [f"S=8      {sweep['error']}"]


def test_the_skinny_products_are_tuned_one_by_one(monkeypatch):
    """``tune_skinny`` times, for each product of a step, the kernel's default launch, each candidate and
    cuBLAS's product alone (a timer of the test's own, by call order), checks each output against the
    reference, and keeps the fastest per (variant, N, K, dtype), which a launch without settings then takes."""
    import kernels.skinny_matmul as sk
    from nanollm import preset
    monkeypatch.setattr(sk, "SKINNY_TUNED", {})
    monkeypatch.setattr(tune, "SKINNY_TUNED", sk.SKINNY_TUNED)
    cfg = preset("TINY")
    fast, slow = sk.SkinnyLaunch(32, 32, 4, 2), sk.SkinnyLaunch(16, 64, 4, 2)
    costs = iter([3.0, 1.0, 2.0, 5.0] * 5)              # per product: default, fast, slow, cuBLAS

    def time_ms(fn):
        fn()
        return next(costs)
    sweeps = tune.tune_skinny(cfg, 3, torch.float32, DEVICE, candidates=(fast, slow), time_ms=time_ms)
    assert list(sweeps) == ["qkv", "o", "gate_up", "down", "head"]
    for name, (variant, N, K) in tune.step_products(cfg).items():
        s = sweeps[name]
        assert (s["variant"], s["N"], s["K"]) == (variant, N, K)
        assert s["cublas"]["ms"] == 5.0 and s["default"]["ms"] == 3.0
        assert all(row["max_diff"] <= sk.TOLERANCE[torch.float32] for row in s["sweep"])
        assert sk.SKINNY_TUNED[(variant, N, K, torch.float32)] == fast
    assert tune.step_products(cfg)["gate_up"] == ("norm_swiglu", cfg.d_ff, cfg.d_model)
    assert tune.step_products(cfg)["qkv"] == ("qkv_rope_write", (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim,
                                              cfg.d_model)               # the skinny step's, RoPE and write in it
    lines = tune.skinny_summary(sweeps)
    assert len(lines) == 5 and "32 columns a program" in lines[0]
    with pytest.raises(ValueError, match="on a GPU"):
        tune.tune_skinny(cfg, 3, torch.float32, "cpu")


def test_timings_walk_through_copies_that_l2_does_not_hold(monkeypatch):
    """A timing reads its input from copies three times the L2's size in all (at most 64, one on a CPU or where
    torch gives no size): a layer's weights and K/V, read once a step, are never in L2 in a real step."""
    from types import SimpleNamespace
    monkeypatch.setattr(tune.torch.cuda, "get_device_properties", lambda d: SimpleNamespace(L2_cache_size=50_000_000))
    assert tune.copies_past_l2(8_000_000, "cuda") == 19                         # 150 MB / 8 MB, rounded up
    assert tune.copies_past_l2(200_000_000, "cuda") == 1
    assert tune.copies_past_l2(1_000, "cuda") == tune.MAX_COPIES
    assert tune.copies_past_l2(8_000_000, "cpu") == 1
    monkeypatch.setattr(tune.torch.cuda, "get_device_properties", lambda d: SimpleNamespace())
    assert tune.copies_past_l2(8_000_000, "cuda:0") == 1
