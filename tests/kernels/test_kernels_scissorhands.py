"""Scissorhands' step in three launches (kernels/scissorhands.py) against its PyTorch reference: the same output,
the same ring buffers, counters and attention, the same slot emptied.

Without a GPU the kernels run in Triton's interpreter (``tests/conftest.py`` sets TRITON_INTERPRET=1). The
cases have empty slots, a recent window, a ring buffer whose row the step overwrites holding flags already,
stale flags and a stale counter in the slot the step just wrote (which must start again empty), rings of
one row and of more rows than one block of the kernel, and (but for the ties) heads over their budget
beside heads under it.
"""

from typing import NamedTuple

import pytest
import torch

import kernels
from kernels.scissorhands import reference_scissors_attend, scissors_attend_triton
from tests.conftest import one_fast
from tests.kernels.test_kernels_heavy import state as heavy_state

pytestmark = pytest.mark.skipif(not kernels.HAS_TRITON or not (kernels.interpreting() or torch.cuda.is_available()),
                                reason="no way to run a Triton kernel: triton is not installed, or there is no "
                                       "CUDA device and TRITON_INTERPRET is not 1")
DEVICES = (["cpu"] if kernels.interpreting() else []) + (["cuda"] if torch.cuda.is_available() else [])


class Args(NamedTuple):
    """A step's arguments, in the launcher's order."""
    q: torch.Tensor          # (B, H, d)
    kb: torch.Tensor         # (B, H_kv, C, d)
    vb: torch.Tensor
    pos: torch.Tensor        # (B, H_kv, C) int64, -1 = empty
    slot: torch.Tensor       # (B, H_kv) the slot the step wrote
    low: torch.Tensor        # (B, H_kv, w, C) bool, the ring buffers
    count: torch.Tensor      # (B, H_kv, C) int32, their counters
    attn: torch.Tensor       # (B, H_kv, C) fp32, the last step's attention
    position: torch.Tensor   # (1,) the step's position


class After(NamedTuple):
    """What a step returns and leaves."""
    out: torch.Tensor
    low: torch.Tensor
    count: torch.Tensor
    attn: torch.Tensor
    pos: torch.Tensor
    slot: torch.Tensor


def state(B, H, H_kv, C, d, w, device, dtype=torch.float32, seed=0, uniform=False) -> Args:
    """H2O's step (``test_kernels_heavy.state``: a few empty slots per head, more in head 0, so that it is
    under budget where the others are over; the new entry at position C + 40 already written into its slot),
    with Scissorhands' state instead of H2O's scores: random rings of flags with their counters, the new
    entry's ring all set and its counter stale, and a last attention."""
    q, kb, vb, pos, slot, _, position = heavy_state(B, H, H_kv, C, d, device, dtype, seed, uniform)
    g = torch.Generator().manual_seed(seed + 1)
    at = slot.cpu()
    low = torch.zeros(B, H_kv, w, C, dtype=torch.bool) if uniform else torch.rand(B, H_kv, w, C, generator=g) < 0.4
    low.scatter_(3, at[:, :, None, None].expand(B, H_kv, w, 1), True)   # stale: the slot's last tenant's
    count = low.sum(2, dtype=torch.int32)
    count.scatter_(2, at[..., None], 1000)
    attn = torch.rand(B, H_kv, C, generator=g)
    return Args(q, kb, vb, pos, slot, *(t.to(device) for t in (low, count, attn)), position)


def both(args: Args, n_recent, budget, threshold=None, splits=None) -> tuple[After, After]:
    """The reference and the kernels, each on its own copy of the state: (want, got)."""
    ref, got = Args(*(t.clone() for t in args)), Args(*(t.clone() for t in args))
    out_ref = reference_scissors_attend(*ref, n_recent, budget, threshold)
    out = scissors_attend_triton(*got, n_recent, budget, threshold, splits=splits)
    return (After(out_ref, ref.low, ref.count, ref.attn, ref.pos, ref.slot),
            After(out, got.low, got.count, got.attn, got.pos, got.slot))


