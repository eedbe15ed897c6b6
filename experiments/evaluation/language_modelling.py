"""
Language modelling under compression: perplexity and KL(full || method) over a long natural text, as
StreamingLLM (§4.1), H2O (§5) and Scissorhands (§5) judge a cache.

The text is consecutive paragraphs of Python's help topics (nothing is downloaded); every method is scored
on its second half with the budget ``round(keep * length / 2)``. Decode-time methods evict as they step;
prompt compressors compress the first half once and keep every later token. Per row: perplexity, its ratio
to the full cache's, KL and top-1 agreement. ``python -m experiments.evaluation.language_modelling --help``;
the two protocols in full: ``inside.md``, "language_modelling.py".
"""

from __future__ import annotations

import json
import math
import time

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from methods import METHODS, KVReviverPolicy, make_policy
from methods.presets import PRESETS, preset_options
from nanollm import cli, load
from nanollm.cache import KVCache
from nanollm.cli.provenance import header, provenance
from nanollm.data.tasks import docs_paragraphs
from nanollm.io.checkpoint import load_config, load_tokenizer
from nanollm.io.files import atomic_write_text

from . import budget_for
from .compare import check_methods_flag
from .engines import ENGINES, make_engine

DEFAULT_KEEP_RATIOS = [0.1, 0.2, 0.5]
DEFAULT_LENGTH = 512


def text_ids(tok, length: int) -> list[int]:
    """The first ``length`` tokens of the Python help topics' paragraphs, one paragraph per line."""
    ids = tok.encode("\n".join(docs_paragraphs()))
    if len(ids) < length:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than length {length}")
    return ids[:length]


def decodes_as_it_goes(spec: str) -> bool:
    """Whether a method compresses after decode steps (then it is scored evicting as it goes), rather than
    once after the prompt. KVReviver moves a token into its sketch at every step past its budget."""
    policy = make_policy(spec, budget=1)
    return isinstance(policy, KVReviverPolicy) or "decode" in getattr(policy, "compress_on", ())


class Scores:
    """Running sums over the scored positions of one cache, against the full cache's log-probabilities."""

    def __init__(self) -> None:
        self.nll = self.kl = 0.0
        self.agree = self.n = 0

    def add(self, logp: Tensor, full_logp: Tensor, target: int) -> None:      # (V,), (V,) log-probabilities
        self.nll -= logp[target].item()
        self.kl += F.kl_div(logp, full_logp, log_target=True, reduction="sum").item()   # KL(full || method)
        self.agree += int(logp.argmax() == full_logp.argmax())
        self.n += 1


def stream_scored(engine, ids: list[int], caches: list[KVCache], start: int, score_from: int,
                  on_logp, bar) -> None:
    """Step ``ids[start:-1]`` into every cache (the step fed ``ids[p]`` predicts ``ids[p + 1]``); for each
    predicted position from ``score_from`` on, hand each cache's log-probabilities to
    ``on_logp(cache index, predicted position, logp)``."""
    for p in range(start, len(ids) - 1):
        logits, _, _ = engine.step(caches, [ids[p]] * len(caches))             # (n_caches, V)
        if p + 1 >= score_from:
            logp = F.log_softmax(logits.float(), dim=-1)
            for i in range(len(caches)):
                on_logp(i, p + 1, logp[i])
        bar.update(1)


def budgets_and_fill(keep_ratios: list[float], length: int) -> tuple[dict, dict]:
    """Per keep ratio: the budget, ``round(keep * length / 2)`` (at least 1; keep > 1, for tests, gives a budget
    past the prefix), and the tokens of a decode-time run's first pass, ``min(budget, length / 2)``."""
    half = length // 2
    budgets = {k: budget_for(k, half) for k in keep_ratios}
    return budgets, {k: min(budgets[k], half) for k in keep_ratios}


