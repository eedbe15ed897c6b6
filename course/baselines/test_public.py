"""Public tests of the ``baselines`` assignment: StreamingLLM's ranges, H2O's scores, SnapKV's vote, AdaKV's
allocation, each on a small case. Run them with ``python -m course.grade baselines``."""

import adapters as A
import torch
from oracle import assert_close, generator, points


def check_close(got, want: torch.Tensor, what: str, why: str = "", axes=("row", "head", "token"),
                tol: float = 1e-5) -> None:
    """``got`` equals ``want`` up to float rounding (``want`` computed in any precision, compared as the float32
    answer it should be), with its shape and dtype; otherwise an AssertionError that says what is checked, the
    axes, how many entries differ and the first one (``oracle.assert_close``), then why (the rule)."""
    assert_close(got, want.float(), atol=tol, rtol=tol,
                 what=f"{what}, indexed [{', '.join(axes)}]" + (f" ({why})" if why else ""))


def positions(ranges) -> list[int]:
    """The positions a list of ranges names, each once, ascending (a position listed twice is kept once)."""
    return sorted({p for r in ranges for p in r})


@points(2, task="sinks_and_recent")
def test_streaming_llm_keeps_sinks_and_recent():
    """The sinks and the most recent tokens, after a number of tokens drawn from the run's seed: 4 sinks and 4
    recent, 2 and 4, the sinks cut to 2 so that the newest token fits (R = 1), fewer tokens than the budget; the
    keep mask over slots holding the positions in any order, with an empty slot."""
    g = generator("streaming public")
    later = int(torch.randint(0, 1000, (1,), generator=g))                # how many more tokens were seen
    for budget, n_sink, seen, sinks, recent in [(8, 4, 20 + later, 4, 4),  # S = 4 sinks, R = 4 recent
                                                (6, 2, 30 + later, 2, 4),
                                                (3, 4, 20 + later, 2, 1),  # the sinks cut to S = 2, R = 1
                                                (4, 4, 10 + later, 3, 1),  # n_sink = budget: cut to 3
                                                (8, 0, 20 + later, 0, 8),  # no sinks: the window only
                                                (1, 4, 5 + later, 0, 1),   # budget 1: the newest token only
                                                (8, 4, 1 + later % 7, None, None)]:   # fewer tokens than the budget
        want = list(range(seen)) if sinks is None else list(range(sinks)) + list(range(seen - recent, seen))
        got = positions(A.streaming_ranges(budget, n_sink, seen))
        S = min(n_sink, budget - 1)
        assert got == want, (f"budget {budget}, n_sink {n_sink}, after {seen} tokens: the ranges name {got}, "
                             f"expected the sinks and the most recent tokens {want} (S = {S} sinks, the newest "
                             f"token must fit; R = {budget - S} recent; only positions 0..{seen - 1} exist)")
    ranges = [list(r) for r in A.streaming_ranges(8, 4, 20)]
    assert ranges == [[0, 1, 2, 3], [16, 17, 18, 19]], f"budget 8, 4 sinks, after 20 tokens: the ranges are " \
        f"{ranges}; the first is the sinks' range, the second the recent window's (the policy reads them so)"
    pos = torch.stack([torch.randperm(20, generator=g) for _ in range(2)])[None]    # (1, 2, 20): any slot order
    pos[0, 1, int(torch.randint(0, 20, (1,), generator=g))] = -1          # an empty slot is never kept
    want = (pos >= 0) & ((pos < 4) | (pos >= 16))
    assert_close(A.streaming_mask(pos, seen=20, budget=8, n_sink=4), want,
                 what=f"budget 8, 4 sinks, after 20 tokens, KV head 0 holding the positions {pos[0, 0].tolist()}: the "
                 "keep mask (B, H_kv, T), True at the slots of positions 0..3 and 16..19, never at an empty slot (-1)")


