"""
The split kernel's launch, chosen by timing it on the GPU at hand: ``python -m fastpath.bench --tune``.

``tune_attention`` times every candidate launch of the masked decode kernel (tokens per block, programs per SM,
warps, stages) on the step's own shape, checks each one's output against the default launch's, and records the
fastest in ``kernels.decode_attention.TUNED``, which every later launch without settings of its own reads.
``tune_skinny`` does the same for the skinny kernel on each product of the step (``SKINNY_TUNED``), beside
cuBLAS's product. ``python -m fastpath.bench --e2e`` tunes both before it times the steps. A CPU has nothing to
time; ``tests/kernels/test_kernels_tune.py`` gives the functions a timer of its own.

    python -m fastpath.bench --tune                           # TINYLLAMA_1B's heads, 16 x 8,192 tokens, bf16
    python -m fastpath.bench --tune --length 32768 --json /tmp/tune.json

How it works: fastpath/inside.md, section "tune.py: the split kernel's launch, timed".
"""

from __future__ import annotations

import math

import torch

from kernels import serves
from kernels.decode_attention import TUNED, Launch, default_launch, masked_decode_attention_triton, split_plan
from kernels.skinny_matmul import (
    DEFAULT_LAUNCH,
    SKINNY_TUNED,
    SkinnyLaunch,
    linear_add_triton,
    norm_linear_triton,
    norm_swiglu_triton,
    reference_linear_add,
    reference_norm_linear,
    reference_norm_swiglu,
)
from kernels.skinny_matmul import TOLERANCE as SKINNY_TOLERANCE
from kernels.skinny_qkv import norm_qkv_rope_write_triton, reference_norm_qkv_rope_write

# every cut tried: tokens per block x programs per SM x warps x pipeline stages, 90 launches of 18 compiled
# variants (the ranges are an argument, not compiled in)
CANDIDATES = tuple(Launch(b, s, w, st) for b in (32, 64, 128) for s in (1, 2, 4, 8, 16) for w in (2, 4, 8)
                   for st in (2, 3))
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}   # against the default launch


def gpu_ms(fn) -> float:
    """Median milliseconds of ``fn`` captured in a CUDA graph and replayed (as the decode step runs it)."""
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


def timer_or_gpu(time_ms, device):
    """``time_ms`` if given, else ``gpu_ms`` on a CUDA device; on a CPU there is nothing to time."""
    if time_ms is not None:
        return time_ms
    if not str(device).startswith("cuda"):
        raise ValueError("tuning times the kernel on a GPU: on a CPU, Triton's interpreter runs its programs "
                         "one after another, so there is nothing to time")
    return gpu_ms


def said(e: Exception) -> str:
    """An exception in one line, as a sweep records a launch that failed."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


MAX_COPIES = 64


def copies_past_l2(nbytes: int, device) -> int:
    """How many copies of an input of ``nbytes`` a timing walks through, one per call, so that no call finds
    its input in the GPU's L2 cache, as a decode step does not (a layer's weights or K/V are read once a step,
    between the other layers'): enough for three times the L2 (an H100's holds 50 MB, more than some of
    TinyLlama's weights), at most ``MAX_COPIES``; 1 on a CPU or where torch does not give the size."""
    if not str(device).startswith("cuda"):
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    return max(1, min(MAX_COPIES, math.ceil(3 * l2 / max(nbytes, 1)))) if l2 else 1


