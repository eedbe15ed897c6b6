"""Hidden tests of the ``kernels`` assignment (the grader's; not in a student copy): scores far from 0 (where
a missing max-subtraction overflows or underflows), more query heads per KV head, ragged ranges, several
sequences; merges of ranges far apart and of empty ranges anywhere. Every random input is drawn from the run's
seed (``test_public.randn``)."""

import torch
from oracle import points
from test_public import check_merge, check_online_softmax, far_below_zero_case, merge_case


@points(3, task="online_softmax")
def test_scores_far_from_zero():
    """Scores in the hundreds (exp overflows without the running max) and around -200 (exp underflows to 0),
    2 sequences, 8 query heads over 2 KV heads, d = 32; an fp32 cache."""
    check_online_softmax(B=2, H=8, H_kv=2, d=32, n=44, seed=5, k_scale=40.0, tag=" (scores in the hundreds)",
                         rtol=5e-4, dtypes=(torch.float32,))
    check_online_softmax(B=1, H=4, H_kv=2, d=16, n=40, seed=6, k_shift=4.0, q_shift=-200.0,
                         tag=" (scores around -200)", rtol=5e-4, dtypes=(torch.float32,))


@points(2, task="online_softmax")
def test_three_query_heads_per_kv_head_and_ragged_ranges():
    """6 query heads over 2 KV heads (a group padded to the kernels' tile), 37 and 50 tokens, two seeds."""
    check_online_softmax(B=2, H=6, H_kv=2, d=16, n=37, seed=7)
    check_online_softmax(B=1, H=3, H_kv=1, d=16, n=50, seed=8)


@points(3, task="merge_splits")
def test_merge_ranges_far_apart():
    """Ranges whose scores lie hundreds apart (weights exp(m - M) far below 1; without M, exp(m) overflows),
    45 ranges, 3 query heads; rows of scores near -300 (without M, exp(m) is 0) and +300."""
    bounds = [(0, 5), (5, 9), (9, 16), (16, 18)]
    check_merge(*merge_case(2, 2, 16, bounds, seed=2, shifts=[300.0, -200.0, 310.0, 0.0]), tag="ranges far apart")
    bounds = [(3 * i, 3 * i + 1 + i % 3) for i in range(45)]
    check_merge(*merge_case(3, 3, 32, bounds, seed=3, shifts=[(-1) ** i * 150.0 for i in range(45)]),
                tag="45 ranges far apart")
    check_merge(*far_below_zero_case(seed=7), tag="rows of scores near -300 and +300, 3 query heads, seed 7")
    check_merge(*merge_case(2, 3, 16, [(3 * i, 3 * i + 2) for i in range(45)], seed=13,
                            shifts=[0.0] * 33 + [150.0] + [0.0] * 10 + [-150.0]),
                tag="45 ranges, the 34th 150 above the others")


@points(2, task="merge_splits")
def test_merge_empty_ranges_anywhere():
    """Empty ranges (m = -inf, l = 0, acc = 0) first, in the middle and last, 1, 3 and 4 query heads."""
    bounds = [(0, 0), (0, 6), (6, 6), (6, 13), (13, 13)]
    check_merge(*merge_case(3, 1, 12, bounds, seed=4), tag="empty ranges, 1 query head, d = 12")
    bounds = [(0, 0)] * 3 + [(0, 9)] + [(9, 9)] * 35 + [(9, 20)]
    check_merge(*merge_case(2, 4, 16, bounds, seed=5, spread=6.0), tag="40 ranges, mostly empty")
    bounds = [(0, 0)] * 36 + [(0, 5), (5, 5), (5, 11)]
    check_merge(*merge_case(2, 3, 16, bounds, seed=14, row_shifts=[120.0, -120.0]),
                tag="39 ranges, the first 36 empty, rows of scores near +120 and -120")
    bounds = [(0, 3), (3, 3), (3, 9), (9, 9), (9, 12)]
    check_merge(*merge_case(3, 3, 16, bounds, seed=9, row_shifts=[-300.0, 300.0, -300.0],
                            head_shifts=[200.0, 0.0, -200.0]),
                tag="empty ranges, rows of scores near -300 and +300")
