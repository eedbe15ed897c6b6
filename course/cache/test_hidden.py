"""Hidden tests of the ``cache`` assignment (the grader's; not in a student copy). Each task is graded alone,
against oracles written here: the storage against ``torch.cat`` (and inside the instructor's decoder, run in
this process, its attention reading your storage), the scores against a loop over heads, the masked attention
against a loop over queries, heads and the slots each may see (with the adapters' scores, not yours)."""

import math

import adapters as A
import torch
from oracle import address, assert_close, check_tensor, generator, points, reference
from test_public import check_amortised_growth, randn, scores_by_loop

ROOM = 64          # the first append leaves at least this much room (nanollm.storage.MIN_CAPACITY)


# -- task append ------------------------------------------------------------------------------------------

def check_state(store, name, want, what):
    """A per-slot state keeps its numbers and its new slots start at its fill value."""
    assert_close(A.storage_state(store, name), want, what=f"{what}: state {name!r}, which keeps its numbers, its "
                 "dtype and its new slots at its fill (every append adds its slots to every state)")


def check_contents(store, k, v, pos, what):
    """The storage holds exactly k, v, pos (B, H_kv, T, ...) in its slots in use."""
    got_k, got_v, got_pos = A.storage_contents(store)
    for name, got, want in (("keys", got_k, k), ("values", got_v, v), ("positions", got_pos, pos)):
        assert_close(got, want, what=f"{what}: the stored {name}, each chunk as appended and in that order, same dtype")


def append(store, k, v, pos, what):
    """Append, checking the growth: a chunk that fits is written in place (the entries do not move); a full
    buffer is replaced by one of at least twice its capacity and at most about twice what it holds; the room
    past the slots in use is empty (position -1)."""
    before = A.storage_contents(store)[0]                 # None while empty
    n, cap = (0, 0) if before is None else (before.shape[2], A.storage_capacity(store))
    where = None if before is None else address(before)
    A.storage_append(store, k, v, pos)
    got, new_cap = A.storage_contents(store)[0], A.storage_capacity(store)
    total = n + k.shape[2]
    assert got.shape[2] == total, f"{what}: {n} slots + {k.shape[2]} appended, the storage holds {got.shape[2]}"
    if n == 0:
        assert new_cap >= total + ROOM, f"{what}: the first append must leave room ({new_cap} slots for {total})"
    elif total <= cap:
        assert address(got) == where, f"{what}: {n} + {k.shape[2]} slots fit in the capacity {cap}, yet the " \
            "entries moved: write in place"
    else:
        assert new_cap >= 2 * cap, f"{what}: a full buffer of {cap} slots grew to {new_cap}: at least double it"
    assert new_cap <= 2 * total + ROOM, f"{what}: {total} slots in use hold a capacity of {new_cap}: double, no more"
    assert_close(A.storage_room_positions(store), torch.full((*got.shape[:2], new_cap - total), -1),
                 what=f"{what}: the positions of the {new_cap - total} slots past those in use, all empty (-1)")
    return address(got) != where


@points(2, task="append")
def test_append_writes_in_place_and_doubles_when_full():
    """300 one-token appends, then a chunk of 1000: an append that fits moves nothing, a full buffer at least
    doubles (O(1) copies per token, amortised), grows enough for the chunk, and never holds more than about twice
    what is stored; a state set after the first."""
    check_amortised_growth("append_writes_in_place_and_doubles_when_full")
    store, B, H_kv = A.new_storage(), 2, 3
    ks, vs, moves = [], [], 0
    for t in range(300):
        k, v = randn(B, H_kv, 1, 4, seed=t), randn(B, H_kv, 1, 2, seed=1000 + t)
        ks.append(k), vs.append(v)
        moves += append(store, k, v, torch.tensor([t]), f"append {t + 1} of one token") and t > 0
        if t == 0:
            A.storage_set_state(store, "hits", torch.full((B, H_kv, 1, 2), 5), fill=2)
    assert moves <= 4, f"300 appends moved the entries {moves} times: a doubling buffer moves them about 3 times"
    k, v = randn(B, H_kv, 1000, 4, seed=300), randn(B, H_kv, 1000, 2, seed=1300)
    ks.append(k), vs.append(v)
    append(store, k, v, torch.arange(300, 1300), "then a chunk of 1000 tokens (more than twice the capacity)")
    pos = torch.arange(1300).expand(B, H_kv, 1300)
    check_contents(store, torch.cat(ks, dim=2), torch.cat(vs, dim=2), pos, "300 appends, then 1000 tokens")
    check_state(store, "hits", torch.cat([torch.full((B, H_kv, 1, 2), 5), torch.full((B, H_kv, 1299, 2), 2)], 2),
                "a state set after the first token")


