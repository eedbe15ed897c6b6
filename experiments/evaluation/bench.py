"""
What compression buys at decode time: one decode step with a compressed cache against the full cache, at
long contexts. ``python -m experiments.evaluation.bench --help``.

A long-context step is bound by the bytes of keys and values it reads, so a method keeping a fraction r of
them is at best 1 / r times faster (the *ideal* speedup); the fixed cost of a step and a method's own work
keep it below that (the *bound* and *of bound* columns). The cache is filled directly with random entries
and each method compresses it with its real prefill hook, so this measures speed, not which tokens are
kept; every variant of one context is timed interleaved, medians reported, and the read bandwidth is
measured in the same run. How it works: ``inside.md``, "bench.py".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from experiments.bench import decode_weight_bytes, read_bandwidth
from methods import METHODS, make_policy, method_chain
from nanollm import cli
from nanollm.cache import KVCache
from nanollm.cli.provenance import provenance
from nanollm.cli.timing import elapsed_s
from nanollm.config import ModelConfig
from nanollm.generation import decode_step, prefill
from nanollm.io import files
from nanollm.model import Transformer
from nanollm.policy import CachePolicy, StepContext

from . import budget_for

DEFAULT_CONTEXTS = [4096, 8192, 16384, 32768]
DEFAULT_KEEP_RATIOS = [0.1, 0.25]
PREFILL_METHODS = ["full", "snapkv", "h2o"]     # "full" = the plain cache
PREFILL_KEEP_RATIO = 0.1
FIXED_COST_CONTEXT = 64        # tokens in the cache when the fixed cost of a step is measured
MiB = 2 ** 20


def bench_config(max_seq_len: int) -> ModelConfig:
    """A model whose decode step is dominated by K/V bytes at long contexts: 2 layers, 8 KV heads of 32
    dimensions (4 KiB of K/V per token, 128 MiB at 32k tokens) against ~6.6 MB of weights."""
    return ModelConfig(flavour="llama", vocab_size=256, n_layer=2, d_model=256, n_head=8, n_kv_head=8,
                       max_seq_len=max_seq_len)


@dataclass(frozen=True)
class BenchCase:
    """What one cache runs: the plain full cache (``keep_ratio`` None) or a method at a keep ratio."""

    method: str                         # a method spec, or "full" with keep_ratio None: the plain cache
    keep_ratio: float | None = None

    def policy(self, context: int) -> CachePolicy | None:
        return None if self.keep_ratio is None else make_policy(self.method, budget_for(self.keep_ratio, context))


@dataclass
class Row:
    """One variant at one context: the measurements, and the cache they were taken on (not recorded)."""

    context: int
    method: str
    keep_ratio: float | None
    budget: int | None
    status: str = "ok"                  # "ok", "error" (it raised: see note), "skipped" (too slow: see note)
    note: str = ""
    compress_ms: float | None = None    # the on_prefill hooks of every layer, once
    step_ms_all: list[float] = field(default_factory=list)   # every timed decode step
    kv_bytes: int | None = None         # storage bytes when a step's attention runs, all layers
    attended_bytes: int | None = None   # bytes of the entries attended (more when a method rebuilds entries)
    slot_bytes: int | None = None       # K/V slots the policy keeps outside the storage (a sketch's cells)
    entries_per_head: float | None = None   # occupied slots per layer and KV head at that moment (mean)
    cache: KVCache | None = field(default=None, repr=False)

    @property
    def step_ms(self) -> float | None:
        return statistics.median(self.step_ms_all) if self.step_ms_all else None

    def fail(self, status: str, note: str) -> None:
        self.status, self.note, self.cache = status, note, None


# ----------------------------------------------------------------------------------------------------------
# A long cache without a prefill, compressed the way a prompt's prefill compresses it

def random_entries(config: ModelConfig, context: int, gen: torch.Generator) -> list[tuple[Tensor, Tensor]]:
    """Random keys and values of ``context`` tokens for every layer, each (1, H_kv, T, d)."""
    shape = (1, config.n_kv_head, context, config.head_dim)
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(config.n_layer)]


def filled_cache(config: ModelConfig, entries: list[tuple[Tensor, Tensor]], policy: CachePolicy | None) -> KVCache:
    """A cache that has seen T tokens: ``entries`` appended to every layer at positions 0..T-1."""
    cache = KVCache(config, policy)                 # a new cache resets the policy
    context = entries[0][0].shape[2]
    pos = torch.arange(context)                                             # (T,)
    for store, (k, v) in zip(cache.layers, entries):
        store.append(k, v, pos)                     # copied into the storage's own buffers: dense, T slots
    cache.seen = context
    return cache


def random_queries(config: ModelConfig, n_queries: int, gen: torch.Generator) -> list[Tensor]:
    """One set of W random query rows per layer, each (1, H, W, d): the stand-in for a prompt's last rows."""
    shape = (1, config.n_head, n_queries, config.head_dim)
    return [torch.randn(shape, generator=gen) for _ in range(config.n_layer)]


