"""
fastpath: the same decoder's decode step, faster, plugged in from above; the reading path (``nanollm/``) never
imports it.

Four steps, each taking away a cost the one before leaves: ``lean.py`` (stacked weights, fewer operations),
``graph.py`` (fixed-capacity buffers, the step captured in a CUDA graph), ``fused.py`` (its element-wise work
compiled) and ``skinny.py`` (its products in Triton kernels for a few rows). Beside them: ``attention.py`` (a
decode step's attention), ``reviver.py`` and ``sketch.py`` (KVReviver's fast paths), ``tensor.py`` (tensor
attention's kernel), ``tune.py`` (kernel launches timed), ``e2e.py``, ``bench.py`` and ``profile.py`` (timing
and profiling), ``gpu_check.sh`` (what a GPU must show).

Each computes what the reading path computes: ``tests/fastpath/`` compares them (bit for bit on a CPU where the
arithmetic is the same, at float tolerance where kernels or stacked products sum in another order).
What they measured: fastpath/README.md. How each file works: fastpath/inside.md.
"""

import nanollm.interrupt  # noqa: F401  (first: Ctrl-C while a command starts is one line, nanollm/interrupt.py)
