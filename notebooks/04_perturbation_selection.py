# %% [markdown]
# # 04 CriticalKV: perturbation-constrained selection
#
# SnapKV (notebook 01) keeps the entries the observation window attends to most. Feng et al. ("Identify
# Critical KV Cache in LLM Inference from an Output Perturbation Perspective",
# [arXiv 2502.03805](https://arxiv.org/abs/2502.03805)) ask instead how much dropping an entry moves the
# attention *output*, which depends on its attention weight **and** on the size of its value after the output
# projection. Their two-stage selection (Algorithm 1) keeps a share of the budget by attention and the rest by
# attention times projected value size; inside SnapKV and AdaKV (Algorithm 2), the paper reports a lower
# output perturbation in about 74% of the attention heads of 7-8B models (§5.1).
#
# **You will learn**
#
# 1. the output perturbation, its bound, and Algorithm 1, written out and checked against the library;
# 2. whether Algorithm 1 lowers the perturbation when it knows the true query, and why that depends on how
#    concentrated the attention is;
# 3. the two readings of Algorithm 2 inside SnapKV, and how pooling changes whether a needle's value is kept;
# 4. what changes on a real language model, SmolLM2-135M.
#
# Code: `methods/critical_kv.py`. A *keep ratio* is the share of the prompt each KV head keeps (notebook 01's
# glossary).

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
# | $V$, $v_n$ | the head's stored values, $T \times d$ | `v` |
# | $W_O$ | the output projection, $D \times D$ | `W_O` |
# | $W_O^{(h)}$ | the $d$ rows of $W_O$ that head $h$'s output meets, $d \times D$ | in `projected_values` |
# | $V W_O^{(h)}$, $P_n$ | projected values ($T \times D$); $P_n = \|v_n W_O^{(h)}\|_1$, entry $n$'s size | `vw`, `P` |
# | $B$ | the budget: entries kept | `b` |
# | $\mathcal{N}$, $\mathcal{N}_n$ | the keep mask: 1 for a kept entry, 0 for an evicted one | `keep` |
# | $m$ | the kept attention mass, $\sum_n \mathcal{N}_n A_n$ | `m` |
# | $A'$ | the attention over the kept entries (Theorem 1) | `renormalized_attention` |
# | $\mathcal{L}$ | the output perturbation (Eq. 5) | `output_perturbation`, `L` |
# | $C$, $\theta$ | $C = \sum_n A_n P_n$, and the bound on $\mathcal{L}$ (Theorem 2) | `perturbation_bound`, `theta` |
# | $\alpha$, $\sigma$ | stage 1's share of $B$, and the mass stage 1 keeps | `alpha` |
# | $\bar{A}$, $\bar{A}'$ | SnapKV's window attention, and its pooled vote (section 3) | `abar`, `pooled` |
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
# has $A'_n = A_n / m \ge A_n$ and adds $(1/m - 1) A_n P_n$. The evicted entries together add
# $C - \sum_n \mathcal{N}_n A_n P_n$, the kept ones $(1/m - 1) \sum_n \mathcal{N}_n A_n P_n$; in all,
#
# $$\mathcal{L} \le \theta = C - \Big(2 - \frac{1}{m}\Big) \sum_n \mathcal{N}_n A_n P_n \quad \text{(Eq. 8)}.$$
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
print(f"Theorem 1: max |softmax over the kept entries - N*A/m| = {identity_err:.1e}")
print(f"Theorem 2: min over random masks of theta - L = {worst_gap:.3f}  (>= 0: the bound holds)")

