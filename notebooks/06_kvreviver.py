# %% [markdown]
# # 06 KVReviver: evicted tokens in a count sketch, revived for every attention
#
# Yuan et al., "KVReviver: Reversible KV Cache Compression with Sketch-Based Token Reconstruction",
# [arXiv 2512.17917](https://arxiv.org/abs/2512.17917).
#
# **Before this lesson**: [01_baselines](01_baselines.ipynb): the eviction baselines (StreamingLLM, H2O).
# The metrics (acc, KL, keep ratio, KV KiB) are in the [metrics glossary](README.md#metrics), the shared symbols
# ($T$, $d$, $H_{kv}$, $B$) in the [book's notation table](README.md).
#
# **The question.** An evicting method forgets: a token dropped before the question arrives cannot answer it
# (the paper's *contextual amnesia*). KVReviver keeps the newest tokens (*Recent*) and the most-attended ones
# (*Candidate*) raw, and adds every other token into a small *count sketch* (*Vague*), from which each
# attention rebuilds an approximation of all of them. The paper reports near-full accuracy at 10-25% budgets
# where eviction fails. Does the sketch bring forgotten tokens back? You will build the sketch by hand
# (checked against `methods/kvreviver_sketch.py`), measure its errors, and see why it fails on keys.

# %% tags=["setup"]
from preamble import TINY

from nanollm import load

model, tok, card = load("retrieval-llama")     # the bundled model (notebook 00): 4 layers, 4 query heads, 2 KV heads

# %% [markdown]
# ## 1. KVReviver's count sketch: insert, and a median query
#
# A count sketch (Charikar, Chen and Farach-Colton, 2002) keeps the sums of many items in a small table of
# $R$ rows of $W$ cells. Each row $i$ has a *bucket hash* $c_i(J)$, which picks one of its cells for item $J$,
# and a *sign hash* $g_i(J) = \pm 1$. KVReviver's Vague part is a count sketch of $R = 3$ rows whose cells
# hold a key and a value for every KV head. This lesson's symbols:
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $R$, $i$; $W$ | rows, one of them; cells per row (the width) | `rows`, `i`; `W` |
# | $J$; $c_i(J)$, $g_i(J)$ | a token, by its position; its cell and sign in row $i$ | `J`; `h`, `g` |
# | $k_J$, $v_J$; $\hat k_J$, $\hat v_J$ | token $J$'s key and value ($d$ numbers each); their estimates | `k`, `v` |
# | $C^K$, $C^V$ | the cells: sums of keys, signed sums of values | `cell_k`, `cell_v` |
# | $E$; $\sigma^2$ | tokens in the sketch (the paper's $a$); their variance per coordinate | `E` |
#
# Inserting token $J$ (Algorithm 1) adds its key, and its value times its sign, to its cell in every row;
# querying it (Algorithm 2) takes the element-wise median over the rows, the value's sign undone:
#
# $$C^K[i, c_i(J)] \mathrel{+}= k_J,\quad C^V[i, c_i(J)] \mathrel{+}= g_i(J)\,v_J \qquad\qquad
# \hat k_J = \operatorname{median}_i C^K[i, c_i(J)],\quad \hat v_J = \operatorname{median}_i\, g_i(J)\,C^V[i, c_i(J)]$$
#
# A row reads $v_J$ plus every other token in its cell, each times a random sign: an error of zero on average,
# with variance about $(E/W)\,\sigma^2$ (exactly so for values of mean 0; a mean adds its square to $\sigma^2$). The
# median of the rows is far off only when at least two of the three are. Keys get no sign (the paper: the softmax
# would not keep them unbiased anyway), so a key's error is a plain sum of other keys. A toy: six tokens
# $J = 0, \dots, 5$, token $J$ with key $J + 1$ and value $10\,(J + 1)$, in 3 rows of 4 cells.

# %%
import torch

from exercises import where_differs             # the by-hand check below: where a result differs
from methods.kvreviver_sketch import VagueSketch

