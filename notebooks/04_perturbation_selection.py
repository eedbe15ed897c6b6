# %% [markdown]
# # 04 CriticalKV: perturbation-constrained selection
#
# SnapKV keeps the entries the observation window attends to most. Feng et al. ("Identify Critical KV Cache
# in LLM Inference from an Output Perturbation Perspective",
# [arXiv 2502.03805](https://arxiv.org/abs/2502.03805)) ask instead how much dropping an entry moves the
# attention *output*, which depends on its attention weight **and** on the size of its value after the output
# projection. Their two-stage selection (Algorithm 1) keeps a share of the budget by attention and the rest by
# attention times projected value size; inside SnapKV and AdaKV (Algorithm 2), the paper reports a lower
# output perturbation in about 74% of the attention heads of 7-8B models (§5.1).
#
# **Before this lesson** read [01_baselines](01_baselines.ipynb): SnapKV (the observation window's pooled
# vote, kept once at prefill) and AdaKV (one budget pool per layer, shared by its KV heads) are the hosts
# CriticalKV runs inside. The keep ratio (the share of the prompt each KV head keeps) is defined in the
# [metrics glossary](README.md#metrics), the book's shared symbols in [notebooks/README.md](README.md).
#
# **You will learn**
#
# 1. the output perturbation, its bound, and Algorithm 1, written out and checked against the library;
# 2. why it needs concentrated attention;
# 3. the two readings of Algorithm 2's second stage inside SnapKV, and what each keeps of a passage on a real
#    model, SmolLM2-135M.
#
# Code: `methods/critical_kv.py`.

# %% tags=["setup"]
from preamble import TINY  # the repository importable before any other import

import matplotlib.pyplot as plt
import torch

# %% [markdown]
# ## 1. The perturbation and its bound, on one head
#
# One head, one query. The symbols, from the course's shared table (`notebooks/README.md`) and this lesson's
# own:
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $T$, $n$ | entries in the cache, and one of them | `T` |
# | $A$, $A_n$ | the query's attention over the $T$ entries ($A_n = a_{t,n}$) | `attn`, `A` |
# | $V$, $v_n$ | the head's stored values, $T \times d$ | kept in a `KVCache` |
# | $W_O$ | the output projection, $D \times D$ | `W_O` |
# | $W_O^{(h)}$ | head $h$'s slice, $d \times D$: `W_O`'s columns $hd$ to $(h+1)d-1$, transposed | inside `vw` |
# | $V W_O^{(h)}$ | the projected values, $T \times D$ | `vw` |
# | $P_n$ | $\|v_n W_O^{(h)}\|_1$, entry $n$'s size (this lesson's own; lesson 01's $P$ is a pooling width) | `P` |
# | $B$ | the budget: entries kept | `b` |
# | $\mathcal{N}$, $\mathcal{N}_n$ | the keep mask: 1 for a kept entry, 0 for an evicted one | `keep` |
# | $\mu$ | the kept attention mass, $\sum_n \mathcal{N}_n A_n$ (this lesson's own symbol) | `mu` |
# | $A'$ | the attention over the kept entries (Theorem 1) | `renormalized_attention` |
# | $\mathcal{L}$ | the output perturbation (Eq. 5) | `output_perturbation`, `L` |
# | $C$, $\theta$ | $C = \sum_n A_n P_n$, and the bound on $\mathcal{L}$ (Theorem 2) | `perturbation_bound`, `theta` |
# | $\alpha$, $\sigma$ | stage 1's share of $B$, and the mass stage 1 keeps | `alpha` |
# | $\bar{A}$, $\bar{A}'$ | SnapKV's window attention, and its pooled vote (section 2) | the option `stage2` |
#
# The head adds $A V W_O^{(h)}$ to the layer's output (Eq. 2). CriticalKV evicts entries with a mask
# $\mathcal{N}$; the softmax over the kept entries is the old attention renormalised (Theorem 1, Eq. 6), and
# the output moves by the perturbation $\mathcal{L}$ (Eq. 5):
#
# $$A' = \frac{\mathcal{N} \odot A}{\sum_n \mathcal{N}_n A_n} \quad \text{(Eq. 6)}, \qquad
# \mathcal{L} = \big\|(A - A')\, V W_O^{(h)}\big\|_1 \quad \text{(Eq. 5)}.$$
#
# **The bound (§3.3, Theorem 2).** The triangle inequality splits $\mathcal{L}$ entry by entry:
# $\mathcal{L} \le \sum_n |A_n - A'_n|\, P_n$. An evicted entry has $A'_n = 0$ and adds $A_n P_n$; a kept one
# has $A'_n = A_n / \mu \ge A_n$ and adds $(1/\mu - 1) A_n P_n$. The evicted entries together add
# $C - \sum_n \mathcal{N}_n A_n P_n$, the kept ones $(1/\mu - 1) \sum_n \mathcal{N}_n A_n P_n$; in all,
#
# $$\mathcal{L} \le \theta = C - \Big(2 - \frac{1}{\mu}\Big) \sum_n \mathcal{N}_n A_n P_n \quad \text{(Eq. 8)}.$$
#
# The cell below checks both theorems against the library on random heads.

