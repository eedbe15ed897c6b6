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
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from experiments import moved
from experiments.analysis.kvreviver_rounding import sums_in_float64
from experiments.evaluation import compare, language_modelling
from experiments.evaluation.compare import Variant
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
                 and r["method"] in methods + ["full"]            # a record's ratio is budget / length, rounded
                 and (r["method"] == "full" or math.isclose(r["keep_ratio"], keep_ratio, abs_tol=2e-3))}
    assert set(committed) == set(methods) | {"full"}, f"{name} has no cell {task} / {mode} / keep {keep_ratio}"
    budgets = [committed[methods[0]]["budget"]] if methods else []        # no method: the full cache alone
    length, samples = committed["full"]["length"], committed["full"]["n_samples"]
    variants = [Variant(m, m, preset_options(m, args.preset)) for m in methods]
    first = None if first is None or samples <= first else first
    again = compare.run(model, tok, compare.RunSpec(variants, budgets, [task], [mode], first or samples, length,
                                                    args.seed, progress=False))
    answers = ("accuracies", "predictions") if "predictions" in committed["full"] else ("accuracies",)
    if first is None:
        assert_rows_equal(again, committed, "method", answers + ("kv_bytes",), METRICS)
    else:
        for field in answers:
            assert {r["method"]: r[field] for r in again} == \
                {m: r[field][:first] for m, r in committed.items()}, field


