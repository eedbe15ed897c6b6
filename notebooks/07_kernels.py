# %% [markdown]
# # 07 Kernels: decoding is reading, so read less
#
# A decode step of a long-context model spends its time *loading the KV cache*, not computing with it.
# This notebook makes that argument with numbers (the roofline), then walks through the Triton kernels in
# `kernels/`, each next to the PyTorch reference it must match:
#
# 1. the roofline of a decode step: bytes, FLOPs, and why compression is a speed-up only when it reads
#    fewer bytes;
# 2. the bytes of *storing* a token: the textbook `torch.cat` append against nanollm's in-place storage,
#    measured beside the attention;
# 3. `decode_attention.py`: split-K ("flash-decoding") attention over a contiguous cache, and the same
#    kernel gathering per-head selected rows (what SnapKV/AdaKV-style selections need) without a copy;
# 4. `count_sketch.py`: KVReviver's sketch, and a fused rebuild-then-attend;
# 5. `tensor_decode.py`: tensor attention over the four-matrix cache in tiles, with an online softmax over
#    pairs;
# 6. the benchmark: what `python -m fastpath.bench` measures, and what was measured on an H100.
#
# Without a GPU the kernels run in Triton's *interpreter* (`TRITON_INTERPRET=1`): the same kernel code,
# executed block by block with NumPy, exact and very slow. That is how this notebook and the tests check
# them on a laptop.
#
# **Without Triton** (macOS, or a minimal install) the notebook still runs: the roofline, every PyTorch
# reference, the committed H100 results and the exercises need only PyTorch. The cells that launch a
# kernel print one line saying that they skipped it, and why.

# %%
import os
import sys

TINY = os.environ.get("NANOLLM_TINY") == "1"      # CI runs the notebook in a quick tiny mode
if not os.path.isdir("kernels") and os.path.isdir(os.path.join("..", "kernels")):
    sys.path.insert(0, os.path.abspath(".."))      # opened from notebooks/: make the repo importable

import torch

if not torch.cuda.is_available():                  # before any kernel is defined: run them in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

import kernels
from kernels.decode_attention import (
    decode_attention_triton,
    reference_decode_attention,
    reference_selected_decode_attention,
    selected_decode_attention_triton,
)
from methods.evaluation.viz import print_mode

ROOT = Path(kernels.__file__).resolve().parents[1]          # the repository (for results/)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"    # every tensor below is made on it
RUN_KERNELS = kernels.HAS_TRITON                           # the cells that launch a kernel need Triton


def skipped(what: str) -> None:
    """The one line a kernel cell prints instead of running without Triton."""
    print(f"skipped: {what} (Triton is not installed: the kernels need it; the references above do not)")


print(f"tiny mode: {TINY}; device: {DEVICE}; Triton available: {kernels.HAS_TRITON}; "
      f"interpreter: {kernels.interpreting()}")
print_mode(TINY)                                   # quick mode: the text describes another run

# %% [markdown]
# ## 1. The roofline of a decode step
#
# One new token per sequence. For each layer and KV head the step reads every cached key and value once
# (`2 S d` numbers) and does about `4 G S d` FLOPs with them (`q.k` and `p.v` for the `G` query heads that
# share the KV head). Its arithmetic intensity is `4 G S d / (2 S d b) = 2 G / b` FLOP per byte: 4 for
# Llama-3-8B's groups of 4 query heads (32 query heads, 8 KV heads) in bf16 (b = 2). An H100 does about
# 990 TFLOP/s of bf16 matrix math against about 3.35 TB/s of HBM bandwidth (its data sheet), a ridge of
# about 300 FLOP/byte (printed below: 296): decode sits 74x below it. The time is
# `bytes / bandwidth`, whatever the arithmetic.

# %%
def decode_bytes(B, L, H_kv, S, d, b):
    """K and V bytes a decode step reads, whole model."""
    return 2 * B * L * H_kv * S * d * b


