# %% [markdown]
# # 03 Tensor attention: a four-matrix or a two-matrix KV cache
#
# Chen, Li, Liang, Shi et al., "Time and Memory Trade-off of KV-Cache Compression in Tensor Transformer
# Decoding", 2025, [arXiv 2503.11108](https://arxiv.org/abs/2503.11108); tensor attention itself comes from
# Sanford, Hsu & Telgarsky (NeurIPS 2023, [arXiv 2306.02896](https://arxiv.org/abs/2306.02896)).
#
# **Before this lesson**: lesson 00 (the KV cache, ordinary attention).
#
# An ordinary attention query scores single tokens. A **tensor attention** query scores *pairs* of tokens:
# every token carries two keys and two values, and one softmax runs over all pairs of cached tokens. With
# $T$ cached tokens of $d$ numbers per head, the cache can be kept in two ways:
#
# * **four matrices**: every token's two keys and two values, $4Td$ numbers; the pairs are formed when needed;
# * **two matrices**: one key row and one value row for every *pair* of tokens, about $2T^2d$ numbers.
#
# Chen et al. prove that the two-matrix cache saves $\Omega(T^2d)$ time a decode step (Theorem 4.3) against a
# four-matrix cache that forms every pair row at every step. This lesson asks: **what does each layout cost on
# a real machine, and does attending to pairs pay off on a task that needs them?**
#
# **You will learn**: tensor attention by hand, checked against the library (`methods/tensor_attention/`);
# each layout's time and memory, measured; and Match3, a task where pairs matter.

# %% tags=["setup"]
from preamble import TINY  # the repository importable before any other import

# %% [markdown]
# ## 1. One decode step, built by hand
#
# The symbols of this lesson, besides the book's shared ones ([notebooks/README.md](README.md)):
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $T$, $d$ | tokens in the cache (the paper's $n$); numbers per head | `n`, `d` |
# | $q_t$ | the query of step $t$, $d$ numbers | `q` |
# | $K_1$, $K_2$ | a head's two keys per token, $T \times d$ each: $K_1[a]$ is token $a$'s first key | `K1`, `K2` |
# | $V_1$, $V_2$ | a head's two values per token, $T \times d$ each | `V1`, `V2` |
# | $\odot$ | elementwise product (of two equal shapes; of a matrix and a vector: each row times the vector) | `*` |
# | $Z_{ab}$ | the score of the token pair $(a, b)$ | `S` |
# | $P_{ab}$ | the pair's weight: one softmax over all $T^2$ pairs | `P` |
# | $o_t$ | the head's output at step $t$, $d$ numbers | `factored`, `naive`, `two` |
# | $\tilde K$, $\tilde V$ | the $T^2$ pair rows: row $(a, b)$ of $\tilde K$ is $K_1[a] \odot K_2[b]$ | `kron_rows` |
#
# Tensor attention for one query (Chen et al., Definition 3.6; the $1/\sqrt d$ is ours):
#
# $$Z_{ab} = \frac{\big\langle q_t,\; K_1[a] \odot K_2[b] \big\rangle}{\sqrt d}, \qquad
#   P = \operatorname{softmax}_{(a, b)}(Z), \qquad
#   o_t = \sum_{a=0}^{T-1} \sum_{b=0}^{T-1} P_{ab}\; V_1[a] \odot V_2[b].$$
#
# A random toy of one head, 50 tokens of 16 numbers, in float64 so that two ways of computing agree to
# rounding:

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


def pair_probabilities_by_hand(q, K1, K2, scale):
    """q (d,), K1 (n, d), K2 (n, d) -> S, P, both (n, n): the pair scores and their softmax for one query."""
    # BEGIN SOLUTION [tensor_attention:pair_softmax] score each pair (a, b) in two loops, then ONE softmax over all n^2
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
      f"{P_hand.sum():.3f} over all pairs, and the largest row sum is {P_hand.sum(1).max():.3f} (one softmax per "
      "row would make every row sum 1)")

# %% [markdown]
# The library computes $o_t$ in three ways, none with loops:
#
# * **naive four-matrix**: build $\tilde K$ and $\tilde V$ from the four matrices (`kron_rows`), then ordinary
#   attention over the pair rows: what Theorem 4.3 charges the four-matrix cache.
# * **factored four-matrix**: a pair's score is $\sum_j q_j K_1[a]_j K_2[b]_j / \sqrt d$ ($j$ over the $d$
#   numbers), so scores and output factor into matrix products and nothing of size $T^2 d$ is formed:
#
#   $$Z = \frac{(K_1 \odot q_t)\, K_2^\top}{\sqrt d}, \qquad o_t = \sum_{a=0}^{T-1} \big(V_1 \odot (P\,V_2)\big)[a].$$
#
# * **two-matrix**: $\tilde K$ and $\tilde V$ are stored; ordinary attention over them.
#
# The three agree:

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
from methods.tensor_attention import four_cache_attention, kron_rows, naive_four_cache_attention, two_cache_attention

