"""
Decoding many caches at once: what one batched step saves over stepping each cache on its own.
``python -m experiments.evaluation.throughput --help``.

Stepped one by one (``LeanDecoder.step``) every cache's step reads every weight matrix; stepped together
(``side_by_side.step_many``) the products run over all caches' rows in blocks, reading the weights once per
block. Each cache's attention and hooks cannot be shared, which bounds the speedup. Both ways run side by
side in one run on the same caches; printed: each way's time, the speedup, the batched step's split into
shared and own work, and the weight-read roofline. How: ``inside.md``, "throughput.py".
"""

from __future__ import annotations

import copy
import json
import statistics
import time

import torch
from tqdm import tqdm

from experiments.bench import decode_weight_bytes, read_bandwidth
from fastpath.lean import LeanDecoder
from methods import METHODS, make_policy, method_chain
from nanollm import cli, load
from nanollm.cache import KVCache
from nanollm.cli.provenance import header, provenance
from nanollm.cli.timing import elapsed_s
from nanollm.data.tasks import make_sample
from nanollm.io.files import atomic_write_text

from . import budget_for
from .compare import DEFAULT_KEEP_RATIOS
from .engines import make_engine
from .side_by_side import ROWS, FastEngine, step_many


@torch.no_grad()
def one_by_one(lean: LeanDecoder, caches: list[KVCache], tokens: list[int]) -> tuple[float, torch.Tensor]:
    """Seconds to feed ``tokens`` to every cache, each cache's step on its own; the last step's logits."""
    device = lean.model.tok_emb.weight.device

    def steps():
        for token in tokens:
            logits = [lean.step(torch.tensor([token], device=device), cache) for cache in caches]
        return torch.cat(logits)
    return elapsed_s(steps, device)


@torch.no_grad()
def batched(engine: FastEngine, caches: list[KVCache], tokens: list[int]) -> tuple[float, list[float], torch.Tensor]:
    """Seconds to feed ``tokens`` to every cache with the fast engine's step (``step_many``), the seconds of
    that spent in each cache's own attention, and the last step's logits."""
    own = [0.0] * len(caches)                      # on a GPU without a sync per cache: launch time, roughly

    def steps():
        for token in tokens:
            logits, _ = step_many(engine.lean, [torch.tensor([token], device=engine.device)] * len(caches), caches,
                                  own)
        return logits
    seconds, logits = elapsed_s(steps, engine.device)
    return seconds, own, logits


