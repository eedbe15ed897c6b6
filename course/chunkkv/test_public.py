"""Public tests of the ``chunkkv`` assignment: chunks ranked by their summed votes, the remainder, the
position lookup of layer-wise reuse. Run them with ``python -m course.grade chunkkv``."""

import adapters as A
import torch
from oracle import points

# 2 KV heads, 11 positions, chunks of 4: [0..3], [4..7] and the last, [8..10], has 3 tokens. Head 1 holds the
# positions in reverse order (slot j holds position 10 - j): a chunk is made of positions, not of slots.
# Head 0's chunk sums are 0.6, 1.1, 0.9 (means 0.15, 0.275, 0.3; best single votes 0.6, 0.5, 0.3).
BY_POSITION = torch.tensor([[[0.6, 0.0, 0.0, 0.0, 0.5, 0.2, 0.2, 0.2, 0.3, 0.3, 0.3],
                             [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5]]])
POS = torch.stack([torch.arange(11), torch.arange(10, -1, -1)])[None]          # (1, 2, 11)
VOTES = BY_POSITION.gather(-1, POS)                                            # the votes of each slot
FREE = torch.ones(1, 2, 11, dtype=torch.bool)


def kept(mask, h):
    """The positions a head keeps, sorted."""
    return sorted(POS[0, h][mask[0, h]].tolist())


def check(mask, want, what):
    assert mask.shape == VOTES.shape and mask.dtype == torch.bool, \
        f"chunk_keep_mask returns a (B, H_kv, T) = {tuple(VOTES.shape)} bool mask, got {mask.dtype} {tuple(mask.shape)}"
    for h in range(2):
        assert kept(mask, h) == want[h], f"{what}: KV head {h} keeps positions {kept(mask, h)}, expected {want[h]}"


@points(2, task="chunk_ranking")
def test_whole_chunks_by_summed_votes():
    mask = A.chunk_mask(VOTES, POS, FREE, torch.tensor([[4, 4]]), 4, False, "none")
    check(mask, [[4, 5, 6, 7], [8, 9, 10]], "room for 4 tokens, per head: a chunk scores the sum of its votes (head "
          "0: 0.6, 1.1, 0.9, so chunk 1, not the best mean (chunk 2) nor the best single vote (chunk 0)); the "
          "next chunk does not fit")
    mask = A.chunk_mask(VOTES, POS, FREE, torch.tensor([[7, 7]]), 4, True, "none")
    check(mask, [[4, 5, 6, 7, 8, 9, 10]] * 2, "shared: one ranking for the layer, the chunk sums added over the KV "
          "heads (0.6, 1.1, 2.4): chunks 2 then 1 fill the 7 slots in both heads")
    free = FREE.clone()
    free[0, 0, 2:4] = False                                    # protected: chunk 0 of head 0 has 2 free slots
    mask = A.chunk_mask(VOTES, POS, free, torch.tensor([[6, 6]]), 4, False, "none")
    check(mask, [[4, 5, 6, 7], [8, 9, 10]], "room for 6, per head: chunks are taken best first while they fit, and "
          "the first that does not fit ends the choice (head 0: chunk 1 (4 slots), then chunk 2 (3 slots) does "
          "not fit, so chunk 0, though only 2 free slots, is not taken)")
    free = FREE.clone()
    free[0, 0, 2] = free[0, 0, 5] = free[0, 1, 5] = False     # protected positions 2 and 5: the policy gives +inf
    votes = VOTES.masked_fill(~free, float("inf"))
    mask = A.chunk_mask(votes, POS, free, torch.tensor([[6, 7]]), 4, False, "none")
    check(mask, [[4, 6, 7, 8, 9, 10], [0, 1, 2, 3, 8, 9, 10]], "room for 6 and 7, per head, positions 2 and 5 "
          "protected (their +inf votes do not count): a chunk is its free slots (head 0: chunk 1 = 4, 6, 7 with 0.9 "
          "and chunk 2 with 0.9 fill the 6 slots; head 1: chunk 2, then chunks 0 and 1 tie at 0: the earlier, "
          "chunk 0, fits); a protected slot is never in the mask")


@points(2, task="chunk_ranking")
def test_the_remainder_is_filled_with_single_tokens():
    mask = A.chunk_mask(VOTES, POS, FREE, torch.tensor([[6, 6]]), 4, False, "tokens")
    check(mask, [[0, 4, 5, 6, 7, 8], [5, 6, 7, 8, 9, 10]], "room for 6, remainder 'tokens': the best chunk, then "
          "the best single tokens of the other chunks, ties to the earlier slot (head 0: position 0 (0.6), then 8, "
          "the earliest 0.3; head 1: slots 3, 4, 5 (positions 7, 6, 5))")
    mask = A.chunk_mask(VOTES, POS, FREE, torch.tensor([[6, 6]]), 4, False, "none")
    check(mask, [[4, 5, 6, 7], [8, 9, 10]], "remainder 'none' leaves the rest of the room empty")


@points(2, task="holds_position")
def test_positions_held_by_another_layer():
    chosen = torch.tensor([[[2, 5, 9, -1], [3, -1, 0, 7]], [[1, 3, 4, 8], [-1, -1, 9, 6]]])   # -1: nothing
    pos = torch.tensor([[[9, 3, 5, -1, 2, 7], [7, 0, -1, 3, 5, 9]], [[9, 3, 5, -1, 2, 7], [6, 0, 1, 3, 5, 9]]])
    want = [[[True, False, True, False, True, False], [True, True, False, True, False, False]],
            [[False, True, False, False, False, False], [True, False, False, False, False, True]]]
    got = A.holds(chosen, pos, seen=10)
    assert got.shape == pos.shape, f"holds_position returns the shape of pos {tuple(pos.shape)}, got {got.shape}"
    for b in range(2):
        for h in range(2):
            assert got[b, h].tolist() == want[b][h], (
                f"batch {b}, KV head {h}: slot i holds a chosen position iff pos[i] is among chosen "
                f"{chosen[b, h].tolist()} of the same row and head (-1 in either is nothing); positions "
                f"{pos[b, h].tolist()} give {want[b][h]}, got {got[b, h].tolist()}")
