"""
Hostile data files: a checkpoint, Hugging Face folder, GGUF file or training run may come from anywhere, and
none may run code, end in a traceback, hang, or make a loader allocate more than the file holds. Each ends in
one line, ``error: <file>: ...`` naming the file and the field, with exit status 2, before a model is built.

1. Data never names code: a config's ``attention`` is a name from a fixed registry, never an import path.
2. Config values: types and ranges (nanollm_config.json and config.json), tensors checked against the config
   on the weights file's header, JSON nested too deeply.
3. Training runs: any broken ``state.pt`` is one line wherever it is read (load_config, card, train --resume).
4. NaN: a temperature so small the scaled logits overflow; non-finite weights in any kind of checkpoint.
5. Special files: a FIFO, a link to /dev/zero, a file larger than its kind may be.
6. Model cards: card.json's fields, and ``nanollm.cli.card``'s --samples and --workers.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from nanollm import generate, preset
from nanollm.cli import card as card_cli
from nanollm.cli import generate as generate_cli
from nanollm.cli import train as train_cli
from nanollm.io import checkpoint
from nanollm.io.checkpoint import BUNDLED_DIR, load, load_card, load_config
from nanollm.io.gguf import read_gguf
from nanollm.io.hf import export_hf
from nanollm.io.safetensors import load_file, save_file
from nanollm.io.tokenizer import Tokenizer
from tests.commands import within
from tests.nanollm.io.test_gguf import llama_gguf, tokenizer_metadata, write

SECONDS = 20          # every refusal comes at once; a hang or a huge build fails the test instead


def refusal(capsys, main, argv, seconds: float = SECONDS) -> tuple[str, str]:
    """(stdout, the one ``error:`` line) of a command that refuses with exit status 2 within ``seconds``."""
    box, _ = within(seconds, lambda: main(argv))
    out, err = capsys.readouterr()
    error = box.get("error")
    assert isinstance(error, SystemExit) and error.code == 2, (box, err[-2000:])
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return out, err


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, make_model) -> Path:
    """A small nanollm checkpoint (TINY, with the bundled model's tokenizer and a card): copied before use."""
    folder = tmp_path_factory.mktemp("tiny") / "ckpt"
    tok = Tokenizer.load(BUNDLED_DIR / "retrieval-llama" / "tokenizer.json")
    checkpoint.save(make_model(preset("TINY", vocab_size=tok.vocab_size), seed=1), tok, folder,
                    card={"name": "tiny", "summary": "a test model"})
    return folder


@pytest.fixture
def ckpt(tiny_folder, tmp_path) -> Path:
    """A fresh copy of the small checkpoint, for a test to spoil."""
    return Path(shutil.copytree(tiny_folder, tmp_path / "ckpt"))


@pytest.fixture
def hf_folder(tiny_folder, tmp_path) -> Path:
    """The small checkpoint exported as a Hugging Face folder (config.json, model.safetensors, tokenizer.json)."""
    model, tok, _ = load(tiny_folder)
    export_hf(model, tmp_path / "hf", tokenizer=tok)
    return tmp_path / "hf"


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, **changes}))


def generate_argv(folder) -> list[str]:
    return ["--checkpoint", str(folder), "--prompt", "The special magic number", "--max-new-tokens", "3"]


# ----------------------------------------------------------------------------------------------------------
# 1. Data never names code

@pytest.mark.parametrize("module", ["hostile_attention_module", "this"])
def test_a_config_never_names_code_to_import(ckpt, capsys, monkeypatch, module):
    """``"attention": "evil:X"`` with an evil.py beside it (and the folder on sys.path, as when the command
    runs there) imports nothing: one line names the allowed modules. ("this" prints the Zen of Python.)"""
    marker = ckpt / "imported"
    (ckpt / "hostile_attention_module.py").write_text(f"open({str(marker)!r}, 'w').close()\nX = 1\n")
    edit_json(ckpt / "nanollm_config.json", attention=f"{module}:X")
    monkeypatch.syspath_prepend(str(ckpt))
    monkeypatch.chdir(ckpt)
    monkeypatch.delitem(sys.modules, module, raising=False)
    out, err = refusal(capsys, generate_cli.main, generate_argv("."))
    assert not marker.exists() and module not in sys.modules and "Beautiful is better" not in out
    assert "nanollm_config.json" in err and f"attention '{module}:X'" in err and "'causal'" in err


