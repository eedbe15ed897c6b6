"""
Mutation testing of the graded tests: does each task's grade fall when its code is plausibly wrong?

    python -m course.mutants cache                     # every mutant of one assignment
    python -m course.mutants baselines --task adakv    # one task's mutants
    python -m course.mutants all --out results/course_mutants.txt --jobs 2

A mutant is one plausible student mistake written into one solution region of the reference. Two sources:
the catalogue (``OPERATORS``, applied by the syntax tree to every site of every graded region, at most
``--cap`` per region) and each assignment's hand-written ``MUTANTS`` in ``course/<name>/mutants.py``
(instructor-only), whose ``ACCEPTABLE = {mutant name: why}`` says why a survivor is acceptable. A mutant is
*killed* when its task loses at least half of its points; each is graded alone in a scratch copy, only its
task's tests, their inputs drawn from the fixed seed ``SEED``. The report lists per assignment the mutants,
the kills, and the survivors with the task's tests that passed (those should have caught them). More:
course/README.md, section "The course's files".
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import os
import queue
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from . import grade as grader
from .assignments import ASSIGNMENTS, COURSE, ROOT, command_line, get
from .markers import Region

CAP = 15                 # catalogue mutants per region at most (chosen round-robin over the operators)
PER_TEST_S = 30          # a mutant's test time limit (a mutant may loop forever)
SEED = 0                 # every grade here draws the tests' inputs from this seed (``course.grade --seed``), so
                         # the kill table comes out the same each run


@dataclass(frozen=True)
class Mutant:
    """One mistake in one region: in the region of ``task`` (``[assignment:task]``), the text ``old`` (exactly
    once in the region's body) becomes ``new``; with ``old=None`` ``new`` replaces the whole body (written
    without indentation: it is indented to the region's)."""
    name: str            # what the mistake is, in a few words ("H2O's GQA groups as view(B, G, H_kv, T)")
    task: str            # the graded task whose region it changes
    new: str
    old: str | None = None
    source: str = "hand"     # "hand", or the catalogue operator that wrote it


# -- regions and how a mutant is written into one -----------------------------------------------------------

def graded_regions(assignment) -> list[Region]:
    """The regions of ``assignment`` that a task grades: those with a task, in its library files."""
    return [r for r in assignment.regions() if r.task and str(r.path.relative_to(ROOT)) in assignment.library]


def where(path: Path) -> str:
    """A file as the report names it: relative to the repository where it lies in it."""
    return str(path.relative_to(ROOT)) if ROOT in path.parents else path.name


def dedent(body: list[str]) -> tuple[str, str]:
    """(the common indentation of the body's lines, the body without it)."""
    prefixes = [line[:len(line) - len(line.lstrip())] for line in body if line.strip()]
    indent = os.path.commonprefix(prefixes) if prefixes else ""
    return indent, "\n".join(line[len(indent):] if line.strip() else "" for line in body)


def indent_lines(text: str, indent: str) -> list[str]:
    return [indent + line if line.strip() else "" for line in text.splitlines()]


def new_bodies(mutant: Mutant, region: Region, lines: list[str]) -> list[list[str]]:
    """The region's body with the mutant written in, the ways ``old`` and ``new`` may be read: without the
    body's indentation (then indented back), and as the file has it. ``plan`` takes the first that compiles
    (a multi-line ``new`` may give its later lines either way)."""
    body = region.body(lines)
    indent, flat = dedent(body)
    if mutant.old is None:
        return [indent_lines(mutant.new, indent or region.indent)]
    raw = "\n".join(body)
    return ([indent_lines(flat.replace(mutant.old, mutant.new, 1), indent)] if mutant.old in flat else []) + \
        ([raw.replace(mutant.old, mutant.new, 1).splitlines()] if mutant.old in raw else [])


def spliced(region: Region, lines: list[str], body: list[str], text: str) -> str:
    """The file's text with the region's body replaced (markers kept)."""
    out = lines[:region.begin] + body + lines[region.end - 1:]
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


@dataclass(frozen=True)
class Planned:
    """A mutant ready to grade: the file it changes (relative to the root) and that file's mutated text."""
    mutant: Mutant
    file: str
    text: str
    key: str = ""        # what it computes, for finding duplicates (the mutated region's AST)


def compile_error(text: str, path: Path) -> str | None:
    """Why the file's text does not compile (``message, line N``), or None if it does."""
    try:
        compile(text, str(path), "exec", dont_inherit=True)
    except SyntaxError as e:
        return f"{e.msg}, line {e.lineno}"
    except ValueError as e:
        return str(e)
    return None


def region_key(body: list[str]) -> str:
    """The region's code up to formatting and comments (two mutants with the same key are duplicates)."""
    flat = dedent(body)[1]
    try:
        return ast.dump(ast.parse(flat))
    except SyntaxError:
        return flat


def occurrences(old: str, region: Region, lines: list[str]) -> int:
    """How often ``old`` is in the region's body: without its indentation, else as the file has it."""
    body = region.body(lines)
    return dedent(body)[1].count(old) or "\n".join(body).count(old)


def plan(mutants: list[Mutant], regions: list[Region], origin: str = "") -> list[Planned]:
    """Each mutant written into its region; a one-line error naming the mutant where its task has no region,
    its ``old`` is not exactly once in the task's regions, or the mutated file does not compile."""
    texts = {r.path: r.path.read_text() for r in regions}
    out = []
    for m in mutants:
        what = f"error: {origin}mutant {m.name!r}"
        mine = [r for r in regions if r.task == m.task]
        if not mine:
            tasks = ", ".join(sorted({r.task for r in regions}))
            raise SystemExit(f"{what}: no graded region of task {m.task!r}; the tasks: {tasks}")
        if m.old is None and len(mine) > 1:
            raise SystemExit(f"{what}: task {m.task!r} has {len(mine)} regions; give the text to replace (old)")
        counts = [0 if m.old is None else occurrences(m.old, r, texts[r.path].splitlines()) for r in mine]
        if m.old is not None and sum(counts) != 1:
            raise SystemExit(f"{what}: its old text {m.old[:60]!r} is in the region of task {m.task!r} "
                             f"{'not at all' if sum(counts) == 0 else f'{sum(counts)} times'}; it must be there "
                             "exactly once")
        region = mine[0] if m.old is None else mine[counts.index(1)]
        text = texts[region.path]
        tried = [(b, spliced(region, text.splitlines(), b, text)) for b in new_bodies(m, region, text.splitlines())]
        errors = [compile_error(t, region.path) for _, t in tried]
        if None not in errors:
            raise SystemExit(f"{what}: the mutated {where(region.path)} does not compile ({errors[0]})")
        body, new_text = tried[errors.index(None)]
        out.append(Planned(m, where(region.path), new_text, f"{where(region.path)}:{region.begin}:{region_key(body)}"))
    return out


# -- the catalogue: operators on the region's syntax tree ---------------------------------------------------
#
# An operator looks at one node (with its parent, and the region's tree) and returns the edits it makes
# there: (the node to replace, its replacement, or None to leave a statement out). Each edit is one mutant.

Edit = tuple[ast.AST, "ast.AST | None"]
DIM_KEYWORDS = ("dim", "axis")
# the positional arguments that are dimensions in the method form x.f(...); the function form torch.f(x, ...)
# shifts them by one
DIM_ARGS = {**{f: (0,) for f in ("sum", "mean", "amax", "amin", "max", "min", "median", "softmax", "log_softmax",
                                 "cumsum", "cumprod", "sort", "argsort", "argmax", "argmin", "unsqueeze", "squeeze",
                                 "unflatten", "index_select", "index_add", "index_add_", "gather", "scatter",
                                 "scatter_", "scatter_add", "scatter_add_", "logsumexp", "cat", "stack")},
            "flatten": (0, 1), "transpose": (0, 1), "topk": (1,)}
MODULES = ("torch", "tl", "F")        # torch.f(x, ...), triton.language as tl, torch.nn.functional as F
REDUCTIONS = {"sum": ("mean", "amax"), "mean": ("sum", "median"), "amax": ("sum", "mean"),
              "max": ("sum", "mean"), "median": ("mean", "sum")}          # what each is mistaken for
TRITON_REDUCTIONS = {"sum": ("max",), "max": ("sum",)}                      # tl has no mean or median
PAIRED = ("max", "median")            # over a dim they return (values, indices)
SHAPES = ("view", "reshape", "unflatten")
FLIPS = ("descending", "largest", "keepdim")


def int_value(node: ast.AST) -> int | None:
    """The value of an integer literal (``3``, ``-1``), else None."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = int_value(node.operand)
        return None if v is None else -v
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def literal(v: int) -> ast.AST:
    return ast.UnaryOp(ast.USub(), ast.Constant(-v)) if v < 0 else ast.Constant(v)


def call_name(node: ast.AST) -> tuple[str | None, bool]:
    """(the called attribute's name, whether it is a module function such as torch.f) of a call ``x.f(...)``."""
    f = getattr(node, "func", None) if isinstance(node, ast.Call) else None
    if not isinstance(f, ast.Attribute):
        return None, False
    return f.attr, isinstance(f.value, ast.Name) and f.value.id in MODULES


def dim_slots(call: ast.Call) -> list[ast.AST]:
    """The arguments of a call that are dimensions given as integer literals."""
    name, module = call_name(call)
    slots = [k.value for k in call.keywords if k.arg in DIM_KEYWORDS]
    slots += [call.args[i + module] for i in DIM_ARGS.get(name, ()) if i + module < len(call.args)]
    return [s for s in slots if int_value(s) is not None]


def is_dim(node: ast.AST, parent: ast.AST | None) -> bool:
    if isinstance(parent, ast.keyword):
        return parent.arg in DIM_KEYWORDS
    return isinstance(parent, ast.Call) and any(node is s for s in dim_slots(parent))


def op_dim(node, parent, tree) -> list[Edit]:
    """A reduction or index over the neighbouring axis: -1 -> -2, -k -> -k +- 1, 0 -> 1, k -> k +- 1 (an
    axis counted from the end stays counted from the end)."""
    if not isinstance(node, ast.Call):
        return []
    edits = []
    for slot in dim_slots(node):
        v = int_value(slot)
        moves = [-2] if v == -1 else [1] if v == 0 else [v + 1, v - 1]
        edits += [(slot, literal(w)) for w in moves]
    return edits


def op_first_last(node, parent, tree) -> list[Edit]:
    """First instead of last (and back): an index 0 <-> -1."""
    if not isinstance(node, ast.Subscript):
        return []
    parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    return [(p, literal(-1 - int_value(p))) for p in parts if int_value(p) in (0, -1)]


def op_compare(node, parent, tree) -> list[Edit]:
    """``<`` <-> ``<=``, ``>`` <-> ``>=``."""
    if not isinstance(node, ast.Compare):
        return []
    swap = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
    edits = []
    for i, op in enumerate(node.ops):
        if type(op) in swap:
            new = copy.deepcopy(node)
            new.ops[i] = swap[type(op)]()
            edits.append((node, new))
    return edits


def op_reduction(node, parent, tree) -> list[Edit]:
    """Sum vs mean vs max, median vs mean: ``x.sum(...)``, ``torch.sum(x, ...)``, ``tl.sum(x, axis=...)``.
    A max or median over a dim gives (values, indices): its ``.values`` goes or comes with the swap."""
    name, module = call_name(node)
    triton = module and node.func.value.id == "tl"
    targets = (TRITON_REDUCTIONS if triton else REDUCTIONS).get(name, ())
    if not targets or (module and not node.args):
        return []
    has_dim = any(k.arg in DIM_KEYWORDS for k in node.keywords) or len(node.args) > int(module)
    paired_in = not triton and name in PAIRED and has_dim
    if paired_in and not (isinstance(parent, ast.Attribute) and parent.attr == "values"):
        return []                          # (values, indices) used otherwise, or torch.max(a, b): not a reduction
    edits = []
    for t in targets:
        new = copy.deepcopy(node)
        new.func.attr = t
        paired_out = not triton and t in PAIRED and has_dim
        if paired_in and not paired_out:
            edits.append((parent, new))
        elif paired_out and not paired_in:
            edits.append((node, ast.Attribute(new, "values", ast.Load())))
        else:
            edits.append((node, new))
    return edits


def op_drop_sign(node, parent, tree) -> list[Edit]:
    """A dropped sign or negation: ``-x`` -> ``x``, ``~mask`` -> ``mask`` (not on number literals)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Invert)) \
            and not isinstance(node.operand, ast.Constant):
        return [(node, copy.deepcopy(node.operand))]
    return []


def op_drop_term(node, parent, tree) -> list[Edit]:
    """A dropped term or scale: ``a + b``, ``a - b``, ``a * b``, ``a / b``, ``a // b``, ``a & b``, ``a | b``
    -> ``a`` (and -> ``b`` where the order does not matter)."""
    if not isinstance(node, ast.BinOp):
        return []
    if isinstance(node.op, (ast.Add, ast.Mult, ast.BitAnd, ast.BitOr)):
        return [(node, copy.deepcopy(node.left)), (node, copy.deepcopy(node.right))]
    if isinstance(node.op, (ast.Sub, ast.Div, ast.FloorDiv)):
        return [(node, copy.deepcopy(node.left))]
    return []


def op_shape_swap(node, parent, tree) -> list[Edit]:
    """A mis-ordered grouping: two neighbouring symbolic sizes of ``.view``, ``.reshape``, ``.unflatten``
    swapped (``view(B, H_kv, G, T)`` -> ``view(B, G, H_kv, T)``)."""
    name, module = call_name(node)
    if name not in SHAPES or module:
        return []
    if name == "unflatten":
        if len(node.args) != 2 or not isinstance(node.args[1], (ast.Tuple, ast.List)):
            return []
        holder, part = node.args[1], "elts"
    elif len(node.args) == 1 and isinstance(node.args[0], (ast.Tuple, ast.List)):
        holder, part = node.args[0], "elts"
    else:
        holder, part = node, "args"
    sizes = getattr(holder, part)
    symbolic = [i for i, a in enumerate(sizes) if int_value(a) is None and not isinstance(a, ast.Starred)]
    edits = []
    for i, j in zip(symbolic, symbolic[1:]):
        if ast.unparse(sizes[i]) != ast.unparse(sizes[j]):
            new = copy.deepcopy(holder)
            swapped = getattr(new, part)
            swapped[i], swapped[j] = swapped[j], swapped[i]
            edits.append((holder, new))
    return edits


def op_flip(node, parent, tree) -> list[Edit]:
    """``descending=`` / ``largest=`` / ``keepdim=`` flipped."""
    if isinstance(node, ast.keyword) and node.arg in FLIPS and isinstance(node.value, ast.Constant) \
            and isinstance(node.value.value, bool):
        return [(node, ast.keyword(node.arg, ast.Constant(not node.value.value)))]
    return []


def position(node: ast.AST) -> tuple[int, int]:
    return getattr(node, "lineno", 0), getattr(node, "col_offset", 0)


def bound_before(stmt: ast.stmt, tree: ast.AST) -> bool:
    """Whether every name ``stmt`` assigns already has a value when it runs: it is mentioned earlier in the
    region, or read by ``stmt`` itself (``x = x * 2``; a parameter tested by an ``if``). Leaving ``stmt`` out
    then keeps the older value instead of failing on an unbound name. (A loop's own variable does not count.)"""
    loop = {id(n) for f in ast.walk(stmt) if isinstance(f, ast.For) for n in ast.walk(f.target)}
    names = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
             and id(n) not in loop}
    read = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    earlier = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and position(n) < position(stmt)}
    return names <= read | earlier


def op_drop_statement(node, parent, tree) -> list[Edit]:
    """A missing step: a statement that writes in place, updates a value or guards a block, left out."""
    if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.If, ast.For, ast.While,
                             ast.With)):
        return []
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):      # a docstring
        return []
    return [(node, None)] if bound_before(node, tree) else []


