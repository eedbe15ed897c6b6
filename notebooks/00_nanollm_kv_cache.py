# %% [markdown]
# # 00 The KV cache: what it stores, what it saves, what it costs
#
# **Before this lesson**: PyTorch (tensors, `nn.Module`, forward hooks) and attention (queries, keys, values,
# the softmax over scaled dot products, causal masking, multiple heads); nothing else. The symbols are the
# book's, listed in [notebooks/README.md](README.md); the metrics later lessons print are defined in the
# [metrics glossary](README.md#metrics).
#
# Every method in this course changes *what the KV cache keeps*. Before compressing a cache, this lesson
# looks at the plain one: what does a decoder store between two steps, what does that save, what does it cost?
#
# **You will learn**
#
# 1. what the cache stores instead of recomputing, built by hand and checked against the library's;
# 2. how many bytes it takes, and what grouped-query attention saves;
# 3. that it computes *exactly* what the plain forward computes, and how much time it saves;
# 4. why it stores every entry's position (RoPE), which keeps attention right after a method evicts entries;
# 5. when a method may act.
#
# The model is nanollm's `TINY` preset with random weights: the cache does not care what the weights are.
# (The `TINY` the first cell imports is another thing: True only in a quick check of the notebook, where some
# cells use smaller sizes.) Code: `nanollm/storage.py`, `nanollm/cache.py`, `nanollm/generation.py`.

# %% tags=["setup"]
from preamble import TINY

from nanollm import Transformer, preset

config = preset("TINY", max_seq_len=2048)     # 2 layers, 4 query heads, 2 KV heads; room for 2048 tokens
model = Transformer(config).eval()            # random weights (seeded)

# %% [markdown]
# ## 1. What is recomputed without a cache
#
# A decoder produces one token per step. At step $t$ the new token's query must attend to the keys and values
# of **all** earlier tokens, in every layer. Without a cache the only way to get them is to run the whole
# prefix through the model again. But attention is causal: a token's key and value never depend on later
# tokens, so they can be computed once and **stored**: that store is the KV cache, a `KVCache` in nanollm.
# Three calls run a model with one:
#
# * `prefill(model, ids, cache)` runs a prompt through an empty cache, storing its keys and values;
# * `decode_step(model, token, cache)` runs one new token, its attention reading the stored entries;
# * `extend(model, ids, cache)` does the same for a chunk of new tokens (a question appended to a document).
#
# Below, a 4-token prompt and 8 more (random) tokens run both ways, and a hook on layer 0's key projection
# counts the rows it computes at each step.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
import torch

from nanollm import KVCache, decode_step, prefill

PROMPT, NEW = 4, 8                                            # a 4-token prompt, then 8 new tokens
x = torch.randint(0, config.vocab_size, (1, PROMPT + NEW))    # token ids (1, T)
rows = []                                                     # rows the key projection sees, per call
hook = model.blocks[0].attn.k_proj.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[1]))
with torch.no_grad():
    for t in range(PROMPT, PROMPT + NEW + 1):
        model(x[:, :t])                                       # no cache: the whole prefix, at every step
recompute, rows = rows, []
cache = KVCache(config)
prefill(model, x[:, :PROMPT], cache)                          # with the cache: the prompt once,
for t in range(PROMPT, PROMPT + NEW):
    decode_step(model, x[:, t], cache)                        # then the new token only
cached = rows
hook.remove()
print(f"key rows computed per step without a cache: {recompute}; with one: {cached}")

# %% [markdown]
# Drawn step by step, with the positions each step computes, reads from the cache, or has not seen yet:

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap

fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.4), dpi=80, sharey=True, layout="constrained")
for ax, (name, counts) in zip(axes, [("without a cache", recompute), ("with a KV cache", cached)]):
    grid = torch.zeros(len(counts), PROMPT + NEW)             # (steps, positions): 0 not seen yet,
    for step, n in enumerate(counts):
        grid[step, :PROMPT + step] = 1                        # 1 read from the cache,
        grid[step, PROMPT + step - n:PROMPT + step] = 2       # 2 computed in this step
    im = ax.imshow(grid, cmap=ListedColormap(["white", "#9ecae1", "#d62728"]), vmin=-0.5, vmax=2.5)
    ax.set(title=f"{name}: {sum(counts)} key rows computed", xlabel="token position")
axes[0].set_ylabel("step (0: the prompt)")
bar = fig.colorbar(im, ax=axes, ticks=[0, 1, 2], shrink=0.8)
bar.ax.set_yticklabels(["not seen yet", "read from cache", "computed"])
fig.suptitle("layer 0's keys at each step of a generation (counted by a hook on the key projection)")
plt.show()

# %% [markdown]
# One row per step, one column per position: red marks the key rows a step computes, blue those it reads
# from the cache. Without a cache every step recomputes the whole prefix, a triangle of work; with one each
# step computes one new row. The same holds in every layer. Per step, with $T$ tokens already seen:
#
# | one step, $T$ tokens seen | matmul work | attention work |
# |---|---|---|
# | recompute the prefix | $T$ tokens through every layer | $T^2$ query-key pairs |
# | with a KV cache | 1 token through every layer | $T$ query-key pairs |
#
# The lesson's symbols (the book's, [notebooks/README.md](README.md), plus its own from $j$ on):
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $T$ | tokens the cache has seen (the prompt, then every generated token) | `cache.seen` |
# | $t$ | the current step: a query's position | `q_pos` |
# | $n$ | a stored token's position, $0 \le n < T$ | `pos` |
# | $L$ | layers | `n_layer` |
# | $H$ | query heads | `n_head` |
# | $H_{kv}$ | KV heads ($H_{kv}$ divides $H$) | `n_kv_head` |
# | $G = H / H_{kv}$ | query heads that read one KV head | `group` |
# | $d$ | numbers per head | `head_dim` |
# | $q_t$, $k_n$ | the query at position $t$, the key at position $n$, $d$ numbers each | `q`, `k` |
# | $K$, $V$ | a KV head's stored keys and values, a row per slot | `k_buf`, `v_buf` |
# | $o_t$ | a head's attention output at $t$ | `attend` |
# | $B$ | a method's budget: entries kept per layer and KV head | `budget` |
# | $j$ | a slot (a row of the buffers) | `used` counts the filled ones |
# | $p_j$ | the position slot $j$ stores ($-1$: empty) | `pos`, `pos_buf` |
# | $M$ | the mask: $0$ where a query may look, $-\infty$ elsewhere | `visible` |
# | $b$ | bytes per stored number (4 in fp32, 2 in bf16) | `bytes_per_element` |
# | $R_n$, $\theta_i$ | RoPE's rotation at position $n$; pair $i$'s angle per position | `rotated`, `inv_freq` |
#
# nanollm stores, per layer, three tensors: `k` and `v`, shaped `(1, H_kv, T, d)`, and `pos`, shaped
# `(1, H_kv, T)`: the position of every stored entry. Here they are after a 10-token prompt:

# %% tags=["needs:append"]
cache = KVCache(config)
prefill(model, torch.randint(0, config.vocab_size, (1, 10)), cache)   # a 10-token prompt
layer0 = cache.layers[0]
print("k, v:", tuple(layer0.k.shape), tuple(layer0.v.shape), "(1, H_kv, T, d) | pos:", tuple(layer0.pos.shape))
print("positions stored by KV head 0:", layer0.pos[0, 0].tolist(), "| tokens seen:", cache.seen)

