"""Public tests of the ``scissorhands`` assignment: the low flags, the order of eviction, how many to drop.
Run them with ``python -m course.grade scissorhands``."""

import adapters as A
import torch
from oracle import assert_close, check_tensor, generator, points


def permuted(g, *tensors, dims=(1, 2, 3)):
    """The tensors with the same random order along each of ``dims`` (drawn from ``g``): heads, queries, slots.
    A rule that looks at each query's row as a whole gives the permuted answer of the permuted input."""
    for dim in dims:
        order = torch.randperm(tensors[0].shape[dim], generator=g)
        tensors = tuple(t.index_select(dim, order) for t in tensors)
    return tensors


@points(2, task="low_flags")
def test_low_flags_use_each_querys_uniform_level():
    """A hand case (its heads, queries and slots in an order drawn from the run's seed), then a threshold drawn
    from it."""
    # 2 KV heads, 2 queries, 4 slots; values exact in binary, so "equal to the level" is exactly equal
    attn = torch.tensor([[[[0.25, 0.125, 0.5, 0.125], [0.5, 0.5, 0.0, 0.0]],
                          [[0.5, 0.25, 0.25, 0.0], [0.0625, 0.4375, 0.25, 0.25]]]])
    visible = torch.tensor([[[[True, True, True, True], [True, True, False, False]],
                             [[True, True, True, False], [True, True, True, True]]]])
    # head 0: query 0 saw 4 slots (level 1/4: 0.25 is not below it); query 1 saw 2 (level 1/2), unseen slots
    # are never low; head 1: query 0 saw 3 (level 1/3), query 1 saw 4 (level 1/4)
    want = torch.tensor([[[[False, True, False, True], [False, False, False, False]],
                          [[False, True, True, False], [True, False, False, False]]]])
    g = generator("low flags public")
    attn, visible, want = permuted(g, attn, visible, want)

    def detail(at):
        return f"attention {attn[at]:g}, {int(visible[at[:3]].sum())} slots attended by that query"
    assert_close(A.unimportant(attn, visible), want, detail=detail,
                 what="the low flags (B, H_kv, Tn, T), a bool tensor shaped like attn: a slot is low when its query "
                 "attended it and its attention is below 1 / (slots that query attended)")
    rows = A.unimportant(torch.cat([attn, attn.flip(-1)]), torch.cat([visible, visible.flip(-1)]))
    assert_close(rows, torch.cat([want, want.flip(-1)]), what="two batch rows (the case, then its slots reversed): "
                 "each query's level counts the slots it attended in its own row")
    assert_close(A.unimportant(torch.tensor([[[[0.625, 0.375, 0.0]]]]), torch.ones(1, 1, 1, 3, dtype=torch.bool)),
                 torch.tensor([[[[False, False, True]]]]), what="one query that attended 3 slots, one of them with "
                 "attention 0: the level is 1/3 (every True entry of visible counts, even at 0), so 0.375 is not low")
    tau = 0.05 + 0.5 * float(torch.rand(1, generator=g))
    assert_close(A.unimportant(attn, visible, threshold=tau), visible & (attn < tau), detail=detail,
                 what=f"with threshold={tau:.6g}, the low flags: a slot is low when attended and strictly below it")

    # softmax rows as the policy sees them (float32): exactly at the level, and a hair below it
    n = torch.tensor([10, 25, 31])                                           # slots attended by KV head 0, 1, 2
    seen = (torch.arange(31) < n[:, None, None])[None]                       # (1, 3, 1, 31)
    uniform = torch.softmax(torch.zeros(seen.shape).masked_fill(~seen, float("-inf")), -1)
    assert_close(A.unimportant(uniform, seen), torch.zeros_like(seen), what="uniform rows (a softmax of equal "
                 "scores over 10, 25 and 31 slots): each attention is 1/n, exactly the level as float32 computes it, "
                 "so no slot is low")
    near = torch.softmax(torch.tensor([[[[0.0, 0.0, 0.0, 1e-6]]]]), -1)     # 0.24999995 three times, then more
    assert_close(A.unimportant(near, torch.ones(1, 1, 1, 4, dtype=torch.bool)),
                 torch.tensor([[[[True, True, True, False]]]]), what="a softmax of the scores (0, 0, 0, 1e-6): the "
                 "first three attentions, 0.24999995, are below the level 1/4 by a hair, and low")


