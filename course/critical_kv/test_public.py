"""Public tests of the ``critical_kv`` assignment: the output perturbation (Eq. 5), its bound (Theorem 2,
Eq. 8) and Algorithm 1's two stages. Run them with ``python -m course.grade critical_kv``."""

import adapters as A
import torch
from oracle import assert_close, check_tensor, generator, points


def perturbation_by_loop(attn, keep, projected):
    """Eq. 5 for one row, in plain Python: A' = N*A / sum(N*A); L = sum_d |sum_i (A_i - A'_i) VW_id|."""
    a, n, vw = attn.tolist(), keep.tolist(), projected.tolist()
    mass = sum(x for x, k in zip(a, n) if k)
    diff = [x - (x / mass if k else 0.0) for x, k in zip(a, n)]
    return sum(abs(sum(d * row[c] for d, row in zip(diff, vw))) for c in range(len(vw[0])))


def mask(n, entries):
    """A (1, n) bool mask, True at ``entries``."""
    out = torch.zeros(1, n, dtype=torch.bool)
    out[0, list(entries)] = True
    return out


@points(2, task="output_perturbation")
def test_perturbation_is_the_l1_change_of_the_output():
    g = generator("perturbation public")
    attn = torch.softmax(torch.randn(3, 8, generator=g) * 2, -1)           # 3 rows (heads), 8 entries
    projected = torch.randn(3, 8, 6, generator=g)                           # rows V_i W_O, D = 6
    keep = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 0], [1, 0, 0, 0, 0, 0, 0, 0], [1] * 8], dtype=torch.bool)
    keep = keep[:, torch.randperm(8, generator=g)]                          # which entries: drawn
    want = torch.tensor([perturbation_by_loop(attn[r], keep[r], projected[r]) for r in range(3)])
    assert_close(A.renormalized(attn, keep), attn * keep / (attn * keep).sum(-1, keepdim=True), atol=1e-6,
                 what="renormalized_attention (Theorem 1), (3, 8): A'_i = N_i A_i / sum_j N_j A_j")
    assert_close(A.perturbation(attn, keep, projected), want, atol=1e-5, rtol=1e-5,
                 detail=lambda at: f"keeping {int(keep[at].sum())} of 8",
                 what="output_perturbation, one L per row (3,): L = ||(A - A') V W_O||_1 with A' the attention "
                 "renormalised over the kept entries")
    for lead in ((), (1, 3)):                                               # any leading shape: one row, a grid
        n = 1 if lead == () else 3
        try:
            got = A.perturbation(attn[:n].reshape(*lead, 8), keep[:n].reshape(*lead, 8),
                                 projected[:n].reshape(*lead, 8, 6))
        except RuntimeError as e:
            raise AssertionError(f"output_perturbation with leading shape {lead} failed: {str(e)[:100]}; it takes "
                                 "any leading shape (..., n), one row or a grid of them") from None
        assert_close(got, want[:n].reshape(lead), atol=1e-5, rtol=1e-5, what=f"output_perturbation with leading "
                     f"shape {lead} (attn {(*lead, 8)}, projected {(*lead, 8, 6)}): one L per row, shape {lead}")
    heads = torch.stack([projected, projected.flip(1)], 2).transpose(1, 2)   # (3, 2, 8, 6), a transpose
    got = A.perturbation(torch.stack([attn, attn.flip(-1)], 1), torch.stack([keep, keep.flip(-1)], 1), heads)
    assert_close(got, torch.stack([want, want], 1), atol=1e-5, rtol=1e-5, what="output_perturbation over 2 heads, "
                 "the second the first's entries reversed (the same L), projected (3, 2, 8, 6) a transpose of "
                 "(3, 8, 2, 6), not contiguous (as a model's heads often are): one L per row, shape (3, 2)")
    exact = A.perturbation(attn.double(), keep, projected.double())
    check_tensor(exact, (3,), torch.float64, "output_perturbation of float64 attention and projected values")