def tune_attention(B: int, H: int, H_kv: int, S: int, d: int, dtype: torch.dtype, device: str = "cuda",
                   room: int = 0, candidates=CANDIDATES, time_ms=None, bandwidth: float | None = None) -> dict:
    """Time the masked split kernel over B sequences of S entries (and ``room`` empty slots after them, as the
    graph step's buffers hold), H query heads sharing H_kv KV heads of d dims, with the default launch and
    with each of ``candidates``; set ``TUNED[(d, dtype, S + room)]`` to the fastest whose output equals the
    default launch's within ``TOLERANCE`` (settings tuned on other numbers of slots are kept). ``time_ms(fn)``
    times a call (default: ``gpu_ms``, a CUDA device only). Returns the sweep: the shape, its K/V bytes, the
    default's and the chosen launch's rows, and every row (its launch, ranges, ms, largest difference from the
    default's output, or its error)."""
    time_ms = timer_or_gpu(time_ms, device)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, H, d, generator=g, device=device).to(dtype)                # (B, H, d)
    k = torch.randn(B, H_kv, S + room, d, generator=g, device=device).to(dtype)   # (B, H_kv, C, d)
    v = torch.randn(B, H_kv, S + room, d, generator=g, device=device).to(dtype)
    pos = torch.arange(S + room, device=device).masked_fill(torch.arange(S + room, device=device) >= S, -1)
    pos = pos.expand(B, H_kv, S + room).contiguous()                               # (B, H_kv, C): room empty
    key, kv_bytes = (d, dtype, S + room), 2 * B * H_kv * S * d * k.element_size()

    def attend():                                           # launched as TUNED[key] says
        return masked_decode_attention_triton(q, k, v, pos)

    # timed over copies of the cache, one a call, none of them in L2 when its turn comes (copies_past_l2)
    copies = [(k, v, pos)] + [(k.clone(), v.clone(), pos.clone())
                              for _ in range(copies_past_l2(2 * k.nbytes + pos.nbytes, device) - 1)]

    def attend_each():
        for kc, vc, pc in copies:
            masked_decode_attention_triton(q, kc, vc, pc)

    saved = TUNED.pop(key, None)
    try:
        default = TUNED[key] = default_launch(dtype)
        reference = attend().float()
        rows = []
        for launch in (default,) + tuple(c for c in candidates if c != default):
            TUNED[key] = launch
            row = {**launch._asdict(), "splits": split_plan(q, k, S + room)[2], "default": launch == default}
            try:
                row["max_diff"] = float((attend().float() - reference).abs().max())
                if row["max_diff"] <= TOLERANCE[dtype]:
                    row["ms"] = time_ms(attend_each) / len(copies)
                    row["GB_per_s"] = kv_bytes / (row["ms"] / 1e3) / 1e9
                else:
                    row["error"] = f"output differs from the default launch's by {row['max_diff']:.3g}"
            except Exception as e:                          # noqa: BLE001  (one that does not compile: recorded)
                row["error"] = said(e)
            rows.append(row)
    finally:
        TUNED.pop(key, None)
        if saved is not None:
            TUNED[key] = saved
    timed = [r for r in rows if "ms" in r]
    if not timed:
        raise RuntimeError("no launch of the split kernel ran: " + "; ".join(r.get("error", "") for r in rows[:3]))
    best = min(timed, key=lambda r: r["ms"])
    TUNED[key] = Launch(best["block_n"], best["per_sm"], best["num_warps"], best["num_stages"])
    for r in timed:
        if bandwidth:
            r["fraction_of_copy_bw"] = kv_bytes / (r["ms"] / 1e3) / bandwidth
    return {"shape": {"batch": B, "heads": H, "kv_heads": H_kv, "entries": S, "room": room, "head_dim": d,
                      "dtype": str(dtype)},
            "kv_bytes": kv_bytes, "default": rows[0], "best": best, "rows": rows}


def tune_or_say_why(B: int, H: int, H_kv: int, S: int, d: int, dtype: torch.dtype, device: str, room: int,
                    bandwidth: float | None = None) -> dict:
    """``tune_attention`` where the kernels serve this device (``kernels.serves``), its sweep; else, or where the
    sweep fails, ``{"error": why}`` and the defaults: where the sweep fails, they are recorded for its slots,
    so that its caches do not take what another number of slots chose; a bench or profile goes on with them."""
    if not serves(torch.empty(0, device=device, dtype=dtype)):
        return {"error": "not tuned: the Triton kernels do not serve here (no sm_80+ GPU, or NANOKV_NO_TRITON=1)"}
    try:
        return tune_attention(B, H, H_kv, S, d, dtype, device, room=room, bandwidth=bandwidth)
    except Exception as e:                                  # noqa: BLE001  (recorded; the defaults are launched)
        TUNED[(d, dtype, S + room)] = default_launch(dtype)
        return {"error": f"not tuned ({said(e)})"}


