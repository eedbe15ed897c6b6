# %% [markdown]
# # 03 Tensor attention: a four-matrix or a two-matrix KV cache
#
# Chen, Li, Liang, Shi et al., "Time and Memory Trade-off of KV-Cache Compression in Tensor Transformer
# Decoding", 2025, [arXiv 2503.11108](https://arxiv.org/abs/2503.11108). Tensor attention itself comes from
# Sanford, Hsu & Telgarsky (NeurIPS 2023, [arXiv 2306.02896](https://arxiv.org/abs/2306.02896)) and Alman &
# Song (ICLR 2024, [arXiv 2310.04064](https://arxiv.org/abs/2310.04064)).
#
# A standard attention query scores single tokens. A **tensor attention** query scores *pairs* of tokens:
# each token has two keys and two values, the query at step t scores the pair (a, b) with
# `<q_t, k1_a * k2_b>`, a softmax runs over all t^2 pairs, and the output mixes `v1_a * v2_b`. Decoding
# needs a cache, and there are two ways to keep it:
#
# * **four matrices** `K1, K2, V1, V2` (4 n d numbers), the pairs formed when needed;
# * **two matrices** `K~ = K1 (/) K2`, `V~ = V1 (/) V2` holding every pair row (2 n^2 d numbers).
#
# The paper proves memory lower bounds for both when d >= C log n (Omega(n d) bits given four matrices,
# Omega(n^2 d) bits given two, Theorems 4.1/4.2; the second is about arbitrary pair rows, not rows built
# from n tokens' factors) and says the two-matrix cache is faster by Omega(n^2 d) per step (Theorem 4.3).
#
# **You will learn**
#
# 1. the definition written by hand (pair scores, one softmax over all pairs) and checked against the
#    library; three ways of computing one decode step agree (and reduce to ordinary attention when
#    `k2 = v2 = 1`);
# 2. a tensor-attention decoder: the same nanollm model, another attention module, three cache layouts;
# 3. the trade-off measured: memory grows like n vs n^2, but time per step like n^2 for *every* path,
#    so the claimed speed gap only holds against a four-matrix cache that rebuilds the pairs each step;
# 4. a task where pairs matter (Match3): a trained tensor model vs a standard one of the same size;
# 5. the memory lower bound in a small experiment (the Index problem);
# 6. SubGen-style clustering and sampling as an approximate cache: error vs memory;
# 7. whether dropping tokens or dropping pairs is the better use of a compressed tensor cache's bytes.
#
# Code: `methods/tensor_attention/attention.py` (the module and the caches), `methods/tensor_attention/bench.py`
# (the measurement), `methods/tensor_attention/match3.py` (task, training, checkpoints),
# `methods/tensor_attention/index_problem.py`, `methods/tensor_attention/subgen.py`. Section 1 writes the pair
# scores and their softmax by hand; the rest imports the library.

# %%
import os
import sys

TINY = os.environ.get("NANOLLM_TINY") == "1"      # CI runs the notebook in a quick tiny mode
if not os.path.isdir("methods") and os.path.isdir(os.path.join("..", "methods")):
    sys.path.insert(0, os.path.abspath(".."))      # opened from notebooks/: make the repo importable

import math

import matplotlib.pyplot as plt
import matplotlib.ticker
import torch

from methods.evaluation.intervals import describe, paired_difference, wilson
from methods.evaluation.viz import print_mode
from methods.tensor_attention import (
    LAYOUTS,
    TENSOR_ATTENTION,
    four_cache_attention,
    kron_rows,
    match3,
    naive_four_cache_attention,
    pair_scores,
    pair_softmax,
    tensor_cache,
    two_cache_attention,
)
from methods.tensor_attention.bench import measure, table
from nanollm import generate
from nanollm.attention import attend
from nanollm.config import preset
from nanollm.generation import decode_step, extend, prefill
from nanollm.model import Transformer

torch.set_num_threads(1)                           # tiny tensors: one thread is fastest and least noisy
LENGTHS = [16, 32, 64, 128] if TINY else [32, 64, 128, 256, 512, 1024]   # section 3
EVAL_SEQUENCES = 200 if TINY else 2000             # section 4
print(f"tiny mode: {TINY}")
print_mode(TINY)                                   # quick mode: the text describes another run