# %% tags=["needs:output_perturbation", "needs:perturbation_bound"]
from methods.critical_kv import output_perturbation, perturbation_bound, renormalized_attention

g = torch.Generator().manual_seed(0)
worst_gap, identity_err = float("inf"), 0.0
for _ in range(500 if TINY else 2000):
    T, d, D = 30, 4, 8
    logits = torch.randn(T, generator=g, dtype=torch.float64) * float(torch.empty(1).uniform_(0.1, 5, generator=g))
    attn = torch.softmax(logits, -1)                                        # (T,) A
    vw = torch.randn(T, d, generator=g, dtype=torch.float64) @ torch.randn(d, D, generator=g, dtype=torch.float64)
    keep = torch.rand(T, generator=g) < 0.3                                 # (T,) the mask N
    keep[0] = True
    theta = perturbation_bound(attn, keep, vw.abs().sum(-1))
    worst_gap = min(worst_gap, float(theta - output_perturbation(attn, keep, vw)))
    masked = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)
    identity_err = max(identity_err, float((masked - renormalized_attention(attn, keep)).abs().max()))
print(f"Theorem 1: max |softmax over the kept entries - N*A/mu| = {identity_err:.1e}")
print(f"Theorem 2: min over random masks of theta - L = {worst_gap:.3f}  (>= 0: the bound holds)")

# %% [markdown]
# **From the bound to Algorithm 1 (§3.4-3.5).** If the kept mass $\mu$ exceeds one half, the factor $2 - 1/\mu$
# is positive, and keeping entries with a large $A_n P_n$ lowers $\theta$. Algorithm 1 therefore works in two
# stages. Stage 1 keeps the $\lfloor \alpha B \rfloor$ entries with the most attention; Assumption 1 says their
# mass $\sigma$ already exceeds one half. Split the mask as $\mathcal{N} = \mathcal{N}' + \mathcal{N}''$:
# $\mathcal{N}'$ marks stage 1's entries, $\mathcal{N}''$ those stage 2 adds. **Theorem 3** then freezes the
# factor at its stage-1 value: since $\mu \ge \sigma$, $\theta$ is at most $C' - (2 - 1/\sigma) \sum_n
# \mathcal{N}''_n A_n P_n$, where $C' = C - (2 - 1/\sigma) \sum_n \mathcal{N}'_n A_n P_n$ is fixed once stage 1
# has chosen. Stage 2 minimises that by filling the rest of
# the budget with the largest $A_n P_n$: *Theorem 3's ranking*. Here is Algorithm 1 for one head (its
# comments write $A_i$, $P_i$ and $n$ entries, as the paper does), checked against the library's
# `perturbation_constrained_select` on random heads:

# %%
# BEGIN SOLUTION [critical_kv:two_stage] stage 1: the alpha share of b by attention A; stage 2: the rest by A * P
def algorithm1(attn: torch.Tensor, vnorm: torch.Tensor, b: int, alpha: float) -> torch.Tensor:
    """Algorithm 1 for one head and one query: attn, vnorm (n,) -> the b kept entries (b,), ascending."""
    n_first = int(alpha * b)                                          # stage 1's share of the budget
    by_attention = torch.argsort(attn, descending=True, stable=True)  # (n,) best first, ties: earlier first
    stage1 = by_attention[:n_first]                                   # secure the attention mass
    score = attn * vnorm                                              # (n,) A_i * P_i, Theorem 3's ranking
    score[stage1] = float("inf")                                      # stage 1's entries stay
    keep = torch.argsort(score, descending=True, stable=True)[:b]     # stage 2 fills the budget
    return keep.sort().values