def run(model, tok, task: str, methods: list[str], keep_ratios: list[float], length: int, steps: int,
        repeats: int, bandwidth_mib: int = 512, progress: bool = True) -> dict:
    """Time both ways of decoding every (method, keep ratio) cache of one ``task`` sample; every number of
    the report (see the module docstring)."""
    sample = make_sample(task, tok, length - steps, seed=0)
    specs = [("full", None)] + [(m, budget_for(r, length)) for m in methods if m != "full" for r in keep_ratios]
    tokens = (sample.target_ids * steps)[:steps]                # the answer's tokens, fed as decoding would
    engine = make_engine("fast", model)
    t0 = time.perf_counter()
    caches, _ = engine.fill([make_policy(m, budget=b) for m, b in specs], [sample.prompt_ids])
    prefill_s = time.perf_counter() - t0
    times = {"one_by_one": [], "batched": [], "own": [], "own_each": []}
    bar = tqdm(range(repeats), desc="throughput", unit="repeat", disable=not progress, dynamic_ncols=True)
    for _ in bar:                                # alternate the two ways: a slow spell of the machine hits both
        s1, single = one_by_one(engine.lean, copy.deepcopy(caches), tokens)
        s2, own_each, together = batched(engine, copy.deepcopy(caches), tokens)
        times["one_by_one"].append(s1), times["batched"].append(s2), times["own"].append(sum(own_each))
        times["own_each"].append(own_each)
    one, both, own = (statistics.median(times[k]) / steps for k in ("one_by_one", "batched", "own"))
    own_by_method: dict[str, float] = {}         # ms per step of each method's caches (median per cache, summed)
    for (name, _), *per_repeat in zip(specs, *times["own_each"]):
        own_by_method[name] = own_by_method.get(name, 0.0) + statistics.median(per_repeat) / steps * 1e3
    weights = decode_weight_bytes(model)
    bandwidth = read_bandwidth(bandwidth_mib, device=engine.device) * 1e9                             # bytes / s
    n = len(caches)
    blocks = -(-n // ROWS)
    return {
        "device": str(engine.device), "length": length, "prompt_tokens": len(sample.prompt_ids), "steps": steps,
        "repeats": repeats, "caches": n,
        "configurations": [f"{m}" if b is None else f"{m}@{b}" for m, b in specs], "rows_per_block": ROWS,
        "prefill_s": prefill_s,
        "one_by_one_ms_per_step": one * 1e3, "batched_ms_per_step": both * 1e3,
        "batched_own_attention_ms": own * 1e3, "batched_shared_ms": (both - own) * 1e3,
        "own_attention_ms_by_method": own_by_method, "speedup_if_shared_were_free": one / own,
        "one_by_one_cache_steps_per_s": n / one, "batched_cache_steps_per_s": n / both, "speedup": one / both,
        "weight_bytes": weights, "bandwidth_gb_per_s": bandwidth / 1e9,
        "weight_read_ms_one_by_one": n * weights / bandwidth * 1e3,
        "weight_read_ms_batched": blocks * weights / bandwidth * 1e3,
        "max_logit_difference": float((single - together).abs().max()),
    }


def format_result(r: dict) -> str:
    speed = f"{r['speedup']:.2f}x"
    return "\n".join([
        f"{r['caches']} caches of one sample ({', '.join(r['configurations'])}), {r['prompt_tokens']}-token "
        f"prompt (one shared prompt pass: {r['prefill_s']:.1f} s), {r['steps']} decode steps, median of "
        f"{r['repeats']} alternating repetitions",
        "",
        f"{'':<32}{'ms / step':>10}{'cache-steps / s':>17}{'weight-read roofline ms':>25}",
        f"{'one by one (LeanDecoder.step)':<32}{r['one_by_one_ms_per_step']:>10.1f}"
        f"{r['one_by_one_cache_steps_per_s']:>17.1f}{r['weight_read_ms_one_by_one']:>25.1f}",
        f"{'batched (step_many)':<32}{r['batched_ms_per_step']:>10.1f}"
        f"{r['batched_cache_steps_per_s']:>17.1f}{r['weight_read_ms_batched']:>25.1f}",
        "",
        f"batched / one by one: {speed} faster per step. The batched step: {r['batched_shared_ms']:.1f} ms shared "
        f"(products in blocks of {r['rows_per_block']} rows, element-wise work), {r['batched_own_attention_ms']:.1f} "
        "ms in the caches' own attention and policy hooks, which no batching removes.",
        f"Even if the shared part took no time, batching could be at most {r['speedup_if_shared_were_free']:.2f}x "
        "faster (one by one / own work). The own work per step, by method (its caches summed): "
        + ", ".join(f"{m} {ms:.1f}" for m, ms in sorted(r["own_attention_ms_by_method"].items(),
                                                        key=lambda item: -item[1])) + " ms.",
        f"roofline: {r['weight_bytes'] / 1e6:.0f} MB of weights read once per cache or once per block at the "
        f"{r['bandwidth_gb_per_s']:.1f} GB/s measured here ({r['device']}). Largest logit difference between the "
        "two ways: "
        f"{r['max_logit_difference']:.1e} (the products round differently in blocks).",
    ])


def check_bandwidth_mib(mib: int, device: str) -> None:
    """``--bandwidth-mib``: the tensor it names must fit in the memory of the machine, or of the GPU, before the
    model loads (``torch.ones`` of 10^12 MiB would end in a traceback)."""
    need = mib * 2**20
    cli.check_fits(f"--bandwidth-mib {mib}", need)
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        if need > free:
            cli.fail(f"--bandwidth-mib {mib} needs {need / 2**30:,.1f} GiB on {device}, which has "
                     f"{free / 2**30:.1f} GiB free")


def parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(
        prog="python -m experiments.evaluation.throughput",
        description="Decode the full cache and every method at every keep ratio on one sample, each cache "
                    "stepped on its own against all stepped together (experiments.compare's batched step), side by "
                    "side in one run: time per step, caches x steps per second, and the weight-read roofline.")
    ap.add_argument("--checkpoint", default="smollm2-135m",
                    help="bundled checkpoint name, fetched model's name, checkpoint folder or GGUF file "
                         "(default %(default)s)")
    ap.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                    help=f"methods beside the full cache, MODULE:CLASS for a policy class of your own (default: "
                         f"every registered one: {', '.join(METHODS)})")
    ap.add_argument("--keep-ratios", nargs="+", type=float, default=DEFAULT_KEEP_RATIOS, metavar="R",
                    help="budgets as fractions of --length, each in (0, 1] (default %(default)s)")
    ap.add_argument("--task", default=None,
                    help="the sample's task (default: the first of the checkpoint card's default suite)")
    ap.add_argument("--length", type=cli.positive_int, default=2048,
                    help="tokens of the sample: prompt + the decode steps (default %(default)s)")
    ap.add_argument("--steps", type=cli.positive_int, default=8, help="decode steps timed (default %(default)s)")
    ap.add_argument("--repeats", type=cli.positive_int, default=3,
                    help="timed repetitions of each way, alternating; the median counts (default %(default)s)")
    ap.add_argument("--device", type=cli.device, default="cpu", help="torch device (default %(default)s)")
    ap.add_argument("--threads", type=cli.threads_or_workers, default=1,
                    help="torch CPU threads, for the steps and the bandwidth measurement, at most the CPU cores "
                         "(default %(default)s)")
    ap.add_argument("--bandwidth-mib", type=cli.positive_int, default=512, metavar="MIB",
                    help="size of the fp32 tensor whose x.sum() measures the read bandwidth, at most the memory of "
                         "the machine (of the GPU with --device cuda) (default %(default)s)")
    ap.add_argument("--json", type=cli.output_file, default=None, metavar="PATH",
                    help="write the numbers and their provenance to PATH (default: none)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        cli.check_outputs({"--json": args.json}, inputs=[args.checkpoint])
        check_bandwidth_mib(args.bandwidth_mib, args.device)
        from nanollm.data.tasks import ALL_TASKS
        from nanollm.io.checkpoint import load_card, load_config, load_tokenizer
        methods = args.methods or [m for m in METHODS if m != "full"]
        for m in methods:
            try:
                method_chain(m)
            except ValueError as e:
                cli.fail(f"--methods: {e}")
        if any(not 0 < r <= 1 for r in args.keep_ratios):
            cli.fail(f"--keep-ratios must lie in (0, 1], got {args.keep_ratios}")
        config, card = load_config(args.checkpoint), load_card(args.checkpoint)
        task = args.task or (card.get("default_suite") or ["niah_single_noise"])[0]
        if task not in ALL_TASKS:
            cli.fail(f"--task: unknown task {task!r}; choose from {ALL_TASKS}")
        if not args.steps < args.length <= config.max_seq_len:
            cli.fail(f"--length must be in ({args.steps}, {config.max_seq_len}] (more than --steps, at most the "
                     f"model's maximum positions), got {args.length}")
        try:
            make_sample(task, load_tokenizer(args.checkpoint), args.length - args.steps, seed=0)
        except ValueError as e:
            cli.fail(f"--length {args.length}: {e}")
        torch.set_num_threads(args.threads)
        model, tok, _ = load(args.checkpoint, device=args.device)
        try:
            make_engine("fast", model)                 # the fast engine's step is what this command times
        except ValueError as e:
            cli.fail(str(e))
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        prov = provenance(argv, prog=ap.prog, threads=args.threads, dtype=dtype, seed=0)
        print(header(prov), flush=True)
        result = run(model, tok, task, methods, args.keep_ratios, args.length, args.steps, args.repeats,
                     args.bandwidth_mib, progress=not args.quiet)
        print(format_result(result))
        if args.json:
            atomic_write_text(args.json, json.dumps({"provenance": prov, **result}, indent=1))
            print(f"written to {args.json}")
        return result


if __name__ == "__main__":
    main()