@pytest.mark.slow
def test_compare_default_reproduces():
    """The bundled model's table: every method at keep 0.25 on one task, question in the prompt."""
    _, records = recorded("compare_default.json")
    methods = sorted({r["method"] for r in records} - {"full"})
    rerun_compare_cell("compare_default.json", methods, 0.25, "niah_multikey", "question_in_prompt")


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("name, methods, keep, task, mode, first", [
    # the main job (2k tokens, 30 samples: the first samples' answers, each takes seconds): a prompt compressor
    # with the question in the prompt; a decode-time evictor and KVReviver with the question after the context
    ("compare_smollm2.json", ["critical_kv"], 0.25, "passkey", "question_in_prompt", 10),
    ("compare_smollm2.json", ["h2o", "kvreviver"], 0.1, "niah_single_docs", "question_after_context", 3),
    # kvpress's settings (512 tokens, 10 samples): every method, the wrapper too, in both modes
    ("compare_smollm2_kvpress.json", ["chunkkv"], 0.25, "passkey", "question_in_prompt", None),
    ("compare_smollm2_kvpress.json", ["streaming_llm", "snapkv", "adakv", "critical_kv", "critical_kv(adakv(snapkv))"],
     0.1, "niah_single_docs", "question_after_context", None),
    # AdaKV's two readings (experiments/analysis/adakv_allocation.py): a cell whose first answers differ between them
    ("adakv_allocation_smollm2.json", ["adakv", "experiments.analysis.adakv_allocation:RepositoryAdaKV"], 0.25,
     "passkey", "question_after_context", 3),
    ("adakv_allocation_alpha05_smollm2.json", ["experiments.analysis.adakv_allocation:AdaKVAlphaHalf",
     "experiments.analysis.adakv_allocation:RepositoryAdaKVAlphaHalf"], 0.25, "niah_multikey_docs",
     "question_in_prompt", 2),
    # the full cache's accuracy at three lengths and over 30 samples (nanollm/README.md's table)
    ("smollm2_full_cache_1024.json", [], 1.0, "niah_multivalue_docs", "question_in_prompt", None),
    ("smollm2_full_cache_2048.json", [], 1.0, "niah_multiquery_docs", "question_after_context", None),
    ("smollm2_full_cache_4096.json", [], 1.0, "passkey", "question_in_prompt", 2),
    ("smollm2_full_cache_2048_30samples.json", [], 1.0, "vt", "question_in_prompt", 4),
])
def test_compare_smollm2_reproduces(name, methods, keep, task, mode, first):
    """SmolLM2-135M's tables from experiments.compare: each kind of row (the full cache, a prompt compressor, a
    decode-time evictor, KVReviver, a wrapper; both modes) in one cell of the file that holds it."""
    rerun_compare_cell(name, methods, keep, task, mode, first=first)


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("name", ["kvreviver_rounding_plain.json", "kvreviver_rounding_float64.json"])
def test_kvreviver_rounding_reproduces(name):
    """KVReviver's records with its sketch's sums in fp32 and in float64 (``experiments.analysis.kvreviver_rounding``,
    the files' commands): the first three answers of the cell where the third moved between the two."""
    with sums_in_float64() if "float64" in name else nullcontext():
        rerun_compare_cell(name, ["kvreviver"], 0.1, "passkey", "question_in_prompt", first=3)


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
    printed: the quoting resolution of ``experiments/evaluation/smollm2.md``."""
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


def rerun_key_norm(name: str, samples: int) -> None:
    """``experiments.analysis.key_norm``'s table: the first task's first ``samples`` prompts, every layer."""
    from experiments.analysis import key_norm
    records, args, model, tok = recorded_model(name, key_norm)
    task = args.tasks[0]
    again = key_norm.measure(model, tok, task, args.length, args.keep, samples)
    committed = {(r["seed"], r["layer"]): r for r in records if r["task"] == task and r["seed"] < samples}
    for r in again:
        r["key"] = (r["seed"], r["layer"])
    assert_rows_equal(again, committed, "key", ("length", "budget"), key_norm.COLUMNS)


@pytest.mark.slow
def test_key_norm_toy_reproduces():
    """The bundled model's key norms against its last query's attention (two prompts of the first task)."""
    rerun_key_norm("key_norm_toy.json", 2)


@pytest.mark.slow
@pytest.mark.heavy
def test_key_norm_smollm2_reproduces():
    """SmolLM2's key norms against its last query's attention (one prompt of the first task)."""
    rerun_key_norm("key_norm_smollm2.json", 1)


@pytest.mark.slow
@pytest.mark.heavy
def test_kvreviver_ablation_reproduces():
    """KVReviver's ablation table (SmolLM2, the language-modelling protocol): the shipped method and the one
    without swaps at 51 slots, side by side, against the committed rows (swaps counted exactly)."""
    from experiments.analysis import kvreviver_ablation as ablation
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
def test_kvreviver_ablation_s_fisher_and_lemma_rows_reproduce():
    """The ablation file's other two kinds of row: the Fisher information per layer that sets the "Fisher
    budgets" variant, and Lemma 2's predicted and measured reconstruction errors per layer and policy."""
    from experiments.analysis import kvreviver_ablation as ablation
    records, args, model, tok = recorded_model("kvreviver_ablation.json", ablation)
    fisher = next(r for r in records if r["kind"] == "fisher")
    calib = ablation.calibration_ids(tok)
    assert (len(calib), ablation.CALIBRATION_FROM) == (fisher["calibration_tokens"], fisher["calibration_from"])
    assert ablation.fisher_information(model, calib) == pytest.approx(fisher["fisher"], rel=1e-4)
    committed = {(r["policy"], r["layer"]): r for r in records if r["kind"] == "lemma2"}
    again = ablation.lemma2(model, tok, args.lemma_length, args.lemma_keep,
                            {"shipped": ablation.KVReviverPolicy, "centred+shrunk": ablation.CentredShrunk})
    assert {(r["policy"], r["layer"]) for r in again} == set(committed)
    for r in again:
        c = committed[(r["policy"], r["layer"])]
        exact = ("length", "budget", "tokens_in_sketch", "width", "rows")
        assert [r[k] for k in exact] == [c[k] for k in exact], (r["policy"], r["layer"])
        for k in ("predicted", "bound", "key_mse", "value_mse", "key_error_norm", "value_error_norm",
                  "key_mean_ratio", "value_mean_ratio"):
            assert r[k] == pytest.approx(c[k], rel=1e-4, abs=1e-6), (r["policy"], r["layer"], k)


@pytest.mark.slow
@pytest.mark.heavy
def test_a_row_of_the_course_mutants_report_reproduces(tmp_path):
    """``results/course_mutants.txt``: one task's row (the cache assignment's group scores, hand-written and
    catalogue mutants) graded again gives the committed mutants and kills."""
    from course import mutants
    row = re.search(r"^== cache: .*?^   group_scores +(\d+) +(\d+)$",
                    (RESULTS / "course_mutants.txt").read_text(), re.M | re.S)
    assert row, "results/course_mutants.txt has no cache / group_scores row"
    out = tmp_path / "report.txt"
    assert mutants.main(["cache", "--task", "group_scores", "--jobs", "2", "--quiet", "--out", str(out)]) == 0
    again = re.search(r"^   group_scores +(\d+) +(\d+)$", out.read_text(), re.M)
    assert again and again.groups() == row.groups(), out.read_text()


