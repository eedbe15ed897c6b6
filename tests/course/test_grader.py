"""
The grader (``course.grade``) and its Gradescope package (``course.gradescope``): what an instructor trusts
with a class.

* Flags are checked before any work, each refusal one ``error:`` line with exit status 2.
* A test that crashes the interpreter, or loops while catching every exception, fails alone (the grader
  stops it from outside the test process) and the run ends in bounded time.
* A library file that does not import fails only the tasks that use it, with the error's type, file and line;
  a missing module is never borrowed from an installed checkout, nor code from the repository's own tests.
* The JSON carries each failure in a few lines and the notes (changed adapters).
* The Gradescope zip, unpacked and run, gives the reference full marks and the untouched copy zero.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from course import grade, gradescope, handout, submit
from course.assignments import ASSIGNMENTS, ROOT
from course.markers import find_regions
from course.sandbox import confine, remote
from tests.commands import refused


def graded_here(name: str) -> None:
    """Skip, saying why, where the grader refuses to grade ``name`` here (``grade.interpreter_refusal``: its
    tests run Triton kernels in an interpreter that cannot run them; checked below)."""
    if why := grade.interpreter_refusal(ASSIGNMENTS[name]):
        pytest.skip(why)


def student_copy(tmp_path: Path, name: str = "cache") -> Path:
    """The untouched student copy of ``name``."""
    out = tmp_path / f"{name}-copy"
    handout.student_copy(ASSIGNMENTS[name], out)
    return out


def full_copy(tmp_path: Path) -> Path:
    """Every file of the repository, solutions and all: a submission that should get full marks."""
    out = tmp_path / "full"
    for rel in handout.repository_files():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, out / rel)
    return out


def reference(rel: str, task: str) -> list[str]:
    """The reference lines of ``task``'s region in the file ``rel``, without the region's indentation."""
    path = ROOT / rel
    r = next(r for r in find_regions(path) if r.task == task)
    return [line[len(r.indent):] for line in r.body(path.read_text().splitlines())]


def toy_connection(tmp_path: Path, folder: Path, home: Path | None = None) -> remote.Connection:
    """A connection to a student's process for the toy copy ``folder`` (its ``course/x/adapters.py``), started as
    the grader starts one: in its room, and there as nobody where this runs as root (never as root: as root
    with no room, the test skips)."""
    home = home or tmp_path / "toy-home"
    home.mkdir(exist_ok=True)
    for p in [folder, *folder.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    spec, why = confine.room(Path(tempfile.mkdtemp(prefix="toy-room-", dir=tmp_path)), folder, home,
                             grade.site_dirs(), ROOT)
    if spec is None and os.geteuid() == 0:
        pytest.skip(f"as root the student's code runs only in a room, and none can be built here: {why}")
    return remote.Connection(str(folder), str(folder / "course" / "x" / "adapters.py"), grade.site_dirs(),
                             str(tmp_path / "dump.txt"), 60.0, str(home), nobody=False,
                             jail=confine.jailed([]) if spec else None,
                             room=confine.spec_bytes(spec).decode() if spec else None)


def put(path: Path, task: str, body: list[str]) -> None:
    """Write ``body`` (lines without indentation) in place of ``task``'s stub in a student file."""
    lines = path.read_text().splitlines()
    i = next(n for n, line in enumerate(lines) if "raise NotImplementedError(" in line and f"task {task}:" in line)
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    lines[i:i + 1] = [indent + b if b else b for b in body]
    path.write_text("\n".join(lines) + "\n")


# -- flags: checked before any work, one line each -----------------------------------------------------------

def test_command_line_errors(tmp_path, capsys, monkeypatch):
    assert "no assignment 'nope'; choose one of: cache" in refused(capsys, handout.main,
                                                                   ["nope", "--out", str(tmp_path / "x")])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("")
    assert "exists and is not empty" in refused(capsys, handout.main, ["cache", "--out", str(tmp_path / "full")])
    assert "inside the repository" in refused(capsys, handout.main, ["cache", "--out", str(ROOT / "course" / "x")])
    assert "--out" in refused(capsys, handout.main, ["cache"])              # argparse's errors: one line too

    monkeypatch.setattr(grade, "run_tests", lambda *a, **kw: pytest.fail("graded despite a bad flag"))
    (tmp_path / "r.json").write_text("{}")
    assert "exists; name a new file" in refused(capsys, grade.main, ["cache", "--json", str(tmp_path / "r.json")])
    assert "does not exist" in refused(capsys, grade.main, ["cache", "--json", str(tmp_path / "no" / "r.json")])
    for value in ["nan", "inf", "-inf", "0", "-1"]:
        err = refused(capsys, grade.main, ["cache", f"--per-test-s={value}"])
        assert "--per-test-s must be a positive, finite number" in err, err
    assert "invalid float value" in refused(capsys, grade.main, ["cache", "--per-test-s", "soon"])
    assert "no task 'nope' in 'cache'; its tasks: " in refused(capsys, grade.main, ["cache", "-k", "nope"])
    assert "no assignment 'nope'" in refused(capsys, grade.main, ["nope"])
    assert "no folder" in refused(capsys, grade.main, ["cache", "--student", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="no course/cache/adapters.py"):
        grade.grade("cache", tmp_path)

    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "cache-autograder.zip").write_text("")
    assert "exists; name another --out" in refused(capsys, gradescope.main, ["cache", "--out", str(tmp_path / "dist")])
    assert "no assignment 'nope'" in refused(capsys, gradescope.main, ["nope", "--out", str(tmp_path)])
    assert "--out" in refused(capsys, gradescope.main, ["cache"])


@pytest.mark.parametrize("link,target", [("methods", "/proc/self/cwd/methods"),
                                         ("methods/chunkkv.py", str(ROOT / "methods" / "chunkkv.py"))])