# %% [markdown]
# ## 1. One decode step, built by hand
#
# In tensor attention a query scores *pairs* of cached tokens: the pair (a, b) gets the inner product of
# the query with the elementwise product of token a's first key and token b's second key, one softmax
# runs over all n^2 pairs at once (not row by row), and the output mixes the elementwise products of the
# two values. For the query `q` of one decode step over n cached tokens (Chen et al., Definition 3.6;
# `scale = 1/sqrt(d)`):
#
# $$S[a, b] = \mathrm{scale}\,\big\langle q,\; K_1[a] \odot K_2[b] \big\rangle, \qquad
#   P = \operatorname{softmax}_{(a, b)}(S), \qquad
#   o = \sum_{a, b} P[a, b]\; V_1[a] \odot V_2[b].$$
#
# The scores and the softmax, written out with two loops for one query on a random toy (n = 50 tokens,
# d = 16), against the library's `pair_scores` (which never forms the n^2 x d products) and `pair_softmax`:

# %%
g = torch.Generator().manual_seed(0)
n, d = 50, 16
K1, K2, V1, V2 = (torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) for _ in range(4))   # (batch, head, n, d)
q = torch.randn(1, 1, 1, d, generator=g, dtype=torch.float64)                                   # one query
scale = 1 / math.sqrt(d)


# BEGIN SOLUTION [tensor_attention:pair_softmax] score each pair (a, b) in two loops, then ONE softmax over all n^2
def pair_probabilities_by_hand(q, K1, K2, scale):
    """q (d,), K1 (n, d), K2 (n, d) -> S, P, both (n, n): the pair scores and their softmax for one query."""
    n = K1.shape[0]
    S = torch.empty(n, n, dtype=q.dtype)
    for a in range(n):
        for b in range(n):
            S[a, b] = scale * (q * K1[a] * K2[b]).sum()          # <q, K1[a] * K2[b]>
    P = torch.exp(S - S.max())                                  # over every pair at once, not row by row
    return S, P / P.sum()
# END SOLUTION


S_hand, P_hand = pair_probabilities_by_hand(q[0, 0, 0], K1[0, 0], K2[0, 0], scale)
S_lib = pair_scores(q, K1, K2, scale)                         # (1, 1, 1, n, n): one score per pair
assert torch.allclose(S_hand, S_lib[0, 0, 0]), "a pair's score is scale * sum_i q_i K1[a]_i K2[b]_i"
assert torch.allclose(P_hand, pair_softmax(S_lib)[0, 0, 0]), "one softmax over all n^2 pairs, not one per row"
print(f"{n * n} pairs: scores and probabilities by hand equal the library's; the probabilities sum to "
      f"{P_hand.sum():.3f} over all pairs, and the largest row sum is {P_hand.sum(1).max():.3f}")

# %% [markdown]
# The library computes the same numbers in three ways, two of them without loops (Definition 3.1 defines
# `kron_rows(K1, K2)`, one row `K1[a] * K2[b]` per pair):
#
# * **naive four-matrix**: build `K1 (/) K2` and `V1 (/) V2` (n^2 rows each), then ordinary attention over
#   the pair rows. This is what Theorem 4.3 charges the four-matrix cache at every step.
# * **factored four-matrix**: `S = (K1 * q) @ K2^T` is the n x n score matrix, and
#   `o = sum_a V1[a] * (P @ V2)[a]`; nothing of size n^2 d is ever formed.
# * **two-matrix**: the pair rows are already stored; ordinary attention over them.

# %%
# needs: pair_scores, pair_softmax, factored_output
naive = naive_four_cache_attention(q, K1, K2, V1, V2, scale)
factored = four_cache_attention(q, K1, K2, V1, V2, scale)
two = two_cache_attention(q, kron_rows(K1, K2), kron_rows(V1, V2), scale)
print(f"fp64, n = {n}: |naive - factored| = {(naive - factored).abs().max():.1e}, "
      f"|two - factored| = {(two - factored).abs().max():.1e}")

ones = torch.ones_like(K2)
standard, _, _ = attend(q, K1, V1, torch.tensor([n - 1]), torch.arange(n).expand(1, 1, n))
print(f"k2 = v2 = 1: |tensor attention - nanollm's standard attention| = "
      f"{(four_cache_attention(q, K1, ones, V1, ones, scale) - standard).abs().max():.1e}")

# %% [markdown]
# Why the ones reduce it: with `k2_b = 1` every pair (a, b) scores `<q, k1_a>`, so the softmax over the
# n^2 pairs is the ordinary softmax over a, spread evenly over b; with `v2_b = 1` the output is
# `sum_a p_a v1_a`. The module uses this: its second key and value are `1 + projection(x)`, so a freshly
# initialised layer (projections near zero) starts as ordinary attention and learns to use pairs.

