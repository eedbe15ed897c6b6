"""
Real checkpoints: load GPT-2 and Llama-family weights from a Hugging Face-format folder, and export any
nanollm model to one.

A Hugging Face folder holds ``config.json`` and the weights: ``model.safetensors``, a sharded
``model.safetensors.index.json`` + shards, or the older pickled ``pytorch_model.bin`` (see
``nanollm/io/safetensors.py``). Nothing is downloaded: everything is read from the local folder.

Name mapping, Hugging Face -> nanollm (``{i}`` is the layer index)::

    GPT2LMHeadModel ("transformer." prefix optional)    nanollm
    transformer.wte / transformer.wpe                    tok_emb / pos_emb
    transformer.h.{i}.ln_1 / ln_2                        blocks.{i}.attn_norm / mlp_norm
    transformer.h.{i}.attn.c_attn (q, k, v fused)        blocks.{i}.attn.q_proj, k_proj, v_proj
    transformer.h.{i}.attn.c_proj                        blocks.{i}.attn.o_proj
    transformer.h.{i}.mlp.c_fc / c_proj                  blocks.{i}.mlp.up_proj / down_proj
    transformer.ln_f                                     final_norm
    lm_head (tied to wte unless tie_word_embeddings is false)   lm_head

    LlamaForCausalLM / MistralForCausalLM               nanollm
    model.embed_tokens                                   tok_emb
    model.layers.{i}.input_layernorm                     blocks.{i}.attn_norm
    model.layers.{i}.self_attn.{q,k,v,o}_proj            blocks.{i}.attn.{q,k,v,o}_proj
    model.layers.{i}.post_attention_layernorm            blocks.{i}.mlp_norm
    model.layers.{i}.mlp.{gate,up,down}_proj             blocks.{i}.mlp.{gate,up,down}_proj
    model.norm / lm_head                                 final_norm / lm_head

GPT-2 stores its linear layers as ``Conv1D`` modules whose weight is (in, out), the transpose of
``nn.Linear``'s (out, in), and fuses q, k, v into one ``c_attn`` of width 3 * d_model, split here in that
order. Llama's q/k weights need no permutation: nanollm's RoPE uses the same "rotate_half" pairing
(dimension i with i + d/2) as Hugging Face.

    model, hf_config = load_hf("path/to/TinyLlama-1.1B")          # float32 on CPU by default
    export_hf(model, "out/")     # out/config.json + out/model.safetensors, loadable by transformers
"""

from __future__ import annotations

import json
import os

import torch
from torch import Tensor

from ..attention import rope_inv_freq
from ..config import ModelConfig
from ..model import Transformer
from .files import atomic_write_text
from .safetensors import load_file, load_sharded, load_torch_bin, read_header, save_file

# model_type -> architectures we can build; anything else raises a clear error
SUPPORTED = {"gpt2": ("GPT2LMHeadModel", "GPT2Model"),
             "llama": ("LlamaForCausalLM",),
             "mistral": ("MistralForCausalLM",)}
# Weight files, in the order Hugging Face prefers them
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")
# Buffers some checkpoints carry that are recomputed, not learned
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def is_hf_folder(path: str | os.PathLike) -> bool:
    """True if ``path`` is a folder with a ``config.json`` and a weight file we can read."""
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
            and any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES))


