"""
The experiments: what runs the methods and measures them, above everything it measures.

``evaluation/`` scores every method against the full cache (the main job, ``python -m experiments.compare``),
``analysis/`` holds the studies of single methods, and ``bench.py`` times a decode step with and without a
cache. They stand on ``nanollm``, ``methods``, ``kernels`` and ``fastpath``; none of those imports them.
"""

import nanollm.interrupt  # noqa: F401  (first: Ctrl-C while a command starts is one line, nanollm/interrupt.py)