@points(2, task="keep_score")
def test_fewer_low_flags_first_then_higher_attention():
    """A hand case of ties and near ties (each head's slots and the heads in an order drawn from the run's seed,
    the attentions scaled by a power of two, which changes no order)."""
    counts = torch.tensor([[[3, 0, 1, 1, 0, 2], [400, 400, 399, 0, 400, 400], [2, 1, 2, 1, 0, 2]]])
    attn = torch.tensor([[[0.9, 0.1, 0.3, 0.2, 0.4, 0.05], [0.5, 0.50000006, 0.0, 0.0, 0.25, 0.75],
                          [0.25, 0.5, 0.25, 0.5, 0.125, 0.25]]])
    pos = torch.tensor([[[0, 1, 2, 3, -1, 5], [4, 0, 1, 2, 3, 5], [0, 1, 2, 3, 4, 5]]])
    # head 0: slot 1 (no flag), 2 and 3 (one flag each, 2 has more attention), 5 (two), 0 (three); 4 is empty
    # head 1: slot 3 (no flag), slot 2 (399), then the 400s by attention: 5, 1 (0.50000006), 0 (0.5), 4
    # head 2: slot 4 (no flag), then slots 1 and 3 (one flag, attention 0.5 each: a tie), then 0, 2 and 5 (a tie)
    want = [[[1], [2], [3], [5], [0]], [[3], [2], [5], [1], [0], [4]], [[4], [1, 3], [0, 2, 5]]]   # best first
    g = generator("keep score public")
    heads = torch.randperm(3, generator=g)
    slots = torch.stack([torch.randperm(6, generator=g) for _ in range(3)])[None]     # new slot i: old slots[i]
    counts, attn, pos = (t[:, heads].gather(-1, slots) for t in (counts, attn, pos))
    attn = attn * 2.0 ** int(torch.randint(-4, 5, (1,), generator=g))
    now = [{old: new for new, old in enumerate(slots[0, h].tolist())} for h in range(3)]
    want = [[[now[h][i] for i in group] for group in want[int(heads[h])]] for h in range(3)]
    score = A.keep_order(counts, attn, pos)
    check_tensor(score, counts.shape, torch.float64, "keep_score's scores (B, H_kv, T)")
    empty = pos < 0
    assert_close(score[empty], torch.full((int(empty.sum()),), float("-inf"), dtype=torch.float64),
                 what="the scores of the empty slots (pos -1), all -inf")

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


    T = 1100                                                   # "T up to a few thousand slots"
    many = A.keep_order((torch.arange(T) % 2).view(1, 1, T), torch.arange(T).float().view(1, 1, T) / T,
                        torch.arange(T).view(1, 1, T))
    low, high = int(many[0, 0, ::2].argmin()) * 2, int(many[0, 0, 1::2].argmax()) * 2 + 1
    assert many[0, 0, low] > many[0, 0, high], (
        f"{T} slots, counters alternating 0 and 1, attention rising with the slot: every slot with I = 0 must score "
        f"above every slot with I = 1, however their attentions compare; slot {low} (I = 0) scores "
        f"{float(many[0, 0, low])}, slot {high} (I = 1) {float(many[0, 0, high])}")
    tiny = torch.tensor([[[0.0, 1e-30, 1e-10, 1.00001e-10, 0.3]]])             # equal counters, rising attention
    s = A.keep_order(torch.full((1, 1, 5), 400), tiny, torch.arange(5).view(1, 1, 5))
    for kind, t in (("", s), (" (in float32, as select_topk ranks it)", s.float())):
        assert (t[0, 0, 1:] > t[0, 0, :-1]).all(), (
            f"five slots with I = 400 and the attentions {tiny.flatten().tolist()}: each must score above the one "
            f"before it{kind} (however small or close the attentions), got {t.flatten().tolist()}")

    rows = A.keep_order(torch.tensor([[[0, 1]], [[0, 0]]]), torch.tensor([[[0.125, 0.875]], [[0.5, 0.625]]]),
                        torch.tensor([[[0, 1]], [[0, 1]]]))
    assert rows[0, 0, 0] > rows[0, 0, 1] and rows[1, 0, 1] > rows[1, 0, 0], (
        "two batch rows, each ranked on its own: row 0, slot 0 (I = 0, attention 0.125) above slot 1 (I = 1, 0.875); "
        f"row 1, slot 1 (I = 0, 0.625) above slot 0 (I = 0, 0.5); got scores {rows.flatten().tolist()}")


@points(2, task="n_dropped")
def test_tokens_to_drop():
    """Hand cases, each moved by a number of slots drawn from the run's seed (budget, slots held and recent
    tokens moved together: what is too many and m stay as they were)."""
    later = int(torch.randint(0, 10_000, (1,), generator=generator("n_dropped public")))
    cases = [  # n_slots, budget, drop, n_recent, expected, why
        (10, 12, 1, 2, 0, "within budget: nothing to drop"),
        (12, 12, 4, 2, 0, "exactly the budget: nothing to drop"),
        (13, 12, 1, 2, 1, "one too many, m = 1"),
        (13, 12, 4, 2, 4, "m = 4 at a time, even for one too many"),
        (17, 12, 4, 2, 8, "5 too many: two compressions of m = 4"),
        (16, 12, 4, 2, 4, "4 too many: exactly one compression of m = 4"),
        (13, 12, 20, 2, 10, "m is cut to budget - n_recent = 10"),
        (23, 12, 20, 7, 15, "m is cut to budget - n_recent = 5: three compressions for 11 too many"),
        (2001, 2000, 1500, 0, 1500, "m = 1500 at a time, even for one too many"),
    ]
    for n_slots, budget, drop, n_recent, want, why in cases:
        n_slots, budget, n_recent = n_slots + later, budget + later, n_recent + later
        got = A.tokens_to_drop(n_slots, budget, drop, n_recent)
        assert isinstance(got, int) and got == want, (
            f"n_dropped(n_slots={n_slots}, budget={budget}, drop={drop}, n_recent={n_recent}): {why}, so {want}; "
            f"got {got!r}")
