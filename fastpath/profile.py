"""
Where a fused decode step's time goes, kernel by kernel: ``python -m fastpath.profile``.

On the e2e benchmark's synthetic cache (keep 0.1), after ``e2e.WARM`` steps, ``--steps`` more are recorded
with ``torch.profiler``; each kernel's launches and time per step are printed, the most time first.

    python -m fastpath.profile --length 32768 --methods full h2o         # on a GPU: bash fastpath/gpu_check.sh
    python -m fastpath.profile --path skinny --methods full snapkv       # the products in the skinny kernel
    python -m fastpath.profile --quick                                   # tiny shapes, on a CPU: its operators

How: fastpath/inside.md, "bench.py and profile.py".
"""

from __future__ import annotations

import argparse
import re

import torch
from torch.profiler import ProfilerActivity, profile

from nanollm import cli, preset
from nanollm.cli.provenance import header, provenance
from nanollm.io.files import atomic_write_text

from . import e2e
from .fused import FusedGraphDecoder
from .skinny import SkinnyGraphDecoder
from .tune import skinny_summary, tune_skinny_or_say_why
from .tune import summary as tune_summary

TOP = 15                # kernels listed per method


def device_time(event) -> float:
    """An averaged event's own time on the device in microseconds (the attribute's name moved in torch 2.5)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return getattr(event, name)
    return 0.0


# what the profiler records beside the kernels, with device time of its own: the host's calls into CUDA (a
# Triton launch is a cuLaunchKernelEx, once per kernel it launches) and the profiler's own buffer requests
NOT_KERNELS = re.compile(r"^(cu|cuda)[A-Z]|^Activity Buffer Request$")


def kernels_of(prof, device: str) -> dict[str, tuple[int, float]]:
    """name -> (launches, microseconds) of the recorded device kernels (on a CPU: the operators, their own
    host time, the views and other metadata calls left out)."""
    out: dict[str, tuple[int, float]] = {}
    for e in prof.key_averages():
        if device == "cuda":
            us = device_time(e)
            if NOT_KERNELS.match(e.key):
                continue
            if e.device_type == torch.autograd.DeviceType.CUDA or (us > 0 and not e.key.startswith("aten::")):
                out[e.key] = (e.count, us)
        elif e.key.startswith("aten::") and e.self_cpu_time_total > 0 and e.key not in VIEWS:
            out[e.key] = (e.count, e.self_cpu_time_total)
    return out


# the operators that launch no kernel: views (metadata only; experiments/evaluation/launches.py counts them apart
# too), and the allocations and reshapes above them
METADATA_ONLY = {"slice", "view", "expand", "select", "_unsafe_view", "unsqueeze", "squeeze", "as_strided", "t",
                 "transpose", "permute", "alias", "detach", "split", "split_with_sizes", "chunk", "unbind",
                 "unflatten", "narrow", "lift_fresh", "view_as_real", "view_as_complex", "_reshape_alias"}
VIEWS = {f"aten::{n}" for n in METADATA_ONLY | {"reshape", "empty", "empty_strided"}}


def profile_method(cfg, model, decoder: FusedGraphDecoder, method: str, B: int, S: int, dtype, device: str,
                   steps: int) -> list[str]:
    """The table of one method's step (see the module docstring)."""
    cache = e2e.synthetic_cache(cfg, method, B, S, dtype, device)
    if not decoder.start(cache, e2e.ROOM):
        raise RuntimeError(f"{method} fell back to the lean step: {decoder.fallback}")
    del cache
    token = torch.zeros(B, dtype=torch.long, device=device)
    decoder.current.token.copy_(token)
    for _ in range(e2e.WARM):
        decoder.decode(decoder.current.token)
    e2e.sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            decoder.decode(decoder.current.token)
        e2e.sync(device)
    kernels = kernels_of(prof, device)
    decoder.forget()
    total_n = sum(n for n, _ in kernels.values()) / steps
    total_us = sum(us for _, us in kernels.values()) / steps
    what = "kernels" if device == "cuda" else "operators (a CPU dry run)"
    lines = [f"{method} at {S} tokens: {total_n:.0f} {what} per step, {total_us / 1e3:.3f} ms of their own time "
             f"per step ({cfg.n_layer} layers)",
             f"  {'per step':>8} {'us/step':>9} {'share':>6}  name"]
    for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:TOP]:
        lines.append(f"  {n / steps:8.1f} {us / steps:9.1f} {us / max(total_us * steps, 1e-9):6.1%}  {name[:90]}")
    return lines


