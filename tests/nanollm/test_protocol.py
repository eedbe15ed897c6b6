"""
The policy protocol's extension points, each exercised by a small policy or module written here:

* per-slot state in the storage moves with the entries (append, keep, padding);
* a policy that *rebuilds* entries in ``attend_kv`` gets probabilities and attended positions that line up;
* another attention module, with its own storage layout, plugs in through the config and decodes exactly
  as its uncached forward;
* method specs: one spelling for nested policies, options routed to the right policy, clear errors;
* layering: nanollm never imports methods, policy never imports the cache.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course.handout import repository_files
from methods import METHODS, make_policy, method_chain, method_options, scorers, wrappers
from methods.adakv import AdaKVPolicy
from methods.h2o import STATE, H2OPolicy
from methods.snapkv import SnapKVPolicy
from nanollm import CachePolicy, KVCache, LayerKV, decode_step, extend, generate, prefill, preset
from nanollm.attention import ATTENTION, attend, attention_class
from nanollm.policy import Needs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def ids(n: int, seed: int = 0, batch: int = 2, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------
# Per-slot state

def test_state_moves_with_entries_and_padding_gets_the_fill():
    kv = LayerKV()
    kv.append(torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 3), torch.arange(4))
    kv.set_state("score", torch.arange(8.0).view(1, 2, 4), fill=-1.0)
    kv.set_state("vec", torch.arange(16.0).view(1, 2, 4, 2), fill=0.5)         # trailing dims move too
    kv.append(torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 3), torch.tensor([4]))
    assert kv.state["score"].tolist() == [[[0, 1, 2, 3, -1], [4, 5, 6, 7, -1]]]  # new slot: the fill
    assert kv.state["vec"][0, 0, 4].tolist() == [0.5, 0.5]
    kv.keep(torch.tensor([[[4, 1, -1], [0, 2, 3]]]))                             # head 0 padded
    assert kv.pos.tolist() == [[[4, 1, -1], [0, 2, 3]]]
    assert kv.state["score"].tolist() == [[[-1, 1, -1], [4, 6, 7]]]
    assert kv.state["vec"][0, 0].tolist() == [[0.5, 0.5], [2, 3], [0.5, 0.5]]
    assert kv.state_nbytes() == 2 * 3 * 4 + 2 * 3 * 2 * 4
    with pytest.raises(ValueError, match="shape"):
        kv.set_state("bad", torch.zeros(1, 2, 5))


def test_h2o_scores_stay_aligned_under_adakv_padding(make_model):
    """H2O's accumulated scores live in the storage: under AdaKV's unequal heads (padded with empty slots)
    they follow their entries, and padded slots carry no score."""
    model = make_model(preset("TINY"), seed=0)
    policy = make_policy("adakv(h2o)", 10, alpha_safeguard=0.0)
    cache = KVCache(model.config, policy)
    prefill(model, ids(30), cache)
    for t in range(3):
        decode_step(model, ids(1, seed=10 + t)[:, 0], cache)
    padded = 0
    for layer in cache.layers:
        assert layer.state[STATE].shape == layer.pos.shape
        assert bool((layer.state[STATE][layer.pos < 0] == 0).all())
        assert int(layer.counts().sum(-1).max()) <= model.config.n_kv_head * 10
        padded += int((layer.pos < 0).sum())
    assert padded > 0, "the heads should have received unequal budgets on this model"


# ---------------------------------------------------------------------------------------------------------
# Rebuilt entries

class RebuildFirst(CachePolicy):
    """Evicts position 0 from the storage after prefill, keeps its K/V aside, and rebuilds it in
    ``attend_kv`` in front of the storage: attention sees the storage plus one rebuilt entry."""

    def needs(self, phase):
        return Needs(rows=None)

    def __init__(self) -> None:
        self.aside: dict[int, tuple] = {}
        self.seen_ctx: list = []

    def attend_kv(self, layer, store):
        if layer not in self.aside:
            return store
        k0, v0 = self.aside[layer]
        B, H_kv = store.pos.shape[:2]
        pos0 = torch.zeros(B, H_kv, 1, dtype=store.pos.dtype)
        return LayerKV(torch.cat([k0, store.k], 2), torch.cat([v0, store.v], 2), torch.cat([pos0, store.pos], 2))

    def on_prefill(self, ctx):
        self.seen_ctx.append((ctx.probs.shape, ctx.attended_pos.clone(), len(ctx.kv)))
        self.aside[ctx.layer] = (ctx.kv.k[:, :, :1].clone(), ctx.kv.v[:, :, :1].clone())
        B, H_kv, T = ctx.kv.pos.shape
        ctx.kv.keep(torch.arange(1, T).expand(B, H_kv, T - 1))

    def on_decode(self, ctx):
        self.seen_ctx.append((ctx.probs.shape, ctx.attended_pos.clone(), len(ctx.kv)))

    def reset(self):
        self.aside = {}


def test_rebuilt_entries_line_up_with_probs(tiny_model):
    model, x = tiny_model, ids(16, seed=1)
    full, rebuilt = KVCache(model.config), KVCache(model.config, RebuildFirst())
    ref = [prefill(model, x[:, :10], full)]
    out = [prefill(model, x[:, :10], rebuilt)]
    ref.append(extend(model, x[:, 10:13], full))
    out.append(extend(model, x[:, 10:13], rebuilt))
    for t in range(13, 16):
        ref.append(decode_step(model, x[:, t], full))
        out.append(decode_step(model, x[:, t], rebuilt))
    for a, b in zip(ref, out):          # the rebuilt entry is exact here, so logits match the full cache
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert all(len(layer) == 15 for layer in rebuilt.layers)   # storage: 16 tokens, position 0 set aside
    L = model.config.n_layer
    for shape, attended, stored in rebuilt.policy.seen_ctx[L:]:   # extend and decode steps
        assert shape[-1] == attended.shape[-1] == stored + 1     # probs over storage + 1 rebuilt entry
        assert bool((attended[..., 0] == 0).all())               # ... which is position 0, in front
        assert bool((attended[..., 1:] >= 1).all())


def test_rebuilt_probs_are_the_full_attention_on_those_positions(tiny_model):
    """The probabilities a rebuilding policy receives refer to the rebuilt layout: slot 0 is position 0."""

    class Capture(RebuildFirst):
        def on_decode(self, ctx):
            self.probs = getattr(self, "probs", {})
            self.probs[ctx.layer] = (ctx.probs.clone(), ctx.attended_pos.clone())

    class FullCapture(CachePolicy):
        def needs(self, phase):
            return Needs(rows=None)

        def on_decode(self, ctx):
            self.probs = getattr(self, "probs", {})
            self.probs[ctx.layer] = ctx.probs.clone()

    x = ids(12, seed=2)
    a, b = KVCache(tiny_model.config, FullCapture()), KVCache(tiny_model.config, Capture())
    for cache in (a, b):
        prefill(tiny_model, x[:, :11], cache)
        decode_step(tiny_model, x[:, 11], cache)
    for layer in range(tiny_model.config.n_layer):
        probs, attended = b.policy.probs[layer]
        assert attended[0, 0].tolist() == list(range(12))       # rebuilt position 0, then the storage 1..11
        torch.testing.assert_close(probs, a.policy.probs[layer], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Another attention module: keys stored as two factors (k = ka * kb), through config.attention

class FactorKV:
    """Storage of ``FactoredKeyAttention``: two key factors ka, kb and values, (B, H_kv, T, d) each."""

    def __init__(self) -> None:
        self.ka = self.kb = self.v = self.pos = None

    def __len__(self) -> int:
        return 0 if self.ka is None else self.ka.shape[2]

    def append(self, ka, kb, v, pos) -> None:
        B, H_kv, Tn, _ = ka.shape
        p = pos.view(1, 1, Tn).expand(B, H_kv, Tn)
        if self.ka is None:
            self.ka, self.kb, self.v, self.pos = ka, kb, v, p.clone()
        else:
            self.ka, self.kb = torch.cat([self.ka, ka], 2), torch.cat([self.kb, kb], 2)
            self.v, self.pos = torch.cat([self.v, v], 2), torch.cat([self.pos, p], 2)

    def nbytes(self) -> int:
        return 0 if self.ka is None else self.ka.nbytes + self.kb.nbytes + self.v.nbytes

    def state_nbytes(self) -> int:
        return 0


class FactoredKeyAttention(nn.Module):
    """Attention whose key is the elementwise product of two projections; no positional rotation."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        H, H_kv, d, D = config.n_head, config.n_kv_head, config.head_dim, config.d_model
        self.q_proj, self.o_proj = nn.Linear(D, H * d, bias=False), nn.Linear(H * d, D, bias=False)
        self.ka_proj, self.kb_proj = nn.Linear(D, H_kv * d, bias=False), nn.Linear(D, H_kv * d, bias=False)
        self.v_proj = nn.Linear(D, H_kv * d, bias=False)

    @classmethod
    def new_storage(cls, config) -> FactorKV:
        return FactorKV()

    @staticmethod
    def attend_entries(q, entries, q_pos, needs=Needs()):
        return attend(q, entries.ka * entries.kb, entries.v, q_pos, entries.pos, needs)

    def forward(self, x, pos, rope, cache=None):
        B, T, _ = x.shape
        H, H_kv, d = self.config.n_head, self.config.n_kv_head, self.config.head_dim
        q = self.q_proj(x).view(B, T, H, d).transpose(1, 2)
        ka, kb, v = (p(x).view(B, T, H_kv, d).transpose(1, 2) for p in (self.ka_proj, self.kb_proj, self.v_proj))
        if cache is None:
            y = F.scaled_dot_product_attention(q, ka * kb, v, is_causal=True, enable_gqa=H_kv != H)
        else:
            y = cache.attend(self.layer_idx, self, q, pos, (ka, kb, v))
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * d))


