# %% [markdown]
# # 06 KVReviver: evicted tokens in a count sketch, revived for every attention
#
# Yuan et al., "KVReviver: Reversible KV Cache Compression with Sketch-Based Token Reconstruction",
# [arXiv 2512.17917](https://arxiv.org/abs/2512.17917).
#
# **Before this lesson**: [01_baselines](01_baselines.ipynb): the eviction baselines (StreamingLLM, H2O) and
# the two modes (the question in the prompt, or after the context). The metrics (acc, KL, keep ratio,
# KV KiB) are in the [metrics glossary](README.md#metrics), the shared symbols ($T$, $d$, $H_{kv}$, $B$) in
# the [book's notation table](README.md).
#
# **The question.** An evicting method forgets: a token dropped before the question arrives cannot answer it.
# The paper calls this *contextual amnesia*. KVReviver keeps the newest tokens (*Recent*) and the
# most-attended ones (*Candidate*) raw, and adds every other token into a small *count sketch* (*Vague*), from
# which each attention rebuilds an approximation of all of them. The paper reports near-full accuracy at
# 10-25% budgets where eviction fails. Does the sketch bring forgotten tokens back?
#
# **You will learn** what a count sketch is, how KVReviver uses one (built by hand, checked against
# `methods/kvreviver.py`), and why it fails on keys.

# %% tags=["setup"]
from preamble import TINY

from nanollm import load

model, tok, card = load("retrieval-llama")     # the bundled model (notebook 00): 4 layers, 4 query heads, 2 KV heads

# %% [markdown]
# ## 1. The count sketch, and KVReviver's
#
# ### 1.1 A count sketch
#
# A count sketch (Charikar, Chen and Farach-Colton, 2002) keeps the totals of many items in a small table of
# $R$ rows of $W$ cells, and answers "what is item $J$'s total?" approximately. Each row $i$ has a *bucket
# hash* $c_i(J)$, which picks one of the row's cells, and a *sign hash* $g_i(J) = \pm 1$. This lesson's
# symbols:
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $R$, $i$; $W$; $N$ | rows, one of them; cells per row (the width); cells in all, $R W$ | `rows`, `i`; `W` |
# | $J$; $c_i(J)$, $g_i(J)$ | an item (a token, by its position); its cell and sign in row $i$ | `J`; `h`, `g` |
# | $u_J$, $\hat u_J$; $C[i, c]$ | the number $J$ adds, and its estimate; the number in cell $c$ of row $i$ | |
# | $E$; $\sigma^2$ | items (tokens) in the sketch (the paper's $m$); the mean of $u_J^2$ | `E` |
# | $k_J$, $v_J$; $\hat k_J$, $\hat v_J$ | token $J$'s key and value ($d$ numbers each); their estimates | `k`, `v` |
# | $C^K$, $C^V$ | KVReviver's cells: sums of keys, signed sums of values | `cell_k`, `cell_v` |
# | $\hat v_{J,j}$; $\sigma_v^2$ | coordinate $j$ of $\hat v_J$; a value coordinate's variance (tokens) | `v.var(0)` |
#
# Item $J$ adds $g_i(J)\,u_J$ to its cell in every row; a query reads its $R$ cells back, undoes the sign,
# and takes the median:
#
# $$C[i, c_i(J)] \mathrel{+}= g_i(J)\,u_J \ \text{ for every row } i, \qquad
# \hat u_J = \operatorname{median}_i\ g_i(J)\,C[i, c_i(J)]$$
#
# **Its error.** Row $i$ reads $u_J$ plus every other item in $J$'s cell, each times a random sign: zero on
# average, with variance about $(E/W)\,\sigma^2$ (another item lands in $J$'s cell with probability $1/W$).
# Without the signs the neighbours would not cancel. The median of the rows is far off only when half of them
# are, which gets exponentially unlikely as $R$ grows.
#
# ### 1.2 KVReviver's sketch: insert, and a median query
#
# KVReviver's Vague part is a count sketch of $R = 3$ rows whose cells hold a key and a value for every KV
# head. Inserting token $J$ (Algorithm 1) adds its key, and its value times its sign, to its cell in every
# row; querying it (Algorithm 2) takes the element-wise median over the rows:
#
# $$C^K[i, c_i(J)] \mathrel{+}= k_J,\quad C^V[i, c_i(J)] \mathrel{+}= g_i(J)\,v_J \qquad\qquad
# \hat k_J = \operatorname{median}_i C^K[i, c_i(J)],\quad \hat v_J = \operatorname{median}_i\, g_i(J)\,C^V[i, c_i(J)]$$
#
# Keys get no sign (the paper: the softmax would not keep them unbiased anyway), so a key's error is a plain
# sum of other keys. A toy: six tokens with keys 1 to 6 and values 10 to 60, in 3 rows of 4 cells.

