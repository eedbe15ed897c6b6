# %% [markdown]
# # 00 The KV cache: what it stores, what it saves, what it costs
#
# **Before this lesson**: PyTorch (tensors, `nn.Module`, forward hooks) and attention (queries, keys, values,
# scaled dot products, causal masking, multiple heads). The symbols are the book's, in
# [notebooks/README.md](README.md).
#
# Every method in this course changes *what the KV cache keeps*. This lesson builds the plain cache by hand,
# measures what it saves and costs, and shows why it stores each entry's position, which lets a method evict
# entries. The model is nanollm's 2-layer `TINY` preset with random weights (the cache does not care what they
# are); the `TINY` flag imported below is another thing: it only shortens CI's quick run.

# %% tags=["setup"]
from preamble import TINY          # a flag: True only in CI's quick run, which uses smaller sizes

from nanollm import Transformer, preset

config = preset("TINY", max_seq_len=2048)     # 2 layers, 4 query heads, 2 KV heads; room for 2048 tokens
model = Transformer(config).eval()            # random weights (seeded)

# %% [markdown]
# ## 1. What is recomputed without a cache
#
# Attention is causal, so a token's key and value never change once computed: they can be **stored** for later
# queries. That store is the KV cache (`KVCache` in nanollm), used through three calls:
#
# * `prefill(model, ids, cache)` runs a prompt through an empty cache;
# * `decode_step(model, token, cache)` runs one new token over the stored entries;
# * `extend(model, ids, cache)` does the same for a chunk of new tokens (a question appended to a document).
#
# A 4-token prompt and 8 more tokens, run both ways: a hook counts the rows layer 0's key projection computes
# per call, and the logits are compared:

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
import torch

from nanollm import KVCache, decode_step, prefill

x = torch.randint(0, config.vocab_size, (1, 12))              # token ids: a 4-token prompt, then 8 new tokens
rows = []                                                     # rows the key projection sees, per call
hook = model.blocks[0].attn.k_proj.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[1]))
with torch.no_grad():
    uncached = [model(x[:, :t])[:, -1] for t in range(4, 13)]  # no cache: the whole prefix, at every step
cache = KVCache(config)
cached = [prefill(model, x[:, :4], cache)[:, -1]]             # with the cache: the prompt once,
cached += [decode_step(model, x[:, t], cache) for t in range(4, 12)]   # then the new token only
hook.remove()
print(f"key rows computed per step without a cache: {rows[:9]}; with one: {rows[9:]}")
print(f"max |logits diff|, cached against uncached: {(torch.cat(cached) - torch.cat(uncached)).abs().max():.1e}")

# %% [markdown]
# After the prompt (each list's first entry), a step without a cache recomputes the keys of the whole prefix;
# with one, it computes one row. The logits differ by fp32 rounding only: the cache changes nothing.
#
# ### 1.1 Build it: a cache by hand
#
# A layer's cache is three preallocated buffers with a row of slots per KV head: keys, values and each entry's
# position. A step **appends** its new keys and values into the next free slots, then its queries
# **attend** over everything stored (Vaswani et al., 2017, §3.2.1, Eq. 1, with the causal mask). The symbols
# beyond the book's:
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $G$ | query heads per KV head, $H / H_{kv}$ | `group` |
# | $K$, $V$ | the stored keys and values, a row per slot | `k_buf`, `v_buf` |
# | $j$, $p_j$ | a slot (a buffer row); the position it stores ($-1$: empty) | `used` counts slots; `pos_buf` |
# | $M_{t,j}$ | the mask: $0$ if the query at $t$ may see slot $j$, else $-\infty$ | `visible` |
# | $R_n$, $\theta_i$ | used in section 4.1: RoPE's rotation at position $n$; pair $i$'s angle | `rotated`, `inv_freq` |
#
# $$o_t = \text{softmax}\!\left(\frac{q_t K^\top}{\sqrt{d}} + M_t\right) V, \qquad
# M_{t,j} = \begin{cases} 0 & \text{if } 0 \le p_j \le t \\ -\infty & \text{otherwise.}
# \end{cases}$$
#
# The mask reads the *stored* positions $p_j$, not slot numbers, so it stays right after a method evicts
# entries (section 4); a chunk of queries has a row $M_t$ per query. The recorded keys and queries already carry
# RoPE's rotation (section 4). KV head $h$ serves query heads $hG$ to $(h+1)G - 1$, hence `repeat_interleave`,
# not `repeat`. The buffers, and two helpers that only word the checks' messages (skim them):

