"""Public tests of the ``baselines`` assignment: StreamingLLM's ranges, H2O's scores, SnapKV's vote, AdaKV's
allocation, each on a small case. Run them with ``python -m course.grade baselines``."""

import adapters as A
import torch
from oracle import points


def check_close(got, want: torch.Tensor, what: str, why: str = "", axes=("row", "head", "token"),
                tol: float = 1e-5) -> None:
    """``got`` equals ``want`` up to float rounding; otherwise an AssertionError that says what is checked,
    where (the worst entry, by ``axes``), what was got and what was expected, then why (the rule)."""
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor of shape {tuple(want.shape)}, got {type(got).__name__}")
    if got.shape != want.shape:
        raise AssertionError(f"{what}: got shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    got64, want64 = got.double(), want.double()
    err = torch.nan_to_num((got64 - want64).abs(), nan=float("inf"))
    err = torch.where(got64 == want64, torch.zeros_like(err), err)            # equal infinities are equal
    if bool((err <= tol + tol * want64.abs().nan_to_num(posinf=0.0, neginf=0.0)).all()):
        return
    i = tuple(int(x) for x in torch.unravel_index(torch.argmax(err), err.shape))
    where = ", ".join(f"{a} {n}" for a, n in zip(axes, i))
    raise AssertionError(f"{what}: {where} got {float(got64[i]):.4g}, expected {float(want64[i]):.4g}"
                         + (f" ({why})" if why else ""))


def positions(ranges) -> list[int]:
    """The positions a list of ranges names, each once, ascending (a position listed twice is kept once)."""
    return sorted({p for r in ranges for p in r})


@points(2, task="sinks_and_recent")
def test_streaming_llm_keeps_sinks_and_recent():
    for budget, n_sink, seen, want in [(8, 4, 20, [0, 1, 2, 3, 16, 17, 18, 19]),     # S = 4 sinks, R = 4 recent
                                       (6, 2, 30, [0, 1, 26, 27, 28, 29]),
                                       (3, 4, 20, [0, 1, 19]),             # the sinks cut to S = 2, R = 1
                                       (8, 4, 3, [0, 1, 2])]:              # fewer tokens than the budget
        got = positions(A.streaming_ranges(budget, n_sink, seen))
        S = min(n_sink, budget - 1)
        assert got == want, (f"budget {budget}, n_sink {n_sink}, after {seen} tokens: the ranges name {got}, "
                             f"expected the sinks and the most recent tokens {want} (S = {S} sinks, the newest "
                             f"token must fit; R = {budget - S} recent; only positions 0..{seen - 1} exist)")
    pos = torch.arange(20).expand(1, 2, 20).clone()
    pos[0, 1, 17] = -1                                                   # an empty slot is never kept
    keep = A.streaming_mask(pos, seen=20, budget=8, n_sink=4)
    assert not keep[0, 1, 17], "an empty slot (position -1) must never be protected"
    got = torch.nonzero(keep[0, 0]).flatten().tolist()
    assert got == [0, 1, 2, 3, 16, 17, 18, 19], f"KV head 0 protects slots {got}, expected 0..3 and 16..19"


@points(2, task="h2o_observe")
def test_h2o_scores_accumulate():
    """Prefill: the scores are what each slot received (mean over the KV head's query heads); decode: they
    grow by what each slot received; new slots start at 0. 4 query heads over 2 KV heads, all different."""
    g = torch.Generator().manual_seed(0)
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


@points(2, task="window_vote")
def test_snapkv_vote_sums_pools_and_averages():
    """Two query heads per KV head, three window queries, max pooling of width 3, by hand."""
    probs = torch.zeros(1, 2, 3, 6)                                      # (B, H, w, Tp)
    probs[0, 0, :, 1] = torch.tensor([0.1, 0.2, 0.3])                    # head 0: token 1, 0.6 summed
    probs[0, 0, 2, 5] = 0.2                                              #         token 5, 0.2
    probs[0, 1, :, 3] = torch.tensor([0.5, 0.5, 0.4])                    # head 1: token 3, 1.4 summed
    # summed over the window: head 0 [0, .6, 0, 0, 0, .2], head 1 [0, 0, 0, 1.4, 0, 0]
    # max-pooled (width 3):   head 0 [.6, .6, .6, 0, .2, .2], head 1 [0, 0, 1.4, 1.4, 1.4, 0]; then the mean
    want = torch.tensor([[[0.3, 0.3, 1.0, 0.7, 0.8, 0.1]]])
    check_close(A.snapkv_vote(probs, 1, kernel=3, pooling="max"), want, "SnapKV's vote",
                "the window's attention summed over its queries, max-pooled along the tokens, then averaged over "
                "the KV head's query heads", axes=("row", "KV head", "token"))


@points(1, task="adakv")
def test_adakv_shares_the_budget_with_a_safeguard():
    """Two KV heads, 5 slots, budget 2 (the layer keeps 4), one safeguarded entry per head: head 1's best
    (slot 3, 0.05) is below all of head 0's, yet the safeguard keeps it; head 0 keeps its best 3."""
    scores = torch.tensor([[[.9, .8, .7, .6, .5], [.01, .02, .03, .05, .04]]])
    got = A.adakv_mask(scores, budget=2, n_safe=1)
    want = [[[True, True, True, False, False], [False, False, False, True, False]]]
    assert got.tolist() == want, (f"AdaKV kept {got.int().tolist()}, expected {[[int(x) for x in h] for h in want[0]]} "
                                  "(each head's best entry first, here head 1's slot 3; then the layer's best)")
