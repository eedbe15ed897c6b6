"""
The grader against a hostile student, round three (course/README.md, section "Threat model"): the machine the
grade runs on, and what the student sees of the hidden tests.

* The student's code never runs as uid 0: as root, the grader runs it as ``nobody``, or refuses in one line
  saying what to change where nobody cannot read Python (a virtual environment made under umask 077); in its
  room the kernel's settings (``/proc/sys``, ``/proc/sysrq-trigger``) are read-only and ``/proc/1/cmdline``
  names none of the grader's paths; the copy's own tests and the course's oracle are not in the room at all.
* A hidden test's JSON output (what Gradescope shows once grades are published) is the grader's words only:
  inputs the student's code plants in an exception reach no part of it.
* A graded function that writes into a tensor the test passed it fails (the wire sees the write).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from course import gradescope
from course.assignments import ASSIGNMENTS, ROOT
from course.sandbox import remote
from tests.course.test_grader import put, student_copy, toy_connection
from tests.course.test_grader_hostile import autograded, graded, marker_folder

pytestmark = pytest.mark.slow

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the uid-0 attacks need a grader running as root")

# What the graded code tries on the machine, said in one short line (a public test's message shows it): its
# uids, which kernel settings it could open for writing (it writes nothing), which are mounted read-only, and
# whether process 1 names one of the grader's paths.
PROBE = [
    "import os",
    "def opened(path):",
    "    try:",
    "        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))",
    "        return True",
    "    except OSError:",
    "        return False",
    "settings = ['/proc/sys/kernel/core_pattern', '/proc/sys/vm/drop_caches', '/proc/sys/kernel/hostname',",
    "            '/proc/sysrq-trigger']",
    "writable = [p.rsplit('/', 1)[1] for p in settings if opened(p)]",
    "mounts = [line.split() for line in open('/proc/self/mountinfo')]",
    "ro = sorted(m[4] for m in mounts if m[4] in ('/proc/sys', '/proc/sysrq-trigger') and 'ro' in m[5].split(','))",
    "try:",
    "    first = open('/proc/1/cmdline', 'rb').read()",
    "except OSError:",
    "    first = b''",
    "host = [w for w in ('\"mask\": [\"/', '\"root\": \"/', '__editable__', {root!r}) if w.encode() in first]",
    "open({marker!r} + '/ran', 'w').close() if os.path.isdir({marker!r}) else None",
    "raise RuntimeError(f'uid {{os.getuid()}} {{os.geteuid()}} gid {{os.getgid()}} writable {{writable}} ro {{ro}} "
    "host {{host}}')",
]


def probing_copy(tmp_path: Path, marker: Path) -> Path:
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores",
        [line.format(root=str(ROOT), marker=str(marker)) for line in PROBE])
    return copy


def probe_said(results: dict) -> str:
    said = [t["output"] for t in results["tests"] if t["visibility"] == "visible" and "group_scores" in t["name"]]
    assert said and "uid " in said[0], results
    return said[0]


@as_root
def test_in_its_room_the_code_runs_as_nobody_and_cannot_write_the_kernels_settings(tmp_path, capsys):
    """As root, the graded code runs as nobody; it can open none of core_pattern, drop_caches, hostname and
    sysrq-trigger for writing, finds /proc/sys and /proc/sysrq-trigger mounted read-only, and process 1's
    command line names none of the grader's paths (its room's spec reaches it on standard input)."""
    marker = marker_folder()
    results, printed = graded(capsys, probing_copy(tmp_path, marker), tmp_path / "r.json", "-k", "group_scores")
    said = probe_said(results)
    if "UNCONFINED" in results["output"]:
        pytest.skip("no room here")
    assert "uid 65534 65534 gid 65534" in said and "writable []" in said, said
    assert "ro ['/proc/sys', '/proc/sysrq-trigger']" in said or "ro ['/proc/sys']" in said, said
    assert "host []" in said, said


def venv_nobody_cannot_read(tmp_path: Path) -> Path:
    """A virtual environment made under umask 077 (its files root's alone), with this Python's packages: the
    grader's Python, run from it, is one the user nobody cannot read."""
    venv = tmp_path / "venv077"
    subprocess.run(["bash", "-c", f"umask 077 && {sys.executable} -m venv --without-pip --system-site-packages "
                                  f"{venv}"], check=True, timeout=120)
    return venv / "bin" / "python"


@as_root
def test_as_root_with_a_python_nobody_cannot_read_the_grader_refuses_in_one_line(tmp_path):
    """The grader runs as root from a Python nobody cannot read: it grades nothing (the code never runs, so never
    as root without capabilities, which may still write core_pattern) and says in one line what to change."""
    marker = marker_folder()
    copy, out = probing_copy(tmp_path, marker), tmp_path / "r.json"
    run = subprocess.run([str(venv_nobody_cannot_read(tmp_path)), "-m", "course.grade", "cache", "--student",
                          str(copy), "-k", "group_scores", "--json", str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    err = run.stderr.strip()
    assert run.returncode != 0 and not out.exists(), (run.returncode, run.stdout[-1500:], err[-1500:])
    assert err.startswith("error: the grader runs as root") and "\n" not in err, err
    assert "nobody cannot read" in err and "chmod" in err and "(mode 7" in err, err
    assert not (marker / "ran").exists(), "the student's code ran"


@as_root
def test_through_run_autograder_the_code_never_runs_as_root(tmp_path):
    """Through the Gradescope package's ``run_autograder``, as root: with a Python nobody can read the probe runs
    as nobody and writes nothing; with one nobody cannot read, the grade is 0, "not graded", saying why."""
    source, results = tmp_path / "source", tmp_path / "results" / "results.json"
    with zipfile.ZipFile(gradescope.write_zip(ASSIGNMENTS["cache"], tmp_path / "dist")) as z:
        z.extractall(source)
    copy = probing_copy(tmp_path, marker_folder())

    def run_autograder(python: str) -> dict:
        return autograded(source, copy, results, python, tmp_path)

    graded_copy = run_autograder(sys.executable)
    said = probe_said(graded_copy)
    assert "uid 0" not in said and "writable []" in said, said
    refused = run_autograder(str(venv_nobody_cannot_read(tmp_path)))
    assert refused["score"] == 0 and "not graded" in refused["output"], refused
    assert "the grader runs as root" in refused["output"] and "chmod" in refused["output"], refused


def test_the_setup_makes_the_graders_python_readable_by_nobody(tmp_path):
    """``setup.sh`` installs under umask 022 and opens the environment and the folders above it to other users, so
    that ``run_autograder`` runs the code as nobody and never refuses for want of a readable Python."""
    with zipfile.ZipFile(gradescope.write_zip(ASSIGNMENTS["cache"], tmp_path / "dist")) as z:
        setup = z.read("setup.sh").decode()
    assert "umask 022" in setup and 'chmod -R o+rX "$venv"' in setup and "chmod o+x" in setup, setup


def test_the_copys_tests_and_the_oracle_are_not_in_the_room(tmp_path, capsys):
    """Code that takes the import guard off (it runs in the student's process, so it can) still finds neither the
    copy's own tests nor the course's oracle and test files: the grader never gives them to the graded code."""
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores", [
        "import os, sys",
        "sys.meta_path[:] = [f for f in sys.meta_path if 'Guard' not in type(f).__name__ and 'guard' not in "
        "type(f).__name__.lower()]",
        "here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))",
        "found = [p for p in ('tests', 'tests/course/test_grader.py', 'course/oracle.py',"
        " 'course/cache/test_public.py') if os.path.exists(os.path.join(here, p))]",
        "try:",
        "    import tests.course.test_grader",
        "    found.append('imported tests')",
        "except Exception:",
        "    pass",
        "raise RuntimeError(f'found {found}')"])
    results, _ = graded(capsys, copy, tmp_path / "r.json", "-k", "group_scores")
    said = [t["output"] for t in results["tests"] if t["visibility"] == "visible"]
    assert said and all("found []" in s for s in said), said


def test_nothing_the_code_produced_reaches_a_hidden_tests_output(tmp_path, capsys):
    """The graded code raises what the tests gave it (the inputs' bytes in base64, behind a marker) in every call:
    the hidden tests' JSON outputs hold the grader's words only, and the marker is nowhere in them."""
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "attention.py", "group_scores", [
        "import base64",
        "raise RuntimeError('PLANTED ' + base64.b64encode(q.detach().numpy().tobytes()[:600]).decode())"])
    results, _ = graded(capsys, copy, tmp_path / "r.json", "-k", "group_scores")
    hidden = [t for t in results["tests"] if t["visibility"] == "after_published"]
    public = [t for t in results["tests"] if t["visibility"] == "visible"]
    assert hidden and public and any("PLANTED" in t["output"] for t in public), results   # the plant works
    from course import grade
    for t in hidden:
        assert "PLANTED" not in t["output"] and t["output"] in grade.HIDDEN_SAYS.values(), t


