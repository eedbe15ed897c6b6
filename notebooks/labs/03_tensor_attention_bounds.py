# %% [markdown]
# # 03 Lab: tensor attention's memory bound, an approximate cache, and pair eviction
#
# The lab of [the tensor-attention lesson](../03_tensor_attention.ipynb), which builds one decode step by
# hand, measures the four-matrix and two-matrix caches and trains the Match3 models. Here, the research
# around it (symbols as in the lesson and [the book's table](../README.md); metrics: [glossary](../README.md#metrics)):
#
# 1. the memory lower bound of Theorem 4.1 in a small experiment (the Index problem);
# 2. SubGen-style clustering and sampling as an approximate cache: error against memory;
# 3. whether dropping tokens or dropping pairs is the better use of a compressed tensor cache's bytes, on the
#    bundled Match3 tensor model;
# 4. the Match3 models' accuracy by position, drawn with intervals, their training curves, and greedy decoding
#    through each layout.
#
# Code: `methods/tensor_attention/index_problem.py`, `methods/tensor_attention/subgen.py`,
# `methods/tensor_attention/attention.py`.

# %% tags=["setup"]
from preamble import TINY

from methods.tensor_attention import match3

tensor_model, tensor_card = match3.load("match3-tensor")      # the lesson's section 3 model (section 3 here)

# %% [markdown]
# ## 1. The memory lower bound, run: the Index problem
#
# Theorem 4.1 says an exact four-matrix cache needs Omega(n d) bits ($n$: the paper's count of cached tokens, the
# lesson's $T$). The proof is a reduction from the
# Index problem (Lemma 3.11): Alice holds n bits, writes a cache from them; Bob, given any index j, builds
# a query and reads x_j off one attention output. Then the cache is a message that tells Bob every bit, so
# it holds at least n bits; with a value coordinate per bit (d bits a token; the argument is in
# `methods/tensor_attention/README.md`, "The Index problem") the same reduction gives n d. This run stores one
# bit a token, so it shows the n. Its keys have d = ceil(4 log2 n) coordinates, 28 for n = 128: the paper's
# regime d >= C log n, enough for random +-1 keys to tell every pair apart.
# `methods/tensor_attention/index_problem.py` builds such a cache (random +-1 keys, the pair
# (j, j) wins Bob's softmax, the bits sit in V1) and compresses it two ways: keep k of the n token rows, or
# let groups of g tokens share one majority sign. Bob's accuracy against the bits the cache keeps, with the
# information limit from Fano's inequality (no s-bit cache can be right on more than this fraction):

# %%
import matplotlib.pyplot as plt
import torch

from experiments.evaluation.intervals import wilson
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
ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.02, 1.0))
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# The figure shows Bob's accuracy against the bits each compressed cache keeps, with 95% intervals, under the
# Fano limit (solid) and the store-and-guess line (dotted). Keeping token rows lies on the dotted line: it
# stores some bits verbatim and guesses the rest. Sharing a majority sign lies above it: a lossy code beats
# storing bits verbatim, and still stays under Fano's limit. The numbers (`param` is the share of token rows
# kept, or the group size g; `expected` the accuracy each scheme has in expectation, 1/2 + s/(2n) for kept
# rows, the chance that a bit agrees with its group's majority for groups):

# %%
for r in rows5:
    print(f"{r['scheme']:>8} {r['param']:>6}: {r['bits']:>4} bits -> accuracy {r['accuracy']:.3f} "
          f"(expected {r['expected']:.3f}, Fano limit {r['fano']:.3f})")

# %% [markdown]
# Both compressed caches stay under the limit, up to the spread of a finite sample (at s = 0 and s = N the
# expected accuracy *is* the limit, so a measured mean could sit a hair above it), and the limit is a straight
# consequence
# of counting: to be right on a fraction p of the n bits a cache needs at least n (1 - H(p)) bits, linear in n.
# This is an illustration of the theorem, not a proof of it (the proof must handle any cache, any query scheme);
# and it shows the four-matrix side only. The two-matrix bound (Omega(n^2 d), Theorem 4.2) is about caches that
# must answer for arbitrary pair rows, which a cache made of n token factors never stores.

