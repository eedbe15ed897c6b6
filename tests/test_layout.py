"""
The layout, checked: the packages stand in layers and import only downwards, with no exception,

    nanollm  <-  methods  <-  kernels, fastpath  <-  experiments  <-  course, notebooks

(kernels are leaves: they import nothing of the project), there is no import cycle, and the linter passes.

The import graph is read from the source (every ``import``, at any depth: inside functions, under
``TYPE_CHECKING``), not from what Python happened to import, so a lazy import counts too.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = (("nanollm",), ("methods",), ("kernels", "fastpath"), ("experiments",), ("course", "notebooks"))
PACKAGES = tuple(pkg for layer in LAYERS for pkg in layer)
READING_PATH = ("config", "storage", "policy", "attention", "cache", "model", "generation")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """The project modules ``name`` imports: ``from a.b import c`` is a.b.c when that is a module, else a.b."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:         # import a.b.c of a function: the module a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    """Every project module and the project modules it imports (parsed once, at the first test that asks)."""
    return {name: imports_of(name) for name in MODULES}


def test_the_graph_sees_the_imports():
    """A check of the checker: known edges are found, relative and lazy ones included."""
    assert "nanollm.cache" in graph()["nanollm.model"]                       # from .cache import KVCache
    assert "nanollm.io.checkpoint" in graph()["nanollm"]                     # lazy, inside load()
    assert "experiments.evaluation.compare" in graph()["experiments.compare"]
    assert "methods.tensor_attention.attention" in graph()["methods.tensor_attention"]


def test_no_import_cycle():
    """No module imports itself through others (lazy imports included): the layers read bottom-up."""
    state, stack, cycles = {}, [], []

    def visit(name: str) -> None:                          # depth-first search; grey = on the stack
        state[name] = "grey"
        stack.append(name)
        for dep in sorted(graph()[name]):
            if state.get(dep) == "grey":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[name] = "black"

    for name in sorted(graph()):
        if name not in state:
            visit(name)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def layer_of(module: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if module.split(".")[0] in layer)


def test_imports_run_only_downwards():
    """No module imports one of a higher layer (lazy imports and command lines included): the reading path
    never needs the methods, no method needs a kernel or the fast path, and the experiments that measure them
    all (the evaluation, the analyses, the benchmarks) are above everything they measure."""
    wrong = sorted(f"{a} -> {b}" for a, deps in graph().items() for b in deps if layer_of(b) > layer_of(a))
    assert not wrong, "imports from a lower layer to a higher one: " + "; ".join(wrong)


def test_the_layer_check_fails_on_an_upward_import():
    """A check of the check: an edge from the library to an experiment, or from a method to the fast path,
    is upward."""
    assert layer_of("experiments.evaluation.compare") > layer_of("fastpath.lean") > layer_of("methods.snapkv")
    assert layer_of("kernels.streaming") == layer_of("fastpath.graph") > layer_of("nanollm.model")
    assert layer_of("course.grade") > layer_of("experiments.compare")


EVALUATION_PLAIN_PATH = ("task", "engine", "protocol", "metrics")


def evaluation_plain_path_lines() -> tuple[dict, int]:
    """Each plain-path file's lines, and the plain path's: all of them but the tasks defined beside ``Task``
    in task.py (tasks are what the plain path runs, as methods are: ``DocsContinuation`` is the example)."""
    counts = {name: len((ROOT / "experiments" / "evaluation" / f"{name}.py").read_text().splitlines())
              for name in EVALUATION_PLAIN_PATH}
    tree = ast.parse((ROOT / "experiments" / "evaluation" / "task.py").read_text())
    tasks = sum(node.end_lineno - node.lineno + 1 for node in tree.body if isinstance(node, ast.ClassDef)
                and any(getattr(base, "id", None) == "Task" for base in node.bases))
    return counts, sum(counts.values()) - tasks


def test_the_evaluation_s_plain_path_is_short_and_never_reaches_the_fast_paths():
    """experiments/evaluation's plain path (task, engine, protocol with its main loop, metrics): at most 500 lines,
    docstrings included, and nothing it imports, at any depth, is fastpath/ or the fast engine."""
    _, lines = evaluation_plain_path_lines()
    assert lines <= 500, f"the evaluation's plain path has {lines} lines, more than 500"
    plain = [f"experiments.evaluation.{name}" for name in EVALUATION_PLAIN_PATH]
    seen, todo = set(), list(plain)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph()[name]
    fast = sorted(n for n in seen if n.startswith("fastpath") or n in ("experiments.evaluation.side_by_side",
                                                                       "experiments.evaluation.harness"))
    assert not fast, f"the evaluation's plain path reaches {fast}"


def test_the_evaluation_readme_states_the_plain_path_s_limit():
    """experiments/evaluation/README.md names the plain path's files and the limit this file holds them to (not
    their counts, which a new task beside ``Task`` would change)."""
    readme = " ".join((ROOT / "experiments" / "evaluation" / "README.md").read_text().split())
    assert all(f"`{name}.py`" in readme for name in EVALUATION_PLAIN_PATH)
    assert "`lines <= 500`" in readme


def test_the_reading_path_is_short_and_imports_only_itself():
    """The files nanollm/README.md lists as the reading path: at most 900 lines in all, docstrings included,
    importing nothing of the project but each other, the option checks and the slots' fast paths."""
    readme = (ROOT / "nanollm" / "README.md").read_text()
    listed = [name for name in READING_PATH if f"`{name}.py`" in readme]
    assert listed == list(READING_PATH), f"nanollm/README.md must list the reading path: {READING_PATH}"
    lines = sum(len((ROOT / "nanollm" / f"{name}.py").read_text().splitlines()) for name in READING_PATH)
    assert lines <= 900, f"the reading path has {lines} lines, more than 900"
    allowed = {f"nanollm.{name}" for name in READING_PATH} | {"nanollm.checks", "nanollm.slots"}
    for name in READING_PATH:
        extra = graph()[f"nanollm.{name}"] - allowed
        assert not extra, f"nanollm/{name}.py imports {extra}"