@points(2, task="perturbation_bound")
def test_the_bound_is_eq8_and_holds():
    # a hand case: A = (1/2, 1/4, 1/4), P = (1, 2, 4): C = 2. Keeping entries 0 and 2 (mass 3/4, sum N A P = 3/2):
    # theta = 2 - (2 - 4/3) 3/2 = 1. Keeping entry 1 only (mass 1/4, sum 1/2): theta = 2 - (2 - 4) 1/2 = 3.
    # Here the entries come in an order and P at a scale drawn from the run's seed (theta is linear in P).
    g = generator("bound public")
    order, scale = torch.randperm(3, generator=g), 0.5 + float(torch.rand(1, generator=g))
    attn = torch.tensor([[0.5, 0.25, 0.25]] * 3)[:, order]
    vnorm = torch.tensor([[1.0, 2.0, 4.0]] * 3)[:, order] * scale
    keep = torch.tensor([[True, False, True], [False, True, False], [True, True, True]])[:, order]
    assert_close(A.bound(attn, keep, vnorm), torch.tensor([1.0, 3.0, 0.0]) * scale, atol=1e-6, rtol=1e-6,
                 detail=lambda at: f"keep {keep[at].int().tolist()}",
                 what=f"Eq. 8, theta = C - (2 - 1/sum(N A)) sum(N A P) with C = sum(A P), on A = "
                 f"{attn[0].tolist()}, P = {[round(x, 5) for x in vnorm[0].tolist()]}, one theta per row (3,)")
    check_tensor(A.bound(attn.double(), keep, vnorm.double()), (3,), torch.float64,
                 "theta of float64 attention and value norms (the hand case in float64)")
    for case in range(10):
        attn = torch.softmax(torch.randn(12, generator=g) * 2, 0)
        projected = torch.randn(12, 5, generator=g)
        keep = torch.rand(12, generator=g) > 0.5
        keep[attn.argmax()] = True
        theta = A.bound(attn, keep, projected.abs().sum(-1))
        check_tensor(theta, (), torch.float32, f"case {case}: theta of one row of 12 entries")
        L = perturbation_by_loop(attn, keep, projected)
        assert L <= float(theta) + 1e-5, \
            f"case {case}: Theorem 2 bounds the perturbation, but L = {L:.5f} > theta = {float(theta):.5f}"
        a, n, p = attn.double().tolist(), keep.tolist(), projected.double().abs().sum(-1).tolist()   # Eq. 8 by hand
        C, mass = sum(x * y for x, y in zip(a, p)), sum(x for x, k in zip(a, n) if k)
        want = C - (2 - 1 / mass) * sum(x * y for x, k, y in zip(a, n, p) if k)
        assert abs(float(theta) - want) <= 1e-5 * max(1.0, abs(want)), f"case {case}: theta = {float(theta):.5f}, " \
            f"Eq. 8 gives {want:.5f} (C = {C:.5f}, kept mass {mass:.5f}): a bound above it holds but says less"


