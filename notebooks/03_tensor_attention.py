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
# * **four matrices** `K1, K2, V1, V2` ($4nd$ numbers), the pairs formed when needed;
# * **two matrices** `K~ = K1 (/) K2`, `V~ = V1 (/) V2` holding every pair row ($2n^2d$ numbers).
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
# 4. a task where pairs matter (Match3): a trained tensor model vs a standard one of the same size.
#
# Its lab takes the paper's other claims further: the memory lower bound run as an experiment, an
# approximate cache (SubGen), and dropping tokens against dropping pairs.
#
# Code: `methods/tensor_attention/attention.py` (the module and the caches), `methods/tensor_attention/bench.py`
# (the measurement), `methods/tensor_attention/match3.py` (task, training, checkpoints). Section 1 writes the
# pair scores and their softmax by hand; the rest imports the library.

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

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
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

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
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

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
timing = measure(LENGTHS)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
for k, style in (("four", "o-"), ("two", "s-")):
    ax1.loglog(timing["lengths"], [b / 2**20 for b in timing[k]["bytes"]], style,
               label=f"{k}-matrix (slope {timing[k]['bytes_slope']:.2f})")
ax1.set(xlabel="tokens i", ylabel="stored MiB (one layer)", title="memory: 4 i d  vs  2 i^2 d + 4 i d")
for k, style in (("four-naive", "^-"), ("four", "o-"), ("two", "s-")):
    ax2.loglog(timing["lengths"], timing[k]["ms"], style, label=f"{k} (slope {timing[k]['time_slope']:.2f})")
    ax2.fill_between(timing["lengths"], *zip(*timing[k]["iqr_ms"]), alpha=0.2)      # quartiles of the steps
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
#   scoring every pair. A slope above 2 means a pair costs more at the longest lengths than at the short
#   ones: there the step's matrices outgrow the CPU's caches and their numbers come from main memory. The
#   bands are the quartiles of the 7 timed steps; where a band is wide, that length's median moved with
#   the machine's load.
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
# `a <= b <= i`. Two bundled models, trained with the same budget (3000 steps, the curves printed below) by
# `python -m methods.tensor_attention.match3 train --attention tensor|standard`: a tensor-attention decoder and a
# standard one with the same number of parameters (its MLP is wider by the two extra projections' worth). Same
# parameters and steps, not the same compute: a tensor layer costs O(T^3) per sequence, a standard one O(T^2). One
# seed each, and a learning rate tuned for neither. Sanford et al.'s lower bound is for a single standard layer;
# this baseline has two layers and MLPs, so the comparison tests more than the theorem.

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
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

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
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

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
xs = torch.tensor([match3.random_numbers(match3.N_NUMBERS, __import__("random").Random(s)) for s in range(64)])
decoded = {layout: match3.greedy_labels(tensor_model, xs, layout) for layout in LAYOUTS}
print("identical labels for every layout:", all(torch.equal(v, decoded["four"]) for v in decoded.values()))
example = xs[0].tolist()
print("numbers:", example)
print("truth:  ", ["Y" if t == match3.YES else "n" for t in match3.labels(example)])
print("decoded:", ["Y" if t == match3.YES else "n" for t in decoded["two"][0].tolist()])

# %% [markdown]
# ## 5. And on the real model?
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

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
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

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
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
# number of stored bytes (the lab's section 3 does it with an oracle).
#
# ### Exercise 5: a longer training budget
#
# Train `python -m methods.tensor_attention.match3 train --attention standard --steps 10000 --out runs/m3-long`:
# does a longer budget let standard attention catch up at this size? What about `n_layer=4`?
#
# ### Exercise 6: a larger modulus
#
# Change the modulus `M` in `methods/tensor_attention/match3.py` to 64: which model degrades first?

# %% [markdown]
# **Go further**: [labs/03_tensor_attention_bounds.ipynb](labs/03_tensor_attention_bounds.ipynb) runs the
# memory lower bound of Theorem 4.1 as an Index-problem experiment, measures SubGen's error against its
# memory, and compares dropping tokens with dropping pairs on the Match3 model at equal bytes.

# %%
from methods.evaluation.viz import print_run_time  # the whole notebook, from its first cell

print_run_time()
