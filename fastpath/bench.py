"""
Benchmark the kernels against their PyTorch references, side by side in one run: ``python -m fastpath.bench``.

For every case (dense, selected, sketch, tensor): our Triton kernel's time, the reference's (and
``scaled_dot_product_attention``'s for dense decode), the bytes the step must move at least, the achieved
bandwidth and its share of a device-to-device copy's, measured in the same run; each case's target checked.
On a CPU the kernels run only in Triton's interpreter: the references alone are timed.

    python -m fastpath.bench --json results/kernels_bench.json
    python -m fastpath.bench --e2e --quick                  # whole decode steps (fastpath/e2e.py)
    python -m fastpath.bench --summary results/decode_e2e_h200.json

How it times, and the cases' targets: fastpath/inside.md, "bench.py and profile.py".
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from kernels import HAS_TRITON
from kernels.decode_attention import (
    decode_attention_triton,
    reference_decode_attention,
    reference_selected_decode_attention,
    selected_decode_attention_triton,
)
from nanollm import PRESETS, cli, preset
from nanollm.cli.provenance import provenance
from nanollm.cli.timing import median_ms
from nanollm.io import files

PATHS_ALL = ("lean", "graph", "fused", "skinny")          # --paths' choices, e2e.PATHS (imported late: e2e is heavy)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}     # --dtype's choices
EAGER: list[str] = []      # what could not be timed in a CUDA graph (it synchronises with the host)


def timer(device: str):
    """Median milliseconds of a function. On a GPU: ``do_bench_cudagraph``, the call captured in a CUDA
    graph and replayed, as a serving loop runs its decode step, so that Python's launch overhead (tens of
    microseconds per call) hides no kernel's own time; a function that synchronises with the host cannot be
    captured and is timed with plain ``do_bench`` (noted in ``EAGER``). On CPU: interleaved perf_counter
    repeats."""
    if device == "cuda":
        import triton.testing

        def gpu(fn, label: str = "") -> float:
            try:
                return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
            except Exception as e:                     # noqa: BLE001  (a capture error: time it eagerly)
                torch.cuda.synchronize()
                EAGER.append(f"{label or getattr(fn, '__qualname__', 'a function')}: {type(e).__name__}")
                return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        return gpu

    def cpu(fn, label: str = "", repeats: int = 5) -> float:
        return median_ms(fn, repeats, warmup=1)
    return cpu


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Measured bytes/s of a device-to-device copy (read + write), the practical ceiling of a memory-bound
    kernel on this device."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    if device == "cuda":       # one long copy: no launch overhead to hide, and a plain call reads faster
        import triton.testing  # than its CUDA-graph replay on an H100 (3.0 vs 2.4 TB/s): the higher ceiling
        ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=100, return_mode="median")
    else:
        ms = timer(device)(lambda: y.copy_(x))
    return 2 * x.nbytes / (ms / 1e3)


def row(name: str, nbytes: int, times: dict, bandwidth: float, **extra) -> dict:
    out = {"case": name, "bytes": nbytes, "ms": times, **extra}
    out["GB/s"] = {k: nbytes / (ms / 1e3) / 1e9 for k, ms in times.items()}
    out["fraction_of_copy_bw"] = {k: nbytes / (ms / 1e3) / bandwidth for k, ms in times.items()}
    return out


def kv(B, H, H_kv, S, d, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, d, generator=g, device=device, dtype=dtype)
    k = torch.randn(B, H_kv, S, d, generator=g, device=device, dtype=dtype)
    v = torch.randn(B, H_kv, S, d, generator=g, device=device, dtype=dtype)
    return q, k, v


def dense_cases(device: str, quick: bool, kernels_on: bool, bandwidth: float, dtype) -> list[dict]:
    rows = []
    H, H_kv, d = 32, 8, 128
    shapes = [(8, 32768), (1, 131072)] if not quick else [(2, 1024), (1, 4096)]
    bench = timer(device)
    for B, S in shapes:
        q, k, v = kv(B, H, H_kv, S, d, dtype, device)
        nbytes = k.nbytes + v.nbytes + 2 * q.nbytes
        times = {"reference": bench(lambda: reference_decode_attention(q, k, v))}
        qs = q[:, :, None]
        times["sdpa"] = bench(lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True))
        if kernels_on:
            times["triton"] = bench(lambda: decode_attention_triton(q, k, v))
        rows.append(row(f"dense B={B} S={S}", nbytes, times, bandwidth, B=B, S=S, H=H, H_kv=H_kv, d=d))
    return rows


def selected_cases(device: str, quick: bool, kernels_on: bool, bandwidth: float, dtype) -> list[dict]:
    B, H, H_kv, d = (8, 32, 8, 128) if not quick else (2, 32, 8, 128)
    S = 32768 if not quick else 2048
    K = S // 10
    q, k, v = kv(B, H, H_kv, S, d, dtype, device)
    g = torch.Generator(device=device).manual_seed(1)
    idx = torch.rand(B, H_kv, S, generator=g, device=device).topk(K, dim=-1).indices.sort(-1).values
    rows_ = idx[..., None].expand(-1, -1, -1, d)
    kc, vc = k.gather(2, rows_).contiguous(), v.gather(2, rows_).contiguous()       # a compacted cache
    bench = timer(device)
    nbytes = kc.nbytes + vc.nbytes + idx.shape[-1] * B * H_kv * 4 + 2 * q.nbytes
    times = {"reference": bench(lambda: reference_selected_decode_attention(q, k, v, idx),
                                "selected reference (checks idx on the host)")}
    full, compact = {}, {}
    if kernels_on:
        idx32 = idx.to(torch.int32).contiguous()              # checked once here, not inside the timed call
        selected_decode_attention_triton(q, k, v, idx32)
        times["triton"] = bench(lambda: selected_decode_attention_triton(q, k, v, idx32, validate=False))
        full["triton"] = bench(lambda: decode_attention_triton(q, k, v))
        compact["triton"] = bench(lambda: decode_attention_triton(q, kc, vc))
    return [row(f"selected keep 0.1 B={B} S={S}", nbytes, times, bandwidth, B=B, S=S, K=K,
                full_cache_ms=full, compacted_ms=compact)]


def sketch_cases(device: str, quick: bool, kernels_on: bool, bandwidth: float, dtype) -> list[dict]:
    """KVReviver at a 25% budget of S tokens (batch 1): 90% of the budget raw, 10% sketch cells (3 rows),
    every other token rebuilt from the sketch inside the kernel; against dense decode over all S tokens and
    against rebuilding in PyTorch then attending."""
    from kernels.count_sketch import reference_sketch_decode_attention, sketch_decode_attention_triton
    H, H_kv, d, r = 32, 8, 128, 3
    S = 32768 if not quick else 2048
    budget = S // 4
    n_raw, width = int(0.9 * budget), max(1, int(0.1 * budget) // r)
    n_v = S - n_raw
    q, k, v = kv(1, H, H_kv, S, d, dtype, device)
    k_raw, v_raw = k[0, :, :n_raw], v[0, :, :n_raw]                                  # (H_kv, n_raw, d)
    g = torch.Generator(device=device).manual_seed(2)
    key = torch.randn(r, width, H_kv, d, generator=g, device=device)
    value = torch.randn(r, width, H_kv, d, generator=g, device=device)
    cells = torch.randint(0, width, (r, n_v), generator=g, device=device, dtype=torch.int32)
    signs = torch.randint(0, 2, (r, n_v), generator=g, device=device).float() * 2 - 1
    scale = d ** -0.5
    bench = timer(device)
    nbytes = k_raw.nbytes + v_raw.nbytes + key.nbytes + value.nbytes + cells.nbytes + signs.nbytes + 2 * q[0].nbytes
    times = {"reference": bench(lambda: reference_sketch_decode_attention(q[0], k_raw, v_raw, key, value, cells,
                                                                          signs, scale))}
    dense, found = {}, {}
    if kernels_on:
        times["triton"] = bench(lambda: sketch_decode_attention_triton(q[0], k_raw, v_raw, key, value, cells,
                                                                       signs, scale))
        dense["triton"] = bench(lambda: decode_attention_triton(q, k, v))
        speed = dense["triton"] / times["triton"]
        unfused = times["reference"] / times["triton"]
        found = {"sketch >= 0.67x dense speed": f"{speed:.2f}x ({'met' if speed >= 0.67 else 'NOT met'})",
                 "sketch >= 5x unfused PyTorch": f"{unfused:.1f}x ({'met' if unfused >= 5 else 'NOT met'})"}
    return [row(f"sketch budget 0.25 S={S}", nbytes, times, bandwidth, S=S, n_raw=n_raw, n_vague=n_v, rows=r,
                width=width, dense_all_tokens_ms=dense, targets=found)]


def peak_bytes(device: str, fn) -> int | None:
    """Bytes allocated at the peak of ``fn`` beyond what was allocated before (CUDA only)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def tensor_cases(device: str, quick: bool, kernels_on: bool, bandwidth: float, dtype) -> list[dict]:
    """Tensor attention, one decode query over a four-matrix cache of i tokens (batch 1, 8 heads x 64 dims):
    the tiled kernel against the materialising reference (Kronecker products built, as Chen et al. Theorem
    4.3 charges it) and the factored PyTorch reference (an i x i score matrix per head)."""
    from kernels.tensor_decode import tensor_decode_triton
    from methods.tensor_attention import four_cache_attention, naive_four_cache_attention
    H, d = 8, 64
    n = 1024 if not quick else 128
    g = torch.Generator(device=device).manual_seed(3)
    q = torch.randn(1, H, d, generator=g, device=device, dtype=dtype)
    K1, K2, V1, V2 = (torch.randn(1, H, n, d, generator=g, device=device, dtype=dtype) for _ in range(4))
    scale = d ** -0.5
    naive = lambda: naive_four_cache_attention(q[:, :, None], K1, K2, V1, V2, scale)       # noqa: E731
    factored = lambda: four_cache_attention(q[:, :, None], K1, K2, V1, V2, scale)          # noqa: E731
    bench = timer(device)
    times = {"materialising": bench(naive), "factored_reference": bench(factored)}
    memory = {"materialising": peak_bytes(device, naive), "factored_reference": peak_bytes(device, factored)}
    found = {}
    if kernels_on:
        kernel = lambda: tensor_decode_triton(q, K1, K2, V1, V2, scale)                     # noqa: E731
        times["triton"] = bench(kernel)
        memory["triton"] = peak_bytes(device, kernel)
        speed = times["materialising"] / times["triton"]
        less = memory["materialising"] / max(1, memory["triton"])
        found = {"tensor >= 10x faster than materialising": f"{speed:.0f}x ({'met' if speed >= 10 else 'NOT met'})",
                 "tensor >= 20x less peak memory": f"{less:.0f}x ({'met' if less >= 20 else 'NOT met'})"}
    nbytes = 4 * K1.nbytes + 2 * q.nbytes
    return [row(f"tensor i={n}", nbytes, times, bandwidth, i=n, H=H, d=d, peak_bytes=memory, targets=found,
                flops=4 * H * n * n * d)]


