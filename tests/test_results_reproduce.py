"""
The committed results reproduce: one small cell of each results table is re-run here with the settings its
file records (``nanollm.cli.provenance``: the command, parsed back with the command's own parser), and must
give the committed numbers. A change to the code that moves a committed number fails here until the file is
regenerated (its command is the first line of its ``.txt``).

Also: every file in ``results/`` says where it came from, in the file (a ``provenance`` record) or, for
files written before the commands recorded it, in ``results/README.md``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from methods.evaluation import compare, language_modelling
from methods.evaluation.compare import Variant
from methods.presets import preset_options
from nanollm import load
from nanollm.io.checkpoint import load_config

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
METRICS = ("kl", "perturbation", "lost_mass")           # means over the cell's samples: equal to float noise


def recorded(name: str) -> tuple[dict, list[dict]]:
    saved = json.loads((RESULTS / name).read_text())
    return saved["provenance"], saved["records"]


def recorded_args(prov: dict, module):
    """The command's arguments, parsed by the module's own parser (defaults filled in as that run had them)."""
    words = shlex.split(prov["command"])
    assert words[:2] == ["python", "-m"], prov["command"]
    args, skip = [], False
    for w in words[3:]:                      # the output files are the run's, not settings (nor checked here)
        if not skip and w not in ("--json", "--plot", "--out"):
            args.append(w)
        skip = w in ("--json", "--plot", "--out")
    return module.parser().parse_args(args)


def fetched(checkpoint: str) -> None:
    try:
        load_config(checkpoint)
    except (OSError, ValueError) as e:
        pytest.skip(f"{checkpoint} is not here ({e}); `python -m nanollm.cli.fetch {checkpoint}`")


def recorded_model(name: str, module):
    """The file's provenance, records and parsed arguments, and its model loaded with its thread count."""
    prov, records = recorded(name)
    args = recorded_args(prov, module)
    fetched(args.checkpoint)
    torch.set_num_threads(prov["threads"])
    model, tok, _ = load(args.checkpoint)
    return records, args, model, tok


def assert_rows_equal(again: list[dict], committed: dict, key: str, exact: tuple, close: tuple,
                      logs: tuple = ()) -> None:
    """Each re-run row against the committed row of the same ``key``: ``exact`` fields equal, ``close`` fields
    equal to float noise, and ``logs`` fields equal to float noise in their logarithm: a perplexity ratio is
    exp(mean NLL gap), so the rounding of another CPU adds to its log, and a ratio of 3.8e5 (KVReviver's shipped
    cache) moves by 1e-3 of itself between two x86 machines when its log moves by 8e-5 of itself."""
    assert {r[key] for r in again} == set(committed)
    for r in again:
        c = committed[r[key]]
        assert [r[k] for k in exact] == [c[k] for k in exact], (r[key], exact)
        for k in close:
            assert r[k] == pytest.approx(c[k], rel=1e-4, abs=1e-6), (r[key], k)
        for k in logs:
            assert math.log(r[k]) == pytest.approx(math.log(c[k]), rel=1e-4, abs=1e-6), (r[key], k)


def rerun_compare_cell(name: str, methods: list[str], keep_ratio: float, task: str, mode: str,
                       first: int | None = None) -> None:
    """Re-run ``methods`` at one keep ratio on one task and mode with the file's settings; compare every
    record of that cell (the full cache's too) with the committed one. A run of more than ``first``
    samples (a long real-model run) is checked on its first ``first`` samples: their answers must be the
    committed ones, one by one."""
    records, args, model, tok = recorded_model(name, compare)
    committed = {r["method"]: r for r in records if r["task"] == task and r["mode"] == mode
                 and r["method"] in methods + ["full"] and r["keep_ratio"] in (keep_ratio, 1.0)}
    budget = committed[methods[0]]["budget"]
    length, samples = committed["full"]["length"], committed["full"]["n_samples"]
    variants = [Variant(m, m, preset_options(m, args.preset)) for m in methods]
    first = None if first is None or samples <= first else first
    again = compare.run(model, tok, variants, [budget], [task], [mode], first or samples, length, args.seed,
                        progress=False)
    if first is None:
        assert_rows_equal(again, committed, "method", ("accuracies", "kv_bytes"), METRICS)
    else:
        assert {r["method"]: r["accuracies"] for r in again} == \
            {m: r["accuracies"][:first] for m, r in committed.items()}


@pytest.mark.slow
def test_compare_default_reproduces():
    """The bundled model's table: every method at keep 0.25 on one task, question in the prompt."""
    _, records = recorded("compare_default.json")
    methods = sorted({r["method"] for r in records} - {"full"})
    rerun_compare_cell("compare_default.json", methods, 0.25, "niah_multikey", "question_in_prompt")


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("name, method", [("compare_smollm2.json", "critical_kv"),
                                          ("compare_smollm2_kvpress.json", "chunkkv")])
def test_compare_smollm2_reproduces(name, method):
    """SmolLM2-135M, our settings and kvpress's: one method at keep 0.25 on passkey, question in the prompt
    (for the 30-sample run at 2k tokens, the first 10 samples' answers: each takes seconds)."""
    rerun_compare_cell(name, [method], 0.25, "passkey", "question_in_prompt", first=10)


