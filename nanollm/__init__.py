"""nanollm: a tiny GPT-2/Llama-style decoder with an explicit KV cache and a policy protocol for methods.

Reading order (config, model, attention, storage, policy, cache, generation; then I/O and tools): README.md
in this folder.
"""

from .cache import KVCache, LayerKV
from .checks import check_budget
from .config import PRESETS, ModelConfig, preset
from .generation import decode_step, extend, generate, prefill
from .model import Transformer
from .policy import CachePolicy, FullCache, PolicyWrapper, ScoringPolicy, StepContext, select_topk


def load(name_or_path, device: str = "cpu"):
    """(model, tokenizer, card) of a bundled checkpoint name or a folder; see ``checkpoint.load``.

    Imported on first use, so ``python -m nanollm.<tool>`` does not import its own module twice.
    """
    from .io.checkpoint import load as _load
    return _load(name_or_path, device)


__all__ = [
    "load", "KVCache", "LayerKV", "ModelConfig", "PRESETS", "preset", "Transformer",
    "prefill", "extend", "decode_step", "generate",
    "CachePolicy", "FullCache", "ScoringPolicy", "PolicyWrapper", "StepContext", "select_topk", "check_budget",
]
