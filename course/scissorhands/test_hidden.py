"""Hidden tests of the ``scissorhands`` assignment (the grader's; not in a student copy)."""

import adapters as A
import torch
from oracle import points


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
    logits = A.run_prefill(model, ids, cache)[:, -1]
    for _ in range(4):
        torch.testing.assert_close(logits, A.uncached_logits(model, ids)[:, -1], rtol=1e-4, atol=1e-5)
        token = logits.argmax(-1)
        ids = torch.cat([ids, token[:, None]], dim=1)
        logits = A.run_decode(model, token, cache)


@points(3)
def test_budget_cache_stays_within_budget_and_keeps_the_recent_tokens():
    model = A.tiny_model(seed=3)
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(2))
    budget, n_recent = 8, 3
    cache = A.new_cache(model, "scissorhands", budget, history_window=4, n_recent=n_recent)
    logits = A.run_prefill(model, ids, cache)[:, -1]
    for step in range(5):
        token = logits.argmax(-1)
        logits = A.run_decode(model, token, cache)
        seen = 16 + step + 1
        for layer in range(2):
            pos = A.kept_positions(cache, layer)
            assert pos.shape[-1] <= budget, f"layer {layer} holds {pos.shape[-1]} > budget {budget}"
            for h in range(pos.shape[1]):
                assert set(range(seen - n_recent, seen)) <= set(pos[0, h].tolist()), "the recent window was evicted"
