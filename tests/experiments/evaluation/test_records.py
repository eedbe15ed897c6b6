"""The evaluation's design, checked: the plain and fast engines give the same records, a committed records file
re-scores to its own numbers from its predictions alone, a task read from real text is one class, and a model
the fast engine does not take gets one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from experiments.evaluation import compare
from experiments.evaluation.engines import make_engine
from experiments.evaluation.metrics import METRICS, Metric, rescore
from experiments.evaluation.task import TASKS, DocsContinuation
from nanollm import load, preset
from nanollm.data.evaluate import MODES
from nanollm.data.tasks import docs_paragraphs
from nanollm.io.checkpoint import load_tokenizer
from nanollm.io.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = ROOT / "results" / "compare_default.json"


def assert_same_records(ours: list[dict], theirs: list[dict], keys: tuple[str, ...]) -> None:
    """Two engines' records of one run, row by row (``keys`` name the rows): the same answers and bytes, and
    KL, perturbation, lost mass and attention error within 1e-5."""
    assert [tuple(r[k] for k in keys) for r in ours] == [tuple(r[k] for k in keys) for r in theirs]
    for a, b in zip(ours, theirs):
        assert (a["accuracies"], a["predictions"], a["kv_bytes"], a["extra_bytes"]) == \
            (b["accuracies"], b["predictions"], b["kv_bytes"], b["extra_bytes"]), a["method"]
        for k in ("kl", "perturbation", "lost_mass"):
            assert a[k] == pytest.approx(b[k], abs=1e-5), (a["method"], k)
        assert torch.allclose(torch.tensor(a["attn_l1"]), torch.tensor(b["attn_l1"]), atol=1e-5)


@pytest.mark.slow
def test_the_plain_and_fast_engines_give_the_same_records():
    """``--engine plain`` against ``--engine fast`` (the default) on the bundled model, which is far from logit
    ties on its tasks: the same answers and bytes, and KL, perturbation, lost mass and attention error within
    1e-5 (the plain engine runs the model's own forward per cache, the fast one other products)."""
    torch.set_num_threads(1)
    model, tok, _ = load("retrieval-llama")
    kw = dict(methods=["h2o", "snapkv", "chunkkv"], budgets=[128], tasks=["niah_multikey"], modes=MODES,
              samples=2, length=512, progress=False)
    fast = compare.run(model, tok, compare.RunSpec(**kw))
    plain = compare.run(model, tok, compare.RunSpec(engine="plain", **kw))
    assert_same_records(fast, plain, ("method", "mode"))
    assert any(r["kl"] > 0.1 for r in fast) and len({tuple(r["accuracies"]) for r in fast}) > 1   # not vacuous


def test_a_committed_file_rescores_to_its_numbers():
    """results/compare_default.json keeps every greedy answer: scored again from the file alone (each sample
    made anew from its task, length and seed), they give the file's accuracies, record by record; a new
    answer-level metric needs no run of the model."""
    saved = json.loads(COMMITTED.read_text())
    records, seed = saved["records"], saved["provenance"]["seed"]
    tok = load_tokenizer("retrieval-llama")
    again = rescore(records, tok, seed)
    assert again == [r["accuracies"] for r in records]
    assert all(sum(a) / len(a) == pytest.approx(r["accuracy"]) for a, r in zip(again, records))
    assert 0 < sum(map(sum, again)) < sum(map(len, again))             # right and wrong answers both
    exact = Metric("exact", lambda f, m, task, s: float(m.prediction == s.target), answer=True)   # one of ours
    assert sum(map(sum, rescore(records, tok, seed, exact))) < sum(map(sum, again))
    with pytest.raises(ValueError, match="not the one the records were made from"):
        rescore([{**r, "seed": r["seed"] + 1} for r in records], tok, seed)    # other samples than the file's
    with pytest.raises(ValueError, match="reads the traces"):
        rescore(records, tok, seed, METRICS[1])


def test_a_task_read_from_text():
    """``DocsContinuation``: the quote and its answer come from the context, in order; the sample fits its
    length and is the same for the same seed; the scorer gives part of the score to part of the answer."""
    tok = Tokenizer.train(" ".join(docs_paragraphs()[:40]), 400)
    task = TASKS["docs_continuation"]
    assert isinstance(task, DocsContinuation)
    for seed in range(4):
        s = task.sample(tok, 300, seed)
        assert s.n_tokens <= 300 and task.sample(tok, 300, seed).question_ids == s.question_ids
        cue = s.question.split('"')[1]
        assert f"{cue} {s.answers[0]}" in " ".join(s.context.split())
        assert task.chunks(s, MODES[1]) == [s.context_ids, s.question_ids]
        assert task.score(s.target, s) == 1.0 and task.score(" nothing", s) == 0.0
        words = s.answers[0].split()
        assert task.score(" " + " ".join(words[:3]) + " and so on", s) == pytest.approx(3 / len(words))
    with pytest.raises(ValueError, match="too short"):
        task.sample(tok, 100, 0)


def test_compare_runs_a_task_read_from_text(make_model):
    torch.set_num_threads(1)
    model = make_model(preset("TINY"), seed=1)
    tok = Tokenizer.train(" ".join(docs_paragraphs()[:40]), 512)
    records = compare.run(model, tok, compare.RunSpec(["streaming_llm"], [64], ["docs_continuation"], MODES[:1], 2, 256,
                          progress=False))
    assert [r["method"] for r in records] == ["full", "streaming_llm"]
    assert all(len(r["predictions"]) == 2 and all(0 <= a <= 1 for a in r["accuracies"]) for r in records)
    names = {m.name for m in METRICS} | {m.keep for m in METRICS if m.keep}
    assert all(names <= set(r) for r in records)                        # every metric, in every record


def test_the_fast_engine_names_the_model_it_does_not_take(make_model):
    model = make_model(preset("TINY_GPT2"), seed=0)
    with pytest.raises(ValueError) as e:
        make_engine("fast", model)
    assert "--engine plain" in str(e.value) and "\n" not in str(e.value)
    assert make_engine("plain", model).name == "plain"


def test_a_rescore_hands_a_metric_the_ids_and_the_full_cache_s_answer():
    """What a live run hands an answer-level metric, rebuilt from the file: the answer's text and token ids,
    and the full cache's answer for the same sample (compare_default.json keeps no ids: they are the text
    encoded again, which for these answers gives the ids back)."""
    saved = json.loads(COMMITTED.read_text())
    records, seed = saved["records"], saved["provenance"]["seed"]
    tok = load_tokenizer("retrieval-llama")
    ids = Metric("ids", lambda f, m, task, s: float(tok.decode(m.prediction_ids) == m.prediction), answer=True)
    assert all(all(v == 1.0 for v in row) for row in rescore(records, tok, seed, ids))
    same = Metric("same", lambda f, m, task, s: float(m.prediction == f.prediction), answer=True)
    scored = rescore(records, tok, seed, same)
    assert all(all(v == 1.0 for v in row) for r, row in zip(records, scored) if r["method"] == "full")
    assert 0 < sum(map(sum, scored)) < sum(map(len, scored))          # methods answer otherwise, sometimes
