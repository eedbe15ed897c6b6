"""``LayerKV.buffers`` and ``adopt``: the public door for code that lays many storages side by side (the
evaluation's batched engine, the fast paths), so that none of it writes the storage's private fields."""

from __future__ import annotations

import torch

from nanollm.storage import LayerKV


def filled(n: int = 3) -> LayerKV:
    store = LayerKV()
    store.append(torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4), torch.arange(n))
    store.set_state("score", torch.ones(1, 2, n), fill=-1.0)
    return store


def test_buffers_are_the_whole_buffers_room_included():
    store = filled()
    k, v, pos, state = store.buffers()
    assert k.shape[2] == v.shape[2] == pos.shape[2] == state["score"].shape[2] == store.capacity() > store.n
    assert torch.equal(k[:, :, :store.n], store.k) and (pos[:, :, store.n:] == -1).all()
    state["other"] = torch.zeros(1)                      # a copy of the dict: the storage's states stay its own
    assert "other" not in store.state


def test_an_adopted_buffer_is_where_the_storage_keeps_its_slots():
    store = filled()
    k, v, pos, state = store.buffers()
    group = [t.new_zeros((2, *t.shape[1:])) if t.dtype != torch.long else t.new_full((2, *t.shape[1:]), -1)
             for t in (k, v, pos, state["score"])]      # two rows, as a group of caches holds them
    for buffer, t in zip(group, (k, v, pos, state["score"])):
        buffer[1:] = t
    store.adopt(group[0][1:], group[1][1:], group[2][1:], {"score": group[3][1:]})
    store.append(torch.full((1, 2, 1, 4), 7.0), torch.full((1, 2, 1, 4), 8.0), torch.tensor([3]))
    assert (group[0][1, :, 3] == 7).all() and (group[2][1, :, 3] == 3).all()   # the step went into the group's row
    assert (group[3][1, :, 3] == -1).all() and store.fill == {"score": -1.0}   # its state at the kept fill value
    assert (group[2][0] == -1).all()                                            # the other row untouched
