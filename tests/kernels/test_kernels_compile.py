"""The kernels changed since the last GPU run compile for a GPU, on a machine without one: Triton's own
compiler (its front end, then ptxas, which ships with triton) for Hopper (sm_90) and Ampere (sm_80), with
the constants the launchers pass.

Triton's CPU interpreter, which the other kernel tests run in, executes a kernel's Python as Python: it does
not type-check the kernel as the GPU compiler does (a loop-carried value whose type changes between
iterations runs in the interpreter and is an error on a GPU). Each compile runs in a process of its own
without ``TRITON_INTERPRET`` (the interpreter, once on, replaces Triton's language functions in its
process), so these tests are in the slow tier.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kernels

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def has_nvidia_backend() -> bool:
    if not kernels.HAS_TRITON:
        return False
    from triton.backends import backends
    return "nvidia" in backends


needs_nvidia = pytest.mark.skipif(not has_nvidia_backend(),
                                  reason="needs triton with its NVIDIA back end (the Linux wheels have it)")

COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, signature, constants, arch = json.loads(sys.argv[1])
kernel = getattr(importlib.import_module(module), name)
signature = {**signature, **dict.fromkeys(constants, "constexpr")}
compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                          target=GPUTarget("cuda", arch, 32))
assert compiled.asm["cubin"], "no cubin"
print(name, "compiled for sm_%d" % arch)
"""


def compile_for(module: str, name: str, signature: dict, constants: dict, arch: int) -> None:
    """Compile ``module.name`` for compute capability ``arch`` in a fresh process; fails with the compiler's
    message (the kernel's line and what is wrong there)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", COMPILE, json.dumps([module, name, signature, constants, arch])],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


SPLIT_ARGS = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "idx_ptr": "*fp32", "pos_ptr": "*i64", "m_ptr": "*fp32",
    "l_ptr": "*fp32", "acc_ptr": "*fp32", "s_ptr": "*fp32", "ev_ptr": "*i64", "n_tokens": "i32",
    "tokens_per_split": "i32", "scale": "fp32", "n_sink": "i32",
    **dict.fromkeys(["stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_ks", "stride_vb", "stride_vh",
                     "stride_vs", "stride_ib", "stride_ih", "stride_pb", "stride_ph"], "i32")}
UPDATE_ARGS = {"s_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "score_ptr": "*fp32", "pos_ptr": "*i64",
               "slot_ptr": "*i64", "position_ptr": "*i64",
               **dict.fromkeys(["n_splits", "C", "n_recent", "budget", "stride_cb", "stride_ch", "stride_pb",
                                "stride_ph", "stride_sb", "stride_sh"], "i32")}


@needs_nvidia
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("keeps", ["nothing", "scores", "oldest"])
def test_the_masked_split_kernel_compiles(arch, dtype, keeps):
    """The masked split kernel as the graph step launches it, as H2O's step does (its scores kept) and as
    StreamingLLM's does (each range's oldest entry kept), in bf16 (tensor cores) and fp32."""
    compile_for("kernels.decode_attention", "_decode_split_kernel",
                {**SPLIT_ARGS, **{p: "*" + dtype for p in ("q_ptr", "k_ptr", "v_ptr")}},
                {"H_kv": 4, "G": 8, "G_PAD": 16, "D": 64, "BLOCK_N": 64 if dtype == "bf16" else 32,
                 "GATHER": False, "MASKED": True, "DOT_FP32": dtype == "fp32", "SCORES": keeps == "scores",
                 "EVICT": keeps == "oldest"}, arch)


@needs_nvidia
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("G", [8, 3, 1])
def test_the_heavy_update_kernel_compiles(arch, G):
    """H2O's update kernel for groups of 8 query heads (TinyLlama's), 3 (SmolLM2's) and 1 (no GQA)."""
    compile_for("kernels.heavy_hitters", "_heavy_update_kernel", UPDATE_ARGS,
                {"H_kv": 4, "G": G, "G_PAD": kernels.next_pow2(G), "BLOCK_S": 32, "BLOCK_C": 256}, arch)


EVICT_ARGS = {"ev_ptr": "*i64", "pos_ptr": "*i64", "slot_ptr": "*i64", "n_splits": "i32", "budget": "i32",
              **dict.fromkeys(["stride_pb", "stride_ph", "stride_sb", "stride_sh"], "i32")}


@needs_nvidia
@pytest.mark.parametrize("arch", [80, 90])
def test_the_eviction_kernel_compiles(arch):
    """StreamingLLM's eviction kernel (kernels/streaming.py)."""
    compile_for("kernels.streaming", "_evict_oldest_kernel", EVICT_ARGS, {"H_kv": 4, "BLOCK_S": 32}, arch)


def test_the_argument_lists_are_the_kernels():
    """The names above are the kernels' own arguments, in order (a renamed or added argument would make the
    compiles above fail for the wrong reason)."""
    if not kernels.HAS_TRITON:
        pytest.skip("needs triton")
    from kernels.decode_attention import _decode_split_kernel
    from kernels.heavy_hitters import _heavy_update_kernel
    from kernels.streaming import _evict_oldest_kernel
    for kernel, args in ((_decode_split_kernel, SPLIT_ARGS), (_heavy_update_kernel, UPDATE_ARGS),
                         (_evict_oldest_kernel, EVICT_ARGS)):
        code = kernel.fn.__code__
        assert list(code.co_varnames[:len(args)]) == list(args), kernel.fn.__name__
