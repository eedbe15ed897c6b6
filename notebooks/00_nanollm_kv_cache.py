# %% [markdown]
# # 00 The KV cache: what it stores, what it saves, what it costs
#
# Every method in this project changes *what the KV cache keeps*. Before compressing a cache, this
# notebook looks at the plain one: what it stores, what it saves, what it costs.
#
# **You will learn**
#
# 1. what a decoder recomputes at every step when it has no cache, and what the cache stores instead;
# 2. the memory formula `2 * n_layer * n_kv_head * head_dim * bytes * T`, and what grouped-query attention saves;
# 3. that cached decoding computes *exactly* what the plain forward computes (fp32);
# 4. how the cost of one decode step grows with the context, with and without the cache;
# 5. why the cache stores each token's *position*, and why that keeps RoPE right after eviction (drawn
#    from a real cache before and after a method evicts);
# 6. why the textbook `torch.cat` append is O(T) per token, and how the storage grows in place instead;
# 7. when a method acts: the order in which the cache calls a policy's hooks, layer by layer, over a
#    prefill, an `extend` chunk and decode steps (recorded, then drawn).
#
# Code: `nanollm/cache.py` and `nanollm/storage.py` (storage), `nanollm/generation.py` (prefill / extend
# / decode_step), `nanollm/policy.py` (the hooks), `nanollm/cli/bench.py` (timings). This notebook only
# imports them. The timings below were measured on the machine that built this notebook (printed in the
# next cell), on one thread: read their ratios, not their milliseconds.

# %%
import os
import sys

TINY = os.environ.get("NANOLLM_TINY") == "1"      # CI runs the notebook in a quick tiny mode
if not os.path.isdir("nanollm") and os.path.isdir(os.path.join("..", "nanollm")):
    sys.path.insert(0, os.path.abspath(".."))      # opened from notebooks/: make the repo importable

import platform

import matplotlib.pyplot as plt
import torch

from nanollm import KVCache, LayerKV, Transformer, decode_step, extend, prefill, preset
from nanollm.attention import attend
from nanollm.cli.bench import format_result, run_bench

CONTEXTS = [32, 64, 128] if TINY else [128, 256, 512, 1024]   # context lengths for the timings
REPEATS, STEPS = (2, 2) if TINY else (5, 8)                   # medians of REPEATS x STEPS decode steps
GROW_TOKENS = 64 if TINY else 512                             # tokens generated in the memory plot
COPY_CONTEXTS = [256, 1024] if TINY else [1024, 4096, 16384]   # context lengths for the append timings
torch.manual_seed(0)
print(f"tiny mode: {TINY}; torch {torch.__version__}; machine: {platform.system()} {platform.machine()}, "
      f"{os.cpu_count()} CPU cores")

from methods.evaluation.viz import print_mode

print_mode(TINY)                                   # quick mode: the text describes another run

# %% [markdown]
# ## 1. What is recomputed without a cache
#
# A decoder produces one token per step. At step *t*, the new token's query must attend to the keys and
# values of **all** *t* earlier tokens, in every layer. Without a cache the only way to get them is to
# run the whole prefix through the model again: every layer recomputes the norms, the K/V projections,
# the MLPs and the attention of tokens whose results have not changed since the previous step.
#
# Because attention is causal, token *s*'s key and value never depend on later tokens. So they can be
# computed once and **stored**: that store is the KV cache. A decode step then runs the model over the
# single new token; only its attention reads the stored keys and values.
#
# | one step at context *t* | matmul work | attention work |
# |---|---|---|
# | recompute the prefix | *t* tokens through every layer | *t*² query-key pairs |
# | with a KV cache | 1 token through every layer | *t* query-key pairs |
#
# nanollm stores, per layer, `k, v: (B, H_kv, T, d)` (keys *after* RoPE) and `pos: (B, H_kv, T)`,
# the absolute position of every stored entry. Let's look at one.

# %%
# needs: append
config = preset("TINY", max_seq_len=2048)                     # room for the longer runs below
model = Transformer(config).eval()
print(config)
print(f"{model.num_params():,} parameters")