def load_weights(folder: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """The raw Hugging Face state dict of a folder, from whichever weight file it has."""
    for name in WEIGHT_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            if name.endswith(".index.json"):
                return load_sharded(path, device)
            return load_file(path, device) if name.endswith(".safetensors") else load_torch_bin(path, device)
    raise FileNotFoundError(f"{folder}: no weights found; expected one of {', '.join(WEIGHT_FILES)}")


# ----------------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig

def read_hf_config(folder: str | os.PathLike) -> dict:
    """The ``config.json`` of a Hugging Face folder as a dict; a clear error naming the file if it is broken."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"cannot read {path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _need(cfg: dict, key: str):
    if key not in cfg:
        raise ValueError(f"config.json lacks the field {key!r} needed for model_type {cfg.get('model_type')!r}")
    return cfg[key]


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from the legacy fields or from transformers 5's ``rope_parameters``."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or not isinstance(params.get("rope_type", ""), str):
            raise ValueError(f"rope_parameters {params!r} not supported: expected one flat dict")
        theta, scaling = params.get("rope_theta", cfg.get("rope_theta", 10000.0)), params
    else:
        theta, scaling = cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: 'llama3' (or none)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise ValueError(f"llama3 rope_scaling lacks {missing}")
    return float(theta), {"rope_type": "llama3", **{k: scaling[k] for k in keys}}


def config_from_hf(cfg: dict) -> ModelConfig:
    """A nanollm ModelConfig from a Hugging Face ``config.json`` dict, or a clear error if unsupported."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    for arch in cfg.get("architectures") or []:
        if arch not in SUPPORTED[model_type]:
            raise ValueError(f"architecture {arch!r} is not supported for model_type {model_type!r}; "
                             f"supported: {', '.join(SUPPORTED[model_type])}")
    extra = {"hf_model_type": model_type}
    for key in ("bos_token_id", "eos_token_id"):
        if cfg.get(key) is not None:
            extra[key] = cfg[key]

    if model_type == "gpt2":
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"GPT-2 activation_function {act!r} is not supported; nanollm uses the tanh "
                             "GELU ('gelu_new')")
        if not cfg.get("scale_attn_weights", True) or cfg.get("scale_attn_by_inverse_layer_idx", False) \
                or cfg.get("add_cross_attention", False):
            raise ValueError("GPT-2 variants with scale_attn_weights=false, scale_attn_by_inverse_layer_idx "
                             "or cross-attention are not supported")
        n_embd = _need(cfg, "n_embd")
        return ModelConfig(
            flavour="gpt2", vocab_size=_need(cfg, "vocab_size"), n_layer=_need(cfg, "n_layer"),
            n_head=_need(cfg, "n_head"), n_kv_head=_need(cfg, "n_head"), d_model=n_embd,
            d_ff=cfg.get("n_inner") or 4 * n_embd, max_seq_len=_need(cfg, "n_positions"),
            norm_eps=cfg.get("layer_norm_epsilon", 1e-5), tie_embeddings=cfg.get("tie_word_embeddings", True),
            bias=True, extra=extra)

    # Llama family
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported; Llama models use 'silu'")
    window = cfg.get("sliding_window")
    if window is not None and window < cfg.get("max_position_embeddings", 0):
        raise ValueError(f"sliding-window attention (sliding_window={window}) is not supported")
    attn_bias, mlp_bias = cfg.get("attention_bias", False), cfg.get("mlp_bias", False)
    if attn_bias != mlp_bias:
        raise ValueError(f"attention_bias={attn_bias} with mlp_bias={mlp_bias} is not supported: nanollm "
                         "has biases in every linear layer or in none")
    d_model, n_head = _need(cfg, "hidden_size"), _need(cfg, "num_attention_heads")
    if cfg.get("head_dim") not in (None, d_model // n_head):
        raise ValueError(f"head_dim={cfg['head_dim']} != hidden_size / num_attention_heads = "
                         f"{d_model // n_head} is not supported")
    theta, scaling = _rope(cfg)
    return ModelConfig(
        flavour="llama", vocab_size=_need(cfg, "vocab_size"), n_layer=_need(cfg, "num_hidden_layers"),
        n_head=n_head, n_kv_head=cfg.get("num_key_value_heads") or n_head, d_model=d_model,
        d_ff=_need(cfg, "intermediate_size"), max_seq_len=cfg.get("max_position_embeddings", 2048),
        rope_base=theta, rope_scaling=scaling, norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_embeddings=cfg.get("tie_word_embeddings", False), bias=bool(attn_bias), extra=extra)


def config_to_hf(config: ModelConfig, dtype: torch.dtype) -> dict:
    """The ``config.json`` dict transformers needs to build the same model as GPT2LMHeadModel / LlamaForCausalLM."""
    # special token ids only when known (from a loaded checkpoint); null beats transformers' defaults, which
    # can lie outside a small vocabulary
    if config.attention != "causal":
        raise ValueError(f"only the standard attention module exports to Hugging Face, not {config.attention!r}")
    tokens = {k: config.extra.get(k) for k in ("bos_token_id", "eos_token_id")}
    torch_dtype = str(dtype).removeprefix("torch.")
    if config.flavour == "gpt2":
        if config.n_kv_head != config.n_head or not config.bias:
            raise ValueError("GPT-2 export needs plain multi-head attention (n_kv_head == n_head) and "
                             f"bias=True; got n_kv_head={config.n_kv_head}, n_head={config.n_head}, "
                             f"bias={config.bias}")
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_embd": config.d_model, "n_layer": config.n_layer, "n_head": config.n_head,
            "n_positions": config.max_seq_len, "n_ctx": config.max_seq_len, "n_inner": config.d_ff,
            "layer_norm_epsilon": config.norm_eps, "activation_function": "gelu_new",
            "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,    # nanollm has no dropout
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "initializer_range": 0.02,
            "tie_word_embeddings": config.tie_embeddings, "use_cache": True, "torch_dtype": torch_dtype,
            **tokens}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.d_model, "intermediate_size": config.d_ff, "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head, "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_base, "rope_scaling": config.rope_scaling,
        "hidden_act": "silu", "attention_bias": config.bias, "mlp_bias": config.bias,
        "attention_dropout": 0.0, "pretraining_tp": 1, "initializer_range": 0.02,
        "tie_word_embeddings": config.tie_embeddings, "use_cache": True, "torch_dtype": torch_dtype,
        **tokens}


