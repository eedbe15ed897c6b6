"""
Exercises that check the learner (``notebooks/exercises.py``): every exercise of a lesson is a cell where the
learner writes (``my_*`` names, stubs of None or ``...``), a visible check that reads only those, and the
reference answer in a collapsed cell that assigns its own ``reference_*`` names.

The fast tests read the sources: the three cells of each exercise, in order, and what each may assign and read.
The slow one (``test_notebooks.py::test_each_exercise_checks_the_learner``, on the lessons' tiny-mode run) puts
probes after each reference cell (``with_probes``): the check cell run again with the reference's answer in the
learner's names passes, and with a plausible wrong answer (``wrong_answers/NN_*.json``) fails with its hint, a
hint that does not print the answer; a right answer in another form (``right_answers/NN_*.json``: a float32
tensor for a float, say) passes too; the untouched stub's check said "not answered yet".
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import re
import symtable
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
WRONG = Path(__file__).resolve().parent / "wrong_answers"
RIGHT_FORMS = Path(__file__).resolve().parent / "right_answers"
_spec = importlib.util.spec_from_file_location("notebook_build", NOTEBOOKS / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)
LESSONS = build.lessons()

HEADING = re.compile(r"^### Exercise (\d+):", flags=re.M)
NOT_YET, RIGHT, PROBE = "not answered yet", ": right.", "EXERCISE-PROBE "


@dataclass
class Part:
    """One check of an exercise: the learner's cell, the check cell, the reference cell (cell indices)."""
    exercise: int
    stub: int
    check: int
    reference: int


def parts(nb: nbformat.NotebookNode) -> tuple[list[int], list[Part]]:
    """(the exercise numbers the headings past ``## Exercises`` name, each check cell's three cells)."""
    numbers, found, current, inside = [], [], None, False
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            lines = cell.source.splitlines()
            if build.EXERCISES in (line.strip() for line in lines):
                inside = True
            elif any(line.startswith("## ") for line in lines):
                inside = False
            if inside and (m := HEADING.findall(cell.source)):
                numbers += [int(n) for n in m]
                current = int(m[-1])
        elif inside and current is not None and "@exercise(" in cell.source and "probe" not in cell.metadata:
            found.append(Part(current, i - 1, i, i + 1))
    return numbers, found


def assigned(source: str) -> set[str]:
    """The names a cell binds at its top level (assignments, imports, defs, loop targets)."""
    table = symtable.symtable(source, "cell", "exec")
    return {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()
            or s.is_namespace()}


def read_globals(source: str) -> set[str]:
    """The global names a cell reads, at its top level or inside the functions it defines."""
    names, tables = set(), [symtable.symtable(source, "cell", "exec")]
    while tables:
        t = tables.pop()
        tables += t.get_children()
        names |= {s.get_name() for s in t.get_symbols() if s.is_referenced()
                  and (t.get_type() == "module" or s.is_global())}
    return names


