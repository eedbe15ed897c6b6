"""
The main job: ``python -m experiments.compare`` runs every registered method beside the full cache on the
synthetic tasks and prints one table per mode (``--help`` lists the options).

This file is only the command's name; the evaluation is in ``experiments/evaluation/`` (``compare.py``: the jobs,
records, tables and plot; ``harness.py``: one sample through every cache).
"""

from experiments.evaluation.compare import main

if __name__ == "__main__":
    main()
