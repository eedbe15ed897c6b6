# %% [markdown]
# # 07 Kernels: decoding is reading, so read less
#
# A decode step of a long-context model, or of a batch of sequences, spends its time *loading the KV cache*
# (and the weights), not computing with it. This
# lesson makes that argument with the roofline, builds the **online softmax** that lets a kernel read the cache
# once, in blocks (FlashAttention), checks the Triton kernel of `kernels/` that uses it against its PyTorch
# reference, and reads what it reached on an H100.
#
# **Before this lesson** read [lesson 00](00_nanollm_kv_cache.ipynb): the bytes a cached token takes and
# grouped-query attention (query heads sharing a KV head). The symbols are the book's
# ([notebooks/README.md](README.md)).
#
# Without a GPU the kernels run in Triton's *interpreter* (`TRITON_INTERPRET=1`, set below): the same code,
# exact and slow. Without Triton (macOS) a cell that would launch a kernel skips it.

# %% tags=["setup"]
from preamble import TINY
import os

import torch

if not torch.cuda.is_available():                  # no GPU: Triton runs the kernels in its interpreter, on NumPy
    os.environ.setdefault("TRITON_INTERPRET", "1")   # set before the first kernel is defined
import kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"    # every tensor below is made on it
RUN_KERNELS = kernels.HAS_TRITON                           # the cells that launch a kernel need Triton
print(f"device: {DEVICE}; Triton available: {kernels.HAS_TRITON}; interpreter: {kernels.interpreting()}")

# %% [markdown]
# ## 1. The roofline of a decode step
#
# The symbols of this section (section 2 adds those of the online softmax):
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $T$ | tokens in the cache of one sequence | `T`, `contexts` |
# | $L$; $H$, $H_{kv}$ | layers; query heads, KV heads | `L`; `H`, `H_kv` |
# | $G = H / H_{kv}$ | query heads that read one KV head | `G` |
# | $d$; $b$ | numbers per head; bytes per stored number (2 in bf16) | `d`; `b` |
# | $q$, $k_n$, $v_n$ | one head's query, and the key and value of stored token $n$ | `q`, `k`, `v` |
# | `B`, `S` | in a benchmark's name: sequences, tokens per sequence (elsewhere: a budget, sinks) | `B`, `S` |
#
# One new token per sequence. For each layer and KV head the step reads every cached key and value once ($2Td$
# numbers) and does about $4GTd$ FLOPs with them (2 a multiply-add, in $q \cdot k_n$ and in the weighted sum of the
# $v_n$, for the $G$ query heads that share the KV head): an arithmetic intensity of $4GTd / (2Tdb) = 2G/b$ FLOP per
# byte. Llama-3-8B has $G = 4$ (32 query heads, 8 KV heads); its data sheet's H100 does about 990 TFLOP/s of bf16
# matrix math against about 3.35 TB/s of memory bandwidth. Their ratio is the *ridge* of the roofline model: a step
# doing fewer FLOPs per byte than that waits on memory, and its time is `bytes / bandwidth`:

# %%
from exercises import lesson_function     # marks the functions an exercise's check computes with


@lesson_function
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
fig, ax = plt.subplots(figsize=(8, 3.5), layout="constrained")
ax.loglog(contexts, kv_ms, "o-", label="KV cache, full")
ax.loglog(contexts, [ms * 0.1 for ms in kv_ms], "o--", label="KV cache, keep 10%")
ax.axhline(weights / BW * 1e3, color="k", ls=":", label="weights (batch 1)")
ax.set(xlabel="context tokens", ylabel="ms per decode step (floor)",
       title="bandwidth floor of a decode step, Llama-3-8B shape, H100")
ax.legend(fontsize=9)
plt.show()

# %% [markdown]
# The figure shows the least time a decode step can take: the solid line reads the whole cache, the dashed
# one a tenth of it, the dotted one the weights. At batch 1 the weights dominate up to about 122k tokens; a
# batch of sequences multiplies the cache, which then dominates much sooner. Keeping 10% of the cache cuts
# its floor tenfold, *if* the kernel reads only the kept rows: attention with the dropped rows masked moves
# every byte, and so does an append that copies the cache at every token (`torch.cat`). At batch 1 and
# moderate contexts the weights' floor stays: keeping a tenth of the cache then barely shortens the whole
# step.

