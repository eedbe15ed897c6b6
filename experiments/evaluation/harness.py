"""
The evaluation's protocol as the notebooks call it: a model and a sample in, traces and answers out.

    trs = traces(model, sample, mode, [None, make_policy("snapkv", 64)], [True, False])   # None: full cache
    answers = greedy_accuracies(model, tok, sample, trs)      # [(score, text)] per trace
    compare_traces(trs[0], trs[1], model.config.group_size)   # KL, perturbation, lost mass, bytes, times

The full cache's trace must record its probabilities (``True`` above) for ``compare_traces``. A sample of a
task file is scored by its file's rules: pass its task, ``task=FileTask(path)``, to ``traces`` and
``greedy_accuracies``.

Each is a line or two over the plain path (``task.py``, ``engine.py``, ``protocol.py``, ``metrics.py``),
with the fast engine unless ``engine="plain"``: the numbers of ``experiments.compare``'s records.
"""

from __future__ import annotations

from methods import make_policy
from nanollm.data.tasks import Sample
from nanollm.policy import CachePolicy

from .engines import make_engine
from .metrics import measure
from .protocol import Trace, continue_greedy, drive, teacher_force
from .task import TASKS, Task


def task_of(sample: Sample, task: Task | None = None) -> Task:
    """``task`` where given, else the sample's registered task; for a sample made by hand, the synthetic tasks'
    defaults (its chunks, reference, answer length and scorer read only the sample). A task file's sample
    needs its task given: its answer lengths and scorer are the file's."""
    if task is not None:
        return task
    if sample.task.startswith("file:") and sample.task not in TASKS:
        raise ValueError(f"a sample of {sample.task}: pass its task, task=FileTask(path), so that its answer "
                         "lengths and scorer are the file's")
    return TASKS.get(sample.task) or Task(sample.task)


def traces(model, sample: Sample, mode: str, policies: list[CachePolicy | None], record_probs: list[bool],
           engine: str = "fast", task: Task | None = None) -> list[Trace]:
    """``protocol.teacher_force`` of one sample for several policies (None: the full cache)."""
    full = [make_policy("full", budget=None) if p is None else p for p in policies]
    engine = make_engine(engine, model)
    return drive(engine, teacher_force(engine, task_of(sample, task), sample, mode, full, record_probs))


def trace(model, sample: Sample, mode: str, policy: CachePolicy | None = None, record_probs: bool = False,
          engine: str = "fast", task: Task | None = None) -> Trace:
    return traces(model, sample, mode, [policy], [record_probs], engine, task)[0]


def greedy_from_traces(model, tok, sample: Sample, trs: list[Trace], task: Task | None = None) -> list[list[int]]:
    """Each trace's greedy answer ids, up to the end-of-text token (``protocol.continue_greedy``)."""
    return drive(trs[0].engine if trs else None, continue_greedy(task_of(sample, task), sample, trs, tok))


def greedy_accuracies(model, tok, sample: Sample, trs: list[Trace], task: Task | None = None
                      ) -> list[tuple[float, str]]:
    """The task's score of each trace's greedy answer, and the answer."""
    greedy_from_traces(model, tok, sample, trs, task)
    return [(task_of(sample, task).score(tr.prediction, sample), tr.prediction) for tr in trs]


def greedy_accuracy(model, tok, sample: Sample, tr: Trace, task: Task | None = None) -> tuple[float, str]:
    return greedy_accuracies(model, tok, sample, [tr], task)[0]


def compare_traces(full: Trace, method: Trace, group_size: int | None = None) -> dict:
    """The metrics of a method's trace against the full cache's that need no greedy answer (``group_size``,
    query heads per KV head, is read from the traces' shapes; the argument is accepted and unused). The full
    cache's trace must hold its probabilities (``record_probs`` True for it)."""
    if not full.probs:
        raise ValueError("compare_traces needs the full cache's probabilities: trace it with record_probs True")
    return measure(full, method)
