"""
Do KVReviver's records move when only the rounding of its sketch's sums changes? A question a CPU can answer.

On a GPU the main job's records of KVReviver differ from the CPU's in a few answers, where every other
method's are the CPU's (``fastpath/README.md``); its count sketch (Algorithm 1, Yuan et al., arXiv
2512.17917) adds many tokens into each cell, which a GPU sums in an order of its own. This module runs
``experiments.compare`` with one change, each ``VagueSketch.insert`` taking its sums in float64 and rounding
them once to fp32; ``experiments.evaluation.agree --records`` against a plain run says which records moved:

    python -m experiments.analysis.kvreviver_rounding --checkpoint smollm2-135m --methods kvreviver \\
        --keep-ratios 0.1 --tasks niah_single_docs passkey niah_multikey_docs --samples 10 --json float64.json

It takes ``experiments.compare``'s options and runs in one process on the CPU (``--workers 1``, ``--device
cpu``). Why the change is a fair test, the plain run and the comparison: experiments/README.md, section
"analysis/kvreviver_rounding.py: does the sketch's rounding move the records?".
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
from torch import Tensor

from experiments.evaluation import compare
from methods.kvreviver_sketch import VagueSketch
from nanollm import cli

PROG = "python -m experiments.analysis.kvreviver_rounding"
PLAIN_INSERT = VagueSketch.insert        # Algorithm 1 as methods/kvreviver_sketch.py has it (float64_insert runs it)


def float64_insert(self: VagueSketch, pos: Tensor, k: Tensor, v: Tensor, sign: float = 1.0) -> None:
    """``VagueSketch.insert`` itself on float64 copies of the cells, which are then rounded once back to the
    cells' dtype: the insert converts the tokens to its cells' dtype, so every sum is taken in float64 (the
    plain insert adds the tokens one by one in fp32). pos (n,); k, v (n, H_kv, d)."""
    key, value = self.key, self.value
    self.key, self.value = key.double(), value.double()
    try:
        PLAIN_INSERT(self, pos, k, v, sign)
        key.copy_(self.key)
        value.copy_(self.value)
    finally:
        self.key, self.value = key, value


@contextmanager
def sums_in_float64():
    """Every KVReviver sketch in this process inserts with ``float64_insert`` (the kernels' ``KernelSketch``
    off a GPU and the fast engines' routed sketches inherit it), until the block ends."""
    VagueSketch.insert = float64_insert
    try:
        yield
    finally:
        VagueSketch.insert = PLAIN_INSERT


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = compare.parser()
    ap.prog = PROG
    ap.description = ("experiments.compare with KVReviver's sketch summing in float64, rounded once to fp32: does a "
                      "change of rounding in its cells move its records? Compare with a plain run "
                      "of the same options (python -m experiments.evaluation.agree --records). One process, on the "
                      "CPU.")
    for action in ap._actions:                     # compare's help for --workers, as it holds here
        if action.dest == "workers":
            action.help = "1, the default and the only value: the change reaches this process only"
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        if args.workers not in (None, 1):
            cli.fail(f"--workers {args.workers}: the change reaches this process only; run with --workers 1")
        if torch.device(args.device).type != "cpu":
            cli.fail(f"--device {args.device}: on a GPU the sketch is the Triton kernels', which this does not "
                     "change; run on the CPU")
    with sums_in_float64():
        compare.main(argv + ([] if args.workers else ["--workers", "1"]), prog=PROG)


if __name__ == "__main__":
    main()
