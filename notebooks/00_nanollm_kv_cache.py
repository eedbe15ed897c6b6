# %% [markdown]
# # nanollm 00: the KV cache
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
# 5. why the cache stores each token's *position*, and why that keeps RoPE right after eviction;
# 6. why the textbook `torch.cat` append is O(T) per token, and how the storage grows in place instead.
#
# Code: `nanollm/cache.py` and `nanollm/storage.py` (storage), `nanollm/generation.py` (prefill / extend
# / decode_step), `nanollm/cli/bench.py` (timings). This notebook only imports them.

# %%
import os
import sys

TINY = os.environ.get("NANOLLM_TINY") == "1"      # CI runs the notebook in a quick tiny mode
if not os.path.isdir("nanollm") and os.path.isdir(os.path.join("..", "nanollm")):
    sys.path.insert(0, os.path.abspath(".."))      # opened from notebooks/: make the repo importable

import matplotlib.pyplot as plt
import torch

from nanollm import KVCache, LayerKV, Transformer, decode_step, extend, prefill, preset
from nanollm.attention import attend_step
from nanollm.cli.bench import format_result, run_bench

CONTEXTS = [32, 64, 128] if TINY else [128, 256, 512, 1024]   # context lengths for the timings
REPEATS, STEPS = (2, 2) if TINY else (5, 8)                   # medians of REPEATS x STEPS decode steps
GROW_TOKENS = 64 if TINY else 512                             # tokens generated in the memory plot
COPY_CONTEXTS = [256, 1024] if TINY else [1024, 4096, 16384]   # context lengths for the append timings
torch.manual_seed(0)
print(f"tiny mode: {TINY}; torch {torch.__version__}")

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
# Differences of ~1e-7 are fp32 rounding: the same sums in a different order. `tests/nanollm/test_model.py`
# asserts them at `atol=1e-5`. In bf16 the same comparison gives visibly larger gaps (see
# huggingface/transformers#25420), so low-precision checks compare greedy tokens instead.
#
# ## 4. What the cache buys: time per decode step
#
# `nanollm.cli.bench.run_bench` times, at each context length, one cached `decode_step` against one full
# uncached forward over the prefix (what you would run to get the next token without a cache). The
# lengths and both modes are measured interleaved, and medians are reported. The same numbers come from
# `python -m nanollm.cli.bench` on the command line.

# %%
bench = run_bench(config, contexts=CONTEXTS, repeats=REPEATS, steps=STEPS, threads=1)
print(format_result(bench, name="TINY"))

# %%
ctx = [r.context for r in bench.rows]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=80)
for mode, style in [("recompute", "o-"), ("cached", "s-")]:
    a, b = bench.fit[mode]
    ax1.plot(ctx, [getattr(r, f"{mode}_ms") for r in bench.rows], style, label=f"{mode} (measured)")
    ax1.plot(ctx, [a + b * t for t in ctx], "k:", lw=1)
