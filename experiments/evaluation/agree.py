"""
Do two ``experiments.compare`` results files say the same? The check behind "the GPU run equals the CPU run",
"bf16 moves nothing that matters", "the plain and fast engines agree":

    python -m experiments.evaluation.agree results/compare_default.json /tmp/cuda.json
    python -m experiments.evaluation.agree A.json B.json --tol 1e-3
    python -m experiments.evaluation.agree A.json B.json --records   # and a line per record that differs

Records are matched by (method, budget, task, mode); answers must be equal, float metrics within ``--tol``
(absolute up to 1, relative above), timings and settings are not compared. Prints a line per field and a
last line ``agree`` or ``differ: FIELDS``; exits 0 or 1, and 2 with one ``error:`` line for a file that is
not a compare results file. The rules in full: ``inside.md``, "agree.py".
"""

from __future__ import annotations

import math
from pathlib import Path

from nanollm import cli
from nanollm.io.files import read_json

KEY = ("method", "budget", "task", "mode")
EXACT = ("predictions", "prediction_ids", "accuracies", "references", "kv_bytes", "extra_bytes",
         "compressed_tokens", "n_samples")
CLOSE = ("kl", "perturbation", "lost_mass", "attn_l1")


def cells(path: Path) -> dict[tuple, dict]:
    """The file's records by (method, budget, task, mode); one line and exit for anything else."""
    data = read_json(path, "results file")
    records = data.get("records") if isinstance(data, dict) else None
    if not isinstance(records, list) or not records or not all(isinstance(r, dict) for r in records):
        cli.fail(f"{path}: not a experiments.compare results file (a JSON object with a list of 'records')")
    by_key = {}
    for i, r in enumerate(records):
        if not all(k in r for k in KEY):
            cli.fail(f"{path}: record {i} lacks {', '.join(k for k in KEY if k not in r)}")
        key = tuple(r[k] for k in KEY)
        if not all(v is None or isinstance(v, (str, int, float)) for v in key):
            cli.fail(f"{path}: record {i}: its {'/'.join(KEY)} are strings or numbers, not {key!r:.80}")
        if key in by_key:
            cli.fail(f"{path}: two records of {key}")
        by_key[key] = r
    return by_key


def flat(x) -> list[float | None]:
    """A metric's numbers in order: a number, or a (nested) list of them (``attn_l1``: one per layer); None
    for anything that is not a number."""
    if isinstance(x, list):
        return [v for item in x for v in flat(item)]
    return [float(x)] if isinstance(x, (int, float)) and not isinstance(x, bool) else [None]


def gap(x: float | None, y: float | None) -> float:
    """|x - y| / max(1, |x|, |y|): absolute up to 1, relative above; 0 for two NaNs (a metric undefined in both
    runs), inf for NaN or a non-number against another."""
    if x is None or y is None or math.isnan(x) or math.isnan(y):
        return 0.0 if x is not None and y is not None and math.isnan(x) and math.isnan(y) else math.inf
    return abs(x - y) / max(1.0, abs(x), abs(y))


def largest_gap(a, b) -> float:
    """The largest ``gap`` over two values of one metric (inf where their shapes differ or one is missing)."""
    if a is None or b is None:
        return 0.0 if a is b else math.inf
    xs, ys = flat(a), flat(b)
    if len(xs) != len(ys):
        return math.inf
    return max((gap(x, y) for x, y in zip(xs, ys)), default=0.0)