# %% [markdown]
# ## 2. A tensor-attention decoder
#
# The module plugs into the nanollm decoder through `ModelConfig.attention`; norms, MLP, embeddings and
# generation are the same code as for every other model in this repository. Rotary embeddings do not give
# pair scores that depend only on distances (`<R_t q, R_a k1 * k2_b>` is not a function of `t - a`), so the
# tensor model uses learned absolute positions (the GPT-2 flavour). The cache layout is chosen per cache:
# `tensor_cache(config, "four" | "four-naive" | "two")`.

# %%
# needs: pair_scores, pair_softmax, factored_output, two_cache_append
config = preset("TINY_GPT2", attention=TENSOR_ATTENTION, max_seq_len=64)
torch.manual_seed(0)
model = Transformer(config).eval()
with torch.no_grad():                              # random weights larger than the init: pairs matter
    for p in model.parameters():
        p.normal_(0, 0.3)
x = torch.randint(0, config.vocab_size, (1, 40), generator=g)
with torch.no_grad():
    full = model(x)                                # the training path: all queries at once, causal pairs
    for layout in LAYOUTS:
        cache = tensor_cache(config, layout)
        steps = [prefill(model, x[:, :20], cache), extend(model, x[:, 20:30], cache)]
        steps += [decode_step(model, x[:, t:t + 1], cache)[:, None] for t in range(30, 40)]
        diff = (torch.cat(steps, 1) - full).abs().max().item()
        print(f"{layout:>10}: cached prefill + extend + decode vs uncached forward: max |diff| {diff:.1e}; "
              f"stored {cache.nbytes() / 1024:.0f} KiB")
    tokens = [generate(model, x[:, :10], 12, cache=tensor_cache(config, layout)) for layout in LAYOUTS]
print("greedy tokens identical for every layout:", all(torch.equal(t, tokens[0]) for t in tokens))

# %% [markdown]
# ## 3. The trade-off, measured
#
# One layer (4 heads x 16 dims, fp32) filled with i random tokens, then decode steps (append the new
# token's rows, attend with its query) on each path. Left: stored bytes. Right: time per step, the median
# of 7 steps, slopes fitted over the longer half of the lengths.

# %%
# needs: pair_scores, pair_softmax, factored_output, two_cache_append
timing = measure(LENGTHS)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
for k, style in (("four", "o-"), ("two", "s-")):
    ax1.loglog(timing["lengths"], [b / 2**20 for b in timing[k]["bytes"]], style,
               label=f"{k}-matrix (slope {timing[k]['bytes_slope']:.2f})")
ax1.set(xlabel="tokens i", ylabel="stored MiB (one layer)", title="memory: 4 i d  vs  2 i^2 d + 4 i d")
for k, style in (("four-naive", "^-"), ("four", "o-"), ("two", "s-")):
    ax2.loglog(timing["lengths"], timing[k]["ms"], style, label=f"{k} (slope {timing[k]['time_slope']:.2f})")
ax2.set(xlabel="tokens i", ylabel="ms per decode step", title="time per decode step")
for ax in (ax1, ax2):
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_xticks(timing["lengths"])
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
# times vary by machine: label 1, 2 and 5 of every decade so a narrow range still shows readable ticks
ax2.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
ax2.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
ax2.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
fig.tight_layout()
plt.show()
print(table(timing))
last = -1
print(f"at i = {timing['lengths'][last]}: two-matrix cache "
      f"{timing['two']['bytes'][last] / timing['four']['bytes'][last]:.0f}x the bytes of the four-matrix cache; "
      "naive four / two = "
      f"{timing['four-naive']['ms'][last] / timing['two']['ms'][last]:.1f}x the time, factored four / two = "
      f"{timing['four']['ms'][last] / timing['two']['ms'][last]:.2f}x")

