"""The skinny q/k/v kernel (kernels/skinny_qkv.py): the product, RoPE and the cache's write in one launch, against
norm_linear, RoPE and the write as the fused step does them.

Without a GPU the kernel runs in Triton's interpreter (``tests/conftest.py`` sets TRITON_INTERPRET=1). The shapes
cover a program's block of pairs within one head and across several (d = 64 and d = 16 with 16 pairs a program),
rows under and over one tile of 16, grouped heads (H > H_kv), and slots that differ per sequence and head.
"""

import pytest
import torch

import kernels
from kernels.skinny_matmul import SkinnyLaunch
from kernels.skinny_qkv import norm_qkv_rope_write_triton, reference_norm_qkv_rope_write
from tests.conftest import one_fast
from tests.kernels.test_kernels_skinny import DEVICES, SMALL, close  # the product kernels' devices, launch, check

pytestmark = pytest.mark.skipif(not kernels.HAS_TRITON or not (kernels.interpreting() or torch.cuda.is_available()),
                                reason="no way to run a Triton kernel: triton is not installed, or there is no "
                                       "CUDA device and TRITON_INTERPRET is not 1")
SHAPES = [(1, 48, 4, 2, 16), (3, 40, 2, 1, 64), (20, 64, 6, 2, 16)]        # (M, K, H, H_kv, d)
C = 7                                       # slots a head


def inputs(M, K, H, H_kv, d, dtype, device, seed=0):
    """x (M, K) as a view with a row stride of K + 3, the norm's g, the stacked weight, one step's cos and sin
    (the angles of a pair's two halves differ here, where ``rope_cos_sin`` repeats them: a kernel that read one
    half's for both would pass with those), buffers of C slots holding other entries, each
    (sequence, KV head) writing to a slot of its own, and the step's position."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K + 3, generator=g)[:, 1:K + 1]
    norm_w = 1 + 0.2 * torch.randn(K, generator=g)
    w = torch.randn((H + 2 * H_kv) * d, K, generator=g) / K ** 0.5
    angles = 6 * torch.rand(1, d, generator=g)
    kb, vb = torch.randn(2, M, H_kv, C, d, generator=g)
    pos = torch.randint(-1, 50, (M, H_kv, C), generator=g)
    slot = torch.randint(0, C, (M, H_kv), generator=g)
    floats = [t.to(device, dtype) for t in (x, norm_w, w, angles.cos(), angles.sin(), kb, vb)]
    return floats + [t.to(device) for t in (pos, slot, torch.tensor([61]))]


def both(args, launch=SMALL):
    """The reference's and the kernel's q and buffers, each on buffers of its own."""
    x, g, w, cos, sin, kb, vb, pos, slot, position = args
    ref = [t.clone() for t in (kb, vb, pos)]
    got = [t.clone() for t in (kb, vb, pos)]
    q_ref = reference_norm_qkv_rope_write(x, g, 1e-5, w, cos, sin, *ref, slot, position)
    q_got = norm_qkv_rope_write_triton(x, g, 1e-5, w, cos, sin, *got, slot, position, launch=launch)
    return (q_ref, *ref), (q_got, *got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", one_fast(torch.float32, torch.bfloat16))
@pytest.mark.parametrize("M,K,H,H_kv,d", one_fast(*SHAPES))
def test_q_and_the_written_entries(device, dtype, M, K, H, H_kv, d):
    """q rotated, and the new k (rotated) and v in each head's slot, within the kernel's tolerance of the
    reference; every other slot and every position the reference's, bit for bit."""
    args = inputs(M, K, H, H_kv, d, dtype, device)
    (q_ref, kb_ref, vb_ref, pos_ref), (q, kb, vb, pos) = both(args)
    assert q.shape == (M, H, d) and q.dtype == dtype
    close(q, q_ref, dtype)
    close(kb, kb_ref, dtype)
    close(vb, vb_ref, dtype)
    assert torch.equal(pos, pos_ref)
    slot = args[8]
    others = torch.ones(M, H_kv, C, dtype=torch.bool, device=device).scatter_(2, slot[:, :, None], False)
    assert torch.equal(kb[others], args[5][others]) and torch.equal(vb[others], args[6][others])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_program_across_heads_and_a_masked_tail(device, dtype):
    """32 rows a program over heads of 16 dims: each program holds two heads (one of them q's last and k's
    first), and the last one half of a program, the rest masked."""
    args = inputs(5, 40, 3, 1, 16, dtype, device)                   # 5 heads of 16 rows: 2.5 programs
    want, got = both(args, SkinnyLaunch(32, 32, 4, 2))
    for a, b in zip(got, want):
        close(a, b, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_the_default_launch_and_a_wide_one(device):
    """The launch taken when none is given, and 64 pairs a program over 40 (one program, most of it masked)."""
    args = inputs(5, 70, 3, 1, 16, torch.float32, device)
    for launch in (None, SkinnyLaunch(64, 128, 4, 2)):
        want, got = both(args, launch)
        for a, b in zip(got, want):
            close(a, b, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_turns_q_and_k_and_not_v(device):
    """A plausible mistake (v rotated too, or k not rotated) is caught: at an angle of 0 for every pair the
    kernel's q, k and v are the plain product's, at the step's angles q and k differ from it and v does not."""
    x, g, w, cos, sin, kb, vb, pos, slot, position = inputs(2, 32, 2, 1, 16, torch.float32, device)
    still = [t.clone() for t in (kb, vb, pos)]
    plain = norm_qkv_rope_write_triton(x, g, 1e-5, w, torch.ones_like(cos), torch.zeros_like(sin), *still, slot,
                                       position, launch=SMALL)
    turned = [t.clone() for t in (kb, vb, pos)]
    q = norm_qkv_rope_write_triton(x, g, 1e-5, w, cos, sin, *turned, slot, position, launch=SMALL)
    at = slot[:, :, None, None].expand(-1, -1, 1, 16)
    assert not torch.allclose(q, plain)
    assert not torch.allclose(turned[0].gather(2, at), still[0].gather(2, at))
    torch.testing.assert_close(turned[1].gather(2, at), still[1].gather(2, at), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_one_line_errors(device):
    x, g, w, cos, sin, kb, vb, pos, slot, position = inputs(2, 32, 2, 1, 16, torch.float32, device)
    with pytest.raises(ValueError, match=r"\(H \+ 2 H_kv\) d rows"):
        norm_qkv_rope_write_triton(x, g, 1e-5, w[:40], cos, sin, kb, vb, pos, slot, position)
    with pytest.raises(ValueError, match="even head size"):
        norm_qkv_rope_write_triton(x, g, 1e-5, w, cos, sin, kb, vb[..., :8], pos, slot, position)
    with pytest.raises(ValueError, match="one row of 16"):
        norm_qkv_rope_write_triton(x, g, 1e-5, w, cos[:, :8], sin[:, :8], kb, vb, pos, slot, position)
    with pytest.raises(ValueError, match="slot must have shape"):
        norm_qkv_rope_write_triton(x, g, 1e-5, w, cos, sin, kb, vb, pos, slot[:1], position)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        norm_qkv_rope_write_triton(x.half(), g.half(), 1e-5, w.half(), cos, sin, kb, vb, pos, slot, position)
