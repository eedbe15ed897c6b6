"""
Speed on a real model: prompt (prefill) and decode tokens per second against Hugging Face transformers on
the same weights, and the decode step against its roofline. ``python -m experiments.speed --help``.

For each context length T, with the same random token ids for both libraries, it times the prefill of T
tokens into a KV cache and one greedy decode step over a cache of about T tokens (``decode_step``, the lean
step of ``fastpath/lean.py``, and transformers with a ``DynamicCache``), interleaved, and reports medians.
A decode step reads every weight and every cached key and value once for a handful of multiply-adds, so on
a CPU it is bound by memory bandwidth: ``of roofline`` is the time reading those bytes takes at the read
bandwidth measured in the same run, over the measured time.

What is timed exactly, the roofline's bytes and SmolLM2-135M's numbers: experiments/README.md, section
"speed.py: a real model against transformers, and the roofline".
"""

from __future__ import annotations

import json
import statistics
import tempfile

import torch

from nanollm import cli
from nanollm.cache import KVCache
from nanollm.cli.provenance import provenance
from nanollm.cli.timing import elapsed_s
from nanollm.generation import prefill
from nanollm.io import files

from .bench import GreedyDecoder, decode_weight_bytes, read_bandwidth, transformers_available

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _ms(f) -> float:
    """Milliseconds of one call of ``f``."""
    return elapsed_s(f)[0] * 1e3


def _hf_model(model, dtype: torch.dtype):
    """transformers' LlamaForCausalLM with ``model``'s weights (written by ``export_hf``, read back)."""
    import transformers
    from transformers import LlamaForCausalLM

    from nanollm.io.hf import export_hf
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        export_hf(model, folder)
        return LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval(), transformers.__version__


def reference_text() -> str:
    """Fixed English text for the dtype cost, shipped with the package: the docstrings of the reading path."""
    from nanollm import attention, cache, generation, model, policy, storage
    return "\n\n".join(m.__doc__.strip() for m in (model, attention, storage, policy, cache, generation))


def dtype_cost(checkpoint: str, dtype: torch.dtype, text: str, tokens: int = 512) -> dict:
    """What ``dtype`` costs against fp32 on ``tokens`` tokens of ``text``: mean KL(fp32 || dtype) per token in
    nats, the fraction of positions with the same top-1 token, and both perplexities."""
    from nanollm.io.checkpoint import load
    ref, tok, _ = load(checkpoint)
    low, _, _ = load(checkpoint, dtype=dtype)
    ids = torch.tensor([tok.encode(text)[:tokens]])
    with torch.no_grad():
        p, q = ref(ids).log_softmax(-1), low(ids).float().log_softmax(-1)       # (1, T, V)
    nll = lambda lp: -lp[0, :-1].gather(-1, ids[0, 1:, None]).mean().item()    # noqa: E731
    return {"dtype": str(dtype).removeprefix("torch."), "tokens": ids.shape[1],
            "kl": (p.exp() * (p - q)).sum(-1).mean().item(),
            "top1_agreement": (p.argmax(-1) == q.argmax(-1)).float().mean().item(),
            "ppl_fp32": float(torch.tensor(nll(p)).exp()), "ppl": float(torch.tensor(nll(q)).exp())}