@pytest.fixture(params=["registered", "path"])
def factored_model(request, monkeypatch, make_model):
    if request.param == "registered":
        monkeypatch.setitem(ATTENTION, "factored", FactoredKeyAttention)
        name = "factored"
    else:
        name = f"{__name__}:FactoredKeyAttention"       # a module the package does not know about
    model = make_model(preset("TINY", attention=name), seed=3)
    assert all(isinstance(b.attn, FactoredKeyAttention) for b in model.blocks)
    return model


def test_other_attention_module_decodes_like_its_forward(factored_model):
    model, x = factored_model, ids(20, seed=4)
    full = model(x)                                                          # uncached forward
    cache = KVCache(model.config)
    assert all(isinstance(layer, FactorKV) for layer in cache.layers)
    steps = [prefill(model, x[:, :12], cache), extend(model, x[:, 12:15], cache)]
    steps += [decode_step(model, x[:, t], cache)[:, None] for t in range(15, 20)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)
    d = model.config.head_dim
    assert cache.nbytes() == 3 * 4 * d * model.config.n_kv_head * 2 * 20 * model.config.n_layer
    # and through a policy's hooks: the full-cache policy, recorded
    cache = KVCache(model.config, make_policy("full", 99))
    prefill(model, x[:, :12], cache)
    torch.testing.assert_close(decode_step(model, x[:, 12], cache), full[:, 12], rtol=0, atol=1e-5)
    # generate runs unchanged
    out = generate(model, x[:, :8], max_new_tokens=5)
    ref = x[:, :8]
    for _ in range(5):
        ref = torch.cat([ref, model(ref)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref[:, 8:])


def test_unknown_attention_module_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention module 'nope'"):
        attention_class("nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        attention_class("no_such_package.mod:Cls")
    with pytest.raises(ValueError, match="has no new_storage"):
        attention_class("torch.nn:Linear")
    with pytest.raises(ValueError, match="attention"):
        preset("TINY", attention="")


# ---------------------------------------------------------------------------------------------------------
# Method specs: one spelling in Python, on the command line, in the records

def test_spec_spellings_build_the_same_policy():
    a = make_policy("adakv(h2o)", 16, alpha_safeguard=0.5, n_recent=4)
    b = make_policy("adakv", 16, inner="h2o", alpha_safeguard=0.5, n_recent=4)
    c = AdaKVPolicy(budget=16, alpha_safeguard=0.5, inner=H2OPolicy(budget=16, n_recent=4))
    assert a == b == c
    assert make_policy("adakv", 16, window=8) == AdaKVPolicy(16, inner=SnapKVPolicy(16, window=8))
    assert method_chain("adakv") == ["adakv", "snapkv"] and method_chain(" adakv( h2o ) ") == ["adakv", "h2o"]
    assert method_options("adakv(h2o)") == ["alpha_safeguard", "n_recent"]


def test_wrapper_forwards_what_the_inner_policy_needs():
    for scorer in scorers():
        inner = make_policy(scorer, 16)
        outer = make_policy(f"adakv({scorer})", 16)
        assert outer.needs("prefill") == inner.needs("prefill") and outer.needs("decode") == inner.needs("decode")
        assert outer.compress_on == inner.compress_on
        assert outer.slack(40, 5) == inner.slack(40, 5)
        assert outer.protected_positions(40, 45) == inner.protected_positions(40, 45)


@pytest.mark.parametrize("spec,match", [
    ("adakv(full)", "does not score"), ("snapkv(h2o)", "not a wrapper"), ("adakv(h2o", "unbalanced"),
    ("adakv(nope)", "unknown method 'nope'"), ("adakv()", "unknown method ''"),
])
def test_bad_specs_are_clear_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        make_policy(spec, 8)


def test_wrapper_checks_its_inner_policy():
    with pytest.raises(ValueError, match="inner budget"):
        AdaKVPolicy(budget=8, inner=SnapKVPolicy(budget=9))
    with pytest.raises(ValueError, match="scoring policy"):
        AdaKVPolicy(budget=8, inner=make_policy("full", 8))
    with pytest.raises(ValueError, match="n_recent"):         # an inner option, checked by the inner policy
        make_policy("adakv(h2o)", 8, n_recent=9)


def test_registry_lists_scorers_and_wrappers():
    assert set(scorers()) | set(wrappers()) <= set(METHODS) - {"full"}
    assert {"streaming_llm", "h2o", "snapkv"} <= set(scorers()) and "adakv" in wrappers()
    assert not set(scorers()) & set(wrappers())


# ---------------------------------------------------------------------------------------------------------
# Layering and references

def imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_nanollm_never_imports_methods():
    for path in (ROOT / "nanollm").glob("*.py"):
        assert not any(n == "methods" or n.startswith("methods.") for n in imports(path)), path.name


def test_policy_does_not_import_the_cache():
    assert not any(n.endswith("cache") for n in imports(ROOT / "nanollm" / "policy.py"))
    assert not any(n.endswith("cache") for n in imports(ROOT / "nanollm" / "storage.py"))


@pytest.mark.slow
def test_no_file_cites_documents_outside_the_repository():
    """Code and docs cite the papers; the project's private design notes are not part of the repository."""
    pattern = re.compile(r"specs?/methods|spec [§]|STYLE\.md|PERF\.md|DESIGN\.md|\.\./shared|seed 00[0-4]")
    offenders = []
    for name in repository_files():                   # what git would commit, with or without git here
        if name.endswith((".py", ".md", ".ipynb", ".json", ".txt", ".ini")):
            text = (ROOT / name).read_text(errors="ignore")
            offenders += [f"{name}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not offenders, offenders