L, H, H_kv, d, b = 32, 32, 8, 128, 2               # a Llama-3-8B shape, bf16
weights = 8.0e9 * b                                # ~8B parameters, read once per step
BW = 3.35e12                                       # H100 SXM data-sheet bandwidth, bytes/s
RIDGE = 990e12 / BW                                # FLOP per byte where compute would start to bound
contexts = [2**k for k in range(10, 18)]
kv_ms = [decode_bytes(1, L, H_kv, S, d, b) / BW * 1e3 for S in contexts]
w_ms = weights / BW * 1e3
kv_32k = decode_bytes(1, L, H_kv, 32768, d, b)                  # bytes of K/V a step reads at 32k tokens
intensity = 2 * (H // H_kv) / b
print(f"KV bytes per token: {decode_bytes(1, L, H_kv, 1, d, b) // 1024} KiB; at 32k tokens a step reads "
      f"{kv_32k / 1e9:.2f} GB of KV cache = {kv_32k / BW * 1e3:.2f} ms "
      f"at {BW / 1e12:.2f} TB/s (weights: {w_ms:.2f} ms)")
print(f"arithmetic intensity 2G/b = {intensity:.0f} FLOP/byte (the H100's ridge: ~{RIDGE:.0f}, "
      f"{RIDGE / intensity:.0f}x higher)")
print(f"at batch 1 the cache reads as many bytes as the weights at "
      f"{weights / decode_bytes(1, L, H_kv, 1, d, b) / 1e3:.0f}k tokens of context")
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.loglog(contexts, kv_ms, "o-", label="KV cache, full")
ax.loglog(contexts, [m * 0.1 for m in kv_ms], "o--", label="KV cache, keep 10%")
ax.axhline(w_ms, color="k", ls=":", label="weights (batch 1)")
ax.set(xlabel="context tokens", ylabel="ms per decode step (floor)",
       title="bandwidth floor of a decode step, Llama-3-8B shape on an H100 (data sheet)")
ax.legend(fontsize=8)
ax.grid(True, which="both", alpha=0.3)
plt.show()

# %% [markdown]
# At batch 1 the weights dominate until the cache is as large as the model (printed above: about 122k
# tokens); at batch B the cache is B times larger and dominates much sooner. Keeping 10% of the cache cuts
# its floor 10x, *if* the kernel reads only the kept rows: computing full attention and masking the
# dropped ones moves every byte and saves nothing.

# %% [markdown]
# ## 2. Storing a token without copying the cache
#
# If a step's time is its bytes over the bandwidth, the bytes spent *storing* the new token count too. The
# textbook way to add its entry is `k = torch.cat([k, k_new], dim=2)`. It allocates a new tensor and
# copies the whole layer, at every token: the step reads and writes every stored byte once more on top of
# the attention's read, and a generation of T tokens copies O(T^2) bytes in total.
#
# nanollm's `LayerKV` (`nanollm/storage.py`, the `append` task of the `cache` assignment) instead keeps
# `k`, `v`, `pos` as views of the first T slots of larger buffers. `append` writes the new entries in place
# after them; only when a buffer is full does it allocate one twice as large and copy once. Over a
# generation every entry is copied about once on average: O(T) in total, nothing per step. Watch the
# buffer's capacity as tokens arrive:

# %%
from nanollm.storage import LayerKV

store = LayerKV()
slots, capacity, moves, ptr = [], [], 0, None
for t in range(300):
    store.append(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), torch.tensor([t]))
    moves += store.k.data_ptr() != ptr                 # a new buffer: the stored entries were copied
    ptr = store.k.data_ptr()
    slots.append(len(store))
    capacity.append(store.capacity())
plt.figure(figsize=(5.5, 3.2), dpi=80)
plt.plot(slots, label="slots in use (T)")
plt.step(range(300), capacity, where="post", label="buffer capacity")
plt.xlabel("tokens appended")
plt.ylabel("slots per head")
plt.title("LayerKV: capacity doubles when full, slots grow by one")
plt.legend()
plt.show()
print(f"300 appends, {moves} buffer allocations (the first one included); final capacity {store.capacity()}")

