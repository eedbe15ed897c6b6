"""``experiments.analysis.key_norm``: the shares by hand (a query head reads KV head h // group), the recorded
row is the prompt's last query's attention recomputed from its queries and keys, and the command refuses bad
input before loading a model. The committed tables re-run in tests/test_results_reproduce.py."""

from __future__ import annotations

import math

import pytest
import torch

from experiments.analysis import key_norm
from experiments.analysis.key_norm import LastQuery, kept_shares, rank_correlation
from nanollm import generate
from tests.commands import refused


def test_the_shares_by_hand():
    norms = torch.tensor([[1.0, 4.0, 2.0, 3.0],          # KV head 0: smallest norms at 0 and 2
                          [5.0, 1.0, 3.0, 2.0]])         # KV head 1: smallest at 1 and 3
    probs = torch.tensor([[0.4, 0.1, 0.2, 0.3],          # query heads 0 and 1 read KV head 0
                          [0.2, 0.1, 0.4, 0.3],
                          [0.7, 0.1, 0.1, 0.1],          # query heads 2 and 3 read KV head 1
                          [0.5, 0.3, 0.1, 0.1]])
    shares = kept_shares(norms, probs, budget=2)
    # KV head 0 sees [0.3, 0.1, 0.3, 0.3]; KV head 1 sees [0.6, 0.2, 0.1, 0.1]
    assert torch.allclose(shares["smallest norm"], torch.tensor([0.6, 0.3]))
    assert torch.allclose(shares["smallest but 1st"], torch.tensor([0.6, 0.3]))   # keys 2, 3 and 1, 3
    assert torch.allclose(shares["largest norm"], torch.tensor([0.4, 0.7]))
    assert torch.allclose(shares["most attended"], torch.tensor([0.6, 0.8]))
    assert torch.allclose(shares["random"], torch.tensor([0.5, 0.5]))
    assert torch.allclose(shares["first key"], torch.tensor([0.3, 0.6]))
    assert list(shares) == list(key_norm.COLUMNS)


def test_rank_correlation():
    a = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0]])
    b = torch.tensor([[10.0, 20.0, 30.0, 40.0], [4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    # Spearman's rho = 1 - 6 sum d^2 / (n (n^2 - 1)); the third pair swaps two ranks: d^2 sums to 2
    assert torch.allclose(rank_correlation(a, b), torch.tensor([1.0, -1.0, 1 - 6 * 2 / (4 * 15)]))
    # values that are not ranks, ordered by a permutation that is not its own inverse: ranks [0, 3, 1, 4, 2] and
    # [2, 0, 3, 1, 4], d^2 sums to 30 (a single argsort gives 0.0 here, Pearson's r on the values -0.62)
    a, b = torch.tensor([0.1, 5.0, 0.2, 9.0, 0.3]), torch.tensor([3.0, 1.0, 4.0, 1.5, 9.0])
    assert torch.allclose(rank_correlation(a, b), torch.tensor(1 - 6 * 30 / (5 * 24)))


class Checked(LastQuery):
    """Also recomputes the last query's attention from the step's queries and stored keys, and the keys' norms
    from each layer's input (``inputs``, layer -> (1, T, D), which forward hooks fill)."""

    def __init__(self, inputs: dict):
        super().__init__()
        self.inputs = inputs

    def on_prefill(self, ctx):
        super().on_prefill(ctx)
        q, k = ctx.q[0, :, -1], ctx.kv.k[0]                                    # (H, d), (H_kv, T, d)
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)              # (H, T, d): head h reads h // G
        expected = torch.softmax(torch.einsum("hd,htd->ht", q, k) / math.sqrt(q.shape[-1]), dim=-1)
        assert torch.allclose(self.probs[ctx.layer], expected, atol=1e-6), ctx.layer
        keys = ctx.attn.k_proj(self.inputs[ctx.layer][0])                         # (T, H_kv * d), before RoPE
        norms = keys.view(keys.shape[0], ctx.config.n_kv_head, -1).norm(dim=-1).T      # (H_kv, T): RoPE rotates
        assert torch.allclose(self.norms[ctx.layer], norms, atol=1e-5), ctx.layer     # pairs, keeping norms


def test_the_recorded_row_is_the_last_querys_attention(tiny_model):
    inputs = {}
    hooks = [block.attn.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0]))
             for i, block in enumerate(tiny_model.blocks)]
    rec = Checked(inputs)
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    try:
        generate(tiny_model, ids, max_new_tokens=1, policy=rec)
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(rec.probs) == list(range(tiny_model.config.n_layer))
    for layer, norms in rec.norms.items():
        assert norms.shape == (tiny_model.config.n_kv_head, 40)
        assert rec.probs[layer].shape == (tiny_model.config.n_head, 40)


@pytest.mark.parametrize("args, message", [
    (["--keep", "1"], "--keep must lie in (0, 1), got 1.0"),
    (["--length", "1"], "--length must be in [2, "),
    (["--length", "100000"], "(the model's maximum positions), got 100000"),
    (["--length", "8"], "--length 8, task niah_single_noise: "),
])
def test_the_command_refuses(capsys, monkeypatch, args, message):
    monkeypatch.setattr(key_norm, "load", lambda *a, **k: pytest.fail("loaded a model before refusing"))
    assert message in refused(capsys, key_norm.main, args)
