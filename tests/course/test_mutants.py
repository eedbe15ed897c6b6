"""
The mutation engine (``course/mutants.py``): the catalogue's operators on a toy region, the checks of
hand-written mutants, the kill rule, the command line; in the slow tier, mutants graded for real.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

from course import grade, mutants
from course.assignments import ASSIGNMENTS
from course.markers import find_regions
from course.mutants import Mutant
from tests.commands import refused

TOY = '''\
import torch


def f(x, n, mask, q, B, H, G, T):
    """A toy region with one site per operator."""
    # BEGIN SOLUTION [toy:t] anything
    s = x.sum(dim=-1)
    m = x.max(dim=1).values
    y = -s + n * 2
    ok = (n < 3) & ~mask
    last = x[..., 0]
    g = q.view(B, H, G, T)
    top = torch.sort(s, descending=True).indices
    w = x.mean(1, keepdim=True)
    window = x[:, n - 1:]
    x = x * 2
    return y, m, ok, last, g, top, w, window, x
    # END SOLUTION
'''


@pytest.fixture
def toy(tmp_path):
    path = tmp_path / "toy.py"
    path.write_text(TOY)
    return find_regions(path)[0]


def lines_of(m: Mutant) -> set[str]:
    return {line.strip() for line in m.new.splitlines()}


@pytest.mark.parametrize("source, line", [
    ("dim", "s = x.sum(dim=-2)"),
    ("dim", "w = x.mean(2, keepdim=True)"),
    ("reduction", "s = x.mean(dim=-1)"),
    ("reduction", "s = x.amax(dim=-1)"),
    ("reduction", "m = x.sum(dim=1)"),                             # a max's .values goes with it
    ("reduction", "w = x.median(1, keepdim=True).values"),         # and comes with a median
    ("drop_sign", "y = s + n * 2"),
    ("drop_sign", "ok = (n < 3) & mask"),
    ("drop_term", "y = -s"),
    ("drop_term", "y = -s + n"),
    ("drop_term", "ok = n < 3"),
    ("compare", "ok = (n <= 3) & ~mask"),
    ("first_last", "last = x[..., -1]"),
    ("shape_swap", "g = q.view(B, G, H, T)"),
    ("shape_swap", "g = q.view(H, B, G, T)"),
    ("flip", "top = torch.sort(s, descending=False).indices"),
    ("flip", "w = x.mean(1, keepdim=False)"),
    ("bound", "window = x[:, n - 1 + 1:]"),
    ("bound", "window = x[:, n - 1 - 1:]"),
    ("off_by_one", "ok = (n < 4) & ~mask"),
    ("off_by_one", "y = -s + n * 1"),
])
def test_each_operator_writes_what_it_says(toy, source, line):
    found = [m for m in mutants.region_mutants(toy, cap=1000) if line in lines_of(m)]
    assert [m.source for m in found] == [source], f"{line!r} written by {[m.source for m in found]}"
    m = found[0]
    assert m.task == "t" and m.name.startswith(f"{source} at toy.py:")
    assert len(m.new.splitlines()) == 11, "one edit: every other statement of the region stays"


def test_statements_are_left_out_only_where_a_value_remains(toy):
    dropped = {m.name.split(": ", 1)[1] for m in mutants.region_mutants(toy, cap=1000) if m.source == "drop_statement"}
    assert dropped == {"x = x * 2 -> (left out)"}, "x = x * 2 leaves x; dropping s = ... would leave s unbound"


def test_catalogue_mutants_apply_to_the_region_and_keep_the_rest(toy):
    ms = mutants.region_mutants(toy, cap=1000)
    planned = mutants.plan(ms, [toy])
    assert len(planned) == len(ms) and len({p.key for p in planned}) == len(ms), "all distinct"
    for p in planned:
        lines = p.text.splitlines()
        assert lines[:toy.begin] == TOY.splitlines()[:toy.begin] and lines[-1] == "    # END SOLUTION"
        assert all(line.startswith("    ") for line in lines[toy.begin:-1]), "re-indented to the region's"
        compile(p.text, "toy.py", "exec")
    names = [m.name for m in ms]
    assert len(set(names)) == len(names)
    line = next(m for m in ms if "last = x[..., -1]" in lines_of(m)).name
    assert f"toy.py:{toy.begin + 5}: 0 -> -1" in line, "the name gives the file's line of the site"


def test_the_same_mutant_is_written_once(toy):
    """Index 0 -> -1 is first_last's and off_by_one's: kept once, under the operator listed first."""
    ms = mutants.region_mutants(toy, cap=1000)
    assert [m.source for m in ms if "last = x[..., -1]" in lines_of(m)] == ["first_last"]
    assert len({ast.dump(ast.parse(m.new)) for m in ms}) == len(ms)
    assert ast.dump(ast.parse(textwrap.dedent("\n".join(toy.body(TOY.splitlines()))))) not in \
        {ast.dump(ast.parse(m.new)) for m in ms}, "no mutant computes what the region computes"


def test_a_mutant_that_does_not_compile_is_left_out(toy):
    def literal_target(node, parent, tree):          # `1 = x.sum(dim=-1)` parses back but does not compile
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "s":
            return [(node.targets[0], ast.Constant(1))]
        return []
    ops = [("bad", literal_target), ("compare", mutants.op_compare)]
    assert [m.source for m in mutants.region_mutants(toy, operators=ops)] == ["compare"]


def test_the_cap_takes_every_operator_in_turn(toy):
    ms = mutants.region_mutants(toy, cap=8)
    assert len(ms) == 8 and len({m.source for m in ms}) == 8
    assert [m.name for m in ms] == [m.name for m in mutants.region_mutants(toy, cap=8)], "deterministic"


@pytest.mark.parametrize("name", sorted(ASSIGNMENTS))
def test_the_catalogue_of_every_assignment_applies(name):
    regions = mutants.graded_regions(ASSIGNMENTS[name])
    ms = mutants.catalogue(name)
    assert ms and {m.task for m in ms} <= {r.task for r in regions}
    assert len(mutants.plan(ms, regions)) == len(ms)
    assert all(len(m.name) < 140 for m in ms)


# -- hand-written mutants -----------------------------------------------------------------------------------

def test_hand_mutants_are_checked(toy):
    bad = [(Mutant("no task", "nope", "x"), "no graded region of task 'nope'; the tasks: t"),
           (Mutant("not there", "t", "y", "z = 3"), r"old text 'z = 3' is in the region of task 't' not at all"),
           (Mutant("twice", "t", "y", "x."), "is in the region of task 't' 3 times"),
           (Mutant("broken", "t", "s = (", "s = x.sum(dim=-1)"), "does not compile")]
    for m, message in bad:
        with pytest.raises(SystemExit, match=rf"^error: my\.py: mutant '{m.name}': .*{re.escape(message[-30:])}"):
            mutants.plan([m], [toy], "my.py: ")
    ok = mutants.plan([Mutant("sum for mean", "t", "x.mean(1, keepdim=False)", "x.mean(1, keepdim=True)"),
                       Mutant("whole body", "t", "return 0")], [toy])
    assert "    w = x.mean(1, keepdim=False)\n" in ok[0].text
    assert "    # BEGIN SOLUTION [toy:t] anything\n    return 0\n    # END SOLUTION\n" in ok[1].text


def test_a_multi_line_old_may_be_written_flush_or_as_in_the_file(toy):
    flush = Mutant("flush", "t", "s = x.sum()\nm = x.amax()", "s = x.sum(dim=-1)\nm = x.max(dim=1).values")
    as_file = Mutant("as in the file", "t", "s = x.sum()\n    m = x.amax()",
                     "s = x.sum(dim=-1)\n    m = x.max(dim=1).values")
    new_as_file = Mutant("one line old, new as in the file", "t", "x.sum()\n    m = x.amax()", "x.sum(dim=-1)")
    for p in mutants.plan([flush, as_file, new_as_file], [toy]):
        assert "\n    s = x.sum()\n    m = x.amax()\n" in p.text


def test_hand_reads_the_assignments_file(tmp_path):
    path = tmp_path / "mutants.py"
    path.write_text("from course.mutants import Mutant\nMUTANTS = [Mutant('m', 'nope', 'x')]\n")
    with pytest.raises(SystemExit, match=r"^error: mutants.py: mutant 'm': no graded region of task 'nope'"):
        mutants.hand("cache", path)
    path.write_text("from course.mutants import Mutant\n"
                    "MUTANTS = [Mutant('m', 'mask', 'x'), Mutant('m', 'mask', 'y')]\n")
    with pytest.raises(SystemExit, match="two mutants are named 'm'"):
        mutants.hand("cache", path)
    path.write_text("import no_such_module\n")
    with pytest.raises(SystemExit, match="cannot import it: ModuleNotFoundError"):
        mutants.hand("cache", path)
    assert mutants.hand("cache", tmp_path / "absent.py") == []


@pytest.mark.parametrize("name", sorted(ASSIGNMENTS))
def test_every_assignments_hand_mutants_are_valid(name):
    for m in mutants.hand(name):                     # raises, naming the mutant, if one does not apply
        assert m.name and m.task in {r.task for r in mutants.graded_regions(ASSIGNMENTS[name])}


def test_a_catalogue_mutant_that_repeats_a_hand_one_is_left_out(toy, monkeypatch):
    mine = [Mutant("mean", "t", "s = x.mean(dim=-1)", "s = x.sum(dim=-1)"),
            Mutant("mean again", "t", "x.mean(dim=-1)", "x.sum(dim=-1)")]      # the same: both hand, both kept
    monkeypatch.setattr(mutants, "graded_regions", lambda assignment: [toy])
    monkeypatch.setattr(mutants, "hand", lambda name: mine)
    theirs = mutants.region_mutants(toy, cap=1000)
    planned = mutants.mutants_of("cache", cap=1000)
    assert [p.mutant for p in planned[:2]] == mine and len(planned) == 2 + len(theirs) - 1
    assert not [p for p in planned[2:] if "s = x.mean(dim=-1)" in lines_of(p.mutant)]
    assert len(mutants.mutants_of("cache", only="hand")) == 2
    assert len(mutants.mutants_of("cache", only="catalogue", cap=1000)) == len(theirs)


def test_acceptable_matches_a_catalogue_name_without_its_line():
    table = {"compare at methods/h2o.py:40: a < b -> a <= b": "why", "the hand one": "because"}
    assert mutants.why_acceptable("compare at methods/h2o.py:52: a < b -> a <= b", table) == "why"
    assert mutants.why_acceptable("the hand one", table) == "because"
    assert mutants.why_acceptable("compare at methods/h2o.py:52: a < b -> a > b", table) is None


# -- the kill rule and the run, with a fake grader ----------------------------------------------------------

def test_the_kill_rule():
    assert mutants.is_killed(2, 4) and mutants.is_killed(0, 4) and mutants.is_killed(1.5, 3)
    assert not mutants.is_killed(2.5, 4) and not mutants.is_killed(4, 4) and not mutants.is_killed(0, 0)


TESTS = {"test_a": 2.0, "test_b": 1.0, "test_c": 1.0}      # task t: 4 points


@pytest.fixture
def fake(toy, tmp_path, monkeypatch):
    """A run on the toy region with a fake grader: test_a fails where the region has `amax`, test_b where it
    has `mean(dim=-1)`; it records the text of the region each grading saw."""
    seen = []

    def fake_grade(name, student, tasks=None, per_test_s=None, **kw):
        text = (student / "toy.py").read_text()
        seen.append(text)
        fails = {"test_a": "amax" in text, "test_b": "mean(dim=-1)" in text, "test_c": "REFERENCE_FAILS" in text}
        results = [{"name": n, "task": "t", "score": 0.0 if fails[n] else p, "max_score": p,
                    "status": "failed" if fails[n] else "passed", "output": ""} for n, p in TESTS.items()]
        return {"results": [r for r in results if tasks is None or r["task"] in tasks]}

    def fake_copy(out: Path) -> Path:
        out.mkdir(parents=True)
        (out / "toy.py").write_text(toy.path.read_text())
        return out

    monkeypatch.setattr(grade, "grade", fake_grade)
    monkeypatch.setattr(grade, "task_names", lambda assignment, hidden=True: ["t"])
    monkeypatch.setattr(mutants, "copy_repository", fake_copy)
    return seen


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_mutant_is_killed_when_its_task_loses_half_its_points(toy, fake, jobs):
    ms = [Mutant("max", "t", "s = x.amax(dim=-1)", "s = x.sum(dim=-1)"),          # test_a: 2 of 4 lost
          Mutant("mean", "t", "s = x.mean(dim=-1)", "s = x.sum(dim=-1)"),          # test_b: 1 of 4 lost
          Mutant("other", "u", "x")]
    planned = mutants.plan(ms[:2], [toy]) + [mutants.Planned(ms[2], "toy.py", TOY, "u")]
    report = mutants.run_mutants("cache", planned, jobs=jobs, progress=False)
    by_name = {o.mutant.name: o for o in report.outcomes}
    assert by_name["max"].killed and by_name["max"].kept == 2 and by_name["max"].max_score == 4
    assert not by_name["mean"].killed and by_name["mean"].passing == ["test_a", "test_c"]
    assert not by_name["other"].killed and report.untested == ["u"]
    assert report.killed == 1 and not report.reference_failures
    assert fake[0] == TOY, "the unchanged copy is graded first"
    assert sorted(t.count("amax") + 2 * t.count("mean(dim=-1)") for t in fake[1:]) == [1, 2], "one mutant each"
    text = mutants.render(report)
    assert "3 mutants (3 hand, 0 catalogue), 1 killed (33.3%)" in text and "below the 90%" in text
    assert "[t] mean  (hand; kept 3 / 4)\n       passed: test_a, test_c\n       not listed in ACCEPTABLE" in text
    assert "task u: no test grades it" in text
    assert mutants.summary([report, report]) == "2 assignments, 6 mutants, 2 killed (33.3%)"


def test_a_reference_that_fails_grades_no_mutant(toy, fake, tmp_path):
    (tmp_path / "toy.py").write_text(TOY.replace("import torch", "import torch  # REFERENCE_FAILS"))
    region = find_regions(tmp_path / "toy.py")[0]
    report = mutants.run_mutants("cache", mutants.plan([Mutant("m", "t", "s = 1", "s = x.sum(dim=-1)")], [region]),
                                 progress=False)
    assert report.reference_failures and not report.outcomes and len(fake) == 1
    assert "the reference fails test_c" in mutants.render(report)


# -- the command line ---------------------------------------------------------------------------------------

def test_command_line_errors(tmp_path, capsys):
    assert "no assignment 'nope'" in refused(capsys, mutants.main, ["nope"])
    assert "--only must be hand or catalogue" in refused(capsys, mutants.main, ["cache", "--only", "both"])
    assert "--jobs must be a whole number" in refused(capsys, mutants.main, ["cache", "--jobs", "0"])
    assert "--per-test-s must be a positive, finite" in refused(capsys, mutants.main, ["cache", "--per-test-s", "nan"])
    assert "below 0.5 s, the shortest limit" in refused(capsys, mutants.main, ["cache", "--per-test-s", "5e-324"])
    assert "--task needs one assignment" in refused(capsys, mutants.main, ["all", "--task", "mask"])
    assert "no task 'nope' in 'cache'; its tasks: append" in refused(capsys, mutants.main, ["cache", "--task", "nope"])
    (tmp_path / "report.txt").write_text("")
    assert "exists; name a new file or add --force" in refused(capsys, mutants.main,
                                                               ["cache", "--out", str(tmp_path / "report.txt")])
    assert "does not exist" in refused(capsys, mutants.main, ["cache", "--out", str(tmp_path / "no" / "report.txt")])
    assert "is a folder" in refused(capsys, mutants.main, ["cache", "--out", str(tmp_path)])


# -- for real (slow) ----------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.heavy                       # a mutants run: with --runheavy
def test_real_grading_kills_an_empty_region_and_spares_the_reference(tmp_path):
    """Two mutants of cache's mask graded for real, in parallel: the reference written back (it keeps every
    point: nothing to kill) and a region that raises (it loses them all). The repository is not touched."""
    region = next(r for r in mutants.graded_regions(ASSIGNMENTS["cache"]) if r.task == "mask")
    before = region.path.read_bytes()
    body = mutants.dedent(region.body(before.decode().splitlines()))[1]
    planned = mutants.plan([Mutant("the reference", "mask", body), Mutant("nothing", "mask", "raise ValueError")],
                           [region])
    report = mutants.run_mutants("cache", planned, jobs=2, progress=False)
    same, nothing = report.outcomes
    assert not report.reference_failures
    assert same.kept == same.max_score > 0 and not same.killed and same.passing
    assert nothing.kept == 0 and nothing.killed and not nothing.passing
    assert region.path.read_bytes() == before


@pytest.mark.slow
@pytest.mark.heavy
def test_the_command_grades_one_tasks_hand_mutants(tmp_path, capsys):
    name, task = "cache", "group_scores"          # few mutants, quick tests
    n = sum(m.task == task for m in mutants.hand(name))
    if not n:
        pytest.skip(f"course/{name}/mutants.py has no mutant of {task}")
    out = tmp_path / "report.txt"
    assert mutants.main([name, "--task", task, "--only", "hand", "--quiet", "--out", str(out)]) == 0
    text = out.read_text()
    assert re.search(rf"^== {name}: {n} mutants \({n} hand, 0 catalogue\), (\d+) killed ", text), text
    assert re.search(rf"\n\n1 assignments, {n} mutants, \d+ killed \(\d+\.\d%\)\n$", text), text
    assert "the reference fails" not in text and capsys.readouterr().out.startswith(text)
