"""Public tests of the ``cache`` assignment, one per task: the storage, the grouped scores, the masked attention.
Run them with ``python -m course.grade cache`` (they reach your code through ``adapters.py``). Each task is
graded alone: a test of the mask runs ``attend`` with the adapters' own scores (``scores_for_the_mask``), not
your ``group_scores``. The random inputs are drawn from the run's seed (printed with the score)."""

import math

import adapters as A
import torch
from oracle import address, assert_close, generator, points, whole_copy_s


def randn(*shape, seed=0, dtype=torch.float32):
    """Random numbers of one test's case ``seed``, drawn from the run's seed (``oracle.generator``)."""
    return torch.randn(*shape, generator=generator("cache", seed), dtype=torch.float64).to(dtype)


GROWTH_CHUNKS, GROWTH_TOKENS = 1024, 32   # appends of 32 tokens of 4 KiB: a storage of 128 MiB at the end
GROWTH_COPIES = 64                          # the CPU your process may spend, in copies of that whole storage


def check_amortised_growth(what):
    """Amortised O(1) copies per token, read from outside your code: the CPU seconds of the process running it
    (``adapters.watch``, from /proc) while ``GROWTH_CHUNKS`` chunks are appended to a new storage, against what
    copying the whole final storage once costs this process. A storage that doubles when full copies each token
    about twice (a few copies of the whole, plus each call's own cost); one that copies everything at each
    append (``torch.cat``), or at each read (a slot just appended is read after every append, as a decode step
    reads the storage: ``store.k``, ``store.v`` and ``store.pos`` whole, by their names in the library, whatever the
    adapters say), copies it ``GROWTH_CHUNKS / 2`` times. Nothing your process reports counts here."""
    B, H_kv, d = 1, 4, 128
    total = GROWTH_CHUNKS * GROWTH_TOKENS * B * H_kv * 2 * d * 4
    copy = whole_copy_s(total)
    limit = GROWTH_COPIES * copy + 0.25
    store = A.new_storage()
    g = generator("cache growth", what)
    slots = torch.randint(GROWTH_TOKENS, (GROWTH_CHUNKS,), generator=generator("cache growth reads", what))
    with A.watch() as watch:
        for i in range(GROWTH_CHUNKS):
            k, v = (torch.randn(B, H_kv, GROWTH_TOKENS, d, generator=g) for _ in range(2))
            A.storage_append(store, k, v, torch.arange(i * GROWTH_TOKENS, (i + 1) * GROWTH_TOKENS))
            j = int(slots[i])               # then a read, as a decode step reads: store.k, .v and .pos whole
            got = A.harness("read_slot", store, i * GROWTH_TOKENS + j, (i + 1) * GROWTH_TOKENS)   # (the library's
            for name, x, y in (("key", got[0], k[:, :, j]), ("value", got[1], v[:, :, j]),           # names, not
                               ("position", got[2], torch.full((B, H_kv), i * GROWTH_TOKENS + j))):  # an adapter)
                assert_close(x, y, what=f"{what}: after {i + 1} appends, the {name} of slot "
                             f"{i * GROWTH_TOKENS + j} read back from store.k, store.v and store.pos")
            del k, v, got                            # held by the test, each would be compared at every call
            if i % 32 == 31 and watch.cpu_so_far() > limit:
                break                                # over the limit already: no need to wait for the rest
    assert watch.cpu_s < limit, \
        f"{what}: appending {i + 1} of {GROWTH_CHUNKS} chunks of {GROWTH_TOKENS} tokens ({total >> 20} MiB at the " \
        f"end) took {watch.cpu_s:.2f} s of CPU in the process running your code, {watch.cpu_s / copy:.0f} times what " \
        f"copying the whole storage once takes (at most {GROWTH_COPIES} for all): does every append copy what is " \
        "stored, or every read of a slot (store.k[:, :, j])? Grow by doubling: O(1) copies per token, amortised, " \
        "and read through views (read from outside your process)"
    held_after_growth(store, what, B, H_kv, d)


