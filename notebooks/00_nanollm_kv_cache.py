# %% [markdown]
# # 00 The KV cache: what it stores, what it saves, what it costs
#
# Every method in this course changes *what the KV cache keeps*. Before compressing a cache, this lesson
# looks at the plain one: what does a decoder store between two steps, what does that save, what does it cost?
#
# **You will learn**
#
# 1. what a decoder recomputes at every step without a cache, what the cache stores instead, and how to build
#    one by hand, checked against the library's;
# 2. how many bytes the cache takes, and what grouped-query attention saves;
# 3. that cached decoding computes *exactly* what the plain forward computes, and how much time it saves;
# 4. how rotary position embeddings (RoPE) put a token's position into its key, and why the cache therefore
#    stores every entry's position, which keeps attention right after a method evicts entries;
# 5. at which moments of a generation the cache lets a compression method act.
#
# The model is nanollm's `TINY` preset with random weights: the cache does not care what the weights are.
# (Two things share the name: `preset("TINY")` is that model's shape; the `TINY` the first cell imports is
# True only in a quick check of the notebook (`NANOLLM_TINY=1`), where some cells use smaller sizes.)
# Code: `nanollm/storage.py`, `nanollm/cache.py`, `nanollm/generation.py`.

# %% tags=["setup"]
from preamble import TINY

from nanollm import Transformer, preset

config = preset("TINY", max_seq_len=2048)     # 2 layers, 4 query heads, 2 KV heads; room for 2048 tokens
model = Transformer(config).eval()            # random weights (seeded)

# %% [markdown]
# ## 1. What is recomputed without a cache
#
# A decoder produces one token per step. At step *t* the new token's query must attend to the keys and values
# of **all** earlier tokens, in every layer. Without a cache the only way to get them is to run the whole
# prefix through the model again, recomputing every layer's work on tokens whose results have not changed.
#
# Because attention is causal, a token's key and value never depend on later tokens. So they can be computed
# once and **stored**: that store is the KV cache, a `KVCache` in nanollm. Three calls run a model with one:
#
# * `prefill(model, ids, cache)` runs a prompt through an empty cache, storing its keys and values;
# * `decode_step(model, token, cache)` runs one new token: only its own keys and values are computed, and
#   its attention reads the stored ones;
# * `extend(model, ids, cache)` does the same for a chunk of new tokens (a question appended to a document).
#
# Below, 8 more tokens follow a 4-token prompt (random ids stand in for generated ones), run both ways, and a
# hook on layer 0's key projection counts the rows it computes at each step.

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


def step_grid(rows_computed):
    """(steps, positions): 0 not seen yet, 1 read from the cache, 2 computed in this step."""
    grid = torch.zeros(len(rows_computed), PROMPT + NEW)
    for step, n in enumerate(rows_computed):
        seen = PROMPT + step                                  # the prompt, then one more token per step
        grid[step, :seen] = 1
        grid[step, seen - n:seen] = 2
    return grid


fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.4), dpi=80, sharey=True, layout="constrained")
for ax, (name, counts) in zip(axes, [("without a cache", recompute), ("with a KV cache", cached)]):
    im = ax.imshow(step_grid(counts), cmap=ListedColormap(["white", "#9ecae1", "#d62728"]), vmin=-0.5, vmax=2.5)
    ax.set(title=f"{name}: {sum(counts)} key rows computed", xlabel="token position")
axes[0].set_ylabel("step (0: the prompt)")
bar = fig.colorbar(im, ax=axes, ticks=[0, 1, 2], shrink=0.8)
bar.ax.set_yticklabels(["not seen yet", "read from cache", "computed"])
fig.suptitle("layer 0's keys at each step of a generation (counted by a hook on the key projection)")
plt.show()

