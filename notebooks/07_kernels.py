# %% [markdown]
# # 07 Kernels: decoding is reading, so read less
#
# A decode step of a long-context model spends its time *loading the KV cache*, not computing with it. This
# lesson makes that argument with numbers (the roofline, and what storing a token costs), then runs the
# Triton kernels of `kernels/`, each against the PyTorch reference it must match: split-K ("flash-decoding")
# attention, KVReviver's count sketch and tensor attention; last, what they reached on an H100 and a whole
# decode step on an H200.
#
# **Before this lesson** read [lesson 00](00_nanollm_kv_cache.ipynb): the bytes a cached token takes (keys and
# values, times layers, KV heads, numbers per head and bytes per number), grouped-query attention (query heads
# sharing a KV head) and `LayerKV`'s in-place storage. Section 5 runs [lesson 03](03_tensor_attention.ipynb)'s
# four-matrix cache, and section 4 the count sketch of [lesson 06](06_kvreviver.ipynb) (recalled there). The
# symbols are the book's ([notebooks/README.md](README.md)), the metrics those of the
# [metrics glossary](README.md#metrics).
#
# Without a GPU the kernels run in Triton's *interpreter* (`TRITON_INTERPRET=1`, set below): the same code,
# run block by block with NumPy, exact and slow. Without Triton (macOS) a cell that would launch a kernel
# skips it.

# %% tags=["setup"]
from preamble import TINY
from torch import cuda

if not cuda.is_available():                        # no GPU: Triton runs the kernels in its interpreter, on NumPy
    import os
    os.environ.setdefault("TRITON_INTERPRET", "1")   # set before the first kernel is defined

import torch

import kernels

DEVICE = "cuda" if cuda.is_available() else "cpu"          # every tensor below is made on it
RUN_KERNELS = kernels.HAS_TRITON                           # the cells that launch a kernel need Triton
print(f"device: {DEVICE}; Triton available: {kernels.HAS_TRITON}; interpreter: {kernels.interpreting()}")

# %% [markdown]
# ## 1. The roofline of a decode step
#
# The symbols of this lesson (shared ones, and the online softmax's of section 3):
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $T$ | tokens in the cache, the context of one sequence | `T`, `contexts` |
# | $L$ | layers | `L` |
# | $H$, $H_{kv}$ | query heads, KV heads | `H`, `H_kv` |
# | $G = H / H_{kv}$ | query heads that read one KV head | `G` |
# | $d$ | numbers per head | `d` |
# | $b$ | bytes per stored number: 2 in bf16, 4 in fp32 (as in lesson 00) | `b` |
# | $q$, $k_n$, $v_n$ | one head's query, and the key and value of stored token $n$ | `q`, `k`, `v` |
# | $x_n$ | this lesson's own: the score of token $n$, $q \cdot k_n / \sqrt{d}$ | `s` |
# | $m$, $m'$ | this lesson's own: the running max of the scores, before and after a block | `m`, `m_new` |
# | $z$, $z'$ | this lesson's own: the running sum $\sum_n e^{x_n - m}$, before and after a block | `l` |
# | $\tilde o$, $\tilde o'$ | this lesson's own: the running output $\sum_n e^{x_n - m} v_n$, before $/ z$ | `a` |
# | $r$; $m_r$, $z_r$, $\tilde o_r$ | this lesson's own: a range of tokens; its final $m$, $z$, $\tilde o$ | `ranges` |
# | $M$ | this lesson's own: the largest $m_r$ | `M` |
# | $o$ | the attention output, $\sum_n \mathrm{softmax}_n(x)\, v_n$ | `ref`, `got` |
# | `B`, `S` (benchmark cases) | here: sequences, and tokens in each; not the book's budget and sinks | `B`, `S` |
#
# One new token per sequence. For each layer and KV head the step reads every cached key and value once
# ($2Td$ numbers) and does about $4GTd$ FLOPs with them ($q \cdot k_n$ and the weighted sum of the $v_n$, for
# the $G$ query heads that share the KV head). Its arithmetic intensity is $4GTd / (2Tdb) = 2G/b$ FLOP per
# byte. Llama-3-8B has groups of 4 query heads (32 query heads, 8 KV heads) and its data sheet's H100 does
# about 990 TFLOP/s of bf16 matrix math against about 3.35 TB/s of memory bandwidth. The step's time is
# `bytes / bandwidth`, whatever the arithmetic:

# %%
def decode_bytes(L, H_kv, T, d, b, batch=1):
    """K and V bytes one decode step reads: every layer, KV head and cached token of ``batch`` sequences."""
    return 2 * batch * L * H_kv * T * d * b


