# %% [markdown]
# # 00 The KV cache: what it stores, what it saves, what it costs
#
# Every method in this project changes *what the KV cache keeps*. Before compressing a cache, this
# notebook looks at the plain one: what it stores, what it saves, what it costs.
#
# **You will learn**
#
# 1. what a decoder recomputes at every step when it has no cache, and what the cache stores instead
#    (drawn from a real generation), and a cache built by hand in a few lines: the append and the attention
#    over stored entries, checked against the library's;
# 2. the memory formula `2 * n_layer * n_kv_head * head_dim * bytes * T`, and what grouped-query attention saves;
# 3. that cached decoding computes *exactly* what the plain forward computes (fp32);
# 4. how the cost of one decode step grows with the context, with and without the cache;
# 5. why the cache stores each token's *position*, and why that keeps RoPE right after eviction (drawn
#    from a real cache before and after a method evicts);
# 6. when a method acts: the order in which the cache calls a policy's hooks, layer by layer, over a
#    prefill, an `extend` chunk and decode steps (recorded, then drawn).
#
# How the storage grows without copying (and what the textbook `torch.cat` append would cost) is measured
# in notebook `07_kernels`, section 2, beside the roofline of a decode step.
#
# Code: `nanollm/cache.py` and `nanollm/storage.py` (storage), `nanollm/generation.py` (prefill / extend
# / decode_step), `nanollm/policy.py` (the hooks), `nanollm/cli/bench.py` (timings). Section 1.1 builds
# the cache's core by hand; the rest imports the library. The timings below were measured on the machine
# that built this notebook (printed in the next cell), on one thread: read their ratios, not their
# milliseconds.

# %%
import os
import sys

TINY = os.environ.get("NANOLLM_TINY") == "1"      # CI runs the notebook in a quick tiny mode
if not os.path.isdir("nanollm") and os.path.isdir(os.path.join("..", "nanollm")):
    sys.path.insert(0, os.path.abspath(".."))      # opened from notebooks/: make the repo importable

import platform

import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullFormatter

from methods.evaluation.viz import print_mode
from nanollm import KVCache, Transformer, decode_step, extend, prefill, preset
from nanollm.cli.bench import run_bench

CONTEXTS = [32, 64, 128] if TINY else [128, 256, 512, 1024]   # context lengths for the timings
REPEATS, STEPS = (2, 2) if TINY else (5, 8)                   # medians of REPEATS x STEPS decode steps
GROW_TOKENS = 64 if TINY else 512                             # tokens generated in the memory plot
torch.manual_seed(0)
config = preset("TINY", max_seq_len=2048)                     # the model of this notebook (room for long runs)
model = Transformer(config).eval()                            # random weights: the cache does not care
print(f"tiny mode: {TINY}; torch {torch.__version__}; machine: {platform.system()} {platform.machine()}, "
      f"{os.cpu_count()} CPU cores")
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
# Below, the model generates a few tokens both ways, and a hook on layer 0's key projection counts the
# rows it computes at each step: the whole prefix without a cache, one row with it.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
PROMPT, NEW = 4, 8                                            # a 4-token prompt, then 8 new tokens
x = torch.randint(0, config.vocab_size, (1, PROMPT + NEW))
counts = []                                                   # rows of x the K projection sees, per call
hook = model.blocks[0].attn.k_proj.register_forward_hook(lambda mod, inp, out: counts.append(inp[0].shape[1]))
with torch.no_grad():
    for t in range(PROMPT, PROMPT + NEW + 1):
        model(x[:, :t])                                       # no cache: the whole prefix, at every step
recompute, counts = counts, []
cache = KVCache(config)
prefill(model, x[:, :PROMPT], cache)
for t in range(PROMPT, PROMPT + NEW):
    decode_step(model, x[:, t], cache)                        # with the cache: the new token only
cached = counts
hook.remove()


def step_grid(rows_computed):
    """(steps, positions): 0 not seen yet, 1 read from the cache, 2 computed in this step."""
    grid = torch.zeros(len(rows_computed), PROMPT + NEW)
    for step, n in enumerate(rows_computed):
        seen = PROMPT + step                                  # the prompt, then one more token per step
        grid[step, :seen] = 1
        grid[step, seen - n:seen] = 2
    return grid


fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), dpi=80, sharey=True, layout="constrained")
for ax, (name, rows) in zip(axes, [("without a cache", recompute), ("with a KV cache", cached)]):
    im = ax.imshow(step_grid(rows), cmap=ListedColormap(["white", "#9ecae1", "#d62728"]), vmin=-0.5, vmax=2.5)
    ax.set_title(f"{name}: {sum(rows)} key rows computed")
    ax.set_xlabel("token position")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
axes[0].set_ylabel("step (0: the prompt)")
bar = fig.colorbar(im, ax=axes, ticks=[0, 1, 2], shrink=0.8)
bar.ax.set_yticklabels(["not seen yet", "read from the cache", "computed"])
fig.suptitle("layer 0's keys at each step of a generation (counted by a hook on the key projection)")
plt.show()
print(f"{NEW} new tokens after a {PROMPT}-token prompt: layer 0 computed {sum(recompute)} key rows without a "
      f"cache, {sum(cached)} with one")

# %% [markdown]
# Without a cache every step recomputes the keys (and values, queries, MLPs) of the whole prefix, a
# triangle of work that grows with each step; with a cache each step computes one new row and reads the
# others. The same holds in every layer. Per step, at context *t*:
#
# | one step at context *t* | matmul work | attention work |
# |---|---|---|
# | recompute the prefix | *t* tokens through every layer | *t*² query-key pairs |
# | with a KV cache | 1 token through every layer | *t* query-key pairs |
#
# nanollm stores, per layer, `k, v: (B, H_kv, T, d)` (keys *after* RoPE) and `pos: (B, H_kv, T)`,
# the absolute position of every stored entry. Let's look at one.

# %% tags=["needs:append"]
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
# ### 1.1 Build it: a cache by hand
#
# A layer's cache is three preallocated buffers per KV head: keys, values, and the position of each stored
# entry (-1 marks an empty slot). A step **appends** its new keys and values into the next free slots, then
# its queries **attend** over everything stored:
#
# $$\text{out} = \text{softmax}\!\left(\frac{q K^\top}{\sqrt{d}} + M\right) V, \qquad
# M_{ij} = \begin{cases} 0 & \text{if } 0 \le \text{pos}_j \le \text{qpos}_i \\ -\infty & \text{otherwise}
# \end{cases}$$
#
# (Vaswani et al., 2017, §3.2.1, Eq. 1, with the causal mask). The mask is built from the *stored* positions, not
# from slot numbers: that is what keeps it right once a method has evicted entries (section 5). With
# grouped-query attention, each KV head serves a group of query heads, so its entries are repeated for them.
# Below, the two functions by hand, then the library's cache on a real run (a prefill, an `extend` chunk,
# a decode step): every call of layer 0 is replayed through the hand-built cache and must give the same
# output.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
CAPACITY = 64                                                  # slots preallocated per KV head
k_buf = torch.zeros(1, config.n_kv_head, CAPACITY, config.head_dim)   # (B, H_kv, slots, d)
v_buf = torch.zeros_like(k_buf)
pos_buf = torch.full((1, config.n_kv_head, CAPACITY), -1)     # (B, H_kv, slots): -1 marks an empty slot
used = 0                                                       # slots filled so far


# BEGIN SOLUTION [cache:append] write k, v and pos into the next free slots of the buffers; count them in `used`
def append(k, v, pos):
    """Write a step's keys and values (B, H_kv, T, d) at positions pos (T,) into the next free slots."""
    global used
    T = k.shape[2]
    k_buf[:, :, used:used + T], v_buf[:, :, used:used + T], pos_buf[:, :, used:used + T] = k, v, pos
    used += T
# END SOLUTION


# BEGIN SOLUTION [cache:mask] Vaswani §3.2.1 (Eq. 1): repeat each KV head for its query heads, mask from positions
def attend(q, q_pos):
    """Queries q (B, H, Tq, d) at positions q_pos (Tq,) over every stored entry -> (B, H, Tq, d)."""
    group = q.shape[1] // config.n_kv_head                     # query heads per KV head (GQA)
    k, v, pos = (t[:, :, :used].repeat_interleave(group, dim=1) for t in (k_buf, v_buf, pos_buf))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5      # (B, H, Tq, used)
    visible = (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= q_pos[:, None])   # the mask M
    return scores.masked_fill(~visible, float("-inf")).softmax(dim=-1) @ v
