"""The switch: the fast paths take the kernels where ``kernels.serves`` says so (CUDA + Triton).

``serves`` itself: false on a CPU tensor (the interpreter is for the tests, never for the library), false
with ``NANOKV_NO_TRITON=1`` or without Triton, true on an sm_80+ GPU. On a machine without a GPU the switch
is then patched to serve CPU tensors too, so the same paths run through Triton's interpreter here and must
give what the reading path gives: the lean decode step (``fastpath/``, with and without a policy), a
tensor-attention decode step over the four-matrix cache (``fastpath/tensor.py``), and KVReviver's sketch on
``fastpath.sketch``.
"""

from types import SimpleNamespace

import pytest
import torch

import kernels
from fastpath.lean import LeanDecoder
from fastpath.sketch import use_kernels
from fastpath.tensor import tensor_cache as kernel_tensor_cache
from methods import make_policy
from methods.tensor_attention import TENSOR_ATTENTION, tensor_cache
from nanollm import KVCache, Transformer, preset
from nanollm.generation import decode_step, prefill

through_kernels = pytest.mark.skipif(
    not kernels.HAS_TRITON or not (kernels.interpreting() or torch.cuda.is_available()),
    reason="no way to run a Triton kernel: triton is not installed, or there is no CUDA device and "
           "TRITON_INTERPRET is not 1")


# ----------------------------------------------------------------------------------------------------------
# The switch itself


def test_serves_no_cpu_tensor():
    """Not even under TRITON_INTERPRET=1: the interpreter is far too slow for a model."""
    assert not kernels.serves(torch.zeros(2, 16))


@pytest.fixture
def a_gpu(monkeypatch):
    """A stand-in for a tensor on CUDA device 0 (compute capability major 9), Triton importable."""
    monkeypatch.setattr(kernels, "HAS_TRITON", True)
    monkeypatch.setattr(kernels, "_properties", lambda index: (9, 132))
    monkeypatch.delenv("NANOKV_NO_TRITON", raising=False)
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))


def test_serves_a_cuda_tensor_of_a_recent_gpu(a_gpu, monkeypatch):
    assert kernels.serves(a_gpu)
    monkeypatch.setattr(kernels, "_properties", lambda index: (7, 80))       # sm_75: too old for the kernels
    assert not kernels.serves(a_gpu)


def test_serves_honours_the_opt_out(a_gpu, monkeypatch):
    monkeypatch.setenv("NANOKV_NO_TRITON", "1")
    assert not kernels.serves(a_gpu)
    monkeypatch.setenv("NANOKV_NO_TRITON", "0")
    assert kernels.serves(a_gpu)


def test_serves_nothing_without_triton(a_gpu, monkeypatch):
    monkeypatch.setattr(kernels, "HAS_TRITON", False)
    assert not kernels.serves(a_gpu)


# ----------------------------------------------------------------------------------------------------------
# The library through the kernels


@pytest.fixture
def kernels_everywhere(monkeypatch):
    """``serves`` patched to say yes wherever a kernel can run (CUDA, or the interpreter on a CPU); the
    shapes it was asked about are recorded."""
    calls = []

    def serves(t):
        calls.append(tuple(t.shape))
        return t.is_cuda or kernels.interpreting()
    monkeypatch.setattr(kernels, "serves", serves)
    return calls


def run(model, x, cache, step=None):
    step = step or (lambda t, c: decode_step(model, t, c))
    with torch.no_grad():
        logits = [prefill(model, x[:, :6], cache)[:, -1]]
        logits += [step(x[:, t], cache) for t in range(6, x.shape[1])]
    return torch.stack(logits, 1)


@through_kernels
@pytest.mark.parametrize("policy", [None, "snapkv"])
def test_lean_decode_step(kernels_everywhere, make_model, policy):
    model = make_model(preset("TINY"), seed=0)
    x = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model.config, policy and make_policy(policy, 64))
    out = run(model, x, cache, LeanDecoder(model).step)
    assert kernels_everywhere
    torch.testing.assert_close(out, model(x)[:, 5:], rtol=0, atol=1e-5)


@through_kernels
def test_tensor_attention_decode_step(kernels_everywhere):
    torch.manual_seed(0)
    model = Transformer(preset("TINY_GPT2", attention=TENSOR_ATTENTION, max_seq_len=32)).eval()
    x = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    out = run(model, x, kernel_tensor_cache(model.config))
    assert kernels_everywhere
    torch.testing.assert_close(out, model(x)[:, 5:], rtol=0, atol=1e-5)
    kernels_everywhere.clear()
    run(model, x, tensor_cache(model.config, "four"))                  # the library's own cache: PyTorch only
    assert not kernels_everywhere


@pytest.mark.slow
@through_kernels
def test_kvreviver_sketch(kernels_everywhere, monkeypatch, make_model):
    model = make_model(preset("TINY"), seed=0)
    x = torch.randint(0, 512, (1, 90), generator=torch.Generator().manual_seed(2))
    with_kernels = run(model, x, KVCache(model.config, use_kernels(make_policy("kvreviver", 64))))
    assert (3, 2, 2, 16) in kernels_everywhere         # the sketch's cells (r, b, H_kv, d) went through
    monkeypatch.setattr(kernels, "serves", lambda t: False)
    without = run(model, x, KVCache(model.config, make_policy("kvreviver", 64)))
    torch.testing.assert_close(with_kernels, without, rtol=0, atol=1e-4)


