"""
The evaluation's commands against hostile sizes and files (issue 59): each ends in one ``error:`` line, exit
status 2, before any work.

* ``experiments.compare``: a ``--samples`` beyond its maximum or beyond the machine's memory; a ``--length`` its
  task cannot make (``docs_continuation`` at 64 tokens made 240-token samples).
* ``experiments.evaluation.throughput``: a ``--bandwidth-mib`` beyond the machine's memory.
* ``experiments.evaluation.rescore``: a results file tampered with in every field it reads, a file with no
  predictions, a file of another command; SIGTERM during a long rescore ends in ``error: interrupted``.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.evaluation import compare, rescore, task, throughput
from experiments.evaluation.metrics import rescore as rescore_records
from nanollm import cli
from nanollm.io.checkpoint import load_tokenizer
from tests.commands import refused
from tests.nanollm.cli.test_hostile_commands import no_work

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "results"
COMMITTED = RESULTS / "compare_default.json"


# ----------------------------------------------------------------------------------------------------------
# experiments.compare

def test_compare_refuses_a_sample_count_beyond_its_maximum(monkeypatch, capsys):
    """``--samples 1000000000000`` made a list of 10^12 jobs: a MemoryError traceback after 7 GB."""
    no_work(monkeypatch, compare, "run_main")
    err = refused(capsys, compare.main, ["--samples", "1000000000000", "--quiet"])
    assert "--samples" in err and f"at most {compare.MAX_SAMPLES}" in err, err
    with pytest.raises(SystemExit):
        compare.main(["--help"])
    assert f"at most {compare.MAX_SAMPLES}" in " ".join(capsys.readouterr().out.split())


def test_compare_refuses_samples_beyond_the_machine_s_memory(monkeypatch, capsys):
    no_work(monkeypatch, compare, "run_main")
    monkeypatch.setattr(cli, "machine_memory", lambda: 2**20)              # a machine of 1 MiB
    err = refused(capsys, compare.main, ["--samples", "100", "--quiet"])
    assert "--samples 100" in err and "GiB of memory" in err, err


def test_compare_refuses_a_length_its_task_cannot_make(monkeypatch, capsys):
    """``--tasks docs_continuation --length 64`` ran 240-token samples under a summary saying 64."""
    no_work(monkeypatch, compare, "run_main")
    err = refused(capsys, compare.main, ["--tasks", "docs_continuation", "--length", "64", "--quiet"])
    assert "--length 64" in err and "too short" in err and "docs_continuation" in err, err


def test_a_text_task_never_makes_a_sample_longer_than_asked():
    tok = load_tokenizer("retrieval-llama")
    made = 0
    for length in [1, 32, 64, 95, 96, 97, 150, 200, 230, 256, 300]:
        for seed in range(3):
            try:
                sample = task.TASKS["docs_continuation"].sample(tok, length, seed)
            except ValueError as e:
                assert "too short" in str(e)
                continue
            assert sample.n_tokens <= length, (length, seed, sample.n_tokens)
            made += 1
    assert made > 5                                                     # not vacuous


# ----------------------------------------------------------------------------------------------------------
# experiments.evaluation.throughput

def test_throughput_refuses_a_bandwidth_tensor_beyond_the_machine_s_memory(monkeypatch, capsys):
    """``--bandwidth-mib 1000000000000`` ended in a traceback from ``torch.ones``."""
    no_work(monkeypatch, throughput, "load", "run")
    err = refused(capsys, throughput.main, ["--checkpoint", "retrieval-llama", "--length", "256",
                                            "--bandwidth-mib", "1000000000000"])
    assert "--bandwidth-mib" in err and "memory" in err, err
    err = refused(capsys, throughput.main, ["--bandwidth-mib", "1e12"])
    assert "--bandwidth-mib" in err, err


# ----------------------------------------------------------------------------------------------------------
# experiments.evaluation.rescore

def tampered(data: dict, change) -> dict:
    change(data)
    return data


def set_in(record: int, field: str, value):
    return lambda d: d["records"][record].__setitem__(field, value)


def drop(record: int, field: str):
    return lambda d: d["records"][record].pop(field)


# (name, what is changed in a copy of results/compare_default.json, what the error line must say)
TAMPERINGS = [
    ("no predictions", drop(0, "predictions"), ["record 0", "'predictions'"]),
    ("predictions a string", set_in(0, "predictions", " 2577979"), ["record 0", "'predictions' must be a list"]),
    ("a prediction a number", lambda d: d["records"][3]["predictions"].__setitem__(0, 7),
     ["record 3", "'predictions'"]),
    ("no predictions at all", set_in(0, "predictions", []), ["record 0", "holds 0 answers"]),
    ("too many predictions", lambda d: d["records"][0].update(predictions=["1"] * 10_001, references=[["1"]] * 10_001),
     ["record 0", "holds 10001 answers"]),
    ("no references", drop(2, "references"), ["record 2", "'references'"]),
    ("references not lists", set_in(0, "references", ["2577979"] * 10), ["record 0", "list of lists of strings"]),
    ("a reference a number", lambda d: d["records"][0]["references"].__setitem__(1, [196238]),
     ["record 0", "list of lists of strings"]),
    ("one extra reference", lambda d: d["records"][0]["references"].append(["1"]),
     ["record 0", "10 predictions but 11 references"]),
    ("one prediction fewer", lambda d: d["records"][5]["predictions"].pop(),
     ["record 5", "9 predictions but 10 references"]),
    ("length a string", set_in(0, "length", "512"), ["record 0", "'length'"]),
    ("length 1e9", set_in(0, "length", 1e9), ["record 0", "'length'", "1024"]),
    ("length 10**9", set_in(0, "length", 10**9), ["record 0", "'length'", "1024"]),
    ("length 0", set_in(0, "length", 0), ["record 0", "'length'"]),
    ("length true", set_in(0, "length", True), ["record 0", "'length'"]),
    ("length too short for the task", set_in(0, "length", 40), ["record 0", "'length' 40", "too short"]),
    ("no length", drop(0, "length"), ["record 0", "'length'"]),
    ("unknown task", set_in(1, "task", "nope"), ["record 1", "'task'", "nope"]),
    ("task a list", set_in(1, "task", ["niah_multikey"]), ["record 1", "'task'"]),
    ("no task", drop(1, "task"), ["record 1", "'task'"]),
    ("unknown mode", set_in(0, "mode", "sideways"), ["record 0", "'mode'"]),
    ("method a number", set_in(0, "method", 5), ["record 0", "'method'"]),
    ("keep ratio a string", set_in(0, "keep_ratio", "0.5"), ["record 0", "'keep_ratio'"]),
    ("accuracy a string", set_in(0, "accuracy", "1.0"), ["record 0", "'accuracy'"]),
    ("accuracies too short", set_in(0, "accuracies", [1.0]), ["record 0", "'accuracies'"]),
    ("a record a string", lambda d: d["records"].__setitem__(4, "full"), ["record 4", "must be an object"]),
    ("records an object", lambda d: d.__setitem__("records", {"0": {}}), ["'records'"]),
    ("no records", lambda d: d.pop("records"), ["not a experiments.compare results file"]),
    ("prediction ids of another length", set_in(0, "prediction_ids", [[1]]), ["record 0", "'prediction_ids'"]),
    ("prediction ids strings", set_in(0, "prediction_ids", [["1"]] * 10), ["record 0", "'prediction_ids'"]),
    ("a record's seed a string", set_in(2, "seed", "0"), ["record 2", "'seed'"]),
    ("a task file not here", set_in(3, "task_file", "/nonexistent/tasks.jsonl"), ["record 3", "'task_file'"]),
    ("no provenance", lambda d: d.pop("provenance"), ["provenance"]),
    ("seed a string", lambda d: d["provenance"].__setitem__("seed", "0"), ["provenance.seed"]),
    ("seed a float", lambda d: d["provenance"].__setitem__("seed", 0.0), ["provenance.seed"]),
    ("no command", lambda d: d["provenance"].pop("command"), ["provenance.command"]),
    ("another command", lambda d: d["provenance"].__setitem__("command", "python -m experiments.evaluation.bench"),
     ["not a experiments.compare results file"]),
]


@pytest.fixture(scope="module")
def committed() -> str:
    return COMMITTED.read_text()


@pytest.mark.parametrize("name, change, expected", TAMPERINGS, ids=[t[0] for t in TAMPERINGS])
def test_a_tampered_results_file_is_refused_in_one_line(monkeypatch, capsys, tmp_path, committed, name, change,
                                                        expected):
    """Each of these ended in a KeyError, TypeError or AttributeError traceback, or was accepted silently (one
    extra reference, predictions as a string), or a length of 1e9 allocated GBs: now one line, before any work,
    naming the record and the field."""
    no_work(monkeypatch, rescore, "rescore")
    path = tmp_path / "compare_default.json"
    path.write_text(json.dumps(tampered(json.loads(committed), change)))
    err = refused(capsys, rescore.main, [str(path)])
    assert str(path) in err and all(e in err for e in expected), err


def test_a_file_that_is_no_object_is_refused(monkeypatch, capsys, tmp_path, committed):
    no_work(monkeypatch, rescore, "rescore")
    path = tmp_path / "list.json"
    path.write_text(json.dumps(json.loads(committed)["records"]))
    err = refused(capsys, rescore.main, [str(path)])
    assert "not a experiments.compare results file" in err, err


def test_a_file_without_predictions_is_refused_so(monkeypatch, capsys, tmp_path):
    """A results file written before the records kept every answer (the committed ones were re-run since)."""
    no_work(monkeypatch, rescore, "rescore", "load_tokenizer")
    saved = json.loads(COMMITTED.read_text())
    for r in saved["records"]:
        del r["predictions"]
    (tmp_path / "old.json").write_text(json.dumps(saved))
    err = refused(capsys, rescore.main, [str(tmp_path / "old.json")])
    assert "old.json" in err and "no predictions" in err, err


@pytest.mark.parametrize("name", ["kvreviver_ablation.json", "methods_bench_1thread.json", "timings.json"])
def test_a_results_file_of_another_command_is_refused(monkeypatch, capsys, name):
    no_work(monkeypatch, rescore, "rescore", "load_tokenizer")
    err = refused(capsys, rescore.main, [str(RESULTS / name)])
    assert name in err and "not a experiments.compare results file" in err, err


def test_rescore_does_not_write_over_its_input(monkeypatch, capsys, tmp_path):
    no_work(monkeypatch, rescore, "rescore", "read_json")
    path = shutil.copy(COMMITTED, tmp_path / "r.json")
    err = refused(capsys, rescore.main, [str(path), "--json", str(path)])
    assert "--json" in err and "reads" in err, err


def test_a_metric_of_ones_own_is_module_colon_function_checked_before_any_work(capsys, tmp_path, monkeypatch):
    # No edit of the project: a function in a file of one's own, fn(prediction, answers) -> a number, named
    # MODULE:FUNCTION; one that cannot be imported or breaks the contract is one line before the model loads.
    (tmp_path / "mine.py").write_text("def first_word(prediction, answers):\n"
                                      "    return float(prediction.split()[:1] == answers[0].split()[:1])\n"
                                      "def broken(prediction, answers):\n    return 'yes'\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "mine.json"
    rescore.main([str(COMMITTED), "--metric", "accuracy", "mine:first_word", "--json", str(out)])
    assert "mine:first_word: not stored in the file" in capsys.readouterr().out
    rows = json.loads(out.read_text())["records"]
    assert all(0.0 <= r["mine:first_word"] <= 1.0 for r in rows) and any(r["mine:first_word"] > 0 for r in rows)
    for spec, said in [("mine:broken", "returned 'yes', not a finite number"), ("mine:nope", "cannot import it"),
                       ("nothing", "is not a metric")]:
        err = refused(capsys, rescore.main, [str(COMMITTED), "--metric", spec])
        assert said in err and len(err.strip().splitlines()) == 1, err


def test_rescore_gives_the_committed_numbers_back(capsys, tmp_path):
    out = tmp_path / "rescored.json"
    rescore.main([str(COMMITTED), "--metric", "accuracy", "exact_match", "--json", str(out)])
    text = capsys.readouterr().out
    assert "accuracy: the same as stored in 300 of 300 records" in text
    assert "exact_match: not stored in the file" in text and "differs" not in text
    saved, again = json.loads(COMMITTED.read_text()), json.loads(out.read_text())
    assert again["provenance"]["seed"] == saved["provenance"]["seed"] == 0
    assert [r["accuracy_each"] for r in again["records"]] == [r["accuracies"] for r in saved["records"]]


def compare_files() -> list[str]:
    """The committed results files experiments.compare wrote (their provenance says so)."""
    names = []
    for path in sorted(RESULTS.glob("*.json")):
        saved = json.loads(path.read_text())
        command = saved.get("provenance", {}).get("command", "") if isinstance(saved, dict) else ""
        if command.startswith("python -m experiments.compare "):
            names.append(path.name)
    return names


@pytest.mark.slow
@pytest.mark.parametrize("name", compare_files())
def test_every_committed_compare_file_rescores_to_its_numbers(capsys, tmp_path, name):
    """Each results file of experiments.compare keeps its answers, and the command scores them again, from the
    file and the tokenizer alone, to the accuracy every record stores."""
    saved = json.loads((RESULTS / name).read_text())
    checkpoint = saved["records"][0]["checkpoint"]
    try:
        load_tokenizer(checkpoint)
    except (OSError, ValueError) as e:
        pytest.skip(f"{checkpoint} is not here ({e})")
    rescore.main([str(RESULTS / name), "--metric", "accuracy", "--json", str(tmp_path / "again.json")])
    n = len(saved["records"])
    assert f"accuracy: the same as stored in {n} of {n} records" in capsys.readouterr().out


def test_the_library_refuses_a_record_with_an_extra_reference():
    saved = json.loads(COMMITTED.read_text())
    record = saved["records"][0]
    record["references"].append(["1"])
    with pytest.raises(ValueError, match="10 predictions but 11 references"):
        rescore_records([record], load_tokenizer("retrieval-llama"), 0)


SLOW_SAMPLES = """
import sys, time
from experiments.evaluation import rescore, task
made = task.Task.sample
def slowly(self, *args):                       # a long rescore: each sample takes 0.3 s to make
    time.sleep(0.3)
    return made(self, *args)
task.Task.sample = slowly
rescore.main(sys.argv[1:])
"""


def test_sigterm_during_the_rescore_ends_in_one_line(monkeypatch, capsys):
    """SIGTERM once the work has started (sent here by the work itself, so at a known point): the one line
    ``error: interrupted``, exit status 130."""
    work = rescore.rescore

    def terminated_meanwhile(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)
        return work(*args, **kwargs)
    monkeypatch.setattr(rescore, "rescore", terminated_meanwhile)
    with pytest.raises(SystemExit) as e:
        rescore.main([str(COMMITTED)])
    assert e.value.code == 130 and capsys.readouterr().err == "error: interrupted\n"


@pytest.mark.slow
def test_sigterm_during_a_long_rescore_ends_in_one_line():
    """The same from outside, as ``kill`` sends it, to a rescore slowed to 0.3 s a sample."""
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAMPLES, str(COMMITTED)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline()                   # the work has started
        assert line.startswith("# rescoring"), line
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err == "error: interrupted\n", (proc.returncode, err)


def test_rescore_documents_its_metrics(capsys):
    with pytest.raises(SystemExit):
        rescore.main(["--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in rescore.SCORES) and "--json" in text
