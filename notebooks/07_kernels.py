# %% [markdown]
# # 06 Kernels: decoding is reading, so read less
#
# A decode step of a long-context model spends its time *loading the KV cache*, not computing with it.
# This notebook makes that argument with numbers (the roofline), then walks through the Triton kernels in
# `kernels/`, each next to the PyTorch reference it must match:
#
# 1. the roofline of a decode step: bytes, FLOPs, and why compression is a speed-up only when it reads
#    fewer bytes;
# 2. `decode_attention.py`: split-K ("flash-decoding") attention over a contiguous cache, and the same
#    kernel gathering per-head selected rows (what SnapKV/AdaKV-style selections need) without a copy;
# 3. `count_sketch.py`: KVReviver's sketch, and a fused rebuild-then-attend;
# 4. `tensor_decode.py`: tensor attention over the four-matrix cache in tiles, with an online softmax over
#    pairs;
# 5. the benchmark: what `python -m kernels.bench` measures, and what was measured.
#
# Without a GPU the kernels run in Triton's *interpreter* (`TRITON_INTERPRET=1`): the same kernel code,
# executed block by block with NumPy, exact and very slow. That is how this notebook and the tests check
# them on a laptop.

# %%
import os
import sys

TINY = os.environ.get("NANOLLM_TINY") == "1"      # CI runs the notebook in a quick tiny mode
if not os.path.isdir("kernels") and os.path.isdir(os.path.join("..", "kernels")):
    sys.path.insert(0, os.path.abspath(".."))      # opened from notebooks/: make the repo importable

import torch

if not torch.cuda.is_available():                  # before any kernel is defined: run them in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math

import matplotlib.pyplot as plt

