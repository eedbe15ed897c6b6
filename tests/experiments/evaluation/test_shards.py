"""
``torchrun`` over ``experiments.compare``: two CPU processes split the samples, and rank 0 writes the records
of a one-process run (timings aside).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from experiments.evaluation import shards
from experiments.evaluation.compare import launcher

TIMINGS = {"decode_ms_per_token", "compress_ms"}


def test_each_job_goes_to_one_rank_and_comes_back_in_order():
    jobs = list(range(11))
    parts = [shards.share(jobs, r, 3) for r in range(3)]
    assert sorted(sum(parts, [])) == jobs and parts[1] == [1, 4, 7, 10]
    assert shards.gather(jobs, 11, 0, 1) == jobs                      # one process: nothing to gather
    assert launcher(1, "python -m experiments.compare") == "python -m experiments.compare"


def test_rank_0_puts_every_rank_s_results_back_in_job_order(monkeypatch):
    """gather on rank 0 of 3, with what the other ranks would send: job j comes from rank j % 3."""
    jobs = [f"job {j}" for j in range(8)]

    def fake_gather(mine, every, dst):
        if every is not None:                                         # rank 0 receives
            every[:] = [mine] + [shards.share(jobs, r, 3) for r in (1, 2)]
    monkeypatch.setattr(shards.dist, "gather_object", fake_gather)
    assert shards.gather(shards.share(jobs, 0, 3), len(jobs), 0, 3) == jobs
    assert shards.gather([], len(jobs), 1, 3) is None                 # the other ranks get nothing back


@pytest.mark.slow
def test_torchrun_with_two_processes_writes_the_one_process_records(tmp_path):
    args = ["-m", "experiments.compare", "--methods", "full", "snapkv", "h2o", "--keep-ratios", "0.25",
            "--tasks", "niah_single_noise", "niah_multikey", "--samples", "3", "--length", "256", "--quiet",
            "--modes", "question_in_prompt"]              # one mode: a cell's samples come from both ranks
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    subprocess.run([sys.executable, *args, "--workers", "1", "--json", str(one)], check=True, capture_output=True)
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          *args, "--json", str(two)], check=True, capture_output=True, text=True)
    assert ran.stdout.count("# command: torchrun --nproc-per-node 2 -m experiments.compare") == 1   # rank 0 alone
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert len(a["records"]) == 2 * 3                                 # (full + 2 methods) x 2 tasks
    strip = lambda recs: [{k: v for k, v in r.items() if k not in TIMINGS} for r in recs]   # noqa: E731
    assert strip(a["records"]) == strip(b["records"])
    assert a["pairwise"] == b["pairwise"]
    assert b["provenance"]["command"].startswith("torchrun --nproc-per-node 2 -m experiments.compare")
