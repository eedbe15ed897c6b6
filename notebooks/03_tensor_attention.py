# %% [markdown]
# # 03 Tensor attention: a four-matrix or a two-matrix KV cache
#
# Chen, Li, Liang, Shi et al., "Time and Memory Trade-off of KV-Cache Compression in Tensor Transformer
# Decoding", 2025, [arXiv 2503.11108](https://arxiv.org/abs/2503.11108). Tensor attention itself comes from
# Sanford, Hsu & Telgarsky (NeurIPS 2023, [arXiv 2306.02896](https://arxiv.org/abs/2306.02896)) and Alman &
# Song (ICLR 2024, [arXiv 2310.04064](https://arxiv.org/abs/2310.04064)).
#
# An ordinary attention query scores single tokens. A **tensor attention** query scores *pairs* of tokens:
# every token carries two keys and two values, and one softmax runs over all pairs of cached tokens. With
# $T$ cached tokens of $d$ numbers per head, the cache can be kept in two ways:
#
# * **four matrices**: every token's two keys and two values, $4Td$ numbers; the pairs are formed when needed;
# * **two matrices**: one key row and one value row for every *pair* of tokens, about $2T^2d$ numbers.
#
# Chen et al. prove that neither layout compresses much (Theorems 4.1 and 4.2: $\Omega(Td)$ bits given four
# matrices, $\Omega(T^2d)$ given two, the second for arbitrary pair rows rather than rows built from $T$
# tokens' keys and values) and that the two-matrix cache is faster, by $\Omega(T^2d)$ time a decode step
# (Theorem 4.3). This lesson asks: **what does each layout cost on a real machine, and does attending to
# pairs pay off on a task that needs them?**
#
# **You will learn**
#
# 1. tensor attention written by hand, checked against the library, and three ways of computing one decode
#    step that give the same output;
# 2. a decoder built on it, whose three cache layouts produce the same tokens;
# 3. the trade-off measured: memory grows like $T$ against $T^2$, but the time of a step grows far faster than
#    $T$ on every path;
# 4. a task where pairs matter (Match3): a trained tensor model against a standard one of the same size.
#
# The library: `methods/tensor_attention/attention.py` (the module and the caches), `bench.py` (the
# measurement) and `match3.py` (the task and its two models) in the same folder.

# %% tags=["setup"]
from preamble import TINY  # the repository importable before any other import

# %% [markdown]
# ## 1. One decode step, built by hand
#
# The symbols of this lesson: the course's shared ones (`notebooks/README.md`) and its own.
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $T$ | tokens in the cache (the paper's $n$) | `n` |
# | $t$ | the current step: the position of the query's token | `t` |
# | $d$ | numbers per head | `d` |
# | $q_t$ | the query of step $t$, $d$ numbers | `q` |
# | $K_1$, $K_2$ | a head's two keys per token, $T \times d$ each; $K_1[a]$ is token $a$'s first key | `K1`, `K2` |
# | $V_1$, $V_2$ | a head's two values per token, $T \times d$ each | `V1`, `V2` |
# | $a$, $b$ | the positions of the two tokens of a pair, $0 \le a, b < T$ | `a`, `b` |
# | $\odot$ | elementwise product (a vector and a matrix: the vector times each row) | `*` |
# | $Z_{ab}$ | the score of the pair $(a, b)$; $Z$ is $T \times T$ | `S`, `pair_scores` |
# | $P_{ab}$ | the attention weight of the pair: one softmax over all $T^2$ pairs | `P`, `pair_softmax` |
# | $o_t$ | the head's output at step $t$, $d$ numbers | `factored`, `naive`, `two` |
# | $\tilde K$ | the pair keys, $T^2 \times d$: row $(a, b)$ is $K_1[a] \odot K_2[b]$ | `kron_rows`, `Kt` |
# | $\tilde V$ | the pair values, $T^2 \times d$: row $(a, b)$ is $V_1[a] \odot V_2[b]$ | `kron_rows`, `Vt` |
#
# Tensor attention for one query (Chen et al., Definition 3.6; the scaling by $1/\sqrt d$ is ours, as in
# ordinary attention):
#
# $$Z_{ab} = \frac{\big\langle q_t,\; K_1[a] \odot K_2[b] \big\rangle}{\sqrt d}, \qquad
#   P = \operatorname{softmax}_{(a, b)}(Z), \qquad
#   o_t = \sum_{a=0}^{T-1} \sum_{b=0}^{T-1} P_{ab}\; V_1[a] \odot V_2[b].$$
#
# The softmax runs over all $T^2$ pairs at once, not row by row. A random toy of one head, 50 tokens of 16
# numbers, in float64 so that two ways of computing agree to rounding:

# %%
import math

import torch

g = torch.Generator().manual_seed(0)
n, d = 50, 16
K1, K2, V1, V2 = (torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) for _ in range(4))   # (1, 1, n, d)
q = torch.randn(1, 1, 1, d, generator=g, dtype=torch.float64)                                   # one query
scale = 1 / math.sqrt(d)

