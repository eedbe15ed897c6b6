"""
What one layer of the standard attention stores: keys, values, positions, and per-slot state.

    k, v   : (B, H_kv, T, d)        keys (rotated at their own positions) and values
    pos    : (B, H_kv, T)           the absolute position of every entry; -1 marks an empty slot
    state  : name -> (B, H_kv, T, ...)   numbers a method keeps beside each entry, moved with it

Positions are per KV head: heads may keep different tokens, and different numbers of them (the shorter
padded with empty slots). T counts slots, not tokens seen (``KVCache.seen``). ``append`` writes in place
into buffers with room to spare, doubling them when full: a generation copies O(T) bytes in all, where
``torch.cat`` at every token would copy O(T^2).
"""

from __future__ import annotations

import torch
from torch import Tensor

MIN_CAPACITY = 64           # slots of room left by the first append and by keep


def gather_slots(t: Tensor, idx: Tensor) -> Tensor:
    """t (B, H_kv, S, ...) -> (B, H_kv, K, ...): the slots idx (B, H_kv, K) of every head, as rows of a flat
    (B*H_kv*S, -1) view (one index_select: on CPU much faster than gather with an expanded index)."""
    B, H_kv, S = t.shape[:3]
    rows = (torch.arange(B * H_kv, device=idx.device).view(B, H_kv, 1) * S + idx).reshape(-1)
    return t.reshape(B * H_kv * S, -1).index_select(0, rows).view(B, H_kv, idx.shape[-1], *t.shape[3:])


class LayerKV:
    """One layer's storage. Empty until the first ``append`` unless built from tensors."""

    def __init__(self, k: Tensor | None = None, v: Tensor | None = None, pos: Tensor | None = None) -> None:
        self._k, self._v, self._pos = k, v, pos      # buffers (B, H_kv, capacity, ...); k, v, pos view them
        self.n = 0 if k is None else k.shape[2]      # slots in use
        self.state: dict[str, Tensor] = {}           # name -> (B, H_kv, T, ...) aligned with the slots
        self.fill: dict[str, float] = {}             # name -> value of new and empty slots

    @property
    def k(self) -> Tensor | None:
        return None if self._k is None else self._k[:, :, :self.n]

    @property
    def v(self) -> Tensor | None:
        return None if self._v is None else self._v[:, :, :self.n]

    @property
    def pos(self) -> Tensor | None:
        return None if self._pos is None else self._pos[:, :, :self.n]

    def __len__(self) -> int:
        return self.n

    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    def append(self, k: Tensor, v: Tensor, pos: Tensor) -> None:
        """Add k, v (B, H_kv, Tn, d) at positions pos (Tn,): in place while there is room, else into buffers of
        twice the capacity (room's positions -1; ``MIN_CAPACITY`` at first); each state gets Tn fill-value slots."""
        # BEGIN SOLUTION [cache:append] grow as the docstrings say: O(1) bytes per token, amortised (notebook 07 §2)
        B, H_kv, Tn, d = k.shape
        if self.n + Tn > self.capacity():             # reallocate: double, keep the first n slots
            cap = Tn + MIN_CAPACITY if self._k is None else max(self.n + Tn, 2 * self.capacity(), MIN_CAPACITY)
            old = (self._k, self._v, self._pos)
            self._k, self._v = k.new_empty(B, H_kv, cap, d), v.new_empty(B, H_kv, cap, v.shape[-1])
            self._pos = pos.new_full((B, H_kv, cap), -1)
            if old[0] is not None:
                self._k[:, :, :self.n], self._v[:, :, :self.n], self._pos[:, :, :self.n] = (
                    t[:, :, :self.n] for t in old)
        end = self.n + Tn
        self._k[:, :, self.n:end] = k
        self._v[:, :, self.n:end] = v
        self._pos[:, :, self.n:end] = pos
        self.n = end
        for name, t in self.state.items():            # new slots start at the state's fill value
            self.state[name] = torch.cat([t, t.new_full((B, H_kv, Tn, *t.shape[3:]), self.fill[name])], dim=2)
        # END SOLUTION

    def keep(self, idx: Tensor) -> None:
        """Keep only the slots idx (B, H_kv, K) of each head, in that order; -1 makes an empty slot. The
        state moves with the entries; the new buffers keep ``MIN_CAPACITY`` slots of room."""
        K = idx.shape[-1]
        empty = idx < 0
        slots = idx.clamp(min=0)
        with_room = torch.nn.functional.pad(slots, (0, MIN_CAPACITY))         # (B, H_kv, K + room)
        self._k, self._v, self._pos = (gather_slots(t, with_room) for t in (self._k, self._v, self._pos))
        self._pos[:, :, K:] = -1
        self.state = {name: gather_slots(t, slots) for name, t in self.state.items()}
        self.n = K
        if empty.any():
            self.k.masked_fill_(empty[..., None], 0.0)
            self.v.masked_fill_(empty[..., None], 0.0)
            self.pos.masked_fill_(empty, -1)
            for name, t in self.state.items():
                self.state[name] = t.masked_fill(empty.view(*empty.shape, *[1] * (t.dim() - 3)), self.fill[name])

    def set_state(self, name: str, values: Tensor, fill: float = 0.0) -> None:
        """Per-slot ``values`` (B, H_kv, T, ...) under ``name``; slots added later start at ``fill``."""
        if values.shape[:3] != self.pos.shape:
            raise ValueError(f"state {name!r} must have shape (B, H_kv, T, ...) = {tuple(self.pos.shape)} "
                             f"+ ..., got {tuple(values.shape)}")
        self.state[name], self.fill[name] = values, fill

    def replace(self, k: Tensor, v: Tensor, pos: Tensor) -> None:
        """Overwrite every entry (a method that rebuilds them); its per-slot state is dropped."""
        self._k, self._v, self._pos, self.n = k, v, pos, k.shape[2]
        self.state, self.fill = {}, {}

    def counts(self) -> Tensor:
        """(B, H_kv) occupied slots."""
        return (self.pos >= 0).sum(-1) if self.pos is not None else torch.zeros(0, dtype=torch.long)

    def nbytes(self) -> int:
        """Bytes of K and V in the T slots in use (what the cache stores)."""
        return 0 if self._k is None else (self._k.nbytes + self._v.nbytes) // self._k.shape[2] * self.n

    def allocated_nbytes(self) -> int:
        return 0 if self._k is None else self._k.nbytes + self._v.nbytes     # the buffers, room included

    def pos_nbytes(self) -> int:
        return 0 if self.pos is None else self.pos.nbytes

    def state_nbytes(self) -> int:
        return sum(t.nbytes for t in self.state.values())
