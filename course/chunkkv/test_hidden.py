"""Hidden tests of the ``chunkkv`` assignment (the grader's; not in a student copy)."""

import adapters as A
import torch
from oracle import points


@points(2)
def test_shared_ranking_sums_votes_over_heads():
    scores = torch.tensor([[[1.0, 1.0, 0.0, 0.0, 0.2, 0.2], [0.0, 0.0, 0.0, 0.0, 0.9, 0.9]]])   # chunks of 2
    pos = torch.arange(6).expand(1, 2, 6)
    free = torch.ones(1, 2, 6, dtype=torch.bool)
    n_free = torch.tensor([[2, 2]])
    own = A.chunk_mask(scores, pos, free, n_free, 2, False, "none")
    shared = A.chunk_mask(scores, pos, free, n_free, 2, True, "none")
    assert [torch.nonzero(own[0, h]).flatten().tolist() for h in range(2)] == [[0, 1], [4, 5]]
    # summed over heads: chunk 0 = 2.0, chunk 2 = 2.2: both heads keep chunk 2
    assert [torch.nonzero(shared[0, h]).flatten().tolist() for h in range(2)] == [[4, 5], [4, 5]]


@points(2)
def test_protected_slots_never_compete():
    scores = torch.tensor([[[5.0, 5.0, 0.1, 0.1, 0.2, 0.2]]])
    pos = torch.arange(6).view(1, 1, 6)
    free = torch.tensor([[[False, False, True, True, True, True]]])
    keep = A.chunk_mask(scores, pos, free, torch.tensor([[2]]), 2, False, "none")
    assert torch.nonzero(keep[0, 0]).flatten().tolist() == [4, 5], "only free slots may be chosen"


@points(3)
def test_chunkkv_keeps_whole_chunks_and_reuses_indices():
    model = A.tiny_model(seed=5)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(6))
    budget, chunk, window = 16, 4, 4
    cache = A.new_cache(model, "chunkkv", budget, chunk_size=chunk, reuse=2, remainder="none", window=window)
    A.run_prefill(model, ids, cache)
    p0, p1 = A.kept_positions(cache, 0), A.kept_positions(cache, 1)
    assert torch.equal(p0, p1), "with reuse = 2 layer 1 keeps exactly layer 0's positions"
    for h in range(p0.shape[1]):
        kept = set(p0[0, h].tolist()) - {-1}
        assert set(range(40 - window, 40)) <= kept, "the observation window is kept"
        chosen = kept - set(range(40 - window, 40))
        assert len(chosen) == budget - window, f"head {h}: {len(chosen)} chosen, expected {budget - window}"
        assert all({c // chunk * chunk + i for i in range(chunk)} <= kept for c in chosen), "whole chunks only"
