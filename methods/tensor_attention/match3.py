"""
Match3, causal: a task where three-way interactions matter. Train, evaluate and bundle the tiny models.

Paper: Sanford, Hsu & Telgarsky, NeurIPS 2023, https://arxiv.org/abs/2306.02896, §4: on x_1..x_n in Z_M, position i
is labelled 1 if x_i + x_j + x_k = 0 (mod M) for some j, k; one tensor-attention head computes it directly, one
standard attention layer needs a large size. Our causal form puts the labels in the sequence, so it decodes::

    BOS x_1 L_1 x_2 L_2 ... x_n L_n        L_i = YES if x_a + x_b + x_i = 0 (mod M) for some a <= b <= i, else NO

    python -m methods.tensor_attention.match3 train --attention tensor --out runs/m3-tensor
    python -m methods.tensor_attention.match3 eval match3-tensor match3-standard

The bundled ``checkpoints/match3-tensor`` and ``match3-standard`` were trained with the defaults; each card records
its command, budget and accuracy. The task in full, the baseline: ``methods/tensor_attention/README.md``, "Match3:
the task and the bundled models".
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from nanollm import cli
from nanollm.cache import KVCache
from nanollm.config import ModelConfig
from nanollm.generation import extend, prefill
from nanollm.io import checkpoint
from nanollm.model import Transformer

from .attention import TENSOR_ATTENTION, tensor_cache

M = 32                                   # numbers live in Z_M: tokens 0..M-1
YES, NO, BOS = M, M + 1, M + 2
VOCAB = M + 3
N_NUMBERS = 12                           # numbers per training sequence (25 tokens with BOS and labels)
CHECKPOINTS = Path(__file__).parent / "checkpoints"


# ----------------------------------------------------------------------------------------------------------
# The task


def labels(xs: list[int], m: int = M) -> list[int]:
    """L_i for every i: YES if x_a + x_b + x_i = 0 (mod m) for some a <= b <= i (0-based, i included)."""
    out, seen = [], []
    for x in xs:
        seen.append(x)
        sums = {(a + b) % m for j, a in enumerate(seen) for b in seen[j:]}        # pair sums so far
        out.append(YES if (-x) % m in sums else NO)
    return out


def sequence(xs: list[int]) -> list[int]:
    """BOS x_1 L_1 ... x_n L_n."""
    ids = [BOS]
    for x, label in zip(xs, labels(xs)):
        ids += [x, label]
    return ids


def random_numbers(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(M) for _ in range(n)]


def batch(n_seq: int, n: int, seed: int) -> tuple[Tensor, Tensor]:
    """ids (B, 1 + 2n) and targets (B, 1 + 2n): the label after each number, -100 (ignored) elsewhere."""
    rng = random.Random(seed)
    ids = torch.tensor([sequence(random_numbers(n, rng)) for _ in range(n_seq)])
    targets = torch.full_like(ids, -100)
    targets[:, 1::2] = ids[:, 2::2]                  # at x_i (odd positions) the next token is L_i
    return ids, targets


def majority_baseline(n: int = N_NUMBERS, n_seq: int = 20000, seed: int = 0) -> float:
    """Accuracy of predicting, at each position i, the label more frequent there (estimated on a sample)."""
    ids, _ = batch(n_seq, n, seed)
    yes = (ids[:, 2::2] == YES).float().mean(0)                                   # (n,) P(YES) per position
    return float(torch.maximum(yes, 1 - yes).mean())


# ----------------------------------------------------------------------------------------------------------
# Models: the tensor-attention decoder and a standard one with the same number of parameters


def model_config(attention: str) -> ModelConfig:
    """GPT-2 flavour (learned positions), 2 layers, 4 heads of 16 dims. Tensor attention has five
    projections where standard attention has three; the standard model gets the difference back as a wider
    MLP (d_ff 320 instead of 256), so both have the same parameter count to within 0.2% (121,024 vs 120,896).
    "Same size" is parameters and optimiser steps, not compute: a tensor layer costs O(T^3 d) per sequence
    against O(T^2 d), and the learning rate (3e-3) was not tuned for either model."""
    if attention not in ("tensor", "standard"):
        raise ValueError(f"attention must be 'tensor' or 'standard', got {attention!r}")
    tensor = attention == "tensor"
    return ModelConfig(flavour="gpt2", vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=4, d_model=64,
                       d_ff=256 if tensor else 320, max_seq_len=32,
                       attention=TENSOR_ATTENTION if tensor else "causal")


def accuracy(model: Transformer, n: int = N_NUMBERS, n_seq: int = 2000, seed: int = 10**6) -> float:
    """Teacher-forced label accuracy on fresh sequences (the true earlier labels are in the context)."""
    ids, targets = batch(n_seq, n, seed)
    with torch.no_grad():
        pred = torch.cat([model(ids[i:i + 500]).argmax(-1) for i in range(0, n_seq, 500)])
    mask = targets != -100
    return float((pred[mask] == targets[mask]).float().mean())


def greedy_labels(model: Transformer, xs: Tensor, layout: str | None = None) -> Tensor:
    """Decode the labels of numbers xs (B, n) greedily through a KV cache: prefill BOS x_1, take the argmax
    as L_1, extend by [L_1, x_2], and so on; the model reads its *own* labels. ``layout`` picks a tensor
    cache ("four", "four-naive", "two"; None = the module's default). Returns the labels (B, n)."""
    B, n = xs.shape
    if layout is not None and model.config.attention != TENSOR_ATTENTION:
        raise ValueError(f"layout {layout!r} is for tensor-attention models; this one has "
                         f"{model.config.attention!r} attention")
    cache = tensor_cache(model.config, layout) if layout else KVCache(model.config)
    with torch.no_grad():
        logits = prefill(model, torch.cat([torch.full((B, 1), BOS), xs[:, :1]], 1), cache)[:, -1]
        out = [logits.argmax(-1)]
        for i in range(1, n):
            logits = extend(model, torch.stack([out[-1], xs[:, i]], 1), cache)[:, -1]
            out.append(logits.argmax(-1))
    return torch.stack(out, 1)


# ----------------------------------------------------------------------------------------------------------
# Training (AdamW, warm-up + cosine; the loss is on the labels only: the numbers are random)


def train(attention: str, steps: int = 3000, batch_size: int = 128, lr: float = 3e-3, seed: int = 0,
          log=print) -> tuple[Transformer, list[dict]]:
    torch.manual_seed(seed)
    model = Transformer(model_config(attention))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, min(200, steps // 10))
    history = []
    for step in tqdm(range(steps), desc=f"train {attention}", mininterval=5):
        f = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr * max(f, 0.02)
        ids, targets = batch(batch_size, N_NUMBERS, seed=seed * 10**7 + step)
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % max(1, steps // 10) == 0 or step + 1 == steps:
            model.eval()
            history.append({"step": step + 1, "loss": round(loss.item(), 4),
                            "accuracy": round(accuracy(model, n_seq=500), 4)})
            model.train()
            log(f"step {step + 1}: loss {loss.item():.4f}, accuracy {history[-1]['accuracy']:.3f}")
    return model.eval(), history


# ----------------------------------------------------------------------------------------------------------
# Checkpoint folders: nanollm_config.json, model.safetensors, card.json, README.md (no tokenizer: the
# tokens are the numbers 0..M-1 and YES, NO, BOS)


def save(model: Transformer, folder: str | Path, card: dict) -> None:
    checkpoint.save(model, None, folder, {**card, "markdown": card_markdown(card)})


def load(name_or_path: str | Path) -> tuple[Transformer, dict]:
    """A Match3 model by bundled name ("match3-tensor", "match3-standard") or folder: (model, card)."""
    folder = Path(name_or_path)
    if not folder.is_dir():
        folder = CHECKPOINTS / str(name_or_path)
    if not checkpoint.is_checkpoint(folder):
        raise ValueError(f"no Match3 checkpoint {str(name_or_path)!r}: bundled ones are "
                         f"{sorted(p.name for p in CHECKPOINTS.glob('match3-*'))}, or give a folder")
    return checkpoint.load_model(folder), checkpoint.load_card(folder)


def card_markdown(card: dict) -> str:
    lines = [f"# {card['name']}", "", card["description"], "",
             f"* attention: {card['attention']}; parameters: {card['parameters']:,}",
             f"* trained with: `{card['command']}` ({card['steps']} steps of {card['batch_size']} sequences, "
             f"{card['train_seconds']:.0f} s on {card['device']})",
             f"* label accuracy (teacher-forced, {card['eval_sequences']} fresh sequences of {N_NUMBERS} numbers): "
             f"**{card['accuracy']:.3f}**; greedy decoding: {card['greedy_accuracy']:.3f}; "
             f"majority-per-position baseline: {card['baseline']:.3f}",
             "", "Training curve (step, loss, accuracy on 500 sequences):", ""]
    lines += [f"    {h['step']:5d}  {h['loss']:.4f}  {h['accuracy']:.3f}" for h in card["history"]]
    return "\n".join(lines) + "\n"


def evaluate(model: Transformer, n_seq: int = 2000, seed: int = 10**6) -> dict:
    xs = torch.tensor([random_numbers(N_NUMBERS, random.Random(seed + i)) for i in range(n_seq)])
    truth = torch.tensor([labels(x.tolist()) for x in xs])
    greedy = greedy_labels(model, xs)
    return {"accuracy": accuracy(model, n_seq=n_seq, seed=seed),
            "greedy_accuracy": float((greedy == truth).float().mean()), "eval_sequences": n_seq}


def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(prog="python -m methods.tensor_attention.match3", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a tiny Match3 model and save it as a checkpoint folder")
    t.add_argument("--attention", choices=["tensor", "standard"], required=True,
                   help="tensor attention (pairs of tokens) or standard attention of the same size")
    t.add_argument("--out", required=True, help="checkpoint folder to write (new or empty; see --force)")
    t.add_argument("--force", action="store_true", help="replace the checkpoint files already in --out")
    t.add_argument("--steps", type=cli.positive_int, default=3000, help="optimiser steps (default 3000)")
    t.add_argument("--batch-size", type=cli.positive_int, default=128, help="sequences per step (default 128)")
    t.add_argument("--lr", type=cli.positive_float, default=3e-3, help="peak learning rate (default 3e-3)")
    t.add_argument("--seed", type=cli.non_negative_int, default=0, help="seed of the init and the data")
    t.add_argument("--eval-sequences", type=cli.positive_int, default=2000,
                   help="fresh sequences the card's accuracy is measured on (default 2000)")
    e = sub.add_parser("eval", help="measure the accuracy of checkpoints (bundled names or folders)")
    e.add_argument("checkpoints", nargs="+", help="match3-tensor, match3-standard, or checkpoint folders")
    e.add_argument("--sequences", type=cli.positive_int, default=2000, help="fresh sequences (default 2000)")
    args = p.parse_args(argv)
    with cli.errors(args.debug):
        if args.cmd == "train":
            def holds_checkpoint(f):
                return args.force and checkpoint.is_checkpoint(f)
            out = cli.output_folder(args.out, "--out", may_hold=holds_checkpoint)
            start = time.time()
            model, history = train(args.attention, args.steps, args.batch_size, args.lr, args.seed,
                                   log=tqdm.write)
            seconds = time.time() - start
            card = {"name": f"match3-{args.attention}", "attention": args.attention,
                    "description": f"A {args.attention}-attention decoder trained on causal Match3 "
                                   f"(methods/tensor_attention/match3.py), numbers mod {M}, "
                                   f"{N_NUMBERS} numbers per sequence.",
                    "parameters": model.num_params(), "steps": args.steps, "batch_size": args.batch_size,
                    "lr": args.lr, "seed": args.seed, "train_seconds": seconds,
                    "device": f"CPU, {torch.get_num_threads()} threads",
                    "command": "python -m methods.tensor_attention.match3 "
                               + " ".join(argv if argv is not None else sys.argv[1:]),
                    "history": history, "baseline": majority_baseline(),
                    **evaluate(model, n_seq=args.eval_sequences)}
            save(model, out, card)
            print(f"saved {out}: accuracy {card['accuracy']:.3f} (baseline {card['baseline']:.3f})")
        else:
            baseline = majority_baseline()
            for name in args.checkpoints:
                model, card = load(name)
                r = evaluate(model, n_seq=args.sequences)
                print(f"{name}: {card['attention']} attention, {model.num_params():,} parameters, accuracy "
                      f"{r['accuracy']:.3f}, greedy {r['greedy_accuracy']:.3f}, baseline {baseline:.3f}")


if __name__ == "__main__":
    main()
