"""
Notebook 07 (kernels) runs without Triton, as on macOS: the roofline, the PyTorch references, the committed
H100 results and the exercises, with every kernel cell printing that it skipped.

How Triton is made unavailable: a ``sitecustomize.py`` written to a temporary folder put on the kernel's
``PYTHONPATH`` sets ``sys.modules["triton"] = None`` when the interpreter starts. Python then answers
``import triton`` (and ``import triton.language``) with ``ModuleNotFoundError`` and
``importlib.util.find_spec("triton")`` with None, exactly as when the package is not installed, so
``kernels.HAS_TRITON`` is False through the library's own check and nothing in the library or the notebook
needs a switch for the test. (``NANOKV_NO_TRITON=1`` is a different thing: Triton importable, kernels
not routed to; it would not exercise the import guards.)
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow        # a notebook in a kernel: the fast tier (-m "not slow") skips it

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
CELL_TIMEOUT_S = 120

_spec = importlib.util.spec_from_file_location("notebook_build", NOTEBOOKS / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

BLOCK_TRITON = 'import sys\nsys.modules["triton"] = None    # import triton: ModuleNotFoundError, as if not installed\n'


def test_kernels_notebook_runs_without_triton(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCK_TRITON)
    path = os.pathsep.join([str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    monkeypatch.setenv("PYTHONPATH", path)           # build.kernel_env keeps it, after the repository root
    nb = nbformat.read(NOTEBOOKS / "07_kernels.ipynb", as_version=4)
    t0 = time.perf_counter()
    build.execute(nb, tiny=True, timeout=CELL_TIMEOUT_S)       # raises CellExecutionError on the first error
    assert not build.error_outputs(nb)
    text = "\n".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                     for out in cell.get("outputs", []) if out.get("output_type") == "stream")
    assert "Triton available: False" in text, "Triton was not blocked: the sitecustomize did not run in the kernel"
    assert text.count("skipped: ") == 2, "every kernel cell (sections 2.1, 2.2) should print one skip line"
    print(f"07_kernels.ipynb without Triton: {time.perf_counter() - t0:.1f} s in tiny mode")
