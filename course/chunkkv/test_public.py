"""Public tests of the ``chunkkv`` assignment: chunks ranked by their summed votes, the remainder, the
position lookup of layer-wise reuse. Run them with ``python -m course.grade chunkkv``."""

import adapters as A
import torch
from oracle import assert_close, check_tensor, generator, points

# 2 KV heads, 11 positions, chunks of 4: [0..3], [4..7] and the last, [8..10], has 3 tokens. Each head holds the
# positions in its slots in an order of its own (``layout``): a chunk is made of positions, not of slots.
# Head 0's chunk sums are 0.6, 1.1, 0.9 (means 0.15, 0.275, 0.3; best single votes 0.6, 0.5, 0.3).
BY_POSITION = torch.tensor([[[0.6, 0.0, 0.0, 0.0, 0.5, 0.2, 0.2, 0.2, 0.3, 0.3, 0.3],
                             [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5]]])


def layout(salt):
    """(votes of each slot, positions of each slot (1, 2, 11)): the votes above scaled by a power of two (exact:
    no sum or tie changes), each head's positions in its slots in an order drawn from the run's seed."""
    g = generator("chunkkv public", salt)
    pos = torch.stack([torch.randperm(11, generator=g) for _ in range(2)])[None]
    return BY_POSITION.gather(-1, pos) * 2.0 ** int(torch.randint(-6, 7, (1,), generator=g)), pos


def kept(mask, pos, h):
    """The positions a head keeps, sorted."""
    return sorted(pos[0, h][mask[0, h]].tolist())


def check(mask, pos, want, what):
    check_tensor(mask, pos.shape, torch.bool, "chunk_keep_mask's mask (B, H_kv, T)")
    for h in range(2):
        assert kept(mask, pos, h) == want[h], (f"{what}: KV head {h} keeps positions {kept(mask, pos, h)}, expected "
                                               f"{want[h]} (its slots hold the positions {pos[0, h].tolist()})")


