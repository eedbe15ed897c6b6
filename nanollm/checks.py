"""
Checks of option values, shared by the decoder and every method: one line each at the top of a constructor
or function, and an error that names the option, says what it must be and shows what it got.

Python's ``bool`` is an ``int`` (``True == 1``), so every check below refuses booleans where it expects
numbers: ``budget=True`` is a mistake, not a budget of one.
"""

from __future__ import annotations

import importlib
import math

import torch


def is_int(value) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_budget(budget: int) -> int:
    """A per-head token budget: a positive int (tokens kept per layer per KV head)."""
    if not is_int(budget):
        raise TypeError(f"budget must be an int (tokens kept per layer per KV head), got {budget!r}")
    if budget <= 0:
        raise ValueError(f"budget must be positive (tokens kept per layer per KV head), got {budget}")
    return budget


def check_int(name: str, value, low: int = 1, what: str = "", high: int | None = None) -> int:
    """An int (not a bool) >= ``low`` (and <= ``high`` if given); the error names the option."""
    if not is_int(value) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {bound}{what}, got {value!r}")
    return value


def check_number(name: str, value, low: float = -math.inf, high: float = math.inf, what: str = "",
                 open_low: bool = False, open_high: bool = False) -> float:
    """An int or float (not a bool, not NaN) from ``low`` to ``high``, ends included unless ``open_low`` /
    ``open_high`` (``high=math.inf, open_high=True``: a finite number); the error names the option."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value) \
        and (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
    if not ok:
        if high == math.inf:                         # "a number >= 1", "a finite number >= 0"
            bound = f"{'a finite number' if open_high else 'a number'} {'>' if open_low else '>='} {low:g}"
        else:
            bound = f"a number in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        raise ValueError(f"{name} must be {bound}{what}, got {value!r}")
    return value


def check_flag(name: str, value) -> bool:
    """True or False (not 0/1, not None)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(name: str, value, choices) -> None:
    """One of ``choices`` (a preset's name, say); the error lists them."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {sorted(choices)}")


def check_fields(d: dict, known) -> None:
    """A dict read as a ``ModelConfig`` names only its fields ``known``."""
    unknown = set(d) - set(known)
    if unknown:
        raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}; known: {sorted(known)}")


def check_config(c) -> None:
    """A ``ModelConfig``'s values make a model: positive sizes, whole groups of query heads, even RoPE pairs, and
    every field of its type (a config read from a file could hold ``"tie_embeddings": "no"``, which is true)."""
    if c.flavour not in ("gpt2", "llama"):
        raise ValueError(f"flavour must be 'gpt2' or 'llama', got {c.flavour!r}")
    for name in ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "max_seq_len"):
        if not is_int(getattr(c, name)) or getattr(c, name) <= 0:
            raise ValueError(f"{name} must be a positive integer, got {getattr(c, name)!r}")
    check_int("d_ff", c.d_ff, 0, " (0: the flavour's default)")
    check_flag("tie_embeddings", c.tie_embeddings)
    if c.bias is not None:
        check_flag("bias", c.bias)
    if c.qkv_bias is not None:
        check_flag("qkv_bias", c.qkv_bias)
    if not isinstance(c.extra, dict):
        raise ValueError(f"extra must be a dict of notes, got {c.extra!r:.100}")
    if c.n_head % c.n_kv_head != 0:
        raise ValueError(f"n_head ({c.n_head}) must be divisible by n_kv_head ({c.n_kv_head}): "
                         "each KV head serves a whole group of query heads")
    check_int("d_head", c.d_head, 0, " (0: d_model // n_head)")
    check_flag("qk_norm", c.qk_norm)
    if c.flavour == "gpt2" and (c.d_head or c.qk_norm):
        raise ValueError("d_head and qk_norm are for llama-flavour models (Qwen3); a gpt2 has neither")
    if not c.d_head and c.d_model % c.n_head != 0:
        raise ValueError(f"d_model ({c.d_model}) must be divisible by n_head ({c.n_head}), or give d_head")
    if c.flavour == "llama" and c.head_dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head dimension, got {c.head_dim}")
    if not isinstance(c.attention, str) or not c.attention:
        raise ValueError(f"attention must name an attention module, got {c.attention!r}")
    for name in ("norm_eps", "rope_base"):
        check_number(name, getattr(c, name), 0, math.inf, open_low=True, open_high=True)
    check_rope_scaling(c.rope_scaling)


LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(scaling) -> None:
    """None, a dict of type "default", or a "llama3" dict whose four numbers ``attention.rope_inv_freq`` can use:
    positive and finite, the high-frequency factor above the low one (their difference divides)."""
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be a dict or None, got {scaling!r:.100}")
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind not in (None, "default", "llama3"):
        raise ValueError(f"rope_scaling type {kind!r:.100} is not supported; supported: 'llama3' (or none)")
    if kind == "llama3":
        for key in LLAMA3_SCALING:
            check_number(f"rope_scaling {key}", scaling.get(key), 0, math.inf, open_low=True, open_high=True)
        if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise ValueError(f"rope_scaling high_freq_factor ({scaling['high_freq_factor']}) must be above "
                             f"low_freq_factor ({scaling['low_freq_factor']})")


def check_attention_path(name: str, known) -> type:
    """The attention module a ``"package.module:Class"`` name gives (a name that is not a key of ``known``,
    the registry ``attention.ATTENTION``), imported, and holding what the decoder calls; else a one-line error."""
    if ":" not in name:
        raise ValueError(f"unknown attention module {name!r}; choose one of {sorted(known)} or give "
                         "'package.module:Class'")
    module_name, _, class_name = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"attention module {name!r} cannot be imported: {e}") from e
    for method in ("new_storage", "attend_entries", "forward"):
        if not hasattr(cls, method):
            raise ValueError(f"attention module {name!r} has no {method}(); see nanollm/attention.py")
    return cls


def check_needs(rows, col_sums) -> None:
    """A ``policy.Needs``: ``rows`` an int >= 0 or None (every row), ``col_sums`` True or False."""
    if rows is not None:
        check_int("Needs.rows", rows, 0, what=" or None (every row)")
    check_flag("Needs.col_sums", col_sums)


def check_scores(policy, scores, pos):
    """A scorer's ``score``: one number per slot, (B, H_kv, T) as ``pos``; else one line naming its class."""
    if not isinstance(scores, torch.Tensor) or scores.shape != pos.shape:
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"{type(policy).__name__}.score returned {got}: it must give one number per slot, "
                         f"(B, H_kv, T) = {tuple(pos.shape)}")
    return scores


