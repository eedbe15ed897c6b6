"""The skinny matmul kernel (kernels/skinny_matmul.py) against its PyTorch references.

Without a GPU the kernel runs in Triton's interpreter (``tests/conftest.py`` sets TRITON_INTERPRET=1). The
shapes cover rows under, at and over one tile of 16 (the rest masked, or a second row of programs), K that is
and is not a multiple of the step along it, N that is and is not a multiple of the columns per program, and
inputs that are views with a row stride of their own (as the fused step passes the attention's output).
"""

from pathlib import Path

import pytest
import torch

import kernels
from kernels.skinny_matmul import (
    TOLERANCE,
    SkinnyLaunch,
    linear_add_triton,
    norm_linear_triton,
    norm_swiglu_triton,
    reference_linear_add,
    reference_norm_linear,
    reference_norm_swiglu,
)

pytestmark = pytest.mark.skipif(not kernels.HAS_TRITON or not (kernels.interpreting() or torch.cuda.is_available()),
                                reason="no way to run a Triton kernel: triton is not installed, or there is no "
                                       "CUDA device and TRITON_INTERPRET is not 1")
DEVICES = (["cpu"] if kernels.interpreting() else []) + (["cuda"] if torch.cuda.is_available() else [])
ROOT = Path(__file__).resolve().parents[2]
SMALL = SkinnyLaunch(16, 32, 4, 2)          # small blocks: several programs and steps along K even here
SHAPES = [(1, 64, 16), (3, 100, 40), (16, 64, 48), (20, 96, 32)]          # (M, K, N)


