"""
The main job's worker processes: each runs batches of (task, sample, mode) jobs on its engine, and on a GPU
gives back what it no longer holds; how many a run takes, and what to say when their memory runs out.

The processes are fresh interpreters ("spawn"), one torch thread each; the model travels to them once, in
a temporary file (``in_workers``). Their results come back in job order, so the records are those of one
process, number for number but the timings (``compare.py``'s module docstring).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import tempfile
from pathlib import Path

import torch

from nanollm import cli

from .engines import make_engine
from .protocol import Variant
from .together import run_jobs

_ENGINE: dict = {}      # per process: the engine of the last model, built once (the fast one copies weights)


def engine_for(name: str, alone: bool = False, model=None):
    if _ENGINE.get("key") != (name, alone, id(model)):
        _ENGINE.update(key=(name, alone, id(model)), engine=make_engine(name, model, alone))
    return _ENGINE["engine"]


def some_jobs(model, tok, variants: list[Variant], budgets: list[int], length: int, seed: int,
              engine: tuple[str, bool], jobs: list[tuple[str, int, str]]) -> list[list[tuple[tuple, dict]]]:
    """``together.run_jobs``: the jobs side by side on this process's engine, each one's result. On a GPU that
    processes share, each gives back the memory it no longer uses after each batch (``give_back``), and a
    batch whose memory runs out is run once more, from its start, after giving back what the failed try
    held (the others' peaks may have passed: their jobs' numbers do not depend on when they run); a second
    time is one line from the command (``cli.errors``), not a traceback from each worker."""
    for last in (False, True):
        try:
            return run_jobs(engine_for(*engine, model=model), tok, variants, budgets, length, seed, jobs)
        except torch.OutOfMemoryError:
            if last:
                raise cli.UsageError(out_of_memory(_WORKER.get("workers", 1), len(jobs), engine[0])) from None
        finally:
            give_back()


def give_back() -> None:
    """Where this process has used a GPU: the engine's last buffers dropped and the CUDA allocator's free
    blocks returned, so that the processes sharing the GPU hold what they use, not each its own peak."""
    if torch.cuda.is_initialized():
        if hasattr(_ENGINE.get("engine"), "release"):     # the batched engines: the last step's groups
            _ENGINE["engine"].release()
        gc.collect()                                  # a failed try's tensors, held in reference cycles
        torch.cuda.empty_cache()


_WORKER: dict = {}      # in a worker process: the arguments every job shares, set once by _init_worker


def _init_worker(threads: int, shared: str, workers: int = 1) -> None:
    cli.worker_leaves_on_sigterm()
    torch.set_num_threads(threads)
    _WORKER["workers"] = workers
    with open(shared, "rb") as f:
        _WORKER["shared"] = pickle.load(f)


def _run_jobs_in_worker(jobs: list[tuple[str, int, str]]) -> list[list[tuple[tuple, dict]]]:
    return some_jobs(*_WORKER["shared"], jobs)


def out_of_memory(workers: int, together: int = 1, engine: str = "one-group") -> str:
    """What to do when a worker's GPU memory runs out: the processes share the GPU, each holding the model,
    its caches and CUDA's own memory (SmolLM2's main job with one group held 7 to 10 GiB a worker on an H200:
    fastpath/README.md), each sample stepped together with others holding its own caches; one group pads
    every cache to the largest, where groups by size (``--engine batched``) pad less."""
    held = f", this one holding {torch.cuda.memory_reserved() / 2**30:.1f} GiB" if torch.cuda.is_available() else ""
    other = [f"a smaller --together (each process holds {together} samples' caches)"] if together > 1 else []
    other += ["--engine batched, whose groups by size pad less than one group"] if engine == "one-group" else []
    if workers <= 1:
        return (f"the GPU ran out of memory{held}: the model and its caches do not fit ("
                + ", ".join(other + ["a shorter --length, fewer --methods or --budgets"]) + ")")
    return (f"the GPU ran out of memory with {workers} worker processes sharing it{held}: run with fewer "
            f"--workers" + (f" (or {'; or '.join(other)})" if other else ""))


def in_workers(batches: list[list[tuple]], shared: tuple, workers: int, tick) -> list:
    """``some_jobs`` of every batch of jobs in ``workers`` processes, in order however they finish (passed
    through ``tick``, the progress bar).

    The processes are fresh interpreters ("spawn": safe with torch threads). The model travels as plain
    pickled bytes (a few MB), not through torch's shared-memory files, in a temporary file each worker reads
    as it starts: passed in the pool's arguments, the bytes would go down a pipe that the pool writes until
    the worker has read them, after its imports, so the workers would start one after the other.

    They are started without Ctrl-C (``cli.worker_pool``): on Ctrl-C or SIGTERM this process stops them
    (``Pool.terminate``), removes the file and prints the one ``error: interrupted`` line."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="compare-") as folder:
        blob = os.path.join(folder, "shared.pickle")
        with open(blob, "wb") as f:
            pickle.dump(shared, f)
        with cli.worker_pool(ctx, workers, _init_worker, (1, blob, workers)) as pool:
            return list(tick(pool.imap(_run_jobs_in_worker, batches)))