# %% [markdown]
# The figure has one row per step and one column per token position: red marks the key rows a step computes,
# blue the rows it reads from the cache, white the positions not generated yet. Without a cache every step
# recomputes the whole prefix, a triangle of work; with a cache each step computes one new row and reads the
# others. The same holds in every layer. Per step, at context *t*:
#
# | one step at context *t* | matmul work | attention work |
# |---|---|---|
# | recompute the prefix | *t* tokens through every layer | *t*² query-key pairs |
# | with a KV cache | 1 token through every layer | *t* query-key pairs |
#
# The lesson's symbols (the course's shared notation, plus its own):
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $T$ | tokens the cache has seen | `cache.seen` |
# | $t$ | a query's position | `q_pos` |
# | $n$ | a stored token's position | `pos` |
# | $L$ | layers | `n_layer` |
# | $H$ | query heads | `n_head` |
# | $H_{kv}$ | KV heads ($H_{kv}$ divides $H$) | `n_kv_head` |
# | $G = H / H_{kv}$ | query heads that read one KV head | `group` |
# | $d$ | numbers per head | `head_dim` |
# | $q_t$, $k_n$ | the query at position $t$, the key at position $n$ | `q`, `k` |
# | $K$, $V$ | a KV head's stored keys and values, a row per slot | `k_buf`, `v_buf` |
# | $j$ | a slot (a row of the buffers) | `used` counts the filled ones |
# | $p_j$ | the position slot $j$ stores ($-1$: empty) | `pos`, `pos_buf` |
# | $M$ | the mask: $0$ where a query may look, $-\infty$ elsewhere | `visible` |
# | $o_t$ | a head's attention output at $t$ | `attend` |
# | $b$ | bytes per stored number (4 in fp32, 2 in bf16) | `bytes_per_element` |
# | $B$ | a method's budget: entries kept per layer and KV head | `budget` |
# | $R_n$, $\theta_i$ | RoPE's rotation at position $n$; pair $i$'s angle per position | `rotated`, `inv_freq` |
#
# nanollm stores, per layer, three tensors: `k` and `v`, shaped `(1, H_kv, T, d)`, and `pos`, shaped
# `(1, H_kv, T)`: the position of every stored entry. Here they are after a 10-token prompt:

# %% tags=["needs:append"]
cache = KVCache(config)
prefill(model, torch.randint(0, config.vocab_size, (1, 10)), cache)   # a 10-token prompt
layer0 = cache.layers[0]
print("k  ", tuple(layer0.k.shape), "  (1, H_kv, T, d)")
print("v  ", tuple(layer0.v.shape))
print("pos", tuple(layer0.pos.shape), "     (1, H_kv, T)")
print("positions stored by KV head 0:", layer0.pos[0, 0].tolist(), "| tokens seen:", cache.seen)

# %% [markdown]
# ### 1.1 Build it: a cache by hand
#
# A layer's cache is three preallocated buffers per KV head: keys, values, and the position of each stored
# entry ($-1$ marks an empty slot). A step **appends** its new keys and values into the next free slots, then
# its queries **attend** over everything stored (Vaswani et al., 2017, §3.2.1, Eq. 1, with the causal mask):
#
# $$o_t = \text{softmax}\!\left(\frac{q_t K^\top}{\sqrt{d}} + M\right) V, \qquad
# M_j = \begin{cases} 0 & \text{if } 0 \le p_j \le t \\ -\infty & \text{otherwise.}
# \end{cases}$$
#
# The mask is built from the *stored* positions $p_j$, not from slot numbers $j$: that is what keeps it right
# once a method has evicted entries (section 5). With grouped-query attention each KV head serves $G$ query
# heads, so its entries are repeated for them. First the buffers:

# %%
import torch

CAPACITY = 64                                                  # slots preallocated per KV head
k_buf = torch.zeros(1, config.n_kv_head, CAPACITY, config.head_dim)   # (1, H_kv, slots, d)
v_buf = torch.zeros_like(k_buf)
pos_buf = torch.full((1, config.n_kv_head, CAPACITY), -1)     # (1, H_kv, slots): -1 marks an empty slot
used = 0                                                       # slots filled so far