# %%
import matplotlib.pyplot as plt
import torch

from methods.kvreviver import VagueSketch

toy = VagueSketch(rows=3, width=4, n_kv_head=1, head_dim=1, seed=3)
toy_pos = torch.arange(6)                                  # six tokens, J = 0..5
toy_k = torch.arange(1.0, 7.0).view(6, 1)                  # (n, d = 1): keys 1..6
toy_v = 10 * toy_k                                         # values 10..60
h, g = toy.buckets(toy_pos), toy.signs(toy_pos)            # (R, n): cell and sign of token J in row i
count = torch.zeros(toy.rows, toy.width)                   # (R, W): tokens per cell
for i in range(toy.rows):
    for J in range(len(toy_pos)):
        count[i, h[i, J]] += 1

fig, ax = plt.subplots(figsize=(7.5, 2.8))
im = ax.imshow(count.numpy(), cmap="Oranges", vmin=0, vmax=4)
for i in range(toy.rows):
    for c in range(toy.width):
        names = [f"{J}{'+' if g[i, J] > 0 else '−'}" for J in range(len(toy_pos)) if h[i, J] == c]
        ax.text(c, i, "  ".join(names), ha="center", va="center", fontsize=11)
ax.set_xticks(range(toy.width), [f"cell {c}" for c in range(toy.width)])
ax.set_yticks(range(toy.rows), [f"row {i}" for i in range(toy.rows)])
ax.set(title="six tokens in 3 rows of 4 cells (token J, then its sign)", xlabel="cell", ylabel="row")
fig.colorbar(im, ax=ax, label="tokens in the cell", ticks=range(5))
plt.show()


# %% [markdown]
# The figure shows where each token lands (with its sign in that row; the shade counts tokens per cell).
# Tokens 1 and 4 sit alone in all three rows, token 2 in one row only, and tokens 0, 3 and 5 share a cell in
# every row. Insert and query by hand, checked against the library's `VagueSketch`:

# %%
# BEGIN SOLUTION [kvreviver:insert] Algorithm 1: for every row i and token J, add k_J and g_i(J) v_J to cell h_i(J)
def sketch_insert(h, g, k, v, width):
    """h, g: (R, n) cells and signs; k, v: (n, d). Returns the cells (R, width, d): keys, values."""
    rows, n = h.shape
    cell_k = torch.zeros(rows, width, k.shape[-1])
    cell_v = torch.zeros(rows, width, v.shape[-1])
    for i in range(rows):
        for J in range(n):
            cell_k[i, h[i, J]] += k[J]                    # keys: plain sums
            cell_v[i, h[i, J]] += g[i, J] * v[J]          # values: signed sums
    return cell_k, cell_v
# END SOLUTION


# BEGIN SOLUTION [kvreviver:query] Algorithm 2: read cell h_i(J) of every row (the value times g_i(J)), median over rows
def sketch_query(cell_k, cell_v, h, g):
    """The estimates (n, d) of every token's key and value, from the cells (R, W, d)."""
    rows = torch.arange(h.shape[0]).view(-1, 1)           # (R, 1): row i, beside h's (R, n)
    k_rows = cell_k[rows, h]                              # (R, n, d): row i's cell of token J
    v_rows = g[..., None] * cell_v[rows, h]               # (R, n, d): the sign again
    return k_rows.median(dim=0).values, v_rows.median(dim=0).values
# END SOLUTION


