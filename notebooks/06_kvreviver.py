# %% [markdown]
# # 06 KVReviver: evicted tokens in a count sketch, revived for every attention
#
# Yuan et al., "KVReviver: Reversible KV Cache Compression with Sketch-Based Token Reconstruction",
# [arXiv 2512.17917](https://arxiv.org/abs/2512.17917).
#
# **Before this lesson**: [01_baselines](01_baselines.ipynb) (eviction, H2O); the [metrics glossary](README.md#metrics)
# and the [notation table](README.md) ($T$, $d$, $H_{kv}$, $B$).
#
# **The question.** A token evicted before the question arrives cannot answer it (the paper's *contextual
# amnesia*). KVReviver keeps the newest (*Recent*) and most-attended (*Candidate*) tokens, and adds the rest to a
# small *count sketch* (*Vague*) from which attention rebuilds them, approximately. The paper reports near-full
# accuracy at 10-25% budgets where eviction fails. Does the sketch bring forgotten tokens back?

# %% tags=["setup"]
from preamble import TINY

from nanollm import load

model, tok, card = load("retrieval-llama")     # the bundled model (notebook 00): 4 layers, 4 query heads, 2 KV heads

# %% [markdown]
# ## 1. KVReviver's count sketch: insert, and a median query
#
# A count sketch sums many items into $R$ rows of $W$ cells: row $i$ adds item $J$ to cell $c_i(J)$ with a sign
# $g_i(J) = \pm 1$, both random hashes of $J$. KVReviver's has $R = 3$ rows; a cell holds a key and a value per KV
# head.
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $R$, $i$; $W$ | rows, one of them; cells per row | `rows`, `i`; `W` |
# | $J$; $c_i(J)$, $g_i(J)$ | a token's position; its cell and sign in row $i$ | `J`; `h`, `g` |
# | $k_J$, $v_J$; $\hat k_J$, $\hat v_J$ | its key and value; their estimates | `k`, `v` |
# | $C^K$, $C^V$ | the cells: sums of keys, signed sums of values | `cell_k`, `cell_v` |
# | $E$; $\sigma^2$ | tokens in the sketch; their variance | `E` |
#
# Insert (Algorithm 1) adds $k_J$, and $v_J$ times its sign, to $J$'s cell in every row; query (Algorithm 2) takes
# the element-wise median over the rows, the sign undone:
#
# $$C^K[i, c_i(J)] \mathrel{+}= k_J,\quad C^V[i, c_i(J)] \mathrel{+}= g_i(J)\,v_J \qquad\qquad
# \hat k_J = \operatorname{median}_i C^K[i, c_i(J)],\quad \hat v_J = \operatorname{median}_i\, g_i(J)\,C^V[i, c_i(J)]$$
#
# A row thus reads $v_J$ plus its cell's other values, each times a random sign: an error of zero on average. Keys
# get no sign (the paper: the softmax would not stay unbiased anyway), so a key's error is a plain sum of other
# keys. The toy: six tokens $J = 0, \dots, 5$, keys $J + 1$, values $10\,(J + 1)$, in 3 rows of 4 cells; below,
# each cell's tokens and their signs:

# %%
import torch

from exercises import lesson_function, where_differs   # a check's functions; where a by-hand result differs
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
# Tokens 1 and 4, alone in every row, come back exactly (two rows would do: the median of `{x, x, x + error}` is
# `x`). The other keys come back too large, the other values off either way.
#
# ## 2. Reconstruction error vs tokens per cell
#
# A row's value error has a variance of about $(E/W)\,\sigma^2$; the median of three rows keeps about 0.448 of it
# (the paper's Lemma 2). Measured on the first 128 tokens of layer 2 of the bundled model, in 3 rows, each width
# $W$ over five draws of the hashes:

# %%
from nanollm import KVCache, prefill
from nanollm.data.tasks import make_sample

LENGTH = 256 if TINY else 512                               # prompt tokens
full = KVCache(model.config)                                # the full cache: every token kept
prefill(model, torch.tensor([make_sample("niah_single_noise", tok, LENGTH, seed=1).context_ids]), full)
k, v = (x[0, :, :128].transpose(0, 1) for x in (full.layers[2].k, full.layers[2].v))   # (E, H_kv, d)
E = k.shape[0]                                              # tokens in the sketch


# %% tags=["needs:insert", "needs:query"]
def errors(W, seed):                                        # (value error, key error): MSE / variance
    s = VagueSketch(3, W, k.shape[1], k.shape[2], seed=seed)
    s.insert(torch.arange(E), k, v)
    kh, vh = s.query(torch.arange(E))
    return float(((vh - v) ** 2).mean() / v.var(0).mean()), float(((kh - k) ** 2).mean() / k.var(0).mean())


err = {W: tuple(sum(x) / 5 for x in zip(*(errors(W, seed) for seed in range(5)))) for W in (4, 16, 64, 128)}  # 5 draws
print(f"E = {E} tokens, 3 rows; MSE / per-coordinate variance\n   W    E/W   values   Lemma 2 (0.448 E/W)      keys")
for W in err:
    print(f"{W:4d} {E / W:6.1f} {err[W][0]:8.2f} {0.448 * E / W:13.2f} {err[W][1]:15.2f}")


