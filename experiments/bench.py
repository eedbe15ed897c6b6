"""
What the KV cache buys: decode speed with the cache vs recomputing the whole prefix for every new token.

Without a cache, each new token reruns the model over the whole prefix; with one (``decode_step``), a step
runs the model over the new token alone and only its attention reads the stored keys and values, at the
cost of ``2 * n_layer * n_kv_head * head_dim * bytes`` per token (``ModelConfig.kv_bytes_per_token``). This
module times both at several context lengths, interleaved in one run, reports medians, fits the per-step
cost as ``ms = a + b * context`` and checks the cache's byte count against the formula. ``--vs-transformers``
also times one greedy decode step against Hugging Face transformers, when it is installed.

    python -m experiments.bench --help

The cost of each mode, how the timing is done and the comparison with transformers: experiments/README.md,
section "bench.py: what the KV cache buys".
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import platform
import statistics
import tempfile
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from fastpath.lean import LeanDecoder
from nanollm.cache import KVCache
from nanollm.cli.provenance import provenance
from nanollm.cli.timing import elapsed_s, median_ms, quartiles
from nanollm.config import ModelConfig, preset
from nanollm.generation import decode_step, prefill
from nanollm.io import files
from nanollm.model import Transformer


@dataclass
class BenchRow:
    """Medians at one context length (tokens already cached when a timed step runs)."""

    context: int
    cached_ms: float          # one decode step with the KV cache
    recompute_ms: float       # one full uncached forward over the prefix + the new token
    kv_bytes: int             # cache.nbytes() after prefilling `context` tokens
    kv_bytes_formula: int     # config.kv_bytes_per_token(bytes) * context * batch
    cached_iqr_ms: tuple[float, float] = (math.nan, math.nan)      # quartiles of the repeats: the spread
    recompute_iqr_ms: tuple[float, float] = (math.nan, math.nan)

    @property
    def speedup(self) -> float:
        return self.recompute_ms / self.cached_ms


@dataclass
class BenchResult:
    config: ModelConfig
    batch: int
    threads: int
    repeats: int
    steps: int
    rows: list[BenchRow] = field(default_factory=list)
    fit: dict = field(default_factory=dict)   # {"cached": (a_ms, b_ms_per_token), "recompute": (...)}; empty
                                              # with fewer than two context lengths

    def to_dict(self) -> dict:
        return {
            "config": self.config.to_dict(), "batch": self.batch, "threads": self.threads,
            "repeats": self.repeats, "steps": self.steps,
            "rows": [{**asdict(r), "speedup": r.speedup} for r in self.rows],
            "fit": {mode: {"intercept_ms": a, "slope_us_per_1k_tokens": b * 1e6} for mode, (a, b) in self.fit.items()},
            "torch": torch.__version__, "machine": platform.platform(), "processor": platform.processor(),
        }


@torch.no_grad()
def time_cached(model: Transformer, ids: Tensor, context: int, steps: int) -> tuple[float, int]:
    """Mean ms of one cached decode step after ``context`` cached tokens, and the cache's bytes at that point.

    ids (B, >= context + steps): the first ``context`` are prefilled (not timed), then ``steps`` decode steps
    are timed, each feeding one more of ``ids``.
    """
    cache = KVCache(model.config)
    prefill(model, ids[:, :context], cache)
    nbytes = cache.nbytes()
    seconds, _ = elapsed_s(lambda: [decode_step(model, ids[:, context + i], cache) for i in range(steps)],
                           ids.device)
    return seconds * 1e3 / steps, nbytes


@torch.no_grad()
def time_recompute(model: Transformer, ids: Tensor, context: int, steps: int) -> float:
    """Mean ms to get the next token's logits by running the whole prefix again (no cache), ``steps`` times."""
    seconds, _ = elapsed_s(lambda: [model(ids[:, :context + i + 1])[:, -1] for i in range(steps)], ids.device)
    return seconds * 1e3 / steps


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares line y = a + b * x; returns (a, b)."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((xi - mx) ** 2 for xi in x)
    b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def run_bench(config: ModelConfig, contexts: list[int] = (128, 256, 512, 1024), batch: int = 1,
              repeats: int = 7, steps: int = 16, threads: int | None = 1, seed: int = 0,
              device: str = "cpu", verbose: bool = False) -> BenchResult:
    """Time cached vs recomputed decoding at every context length, interleaved; medians over ``repeats``.

    Parameters
    ----------
    config : model shape (a seeded random init is timed: speed does not depend on the weights).
    contexts : tokens already in the cache when a timed step runs; each + ``steps`` must fit max_seq_len.
    batch : sequences decoded together.
    repeats : independent measurements per length and mode; the median is reported.
    steps : decode steps averaged within one measurement.
    threads : ``torch.set_num_threads`` during the run (restored afterwards); None leaves it as is.
    """
    contexts = sorted(int(c) for c in contexts)
    if not contexts or contexts[0] <= 0:
        raise ValueError(f"contexts must be positive token counts, got {contexts}")
    if repeats <= 0 or steps <= 0 or batch <= 0:
        raise ValueError(f"repeats, steps and batch must be positive, got {repeats}, {steps}, {batch}")
    if contexts[-1] + steps > config.max_seq_len:
        raise ValueError(f"context {contexts[-1]} + {steps} steps exceeds max_seq_len={config.max_seq_len}; "
                         "raise max_seq_len or use shorter contexts")
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        model = Transformer(config).to(device).eval()
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, config.vocab_size, (batch, contexts[-1] + steps), generator=gen).to(device)
        for c in contexts:                                                 # warm-up, not recorded
            time_cached(model, ids, c, min(steps, 2))
            time_recompute(model, ids, c, min(steps, 2))
        cached = {c: [] for c in contexts}
        recompute = {c: [] for c in contexts}
        nbytes = {}
        for r in range(repeats):                                           # interleaved: every repeat
            for c in contexts:                                             # measures every length, both modes
                ms, nbytes[c] = time_cached(model, ids, c, steps)
                cached[c].append(ms)
                recompute[c].append(time_recompute(model, ids, c, steps))
            if verbose:
                print(f"  repeat {r + 1}/{repeats} done", flush=True)
    finally:
        torch.set_num_threads(old_threads)

    elem = torch.empty(0, dtype=next(model.parameters()).dtype).element_size()
    result = BenchResult(config=config, batch=batch, threads=threads or old_threads, repeats=repeats, steps=steps)
    for c in contexts:
        result.rows.append(BenchRow(context=c, cached_ms=statistics.median(cached[c]),
                                    recompute_ms=statistics.median(recompute[c]), kv_bytes=nbytes[c],
                                    kv_bytes_formula=config.kv_bytes_per_token(elem) * c * batch,
                                    cached_iqr_ms=quartiles(cached[c]), recompute_iqr_ms=quartiles(recompute[c])))
    if len(set(contexts)) >= 2:                                            # a line needs two lengths
        for mode in ("cached", "recompute"):
            result.fit[mode] = fit_line(contexts, [getattr(row, f"{mode}_ms") for row in result.rows])
    return result