# ----------------------------------------------------------------------------------------------------------
# 2. Config values

@pytest.mark.parametrize("field, value, expected", [
    ("vocab_size", 10**9, ["model.safetensors", "vocab_size 1000000000", "tok_emb.weight"]),
    ("d_ff", 10**9, ["model.safetensors", "d_ff 1000000000", "up_proj.weight"]),
    ("d_ff", -5, ["nanollm_config.json", "d_ff must be an int >= 0"]),
    ("n_layer", 10**6, ["model.safetensors", "1000000 layers (n_layer)"]),
    ("tie_embeddings", "no", ["nanollm_config.json", "tie_embeddings must be True or False"]),
    ("bias", "yes", ["nanollm_config.json", "bias must be True or False"]),
    ("rope_scaling", [], ["nanollm_config.json", "rope_scaling must be a dict"]),
    ("extra", [], ["nanollm_config.json", "extra must be a dict"]),
])
def test_bad_nanollm_config_values_are_refused_before_building(ckpt, capsys, field, value, expected):
    """Wrong types, and sizes the weights file does not hold (a 256 GB embedding, a million layers), are
    refused on the config and the weights file's header, before a model is built."""
    edit_json(ckpt / "nanollm_config.json", **{field: value})
    _, err = refusal(capsys, generate_cli.main, generate_argv(ckpt))
    assert all(e in err for e in expected), err


@pytest.mark.parametrize("field, value, expected", [
    ("num_attention_heads", 0, ["config.json", "num_attention_heads must be an integer >= 1"]),
    ("hidden_size", "128", ["config.json", "hidden_size must be an integer >= 1"]),
    ("num_hidden_layers", 10**7, ["model.safetensors", "10000000 layers (n_layer)"]),
    ("num_hidden_layers", 1e7, ["config.json", "num_hidden_layers must be an integer"]),
    ("eos_token_id", [], ["config.json", "eos_token_id must be a token id"]),
    ("tie_word_embeddings", "no", ["config.json", "tie_word_embeddings must be true or false"]),
    ("vocab_size", 10**9, ["model.safetensors", "vocab_size 1000000000"]),
    ("intermediate_size", 10**9, ["model.safetensors", "d_ff 1000000000"]),
    ("model_type", ["llama"], ["config.json", "model_type must be a string"]),
    ("rope_scaling", [], ["config.json", "rope_scaling must be an object or null"]),
])
def test_bad_hf_config_values_are_refused_before_building(hf_folder, capsys, field, value, expected):
    edit_json(hf_folder / "config.json", **{field: value})
    _, err = refusal(capsys, generate_cli.main, generate_argv(hf_folder))
    assert all(e in err for e in expected), err


@pytest.mark.parametrize("name", ["nanollm_config.json", "tokenizer.json", "card.json", "hf:config.json"])
def test_json_nested_too_deeply_is_one_line(ckpt, hf_folder, capsys, name):
    folder = hf_folder if name.startswith("hf:") else ckpt
    name = name.removeprefix("hf:")
    (folder / name).write_text("[" * 100_000 + "]" * 100_000)
    _, err = refusal(capsys, generate_cli.main, generate_argv(folder))
    assert name in err and "nested too deeply" in err, err


# ----------------------------------------------------------------------------------------------------------
# 3. Training runs: state.pt

class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def bad_states(marker: Path) -> dict[str, bytes]:
    """Broken state.pt contents: code in a pickle, garbage, nothing, a valid file of the wrong shape."""
    import io
    wrong = io.BytesIO()
    torch.save({"model": {}, "step": "three"}, wrong)
    return {"pickle": pickle.dumps({"model": RunsCode(marker)}, protocol=2), "garbage": b"\x80\x02garbage" * 10,
            "empty": b"", "wrong fields": wrong.getvalue()}