# END SOLUTION


from methods.critical_kv import perturbation_constrained_select

g = torch.Generator().manual_seed(0)
n_heads = 300
for trial in range(n_heads):
    T = int(torch.randint(4, 40, (1,), generator=g))                  # entries in this head
    attn = torch.softmax(torch.randn(T, generator=g) * 3, -1)         # (T,) one query's attention A
    P = torch.rand(T, generator=g) * 4                                # (T,) projected value sizes P_n
    b = int(torch.randint(1, T + 1, (1,), generator=g))               # the budget B
    alpha = [0.0, 0.25, 0.5, 1.0][trial % 4]
    assert torch.equal(algorithm1(attn, P, b, alpha), perturbation_constrained_select(attn, P, b, alpha))
print(f"Algorithm 1 written out keeps the library's entries in all {n_heads} random heads (alpha 0, 0.25, 0.5, 1).")

# %% [markdown]
# A hand example: four entries and a budget of two. Attention top-2 is Algorithm 1 with $\alpha = 1$ (all of
# the budget by attention); with $\alpha = 0.5$, one entry goes by attention and one by $A_n P_n$. Which two
# does each keep, and how far does the output move?

# %% tags=["needs:output_perturbation", "needs:perturbation_bound", "needs:two_stage"]
attn = torch.tensor([0.5, 0.2, 0.18, 0.12], dtype=torch.float64)                # (4,) one query's attention A
vw = torch.tensor([[1.0], [0.1], [-2.0], [1.0]], dtype=torch.float64) \
    @ torch.tensor([[1.0, 0.5]], dtype=torch.float64)                           # (4, 2) V W_O^(h)
P = vw.abs().sum(-1)                                                            # (4,) P_n
fig, axes = plt.subplots(1, 2, figsize=(11, 3.4), dpi=80, sharey=True)
for ax, (name, alpha) in zip(axes, [("attention top-2", 1.0), ("Algorithm 1, alpha = 0.5", 0.5)]):
    idx = perturbation_constrained_select(attn, P, 2, alpha)
    keep = torch.zeros(4, dtype=torch.bool).index_fill(0, idx, True)
    L, theta = float(output_perturbation(attn, keep, vw)), float(perturbation_bound(attn, keep, P))
    shade = [1.0 if k else 0.25 for k in keep.tolist()]                         # evicted entries pale
    for x in range(4):
        ax.bar(x - 0.2, float(attn[x]), 0.4, color="C0", alpha=shade[x], label="attention A" if x == 0 else None)
        ax.bar(x + 0.2, float(attn[x] * P[x]), 0.4, color="C1", alpha=shade[x], label="A x P" if x == 0 else None)
        ax.text(x, 0.8, "kept" if keep[x] else "evicted", ha="center", fontsize=10)
    ax.set(title=f"{name}: L = {L:.3f}", xlabel="entry", xticks=range(4), ylim=(0, 0.9))
    print(f"{name:<26} keeps {idx.tolist()}: kept mass {float(attn[keep].sum()):.2f}, L = {L:.3f}, theta = {theta:.3f}")