@pytest.mark.slow
@pytest.mark.heavy
def test_the_launch_count_reproduces():
    """``results/launches_smollm2_batched.txt``: one SmolLM2 job counted again gives the committed table, row
    by row (operations and host waits are the code's, not the machine's; the time in its last line is)."""
    from experiments.evaluation import launches
    fetched("smollm2-135m")
    text = (RESULTS / "launches_smollm2_batched.txt").read_text()
    torch.set_num_threads(1)
    model, tok, _ = load("smollm2-135m")
    counter = launches.count(model, tok, "batched", "niah_single_docs", "question_after_context", 2048, 0)
    again = launches.report(counter)[:-1]                  # without the timing line
    committed = text.split("\n")[text.split("\n").index(again[0]):][:len(again)]
    assert again == committed


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
        words[2] = moved(words[2])                      # the command as it ran; its module may have moved since
        out = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "2"})
        assert out.returncode == 0, out.stderr[-500:]
        assert out.stdout.strip() == printed.strip(), f"{command}: prints\n{out.stdout[-400:]}"


HERE = "tests/test_results_reproduce.py::"
LOG = "log: a before/after run of a past change, kept as what it showed then (results/README.md)"
TIMING = "timing: one machine's run; timed again, its numbers move with the machine"
GPU = "gpu: measured on a lent GPU; fastpath/gpu_check.sh runs it again on a CUDA machine"
INDEX = "index: needs the package index and a Python 3.10 (python -m course.image_check, its first line); the " \
        "versions it resolves and its timings move with the index"
READERS = "readers: cold attempts by readers new to the topic, each estimating a student's minutes; no program " \
          "re-runs a reader (the file's header says how the attempts were made)"
# How each committed results file is checked at HEAD: the tests that re-run its rows (each kind of row it
# holds), or why none does. A file a run prints beside another ("beside NAME") is checked through it.


def compare_run(run: str) -> dict:
    """A SmolLM2 ``experiments.compare`` run's three files: its JSON re-run by a cell, its tables and plot beside."""
    return {f"{run}.json": (HERE + "test_compare_smollm2_reproduces",), f"{run}.txt": f"beside {run}.json",
            f"{run}.png": f"beside {run}.json"}


