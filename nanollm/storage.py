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

Growing without copying. The naive cache appends with ``torch.cat([k, k_new])``: a fresh tensor and a copy
of the *whole* layer at every decode step, so one step costs O(T) in copies and a generation O(T^2), far
more than the attention itself reads. Here ``k``, ``v`` and ``pos`` are views of the first T slots of
larger buffers: ``append`` writes the new entries in place after them and reallocates only when the
buffer is full, doubling its capacity, so the copies add up to O(T) over a whole generation (each entry
is moved about once on average). ``keep`` gathers the kept slots into fresh buffers with some room left
for the next appends.

Per-slot state exists so that a method never has to keep its own table aligned with the storage by hand:
``append`` gives the new slots the state's fill value, ``keep`` moves the state with the entries (padding
slots get the fill value too). State usually holds a few numbers per slot, small next to K and V, and
simply grows by concatenation (Scissorhands' history of w flags per slot is the exception: larger than
the entry itself at w = 400, and copied at every step).

``dense`` tells attention it may skip the mask (``attention.attend``): it is True when no slot is empty
(no -1) and no stored position lies after the newest entry, so a decode step's query (the newest entry)
sees every stored slot. Entries that came in through ``append`` are dense; ``keep`` preserves that unless
it leaves empty slots; storage built from arbitrary tensors is not dense until proven otherwise (a method
that rebuilds every position in order, like KVReviver, sets it itself).

Memory. The buffers hold up to twice the entries in use right after they double; ``nbytes`` counts the
entries (what the cache *stores*, what the harness and the tables report), ``allocated_nbytes`` the
buffers (what the process *holds*). The first append leaves ``MIN_CAPACITY`` slots of room, so the decode
steps right after a prompt write in place instead of doubling a prompt-sized buffer at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

MIN_CAPACITY = 64           # slots of room per head left by the first append and by keep


def gather_slots(t: Tensor, idx: Tensor, rows: Tensor | None = None) -> Tensor:
    """t (B, H_kv, S, ...) -> (B, H_kv, K, ...): the slots ``idx`` (B, H_kv, K) of every head, as one
    ``index_select`` of rows over a flat (B*H_kv*S, -1) view (a row gather: much faster on CPU than the
    element-wise ``torch.gather`` with an index expanded over the last dimensions). ``rows``:
    ``slot_rows(idx, S)`` if already computed (tensors with the same first three sizes share it)."""
    B, H_kv, S = t.shape[:3]
    rows = slot_rows(idx, S) if rows is None else rows
    return t.reshape(B * H_kv * S, -1).index_select(0, rows).view(B, H_kv, idx.shape[-1], *t.shape[3:])


def slot_rows(idx: Tensor, S: int) -> Tensor:
    """Slots ``idx`` (B, H_kv, K) of heads holding S slots each -> their rows (B*H_kv*K,) in a flat
    (B*H_kv*S, -1) view."""
    B, H_kv = idx.shape[:2]
    first = torch.arange(B * H_kv, device=idx.device).view(B, H_kv, 1) * S     # first row of each head
    return (first + idx).reshape(-1)