# %% [markdown]
# ### 1.1 Build it: a cache by hand
#
# A layer's cache is three preallocated buffers per KV head: keys, values, and each entry's position ($-1$
# marks an empty slot). A step **appends** its new keys and values into the next free slots, then its
# queries **attend** over everything stored (Vaswani et al., 2017, §3.2.1, Eq. 1, with the causal mask):
#
# $$o_t = \text{softmax}\!\left(\frac{q_t K^\top}{\sqrt{d}} + M\right) V, \qquad
# M_j = \begin{cases} 0 & \text{if } 0 \le p_j \le t \\ -\infty & \text{otherwise.}
# \end{cases}$$
#
# The mask reads the *stored* positions $p_j$, not slot numbers $j$, which keeps it right once a method has
# evicted entries (section 5). Each KV head serves $G$ query heads (grouped-query attention). The buffers:

# %%
import torch                                                   # (again: this cell needs no task of the course)

CAPACITY = 64                                                  # slots preallocated per KV head
k_buf = torch.zeros(1, config.n_kv_head, CAPACITY, config.head_dim)   # (1, H_kv, slots, d)
v_buf = torch.zeros_like(k_buf)
pos_buf = torch.full((1, config.n_kv_head, CAPACITY), -1)     # (1, H_kv, slots): -1 marks an empty slot
used = 0                                                       # slots filled so far

# %% [markdown]
# To check the hand-built cache we record layer 0's calls of `KVCache.attend` (the step's queries, their
# positions, their new keys and values, and the output) on a prefill of 6 tokens, an `extend` chunk of 5 and
# one decode step.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
from nanollm import extend

library, calls = KVCache(config), []                          # the library's cache, layer 0's calls recorded
library_attend = library.attend


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
print(f"{len(calls)} calls of layer 0 recorded, of {[q.shape[2] for q, *_ in calls]} queries")

# %% [markdown]
# The two functions by hand, `append` and `attend` (Eq. 1); every recorded call, replayed through them, must
# give the library's output and store what the library stored.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
# BEGIN SOLUTION [cache:append] write k, v and pos into the next free slots of the buffers; count them in `used`
def append(k, v, pos):
    """Write a step's keys and values (batch, H_kv, n_new, d) at positions pos (n_new,) into the next free slots."""
    global used
    n_new = k.shape[2]                                         # the step's new tokens
    end = used + n_new
    k_buf[:, :, used:end], v_buf[:, :, used:end], pos_buf[:, :, used:end] = k, v, pos
    used = end
# END SOLUTION


# BEGIN SOLUTION [cache:mask] Vaswani §3.2.1 (Eq. 1): repeat each KV head for its query heads, mask from positions
def attend(q, q_pos):
    """Queries q (batch, H, Tq, d) at positions q_pos (Tq,) over every stored entry -> (batch, H, Tq, d)."""
    group = q.shape[1] // config.n_kv_head                     # query heads per KV head (GQA)
    k, v, pos = (t[:, :, :used].repeat_interleave(group, dim=1) for t in (k_buf, v_buf, pos_buf))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5      # (batch, H, Tq, used)
    visible = (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= q_pos[:, None])   # the mask M
    return scores.masked_fill(~visible, float("-inf")).softmax(dim=-1) @ v
# END SOLUTION


for q, pos, (k, v), out in calls:                              # replay: the same inputs, by hand
    append(k, v, pos)
    mine = attend(q, pos)
    assert torch.allclose(mine, out, rtol=1e-5, atol=1e-6), f"at {pos.tolist()}: off by {(mine - out).abs().max():.1e}"
stored = library.layers[0]
assert torch.equal(k_buf[:, :, :used], stored.k) and torch.equal(pos_buf[:, :, :used], stored.pos), "stored otherwise"
print(f"by hand == KVCache on layer 0 over {len(calls)} steps (prefill of 6, extend of 5, one decode step): "
      f"{used} slots filled, positions {pos_buf[0, 0, :used].tolist()}")

