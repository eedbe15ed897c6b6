"""Public tests of the ``scissorhands`` assignment: the low flags, the order of eviction, how many to drop.
Run them with ``python -m course.grade scissorhands``."""

import adapters as A
import torch
from oracle import points


def first_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[int, ...] | None:
    """The index of the first entry where two tensors of the same shape differ, or None."""
    diff = (got != want).nonzero()
    return tuple(diff[0].tolist()) if len(diff) else None


@points(2, task="low_flags")
def test_low_flags_use_each_querys_uniform_level():
    # 2 KV heads, 2 queries, 4 slots; values exact in binary, so "equal to the level" is exactly equal
    attn = torch.tensor([[[[0.25, 0.125, 0.5, 0.125], [0.5, 0.5, 0.0, 0.0]],
                          [[0.5, 0.25, 0.25, 0.0], [0.0625, 0.4375, 0.25, 0.25]]]])
    visible = torch.tensor([[[[True, True, True, True], [True, True, False, False]],
                             [[True, True, True, False], [True, True, True, True]]]])
    # head 0: query 0 saw 4 slots (level 1/4: 0.25 is not below it); query 1 saw 2 (level 1/2), unseen slots
    # are never low; head 1: query 0 saw 3 (level 1/3), query 1 saw 4 (level 1/4)
    want = torch.tensor([[[[False, True, False, True], [False, False, False, False]],
                          [[False, True, True, False], [True, False, False, False]]]])
    got = A.unimportant(attn, visible)
    assert got.shape == want.shape and got.dtype == torch.bool, \
        f"low_flags returns a bool tensor shaped like attn {tuple(want.shape)}, got {got.dtype} {tuple(got.shape)}"
    at = first_difference(got, want)
    assert at is None, (f"a slot is low when its query attended it and its attention is below 1 / (slots that "
                        f"query attended): KV head {at[1]}, query {at[2]}, slot {at[3]} (attention {attn[at]:g}, "
                        f"{int(visible[at[:3]].sum())} slots attended) got {bool(got[at])}, expected {bool(want[at])}")
    tau = 0.25
    want = visible & (attn < tau)
    got = A.unimportant(attn, visible, threshold=tau)
    at = first_difference(got, want)
    assert at is None, (f"with threshold={tau} a slot is low when attended and strictly below {tau}: KV head "
                        f"{at[1]}, query {at[2]}, slot {at[3]} (attention {attn[at]:g}) got {bool(got[at])}, "
                        f"expected {bool(want[at])}")


@points(2, task="keep_score")
def test_fewer_low_flags_first_then_higher_attention():
    counts = torch.tensor([[[3, 0, 1, 1, 0, 2], [400, 400, 399, 0, 400, 400], [2, 1, 2, 1, 0, 2]]])
    attn = torch.tensor([[[0.9, 0.1, 0.3, 0.2, 0.4, 0.05], [0.5, 0.50000006, 0.0, 0.0, 0.25, 0.75],
                          [0.25, 0.5, 0.25, 0.5, 0.125, 0.25]]])
    pos = torch.tensor([[[0, 1, 2, 3, -1, 5], [4, 0, 1, 2, 3, 5], [0, 1, 2, 3, 4, 5]]])
    # head 0: slot 1 (no flag), 2 and 3 (one flag each, 2 has more attention), 5 (two), 0 (three); 4 is empty
    # head 1: slot 3 (no flag), slot 2 (399), then the 400s by attention: 5, 1 (0.50000006), 0 (0.5), 4
    # head 2: slot 4 (no flag), then slots 1 and 3 (one flag, attention 0.5 each: a tie), then 0, 2 and 5 (a tie)
    want = [[[1], [2], [3], [5], [0]], [[3], [2], [5], [1], [0], [4]], [[4], [1, 3], [0, 2, 5]]]   # best first
    score = A.keep_order(counts, attn, pos)
    assert score.shape == counts.shape, f"keep_score returns (B, H_kv, T) = {tuple(counts.shape)}, got {score.shape}"
    assert score[0, 0, 4] == float("-inf"), f"an empty slot (pos -1) scores -inf, got {float(score[0, 0, 4])}"

    def slot(s, h, i):
        return (f"slot {i} (I = {int(counts[0, h, i])}, attention {float(attn[0, h, i]):.8g}, score "
                f"{float(s[0, h, i])})")
    for kind, s in (("", score), (" (in float32, as select_topk ranks it)", score.float())):
        for h in range(3):
            for group in want[h]:
                for i in group[1:]:
                    assert s[0, h, i] == s[0, h, group[0]], (
                        f"equal counters and equal attention score equal{kind}: KV head {h}, {slot(s, h, group[0])} "
                        f"and {slot(s, h, i)}")
            for better, worse in zip(want[h], want[h][1:]):
                assert s[0, h, better[0]] > s[0, h, worse[0]], (
                    f"fewer low flags first, then the higher attention{kind}: KV head {h}, {slot(s, h, better[0])} "
                    f"must score above {slot(s, h, worse[0])}")


@points(2, task="n_dropped")
def test_tokens_to_drop():
    cases = [  # n_slots, budget, drop, n_recent, expected, why
        (10, 12, 1, 2, 0, "within budget: nothing to drop"),
        (12, 12, 4, 2, 0, "exactly the budget: nothing to drop"),
        (13, 12, 1, 2, 1, "one too many, m = 1"),
        (13, 12, 4, 2, 4, "m = 4 at a time, even for one too many"),
        (17, 12, 4, 2, 8, "5 too many: two compressions of m = 4"),
        (16, 12, 4, 2, 4, "4 too many: exactly one compression of m = 4"),
        (13, 12, 20, 2, 10, "m is cut to budget - n_recent = 10"),
        (23, 12, 20, 7, 15, "m is cut to budget - n_recent = 5: three compressions for 11 too many"),
    ]
    for n_slots, budget, drop, n_recent, want, why in cases:
        got = A.tokens_to_drop(n_slots, budget, drop, n_recent)
        assert got == want, (f"n_dropped(n_slots={n_slots}, budget={budget}, drop={drop}, n_recent={n_recent}): "
                             f"{why}, so {want}; got {got}")