def test_a_pack_holding_a_link_is_refused_before_anything_is_laid_out(tmp_path, link, target):
    """A pack is laid over a fresh copy as the grader's user, before the room: a link in it (a folder
    ``methods`` -> ``/proc/self/cwd/methods``, the grader's own library wherever it runs) would grade the
    reference solutions. Refused in one line naming the link, and no copy is made."""
    pack = tmp_path / "pack"
    (pack / "course" / "chunkkv").mkdir(parents=True)
    (pack / submit.MANIFEST).write_text(json.dumps({"assignment": "chunkkv", "files": []}))
    (pack / "course" / "chunkkv" / "adapters.py").write_text((ROOT / "course/chunkkv/adapters.py").read_text())
    (pack / link).parent.mkdir(parents=True, exist_ok=True)
    (pack / link).symlink_to(target)
    for lay_out in (lambda: submit.lay_over(pack, "chunkkv", tmp_path / "laid"), lambda: grade.grade("chunkkv", pack)):
        with pytest.raises(SystemExit) as e:
            lay_out()
        assert str(e.value) == f"error: {pack} holds a link, {link} -> {target}: a pack of python -m " \
                               "course.submit holds plain files only"
    assert not (tmp_path / "laid").exists()


@pytest.mark.parametrize("body", [
    "inspect.builtins.exec('import torch', {})",             # a module Triton's interpreter puts in the namespace
    "[tl][0].core.builtins.exec('import torch', {})",        # tl reached through a list, then a module of it
    "t = tl\n    t.core",                                     # tl under another name
    "x = tl.load(p)\n    x.handle.data.tofile('x')",          # the interpreter's array under a tensor
    "tl.core.builtins",                                      # a module of triton.language
    "f = 0\n    match tl.zeros([1], tl.float32):\n        case tl.tensor(__reduce_ex__=f):\n            f(1)",
    # a class pattern reads any attribute: __reduce_ex__ gave `object`, then __globals__ (round fifteen)
    "x = {'p': p}",                                          # syntax outside what a kernel may use (a dict)
    "x = (tl := p)",                                         # tl rebound, by a walrus as by an assignment
    "x = f'{tl.load(p)}'",                                   # a tensor's data as text (round sixteen)
    "x = '%s' % tl.load(p)",
    "n = 0\n    for i in range(tl.load(p)):\n        n += 1\n    x = 2.0 ** n",   # a power of a number counted out
    "N = tl.load(p)\n    x = f'{N}'",                      # a constexpr's name given a tensor (round seventeen)
    "tl.store(p, float(f'{N}') if (N := tl.load(p)) is not None else 0)",     # the same by a walrus
    "for i in range(tl.load(p)):\n        N += 1\n    x = 2.0 ** N",      # a count under a constexpr's name
    "x = f'%s' % tl.load(p)",                                # text held in a value, then formatted: the data as text
    "fmt = '%s'\n    x = fmt % tl.load(p)",
    "x = ['%s'][0] % tl.load(p)",
    "s = '%s'\n    s %= tl.load(p)",
    "x = '0123456789'[tl.load(p)]",
    "x = 2.718\n    x **= 2.0",                             # ** by assignment (a Python float in the interpreter)
    "tl.tensor.T = tl.tensor.to",                            # Triton's classes rewritten for the kernels after
    "fmt = tl.multiple_of(input='%r', values=1)",            # a tl function handing its keyword's text back
    "fmt = tl.constexpr_type(value='%f').value",             # (round eighteen)
    "x = b'%a' % tl.load(p)",                                # bytes are text too
    "k(p, tl.load(p))",                                      # a call of itself, its constexpr given a tensor
    "x = [0.5, 1.5][tl.load(p).to(tl.int32)]",               # Python values chosen by the data
    "table = (0.5, 1.5)\n    x = table[tl.load(p).to(tl.int32)]",
    "y = len(range(-1, tl.load(p)))",                         # a range's bounds read the data (round nineteen)
    "x = range(100)[tl.load(p)]",
    "r = range(tl.load(p))",
    "f = range\n    r = f(0, tl.load(p))\n    x = len(r)",     # a built-in handed on (round twenty)
    "t: tl.tensor = [0.5, 1.5]\n    x = t[tl.load(p).to(tl.int32)]",    # a list indexed by data, however bound
    "s = tl.zeros([4, 4], tl.float32).shape\n    u = s[0:tl.load(p)]",
    "steps = tl.static_range\n    r = steps(0, tl.load(p))",    # a range handed on (round twenty-one)
    "e = max([(tl.load(p) == 1, 2.718), (tl.load(p) == 2, 7.389)])[1]",   # Python values chosen by the data
    "c = [tl.load(p), tl.load(p + 1)]\n    c.sort()",
    "t = [0.5, 1.5] if tl.load(p) > 2.5 else [2.5, 3.5]",
    "x = tl.sum(tl.load(p + tl.arange(0, N)), axis=tl.load(p) - 2)",
    "for t in tl.tuple_type([(tl.load(p) == 2.0, 7.389)]):\n        x = t[1]",   # a table given to tl.<name>
    "y = tl.topk(tl.load(p + tl.arange(0, N)), k=tl.load(p).to(tl.int32))",      # a count from the data
    "y = tl.gather(tl.load(p + tl.arange(0, N)), tl.arange(0, N), tl.load(p).to(tl.int32))",
    "dt = (tl.load(p) > 2.5) and tl.float16 or tl.int8",     # a dtype chosen by the data
    "x = tl.load(p)\n    assert x < 0, x",                     # a test's inputs in the grader's message
    "tl.static_assert(False, tl.load(p))",
])
def test_a_kernel_that_leaves_tritons_language_is_refused(body):
    """The kernels' process checks each kernel's syntax, not its namespace: each of these ran PyTorch as a kernel
    or could (kernels 16 / 16, kvreviver 16 / 16 before). The library's graded kernels pass."""
    from course.sandbox.student_process import NotTriton, check_triton_only, jit_functions, language_names
    fn = jit_functions(ast.parse(f"@triton.jit\ndef k(p, N: tl.constexpr):\n    {body}\n"))["k"]
    with pytest.raises(NotTriton):
        check_triton_only(fn, language_names(), "k.py", {"k"})
    graded = {f for a in ("kernels", "kvreviver") for f in ASSIGNMENTS[a].library if f.startswith("kernels/")}
    for file in sorted(graded):
        found = jit_functions(ast.parse((ROOT / file).read_text()))
        for fn in found.values():
            check_triton_only(fn, language_names(), file, set(found))


