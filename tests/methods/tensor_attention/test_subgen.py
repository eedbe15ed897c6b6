"""SubGen: exact when the sketch holds the whole stream, the normaliser of one tight cluster, error falling with
more samples, the pair stream of a tensor-attention cache, memory that stops growing, argument errors, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from methods.tensor_attention import TwoCache, kron_rows, two_cache_attention
from methods.tensor_attention.subgen import SubGen, clustered_factors, error_vs_memory, pair_rows, subgen_pairs


def randn(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def softmax_attention(q, K, V, scale):
    return torch.softmax(scale * q @ K.T, dim=-1) @ V


def test_sketch_as_large_as_the_stream_is_exact():
    """per_cluster and value_samples >= the stream length: every key is in its cluster's sample and every
    pair is kept verbatim, so the estimate is softmax attention itself (fp64), for one query or several."""
    K, V, q = randn(50, 6, seed=1), randn(50, 6, seed=2), randn(3, 6, seed=3)
    sketch = SubGen(6, delta=1.0, per_cluster=50, value_samples=50)
    sketch.update(K[:20], V[:20])
    sketch.update(K[20:], V[20:])
    assert sketch.exact_values and sum(sketch.counts) == 50
    torch.testing.assert_close(sketch.attend(q, 0.5), softmax_attention(q, K, V, 0.5), atol=1e-10, rtol=0)
    torch.testing.assert_close(sketch.attend(q[0], 0.5), softmax_attention(q[0], K, V, 0.5), atol=1e-10, rtol=0)


def test_pair_sketch_as_large_as_the_pairs_is_exact_tensor_attention():
    """n = 6 tokens: 36 pair rows; a sketch that keeps them all equals the two-matrix cache's attention."""
    n, d = 6, 4
    K1, K2, V1, V2 = (randn(n, d, seed=s) for s in range(4))
    q = randn(5, d, seed=9)
    sketch = subgen_pairs(K1, K2, V1, V2, delta=0.5, per_cluster=n * n, value_samples=n * n)
    exact = two_cache_attention(q, kron_rows(K1, K2), kron_rows(V1, V2), 1 / math.sqrt(d))
    torch.testing.assert_close(sketch.attend(q, 1 / math.sqrt(d)), exact, atol=1e-10, rtol=0)


def test_one_cluster_of_identical_keys_has_an_exact_normaliser():
    """100 copies of one key: one cluster, and any sample of it gives Z = 100 exp(<q, k>) exactly."""
    k = randn(1, 5, seed=4)
    sketch = SubGen(5, delta=0.1, per_cluster=3, value_samples=4, seed=7)
    sketch.update(k.expand(100, 5), randn(100, 5, seed=5))
    q = randn(5, seed=6)
    assert sketch.n_clusters == 1 and sketch.counts == [100]
    z = sketch.normaliser(q, 0.7)
    assert math.isclose(float(z), 100 * math.exp(0.7 * float(k[0] @ q)), rel_tol=1e-12)


def test_error_falls_with_more_samples():
    """Mean relative error over queries and 3 sketch seeds: 1 key per cluster and 4 value samples against 8
    and 128 (n = 24: 576 pair rows, 9 pair clusters)."""
    rows = error_vs_memory(n=24, settings=((1, 4), (8, 128)), seeds=3)
    small, large = rows
    assert small["n_clusters"] == large["n_clusters"] == 9
    assert large["stored_bytes"] > small["stored_bytes"]
    assert large["rel_error"] < 0.5 * small["rel_error"]
    assert large["bound_error"] < 0.5 * small["bound_error"]


def test_pair_stream_is_the_two_matrix_cache_and_counts_add_up():
    """The rows streamed for token i are the rows ``TwoCache`` appends for it, in its order; n^2 in all."""
    n, d = 7, 3
    K1, K2, V1, V2 = (randn(n, d, seed=s) for s in range(4))
    cache = TwoCache()
    for i in range(n):
        cache.append(*(t[None, None, i:i + 1] for t in (K1, K2, V1, V2)), torch.tensor([i]))
    keys, values = zip(*(pair_rows(K1, K2, V1, V2, i) for i in range(n)))
    assert [len(k) for k in keys] == [2 * i + 1 for i in range(n)]
    torch.testing.assert_close(torch.cat(keys), cache.kt.t[0, 0], atol=0, rtol=0)
    torch.testing.assert_close(torch.cat(values), cache.vt.t[0, 0], atol=0, rtol=0)
    sketch = subgen_pairs(K1, K2, V1, V2, delta=0.3, per_cluster=2, value_samples=5)
    assert sum(sketch.counts) == sketch.n_seen == n * n


def test_memory_stops_growing_on_clustered_keys():
    """Once every cluster's reservoir is full and the value side samples, more rows cost no memory."""
    g = torch.Generator().manual_seed(0)
    K1, K2, V1, V2 = clustered_factors(24, 8, clusters=2, noise=0.02, generator=g)
    short = subgen_pairs(K1[:12], K2[:12], V1[:12], V2[:12], delta=1.0, per_cluster=4, value_samples=16)
    long = subgen_pairs(K1, K2, V1, V2, delta=1.0, per_cluster=4, value_samples=16)
    assert short.n_clusters == long.n_clusters == 4
    assert short.numbers() == long.numbers() == (4 + 4 * 4 + 2 * 16) * 8 + 4 + 2
    assert long.nbytes() == 8 * long.numbers() and long.nbytes(4) == 4 * long.numbers()


def test_same_seed_same_sketch_other_seed_other_samples():
    g = torch.Generator().manual_seed(1)
    factors = clustered_factors(12, 6, clusters=2, noise=0.05, generator=g)
    q = randn(4, 6, seed=2)
    a, b, c = (subgen_pairs(*factors, delta=1.0, per_cluster=2, value_samples=8, seed=s) for s in (3, 3, 4))
    assert torch.equal(a.attend(q, 0.5), b.attend(q, 0.5))
    assert not torch.equal(a.attend(q, 0.5), c.attend(q, 0.5))


@pytest.mark.parametrize("kwargs, match", [
    (dict(delta=0.0), "delta"), (dict(delta=-1.0), "delta"), (dict(delta=float("nan")), "delta"),
    (dict(per_cluster=0), "per_cluster"), (dict(value_samples=0), "value_samples"), (dict(d=0), "d must"),
])
def test_bad_arguments(kwargs, match):
    args = dict(d=4, delta=1.0, per_cluster=2, value_samples=3) | kwargs
    with pytest.raises(ValueError, match=match):
        SubGen(**args)


def test_bad_shapes():
    sketch = SubGen(4, delta=1.0, per_cluster=2, value_samples=3)
    with pytest.raises(ValueError, match="empty"):
        sketch.attend(randn(4))
    with pytest.raises(ValueError, match="keys and values"):
        sketch.update(randn(5, 4), randn(4, 4))
    with pytest.raises(ValueError, match="keys and values"):
        sketch.update(randn(5, 3), randn(5, 3))
    sketch.update(randn(5, 4), randn(5, 4))
    with pytest.raises(ValueError, match="q must be"):
        sketch.attend(randn(3))
    with pytest.raises(ValueError, match="K1, K2, V1, V2"):
        subgen_pairs(randn(3, 4), randn(3, 4), randn(2, 4), randn(3, 4), 1.0, 2, 3)