def held_after_growth(store, what, B, H_kv, d, slots=16):
    """What ``check_amortised_growth`` appended is all held: ``slots`` slots per head, drawn from the run's seed,
    kept (``storage_keep``) and read back against the chunks drawn again from the same stream."""
    T = GROWTH_CHUNKS * GROWTH_TOKENS
    g = generator("cache growth slots", what)
    idx = torch.stack([torch.randperm(T, generator=g)[:slots] for _ in range(H_kv)]).expand(B, H_kv, slots)
    want_k, want_v = torch.empty(B, H_kv, slots, d), torch.empty(B, H_kv, slots, d)
    replay = generator("cache growth", what)                     # the loop's stream, chunk by chunk
    for i in range(GROWTH_CHUNKS):
        k, v = (torch.randn(B, H_kv, GROWTH_TOKENS, d, generator=replay) for _ in range(2))
        for b, h, j in ((idx // GROWTH_TOKENS) == i).nonzero().tolist():
            slot = idx[b, h, j] % GROWTH_TOKENS
            want_k[b, h, j], want_v[b, h, j] = k[b, h, slot], v[b, h, slot]
    A.storage_keep(store, idx.contiguous())
    got_k, got_v, got_pos = A.storage_contents(store)
    for name, got, want in (("keys", got_k, want_k), ("values", got_v, want_v), ("positions", got_pos, idx)):
        assert_close(got, want, what=f"{what}: after {GROWTH_CHUNKS} appends of {GROWTH_TOKENS} tokens, the {name} "
                     f"of {slots} slots per head drawn at random (kept, then read back): every appended token is held")


@points(2, task="append")
def test_append_then_read():
    """Appends of 5, 1, 63 (exactly filling the buffer), 1 and 300 tokens (more than twice the capacity) of float16
    keys and values read back as one sequence: keys, values and positions in order, in the keys' dtype; written
    in place while they fit, the buffer at least doubled when full (and large enough for the chunk), its room
    empty (-1)."""
    sizes, store = [5, 1, 63, 1, 300], A.new_storage()
    ks = [randn(2, 3, n, 8, seed=i, dtype=torch.float16) for i, n in enumerate(sizes)]
    vs = [randn(2, 3, n, 6, seed=10 + i, dtype=torch.float16) for i, n in enumerate(sizes)]   # values narrower
    T = 0
    for k, v in zip(ks, vs):
        where, cap = (None, 0) if T == 0 else (address(A.storage_contents(store)[0]), A.storage_capacity(store))
        A.storage_append(store, k, v, torch.arange(T, T + k.shape[2]))
        T += k.shape[2]
        got, new_cap = A.storage_contents(store)[0], A.storage_capacity(store)
        if T == k.shape[2]:
            assert new_cap >= T + 64, f"the first append leaves 64 slots (MIN_CAPACITY) of room past its chunk: " \
                f"capacity {new_cap} for {T} slots, at least {T + 64} expected"
        elif T <= cap:
            assert address(got) == where, f"{T} slots fit in the capacity {cap}, yet the entries moved: " \
                "write in place"
        else:
            assert new_cap >= 2 * cap, f"a full buffer of {cap} slots grew to {new_cap}: double it"
        assert_close(A.storage_room_positions(store), torch.full((2, 3, new_cap - T), -1),
                     what=f"{T} slots appended (len(store) says {len(store)}), capacity {new_cap}: the positions of "
                     "the room past the slots in use, all empty (-1)")
    k, v, pos = A.storage_contents(store)
    assert_close(k, torch.cat(ks, dim=2), what="after appending 5, 1, 63, 1 and 300 slots, the stored keys (B, H_kv, "
                 "T, d): the appended ones in order, in their dtype")
    assert_close(v, torch.cat(vs, dim=2), what="the stored values: the appended ones in order, in their dtype")
    assert_close(pos, torch.arange(370).expand(2, 3, 370), what="the stored positions, per row and KV head, in order")
    state = A.new_storage()
    A.storage_append(state, randn(1, 1, 2, 1, seed=20), randn(1, 1, 2, 1, seed=21), torch.arange(2))
    A.storage_set_state(state, "s", torch.tensor([[[1.0, 2.0]]]), fill=-7.0)
    for n, T in ((1, 3), (70, 73)):                         # one more token, then 70: the buffers grow
        A.storage_append(state, randn(1, 1, n, 1, seed=22 + n), randn(1, 1, n, 1, seed=23 + n), torch.arange(T - n, T))
        assert_close(A.storage_state(state, "s"), torch.tensor([1.0, 2.0] + [-7.0] * (T - 2)).view(1, 1, T),
                     what=f"a state 's' set to [1, 2] with fill -7, after appending up to {T} slots: the new slots "
                     "start at the fill value, the old ones keep theirs (also when the buffers grow)")
    check_amortised_growth("append")


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
    assert_close(A.scores(q, k), scores_by_loop(q, k), rtol=1e-5, atol=1e-5,
                 what="the scores (B, H_kv, G, C, T): q k^T / sqrt(d), query head kv * G + g in [:, kv, g]")
    q3 = randn(2, 4, 3, 16, seed=5)                          # a chunk of 3 queries: C = 3
    assert_close(A.scores(q3, k), scores_by_loop(q3, k), rtol=1e-5, atol=1e-5,
                 what="the scores of a chunk of 3 queries (B, H_kv, G, C, T): query t of head kv * G + g in "
                 "[:, kv, g, t] (the G heads before the C queries)")
    qm = randn(2, 3, 4, 16, seed=6).transpose(1, 2)         # (B, H, C, d) as the model has it: a transpose
    assert_close(A.scores(qm, k), scores_by_loop(qm, k), rtol=1e-5, atol=1e-5,
                 what="the scores of queries as the model hands them over, q (2, 4, 3, 16) a transpose of "
                 "(B, C, H, d), not contiguous: .view cannot regroup them, .reshape can")
    half = A.scores(q.half(), k.half())
    assert half.dtype == torch.float16, f"the scores of float16 queries and keys are {half.dtype}: keep the " \
        "inputs' dtype (the attention's softmax and its product with float16 values expect it)"


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
    """Scattered positions (after an eviction), in any slot order, and a chunk of three queries: the mask comes from
    positions."""
    q, k, v = randn(1, 4, 3, 16, seed=2), randn(1, 2, 6, 16, seed=3), randn(1, 2, 6, 16, seed=4)
    order = torch.randperm(6, generator=generator("cache mask order"))
    k_pos = torch.tensor([0, 3, 7, 9, 10, 11])[order].expand(1, 2, 6)
    q_pos = torch.tensor([9, 10, 11])
    got, _ = A.masked_attention(q, k, v, q_pos, k_pos)
    assert_close(got, attention_by_loop(q, k, v, q_pos, k_pos), rtol=1e-5, atol=1e-5,
                 what=f"slots at positions {k_pos[0, 0].tolist()}, queries at {q_pos.tolist()}: the output; a query "
                 "at p sees the slots at positions 0..p, its own included")
    one, k2, v2 = torch.ones(1, 1, 1, 1), torch.tensor([5.0, 0.0]).view(1, 1, 2, 1), torch.tensor([100.0, 1.0])
    got, _ = A.masked_attention(one, k2, v2.view(1, 1, 2, 1), torch.tensor([5]), torch.tensor([[[-1, 0]]]))
    assert_close(got, one, what="slot 0 empty (position -1, value 100), slot 1 at position 0 (value 1), a query at 5: "
                 "the output is 1, an empty slot is never attended")
    big, k3 = torch.ones(1, 1, 1, 1), torch.tensor([1e10, -1e5]).view(1, 1, 2, 1)
    got, _ = A.masked_attention(big, k3, v2.view(1, 1, 2, 1), torch.tensor([5]), torch.tensor([[[-1, 0]]]))
    assert_close(got, big, what="slot 0 empty with a huge key (1e10, value 100), slot 1 at position 0 with the key "
                 "-1e5 (value 1), a query at 5: the output is 1; a masked score is -inf, below any finite one")
    half = [t.half() for t in (q, k, v)]
    got, _ = A.masked_attention(*half, q_pos, k_pos)
    assert got.dtype == torch.float16, f"the output of float16 q, k, v is {got.dtype}: keep their dtype"
    assert_close(got.float(), attention_by_loop(q, k, v, q_pos, k_pos), rtol=1e-2, atol=1e-2,
                 what="the same attention in float16: the output (fill the masked scores in their own dtype)")
    zero = torch.zeros(1, 1, 2, 1)
    try:
        got, _ = A.masked_attention(zero, zero, torch.tensor([0.0, 1.0]).view(1, 1, 2, 1), torch.tensor([0, 1]),
                                    torch.tensor([[[0, 1]]]), chunk=1)
    except RuntimeError as e:
        raise AssertionError(f"two queries in chunks of one failed: {str(e)[:100]}; each chunk's mask reads its own "
                             "positions (pc, one per query of the chunk), not all of q_pos") from None
    assert_close(got, torch.tensor([0.0, 0.5]).view(1, 1, 2, 1), what="two queries at positions 0 and 1 in chunks of "
                 "one (each chunk's own positions), slots at 0 and 1 with values 0 and 1, equal scores: the outputs "
                 "0 and 0.5")
