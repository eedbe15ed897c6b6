"""Public tests of the ``baselines`` assignment: StreamingLLM's keep set, H2O's accumulation, SnapKV's vote.
Run them with ``python -m course.grade baselines``."""

import adapters as A
import torch
import torch.nn.functional as F
from oracle import points


@points(2)
def test_streaming_llm_keeps_sinks_and_recent():
    pos = torch.arange(20).expand(1, 2, 20).clone()
    pos[0, 1, 5] = -1                                                    # an empty slot is never kept
    keep = A.streaming_mask(pos, seen=20, budget=8, n_sink=4)
    want = [p for p in range(20) if p < 4 or p >= 16]
    assert torch.nonzero(keep[0, 0]).flatten().tolist() == want, "keep positions 0..3 and the last 4"
    assert not keep[0, 1, 5], "an empty slot (position -1) must not be kept"


@points(2)
def test_h2o_scores_accumulate():
    """Prefill: the scores are what each slot received (group mean); decode: they add up; new slots start at 0."""
    g = torch.Generator().manual_seed(0)
    policy = A.h2o_policy(100)
    store = A.new_storage()
    A.storage_append(store, torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g), torch.arange(5))
    c0 = torch.rand(1, 4, 5, generator=g)                                # 4 query heads over 2 KV heads
    s0 = A.h2o_observe(policy, store, c0, "prefill", 5).clone()
    torch.testing.assert_close(s0, c0.view(1, 2, 2, 5).mean(2))
    A.storage_append(store, torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g),
                      torch.tensor([5]))
    c1 = torch.rand(1, 4, 6, generator=g)
    s1 = A.h2o_observe(policy, store, c1, "decode", 6)
    torch.testing.assert_close(s1, torch.cat([s0, torch.zeros(1, 2, 1)], -1) + c1.view(1, 2, 2, 6).mean(2))


@points(2)
def test_snapkv_vote_sums_pools_and_averages():
    g = torch.Generator().manual_seed(1)
    probs = torch.rand(2, 4, 3, 11, generator=g)                        # (B, H, w, Tp)
    vote = probs.sum(2)                                                  # (B, H, Tp)
    padded = F.pad(vote, (2, 2), value=float("-inf"))
    pooled = torch.stack([padded[..., i:i + 5].max(-1).values for i in range(11)], -1)
    want = pooled.view(2, 2, 2, 11).mean(2)
    torch.testing.assert_close(A.snapkv_vote(probs, 2, kernel=5, pooling="max"), want)