@torch.no_grad()
def compress_as_prefill(model: Transformer, cache: KVCache, queries: list[Tensor]) -> float:
    """Run the policy's ``on_prefill`` hook on every layer of a filled cache; return the hooks' total ms.

    Per layer, as ``KVCache.attend`` does at a prefill: the entries the policy lets the queries see
    (``attend_kv``), their attention with the statistics the policy declares (``needs("prefill")``), a
    ``StepContext``, the hook. The queries are the W rows at positions T-W..T-1 (``queries[layer]``,
    (1, H, W, d)); with W < T attention takes its general masked path. Only the hooks are timed.
    """
    policy, T = cache.policy, cache.seen
    needs = policy.needs("prefill")
    hooks_s = 0.0
    for layer, (store, q) in enumerate(zip(cache.layers, queries)):
        module = model.blocks[layer].attn
        q_pos = torch.arange(T - q.shape[2], T)                              # (W,)
        entries = policy.attend_kv(layer, store)
        attended_pos = entries.pos
        out, probs, col_sums = module.attend_entries(q, entries, q_pos, needs)   # (1, H, W, d), ...
        ctx = StepContext(layer=layer, phase="prefill", q=q, q_pos=q_pos, probs=probs, out=out, kv=store,
                          attn=module, config=cache.config, seen=T, attended_pos=attended_pos,
                          col_sums=col_sums)
        t0 = time.perf_counter()
        policy.on_prefill(ctx)
        hooks_s += time.perf_counter() - t0
    return hooks_s * 1e3


# ----------------------------------------------------------------------------------------------------------
# Decode steps: timing, and the bytes a step reads

def timed_step(model: Transformer, cache: KVCache, token: Tensor) -> float:
    """ms of one ``decode_step`` (the policy's decode hooks included); token (1,)."""
    return elapsed_s(lambda: decode_step(model, token, cache), token.device)[0] * 1e3


@contextmanager
def attention_probe(model: Transformer, cache: KVCache):
    """While active, every layer's attention over ``cache`` appends (storage bytes, attended bytes, occupied
    slots per KV head) to the yielded list, read at the moment it attends (after the step's new entry is
    stored, before any eviction)."""
    seen: list[tuple[int, int, float]] = []
    modules = [block.attn for block in model.blocks]
    for module in modules:
        def probe(q, entries, q_pos, *rest, _module=module, _attend=module.attend_entries):
            store = cache.layers[_module.layer_idx]
            seen.append((store.nbytes(), entries.nbytes(), store.counts().float().mean().item()))
            return _attend(q, entries, q_pos, *rest)
        module.attend_entries = probe               # an instance attribute shadows the class's method
    try:
        yield seen
    finally:
        for module in modules:
            del module.attend_entries


def count_bytes(model: Transformer, row: Row, token: Tensor) -> None:
    """One more (untimed) decode step of ``row.cache`` with the probe: fills the row's byte counts."""
    with attention_probe(model, row.cache) as seen:
        decode_step(model, token, row.cache)
    row.kv_bytes = sum(s[0] for s in seen)
    row.attended_bytes = sum(s[1] for s in seen)
    row.slot_bytes = row.cache.policy.slot_nbytes() if row.cache.policy is not None else 0
    row.entries_per_head = sum(s[2] for s in seen) / len(seen)


# ----------------------------------------------------------------------------------------------------------
# One context length: every variant built, compressed, then timed interleaved

