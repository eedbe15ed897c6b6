"""Language modelling under compression: the scored positions, the two protocols, exactness at a covering
budget, and the command's errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from experiments.evaluation.language_modelling import decodes_as_it_goes, main, run, text_ids
from methods import METHODS
from nanollm import preset
from nanollm.data.tasks import corpus
from nanollm.io import checkpoint
from nanollm.io.tokenizer import Tokenizer

LENGTH = 96


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, make_model):
    tok = Tokenizer.train(corpus(30_000, seed=0), 400)
    model = make_model(preset("TINY"), seed=2)
    folder = tmp_path_factory.mktemp("lm")
    checkpoint.save(model, tok, folder, card={"name": "tiny-random"})
    return folder


@pytest.fixture(scope="module")
def loaded(ckpt):
    return checkpoint.load(ckpt)


def test_which_methods_evict_as_they_go():
    assert [m for m in METHODS if m != "full" and decodes_as_it_goes(m)] == \
        ["streaming_llm", "h2o", "kvreviver", "scissorhands"]
    assert decodes_as_it_goes("adakv(h2o)") and not decodes_as_it_goes("chunkkv(snapkv)")


def test_full_cache_perplexity_is_the_uncached_forward_on_the_second_half(loaded):
    """Scoring the right positions: the full cache's perplexity equals one uncached forward pass's over
    the predictions of positions LENGTH // 2 + 1 .. LENGTH - 1."""
    model, tok, _ = loaded
    ids = text_ids(tok, LENGTH)
    (full,) = run(model, tok, ["full"], [0.5], LENGTH, progress=False)
    logp = F.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)           # (T, V)
    half = LENGTH // 2
    nll = -torch.stack([logp[p - 1, ids[p]] for p in range(half + 1, LENGTH)]).mean().item()
    assert full["scored_tokens"] == LENGTH - 1 - half
    assert full["perplexity"] == pytest.approx(math.exp(nll), rel=1e-4)
    assert full["kl"] == 0 and full["top1_agreement"] == 1 and full["ppl_ratio"] == 1


def test_every_method_is_the_full_cache_at_a_covering_budget(loaded):
    model, tok, _ = loaded
    records = run(model, tok, list(METHODS), [2.0], LENGTH, progress=False)       # budget = LENGTH
    full = next(r for r in records if r["method"] == "full")
    assert len(records) == len(METHODS)
    for r in records:
        assert r["kl"] == 0 and r["perplexity"] == full["perplexity"] and r["top1_agreement"] == 1, r["method"]


def test_protocols_budgets_and_determinism(loaded):
    model, tok, _ = loaded
    methods = ["full", "h2o", "streaming_llm", "snapkv", "chunkkv"]
    a = run(model, tok, methods, [0.25, 0.5], LENGTH, progress=False)
    assert a == run(model, tok, methods, [0.25, 0.5], LENGTH, progress=False)
    half = LENGTH // 2
    for r in a:
        if r["method"] == "full":
            continue
        budget = round(r["keep_ratio"] * half)
        assert r["budget"] == budget
        if r["protocol"] == "decode":       # holds its budget through the scored half
            assert r["cache_at_end"] == budget
        else:                               # the prefix compressed, then every scored token kept
            assert r["protocol"] == "prompt" and r["cache_at_end"] == budget + LENGTH - 1 - half
        assert r["kl"] > 0 and 0 <= r["top1_agreement"] <= 1


@pytest.mark.parametrize("argv, message", [
    (["--keep-ratios", "0"], "--keep-ratios must lie in (0, 1]"),
    (["--methods", "nope"], "unknown method"),
    (["--length", "100000"], "--length must be in"),
])
def test_cli_errors(ckpt, argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(ckpt), *argv])
    assert message in capsys.readouterr().err


def test_cli_writes_table_and_json(ckpt, tmp_path, capsys):
    out = tmp_path / "lm.json"
    main(["--checkpoint", str(ckpt), "--methods", "h2o", "snapkv", "--keep-ratios", "0.5", "--length", "64",
          "--json", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert "ppl/full" in text and "h2o" in text and out.stat().st_size > 0