# %% [markdown]
# The scores and their softmax, written with two loops, against the library's `pair_scores` (which never
# forms the $T^2 \times d$ products) and `pair_softmax`:

# %%
from methods.tensor_attention import pair_scores, pair_softmax


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
# The library computes $o_t$ in three ways, none with loops:
#
# * **naive four-matrix**: build $\tilde K = K_1 \oslash K_2$ and $\tilde V = V_1 \oslash V_2$ from the four
#   matrices ($T^2$ rows each; $\oslash$ is Definition 3.1's column-wise Kronecker product, the library's
#   `kron_rows`), then ordinary attention over the pair rows. This is what Theorem 4.3 charges the
#   four-matrix cache at every step.
# * **factored four-matrix**: a pair's score is $\sum_j q_j K_1[a]_j K_2[b]_j / \sqrt d$ ($j$ runs over the $d$
#   coordinates), so the whole score matrix and the output factor into two matrix products, and nothing of
#   size $T^2 d$ is ever formed:
#
#   $$Z = \frac{(K_1 \odot q_t)\, K_2^\top}{\sqrt d}, \qquad o_t = \sum_{a=0}^{T-1} \big(V_1 \odot (P\,V_2)\big)[a].$$
#
# * **two-matrix**: the pair rows $\tilde K$, $\tilde V$ are already stored; ordinary attention over them.
#
# The three agree, and with second keys and values of ones ($K_2 = V_2 = 1$) tensor attention is nanollm's
# ordinary attention (lesson 00's `attend`) over $K_1$, $V_1$:

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
from methods.tensor_attention import four_cache_attention, kron_rows, naive_four_cache_attention, two_cache_attention
from nanollm.attention import attend

naive = naive_four_cache_attention(q, K1, K2, V1, V2, scale)
factored = four_cache_attention(q, K1, K2, V1, V2, scale)
two = two_cache_attention(q, kron_rows(K1, K2), kron_rows(V1, V2), scale)
print(f"fp64, n = {n}: |naive - factored| = {(naive - factored).abs().max():.1e}, "
      f"|two - factored| = {(two - factored).abs().max():.1e}")

ones = torch.ones_like(K2)
standard, _, _ = attend(q, K1, V1, torch.tensor([n - 1]), torch.arange(n).expand(1, 1, n))   # query at n - 1
print(f"k2 = v2 = 1: |tensor attention - nanollm's standard attention| = "
      f"{(four_cache_attention(q, K1, ones, V1, ones, scale) - standard).abs().max():.1e}")

# %% [markdown]
# Why the ones reduce it: with $K_2[b] = 1$ every pair $(a, b)$ scores $\langle q_t, K_1[a]\rangle/\sqrt d$,
# so the softmax over the $T^2$ pairs is the ordinary softmax over $a$, spread evenly over $b$; with
# $V_2[b] = 1$ the output is that softmax's weighted sum of the rows of $V_1$. The module uses this: its
# second key and value are `1 + projection(x)`, so a freshly initialised layer (projections near zero)
# starts as ordinary attention and learns to use pairs.

