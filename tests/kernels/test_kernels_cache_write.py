"""The cache-write kernel (kernels/cache_write.py) against its PyTorch reference: the same buffers bit for bit.

Without a GPU the kernel runs in Triton's interpreter (``tests/conftest.py`` sets TRITON_INTERPRET=1). The
new entry comes as the fused step gives it, a view of a larger tensor (its rows are not contiguous); the
head dimension is a power of two or not (the kernel rounds its block up and masks the rest).
"""

import pytest
import torch

import kernels
from kernels.cache_write import reference_write_entry, write_entry_triton

pytestmark = pytest.mark.skipif(not kernels.HAS_TRITON or not (kernels.interpreting() or torch.cuda.is_available()),
                                reason="no way to run a Triton kernel: triton is not installed, or there is no "
                                       "CUDA device and TRITON_INTERPRET is not 1")
DEVICES = (["cpu"] if kernels.interpreting() else []) + (["cuda"] if torch.cuda.is_available() else [])


def buffers(B, H_kv, C, d, dtype, device, seed=0, d_v=None):
    """Layer 1's views of buffers for 3 layers, already holding entries (values of d_v elements, keys of d),
    each head's slot drawn on its own, and a new entry sliced out of larger tensors (the key as
    ``fused.before_attention`` returns it), so that no stride is another's."""
    d_v = d_v or d
    g = torch.Generator().manual_seed(seed)
    kb = torch.randn(3, B, H_kv, C, d, generator=g).to(device, dtype)[1]                 # (B, H_kv, C, d)
    vb = torch.randn(3, B, H_kv, C, d_v, generator=g).to(device, dtype)[1]                # (B, H_kv, C, d_v)
    pos = torch.randint(-1, 50, (B, H_kv, C), generator=g).to(device)
    slot = torch.randint(0, C, (B, H_kv), generator=g).to(device)
    k = torch.randn(B, 4 + 2 * H_kv, d, generator=g).to(device, dtype)[:, 4:4 + H_kv, None]   # (B, H_kv, 1, d)
    v = torch.randn(B, H_kv + 1, d_v, generator=g).to(device, dtype)[:, 1:, None]   # its own strides
    return kb, vb, pos, slot, k, v, torch.tensor([57], device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H_kv,C,d,d_v", [(2, 3, 7, 16, 16), (1, 2, 5, 48, 48), (3, 1, 1, 64, 64),
                                            (2, 2, 6, 48, 24)])
def test_the_kernel_writes_what_the_scatters_write(device, dtype, B, H_kv, C, d, d_v):
    args = buffers(B, H_kv, C, d, dtype, device, d_v=d_v)
    assert B == 1 or not args[4].is_contiguous()
    expected = [t.clone() for t in args[:4]]
    reference_write_entry(*expected, *args[4:])
    write_entry_triton(*args)
    for name, got, want in zip(["kb", "vb", "pos", "slot"], args[:4], expected):
        assert torch.equal(got, want), f"{name} differs from the scatters'"
    # each head's slot now holds the new entry, and nothing else moved
    b, h = torch.meshgrid(torch.arange(B), torch.arange(H_kv), indexing="ij")
    s = args[3].cpu()
    assert torch.equal(args[0].cpu()[b, h, s], args[4][:, :, 0].cpu())
    assert torch.equal(args[1].cpu()[b, h, s], args[5][:, :, 0].cpu())
    assert (args[2].cpu()[b, h, s] == 57).all()


@pytest.mark.parametrize("device", DEVICES)
def test_one_line_errors(device):
    kb, vb, pos, slot, k, v, position = buffers(2, 3, 7, 16, torch.float32, device)
    with pytest.raises(ValueError, match="slot must have shape"):
        write_entry_triton(kb, vb, pos, slot[:1], k, v, position)
    with pytest.raises(ValueError, match="int64"):
        write_entry_triton(kb, vb, pos, slot.int(), k, v, position)
    with pytest.raises(ValueError, match="dtypes"):
        write_entry_triton(kb, vb, pos, slot, k.double(), v, position)
    with pytest.raises(ValueError, match="stride 1"):
        write_entry_triton(kb.repeat_interleave(2, dim=-1)[..., ::2], vb, pos, slot, k, v, position)