def describe(launch: dict) -> str:
    """One launch's row in words: its cut, and its time where it has one."""
    cut = (f"{launch['block_n']} tokens a block, {launch['per_sm']} programs per SM ({launch['splits']} ranges), "
           f"{launch['num_warps'] or 'default'} warps, {launch['num_stages'] or 'default'} stages")
    if "ms" not in launch:
        return f"{cut}: {launch.get('error', 'not timed')}"
    share = f" = {copy_share(launch)}" if "fraction_of_copy_bw" in launch else ""
    return f"{cut}: {launch['ms'] * 1e3:.1f} us, {launch['GB_per_s']:.0f} GB/s{share}"


def copy_share(launch: dict) -> str:
    """A timed launch's share of the copy bandwidth measured in the same run ("" where none was given)."""
    return f"{launch['fraction_of_copy_bw']:.0%} of the copy bandwidth" if "fraction_of_copy_bw" in launch else ""


def summary(sweep: dict) -> list[str]:
    """The sweep's default and chosen launch, and its speed-up (or why there is no sweep)."""
    if "error" in sweep:
        return [f"the split kernel's launch: {sweep['error']}"]
    s, best, default = sweep["shape"], sweep["best"], sweep["default"]
    lines = [f"the split kernel over {s['batch']} x {s['kv_heads']} KV heads x {s['entries']} entries of "
             f"{s['head_dim']} dims, {s['dtype']} ({sweep['kv_bytes'] / 1e6:.0f} MB of K/V), "
             f"{sum('ms' in r for r in sweep['rows'])} launches timed",
             f"  default: {describe(default)}", f"  chosen:  {describe(best)}"]
    if "ms" in default:
        lines.append(f"  the chosen launch is {default['ms'] / best['ms']:.2f}x the default's speed")
    return lines


# ----------------------------------------------------------------------------------------------------------
# The skinny kernel's launches (kernels/skinny_matmul.py), one per product of a decode step

# columns per program x the step along K x pipeline stages with 4 warps, then wider blocks, deeper pipelines
# and longer steps with 8 warps: 18 launches of each of the four variants (a program of 16 columns holds few
# bytes in flight, so depth may matter; a wider one reads the step's rows of x from L2 fewer times)
SKINNY_CANDIDATES = tuple(SkinnyLaunch(n, k, 4, st) for n in (16, 32) for k in (128, 256, 512) for st in (3, 4)) + (
    SkinnyLaunch(64, 256, 4, 3), SkinnyLaunch(64, 128, 4, 4), SkinnyLaunch(16, 256, 4, 5), SkinnyLaunch(32, 256, 4, 5),
    SkinnyLaunch(16, 512, 8, 3), SkinnyLaunch(16, 1024, 8, 2))


def step_products(cfg) -> dict[str, tuple[str, int, int]]:
    """A decode step's products for a Llama-flavour config: name -> (the skinny kernel's variant, N, K); the q/k/v
    product is ``kernels/skinny_qkv.py``'s, with RoPE and the cache's write."""
    qkv = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
    return {"qkv": ("qkv_rope_write", qkv, cfg.d_model), "o": ("linear_add", cfg.d_model, cfg.n_head * cfg.head_dim),
            "gate_up": ("norm_swiglu", cfg.d_ff, cfg.d_model), "down": ("linear_add", cfg.d_model, cfg.d_ff),
            "head": ("norm_linear", cfg.vocab_size, cfg.d_model)}


