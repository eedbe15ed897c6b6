"""
Does a key's norm say how much attention it will get? KnormPress's premise, measured.

Devoto et al. ("A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024, arXiv
2406.11430) observe that a key of small L2 norm usually draws a high attention score during decoding, and
keep the smallest-norm keys without reading a query (kvpress's KnormPress; ours is the test-only scorer
``tests/methods/knorm.py``). Whether that holds is a property of a trained model, which this measures.

Per sample, layer and KV head, at the prompt's last query (the one that predicts the first answer token),
the share of its attention (mean over the query heads that read the KV head) that ``budget`` keys receive,
for five choices of them: the smallest norms (what KnormPress keeps), the smallest among every key but the
first (the premise without the attention sink), the largest, ``budget`` at random (``budget / T`` in
expectation) and the ones it attends most (the most any ``budget`` keys hold). Also the first key's share
alone and the rank correlation of the key norm with that attention (negative where small norms draw
attention):

    python -m experiments.analysis.key_norm --checkpoint smollm2-135m --out results/key_norm_smollm2.txt

How to read the tables: experiments/README.md, section "analysis/key_norm.py: does a small key norm draw
attention?".
"""

from __future__ import annotations

import json
import time

import torch
from torch import Tensor
from tqdm import tqdm

from nanollm import cli, generate, load
from nanollm.cli.provenance import header, provenance
from nanollm.data.tasks import ALL_TASKS, make_sample
from nanollm.io.checkpoint import load_config, load_tokenizer
from nanollm.io.files import atomic_write_text
from nanollm.policy import CachePolicy, Needs, StepContext

CHOICES = ("smallest norm", "smallest but 1st", "largest norm", "random", "most attended")
COLUMNS = (*CHOICES, "first key", "rank correlation")


class LastQuery(CachePolicy):
    """Keeps everything, and records per layer the prompt's keys' norms (H_kv, T) and its last query's
    attention (H, T) (batch 1)."""

    def __init__(self) -> None:
        self.norms: dict[int, Tensor] = {}
        self.probs: dict[int, Tensor] = {}

    def needs(self, phase: str) -> Needs:
        return Needs(rows=1) if phase == "prefill" else Needs()

    def on_prefill(self, ctx: StepContext) -> None:
        self.norms[ctx.layer] = ctx.kv.k[0].float().norm(dim=-1)      # (H_kv, T)
        self.probs[ctx.layer] = ctx.probs[0, :, -1].float()           # (H, T)


def rank_correlation(a: Tensor, b: Tensor) -> Tensor:
    """Spearman's rank correlation of each row of a and b (..., T) -> (...); ties take arbitrary ranks."""
    ra, rb = (x.argsort(-1).argsort(-1).float() for x in (a, b))
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1))


def kept_shares(norms: Tensor, probs: Tensor, budget: int) -> dict[str, Tensor]:
    """The share of one query's attention that ``budget`` keys per KV head receive, per choice of keys.

    norms (H_kv, T): the keys' L2 norms; probs (H, T): the query heads' attention, query head h reading KV
    head h // (H / H_kv); 1 <= budget < T. Returns {column: (H_kv,)} for COLUMNS: the CHOICES (the smallest
    norms, the smallest among every key but the first, the largest, random, the most attended), the share of
    the first key alone (an attention sink, which a small norm may be all there is to), and the rank
    correlation of the norms with the attention."""
    H_kv, T = norms.shape
    share = probs.view(H_kv, -1, T).mean(1)                           # (H_kv, T): the KV head's query heads
    chosen = {"smallest norm": norms.topk(budget, largest=False).indices,
              "smallest but 1st": 1 + norms[:, 1:].topk(budget, largest=False).indices,
              "largest norm": norms.topk(budget).indices,
              "most attended": share.topk(budget).indices}
    out = {name: share.gather(-1, idx).sum(-1) for name, idx in chosen.items()}
    out["random"] = share.sum(-1) * budget / T                        # the expectation over random choices
    out["first key"] = share[:, 0]                                    # the sink of StreamingLLM, alone
    out["rank correlation"] = rank_correlation(norms, share)
    return {name: out[name] for name in COLUMNS}


def measure(model, tok, task: str, length: int, keep: float, samples: int, bar=None) -> list[dict]:
    """One record per sample and layer: the means over KV heads of ``kept_shares``, with ``keep`` of the
    prompt's T keys chosen (rounded, at least one, at most T - 1). ``bar``: a progress bar, one step a prompt."""
    records = []
    for seed in range(samples):
        sample = make_sample(task, tok, length=length, seed=seed)
        ids = torch.tensor([sample.prompt_ids])                          # (1, T)
        budget = min(ids.shape[1] - 1, max(1, round(keep * ids.shape[1])))
        rec = LastQuery()
        generate(model, ids, max_new_tokens=1, policy=rec)
        for layer in sorted(rec.norms):
            shares = kept_shares(rec.norms[layer], rec.probs[layer], budget)
            records.append({"task": task, "seed": seed, "layer": layer, "length": ids.shape[1], "budget": budget,
                            **{name: float(v.mean()) for name, v in shares.items()}})
        if bar is not None:
            bar.update(1)
    return records


