"""fastpath/attention.py: the decode step without a mask is the reading path's ``attend`` with an all-True
mask (bit for bit on CPU), and the cache gives the same logits through ``FastAttention``."""

import pytest
import torch

from fastpath.attention import FastAttention, attend_entries, attend_step
from methods import METHODS, make_policy
from nanollm import KVCache, LayerKV, preset
from nanollm.attention import attend
from nanollm.generation import prefill
from nanollm.policy import Needs


@pytest.mark.parametrize("needs", [Needs(), Needs(rows=1), Needs(col_sums=True), Needs(rows=1, col_sums=True)])
def test_mask_free_step_is_attend_with_nothing_masked(needs):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 8, generator=g)
    k, v = torch.randn(2, 2, 30, 8, generator=g), torch.randn(2, 2, 30, 8, generator=g)
    pos = torch.randperm(30, generator=g).expand(2, 2, 30)                    # any order, all in the past
    for a, b in zip(attend_step(q, k, v, needs), attend(q, k, v, torch.tensor([30]), pos, needs)):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("pos", [[[0, 1, 2, 3, 4, 5], [0, 2, 4, -1, -1, -1]],     # empty slots
                                 [[0, 1, 2, 3, 4, 5], [0, 2, 4, 7, 9, 5]]])      # entries after the query
def test_a_decode_step_hides_what_the_reading_path_hides(pos):
    """Empty slots and positions after the query's (5) get no attention, as in ``attend``, bit for bit."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 1, 8, generator=g)
    entries = LayerKV(torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g),
                      torch.tensor([pos]))
    out, probs, _ = attend_entries(q, entries, torch.tensor([5]), Needs(rows=1))
    ref, ref_probs, _ = attend(q, entries.k, entries.v, torch.tensor([5]), entries.pos, Needs(rows=1))
    assert torch.equal(out, ref) and torch.equal(probs, ref_probs)
    assert probs[0, 2:, 0, 3:5].sum() == 0                  # KV head 1: slots 3 and 4 hidden in both


@pytest.mark.parametrize("name", sorted(METHODS))
def test_fast_attention_gives_the_reading_paths_numbers(make_model, name):
    """Every policy's decode steps through ``FastAttention``: the same logits and kept positions, bit for bit."""
    model = make_model(preset("TINY"), seed=2)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    caches = [KVCache(model.config, make_policy(name, 10)) for _ in range(2)]
    for cache in caches:
        prefill(model, x[:, :12], cache)
    fast = [FastAttention(block.attn) for block in model.blocks]
    for t in range(12, 24):
        logits = [step(model, x[:, t], caches[0], None), step(model, x[:, t], caches[1], fast)]
        assert torch.equal(logits[0], logits[1]), t
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.pos, b.pos)


def step(model, token, cache, fast):
    """One decode step by hand, each layer's cache.attend handed ``fast[i]`` instead of the module."""
    from nanollm.attention import apply_rope, rope_cos_sin
    with torch.no_grad():
        x = model.tok_emb(token[:, None])
        pos = torch.tensor([cache.seen])
        cos, sin = rope_cos_sin(pos, model.inv_freq, x.dtype)
        for i, block in enumerate(model.blocks):
            a, h = block.attn, block.attn_norm(x)
            B, H, H_kv, d = 2, a.config.n_head, a.config.n_kv_head, a.config.head_dim
            q = apply_rope(a.q_proj(h).view(B, 1, H, d).transpose(1, 2), cos, sin)
            k = apply_rope(a.k_proj(h).view(B, 1, H_kv, d).transpose(1, 2), cos, sin)
            v = a.v_proj(h).view(B, 1, H_kv, d).transpose(1, 2)
            y = cache.attend(i, a if fast is None else fast[i], q, pos, (k, v))
            x = x + a.o_proj(y.transpose(1, 2).reshape(B, 1, H * d))
            x = x + block.mlp(block.mlp_norm(x))
        cache.seen += 1
        return model.lm_head(model.final_norm(x))