def stub_values(source: str) -> dict[str, str]:
    """The ``my_*`` names a learner's cell assigns, each with the source of its value."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id.startswith("my_"):
                    out[target.id] = ast.get_source_segment(source, node.value)
    return out


def is_stub(value: str) -> bool:
    """None or ``...``, or a list, tuple or dict whose items are."""
    node = ast.parse(value, mode="eval").body
    items = node.values if isinstance(node, ast.Dict) else node.elts if isinstance(node, (ast.List, ast.Tuple)) \
        else [node]
    return bool(items) and all(isinstance(v, ast.Constant) and v.value in (None, Ellipsis) for v in items)


def call_args(source: str, function: str) -> list[str]:
    """The names passed to the last top-level call of ``function`` in a cell."""
    calls = [n.value for n in ast.parse(source).body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
             and isinstance(n.value.func, ast.Name) and n.value.func.id == function]
    assert calls, f"no call of {function}(...) at the cell's top level"
    return [a.id if isinstance(a, ast.Name) else ast.unparse(a) for a in calls[-1].args]


def check_name(source: str) -> str:
    """The function a check cell decorates with ``@exercise(...)``."""
    return next(n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and any(
        isinstance(d, ast.Call) and getattr(d.func, "id", None) == "exercise" for d in n.decorator_list))


def problems(nb: nbformat.NotebookNode) -> list[str]:
    """What keeps a lesson's exercises from checking the learner (empty when nothing does)."""
    numbers, found = parts(nb)
    out = [f"Exercise {n}: no check cell (@exercise(...))" for n in numbers if n not in {p.exercise for p in found}]
    for p in found:
        where = f"Exercise {p.exercise} (cells {p.stub}-{p.reference})"
        stub, check, ref = (nb.cells[i] if i < len(nb.cells) else None for i in (p.stub, p.check, p.reference))
        if stub is None or stub.cell_type != "code" or ref is None or ref.cell_type != "code":
            out.append(f"{where}: a check cell needs the learner's code cell before it and the reference's after")
            continue
        mine = stub_values(stub.source)
        if not mine:
            out.append(f"{where}: the learner's cell assigns no my_* name")
        out += [f"{where}: {k} = {v} is not a stub (None or ...)" for k, v in mine.items() if not is_stub(v)]
        if stub.metadata.get("jupyter", {}).get("source_hidden") or check.metadata.get("jupyter", {}).get(
                "source_hidden"):
            out.append(f"{where}: the learner's cell and the check are in sight")
        if not ref.metadata.get("jupyter", {}).get("source_hidden") or not any(
                t.startswith(build.SOLUTION_TAG) for t in ref.metadata.get("tags", [])):
            out.append(f"{where}: the reference cell holds a solution region and is collapsed")
        function = check_name(check.source)
        if sorted(call_args(check.source, function)) != sorted(mine):
            out.append(f"{where}: the check cell calls {function} on the learner's names, {sorted(mine)}")
        wanted = sorted("reference_" + k[len("my_"):] for k in mine)
        try:
            given = call_args(ref.source, function)
        except AssertionError as e:
            given = [str(e)]
        if sorted(given) != wanted:
            out.append(f"{where}: the reference cell calls {function} on {wanted}, not {given}")
        if clash := assigned(ref.source) & (assigned(stub.source) | {function}):
            out.append(f"{where}: the reference cell assigns the learner's {sorted(clash)}")
        if peek := read_globals(check.source) & assigned(ref.source):
            out.append(f"{where}: the check reads the reference's {sorted(peek)}")
        if trusted := read_globals(check.source) & (assigned(stub.source) - set(mine)):
            out.append(f"{where}: the check trusts {sorted(trusted)}, defined in the learner's cell (move it to a "
                       "cell of its own before)")
    return out


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_every_exercise_has_a_cell_to_write_a_check_and_a_reference_out_of_sight(path):
    nb = build.read_percent(path)
    numbers, _ = parts(nb)
    assert numbers, f"{path.name}: no ### Exercise heading past ## Exercises"
    assert not (found := problems(nb)), f"{path.name}:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_every_exercise_has_a_plausible_wrong_answer(path):
    _, found = parts(build.read_percent(path))
    wrong = probe_answers(path.stem)
    for p in found:
        key = f"{p.exercise}:{check_name(build.read_percent(path).cells[p.check].source)}"
        assert key in wrong, f"{path.name}: no wrong answer for {key} in {WRONG / (path.stem + '.json')}"


def test_no_exercise_asks_the_learner_to_edit_the_tested_library():
    for path in LESSONS:
        text = path.read_text().split("# ## Exercises", 1)[-1]
        asks = re.findall(r"(?:edit|change|modify|open)\s+`?(?:methods|nanollm|kernels|fastpath)/[\w/]+\.py", text)
        assert not asks, f"{path.name}: {asks}: copy the function into the notebook instead"


def source_nb(text: list[tuple[str, str]]) -> nbformat.NotebookNode:
    """A notebook of ("md" | "code", source) cells."""
    nb = nbformat.v4.new_notebook()
    for kind, src in text:
        nb.cells.append(nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src))
    return nb


GOOD = [("md", "## Exercises\n\n### Exercise 1: a ratio"), ("code", "my_total = None   # replace None: 3 / 8"),
        ("code", '@exercise("Exercise 1")\ndef check_total(total):\n    assert total == 0.375, "divide them"\n'
                 "check_total(my_total)"),
        ("code", "reference_total = 3 / 8\ncheck_total(reference_total)")]


