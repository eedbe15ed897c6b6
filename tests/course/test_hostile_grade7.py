"""
The grader against a hostile student, round fifteen (a red-team helper's findings, course/README.md "Threat
model"). The kernel checker's own escape (a ``match`` class pattern reading ``__reduce_ex__``, then ``__globals__``)
is tested beside the other escapes: ``test_grader.py`` (the checker) and ``test_hostile_grade6.py`` (the kernels'
process). Here:

* One student's process at a time: the test process started it twice (at import and once the tests were read),
  and the first ran on unwatched, beside the watched one, able to hand it what it computed.
* What the student's process writes into its dump reaches the grader's table escaped (a file name in a fake
  traceback held a terminal's escape sequences).
* A tensor's type name from the student's process never makes the test process import a module of torch.
* Round sixteen, the kernel checker again: a pointer parameter annotated ``tl.constexpr`` reached the kernel as
  the PyTorch tensor itself (the interpreter leaves a constexpr's value as it is), and a tensor's data became
  Python numbers through an f-string or ``float()``: both merged the partials outside Triton, 8 / 8.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from course import grade
from course.assignments import ROOT
from tests.course.test_grader import student_copy, toy_connection
from tests.course.test_grader_hostile import graded
from tests.course.test_hostile_grade6 import toy_copy

pytestmark = pytest.mark.slow

# At import, the copy's adapters hold a lock on their own file: a second student's process beside the first fails
# to import them (BlockingIOError), one after another never does (the lock goes with the process).
ONE_AT_A_TIME = (
    "import fcntl as _fcntl\n"
    "_HELD = open(__file__, 'rb')\n"
    "_fcntl.flock(_HELD, _fcntl.LOCK_EX | _fcntl.LOCK_NB)\n"
)


def test_the_students_process_runs_one_at_a_time(tmp_path, capsys):
    """The untouched copy with adapters that refuse a second process beside them: every public test of
    group_scores fails on the stub's hint, none because its adapters could not be imported."""
    copy = student_copy(tmp_path)
    adapters = copy / "course" / "cache" / "adapters.py"
    adapters.write_text(adapters.read_text() + "\n" + ONE_AT_A_TIME)
    results, printed = graded(capsys, copy, tmp_path / "out.json", "-k", "group_scores", "--public-only")
    outputs = [t["output"] for t in results["tests"]]
    assert outputs and not any("BlockingIOError" in o for o in outputs), outputs
    assert all("task group_scores" in o for o in outputs), outputs


def test_a_connection_never_starts_a_second_process(tmp_path):
    connection = toy_connection(tmp_path, toy_copy(tmp_path, "def one():\n    return 1\n"))
    try:
        connection.start()
        with pytest.raises(RuntimeError, match="running already"):
            connection.start()
    finally:
        connection.close()


def test_where_the_code_was_is_escaped(tmp_path):
    """A fake traceback in the dump names a file whose name redraws the terminal: the grader's words carry it
    escaped."""
    student = tmp_path / "copy"
    dump = tmp_path / "dump.txt"
    dump.write_text(f'Timeout (0:00:06)!\nThread 0x1 (most recent call first):\n'
                    f'  File "{student}/x\x1b[2K\x1b[1A\x07\u202e.py", line 7 in f\n')
    where = grade.where_it_was(dump, student)
    assert where.startswith(", in x") and where.endswith(", line 7 (f)"), where
    assert all(c.isprintable() for c in where), repr(where)
    assert "\\x1b[2K" in where and "\\u202e" in where, where


def test_a_tensors_type_name_imports_nothing():
    """``_dynamo`` as a tensor's dtype: refused, and torch._dynamo never imported (before: 93 modules, 2 s)."""
    probe = ("import sys\n"
             "from course.sandbox.student_process import unpack, decode_torch_name\n"
             "for bad in (lambda: unpack({'dtype': '_dynamo', 'shape': [0], 'bytes': b''}),\n"
             "            lambda: decode_torch_name({'torch': 'dtype', 'name': 'torch._dynamo'}),\n"
             "            lambda: unpack({'dtype': ['float32'], 'shape': [0], 'bytes': b''})):\n"
             "    try:\n"
             "        bad()\n"
             "    except ValueError:\n"
             "        pass\n"
             "    else:\n"
             "        raise SystemExit('not refused')\n"
             "print(unpack({'dtype': 'float32', 'shape': [1], 'bytes': bytearray(4)}).dtype)\n"
             "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["torch.float32", "[]"], out.stdout


TORCH_IN_A_KERNEL = """import triton
import triton.language as tl


@triton.jit
def k(x: tl.constexpr, out: tl.constexpr, N: tl.constexpr):
    out += x.exp().sum()


@triton.jit
def k_quoted(x: "tl.constexpr", out: "constexpr", N: tl.constexpr):
    out += x.exp().sum()
"""


@pytest.mark.parametrize("kernel", ["k", "k_quoted"])
def test_a_tensor_given_to_a_constexpr_parameter_is_refused(tmp_path, monkeypatch, kernel):
    pytest.importorskip("triton")
    import torch

    from course.sandbox.student_process import KernelsAlone, NotTriton
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (tmp_path / "k.py").write_text(TORCH_IN_A_KERNEL)
    x, out = torch.randn(4), torch.zeros(1)
    with pytest.raises(NotTriton, match="annotated tl.constexpr but is given a Tensor"):
        KernelsAlone(tmp_path).launch("k.py", kernel, [1], [x, out], {"N": 4})
    assert out.item() == 0.0
