"""The switch: the library's hot paths take the kernels where ``kernels.serves`` says so (CUDA + Triton).

On a machine without a GPU the switch is patched to serve CPU tensors too, so the same paths run through
Triton's interpreter here and must give what the PyTorch paths give: a decode step of the nanollm decoder,
a tensor-attention decode step over the four-matrix cache, and KVReviver's sketch insert and query.
"""

import pytest
import torch

import kernels
import nanollm.attention
from methods import make_policy
from methods.tensor_attention import TENSOR_ATTENTION, tensor_cache
from nanollm import KVCache, Transformer, preset
from nanollm.generation import decode_step, prefill

pytestmark = pytest.mark.skipif(not kernels.HAS_TRITON or not kernels.use_triton(torch.zeros(1)),
                                reason="triton is not installed (or the interpreter is off on this CPU)")


@pytest.fixture
def kernels_everywhere(monkeypatch):
    calls = []

    def serves(t):
        calls.append(tuple(t.shape))
        return kernels.use_triton(t)
    monkeypatch.setattr(kernels, "serves", serves)
    monkeypatch.setattr(nanollm.attention, "kernel_serves", serves)
    return calls


def run(model, x, cache):
    with torch.no_grad():
        logits = [prefill(model, x[:, :6], cache)[:, -1]]
        logits += [decode_step(model, x[:, t:t + 1], cache) for t in range(6, x.shape[1])]
    return torch.stack(logits, 1)


def test_decoder_decode_step(kernels_everywhere, make_model):
    model = make_model(preset("TINY"), seed=0)
    x = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = run(model, x, KVCache(model.config))         # recorded before: the patch is active for both runs,
    assert kernels_everywhere                          # so compare against the uncached forward instead
    torch.testing.assert_close(ref, model(x)[:, 5:], rtol=0, atol=1e-5)


def test_tensor_attention_decode_step(kernels_everywhere):
    torch.manual_seed(0)
    model = Transformer(preset("TINY_GPT2", attention=TENSOR_ATTENTION, max_seq_len=32)).eval()
    x = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    out = run(model, x, tensor_cache(model.config, "four"))
    assert kernels_everywhere
    torch.testing.assert_close(out, model(x)[:, 5:], rtol=0, atol=1e-5)


def test_kvreviver_sketch(kernels_everywhere, monkeypatch, make_model):
    model = make_model(preset("TINY"), seed=0)
    x = torch.randint(0, 512, (1, 90), generator=torch.Generator().manual_seed(2))
    with_kernels = run(model, x, KVCache(model.config, make_policy("kvreviver", 64)))
    assert (3, 2, 2, 16) in kernels_everywhere         # the sketch's cells (r, b, H_kv, d) went through
    monkeypatch.setattr(kernels, "serves", lambda t: False)
    monkeypatch.setattr(nanollm.attention, "kernel_serves", lambda t: False)
    without = run(model, x, KVCache(model.config, make_policy("kvreviver", 64)))
    torch.testing.assert_close(with_kernels, without, rtol=0, atol=1e-4)