# %% [markdown]
# Memory grows like i for the four-matrix cache and like i^2 for the two-matrix one, and time per step
# like i^2 on every path. The timings move from run to run (page faults on fresh buffers, a shared CPU;
# `python -m methods.tensor_attention.bench` gives another draw each time), so read the slopes and the
# orders of magnitude printed above, not their second digit:
#
# * **Memory**: slope 1.00 for the four-matrix cache and 1.98 for the two-matrix one (its 4 i d of factors
#   bend the line just below 2). At 1024 tokens the two-matrix cache is 513x larger: (2 i^2 + 4 i) d
#   against 4 i d (525312 KiB against 1024 KiB).
# * **Time**: every path's fitted slope is well above 1: no layout escapes the i^2 d arithmetic of
#   scoring every pair.
# * **Theorem 4.3 holds against the naive path only**: rebuilding both Kronecker products every step is
#   several times slower than the two-matrix cache at the longest lengths, and the gap between them grows
#   about like i^2, the Omega(n^2 d) of the theorem.
# * **The factored four-matrix path beats the two-matrix path** at the longest lengths (the last column
#   of the table is below 1). Both do about 2 i^2 d multiply-adds per head, but the two-matrix path streams
#   2 i^2 d stored floats from memory at every step, while the factored path reads 4 i d and works on an
#   i x i score matrix per head. On this CPU the trade-off "less memory, more time" does not exist: the
#   four-matrix cache wins on both. (A GPU has other constants; not measured here.)

# %% [markdown]
# ## 4. Where pairs matter: Match3
#
# Sanford et al. (§4) prove that Match3, "does some pair of numbers complete this one to 0 mod M?", needs a
# large standard attention layer, while one tensor head computes it. `methods/tensor_attention/match3.py` makes it
# causal and dense: `BOS x_1 L_1 x_2 L_2 ...`, where `L_i` says whether `x_a + x_b + x_i = 0 (mod 32)` for some
# `a <= b <= i`. Two bundled models, trained with the same budget (3000 steps of 128 sequences) by
# `python -m methods.tensor_attention.match3 train --attention tensor|standard`: a tensor-attention decoder and a
# standard one with the same number of parameters (its MLP is wider by the two extra projections' worth). Same
# parameters and steps, not the same compute: a tensor layer costs O(T^3) per sequence, a standard one O(T^2). One
# seed each, and a learning rate tuned for neither. Sanford et al.'s lower bound is for a single standard layer;
# this baseline has two layers and MLPs, so the comparison tests more than the theorem.

# %%
# needs: pair_scores, pair_softmax, factored_output
tensor_model, tensor_card = match3.load("match3-tensor")
standard_model, standard_card = match3.load("match3-standard")
baseline = match3.majority_baseline()
for name, m, card in (("tensor", tensor_model, tensor_card), ("standard", standard_model, standard_card)):
    r4 = match3.evaluate(m, n_seq=EVAL_SEQUENCES)
    print(f"{name:>8} attention, {m.num_params():,} parameters: label accuracy {r4['accuracy']:.3f} "
          f"(teacher-forced), {r4['greedy_accuracy']:.3f} (greedy, reading its own labels); "
          f"majority-per-position baseline {baseline:.3f}; card: {card['accuracy']:.3f}")
    print("  training curve (step: accuracy on 500 sequences): "
          + ", ".join(f"{h['step']}: {h['accuracy']:.3f}" for h in card["history"]))

# %% [markdown]
# Accuracy by position: early positions are easy (few pairs: mostly NO), late ones too (many pairs: mostly
# YES); the middle is where a model must actually find the pair.

# %%
# needs: pair_scores, pair_softmax, factored_output
ids, targets = match3.batch(EVAL_SEQUENCES, match3.N_NUMBERS, seed=10**6)
fig, ax = plt.subplots(figsize=(7, 3.5))
truth = ids[:, 2::2]                                        # (sequences, numbers): the true labels
yes = (truth == match3.YES).float().mean(0)
positions = torch.arange(1, match3.N_NUMBERS + 1)
ax.plot(positions, torch.maximum(yes, 1 - yes), "k--", label="majority per position")
right = {}                                                  # (sequences, numbers): label right or wrong
for shift, (name, m) in zip((-0.08, 0.08), (("tensor", tensor_model), ("standard", standard_model))):
    with torch.no_grad():
        right[name] = (m(ids).argmax(-1)[:, 1::2] == truth).float()
    by_position = right[name].mean(0)
    lo, hi = zip(*(wilson(a, len(ids)) for a in by_position.tolist()))
    ax.errorbar(positions + shift, by_position, yerr=[by_position - torch.tensor(lo), torch.tensor(hi) - by_position],
                fmt="o-", capsize=2, label=f"{name} attention")
    print(f"{name:>8} attention, accuracy by position 1-{match3.N_NUMBERS}: "
          + " ".join(f"{a:.2f}" for a in by_position.tolist()))