# %% [markdown]
# The library does the same with more care (`nanollm/storage.py` grows the buffers when they fill,
# `nanollm/attention.py` scores a KV head's $G$ query heads without repeating the keys). Everything below uses
# the library.
#
# ## 2. How big is it? The memory formula
#
# Each token adds one key and one value vector per layer and per **KV head**:
#
# $$\text{bytes}(T) = 2 \cdot L \cdot H_{kv} \cdot d \cdot b \cdot T$$
#
# (the 2 is K and V). Grouped-query attention (GQA; Ainslie et al., 2023, §2) lets $H$ query heads share
# $H_{kv}$ KV heads, so the cache shrinks by $G = H / H_{kv}$ against multi-head attention (MHA, one KV head
# per query head). `ModelConfig.kv_bytes_per_token(bytes_per_element)` computes the formula for one token:

# %%
print(f"{'preset':<13} {'L':>3} {'H':>3} {'H_kv':>5} {'d':>4} | {'KiB/token fp32':>14} {'KiB/token bf16':>14} | "
      f"{'GQA saves':>9} | MiB at max_seq_len, bf16")
for name in ["TINY", "SMALL", "GPT2_124M", "TINYLLAMA_1B"]:
    c = preset(name)
    fp32, bf16 = c.kv_bytes_per_token(bytes_per_element=4), c.kv_bytes_per_token(bytes_per_element=2)
    print(f"{name:<13} {c.n_layer:>3} {c.n_head:>3} {c.n_kv_head:>5} {c.head_dim:>4} | {fp32 / 1024:>14.1f} "
          f"{bf16 / 1024:>14.1f} | {c.n_head // c.n_kv_head:>8}x | {bf16 * c.max_seq_len / 2**20:.1f} "
          f"({c.max_seq_len} tokens)")

# %% [markdown]
# TinyLlama's 32 query heads share 4 KV heads: its cache is 8 times smaller than with MHA. The formula is
# exact: `cache.nbytes()` counts the bytes of the keys and values in use (not the stored positions). For the
# 10-token cache of section 1 (fp32):

# %% tags=["needs:append"]
print("cache.nbytes()                    :", cache.nbytes())
print("kv_bytes_per_token() * 10 tokens  :", config.kv_bytes_per_token() * 10)

# %% [markdown]
# The cache grows by the same bytes with every token, without end. Every method of this course stops that
# growth at a budget $B$ of entries per layer and KV head: which entries to keep is the whole question.
#
# ## 3. The cache changes nothing (in fp32)
#
# The logits of one uncached forward over 48 tokens, against (a) prefilling 1 token and decoding the rest one
# at a time, and (b) prefilling 20 tokens and `extend`ing by the rest in one chunk, for both of nanollm's model
# flavours, Llama-style (GQA) and GPT-2-style (MHA):

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
for name in ["TINY", "TINY_GPT2"]:
    m = Transformer(preset(name)).eval()
    x = torch.randint(0, m.config.vocab_size, (1, 48))
    with torch.no_grad():
        full = m(x)                                              # (1, T, vocab), no cache
    c = KVCache(m.config)
    stepwise = torch.cat([prefill(m, x[:, :1], c)] + [decode_step(m, x[:, t], c)[:, None] for t in range(1, 48)], 1)
    c = KVCache(m.config)
    chunked = torch.cat([prefill(m, x[:, :20], c), extend(m, x[:, 20:], c)], dim=1)
    print(f"{name:<10} max |logits diff|: step by step {(stepwise - full).abs().max():.1e}, "
          f"prefill + extend {(chunked - full).abs().max():.1e}  (logits up to {full.abs().max():.2f})")

# %% [markdown]
# Differences of a few 1e-7, against logits of order 1, are fp32 rounding: the same sums in a different
# order. (In bf16 the gaps are visibly larger, so low-precision checks compare greedy tokens instead.)
#
# ## 4. What the cache buys: time per decode step
#
# `run_bench` times, at each context length, one cached `decode_step` against one uncached forward over the
# whole prefix, on one thread: read the ratios, not the milliseconds, which depend on the machine.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
from nanollm.cli.bench import run_bench

