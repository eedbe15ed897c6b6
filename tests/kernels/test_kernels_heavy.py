"""H2O's step in four launches (kernels/heavy_hitters.py) against its PyTorch reference: the same output, the
same scores, the same slot emptied.

Without a GPU the kernels run in Triton's interpreter (``tests/conftest.py`` sets TRITON_INTERPRET=1). The
cases have empty slots, a recent window, a stale score in the slot the step just wrote (which must start
again from 0), and (but for the ties) heads over their budget beside heads under it.
"""

import pytest
import torch

import kernels
from kernels.heavy_hitters import heavy_attend_triton, reference_heavy_attend
from tests.conftest import one_fast

pytestmark = pytest.mark.skipif(not kernels.HAS_TRITON or not (kernels.interpreting() or torch.cuda.is_available()),
                                reason="no way to run a Triton kernel: triton is not installed, or there is no "
                                       "CUDA device and TRITON_INTERPRET is not 1")
DEVICES = (["cpu"] if kernels.interpreting() else []) + (["cuda"] if torch.cuda.is_available() else [])


def state(B, H, H_kv, C, d, device, dtype=torch.float32, seed=0, uniform=False):
    """A step's arguments: buffers with a few empty slots per head (more in head 0, so that it is under
    budget where the others are over), each head's entries at distinct earlier positions, and the step's
    new entry at position C + 40 already written into its slot (as the fused step writes before attending)."""
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
    score = torch.zeros(B, H_kv, C) if uniform else torch.rand(B, H_kv, C, generator=g) * 3
    score.scatter_(2, slot[..., None], 100.0)                            # stale: the slot's last tenant's
    args = [q.to(dtype), kb.to(dtype), vb.to(dtype), pos, slot, score, torch.tensor([now])]
    return [t.to(device) for t in args]


def both(args, n_recent, budget, splits=None):
    """The reference and the kernels, each on its own copy of the state: (output, score, pos, slot) each."""
    ref = [t.clone() for t in args]
    got = [t.clone() for t in args]
    out_ref = reference_heavy_attend(*ref, n_recent, budget)
    out = heavy_attend_triton(*got, n_recent, budget, splits=splits)
    return (out_ref, ref[5], ref[3], ref[4]), (out, got[5], got[3], got[4])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,H,H_kv,C,d", one_fast((2, 8, 2, 37, 16), (1, 4, 4, 300, 32), (2, 6, 2, 9, 16)))
@pytest.mark.parametrize("n_recent", one_fast(5, 0, 10_000))
@pytest.mark.parametrize("splits", one_fast(3, 1))
def test_the_kernels_do_what_the_reference_does(device, B, H, H_kv, C, d, n_recent, splits):
    """fp32: the output and scores within 1e-5, the positions and next slots equal (300 slots: two blocks of
    the update kernel; 10,000 recent: every entry stays, so the latest one is emptied; splits=3: up to 3
    ranges a head, whose maxima and sums the update kernel merges)."""
    args = state(B, H, H_kv, C, d, device)
    budget = (C * 3) // 5
    want, got = both(args, n_recent, budget, splits)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    over = (args[3] >= 0).sum(-1) > budget
    assert over.any() and not over.all()                                 # both kinds of head were tried
    assert torch.equal(want[3][~over], args[4][~over] + 1)                # under budget: the next slot
    assert (want[1].gather(2, args[4][..., None]) < 100).all()           # the stale score was reset


@pytest.mark.parametrize("device", DEVICES)
def test_a_head_is_over_its_budget_by_all_its_blocks_together(device):
    """300 slots are two blocks of 256 and 44 for the kernel that scores them, each block counting its own
    entries: a budget no block's count exceeds, but the sum of a head's blocks does, still empties a slot."""
    args = state(1, 4, 4, 300, 32, device)
    held = args[3] >= 0
    budget = int(torch.stack([held[..., :256].sum(-1), held[..., 256:].sum(-1)]).max())   # no block over it
    over = held.sum(-1) > budget
    assert over.sum() >= 2                                               # but heads over it, all blocks counted
    want, got = both(args, 5, budget)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    assert (want[2] < 0).sum() == (args[3] < 0).sum() + over.sum()       # one slot emptied per head over


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("C,splits", [(40, 1), (300, 3)])
def test_ties_go_to_the_latest_position(device, C, splits):
    """A zero query gives every entry the same probability and every score the same sum: the slot emptied
    is the one holding the latest position outside the recent window, as ``select_lowest`` picks, also when
    the tied slots lie in different blocks and ranges. Every head holds the two positions on either side of
    the window's edge (the step's position - 3 and - 2, with 3 recent), so the edge is checked exactly."""
    args = state(2, 4, 2, C, 16, device, uniform=True)
    pos, slot, now = args[3], args[4], C + 40
    for row, edge in ((0, now - 3), (C - 1, now - 2)):                   # first block and last
        taken = pos == edge
        pos.masked_fill_(taken, -1)                                      # each position once a head
        at = torch.full_like(slot, row).masked_fill(slot == row, row + (1 if row == 0 else -1))
        pos.scatter_(2, at[..., None], edge)
    want, got = both(args, 3, 10, splits)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    assert (want[2].gather(2, slot[..., None]) == now).all()            # the new entry stays
    assert torch.equal(want[3], (pos == now - 3).int().argmax(-1))       # the edge's outer side is emptied


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_infinite_scores_are_ordered_as_the_reference_orders_them(device):
    """A NaN score counts as -inf (tied with it: the later position is emptied), +inf as the largest finite
    number, in the kernel as in the reference: scores never get there in a run, but the two must not differ
    where they do."""
    for values in ((float("nan"), float("-inf")), (float("inf"),), (float("-inf"), -1e30)):
        args = state(2, 8, 2, 37, 16, device, seed=3)
        pos, score = args[3], args[5]
        old = (pos >= 0) & (pos < 20)                                    # outside any recent window here
        for i, value in enumerate(values):
            first = old.int().argmax(-1, keepdim=True)                   # a held, old slot per head
            score.scatter_(2, first, value)
            old.scatter_(2, first, False)
        if values == (float("inf"),):
            score.masked_fill_((pos >= 0) & (pos < 77 + 1 - 5), float("inf"))  # every candidate infinite
        want, got = both(args, 5, 20)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5, equal_nan=True)
        assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3]), values


@pytest.mark.parametrize("device", DEVICES)
def test_bf16(device):
    """A bf16 cache: the output within bf16's rounding; the scores within 1e-3 (on a GPU the scaled query
    enters the product rounded to bf16, which the reference's fp32 product does not; d = 32, whose scale
    1/sqrt(32) is not a power of two, so that rounding happens); the same slot emptied on these values."""
    args = state(2, 8, 2, 37, 32, device, dtype=torch.bfloat16)
    want, got = both(args, 5, 20)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=0, atol=2e-2)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-3)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])


@pytest.mark.parametrize("device", DEVICES)
def test_one_line_errors(device):
    q, kb, vb, pos, slot, score, position = state(2, 8, 2, 9, 16, device)
    with pytest.raises(ValueError, match="score must be fp32"):
        heavy_attend_triton(q, kb, vb, pos, slot, score.double(), position, 3, 4)
    with pytest.raises(ValueError, match="slot must have shape"):
        heavy_attend_triton(q, kb, vb, pos, slot[:1], score, position, 3, 4)
    with pytest.raises(ValueError, match="int64"):
        heavy_attend_triton(q, kb, vb, pos.int(), slot, score, position, 3, 4)
