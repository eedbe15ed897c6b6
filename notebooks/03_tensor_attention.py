# %% [markdown]
# # 03 Tensor attention: a four-matrix or a two-matrix KV cache
#
# Chen, Li, Liang, Shi et al., "Time and Memory Trade-off of KV-Cache Compression in Tensor Transformer
# Decoding", 2025, [arXiv 2503.11108](https://arxiv.org/abs/2503.11108). Tensor attention itself comes from
# Sanford, Hsu & Telgarsky (NeurIPS 2023, [arXiv 2306.02896](https://arxiv.org/abs/2306.02896)) and Alman &
# Song (ICLR 2024, [arXiv 2310.04064](https://arxiv.org/abs/2310.04064)).
#
# **Before this lesson**: lesson 00 (the KV cache, `prefill`/`extend`/`decode_step`, ordinary attention).
# Metrics, where the lab prints them: the [metrics glossary](README.md#metrics).
#
# An ordinary attention query scores single tokens. A **tensor attention** query scores *pairs* of tokens:
# every token carries two keys and two values, and one softmax runs over all pairs of cached tokens. With
# $T$ cached tokens of $d$ numbers per head, the cache can be kept in two ways:
#
# * **four matrices**: every token's two keys and two values, $4Td$ numbers; the pairs are formed when needed;
# * **two matrices**: one key row and one value row for every *pair* of tokens, about $2T^2d$ numbers (plus
#   the four matrices, to form the next token's pairs).
#
# Chen et al. prove lower bounds on the memory any such cache needs (Theorems 4.1 and 4.2; the lab runs them),
# and that the two-matrix cache saves $\Omega(T^2d)$ time a decode step (Theorem 4.3) against a four-matrix
# cache that forms every pair row at every step; section 3 shows a four-matrix cache need not. This lesson asks:
# **what does each layout cost on a
# real machine, and does attending to pairs pay off on a task that needs them?**
#
# **You will learn**: tensor attention by hand, checked against the library; a decoder whose three cache
# layouts give the same outputs; the time and memory of each layout, measured; and Match3, a task where pairs
# matter. The library: `methods/tensor_attention/` (`attention.py`, `bench.py`, `match3.py`).

# %% tags=["setup"]
from preamble import TINY  # the repository importable before any other import

# %% [markdown]
# ## 1. One decode step, built by hand
#
# The symbols of this lesson, besides the book's shared ones ([notebooks/README.md](README.md)):
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $T$ | tokens in the cache (the paper's $n$) | `n` |
# | $t$ | the current step: the position of the query's token | `t` |
# | $d$ | numbers per head | `d` |
# | $q_t$ | the query of step $t$, $d$ numbers | `q` |
# | $K_1$, $K_2$ | a head's two keys per token, $T \times d$ each; $K_1[a]$ is token $a$'s first key | `K1`, `K2` |
# | $V_1$, $V_2$ | a head's two values per token, $T \times d$ each | `V1`, `V2` |
# | $a$, $b$ | here: a pair's two token positions, $0 \le a, b < T$ (not $a_{t,n}$ or bytes) | `a`, `b` |
# | $\odot$ | elementwise product (a vector and a matrix: the vector times each row) | `*` |
# | $\oslash$ | column-wise Kronecker product: $A \oslash B$ has a row $A[a] \odot B[b]$ per pair | `kron_rows` |
# | $Z_{ab}$ | the score of the pair $(a, b)$; $Z$ is $T \times T$ | `S`, `pair_scores` |
# | $P_{ab}$ | the pair's attention weight: one softmax over all $T^2$ pairs | `P` |
# | $o_t$ | the head's output at step $t$, $d$ numbers | `factored`, `naive`, `two` |
# | $\tilde K$ | the pair keys $K_1 \oslash K_2$, $T^2 \times d$: row $(a, b)$ is $K_1[a] \odot K_2[b]$ | `pair_keys` |
# | $\tilde V$ | the pair values $V_1 \oslash V_2$, likewise: row $(a, b)$ is $V_1[a] \odot V_2[b]$ | `pair_values` |
#
# Tensor attention for one query (Chen et al., Definition 3.6; the $1/\sqrt d$ is ours):
#
# $$Z_{ab} = \frac{\big\langle q_t,\; K_1[a] \odot K_2[b] \big\rangle}{\sqrt d}, \qquad
#   P = \operatorname{softmax}_{(a, b)}(Z), \qquad
#   o_t = \sum_{a=0}^{T-1} \sum_{b=0}^{T-1} P_{ab}\; V_1[a] \odot V_2[b].$$
#
# One softmax runs over all $T^2$ pairs, not one per row. A random toy of one head, 50 tokens of 16 numbers,
# in float64 so that two ways of computing agree to rounding:

# %%
import math

import torch

g = torch.Generator().manual_seed(0)
n, d = 50, 16
K1, K2, V1, V2 = (torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) for _ in range(4))   # (1, 1, n, d)
q = torch.randn(1, 1, 1, d, generator=g, dtype=torch.float64)                                   # one query
scale = 1 / math.sqrt(d)

