"""
The test tiers' own guard (tests/conftest.py): a fast-tier test that starts a process fails, saying it
belongs to the slow tier, unless a compiler starts it (Triton's first compile on a GPU runs ``ldconfig`` and
the C compiler; so does torch.compile's inductor), so the kernel tests pass on a CUDA machine too.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import COMPILERS


def test_a_fast_test_may_not_start_a_process():
    with pytest.raises(AssertionError, match="starts a subprocess: mark it @pytest.mark.slow"):
        subprocess.run(["true"])


@pytest.mark.skipif(not COMPILERS, reason="neither Triton nor torch's inductor is installed")
def test_a_compiler_may_start_one():
    """Code whose file is in a compiler's folder (as Triton's is when it compiles a kernel) starts a process."""
    folder = next(c for c in COMPILERS if c.endswith("/"))
    code = compile("import subprocess\ndone = subprocess.run(['true']).returncode\n", folder + "build.py", "exec")
    scope = {}
    exec(code, scope)
    assert scope["done"] == 0
