"""Public tests of the ``tensor_attention`` assignment, one per task: pair scores, the softmax over pairs, the
factored output, the two-matrix cache's append. Run them with ``python -m course.grade tensor_attention``."""

import adapters as A
import torch
from oracle import LargestTensor, points


def random(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def first_difference(got, want) -> str:
    """Where two tensors differ most: 'at [i, j, ...] got x, expected y' (or the two shapes)."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    i = (got - want).abs().nan_to_num(float("inf")).flatten().argmax().item()
    at = [int(c) for c in torch.unravel_index(torch.tensor(i), got.shape)]
    return f"at {at} got {got.flatten()[i].item():.4g}, expected {want.flatten()[i].item():.4g}"


def no_kronecker_product(fn, n1, n2, d, lead, what):
    """Run fn() watching its tensors: none may hold n1 n2 d numbers per leading index (the Kronecker product)."""
    with LargestTensor(A) as watch:
        out = fn()
    kron = n1 * n2 * d * lead
    assert watch.numbers < kron, f"{what} made a tensor of {watch.numbers} numbers: the Kronecker product has " \
        f"{kron}; factor it instead (Chen et al. §3.2, the module docstring)"
    return out


@points(2, task="pair_scores")
def test_pair_scores_without_the_kronecker_product():
    q, K1, K2 = random(2, 3, 8), random(2, 5, 8, seed=1), random(2, 4, 8, seed=2)
    got = no_kronecker_product(lambda: A.scores(q, K1, K2, 0.5), 5, 4, 8, 2, "pair_scores")
    want = torch.einsum("btd,bad,bcd->btac", q, K1, K2) * 0.5
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5), \
        "S[t, a, b] = scale <q_t, K1[a] * K2[b]>: " + first_difference(got, want)


@points(2, task="pair_softmax")
def test_softmax_runs_over_all_pairs_of_a_query():
    S = random(2, 3, 4, 5)
    allowed = torch.rand(3, 4, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    allowed[:, 0, 0] = True
    P = A.softmax_over_pairs(S, allowed)
    assert P.shape == S.shape, f"P has shape {tuple(P.shape)}, expected that of S {tuple(S.shape)}"
    assert torch.allclose(P.sum((-1, -2)), torch.ones(2, 3)), \
        f"each query's probabilities sum to 1 over all its pairs; got sums {P.sum((-1, -2))[0].tolist()}"
    assert (P[:, ~allowed] == 0).all(), "a masked pair must get probability 0"
    want = torch.softmax(S.masked_fill(~allowed, float("-inf")).flatten(-2), -1).view_as(S)
    assert torch.allclose(P, want, rtol=1e-5, atol=1e-6), "exp(S[t, a, b]) / sum over allowed pairs: " \
        + first_difference(P, want)


@points(2, task="factored_output")
def test_factored_output_equals_the_sum_over_pairs():
    P = torch.softmax(random(2, 3, 20), -1).view(2, 3, 5, 4)
    V1, V2 = random(2, 5, 8, seed=4), random(2, 4, 8, seed=5)
    got = no_kronecker_product(lambda: A.output(P, V1, V2), 5, 4, 8, 2, "factored_output")
    want = torch.einsum("btac,bad,bcd->btd", P, V1, V2)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6), \
        "o_t = sum over (a, b) of P[t, a, b] V1[a] * V2[b]: " + first_difference(got, want)


@points(2, task="two_cache_append")
def test_two_cache_holds_every_pair_once():
    """A prompt of 3 tokens, then one more: 16 pair rows, row (a, b) = K1[a] * K2[b] and V1[a] * V2[b]; the 9
    rows of the prompt stay where they are."""
    k1, k2, v1, v2 = (random(1, 2, 4, 8, seed=s) for s in range(4))
    cache = A.new_two_cache()
    A.two_cache_append(cache, k1[:, :, :3], k2[:, :, :3], v1[:, :, :3], v2[:, :, :3], torch.arange(3))
    before = [t.clone() for t in A.two_cache_pairs(cache)]
    A.two_cache_append(cache, k1[:, :, 3:], k2[:, :, 3:], v1[:, :, 3:], v2[:, :, 3:], torch.tensor([3]))
    Kt, Vt, pa, pb = A.two_cache_pairs(cache)
    P = before[0].shape[2]
    assert sorted(zip(pa.tolist(), pb.tolist())) == [(a, b) for a in range(4) for b in range(4)], \
        f"the pair rows' positions (a, b) must be every pair of the 4 tokens once; got {list(zip(pa, pb))}"
    want_k, want_v = k1[:, :, pa] * k2[:, :, pb], v1[:, :, pa] * v2[:, :, pb]
    assert Kt.shape == want_k.shape and torch.allclose(Kt, want_k), \
        "the K~ row of pair (a, b) is K1[a] * K2[b]: " + first_difference(Kt, want_k)
    assert Vt.shape == want_v.shape and torch.allclose(Vt, want_v), \
        "the V~ row of pair (a, b) is V1[a] * V2[b]: " + first_difference(Vt, want_v)
    assert all(torch.equal(x[..., :P, :] if x.dim() == 4 else x[:P], y) for x, y in zip((Kt, Vt, pa, pb), before)), \
        f"the {P} pair rows of the first 3 tokens moved or changed: the new pairs go after them (Def. 3.8)"
