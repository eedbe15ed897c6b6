"""A task read from a file (``task_file.py``): the committed example, exported from a built-in task, runs as
that task does (the same answers and scores, both modes); a context too long is cut in its middle; every bad
item is one line naming its line; the file travels to worker processes as its path and is refused if it
changed; ``--task-file`` on ``experiments.compare`` checks its items against ``--samples`` before any work."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch

from experiments.evaluation import compare, rescore, task_file
from experiments.evaluation.task import TASKS, Task
from experiments.evaluation.task_file import SCORERS, FileTask, export, read_items
from nanollm.data.evaluate import MODES

EXAMPLE = Path(__file__).resolve().parents[3] / "experiments" / "evaluation" / "examples" / "niah_single_noise.jsonl"


def test_the_example_file_is_the_built_in_task_s_export(bundled):
    """The committed example is what ``python -m experiments.evaluation.task_file niah_single_noise`` writes."""
    model, tok, _ = bundled
    lines = [json.dumps(item) + "\n" for item in export(TASKS["niah_single_noise"], model, tok, 512, range(8))]
    assert EXAMPLE.read_text() == "".join(lines)


def test_a_file_task_runs_as_the_built_in_task_it_was_exported_from(bundled):
    model, tok, _ = bundled
    torch.set_num_threads(1)
    kw = dict(methods=["snapkv", "streaming_llm"], budgets=[64], modes=MODES, samples=2, length=512,
              progress=False, engine="plain")
    built_in = compare.run(model, tok, compare.RunSpec(tasks=["niah_single_noise"], **kw))
    from_file = compare.run(model, tok, compare.RunSpec(tasks=[FileTask(EXAMPLE)], **kw))
    assert [r["task"] for r in from_file] == ["file:niah_single_noise"] * len(built_in)
    timed = {"task", "compress_ms", "decode_ms_per_token"}                # the name, and two clock readings
    for a, b in zip(built_in, from_file):
        assert {k: v for k, v in a.items() if k not in timed} == {k: v for k, v in b.items() if k not in timed}
    assert len({tuple(r["accuracies"]) for r in built_in}) > 1            # the methods differ: not vacuous


def write(tmp_path: Path, *items, name: str = "mine.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((i if isinstance(i, str) else json.dumps(i)) + "\n" for i in items))
    return path


GOOD = {"context": "The capital of France is Paris. " * 3, "question": "What is the capital of France?",
        "answers": ["Paris"]}


@pytest.mark.parametrize("bad, message", [
    ("{not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: an item is a JSON object"),
    ({"context": "x", "answers": ["a"]}, "line 2: no 'question'"),
    ({"context": "x", "question": "q", "answer": "Paris"}, "line 2: no 'answers'"),   # a misspelt field: missing
    (GOOD | {"id": 1.5}, "line 2: 'id' is a str or int, not float"),
    (GOOD | {"answers": "Paris"}, "line 2: 'answers' is a list, not str"),
    (GOOD | {"answers": []}, "line 2: 'answers' is a list of one or more non-empty strings"),
    (GOOD | {"scorer": "rouge"}, "line 2: unknown scorer 'rouge'"),
    (GOOD | {"answer_tokens": True}, "line 2: 'answer_tokens' is a int, not bool"),
    (GOOD | {"answer_tokens": 0}, "line 2: 'answer_tokens' is from 1 to 4096"),
    (GOOD | {"question": ""}, "line 2: 'question' is empty"),                # passed, then a 67-line traceback
    (GOOD | {"context": " \n\t"}, "line 2: 'context' is empty"),
])
def test_a_bad_item_is_one_line_naming_its_line(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        read_items(write(tmp_path, GOOD, bad))


def test_ids_are_kept_other_fields_are_metadata_and_all_takes_every_item(tmp_path, capsys):
    # A benchmark's rows keep their own fields (they were fatal: "unknown field 'id'"): an id is kept in every
    # record, the other fields are listed once and not read; --samples all takes every item of the file.
    rows = [GOOD | {"id": f"q{i}", "_id": f"lb-{i}", "dataset": "hotpotqa"} for i in range(3)]
    with pytest.raises(ValueError, match="id 'q1' names more than one item"):
        read_items(write(tmp_path, *rows, rows[1]))
    path = write(tmp_path, *rows, name="bench.jsonl")
    assert task_file.metadata(read_items(path)) == ["_id", "dataset"]
    out = tmp_path / "run.json"
    compare.main(["--task-file", str(path), "--samples", "all", "--seed", "1", "--methods", "snapkv", "--keep-ratios",
                  "0.5", "--workers", "1", "--quiet", "--json", str(out)])
    assert "file:bench: fields kept as metadata, not read: _id, dataset" in capsys.readouterr().err
    records = json.loads(out.read_text())["records"]
    assert all(r["n_samples"] == 2 and r["item_ids"] == ["q1", "q2"] for r in records)
    with pytest.raises(SystemExit):
        compare.main(["--tasks", "passkey", "--task-file", str(path), "--samples", "all", "--methods", "snapkv"])
    assert "--samples all takes every item of the --task-file files" in capsys.readouterr().err


def test_a_byte_that_is_not_utf8_is_named_with_its_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    latin1 = b'{"context": "caf\xe9", "question": "q", "answers": ["a"]}\n'                 # byte 17: an e-acute
    path.write_bytes((json.dumps(GOOD) + "\n").encode() + latin1)
    with pytest.raises(ValueError, match=rf"{path}, line 2: not UTF-8 \(byte 0xe9 at column 17\)"):
        read_items(path)


def test_a_long_context_is_cut_in_its_middle_and_scorers_and_lengths_follow_the_item(bundled, tmp_path):
    model, tok, _ = bundled
    long = {"context": " ".join(f"w{i}" for i in range(400)), "question": " Which word comes first?",
            "answers": ["w0", "first"], "scorer": "string_match_part", "answer_tokens": 5}
    with pytest.raises(ValueError, match="line 1's context is .* tokens and .* fit in --length 128.*--truncate"):
        FileTask(write(tmp_path, long, GOOD)).sample(tok, 128, seed=0)      # refused unless a cut is asked for
    task = FileTask(write(tmp_path, long, GOOD), "middle")
    s = task.sample(tok, 128, seed=0)
    full = tok.encode(long["context"])
    room = 128 - len(s.question_ids) - len(s.target_ids)
    assert s.context_ids == full[:room // 2] + full[len(full) - (room - room // 2):] and s.n_tokens == 128
    assert s.target == " w0" and task.answer_length(model, s) == 5
    assert task.score("it is w0", s) == 1.0 and task.score("no", s) == 0.0          # any reference: part
    g = task.sample(tok, 128, seed=1)
    assert g.context_ids == tok.encode(GOOD["context"]) and task.answer_length(model, g) == len(g.target_ids) + 8
    assert task.score("Paris", g) == SCORERS["string_match_all"]("Paris", ["Paris"]) == 1.0
    with pytest.raises(ValueError, match="holds 2 items; sample 2"):
        task.sample(tok, 128, seed=2)


def test_a_cut_is_refused_before_any_work_or_said_and_recorded(tmp_path, capsys, monkeypatch):
    # A context longer than --length allows: refused in one line before the model loads (12 of 12 answers were
    # cut away in silence before --truncate); cut on request, the run says how many items and which lost
    # every answer, and the records keep each cut item's token counts.
    filler = " ".join(["The harbour was grey that day."] * 150)
    items = [{"context": f"The secret city is Lima{i}. " + filler * (i + 1), "question": " Which is the secret city?",
              "answers": [f"Lima{i}"], **({"id": "third"} if i == 2 else {})} for i in range(3)] + [GOOD]
    path = write(tmp_path, *items)
    base = ["--task-file", str(path), "--samples", "4", "--methods", "snapkv", "--keep-ratios", "0.5", "--workers",
            "1", "--quiet"]
    with monkeypatch.context() as m:
        m.setattr(compare, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
        with pytest.raises(SystemExit):
            compare.main(base)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "3 of 4 items have a context longer than --length allows" in err, err
    assert "the longest, line 3 (id 'third')" in err and "--truncate middle or left cuts them, or raise" in err
    with pytest.raises(SystemExit):                       # --length at the model's most: raising it cannot help
        compare.main(base + ["--length", "1024"])
    assert "cuts them (--length 1024 is already the model's most)" in capsys.readouterr().err
    for mode, lost in [("middle", []), ("left", [0, 1, 2])]:          # the left cut drops each item's opening
        out = tmp_path / f"{mode}.json"
        compare.main(base + ["--truncate", mode, "--json", str(out)])
        printed = capsys.readouterr()
        said = printed.err
        assert f"file:mine: 3 of 4 items cut to fit --length 512 (--truncate {mode})" in said, said
        assert f"note: file:mine: 3 of 4 items were cut to fit --length 512 (--truncate {mode})" + \
            (f", {len(lost)} of them losing every answer" if lost else "") in printed.out   # beside the results
        named = ", ".join(f"line {i + 1}" + (" (id 'third')" if i == 2 else "") for i in lost)
        assert (f"took every answer out of the prompt of {named}" in said) == bool(lost), said
        records = json.loads(out.read_text())["records"]
        cuts = records[0]["cuts"]
        assert all(r["truncate"] == mode and r["cuts"] == cuts for r in records)
        assert [c["item"] for c in cuts] == [0, 1, 2] and all(c["context_tokens"] > c["kept_tokens"] for c in cuts)
        assert [c["item"] for c in cuts if not c["answers_kept"]] == lost


def test_a_file_task_pickles_as_its_path_and_refuses_a_changed_file(tmp_path):
    path = write(tmp_path, GOOD)
    task = FileTask(path)
    blob = pickle.dumps(task)
    assert b"capital" not in blob and pickle.loads(blob).items == task.items
    path.write_text(json.dumps(GOOD | {"answers": ["Lyon"]}) + "\n")
    task_file._ITEMS.clear()                           # as in a worker process, which reads the file itself
    with pytest.raises(ValueError, match="changed since the run began"):
        pickle.loads(blob).items


def test_a_code_task_without_an_answer_length_is_refused(bundled):
    model, tok, _ = bundled

    class Mine(Task):
        def sample(self, tok, length, seed):
            return TASKS["passkey"].sample(tok, length, seed)

    with pytest.raises(ValueError, match="set answer_tokens on its class"):
        Mine("mine").answer_length(model, Mine("mine").sample(tok, 256, 0))
    Mine.answer_tokens = 12
    assert Mine("mine").answer_length(model, Mine("mine").sample(tok, 256, 0)) == 12


def test_compare_checks_the_file_against_samples_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compare.main(["--task-file", str(EXAMPLE), "--samples", "9", "--methods", "snapkv"])
    err = capsys.readouterr().err
    assert "asks for items 0 to 8" in err and "which holds 8" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit):
        compare.main(["--task-file", str(write(tmp_path, "{oops")), "--methods", "snapkv"])
    assert "--task-file" in capsys.readouterr().err


def test_a_file_task_s_results_rescore_from_the_file_they_name(tmp_path, capsys):
    out = tmp_path / "run.json"
    compare.main(["--task-file", str(EXAMPLE), "--samples", "2", "--methods", "snapkv", "--keep-ratios", "0.25",
                  "--length", "512", "--workers", "1", "--quiet", "--json", str(out)])
    records = json.loads(out.read_text())["records"]
    assert {(r["task"], r["task_file"], r["seed"], r["engine"]) for r in records} == \
        {("file:niah_single_noise", str(EXAMPLE), 0, "fast")}
    assert all(len(r["prediction_ids"]) == 2 for r in records)
    capsys.readouterr()
    rescore.main([str(out), "--metric", "accuracy", "answer_tokens", "same_as_full"])
    assert "accuracy: the same as stored in 4 of 4 records" in capsys.readouterr().out     # both modes
    data = json.loads(out.read_text())
    data["records"][0]["task_file_sha256"] = "0" * 64                  # another file than the run read
    out.write_text(json.dumps(data))
    with pytest.raises(SystemExit):
        rescore.main([str(out)])
    assert "differ from it: give it with --task-file PATH" in capsys.readouterr().err


def test_results_travel_with_their_task_file_and_exact_match_means_any_reference(tmp_path, capsys, monkeypatch):
    # A run made with a relative path, its results and task file moved to another folder: rescore finds the
    # file beside the results by its SHA-256, or where --task-file says; a different file is refused in one
    # line. exact_match has one meaning, the task files' (any reference); target_match is the other.
    here = tmp_path / "run"
    here.mkdir()
    write(here, GOOD | {"answers": ["Paris", "Lyon"]}, GOOD, name="two.jsonl")
    monkeypatch.chdir(here)
    compare.main(["--task-file", "two.jsonl", "--samples", "2", "--methods", "snapkv", "--keep-ratios", "0.5",
                  "--workers", "1", "--quiet", "--json", "out.json"])
    ran = json.loads((here / "out.json").read_text())["run"]           # the file names what ran, exactly
    from nanollm.io.checkpoint import resolve
    weights = resolve("retrieval-llama") / "model.safetensors"
    assert ran == {"engine": "fast", "weights_sha256": {"model.safetensors": hashlib.sha256(
        weights.read_bytes()).hexdigest()}}
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / "out.json").write_text((here / "out.json").read_text())
    (moved / "two.jsonl").write_text((here / "two.jsonl").read_text())
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    rescore.main([str(moved / "out.json"), "--metric", "accuracy", "exact_match", "target_match"])
    assert "differs" not in capsys.readouterr().out
    (moved / "two.jsonl").unlink()
    other = write(tmp_path, GOOD, name="other.jsonl")
    with pytest.raises(SystemExit):
        rescore.main([str(moved / "out.json"), "--task-file", str(other)])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'task_file' two.jsonl" in err and "differ from it" in err, err
    rescore.main([str(moved / "out.json"), "--task-file", str(here / "two.jsonl")])
    scores = {m.name: m for m in [rescore.SCORES["exact_match"], rescore.SCORES["target_match"]]}
    sample = type("S", (), {"answers": ["Lima", "Oslo"], "target": " Lima"})()
    answer = type("M", (), {"prediction": " Oslo"})()
    assert scores["exact_match"].value(None, answer, None, sample) == 1.0
    assert scores["target_match"].value(None, answer, None, sample) == 0.0
    assert task_file.exact_match(" Oslo", ["Lima", "Oslo"]) == 1.0



def test_rescore_names_the_checkpoint_it_needs_and_refuses_other_weights(tmp_path, capsys, monkeypatch):
    # A run on a checkpoint named by a relative path, rescored from another folder: one line saying that the
    # run's checkpoint is not there and that --checkpoint gives it; --checkpoint of other weights (the same
    # tokenizer, one weight changed) is refused, as the file keeps the run's weights' SHA-256.
    from nanollm.io import checkpoint
    model, tok, card = checkpoint.load("retrieval-llama")
    here = tmp_path / "run"
    checkpoint.save(model, tok, here / "model", card=card)
    write(here, GOOD, GOOD, name="two.jsonl")
    monkeypatch.chdir(here)
    compare.main(["--checkpoint", "model", "--task-file", "two.jsonl", "--samples", "2", "--methods", "snapkv",
                  "--keep-ratios", "0.5", "--workers", "1", "--quiet", "--json", "out.json"])
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        rescore.main([str(here / "out.json")])
    err = capsys.readouterr().err.strip()
    assert err.endswith("the run's checkpoint 'model' (as its command named it) is not here: give it with "
                        "--checkpoint PATH") and len(err.splitlines()) == 1, err
    with torch.no_grad():
        model.blocks[0].attn.q_proj.weight[0, 0] += 1.0
    checkpoint.save(model, tok, tmp_path / "other", card=card)
    with pytest.raises(SystemExit):
        rescore.main([str(here / "out.json"), "--checkpoint", str(tmp_path / "other")])
    assert "not the weights the run used" in capsys.readouterr().err
    rescore.main([str(here / "out.json"), "--checkpoint", str(here / "model"), "--metric", "accuracy",
                  "answer_tokens"])
    out = capsys.readouterr().out
    assert "accuracy: the same as stored in 4 of 4 records" in out and " answer_tokens stored" in out