# %% [markdown]
# The scores and their softmax with two loops, against the library's `pair_scores` and `pair_softmax`:

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
# The probabilities sum to 1 over all pairs together, not row by row: no row of $P$ is a distribution of its own.
# The library computes $o_t$ in three ways, none with loops:
#
# * **naive four-matrix**: build $\tilde K = K_1 \oslash K_2$ and $\tilde V = V_1 \oslash V_2$ from the four
#   matrices, then ordinary attention over the pair rows: what Theorem 4.3 charges the four-matrix cache.
# * **factored four-matrix**: a pair's score is $\sum_j q_j K_1[a]_j K_2[b]_j / \sqrt d$ ($j$ runs over the $d$
#   coordinates), so scores and output factor into matrix products and nothing of size $T^2 d$ is formed:
#
#   $$Z = \frac{(K_1 \odot q_t)\, K_2^\top}{\sqrt d}, \qquad o_t = \sum_{a=0}^{T-1} \big(V_1 \odot (P\,V_2)\big)[a].$$
#
# * **two-matrix**: $\tilde K$ and $\tilde V$ are stored; ordinary attention over them.
#
# The three agree. With second keys and values of ones ($K_2 = V_2 = 1$), tensor attention is ordinary
# attention over $K_1$, $V_1$: lesson 00's `attend(q, k, v, q_pos, k_pos)`, where a query at position `q_pos`
# sees the keys whose positions `k_pos` are at or before it (here the query sits at $n - 1$ and sees all $n$).
# `attend` also returns two optional statistics of the weights, which we drop:

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
from methods.tensor_attention import four_cache_attention, kron_rows, naive_four_cache_attention, two_cache_attention
from nanollm.attention import attend

naive = naive_four_cache_attention(q, K1, K2, V1, V2, scale)
factored = four_cache_attention(q, K1, K2, V1, V2, scale)
two = two_cache_attention(q, kron_rows(K1, K2), kron_rows(V1, V2), scale)
print(f"fp64, n = {n}: |naive - factored| = {(naive - factored).abs().max():.1e}, "
      f"|two - factored| = {(two - factored).abs().max():.1e}")

ones = torch.ones_like(K2)
query_position, key_positions = torch.tensor([n - 1]), torch.arange(n).expand(1, 1, n)   # (1,) and (1, 1, n)
standard, _, _ = attend(q, K1, V1, query_position, key_positions)     # output (1, 1, 1, d); two Nones dropped
print(f"k2 = v2 = 1: |tensor attention - nanollm's standard attention| = "
      f"{(four_cache_attention(q, K1, ones, V1, ones, scale) - standard).abs().max():.1e}")

# %% [markdown]
# With $K_2[b] = 1$ every pair $(a, b)$ scores $\langle q_t, K_1[a]\rangle/\sqrt d$: the softmax over pairs is
# the ordinary one over $a$, spread evenly over $b$. So the module's second key and value are
# `1 + projection(x)`, with the projections initialised near zero: a fresh layer starts as approximately
# ordinary attention, and learns to use pairs.

# %% [markdown]
# ## 2. A tensor-attention decoder
#
# The module plugs into lesson 00's nanollm decoder through `ModelConfig.attention`; norms, MLP, embeddings
# and generation are unchanged. Rotary embeddings (RoPE) make a score depend only on the distance of query and
# key; the elementwise product with a second key breaks that, so the tensor model uses learned absolute
# positions (the GPT-2 flavour). A toy decoder with random weights,
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
# The layout is chosen per cache: `tensor_cache(config, layout)`, with `layout` one of `LAYOUTS`: `"four"`
# (factored), `"four-naive"` or `"two"`. Each runs lesson 00's cached path (`prefill` the first 20 tokens,
# `extend` by 10, then 10 single `decode_step`s), compared with the uncached forward pass:

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
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