def assert_same(got: After, want: After, atol=1e-5):
    """The output and attention within ``atol`` (NaN where NaN); the flags, counters, positions and next
    slots equal."""
    torch.testing.assert_close(got.out, want.out, rtol=0, atol=atol, equal_nan=True)
    torch.testing.assert_close(got.attn, want.attn, rtol=0, atol=1e-5, equal_nan=True)
    for name in ("low", "count", "pos", "slot"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,H,H_kv,C,d", one_fast((2, 8, 2, 37, 16), (1, 4, 4, 300, 32), (2, 6, 2, 9, 16)))
@pytest.mark.parametrize("w", one_fast(1, 300))
@pytest.mark.parametrize("n_recent", one_fast(5, 0, 10_000))
def test_the_kernels_do_what_the_reference_does(device, B, H, H_kv, C, d, w, n_recent):
    """fp32 (300 slots: two blocks of the update kernel; w = 300: two blocks of its ring's reset; 10,000
    recent: no entry can go, so the head's slot 0 is emptied, as the reference's argmax picks; G = 3: a
    group padded to 4)."""
    args = state(B, H, H_kv, C, d, w, device)
    budget = (C * 3) // 5
    want, got = both(args, n_recent, budget)
    assert_same(got, want)
    over = (args.pos >= 0).sum(-1) > budget
    assert over.any() and not over.all()                                 # both kinds of head were tried
    assert torch.equal(want.slot[~over], args.slot[~over] + 1)            # under budget: the next slot
    new = args.slot[:, :, None, None].expand(B, H_kv, w, 1)
    assert (want.low.gather(3, new).sum((2, 3)) <= 1).all()              # the new entry's ring: its one flag
    assert torch.equal(want.count, want.low.sum(2, dtype=torch.int32))   # counters = flags in the ring


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", one_fast(3, 1))
@pytest.mark.parametrize("threshold", one_fast(None, 0.02, 1.0))
def test_splits_and_a_given_threshold(device, splits, threshold):
    """Up to 3 ranges a head, whose maxima and sums the update kernel merges; tau given (1.0: every held
    entry is low, the new one too) or the uniform level 1/n."""
    args = state(2, 8, 2, 300, 16, 7, device, seed=1)
    want, got = both(args, 5, 150, threshold, splits)
    assert_same(got, want)
    if threshold == 1.0:
        assert torch.equal(want.low[:, :, int(args.position % 7)], args.pos >= 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("C,splits", one_fast((40, 1), (300, 3)))
@pytest.mark.parametrize("H", one_fast(6, 4))
def test_ties_go_to_the_least_attention_then_the_latest_position(device, C, splits, H):
    """A zero query gives every entry the same probability, exactly 1/n, and the same group mean (G = 2, or
    3, whose mean can round below 1/n: the flags are then all set, in the kernel as in the reference), so
    equal counters stay equal; the slot emptied is then the one holding the latest position outside the
    recent window, also when the tied slots lie in different blocks and ranges. Every head holds the two
    positions on either side of the window's edge (the step's position - 3 and - 2, with 3 recent), so the
    edge is checked exactly. Then one counter higher than the rest, and it goes whatever its position."""
    args = state(2, H, 2, C, 16, 5, device, uniform=True)
    pos, slot, now = args.pos, args.slot, C + 40
    for row, edge in ((0, now - 3), (C - 1, now - 2)):                   # first block and last
        taken = pos == edge
        pos.masked_fill_(taken, -1)                                      # each position once a head
        at = torch.full_like(slot, row).masked_fill(slot == row, row + (1 if row == 0 else -1))
        pos.scatter_(2, at[..., None], edge)
    want, got = both(args, 3, 10, splits=splits)
    assert_same(got, want)
    flags = want.low[:, :, now % 5][pos >= 0]
    assert flags.all() or not flags.any()                                # one flag for every entry
    assert (want.pos.gather(2, slot[..., None]) == now).all()           # the new entry stays
    assert torch.equal(want.slot, (pos == now - 3).int().argmax(-1))     # the edge's outer side is emptied
    oldest = pos.masked_fill(pos < 0, now).argmin(-1, keepdim=True)     # each head's oldest entry...
    args.count.scatter_(2, oldest, 2)                                    # ...has the most flags
    args.low[:, :, 0].scatter_(2, oldest, True)
    args.low[:, :, 1].scatter_(2, oldest, True)
    want, got = both(args, 3, 10, splits=splits)
    assert_same(got, want)
    assert torch.equal(want.slot, oldest[..., 0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")     # the interpreter's NaN
def test_a_nan_attention_is_kept_and_ranked_last(device):
    """A NaN in a query makes its group's attention NaN: kept as NaN (the reference's ``copy_``), flagged
    not low (NaN < tau is false), and ranked as the least candidate (NaN last): the latest position goes."""
    args = state(2, 8, 2, 37, 16, 5, device)
    args.q[0, 4:] = float("nan")                                         # sequence 0, KV head 1's group
    args.low[0, 1] = False
    args.count[0, 1] = 0
    want, got = both(args, 5, 20)
    assert_same(got, want)
    assert want.attn[0, 1].isnan().all() and not want.attn[:, 0].isnan().any()
    assert not want.low[0, 1].any()
    held = (args.pos[0, 1] >= 0) & (args.pos[0, 1] < args.position + 1 - 5)
    assert int(want.slot[0, 1]) == int(args.pos[0, 1].masked_fill(~held, -1).argmax())     # over budget here


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
    exact = [(t.float() * 4).round().clamp(-8, 8).div(4).to(torch.bfloat16) for t in (args.q, args.kb)]
    want, got = both(args._replace(q=exact[0], kb=exact[1]), 5, 20)
    assert_same(got, want, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_one_line_errors(device):
    a = state(2, 8, 2, 9, 16, 3, device)
    with pytest.raises(ValueError, match="count int32"):
        scissors_attend_triton(*a._replace(count=a.count.long()), 3, 4)
    with pytest.raises(ValueError, match="low must have shape"):
        scissors_attend_triton(*a._replace(low=a.low[:, :, :, :4]), 3, 4)
    with pytest.raises(ValueError, match="slot must have shape"):
        scissors_attend_triton(*a._replace(slot=a.slot[:1]), 3, 4)
    with pytest.raises(ValueError, match="stride 1"):
        scissors_attend_triton(*a._replace(low=a.low.transpose(2, 3).contiguous().transpose(2, 3)), 3, 4)
