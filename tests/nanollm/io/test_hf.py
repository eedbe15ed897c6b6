"""
nanollm.io.hf: export -> load round trips (exact logits), every weight-file layout Hugging Face uses, clear errors
for what nanollm cannot represent, and, when ``transformers`` is installed, logits equal to
LlamaForCausalLM / GPT2LMHeadModel loaded from the exported folder.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from nanollm import ModelConfig, Transformer
from nanollm.io.hf import config_from_hf, export_hf, is_hf_folder, load_hf, load_weights, state_to_hf
from nanollm.io.safetensors import load_file, save_file

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8}
CONFIGS = {
    "llama_gqa_tied": dict(flavour="llama", n_head=4, n_kv_head=2),
    "llama_mqa_untied_llama3": dict(flavour="llama", n_head=4, n_kv_head=1, tie_embeddings=False,
                                    rope_base=500000.0, norm_eps=1e-6, rope_scaling=LLAMA3_SCALING),
    "llama_bias": dict(flavour="llama", n_head=4, n_kv_head=4, bias=True),
    "qwen2_qkv_bias": dict(flavour="llama", n_head=4, n_kv_head=2, qkv_bias=True, rope_base=1000000.0),
    "qwen3_qk_norm": dict(flavour="llama", n_head=4, n_kv_head=2, qk_norm=True, d_head=16, rope_base=1000000.0),
    "gpt2_tied": dict(flavour="gpt2", n_head=4, n_kv_head=4),
    "gpt2_untied": dict(flavour="gpt2", n_head=4, n_kv_head=4, tie_embeddings=False, d_ff=48),
}


def random_model(name: str, seed: int = 0) -> Transformer:
    """A tiny fp32 model in which *every* parameter (norm weights and biases too) is random, so a swapped or
    dropped tensor changes the logits."""
    config = ModelConfig(vocab_size=97, n_layer=2, d_model=32, max_seq_len=32, **CONFIGS[name])
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if p.dim() == 2 else 0.5) + (p.dim() == 1))
    return model.eval()


def ids(n: int = 24) -> torch.Tensor:
    return torch.randint(0, 97, (2, n), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def assert_same_logits(a: Transformer, b: Transformer) -> None:
    x = ids()
    assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_export_load_round_trip_is_exact(tmp_path, name):
    model = random_model(name)
    export_hf(model, tmp_path)
    assert is_hf_folder(tmp_path) and not is_hf_folder(tmp_path / "nope")
    loaded, hf_config = load_hf(tmp_path)
    assert hf_config["model_type"] == (name[:5] if name.startswith("qwen") else model.config.flavour)
    assert {**loaded.config.to_dict(), "extra": {}} == {**model.config.to_dict(), "extra": {}}
    assert (loaded.config.rope_scaling, loaded.config.bias, loaded.config.qkv_bias) == \
        (model.config.rope_scaling, model.config.bias, model.config.qkv_bias)
    assert loaded.num_params() == model.num_params()
    if model.config.tie_embeddings:
        assert loaded.lm_head.weight is loaded.tok_emb.weight
        assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")   # as transformers saves it
    assert_same_logits(model, loaded)


def test_dtype_kept_or_cast(tmp_path):
    model = random_model("llama_gqa_tied")
    export_hf(model, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_hf(tmp_path, dtype=None)[0].tok_emb.weight.dtype == torch.bfloat16
    loaded = load_hf(tmp_path)[0]
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert torch.equal(loaded.tok_emb.weight, model.tok_emb.weight.bfloat16().float())


def test_special_token_ids_survive(tmp_path):
    model = random_model("gpt2_tied")
    export_hf(model, tmp_path / "a")
    assert json.loads((tmp_path / "a" / "config.json").read_text())["eos_token_id"] is None   # unknown: null
    model.config.extra.update(bos_token_id=5, eos_token_id=6)
    export_hf(model, tmp_path / "b")
    extra = load_hf(tmp_path / "b")[0].config.extra
    assert (extra["bos_token_id"], extra["eos_token_id"]) == (5, 6)


def test_pytorch_model_bin_and_shards(tmp_path):
    model = random_model("gpt2_untied")
    export_hf(model, tmp_path / "st")
    tensors = load_file(tmp_path / "st" / "model.safetensors")
    config = (tmp_path / "st" / "config.json").read_text()

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(config)
    torch.save(tensors, tmp_path / "bin" / "pytorch_model.bin")
    assert_same_logits(model, load_hf(tmp_path / "bin")[0])

    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "config.json").write_text(config)
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        shard = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, tmp_path / "shards" / shard)
        weight_map.update({n: shard for n in part})
    (tmp_path / "shards" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_same_logits(model, load_hf(tmp_path / "shards")[0])


def test_gpt2_hub_layout(tmp_path):
    """The original gpt2 checkpoint: no "transformer." prefix, and causal-mask buffers stored as weights."""
    model = random_model("gpt2_tied")
    export_hf(model, tmp_path)
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(tmp_path / "model.safetensors").items()}
    for i in range(model.config.n_layer):
        tensors[f"h.{i}.attn.bias"] = torch.ones(1, 1, 32, 32).tril()
    tensors["lm_head.weight"] = tensors["wte.weight"]          # some tied checkpoints store the head too
    save_file(tensors, tmp_path / "model.safetensors")
    assert_same_logits(model, load_hf(tmp_path)[0])


def test_gpt2_conv1d_layout():
    """Conv1D stores (in, out) and c_attn fuses q, k, v: check one layer's tensors by hand."""
    model = random_model("gpt2_tied")
    sd = state_to_hf(model)
    attn = model.blocks[0].attn
    c_attn = sd["transformer.h.0.attn.c_attn.weight"]                                   # (D, 3D)
    assert c_attn.shape == (32, 96)
    assert torch.equal(c_attn[:, 32:64], attn.k_proj.weight.t())
    assert torch.equal(sd["transformer.h.0.attn.c_attn.bias"][64:], attn.v_proj.bias)
    assert torch.equal(sd["transformer.h.0.mlp.c_fc.weight"], model.blocks[0].mlp.up_proj.weight.t())


