"""
The "measure and explain" part of an assignment: run your code on the bundled model, one figure, then a
paragraph in ``writeup.md`` that holds the figure against the paper's claim (the sheet's last written
question says which claim, and its rubric).

    python -m course.measure chunkkv              # writes course/chunkkv/measure/: figure.png, table.txt, record.json
    python -m course.measure chunkkv --quick              # a few samples: seconds, to see that it runs
    python -m course.measure chunkkv --checkpoint smollm2-135m    # the real model once fetched: minutes

It runs the code of the copy you run it in (your library files), and stops with one line naming the task
if a stub is still there. ``cache`` and ``tensor_attention`` measure bytes and time per decode step, the
methods' assignments their method against the paper's baselines at a few keep ratios, ``kernels`` its split
kernel's error and time; what each draws: course/README.md, section "The course's files". ``table.txt``
holds the numbers the figure draws, ``record.json`` all of them with how they were made.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .assignments import ASSIGNMENTS, command_line, get, parser


@dataclass(frozen=True)
class Comparison:
    """A ``experiments.compare`` run: the methods side by side at ``ratios`` on ``tasks`` in ``modes``; the
    figure draws ``metric`` (a record field) against the keep ratio, one panel a mode."""
    methods: tuple[str, ...]
    ratios: tuple[float, ...]
    tasks: tuple[str, ...]
    modes: tuple[str, ...]
    samples: int
    metric: str = "accuracy"
    quick_samples: int = 2
    real_tasks: tuple[str, ...] = ("passkey", "niah_single_docs")     # for a real model (--checkpoint)


SPLITS = (1, 4, 16)     # ranges the kernels measurement cuts the cache into
REAL_LENGTH = 512       # a real model's prompts (its card's default, 2048, takes minutes a sample on a laptop)
BOTH = ("question_in_prompt", "question_after_context")
NIAH = ("niah_multikey", "niah_multivalue")
COMPARISONS = {
    "baselines": Comparison(("streaming_llm", "h2o", "snapkv", "adakv"), (0.1, 0.25, 0.5), NIAH, BOTH, 10),
    "scissorhands": Comparison(("scissorhands", "h2o", "streaming_llm"), (0.2, 0.5), NIAH, BOTH[:1], 15),
    "critical_kv": Comparison(("snapkv", "critical_kv"), (0.1, 0.25), NIAH, BOTH[:1], 15, metric="perturbation"),
    "chunkkv": Comparison(("snapkv", "chunkkv"), (0.1, 0.25, 0.5), NIAH, BOTH, 10),
    "kvreviver": Comparison(("kvreviver", "h2o", "streaming_llm"), (0.1, 0.25, 0.5), NIAH, BOTH[1:], 10),
}
LABEL = {"accuracy": "accuracy (95% Wilson interval)", "perturbation": "relative error of the final hidden state",
         "kl": "KL(full || method) over the answer"}


def run_module(argv: list[str], out: Path) -> None:
    """``python -m argv...`` in this copy, its output shown and kept in ``out/table.txt``; a failure stops
    here, with its last line (a stub names its task there)."""
    with (out / "table.txt").open("w") as table:
        proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        last = ""
        for line in proc.stdout:
            print(line, end="", flush=True)
            table.write(line)
            last = line.strip() or last
        if proc.wait():                             # its last line names a stub's task (NotImplementedError)
            raise SystemExit(f"error: the measurement stopped (python -m {argv[0]} exited {proc.returncode}): "
                             f"{last.removeprefix('error: ')}")


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson interval of a proportion (successes may be fractional: a partial score)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))


def comparison_figure(record: dict, metric: str, path: Path, title: str) -> None:
    """``metric`` against the keep ratio, a line a method, a panel a mode, averaged over the tasks; the full
    cache as a dashed line."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = record["records"]
    modes = sorted({r["mode"] for r in rows}, key=BOTH.index)
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6), squeeze=False, sharey=True)
    for ax, mode in zip(axes[0], modes):
        here = [r for r in rows if r["mode"] == mode]
        shown = [m for m in dict.fromkeys(r["method"] for r in here) if m != "full"]
        for method in dict.fromkeys(r["method"] for r in here):
            mine = [r for r in here if r["method"] == method]
            points = {}
            for r in mine:
                points.setdefault(r["keep_ratio"], []).append(r)
            ratios = sorted(points)
            if metric == "accuracy":
                values = [sum(a for r in points[k] for a in r["accuracies"]) for k in ratios]
                counts = [sum(len(r["accuracies"]) for r in points[k]) for k in ratios]
                ys = [v / n for v, n in zip(values, counts)]
                low, high = zip(*(wilson(v, n) for v, n in zip(values, counts)))
                errors = [[y - lo for y, lo in zip(ys, low)], [hi - y for y, hi in zip(ys, high)]]
            else:
                ys = [sum(r[metric] for r in points[k]) / len(points[k]) for k in ratios]
                errors = None
            if method == "full":
                ax.axhline(ys[0], color="black", ls="--", lw=1, label="full cache")
                continue
            nudge = 1.04 ** (shown.index(method) - (len(shown) - 1) / 2)     # side by side, not on top
            ax.errorbar([k * nudge for k in ratios], ys, yerr=errors, marker="o", capsize=3, label=method)
        ax.set_xscale("log")
        ratios = sorted({r["keep_ratio"] for r in here if r["method"] != "full"})
        ax.set_xticks(ratios, [f"{k:.2g}" for k in ratios])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("keep ratio (budget / prompt length)")
        ax.set_title(mode.replace("_", " "))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(LABEL.get(metric, metric))
    axes[0][-1].legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def measure_comparison(name: str, out: Path, quick: bool, checkpoint: str | None, samples: int | None,
                       seed: int) -> None:
    c = COMPARISONS[name]
    tasks = c.real_tasks if checkpoint else c.tasks
    samples = samples or (c.quick_samples if quick else c.samples)
    argv = ["experiments.compare", "--engine", "plain", "--quiet", "--methods", "full", *c.methods,
            "--keep-ratios", *map(str, c.ratios), "--tasks", *tasks, "--modes", *c.modes,
            "--samples", str(samples), "--seed", str(seed), "--json", str(out / "record.json")]
    real = ["--checkpoint", checkpoint, "--length", str(REAL_LENGTH)] if checkpoint else []
    run_module(argv + real, out)
    record = json.loads((out / "record.json").read_text())
    comparison_figure(record, c.metric, out / "figure.png",
                      f"{name}: {', '.join(tasks)}, {samples} samples per task and mode from seed {seed}, "
                      f"{checkpoint or 'the bundled model'}")


