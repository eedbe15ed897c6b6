"""A nanollm checkpoint exported as a Hugging Face folder (weights + tokenizer.json) and used like one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.evaluation.compare import RunSpec, run
from nanollm import preset
from nanollm.cli.hf import main as hf_main
from nanollm.data.tasks import corpus, make_sample
from nanollm.io import checkpoint
from nanollm.io.hf import export_hf
from nanollm.io.hf_tokenizer import encoding_from_tokenizer_json, tokenizer_json
from nanollm.io.tokenizer import EOT, Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(corpus(80_000, seed=0), 512)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tok, make_model):
    model = make_model(preset("TINY"), seed=2)
    ours = tmp_path_factory.mktemp("nanollm")
    checkpoint.save(model, tok, ours, card={"name": "tiny"})
    hf = tmp_path_factory.mktemp("hf")
    hf_main([str(ours), str(hf)])
    return ours, hf


def test_tokenizer_json_reproduces_our_ids(tok, tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json(tok.ranks, tok.pattern, {EOT: tok.eot_id})))
    enc = encoding_from_tokenizer_json(tmp_path / "tokenizer.json")
    text = corpus(30_000, seed=9) + " café 🙂 " + EOT
    assert enc.encode(text, allowed_special="all") == tok.encode(text)


def test_hf_tokenizers_library_agrees(folders, tok):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(folders[1] / "tokenizer.json"))
    text = corpus(20_000, seed=4) + " naïve 東京"
    assert hf.encode(text).ids == tok.encode(text)


def test_load_hf_folder_same_logits_and_tokens(folders, tok):
    m1, t1, _ = checkpoint.load(folders[0])
    m2, t2, card = checkpoint.load(folders[1])
    assert card["source"] == "huggingface" and t2.eot_id == tok.eot_id
    text = "The special magic number for calm-otter is: 4821733."
    assert t2.encode(text) == t1.encode(text)
    ids = torch.tensor([t1.encode(text)])
    assert torch.equal(m1(ids), m2(ids))


def test_a_tokenizer_past_the_models_vocabulary_is_refused_and_padded_rows_decode_to_nothing(folders, tmp_path,
                                                                                             make_model):
    """A model whose embedding has fewer rows (400) than its folder's tokenizer has tokens (512) would see
    every later token dropped from its prompts: refused when the folder loads, in one line naming both. One
    with more rows (600, as Qwen pads theirs) loads, and an id past every token decodes to nothing (as
    transformers decodes it) instead of failing the run that sampled it."""
    for rows, name in ((400, "small"), (600, "padded")):
        export_hf(make_model(preset("TINY", vocab_size=rows), seed=0), tmp_path / name)
        (tmp_path / name / "tokenizer.json").write_bytes((folders[1] / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match=r"small: the tokenizer has a token of id 511, past the model's "
                                         r"vocab_size 400 \(its embedding's rows\)"):
        checkpoint.load(tmp_path / "small")
    _, tok, _ = checkpoint.load(tmp_path / "padded")
    ids = tok.encode("The grass is green.")
    assert tok.decode(ids + [599, 512]) == tok.decode(ids) == "The grass is green."


def test_hf_folder_without_tokenizer_loads_with_none(tmp_path, make_model):
    export_hf(make_model(preset("TINY"), seed=0), tmp_path)
    _, t, _ = checkpoint.load(tmp_path)
    assert t is None


@pytest.mark.slow
def test_generate_and_compare_accept_hf_folder(folders):
    # the CLI runs in a subprocess, as people run it (importing nanollm.cli.generate here would rebind the
    # package attribute nanollm.cli.generate, the function, to the command-line module)
    out = subprocess.run([sys.executable, "-m", "nanollm.cli.generate", "--checkpoint", str(folders[1]), "--prompt",
                          "The grass is", "--max-new-tokens", "4"], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[3])
    assert out.stdout.startswith("The grass is") and not out.stderr
    model, tok, _ = checkpoint.load(folders[1])
    records = run(model, tok, RunSpec(["streaming_llm"], [32], ["niah_single_noise"], ["question_in_prompt"], 1, 200,
                  progress=False))
    assert {r["method"] for r in records} == {"full", "streaming_llm"}
    s = make_sample("niah_single_noise", tok, 200, seed=0)
    assert s.target_ids[-1] == tok.eot_id
