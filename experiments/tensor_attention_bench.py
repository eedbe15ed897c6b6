"""
Tensor attention's cache trade-off, measured: stored bytes and time per decode step vs sequence length.

    python -m experiments.tensor_attention_bench                       # lengths 32..1024, a table with fitted slopes
    python -m experiments.tensor_attention_bench --plot tensor.png --json tensor.json

For each length i, one layer's caches (4 heads of 16 dims, the bundled Match3 model's shape) are filled
with i random tokens, then a few decode steps run on each path (append the new token's rows, attend with
its query): "four-naive" (Kronecker products rebuilt every step, as Chen et al. Theorem 4.3 charges the
four-matrix cache), "four" (factored, no n^2 d intermediate) and "two" (pair rows stored). The step time is
the median over the steps; the slope of log(time) against log(length) is fitted over the longer half of
the lengths, where the arithmetic, not the per-call overhead, dominates. Expected: bytes slope 1 (four) vs
2 (two); time slope about 2 for every path, at different constants. Theorem 4.3's claim is an additive
gap, so the slope of (time of a four-matrix path - time of the two-matrix path) is fitted too. Bytes are
the numbers stored (K, V rows and factors), not positions or the buffers' spare room.
"""

from __future__ import annotations

import json
import math
import statistics

import torch

from experiments.bench import fit_line
from methods.tensor_attention import LAYOUTS
from nanollm import cli
from nanollm.cli.provenance import provenance
from nanollm.cli.timing import elapsed_s, quartiles
from nanollm.io import files

H, D = 4, 16                      # heads and head dimension of the bundled Match3 tensor model


def step_times(layout: str, length: int, steps: int = 7, seed: int = 0) -> tuple[float, int, tuple[float, float]]:
    """Median seconds of one decode step (append + attend) at ``length`` tokens, the bytes stored, and the
    quartiles of the steps' seconds (the spread)."""
    g = torch.Generator().manual_seed(seed)
    rows = lambda n: [torch.randn(1, H, n, D, generator=g) for _ in range(4)]     # noqa: E731
    store = LAYOUTS[layout]()
    store.append(*rows(length - steps), torch.arange(length - steps))
    times = []
    for t in range(length - steps, length):
        new = rows(1)
        q = torch.randn(1, H, 1, D, generator=g)
        times.append(elapsed_s(lambda: (store.append(*new, torch.tensor([t])), store.attend(q, torch.tensor([t]))))[0])
    return statistics.median(times), store.nbytes(), quartiles(times)