# %% [markdown]
# **From the bound to Algorithm 1 (§3.4-3.5).** If the kept mass $m$ exceeds one half, the factor $2 - 1/m$
# is positive, and keeping entries with a large $A_n P_n$ lowers $\theta$. Algorithm 1 therefore works in two
# stages. Stage 1 keeps the $\lfloor \alpha B \rfloor$ entries with the most attention; Assumption 1 says their
# mass $\sigma$ already exceeds one half. Split the mask as $\mathcal{N} = \mathcal{N}' + \mathcal{N}''$:
# $\mathcal{N}'$ marks stage 1's entries, $\mathcal{N}''$ those stage 2 adds. **Theorem 3** then freezes the
# factor at its stage-1 value: since $m \ge \sigma$, $\theta$ is at most $C' - (2 - 1/\sigma) \sum_n
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
# One identity helps below. The full output is $m$ times the kept entries' attention-weighted mean projected
# value, $o_\text{kept}$, plus $1 - m$ times the evicted ones', $o_\text{dropped}$; the compressed output is
# $o_\text{kept}$, so $\mathcal{L} = (1 - m)\, \| o_\text{dropped} - o_\text{kept} \|_1$: the evicted mass
# times how far the evicted values lie from the kept ones. Attention top-k maximises $m$; Algorithm 1 gives
# up some mass to keep large values. The cell checks the identity on Algorithm 1's choice.

# %% tags=["needs:output_perturbation", "needs:perturbation_bound", "needs:two_stage"]
keep = torch.tensor([True, False, True, False])                  # Algorithm 1's choice above
m = float((attn * keep).sum())
o_kept = renormalized_attention(attn, keep) @ vw                 # (2,) the kept entries' mean value
o_dropped = renormalized_attention(attn, ~keep) @ vw             # (2,) the evicted entries' mean value
print(f"L = {float(output_perturbation(attn, keep, vw)):.6f};  (1 - m) ||o_dropped - o_kept||_1 = "
      f"{(1 - m) * float((o_dropped - o_kept).abs().sum()):.6f}")

# %% [markdown]
# ## 2. Algorithm 1 with the true query
#
# The paper's sections 3.2-3.5 reason about one known query. Test exactly that on the bundled model (trained
# on synthetic retrieval), its default suite of tasks, with the question in the prompt: at the first decode
# step of the full cache, for every layer and query head, choose $B$ entries either by attention top-k
# ($\alpha = 1$) or by Algorithm 1 ($\alpha = 0.25$), using that step's *true* attention $A$ and the layer's
# projected values, and compute $\mathcal{L}$ and $\theta$ for both. No proxy, no pooling, no window: if the
# criterion helps anywhere, it helps here. The first function compares the two on one head.

# %% tags=["needs:output_perturbation", "needs:perturbation_bound", "needs:two_stage"]
def topk_vs_algorithm1(A: torch.Tensor, vw: torch.Tensor, b: int) -> list[float]:
    """One head: [L, theta, kept mass] of attention top-k (alpha = 1), then of Algorithm 1 (alpha = 0.25)."""
    P = vw.abs().sum(-1)                                                  # (T,) P_n
    row = []
    for alpha in (1.0, 0.25):
        keep = torch.zeros_like(A, dtype=torch.bool)
        keep[perturbation_constrained_select(A, P, b, alpha)] = True
        row += [float(output_perturbation(A, keep, vw)), float(perturbation_bound(A, keep, P)), float(A[keep].sum())]
    return row


# %% [markdown]
# The second runs it over samples, layers and query heads, with the first decode step's attention from a trace
# of the full cache (`methods.evaluation.harness.trace`) and its values from a cache that took the same step.

# %% tags=["needs:output_perturbation", "needs:perturbation_bound", "needs:two_stage"]
from methods.critical_kv import projected_values
from methods.evaluation.harness import trace
from nanollm import KVCache, decode_step, prefill
from nanollm.data.tasks import make_sample

MODE = "question_in_prompt"                                          # the question at the end of the prompt


def algorithm1_vs_topk(model, tok, tasks: list[str], n_samples: int, length: int, ratios: list[float]) -> dict:
    """(keep ratio, layer) -> one `topk_vs_algorithm1` row per (sample, query head), B = ratio * length."""
    cfg, rows = model.config, {}
    for task in tasks:
        for i in range(n_samples):
            s = make_sample(task, tok, length, seed=i)
            full = trace(model, s, MODE, None, record_probs=True)        # policy None: the full cache
            cache = KVCache(cfg)
            prefill(model, torch.tensor([s.prompt_ids]), cache)
            decode_step(model, torch.tensor([s.target_ids[0]]), cache)  # the same step: its values
            for l, block in enumerate(model.blocks):
                W_O = block.attn.o_proj.weight.detach()                   # (D, H*d)
                for h in range(cfg.n_head):
                    vw = projected_values(cache.layers[l].v, W_O, h, cfg.n_head)[0].double()   # (T+1, D)
                    for ratio in ratios:
                        row = topk_vs_algorithm1(full.probs[l][h].double(), vw, round(ratio * length))
                        rows.setdefault((ratio, l), []).append(row)
    return rows


