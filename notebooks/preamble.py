"""
What every lesson and lab does before its first idea, kept here so that the notebook's first cell is short::

    from preamble import TINY          # the repository importable; TINY: the quick check CI runs

(A lab imports ``notebooks/labs/preamble.py``, which runs this file.)

* The repository's packages (``nanollm``, ``methods``, ``kernels``) become importable when Jupyter runs the
  notebook from ``notebooks/`` or ``notebooks/labs/`` without the package installed.
* ``TINY`` is True when ``NANOLLM_TINY=1``: the notebook then uses smaller prompts, models and sample counts,
  a check that it runs (CI does this). Its prose describes the committed normal run, so it says which run this
  is.
* torch uses one thread and a fixed seed, so two runs of a notebook print the same numbers; where a cell asks
  for more threads, idle ones sleep rather than spin (``OMP_WAIT_POLICY=PASSIVE``).
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # the repository: notebooks/..
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)                           # the packages importable without an install

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads: idle threads sleep, not spin (a
#                                                      lesson that runs two threads stays fast on a busy machine)
import torch  # noqa: E402

from experiments.evaluation.viz import print_mode  # noqa: E402

TINY = os.environ.get("NANOLLM_TINY") == "1"
torch.set_num_threads(1)
torch.manual_seed(0)
print_mode(TINY)
