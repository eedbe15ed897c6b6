"""Every kernel launch the kernel tests make compiles for a GPU, on a machine without one: Triton's own compiler
(its front end, then ptxas, which ships with triton) for Hopper (sm_90) and Ampere (sm_80), with the argument
types and compile-time constants of each launch.

Triton's CPU interpreter, which the other kernel tests run in, executes a kernel's Python as Python: it does
not type-check the kernel as the GPU compiler does (a loop-carried value whose type changes between
iterations runs in the interpreter and is an error on a GPU: H2O's first update kernel had one). So the
kernel tests run once more in the interpreter with ``launch_capture.py`` recording each distinct launch, and
a process without the interpreter (which, once on, replaces Triton's language functions in its process)
compiles them all. Slow tier: two processes, and ptxas is a third. On a machine with a GPU the kernel tests
compile every kernel for real, so this is skipped there.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels in their own tests")]
ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def has_nvidia_backend() -> bool:
    if not kernels.HAS_TRITON:
        return False
    from triton.backends import backends
    return "nvidia" in backends


COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
launches, arch = json.load(open(sys.argv[1])), int(sys.argv[2])
failed = []
for launch in launches:
    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
    signature = {**launch["signature"], **dict.fromkeys(launch["constants"], "constexpr")}
    try:
        triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=launch["constants"]),
                       target=GPUTarget("cuda", arch, 32))
    except Exception as e:
        failed.append(f"{launch['module']}.{launch['name']} with {launch['constants']}: {str(e)[-600:]}")
print(json.dumps(failed))
"""


def environment(**extra) -> dict:
    """The repository importable, and this folder too: a kernel a test file defines (``test_kernels_wiring``'s
    scalar-mask kernel) is recorded under its test module's name, as pytest imports it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")])
    return env | extra


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Path:
    """The distinct launches of the kernel tests (this file's aside), recorded in the interpreter."""
    out = tmp_path_factory.mktemp("launches") / "launches.json"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p",
                           "tests.kernels.launch_capture", str(HERE), "--ignore", __file__],
                          cwd=ROOT, env=environment(TRITON_INTERPRET="1", KERNEL_LAUNCHES=str(out)),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:]
    return out


def test_the_tests_launch_every_kernel(launches):
    """Every ``@triton.jit`` kernel of ``kernels/`` that a launcher starts is among the launches recorded
    (its helpers, called from inside a kernel, are compiled with it)."""
    names = {(e["module"], e["name"]) for e in json.loads(launches.read_text())}
    defined = set()                                     # (module, name) of each jitted function named *_kernel
    for path in (ROOT / "kernels").glob("*.py"):
        lines = [line.strip() for line in path.read_text().splitlines()]
        for before, line in zip(lines, lines[1:]):
            name = line.removeprefix("def ").split("(")[0]
            if before == "@triton.jit" and name.endswith("_kernel"):
                defined.add((f"kernels.{path.stem}", name))
    assert defined and defined <= names, f"kernels no test launches: {sorted(defined - names)}"


@pytest.mark.skipif(not has_nvidia_backend(), reason="needs triton with its NVIDIA back end (the Linux wheels have it)")
@pytest.mark.parametrize("arch", [80, 90])
def test_every_launch_compiles_for_a_gpu(launches, arch):
    done = subprocess.run([sys.executable, "-c", COMPILE, str(launches), str(arch)], cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, "\n\n".join(failed)
