"""Public tests of the ``kvreviver`` assignment: inserting tokens into the count sketch (Algorithm 1) and
reading them back (Algorithm 2). Run them with ``python -m course.grade kvreviver``."""

import adapters as A
import torch
from oracle import points


def tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 4, generator=g), torch.randn(n, 2, 4, generator=g)


def filled_sketch(width, n, seed):
    """A 3-row sketch of ``width`` cells holding tokens at positions 0..n-1; with what the test compares:
    (sketch, k, v, cells h_i(J), signs g_i(J), key cells, value cells)."""
    sketch = A.new_sketch(3, width, 2, 4, seed=seed)
    k, v = tokens(n, seed=seed)
    A.insert(sketch, torch.arange(n), k, v)
    return (sketch, k, v, *A.hashes(sketch, torch.arange(n)), *A.cells(sketch))


@points(2)
def test_an_injective_sketch_gives_tokens_back_exactly():
    sketch = A.new_sketch(3, 16, 2, 4, injective=True)
    k, v = tokens(5)
    pos = torch.tensor([0, 3, 7, 8, 15])
    A.insert(sketch, pos, k, v)
    k_hat, v_hat = A.query(sketch, pos)
    torch.testing.assert_close(k_hat, k)
    torch.testing.assert_close(v_hat, v)


@points(2)
def test_cells_hold_keys_and_signed_values():
    _, k, v, cell, sign, key, value = filled_sketch(width=4, n=6, seed=1)     # cell, sign (3, 6)
    for i in range(3):
        for c in range(4):
            here = cell[i] == c
            want_k = k[here].sum(0) if here.any() else torch.zeros(2, 4)
            want_v = (sign[i][here, None, None] * v[here]).sum(0) if here.any() else torch.zeros(2, 4)
            torch.testing.assert_close(key[i, c], want_k, msg=f"row {i} cell {c}: key sum")
            torch.testing.assert_close(value[i, c], want_v, msg=f"row {i} cell {c}: signed value sum")


@points(2)
def test_query_is_the_median_over_rows():
    sketch, k, v, cell, sign, key, value = filled_sketch(width=5, n=9, seed=2)
    k_hat, v_hat = A.query(sketch, torch.arange(9))
    rows = torch.arange(3)[:, None]
    want_k = key[rows, cell].median(0).values                           # (9, 2, 4)
    want_v = (value[rows, cell] * sign[..., None, None]).median(0).values
    torch.testing.assert_close(k_hat, want_k)
    torch.testing.assert_close(v_hat, want_v)
