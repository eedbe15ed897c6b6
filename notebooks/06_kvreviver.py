# %% [markdown]
# # 06 KVReviver: evicted tokens in a count sketch, revived for every attention
#
# Yuan et al., "KVReviver: Reversible KV Cache Compression with Sketch-Based Token Reconstruction",
# [arXiv 2512.17917](https://arxiv.org/abs/2512.17917).
#
# **Before this lesson**: read [01_baselines](01_baselines.ipynb) first. This lesson compares KVReviver with
# its eviction baselines (StreamingLLM, H2O, SnapKV) in its two modes (the question in the prompt, or after
# the context), and prints the course's metrics (acc, KL, pert, lost, keep ratio, KV KiB), defined in the
# [metrics glossary](README.md#metrics). The shared symbols ($T$, $d$, $H_{kv}$, $k_n$, $v_n$, $B$) are those
# of the [book's notation table](README.md).
#
# **The question.** An evicting method forgets: a dropped token cannot answer a question asked about it
# later, when the context was compressed before the question arrived. The paper calls this *contextual
# amnesia*. KVReviver keeps the newest tokens (*Recent*) and the most-attended ones (*Candidate*) raw, and
# adds every other token into a small *count sketch* (*Vague*), from which each attention rebuilds an
# approximation of all of them. The paper reports near-full accuracy at 10-25% budgets where eviction fails.
# Does the sketch bring forgotten tokens back?
#
# **You will learn** what a count sketch is and how KVReviver uses one (built by hand, checked against
# `methods/kvreviver.py`); how its error grows with the tokens per cell, for values and for keys; what the
# key error does to attention; and the accuracy and memory, on the bundled model and on SmolLM2-135M.

# %% tags=["setup"]
from preamble import TINY

from nanollm import load

model, tok, card = load("retrieval-llama")     # the bundled model (notebook 00): 4 layers, 4 query heads, 2 KV heads