cell_k, cell_v = sketch_insert(h, g, toy_k, toy_v, toy.width)
est_k, est_v = sketch_query(cell_k, cell_v, h, g)
toy.insert(toy_pos, toy_k.view(6, 1, 1), toy_v.view(6, 1, 1))     # the library: k, v as (n, H_kv, d)
lib_k, lib_v = toy.query(toy_pos)
assert torch.allclose(cell_k, toy.key.view(3, 4, 1)) and torch.allclose(cell_v, toy.value.view(3, 4, 1)), \
    "the cells differ from VagueSketch.insert's"
assert torch.allclose(est_k, lib_k.view(6, 1)) and torch.allclose(est_v, lib_v.view(6, 1)), \
    "the estimates differ from VagueSketch.query's"

# %%
print("keys   ", toy_k.flatten().int().tolist(), "-> estimates", est_k.flatten().int().tolist())
print("values ", toy_v.flatten().int().tolist(), "-> estimates", est_v.flatten().int().tolist())


# %% [markdown]
# The library agrees. Tokens 1 and 4 come back exactly: alone in every row, each row reads `x` (a token alone
# in two rows of three would too: the median of `{x, x, x + error}` is `x`). Token 2's
# key comes back one too large. Tokens 0, 3 and 5 get keys too large (sums of other keys) and values off in
# either direction, token 3's with the wrong sign.
#
# ## 2. Reconstruction error vs tokens per cell
#
# With $E$ tokens in $W$ cells a row, one row's value error has variance about $(E/W)\,\sigma_v^2$ (section 1.1),
# and the median of three rows keeps about 0.448 of it (the paper's Lemma 2). The paper's bound (likewise for
# keys):
#
# $$\Pr\left(\operatorname{Var}(\hat v_{J,j}) > \frac{E\pi}{N}\,\sigma_v^2\right) <
# \exp\left(-\frac{E}{N}\right)$$
#
# Measured on the first 128 tokens of layer 2 of the bundled model on one prompt, relative to their
# per-coordinate variance, for sketches of 3 rows and several widths $W$ (the mean of five draws of the
# hashes):

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


widths = [4, 8, 16, 32, 64, 128, 256]                       # W
err = {W: tuple(sum(x) / 5 for x in zip(*(errors(W, seed) for seed in range(5)))) for W in widths}   # 5 hash draws


print(f"E = {E} tokens, 3 rows; errors as MSE / per-coordinate variance")
print("   W    E/W   values   Lemma 2 (0.448 E/W)   bound (E pi / N)      keys")
for W in widths:
    lemma, bound = 0.448 * E / W, torch.pi * E / (3 * W)
    print(f"{W:4d} {E / W:6.1f} {err[W][0]:8.2f} {lemma:13.2f} {bound:18.2f} {err[W][1]:13.2f}")


# %% [markdown]
# The value errors follow Lemma 2 and stay under the bound. The key errors grow far faster, roughly with the
# square of E/W once a cell holds more than a few tokens: an unsigned sum also carries the mean all keys
# share, E/W times over.
#
# ## 3. What the key error does to attention
#
# KVReviver splits a budget of $B$ slots per layer as the paper's Tables 2-3 do: 45% Recent, 45% Candidate,
# 10% sketch cells. After each step (Algorithm 3) Recent's oldest token moves to Candidate, Candidate's
# least-attended into the sketch, and a sketched token that scores high enough is revived. Before each
# attention (Algorithm 4) every evicted position is rebuilt from the sketch (`policy.attend_kv`). Per layer,
# a quarter of our prompt as budget:

# %% tags=["needs:insert", "needs:query"]
from methods import make_policy