PATHS = {"fused": FusedGraphDecoder, "skinny": SkinnyGraphDecoder}


def run(device: str, quick: bool, lengths: tuple, methods: list[str], steps: int, path: str = "fused") -> list[str]:
    B = e2e.QUICK_BATCH if quick else e2e.BATCH
    dtype = torch.float32 if quick else torch.bfloat16
    cfg = preset(e2e.PRESET, max_seq_len=max(lengths) + e2e.ROOM, **(e2e.QUICK_SHAPE if quick else {}))
    torch.manual_seed(0)
    model = e2e.random_model(cfg, dtype, device)
    decoder = PATHS[path](model, backend=None if device == "cuda" else "eager")
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    lines = [f"the {path} step's {'kernels' if device == 'cuda' else 'operators'} on {name}: {e2e.PRESET}"
             f"{' (quick: shrunk)' if quick else ''} shape, batch {B}, {dtype}, keep {e2e.KEEP}, {steps} steps "
             f"recorded after {e2e.WARM}"]
    if path == "skinny" and device == "cuda" and not quick:     # the products launched as the e2e bench does
        lines += [""] + skinny_summary(tune_skinny_or_say_why(cfg, B, dtype, device))
    for S in lengths:
        if device == "cuda" and not quick:            # the split kernel launched as the e2e bench launches it
            for sweep in e2e.tune_at(cfg, B, S, dtype, device).values():
                lines += [""] + tune_summary(sweep)
        for method in methods:
            lines += [""] + profile_method(cfg, model, decoder, method, B, S, dtype, device, steps)
            print("\n".join(lines[-TOP - 3:]), flush=True)
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = cli.ArgumentParser(prog="python -m fastpath.profile", description=__doc__.split("\n", 2)[2],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=cli.positive_int, nargs="+", default=None,
                    help="context lengths (default 8192 and 32768; --quick: 64)")
    ap.add_argument("--methods", nargs="+", choices=e2e.METHODS_TIMED, default=list(e2e.METHODS_TIMED),
                    help="the caches: the full one and methods at keep 0.1 (default: all five)")
    ap.add_argument("--path", choices=sorted(PATHS), default="fused",
                    help="the step profiled: fused (fused.py) or skinny (skinny.py, its products in the skinny "
                         "kernel; on a CPU the fused step) (default %(default)s)")
    ap.add_argument("--steps", type=cli.positive_int, default=2, help="steps recorded (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes in fp32: seconds on a CPU (a dry run)")
    ap.add_argument("--device", type=cli.device, default=None,
                    help="cuda where there is one, else cpu (default: that choice)")
    ap.add_argument("--out", type=cli.output_file, default=None, metavar="PATH",
                    help="also write the tables, with their provenance, to PATH (default: none)")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    lengths = tuple(args.length or ((64,) if args.quick else e2e.LENGTHS))
    with cli.errors(args.debug):
        e2e.check_shapes(e2e.PRESET, args.quick, lengths, None, torch.float32 if args.quick else torch.bfloat16,
                         args.steps)
        lines = run(device, args.quick, lengths, args.methods, args.steps, args.path)
        if args.out is not None:
            prov = provenance(threads=torch.get_num_threads(), dtype="float32" if args.quick else "bfloat16",
                              seed=0)
            atomic_write_text(args.out, header(prov) + "\n\n" + "\n".join(lines) + "\n")
            print(f"tables written to {args.out}")


if __name__ == "__main__":
    main()