# %% [markdown]
# To check the hand-built cache we record what the library's cache does in layer 0 on a real run: a prefill of
# 6 tokens, an `extend` chunk of 5 and one decode step. Every layer's attention calls `KVCache.attend` with the
# step's queries, their positions and their new keys and values; it appends, attends and returns the output.
# We keep the inputs and the output of each of layer 0's calls.

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
# The two functions by hand, `append` and `attend` (Eq. 1). Every recorded call is replayed through them and
# must give the library's output, and the buffers must end up holding what the library stored.

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
# The library does the same with more care: `nanollm/storage.py` grows the buffers when they fill, and
# `nanollm/attention.py` scores a KV head's $G$ query heads in one product, without repeating the keys, and
# builds the mask. Everything below uses the library.
#
# ## 2. How big is it? The memory formula
#
# Each token adds one key and one value vector per layer and per **KV head**:
#
# $$\text{bytes}(T) = 2 \cdot L \cdot H_{kv} \cdot d \cdot b \cdot T$$
#
# (the 2 is K and V). Grouped-query attention (GQA; Ainslie et al., 2023, §2) lets $H$ query heads share
# $H_{kv}$ KV heads, so the cache shrinks by $G = H / H_{kv}$ compared with multi-head attention (MHA, one KV
# head per query head) at the same model width. `ModelConfig.kv_bytes_per_token(bytes_per_element)` computes
# the formula for one token; the table applies it to four of nanollm's presets.

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
# TinyLlama's 32 query heads share 4 KV heads: its cache is 8 times smaller than with MHA. The formula is not
# an estimate: `cache.nbytes()` counts the bytes of the keys and values in the slots in use (the stored
# positions beside them, one integer a slot and head, are left out). For the 10-token cache of
# section 1 (fp32):

# %% tags=["needs:append"]
print("cache.nbytes()                    :", cache.nbytes())
print("kv_bytes_per_token() * 10 tokens  :", config.kv_bytes_per_token() * 10)

# %% [markdown]
# The cache grows by the same bytes with every token, without end. Every method of this course aims to stop
# that growth at a budget $B$ of entries per layer and KV head, whatever the context length: which entries to
# keep is the whole question.
#
# ## 3. The cache changes nothing (in fp32)
#
# Cached decoding must compute what the plain forward computes. Below: the logits of one uncached forward
# over 48 tokens, against (a) prefilling 1 token and decoding the rest one at a time, and (b) prefilling 20
# tokens and `extend`ing by the rest in one chunk. Both of nanollm's model flavours: Llama-style (GQA) and
# GPT-2-style (MHA).

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
for name in ["TINY", "TINY_GPT2"]:
    m = Transformer(preset(name)).eval()
    x = torch.randint(0, m.config.vocab_size, (1, 48))
    with torch.no_grad():
        full = m(x)                                              # (1, T, vocab), no cache
    c = KVCache(m.config)
    steps = [prefill(m, x[:, :1], c)] + [decode_step(m, x[:, t], c)[:, None] for t in range(1, 48)]
    stepwise = torch.cat(steps, dim=1)
    c = KVCache(m.config)
    chunked = torch.cat([prefill(m, x[:, :20], c), extend(m, x[:, 20:], c)], dim=1)
    print(f"{name:<10} max |logits diff|: step by step {(stepwise - full).abs().max():.1e}, "
          f"prefill + extend {(chunked - full).abs().max():.1e}  (logits up to {full.abs().max():.2f})")