naive = naive_four_cache_attention(q, K1, K2, V1, V2, scale)
factored = four_cache_attention(q, K1, K2, V1, V2, scale)
two = two_cache_attention(q, kron_rows(K1, K2), kron_rows(V1, V2), scale)
print(f"fp64, n = {n}: |naive - factored| = {(naive - factored).abs().max():.1e}, "
      f"|two - factored| = {(two - factored).abs().max():.1e}")

# %% [markdown]
# ## 2. The trade-off, measured
#
# `measure` (from `experiments/tensor_attention_bench.py`) fills one layer (4 heads of 16 numbers, fp32) with
# $T - 7$ random tokens, runs 7 decode steps on each path (append the new token's rows, attend with its query), so
# the cache ends at $T$ tokens, and records the bytes stored and the median time of a step. The table's last columns
# divide each four-matrix path's time by the two-matrix path's; a slope 2 (of log time or log bytes against log $T$)
# means growth like $T^2$:

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
from experiments.tensor_attention_bench import measure, table

lengths = [16, 32, 64, 128] if TINY else [32, 128, 512, 1024]
timing = measure(lengths)             # per path: bytes stored and ms per step, at each length
print(table(timing))
ratio = timing["two"]["bytes"][-1] / timing["four"]["bytes"][-1]
print(f"at T = {lengths[-1]}: the two-matrix cache stores {ratio:.0f}x the bytes of the four-matrix cache")

# %% [markdown]
# Timings move from run to run (a shared CPU): read orders of magnitude more than the slopes.
#
# * **Memory**: the two-matrix cache grows like $T^2$ (it also keeps the four factor matrices, to form the next
#   token's pairs): 513x the four-matrix cache at 1024 tokens.
# * **Theorem 4.3's saving shows against the naive path only**: rebuilding $\tilde K$ and $\tilde V$ at every
#   step is several times slower than reading them from the two-matrix cache (naive/two; how many times depends on
#   the machine: five to ten on the ones we ran), except at the shortest length, and the gap grows about as
#   $T^2$ (the `additive gap` line: slope about 2 for four-naive minus two). The factored path has no such gap:
#   four minus two is negative at every length.
# * **The factored path beats the two-matrix path** (four/two below 1). Both do about $2T^2d$ multiply-adds a
#   head, but the two-matrix path reads $2T^2d$ stored numbers a step, the factored path $4Td$. On this CPU the
#   four-matrix cache wins on memory and on time.

# %% [markdown]
# ## 3. Where pairs matter: Match3
#
# Sanford et al. (§4) prove that Match3, "do two numbers of the sequence complete this one to 0 modulo a fixed
# number?", needs a large standard attention layer, while one tensor head computes it. Here it is causal: a
# sequence `BOS x_1 L_1 x_2 L_2 ...` of 12 numbers $x_i$ modulo 32, where the label `L_i` is YES if
# $x_a + x_b + x_i = 0 \pmod{32}$ for some $a \le b \le i$, else NO. A model reads $x_i$ and predicts `L_i`.
#
# Two bundled decoders (lesson 00's nanollm) were trained for the same number of steps, one seed each: one
# with tensor attention, one with standard attention and nearly as many parameters. The *majority baseline*
# guesses, at each position, the label more frequent there. The accuracy difference is paired over the same
# sequences, with its interval:

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
from experiments.evaluation.intervals import describe, paired_difference
from methods.tensor_attention import match3

n_eval = 200 if TINY else 2000                    # fresh sequences to evaluate on
ids, _ = match3.batch(n_eval, match3.N_NUMBERS, seed=10**6)       # (sequences, 25): BOS x_1 L_1 x_2 L_2 ...
print(f"Match3 modulo {match3.M}, {match3.N_NUMBERS} numbers a sequence, {n_eval} fresh sequences; "
      f"majority baseline {match3.majority_baseline():.3f}")
right = {}                                        # (sequences, numbers): label right or wrong
for name in ("tensor", "standard"):
    m, card = match3.load(f"match3-{name}")
    with torch.no_grad():     # the output at x_i (positions 1, 3, ...) predicts L_i (the next token: 2, 4, ...)
        right[name] = (m(ids).argmax(-1)[:, 1::2] == ids[:, 2::2]).float()
    print(f"{name:>8} attention, {m.num_params():,} parameters, {card['steps']} training steps: "
          f"label accuracy {right[name].mean():.3f}")