print("majority per position:         " + " ".join(f"{a:.2f}" for a in torch.maximum(yes, 1 - yes).tolist()))
ax.set(xlabel="position i of the number", ylabel="label accuracy (95% interval)", title="Match3 (mod 32), by position",
       xticks=positions.tolist())
ax.legend()
ax.grid(alpha=0.3)
plt.show()
gap, lo, hi = paired_difference([right["tensor"].mean(1).tolist()], [right["standard"].mean(1).tolist()])
print(f"tensor - standard label accuracy, paired over the same {len(ids)} sequences: {describe(gap, lo, hi, 3)}")

# %% [markdown]
# Tensor attention is right more often than standard attention at every position from 3 on, and the gap
# is in the middle positions, where the majority guess is a coin flip (0.51 at position 6): there the
# tensor model is right at a rate of 0.92 and the standard one 0.81, at position 7 0.91 vs 0.74. Over all
# labels of the 2000 fresh sequences (`python -m methods.tensor_attention.match3 eval match3-tensor
# match3-standard` gives the same), tensor attention scores 0.944, standard attention 0.874 and the
# majority baseline 0.766; the difference is distinguishable (the paired 95% interval over the sequences,
# printed above, excludes 0). The standard model is far above the baseline too (two layers and MLPs can
# check a few pairs), but its training curve stays between 0.864 and 0.872 from step 1800 on, while the
# tensor model is still climbing at the end of the budget (0.907 at step 1800, 0.946 at step 3000). Both
# are single runs with one seed: the interval covers the evaluation sequences, not another training run.
#
# Greedy decoding through each cache layout gives the same labels (the three paths compute the same
# numbers, up to float rounding that never flips an argmax here):

# %%
# needs: pair_scores, pair_softmax, factored_output, two_cache_append
xs = torch.tensor([match3.random_numbers(match3.N_NUMBERS, __import__("random").Random(s)) for s in range(64)])
decoded = {layout: match3.greedy_labels(tensor_model, xs, layout) for layout in LAYOUTS}
print("identical labels for every layout:", all(torch.equal(v, decoded["four"]) for v in decoded.values()))
example = xs[0].tolist()
print("numbers:", example)
print("truth:  ", ["Y" if t == match3.YES else "n" for t in match3.labels(example)])
print("decoded:", ["Y" if t == match3.YES else "n" for t in decoded["two"][0].tolist()])

# %% [markdown]
# ## 5. The memory lower bound, run: the Index problem
#
# Theorem 4.1 says an exact four-matrix cache needs Omega(n d) bits. The proof is a reduction from the
# Index problem (Lemma 3.11): Alice holds n bits, writes a cache from them; Bob, given any index j, builds
# a query and reads x_j off one attention output. Then the cache is a message that tells Bob every bit, so
# it holds at least n bits. `methods/tensor_attention/index_problem.py` builds such a cache (random +-1 keys, the pair
# (j, j) wins Bob's softmax, the bits sit in V1) and compresses it two ways: keep k of the n token rows, or
# let groups of g tokens share one majority sign. Bob's accuracy against the bits the cache keeps, with the
# information limit from Fano's inequality (no s-bit cache can be right on more than this fraction):

# %%
# needs: pair_scores, pair_softmax, factored_output
from methods.tensor_attention.index_problem import accuracy_vs_bits, fano_accuracy, make_instance, retrieve

inst = make_instance(128, seed=0)
print(f"n = 128, d = {inst.d}: the full cache gives back every bit: "
      f"{bool((retrieve(inst) == inst.x).all())}")
TRIALS5 = 1 if TINY else 4
rows5 = accuracy_vs_bits(n=128, trials=TRIALS5)
fig, ax = plt.subplots(figsize=(7, 4))
N = rows5[0]["info_bits"]
s_grid = [N * i / 100 for i in range(101)]
ax.plot(s_grid, [fano_accuracy(s, N) for s in s_grid], "k-", label="Fano limit: most any s-bit cache allows")
ax.plot(s_grid, [0.5 + s / (2 * N) for s in s_grid], "k:", label="store s bits verbatim, guess the rest")
for scheme, style in (("rows", "o"), ("majority", "s")):
    pts = [r for r in rows5 if r["scheme"] == scheme]
    acc = torch.tensor([r["accuracy"] for r in pts])
    lo, hi = (torch.tensor(b) for b in zip(*(wilson(a, 128 * TRIALS5) for a in acc.tolist())))  # over n x trials bits
    ax.errorbar([r["bits"] for r in pts], acc, yerr=[acc - lo, hi - acc], fmt=style, capsize=3,
                label={"rows": "keep k of n token rows", "majority": "groups share a majority sign"}[scheme])
