"""
The decoder: token embedding, pre-norm blocks (attention + MLP), a final norm and the LM head.

    logits = model(ids)                    # training, a plain forward: causal attention, no cache
    logits = model(ids, cache=cache)       # generation: positions continue from cache.seen
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .attention import RMSNorm, attention_class, rope_cos_sin, rope_inv_freq
from .cache import KVCache
from .checks import check_ids
from .config import ModelConfig


def make_norm(config: ModelConfig) -> nn.Module:
    if config.flavour == "gpt2":
        return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
    return RMSNorm(config.d_model, config.norm_eps)


class MLP(nn.Module):
    """GPT-2: down(gelu(up(x))). Llama (SwiGLU, Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.swiglu = config.flavour == "llama"
        D, F_ = config.d_model, config.d_ff
        self.up_proj = nn.Linear(D, F_, bias=config.bias)
        self.gate_proj = nn.Linear(D, F_, bias=config.bias) if self.swiglu else None
        self.down_proj = nn.Linear(F_, D, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))   # GPT-2's "gelu_new"


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); attn is ``config.attention``'s."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = attention_class(config.attention)(config, layer_idx)
        self.mlp_norm = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, pos: Tensor, rope, cache: KVCache | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), pos, rope, cache)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """A GPT-2- or Llama-style decoder-only language model."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model) if config.flavour == "gpt2" else None
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.final_norm = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # RoPE frequencies (d/2,) in float64, outside the module's buffers so .half() cannot round them
        self.inv_freq = rope_inv_freq(config) if config.flavour == "llama" else None
        self.apply(self._init_weights)
        # GPT-2 §2.3: scale the init of residual output projections by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def check_ids(self, ids: Tensor, start: int = 0) -> None:
        check_ids(ids, self.config, self.tok_emb.weight.device, start)      # a clear error, before any work

    def forward(self, ids: Tensor, cache: KVCache | None = None, return_hidden: bool = False):
        """Logits (B, T, vocab) of ids (B, T), and the final hidden state if ``return_hidden``. With a cache the
        ids continue the cached sequence: their positions start at ``cache.seen``."""
        start = cache.seen if cache is not None else 0
        self.check_ids(ids, start)
        T = ids.shape[1]
        pos = torch.arange(start, start + T, device=ids.device)             # (T,)
        x = self.tok_emb(ids)                                               # (B, T, D)
        rope = None if self.pos_emb is not None else rope_cos_sin(pos, self.inv_freq.to(ids.device), x.dtype)
        if self.pos_emb is not None:                                        # gpt2: learned positions; llama: RoPE
            x = x + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x, pos, rope, cache)
        h = self.final_norm(x)
        logits = self.lm_head(h)
        if cache is not None:
            cache.seen += T
        return (logits, h) if return_hidden else logits
