"""
A policy class of one's own, named ``MODULE:CLASS``, is a method spec wherever a registered name is one:
``make_policy``, inside a wrapper, and ``experiments.compare --methods`` (in its worker processes too), so a
researcher tries a method without editing ``methods/__init__.py``. A name that does not import, or imports
something other than a policy dataclass, is one line naming it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.evaluation import compare
from experiments.evaluation.report import format_intervals, shown
from methods import AdaKVPolicy, make_policy, method_chain, method_options
from nanollm import KVCache, prefill
from nanollm.config import preset
from tests.methods.knorm import KnormPolicy

ROOT = Path(__file__).resolve().parents[2]
SPEC = "tests.methods.knorm:KnormPolicy"
EXAMPLE = ROOT / "experiments" / "evaluation" / "examples" / "niah_single_noise.jsonl"


@pytest.fixture
def tiny(make_model):
    return make_model(preset("TINY"), seed=0)


def test_a_class_of_ones_own_is_a_method_spec(tiny):
    assert make_policy(SPEC, 8) == KnormPolicy(budget=8)
    assert make_policy(f"adakv({SPEC})", 8, alpha_safeguard=0.5) == \
        AdaKVPolicy(budget=8, alpha_safeguard=0.5, inner=KnormPolicy(budget=8))
    assert method_chain(f"chunkkv({SPEC})") == ["chunkkv", SPEC]
    assert method_options(f"adakv({SPEC})") == ["alpha_safeguard"]
    ids = torch.randint(tiny.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    caches = [KVCache(tiny.config, policy) for policy in (make_policy(SPEC, 8), KnormPolicy(budget=8))]
    for cache in caches:
        prefill(tiny, ids, cache)
    assert all(torch.equal(a.pos, b.pos) for a, b in zip(*[c.layers for c in caches]))


class WrongShape(KnormPolicy):
    """A score with a trailing axis of 1 (B, H_kv, T, 1): one number per slot, in the wrong shape."""

    def score(self, ctx):
        return super().score(ctx)[..., None]


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_score_of_the_wrong_shape_is_one_line(tiny, wrapped):
    policy = WrongShape(budget=8)
    if wrapped:
        policy = AdaKVPolicy(budget=8, inner=policy)
    ids = torch.randint(tiny.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"WrongShape.score returned \(1, 2, 30, 1\): it must give one number "
                       r"per slot, \(B, H_kv, T\) = \(1, 2, 30\)") as e:
        prefill(tiny, ids, KVCache(tiny.config, policy))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:Policy", "cannot import 'Policy' from module 'no_such_module_xyz'"),
    ("tests.methods.knorm:Nope", "cannot import 'Nope' from module 'tests.methods.knorm'"),
    ("tests.methods.knorm:check_budget", "check_budget is not a policy dataclass with a budget field"),
    (".knorm:KnormPolicy", "cannot import 'KnormPolicy' from module '.knorm' (TypeError"),
    ("no_such_method", "or name a policy class of your own as MODULE:CLASS"),
    (f"{SPEC}(h2o)", "is not a wrapper"),
])
def test_a_name_that_is_no_policy_is_one_line(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
        make_policy(spec, 8)
    assert "\n" not in str(e.value)


def test_a_wrapper_of_ones_own_and_a_module_in_the_current_folder(tmp_path, monkeypatch):
    """A wrapper is a policy class too (it takes its default inner scorer when named alone), and a module is
    found in the folder the command runs in, as a metric of one's own is; a module that does not compile, or a
    class without a budget, is one line."""
    assert method_chain("methods.adakv:AdaKVPolicy") == ["methods.adakv:AdaKVPolicy", "snapkv"]
    assert make_policy("methods.adakv:AdaKVPolicy(h2o)", 8) == make_policy("adakv(h2o)", 8)
    (tmp_path / "own_mine.py").write_text("from tests.methods.knorm import KnormPolicy as Mine\n")
    (tmp_path / "own_broken.py").write_text("def oops(:\n")
    (tmp_path / "own_nobudget.py").write_text("from dataclasses import dataclass\n"
                                              "from nanollm.policy import CachePolicy\n\n"
                                              "@dataclass\nclass NoBudget(CachePolicy):\n    pass\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    for name in ("own_mine", "own_broken", "own_nobudget"):          # names no other test's module has
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert make_policy("own_mine:Mine", 8) == KnormPolicy(budget=8)
    for spec, message in [("own_broken:Mine", "(SyntaxError"), ("own_nobudget:NoBudget", "with a budget field")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
            make_policy(spec, 8)
        assert "\n" not in str(e.value)


def test_compare_runs_a_class_of_ones_own_in_process(tmp_path, capsys):
    """The records name the class as written; the report shows it by its class name, with a line saying what that
    name stands for, so the tables keep the registered names' width."""
    out = tmp_path / "run.json"
    compare.main(["--task-file", str(EXAMPLE), "--samples", "1", "--methods", SPEC, f"adakv({SPEC})",
                  "--keep-ratios", "0.25", "--length", "512", "--workers", "1", "--json", str(out)])
    assert {r["method"] for r in json.loads(out.read_text())["records"]} == {"full", SPEC, f"adakv({SPEC})"}
    printed = capsys.readouterr().out
    assert f"KnormPolicy = {SPEC}\n" in printed
    assert "\nadakv(KnormPolicy) " in printed and "\nKnormPolicy " in printed
    report = [line for line in printed.splitlines() if not line.startswith(("# ", "KnormPolicy = "))]
    assert not [line for line in report if SPEC in line]                # the provenance header keeps the command