ax.set(xlabel="bits of x the cache keeps (s)", ylabel="Bob's accuracy over the n bits (95% interval)",
       title="Index problem on a tensor-attention cache, n = 128")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
plt.show()
for r in rows5:
    print(f"{r['scheme']:>8} {r['param']:>6}: {r['bits']:>4} bits -> accuracy {r['accuracy']:.3f} "
          f"(expected {r['expected']:.3f}, Fano limit {r['fano']:.3f})")

# %% [markdown]
# Both compressed caches stay under the limit, up to the spread of a finite sample (at s = 0 and s = N the
# expected accuracy *is* the limit, so a measured mean can sit a hair above it), and the limit is a straight consequence
# of counting: to be right on a fraction p of the n bits a cache needs at least n (1 - H(p)) bits, linear in n.
# This is an illustration of the theorem, not a proof of it (the proof must handle any cache, any query scheme);
# and it shows the four-matrix side only. The two-matrix bound (Omega(n^2 d), Theorem 4.2) is about caches that
# must answer for arbitrary pair rows, which a cache made of n token factors never stores.

# %% [markdown]
# ## 6. SubGen: an approximate cache when the keys cluster
#
# The lower bounds are for worst-case keys. When keys cluster, SubGen (Zandieh et al. 2024,
# [arXiv 2402.06082](https://arxiv.org/abs/2402.06082); used for tensor attention in §5.1 of the paper,
# SubGen4Cache / SubGen2Cache) keeps a few sampled keys per cluster to estimate the softmax normaliser and
# a norm-weighted sample of values for the numerator. `methods/tensor_attention/subgen.py` streams a tensor cache's
# pair
# rows through such a sketch; error against the exact output vs the bytes the sketch keeps:

# %%
# needs: pair_scores, pair_softmax, factored_output
from methods.tensor_attention.subgen import error_vs_memory

rows6 = error_vs_memory(n=24 if TINY else 32, seeds=1 if TINY else 4)
fig, ax = plt.subplots(figsize=(10, 4), layout="constrained")
ax.loglog([r["stored_bytes"] for r in rows6], [r["rel_error"] for r in rows6], "o-", label="||o_hat - o|| / ||o||")
ax.loglog([r["stored_bytes"] for r in rows6], [r["bound_error"] for r in rows6], "s-",
          label="error / (||softmax||_2 ||V~||_op): what the guarantee bounds")
ax.axvline(rows6[0]["two_cache_bytes"], color="r", ls="--", label="two-matrix cache (exact)")
ax.axvline(rows6[0]["four_cache_bytes"], color="g", ls="--", label="four-matrix cache (exact)")
ax.set(xlabel="bytes kept", ylabel="error", title="SubGen over the pair rows: error vs memory")
for axis in (ax.xaxis, ax.yaxis):                          # ticks at 1, 2, 5 x 10^k, written out
    axis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))     # beside the data
ax.grid(True, which="both", alpha=0.3)
plt.show()
print(f"exact caches: four-matrix {rows6[0]['four_cache_bytes']:,} bytes, "
      f"two-matrix {rows6[0]['two_cache_bytes']:,} bytes")
for r in rows6:
    print(f"per cluster {r['per_cluster']:>3}, value samples {r['value_samples']:>4}: {r['n_clusters']} clusters, "
          f"{r['stored_bytes']:>7,} bytes, relative error {r['rel_error']:.3f}")

# %% [markdown]
# The sketch trades error for memory smoothly, and against the two-matrix cache it saves a lot. But look
# at the green line: every sketch smaller than the exact four-matrix cache errs by about a third or more here
# (relative error 0.332 at 3,820 bytes, against 8,192 bytes for the exact answer). Sketching the
# n^2 pair rows only pays when the alternative is storing them; the four factor matrices already give the
# exact answer from O(n d) numbers (and a decoder that keeps generating needs them anyway, to make the
# next token's pairs).