# %% [markdown]
# All three layouts give the uncached outputs. At 40 tokens the two-matrix cache stores 1680 KiB against 80:
# $T/2$ times as much for the pair rows, plus the four factor matrices it also keeps.
#
# ## 3. The trade-off, measured
#
# `measure` (from `bench.py`) fills one layer (4 heads of 16 numbers, fp32) with $T$ random tokens, runs 7
# decode steps on each path (append the new token's rows, attend with its query), and records the bytes stored
# and the median time of a step. On log-log axes growth like $T^2$ is a line of slope 2; the legend gives each
# path's slope, fitted over the longer half of the lengths.

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
import matplotlib.pyplot as plt

from methods.tensor_attention.bench import decades, measure, table

lengths = [16, 32, 64, 128] if TINY else [32, 64, 128, 256, 512, 1024]
timing = measure(lengths)             # per path: bytes stored and ms per step, at each length
fig, ax = plt.subplots(figsize=(7, 4.2))
for k, colour in (("four-naive", "tab:red"), ("four", "tab:blue"), ("two", "tab:orange")):
    ax.loglog(lengths, timing[k]["ms"], "o-", color=colour, label=f"{k} (slope {timing[k]['time_slope']:.2f})")
ax.set(xlabel="tokens T", ylabel="ms per decode step", title="time per decode step, one layer", ylim=decades(timing))
ax.set_xticks(lengths, [str(i) for i in lengths])
ax.minorticks_off()
ax.legend(fontsize=9)
plt.show()

# %% [markdown]
# The figure shows the time of one decode step against the number of cached tokens $T$: red the four-matrix
# cache with the pair rows rebuilt at every step (naive), blue the same cache attended the factored way, orange
# the two-matrix cache. The table gives the numbers, and the bytes each cache stores:

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
print(table(timing))
ratio = timing["two"]["bytes"][-1] / timing["four"]["bytes"][-1]
print(f"at T = {lengths[-1]}: the two-matrix cache stores {ratio:.0f}x the bytes of the four-matrix cache")

# %% [markdown]
# Timings move from run to run (a shared CPU, where one slow length moves a fitted slope a lot), so read the
# table's rows and orders of magnitude more than the slopes:
#
# * **Memory**: slope 1.00 for the four-matrix cache, 1.98 for the two-matrix one (which also keeps the four
#   factor matrices, to form the next token's pairs); 513x larger at 1024 tokens.
# * **Time**: every path is far slower at the longest length than at the shortest: whatever the layout, a step
#   scores all $T^2$ pairs.
# * **Theorem 4.3's saving shows against the naive path only, and only from 128 tokens on**: below that,
#   naive/two is at most about 1 (the naive path can be the faster); from there, rebuilding $\tilde K$ and $\tilde V$ at
#   every step is several times slower than the
#   two-matrix cache, and the gap grows with $T$ (the table's "additive gap").
# * **The factored path beats the two-matrix path**: four/two is below 1, so its gap is negative, at every
#   length. Both do about $2T^2d$ multiply-adds a head, but the two-matrix path reads $2T^2d$ stored numbers a
#   step, the factored path $4Td$. On this CPU the four-matrix cache wins on memory and on time.
#
# This lesson does not explain the naive path's jump from 64 to 128 tokens, far more than the 4x that $T^2$
# predicts for twice the tokens.

# %% [markdown]
# ## 4. Where pairs matter: Match3
#
# Sanford et al. (§4) prove that Match3, "do two numbers of the sequence complete this one to 0 modulo M?",
# needs a large standard attention layer, while one tensor head computes it. `match3.py` makes it causal: a
# sequence `BOS x_1 L_1 x_2 L_2 ...` of 12 numbers $x_i$ modulo 32, where the label `L_i` is YES if
# $x_a + x_b + x_i = 0 \pmod{32}$ for some $a \le b \le i$, else NO: the "two numbers" may be one taken twice
# or $x_i$ itself (even $a = b = i$, $3x_i = 0$). A model reads $x_i$ and predicts `L_i`.
#
# Two bundled models were trained for the same number of steps, one seed each: a tensor-attention decoder and
# a standard one with nearly as many parameters (a wider MLP), though not the same compute (a tensor layer
# costs $O(T^3)$ a sequence). The *majority baseline* guesses, at each position, the label more frequent there.
# Accuracy is teacher-forced (the model sees the true earlier labels) or greedy (it reads its own labels,
# through the cache); the two models' difference is paired over the same sequences, with its interval:

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
from methods.evaluation.intervals import describe, paired_difference
from methods.tensor_attention import match3