# %% [markdown]
# ## 1. The count sketch, and KVReviver's
#
# ### 1.1 A count sketch
#
# A count sketch (Charikar, Chen and Farach-Colton, 2002) keeps many items, each adding a number to its own
# total, in a small fixed table of $R$ rows of $W$ cells (buckets), and answers "what is item $J$'s total?"
# approximately. Each row $i$ has two hash functions of the item: a *bucket hash* $c_i(J)$, which picks one
# of the row's cells, and a *sign hash* $g_i(J) = \pm 1$. The lesson's own symbols (the shared ones are in
# the [book's notation table](README.md); this lesson's $R$, $W$, $E$, $C$ are its own):
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $R$, $i$ | rows of the sketch, and one of them (here: not a count of Recent tokens) | `rows`, `i` |
# | $W$ | cells (buckets) per row: the sketch's width | `width`, `W` |
# | $N = R W$ | cells in all | |
# | $J$ | an item: a token, named by its position | `J`, `pos` |
# | $c_i(J)$ | row $i$'s bucket hash: the cell of $J$ in row $i$, from 0 to $W - 1$ | `h`, `buckets` |
# | $g_i(J)$ | row $i$'s sign hash, $+1$ or $-1$ | `g`, `signs` |
# | $u_J$, $\hat u_J$ | the number item $J$ adds, and the sketch's estimate of it | |
# | $C[i, c]$ | the number in cell $c$ of row $i$ | |
# | $E$ | items (tokens) in the sketch (the paper's $m$) | `E` |
# | $\sigma^2$ | the items' mean square, the mean of $u_J^2$ | |
# | $\varepsilon$, $\delta$ | the guarantee's error (a fraction of $\lVert u \rVert_2$), its failure probability | |
# | $k_J$, $v_J$ | token $J$'s key and value, $d$ numbers each | `k`, `v` |
# | $C^K$, $C^V$ | KVReviver's cells: sums of keys, signed sums of values | `cell_k`, `cell_v` |
# | $\hat k_J$, $\hat v_J$ | the key and value the sketch gives back for $J$ | `est_k`, `est_v` |
# | $\hat v_{J,j}$ | coordinate $j$ of $\hat v_J$ | |
# | $\sigma_v^2$ | a value coordinate's variance over the tokens | `v.var(0)` |
#
# Item $J$ adds $g_i(J)\,u_J$ to its cell in every row; a query reads its $R$ cells back, undoes the sign,
# and takes the median:
#
# $$C[i, c_i(J)] \mathrel{+}= g_i(J)\,u_J \ \text{ for every row } i, \qquad
# \hat u_J = \operatorname{median}_i\ g_i(J)\,C[i, c_i(J)]$$
#
# **Its error.** Row $i$ reads $u_J$ plus every other item in $J$'s cell, each times a random sign. So a
# row's error is zero on average, and its variance is the sum of the other items' $u^2$ over $W$ (another
# item lands in $J$'s cell with probability $1/W$): with $E$ items of mean square $\sigma^2$, about
# $(E/W)\,\sigma^2$. Without signs the errors would not cancel: a row would read $u_J$ plus the plain sum of
# its neighbours, too large on average.
#
# **Median or mean.** The mean of the $R$ rows has $R$ times less variance, but one row where $J$ shares its
# cell with a large item spoils it. The median is far off only when half of the rows are, which gets
# exponentially unlikely as $R$ grows. The classic guarantee: pick an error $\varepsilon$ you accept, as a
# fraction of the norm $\lVert u \rVert_2 = (\sum_J u_J^2)^{1/2}$ of all the items, and a failure probability
# $\delta$; with $W \sim 1/\varepsilon^2$ cells per row and $R \sim \log(1/\delta)$ rows, $\hat u_J$ is within
# $\varepsilon \lVert u \rVert_2$ of $u_J$ with probability at least $1 - \delta$.
#
# ### 1.2 KVReviver's sketch: insert, and a median query
#
# KVReviver's Vague part is a count sketch of $R = 3$ rows whose cells hold a key and a value ($d$ numbers
# each, for every KV head). Inserting token $J$ (Algorithm 1) adds its key, and its value times its sign, to
# its cell in every row; querying it (Algorithm 2) takes the element-wise median of its cells over the rows,
# the value times the sign again:
#
# $$C^K[i, c_i(J)] \mathrel{+}= k_J,\quad C^V[i, c_i(J)] \mathrel{+}= g_i(J)\,v_J \qquad\qquad
# \hat k_J = \operatorname{median}_i C^K[i, c_i(J)],\quad \hat v_J = \operatorname{median}_i\, g_i(J)\,C^V[i, c_i(J)]$$
#
# Values are a count sketch as in section 1.1. Keys get no sign (the paper: the softmax would not keep them
# unbiased anyway), so a key's error is a plain sum of other keys. A toy: six tokens with keys 1 to 6 and
# values 10 to 60, in 3 rows of 4 cells.

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
# The figure shows where each token lands: a cell lists its tokens, each with its sign in that row, and
# the orange shade counts them (white: empty). With six tokens in four cells some cells are shared: tokens
# 1 and 4 sit alone in all three rows, token 2 in one row only, and tokens 0, 3 and 5 share a cell in every
# row. Insert and query written out, then checked against the library's `VagueSketch`:

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
# The library agrees. Tokens 1 and 4, alone in at least two rows, come back exactly: the median of
# `{x, x, x + error}` is `x`. Token 2 is alone in one row and its key comes back one too large. Tokens 0,
# 3 and 5 share every cell: their keys come back too large (a sum of other keys), their values off in
# either direction, token 3's with the wrong sign.
#
# ## 2. Reconstruction error vs tokens per cell
#
# With $E$ tokens in $W$ cells a row, one row's value error has variance about $(E/W)\,\sigma_v^2$
# (section 1.1), and the median of three rows about 0.448 times that (the paper's Lemma 2: the median of
# three normal variables). The paper's bound (its Mathematical Analysis section; likewise for keys), with
# $N = R W$ cells:
#
# $$\Pr\left(\operatorname{Var}(\hat v_{J,j}) > \frac{E\pi}{N}\,\sigma_v^2\right) <
# \exp\left(-\frac{E}{N}\right)$$
#
# Measured on real keys and values: the first 128 tokens of layer 2 of the bundled model on one prompt,
# relative to their per-coordinate variance, for sketches of 3 rows and several widths $W$.

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
widths = [4, 8, 16, 32, 64, 128, 256]                       # W
err = {}                                                    # W -> (value error, key error): MSE / variance
for W in widths:
    runs = []
    for seed in range(5):                                   # five draws of the hashes
        s = VagueSketch(3, W, k.shape[1], k.shape[2], seed=seed)
        s.insert(torch.arange(E), k, v)
        kh, vh = s.query(torch.arange(E))
        runs.append((float(((vh - v) ** 2).mean() / v.var(0).mean()),
                     float(((kh - k) ** 2).mean() / k.var(0).mean())))
    err[W] = tuple(sum(x) / 5 for x in zip(*runs))


