"""The skinny step (fastpath/skinny.py): the fused step with its products in the skinny kernel, the same logits
and the same kept entries as the lean step."""

from types import SimpleNamespace

import pytest
import torch

import fastpath.fused as fused_module
import fastpath.skinny as skinny_module
import kernels
from fastpath.fused import FusedGraphDecoder
from fastpath.skinny import SkinnyGraphDecoder
from tests.conftest import one_fast
from tests.fastpath.test_graph import assert_lean_logits, assert_same_entries, steps_both, tokens

STEPS = 4                   # decode steps compared in the interpreter (each launches every kernel of every layer)
interpreter = pytest.mark.skipif(not kernels.HAS_TRITON or not kernels.interpreting(),
                                 reason="needs Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py "
                                        "without a GPU)")


def with_norm_weights(model):
    """The model with every norm's weight drawn around 1 (the fixtures keep them at 1, where a step that took
    one norm's weight for another's would go unseen)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def counting(monkeypatch, names):
    """Each launcher of ``names`` in fastpath.skinny wrapped to count its calls; the counts."""
    calls = {name: 0 for name in names}
    for name in names:
        real = getattr(skinny_module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(skinny_module, name, counted)
    return calls


@interpreter
@pytest.mark.parametrize("spec", one_fast("h2o", None, "snapkv", "streaming_llm", "scissorhands"))
def test_the_skinny_step_is_the_lean_step(make_model, tiny_cfg, spec, monkeypatch):
    """Where ``kernels.serves`` says so (patched here to take CPU tensors, through the interpreter), every
    product of every step is the skinny kernel's: per layer one norm_qkv_rope_write (q/k/v, RoPE and the write
    into the buffers; the step's own write never runs), two linear_add (o_proj, down) and one norm_swiglu, and
    one norm_linear for the LM head; the logits within 1e-5 of the lean step's in fp32 over 4 steps (the
    evicting methods, at a budget of 12, evict at each), the kept positions equal (the evicting methods on their
    own kernels too). Every norm has a weight of its own, so that one taken for another shows."""
    calls = counting(monkeypatch, ["norm_qkv_rope_write_triton", "norm_linear_triton", "norm_swiglu_triton",
                                   "linear_add_triton"])
    serves = SimpleNamespace(serves=lambda t: True)
    monkeypatch.setattr(skinny_module, "kernels", serves)
    monkeypatch.setattr(fused_module, "kernels", serves)
    torch._dynamo.reset()
    model = with_norm_weights(make_model(tiny_cfg, seed=0))
    skinny = SkinnyGraphDecoder(model, backend="eager")
    skinny.write = lambda *args: pytest.fail("the skinny step wrote its entry a second time")
    ref, out, cache, graph = steps_both(model, tokens(STEPS + 20), spec, graph=skinny)     # a prompt of 20
    L = model.config.n_layer
    assert calls == {"norm_qkv_rope_write_triton": STEPS * L, "norm_linear_triton": STEPS,
                     "norm_swiglu_triton": STEPS * L, "linear_add_triton": STEPS * 2 * L}
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert_same_entries(cache, graph)


def test_where_the_kernels_do_not_serve_it_is_the_fused_step(tiny_model):
    """On a CPU (no patch) the skinny step is the fused step, to the last bit."""
    torch._dynamo.reset()
    _, a, _, _ = steps_both(tiny_model, tokens(), "h2o", graph=FusedGraphDecoder(tiny_model, backend="eager"))
    _, b, _, _ = steps_both(tiny_model, tokens(), "h2o", graph=SkinnyGraphDecoder(tiny_model, backend="eager"))
    assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,spec", [(torch.float32, None), (torch.float32, "snapkv"), (torch.bfloat16, "snapkv"),
                                        (torch.float32, "h2o"), (torch.float32, "streaming_llm"),
                                        (torch.float32, "scissorhands"), (torch.bfloat16, None)])
def test_the_skinny_step_captured_on_a_gpu(make_model, tiny_cfg, dtype, spec):
    """Captured with the rest of the step and replayed: the lean step's logits (fp32 within 1e-5, bf16 within
    the graph step's tolerance) and, in fp32, its kept positions (Scissorhands in fp32 only: in bf16 a slot
    near its threshold may flag otherwise, as in the fused step's tests)."""
    torch._dynamo.reset()
    model = with_norm_weights(make_model(tiny_cfg, seed=1)).cuda().to(dtype)
    skinny = SkinnyGraphDecoder(model)
    ref, out, cache, graph = steps_both(model, tokens(34, 3).cuda(), spec, graph=skinny)
    assert graph.captures == 1
    assert_lean_logits(out, ref, dtype)
    if dtype == torch.float32:
        assert_same_entries(cache, graph)