L, H, H_kv, d, b = 32, 32, 8, 128, 2               # a Llama-3-8B shape, bf16
G = H // H_kv
weights = 8.0e9 * b                                # ~8B parameters, read once per step
BW = 3.35e12                                       # H100 SXM data-sheet bandwidth, bytes/s
RIDGE = 990e12 / BW                                # FLOP per byte where compute would start to bound
kv_32k = decode_bytes(L, H_kv, 32768, d, b)
print(f"KV bytes per token: {decode_bytes(L, H_kv, 1, d, b) // 1024} KiB; at 32k tokens a step reads "
      f"{kv_32k / 1e9:.2f} GB of KV cache = {kv_32k / BW * 1e3:.2f} ms at {BW / 1e12:.2f} TB/s")
print(f"arithmetic intensity 2G/b = {2 * G / b:.0f} FLOP/byte; the H100's ridge: ~{RIDGE:.0f}, "
      f"{RIDGE / (2 * G / b):.0f}x higher")
print(f"at batch 1 the cache reads as many bytes as the weights ({weights / BW * 1e3:.2f} ms) at "
      f"{weights / decode_bytes(L, H_kv, 1, d, b) / 1e3:.0f}k tokens of context")

# %% [markdown]
# Decode sits far below the ridge, the intensity at which compute would start to bound. Drawn against the
# context, with the weights for comparison:

# %%
import matplotlib.pyplot as plt

