"""Runs that say when they are degenerate: a full cache below ``report.DEGENERATE`` flags its cell's records
and prints a warning; no method is "best" among answers all wrong; every metric of ``METRICS`` that the
tables leave out is named in one line."""

from __future__ import annotations

import pytest

from experiments.evaluation import report
from experiments.evaluation.metrics import METRICS, Metric


def record(method: str, task: str, accuracies: list[float], ratio: float | None = 0.25) -> dict:
    return {"method": method, "budget": None if method == "full" else 64, "keep_ratio": 1.0 if method == "full"
            else ratio, "task": task, "mode": "question_in_prompt", "length": 256, "accuracies": accuracies,
            "accuracy": sum(accuracies) / len(accuracies), "kl": 0.1, "perturbation": 0.1, "lost_mass": 0.1,
            "kv_bytes": 1024, "decode_ms_per_token": 1.0}


def test_a_full_cache_below_the_threshold_flags_its_cell_and_warns():
    records = [record("full", "passkey", [0, 0, 0, 0]), record("snapkv", "passkey", [0, 0, 0, 0]),
               record("full", "vt", [1, 1, 0, 1]), record("snapkv", "vt", [1, 0, 0, 1])]
    lines = report.flag_degenerate(records)
    assert [r["degenerate"] for r in records] == [True, True, False, False]
    assert len(lines) == 1 and "0.00 on passkey [question_in_prompt]" in lines[0] and "below 0.1" in lines[0]
    assert report.degenerate_cells([record("full", "vt", [1] + [0] * 10)]) != {}          # 0.09 is below 0.1
    assert report.degenerate_cells([record("full", "vt", [1] + [0] * 9)]) == {}           # 0.1 is not


def test_no_best_among_methods_that_answer_nothing_right():
    zero = [record("full", "passkey", [1, 1, 1, 1])] + \
        [record(m, "passkey", [0, 0, 0, 0]) for m in ("h2o", "snapkv", "streaming_llm")]
    assert report.versus_best(zero, "question_in_prompt") == {}
    text = report.format_intervals(zero)
    assert "no best, every method answers nothing right" in text and "best streaming_llm" not in text
    some = zero[:2] + [record("snapkv", "passkey", [1, 0, 0, 0])]
    assert report.versus_best(some, "question_in_prompt")[("snapkv", 0.25)] == "best"


def test_every_metric_the_tables_leave_out_is_named(monkeypatch):
    line = report.json_only()
    shown = report.SHOWN
    assert all((m.name in line) != (m.name in shown) for m in METRICS)
    monkeypatch.setattr(report, "METRICS", METRICS + [Metric("mine", lambda f, m, t, s: 0.0)])
    assert report.json_only().endswith(", mine")
    assert shown <= {m.name for m in METRICS}                   # the tables show metrics that exist


@pytest.mark.parametrize("name", sorted(report.SHOWN))
def test_the_tables_show_what_they_say_they_show(name):
    header = report.format_tables([record("full", "vt", [1, 1]), record("snapkv", "vt", [1, 0])])
    column = {"accuracy": "mean acc", "kl": "KL", "perturbation": "pert", "lost_mass": "lost",
              "kv_bytes": "KV KiB", "decode_ms_per_token": "step ms"}[name]
    assert column in header


def test_the_quiet_summary_gives_the_full_cache_s_accuracy_and_few_answers_no_verdict():
    """``--quiet`` says what the full cache scores in each mode (what the methods can keep at best); a
    difference from the full cache over fewer than ``MIN_PAIRED`` answers prints its interval, no verdict; a
    metric of one's own is not headed "acc"."""
    few = [record("full", "passkey", [1, 0]), record("snapkv", "passkey", [0, 0]), record("h2o", "passkey", [0, 0])]
    summary = report.format_summary(few)
    assert summary.splitlines()[0] == "[question_in_prompt] full cache: mean accuracy 0.50 over its tasks"
    assert "no best, every method answers nothing right" in summary
    text = report.format_intervals(few)
    assert "no verdict: 2 answer(s) in a task, under 10" in text and "lower" not in text
    many = [record("full", "passkey", [1] * 10), record("snapkv", "passkey", [0] * 10)]
    assert report.format_intervals(many).rstrip().splitlines()[-2].endswith("lower")
    assert "keep 0.25: snapkv (0.00), the only method" in report.format_summary(many)     # alone at its keep
    # ten answers in all, one in each task: the bootstrap resamples each task apart, so no verdict either
    tasks = [f"task{i}" for i in range(10)]
    spread = [record("full", t, [1]) for t in tasks] + [record("snapkv", t, [0 if t == "task0" else 1]) for t in tasks]
    assert "no verdict: 1 answer(s) in a task, under 10" in report.format_intervals(spread)
    assert "mean acc" not in report.format_intervals(few, "my:metric").splitlines()[2]