def tune_skinny(cfg, B: int, dtype: torch.dtype, device: str = "cuda", candidates=SKINNY_CANDIDATES,
                time_ms=None, bandwidth: float | None = None) -> dict:
    """For each product of a decode step of ``cfg`` over B rows (``step_products``): time cuBLAS's product
    alone (``F.linear``; the fused step runs it with the norm, SiLU-times-up, residual, RoPE or write around it
    as other kernels, and inductor may call another cuBLAS kernel to add the residual), the skinny kernel's
    default launch and each of ``candidates`` (norm, SwiGLU, residual, RoPE and write included: the q/k/v
    product writes into buffers of 8 slots a head), each over copies of the weight
    that L2 does not hold (``copies_past_l2``); set
    ``SKINNY_TUNED[(variant, N, K, dtype)]`` to the fastest whose output equals the reference's within the
    kernel's ``TOLERANCE``. ``time_ms(fn)`` times a call (default: ``gpu_ms``, a CUDA device only). Returns,
    per product, its shape, weight bytes, cuBLAS's row, the default's and the chosen launch's rows, and every
    row (its launch, ms, or its error)."""
    time_ms = timer_or_gpu(time_ms, device)
    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, (variant, N, K) in step_products(cfg).items():
        rows_of_w = 2 * N if variant == "norm_swiglu" else N
        x = torch.randn(B, K, generator=g, device=device).to(dtype)
        w = (torch.randn(rows_of_w, K, generator=g, device=device) / K ** 0.5).to(dtype)
        norm_w = (1 + 0.1 * torch.randn(K, generator=g, device=device)).to(dtype)
        r = torch.randn(B, N, generator=g, device=device).to(dtype)
        cos, sin = torch.randn(2, 1, cfg.head_dim, generator=g, device=device).to(dtype)   # RoPE's, any angles
        buffers = (torch.zeros(B, cfg.n_kv_head, 8, cfg.head_dim, device=device, dtype=dtype),      # kb, vb, pos,
                   torch.zeros(B, cfg.n_kv_head, 8, cfg.head_dim, device=device, dtype=dtype),      # slot, position:
                   torch.full((B, cfg.n_kv_head, 8), -1, device=device, dtype=torch.long),           # 8 slots a head,
                   torch.zeros(B, cfg.n_kv_head, device=device, dtype=torch.long),                   # writing to 0
                   torch.zeros(1, device=device, dtype=torch.long))

        def qkv(launch, w, buf=buffers):                # the q/k/v product: q returned, k and v written into buf
            return norm_qkv_rope_write_triton(x, norm_w, 1e-5, w, cos, sin, *buf, launch)

        def entry_written(write) -> torch.Tensor:       # q and the k, v that write(*buf) put into buffers of its own
            kb, vb, pos, slot, position = (t.clone() for t in buffers)
            q = write(kb, vb, pos, slot, position)
            return torch.cat([q.flatten(1), kb[:, :, 0].flatten(1), vb[:, :, 0].flatten(1)], dim=1)
        kernel, reference = {
            "qkv_rope_write": (qkv, lambda: entry_written(
                lambda *buf: reference_norm_qkv_rope_write(x, norm_w, 1e-5, w, cos, sin, *buf))),
            "norm_linear": (lambda launch, w: norm_linear_triton(x, norm_w, 1e-5, w, launch),
                            lambda: reference_norm_linear(x, norm_w, 1e-5, w)),
            "norm_swiglu": (lambda launch, w: norm_swiglu_triton(x, norm_w, 1e-5, w, launch),
                            lambda: reference_norm_swiglu(x, norm_w, 1e-5, w)),
            "linear_add": (lambda launch, w: linear_add_triton(x, w, r, launch),
                           lambda: reference_linear_add(x, w, r))}[variant]
        # what is checked against the reference: the output, and for q/k/v the entries written too (the timed
        # calls write into the same buffers, so that a call is the kernel alone)
        checked = ((lambda launch: entry_written(lambda *buf: qkv(launch, w, buf))) if variant == "qkv_rope_write"
                   else (lambda launch: kernel(launch, w)))
        want = reference().float()
        scale = float(want.abs().max().clamp_min(1e-6))
        # timed over copies of the weight, one a call, none in L2 when its turn comes (copies_past_l2); the
        # step's few rows of x stay there, as in a step, where the kernel before has just written them
        weights = [w] + [w.clone() for _ in range(copies_past_l2(w.nbytes, device) - 1)]

        def timed(call) -> dict:                        # call(w) once per copy of the weight
            ms = time_ms(lambda: [call(wc) for wc in weights]) / len(weights)
            row = {"ms": ms, "GB_per_s": w.nbytes / (ms / 1e3) / 1e9}
            if bandwidth:
                row["fraction_of_copy_bw"] = w.nbytes / (ms / 1e3) / bandwidth
            return row

        rows = []
        for launch in (DEFAULT_LAUNCH,) + tuple(c for c in candidates if c != DEFAULT_LAUNCH):
            row = {**launch._asdict(), "default": launch == DEFAULT_LAUNCH}
            try:
                row["max_diff"] = float((checked(launch).float() - want).abs().max()) / scale
                if row["max_diff"] <= SKINNY_TOLERANCE[dtype]:
                    row.update(timed(lambda wc, launch=launch: kernel(launch, wc)))
                else:
                    row["error"] = f"output differs from the reference's by {row['max_diff']:.3g} of its largest"
            except Exception as e:                      # noqa: BLE001  (one that does not compile: recorded)
                row["error"] = said(e)
            rows.append(row)
        cublas = {"what": "F.linear alone (cuBLAS), without the norm, SwiGLU, residual, RoPE or write around it",
                  **timed(lambda wc: torch.nn.functional.linear(x, wc))}
        entry = {"variant": variant, "rows": B, "N": N, "K": K, "dtype": str(dtype), "weight_bytes": w.nbytes,
                 "cublas": cublas, "default": rows[0], "sweep": rows}
        ran = [row for row in rows if "ms" in row]
        if ran:
            best = min(ran, key=lambda row: row["ms"])
            SKINNY_TUNED[(variant, N, K, dtype)] = SkinnyLaunch(best["block_n"], best["block_k"], best["num_warps"],
                                                                best["num_stages"])
            entry["best"] = best
        else:
            entry["error"] = "no launch ran: " + "; ".join(row.get("error", "") for row in rows[:3])
        out[name] = entry
    return out