# %% [markdown]
# The third prints, per keep ratio and layer, how often Algorithm 1's $\mathcal{L}$ and $\theta$ are lower
# than attention top-k's, the mean $\mathcal{L}$ of each, and the mass each keeps.

# %% tags=["needs:output_perturbation", "needs:perturbation_bound", "needs:two_stage"]
def summarise(rows: dict, ratios: list[float], blocks: list[tuple[str, list[int]]], digits: int) -> None:
    """One line per (keep ratio, block of layers), from `algorithm1_vs_topk`'s rows."""
    print(f"{'keep':>5} {'layers':>7} | {'Alg.1 L lower':>13} {'Alg.1 theta lower':>17} | {'mean L top-k':>12} "
          f"{'mean L Alg.1':>12} | {'kept mass top-k':>15} {'Alg.1':>6}")
    for ratio in ratios:
        for name, layers in blocks:
            x = torch.cat([torch.tensor(rows[(ratio, l)]) for l in layers])     # (rows, 6)
            print(f"{ratio:>5} {name:>7} | {float((x[:, 3] < x[:, 0]).float().mean()):>13.{digits}f} "
                  f"{float((x[:, 4] < x[:, 1]).float().mean()):>17.{digits}f} | {float(x[:, 0].mean()):>12.3f} "
                  f"{float(x[:, 3].mean()):>12.3f} | {float(x[:, 2].mean()):>15.2f} {float(x[:, 5].mean()):>6.2f}")
    print(f"({len(rows[(ratios[0], blocks[0][1][0])])} (sample, query head) pairs per layer; 'lower' = the fraction "
          "of them where Algorithm 1's value is strictly lower)")


# %% [markdown]
# The bundled model, its suite, and the two keep ratios:

# %%
from nanollm import load

model, tok, card = load("retrieval-llama")                       # the bundled model
cfg = model.config
TASKS = card["default_suite"][:1] if TINY else card["default_suite"]
RATIOS = [0.25] if TINY else [0.1, 0.25]                         # keep ratios
print(f"{cfg.n_layer} layers, {cfg.n_head} query heads, {cfg.n_kv_head} KV heads; suite {TASKS}")

# %% tags=["needs:output_perturbation", "needs:perturbation_bound", "needs:two_stage"]
alg1 = algorithm1_vs_topk(model, tok, TASKS, 1 if TINY else 5, 256 if TINY else 512, RATIOS)
summarise(alg1, RATIOS, [(str(l), [l]) for l in range(cfg.n_layer)] + [("all", range(cfg.n_layer))], digits=2)

# %% [markdown]
# On this model Algorithm 1 loses to attention top-k even with the true query: over all layers it lowers
# $\mathcal{L}$ in 0.29 (keep ratio 0.1) and 0.26 (0.25) of the (sample, head) pairs, its mean $\mathcal{L}$
# is higher in every layer, and it lowers even the bound $\theta$ less often still. Theorem 3 freezes the
# factor $2 - 1/m$ at $2 - 1/\sigma$, as if $m$ were fixed; but every entry stage 2 picks for its value
# instead of its attention lowers $m$, and $\theta$, like $\mathcal{L} = (1 - m)\,
# \| o_\text{dropped} - o_\text{kept} \|_1$, grows as $m$ falls. That cost is small only where attention is
# concentrated, as the paper assumes (§3.5: "a small subset of cache entries accounts for the majority of the
# attention weights"). Here it mostly is not: a tenth of the entries by attention keeps 0.51-0.67 of the mass
# in layers 0, 2 and 3. Only layer 1 is concentrated (0.90), and there the two mean $\mathcal{L}$ are closest
# (0.394 against 0.417 at keep 0.1, 0.226 against 0.234 at 0.25); its win fraction leads at keep 0.1 (0.39)
# but not at 0.25 (0.31, against 0.35 in layers 2 and 3).

