"""
The main job's report: its records as tables per mode, intervals and exact paired tests, the short summary
``--quiet`` prints, the degenerate cells' warnings, and the accuracy-against-keep-ratio plot. A policy class of
one's own shows by its class name (``shown``), its full ``MODULE:CLASS`` in a line above the tables.
"""

from __future__ import annotations

import re

from methods import METHODS
from nanollm import cli
from nanollm.data.evaluate import MODES
from nanollm.data.tasks import ALL_TASKS

from .intervals import ALPHA, MIN_PAIRED, best_and_ties, paired_difference, sign_test, signed, verdict, wilson
from .metrics import METRICS

OWN_CLASS = re.compile(r"[\w.]+:(\w+)")           # MODULE:CLASS inside a method spec: "adakv(pkg.mod:Knorm)"


def shown(records: list[dict]) -> tuple[list[dict], list[str]]:
    """Records whose method names show each ``MODULE:CLASS`` by its ``CLASS`` (the tables and the plot stay as wide
    as the registered names), each with its name as written in ``spec`` (ties between methods are broken on it, so
    the report names the same best), and a line per class saying what it stands for; the records unchanged where
    nothing is shortened. Two classes of one name from different modules, or a class named as a registered method
    or a record's method (in any case), keep their full names. The JSON keeps the names as written."""
    full = {m.group(0) for r in records for m in OWN_CLASS.finditer(r["method"])}
    short = {spec: spec.rpartition(":")[2] for spec in full}
    taken = {name.lower() for name in set(METHODS) | {r["method"] for r in records}}
    clash = {name for name in short.values() if list(short.values()).count(name) > 1 or name.lower() in taken}
    short = {spec: name for spec, name in short.items() if name not in clash}
    if not short:
        return records, []
    lines = [f"{name} = {spec}" for spec, name in sorted(short.items(), key=lambda x: x[1])]
    return [{**r, "method": OWN_CLASS.sub(lambda m: short.get(m.group(0), m.group(0)), r["method"]),
             "spec": r["method"]} for r in records], lines              # spec: ties are broken on it


def spelled(records: list[dict]) -> dict[str, str]:
    """Each method's name as the records write it, by the name a report shows (``shown``): ties are broken on it."""
    return {r["method"]: r.get("spec", r["method"]) for r in records}


def answers_by_row(records: list[dict], mode: str) -> dict[tuple[str, float], list[float]]:
    """Per (method, keep ratio) in ``mode``: every sample's accuracy, tasks one after the other in a fixed
    order, for the rows that ran every task (the pairs of the exact tests)."""
    rows = [r for r in records if r["mode"] == mode]
    tasks = sorted({r["task"] for r in rows}, key=lambda t: ALL_TASKS.index(t) if t in ALL_TASKS else 99)
    by_key: dict[tuple, dict] = {}
    for r in rows:
        by_key.setdefault((r["method"], r["keep_ratio"]), {})[r["task"]] = r["accuracies"]
    return {k: [a for t in tasks for a in v[t]] for k, v in by_key.items() if set(v) == set(tasks)}


# Below this mean accuracy of the full cache on a (task, mode), the task says nothing of the methods: what they
# lose cannot show (every record of that cell is flagged "degenerate" and a warning line printed). 0.1 is two
# right answers in twenty; the bundled model's default suite scores 0.70-1.00 with the full cache.
DEGENERATE = 0.1


def degenerate_cells(records: list[dict]) -> dict[tuple[str, str], float]:
    """{(task, mode): the full cache's mean accuracy} where it is below ``DEGENERATE``."""
    return {(r["task"], r["mode"]): r["accuracy"] for r in records
            if r["method"] == "full" and r["accuracy"] < DEGENERATE}


def flag_degenerate(records: list[dict]) -> list[str]:
    """Marks every record ``degenerate`` (True or False) and returns a warning line per degenerate cell."""
    bad = degenerate_cells(records)
    for r in records:
        r["degenerate"] = (r["task"], r["mode"]) in bad
    return [f"warning: the full cache scores {acc:.2f} on {task} [{mode}], below {DEGENERATE}: the methods' "
            "accuracies there say nothing of what they lose (records flagged degenerate)"
            for (task, mode), acc in bad.items()]


# What the tables show of METRICS; the others are named in one line as JSON-only.
SHOWN = {"accuracy", "kl", "perturbation", "lost_mass", "kv_bytes", "decode_ms_per_token"}


def json_only() -> str:
    return "in the JSON only: " + ", ".join(m.name for m in METRICS if m.name not in SHOWN)


