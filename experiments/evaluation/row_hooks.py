"""
A method's caches side by side in a group, given their decode hook at once (``batched.py``'s step).

Rows whose policies declare the same decode rule (``decode_rule()``, ``methods/rules.py``, but for the
budget and the recent window) observe the step once and drop one slot per row and KV head with the
method's own function (``h2o.evict_lowest``, ``scissorhands.evict_one``); the hooks of every layer wait for
the step's last layer and run as one. Each cache gets the numbers its own hook gives
(``tests/experiments/evaluation/test_row_hooks.py``). How it works: ``inside.md``, "row_hooks.py".
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from methods.h2o import STATE, evict_lowest
from methods.rules import DecodeRule
from methods.scissorhands import ATTN, COUNT, LOW, ScissorhandsPolicy, evict_one, group_mean, low_flags, push_column
from nanollm.cache import KVCache
from nanollm.policy import StepContext
from nanollm.slots import to_device
from nanollm.storage import LayerKV

from .protocol import Probe

KINDS = ("heavy", "scissors")  # the rules (``methods/rules.py``) whose rows step at once: H2O's, Scissorhands'
ENABLED = True          # False: every cache runs its own hook (the tests compare the two)


def declared(policy) -> DecodeRule | None:
    """The decode rule ``policy``'s class declares (``decode_rule``), where it is one of ``KINDS``."""
    rule = getattr(type(policy), "decode_rule", None)
    rule = rule(policy) if rule is not None else None
    return rule if isinstance(rule, DecodeRule) and rule.kind in KINDS else None


def bare(cache: KVCache):
    """The cache's policy, unwrapped from a ``Probe`` (greedy's caches are bare)."""
    return cache.policy.inner if isinstance(cache.policy, Probe) else cache.policy


def unwrapped(cache: KVCache):
    """The cache's H2O or Scissorhands policy (one that declares such a rule), bare or in a ``Probe``, else
    None."""
    return bare(cache) if declared(bare(cache)) is not None else None


def method(cache: KVCache):
    """``unwrapped(cache)`` where its hook would do only what ``step_rows`` does (a ``Probe`` that records
    does more), else None."""
    return None if isinstance(cache.policy, Probe) and cache.policy.recording else unwrapped(cache)


def rule(policy) -> DecodeRule:
    """What must be equal for two policies to step as one: their declared rule but for the budget and the
    recent window."""
    return declared(policy).unbudgeted()


def side_by_side(caches: list[KVCache]) -> list[KVCache]:
    """``caches`` in a group's row order: those of one method and rule adjacent, in the order their first
    appears, the others where they are (a row's numbers do not depend on its place in the group)."""
    first: dict = {}
    keys = [n if unwrapped(c) is None else rule(unwrapped(c)) for n, c in enumerate(caches)]
    for n, key in enumerate(keys):
        first.setdefault(key, n)
    return [caches[n] for n in sorted(range(len(caches)), key=lambda n: (first[keys[n]], n))]


def runs(group, i: int) -> list[range]:
    """The runs of at least two consecutive rows of ``group`` whose caches step as one at layer i (the module
    docstring), each cache's state held in the group's buffers (``Group.holds``)."""
    keys, caches = [], group.caches
    for r, cache in enumerate(caches):                   # the declaration asked once per cache: a hot path
        recording = isinstance(cache.policy, Probe) and cache.policy.recording
        declared_rule = None if recording else declared(bare(cache))
        store = cache.layers[i]
        ok = declared_rule is not None and len(store) == declared_rule.budget + 1 \
            and all(group.holds(i, r, name, t) for name, t in store.buffers()[3].items())   # drops one slot
        keys.append(declared_rule.unbudgeted() if ok else None)
    out, start = [], 0
    for r in range(1, len(caches) + 1):
        if r == len(caches) or keys[r] is None or keys[r] != keys[start]:
            if keys[start] is not None and r - start >= 2:
                out.append(range(start, r))
            start = r
    return out


_WINDOWS: dict = {}


