"""Public tests of the ``tensor_attention`` assignment: pair scores, the softmax over pairs, the factored
output. Run them with ``python -m course.grade tensor_attention``."""

import adapters as A
import torch
from oracle import points


def random(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@points(2)
def test_pair_scores_without_the_kronecker_product():
    q, K1, K2 = random(2, 3, 8), random(2, 5, 8, seed=1), random(2, 4, 8, seed=2)
    want = torch.einsum("btd,bad,bcd->btac", q, K1, K2) * 0.5
    torch.testing.assert_close(A.scores(q, K1, K2, 0.5), want, rtol=1e-5, atol=1e-5)


@points(2)
def test_softmax_runs_over_all_pairs_of_a_query():
    S = random(2, 3, 4, 5)
    allowed = torch.rand(3, 4, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    allowed[:, 0, 0] = True
    P = A.softmax_over_pairs(S, allowed)
    torch.testing.assert_close(P.sum((-1, -2)), torch.ones(2, 3))
    assert (P[:, ~allowed] == 0).all(), "a masked pair must get probability 0"
    want = torch.softmax(S.masked_fill(~allowed, float("-inf")).flatten(-2), -1).view_as(S)
    torch.testing.assert_close(P, want)


@points(2)
def test_factored_output_equals_the_sum_over_pairs():
    P = torch.softmax(random(2, 3, 20), -1).view(2, 3, 5, 4)
    V1, V2 = random(2, 5, 8, seed=4), random(2, 4, 8, seed=5)
    want = torch.einsum("btac,bad,bcd->btd", P, V1, V2)
    torch.testing.assert_close(A.output(P, V1, V2), want, rtol=1e-5, atol=1e-6)
