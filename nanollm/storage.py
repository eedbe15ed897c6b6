"""
What one layer of the standard attention stores: keys, values, positions, and per-slot side state.

Layout of one layer (``LayerKV``)::

    k, v   : (B, H_kv, T, d)   keys (after RoPE, at their original positions) and values
    pos    : (B, H_kv, T)      the absolute position of every stored entry; -1 marks an empty slot
    state  : name -> (B, H_kv, T, ...)   per-slot numbers a method keeps beside each entry (H2O's
             accumulated attention, Scissorhands' counters, ...), moved together with the entries

Each KV head may keep a different set of tokens (SnapKV selects per head), so positions are stored per
head. Heads may even keep different *numbers* of tokens (AdaKV): the shorter heads are padded with empty
slots (pos = -1), which attention never sees. ``T`` is the number of slots, not the number of tokens
seen: the cache counts those separately in ``KVCache.seen``, and a new token always gets position
``seen``. Conflating the two would rotate new keys at the wrong angle once anything has been evicted.

Per-slot state exists so that a method never has to keep its own table aligned with the storage by hand:
``append`` gives the new slots the state's fill value, ``keep`` moves the state with the entries (padding
slots get the fill value too).
"""

from __future__ import annotations

import torch
from torch import Tensor


class LayerKV:
    """One layer's storage. Empty until the first ``append`` unless built from tensors."""

    def __init__(self, k: Tensor | None = None, v: Tensor | None = None, pos: Tensor | None = None) -> None:
        self.k, self.v, self.pos = k, v, pos
        self.state: dict[str, Tensor] = {}      # name -> (B, H_kv, T, ...) aligned with the slots
        self.fill: dict[str, float] = {}        # name -> value given to new and empty slots

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
        for name, t in self.state.items():     # new slots start from the state's fill value
            new = t.new_full((B, H_kv, Tn, *t.shape[3:]), self.fill[name])
            self.state[name] = torch.cat([t, new], dim=2)

    def keep(self, idx: Tensor) -> None:
        """Keep only the slots ``idx`` (B, H_kv, K), per head, in the given order; -1 makes an empty slot.

        Rows are picked with one ``index_select`` over a flat (B*H_kv*T, d) view: a row gather, much
        faster on CPU than the element-wise ``torch.gather`` with an index expanded over d. Per-slot
        state moves with the entries.
        """
        B, H_kv, T, d = self.k.shape
        K = idx.shape[-1]
        empty = idx < 0
        base = torch.arange(B * H_kv, device=idx.device).view(B, H_kv, 1) * T   # first row of each head
        flat = (base + idx.clamp(min=0)).reshape(-1)                              # (B*H_kv*K,)

        def rows(t: Tensor) -> Tensor:                                            # (B, H_kv, T, ...) -> K
            rest = t.shape[3:]
            return t.reshape(B * H_kv * T, -1).index_select(0, flat).view(B, H_kv, K, *rest)

        self.k, self.v = rows(self.k), rows(self.v)
        self.pos = self.pos.reshape(-1).index_select(0, flat).view(B, H_kv, K)
        self.state = {name: rows(t) for name, t in self.state.items()}
        if empty.any():
            self.k = self.k.masked_fill(empty[..., None], 0.0)
            self.v = self.v.masked_fill(empty[..., None], 0.0)
            self.pos = self.pos.masked_fill(empty, -1)
            for name, t in self.state.items():
                e = empty.view(*empty.shape, *([1] * (t.dim() - 3)))
                self.state[name] = t.masked_fill(e, self.fill[name])

    def set_state(self, name: str, values: Tensor, fill: float = 0.0) -> None:
        """Store per-slot ``values`` (B, H_kv, T, ...) under ``name``; slots added later start at ``fill``."""
        if values.shape[:3] != self.pos.shape:
            raise ValueError(f"state {name!r} must have shape (B, H_kv, T, ...) = {tuple(self.pos.shape)} "
                             f"+ ..., got {tuple(values.shape)}")
        self.state[name] = values
        self.fill[name] = fill

    def replace(self, k: Tensor, v: Tensor, pos: Tensor) -> None:
        """Overwrite the entries (for methods that rebuild them). Shapes as in the module doc; per-slot
        state must be re-set by the caller if the slots changed."""
        self.k, self.v, self.pos = k, v, pos
        self.state, self.fill = {}, {}

    def counts(self) -> Tensor:
        """Number of occupied (non-empty) slots per row and KV head, (B, H_kv)."""
        return (self.pos >= 0).sum(-1) if self.pos is not None else torch.zeros(0, dtype=torch.long)

    def nbytes(self) -> int:
        """Bytes held by K and V (positions are bookkeeping and are reported by ``pos_nbytes``)."""
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes

    def pos_nbytes(self) -> int:
        return 0 if self.pos is None else self.pos.nbytes

    def state_nbytes(self) -> int:
        """Bytes of the per-slot state (a method's side tables, reported apart from K and V)."""
        return sum(t.nbytes for t in self.state.values())