def plus(node: ast.AST, k: int) -> ast.AST:
    return ast.BinOp(copy.deepcopy(node), ast.Add() if k > 0 else ast.Sub(), ast.Constant(abs(k)))


def op_bound(node, parent, tree) -> list[Edit]:
    """An off-by-one in a window or range: a slice bound or a ``range``/``arange`` argument (not a literal)
    +- 1."""
    if isinstance(node, ast.Slice):
        bounds = [b for b in (node.lower, node.upper) if b is not None and int_value(b) is None]
    elif isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "range"
                                        or getattr(node.func, "attr", None) == "arange"):
        bounds = [a for a in node.args if int_value(a) is None and not isinstance(a, ast.Starred)]
    else:
        return []
    return [(b, plus(b, k)) for b in bounds for k in (1, -1)]


def op_off_by_one(node, parent, tree) -> list[Edit]:
    """An off-by-one in a count or budget: an integer literal +- 1 (a dimension is ``dim``'s)."""
    v = int_value(node)
    if v is None or int_value(parent) is not None or is_dim(node, parent):
        return []
    return [(node, literal(v + 1)), (node, literal(v - 1))]


OPERATORS: list[tuple[str, Callable]] = [
    ("dim", op_dim), ("first_last", op_first_last), ("compare", op_compare), ("reduction", op_reduction),
    ("drop_sign", op_drop_sign), ("drop_term", op_drop_term), ("shape_swap", op_shape_swap), ("flip", op_flip),
    ("drop_statement", op_drop_statement), ("bound", op_bound), ("off_by_one", op_off_by_one),
]