contexts = [2**k for k in range(10, 18)]
kv_ms = [decode_bytes(L, H_kv, T, d, b) / BW * 1e3 for T in contexts]
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.loglog(contexts, kv_ms, "o-", label="KV cache, full")
ax.loglog(contexts, [ms * 0.1 for ms in kv_ms], "o--", label="KV cache, keep 10%")
ax.axhline(weights / BW * 1e3, color="k", ls=":", label="weights (batch 1)")
ax.set(xlabel="context tokens", ylabel="ms per decode step (floor)",
       title="bandwidth floor of a decode step, Llama-3-8B shape, H100")
ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))
ax.grid(True, which="both", alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# The figure shows the least time a decode step can take: the solid line reads the whole cache, the dashed
# one a tenth of it, the dotted one the weights. At batch 1 the weights dominate until the cache is as large
# as the model (printed above: about 122k tokens); a batch of sequences multiplies the cache, which then
# dominates much sooner. Keeping 10% of the cache cuts its floor tenfold, *if* the kernel reads only the kept
# rows: full attention with the dropped rows masked moves every byte.

# %% [markdown]
# ## 2. Storing a token without copying the cache
#
# If a step's time is its bytes over the bandwidth, the bytes spent *storing* the new token count too. The
# textbook append, `k = torch.cat([k, k_new], dim=2)`, copies the whole layer at every token: it reads *and
# writes* every stored byte, twice what the attention then reads, and a generation of $T$ tokens copies
# $O(T^2)$ bytes. nanollm's `LayerKV` (lesson 00) writes in place into buffers that double when full: $O(T)$
# bytes in all. With a copying append, a method that reads a tenth of the cache still moves all of it.

# %% [markdown]
# ## 3. Decode attention, split along the sequence
#
# `decode_attention_triton(q, k, v)` cuts a decode step's attention into independent pieces, one per
# (sequence, KV head, range of tokens), run in parallel (section 3.1). Each piece loads its group's $G$
# query heads once and walks its range in blocks of tokens, never holding a whole row of scores: an **online
# softmax** keeps a running max $m$, sum $z$ and output $\tilde o$, and updates them for each block of scores
# $x_n$ and values $v_n$ (FlashAttention, §3.1, Algorithm 1):
#
# $$m' = \max\big(m, \max_n x_n\big), \qquad z' = e^{m - m'}\,z + \sum_n e^{x_n - m'}, \qquad
# \tilde o' = e^{m - m'}\,\tilde o + \sum_n e^{x_n - m'}\,v_n$$
#
# The factor $e^{m - m'}$ rescales what was summed under the old max to the new one, so at the end of the
# tokens $o = \tilde o / z$, the softmax-weighted sum exactly. First the update by hand on a toy cache of 50
# tokens, checked against the reference's plain softmax:

# %%
import math

from kernels.decode_attention import reference_decode_attention

g = torch.Generator().manual_seed(0)
H_, Hkv_, T_, d_ = 4, 2, 50, 16                                  # a toy cache: 2 KV heads, G = 2
G_ = H_ // Hkv_
q = torch.randn(1, H_, d_, generator=g).to(DEVICE)               # (1, H, d): the new token's queries
k = torch.randn(1, Hkv_, T_, d_, generator=g).to(DEVICE)         # (1, H_kv, T, d)
v = torch.randn(1, Hkv_, T_, d_, generator=g).to(DEVICE)
ref = reference_decode_attention(q, k, v)                        # (1, H, d): softmax over all 50 tokens

# %%
# BEGIN SOLUTION [kernels:online_softmax] FlashAttention §3.1: per block, the new max; rescale l and a by exp(m - m')
def online_softmax(q, k, v, block):
    """One range: q (G, d), already scaled; k, v (n, d) in blocks of ``block`` -> m (G,), l (G,), a (G, d)."""
    m = torch.full((q.shape[0],), float("-inf"), device=q.device)
    l, a = torch.zeros(q.shape[0], device=q.device), torch.zeros(q.shape[0], k.shape[1], device=q.device)
    for first in range(0, k.shape[0], block):
        s = q @ k[first:first + block].T                             # (G, block)
        m_new = torch.maximum(m, s.max(dim=-1).values)
        p = torch.exp(s - m_new[:, None])
        l = torch.exp(m - m_new) * l + p.sum(dim=-1)
        a = torch.exp(m - m_new)[:, None] * a + p @ v[first:first + block]
        m = m_new
    return m, l, a
# END SOLUTION


qh = q[0, :G_] / math.sqrt(d_)                                   # KV head 0's query heads, scaled
m, l, a = online_softmax(qh, k[0, 0], v[0, 0], block=8)          # all 50 tokens, in blocks of 8
got = a / l[:, None]                                             # o = (running output) / (running sum)
assert torch.allclose(got, ref[0, :G_], rtol=1e-5, atol=1e-6), f"off by {(got - ref[0, :G_]).abs().max():.1e}"
print("online softmax over blocks of 8, divided by the running sum at the end == softmax over all 50 tokens")

# %% [markdown]
# The kernel also splits the tokens of one KV head into ranges, so that a long cache keeps the whole GPU
# busy even at batch 1. Each range $r$ ends with its own $(m_r, z_r, \tilde o_r)$, and a small reduction
# (`merge_splits`) **merges** them exactly, rescaling each to the largest max $M$:
#
# $$M = \max_r m_r, \qquad o = \frac{\sum_r e^{m_r - M}\,\tilde o_r}{\sum_r e^{m_r - M}\,z_r}$$

# %%
# BEGIN SOLUTION [kernels:merge_splits] FlashAttention §3.1: weigh each range by exp(m_r - M), then divide the sums
def merge(ranges):
    """[(m, l, a)] of the ranges -> out (G, d)."""
    M = torch.stack([m for m, _, _ in ranges]).max(dim=0).values
    top = sum(torch.exp(m - M)[:, None] * a for m, _, a in ranges)
    return top / sum(torch.exp(m - M) * l for m, l, _ in ranges)[:, None]
# END SOLUTION


for h in range(Hkv_):                                            # each KV head with its group of query heads
    qh = q[0, h * G_:(h + 1) * G_] / math.sqrt(d_)
    ranges = [online_softmax(qh, k[0, h, lo:hi], v[0, h, lo:hi], block=8) for lo, hi in ((0, 25), (25, 50))]
    got, want = merge(ranges), ref[0, h * G_:(h + 1) * G_]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"KV head {h}: off by {(got - want).abs().max():.1e}"
print("two ranges of 25 tokens, merged by hand == softmax over all 50 tokens, for each KV head")

# %% [markdown]
# ### 3.1 Triton's programming model
#
# A Triton kernel is a Python function under `@triton.jit`, launched on a *grid*: `kernel[(n0, n1)](...)`
# starts one *program* per point of the grid, all running the same code. The decode kernel's grid is
# (sequences x KV heads, ranges), and nothing in it loops over heads or ranges: the grid does. A program
# learns which point it is from `tl.program_id(axis)`.
#
# A program works on whole *blocks*. `tl.arange(0, BLOCK_N)` is a vector of offsets; a pointer plus offsets,
# like `k_ptr + rows[:, None] * stride_ks + dim[None, :]`, is a block of addresses (here a `BLOCK_N x D` tile of
# keys, `stride_ks` the distance between two tokens' rows); `tl.load` reads the whole block at once and
# `tl.store` writes one. The last block of a range may run past its end, so both take a `mask`: entries where it
# is false are not read (they get `other`) or not written. Block sizes are `tl.constexpr`: compile-time powers
# of two, since they set the tiles' shapes. On the tiles, `tl.dot`, `tl.max`, `tl.sum` and `tl.exp` work in
# registers.
#
# The kernel is `_decode_split_kernel` in [`kernels/decode_attention.py`](../kernels/decode_attention.py);
# read it beside these notes. `program_id` picks the (sequence, KV head) and the range; the group's queries are
# loaded once, padded to `G_PAD` rows with a mask. The loop is the update of section 3 on blocks of `BLOCK_N`
# tokens; `m_safe` guards a range with no valid token yet, where $e^{m - m'}$ would be $e^{-\infty + \infty}$.
# Both products of a block are `tl.dot`s, the $G$ query heads padded to the 16 rows a tensor-core tile needs
# (wasted arithmetic, but loading K and V bounds the step). Last, `tl.store` writes the range's $m$, $z$,
# $\tilde o$ for `merge_splits`. `GATHER` and `MASKED` are compile-time switches: the first reads the rows
# listed at `idx_ptr` (section 3.2), the second skips slots whose position is -1, the empty slots of
# fixed-size buffers; the others (`DOT_FP32`, `SCORES`, `EVICT`) are off here.
#
# Run against the reference, with one, two and four ranges and two block sizes (neither may change the
# output beyond rounding: they only change the order of the sums):

# %% tags=["needs:online_softmax", "needs:merge_splits"]
from kernels.decode_attention import decode_attention_triton


def skipped(what: str) -> None:
    """The one line a kernel cell prints instead of running without Triton."""
    print(f"skipped: {what} (Triton is not installed: the kernels need it; the references above do not)")


if RUN_KERNELS:
    for block_n, splits in ((16, 1), (16, 2), (16, 4), (32, 2)):
        out = decode_attention_triton(q, k, v, block_n=block_n, splits=splits)
        print(f"kernel, block_n {block_n}, {splits} range(s): max |kernel - reference| = {(out - ref).abs().max():.1e}")
else:
    skipped("decode_attention_triton with 1, 2 and 4 ranges and two block sizes against the reference")

# %% [markdown]
# ### 3.2 Selected rows
#
# A method that keeps a different set of tokens per head (SnapKV, AdaKV) can copy the kept rows into a compact
# cache, or give the kernel the indices: `selected_decode_attention_triton` loads `idx[b, h, n]`, then that row
# of K and V (the `GATHER` branch); `-1` entries are padding (AdaKV's ragged budgets). Bytes read: the kept rows
# plus 4 bytes of index per row. The reference gathers first; below it is checked against attention over the
# kept rows copied out by hand.

# %% tags=["needs:online_softmax", "needs:merge_splits"]
from kernels.decode_attention import reference_selected_decode_attention, selected_decode_attention_triton

idx = torch.stack([torch.randperm(T_, generator=g)[:12] for _ in range(Hkv_)])[None].to(DEVICE)  # (1, H_kv, 12)
idx[0, 1, 8:] = -1                                                                     # a shorter head
sel_ref = reference_selected_decode_attention(q, k, v, idx)
by_hand = torch.cat([reference_decode_attention(q[:, h * G_:(h + 1) * G_],          # the group's query heads
                                                k[:, h:h + 1, idx[0, h][idx[0, h] >= 0]],
                                                v[:, h:h + 1, idx[0, h][idx[0, h] >= 0]])
                     for h in range(Hkv_)], dim=1)
print(f"selected rows: max |reference - attention over the copied rows| = {(sel_ref - by_hand).abs().max():.1e}")
if RUN_KERNELS:
    out = selected_decode_attention_triton(q, k, v, idx, block_n=16)
    print(f"selected rows: max |kernel - gather-then-attend reference| = {(out - sel_ref).abs().max():.1e}")
else:
    skipped("selected_decode_attention_triton against the reference")

# %% [markdown]
# ## 4. The count sketch (KVReviver)
#
# KVReviver (lesson 06) sums evicted tokens into a count sketch: cells `key`, `value` of shape
# `(rows, width, H_kv, d)`; a token lands in one cell of every row (its value with a sign) and is rebuilt as
# the element-wise median over the rows. `kernels/count_sketch.py` has three kernels: **insert** (atomic
# adds, so two tokens that share a cell both count), **query** (each token's cells gathered, their median
# taken in registers), and a **fused decode** that attends over raw and sketch tokens, rebuilding each sketch
# token's key and value in registers as it streams past, never writing the rebuilt cache that the PyTorch
# path writes before attending. Below, a sketch filled by the method's own class:

# %% tags=["needs:online_softmax", "needs:merge_splits"]
from kernels.count_sketch import reference_sketch_decode_attention, reference_sketch_query
from methods.kvreviver import VagueSketch

sketch = VagueSketch(rows=3, width=5, n_kv_head=Hkv_, head_dim=d_, seed=0, device=DEVICE)   # 3 rows of 5 cells
pos = torch.arange(20, device=DEVICE)
k_tok, v_tok = (torch.randn(20, Hkv_, d_, generator=g).to(DEVICE) for _ in range(2))
sketch.insert(pos, k_tok, v_tok)                          # 20 tokens in 5 cells per row: collisions
cells, signs = sketch.buckets(pos).int(), sketch.signs(pos)
k_ref, v_ref = sketch.query(pos)
k_def, v_def = reference_sketch_query(sketch.key, sketch.value, cells, signs)
print(f"reference_sketch_query vs VagueSketch.query: max diff {(k_def - k_ref).abs().max():.1e} (keys), "
      f"{(v_def - v_ref).abs().max():.1e} (values); the sketch's own error on values: "
      f"{(v_ref - v_tok).abs().mean():.2f} mean |v^ - v| (5 cells for 20 tokens)")
q1 = torch.randn(4, d_, generator=g).to(DEVICE)           # 4 query heads, G = 2
k_raw, v_raw = (torch.randn(Hkv_, 7, d_, generator=g).to(DEVICE) for _ in range(2))
unfused = reference_sketch_decode_attention(q1, k_raw, v_raw, sketch.key, sketch.value, cells, signs, d_ ** -0.5)
print(f"rebuild in PyTorch then attend: output {tuple(unfused.shape)} over 7 raw + 20 sketch tokens per KV head")

# %% [markdown]
# Both kernels against them:

# %% tags=["needs:online_softmax", "needs:merge_splits"]
from kernels.count_sketch import sketch_decode_attention_triton, sketch_query_triton

if RUN_KERNELS:
    k_hat, v_hat = sketch_query_triton(sketch.key, sketch.value, cells, signs)
    print(f"query kernel vs VagueSketch.query: max diff {(k_hat - k_ref).abs().max():.1e} (keys), "
          f"{(v_hat - v_ref).abs().max():.1e} (values)")
    fused = sketch_decode_attention_triton(q1, k_raw, v_raw, sketch.key, sketch.value, cells, signs, d_ ** -0.5)
    print(f"fused rebuild-then-attend vs rebuild in PyTorch then attend: max diff {(fused - unfused).abs().max():.1e}")
else:
    skipped("sketch_query_triton and the fused sketch_decode_attention_triton against their references")

# %% [markdown]
# What fusing saves: the rebuilt keys and values, written and read back by the PyTorch path. What it does
# not: a rebuilt token gathers one fp32 cell per row for its key and one for its value, $2 \times 3 \times 4 = 24$
# bytes a number with 3 rows, where a raw bf16 key and value take $2 \times 2 = 4$: six times the bytes. The
# sketch saves memory, not time (section 6.1).

# %% [markdown]
# ## 5. Tensor attention over the four-matrix cache
#
# Lesson 03's four-matrix cache stores two keys `K1`, `K2` and two values `V1`, `V2` per head, $i \times d$
# each for $i$ cached tokens; the query attends to every *pair* of tokens, a row of `K1` with a row of `K2`.
# Its factored decode step (`methods/tensor_attention/attention.py`) still writes an `i x i` score matrix
# per head. `kernels/tensor_decode.py` never does: each program takes a tile of `BLOCK_A` rows of `K1`, `V1`
# and streams every tile of `BLOCK_B` rows of `K2`, `V2` past it, scoring the tiles' pairs with one `tl.dot`
# and folding them into one running max, sum and output for *all* pairs: section 3's online softmax, over
# pairs. Programs split the rows of `K1`; a tiny second kernel merges their partials.

# %% tags=["needs:online_softmax", "needs:merge_splits"]
from kernels.tensor_decode import peak_memory_bytes, reference_tensor_decode, tensor_decode_triton
from methods.tensor_attention import naive_four_cache_attention

n_, dt = 37, 16                                           # a ragged length: 3 tiles of 16, the last partial
qt = torch.randn(1, 2, dt, generator=g).to(DEVICE)
K1, K2, V1, V2 = (torch.randn(1, 2, n_, dt, generator=g).to(DEVICE) for _ in range(4))
t_ref = reference_tensor_decode(qt, K1, K2, V1, V2)
t_naive = naive_four_cache_attention(qt[:, :, None], K1, K2, V1, V2, dt ** -0.5)[:, :, 0]
print(f"factored reference vs the materialising reference: {(t_ref - t_naive).abs().max():.1e}")
if RUN_KERNELS:
    out = tensor_decode_triton(qt, K1, K2, V1, V2, block_a=16, block_b=16, splits=2)
    print(f"kernel vs factored reference: {(out - t_ref).abs().max():.1e}; "
          f"vs the materialising reference: {(out - t_naive).abs().max():.1e}")
else:
    skipped("tensor_decode_triton against both references")
print("working memory of one decode step per query and head (fp32, d = 64), besides the cache itself:")
for n in (256, 1024, 4096):
    mib = {p: peak_memory_bytes(n, 64, p) / 2**20 for p in ("naive", "reference", "kernel")}
    print(f"  i = {n:>5}: materialising {mib['naive']:>9.1f} MiB, factored reference {mib['reference']:>7.2f} MiB, "
          f"kernel {mib['kernel'] * 2**20:.0f} bytes")

# %% [markdown]
# ## 6. The benchmark
#
# `python -m fastpath.bench --json results/kernels_bench.json` times each kernel,
# its PyTorch reference and (for dense decode) `scaled_dot_product_attention` (SDPA), with the bytes each step
# must move, the achieved GB/s, and its fraction of a device-to-device copy measured in the same run.
#
# ### 6.1 What was measured on an H100
#
# One H100 run (bf16), saved in `results/kernels_bench_h100.json` and read here; no GPU or Triton needed:

# %%
import json
from pathlib import Path

from matplotlib.ticker import FuncFormatter

h100 = json.loads((Path(kernels.__file__).parents[1] / "results" / "kernels_bench_h100.json").read_text())
fig, ax = plt.subplots(figsize=(10, 3.8))
for j, impl in enumerate(["reference", "sdpa", "materialising", "factored_reference", "triton"]):
    xs = [i for i, r in enumerate(h100["rows"]) if impl in r["GB/s"]]
    ax.bar([x + (j - 2) * 0.16 for x in xs], [h100["rows"][i]["GB/s"][impl] for i in xs], 0.16,
           label=impl.replace("_", " "))
ax.axhline(h100["copy_bandwidth"] / 1e9, color="k", ls=":", label="device copy (same run)")
ax.set(yscale="log", xlabel="benchmark case", ylabel="achieved GB/s (log)",
       title="kernels vs PyTorch references: one H100 run, bf16")
ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
ax.set_xticks(range(5), [r["case"].replace(" B=", "\nB=").replace(" S=", "\nS=") for r in h100["rows"]], fontsize=9)
ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))
plt.tight_layout()
plt.show()