def test_the_rules_catch_an_exercise_that_checks_its_own_answer():
    """The mistakes the rules are for, each on a one-exercise lesson: the reference assigning the learner's name
    (an untouched stub then "passes"), a check reading the reference, no stub, no check."""
    def nb(cells):
        out = source_nb(cells)
        out.cells[3].metadata.update(jupyter={"source_hidden": True, "outputs_hidden": True},
                                     tags=["solution:x"])
        return out
    assert problems(nb(GOOD)) == []
    own = GOOD[:3] + [("code", "my_total = 1 + 2\ncheck_total(my_total)")]
    assert any("assigns the learner's ['my_total']" in p for p in problems(nb(own)))
    peek = GOOD[:2] + [("code", GOOD[2][1].replace("total == 0.375", "total == reference_total"))] + GOOD[3:]
    assert any("reads the reference's ['reference_total']" in p for p in problems(nb(peek)))
    filled = [GOOD[0], ("code", "my_total = 3")] + GOOD[2:]
    assert any("is not a stub" in p for p in problems(nb(filled)))
    shown = nb(GOOD)
    shown.cells[3].metadata = {}
    assert any("collapsed" in p for p in problems(shown))
    assert problems(source_nb(GOOD[:2])) == ["Exercise 1: no check cell (@exercise(...))"]


# -- the probes the slow tier runs ------------------------------------------------------------------------------

def probe_answers(stem: str, folder: Path = WRONG) -> dict[str, list[dict[str, str]]]:
    """``{"N:check_name": [{"my_x": "a wrong answer, as Python the kernel evaluates"}, ...]}`` for a lesson: in the
    file, one answer's dict or a list of them (``folder=RIGHT_FORMS``: right answers in other forms)."""
    path = folder / f"{stem}.json"
    found = json.loads(path.read_text()) if path.exists() else {}
    return {k: v if isinstance(v, list) else [v] for k, v in found.items()}


def probe(p: Part, nb: nbformat.NotebookNode, wrong: list[dict[str, str]] | None,
          right: list[dict[str, str]] | None = None) -> str:
    """A cell to run after ``p``'s reference cell: the check cell again, once with the reference's answer in the
    learner's names, once with each ``wrong`` answer and once with each ``right`` one (another form of a right
    answer); prints one JSON line; puts the stubs back."""
    mine = sorted(stub_values(nb.cells[p.stub].source))
    check = nb.cells[p.check].source
    reference = "{" + ", ".join(f"{k!r}: reference_{k[3:]}" for k in mine) + "}"
    cases = f"'reference': {reference}"
    for kind, answers in (("wrong", wrong), ("right", right)):                # cases 'wrong', 'wrong 2', 'right'...
        for i, answer in enumerate(answers or []):
            name = kind + (f" {i + 1}" if i else "")
            cases += f", {name!r}: {{" + ", ".join(f"{k!r}: ({answer[k]})" for k in mine) + "}"
    return "\n".join([
        "import contextlib as _c, io as _io, json as _json",
        f"_stubs = {{k: globals()[k] for k in {mine!r}}}",
        f"_cases, _said = {{{cases}}}, {{}}",
        "for _case, _values in _cases.items():",
        "    globals().update(_values)",
        "    _out = _io.StringIO()",
        "    try:",
        "        with _c.redirect_stdout(_out):",
        f"            exec({check!r}, globals())",
        "        _said[_case] = ['passed', _out.getvalue()]",
        "    except Exception as _e:",
        "        _said[_case] = [type(_e).__name__, str(_e)]",
        "globals().update(_stubs)",
        f"_said['answer'] = [repr(v) for v in {reference}.values()]",
        f"print({PROBE!r} + _json.dumps({{'exercise': {p.exercise}, 'said': _said}}))",
    ])


def with_probes(nb: nbformat.NotebookNode, stem: str) -> nbformat.NotebookNode:
    """A copy of a lesson with a probe after each exercise's reference cell."""
    out = copy.deepcopy(nb)
    _, found = parts(out)
    wrong, right = probe_answers(stem), probe_answers(stem, RIGHT_FORMS)
    for p in reversed(found):
        key = f"{p.exercise}:{check_name(out.cells[p.check].source)}"
        cell = nbformat.v4.new_code_cell(probe(p, out, wrong.get(key), right.get(key)))
        cell.metadata["probe"] = key
        out.cells.insert(p.reference + 1, cell)
    return out