@points(3, task="append")
def test_append_chunks_of_any_size_positions_as_given():
    """Chunks of 5, 1, 70, 3, 59 (exactly filling the buffer), 71 and 600 (more than twice the capacity) tokens,
    bfloat16 keys and values narrower than the keys, positions out of order and -1 (an empty slot): stored as
    given, in their dtype, per row and KV head; states set after the first chunk grow with every later one."""
    check_amortised_growth("append_chunks_of_any_size_positions_as_given")
    store, B, H_kv = A.new_storage(), 2, 3
    ks, vs, ps, seen = [], [], [], 0
    for i, n in enumerate([5, 1, 70, 3, 59, 71, 600]):
        k = randn(B, H_kv, n, 8, seed=i, dtype=torch.bfloat16)
        v = randn(B, H_kv, n, 6, seed=10 + i, dtype=torch.bfloat16)
        pos = torch.randperm(n, generator=generator("cache chunk positions", i)) + seen
        pos[0] = -1
        what = f"chunk {i} ({n} tokens after {seen})"
        append(store, k, v, pos, what)
        ks.append(k), vs.append(v), ps.append(pos.expand(B, H_kv, n))
        seen += n
        check_contents(store, torch.cat(ks, dim=2), torch.cat(vs, dim=2), torch.cat(ps, dim=2), what)
        if i == 0:
            A.storage_set_state(store, "score", torch.arange(30.0).view(B, H_kv, 5), fill=0.5)
            A.storage_set_state(store, "pairs", torch.ones(B, H_kv, 5, 2), fill=-1.0)
    check_state(store, "score", torch.cat([torch.arange(30.0).view(B, H_kv, 5), torch.full((B, H_kv, 804), 0.5)],
                                          2), "a state set after the first chunk")
    check_state(store, "pairs", torch.cat([torch.ones(B, H_kv, 5, 2), torch.full((B, H_kv, 804, 2), -1.0)], 2),
                "a (B, H_kv, T, 2) state set after the first chunk")