# %% [markdown]
# ## 2. A tensor-attention decoder
#
# The module plugs into lesson 00's nanollm decoder through `ModelConfig.attention`; norms, MLP, embeddings
# and generation are the same code as for every other model of the course. Rotary embeddings (RoPE, lesson
# 00) rotate a query and a key by their positions so that a score depends only on their distance; with a
# pair of keys that no longer holds (the elementwise product with the second key breaks the rotation), so
# the tensor model uses learned absolute positions (the GPT-2 flavour). A toy decoder with random weights,
# larger than at initialisation so that pairs matter:

# %%
from methods.tensor_attention import LAYOUTS, TENSOR_ATTENTION, tensor_cache
from nanollm.config import preset
from nanollm.model import Transformer

config = preset("TINY_GPT2", attention=TENSOR_ATTENTION, max_seq_len=64)
torch.manual_seed(0)
model = Transformer(config).eval()
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.3)
x = torch.randint(0, config.vocab_size, (1, 40), generator=g)          # one sequence of 40 tokens

# %% [markdown]
# The cache layout is chosen per cache: `tensor_cache(config, layout)`, with `layout` a name from
# `LAYOUTS`: `"four"` (factored), `"four-naive"` or `"two"`. Each layout runs lesson 00's cached path
# (`prefill` the first 20 tokens, `extend` by 10, then 10 single `decode_step`s) and is compared with the
# uncached forward pass, which computes every query at once; then greedy generation through each layout:

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
from nanollm import generate
from nanollm.generation import decode_step, extend, prefill

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
# `measure` (from `methods/tensor_attention/bench.py`) fills one layer (4 heads of 16 numbers, fp32) with
# $T$ random tokens, then runs 7 decode steps on each path (append the new token's rows, attend with its
# query) and records the bytes stored and the median time of a step. Both are drawn on log-log axes, where
# growth like $T$ is a line of slope 1 and growth like $T^2$ a line of slope 2; the legends give the slopes,
# fitted over all lengths for memory and over the longer half for time.

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
import matplotlib.pyplot as plt

from methods.tensor_attention.bench import decades, measure, table

lengths = [16, 32, 64, 128] if TINY else [32, 64, 128, 256, 512, 1024]
timing = measure(lengths)             # per path: bytes stored, ms per step and its quartiles, at each length
colour = {"four-naive": "tab:red", "four": "tab:blue", "two": "tab:orange"}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6))
for k in ("four", "two"):
    ax1.loglog(lengths, [b / 2**20 for b in timing[k]["bytes"]], "o-", color=colour[k],
               label=f"{k}-matrix (slope {timing[k]['bytes_slope']:.2f})")
ax1.set(xlabel="tokens T", ylabel="stored MiB (one layer)", title="memory")
for k in ("four-naive", "four", "two"):
    ax2.loglog(lengths, timing[k]["ms"], "o-", color=colour[k], label=f"{k} (slope {timing[k]['time_slope']:.2f})")
    ax2.fill_between(lengths, *zip(*timing[k]["iqr_ms"]), color=colour[k], alpha=0.2)   # quartiles of the steps
ax2.set(xlabel="tokens T", ylabel="ms per decode step", title="time per decode step", ylim=decades(timing))
for ax in (ax1, ax2):
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_xticks(lengths, [str(i) for i in lengths])
    ax.minorticks_off()
fig.tight_layout()
plt.show()

# %% [markdown]
# The figure shows, for one layer, the bytes each cache stores (left) and the time of one decode step on
# each path (right), against the number of cached tokens $T$. Blue is the four-matrix cache attended the
# factored way, red the same cache with the pair rows rebuilt at every step (naive), orange the two-matrix
# cache; the shaded band around each time curve spans the quartiles of its 7 timed steps (where a band is
# wide, that length's time moved with the machine's load). The table gives the numbers:

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
print(table(timing))
last = -1
print(f"at T = {lengths[last]}: two-matrix cache "
      f"{timing['two']['bytes'][last] / timing['four']['bytes'][last]:.0f}x the bytes of the four-matrix cache; "
      f"naive four / two = {timing['four-naive']['ms'][last] / timing['two']['ms'][last]:.1f}x the time, "
      f"factored four / two = {timing['four']['ms'][last] / timing['two']['ms'][last]:.2f}x")

