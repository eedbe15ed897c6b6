"""Scissorhands' step in three launches (kernels/scissorhands.py) against its PyTorch reference: the same output,
the same ring buffers, counters and attention, the same slot emptied.

Without a GPU the kernels run in Triton's interpreter (``tests/conftest.py`` sets TRITON_INTERPRET=1). The
cases have empty slots, a recent window, a ring buffer whose row the step overwrites holding flags already,
stale flags and a stale counter in the slot the step just wrote (which must start again empty), rings of
one row and of more rows than one block of the kernel, and (but for the ties) heads over their budget
beside heads under it.
"""

import pytest
import torch

import kernels
from kernels.scissorhands import reference_scissors_attend, scissors_attend_triton

pytestmark = pytest.mark.skipif(not kernels.HAS_TRITON or not (kernels.interpreting() or torch.cuda.is_available()),
                                reason="no way to run a Triton kernel: triton is not installed, or there is no "
                                       "CUDA device and TRITON_INTERPRET is not 1")
DEVICES = (["cpu"] if kernels.interpreting() else []) + (["cuda"] if torch.cuda.is_available() else [])


def state(B, H, H_kv, C, d, w, device, dtype=torch.float32, seed=0, uniform=False):
    """A step's arguments: buffers with a few empty slots per head (more in head 0, so that it is under
    budget where the others are over), each head's entries at distinct earlier positions, random rings of
    flags with their counters, and the step's new entry at position C + 40 already written into its slot
    (as the fused step writes before attending), its ring all set and its counter stale."""
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(B, H, d) if uniform else torch.randn(B, H, d, generator=g)
    kb, vb = torch.randn(B, H_kv, C, d, generator=g), torch.randn(B, H_kv, C, d, generator=g)
    now = C + 40                                                         # the step's position
    pos = torch.stack([torch.stack([torch.randperm(now, generator=g)[:C] for _ in range(H_kv)]) for _ in range(B)])
    empty = torch.rand(B, H_kv, C, generator=g) < 0.2
    empty[:, 0, : C // 2] = True                                         # head 0: few entries
    pos = pos.masked_fill(empty, -1)
    slot = torch.randint(0, C, (B, H_kv), generator=g)
    pos.scatter_(2, slot[..., None], now)                                # the new entry, written
    low = torch.zeros(B, H_kv, w, C, dtype=torch.bool) if uniform else torch.rand(B, H_kv, w, C, generator=g) < 0.4
    low.scatter_(3, slot[:, :, None, None].expand(B, H_kv, w, 1), True)  # stale: the slot's last tenant's
    count = low.sum(2, dtype=torch.int32)
    count.scatter_(2, slot[..., None], 1000)
    attn = torch.rand(B, H_kv, C, generator=g)
    args = [q.to(dtype), kb.to(dtype), vb.to(dtype), pos, slot, low, count, attn, torch.tensor([now])]
    return [t.to(device) for t in args]


def both(args, n_recent, budget, threshold=None, splits=None):
    """The reference and the kernels, each on its own copy of the state: (output, low, count, attn, pos,
    slot) each."""
    ref = [t.clone() for t in args]
    got = [t.clone() for t in args]
    out_ref = reference_scissors_attend(*ref, n_recent, budget, threshold)
    out = scissors_attend_triton(*got, n_recent, budget, threshold, splits=splits)
    return (out_ref, *ref[5:8], ref[3], ref[4]), (out, *got[5:8], got[3], got[4])


def assert_same(got, want):
    """The output and attention within 1e-5 (fp32); the flags, counters, positions and next slots equal."""
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[3], want[3], rtol=0, atol=1e-5)
    for name, a, b in zip(("low", "count", "pos", "slot"), got[1:3] + got[4:], want[1:3] + want[4:]):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,H,H_kv,C,d", [(2, 8, 2, 37, 16), (1, 4, 4, 300, 32), (2, 6, 2, 9, 16)])
