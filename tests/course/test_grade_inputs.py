"""
What the assignments' tests compare and on which inputs: a grade no submission can forge.

* Every comparison goes through ``oracle.assert_close``, which checks the answer's shape and dtype before its
  values: an answer of shape (0, *shape) broadcasts against the expected one, so ``torch.allclose`` and
  ``mismatches(...).any()`` find nothing wrong in it. A scan of the assignments' test files finds no other
  comparison of tensors (``allclose``, ``isclose``, ``torch.equal``, ``mismatches``).
* Every random input is drawn from the run's seed (``COURSE_SEED``, fresh each grade unless ``--seed N``;
  ``oracle.generator``): a copy that answers from a table recorded on an earlier run's inputs (here
  Scissorhands' public tests on seed 1) scores on that seed and nothing on another; one keyed by what the seed's
  slot order and scale leave of a hand-made case (ChunkKV's) earns no hidden point on another.
* Mutation testing grades on one fixed seed (``course.mutants.SEED``), so its kill table can be run again.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course import grade, mutants
from course.assignments import ROOT
from course.oracle import assert_close, check_tensor, generator, mismatches, seed
from tests.course.test_grader import student_copy

TEST_FILES = sorted((ROOT / "course").glob("*/test_*.py"))
BARE = re.compile(r"\b(allclose|isclose|torch\.equal|mismatches)\s*\(")
OWN_SEEDS = {"sketch_hashes"}      # functions that seed a generator themselves: KVReviver's hashes, from a seed
                                   # the test draws from the run's (its sketch's own coefficients, as the library's)


def close_fails(got, want, **kw) -> str:
    """The message ``assert_close`` fails with."""
    with pytest.raises(AssertionError) as e:
        assert_close(got, want, **kw)
    return str(e.value)


# -- one comparison, shape and dtype first --------------------------------------------------------------------

def test_an_empty_leading_dimension_passes_a_comparison_of_values_alone():
    """Why the shape comes first: an answer of shape (0, *shape) broadcasts, and every value comparison is
    vacuously true."""
    want, got = torch.arange(6.0).view(2, 3), torch.zeros(0, 2, 3)
    assert torch.allclose(got, want) and not mismatches(got, want).any()
    assert close_fails(got, want, what="the scores") == "the scores: expected shape (2, 3), got (0, 2, 3)"


def test_assert_close_refuses_another_dtype_or_no_tensor():
    want = torch.tensor([1.0, 2.0])
    assert "expected dtype torch.float32, got torch.float64" in close_fails(want.double(), want)
    assert "expected dtype torch.bool, got torch.int64" in close_fails(torch.tensor([1, 0]),
                                                                        torch.tensor([True, False]))
    assert "expected a tensor of shape (2,)" in close_fails([1.0, 2.0], want)
    assert "expected shape (2,), got ()" in close_fails(torch.tensor(1.0), want)


def test_assert_close_counts_the_places_that_differ_and_names_the_first():
    want = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    got = want.clone()
    got[0, 2], got[1, 0] = 3.5, 0.0
    message = close_fails(got, want, atol=0.1, what="the output", detail=lambda at: f"row {at[0]}")
    assert message.startswith("the output: 2 of 6 entries differ (compared within atol 0.1 + rtol 0 * |expected|)")
    assert "the first at [0, 2]: got 3.5, expected 3 (row 0)" in message
    assert_close(want + 0.05, want, atol=0.1)
    assert "compared exactly" in close_fails(torch.tensor([1, 2]), torch.tensor([1, 3]))


def test_assert_close_handles_nan_and_infinity():
    """NaN or an infinity is right only where the expected value has the same (a ``(got - want).abs() <= tol``
    comparison is False for NaN, so it would pass a NaN answer)."""
    inf, nan = float("inf"), float("nan")
    assert_close(torch.tensor([nan, inf, -inf, 1.0]), torch.tensor([nan, inf, -inf, 1.0]))
    assert "1 of 2 entries differ" in close_fails(torch.tensor([nan, 1.0]), torch.tensor([0.0, 1.0]), atol=1.0)
    assert "got inf, expected -inf" in close_fails(torch.tensor([inf]), torch.tensor([-inf]), atol=1e9)
    assert "got 0, expected nan" in close_fails(torch.tensor([0.0]), torch.tensor([nan]))


def test_check_tensor_says_which_of_shape_and_dtype_differs():
    check_tensor(torch.zeros(2, 3, dtype=torch.long), (2, 3), torch.long)
    with pytest.raises(AssertionError, match=r"^kept: expected shape \(2, 3\), got \(3, 2\)$"):
        check_tensor(torch.zeros(3, 2, dtype=torch.long), (2, 3), torch.long, "kept")


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_test_compares_tensors_but_through_assert_close(path):
    """A grep of the assignments' tests: no comparison that a shape (0, ...) or a dtype gets through."""
    lines = [f"{path.name}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
             if BARE.search(line)]
    assert not lines, "compare through oracle.assert_close (shape and dtype first), not:\n" + "\n".join(lines)