ax1.set(xlabel="context (tokens already seen)", ylabel="ms per decode step", title="cost of one new token")
ax1.legend()
ax2.plot(ctx, [r.speedup for r in bench.rows], "o-", color="C2")
ax2.set(xlabel="context (tokens)", ylabel="recompute time / cached time", title="speedup of the KV cache")
ax2.axhline(1, color="gray", lw=0.8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Read the fitted slopes (dotted lines): recomputing grows by milliseconds per thousand tokens of context,
# because every step re-runs the whole prefix; the cached step grows by far less, only through the
# attention over the stored entries (section 6 shows what a naive append would add). At short contexts the
# fixed per-step cost of Python and small-matrix overheads dominates, and the cache barely helps; the longer
# the context, the bigger the win. The price is memory, which grows linearly with the tokens seen:

# %%
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
decode_step(model, torch.tensor([7]), cache)                       # one more token
print(f"slots: {len(kv)}, tokens seen: {cache.seen}")
print("positions after one decode step:\n", kv.pos[0])
print(f"the new token got position {kv.pos[0, 0, -1].item()} (tokens seen before it), "
      f"although it sits in slot {len(kv) - 1}")

# %%
kept = torch.zeros(config.n_kv_head, cache.seen)
for h in range(config.n_kv_head):
    p = kv.pos[0, h]
    kept[h, p[p >= 0]] = 1
plt.figure(figsize=(6, 1.6), dpi=80)
plt.imshow(kept, cmap="Greens", aspect="auto", vmin=0, vmax=1)
plt.yticks(range(config.n_kv_head), [f"KV head {h}" for h in range(config.n_kv_head)])
plt.xlabel("position")
plt.title("layer 0: positions kept per KV head")
plt.show()

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
plt.legend()
plt.show()

# %% [markdown]
# What the copy costs, measured: one layer shaped like a model whose cache dominates the bytes (8 KV
# heads of dimension 32, fp32), at several context lengths. Per token we time the textbook `torch.cat`
# append, `LayerKV.append`, and the attention of one query over the stored entries (`attend_step`, what
# a decode step must read anyway).

# %%
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
    attend_ms = median_ms(lambda: attend_step(q, store.k, store.v))
    rows.append((T, cat_ms, append_ms, attend_ms))
    print(f"T={T:>6}: torch.cat append {cat_ms:7.3f} ms | in-place append {append_ms:6.3f} ms | "
          f"attention over the entries {attend_ms:6.3f} ms | cat / attention = {cat_ms / attend_ms:4.1f}x")

# %% [markdown]
# At the shortest length the layer fits in the CPU's caches and fixed overheads dominate both. At the
# longer ones the `torch.cat` append reads *and writes* every stored byte, so it costs at least about as
# much as the attention's single read of them, and far more whenever the allocator has to map fresh
# memory for the new tensor: between about 1x and 12x the attention on the development machine, from run
# to run. With it, a decode step at least doubles its memory traffic, and a method that keeps 10% of the
# tokens would look *better* than it is, because its small cache is also cheap to copy. The in-place
# append costs microseconds at any length. (`python -m methods.evaluation.bench` measures whole decode steps: bytes read
# per step, the achieved GB/s against the machine's measured bandwidth, and the speedup of each
# compression method over the full cache.)
#
# ## Your turn
#
# 1. **Memory arithmetic.** Llama-3-8B has 32 layers, 32 query heads, 8 KV heads and head_dim 128.
#    How many GiB does its KV cache take for one 128k-token sequence in bf16? How much would it take
#    without GQA? (Build a `ModelConfig` with `d_model=4096` and use `kv_bytes_per_token`.)
# 2. **Where does the speedup start?** Run `python -m nanollm.cli.bench --preset SMALL` and with
#    `--threads 2`. At which context length does the cache start to pay off, and why does a larger
#    model cross over earlier?
# 3. **The price of `torch.cat`.** A textbook cache appends with `torch.cat`, copying the whole layer at
#    every step. Estimate how many bytes that moves per step at 1024 tokens for TINY (read and write),
#    and how many a whole generation of 1024 tokens moves. Compare with what the attention reads per
#    step, and with the timings of section 6. (Another way out, used by gpt-fast: preallocate the
#    cache for the maximum length once.)
# 4. **Break it on purpose.** What would go wrong if the new token were given position `len(cache)`
#    after the `keep` above? Which test in `tests/nanollm/test_model.py` would catch it?

# %%
# 1. Memory arithmetic: fill in, then compare with a neighbour.
from nanollm import ModelConfig

llama3_8b = ModelConfig(n_layer=32, n_head=32, n_kv_head=8, d_model=4096, vocab_size=128256, max_seq_len=131072)
gib_gqa = None        # your answer: llama3_8b.kv_bytes_per_token(2) * ... / 2**30
gib_mha = None        # the same model with n_kv_head = n_head
print("GQA:", gib_gqa, "GiB | MHA:", gib_mha, "GiB")

# %%
# 3. Bytes moved by a torch.cat append per decode step at T tokens (all layers, K and V): your formula here.
T = 1024
copied = None         # e.g. config.kv_bytes_per_token() * T
print("bytes copied per step at", T, "tokens:", copied)
