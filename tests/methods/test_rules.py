"""The decode rules the methods declare (``methods/rules.py``): each in-place method says which rule and with
what numbers, a class that changes the method's hooks says why it has none, and the fast paths and the
batched evaluation take the rule from that declaration, not from the policy's type."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from experiments.evaluation import row_hooks
from fastpath.graph import eviction_rule
from methods import make_policy
from methods.h2o import H2OPolicy, evict_lowest
from methods.rules import DecodeRule
from methods.streaming_llm import evict_oldest


def test_each_in_place_method_declares_its_rule():
    assert make_policy("h2o", 16).decode_rule() == DecodeRule("heavy", 16, n_recent=8)
    assert make_policy("streaming_llm", 3, n_sink=4).decode_rule() == DecodeRule("sinks", 3, n_sink=2)
    assert make_policy("scissorhands", 16, history_window=5).decode_rule() == \
        DecodeRule("scissors", 16, n_recent=10, window=5)
    assert "m > 1" in make_policy("scissorhands", 16, drop=3).decode_rule()


@dataclass
class LouderH2O(H2OPolicy):
    def observe(self, ctx):                              # another rule than the one H2O declares
        super().observe(ctx)


def test_a_class_that_changes_the_hooks_declares_none_and_the_paths_fall_back():
    policy = LouderH2O(16)
    assert isinstance(policy.decode_rule(), str) and isinstance(eviction_rule(policy), str)
    assert row_hooks.declared(policy) is None


def test_the_fast_path_reads_the_declaration(monkeypatch):
    """A check of the wiring: the graph step's rule is what ``decode_rule`` says, whatever the class."""
    monkeypatch.setattr(H2OPolicy, "decode_rule", lambda self: DecodeRule("sinks", self.budget, n_sink=1))
    assert eviction_rule(make_policy("h2o", 16)) == DecodeRule("sinks", 16, n_sink=1)
    assert eviction_rule(make_policy("adakv(h2o)", 16)) != DecodeRule("sinks", 16, n_sink=1)   # a wrapper's own


def test_the_rules_over_fixed_slots():
    pos = torch.tensor([[[0, 1, 5, -1, 3, 4]]])                                 # one empty slot
    score = torch.tensor([[[9.0, 0.5, 0.1, 0.0, 0.5, 2.0]]])
    assert evict_lowest(score, pos, 5).flatten().tolist() == [4]                # tie 0.5: the later position
    assert evict_lowest(score.index_fill(2, torch.tensor([0]), float("nan")), pos, 5).flatten().tolist() == [0]
    assert evict_oldest(pos, 1).flatten().tolist() == [1]                       # the sink 0 and the empty stay
    assert evict_oldest(pos, 2, n=2).flatten().tolist() == [4, 5]               # positions 3, 4