@points(2, task="append")
def test_append_after_keep_and_with_state():
    """After an eviction (``keep`` of any three slots per head, in any order, one of them empty) the next tokens go
    after the kept ones; a method's per-slot state keeps its numbers and new slots start at the state's fill
    value."""
    check_amortised_growth("append_after_keep_and_with_state")
    store = A.new_storage()
    k, v = randn(1, 2, 10, 4), randn(1, 2, 10, 3, seed=1)
    A.storage_append(store, k, v, torch.arange(10))
    A.storage_set_state(store, "score", torch.arange(20.0).view(1, 2, 10), fill=-7.0)
    A.storage_set_state(store, "flags", torch.ones(1, 2, 10, 3, dtype=torch.bool), fill=False)
    A.storage_append(store, randn(1, 2, 2, 4, seed=2), randn(1, 2, 2, 3, seed=3), torch.tensor([10, 11]))
    score = torch.cat([torch.arange(20.0).view(1, 2, 10), torch.full((1, 2, 2), -7.0)], dim=2)
    check_state(store, "score", score, "two tokens after a state was set")
    check_state(store, "flags", torch.arange(12).view(1, 1, 12, 1).expand(1, 2, 12, 3) < 10,
                "a (B, H_kv, T, 3) bool state, two tokens after it was set")
    g = generator("cache keep")
    idx = torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(2)])[None]     # (1, 2, 3), any order
    idx[0, 1, int(torch.randint(0, 3, (1,), generator=g))] = -1                          # an empty slot
    kept = torch.where(idx >= 0, idx, -1)                    # slot s held position s: the positions kept
    kept_score = torch.where(idx >= 0, score.gather(2, idx.clamp(min=0)), -7.0)
    A.storage_keep(store, idx)
    kk, vv, pp = (t.clone() for t in A.storage_contents(store))
    new_k, new_v = randn(1, 2, 3, 4, seed=4), randn(1, 2, 3, 3, seed=5)
    append(store, new_k, new_v, torch.tensor([12, 13, 14]), "3 tokens after keep (which leaves room)")
    want_pos = torch.cat([kept, torch.tensor([12, 13, 14]).expand(1, 2, 3)], 2)
    check_contents(store, torch.cat([kk, new_k], 2), torch.cat([vv, new_v], 2), want_pos,
                   f"appending after keep of the slots {idx[0].tolist()}")
    check_state(store, "score", torch.cat([kept_score, torch.full((1, 2, 3), -7.0)], 2),
                f"after keep of the slots {idx[0].tolist()} and 3 tokens")
    room = A.storage_capacity(store) - 6
    assert room <= 4096, f"after keep of 3 slots and 3 tokens, a capacity of {room + 6} slots: keep leaves " \
                         "MIN_CAPACITY slots of room past those it keeps"      # (the test fills it, in its process)
    append(store, randn(1, 2, room, 4, seed=6), randn(1, 2, room, 3, seed=7), torch.arange(15, 15 + room),
           f"{room} tokens exactly filling the room")
    append(store, randn(1, 2, 1, 4, seed=8), randn(1, 2, 1, 3, seed=9), torch.tensor([15 + room]),
           "one token past a full buffer")
    assert_close(A.storage_contents(store)[2][..., :7], torch.cat([want_pos, torch.full((1, 2, 1), 15)], 2),
                 what="after keep, 3 tokens, the room filled and one more: the first 7 slots' positions")
    left = A.storage_capacity(store) - (7 + room)                            # room after the reallocation
    big = left + 5
    append(store, randn(1, 2, big, 4, seed=10), randn(1, 2, big, 3, seed=11), torch.arange(16 + room, 16 + room + big),
           f"{big} tokens, more than the {left} slots of room left")
    check_state(store, "score", torch.cat([kept_score, torch.full((1, 2, 4 + room + big), -7.0)], 2),
                "a state grows with the buffers, its numbers kept and new slots at its fill")


@points(2, task="append")
def test_append_keeps_the_keys_dtype():
    """float16, bfloat16 and float64 keys and values (a model run in half precision, a float64 check): chunks of 3,
    70 (past the first capacity) and 1 token, with a float32 state beside them: what is stored and read back has
    the keys' dtype and their exact values (buffers made in float32 whatever the keys widen half precision and
    round float64), and the state keeps its own dtype."""
    check_amortised_growth("append_keeps_the_keys_dtype")
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        store, ks, vs, ps, seen = A.new_storage(), [], [], [], 0
        for i, n in enumerate([3, 70, 1]):
            k, v = randn(2, 2, n, 8, seed=50 + i, dtype=dtype), randn(2, 2, n, 4, seed=60 + i, dtype=dtype)
            pos = torch.arange(seen, seen + n)
            what = f"{dtype} keys and values, chunk {i} ({n} tokens after {seen})"
            append(store, k, v, pos, what)
            ks.append(k), vs.append(v), ps.append(pos.expand(2, 2, n))
            seen += n
            check_contents(store, torch.cat(ks, 2), torch.cat(vs, 2), torch.cat(ps, 2), what)
            if i == 0:
                A.storage_set_state(store, "score", torch.arange(12.0).view(2, 2, 3), fill=0.25)
        check_state(store, "score", torch.cat([torch.arange(12.0).view(2, 2, 3), torch.full((2, 2, 71), 0.25)], 2),
                    f"a float32 state beside {dtype} keys")