# %% [markdown]
# ## 2. Decode attention, split along the sequence
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $x_n$ | the score of token $n$, $q \cdot k_n / \sqrt{d}$ | `s` |
# | $m$, $m'$ | the running max of the scores, before and after a block | `m`, `m_new` |
# | $z$, $z'$ | the running sum $\sum_n e^{x_n - m}$, before and after a block | `l` |
# | $\tilde o$, $\tilde o'$ | the running output $\sum_n e^{x_n - m} v_n$, not yet divided by $z$ | `a` |
# | $r$; $m_r$, $z_r$, $\tilde o_r$ | a range of tokens; its final $m$, $z$, $\tilde o$ | `ranges` |
# | $M$ | the largest $m_r$ | `M` |
# | $o$ | the attention output, $\sum_n \mathrm{softmax}_n(x)\, v_n$ | `ref`, `got` |
#
# To read the cache once, a kernel walks it in blocks of tokens, never holding a whole row of scores: an
# **online softmax** keeps a running max $m$, sum $z$ and output $\tilde o$, and updates them for each block
# of scores $x_n$ and values $v_n$ (FlashAttention, §3.1, Algorithm 1):
#
# $$m' = \max\big(m, \max_n x_n\big), \qquad z' = e^{m - m'}\,z + \sum_n e^{x_n - m'}, \qquad
# \tilde o' = e^{m - m'}\,\tilde o + \sum_n e^{x_n - m'}\,v_n$$
#
# The factor $e^{m - m'}$ rescales what was summed under the old max to the new one, so at the end
# $o = \tilde o / z$ exactly. The update by hand on a toy cache of 50 tokens, checked against the library's
# reference (a plain softmax):

# %%
import math

from exercises import where_differs              # the by-hand checks below: where a result differs
from kernels.decode_attention import reference_decode_attention

g = torch.Generator().manual_seed(0)
H_, Hkv_, T_, d_ = 4, 2, 50, 16                                  # a toy cache: 2 KV heads, G = 2
G_ = H_ // Hkv_
q = torch.randn(1, H_, d_, generator=g).to(DEVICE)               # (1, H, d): the new token's queries
k = torch.randn(1, Hkv_, T_, d_, generator=g).to(DEVICE)         # (1, H_kv, T, d)
v = torch.randn(1, Hkv_, T_, d_, generator=g).to(DEVICE)
ref = reference_decode_attention(q, k, v)                        # (1, H, d): softmax over all 50 tokens

# %%
def online_softmax(q, k, v, block):
    """One range: q (G, d), already scaled; k, v (n, d) in blocks of ``block`` -> m (G,), l (G,), a (G, d)."""
    # BEGIN SOLUTION [kernels:online_softmax] FlashAttention §3.1: per block, new max m'; l and a times exp(m - m')
    m = torch.full((q.shape[0],), float("-inf"), device=q.device)   # -inf: the first block's exp(m - m') is 0
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
scores = qh @ k[0, 0].T                                          # (G, 50): every score at once, to check m and l
for mine, want, what in ((m, scores.max(dim=-1).values, "m: the largest score over all blocks so far"),
                         (l, torch.exp(scores - m[:, None]).sum(-1), "l: the sum of exp(s - m), the old sum times "
                                                                     "exp(m - m') whenever the maximum grows to m'"),
                         (got, ref[0, :G_], "a: the old a times exp(m - m') too, plus p @ v of the block")):
    assert not (off := where_differs(mine, want, ("query head", "dim"))), f"{what}; yours differ: {off}"
print("online softmax over blocks of 8, divided by the running sum at the end == softmax over all 50 tokens")

# %% [markdown]
# A decode kernel also splits the tokens of one KV head into ranges, so that a long cache keeps the whole GPU
# busy even at batch 1. Each range $r$ ends with its own $(m_r, z_r, \tilde o_r)$, and a small reduction
# (`merge_splits`) **merges** them exactly, rescaling each to the largest max $M$:
#
# $$M = \max_r m_r, \qquad o = \frac{\sum_r e^{m_r - M}\,\tilde o_r}{\sum_r e^{m_r - M}\,z_r}$$