# %%
import torch                                                   # again: the cells from here need only it and config

from exercises import lesson_function, where_differs

CAPACITY = 64                                                  # slots preallocated per KV head
k_buf = torch.zeros(1, config.n_kv_head, CAPACITY, config.head_dim)   # (1, H_kv, slots, d)
v_buf = torch.zeros_like(k_buf)
pos_buf = torch.full((1, config.n_kv_head, CAPACITY), -1)     # (1, H_kv, slots): -1 marks an empty slot
used = 0                                                       # slots filled so far


def appended(before, k, v, pos):
    """Whether `used` grew by a step's n tokens and slots before .. before + n - 1 hold its k, v and pos."""
    n, rows = len(pos), pos.expand(1, config.n_kv_head, -1)       # pos (n,) -> (1, H_kv, n): the same per head
    return used == before + n and all(torch.equal(buf[:, :, before:before + n], x)
                                      for buf, x in ((k_buf, k), (v_buf, v), (pos_buf, rows)))


def attend_off(mine, out):
    """Where a by-hand attention output first differs from the library's, and what to check; "" if nowhere."""
    off = where_differs(mine, out, ("batch", "query head", "query", "feature"))
    if not off or getattr(mine, "shape", None) != out.shape:   # nowhere, or the shapes differ (off names them)
        return off
    heads = [h for h in range(config.n_head) if where_differs(mine[:, h], out[:, h], ())]
    return off + "; " + (f"only query heads {heads} are off: KV head h serves query heads hG..hG+G-1"
                         if len(heads) < config.n_head else
                         "every head is off: nan means a query whose mask hides every slot; scale by 1/sqrt(d)")


# %% [markdown]
# To check it, we record layer 0's calls of `KVCache.attend` (queries, their positions, new keys and values,
# output) over a prefill of 6 tokens, an `extend` chunk of 5 and one decode step. `record_layer0` wraps that
# method on one cache object only. Each layer's attention block calls `cache.attend(layer, module, q, pos, new)`:
# its index, itself, the step's queries, their positions, and `new`, the step's keys and values, which sit at the
# queries' own positions.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
from nanollm import extend


def record_layer0(cache):
    """From now on, record each call of cache.attend in layer 0: (queries, their positions, (k, v) new, output)."""
    calls = []

    def recorded(layer, module, q, pos, new):                          # new: the step's (k, v)
        out = KVCache.attend(cache, layer, module, q, pos, new)        # the library's own method
        if layer == 0:
            calls.append((q, pos, new, out))
        return out

    cache.attend = recorded
    return calls


library = KVCache(config)
calls = record_layer0(library)
ids = torch.randint(0, config.vocab_size, (1, 12))
prefill(model, ids[:, :6], library)
extend(model, ids[:, 6:11], library)
_ = decode_step(model, ids[:, 11], library)                   # (its logits are not needed here)

# %% [markdown]
# `append` and `attend` by hand, the equation above in code: read them until you see why they equal the library.
# The cell replays every recorded call: each must fill the next slots and give the library's output.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
def append(k, v, pos):
    """Write a step's keys and values (batch, H_kv, n_new, d) at positions pos (n_new,) into the next free slots."""
    global used
    # BEGIN SOLUTION [cache:append] write k, v and pos into the next free slots of the buffers; count them in `used`
    n_new = k.shape[2]                                         # the step's new tokens
    end = used + n_new
    k_buf[:, :, used:end], v_buf[:, :, used:end], pos_buf[:, :, used:end] = k, v, pos
    used = end
    # END SOLUTION