gap, lo, hi = paired_difference([right["tensor"].mean(1).tolist()], [right["standard"].mean(1).tolist()])
print(f"tensor - standard label accuracy, paired over the same {n_eval} sequences: {describe(gap, lo, hi, 3)}")

# %% [markdown]
# Tensor attention gets 0.944 of the labels right, standard attention 0.874, the majority baseline 0.766, and
# the paired interval lies above 0: on a task that needs pairs, attending to pairs pays off. Both are single
# runs with one seed: the interval covers the evaluation sequences, not another training run.
#
# Unlike the other lessons, this one runs no pretrained language model: none with tensor attention runs here.
# And the theorem is about one attention layer, while both bundled models have more than one: this comparison
# illustrates it, it does not test it.
#
# ## Exercises
#
# Each exercise: a cell where you replace the `None`, a check that gives a hint when the answer is wrong, and
# the reference answer, collapsed.
#
# ### Exercise 1: the naive step by hand
#
# Write the naive four-matrix path yourself, without `kron_rows`, `TwoCache` or the library's attentions and their
# parts (`pair_scores`, `pair_softmax`, `factored_output`):
# `my_naive_step(q, K1, K2, V1, V2, scale)`, for one head with `q` (d,) and `K1`, `K2`, `V1`, `V2` (n, d),
# returns a tuple of three: the $n^2$ pair rows $\tilde K$ and $\tilde V$ (n * n, d), row $a n + b$ holding
# pair $(a, b)$, then one ordinary attention of `q` over them
# (scores scaled by `scale`, one softmax, a weighted sum of the pair values), (d,). The check runs it on the toy
# of section 1 and on random ones of other sizes, handing your function the (d,) and (n, d) slices itself.

# %%
my_naive_step = None       # replace None: a function -> (pair keys, pair values, output) (write def my_naive_step(...))

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
from exercises import calls, exercise, on_copies


@exercise("Exercise 1")
def check_naive_step(naive_step):
    library = calls(naive_step, "kron_rows", "naive_four_cache_attention", "four_cache_attention",
                    "two_cache_attention", "TwoCache", "pair_scores", "pair_softmax", "factored_output")
    assert not library, f"by hand: your function calls {', '.join(library)} (yours by that name too: rename it)"
    g = torch.Generator().manual_seed(1)
    toys = [(q, K1, K2, V1, V2, scale)] + [tuple(torch.randn(1, 1, m, e, generator=g, dtype=q.dtype)
                                                  for m in (1, n_, n_, n_, n_)) + (s,)
                                            for n_, e, s in ((3, 5, 5 ** -0.5), (7, 2, 1.3))]   # another scale
    for tq, tk1, tk2, tv1, tv2, ts in toys:
        m, e = tk1.shape[-2:]
        pair_keys, pair_values, output = (torch.as_tensor(x).to(tq.dtype) for x in
                                          on_copies(naive_step, tq[0, 0, 0], tk1[0, 0], tk2[0, 0], tv1[0, 0],
                                                    tv2[0, 0], ts))
        for rows in (pair_keys, pair_values):
            assert tuple(rows.shape) == (m * m, e), "the pair rows: n * n rows of d numbers each"
        assert torch.allclose(pair_keys[1], tk1[0, 0, 0] * tk2[0, 0, 1]), "row a * n + b holds K1[a] * K2[b]"
        assert torch.allclose(pair_keys, kron_rows(tk1, tk2)[0, 0]), "every row a * n + b holds K1[a] * K2[b]"
        assert torch.allclose(pair_values, kron_rows(tv1, tv2)[0, 0]), "every row a * n + b holds V1[a] * V2[b]"
        assert tuple(output.shape) == (e,), "the output is one vector of d numbers"
        right = four_cache_attention(tq, tk1, tk2, tv1, tv2, ts)[0, 0, 0]
        assert torch.allclose(output, right, atol=1e-6), \
            "one softmax over all n * n scores, each scaled by `scale`, then the weighted sum of the pair values"


check_naive_step(my_naive_step)

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output"]
# BEGIN SOLUTION [tensor_attention] broadcast K1[:, None] * K2[None] to (n, n, d), flatten, softmax(scale K~ q) @ V~
def reference_naive_step(q, K1, K2, V1, V2, scale):
    n, d = K1.shape
    pair_keys = (K1[:, None, :] * K2[None, :, :]).reshape(n * n, d)       # row a n + b = K1[a] * K2[b]
    pair_values = (V1[:, None, :] * V2[None, :, :]).reshape(n * n, d)
    return pair_keys, pair_values, (scale * pair_keys @ q).softmax(0) @ pair_values
# END SOLUTION


check_naive_step(reference_naive_step)