# %%
def merge(ranges):
    """[(m, l, a)] of the ranges -> out (G, d)."""
    # BEGIN SOLUTION [kernels:merge_splits] FlashAttention §3.1: weigh each range by exp(m_r - M), then divide the sums
    M = torch.stack([m for m, _, _ in ranges]).max(dim=0).values
    top = sum(torch.exp(m - M)[:, None] * a for m, _, a in ranges)
    return top / sum(torch.exp(m - M) * l for m, l, _ in ranges)[:, None]
    # END SOLUTION


for h in range(Hkv_):                                            # each KV head with its group of query heads
    qh = q[0, h * G_:(h + 1) * G_] / math.sqrt(d_)
    ranges = [online_softmax(qh, k[0, h, lo:hi], v[0, h, lo:hi], block=8) for lo, hi in ((0, 25), (25, 50))]
    got, want = merge(ranges), ref[0, h * G_:(h + 1) * G_]
    assert not (off := where_differs(got, want, ("query head", "dim"))), f"KV head {h}: {off}; weigh each " \
        "range's l and a by exp(m_r - M), M the largest m_r, add them, then divide the sums"
print("two ranges of 25 tokens, merged by hand == softmax over all 50 tokens, for each KV head")

# %% [markdown]
# ### 2.1 The kernel in Triton
#
# `decode_attention_triton` launches one Triton program per (sequence, KV head, range). A program loads its
# group's $G$ queries once, reads each key and value of its range once, in blocks of `BLOCK_N` tokens, runs
# the update above, and writes its $m$, $z$, $\tilde o$; `merge_splits` then merges the ranges. So a step
# reads the bytes of section 1 and little else. The source is `_decode_split_kernel` in
# [`kernels/decode_attention.py`](../kernels/decode_attention.py); you need not read it for this lesson.
# Against the reference, with one, two and four ranges and two block sizes (they change only the order of
# the sums):

# %% tags=["needs:online_softmax", "needs:merge_splits"]
from kernels.decode_attention import decode_attention_triton

if RUN_KERNELS:
    for block_n, splits in ((16, 1), (16, 4)) if TINY else ((16, 1), (16, 2), (16, 4), (32, 2)):
        out = decode_attention_triton(q, k, v, block_n=block_n, splits=splits)
        print(f"kernel, block_n {block_n}, {splits} range(s): max |kernel - reference| = {(out - ref).abs().max():.1e}")
else:
    print("skipped: decode_attention_triton against the reference (Triton is not installed)")

# %% [markdown]
# ### 2.2 Selected rows
#
# A method that keeps a different set of tokens per head (SnapKV, AdaKV) can give the kernel the kept rows'
# indices instead of a compacted copy: `selected_decode_attention_triton` loads `idx[b, h, n]`, then that row
# of K and V; `-1` entries are padding, for ragged budgets. It reads the kept rows plus 4 bytes of index per
# row. Against the reference, which copies the kept rows out first, then attends:

# %% tags=["needs:online_softmax", "needs:merge_splits"]
from kernels.decode_attention import reference_selected_decode_attention, selected_decode_attention_triton

idx = torch.stack([torch.randperm(T_, generator=g)[:12] for _ in range(Hkv_)])[None].to(DEVICE)  # (1, H_kv, 12)
idx[0, 1, 8:] = -1                                                                     # a shorter head
sel_ref = reference_selected_decode_attention(q, k, v, idx)
if RUN_KERNELS:
    out = selected_decode_attention_triton(q, k, v, idx, block_n=16)
    print(f"selected rows: max |kernel - gather-then-attend reference| = {(out - sel_ref).abs().max():.1e}")
else:
    print("skipped: selected_decode_attention_triton against the reference (Triton is not installed)")

# %% [markdown]
# ## 3. Measured on an H100
#
# `python -m fastpath.bench` times each kernel and its PyTorch reference (for dense decode also PyTorch's
# `scaled_dot_product_attention`, SDPA) and measures a device-to-device copy's bandwidth in the same run. One
# H100 run (one layer, bf16, 32 query and 8 KV heads of 128 numbers) is saved in
# `results/kernels_bench_h100.json`, with the copy bandwidth it measured (below the 3.35 TB/s of section 1's
# datasheet):