HELPERS = """
@triton.jit
def as_text(x, N: tl.constexpr):
    return f'{N}'


@triton.jit
def via_helper(x_ptr, out_ptr, N: tl.constexpr):
    t = as_text(x_ptr, tl.load(x_ptr + tl.arange(0, N)))
    tl.store(out_ptr, len(t))


@triton.jit
def handed_on(x_ptr, N: tl.constexpr):
    tl.store(x_ptr, tl.reduce(tl.load(x_ptr + tl.arange(0, N)), 0, as_text))


@triton.jit
def ping(x):
    return pong(x)


@triton.jit
def pong(x):
    return ping(x) if x > 0 else [x]


@triton.jit
def shadow(E):
    return 2.0 ** E


@triton.jit
def scale(x, F: tl.constexpr):
    return x * F


@triton.jit
def fine(x_ptr, N: tl.constexpr):
    tl.store(x_ptr, scale(tl.load(x_ptr), N + 1) + scale(1.0, F=tl.constexpr(-2)))
"""


def test_a_helpers_constexpr_parameters_take_constants():
    """``launch`` checks the constexpr arguments of the kernel it launches; a helper's, given a tensor by its
    caller, was a constant to the checks inside it, and ``f'{N}'`` there gave the block's data as text (round
    seventeen). A call gives a helper's constexpr parameters constants; a kernel with such parameters is called,
    not handed on as a function."""
    from course.sandbox.student_process import NotTriton, check_triton_only, jit_functions, language_names
    found = jit_functions(ast.parse(HELPERS))
    check = lambda name: check_triton_only(found[name], language_names(), "k.py", set(found), found)   # noqa: E731
    check("fine")
    with pytest.raises(NotTriton, match=r"as_text\(N=tl.load"):
        check("via_helper")
    with pytest.raises(NotTriton, match="is called, not handed on"):
        check("handed_on")
    with pytest.raises(NotTriton, match="calls ping back"):                # recursion through a helper
        check("ping")
    with pytest.raises(NotTriton, match="a tuple returned"):               # a list handed back (round twenty-two)
        check_triton_only(found["pong"], language_names(), "k.py", {"ping", "pong"})
    with pytest.raises(NotTriton, match=r"\*\* of a value known only when the kernel runs"):   # a parameter named E
        check_triton_only(found["shadow"], language_names(), "k.py", set(found) | {"E"}, found)   # as a constant


@pytest.mark.parametrize("header", ["def k(p) -> tl.core.builtins.exec('import torch'):",   # read at def time
                                    "def k(p: exec('import torch')):",                        # without the
                                    "def k(p=exec('import torch')):"])                        # __future__ import
def test_a_kernels_annotations_and_defaults_are_triton_too(header):
    """What Python evaluates when it defines a kernel (its annotations, its defaults) is checked as its body."""
    from course.sandbox.student_process import NotTriton, check_triton_only, jit_functions, language_names
    fn = jit_functions(ast.parse(f"@triton.jit\n{header}\n    pass\n"))["k"]
    with pytest.raises(NotTriton):
        check_triton_only(fn, language_names(), "k.py", {"k"})


ORDINARY_TRITON = """from __future__ import annotations
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
NEG = tl.constexpr(-1)
NEG_INF = tl.constexpr(float("-inf"))
DT = tl.float32


@triton.jit
def exp_of(x) -> tl.tensor:
    return tl.math.exp2(x * LOG2E)


@triton.jit
def times(x, F: "tl.constexpr"):
    return x * F


@triton.jit(do_not_specialize=["n"])
def ordinary(x_ptr, n, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.static_assert(len(offs.shape) == 1, f"one axis of {N}")
    x = tl.load(x_ptr + offs, mask=(inside := offs < n), other=NEG_INF, eviction_policy="evict_last").to(DT)
    tl.store(x_ptr + offs, times(exp_of(tl.maximum(x, NEG_INF)), -NEG), mask=inside)


HAS_TRITON = True
if HAS_TRITON:
    TWICE = tl.constexpr(2.0)


@triton.jit
def rounded(x_ptr, y_ptr, N: tl.constexpr, IEEE: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs, eviction_policy="evict_last" if IEEE else "evict_first")
    tl.store(y_ptr + offs, (x * TWICE).to(tl.bfloat16, fp_downcast_rounding="rtne"))


@triton.jit
def scalar_masked(x_ptr, y_ptr, n, N: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + t * N + offs, mask=(offs < N) & (t < n), other=0.0)
    tl.store(y_ptr + t * N + offs, x, mask=t < n)


@triton.jit
def refused(x_ptr):
    tl.store(x_ptr, tl.core.builtins.exec("import torch"))
"""