@points(2, task="append")
def test_cached_decoding_equals_uncached_with_the_tests_attention():
    """The storage inside the decoder (Llama: RoPE, GQA; GPT-2: learned positions): a prompt, a chunk of 3
    tokens, then 5 greedy steps through the cache give the logits of one uncached pass over the sequence. The
    decoder and its attention are the instructor's, run here; only the storage is yours."""
    check_amortised_growth("cached_decoding_equals_uncached_with_the_tests_attention")
    for flavour in ("llama", "gpt2"):
        decode_through_the_storage(flavour)


def storage_of_yours():
    """The instructor's layer storage (``LayerKV``, in this process) whose entries your storage keeps: each
    append goes to your storage, and the instructor's attention reads the slots in use that your storage then
    holds (its keys, values and positions)."""
    class YourStorage(reference("nanollm.storage").LayerKV):
        def __init__(self):
            super().__init__()
            self.yours = A.new_storage()

        def append(self, k, v, pos):
            A.storage_append(self.yours, k, v, pos)
            self._k, self._v, self._pos = A.storage_contents(self.yours)
            self.n = self._k.shape[2]
    return YourStorage()


def decode_through_the_storage(flavour):
    R = reference("course.model_adapters")              # the instructor's model, decoder and uncached pass
    model = R.tiny_model(flavour, seed=3)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=generator("cache decode", flavour))
    cache = reference("nanollm.cache").KVCache(model.config, new_storage=lambda config: storage_of_yours())
    yours = [layer.yours for layer in cache.layers]
    R.run_prefill(model, ids[:, :6], cache)
    where = address(A.storage_contents(yours[0])[0])
    logits = R.run_extend(model, ids[:, 6:], cache)[:, -1]
    for step in range(6):
        assert_close(logits, R.uncached_logits(model, ids)[:, -1], rtol=1e-4, atol=1e-5,
                     what=f"{flavour}, {ids.shape[1]} tokens: the cached logits against the uncached pass")
        if step == 5:
            break
        token = logits.argmax(-1)
        ids = torch.cat([ids, token[:, None]], dim=1)
        logits = R.run_decode(model, token, cache)
    assert address(A.storage_contents(yours[0])[0]) == where, \
        f"{flavour}: 14 tokens fit in the room the prompt's append left, yet the entries moved: write in place"
    T = ids.shape[1]
    assert_close(A.storage_contents(yours[1])[2], torch.arange(T).expand(2, model.config.n_kv_head, T),
                 what=f"{flavour}: the positions layer 1 stores")
    more = torch.randint(0, model.config.vocab_size, (2, 64), generator=generator("cache decode more", flavour))
    logits = R.run_extend(model, more, cache)[:, -1]                     # outgrows the room that is left
    ids = torch.cat([ids, more], dim=1)
    assert_close(logits, R.uncached_logits(model, ids)[:, -1], rtol=1e-4, atol=1e-5,
                 what=f"{flavour}: after a 64-token chunk larger than the room left, the cached logits against the "
                 "uncached pass")


# -- task group_scores ------------------------------------------------------------------------------------

GQA_H, GQA_T, GQA_D = 64, 1 << 16, 64   # 64 query heads over one KV head of 65,536 keys: 16 MiB, repeated 1 GiB
SCORES_GROWTH = 384 << 20               # what the process running your code may add while it scores them, at most

