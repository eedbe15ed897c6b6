"""
A peer check against kvpress: does our policy keep the very positions kvpress's press keeps, head by head?

    pip install -e .[peer]          # kvpress 0.5.5 (and the transformers 5.2.x it needs)
    python -m experiments.evaluation.peer_kvpress --out results/peer_kvpress.txt

Both sides read the same SmolLM2-135M GGUF file and prompt ids; our policy runs with kvpress's defaults
(``preset_options(spec, "kvpress")``) and the budget kvpress derives from its compression ratio. kvpress's
kept set is read off its press without changing it. The report counts the (sample, layer, KV head) triples
with identical sets and the answers that agree (``results/peer_kvpress.txt``). How, and why some differ:
``inside.md``, "peer_kvpress.py".
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from methods import make_policy
from methods.presets import preset_options
from nanollm import KVCache, cli, decode_step, prefill
from nanollm.cli.provenance import header, provenance
from nanollm.data.evaluate import answer_length
from nanollm.data.tasks import make_sample, string_match_all

KVPRESS_VERSION = "0.5.5"                 # the version methods/presets.py's "kvpress" preset follows
CHECKPOINT = "smollm2-135m"
DEFAULT_KEEP_RATIOS = [0.1, 0.25, 0.5]
DEFAULT_LENGTH = 512
DEFAULT_SAMPLES = 8
TASKS = ["passkey", "niah_single_docs"]    # the samples alternate between these two tasks

# Our method spec -> the name of kvpress's press doing the same (built by ``make_press``, at its defaults).
PEERS = {
    "snapkv": "SnapKVPress",
    "streaming_llm": "StreamingLLMPress",
    "adakv(snapkv)": "AdaKVPress(SnapKVPress)",
    "chunkkv(snapkv)": "ChunkKVPress(SnapKVPress)",
    "critical_kv(snapkv)": "CriticalKVPress(SnapKVPress)",
    "critical_kv(adakv(snapkv))": "CriticalAdaKVPress(SnapKVPress)",
}


def import_kvpress():
    """The kvpress module, or a one-line error saying how to install it."""
    try:
        import kvpress
    except ImportError as e:
        cli.fail(f"kvpress is not installed ({e}): pip install -e .[peer]")
    return kvpress


def kvpress_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kvpress")
    except PackageNotFoundError:
        return "unknown"


def make_press(kvpress, spec: str, ratio: float):
    """kvpress's press for our ``spec`` at ``compression_ratio=ratio``, every other setting at its default."""
    snap = kvpress.SnapKVPress(compression_ratio=ratio)
    if spec == "snapkv":
        return snap
    if spec == "streaming_llm":
        return kvpress.StreamingLLMPress(compression_ratio=ratio)
    if spec == "adakv(snapkv)":
        return kvpress.AdaKVPress(snap)
    if spec == "chunkkv(snapkv)":
        return kvpress.ChunkKVPress(snap)
    if spec == "critical_kv(snapkv)":
        return kvpress.CriticalKVPress(snap)
    if spec == "critical_kv(adakv(snapkv))":
        return kvpress.CriticalAdaKVPress(snap)
    raise ValueError(f"no kvpress peer for {spec!r}; choose one of {list(PEERS)}")


def kvpress_budget(n_prompt: int, keep: float) -> int:
    """Entries per KV head kvpress keeps of an ``n_prompt``-token prompt at keep ratio ``keep``: it is given
    ``compression_ratio = 1 - keep`` and keeps ``int(n_prompt * (1 - compression_ratio))`` (at least 1)."""
    return max(1, int(n_prompt * (1 - (1 - keep))))


# ---------------------------------------------------------------------------------------------------------
# kvpress's side: transformers reading the same GGUF file