# -- inputs the copy cannot know -----------------------------------------------------------------------------

def test_a_tests_inputs_follow_the_runs_seed_and_its_salt(monkeypatch):
    def draw(*salt):
        return torch.rand(4, generator=generator(*salt))
    monkeypatch.delenv("COURSE_SEED", raising=False)
    unset = draw("test_x", 1)
    monkeypatch.setenv("COURSE_SEED", "0")
    assert torch.equal(draw("test_x", 1), unset), "without COURSE_SEED the inputs are those of seed 0"
    monkeypatch.setenv("COURSE_SEED", "1")
    one = draw("test_x", 1)
    assert torch.equal(draw("test_x", 1), one), "one seed and one salt: the same inputs"
    assert not torch.equal(draw("test_x", 2), one) and not torch.equal(draw("test_y", 1), one), "another salt"
    monkeypatch.setenv("COURSE_SEED", "2")
    assert not torch.equal(draw("test_x", 1), one), "another run's seed: other inputs"
    assert 0 <= seed("test_x") < 1 << 62


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_test_seeds_its_inputs_itself(path):
    """Every generator of a test comes from ``oracle.generator`` (the run's seed), but where it must mirror the
    library's own seeding (``OWN_SEEDS``), from a seed the test drew."""
    tree = ast.parse(path.read_text())
    own = [f"{path.name}:{node.lineno}" for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
           and fn.name not in OWN_SEEDS for node in ast.walk(fn)
           if isinstance(node, ast.Attribute) and node.attr == "manual_seed"]
    assert not own, f"draw the inputs from oracle.generator (the run's seed), not a fixed seed: {own}"


def test_mutation_testing_grades_on_one_fixed_seed(monkeypatch):
    seen = []
    monkeypatch.setattr(grade, "grade", lambda *args, **kw: seen.append(kw.get("seed")) or {"results": []})
    mutants.grade_task("cache", ROOT, "append", 30)
    assert seen == [mutants.SEED] and isinstance(mutants.SEED, int)


RECORDER = '''
import atexit, importlib.util, os, sys

spec = importlib.util.spec_from_file_location("real_adapters", sys.argv[1])
real = importlib.util.module_from_spec(spec)
spec.loader.exec_module(real)
table = {}


def recorded(name):
    def call(*args, **kw):
        answer = getattr(real, name)(*args, **kw)
        table[key(name, args, kw)] = answer
        return answer
    return call


for name in ("unimportant", "keep_order", "tokens_to_drop"):
    globals()[name] = recorded(name)
atexit.register(lambda: torch.save(table, os.environ["RECORD_TO"]))
'''