# END SOLUTION


library = KVCache(config)                                      # the library's cache, layer 0's calls recorded
calls, library_attend = [], library.attend


def recorded(layer, module, q, pos, new):
    out = library_attend(layer, module, q, pos, new)
    if layer == 0:
        calls.append((q, pos, new, out))
    return out


library.attend = recorded
ids = torch.randint(0, config.vocab_size, (1, 12))
prefill(model, ids[:, :6], library)
extend(model, ids[:, 6:11], library)
decode_step(model, ids[:, 11], library)
for q, pos, (k, v), out in calls:                              # replay: the same inputs, by hand
    append(k, v, pos)
    mine = attend(q, pos)
    assert torch.allclose(mine, out, rtol=1e-5, atol=1e-6), f"at {pos.tolist()}: off by {(mine - out).abs().max():.1e}"
stored = library.layers[0]
assert torch.equal(k_buf[:, :, :used], stored.k) and torch.equal(pos_buf[:, :, :used], stored.pos), "stored otherwise"
print(f"by hand == KVCache on layer 0 over {len(calls)} steps (prefill of 6, extend of 5, one decode step): "
      f"{used} slots filled, positions {pos_buf[0, 0, :used].tolist()}")

# %% [markdown]
# The library does the same with more care: `nanollm/storage.py` grows the buffers when they fill (the
# `cache` assignment's `append`), and `nanollm/attention.py` computes the scores per group without
# repeating the keys (`group_scores`) and builds the mask (`mask`). Everything below uses the library.

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

# %% tags=["needs:append"]
print("cache.nbytes()                         :", cache.nbytes())
print("kv_bytes_per_token() * tokens * batch  :", config.kv_bytes_per_token() * 10 * 2)

# %% [markdown]
# ## 3. The cache changes nothing (in fp32)
#
# Cached decoding must compute what the plain forward computes. Below: the logits of a full uncached
# forward over 48 tokens, against (a) prefilling 1 token and decoding the rest one at a time, and
# (b) prefilling 20 tokens and `extend`ing by the rest in one chunk (how a question is added after a document).
# Both flavours: Llama (RoPE, GQA) and GPT-2 (learned positions, MHA).

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
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
# visibly larger gaps (a known report: `huggingface/transformers#25420`), so low-precision checks compare
# greedy tokens instead.
#
# ## 4. What the cache buys: time per decode step
#
# `nanollm.cli.bench.run_bench` times, at each context length, one cached `decode_step` against one full
# uncached forward over the prefix (what you would run to get the next token without a cache). The
# lengths and both modes are measured interleaved, and medians are reported with the quartiles of the
# repeats as a band (most bands are thinner than the line); dotted lines are the least-squares fits
# `ms = a + b * context`. The same numbers, as a table, come from
# `python -m nanollm.cli.bench` on the command line.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
bench = run_bench(config, contexts=CONTEXTS, repeats=REPEATS, steps=STEPS, threads=1)
ctx = [r.context for r in bench.rows]


def plain_log_ticks(axis, ticks):
    """Label a log axis at ``ticks`` written plainly (0.5, 1, 2, 128, ...), without minor labels."""
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=80, layout="constrained")
for mode, style in [("recompute", "o-"), ("cached", "s-")]:
    a, b = bench.fit[mode]
    ax1.plot(ctx, [getattr(r, f"{mode}_ms") for r in bench.rows], style, label=f"{mode} (median)")
    ax1.fill_between(ctx, *zip(*[getattr(r, f"{mode}_iqr_ms") for r in bench.rows]), alpha=0.25,
                     label="quartiles of the repeats" if mode == "cached" else None)
    fit = [(t, a + b * t) for t in ctx if a + b * t > 0]
    ax1.plot(*zip(*fit), "k:", lw=1, label="least-squares fit" if mode == "cached" else None)
ax2.plot(ctx, [r.speedup for r in bench.rows], "o-", color="C2")
ax2.axhline(1, color="gray", lw=0.8)
for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain_log_ticks(ax.xaxis, ctx)
    plain_log_ticks(ax.yaxis, [0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 7, 10, 15, 20, 30, 50])