# %%
import json
from pathlib import Path

h100 = json.loads((Path(kernels.__file__).parents[1] / "results" / "kernels_bench_h100.json").read_text())
d8, d1, sel = h100["rows"][:3]                             # dense decode, twice; selected rows
print(f"dense 8 x 32k: {d8['fraction_of_copy_bw']['triton']:.0%} of the copy bandwidth; dense 1 x 128k: "
      f"{d1['ms']['sdpa'] / d1['ms']['triton']:.3f}x SDPA's speed (the same bytes)")
print(f"selected keep 0.1: {sel['full_cache_ms']['triton'] / sel['ms']['triton']:.1f}x the full cache's speed")
print(f"copy bandwidth measured in the same run: {h100['copy_bandwidth'] / 1e12:.2f} TB/s")

# %% [markdown]
# Dense decode moves its bytes about as fast as a plain copy and runs within a few percent of SDPA: nothing is
# left to gain but reading
# fewer bytes. Selected rows do read fewer, but gain less than their bytes promise (Exercise 1 counts them).
# The same online softmax runs in two more kernels, for the caches of lessons 06 and 03
# ([`kernels/count_sketch.py`](../kernels/count_sketch.py),
# [`kernels/tensor_decode.py`](../kernels/tensor_decode.py)); [`kernels/README.md`](../kernels/README.md) has
# their H100 results.

# %% [markdown]
# ## Exercises
#
# Each exercise has a cell where you write (replace the `None`), a check cell, and the reference answer,
# collapsed. Neither needs a GPU.
#
# ### Exercise 1: what selected-index decode must read
#
# The case `selected keep 0.1 B=8 S=32768` is one layer of the Llama-3-8B shape (32 query heads, 8 KV heads of
# dimension 128, bf16) for 8 sequences of 32768 tokens. It keeps 3276 rows per (sequence, KV head) and gives the
# kernel their indices as int32, one per kept row. Write `my_step_bytes(B, S, rows)`: the bytes a step of this layer
# must move at least for B sequences of S tokens reading `rows` rows per (sequence, KV head): the rows' keys and
# values read once, an index per row where it reads fewer than S (the selected kernel; the dense one reads every row,
# no index), and each sequence's queries read once and its output written once (32 query heads, bf16). The check
# compares it with the three cases of section 3 (`dense B=8 S=32768`, `dense B=1 S=131072` and the selected one) and
# prints the speed-up the roofline then promises, dense over selected. The kernel measured 8.0x (section 3): is the
# gather what falls short?

# %%
my_step_bytes = None                # replace None: a function (B, S, rows) -> bytes (write def my_step_bytes(...))
print(f"measured: the kernel on the kept rows {sel['ms']['triton']:.3f} ms; the same kernel on a cache holding "
      f"only the kept rows, copied together (no gather) {sel['compacted_ms']['triton']:.3f} ms")


# %%
from exercises import exercise


@exercise("Exercise 1")
def check_step_bytes(step_bytes):                        # d8, d1, sel: section 3's cases, as measured
    dense = "the keys and values of every row (B sequences x 8 KV heads x S rows x 128 numbers, bf16), no index"
    for case, (B, S, rows), what in ((d8, (8, 32768, 32768), dense), (d1, (1, 131072, 131072), dense),
                                     (sel, (8, 32768, 3276), "the kept rows' keys and values, one 4-byte index per "
                                      "kept row (its key and value share it)")):
        assert step_bytes(B, S, rows) == case["bytes"], f"{case['case']}: {what}, and the queries and output " \
                                                         "(B sequences x 32 query heads x 128 numbers each)"
    kept = 65536                                         # half of one sequence of 131072 tokens, selected
    assert step_bytes(1, 131072, kept) == 2 * 8 * kept * 128 * 2 + 8 * kept * 4 + 2 * 32 * 128 * 2, \
        "selected keep 0.5 B=1 S=131072: the kept rows' keys and values and an index each, wherever rows < S"
    promise = step_bytes(8, 32768, 32768) / step_bytes(8, 32768, 3276)
    return f"the roofline promises {promise:.1f}x; the kernel measured " \
           f"{sel['full_cache_ms']['triton'] / sel['ms']['triton']:.1f}x (section 3)"