toy = VagueSketch(rows=3, width=4, n_kv_head=1, head_dim=1, seed=3)
toy_pos = torch.arange(6)                                  # six tokens, J = 0..5
toy_k = torch.arange(1.0, 7.0).view(6, 1)                  # (n, d = 1): keys 1..6
toy_v = 10 * toy_k                                         # values 10..60
h, g = toy.buckets(toy_pos), toy.signs(toy_pos)            # (R, n): cell and sign of token J in row i
for i in range(toy.rows):                                  # each cell's tokens, each with its sign in row i
    cells = [[f"{J}{'+' if g[i, J] > 0 else '-'}" for J in range(6) if h[i, J] == c] for c in range(toy.width)]
    print(f"row {i}:", " | ".join(f"cell {c}: {' '.join(names) or '(empty)'}" for c, names in enumerate(cells)))


# %% [markdown]
# Insert and query the toy by hand, checked against the library's `VagueSketch`:

# %%
def sketch_insert(h, g, k, v, width):
    """h, g: (R, n) cells and signs; k, v: (n, d). Returns the cells (R, width, d): keys, values."""
    # BEGIN SOLUTION [kvreviver:insert] Algorithm 1: for every row i and token J, add k_J and g_i(J) v_J to cell h_i(J)
    rows, n = h.shape
    cell_k = torch.zeros(rows, width, k.shape[-1])
    cell_v = torch.zeros(rows, width, v.shape[-1])
    for i in range(rows):
        for J in range(n):
            cell_k[i, h[i, J]] += k[J]                    # keys: plain sums
            cell_v[i, h[i, J]] += g[i, J] * v[J]          # values: signed sums
    return cell_k, cell_v
    # END SOLUTION


def sketch_query(cell_k, cell_v, h, g):
    """The estimates (n, d) of every token's key and value, from the cells (R, W, d)."""
    # BEGIN SOLUTION [kvreviver:query] Algorithm 2: cell h_i(J) of every row (values times g_i(J)); median over rows
    rows = torch.arange(h.shape[0]).view(-1, 1)           # (R, 1): row i, beside h's (R, n)
    k_rows = cell_k[rows, h]                              # (R, n, d): row i's cell of token J
    v_rows = g[..., None] * cell_v[rows, h]               # (R, n, d): the sign again
    return k_rows.median(dim=0).values, v_rows.median(dim=0).values
    # END SOLUTION


toy.insert(toy_pos, toy_k.view(6, 1, 1), toy_v.view(6, 1, 1))     # the library: k, v as (n, H_kv, d)
lib_k, lib_v = toy.query(toy_pos)
cell_k, cell_v = sketch_insert(h, g, toy_k, toy_v, toy.width)      # by hand
est_k, est_v = sketch_query(cell_k, cell_v, h, g)
for mine, library, dims, what in ((cell_k, toy.key.view(3, 4, 1), ("row", "cell"), "key cells: plain sums of keys"),
                                  (cell_v, toy.value.view(3, 4, 1), ("row", "cell"), "value cells: sums of g_i(J) v_J"),
                                  (est_k, lib_k.view(6, 1), ("token",), "keys: the median over rows of cell h_i(J)"),
                                  (est_v, lib_v.view(6, 1), ("token",), "values: the median of g_i(J) cell h_i(J)")):
    assert not (off := where_differs(mine, library, dims)), f"{what}; yours differ: {off}"

# %% tags=["needs:insert", "needs:query"]
print("keys   ", toy_k.flatten().int().tolist(), "-> estimates", lib_k.flatten().int().tolist())
print("values ", toy_v.flatten().int().tolist(), "-> estimates", lib_v.flatten().int().tolist())


