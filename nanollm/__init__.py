"""nanollm: a tiny GPT-2/Llama-style decoder with an explicit KV cache and a policy protocol for methods.

Reading order (config, storage, policy, attention, cache, model, generation; then I/O and tools): README.md
in this folder.
"""

from . import interrupt  # noqa: F401  (first: Ctrl-C while a command imports torch is one line, interrupt.py)
from .cache import KVCache, LayerKV
from .checks import check_budget
from .config import PRESETS, ModelConfig, preset
from .generation import decode_step, extend, generate, prefill
from .model import Transformer
from .policy import CachePolicy, FullCache, ScoringPolicy, StepContext, select_topk
from .wrapper import PolicyWrapper


def load(name_or_path, device: str = "cpu", dtype=None):
    """(model, tokenizer, card) of a bundled checkpoint name, a fetchable model's name (``smollm2-135m``), a
    folder or a GGUF file, weights in ``dtype`` (default fp32); see ``io.checkpoint.load``.

    Imported on first use, so ``python -m nanollm.<tool>`` does not import its own module twice.
    """
    import torch

    from .io.checkpoint import load as _load
    return _load(name_or_path, device, torch.float32 if dtype is None else dtype)


__all__ = [
    "load", "KVCache", "LayerKV", "ModelConfig", "PRESETS", "preset", "Transformer",
    "prefill", "extend", "decode_step", "generate",
    "CachePolicy", "FullCache", "ScoringPolicy", "PolicyWrapper", "StepContext", "select_topk", "check_budget",
]