def p_value(p: float) -> str:
    """A p-value in a table: two decimals, or one significant digit below 0.01 ("5e-04"); never rounded up
    to the level ``ALPHA`` when below it (0.0499 is "<0.05", not "0.05")."""
    text = f"{p:.2f}" if p >= 0.01 else f"{p:.0e}"
    return f"<{ALPHA}" if p < ALPHA <= float(text) else text


def versus_best(records: list[dict], mode: str) -> dict[tuple[str, float], str]:
    """Per (method, keep ratio) of the methods (not the full cache): "best" for each keep ratio's best mean
    accuracy, "tie p=.." for a method the exact paired test cannot tell from it (p >= 0.05), else "p=..".
    Keep ratios with a single method get no mark."""
    answers, written = answers_by_row(records, mode), spelled(records)
    marks = {}
    for ratio in sorted({k[1] for k in answers if k[0] != "full"}):
        at = {k[0]: v for k, v in answers.items() if k[1] == ratio and k[0] != "full"}
        if len(at) < 2:
            continue
        best, p = best_and_ties(at, written)
        if not any(at[best]):                          # every answer wrong: no best among ties at zero
            continue
        marks[(best, ratio)] = "best"
        for name, pv in p.items():
            marks[(name, ratio)] = f"tie p={p_value(pv)}" if pv >= ALPHA else f"p={p_value(pv)}"
    return marks


def pairwise(records: list[dict]) -> list[dict]:
    """Every pair of methods at every keep ratio, per mode: the exact paired test of their answers
    (``intervals.sign_test``): wins of each on the samples where they differ, and the two-sided p-value."""
    out = []
    for mode in [m for m in MODES if any(r["mode"] == m for r in records)]:
        answers = answers_by_row(records, mode)
        for ratio in sorted({k[1] for k in answers if k[0] != "full"}):
            names = sorted(k[0] for k in answers if k[1] == ratio and k[0] != "full")
            for i, a in enumerate(names):
                for b in names[i + 1:]:
                    wa, wb, p = sign_test(answers[(a, ratio)], answers[(b, ratio)])
                    out.append({"mode": mode, "keep_ratio": ratio, "a": a, "b": b, "wins_a": wa, "wins_b": wb,
                                "p": p, "n": len(answers[(a, ratio)])})
    return out


def format_pairwise(records: list[dict]) -> str:
    """Per mode and keep ratio, a matrix of the exact paired tests between methods: "w:l p" is how many
    samples the row's method answered better than the column's, how many worse, and the p-value."""
    lines = []
    tests = pairwise(records)
    for mode in [m for m in MODES if any(t["mode"] == m for t in tests)]:
        for ratio in sorted({t["keep_ratio"] for t in tests if t["mode"] == mode}):
            at = [t for t in tests if t["mode"] == mode and t["keep_ratio"] == ratio]
            names = sorted({t["a"] for t in at} | {t["b"] for t in at})
            cell = {}
            for t in at:
                cell[(t["a"], t["b"])] = f"{t['wins_a']}:{t['wins_b']} {p_value(t['p'])}"
                cell[(t["b"], t["a"])] = f"{t['wins_b']}:{t['wins_a']} {p_value(t['p'])}"
            w = max(14, 1 + max(map(len, names)))
            cw = max(11, 2 + max(len(c) for c in cell.values()), 2 + max(map(len, names)))   # whole names
            head = f"{'':<{w}}" + "".join(f"{n:>{cw}}" for n in names)
            lines += [f"\n[{mode}] keep {ratio:.2f}: exact paired tests over {at[0]['n']} answers "
                      "(row wins:column wins on the samples they differ, two-sided p)", head, "-" * len(head)]
            for a in names:
                lines.append(f"{a:<{w}}" + "".join(f"{cell.get((a, b), '-'):>{cw}}" for b in names))
    return "\n".join(lines)


