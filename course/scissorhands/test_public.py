"""Public tests of the ``scissorhands`` assignment: the low flags, the order of eviction, how many to drop.
Run them with ``python -m course.grade scissorhands``."""

import adapters as A
import torch
from oracle import points


@points(2)
def test_low_flags_use_the_uniform_level():
    attn = torch.tensor([[[[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.2, 0.6]]]])      # (1, 1, 2 queries, 4 slots)
    visible = torch.tensor([[[[True, True, True, False], [True, True, True, True]]]])
    flags = A.unimportant(attn, visible)
    # query 0 saw 3 slots (level 1/3), query 1 saw 4 (level 1/4); an unseen slot is never low
    assert flags.tolist() == [[[[False, True, True, False], [True, True, True, False]]]], flags.tolist()
    flags = A.unimportant(attn, visible, threshold=0.15)
    assert flags.tolist() == [[[[False, False, False, False], [True, True, False, False]]]], flags.tolist()


@points(2)
def test_tokens_to_drop():
    assert A.tokens_to_drop(10, 12, drop=1, n_recent=2) == 0, "within budget: nothing to drop"
    assert A.tokens_to_drop(13, 12, drop=1, n_recent=2) == 1
    assert A.tokens_to_drop(13, 12, drop=4, n_recent=2) == 4, "m at a time"
    assert A.tokens_to_drop(19, 12, drop=4, n_recent=2) == 8, "as often as needed to get within budget"
    assert A.tokens_to_drop(13, 12, drop=20, n_recent=2) == 10, "m is cut to budget - n_recent"


@points(2)
def test_fewer_low_flags_first_then_higher_attention():
    counts = torch.tensor([[[3, 0, 1, 1, 0]]])
    attn = torch.tensor([[[0.9, 0.1, 0.3, 0.2, 0.4]]])
    pos = torch.tensor([[[0, 1, 2, 3, -1]]])
    order = A.keep_order(counts, attn, pos)[0, 0].argsort(descending=True).tolist()
    assert order == [1, 2, 3, 0, 4], f"keep order {order}: counts ascending, then attention, the empty slot last"