def attend(q, q_pos):
    """Queries q (batch, H, Tq, d) at positions q_pos (Tq,) over every stored entry -> (batch, H, Tq, d)."""
    # BEGIN SOLUTION [cache:mask] Vaswani §3.2.1 (Eq. 1): repeat each KV head for its query heads, mask from positions
    group = q.shape[1] // config.n_kv_head                     # query heads per KV head (GQA)
    k, v, pos = (t[:, :, :used].repeat_interleave(group, dim=1) for t in (k_buf, v_buf, pos_buf))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5      # (batch, H, Tq, used)
    # the mask M: stored positions (batch, H, 1, used) against the queries' (Tq, 1) -> (batch, H, Tq, used)
    visible = (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= q_pos[:, None])
    return scores.masked_fill(~visible, float("-inf")).softmax(dim=-1) @ v
    # END SOLUTION


used = 0                                                       # from empty buffers (the cell can run again)
for q, pos, (k, v), out in calls:                              # replay: the same inputs, by hand
    before = used
    append(k, v, pos)
    assert appended(before, k, v, pos), \
        f"append at {pos.tolist()}: k, v and pos go to the {len(pos)} slots after the {before} filled; used counts them"
    mine = attend(q, pos)
    assert not (off := attend_off(mine, out)), f"queries at {pos.tolist()}: {off}"
print(f"by hand == KVCache on layer 0 over {len(calls)} calls: {used} slots, positions {pos_buf[0, 0, :used].tolist()}")

# %% [markdown]
# The library does the same, growing its buffers when full (`nanollm/storage.py`); from here on we use it.
#
# ## 2. How big is it? The memory formula
#
# Each token stores a key and a value (the 2) per layer and **KV head**, $d$ numbers of $b$ bytes each:
#
# $$\text{bytes}(T) = 2 \cdot L \cdot H_{kv} \cdot d \cdot b \cdot T$$
#
# Grouped-query attention (GQA; Ainslie et al., 2023, §2) shares each KV head among $G$ query heads, so the
# cache is $G$ times smaller than with multi-head attention (MHA, one KV head per query head).
# `ModelConfig.kv_bytes_per_token(bytes_per_element)` gives the formula for one token; `cache.nbytes()` counts
# the bytes of a cache's keys and values:

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
for name in ["TINY", "GPT2_124M", "TINYLLAMA_1B"]:
    c = preset(name)
    print(f"{name:<13} L={c.n_layer:<3} H={c.n_head:<3} H_kv={c.n_kv_head:<3} d={c.head_dim:<3} | G = "
          f"{c.n_head // c.n_kv_head:<2} | {c.kv_bytes_per_token(bytes_per_element=2) / 1024:6.2f} KiB/token in bf16")
print(f"the 12-token cache of section 1.1: nbytes() = {library.nbytes()}, "
      f"kv_bytes_per_token() x 12 = {config.kv_bytes_per_token() * 12} (fp32)")

# %% [markdown]
# TinyLlama's cache is 8 times smaller than with MHA, yet still grows with every token. The course's methods cap
# it at a budget $B$ of entries per layer and KV head; which entries to keep is the whole question.
#
# ## 3. What the cache saves in time
#
# An uncached forward over the whole prefix, timed against one cached decode step:

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
from experiments.bench import run_bench

CONTEXTS = [32, 64, 128] if TINY else [128, 256, 512, 1024]     # tokens already in the cache
bench = run_bench(config, contexts=CONTEXTS, repeats=2 if TINY else 5, steps=2 if TINY else 8, threads=1)
print("speedup of a cached step:", ", ".join(f"{r.speedup:.1f}x at {r.context}" for r in bench.rows))