def load_reference(gguf_path: str):
    """transformers' model for the GGUF file, fp32, eval mode, with the attention kvpress supports (sdpa)."""
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()                         # the GGUF conversion's bars
    folder, name = os.path.split(str(gguf_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    return model.eval()


def rows_kept(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """(H_kv, T) bool: which of ``before``'s key rows (1, H_kv, T, d) ``after`` (1, H_kv, K, d) holds. Each
    row of ``after`` must equal exactly one row of ``before`` in its head (a gather copies rows bit for bit)."""
    H, T = before.shape[1], before.shape[2]
    kept = torch.zeros(H, T, dtype=torch.bool)
    for h in range(H):
        same = (after[0, h][:, None, :] == before[0, h][None, :, :]).all(-1)          # (K, T)
        if not bool((same.sum(-1) == 1).all()):
            raise RuntimeError("a kept key row matches no original row, or several: cannot tell its position")
        kept[h, same.float().argmax(-1)] = True
    return kept


def record_kept(press, kept: dict) -> None:
    """Wrap ``press.compress`` (on this instance only) so that every layer's kept set lands in ``kept``."""
    compress = press.compress

    def compress_and_record(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = compress(module, hidden_states, keys, values, attentions, kwargs)
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None and new_keys.shape == keys.shape:          # AdaKV-style: masked, not pruned
            mask = torch.ones(keys.shape[1], keys.shape[2], dtype=torch.bool)
            batch, head, seq = (t.cpu() for t in masked)
            mask[head[batch == 0], seq[batch == 0]] = False
        else:
            mask = rows_kept(keys.cpu(), new_keys.cpu())
        kept[module.layer_idx] = mask
        return new_keys, new_values

    press.compress = compress_and_record


def greedy(logits: torch.Tensor, step, n_new: int, stop_id: int | None) -> list[int]:
    """Greedy answer ids from the prompt's last logits (V,): ``step(token, i)`` feeds the i-th answer token and
    returns the next logits; stops at ``stop_id`` (not included) or after ``n_new`` tokens. Both sides use it,
    so their answers differ only by what their caches hold."""
    out: list[int] = []
    for i in range(n_new):
        token = int(logits.argmax())
        if token == stop_id:
            break
        out.append(token)
        if i == n_new - 1:
            break
        logits = step(token, i)
    return out


@torch.no_grad()
def kvpress_run(hf_model, press, ids: torch.Tensor, n_new: int, stop_id: int | None):
    """Prefill ``ids`` (1, T) under ``press`` (None: no compression), then decode greedily as kvpress's
    pipeline does (positions continue from T whatever the cache holds). Returns (kept masks per layer,
    each (H_kv, T) bool, or None without a press; answer ids, up to and without ``stop_id``)."""
    from transformers import DynamicCache
    cache, kept = DynamicCache(), {}
    T = ids.shape[1]
    if press is None:
        logits = hf_model(input_ids=ids, past_key_values=cache).logits[0, -1]
    else:
        record_kept(press, kept)
        with press(hf_model):
            logits = hf_model(input_ids=ids, past_key_values=cache).logits[0, -1]
    out = greedy(logits, lambda token, i: hf_model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                                                   position_ids=torch.tensor([[T + i]])).logits[0, -1],
                 n_new, stop_id)
    masks = [kept[i] for i in range(len(kept))] if press is not None else None
    return masks, out


# ---------------------------------------------------------------------------------------------------------
# our side

@torch.no_grad()
def our_run(model, policy, ids: torch.Tensor, n_new: int, stop_id: int | None):
    """Prefill ``ids`` (1, T) with ``policy`` (None: the full cache), then decode greedily. Returns (kept
    masks per layer, (H_kv, T) bool, as the storage holds them right after the prefill; answer ids)."""
    cache = KVCache(model.config, policy)
    T = ids.shape[1]
    logits = prefill(model, ids, cache)[0, -1]
    masks = []
    for layer in cache.layers:
        pos = layer.pos[0]                                                # (H_kv, K), -1 = empty slot
        mask = torch.zeros(pos.shape[0], T + 1, dtype=torch.bool)
        mask.scatter_(1, torch.where(pos >= 0, pos, T).cpu(), True)      # empty slots land in column T
        masks.append(mask[:, :T])
    out = greedy(logits, lambda token, i: decode_step(model, torch.tensor([token]), cache)[0], n_new, stop_id)
    return masks, out


# ---------------------------------------------------------------------------------------------------------
# the comparison

@dataclass
class Tally:
    """One (method, keep ratio) cell, summed over samples."""
    heads: int = 0
    equal_heads: int = 0
    differences: list[int] = field(default_factory=list)     # |ours Δ kvpress| of each mismatching head
    mismatch_layers: dict[int, int] = field(default_factory=dict)   # layer -> mismatching heads there
    samples: int = 0
    equal_answers: int = 0
    acc_ours: float = 0.0
    acc_kvpress: float = 0.0
    kept_ours: int = 0                                        # entries kept, summed over heads
    kept_kvpress: int = 0

    def add_masks(self, ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
        for layer, (a, b) in enumerate(zip(ours, theirs)):
            diff = (a ^ b).sum(-1)                                       # (H_kv,)
            self.heads += diff.numel()
            self.equal_heads += int((diff == 0).sum())
            self.differences += [int(d) for d in diff if d > 0]
            if bool((diff > 0).any()):
                self.mismatch_layers[layer] = self.mismatch_layers.get(layer, 0) + int((diff > 0).sum())
            self.kept_ours += int(a.sum())
            self.kept_kvpress += int(b.sum())

    def add_answers(self, ours: list[int], theirs: list[int], acc_ours: float, acc_theirs: float) -> None:
        self.samples += 1
        self.equal_answers += int(ours == theirs)
        self.acc_ours += acc_ours
        self.acc_kvpress += acc_theirs

    @property
    def all_equal(self) -> bool:
        return self.heads > 0 and self.equal_heads == self.heads


def sample_plan(tasks: list[str], samples: int, seed: int) -> list[tuple[str, int]]:
    """(task, seed) of each sample: the tasks in turn, each with consecutive seeds from ``seed``."""
    return [(tasks[i % len(tasks)], seed + i // len(tasks)) for i in range(samples)]


def run(model, tok, hf_model, kvpress, specs: list[str], keeps: list[float], plan: list[tuple[str, int]],
        length: int, progress=None) -> dict:
    """Every (spec, keep) cell over the samples of ``plan``, plus ("full", None) comparing the two models
    without compression. Returns {(spec, keep): Tally}."""
    tallies: dict = {("full", None): Tally()}
    for n, (task, seed) in enumerate(plan):
        sample = make_sample(task, tok, length, seed=seed)
        ids = torch.tensor([sample.prompt_ids])
        T, n_new, stop = ids.shape[1], answer_length(model, sample), tok.eot_id

        def acc(answer: list[int]) -> float:
            return string_match_all(tok.decode(answer), sample.answers)

        _, ours = our_run(model, None, ids, n_new, stop)
        _, theirs = kvpress_run(hf_model, None, ids, n_new, stop)
        tallies[("full", None)].add_answers(ours, theirs, acc(ours), acc(theirs))
        for spec in specs:
            for keep in keeps:
                budget = kvpress_budget(T, keep)
                policy = make_policy(spec, budget, **preset_options(spec, "kvpress"))
                our_masks, ours = our_run(model, policy, ids, n_new, stop)
                press = make_press(kvpress, spec, 1 - keep)
                their_masks, theirs = kvpress_run(hf_model, press, ids, n_new, stop)
                tally = tallies.setdefault((spec, keep), Tally())
                tally.add_masks(our_masks, their_masks)
                tally.add_answers(ours, theirs, acc(ours), acc(theirs))
        if progress is not None:
            progress(f"sample {n + 1}/{len(plan)} ({task}, seed {seed}, {T} prompt tokens) done")
    return tallies


def format_report(tallies: dict, n_layers: int) -> str:
    """The table: one line per (method, keep ratio)."""
    lines = [f"{'method (ours)':<27} {'kvpress press':<32} {'keep':>5} {'heads equal':>13} "
             f"{'diff median/max':>15} {'kept ours/kvp':>14} {'answers equal':>13} {'acc ours/kvp':>13}"]
    for (spec, keep), t in tallies.items():
        peer = PEERS.get(spec, "(no press)")
        keep_s = f"{keep:g}" if keep is not None else "-"
        heads = f"{t.equal_heads}/{t.heads}" if t.heads else "-"
        diff = f"{statistics.median(t.differences):g}/{max(t.differences)}" if t.differences else "-"
        kept = f"{t.kept_ours / t.heads:.1f}/{t.kept_kvpress / t.heads:.1f}" if t.heads else "-"
        answers = f"{t.equal_answers}/{t.samples}"
        accs = f"{t.acc_ours / t.samples:.2f}/{t.acc_kvpress / t.samples:.2f}"
        lines.append(f"{spec:<27} {peer:<32} {keep_s:>5} {heads:>13} {diff:>15} {kept:>14} {answers:>13} {accs:>13}")
    lines.append("")
    lines.append("heads equal: (sample, layer, KV head) triples whose kept prompt positions are the same set; "
                 "diff: positions in one set and not the other (both ways) over the mismatching heads; kept: "
                 "mean entries kept per head; answers equal: identical greedy answer ids; acc: string_match_all.")
    mismatched = [(spec, keep, t) for (spec, keep), t in tallies.items() if t.heads and not t.all_equal]
    for spec, keep, t in mismatched:
        where = ", ".join(f"{layer}:{n}" for layer, n in sorted(t.mismatch_layers.items()))
        lines.append(f"  {spec} keep {keep:g}: mismatching heads per layer (of {n_layers}) {where}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = cli.ArgumentParser(
        prog="python -m experiments.evaluation.peer_kvpress",
        description="Compare our methods, at kvpress's defaults (the kvpress preset of methods.presets), with "
                    "kvpress's presses on SmolLM2-135M: the prompt positions kept per layer and KV head, and the "
                    "greedy answers. "
                    f"Needs kvpress {KVPRESS_VERSION}: pip install -e .[peer]")
    ap.add_argument("--out", type=cli.output_file, required=True, metavar="PATH",
                    help="text file the report is written to (it is also printed)")
    ap.add_argument("--samples", type=cli.positive_int, default=DEFAULT_SAMPLES,
                    help="prompts in all, taking the model's default task suite in turn (passkey, "
                         "niah_single_docs), question in the prompt (default %(default)s)")
    ap.add_argument("--keep-ratios", nargs="+", type=float, default=DEFAULT_KEEP_RATIOS, metavar="R",
                    help="fractions of the prompt kept, each in (0, 1): kvpress gets compression_ratio 1 - R and "
                         "our policy the budget int(T * R) of a T-token prompt, as kvpress counts it "
                         f"(default {' '.join(map(str, DEFAULT_KEEP_RATIOS))})")
    ap.add_argument("--length", type=int, default=DEFAULT_LENGTH,
                    help="tokens per sample, context + question + answer; the prompt must be longer than "
                         "SnapKV's 64-token window (default %(default)s)")
    ap.add_argument("--methods", nargs="+", default=list(PEERS), choices=list(PEERS), metavar="METHOD",
                    help=f"our method specs to check, each against its press: {', '.join(PEERS)} (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first sample of each task (default %(default)s)")
    ap.add_argument("--threads", type=cli.threads_or_workers, default=1,
                    help="torch CPU threads, at most the CPU cores (default %(default)s)")
    args = ap.parse_args(argv)

    with cli.errors(args.debug):
        cli.check_outputs({"--out": args.out}, inputs=[CHECKPOINT])
        if any(not 0 < r < 1 for r in args.keep_ratios):
            cli.fail(f"--keep-ratios must lie strictly between 0 and 1, got {args.keep_ratios}")
        from nanollm.io import fetch
        from nanollm.io.checkpoint import load, load_config, load_tokenizer
        if not fetch.is_fetched(CHECKPOINT):
            cli.fail(f"{CHECKPOINT} is not fetched: python -m nanollm.cli.fetch {CHECKPOINT}")
        config, tok = load_config(CHECKPOINT), load_tokenizer(CHECKPOINT)
        if not 0 < args.length <= config.max_seq_len:
            cli.fail(f"--length must be in [1, {config.max_seq_len}], got {args.length}")
        tasks = TASKS
        plan = sample_plan(tasks, args.samples, args.seed)
        for task, seed in plan[:len(tasks)]:
            try:
                n_prompt = len(make_sample(task, tok, args.length, seed=seed).prompt_ids)
            except ValueError as e:
                cli.fail(f"--length {args.length}: {e}")
            if n_prompt <= 64:
                cli.fail(f"--length {args.length}: a {task} prompt has {n_prompt} tokens, not more than "
                         "SnapKV's 64-token window (kvpress refuses it)")
        kvpress = import_kvpress()
        import transformers

        torch.set_num_threads(args.threads)
        t0 = time.time()
        model, tok, _ = load(CHECKPOINT)
        hf_model = load_reference(fetch.target(CHECKPOINT))
        prov = provenance(argv, prog=ap.prog, threads=args.threads, dtype="float32", seed=args.seed)
        head = (header(prov) + f"\n# peers: kvpress {kvpress_version()}, transformers {transformers.__version__}"
                f"\n# {CHECKPOINT}, tasks {', '.join(tasks)}, {args.samples} samples, {args.length} tokens, "
                "question in the prompt; our options: preset kvpress ("
                + "; ".join(f"{s}: " + (", ".join(f"{k}={v}" for k, v in preset_options(s, 'kvpress').items())
                                        or "defaults") for s in args.methods) + ")")
        print(head, flush=True)

        def progress(message: str) -> None:
            print(f"  {message} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)

        tallies = run(model, tok, hf_model, kvpress, args.methods, args.keep_ratios, plan, args.length, progress)
        report = format_report(tallies, config.n_layer)
        footer = f"\n{args.samples} samples, {time.time() - t0:.0f} s."
        print(report + footer)
        from nanollm.io.files import atomic_write_text
        atomic_write_text(args.out, head + "\n\n" + report + footer + "\n")
        print(f"report written to {args.out}")


if __name__ == "__main__":
    main()
