"""
The reading path's attention, against a naive reference.

1. ``LayerKV`` grows in place: appends within capacity copy nothing, the buffer doubles when full, ``keep``
   leaves room, and the views always show exactly the T slots in use.
2. The two attends agree with the textbook computation: ``attend`` (the mask from positions, in chunks of
   queries) and ``attend_prompt`` (SDPA, statistics in chunks), probabilities and column sums included.
3. The model: the prompt attend and the general attend give the uncached forward's logits; a policy that
   asks for statistics gets exactly the full matrix's rows and column sums.
"""

from __future__ import annotations

import math

import pytest
import torch

import nanollm.attention as attention
from nanollm import CachePolicy, KVCache, LayerKV, decode_step, extend, prefill
from nanollm.attention import attend, attend_prompt
from nanollm.policy import Needs
from nanollm.storage import MIN_CAPACITY


def naive_attention(q, k, v, q_pos, k_pos):
    """The textbook computation: repeat K/V per query head, full (Tq, Tk) matrix, mask from positions."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)       # (B, H, Tk, d)
    kp = k_pos.repeat_interleave(G, dim=1)[:, :, None, :]                    # (B, H, 1, Tk)
    visible = (kp >= 0) & (kp <= q_pos[None, None, :, None])
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return probs @ v, probs                                                   # (B, H, Tq, d), (B, H, Tq, Tk)


def random_qkv(B=2, H=4, H_kv=2, Tq=9, Tk=9, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Tq, d, generator=g), torch.randn(B, H_kv, Tk, d, generator=g),
            torch.randn(B, H_kv, Tk, d, generator=g))


# ---------------------------------------------------------------------------------------------------------
# 1. Storage

def test_append_writes_in_place_and_doubles_when_full():
    kv = LayerKV()
    step = lambda t: kv.append(torch.full((1, 2, 1, 4), float(t)), torch.full((1, 2, 1, 4), -float(t)),  # noqa: E731
                               torch.tensor([t]))
    step(0)
    buffer, cap = kv.k.data_ptr(), kv.capacity()
    assert cap == 1 + MIN_CAPACITY                               # the first append leaves room
    for t in range(1, cap):
        step(t)
        assert kv.k.data_ptr() == buffer, "an append within capacity must not move the stored entries"
    step(cap)                                                    # full: one reallocation, twice the room
    assert kv.capacity() == 2 * cap and len(kv) == cap + 1
    assert torch.equal(kv.pos[0, 1], torch.arange(cap + 1))
    assert torch.equal(kv.k[0, 1, :, 0], torch.arange(cap + 1).float())
    assert torch.equal(kv.v[0, 0, :, 3], -torch.arange(cap + 1).float())
    assert kv.nbytes() == 2 * 2 * (cap + 1) * 4 * 4             # the slots in use, not the capacity
    assert kv.allocated_nbytes() == 2 * 2 * 2 * cap * 4 * 4


def test_keep_leaves_room_and_views_show_the_kept_slots():
    kv = LayerKV()
    kv.append(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), torch.arange(10))
    k0 = kv.k.clone()
    kv.keep(torch.tensor([[[1, 4, 7], [0, 8, 9]]]))
    assert len(kv) == 3 and kv.capacity() > 3
    assert torch.equal(kv.k[0, 0], k0[0, 0, [1, 4, 7]]) and torch.equal(kv.pos[0, 1], torch.tensor([0, 8, 9]))
    kept = kv.k.data_ptr()
    kv.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), torch.tensor([10]))
    assert kv.k.data_ptr() == kept and kv.pos[0, 0].tolist() == [1, 4, 7, 10]
    kv.keep(torch.tensor([[[0, 1, 2, 3], [0, 1, -1, -1]]]))     # -1: an empty slot
    assert kv.counts().tolist() == [[4, 2]] and kv.pos[0, 1].tolist() == [0, 8, -1, -1]


@pytest.mark.parametrize("room", [0, 1, 3])
def test_replace_with_room_and_the_next_append_writes_there(room):
    kv = LayerKV()
    kv.append(torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4), torch.arange(4))
    kv.set_state("score", torch.ones(1, 2, 4), fill=0.0)
    k, v = torch.randn(1, 2, 3 + room, 4), torch.randn(1, 2, 3 + room, 5)
    pos = torch.tensor([[[0, 2, 3] + [-1] * room, [1, 2, 3] + [-1] * room]])
    kv.replace(k, v, pos, n=3 if room else None)
    assert len(kv) == 3 and kv.capacity() == 3 + room and kv.state == {}
    assert torch.equal(kv.k, k[:, :, :3]) and torch.equal(kv.pos, pos[:, :, :3])    # the views: the 3 only
    buffer = kv.k.data_ptr()
    kv.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 5), torch.tensor([4]))
    assert (kv.k.data_ptr() == buffer) == (room >= 1), "an append within the room must not move the entries"
    assert kv.pos[0, 0].tolist() == [0, 2, 3, 4] and torch.equal(kv.v[:, :, :3], v[:, :, :3])


# ---------------------------------------------------------------------------------------------------------
# 2. The attention paths

@pytest.mark.parametrize("chunk", [1, 3, 4, None])
def test_chunked_masked_attention_equals_the_whole_matrix(chunk):
    """Attention in chunks of queries == the full (Tq, Tk) computation, rows and column sums too."""
    q, k, v = random_qkv(Tq=11, Tk=14)
    q_pos = torch.arange(3, 14)
    k_pos = torch.arange(14).expand(2, 2, 14).clone()
    k_pos[1, 0, 5] = -1                                                     # an empty slot
    k_pos[0, 1] = k_pos[0, 1].flip(0)                                       # slots in any order
    ref_out, ref_probs = naive_attention(q, k, v, q_pos, k_pos)
    out, probs, col_sums = attend(q, k, v, q_pos, k_pos, Needs(rows=None, col_sums=True), chunk=chunk)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(probs, ref_probs, rtol=0, atol=1e-5)
    torch.testing.assert_close(col_sums, ref_probs.sum(dim=2), rtol=0, atol=1e-5)
    _, last, none = attend(q, k, v, q_pos, k_pos, Needs(rows=4), chunk=chunk)
    torch.testing.assert_close(last, ref_probs[:, :, -4:], rtol=0, atol=1e-5)
    assert none is None
    _, no_rows, _ = attend(q, k, v, q_pos, k_pos, Needs(), chunk=chunk)
    assert no_rows is None


@pytest.mark.parametrize("elements", [2 * 4 * 12, 5 * 2 * 4 * 12, None])      # 1 query, 5 queries, all per chunk
@pytest.mark.parametrize("needs", [Needs(), Needs(rows=3), Needs(rows=None), Needs(col_sums=True),
                                   Needs(rows=2, col_sums=True), Needs(rows=7)])
def test_prompt_attention_equals_the_reference(needs, elements, monkeypatch):
    """The prompt over itself: SDPA for the output, statistics beside it in chunks."""
    if elements is not None:
        monkeypatch.setattr(attention, "SCORE_ELEMENTS", elements)
    q, k, v = random_qkv(Tq=12, Tk=12)
    q_pos = torch.arange(12)
    ref_out, ref_probs = naive_attention(q, k, v, q_pos, q_pos.expand(2, 2, 12))
    out, probs, col_sums = attend_prompt(q, k, v, needs)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
    rows = 12 if needs.rows is None else needs.rows
    if rows:
        torch.testing.assert_close(probs, ref_probs[:, :, 12 - rows:], rtol=0, atol=1e-5)
    else:
        assert probs is None
    if needs.col_sums:
        torch.testing.assert_close(col_sums, ref_probs.sum(dim=2), rtol=0, atol=1e-5)
    else:
        assert col_sums is None
    assert torch.equal(out, attend_prompt(q, k, v)[0])          # the output never depends on what was asked


def test_decode_step_equals_the_reference():
    q, k, v = random_qkv(Tq=1, Tk=30)
    q_pos, k_pos = torch.tensor([40]), torch.randperm(30).expand(2, 2, 30)   # any order, all in the past
    ref_out, ref_probs = naive_attention(q, k, v, q_pos, k_pos)
    out, probs, col_sums = attend(q, k, v, q_pos, k_pos, Needs(rows=1, col_sums=True))
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(probs, ref_probs, rtol=0, atol=1e-6)
    torch.testing.assert_close(col_sums, ref_probs[:, :, 0], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# 3. The model on both storage paths

class GeneralPath(CachePolicy):
    """Keeps everything but hands attention the storage's slots in reverse order: the prompt too goes
    through ``attend`` (the mask from positions) instead of ``attend_prompt``."""

    def attend_kv(self, layer, store):
        return LayerKV(store.k.flip(2), store.v.flip(2), store.pos.flip(2))


@pytest.mark.parametrize("policy", [None, GeneralPath()], ids=["prompt", "general"])
def test_cached_equals_uncached_on_both_attends(tiny_model, policy):
    model = tiny_model
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
    cache = KVCache(model.config, policy)
    steps = [prefill(model, ids[:, :12], cache), extend(model, ids[:, 12:20], cache)]
    steps += [decode_step(model, ids[:, t], cache)[:, None] for t in range(20, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_the_prompt_takes_attend_prompt_and_every_later_step_attend(tiny_model, monkeypatch):
    calls = []
    for name in ("attend", "attend_prompt"):
        real = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, _n=name, _f=real, **kw: calls.append(_n) or _f(*a, **kw))
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 16))
    cache = KVCache(tiny_model.config)
    prefill(tiny_model, ids[:, :10], cache)
    assert calls == ["attend_prompt"] * tiny_model.config.n_layer
    calls.clear()
    decode_step(tiny_model, ids[:, 10], cache)
    extend(tiny_model, ids[:, 11:14], cache)
    assert calls == ["attend"] * 2 * tiny_model.config.n_layer


def test_policy_statistics_equal_the_full_matrix(tiny_model):
    """What a policy receives at prefill (last rows, column sums) is the naive full probability matrix's,
    computed here from the same queries and keys."""

    class Record(CachePolicy):
        def __init__(self, needs):
            self.wanted, self.got = needs, {}

        def needs(self, phase):
            return self.wanted

        def on_prefill(self, ctx):
            kv = ctx.kv
            _, ref = naive_attention(ctx.q, kv.k, kv.v, ctx.q_pos, kv.pos)          # (B, H, T, T)
            self.got[ctx.layer] = (ctx.probs, ctx.col_sums, ref)

    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(5))
    every, some = Record(Needs(rows=None)), Record(Needs(rows=5, col_sums=True))
    for policy in (every, some):
        prefill(tiny_model, ids, KVCache(tiny_model.config, policy))
    for layer in range(tiny_model.config.n_layer):
        probs, none, ref = every.got[layer]
        torch.testing.assert_close(probs, ref, rtol=0, atol=1e-6)
        assert none is None
        rows, col_sums, ref = some.got[layer]
        torch.testing.assert_close(rows, ref[:, :, -5:], rtol=0, atol=1e-6)
        torch.testing.assert_close(col_sums, ref.sum(dim=2), rtol=0, atol=1e-5)