# %% [markdown]
# The value errors follow Lemma 2. The key errors grow far faster, roughly as $(E/W)^2$: an unsigned sum also
# carries the keys' shared mean, E/W times over.
#
# ## 3. Contextual amnesia: the question after the context
#
# As in the paper's Tables 2-3, KVReviver splits a budget of $B$ slots per layer into 45% Recent, 45% Candidate
# and 10% sketch cells. The cell prints $W$ and $E/W$ per budget ($E$: the context's tokens outside Recent and
# Candidate, compressed before the question arrives), then runs every task with KVReviver, the full cache and H2O
# at the same budgets (the columns: [the metrics glossary](README.md#metrics); `vs best`: a paired test against
# the best method at that keep ratio):

# %% tags=["needs:insert", "needs:query"]
from experiments.evaluation.compare import RunSpec, format_tables, run
from methods.kvreviver import KVReviverPolicy

TASKS = card["default_suite"][:1] if TINY else card["default_suite"]    # the bundled model's six tasks
SAMPLES = 1 if TINY else 5                                     # prompts per task
budgets = [round(r * LENGTH) for r in ([0.25] if TINY else [0.25, 0.5])]   # B at keep ratios 0.25 and 0.5
contexts = [len(make_sample(t, tok, LENGTH, seed=i).context_ids) for t in TASKS for i in range(SAMPLES)]
context = sum(contexts) / len(contexts)                        # tokens compressed before the question, on average
for B in budgets:
    split = KVReviverPolicy(budget=B).split(B)                  # raw = Recent + Candidate slots; the sketch's width
    print(f"B = {B}: {split.raw} raw slots, W = {split.width} cells a row for E = {context - split.raw:.0f} "
          f"tokens on average: E/W = {(context - split.raw) / split.width:.0f}")
records = run(model, tok, RunSpec(["kvreviver", "h2o"], budgets, TASKS, ["question_after_context"], SAMPLES, LENGTH,
              progress=False))
print(format_tables(records))


# %% [markdown]
# KVReviver answers no question at either keep ratio (mean acc 0.00), where H2O answers 0.69 and 0.85: the sketch
# brings nothing back. It holds E/W = 83 and 27 tokens a cell, where section 2's keys were already 870.75
# variances off at E/W = 32. The [lab](labs/06_kvreviver_failure.ipynb) shows the rebuilt keys tens of times too
# long, and the eviction half alone (no sketch) answering nothing either, because it makes one choice of tokens for
# all of a layer's heads, whose attention falls on different tokens: with one choice per KV head it answers most
# questions, as H2O does (lab section 2.2, three prompts a task). SmolLM2-135M with KVReviver also answers almost
# nothing, at 2048 tokens ([the SmolLM2 runs](../experiments/evaluation/smollm2.md)).

# %% [markdown]
# ## Exercises
#
# Fill in each `None`, then run the check below it; the reference answer is collapsed under the check.
#
# ### Exercise 1: which tokens come back exactly?
#
# Write section 1's rule: `my_exact(h, W)` takes `h` (R, n), the cells of n tokens in R rows of W cells, and
# returns a bool per token: True where it is alone in its cell in at least two rows. The check compares it with
# the keys that come back exactly from sketches of positive keys; try yours on `big` below. Then, in a sentence:
# why does a positive key come back exact only where the rule says so, while a value may come back exact
# elsewhere too?

# %% tags=["needs:insert", "needs:query"]
@lesson_function                         # the check below computes with it
def positive_sketch(seed, width=64):       # 48 positive keys (the values: the same numbers) in 3 rows of W cells
    sketch = VagueSketch(rows=3, width=width, n_kv_head=1, head_dim=1, seed=seed)
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
    for seed, width in ((1, 32), (2, 64), (3, 100)):                           # sketches the learner never saw
        sketch, pos, keys = positive_sketch(seed, width)
        came_back = (sketch.query(pos)[0] == keys).flatten()                   # (48,): the exact keys
        h = sketch.buckets(pos)                                                # (3, 48): widths 32, 64, 100
        try:
            said = torch.as_tensor(exact(h, width))
        except Exception as e:                                                 # a width written as a number
            raise AssertionError(f"on h {tuple(h.shape)} and W = {width}, your function raised "
                                 f"{type(e).__name__}: {e}") from None
        assert said.shape == came_back.shape, "one prediction per token: shape (n,), n the columns of h"
        assert said.dtype == torch.bool, "a bool per token: True where you predict the key comes back exactly"
        assert not (said & ~came_back).any(), "some tokens you call exact come back too large: count the tokens " \
            "in each cell of each row (R, W), look up each token's own cell in that row, and call it exact only " \
            "where it is alone in at least two rows (one is not enough: the median needs two)"
        assert torch.equal(said, came_back), "some exact keys you missed: count the tokens in every cell of every " \
            "row, look up each token's cells, and call it exact where it is alone in at least two rows (not all)"


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
# Would signing the keys help? Write `my_signed_key_error`: the error at $W = 4$ and $W = 128$ of keys that go into
# the sketch and come back times $g_i(J)$, as values do, measured like section 2's `errors` (`seed=0`, the MSE
# divided by `k.var(0).mean()`), which inserts `k` unsigned. Then, in a sentence: is that enough to cure the keys?

# %% tags=["needs:insert", "needs:query"]
my_signed_key_error = {4: None, 128: None}     # replace each None: the signed keys' error at that W

# %% tags=["needs:insert", "needs:query"]
@exercise("Exercise 2")
def check_signed_key_error(error):
    assert sorted(error) == [4, 128], "one error for W = 4 and one for W = 128"
    for W, e in error.items():
        s = VagueSketch(3, int(W), k.shape[1], k.shape[2], seed=0)               # a key of 4.0 reads as 4
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
# the rebuilt keys and their attention, wider sketches, one part changed at a time, memory and decode time.