policy = make_policy("kvreviver", budget=LENGTH // 4)
cache = KVCache(model.config, policy)
prefill(model, torch.tensor([sample.context_ids]), cache)
for layer in range(model.config.n_layer):
    rebuilt = policy.attend_kv(layer, cache.layers[layer])                   # Algorithm 4
    vague = ~torch.isin(rebuilt.pos[0, 0], cache.layers[layer].pos[0, 0])    # positions only the sketch holds
    true_norm = full.layers[layer].k[0].norm(dim=-1).mean()
    part = policy.parts(layer, cache.layers[layer])
    print(f"layer {layer}: Recent {part['R']}, Candidate {part['C']}, sketch {part['V']} tokens in "
          f"{part['cells']} cells;  |k| real {true_norm:.1f}, rebuilt {rebuilt.k[0][:, vague].norm(dim=-1).mean():.1f}")


# %% [markdown]
# The sketch's 12 cells hold 348 tokens, and the rebuilt keys are tens of times longer than real ones. The
# logit of a rebuilt key is then about the sum of its cell's tokens' logits, so large that each head should
# give the rebuilt entries all or nothing, its sign deciding which. The lab draws and counts it: most heads
# give the sketch nothing, as if its tokens were evicted, and a few give it everything.
#
# ## 4. Contextual amnesia: the question after the context
#
# The context is compressed before the question arrives. `compare.run` answers every task's prompts with
# KVReviver, the full cache, H2O and StreamingLLM (notebook 01), at the same slot budgets:

# %% tags=["needs:insert", "needs:query"]
from methods.evaluation.compare import format_tables, run
from methods.evaluation.intervals import describe, paired_difference

TASKS = card["default_suite"][:1] if TINY else card["default_suite"]    # the bundled model's six tasks
SAMPLES = 1 if TINY else 5                                     # prompts per task
KEEP_RATIOS = [0.25] if TINY else [0.1, 0.25, 0.5]
budgets = [max(1, round(r * LENGTH)) for r in KEEP_RATIOS]     # B: slots per layer and KV head
records = run(model, tok, ["kvreviver", "h2o", "streaming_llm"], budgets, TASKS,
              ["question_after_context"], SAMPLES, LENGTH, progress=False)


def per_task(records, method, ratio):    # per task, the per-sample accuracies (what paired_difference resamples)
    return [r["accuracies"] for r in sorted((r for r in records if r["method"] == method
                                             and abs(r["keep_ratio"] - ratio) < 0.005), key=lambda r: r["task"])]


# %% [markdown]
# `vs best` is an exact paired test against the keep ratio's most accurate method; under the table,
# KVReviver minus H2O with a paired interval (each task's prompts resampled).

# %% tags=["needs:insert", "needs:query"]
print(format_tables(records))
for keep in KEEP_RATIOS:
    print(f"keep {keep}: KVReviver - H2O accuracy "
          f"{describe(*paired_difference(per_task(records, 'kvreviver', keep), per_task(records, 'h2o', keep)))}")


# %% [markdown]
# KVReviver answers no question at any keep ratio (mean acc 0.00). At keep 0.1 no method answers much; at
# 0.25 and 0.5 KVReviver is below H2O (-0.69 and -0.85, intervals excluding 0), with the largest KL of the
# three. The sketch does not cure contextual amnesia on this model.
#
# ## 5. On a pretrained model: SmolLM2-135M
#
# A pretrained model whose full cache answers two tasks at 512 tokens: `passkey` (a numeric key in filler)
# and `niah_single_docs` (a needle in real documents). The paper reports full-cache accuracy at a 10% budget
# on 2k-token contexts. The table is the question after the context; under it, KVReviver minus the full
# cache in both modes.

# %% tags=["needs:insert", "needs:query"]
real, real_tok, _ = load("smollm2-135m")
LENGTH_REAL, SAMPLES_REAL = (256, 1) if TINY else (512, 3)            # tokens; prompts per task and mode
TASKS_REAL = ["passkey"] if TINY else ["passkey", "niah_single_docs"]
MODES_REAL = ["question_after_context"] if TINY else ["question_in_prompt", "question_after_context"]
KEEP_REAL = [0.25] if TINY else [0.1, 0.25]
real_records = run(real, real_tok, ["kvreviver", "h2o", "streaming_llm"], [round(k * LENGTH_REAL) for k in KEEP_REAL],
                   TASKS_REAL, MODES_REAL, SAMPLES_REAL, LENGTH_REAL, progress=False, workers=1)


# %% tags=["needs:insert", "needs:query"]
print(format_tables([r for r in real_records if r["mode"] == "question_after_context"]))
for mode in MODES_REAL:
    in_mode = [r for r in real_records if r["mode"] == mode]
    for keep in KEEP_REAL:
        print(f"{mode}, keep {keep}: KVReviver - full cache accuracy "
              f"{describe(*paired_difference(per_task(in_mode, 'kvreviver', keep), per_task(in_mode, 'full', 1.0)))}")


# %% [markdown]
# KVReviver answers nothing here either, in either mode (-1.00 against the full cache: it misses every answer
# the full cache gets, so the interval is one point), where StreamingLLM reaches 0.67 at keep 0.25. The
# paper's claim is **not reproduced**, with caveats: 512-token contexts (the paper: 2k and 32k), a 135M model,
# 3 prompts per task and mode.
#
# ## 6. What this says at our scale
#
# * **Values** behave as the analysis says: signed sums, an error near Lemma 2's (section 2).
# * **Keys** break it: unsigned sums rebuild tens of times too long, and attention to the sketch turns all or
#   nothing (section 3 says why; the lab, section 2.1, draws and counts it). So KVReviver does **not** cure
#   contextual amnesia here (sections 4 and 5).

# %% [markdown]
# ## Exercises
#
# Each exercise has a cell where you write (replace the `None`), a check cell that reads only your answer
# (it says "not answered yet" until you do, stops with a hint when the answer is wrong, and says "right"
# when it is), and the reference answer, collapsed: open it once you are done.
#
# ### Exercise 1: which tokens come back exactly?
#
# In section 1 the tokens alone in their cell in at least two rows came back exactly. Check that rule on 48
# tokens with positive keys in 3 rows of 64 cells: from the buckets alone (`h_big`), count the tokens in
# each row's cells, and predict "exact" where a token is alone in at least two rows. Write `my_exact`, one
# bool per token. Then, in a sentence: why does the rule hold for positive keys, and not for
# values?

# %% tags=["needs:insert", "needs:query"]
big = VagueSketch(rows=3, width=64, n_kv_head=1, head_dim=1, seed=0)
big_pos = torch.randperm(4096, generator=torch.Generator().manual_seed(0))[:48]     # 48 positions in a 4k context
big_k = torch.rand(48, 1, 1, generator=torch.Generator().manual_seed(0)) + 0.5     # positive keys
big.insert(big_pos, big_k, big_k)                                                  # the values: the same numbers
h_big = big.buckets(big_pos)                                                       # (R, n): token J's cell in row i
my_exact = None                       # replace None: a (48,) bool tensor, True where the key comes back exactly

# %% tags=["needs:insert", "needs:query"]
from exercises import exercise


@exercise("Exercise 1")
def check_exact(exact):
    came_back = (big.query(big_pos)[0] == big_k).flatten()                     # (48,): the exact keys
    exact = torch.as_tensor(exact)
    assert exact.shape == came_back.shape, "one prediction per token: shape (48,)"
    assert exact.dtype == torch.bool, "a bool per token: True where you predict the key comes back exactly"
    assert not (exact & ~came_back).any(), \
        "some tokens you call exact come back too large: alone in one row is not enough, the median needs two"
    assert torch.equal(exact, came_back), \
        "some exact keys you missed: count every row's cells (torch.nn.functional.one_hot(h_big, 64).sum(1))"


check_exact(my_exact)

# %% tags=["needs:insert", "needs:query"]
# BEGIN SOLUTION [kvreviver] one_hot(h, W).sum(1): tokens per cell; gather each token's count; alone where it is 1
per_cell = torch.nn.functional.one_hot(h_big, big.width).sum(1)                # (R, W): tokens in each cell
alone = per_cell.gather(1, h_big) == 1                                         # (R, n): alone in row i's cell
reference_exact = alone.sum(0) >= 2
# END SOLUTION
check_exact(reference_exact)
values_exact = (big.query(big_pos)[1] == big_k).flatten()
print(f"{int(reference_exact.sum())} of 48 keys come back exactly; {int(values_exact.sum())} values, "
      f"{int((values_exact & ~reference_exact).sum())} of them not alone in two rows. A positive key's shared "
      "cell always reads too much; a signed value's errors can fall on both sides of v_J, or cancel.")

# %% [markdown]
# ### Exercise 2: signed keys
#
# Give the keys signs too, as values have: would a zero-mean key error help? `signed_key_error` below
# measures section 2's key error on its keys `k`, still unsigned: change it so that the keys go into the
# sketch times $g_i(J)$ and come back times $g_i(J)$ again, as values do (`VagueSketch` already signs what it
# stores as a value; the library stays as it is). Write `my_signed_key_error`, the signed keys' error at $W = 4$ and
# $W = 128$ (`seed=0`). Then, in a sentence: is that enough to cure section 3's keys?

# %% tags=["needs:insert", "needs:query"]
def signed_key_error(k, width, seed=0):
    """Section 2's key error (3 rows of `width` cells): MSE / per-coordinate variance. Change it: the keys signed
    by g_i(J) on the way in and on the way out."""
    s = VagueSketch(3, width, k.shape[1], k.shape[2], seed=seed)
    s.insert(torch.arange(len(k)), k, torch.zeros_like(k))
    est_k, _ = s.query(torch.arange(len(k)))
    return float(((est_k - k) ** 2).mean() / k.var(0).mean())


my_signed_key_error = {4: None, 128: None}     # replace each None: signed_key_error(k, W), once you changed it

# %% tags=["needs:insert", "needs:query"]
@exercise("Exercise 2")
def check_signed_key_error(error):
    assert sorted(error) == [4, 128], "one error for W = 4 and one for W = 128"
    pos, flat = torch.arange(E), k.reshape(E, -1)                              # the keys as (E, H_kv * d)
    for W, e in error.items():
        s = VagueSketch(3, W, k.shape[1], k.shape[2], seed=0)
        h, g = s.buckets(pos), s.signs(pos)
        unsigned, signed = sketch_query(*sketch_insert(h, g, flat, flat, W), h, g)   # keys as keys, as values
        truth = float(((signed - flat) ** 2).mean() / k.var(0).mean())
        plain = float(((unsigned - flat) ** 2).mean() / k.var(0).mean())
        assert abs(e - plain) > 1e-4 * plain, \
            f"W = {W}: that is the unsigned keys' error: your copy still inserts the keys without g_i(J)"
        assert abs(e - truth) <= 1e-4 * truth, f"W = {W}: not the signed keys' error: in signed_key_error, " \
            "put the keys where VagueSketch puts the values, read them back from there, and keep seed=0"


check_signed_key_error(my_signed_key_error)

# %% tags=["needs:insert", "needs:query"]
# BEGIN SOLUTION [kvreviver] insert the keys in the values' place, insert(pos, zeros, k), and read query's second half
def signed_error(k, width, seed=0):
    s = VagueSketch(3, width, k.shape[1], k.shape[2], seed=seed)
    s.insert(torch.arange(len(k)), torch.zeros_like(k), k)         # the keys get g_i(J), as values do
    _, est_k = s.query(torch.arange(len(k)))                       # and lose it again
    return float(((est_k - k) ** 2).mean() / k.var(0).mean())


reference_signed_key_error = {W: signed_error(k, W) for W in (4, 128)}
# END SOLUTION
check_signed_key_error(reference_signed_key_error)
signed = reference_signed_key_error
print(f"signed keys: {signed[4]:.2f} at W = 4, {signed[128]:.2f} at W = 128; unsigned (section 2): {err[4][1]:.2f} "
      f"and {err[128][1]:.2f}; Lemma 2: {0.448 * E / 4:.2f} and {0.448 * E / 128:.2f}. Signs remove the keys' shared "
      f"mean, but at E/W = {E // 4} the error is still {signed[4]:.0f} key variances. (Lemma 2 assumes independent "
      "hashes and zero-mean items; the library's hash and these keys are neither, so the match may be partly luck.)")

# %% [markdown]
# **Go further**: [labs/06_kvreviver_failure.ipynb](labs/06_kvreviver_failure.ipynb) takes the failure apart:
# the attention picture, wider sketches, one part changed at a time, the memory and the decode time.