@pytest.mark.slow
@pytest.mark.heavy
def test_language_modelling_reproduces():
    """SmolLM2-135M's language-modelling table: a decode-time method and a prompt compressor at keep 0.5."""
    records, args, model, tok = recorded_model("lm_smollm2.json", language_modelling)
    methods = ["h2o", "critical_kv"]
    committed = {r["method"]: r for r in records if r["method"] == "full"
                 or (r["method"] in methods and r["keep_ratio"] == 0.5)}
    again = language_modelling.run(model, tok, ["full"] + methods, [0.5], committed["full"]["length"],
                                   progress=False, options={m: preset_options(m, args.preset) for m in methods})
    assert_rows_equal(again, committed, "method", ("budget", "cache_at_end", "scored_tokens"),
                      ("ppl_ratio", "kl", "top1_agreement"))


COLLAPSED = 100.0        # a perplexity ratio above this is a collapsed cache: its value is an order of magnitude


@pytest.mark.slow
@pytest.mark.heavy
def test_language_modelling_s_collapsed_rows_reproduce_in_order_of_magnitude():
    """KVReviver's rows of the language-modelling table, the kind the table holds beside the decode-time and
    prompt rows: a collapsed cache (perplexity ratio in the 1e4-1e6) is the exp of a mean of large negative
    log-likelihoods, which the order of a sum moves, so it reproduces in its order of magnitude, and the rest
    of its row (the budget, the cache) exactly. The spread across the two engines and one or two threads is
    printed: the quoting resolution of ``methods/evaluation/smollm2.md``."""
    records, args, model, tok = recorded_model("lm_smollm2.json", language_modelling)
    committed = {r["keep_ratio"]: r for r in records if r["method"] == "kvreviver"}
    runs = {}
    for engine in ("fast", "plain"):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            rows = language_modelling.run(model, tok, ["kvreviver"], sorted(committed), committed[0.1]["length"],
                                          progress=False, engine=engine,
                                          options={"kvreviver": preset_options("kvreviver", args.preset)})
            runs[(engine, threads)] = {r["keep_ratio"]: r for r in rows if r["method"] == "kvreviver"}
    torch.set_num_threads(1)
    for ratio, c in committed.items():
        values = [run[ratio]["ppl_ratio"] for run in runs.values()]
        print(f"kvreviver keep {ratio}: committed ppl/full {c['ppl_ratio']:.3g}; fast/plain x 1/2 threads "
              f"{min(values):.3g} to {max(values):.3g}")
        for run in runs.values():
            assert [run[ratio][k] for k in ("budget", "cache_at_end", "scored_tokens")] == \
                [c[k] for k in ("budget", "cache_at_end", "scored_tokens")]
            if c["ppl_ratio"] > COLLAPSED:
                assert abs(math.log10(run[ratio]["ppl_ratio"]) - math.log10(c["ppl_ratio"])) < 0.5, (ratio, values)
            else:
                assert run[ratio]["ppl_ratio"] == pytest.approx(c["ppl_ratio"], rel=1e-3), (ratio, values)


@pytest.mark.slow
@pytest.mark.heavy
def test_kvreviver_ablation_reproduces():
    """KVReviver's ablation table (SmolLM2, the language-modelling protocol): the shipped method and the one
    without swaps at 51 slots, side by side, against the committed rows (swaps counted exactly)."""
    from methods.analysis import kvreviver_ablation as ablation
    records, args, model, tok = recorded_model("kvreviver_ablation.json", ablation)
    names = ["shipped", "no swaps"]
    committed = {r["variant"]: r for r in records if r.get("kind") == "lm" and r["keep_ratio"] in (0.2, 1.0)
                 and r["variant"] in names + ["full"]}
    variants = [v for v in ablation.VARIANTS if v.name in names]
    again = ablation.lm_ablation(model, tok, variants, [0.2], committed["full"]["length"])
    assert_rows_equal(again, committed, "variant", ("budget", "swaps", "scored_tokens"), ("kl", "top1_agreement"),
                      logs=("ppl_ratio",))


@pytest.mark.slow
@pytest.mark.heavy
def test_the_front_pages_generation_reproduces():
    """The README's compression example (``results/generate_smollm2_passkey.txt``): each of its commands, run
    again, prints what the file holds (greedy decoding: the same tokens)."""
    fetched("smollm2-135m")
    text = (RESULTS / "generate_smollm2_passkey.txt").read_text()
    runs = text.split("\n$ ")[1:]
    assert len(runs) == 2
    for run in runs:
        command, _, printed = run.partition("\n")
        words = shlex.split(command)
        out = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "2"})
        assert out.returncode == 0, out.stderr[-500:]
        assert out.stdout.strip() == printed.strip(), f"{command}: prints\n{out.stdout[-400:]}"


def test_every_results_file_says_where_it_came_from():
    """A JSON file carries a ``provenance`` record (command, threads, dtype, seed, versions, commit); a text
    results table starts with the same record as ``# `` lines; any other file is listed in results/README.md
    with its command and what is known of its provenance."""
    manifest = (RESULTS / "README.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+)` \|", manifest, re.M))
    missing = []
    for path in sorted(RESULTS.iterdir()):
        if path.name == "README.md" or path.name in listed:
            continue
        if path.suffix == ".json":
            prov = json.loads(path.read_text()).get("provenance") if path.read_text().lstrip().startswith("{") \
                else None
            ok = prov is not None and {"command", "threads", "dtype", "seed", "versions", "commit"} <= set(prov)
        elif path.suffix == ".txt":
            ok = path.read_text().startswith("# command: ")
        else:                                   # a plot: its JSON beside it records the run
            ok = path.with_suffix(".json").exists()
        if not ok:
            missing.append(path.name)
    assert not missing, f"results files with no provenance in the file or in results/README.md: {missing}"
    stale = sorted(n for n in listed if not (RESULTS / n).exists())
    assert not stale, f"results/README.md lists files that are not there: {stale}"
