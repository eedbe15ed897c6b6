"""Public tests of the ``chunkkv`` assignment: chunks ranked by their summed votes, the remainder, the
position lookup of layer-wise reuse. Run them with ``python -m course.grade chunkkv``."""

import adapters as A
import torch
from oracle import points

SCORES = torch.tensor([[[0.1, 0.1, 0.1, 0.1,  0.9, 0.0, 0.0, 0.0,  0.3, 0.3, 0.3, 0.3]]])   # chunks of 4
POS = torch.arange(12).view(1, 1, 12)
FREE = torch.ones(1, 1, 12, dtype=torch.bool)


@points(2)
def test_whole_chunks_by_summed_votes():
    # chunk sums: 0.4, 0.9, 1.2 -> chunks 2 then 1; the single best token (0.9) does not decide alone
    keep = A.chunk_mask(SCORES, POS, FREE, torch.tensor([[8]]), 4, False, "none")
    assert torch.nonzero(keep[0, 0]).flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


@points(2)
def test_the_remainder_is_filled_with_single_tokens():
    keep = A.chunk_mask(SCORES, POS, FREE, torch.tensor([[6]]), 4, False, "tokens")
    # chunk 2 whole (4 tokens), then the best 2 single tokens elsewhere: 4 (0.9), then 0 (the earlier of the 0.1s)
    assert torch.nonzero(keep[0, 0]).flatten().tolist() == [0, 4, 8, 9, 10, 11]
    keep = A.chunk_mask(SCORES, POS, FREE, torch.tensor([[6]]), 4, False, "none")
    assert torch.nonzero(keep[0, 0]).flatten().tolist() == [8, 9, 10, 11], '"none" leaves the remainder empty'


@points(2)
def test_positions_held_by_another_layer():
    chosen = torch.tensor([[[2, 5, 9, -1]]])
    pos = torch.tensor([[[9, 3, 5, -1, 2, 7]]])
    assert A.holds(chosen, pos, seen=10).tolist() == [[[True, False, True, False, True, False]]]
