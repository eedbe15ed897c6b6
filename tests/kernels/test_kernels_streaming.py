"""StreamingLLM's step in three launches (kernels/streaming.py) against its PyTorch reference: the same output,
the same slot emptied, the same next slot.

Without a GPU the kernels run in Triton's interpreter (``tests/conftest.py`` sets TRITON_INTERPRET=1). The
cases have empty slots, sinks, heads over their budget beside heads under it, and the oldest entry after
the sinks in the first range, the last, or a middle one.
"""

import pytest
import torch

import kernels
from kernels.streaming import reference_sinks_attend, sinks_attend_triton
from tests.conftest import one_fast

pytestmark = pytest.mark.skipif(not kernels.HAS_TRITON or not (kernels.interpreting() or torch.cuda.is_available()),
                                reason="no way to run a Triton kernel: triton is not installed, or there is no "
                                       "CUDA device and TRITON_INTERPRET is not 1")
DEVICES = (["cpu"] if kernels.interpreting() else []) + (["cuda"] if torch.cuda.is_available() else [])


def state(B, H, H_kv, C, d, device, dtype=torch.float32, seed=0):
    """A step's arguments: positions drawn without repeats below the step's (C + 40), a fifth of the slots
    empty (half of head 0's, so that it is under budget where the others are over), the new entry written."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, d, generator=g)
    kb, vb = torch.randn(B, H_kv, C, d, generator=g), torch.randn(B, H_kv, C, d, generator=g)
    now = C + 40
    pos = torch.stack([torch.stack([torch.randperm(now, generator=g)[:C] for _ in range(H_kv)]) for _ in range(B)])
    empty = torch.rand(B, H_kv, C, generator=g) < 0.2
    empty[:, 0, : C // 2] = True
    pos = pos.masked_fill(empty, -1)
    slot = torch.randint(0, C, (B, H_kv), generator=g)
    pos.scatter_(2, slot[..., None], now)
    return [t.to(device) for t in (q.to(dtype), kb.to(dtype), vb.to(dtype), pos, slot)]


def both(args, n_sink, budget, splits=None):
    """(output, pos, slot) of the reference and of the kernels, each on its own copy of the state."""
    ref, got = [t.clone() for t in args], [t.clone() for t in args]
    out_ref = reference_sinks_attend(*ref, n_sink, budget)
    out = sinks_attend_triton(*got, n_sink, budget, splits=splits)
    return (out_ref, ref[3], ref[4]), (out, got[3], got[4])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,H,H_kv,C,d", one_fast((2, 8, 2, 37, 16), (1, 4, 4, 300, 32), (2, 6, 2, 9, 16)))
@pytest.mark.parametrize("n_sink", one_fast(4, 0, 1000))
@pytest.mark.parametrize("splits", one_fast(3, 1, 64))
def test_the_kernels_do_what_the_reference_does(device, B, H, H_kv, C, d, n_sink, splits):
    """fp32: the output within 1e-5, the positions and next slots equal (n_sink 1000: every entry a sink, so
    the first slot is the one chosen; splits 64: as many ranges as blocks)."""
    args = state(B, H, H_kv, C, d, device)
    budget = (C * 3) // 5
    want, got = both(args, n_sink, budget, splits)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    over = (args[3] >= 0).sum(-1) > budget
    assert over.any() and not over.all()                                 # both kinds of head were tried


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_the_oldest_entry_is_found_in_any_range(device, where):
    """The oldest position after the sinks placed in the first, a middle or the last slot, with 4 ranges of
    positions around it: the slot emptied is that one, in every head over its budget."""
    args = state(2, 4, 2, 200, 16, device, seed=1)
    pos = args[3]
    at = {"first": 0, "middle": 101, "last": 199}[where]
    pos.masked_fill_((pos >= 4) & (pos < 10), -1)                          # nothing else that old
    keep_new = args[4] == at
    args[4].masked_fill_(keep_new, at - 1 if at else 1)                   # the new entry elsewhere
    pos.scatter_(2, args[4][..., None], 240)
    pos[:, :, at] = 7
    want, got = both(args, 4, 50, splits=4)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert (want[2] == at).all() and (want[1][:, :, at] == -1).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("C,splits", [(37, None), (300, 64)])
def test_bf16(device, C, splits):
    """A bf16 cache: the output within bf16's rounding, the same slots (the choice reads positions only).
    300 slots, a range per block: 5 of bf16's 64-token blocks, which ``sinks_attend_triton`` must size its
    buffer for (fp32's 32-token blocks would make 10)."""
    args = state(2, 8, 2, C, 32, device, dtype=torch.bfloat16)
    want, got = both(args, 4, (C * 3) // 5, splits)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=0, atol=2e-2)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


@pytest.mark.parametrize("device", DEVICES)
def test_one_line_errors(device):
    q, kb, vb, pos, slot = state(2, 8, 2, 9, 16, device)
    with pytest.raises(ValueError, match="int64"):
        sinks_attend_triton(q, kb, vb, pos.int(), slot, 4, 5)
    with pytest.raises(ValueError, match="must have shape"):
        sinks_attend_triton(q, kb, vb, pos, slot[:1], 4, 5)
