"""Hidden tests of the ``tensor_attention`` assignment (the grader's; not in a student copy)."""

import math

import adapters as A
import torch
from oracle import assert_greedy_is_uncached, points


@points(3)
def test_causal_tensor_attention_against_loops():
    """Every query t over the pairs (a, b) with a, b <= t, by explicit loops (the oracle)."""
    g = torch.Generator().manual_seed(0)
    n, d = 5, 4
    q, K1, K2, V1, V2 = (torch.randn(n, d, generator=g) for _ in range(5))
    t = torch.arange(n)
    seen = t[None, :] <= t[:, None]
    got = A.attention(q, K1, K2, V1, V2, 1 / math.sqrt(d), seen[:, :, None] & seen[:, None, :])
    for i in range(n):
        pairs = [(a, b) for a in range(i + 1) for b in range(i + 1)]
        s = torch.stack([(q[i] * K1[a] * K2[b]).sum() / math.sqrt(d) for a, b in pairs])
        p = torch.softmax(s, 0)
        want = sum(p[j] * V1[a] * V2[b] for j, (a, b) in enumerate(pairs))
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6, msg=f"query {i}")


@points(3)
def test_cached_decode_equals_uncached_forward():
    model = A.tiny_tensor_model()
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(1))
    assert_greedy_is_uncached(A, model, ids, A.new_tensor_cache(model, "four"), 3, what="four-matrix cache,")


@points(2)
def test_four_and_two_matrix_caches_agree():
    model = A.tiny_tensor_model(seed=2)
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(2))
    four, two = A.new_tensor_cache(model, "four"), A.new_tensor_cache(model, "two")
    torch.testing.assert_close(A.run_prefill(model, ids, four), A.run_prefill(model, ids, two), rtol=1e-4,
                               atol=1e-5)
    token = ids[:, -1]
    torch.testing.assert_close(A.run_decode(model, token, four), A.run_decode(model, token, two), rtol=1e-4,
                               atol=1e-5)
