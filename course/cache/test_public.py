"""Public tests of the ``cache`` assignment: the storage, one decode step's probabilities, the positional
mask. Run them with ``python -m course.grade cache`` (they reach your code through ``adapters.py``)."""

import adapters as A
import torch
from oracle import full_attention, points


@points(2)
def test_append_then_read():
    """Two appends read back as one sequence: keys, values and positions in order."""
    g = torch.Generator().manual_seed(0)
    k1, v1 = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 5, 8, generator=g)
    k2, v2 = torch.randn(2, 3, 1, 8, generator=g), torch.randn(2, 3, 1, 8, generator=g)
    store = A.new_storage()
    A.storage_append(store, k1, v1, torch.arange(5))
    A.storage_append(store, k2, v2, torch.tensor([5]))
    k, v, pos = A.storage_contents(store)
    assert k.shape == (2, 3, 6, 8), f"stored keys have shape {tuple(k.shape)}, expected (2, 3, 6, 8)"
    torch.testing.assert_close(k, torch.cat([k1, k2], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(v, torch.cat([v1, v2], dim=2), rtol=0, atol=0)
    assert pos.tolist() == [[list(range(6))] * 3] * 2, \
        f"positions must be stored per row and head, in order; got {pos[0, 0].tolist()} in row 0, head 0"


@points(2)
def test_decode_probs_match_full_attention():
    """GQA decode step: 4 query heads over 2 KV heads, compared with full attention (the oracle)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 1, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g), \
        torch.randn(2, 2, 9, 16, generator=g)
    probs = A.decode_probs(q, k)                                         # (B, H_kv, G, Tk)
    assert probs.shape == (2, 2, 2, 9), f"probs have shape {tuple(probs.shape)}, expected (B, H_kv, G, Tk)"
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 2, 2), rtol=0, atol=1e-6)
    out = (probs @ v).reshape(2, 4, 1, 16)                               # query head h = kv * G + g
    want = full_attention(q, k, v, torch.tensor([8]), torch.arange(9).expand(2, 2, 9))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@points(2)
def test_masked_attention_sees_only_the_past():
    """Scattered positions (after an eviction) and a chunk of three queries: the mask comes from positions."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 3, 16, generator=g)
    k, v = torch.randn(1, 2, 6, 16, generator=g), torch.randn(1, 2, 6, 16, generator=g)
    k_pos = torch.tensor([0, 3, 7, 9, 10, 11]).expand(1, 2, 6)
    q_pos = torch.tensor([9, 10, 11])
    want = full_attention(q, k, v, q_pos, k_pos)
    torch.testing.assert_close(A.masked_attention(q, k, v, q_pos, k_pos), want, rtol=1e-5, atol=1e-6)
