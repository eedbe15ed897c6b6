"""Match3 (methods/tensor_attention/match3.py): the labels, the bundled tensor / standard models, the command line."""

import itertools
import random

import pytest
import torch

from methods.tensor_attention import LAYOUTS, match3


def brute_force(xs, m):
    return [match3.YES if any((xs[a] + xs[b] + xs[i]) % m == 0
                              for a, b in itertools.combinations_with_replacement(range(i + 1), 2))
            else match3.NO for i in range(len(xs))]


def test_labels_are_the_definition():
    rng = random.Random(0)
    for _ in range(200):
        xs = match3.random_numbers(rng.randrange(1, 14), rng)
        assert match3.labels(xs) == brute_force(xs, match3.M)
    assert match3.labels([0]) == [match3.YES]                  # 0 + 0 + 0: a = b = i counts
    assert match3.labels([1, 30]) == [match3.NO, match3.YES]   # 1 + 1 + 30 = 32


def test_batch_supervises_the_label_after_each_number():
    ids, targets = match3.batch(5, 7, seed=1)
    assert ids.shape == targets.shape == (5, 15)
    assert (ids[:, 0] == match3.BOS).all()
    for row, tgt in zip(ids.tolist(), targets.tolist()):
        xs = row[1::2]
        assert row[2::2] == match3.labels(xs)
        assert tgt[1::2] == match3.labels(xs) and set(tgt[0::2]) == {-100}


def test_models_have_the_same_size():
    from nanollm.model import Transformer
    a, b = (Transformer(match3.model_config(k)).num_params() for k in ("tensor", "standard"))
    assert abs(a - b) / a < 2e-3
    with pytest.raises(ValueError, match="attention must be 'tensor' or 'standard'"):
        match3.model_config("linear")


@pytest.fixture(scope="module")
def match3_models():
    return {k: match3.load(f"match3-{k}") for k in ("tensor", "standard")}


@pytest.mark.slow
@pytest.mark.heavy                       # a re-run of committed results: with --runheavy
def test_bundled_cards_reproduce(match3_models):
    """The cards' numbers come from ``evaluate`` with its defaults: measuring again gives them back."""
    for model, card in match3_models.values():
        r = match3.evaluate(model)
        assert abs(r["accuracy"] - card["accuracy"]) < 2e-3
        assert abs(r["greedy_accuracy"] - card["greedy_accuracy"]) < 2e-3
        assert card["baseline"] == pytest.approx(match3.majority_baseline())


def test_tensor_model_greedy_labels_identical_for_every_cache_layout(match3_models):
    model, _ = match3_models["tensor"]
    xs = torch.tensor([match3.random_numbers(match3.N_NUMBERS, random.Random(s)) for s in range(32)])
    out = {layout: match3.greedy_labels(model, xs, layout) for layout in LAYOUTS}
    assert all(torch.equal(v, out["four"]) for v in out.values())
    # and greedy decoding equals reading the labels off one uncached forward of the decoded sequence
    seq = torch.full((32, 1 + 2 * match3.N_NUMBERS), match3.BOS)
    seq[:, 1::2], seq[:, 2::2] = xs, out["two"]
    with torch.no_grad():
        assert torch.equal(model(seq).argmax(-1)[:, 1::2], out["two"])


def test_layout_for_a_standard_model_is_a_clear_error(match3_models):
    model, _ = match3_models["standard"]
    with pytest.raises(ValueError, match="layout 'two' is for tensor-attention models"):
        match3.greedy_labels(model, torch.zeros(1, 3, dtype=torch.long), "two")


def test_unknown_checkpoint_is_a_clear_error():
    with pytest.raises(ValueError, match="no Match3 checkpoint 'match3-nope'"):
        match3.load("match3-nope")


@pytest.mark.slow
def test_train_command_writes_a_loadable_checkpoint_and_never_overwrites(tmp_path, capsys):
    out = tmp_path / "m3"
    match3.main(["train", "--attention", "tensor", "--out", str(out), "--steps", "2", "--batch-size", "4",
                 "--eval-sequences", "8"])
    model, card = match3.load(out)
    assert card["steps"] == 2 and card["attention"] == "tensor" and (out / "README.md").exists()
    with pytest.raises(SystemExit):
        match3.main(["train", "--attention", "tensor", "--out", str(out), "--steps", "2"])
    assert "already holds other files" in capsys.readouterr().err
    match3.main(["train", "--attention", "standard", "--out", str(out), "--steps", "1", "--batch-size", "2",
                 "--eval-sequences", "8", "--force"])
    assert match3.load(out)[1]["attention"] == "standard"
    with pytest.raises(SystemExit):
        match3.main(["train", "--attention", "tensor", "--out", str(tmp_path / "x"), "--steps", "0"])