def test_ordinary_triton_runs_and_a_refused_kernel_costs_only_its_own_launch(tmp_path, monkeypatch):
    """Constructs of Triton's own tutorials and compiler that the kernels' process refused, zeroing every task of the
    file (a helper's correct kernels, 0 / 16 each): ``tl.math.exp2`` (as ``tl.exp2``), a module-level ``tl.constexpr``
    constant, a return annotation (never run: Triton does not read it), ``len``; then (round sixteen) a negative
    constant, ``float("-inf")``, a dtype constant, ``do_not_specialize`` and an f-string of a constexpr; a walrus
    (``:=``, which Triton's compiler reads as an assignment), a helper given a constant for its constexpr
    parameter (quoted), a keyword of text (``eviction_policy``); then (2026-12-02, a false-negative reader's, 0 / 8
    each) a constant in a top-level ``if`` block (the library's ``if HAS_TRITON:``), a keyword of text on a tensor's
    ``.to``, a ternary of texts. They run now; a kernel leaving Triton's language is refused when it is launched, not
    when a file's other kernel is."""
    pytest.importorskip("triton")
    import torch

    from course.sandbox.student_process import KernelsAlone, NotTriton
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (tmp_path / "k.py").write_text(ORDINARY_TRITON)
    alone, x = KernelsAlone(tmp_path), torch.randn(8)
    want = x.exp()
    alone.launch("k.py", "ordinary", [1], [x, 8], {"N": 8})
    torch.testing.assert_close(x, want)
    y = torch.empty(8, dtype=torch.bfloat16)
    alone.launch("k.py", "rounded", [1], [x, y], {"N": 8, "IEEE": True})
    assert torch.equal(y, (x * 2).to(torch.bfloat16))        # rounded to the nearest, as on a GPU (as_on_a_gpu)
    with pytest.raises(NotTriton, match="k.py, line"):
        alone.launch("k.py", "refused", [1], [x], {})


def test_a_scalar_mask_runs_in_the_kernels_process(tmp_path, monkeypatch):
    """A mask of two scalars (``t < n``, alone over a block or joined to a block's) is an i1 on a GPU and int32 in
    Triton's interpreter, which refuses it ("mask has unsupported dtype", Triton 3.9): a helper's correct insert
    kernel had 2 / 8. The kernels' process takes it as a GPU does (``as_on_a_gpu``), with the library's own mend
    (``kernels.take_any_mask``, which that process never imports) undone here."""
    pytest.importorskip("triton")
    import torch
    from triton.runtime.interpreter import InterpreterBuilder

    from course.sandbox.student_process import KernelsAlone
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in ("create_masked_load", "create_masked_store", "create_atomic_rmw"):
        op = getattr(InterpreterBuilder, name)
        while hasattr(op, "unmended") or hasattr(op, "plain"):
            op = getattr(op, "unmended", None) or op.plain
        monkeypatch.setattr(InterpreterBuilder, name, op)
    (tmp_path / "k.py").write_text(ORDINARY_TRITON)
    x, y = torch.arange(1.0, 25.0), torch.zeros(24)
    KernelsAlone(tmp_path).launch("k.py", "scalar_masked", [3], [x, y, 2], {"N": 8})
    assert torch.equal(y[:16], x[:16]) and not y[16:].any()


DEFAULTS_ESCAPE = """import triton
import triton.language as tl


@triton.jit
def nothing():
    return None


@triton.jit
def grab(L, s, _patch_attr):
    _patch_attr(L[0][2], "exec", 0, 0, s)
    L[1][2]("import builtins, inspect, torch\\nbuiltins.exec = E\\ninspect.builtins = builtins\\n"
            "open('MARKER', 'w').write(torch.__version__)", {"__builtins__": L[0][2], "E": L[1][2]})
    return 0


@triton.jit
def start(L, type, _LangPatchScope, _patch_attr, inspect):
    _patch_attr(inspect, "builtins", 0, 0, type("S", (_LangPatchScope,), {"__init__": nothing, "_changes": L})())
    return grab(L, type("S", (_LangPatchScope,), {"__init__": nothing, "_changes": L})(), _patch_attr)


@triton.jit
def k(x, _=nothing(), _tuple_create=0, TensorHandle=0, _LangPatchScope=0, _patch_attr=0, inspect=0,
      __=start([], _tuple_create(TensorHandle, TensorHandle), _LangPatchScope, _patch_attr, inspect)):
    tl.store(x + tl.arange(0, 4), tl.load(x + tl.arange(0, 4)) + 1.0)
"""


def test_a_kernels_defaults_cannot_run_code_when_it_is_defined(tmp_path, monkeypatch):
    """Python evaluates a kernel's defaults in the module's scope, where the check had read them as the kernel's
    own names: a default calling a kernel filled the namespace with Triton's interpreter's globals, and later
    defaults built ``exec`` from them and imported torch (a red-team helper's escape: it wrote a file). Defaults
    and annotations are literals, ``tl.<name>`` or the file's constants now; a float constant too large is
    ``inf`` (it was written ``inf``, a NameError for the whole file); a constant or a kernel named as a keyword of
    ``triton.jit`` (which the interpreter binds when it evaluates defaults again) is refused."""
    pytest.importorskip("triton")
    import torch

    from course.sandbox.student_process import KernelsAlone, NotTriton
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    marker = tmp_path / "escaped"
    (tmp_path / "k.py").write_text(DEFAULTS_ESCAPE.replace("MARKER", str(marker)))
    with pytest.raises(NotTriton, match="defaults and annotations are literals|Dict is not Triton's|text only"):
        KernelsAlone(tmp_path).launch("k.py", "k", [1], [torch.zeros(4)], {})    # (start's class dict: round 15)
    assert not marker.exists()
    (tmp_path / "c.py").write_text("import triton\nimport triton.language as tl\nBIG = tl.constexpr(1e999)\n\n\n"
                                   "@triton.jit\ndef big(x, c=BIG, n: tl.constexpr = -1):\n    tl.store(x, c)\n")
    x = torch.zeros(1)
    KernelsAlone(tmp_path).launch("c.py", "big", [1], [x], {})
    assert x.item() == float("inf")
    (tmp_path / "r.py").write_text("import triton\nimport triton.language as tl\nrepr = tl.constexpr(1.0)\n")
    with pytest.raises(NotTriton, match="repr: a constant kernels read takes a name of its own"):
        KernelsAlone(tmp_path).kernels_of("r.py")