def shifts(values: list[int], device) -> Tensor:
    """(n, 1, 1) the rows' ``1 - n_recent`` on ``device``, made once per set (the host sends nothing per step)."""
    key = (tuple(values), str(device))
    if key not in _WINDOWS:
        _WINDOWS[key] = to_device(values, device).view(-1, 1, 1)
    return _WINDOWS[key]


def observe_rows(policy: ScissorhandsPolicy, kv: LayerKV, probs: Tensor, positions: Tensor) -> None:
    """``ScissorhandsPolicy.observe`` at a decode step over the rows of ``kv``, each row's flags into its own
    column of the ring buffer: (its token's position) mod w, where ``observe`` takes one column, from the
    tokens seen, for every row. probs (n, H, 1, C); positions (n,)."""
    state = kv.state
    attn = group_mean(probs.float(), kv.pos.shape[1])                           # (n, H_kv, 1, C)
    flags = low_flags(attn, (kv.pos >= 0)[:, :, None], policy.threshold)[:, :, 0]   # (n, H_kv, C)
    push_column(state[LOW], state[COUNT], flags, positions % policy.history_window)
    state[ATTN].copy_(attn[:, :, -1])                                           # the step's last query


def evict_rows(policies: list, kv: LayerKV, ctx: StepContext, windows: list[int]) -> Tensor:
    """The hook of ``policies`` (one method and rule, a row of ``kv`` each) at once: each row observes the
    step and drops one slot per KV head (the module docstring). ``ctx`` gives the rows' probabilities, column
    sums and token positions ``q_pos`` (n,); ``windows`` each row's ``1 - n_recent``. Returns the slots
    dropped (n, H_kv, 1), already emptied in ``kv``."""
    recent_from = ctx.q_pos.view(-1, 1, 1) + shifts(windows, kv.pos.device)      # (n, 1, 1): seen - n_recent
    if declared(policies[0]).kind == "heavy":                                    # ``H2OPolicy.evict``
        policies[0].observe(ctx)                                                 # the rows' own, at once
        idx = evict_lowest(kv.state[STATE], kv.pos, recent_from)
    else:                                                                        # ``ScissorhandsPolicy.evict``
        observe_rows(policies[0], kv, ctx.probs, ctx.q_pos)
        idx = evict_one(kv.pos, kv.state[COUNT], kv.state[ATTN], recent_from)
    kv.pos.scatter_(2, idx, -1)                                 # each row's ``LayerKV.evict`` (every slot in use)
    return idx


def emptied(caches: list[KVCache], layers: list[int], idx: Tensor) -> None:
    """Each cache's slots ``idx`` (n * len(layers), H_kv, 1), its layers' rows in turn, into the free slots
    of those layers' storages (as ``LayerKV.evict`` leaves them)."""
    j = 0
    for cache in caches:
        for i in layers:
            store = cache.layers[i]
            store.free = idx[j:j + 1] if store.free is None else torch.cat([store.free, idx[j:j + 1]], dim=-1)
            j += 1


def timed(caches: list[KVCache], t0: float) -> float:
    """The seconds since ``t0``, shared by the caches' probes as ``Probe.on_decode`` times them."""
    seconds = time.perf_counter() - t0
    for cache in caches:
        if isinstance(cache.policy, Probe):
            cache.policy.compress_s += seconds / len(caches)
    return seconds


def step_rows(group, i: int, rows: range, attn, q: Tensor, positions: Tensor, out: Tensor, probs: Tensor | None,
              col_sums: Tensor | None) -> float:
    """The hook of the caches in ``rows`` of ``group`` at layer i, at once; q, out (n, H, 1, d), the new
    tokens' positions (n,), and probs, col_sums ((n, H, 1, C), (n, H, C)) are the rows' own. Returns the
    seconds it took."""
    t0 = time.perf_counter()
    caches = [group.caches[r] for r in rows]
    policies = [method(c) for c in caches]
    a, b, first = rows.start, rows.stop, caches[0].layers[i]
    kv = LayerKV(group.k[i][a:b], group.v[i][a:b], group.pos[i][a:b])             # every slot of the rows
    kv.adopt(*kv.buffers()[:3], {name: buffer[a - lo:b - lo] for name, (lo, buffer) in group.state[i].items()
                                 if name in first.state})
    kv.fill = dict(first.fill)
    ctx = StepContext(layer=i, phase="decode", q=q, q_pos=positions, probs=probs, out=out, kv=kv, attn=attn,
                      config=caches[0].config, seen=caches[0].seen + 1, attended_pos=kv.pos, col_sums=col_sums)
    emptied(caches, [i], evict_rows(policies, kv, ctx, [1 - p.n_recent for p in policies]))
    return timed(caches, t0)