# %% [markdown]
# ## 3. Inside SnapKV: the two readings of Algorithm 2's stage 2
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
# The pooled reading is what the authors' code runs (kvpress's `CriticalKVPress`), and our default. The
# literal reading is the option `stage2="window"`; everything else, stage 1 included, is the same. Does the
# pooling matter? Take a single-needle sample (`niah_single_noise`, seed 1) and a budget of 256 tokens:

# %%
sample = make_sample("niah_single_noise", tok, 512, seed=1)
value_ids = tok.encode(sample.answers[0])
start = next(i for i in range(len(sample.context_ids)) if sample.context_ids[i:i + len(value_ids)] == value_ids)
digits = torch.arange(start, start + len(value_ids))              # positions of the value's digit tokens
before = torch.arange(start - 12, start)                          # the 12 tokens before them (the key)
ids = torch.tensor([sample.prompt_ids])                           # (1, T)
print(f"{len(sample.prompt_ids)} prompt tokens; value {sample.answers[0]} at positions {digits.tolist()}; "
      f"before it: {tok.decode(sample.context_ids[start - 12:start])!r}")

# %% [markdown]
# In layer 3, how much attention do the six digits get from the window (what the literal stage 2 ranks by),
# from the pooled vote (what the pooled stage 2 ranks by), and from the first answer token's query in the full
# cache (what decoding asks for)? The policy records $\bar{A}$ of its last compression in `policy.last`.

# %% tags=["needs:two_stage"]
from methods import make_policy
from methods.snapkv import pool1d

layer = 3
policy = make_policy("critical_kv", budget=256)
prefill(model, ids, KVCache(cfg, policy))
abar = policy.last[layer]["abar"][0]                                  # (H, T) window attention, not pooled
pooled = pool1d(abar, policy.inner.kernel, policy.inner.pooling)      # (H, T) SnapKV's pooled vote
full = trace(model, sample, MODE, None, record_probs=True)           # full cache, first decode step
mass = lambda a: float(a[:, digits].sum(-1).mean())                 # mean over query heads
print(f"layer {layer}: attention mass on the 6 digits, mean over query heads: window Abar {mass(abar):.3f}, "
      f"pooled vote {mass(pooled):.3f}, first answer query {mass(full.probs[layer]):.3f}")

# %% [markdown]
# Then the rank each stage-2 score gives each digit, per KV head (0 = ranked first; a KV head's score is the
# mean over the query heads that read it). The two average differently, as the library does: SnapKV's pooled
# vote exists only per KV head (it averages its query heads' votes), so the pooled score multiplies it by the
# heads' mean $P_n$, a product of means; $\bar{A}$ is per query head, so the literal score pairs each head's
# $\bar{A}_n$ with its own $P_n$ and averages the products.

# %% tags=["needs:two_stage"]
from methods.critical_kv import projected_value_norms

full_cache = KVCache(cfg)
prefill(model, ids, full_cache)
W_O = model.blocks[layer].attn.o_proj.weight.detach()                # (D, H*d)
T = len(sample.prompt_ids)
P = projected_value_norms(full_cache.layers[layer].v, W_O, cfg.n_head)[0][:, :T]      # (H, T) P_n per query head
G = cfg.n_head // cfg.n_kv_head                                      # query heads per KV head
stage2 = {"literal: Abar x P": (abar * P).view(cfg.n_kv_head, G, T).mean(1),
          "default: pooled x P": pooled.view(cfg.n_kv_head, G, T).mean(1) * P.view(cfg.n_kv_head, G, T).mean(1)}
for name, score in stage2.items():                                    # (H_kv, T) stage-2 score per KV head
    rank = score.argsort(-1, descending=True).argsort(-1)             # 0 = ranked first
    print(f"stage 2, {name:<20} rank of the value digits (of {T}) per KV head: "
          + "; ".join(f"KV head {j}: {rank[j, digits].tolist()}" for j in range(cfg.n_kv_head)))

