"""
KVReviver's decode step with every layer's compression, and the next step's rebuild, at once.

    policy = make_policy("kvreviver", budget=256)
    every_layer_at_once(policy)        # the same policy, its Algorithms 3 and 4 batched over the layers
    every_layer_at_once_on(policies)   # each KVReviver among them (the evaluation's fast engines)

Each layer's compression waits for the step's last layer, then all run at once as rows of one tensor, with one
host wait for every row's swap test; where the rows would not share shapes, a layer compresses right away. The
next step's entries are rebuilt ahead for every layer where a rebuild takes every position at once (a GPU, or a
CPU where ``kvreviver.REBUILD_CHUNK`` covers the sketch's positions); elsewhere each layer rebuilds in chunks
just before its attention. The results are ``KVReviverPolicy``'s to the last bit
(``tests/fastpath/test_reviver.py``).

How it works: fastpath/inside.md, section "reviver.py: KVReviver's layers compressed at once".
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastpath.sketch import KernelSketch
from methods import kvreviver
from methods.kvreviver import KVReviverPolicy, overflow_slots, swap_test
from methods.kvreviver_sketch import VagueSketch
from nanollm.policy import CachePolicy, StepContext
from nanollm.storage import LayerKV


class KVReviverLayersAtOnce(KVReviverPolicy):
    """``KVReviverPolicy`` whose decode hook compresses every layer at the step's last layer, at once (see the
    module docstring). The same fields and results; made from a policy by ``every_layer_at_once``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._start_queue()

    def _start_queue(self) -> None:
        """No layer waiting, no cells or rebuilt entries made ahead yet."""
        self._waiting, self._cells, self._tables_at, self._buffers, self._rebuilt = [], None, None, None, None

    def on_decode(self, ctx: StepContext) -> None:
        waiting = self._waiting
        if waiting and (ctx.layer <= waiting[-1].layer or ctx.seen != waiting[0].seen):
            self.catch_up()                                                      # a step that did not end
        self._accumulate(ctx)                                                    # the layer's scores, now
        if not self._stackable(ctx):
            self.catch_up()
            self._rebuilt = None                                                 # this layer's storage changes
            self._compress(ctx)
            return
        self._waiting.append(ctx)
        if ctx.layer == ctx.config.n_layer - 1:
            self.catch_up()

    def _stackable(self, ctx: StepContext) -> bool:
        """Whether layer ``ctx.layer``'s compression can wait and run with the others: the same budget in every
        layer, a sketch with cells already made (so ``_compress`` goes the whole way), plain sketches (an
        ablation's own may work otherwise) and the shapes of the layers already waiting."""
        sketches = self._sketch.get(ctx.layer)
        if self.layer_budgets is not None or not sketches or ctx.kv.free is not None or sketches[0].injective:
            return False
        if any(type(s) not in (VagueSketch, KernelSketch) for s in sketches):
            return False
        if self._waiting:
            first = self._waiting[0]
            if (ctx.q.shape[2] != first.q.shape[2] or ctx.kv.k.shape != first.kv.k.shape
                    or ctx.kv.v.shape != first.kv.v.shape or self._recent[ctx.layer] != self._recent[first.layer]):
                return False
        return True

    # -- a layer's state read from outside: its compression first ----------------------------------------
    def waits(self, layer: int) -> None:
        """Compress what waits if layer ``layer`` is among it (the next layers' attention reads their own)."""
        if any(ctx.layer == layer for ctx in self._waiting):
            self.catch_up()

    def attend_kv(self, layer, store):
        """``KVReviverPolicy.attend_kv``: the entries rebuilt at the last step's end for every layer, with this
        step's entry written into its slot, where the storage holds that step's view and one entry more;
        else rebuilt here."""
        self.waits(layer)
        if self._rebuilt is not None:
            layers, views, k, v, pos = self._rebuilt
            i = layers.index(layer) if layer in layers else -1
            if i >= 0 and store.buffers()[0] is views[i] and store.n == views[i].shape[2]:
                T = store.n - 1                                                  # the step's entry is in slot T
                k, v = k[i], v[i]                                                # (B, H_kv, seen + 1, d)
                k[:, :, -1], v[:, :, -1] = store.k[:, :, T], store.v[:, :, T]
                rebuilt = LayerKV(k, v, pos)
                self.rebuilt_nbytes = max(self.rebuilt_nbytes, rebuilt.nbytes())
                return rebuilt
        return super().attend_kv(layer, store)

    def exact_positions(self, layer, store):
        self.waits(layer)
        return super().exact_positions(layer, store)

    def parts(self, layer, store, row=0, head=0):
        self.waits(layer)
        return super().parts(layer, store, row, head)

    def slot_nbytes(self) -> int:
        self.catch_up()
        return super().slot_nbytes()

    def on_prefill(self, ctx: StepContext) -> None:
        self.catch_up()
        self._rebuilt = None
        super().on_prefill(ctx)

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``: greedy's fork) compresses what waits first, and leaves out the last
        step's buffers, which the storages view (a fork copies the storages on their own), and the entries
        rebuilt for the next step (the copy rebuilds its own)."""
        self.catch_up()
        return {**self.__dict__, "_buffers": None, "_rebuilt": None}

    def reset(self) -> None:
        super().reset()
        self._start_queue()

    # -- Algorithm 3 for every waiting layer at once ------------------------------------------------------
    def catch_up(self) -> None:
        """Compress every layer that waits, at once (``KVReviverPolicy._compress`` for each, to the last bit)."""
        waiting, self._waiting = self._waiting, []
        if waiting:
            self._rebuilt = None
        if len(waiting) == 1:
            return self._compress(waiting[0])
        if not waiting:
            return
        first, layers = waiting[0], [c.layer for c in waiting]
        split = self.split(self.budget)
        stores = [c.kv for c in waiting]
        for layer in layers:                                                     # R.Push, R -> C overflow
            self._recent[layer] += first.q.shape[2]
            if self._recent[layer] > split.recent + split.slack:
                self._recent[layer] = split.recent
        recent, seen = self._recent[first.layer], first.seen
        B, H_kv, T, d = first.kv.k.shape
        S = self.groups(H_kv)
        G, dv, L = H_kv // S, first.kv.v.shape[-1], len(waiting)
        X = L * B * S                                                            # rows: (layer, sequence, group)
        sketches = [s for layer in layers for s in self._sketch[layer]]          # X, row by row
        for sketch in sketches:
            sketch.cover(seen)                                                   # hash tables (positions < seen)
        key, value, cells, signs = self._stacked(layers, sketches)
        k, v, p = self._stored(layers, stores, X, G, T, d, dv)                   # (X, G, T, d), (X, G, T, dv), (X, T)
        scores = torch.stack([self.by_group(self._scores[layer]) for layer in layers]).view(X, -1)   # (X, N)
        recent_from = seen - recent
        n_out = T - recent - split.candidate                                     # the same in every row
        if n_out > 0:                                                            # ``_overflow``, every row
            out, kept = overflow_slots(scores.gather(1, p), p >= recent_from, n_out)   # (X, n_out), (X, T2)
            at = p.gather(1, out)                                                # the leaving slots' positions
            k_out = k.gather(2, out[:, None, :, None].expand(X, G, n_out, d)).transpose(1, 2)    # (X, n, G, d)
            v_out = v.gather(2, out[:, None, :, None].expand(X, G, n_out, dv)).transpose(1, 2)
            self._insert(sketches[0], key, value, cells, signs, at, k_out, v_out)
            T = kept.shape[1]
            k = k.gather(2, kept[:, None, :, None].expand(X, G, T, d))
            v = v.gather(2, kept[:, None, :, None].expand(X, G, T, dv))
            p = p.gather(1, kept)
        # new buffers, a slot of room for the next step's entry (its position -1), as ``_compress`` makes them
        k_buf, v_buf = k.new_empty(X, G, T + 1, d), v.new_empty(X, G, T + 1, dv)
        p_buf = p.new_full((X, G, T + 1), -1)
        k_buf[:, :, :T], v_buf[:, :, :T], p_buf[:, :, :T] = k, v, p[:, None, :]
        self._swaps(layers, sketches, scores, k_buf[:, :, :T], v_buf[:, :, :T], p_buf[:, :, :T], recent_from,
                    split.candidate, B, S)
        views = [t.view(L, B, H_kv, T + 1, -1) for t in (k_buf, v_buf)] + [p_buf.view(L, B, H_kv, T + 1)]
        for i, (layer, store) in enumerate(zip(layers, stores)):
            store.replace(views[0][i], views[1][i], views[2][i], n=T)
            self._compressed_at[layer] = (seen, T)
        self._buffers = (layers, [store.buffers()[:3] for store in stores], k_buf, v_buf, p_buf)
        if not k_buf.is_cpu or kvreviver.REBUILD_CHUNK >= seen - T:             # (see the module docstring)
            k_all, v_all, pos = self._rebuild(sketches[0], key, value, cells, signs, k_buf, v_buf, p_buf[:, 0, :T],
                                              seen)
            self._rebuilt = (layers, [store.buffers()[0] for store in stores], k_all.view(L, B, H_kv, seen + 1, d),
                             v_all.view(L, B, H_kv, seen + 1, dv), pos.expand(B, H_kv, seen + 1))

    @staticmethod
    def _rebuild(sketch: VagueSketch, key: Tensor, value: Tensor, cells: Tensor, signs: Tensor, k: Tensor,
                 v: Tensor, p: Tensor, seen: int) -> tuple[Tensor, Tensor, Tensor]:
        """Algorithm 4 for the next step, every row at once: k, v (X, G, seen + 1, d) holding each position
        0..seen-1 once, in order, raw where the storage holds it, else row x's sketch's estimate, and slot
        ``seen`` left for the next step's entry; their positions (seen + 1,). The storage: k, v (X, G, T + 1, d),
        whose last slot (room) goes to slot ``seen`` too, and positions p (X, T). The estimates are the
        sketches' own ``query`` (the class of ``sketch``) over one sketch of r rows whose cells are all of
        theirs (key, value (X * r, b, G, d) copied row-major: (r, X * b)), each position sent to its own
        sketch's cells. Entries are copied as rows of a flat view, one index per (row, head, position): on a
        CPU a scatter over an index as large as the entries is several times slower."""
        X, G, T1, d = k.shape
        r, b, dv, n_v = cells.shape[1], key.shape[1], v.shape[-1], seen - (T1 - 1)
        k_all, v_all = k.new_empty(X, G, seen + 1, d), v.new_empty(X, G, seen + 1, dv)
        heads = torch.arange(X * G, device=p.device).view(X, G, 1) * (seen + 1)   # (X, G, 1) each row-head's first
        raw = heads + torch.cat([p, p.new_full((X, 1), seen)], dim=1)[:, None, :]   # (X, G, T + 1)
        k_all.view(-1, d).index_copy_(0, raw.view(-1), k.reshape(-1, d))        # raw entries, as stored
        v_all.view(-1, dv).index_copy_(0, raw.view(-1), v.reshape(-1, dv))
        if n_v == 0:
            return k_all, v_all, torch.arange(seen + 1, device=p.device)
        in_v = torch.ones(X, seen, dtype=torch.uint8, device=p.device)
        in_v.scatter_(1, p, 0)                                                   # 1: not in R or C
        vague = in_v.argsort(dim=1, descending=True, stable=True)[:, :n_v]      # (X, n_V) V's positions
        where = vague[:, None, :].expand(X, r, n_v)
        first = torch.arange(X, device=p.device).view(1, X, 1) * b              # each sketch's first cell in a row
        to = (first + cells.gather(2, where).transpose(0, 1)).reshape(r, -1)     # (r, X * n_V)
        by_row = [t.view(X, r, b, *t.shape[2:]).transpose(0, 1).reshape(r, X * b, *t.shape[2:]) for t in (key, value)]
        one = routed(sketch, *by_row, to, signs.gather(2, where).transpose(0, 1).reshape(r, -1))
        k_hat, v_hat = one.query(vague.reshape(-1))                              # (X * n_V, G, d) each
        at = (heads.view(X, 1, G) + vague[:, :, None]).view(-1)                 # (X * n_V * G,) as the estimates
        k_all.view(-1, d).index_copy_(0, at, k_hat.to(k_all.dtype).view(-1, d))
        v_all.view(-1, dv).index_copy_(0, at, v_hat.to(v_all.dtype).view(-1, dv))
        return k_all, v_all, torch.arange(seen + 1, device=p.device)

    def _stored(self, layers, stores, X, G, T, d, dv) -> tuple[Tensor, Tensor, Tensor]:
        """Every waiting layer's storage as rows: k (X, G, T, d), v (X, G, T, dv), positions p (X, T) (each
        group's first head's). The last step's buffers as they are, when every storage still holds its view
        of them (the step's entry written into its slot of room); else stacked."""
        if self._buffers is not None:
            was, views, k_buf, v_buf, p_buf = self._buffers
            if was == layers and all(all(a is b for a, b in zip(s.buffers(), view)) and s.n == view[0].shape[2]
                                     for s, view in zip(stores, views)) and k_buf.shape[2] == T:
                return k_buf, v_buf, p_buf[:, 0]
        k = torch.stack([s.k for s in stores]).view(X, G, T, d)
        v = torch.stack([s.v for s in stores]).view(X, G, T, dv)
        p = torch.stack([s.pos for s in stores]).view(X, G, T)[:, 0]
        return k, v, p

    def _stacked(self, layers, sketches) -> tuple:
        """The sketches' cells in one buffer each, key and value (X * r, b, G, d): sketch x's rows are rows
        x * r, ..., and its own ``key`` and ``value`` views of them (moved there once, contiguous as before);
        their hash tables as rows, cells and signs (X, r, covered), remade when a table grows."""
        if self._cells is None or self._cells[0] != layers or any(
                s.key is not own for s, own in zip(sketches, self._cells[3])):
            key, value = torch.cat([s.key for s in sketches]), torch.cat([s.value for s in sketches])
            r = sketches[0].rows
            for x, s in enumerate(sketches):
                s.key, s.value = key[x * r:(x + 1) * r], value[x * r:(x + 1) * r]
            self._cells, self._tables_at = (layers, key, value, [s.key for s in sketches]), None
        layers, key, value, _ = self._cells
        covered = sketches[0].covered
        if self._tables_at is None or self._tables_at[0] != covered:
            cells = torch.stack([s.cell_table for s in sketches])               # (X, r, covered)
            signs = torch.stack([s.sign_table for s in sketches])
            self._tables_at = (covered, cells, signs)
        return key, value, self._tables_at[1], self._tables_at[2]

    @staticmethod
    def _insert(sketch: VagueSketch, key: Tensor, value: Tensor, cells: Tensor, signs: Tensor, at: Tensor,
                k: Tensor, v: Tensor) -> None:
        """Row x's tokens at positions ``at[x]`` (X, n), k (X, n, G, d), v (X, n, G, dv), into row x's sketch,
        for every row at once: the sketches' own ``insert`` (the class of ``sketch``) over one sketch row
        whose cells are all of theirs (key, value (X * r, b, G, d) flat), each token given once per sketch row
        and sent to the cell that row's hash names. A cell's tokens are summed in the order each sketch's
        own ``insert`` sums them."""
        X, r, n = cells.shape[0], cells.shape[1], at.shape[1]
        (b, G, d), dv = key.shape[1:], value.shape[-1]
        where = at[:, None, :].expand(X, r, n)
        first = torch.arange(X * r, device=at.device).view(X, r, 1) * b         # each sketch row's first cell
        to = (first + cells.gather(2, where)).view(1, -1)                        # (1, X * r * n) cell of (x, i, j)
        one = routed(sketch, key.view(1, -1, G, d), value.view(1, -1, G, dv), to, signs.gather(2, where).view(1, -1))
        one.insert(where.reshape(-1), k[:, None].expand(X, r, n, G, d).reshape(-1, G, d),
                   v[:, None].expand(X, r, n, G, dv).reshape(-1, G, dv))

    def _swaps(self, layers, sketches, scores: Tensor, k: Tensor, v: Tensor, p: Tensor, recent_from: int,
               max_swaps: int, B: int, S: int) -> None:
        """The swap loop's first test for every row (one host wait), then ``KVReviverPolicy._swap`` for each row
        whose test passes, its entries written back in place: k, v (X, G, T, d), p (X, G, T)."""
        N, T = scores.shape[1], p.shape[2]
        if min(max_swaps, T, N - T) == 0:                                         # ``_swap``: nothing to swap
            return
        for x, go in enumerate(swap_test(scores, p[:, 0], recent_from, self.replace_rate).tolist()):
            if not go:
                continue
            layer, (b, s) = layers[x // (B * S)], divmod(x % (B * S), S)
            row_scores, approx = self.by_group(self._scores[layer])[b, s], self.by_group(self._approx[layer])[b, s]
            kx, vx, px = self._swap(sketches[x], row_scores, k[x], v[x], p[x, 0], recent_from, approx, max_swaps)
            k[x], v[x], p[x] = kx, vx, px


class Routed:
    """A sketch over cells that other sketches own, each token sent to the cells and signs ``route`` names
    rather than hashed: a sketch's own ``insert`` and ``query`` (PyTorch's, or the Triton kernels of
    ``KernelSketch``) run for many sketches at once. Made by ``routed``."""

    def buckets(self, pos: Tensor) -> Tensor:
        return self.route[0]

    def signs(self, pos: Tensor) -> Tensor:
        return self.route[1]


class RoutedSketch(Routed, VagueSketch):
    pass


class RoutedKernelSketch(Routed, KernelSketch):
    pass


def routed(sketch: VagueSketch, key: Tensor, value: Tensor, cells: Tensor, signs: Tensor) -> VagueSketch:
    """A sketch of ``sketch``'s class with cells key, value (r, W, G, d) whose tokens go to ``cells`` (r, n)
    with ``signs`` (r, n), in the order given."""
    one = object.__new__(RoutedKernelSketch if isinstance(sketch, KernelSketch) else RoutedSketch)
    one.rows, one.width, one.injective, one.covered = cells.shape[0], key.shape[1], False, 0
    one.key, one.value, one.route = key, value, (cells, signs.to(value.dtype))
    return one


def every_layer_at_once(policy: CachePolicy) -> CachePolicy:
    """Make ``policy``, or the ``KVReviverPolicy`` it wraps (``inner``), an ``KVReviverLayersAtOnce``: the same
    object, fields and state, its decode hook batched over the layers. Only a plain ``KVReviverPolicy`` (an
    ablation's subclass keeps its own hooks); any other policy is returned untouched."""
    inner = policy
    while not isinstance(inner, KVReviverPolicy):
        inner = getattr(inner, "inner", None)
        if inner is None:
            return policy
    if type(inner) is KVReviverPolicy:
        inner.__class__ = KVReviverLayersAtOnce
        inner._start_queue()
    return policy


def every_layer_at_once_on(policies: list[CachePolicy]) -> None:
    """``every_layer_at_once`` on each policy (the evaluation's fast engines, on every device)."""
    for policy in policies:
        every_layer_at_once(policy)