def test_a_transposed_tensor_crosses_as_a_transpose():
    """The model's queries are a transpose, not contiguous: a tensor crosses between the processes with its
    axes' order in memory, so code that reads it with ``.view`` fails in the grade as it does in the model (it
    passed every test while inputs crossed contiguous); other layouts (a slice) cross contiguous; an order that
    is not a permutation of the axes is refused."""
    import torch

    from course.sandbox import student_process as wire

    def cross(t, **changed):
        d = wire.pack(t)
        return wire.unpack({**d, "bytes": bytearray(d["bytes"]), **changed})
    q = torch.randn(2, 5, 3, 4).transpose(1, 2)                       # (B, H, T, d) from (B, T, H, d)
    got = cross(q)
    assert torch.equal(got, q) and got.stride() == q.stride(), (got.stride(), q.stride())
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        got.view(2, 15, 4)
    part = torch.randn(4, 6)[:, ::2]
    assert torch.equal(cross(part), part) and cross(part).is_contiguous()
    for order in ([0, 0, 1, 3], [0, 2, 1], {0: 0, 1: 0, 2: 0, 3: 0}, [0.0, 2.0, 1.0, 3.0]):
        with pytest.raises(ValueError, match="axis order"):
            cross(q, order=order)


def test_a_kernel_holding_its_stub_runs_as_the_stub_alone():
    """In a student copy a graded kernel keeps the code after its task's stub, which reads what the task computes
    (``s`` here): the kernels' process runs it as the stub alone, which raises the stub's hint (the untouched
    copy failed "not Triton" for ``s``); a kernel without a stub is checked and run as it is."""
    from course.sandbox.student_process import (
        check_triton_only,
        jit_functions,
        language_names,
        stub_hint,
        stub_only,
        written_again,
    )
    text = ("@triton.jit\ndef k(p):\n    x = tl.load(p)\n"
            "    raise NotImplementedError('kernels, task t: a hint')   # your code here\n    tl.store(p, s)\n"
            "@triton.jit\ndef done(p):\n    tl.store(p, tl.load(p))\n")
    found = jit_functions(ast.parse(text))
    assert stub_hint(found["done"]) is None and stub_hint(found["k"]) == "kernels, task t: a hint"
    stub = stub_only(found["k"], stub_hint(found["k"]))
    check_triton_only(stub, language_names(), "k.py", set(found))
    assert written_again(stub) == "@triton.jit\ndef k(p):\n    raise NotImplementedError('kernels, task t: a hint')"


def test_the_kernel_that_runs_is_the_kernel_that_was_checked():
    """The kernels' process runs each checked kernel written again from its syntax tree. Cut from the file's
    text, form feeds in a comment (``str.splitlines`` cuts there, Python does not) moved the cut into a string
    whose text ran as the kernel, and Triton's interpreter ran a ``def`` written in a docstring (its last line
    starting with ``def``): merge_splits 8 / 8 in PyTorch, both ways."""
    from course.sandbox.student_process import check_triton_only, jit_functions, language_names, written_again
    escape = "def k(p):\n    tl.core.builtins.exec('import torch')\n"
    text = (f'@triton.jit\ndef k(p):\n    """{escape}"""\n    # \x0c\x0c\n'
            f'    tl.static_assert(True, """\n{escape}""")\n    raise NotImplementedError\n')
    fn = jit_functions(ast.parse(text))["k"]
    check_triton_only(fn, language_names(), "k.py", {"k"})
    again = written_again(fn)
    assert [line for line in again.splitlines() if line.strip().startswith("def ")] == ["def k(p):"], again
    assert ast.dump(ast.parse(again).body[0]) == ast.dump(ast.FunctionDef(**{**vars(fn), "body": fn.body[1:]}))


def test_an_interpreter_that_cannot_run_the_kernels_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """Where Triton's CPU interpreter cannot run the kernels (``kernels.interpreter_problem``: Triton before
    3.7 under numpy 2.4 or later), grading an assignment whose tests run them stops before anything is copied
    or started, in one line that says what to install, and so is a Gradescope zip whose pins are that pair;
    the other assignments, other versions and a grade that does not use the interpreter (TRITON_INTERPRET=0)
    are not refused."""
    versions = {"triton": "3.6.0", "numpy": "2.5.2"}            # what the graded processes would import
    monkeypatch.setattr(grade, "child_version", versions.get)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)       # the grader's default: the interpreter
    monkeypatch.setattr(grade.confine, "scratch_copy", lambda *a: pytest.fail("graded despite the interpreter"))
    err = refused(capsys, grade.main, ["kernels"])
    assert "the kernels assignment's tests run Triton kernels in its CPU interpreter" in err, err
    assert "triton>=3.7" in err, err
    assert "numpy<2.4" in refused(capsys, grade.main, ["kvreviver"])
    assert gradescope.main(["kernels", "--out", str(tmp_path / "ok")]) is None     # the zip pins its own versions
    pins = "torch==2.9.1\nnumpy==2.5.2\ntriton==3.6.0; sys_platform == \"linux\"\n"   # a pair that cannot
    monkeypatch.setattr(gradescope, "requirements", lambda: pins)
    assert "pins versions under which" in refused(capsys, gradescope.main, ["kernels", "--out", str(tmp_path / "no")])
    assert not (tmp_path / "no").exists()                       # no zip written
    assert grade.interpreter_refusal(ASSIGNMENTS["cache"]) is None
    versions["numpy"] = "2.3.5"
    assert grade.interpreter_refusal(ASSIGNMENTS["kernels"]) is None
    versions["numpy"] = "2.5.2"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert grade.interpreter_refusal(ASSIGNMENTS["kernels"]) is None


# -- what is recorded, and how a failure reads -----------------------------------------------------------------

