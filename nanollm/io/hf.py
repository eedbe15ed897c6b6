"""
Real checkpoints: load GPT-2 and Llama-family weights from a local Hugging Face-format folder (``config.json``
+ ``model.safetensors``, sharded safetensors or ``pytorch_model.bin``), and export any nanollm model to one.
Nothing is downloaded.

    model, hf_config = load_hf("path/to/TinyLlama-1.1B")          # float32 on CPU by default
    export_hf(model, "out/")     # out/config.json + out/model.safetensors, loadable by transformers

Names follow transformers' ``GPT2LMHeadModel`` and ``LlamaForCausalLM`` (``SUPPORTED`` lists the model types;
Qwen2 adds biases on q, k and v, Qwen3 an RMSNorm of each head's q and k).
A folder is data: every ``config.json`` field is checked for type and range, and the tensors the weight files
list are checked by name and shape against the model the config describes (``check_state``), before a model
is built; non-finite weights are refused.

Details (the name maps, GPT-2's Conv1D and fused q/k/v, RoPE): nanollm/inside.md, section "io/hf.py: Hugging
Face folders in and out".
"""

from __future__ import annotations

import json
import os

import torch
from torch import Tensor

from ..attention import rope_inv_freq
from ..checks import LLAMA3_SCALING, check_finite_weights, check_rope_scaling, is_int
from ..config import ModelConfig
from ..model import Transformer
from .files import atomic_write_text, read_json, removed_on_failure
from .safetensors import DTYPES, load_file, load_sharded, load_torch_bin, read_header, save_file, shards

# model_type -> architectures we can build; anything else raises a clear error
SUPPORTED = {"gpt2": ("GPT2LMHeadModel", "GPT2Model"),
             "llama": ("LlamaForCausalLM",),
             "mistral": ("MistralForCausalLM",),
             "qwen2": ("Qwen2ForCausalLM",),
             "qwen3": ("Qwen3ForCausalLM",)}
# Weight files, in the order Hugging Face prefers them
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")
# Buffers some checkpoints carry that are recomputed, not learned
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def is_hf_folder(path: str | os.PathLike) -> bool:
    """True if ``path`` is a folder with a ``config.json`` and a weight file we can read."""
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
            and any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES))


def weight_file(folder: str | os.PathLike) -> str:
    """The path of the folder's weight file (or index), the first of ``WEIGHT_FILES`` it has."""
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise FileNotFoundError(f"{folder}: no weights found; expected one of {', '.join(WEIGHT_FILES)}")