def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(prog="python -m fastpath.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes (seconds, for a smoke test)")
    p.add_argument("--cases", nargs="+", choices=["dense", "selected", "sketch", "tensor"],
                   default=["dense", "selected", "sketch", "tensor"], help="which kernels to measure (default all)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="cache dtype for the attention cases (default bf16)")
    p.add_argument("--json", type=cli.output_file, default=None, help="also write the rows to this JSON file")
    p.add_argument("--e2e", action="store_true",
                   help="time whole decode steps instead (fastpath/e2e.py): the lean, graph, fused and skinny steps, "
                        "full cache vs keep 0.1, transformers' StaticCache step; --cases is ignored")
    p.add_argument("--paths", nargs="+", choices=["lean", "graph", "fused", "skinny"], default=None,
                   help="with --e2e: only these steps (default all four)")
    p.add_argument("--summary", default=None, metavar="REPORT.json",
                   help="print an --e2e report's ratios (speed-ups over the full cache, fraction of the copy "
                        "bandwidth, against transformers, the targets) computed from its step times; runs nothing")
    p.add_argument("--hf-compile", action="store_true",
                   help="with --e2e: also time transformers' step under torch.compile(mode='reduce-overhead')")
    p.add_argument("--hf-only", action="store_true", help="with --e2e: time transformers' step alone")
    p.add_argument("--tune", action="store_true",
                   help="time the split kernel's launches on the e2e shape instead (fastpath/tune.py; its --length, "
                        "--preset, --batch, --dtype) and print the default and the fastest; a GPU only")
    p.add_argument("--no-tune", action="store_true",
                   help="with --e2e: launch the split kernel with its defaults, where on a GPU each length first "
                        "times its launches and takes the fastest (fastpath/tune.py)")
    p.add_argument("--length", type=cli.positive_int, nargs="+", default=None,
                   help="with --e2e: these context lengths (default 8192 and 32768; --quick: 64 and 256)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="with --e2e: the model's shape, random weights (default TINYLLAMA_1B; SMOLLM2_135M is "
                        "SmolLM2-135M's)")
    p.add_argument("--batch", type=cli.positive_int, default=None,
                   help="with --e2e: sequences decoded side by side (default 16; --quick: 2)")
    args = p.parse_args(argv)
    with cli.errors(args.debug):
        EAGER.clear()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.summary is not None:                   # '' too: a report's name, never the kernels' benchmarks
            from fastpath import e2e
            report = files.read_json(args.summary, "an --e2e report")
            try:
                print("\n".join(e2e.summary(report, rows_too=True)))
            except (KeyError, TypeError, AttributeError, ZeroDivisionError, IndexError, ValueError,
                    OverflowError) as e:
                cli.fail(f"{args.summary} is not a report of python -m fastpath.bench --e2e ({type(e).__name__}: {e})")
            return
        if args.tune:
            return tuning(args, argv, p.prog, device)
        if (args.e2e or args.hf_compile or args.hf_only or args.length or args.preset or args.batch or args.no_tune
                or args.paths):
            return end_to_end(args, argv, p.prog, device)
        kernels_on = device == "cuda" and HAS_TRITON
        if not kernels_on:                     # a GPU's timer is Triton's (timer): without it, the CPU's
            device = "cpu"
            print("no CUDA device (or no Triton): the kernels run only in Triton's CPU interpreter, which checks "
                  "correctness (the kernel tests), not speed. Timing the PyTorch references only, on the CPU; "
                  "run this on a GPU with Triton for the kernel numbers.")
        dtype = DTYPES[args.dtype]
        if device == "cpu" and dtype != torch.float32:
            dtype = torch.float32
        bandwidth = copy_bandwidth(device, (1 << 30) if device == "cuda" and not args.quick else (1 << 26))
        print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}; measured copy bandwidth "
              f"{bandwidth / 1e9:.0f} GB/s; dtype {dtype}")
        rows = []
        makers = {"dense": dense_cases, "selected": selected_cases, "sketch": sketch_cases,
                  "tensor": tensor_cases}
        for case in args.cases:
            for r in makers[case](device, args.quick or device == "cpu", kernels_on, bandwidth, dtype):
                rows.append(r)
                print(format_row(r))
        report = {"device": device, "copy_bandwidth": bandwidth, "dtype": str(dtype), "rows": rows,
                  "targets": targets(rows) if kernels_on else {}}
        if EAGER:
            print(f"timed without a CUDA graph (they synchronise with the host): {'; '.join(EAGER)}")
        report["timed_eagerly"] = EAGER
        for name, verdict in report["targets"].items():
            print(f"target {name}: {verdict}")
        if args.json:
            report["provenance"] = provenance(argv, prog=p.prog, threads=torch.get_num_threads(), dtype=str(dtype),
                                              seed=None)
            files.atomic_write_text(args.json, json.dumps(report, indent=1))