# %% [markdown]
# Each bar is an implementation's bandwidth, the dotted line a plain copy's: on the dense cases the kernel and
# SDPA come near the copy, the plain PyTorch references far below it. Each kernel's time, against its bytes:

# %%
d8, d1, sel, sk, ten = h100["rows"]                        # the figure's five cases, in its order
print(f"dense 8 x 32k: {d8['fraction_of_copy_bw']['triton']:.0%} of the copy bandwidth (ideal 100%); dense 1 x 128k: "
      f"{d1['ms']['sdpa'] / d1['ms']['triton']:.3f}x SDPA's speed (ideal 1x, the same bytes)")
print(f"selected: {sel['full_cache_ms']['triton'] / sel['ms']['triton']:.1f}x the full cache's speed; "
      f"{sel['ms']['triton'] / sel['compacted_ms']['triton']:.2f}x the time of a compacted copy of its rows")
print(f"sketch: {sk['dense_all_tokens_ms']['triton'] / sk['ms']['triton']:.2f}x dense speed (ideal, bytes gathered: "
      f"{sk['S'] * 4 / (sk['n_raw'] * 4 + sk['n_vague'] * sk['rows'] * 8):.2f}x); "
      f"{sk['ms']['reference'] / sk['ms']['triton']:.1f}x the unfused PyTorch speed")
