"""
The engines by name, for every command's ``--engine``: ``make_engine(name, model)``.

    plain     engine.PlainEngine: nanollm's reading path, one cache after another
    fast      side_by_side.FastEngine: one prompt pass for every cache, the products of a step shared
    batched   batched.BatchedEngine: the fast engine with the caches' attention batched too (for a GPU)
    one-group batched.OneGroupEngine: the batched engine with every cache in one group (fewer, larger
              operations, more bytes; H2O's and Scissorhands' caches hooked at once: an experiment for a GPU)
"""

from __future__ import annotations

from .batched import BatchedEngine, OneGroupEngine
from .engine import PlainEngine
from .side_by_side import FastEngine

ENGINES = {"plain": PlainEngine, "fast": FastEngine, "batched": BatchedEngine, "one-group": OneGroupEngine}


def make_engine(name: str, model, alone: bool = False):
    """The engine ``name`` for ``model``; a ValueError of one line for a model the fast engines do not take
    (the same rule for every command: no silent fallback). ``alone``: the fast engine steps the caches one
    at a time (see ``FastEngine``); the plain engine always does, the batched one refuses."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {sorted(ENGINES)}")
    if name == "plain":
        return PlainEngine(model)
    if issubclass(ENGINES[name], BatchedEngine) and alone:
        raise ValueError(f"--time-alone steps each cache on its own, the {name} engine steps them together: "
                         "use --engine fast")
    try:
        return ENGINES[name](model, alone=alone)
    except ValueError as e:
        raise ValueError(f"--engine {name}: {e}; --engine plain runs any model") from None