# %% [markdown]
# The library agrees. Tokens 1 and 4 (keys 2 and 5), alone in every row, come back exactly (alone in two rows of
# three would do: the median of `{x, x, x + error}` is `x`). The others' keys come back too large (sums of other
# keys), their values off in either direction, token 3's with the wrong sign.
#
# ## 2. Reconstruction error vs tokens per cell
#
# For values, the median of three rows keeps about 0.448 of a row's error variance $(E/W)\,\sigma^2$ (the paper's
# Lemma 2: 0.448 is the variance of the median of three standard normal draws; its Eq. 2 prints a 3 where the
# median's density has a 6, see `methods/claims.md`). Measured on the first 128 tokens of layer 2 of the bundled
# model on one prompt, for 3 rows and several widths $W$ (the mean of five draws of the hashes):

# %%
from nanollm import KVCache, prefill
from nanollm.data.tasks import make_sample

LENGTH = 256 if TINY else 512                               # prompt tokens
sample = make_sample("niah_single_noise", tok, LENGTH, seed=1)
full = KVCache(model.config)                                # the full cache: every token kept
prefill(model, torch.tensor([sample.context_ids]), full)
k, v = (x[0, :, :128].transpose(0, 1) for x in (full.layers[2].k, full.layers[2].v))   # (E, H_kv, d)
E = k.shape[0]                                              # tokens in the sketch


# %% tags=["needs:insert", "needs:query"]
def errors(W, seed):                                        # (value error, key error): MSE / variance
    s = VagueSketch(3, W, k.shape[1], k.shape[2], seed=seed)
    s.insert(torch.arange(E), k, v)
    kh, vh = s.query(torch.arange(E))
    return float(((vh - v) ** 2).mean() / v.var(0).mean()), float(((kh - k) ** 2).mean() / k.var(0).mean())


widths = [4, 16, 64, 128]                                   # W
err = {W: tuple(sum(x) / 5 for x in zip(*(errors(W, seed) for seed in range(5)))) for W in widths}   # 5 hash draws
print(f"E = {E} tokens, 3 rows; errors as MSE / per-coordinate variance")
print("   W    E/W   values   Lemma 2 (0.448 E/W)      keys")
for W in widths:
    print(f"{W:4d} {E / W:6.1f} {err[W][0]:8.2f} {0.448 * E / W:13.2f} {err[W][1]:15.2f}")


# %% [markdown]
# The value errors follow Lemma 2. The key errors grow far faster, roughly with the square of E/W once a cell
# holds more than a few tokens: an unsigned sum also carries the mean all keys share, E/W times over.
#
# ## 3. Contextual amnesia: the question after the context
#
# KVReviver splits a budget of $B$ slots per layer as the paper's Tables 2-3 do: 45% Recent, 45% Candidate, 10%
# sketch cells; the cell below prints the sketch's width $W$ at each budget and the tokens a cell then holds,
# $E/W$, with $E$ the context's tokens outside Recent and Candidate (raw = Recent + Candidate): at the smaller
# budget far beyond the first row of section 2's table ($E/W = 32$), at the larger one just below it. The
# context is compressed before the question arrives; `compare.run`
# answers every task's prompts with KVReviver, the full cache and H2O (notebook 01) at the same budgets
# (`vs best`: an exact paired test against the keep ratio's most accurate method):

# %% tags=["needs:insert", "needs:query"]
from experiments.evaluation.compare import RunSpec, format_tables, run
from methods.kvreviver import KVReviverPolicy

TASKS = card["default_suite"][:1] if TINY else card["default_suite"]    # the bundled model's six tasks
SAMPLES = 1 if TINY else 5                                     # prompts per task
KEEP_RATIOS = [0.25] if TINY else [0.25, 0.5]
budgets = [max(1, round(r * LENGTH)) for r in KEEP_RATIOS]     # B: slots per layer and KV head
contexts = [len(make_sample(t, tok, LENGTH, seed=i).context_ids) for t in TASKS for i in range(SAMPLES)]
context = sum(contexts) / len(contexts)                        # the tokens compressed before the question
print(f"contexts of {min(contexts)} to {max(contexts)} tokens, {context:.0f} on average")
for B in budgets:
    split = KVReviverPolicy(budget=B).split(B)                  # raw = Recent + Candidate slots; the sketch's width
    print(f"B = {B}: {split.raw} raw slots, W = {split.width} cells a row for E = {context - split.raw:.0f} "
          f"tokens on average: E/W = {(context - split.raw) / split.width:.0f}")