def tuning(args, argv: list[str] | None, prog: str, device: str) -> None:
    """``--tune``: ``fastpath.tune.tune_attention`` on the e2e shape (its first ``--length``), the sweep written
    to ``--json`` with the provenance."""
    from fastpath import e2e, tune
    if args.e2e or args.hf_compile or args.hf_only or args.no_tune:
        cli.fail("--tune times the split kernel alone: not with --e2e, --hf-compile, --hf-only or --no-tune")
    if device != "cuda" or not HAS_TRITON:
        cli.fail("--tune times the kernel on a GPU with Triton, and there is none here")
    S, name = (args.length or e2e.LENGTHS)[0], args.preset or e2e.PRESET
    cfg = preset(name, max_seq_len=S + e2e.ROOM)
    dtype = DTYPES[args.dtype]
    bandwidth = copy_bandwidth(device, 1 << 30)
    sweep = tune.tune_attention(args.batch or e2e.BATCH, cfg.n_head, cfg.n_kv_head, S, cfg.head_dim, dtype, device,
                                room=e2e.ROOM, bandwidth=bandwidth)
    sweep.update(device_name=torch.cuda.get_device_name(), copy_bandwidth=bandwidth, preset=name)
    print(f"measured on {sweep['device_name']}, copy bandwidth {bandwidth / 1e9:.0f} GB/s, {name}")
    print("\n".join(tune.summary(sweep)))
    if args.json:
        sweep["provenance"] = provenance(argv, prog=prog, threads=torch.get_num_threads(), dtype=str(dtype), seed=0)
        files.atomic_write_text(args.json, json.dumps(sweep, indent=1))