def format_tables(records: list[dict]) -> str:
    """One table per mode: rows method @ keep ratio (and the share of the compressed tokens kept, mean over
    tasks), columns accuracy per task, then mean metrics, and (with per-sample accuracies) how each method
    stands against its keep ratio's best (``versus_best``)."""
    lines = []
    tasks = sorted({r["task"] for r in records}, key=lambda t: ALL_TASKS.index(t) if t in ALL_TASKS else 99)
    for mode in [m for m in MODES if any(r["mode"] == m for r in records)]:
        rows = [r for r in records if r["mode"] == mode]
        keys = sorted({(r["method"], r["keep_ratio"], r["budget"]) for r in rows},
                      key=lambda k: (k[0] != "full", k[0], k[1]))
        short = [t.replace("niah_", "").replace("single_", "s_")[:10] for t in tasks]
        marks = versus_best(records, mode) if all("accuracies" in r for r in rows) else {}
        w = max(14, 1 + max(len(k[0]) for k in keys))                 # the method column fits every name
        head = f"{'method':<{w}}{'keep':>6}{'kept':>6}{'budget':>7} " + "".join(f"{s:>11}" for s in short) + \
            f"{'mean acc':>9}{'KL':>8}{'pert':>7}{'lost':>6}{'KV KiB':>8}{'step ms':>8}" + \
            ("  vs best" if marks else "")
        lines += [f"\n[{mode}]", head, "-" * len(head)]
        for method, ratio, budget in keys:
            sel = {r["task"]: r for r in rows if (r["method"], r["keep_ratio"], r["budget"]) == (method, ratio, budget)}
            accs = [sel[t]["accuracy"] if t in sel else float("nan") for t in tasks]
            mean = lambda k: sum(r[k] for r in sel.values()) / len(sel)   # noqa: E731
            kept = mean("realised_keep_ratio") if all("realised_keep_ratio" in r for r in sel.values()) else ratio
            lines.append(f"{method:<{w}}{ratio:>6.2f}{kept:>6.2f}{budget if budget is not None else '-':>7} "
                         + "".join(f"{a:>11.2f}" for a in accs)
                         + f"{sum(accs) / len(accs):>9.2f}{mean('kl'):>8.3f}{mean('perturbation'):>7.3f}"
                         f"{mean('lost_mass'):>6.2f}{max(r['kv_bytes'] for r in sel.values()) / 1024:>8.0f}"
                         f"{mean('decode_ms_per_token'):>8.1f}"
                         + (f"  {marks.get((method, ratio), ''):<11}".rstrip() if marks else ""))
    return "\n".join(lines)


def format_intervals(records: list[dict], what: str = "accuracy") -> str:
    """Per mode: each row's mean accuracy with its 95% Wilson interval, its paired difference from the
    full cache (95% bootstrap interval), and per keep ratio the methods the exact paired test cannot tell
    from that keep ratio's best (see ``intervals``). Needs the per-sample ``accuracies`` of each record
    (``what``: the metric they hold, for the titles)."""
    lines = []
    for mode in [m for m in MODES if any(r["mode"] == m for r in records)]:
        rows = [r for r in records if r["mode"] == mode]
        tasks = sorted({r["task"] for r in rows}, key=lambda t: ALL_TASKS.index(t) if t in ALL_TASKS else 99)
        by_key: dict[tuple, dict] = {}
        for r in rows:
            by_key.setdefault((r["method"], r["keep_ratio"]), {})[r["task"]] = r["accuracies"]
        groups = {k: [v[t] for t in tasks] for k, v in by_key.items() if set(v) == set(tasks)}
        full = next((g for (m, _), g in groups.items() if m == "full"), None)
        keys = sorted(groups, key=lambda k: (k[0] != "full", k[0], k[1]))
        w = max(14, 1 + max(len(k[0]) for k in keys))
        mean_of = "mean acc" if what == "accuracy" else "mean"            # the title names another metric
        head = f"{'method':<{w}}{'keep':>6}{mean_of:>9}   {'95% interval':<14}" + \
            ("   vs full (paired): difference [95% interval]" if full else "")
        lines += [f"\n[{mode}] mean {what}: 95% Wilson interval over its answers; "
                  "difference from the full cache: 95% paired bootstrap interval (each task's samples resampled)", head,
                  "-" * len(head)]
        means = {}
        for k in keys:
            g = groups[k]
            means[k] = sum(sum(x) / len(x) for x in g) / len(g)
            lo, hi = wilson(means[k], sum(len(x) for x in g))
            line = f"{k[0]:<{w}}{k[1]:>6.2f}{means[k]:>9.2f}   [{lo:.2f}, {hi:.2f}]  "
            if full is not None and k[0] != "full":
                d, dlo, dhi = paired_difference(g, full)
                fewest = min(len(x) for x in g)             # the bootstrap resamples each task's answers
                said = verdict(dlo, dhi) if fewest >= MIN_PAIRED else \
                    f"no verdict: {fewest} answer(s) in a task, under {MIN_PAIRED}"
                line += f"   {signed(d)} [{signed(dlo)}, {signed(dhi)}]  {said}"
            lines.append(line.rstrip())
        answers, written = answers_by_row(records, mode), spelled(records)
        for ratio in sorted({k[1] for k in keys if k[0] != "full"}):
            at = {k[0]: answers[k] for k in keys if k[1] == ratio and k[0] != "full"}
            if len(at) == 1:                                # nothing to rank it against: its mean alone
                (name,) = at
                lines.append(f"keep {ratio:.2f}: {name} ({means[(name, ratio)]:.2f}), the only method")
            if len(at) < 2:
                continue
            best, p = best_and_ties(at, written)
            if not any(at[best]):
                nothing = "answers nothing right" if what == "accuracy" else f"scores 0 ({what}) on every answer"
                lines.append(f"keep {ratio:.2f}: no best, every method {nothing}")
                continue
            ties = [f"{name} (p={p_value(pv)})" for name, pv in sorted(p.items(), key=lambda x: -x[1]) if pv >= ALPHA]
            lines.append(f"keep {ratio:.2f}: best {best} ({means[(best, ratio)]:.2f}); not distinguishable from it "
                         "(exact paired test, p >= 0.05): " + (", ".join(ties) if ties else "none"))
    return "\n".join(lines)