# ----------------------------------------------------------------------------------------------------------
# State dicts: nanollm name -> Hugging Face name

def _llama_names(config: ModelConfig) -> dict[str, str]:
    """nanollm -> LlamaForCausalLM parameter names; every Llama tensor is a plain rename."""
    names = {"tok_emb.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    suffixes = ["weight", "bias"] if config.bias else ["weight"]
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        names[ours + "attn_norm.weight"] = theirs + "input_layernorm.weight"
        names[ours + "mlp_norm.weight"] = theirs + "post_attention_layernorm.weight"
        for proj in ("q", "k", "v", "o"):
            for s in suffixes:
                names[ours + f"attn.{proj}_proj.{s}"] = theirs + f"self_attn.{proj}_proj.{s}"
        for proj in ("gate", "up", "down"):
            for s in suffixes:
                names[ours + f"mlp.{proj}_proj.{s}"] = theirs + f"mlp.{proj}_proj.{s}"
    return names


def _gpt2_names(config: ModelConfig) -> dict[str, str]:
    """nanollm -> GPT2LMHeadModel names for everything but the fused c_attn (handled separately)."""
    names = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
             "final_norm.weight": "transformer.ln_f.weight", "final_norm.bias": "transformer.ln_f.bias"}
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2"), ("attn.o_proj", "attn.c_proj"),
                     ("mlp.up_proj", "mlp.c_fc"), ("mlp.down_proj", "mlp.c_proj")):
            names[ours + a + ".weight"], names[ours + a + ".bias"] = theirs + b + ".weight", theirs + b + ".bias"
    return names


def _is_conv1d(hf_name: str) -> bool:
    """GPT-2's Conv1D weights are stored (in, out): transposed relative to nn.Linear."""
    return hf_name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))


