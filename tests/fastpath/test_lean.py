"""The lean decode step (fastpath/lean.py) computes what decode_step computes, with every policy."""

import pytest
import torch

from fastpath.attention import attend_heads, attend_step
from fastpath.lean import LeanDecoder
from methods import METHODS, make_policy
from nanollm import KVCache, generate, preset
from nanollm.generation import decode_step, prefill


def steps_both(model, x, policy_name=None, budget=12, n_prompt=10):
    """Logits of decode_step and of the lean step over the same tokens, each with its own cache."""
    caches = [KVCache(model.config, make_policy(policy_name, budget) if policy_name else None) for _ in range(2)]
    lean = LeanDecoder(model)
    out = [[], []]
    with torch.no_grad():
        for c in caches:
            prefill(model, x[:, :n_prompt], c)
        for t in range(n_prompt, x.shape[1]):
            out[0].append(decode_step(model, x[:, t], caches[0]))
            out[1].append(lean.step(x[:, t], caches[1]))
    return torch.stack(out[0], 1), torch.stack(out[1], 1), caches


@pytest.mark.parametrize("name", [None, *sorted(METHODS)])
def test_lean_step_equals_decode_step(make_model, name):
    model = make_model(preset("TINY"), seed=1)
    x = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(0))
    ref, lean, caches = steps_both(model, x, name)
    torch.testing.assert_close(lean, ref, rtol=0, atol=1e-5)
    a, b = caches
    assert a.seen == b.seen
    for la, lb in zip(a.layers, b.layers):          # the policy kept the same entries in both caches
        assert torch.equal(la.pos, lb.pos)


@pytest.mark.parametrize("bias, qkv_bias", [(True, True), (False, True)])   # a llama with attention_bias; Qwen2
def test_lean_step_adds_the_biases(make_model, bias, qkv_bias):
    model = make_model(preset("TINY", bias=bias, qkv_bias=qkv_bias), seed=4)
    with torch.no_grad():                       # make_model leaves the biases at zero: draw them too
        for i, (name, p) in enumerate(model.named_parameters()):
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    assert LeanDecoder(model).biased
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    ref, lean, _ = steps_both(model, x, "snapkv")
    torch.testing.assert_close(lean, ref, rtol=0, atol=1e-5)
    assert not torch.allclose(ref, steps_both(make_model(preset("TINY"), seed=4), x, "snapkv")[0])


@pytest.mark.parametrize("name", ["h2o", "kvreviver"])
def test_lean_step_normalises_qwen3s_queries_and_keys(make_model, name):
    """Qwen3's RMSNorm of each head's q and k (weights drawn, not ones), with a head size of its own (32, where
    TINY's d_model / n_head is 16): the lean step's logits and kept entries are decode_step's."""
    model = make_model(preset("TINY", qk_norm=True, d_head=32), seed=5)
    with torch.no_grad():
        for i, (n, p) in enumerate(model.named_parameters()):
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    assert LeanDecoder(model).qk_norms is not None
    x = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(0))
    ref, lean, (a, b) = steps_both(model, x, name)
    torch.testing.assert_close(lean, ref, rtol=0, atol=1e-5)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.pos, lb.pos)


def test_lean_generate_equals_generate(make_model):
    model = make_model(preset("TINY"), seed=2)
    x = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(LeanDecoder(model).generate(x, 12), generate(model, x, 12))


def test_bundled_model(make_model):
    from nanollm import load
    model, _, _ = load("retrieval-llama")
    x = torch.randint(0, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(3))
    ref, lean, _ = steps_both(model, x, "snapkv", budget=32, n_prompt=60)
    torch.testing.assert_close(lean, ref, rtol=0, atol=1e-5)


def test_clear_errors(make_model):
    with pytest.raises(ValueError, match="llama-flavour model with the standard attention"):
        LeanDecoder(make_model(preset("TINY_GPT2")))
    model = make_model(preset("TINY", max_seq_len=12))
    lean = LeanDecoder(model)
    with pytest.raises(ValueError, match="already holds a prefix"):
        lean.step(torch.tensor([1]), KVCache(model.config))
    with pytest.raises(ValueError, match="max_seq_len"):
        lean.generate(torch.zeros(1, 10, dtype=torch.long), 5)


@pytest.mark.parametrize("B,H,H_kv,T", [(1, 9, 3, 100), (2, 4, 2, 37), (3, 8, 8, 5), (2, 6, 1, 64)])
def test_attend_heads_is_attend_step(B, H, H_kv, T):
    """One (row, KV head) at a time: the same output as the batched step, to float rounding."""
    g = torch.Generator().manual_seed(T)
    q = torch.randn(B, H, 1, 16, generator=g)
    k, v = torch.randn(B, H_kv, T, 16, generator=g), torch.randn(B, H_kv, T, 16, generator=g)
    torch.testing.assert_close(attend_heads(q, k, v), attend_step(q, k, v)[0], rtol=0, atol=1e-6)


def test_lean_step_with_several_threads(make_model, monkeypatch):
    """With more than one thread and a long enough cache the plain cache's attention goes through
    attend_heads (here from 12 tokens on): still what decode_step computes."""
    import fastpath.lean as lean
    model = make_model(preset("TINY"), seed=1)
    x = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(0))
    calls = []
    monkeypatch.setattr(lean, "SPLIT_HEADS_FROM", 12)
    monkeypatch.setattr(lean, "attend_heads", lambda q, k, v: calls.append(k.shape[2]) or attend_heads(q, k, v))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ref, out, _ = steps_both(model, x)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert min(calls) == 12 and len(calls) == model.config.n_layer * (30 - 11)     # cache lengths 12..30