def end_to_end(args, argv: list[str] | None, prog: str, device: str) -> None:
    """``--e2e``: ``fastpath.e2e.run``, its report written to ``--json`` with the provenance."""
    from fastpath import e2e
    if not args.e2e:
        cli.fail("--hf-compile, --hf-only, --length, --preset, --batch, --paths and --no-tune go with --e2e")
    if device != "cuda":
        print("no CUDA device: timing the steps on the CPU, which says nothing about a GPU "
              "(bash fastpath/gpu_check.sh runs this on one)")
    dtype = DTYPES[args.dtype]
    dtype = dtype if device == "cuda" else torch.float32
    e2e.check_shapes(args.preset or e2e.PRESET, args.quick, tuple(args.length or ()) or
                     (e2e.QUICK_LENGTHS if args.quick else e2e.LENGTHS), args.batch, dtype)

    def write(report: dict) -> None:                 # after each length too: a run cut short keeps what it measured
        report["provenance"] = provenance(argv, prog=prog, threads=torch.get_num_threads(), dtype=str(dtype),
                                          seed=0)
        files.atomic_write_text(args.json, json.dumps(report, indent=1))
    report = e2e.run(device, args.quick, dtype, hf_compile=args.hf_compile, hf_only=args.hf_only,
                     lengths=tuple(args.length) if args.length else None, preset_name=args.preset or e2e.PRESET,
                     batch=args.batch, tune=not args.no_tune, save=write if args.json else None,
                     paths=tuple(args.paths) if args.paths else PATHS_ALL)
    if args.json:
        write(report)