def state_from_hf(sd: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Convert a Hugging Face state dict into nanollm names and layouts (a complete Transformer state dict)."""
    if config.flavour == "gpt2" and not any(k.startswith("transformer.") for k in sd):
        sd = {("" if k == "lm_head.weight" else "transformer.") + k: v for k, v in sd.items()}
    names = _llama_names(config) if config.flavour == "llama" else _gpt2_names(config)
    unused = {k for k in sd if not k.endswith(IGNORED_SUFFIXES)}
    if config.tie_embeddings:
        unused.discard("lm_head.weight")          # some tied checkpoints store the head anyway
    missing = [h for h in names.values() if h not in sd]
    out = {}
    for ours, theirs in names.items():
        if theirs in sd:
            out[ours] = sd[theirs].t().contiguous() if _is_conv1d(theirs) else sd[theirs]
            unused.discard(theirs)
    if config.flavour == "gpt2":                  # split the fused (D, 3D) c_attn into q, k, v
        for i in range(config.n_layer):
            w, b = f"transformer.h.{i}.attn.c_attn.weight", f"transformer.h.{i}.attn.c_attn.bias"
            if w not in sd or b not in sd:
                missing += [n for n in (w, b) if n not in sd]
                continue
            unused -= {w, b}
            qkv_w, qkv_b = sd[w].t().split(config.d_model, dim=0), sd[b].split(config.d_model, dim=0)
            for proj, pw, pb in zip("qkv", qkv_w, qkv_b):
                out[f"blocks.{i}.attn.{proj}_proj.weight"] = pw.contiguous()
                out[f"blocks.{i}.attn.{proj}_proj.bias"] = pb.contiguous()
    if missing or unused:
        raise ValueError(f"checkpoint does not match a {config.flavour} model with {config.n_layer} layers: "
                         f"missing {sorted(missing)[:8]}, unexpected {sorted(unused)[:8]}")
    if config.tie_embeddings:
        out["lm_head.weight"] = out["tok_emb.weight"]
    return out


def state_to_hf(model: Transformer) -> dict[str, Tensor]:
    """The model's weights under Hugging Face names and layouts (tied head left out, as transformers does)."""
    config, sd = model.config, model.state_dict()
    names = _llama_names(config) if config.flavour == "llama" else _gpt2_names(config)
    out = {theirs: sd[ours].t() if _is_conv1d(theirs) else sd[ours] for ours, theirs in names.items()}
    if config.flavour == "gpt2":                  # fuse q, k, v into c_attn: weight (D, 3D), bias (3D,)
        for i in range(config.n_layer):
            p = f"blocks.{i}.attn."
            out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat(
                [sd[p + f"{x}_proj.weight"] for x in "qkv"], dim=0).t()
            out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([sd[p + f"{x}_proj.bias"] for x in "qkv"])
    return {k: v.contiguous() for k, v in out.items()}


# ----------------------------------------------------------------------------------------------------------
# Public API

def load_hf(path: str | os.PathLike, device: str | torch.device = "cpu",
            dtype: torch.dtype | None = torch.float32) -> tuple[Transformer, dict]:
    """Build a nanollm Transformer from a Hugging Face folder. Returns ``(model, config.json dict)``.

    ``dtype=None`` keeps the checkpoint's own dtype (that of its token embedding); otherwise every weight
    is cast to ``dtype``. The model is returned in eval mode on ``device``.
    """
    hf_config = read_hf_config(path)
    config = config_from_hf(hf_config)
    config.extra["source"] = os.path.abspath(path)
    sd = state_from_hf(load_weights(path, device), config)
    return model_from_state(config, sd, dtype), hf_config


def model_from_state(config: ModelConfig, sd: dict[str, Tensor], dtype: torch.dtype | None = torch.float32,
                     what: str = "config.json") -> Transformer:
    """A Transformer in eval mode that adopts the tensors of ``sd`` (nanollm names), cast to ``dtype``
    (``None``: keep the dtype of the token embedding), on their device; ``what`` names the config in errors."""
    dtype = sd["tok_emb.weight"].dtype if dtype is None else dtype
    sd = {k: v.to(dtype) for k, v in sd.items()}

    # Build on the meta device (no memory, no random init), then adopt the loaded tensors as parameters.
    with torch.device("meta"):
        model = Transformer(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = {k: (tuple(sd[k].shape), shape) for k, shape in expected.items() if tuple(sd[k].shape) != shape}
    if wrong:
        raise ValueError(f"checkpoint shapes do not match {what}, (file, expected): {wrong}")
    model.load_state_dict(sd, strict=True, assign=True)
    if config.tie_embeddings:                     # assign=True made two parameters: tie them again
        model.lm_head.weight = model.tok_emb.weight
    if config.flavour == "llama":                 # computed under the meta device above: redo for real
        model.inv_freq = rope_inv_freq(config)
    return model.eval()


def export_hf(model: Transformer, path: str | os.PathLike, dtype: torch.dtype | None = None,
              tokenizer=None) -> None:
    """Write ``model`` as a Hugging Face folder: ``config.json`` + ``model.safetensors``.

    transformers loads it as GPT2LMHeadModel or LlamaForCausalLM with the same logits. ``dtype`` casts the
    weights (default: keep the model's dtype). With a ``tokenizer`` (a nanollm ``Tokenizer``, or the
    ``EncodingTokenizer`` of a GGUF or Hugging Face model) the folder also gets an equivalent byte-level BPE
    ``tokenizer.json``, and its end-of-text token becomes ``eos_token_id``.
    """
    dtype = model.tok_emb.weight.dtype if dtype is None else dtype
    hf_config = config_to_hf(model.config, dtype)  # raises for models HF cannot represent
    tokenizer_file = None
    if tokenizer is not None:                      # everything is checked before the first file is written
        from .hf_tokenizer import tokenizer_json
        from .tokenizer import EOT
        if hasattr(tokenizer, "ranks"):            # a nanollm.io.tokenizer.Tokenizer has its BPE ranks
            ranks, pattern, special = tokenizer.ranks, tokenizer.pattern, {EOT: tokenizer.eot_id}
        elif hasattr(tokenizer, "bpe"):            # checkpoint.EncodingTokenizer (tiktoken inside)
            ranks, pattern, special = tokenizer.bpe()
        else:
            raise ValueError(f"export_hf writes byte-level BPE tokenizers, not {type(tokenizer).__name__}")
        if tokenizer.eot_id is not None:
            hf_config["eos_token_id"] = tokenizer.eot_id
        tokenizer_file = json.dumps(tokenizer_json(ranks, pattern, special))
    tensors = {k: v.to(dtype) for k, v in state_to_hf(model).items()}
    os.makedirs(path, exist_ok=True)
    if tokenizer_file is not None:
        atomic_write_text(os.path.join(path, "tokenizer.json"), tokenizer_file)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt", "source": "nanollm"})
    atomic_write_text(os.path.join(path, "config.json"), json.dumps(hf_config, indent=2, sort_keys=True) + "\n")


def is_nanollm_export(folder: str | os.PathLike) -> bool:
    """True for a folder written by ``export_hf`` (its weights say so): one the command line may replace."""
    try:
        return read_header(os.path.join(folder, "model.safetensors"))[1].get("source") == "nanollm"
    except (OSError, ValueError):
        return False