# %% [markdown]
# ## 7. Compressing a tensor cache: drop tokens, or drop pairs?
#
# Evicting a *token* from a four-matrix cache removes its rows of K1, V1 and K2, V2: a whole row *and*
# column of the pair matrix S. Only the two-matrix cache can drop single *pairs*. Which is the better use
# of a byte? Keeping k tokens costs 4 k d numbers and keeps k^2 pairs; the same bytes hold only 2k pair
# rows of the two-matrix cache. On the trained Match3 model (layer 1, the query that decides the last
# label, 64 sequences), with an *oracle* choice for both (the tokens with the most attention mass, the
# pairs with the most), relative error of the attention output at equal bytes:

# %%
# needs: pair_scores, pair_softmax, factored_output
captured = {}
block = tensor_model.blocks[1]
hook = block.attn.register_forward_hook(lambda mod, inp, out: captured.update(x=inp[0]))
seqs, _ = match3.batch(64, match3.N_NUMBERS, seed=7)
with torch.no_grad():
    tensor_model(seqs[:, :-1])                              # up to the last number: its query picks L_n
    q_, K1_, K2_, V1_, V2_ = block.attn.projections(captured["x"])         # (64, H, T, d) each
hook.remove()
q_ = q_[:, :, -1:]                                          # (64, H, 1, d): the last number's query
scale_ = 1 / math.sqrt(q_.shape[-1])
exact = four_cache_attention(q_, K1_, K2_, V1_, V2_, scale_)
P = pair_softmax(pair_scores(q_, K1_, K2_, scale_))[:, :, 0]                # (64, H, T, T)
T_ = P.shape[-1]
token_mass = P.sum(-1) + P.sum(-2)                          # mass of the pairs each token is part of
rows = []
for k_tok in (2, 4, 8, 12, 16):
    keep = token_mass.topk(k_tok, dim=-1).indices.sort(-1).values[..., None].expand(-1, -1, -1, q_.shape[-1])
    sub = [t.gather(2, keep) for t in (K1_, K2_, V1_, V2_)]
    out_tok = four_cache_attention(q_, *sub, scale_)
    n_pairs = 2 * k_tok                                     # the same bytes: 4 k d = 2 (2k) d
    top = P.flatten(-2).topk(n_pairs, dim=-1).indices
    allowed = torch.zeros_like(P.flatten(-2), dtype=torch.bool).scatter_(-1, top, True).view_as(P)[:, :, None]
    out_pair = four_cache_attention(q_, K1_, K2_, V1_, V2_, scale_, allowed)
    err = lambda o: ((o - exact).norm(dim=-1) / exact.norm(dim=-1))[..., 0].mean(0)    # noqa: E731  (H,)
    rows.append((k_tok, n_pairs, err(out_tok), err(out_pair)))
ranked = P.flatten(-2).sort(-1, descending=True).values.cumsum(-1)
half = (ranked < 0.5).sum(-1).float().median(0).values                      # (H,) pairs holding half the mass
print(f"T = {T_} tokens, {T_ * T_} pairs; pairs holding half the attention, median per head: "
      f"{[int(h) for h in half]}")
print("relative error of the output at equal bytes (4 k d numbers), per head:")
for k_tok, n_pairs, e_tok, e_pair in rows:
    print(f"  keep {k_tok:>2} tokens ({k_tok * k_tok:>3} pairs): {[round(e, 2) for e in e_tok.tolist()]}   "
          f"keep {n_pairs:>2} pairs: {[round(e, 2) for e in e_pair.tolist()]}")

# %% [markdown]
# Dropping tokens wins at equal bytes in every head once k >= 4: k kept tokens keep k^2 pairs for the bytes of
# 2k pair rows, and this model's attention is spread (half of a head's mass takes 41-147 pairs in three of
# the four heads). Pairs win only at the smallest budget (k = 2), in two heads: the concentrated one (half
# its mass in 2 pairs; error 0.68 vs 1.14) and the second head (1.77 vs 2.36). Errors above 1 are no bug:
# the exact outputs of the spread heads average many value products and are small, so a few kept pairs
# miss them by more than their own size. The two-matrix cache's finer granularity does not pay for its bytes here; it
# would for attention that puts
# its mass on a handful of pairs. (Both choices are oracles that know the attention; a real policy must
# estimate it, as H2O or SnapKV do for tokens.)

# %% [markdown]
# ## 8. And on the real model?
#
# The other method notebooks end with a section on SmolLM2-135M, a pretrained model. This one cannot:
# tensor attention is a different attention *module*, not a policy over a standard cache, and SmolLM2 was trained with
# standard softmax attention. Swapping its attention for a tensor one
# would need a model trained that way (as the Match3 models of section 4 were), and no pretrained tensor-
# attention model exists that runs here. So the claims of this notebook are measured on the models it
# trains and bundles, and the README's SmolLM2 table marks them "does not apply".