@pytest.mark.parametrize("kind", ["pickle", "garbage", "empty", "wrong fields"])
def test_a_broken_state_pt_is_one_line_wherever_it_is_read(tmp_path, capsys, kind):
    run = tmp_path / "run"
    run.mkdir()
    marker = tmp_path / "code-ran"
    (run / "state.pt").write_bytes(bad_states(marker)[kind])
    with pytest.raises(ValueError, match="state.pt"):
        load_config(run)
    with pytest.raises(ValueError, match="state.pt"):
        checkpoint.export_run(run, tmp_path / "out")
    for main, argv in [(card_cli.main, [str(run)]),
                       (train_cli.main, ["--preset", "tiny", "--out", str(run), "--resume", "--quiet"])]:
        _, err = refusal(capsys, main, argv)
        assert "state.pt" in err, err
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------------------
# 4. NaN

def test_a_temperature_whose_scaled_logits_overflow_is_refused(tiny_model, ckpt, capsys):
    _, err = refusal(capsys, generate_cli.main, generate_argv(ckpt) + ["--temperature", "1e-320"])
    assert "--temperature" in err and "0.0001" in err
    with pytest.raises(ValueError, match="temperature"):
        generate(tiny_model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, temperature=1e-320)


def with_nan(state: dict, name: str) -> dict:
    state = {k: v.clone() for k, v in state.items()}
    state[name].view(-1)[3] = float("nan")
    return state


@pytest.mark.parametrize("kind", ["nanollm", "hf", "gguf", "run"])
def test_non_finite_weights_are_refused_when_loaded(ckpt, hf_folder, tmp_path, tiny_model, kind):
    """Weights with a NaN make every logit NaN: sampling crashes, and greedy decoding and every score would
    report numbers computed from NaN. The loaders refuse them, naming the file and the tensor."""
    if kind == "nanollm":
        path, tensor = ckpt / "model.safetensors", "blocks.1.mlp.up_proj.weight"
        save_file(with_nan(load_file(path), tensor), path)
    elif kind == "hf":
        path, tensor = hf_folder / "model.safetensors", "model.layers.0.self_attn.q_proj.weight"
        save_file(with_nan(load_file(path), tensor), path)
    elif kind == "gguf":
        model = type(tiny_model)(tiny_model.config)
        model.load_state_dict(with_nan(tiny_model.state_dict(), "blocks.0.mlp.down_proj.weight"))
        path, tensor = write(tmp_path, llama_gguf(model, tokenizer_metadata()[0])), "blk.0.ffn_down.weight"
    else:
        path, tensor = tmp_path / "run" / "state.pt", "blocks.0.attn.k_proj.weight"
        path.parent.mkdir()
        shutil.copy(BUNDLED_DIR / "retrieval-llama" / "tokenizer.json", path.parent)
        torch.save({"model": with_nan(tiny_model.state_dict(), tensor), "opt": {}, "step": 1, "stage": 0,
                    "stage_start": 0, "elapsed": 1.0, "model_config": tiny_model.config.to_dict()}, path)
        with pytest.raises(ValueError, match=f"{path}: tensor '{tensor}' holds NaN"):
            checkpoint.export_run(path.parent, tmp_path / "out")
        return
    with pytest.raises(ValueError, match=f"tensor '{tensor}' holds NaN") as e:
        load(path if kind == "gguf" else path.parent)
    assert str(path) in str(e.value)


def test_greedy_generation_with_nan_weights_ends_in_one_line(ckpt, capsys):
    path = ckpt / "model.safetensors"
    save_file(with_nan(load_file(path), "tok_emb.weight"), path)
    _, err = refusal(capsys, generate_cli.main, generate_argv(ckpt))
    assert "model.safetensors" in err and "tok_emb.weight" in err and "NaN" in err


@pytest.mark.parametrize("command", ["experiments.compare", "language_modelling"])
def test_scores_are_never_computed_from_nan_weights(ckpt, tmp_path, capsys, tiny_model, command):
    """Greedy scoring exits 0 on NaN logits (argmax of NaN is a token); the commands that report numbers
    refuse the checkpoint (nanollm folder for compare, GGUF for language_modelling) in one line instead."""
    from experiments import compare
    from experiments.evaluation import language_modelling
    if command == "experiments.compare":
        path = ckpt / "model.safetensors"
        save_file(with_nan(load_file(path), "blocks.0.attn.v_proj.weight"), path)
        main, argv = compare.main, ["--checkpoint", str(ckpt), "--tasks", "niah_single_noise", "--length", "128",
                                    "--samples", "1", "--workers", "1", "--quiet"]
    else:
        model = type(tiny_model)(tiny_model.config)
        model.load_state_dict(with_nan(tiny_model.state_dict(), "blocks.0.attn.v_proj.weight"))
        path = write(tmp_path, llama_gguf(model, tokenizer_metadata()[0]))
        main, argv = language_modelling.main, ["--checkpoint", str(path), "--length", "32", "--quiet"]
    _, err = refusal(capsys, main, argv + ["--json", str(tmp_path / "scores.json")])
    assert str(path) in err and "holds NaN" in err, err
    assert not (tmp_path / "scores.json").exists()