# %% [markdown]
# The question looks at the *key*; the answer copies the *value*. The window's queries put 0.003 of their
# attention (mean over query heads) on the six digits; they attend to the key before them ("royal-field").
# Pooling moves some of the key's vote onto the digits next to it (0.007), so the pooled stage 2 puts the
# value's first digit at rank 216 of 494 (counting from 0) in KV head 1, where the literal one puts it at rank
# 493, the last. The first answer token's query puts 0.519 of its attention on the digits. Pooling lets a
# value ride along with the key the window retrieved; the literal reading sees only the key. Neither ranks
# most digits high: here the observation window is a poor stand-in for the decoding query.

# %% [markdown]
# ## 4. On a real model: SmolLM2-135M
#
# The bundled model's attention is spread out (section 2), and the paper measured 7-8B models.
# SmolLM2-135M-Instruct is a real, if small, language model; its suite here is `passkey` and
# `niah_single_docs` (a needle among paragraphs of Python's documentation), both of which the full cache
# answers. Two questions: does Algorithm 1 now beat attention top-k with the true query, and what does each
# reading of stage 2 keep of a real passage? Budgets are per layer and KV head.

# %%
real, rtok, _ = load("smollm2-135m")
rcfg = real.config
LENGTH_REAL = 256 if TINY else 512                                # tokens per sample
TASKS_REAL = ["passkey"] if TINY else ["passkey", "niah_single_docs"]
N_REAL = 1 if TINY else 3                                         # samples per task
print(f"SmolLM2-135M: {rcfg.n_layer} layers, {rcfg.n_head} query heads, {rcfg.n_kv_head} KV heads, "
      f"d_model {rcfg.d_model}; suite {TASKS_REAL}, {LENGTH_REAL} tokens, {N_REAL} sample(s) per task, "
      f"keep ratios {RATIOS}")

# %% [markdown]
# ### 4.1 Algorithm 1 with the true query
#
# Section 2's test on SmolLM2, with the same functions, the layers in blocks of ten.

# %% tags=["needs:output_perturbation", "needs:perturbation_bound", "needs:two_stage"]
alg1_r = algorithm1_vs_topk(real, rtok, TASKS_REAL, N_REAL, LENGTH_REAL, RATIOS)
summarise(alg1_r, RATIOS, [("0", [0]), ("1-9", range(1, 10)), ("10-19", range(10, 20)),
                           ("20-29", range(20, rcfg.n_layer)), ("all", range(rcfg.n_layer))], digits=3)

# %% [markdown]
# With the true query, Algorithm 1 now wins slightly more often than it loses: lower $\mathcal{L}$ than
# attention top-k in 0.517 (keep ratio 0.1) and 0.604 (0.25) of the (sample, head) pairs over all layers.
# Attention is more concentrated than on the bundled model: over all layers attention top-k keeps 0.93 and
# 0.97 of the mass, so the entries stage 2 picks for their values cost little of it. Concentration alone does
# not rank the layers, though: at keep ratio 0.1 top-k keeps 0.89 in layers 1-9, where Algorithm 1 wins most
# often (0.650), and 0.96 in layers 20-29, where it wins least of the three blocks (0.424). In layer 0, the
# least concentrated (0.58), Algorithm 1 still loses.
#
# ### 4.2 What the two readings keep of a real passage
#
# A `niah_single_docs` sample: a sentence "The special magic number for KEY is: VALUE." hidden among
# documentation paragraphs, the question at the end of the prompt. At keep ratio 0.25, which prompt positions
# does each selection keep, and what does the model answer? Besides SnapKV and the two readings, the cell runs
# CriticalSnapKV at kvpress's settings (`preset_options`: half the budget by attention, a wider window,
# average pooling).

# %% tags=["needs:two_stage"]
from methods.evaluation.harness import greedy_accuracies, traces
from methods.evaluation.viz import kept_mask, needle_spans
from methods.presets import preset_options

VARIANTS = {"SnapKV": ("snapkv", {}), "pooled (default)": ("critical_kv", {}),
            "literal": ("critical_kv", {"stage2": "window"}),
            "kvpress's settings": ("critical_kv", preset_options("critical_kv", "kvpress"))}
