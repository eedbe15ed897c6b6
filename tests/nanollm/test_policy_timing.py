"""When compression happens relative to attention (the sentence in CachePolicy's docstring), tested."""

import torch

from nanollm import CachePolicy, KVCache, decode_step, extend, prefill
from nanollm.policy import Needs


class KeepNewest(CachePolicy):
    """Keeps only the newest entry of every layer after every hook; records what each step attended to."""

    def __init__(self):
        self.seen_by_attention = []       # (phase, layer, number of entries the step's queries saw)

    def needs(self, phase):
        return Needs(rows=1)

    def _keep_last(self, ctx):
        B, H_kv, T = ctx.kv.pos.shape
        ctx.kv.keep(torch.full((B, H_kv, 1), T - 1, dtype=torch.long))

    def on_prefill(self, ctx):
        self.seen_by_attention.append(("prefill", ctx.layer, ctx.probs.shape[-1]))
        self._keep_last(ctx)

    def on_decode(self, ctx):
        self.seen_by_attention.append(("decode", ctx.layer, ctx.probs.shape[-1]))
        self._keep_last(ctx)


def test_prompt_attention_is_exact_then_each_step_sees_what_was_kept(tiny_model):
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 20))
    full, policy = KVCache(tiny_model.config), KeepNewest()
    cache = KVCache(tiny_model.config, policy=policy)
    # prefill: every prompt query attends over the whole prompt, compression comes after, layer by layer
    assert torch.equal(prefill(tiny_model, ids, cache), prefill(tiny_model, ids, full))
    L = tiny_model.config.n_layer
    assert policy.seen_by_attention == [("prefill", i, 20) for i in range(L)]
    assert all(len(layer) == 1 for layer in cache.layers)
    # decode: the new token is appended before its attention (1 kept + 1 new), then the policy compresses
    decode_step(tiny_model, ids[:, 0], cache)
    assert policy.seen_by_attention[L:] == [("decode", i, 2) for i in range(L)]
    # extend: a chunk of 3 sees the kept entry and the whole chunk, causally
    extend(tiny_model, ids[:, :3], cache)
    assert policy.seen_by_attention[2 * L:] == [("decode", i, 4) for i in range(L)]
    assert all(len(layer) == 1 for layer in cache.layers) and cache.seen == 24
    assert all(layer.pos[0, 0, 0].item() == 23 for layer in cache.layers)     # positions stay true
