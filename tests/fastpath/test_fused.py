"""The fused graph step (fastpath/fused.py): the graph step with its element-wise work compiled, the same
logits and the same kept entries as the lean step."""

from types import SimpleNamespace

import pytest
import torch

import fastpath.fused as fused_module
import kernels
from fastpath.fused import FusedGraphDecoder
from tests.conftest import one_fast
from tests.fastpath.test_graph import assert_lean_logits, assert_same_entries, steps_both, tokens

STEPS = 7       # decode steps after a prompt of 20 where the kernels run in the interpreter (each launches them all)


@pytest.mark.parametrize("spec", one_fast("scissorhands", None, "snapkv", "streaming_llm", "h2o"))
def test_the_fused_step_is_the_lean_step(tiny_model, spec):
    """Traced by dynamo without generating code (backend "eager": the same functions, seconds on a CPU); fp32
    within 1e-5 over 14 steps, the kept positions equal after them."""
    torch._dynamo.reset()
    fused = FusedGraphDecoder(tiny_model, backend="eager")
    ref, out, cache, graph = steps_both(tiny_model, tokens(), spec, graph=fused)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert_same_entries(cache, graph)


@pytest.mark.skipif(not kernels.HAS_TRITON or not kernels.interpreting(),
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without a GPU)")
@pytest.mark.parametrize("spec", one_fast("h2o", None, "streaming_llm", "scissorhands"))
def test_the_writes_in_one_launch(tiny_model, spec, monkeypatch):
    """Where ``kernels.serves`` says so (patched here to take CPU tensors, through the interpreter), every
    layer's write is the one-launch kernel; the logits and the kept entries stay the lean step's."""
    calls = []
    real = fused_module.write_entry_triton

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)
    monkeypatch.setattr(fused_module, "write_entry_triton", counted)
    monkeypatch.setattr(fused_module, "kernels", SimpleNamespace(serves=lambda t: True))
    torch._dynamo.reset()
    fused = FusedGraphDecoder(tiny_model, backend="eager")
    ref, out, cache, graph = steps_both(tiny_model, tokens(STEPS + 20), spec, graph=fused)
    assert len(calls) == STEPS * tiny_model.config.n_layer                  # every layer of every step
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert_same_entries(cache, graph)


# each evicting method's kernels, the step's compiled piece they replace, and the option set beside the budget
EVICTING = {"h2o": ("heavy_attend_triton", "attend_heavy", "n_recent"),
            "scissorhands": ("scissors_attend_triton", "attend_scissors", "n_recent"),
            "streaming_llm": ("sinks_attend_triton", "evict_sinks", "n_sink")}


@pytest.mark.skipif(not kernels.HAS_TRITON or not kernels.interpreting(),
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without a GPU)")
@pytest.mark.parametrize("spec", one_fast(*sorted(EVICTING)))
@pytest.mark.parametrize("budget,option", one_fast((8, None), (12, 2), (8, 0)))
def test_evictions_use_what_the_attention_kernel_read(tiny_model, spec, budget, option, monkeypatch):
    """Where the kernels serve (patched as above), every layer of H2O's step is ``heavy_attend_triton`` (the
    split kernel keeping its scores, the merge, the update kernel), never ``attend_heavy``'s second pass;
    every layer of Scissorhands' is ``scissors_attend_triton`` (the same scores, the merge, its update
    kernel), never ``attend_scissors``; and every layer of StreamingLLM's is ``sinks_attend_triton`` (the
    split kernel keeping each range's oldest entry, the merge, the eviction kernel), never the compiled
    ``evict_sinks``; the logits within 1e-5 and the kept positions equal to the lean step's after every step
    (and Scissorhands' counters and ring buffer: ``steps_both``)."""
    launcher, replaced, name = EVICTING[spec]
    calls = []
    real = getattr(fused_module, launcher)

    def counted(*args):
        calls.append(args[1].shape)
        return real(*args)
    monkeypatch.setattr(fused_module, launcher, counted)
    monkeypatch.setattr(fused_module, "kernels", SimpleNamespace(serves=lambda t: True))
    torch._dynamo.reset()
    fused = FusedGraphDecoder(tiny_model, backend="eager")
    setattr(fused, replaced, None)                                          # a call to it fails
    options = {} if option is None else {name: option}
    ref, out, cache, graph = steps_both(tiny_model, tokens(STEPS + 20), spec, budget, graph=fused, **options)
    assert len(calls) == STEPS * tiny_model.config.n_layer
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert_same_entries(cache, graph)


@pytest.mark.skipif(not kernels.HAS_TRITON or not kernels.interpreting(),
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without a GPU)")
@pytest.mark.parametrize("options", one_fast({"history_window": 3}, {"history_window": 4, "threshold": 0.05}))
def test_scissorhands_kernel_with_a_wrapping_ring(tiny_model, options, monkeypatch):
    """Scissorhands through its kernels with a ring of 3 or 4 rows, which 7 steps wrap (each
    step's row overwrites flags still counted), the uniform level or a given tau: the lean step's logits,
    kept positions, counters and ring buffer after every step."""
    monkeypatch.setattr(fused_module, "kernels", SimpleNamespace(serves=lambda t: True))
    torch._dynamo.reset()
    fused = FusedGraphDecoder(tiny_model, backend="eager")
    fused.attend_scissors = None                                             # a call to it fails
    ref, out, cache, graph = steps_both(tiny_model, tokens(STEPS + 20), "scissorhands", 8, graph=fused, **options)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["streaming_llm", "h2o", "scissorhands"])
def test_the_fused_step_with_inductor(tiny_model, spec):
    """inductor (C++ on a CPU) generates the fused functions, the evictions' in-place writes included; they
    serve every layer (one compile each) and match the lean step."""
    torch._dynamo.reset()
    fused = FusedGraphDecoder(tiny_model)
    ref, out, cache, graph = steps_both(tiny_model, tokens(), spec, graph=fused)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert_same_entries(cache, graph)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype,spec,options", [(torch.float32, "snapkv", {}), (torch.bfloat16, "snapkv", {}),
                                                (torch.float32, "streaming_llm", {}), (torch.float32, "h2o", {}),
                                                (torch.float32, "scissorhands", {}),
                                                (torch.float32, "scissorhands", {"history_window": 3})])
def test_the_fused_step_captured_on_a_gpu(make_model, tiny_cfg, dtype, spec, options):
    """Compiled by inductor on the first eager step, captured with the rest of the step, replayed (the
    evictions on their kernels; Scissorhands also with a ring of 3 rows, which the steps wrap)."""
    torch._dynamo.reset()
    model = make_model(tiny_cfg, seed=1).cuda().to(dtype)
    fused = FusedGraphDecoder(model)
    ref, out, cache, graph = steps_both(model, tokens(34, 3).cuda(), spec, graph=fused, **options)
    assert graph.captures == 1
    assert_lean_logits(out, ref, dtype)
    if dtype == torch.float32:
        assert_same_entries(cache, graph)