# %% [markdown]
# The speedup grows with the context, as the uncached step re-runs the whole prefix (at short contexts, this
# tiny model's step is mostly Python overhead).
#
# ## 4. Positions: RoPE, and why eviction keeps them true
#
# ### 4.1 RoPE in brief
#
# Rotary position embeddings (RoPE; Su et al., 2021, §3.2) split a query or key into $d/2$ pairs; $R_n$, the
# rotation at position $n$, turns pair $i$ by the angle $n\,\theta_i$, with $\theta_i = 10000^{-2i/d}$.
# Rotations compose, so a score depends only on the distance $t - n$ between the two positions:
#
# $$(R_t\, q_t)^\top (R_n\, k_n) = q_t^\top R_{n-t}\, k_n .$$
#
# So a key can be rotated **once**, at its own position, when stored. A random query and key at three pairs of
# positions:

# %%
from nanollm.attention import apply_rope, rope_cos_sin, rope_inv_freq

inv_freq = rope_inv_freq(config)                                    # theta_i, (d/2,)
rope_q, rope_k = torch.randn(1, 1, 1, config.head_dim), torch.randn(1, 1, 1, config.head_dim)   # a query, a key


@lesson_function                 # an exercise's check below computes with it
def rotated(x, position):
    """R_position x: pair i of x turned by the angle position * theta_i."""
    cos, sin = rope_cos_sin(torch.tensor([position]), inv_freq, x.dtype)
    return apply_rope(x, cos, sin)


for t, n in [(5, 2), (1005, 1002), (5, 4)]:
    print(f"query at {t:>4}, key at {n:>4} (distance {t - n}): "
          f"score {(rotated(rope_q, t) * rotated(rope_k, n)).sum():+.4f}")

# %% [markdown]
# Pairs 3 apart give the same score, the pair 1 apart another: attention reads distances, so the cache must
# keep them true.
#
# ### 4.2 Eviction keeps positions true
#
# A method evicts with `keep(idx)` on a layer's storage (`LayerKV`): `idx` lists, per KV head, the slots to keep
# ($-1$: an empty slot, which attention skips, where a head keeps fewer); positions move with their keys. Keys are
# cached after RoPE, so kept keys need no new rotation, and the next token gets position `cache.seen` ($T$), not the
# number of slots in use. Below, after a 12-token prompt, each KV head of layer 0 keeps 6 slots (one of KV head 1's
# empty), then one more token is decoded.

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
cache = KVCache(config)
prefill(model, torch.randint(0, config.vocab_size, (1, 12)), cache)
kv = cache.layers[0]
idx = torch.tensor([[[0, 1, 5, 9, 10, 11], [0, 1, 7, 10, 11, -1]]])   # (1, H_kv, 6): the slots each head keeps
kv.keep(idx)
decode_step(model, torch.tensor([7]), cache)                          # one more token (its id: 7)
for h in range(config.n_kv_head):
    print(f"KV head {h}, the position stored in each slot: {kv.pos[0, h].tolist()}")
print(f"the new token got position {int(kv.pos[0, 0, -1])} (the tokens seen before it), in slot {len(kv) - 1}")

# %% [markdown]
# Each head stores its own positions, the empty slot stays $-1$ (the new token goes after the kept slots, not
# into it), and the new token's position counts the tokens seen, not the slots, so its scores see true distances.
#
# Section 1.1's `append` and `attend` must stay right here too, where slot $j$ no longer holds position $j$. We load
# layer 0's slots into the hand-built buffers, then replay an `extend` chunk of 3 tokens (positions 13 to 15):

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
stored = [t.clone() for t in (kv.k, kv.v, kv.pos)]             # layer 0's slots as they are now
evicted_calls = record_layer0(cache)
extend(model, torch.randint(0, config.vocab_size, (1, 3)), cache)
q, pos, (k, v), out = evicted_calls[0]                        # layer 0's only call: queries at 13, 14, 15

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
used = stored[0].shape[2]                                      # the hand-built buffers: layer 0's slots, as stored
k_buf[:, :, :used], v_buf[:, :, :used], pos_buf[:, :, :used] = stored
before = used
append(k, v, pos)
assert appended(before, k, v, pos), \
    "append: the chunk's k, v and pos go to the slots after the filled ones, whatever positions those hold"
