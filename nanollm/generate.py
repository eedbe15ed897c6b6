"""
The generation command line: ``python -m nanollm.generate --help``.

Loads a checkpoint (bundled, nanollm folder or Hugging Face folder), builds a prompt (your text, or a
sample of a synthetic task), and generates with an explicit, uncompressed KV cache. The same command with
a compression method is ``python -m methods.generate`` (it passes ``make_policy`` to ``main`` below:
nanollm itself never imports ``methods``). The library functions (prefill, extend, decode_step, generate)
live in ``generation.py`` and are exported by the package: ``from nanollm import generate`` is the
function, not this module.
"""

from __future__ import annotations

import argparse
import sys

import torch

from .generation import generate



def main(argv: list[str] | None = None, make_policy=None, prog: str = "python -m nanollm.generate") -> None:
    """The command line. ``make_policy(spec, budget=...)``, when given, adds ``--method`` and ``--budget``."""
    from . import load   # the checkpoint loader (bundled names, paths, Hugging Face folders)

    ap = argparse.ArgumentParser(
        prog=prog,
        description="Generate text with a nanollm checkpoint and an explicit KV cache"
                    + (", optionally compressed by a KV-cache method." if make_policy else
                       " (full cache; 'python -m methods.generate' adds compression methods)."))
    ap.add_argument("--checkpoint", default="retrieval-llama",
                    help="bundled checkpoint name, a nanollm checkpoint folder, or a local Hugging Face-format "
                         "folder (config.json + weights). Default: %(default)s")
    ap.add_argument("--prompt", default=None, help="the prompt text; default: a sample of the task --task")
    ap.add_argument("--task", default="niah_single",
                    help="when no --prompt is given, generate a sample of this synthetic task "
                         "(see nanollm.tasks.TASKS). Default: %(default)s")
    ap.add_argument("--length", type=int, default=512, help="token length of the generated task sample")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    ap.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only")
    if make_policy is not None:
        ap.add_argument("--method", default="full",
                        help="KV-cache method: a name from methods.METHODS or a wrapper around a scorer such "
                             "as 'adakv(h2o)' (default: full cache)")
        ap.add_argument("--budget", type=int, default=None,
                        help="tokens kept per layer per KV head for --method (required unless --method full)")
    ap.add_argument("--seed", type=int, default=0, help="seed for the task sample and for sampling")
    ap.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default %(default)s)")
    args = ap.parse_args(argv)

    model, tok, card = load(args.checkpoint, device=args.device)
    if args.prompt is None:
        from .tasks import make_sample
        sample = make_sample(args.task, tok, length=args.length, seed=args.seed)
        text = sample.context + sample.question
        print(f"[task {args.task}, {args.length} tokens; expected answer: {' '.join(sample.answers)}]")
    else:
        text = args.prompt
    ids = torch.tensor([tok.encode(text)], device=args.device)
    policy = None
    if make_policy is not None and args.method != "full":
        if args.budget is None:
            ap.error("--budget is required with --method")
        try:
            policy = make_policy(args.method, budget=args.budget)
        except ValueError as e:
            ap.error(str(e))
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    stop = [tok.eot_id] if getattr(tok, "eot_id", None) is not None else []
    try:
        new = generate(model, ids, args.max_new_tokens, policy=policy, temperature=args.temperature,
                       top_k=args.top_k, stop_ids=stop, generator=gen)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(text[-300:] if args.prompt is None else text, end="")
    out = new[0].tolist()
    if stop and stop[0] in out:                  # show the answer, not the end-of-text token
        out = out[:out.index(stop[0])]
    print(tok.decode(out))


if __name__ == "__main__":
    main()