@points(4, task="group_scores")
def test_group_scores_against_a_loop_over_heads():
    """A chunk of 4 queries over 7 keys, every head different, G = 3 (GQA), 6 (one KV head) and 1 (multi-head):
    the scores are q k^T / sqrt(d), with query head kv * G + g's in [:, kv, g]; and 64 query heads over 65,536
    keys of one KV head, read without repeating them (the memory of your process, watched from outside)."""
    for seed, (H, H_kv) in enumerate([(6, 2), (6, 1), (3, 3), (6, 2)]):
        q, k = randn(2, H, 4, 16, seed=seed), randn(2, H_kv, 7, 16, seed=seed + 9) * 2
        if seed == 3:                                    # laid out as the model's projection leaves them
            q = randn(2, 4, H, 16, seed=seed).transpose(1, 2)
        assert_close(A.scores(q, k), scores_by_loop(q, k), rtol=1e-5, atol=1e-5,
                     what=f"H={H}, H_kv={H_kv}: the scores (B, H_kv, G, C, T), q k^T / sqrt(d) with query head "
                     "kv * G + g in [:, kv, g]")
        check_tensor(A.scores(q.half(), k.half()), (2, H_kv, H // H_kv, 4, 7), torch.float16,
                     f"H={H}, H_kv={H_kv}, float16 queries and keys: the scores, in float16")
    q, k = randn(1, GQA_H, 2, GQA_D, seed=30), randn(1, 1, GQA_T, GQA_D, seed=31)     # one KV head: 16 MiB of keys
    with A.watch(fresh=True) as watch:                # read from outside your process: memory set aside counts too
        got = A.scores(q, k)
    assert watch.peak_bytes < SCORES_GROWTH, f"H={GQA_H}, H_kv=1, {GQA_T} keys of d = {GQA_D}: the process running " \
        f"your code grew by {watch.peak_bytes >> 20} MiB (the keys repeated for each query head hold " \
        f"{GQA_H * GQA_T * GQA_D * 4 >> 20} MiB; at most {SCORES_GROWTH >> 20} MiB is allowed): let a KV head's " \
        "G query heads read its keys as they are (the sheet: never repeat_interleave the keys)"
    assert_close(got, (q.view(1, 1, GQA_H, 2, GQA_D) @ k[:, :, None].transpose(-1, -2)) / math.sqrt(GQA_D),
                 rtol=1e-5, atol=1e-5,
                 what=f"H={GQA_H}, H_kv=1, 2 queries over {GQA_T} keys: the scores (1, 1, {GQA_H}, 2, {GQA_T})")


# -- task mask --------------------------------------------------------------------------------------------

def attention_by_loop(q, k, v, q_pos, k_pos):
    """The test's masked attention, query by query and head by head over the slots it may see: output
    (B, H, Tq, dv) and probabilities (B, H, Tq, Tk)."""
    B, H, Tq, d = q.shape
    G, Tk = H // k.shape[1], k.shape[2]
    out, probs = torch.empty(B, H, Tq, v.shape[-1]), torch.zeros(B, H, Tq, Tk)
    for b in range(B):
        for h in range(H):
            for t in range(Tq):
                seen = [s for s in range(Tk) if 0 <= k_pos[b, h // G, s] <= q_pos[t]]
                w = torch.softmax(k[b, h // G, seen] @ q[b, h, t] / math.sqrt(d), dim=0)
                out[b, h, t], probs[b, h, t, seen] = w @ v[b, h // G, seen], w
    return out, probs


def scattered(B, H, H_kv, Tq, Tk, d, seed):
    """Queries at the last Tq positions over Tk slots whose positions differ per row and KV head, out of
    order, with empty slots (-1) that hold garbage; one slot at position 0 and the queries' own positions kept."""
    g = generator("cache scattered", seed)
    q, k, v = torch.randn(B, H, Tq, d, generator=g), torch.randn(B, H_kv, Tk, d, generator=g), \
        torch.randn(B, H_kv, Tk, d, generator=g)
    q_pos = torch.arange(Tk + 4 - Tq, Tk + 4)
    k_pos = torch.empty(B, H_kv, Tk, dtype=torch.long)
    for b in range(B):
        for h in range(H_kv):
            keep = torch.cat([torch.tensor([0]), q_pos, torch.randperm(Tk + 3 - Tq, generator=g)[:Tk - Tq - 3] + 1])
            keep = torch.cat([keep, torch.tensor([-1, -1])])[torch.randperm(Tk, generator=g)]
            k_pos[b, h] = keep
    empty = k_pos < 0
    k, v = k.masked_fill(empty[..., None], 30.0), v.masked_fill(empty[..., None], 1e4)   # garbage
    return q, k, v, q_pos, k_pos


@points(3, task="mask")
def test_mask_from_positions_against_a_loop():
    """Per row and KV head different, unordered positions with empty slots (-1, garbage inside), queries at
    positions the slots hold, G = 2, 3 and 1: a query at p sees exactly the slots at positions 0..p."""
    for seed, (H, H_kv) in enumerate([(4, 2), (6, 2), (2, 2), (4, 2)]):
        q, k, v, q_pos, k_pos = scattered(2, H, H_kv, 3, 12, 8, seed)
        want, want_probs = attention_by_loop(q, k, v, q_pos, k_pos)
        got, probs = A.masked_attention(q, k, v, q_pos, k_pos, rows=3)
        where = f"H={H}, H_kv={H_kv}, query positions {q_pos.tolist()}, row 0 KV head 0 slot positions " \
            f"{k_pos[0, 0].tolist()} (a query at p sees the slots at 0..p, never -1)"
        assert_close(got, want, rtol=1e-5, atol=1e-4, what=f"{where}: the output")
        assert_close(probs, want_probs, rtol=1e-5, atol=1e-6, what=f"{where}: the probabilities (B, H, Tq, Tk)")
        ones, far = torch.ones_like(q), -1e5 * k.abs()                  # every score far below -1e4
        want_far, _ = attention_by_loop(ones, far, v, q_pos, k_pos)
        got, _ = A.masked_attention(ones, far, v, q_pos, k_pos)
        assert_close(got, want_far, rtol=1e-4, atol=1e-3, what=f"{where}, every score below -1e4: the output (a "
                     "masked score must be below any finite score)")
        got, _ = A.masked_attention(q.half(), k.half(), v.half(), q_pos, k_pos)
        check_tensor(got, want.shape, torch.float16, f"{where}, in float16: the output")
        assert_close(got.float(), want, rtol=2e-2, atol=2e-2, what=f"{where}, in float16: the output")


@points(3, task="mask")
def test_mask_probabilities_in_chunks_of_queries():
    """The probabilities a policy reads: every query's row sums to 1 over the slots it sees and is exactly 0
    elsewhere, in chunks of 1, 2 or all queries; one decode step (a single query) too."""
    q, k, v, q_pos, k_pos = scattered(2, 6, 2, 5, 14, 8, seed=7)
    want_out, want_probs = attention_by_loop(q, k, v, q_pos, k_pos)
    for chunk in (1, 2, None):
        out, probs = A.masked_attention(q, k, v, q_pos, k_pos, chunk=chunk, rows=5)
        hidden = want_probs == 0
        check_tensor(probs, want_probs.shape, want_probs.dtype, f"chunk {chunk}: the probabilities (B, H, Tq, Tk)")
        assert_close(probs.masked_fill(~hidden, 0.0), torch.zeros_like(want_probs),
                     what=f"chunk {chunk}: the probabilities on the slots each query may not see, all exactly 0")
        assert_close(probs, want_probs, rtol=1e-5, atol=1e-6, what=f"chunk {chunk}: the probabilities")
        assert_close(out, want_out, rtol=1e-5, atol=1e-4, what=f"chunk {chunk}: the output")
    one = slice(4, 5)
    out, probs = A.masked_attention(q[:, :, one], k, v, q_pos[one], k_pos, rows=1)
    assert_close(out, want_out[:, :, one], rtol=1e-5, atol=1e-4, what="a decode step (one query): the output")