mine = attend(q, pos)
assert torch.allclose(mine, out, rtol=1e-5, atol=1e-6), \
    f"after eviction, off by {(mine - out).abs().max():.1e}: does the mask read the stored positions (not slot " \
    "numbers), and skip the empty slots (-1)?"
print(f"by hand == KVCache after eviction: queries at {pos.tolist()} over slots holding, in KV head 1, "
      f"{pos_buf[0, 1, :used].tolist()}")

# %% [markdown]
# ## 5. When a method acts: the policy hooks
#
# A method is a `CachePolicy` (`nanollm/policy.py`) acting through three *hooks*, which `KVCache.attend` calls
# in every layer after appending the step's new entries:
#
# * `attend_kv(layer, store)`: what the step's queries attend to (usually the storage itself);
# * `on_prefill(ctx)`: after attending over the prompt; the method may evict from `ctx.kv`, the layer's storage;
# * `on_decode(ctx)`: the same after a decode step *or an `extend` chunk*.
#
# StreamingLLM (`methods/streaming_llm.py`) keeps $B$ entries per KV head: $S$ sink tokens at the start (2 here;
# the paper's default is 4) and the most recent. With $B$ = 8, a subclass prints how many slots layer 0's
# `attend_kv` gets over a prefill of 10 tokens, an `extend` chunk of 4 and a decode step; after each, the
# positions kept:

# %% tags=["needs:append", "needs:group_scores", "needs:mask", "needs:baselines:sinks_and_recent"]
from methods.streaming_llm import StreamingLLMPolicy


class LoggedStreamingLLM(StreamingLLMPolicy):
    """StreamingLLM, unchanged, printing how many slots layer 0's queries attend over."""

    def attend_kv(self, layer, store):
        if layer == 0:
            print(f"  attend_kv: {len(store)} slots")
        return super().attend_kv(layer, store)


ids, logged = torch.randint(0, config.vocab_size, (1, 15)), KVCache(config, LoggedStreamingLLM(budget=8, n_sink=2))
for name, step in (("prefill 10", lambda: prefill(model, ids[:, :10], logged)),
                   ("extend 4", lambda: extend(model, ids[:, 10:14], logged)),
                   ("decode 1", lambda: decode_step(model, ids[:, 14], logged))):
    step()
    kept = logged.layers[0].pos[0, 0]                          # layer 0, KV head 0: the positions kept
    print(f"{name}: kept positions {sorted(kept[kept >= 0].tolist())}")