# %% [markdown]
# Differences of a few 1e-7, against logits of order 1, are fp32 rounding: the same sums in a different
# order. In bf16 the same comparison gives visibly larger gaps (a known report: `huggingface/transformers#25420`),
# so low-precision checks compare greedy tokens instead.
#
# ## 4. What the cache buys: time per decode step
#
# `nanollm.cli.bench.run_bench` times, at each context length, one cached `decode_step` against one uncached
# forward over the whole prefix, interleaved, on one thread: read the ratios, not the milliseconds, which
# depend on the machine.

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
first, last = bench.rows[0], bench.rows[-1]
for mode in ("recompute", "cached"):
    a, b = getattr(first, f"{mode}_ms"), getattr(last, f"{mode}_ms")
    print(f"{mode:<9}: {a:.2f} ms at {first.context} tokens, {b:.2f} ms at {last.context} ({b / a:.1f}x)")
print("speedup (recompute time / cached time):", ", ".join(f"{r.speedup:.1f}x at {r.context}" for r in bench.rows))

# %% [markdown]
# The figure plots the time of one decode step (the median of the repeats) against the context, both axes
# logarithmic: blue circles recompute the prefix, orange squares use the cache, and the shaded bands are the
# quartiles of the repeats, the spread of the timings on a shared machine. The recomputing step climbs with
# the context, since every step re-runs the whole prefix; the cached step grows far more slowly (the printed
# ratios from the shortest context to the longest), only through its attention over the stored entries, so
# the speedup grows with the context. At these lengths the cached step is mostly a fixed cost: the overheads
# of one token through the layers.
#
# ## 5. Positions: RoPE, and why eviction keeps them true
#
# ### 5.1 RoPE in brief
#
# A Llama-style model tells attention where tokens are with rotary position embeddings (RoPE; Su et al.,
# 2021, §3.4): before the scores, every head's query and key are rotated by angles proportional to their
# token's position. The $d$ numbers of a vector form $d/2$ pairs, and
# at position $n$ pair $i$ is turned by the angle $n\,\theta_i$, with $\theta_i = 10000^{-2i/d}$ (fast turns
# for the first pairs, slow ones for the last). Call $R_n$ that rotation. Rotations compose, so a score
# depends on the two positions only through their distance:
#
# $$(R_t\, q_t)^\top (R_n\, k_n) = q_t^\top R_{n-t}\, k_n .$$
#
# So a key can be rotated **once**, at its own position, when it is stored: every later query gets the right
# distance from it, as long as every token is rotated at its true position. Below, one random query and one
# random key are rotated with nanollm's functions (`nanollm/attention.py`) at three pairs of positions.

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
# each KV head, the slots to keep ($-1$ makes an empty slot, which attention skips). Each head may keep
# different tokens, and the stored positions move with the keys. Two facts keep eviction correct:
#
# * keys are cached *after* RoPE, rotated at the position they were seen at, so a kept key never needs
#   rotating again;
# * the next token gets position `cache.seen` ($T$, the tokens seen), not the number of slots in use, and the
#   mask $M$ is built from the stored positions $p_j$, not from slot numbers.
#
# `keep` gathers the kept entries into fresh buffers. A method that drops a token at *every* decode step uses
# `evict(idx)` instead, which moves nothing: the dropped slots get position $-1$ and the next append
# writes into them. Slots then stop following positions, harmless for the same two reasons.
#
# Below, a 12-token prompt; in layer 0 KV head 0 keeps the first 2 tokens, a middle one (5) and the three most
# recent, KV head 1 the first 2, another middle one (7), the two most recent and an empty slot ($-1$); then
# one more token is decoded.

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
# Slot and position part ways: each head stores its own positions in its own slots, head 1 has an empty slot
# (position -1), and the decoded token sits in the last slot of both heads with the number of tokens seen as
# its position, not its slot number. Its key was rotated at that position, so its scores with the kept keys,
# rotated at their own positions, depend on the true distances (section 5.1).
#
# ## 6. When a method acts: the policy hooks
#
# A method is a `CachePolicy` (`nanollm/policy.py`) and acts only through three of its methods, its *hooks*,
# which `KVCache.attend` calls inside every layer's attention, after the step's new entries were appended:
#
# * `attend_kv(layer, store)`: what the step's queries attend to (the storage itself, unless the method
#   rebuilds entries from a summary of its own);
# * `on_prefill(ctx)`: after the layer attended over the whole prompt (the cache was empty); `ctx` holds the
#   step's queries, their attention and the layer's storage `ctx.kv`, from which the method may evict;
# * `on_decode(ctx)`: after the layer attended in a decode step *or an `extend` chunk*.
#
# To see the order, a subclass of a real method records every call and the slots the layer holds before and
# after it. The method is StreamingLLM (`methods/streaming_llm.py`): it keeps a budget $B$ = 8 entries per KV
# head, the first 2 tokens (the "sinks") and the most recent ones.

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