@points(2, task="chunk_ranking")
def test_whole_chunks_by_summed_votes():
    votes, pos = layout("whole chunks")
    free = torch.ones(1, 2, 11, dtype=torch.bool)
    mask = A.chunk_mask(votes, pos, free, torch.tensor([[4, 4]]), 4, False, "none")
    check(mask, pos, [[4, 5, 6, 7], [8, 9, 10]], "room for 4 tokens, per head: a chunk scores the sum of its votes "
          "(head 0: 0.6, 1.1, 0.9 times a scale, so chunk 1, not the best mean (chunk 2) nor the best single vote "
          "(chunk 0)); the next chunk does not fit")
    mask = A.chunk_mask(votes, pos, free, torch.tensor([[7, 7]]), 4, True, "none")
    check(mask, pos, [[4, 5, 6, 7, 8, 9, 10]] * 2, "shared: one ranking for the layer, the chunk sums added over the "
          "KV heads (0.6, 1.1, 2.4 times a scale): chunks 2 then 1 fill the 7 slots in both heads")
    ahead = torch.zeros(1, 2, 11)
    ahead[0, 0, :4] = 5.0                                           # a second row: chunk 0 far ahead, head 0 only
    two_rows = A.chunk_mask(torch.cat([votes, ahead.gather(-1, pos)]), pos.repeat(2, 1, 1), free.repeat(2, 1, 1),
                            torch.tensor([[7, 7], [7, 7]]), 4, True, "none")
    check(two_rows[:1], pos, [[4, 5, 6, 7, 8, 9, 10]] * 2, "shared, two batch rows: each row ranks its own chunks "
          "(sums over its KV heads, not over the rows); row 0 as in the case before")
    check(two_rows[1:], pos, [[0, 1, 2, 3]] * 2, "shared, two batch rows: row 1's chunk 0 (5.0 x 4), then chunks "
          "1 and 2 tie at 0 and the earlier, chunk 1 (4 slots), does not fit the 3 left")
    empty = torch.cat([pos, torch.full((1, 2, 1), -1)], -1)         # one more slot per head: empty (-1), not free
    try:
        mask = A.chunk_mask(torch.cat([votes, torch.zeros(1, 2, 1)], -1), empty, torch.cat(
            [free, torch.zeros(1, 2, 1, dtype=torch.bool)], -1), torch.tensor([[4, 4]]), 4, False, "none")
    except (IndexError, RuntimeError) as e:
        raise AssertionError(f"an empty slot (pos -1, not free) failed: {str(e)[:120]}; it belongs to no chunk: "
                             "mask the slots that are not free before pos // chunk_size indexes a chunk") from None
    check(mask, empty, [[4, 5, 6, 7], [8, 9, 10]], "room for 4, per head, one empty slot (pos -1, not free): it is "
          "no chunk's and is never kept")
    protected = torch.stack([(pos[0, 0] != 2) & (pos[0, 0] != 3), torch.ones(11, dtype=torch.bool)])[None]
    mask = A.chunk_mask(votes, pos, protected, torch.tensor([[6, 6]]), 4, False, "none")   # head 0's chunk 0: 2 free
    check(mask, pos, [[4, 5, 6, 7], [8, 9, 10]], "room for 6, per head: chunks are taken best first while they fit, "
          "and the first that does not fit ends the choice (head 0: chunk 1 (4 slots), then chunk 2 (3 slots) does "
          "not fit, so chunk 0, though only 2 free slots, is not taken)")
    free = ~torch.stack([(pos[0, 0] == 2) | (pos[0, 0] == 5), pos[0, 1] == 5])[None]   # positions 2 and 5 protected
    mask = A.chunk_mask(votes.masked_fill(~free, float("inf")), pos, free, torch.tensor([[6, 7]]), 4, False, "none")
    check(mask, pos, [[4, 6, 7, 8, 9, 10], [0, 1, 2, 3, 8, 9, 10]], "room for 6 and 7, per head, positions 2 and 5 "
          "protected (the policy gives them +inf votes, which do not count): a chunk is its free slots (head 0: chunk "
          "1 = 4, 6, 7 with 0.9 and chunk 2 with 0.9, times a scale, fill the 6 slots; head 1: chunk 2, then chunks "
          "0 and 1 tie at 0: the earlier, chunk 0, fits); a protected slot is never in the mask")


    one = torch.ones(1, 2, 20, dtype=torch.bool)
    mask = A.chunk_mask(torch.ones(1, 2, 20), torch.arange(20).expand(1, 2, 20), one, torch.tensor([[3, 5]]), 1,
                        False, "none")
    check(mask, torch.arange(20).expand(1, 2, 20), [[0, 1, 2], [0, 1, 2, 3, 4]], "chunks of 1, 20 equal votes, room "
          "for 3 and 5: every tie goes to the earlier chunk (a sort without stable=True, or topk, reorders ties)")
    near = torch.tensor([[[0.5, 0.50000006, 0.125, 0.125], [1.0, 1.0001, 0.125, 0.125]]])
    mask = A.chunk_mask(near, torch.arange(4).expand(1, 2, 4), one[..., :4], torch.tensor([[1, 1]]), 1, False, "none")
    check(mask, torch.arange(4).expand(1, 2, 4), [[1], [1]], "chunks of 1, votes (0.5, 0.50000006, ...) and (1.0, "
          "1.0001, ...), room for 1: the higher vote wins, however close (summed in float32, never float16)")
    split = torch.tensor([[[0, 1, 2, 3, -1, -1, -1, -1], list(range(4, 12))]])      # the heads hold other positions
    mask = A.chunk_mask(torch.ones(1, 2, 8).masked_fill(split < 0, float("-inf")), split, split >= 0,
                        torch.tensor([[4, 4]]), 4, False, "none")
    check(mask, split, [[0, 1, 2, 3], [4, 5, 6, 7]], "chunks of 4, head 0 holding positions 0-3 (and 4 empty slots), "
          "head 1 positions 4-11: each head's chunks come from its own positions")
    grid = torch.arange(8).expand(1, 2, 8)
    votes = torch.tensor([float("inf"), 0.125, 0.125, 0.125, 1.0, 0.125, 0.125, 0.125]).expand(1, 2, 8)
    mask = A.chunk_mask(votes, grid, grid > 0, torch.tensor([[4, 4]]), 4, False, "none")
    check(mask, grid, [[4, 5, 6, 7]] * 2, "chunks of 4, position 0 protected (vote +inf), 1.0 at position 4: the "
          "chunks are positions 4k to 4k + 3 whatever is protected, so chunk 1 (1.375) beats chunk 0's free slots "
          "(0.375)")
    votes = torch.tensor([[[1.0, 1.0, 0.125, 0.125], [float("inf"), float("inf"), 0.125, 0.125]]])
    mask = A.chunk_mask(votes, torch.arange(4).expand(1, 2, 4), votes.isfinite(), torch.tensor([[2, 2]]), 2, True,
                        "none")
    check(mask, torch.arange(4).expand(1, 2, 4), [[0, 1], [2, 3]], "shared, chunks of 2, head 1's positions 0 and 1 "
          "protected: chunk 0 sums 2.0 over the heads (head 1 adds nothing there, rather than sinking it) and head 0 "
          "keeps it; head 1 has no free slot in it and keeps chunk 1")
    votes = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.125, 0.125, 0.125, 0.125]).expand(1, 2, 8)
    mask = A.chunk_mask(votes, grid, torch.ones(1, 2, 8, dtype=torch.bool), torch.tensor([[4, 8]]), 4, True, "none")
    check(mask, grid, [[0, 1, 2, 3], list(range(8))], "shared, chunks of 4, room for 4 in head 0 and 8 in head 1: "
          "one ranking for the layer, but each head fills its own room")


