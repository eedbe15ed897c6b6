"""Public tests of the ``critical_kv`` assignment: the output perturbation (Eq. 5), its bound (Theorem 2,
Eq. 8) and Algorithm 1's two stages. Run them with ``python -m course.grade critical_kv``."""

import adapters as A
import torch
from oracle import points


def perturbation_by_loop(attn, keep, projected):
    """Eq. 5 for one row, in plain Python: A' = N*A / sum(N*A); L = sum_d |sum_i (A_i - A'_i) VW_id|."""
    a, n, vw = attn.tolist(), keep.tolist(), projected.tolist()
    mass = sum(x for x, k in zip(a, n) if k)
    diff = [x - (x / mass if k else 0.0) for x, k in zip(a, n)]
    return sum(abs(sum(d * row[c] for d, row in zip(diff, vw))) for c in range(len(vw[0])))


@points(2, task="output_perturbation")
def test_perturbation_is_the_l1_change_of_the_output():
    g = torch.Generator().manual_seed(1)
    attn = torch.softmax(torch.randn(3, 8, generator=g) * 2, -1)           # 3 rows (heads), 8 entries
    projected = torch.randn(3, 8, 6, generator=g)                           # rows V_i W_O, D = 6
    keep = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 0], [1, 0, 0, 0, 0, 0, 0, 0], [1] * 8], dtype=torch.bool)
    got = A.perturbation(attn, keep, projected)
    assert got.shape == (3,), f"output_perturbation returns one L per row, shape (3,), got {tuple(got.shape)}"
    for r in range(3):
        want = perturbation_by_loop(attn[r], keep[r], projected[r])
        assert abs(float(got[r]) - want) <= 1e-5 * (1 + want), (
            f"row {r} (keeping {int(keep[r].sum())} of 8): L = ||(A - A') V W_O||_1 with A' the attention "
            f"renormalised over the kept entries; got {float(got[r]):.6f}, expected {want:.6f}")
    renorm = A.renormalized(attn, keep)
    want = attn * keep / (attn * keep).sum(-1, keepdim=True)
    assert torch.allclose(renorm, want, atol=1e-6), (
        f"renormalized_attention (Theorem 1): A'_i = N_i A_i / sum_j N_j A_j; row 0 got "
        f"{[round(x, 4) for x in renorm[0].tolist()]}, expected {[round(x, 4) for x in want[0].tolist()]}")


@points(2, task="perturbation_bound")
def test_the_bound_is_eq8_and_holds():
    # a hand case: A = (1/2, 1/4, 1/4), P = (1, 2, 4): C = 2. Keeping entries 0 and 2 (mass 3/4, sum N A P = 3/2):
    # theta = 2 - (2 - 4/3) 3/2 = 1. Keeping entry 1 only (mass 1/4, sum 1/2): theta = 2 - (2 - 4) 1/2 = 3.
    attn = torch.tensor([[0.5, 0.25, 0.25]] * 3)
    vnorm = torch.tensor([[1.0, 2.0, 4.0]] * 3)
    keep = torch.tensor([[True, False, True], [False, True, False], [True, True, True]])
    got = A.bound(attn, keep, vnorm)
    for r, want in enumerate([1.0, 3.0, 0.0]):
        assert abs(float(got[r]) - want) < 1e-6, (
            f"Eq. 8, theta = C - (2 - 1/sum(N A)) sum(N A P) with C = sum(A P): A = (1/2, 1/4, 1/4), P = (1, 2, 4), "
            f"keep {keep[r].int().tolist()}: expected {want}, got {float(got[r]):.6f}")
    g = torch.Generator().manual_seed(1)
    for seed in range(10):
        attn = torch.softmax(torch.randn(12, generator=g) * 2, 0)
        projected = torch.randn(12, 5, generator=g)
        keep = torch.rand(12, generator=g) > 0.5
        keep[attn.argmax()] = True
        theta = float(A.bound(attn, keep, projected.abs().sum(-1)))
        L = perturbation_by_loop(attn, keep, projected)
        assert L <= theta + 1e-5, \
            f"case {seed}: Theorem 2 bounds the perturbation, but L = {L:.5f} > theta = {theta:.5f}"


@points(2, task="two_stage")
def test_two_stages():
    first = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.08, 0.07]])
    second = first * torch.tensor([0.1, 0.1, 0.1, 5.0, 0.1, 4.0])               # A * P ranks 3, 5 first
    stage1, keep = A.stages(first, second, 4, 2)
    assert torch.nonzero(stage1[0]).flatten().tolist() == [0, 1], (
        f"stage 1 keeps the top n_first = 2 by the first ranking: entries [0, 1], got {stage1[0].int().tolist()}")
    assert torch.nonzero(keep[0]).flatten().tolist() == [0, 1, 3, 5], (
        f"stage 2 fills the budget of 4 with the best of the rest by the second ranking (3, then 5): expected "
        f"entries [0, 1, 3, 5], got {keep[0].int().tolist()}")
    stage1, keep = A.stages(second, first, 3, 1)                                 # the orders swapped
    assert torch.nonzero(keep[0]).flatten().tolist() == [0, 1, 3], (
        f"first ranking A * P (stage 1: entry 3), then attention (0, 1): expected entries [0, 1, 3], got "
        f"{keep[0].int().tolist()}")
    valid = torch.tensor([[True, False, True, True, True, True]])
    stage1, keep = A.stages(first, second, 3, 2, valid)
    assert torch.nonzero(keep[0]).flatten().tolist() == [0, 2, 3], (
        f"entry 1 is not valid (an empty slot): stage 1 takes 0, 2; stage 2 takes 3; got {keep[0].int().tolist()}")
    stage1, keep = A.stages(first, second, 8, 2, valid)
    assert keep[0].tolist() == valid[0].tolist(), (
        f"a budget of 8 over 5 valid entries is cut to the 5: they are all kept, never the empty slot 1; expected "
        f"{valid[0].int().tolist()}, got {keep[0].int().tolist()}")
    stage1, keep = A.stages(first, second, 2, 5)
    assert stage1[0].tolist() == keep[0].tolist() == [True, True, False, False, False, False], (
        f"n_first = 5 over a budget of 2 is cut to the budget: stage 1 and the kept set are entries [0, 1]; got "
        f"stage 1 {stage1[0].int().tolist()}, kept {keep[0].int().tolist()}")
    odd = torch.tensor([[0.0, 0.0, -0.5, float("nan"), float("-inf")]])
    for budget, want in ((2, [0, 2]), (4, [0, 2, 3, 4])):
        _, keep = A.stages(torch.tensor([[0.9, 0.8, 0.1, 0.2, 0.3]]), odd, budget, 1,
                           torch.tensor([[True, False, True, True, True]]))
        assert torch.nonzero(keep[0]).flatten().tolist() == want, (
            f"budget {budget}, stage 1 takes entry 0; by the second ranking -0.5 beats NaN and -inf, which rank "
            f"lowest among the valid entries but above the empty slot 1: expected entries {want}, got "
            f"{keep[0].int().tolist()}")
    vnorm = torch.tensor([0.1, 0.1, 0.1, 5.0, 0.1, 4.0])
    got = A.select(first[0], vnorm, 4, 0.5).tolist()
    assert got == [0, 1, 3, 5], f"Algorithm 1, budget 4, alpha 0.5: expected entries [0, 1, 3, 5], got {got}"