def parents_of(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


@contextmanager
def edited(parents: dict[ast.AST, ast.AST], old: ast.AST, new: ast.AST | None):
    """The tree with ``old`` replaced by ``new`` (None: a statement left out; a body left empty gets
    ``pass``) while the block runs; put back after."""
    parent = parents[old]
    for name, value in ast.iter_fields(parent):
        if value is old:
            setattr(parent, name, new)
            try:
                yield
            finally:
                setattr(parent, name, old)
            return
        if isinstance(value, list) and any(v is old for v in value):
            before = list(value)
            i = next(i for i, v in enumerate(value) if v is old)
            value[i:i + 1] = [] if new is None else [new]
            if not value and name == "body":
                value.append(ast.Pass())
            try:
                yield
            finally:
                value[:] = before
            return


def snippets(old: ast.AST, new: ast.AST | None, width: int = 40) -> tuple[str, str]:
    """What the edit changes, short: the two codes around where they differ (``...`` for what they share)."""
    a = " ".join(ast.unparse(old).split())
    if new is None:
        return (a if len(a) <= width else a[:width - 3] + "..."), "(left out)"
    b = " ".join(ast.unparse(new).split())
    if len(a) <= width and len(b) <= width:
        return a, b
    p = len(os.path.commonprefix([a, b]))
    q = len(os.path.commonprefix([a[p:][::-1], b[p:][::-1]]))
    start = max(0, p - 12)

    def cut(t: str) -> str:
        stop = len(t) - max(0, q - 12)
        part = ("..." if start else "") + t[start:stop] + ("..." if stop < len(t) else "")
        return part if len(part) <= width + 6 else part[:width + 3] + "..."
    return cut(a), cut(b)


def region_mutants(region: Region, text: str | None = None, operators=None, cap: int = CAP) -> list[Mutant]:
    """The catalogue's mutants of one region: each operator at each site, one edit each. An edit that computes
    the same as an earlier one (or as the reference) is left out, under the operator listed first; one that
    does not compile is skipped. At most ``cap``, taken round-robin over the operators in site order."""
    operators = OPERATORS if operators is None else operators
    text = region.path.read_text() if text is None else text
    flat = dedent(region.body(text.splitlines()))[1]
    try:
        tree = ast.parse(flat)
    except SyntaxError:
        return []
    nodes, parents = list(ast.walk(tree)), parents_of(tree)
    seen = {ast.dump(tree)}
    by_operator = {}
    for op_name, op in operators:
        found = []
        for node in nodes:
            for target, new in op(node, parents.get(node), tree):
                with edited(parents, target, new):
                    key = ast.dump(tree)
                if key not in seen:
                    seen.add(key)
                    found.append((position(target), target, new))
        by_operator[op_name] = sorted(found, key=lambda x: x[0])
    chosen, rounds = [], max((len(v) for v in by_operator.values()), default=0)
    for i in range(rounds):
        for op_name, found in by_operator.items():
            if i >= len(found) or len(chosen) == cap:
                continue
            site, target, new = found[i]
            with edited(parents, target, new):
                body = ast.unparse(tree)
            if compile_error("def mutant():\n" + "\n".join(indent_lines(body, "    ")) + "\n", region.path):
                continue
            before, after = snippets(target, new)
            name = f"{op_name} at {where(region.path)}:{region.begin + site[0]}: {before} -> {after}"
            chosen.append((site, Mutant(name, region.task, body, flat, op_name)))
    order = {name: k for k, (name, _) in enumerate(operators)}
    return [m for _, m in sorted(chosen, key=lambda x: (x[0], order[x[1].source]))]


def unique_names(mutants: list[Mutant]) -> list[Mutant]:
    """Mutants whose names repeat get `` (2)``, `` (3)``... (a name is what ACCEPTABLE refers to)."""
    count: dict[str, int] = {}
    out = []
    for m in mutants:
        count[m.name] = count.get(m.name, 0) + 1
        out.append(m if count[m.name] == 1 else
                   Mutant(f"{m.name} ({count[m.name]})", m.task, m.new, m.old, m.source))
    return out


def catalogue(assignment: str, cap: int = CAP) -> list[Mutant]:
    """The catalogue's mutants of every graded region of ``assignment``."""
    return unique_names([m for r in graded_regions(get(assignment)) for m in region_mutants(r, cap=cap)])


# -- the hand-written mutants ------------------------------------------------------------------------------

def hand_module(assignment: str, path: Path | None = None):
    """``course/<name>/mutants.py`` as a module (imported by path: it is not part of a package), or None."""
    path = COURSE / assignment / "mutants.py" if path is None else path
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"course_{assignment}_mutants", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise SystemExit(f"error: {where(path)}: cannot import it: {type(e).__name__}: {e}") from None
    return module


def hand(assignment: str, path: Path | None = None) -> list[Mutant]:
    """``MUTANTS`` of ``course/<name>/mutants.py`` (none if the file does not exist), checked against the
    assignment's graded regions: a one-line error names a mutant of an unknown task, or whose ``old`` is not
    exactly once in its region."""
    module = hand_module(assignment, path)
    mutants = list(getattr(module, "MUTANTS", []))
    origin = f"{where(path or COURSE / assignment / 'mutants.py')}: "
    for m in mutants:
        if not all(hasattr(m, f) for f in ("name", "task", "new", "old")):
            raise SystemExit(f"error: {origin}MUTANTS holds {m!r}, not a course.mutants.Mutant")
    names = [m.name for m in mutants]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise SystemExit(f"error: {origin}two mutants are named {twice!r}")
    plan(mutants, graded_regions(get(assignment)), origin)
    return mutants


def acceptable(assignment: str) -> dict[str, str]:
    """``ACCEPTABLE`` of ``course/<name>/mutants.py``: mutant name -> why its survival is acceptable."""
    return dict(getattr(hand_module(assignment), "ACCEPTABLE", {}))


def why_acceptable(name: str, table: dict[str, str]) -> str | None:
    """The reason ``table`` gives for ``name``; a catalogue name matches with or without its line number."""
    def bare(s: str) -> str:
        return re.sub(r"(\.py):\d+:", r"\1:", s)
    return table.get(name) or {bare(k): v for k, v in table.items()}.get(bare(name))


# -- grading ------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    mutant: Mutant
    kept: float                     # points the task kept with the mutant in
    max_score: float                # the task's points
    killed: bool
    passing: list[str] = field(default_factory=list)     # the task's tests that passed
    seconds: float = 0.0


def is_killed(kept: float, max_score: float) -> bool:
    """The kill rule: the task lost at least half of its points."""
    return max_score > 0 and max_score - kept >= max_score / 2


def copy_repository(out: Path) -> Path:
    """A scratch copy of the repository's files (those a student copy is made of) in ``out``."""
    from .handout import repository_files
    for rel in repository_files():
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dst)
    return out