# %% [markdown]
# The buffer is reallocated only when the slots in use reach its capacity, a handful of times (printed
# above) for 300 tokens, and each time the capacity doubles; every other append writes one row in place.
#
# What the copy costs, measured on this machine's CPU: one layer shaped like a model whose cache dominates
# the bytes (8 KV heads of dimension 32, fp32), at several context lengths. Per token we time the textbook
# `torch.cat` append, `LayerKV.append`, and the attention of one query per head over the stored entries
# (`reference_decode_attention`, what a decode step must read anyway).

# %%
import time

COPY_CONTEXTS = [256, 1024] if TINY else [1024, 4096, 16384]   # context lengths for the append timings


def timed_ms(fn, repeats=9):
    """(median, first quartile, third quartile) of ``repeats`` calls of ``fn``, in ms."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    q1, median, q3 = torch.tensor(times).quantile(torch.tensor([0.25, 0.5, 0.75]), interpolation="midpoint")
    return 1e3 * median.item(), 1e3 * q1.item(), 1e3 * q3.item()


threads = torch.get_num_threads()
torch.set_num_threads(1)                                       # one thread: steadier timings on a shared machine
rows = []
for T in COPY_CONTEXTS:
    k_, v_ = torch.randn(1, 8, T, 32), torch.randn(1, 8, T, 32)          # (B, H_kv, T, d)
    new_k, new_v = torch.randn(1, 8, 1, 32), torch.randn(1, 8, 1, 32)
    store = LayerKV()
    store.append(k_, v_, torch.arange(T))
    q_ = torch.randn(1, 8, 32)                                           # (B, H, d)
    cat_ms = timed_ms(lambda: (torch.cat([k_, new_k], dim=2), torch.cat([v_, new_v], dim=2)))
    append_ms = timed_ms(lambda: store.append(new_k, new_v, torch.tensor([len(store)])))
    attend_ms = timed_ms(lambda: reference_decode_attention(q_, store.k, store.v))
    rows.append((T, cat_ms, append_ms, attend_ms))
torch.set_num_threads(threads)

fig, ax = plt.subplots(figsize=(6.5, 3.6), dpi=80)
for j, name in enumerate(["torch.cat append (copies the layer)", "in-place append (LayerKV)",
                          "attention over the entries"]):
    ax.plot(COPY_CONTEXTS, [r[j + 1][0] for r in rows], "os^"[j] + "-", label=name)
    ax.fill_between(COPY_CONTEXTS, [r[j + 1][1] for r in rows], [r[j + 1][2] for r in rows], alpha=0.2)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.xaxis.set_major_locator(FixedLocator(COPY_CONTEXTS))
ax.yaxis.set_major_locator(FixedLocator([0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30]))
for axis in (ax.xaxis, ax.yaxis):
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())
ax.set(xlabel="tokens stored (T)", ylabel="ms per new token (median, quartile band)",
       title="storing one token vs reading the cache, one layer, CPU")
ax.legend(loc="upper left", fontsize=8)
plt.show()
T, (cat_ms, *_), (append_ms, *_), (attend_ms, *_) = rows[-1]
print(f"at {T} tokens: torch.cat append {cat_ms / attend_ms:.1f}x the attention's time, in-place append "
      f"{attend_ms / append_ms:.0f}x less than the attention; torch.cat / attention over all lengths: "
      f"{', '.join(f'{cat[0] / att[0]:.1f}x' for _, cat, _, att in rows)}")

# %% [markdown]
# The in-place append stays flat at every length, while the `torch.cat` append grows with the context
# like the attention does and, at the longest context, costs more than the attention itself (the ratios
# printed above). The copy reads *and writes* every stored byte, twice the bytes the attention reads, and
# allocates a new tensor each time; a large one may also cost fresh memory from the operating system. On
# the machine that built this notebook (two cores shared with other work) the ratio moves a lot from run
# to run, so read it as "at least the order of the attention", not as a fixed factor. With it, a decode
# step at least doubles its memory traffic, and a method that keeps a tenth of the tokens would look
# *better* than it is, because its small cache is also cheap to copy. (`python -m methods.evaluation.bench`
# measures whole decode steps: bytes read per step, the achieved GB/s against the machine's measured
# bandwidth, and the speedup of each compression method over the full cache.)

# %% [markdown]
# ## 3. Decode attention, split along the sequence
#
# `decode_attention_triton(q, k, v)`: one program per (sequence, KV head, range of tokens). Each program
# loads its group's G query heads once and walks its range in blocks of `BLOCK_N` tokens. It never holds
# a whole row of scores: an **online softmax** keeps a running max $m$, a running sum $\ell$ and an output
# accumulator $a$, and for each block of scores $s_n$ (keys $k_n$, values $v_n$) updates them
# (FlashAttention, §3.1, Algorithm 1):
#
# $$m' = \max\big(m, \max_n s_n\big), \qquad \ell' = e^{m - m'}\,\ell + \sum_n e^{s_n - m'}, \qquad
# a' = e^{m - m'}\,a + \sum_n e^{s_n - m'}\,v_n$$
#
# Each range ends with its own $(m_r, \ell_r, a_r)$; a small reduction (`merge_splits`) **merges** the
# ranges exactly, rescaling each to the largest max $M$:
#
# $$M = \max_r m_r, \qquad \text{out} = \frac{\sum_r e^{m_r - M}\,a_r}{\sum_r e^{m_r - M}\,\ell_r}$$
#
# Below, both by hand (no Triton needed), checked against the plain softmax of the reference; then the
# kernel's own loop, printed from `kernels/decode_attention.py`.

# %%
g = torch.Generator().manual_seed(0)
B_, H_, Hkv_, S_, d_ = 1, 4, 2, 50, 16
q = torch.randn(B_, H_, d_, generator=g).to(DEVICE)
k = torch.randn(B_, Hkv_, S_, d_, generator=g).to(DEVICE)
v = torch.randn(B_, Hkv_, S_, d_, generator=g).to(DEVICE)
ref = reference_decode_attention(q, k, v)                        # (B, H, d): softmax over all 50 tokens


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


# BEGIN SOLUTION [kernels:merge_splits] FlashAttention §3.1: weigh each range by exp(m_r - M), then divide the sums
def merge(ranges):
    """[(m, l, a)] of the ranges -> out (G, d)."""
    M = torch.stack([m for m, _, _ in ranges]).max(dim=0).values
    top = sum(torch.exp(m - M)[:, None] * a for m, _, a in ranges)
    return top / sum(torch.exp(m - M) * l for m, l, _ in ranges)[:, None]
# END SOLUTION


G_ = H_ // Hkv_
for h in range(Hkv_):                                            # each KV head with its group of query heads
    qh = q[0, h * G_:(h + 1) * G_] / math.sqrt(d_)
    ranges = [online_softmax(qh, k[0, h, lo:hi], v[0, h, lo:hi], block=8) for lo, hi in ((0, 25), (25, 50))]
    got, want = merge(ranges), ref[0, h * G_:(h + 1) * G_]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"KV head {h}: off by {(got - want).abs().max():.1e}"
print("online softmax over blocks of 8, two ranges merged by hand == softmax over all 50 tokens, for each head")

# %% [markdown]
# The kernel runs the same update, with `tl.` operations on blocks loaded from the cache. Its loop, as the
# file has it (`m_safe` guards a range with no valid token yet, where $e^{m - m'}$ would be $e^{-\infty +
# \infty}$; both products of a block are `tl.dot`s, the G query heads padded to the 16 rows a tensor-core
# tile needs: wasted arithmetic the step can afford, since loading K and V bounds it). In a student copy of
# the `kernels` assignment this cell comes without its output: run, it prints your own kernel.

# %%
source = (ROOT / "kernels" / "decode_attention.py").read_text().splitlines()
first = source.index("    def _decode_split_kernel(") - 1                 # the @triton.jit line above it
loop = next(i for i in range(first, len(source)) if source[i].strip().startswith("for first in range("))
end = next(i for i in range(loop, len(source)) if source[i].strip().startswith("out = "))
shown = source[first:first + 2] + ["        ..."] + source[loop - 5:end]
print("\n".join(line for line in shown if "SOLUTION" not in line))      # the course's markers left out

# %% [markdown]
# Then the kernel itself against the reference, with one, two and four ranges per KV head (`merge_splits`
# reduces them):

# %% tags=["needs:online_softmax", "needs:merge_splits"]
if RUN_KERNELS:
    for splits in (1, 2, 4):
        out = decode_attention_triton(q, k, v, block_n=16, splits=splits)
        print(f"kernel, {splits} range(s): max |kernel - reference| = {(out - ref).abs().max():.1e}")
else:
    skipped("decode_attention_triton with 1, 2 and 4 ranges against the reference")

# %% [markdown]
# ### 3.1 Selected rows
#
# A method that keeps a different set of tokens per head (SnapKV, AdaKV) can either copy the kept rows
# into a compact cache, or give the kernel the indices: `selected_decode_attention_triton` loads
# `idx[b, h, n]` and then row `idx[...]` of K and V, inside the kernel; `-1` entries are padding (AdaKV's
# ragged budgets). Bytes read: the kept rows plus 4 bytes of index per row. The reference gathers first;
# below it is checked against attending, head by head, over the kept rows copied out by hand.

# %% tags=["needs:online_softmax", "needs:merge_splits"]
idx = torch.stack([torch.randperm(S_, generator=g)[:12] for _ in range(Hkv_)])[None].to(DEVICE)  # (1, H_kv, 12)
idx[0, 1, 8:] = -1                                                                     # a shorter head
sel_ref = reference_selected_decode_attention(q, k, v, idx)
G_ = H_ // Hkv_
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
# KVReviver (`methods/kvreviver.py`) sums evicted tokens into a count sketch: cells `key`, `value` of
# shape (r, b, H_kv, d); token J lands in cell `h_i(J)` of every row i (values with a sign `g_i(J)`), and is
# rebuilt as the element-wise median over the rows. Three kernels in `kernels/count_sketch.py`:
#
# * **insert**: one program per block of tokens adds them into their cells with atomic adds, so two tokens
#   that share a cell in the same batch both count;
# * **query**: gathers the r cells of each token and takes the median in registers;
# * **fused decode**: attention over raw tokens *and* sketch tokens, rebuilding each sketch token's key and
#   value in registers as it streams past: the rebuilt cache is never written. The PyTorch path writes
#   all of it (n tokens x H_kv x d, keys and values) before attending.
#
# Below, a sketch filled by the method's own class, queried through the reference and the kernels:

# %% tags=["needs:online_softmax", "needs:merge_splits"]
from kernels.count_sketch import (
    reference_sketch_decode_attention,
    reference_sketch_query,
    sketch_decode_attention_triton,
    sketch_query_triton,
)
from methods.kvreviver import VagueSketch

r = 3                                                     # sketch rows; Hkv_ = 2 KV heads of d_ = 16, as above
sketch = VagueSketch(rows=r, width=5, n_kv_head=Hkv_, head_dim=d_, seed=0, device=DEVICE)
pos = torch.arange(20, device=DEVICE)
k_tok, v_tok = (torch.randn(20, Hkv_, d_, generator=g).to(DEVICE) for _ in range(2))
sketch.insert(pos, k_tok, v_tok)                          # 20 tokens in 5 cells per row: collisions
cells, signs = sketch.buckets(pos).int(), sketch.signs(pos)
k_ref, v_ref = sketch.query(pos)
k_def, v_def = reference_sketch_query(sketch.key, sketch.value, cells, signs)
print(f"reference_sketch_query vs VagueSketch.query: max diff {(k_def - k_ref).abs().max():.1e} (keys), "
      f"{(v_def - v_ref).abs().max():.1e} (values); the sketch's own error on values: "
      f"{(v_ref - v_tok).abs().mean():.2f} mean |v^ - v| (5 cells for 20 tokens)")
q1 = torch.randn(4, d_, generator=g).to(DEVICE)           # 4 query heads, GQA group 2
k_raw, v_raw = (torch.randn(Hkv_, 7, d_, generator=g).to(DEVICE) for _ in range(2))
unfused = reference_sketch_decode_attention(q1, k_raw, v_raw, sketch.key, sketch.value, cells, signs, d_ ** -0.5)
print(f"rebuild in PyTorch then attend: output {tuple(unfused.shape)} over 7 raw + 20 sketch tokens per KV head")
if RUN_KERNELS:
    k_hat, v_hat = sketch_query_triton(sketch.key, sketch.value, cells, signs)
    print(f"query kernel vs VagueSketch.query: max diff {(k_hat - k_ref).abs().max():.1e} (keys), "
          f"{(v_hat - v_ref).abs().max():.1e} (values)")
    fused = sketch_decode_attention_triton(q1, k_raw, v_raw, sketch.key, sketch.value, cells, signs, d_ ** -0.5)
    print(f"fused rebuild-then-attend vs rebuild in PyTorch then attend: max diff {(fused - unfused).abs().max():.1e}")
else:
    skipped("sketch_query_triton and the fused sketch_decode_attention_triton against their references")

# %% [markdown]
# What fusing saves: the PyTorch path writes the rebuilt keys and values (2 n d numbers per KV head) and
# reads them back; the fused kernel reads the cells and writes nothing. What it does not save: each
# rebuilt token still gathers 2r cells (r = 3 rows, for its key and its value), in fp32, where a raw token
# is one bf16 key and one bf16 value: $2r \times 4 / (2 \times 2) = 6$ times the bytes. So rebuilding a token costs
# *more* than attending to a raw one. On the H100 (section 6) the fused decode was 10.3x faster than the
# unfused PyTorch path, and yet ran at 0.19x the speed of dense decode over all tokens: the sketch saves
# memory, not time.

# %% [markdown]
# ## 5. Tensor attention over the four-matrix cache
#
# The factored decode step of `methods/tensor_attention/attention.py` still writes an i x i score matrix per head.
# `kernels/tensor_decode.py` never does: each program takes a tile of BLOCK_A rows of K1, V1 and streams
# every tile of BLOCK_B rows of K2, V2 past it, computing the tile's scores `(q * K1_a) @ K2_b^T` with one
# `tl.dot`, folding them into one running max, one running sum and one output accumulator for *all* pairs
# (the online softmax, over pairs instead of tokens), and adding `sum_a V1[a] * (p @ V2_b)[a]`. Programs
# split the a axis; a tiny second kernel merges their partials.

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
# `python -m fastpath.bench --json results/kernels_bench.json` times, side by side in one run, each kernel,
# its PyTorch reference and (for dense decode) `scaled_dot_product_attention`, with the bytes each step must
# move, the achieved GB/s and its fraction of a device-to-device copy measured in the same run. On a GPU it
# checks the targets below and prints met / NOT met.
#
# ### 6.1 What was measured on an H100
#
# The committed run, `results/kernels_bench_h100.json` (one H100, bf16), read here; no GPU or Triton needed:

# %% tags=["needs:online_softmax", "needs:merge_splits"]
h100 = json.loads((ROOT / "results" / "kernels_bench_h100.json").read_text())
impls = ["reference", "sdpa", "materialising", "factored_reference", "triton"]
fig, ax = plt.subplots(figsize=(10, 3.6))
width = 0.8 / len(impls)
for j, impl in enumerate(impls):
    xs = [i for i, r in enumerate(h100["rows"]) if impl in r["GB/s"]]
    ax.bar([x + (j - len(impls) / 2 + 0.5) * width for x in xs],
           [h100["rows"][i]["GB/s"][impl] for i in xs], width, label=impl.replace("_", " "))
ax.axhline(h100["copy_bandwidth"] / 1e9, color="k", ls=":", label="device copy (same run)")
ax.set_yscale("log")
ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
ax.set_xticks(range(len(h100["rows"])), [r["case"].replace(" S=", "\nS=") for r in h100["rows"]], fontsize=8)
ax.set(xlabel="benchmark case", ylabel="achieved GB/s (log)",
       title="kernels vs PyTorch references: the committed H100 run, bf16")
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))       # beside the bars, not over them
plt.tight_layout()
plt.show()
print(f"device: {h100['device']} (H100), dtype {h100['dtype']}, "
      f"measured copy bandwidth {h100['copy_bandwidth'] / 1e9:.0f} GB/s; the targets:")
for target, verdict in h100["targets"].items():
    print(f"  {target:<42} {verdict}")
dense_1x = next(r for r in h100["rows"] if r["case"] == "dense B=1 S=131072")
print(f"dense 1 x 128k exactly: the kernel at {dense_1x['ms']['sdpa'] / dense_1x['ms']['triton']:.3f}x SDPA's speed")

# %% [markdown]
# On the dense cases the Triton kernel reads about as fast as SDPA and the device's own copy, far above the
# PyTorch reference; on the sketch and tensor cases every bar is far below the copy line, because those
# steps are not a plain read of the cache. The targets printed under the figure, one by one:
#
# * **dense split decode** reads at 98% of the copy bandwidth at 8 x 32k (target 75%: met). At 1 x 128k it
#   is at 1.00x SDPA's speed when rounded, 0.995x exactly: a tie in practice, but the target "not slower
#   than SDPA" is NOT met by the letter, and the JSON says so.
# * **selected-index decode** at keep 0.1 of 32k: 8.0x faster than the full-cache kernel, and 1.04x the
#   time of the same kernel over a compacted cache of the same rows (both met): gathering in the kernel
#   costs almost nothing over copying first.
# * **fused sketch decode** at a budget of a quarter of the tokens: 10.3x faster than the unfused PyTorch
#   path (met), but 0.19x the speed of dense decode over all tokens (NOT met): section 4's six times the
#   bytes per rebuilt token.
# * **factored tensor decode** at i = 1024: 182x faster and 31790x less peak memory than materialising
#   (met). Its GB/s are low because it is not bandwidth-bound: it does i^2 d work per head on i d bytes.
#
# The sketch and tensor inputs fit in the H100's L2 cache (50 MB in its data sheet), so their GB/s are not
# HBM bandwidth (`fastpath/bench.py`'s docstring). What lets the decode kernel read near the bandwidth: both
# of its products go through `tl.dot` (the group's query heads padded to 16 rows, so the tensor cores take
# them), and its split merge is one launch; a kernel that multiplies with broadcasts and sums in registers
# leaves the tensor cores idle and reads at a fraction of it.
#
# ### 6.2 On this machine
#
# What the benchmark does on the machine running this notebook: on a CPU it times the references only
# (the kernels run only in the interpreter, which is for correctness, not speed), so its numbers are the
# CPU side of the roofline argument; on a GPU with Triton it times the kernels too.

# %%
from fastpath import bench

if TINY:
    bench.main(["--quick", "--cases", "dense", "tensor"])
else:
    bench.main(["--quick"])

# %% [markdown]
# ## Exercises
#
# The exercises read the committed H100 run (`h100`, section 6.1) and the roofline's numbers (section 1);
# none needs a GPU or Triton. Each code cell checks your answer against an independent computation.
#
# ### Exercise 1: the bytes of a dense decode step
#
# The case `dense B=8 S=32768` is one layer of a Llama-3-8B decode step: B = 8 sequences of S = 32768
# tokens, 32 query heads, 8 KV heads of dimension 128, bf16. The bench counts what the step must move at
# least: K and V read once, the queries read once, the output written once. Compute that count from the
# shape, then the kernel's achieved GB/s from its time in milliseconds.

# %% tags=["needs:online_softmax", "needs:merge_splits"]
dense = next(row for row in h100["rows"] if row["case"] == "dense B=8 S=32768")
# BEGIN SOLUTION [kernels] bytes: K + V + q + output, each B x heads x tokens x 128 x 2; GB/s: bytes / s / 1e9
ex1_bytes = 2 * 8 * 8 * 32768 * 128 * 2 + 2 * 8 * 32 * 128 * 2
ex1_gbs = ex1_bytes / (dense["ms"]["triton"] / 1e3) / 1e9
# END SOLUTION
assert ex1_bytes == dense["bytes"], \
    f"{ex1_bytes} bytes, the bench counted {dense['bytes']}: K and V have 8 KV heads, q and the output 32 query heads"
assert abs(ex1_gbs - dense["GB/s"]["triton"]) < 1e-6 * dense["GB/s"]["triton"], \
    f"{ex1_gbs:.0f} GB/s, the bench says {dense['GB/s']['triton']:.0f}: ms is milliseconds, and GB means 1e9 bytes"
print(f"{ex1_bytes:,} bytes in {dense['ms']['triton']:.3f} ms = {ex1_gbs:.0f} GB/s")

# %% [markdown]
# ### Exercise 2: what selected-index decode must read
#
# The case `selected keep 0.1 B=8 S=32768` keeps K = 3276 rows per (sequence, KV head) and gives the kernel
# their indices as int32. Count the bytes it must move (kept keys and values, indices, queries, output), and
# the ratio of the dense case's bytes to it: the speed-up the roofline promises. Compare it with the
# measured 8.0x (`h100["targets"]`).

# %% tags=["needs:online_softmax", "needs:merge_splits"]
sel = next(row for row in h100["rows"] if row["case"].startswith("selected"))
# BEGIN SOLUTION [kernels] kept K and V rows (2 bytes a number), 4 bytes per index, q and output as in exercise 1
ex2_bytes = 2 * 8 * 8 * 3276 * 128 * 2 + 8 * 8 * 3276 * 4 + 2 * 8 * 32 * 128 * 2
ex2_promise = dense["bytes"] / ex2_bytes
# END SOLUTION
assert ex2_bytes == sel["bytes"], \
    f"{ex2_bytes} bytes, the bench counted {sel['bytes']}: did you count the int32 indices once per kept row?"
assert abs(ex2_promise - dense["bytes"] / sel["bytes"]) < 1e-9, "the promise is dense bytes / selected bytes"
print(f"roofline promise {ex2_promise:.1f}x; measured {h100['targets']['selected >= 6x full cache']}")

# %% [markdown]
# ### Exercise 3: where the cache overtakes the weights
#
# Section 1 found that at batch 1 the KV cache of the Llama-3-8B shape reads as many bytes as the weights
# (`weights`, 16 GB in bf16) at about 122k tokens. At batch 8, from how many tokens of context per sequence
# does the cache read more bytes than the weights? Give a whole number of tokens.

# %%
# BEGIN SOLUTION [kernels] the smallest S with 2 x 8 x 32 layers x 8 KV heads x S x 128 x 2 bytes > weights
ex3_tokens = math.floor(weights / (2 * 8 * 32 * 8 * 128 * 2)) + 1
# END SOLUTION
llama_8 = lambda S: decode_bytes(8, 32, 8, S, 128, 2)       # noqa: E731  (batch 8, the Llama-3-8B shape, bf16)
assert llama_8(ex3_tokens) > weights >= llama_8(ex3_tokens - 1), \
    f"at {ex3_tokens} tokens the cache reads {llama_8(ex3_tokens) / 1e9:.2f} GB against " \
    f"{weights / 1e9:.0f} GB of weights: look for the first S where it is larger (decode_bytes, section 1)"
print(f"batch 8: the cache outweighs the weights from {ex3_tokens:,} tokens per sequence")

# %% [markdown]
# ### Exercise 4: a kernel on a GPU (open)
#
# On a machine with an NVIDIA GPU (sm_80 or newer) and Triton, run `python -m fastpath.bench` and compare
# its table with section 6.1. Which targets does your GPU meet? Then change `block_n` in section 3's kernel
# call (16, 32, 64) in the interpreter: does the answer change, and why must it not?

# %%
from methods.evaluation.viz import print_run_time  # the whole notebook, from its first cell

print_run_time()
