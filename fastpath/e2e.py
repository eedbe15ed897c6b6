"""
Whole decode steps, timed: the lean, graph, fused and skinny steps, the full cache against keep 0.1, and
transformers' ``StaticCache`` step, against the copy bandwidth measured in the same run.

    python -m fastpath.bench --e2e --json results/decode_e2e.json     # on a GPU: bash fastpath/gpu_check.sh
    python -m fastpath.bench --e2e --quick --json /tmp/e2e.json       # tiny shapes, fp32: runs on a CPU

The shape is TINYLLAMA_1B's with random bf16 weights, 16 sequences at two lengths; each cache is filled with
random entries at the positions its method keeps, and no prompt runs. Each row records the step's time, the
bytes it must read and what it costs beyond them; ``summary`` prints a report's ratios and targets
(``python -m fastpath.bench --summary REPORT.json``). ``tests/fastpath/test_e2e_bench.py`` runs it on a CPU;
the committed reports are read in ``fastpath/README.md``.

How it works: fastpath/inside.md, section "e2e.py: whole decode steps, timed".
"""

from __future__ import annotations

import functools
import inspect
import math
import statistics
import time

import torch

from methods import make_policy
from methods.h2o import STATE as H2O_STATE
from methods.scissorhands import ATTN, COUNT, LOW
from nanollm import KVCache, cli, preset
from nanollm.model import Transformer
from nanollm.storage import LayerKV

from .fused import FusedGraphDecoder
from .graph import BF16_TOL, GraphDecoder
from .skinny import SkinnyGraphDecoder, kernels_serve
from .tune import copy_share, skinny_summary, tune_or_say_why, tune_skinny_or_say_why
from .tune import summary as tune_summary