CHECKED_BY = {
    "compare_default.json": (HERE + "test_compare_default_reproduces",),
    "compare_default.txt": "beside compare_default.json",
    **{name: entry for run in ("compare_smollm2", "compare_smollm2_kvpress", "adakv_allocation_smollm2",
                               "adakv_allocation_alpha05_smollm2")
       for name, entry in compare_run(run).items()},
    "smollm2_full_cache_1024.json": (HERE + "test_compare_smollm2_reproduces",),
    "smollm2_full_cache_2048.json": (HERE + "test_compare_smollm2_reproduces",),
    "smollm2_full_cache_4096.json": (HERE + "test_compare_smollm2_reproduces",),
    "smollm2_full_cache_2048_30samples.json": (HERE + "test_compare_smollm2_reproduces",),
    "smollm2_full_cache_2048_30samples.txt": "beside smollm2_full_cache_2048_30samples.json",
    "lm_smollm2.json": (HERE + "test_language_modelling_reproduces",
                        HERE + "test_language_modelling_s_collapsed_rows_reproduce_in_order_of_magnitude"),
    "lm_smollm2.txt": "beside lm_smollm2.json",
    "lm_smollm2.png": "beside lm_smollm2.json",
    "lm_smollm2_kvreviver_spread.txt":
        (HERE + "test_language_modelling_s_collapsed_rows_reproduce_in_order_of_magnitude",),
    "kvreviver_ablation.json": (HERE + "test_kvreviver_ablation_reproduces",
                                HERE + "test_kvreviver_ablation_s_fisher_and_lemma_rows_reproduce"),
    "kvreviver_ablation.txt": "beside kvreviver_ablation.json",
    "key_norm_toy.json": (HERE + "test_key_norm_toy_reproduces",),
    "key_norm_toy.txt": "beside key_norm_toy.json",
    "key_norm_smollm2.json": (HERE + "test_key_norm_smollm2_reproduces",),
    "key_norm_smollm2.txt": "beside key_norm_smollm2.json",
    "kvreviver_rounding_plain.json": (HERE + "test_kvreviver_rounding_reproduces",),
    "kvreviver_rounding_float64.json": (HERE + "test_kvreviver_rounding_reproduces",),
    "kvreviver_rounding_smollm2.txt": "beside kvreviver_rounding_float64.json",
    "generate_smollm2_passkey.txt": (HERE + "test_the_front_pages_generation_reproduces",),
    "course_mutants.txt": (HERE + "test_a_row_of_the_course_mutants_report_reproduces",),
    "match3_eval.txt": ("tests/methods/tensor_attention/test_match3.py::test_bundled_cards_reproduce",),
    "peer_kvpress.txt": ("tests/methods/test_kvpress_peer.py::test_same_kept_positions_as_kvpress",
                         "tests/methods/test_kvpress_peer.py::"
                         "test_chunkkv_differs_only_in_the_chunk_straddling_the_window"),
    **dict.fromkeys(["compare_2samples_before_shared_prompt.txt", "compare_2samples_after_shared_prompt.txt",
                     "compare_2samples_before_side_by_side.txt", "compare_2samples_after_side_by_side.txt",
                     "compare_4methods_2samples_before.txt", "compare_4methods_2samples_after.txt",
                     "full_cache_step_32k_before_after.txt"], LOG),
    **dict.fromkeys(["methods_bench_1thread.json", "methods_bench_1thread.png", "methods_bench_2threads_32k.json",
                     "methods_bench_smollm2.json", "nanollm_bench_vs_transformers.json", "speed_smollm2_bf16.json",
                     "speed_smollm2_fp32.json", "tensor_bench_1thread.json", "tensor_bench_1thread.png",
                     "throughput_smollm2.json", "throughput_smollm2.txt", "timings.json"], TIMING),
    **dict.fromkeys(["decode_e2e_h100.json", "decode_e2e_h100_summary.txt", "decode_e2e_hf_compiled_8192_h100.json",
                     "decode_e2e_smollm2_b16_h100.json", "decode_e2e_smollm2_b1_h100.json",
                     "decode_profile_h100_32k.txt", "decode_tests_h100.txt", "kernels_bench_h100.json",
                     "kernels_tests_h100.txt", "decode_e2e_h200.json", "decode_e2e_h200_summary.txt",
                     "decode_tests_h200.txt", "compare_gpu_h200.txt", "launches_bundled_h200_fast.txt",
                     "launches_bundled_h200_batched.txt", "decode_e2e_smollm2_b1_h200.json",
                     "decode_e2e_smollm2_b16_h200.json", "decode_e2e_hf_compiled_8192_h200.json",
                     "decode_profile_h200.txt", "decode_tests_h200_9fc034d.txt", "compare_gpu_h200_9fc034d.txt",
                     "decode_e2e_h200_fd79573.json"], GPU),
    "launches_smollm2_batched.txt": (HERE + "test_the_launch_count_reproduces",),
    "launches_smollm2_fast.txt": "beside launches_smollm2_batched.txt",
    "launches_smollm2_one-group.txt": "beside launches_smollm2_batched.txt",
    "launches_smollm2_one-group_together2.txt": "beside launches_smollm2_batched.txt",
    "launches_smollm2_batched_22ea94c.txt": LOG,
    "agree_22ea94c_7f225c6.txt": LOG,
    "agree_7f225c6_602d281.txt": LOG,
    "agree_row_hooks_89e7d65.txt": LOG,
    "agree_7f225c6_82f90e5.txt": LOG,
    "agree_82f90e5_9eecbf6.txt": LOG,
    "agree_4a64570_13ea08b.txt": LOG,
    "agree_eea8c21_47f26a8.txt": LOG,
    "agree_e4fc73c_c110db0.txt": LOG,
    "launches_smollm2_one-group_37fc1cd.txt": LOG,
    "launches_smollm2_one-group_c110db0.txt": LOG,
    "launches_smollm2_one-group_838797e.txt": LOG,
    "agree_e8e02a6_be67f97.txt": LOG,
    "agree_dc6c1fd_3f0fd0f.txt": LOG,
    "peak_memory_dc6c1fd_3f0fd0f.txt": LOG,
    "course_attempts.txt": READERS,
    "gradescope_image.txt": INDEX,
    "student_install.txt": LOG,
}


def test_every_results_file_is_re_run_or_says_why():
    """Each file in results/ is in ``CHECKED_BY``: the tests named there exist (a renamed test fails here), a
    file "beside" another names one that tests re-run, and nothing listed is gone."""
    files = {p.name for p in RESULTS.iterdir() if p.name != "README.md"}
    assert files - set(CHECKED_BY) == set(), "results files that no test re-runs and no line explains"
    assert set(CHECKED_BY) - files == set(), "CHECKED_BY names files that are not in results/"
    for name, how in CHECKED_BY.items():
        if isinstance(how, str):
            kind, _, rest = how.partition(" ")
            assert how in (LOG, TIMING, GPU, READERS, INDEX) or kind == "beside", (name, how)
            if kind == "beside":
                assert isinstance(CHECKED_BY.get(rest), tuple), (name, how)
            continue
        for test in how:
            path, _, function = test.partition("::")
            assert re.search(rf"^def {function}\(", (ROOT / path).read_text(), re.M), (name, test)


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