class LayerKV:
    """One layer's storage. Empty until the first ``append`` unless built from tensors."""

    def __init__(self, k: Tensor | None = None, v: Tensor | None = None, pos: Tensor | None = None) -> None:
        # buffers (B, H_kv, capacity, ...) and the number of slots in use; k, v, pos are views of them
        self._k, self._v, self._pos = k, v, pos
        self.n = 0 if k is None else k.shape[2]
        self.dense = k is None                  # see the module docstring
        self.state: dict[str, Tensor] = {}      # name -> (B, H_kv, T, ...) aligned with the slots
        self.fill: dict[str, float] = {}        # name -> value given to new and empty slots

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
        """Number of slots T (including empty ones)."""
        return self.n

    def capacity(self) -> int:
        """Slots allocated per head (>= T)."""
        return 0 if self._k is None else self._k.shape[2]

    def _grow(self, need: int) -> None:
        """Reallocate the buffers with room for at least ``need`` slots (doubling), keeping the first T."""
        cap = max(need, 2 * self.capacity(), MIN_CAPACITY)
        B, H_kv, _, d = self._k.shape
        k = self._k.new_empty(B, H_kv, cap, d)
        v = self._v.new_empty(B, H_kv, cap, self._v.shape[-1])
        pos = self._pos.new_full((B, H_kv, cap), -1)
        k[:, :, :self.n], v[:, :, :self.n], pos[:, :, :self.n] = self.k, self.v, self.pos
        self._k, self._v, self._pos = k, v, pos

    def append(self, k: Tensor, v: Tensor, pos: Tensor) -> None:
        """Add new entries at the end. k, v (B, H_kv, Tn, d); pos (Tn,) shared by every row and head."""
        B, H_kv, Tn, d = k.shape
        if self._k is None:                     # the first append: allocate with room to grow
            cap = Tn + MIN_CAPACITY
            self._k, self._v = k.new_empty(B, H_kv, cap, d), v.new_empty(B, H_kv, cap, v.shape[-1])
            self._pos = pos.new_full((B, H_kv, cap), -1)
        elif self.n + Tn > self.capacity():
            self._grow(self.n + Tn)
        # BEGIN SOLUTION [cache] write k, v, pos into slots n..n+Tn-1 of the buffers, in place; then advance n
        end = self.n + Tn
        self._k[:, :, self.n:end] = k           # written in place: no copy of the stored slots
        self._v[:, :, self.n:end] = v
        self._pos[:, :, self.n:end] = pos
        self.n = end
        # END SOLUTION
        for name, t in self.state.items():     # new slots start from the state's fill value
            new = t.new_full((B, H_kv, Tn, *t.shape[3:]), self.fill[name])
            self.state[name] = torch.cat([t, new], dim=2)

    def keep(self, idx: Tensor) -> None:
        """Keep only the slots ``idx`` (B, H_kv, K), per head, in the given order; -1 makes an empty slot.

        Rows are picked by ``gather_slots``. The gathered buffers get ``MIN_CAPACITY`` extra slots (copies
        of a slot 0, never read: past ``T``) so the next appends write in place (for a method that evicts
        at every step, the append between two evictions never reallocates; ``keep`` itself always gathers
        into fresh buffers). Per-slot state moves with the entries.
        """
        K = idx.shape[-1]
        empty = idx < 0
        slots = idx.clamp(min=0)
        with_room = torch.nn.functional.pad(slots, (0, MIN_CAPACITY))          # (B, H_kv, K + room)
        rows = slot_rows(with_room, self.capacity())                           # the same for k, v and pos
        self._k, self._v, self._pos = (gather_slots(t, with_room, rows) for t in (self._k, self._v, self._pos))
        self._pos[:, :, K:] = -1
        if self.state:
            rows = slot_rows(slots, self.n)                                    # the state has T slots per head
            self.state = {name: gather_slots(t, slots, rows) for name, t in self.state.items()}
        self.n = K
        if empty.any():
            self.dense = False
            self.k.masked_fill_(empty[..., None], 0.0)
            self.v.masked_fill_(empty[..., None], 0.0)
            self.pos.masked_fill_(empty, -1)
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
        state must be re-set by the caller if the slots changed. The storage is then not ``dense``."""
        self._k, self._v, self._pos, self.n = k, v, pos, k.shape[2]
        self.dense = False
        self.state, self.fill = {}, {}

    def counts(self) -> Tensor:
        """Number of occupied (non-empty) slots per row and KV head, (B, H_kv)."""
        return (self.pos >= 0).sum(-1) if self.pos is not None else torch.zeros(0, dtype=torch.long)

    def nbytes(self) -> int:
        """Bytes held by K and V (positions are bookkeeping and are reported by ``pos_nbytes``): the T slots
        in use of the buffers."""
        if self._k is None or self.n == 0:
            return 0
        return (self._k.nbytes + self._v.nbytes) // self._k.shape[2] * self.n

    def allocated_nbytes(self) -> int:
        """Bytes of the K and V buffers including the room not yet used (what the process really holds)."""
        return 0 if self._k is None else self._k.nbytes + self._v.nbytes

    def pos_nbytes(self) -> int:
        return 0 if self.pos is None else self.pos.nbytes

    def state_nbytes(self) -> int:
        """Bytes of the per-slot state (a method's side tables, reported apart from K and V)."""
        return sum(t.nbytes for t in self.state.values())