def error_note(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def build_rows(model: Transformer, config: ModelConfig, context: int, variants: list[BenchCase],
               prompt_queries: int, gen: torch.Generator, time_limit_s: float, bar) -> list[Row]:
    """A filled cache per variant (the same random K/V and queries for all), compressed by its method's
    prefill hooks."""
    entries, queries = random_entries(config, context, gen), random_queries(config, prompt_queries, gen)
    rows = []
    for v in variants:
        budget = None if v.keep_ratio is None else budget_for(v.keep_ratio, context)
        row = Row(context, v.method, v.keep_ratio, budget)
        try:
            row.cache = filled_cache(config, entries, v.policy(context))
            if row.cache.policy is not None:
                row.compress_ms = compress_as_prefill(model, row.cache, queries)
                if row.compress_ms > time_limit_s * 1e3:
                    row.note = f"compression took {row.compress_ms / 1e3:.1f} s > --time-limit"
        except Exception as e:                     # a method's failure is a result: reported, not hidden
            row.fail("error", error_note(e))
        rows.append(row)
        bar.update(1)
    return rows


def time_steps(model: Transformer, config: ModelConfig, rows: list[Row], warmup: int, steps: int,
               gen: torch.Generator, time_limit_s: float, bar) -> None:
    """``warmup`` + ``steps`` decode steps of every live row, interleaved: step i of every row, in an order
    rotated by one each round, before step i + 1 of any. Fills ``row.step_ms_all`` with the timed ones."""
    for i in range(warmup + steps):
        token = torch.randint(0, config.vocab_size, (1,), generator=gen)
        for j in range(len(rows)):
            row = rows[(i + j) % len(rows)]
            bar.update(1)
            if row.cache is None:
                continue
            try:
                ms = timed_step(model, row.cache, token)
            except Exception as e:
                row.fail("error", error_note(e))
                continue
            if i >= warmup:
                row.step_ms_all.append(ms)
            if ms > time_limit_s * 1e3:
                row.fail("skipped", f"stopped after {i + 1} steps: one took {ms / 1e3:.1f} s > --time-limit")


def bench_context(model: Transformer, config: ModelConfig, context: int, variants: list[BenchCase],
                  prompt_queries: int, warmup: int, steps: int, seed: int, time_limit_s: float,
                  bar=None) -> tuple[list[Row], float | None]:
    """Every variant at one context: compression cost, decode step times, bytes read per step; and the
    fixed cost of a step (median ms of the full cache over ``FIXED_COST_CONTEXT`` tokens, timed in the same
    interleaved rounds). The rows keep their caches (``row.cache``) for inspection; drop them to free the
    memory."""
    bar = bar if bar is not None else tqdm(disable=True)
    gen = torch.Generator().manual_seed(seed + context)
    rows = build_rows(model, config, context, variants, prompt_queries, gen, time_limit_s, bar)
    fixed = Row(FIXED_COST_CONTEXT, "full", None, None)
    fixed.cache = filled_cache(config, random_entries(config, FIXED_COST_CONTEXT, gen), None)
    time_steps(model, config, rows + [fixed], warmup, steps, gen, time_limit_s, bar)
    token = torch.randint(0, config.vocab_size, (1,), generator=gen)
    for row in rows:
        if row.cache is not None:
            try:
                count_bytes(model, row, token)
            except Exception as e:
                row.fail("error", error_note(e))
        bar.update(1)
    return rows, fixed.step_ms


# ----------------------------------------------------------------------------------------------------------
# Memory at a real prefill, each variant in a fresh process

def proc_status_kib(name: str) -> int | None:
    """A ``VmRSS`` / ``VmHWM`` line of ``/proc/self/status`` in KiB; None without /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current resident size (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def prefill_memory(config: ModelConfig, method: str, context: int, seed: int) -> dict:
    """A real prefill of ``context`` random tokens; wall time and peak resident memory beyond the cache.

    baseline = resident size once the model and the ids exist; peak = VmHWM after the prefill (reset to
    the baseline first where Linux allows); beyond = peak - baseline - bytes of the cache's buffers
    (``LayerKV.allocated_nbytes``). Meant to run alone in a fresh process.
    """
    torch.manual_seed(seed)
    model = Transformer(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, context), generator=torch.Generator().manual_seed(seed))
    keep_ratio = None if method == "full" else PREFILL_KEEP_RATIO
    policy = None if keep_ratio is None else make_policy(method, budget_for(keep_ratio, context))
    cache = KVCache(config, policy)
    peak_reset = reset_peak_rss()
    baseline = proc_status_kib("VmRSS")
    t0 = time.perf_counter()
    logits = prefill(model, ids, cache)                                         # (1, T, vocab)
    wall_s = time.perf_counter() - t0
    peak = proc_status_kib("VmHWM")
    cache_bytes = sum(layer.allocated_nbytes() for layer in cache.layers)
    result = {"method": method, "keep_ratio": keep_ratio, "context": context, "wall_s": wall_s,
              "cache_bytes": cache_bytes, "logits_bytes": logits.nbytes, "peak_reset": peak_reset,
              "baseline_bytes": None, "peak_bytes": None, "beyond_bytes": None}
    if baseline is not None and peak is not None:
        result.update(baseline_bytes=baseline * 1024, peak_bytes=peak * 1024,
                      beyond_bytes=(peak - baseline) * 1024 - cache_bytes)
    return result


def _prefill_child(conn, config: dict, method: str, context: int, threads: int, seed: int) -> None:
    try:
        torch.set_num_threads(threads)
        result = prefill_memory(ModelConfig.from_dict(config), method, context, seed)
    except BaseException as e:                    # sent back as a result: the parent reports it
        result = {"method": method, "context": context, "error": error_note(e)}
    conn.send(result)
    conn.close()


def prefill_memory_in_subprocess(config: ModelConfig, method: str, context: int, threads: int, seed: int) -> dict:
    """``prefill_memory`` in a fresh (spawned) process, so that no earlier allocation hides its peak."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_prefill_child, args=(send, config.to_dict(), method, context, threads, seed))
    child.start()
    send.close()                                   # ours: recv() then ends with EOFError if the child dies
    try:
        result = receive.recv()
    except EOFError:
        result = None
    child.join()
    if result is None:                             # it died before sending anything
        code = child.exitcode
        why = (f"killed by signal {-code}" + (" (SIGKILL: out of memory?)" if code == -9 else "")
               if code is not None and code < 0 else f"exited with status {code} (its stderr is above)")
        result = {"method": method, "context": context, "error": f"the subprocess died: {why}"}
    return result


# ----------------------------------------------------------------------------------------------------------
# The whole run and its derived numbers

def row_record(row: Row, full: Row | None, fixed_ms: float | None, weight_bytes: int = 0) -> dict:
    """A row as recorded: the measurements plus GB/s, measured, ideal and bound speedups. ``ideal_bytes_speedup``
    counts the weights a step reads too: (weights + full K/V) / (weights + the K/V it reads)."""
    rec = {k: getattr(row, k) for k in ("context", "method", "keep_ratio", "budget", "status", "note",
                                        "compress_ms", "step_ms", "step_ms_all", "kv_bytes", "attended_bytes",
                                        "slot_bytes", "entries_per_head")}
    rec["fixed_ms"] = fixed_ms
    # what a step's attention reads: the entries it attends (a method that rebuilds entries attends more
    # than it stores)
    read = rec["read_bytes"] = row.attended_bytes if row.attended_bytes is not None else row.kv_bytes
    ms = row.step_ms
    rec["gb_per_s"] = read / ms / 1e6 if ms and read is not None else None
    rec["ideal_speedup"] = 1.0 / row.keep_ratio if row.keep_ratio is not None else 1.0
    rec["speedup"] = rec["bound_speedup"] = rec["ideal_bytes_speedup"] = None
    if full is not None and full.kv_bytes and read is not None:
        rec["ideal_bytes_speedup"] = (weight_bytes + full.kv_bytes) / (weight_bytes + read)
    if full is not None and full.step_ms and ms and read is not None and full.kv_bytes \
            and fixed_ms is not None:
        rec["speedup"] = full.step_ms / ms
        per_byte = max(full.step_ms - fixed_ms, 0.0) / full.kv_bytes           # ms per K/V byte read
        rec["bound_speedup"] = full.step_ms / (min(fixed_ms, full.step_ms) + per_byte * read)
    return rec


def run_bench(contexts: list[int] = DEFAULT_CONTEXTS, methods: list[str] | None = None,
              keep_ratios: list[float] = DEFAULT_KEEP_RATIOS, steps: int = 10, warmup: int = 2,
              prompt_queries: int = 64, prefill_context: int = 16384, threads: int | None = 1, seed: int = 0,
              time_limit_s: float = 60.0, bandwidth_mib: int = 512, progress: bool = True,
              checkpoint: str | None = None) -> dict:
    """The whole benchmark; returns every number as a JSON-ready dict (see ``format_result``).

    ``methods`` default: every registered method but "full". A variant that raises, or whose step (or
    compression) takes longer than ``time_limit_s``, is reported as such and not run at longer contexts.
    ``prefill_context`` 0 skips the prefill memory part. ``threads``: ``torch.set_num_threads`` for the run
    and the subprocesses (restored afterwards); None leaves it as is. ``checkpoint``: time that model (e.g.
    ``smollm2-135m``: its real weights, fp32) instead of the small random one of ``bench_config``; its
    ``max_seq_len`` bounds the contexts, and the prefill memory part runs only on the random model.
    """
    contexts = sorted(set(contexts))
    methods = [m for m in METHODS if m != "full"] if methods is None else list(dict.fromkeys(methods))
    keep_ratios = list(dict.fromkeys(keep_ratios))
    variants = [BenchCase("full")] + [BenchCase(m, r) for m in methods for r in keep_ratios]
    max_seq_len = max(contexts[-1] + warmup + steps + 1, prefill_context, FIXED_COST_CONTEXT + steps + 2)
    if checkpoint is None:
        config, model = bench_config(max_seq_len), None
    else:
        from nanollm.io.checkpoint import load
        model = load(checkpoint)[0]
        config = model.config
        if prefill_context:
            raise ValueError("the prefill memory part runs on the random model only: give --prefill-context 0 "
                             "with --checkpoint")
        if max_seq_len > config.max_seq_len:
            raise ValueError(f"context {contexts[-1]} + {warmup} warm-up + {steps} timed steps needs "
                             f"{max_seq_len} positions; {checkpoint} has {config.max_seq_len}")
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    n_prefill = len(PREFILL_METHODS) if prefill_context else 0
    per_context = len(variants) * 2 + (len(variants) + 1) * (warmup + steps)    # build + bytes, steps
    bar = tqdm(total=len(contexts) * per_context + n_prefill, desc="methods.bench",
               disable=not progress, dynamic_ncols=True)
    try:
        torch.manual_seed(seed)
        model = Transformer(config).eval() if model is None else model
        weight_bytes = decode_weight_bytes(model)
        bandwidth = read_bandwidth(bandwidth_mib)
        records, too_slow = [], {}
        for context in contexts:
            live = [v for v in variants if v not in too_slow]
            rows, fixed_ms = bench_context(model, config, context, live, prompt_queries, warmup, steps, seed,
                                           time_limit_s, bar)
            bar.update((len(variants) - len(live)) * (warmup + steps + 2))
            full = rows[0] if live and live[0].keep_ratio is None else None
            measured = dict(zip(live, rows))
            for v in variants:                            # in variant order, the ones skipped included
                row = measured.get(v) or Row(context, v.method, v.keep_ratio, None if v.keep_ratio is None
                                             else budget_for(v.keep_ratio, context), "skipped", too_slow.get(v, ""))
                records.append(row_record(row, full, fixed_ms, weight_bytes))
                row.cache = None                                  # free the memory before the next length
                if v in measured and (row.status == "skipped" or "--time-limit" in row.note):
                    too_slow[v] = f"too slow at context {context}"
        prefill_rows = []
        for method in PREFILL_METHODS if prefill_context else []:
            prefill_rows.append(prefill_memory_in_subprocess(config, method, prefill_context, threads, seed))
            bar.update(1)
    finally:
        bar.close()
        torch.set_num_threads(old_threads)
    return {"config": config.to_dict(), "checkpoint": checkpoint, "weight_bytes": weight_bytes,
            "kv_bytes_per_token": config.kv_bytes_per_token(), "threads": threads, "seed": seed,
            "contexts": contexts, "methods": methods, "keep_ratios": list(keep_ratios), "steps": steps,
            "warmup": warmup, "prompt_queries": prompt_queries, "time_limit_s": time_limit_s,
            "bandwidth": {"gb_per_s": bandwidth, "tensor_mib": bandwidth_mib, "how": "median time of x.sum()"},
            "fixed_context": FIXED_COST_CONTEXT, "rows": records,
            "prefill": {"context": prefill_context, "keep_ratio": PREFILL_KEEP_RATIO, "rows": prefill_rows},
            "torch": torch.__version__, "machine": platform.platform(), "processor": platform.processor()}


# ----------------------------------------------------------------------------------------------------------
# Output: the tables, the figure

def _num(value, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"


def format_rows(result: dict, context: int) -> list[str]:
    """The table of one context: every variant's cost and speed, the full cache first."""
    rows = [r for r in result["rows"] if r["context"] == context]
    full = next((r for r in rows if r["keep_ratio"] is None), None)
    lines = [""]
    if full and full["step_ms"] is not None:
        bw = result["bandwidth"]["gb_per_s"]
        fixed = "" if full["fixed_ms"] is None else f"; fixed cost of a step {full['fixed_ms']:.2f} ms"
        lines.append(f"context {context}: the full cache reads {full['kv_bytes'] / MiB:.1f} MiB of K/V per step in "
                     f"{full['step_ms']:.2f} ms = {full['gb_per_s']:.1f} GB/s, {full['gb_per_s'] / bw:.0%} of the "
                     f"measured read bandwidth{fixed}")
    else:
        lines.append(f"context {context}: no full-cache measurement ({full['note'] if full else 'not run'})")
    w = max(14, *(len(r["method"]) + 1 for r in rows))
    head = (f"{'method':<{w}}{'keep':>5}{'budget':>7}{'compress ms':>12}{'step ms':>9}{'KV MiB':>8}{'GB/s':>7}"
            f"{'speedup':>9}{'ideal':>7}{'+W':>7}{'bound':>7}{'of bound':>9}  note")
    lines += [head, "-" * (len(head) + 20)]
    for r in rows:
        label = "full cache" if r["keep_ratio"] is None else r["method"]
        note = r["note"]
        if r["status"] != "ok":
            note = f"{r['status'].upper()}: {note}"
        elif r["attended_bytes"] is not None and r["attended_bytes"] != r["kv_bytes"]:
            sketch = f" + {r['slot_bytes'] / MiB:.2f} MiB of sketch" if r.get("slot_bytes") else ""
            note = (f"stores {r['kv_bytes'] / MiB:.2f} MiB{sketch}, attends rebuilt entries"
                    + (f"; {note}" if note else ""))
        kv = r["read_bytes"] / MiB if r["read_bytes"] is not None else None
        share = None if r["speedup"] is None or not r["bound_speedup"] else r["speedup"] / r["bound_speedup"]
        lines.append(f"{label:<{w}}{_num(r['keep_ratio'], '.2f', 5)}{_num(r['budget'], 'd', 7)}"
                     f"{_num(r['compress_ms'], '.1f', 12)}{_num(r['step_ms'], '.2f', 9)}{_num(kv, '.2f', 8)}"
                     f"{_num(r['gb_per_s'], '.1f', 7)}{_num(r['speedup'], '.2f', 8)}x"
                     f"{_num(r['ideal_speedup'], '.1f', 6)}x{_num(r.get('ideal_bytes_speedup'), '.2f', 6)}x"
                     f"{_num(r['bound_speedup'], '.1f', 6)}x"
                     f"{_num(share, '.0%', 9)}  {note}".rstrip())
    return lines


def format_prefill(result: dict) -> list[str]:
    """The prefill memory table, or nothing when it was skipped."""
    p = result["prefill"]
    if not p["rows"]:
        return []
    lines = ["", f"real prefill of {p['context']} tokens, each in a fresh process, {result['threads']} thread(s): "
                 f"peak resident memory beyond the cache",
             f"{'method':<12}{'keep':>5}{'wall s':>8}{'baseline MiB':>14}{'peak MiB':>10}{'cache MiB':>11}"
             f"{'beyond MiB':>12}", "-" * 72]
    for r in p["rows"]:
        label = "full cache" if r["method"] == "full" else r["method"]
        if "error" in r:
            lines.append(f"{label:<12}  ERROR: {r['error']}")
            continue
        mib = lambda k: None if r[k] is None else r[k] / MiB          # noqa: E731
        mem = [f"{'n/a':>14}{'n/a':>10}", f"{'n/a':>12}"] if r["peak_bytes"] is None else \
            [f"{mib('baseline_bytes'):>14.1f}{mib('peak_bytes'):>10.1f}", f"{mib('beyond_bytes'):>12.1f}"]
        lines.append(f"{label:<12}{_num(r['keep_ratio'], '.2f', 5)}{r['wall_s']:>8.2f}{mem[0]}"
                     f"{mib('cache_bytes'):>11.1f}{mem[1]}" + ("" if r["peak_reset"] else "  (peak not reset)"))
    logits = next((r["logits_bytes"] for r in p["rows"] if "logits_bytes" in r), None)
    lines.append("beyond = peak - baseline - bytes of the cache's buffers (room to grow included)"
                 + (f"; it includes the prompt's logits ({logits / MiB:.1f} MiB)" if logits else ""))
    return lines


def format_result(result: dict) -> str:
    """Everything the command line prints."""
    cfg = result["config"]
    lines = [
        f"model: llama, {cfg['n_layer']} layers, {cfg['n_head']} heads / {cfg['n_kv_head']} KV heads of "
        f"{cfg.get('d_head') or cfg['d_model'] // cfg['n_head']}, d_model {cfg['d_model']}, "
        f"{'random weights' if not result.get('checkpoint') else 'the weights of ' + result['checkpoint']} "
        f"({result['weight_bytes'] / 1e6:.1f} MB read per step); K/V {result['kv_bytes_per_token']} bytes per "
        "token; fp32, "
        f"batch 1, {result['threads']} thread(s)",
        f"read bandwidth: {result['bandwidth']['gb_per_s']:.1f} GB/s (median time of x.sum() over "
        f"{result['bandwidth']['tensor_mib']} MiB)",
        f"median of {result['steps']} interleaved decode steps after {result['warmup']} warm-up; compression "
        f"statistics from {result['prompt_queries']} random queries (speed, not quality)",
    ]
    for context in result["contexts"]:
        lines += format_rows(result, context)
    lines += ["", "compress ms: the method's on_prefill hooks (scoring, selection, gathering), all layers, once; "
                  "the statistics a method asks of the prompt's attention (e.g. H2O's column sums over every "
                  "query) are paid inside the prefill itself: see the real prefill's wall time. KV MiB: K/V "
                  "bytes a step's attention reads (the entries it attends, all layers). speedup: full-cache "
                  "step ms / this step ms; ideal: 1 / keep; +W: the ideal from the bytes a step reads, weights "
                  "included, (weights + full K/V) / (weights + this K/V); bound: the ideal once the fixed cost of "
                  f"a step (a step of the full cache over {result['fixed_context']} tokens, timed alongside) is "
                  "counted, full / (fixed + (full - fixed) * this K/V / full K/V); of bound: speedup / bound."]
    lines += format_prefill(result)
    return "\n".join(lines)


def plot(result: dict, path: str | Path) -> None:
    """Step ms vs context (log-log), one line per (method, keep ratio), the full cache bold; and the measured
    speedup vs context beside the ideal 1 / keep ratio."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if r["step_ms"] is not None]
    keys = sorted({(r["method"], r["keep_ratio"]) for r in rows}, key=lambda k: (k[1] is not None, k[0], k[1] or 0))
    methods = sorted({k[0] for k in keys if k[1] is not None})
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    styles = {r: s for r, s in zip(sorted(result["keep_ratios"]), ["-", "--", ":", "-."] * 10)}
    fig, (ax_ms, ax_speed) = plt.subplots(1, 2, figsize=(13, 4.8))
    for method, ratio in keys:
        sel = sorted((r for r in rows if (r["method"], r["keep_ratio"]) == (method, ratio)), key=lambda r: r["context"])
        x = [r["context"] for r in sel]
        if ratio is None:
            ax_ms.plot(x, [r["step_ms"] for r in sel], color="black", lw=3, marker="o", label="full cache")
            continue
        style = dict(color=colors[method], ls=styles.get(ratio, "-"), marker=".", label=f"{method} @ {ratio:g}")
        ax_ms.plot(x, [r["step_ms"] for r in sel], **style)
        speed = [(r["context"], r["speedup"]) for r in sel if r["speedup"] is not None]
        if speed:
            ax_speed.plot(*zip(*speed), **style)
    for ratio in result["keep_ratios"]:
        ax_speed.axhline(1 / ratio, color="grey", ls=styles.get(ratio, "-"), lw=1)
        ax_speed.annotate(f"ideal 1/{ratio:g}", (1.0, 1 / ratio), xycoords=("axes fraction", "data"),
                          ha="right", va="bottom", fontsize=8, color="grey")
    ax_speed.axhline(1.0, color="black", lw=1)
    ax_ms.set(xscale="log", yscale="log", xlabel="context (tokens in the cache)", ylabel="ms per decode step",
              title=f"decode step, {result['threads']} thread(s)")
    ax_speed.set(xscale="log", yscale="log", xlabel="context (tokens in the cache)",
                 ylabel="speedup over the full cache",
                 title="measured speedup vs ideal (1 / keep ratio)")
    for ax in (ax_ms, ax_speed):
        ax.grid(alpha=0.3, which="both")
    ax_ms.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    cli.save_figure(fig, path)


# ----------------------------------------------------------------------------------------------------------
# The command line

def keep_ratio_arg(text: str) -> float:
    value = cli.positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1] (budget = ratio * context), got {text}")
    return value


def main(argv: list[str] | None = None) -> dict:
    ap = cli.ArgumentParser(
        prog="python -m experiments.evaluation.bench",
        description="Decode speed of every KV-cache method against the full cache at long contexts, on a model "
                    "whose step is dominated by K/V bytes: ms per step, K/V bytes read, GB/s, measured speedup "
                    "beside the ideal 1 / keep ratio, the one-time compression cost, the machine's read "
                    "bandwidth, and the peak memory of a real prefill. The caches are filled with random K/V "
                    "and compressed from random queries' attention: it measures speed, not quality.")
    ap.add_argument("--checkpoint", default=None, metavar="NAME",
                    help="time this model instead of the small random one: a bundled or fetched name (e.g. "
                         "smollm2-135m, with --contexts 8176 --prefill-context 0) or a folder (default: none)")
    ap.add_argument("--contexts", type=cli.positive_int, nargs="+", default=DEFAULT_CONTEXTS, metavar="T",
                    help="tokens in the cache when the steps are timed "
                         f"(default {' '.join(map(str, DEFAULT_CONTEXTS))})")
    ap.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                    help=f"methods to time besides the full cache: registered names ({', '.join(METHODS)}), a "
                         "wrapper around a scorer, e.g. 'adakv(h2o)', or MODULE:CLASS, a policy class of your own "
                         "(default: every registered method but full)")
    ap.add_argument("--keep-ratios", type=keep_ratio_arg, nargs="+", default=DEFAULT_KEEP_RATIOS, metavar="R",
                    help="budget = round(R * context) tokens per layer per KV head, each R in (0, 1] "
                         f"(default {' '.join(map(str, DEFAULT_KEEP_RATIOS))})")
    ap.add_argument("--steps", type=cli.positive_int, default=10,
                    help="timed decode steps per variant and context; the median is reported (default %(default)s)")
    ap.add_argument("--warmup", type=cli.non_negative_int, default=2,
                    help="untimed decode steps before them (default %(default)s)")
    ap.add_argument("--prompt-queries", type=cli.positive_int, default=64, metavar="W",
                    help="random query rows at the end of the context whose attention the methods' prefill hooks "
                         "read, at most the shortest context (default %(default)s)")
    ap.add_argument("--prefill-context", type=cli.non_negative_int, default=None, metavar="T",
                    help="tokens of the real prefill whose peak memory is measured for the full cache, SnapKV and "
                         f"H2O at keep ratio {PREFILL_KEEP_RATIO}, each in a fresh process; 0 skips it "
                         "(default 16384; 0 with --checkpoint, where it cannot run)")
    ap.add_argument("--threads", type=cli.threads_or_workers, default=1,
                    help="torch.set_num_threads for the run, the bandwidth measurement and the prefill processes, "
                         "at most the CPU cores (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights, K/V, queries and tokens "
                                                        "(default %(default)s)")
    ap.add_argument("--time-limit", type=cli.positive_float, default=60.0, metavar="SECONDS",
                    help="a variant whose compression or one decode step takes longer is reported as too slow and "
                         "not run at longer contexts (default %(default)s)")
    ap.add_argument("--bandwidth-mib", type=cli.positive_int, default=512, metavar="MIB",
                    help="size of the fp32 tensor whose x.sum() measures the read bandwidth; keep it well above "
                         "the CPU's caches, 256 or more (default %(default)s)")
    ap.add_argument("--json", type=cli.output_file, default=None, metavar="PATH",
                    help="write every number (config, threads, bandwidth, rows, prefill rows) to PATH "
                         "(default: none)")
    ap.add_argument("--plot", type=cli.figure_file, default=None, metavar="PATH",
                    help="write step ms vs context and speedup vs ideal to PATH, a "
                         f"{cli.FIGURE_HELP} file (default: none)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (default: a progress bar on stderr)")
    args = ap.parse_args(argv)

    with cli.errors(args.debug):
        cli.check_outputs({"--json": args.json, "--plot": args.plot}, inputs=[args.checkpoint])
        for m in args.methods or []:                  # every argument is checked before any work
            try:
                method_chain(m)
            except ValueError as e:
                cli.fail(f"--methods: {e}")
        if args.prompt_queries > min(args.contexts):
            cli.fail(f"--prompt-queries {args.prompt_queries} exceeds the shortest of --contexts "
                     f"({min(args.contexts)}): the queries sit at the end of the context")
        if args.prefill_context is None:
            args.prefill_context = 0 if args.checkpoint else 16384
        elif args.prefill_context and args.checkpoint:
            cli.fail(f"--prefill-context {args.prefill_context}: the prefill memory part runs on the random model "
                     "only; give --prefill-context 0 (the default) with --checkpoint")
        cli.check_fits(f"--bandwidth-mib {args.bandwidth_mib}", args.bandwidth_mib * 2**20)
        if args.checkpoint is None:                   # K/V of the random model: a few caches of the longest context
            per_token = bench_config(1).kv_bytes_per_token()
            cli.check_fits(f"--contexts {max(args.contexts)}", 3 * max(args.contexts) * per_token)
            cli.check_fits(f"--prefill-context {args.prefill_context}", 3 * args.prefill_context * per_token)
        result = run_bench(args.contexts, args.methods, args.keep_ratios, steps=args.steps, warmup=args.warmup,
                           prompt_queries=args.prompt_queries, prefill_context=args.prefill_context,
                           threads=args.threads, seed=args.seed, time_limit_s=args.time_limit,
                           bandwidth_mib=args.bandwidth_mib, progress=not args.quiet, checkpoint=args.checkpoint)
        print(format_result(result))
        if args.json:
            result["provenance"] = provenance(argv, prog=ap.prog, threads=args.threads, dtype="float32",
                                              seed=args.seed)
            files.atomic_write_text(args.json, json.dumps(result, indent=1))
            print(f"\nwrote {args.json}")
        if args.plot:
            plot(result, args.plot)
            print(f"plot written to {args.plot}")
    return result


if __name__ == "__main__":
    main()