sample_r = make_sample("niah_single_docs", rtok, LENGTH_REAL, seed=0)
span = needle_spans(sample_r, rtok)[0]                            # (key start, value start, value end)
b_view, T_r = round(0.25 * LENGTH_REAL), len(sample_r.prompt_ids)
print(f"{T_r} prompt tokens, value {sample_r.answers[0]} at positions {span[1]}..{span[2] - 1}; budget {b_view}")
caches, masks = {}, {}
for label, (spec, opts) in VARIANTS.items():                     # what each one keeps after the prompt
    caches[label] = KVCache(rcfg, make_policy(spec, budget=b_view, **opts))
    prefill(real, torch.tensor([sample_r.prompt_ids]), caches[label])
    masks[label] = kept_mask(caches[label], T_r)[:, :, span[1]:span[2]]   # (L, H_kv, value tokens)
    print(f"{label}: value complete in {int(masks[label].all(-1).sum())} of {masks[label][..., 0].numel()} "
          f"(layer, KV head), no digit in {int((~masks[label].any(-1)).sum())}; digits kept per KV head, mean over "
          "layers 0-9 / 10-19 / 20-29: " + " / ".join(f"{float(masks[label][list(r)].sum(-1).float().mean()):.1f}"
          for r in [range(0, 10), range(10, 20), range(20, rcfg.n_layer)]) + f" of {span[2] - span[1]}")
policies = [None] + [make_policy(spec, budget=b_view, **opts) for spec, opts in VARIANTS.values()]
trs = traces(real, sample_r, MODE, policies, [False] * len(policies))   # one prompt pass, answers side by side
for label, (acc, said) in zip(["full cache", *VARIANTS], greedy_accuracies(real, rtok, sample_r, trs)):
    print(f"{label:<19} answers {said.strip()[:40]!r:<44} correct: {acc:.0f}")

# %% [markdown]
# The figure draws what the first three keep: one strip each, layers 0, 10, 20 and 29, three KV heads each.

# %% tags=["needs:two_stage"]
from types import SimpleNamespace

from methods.evaluation.viz import plot_kept

SHOW = [0, 10, 20, 29] if rcfg.n_layer == 30 else [0, rcfg.n_layer - 1]
fig, axes = plt.subplots(3, 1, figsize=(11, 8), dpi=80, layout="constrained")
for ax, label in zip(axes, ["SnapKV", "pooled (default)", "literal"]):
    shown = SimpleNamespace(layers=[caches[label].layers[l] for l in SHOW])     # `plot_kept` reads `.layers`
    plot_kept(ax, shown, T_r, [span], title=label, window=caches[label].policy.window)
    ax.set_yticks([rcfg.n_kv_head * i + 1 for i in range(len(SHOW))], [f"layer {l}" for l in SHOW], fontsize=10)
bar = fig.colorbar(axes[0].images[0], ax=axes, ticks=[0, 1], shrink=0.5)
bar.ax.set_yticklabels(["evicted", "kept"], fontsize=10)
plt.show()

# %% [markdown]
# The strips show kept positions dark and evicted ones light (the colour bar), the needle's key shaded light
# orange and its value digits red, and the start of SnapKV's window as a dotted blue line. SnapKV keeps the
# needle's sentence in blocks (pooling keeps a strong token's neighbours); the pooled stage 2 keeps a little
# more: the value complete in 33 of the 90 (layer, KV head) pairs, against 26 for SnapKV. The literal reading
# spends its stage-2 budget on isolated tokens all over the prompt (the speckled strip): the value complete in
# 13 pairs, and 0.4 of the 4 digits per KV head in layers 0-9 against 2.9. Section 3's finding holds for what
# is kept on a real model: the pooled vote points at the value through the key next to it; the un-pooled window
# attention does so less often. SnapKV and both readings still answer 6122 here, and kvpress's settings answer "61".
#
# **Verdict.** With the true query Algorithm 1 beats attention top-k on SmolLM2, slightly, and loses on the
# bundled model, whose attention is spread out; concentration is not the whole story (section 4.1). Inside a
# host, the observation window decides what stage 2 sees. Pooling helps keep the value but does not secure it:
# our pooled default keeps it complete in 33 of the 90 (layer, KV head) pairs and the literal reading in 13,
# but kvpress's settings, the authors' code (also pooled, with half the budget by attention, a wider window and
# average pooling), keep it complete in only 5 and answer "61". Nor do kept digits decide this answer: the
# literal reading still answers 6122. Whether the readings move the answers over many samples, and by how
# much, the lab measures.

