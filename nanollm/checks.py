"""
Checks of option values, shared by the decoder and every method: one line each at the top of a constructor
or function, and an error that names the option, says what it must be and shows what it got.

Python's ``bool`` is an ``int`` (``True == 1``), so every check below refuses booleans where it expects
numbers: ``budget=True`` is a mistake, not a budget of one.
"""

from __future__ import annotations

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


def check_config(c) -> None:
    """A ``ModelConfig``'s numbers make a model: positive sizes, whole groups of query heads, even RoPE pairs."""
    if c.flavour not in ("gpt2", "llama"):
        raise ValueError(f"flavour must be 'gpt2' or 'llama', got {c.flavour!r}")
    for name in ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "max_seq_len"):
        if not is_int(getattr(c, name)) or getattr(c, name) <= 0:
            raise ValueError(f"{name} must be a positive integer, got {getattr(c, name)!r}")
    if c.n_head % c.n_kv_head != 0:
        raise ValueError(f"n_head ({c.n_head}) must be divisible by n_kv_head ({c.n_kv_head}): "
                         "each KV head serves a whole group of query heads")
    if c.d_model % c.n_head != 0:
        raise ValueError(f"d_model ({c.d_model}) must be divisible by n_head ({c.n_head})")
    if c.flavour == "llama" and (c.d_model // c.n_head) % 2 != 0:
        raise ValueError(f"RoPE needs an even head dimension, got {c.d_model // c.n_head}")
    if not isinstance(c.attention, str) or not c.attention:
        raise ValueError(f"attention must name an attention module, got {c.attention!r}")
    for name in ("norm_eps", "rope_base"):
        check_number(name, getattr(c, name), 0, math.inf, open_low=True, open_high=True)
    kind = None if c.rope_scaling is None else c.rope_scaling.get("rope_type", c.rope_scaling.get("type"))
    if kind not in (None, "default", "llama3"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: 'llama3' (or none)")


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


def check_generation(config, seen: int, n_ids: int, max_new_tokens: int, temperature: float, top_k) -> None:
    """Options of ``generate``, and room for every position it will feed (the last new token is never fed)."""
    check_int("max_new_tokens", max_new_tokens, 0)
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be positive, got {top_k}")
    total = seen + n_ids + max(max_new_tokens - 1, 0)
    if total > config.max_seq_len:
        raise ValueError(f"prompt ({n_ids} tokens, {seen} already cached) + max_new_tokens ({max_new_tokens}) "
                         f"needs {total} positions, more than max_seq_len={config.max_seq_len}")
