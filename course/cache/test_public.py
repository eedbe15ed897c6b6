"""Public tests of the ``cache`` assignment, one per task: the storage, the grouped scores, the masked attention.
Run them with ``python -m course.grade cache`` (they reach your code through ``adapters.py``). Each task is
graded alone: a test of the mask runs ``attend`` with the adapters' own scores (``scores_for_the_mask``), not
your ``group_scores``."""

import math

import adapters as A
import torch
from oracle import address, points


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def first_difference(got, want) -> str:
    """Where two tensors of one shape differ most: 'at [i, j, ...] got x, expected y'."""
    i = (got - want).abs().flatten().argmax().item()
    at = [int(c) for c in torch.unravel_index(torch.tensor(i), got.shape)]
    return f"at {at} got {got.flatten()[i]:.4g}, expected {want.flatten()[i]:.4g}"


@points(2, task="append")
def test_append_then_read():
    """Appends of 5, 1, 63 (exactly filling the buffer), 1 and 300 tokens (more than twice the capacity) read back
    as one sequence: keys, values and positions in order; written in place while they fit, the buffer at least
    doubled when full (and large enough for the chunk), its room empty (-1)."""
    sizes, store = [5, 1, 63, 1, 300], A.new_storage()
    ks = [randn(2, 3, n, 8, seed=i) for i, n in enumerate(sizes)]
    vs = [randn(2, 3, n, 6, seed=10 + i) for i, n in enumerate(sizes)]      # values may be narrower than keys
    T = 0
    for k, v in zip(ks, vs):
        where, cap = (None, 0) if T == 0 else (address(A.storage_contents(store)[0]), A.storage_capacity(store))
        A.storage_append(store, k, v, torch.arange(T, T + k.shape[2]))
        T += k.shape[2]
        got, new_cap = A.storage_contents(store)[0], A.storage_capacity(store)
        if T == k.shape[2]:
            assert new_cap >= T + 64, f"the first append must leave room: capacity {new_cap} for {T} slots"
        elif T <= cap:
            assert address(got) == where, f"{T} slots fit in the capacity {cap}, yet the entries moved: " \
                "write in place"
        else:
            assert new_cap >= 2 * cap, f"a full buffer of {cap} slots grew to {new_cap}: double it"
        room = A.storage_room_positions(store)
        assert (room == -1).all(), f"the room past the slots in use must be empty (position -1), got {room[0, 0, :3]}"
    k, v, pos = A.storage_contents(store)
    assert tuple(k.shape) == (2, 3, 370, 8), f"after appending 5, 1, 63, 1 and 300 slots the keys are " \
        f"{tuple(k.shape)}, expected (B, H_kv, T, d) = (2, 3, 370, 8)"
    assert torch.equal(k, torch.cat(ks, dim=2)), "the stored keys are not the appended ones in order: " \
        + first_difference(k, torch.cat(ks, dim=2))
    assert torch.equal(v, torch.cat(vs, dim=2)), "the stored values are not the appended ones in order: " \
        + first_difference(v, torch.cat(vs, dim=2))
    assert pos.tolist() == [[list(range(370))] * 3] * 2, \
        f"positions are stored per row and KV head, in order; got {pos[0, 0].tolist()} in row 0, head 0"


def scores_by_loop(q, k):
    """The test's scores: query head h against KV head h // G, one head at a time -> (B, H_kv, G, C, T)."""
    B, H, C, d = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    out = torch.empty(B, H_kv, G, C, k.shape[2])
    for h in range(H):
        out[:, h // G, h % G] = q[:, h] @ k[:, h // G].transpose(-1, -2) / math.sqrt(d)
    return out


@points(2, task="group_scores")
def test_decode_step_scores_with_gqa():
    """A decode step's scores with GQA (4 query heads over 2 KV heads): query head h reads KV head h // 2."""
    q, k = randn(2, 4, 1, 16, seed=1), randn(2, 2, 9, 16, seed=2)
    got = A.scores(q, k)
    assert tuple(got.shape) == (2, 2, 2, 1, 9), \
        f"scores have shape {tuple(got.shape)}, expected (B, H_kv, G, C, T) = (2, 2, 2, 1, 9)"
    want = scores_by_loop(q, k)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), \
        "q k^T / sqrt(d), query head kv * G + g in [:, kv, g]: " + first_difference(got, want)


def attention_by_loop(q, k, v, q_pos, k_pos):
    """The test's masked attention, query by query and head by head over the slots it may see."""
    B, H, Tq, d = q.shape
    G = H // k.shape[1]
    out = torch.empty(B, H, Tq, v.shape[-1])
    for b in range(B):
        for h in range(H):
            for t in range(Tq):
                seen = [s for s in range(k.shape[2]) if 0 <= k_pos[b, h // G, s] <= q_pos[t]]
                w = torch.softmax(k[b, h // G, seen] @ q[b, h, t] / math.sqrt(d), dim=0)
                out[b, h, t] = w @ v[b, h // G, seen]
    return out


@points(2, task="mask")
def test_masked_attention_sees_only_the_past():
    """Scattered positions (after an eviction) and a chunk of three queries: the mask comes from positions."""
    q, k, v = randn(1, 4, 3, 16, seed=2), randn(1, 2, 6, 16, seed=3), randn(1, 2, 6, 16, seed=4)
    k_pos = torch.tensor([0, 3, 7, 9, 10, 11]).expand(1, 2, 6)
    q_pos = torch.tensor([9, 10, 11])
    want = attention_by_loop(q, k, v, q_pos, k_pos)
    got, _ = A.masked_attention(q, k, v, q_pos, k_pos)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), \
        "query at p sees the slots at positions 0..p, its own included: " + first_difference(got, want)