import kernels
from kernels.decode_attention import (
    decode_attention_triton,
    merge_splits,
    reference_decode_attention,
    reference_selected_decode_attention,
    selected_decode_attention_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"    # every tensor below is made on it
if not kernels.HAS_TRITON:
    raise SystemExit("this notebook runs the kernels: it needs triton (pip install triton, Linux)")
print(f"tiny mode: {TINY}; device: {DEVICE}; Triton available: {kernels.HAS_TRITON}; "
      f"interpreter: {kernels.interpreting()}")

# %% [markdown]
# ## 1. The roofline of a decode step
#
# One new token per sequence. For each layer and KV head the step reads every cached key and value once
# (`2 S d` numbers) and does about `4 G S d` FLOPs with them (`q.k` and `p.v` for the `G` query heads that
# share the KV head). Its arithmetic intensity is `4 G S d / (2 S d b) = 2 G / b` FLOP per byte: 4 for
# Llama-3-8B's groups of 4 query heads (32 query heads, 8 KV heads) in bf16 (b = 2). An H100 does about
# 990 TFLOP/s of bf16 matrix math against about 3.35 TB/s of HBM bandwidth (its data sheet), a ridge of
# ~300 FLOP/byte: decode sits ~75x below it. The time is `bytes / bandwidth`, whatever the arithmetic.

# %%
def decode_bytes(B, L, H_kv, S, d, b):
    """K and V bytes a decode step reads, whole model."""
    return 2 * B * L * H_kv * S * d * b


L, H, H_kv, d, b = 32, 32, 8, 128, 2               # a Llama-3-8B shape, bf16
weights = 8.0e9 * b                                # ~8B parameters, read once per step
BW = 3.35e12                                       # H100 SXM data-sheet bandwidth, bytes/s
contexts = [2**k for k in range(10, 18)]
kv_ms = [decode_bytes(1, L, H_kv, S, d, b) / BW * 1e3 for S in contexts]
w_ms = weights / BW * 1e3
kv_32k = decode_bytes(1, L, H_kv, 32768, d, b)                  # bytes of K/V a step reads at 32k tokens
print(f"KV bytes per token: {decode_bytes(1, L, H_kv, 1, d, b) // 1024} KiB; at 32k tokens a step reads "
      f"{kv_32k / 1e9:.2f} GB of KV cache = {kv_32k / BW * 1e3:.2f} ms "
      f"at {BW / 1e12:.2f} TB/s (weights: {w_ms:.2f} ms)")
print(f"arithmetic intensity 2G/b = {2 * (H // H_kv) / b:.0f} FLOP/byte (the H100's ridge: ~{990e12 / BW:.0f})")
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.loglog(contexts, kv_ms, "o-", label="KV cache, full")
ax.loglog(contexts, [m * 0.1 for m in kv_ms], "o--", label="KV cache, keep 10%")
ax.axhline(w_ms, color="k", ls=":", label="weights (batch 1)")
ax.set(xlabel="context tokens", ylabel="ms per decode step (floor)", title="bandwidth floor of a decode step, H100")
ax.legend(fontsize=8)
ax.grid(True, which="both", alpha=0.3)
plt.show()

# %% [markdown]
# At batch 1 the weights dominate until the cache is as large as the model (here ~120k tokens); at batch
# B the cache is B times larger and dominates much sooner. Keeping 10% of the cache cuts its floor 10x,
# *if* the kernel reads only the kept rows: computing full attention and masking the dropped ones moves
# every byte and saves nothing.

# %% [markdown]
# ## 2. Decode attention, split along the sequence
#
# `decode_attention_triton(q, k, v)`: one program per (sequence, KV head, range of tokens). Each program
# loads its group's G query heads once, walks its range in blocks of `BLOCK_N` tokens with an online
# softmax (running max `m`, running sum `l`, output accumulator `acc`), and writes its three partials. Both
# products of a block (`q K^T`, then `P V`) are `tl.dot`s, the G query heads padded to the 16 rows a
# tensor-core tile needs: wasted arithmetic the step can afford, since loading K and V bounds it. A
# small reduction merges the ranges. Here is that merge, done by hand on the kernel's own inputs:

# %%
g = torch.Generator().manual_seed(0)
B_, H_, Hkv_, S_, d_ = 1, 4, 2, 50, 16
q = torch.randn(B_, H_, d_, generator=g).to(DEVICE)
k = torch.randn(B_, Hkv_, S_, d_, generator=g).to(DEVICE)
v = torch.randn(B_, Hkv_, S_, d_, generator=g).to(DEVICE)
ref = reference_decode_attention(q, k, v)
for splits in (1, 2, 4):
    out = decode_attention_triton(q, k, v, block_n=16, splits=splits)
    print(f"{splits} range(s): max |kernel - reference| = {(out - ref).abs().max():.1e}")

# the merge: attention over two halves, each with its own max and sum, combined exactly
scale = 1 / math.sqrt(d_)
qg = q.view(B_, Hkv_, H_ // Hkv_, d_) * scale
parts = []
for lo, hi in ((0, 25), (25, 50)):
    s = qg @ k[:, :, lo:hi].transpose(-1, -2)                     # (B, H_kv, G, n)
    m = s.max(-1).values
    p = torch.exp(s - m[..., None])
    parts.append((m, p.sum(-1), p @ v[:, :, lo:hi]))
m, l, acc = (torch.stack(t, dim=2).flatten(0, 1) for t in zip(*parts))   # (B*H_kv, ranges, G, ...)
merged = merge_splits(m, l, acc).reshape(B_, H_, d_)
print(f"two halves merged by hand: max |merged - reference| = {(merged - ref).abs().max():.1e}")

# %% [markdown]
# **Selected rows.** A method that keeps a different set of tokens per head (SnapKV, AdaKV) can either
# copy the kept rows into a compact cache, or give the kernel the indices: `selected_decode_attention_triton`
# loads `idx[b, h, n]` and then row `idx[...]` of K and V, inside the kernel; `-1` entries are padding
# (AdaKV's ragged budgets). Bytes read: the kept rows plus 4 bytes of index per row.

# %%
idx = torch.stack([torch.randperm(S_, generator=g)[:12] for _ in range(Hkv_)])[None].to(DEVICE)  # (1, H_kv, 12)
idx[0, 1, 8:] = -1                                                                     # a shorter head
out = selected_decode_attention_triton(q, k, v, idx, block_n=16)
print(f"selected rows: max |kernel - gather-then-attend reference| = "
      f"{(out - reference_selected_decode_attention(q, k, v, idx)).abs().max():.1e}")

# %% [markdown]
# ## 3. The count sketch (KVReviver)
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
# Below, a sketch filled by the method's own class, queried and attended through the kernels:

# %%
from kernels.count_sketch import reference_sketch_decode_attention, sketch_decode_attention_triton, sketch_query_triton
from methods.kvreviver import VagueSketch

H_kv, d_, r = 2, 16, 3
sketch = VagueSketch(rows=r, width=5, n_kv_head=H_kv, head_dim=d_, seed=0, device=DEVICE)
pos = torch.arange(20, device=DEVICE)
k_tok, v_tok = (torch.randn(20, H_kv, d_, generator=g).to(DEVICE) for _ in range(2))
sketch.insert(pos, k_tok, v_tok)                          # 20 tokens in 5 cells per row: collisions
k_hat, v_hat = sketch_query_triton(sketch.key, sketch.value, sketch.buckets(pos).int(), sketch.signs(pos))
k_ref, v_ref = sketch.query(pos)
print(f"query kernel vs VagueSketch.query: max diff {(k_hat - k_ref).abs().max():.1e} (keys), "
      f"{(v_hat - v_ref).abs().max():.1e} (values); the sketch's own error on values: "
      f"{(v_ref - v_tok).abs().mean():.2f} mean |v^ - v| (5 cells for 20 tokens)")
q1 = torch.randn(4, d_, generator=g).to(DEVICE)           # 4 query heads, GQA group 2
k_raw, v_raw = (torch.randn(H_kv, 7, d_, generator=g).to(DEVICE) for _ in range(2))
fused = sketch_decode_attention_triton(q1, k_raw, v_raw, sketch.key, sketch.value, sketch.buckets(pos).int(),
                                       sketch.signs(pos), d_ ** -0.5)
unfused = reference_sketch_decode_attention(q1, k_raw, v_raw, sketch.key, sketch.value, sketch.buckets(pos).int(),
                                            sketch.signs(pos), d_ ** -0.5)
print(f"fused rebuild-then-attend vs rebuild in PyTorch then attend: max diff {(fused - unfused).abs().max():.1e}")

# %% [markdown]
# What fusing saves: the PyTorch path writes the rebuilt keys and values (2 n d numbers per KV head) and
# reads them back; the fused kernel reads the cells (r gathers per token, mostly from cache: the sketch is
# small) and writes nothing. With r = 3 it still does 3 gathers per rebuilt token, so it saves memory
# *traffic to DRAM*, not arithmetic: rebuilding costs about what attending to the same number of raw tokens
# costs.

# %% [markdown]
# ## 4. Tensor attention over the four-matrix cache
#
# The factored decode step of `methods/tensor_attention/attention.py` still writes an i x i score matrix per head.
# `kernels/tensor_decode.py` never does: each program takes a tile of BLOCK_A rows of K1, V1 and streams
# every tile of BLOCK_B rows of K2, V2 past it, computing the tile's scores `(q * K1_a) @ K2_b^T` with one
# `tl.dot`, folding them into one running max, one running sum and one output accumulator for *all* pairs
# (the online softmax, over pairs instead of tokens), and adding `sum_a V1[a] * (p @ V2_b)[a]`. Programs
# split the a axis; a tiny second kernel merges their partials.

# %%
from kernels.tensor_decode import peak_memory_bytes, reference_tensor_decode, tensor_decode_triton
from methods.tensor_attention import naive_four_cache_attention

n_, dt = 37, 16                                           # a ragged length: 3 tiles of 16, the last partial
qt = torch.randn(1, 2, dt, generator=g).to(DEVICE)
K1, K2, V1, V2 = (torch.randn(1, 2, n_, dt, generator=g).to(DEVICE) for _ in range(4))
out = tensor_decode_triton(qt, K1, K2, V1, V2, block_a=16, block_b=16, splits=2)
print(f"kernel vs factored reference: {(out - reference_tensor_decode(qt, K1, K2, V1, V2)).abs().max():.1e}; "
      f"vs the materialising reference: "
      f"{(out - naive_four_cache_attention(qt[:, :, None], K1, K2, V1, V2, dt ** -0.5)[:, :, 0]).abs().max():.1e}")
print("working memory of one decode step per query and head (fp32, d = 64), besides the cache itself:")
for n in (256, 1024, 4096):
    mib = {p: peak_memory_bytes(n, 64, p) / 2**20 for p in ("naive", "reference", "kernel")}
    print(f"  i = {n:>5}: materialising {mib['naive']:>9.1f} MiB, factored reference {mib['reference']:>7.2f} MiB, "
          f"kernel {mib['kernel'] * 2**20:.0f} bytes")

# %% [markdown]
# ## 5. The benchmark
#
# `python -m kernels.bench --json results/kernels_bench.json` times, side by side in one run, each kernel,
# its PyTorch reference and (for dense decode) `scaled_dot_product_attention`, with the bytes each step must
# move, the achieved GB/s and its fraction of a device-to-device copy measured in the same run. On a GPU it
# checks the targets below and prints met / NOT met.
#
# | kernel | target (ratios, one run) | H100, bf16 |
# |---|---|---|
# | dense split decode | >= 75% of copy bandwidth at 8 x 32k; SDPA's speed at 1 x 128k | 98% (met); 1.00x (a tie) |
# | selected-index decode, keep 0.1 of 32k | >= 6x full-cache decode; <= 1.3x a compacted cache | 8.0x; 1.04x (met) |
# | fused sketch decode, 25% budget | >= 0.67x dense decode; >= 5x the unfused PyTorch path | 0.19x (not met); 10.3x |
# | factored tensor decode, i = 1024 | >= 10x faster, 20x less peak memory than materialising | 182x; 31790x (met) |
#
# The numbers are in `results/kernels_bench_h100.json`. Two lessons from the GPU. The first decode kernel
# multiplied with broadcasts and sums in registers and read at 18% of the bandwidth; with both products in
# `tl.dot` (the group's query heads padded to 16 rows) and a one-launch merge it reads at 98%. And the
# sketch's fused decode is *slower* than dense decode over all tokens: each rebuilt token gathers six fp32
# cells (three for its key, three for its value), six times the bytes of a bf16 row. The sketch saves
# memory, not time. Below, what the benchmark does on the machine running this notebook (on a CPU: the
# references only, which show the CPU side of the roofline argument).

# %%
from kernels import bench

if TINY:
    bench.main(["--quick", "--cases", "dense", "tensor"])
else:
    bench.main(["--quick"])