def grade_task(name: str, student: Path, task: str, per_test_s: float) -> list[dict]:
    """The results (``course.grade``'s dicts) of ``task``'s tests against ``student``."""
    return grader.grade(name, student, tasks=(task,), per_test_s=per_test_s, seed=SEED)["results"]


def outcome(planned: Planned, results: list[dict], seconds: float = 0.0) -> Outcome:
    task = planned.mutant.task
    mine = [r for r in results if r["task"] == task]
    kept, of = sum(r["score"] for r in mine), sum(r["max_score"] for r in mine)
    return Outcome(planned.mutant, kept, of, is_killed(kept, of),
                   [r["name"] for r in mine if r["status"] == "passed"], seconds)


@dataclass
class Report:
    assignment: str
    outcomes: list[Outcome]
    seconds: float
    acceptable: dict[str, str] = field(default_factory=dict)
    untested: list[str] = field(default_factory=list)          # graded tasks no test grades
    reference_failures: list[str] = field(default_factory=list)

    @property
    def killed(self) -> int:
        return sum(o.killed for o in self.outcomes)


def run_mutants(name: str, planned: list[Planned], jobs: int = 1, per_test_s: float = PER_TEST_S,
                progress: bool = True) -> Report:
    """Grade each planned mutant of assignment ``name`` alone, ``jobs`` at a time (a scratch copy each), after
    checking that the unchanged copy passes every test of the tasks concerned."""
    from tqdm import tqdm
    t0 = time.perf_counter()
    tested = set(grader.task_names(get(name)))
    report = Report(name, [Outcome(p.mutant, 0.0, 0.0, False) for p in planned if p.mutant.task not in tested],
                    0.0, untested=sorted({p.mutant.task for p in planned} - tested))
    planned = [p for p in planned if p.mutant.task in tested]
    tasks = tuple(dict.fromkeys(p.mutant.task for p in planned))
    if not planned:
        report.seconds = time.perf_counter() - t0
        return report
    with tempfile.TemporaryDirectory(prefix=f"mutants-{name}-") as tmp:
        made = [copy_repository(Path(tmp) / f"copy{i}") for i in range(max(1, min(jobs, len(planned))))]
        copies: queue.Queue[Path] = queue.Queue()
        for student in made:
            copies.put(student)
        reference = grader.grade(name, made[0], tasks=tasks, per_test_s=per_test_s, seed=SEED)["results"]
        report.reference_failures = [f"{r['name']} ({r['task']}): {r['output']}" for r in reference
                                     if r["status"] != "passed"]
        if report.reference_failures:      # every mutant would look killed
            planned = []

        def one(p: Planned) -> Outcome:
            student = copies.get()
            path = student / p.file
            original = path.read_bytes()
            try:
                path.write_text(p.text)
                t = time.perf_counter()
                return outcome(p, grade_task(name, student, p.mutant.task, per_test_s), time.perf_counter() - t)
            finally:
                path.write_bytes(original)
                copies.put(student)

        bar = tqdm(total=len(planned), desc=name, unit="mutant", file=sys.stderr, disable=not progress,
                   mininterval=2)
        with ThreadPoolExecutor(max_workers=len(made)) as pool:
            for result in pool.map(one, planned):
                report.outcomes.append(result)
                bar.update()
        bar.close()
    report.seconds = time.perf_counter() - t0
    return report