ids = torch.randint(0, config.vocab_size, (2, 10))             # (B=2, T=10) random token ids
cache = KVCache(config)
logits = prefill(model, ids, cache)                            # (B, T, vocab)
layer0 = cache.layers[0]
print("k  ", tuple(layer0.k.shape), "  (B, H_kv, T, head_dim)")
print("v  ", tuple(layer0.v.shape))
print("pos", tuple(layer0.pos.shape), "     (B, H_kv, T)")
print("positions of row 0, KV head 0:", layer0.pos[0, 0].tolist(), "| tokens seen:", cache.seen)

# %% [markdown]
# ## 2. How big is it? The memory formula
#
# Each token adds one key and one value vector per layer and per **KV head**:
#
# $$\text{bytes}(T) = 2 \cdot n_\text{layer} \cdot n_\text{kv\_head} \cdot d_\text{head}
# \cdot \text{bytes per element} \cdot T$$
#
# (the 2 is K and V). Grouped-query attention (GQA) lets `n_head` query heads share `n_kv_head` KV heads,
# so the cache shrinks by `n_head / n_kv_head` compared with multi-head attention, at the same model
# width. TinyLlama's 32 query heads share 4 KV heads: an 8x smaller cache. `ModelConfig.kv_bytes_per_token`
# computes the formula.

# %%
print(f"{'preset':<13} {'layers':>6} {'heads':>5} {'kv heads':>8} {'head_dim':>8} | {'KiB/token fp32':>14} "
      f"{'KiB/token bf16':>14} | {'GQA saves':>9} | {'MiB at max_seq_len, bf16':>25}")
for name in ["TINY", "SMALL", "GPT2_124M", "TINYLLAMA_1B"]:
    c = preset(name)
    fp32, bf16 = c.kv_bytes_per_token(4), c.kv_bytes_per_token(2)
    print(f"{name:<13} {c.n_layer:>6} {c.n_head:>5} {c.n_kv_head:>8} {c.head_dim:>8} | {fp32 / 1024:>13.1f} "
          f"{bf16 / 1024:>13.1f} | {c.n_head // c.n_kv_head:>8}x | "
          f"{bf16 * c.max_seq_len / 2**20:>14.1f} ({c.max_seq_len} tokens)")

# %% [markdown]
# The formula is not an estimate: `cache.nbytes()` counts the tensors actually stored. For the cache
# filled above (batch 2, 10 tokens, fp32):

# %%
# needs: append
print("cache.nbytes()                         :", cache.nbytes())
print("kv_bytes_per_token() * tokens * batch  :", config.kv_bytes_per_token() * 10 * 2)

# %% [markdown]
# ## 3. The cache changes nothing (in fp32)
#
# Cached decoding must compute what the plain forward computes. Below: the logits of a full uncached
# forward over 48 tokens, against (a) prefilling 1 token and decoding the other 47 one at a time, and
# (b) prefilling 20 tokens and `extend`ing by a chunk of 28 (how a question is added after a document).
# Both flavours: Llama (RoPE, GQA) and GPT-2 (learned positions, MHA).

# %%
# needs: append, group_scores, mask
for name in ["TINY", "TINY_GPT2"]:
    m = Transformer(preset(name)).eval()
    x = torch.randint(0, m.config.vocab_size, (2, 48))
    with torch.no_grad():
        full = m(x)                                              # (B, T, vocab), no cache
    c = KVCache(m.config)
    steps = [prefill(m, x[:, :1], c)] + [decode_step(m, x[:, t], c)[:, None] for t in range(1, 48)]
    stepwise = torch.cat(steps, dim=1)
    c = KVCache(m.config)
    chunked = torch.cat([prefill(m, x[:, :20], c), extend(m, x[:, 20:], c)], dim=1)
    print(f"{name:<10} max |logits diff|: step by step {(stepwise - full).abs().max():.1e}, "
          f"prefill + extend {(chunked - full).abs().max():.1e}  (logits up to {full.abs().max():.2f})")

# %% [markdown]
# Differences of a few 1e-7, against logits of order 1, are fp32 rounding: the same sums in a different
# order. `tests/nanollm/test_model.py` asserts them at `atol=1e-5`. In bf16 the same comparison gives
# visibly larger gaps (see huggingface/transformers#25420), so low-precision checks compare greedy tokens
# instead.
#
# ## 4. What the cache buys: time per decode step
#
# `nanollm.cli.bench.run_bench` times, at each context length, one cached `decode_step` against one full
# uncached forward over the prefix (what you would run to get the next token without a cache). The
# lengths and both modes are measured interleaved, and medians are reported. The same numbers come from
# `python -m nanollm.cli.bench` on the command line.

