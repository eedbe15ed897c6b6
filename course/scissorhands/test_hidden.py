"""Hidden tests of the ``scissorhands`` assignment (the grader's; not in a student copy)."""

import adapters as A
import torch
from oracle import assert_greedy_is_uncached, greedy, points


@points(3)
def test_keep_protects_the_recent_window_and_drops_by_the_counters():
    g = torch.Generator().manual_seed(0)
    T, budget, n_recent = 12, 8, 3
    counts = torch.randint(0, 4, (1, 2, T), generator=g)
    attn = torch.rand(1, 2, T, generator=g)
    pos = torch.arange(T).expand(1, 2, T)
    kept = A.keep(counts, attn, pos, seen=T, budget=budget, drop=1, n_recent=n_recent)
    for h in range(2):
        others = sorted(range(T - n_recent), key=lambda i: (int(counts[0, h, i]), -float(attn[0, h, i])))
        want = sorted(others[:budget - n_recent] + list(range(T - n_recent, T)))
        assert kept[0, h].tolist() == want, f"KV head {h}: kept {kept[0, h].tolist()}, expected {want}"


@points(2)
def test_covering_budget_is_full_attention():
    model = A.tiny_model(seed=2)
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(1))
    cache = A.new_cache(model, "scissorhands", 64, history_window=4)
    assert_greedy_is_uncached(A, model, ids, cache, 4, what="Scissorhands at a covering budget,")


@points(3)
def test_budget_cache_stays_within_budget_and_keeps_the_recent_tokens():
    model = A.tiny_model(seed=3)
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(2))
    budget, n_recent = 8, 3
    cache = A.new_cache(model, "scissorhands", budget, history_window=4, n_recent=n_recent)
    for _, seq in greedy(A, model, ids, cache, 5):
        seen = seq.shape[1]
        for layer in range(2):
            pos = A.kept_positions(cache, layer)
            assert pos.shape[-1] <= budget, f"layer {layer} holds {pos.shape[-1]} > budget {budget}"
            for h in range(pos.shape[1]):
                assert set(range(seen - n_recent, seen)) <= set(pos[0, h].tolist()), "the recent window was evicted"