def format_result(result: BenchResult, name: str = "") -> str:
    """The side-by-side table, the fitted cost lines and the byte check, as printed by the command line."""
    cfg = result.config
    lines = [
        f"model {name or cfg.flavour}: {cfg.flavour}, {cfg.n_layer} layers, {cfg.n_head} heads / {cfg.n_kv_head} "
        f"KV heads, d_model {cfg.d_model}; batch {result.batch}, fp32, {result.threads} thread(s); "
        f"median of {result.repeats} repeats x {result.steps} steps",
        "",
        f"{'context':>8} | {'cached ms/tok':>13} | {'recompute ms/tok':>16} | {'cached tok/s':>12} | "
        f"{'recompute tok/s':>15} | {'speedup':>7} | {'KV bytes':>10} | {'formula':>10}",
        "-" * 112,
    ]
    for r in result.rows:
        tok_s = 1e3 * result.batch
        lines.append(
            f"{r.context:>8} | {r.cached_ms:>13.3f} | {r.recompute_ms:>16.3f} | {tok_s / r.cached_ms:>12.0f} | "
            f"{tok_s / r.recompute_ms:>15.0f} | {r.speedup:>6.1f}x | {r.kv_bytes:>10,} | {r.kv_bytes_formula:>10,}")
    lines += ["", "cost of one decode step vs context, least-squares fit ms = a + b * context:"]
    if not result.fit:
        lines.append("  (no fit: it needs two or more context lengths)")
    for mode, (a, b) in result.fit.items():
        lines.append(f"  {mode:<9}: intercept a = {a:7.3f} ms   slope b = {b * 1e6:9.1f} µs per 1k tokens of context")
    formula = "2 * n_layer * n_kv_head * head_dim * bytes"
    ok = all(r.kv_bytes == r.kv_bytes_formula for r in result.rows)
    lines.append(f"\nKV bytes = {formula} * tokens * batch "
                 f"({cfg.kv_bytes_per_token()} bytes/token in fp32): {'matches' if ok else 'MISMATCH'}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Optional: the same decode step in Hugging Face transformers (only when it is installed)

HF_CONTEXTS = (128, 512, 960)
HF_WARMUP = 3                   # untimed steps of each sequence before the timed repeats


def read_bandwidth(mib: int = 512, repeats: int = 10, device: str | torch.device = "cpu") -> float:
    """The device's read bandwidth in GB/s (on a CPU, with the current thread count): median time of
    ``x.sum()`` over an fp32 tensor of ``mib`` MiB (larger than any cache level, so every byte comes from
    memory), synchronised on a GPU."""
    x = torch.ones(mib * 2**20 // 4, device=device)
    ms = median_ms(x.sum, repeats, warmup=1, device=x.device)   # the warm-up: first touch
    return x.nbytes / (ms / 1e3) / 1e9


def decode_weight_bytes(model: Transformer) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied LM head is the embedding
    matrix, read in full by the head), except an untied token embedding, of which a step reads one row."""
    unique = {p.data_ptr(): p for p in model.parameters()}.values()
    total = sum(p.nbytes for p in unique)
    if not model.config.tie_embeddings:
        total -= model.tok_emb.weight.nbytes
    return total


def transformers_available() -> bool:
    try:
        importlib.import_module("transformers")
    except ImportError:
        return False
    return True


class GreedyDecoder:
    """One implementation's sequence: a prefilled cache and the greedy next token; ``step()`` feeds it."""

    def __init__(self, name: str, model, ids: Tensor) -> None:
        self.name = name
        if name in ("nanollm", "nanollm-lean"):
            self.cache = KVCache(model.config)
            logits = prefill(model, ids, self.cache)[:, -1]                    # (1, V)
            lean = LeanDecoder(model) if name == "nanollm-lean" else None
            self._logits = (lambda t: decode_step(model, t, self.cache)) if lean is None else \
                (lambda t: lean.step(t, self.cache))                           # next-token logits (1, V)
        else:
            from transformers import DynamicCache
            self.cache = DynamicCache(config=model.config)                   # grows in place at every call
            name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            logits = model(input_ids=ids, use_cache=True, **{name: self.cache}).logits[:, -1]
            self._logits = lambda t: model(input_ids=t[:, None], use_cache=True, **{name: self.cache}).logits[:, -1]
        self.first_logits = logits
        self.token = logits.argmax(-1)                                         # (1,)

    def step(self) -> float:
        """ms of one greedy decode step (the forward of one token over the cache, and its argmax)."""
        seconds, self.token = elapsed_s(lambda: self._logits(self.token).argmax(-1), self.token.device)
        return seconds * 1e3


@torch.no_grad()
def run_vs_transformers(checkpoint: str = "retrieval-llama", contexts=HF_CONTEXTS, repeats: int = 7,
                        warmup: int = HF_WARMUP, seed: int = 0) -> dict | None:
    """ms of one greedy decode step, nanollm (plain ``KVCache``) vs transformers' ``LlamaForCausalLM`` with a
    ``DynamicCache``, on the same weights (exported with ``hf.export_hf`` to a temporary folder), one thread.

    For every context the three (nanollm's ``decode_step``, its lean step, transformers) are prefilled with
    the same random ids (untimed), then each repeat times one step of every (context, implementation), in
    alternating order; medians. Each
    sequence continues greedily, so it grows by one token per step. Also records the largest difference of
    the two models' next-token logits after the prefill (they are the same model). Returns None when
    transformers cannot be imported.
    """
    if not transformers_available():
        return None
    import transformers
    from transformers import LlamaForCausalLM

    from nanollm.io.checkpoint import load
    from nanollm.io.hf import export_hf
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    contexts = sorted(int(c) for c in contexts)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, _, _ = load(checkpoint)
        if model.config.flavour != "llama":
            raise ValueError(f"the comparison runs LlamaForCausalLM; {checkpoint} is a {model.config.flavour} model")
        if contexts[-1] + warmup + repeats > model.config.max_seq_len:
            raise ValueError(f"context {contexts[-1]} + {warmup} warm-up + {repeats} repeats exceeds the "
                             f"checkpoint's max_seq_len={model.config.max_seq_len}")
        with tempfile.TemporaryDirectory() as folder:
            export_hf(model, folder)
            hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (1, contexts[-1]), generator=gen)
        runs = {c: [GreedyDecoder("nanollm", model, ids[:, :c]), GreedyDecoder("transformers", hf, ids[:, :c]),
                    GreedyDecoder("nanollm-lean", model, ids[:, :c])] for c in contexts}
        for trio in runs.values():
            for _ in range(warmup):
                for run in trio:
                    run.step()
        times = {(c, run.name): [] for c, trio in runs.items() for run in trio}
        for r in range(repeats):
            for c, trio in runs.items():
                for run in (trio if r % 2 == 0 else trio[::-1]):
                    times[c, run.name].append(run.step())
    finally:
        torch.set_num_threads(old_threads)
    rows = []
    for c, (ours, theirs, _) in runs.items():
        nano_ms, hf_ms = statistics.median(times[c, "nanollm"]), statistics.median(times[c, "transformers"])
        lean_ms = statistics.median(times[c, "nanollm-lean"])
        rows.append({"context": c, "nanollm_ms": nano_ms, "transformers_ms": hf_ms, "lean_ms": lean_ms,
                     "ratio_hf_over_nanollm": hf_ms / nano_ms, "ratio_hf_over_lean": hf_ms / lean_ms,
                     "max_logit_diff": (ours.first_logits - theirs.first_logits).abs().max().item()})
    return {"checkpoint": checkpoint, "transformers": transformers.__version__,
            "attn_implementation": getattr(hf.config, "_attn_implementation", None), "threads": 1,
            "repeats": repeats, "warmup": warmup, "rows": rows}