# %% [markdown]
# ## 2. SubGen: an approximate cache when the keys cluster
#
# The lower bounds are for worst-case keys. When keys cluster, SubGen (Zandieh et al. 2024,
# [arXiv 2402.06082](https://arxiv.org/abs/2402.06082); used for tensor attention in §5.1 of the paper,
# SubGen4Cache / SubGen2Cache) keeps a few sampled keys per cluster to estimate the softmax normaliser and
# a norm-weighted sample of values for the numerator. `methods/tensor_attention/subgen.py` streams a tensor cache's
# pair rows through such a sketch, on a synthetic instance made to cluster (n = 32 tokens, d = 16, keys of
# each factor drawn around 3 centres, so about 9 clusters of pairs; not the Match3 model). Its error against
# the exact output vs the bytes the sketch keeps; the second line divides the error by
# `||softmax(K~ q)||_2 ||V~||_op` instead of `||o||`, the scale of the paper's guarantee (SubGen's error is
# at most eps times that product), so it reads as the eps the sketch reached:

# %%
import matplotlib.ticker

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
ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.02, 1))     # beside the data
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
# ## 3. Compressing a tensor cache: drop tokens, or drop pairs?
#
# Evicting a *token* from a four-matrix cache removes its rows of K1, V1 and K2, V2: a whole row *and*
# column of the pair matrix $Z$ (its probabilities are `P` in the code below). Only the two-matrix cache can
# drop single *pairs*. Which is the better use of a byte? Keeping k tokens costs 4 k d numbers and keeps k^2
# pairs; the same bytes hold only 2k pair
# rows of the two-matrix cache. On the trained Match3 model (layer 1, the second and last, the query that
# decides the last
# label, 64 sequences; the lesson's section 3 trains and bundles it), with an *oracle* choice for both
# (the tokens with the most attention mass, the pairs with the most), relative error of the attention
# output at equal bytes:

# %%
import math

from methods.tensor_attention import four_cache_attention, pair_scores, pair_softmax

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

# %% [markdown]
# Then, for each budget of k tokens, the output from the k tokens with the most pair mass against the output
# from the 2k pairs with the most mass, each as a relative error:

# %%
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
    err = lambda o: ((o - exact).norm(dim=-1) / exact.norm(dim=-1))[..., 0].mean(0)    # H,
    rows.append((k_tok, n_pairs, err(out_tok), err(out_pair)))
ranked = P.flatten(-2).sort(-1, descending=True).values.cumsum(-1)
half = ((ranked < 0.5).sum(-1) + 1).float().median(0).values                # (H,) pairs to reach half the mass
print(f"T = {T_} tokens, {T_ * T_} pairs; pairs holding half the attention, median per head: "
      f"{[int(h) for h in half]}")
print("relative error of the output at equal bytes (4 k d numbers), per head:")
for k_tok, n_pairs, e_tok, e_pair in rows:
    print(f"  keep {k_tok:>2} tokens ({k_tok * k_tok:>3} pairs): {[round(e, 2) for e in e_tok.tolist()]}   "
          f"keep {n_pairs:>2} pairs: {[round(e, 2) for e in e_pair.tolist()]}")

# %% [markdown]
# Dropping tokens wins at equal bytes in every head once k >= 4: k kept tokens keep k^2 pairs for the bytes of
# 2k pair rows, and this model's attention is spread (half of a head's mass takes 42-148 pairs, except in the
# concentrated head). Pairs win only at the smallest budget (k = 2), in two heads: the concentrated one (half
# its mass in 3 pairs; error 0.68 vs 1.14) and the second head (1.77 vs 2.36). Errors above 1 are possible:
# the error is relative to the exact output's length, and a few kept pairs can land farther from the exact
# output than that. The two-matrix cache's finer granularity does not pay for its bytes here; it
# would for attention that puts
# its mass on a handful of pairs. (Both choices are oracles that know the attention; a real policy must
# estimate it, as H2O or SnapKV do for tokens.)

# %% [markdown]
# ## 4. Match3 by position, training curves, and greedy decoding through each layout
#
# The lesson's section 3 prints the two Match3 models' overall accuracy; here it is split by position, with 95%
# intervals (Wilson's, for a proportion), on the lesson's fresh sequences. Early positions are easy (few pairs:
# mostly NO), late ones too (many pairs: mostly YES); the middle is where a model must find the pair. In a
# sequence `BOS x_1 L_1 x_2 L_2 ...` the number $x_i$ sits at an odd position and its label at the next, even
# one, so the model's output at the odd positions (`[:, 1::2]`) is compared with the tokens at the even ones
# (`[:, 2::2]`):