# ----------------------------------------------------------------------------------------------------------
# 5. Special files

def make_special(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("name, kind", [("tokenizer.json", "zero"), ("tokenizer.json", "fifo"),
                                        ("model.safetensors", "fifo"), ("model.safetensors", "zero"),
                                        ("nanollm_config.json", "zero"), ("card.json", "fifo"),
                                        ("card.json", "zero")])
def test_a_file_that_is_not_a_regular_file_is_refused_at_once(ckpt, name, kind):
    """A FIFO would block the read forever, /dev/zero would be read until memory runs out. (A Hugging Face
    folder's files are looked for with ``os.path.isfile``: there such a file counts as absent.)"""
    make_special(ckpt / name, kind)
    box, _ = within(SECONDS, lambda: load(ckpt))
    assert isinstance(box.get("error"), ValueError), box
    assert f"{ckpt / name}: not a regular file" in str(box["error"])


def test_a_tokenizer_linked_to_dev_zero_through_the_command_line(ckpt, capsys):
    make_special(ckpt / "tokenizer.json", "zero")
    _, err = refusal(capsys, generate_cli.main, generate_argv(ckpt))
    assert f"{ckpt / 'tokenizer.json'}: not a regular file" in err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_gguf_that_is_not_a_regular_file_says_so(tmp_path):
    os.mkfifo(tmp_path / "x.gguf")
    box, _ = within(SECONDS, lambda: read_gguf(tmp_path / "x.gguf"))
    assert "x.gguf: not a regular file" in str(box.get("error")), box


def test_a_file_larger_than_its_kind_may_be_is_refused_before_reading(ckpt, capsys):
    with open(ckpt / "tokenizer.json", "wb") as f:
        f.truncate(65 << 20)                         # sparse: 65 MB that take no disk
    _, err = refusal(capsys, generate_cli.main, generate_argv(ckpt))
    assert "tokenizer.json: is 65.0 MB, more than the 64 MB a tokenizer file may be" in err


# ----------------------------------------------------------------------------------------------------------
# 6. Model cards

CARD_ARGV = ["--tasks", "niah_single_noise", "--lengths", "128", "--samples", "1", "--workers", "1"]


@pytest.mark.parametrize("card, field", [([], "a model card must be a JSON object"),
                                         ({"summary": ["x"]}, "summary must be a string"),
                                         ({"default_samples": 10**9}, "default_samples must be an integer in"),
                                         ({"default_suite": ["no_such_task"]}, "default_suite must be a list"),
                                         ({"wall_time_s": "long"}, "wall_time_s must be a number")])
def test_card_json_is_checked(ckpt, capsys, monkeypatch, card, field):
    (ckpt / "card.json").write_text(json.dumps(card))
    with pytest.raises(ValueError, match=field):
        load_card(ckpt)
    monkeypatch.setattr(card_cli, "measure", lambda *a, **kw: pytest.fail("measured before refusing"))
    _, err = refusal(capsys, card_cli.main, [str(ckpt)] + CARD_ARGV)
    assert "card.json" in err and field in err


@pytest.mark.parametrize("flag, value", [("--workers", "999"), ("--samples", "1000000000")])
def test_card_flags_are_capped(ckpt, capsys, monkeypatch, flag, value):
    monkeypatch.setattr(card_cli, "measure", lambda *a, **kw: pytest.fail("measured before refusing"))
    argv = [str(ckpt)] + CARD_ARGV
    argv[argv.index(flag) + 1] = value
    _, err = refusal(capsys, card_cli.main, argv)
    assert flag in err and "at most" in err