def compare_files(a: dict[tuple, dict], b: dict[tuple, dict], tol: float) -> tuple[list[str], list[str]]:
    """The printed lines and the names of the fields that differ."""
    lines, differ = [], []
    for field in EXACT:
        keys = [k for k in a if field in a[k] or field in b[k]]
        if not keys:
            continue
        same = sum(a[k].get(field) == b[k].get(field) for k in keys)
        lines.append(f"{field:<20} equal in {same} of {len(keys)} records")
        if same < len(keys):
            differ.append(field)
            first = next(k for k in keys if a[k].get(field) != b[k].get(field))
            lines.append(f"{'':<20} first that differs: {'/'.join(map(str, first))}")
    for field in CLOSE:
        keys = [k for k in a if field in a[k] or field in b[k]]
        if not keys:
            continue
        gap = max(largest_gap(a[k].get(field), b[k].get(field)) for k in keys)
        ok = gap <= tol
        lines.append(f"{field:<20} largest difference {gap:.3g} (relative above 1) over {len(keys)} records "
                     f"({'within' if ok else 'beyond'} {tol:g})")
        if not ok:
            differ.append(field)
    return lines, differ


def record_lines(a: dict[tuple, dict], b: dict[tuple, dict], tol: float) -> list[str]:
    """A line for each record that differs (``--records``), in A's order."""
    lines = []
    for key, x in a.items():
        y = b[key]
        exact = [f for f in EXACT if x.get(f) != y.get(f)]
        gaps = {f: largest_gap(x.get(f), y.get(f)) for f in CLOSE if f in x or f in y}
        if not exact and all(g <= tol for g in gaps.values()):
            continue
        answers, counted = "answers not comparable", ()
        for field in ("prediction_ids", "predictions"):               # the token ids, else the texts
            got_a, got_b = x.get(field), y.get(field)
            if isinstance(got_a, list) and isinstance(got_b, list) and len(got_a) == len(got_b):
                answers = f"answers {sum(p != q for p, q in zip(got_a, got_b))} of {len(got_a)} differ"
                counted = ("predictions", "prediction_ids")
                break
        acc = " / ".join(f"{r['accuracy']:.3f}" if isinstance(r.get("accuracy"), (int, float)) else "?"
                         for r in (x, y))
        metrics = "  ".join(f"{f} {g:.2g}" for f, g in gaps.items())
        other = [f for f in exact if f not in counted]
        lines.append(f"{'/'.join(map(str, key))}  {answers}  accuracy {acc}  {metrics}"
                     + (f"  also: {', '.join(other)}" if other else ""))
    return lines


def parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(
        prog="python -m experiments.evaluation.agree",
        description="Check that two experiments.compare results files say the same: every answer, accuracy and "
                    "byte count equal record by record, the float metrics (KL, perturbation, lost mass, "
                    "attn_l1) within --tol (absolute up to 1, relative above); timings and settings are not "
                    "compared. Exit status 0: they agree; 1: they differ (the fields are named).")
    ap.add_argument("a", type=Path, metavar="A.json", help="a experiments.compare results file (--json of a run)")
    ap.add_argument("b", type=Path, metavar="B.json", help="another, of the same cells")
    ap.add_argument("--tol", type=cli.positive_float, default=1e-3,
                    help="largest difference allowed in a float metric, absolute for values up to 1 and relative to "
                         "the value above 1 (default 1e-3)")
    ap.add_argument("--records", action="store_true",
                    help="also a line per record that differs: its cell, how many answers differ, its accuracy in "
                         "A and B, each float metric's largest difference and any other field that differs")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with cli.errors(args.debug):
        a, b = cells(args.a), cells(args.b)
        if set(a) != set(b):
            only = sorted(set(a) ^ set(b), key=str)[0]
            side = args.a if only in a else args.b
            cli.fail(f"the files hold different cells: {'/'.join(map(str, only))} is only in {side} "
                     f"({len(set(a) - set(b))} only in A, {len(set(b) - set(a))} only in B)")
        lines, differ = compare_files(a, b, args.tol)
        print(f"# {args.a} against {args.b}: {len(a)} records")
        print("\n".join(lines))
        if args.records:
            print("\n".join(record_lines(a, b, args.tol) or ["(no record differs)"]))
        print("agree" if not differ else f"differ: {', '.join(differ)}")
        return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
