"""
A student can open the notebooks after the README's set-up: JupyterLab is installed, its ``python3`` kernel
is this interpreter (the one ``test_notebooks.py`` runs every notebook in, with nanollm and methods
importable), and jupytext opens each ``.py`` source as the notebook ``notebooks/build.py`` builds from it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
_spec = importlib.util.spec_from_file_location("notebook_build", NOTEBOOKS / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)


def jupyter(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jupyter", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_jupyterlab_is_installed():
    done = jupyter("lab", "--version")
    assert done.returncode == 0 and done.stdout.strip().startswith("4."), done.stderr


@pytest.mark.slow
def test_the_students_kernel_is_this_interpreter_with_the_library():
    done = jupyter("kernelspec", "list", "--json")
    assert done.returncode == 0, done.stderr
    spec = json.loads(done.stdout)["kernelspecs"]["python3"]["spec"]
    python = spec["argv"][0]
    check = subprocess.run([python, "-c", "import nanollm, methods, kernels; print('ok')"],
                           capture_output=True, text=True, timeout=120, cwd=NOTEBOOKS)
    assert check.stdout.strip() == "ok", f"the python3 kernel ({python}) cannot import the library: {check.stderr}"


@pytest.mark.parametrize("path", build.sources(), ids=lambda p: p.name)
def test_jupytext_opens_each_source_as_its_notebook(path):
    """What a student sees on opening ``notebooks/NN.py`` in JupyterLab (jupytext) is what the committed
    ``.ipynb`` was built from: the same cells, in the same order (the course's markers still in the code; the
    page moves them to cell tags)."""
    opened = jupytext.read(path, fmt="py:percent")
    built = build.read_percent(path, page=False)
    assert [(c.cell_type, c.source) for c in opened.cells] == [(c.cell_type, c.source) for c in built.cells]