n_eval = 200 if TINY else 2000                    # fresh sequences to evaluate on
tensor_model, tensor_card = match3.load("match3-tensor")
standard_model, standard_card = match3.load("match3-standard")
ids, _ = match3.batch(n_eval, match3.N_NUMBERS, seed=10**6)       # (sequences, 25): BOS x_1 L_1 x_2 L_2 ...
print(f"Match3 modulo {match3.M}, {match3.N_NUMBERS} numbers a sequence, {n_eval} fresh sequences; "
      f"majority baseline {match3.majority_baseline():.3f}")
right = {}                                        # (sequences, numbers): label right or wrong
for name, m, card in (("tensor", tensor_model, tensor_card), ("standard", standard_model, standard_card)):
    with torch.no_grad():     # the output at x_i (positions 1, 3, ...) predicts L_i (the next token: 2, 4, ...)
        right[name] = (m(ids).argmax(-1)[:, 1::2] == ids[:, 2::2]).float()
    greedy = match3.evaluate(m, n_seq=n_eval)["greedy_accuracy"]
    print(f"{name:>8} attention, {m.num_params():,} parameters, {card['steps']} training steps: label accuracy "
          f"{right[name].mean():.3f} (teacher-forced), {greedy:.3f} (greedy)")
gap, lo, hi = paired_difference([right["tensor"].mean(1).tolist()], [right["standard"].mean(1).tolist()])
print(f"tensor - standard label accuracy, paired over the same {n_eval} sequences: {describe(gap, lo, hi, 3)}")

# %% [markdown]
# Tensor attention gets 0.944 of the labels right, standard attention 0.874, the majority baseline 0.766, and
# the paired interval lies above 0. Both are single runs with one seed: the interval covers the evaluation
# sequences, not another training run. (The lab draws the accuracy by position, with intervals.)
#
# ## 5. And on the real model?
#
# The other method lessons end on SmolLM2-135M, a pretrained model. This one cannot: tensor attention is a
# different attention *module*, not a policy over a standard cache, and no pretrained tensor-attention model
# runs here. An eviction rule (lessons 01 and 02) still applies to the four-matrix cache, a token being one row
# of each matrix; in the two-matrix cache, dropping a token drops every pair row that holds it (the lab
# compares dropping tokens with dropping pairs).
#
# ## Exercises
#
# Each exercise has a cell where you write (replace the `None`), a check cell (it says "not answered yet",
# gives a hint when the answer is wrong, and "right"), and the reference answer, collapsed.
#
# ### Exercise 1: the naive step by hand
#
# Section 1 checked the library's naive four-matrix path; now write it yourself, without `kron_rows`, on the
# toy of section 1 (`q`, `K1`, `K2`, `V1`, `V2`, `scale`, `n`, `d`; the toy's tensors are `(1, 1, n, d)`, so
# take `[0, 0]`): the $T^2$ pair rows $\tilde K$ and $\tilde V$, then one ordinary attention of `q` over them
# (scores scaled by `scale`, one softmax, a weighted sum of the pair values).

# %%
my_pair_keys = None       # replace None: (n * n, d), row a * n + b holds K1[a] * K2[b]
my_pair_values = None     # replace None: (n * n, d), row a * n + b holds V1[a] * V2[b]
my_output = None          # replace None: (d,), ordinary attention of q over the pair rows

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
from exercises import exercise


@exercise("Exercise 1")
def check_naive_step(pair_keys, pair_values, output):
    for rows in (pair_keys, pair_values):
        assert tuple(rows.shape) == (n * n, d), "the pair rows: n * n rows of d numbers each"
    assert torch.allclose(pair_keys[1], K1[0, 0, 0] * K2[0, 0, 1]), "row a * n + b holds K1[a] * K2[b]"
    assert torch.allclose(pair_keys, kron_rows(K1, K2)[0, 0]), "every row a * n + b holds K1[a] * K2[b]"
    assert torch.allclose(pair_values, kron_rows(V1, V2)[0, 0]), "every row a * n + b holds V1[a] * V2[b]"
    assert tuple(output.shape) == (d,), "the output is one vector of d numbers"
    assert torch.allclose(output, four_cache_attention(q, K1, K2, V1, V2, scale)[0, 0, 0]), \
        "one softmax over all n * n scores, each scaled by `scale`, then the weighted sum of the pair values"