ax1.set(xlabel="context (tokens already seen)", ylabel="ms per decode step", title="cost of one new token")
ax1.legend(loc="upper left")
ax2.set(xlabel="context (tokens)", ylabel="recompute time / cached time", title="speedup of the KV cache")
plt.show()
(a_c, b_c), (a_r, b_r) = bench.fit["cached"], bench.fit["recompute"]
print(f"slopes: recompute {b_r * 1e3:.2f} ms, cached {b_c * 1e3:.3f} ms per 1k tokens of context "
      f"({b_r / b_c:.0f}x less); cached step at {ctx[-1]} tokens: {a_c / (a_c + b_c * ctx[-1]):.0%} fixed cost "
      f"(the intercept); speedup {bench.rows[0].speedup:.1f}x at {ctx[0]} tokens, "
      f"{bench.rows[-1].speedup:.1f}x at {ctx[-1]}")

# %% [markdown]
# On log axes the recomputing step climbs in proportion to the context, while the cached step stays
# nearly flat, so the speedup grows with every doubling of the context. The fitted slopes (the line printed
# under the plot) say the same in numbers: recomputing costs milliseconds more per thousand tokens of
# context, because every step re-runs the whole prefix; the cached step grows far more slowly (the printed
# ratio of the two slopes), only through the attention over the stored entries. At these lengths the cached
# step is mostly its fixed cost, the intercept: Python and small-matrix overheads of one token through the
# layers (the printed share). Even so the cache already pays at the shortest context measured. The price
# is memory, which grows linearly with the tokens seen:

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
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
# The full cache grows by the same bytes at every token, without end; the dashed line is what every
# method in `methods/` aims for: a cache that stops growing at `budget` tokens per layer per KV head,
# whatever the context length. Which tokens to keep is the whole question.
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
#
# `keep` compacts: it gathers the kept entries into fresh buffers, which a method that compresses a prompt
# once pays once. A method that drops a token at *every* decode step (StreamingLLM, H2O, Scissorhands) uses
# `LayerKV.evict(idx)` instead: the dropped slots only get position -1, and the next `append` writes the new
# token into them, so a step moves nothing. Slots then stop following positions, harmless for the same two
# reasons.
#
# Below, a 12-token prompt; each head keeps the 2 "sink" tokens, the three most recent and a different
# middle token (head 1 one fewer: an empty slot), then one more token is decoded. The picture is layer 0's storage, slot
# by slot, each slot labelled with the position it stores.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
cache = KVCache(config)
prefill(model, torch.randint(0, config.vocab_size, (1, 12)), cache)
kv = cache.layers[0]
k_before = kv.k.clone()
idx = torch.tensor([[[0, 1, 5, 9, 10, 11], [0, 1, 7, 10, 11, -1]]])    # (B=1, H_kv=2, K=6) slots to keep
kv.keep(idx)
unchanged = torch.equal(kv.k[0, 0], k_before[0, 0, idx[0, 0]])
decode_step(model, torch.tensor([7]), cache)                           # one more token

pos = kv.pos[0]                                                        # (H_kv, slots)
kind = torch.where(pos < 0, 0, torch.where(pos == cache.seen - 1, 2, 1))
plt.figure(figsize=(6.5, 2.0), dpi=80)
plt.imshow(kind, cmap=ListedColormap(["white", "#a1d99b", "#fdae6b"]), vmin=-0.5, vmax=2.5, aspect="auto")
for h in range(pos.shape[0]):
    for slot in range(pos.shape[1]):
        plt.text(slot, h, str(int(pos[h, slot])), ha="center", va="center", fontsize=10)
bar = plt.colorbar(ticks=[0, 1, 2])
bar.ax.set_yticklabels(["empty", "kept", "decoded"])
plt.xticks(range(pos.shape[1]))
plt.yticks(range(pos.shape[0]), [f"KV head {h}" for h in range(pos.shape[0])])
plt.xlabel("slot")
plt.title("layer 0 after keep and one decode step: the position stored in each slot")
plt.show()
print(f"kept keys unchanged: {unchanged}; the new token got position {int(pos[0, -1])} (tokens seen before it), "
      f"although it sits in slot {len(kv) - 1}")