def test_two_classes_of_one_name_or_a_class_named_as_a_method_keep_their_full_names():
    named, lines = shown([{"method": "adakv(a.b:Knorm)"}, {"method": "c.d:Knorm"}, {"method": "x.y:Other"},
                          {"method": "h2o"}])
    assert [r["method"] for r in named] == ["adakv(a.b:Knorm)", "c.d:Knorm", "Other", "h2o"]
    assert lines == ["Other = x.y:Other"]
    assert shown([{"method": "h2o"}]) == ([{"method": "h2o"}], [])
    for clash in ("a.b:h2o", "a.b:full", "a.b:H2O"):                    # named as a registered method, any case
        named, lines = shown([{"method": clash}, {"method": "h2o"}])
        assert [r["method"] for r in named] == [clash, "h2o"] and lines == []


def test_a_shorter_name_breaks_ties_as_the_name_written_does():
    """Equal answers: the best is the last name in alphabetical order as the records write it, whatever the
    report shows ("z.mod:Alpha" after "beta", although "Alpha" sorts before it)."""
    rows = [{"method": m, "mode": "question_in_prompt", "task": "t", "keep_ratio": 0.5, "accuracy": 0.5,
             "accuracies": [1.0, 0.0], "n_samples": 2} for m in ("beta", "z.mod:Alpha")]
    named, _ = shown(rows)
    best = [line for line in format_intervals(named).splitlines() if line.startswith("keep")]
    assert best[0].startswith("keep 0.50: best Alpha "), best


@pytest.mark.slow
def test_compare_s_worker_processes_import_the_class_too(tmp_path):
    """Workers are fresh interpreters (spawn): each imports the class from its name, as the parent did."""
    out = tmp_path / "run.json"
    subprocess.run([sys.executable, "-m", "experiments.compare", "--task-file", str(EXAMPLE), "--samples", "2",
                    "--methods", SPEC, f"adakv({SPEC})", "--keep-ratios", "0.25", "--length", "512",
                    "--workers", "2", "--quiet", "--json", str(out)], cwd=ROOT, check=True, capture_output=True)
    records = json.loads(out.read_text())["records"]
    assert {r["method"] for r in records} == {"full", SPEC, f"adakv({SPEC})"} and len(records) == 6   # 3 x 2 modes