def default_workers() -> int:
    """The CPUs this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def engine_and_workers(engine: str | None, workers: int | None, device: str, world: int, time_alone: bool,
                       that_fit: int | None = None) -> tuple[str, int]:
    """The engine and the worker processes of a run whose command names none. On a CPU: the fast engine, a
    worker per CPU. On a GPU: the one-group engine (the fewest operations; faster than groups by size on an
    H200, fastpath/README.md; unless ``--time-alone``, which it refuses) and a worker per CPU too, processes
    sharing the GPU, since a step of these small models is bound by launching operations from the host, one
    core each; but no more workers than ``that_fit`` (``workers_that_fit``: a large model gets one, whose
    steps are the GPU's work anyway). Under torchrun (``world`` > 1): one worker per rank."""
    gpu = str(device).startswith("cuda")
    engine = engine or ("one-group" if gpu and not time_alone else "fast")
    if workers or world > 1:
        return engine, workers or 1
    if gpu and that_fit is not None:
        return engine, max(1, min(default_workers(), that_fit))
    return engine, default_workers()


def without_mps(device, workers: int) -> str | None:
    """A line for a run of several processes on one GPU without NVIDIA's Multi-Process Service: their kernels
    then take turns in time slices, where through MPS they run side by side (on an H200 the bundled model's
    suite took less time through it: fastpath/README.md). None where MPS's control daemon is running (its
    pipe ``control`` in ``CUDA_MPS_PIPE_DIRECTORY``, else ``/tmp/nvidia-mps``) or the run is not such a run."""
    if not str(device).startswith("cuda") or workers <= 1:
        return None
    if (Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps") / "control").exists():
        return None
    return (f"note: {workers} worker processes share the GPU without NVIDIA's MPS, so their kernels take turns; "
            "start its daemon (nvidia-cuda-mps-control -d) to run them side by side (fastpath/README.md)")


# What a worker holds on the GPU besides its weights, in multiples of its caches' K/V: one group pads every
# cache to the largest and holds its old and new buffers while it regroups, the question's pass and
# KVReviver's rebuilt entries add more. SmolLM2-135M's main job (25 caches of 2,048 tokens, fp32) held up to
# 10.21 GiB a worker on an H200, four times its caches' K/V and CUDA's own memory (fastpath/README.md); 12
# workers of it ran there, 16 ran out. An estimate from that job, with a tenth of the GPU left spare.
HELD_PER_CACHE, CUDA_OWN, SPARE = 4, 2**30, 0.1


def caches_per_worker(variants: list[Variant], budgets: list[int], together: int = 1) -> int:
    """The caches a worker holds at once: a sample's rows of ``protocol.run_job`` (the full cache, then every
    other variant at every budget), ``together`` samples of them."""
    return (1 + sum(v.spec != "full" for v in variants) * len(budgets)) * together


def workers_that_fit(model, device, caches: int, length: int) -> int:
    """How many workers the GPU's memory holds, each with the model's weights and ``caches`` caches of
    ``length`` tokens in the model's dtype (``HELD_PER_CACHE`` times their K/V, and ``CUDA_OWN``); at least one."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = cfg.kv_bytes_per_token(next(model.parameters()).element_size()) * length
    worker = weights + HELD_PER_CACHE * caches * kv + CUDA_OWN
    return max(1, int((1 - SPARE) * torch.cuda.get_device_properties(torch.device(device)).total_memory // worker))