check_naive_step(my_pair_keys, my_pair_values, my_output)

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
# BEGIN SOLUTION [tensor_attention] broadcast K1[:, None] * K2[None] to (n, n, d), flatten, softmax(scale K~ q) @ V~
reference_pair_keys = (K1[0, 0][:, None, :] * K2[0, 0][None, :, :]).reshape(n * n, d)   # row a n + b = K1[a] * K2[b]
reference_pair_values = (V1[0, 0][:, None, :] * V2[0, 0][None, :, :]).reshape(n * n, d)
reference_output = (scale * reference_pair_keys @ q[0, 0, 0]).softmax(0) @ reference_pair_values
# END SOLUTION
check_naive_step(reference_pair_keys, reference_pair_values, reference_output)

# %% [markdown]
# ### Exercise 2: is a path limited by memory?
#
# At every step the naive path writes $\tilde K$ and $\tilde V$, $2T^2d$ numbers a head, then reads them once;
# the two-matrix path reads its stored pair rows, as many numbers. At the longest length of section 3
# (`timing["lengths"][-1]`), for its layer, compute the rate at which each path moves those bytes, in GB/s
# ($10^9$ bytes a second): the bytes of one step over the median time of a step, `timing[path]["ms"][-1]`
# (milliseconds). Then, in a sentence: one CPU core typically streams some 10 to 20 GB/s from memory; which
# path is limited by memory?

# %%
HEADS, DIM, FP32 = 4, 16, 4     # section 3's layer: 4 heads of d = 16 numbers, 4 bytes a number
my_naive_gbps = None            # replace None: GB/s the naive path writes and reads at the longest length
my_two_gbps = None              # replace None: GB/s the two-matrix path reads at the longest length

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
@exercise("Exercise 2")
def check_rates(naive_gbps, two_gbps):
    longest = timing["lengths"][-1]
    pair_bytes = 4 * 2 * longest * longest * 16 * 4              # K~ and V~ of the 4 heads, 4 bytes a number
    naive = 2 * pair_bytes / (timing["four-naive"]["ms"][-1] / 1e3) / 1e9
    two = pair_bytes / (timing["two"]["ms"][-1] / 1e3) / 1e9
    assert abs(naive_gbps / naive - 0.5) > 0.03, "the naive path writes K~ and V~, then reads them: count both"
    assert abs(naive_gbps / naive - 1) < 0.03, \
        "naive: the bytes written and read at one step, over its time in seconds (ms / 1000), over 1e9"
    assert abs(two_gbps / two - 1) < 0.03, \
        "two-matrix: the pair-row bytes read at one step, over its time in seconds (ms / 1000), over 1e9"


check_rates(my_naive_gbps, my_two_gbps)

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
# BEGIN SOLUTION [tensor_attention] bytes = heads * 2 T^2 d * 4 (twice for naive: written, then read) / seconds / 1e9
pair_row_bytes = HEADS * 2 * timing["lengths"][-1] ** 2 * DIM * FP32
reference_naive_gbps = 2 * pair_row_bytes / (timing["four-naive"]["ms"][-1] / 1e3) / 1e9
reference_two_gbps = pair_row_bytes / (timing["two"]["ms"][-1] / 1e3) / 1e9
# END SOLUTION
check_rates(reference_naive_gbps, reference_two_gbps)
print(f"naive {reference_naive_gbps:.1f} GB/s, two-matrix {reference_two_gbps:.1f} GB/s. The two-matrix path "
      "streams its pair rows at about what one core can read from memory: memory bounds it. The naive path moves "
      "its bytes several times slower: building the pair rows (allocating and multiplying), not moving them, "
      "is what costs (measured on one machine: yours may differ).")

# %% [markdown]
# **Go further**: [labs/03_tensor_attention_bounds.ipynb](labs/03_tensor_attention_bounds.ipynb) runs the
# memory lower bound of Theorem 4.1 as an Index-problem experiment, measures SubGen's error against its
# memory, compares dropping tokens with dropping pairs on the Match3 model at equal bytes, draws Match3's
# accuracy by position with its intervals, and reads the two models' training curves.