def test_kernels_are_leaves():
    """A kernel file imports only torch, triton and kernels/ itself (their benchmark is fastpath/bench.py)."""
    wrong = {(a, b) for a, deps in graph().items() if a.startswith("kernels")
             for b in deps if not b.startswith("kernels")}
    assert not wrong, f"kernels/ must not import the library: {sorted(wrong)}"


def test_methods_top_level_is_the_methods():
    """The top of methods/ holds the registered methods, a method's parts in files named after it
    (``kvreviver_sketch.py``), the registry (with its named option sets, the presets) and what a decode-time
    method declares about its rule (rules.py), nothing else."""
    from methods import METHODS
    files = {p.stem for p in (ROOT / "methods").glob("*.py")} - {"__init__", "presets", "rules"}
    modules = {METHODS[name].__module__.rpartition(".")[2] for name in METHODS}
    parts = {f for f in files - modules if any(f.startswith(m + "_") for m in modules)}
    assert files - parts == modules


@pytest.mark.slow
def test_ruff_is_clean():
    """The linter (configuration in pyproject.toml: pycodestyle, pyflakes, import order, 120 columns)."""
    pytest.importorskip("ruff", reason="ruff is installed by requirements.txt")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]


PRIVATE = {"_k", "_v", "_pos", "_state"}            # LayerKV's buffers: its own, reached through buffers() / adopt()


def private_fields(source: str) -> list[tuple[int, str]]:
    """(line, name) of every ``x._k`` and the like where x is not ``self``: another object's private buffers."""
    return [(node.lineno, node.attr) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
            and node.attr in PRIVATE and not (isinstance(node.value, ast.Name) and node.value.id == "self")]


def test_no_room_reaches_into_a_storage_s_private_buffers():
    """Only nanollm/storage.py touches a ``LayerKV``'s buffers by their private names; the batched engine, the
    fast paths and the course go through ``buffers()`` and ``adopt()`` (a storage class's own ``self._pos``
    is its own)."""
    files = [p for pkg in (*PACKAGES, "tests") for p in (ROOT / pkg).rglob("*.py")
             if p != ROOT / "nanollm" / "storage.py"]
    wrong = [f"{p.relative_to(ROOT)}:{line} .{name}" for p in files for line, name in private_fields(p.read_text())]
    assert not wrong, "private fields of another object: " + "; ".join(wrong)


def test_the_private_field_check_sees_one():
    assert private_fields("def f(store):\n    store._k = None\n    self._k = store.k\n") == [(2, "_k")]