PRESET, LENGTHS, BATCH, KEEP = "TINYLLAMA_1B", (8192, 32768), 16, 0.1
QUICK_SHAPE = dict(vocab_size=1024, n_layer=2, n_head=8, n_kv_head=2, d_model=256, d_ff=512)
QUICK_LENGTHS, QUICK_BATCH = (64, 256), 2
METHODS_TIMED = ("full", "snapkv", "streaming_llm", "h2o", "scissorhands")
WARM, STEPS, REPEATS = 3, 8, 3          # steps per path: 27 (a few ms each on a GPU); WARM > graph.WARMUP
QUICK_STEPS, QUICK_REPEATS = 2, 2
ROOM = WARM + STEPS * REPEATS + 5       # new tokens a cache has room for


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write), median of 10: the practical ceiling of a step."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(10):
        if device == "cuda":                       # events: the copy alone, no host round trip
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            y.copy_(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            y.copy_(x)
            times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / statistics.median(times)


def step_ms(step, token: torch.Tensor, device: str, quick: bool) -> tuple[float, list[float], float]:
    """Median milliseconds per step over ``REPEATS`` blocks of ``STEPS`` (fewer if quick), after ``WARM``
    steps; the blocks; the seconds the warm steps took (compiling and capturing)."""
    steps, repeats = (QUICK_STEPS, QUICK_REPEATS) if quick else (STEPS, REPEATS)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(WARM):
        step(token)
    sync(device)
    warm_s = time.perf_counter() - t0
    blocks = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step(token)
        sync(device)
        blocks.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(blocks), blocks, warm_s


def random_model(cfg, dtype: torch.dtype, device: str) -> Transformer:
    with torch.device(device):                          # initialised where it runs: seconds, not minutes
        model = Transformer(cfg)
    return model.to(dtype).eval()


def kept_positions(method: str, S: int, K: int, B: int, H_kv: int, device: str, g) -> torch.Tensor:
    """(B, H_kv, K) positions a method holds after a prompt of S tokens: all of them; StreamingLLM's 4 sinks
    and latest; SnapKV's window (32), H2O's recent half or Scissorhands' recent 10 and, per head, a random
    choice of the rest."""
    if K == S:
        return torch.arange(S, device=device).expand(B, H_kv, S)
    if method == "streaming_llm":
        pos = torch.cat([torch.arange(4, device=device), torch.arange(S - (K - 4), S, device=device)])
        return pos.expand(B, H_kv, K)
    w = {"snapkv": min(32, K // 2), "scissorhands": min(10, K - 1)}.get(method, K // 2)
    chosen = torch.rand(B, H_kv, S - w, generator=g, device=device).topk(K - w, dim=-1).indices.sort(-1).values
    return torch.cat([chosen, torch.arange(S - w, S, device=device).expand(B, H_kv, w)], dim=-1)


def kept(S: int) -> int:
    """The budget of a method that keeps ``KEEP`` of a prompt of S tokens."""
    return max(8, int(KEEP * S))


def tune_at(cfg, B: int, S: int, dtype: torch.dtype, device: str, bandwidth: float | None = None) -> dict:
    """The split kernel's launch timed and chosen (``tune.py``) on the full cache's slots at length S and on
    those of the caches that keep a tenth: their sweeps, keyed as a report records them ("8192", "8192 keep")."""
    return {key: tune_or_say_why(B, cfg.n_head, cfg.n_kv_head, entries, cfg.head_dim, dtype, device, room=ROOM,
                                 bandwidth=bandwidth)
            for key, entries in ((str(S), S), (f"{S} keep", kept(S)))}


def synthetic_cache(cfg, method: str, B: int, S: int, dtype: torch.dtype, device: str) -> KVCache:
    """A cache as after a prompt of S tokens under ``method`` (random entries), with room for ``ROOM`` more."""
    budget = None if method == "full" else kept(S)
    cache = KVCache(cfg, None if budget is None else make_policy(method, budget))
    K = S if budget is None else budget
    H_kv, d = cfg.n_kv_head, cfg.head_dim
    g = torch.Generator(device=device).manual_seed(S)
    for i in range(cfg.n_layer):
        k = torch.zeros(B, H_kv, K + ROOM, d, dtype=dtype, device=device)
        v = torch.zeros_like(k)
        k[:, :, :K].normal_(generator=g)
        v[:, :, :K].normal_(generator=g)
        pos = torch.full((B, H_kv, K + ROOM), -1, dtype=torch.long, device=device)
        pos[:, :, :K] = kept_positions(method, S, K, B, H_kv, device, g)
        store = LayerKV(k, v, pos)
        store.n = K                                     # K slots in use, ROOM to spare: appends write in place
        if method == "h2o":
            store.set_state(H2O_STATE, torch.rand(B, H_kv, K, generator=g, device=device), fill=0.0)
        if method == "scissorhands":                    # a random history of low flags, its counts, attention
            low = torch.rand(B, H_kv, K, cache.policy.history_window, generator=g, device=device) < 0.5
            store.set_state(LOW, low, fill=False)
            store.set_state(COUNT, low.sum(-1, dtype=torch.int32), fill=0)
            store.set_state(ATTN, torch.rand(B, H_kv, K, generator=g, device=device), fill=0.0)
        cache.layers[i] = store
    cache.seen = S
    return cache


def weight_bytes(model: Transformer, graph: GraphDecoder, B: int) -> int:
    """Bytes of the weights one step reads: the stacked matrices and norms, the final norm, the LM head,
    and B rows of the embedding table."""
    layers = sum(t.nbytes for norm1, wqkv, wo, norm2, wgu, wd, _ in graph.lean.layers
                 for t in (norm1.weight, wqkv, wo, norm2.weight, wgu, wd))
    emb = model.tok_emb.weight
    return layers + model.final_norm.weight.nbytes + model.lm_head.weight.nbytes + B * emb[0].nbytes


def row(path: str, method: str, S: int, entries: int, ms: tuple, weights: int, kv: int, bandwidth: float,
        **extra) -> dict:
    nbytes = weights + kv
    ideal = nbytes / bandwidth * 1e3
    return {"path": path, "method": method, "length": S, "entries": entries, "ms": ms[0], "ms_blocks": ms[1],
            "warm_s": ms[2], "bytes": nbytes, "weight_bytes": weights, "kv_bytes": kv, "at_copy_bw_ms": ideal,
            "fixed_ms": ms[0] - ideal, "fraction_of_copy_bw": ideal / ms[0], **extra}


PATHS = ("lean", "graph", "fused", "skinny")


# the methods whose evictions rank entries by the attention they received, which rounding can reorder: two paths'
# caches may part after a few steps, so only their first steps' logits are compared
RANKED_BY_ATTENTION = ("h2o", "scissorhands")


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: inf where either holds a NaN or an inf."""
    x = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    return x if math.isfinite(x) else math.inf


def ours(cfg, model: Transformer, decoders: dict, B: int, S: int, dtype, device: str, bandwidth: float,
         methods, quick: bool) -> list[dict]:
    """Every path's step (``decoders``: path -> its decoder) of every method at one length. Each row also
    records how far its logits are from those of the first path that ran the same method (``logits_vs``, as
    ``gap``): every path computes the same steps from the same cache and token, so a kernel that computes
    something else shows there, not only in its time. At the first step (``max_diff``), which the graph paths run
    before they capture their graph, and at the last (``last_max_diff``; on a GPU a replay), for the methods whose
    evictions do not rank by attention (``RANKED_BY_ATTENTION``; ``tests/fastpath`` compare theirs step by
    step)."""
    rows = []
    token = torch.randint(0, cfg.vocab_size, (B,), generator=torch.Generator().manual_seed(0)).to(device)
    weights = weight_bytes(model, next(iter(decoders.values())), B)
    for method in methods:
        first = None                                    # (path, its first and last steps' logits in fp32)
        for path, decoder in decoders.items():
            try:
                r, logits, last = one_path(path, cfg, method, decoder, token, B, S, dtype, device, quick, weights,
                                           bandwidth)
                if first is None:
                    first = (path, logits, last)
                else:
                    r["logits_vs"] = {"path": first[0], "max_diff": gap(logits, first[1])}
                    if method not in RANKED_BY_ATTENTION:
                        r["logits_vs"]["last_max_diff"] = gap(last, first[2])
                rows.append(r)
            except Exception as e:                      # noqa: BLE001  (recorded: the other cases still run)
                rows.append({"path": path, "method": method, "length": S, "error": f"{type(e).__name__}: {e}"})
            decoder.forget()
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def one_path(path: str, cfg, method: str, graph: GraphDecoder, token, B: int, S: int, dtype, device: str,
             quick: bool, weights: int, bandwidth: float) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """One method's step at one length on one path, on a fresh cache (``graph``: the path's decoder; the lean
    path steps its ``lean``): its row, and its first and last steps' logits (B, V) in fp32."""
    cache = synthetic_cache(cfg, method, B, S, dtype, device)
    K = cache.layers[0].n
    elem = torch.empty((), dtype=dtype).element_size()
    kv = 2 * cfg.n_layer * B * cfg.n_kv_head * (K + 1) * cfg.head_dim * elem    # K, V of the entries + the new
    extra = {}
    if path == "lean":
        step = functools.partial(graph.lean.step, cache=cache)
    else:
        if not graph.start(cache, ROOM):
            raise RuntimeError(f"{method} fell back to the lean step: {graph.fallback}")
        del cache                                       # the static buffers hold their own copy
        step = graph.step
    kept, last = [], []

    def step_keeping_logits(t: torch.Tensor) -> torch.Tensor:
        out = step(t)
        if not kept:                                    # copied now: a replay writes its output buffer again
            kept.append(out.float().clone())
        last[:] = [out]                                 # after the last step, its output (copied below)
        return out
    ms = step_ms(step_keeping_logits, token, device, quick)
    if path != "lean":
        # the skinny path is the fused step where its kernels do not serve (a CPU, NANOKV_NO_TRITON=1, fp16)
        served = {"skinny_kernels": kernels_serve(graph.model)} if path == "skinny" else {}
        extra = dict(capacity=graph.kv.k.shape[3], replayed=graph.current.graph is not None, **served)
    return row(path, method, S, K, ms, weights, kv, bandwidth, **extra), kept[0], last[0].float().clone()


def transformers_static(cfg, B: int, S: int, dtype, device: str, bandwidth: float, compiled: bool,
                        quick: bool) -> dict | str:
    """transformers' ``StaticCache`` decode step of the same shape, or a line saying why it was skipped."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
    except ImportError as e:
        return f"skipped: transformers is not importable ({e})"
    hcfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                       num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                       num_key_value_heads=cfg.n_kv_head, max_position_embeddings=S + ROOM,
                       rope_theta=cfg.rope_base, rms_norm_eps=cfg.norm_eps,
                       tie_word_embeddings=cfg.tie_embeddings, attn_implementation="sdpa")
    with torch.device(device):
        hf = LlamaForCausalLM(hcfg)
    hf = hf.to(dtype).eval()
    cache = StaticCache(config=hcfg, max_cache_len=S + ROOM)
    g = torch.Generator(device=device).manual_seed(S)
    for i in range(cfg.n_layer):                        # the prompt's entries, random: no prompt runs
        shape = (B, cfg.n_kv_head, S, cfg.head_dim)
        cache.update(torch.randn(shape, generator=g, device=device, dtype=dtype),
                     torch.randn(shape, generator=g, device=device, dtype=dtype), i)
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True) if compiled else hf.forward
    token = torch.zeros(B, 1, dtype=torch.long, device=device)
    with torch.no_grad():
        ms = step_ms(functools.partial(forward, use_cache=True, **{name: cache}), token, device, quick)
    elem = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.nbytes for n, p in hf.named_parameters() if "embed_tokens" not in n) + B * cfg.d_model * elem
    kv = 2 * cfg.n_layer * B * cfg.n_kv_head * (S + 1) * cfg.head_dim * elem
    out = row("transformers_static" + ("_compiled" if compiled else ""), "full", S, S, ms, weights, kv, bandwidth,
              transformers=__import__("transformers").__version__)
    del hf, cache
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def fit(rows: list[dict]) -> dict:
    """Per (method, path), the line through its two lengths: ms = fixed_ms + bytes / (GB_per_s * 1e6)."""
    out = {}
    for key in sorted({(r["method"], r["path"]) for r in rows}):
        pts = sorted((r["bytes"], r["ms"]) for r in rows if (r["method"], r["path"]) == key)
        if len(pts) < 2 or pts[-1][0] == pts[0][0]:
            continue
        (b0, t0), (b1, t1) = pts[0], pts[-1]
        slope = (t1 - t0) / (b1 - b0)                                   # ms per byte
        out[f"{key[0]} {key[1]}"] = ({"fixed_ms": t0 - slope * b0, "GB_per_s": 1e-6 / slope} if slope > 0 else
                                     {"fixed_ms": None, "GB_per_s": None, "why": "the longer step was not slower"})
    return out


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['path']:>20} {r['method']:>13} S={r['length']:<6} FAILED: {r['error']}"
    return (f"{r['path']:>20} {r['method']:>13} S={r['length']:<6} {r['entries']:>6} entries: {r['ms']:8.3f} ms/step; "
            f"{r['bytes'] / 1e9:.3f} GB -> {r['at_copy_bw_ms']:.3f} ms at copy bw "
            f"({100 * r['fraction_of_copy_bw']:.0f}%), fixed {r['fixed_ms']:.3f} ms")


def check_shapes(preset_name: str, quick: bool, lengths, batch: int | None, dtype: torch.dtype,
                 steps: int = 0) -> None:
    """Before any allocation, one line where a run cannot be made: the caches of ``batch`` sequences at the
    longest of ``lengths`` beyond this machine's memory, or ``steps`` steps after ``WARM`` beyond the room a
    cache leaves (``ROOM``: the buffers are allocated once, at the length plus that room)."""
    if steps > ROOM - WARM:
        cli.fail(f"--steps {steps}: at most {ROOM - WARM}, the steps a cache has room for after {WARM} warm-up ones")
    cfg = preset(preset_name, max_seq_len=max(lengths) + ROOM, **(QUICK_SHAPE if quick else {}))
    B = batch or (QUICK_BATCH if quick else BATCH)
    per_token = cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
    cli.check_fits(f"the caches of {B} sequences of {max(lengths) + ROOM} tokens ({preset_name})",
                   per_token * (max(lengths) + ROOM) * B)


def run(device: str, quick: bool, dtype: torch.dtype, hf_compile: bool = False, hf_only: bool = False,
        lengths: tuple | None = None, preset_name: str = PRESET, batch: int | None = None,
        tune: bool = True, save=None, paths: tuple = None) -> dict:
    """Every case at both lengths (or at ``lengths``), the ``preset_name`` shape (TINYLLAMA_1B unless given;
    ``SMOLLM2_135M`` is SmolLM2-135M's) with ``batch`` sequences (16 unless given); the report (printed as it
    goes). With ``tune``, on a GPU, the split kernel's launch is first timed and chosen at each length
    (``fastpath/tune.py``), and every step of that length launches it so. ``save(report)``, if given, is called
    after every length but the last with the report so far (``"complete": False``), so that a run cut short
    keeps the lengths it measured. ``paths``: the steps timed (default ``PATHS``, all four)."""
    B = batch or (QUICK_BATCH if quick else BATCH)
    lengths = lengths or (QUICK_LENGTHS if quick else LENGTHS)
    cfg = preset(preset_name, max_seq_len=max(lengths) + ROOM, **(QUICK_SHAPE if quick else {}))
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    bandwidth = copy_bandwidth(device, (1 << 30) if device == "cuda" and not quick else (1 << 26))
    print(f"e2e decode steps measured on {name} ({device}) in this run, {dtype}: every number below is this "
          f"device's. Copy bandwidth {bandwidth / 1e9:.0f} GB/s; {preset_name}{' (quick: shrunk)' if quick else ''} "
          f"shape, batch {B}, lengths {lengths}, keep {KEEP}")
    rows, hf = [], []
    model = decoders = None
    fused_backend = None if device == "cuda" else "eager"      # inductor on a GPU; on a CPU, traced alone
    if not hf_only:
        torch.manual_seed(0)
        model = random_model(cfg, dtype, device)
        graph = GraphDecoder(model)
        makers = {"lean": lambda: graph, "graph": lambda: graph,
                  "fused": lambda: FusedGraphDecoder(model, backend=fused_backend),
                  "skinny": lambda: SkinnyGraphDecoder(model, backend=fused_backend)}
        decoders = {path: makers[path]() for path in (paths or PATHS)}
    tuned, skinny_tuned, done = {}, {}, []

    def report_of(measured: list, complete: bool) -> dict:
        return {"device": device, "device_name": name, "copy_bandwidth": bandwidth, "dtype": str(dtype),
                "preset": preset_name, "quick": quick, "batch": B, "lengths": list(measured), "keep": KEEP,
                "config": cfg.to_dict(),
                "steps": {"warm": WARM, "steps": QUICK_STEPS if quick else STEPS,
                          "repeats": QUICK_REPEATS if quick else REPEATS},
                "fused_backend": fused_backend or "inductor", "tuned": tuned, "skinny_tuned": skinny_tuned,
                "paths": list(decoders or []), "rows": rows, "transformers": hf, "complete": complete,
                "fit": fit([r for r in rows + hf if isinstance(r, dict) and "ms" in r]),
                "note": f"measured on {name}; numbers from another device are not comparable"}
    if tune and device == "cuda" and not quick and not hf_only and "skinny" in decoders:
        skinny_tuned = tune_skinny_or_say_why(cfg, B, dtype, device, bandwidth)
        print("\n".join(skinny_summary(skinny_tuned)))
    for S in lengths:
        if tune and device == "cuda" and not quick and not hf_only:
            for key, sweep in tune_at(cfg, B, S, dtype, device, bandwidth).items():
                tuned[key] = sweep
                print("\n".join(tune_summary(sweep)))
        if not hf_only:
            for r in ours(cfg, model, decoders, B, S, dtype, device, bandwidth, METHODS_TIMED, quick):
                rows.append(r)
                print(format_row(r))
        for compiled in ([True] if hf_only and hf_compile else [False, True] if hf_compile else [False]):
            try:
                r = transformers_static(cfg, B, S, dtype, device, bandwidth, compiled, quick)
            except Exception as e:                      # noqa: BLE001  (another transformers: say so, go on)
                r = f"failed ({'compiled' if compiled else 'eager'}, S={S}): {type(e).__name__}: {e}"
                if device == "cuda":
                    torch.cuda.empty_cache()
            hf.append(r)
            print(format_row(r) if isinstance(r, dict) else f"transformers StaticCache step: {r}")
        if save is not None and S != lengths[-1]:       # what is measured so far, should a later length not end
            save(report_of(done + [S], False))
        done.append(S)
    report = report_of(done, True)
    print("\n".join(summary(report)))
    return report


# The targets of a run at the full shape (TINYLLAMA_1B, 16 sequences, bf16): the full cache's fraction of the
# copy bandwidth at every length, and keep 0.1's speed-up over the full cache on the same path, per length.
FULL_FRACTION = 0.5
SPEEDUP_TARGETS = {8192: {"snapkv": 1.5, "streaming_llm": 1.5, "h2o": 1.3},
                   32768: {"snapkv": 3.0, "streaming_llm": 3.0, "h2o": 2.5}}
VS_TRANSFORMERS = 10.0


def share(launch: dict) -> str:
    """" (80% of the copy bandwidth)" after a timed launch, where its run measured the copy bandwidth."""
    return f" ({copy_share(launch)})" if "fraction_of_copy_bw" in launch else ""


def logits_summary(report: dict) -> list[str]:
    """Per path, the largest gap of its first steps' logits, and of its last steps', from the first path's
    (``ours``), over the largest |logit|, and whether each is within what the tests allow between two paths
    (fp32 1e-5, else ``BF16_TOL``)."""
    allowed = 1e-5 if report.get("dtype") == str(torch.float32) else BF16_TOL
    lines = []
    for key, when in (("max_diff", "first step"), ("last_max_diff", "last step")):
        worst: dict[str, dict] = {}
        for r in report["rows"]:
            x = r.get("logits_vs", {}).get(key)
            if x is not None and x >= worst.get(r["path"], {"x": -1.0})["x"]:
                worst[r["path"]] = {"x": x, "vs": r["logits_vs"]["path"], "method": r["method"], "length": r["length"]}
        lines += [f"{path}: its {when}'s logits differ from {w['vs']}'s by at most {w['x']:.2g} of the largest "
                  f"|logit| ({w['method']}, S={w['length']})"
                  + ("" if w["x"] <= allowed else f": more than the {allowed:g} the tests allow, not the same step")
                  for path, w in worst.items()]
    return lines


def summary(report: dict, rows_too: bool = False) -> list[str]:
    """A report's rows as the ratios a reader asks for, each computed here from the recorded step times (with
    ``rows_too``, first the rows themselves and the fixed cost and rate of each line through two lengths): per
    length and path, the full cache's fraction of the copy bandwidth, keep 0.1's speed-up over the full
    cache on the same path, the full cache against transformers' StaticCache step (eager, and compiled if a
    row has it); then the targets above, met or not, for every path but the lean one."""
    rows = {(r["path"], r["method"], r["length"]): r for r in report["rows"] if "ms" in r}
    hf = {(r["path"], r["length"]): r for r in report.get("transformers", []) if isinstance(r, dict)}
    lines, steps = [], {}
    if rows_too:                                # what was measured, each row's time at the copy bandwidth
        lines += [f"measured on {report['device_name']}, copy bandwidth {report['copy_bandwidth'] / 1e9:.0f} GB/s, "
                  f"{report['preset']}, batch {report['batch']}, {report['dtype']}"]
        lines += [format_row(r) for r in report["rows"] + report.get("transformers", []) if isinstance(r, dict)]
        lines += [f"fit {key}: fixed {f['fixed_ms']:.3f} ms + bytes at {f['GB_per_s']:.0f} GB/s"
                  for key, f in report.get("fit", {}).items() if f.get("fixed_ms") is not None and
                  not key.endswith(" lean") and "transformers" not in key]
    for key, sweep in report.get("tuned", {}).items():            # the split kernel's launch at each length
        S, keep = key.split()[0], key.endswith(" keep")            # "8192": the full cache; "8192 keep": a tenth
        if "error" in sweep:
            lines.append(f"S={S:<6} {sweep['error']}{' (keep)' if keep else ''}")
            continue
        best, default = sweep["best"], sweep["default"]
        lines.append(f"S={S:<6} tuned{' at ' + str(sweep['shape']['entries']) + ' entries' if keep else ''}: "
                     f"{best['block_n']} tokens a block, {best['per_sm']} programs per SM, "
                     f"{best['num_warps']} warps, {best['num_stages']} stages: the split kernel alone "
                     f"{best['ms'] * 1e3:.1f} us{share(best)} against the default launch's "
                     + (f"{default['ms'] * 1e3:.1f} us{share(default)}" if "ms" in default
                        else default.get("error", "(not timed)")))
    if report.get("skinny_tuned"):                                # the skinny kernel's products, once per run
        lines += skinny_summary(report["skinny_tuned"])
    lines += logits_summary(report)
    if any(r.get("skinny_kernels") is False for r in rows.values()):
        lines.append("skinny: its kernels did not serve here (no sm_80+ GPU with Triton, NANOKV_NO_TRITON=1 or fp16), "
                     "so its rows time the fused step again")
    if report.get("device") not in (None, "cuda"):      # tiny shapes on a CPU: per-call overhead, no verdicts
        lines.append(f"on {report.get('device_name', 'a CPU')}: the times below are per-call overhead at these shapes "
                     "and move many-fold between runs; no ratio of them is a speed-up (run it on a GPU)")
        for S in report["lengths"]:
            for path in PATHS:
                here = [(m, rows[(path, m, S)]["ms"]) for m in METHODS_TIMED if (path, m, S) in rows]
                if here:
                    lines.append(f"S={S:<6} {path:>5}: " + ", ".join(f"{m} {ms:.3f} ms" for m, ms in here))
        return lines
    for S in report["lengths"]:
        for path in PATHS:
            full = rows.get((path, "full", S))
            if full is None:
                continue
            ups = {m: full["ms"] / rows[(path, m, S)]["ms"] for m in METHODS_TIMED[1:] if (path, m, S) in rows}
            vs = {name: hf[(name, S)]["ms"] / full["ms"] for name in ("transformers_static",
                  "transformers_static_compiled") if (name, S) in hf}
            lines.append(f"S={S:<6} {path:>5}: full {full['ms']:.3f} ms = {100 * full['fraction_of_copy_bw']:.0f}% of "
                         f"the copy bandwidth; keep {report['keep']}: "
                         + ", ".join(f"{m} {x:.2f}x" for m, x in ups.items())
                         + "".join(f"; {x:.2f}x faster than {name}" for name, x in vs.items()))
            if path != "lean":
                steps.setdefault(S, []).append((full["fraction_of_copy_bw"], ups, vs, path))
    if report["preset"] != PRESET or report["batch"] != BATCH or report["quick"]:
        return lines
    for S, targets in SPEEDUP_TARGETS.items():
        if S not in steps:
            continue
        for fraction, ups, vs, path in steps[S]:
            met = [f"full {fraction:.1%} >= {FULL_FRACTION:.0%} of copy bw: "
                   f"{'met' if fraction >= FULL_FRACTION else 'not met'}"]
            met += [f"{m} {ups.get(m, 0):.3f}x >= {t}x: {'met' if ups.get(m, 0) >= t else 'not met'}"
                    for m, t in targets.items()]
            if "transformers_static" in vs:
                x = vs["transformers_static"]
                met.append(f"{x:.3f}x transformers_static >= {VS_TRANSFORMERS:.0f}x: "
                           f"{'met' if x >= VS_TRANSFORMERS else 'not met'}")
            lines.append(f"targets S={S} {path}: " + "; ".join(met))
    return lines