CONTEXTS = [32, 64, 128] if TINY else [128, 256, 512, 1024]     # tokens already in the cache
bench = run_bench(config, contexts=CONTEXTS, repeats=2 if TINY else 5, steps=2 if TINY else 8, threads=1)
fig, ax = plt.subplots(figsize=(6.5, 3.6), dpi=80)
for mode, style in [("recompute", "o-"), ("cached", "s-")]:
    ax.plot(CONTEXTS, [getattr(r, f"{mode}_ms") for r in bench.rows], style, label=f"{mode} (median)")
    ax.fill_between(CONTEXTS, *zip(*[getattr(r, f"{mode}_iqr_ms") for r in bench.rows]), alpha=0.25)
ax.set(xscale="log", yscale="log", xlabel="context (tokens already seen)", ylabel="ms per decode step",
       title="cost of one new token, with and without the cache")
ax.set_xticks(CONTEXTS, [str(c) for c in CONTEXTS])
ax.yaxis.set_major_formatter("{x:g}")
ax.minorticks_off()
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
plt.show()
print("speedup (recompute time / cached time):", ", ".join(f"{r.speedup:.1f}x at {r.context}" for r in bench.rows))

# %% [markdown]
# The figure plots the time of one decode step (the median of the repeats, the shaded bands their quartiles)
# against the context, both axes logarithmic. The recomputing step (blue) climbs with the context, since it
# re-runs the whole prefix; the cached step (orange) grows far more slowly, only through its attention over
# the stored entries, so the speedup grows with the context. At these lengths the cached step is mostly the
# fixed cost of one token through the layers.
#
# ## 5. Positions: RoPE, and why eviction keeps them true
#
# ### 5.1 RoPE in brief
#
# A Llama-style model tells attention where tokens are with rotary position embeddings (RoPE; Su et al.,
# 2021, §3.4): the $d$ numbers of a query or key form $d/2$ pairs, and at position $n$ pair $i$ is turned by
# the angle $n\,\theta_i$, with $\theta_i = 10000^{-2i/d}$. Call $R_n$ that rotation. Rotations compose, so a
# score depends on the two positions only through their distance:
#
# $$(R_t\, q_t)^\top (R_n\, k_n) = q_t^\top R_{n-t}\, k_n .$$
#
# So a key can be rotated **once**, at its own position, when it is stored, as long as every token is rotated
# at its true position. Below, one random query and one random key, rotated at three pairs of positions:

# %%
from nanollm.attention import apply_rope, rope_cos_sin, rope_inv_freq

inv_freq = rope_inv_freq(config)                                    # theta_i, (d/2,)
q, k = torch.randn(1, 1, 1, config.head_dim), torch.randn(1, 1, 1, config.head_dim)   # one query, one key


def rotated(x, position):
    """R_position x: pair i of x turned by the angle position * theta_i."""
    cos, sin = rope_cos_sin(torch.tensor([position]), inv_freq, x.dtype)
    return apply_rope(x, cos, sin)


for t, n in [(5, 2), (1005, 1002), (5, 4)]:
    print(f"query at {t:>4}, key at {n:>4} (distance {t - n}): score {(rotated(q, t) * rotated(k, n)).sum():+.4f}")

# %% [markdown]
# The first two pairs are 3 positions apart and give the same score, though the second sits a thousand
# positions later; the third pair, 1 apart, gives another score. What attention reads from positions is
# distances, and the cache must keep them true.
#
# ### 5.2 Eviction keeps positions true
#
# A method evicts with `keep(idx)` of a layer's storage (`LayerKV`, `nanollm/storage.py`): `idx` holds, for
# each KV head, the slots to keep ($-1$ makes an empty slot, which attention skips); the stored positions move
# with the keys. Two facts keep eviction correct: keys are cached *after* RoPE, so a kept key never needs
# rotating again; and the next token gets position `cache.seen` ($T$), not the number of slots in use, while
# the mask $M$ reads the stored positions $p_j$, not slot numbers. (`evict(idx)` moves nothing: the dropped
# slots get position $-1$ and the next append writes into them.)
#
# Below, a 12-token prompt; in layer 0 each KV head keeps 6 slots (KV head 1 one of them empty), then one
# more token is decoded.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
cache = KVCache(config)
prefill(model, torch.randint(0, config.vocab_size, (1, 12)), cache)
kv = cache.layers[0]
k_before = kv.k.clone()
idx = torch.tensor([[[0, 1, 5, 9, 10, 11], [0, 1, 7, 10, 11, -1]]])   # (1, H_kv, 6): the slots each head keeps
kv.keep(idx)
unchanged = torch.equal(kv.k[0, 0], k_before[0, 0, idx[0, 0]])
decode_step(model, torch.tensor([7]), cache)                          # one more token
for h in range(config.n_kv_head):
    print(f"KV head {h}, the position stored in each slot: {kv.pos[0, h].tolist()}")
