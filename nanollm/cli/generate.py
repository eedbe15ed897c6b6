"""
The generation command line: ``python -m nanollm.cli.generate --help``.

Loads a checkpoint (bundled, nanollm folder or Hugging Face folder), builds a prompt (your text, or a
sample of a synthetic task), and generates with an explicit, uncompressed KV cache. The same command with
a compression method is ``python -m experiments.evaluation.generate`` (it passes ``make_policy`` to ``main`` below:
nanollm itself never imports ``methods``). The library functions (prefill, extend, decode_step, generate)
live in ``generation.py`` and are exported by the package: ``from nanollm import generate`` is the
function, not this module.
"""

from __future__ import annotations

import argparse

import torch

from .. import cli
from ..checks import MIN_TEMPERATURE
from ..generation import generate

DEFAULT_TASK = "niah_single_noise"
DEFAULT_LENGTH = 512          # tokens of a task sample (or the model's maximum positions, if fewer)
PROMPT_NEW_TOKENS = 32        # default --max-new-tokens with --prompt; a task sample uses its answer length


def temperature(text: str) -> float:
    """``--temperature``: 0 (greedy), or a finite number >= ``checks.MIN_TEMPERATURE``: below it, logits /
    temperature can overflow to infinity, and sampling from the NaN probabilities fails."""
    value = cli.non_negative_float(text)
    if 0 < value < MIN_TEMPERATURE:
        raise argparse.ArgumentTypeError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {text}")
    return value