# %% tags=["needs:insert", "needs:query"]
import math

x = torch.tensor([E / W for W in widths])                   # tokens per cell
fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
for j, (ax, name) in enumerate(zip(axes, ["values (signed)", "keys (summed, no signs)"])):
    ax.loglog(x, [err[W][j] for W in widths], "o", label="measured, median of 3 rows")
    ax.loglog(x, 0.448 * x, "--", label="0.448 E/W (Lemma 2)")
    ax.loglog(x, math.pi * x / 3, "-", lw=0.8, label="E pi / N (the bound, N = 3W)")
    ax.set(title=name, xlabel="tokens per cell E / W", ylabel="MSE / per-coordinate variance")
fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3)
plt.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()
print(f"E = {E} tokens: at E/W = 32 (W = 4) values {err[4][0]:.2f} (Lemma 2: {0.448 * 32:.2f}) and keys "
      f"{err[4][1]:.2f}; at E/W = 1 (W = 128) values {err[128][0]:.2f} (Lemma 2: {0.448:.3f}), keys {err[128][1]:.2f}")


# %% [markdown]
# The figure shows the measured error (dots) against Lemma 2 (dashed) and the bound (solid), values left,
# keys right. The value errors follow Lemma 2 (about 0.448 E/W of the variance) and stay under the bound.
# The key errors grow far faster, with the square of E/W once a cell holds more than a few tokens: an
# unsigned sum also carries the mean all keys share, E/W times over.
#
# ## 3. What the key error does to attention
#
# KVReviver shares a budget of $B$ slots per layer (and KV head) out as the paper's Tables 2-3 do: 45% to
# Recent, 45% to Candidate, 10% to the sketch's cells. After each step (Algorithm 3) Recent's oldest token
# moves to Candidate, Candidate's lowest-scored (by accumulated attention) into the sketch, and a sketched
# token whose score beats Candidate's lowest times a margin (the paper's *ReplaceRate*) is revived into
# Candidate. Before each attention (Algorithm 4) the layer's cache is rebuilt for every position: raw from
# Recent and Candidate, from the sketch for the rest (`policy.attend_kv`). With a quarter of our prompt as
# budget, per layer: the tokens of each part, and the mean length of the rebuilt keys beside the real ones.

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
# The sketch's 12 cells hold 348 tokens, and the rebuilt keys are tens of times longer than real ones.
# What does that do to attention? `harness.traces` runs the prompt, then the reference answer one token at
# a time, through the full cache and through KVReviver (question after the context), keeping every head's
# attention weights.

# %% tags=["needs:insert", "needs:query"]
from methods.analysis.rebuilt_attention import rebuilt_mask
from methods.evaluation.harness import traces

