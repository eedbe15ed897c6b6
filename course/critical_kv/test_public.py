"""Public tests of the ``critical_kv`` assignment: the output perturbation (Eq. 5), its bound (Theorem 2,
Eq. 8) and Algorithm 1's two stages. Run them with ``python -m course.grade critical_kv``."""

import adapters as A
import torch
from oracle import points


def instance(seed, n=12, D=6):
    g = torch.Generator().manual_seed(seed)
    attn = torch.softmax(torch.randn(n, generator=g) * 2, 0)
    projected = torch.randn(n, D, generator=g)                             # rows V_i W_O
    keep = torch.rand(n, generator=g) > 0.5
    keep[attn.argmax()] = True
    return attn, projected, keep


@points(2)
def test_perturbation_is_the_l1_change_of_the_output():
    attn, projected, keep = instance(0)
    renorm = attn * keep / (attn * keep).sum()
    want = ((attn - renorm) @ projected).abs().sum()
    torch.testing.assert_close(A.perturbation(attn, keep, projected), want)


@points(2)
def test_the_bound_holds_and_is_eq8():
    for seed in range(20):
        attn, projected, keep = instance(seed)
        vnorm = projected.abs().sum(-1)
        theta = A.bound(attn, keep, vnorm)
        C, kept = (attn * vnorm).sum(), (attn * keep).sum()
        torch.testing.assert_close(theta, C - (2 - 1 / kept) * (attn * keep * vnorm).sum())
        assert A.perturbation(attn, keep, projected) <= theta + 1e-5, f"seed {seed}: L > theta"


@points(2)
def test_two_stages():
    attn = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.08, 0.07])
    vnorm = torch.tensor([0.1, 0.1, 0.1, 5.0, 0.1, 4.0])
    # budget 4, alpha 0.5: stage 1 takes the top 2 by attention (0, 1); stage 2 the best 2 by A * P: 3, 5
    assert A.select(attn, vnorm, 4, 0.5).tolist() == [0, 1, 3, 5]