# %% [markdown]
# ### Exercise 2: is a path limited by memory?
#
# At every step the naive path writes $\tilde K$ and $\tilde V$, $2T^2d$ numbers a head, then reads them once;
# the two-matrix path reads its stored pair rows, as many numbers. At the longest length of section 2
# (`timing["lengths"][-1]`), for its layer, compute the rate at which each path moves those bytes, in GB/s
# ($10^9$ bytes a second, unrounded): the bytes of one step over the median time of a step, `timing[path]["ms"][-1]`
# (milliseconds). The closer a path comes to the rate at which the machine reads memory, the more memory limits it;
# well below that rate, its arithmetic does. The reference answer measures the rate on your machine: which is which?

# %%
HEADS, DIM, FP32 = 4, 16, 4     # section 2's layer: 4 heads of d = 16 numbers, 4 bytes a number
my_naive_gbps = None            # replace None: GB/s the naive path writes and reads at the longest length
my_two_gbps = None              # replace None: GB/s the two-matrix path reads at the longest length

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
@exercise("Exercise 2")
def check_rates(naive_gbps, two_gbps):
    pair_rows = timing["two"]["bytes"][-1] - timing["four"]["bytes"][-1]   # the two-matrix cache less its 4 factors
    stored = timing["two"]["bytes"][-1]                                    # counting the factors too: also right
    # the bytes each answer implies: GB/s x 1e9 x seconds (one pass for two-matrix; written and read for naive)
    naive_bytes = naive_gbps * 1e9 * timing["four-naive"]["ms"][-1] / 1e3 / 2
    two_bytes = two_gbps * 1e9 * timing["two"]["ms"][-1] / 1e3

    def exact(implied):                                                    # the bytes counted, to half a percent
        return 0.995 * pair_rows <= implied <= 1.005 * stored

    assert not (exact(2 * naive_bytes) and exact(2 * two_bytes)), "both rates are half: fp32, 4 bytes a number"
    assert not exact(2 * naive_bytes), "the naive path writes K~ and V~ (2 T^2 d numbers a head), then reads them: " \
        "count both tensors, written and read"
    for path, implied, bytes_of in (("naive", naive_bytes, "bytes written and read"),
                                    ("two-matrix", two_bytes, "pair-row bytes read")):
        assert exact(implied) or not 0.95 * pair_rows <= implied <= 1.05 * stored, f"{path}: close, not within " \
            "half a percent: count exactly (T, not T - 1) and store the rate unrounded"
        assert exact(implied), f"{path}: the {bytes_of} at one step (all heads, 4 bytes a number, counted " \
            "exactly: 1 GB = 10^9 bytes), over its time in seconds (ms / 1000), over 1e9"


check_rates(my_naive_gbps, my_two_gbps)

# %% tags=["needs:pair_scores", "needs:pair_softmax", "needs:factored_output", "needs:two_cache_append"]
# BEGIN SOLUTION [tensor_attention] bytes = heads * 2 T^2 d * 4 (twice for naive: written, then read) / seconds / 1e9
pair_row_bytes = HEADS * 2 * timing["lengths"][-1] ** 2 * DIM * FP32
reference_naive_gbps = 2 * pair_row_bytes / (timing["four-naive"]["ms"][-1] / 1e3) / 1e9
reference_two_gbps = pair_row_bytes / (timing["two"]["ms"][-1] / 1e3) / 1e9
# END SOLUTION
check_rates(reference_naive_gbps, reference_two_gbps)

import time

big = torch.ones(2 ** 24 if TINY else 2 ** 26)       # 67 or 268 MB of fp32: more than the CPU's caches hold
seconds = []
for _ in range(5):
    start = time.perf_counter()
    big.sum()                                           # reads every byte once
    seconds.append(time.perf_counter() - start)
read_gbps = big.numel() * FP32 / min(seconds) / 1e9     # this machine's read rate: the fastest of five sums
print(f"naive {reference_naive_gbps:.1f} GB/s, two-matrix {reference_two_gbps:.1f} GB/s; this machine reads "
      f"{read_gbps:.1f} GB/s (a sum over {big.numel() * FP32 / 1e6:.0f} MB): the two-matrix path moves its bytes at "
      f"{reference_two_gbps / read_gbps:.0%} of that rate, the naive path at {reference_naive_gbps / read_gbps:.0%}")

# %% [markdown]
# The two-matrix path moves its bytes a few times faster than the naive one (section 2's naive/two ratio, halved:
# the naive path moves twice the bytes), closer to the read rate: its step only reads the stored rows. The naive
# step first builds them, and that arithmetic sets its pace.
#
# **Go further**: [labs/03_tensor_attention_bounds.ipynb](labs/03_tensor_attention_bounds.ipynb): the memory
# lower bound of Theorem 4.1 run, SubGen's approximate cache, dropping tokens or pairs, Match3 by position,
# and Match3 decoded through each of the three cache layouts.