# %% [markdown]
# Timings move from run to run (a shared CPU; `python -m methods.tensor_attention.bench` gives another draw),
# so read the slopes and the orders of magnitude, not the second digit:
#
# * **Memory**: slope 1.00 for the four-matrix cache and 1.98 for the two-matrix one, which also keeps the
#   four factor matrices (the next token's pairs need them) and so bends just below 2. At 1024 tokens the
#   two-matrix cache is 513x larger.
# * **Time**: every path's fitted slope is well above 1. No layout escapes the $T^2 d$ arithmetic of scoring
#   every pair. A slope above 2 means that a step got dearer per pair at the longer lengths: its matrices
#   outgrew the CPU's caches, or the machine got busier while those lengths ran (the bands show where).
# * **Theorem 4.3 holds against the naive path only**: rebuilding $\tilde K$ and $\tilde V$ at every step is
#   several times slower than the two-matrix cache at the longest lengths, and the gap between the two
#   ("additive gap" in the table) grows about like $T^2$, the $\Omega(T^2d)$ of the theorem.
# * **The factored four-matrix path beats the two-matrix path** at every length (the last column is below 1).
#   Both do about $2T^2d$ multiply-adds a head, but the two-matrix path reads $2T^2d$ stored numbers from
#   memory at every step, while the factored path reads $4Td$ and works on a $T \times T$ score matrix. On
#   this CPU the trade-off "less memory, more time" does not exist: the four-matrix cache wins on both.

# %% [markdown]
# ## 4. Where pairs matter: Match3
#
# Sanford et al. (§4) prove that Match3, "does some pair of numbers complete this one to 0 modulo M?", needs
# a large standard attention layer, while one tensor head computes it. `match3.py` makes it causal and dense: a
# sequence `BOS x_1 L_1 x_2 L_2 ...` of 12 numbers $x_i$ between 0 and 31, where the label `L_i` is YES if
# $x_a + x_b + x_i = 0 \pmod{32}$ for some $a \le b \le i$, else NO. A model reads $x_i$ and predicts `L_i`.
#
# Two bundled models were trained with the same budget (3000 steps; the curves are printed below): a
# tensor-attention decoder and a standard one with the same number of parameters (its MLP is wider by the two
# extra projections' worth). Same parameters and steps, not the same compute: a tensor layer costs $O(T^3)$ a
# sequence, a standard one $O(T^2)$. One seed each, and a learning rate tuned for neither. Sanford et al.'s
# lower bound is for one standard layer; this baseline has two layers and MLPs, so the comparison tests more
# than the theorem. The *majority baseline* guesses, at each position, the label that is more frequent there.
# Accuracy is measured teacher-forced (the model sees the true earlier labels) and greedy (it reads its own
# earlier labels, decoding through the cache); "card" is the accuracy the checkpoint recorded when trained.

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
from methods.tensor_attention import match3

n_eval = 200 if TINY else 2000                    # fresh sequences to evaluate on
tensor_model, tensor_card = match3.load("match3-tensor")
standard_model, standard_card = match3.load("match3-standard")
baseline = match3.majority_baseline()
for name, m, card in (("tensor", tensor_model, tensor_card), ("standard", standard_model, standard_card)):
    r4 = match3.evaluate(m, n_seq=n_eval)
    print(f"{name:>8} attention, {m.num_params():,} parameters: label accuracy {r4['accuracy']:.3f} "
          f"(teacher-forced), {r4['greedy_accuracy']:.3f} (greedy, reading its own labels); "
          f"majority-per-position baseline {baseline:.3f}; card: {card['accuracy']:.3f}")
    print("  training curve (step: accuracy on 500 sequences): "
          + ", ".join(f"{h['step']}: {h['accuracy']:.3f}" for h in card["history"]))