def test_a_failure_reads_in_a_few_lines():
    close = ("AssertionError: the window's votes are summed over its queries\n\nMismatched elements: 3 / 8 (37.5%)\n"
             "Greatest absolute difference: 0.217 at index (0, 2) (up to 1e-05 allowed)\n"
             "Greatest relative difference: 0.88 at index (0, 2) (up to 1.3e-06 allowed)")
    assert grade.message(close).count("\n") == 3                          # blank lines go, the rest stays
    assert grade.first_line(close) == ("AssertionError: the window's votes are summed over its queries "
                                       "Greatest absolute difference: 0.217 at index (0, 2) (up to 1e-05 allowed)")
    long = "AssertionError: assert x\n" + "\n".join(f"  line {i}" for i in range(40)) + "\n" + close
    short = grade.message(long)
    assert short.count("\n") == grade.MESSAGE_LINES - 1 and "Greatest absolute difference: 0.217" in short
    assert len(grade.message("E" * 5000)) == grade.MESSAGE_CHARS
    raised = ("NotImplementedError: cache, task append: grow the buffer\n"
              "(raised in nanollm/storage.py, line 71, in append)")
    assert grade.first_line(raised) == ("NotImplementedError: cache, task append: grow the buffer "
                                        "(raised in nanollm/storage.py, line 71, in append)")   # the table's "why"


def test_outcomes_of_one_test_process(tmp_path):
    """A parametrized test passes only if every case does; a crash fails the running test alone; a file
    that did not import fails its tests; tests never reached wait for a fresh process."""
    path = tmp_path / "results.jsonl"
    records = [("collect", "test_hidden.py", "SyntaxError: invalid syntax (methods/snapkv.py, line 3)"),
               ("start", "test_a[llama]", ""), ("passed", "test_a[llama]", ""),
               ("start", "test_a[gpt2]", ""), ("failed", "test_a[gpt2]", "AssertionError: off"),
               ("start", "test_b", ""), ("passed", "test_b", ""),
               ("start", "test_c", "")]                                    # the process died in test_c
    path.write_text("".join(json.dumps({"kind": k, "name": n, "message": m}) + "\n" for k, n, m in records)
                    + '{"kind": "pass')                                      # a line cut short by the kill
    found = grade.read_results(path)
    assert found.running == "test_c" and found.starts == 4
    node = {n: f"test_public.py::{n}" for n in ["test_a", "test_b", "test_c", "test_d"]}
    node["test_h"] = "test_hidden.py::test_h"
    new = grade.round_outcomes(list(node), node, found, -11, None, "", 60, 600, "")
    assert new["test_a"] == ("failed", "[gpt2] AssertionError: off") and new["test_b"] == ("passed", "")
    assert new["test_c"] == ("failed", "the test process stopped (exit code -11) in this test")
    assert new["test_h"][1].startswith("test_hidden.py could not be collected: SyntaxError: invalid syntax")
    assert "test_d" not in new                                              # left for a fresh process
    stopped = grade.round_outcomes(["test_c", "test_d"], node, found, None, "test", "", 2, 600,
                                   ", in nanollm/attention.py, line 9 (attend)")
    assert stopped == {"test_c": ("failed", "ran over 2 s, in nanollm/attention.py, line 9 (attend): the grader "
                                            "stopped it (a loop that never ends, or far too much work?)")}
    finished = grade.round_outcomes(["test_d"], node, found, 1, None, "ERROR: not found: test_d", 60, 600, "")
    assert finished == {"test_d": ("failed", "did not run: ERROR: not found: test_d")}     # never loops
    assert grade.run_limit_s(10, 60) > grade.run_limit_s(5, 60) > 5 * 60


def test_gradescope_zip_holds_the_grader_the_tests_and_pinned_requirements(tmp_path):
    path = gradescope.write_zip(ASSIGNMENTS["cache"], tmp_path / "dist")
    assert path == tmp_path / "dist" / "cache-autograder.zip"
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
        requirements = z.read("requirements.txt").decode()
        run = z.read("run_autograder").decode()
    assert {"setup.sh", "run_autograder", "requirements.txt", "README.md"} <= names
    assert {f"grader/{f}" for f in gradescope.GRADER} <= names
    assert {f"grader/course/cache/{f}" for f in ["adapters.py", "test_public.py", "test_hidden.py"]} <= names
    library = {n for n in names if n.startswith(("grader/nanollm/", "grader/methods/", "grader/kernels/"))}
    assert {"grader/nanollm/storage.py", "grader/methods/scissorhands.py", "grader/kernels/count_sketch.py"} <= library
    assert all(n.endswith(".py") for n in library), "the reference library's Python files, no weights"
    assert modes["run_autograder"] & 0o111 and modes["setup.sh"] & 0o111
    pins = [line for line in requirements.splitlines() if line and not line.startswith(("#", "--"))]
    assert {p.split("==")[0] for p in pins} >= {"torch", "numpy", "pytest"} and all("==" in p for p in pins)
    for variable in ["AUTOGRADER_SOURCE", "AUTOGRADER_SUBMISSION", "AUTOGRADER_RESULTS", "AUTOGRADER_PYTHON"]:
        assert variable in run
    assert "/autograder/results/results.json" in run and "/autograder/submission" in run


@pytest.mark.parametrize("name", sorted(ASSIGNMENTS))
def test_a_submission_hanging_in_every_test_ends_within_gradescopes_timeout(name, tmp_path):
    # Each test's limit is sized so that the grader's own bound on a run (grade.run_limit_s: every test run
    # to its limit, then restarted) ends within Gradescope's default timeout, with room to spare: Gradescope
    # then gets feedback on every test instead of stopping the run with none.
    a = ASSIGNMENTS[name]
    per = gradescope.default_per_test_s(a)
    assert per >= 10 and grade.run_limit_s(gradescope.tests_in(a), per) + gradescope.MARGIN_S <= gradescope.TIMEOUT_S
    path = gradescope.write_zip(a, tmp_path / "dist")
    with zipfile.ZipFile(path) as z:
        run, readme, setup = (z.read(f).decode() for f in ("run_autograder", "README.md", "setup.sh"))
    assert f"--per-test-s {per:g} " in run and "--hidden-visibility after_published " in run
    later = gradescope.contents(a, hidden="after_due_date")["run_autograder"][0]
    assert "--hidden-visibility after_due_date " in later
    result = grade.Result("test_x", "hidden", 1.0, 0.0, "failed", "boom")
    assert grade.gradescope([result], 1.0, "", "after_due_date")["tests"][0]["visibility"] == "after_due_date"
    assert f"Autograder timeout: {gradescope.TIMEOUT_S} s" in readme and f"Memory: {gradescope.MEMORY_GB} GB" in readme
    assert "!= (%d, %d)" % gradescope.IMAGE_PYTHON in setup                    # refuses another Python
    assert f"Base image: {gradescope.IMAGE}**" in readme