print(f"tensor i = 1024: {ten['ms']['materialising'] / ten['ms']['triton']:.0f}x faster and "
      f"{ten['peak_bytes']['materialising'] / ten['peak_bytes']['triton']:.0f}x less peak memory than materialising")

# %% [markdown]
# * **dense** reads as fast as SDPA and the copy: a tie on the same bytes.
# * **selected rows** beat the full cache by less than their bytes promise (Exercise 2 counts them); gathering
#   in the kernel is not the gap, it costs little against a compacted copy of the rows.
# * **fused sketch** beats unfused PyTorch but runs near the fraction of dense speed its gathered bytes allow
#   (section 4's six times the bytes per rebuilt token).
# * **factored tensor decode** does $i^2 d$ work on $i d$ bytes, so its GB/s say little; its time and peak
#   memory against materialising do (both inputs fit in the L2 cache).
#
# ### 6.2 On this machine
#
# On a CPU the benchmark times only the PyTorch references (the interpreter checks correctness, not speed), at
# small shapes; the sketch and materialising references do far more work than the few MiB they move.

# %%
from fastpath import bench, e2e

bench.main(["--quick", "--cases", "dense", "tensor"] if TINY else ["--quick"])

# %% [markdown]
# ### 6.3 The whole step on a GPU
#
# A fast kernel is not yet a fast step; `fastpath/` runs a decode step three ways: **lean** (`lean.py`)
# launches it from Python, kernel by kernel; **graph** (`graph.py`) keeps the cache in fixed-size buffers
# (`MASKED`), so a CUDA graph records the step's kernels once and replays them in one launch;
# **fused** (`fused.py`) also compiles each layer's small element-wise kernels into a few. Timed by `python -m
# fastpath.bench --e2e` on an H200 (`results/decode_e2e_h200.json`): 16 sequences, TinyLlama's shape;
# `transformers_static`: transformers' step. `snapkv 2.51x`: the full cache's step time over SnapKV's:

# %%
run = json.loads((Path(kernels.__file__).parents[1] / "results" / "decode_e2e_h200.json").read_text())
print("\n".join(line for line in e2e.summary(run) if line.startswith("S=32768") and "tuned" not in line))
full, kept = [r for r in run["rows"] if r["path"] == "graph" and r["length"] == 32768][:2]   # full; SnapKV, 0.1
print(f"keep 0.1 reads {full['bytes'] / kept['bytes']:.2f}x fewer bytes (the weights' in both): "
      f"{full['at_copy_bw_ms']:.2f} -> {kept['at_copy_bw_ms']:.2f} ms at the copy bandwidth")

# %% [markdown]
# Lean, every keep ratio is below 1x: launches set its time. In a graph the full cache reads at 65% of the copy
# bandwidth, fused at 80%; the rest is a fixed cost of small kernels in every layer, which a tenth of the cache
# pays as well. Fused, a tenth is faster for every method, but by less than its bytes promise (4.27x fewer
# bytes, at best 2.51x faster).
#
# The same command runs on a CPU (`--e2e --quick`, tiny shapes), but there nothing is compiled and the
# launches it would save are few: its times say nothing about a GPU's, and this lesson does not print them.


# %% [markdown]
# ## Exercises
#
# Each exercise has a cell where you write (replace the `None`), a check cell that reads only your answer
# (it says "not answered yet" until you do, stops with a hint when the answer is wrong, and says "right"
# when it is), and the reference answer, collapsed: open it once you are done. None needs a GPU: they read
# the H100 run's times (section 6.1) and section 1's roofline.
#
# ### Exercise 1: the bytes of a dense decode step
#
# The case `dense B=1 S=131072` is one layer of a Llama-3-8B decode step: one sequence of 131072 tokens, 32
# query heads, 8 KV heads of dimension 128, bf16. The benchmark counts what the step must move at least: K
# and V read once, the queries read once, the output written once. Compute that count from the shape
# (`my_bytes`), then the kernel's achieved GB/s (`my_gbs`, a GB being $10^9$ bytes) from its time in
# milliseconds, `ms["dense B=1 S=131072"]` (the cell below reads each case's time from the H100 run).