# %% [markdown]
# Accuracy by position, with 95% intervals (Wilson's, for a proportion): early positions are easy (few
# pairs: mostly NO), late ones too (many pairs: mostly YES); the middle is where a model must find the pair.

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
from methods.evaluation.intervals import wilson

ids, targets = match3.batch(n_eval, match3.N_NUMBERS, seed=10**6)
truth = ids[:, 2::2]                                        # (sequences, numbers): the true labels
yes = (truth == match3.YES).float().mean(0)
majority = torch.maximum(yes, 1 - yes)                      # the majority guess's accuracy at each position
positions = torch.arange(1, match3.N_NUMBERS + 1)
right = {}                                                  # (sequences, numbers): label right or wrong
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(positions, majority, "k--", label="majority per position")
for shift, (name, m) in zip((-0.08, 0.08), (("tensor", tensor_model), ("standard", standard_model))):
    with torch.no_grad():
        right[name] = (m(ids).argmax(-1)[:, 1::2] == truth).float()
    acc = right[name].mean(0)
    lo, hi = (torch.tensor(v) for v in zip(*(wilson(a, len(ids)) for a in acc.tolist())))
    ax.errorbar(positions + shift, acc, yerr=[acc - lo, hi - acc], fmt="o-", capsize=2, label=f"{name} attention")
ax.set(xlabel="position i of the number", ylabel="label accuracy (95% interval)",
       title="Match3 (mod 32), by position", xticks=positions.tolist())
ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# The figure shows the teacher-forced label accuracy at each of the 12 positions: blue for the tensor model,
# orange for the standard one, each with its 95% interval as error bars, and the dashed black line for the
# majority guess. The same numbers follow, then the difference of the two models paired over the same
# sequences, with its 95% interval (`paired_difference`); `describe` calls it "higher" when the interval lies
# above 0, "lower" below, "within noise" when it covers 0:

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
from methods.evaluation.intervals import describe, paired_difference

for name in right:
    print(f"{name:>8} attention, accuracy by position 1-{match3.N_NUMBERS}: "
          + " ".join(f"{a:.2f}" for a in right[name].mean(0).tolist()))
print("majority per position:         " + " ".join(f"{a:.2f}" for a in majority.tolist()))
gap, lo, hi = paired_difference([right["tensor"].mean(1).tolist()], [right["standard"].mean(1).tolist()])
print(f"tensor - standard label accuracy, paired over the same {len(ids)} sequences: {describe(gap, lo, hi, 3)}")

# %% [markdown]
# Tensor attention is right more often than standard attention at every position from 3 on, and the gap
# is in the middle positions, where the majority guess is a coin flip (0.51 at position 6): there the
# tensor model is right at a rate of 0.92 and the standard one 0.81, at position 7 0.91 against 0.74. Over
# all labels of the 2000 fresh sequences, tensor attention scores 0.944, standard attention 0.874 and the
# majority baseline 0.766; the paired interval excludes 0. The standard model is far above the baseline too
# (two layers and MLPs can check a few pairs), but its training curve stays between 0.864 and 0.872 from
# step 1800 on, while the tensor model is still climbing at the end of the budget (0.907 at step 1800, 0.946
# at step 3000). Both are single runs with one seed: the interval covers the evaluation sequences, not
# another training run.
#
# Greedy decoding through each cache layout gives the same labels (the three paths compute the same
# numbers, up to float rounding that never flips an argmax here), right or wrong: in the example below all
# three say Y at position 7 (counting from 0), where the truth is n.

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
import random

xs = torch.tensor([match3.random_numbers(match3.N_NUMBERS, random.Random(s)) for s in range(64)])
decoded = {layout: match3.greedy_labels(tensor_model, xs, layout) for layout in LAYOUTS}
print("identical labels for every layout:", all(torch.equal(v, decoded["four"]) for v in decoded.values()))
example = xs[0].tolist()
print("numbers:", example)
print("truth:  ", ["Y" if t == match3.YES else "n" for t in match3.labels(example)])
print("decoded:", ["Y" if t == match3.YES else "n" for t in decoded["two"][0].tolist()])