@torch.no_grad()
def run_speed(checkpoint: str = "smollm2-135m", contexts=(512, 2048, 8192), threads: int = 2, repeats: int = 3,
              steps: int = 8, warmup: int = 2, dtype: str = "float32", vs_transformers: bool = True,
              seed: int = 0, progress: bool = True) -> dict:
    """The whole benchmark as a JSON-ready dict (see ``format_speed``)."""
    from nanollm.io.checkpoint import load
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    say = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    try:
        model, _, _ = load(checkpoint, dtype=DTYPES[dtype])
        config = model.config
        n = warmup + steps
        if max(contexts) > config.max_seq_len or min(contexts) <= n:
            raise ValueError(f"contexts must lie in ({n}, {config.max_seq_len}]: {list(contexts)}")
        hf, hf_version = _hf_model(model, DTYPES[dtype]) if vs_transformers else (None, None)
        bandwidth = read_bandwidth(512)
        weight_bytes = decode_weight_bytes(model)
        kv_per_token = config.kv_bytes_per_token(model.tok_emb.weight.element_size())
        gen = torch.Generator().manual_seed(seed)
        rows = []
        for T in sorted(contexts):
            ids = torch.randint(0, config.vocab_size, (1, T), generator=gen)
            say(f"context {T}: prefill ...")
            fills = {"nanollm": lambda: prefill(model, ids, KVCache(config))}
            if hf is not None:
                fills["transformers"] = lambda: hf(input_ids=ids, use_cache=True)
            prefill_ms = {name: [] for name in fills}
            for r in range(repeats):
                for name in (list(fills) if r % 2 == 0 else list(fills)[::-1]):
                    prefill_ms[name].append(_ms(fills[name]))
            say(f"context {T}: decode ...")
            prompt = ids[:, :T - n]
            runs = [GreedyDecoder("nanollm", model, prompt), GreedyDecoder("nanollm-lean", model, prompt)]
            if hf is not None:
                runs.append(GreedyDecoder("transformers", hf, prompt))
            step_ms = {run.name: [] for run in runs}
            for s in range(n):
                for run in (runs if s % 2 == 0 else runs[::-1]):
                    ms = run.step()
                    if s >= warmup:
                        step_ms[run.name].append(ms)
            del runs
            read = weight_bytes + kv_per_token * (T - 1 - steps // 2)        # the middle timed step
            ideal_ms = read / bandwidth / 1e6
            row = {"context": T,
                   "prefill_tok_s": {k: T / (statistics.median(v) / 1e3) for k, v in prefill_ms.items()},
                   "decode_ms": {k: statistics.median(v) for k, v in step_ms.items()},
                   "bytes_per_step": read, "ideal_ms": ideal_ms}
            row["decode_tok_s"] = {k: 1e3 / v for k, v in row["decode_ms"].items()}
            row["of_roofline"] = {k: ideal_ms / v for k, v in row["decode_ms"].items()}
            rows.append(row)
    finally:
        torch.set_num_threads(old_threads)
    return {"checkpoint": checkpoint, "dtype": dtype, "threads": threads, "repeats": repeats, "steps": steps,
            "warmup": warmup, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
            "bandwidth_gb_s": bandwidth, "transformers": hf_version, "torch": torch.__version__, "rows": rows}


def format_speed(result: dict) -> str:
    hf = result["transformers"] is not None
    lines = [f"{result['checkpoint']}, {result['dtype']}, batch 1, {result['threads']} thread(s); medians of "
             f"{result['repeats']} prefills and {result['steps']} decode steps (after {result['warmup']} warm-up), "
             "interleaved" + (f"; transformers {result['transformers']} (sdpa) on the same weights" if hf else ""),
             f"decode roofline: {result['weight_bytes'] / 1e6:.0f} MB of weights + {result['kv_bytes_per_token']} "
             f"bytes of K/V per token per step, at the measured read bandwidth {result['bandwidth_gb_s']:.1f} GB/s",
             "",
             f"{'context':>7} | {'prefill tok/s: nanollm':>22} {'hf':>7} {'ratio':>6} | "
             f"{'decode tok/s: nanollm':>21} {'lean':>6} {'hf':>6} {'ratio':>6} {'lean':>6} | "
             f"{'MB/step':>7} {'ideal ms':>8} {'roofline: nanollm':>17} {'lean':>5}"]
    lines.append("-" * len(lines[-1]))
    for r in result["rows"]:
        p, d, roof = r["prefill_tok_s"], r["decode_tok_s"], r["of_roofline"]
        hp, hd = p.get("transformers"), d.get("transformers")
        ratio = lambda a, b: "-" if b is None else f"{a / b:.2f}x"       # noqa: E731
        number = lambda x, spec: "-" if x is None else format(x, spec)    # noqa: E731  (none measured: "-")
        lines.append(f"{r['context']:>7} | {p['nanollm']:>22.0f} {number(hp, '.0f'):>7} {ratio(p['nanollm'], hp):>6} | "
                     f"{d['nanollm']:>21.1f} {d['nanollm-lean']:>6.1f} {number(hd, '.1f'):>6} "
                     f"{ratio(d['nanollm'], hd):>6} "
                     f"{ratio(d['nanollm-lean'], hd):>6} | {r['bytes_per_step'] / 1e6:>7.0f} {r['ideal_ms']:>8.1f} "
                     f"{roof['nanollm']:>17.0%} {roof['nanollm-lean']:>5.0%}")
    lines += ["", "nanollm: prefill() and decode_step(); lean: the lean decode step (fastpath/lean.py); ratio: "
                  "nanollm / transformers (above 1: nanollm is faster); roofline: ideal ms / measured ms"]
    at = {r["context"]: r for r in result["rows"]}
    verdict = lambda value, goal: "met" if value >= goal else "NOT met"        # noqa: E731
    if 2048 in at and hf:
        p, d = at[2048]["prefill_tok_s"], at[2048]["decode_tok_s"]
        value = p["nanollm"] / p["transformers"]
        lines.append(f"target prefill >= 1.0x transformers at 2k: {value:.3f}x, {verdict(value, 1.0)}")
        for step in ("nanollm", "nanollm-lean"):
            value = d[step] / d["transformers"]
            lines.append(f"target decode >= 1.2x transformers at 2k, {step}: {value:.3f}x, {verdict(value, 1.2)}")
    for r in result["rows"]:
        lines.append(f"target decode step >= 50% of its roofline at {r['context']}: " + ", ".join(
            f"{step} {r['of_roofline'][step]:.1%} {verdict(r['of_roofline'][step], 0.5)}"
            for step in ("nanollm", "nanollm-lean")))
    if result.get("dtype_cost"):
        c = result["dtype_cost"]
        lines.append(f"{c['dtype']} vs fp32 on {c['tokens']} tokens of the reading path's docstrings: KL {c['kl']:.4f} "
                     "nats per token, "
                     f"top-1 agreement {c['top1_agreement']:.1%}, perplexity {c['ppl']:.2f} vs {c['ppl_fp32']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = cli.ArgumentParser(
        prog="python -m experiments.speed",
        description="Prefill and decode speed of a real model, nanollm against Hugging Face transformers on the "
                    "same weights (interleaved, medians), and the decode step against its roofline (bytes of "
                    "weights + K/V read per step / the measured read bandwidth).")
    ap.add_argument("--checkpoint", default="smollm2-135m",
                    help="a fetched or bundled model name, a folder or a GGUF file (default %(default)s)")
    ap.add_argument("--contexts", type=cli.positive_int, nargs="+", default=[512, 2048, 8192], metavar="T",
                    help="prompt lengths; decode steps are timed with up to T tokens cached (default 512 2048 8192)")
    ap.add_argument("--threads", type=cli.threads_or_workers, default=2,
                    help="torch threads, at most the CPU cores (default %(default)s)")
    ap.add_argument("--repeats", type=cli.positive_int, default=3,
                    help="timed prefills per context and implementation (default %(default)s)")
    ap.add_argument("--steps", type=cli.positive_int, default=8,
                    help="timed decode steps per context and implementation (default %(default)s)")
    ap.add_argument("--warmup", type=cli.non_negative_int, default=2,
                    help="untimed decode steps before them (default %(default)s)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                    help="weights and cache dtype; bfloat16 also measures its cost against fp32 (KL, top-1 "
                         "agreement, perplexity on the docstrings of nanollm's reading path) (default %(default)s)")
    ap.add_argument("--no-transformers", action="store_true",
                    help="time nanollm alone (also what happens when transformers is not installed)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the token ids (default %(default)s)")
    ap.add_argument("--json", type=cli.output_file, default=None, metavar="PATH",
                    help="write every number to PATH (default: none)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        cli.check_outputs({"--json": args.json}, inputs=[args.checkpoint])
        from nanollm.io.checkpoint import load_config
        config = load_config(args.checkpoint)
        n = args.warmup + args.steps
        bad = [t for t in args.contexts if t > config.max_seq_len or t <= n]
        if bad:
            cli.fail(f"--contexts {bad}: each must lie in ({n}, {config.max_seq_len}] (the warm-up and timed steps "
                     "fit inside it; the model has max_seq_len positions)")
        vs = not args.no_transformers and transformers_available()
        result = run_speed(args.checkpoint, args.contexts, args.threads, args.repeats, args.steps, args.warmup,
                           args.dtype, vs, args.seed, progress=not args.quiet)
        if args.dtype != "float32":
            result["dtype_cost"] = dtype_cost(args.checkpoint, DTYPES[args.dtype], reference_text())
        print(format_speed(result))
        if args.json:
            result["provenance"] = provenance(argv, prog=ap.prog, threads=args.threads, dtype=args.dtype,
                                              seed=args.seed)
            files.atomic_write_text(args.json, json.dumps(result, indent=1))
            print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