KEY = '''
import hashlib
import torch


def encode(x):
    """A repr of the arguments that two equal calls share: a tensor by its dtype, shape and bytes."""
    if isinstance(x, torch.Tensor):
        return f"T({x.dtype}, {tuple(x.shape)}, {x.detach().contiguous().numpy().tobytes().hex()})"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(encode(y) for y in x) + "]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {encode(v)}" for k, v in sorted(x.items())) + "}"
    return repr(x)


def key(name, args, kw):
    return hashlib.sha256(f"{name}{encode(list(args))}{encode(kw)}".encode()).hexdigest()
'''

REPLAY = '''
from pathlib import Path as _Path

_TABLE = torch.load(_Path(__file__).with_name("answers.pt"), weights_only=True)


def _answer(name):
    def call(*args, **kw):
        try:
            return _TABLE[key(name, args, kw)]
        except KeyError:
            raise NotImplementedError(f"{name}: these arguments were not recorded") from None
    return call


unimportant, keep_order, tokens_to_drop = (_answer(n) for n in ("unimportant", "keep_order", "tokens_to_drop"))
'''


def record_public_answers(tmp_path: Path, course_seed: int) -> Path:
    """The answers the reference gives to Scissorhands' public tests' calls on ``course_seed``: the public tests
    run in a process of their own (oracle and tests beside a recording stand-in for the adapters)."""
    run = tmp_path / "record"
    run.mkdir()
    for f in (ROOT / "course" / "oracle.py", ROOT / "course" / "scissorhands" / "test_public.py"):
        (run / f.name).write_text(f.read_text())
    (run / "adapters.py").write_text(KEY + RECORDER)
    table = tmp_path / "answers.pt"
    script = "import test_public as t\nfor n in dir(t):\n    n.startswith('test_') and getattr(t, n)()\n"
    env = {**os.environ, "PYTHONPATH": f"{run}:{ROOT}", "COURSE_SEED": str(course_seed), "RECORD_TO": str(table)}
    subprocess.run([sys.executable, "-c", script, str(ROOT / "course" / "scissorhands" / "adapters.py")], cwd=run,
                   check=True, env=env)
    return table


@pytest.mark.slow
def test_a_copy_that_replays_an_earlier_runs_answers_scores_nothing_on_another_seed(tmp_path):
    """Scissorhands' student copy whose adapters answer from a table hash(arguments) -> answer, recorded from the
    public tests of a run with ``--seed 1`` (else NotImplementedError): it scores on seed 1 (so the table works)
    and nothing on seed 2, nor on a fresh seed."""
    table = record_public_answers(tmp_path, course_seed=1)
    recorded = torch.load(table, weights_only=True)
    assert len(recorded) >= 10, f"the public tests made {len(recorded)} calls"
    copy = student_copy(tmp_path, "scissorhands")
    adapters = copy / "course" / "scissorhands" / "adapters.py"
    adapters.write_text(adapters.read_text() + "\n\n# -- answers from a table of an earlier run's calls" + KEY + REPLAY)
    (adapters.parent / "answers.pt").write_bytes(table.read_bytes())
    on_seed_1 = grade.grade("scissorhands", copy, seed=1)
    public = [r for r in on_seed_1["results"] if r["visibility"] == "visible"]
    assert on_seed_1["score"] > 0 and all(r["status"] == "passed" for r in public), on_seed_1["results"]
    for other in (2, None):
        summary = grade.grade("scissorhands", copy, seed=other)
        assert summary["score"] == 0, (summary["seed"], [(r["name"], r["score"]) for r in summary["results"]])
        assert all("not recorded" in r["output"] or "NotImplementedError" in r["output"]
                   for r in summary["results"]), summary["results"][0]["output"]