@points(2, task="h2o_observe")
def test_h2o_scores_accumulate():
    """Prefill: the scores are what each slot received (mean over the KV head's query heads); decode: they
    grow by what each slot received; new slots start at 0. 4 query heads over 2 KV heads, all different."""
    g = generator("h2o public")
    policy = A.h2o_policy(100)
    store = A.new_storage(torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g), torch.arange(5))
    c0 = torch.rand(1, 4, 5, generator=g) * torch.tensor([1.0, 2.0, 4.0, 8.0]).view(1, 4, 1)
    want0 = torch.stack([(c0[:, 0] + c0[:, 1]) / 2, (c0[:, 2] + c0[:, 3]) / 2], dim=1)   # KV head j: heads 2j, 2j+1
    s0 = A.h2o_observe(policy, store, c0, "prefill", 5).clone()
    check_close(s0, want0, "H2O's scores after the prefill", "a slot's score is the attention it received, "
                "averaged over its KV head's query heads: head h reads KV head h // 2", axes=("row", "KV head", "slot"))
    A.storage_append(store, torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g),
                     torch.tensor([5]))
    c1 = torch.rand(1, 4, 6, generator=g)
    want1 = torch.cat([want0, torch.zeros(1, 2, 1)], -1) + torch.stack([(c1[:, 0] + c1[:, 1]) / 2,
                                                                      (c1[:, 2] + c1[:, 3]) / 2], dim=1)
    check_close(A.h2o_observe(policy, store, c1, "decode", 6), want1, "H2O's scores after a decode step",
                "each score grows by what its slot received; a new slot starts at 0", axes=("row", "KV head", "slot"))
    rows = torch.rand(2, 4, 5, generator=g)                            # two batch rows, each its own scores
    two = A.new_storage(torch.randn(2, 2, 5, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g), torch.arange(5))
    check_close(A.h2o_observe(A.h2o_policy(100), two, rows, "prefill", 5),
                torch.stack([(rows[:, 0] + rows[:, 1]) / 2, (rows[:, 2] + rows[:, 3]) / 2], dim=1),
                "H2O's scores after a prefill of two batch rows", "each row's own attention, averaged over each KV "
                "head's query heads 2j and 2j + 1", axes=("row", "KV head", "slot"))
    six = torch.rand(1, 6, 5, generator=g)                             # 6 query heads over 2 KV heads: G = 3
    check_close(A.h2o_observe(A.h2o_policy(100), A.new_storage(torch.randn(1, 2, 5, 4, generator=g),
                torch.randn(1, 2, 5, 4, generator=g), torch.arange(5)), six, "prefill", 5),
                torch.stack([six[:, :3].mean(1), six[:, 3:].mean(1)], dim=1), "H2O's scores after a prefill of 6 "
                "query heads over 2 KV heads", "G = H / H_kv = 3: KV head j averages query heads 3j to 3j + 2",
                axes=("row", "KV head", "slot"))


@points(2, task="window_vote")
def test_snapkv_vote_sums_pools_and_averages():
    """Two query heads per KV head, three window queries, max pooling of width 3, by hand; the attention scaled
    by a factor, the window's queries and the group's two heads in an order, drawn from the run's seed (the
    vote scales with the attention; a sum over the queries and a mean over the heads ignore their order)."""
    probs = torch.zeros(1, 2, 3, 6)                                      # (B, H, w, Tp)
    probs[0, 0, :, 1] = torch.tensor([0.1, 0.2, 0.3])                    # head 0: token 1, 0.6 summed
    probs[0, 0, 2, 5] = 0.2                                              #         token 5, 0.2
    probs[0, 1, :, 3] = torch.tensor([0.5, 0.5, 0.4])                    # head 1: token 3, 1.4 summed
    # summed over the window: head 0 [0, .6, 0, 0, 0, .2], head 1 [0, 0, 0, 1.4, 0, 0]
    # max-pooled (width 3):   head 0 [.6, .6, .6, 0, .2, .2], head 1 [0, 0, 1.4, 1.4, 1.4, 0]; then the mean
    want = torch.tensor([[[0.3, 0.3, 1.0, 0.7, 0.8, 0.1]]])
    g = generator("snapkv public")
    scale = 0.5 + float(torch.rand(1, generator=g))
    probs = probs[:, torch.randperm(2, generator=g)][:, :, torch.randperm(3, generator=g)] * scale
    check_close(A.snapkv_vote(probs, 1, kernel=3, pooling="max"), want * scale,
                f"SnapKV's vote of the attention above times {scale:.4f}",
                "the window's attention summed over its queries, max-pooled along the tokens, then averaged over "
                "the KV head's query heads", axes=("row", "KV head", "token"))
    check_close(A.snapkv_pool(torch.tensor([1.0, 1.0, 1.0]), 3, "avg"), torch.tensor([2 / 3, 1.0, 2 / 3]),
                "average pooling of [1, 1, 1], width 3", "each token's centred neighbourhood, zero padding beyond "
                "the tokens counted in the mean", axes=("token",))
    grouped = torch.zeros(1, 4, 1, 2)
    grouped[0, :2, 0, 0], grouped[0, 2:, 0, 1] = 1.0, 1.0                # heads 0, 1 vote token 0; heads 2, 3 token 1
    check_close(A.snapkv_vote(grouped, 2, kernel=1, pooling="max"), torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]),
                "the vote of 4 query heads over 2 KV heads (heads 0 and 1 attend token 0, heads 2 and 3 token 1)",
                "KV head j averages the consecutive query heads 2j and 2j + 1", axes=("row", "KV head", "token"))
    check_close(A.snapkv_scores(torch.tensor([[[[0.0, 0.0, 1.0]]]]), 1, window=1, kernel=3, pooling="max"),
                torch.tensor([[[0.0, 0.0, 1.0]]]), "SnapKV's scores of 3 tokens, the last one the window, its query "
                "attending only itself", "only the prefix's votes are pooled: the window's own attention does not "
                "spill onto token 1", axes=("row", "KV head", "token"))
    check_close(A.snapkv_scores(torch.tensor([[[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]]]), 1, window=1, kernel=1,
                                pooling="max"), torch.tensor([[[0.0, 0.0, 1.0]]]), "SnapKV's scores of 3 tokens "
                "given the attention of 2 queries, a window of 1", "only the last `window` queries vote: the earlier "
                "query's vote for token 1 does not count", axes=("row", "KV head", "token"))
    check_close(A.snapkv_scores(torch.tensor([[[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]]]), 1, window=3,
                                kernel=3, pooling="max"), torch.tensor([[[1.5, 0.5, 1.0]]]), "SnapKV's scores of "
                "a 3-token prompt that is all window", "with no prefix there is nothing to pool: the window's own "
                "votes as they are", axes=("row", "KV head", "token"))