def slope(lengths: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(length)."""
    return fit_line([math.log(v) for v in lengths], [math.log(v) for v in values])[1]


def measure(lengths: list[int], steps: int = 7) -> dict:
    """{"lengths", layout -> {"ms": [...], "iqr_ms": [(q1, q3), ...], "bytes": [...], "time_slope",
    "bytes_slope"}, "fit_from"}."""
    out = {"lengths": lengths, "heads": H, "head_dim": D, "steps": steps,
           "threads": torch.get_num_threads()}
    fit = lengths[len(lengths) // 2:] if len(lengths) >= 4 else lengths
    out["fit_from"] = fit[0]
    k = len(lengths) - len(fit)                    # the fit starts at lengths[k]
    for layout in ("four-naive", "four", "two"):
        ms, nbytes, iqr = [], [], []
        for n in lengths:
            sec, b, (q1, q3) = step_times(layout, n, steps)
            ms.append(sec * 1e3)
            nbytes.append(b)
            iqr.append((q1 * 1e3, q3 * 1e3))
        out[layout] = {"ms": ms, "iqr_ms": iqr, "bytes": nbytes, "time_slope": slope(fit, ms[k:]),
                       "bytes_slope": slope(lengths, nbytes)}
    # Theorem 4.3 is about an additive gap: "faster by Omega(n^2 d)". Slope of (path - two) where positive.
    for layout in ("four-naive", "four"):
        out[layout]["gap_ms"] = [a - b for a, b in zip(out[layout]["ms"], out["two"]["ms"])]
        gap = out[layout]["gap_ms"][k:]
        out[layout]["gap_slope"] = slope(fit, gap) if min(gap) > 0 else None
    return out


def table(r: dict) -> str:
    threads = f"{r['threads']} thread" + ("s" if r["threads"] > 1 else "")
    lines = [f"one layer, {r['heads']} heads x {r['head_dim']} dims, fp32, {threads}; "
             f"median of {r['steps']} decode steps (append + attend)",
             f"{'length':>7} | {'four-naive ms':>13} {'four ms':>9} {'two ms':>9} | {'four KiB':>9} {'two KiB':>10}"
             f" | naive/two  four/two"]
    for i, n in enumerate(r["lengths"]):
        a, b, c = (r[k]["ms"][i] for k in ("four-naive", "four", "two"))
        lines.append(f"{n:>7} | {a:>13.3f} {b:>9.3f} {c:>9.3f} | {r['four']['bytes'][i] / 1024:>9.0f} "
                     f"{r['two']['bytes'][i] / 1024:>10.0f} | {a / c:>9.1f} {b / c:>8.2f}")
    lines.append(f"slopes (time fitted from length {r['fit_from']}): " + ", ".join(
        f"{k} time {r[k]['time_slope']:.2f} bytes {r[k]['bytes_slope']:.2f}" for k in ("four-naive", "four", "two")))
    gaps = [f"{k} - two: " + ("not positive at every length" if r[k]["gap_slope"] is None else
                              f"slope {r[k]['gap_slope']:.2f}") for k in ("four-naive", "four")]
    lines.append("additive gap (Theorem 4.3 claims Omega(n^2 d)): " + "; ".join(gaps))
    return "\n".join(lines)


def decades(r: dict) -> tuple[float, float]:
    """Limits of a log axis for every time ``measure`` drew (medians and quartiles of every path): whole
    decades around them, at least one, so the axis has a labelled tick at each end however fast the machine."""
    drawn = [t for k in ("four-naive", "four", "two") for t in r[k]["ms"] + [q for iqr in r[k]["iqr_ms"] for q in iqr]]
    low = math.floor(math.log10(min(drawn)))
    return 10.0**low, 10.0**max(low + 1, math.ceil(math.log10(max(drawn))))


def plot(r: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    n = r["lengths"]
    for k, style in (("four", "o-"), ("two", "s-")):
        ax1.loglog(n, [b / 2**20 for b in r[k]["bytes"]], style,
                   label=f"{k}-matrix cache (slope {r[k]['bytes_slope']:.2f})")
    ax1.set(xlabel="tokens i", ylabel="stored MiB (one layer)", title="memory: 4 i d  vs  2 i^2 d + 4 i d")
    for k, style in (("four-naive", "^-"), ("four", "o-"), ("two", "s-")):
        ax2.loglog(n, r[k]["ms"], style, label=f"{k} (slope {r[k]['time_slope']:.2f})")
    ax2.set(xlabel="tokens i", ylabel="ms per decode step", title="time per step: all ~ i^2 d")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    cli.save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(prog="python -m experiments.tensor_attention_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=cli.positive_int, nargs="+", default=[32, 64, 128, 256, 512, 1024],
                   help="sequence lengths to measure (default 32 64 128 256 512 1024; the two-matrix cache "
                        "stores 2 i^2 x 64 floats: 512 MiB at 1024, and its buffers and the naive path's "
                        "temporaries take the peak to about 1.5 GiB)")
    p.add_argument("--steps", type=cli.positive_int, default=7, help="decode steps per length (median; default 7)")
    p.add_argument("--threads", type=cli.threads_or_workers, default=1,
                   help="torch threads (default 1: small tensors, least noise; the notebook uses 1 too)")
    p.add_argument("--json", type=cli.output_file, default=None, help="also write the numbers to this file")
    p.add_argument("--plot", type=cli.figure_file, default=None, help="also draw the two log-log panels here")
    args = p.parse_args(argv)
    with cli.errors(args.debug):
        if sorted(set(args.lengths)) != args.lengths:
            raise ValueError("--lengths must be increasing and distinct")
        if any(n <= args.steps for n in args.lengths):
            raise ValueError(f"every length must exceed --steps ({args.steps})")
        torch.set_num_threads(args.threads)
        r = measure(args.lengths, args.steps)
        print(table(r))
        if args.json:
            r["provenance"] = provenance(argv, prog=p.prog, threads=args.threads, dtype="float32", seed=None)
            files.atomic_write_text(args.json, json.dumps(r, indent=1))
        if args.plot:
            plot(r, args.plot)


if __name__ == "__main__":
    main()