axes[0].set(ylabel="weight")
axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# The figure shows, for each entry, its attention (blue) and $A_n P_n$ (orange), evicted entries pale.
# Attention top-2 keeps entries 0 and 1; Algorithm 1 keeps entry 2 instead of entry 1, because its small
# attention (0.18) multiplies a large projected value ($P_2 = 3$), and the output moves by 0.111 instead of
# 0.694.
#
# **What giving up attention costs.** Write $o_\text{kept}$ and $o_\text{dropped}$ for the attention-weighted
# mean projected value of the kept and of the evicted entries. The full output is
# $\mu\, o_\text{kept} + (1 - \mu)\, o_\text{dropped}$ and the compressed one is $o_\text{kept}$, so
#
# $$\mathcal{L} = (1 - \mu)\, \| o_\text{dropped} - o_\text{kept} \|_1:$$
#
# the evicted mass times how far the evicted values lie from the kept ones. Attention top-k maximises $\mu$;
# every entry stage 2 keeps for its value instead of its attention lowers it, a cost Theorem 3 leaves out by
# freezing the factor at $2 - 1/\sigma$. The cost is small only where attention is concentrated, as the paper
# assumes (§3.5). Exercise 2 tests this on random heads. The lab tests it with the true query at every
# head's first decode step: Algorithm 1 beats attention top-k, slightly, on SmolLM2-135M, whose attention is
# concentrated, and loses on the course's bundled model, whose attention is spread out (lab sections 2.4
# and 5.5).
#
# ## 2. Inside SnapKV: the two readings of Algorithm 2's stage 2
#
# Algorithm 2 (§3.6) runs Algorithm 1 inside a host such as SnapKV, which compresses the prompt before any
# answer token exists: the queries of the observation window (the prompt's last tokens, here the question)
# stand in for the decoding query. SnapKV averages the window's attention into $\bar{A}$, max-pools it along
# the prompt into its vote $\bar{A}'$ (a token's vote goes to its three neighbours on either side), and
# stage 1 keeps the top of $\bar{A}'$. Stage 2 ranks the rest by an attention estimate times $P_n$, and there
# the paper and its code part ways:
#
# $$\text{stage-2 score}_n = \bar{A}'_n P_n \ \ \text{(pooled, the authors' code)}
# \qquad \text{or} \qquad \bar{A}_n P_n \ \ \text{(literal, Algorithm 2 line 9)}.$$
#
# The authors' code, `CriticalKVPress` in kvpress (NVIDIA's library of KV-cache compression methods), runs
# the pooled reading, our default; the literal one is the option `stage2="window"`. The difference matters
# for a needle: the question's queries look at the needle's *key*, the answer copies its *value*, and pooling
# spreads the key's vote onto the value tokens next to it.
#
# On SmolLM2-135M-Instruct, take a `niah_single_docs` sample: a sentence "The special magic number for KEY
# is: VALUE." hidden among paragraphs of Python's documentation, the question at the end of the prompt. At
# keep ratio 0.25, which of the value's digits does each selection keep, and what does the model answer?

# %%
from methods import make_policy
from methods.evaluation.harness import greedy_accuracies, traces
from methods.evaluation.viz import kept_mask, needle_spans
from nanollm import KVCache, load, prefill
from nanollm.data.tasks import make_sample

real, rtok, _ = load("smollm2-135m")
rcfg = real.config
LENGTH_REAL, MODE = 256 if TINY else 512, "question_in_prompt"    # tokens per sample; the question in the prompt
sample_r = make_sample("niah_single_docs", rtok, LENGTH_REAL, seed=0)
span = needle_spans(sample_r, rtok)[0]                            # (key start, value start, value end)
b_view, T_r = round(0.25 * LENGTH_REAL), len(sample_r.prompt_ids)
print(f"{T_r} prompt tokens, value {sample_r.answers[0]} at positions {span[1]}..{span[2] - 1}; budget {b_view}")

# %% tags=["needs:two_stage"]
VARIANTS = {"SnapKV": ("snapkv", {}), "pooled (default)": ("critical_kv", {}),
            "literal": ("critical_kv", {"stage2": "window"})}
for label, (spec, opts) in VARIANTS.items():                     # what each one keeps after the prompt
    cache = KVCache(rcfg, make_policy(spec, budget=b_view, **opts))
    prefill(real, torch.tensor([sample_r.prompt_ids]), cache)
    kept = kept_mask(cache, T_r)[:, :, span[1]:span[2]]           # (L, H_kv, value tokens)
    print(f"{label}: value complete in {int(kept.all(-1).sum())} of {kept[..., 0].numel()} "
          f"(layer, KV head), no digit in {int((~kept.any(-1)).sum())}; digits kept per KV head, mean over "
          "layers 0-9 / 10-19 / 20-29: " + " / ".join(f"{float(kept[list(r)].sum(-1).float().mean()):.1f}"
          for r in [range(0, 10), range(10, 20), range(20, rcfg.n_layer)]) + f" of {span[2] - span[1]}")
policies = [None] + [make_policy(spec, budget=b_view, **opts) for spec, opts in VARIANTS.values()]
trs = traces(real, sample_r, MODE, policies, [False] * len(policies))   # one prompt pass, answers side by side
for label, (acc, said) in zip(["full cache", *VARIANTS], greedy_accuracies(real, rtok, sample_r, trs)):
    print(f"{label:<19} answers {said.strip()[:40]!r:<44} correct: {acc:.0f}")

