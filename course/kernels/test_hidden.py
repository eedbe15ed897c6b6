"""Hidden tests of the ``kernels`` assignment (the grader's; not in a student copy)."""

import adapters as A
import torch
from oracle import full_attention, points


@points(3)
def test_selected_rows_with_padding():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 16, generator=g), torch.randn(2, 2, 50, 16, generator=g), \
        torch.randn(2, 2, 50, 16, generator=g)
    idx = torch.stack([torch.randperm(50, generator=g)[:20] for _ in range(4)]).view(2, 2, 20)
    idx[1, 0, 15:] = -1                                                    # a shorter head, padded
    got = A.decode_selected(q, k, v, idx, block_n=16, splits=2)
    for b in range(2):
        for h in range(2):
            rows = idx[b, h][idx[b, h] >= 0]
            want = full_attention(q[b:b + 1, 2 * h:2 * h + 2, None], k[b:b + 1, h:h + 1, rows],
                                  v[b:b + 1, h:h + 1, rows], torch.tensor([0]), torch.zeros(1, 1, len(rows)))
            torch.testing.assert_close(got[b, 2 * h:2 * h + 2], want[0, :, 0], rtol=1e-5, atol=1e-5)


@points(2)
def test_a_range_with_no_valid_token():
    """The last range holds only padding: its partials must not turn the output into nan."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 2, 16, generator=g), torch.randn(1, 1, 64, 16, generator=g), \
        torch.randn(1, 1, 64, 16, generator=g)
    idx = torch.full((1, 1, 64), -1)
    idx[0, 0, :10] = torch.arange(10)
    got = A.decode_selected(q, k, v, idx, block_n=16, splits=4)
    want = torch.softmax(q[0] @ k[0, 0, :10].T / 4.0, -1) @ v[0, 0, :10]
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


@points(2)
def test_merge_skips_an_empty_range():
    g = torch.Generator().manual_seed(4)
    m = torch.tensor([[[1.0], [float("-inf")]]])                             # (1, 2 splits, G=1)
    l = torch.tensor([[[2.0], [0.0]]])
    acc = torch.zeros(1, 2, 1, 4)
    acc[0, 0, 0] = torch.randn(4, generator=g)
    torch.testing.assert_close(A.merge(m, l, acc), acc[:, 0] / 2.0)