# %%
# needs: append, group_scores, mask
bench = run_bench(config, contexts=CONTEXTS, repeats=REPEATS, steps=STEPS, threads=1)
print(format_result(bench, name="TINY"))

# %%
# needs: append, group_scores, mask
ctx = [r.context for r in bench.rows]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=80)
for mode, style in [("recompute", "o-"), ("cached", "s-")]:
    a, b = bench.fit[mode]
    ax1.plot(ctx, [getattr(r, f"{mode}_ms") for r in bench.rows], style, label=f"{mode} (measured)")
    ax1.plot(ctx, [a + b * t for t in ctx], "k:", lw=1, label="least-squares fit" if mode == "cached" else None)
ax1.set(xlabel="context (tokens already seen)", ylabel="ms per decode step", title="cost of one new token")
ax1.legend()
ax2.plot(ctx, [r.speedup for r in bench.rows], "o-", color="C2")
ax2.set(xlabel="context (tokens)", ylabel="recompute time / cached time", title="speedup of the KV cache")
ax2.axhline(1, color="gray", lw=0.8)
plt.tight_layout()
plt.show()
(a_c, b_c), (a_r, b_r) = bench.fit["cached"], bench.fit["recompute"]
print(f"slopes: recompute {b_r * 1e3:.2f} ms, cached {b_c * 1e3:.3f} ms per 1k tokens of context "
      f"({b_r / b_c:.0f}x less); cached step at {ctx[-1]} tokens: {a_c / (a_c + b_c * ctx[-1]):.0%} fixed cost "
      f"(the intercept); speedup {bench.rows[0].speedup:.1f}x at {ctx[0]} tokens, "
      f"{bench.rows[-1].speedup:.1f}x at {ctx[-1]}")

# %% [markdown]
# Read the fitted slopes (dotted lines, and the line printed under the plot): recomputing grows by
# milliseconds per thousand tokens of context, because every step re-runs the whole prefix; the cached step
# grows far more slowly (the printed ratio of the two slopes), only through the attention over the stored
# entries (section 6 shows what a naive append would add). At these lengths the cached step is mostly its
# fixed cost, the intercept: Python and small-matrix overheads of one token through the layers (the printed
# share). Even so the cache already pays at the shortest context measured, and the longer the context, the
# bigger the win (the speedups printed at both ends). The price is memory, which grows linearly with the
# tokens seen:

# %%
# needs: append, group_scores, mask
cache = KVCache(config)
x = torch.randint(0, config.vocab_size, (1, GROW_TOKENS))
prefill(model, x[:, :1], cache)
nbytes = [cache.nbytes()]
for t in range(1, GROW_TOKENS):
    decode_step(model, x[:, t], cache)
    nbytes.append(cache.nbytes())
tokens = list(range(1, GROW_TOKENS + 1))
budget = GROW_TOKENS // 4                                           # an illustrative budget, tokens per head
per_token = config.kv_bytes_per_token()
plt.figure(figsize=(5.5, 3.6), dpi=80)
plt.plot(tokens, [n / 1024 for n in nbytes], label="full cache: cache.nbytes()")
plt.plot(tokens, [min(t, budget) * per_token / 1024 for t in tokens], "--",
         label=f"a method with budget={budget} (illustration)")
plt.xlabel("tokens seen")
plt.ylabel("KV cache (KiB)")
plt.title(f"TINY, fp32: {per_token} bytes per token")
plt.legend()
plt.show()

# %% [markdown]
# The dashed line is what every method in `methods/` aims for: a cache that stops growing at `budget`
# tokens per layer per KV head, whatever the context length. Which tokens to keep is the whole question.
#
# ## 5. Positions stay true after eviction
#
# Evicting entries is `LayerKV.keep(idx)` with per-head slot indices `idx: (B, H_kv, K)`; each head may
# keep different tokens, and `-1` makes an empty slot (ignored by attention). The stored **positions**
# move along with the keys. Two facts keep eviction correct:
#
# * keys are cached *after* RoPE, at the position they were seen at, so a kept key never needs re-rotation;
# * the next token gets position `cache.seen` (tokens seen), not `len(cache)` (slots kept), and the
#   causal mask is built from the stored positions, not from slot numbers.

