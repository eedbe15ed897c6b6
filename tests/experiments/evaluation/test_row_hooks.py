"""``row_hooks``: a method's caches side by side in a group, their decode hook run once over their rows, give
every cache the numbers its own hook gives, bit for bit: ``experiments.compare``'s records with the rows stepped
at once equal those with every cache stepping alone, in every field but the times."""

from __future__ import annotations

import pytest
import torch

from experiments.evaluation import compare, row_hooks
from experiments.evaluation.engines import make_engine
from experiments.evaluation.protocol import Probe
from methods import make_policy
from nanollm.data.evaluate import MODES

TIMES = {"compress_ms", "decode_ms_per_token"}


def records(bundled, engine: str) -> list[dict]:
    model, tok, _ = bundled
    return compare.run(model, tok, compare.RunSpec(["h2o", "scissorhands", "snapkv"], [40, 56, 72],
                                                   ["niah_single_noise"], MODES, 1, 256, engine=engine, progress=False))


@pytest.mark.parametrize("engine", ["one-group", "batched"])
def test_rows_stepped_at_once_give_every_record_bit_for_bit(bundled, monkeypatch, engine):
    runs = []
    evict_rows = row_hooks.evict_rows

    def counted(policies, *args):
        runs.append(tuple(type(p).__name__ for p in policies))
        return evict_rows(policies, *args)
    monkeypatch.setattr(row_hooks, "evict_rows", counted)
    together = records(bundled, engine)
    assert all(len(set(run)) == 1 for run in runs)                 # one method a run
    if engine == "one-group":                     # H2O's three caches and Scissorhands' three, at once
        assert {("H2OPolicy",) * 3, ("ScissorhandsPolicy",) * 3} <= set(runs)
    monkeypatch.setattr(row_hooks, "ENABLED", False)
    runs.clear()
    alone = records(bundled, engine)
    assert runs == []
    assert len(together) == len(alone) == 2 * (1 + 3 * 3)
    for a, b in zip(together, alone):
        assert {k: v for k, v in a.items() if k not in TIMES} == {k: v for k, v in b.items() if k not in TIMES}


@pytest.mark.parametrize("probe, uneven, odd", [(True, False, None), (False, True, None), (True, False, "every"),
                                                (True, False, "one"), (False, False, "narrowed")],
                         ids=["in probes", "bare, uneven", "other windows, a state set again",
                              "other windows, one layer's state set again", "a cache ends"])
def test_the_storage_after_each_step_is_the_one_each_hook_leaves(bundled, monkeypatch, probe, uneven, odd):
    """What the records cannot see: every cache's storage (positions, emptied slots, per-slot state) and
    logits after each step, with the rows at once and alone; the policies in probes (teacher forcing), or
    bare (greedy) with the first of each method a token ahead (its seen differs: its rows still go at once,
    Scissorhands' flags each into its row's own column of the ring buffer); or two Scissorhands caches of
    another ring buffer than
    the first's (their state does not fit the group's buffer: they hook alone), and an H2O cache whose state
    is set again between steps (a tensor of its own: alone too), at every layer (the other two still take
    every layer at once) or at one (the others then take a hook per layer: ``catch_up``'s fallback); or, after
    two steps, the first H2O cache no longer stepped (the group narrowed: the other two go on at once)."""
    model, _, _ = bundled
    prompt = torch.randint(0, model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    calls, evict_rows = [], row_hooks.evict_rows           # (caches, layers) of each hook over rows at once
    monkeypatch.setattr(row_hooks, "evict_rows", lambda policies, kv, *args: calls.append(
        (len(policies), len(kv.pos) // len(policies))) or evict_rows(policies, kv, *args))

    def stepped(enabled: bool) -> list:
        monkeypatch.setattr(row_hooks, "ENABLED", enabled)
        engine = make_engine("one-group", model)
        policies = [make_policy(m, budget=b) for m in ("h2o", "scissorhands") for b in (40, 56, 72)]
        if odd in ("every", "one"):
            policies[4:] = [make_policy("scissorhands", budget=b, history_window=16) for b in (40, 56)]
        caches, _ = engine.fill([Probe(p) if probe else p for p in policies], [prompt.tolist()])
        if uneven:                                  # the first H2O and Scissorhands caches a token ahead
            engine.step([caches[0], caches[3]], [7, 7])
        seen = []
        for n, t in enumerate(prompt[:5].tolist()):
            if odd == "narrowed" and n == 2:
                caches = caches[1:]
            logits, _, _ = engine.step(caches, [t] * len(caches))
            for store in caches[0].layers[:None if odd == "every" else 1] if odd in ("every", "one") and t % 2 else ():
                store.set_state("h2o_score", store.state["h2o_score"].clone(), fill=0.0)            # scores set again
            seen.append([logits] + [(s.pos.clone(), None if s.free is None else s.free.clone(),
                                     {k: v.clone() for k, v in s.state.items()}) for c in caches for s in c.layers])
        return seen

    together = stepped(True)
    L = model.config.n_layer
    if odd == "every":                              # H2O's three or, after a state set again, two; no Scissorhands
        assert (2, L) in calls and set(calls) <= {(3, L), (2, L)} and len(calls) == 5
    elif odd == "narrowed":                         # H2O's three, then two; Scissorhands' three
        assert calls == [(3, L)] * 2 * 2 + [(2, L), (3, L)] * 3
    elif odd == "one":                              # after it, layer 0's two and the other layers' three, each alone
        assert {(2, 1), (3, 1)} <= set(calls) <= {(3, L), (2, 1), (3, 1)}
    else:                                           # each step: each method's three caches at every layer at once
        assert calls == [(3, L)] * 2 * 5
    for a, b in zip(together, stepped(False)):
        assert torch.equal(a[0], b[0])
        for (pos_a, free_a, state_a), (pos_b, free_b, state_b) in zip(a[1:], b[1:]):
            assert torch.equal(pos_a, pos_b) and (free_a is None) == (free_b is None)
            assert free_a is None or torch.equal(free_a, free_b)
            assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_a_state_set_again_is_reset_where_the_next_token_goes(bundled):
    """A state a policy sets again between steps is a tensor of its own, no longer its row of the group's
    buffer (``Group.holds``): the step's write still resets it at the emptied slot the new token takes."""
    model, _, _ = bundled
    prompt = torch.randint(0, model.config.vocab_size, (120,), generator=torch.Generator().manual_seed(1))
    engine = make_engine("one-group", model)
    caches, _ = engine.fill([make_policy("h2o", budget=b) for b in (40, 56)], [prompt.tolist()])
    engine.step(caches, [5, 5])                                     # each drops a slot per head: free
    store = caches[0].layers[0]
    slot = store.free[0, :, 0]                                      # (H_kv,) where the next token goes
    store.set_state("h2o_score", torch.full_like(store.state["h2o_score"], 5.0), fill=0.0)
    engine.step(caches, [6, 6])
    scores = store.state["h2o_score"][0]                            # (H_kv, T)
    new = scores[torch.arange(len(slot)), slot]
    assert (new < 5).all(), "the new token's score starts at the fill value, not at the old one"
    assert (scores >= 5).sum() == scores.numel() - len(slot)        # every other slot kept what was set