# %% [markdown]
# A small runner serves a policy a prefill, `extend` chunks and decode steps, naming each step in the log:

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
def run_logged(model, policy, prompt_len, chunks, decodes):
    """Prefill ``prompt_len`` random tokens, ``extend`` by each chunk length, then ``decodes`` decode steps."""
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
# Here it serves a prefill of 10 tokens, one `extend` chunk of 4 tokens and 3 decode steps; each line of the
# printout is a step, with the calls in the order the cache made them, each with the slots the layer held
# (before -> after, where the hook changed them):

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
policy = LoggedStreamingLLM(budget=8, n_sink=2)
logged = run_logged(model, policy, prompt_len=10, chunks=[4], decodes=3)
for step in dict.fromkeys(entry[0] for entry in policy.log):
    print(f"{step:<10}", " | ".join(f"layer {layer} {hook} {a}" + (f" -> {b}" if b != a else "")
                                    for s, hook, layer, a, b in policy.log if s == step))
print(f"{len(policy.log)} hook calls; slots per layer at the end: {[len(kv) for kv in logged.layers]}")

# %% [markdown]
# In detail:
#
# * **Layer by layer.** Each layer gets its hooks before the next layer starts: `attend_kv`, the attention,
#   then `on_prefill` or `on_decode`. A method that evicts in layer 0 has done so before layer 1 attends.
# * **Appended first.** The slots `attend_kv` counts already include the step's new tokens: the prompt's 10,
#   then 8 kept + 4 from the `extend` chunk, then 8 + 1 per decode step. Eviction only affects the *next* step.
# * **`extend` is a decode step.** The chunk of 4 tokens gets one `on_decode` per layer: the phase is
#   "prefill" only while the cache is empty, so a method that compresses only the prompt never compresses an
#   appended question.
# * **When eviction happens is the method's choice.** StreamingLLM compresses after every `on_prefill` and
#   `on_decode` (`compress_on = ("prefill", "decode")`), back to its budget of 8.
#
# ## Exercises
#
# Each exercise asks for numbers: write yours in place of each `...` in the cell under the question and run
# it. The collapsed cell below it is the answer: it computes the numbers, checks them against the library
# with an `assert` and prints them beside yours.
#
# ### Exercise 1: memory arithmetic
#
# Llama-3-8B has 32 layers, 32 query heads, 8 KV heads and head dimension 128. How many GiB ($2^{30}$ bytes)
# does its KV cache take for one sequence of 131072 tokens (128k) in bf16? How much would it take without GQA
# (one KV head per query head)? Use the formula of section 2.

# %%
gib_gqa_yours = ...    # GiB: Llama-3-8B, 8 KV heads, bf16, one sequence of 131072 tokens
gib_mha_yours = ...    # GiB: the same with 32 KV heads (no GQA)

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
print(f"GQA: {gib_gqa:.0f} GiB | MHA: {gib_mha:.0f} GiB ({gib_mha / gib_gqa:.0f}x more) | "
      f"yours: {gib_gqa_yours}, {gib_mha_yours}")

