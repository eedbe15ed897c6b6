"""Hidden tests of the ``baselines`` assignment (the grader's; not in a student copy)."""

import adapters as A
import torch
import torch.nn.functional as F
from oracle import assert_greedy_is_uncached, greedy, points


@points(3)
def test_streaming_llm_decodes_with_sinks_and_window():
    model = A.tiny_model()
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = A.new_cache(model, "streaming_llm", 8, n_sink=2)
    for _, seq in greedy(A, model, ids, cache, 5):
        pos, T = A.kept_positions(cache, 0), seq.shape[1]
        want = [0, 1] + list(range(T - 6, T))
        assert sorted(pos[0, 0].tolist()) == want, f"after {T} tokens layer 0 holds {sorted(pos[0, 0].tolist())}"


@points(2)
def test_h2o_with_covering_budget_is_full_attention():
    """With a budget covering the sequence nothing is evicted: logits == uncached. And the scores add up:
    every query's attention sums to 1, so a head's scores sum to the number of queries it has seen."""
    model = A.tiny_model(seed=1)
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(3))
    cache = A.new_cache(model, "h2o", 64)
    assert_greedy_is_uncached(A, model, ids, cache, 4, what="H2O at a covering budget,")
    for layer in range(2):
        totals = A.h2o_scores(cache, layer).sum(-1)                       # (B, H_kv)
        torch.testing.assert_close(totals, torch.full_like(totals, 10 + 4), rtol=1e-5, atol=1e-4,
                                   msg=lambda m: f"layer {layer}: scores must sum to the 14 queries seen\n{m}")


@points(3)
def test_snapkv_keeps_the_window_and_each_heads_top_votes():
    g = torch.Generator().manual_seed(4)
    T, w, budget = 16, 4, 9
    probs = torch.softmax(torch.randn(1, 4, w, T, generator=g) * 3, -1)   # the prompt's last w rows
    pos = torch.arange(T).expand(1, 2, T)
    kept = A.snapkv_select(probs, pos, T, budget, w, kernel=3, pooling="avg")
    vote = F.avg_pool1d(probs.sum(2).view(-1, 1, T)[..., :T - w], 3, 1, 1).view(1, 4, T - w)
    vote = vote.view(1, 2, 2, T - w).mean(2)                              # (1, H_kv, T - w)
    for h in range(2):
        top = vote[0, h].topk(budget - w).indices.tolist()
        want = sorted(top + list(range(T - w, T)))
        assert kept[0, h].tolist() == want, f"KV head {h}: kept {kept[0, h].tolist()}, expected {want}"


@points(3)
def test_adakv_allocates_across_heads_with_a_safeguard():
    g = torch.Generator().manual_seed(5)
    scores = torch.rand(2, 4, 10, generator=g)
    scores[:, 0] += 1.0                                                   # head 0 wins the global ranking
    budget, n_safe = 4, 1
    mask = A.adakv_mask(scores, budget, n_safe)
    assert mask.shape == scores.shape
    for b in range(2):
        forced = {(h, int(scores[b, h].argmax())) for h in range(4)}      # every head's safeguard
        rest = sorted(((float(scores[b, h, t]), h, t) for h in range(4) for t in range(10)
                       if (h, t) not in forced), reverse=True)
        want = forced | {(h, t) for _, h, t in rest[:4 * budget - len(forced)]}
        got = {(h, t) for h, t in torch.nonzero(mask[b]).tolist()}
        assert got == want, f"row {b}: AdaKV kept {sorted(got)}, expected {sorted(want)}"