# %% [markdown]
# The pooled reading keeps a little more of the value than SnapKV: complete in 33 of the 90 (layer, KV head)
# pairs, against 26. The literal reading keeps it complete in 13, and 0.4 of the 4 digits per KV head in
# layers 0-9 against 2.9: the pooled vote points at the value through the key next to it, the un-pooled
# window attention less often.
#
# **Verdict.** Inside a host, the observation window decides what stage 2 sees, and pooling helps stage 2
# keep a needle's value. Kept digits do not decide this answer, though: SnapKV and both readings answer 6122,
# as the full cache does. Whether the readings move the answers over many samples, and how the authors' own
# settings compare, the lab measures.

# %% [markdown]
# ## Exercises
#
# Each exercise has a cell where you write (replace the `None`), a check cell that reads only your answer
# (it says "not answered yet" until you do, stops with a hint when the answer is wrong, and says "right"
# when it is), and the reference answer, collapsed: open it once you are done.
#
# ### Exercise 1: the perturbation and its bound by hand
#
# In the hand example of section 1, keep entries 1 and 2, whose attention mass is below one half. Compute
# $\mathcal{L}$ (Eq. 5-6) and $\theta$ (Eq. 8) with tensor operations only (no `output_perturbation`,
# `perturbation_bound` or `renormalized_attention`), as the floats `my_L` and `my_theta`. Then, in a
# sentence: is $\theta$ still an upper bound, and what does the factor $2 - 1/\mu$ do to it?

# %%
ex_attn = torch.tensor([0.5, 0.2, 0.18, 0.12], dtype=torch.float64)                 # A, the hand example
ex_vw = torch.tensor([[1.0], [0.1], [-2.0], [1.0]], dtype=torch.float64) \
    @ torch.tensor([[1.0, 0.5]], dtype=torch.float64)                             # V W_O^(h), one row per entry
ex_keep = torch.tensor([False, True, True, False])                                  # the mask N: entries 1, 2
my_L = None                                 # replace None: L (Eq. 5-6), a float
my_theta = None                             # replace None: theta (Eq. 8), a float

# %% tags=["needs:output_perturbation", "needs:perturbation_bound"]
from exercises import exercise


@exercise("Exercise 1")
def check_L_theta(L, theta):
    assert abs(L - float(output_perturbation(ex_attn, ex_keep, ex_vw))) < 1e-6, \
        "L: renormalise the kept attention (A' = N*A / mu sums to 1), then take the L1 norm of (A - A') V W_O^(h)"
    assert abs(theta - float(perturbation_bound(ex_attn, ex_keep, ex_vw.abs().sum(-1)))) < 1e-6, \
        "theta: C = sum_n A_n P_n with P_n = ||v_n W_O^(h)||_1, minus (2 - 1/mu) times the kept entries' A_n P_n"
    assert theta >= L, "theta bounds L for any mask (Theorem 2)"


check_L_theta(my_L, my_theta)

# %%
# BEGIN SOLUTION [critical_kv] mu = (N*A).sum(); A' = N*A/mu; L = ((A - A') @ VW).abs().sum(); theta from Eq. 8
kept = ex_attn * ex_keep                                  # N*A
mu_kept = kept.sum()                                      # the kept attention mass
reference_L = float(((ex_attn - kept / mu_kept) @ ex_vw).abs().sum())
P_ex = ex_vw.abs().sum(-1)                                # P_n = ||v_n W_O^(h)||_1
reference_theta = float((ex_attn * P_ex).sum() - (2 - 1 / mu_kept) * (kept * P_ex).sum())
# END SOLUTION
check_L_theta(reference_L, reference_theta)
print(f"kept mass {float(mu_kept):.2f}: L = {reference_L:.3f}, theta = {reference_theta:.3f}, "
      f"2 - 1/mu = {float(2 - 1 / mu_kept):.2f}")
print("Yes: Theorem 2 holds for any mask. But with mu below one half the factor 2 - 1/mu is negative, so the kept "
      "entries' A_n P_n add to theta instead of lowering it: keeping large A_n P_n no longer tightens the bound.")

