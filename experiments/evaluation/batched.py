"""
The batched engine: the fast engine's step with the caches' attention batched too, for a GPU
(``--engine batched`` and ``one-group``).

The caches of a step share their storage: per layer and group, ``k, v`` (N, H_kv, C, d) and ``pos``
(N, H_kv, C), a row per cache, -1 for an empty slot; each cache's ``LayerKV`` adopts its row
(``Group.adopt``), so its policy reads and evicts in place. A step writes every row's new entry with one
scatter, attends over all rows and slots at once, and runs each cache's hook on its row (or one hook for a
method's rows: ``row_hooks.py``). Each cache's logits agree with the fast engine's to float rounding.
How it works: ``inside.md``, "batched.py".
"""

from __future__ import annotations

import copy
import functools
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from fastpath.attention import attend_step
from fastpath.lean import LeanDecoder
from nanollm.attention import rope_cos_sin
from nanollm.cache import KVCache, LayerKV
from nanollm.policy import CachePolicy, Needs, StepContext
from nanollm.slots import to_device

from . import row_hooks
from .protocol import Probe
from .side_by_side import FastEngine, global_generators_untouched

MIN_SLOTS = 64          # the smallest group: a few decode steps of room beyond a small cache


def bucket(n: int) -> int:
    """The slots C of a group whose largest cache uses n slots: n + 1 rounded up to a quarter of n's power
    of two (at least ``MIN_SLOTS``), so that caches of similar sizes share a group and padding stays within
    about a quarter: 51 -> 64, 205 -> 256, 1,030 -> 1,280, 2,060 -> 2,560."""
    step = max(MIN_SLOTS, 1 << max(0, n.bit_length() - 3))
    return -(-(n + 1) // step) * step


def rebuilds_entries(policy: CachePolicy | None) -> bool:
    """Whether a policy (or one it wraps) attends to entries it rebuilds (``attend_kv``), not its storage."""
    while policy is not None:
        hook = getattr(type(policy), "attend_kv", CachePolicy.attend_kv)
        if hook not in (CachePolicy.attend_kv, Probe.attend_kv):         # Probe passes its inner's through
            return True
        policy = getattr(policy, "inner", None)
    return False


class Group:
    """Caches of about one size, their layers' entries in shared buffers (shapes in the module docstring)."""

    def __init__(self, caches: list[KVCache], slots: int) -> None:
        self.caches, self.C = caches, slots
        first, L = caches[0].layers[0], len(caches[0].layers)
        N, (_, H_kv, _, d), d_v = len(caches), first.k.shape, first.v.shape[-1]
        # zeros, not empty: an empty slot's v is multiplied by its probability 0, and 0 * NaN would be NaN
        self.k = [first.k.new_zeros(N, H_kv, slots, d) for _ in range(L)]
        self.v = [first.v.new_zeros(N, H_kv, slots, d_v) for _ in range(L)]
        # positions: a row's layers side by side (N, L, H_kv, C), pos[i] the view of layer i (N, H_kv, C), so that
        # a hook can take a row's every layer at once (``row_hooks.step_layers``)
        self.pos_rows = first.pos.new_full((N, L, H_kv, slots), -1)
        self.pos = list(self.pos_rows.unbind(1))
        # per layer and state name: the rows from the first cache holding it to the last, in one buffer, a row
        # each (a method's caches side by side then step as one: ``row_hooks.py``): name -> (first row, buffer);
        # a name with the same rows, shape and type at every layer: views of one buffer (rows, L, H_kv, C, ...)
        # in ``state_rows``, as ``pos_rows``
        rows = [{} for _ in range(L)]
        for i, layer in enumerate(rows):
            for r, cache in enumerate(caches):
                for name, t in cache.layers[i].buffers()[3].items():
                    layer.setdefault(name, [r, r, t])[1] = r
        kind = lambda lo, hi, t: (lo, hi, t.shape[3:], t.dtype)                # noqa: E731
        self.state_rows = {name: (lo, t.new_empty(hi - lo + 1, L, H_kv, slots, *t.shape[3:]))
                           for name, (lo, hi, t) in rows[0].items()
                           if all(name in layer and kind(*layer[name]) == kind(lo, hi, t) for layer in rows)}
        self.state: list[dict[str, tuple[int, Tensor]]] = [
            {name: (lo, self.state_rows[name][1][:, i] if name in self.state_rows else
                    t.new_empty(hi - lo + 1, H_kv, slots, *t.shape[3:])) for name, (lo, hi, t) in layer.items()}
            for i, layer in enumerate(rows)]
        self.fill = [{name: c.layers[i].fill[name] for c in caches for name in c.layers[i].state} for i in range(L)]
        for r, cache in enumerate(caches):
            for i, store in enumerate(cache.layers):
                self.adopt(i, r, store)

    def adopt(self, i: int, r: int, store: LayerKV) -> None:
        """Copy layer i's storage into row r (the slots after its n emptied), then make the storage a view of
        that row (its per-slot state gets C slots too), so that its policy's reads and writes are the group's."""
        n = store.n
        self.k[i][r, :, :n], self.v[i][r, :, :n], self.pos[i][r, :, :n] = store.k[0], store.v[0], store.pos[0]
        self.pos[i][r, :, n:] = -1                    # a row adopted again may hold older entries there
        state = {}
        for name, t in store.buffers()[3].items():    # its row of the group's buffer (a state made since: its own)
            lo, buffer = self.state[i].get(name, (r, None))
            if buffer is None or not 0 <= r - lo < len(buffer) or buffer.shape[3:] != t.shape[3:] \
                    or buffer.dtype != t.dtype or store.fill[name] != self.fill[i][name]:
                state[name] = t.new_empty((*t.shape[:2], self.C, *t.shape[3:]))
            else:
                state[name] = buffer[r - lo:r - lo + 1]
            state[name][:, :, n:] = store.fill[name]
            state[name][:, :, :n] = t[:, :, :n]
        store.adopt(self.k[i][r:r + 1], self.v[i][r:r + 1], self.pos[i][r:r + 1], state)

    def narrowed(self, keep: list[int]) -> "Group":
        """This group's caches at rows ``keep`` (ascending) as a group of their own, with the same slots: each
        buffer's rows gathered with one index (state buffers too, each from its rows in ``keep``), and the
        caches' storages made views of their new rows, as ``adopt`` leaves them. ``self`` with every row kept."""
        if len(keep) == len(self.caches):
            return self
        new = Group.__new__(Group)
        new.caches, new.C, new.fill = [self.caches[r] for r in keep], self.C, self.fill
        rows = to_device(keep, self.k[0].device)                                 # (n,) no host wait
        new.k, new.v = ([t.index_select(0, rows) for t in ts] for ts in (self.k, self.v))
        new.pos_rows = self.pos_rows.index_select(0, rows)
        new.pos = list(new.pos_rows.unbind(1))

        def kept(lo: int, buffer: Tensor) -> tuple[int, Tensor] | None:   # the rows kept in the buffer's range
            inside = [n for n, r in enumerate(keep) if lo <= r < lo + len(buffer)]     # consecutive n
            return (inside[0], buffer.index_select(0, to_device([keep[n] - lo for n in inside], buffer.device))) \
                if inside else None
        new.state_rows = {name: at for name, (lo, b) in self.state_rows.items() if (at := kept(lo, b)) is not None}
        new.state = []
        for i, layer in enumerate(self.state):        # name -> (first row, buffer) over the rows kept in its range
            state = {}
            for name, (lo, buffer) in layer.items():
                if name in self.state_rows:
                    if name in new.state_rows:
                        state[name] = (new.state_rows[name][0], new.state_rows[name][1][:, i])
                elif (at := kept(lo, buffer)) is not None:
                    state[name] = at
            new.state.append(state)
        for n, (r, cache) in enumerate(zip(keep, new.caches)):
            for i, store in enumerate(cache.layers):
                if not self.in_row(i, r, store):
                    continue                           # a storage a hook replaced: ``refit`` adopts it anew
                state = store.buffers()[3]
                for name, t in state.items():          # a state of the group's buffer: its new row (one of its
                    if self.holds(i, r, name, t):      # own, made since, stays its own)
                        lo, buffer = new.state[i][name]
                        state[name] = buffer[n - lo:n - lo + 1]
                store.adopt(new.k[i][n:n + 1], new.v[i][n:n + 1], new.pos[i][n:n + 1], state)
        return new

    def in_row(self, i: int, r: int, store: LayerKV) -> bool:
        """Whether layer i's storage ``store`` is still row r of the group's buffers (not one a hook replaced)."""
        ours, (k, v, pos, _) = (self.k[i][r], self.v[i][r], self.pos[i][r]), store.buffers()
        return k is not None and all(t is not None and t.data_ptr() == o.data_ptr()
                                     for t, o in zip((k, v, pos), ours))

    def holds(self, i: int, r: int, name: str, t: Tensor) -> bool:
        """Whether state ``t`` of row r at layer i is that row of the group's buffer for ``name`` (not a tensor
        of its own: one made since, by ``set_state``, or one the buffer's shape does not fit)."""
        lo, buffer = self.state[i].get(name, (r, None))
        return buffer is not None and 0 <= r - lo < len(buffer) and t.shape[1:] == buffer.shape[1:] \
            and t.data_ptr() == buffer[r - lo].data_ptr()

    def refit(self) -> bool:
        """Whether every cache can take a step in its row: a storage a hook replaced (``keep`` compacts, a
        method may ``replace``) is adopted again, in place; False when one no longer fits its row."""
        for r, cache in enumerate(self.caches):
            for i, store in enumerate(cache.layers):
                if not self.in_row(i, r, store):
                    if store.k is None or type(store) is not LayerKV or store.n + 1 > self.C:
                        return False
                    self.adopt(i, r, store)
                if store.capacity() != self.C or (store.free is None and store.n + 1 > self.C):
                    return False
        return True

    def write(self, i: int, k: Tensor, v: Tensor, pos: Tensor) -> None:
        """The step's entries k, v (N, H_kv, 1, d) at positions pos (N,) into layer i, each row at the slot
        ``LayerKV.append`` would use (the first its policy emptied, else the one after its last), whose
        per-slot state goes back to its fill value; the storages' counters move as ``append``'s would."""
        N, H_kv = k.shape[:2]
        after, emptied, firsts = [], [], []           # each row's next slot, whether it takes an emptied one
        for r, cache in enumerate(self.caches):
            store = cache.layers[i]
            if store.free is not None:                # an emptied slot first, as LayerKV.append
                slot = store.free[..., :1]                                       # (1, H_kv, 1)
                store.free = store.free[..., 1:] if store.free.shape[-1] > 1 else None
                after.append(0), emptied.append(1), firsts.append(slot.view(1, H_kv))
            else:
                slot = store.n
                store.n += 1
                after.append(slot), emptied.append(0), firsts.append(self.none(H_kv, k.device))
            for name, t in store.buffers()[3].items():   # an emptied slot's state back to its fill value (those
                if not isinstance(slot, int) and not self.holds(i, r, name, t):       # after n hold it already:
                    fill(t, slot.view(1, H_kv), store.fill[name])                     # ``adopt`` fills them)
        took = emptied                                # on the host: the rows that took an emptied slot
        after, emptied = to_device([after, emptied], k.device)                  # (N,) each
        slots = torch.where(emptied[:, None] == 1, torch.cat(firsts), after[:, None])   # (N, H_kv)
        for name, (lo, buffer) in self.state[i].items():   # the buffers' rows at once, each at its slot, where
            if any(took[lo:lo + len(buffer)]):              # one took an emptied slot (at n: the fill value is
                fill(buffer, slots[lo:lo + len(buffer)], self.fill[i][name])   # there already)
        at = slots[:, :, None]                                                   # (N, H_kv, 1)
        self.k[i].scatter_(2, at[..., None].expand_as(k), k)
        self.v[i].scatter_(2, at[..., None].expand_as(v), v)
        self.pos[i].scatter_(2, at, pos.view(N, 1, 1).expand(N, H_kv, 1))


    _none: dict = {}

    @classmethod
    def none(cls, H_kv: int, device) -> Tensor:
        """(1, H_kv) zeros on ``device``, made once: a row that takes no emptied slot, in ``write``'s cat."""
        key = (H_kv, str(device))
        if key not in cls._none:
            cls._none[key] = torch.zeros(1, H_kv, dtype=torch.long, device=device)
        return cls._none[key]


def fill(t: Tensor, slots: Tensor, value: float) -> None:
    """Per-slot state t (n, H_kv, C, ...) set to ``value`` at each row and head's slot ``slots`` (n, H_kv)."""
    n, H_kv = slots.shape
    t.scatter_(2, slots.view(n, H_kv, 1, *[1] * (t.dim() - 3)).expand(n, H_kv, 1, *t.shape[3:]), value)


def needs_of(policy: CachePolicy | None) -> Needs:
    """What a cache's policy asks of a decode step's attention (nothing for the plain cache)."""
    return Needs() if policy is None else policy.needs("decode")


class BatchedEngine(FastEngine):
    """``FastEngine`` (its ``fill``: one prompt pass for every cache) with every decode step batched across
    the caches as the module docstring says. ``step``'s seconds: each cache's own hook time plus an equal
    share of the rest of the step."""
    name = "batched"

    def __init__(self, model, alone: bool = False) -> None:
        if alone:
            raise ValueError("--time-alone steps each cache on its own: use --engine fast")
        super().__init__(model)
        self.groups: list[Group] = []                 # the last step's groups, and its caches' ids
        self.ids: tuple = ()

    @torch.no_grad()
    def fill(self, policies: list[CachePolicy], chunks: list[list[int]]) -> tuple[list[KVCache], Tensor]:
        self.release()                                # a new sample
        return super().fill(policies, chunks)

    def release(self) -> None:
        """The last step's groups dropped, so that their buffers go back (a new sample, or a batch's end)."""
        self.groups, self.ids = [], ()

    def fork(self, cache: KVCache) -> KVCache:
        """A copy of ``cache`` that shares nothing with it (``Trace.add``): its layers' used slots only, state
        included, so that a cache in a group is not copied with the whole group's buffers."""
        copies = {}                                    # deepcopy's memo: each buffer's used slots, copied once
        for s in cache.layers:
            k, v, pos, state = s.buffers()
            if k is not None:
                copies |= {id(k): s.k.clone(), id(v): s.v.clone(), id(pos): s.pos.clone()}
                copies |= {id(t): t[:, :, :s.n].clone() for t in state.values()}
        return copy.deepcopy(cache, copies)

    def arrange(self, caches: list[KVCache]) -> tuple[list[Group], list[int]]:
        """The groups of this step's caches (last step's, while they still hold), and the caches that attend
        on their own (rebuilt entries, or a storage the groups do not take)."""
        alone = [n for n, c in enumerate(caches) if rebuilds_entries(c.policy) or not groupable(c)]
        ids = tuple(id(c) for c in caches)
        if ids == self.ids and all(g.refit() for g in self.groups):
            return self.groups, alone
        grouped = {id(c) for n, c in enumerate(caches) if n not in alone}
        if grouped and grouped <= {id(c) for g in self.groups for c in g.caches}:
            # fewer caches than the last step's (a job, or a greedy answer, ended): each group keeps the rows of
            # those still stepped, gathered once per buffer, where new groups would copy each cache in
            kept = [[r for r, c in enumerate(g.caches) if id(c) in grouped] for g in self.groups]
            narrowed = [g.narrowed(rows) for g, rows in zip(self.groups, kept) if rows]
            if all(g.refit() for g in narrowed):
                self.groups, self.ids = narrowed, ids
                return self.groups, alone
        self.groups = []                              # the old buffers go back before the new are made
        by_size: dict[int, list[KVCache]] = {}
        for n, cache in enumerate(caches):
            if n not in alone:
                by_size.setdefault(bucket(max(s.n for s in cache.layers)), []).append(cache)
        self.groups = [Group(row_hooks.side_by_side(members), slots) for slots, members in self.merge(by_size)]
        self.ids = ids
        return self.groups, alone

    @staticmethod
    def merge(by_size: dict[int, list[KVCache]]) -> list[tuple[int, list[KVCache]]]:
        """The groups (slots, caches) from the caches by size: one group per size, smallest first."""
        return sorted(by_size.items())

    @torch.no_grad()
    def step(self, caches: list[KVCache], tokens: list[int]) -> tuple[Tensor, Tensor, list[float]]:
        if not caches or len(caches) != len(tokens) or len({id(c) for c in caches}) != len(caches):
            raise ValueError(f"one token per cache, each cache once: {len(tokens)} tokens, {len(caches)} caches")
        for cache in caches:
            self.lean.check_step(cache)
        t0 = time.perf_counter()
        groups, alone = self.arrange(caches)
        index = {id(c): n for n, c in enumerate(caches)}
        order = [index[id(c)] for g in groups for c in g.caches] + alone        # the step's rows, by group
        own = [0.0] * len(caches)
        with global_generators_untouched("a decode step"):
            logits, hidden = step_batched(self.lean, [tokens[n] for n in order], [caches[n] for n in order],
                                          groups, own)
        row_of = [0] * len(caches)                    # the caller's cache n is the step's row row_of[n]
        for row, n in enumerate(order):
            row_of[n] = row
        back = to_device(row_of, logits.device)
        own = [own[row] for row in row_of]
        self.caches_per_step = len(caches)
        shared = (time.perf_counter() - t0 - sum(own)) / len(caches)
        return logits[back], hidden[back], [s + shared for s in own]


def groupable(cache: KVCache) -> bool:
    """Whether a cache's storage can live in a group: every layer a one-sequence ``LayerKV`` holding entries."""
    return all(type(s) is LayerKV and s.k is not None and s.k.shape[0] == 1 for s in cache.layers)


@torch.no_grad()
def step_batched(lean: LeanDecoder, tokens: list[int], caches: list[KVCache], groups: list[Group],
                 own_seconds: list[float]) -> tuple[Tensor, Tensor]:
    """One decode step: ``tokens[n]`` into ``caches[n]``, the groups' caches first in their order, then those
    that attend alone. Returns logits (N, V) and final hidden states (N, D) in that order; each cache's
    hook time is added to ``own_seconds[n]``."""
    model = lean.model
    device = model.tok_emb.weight.device
    ids, row_pos = to_device([tokens, [c.seen for c in caches]], device)             # (N,) each: token, position
    x = F.embedding(ids, model.tok_emb.weight)                                         # (N, D)
    cos, sin = rope_cos_sin(row_pos, lean.inv_freq, x.dtype)                          # (N, d) each
    cos, sin = cos[:, None], sin[:, None]                                              # (N, 1, d)
    spans, first = [], 0                                                               # each group's rows
    for g in groups:
        spans.append(slice(first, first + len(g.caches)))
        first += len(g.caches)
    alone = range(first, len(caches))
    L, waiting = model.config.n_layer, {id(g): [] for g in groups}     # hooks waiting for the last layer

    def attend(i: int, attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:               # (N, H, 1, d)
        outs = []
        for g, rows in zip(groups, spans):
            g.write(i, k[rows], v[rows], row_pos[rows])
            each = [needs_of(cache.policy) for cache in g.caches]   # what each policy reads (Probe's may change)
            for cache in g.caches:                    # what the storage's attend_kv sees (Probe records it)
                if cache.policy is not None and cache.policy.attend_kv(i, cache.layers[i]) is not cache.layers[i]:
                    raise RuntimeError(f"{type(cache.policy).__name__} rebuilt its entries in a group")
            needs = functools.reduce(Needs.__or__, each, Needs())
            qp = row_pos[rows].view(-1, 1, 1)
            visible = g.pos[i].masked_fill(g.pos[i] > qp, -1)    # (n, H_kv, C): what each row's query sees
            out, probs, col_sums = attend_step(q[rows], g.k[i], g.v[i], needs, visible)
            together = set()                          # rows whose caches' hooks run at once (row_hooks.py),
            for run in row_hooks.runs(g, i) if row_hooks.ENABLED else ():   # after the step's last layer
                a, b = run.start, run.stop
                waiting[id(g)].append((i, run, (attn, q[rows][a:b], row_pos[rows.start + a:rows.start + b], out[a:b],
                                                None if probs is None else probs[a:b],
                                                None if col_sums is None else col_sums[a:b])))
                together.update(run)
            for run, seconds in row_hooks.catch_up(g, waiting[id(g)]) if i == L - 1 else ():
                for r in run:
                    own_seconds[rows.start + r] += seconds / len(run)
            for r, cache in enumerate(g.caches):
                if cache.policy is not None and r not in together:
                    t0 = time.perf_counter()
                    row = rows.start + r
                    hook(i, attn, cache, each[r], q[row:row + 1], row_pos[row:row + 1], out[r:r + 1],
                         probs, col_sums, r)
                    own_seconds[rows.start + r] += time.perf_counter() - t0
            outs.append(out)
        for n in alone:                               # storage of its own: the fast engine's way
            t0 = time.perf_counter()
            outs.append(lean.attend(caches[n], i, attn, q[n:n + 1], k[n:n + 1], v[n:n + 1], row_pos[n:n + 1]))
            own_seconds[n] += time.perf_counter() - t0
        return torch.cat(outs)

    logits, h = lean.forward(x, cos, sin, F.linear, attend)
    for cache in caches:
        cache.seen += 1
    return logits, h


class OneGroupEngine(BatchedEngine):
    """The batched engine with every cache that can share storage in one group, as large as the largest
    (``--engine one-group``): each cache's row padded to the largest cache's slots. A step then runs the
    group's writes and attention once per layer, where the batched engine runs them once per size (three to
    seven sizes in a step of ``experiments.compare``'s 25 caches), for more bytes read; and a method's caches
    at the three keep ratios, side by side in the group, take H2O's or Scissorhands' hook at once
    (``row_hooks.py``), over their padded rows. On a CPU the bytes cost more than the operations saved; on
    a GPU, where a step of a small model is bound by its launches, the trade may go the other way
    (``fastpath/README.md`` says whether it was measured)."""
    name = "one-group"

    @staticmethod
    def merge(by_size: dict[int, list[KVCache]]) -> list[tuple[int, list[KVCache]]]:
        """One group of every cache, the smallest first (``arrange`` then puts a method's side by side), with
        the largest size's slots."""
        return [(max(by_size), [c for size in sorted(by_size) for c in by_size[size]])] if by_size else []


def hook(i: int, attn, cache: KVCache, needs: Needs, q: Tensor, q_pos: Tensor, out: Tensor,
         probs: Tensor | None, col_sums: Tensor | None, r: int) -> None:
    """Cache ``cache``'s decode hook at layer i, with the context ``KVCache.attend`` gives it: its row r's
    output, and the probabilities and column sums it asks for (``needs``) over its own n slots."""
    store = cache.layers[i]
    n = store.n
    ctx = StepContext(layer=i, phase="decode", q=q, q_pos=q_pos,
                      probs=probs[r:r + 1, ..., :n] if needs.rows != 0 else None, out=out, kv=store,
                      attn=attn, config=cache.config, seen=cache.seen + 1, attended_pos=store.pos,
                      col_sums=col_sums[r:r + 1, :, :n] if needs.col_sums else None)
    cache.policy.on_decode(ctx)