# %%
ms = {row["case"]: row["ms"]["triton"] for row in h100["rows"]}     # the kernel's time of each case, in ms
my_bytes = None                     # replace None: the bytes one step of `dense B=1 S=131072` must move
my_gbs = None                       # replace None: the kernel's achieved GB/s on that case

# %%
from exercises import exercise


@exercise("Exercise 1")
def check_dense(nbytes, gbs):
    counted = next(row["bytes"] for row in h100["rows"] if row["case"] == "dense B=1 S=131072")
    assert nbytes == counted, "K and V are read once (8 KV heads, every token), the queries read and the output " \
                              "written once (32 query heads, one token each); bf16 takes 2 bytes a number"
    assert abs(gbs - counted / (ms["dense B=1 S=131072"] / 1e3) / 1e9) < 1e-6 * counted, \
        "GB/s is the bytes moved per second over 1e9, and ms is in thousandths of a second"
    return f"{gbs * 1e9 / h100['copy_bandwidth']:.0%} of the copy bandwidth measured in the same run"


check_dense(my_bytes, my_gbs)

# %%
# BEGIN SOLUTION [kernels] bytes: K + V + q + output, each B x heads x tokens x 128 x 2; GB/s: bytes / s / 1e9
reference_bytes = 2 * 1 * 8 * 131072 * 128 * 2 + 2 * 1 * 32 * 128 * 2
reference_gbs = reference_bytes / (ms["dense B=1 S=131072"] / 1e3) / 1e9
# END SOLUTION
check_dense(reference_bytes, reference_gbs)

