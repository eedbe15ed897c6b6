"""A metric of one's own, MODULE:FUNCTION, in the main job as in rescore (issue 97 item 4): checked before any
work, every answer scored after the run, the records keeping the mean and each sample's value, and the report
giving it the main job's intervals and exact paired tests; rescore prints the same for what it rescores."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.evaluation import compare, rescore
from tests.commands import refused

ROOT = Path(__file__).resolve().parents[3]
MINE = ("def first_word(prediction, answers):\n"
        "    return float(prediction.split()[:1] == answers[0].split()[:1])\n"
        "def loud(prediction, answers):\n    return 2.0\n"
        "def broken(prediction, answers):\n    return 'yes'\n")


def test_the_main_job_scores_its_answers_with_a_metric_of_one_s_own(tmp_path, capsys, monkeypatch):
    (tmp_path / "scorers_of_mine.py").write_text(MINE)   # a name no other test imports
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run.json"
    compare.main(["--methods", "snapkv", "--keep-ratios", "0.5", "--tasks", "niah_multikey", "--samples", "2",
                  "--workers", "1", "--metric", "scorers_of_mine:first_word", "scorers_of_mine:loud",
                  "--json", str(out)])
    printed = capsys.readouterr().out
    assert "# scorers_of_mine:first_word: intervals and exact paired tests" in printed
    assert "# scorers_of_mine:loud: values outside [0, 1], so no intervals" in printed
    for r in json.loads(out.read_text())["records"]:
        assert len(r["scorers_of_mine:first_word_each"]) == r["n_samples"] == 2
        assert r["scorers_of_mine:loud"] == 2.0
        assert r["scorers_of_mine:first_word"] == sum(r["scorers_of_mine:first_word_each"]) / 2


def test_a_metric_that_breaks_its_contract_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    (tmp_path / "scorers_of_mine.py").write_text(MINE)   # a name no other test imports
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compare, "load_config", lambda *a: (_ for _ in ()).throw(AssertionError("loaded")))
    for spec, said in [("scorers_of_mine:broken", "returned 'yes', not a finite number"),
                       ("scorers_of_mine:nope", "cannot import it")]:
        err = refused(capsys, compare.main, ["--metric", spec, "--quiet"])
        assert said in err, err


def test_rescore_prints_the_main_job_s_intervals_for_what_it_rescores(capsys):
    rescore.main([str(ROOT / "results" / "compare_default.json"), "--metric", "exact_match"])
    printed = capsys.readouterr().out
    assert "# exact_match: intervals and exact paired tests as for the accuracy" in printed
    assert "95% Wilson interval" in printed and "exact paired tests over" in printed