# %%
from methods.tensor_attention import LAYOUTS

standard_model, standard_card = match3.load("match3-standard")
n_eval = 200 if TINY else 2000                              # fresh sequences, as in the lesson
ids, _ = match3.batch(n_eval, match3.N_NUMBERS, seed=10**6)
truth = ids[:, 2::2]                                        # (sequences, numbers): the true labels
yes = (truth == match3.YES).float().mean(0)
positions = torch.arange(1, match3.N_NUMBERS + 1)
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(positions, torch.maximum(yes, 1 - yes), "k--", label="majority per position")
for shift, (name, m) in zip((-0.08, 0.08), (("tensor", tensor_model), ("standard", standard_model))):
    with torch.no_grad():
        acc = (m(ids).argmax(-1)[:, 1::2] == truth).float().mean(0)
    lo, hi = (torch.tensor(v) for v in zip(*(wilson(a, len(ids)) for a in acc.tolist())))
    ax.errorbar(positions + shift, acc, yerr=[acc - lo, hi - acc], fmt="o-", capsize=2, label=f"{name} attention")
ax.set(xlabel="position i of the number", ylabel="label accuracy (95% interval)",
       title="Match3 (mod 32), by position", xticks=positions.tolist())
ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# The figure shows the teacher-forced label accuracy at each position, blue for the tensor model
# and orange for the standard one, with 95% intervals as error bars, and the majority guess dashed: the
# intervals lie apart from the fourth position on, and overlap at the first three, where both models are
# nearly always right.
#
# Would a longer training budget help either model? Each card holds its training curve, `card["history"]`: one
# entry `{"step", "loss", "accuracy"}` every tenth of the training, the accuracy on fewer fresh sequences than
# the card's own (`match3.train` calls `accuracy(model, n_seq=500)`), so the last entry differs a little from
# the card. The curves, and each model's gain over the second half of training:

# %%
for name, card in (("tensor", tensor_card), ("standard", standard_card)):
    curve = card["history"]
    half = {h["step"]: h["accuracy"] for h in curve}[card["steps"] // 2]
    print(f"{name:>8}: " + " ".join(f"{h['accuracy']:.3f}" for h in curve) + f" at steps {curve[0]['step']}, "
          f"{curve[1]['step']}, ..., {curve[-1]['step']}; gain since step {card['steps'] // 2}: "
          f"{curve[-1]['accuracy'] - half:+.3f}; card, {card['eval_sequences']} sequences: {card['accuracy']:.3f}")

# %% [markdown]
# The standard model's curve is almost flat over its second half, the tensor model's still climbs: a longer
# budget would more likely help the tensor model. Both ran with a learning rate that decays to zero along a
# cosine, so every curve flattens late; the flat curve is weak evidence. A flat curve makes a late catch-up of
# standard attention
# unlikely but cannot rule it out; only a longer run answers that
# (`python -m methods.tensor_attention.match3 train --attention standard --steps 10000 --out runs/m3-long`, then
# `python -m methods.tensor_attention.match3 eval runs/m3-long match3-tensor`).
#
# Greedy decoding reads the model's *own* labels back (not the true ones, as the teacher-forced figure
# did), through each cache layout: `four` (the four factor matrices), `four-naive` (the same, building every
# pair row at each step) and `two` (the two pair matrices). All three give the same labels (they compute the
# same numbers, up to float rounding that never flips an argmax here), right or wrong: in the example below
# the eighth label is wrong in each.

# %%
import random

xs = torch.tensor([match3.random_numbers(match3.N_NUMBERS, random.Random(s)) for s in range(64)])
decoded = {layout: match3.greedy_labels(tensor_model, xs, layout) for layout in LAYOUTS}
print("identical labels for every layout:", all(torch.equal(v, decoded["four"]) for v in decoded.values()))
example = xs[0].tolist()
print("numbers:", example)
print("truth:  ", ["Y" if t == match3.YES else "n" for t in match3.labels(example)])
print("decoded:", ["Y" if t == match3.YES else "n" for t in decoded["two"][0].tolist()])