def format_row(r: dict) -> str:
    parts = [f"{k} {ms:.3f} ms ({r['GB/s'][k]:.0f} GB/s, {100 * r['fraction_of_copy_bw'][k]:.0f}%)"
             for k, ms in r["ms"].items()]
    extra = "".join(f"; {k} {v}" for k, v in r.items() if k.endswith("_ms") and v)
    return f"{r['case']}: {r['bytes'] / 2**20:.1f} MiB; " + "; ".join(parts) + extra


def targets(rows: list[dict]) -> dict:
    """Each target of the issue as measured here: the numbers and whether they are met."""
    out = {}
    by = {r["case"].split()[0]: r for r in rows}
    dense = [r for r in rows if r["case"].startswith("dense")]
    if dense:
        a, b = dense[0], dense[-1]
        frac = a["fraction_of_copy_bw"]["triton"]
        out[f"dense {a['B']}x{a['S']} >= 75% copy bw"] = f"{100 * frac:.0f}% ({'met' if frac >= 0.75 else 'NOT met'})"
        ratio = b["ms"]["sdpa"] / b["ms"]["triton"]
        out[f"dense {b['B']}x{b['S']} not slower than SDPA"] = (f"{ratio:.2f}x SDPA's speed "
                                                               f"({'met' if ratio >= 1 else 'NOT met'})")
    if "selected" in by:
        s = by["selected"]
        speed = s["full_cache_ms"]["triton"] / s["ms"]["triton"]
        vs_c = s["ms"]["triton"] / s["compacted_ms"]["triton"]
        out["selected >= 6x full cache"] = f"{speed:.1f}x ({'met' if speed >= 6 else 'NOT met'})"
        out["selected within 1.3x compacted"] = f"{vs_c:.2f}x ({'met' if vs_c <= 1.3 else 'NOT met'})"
    for r in rows:
        out.update(r.get("targets", {}))
    return out


if __name__ == "__main__":
    main()
