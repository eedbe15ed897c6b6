"""Hidden tests of the ``kvreviver`` assignment (the grader's; not in a student copy)."""

import adapters as A
import torch
from oracle import assert_greedy_is_uncached, points


@points(2)
def test_delete_undoes_insert():
    g = torch.Generator().manual_seed(3)
    sketch = A.new_sketch(3, 4, 2, 4, seed=3)
    k, v = torch.randn(7, 2, 4, generator=g), torch.randn(7, 2, 4, generator=g)
    A.insert(sketch, torch.arange(7), k, v)
    key, value = A.cells(sketch)
    assert key.abs().max() > 0.1 and value.abs().max() > 0.1, "insert must add the tokens into the cells"
    A.delete(sketch, torch.arange(7), k, v)
    key, value = A.cells(sketch)
    assert key.abs().max() < 1e-5 and value.abs().max() < 1e-5, "delete must subtract exactly what insert added"


@points(2)
def test_a_token_alone_in_its_cells_comes_back_exactly():
    sketch = A.new_sketch(3, 64, 2, 4, seed=4)
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, 2, 4, generator=g), torch.randn(1, 2, 4, generator=g)
    A.insert(sketch, torch.tensor([11]), k, v)
    k_hat, v_hat = A.query(sketch, torch.tensor([11]))
    torch.testing.assert_close(k_hat, k)
    torch.testing.assert_close(v_hat, v, msg="the value's sign must be undone when read")


@points(4)
def test_kvreviver_with_an_exact_sketch_is_full_attention():
    """An injective hash loses nothing: every evicted token is rebuilt exactly, so the logits are the
    uncached forward pass's (the oracle), while tokens really live in the sketch."""
    model = A.tiny_model(seed=6)
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(5))
    cache = A.new_cache(model, "kvreviver", 20, sketch_width=64, injective_hash=True)
    assert_greedy_is_uncached(A, model, ids, cache, 3, what="KVReviver with an exact sketch,")
    assert A.kept_positions(cache, 0).shape[-1] < ids.shape[1] + 3, "tokens must have been evicted into the sketch"