def stacked(group, rows: range) -> bool:
    """Whether every layer's rows ``rows`` sit in ``group``'s buffers across layers (``Group.pos_rows`` and
    ``state_rows``: a row's layers side by side), so that one hook can take every layer of them at once."""
    first = group.caches[rows.start].layers[0]
    return all(name in group.state_rows for name in first.state)


def as_rows(t: Tensor) -> Tensor:
    """(n, L, ...) -> (n * L, ...), a view (``view`` raises where a copy would be needed: the hooks write in it)."""
    return t.view(-1, *t.shape[2:])


def step_layers(group, rows: range, steps: list[tuple]) -> float:
    """``step_rows`` of every layer at once: ``steps[i]`` is layer i's (attn, q, positions, out, probs,
    col_sums) as ``step_rows`` takes them. Each row's layers become rows of their own, (cache, layer) in the
    order of the buffers ``Group.pos_rows`` and ``state_rows``, viewed without a copy: one hook for the whole
    step where each layer took its own (a step's later layers read nothing an earlier layer's hook changes, so
    the hooks may wait until the last layer's attention). Returns the seconds it took."""
    t0 = time.perf_counter()
    caches = [group.caches[r] for r in rows]
    policies = [method(c) for c in caches]
    a, b, L, first = rows.start, rows.stop, len(steps), caches[0].layers[0]
    kv = LayerKV()                                                               # (K and V: these hooks read none)
    kv.adopt(None, None, as_rows(group.pos_rows[a:b]),                           # (n * L, H_kv, C)
             {name: as_rows(buffer[a - lo:b - lo]) for name, (lo, buffer) in group.state_rows.items()
              if name in first.state})
    kv.n, kv.fill = group.C, dict(first.fill)

    def joined(n: int, needed: bool) -> Tensor | None:                           # layers' (n, ...) -> (n * L, ...)
        return None if steps[0][n] is None or not needed else as_rows(torch.stack([s[n] for s in steps], 1))
    positions = steps[0][2][:, None].expand(-1, L).reshape(-1)                   # (n * L,) a row's, every layer
    needs = policies[0].needs("decode")                       # Scissorhands' probabilities, H2O's column sums
    ctx = StepContext(layer=None, phase="decode", q=None, q_pos=positions, probs=joined(4, needs.rows != 0), out=None,
                      kv=kv, attn=None, config=caches[0].config, seen=caches[0].seen + 1, attended_pos=kv.pos,
                      col_sums=joined(5, needs.col_sums))               # (layer, q, out, attn: these hooks read none)
    windows = [1 - p.n_recent for p in policies for _ in range(L)]
    emptied(caches, list(range(L)), evict_rows(policies, kv, ctx, windows))
    return timed(caches, t0)


def catch_up(group, waiting: list[tuple]) -> list[tuple[range, float]]:
    """The hooks that waited for a step's last layer, ``waiting`` [(layer, rows, (attn, q, positions, out,
    probs, col_sums))] in layer order: each run of rows at every layer in one ``step_layers`` where its buffers allow,
    else layer by layer (``step_rows``). Returns (rows, seconds) per call."""
    L, by_rows = len(group.caches[0].layers), {}
    for i, rows, args in waiting:
        by_rows.setdefault(rows, []).append((i, args))
    done = []
    for rows, steps in by_rows.items():
        if [i for i, _ in steps] == list(range(L)) and stacked(group, rows):
            done.append((rows, step_layers(group, rows, [args for _, args in steps])))
        else:
            done += [(rows, step_rows(group, i, rows, *args)) for i, args in steps]
    return done
