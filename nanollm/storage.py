"""
What one layer of the standard attention stores: keys, values, positions, and per-slot state.

    k, v   : (B, H_kv, T, d)        keys (rotated at their own positions) and values
    pos    : (B, H_kv, T)           the absolute position of every entry; -1 marks an empty slot
    state  : name -> (B, H_kv, T, ...)   numbers a method keeps beside each entry, in the same slots

Positions are per KV head: heads may keep different tokens, and different numbers of them (the shorter
padded with empty slots). T counts slots, not tokens seen (``KVCache.seen``). Buffers have room to spare,
doubled when full: ``append`` writes in place, O(T) bytes copied in a generation where ``torch.cat`` per
token copies O(T^2). ``keep`` drops entries by compacting (after a prompt); ``evict`` empties slots in place
and the next ``append`` fills them (O(1) per decoded token); slots need not follow positions (the mask reads pos).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_state
from .slots import StateViews, gather_slots

MIN_CAPACITY = 64           # slots of room left by the first append and by keep


class LayerKV:
    """One layer's storage. Empty until the first ``append`` unless built from tensors."""

    def __init__(self, k: Tensor | None = None, v: Tensor | None = None, pos: Tensor | None = None) -> None:
        self._k, self._v, self._pos = k, v, pos      # buffers (B, H_kv, capacity, ...); k, v, pos view them
        self.n = 0 if k is None else k.shape[2]      # slots in use
        self.free: Tensor | None = None              # (B, H_kv, F) slots ``evict`` emptied, refilled first
        self._state: dict[str, Tensor] = {}          # name -> buffer (B, H_kv, capacity, ...)
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

    @property
    def state(self) -> StateViews:
        return StateViews({name: t[:, :, :self.n] for name, t in self._state.items()})   # writes go to the buffer

    def __len__(self) -> int:
        return self.n - (0 if self.free is None else self.free.shape[-1])   # slots in use, less those emptied

    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    def append(self, k: Tensor, v: Tensor, pos: Tensor) -> None:
        """Add k, v (B, H_kv, Tn, d) at positions pos (Tn,): first into the slots ``evict`` emptied (each head's
        own), the rest after the slots in use, in place while there is room, else into buffers of twice the capacity
        or more (room's positions -1; the first leaves ``MIN_CAPACITY`` past its chunk); new state slots: its fill."""
        reuse = 0 if self.free is None else min(k.shape[2], self.free.shape[-1])
        if reuse:                                     # the emptied slots first: no other slot moves
            freed = self.free[..., :reuse]                                       # (B, H_kv, reuse)
            self.free = self.free[..., reuse:] if reuse < self.free.shape[-1] else None
            self.write(freed, k[:, :, :reuse], v[:, :, :reuse], pos[:reuse])
            if reuse == k.shape[2]:
                return
            k, v, pos = k[:, :, reuse:], v[:, :, reuse:], pos[reuse:]
        B, H_kv, Tn, d = k.shape
        # BEGIN SOLUTION [cache:append] grow as the docstrings say: O(1) bytes per token, amortised (notebook 07 §1)
        if self.n + Tn > self.capacity():             # reallocate: double, keep the first n slots
            cap = Tn + MIN_CAPACITY if self._k is None else max(self.n + Tn, 2 * self.capacity(), MIN_CAPACITY)
            old = [self._k, self._v, self._pos, *self._state.values()]
            self._k, self._v = k.new_empty(B, H_kv, cap, d), v.new_empty(B, H_kv, cap, v.shape[-1])
            self._pos = pos.new_full((B, H_kv, cap), -1)
            self._state = {name: t.new_empty(B, H_kv, cap, *t.shape[3:]) for name, t in self._state.items()}
            for was, now in zip(old, [self._k, self._v, self._pos, *self._state.values()]):
                if was is not None:                   # the first n slots move over
                    now[:, :, :self.n] = was[:, :, :self.n]
        end = self.n + Tn
        self._k[:, :, self.n:end] = k
        self._v[:, :, self.n:end] = v
        self._pos[:, :, self.n:end] = pos
        for name, t in self._state.items():           # new slots start at the state's fill value
            t[:, :, self.n:end] = self.fill[name]
        self.n = end
        # END SOLUTION

    def write(self, slots: Tensor, k: Tensor, v: Tensor, pos: Tensor) -> None:
        """Entries k, v (B, H_kv, E, d) at positions pos (E,) into the slots (B, H_kv, E), in place; every
        state there back to its fill value."""
        B, H_kv, E = slots.shape

        def at(t: Tensor) -> Tensor:                  # the slots as an index of t (B, H_kv, E, ...)
            return slots.view(B, H_kv, E, *[1] * (t.dim() - 3)).expand(B, H_kv, E, *t.shape[3:])
        self._k.scatter_(2, at(self._k), k)
        self._v.scatter_(2, at(self._v), v)
        self._pos.scatter_(2, slots, pos.expand(B, H_kv, E))
        for name, t in self._state.items():
            t.scatter_(2, at(t), self.fill[name])

    def evict(self, idx: Tensor) -> None:
        """Empty the slots idx (B, H_kv, E), as many in every head, moving no other: their positions become -1
        (attention skips them) and the next ``append`` writes there."""
        self._pos.scatter_(2, idx, -1)
        self.free = idx if self.free is None else torch.cat([self.free, idx], dim=-1)

    def keep(self, idx: Tensor) -> None:
        """Keep only the slots idx (B, H_kv, K) of each head, in that order; -1 makes an empty slot. The
        state moves with the entries; the new buffers keep ``MIN_CAPACITY`` slots of room."""
        K, empty = idx.shape[-1], idx < 0
        at = torch.nn.functional.pad(idx.clamp(min=0), (0, MIN_CAPACITY))          # (B, H_kv, K + room)
        self._k, self._v, self._pos, *states = gather_slots([self._k, self._v, self._pos, *self._state.values()], at)
        self._pos[:, :, K:] = -1
        self._state = dict(zip(self._state, states))
        self.n, self.free = K, None
        if empty.any():
            self.k.masked_fill_(empty[..., None], 0.0)
            self.v.masked_fill_(empty[..., None], 0.0)
            self.pos.masked_fill_(empty, -1)
            for name, t in self.state.items():
                t.masked_fill_(empty.view(*empty.shape, *[1] * (t.dim() - 3)), self.fill[name])

    def set_state(self, name: str, values: Tensor, fill: float = 0.0) -> None:
        """Per-slot ``values`` (B, H_kv, T, ...) under ``name``; slots added later start at ``fill``."""
        check_state(name, values, self.pos)
        self._state[name] = values.new_full((*values.shape[:2], self.capacity(), *values.shape[3:]), fill)
        self._state[name][:, :, :self.n], self.fill[name] = values, fill

    def replace(self, k: Tensor, v: Tensor, pos: Tensor, n: int | None = None) -> None:
        """Overwrite every entry (rebuilt by a method), the state dropped; n: entries in use, then room (pos -1)."""
        self._k, self._v, self._pos, self.n, self.free = k, v, pos, k.shape[2] if n is None else n, None
        self._state, self.fill = {}, {}

    def buffers(self) -> tuple[Tensor | None, Tensor | None, Tensor | None, dict[str, Tensor]]:
        """k, v, pos and the states by name: the whole buffers (B, H_kv, capacity, ...), room included."""
        return self._k, self._v, self._pos, dict(self._state)

    def adopt(self, k: Tensor, v: Tensor, pos: Tensor, state: dict[str, Tensor] | None = None) -> None:
        """Keep the slots in these buffers (shaped as ``buffers``'s, holding this storage's slots) from now on, as
        code laying many storages side by side does; ``state`` (name -> buffer) replaces the states' buffers."""
        self._k, self._v, self._pos = k, v, pos
        self._state = self._state if state is None else dict(state)

    def counts(self) -> Tensor:
        """(B, H_kv) occupied slots."""
        return (self.pos >= 0).sum(-1) if self.pos is not None else torch.zeros(0, dtype=torch.long)

    def nbytes(self) -> int:
        """Bytes of K and V in the slots in use, evicted ones waiting for a token left out (what it stores)."""
        return 0 if self._k is None else (self._k.nbytes + self._v.nbytes) // self._k.shape[2] * len(self)

    def allocated_nbytes(self) -> int:
        return 0 if self._k is None else self._k.nbytes + self._v.nbytes     # the buffers, room included

    def state_nbytes(self) -> int:
        return sum(t.nbytes // self.n * len(self) for t in self.state.values() if self.n)