# %% [markdown]
# ### Exercise 2: break it on purpose
#
# In section 5.2 the new token came after the `keep`: 12 tokens seen, 6 slots in use. Suppose it had been
# given the slots in use, 6, as its position instead of `cache.seen`, 12.
#
# * (a) What distance would its query see to the key at position 11, and what is the true one (section 5.1)?
# * (b) A query at position $p$ sees the entries at positions $s$ with $0 \le s \le p$ (the mask $M$). Of
#   the six keys KV head 0 kept (positions 0, 1, 5, 9, 10 and 11), how many would the new token still see?

# %%
distance_wrong_yours, distance_true_yours, visible_yours = ..., ..., ...    # (a) query at 6, at 12; (b)

# %% tags=["needs:group_scores", "needs:mask"]
from nanollm.attention import attend
from nanollm.policy import Needs

# BEGIN SOLUTION [cache] the distance is the query's position minus the key's; the mask hides later positions
distance_wrong, distance_true, visible = 6 - 11, 12 - 11, 3    # (b) 0, 1, 5: the keys at 9, 10, 11 look later
# END SOLUTION
score = lambda t, n: float((rotated(q, t) * rotated(k, n)).sum())    # section 5.1's q at t, its k at n
for t, distance in [(6, distance_wrong), (12, distance_true)]:
    assert abs(score(t, 11) - score(500 + distance, 500)) < 1e-4, f"(a) a query at {t}, a key at 11: {t} - 11"
_, probs, _ = attend(torch.randn(1, config.n_head, 1, config.head_dim), kv.k[:, :, :6], kv.v[:, :, :6],
                     torch.tensor([6]), kv.pos[:, :, :6], Needs(rows=1))      # a query at position 6
seen = int((probs[0, 0, 0] > 0).sum())                   # query head 0 reads KV head 0
assert visible == seen, f"(b) the mask lets a query at 6 see {seen} of {kv.pos[0, 0, :6].tolist()}"
print(f"(a) {distance_wrong} instead of {distance_true}: the key looks {-distance_wrong} positions ahead | "
      f"(b) {seen} of 6 keys visible | yours: {distance_wrong_yours}, {distance_true_yours}, {visible_yours}")

# %% [markdown]
# ### Exercise 3: count the hook calls
#
# Predict, without running it, the hook calls for the SMALL preset (4 layers) with the logged StreamingLLM
# of section 6 (budget 8) over a prompt of 20 tokens, two `extend` chunks of 5 tokens and 6 decode steps:
# how many calls of each hook, and how many slots each layer holds at the end.

# %%
calls_yours = {"attend_kv": ..., "on_prefill": ..., "on_decode": ...}    # calls of each hook over the run
slots_yours = ...                                                        # slots each layer holds at the end

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
# BEGIN SOLUTION [cache] per step and layer: attend_kv, then on_prefill (first step) or on_decode (later steps)
n_layers, n_steps = 4, 1 + 2 + 6
calls = {"attend_kv": n_layers * n_steps, "on_prefill": n_layers, "on_decode": n_layers * (n_steps - 1)}
slots_at_end = 8
# END SOLUTION
small = Transformer(preset("SMALL")).eval()
check = LoggedStreamingLLM(budget=8, n_sink=2)
end = run_logged(small, check, prompt_len=20, chunks=[5, 5], decodes=6)
counted = {hook: sum(entry[1] == hook for entry in check.log) for hook in ("attend_kv", "on_prefill", "on_decode")}
assert calls == counted, f"the answer says {calls}, the cache made {counted}: an extend chunk is one step"
assert all(len(kv) == slots_at_end for kv in end.layers), \
    f"the layers hold {[len(kv) for kv in end.layers]} slots: StreamingLLM evicts after every step"
print("hook calls:", counted, "| slots per layer at the end:", [len(kv) for kv in end.layers])
print("yours:", calls_yours, "|", slots_yours)