records = run(model, tok, RunSpec(["kvreviver", "h2o"], budgets, TASKS, ["question_after_context"], SAMPLES, LENGTH,
              progress=False))
print(format_tables(records))


# %% [markdown]
# KVReviver answers no question at either keep ratio (mean acc 0.00), where H2O answers 0.69 and 0.85: worse
# than plain eviction. The lab finds that its eviction half alone (Recent and Candidate, no sketch) answers
# nothing either with one selection per layer, and that the sketch's keys are what break it. The sketch does not cure
# contextual amnesia on this model, nor on a pretrained one: SmolLM2-135M with KVReviver answers almost nothing at
# 2048 tokens ([the SmolLM2 runs](../experiments/evaluation/smollm2.md)).
#
# ## 4. What this says at our scale
#
# * **Values** behave as the analysis says: signed sums, an error near Lemma 2's (section 2).
# * **Keys** break it: unsigned sums carry the keys' shared mean, and their error grows far faster than the
#   tokens per cell (section 2). The [lab](labs/06_kvreviver_failure.ipynb) shows the rebuilt keys tens of
#   times too long, and each head giving them all of its attention or none. So KVReviver does **not** cure
#   contextual amnesia here (section 3).

# %% [markdown]
# ## Exercises
#
# Replace each `None` in an exercise's first cell, then run its check: it hints when the answer is wrong and
# says "right" when it is. The reference answer is collapsed below it.
#
# ### Exercise 1: which tokens come back exactly?
#
# In section 1 a token alone in its cell in at least two rows came back exactly. Write that rule as a function of
# the buckets alone: `my_exact(h, W)`, with `h` (R, n) the cells of n tokens in R rows of W cells, returns one
# bool per token, True where the token is alone in its cell in at least two rows. The check runs it on sketches
# of 48 tokens with positive keys in 3 rows of 64 cells, hashed with seeds of its own, against the keys their
# queries give back (`big` below is one such sketch to try yours on). Then, in a sentence: why does a positive
# key come back exact only where the rule says so, while a value may come back exact where it does not?

# %% tags=["needs:insert", "needs:query"]
def positive_sketch(seed):                 # 48 positive keys (the values: the same numbers) in 3 rows of 64 cells
    sketch = VagueSketch(rows=3, width=64, n_kv_head=1, head_dim=1, seed=seed)
    pos = torch.randperm(4096, generator=torch.Generator().manual_seed(seed))[:48]     # 48 positions in 4k
    keys = torch.rand(48, 1, 1, generator=torch.Generator().manual_seed(seed)) + 0.5  # (n, H_kv, d), positive
    sketch.insert(pos, keys, keys)
    return sketch, pos, keys


big, big_pos, big_k = positive_sketch(seed=0)
h_big = big.buckets(big_pos)                                                       # (R, n): token J's cell in row i


# %%
my_exact = None                       # replace None: a function (h, W) -> (n,) bool tensor (write def my_exact(h, W))

# %% tags=["needs:insert", "needs:query"]
from exercises import exercise


@exercise("Exercise 1")
def check_exact(exact):
    for seed in (1, 2, 3):                                                     # sketches the learner never saw
        sketch, pos, keys = positive_sketch(seed)
        came_back = (sketch.query(pos)[0] == keys).flatten()                   # (48,): the exact keys
        said = torch.as_tensor(exact(sketch.buckets(pos), sketch.width))
        assert said.shape == came_back.shape, "one prediction per token: shape (n,), n the columns of h"
        assert said.dtype == torch.bool, "a bool per token: True where you predict the key comes back exactly"
        assert not (said & ~came_back).any(), \
            "some tokens you call exact come back too large: alone in one row is not enough, the median needs two"
        assert torch.equal(said, came_back), \
            "some exact keys you missed: count the tokens in every cell of every row, then look up each token's cells"


check_exact(my_exact)