def format_summary(records: list[dict]) -> str:
    """What ``--quiet`` prints instead of the tables: per mode the full cache's mean accuracy (what the methods
    can at best keep), then per keep ratio the best method and those the exact paired test cannot tell from
    it (``format_intervals``' verdict lines)."""
    lines, mode = [], ""
    for line in format_intervals(records).splitlines():
        if line.startswith("["):
            mode = line.split("]")[0] + "]"
            full = [r["accuracy"] for r in records if r["method"] == "full" and f"[{r['mode']}]" == mode]
            if full:
                lines.append(f"{mode} full cache: mean accuracy {sum(full) / len(full):.2f} over its tasks")
        elif line.startswith("keep "):
            lines.append(f"{mode} {line}")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    """Mean accuracy over tasks vs keep ratio, one line per method with its 95% Wilson interval over the
    row's answers, one panel per mode, the legend beside the panels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = [m for m in MODES if any(r["mode"] == m for r in records)]
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes) + 1.6, 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rows = [r for r in records if r["mode"] == mode]
        full = [r["accuracy"] for r in rows if r["method"] == "full"]
        if full:
            ax.axhline(sum(full) / len(full), color="black", ls="--", label="full")
        for method in sorted({r["method"] for r in rows} - {"full"}):
            ratios = sorted({r["keep_ratio"] for r in rows if r["method"] == method})
            cells = [[r for r in rows if r["method"] == method and r["keep_ratio"] == k] for k in ratios]
            accs = [sum(r["accuracy"] for r in c) / len(c) for c in cells]
            answers = [sum(r.get("n_samples", 1) for r in c) for c in cells]
            bounds = [wilson(min(1.0, max(0.0, a)), n) for a, n in zip(accs, answers)]
            err = [[a - lo for a, (lo, _) in zip(accs, bounds)], [hi - a for a, (_, hi) in zip(accs, bounds)]]
            ax.errorbar(ratios, accs, yerr=err, marker="o", capsize=3, label=method)
        ax.set(title=mode.replace("_", " "), xlabel="keep ratio (budget / --length)",
               ylabel="accuracy (mean over tasks, 95% interval)", ylim=(-0.03, 1.03))
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    cli.save_figure(fig, path)                  # png/pdf/svg by suffix; the old figure stays if writing fails


def format_scored(records: list[dict], scored: dict[str, list[list[float]]]) -> str:
    """Metrics scored after a run (``scored``: name -> each record's per-sample values) with the intervals and
    exact paired tests of ``format_intervals`` and ``format_pairwise``, the values standing for the
    accuracies; a metric whose values are not scores in [0, 1] (Wilson's interval is for those) says so."""
    out = []
    for name, values in scored.items():
        if not all(0 <= x <= 1 for v in values for x in v):
            out.append(f"\n# {name}: values outside [0, 1], so no intervals (they are for scores of answers)")
            continue
        rows = [{**{k: r[k] for k in ("method", "budget", "keep_ratio", "task", "mode")},
                 "accuracy": sum(v) / len(v), "accuracies": v} for r, v in zip(records, values)]
        out.append(f"\n# {name}: intervals and exact paired tests as for the accuracy"
                   + format_intervals(rows, name) + format_pairwise(rows))
    return "\n".join(out)
