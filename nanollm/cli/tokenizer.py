"""
Tokenizer utilities: ``python -m nanollm.cli.tokenizer bench`` encodes synthetic task text with tiktoken (our
BPE ranks) and with the pure-Python encoder of ``nanollm/io/tokenizer.py``, checks both give the same ids,
and prints both speeds.
"""

from __future__ import annotations

import argparse

from .. import cli
from ..data.tasks import corpus
from ..io.checkpoint import load_tokenizer
from ..io.tokenizer import bench

# The largest --kbytes: the pure-Python encoder reads about 0.3 MB/s and runs three times, so 10 MB already
# takes minutes (and the two encodings' token lists hold a few hundred MB); a larger text only takes longer.
MAX_KBYTES = 10_000


def kbytes(text: str) -> int:
    """``--kbytes``: a positive integer, at most ``MAX_KBYTES``."""
    value = cli.positive_int(text)
    if value > MAX_KBYTES:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_KBYTES} (10 MB), got {value}")
    return value


def main(argv: list[str] | None = None) -> None:
    ap = cli.ArgumentParser(prog="python -m nanollm.cli.tokenizer",
                            description="Tokenizer utilities: 'bench' encodes synthetic task text with tiktoken "
                                        "(our BPE ranks) and with the pure-Python encoder, checks that both give "
                                        "the same ids, and prints both speeds (medians of 3 runs).")
    ap.add_argument("command", choices=["bench"], help="bench: encode-speed comparison")
    ap.add_argument("--checkpoint", default="retrieval-llama",
                    help="bundled checkpoint name or nanollm checkpoint folder whose BPE tokenizer to use "
                         "(default %(default)s)")
    ap.add_argument("--kbytes", type=kbytes, default=200,
                    help=f"size of the benchmark text in kilobytes, at most {MAX_KBYTES} (1 KB = 1000 bytes; "
                         "default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generated text (default %(default)s)")
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        tok = load_tokenizer(args.checkpoint)
        if not hasattr(tok, "ranks"):            # a Hugging Face folder's tokenizer, or none
            cli.fail(f"--checkpoint {args.checkpoint}: the bench needs the BPE ranks of a nanollm tokenizer "
                     "(a nanollm checkpoint folder or bundled name)")
        text = corpus(args.kbytes * 1000, seed=args.seed)
        r = bench(tok, text)
    print(f"{r['bytes'] / 1e3:.0f} KB -> {r['tokens']:,} tokens (identical ids from both encoders)")
    print(f"tiktoken     : {r['tiktoken_s'] * 1e3:8.1f} ms  {r['tiktoken_MBps']:7.2f} MB/s")
    print(f"pure Python  : {r['python_s'] * 1e3:8.1f} ms  {r['python_MBps']:7.2f} MB/s")
    print(f"speedup      : {r['speedup']:.0f}x")


if __name__ == "__main__":
    main()