def format_vs_transformers(result: dict | None) -> str:
    if result is None:
        return "transformers is not installed: the comparison with it (--vs-transformers) is skipped"
    lines = [f"one greedy decode step, nanollm (KVCache; decode_step and the lean step of fastpath/lean.py) vs "
             f"transformers {result['transformers']} (LlamaForCausalLM + DynamicCache, attention "
             f"{result['attn_implementation']}) on {result['checkpoint']}, 1 thread, median of {result['repeats']} "
             f"interleaved repeats",
             f"{'context':>8} | {'nanollm ms/tok':>14} | {'lean ms/tok':>11} | {'transformers ms/tok':>19} | "
             f"{'hf / nanollm':>12} | {'hf / lean':>9} | {'max |logit diff|':>16}", "-" * 110]
    for r in result["rows"]:
        lines.append(f"{r['context']:>8} | {r['nanollm_ms']:>14.3f} | {r['lean_ms']:>11.3f} | "
                     f"{r['transformers_ms']:>19.3f} | {r['ratio_hf_over_nanollm']:>11.2f}x | "
                     f"{r['ratio_hf_over_lean']:>8.2f}x | {r['max_logit_diff']:>16.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> BenchResult:
    from nanollm import cli
    from nanollm.config import PRESETS
    ap = cli.ArgumentParser(
        prog="python -m experiments.bench",
        description="Decode tokens/s with the KV cache vs recomputing the whole prefix for every new token, at "
                    "several context lengths, measured interleaved in one run; medians of several repeats. "
                    "Also fits the per-step cost as ms = a + b * context and checks the cache's byte count "
                    "against 2 * n_layer * n_kv_head * head_dim * bytes * tokens.")
    ap.add_argument("--preset", default="TINY", choices=sorted(PRESETS),
                    help="model shape from nanollm.config.PRESETS, randomly initialised (default %(default)s)")
    ap.add_argument("--max-seq-len", type=cli.positive_int, default=2048,
                    help="override the preset's max_seq_len (tokens) so the longest context fits "
                         "(default %(default)s)")
    ap.add_argument("--contexts", type=cli.positive_int, nargs="+", default=[128, 256, 512, 1024],
                    help="two or more context lengths in tokens: tokens already cached when a timed step runs "
                         "(default %(default)s)")
    ap.add_argument("--batch", type=cli.positive_int, default=1,
                    help="sequences decoded together (default %(default)s)")
    ap.add_argument("--repeats", type=cli.positive_int, default=7,
                    help="measurements per length and mode; the median is reported (default %(default)s)")
    ap.add_argument("--steps", type=cli.positive_int, default=16,
                    help="decode steps averaged within one measurement (default %(default)s)")
    ap.add_argument("--threads", type=cli.threads_or_workers, default=1,
                    help="torch.set_num_threads for the run, at most the CPU cores; 1 makes runs comparable "
                         "across machines (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the random weights and token ids (default %(default)s)")
    ap.add_argument("--device", type=cli.device, default="cpu",
                    help="torch device, e.g. cpu or cuda (default %(default)s)")
    ap.add_argument("--json", metavar="PATH", type=cli.output_file, default=None,
                    help="also write the results to this JSON file (default: none)")
    ap.add_argument("--vs-transformers", nargs="?", const="retrieval-llama", default=None, metavar="CHECKPOINT",
                    help="also time one greedy decode step against Hugging Face transformers (LlamaForCausalLM "
                         f"+ DynamicCache) at contexts {', '.join(map(str, HF_CONTEXTS))} on one thread, --repeats "
                         "interleaved repeats, on a Llama checkpoint (bundled name or folder; retrieval-llama "
                         "when none is given), exported with nanollm.hf; only if transformers is installed, "
                         "otherwise one line says it is skipped (default: no comparison)")
    args = ap.parse_args(argv)

    with cli.errors(args.debug):
        cli.check_outputs({"--json": args.json}, inputs=[args.vs_transformers])
        if len(set(args.contexts)) < 2:
            cli.fail(f"--contexts needs two or more different lengths to fit a line, got {args.contexts}")
        if max(args.contexts) + args.steps > args.max_seq_len:
            cli.fail(f"--contexts {max(args.contexts)} + --steps {args.steps} exceeds --max-seq-len "
                     f"{args.max_seq_len}; raise --max-seq-len or use shorter contexts")
        if args.vs_transformers is not None:
            from nanollm.io.checkpoint import load_config
            try:
                hf_config = load_config(args.vs_transformers)
            except ValueError as e:
                cli.fail(f"--vs-transformers: {e}")
            if hf_config.flavour != "llama":
                cli.fail(f"--vs-transformers {args.vs_transformers} is a {hf_config.flavour} model; the comparison "
                         "runs LlamaForCausalLM, so it needs a llama checkpoint")
            if HF_CONTEXTS[-1] + HF_WARMUP + args.repeats > hf_config.max_seq_len:
                cli.fail(f"--vs-transformers {args.vs_transformers}: context {HF_CONTEXTS[-1]} + {HF_WARMUP} warm-up "
                         f"+ --repeats {args.repeats} steps exceeds its max_seq_len={hf_config.max_seq_len}")
        config = preset(args.preset, max_seq_len=args.max_seq_len)
        longest = max(args.contexts) + args.steps       # the cache of the longest context, and its recompute
        cli.check_fits(f"--contexts {max(args.contexts)} (batch {args.batch}, preset {args.preset})",
                       2 * args.batch * longest * (config.kv_bytes_per_token() + 4 * config.d_model))
        result = run_bench(config, args.contexts, batch=args.batch, repeats=args.repeats, steps=args.steps,
                           threads=args.threads, seed=args.seed, device=args.device)
        print(format_result(result, name=args.preset))
        vs_hf = None
        if args.vs_transformers is not None:
            vs_hf = run_vs_transformers(args.vs_transformers, repeats=args.repeats, seed=args.seed)
            print("\n" + format_vs_transformers(vs_hf))
            if vs_hf is None:
                vs_hf = {"skipped": "transformers is not installed"}
        if args.json:
            prov = provenance(argv, prog=ap.prog, threads=args.threads, dtype="float32", seed=args.seed)
            files.atomic_write_text(args.json, json.dumps({"preset": args.preset, "device": args.device,
                                                         **result.to_dict(), "vs_transformers": vs_hf,
                                                         "provenance": prov}, indent=2))
            print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
