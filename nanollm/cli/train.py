"""
Train a small retrieval model on the synthetic tasks: ``python -m nanollm.cli.train --help``.

What makes tiny models learn retrieval: a warm-up and a moderate peak learning rate, dense supervision (a loss
on every answer token plus a small language-modelling loss on the rest), and a short-to-long curriculum whose
stages end early once solved. Each batch has one length, from the current stage, and about
``tokens_per_step`` tokens. State is saved every ``save_every`` steps and ``--resume`` continues from it bit
for bit (sample seeds derive from the step number). An existing run needs ``--resume`` or ``--force``, every
file is replaced atomically, and a run that fails before its first save removes what it created.

Details: nanollm/inside.md, section "cli/train.py: training a retrieval model".
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .. import cli
from ..config import preset
from ..data.tasks import TASKS, corpus, make_sample
from ..io import files
from ..io.tokenizer import Tokenizer
from ..model import Transformer


@dataclass
class TrainConfig:
    preset: str = "SMALL"                  # model preset from nanollm.config.PRESETS
    model_overrides: dict = field(default_factory=dict)
    tasks: list = field(default_factory=lambda: list(TASKS))
    # curriculum: [max steps, min length, max length, accuracy that ends the stage early, (tasks)]; a stage
    # trains on its own task list when it has one, else on ``tasks``
    stages: list = field(default_factory=lambda: [
        [1800, 128, 192, 0.9, ["copy", "niah_single_noise", "niah_single_prose", "niah_single_needle"]],
        [1000, 224, 512, 0.9], [700, 512, 832, 0.9], [1000, 832, 1024, 1.1]])
    tokens_per_step: int = 6144
    lr: float = 5e-4                       # peak; measured: 5e-4 learned, 2e-3 got stuck
    min_lr: float = 6e-5
    warmup: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    lm_loss_weight: float = 0.3            # weight of next-token loss outside the answers
    eval_every: int = 250
    eval_samples: int = 8                  # per task, teacher-forced exact match at the stage's max length
    save_every: int = 100
    tokenizer_corpus_bytes: int = 1_000_000
    seed: int = 0

    @property
    def total_steps(self) -> int:
        return sum(s[0] for s in self.stages)


TRAIN_PRESETS = {
    # The bundled model. Stage 0: short samples, many per step, single needles and a copying aid (induction
    # heads form here, after a plateau of ~800 steps); then all tasks at growing lengths.
    "retrieval-llama": TrainConfig(),
    # continue a trained model (--init) on every task at every length, at a lower learning rate
    "retrieval-llama-more": TrainConfig(stages=[[2500, 224, 1024, 1.1]], lr=3e-4, warmup=100),
    # continue again (--init), aimed at what is still unsolved: a short stage weighted toward variable
    # tracking (with 1- and 2-hop chains as stepping stones), common words, multi-query and needle
    # distractors; then every task at every length, the hard ones drawn twice as often
    "retrieval-llama-hard": TrainConfig(
        stages=[[3500, 224, 448, 1.1, ["vt:n_hops=1", "vt:n_hops=2", "vt", "cwe", "cwe", "niah_multiquery",
                                       "niah_multiquery", "niah_single_needle", "niah_multikey",
                                       "niah_multivalue", "niah_single_prose", "copy"]],
                [7500, 224, 1024, 1.1, TASKS + ["vt", "cwe", "niah_multiquery", "niah_single_needle",
                                                "niah_multivalue"]]],
        lr=4e-4, warmup=200, min_lr=3e-5),
    # a last, lower-rate pass at full lengths weighted toward needles among needle-shaped distractors
    "retrieval-llama-needle": TrainConfig(
        stages=[[2000, 512, 1024, 1.1, TASKS + ["niah_single_needle"] * 3 + ["vt", "niah_multiquery"]]],
        lr=1.5e-4, warmup=100, min_lr=2e-5),
    # a few seconds on a laptop: the tiny training run of the tests
    "tiny": TrainConfig(preset="TINY", tasks=["niah_single_noise", "niah_multikey"], stages=[[4, 200, 256, 1.1]],
                        tokens_per_step=512, warmup=2,
                        eval_every=2, eval_samples=1, save_every=2, tokenizer_corpus_bytes=50_000),
}


MAX_LR = 1.0      # the largest --lr taken: AdamW moves every weight by about lr a step, and weights start at ~0.02;
                  # far above it (1e300) AdamW's step size does not fit a float32 (a traceback from the optimizer)


def step_memory(cfg: TrainConfig) -> int:
    """Bytes that one optimizer step needs at least: the logits of its ``tokens_per_step`` tokens over the
    vocabulary and their gradient, in float32 (the activations of the layers come on top). ``--tokens-per-step``
    is checked against the machine's memory with it before any work: a trillion would grow the first batch
    until memory runs out."""
    return cfg.tokens_per_step * preset(cfg.preset, **cfg.model_overrides).vocab_size * 4 * 2


def seed(text: str) -> int:
    """``--seed``: an integer that ``torch.manual_seed`` takes, from -2**63 to 2**64 - 1."""
    try:
        value = int(text)
    except ValueError:                         # not an integer, or one of more than 4300 digits
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r:.40}") from None
    if not -2**63 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be from -2**63 to 2**64 - 1 (what torch.manual_seed takes), "
                                         f"got {text:.40}")
    return value


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at the last planned step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.total_steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def parse_task(entry: str) -> tuple[str, dict]:
    """A mixture entry: a task name, optionally with integer options: "niah_multiquery:n_keys=8,n_queries=8"."""
    name, _, opts = entry.partition(":")
    options = {}
    for kv in filter(None, opts.split(",")):
        k, _, v = kv.partition("=")
        options[k] = int(v)
    return name, options


def make_batch(tok: Tokenizer, tasks: list[str], length: int, n: int, seed: int):
    """n samples of random tasks, each at most ``length`` tokens, right-padded to one length.

    Returns ids (n, T), targets (n, T) (the next token, -100 where padded) and a bool mask of the answer
    positions (n, T): position t is an answer position when targets[t] is an answer token or the final
    end-of-text.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        name, options = parse_task(rng.choice(tasks))
        s = make_sample(name, tok, length, seed=rng.randrange(1 << 40), **options)
        seq = s.context_ids + s.question_ids + s.target_ids
        answer_start = len(s.context_ids) + len(s.question_ids)
        rows.append((seq, answer_start))
    T = max(len(seq) for seq, _ in rows) - 1
    ids = torch.full((n, T), tok.eot_id, dtype=torch.long)
    targets = torch.full((n, T), -100, dtype=torch.long)
    answer = torch.zeros((n, T), dtype=torch.bool)
    for i, (seq, a0) in enumerate(rows):
        seq_t = torch.tensor(seq)
        ids[i, :len(seq) - 1] = seq_t[:-1]
        targets[i, :len(seq) - 1] = seq_t[1:]
        answer[i, a0 - 1:len(seq) - 1] = True      # predicting answer token j happens at position j - 1
    return ids, targets, answer