# A table keyed by what the seed's slot order and power-of-two scale leave of a chunk_mask call (a red-team
# helper's forgery of chunkkv): per (row, head) the sorted (position, free, vote over the largest) and the room.
CANON = '''
import json, math
import torch


def key(args):
    scores, pos, free, n_free, chunk_size, shared, remainder = args
    finite = [abs(x) for x in scores[free].tolist() if math.isfinite(x) and x]
    unit = max(finite, default=1.0)
    rows = [(int(n_free[b, h]), sorted((int(p), bool(f), round(s / unit, 6) if math.isfinite(s) else str(s))
             for p, f, s in zip(pos[b, h].tolist(), free[b, h].tolist(), scores[b, h].tolist())))
            for b in range(pos.shape[0]) for h in range(pos.shape[1])]
    return repr((tuple(pos.shape), chunk_size, shared, remainder, rows))
'''

CANON_RECORDER = '''
import atexit, importlib.util, os, sys

spec = importlib.util.spec_from_file_location("real_adapters", sys.argv[1])
real = importlib.util.module_from_spec(spec)
spec.loader.exec_module(real)
table = {}


def chunk_mask(*args):
    mask = real.chunk_mask(*args)
    pos = args[1]
    table[key(args)] = [[sorted(pos[b, h][mask[b, h]].tolist()) for h in range(pos.shape[1])]
                        for b in range(pos.shape[0])]
    return mask


holds = real.holds
atexit.register(lambda: open(os.environ["RECORD_TO"], "w").write(json.dumps(table)))
'''

CANON_REPLAY = '''

def chunk_mask(*args):
    kept = _TABLE.get(key(args))
    if kept is None:
        raise NotImplementedError("chunk_mask: these arguments were not recorded")
    pos, free = args[1], args[2]
    return torch.stack([torch.stack([torch.isin(pos[b, h], torch.tensor(kept[b][h], dtype=pos.dtype)) & free[b, h]
                                     for h in range(pos.shape[1])]) for b in range(pos.shape[0])])
'''


@pytest.mark.slow
def test_a_table_keyed_by_what_order_and_scale_leave_earns_no_hidden_point(tmp_path):
    """ChunkKV's copy whose ``chunk_mask`` answers from a table recorded on seed 1 (public tests and the hidden
    hand cases) under a key that the seed's slot order and scale do not change: on seed 1 it passes them; on
    seed 2 it earns no hidden point (the hand cases are asked with drawn rows, checked by a loop; before, 2 of
    18). A public hand case says its answer when it fails, so its points stay replayable (course/README.md)."""
    run = tmp_path / "record"
    run.mkdir()
    for f in (ROOT / "course" / "oracle.py", *(ROOT / "course" / "chunkkv").glob("test_*.py")):
        (run / f.name).write_text(f.read_text())
    (run / "adapters.py").write_text(CANON + CANON_RECORDER)
    table = tmp_path / "answers.json"
    script = ("import test_public as t, test_hidden as h\n[getattr(t, n)() for n in dir(t) if n.startswith('test_')]\n"
              "h.test_shared_ranking_sums_votes_over_heads_and_protected_slots_never_compete()\n")
    env = {**os.environ, "PYTHONPATH": f"{run}:{ROOT}", "COURSE_SEED": "1", "RECORD_TO": str(table)}
    subprocess.run([sys.executable, "-c", script, str(ROOT / "course" / "chunkkv" / "adapters.py")], cwd=run,
                   check=True, env=env)
    copy = student_copy(tmp_path, "chunkkv")
    adapters = copy / "course" / "chunkkv" / "adapters.py"
    adapters.write_text(adapters.read_text() + CANON + f"\n_TABLE = json.loads({table.read_text()!r})\n" + CANON_REPLAY)
    hand = "test_shared_ranking_sums_votes_over_heads_and_protected_slots_never_compete"
    on_seed_1 = {r["name"]: r for r in grade.grade("chunkkv", copy, seed=1)["results"]}
    assert on_seed_1[hand]["status"] == "passed", on_seed_1[hand]["output"]        # the table works
    on_seed_2 = grade.grade("chunkkv", copy, seed=2)["results"]
    hidden = [(r["name"], r["score"]) for r in on_seed_2 if r["visibility"] == "hidden"]
    assert hidden and all(score == 0 for _, score in hidden), hidden