L, G, H = model.config.n_layer, model.config.group_size, model.config.n_head
full_tr, kvr_tr = traces(model, sample, "question_after_context",
                         [None, make_policy("kvreviver", LENGTH // 4)], [True, True])
red = torch.cat([rebuilt_mask(kvr_tr, l).repeat_interleave(G, 0) for l in range(L)])   # (L * H, T): rebuilt


# %% tags=["needs:insert", "needs:query"]
from matplotlib.colors import LogNorm

fig = plt.figure(figsize=(11, 5.6))
layout = fig.add_gridspec(2, 3, width_ratios=[40, 1, 1], wspace=0.3, hspace=0.3)      # two panels, two colour bars
axes = [fig.add_subplot(layout[0, 0])]
axes.append(fig.add_subplot(layout[1, 0], sharex=axes[0]))
norm = LogNorm(1e-4, 1)
for ax, (name, tr) in zip(axes, [("full cache", full_tr), (f"KVReviver, {LENGTH // 4} slots", kvr_tr)]):
    p = torch.cat([tr.probs[l] for l in range(L)])                                     # (L * H, T)
    raw_im = ax.imshow(torch.where(red, float("nan"), p).numpy(), aspect="auto", cmap="Blues", norm=norm,
                       interpolation="nearest")
    red_im = ax.imshow(torch.where(red, p, float("nan")).numpy(), aspect="auto", cmap="Reds", norm=norm,
                       interpolation="nearest")
    ax.set_yticks([l * H + (H - 1) / 2 for l in range(L)], [f"layer {l}" for l in range(L)])
    ax.set(title=f"{name}: attention of the first answer token", ylabel="query heads")
axes[0].tick_params(labelbottom=False)
axes[-1].set_xlabel("key position (context, then question)")
fig.colorbar(raw_im, cax=fig.add_subplot(layout[:, 1]), label="attention, raw entry")
fig.colorbar(red_im, cax=fig.add_subplot(layout[:, 2]), label="attention, rebuilt entry")
plt.show()


# %% [markdown]
# The figure shows each query head's attention (rows, four per layer) from the first answer token to every
# key position: blue where KVReviver keeps the entry raw, red where it rebuilds it from the sketch; darker
# is more, white below 1e-4. Both panels colour the same positions, so the full cache's red part shows what
# those tokens got before compression: attention spread over the context in shades. In KVReviver most
# heads give the rebuilt entries nothing (white over the red part: as good as evicted), and a few give them
# nearly everything, in stripes: tokens that share all their cells get the same rebuilt key (the lab counts
# this over one prompt per task). Per head it is all or nothing: the logit of a rebuilt key is about the sum
# of its cell's tokens' logits, so its size makes the softmax all or nothing, and its sign decides which.
#

# ## 4. Contextual amnesia: the question after the context
#
# The context is compressed first; the question arrives later through `extend`. `compare.run` answers every
# task's prompts with each method at each budget, one record per method, budget and task (`format_tables`
# prints them; the metrics are in the [metrics glossary](README.md#metrics)). KVReviver against the full
# cache, H2O, StreamingLLM and SnapKV (notebook 01), at the same slot budgets:

# %% tags=["needs:insert", "needs:query"]
from methods.evaluation.compare import run

TASKS = card["default_suite"][:1] if TINY else card["default_suite"]    # the bundled model's six tasks
SAMPLES = 1 if TINY else 5                                     # prompts per task
KEEP_RATIOS = [0.25] if TINY else [0.1, 0.25, 0.5]
budgets = [max(1, round(r * LENGTH)) for r in KEEP_RATIOS]     # B: slots per layer and KV head
records = run(model, tok, ["kvreviver", "h2o", "streaming_llm", "snapkv"], budgets, TASKS,
              ["question_after_context"], SAMPLES, LENGTH, progress=False)


# %% tags=["needs:insert", "needs:query"]
from methods.evaluation.intervals import describe, paired_difference


def per_task(records, method, ratio):    # per task, the per-sample accuracies (what paired_difference resamples)
    return [r["accuracies"] for r in sorted((r for r in records if r["method"] == method
                                             and abs(r["keep_ratio"] - ratio) < 0.005), key=lambda r: r["task"])]


# %% [markdown]
# The table gives each task's accuracy and the KL; under it, KVReviver minus H2O with a paired interval
# (`paired_difference`: each task's prompts resampled). Its `vs best`
# compares each row with its keep ratio's most accurate method: the p-value of an exact paired test, `tie`
# where the test cannot tell the two apart. SnapKV keeps every token after the prompt on top of its budget
# (notebook 01), hence its larger `KV KiB`.

# %% tags=["needs:insert", "needs:query"]
from methods.evaluation.compare import format_tables

print(format_tables(records))
for keep in KEEP_RATIOS:
    print(f"keep {keep}: KVReviver - H2O accuracy "
          f"{describe(*paired_difference(per_task(records, 'kvreviver', keep), per_task(records, 'h2o', keep)))}")


# %% [markdown]
# KVReviver answers no question after the context at any keep ratio. At keep 0.1 no method answers much
# and KVReviver is within noise of H2O; at 0.25 and 0.5 it is below H2O (0.69 and 0.85), distinguishable
# (the paired interval excludes 0), and there its KL from the full cache is the largest of the four. The
# sketch does not cure contextual amnesia on this model. (Is the sketch too small? The lab widens it: only
# far wider sketches than the paper's split bring accuracy back.)
#
# ## 5. The memory
#
# KVReviver's memory is its raw slots plus the small sketch, and a score per token; but every attention also
# rebuilds every evicted position into a transient cache. For the compressed prompt of section 3:

# %% tags=["needs:insert", "needs:query"]
print(f"KVReviver, {LENGTH // 4} slots per layer, {len(sample.context_ids)}-token context:")
print(f"  raw K/V slots (Recent + Candidate): {cache.nbytes() / 1024:7.1f} KiB")
print(f"  sketch cells:                       {policy.slot_nbytes() / 1024:7.1f} KiB")
print(f"  per-token score tables (extra):     {policy.extra_nbytes() / 1024:7.1f} KiB")
print(f"  transient rebuilt cache (1 layer):  {policy.rebuilt_nbytes / 1024:7.1f} KiB")
print(f"  full cache, all layers:             {full.nbytes() / 1024:7.1f} KiB")


# %% [markdown]
# The stored part is about a quarter of the full cache, but the transient rebuilt cache of one layer is as
# large as all the raw slots. Rebuilding and attending over every position at every step also costs time:
# the paper measures decoding about 2x slower than the full cache; the lab times it here.
#
# ## 6. On a pretrained model: SmolLM2-135M
#
# The bundled model is small and trained on these tasks alone. SmolLM2-135M-Instruct is pretrained; its
# full cache answers two tasks at 512 tokens: `passkey` (a numeric key in repeated filler) and
# `niah_single_docs` (a needle in real documents). The paper reports full-cache accuracy with 10% of the
# budget on 2k-token contexts. Here: keep ratios 0.1 and 0.25, the question in the prompt and after the
# context, against H2O and StreamingLLM.

# %% tags=["needs:insert", "needs:query"]
real, real_tok, _ = load("smollm2-135m")
LENGTH_REAL, SAMPLES_REAL = (256, 1) if TINY else (512, 3)            # tokens; prompts per task and mode
TASKS_REAL = ["passkey"] if TINY else ["passkey", "niah_single_docs"]
MODES_REAL = ["question_after_context"] if TINY else ["question_in_prompt", "question_after_context"]
KEEP_REAL = [0.25] if TINY else [0.1, 0.25]
real_records = run(real, real_tok, ["kvreviver", "h2o", "streaming_llm"], [round(k * LENGTH_REAL) for k in KEEP_REAL],
                   TASKS_REAL, MODES_REAL, SAMPLES_REAL, LENGTH_REAL, progress=False, workers=1)


# %% [markdown]
# The table is the question after the context; under it, KVReviver minus the full cache in both modes, with
# its paired interval, as in section 4.

# %% tags=["needs:insert", "needs:query"]
print(format_tables([r for r in real_records if r["mode"] == "question_after_context"]))
for mode in MODES_REAL:
    in_mode = [r for r in real_records if r["mode"] == mode]
    for keep in KEEP_REAL:
        print(f"{mode}, keep {keep}: KVReviver - full cache accuracy "
              f"{describe(*paired_difference(per_task(in_mode, 'kvreviver', keep), per_task(in_mode, 'full', 1.0)))}")


# %% [markdown]
# KVReviver answers no question, in either mode, at either budget (0.00, below the full cache's 1.00,
# distinguishable: the paired interval excludes 0), where StreamingLLM reaches 0.67 at keep 0.25. The
# paper's claim is **not reproduced** here. Caveats: 512-token contexts (the paper: 2k and 32k), a 135M
# model, 3 prompts per task and mode. The paired intervals are one point, -1.00 [-1.00, -1.00], because
# KVReviver misses every answer the full cache gets, so resampling the prompts never changes the difference.
#
# ## 7. What this says at our scale
#
# * For **values** the sketch behaves as its analysis says: signed sums, an error near 0.448 E/W of the
#   variance (section 2).
# * **Keys** break it: summed without signs, they rebuild tens of times too long, and each head's attention
#   to the sketch is all or nothing (section 3).
# * So KVReviver does **not** cure contextual amnesia here, on the bundled model (section 4) or on SmolLM2
#   (section 6); the lab takes the failure apart.

# %% [markdown]
# ## Exercises
#
# Each exercise has a cell where you write (replace the `None`), a check cell that reads only your answer
# (it says "not answered yet" until you do, stops with a hint when the answer is wrong, and says "right"
# when it is), and the reference answer, collapsed: open it once you are done.
#
# ### Exercise 1: which tokens come back exactly?
#
# In section 1 the tokens alone in their cell in at least two rows came back exactly. Check that rule on a
# bigger sketch: 48 tokens of a long context, with positive keys, in 3 rows of 64 cells. From the buckets
# alone (`h_big`), without reading any cell, predict which keys the sketch returns exactly: count the tokens
# in each row's cells, call a token *alone* in a row where its cell holds one token, and predict "exact" where
# it is alone in at least two of the three rows. Write `my_exact`, one bool per token. Then, in a sentence:
# why does the rule hold for positive keys, and not for values?

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
      f"{int((values_exact & ~reference_exact).sum())} of them not alone in two rows. Positive keys: a shared cell "
      "always reads too much, so the median needs two lone rows. Signed values: two shared rows' errors can fall "
      "on both sides of v_J (the median is the lone row) or cancel.")

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
print(f"signed keys: {signed[4]:.2f} at W = 4, {signed[128]:.2f} at W = 128; section 2's unsigned (5 seeds): "
      f"{err[4][1]:.2f} and {err[128][1]:.2f}; Lemma 2, 0.448 E/W: {0.448 * E / 4:.2f} and {0.448 * E / 128:.2f}")
print("Signs help: the keys' shared mean no longer adds up E/W times over, and they follow Lemma 2 as values do. "
      f"Not enough: at E/W = {E // 4} the error is still {signed[4]:.0f} key variances, and the paper's split "
      "puts hundreds of tokens in a cell (the lab's section 3.1).")

# %% [markdown]
# ### Exercise 3: a mean instead of a sum
#
# Store the *mean* of a cell's tokens instead of their sum: keep a count per cell and divide each cell's key
# sum by it before the query. `mean_cell_keys` below is a copy of the key sketch of `key_error` that returns
# the estimated keys, for you to change. Write `my_mean_key_ratio`, the mean length of the estimated keys
# over the mean length of the real ones (`norm_ratio`), at $W = 4$ (`seed=0`). Then, in a sentence: why is
# such a sketch no longer a count sketch?

# %% tags=["needs:insert", "needs:query"]
def mean_cell_keys(k, width, seed=0):
    """A copy of key_error's sketch, to change: divide each cell's key sum by its token count (an empty cell
    stays 0) before the query. Returns the estimated keys, (E, H_kv, d)."""
    s = VagueSketch(3, width, k.shape[1], k.shape[2], seed=seed)
    s.insert(torch.arange(len(k)), k, torch.zeros_like(k))
    est_k, _ = s.query(torch.arange(len(k)))
    return est_k


def norm_ratio(est_k):                  # the estimates' mean length over the real keys' mean length
    return float(est_k.norm(dim=-1).mean() / k.norm(dim=-1).mean())


print(f"sums (KVReviver's cells), W = 4: the rebuilt keys are {norm_ratio(mean_cell_keys(k, 4)):.1f}x as long")
my_mean_key_ratio = None               # replace None: norm_ratio(mean_cell_keys(k, 4)), once the cells hold means

# %% tags=["needs:insert", "needs:query"]
@exercise("Exercise 3")
def check_mean_key_ratio(ratio):
    pos, flat = torch.arange(E), k.reshape(E, -1)
    s = VagueSketch(3, 4, k.shape[1], k.shape[2], seed=0)
    h, g = s.buckets(pos), s.signs(pos)
    count = torch.nn.functional.one_hot(h, 4).sum(1).clamp(min=1)                # (R, W): tokens per cell
    cell_k, cell_v = sketch_insert(h, g, flat, flat, 4)
    sums, _ = sketch_query(cell_k, cell_v, h, g)
    means, _ = sketch_query(cell_k / count[..., None], cell_v, h, g)
    truth = norm_ratio(means.view_as(k))
    assert abs(ratio - norm_ratio(sums.view_as(k))) > 1e-4 * truth, \
        "that is the length of the sums: divide each cell by the number of tokens in it before the query"
    assert abs(ratio - truth) <= 1e-4 * truth, "divide each cell by its own count of tokens (cells hold " \
        "different numbers), not by the average E/W; count them with a second sketch of ones or from s.buckets"


check_mean_key_ratio(my_mean_key_ratio)

# %% tags=["needs:insert", "needs:query"]
# BEGIN SOLUTION [kvreviver] count with a second VagueSketch of ones (same seed), then s.key /= count before query
def reference_mean_keys(k, width, seed=0):
    s = VagueSketch(3, width, k.shape[1], k.shape[2], seed=seed)
    s.insert(torch.arange(len(k)), k, torch.zeros_like(k))
    count = VagueSketch(3, width, 1, 1, seed=seed)                        # same hashes: tokens per cell
    count.insert(torch.arange(len(k)), torch.ones(len(k), 1, 1), torch.zeros(len(k), 1, 1))
    s.key /= count.key.clamp(min=1)                                       # (R, W, H_kv, d) / (R, W, 1, 1)
    return s.query(torch.arange(len(k)))[0]


reference_mean_key_ratio = norm_ratio(reference_mean_keys(k, 4))
# END SOLUTION
check_mean_key_ratio(reference_mean_key_ratio)
print(f"means, W = 4: {reference_mean_key_ratio:.2f}x the real keys' length. A cell's mean is an average key, "
      "pulled to the keys' common mean. Not a count sketch: a mean is not linear in the tokens (a revived token "
      "cannot simply be subtracted), and a signed value's mean gives back v_J / count plus noise, biased.")

# %% [markdown]
# **Go further**: [labs/06_kvreviver_failure.ipynb](labs/06_kvreviver_failure.ipynb) takes the failure apart:
# which tokens stay raw and where the attention goes, on both models; the Recent / Candidate rule without the
# sketch, per layer and per KV head, and wider sketches, against H2O on the bundled model; the decode time;
# one part of KVReviver changed at a time under language modelling (true keys and values, no swaps, wider
# sketches, the appendix's per-layer budgets, a repair of ours); and Lemma 2 measured at the paper's own
# setting.