def run(model, tok, methods: list[str], keep_ratios: list[float], length: int = DEFAULT_LENGTH,
        progress: bool = True, options: dict[str, dict] | None = None, engine: str = "fast") -> list[dict]:
    """One record per (method, keep ratio), plus "full": perplexity, KL and top-1 agreement over the
    second half of the text (see the module docstring). A keep ratio above 1 (for tests) gives a budget
    past the prefix; at ``keep * length / 2 >= length`` every method is the full cache. ``options``: method
    -> its options for ``make_policy`` (e.g. ``methods.presets.preset_options``); default none. ``engine``:
    "fast", "batched" or "plain" (``engines.make_engine``)."""
    options = options or {}
    engine = make_engine(engine, model)
    ids = text_ids(tok, length)
    half = length // 2
    prompt_methods = [m for m in methods if m != "full" and not decodes_as_it_goes(m)]
    stream_methods = [m for m in methods if m != "full" and decodes_as_it_goes(m)]
    budgets, fill = budgets_and_fill(keep_ratios, length)
    total = (length - 1 - half) + sum(length - 1 - fill[k] for k in keep_ratios if stream_methods)
    # every scored prediction comes from a decode step: positions half + 1 .. length - 1
    bar = tqdm(total=total, disable=not progress, desc="language modelling", unit="step", dynamic_ncols=True)

    # 1. the full cache and the prompt compressors: the prefix in one pass, then the scored half
    rows = [("full", 1.0, None)] + [(m, k, budgets[k]) for m in prompt_methods for k in keep_ratios]
    policies = [make_policy(m, budget=b, **options.get(m, {})) for m, _, b in rows]
    caches, _ = engine.fill(policies, [ids[:half]])
    full_logp: dict[int, Tensor] = {}                # position -> (V,) the full cache's log-probabilities
    scores = {row: Scores() for row in rows}

    def first_group(i: int, pos: int, logp: Tensor) -> None:
        if i == 0:
            full_logp[pos] = logp.clone()
        scores[rows[i]].add(logp, full_logp[pos], ids[pos])

    stream_scored(engine, ids, caches, half, half + 1, first_group, bar)
    per_token = caches[0].nbytes() / (length - 1)        # the full cache's bytes per token after the last step
    size = lambda c: round((c.nbytes() + c.policy.slot_nbytes()) / per_token)    # noqa: E731  token equivalents
    sizes = {row: size(cache) for row, cache in zip(rows, caches)}

    # 2. the decode-time methods, one group per budget: fill the cache with `budget` tokens, then step
    for k in keep_ratios:
        group = [(m, k, budgets[k]) for m in stream_methods]
        if not group:
            continue
        caches, _ = engine.fill([make_policy(m, budget=b, **options.get(m, {})) for m, _, b in group], [ids[:fill[k]]])
        for row in group:
            scores[row] = Scores()
        stream_scored(engine, ids, caches, fill[k], half + 1,
                lambda i, pos, logp: scores[group[i]].add(logp, full_logp[pos], ids[pos]), bar)
        sizes.update({row: size(cache) for row, cache in zip(group, caches)})
    bar.close()

    full_ppl = math.exp(scores[rows[0]].nll / scores[rows[0]].n)
    records = []
    for (m, k, b), s in scores.items():
        ppl = math.exp(s.nll / s.n)
        records.append({"method": m, "keep_ratio": k, "budget": b, "length": length, "scored_tokens": s.n,
                        "protocol": "full" if m == "full" else "decode" if decodes_as_it_goes(m) else "prompt",
                        "perplexity": ppl, "ppl_ratio": ppl / full_ppl, "kl": s.kl / s.n,
                        "top1_agreement": s.agree / s.n, "cache_at_end": sizes[(m, k, b)]})
    return records


def format_table(records: list[dict]) -> str:
    """Rows method @ keep ratio (the full cache first), grouped by protocol."""
    head = f"{'method':<16}{'protocol':>9}{'keep':>6}{'budget':>7}{'cache at end':>13}{'ppl':>9}" \
           f"{'ppl/full':>9}{'KL':>8}{'top-1 = full':>13}"
    lines = [head, "-" * len(head)]
    order = {"full": 0, "decode": 1, "prompt": 2}

    def num(x: float, decimals: int) -> str:          # a collapsed cache's perplexity can reach 1e8
        return f"{x:.{decimals}f}" if abs(x) < 1e4 else f"{x:.2e}"

    for r in sorted(records, key=lambda r: (order[r["protocol"]], r["method"], r["keep_ratio"])):
        lines.append(f"{r['method']:<16}{r['protocol']:>9}{r['keep_ratio']:>6.2f}"
                     f"{r['budget'] if r['budget'] is not None else '-':>7}{r['cache_at_end']:>13}"
                     f"{num(r['perplexity'], 2):>9}{num(r['ppl_ratio'], 3):>9}{r['kl']:>8.3f}"
                     f"{r['top1_agreement']:>13.3f}")
    return "\n".join(lines)