# %%
# needs: append
cache = KVCache(config)
x = torch.randint(0, config.vocab_size, (1, 12))
prefill(model, x, cache)
kv = cache.layers[0]
k_before = kv.k.clone()
print("before keep, positions per KV head:\n", kv.pos[0])
# keep 2 "sink" tokens, 3 recent ones, and one different middle token per head (head 1 keeps one fewer)
idx = torch.tensor([[[0, 1, 5, 9, 10, 11], [0, 1, 7, 10, 11, -1]]])    # (B=1, H_kv=2, K=6)
kv.keep(idx)
print("after keep:\n", kv.pos[0])
print("kept keys unchanged:", torch.equal(kv.k[0, 0], k_before[0, 0, idx[0, 0]]))

# %%
# needs: append, group_scores, mask
decode_step(model, torch.tensor([7]), cache)                       # one more token
print(f"slots: {len(kv)}, tokens seen: {cache.seen}")
print("positions after one decode step:\n", kv.pos[0])
print(f"the new token got position {kv.pos[0, 0, -1].item()} (tokens seen before it), "
      f"although it sits in slot {len(kv) - 1}")

# %%
# needs: append, group_scores, mask
kept = torch.zeros(config.n_kv_head, cache.seen)
for h in range(config.n_kv_head):
    p = kv.pos[0, h]
    kept[h, p[p >= 0]] = 1
plt.figure(figsize=(6.5, 1.8), dpi=80)
plt.imshow(kept, cmap="Greens", aspect="auto", vmin=0, vmax=1)
plt.colorbar(ticks=[0, 1], label="kept")
plt.yticks(range(config.n_kv_head), [f"KV head {h}" for h in range(config.n_kv_head)])
plt.xlabel("position")
plt.ylabel("KV head")
plt.title("layer 0: positions kept per KV head")
plt.show()

# %% [markdown]
# ### 5.1 The layout, drawn from a real cache
#
# Below, every stored number of one small cache, drawn from the tensors themselves. The prompt (10 tokens)
# is prefilled twice: into a plain cache (everything kept), and into a cache whose policy is a real method,
# SnapKV with a budget of 6 entries per KV head (`methods/snapkv.py`), which evicts right after each
# layer's prefill attention; then one token is decoded into the SnapKV cache. Each panel is one layer's
# `k[0, h]` and `v[0, h]` (one column per slot, the d = 16 numbers of the key above those of the value);
# the tick under each column is the slot's `pos`. Per layer the storage is `k, v: (B, H_kv, T, d)` and
# `pos: (B, H_kv, T)`, and nothing else: the slot number is only an index, the position travels with the
# entry.

# %%
# needs: append, group_scores, mask
from methods.snapkv import SnapKVPolicy


def snapshot(c):
    """Per layer: copies of k[0], v[0], pos[0] and the shapes of the stored k and pos."""
    return [(kv.k[0].clone(), kv.v[0].clone(), kv.pos[0].clone(), tuple(kv.k.shape), tuple(kv.pos.shape))
            for kv in c.layers]


prompt = torch.randint(0, config.vocab_size, (1, 10))
full = KVCache(config)
prefill(model, prompt, full)
snap = KVCache(config, SnapKVPolicy(budget=6, window=2, kernel=1))
prefill(model, prompt, snap)
snapshots = {"full cache, after prefill": snapshot(full), "SnapKV (budget 6), after prefill": snapshot(snap)}
decode_step(model, torch.tensor([7]), snap)
snapshots["SnapKV, after one decode step"] = snapshot(snap)

same = all(torch.equal(ks[h], kf[h, ps[h]]) and torch.equal(vs[h], vf[h, ps[h]])
           for (kf, vf, *_), (ks, vs, ps, *_) in zip(snapshots["full cache, after prefill"],
                                                   snapshots["SnapKV (budget 6), after prefill"])
           for h in range(config.n_kv_head))
print("every entry SnapKV kept equals the full cache's entry at its stored position:", same)

names = list(snapshots)
panels = [(layer, h) for layer in range(config.n_layer) for h in range(config.n_kv_head)]
d = config.head_dim
vmax = max(float(t.abs().max()) for name in names for entry in snapshots[name] for t in entry[:2])
fig, axes = plt.subplots(len(panels), len(names), figsize=(12, 1.35 * len(panels) + 1.2), dpi=80, squeeze=False,
                         layout="constrained",
                         gridspec_kw={"width_ratios": [snapshots[n][0][2].shape[-1] for n in names]})