def tune_skinny_or_say_why(cfg, B: int, dtype: torch.dtype, device: str, bandwidth: float | None = None) -> dict:
    """``tune_skinny`` where the kernels serve this device, else (or where it fails) ``{"error": why}``: the
    skinny step then launches the kernel's defaults."""
    if not serves(torch.empty(0, device=device, dtype=dtype)):
        return {"error": "not tuned: the Triton kernels do not serve here (no sm_80+ GPU, or NANOKV_NO_TRITON=1)"}
    try:
        return tune_skinny(cfg, B, dtype, device, bandwidth=bandwidth)
    except Exception as e:                                  # noqa: BLE001  (recorded; the defaults are launched)
        return {"error": f"not tuned ({said(e)})"}


def skinny_summary(sweeps: dict) -> list[str]:
    """Per product: cuBLAS's product alone against the skinny kernel's default and chosen launch."""
    if "error" in sweeps:
        return [f"the skinny kernel's launches: {sweeps['error']}"]

    def said(row: dict) -> str:
        share = f", {row['fraction_of_copy_bw']:.0%} of the copy bandwidth" if "fraction_of_copy_bw" in row else ""
        return f"{row['ms'] * 1e3:.1f} us{share}" if "ms" in row else row.get("error", "not timed")

    lines = []
    for name, s in sweeps.items():
        head = (f"{name:>7} ({s['variant']}, {s['rows']} x {s['K']} -> {s['N']}, {s['weight_bytes'] / 1e6:.1f} MB of "
                f"weight): cuBLAS's product alone {said(s['cublas'])}; the skinny kernel")
        if "best" not in s:
            lines.append(f"{head}: {s.get('error', 'not timed')}")
            continue
        b = s["best"]
        lines.append(f"{head} {said(b)} ({b['block_n']} columns a program, {b['block_k']} a step along K, "
                     f"{b['num_warps']} warps, {b['num_stages']} stages; default launch {said(s['default'])})")
    return lines