print(f"kept keys unchanged: {unchanged}; the new token got position {int(kv.pos[0, 0, -1])}, the tokens seen "
      f"before it, in slot {len(kv) - 1}")

# %% [markdown]
# Slot and position part ways: each head stores its own positions, head 1 has an empty slot (position -1),
# and the decoded token got the number of tokens seen as its position, not its slot number, so its scores
# with the kept keys depend on the true distances (section 5.1).
#
# ## 6. When a method acts: the policy hooks
#
# A method is a `CachePolicy` (`nanollm/policy.py`) and acts only through three of its methods, its *hooks*,
# which `KVCache.attend` calls inside every layer's attention, after the step's new entries were appended:
#
# * `attend_kv(layer, store)`: what the step's queries attend to (the storage itself, unless the method
#   rebuilds entries of its own);
# * `on_prefill(ctx)`: after the layer attended over the whole prompt (the cache was empty); `ctx` holds the
#   step's queries, their attention and the layer's storage `ctx.kv`, from which the method may evict;
# * `on_decode(ctx)`: after the layer attended in a decode step *or an `extend` chunk*.
#
# To see the order, a subclass of StreamingLLM (`methods/streaming_llm.py`, which keeps a budget $B$ of
# entries per KV head: the first 2 tokens, the "sinks", and the most recent ones) records every call and the
# slots the layer holds before and after it.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
from methods.streaming_llm import StreamingLLMPolicy