def loss_fn(model: Transformer, ids, targets, answer, lm_weight: float):
    logits = model(ids)                                                  # (n, T, V)
    ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100)   # (n, T)
    valid = targets != -100
    ans_loss = ce[answer].mean()
    lm_loss = ce[valid & ~answer].mean() if (valid & ~answer).any() else ce.new_zeros(())
    exact = ((logits.argmax(-1) == targets) | ~answer).all(-1)         # every answer token right
    return ans_loss + lm_weight * lm_loss, ans_loss, exact.float().mean()


@torch.no_grad()
def quick_eval(model, tok, cfg: TrainConfig, tasks: list[str], length: int, seed: int) -> dict:
    """Teacher-forced exact match of the whole answer, per task (fast; equals greedy-decoding exact match)."""
    model.eval()
    out, device = {}, next(model.parameters()).device
    for task in tasks:
        ids, targets, answer = (t.to(device) for t in make_batch(tok, [task], length, cfg.eval_samples, seed))
        out[task] = float(loss_fn(model, ids, targets, answer, 0.0)[2])
    model.train()
    return out


RUN_FILES = ("train_config.json", "tokenizer.json", "state.pt", "log.jsonl")   # what a run folder holds


def config_diff(a: dict, b: dict) -> str:
    """The fields where two config dicts differ: "lr (0.0005 vs 0.001), seed (0 vs 1)"."""
    return ", ".join(f"{k} ({a.get(k)!r} vs {b.get(k)!r})" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


def check_run_folder(out: str | Path, cfg: TrainConfig, resume: bool = False, force: bool = False) -> None:
    """Raise ValueError unless ``out`` may be trained into: a new or empty folder, or a run of the same recipe
    with ``resume`` (continue it) or any run with ``force`` (start it over)."""
    out = Path(out)
    if resume and force:
        raise ValueError("--resume continues a run and --force starts it over: give one of them")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    found = [f for f in RUN_FILES if (out / f).exists()]
    if not found:
        if out.is_dir() and any(out.iterdir()):
            raise ValueError(f"--out {out} holds other files and no training run; give a new or empty folder")
        return
    if not (resume or force):
        raise ValueError(f"--out {out} already holds a training run ({', '.join(found)}): continue it with "
                         "--resume, start it over with --force, or give another --out")
    if resume and (out / "train_config.json").exists():
        saved = files.read_json(out / "train_config.json", "training recipe file")
        now = json.loads(json.dumps(dataclasses.asdict(cfg)))
        if saved != now:
            raise ValueError(f"--resume: the run in {out} has another recipe than this command, in "
                             f"{config_diff(saved, now)} (saved vs now); give the flags it was started with, "
                             "or --force to start over")


def check_init(init: str, cfg: TrainConfig) -> None:
    """Raise ValueError unless the checkpoint ``init`` has the recipe's model shape (its weights are not read)."""
    from ..io.checkpoint import load_config
    have, need = load_config(init), preset(cfg.preset, **cfg.model_overrides)
    if have != need:
        raise ValueError(f"--init {init}: its model differs from the recipe's ({cfg.preset}) in "
                         f"{config_diff(have.to_dict(), need.to_dict())} (checkpoint vs recipe)")


def saved_state(path: Path, mcfg, device: str) -> dict:
    """The state.pt of a run being resumed (``checkpoint.load_run_state``), its weights checked against the
    recipe's model (names and shapes) and for finite values: a broken state is one line, before any work."""
    from ..checks import check_finite_weights
    from ..io.checkpoint import load_run_state
    from ..io.hf import check_state
    st = load_run_state(path, device)
    check_state(mcfg, st["model"], path)
    check_finite_weights(st["model"], path)
    return st


def _log_lines_until(path: Path, step: int) -> list[str]:
    """The lines of a run's log up to ``step`` (a resumed run repeats the steps after its last save)."""
    lines = []
    for line in files.read_text(path, "training log", None).splitlines() if path.exists() else []:
        try:
            if json.loads(line)["step"] <= step:
                lines.append(line + "\n")
        except (ValueError, KeyError, TypeError):      # a line cut short by a crash
            pass
    return lines


def train(cfg: TrainConfig, out_dir: str | Path, device: str = "cpu", resume: bool = False,
          max_steps: int | None = None, quiet: bool = False, init: str | None = None,
          force: bool = False) -> Path:
    """Train (or resume) into ``out_dir``. Returns the path of the saved state. See the module docstring.

    ``out_dir`` must be new or empty, unless ``resume`` (continue the run there, which must have the same
    recipe ``cfg``) or ``force`` (delete the run there and start over).
    ``init``: start from the weights and tokenizer of a checkpoint (a bundled name or a folder) instead of a
    random init, with a fresh optimizer: how a later session continues a model whose run folder is gone.
    """
    out = Path(out_dir)
    check_run_folder(out, cfg, resume, force)
    resuming = resume and (out / "state.pt").exists()
    mcfg = preset(cfg.preset, **cfg.model_overrides)
    saved = saved_state(out / "state.pt", mcfg, device) if resuming else None     # broken: fail now
    if init is not None and not resuming:
        check_init(init, cfg)
    if force:
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
    # a run that fails before it has saved a state (a full disk, Ctrl-C, a bad --init) leaves nothing behind;
    # one that has saved a state keeps its folder, to be resumed
    with files.removed_on_failure(out, RUN_FILES, keep=(out / "state.pt").exists):
        out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        tok_path = out / "tokenizer.json"
        if resume and tok_path.exists():
            tok = Tokenizer.load(tok_path)
        elif init is not None:
            from ..io.checkpoint import load_tokenizer
            tok = load_tokenizer(init)
            tok.save(tok_path)
        else:
            tok = Tokenizer.train(corpus(cfg.tokenizer_corpus_bytes, seed=cfg.seed), mcfg.vocab_size)
            tok.save(tok_path)
        model = Transformer(mcfg).to(device)
        if init is not None and not resuming:
            from ..io.checkpoint import load
            start, _, _ = load(init)                   # its shape was checked above (check_init)
            model.load_state_dict(start.state_dict())
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
        # every task of every stage must fit the stage's shortest length: fail now, not hours in
        for n_steps, lo, hi, _, *stage_tasks in cfg.stages:
            for entry in (stage_tasks[0] if stage_tasks else cfg.tasks):
                name, options = parse_task(entry)
                make_sample(name, tok, lo, seed=0, **options)
        state_path = out / "state.pt"
        step, stage, stage_start, elapsed = 0, 0, 0, 0.0
        if saved is not None:
            model.load_state_dict(saved["model"])
            try:
                opt.load_state_dict(saved["opt"])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"{state_path}: opt does not fit the optimizer: {str(e)[:200]}") from None
            step, stage, stage_start, elapsed = (saved[k] for k in ("step", "stage", "stage_start", "elapsed"))
        files.atomic_write_text(out / "train_config.json", json.dumps(dataclasses.asdict(cfg), indent=1))
        # the log keeps the steps of the saved state; a resumed run writes the steps after it again
        files.atomic_write_text(out / "log.jsonl", "".join(_log_lines_until(out / "log.jsonl", step)))
        log = open(out / "log.jsonl", "a")

        def save():
            buffer = io.BytesIO()                  # serialised first: a failed write is then a plain OSError
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "stage": stage,
                        "stage_start": stage_start, "elapsed": elapsed, "model_config": mcfg.to_dict()}, buffer)
            files.atomic_write_bytes(state_path, buffer.getvalue())     # a crash never leaves half a file

        last = cfg.total_steps if max_steps is None else min(cfg.total_steps, max_steps)
        bar = tqdm(total=last, initial=step, disable=quiet, dynamic_ncols=True)
        model.train()
        t0 = time.time() - elapsed
        while step < last and stage < len(cfg.stages):
            n_steps, lo, hi, target_acc, *stage_tasks = cfg.stages[stage]
            tasks = stage_tasks[0] if stage_tasks else cfg.tasks
            rng = random.Random(f"{cfg.seed}/{step}")
            length = rng.randint(lo, hi)
            n = max(1, cfg.tokens_per_step // length)
            ids, targets, answer = make_batch(tok, tasks, length, n, seed=rng.randrange(1 << 40))
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            loss, ans_loss, acc = loss_fn(model, ids.to(device), targets.to(device), answer.to(device),
                                          cfg.lm_loss_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            step += 1
            elapsed = time.time() - t0
            bar.update(1)
            bar.set_postfix(stage=stage, len=length, ans_loss=f"{ans_loss.item():.3f}", acc=f"{acc.item():.2f}")
            record = {"step": step, "stage": stage, "length": length, "loss": loss.item(),
                      "ans_loss": ans_loss.item(), "acc": acc.item(), "lr": lr_at(step - 1, cfg), "time": elapsed}
            if step % cfg.eval_every == 0 or step - stage_start >= n_steps:
                record["eval"] = quick_eval(model, tok, cfg, tasks, hi, seed=10**9 + step)
                mean = sum(record["eval"].values()) / len(record["eval"])
                record["eval_mean"] = mean
                bar.write(f"step {step} stage {stage} (len {lo}-{hi}) eval exact-match {mean:.2f}: " +
                          " ".join(f"{k}={v:.2f}" for k, v in record["eval"].items()))
                if mean >= target_acc or step - stage_start >= n_steps:
                    stage, stage_start = stage + 1, step
                    record["advance"] = stage
            log.write(json.dumps(record) + "\n")
            log.flush()
            if step % cfg.save_every == 0:
                save()
        save()
        bar.close()
        log.close()
        return state_path


def main(argv: list[str] | None = None) -> None:
    ap = cli.ArgumentParser(
        prog="python -m nanollm.cli.train",
        description="Train a nanollm model on the synthetic long-context tasks (on CUDA where present, else the CPU). "
                    "Writes OUT/tokenizer.json, OUT/train_config.json, OUT/log.jsonl (one line per step) and a "
                    "resumable OUT/state.pt, saved every save_every steps of the recipe (100; 2 for 'tiny'); "
                    "--export writes a loadable checkpoint folder (weights, config, tokenizer) at the end.")
    ap.add_argument("--preset", default="retrieval-llama", choices=sorted(TRAIN_PRESETS),
                    help="training recipe (model preset, curriculum, learning rate). Default: %(default)s")
    ap.add_argument("--out", default="runs/retrieval-llama",
                    help="run folder: new or empty, or an earlier run with --resume or --force "
                         "(default %(default)s)")
    again = ap.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue the run in OUT from OUT/state.pt (started with the same recipe and flags); "
                            "a new or empty OUT starts a new run")
    again.add_argument("--force", action="store_true",
                       help="delete the run in OUT (state, log, tokenizer) and start over")
    ap.add_argument("--max-steps", type=cli.positive_int, default=None,
                    help="stop after this many optimizer steps in total, counting the steps of a resumed run "
                         "(default: the whole curriculum)")
    ap.add_argument("--lr", type=cli.positive_float, default=None,
                    help=f"peak learning rate, at least the recipe's final rate min_lr and at most {MAX_LR:g} "
                         "(default: the recipe's, 5e-4 for retrieval-llama)")
    ap.add_argument("--tokens-per-step", type=cli.positive_int, default=None,
                    help="tokens per optimizer step, at least the recipe's longest sample and at most what this "
                         "machine's memory holds (default: the recipe's, 6144 for retrieval-llama)")
    ap.add_argument("--seed", type=seed, default=None,
                    help="seed of the data, the init and the tokenizer, from -2**63 to 2**64 - 1 (default: the "
                         "recipe's, 0)")
    ap.add_argument("--device", type=cli.device, default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu or cuda (default: cuda when available, else cpu)")
    ap.add_argument("--threads", type=cli.threads_or_workers, default=None,
                    help="torch intra-op threads on CPU (default: torch's choice)")
    ap.add_argument("--init", default=None, metavar="CHECKPOINT",
                    help="start from this checkpoint's weights and tokenizer (bundled name or folder; its model "
                         "must have the recipe's shape), with a fresh optimizer (default: random init)")
    ap.add_argument("--export", default=None, metavar="DIR",
                    help="after training, write a checkpoint folder to DIR: new or empty, or a checkpoint "
                         "folder whose files are replaced (default: none)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        cfg = dataclasses.replace(TRAIN_PRESETS[args.preset])
        for name in ("lr", "tokens_per_step", "seed"):
            if getattr(args, name) is not None:
                setattr(cfg, name, getattr(args, name))
        if cfg.lr < cfg.min_lr:
            cli.fail(f"--lr {cfg.lr} is below the recipe's final learning rate min_lr={cfg.min_lr}")
        if cfg.lr > MAX_LR:
            cli.fail(f"--lr {cfg.lr:g} is above {MAX_LR:g}, the largest learning rate taken (the recipe's is "
                     f"{TRAIN_PRESETS[args.preset].lr:g})")
        longest = max(stage[2] for stage in cfg.stages)
        if cfg.tokens_per_step < longest:
            cli.fail(f"--tokens-per-step {cfg.tokens_per_step} is less than the recipe's longest samples "
                     f"({longest} tokens)")
        cli.check_fits(f"--tokens-per-step {cfg.tokens_per_step:,} (its logits alone)", step_memory(cfg))
        check_run_folder(args.out, cfg, args.resume, args.force)
        if args.init is not None and not (args.resume and (Path(args.out) / "state.pt").exists()):
            check_init(args.init, cfg)
        if args.export:
            from ..io.checkpoint import export_run, is_checkpoint
            if Path(args.export).resolve() == Path(args.out).resolve():
                cli.fail("--export must be another folder than --out (a run folder is not a checkpoint)")
            cli.output_folder(args.export, "--export", may_hold=is_checkpoint)
        if args.threads:
            torch.set_num_threads(args.threads)
        train(cfg, args.out, device=args.device, resume=args.resume, max_steps=args.max_steps, quiet=args.quiet,
              init=args.init, force=args.force)
        if args.export:
            export_run(args.out, args.export)
    if args.export:
        print(f"checkpoint written to {args.export}")


if __name__ == "__main__":
    main()