def test_the_zip_pins_versions_for_gradescopes_default_image():
    # The zip's requirements are the committed pins for Ubuntu 22.04's Python 3.10 (course.image_check resolved
    # and installed them there), not the versions of the machine that made the zip, and under the pinned Triton
    # and numpy Triton's CPU interpreter runs the kernels (the kernels assignment's tests need it).
    pins = {line.split("==")[0]: line.split("==")[1].split(";")[0] for line in gradescope.requirements().splitlines()
            if line and not line.startswith(("#", "--"))}
    assert set(pins) == {"torch", "numpy", "pytest", "tqdm", "triton"}
    assert all(gradescope.pinned(name) == version for name, version in pins.items())
    assert gradescope.IMAGE_PYTHON == (3, 10) and "Python 3.10" in gradescope.requirements()
    assert gradescope.pinned_interpreter_problem() is None
    import kernels
    assert kernels.interpreter_problem(pins["triton"], "2.4.0") is not None, "the check must read the pinned triton"


@pytest.mark.slow
def test_setup_refuses_another_python_in_one_line(tmp_path):
    if sys.version_info[:2] == gradescope.IMAGE_PYTHON:
        pytest.skip("this Python is the image's: course.image_check builds with it")
    source = tmp_path / "source"
    with zipfile.ZipFile(gradescope.write_zip(ASSIGNMENTS["cache"], tmp_path / "dist")) as z:
        z.extractall(source)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "AUTOGRADER_VENV": str(tmp_path / "venv")}
    run = subprocess.run(["bash", str(source / "setup.sh")], cwd=source, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("error: setup.sh: requirements.txt pins versions for Python 3.10 (Ubuntu 22.04")
    assert f"python3 is {sys.version.split()[0]}" in run.stderr
    assert not (tmp_path / "venv" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" /
                "site-packages" / "torch").exists(), "refused before installing anything"


def test_gradescope_refuses_a_limit_that_would_outlast_its_timeout(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gradescope.main(["baselines", "--out", str(tmp_path / "dist"), "--per-test-s", "60"])
    assert e.value.code == 2 and "Gradescope would stop it with no feedback" in capsys.readouterr().err
    assert not (tmp_path / "dist").exists()


# -- grading real copies ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_grader_writes_gradescope_json(tmp_path, capsys):
    grade.main(["cache", "--json", str(tmp_path / "results.json")])
    results = json.loads((tmp_path / "results.json").read_text())
    tests = results["tests"]
    assert results["score"] == sum(t["max_score"] for t in tests) > 0
    unconfined = grade.notes({"hidden_tests": True, "changed_adapters": [], "runs_as": "UNCONFINED: as root"})
    assert results["output"] in ("", unconfined[0]), results["output"]      # a note only where no room was built
    assert {t["visibility"] for t in tests} == {"visible", "after_published"}
    assert all(t["status"] == "passed" and set(t) >= {"name", "score", "max_score", "output"} for t in tests)
    printed = capsys.readouterr().out
    assert "public" in printed and "hidden" in printed and f"score: {results['score']:g} / " in printed


@pytest.mark.slow
def test_the_json_says_what_failed_and_where_and_notes_changed_adapters(tmp_path, capsys):
    out = student_copy(tmp_path)
    shutil.copy2(ROOT / "nanollm" / "storage.py", out / "nanollm" / "storage.py")        # append: solved
    put(out / "nanollm" / "attention.py", "group_scores", ["return 1 / 0"])
    with (out / "course" / "cache" / "adapters.py").open("a") as f:
        f.write("# a student's change\n")
    grade.main(["cache", "--student", str(out), "--json", str(tmp_path / "r.json"), "-k", "group_scores"])
    results = json.loads((tmp_path / "r.json").read_text())
    failed = [t["output"] for t in results["tests"] if t["visibility"] == "visible"]
    assert results["score"] == 0 and failed and all(t.startswith("ZeroDivisionError: division by zero\n")
                                                    for t in failed), failed
    assert all("(raised in nanollm/attention.py, line " in t and t.endswith("in group_scores)") for t in failed)
    hidden = [t["output"] for t in results["tests"] if t["visibility"] != "visible"]
    assert hidden and all(t == grade.HIDDEN_SAYS["raised"] for t in hidden), hidden     # the grader's words only
    assert "course/cache/adapters.py differs from this repository's" in results["output"]
    table = capsys.readouterr().out
    assert table.count("ZeroDivisionError") == len(failed) + len(hidden), "the table gives one line per test"


@pytest.mark.slow
def test_a_crash_and_a_swallowed_timeout_fail_alone(tmp_path):
    """One task's code kills the interpreter on a decode step; another loops forever on the public test's six
    slots, catching every exception (as a student's code that swallows a time-limit exception would). Everything
    else is the reference, and passes: the per-test limit (``LIMIT_S``) is well above the slowest test's time under
    load (300 appends: about 2 s at load 2.3 on one machine; on a slower 2-core one it ran over the 6 s this test once
    allowed, and the three public tests of ``cache``, it among them, took 9-12 s), and one test alone pays it."""
    LIMIT_S = 15
    out = student_copy(tmp_path)
    shutil.copy2(ROOT / "nanollm" / "storage.py", out / "nanollm" / "storage.py")        # append: solved
    attention = out / "nanollm" / "attention.py"
    put(attention, "group_scores", ["if q.shape[2] == 1:", "    __import__('os').abort()",
                                    *reference("nanollm/attention.py", "group_scores")])
    put(attention, "mask", ["while kp.shape[-1] == 6:", "    try:", "        sum(range(10 ** 5))",
                            "    except BaseException:", "        pass",
                            *reference("nanollm/attention.py", "mask")])
    t0 = time.perf_counter()
    summary = grade.grade("cache", out, per_test_s=LIMIT_S)
    elapsed = time.perf_counter() - t0
    results = summary["results"]
    by_name = {r["name"]: r for r in results}
    assert by_name["test_append_then_read"]["status"] == "passed", "a test before the crash keeps its pass"
    crashed = [r for r in results if "the process running your code stopped (exit code -6)" in r["output"]]
    stopped = [r for r in results if r["output"].startswith(f"ran over {LIMIT_S} s, in nanollm/attention.py, line ")]
    assert [r["name"] for r in crashed] == ["test_decode_step_scores_with_gqa"], results
    assert [r["name"] for r in stopped] == ["test_masked_attention_sees_only_the_past"], results
    assert [(r["name"], r["output"]) for r in results if r["status"] != "passed" and r not in crashed + stopped] == []
    assert summary["score"] == sum(r["max_score"] for r in results if r["status"] == "passed") > 0
    assert elapsed < grade.run_limit_s(len(results), LIMIT_S), f"the run took {elapsed:.0f} s"


@pytest.mark.slow
def test_a_missing_module_is_not_borrowed_from_an_installed_checkout(tmp_path):
    out = student_copy(tmp_path)
    (out / "nanollm" / "storage.py").unlink()
    summary = grade.grade("cache", out)
    assert summary["score"] == 0 and all("nanollm" in r["output"] for r in summary["results"]), summary["results"]
    assert any("No module named 'nanollm.storage'" in r["output"] for r in summary["results"])
    assert not any("outside the student copy" in r["output"] for r in summary["results"])


@pytest.mark.slow
def test_the_copys_own_tests_are_not_borrowed(tmp_path):
    out = student_copy(tmp_path)
    put(out / "nanollm" / "storage.py", "append", ["import tests.nanollm  # noqa", *reference("nanollm/storage.py",
                                                                                               "append")])
    summary = grade.grade("cache", out, tasks=("append",))
    assert summary["results"] and summary["score"] == 0
    assert all("may not import the repository's own tests" in r["output"] for r in summary["results"])


@pytest.mark.slow
def test_an_import_error_fails_only_the_tasks_that_use_the_file(tmp_path):
    out = full_copy(tmp_path)
    snapkv = out / "methods" / "snapkv.py"
    text = snapkv.read_text()
    snapkv.write_text(text + "\ndef broken(:\n    pass\n")
    line = text.count("\n") + 2
    summary = grade.grade("baselines", out, tasks=("sinks_and_recent", "window_vote"))
    results = {r["name"]: r for r in summary["results"]}
    streaming = [r for r in results.values() if r["task"] == "sinks_and_recent"]
    vote = [r for r in results.values() if r["task"] == "window_vote"]
    assert streaming and all(r["status"] == "passed" for r in streaming), \
        f"a broken snapkv.py must not fail StreamingLLM (course/baselines/adapters.py imports lazily?): {streaming}"
    assert vote and all(r["status"] == "failed" for r in vote)
    assert all(r["output"].startswith(f"SyntaxError: invalid syntax (methods/snapkv.py, line {line})")
               for r in vote), vote[0]["output"]


@pytest.mark.slow
def test_gradescope_package_grades_the_reference_and_the_untouched_copy(tmp_path):
    path = gradescope.write_zip(ASSIGNMENTS["cache"], tmp_path / "dist")
    source = tmp_path / "source"
    with zipfile.ZipFile(path) as z:
        z.extractall(source)
    assert subprocess.run(["bash", "-n", str(source / "setup.sh")]).returncode == 0

    def run_autograder(submission: Path, name: str) -> dict:
        results = tmp_path / name / "results.json"
        env = {**os.environ, "AUTOGRADER_SOURCE": str(source), "AUTOGRADER_SUBMISSION": str(submission),
               "AUTOGRADER_RESULTS": str(results), "AUTOGRADER_PYTHON": sys.executable}
        run = subprocess.run(["bash", str(source / "run_autograder")], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0 and results.exists(), run.stdout[-2000:] + run.stderr[-2000:]
        return json.loads(results.read_text())

    reference = full_copy(tmp_path)
    full = run_autograder(reference, "reference")
    assert full["score"] == sum(t["max_score"] for t in full["tests"]) > 0
    submit.pack(reference, ASSIGNMENTS["cache"], tmp_path / "cache-submission.zip")      # the pack of course.submit,
    with zipfile.ZipFile(tmp_path / "cache-submission.zip") as z:                       # unpacked as Gradescope does
        z.extractall(tmp_path / "pack")
    packed = run_autograder(tmp_path / "pack", "pack")
    assert packed["score"] == full["score"], packed
    assert any(t["visibility"] == "after_published" for t in full["tests"]), "the hidden tests ran"
    zero = run_autograder(student_copy(tmp_path), "copy")
    assert zero["score"] == 0 and len(zero["tests"]) == len(full["tests"])
    assert all("NotImplementedError" in t["output"] if t["visibility"] == "visible" else
               t["output"] == grade.HIDDEN_SAYS["raised"] for t in zero["tests"]), zero["tests"]
    (tmp_path / "empty").mkdir()
    nothing = run_autograder(tmp_path / "empty", "empty")
    assert nothing["score"] == 0 and "not graded" in nothing["output"]