def mutants_of(name: str, only: str | None = None, task: str | None = None, cap: int = CAP) -> list[Planned]:
    """The hand-written mutants, then the catalogue's (less those that compute the same as another), ready to
    grade; only ``task``'s if given."""
    regions = graded_regions(get(name))
    mine = [] if only == "catalogue" else [m for m in hand(name) if task in (None, m.task)]
    theirs = [] if only == "hand" else [m for m in catalogue(name, cap) if task in (None, m.task)]
    out = plan(mine, regions, f"course/{name}/mutants.py: ")
    seen = {p.key for p in out}
    for p in plan(theirs, regions, "catalogue "):
        if p.key not in seen:
            seen.add(p.key)
            out.append(p)
    return out


# -- the report ---------------------------------------------------------------------------------------------

def rate(killed: int, total: int) -> str:
    return f"{100 * killed / total:.1f}%" if total else "-"


def render(report: Report) -> str:
    """One assignment: counts, the kills per task, the survivors with the tests that should have caught them."""
    out = report.outcomes
    operators = {name for name, _ in OPERATORS}
    by_catalogue = sum(o.mutant.source in operators for o in out)
    lines = [f"== {report.assignment}: {len(out)} mutants ({len(out) - by_catalogue} hand, {by_catalogue} "
             f"catalogue), {report.killed} killed ({rate(report.killed, len(out))}) in {report.seconds:.0f} s "
             f"(inputs from --seed {SEED})"]
    if out and report.killed < 0.9 * len(out):
        lines.append("   below the 90% the course asks for")
    for failure in report.reference_failures:
        lines.append(f"   the reference fails {failure}: no mutant was graded")
    for task in report.untested:
        lines.append(f"   task {task}: no test grades it; its mutants all survive")
    tasks = list(dict.fromkeys(o.mutant.task for o in out))
    if tasks:
        width = max(len(t) for t in tasks) + 2
        lines.append(f"   {'task':<{width}}mutants  killed")
        for t in tasks:
            mine = [o for o in out if o.mutant.task == t]
            lines.append(f"   {t:<{width}}{len(mine):>7}  {sum(o.killed for o in mine):>6}")
    survivors = [o for o in out if not o.killed]
    if survivors:
        lines.append("   survivors (task, mutant, points kept; the tests that passed should have caught it):")
    for o in survivors:
        lines.append(f"   [{o.mutant.task}] {o.mutant.name}  ({o.mutant.source}; kept {o.kept:g} / {o.max_score:g})")
        lines.append(f"       passed: {', '.join(o.passing) or '(none)'}")
        why = why_acceptable(o.mutant.name, report.acceptable)
        lines.append(f"       acceptable: {why}" if why else "       not listed in ACCEPTABLE")
    return "\n".join(lines)