for j, name in enumerate(names):
    for i, (layer, h) in enumerate(panels):
        k_, v_, p_, k_shape, pos_shape = snapshots[name][layer]
        ax = axes[i, j]
        im = ax.imshow(torch.cat([k_[h], v_[h]], dim=-1).T, cmap="RdBu_r", vmin=-vmax, vmax=vmax,
                       aspect="auto", interpolation="nearest")
        ax.axhline(d - 0.5, color="k", lw=1)
        ax.set_xticks(range(p_.shape[-1]), [str(int(x)) for x in p_[h]], fontsize=7)
        ax.set_yticks([d / 2 - 0.5, 1.5 * d - 0.5], ["k", "v"])
        if j == 0:
            ax.set_ylabel(f"layer {layer}\nKV head {h}", fontsize=8)
        if i == 0:
            ax.set_title(f"{name}\nk, v {k_shape}; pos {pos_shape}", fontsize=9)
        if i == len(panels) - 1:
            ax.set_xlabel("slots (tick: the stored position)")
fig.colorbar(im, ax=axes, shrink=0.6, label="stored value (keys after RoPE)")
fig.suptitle("one cache, every stored number: SnapKV keeps different positions per head, and each entry keeps its own")
plt.show()

# %% [markdown]
# Read it column by column. After the eviction each head holds 6 slots, not the same positions in every
# head or layer; a kept column has exactly the colours it had in the full cache, under the same position
# (the check printed above compares every number). The decoded token lands in the next free slot, the
# seventh, and gets position 10, the number of tokens seen: its key was rotated for position 10, so its
# dot products with the kept keys, rotated at their own positions, still depend on the true distance.

# %% [markdown]
# ## 6. Growing without copying: decoding at the memory limit
#
# At long contexts a decode step is *memory-bound*: its attention reads every stored key and value once
# and does only two multiply-adds per number read, so the step can be no faster than
# `bytes stored / memory bandwidth`. (That is also why compression speeds decoding up: fewer bytes.)
#
# The textbook way to add the new token's entry is `k = torch.cat([k, k_new], dim=2)`. It allocates a new
# tensor and copies the whole layer, at every token: the step reads and writes every stored byte once
# more on top of the attention's read, and a generation of T tokens copies O(T^2) bytes in total.
#
# `LayerKV` (`nanollm/storage.py`) instead keeps `k`, `v`, `pos` as views of the first T slots of larger
# buffers. `append` writes the new entries in place after them; only when a buffer is full does it
# allocate one twice as large and copy once. Over a generation every entry is copied about once on
# average: O(T) in total, nothing per step. Watch the buffer's address and capacity as tokens arrive:

# %%
# needs: append
kv = LayerKV()
slots, capacity, moves, ptr = [], [], 0, None
for t in range(300):
    kv.append(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), torch.tensor([t]))
    moves += kv.k.data_ptr() != ptr                   # a new buffer: the stored entries were copied
    ptr = kv.k.data_ptr()
    slots.append(len(kv))
    capacity.append(kv.capacity())
print(f"300 appends, {moves} buffer allocations (the first one included); final capacity {kv.capacity()}")
plt.figure(figsize=(5.5, 3.2), dpi=80)
plt.plot(slots, label="slots in use (T)")
plt.step(range(300), capacity, where="post", label="buffer capacity")
plt.xlabel("tokens appended")
plt.ylabel("slots per head")
plt.title("LayerKV: capacity doubles when full, slots grow by one")
plt.legend()
plt.show()

# %% [markdown]
# What the copy costs, measured: one layer shaped like a model whose cache dominates the bytes (8 KV
# heads of dimension 32, fp32), at several context lengths. Per token we time the textbook `torch.cat`
# append, `LayerKV.append`, and the attention of one query over the stored entries (`attend`, what
# a decode step must read anyway).

# %%
# needs: append, group_scores, mask
import time


