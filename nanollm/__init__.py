"""nanollm: a tiny GPT-2/Llama-style decoder with an explicit KV cache and a policy protocol for methods."""

from .cache import KVCache, LayerKV
from .checkpoint import load
from .config import PRESETS, ModelConfig, preset
from .generate import decode_step, extend, generate, prefill
from .model import Transformer
from .policy import CachePolicy, FullCache, StepContext, check_budget, select_topk

__all__ = [
    "load", "KVCache", "LayerKV", "ModelConfig", "PRESETS", "preset", "Transformer",
    "prefill", "extend", "decode_step", "generate",
    "CachePolicy", "FullCache", "StepContext", "select_topk", "check_budget",
]