def toy_copy(tmp_path: Path, adapters: str) -> Path:
    """A toy student copy whose ``course/x/adapters.py`` is ``adapters`` (for ``toy_connection``)."""
    folder = tmp_path / "copy"
    (folder / "course" / "x").mkdir(parents=True)
    (folder / "course" / "x" / "adapters.py").write_text(adapters)
    return folder

def test_a_graded_function_that_writes_into_its_input_fails(tmp_path):
    """A function that masks its input in place (``masked_fill_`` on the caller's tensor) fails the call, with a
    message naming the tensor's shape; the test's tensor keeps its values."""
    import torch
    folder = toy_copy(tmp_path,
        "import torch\n"
        "def masked(t):\n    return t.masked_fill_(t > 1, float('-inf'))\n"
        "def fresh(t):\n    return t.masked_fill(t > 1, float('-inf'))\n")
    connection = toy_connection(tmp_path, folder)
    adapters = remote.Adapters(connection)
    try:
        t = torch.arange(4.0)
        with pytest.raises(remote.InputChanged, match=r"wrote into a tensor the test passed it \(shape \[4\] float32"):
            adapters.masked(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert adapters.fresh(t).tolist() == [0.0, 1.0, float("-inf"), float("-inf")]
    finally:
        connection.close()


def test_in_its_room_the_code_cannot_use_the_kernels_keyrings(tmp_path):
    """A keyring belongs to no namespace: in its room the code added a key to nobody's user keyring that a later
    grade could read, and one to the grader's session keyring where the grader had one (a red-team helper's
    probes). add_key, request_key and keyctl fail with EPERM there now."""
    folder = toy_copy(tmp_path,
        "import ctypes, os, platform\n"
        "def add_key():\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    numbers = {'x86_64': (248, 250), 'aarch64': (217, 219)}[platform.machine()]\n"
        "    out = []\n"
        "    for args in ((numbers[0], b'user', b'room-probe', b'secret', 6, -4), (numbers[1], 0, -4)):\n"
        "        r = libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])\n"
        "        out.append(ctypes.get_errno() if r < 0 else 0)\n"
        "    return out\n")
    connection = toy_connection(tmp_path, folder)
    try:
        if not connection.jail:
            pytest.skip("no room here")
        assert remote.Adapters(connection).add_key() == [1, 1]          # EPERM, both
    finally:
        connection.close()


def test_what_the_code_spends_is_read_from_outside_its_process(tmp_path):
    """``adapters.watch()`` reads the student's process tree from /proc: a call that fills 256 MB and spins for
    a second shows both; a small call shows neither; the code cannot make its own numbers count (it reports
    nothing). Work in a child process: in the room none starts (a child the kernel reaps counted to no
    process); without one, a child's CPU time counts."""
    folder = toy_copy(tmp_path,
        "import subprocess, sys, time, torch\n"
        "def big():\n    x = torch.ones(64 << 20)\n    return float(x.sum())\n"
        "def small():\n    return float(torch.ones(1000).sum())\n"
        "def spin(s):\n    t = time.process_time()\n    while time.process_time() - t < s:\n        pass\n"
        "def child(s):\n    subprocess.run([sys.executable, '-c', f'import time\\nt = time.process_time()\\n"
        "while time.process_time() - t < {s}: pass'], check=True)\n")
    connection = toy_connection(tmp_path, folder)
    adapters = remote.Adapters(connection)
    try:
        adapters.small()
        with adapters.watch() as big:
            adapters.big()
        with adapters.watch() as small:
            adapters.small()
        with adapters.watch() as spin:
            adapters.spin(1.0)
        with adapters.watch() as child:
            if connection.room:
                with pytest.raises(PermissionError, match="Operation not permitted"):
                    adapters.child(1.0)
            else:
                adapters.child(1.0)
    finally:
        connection.close()
    assert big.peak_bytes > 200 << 20 and small.peak_bytes < 32 << 20, (big.peak_bytes, small.peak_bytes)
    assert spin.cpu_s > 0.9 and small.cpu_s < 0.5, (spin.cpu_s, small.cpu_s)
    assert connection.room or child.cpu_s > 0.9, child.cpu_s



def test_a_fresh_watch_sees_what_the_code_set_aside_before_it(tmp_path):
    """Memory the code fills before a watch (at import, or in an earlier call) is not growth within it: a
    Kronecker product written into such a buffer scored 24 / 24. ``watch(fresh=True)`` starts a new student's
    process in which the copy's code loads inside the block, so both buffers count whole there. A file of the
    copy named as a module PyTorch imports (``opt_einsum.py``) ran within ``import torch``, before the watch
    (24 / 24 again): now PyTorch loads before the copy is importable, so it runs within the block, or never."""
    folder = tmp_path / "copy"
    (folder / "course" / "x").mkdir(parents=True)
    (folder / "opt_einsum.py").write_text(
        "import ctypes, mmap, sys\n"
        "sys.arena = mmap.mmap(-1, 192 << 20)\n"
        "ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(sys.arena)), 1, 192 << 20)   # resident from here\n"
        "raise ImportError('PyTorch carries on without it')\n")
    (folder / "course" / "x" / "adapters.py").write_text(
        "import sys, torch\n"
        "def shadow_ran():\n"
        "    return hasattr(sys, 'arena')\n"
        "AT_IMPORT = torch.ones(48 << 20)                                # 192 MiB, resident from import on\n"
        "KEPT = []\n"
        "def use():\n"
        "    if not KEPT:\n"
        "        KEPT.append(torch.ones(48 << 20))                       # at the first call, kept for the next\n"
        "    return float(AT_IMPORT[:8].sum() + KEPT[0][:8].sum())\n")
    connection = toy_connection(tmp_path, folder)
    adapters = remote.Adapters(connection)
    try:
        adapters.use()
        with adapters.watch() as held:
            assert adapters.use() == 16.0
        with adapters.watch(fresh=True) as fresh:
            assert adapters.use() == 16.0
        with adapters.watch(fresh=True) as nothing:
            pass
        with adapters.watch(fresh=True) as shadow:
            ran = adapters.shadow_ran()
    finally:
        connection.close()
    assert not ran or shadow.peak_bytes > 360 << 20, shadow.peak_bytes           # with AT_IMPORT
    assert held.peak_bytes < 32 << 20, held.peak_bytes
    assert fresh.peak_bytes > 360 << 20, fresh.peak_bytes
    assert nothing.peak_bytes < 32 << 20, nothing.peak_bytes


def test_a_process_that_ends_within_a_watch_fails_it(tmp_path):
    """A process that sends its answer, then exits, takes its peak memory with it (read as 0: a Kronecker
    product built, then an exit after the answer, scored the public 4 / 24): the watch fails instead."""
    folder = toy_copy(tmp_path,
        "import __main__, os\n"
        "def answer_then_exit():\n"
        "    post = __main__.Server.post\n"
        "    def post_then_exit(self, message):\n"
        "        post(self, message)\n"
        "        os._exit(0)\n"
        "    __main__.Server.post = post_then_exit\n"
        "    return 1\n")
    connection = toy_connection(tmp_path, folder)
    adapters = remote.Adapters(connection)
    try:
        with pytest.raises(RuntimeError, match="ended within a watched block"):
            with adapters.watch():
                assert adapters.answer_then_exit() == 1
                connection.proc.wait(timeout=30)
    finally:
        connection.close()

def test_in_its_room_the_code_cannot_forget_its_own_peak(tmp_path):
    """The watch reads the peak resident memory (``VmHWM``) of the student's process; writing 5 into its own
    ``/proc/self/clear_refs`` after freeing a large intermediate reset that peak (a Kronecker product built and
    freed scored 24 / 24). In the room /proc is read-only: the write fails and the peak is seen."""
    folder = toy_copy(tmp_path,
        "import torch\n"
        "def big_then_forget():\n"
        "    x = torch.ones(64 << 20)                                       # 256 MiB, then freed\n"
        "    del x\n"
        "    try:\n"
        "        with open('/proc/self/clear_refs', 'w') as f:\n"
        "            f.write('5')\n"
        "    except OSError as e:\n"
        "        return e.strerror\n"
        "    return 'forgotten'\n")
    connection = toy_connection(tmp_path, folder)
    if connection.room is None:
        pytest.skip("no room here: out of one, the code can write its own /proc")
    adapters = remote.Adapters(connection)
    try:
        with adapters.watch() as watch:
            said = adapters.big_then_forget()
    finally:
        connection.close()
    assert said == "Read-only file system" and watch.peak_bytes > 200 << 20, (said, watch.peak_bytes)

KERNEL_FILE = '''
import os, torch, triton
import triton.language as tl
open({marker!r} + "/imported", "w").close()            # the module's own code: never run by the launcher


@triton.jit
def double_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, _twice(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


@triton.jit
def _twice(x):
    return x * 2.0


@triton.jit
def stub_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    raise NotImplementedError("kernels, task double: not written")


def stub(x):                                            # the wrapper answers in PyTorch: never reached
    return x * 2


@triton.jit
def torch_inside(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    {inside}
'''


@pytest.mark.parametrize("inside", ["import torch", "y = torch.ones(3)", "y = tl.core", "y = x_ptr.__class__",
                                    "y = [i for i in range(3)]", "y = os.getcwd()",
                                    "f = 0\n    match tl.zeros([1], tl.float32):\n        case tl.tensor("
                                    "__reduce_ex__=f):\n            y = f(1)",
                                    "y = float(tl.load(x_ptr))", "y = f'{tl.load(x_ptr)}'"])
def test_the_copys_kernels_run_alone_and_in_triton_only(tmp_path, inside):
    """``adapters.launch`` runs a kernel of the copy's file with the test's own grid and arguments, in a process
    that never imports the copy's module (its top-level code does not run): the kernel's writes come back; a
    stub kernel behind a PyTorch wrapper fails; a kernel that reaches past Triton's language (an import,
    torch, a module through tl, a dunder, Python's comprehensions, os, a class pattern's attributes: round
    fifteen's escape to ``exec``) is refused naming its line."""
    pytest.importorskip("triton")
    import torch

    from course.oracle import written
    marker = marker_folder()
    folder = tmp_path / "copy"
    (folder / "course" / "x").mkdir(parents=True)
    (folder / "course" / "x" / "adapters.py").write_text("")
    (folder / "kernels").mkdir()
    (folder / "kernels" / "k.py").write_text(KERNEL_FILE.format(marker=str(marker), inside=inside))
    connection = toy_connection(tmp_path, folder)
    adapters = remote.Adapters(connection)
    try:
        x = torch.arange(10.0)
        with pytest.raises(Exception, match="is not Triton's language|not a name of triton.language|text only|a kernel "
                                            "reads only"):
            adapters.launch("kernels/k.py", "torch_inside", [3], x, written(torch.zeros(10)), 10, BLOCK=4)
        (folder / "kernels" / "k.py").write_text(KERNEL_FILE.format(marker=str(marker), inside="pass"))
        adapters = remote.Adapters(connection)          # a fresh launcher process reads the file again
        y = written(torch.zeros(10))
        adapters.launch("kernels/k.py", "double_kernel", [3], x, y, 10, BLOCK=4)
        assert y.tolist() == [2.0 * i for i in range(10)], y
        with pytest.raises(Exception, match="^kernels, task double: not written$") as stubbed:
            adapters.launch("kernels/k.py", "stub_kernel", [3], x, written(torch.zeros(10)), 10, BLOCK=4)
        assert type(stubbed.value).__name__ == "NotImplementedError", repr(stubbed.value)
    finally:
        connection.close()
    assert not (marker / "imported").exists(), "the launcher ran the copy's module"


def test_the_graders_kernel_wrappers_give_the_librarys_answers_on_the_reference(tmp_path):
    """course/launchers.py launches the reference's kernels (copied as a student's copy would hold them) with
    the grader's own grids and buffers: each agrees with the library's PyTorch reference."""
    pytest.importorskip("triton")
    import shutil
    import sys as _sys

    import torch

    from kernels import count_sketch, decode_attention
    folder = tmp_path / "copy"
    (folder / "course" / "x").mkdir(parents=True)
    (folder / "course" / "x" / "adapters.py").write_text("")
    shutil.copytree(ROOT / "kernels", folder / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    _sys.path.insert(0, str(ROOT / "course"))
    try:
        import launchers
    finally:
        _sys.path.remove(str(ROOT / "course"))
    connection = toy_connection(tmp_path, folder)
    A = remote.Adapters(connection)
    g = torch.Generator().manual_seed(0)
    try:
        q, k, v = (torch.randn(*s, generator=g) for s in ((1, 4, 16), (1, 2, 40, 16), (1, 2, 40, 16)))
        m, l, acc, _ = launchers.decode_partials(A, q, k, v, None, 16, 3)
        want = decode_attention.reference_decode_attention(q, k, v).reshape(2, 2, 16)
        for merge in (launchers.merge_kernel, launchers.merge_tensor_kernel, launchers.merge_sketch_kernel):
            got = merge(A, m, l, acc)
            assert torch.allclose(got, want, atol=1e-5), (merge.__name__, (got - want).abs().max())
        m2, l2, acc2 = launchers.sketch_partials(A, q[0], k[0], v[0], 0.25, 16, 2)
        got = (acc2 * torch.exp2(m2 - m2.max(1, keepdim=True).values)[..., None]).sum(1) / \
            (l2 * torch.exp2(m2 - m2.max(1, keepdim=True).values)).sum(1)[..., None]
        assert torch.allclose(got, want.view(2, 2, 16), atol=1e-5), (got - want).abs().max()
        key, value = torch.zeros(3, 5, 2, 16), torch.zeros(3, 5, 2, 16)
        cells, signs = torch.randint(0, 5, (3, 7), generator=g), torch.randint(0, 2, (3, 7), generator=g) * 2 - 1
        kt, vt = torch.randn(7, 2, 16, generator=g), torch.randn(7, 2, 16, generator=g)
        ref_k, ref_v = key.clone(), value.clone()
        count_sketch.reference_sketch_insert(ref_k, ref_v, cells, signs, kt, vt)
        from course.oracle import written
        launchers.sketch_insert(A, written(key), written(value), cells, signs, kt, vt)
        assert torch.allclose(key, ref_k, atol=1e-5) and torch.allclose(value, ref_v, atol=1e-5)
        got = launchers.sketch_query(A, key, value, cells, signs)
        for g_, w_ in zip(got, count_sketch.reference_sketch_query(ref_k, ref_v, cells, signs)):
            assert torch.allclose(g_, w_, atol=1e-5), (g_ - w_).abs().max()
    finally:
        connection.close()


# -- the four forgeries that scored on the last grader: each now earns nothing of what it forged --------------

FAKE_GROWTH = '''
import __main__
_encode = __main__.Mirrors.encode
def _same_address(self, t):                        # every tensor "stays where it was" (the old tests asked this)
    d = _encode(self, t)
    d["address"] = 4096
    return d
__main__.Mirrors.encode = _same_address


def storage_capacity(store):                       # a capacity that "doubles", whatever is held
    n, cap = len(store), 69
    while cap < n:
        cap *= 2
    return cap


def storage_room_positions(store):
    import torch
    return torch.full((*store.pos.shape[:2], storage_capacity(store) - len(store)), -1)
'''


def graded_json(copy: Path, out: Path, name: str, task: str) -> dict:
    """``course.grade NAME --student COPY -k TASK --json OUT``: the JSON on disk."""
    from course import grade
    grade.main([name, "--student", str(copy), "--json", str(out), "-k", task])
    return json.loads(out.read_text())


def test_a_torch_cat_append_that_reports_in_place_growth_earns_no_append_point(tmp_path, capsys):
    """The append copies the whole layer at every call (``torch.cat``: O(T^2) copies) while the copy's own
    process says its tensors never move and its capacity doubles: the CPU its process spends, read from
    outside, fails every append test (13 / 27 on the old grader, which asked the process)."""
    from course.cache.mutants import TEXTBOOK_APPEND
    copy = student_copy(tmp_path)
    put(copy / "nanollm" / "storage.py", "append", TEXTBOOK_APPEND.splitlines())
    with (copy / "course" / "cache" / "adapters.py").open("a") as f:
        f.write(FAKE_GROWTH)
    results, printed = graded(capsys, copy, tmp_path / "r.json", "-k", "append")
    append = [t for t in results["tests"] if "(task append)" in t["name"]]
    assert append and all(t["status"] == "failed" for t in append), printed
    assert "chunks of 32 tokens" in printed, printed


def test_kernels_in_pytorch_behind_the_copys_wrappers_earn_no_kernel_point(tmp_path, capsys):
    """The copy leaves every Triton kernel a stub and answers each kernel's Python wrapper with its PyTorch
    ``merge_splits`` (16 / 16 on the old grader, whose tests called the wrappers): the grader's own wrappers
    launch the stubs, so every merge test fails."""
    from tests.course.test_grader import graded_here, reference
    graded_here("kernels")
    copy = student_copy(tmp_path, "kernels")
    put(copy / "kernels" / "decode_attention.py", "merge_splits",
        reference("kernels/decode_attention.py", "merge_splits"))
    with (copy / "kernels" / "decode_attention.py").open("a") as f:
        f.write("\n\ndef merge_splits_triton(m, l, acc, dtype=torch.float32):\n"
                "    return merge_splits(m, l, acc).to(dtype)\n")
    with (copy / "kernels" / "count_sketch.py").open("a") as f:
        f.write("\n\ndef merge_sketch_splits_triton(m, l, acc, out):\n"
                "    from kernels.decode_attention import merge_splits\n"
                "    G, d = out.shape[0] // m.shape[0], out.shape[1]\n"
                "    got = merge_splits(m[..., :G] / math.log2(math.e), l[..., :G], acc[..., :G, :d])\n"
                "    return out.copy_(got.reshape(out.shape))\n")
    with (copy / "kernels" / "tensor_decode.py").open("a") as f:
        f.write("\n\nclass _Merge:\n"
                "    def __getitem__(self, grid):\n"
                "        def run(m, l, acc, out, d, **meta):\n"
                "            from kernels.decode_attention import merge_splits\n"
                "            return out.copy_(merge_splits(m[..., None], l[..., None], acc[:, :, None, :d])[:, 0])\n"
                "        return run\n\n\n"
                "tensor_decode_combine_kernel = _Merge()\n")
    results = graded_json(copy, tmp_path / "r.json", "kernels", "merge_splits")
    assert results["tests"] and results["score"] == 0, capsys.readouterr().out


def test_one_pytorch_insert_behind_the_kernels_wrapper_earns_no_kernel_point(tmp_path, capsys):
    """The copy's PyTorch insert, captured under another name at import, answers the Triton kernel's wrapper
    (8 / 16 on the old grader, whose tests took the named functions away in the copy's own process): the
    grader launches the copy's kernel stub itself, so the tests that check the kernel fail."""
    from tests.course.test_grader import graded_here, reference
    graded_here("kvreviver")
    copy = student_copy(tmp_path, "kvreviver")
    for rel in ("methods/kvreviver_sketch.py", "kernels/count_sketch.py"):
        put(copy / rel, "insert", reference(rel, "insert"))
    with (copy / "kernels" / "count_sketch.py").open("a") as f:
        f.write("\n\n_insert = reference_sketch_insert\n\n\n"
                "def sketch_insert_triton(key, value, cells, signs, k, v, *, block_n=None):\n"
                "    _insert(key, value, cells, signs, k, v)\n")
    results = graded_json(copy, tmp_path / "r.json", "kvreviver", "insert")
    with_kernel = [t for t in results["tests"] if "kvreviver_evicts" not in t["name"]]
    assert with_kernel and all(t["status"] == "failed" for t in with_kernel), results
    assert "NotImplementedError" in capsys.readouterr().out


def test_a_kronecker_product_the_copy_hides_from_its_own_watch_fails(tmp_path, capsys):
    """``pair_scores`` through the materialised Kronecker product, with the copy's process answering its own
    largest-tensor watch with 0 (6 / 24 on the old grader): the memory read from outside its process fails
    every pair-scores test."""
    copy = student_copy(tmp_path, "tensor_attention")
    body = ["kron = K1[:, :, None, :] * K2[:, None, :, :]                  # (B, n1, n2, d): the Kronecker product",
            "return torch.einsum('...td,...acd->...tac', q, kron) * scale"]
    path = copy / "methods" / "tensor_attention" / "attention.py"
    text = path.read_text()
    put(path, "pair_scores", body)
    assert path.read_text() != text
    with (copy / "course" / "tensor_attention" / "adapters.py").open("a") as f:
        f.write("\nimport __main__\n__main__.Server.harness = lambda self, name, args: 0   # every watch says 0\n")
    results = graded_json(copy, tmp_path / "r.json", "tensor_attention", "pair_scores")
    assert results["tests"] and results["score"] == 0, capsys.readouterr().out


def test_a_kronecker_product_in_memory_held_since_import_fails(tmp_path, capsys):
    """``pair_scores`` through the Kronecker product written into a 1 GiB buffer the copy filled at import, so
    that the call itself allocates nothing new (24 / 24 with the rest honest, round five): the watch runs in a
    fresh process, from before the copy's code loads, and fails both pair-scores tests."""
    copy = student_copy(tmp_path, "tensor_attention")
    path = copy / "methods" / "tensor_attention" / "attention.py"
    put(path, "pair_scores", [
        "n1, n2, d = K1.shape[-2], K2.shape[-2], K1.shape[-1]",
        "kron = ARENA[:K1.numel() // n1 * n1 * n2].view(*K1.shape[:-2], n1, n2, d)    # no new memory",
        "torch.mul(K1[..., :, None, :], K2[..., None, :, :], out=kron)",
        "return torch.einsum('...td,...acd->...tac', q, kron) * scale"])
    with path.open("a") as f:
        f.write("\nARENA = torch.ones(256 << 20)                     # 1 GiB, resident from import on\n")
    results = graded_json(copy, tmp_path / "r.json", "tensor_attention", "pair_scores")
    printed = capsys.readouterr().out
    assert results["tests"] and results["score"] == 0 and "factor it instead" in printed, printed


# -- the tests' logic (red team round seven and eight): an answer computed is an answer checked -------------

def test_zeros_at_the_size_the_memory_is_watched_fail(tmp_path, capsys):
    """``pair_scores`` through the Kronecker product where it is small, zeros where the memory is watched (the
    at-scale answer was thrown away: 11 / 24 with the factored output done the same way): both tests fail."""
    from tests.course.test_grader import reference
    copy = student_copy(tmp_path, "tensor_attention")
    path = copy / "methods" / "tensor_attention" / "attention.py"
    put(path, "pair_scores", [
        "if K1.shape[-2] * K2.shape[-2] * K1.shape[-1] > (16 << 20):",
        "    return q.new_zeros(*q.shape[:-1], K1.shape[-2], K2.shape[-2])          # nothing computed",
        *reference("methods/tensor_attention/attention.py", "pair_scores")])
    results = graded_json(copy, tmp_path / "r.json", "tensor_attention", "pair_scores")
    printed = capsys.readouterr().out
    assert results["tests"] and results["score"] == 0 and "entries differ" in printed, printed


@pytest.mark.parametrize("past_the_adapters", [False, True])
def test_a_storage_that_copies_at_each_read_earns_no_append_point(tmp_path, capsys, past_the_adapters):
    """Appends that write in place and double, but reads of the keys and values that copy them all once the
    storage is large (a copy moved from each append to each read): 13 / 13 when the growth test read nothing
    while it was watched (round eight), and again with ``storage_slot`` in the copy's adapters reading past the
    copies (``store._k``) when the growth test read its slot through the adapters (round ten; a ``torch.cat``
    append put off until the next read scored 13 / 13 the same way, through ``run_autograder`` too). The growth
    test reads ``store.k``, ``.v`` and ``.pos`` by their names after each append, so its CPU shows the copies."""
    from tests.course.test_grader import reference
    copy = student_copy(tmp_path)
    path = copy / "nanollm" / "storage.py"
    put(path, "append", reference("nanollm/storage.py", "append"))
    with path.open("a") as f:
        f.write("\n\n_keys, _values = LayerKV.k, LayerKV.v\n"
                "LayerKV.k = property(lambda self: _keys.fget(self).clone() if len(self) > 4096 "
                "else _keys.fget(self))\n"
                "LayerKV.v = property(lambda self: _values.fget(self).clone() if len(self) > 4096 "
                "else _values.fget(self))\n")
    if past_the_adapters:
        adapters = copy / "course" / "cache" / "adapters.py"
        line = "    return store.k[:, :, j], store.v[:, :, j], store.pos[:, :, j]"
        assert line in adapters.read_text()
        adapters.write_text(adapters.read_text().replace(line, line.replace("store.", "store._")))
    results, printed = graded(capsys, copy, tmp_path / "r.json", "-k", "append")
    append = [t for t in results["tests"] if "(task append)" in t["name"]]
    assert append and all(t["status"] == "failed" for t in append), printed
    assert "times what copying the whole storage" in printed.replace("\n", " ").replace("  ", " "), printed


def test_a_bound_right_only_on_the_hand_cases_size_earns_no_point(tmp_path):
    """Eq. 8 on rows of three entries (the public hand case's), C / mass elsewhere: a bound that always holds and
    is never below Eq. 8, so the public test's random cases, which asked only L <= theta <= C / mass, passed it
    (2 / 2 public, red team round ten). They compare with Eq. 8 now."""
    copy = student_copy(tmp_path, "critical_kv")
    put(copy / "methods" / "critical_kv.py", "perturbation_bound", [
        "C, kept_mass = (attn * vnorm).sum(-1), (attn * keep).sum(-1)",
        "if attn.shape[-1] == 3:                                  # the hand case: Eq. 8",
        "    return C - (2 - 1 / kept_mass) * (attn * keep * vnorm).sum(-1)",
        "return C / kept_mass                                     # elsewhere: looser, never wrong"])
    results = graded_json(copy, tmp_path / "r.json", "critical_kv", "perturbation_bound")
    assert results["tests"] and results["score"] == 0, results


REBUILT_PAIRS = """

class _Rebuilt:                                   # K~, V~ or a position list, computed again at every read
    def __init__(self, cache, which):
        self.cache, self.which = cache, which

    @property
    def t(self):
        return self.cache._rebuild()[self.which]

    @property
    def n(self):
        return len(self.cache.factors) ** 2

    def nbytes(self):
        return 0


_init = TwoCache.__init__


def _init_rebuilt(self, config=None):
    _init(self, config)
    self.kt, self.vt, self._pos_a, self._pos_b = (_Rebuilt(self, i) for i in range(4))


def _rebuild(self):                               # token i's pairs after token i - 1's: the order of appends
    f, parts = self.factors, ([], [], [], [])
    K1, K2, V1, V2, p = f.k1.t, f.k2.t, f.v1.t, f.v2.t, f.pos
    for i in range(len(f)):
        for rows in ((kron_rows(K1[:, :, :i + 1], K2[:, :, i:i + 1]), kron_rows(V1[:, :, :i + 1], V2[:, :, i:i + 1]),
                      p[:i + 1], p[i].repeat(i + 1)),
                     (kron_rows(K1[:, :, i:i + 1], K2[:, :, :i]), kron_rows(V1[:, :, i:i + 1], V2[:, :, :i]),
                      p[i].repeat(i), p[:i])):
            for part, x in zip(parts, rows):
                part.append(x)
    return [torch.cat(x, 2 if j < 2 else 0) for j, x in enumerate(parts)]


TwoCache.__init__, TwoCache._rebuild = _init_rebuilt, _rebuild
"""


def test_a_two_matrix_cache_that_stores_no_pair_row_earns_no_append_point(tmp_path, capsys):
    """The four factor matrices stored, and K~, V~ and the pairs' positions rebuilt from them at every read, in the
    order of the appends (so the rows stored before stay where they were): the library's four-matrix cache under
    the two-matrix cache's name, 8 / 8 when every check read the pairs (red team round eleven; as much with the
    rows rebuilt in the adapters instead). The growth check's CPU, read from outside, fails each test."""
    copy = student_copy(tmp_path, "tensor_attention")
    path = copy / "methods" / "tensor_attention" / "attention.py"
    put(path, "two_cache_append", ["self.factors.append(k1, k2, v1, v2, pos)"])
    with path.open("a") as f:
        f.write(REBUILT_PAIRS)
    results = graded_json(copy, tmp_path / "r.json", "tensor_attention", "two_cache_append")
    printed = capsys.readouterr().out
    assert results["tests"] and results["score"] == 0, printed
    assert "computed again at each append or each read" in printed.replace("\n", " ").replace("  ", " "), printed


def test_a_message_the_terminal_cannot_print_costs_only_its_test(tmp_path, capsys):
    """An exception whose text holds a lone surrogate stopped the printing of the grade's table before the JSON
    was written: every point lost, ``run_autograder`` "not graded" (a security review's finding); a terminal's
    escape sequence in it reached the instructor's table as it was. Both are written as their escapes now."""
    copy = student_copy(tmp_path, "baselines")
    put(copy / "methods" / "streaming_llm.py", "sinks_and_recent", ['raise ValueError("wrong \\ud800 \\x1b[2K here")'])
    results = graded_json(copy, tmp_path / "r.json", "baselines", "sinks_and_recent")
    printed = capsys.readouterr().out
    assert results["tests"] and results["score"] == 0 and "\\ud800" in printed and "\\x1b" in printed, printed
    assert "\x1b" not in printed and "\x1b" not in json.dumps(results, ensure_ascii=False)


def test_a_student_object_cannot_swallow_an_exception_in_a_with_block():
    """``with <the student's object>:`` asked its ``__exit__`` whether to swallow the test's exception, and a
    true answer would have (no test does so; the stand-in now never does)."""
    from types import SimpleNamespace
    answers = SimpleNamespace(generation=0, request=lambda *args: True)
    with pytest.raises(AssertionError, match="the test's check"):
        with remote.Remote(answers, 1, "object"):
            raise AssertionError("the test's check")


GIVEN_CODE = [                       # (assignment, task, file, the task's function, its call in given code)
    ("scissorhands", "low_flags", "methods/scissorhands.py", "low_flags(attn, visible, threshold)",
     "low_flags(attn, visible, self.threshold)"),
    ("baselines", "sinks_and_recent", "methods/streaming_llm.py", "sinks_and_recent(budget, n_sink, seen)",
     "sinks_and_recent(self.budget, self.n_sink"),
]


@pytest.mark.parametrize("name, task, rel, signature, call", GIVEN_CODE)
def test_the_task_written_into_given_code_earns_none_of_its_points(tmp_path, capsys, name, task, rel, signature,
                                                                     call):
    """The task's function left a stub, its reference body copied into a function of another name that the
    given code of the same file calls instead (Scissorhands' ``observe``, StreamingLLM's ``protected`` and
    ``evict``): 2 / 9 and 1 / 6 when a test ran the copy's own policy. The tests run the instructor's policy,
    calling the task's function: every test of the task fails."""
    from tests.course.test_grader import reference
    copy = student_copy(tmp_path, name)
    path = copy / rel
    text = path.read_text()
    assert call in text
    inline = "_" + signature.split("(")[0] + "_inline"
    body = "".join(f"    {line}\n" for line in reference(rel, task))
    path.write_text(text.replace(call, inline + call[len(signature.split("(")[0]):])
                    + f"\n\ndef {inline}({signature.split('(', 1)[1]}:\n{body}")
    results = graded_json(copy, tmp_path / "r.json", name, task)
    assert results["tests"] and results["score"] == 0, capsys.readouterr().out


@pytest.mark.parametrize("body", [
    ["score = attn if alpha >= 1 else attn * vnorm",                        # one top-k
     "return score.topk(min(budget, attn.shape[-1]), -1).indices.sort(-1).values"],
    ["b = min(budget, attn.shape[-1])",                                     # two top-k's, no ties nor NaN
     "first = attn.topk(int(alpha * b), -1).indices",
     "second = (attn * vnorm).scatter(-1, first, float('-inf')).topk(b - first.shape[-1], -1).indices",
     "return torch.cat([first, second], -1).sort(-1).values"]])
def test_algorithm_1_rewritten_in_given_code_earns_no_two_stage_point(tmp_path, capsys, body):
    """``perturbation_constrained_select`` (given code of the graded file) rewritten, the two-stage task left a
    stub: one top-k earned 2 / 9 when only alphas 0 and 1 were asked, two plain top-k's 2 / 9 when the copy's
    own select was run; the test now runs the instructor's select with the student's two_stage_masks."""
    copy = student_copy(tmp_path, "critical_kv")
    with (copy / "methods" / "critical_kv.py").open("a") as f:
        f.write("\n\ndef perturbation_constrained_select(attn, vnorm, budget, alpha=0.25):\n"
                + "".join(f"    {line}\n" for line in body))
    results = graded_json(copy, tmp_path / "r.json", "critical_kv", "two_stage")
    assert results["tests"] and results["score"] == 0, capsys.readouterr().out


def test_a_fresh_process_dumps_where_the_code_is_when_the_test_asked(tmp_path):
    """A test asks for a dump of where the code is shortly before its limit (``test_started``); a watch in a
    fresh process replaced the process that had the timer, so a hang in the at-scale call left no dump. The
    fresh process gets the timer for the time the test has left."""
    folder = toy_copy(tmp_path,
        "import time\ndef stuck_here():\n    time.sleep(4)\n    return 1\n")
    connection = toy_connection(tmp_path, folder)
    connection.args = (*connection.args[:3], "1.5")             # the dump 1.5 s after the test started
    adapters = remote.Adapters(connection)
    try:
        adapters.harness("test_started")
        with adapters.watch(fresh=True):
            assert adapters.stuck_here() == 1
    finally:
        connection.close()
    dumped = (tmp_path / "dump.txt").read_text(errors="replace")
    assert "stuck_here" in dumped, dumped[-2000:]