# %% [markdown]
# Slot and position part ways: each head stores its own positions in its own slots, head 1 has an empty
# slot (position -1), and the decoded token sits in the last slot of both heads with the number of tokens
# seen as its position, not its slot number.
#
# ### 5.1 A real method's cache
#
# The same with a real method: the prompt (10 tokens) is prefilled into a plain cache (everything kept) and
# into a cache whose policy is SnapKV with a budget of 6 entries per KV head (`methods/snapkv.py`), which
# evicts right after each layer's prefill attention; then one token is decoded into the SnapKV cache. The
# picture has one row per layer and KV head and one column per position; a coloured cell is a position
# the head still holds, labelled with the slot that holds it. The cell compares every kept key and value
# with the full cache's entry at the same position.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
from methods.snapkv import SnapKVPolicy

prompt = torch.randint(0, config.vocab_size, (1, 10))
full = KVCache(config)
prefill(model, prompt, full)
snap = KVCache(config, SnapKVPolicy(budget=6, window=2, kernel=1))
prefill(model, prompt, snap)
decode_step(model, torch.tensor([7]), snap)

heads = [(layer, h) for layer in range(config.n_layer) for h in range(config.n_kv_head)]
state = torch.zeros(len(heads), snap.seen)                  # 0 evicted, 1 kept from the prompt, 2 decoded
fig, ax = plt.subplots(figsize=(7, 2.4), dpi=80)
same = True
for row, (layer, h) in enumerate(heads):
    kv, ref = snap.layers[layer], full.layers[layer]
    for slot, p in enumerate(kv.pos[0, h].tolist()):
        if p < 0:
            continue
        state[row, p] = 1 if p < prompt.shape[1] else 2
        ax.text(p, row, str(slot), ha="center", va="center", fontsize=9)
        if p < prompt.shape[1]:                             # the same numbers as the full cache's entry
            same &= torch.equal(kv.k[0, h, slot], ref.k[0, h, p]) and torch.equal(kv.v[0, h, slot], ref.v[0, h, p])
im = ax.imshow(state, cmap=ListedColormap(["white", "#a1d99b", "#fdae6b"]), vmin=-0.5, vmax=2.5, aspect="auto")
bar = fig.colorbar(im, ax=ax, ticks=[0, 1, 2])
bar.ax.set_yticklabels(["evicted", "kept", "decoded"])
ax.set_xticks(range(snap.seen))
ax.set_yticks(range(len(heads)), [f"layer {layer}, KV head {h}" for layer, h in heads])
ax.set(xlabel="position (label: the slot that holds it)", title="SnapKV (budget 6) after prefill and one decode step")
plt.show()
print(f"every entry SnapKV kept equals the full cache's entry at its position: {same}; "
      f"slots per head: {len(snap.layers[0])}, the decoded token at position {snap.seen - 1}")

# %% [markdown]
# Each layer and head keeps its own positions, in slots numbered in order of position, and every kept
# key and value is the full cache's entry at that position, bit for bit (printed: True). The decoded token
# lands in the next free slot with the number of tokens seen as its position: its key was rotated for
# that position, so its dot products with the kept keys, rotated at their own positions, still depend on
# the true distance.

# %% [markdown]
# ## 6. When a method acts: the policy hooks
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

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
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
ax.xaxis.set_major_locator(MaxNLocator(integer=True))
ax.set(xlabel="call order", ylabel="layer",
       title="StreamingLLM (budget 8): which hook the cache calls when (annotated: slots before -> after)")
ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
plt.tight_layout()
plt.show()
print(f"{len(policy.log)} hook calls over {len(steps)} steps; slots per layer at the end: "
      f"{[len(kv) for kv in logged.layers]}")

# %% [markdown]
# The timeline shows each step visiting the layers in order, every layer getting `attend_kv` and then one
# `on_prefill` or `on_decode`, and StreamingLLM evicting back to 8 slots right after each of them. In detail:
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
# timings in notebook `07_kernels`, section 2. (Another way out, used by gpt-fast: preallocate the cache
# for the maximum length once.)

# %% tags=["needs:append"]
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
# of section 6 (budget 8) over a prompt of 20 tokens, two `extend` chunks of 5 tokens and 6 decode steps:
# how many calls of each hook, and how many slots each layer holds at the end.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
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

# %%
from methods.evaluation.viz import print_run_time  # the whole notebook, from its first cell

print_run_time()
