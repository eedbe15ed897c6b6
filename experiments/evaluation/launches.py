"""
How many tensor operations one sample of the main job runs, and where:
``python -m experiments.evaluation.launches``.

On a GPU every operation that computes is a kernel launch. This runs one (task, sample, mode) of
``experiments.compare`` under a ``TorchDispatchMode`` that counts every aten operation, by phase (fill, step,
fork, rest) and by who ran it (a policy's hooks, attention and storage, the model), with the host's waits.
A CPU count stands in for a GPU's: the same Python runs the same operations on either device.
How it counts: ``inside.md``, "launches.py".
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastpath.profile import METADATA_ONLY
from methods import METHODS, kvreviver
from nanollm import cli, load
from nanollm.cli.provenance import header, provenance
from nanollm.data.evaluate import MODES
from nanollm.io.files import atomic_write_text
from nanollm.policy import CachePolicy
from nanollm.wrapper import PolicyWrapper

from . import budget_for
from .engines import ENGINES
from .protocol import Probe, Variant
from .task import TASKS
from .workers import some_jobs

VIEWS = METADATA_ONLY                                # no kernel: a view's metadata only (fastpath/profile.py)
# allocations and storage swaps: the caching allocator hands out memory, no kernel runs (a deep copy of a tensor
# is mostly these: empty, set_, then one copy_); counted apart, like the views
ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "set_", "resize_"}
STORAGE = {"attend", "write", "attend_entries", "attend_step", "append", "adopt"}   # per cache or per group
# operations whose result's size or value the host reads (int(t), bool(t), t.item(), nonzero, a boolean mask's
# index, ...): on a GPU the host waits there for every kernel launched before them; t.tolist() is counted too
WAITS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "equal",
         "repeat_interleave"}


class Counter(TorchDispatchMode):
    """Counts aten operations that compute, and the host's waits among them, by (phase, who); the phase is
    set by the engine's wrapped methods."""

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.counts, self.waits = "rest", collections.Counter(), collections.Counter()
        self.views = self.allocations = 0

    def key(self, frame) -> tuple[str, str]:
        return self.phase, who(frame) if self.phase == "step" else ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in VIEWS:
            self.views += 1
        elif name in ALLOCATIONS:
            self.allocations += 1
        else:
            key = self.key(sys._getframe(1))
            self.counts[key] += 1
            boolean_index = name == "index" and any(getattr(t, "dtype", None) == torch.bool for t in args[1])
            if name in WAITS or boolean_index or waited_copy(name, args, kwargs or {}):
                self.waits[key] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        tolist = self.tolist = torch.Tensor.tolist

        def counted(t, *a, **k):                 # the host reads a tensor's values: no aten operation shows it
            self.waits[self.key(sys._getframe(1))] += 1
            return tolist(t, *a, **k)
        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.tolist
        return super().__exit__(*exc)


def waited_copy(name: str, args, kwargs) -> bool:
    """A copy between the host and a GPU that the host waits for: not ``non_blocking`` (a copy from ordinary
    host memory to a GPU waits too; ``torch.tensor(values, device="cuda")`` is one). Only a GPU run has them."""
    if name == "_to_copy" and isinstance(args[0], torch.Tensor) and kwargs.get("device") is not None:
        src, dst, non_blocking = args[0].device, torch.device(kwargs["device"]), kwargs.get("non_blocking", False)
    elif name == "copy_" and isinstance(args[1], torch.Tensor):
        src, dst = args[1].device, args[0].device
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    else:
        return False
    return (src.type == "cpu") != (dst.type == "cpu") and not non_blocking


def who(frame) -> str:
    """In a decode step: the innermost policy running (not ``Probe``), else attention and storage, else model."""
    storage = False
    while frame is not None:
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name in ("step_rows", "step_layers"):   # row_hooks.py: several caches of one method
            owner = frame.f_locals.get("policies", [None])[0]
        if isinstance(owner, (CachePolicy, PolicyWrapper)) and not isinstance(owner, Probe):
            return f"policy: {type(owner).__name__}"
        storage |= frame.f_code.co_name in STORAGE
        frame = frame.f_back
    return "attention and storage" if storage else "model"