def measure_cache(out: Path, quick: bool) -> None:
    contexts = [128, 512, 1024] if quick else [128, 256, 512, 1024, 2048, 4096]
    run_module(["experiments.bench", "--contexts", *map(str, contexts), "--max-seq-len", str(max(contexts) + 64),
                "--repeats", "3" if quick else "7", "--json", str(out / "record.json")], out)
    record = json.loads((out / "record.json").read_text())
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = record["rows"]
    x = [r["context"] for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax.plot(x, [r["cached_ms"] for r in rows], "o-", label="with your cache (decode_step)")
    ax.plot(x, [r["recompute_ms"] for r in rows], "s-", label="recomputing the prefix")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens already cached)")
    ax.set_ylabel("ms per decode step (median)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    bx.plot(x, [r["kv_bytes"] / 2**10 for r in rows], "o-", label="measured (your storage)")
    bx.plot(x, [r["kv_bytes_formula"] / 2**10 for r in rows], "k--", label="2 n_layer n_kv_head head_dim bytes T")
    bx.set_xlabel("context (tokens)")
    bx.set_ylabel("KV cache, KiB")
    bx.legend(fontsize=8)
    bx.grid(alpha=0.3)
    fig.suptitle(f"cache: preset {record['preset']}, {record['threads']} thread, fp32", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "figure.png", dpi=120)
    plt.close(fig)


def measure_tensor(out: Path, quick: bool) -> None:
    lengths = [32, 64, 128] if quick else [32, 64, 128, 256, 512]
    run_module(["experiments.tensor_attention_bench", "--lengths", *map(str, lengths), "--json",
                str(out / "record.json"), "--plot", str(out / "figure.png")], out)


def attention_fp64(q, k, v):
    """One decode step's softmax attention in float64, written out: q (B, H, d), k and v (B, H_kv, n, d)."""
    b, h, d = q.shape
    qg = q.double().view(b, k.shape[1], h // k.shape[1], d)                 # (B, H_kv, G, d): a KV head's queries
    p = ((qg @ k.double().transpose(-1, -2)) * d ** -0.5).softmax(-1)      # (B, H_kv, G, n)
    return (p @ v.double()).view(b, h, d)


def measure_kernels(out: Path, quick: bool) -> None:
    """Error of the split kernel (your online softmax and merge) against fp64, as the ranges multiply; and
    the PyTorch decode attention's time against the bytes it reads (the roofline's question, on this CPU)."""
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")      # before Triton is imported: its CPU interpreter

    import kernels
    import kernels.decode_attention as da
    if not kernels.HAS_TRITON:
        raise SystemExit("error: Triton is not installed here (it installs on Linux only): STUDENT.md says how to "
                         "work in a Linux container")
    torch.manual_seed(0)
    lines, record = [], {"errors": [], "times": []}
    groups, d = 4, 64
    lengths = [256, 1024] if quick else [256, 1024, 4096]
    lines.append("split kernel (your online softmax and merge) vs softmax attention in float64; fp32 cache, blocks "
                 "of 16 tokens; error = max |kernel - fp64| / max |fp64| (relative to the output's size); the "
                 "last column: PyTorch's fp32 attention against the same fp64 one")
    lines.append(f"{'tokens':>7} {'ranges':>7} {'error':>10} {'fp32 PyTorch':>13}")
    for n in lengths:
        q = torch.randn(1, 2 * groups, d)
        k, v = torch.randn(1, 2, n, d) * 2, torch.randn(1, 2, n, d)
        exact = attention_fp64(q, k, v)
        size = exact.abs().max().item()
        plain = (da.reference_decode_attention(q, k, v).double() - exact).abs().max().item() / size
        for splits in [s for s in SPLITS if s <= n // 16]:
            _, _, ranges = da.split_plan(q, k, n, block_n=16, splits=splits)
            try:
                got = da.decode_attention_triton(q, k, v, block_n=16, splits=splits)
            except NotImplementedError as e:
                raise SystemExit(f"error: the measurement needs your code: {e}") from None
            err = (got.double() - exact).abs().max().item() / size
            record["errors"].append({"tokens": n, "ranges": ranges, "relative_error": err, "fp32_pytorch": plain})
            lines.append(f"{n:>7} {ranges:>7} {err:>10.2e} {plain:>13.2e}")
    lines.append("")
    lines.append("decode attention in PyTorch (reference_decode_attention), 1 sequence, 32 query heads / 8 KV heads "
                 "x 128 dims, fp32, 1 thread; GB/s = bytes of K and V read / time")
    lines.append(f"{'tokens':>7} {'MiB read':>9} {'ms':>9} {'GB/s':>7}")
    torch.set_num_threads(1)
    for n in ([4096, 16384, 65536] if quick else [4096, 16384, 65536, 262144]):
        q, k, v = torch.randn(1, 32, 128), torch.randn(1, 8, n, 128), torch.randn(1, 8, n, 128)
        read = 2 * k.numel() * 4
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            da.reference_decode_attention(q, k, v)
            times.append(time.perf_counter() - t0)
        ms = sorted(times)[2] * 1e3
        record["times"].append({"tokens": n, "bytes": read, "ms": ms})
        lines.append(f"{n:>7} {read / 2**20:>9.1f} {ms:>9.2f} {read / ms / 1e6:>7.2f}")
    big = torch.randn(64 * 2**20)                       # 256 MiB: reading it once, what this CPU's memory allows
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - t0)
    read_ms = sorted(times)[2] * 1e3
    record["read"] = {"bytes": big.numel() * 4, "ms": read_ms}
    lines.append(f"reading {big.numel() * 4 / 2**20:.0f} MiB once (a sum), 1 thread: {read_ms:.2f} ms, "
                 f"{big.numel() * 4 / read_ms / 1e6:.2f} GB/s (median of 5): the speed a step that only read would "
                 "reach")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    (out / "table.txt").write_text(text)
    (out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    for splits in SPLITS:
        rows = [r for r in record["errors"] if r["ranges"] == splits]
        ax.plot([r["tokens"] for r in rows], [r["relative_error"] for r in rows], "o-", label=f"{splits} range(s)")
    rows = [r for r in record["errors"] if r["ranges"] == 1]
    ax.plot([r["tokens"] for r in rows], [r["fp32_pytorch"] for r in rows], "k--", label="fp32 PyTorch softmax")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(sorted({r["tokens"] for r in record["errors"]}))
    ax.set_xlabel("tokens in the cache (blocks of 16)")
    ax.set_ylabel("max |error| / max |output|")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    rows = record["times"]
    bx.plot([r["bytes"] / 2**20 for r in rows], [r["ms"] for r in rows], "o-", label="attention (PyTorch)")
    speed = record["read"]["bytes"] / record["read"]["ms"]           # bytes per ms
    bx.plot([r["bytes"] / 2**20 for r in rows], [r["bytes"] / speed for r in rows], "k--",
            label=f"reading the same bytes at {speed / 1e6:.0f} GB/s")
    bx.legend(fontsize=8)
    bx.set_xscale("log")
    bx.set_yscale("log")
    for axis in (bx.xaxis, bx.yaxis):
        axis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    bx.set_xticks([r["bytes"] / 2**20 for r in rows])
    bx.set_xlabel("MiB of K and V read")
    bx.set_ylabel("ms (median of 5)")
    bx.set_title("a decode step's attention, 1 thread", fontsize=9)
    ax.set_title("your split kernel's error", fontsize=9)
    bx.grid(alpha=0.3)
    fig.suptitle("kernels: the split kernel in Triton's interpreter; attention's time on this CPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "figure.png", dpi=120)
    plt.close(fig)


def measure(name: str, out: Path, quick: bool = False, checkpoint: str | None = None, samples: int | None = None,
            seed: int = 0) -> None:
    """Run assignment ``name``'s measurement into the folder ``out`` (made here)."""
    out.mkdir(parents=True)
    if name in COMPARISONS:
        measure_comparison(name, out, quick, checkpoint, samples, seed)
    elif name == "cache":
        measure_cache(out, quick)
    elif name == "tensor_attention":
        measure_tensor(out, quick)
    else:
        measure_kernels(out, quick)


@command_line
def main(argv: list[str] | None = None) -> None:
    p = parser("python -m course.measure", __doc__)
    p.add_argument("assignment", help="which assignment: " + ", ".join(ASSIGNMENTS))
    p.add_argument("--out", type=Path, default=None,
                   help="a new folder for figure.png, table.txt and record.json (default: course/ASSIGNMENT/measure, "
                        "beside writeup.md, which shows its figure)")
    p.add_argument("--quick", action="store_true", help="a few samples and lengths: seconds, to see that it runs")
    p.add_argument("--checkpoint", default=None,
                   help="for the methods' assignments: a real model instead of the bundled one, e.g. smollm2-135m "
                        f"once fetched; its tasks are passkey and niah_single_docs, {REAL_LENGTH}-token prompts")
    p.add_argument("--samples", type=int, default=None,
                   help="for the methods' assignments: samples per task and mode (default: the assignment's, "
                        "e.g. 10; 2 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="for the methods' assignments: the first sample's seed "
                   "(default 0): another seed draws other samples, to see how much a number moves")
    args = p.parse_args(argv)
    assignment = get(args.assignment)
    for flag, given in [("--checkpoint", args.checkpoint), ("--samples", args.samples),
                        ("--seed", args.seed != 0)]:
        if given and assignment.name not in COMPARISONS:
            raise SystemExit(f"error: {flag} is for {', '.join(COMPARISONS)}; {assignment.name!r} measures "
                             "without samples of a model")
    if args.samples is not None and not 1 <= args.samples <= 1000:
        raise SystemExit(f"error: --samples must be 1 to 1000, got {args.samples}")
    if not 0 <= args.seed < 2**31:
        raise SystemExit(f"error: --seed must be 0 to 2**31 - 1, got {args.seed}")
    out = args.out or Path("course") / assignment.name / "measure"
    if out.exists():
        raise SystemExit(f"error: {out} exists; remove it or name a new --out folder (nothing is overwritten)")
    started = time.perf_counter()
    measure(assignment.name, out, args.quick, args.checkpoint, args.samples, args.seed)
    print(f"wrote {out / 'figure.png'}, {out / 'table.txt'} and {out / 'record.json'} in "
          f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
