"""
ModelConfig: every number that defines a decoder, and named presets.

``flavour="gpt2"``: learned positions, LayerNorm, GELU MLP, biases (Radford et al. 2019). ``flavour="llama"``:
RoPE (Su et al. 2021), RMSNorm, SwiGLU MLP, no biases, grouped-query attention with ``n_kv_head < n_head``
(Touvron et al. 2023). Query head ``h`` reads KV head ``h // (n_head // n_kv_head)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .checks import check_choice, check_config, check_fields


@dataclass
class ModelConfig:
    flavour: str = "llama"          # "gpt2" or "llama"
    vocab_size: int = 512
    n_layer: int = 2
    n_head: int = 4                 # query heads
    n_kv_head: int = 2              # key/value heads; == n_head is plain MHA, 1 is multi-query attention
    d_model: int = 64
    d_ff: int = 0                   # MLP hidden size; 0 = default (4*d_model for gpt2, ~8/3*d_model for llama)
    max_seq_len: int = 256          # the model's maximum positions (tokens seen, prompt + generated)
    rope_base: float = 10000.0      # RoPE base theta (llama only)
    rope_scaling: dict | None = None  # Llama-3 style frequency scaling, see attention.rope_inv_freq
    norm_eps: float = 1e-5
    tie_embeddings: bool = True     # lm_head shares the token embedding matrix
    bias: bool | None = None        # biases in linear layers; None = flavour default (gpt2 yes, llama no)
    qkv_bias: bool | None = None    # biases on the query, key and value projections (Qwen2: there only); None = bias
    qk_norm: bool = False           # RMSNorm over each head's q and k before RoPE (Qwen3, Yang et al. 2025)
    d_head: int = 0                 # the size d of one head; 0 = d_model // n_head (Qwen3 sets its own)
    attention: str = "causal"       # attention module: a name in attention.ATTENTION or "package.module:Class"
    extra: dict = field(default_factory=dict)  # free-form notes (e.g. where a real checkpoint came from)

    def __post_init__(self) -> None:
        check_config(self)
        if self.bias is None:
            self.bias = self.flavour == "gpt2"
        self.qkv_bias = self.bias if self.qkv_bias is None else self.qkv_bias
        if self.d_ff == 0:
            if self.flavour == "gpt2":
                self.d_ff = 4 * self.d_model
            else:  # Llama: 2/3 of 4*d_model, rounded up to a multiple of 16
                self.d_ff = 16 * ((8 * self.d_model // 3 + 15) // 16)

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_head

    @property
    def group_size(self) -> int:
        return self.n_head // self.n_kv_head          # G: query heads per KV head

    def kv_bytes_per_token(self, bytes_per_element: int = 4) -> int:
        """Bytes one token adds to a full cache of the standard attention: K and V of every layer and KV head."""
        return 2 * self.n_layer * self.n_kv_head * self.head_dim * bytes_per_element

    def to_dict(self) -> dict:              # qkv_bias where it differs from bias (Qwen2), qk_norm and d_head where set
        default = {"qkv_bias": self.bias, "qk_norm": False, "d_head": 0}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in default or v != default[k]}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        check_fields(d, [f.name for f in dataclasses.fields(cls)])
        return cls(**d)


# Presets as keyword arguments, so derived fields (d_ff, bias) follow an override. TINY (tests, quick mode)
# has GQA (4 query heads share 2 KV heads), so grouping bugs show; SMALL is the bundled model's shape;
# the last three are real models' shapes, for memory arithmetic and timing with random weights.
PRESETS: dict[str, dict] = {
    "TINY": dict(flavour="llama", vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, d_model=64, max_seq_len=256),
    "TINY_GPT2": dict(flavour="gpt2", vocab_size=512, n_layer=2, n_head=4, n_kv_head=4, d_model=64, max_seq_len=256),
    "SMALL": dict(flavour="llama", vocab_size=1024, n_layer=4, n_head=4, n_kv_head=2, d_model=128, max_seq_len=1024),
    "GPT2_124M": dict(flavour="gpt2", vocab_size=50257, n_layer=12, n_head=12, n_kv_head=12, d_model=768,
                      max_seq_len=1024),
    "TINYLLAMA_1B": dict(flavour="llama", vocab_size=32000, n_layer=22, n_head=32, n_kv_head=4, d_model=2048,
                         d_ff=5632, max_seq_len=2048, tie_embeddings=False),
    "SMOLLM2_135M": dict(flavour="llama", vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3, d_model=576,
                         d_ff=1536, max_seq_len=8192, rope_base=100000.0),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A fresh config from a named preset, with optional field overrides: ``preset("TINY", n_layer=4)``."""
    check_choice("preset", name, PRESETS)
    return ModelConfig(**{**PRESETS[name], **overrides})