def format_table(records: list[dict], title: str) -> str:
    """Per layer and over all layers: each column's mean over the records (samples, and KV heads before)."""
    layers = sorted({r["layer"] for r in records})
    lines = [title, f"{'layer':>7}  " + "  ".join(f"{n:>16}" for n in COLUMNS)]

    def row(label, rows):
        return f"{label:>7}  " + "  ".join(f"{sum(r[n] for r in rows) / len(rows):16.3f}" for n in COLUMNS)
    lines += [row(layer, [r for r in records if r["layer"] == layer]) for layer in layers]
    lines.append(row("all", records))
    return "\n".join(lines)


def parser() -> cli.ArgumentParser:
    """The command line (also read back by the tests from the results file's recorded command)."""
    ap = cli.ArgumentParser(
        prog="python -m experiments.analysis.key_norm",
        description="KnormPress's premise, measured: the share of the prompt's last query's attention that the "
                    "smallest-norm keys receive, against the largest-norm, random and most-attended keys, per "
                    "layer.")
    ap.add_argument("--checkpoint", default="retrieval-llama",
                    help="bundled checkpoint, fetched model's name (smollm2-135m), nanollm or Hugging Face folder, "
                         "or GGUF file (default %(default)s)")
    ap.add_argument("--tasks", nargs="+", default=["niah_single_noise"], choices=ALL_TASKS, metavar="TASK",
                    help=f"tasks whose prompts are measured, one table each (default niah_single_noise): "
                         f"{', '.join(ALL_TASKS)}")
    ap.add_argument("--length", type=cli.positive_int, default=512,
                    help="prompt tokens (default %(default)s)")
    ap.add_argument("--keep", type=cli.positive_float, default=0.25,
                    help="keys chosen, as a fraction of the prompt, in (0, 1) (default %(default)s)")
    ap.add_argument("--samples", type=cli.positive_int, default=10, help="prompts per task (default %(default)s)")
    ap.add_argument("--threads", type=cli.threads_or_workers, default=1,
                    help="torch CPU threads, at most the CPU cores (default %(default)s)")
    ap.add_argument("--out", type=cli.output_file, default=None, metavar="PATH",
                    help="write the text report (provenance header, tables) to PATH (default: print only)")
    ap.add_argument("--json", type=cli.output_file, default=None, metavar="PATH",
                    help='write {"provenance": ..., "records": [...]} to PATH (default: none)')
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)

    with cli.errors(args.debug):
        if not 0 < args.keep < 1:
            cli.fail(f"--keep must lie in (0, 1), got {args.keep}")
        cli.check_outputs({"--out": args.out, "--json": args.json}, inputs=[args.checkpoint])
        config = load_config(args.checkpoint)
        if not 2 <= args.length <= config.max_seq_len:
            cli.fail(f"--length must be in [2, {config.max_seq_len}] (the model's maximum positions), got "
                     f"{args.length}")
        tok = load_tokenizer(args.checkpoint)
        if tok is None:
            cli.fail(f"--checkpoint {args.checkpoint} has no supported tokenizer, which the prompts need")
        for task in args.tasks:                  # a length the task cannot fill fails here, before any work
            try:
                make_sample(task, tok, length=args.length, seed=0)
            except ValueError as e:
                cli.fail(f"--length {args.length}, task {task}: {e}")
        torch.set_num_threads(args.threads)
        model, tok, _ = load(args.checkpoint)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        prov = provenance(argv, prog=ap.prog, threads=args.threads, dtype=dtype, seed=0)
        t0 = time.time()
        bar = tqdm(total=len(args.tasks) * args.samples, disable=args.quiet, desc="key norm", unit="prompt",
                   dynamic_ncols=True)
        records, parts = [], []
        for task in args.tasks:
            rows = measure(model, tok, task, args.length, args.keep, args.samples, bar)
            records += rows
            lengths = sorted({r["length"] for r in rows})
            tokens = f"{lengths[0]}" if len(lengths) == 1 else f"{lengths[0]}-{lengths[-1]}"
            parts.append(format_table(rows, f"{args.checkpoint}, {task}, {args.samples} prompts of {tokens} tokens: "
                                            f"the share of the last query's attention that {args.keep:g} of the "
                                            "keys, chosen five ways, receive; the first key's share; the rank "
                                            "correlation of norm and attention (means over samples and KV heads)"))
        bar.close()
        text = header(prov) + "\n\n" + "\n\n".join(parts) + f"\n\n{time.time() - t0:.0f} s.\n"
        print(text)
        if args.out:
            atomic_write_text(args.out, text)
            print(f"report written to {args.out}")
        if args.json:
            atomic_write_text(args.json, json.dumps({"provenance": prov, "records": records}, indent=1))
            print(f"records written to {args.json}")


if __name__ == "__main__":
    main()