def inputs(M, K, N, dtype, device, seed=0, w_rows=None):
    """x (M, K) as a view with a row stride of K + 3, the norm's weight g (K,) around 1, w (w_rows or N, K) and
    a residual r (M, N), all at scales that keep the outputs away from 0 and from overflow."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K + 3, generator=g)[:, 1:K + 1]
    norm_w = 1 + 0.2 * torch.randn(K, generator=g)
    w = torch.randn(w_rows or N, K, generator=g) / K ** 0.5
    r = torch.randn(M, N, generator=g)
    return [t.to(device, dtype) for t in (x, norm_w, w, r)]


def close(got, want, dtype):
    scale = want.abs().max().clamp_min(1e-6)
    err = float((got.float() - want.float()).abs().max() / scale)
    assert err <= TOLERANCE[dtype], (f"max |kernel - reference| = {err:.3g} of max |reference| "
                                     f"(tolerance {TOLERANCE[dtype]})")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_norm_linear(device, dtype, M, K, N):
    x, g, w, _ = inputs(M, K, N, dtype, device)
    got = norm_linear_triton(x, g, 1e-5, w, launch=SMALL)
    assert got.shape == (M, N) and got.dtype == dtype
    close(got, reference_norm_linear(x, g, 1e-5, w), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_norm_swiglu(device, dtype, M, K, N):
    x, g, w, _ = inputs(M, K, N, dtype, device, w_rows=2 * N)
    got = norm_swiglu_triton(x, g, 1e-5, w, launch=SMALL)
    assert got.shape == (M, N)
    close(got, reference_norm_swiglu(x, g, 1e-5, w), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_linear_add(device, dtype, M, K, N):
    y, _, w, r = inputs(M, K, N, dtype, device)
    got = linear_add_triton(y, w, r, launch=SMALL)
    close(got, reference_linear_add(y, w, r), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_the_default_launch_and_a_wide_one(device):
    """The launch taken when none is given (16 columns, a step of 256 along K: here one step), and 64 columns
    over an N of 40 (one program, most of it masked)."""
    x, g, w, r = inputs(5, 300, 40, torch.float32, device)
    close(norm_linear_triton(x, g, 1e-6, w), reference_norm_linear(x, g, 1e-6, w), torch.float32)
    close(linear_add_triton(x, w, r, launch=SkinnyLaunch(64, 128, 4, 2)), reference_linear_add(x, w, r),
          torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_the_norm_is_the_rows_own(device):
    """A plausible mistake, a norm over the whole block or without eps, is caught: rows of very different sizes,
    one of them all zeros (its output is 0, as x / sqrt(0 + eps) * 0 is)."""
    x, g, w, _ = inputs(4, 64, 16, torch.float32, device)
    x = x * torch.tensor([[1e-3], [1.0], [1e3], [0.0]], device=device)
    got = norm_linear_triton(x, g, 1e-5, w, launch=SMALL)
    close(got, reference_norm_linear(x, g, 1e-5, w), torch.float32)
    assert torch.equal(got[3], torch.zeros_like(got[3]))


@pytest.mark.parametrize("device", DEVICES)
def test_one_line_errors(device):
    x, g, w, r = inputs(2, 32, 16, torch.float32, device)
    with pytest.raises(ValueError, match="share K"):
        norm_linear_triton(x, g, 1e-5, w[:, :16])
    with pytest.raises(ValueError, match="even number of rows"):
        norm_swiglu_triton(x, g, 1e-5, w[:15])
    with pytest.raises(ValueError, match="norm's weight"):
        norm_linear_triton(x, g[:8], 1e-5, w)
    with pytest.raises(ValueError, match="residual"):
        linear_add_triton(x, w, r[:, :8])
    with pytest.raises(ValueError, match="dtype"):
        linear_add_triton(x.double(), w, r)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        norm_linear_triton(x.half(), g.half(), 1e-5, w.half())


# compiles the kernel for sm_90 in a process of its own: Triton's interpreter, which the tests set on a CPU,
# replaces the language's functions (tl.sum among them) for the whole process
COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.skinny_matmul as sk
import kernels.skinny_qkv as sq
launch, out = sk.DEFAULT_LAUNCH, {}
sizes = {"BLOCK_M": sk.BLOCK_M, "BLOCK_N": launch.block_n, "BLOCK_K": launch.block_k}
for variant in sys.argv[1:]:
    if variant == "qkv_rope_write":                 # TinyLlama's heads: 32 of q, 4 of k and of v, 64 dims
        fn = sq._qkv_rope_write_kernel
        constexprs = {"H": 32, "H_KV": 4, "D": 64, "DOT_FP32": False, **sizes}
    else:
        fn = sk._skinny_kernel
        constexprs = {"NORM": variant != "linear_add", "SWIGLU": variant == "norm_swiglu",
                      "RESIDUAL": variant == "linear_add", "DOT_FP32": False, **sizes}
    args = [a for a in fn.arg_names if a not in constexprs]
    signature = {a: ("*i64" if a in ("pos_ptr", "slot_ptr", "position_ptr") else "*bf16") if a.endswith("_ptr")
                 else "fp32" if a == "eps" else "i32" for a in args}
    # the ints a launch at these shapes passes as multiples of 16; not eps, nor slot's and pos's strides over
    # KV heads (4, 1, C) and sequences (4 H_kv, H_kv C), C = budget + 1 for an evicting cache
    odd = ("eps", "stride_sb", "stride_sh", "stride_ph", "stride_pb")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in args if a not in odd}
    signature.update({name: "constexpr" for name in constexprs})
    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    except RuntimeError as e:
        print(json.dumps({"skip": str(e).splitlines()[0]}))
        raise SystemExit(0)
    ptx = compiled.asm["ptx"]
    out[variant] = {"cp.async": ptx.count("cp.async"), "mma": ptx.count("mma.sync")}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_kernel_compiles_for_a_hopper_gpu_with_its_loads_pipelined():
    """Each variant, and ``kernels/skinny_qkv.py``'s kernel, compiled here, without a GPU, for an H100/H200
    (sm_90) as a bf16 launch of the default settings would be (pointers, sizes and strides divisible by 16, as
    Triton specialises them at a launch): it compiles, its products are on the tensor cores, and its loads of x
    and w are asynchronous copies (``cp.async``), the pipelining its ``num_stages`` asks for, without which a
    program waits for every block it loads (the slow tier: a process of its own, and ptxas in another).
    ``test_kernels_compile.py`` compiles every launch the tests make, at their tiny shapes; this asks what only
    the real shapes' alignment gives."""
    import json
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    variants = ["norm_linear", "norm_swiglu", "linear_add", "qkv_rope_write"]     # the last: skinny_qkv.py's
    done = subprocess.run([sys.executable, "-c", COMPILE, *variants], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in got:                                # a Triton without the NVIDIA backend or its ptxas
        pytest.skip(f"cannot compile for sm_90 here: {got['skip']}")
    assert sorted(got) == sorted(variants)
    for variant, counts in got.items():
        assert counts["mma"] > 0, f"{variant}: the products are not on the tensor cores"
        assert counts["cp.async"] > 0, f"{variant}: the loads are not pipelined"