def test_unsupported_configs_raise():
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
    assert config_from_hf(llama).n_kv_head == 4
    assert config_from_hf({**llama, "head_dim": 16}).head_dim == 16            # transformers honours it too
    assert config_from_hf({**llama, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}).rope_base == 5e5
    for bad, message in [({"model_type": "bert"}, "model_type 'bert' is not supported"),
                         ({"architectures": ["LlamaForSequenceClassification"]}, "architecture"),
                         ({"hidden_act": "gelu"}, "hidden_act"),
                         ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
                         ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6},   # Qwen3's own advice:
                           "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),  # added
                         ({"attention_bias": True}, "mlp_bias"),
                         ({"head_dim": 7}, "RoPE needs an even head dimension, got 7"),
                         ({"model_type": "mistral", "architectures": None, "sliding_window": 4,
                           "max_position_embeddings": 64}, "sliding-window")]:
        with pytest.raises(ValueError, match=message):
            config_from_hf({**llama, **bad})
    with pytest.raises(ValueError, match="activation_function"):
        config_from_hf({"model_type": "gpt2", "activation_function": "relu"})


def test_unrepresentable_exports_and_mismatched_weights_raise(tmp_path):
    gqa_gpt2 = Transformer(ModelConfig(flavour="gpt2", vocab_size=97, n_layer=1, n_head=4, n_kv_head=2, d_model=32))
    with pytest.raises(ValueError, match="n_kv_head == n_head"):
        export_hf(gqa_gpt2, tmp_path / "x")
    model = random_model("llama_gqa_tied")
    export_hf(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "model.layers.7.mlp.up_proj.weight": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected"):
        load_hf(tmp_path)
    tensors.pop("model.norm.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing"):
        load_hf(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_weights(tmp_path)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_loads_the_export(tmp_path, name):
    """The real check of the format: transformers builds the model from our folder and agrees on logits."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    model = random_model(name)
    export_hf(model, tmp_path / "ours")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(hf).__name__ == ("GPT2LMHeadModel" if model.config.flavour == "gpt2" else "Qwen3ForCausalLM"
                                 if model.config.qk_norm else "Qwen2ForCausalLM"
                                 if model.config.qkv_bias and not model.config.bias else "LlamaForCausalLM")
    x = ids()
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)

    # and back: a folder written by transformers' own save_pretrained loads into the same model
    hf.save_pretrained(tmp_path / "theirs")
    assert_same_logits(model, load_hf(tmp_path / "theirs")[0])


@pytest.mark.parametrize("name", ["qwen2_qkv_bias", "qwen3_qk_norm", "llama_mqa_untied_llama3", "llama_gqa_tied"])
def test_a_folder_transformers_wrote_loads_in_bf16_with_its_logits(tmp_path, name):
    """In bf16, the logits of a folder transformers saved, read by nanollm and by transformers itself: equal
    to 0.02 (bf16's rounding; these tiny models agree exactly, another summation order would not), with the
    same argmax, and both within 0.25 of the fp32 model's."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    model = random_model(name)
    export_hf(model, tmp_path / "ours")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").save_pretrained(tmp_path / "theirs")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "theirs", dtype=torch.bfloat16).eval()
    ours = load_hf(tmp_path / "theirs", dtype=torch.bfloat16)[0]
    assert ours.tok_emb.weight.dtype == hf.dtype == torch.bfloat16
    x = ids()
    with torch.no_grad():
        theirs, mine, full = hf(x).logits.float(), ours(x).float(), model(x)
    torch.testing.assert_close(mine, theirs, atol=0.02, rtol=0)
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
    assert (mine - full).abs().max() < 0.25 and (mine - full).abs().max() > 0       # bf16, not fp32 in disguise


def test_an_unsupported_architecture_is_one_line_naming_it():
    base = {"vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 64}
    with pytest.raises(ValueError, match="model_type 'phi3' is not supported; supported: gpt2, llama, mistral, "
                                         "qwen2, qwen3"):
        config_from_hf({"model_type": "phi3", **base})
    with pytest.raises(ValueError, match="attention_bias=true on a qwen3"):
        config_from_hf({"model_type": "qwen3", "attention_bias": True, **base})
    with pytest.raises(ValueError, match="layer_types .* every layer must be 'full_attention'"):
        config_from_hf({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"], **base})
    with pytest.raises(ValueError, match="RoPE needs an even head dimension, got 7"):
        config_from_hf({"model_type": "qwen3", "head_dim": 7, **base})
    qwen3 = config_from_hf({"model_type": "qwen3", "head_dim": 16, "sliding_window": 16, **base})
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.bias, qwen3.qkv_bias) == (True, 16, False, False)
    assert config_from_hf({"model_type": "qwen3", **base}).head_dim == 128      # Qwen3Config's default
    with pytest.raises(ValueError, match="head_dim must be an integer .or left out: 128"):
        config_from_hf({"model_type": "qwen3", "head_dim": None, **base})       # transformers refuses it too
    with pytest.raises(ValueError, match="sliding-window attention"):
        config_from_hf({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, **base})
    qwen = config_from_hf({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 16, **base})
    assert (qwen.bias, qwen.qkv_bias) == (False, True)


@pytest.mark.parametrize("name", ["qwen2_qkv_bias", "llama_bias", "qwen3_qk_norm"])
def test_the_fast_engine_runs_a_model_with_biases_as_the_plain_one(name):
    """Qwen2's q/k/v biases (and a llama's attention_bias), Qwen3's q/k norms: the evaluation's engines fill
    the same caches and step them to the same logits, and so does the graph step (fp32 within 1e-5); the fused
    step, which has neither, refuses in one line."""
    from experiments.evaluation.engines import ENGINES, make_engine
    from fastpath.fused import FusedGraphDecoder
    from fastpath.graph import GraphDecoder
    from methods import make_policy
    model = random_model(name)
    chunks, tokens = [ids(16)[0].tolist(), ids(20)[1, 16:].tolist()], [5, 7]
    out = {}
    for engine in ENGINES:
        e = make_engine(engine, model)
        caches, last = e.fill([make_policy("full", 8), make_policy("snapkv", 8)], chunks)
        out[engine] = [last]
        for t in tokens:
            out[engine] += e.step(caches, [t, t])[:2]
    for engine in ENGINES:
        for a, b in zip(out["plain"], out[engine]):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    graph = GraphDecoder(model)                                    # on the plain engine's caches, as filled
    caches, _ = make_engine("plain", model).fill([make_policy("full", 8), make_policy("snapkv", 8)], chunks)
    for b, cache in enumerate(caches):
        assert graph.start(cache, len(tokens))
        for n, t in enumerate(tokens):                             # out: last, then each step's logits, hidden
            torch.testing.assert_close(graph.step(torch.tensor([t]))[0], out["plain"][1 + 2 * n][b], rtol=0,
                                       atol=1e-5)
    with pytest.raises(ValueError, match="the fused step takes a model without " + ("q/k norms" if "qwen3" in name
                                                                                      else "biases")):
        FusedGraphDecoder(model)


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_a_folder_of_random_weights_transformers_built_loads_with_its_logits(tmp_path, arch):
    """Each architecture built by transformers itself from its config class (random weights, no download),
    saved as safetensors, read by nanollm: the same logits in fp32 (Llama with Llama-3's RoPE scaling,
    Qwen2 with its q/k/v biases, Qwen3 with its q/k norms and a head size of its own, Mistral without a
    sliding window)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    config = {"MistralForCausalLM": lambda: transformers.MistralConfig(**common, sliding_window=None),
              "Qwen2ForCausalLM": lambda: transformers.Qwen2Config(**common, use_sliding_window=False),
              "Qwen3ForCausalLM": lambda: transformers.Qwen3Config(**common, head_dim=16, rope_theta=1000000.0),
              "LlamaForCausalLM": lambda: transformers.LlamaConfig(**common, rope_theta=500000.0,
                                                                   rope_scaling=LLAMA3_SCALING)}[arch]()
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for p in hf.parameters():                          # every tensor random, biases and norms included
            p.add_(torch.randn(p.shape) * 0.1)
    hf.save_pretrained(tmp_path)
    ours, _ = load_hf(tmp_path)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-5, rtol=0)


def test_a_qwen3_folder_without_its_q_norms_is_named_as_a_qwen3(tmp_path):
    """Weights that lack a layer's q_norm: one line naming the model type the folder declares, and the tensor."""
    export_hf(random_model("qwen3_qk_norm"), tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.self_attn.q_norm.weight"]
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"does not match a qwen3 model with 2 layers: missing "
                                         r"\['model.layers.1.self_attn.q_norm.weight'\]"):
        load_hf(tmp_path)