@points(2, task="chunk_ranking")
def test_the_remainder_is_filled_with_single_tokens():
    votes, pos = layout("remainder")
    free = torch.ones(1, 2, 11, dtype=torch.bool)
    slots = [pos[0, h].tolist() for h in range(2)]
    tail = min(slots[0].index(p) for p in (8, 9, 10))            # head 0: the earliest slot of the three 0.3 votes
    zeros = sorted(slots[1][i] for i in sorted(slots[1].index(p) for p in range(8))[:3])   # head 1: all at 0
    mask = A.chunk_mask(votes, pos, free, torch.tensor([[6, 6]]), 4, False, "tokens")
    check(mask, pos, [sorted([0, 4, 5, 6, 7, slots[0][tail]]), sorted([8, 9, 10] + zeros)],
          "room for 6, remainder 'tokens': the best chunk, then the best single tokens of the other chunks, ties to "
          "the earlier slot (head 0: position 0 (0.6), then the earliest slot of the 0.3s of chunk 2; head 1: after "
          "chunk 2, the three earliest slots of the others, all at 0)")
    mask = A.chunk_mask(votes, pos, free, torch.tensor([[6, 6]]), 4, False, "none")
    check(mask, pos, [[4, 5, 6, 7], [8, 9, 10]], "remainder 'none' leaves the rest of the room empty")


@points(2, task="holds_position")
def test_positions_held_by_another_layer():
    """A hand case, its positions renamed by a permutation drawn from the run's seed (holding a position is the
    same for any names) and each head's slots in a drawn order."""
    chosen = torch.tensor([[[2, 5, 9, -1], [3, -1, 0, 7]], [[1, 3, 4, 8], [-1, -1, 9, 6]]])   # -1: nothing
    pos = torch.tensor([[[9, 3, 5, -1, 2, 7], [7, 0, -1, 3, 5, 9]], [[9, 3, 5, -1, 2, 7], [6, 0, 1, 3, 5, 9]]])
    want = torch.tensor([[[True, False, True, False, True, False], [True, True, False, True, False, False]],
                         [[False, True, False, False, False, False], [True, False, False, False, False, True]]])
    g = generator("holds public")
    name = torch.cat([torch.tensor([0]), torch.randperm(999, generator=g)[:9] + 1,   # position 0 keeps its name:
                      torch.tensor([-1])])                                          # -1 read as 0 would show
    order = torch.stack([torch.randperm(6, generator=g) for _ in range(4)]).view(2, 2, 6)
    chosen, pos, want = name[chosen], name[pos].gather(-1, order), want.gather(-1, order)
    assert_close(A.holds(chosen, pos, seen=1000), want,
                 detail=lambda at: f"slot {at[2]} holds {int(pos[at])}; that head chose {chosen[at[:2]].tolist()}",
                 what="holds_position (B, H_kv, T): slot i holds a chosen position iff pos[i] is among those chosen by "
                 "the same row and head (-1 in either is nothing)")
    for chosen, pos, seen, want, why in (
            ([0, 3, -1], [0, 1, 3], 5, [True, False, True], "position 0 chosen, then -1 (nothing): 0 stays chosen"),
            ([1, -1], [1, 4], 5, [True, False], "-1 chosen is no position (not the last one, seen - 1 = 4)"),
            ([5], [0, 1, 2], 6, [False, False, False], "position 5 chosen, held by no slot (seen = 6)")):
        try:
            got = A.holds(torch.tensor([[chosen]]), torch.tensor([[pos]]), seen=seen)
        except (IndexError, RuntimeError) as e:
            raise AssertionError(f"holds_position(chosen {chosen}, pos {pos}, seen {seen}) failed: {str(e)[:100]}; "
                                 f"positions run from 0 to seen - 1, whatever the slots hold") from None
        assert_close(got, torch.tensor([[want]]), what=f"holds_position, chosen {chosen}, slots holding {pos}, seen "
                     f"{seen}: {why}")