@pytest.mark.parametrize("w", [1, 300])
@pytest.mark.parametrize("n_recent", [0, 5, 10_000])
def test_the_kernels_do_what_the_reference_does(device, B, H, H_kv, C, d, w, n_recent):
    """fp32 (300 slots: two blocks of the update kernel; w = 300: two blocks of its ring's reset; 10,000
    recent: no entry can go, so the head's slot 0 is emptied, as the reference's argmax picks; G = 3: a
    group padded to 4)."""
    args = state(B, H, H_kv, C, d, w, device)
    budget = (C * 3) // 5
    want, got = both(args, n_recent, budget)
    assert_same(got, want)
    over = (args[3] >= 0).sum(-1) > budget
    assert over.any() and not over.all()                                 # both kinds of head were tried
    assert torch.equal(want[5][~over], args[4][~over] + 1)                # under budget: the next slot
    new = args[4][:, :, None, None].expand(B, H_kv, w, 1)
    assert (want[1].gather(3, new).sum((2, 3)) <= 1).all()               # the new entry's ring: its one flag
    assert torch.equal(want[2], want[1].sum(2, dtype=torch.int32))        # counters = flags in the ring


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("threshold", [None, 0.02, 1.0])
def test_splits_and_a_given_threshold(device, splits, threshold):
    """Up to 3 ranges a head, whose maxima and sums the update kernel merges; tau given (1.0: every held
    entry is low, the new one too) or the uniform level 1/n."""
    args = state(2, 8, 2, 300, 16, 7, device, seed=1)
    want, got = both(args, 5, 150, threshold, splits)
    assert_same(got, want)
    if threshold == 1.0:
        held = args[3] >= 0
        row = int(args[8] % 7)
        assert torch.equal(want[1][:, :, row], held)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("C,splits", [(40, 1), (300, 3)])
def test_ties_go_to_the_least_attention_then_the_latest_position(device, C, splits):
    """A zero query gives every entry the same probability, exactly 1/n: no flag is low, so equal counters
    stay equal; the slot emptied is then the one holding the latest position outside the recent window, also
    when the tied slots lie in different blocks and ranges. Every head holds the two positions on either
    side of the window's edge (the step's position - 3 and - 2, with 3 recent), so the edge is checked
    exactly. Then one counter higher than the rest, and it goes whatever its position."""
    args = state(2, 4, 2, C, 16, 5, device, uniform=True)
    pos, slot, now = args[3], args[4], C + 40
    for row, edge in ((0, now - 3), (C - 1, now - 2)):                   # first block and last
        taken = pos == edge
        pos.masked_fill_(taken, -1)                                      # each position once a head
        at = torch.full_like(slot, row).masked_fill(slot == row, row + (1 if row == 0 else -1))
        pos.scatter_(2, at[..., None], edge)
    want, got = both(args, 3, 10, splits=splits)
    assert_same(got, want)
    assert not want[1].any()                                             # 1/n is not below 1/n
    assert (want[4].gather(2, slot[..., None]) == now).all()            # the new entry stays
    assert torch.equal(want[5], (pos == now - 3).int().argmax(-1))       # the edge's outer side is emptied
    oldest = pos.masked_fill(pos < 0, now).argmin(-1, keepdim=True)     # each head's oldest entry...
    args[6].scatter_(2, oldest, 2)                                       # ...has the most flags
    args[5][:, :, 0].scatter_(2, oldest, True)
    args[5][:, :, 1].scatter_(2, oldest, True)
    want, got = both(args, 3, 10, splits=splits)
    assert_same(got, want)
    assert torch.equal(want[5], oldest[..., 0])


@pytest.mark.parametrize("device", DEVICES)
def test_bf16(device):
    """A bf16 cache: the output within bf16's rounding, the attention within 1e-5, and the same flags,
    counters and slot emptied. The flags and the choice are decisions, which a score rounded otherwise could
    flip (a GPU's bf16 product rounds the scaled query to bf16, the reference's fp32 product does not): so
    the queries and keys here are multiples of 1/4 and d = 16 (scale 1/4), every score exact either way,
    and what is left to differ, the exponentials' last bits, is far inside this state's margins (every
    attention at least 1% from 1/n; among the candidates with the most flags, the least attention 30%
    below the next)."""
    args = state(2, 8, 2, 37, 16, 5, device, dtype=torch.bfloat16, seed=1)
    for i in (0, 1):                                                     # q and kb: exact in bf16
        args[i] = (args[i].float() * 4).round().clamp(-8, 8).div(4).to(torch.bfloat16)
    want, got = both(args, 5, 20)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=0, atol=2e-2)
    torch.testing.assert_close(got[3], want[3], rtol=0, atol=1e-5)
    for a, b in zip(got[1:3] + got[4:], want[1:3] + want[4:]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_one_line_errors(device):
    q, kb, vb, pos, slot, low, count, attn, position = state(2, 8, 2, 9, 16, 3, device)
    with pytest.raises(ValueError, match="count int32"):
        scissors_attend_triton(q, kb, vb, pos, slot, low, count.long(), attn, position, 3, 4)
    with pytest.raises(ValueError, match="low must have shape"):
        scissors_attend_triton(q, kb, vb, pos, slot, low[:, :, :, :4], count, attn, position, 3, 4)
    with pytest.raises(ValueError, match="slot must have shape"):
        scissors_attend_triton(q, kb, vb, pos, slot[:1], low, count, attn, position, 3, 4)
    with pytest.raises(ValueError, match="stride 1"):
        scissors_attend_triton(q, kb, vb, pos, slot, low.transpose(2, 3).contiguous().transpose(2, 3), count,
                               attn, position, 3, 4)