# %% [markdown]
# ## Exercises
#
# ### Exercise 1: the perturbation and its bound by hand
#
# In the hand example of section 1, keep entries 1 and 2, whose attention mass is below one half. Compute
# $\mathcal{L}$ (Eq. 5-6) and $\theta$ (Eq. 8) with tensor operations only (no `output_perturbation`,
# `perturbation_bound` or `renormalized_attention`), as the floats `my_L` and `my_theta` in place of the
# `None`s below. Is $\theta$ still an upper bound, and what does the factor $2 - 1/m$ do to it?

# %%
ex_attn = torch.tensor([0.5, 0.2, 0.18, 0.12], dtype=torch.float64)                 # A, the hand example
ex_vw = torch.tensor([[1.0], [0.1], [-2.0], [1.0]], dtype=torch.float64) \
    @ torch.tensor([[1.0, 0.5]], dtype=torch.float64)                             # V W_O^(h), one row per entry
ex_keep = torch.tensor([False, True, True, False])                                  # the mask N: entries 1, 2
my_L, my_theta = None, None                                                         # your code

# %% tags=["needs:output_perturbation", "needs:perturbation_bound"]
# BEGIN SOLUTION [critical_kv] kept mass m = (N*A).sum(); A' = N*A/m; L = ((A - A') @ VW).abs().sum(); theta from Eq. 8
kept = ex_attn * ex_keep                                  # N*A
m_kept = kept.sum()                                       # the kept attention mass
my_L = float(((ex_attn - kept / m_kept) @ ex_vw).abs().sum())
P_ex = ex_vw.abs().sum(-1)                                # P_n = ||v_n W_O^(h)||_1
my_theta = float((ex_attn * P_ex).sum() - (2 - 1 / m_kept) * (kept * P_ex).sum())
# END SOLUTION
assert abs(my_L - float(output_perturbation(ex_attn, ex_keep, ex_vw))) < 1e-9, \
    f"my_L = {my_L:.4f}, the library's L = {float(output_perturbation(ex_attn, ex_keep, ex_vw)):.4f}: " \
    "renormalise the kept attention (A' sums to 1) and take the L1 norm of (A - A') V W_O^(h)"
assert abs(my_theta - float(perturbation_bound(ex_attn, ex_keep, ex_vw.abs().sum(-1)))) < 1e-9, \
    f"my_theta = {my_theta:.4f} differs from Theorem 2's bound: C = sum(A*P), then minus (2 - 1/m) sum(N*A*P)"
print(f"kept mass {float(m_kept):.2f}: L = {my_L:.3f}, theta = {my_theta:.3f}, 2 - 1/m = {float(2 - 1 / m_kept):.2f}")

# %% [markdown]
# ### Exercise 2: concentrated attention
#
# Sections 2 and 4 say the criterion needs concentrated attention. Test that on random heads of 64 entries
# and a budget of 16: for each sharpness in `(0.5, 1, 2, 4, 8)` (it multiplies the logits: larger is more
# concentrated), draw 200 heads with attention `torch.softmax(sharpness * torch.randn(64))` and projected
# values `torch.randn(64, 8)` with each row scaled by `exp` of a standard normal (so that some entries are
# much larger than others), and store in `wins[sharpness]` the fraction of heads where Algorithm 1
# ($\alpha = 0.25$) has a lower $\mathcal{L}$ than attention top-k ($\alpha = 1$), using
# `perturbation_constrained_select` and `output_perturbation`. Does concentrated attention make Algorithm 1 win?