def main(argv: list[str] | None = None, make_policy=None, prog: str = "python -m nanollm.cli.generate") -> None:
    """The command line. ``make_policy(spec, budget=...)``, when given, adds ``--method`` and ``--budget``."""
    from ..data.evaluate import ANSWER_TOKENS, DEFAULT_ANSWER_TOKENS
    from ..data.tasks import ALL_TASKS

    ap = cli.ArgumentParser(
        prog=prog,
        description="Generate text with a nanollm checkpoint and an explicit KV cache"
                    + (", optionally compressed by a KV-cache method." if make_policy else
                       " (full cache; 'python -m experiments.evaluation.generate' adds compression methods).")
                    + " Without --prompt, the prompt is a sample of a synthetic task, and the answer is checked "
                      "against the sample's expected answer.")
    ap.add_argument("--checkpoint", default="retrieval-llama",
                    help="bundled checkpoint name, a fetched model's name (smollm2-135m), a nanollm checkpoint "
                         "folder, a local Hugging Face-format folder (config.json + weights + tokenizer files) or a "
                         "GGUF file. Default: %(default)s")
    ap.add_argument("--prompt", default=None,
                    help="the prompt text (default: a sample of --task, whose expected answer is shown)")
    ap.add_argument("--task", default=None, choices=ALL_TASKS, metavar="TASK",
                    help=f"without --prompt: the synthetic task to sample, one of {', '.join(ALL_TASKS)} "
                         f"(default {DEFAULT_TASK})")
    ap.add_argument("--length", type=cli.positive_int, default=None,
                    help="without --prompt: tokens of the task sample, context + question + answer (default "
                         f"{DEFAULT_LENGTH}, or the model's maximum positions if fewer)")
    ap.add_argument("--max-new-tokens", type=cli.positive_int, default=None,
                    help="tokens to generate at most; generation stops early at the end-of-text token (default: "
                         "the task's answer length, 16 to 96 tokens, or "
                         f"{PROMPT_NEW_TOKENS} with --prompt)")
    ap.add_argument("--temperature", type=temperature, default=0.0,
                    help=f"0 = greedy (default); at least {MIN_TEMPERATURE:g}: samples from softmax(logits / "
                         "temperature) (smaller ones could overflow the scaled logits)")
    ap.add_argument("--top-k", type=cli.positive_int, default=None,
                    help="with --temperature > 0: sample among the k most likely tokens only (default: all)")
    if make_policy is not None:
        ap.add_argument("--method", default=None,
                        help="KV-cache method: a name from methods.METHODS, a wrapper around a scorer such "
                             "as 'adakv(h2o)', or MODULE:CLASS, a policy class of your own (default: full cache)")
        ap.add_argument("--budget", type=cli.positive_int, default=None,
                        help="tokens kept per layer per KV head by --method (required with a --method other "
                             "than full)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the task sample and of sampling (default %(default)s)")
    ap.add_argument("--device", type=cli.device, default="cpu",
                    help="torch device, e.g. cpu or cuda (default %(default)s)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of the weights and the cache; bfloat16 halves the bytes a step reads, at a small "
                         "cost in accuracy (`python -m experiments.speed --dtype bfloat16` measures it) "
                         "(default %(default)s)")
    args = ap.parse_args(argv)

    with cli.errors(args.debug):
        from ..data.tasks import make_sample, string_match_all
        from ..io.checkpoint import load, load_config, load_tokenizer

        # 1. the flags, alone and together
        if args.top_k is not None and args.temperature == 0:
            cli.fail("--top-k only applies when sampling: give --temperature > 0 as well")
        if args.prompt is not None and (args.task is not None or args.length is not None):
            cli.fail("--task and --length make a task sample, which --prompt replaces: give one or the other")
        policy, method = None, getattr(args, "method", None)
        if make_policy is not None:
            if args.budget is not None and method is None:
                cli.fail("--budget is the budget of a compression method: give --method as well")
            if args.budget is not None and method == "full":
                cli.fail("--method full keeps every entry: --budget does not apply to it")
            if method not in (None, "full"):
                if args.budget is None:
                    cli.fail(f"--method {method} needs --budget (tokens kept per layer per KV head)")
                try:
                    policy = make_policy(method, budget=args.budget)
                except ValueError as e:
                    cli.fail(f"--method {method}: {e}")

        # 2. the checkpoint's config and tokenizer (not its weights yet)
        config = load_config(args.checkpoint)
        tok = load_tokenizer(args.checkpoint)
        if tok is None:
            cli.fail(f"--checkpoint {args.checkpoint} has no supported tokenizer file (tokenizer.json, or "
                     "vocab.json + merges.txt), which is needed to encode the prompt")

        # 3. the prompt, and room for the answer
        sample = None
        if args.prompt is not None:
            ids = tok.encode(args.prompt)
            if not ids:
                cli.fail("--prompt is empty: give some text")
            default_new = PROMPT_NEW_TOKENS
        else:
            task = args.task or DEFAULT_TASK
            length = args.length or min(DEFAULT_LENGTH, config.max_seq_len)
            if length > config.max_seq_len:
                cli.fail(f"--length {length} exceeds the model's maximum positions ({config.max_seq_len})")
            try:
                sample = make_sample(task, tok, length=length, seed=args.seed)
            except ValueError as e:
                cli.fail(f"--length {length}: {e}")
            ids = sample.prompt_ids
            default_new = ANSWER_TOKENS.get(task, DEFAULT_ANSWER_TOKENS)
        room = config.max_seq_len - len(ids) + 1            # the last new token needs no position
        if room < 1:
            cli.fail(f"--prompt is {len(ids)} tokens, more than the model's maximum positions ({config.max_seq_len})")
        max_new = args.max_new_tokens or min(default_new, room)
        if max_new > room:
            cli.fail(f"--max-new-tokens {max_new}: the prompt ({len(ids)} tokens) leaves room for {room} new "
                     f"tokens in the model's {config.max_seq_len} positions")

        # 4. the work
        model, _, _ = load(args.checkpoint, device=args.device, dtype=getattr(torch, args.dtype))
        gen = torch.Generator(device=args.device).manual_seed(args.seed)
        stop = [tok.eot_id] if getattr(tok, "eot_id", None) is not None else []
        new = generate(model, torch.tensor([ids], device=args.device), max_new, policy=policy,
                       temperature=args.temperature, top_k=args.top_k, stop_ids=stop, generator=gen)
    out = new[0].tolist()
    stopped = bool(stop) and stop[0] in out
    if stopped:                                   # show the answer, not the end-of-text token
        out = out[:out.index(stop[0])]
    cache = f"method {method}, budget {args.budget}" if policy is not None else "full cache"
    if sample is not None:
        text = sample.context + sample.question
        print(f"[task {sample.task}, {len(ids)} prompt tokens, seed {args.seed}, {cache}; expected answer: "
              f"{' '.join(sample.answers)}]")
        print(("..." + text[-300:]) if len(text) > 300 else text)
    else:
        print(args.prompt)
    held = "" if policy is None or args.budget < len(ids) + len(out) else \
        "; the budget holds the prompt and the answer, so nothing was evicted"
    print(f"--- generated: {len(out)} tokens, {'stopped at end-of-text' if stopped else f'limit {max_new}'}"
          f"{'' if sample is not None else f', {len(ids)} prompt tokens, ' + cache}{held} ---")
    answer = tok.decode(out)
    print(answer)
    if sample is not None:
        score = string_match_all(answer, sample.answers)
        found = round(score * len(sample.answers))
        print(f"--- {'matches' if score == 1 else 'does not match'} the expected answer: {found} of "
              f"{len(sample.answers)} expected strings found ---")


if __name__ == "__main__":
    main()