# %% [markdown]
# ### Exercise 2: concentrated attention
#
# Section 1 says the criterion needs concentrated attention. Test that on random heads of 64 entries and a
# budget of 16. `random_head(sharpness, g)` below draws one head: its attention, the softmax of `sharpness`
# times random logits (larger is more concentrated), and its projected values, each row scaled by `exp` of a
# standard normal (so that some entries are much larger than others). For each sharpness in `SHARPNESS`, in
# that order, draw 200 heads with the generator `g` and store in `my_wins[sharpness]` the fraction of them
# where Algorithm 1 ($\alpha = 0.25$) has a strictly lower $\mathcal{L}$ than attention top-k ($\alpha = 1$),
# using `perturbation_constrained_select` and `output_perturbation`. Then, in a sentence: does concentrated
# attention make Algorithm 1 win?

# %%
def random_head(sharpness: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One random head: attention A (64,) and projected values V W_O^(h) (64, 8)."""
    attn = torch.softmax(sharpness * torch.randn(64, generator=g, dtype=torch.float64), -1)
    vw = torch.randn(64, 8, generator=g, dtype=torch.float64) * torch.randn(64, 1, generator=g).exp()
    return attn, vw


SHARPNESS = (0.5, 1, 2, 4, 8)
g = torch.Generator().manual_seed(0)
my_wins = {0.5: None, 1: None, 2: None, 4: None, 8: None}   # replace each None: Algorithm 1's share of wins


# %% tags=["needs:output_perturbation", "needs:two_stage"]
@exercise("Exercise 2")
def check_wins(wins):
    assert sorted(wins) == sorted(SHARPNESS), "one fraction per sharpness in SHARPNESS"
    assert all(0 <= w <= 1 for w in wins.values()), "a fraction of heads lies between 0 and 1"
    g_check = torch.Generator().manual_seed(0)
    for s in SHARPNESS:
        L = [[float(output_perturbation(a, torch.zeros(64, dtype=torch.bool).index_fill(
              0, perturbation_constrained_select(a, vw.abs().sum(-1), 16, alpha), True), vw))
              for alpha in (1.0, 0.25)] for a, vw in (random_head(s, g_check) for _ in range(200))]
        truth = sum(alg1 < top for top, alg1 in L) / len(L)
        assert abs(wins[s] - truth) <= 0.1, f"sharpness {s}: count the heads where Algorithm 1's L (alpha 0.25) " \
            "is strictly below top-k's (alpha 1), out of 200 drawn with random_head(s, g), sharpness in order"


check_wins(my_wins)

# %%
# BEGIN SOLUTION [critical_kv] per sharpness: 200 heads; keep 16 with alpha 1 and 0.25; count where L is lower
reference_wins, top_mass = {}, {}
g_ref = torch.Generator().manual_seed(0)
for s in SHARPNESS:
    won = 0
    for _ in range(200):
        attn, vw = random_head(s, g_ref)
        L_of = [float(output_perturbation(attn, torch.zeros(64, dtype=torch.bool).index_fill(
            0, perturbation_constrained_select(attn, vw.abs().sum(-1), 16, alpha), True), vw)) for alpha in (1.0, 0.25)]
        won += L_of[1] < L_of[0]
        top_mass[s] = top_mass.get(s, 0.0) + float(attn.topk(16).values.sum()) / 200
    reference_wins[s] = won / 200
# END SOLUTION
check_wins(reference_wins)
for s in SHARPNESS:
    print(f"sharpness {s}: top-16 keeps {top_mass[s]:.2f} of the mass; Algorithm 1's L lower in "
          f"{reference_wins[s]:.2f} of the heads")
print("Concentration helps: Algorithm 1 wins more often as top-16 keeps more of the mass. But it still wins in "
      "fewer than half of these random heads: concentrated attention is needed, not enough.")

# %% [markdown]
# **Go further**: the lab [labs/04_critical_kv_readings.ipynb](labs/04_critical_kv_readings.ipynb) follows a
# sample of the bundled model through every variant over SnapKV and AdaKV, kvpress's settings included;
# counts, head by head, where the selection lowers the perturbation (the paper's §5.1); tests Algorithm 1
# with the true query on both models; measures accuracy and the other metrics, the $\alpha$ ablation and
# Assumption 1; and sets each of the paper's claims against what we measure, on both models. CriticalKV also
# wraps H2O, which has no window: `python -m methods.compare --methods h2o "critical_kv(h2o)"`.