def count(model, tok, engine: str, task: str, mode: str, length: int, seed: int, together: int = 1) -> Counter:
    """One job of ``experiments.compare`` (every method at keep 0.1, 0.25 and 0.5) after a warm-up job: timed
    (``counter.seconds``), then run again, counted. ``together`` > 1: that many jobs (samples 1, 2, ...)
    stepped side by side (``--together``), counted and timed together (``counter.samples``)."""
    variants = [Variant(name, name) for name in METHODS]
    budgets = [budget_for(r, length) for r in (0.1, 0.25, 0.5)]
    # the warm-up: sample 0 and, with together > 1, as many more samples as the counted run steps together (its
    # shapes made once, as in a run's later samples: samples together + 1, ...); the counted: samples 1, 2, ...
    samples = [[(task, i, mode) for i in [0, *range(together + 1, 2 * together)]],
               [(task, i, mode) for i in range(1, together + 1)]]
    job = lambda i: some_jobs(model, tok, variants, budgets, length, seed, (engine, False), samples[i])  # noqa: E731
    job(0)
    counter = Counter()
    counter.samples = together
    counter.seconds = timed(lambda: job(1), model)
    cls = ENGINES[engine]
    originals = {name: getattr(cls, name) for name in ("fill", "step", "fork")}

    def phased(name, f):
        def run(self, *a, **k):
            before, counter.phase = counter.phase, name
            try:
                return f(self, *a, **k)
            finally:
                counter.phase = before
        return run
    chunk = kvreviver.REBUILD_CHUNK
    try:
        for name, f in originals.items():
            setattr(cls, name, phased(name, f))
        kvreviver.REBUILD_CHUNK = 1 << 62     # as on a GPU: KVReviver rebuilds its positions at once (same values)
        with counter:
            job(1)
    finally:
        for name, f in originals.items():
            setattr(cls, name, f)
        kvreviver.REBUILD_CHUNK = chunk
    return counter


def timed(f, model) -> float:
    """Seconds ``f()`` takes, the device synchronised before and after."""
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    f()
    sync()
    return time.perf_counter() - t0


def report(counter: Counter) -> list[str]:
    """One line per (phase, who), the most operations first: operations, their share, the host's waits; per
    sample where several were stepped together (their totals divided by their number)."""
    k = getattr(counter, "samples", 1)
    total = sum(counter.counts.values())
    lines = [f"{'phase':6} {'who':32} {'operations':>10} {'share':>6} {'host waits':>10}"]
    for key, n in sorted(counter.counts.items(), key=lambda kv: -kv[1]):
        lines.append(f"{key[0]:6} {key[1] or '-':32} {n // k:10,d} {n / total:6.1%} {counter.waits[key] // k:10,d}")
    lines.append(f"{'all':6} {'operations that compute':32} {total // k:10,d} {'':6} "
                 f"{sum(counter.waits.values()) // k:10,d}")
    lines.append(f"{'all':6} {'views (no kernel)':32} {counter.views // k:10,d}")
    lines.append(f"{'all':6} {'allocations (no kernel)':32} {counter.allocations // k:10,d}")
    what = "the same job not counted: " if k == 1 else f"the same {k} samples stepped together, not counted: a sample "
    lines.append(f"{what}{counter.seconds / k:.2f} s, {counter.seconds / total * 1e6:.1f} us per "
                 "operation that computes (its views, allocations and the Python around it, included)")
    if k > 1:
        lines.insert(0, f"(every count per sample: the totals of {k} samples stepped together, divided by {k})")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = cli.ArgumentParser(prog="python -m experiments.evaluation.launches", description=__doc__.split("\n", 2)[2],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="retrieval-llama",
                    help="checkpoint name, as experiments.compare takes it (default %(default)s)")
    ap.add_argument("--engine", choices=sorted(ENGINES), default="fast", help="the engine (default %(default)s)")
    ap.add_argument("--task", choices=sorted(TASKS), default="niah_multikey", help="the task (default %(default)s)")
    ap.add_argument("--mode", choices=MODES, default=MODES[1], help="the mode (default %(default)s)")
    ap.add_argument("--length", type=cli.positive_int, default=512, help="sample tokens (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="first sample seed (default %(default)s)")
    ap.add_argument("--together", type=cli.positive_int, default=1, metavar="K",
                    help="count K samples stepped side by side, as experiments.compare --together K runs them, and "
                         "report per sample (default %(default)s)")
    ap.add_argument("--device", type=cli.device, default="cpu",
                    help="torch device the job runs on; the operations are the same on any, the host's waits for a "
                         "copy between host and GPU count only on a GPU (default %(default)s)")
    ap.add_argument("--out", type=cli.output_file, default=None, metavar="PATH",
                    help="also write the report, with its provenance, to PATH (default: none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with cli.errors(args.debug):
        model, tok, _ = load(args.checkpoint, device=args.device)
        counter = count(model, tok, args.engine, args.task, args.mode, args.length, args.seed, args.together)
        which = f"sample {args.seed + 1}" if args.together == 1 else \
            f"samples {args.seed + 1} to {args.seed + args.together} stepped together (--together {args.together})"
        text = "\n".join([f"one job of experiments.compare on {args.device}: {args.checkpoint}, {args.task}, "
                          f"{args.mode}, {args.length} tokens, every method at keep 0.1 / 0.25 / 0.5, --engine "
                          f"{args.engine}, {which} (after a warm-up {'one' if args.together == 1 else 'of as many'})",
                          *report(counter)])
        print(text)
        if args.out is not None:
            prov = provenance(threads=1, dtype="float32", seed=args.seed)
            atomic_write_text(args.out, header(prov) + "\n\n" + text + "\n")
            print(f"report written to {args.out}")


if __name__ == "__main__":
    main()