# %% [markdown]
# ## 5. And on the real model?
#
# Beside the other lessons: 01 and 02 drop tokens from an ordinary cache (StreamingLLM, H2O, Scissorhands);
# this one keeps every token and asks what the layout costs, and Chen et al.'s bounds say neither layout
# shrinks much that way. An eviction rule still applies unchanged to the four-matrix cache (a token is one
# row of each matrix); in the two-matrix cache, dropping a token drops every pair row that holds it.
#
# The other method lessons end on SmolLM2-135M, a pretrained model. This one cannot: tensor attention is a
# different attention *module*, not a policy over a standard cache, and SmolLM2 was trained with standard
# attention. No pretrained tensor-attention model runs here, so this lesson's claims are measured on the
# models it trains and bundles.

# %% [markdown]
# ## Exercises
#
# Exercises 1 and 2 check themselves: each answer sits in a collapsed cell under its exercise, to open once
# you have tried. Exercises 3 and 4 are questions to experiment with.
#
# ### Exercise 1: the naive step by hand
#
# Section 1 checked the library's naive four-matrix path; now write it yourself, without `kron_rows`, on
# the toy of section 1 (`q`, `K1`, `K2`, `V1`, `V2`, `scale`, `n`, `d`; the toy's tensors are
# `(1, 1, n, d)`, so take `[0, 0]`). Replace the three `None` of the cell below: `Kt` and `Vt`, the $T^2$
# pair rows, then `by_hand`, one ordinary attention of `q` over them (scores scaled by `scale`, a softmax, a
# weighted sum). The answer cell compares `by_hand` with `factored` from section 1.

# %%
Kt = None             # (n * n, d): row a * n + b holds K1[a] * K2[b]
Vt = None             # (n * n, d): row a * n + b holds V1[a] * V2[b]
by_hand = None        # (d,): softmax of the n * n scaled scores of q against Kt, times Vt

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
# Section 3's table gives the bytes one layer stores at each length. Write them as formulas in the length `i`
# (the $T$ of the math): the four-matrix cache stores $K_1$, $K_2$, $V_1$, $V_2$ for each of the 4 heads; the
# two-matrix cache stores the pair rows of $\tilde K$ and $\tilde V$ and, to form the next token's pairs, the
# four factor matrices as well. Replace the two `None` below by lists, one entry for each `i` in
# `timing["lengths"]`.

# %%
HEADS, DIM, FP32 = 4, 16, 4     # section 3's layer: 4 heads of d = 16 numbers, 4 bytes a number
four_bytes = None               # [bytes of the four-matrix cache for i in timing["lengths"]]
two_bytes = None                # [bytes of the two-matrix cache for i in timing["lengths"]]

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
# At every step the naive path builds $\tilde K$ and $\tilde V$, two $T^2 \times d$ matrices, and then reads
# them. Count the bytes it writes and reads at $T$ = 1024 for the layer of section 3, divide by its time a
# step from the table, and compare that rate with what your machine's memory can move. Do the same for the
# two-matrix path, which reads as many stored bytes at every step: which of the two is limited by memory?
#
# ### Exercise 4: a longer training budget
#
# Train the standard model for longer,
# `python -m methods.tensor_attention.match3 train --attention standard --steps 10000 --out runs/m3-long`,
# then compare it with the tensor model:
# `python -m methods.tensor_attention.match3 eval runs/m3-long match3-tensor`. Does a longer budget let
# standard attention catch up at this size? Section 4's training curves are a first clue.

# %% [markdown]
# **Go further**: [labs/03_tensor_attention_bounds.ipynb](labs/03_tensor_attention_bounds.ipynb) runs the
# memory lower bound of Theorem 4.1 as an Index-problem experiment, measures SubGen's error against its
# memory, and compares dropping tokens with dropping pairs on the Match3 model at equal bytes (a pair-level
# eviction policy a two-matrix cache allows and a four-matrix one does not).