def plot(records: list[dict], path) -> None:
    """Perplexity relative to the full cache vs keep ratio, one line per method (log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.axhline(1.0, color="black", ls="--", label="full cache")
    for m in sorted({r["method"] for r in records} - {"full"}):
        rs = sorted((r for r in records if r["method"] == m), key=lambda r: r["keep_ratio"])
        style = "-" if rs[0]["protocol"] == "decode" else ":"
        ax.plot([r["keep_ratio"] for r in rs], [r["ppl_ratio"] for r in rs], style, marker="o",
                label=f"{m} ({rs[0]['protocol']})")
    ax.set(yscale="log", xlabel="keep ratio (budget / prefix tokens)", ylabel="perplexity / full cache's",
           title="language modelling on the second half of the text")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    cli.save_figure(fig, path)


def parser() -> cli.ArgumentParser:
    """The command line (also read back by the tests from a results file's recorded command)."""
    ap = cli.ArgumentParser(
        prog="python -m experiments.evaluation.language_modelling",
        description="Perplexity and KL(full || method) of every method over a long natural text (Python's "
                    "help topics), decode-time methods evicting as they go, prompt compressors compressing "
                    "the first half; every method scored on the second half.")
    ap.add_argument("--checkpoint", default="smollm2-135m",
                    help="fetched model's name, bundled checkpoint, nanollm or Hugging Face folder, or GGUF "
                         "file (default %(default)s)")
    ap.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                    help=f"method specs, MODULE:CLASS for a policy class of your own (default: every registered "
                         f"name: {', '.join(METHODS)})")
    ap.add_argument("--keep-ratios", nargs="+", type=float, default=DEFAULT_KEEP_RATIOS, metavar="R",
                    help="budgets as fractions of the prefix (the text's first half), each in (0, 1] "
                         f"(default {' '.join(map(str, DEFAULT_KEEP_RATIOS))})")
    ap.add_argument("--length", type=int, default=None,
                    help=f"tokens of text (default {DEFAULT_LENGTH}, or the model's maximum positions if smaller)")
    ap.add_argument("--threads", type=cli.threads_or_workers, default=1,
                    help="torch CPU threads (default %(default)s; the numbers do not depend on it)")
    ap.add_argument("--engine", choices=sorted(ENGINES), default="fast",
                    help="fast: one prompt pass for all the caches and their decode steps side by side; batched: "
                         "the same with the caches' attention batched too (for a GPU); one-group: batched, every "
                         "cache in one group (an experiment for a GPU); plain: nanollm's own "
                         "prefill and forward, one cache at a time, slower; the numbers agree to float rounding "
                         "(default %(default)s)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="ours",
                    help="the methods' options: ours (the papers' settings) or kvpress (kvpress 0.5.5's defaults "
                         "for the methods it has, methods/presets.py) (default %(default)s)")
    ap.add_argument("--json", type=cli.output_file, default=None, metavar="PATH",
                    help="write the records, with the run's provenance, as JSON to PATH (default: none)")
    ap.add_argument("--plot", type=cli.figure_file, default=None, metavar="PATH",
                    help=f"write a perplexity-vs-keep-ratio figure to PATH, a {cli.FIGURE_HELP} file (default: none)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)

    with cli.errors(args.debug):
        methods = args.methods or list(METHODS)
        check_methods_flag(methods)
        if any(not 0 < r <= 1 for r in args.keep_ratios):
            cli.fail(f"--keep-ratios must lie in (0, 1], got {args.keep_ratios}")
        cli.check_outputs({"--json": args.json, "--plot": args.plot}, inputs=[args.checkpoint])
        config = load_config(args.checkpoint)
        length = args.length if args.length is not None else min(DEFAULT_LENGTH, config.max_seq_len)
        if not 4 <= length <= config.max_seq_len:
            cli.fail(f"--length must be in [4, {config.max_seq_len}] (the model's maximum positions), got {length}")
        tok = load_tokenizer(args.checkpoint)
        if tok is None:
            cli.fail(f"--checkpoint {args.checkpoint} has no supported tokenizer, which the text needs")
        try:
            text_ids(tok, length)
        except ValueError as e:
            cli.fail(f"--length {length}: {e}")
        torch.set_num_threads(args.threads)
        model, tok, _ = load(args.checkpoint)
        try:
            make_engine(args.engine, model)
        except ValueError as e:
            cli.fail(str(e))
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        prov = provenance(argv, prog=ap.prog, threads=args.threads, dtype=dtype, seed=None)
        options = {m: preset_options(m, args.preset) for m in methods if m != "full"}
        print(header(prov) + f"\n# methods' options: {args.preset}", flush=True)
        t0 = time.time()
        records = run(model, tok, ["full"] + [m for m in methods if m != "full"], args.keep_ratios, length,
                      progress=not args.quiet, options=options, engine=args.engine)
        print(format_table(records))
        print(f"\n{length} tokens of Python's help topics; scored: the last {records[0]['scored_tokens']} "
              f"predictions; budget = keep x {length // 2} (the prefix). {time.time() - t0:.0f} s. ppl = "
              "perplexity; KL = mean next-token KL(full || method); top-1 = full: the share of positions where "
              "the method's most likely token is the full cache's.")
        if args.json:
            atomic_write_text(args.json, json.dumps({"provenance": prov, "preset": args.preset, "records": records},
                                                    indent=1))
            print(f"records written to {args.json}")
        if args.plot:
            plot(records, args.plot)
            print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