check_step_bytes(my_step_bytes)

# %%
# BEGIN SOLUTION [kernels] K and V of the rows read (2 bytes a number), 4 bytes an index, q and output 32 heads x 128
def reference_step_bytes(B, S, rows):
    kv = 2 * B * 8 * rows * 128 * 2                      # keys and values of the rows read, bf16
    index = B * 8 * rows * 4 if rows < S else 0          # an int32 index per kept row; the dense kernel needs none
    return kv + index + 2 * B * 32 * 128 * 2             # + each query read and each output written
# END SOLUTION


check_step_bytes(reference_step_bytes)
reference_promise = reference_step_bytes(8, 32768, 32768) / reference_step_bytes(8, 32768, 3276)
print(f"No: the bytes promise {reference_promise:.1f}x, and the kernel takes only "
      f"{sel['ms']['triton'] / sel['compacted_ms']['triton']:.2f}x the time of attention over a "
      "compacted copy of the same rows: that copy falls short of its bytes too")
at_copy_ms = sel["bytes"] / h100["copy_bandwidth"] * 1e3                 # the step's bytes at the copy bandwidth
print(f"Its {sel['bytes'] / 1e6:.0f} MB take {at_copy_ms:.3f} ms at the copy bandwidth, the kernel "
      f"{sel['ms']['triton']:.3f} ms: {(sel['ms']['triton'] - at_copy_ms) * 1e3:.0f} us beyond its bytes, where the "
      f"dense step ({d8['ms']['triton']:.3f} ms) runs at {d8['fraction_of_copy_bw']['triton']:.0%} of the copy's "
      "speed. A guess, which this run did not time apart: a step this short may feel fixed costs (the launches, the "
      "merge of the ranges)")

# %% [markdown]
# ### Exercise 2: where the cache overtakes the weights
#
# At batch 1, all in bf16, the Llama-3-8B shape's cache outweighs its weights from about 122k tokens
# (section 1). Serve it now with its 8e9 parameters in FP8, one byte each, the cache still in bf16, at a
# batch of 8 sequences: from how many tokens of context per sequence does the cache read more
# bytes than the weights? Give a whole number of tokens (`my_tokens`).

# %%
my_tokens = None                    # replace None: the fewest tokens per sequence where the cache outweighs them


# %%
@exercise("Exercise 2")
def check_tokens(tokens):
    assert not isinstance(tokens, (str, bytes)), "a number of tokens, as 1000, not text"
    assert float(tokens).is_integer(), "a count of tokens is whole: the first T at which the cache outweighs"
    tokens = int(tokens)                                     # a numpy or tensor integer as Python's (no overflow)
    fp8_weights, cache = 8.0e9 * 1, lambda T: decode_bytes(32, 8, T, 128, 2, batch=8)   # 8B parameters
    far = "far from the crossing: check the bytes a token adds (K and V, all layers and KV heads: decode_bytes of " \
        "section 1) for all 8 sequences (batch=8), and the weights at one byte a parameter (FP8: 8e9 bytes)"
    assert 0.98 * fp8_weights < cache(tokens) and cache(int(0.98 * tokens)) <= fp8_weights, far
    assert cache(tokens) > fp8_weights, "at that context the cache is not yet larger than the weights (FP8: " \
        "8e9 bytes): count K and V of all 8 sequences (decode_bytes of section 1, with batch=8), and round up"
    assert cache((tokens + 1) // 2) <= fp8_weights, "at half that context the cache already outweighs the weights: " \
        "count K and V of all 8 sequences (batch=8), and the weights at one byte a parameter (FP8: 8e9 bytes)"
    assert cache(tokens - 1) <= fp8_weights, "one token earlier the cache already outweighs the weights (FP8: " \
        "8e9 bytes, one a parameter): look for the first such T (decode_bytes of section 1, with batch=8)"


check_tokens(my_tokens)

# %%
# BEGIN SOLUTION [kernels] the smallest S with 2 x 8 x 32 layers x 8 KV heads x S x 128 x 2 bytes > weights
reference_tokens = math.floor(8.0e9 * 1 / (2 * 8 * 32 * 8 * 128 * 2)) + 1
# END SOLUTION
check_tokens(reference_tokens)
