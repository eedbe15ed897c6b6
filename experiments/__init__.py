"""
The experiments: what runs the methods and measures them, above everything it measures.

``evaluation/`` scores every method against the full cache (the main job, ``python -m experiments.compare``),
``analysis/`` holds the studies of single methods, and ``bench.py`` times a decode step with and without a
cache. They stand on ``nanollm``, ``methods``, ``kernels`` and ``fastpath``; none of those imports them.
"""

import nanollm.interrupt  # noqa: F401  (first: Ctrl-C while a command starts is one line, nanollm/interrupt.py)

# Where the experiments' modules were before they moved here: a results file keeps the command as it ran,
# ``python -m methods.compare ...`` for one written before, and is read (rescored, re-run) under the new name.
MOVED = {"methods.compare": "experiments.compare", "methods.evaluation": "experiments.evaluation",
         "methods.analysis": "experiments.analysis", "nanollm.cli.bench": "experiments.bench",
         "nanollm.cli.speed": "experiments.speed",
         "methods.tensor_attention.bench": "experiments.tensor_attention_bench"}


def moved(module: str) -> str:
    """A ``python -m`` module's name now (``methods.evaluation.agree`` -> ``experiments.evaluation.agree``)."""
    for old, new in MOVED.items():
        if module == old or module.startswith(old + "."):
            return new + module[len(old):]
    return module