def summary(reports: list[Report]) -> str:
    total, killed = sum(len(r.outcomes) for r in reports), sum(r.killed for r in reports)
    return f"{len(reports)} assignments, {total} mutants, {killed} killed ({rate(killed, total)})"


@command_line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course.mutants", description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="assignments: " + ", ".join(ASSIGNMENTS))
    p.add_argument("assignment", help="which assignment, or all: " + ", ".join(ASSIGNMENTS))
    p.add_argument("--task", default=None, help="only the mutants of this task (one assignment)")
    p.add_argument("--only", default=None, metavar="hand|catalogue", help="only one source of mutants")
    p.add_argument("--out", type=Path, default=None, help="also write the report here")
    p.add_argument("--force", action="store_true", help="let --out overwrite an existing file")
    p.add_argument("--jobs", default="1", help="grade this many mutants at once (a scratch copy each; default 1)")
    p.add_argument("--per-test-s", default=str(PER_TEST_S),
                   help=f"time limit of one test of a mutant in seconds (default {PER_TEST_S})")
    p.add_argument("--cap", default=str(CAP), help=f"catalogue mutants per region at most (default {CAP})")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    names = list(ASSIGNMENTS) if args.assignment == "all" else [get(args.assignment).name]
    if args.only not in (None, "hand", "catalogue"):
        raise SystemExit(f"error: --only must be hand or catalogue, got {args.only!r}")
    for flag, value in (("--jobs", args.jobs), ("--cap", args.cap)):
        if not value.isdigit() or int(value) < 1:
            raise SystemExit(f"error: {flag} must be a whole number of at least 1, got {value!r}")
    if int(args.jobs) > (os.cpu_count() or 1):
        raise SystemExit(f"error: --jobs must be at most {os.cpu_count() or 1}, the CPU cores of this machine "
                         f"(each job grades with two processes), got {args.jobs}")
    try:
        per_test_s = float(args.per_test_s)
    except ValueError:
        per_test_s = float("nan")
    grader.check_per_test_s(per_test_s)          # positive, finite, and no shorter than the grader enforces
    if args.task is not None:
        if len(names) != 1:
            raise SystemExit("error: --task needs one assignment, not all")
        tasks = sorted({r.task for r in graded_regions(get(names[0]))})
        if args.task not in tasks:
            raise SystemExit(f"error: no task {args.task!r} in {names[0]!r}; its tasks: {', '.join(tasks)}")
    if args.out is not None:
        if args.out.is_dir():
            raise SystemExit(f"error: --out {args.out} is a folder; name a file")
        if args.out.exists() and not args.force:
            raise SystemExit(f"error: {args.out} exists; name a new file or add --force")
        if not args.out.parent.is_dir():
            raise SystemExit(f"error: --out {args.out}: the folder {args.out.parent} does not exist")
    plans = {n: mutants_of(n, args.only, args.task, int(args.cap)) for n in names}   # every error before grading
    reports, text = [], ""
    for n in names:
        report = run_mutants(n, plans[n], int(args.jobs), per_test_s, progress=not args.quiet)
        report.acceptable = acceptable(n)
        reports.append(report)
        print(render(report) + "\n", flush=True)
        text = "\n\n".join(render(r) for r in reports) + "\n\n" + summary(reports) + "\n"
        if args.out is not None:
            args.out.write_text(text)
    print(summary(reports))
    if args.out is not None:
        print(f"wrote {args.out}")
    return 1 if any(r.reference_failures for r in reports) else 0


if __name__ == "__main__":
    from course.mutants import main as main_  # one Mutant class for this module and the mutants.py files
    sys.exit(main_())