def median_ms(fn, repeats=9):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[repeats // 2]


torch.set_num_threads(1)
rows = []
for T in COPY_CONTEXTS:
    k, v = torch.randn(1, 8, T, 32), torch.randn(1, 8, T, 32)
    new_k, new_v = torch.randn(1, 8, 1, 32), torch.randn(1, 8, 1, 32)
    store = LayerKV()
    store.append(k, v, torch.arange(T))
    q = torch.randn(1, 8, 1, 32)
    cat_ms = median_ms(lambda: (torch.cat([k, new_k], dim=2), torch.cat([v, new_v], dim=2)))
    append_ms = median_ms(lambda: store.append(new_k, new_v, torch.tensor([len(store)])))
    attend_ms = median_ms(lambda: attend(q, store.k, store.v, torch.tensor([len(store)]), store.pos))
    rows.append((T, cat_ms, append_ms, attend_ms))
    print(f"T={T:>6}: torch.cat append {cat_ms:7.3f} ms | in-place append {append_ms:6.3f} ms | "
          f"attention over the entries {attend_ms:6.3f} ms | cat / attention = {cat_ms / attend_ms:4.1f}x")
ratios = [cat / att for _, cat, _, att in rows]
print(f"over these lengths: torch.cat / attention {min(ratios):.1f}x to {max(ratios):.1f}x; in-place append "
      f"{min(r[2] for r in rows) * 1e3:.0f} to {max(r[2] for r in rows) * 1e3:.0f} µs whatever the length")

# %% [markdown]
# The `torch.cat` append reads *and writes* every stored byte, twice the bytes the attention reads, and
# allocates a new tensor each time (more still when the allocator has to map fresh memory). The last line
# printed above gives the range of the ratio in this run; on the machine that built this notebook (two
# cores shared with other work) it moves from run to run, so read it as "the same order as the attention",
# not as a fixed factor. With it, a decode step roughly doubles its memory traffic, and a method that keeps
# 10% of the tokens would look *better* than it is, because its small cache is also cheap to copy. The
# in-place append costs the same at every length (the last line printed), a small fraction of the
# attention from 1024 tokens on. (`python -m methods.evaluation.bench` measures whole decode steps: bytes
# read per step, the achieved GB/s against the machine's measured bandwidth, and the speedup of each
# compression method over the full cache.)
#
# ## 7. When a method acts: the policy hooks
#
# A method is a `CachePolicy` (`nanollm/policy.py`) and acts only through three hooks, which
# `KVCache.attend` calls inside every layer's attention, after the step's new entries were appended:
#
# * `attend_kv(layer, store)`: what the step's queries attend to (the storage itself, unless the method
#   rebuilds entries, as KVReviver does from its sketch);
# * `on_prefill(ctx)`: after the layer attended over the whole prompt (the cache was empty);
# * `on_decode(ctx)`: after the layer attended in a decode step *or an `extend` chunk*.
#
# To see the order, a subclass of a real method, StreamingLLM (`methods/streaming_llm.py`: 2 sinks and a
# recent window, 8 entries per KV head), records every call and the slots the layer holds before and
# after it, and changes nothing else. It serves a prefill of 10 tokens, one `extend` chunk of 4 tokens and
# 3 decode steps.

# %%
# needs: append, group_scores, mask
from methods.streaming_llm import StreamingLLMPolicy


class LoggedStreamingLLM(StreamingLLMPolicy):
    """StreamingLLM, unchanged, recording every hook call: (hook, layer, step, slots before, slots after)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.log, self.step = [], ""

    def attend_kv(self, layer, store):
        self.log.append(("attend_kv", layer, self.step, len(store), len(store)))
        return super().attend_kv(layer, store)

    def on_prefill(self, ctx):
        before = len(ctx.kv)
        super().on_prefill(ctx)
        self.log.append(("on_prefill", ctx.layer, self.step, before, len(ctx.kv)))

    def on_decode(self, ctx):
        before = len(ctx.kv)
        super().on_decode(ctx)
        self.log.append(("on_decode", ctx.layer, self.step, before, len(ctx.kv)))


def run_logged(model, policy, prompt_len, chunks, decodes, seed=0):
    """Prefill ``prompt_len`` random tokens, ``extend`` by each chunk length, then ``decodes`` decode steps."""
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len + sum(chunks) + decodes),
                        generator=torch.Generator().manual_seed(seed))
    c = KVCache(model.config, policy)
    policy.step = f"prefill {prompt_len}"
    prefill(model, ids[:, :prompt_len], c)
    t = prompt_len
    for n in chunks:
        policy.step = f"extend {n}"
        extend(model, ids[:, t:t + n], c)
        t += n
    for i in range(decodes):
        policy.step = f"decode {i + 1}"
        decode_step(model, ids[:, t], c)
        t += 1
    return c


policy = LoggedStreamingLLM(budget=8, n_sink=2)
logged = run_logged(model, policy, prompt_len=10, chunks=[4], decodes=3)
for n, (hook, layer, step, before, after) in enumerate(policy.log):
    change = f"{before} -> {after} slots" if before != after else f"{before} slots"
    print(f"{n:>2}  {step:<10} layer {layer}  {hook:<10} {change}")

markers = {"attend_kv": ("o", "C0"), "on_prefill": ("s", "C1"), "on_decode": ("D", "C3")}
fig, ax = plt.subplots(figsize=(11, 2.8), dpi=80)
steps = list(dict.fromkeys(step for _, _, step, _, _ in policy.log))
for j, name in enumerate(steps):
    calls = [n for n, entry in enumerate(policy.log) if entry[2] == name]
    ax.axvspan(calls[0] - 0.5, calls[-1] + 0.5, color="0.92" if j % 2 else "0.97", zorder=0)
    ax.text((calls[0] + calls[-1]) / 2, config.n_layer - 0.45, name, ha="center", fontsize=8)
for hook, (marker, colour) in markers.items():
    calls = [(n, layer) for n, (h, layer, *_) in enumerate(policy.log) if h == hook]
    ax.scatter([n for n, _ in calls], [layer for _, layer in calls], marker=marker, color=colour, s=60,
               label=hook, zorder=3)
for n, (hook, layer, _, before, after) in enumerate(policy.log):
    if before != after:
        ax.annotate(f"{before}->{after}", (n, layer), textcoords="offset points", xytext=(0, -14),
                    ha="center", fontsize=7)
ax.set_yticks(range(config.n_layer), [f"layer {layer}" for layer in range(config.n_layer)])
ax.set_ylim(-0.7, config.n_layer - 0.2)
ax.set(xlabel="call order", ylabel="layer",
       title="StreamingLLM (budget 8): which hook the cache calls when (annotated: slots before -> after)")
ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# What the timeline shows:
#
# * **Layer by layer.** A step runs through the layers in order, and each layer gets its hooks before the
#   next layer starts: `attend_kv`, then the attention, then `on_prefill` or `on_decode`. So a method that
#   evicts in layer 0 has done so before layer 1 attends, and every layer decides for itself.
# * **Appended first.** The slots counted by `attend_kv` already include the step's new tokens: the prompt's
#   10, then 8 kept + 4 from the `extend` chunk, then 8 + 1 per decode step. A step's queries always see
#   their own tokens; eviction only affects the *next* step.
# * **`extend` is a decode step.** The chunk of 4 tokens gets one `on_decode` per layer, like a single
#   token does: the phase is "prefill" only while the cache is empty. (A method that compresses only the
#   prompt, such as SnapKV, therefore never compresses an appended question.)
# * **When eviction happens is the method's choice.** StreamingLLM compresses after every hook
#   (`compress_on = ("prefill", "decode")`), back to its budget of 8; the annotations are its evictions.
#
# ## Exercises
#
# Exercises 1, 3 and 5 check themselves: fill in the marked lines, run the cell, and an `assert` says
# what is wrong. Exercises 2 and 4 are questions to think and experiment with.
#
# ### Exercise 1: memory arithmetic
#
# Llama-3-8B has 32 layers, 32 query heads, 8 KV heads and head_dim 128. How many GiB does its KV cache
# take for one 128k-token (131072) sequence in bf16? How much would it take without GQA (one KV head per
# query head)? Do the arithmetic from the formula of section 2.

# %%
from nanollm import ModelConfig

llama3_8b = ModelConfig(n_layer=32, n_head=32, n_kv_head=8, d_model=4096, vocab_size=128256, max_seq_len=131072)
# BEGIN SOLUTION [cache] bytes = 2 (K, V) x layers x KV heads x head_dim x 2 (bf16) x tokens; GiB = 2**30 bytes
gib_gqa = 2 * 32 * 8 * 128 * 2 * 131072 / 2**30
gib_mha = 2 * 32 * 32 * 128 * 2 * 131072 / 2**30
# END SOLUTION
assert abs(gib_gqa - llama3_8b.kv_bytes_per_token(2) * 131072 / 2**30) < 1e-9, \
    f"GQA: {gib_gqa} GiB, but kv_bytes_per_token says otherwise: count 8 KV heads, 2 bytes per number, K and V"
mha = ModelConfig(n_layer=32, n_head=32, n_kv_head=32, d_model=4096, vocab_size=128256, max_seq_len=131072)
assert abs(gib_mha - mha.kv_bytes_per_token(2) * 131072 / 2**30) < 1e-9, \
    f"MHA: {gib_mha} GiB: without GQA there are as many KV heads as query heads (32)"
print(f"GQA: {gib_gqa:.0f} GiB | MHA: {gib_mha:.0f} GiB ({gib_mha / gib_gqa:.0f}x more)")

# %% [markdown]
# ### Exercise 2: where does the speedup start?
#
# Run `python -m nanollm.cli.bench --preset SMALL`, then again with `--threads 2`. At which context length
# does the cache start to pay off, and why does a larger model cross over earlier?
#
# ### Exercise 3: the price of `torch.cat`
#
# A textbook cache appends with `torch.cat`, copying the whole layer at every step. For this notebook's
# TINY model (`config`, fp32, batch 1), count the bytes one such append moves in all layers at T = 1024
# tokens already stored (it reads the stored K and V and writes them again; leave out the new token), and
# the bytes a whole generation moves that grows the cache from 0 to 1024 tokens this way (the step that
# finds t tokens stored moves that many). Compare with what the attention reads per step, and with the
# timings of section 6. (Another way out, used by gpt-fast: preallocate the cache for the maximum length
# once.)

# %%
# needs: append
T = 1024
# BEGIN SOLUTION [cache] step: 2 (read, write) x config.kv_bytes_per_token() x T; generation: sum over t < T
cat_bytes_step = 2 * config.kv_bytes_per_token() * T
cat_bytes_generation = sum(2 * config.kv_bytes_per_token() * t for t in range(T))
# END SOLUTION
measured = KVCache(config)                                     # an actual cache holding T tokens
prefill(model, torch.randint(0, config.vocab_size, (1, T)), measured)
stored = measured.nbytes()
assert cat_bytes_step == 2 * stored, \
    f"{cat_bytes_step} bytes per step; the cache holds {stored} bytes at T={T}: read once and written once"
assert cat_bytes_generation == (T - 1) * stored, \
    "a generation sums 2 x (bytes of t tokens) over the steps t = 0 .. T-1: quadratic in T"
print(f"one torch.cat append at T={T}: {cat_bytes_step / 2**20:.2f} MiB moved, {cat_bytes_step // stored}x what "
      f"the attention reads; a whole generation: {cat_bytes_generation / 2**30:.2f} GiB")

# %% [markdown]
# ### Exercise 4: break it on purpose
#
# What would go wrong if the new token were given position `len(cache)` (slots kept) instead of
# `cache.seen` after the `keep` of section 5? Which test in `tests/nanollm/test_model.py` would catch it?
#
# ### Exercise 5: count the hook calls
#
# Predict, without running it, the hook calls for the SMALL preset (4 layers) with the logged StreamingLLM
# of section 7 (budget 8) over a prompt of 20 tokens, two `extend` chunks of 5 tokens and 6 decode steps:
# how many calls of each hook, and how many slots each layer holds at the end.

# %%
# needs: append, group_scores, mask
# BEGIN SOLUTION [cache] per step and layer: attend_kv, then on_prefill (first step) or on_decode (later steps)
n_layers, n_steps = 4, 1 + 2 + 6
calls = {"attend_kv": n_layers * n_steps, "on_prefill": n_layers, "on_decode": n_layers * (n_steps - 1)}
slots_at_end = 8
# END SOLUTION
small = Transformer(preset("SMALL")).eval()
check = LoggedStreamingLLM(budget=8, n_sink=2)
end = run_logged(small, check, prompt_len=20, chunks=[5, 5], decodes=6)
counted = {hook: sum(entry[0] == hook for entry in check.log) for hook in ("attend_kv", "on_prefill", "on_decode")}
assert calls == counted, f"you predicted {calls}, the cache made {counted}: an extend chunk is one step"
assert all(len(kv) == slots_at_end for kv in end.layers), \
    f"the layers hold {[len(kv) for kv in end.layers]} slots: StreamingLLM evicts after every step"
print("hook calls:", counted, "| slots per layer at the end:", [len(kv) for kv in end.layers])
