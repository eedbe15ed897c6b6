"""The adapters of the ``cache`` assignment: the tests' only door into your code (see course/model_adapters.py).
If you move or rename things in the library, change these functions so they reach your code.

Each adapter imports the library module it needs when it is called, so a file of yours that fails to import
fails only the tasks that use it: ``append`` lives in nanollm/storage.py, ``group_scores`` and ``mask`` in
nanollm/attention.py (which imports storage.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys

from torch import Tensor


def nanollm(name: str):
    """The copy's module ``nanollm.<name>``. If the package does not import (a mistake in another of its files),
    the module is imported with the package's ``__init__`` skipped: only what it imports itself must work."""
    try:
        return importlib.import_module(f"nanollm.{name}")
    except Exception:
        if "nanollm" in sys.modules or (spec := importlib.util.find_spec("nanollm")) is None:
            raise
        sys.modules["nanollm"] = importlib.util.module_from_spec(spec)       # the package, its __init__ not run
        return importlib.import_module(f"nanollm.{name}")


# -- task append: the storage (nanollm/storage.py) --------------------------------------------------------

def new_storage():
    """An empty layer storage (``LayerKV``)."""
    return nanollm("storage").LayerKV()


def storage_append(store, k: Tensor, v: Tensor, pos: Tensor) -> None:
    """Append k (B, H_kv, Tn, d), v (B, H_kv, Tn, dv) at positions pos (Tn,)."""
    store.append(k, v, pos)


def storage_contents(store) -> tuple[Tensor, Tensor, Tensor]:
    """The stored (k, v, pos): (B, H_kv, T, d), (B, H_kv, T, dv), (B, H_kv, T); T = the slots in use."""
    return store.k, store.v, store.pos


def storage_slot(store, j: int) -> tuple[Tensor, Tensor, Tensor]:
    """Slot j of every head, read as a decode step reads the storage: k, v (B, H_kv, d), pos (B, H_kv)."""
    return store.k[:, :, j], store.v[:, :, j], store.pos[:, :, j]


def storage_room_positions(store) -> Tensor:
    """The positions in the buffers' room, past the slots in use (B, H_kv, capacity - T)."""
    return store.buffers()[2][:, :, len(store):]


def storage_capacity(store) -> int:
    """Slots the buffers hold, in use or not."""
    return store.capacity()


def storage_keep(store, idx: Tensor) -> None:
    """Keep the slots idx (B, H_kv, K) of each head, in that order; -1 makes an empty slot (not your code)."""
    store.keep(idx)


def storage_set_state(store, name: str, values: Tensor, fill: float) -> None:
    """Per-slot numbers (B, H_kv, T, ...) kept beside the entries; slots added later start at ``fill``."""
    store.set_state(name, values, fill)


def storage_state(store, name: str) -> Tensor:
    return store.state[name]


# -- tasks group_scores and mask: the attention (nanollm/attention.py) ------------------------------------

def scores(q: Tensor, k: Tensor) -> Tensor:
    """q k^T / sqrt(d) per KV head: q (B, H, C, d), k (B, H_kv, T, d) -> (B, H_kv, G, C, T)."""
    return nanollm("attention").group_scores(q, k)


def scores_for_the_mask(q: Tensor, k: Tensor) -> Tensor:
    """q k^T / sqrt(d) one query head at a time, head h against KV head h // G -> (B, H_kv, G, C, T): the scores
    ``masked_attention`` gives ``attend`` in place of your ``group_scores``, so that the mask is graded alone
    (given code, not a task)."""
    B, H, C, d = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    out = q.new_empty(B, H_kv, G, C, k.shape[2])
    for h in range(H):
        out[:, h // G, h % G] = q[:, h] @ k[:, h // G].transpose(-1, -2) / math.sqrt(d)
    return out


def masked_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, chunk: int | None = None,
                     rows: int = 0) -> tuple[Tensor, Tensor | None]:
    """``attend`` with the mask built from positions, its scores from ``scores_for_the_mask`` (not your
    ``group_scores``: the mask is graded alone): q (B, H, Tq, d), k, v (B, H_kv, Tk, d), q_pos (Tq,), k_pos
    (B, H_kv, Tk) with -1 for an empty slot; queries in chunks of ``chunk``. Returns out (B, H, Tq, d) and the
    probabilities of the last ``rows`` queries (B, H, rows, Tk), or None when rows is 0."""
    attention, policy = nanollm("attention"), nanollm("policy")
    saved = attention.group_scores
    attention.group_scores = scores_for_the_mask
    try:
        out, probs, _ = attention.attend(q, k, v, q_pos, k_pos, policy.Needs(rows=rows), chunk=chunk)
    finally:
        attention.group_scores = saved
    return out, probs
