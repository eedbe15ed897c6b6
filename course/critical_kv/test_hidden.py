"""Hidden tests of the ``critical_kv`` assignment (the grader's; not in a student copy)."""

import adapters as A
import torch
from oracle import points


@points(3)
def test_alpha_one_is_attention_topk_and_alpha_zero_is_a_times_p():
    g = torch.Generator().manual_seed(1)
    attn = torch.softmax(torch.randn(3, 16, generator=g), -1)
    vnorm = torch.rand(3, 16, generator=g) * 3
    for row in range(3):
        top_a = sorted(attn[row].topk(5).indices.tolist())
        top_ap = sorted((attn[row] * vnorm[row]).topk(5).indices.tolist())
        assert A.select(attn, vnorm, 5, 1.0)[row].tolist() == top_a, "alpha = 1: the attention top-k"
        assert A.select(attn, vnorm, 5, 0.0)[row].tolist() == top_ap, "alpha = 0: the top-k of A * P"
    assert A.select(attn, vnorm, 40, 0.25).shape[-1] == 16, "a budget over n keeps everything"


@points(2)
def test_keeping_everything_changes_nothing():
    g = torch.Generator().manual_seed(2)
    attn = torch.softmax(torch.randn(4, 10, generator=g), -1)
    projected = torch.randn(4, 10, 3, generator=g)
    keep = torch.ones(4, 10, dtype=torch.bool)
    torch.testing.assert_close(A.perturbation(attn, keep, projected), torch.zeros(4), atol=1e-6, rtol=0)
    torch.testing.assert_close(A.bound(attn, keep, projected.abs().sum(-1)), torch.zeros(4), atol=1e-6, rtol=0)


@points(3)
def test_critical_snapkv_compresses_the_prompt_to_budget():
    model = A.tiny_model(seed=4)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(3))
    budget, window = 10, 4
    cache = A.new_cache(model, "critical_kv", budget, inner="snapkv", window=window)
    logits = A.run_prefill(model, ids, cache)[:, -1]
    for layer in range(2):
        pos = A.kept_positions(cache, layer)
        for h in range(pos.shape[1]):
            kept = set(pos[0, h].tolist()) - {-1}
            assert len(kept) == budget, f"layer {layer} head {h} keeps {len(kept)} entries, budget {budget}"
            assert set(range(24 - window, 24)) <= kept, "the observation window is always kept"
    assert torch.isfinite(A.run_decode(model, logits.argmax(-1), cache)).all()