@through_kernels
@pytest.mark.parametrize("engine", [pytest.param("fast", marks=pytest.mark.slow), "batched"])
def test_the_evaluation_sketches_on_the_kernels_where_they_serve(monkeypatch, engine):
    """The fast engines give KVReviver the sketch's kernels where they serve (``use_kernels_on``, patched here
    for the sketch alone): its records are those of the PyTorch sketch, to float rounding (the atomic adds sum
    in another order). A wrapped KVReviver is reached; an ablation's own sketch is left alone. (In the fast
    tier with the batched engine, so that ``fastpath/gpu_check.sh``'s tests stage runs it on a GPU.)"""
    import fastpath.sketch
    from experiments.analysis.kvreviver_ablation import CentredSketch
    from experiments.evaluation import agree, compare
    from experiments.evaluation.protocol import Probe
    from nanollm import load
    from nanollm.data.evaluate import MODES

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok, _ = load("retrieval-llama", device=device)

    def records(kernels_serve: bool) -> list[dict]:
        queried = []
        query = fastpath.sketch.KernelSketch.query

        def counted(self, pos):
            queried.append(len(pos))
            return query(self, pos)
        with monkeypatch.context() as m:
            serves = (lambda t: t.is_cuda or kernels.interpreting()) if kernels_serve else (lambda t: False)
            m.setattr(fastpath.sketch, "kernels", SimpleNamespace(serves=serves))
            m.setattr(fastpath.sketch.KernelSketch, "query", counted)
            out = compare.run(model, tok, compare.RunSpec(["kvreviver"], [32], ["niah_single_noise"], MODES[:1], 1, 128,
                              engine=engine, progress=False))
        assert bool(queried) == kernels_serve
        return out

    with_kernels, without = records(True), records(False)
    assert len(with_kernels) == len(without) == 2                  # the full cache and KVReviver
    for a, b in zip(with_kernels, without):
        assert a.keys() == b.keys()
        for key in a.keys() - {"compress_ms", "decode_ms_per_token"}:    # the times differ, of course
            if key in agree.CLOSE or isinstance(a[key], float):       # attn_l1: a list of them per layer
                assert agree.flat(a[key]) == pytest.approx(agree.flat(b[key]), rel=1e-5, abs=1e-5), key
            else:
                assert a[key] == b[key], key

    wrapped, own = Probe(make_policy("kvreviver", 64)), make_policy("kvreviver", 64)
    own.use_sketch(CentredSketch)
    fastpath.sketch.use_kernels(wrapped), fastpath.sketch.use_kernels(own)
    assert wrapped.inner.sketch_class is fastpath.sketch.KernelSketch and own.sketch_class is CentredSketch


def test_the_interpreter_problem_names_the_clash():
    """Triton before 3.7 under numpy 2.4 or later: its interpreter fails every kernel with a loop
    (triton-lang/triton#9171); any other pair of versions is fine."""
    said = kernels.interpreter_problem("3.6.0", "2.5.2")
    assert said and "triton-lang/triton#9171" in said and "triton>=3.7 or numpy<2.4" in said
    assert kernels.interpreter_problem("3.6.0", "2.3.5") is None
    assert kernels.interpreter_problem("3.7.0", "2.5.2") is None
    assert kernels.interpreter_problem("3.10.0+git1234", "2.4.0") is None     # 3.10 comes after 3.7
    assert kernels.interpreter_problem("3.2.0", "2.4.0rc1") is not None


if kernels.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_rows_kernel(x_ptr, y_ptr, n, HD, BLOCK: tl.constexpr):
        """Row t of x into y, t < n, with the two masks a scalar comparison makes: alone over a block, and
        joined to a block's."""
        t = tl.program_id(0)
        col = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + t * HD + col, mask=(col < HD) & (t < n), other=0.0)
        tl.store(y_ptr + t * HD + col, x, mask=t < n)


@through_kernels
def test_a_scalar_mask_runs_as_on_a_gpu():
    """``t < n`` of two scalars is an i1 on a GPU and int32 in Triton's interpreter, which refuses it as a mask
    ("mask has unsupported dtype", Triton 3.9): importing ``kernels`` makes the interpreter take it as a GPU
    does (``kernels.take_any_mask``), where a correct student kernel runs."""
    x = torch.arange(1.0, 25.0).view(3, 8)
    y = torch.zeros(3, 8)
    _copy_rows_kernel[(3,)](x, y, 2, 8, BLOCK=8)
    assert torch.equal(y[:2], x[:2]) and torch.equal(y[2], torch.zeros(8))
    kernels.take_any_mask()                                        # once: a second call wraps nothing again
    from triton.runtime.interpreter import InterpreterBuilder
    assert not hasattr(InterpreterBuilder.create_masked_load.unmended, "unmended")