# %% [markdown]
# ### Exercise 2: what selected-index decode must read
#
# The case `selected keep 0.1 B=8 S=32768` keeps 3276 rows per (sequence, KV head) and gives the kernel their
# indices as int32, one per kept row. Count the bytes it must move (kept keys and values, indices, queries,
# output: `my_selected_bytes`), and the ratio of the bytes of the full cache's case, `dense B=8 S=32768`, to
# it (`my_promise`): the speed-up the roofline promises. Then, in a sentence: the kernel measured 8.0x
# (section 6.1); is the gather what falls short?

# %%
my_selected_bytes = None            # replace None: the bytes one step of `selected keep 0.1 B=8 S=32768` moves
my_promise = None                   # replace None: the bytes of `dense B=8 S=32768` over my_selected_bytes


# %%
@exercise("Exercise 2")
def check_selected(nbytes, promise):
    case = {row["case"]: row for row in h100["rows"]}
    sel, dense = case["selected keep 0.1 B=8 S=32768"], case["dense B=8 S=32768"]
    assert nbytes == sel["bytes"], "the kept rows' keys and values (8 sequences x 8 KV heads x 3276 rows, bf16), " \
                                   "one 4-byte index per kept row (its key and value share it), and the " \
                                   "queries and output as in Exercise 1"
    assert abs(promise - dense["bytes"] / nbytes) < 1e-9 * promise, \
        "the promise is the full cache's bytes (counted as in Exercise 1, at B = 8, S = 32768) over the selected's"
    return f"the kernel measured {sel['full_cache_ms']['triton'] / sel['ms']['triton']:.1f}x (section 6.1)"


check_selected(my_selected_bytes, my_promise)

# %%
# BEGIN SOLUTION [kernels] kept K and V rows (2 bytes a number), 4 bytes per index, q and output as in exercise 1
reference_selected_bytes = 2 * 8 * 8 * 3276 * 128 * 2 + 8 * 8 * 3276 * 4 + 2 * 8 * 32 * 128 * 2
reference_promise = (2 * 8 * 8 * 32768 * 128 * 2 + 2 * 8 * 32 * 128 * 2) / reference_selected_bytes
# END SOLUTION
check_selected(reference_selected_bytes, reference_promise)
compacted = next(r for r in h100["rows"] if r["case"].startswith("selected"))
print(f"No: the bytes promise {reference_promise:.1f}x, and the kernel takes only "
      f"{compacted['ms']['triton'] / compacted['compacted_ms']['triton']:.2f}x the time of attention over a "
      "compacted copy of the same rows (section 6.1): that copy falls short of its bytes too")

# %% [markdown]
# ### Exercise 3: where the cache overtakes the weights
#
# At batch 1, all in bf16, the Llama-3-8B shape's cache outweighs its weights from about 122k tokens
# (section 1). Serve it now with its weights in FP8, one byte a parameter, the cache still in bf16, at a
# batch of 8 sequences: from how many tokens of context per sequence does the cache read more
# bytes than the weights? Give a whole number of tokens (`my_tokens`).

# %%
my_tokens = None                    # replace None: the fewest tokens per sequence where the cache outweighs them


# %%
@exercise("Exercise 3")
def check_tokens(tokens):
    fp8_weights, cache = 8.0e9 * 1, lambda T: decode_bytes(32, 8, T, 128, 2, batch=8)   # 8B parameters
    assert cache(tokens) > fp8_weights, "at that context the cache is not yet larger than the weights: count K " \
                                        "and V of all 8 sequences (decode_bytes of section 1, with batch=8)"
    assert cache(tokens - 1) <= fp8_weights, "one token earlier the cache already outweighs the weights: look " \
                                             "for the first such T (decode_bytes of section 1, with batch=8)"


check_tokens(my_tokens)

# %%
# BEGIN SOLUTION [kernels] the smallest S with 2 x 8 x 32 layers x 8 KV heads x S x 128 x 2 bytes > weights
reference_tokens = math.floor(8.0e9 * 1 / (2 * 8 * 32 * 8 * 128 * 2)) + 1
# END SOLUTION
check_tokens(reference_tokens)