# %% [markdown]
# `attend_kv` runs first, and its count includes the step's new tokens (12 slots for a budget of 8): an
# eviction only affects the *next* step.
#
# ## Exercises
#
# Replace each `None` in an exercise's first cell, then run its check: it hints when the answer is wrong and
# says "right" when it is. The reference answer is collapsed below it.
#
# ### Exercise 1: memory arithmetic
#
# Llama-3-8B has 32 layers, 32 query heads, 8 KV heads and head dimension 128. How many GiB ($2^{30}$ bytes)
# does its KV cache take for one sequence of 131072 tokens (128k) in bf16, and how many without GQA (one KV
# head per query head)? Use section 2's formula.

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
    assert not any(isinstance(x, str) for x in (gib_gqa, gib_mha)), "two numbers of GiB, as 1.5, not text"
    sides = (("with GQA", gib_gqa, gib(8), gib(32), "the cache holds the 8 KV heads, not one per query head"),
             ("without GQA", gib_mha, gib(32), gib(8), "H_kv is the number of query heads, H"))
    for side, answer, right, other_heads, heads_hint in sides:
        if abs(answer - right) < 1e-6:
            continue
        for slip, hint in ((right / 2, "each token stores a key and a value, 2 bytes a number in bf16"),
                           (right * 2**30 / 1e9, "a GiB is 2**30 bytes, not 10**9"),
                           (2 * right, "bf16 takes 2 bytes per number"), (other_heads, heads_hint),
                           (right * 2**30, "that is bytes: divide by 2**30 for GiB"), (right * 1024, "GiB, not MiB")):
            assert abs(answer - slip) >= 2e-2 * slip, f"{side}: {hint}"     # the usual slips, rounded too
        raise AssertionError(f"{side}: section 2's formula, each of its factors once, with Llama-3-8B's numbers")
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
# In section 4.2 the new token came after the `keep`: 12 tokens seen, 6 slots in use. Suppose it had been
# given position 6 (the slots in use) instead of `cache.seen`, 12.
#
# * (a) RoPE rotates a query and a key by their positions: what distance (the query's position minus the key's)
#   would the score of its query with the key at position 11 encode, mask aside, and what is the true one?
# * (b) The mask $M$ shows a query at $t$ the entries with $0 \le p_j \le t$. Of the six keys KV head 0 kept
#   (positions 0, 1, 5, 9, 10 and 11), which would the new token still see? (Their positions, as a list.)

# %%
my_distance_wrong = None    # replace None: (a) the distance a query at position 6 sees to the key at 11
my_distance_true = None     # replace None: (a) the true distance: the query at position 12
my_visible = None           # replace None: (b) the positions of the kept keys a query at position 6 sees

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
from nanollm import attention
from nanollm.policy import Needs


@exercise("Exercise 2")
def check_break_it(distance_wrong, distance_true, visible):
    score = lambda t, n: float((rotated(rope_q, t) * rotated(rope_k, n)).sum())   # section 4.1's, at t and n
    for t, distance in [(6, distance_wrong), (12, distance_true)]:
        assert abs(score(t, 11) - score(500 + distance, 500)) < 1e-4, \
            f"(a) the query at {t}: RoPE's score sees the query's position minus the key's (section 4.1)"
    _, probs, _ = attention.attend(torch.randn(1, config.n_head, 1, config.head_dim), kv.k[:, :, :6],
                                   kv.v[:, :, :6], torch.tensor([6]), kv.pos[:, :, :6], Needs(rows=1))
    seen = probs[0, 0, 0] > 0                                       # query head 0 reads KV head 0's six slots
    shown, hidden = (kv.pos[0, 0, :6][m].tolist() for m in (seen, ~seen))
    if hasattr(visible, "tolist"):                   # a tensor or an array of positions reads as its list
        visible = visible.tolist()
    assert isinstance(visible, (list, tuple, set)), "(b) the positions of the keys the query sees, as a list"
    assert sorted(visible) != hidden, "(b) those are the keys the mask hides: it shows the ones with 0 <= p_j <= t"
    assert sorted(visible) == shown, "(b) of the six kept keys: the mask keeps the stored positions from 0 up to " \
        "the query's own, and hides the later ones"


check_break_it(my_distance_wrong, my_distance_true, my_visible)

# %% tags=["needs:append", "needs:group_scores", "needs:mask"]
# BEGIN SOLUTION [cache] the distance is the query's position minus the key's; the mask hides later positions
reference_distance_wrong, reference_distance_true = 6 - 11, 12 - 11
reference_visible = [0, 1, 5]                  # the keys at 9, 10 and 11 lie after 6
# END SOLUTION
check_break_it(reference_distance_wrong, reference_distance_true, reference_visible)
print("With position 6, the key at 11 would look 5 positions ahead of the query, and the mask would hide the "
      "three most recent tokens from it.")