@points(1, task="adakv")
def test_adakv_shares_the_budget_with_a_safeguard():
    """Two KV heads, 5 slots, budget 2 (the layer keeps 4), one safeguarded entry per head: head 1's best
    (0.05) is below all of head 0's, yet the safeguard keeps it; head 0 keeps its best 3, the last of them one
    of two tied at 0.7: the earlier slot. Two rows of the same scores, scaled, each head's slots in an order
    drawn from the run's seed (the ranking ignores both; the tie goes to whichever slot comes first)."""
    g = generator("adakv public")
    order = torch.stack([torch.randperm(5, generator=g) for _ in range(4)]).view(2, 2, 5)   # slot i holds old order[i]
    scale = 0.5 + float(torch.rand(1, generator=g))
    scores = torch.tensor([[.9, .8, .7, .7, .5], [.01, .02, .03, .05, .04]]).expand(2, 2, 5).gather(-1, order) * scale
    want = torch.zeros(2, 2, 5, dtype=torch.bool)
    for b in range(2):
        was = order[b].tolist()                                          # was[h][i]: the old slot now at i
        first_07 = min(was[0].index(2), was[0].index(3))                 # of the two 0.7s, the earlier slot now
        want[b, 0, [was[0].index(0), was[0].index(1), first_07]] = True
        want[b, 1, was[1].index(3)] = True
    assert_close(A.adakv_mask(scores, budget=2, n_safe=1), want,
                 what=f"AdaKV on the scores {[[round(x, 4) for x in h] for h in scores[0].tolist()]} (row 0), budget "
                 "2, one safeguarded entry per head: the keep mask (B, H_kv, T), each head's best entry first (here "
                 f"head 1's 0.05 x {scale:.4f}), then the layer's best, ties to the earlier slot")
    assert_close(A.adakv_mask(torch.zeros(1, 2, 8), budget=2, n_safe=0), torch.arange(16).view(1, 2, 8) < 4,
                 what="AdaKV on 16 equal scores, budget 2 (4 in the layer), no safeguard: ties go to the earlier "
                 "(KV head, slot), head 0's slots 0..3")
    assert_close(A.adakv_mask(torch.tensor([[[float("nan"), -1.0]]]), budget=1, n_safe=0),
                 torch.tensor([[[False, True]]]), what="AdaKV on the scores [nan, -1.0], budget 1: a NaN score ranks "
                 "lowest, below any number")
    assert_close(A.adakv_mask(torch.tensor([[[5.0, 4.0], [0.1, 0.2]]]), budget=1, n_safe=1),
                 torch.tensor([[[True, False], [False, True]]]), what="AdaKV on the scores [[5, 4], [0.1, 0.2]], "
                 "budget 1, one safeguarded entry per head: head 1's best (0.2) is kept, however far below head 0's")
    assert_close(A.adakv_mask(torch.zeros(1, 1, 17), budget=1, n_safe=1), torch.arange(17).view(1, 1, 17) < 1,
                 what="AdaKV on 17 equal scores, budget 1, one safeguarded entry: slot 0 (past 16 entries, a sort "
                 "without stable=True moves ties)")