class LoggedStreamingLLM(StreamingLLMPolicy):
    """StreamingLLM, unchanged, recording every hook call: (step, hook, layer, slots before, slots after)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.log, self.step = [], ""

    def attend_kv(self, layer, store):
        self.log.append((self.step, "attend_kv", layer, len(store), len(store)))
        return super().attend_kv(layer, store)

    def on_prefill(self, ctx):
        before = len(ctx.kv)
        super().on_prefill(ctx)
        self.log.append((self.step, "on_prefill", ctx.layer, before, len(ctx.kv)))

    def on_decode(self, ctx):
        before = len(ctx.kv)
        super().on_decode(ctx)
        self.log.append((self.step, "on_decode", ctx.layer, before, len(ctx.kv)))


# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
def run_logged(model, policy, prompt_len, chunks, decodes):
    """A runner: prefill ``prompt_len`` random tokens, ``extend`` by each chunk length, then ``decodes`` steps."""
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len + sum(chunks) + decodes))
    cache = KVCache(model.config, policy)
    policy.step = f"prefill {prompt_len}"
    prefill(model, ids[:, :prompt_len], cache)
    t = prompt_len
    for n in chunks:
        policy.step = f"extend {n}"
        extend(model, ids[:, t:t + n], cache)
        t += n
    for i in range(decodes):
        policy.step = f"decode {i + 1}"
        decode_step(model, ids[:, t + i], cache)
    return cache

# %% [markdown]
# Here, with $B$ = 8: a prefill of 10 tokens, an `extend` chunk of 4 and 3 decode steps; one line per step,
# the calls in order, each with the slots the layer held (before -> after, where the hook changed them):

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
policy = LoggedStreamingLLM(budget=8, n_sink=2)
logged = run_logged(model, policy, prompt_len=10, chunks=[4], decodes=3)
for step in dict.fromkeys(entry[0] for entry in policy.log):
    print(f"{step:<10}", " | ".join(f"layer {layer} {hook} {a}" + (f" -> {b}" if b != a else "")
                                    for s, hook, layer, a, b in policy.log if s == step))
print(f"{len(policy.log)} hook calls; slots per layer at the end: {[len(kv) for kv in logged.layers]}")

# %% [markdown]
# Layer by layer, each layer gets `attend_kv`, the attention, then `on_prefill` or `on_decode`, before the
# next layer starts. The slots `attend_kv` counts already include the step's new tokens, so an eviction only
# affects the *next* step. An `extend` chunk is a decode step: the phase is "prefill" only while the cache is
# empty, so a method that compresses only the prompt never compresses an appended question. When to evict is
# the method's choice: StreamingLLM evicts after every step (`compress_on = ("prefill", "decode")`).
#
# ## Exercises
#
# Each exercise has a cell where you write (replace the `None`), a check cell that reads only your answer
# (it says "not answered yet" until you do, stops with a hint when the answer is wrong, and says "right"
# when it is), and the reference answer, collapsed: open it once you are done.
#
# ### Exercise 1: memory arithmetic
#
# Llama-3-8B has 32 layers, 32 query heads, 8 KV heads and head dimension 128. How many GiB ($2^{30}$ bytes)
# does its KV cache take for one sequence of 131072 tokens (128k) in bf16? How much would it take without GQA
# (one KV head per query head)? Use the formula of section 2.

# %%
my_gib_gqa = None    # replace None: GiB, Llama-3-8B with its 8 KV heads, bf16, one sequence of 131072 tokens
my_gib_mha = None    # replace None: GiB, the same model and sequence with 32 KV heads (no GQA)

# %%
from exercises import exercise
from nanollm import ModelConfig


@exercise("Exercise 1")
def check_memory(gib_gqa, gib_mha):
    def gib(n_kv_head):                        # the library's bytes per token (bf16), times the tokens, in GiB
        c = ModelConfig(n_layer=32, n_head=32, n_kv_head=n_kv_head, d_model=4096, vocab_size=128256)
        return c.kv_bytes_per_token(bytes_per_element=2) * 131072 / 2**30
    assert abs(gib_gqa - gib(8)) < 1e-6, "with GQA: bytes = 2 (a key and a value) x L x H_kv x d x b x T, with " \
                                         "H_kv = 8 and b = 2 bytes in bf16; then divide by 2**30"
    assert abs(gib_mha - gib(32)) < 1e-6, "without GQA, H_kv is the number of query heads, H"
    return "GQA divides the cache by G = H / H_kv."


check_memory(my_gib_gqa, my_gib_mha)

# %%
# BEGIN SOLUTION [cache] bytes = 2 (K, V) x layers x KV heads x head_dim x 2 (bf16) x tokens; GiB = 2**30 bytes
reference_gib_gqa = 2 * 32 * 8 * 128 * 2 * 131072 / 2**30
reference_gib_mha = 2 * 32 * 32 * 128 * 2 * 131072 / 2**30
# END SOLUTION
check_memory(reference_gib_gqa, reference_gib_mha)

# %% [markdown]
# ### Exercise 2: break it on purpose
#
# In section 5.2 the new token came after the `keep`: 12 tokens seen, 6 slots in use. Suppose it had been
# given the slots in use, 6, as its position instead of `cache.seen`, 12.
#
# * (a) What distance would its query see to the key at position 11, and what is the true one? (A distance,
#   as in section 5.1, is the query's position minus the key's.)
# * (b) A query at position $t$ sees the entries at positions $p_j$ with $0 \le p_j \le t$ (the mask $M$).
#   Of the six keys KV head 0 kept (positions 0, 1, 5, 9, 10 and 11), how many would the new token still see?

# %%
my_distance_wrong = None    # replace None: (a) the distance a query at position 6 sees to the key at 11
my_distance_true = None     # replace None: (a) the true distance: the query at position 12
my_visible = None           # replace None: (b) how many of the six kept keys a query at position 6 sees

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
from nanollm import attention
from nanollm.policy import Needs


@exercise("Exercise 2")
def check_break_it(distance_wrong, distance_true, visible):
    score = lambda t, n: float((rotated(q, t) * rotated(k, n)).sum())    # section 5.1's q at t, its k at n
    for t, distance in [(6, distance_wrong), (12, distance_true)]:
        assert abs(score(t, 11) - score(500 + distance, 500)) < 1e-4, \
            f"(a) the query at {t}: RoPE's score sees the query's position minus the key's (section 5.1)"
    _, probs, _ = attention.attend(torch.randn(1, config.n_head, 1, config.head_dim), kv.k[:, :, :6],
                                   kv.v[:, :, :6], torch.tensor([6]), kv.pos[:, :, :6], Needs(rows=1))
    assert visible == int((probs[0, 0, 0] > 0).sum()), \
        "(b) the mask keeps the stored positions from 0 up to the query's own, and hides the later ones"


check_break_it(my_distance_wrong, my_distance_true, my_visible)

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
# BEGIN SOLUTION [cache] the distance is the query's position minus the key's; the mask hides later positions
reference_distance_wrong, reference_distance_true = 6 - 11, 12 - 11
reference_visible = 3                          # positions 0, 1 and 5; the keys at 9, 10 and 11 lie after 6
# END SOLUTION
check_break_it(reference_distance_wrong, reference_distance_true, reference_visible)
print("With position 6, the key at 11 would look 5 positions ahead of the query, and the mask would hide the "
      "three most recent tokens from it.")

# %% [markdown]
# ### Exercise 3: count the hook calls
#
# Predict, without running it, the hook calls for the SMALL preset (4 layers) with the logged StreamingLLM
# of section 6, now with a budget of 6 (`LoggedStreamingLLM(budget=6, n_sink=2)`), over a prompt of 20
# tokens, two `extend` chunks of 5 tokens and 6 decode steps: how many calls of each hook, and how many slots
# each layer holds at the end.

# %%
my_calls = {"attend_kv": None, "on_prefill": None, "on_decode": None}   # replace each None: calls of the hook
my_slots = None                                                          # replace None: slots per layer at the end

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
@exercise("Exercise 3")
def check_hook_calls(calls, slots):
    logged_policy = LoggedStreamingLLM(budget=6, n_sink=2)
    small = run_logged(Transformer(preset("SMALL")).eval(), logged_policy, prompt_len=20, chunks=[5, 5], decodes=6)
    counted = {h: sum(entry[1] == h for entry in logged_policy.log) for h in ("attend_kv", "on_prefill", "on_decode")}
    assert sorted(calls) == sorted(counted), "one count for each of the three hooks"
    assert calls["on_prefill"] == counted["on_prefill"], "on_prefill: once per layer, in the step that fills an " \
                                                         "empty cache"
    assert calls == counted, "each step (the prefill, an extend chunk, a decode step) calls attend_kv, then " \
                             "on_prefill or on_decode, once in every layer: count the steps, not the tokens"
    assert all(len(layer) == slots for layer in small.layers), "StreamingLLM evicts after every step, back to " \
                                                               "its budget"


check_hook_calls(my_calls, my_slots)

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
# BEGIN SOLUTION [cache] per step and layer: attend_kv, then on_prefill (first step) or on_decode (later steps)
n_layers, n_steps = 4, 1 + 2 + 6                 # the prefill, two extend chunks, six decode steps
reference_calls = {"attend_kv": n_layers * n_steps, "on_prefill": n_layers, "on_decode": n_layers * (n_steps - 1)}
reference_slots = 6                              # back to the budget after every step
# END SOLUTION
check_hook_calls(reference_calls, reference_slots)
