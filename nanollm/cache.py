"""
The explicit KV cache: what each layer has stored, at KV-head granularity, with every entry's position.

Layout of one layer (``LayerKV``)::

    k, v : (B, H_kv, T, d)   keys (after RoPE, at their original positions) and values
    pos  : (B, H_kv, T)      the absolute position of every stored entry; -1 marks an empty slot

Each KV head may keep a different set of tokens (SnapKV selects per head), so positions are stored per
head. Heads may even keep different *numbers* of tokens (AdaKV): the shorter heads are padded with empty
slots (pos = -1), which attention never sees. ``T`` is the number of slots, not the number of tokens
seen: the cache counts those separately in ``KVCache.seen``, and a new token always gets position
``seen`` — conflating the two breaks RoPE after eviction (STYLE.md §3 item 4).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import attend
from .config import ModelConfig


class LayerKV:
    """One layer's storage. Empty until the first ``append``."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.pos: Tensor | None = None

    def __len__(self) -> int:
        """Number of slots T (including empty ones)."""
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: Tensor, v: Tensor, pos: Tensor) -> None:
        """Add new entries at the end. k, v (B, H_kv, Tn, d); pos (Tn,) shared by every row and head."""
        B, H_kv, Tn, _ = k.shape
        new_pos = pos.view(1, 1, Tn).expand(B, H_kv, Tn)
        if self.k is None:
            self.k, self.v, self.pos = k, v, new_pos.clone()
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
            self.pos = torch.cat([self.pos, new_pos], dim=2)

    def keep(self, idx: Tensor) -> None:
        """Keep only the slots ``idx`` (B, H_kv, K), per head, in the given order; -1 makes an empty slot.

        Rows are picked with one ``index_select`` over a flat (B*H_kv*T, d) view: a row gather, not the
        element-wise ``torch.gather`` with an expanded index (PERF.md §3.7: that one is slower than not
        compressing at all).
        """
        B, H_kv, T, d = self.k.shape
        K = idx.shape[-1]
        empty = idx < 0
        base = torch.arange(B * H_kv, device=idx.device).view(B, H_kv, 1) * T   # first row of each head
        flat = (base + idx.clamp(min=0)).reshape(-1)                              # (B*H_kv*K,)
        self.k = self.k.reshape(-1, d).index_select(0, flat).view(B, H_kv, K, d)
        self.v = self.v.reshape(-1, d).index_select(0, flat).view(B, H_kv, K, d)
        self.pos = self.pos.reshape(-1).index_select(0, flat).view(B, H_kv, K)
        if empty.any():
            self.k = self.k.masked_fill(empty[..., None], 0.0)
            self.v = self.v.masked_fill(empty[..., None], 0.0)
            self.pos = self.pos.masked_fill(empty, -1)

    def replace(self, k: Tensor, v: Tensor, pos: Tensor) -> None:
        """Overwrite the whole storage (for methods that rebuild entries). Shapes as in the class doc."""
        self.k, self.v, self.pos = k, v, pos

    def counts(self) -> Tensor:
        """Number of occupied (non-empty) slots per row and KV head, (B, H_kv)."""
        return (self.pos >= 0).sum(-1) if self.pos is not None else torch.zeros(0, dtype=torch.long)

    def nbytes(self) -> int:
        """Bytes held by K and V (positions are bookkeeping and are reported by ``pos_nbytes``)."""
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes

    def pos_nbytes(self) -> int:
        return 0 if self.pos is None else self.pos.nbytes


class KVCache:
    """All layers' storage, the number of tokens seen, and the policy that decides what is kept.

    ``policy=None`` is the plain cache: store everything, call nothing. Any ``CachePolicy`` (including
    ``FullCache``, which keeps everything) goes through the hook path; see ``policy.CachePolicy`` for the
    exact moments at which it is called.
    """

    def __init__(self, config: ModelConfig, policy=None) -> None:
        self.config = config
        self.policy = policy
        self.layers = [LayerKV() for _ in range(config.n_layer)]
        self.seen = 0           # tokens processed so far; the next token gets position `seen`

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, pos: Tensor, module) -> Tensor:
        """Called by layer ``layer``'s attention: store k/v, attend q over what is visible, run the policy.

        q (B, H, Tn, d); k, v (B, H_kv, Tn, d); pos (Tn,). Returns the attention output (B, H, Tn, d).
        """
        from .policy import StepContext   # local import: policy.py imports this module

        store = self.layers[layer]
        phase = "prefill" if self.seen == 0 else "decode"   # `extend` chunks count as decode steps
        store.append(k, v, pos)
        if self.policy is None:
            out, _ = attend(q, store.k, store.v, pos, store.pos)
            return out
        k_att, v_att, pos_att = self.policy.attend_kv(layer, store)
        out, probs = attend(q, k_att, v_att, pos, pos_att, need_probs=self.policy.needs_probs)
        ctx = StepContext(layer=layer, phase=phase, q=q, q_pos=pos, probs=probs, out=out, kv=store,
                          attn=module, config=self.config, seen=self.seen + q.shape[2])
        if phase == "prefill":
            self.policy.on_prefill(ctx)
        else:
            self.policy.on_decode(ctx)
        return out

    def nbytes(self) -> int:
        """K and V bytes stored over all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    def layer_nbytes(self) -> list[int]:
        return [layer.nbytes() for layer in self.layers]

    def reset(self) -> None:
        """Forget everything (the policy too), ready for a new sequence."""
        self.layers = [LayerKV() for _ in range(self.config.n_layer)]
        self.seen = 0
        if self.policy is not None:
            self.policy.reset()
