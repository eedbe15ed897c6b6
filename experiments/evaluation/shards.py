"""
One evaluation over several processes: ``torchrun`` splits the samples, rank 0 writes the results.

``experiments.compare``'s (task, sample, mode) jobs are independent, so N processes can each run a share and
send their results to one of them, which averages them in job order: the records are then the same as a
one-process run's, number for number (timings aside). ``torchrun`` starts the processes and tells each its
rank and the world size through environment variables; ``torch.distributed`` connects them (``gloo`` on
CPU, ``nccl`` with one GPU per process) and carries the results, as pickled Python objects, to rank 0.

    torchrun --nproc-per-node 4 -m experiments.compare ...                      # 4 processes on this machine
    torchrun --nnodes 2 --node-rank R --nproc-per-node 8 \\
        --master-addr HOST --master-port 29500 -m experiments.compare ...        # 2 machines of 8 GPUs each

Rank r takes jobs r, r + N, r + 2N, ... (the jobs go task by task, so every rank gets some of each task).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def launched() -> bool:
    """Whether this process was started by ``torchrun`` (or anything that sets its variables) with more than
    one process in all."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def start(device: str) -> tuple[int, int, str]:
    """Join the process group: (rank, world size, this process's device). On CUDA each process takes the
    GPU of its local rank on its machine; on CPU the processes talk through ``gloo``."""
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    # a rank that finishes its share early waits at the gather for the slowest: allow a long run
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=timedelta(hours=12))
    return dist.get_rank(), dist.get_world_size(), device


def share(jobs: list, rank: int, world: int) -> list:
    """The jobs rank ``rank`` of ``world`` runs: every world-th one, from the rank-th."""
    return jobs[rank::world]


def gather(mine: list, n_jobs: int, rank: int, world: int) -> list | None:
    """Every rank's results (``mine``: one per job of its ``share``), on rank 0 in job order; None on the
    other ranks."""
    if world == 1:
        return mine
    every = [None] * world if rank == 0 else None
    dist.gather_object(mine, every, dst=0)
    if rank != 0:
        return None
    return [every[j % world][j // world] for j in range(n_jobs)]


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