def load_weights(folder: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """The raw Hugging Face state dict of a folder, from whichever weight file it has; every weight finite."""
    path = weight_file(folder)
    if path.endswith(".index.json"):
        sd = load_sharded(path, device)
    else:
        sd = load_file(path, device) if path.endswith(".safetensors") else load_torch_bin(path, device)
    check_finite_weights(sd, path)
    return sd


def meta_tensors(header: dict) -> dict[str, Tensor]:
    """Tensors on the meta device (a shape and a dtype, no data) for a safetensors header's entries."""
    return {name: torch.empty(info["shape"], dtype=DTYPES[info["dtype"]], device="meta")
            for name, info in header.items()}


def stored_tensors(folder: str | os.PathLike) -> dict[str, Tensor] | None:
    """The folder's tensors as meta tensors, from the safetensors headers alone (no data is read); None for
    pickled ``.bin`` weights, whose shapes are known only once they are loaded."""
    path = weight_file(folder)
    if path.endswith(".safetensors"):
        return meta_tensors(read_header(path)[0])
    if path.endswith(".safetensors.index.json"):
        weight_map, paths = shards(path)
        out = {}
        for shard in paths:
            out.update(meta_tensors(read_header(shard)[0]))
        return {name: t for name, t in out.items() if name in weight_map}
    return None


# ----------------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig

def read_hf_config(folder: str | os.PathLike) -> dict:
    """The ``config.json`` of a Hugging Face folder as a dict; a clear error naming the file if it is broken."""
    path = os.path.join(folder, "config.json")
    cfg = read_json(path, "config file")
    if not isinstance(cfg, dict):
        raise ValueError(f"cannot read {path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


_REQUIRED = object()


class Fields:
    """The fields of a ``config.json`` dict, each checked as it is read: a wrong type or range is a ValueError
    that names the file (``where``) and the field. (Unchecked, ``"hidden_size": "128"`` fails deep in the
    model, ``"num_attention_heads": 0`` divides by zero, and ``"tie_word_embeddings": "no"`` is true.)"""

    def __init__(self, cfg: dict, where) -> None:
        self.cfg, self.where = cfg, where

    def fail(self, key: str, value, expected: str):
        raise ValueError(f"{self.where}: {key} must be {expected}, got {value!r:.100}")

    def get(self, key: str, default=_REQUIRED):
        """The field's value; ``default`` when it is absent or null (an error if there is no default)."""
        if self.cfg.get(key) is not None:
            return self.cfg[key]
        if default is _REQUIRED:
            raise ValueError(f"{self.where}: lacks the field {key!r} needed for model_type "
                             f"{self.cfg.get('model_type')!r}")
        return default

    def integer(self, key: str, default=_REQUIRED, low: int = 1) -> int:
        value = self.get(key, default)
        if value is not None and (not is_int(value) or value < low):
            self.fail(key, value, f"an integer >= {low}")
        return value

    def number(self, key: str, default=_REQUIRED) -> float:
        value = self.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
            self.fail(key, value, "a positive finite number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            self.fail(key, value, "true or false")
        return value

    def text(self, key: str, default=_REQUIRED) -> str:
        value = self.get(key, default)
        if value is not None and not isinstance(value, str):
            self.fail(key, value, "a string")
        return value

    def token_ids(self, key: str, vocab: int):
        """bos / eos: absent, or a token id below ``vocab``, or a non-empty list of them."""
        value = self.get(key, None)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not (ids and all(is_int(i) and 0 <= i < vocab for i in ids)):
            self.fail(key, value, f"a token id in [0, {vocab}) or a non-empty list of them")
        return value


def _rope(f: Fields) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from the legacy fields or from transformers 5's ``rope_parameters``."""
    params, legacy = f.get("rope_parameters", None), f.get("rope_scaling", None)
    if params is not None:
        if not isinstance(params, dict) or not isinstance(params.get("rope_type", ""), str):
            raise ValueError(f"{f.where}: rope_parameters {params!r:.100} not supported: expected one flat dict")
        theta = Fields(params, f.where).number("rope_theta", f.number("rope_theta", 10000.0))
        scaling = params
    else:
        theta, scaling = f.number("rope_theta", 10000.0), legacy
    if isinstance(legacy, dict) and legacy.get("rope_type", legacy.get("type")) not in (None, "default"):
        scaling = legacy                 # a scaling added as rope_scaling beside rope_parameters applies too
    if scaling is not None and not isinstance(scaling, dict):
        f.fail("rope_scaling", scaling, "an object or null")
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return theta, None
    missing = [k for k in LLAMA3_SCALING if k not in scaling] if kind == "llama3" else []
    if missing:
        raise ValueError(f"{f.where}: llama3 rope_scaling lacks {missing}")
    scaling = {"rope_type": "llama3", **{k: scaling[k] for k in LLAMA3_SCALING}} if kind == "llama3" else scaling
    try:
        check_rope_scaling(scaling)
    except ValueError as e:
        raise ValueError(f"{f.where}: {e}") from None
    return theta, scaling


def config_from_hf(cfg: dict, where="config.json") -> ModelConfig:
    """A nanollm ModelConfig from a Hugging Face ``config.json`` dict, or a clear error naming ``where`` (the
    file) and the field if it is unsupported or holds a value of the wrong type or range."""
    f = Fields(cfg, where)
    model_type = f.text("model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    architectures = f.get("architectures", [])
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        f.fail("architectures", architectures, "a list of strings")
    for arch in architectures:
        if arch not in SUPPORTED[model_type]:
            raise ValueError(f"{where}: architecture {arch!r} is not supported for model_type {model_type!r}; "
                             f"supported: {', '.join(SUPPORTED[model_type])}")
    try:
        return _gpt2_config(f) if model_type == "gpt2" else _llama_config(f)
    except ValueError as e:              # ModelConfig's own checks (whole head groups, ...): name the file
        raise ValueError(str(e) if str(e).startswith(f"{where}:") else f"{where}: {e}") from None


def _extra(f: Fields, vocab: int) -> dict:
    extra = {"hf_model_type": f.cfg["model_type"]}
    for key in ("bos_token_id", "eos_token_id"):
        if f.token_ids(key, vocab) is not None:
            extra[key] = f.cfg[key]
    return extra


def _gpt2_config(f: Fields) -> ModelConfig:
    act = f.text("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"GPT-2 activation_function {act!r} is not supported; nanollm uses the tanh "
                         "GELU ('gelu_new')")
    if not f.flag("scale_attn_weights", True) or f.flag("scale_attn_by_inverse_layer_idx", False) \
            or f.flag("add_cross_attention", False):
        raise ValueError("GPT-2 variants with scale_attn_weights=false, scale_attn_by_inverse_layer_idx "
                         "or cross-attention are not supported")
    n_embd, n_head, vocab = f.integer("n_embd"), f.integer("n_head"), f.integer("vocab_size")
    return ModelConfig(
        flavour="gpt2", vocab_size=vocab, n_layer=f.integer("n_layer"), n_head=n_head, n_kv_head=n_head,
        d_model=n_embd, d_ff=f.integer("n_inner", 4 * n_embd), max_seq_len=f.integer("n_positions"),
        norm_eps=f.number("layer_norm_epsilon", 1e-5), tie_embeddings=f.flag("tie_word_embeddings", True),
        bias=True, extra=_extra(f, vocab))


def _llama_config(f: Fields) -> ModelConfig:
    """Llama, Mistral, Qwen2 (a Llama with biases on the query, key and value projections, and a sliding
    window only when ``use_sliding_window`` says so) and Qwen3 (no biases, an RMSNorm of each head's query and
    key, its own ``head_dim``). Every family's ``head_dim`` is honoured, as transformers does."""
    if f.text("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {f.cfg['hidden_act']!r} is not supported; Llama models use 'silu'")
    qwen2, qwen3 = f.cfg["model_type"] == "qwen2", f.cfg["model_type"] == "qwen3"
    window = f.integer("sliding_window", None, low=0)
    max_pos = f.integer("max_position_embeddings", 2048)
    if (qwen2 or qwen3) and f.flag("use_sliding_window", False):
        raise ValueError(f"sliding-window attention (use_sliding_window, sliding_window={window}) is not supported")
    if not (qwen2 or qwen3) and window is not None and window < max_pos:
        raise ValueError(f"sliding-window attention (sliding_window={window}) is not supported")
    layer_types = f.get("layer_types", [])
    if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
        raise ValueError(f"layer_types {layer_types!r:.100} is not supported: every layer must be 'full_attention'")
    attn_bias, mlp_bias = f.flag("attention_bias", False), f.flag("mlp_bias", False)
    if qwen3 and attn_bias:
        raise ValueError("attention_bias=true on a qwen3 (biases on q, k, v and o, none in the MLP) is not supported")
    if attn_bias != mlp_bias:
        raise ValueError(f"attention_bias={attn_bias} with mlp_bias={mlp_bias} is not supported: nanollm "
                         "has biases in every linear layer, in none, or (Qwen2) on q, k and v only")
    d_model, n_head, vocab = f.integer("hidden_size"), f.integer("num_attention_heads"), f.integer("vocab_size")
    if qwen3 and "head_dim" in f.cfg and f.cfg["head_dim"] is None:      # Qwen3Config refuses it too
        f.fail("head_dim", None, "an integer (or left out: 128, Qwen3Config's default)")
    head_dim = f.integer("head_dim", 128 if qwen3 else None)             # transformers' Qwen3Config default
    theta, scaling = _rope(f)
    return ModelConfig(
        flavour="llama", vocab_size=vocab, n_layer=f.integer("num_hidden_layers"), n_head=n_head,
        n_kv_head=f.integer("num_key_value_heads", n_head), d_model=d_model, d_ff=f.integer("intermediate_size"),
        max_seq_len=max_pos, rope_base=theta, rope_scaling=scaling, norm_eps=f.number("rms_norm_eps", 1e-6),
        tie_embeddings=f.flag("tie_word_embeddings", False), bias=attn_bias, qkv_bias=qwen2 or attn_bias,
        qk_norm=qwen3, d_head=0 if head_dim in (None, d_model / n_head) else head_dim, extra=_extra(f, vocab))


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
    if config.bias and not config.qkv_bias:
        raise ValueError("biases in every linear layer but the query, key and value projections: no Hugging Face "
                         "architecture has them so")
    if config.qk_norm and (config.bias or config.qkv_bias):
        raise ValueError("q/k norms with biases: no Hugging Face architecture has both (Qwen3 has no biases)")
    llama = {                                      # what Llama, Qwen2 and Qwen3 share
        "vocab_size": config.vocab_size, "hidden_size": config.d_model, "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head, "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base, "rope_scaling": config.rope_scaling, "hidden_act": "silu",
        "attention_dropout": 0.0, "initializer_range": 0.02, "tie_word_embeddings": config.tie_embeddings,
        "use_cache": True, "torch_dtype": torch_dtype, **tokens}
    if config.qk_norm:                             # each head's q and k normalised: Qwen3's layout
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **llama, "attention_bias": False,
                "use_sliding_window": False}
    if config.qkv_bias and not config.bias:        # biases on q, k, v only: Qwen2's layout
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **llama, "use_sliding_window": False}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **llama, "attention_bias": config.bias,
            "mlp_bias": config.bias, "pretraining_tp": 1}


# ----------------------------------------------------------------------------------------------------------
# State dicts: nanollm name -> Hugging Face name

def _llama_names(config: ModelConfig) -> dict[str, str]:
    """nanollm -> LlamaForCausalLM parameter names; every Llama tensor is a plain rename."""
    names = {"tok_emb.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    suffixes = ["weight", "bias"] if config.bias else ["weight"]
    qkv_suffixes = ["weight", "bias"] if config.qkv_bias else ["weight"]
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        names[ours + "attn_norm.weight"] = theirs + "input_layernorm.weight"
        names[ours + "mlp_norm.weight"] = theirs + "post_attention_layernorm.weight"
        if config.qk_norm:                                                       # Qwen3
            names[ours + "attn.q_norm.weight"] = theirs + "self_attn.q_norm.weight"
            names[ours + "attn.k_norm.weight"] = theirs + "self_attn.k_norm.weight"
        for proj in ("q", "k", "v", "o"):
            for s in (qkv_suffixes if proj != "o" else suffixes):
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


def check_layer_count(config: ModelConfig, n_tensors: int, where) -> None:
    """Every layer has tensors of its own, so a file of ``n_tensors`` tensors holds at most that many layers:
    checked first, because listing (or building) the layers a config claims costs time in proportion."""
    if config.n_layer > n_tensors:
        raise ValueError(f"{where}: holds {n_tensors} tensors, too few for the {config.n_layer} layers (n_layer) "
                         "of its config")


def state_from_hf(sd: dict[str, Tensor], config: ModelConfig, where="checkpoint") -> dict[str, Tensor]:
    """Convert a Hugging Face state dict into nanollm names and layouts (a complete Transformer state dict).
    The tensors may be meta tensors (shapes only): a dry run that checks a file's header before its data."""
    check_layer_count(config, len(sd), where)
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
        kind = config.extra.get("hf_model_type", config.flavour)                # "qwen3", not "llama"
        raise ValueError(f"{where} does not match a {kind} model with {config.n_layer} layers: "
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
    is cast to ``dtype``. The model is returned in eval mode on ``device``. The weight files' tensors are
    checked against the config, by name and shape, before their data is read (pickled ``.bin`` files: once
    loaded) and before the model is built.
    """
    hf_config = read_hf_config(path)
    config = config_from_hf(hf_config, os.path.join(path, "config.json"))
    config.extra["source"] = os.path.abspath(path)
    weights = weight_file(path)
    stored = stored_tensors(path)
    if stored is not None:                    # a dry run on the header's shapes: nothing read or built yet
        check_state(config, state_from_hf(stored, config, weights), weights)
    sd = state_from_hf(load_weights(path, device), config, weights)
    return model_from_state(config, sd, dtype, what=weights), hf_config


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The state-dict shapes of a Transformer of ``config``, from one built on the meta device (no memory)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Transformer(config).state_dict().items()}


def check_state(config: ModelConfig, sd: dict[str, Tensor | None], where) -> None:
    """The tensors of ``sd`` (nanollm names; meta tensors will do, and None counts as missing) are exactly those
    of a model of ``config``, with its shapes: a ValueError naming ``where`` (the weights file) if not."""
    check_layer_count(config, len(sd), where)
    expected = expected_shapes(config)
    have = {k: tuple(v.shape) for k, v in sd.items() if v is not None}
    missing, unexpected = sorted(set(expected) - set(have)), sorted(set(have) - set(expected))
    wrong = [f"{k} is {list(have[k])} in the file, {list(expected[k])} by the config" for k in expected
             if k in have and have[k] != expected[k]]
    if missing or unexpected or wrong:
        problems = [f"missing {missing[:5]}" if missing else "", f"unexpected {unexpected[:5]}" if unexpected else "",
                    "; ".join(wrong[:3])]
        raise ValueError(f"{where} does not match its config ({_sizes(config)}): "
                         f"{'; '.join(p for p in problems if p)}")


def _sizes(config: ModelConfig) -> str:
    """The config fields that set the tensors' shapes, for an error: "vocab_size 512, n_layer 2, ..."."""
    return ", ".join(f"{k} {getattr(config, k)}" for k in ("vocab_size", "n_layer", "d_model", "d_ff", "n_head",
                                                           "n_kv_head", "head_dim", "tie_embeddings"))


def model_from_state(config: ModelConfig, sd: dict[str, Tensor], dtype: torch.dtype | None = torch.float32,
                     what: str = "config.json") -> Transformer:
    """A Transformer in eval mode that adopts the tensors of ``sd`` (nanollm names), cast to ``dtype``
    (``None``: keep the dtype of the token embedding), on their device; ``what`` names the file in errors.
    ``sd`` must match the config exactly (``check_state``)."""
    check_state(config, sd, what)
    dtype = sd["tok_emb.weight"].dtype if dtype is None else dtype
    sd = {k: v.to(dtype) for k, v in sd.items()}

    # Build on the meta device (no memory, no random init), then adopt the loaded tensors as parameters.
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(sd, strict=True, assign=True)
    if config.tie_embeddings:                     # assign=True made two parameters: tie them again
        model.lm_head.weight = model.tok_emb.weight
    if config.flavour == "llama":                 # computed under the meta device above: redo for real
        model.inv_freq = rope_inv_freq(config)
    return model.eval()


HF_EXPORT_FILES = ("tokenizer.json", "model.safetensors", "config.json")     # what export_hf writes


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
    with removed_on_failure(path, HF_EXPORT_FILES):      # a full disk, Ctrl-C: nothing it created is left
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