# %% [markdown]
# ## Exercises
#
# ### Exercise 1: the naive step by hand
#
# Section 1 built the pair probabilities; now the naive four-matrix path of Theorem 4.3, without
# `kron_rows`: build the n^2 pair rows `Kt` and `Vt` of the toy of section 1 (row `a * n + b` holds
# `K1[a] * K2[b]`, likewise for V), then one ordinary attention of `q` over those rows (scores scaled by
# `scale`, a softmax, a weighted sum). Call the output `by_hand`, a vector of `d` numbers; the check
# compares it with `factored` from section 1.

# %%
# needs: pair_scores, pair_softmax, factored_output
# BEGIN SOLUTION [tensor_attention] broadcast K1[:, None] * K2[None] to (n, n, d), flatten, softmax(scale Kt q) @ Vt
Kt = (K1[0, 0][:, None, :] * K2[0, 0][None, :, :]).reshape(n * n, d)      # (n^2, d): row a n + b = K1[a] * K2[b]
Vt = (V1[0, 0][:, None, :] * V2[0, 0][None, :, :]).reshape(n * n, d)
by_hand = (scale * Kt @ q[0, 0, 0]).softmax(0) @ Vt                          # ordinary attention over the pair rows
# END SOLUTION
assert by_hand.shape == (d,), f"by_hand should be one output vector of d = {d} numbers, got {tuple(by_hand.shape)}"
assert torch.allclose(by_hand, factored[0, 0, 0]), \
    "by_hand differs from four_cache_attention: one softmax over all n^2 pair rows, scores scaled by 1/sqrt(d)?"
print(f"{n * n} pair rows of {d} numbers each; |by_hand - factored| = {(by_hand - factored[0, 0, 0]).abs().max():.1e}")

# %% [markdown]
# ### Exercise 2: the bytes of the two caches
#
# Section 3's table gives the stored bytes of one layer (4 heads x 16 dims, fp32) for each length `i`.
# Write them as formulas: the four-matrix cache stores `K1, K2, V1, V2` (`4 i d` numbers per head), the
# two-matrix cache stores the `i^2` pair rows of `K~` and `V~` and, to make the next token's pairs, the
# four factor matrices as well. Fill `four_bytes` and `two_bytes` (lists, one entry per length of
# `timing["lengths"]`).

# %%
# needs: pair_scores, pair_softmax, factored_output, two_cache_append
# BEGIN SOLUTION [tensor_attention] per head: 4 i d factor numbers, plus 2 i^2 d pair-row numbers for two; 4 bytes each
HEADS, DIM, FP32 = 4, 16, 4
four_bytes = [HEADS * 4 * i * DIM * FP32 for i in timing["lengths"]]
two_bytes = [HEADS * (2 * i * i + 4 * i) * DIM * FP32 for i in timing["lengths"]]
# END SOLUTION
assert four_bytes == list(timing["four"]["bytes"]), \
    f"four-matrix bytes {four_bytes} differ from the measured {list(timing['four']['bytes'])}: 4 matrices of i x d"
assert two_bytes == list(timing["two"]["bytes"]), \
    f"two-matrix bytes {two_bytes} differ from the measured {list(timing['two']['bytes'])}: pair rows and factors"
print("the formulas give every measured byte count")

# %% [markdown]
# ### Exercise 3: is the naive path memory-bound?
#
# Time a decode step with the naive path at i = 1024 and count its bytes moved: it builds two n^2 d
# matrices per step. Is it memory-bound? Compare with the two-matrix path, which *reads* as many bytes.
#
# ### Exercise 4: a pair-level heavy-hitter policy
#
# Token eviction on a four-matrix cache removes whole rows *and columns* of the score matrix S; the
# two-matrix cache can drop single pairs. Write a pair-level "heavy hitter" policy for `TwoCache` (keep the
# pairs with the largest accumulated attention) and compare its error with token eviction at the same
# number of stored bytes (section 7 did it with an oracle).
#
# ### Exercise 5: a longer training budget
#
# Train `python -m methods.tensor_attention.match3 train --attention standard --steps 10000 --out runs/m3-long`:
# does a longer budget let standard attention catch up at this size? What about `n_layer=4`?
#
# ### Exercise 6: a larger modulus
#
# Change the modulus `M` in `methods/tensor_attention/match3.py` to 64: which model degrades first?