# %% tags=["needs:output_perturbation", "needs:two_stage"]
# BEGIN SOLUTION [critical_kv] per sharpness: 200 heads; keep 16 with alpha 1 and 0.25; count where L is lower
g = torch.Generator().manual_seed(0)
wins = {}
for sharpness in (0.5, 1, 2, 4, 8):
    won, top_mass = 0, 0.0
    for _ in range(200):
        attn = torch.softmax(sharpness * torch.randn(64, generator=g, dtype=torch.float64), -1)
        vw = torch.randn(64, 8, generator=g, dtype=torch.float64) * torch.randn(64, 1, generator=g).exp()
        keeps = [torch.zeros(64, dtype=torch.bool).index_fill(0, perturbation_constrained_select(
            attn, vw.abs().sum(-1), 16, alpha), True) for alpha in (1.0, 0.25)]
        won += float(output_perturbation(attn, keeps[1], vw)) < float(output_perturbation(attn, keeps[0], vw))
        top_mass += float(attn.topk(16).values.sum()) / 200
    wins[sharpness] = won / 200
    print(f"sharpness {sharpness}: top-16 keeps {top_mass:.2f} of the mass; Algorithm 1's L lower in "
          f"{wins[sharpness]:.2f} of the heads")
# END SOLUTION
assert set(wins) == {0.5, 1, 2, 4, 8} and all(0 <= w <= 1 for w in wins.values()), \
    "wins maps each sharpness to the fraction of the 200 heads where Algorithm 1's L is lower"

# %% [markdown]
# ### Exercise 3: the two readings of Algorithm 2 line 9
#
# The default `stage2="host"` multiplies SnapKV's *pooled* vote by the value size; the literal
# `stage2="window"` multiplies the un-pooled window attention. On the sample of section 3 (its prompt `ids`,
# the value's positions `digits` and the 12 positions `before` them), count per (layer, KV head) how many of
# the digits and of the 12 tokens before them each reading keeps with a budget of 256 (`kept_digits` and
# `kept_before`, one list per reading, keys `"host"` and `"window"`; a layer's kept positions are
# `cache.layers[l].pos[0]`, one row per KV head), and in how many (layer, KV head) the pooled reading keeps
# at least as many digits. Then try `kernel=1` (no pooling): do the two readings agree?

# %% tags=["needs:two_stage"]
# BEGIN SOLUTION [critical_kv] per stage2: prefill make_policy("critical_kv", 256, stage2=...); count isin(digits, p)
kept_digits, kept_before = {}, {}
for reading in ("host", "window"):
    cache = KVCache(cfg, make_policy("critical_kv", budget=256, stage2=reading))
    prefill(model, ids, cache)
    kept_digits[reading] = [int(torch.isin(digits, p).sum()) for layer in cache.layers for p in layer.pos[0]]
    kept_before[reading] = [int(torch.isin(before, p).sum()) for layer in cache.layers for p in layer.pos[0]]
# END SOLUTION
assert set(kept_digits) == set(kept_before) == {"host", "window"} and all(
    len(v) == cfg.n_layer * cfg.n_kv_head for v in [*kept_digits.values(), *kept_before.values()]), \
    "one count per (layer, KV head), in the order of cache.layers and each layer's KV heads, for each reading"
assert kept_digits["host"] != kept_digits["window"], \
    "the two readings keep the same digits: pass stage2='host' and stage2='window' to make_policy"
for reading in ("host", "window"):
    print(f"stage2={reading!r:<9} digits kept per (layer, KV head): {kept_digits[reading]}, "
          f"key tokens before them: {kept_before[reading]}")
print(f"the pooled reading keeps at least as many digits in "
      f"{sum(h >= w for h, w in zip(kept_digits['host'], kept_digits['window']))} of {len(kept_digits['host'])}")

# %% [markdown]
# **Go further**: the lab [labs/04_critical_kv_readings.ipynb](labs/04_critical_kv_readings.ipynb) follows
# section 3's sample through every variant over SnapKV and AdaKV; counts, head by head, where the selection
# lowers the perturbation (the paper's §5.1); measures accuracy and the other metrics, the $\alpha$ ablation
# and Assumption 1; and sets each of the paper's claims against what we measure, on both models. CriticalKV
# also wraps H2O, which has no window: `python -m methods.compare --methods h2o "critical_kv(h2o)"`.