def check_state(name: str, values, pos) -> None:
    """Per-slot state ``values`` (B, H_kv, T, ...) for a storage whose positions are ``pos`` (B, H_kv, T)."""
    if values.shape[:3] != pos.shape:
        raise ValueError(f"state {name!r} must have shape (B, H_kv, T, ...) = {tuple(pos.shape)} "
                         f"+ ..., got {tuple(values.shape)}")


def check_finite_weights(state: dict, where) -> None:
    """Every floating-point tensor of a loaded state dict is finite: a NaN or infinite weight makes every
    logit NaN, so generation would crash in sampling and greedy decoding and scores would report nonsense.
    The error names the file (``where``) and the first bad tensor."""
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            what = "NaN" if bool(torch.isnan(t).any()) else "infinite"
            raise ValueError(f"{where}: tensor {name!r} holds {what} values; a checkpoint with non-finite "
                             "weights is broken")


def check_ids(ids, config, device, start: int = 0) -> None:
    """Token ids (B, T) a model of ``config`` on ``device`` can take after ``start`` tokens, checked before
    anything is computed or stored."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ids must be an integer tensor (torch.long), got dtype {ids.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"ids must have shape (batch, tokens), got {tuple(ids.shape)}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"ids must hold at least one token per row, got shape {tuple(ids.shape)}")
    if ids.device != device:
        raise ValueError(f"ids are on {ids.device} but the model is on {device}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= config.vocab_size:
        raise ValueError(f"token ids must lie in [0, {config.vocab_size}), got values in [{lo}, {hi}]")
    if start + ids.shape[1] > config.max_seq_len:
        raise ValueError(f"{start} tokens seen + {ids.shape[1]} new = {start + ids.shape[1]} exceeds the model's "
                         f"maximum positions max_seq_len={config.max_seq_len}")


def check_prefill(cache) -> None:
    """``prefill`` starts a sequence: its cache has seen nothing yet."""
    if cache.seen != 0:
        raise ValueError(f"prefill needs an empty cache, this one has seen {cache.seen} tokens; "
                         "use extend() to continue a sequence or cache.reset() to start a new one")


def check_extend(cache) -> None:
    """``extend`` continues a sequence: its cache holds a prefix."""
    if cache.seen == 0:
        raise ValueError("extend needs a cache that already holds a prefix; use prefill() first")


def check_one_token(token) -> None:
    """``decode_step``'s token, made (B, 1): one per row."""
    if token.dim() != 2 or token.shape[1] != 1:
        raise ValueError(f"decode_step takes one token per row, shape (B,) or (B, 1); got {tuple(token.shape)}")


# Sampling divides the logits by the temperature: below this, logits / temperature can overflow to inf and the
# softmax gives NaN, on which torch.multinomial fails. (At 1e-4 sampling is already greedy in practice.)
MIN_TEMPERATURE = 1e-4


def check_generation(config, seen: int, n_ids: int, max_new_tokens: int, temperature: float, top_k) -> None:
    """Options of ``generate``, and room for every position it will feed (the last new token is never fed)."""
    check_int("max_new_tokens", max_new_tokens, 0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not math.isfinite(temperature) \
            or temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be positive, got {top_k}")
    total = seen + n_ids + max(max_new_tokens - 1, 0)
    if total > config.max_seq_len:
        raise ValueError(f"prompt ({n_ids} tokens, {seen} already cached) + max_new_tokens ({max_new_tokens}) "
                         f"needs {total} positions, more than max_seq_len={config.max_seq_len}")
