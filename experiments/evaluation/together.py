"""
Several samples stepped side by side in one process: ``experiments.compare --together K``.

A job of the main job (``protocol.run_job``: one task, sample and mode, every cache) asks the engine for one
decode step at a time, and its phases are generators of those steps (``protocol.Steps``). ``run_together``
runs several jobs' generators at once: each round, every job still running asks for a step, and one
``engine.step`` takes all of them, the caches one job after another, each job sent its own rows back. A job
at a ``BARRIER`` (between teacher forcing and the greedy answers) waits until every job still running has
reached one, so that the jobs' new caches (greedy's forks) join the steps at the same round, where the
batched engines group them once rather than once per job.

On the fast engine a cache's numbers do not depend on the caches stepped beside it, so every record is the
one of its job run alone, bit for bit (timings aside, which are shared by more caches); on the batched
engines, to float rounding. What it saves is operations, which a GPU launches one by one: the model's
products, and on the batched engines the writes, the attention and H2O's and Scissorhands' hooks, run once
for every job's caches (``python -m experiments.evaluation.launches --together K`` counts them per sample).
"""

from __future__ import annotations

import torch

from .protocol import BARRIER, Steps, Task, Variant, run_job


@torch.no_grad()
def run_together(engine, jobs: list[Steps]) -> list:
    """Drive several jobs' steps at once (see the module docstring); what each job returned, in order."""
    results, pending = [None] * len(jobs), {}

    def advance(n: int, sent) -> None:                  # job n's next request, or its result
        try:
            pending[n] = jobs[n].send(sent)
        except StopIteration as done:
            results[n] = done.value
            pending.pop(n, None)

    for n in range(len(jobs)):                          # each runs up to its first step (its prompt is filled)
        advance(n, None)
    while pending:
        order = [n for n in pending if pending[n] is not BARRIER]
        if not order:                                   # every job still running waits: they all go on
            for n in list(pending):
                advance(n, None)
            continue
        caches = [c for n in order for c in pending[n][0]]
        tokens = [t for n in order for t in pending[n][1]]
        logits, hidden, seconds = engine.step(caches, tokens)
        first = 0
        for n in order:
            rows = slice(first, first + len(pending[n][0]))
            first = rows.stop
            advance(n, (logits[rows], hidden[rows], seconds[rows]))
    return results


def run_jobs(engine, tok, variants: list[Variant], budgets: list[int], length: int, seed: int,
             jobs: list[tuple[str | Task, int, str]]) -> list[list[tuple[tuple, dict]]]:
    """``protocol.run_job`` of each of ``jobs``, their decode steps taken together; each job's result."""
    return run_together(engine, [run_job(engine, tok, variants, budgets, length, seed, job) for job in jobs])