# %% tags=["needs:insert", "needs:query"]
# BEGIN SOLUTION [kvreviver] one_hot(h, W).sum(1): tokens per cell; gather each token's count; alone where it is 1
def reference_exact(h, W):
    per_cell = torch.nn.functional.one_hot(h, W).sum(1)                        # (R, W): tokens in each cell
    alone = per_cell.gather(1, h) == 1                                         # (R, n): alone in row i's cell
    return alone.sum(0) >= 2
# END SOLUTION


check_exact(reference_exact)
keys_exact = reference_exact(h_big, big.width)
values_exact = (big.query(big_pos)[1] == big_k).flatten()
print(f"In big: {int(keys_exact.sum())} of 48 keys come back exactly, and {int(values_exact.sum())} values: a "
      "positive key's shared cell always reads too much; a signed value's errors can fall on both sides of v_J, "
      "or cancel.")

# %% [markdown]
# ### Exercise 2: signed keys
#
# Give the keys signs too, as values have: would a zero-mean key error help? Section 2's `errors` inserts the
# keys `k` unsigned. Write `my_signed_key_error`, the error (MSE / per-coordinate variance) of keys that go
# into the sketch times $g_i(J)$ and come back times $g_i(J)$ again, as values do, at $W = 4$ and $W = 128$
# (`seed=0`, and divided by the keys' variance as `errors` divides). Then, in a sentence: is that enough to
# cure the keys?

# %% tags=["needs:insert", "needs:query"]
my_signed_key_error = {4: None, 128: None}     # replace each None: the signed keys' error at that W

# %% tags=["needs:insert", "needs:query"]
@exercise("Exercise 2")
def check_signed_key_error(error):
    assert sorted(error) == [4, 128], "one error for W = 4 and one for W = 128"
    for W, e in error.items():
        s = VagueSketch(3, W, k.shape[1], k.shape[2], seed=0)
        s.insert(torch.arange(E), k, k)                                # k as a key (unsigned), and as a value
        plain, truth = (float(((x - k) ** 2).mean() / k.var(0).mean()) for x in s.query(torch.arange(E)))
        assert abs(e - plain) > 0.01 * plain, \
            f"W = {W}: that is the unsigned keys' error: the keys still go in without g_i(J)"
        assert abs(e - truth) <= 0.01 * truth, f"W = {W}: not the signed keys' error (within 1%): sign the keys " \
            "as the values are signed, with seed=0's hashes, and divide the MSE by k.var(0).mean(), as errors does"


check_signed_key_error(my_signed_key_error)

# %% tags=["needs:insert", "needs:query"]
# BEGIN SOLUTION [kvreviver] insert the keys in the values' place, insert(pos, zeros, k), and read query's second half
def signed_error(W, seed=0):
    s = VagueSketch(3, W, k.shape[1], k.shape[2], seed=seed)
    s.insert(torch.arange(E), torch.zeros_like(k), k)              # the keys get g_i(J), as values do
    _, est_k = s.query(torch.arange(E))                            # and lose it again
    return float(((est_k - k) ** 2).mean() / k.var(0).mean())


reference_signed_key_error = {W: signed_error(W) for W in (4, 128)}
# END SOLUTION
check_signed_key_error(reference_signed_key_error)
unsigned = {W: errors(W, 0)[1] for W in (4, 128)}                 # section 2's keys, the same hashes (seed 0)
print(f"signed keys: {reference_signed_key_error[4]:.2f} at W = 4, {reference_signed_key_error[128]:.2f} at W = 128; "
      f"unsigned: {unsigned[4]:.2f} and {unsigned[128]:.2f}. Signs remove the keys' shared mean, but at "
      f"E/W = {E // 4} the error is still {reference_signed_key_error[4]:.0f} key variances: not enough.")

# %% [markdown]
# **Go further**: [labs/06_kvreviver_failure.ipynb](labs/06_kvreviver_failure.ipynb) takes the failure apart:
# the rebuilt keys and the attention they get, wider sketches, one part changed at a time, the memory and the
# decode time.