@points(2, task="two_stage")
def test_two_stages():
    """Hand cases, their entries in an order and their scores at scales drawn from the run's seed (neither
    changes what is kept, only where)."""
    g = generator("two stages public")
    order = torch.randperm(6, generator=g)
    now = {int(old): new for new, old in enumerate(order)}                # old entry -> where it is now

    def at(*old):
        return sorted(now[i] for i in old)
    first = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.08, 0.07]])
    second = first * torch.tensor([0.1, 0.1, 0.1, 5.0, 0.1, 4.0])               # A * P ranks 3, 5 first
    first, second = first[:, order] * (0.5 + torch.rand(1, generator=g)), second[:, order]
    stage1, keep = A.stages(first, second, 4, 2)
    assert_close(stage1, mask(6, at(0, 1)), what=f"scores {[round(x, 4) for x in first[0].tolist()]} (first) and "
                 f"{[round(x, 4) for x in second[0].tolist()]} (second), budget 4, n_first 2: stage 1, the top "
                 "n_first = 2 by the first ranking")
    assert_close(keep, mask(6, at(0, 1, 3, 5)), what="budget 4, n_first 2: the kept set, stage 1 and then the best of "
                 "the rest by the second ranking up to the budget")
    _, keep = A.stages(torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.5, 0.1, 0.3]]), 2, 1)
    assert_close(keep, mask(3, [0, 2]), what="first [0.5, 0.3, 0.2], second [0.5, 0.1, 0.3], budget 2, n_first 1: "
                 "stage 2 ranks the entries stage 1 left (entry 0, its best by both, is already kept): entries 0, 2")
    stage1, keep = A.stages(second, first, 3, 1)                                 # the orders swapped
    assert_close(keep, mask(6, at(0, 1, 3)), what="the rankings swapped, budget 3, n_first 1: the kept set, first "
                 "A * P (stage 1: its best), then the attention")
    valid = mask(6, at(0, 2, 3, 4, 5))
    stage1, keep = A.stages(first, second, 3, 2, valid)
    assert_close(keep, mask(6, at(0, 2, 3)), what=f"valid entries {valid[0].int().tolist()} (the other an empty "
                 "slot), budget 3, n_first 2: the kept set, stage 1 among the valid entries, then stage 2")
    stage1, keep = A.stages(first, second, 8, 2, valid)
    assert_close(keep, valid, what="a budget of 8 over 5 valid entries is cut to the 5: the kept set, every valid "
                 "entry, never the empty slot")
    stage1, keep = A.stages(first, second, 2, 5)
    for name, got in (("stage 1", stage1), ("the kept set", keep)):
        assert_close(got, mask(6, at(0, 1)), what=f"n_first = 5 over a budget of 2 is cut to the budget: {name}")
    five = torch.randperm(5, generator=g)
    where = {int(old): new for new, old in enumerate(five)}
    odd = torch.tensor([[0.0, 0.0, -0.5, float("nan"), float("-inf")]])[:, five]
    for budget, want in ((2, [0, 2]), (4, [0, 2, 3, 4])):
        _, keep = A.stages(torch.tensor([[0.9, 0.8, 0.1, 0.2, 0.3]])[:, five], odd, budget, 1,
                           torch.tensor([[True, False, True, True, True]])[:, five])
        assert_close(keep, mask(5, [where[i] for i in want]), what=(
            f"second scores {odd[0].tolist()}, budget {budget}, stage 1 takes the best first score; by the second "
            "ranking -0.5 beats NaN and -inf, which rank lowest among the valid entries but above the empty slot: "
            "the kept set"))
    stage1, keep = A.stages(torch.tensor([[float("inf"), float("inf"), 0.3, 0.2, 0.1]]),
                            torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]]), 3, 2)
    assert_close(stage1, mask(5, [0, 1]), what="first scores [inf, inf, 0.3, 0.2, 0.1] (a protected window of 2), "
                 "budget 3, n_first 2: stage 1, whose n_first counts the +inf entries")
    assert_close(keep, mask(5, [0, 1, 4]), what="the same, second scores [0, 0, 0, 0, 1]: the kept set, stage 1 and "
                 "the one entry left by the second ranking")
    _, keep = A.stages(torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.12, 0.05]]),
                       torch.tensor([[0.3, 0.1, 0.2, 0.4, 0.4, 0.1]]), 3, 2)
    assert_close(keep, mask(6, [0, 1, 3]), what="first [0.30, 0.25, 0.20, 0.10, 0.12, 0.05], second [0.3, 0.1, 0.2, "
                 "0.4, 0.4, 0.1], budget 3, n_first 2: stage 2's tie (0.4 at entries 3 and 4) goes to the earlier "
                 "entry, whatever their first scores: entries 0, 1, 3")
    stage1, keep = A.stages(torch.tensor([[float("nan"), 0.5, 0.4, 0.3]]), torch.tensor([[0.1, 0.2, 0.3, 0.4]]), 2, 1)
    assert_close(stage1, mask(4, [1]), what="first scores [nan, 0.5, 0.4, 0.3], budget 2, n_first 1: stage 1 "
                 "ranks NaN lowest too, so it takes entry 1")
    assert_close(keep, mask(4, [1, 3]), what="first [nan, 0.5, 0.4, 0.3], second [0.1, 0.2, 0.3, 0.4], budget 2, "
                 "n_first 1: the kept set, entry 1 by stage 1 and entry 3 by stage 2")
    _, keep = A.stages(torch.tensor([[0.9, 0.5, 0.4, 0.3]]), torch.tensor([[0.1, 0.2, float("nan"), float("-inf")]]),
                       4, 1)
    assert_close(keep, mask(4, range(4)), what="second scores [0.1, 0.2, nan, -inf], a budget of 4 over 4 valid "
                 "entries: every entry is kept, NaN and -inf ones included")
    stage1, keep = A.stages(torch.zeros(1, 24), torch.zeros(1, 24), 3, 1)
    assert_close(keep, mask(24, [0, 1, 2]), what="24 equal scores in both rankings, budget 3, n_first 1: ties go to "
                 "the earlier entry (a stable sort), so the kept set is entries 0, 1, 2")
    vnorm = torch.tensor([0.1, 0.1, 0.1, 5.0, 0.1, 4.0])[order]
    _, keep = A.stages(first[0], first[0] * vnorm, 4, 2)         # Algorithm 1 as select runs it: alpha 0.5
    check_tensor(keep, (6,), torch.bool, "Algorithm 1's kept set, budget 4, stages(A, A * P, 4, floor(0.5 * 4))")
    got = keep.nonzero().flatten().tolist()
    assert got == at(0, 1, 3, 5), \
        f"Algorithm 1, budget 4, alpha 0.5 (stages(A, A * P, 4, 2)): expected entries {at(0, 1, 3, 5)}, got {got}"