def shown_forms(answer: str) -> set[str]:
    """How an answer (its repr) could appear in a hint: the repr, and for a number its roundings."""
    forms = {answer}
    try:
        x = float(answer)
    except ValueError:
        return {f for f in forms if len(f) >= 3}
    forms |= {f"{x:.{n}f}" for n in range(1, 5)} | {f"{x:.{n}g}" for n in range(2, 5)}
    return {f for f in forms if len(f.strip("0.-")) >= 2}


def probe_findings(nb: nbformat.NotebookNode) -> list[str]:
    """What a probed lesson's run says is wrong with its exercises (empty when each checks the learner)."""
    out, said = [], {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        text = "".join(o.get("text", "") for o in cell.get("outputs", []))
        if "probe" in cell.metadata:
            line = next((x for x in text.splitlines() if x.startswith(PROBE)), None)
            if line is None:
                out.append(f"{cell.metadata['probe']}: the probe printed nothing: {text[-300:]!r}")
                continue
            said[cell.metadata["probe"]] = json.loads(line[len(PROBE):])["said"]
    _, found = parts(nb)
    for p in found:
        key = f"{p.exercise}:{check_name(nb.cells[p.check].source)}"
        text = "".join(o.get("text", "") for o in nb.cells[p.check].get("outputs", []))
        if NOT_YET not in text:
            out.append(f"{key}: the untouched stub's check did not say {NOT_YET!r}: {text[-200:]!r}")
        got = said.get(key)
        if got is None:
            continue
        if got["reference"][0] != "passed" or RIGHT not in got["reference"][1]:
            out.append(f"{key}: the reference's answer in the learner's cell did not pass: {got['reference']}")
        for case in [c for c in got if c.startswith("right")]:
            if got[case][0] != "passed" or RIGHT not in got[case][1]:
                out.append(f"{key}: a right answer in another form ({case}) was refused: {got[case]}")
        for case in [c for c in got if c.startswith("wrong")] or ["wrong"]:
            kind, hint = got.get(case, ["no wrong answer", ""])
            if kind != "NotRightYet":
                out.append(f"{key}: the {case} answer was not refused with a hint: {got.get(case)}")
            elif leaked := [a for a in got["answer"] for f in shown_forms(a)
                            if re.search(rf"(?<![\w.]){re.escape(f)}(?![\w]|\.\d)", hint)]:
                out.append(f"{key}: the hint shows the answer {leaked}: {hint!r}")
    return out


def test_the_probes_see_a_check_that_passes_anything_and_a_hint_that_gives_the_answer():
    """The slow test's reading of a probed run, on runs made up by hand."""
    nb = source_nb(GOOD)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", text="Exercise 1: not answered yet (...)\n")]
    def run(reference, wrong):
        out = copy.deepcopy(nb)
        cell = nbformat.v4.new_code_cell("probe")
        cell.metadata["probe"] = "1:check_total"
        said = {"reference": reference, "wrong": wrong, "answer": ["0.375"]}
        cell.outputs = [nbformat.v4.new_output("stream", text=PROBE + json.dumps({"exercise": 1, "said": said}))]
        out.cells.append(cell)
        return probe_findings(out)
    right = ["passed", "Exercise 1: right.\n"]
    assert run(right, ["NotRightYet", "Exercise 1: not right yet. add them"]) == []
    assert "was not refused" in run(right, ["passed", "Exercise 1: right.\n"])[0]
    assert "shows the answer" in run(right, ["NotRightYet", "Exercise 1: not right yet. 3 / 8 = 0.38"])[0]
    assert "did not pass" in run(["NotRightYet", "x"], ["NotRightYet", "divide them"])[0]
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", text="Exercise 1: right.\n")]
    assert "did not say" in run(right, ["NotRightYet", "divide them"])[0]


def test_the_probes_see_a_check_that_refuses_a_right_answer_in_another_form():
    """Lesson 04's concentrated-attention exercise refused a right fraction computed as a float32 mean (a 1e-9
    tolerance): the probes run the right forms of ``right_answers/`` too, and a refused one is a finding."""
    nb = source_nb(GOOD)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", text="Exercise 1: not answered yet (...)\n")]
    cell = nbformat.v4.new_code_cell("probe")
    cell.metadata["probe"] = "1:check_total"
    said = {"reference": ["passed", "Exercise 1: right.\n"], "wrong": ["NotRightYet", "divide them"],
            "right": ["NotRightYet", "divide them"], "answer": ["0.375"]}
    cell.outputs = [nbformat.v4.new_output("stream", text=PROBE + json.dumps({"exercise": 1, "said": said}))]
    nb.cells.append(cell)
    assert any("another form (right) was refused" in f for f in probe_findings(nb))
    said["right"] = ["passed", "Exercise 1: right.\n"]
    cell.outputs = [nbformat.v4.new_output("stream", text=PROBE + json.dumps({"exercise": 1, "said": said}))]
    assert probe_findings(nb) == []
    assert "'right': {'my_total': (torch.tensor(0.375))}" in probe(parts(nb)[1][0], nb, [{"my_total": "1"}],
                                                                    [{"my_total": "torch.tensor(0.375)"}])


def exercises_module():
    """``notebooks/exercises.py``, loaded as the notebooks import it."""
    spec = importlib.util.spec_from_file_location("notebook_exercises", NOTEBOOKS / "exercises.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_library_call_inside_a_helper_of_the_learners_is_seen():
    """``exercises.calls`` refuses an answer made with the library call an exercise asks to do without, also when
    the call is in a function defined inside the answer or in another function of the notebook it calls (the
    answer's own code names neither: lessons 01, 03 and 04 passed such answers)."""
    exercises = exercises_module()
    space = {"__name__": "__main__", "library_rule": lambda *a: a}
    exec("def direct(x):\n    return library_rule(x)\n"
         "def nested(x):\n    inner = lambda y: library_rule(y)\n    return inner(x)\n"
         "def helper(x):\n    return library_rule(x)\n"
         "def through_helper(x):\n    return helper(x) + 1\n"
         "def by_hand(x):\n    return x + 1\n", space)
    for name in ("direct", "nested", "through_helper"):
        assert exercises.calls(space[name], "library_rule", "other") == ["library_rule"], name
    assert exercises.calls(space["by_hand"], "library_rule") == []


def test_a_forbidden_function_under_another_name_is_seen():
    """An exercise that forbids a function (lesson 01's StreamingLLM exercise forbade section 2.1's
    ``streaming_keep``): ``my_leaves_at = streaming_keep`` (or a call through another name for it) passed, since
    neither answer's code names it."""
    exercises = exercises_module()
    space = {"__name__": "__main__"}
    exec("def streaming_keep(x):\n    return x + 1\n"
         "my_leaves_at = streaming_keep\n"
         "keep = streaming_keep\n"
         "def through_alias(x):\n    return keep(x)\n"
         "def by_hand(x):\n    return x + 1\n", space)
    assert exercises.calls(space["my_leaves_at"], "streaming_keep", "sinks_and_recent") == ["streaming_keep"]
    assert exercises.calls(space["through_alias"], "streaming_keep") == ["streaming_keep"]
    assert exercises.calls(space["by_hand"], "streaming_keep") == []


def test_a_partial_or_a_callable_object_is_read_too():
    """``functools.partial`` of an answer made ``calls`` fail with an AttributeError (no ``__globals__``), and a
    partial over the forbidden function, or an object whose ``__call__`` makes the call, is that call (an
    exercise audit's probes)."""
    import functools
    exercises = exercises_module()
    space = {"__name__": "__main__"}
    exec("def streaming_keep(x, extra=0):\n    return x + extra\n"
         "def by_hand(x, extra=0):\n    return x + 1 + extra\n"
         "def apply(f, x):\n    return f(x)\n"
         "class Rule:\n    def __call__(self, x):\n        return streaming_keep(x)\n", space)
    assert exercises.calls(functools.partial(space["by_hand"], extra=1), "streaming_keep") == []
    assert exercises.calls(functools.partial(space["streaming_keep"], extra=1), "streaming_keep") == ["streaming_keep"]
    assert exercises.calls(functools.partial(space["apply"], space["streaming_keep"]), "streaming_keep") == \
        ["streaming_keep"]
    assert exercises.calls(space["Rule"](), "streaming_keep") == ["streaming_keep"]


def test_an_answer_that_writes_into_its_input_is_refused_and_leaves_the_lessons_tensors_alone():
    """``exercises.on_copies``: lessons 03 and 04 compared an answer with values computed from the tensors they had
    handed it, so ``kept = attn; kept[~keep] = 0`` (no copy) changed both sides alike and passed."""
    import torch
    exercises = exercises_module()
    attn, keep = torch.tensor([0.5, float("nan"), 0.25]), torch.tensor([True, False, True])

    def aliased(attn, keep):
        kept = attn
        kept[~keep] = 0
        return kept.sum()

    with pytest.raises(AssertionError, match="changed its input `attn` in place"):
        exercises.on_copies(aliased, attn, keep)
    assert attn[1].isnan() and attn[0] == 0.5, "the lesson's tensor was written"
    assert exercises.on_copies(lambda attn, keep: (attn * keep).nansum(), attn, keep) == 0.75   # NaN == NaN here
    maps = [attn.clone(), attn.clone()]                                 # lesson 01 hands over a list of maps
    with pytest.raises(AssertionError, match="changed its input `maps` in place"):
        exercises.on_copies(lambda maps, budget: [m.mul_(0.5) for m in maps], maps, 3)
    assert maps[0][0] == 0.5, "a tensor inside the lesson's list was written"
    with pytest.raises(AssertionError, match="changed its input `keep`"):
        exercises.on_copies(lambda attn, keep: keep.logical_not_(), attn, keep)   # bool: no allclose


def test_where_differs_names_the_first_entry_and_the_shape():
    """``exercises.where_differs``, the by-hand checks' message: a shape, or the first entry that differs."""
    import torch
    exercises = exercises_module()
    lib = torch.zeros(2, 3)
    mine = lib.clone()
    mine[1, 2], mine[1, 0] = 0.5, 1e-9                       # the second is within tolerance
    assert exercises.where_differs(mine, lib, ("KV head", "token")) == \
        "KV head 1, token 2: 0.5 by hand, 0 in the library (1 of 6 entries differ)"
    assert exercises.where_differs(lib, lib, ("KV head", "token")) == ""
    assert exercises.where_differs(torch.zeros(2, 4), lib, ("KV head", "token")) == \
        "shape (2, 4) by hand, (2, 3) in the library"
    assert exercises.where_differs(mine > 0.1, lib > 0.1, ("KV head", "token")).startswith(
        "KV head 1, token 2: True by hand, False in the library")


def test_a_redefined_lesson_function_is_named_not_checked_against():
    """A check that computes its truth with a lesson's function (lesson 04's ``perturbation_after``, 07's
    ``decode_bytes``) read the learner's function when their cell defined one under that name, and called a
    wrong answer made with it right (a reader's probe): a ``@lesson_function`` redefined is named instead."""
    exercises = exercises_module()
    space = {"__name__": "__main__", "exercise": exercises.exercise, "lesson_function": exercises.lesson_function}
    exec("@lesson_function\ndef truth(x):\n    return 2 * x\n"
         "@exercise('Exercise 1')\ndef check_double(f):\n    assert f(3) == truth(3), 'twice'\n", space)
    space["check_double"](lambda x: 2 * x)                                    # right: passes
    exec("def truth(x):\n    return x\n", space)                             # the learner's cell redefines it
    with pytest.raises(exercises.NotRightYet, match="computes with the lesson's truth, which your cells define"):
        space["check_double"](lambda x: x)


def test_an_answer_the_check_cannot_read_gets_a_hint_and_the_learners_own_error_its_traceback():
    """A string for a number, or a started function that returns None, crashed the check with a TypeError (a
    reader's probes): it is not right yet, with the error as the hint. An error inside the learner's own function
    stays theirs, traceback and all, and a cell waiting on an unfinished task stops with NotImplementedError."""
    exercises = exercises_module()

    @exercises.exercise("Exercise 2")
    def check_sum(f):
        assert sum(f([1, 2])) == 3, "the values, kept"

    with pytest.raises(exercises.NotRightYet, match=r"could not read your answer \(TypeError: 'NoneType'"):
        check_sum(lambda xs: None)

    def buggy(xs):
        return [x + "1" for x in xs]                                          # the learner's own TypeError
    with pytest.raises(TypeError, match="unsupported operand"):
        check_sum(buggy)

    @exercises.exercise("Exercise 3")
    def check_with_the_library(x):                                            # the library's task not done yet
        raise NotImplementedError("runs once task low_flags is done")
    with pytest.raises(NotImplementedError, match="low_flags"):
        check_with_the_library(1)
