# %% [markdown]
# # 04 CriticalKV: perturbation-constrained selection
#
# SnapKV keeps the entries the observation window attends to most. Feng et al. ("Identify Critical KV Cache
# in LLM Inference from an Output Perturbation Perspective", [arXiv 2502.03805](https://arxiv.org/abs/2502.03805))
# ask what "critical" should mean: an entry matters by how much dropping it changes the attention
# *output*, and that depends on its attention weight **and** on the size of its value after the output
# projection, `||V_i W_O||_1`. Their two-stage selection (Algorithm 1) keeps a share `alpha` of the budget by
# attention and fills the rest by `A_i * ||V_i W_O||_1`; plugged into SnapKV and AdaKV (Algorithm 2) it
# lowered the output perturbation in about 74% of the attention heads of 7-8B models (§5.1).
#
# **You will learn**
#
# 1. the perturbation `L = ||(A - A') V W_O||_1`, its bound `theta` (Theorem 2), and why the bound brings in
#    the projected value norms;
# 2. what happens on the sample where SnapKV evicts the needle's value digits (the motivation of this
#    notebook);
# 3. the two readings of Algorithm 2's stage 2 (line 9): the host's *pooled* window vote times the value
#    norm, as the authors' code runs it (our default), or the *un-pooled* window attention, as the line
#    reads (`stage2="window"`), and why pooling decides whether a retrieved needle's digits survive;
# 4. whether the criterion lowers the perturbation at our scale, first with the true query (Algorithm 1
#    alone), then inside SnapKV and AdaKV with the observation window (Algorithm 2), in both readings and at
#    kvpress's settings: head by head, at the final hidden state, in accuracy and KL, and across `alpha`;
# 5. how often the paper's Assumption 1 holds on a 0.87M-parameter model, and what that does to the theory;
# 6. which of these findings change on a real language model, SmolLM2-135M (section 7).
#
# Code: `methods/critical_kv.py` (the functions and the `critical_kv` wrapper), `methods/evaluation/harness.py`
# (traces against the full cache), `methods/compare.py` (accuracy tables). Section 1 writes Algorithm 1 out
# and checks it against the library; everything after it uses the library.

# %%
import os
import sys
import time
from types import SimpleNamespace

TINY = os.environ.get("NANOLLM_TINY") == "1"      # CI runs the notebook in a quick tiny mode
if not os.path.isdir("nanollm") and os.path.isdir(os.path.join("..", "nanollm")):
    sys.path.insert(0, os.path.abspath(".."))      # opened from notebooks/: make the repo importable

import matplotlib.pyplot as plt
import torch

from methods import make_policy
from methods.critical_kv import (
    assumption1_sigma,
    output_perturbation,
    perturbation_bound,
    perturbation_constrained_select,
    projected_output_l1,
    projected_value_norms,
    projected_values,
    renormalized_attention,
)
from methods.evaluation.compare import Variant, format_intervals, format_tables, run
from methods.evaluation.harness import compare_traces, greedy_accuracies, greedy_accuracy, trace, traces
from methods.evaluation.intervals import describe, paired_difference, wilson
from methods.evaluation.viz import kept_mask, needle_spans, plot_kept, print_mode
from methods.presets import preset_options
from methods.snapkv import pool1d
from nanollm import KVCache, decode_step, load, prefill
from nanollm.data.evaluate import MODES, answer
from nanollm.data.tasks import make_sample

torch.set_num_threads(1)
torch.manual_seed(0)
model, tok, card = load("retrieval-llama")
cfg = model.config
G = cfg.n_head // cfg.n_kv_head                                  # query heads per KV head
W_O = [block.attn.o_proj.weight.detach() for block in model.blocks]   # (D, H*d) per layer

LENGTH = 256 if TINY else 512                                    # tokens per sample
TASKS = card["default_suite"][:1] if TINY else card["default_suite"]
N_SAMPLES = 1 if TINY else 5                                     # samples per task (seeds 0..N-1)
HEAD_RATIOS = [0.25] if TINY else [0.1, 0.25]                    # keep ratios of the head-wise study
COMPARE_RATIOS = [0.25] if TINY else [0.25, 0.5]                 # keep ratios of the accuracy table
MODE = "question_in_prompt"                                      # the head-wise study's mode (both in §5)
LITERAL = {"stage2": "window"}                                   # Algorithm 2 line 9 read literally (the ablation)
KVPRESS = preset_options("critical_kv", "kvpress")               # kvpress's CriticalKVPress settings
KVPRESS_ADA = preset_options("critical_kv(adakv(snapkv))", "kvpress")    # and its CriticalAdaKVPress
T0 = time.time()
print(f"tiny mode: {TINY}; {len(TASKS)} task(s) x {N_SAMPLES} sample(s), {LENGTH} tokens; torch {torch.__version__}")
print_mode(TINY)                                   # quick mode: the text describes another run
print(f"kvpress's settings: CriticalSnapKV {KVPRESS}; CriticalAdaKV {KVPRESS_ADA}")

# %% [markdown]
# ## 1. The perturbation and its bound, on one head
#
# CriticalKV's idea in one paragraph. One head, one query: the output is `o = A V W_O` (Eq. 2). Keep a 0/1
# mask $\mathcal{N}$ of $b$ entries; attention renormalises over what is kept (Theorem 1, Eq. 6), exactly the
# masked softmax, and the output moves by the perturbation $\mathcal{L}$ (Eq. 5):
#
# $$A' = \frac{\mathcal{N} \odot A}{\sum_{i=1}^{n} \mathcal{N}_i A_i} \quad \text{(Eq. 6)}, \qquad
# \mathcal{L} = \big\|(A - A')\, V W^O\big\|_1 \quad \text{(Eq. 5)}.$$
#
# The triangle inequality bounds it (§3.3, Theorem 2, Eq. 8), with `P_i = ||V_i W_O||_1` and
# `C = sum_i A_i P_i`:
#
# $$L \le \theta = C - \Big(2 - \frac{1}{\sum_i N_i A_i}\Big) \sum_i N_i A_i P_i .$$
#
# If the kept attention mass exceeds 1/2 (Assumption 1), the factor in brackets is positive and the bound
# falls fastest by keeping large `A_i * P_i`. Hence CriticalKV's two-stage selection (§3.4, Algorithm 1):
# stage 1 keeps the top `alpha * b` entries by attention, to secure that mass; stage 2 fills the rest of the
# budget `b` by `A_i * P_i`. Here it is for one head, written out and checked against the library's
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


g = torch.Generator().manual_seed(0)
n_heads = 300
for trial in range(n_heads):
    n = int(torch.randint(4, 40, (1,), generator=g))                  # entries in this head
    attn = torch.softmax(torch.randn(n, generator=g) * 3, -1)         # (n,) one query's attention
    vnorm = torch.rand(n, generator=g) * 4                            # (n,) P_i = ||V_i W_O||_1
    b = int(torch.randint(1, n + 1, (1,), generator=g))               # the budget
    alpha = [0.0, 0.25, 0.5, 1.0][trial % 4]
    assert torch.equal(algorithm1(attn, vnorm, b, alpha), perturbation_constrained_select(attn, vnorm, b, alpha))
print(f"Algorithm 1 written out keeps the library's entries in all {n_heads} random heads (alpha 0, 0.25, 0.5, 1).")

# %% [markdown]
# Two facts behind the bound, on random heads: the masked softmax is Theorem 1's renormalisation, and `L`
# never exceeds `theta`.

# %%
# needs: output_perturbation, perturbation_bound
g = torch.Generator().manual_seed(0)
worst_gap, identity_err = float("inf"), 0.0
for _ in range(500 if TINY else 2000):
    n, d, D = 30, 4, 8
    logits = torch.randn(n, generator=g, dtype=torch.float64) * float(torch.empty(1).uniform_(0.1, 5, generator=g))
    attn = torch.softmax(logits, -1)
    vw = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(d, D, generator=g, dtype=torch.float64)
    keep = torch.rand(n, generator=g) < 0.3
    keep[0] = True
    worst_gap = min(worst_gap, float(perturbation_bound(attn, keep, vw.abs().sum(-1))
                                     - output_perturbation(attn, keep, vw)))
    masked = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)
    identity_err = max(identity_err, float((masked - renormalized_attention(attn, keep)).abs().max()))
print(f"Theorem 1: max |softmax(a + M) - N*A/sum(N*A)| = {identity_err:.1e}")
print(f"Theorem 2: min over random masks of theta - L = {worst_gap:.3f}  (>= 0: the bound holds)")

# %% [markdown]
# The hand example of `tests/methods/test_critical_kv.py`: four entries, a budget of two. Which two does each
# rule keep, and how far does the output move?

# %%
# needs: output_perturbation, perturbation_bound, two_stage
attn = torch.tensor([0.5, 0.2, 0.18, 0.12], dtype=torch.float64)                # (4,) one query's attention
vw = torch.tensor([[1.0], [0.1], [-2.0], [1.0]], dtype=torch.float64) \
    @ torch.tensor([[1.0, 0.5]], dtype=torch.float64)                           # (4, 2) V W_O
P = vw.abs().sum(-1)                                                            # (4,) P_i = ||V_i W_O||_1
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), dpi=80, sharey=True)
for ax, (name, alpha) in zip(axes, [("attention top-2", 1.0), ("Algorithm 1, alpha = 0.5", 0.5)]):
    idx = perturbation_constrained_select(attn, P, 2, alpha)
    keep = torch.zeros(4, dtype=torch.bool).index_fill(0, idx, True)
    L, theta = float(output_perturbation(attn, keep, vw)), float(perturbation_bound(attn, keep, P))
    shade = [1.0 if k else 0.25 for k in keep.tolist()]                         # evicted entries pale
    for x in range(4):
        ax.bar(x - 0.2, float(attn[x]), 0.4, color="C0", alpha=shade[x], label="attention A" if x == 0 else None)
        ax.bar(x + 0.2, float(attn[x] * P[x]), 0.4, color="C1", alpha=shade[x], label="A x P" if x == 0 else None)
        ax.text(x, 0.8, "kept" if keep[x] else "evicted", ha="center", fontsize=9)
    ax.set(title=f"{name}: L = {L:.3f}", xlabel="entry", xticks=range(4), ylim=(0, 0.9))
    print(f"{name:<26} keeps {idx.tolist()}: kept mass {float(attn[keep].sum()):.2f}, L = {L:.3f}, theta = {theta:.3f}")
axes[0].set(ylabel="weight")
axes[1].legend(loc="center right", fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Attention top-2 keeps the two entries with the most attention; Algorithm 1 keeps entry 2 instead of entry 1,
# because its small attention (0.18) multiplies a large projected value (`P = 3`), and the output moves by
# 0.111 instead of 0.694.
#
# One more identity helps to read everything below. Split the full output into the kept part and the
# dropped part, `o = m * o_kept + (1 - m) * o_dropped` with `m = sum(N*A)` the kept mass and each part the
# attention-weighted mean of its projected values. The compressed output is `o_kept`, so
#
# $$L = (1 - m)\, \| o_\text{dropped} - o_\text{kept} \|_1 .$$
#
# The perturbation is the dropped mass times how far the dropped values are from the kept ones. Attention
# top-k maximises `m`; Algorithm 1 gives up some mass to keep large values. Which one wins depends on how
# concentrated the attention is: Theorem 2's bound ignores that dropped values partly cancel, and with
# spread-out attention (small `m`) the factor `2 - 1/m` is small or negative, and large `A * P` no longer
# lowers the bound.

# %%
# needs: output_perturbation, perturbation_bound, two_stage
keep = torch.tensor([True, False, True, False])                  # Algorithm 1's choice above
m = float((attn * keep).sum())
o_kept = renormalized_attention(attn, keep) @ vw
o_dropped = renormalized_attention(attn, ~keep) @ vw
print(f"L = {float(output_perturbation(attn, keep, vw)):.6f};  (1 - m) ||o_dropped - o_kept||_1 = "
      f"{(1 - m) * float((o_dropped - o_kept).abs().sum()):.6f}")

# %% [markdown]
# ## 2. The sample that motivated this notebook
#
# Measured on the bundled model: with the question in the prompt and a budget of 256 of 494 prompt
# tokens, SnapKV answers `999999...` on a single-needle sample. It is `niah_single_noise` at 512 tokens,
# **seed 1** (494 prompt tokens, value 196238). Which of the six value digits does each variant keep, per
# layer and KV head, and what does it answer?

# %%
# needs: two_stage
sample = make_sample("niah_single_noise", tok, 512, seed=1)
value_ids = tok.encode(sample.answers[0])
start = next(i for i in range(len(sample.context_ids)) if sample.context_ids[i:i + len(value_ids)] == value_ids)
digits = torch.arange(start, start + len(value_ids))              # positions of the value's digit tokens
before = torch.arange(start - 12, start)                          # the 12 tokens before them (the key)
print(f"{len(sample.prompt_ids)} prompt tokens; value {sample.answers[0]} at positions {digits.tolist()}; "
      f"before it: {tok.decode(sample.context_ids[start - 12:start])!r}")
SAMPLE_VARIANTS = {                  # label -> (method spec, options)
    "snapkv": ("snapkv", {}),
    "critical_kv": ("critical_kv", {}),                            # CriticalSnapKV: pooled stage 2, alpha 0.25
    "critical_kv literal": ("critical_kv", LITERAL),               # un-pooled window attention in stage 2
    "critical_kv kvpress": ("critical_kv", KVPRESS),
    "adakv": ("adakv", {}),
    "critical_kv(adakv)": ("critical_kv(adakv(snapkv))", {}),      # CriticalAdaKV
    "crit(adakv) literal": ("critical_kv(adakv(snapkv))", LITERAL),
    "crit(adakv) kvpress": ("critical_kv(adakv(snapkv))", KVPRESS_ADA),
}
ids = torch.tensor([sample.prompt_ids])
print(f"\n{'variant':<22}{'answer':<18}"
      + "".join(f"L{l}h{j}".center(9) for l in range(cfg.n_layer) for j in range(cfg.n_kv_head)))
for label, (spec, opts) in SAMPLE_VARIANTS.items():
    cache = KVCache(cfg, make_policy(spec, budget=256, **opts))
    prefill(model, ids, cache)
    cells = [f"{int(torch.isin(digits, p).sum())}/6 ({int(torch.isin(before, p).sum()):>2})"
             for layer in cache.layers for p in layer.pos[0]]
    said = answer(model, tok, sample, MODE, make_policy(spec, budget=256, **opts)).strip()
    print(f"{label:<22}{said[:16]:<18}" + "".join(c.center(9) for c in cells))
print("\ncells: value digits kept / 6 (tokens of the 12 before them kept)")


# %% [markdown]
# No variant recovers 196238. SnapKV keeps 1 of the 6 digits in both layer-3 KV heads (with 3 and 12 of the 12
# key tokens before them). The two readings of CriticalSnapKV differ only in stage 2, and it shows: the default
# (pooled) keeps 0 and 2 digits in layer 3 and 1, 1 and 2 in the layer-1 and layer-2 heads where the literal
# reading keeps 0, 0 and 1; it answers "111188", the right first digit, where the literal reading answers
# "222288888888888". CriticalAdaKV answers "222288888888888" pooled and "999999999999999" literal, as AdaKV does.
#
# **Two readings of Algorithm 2 line 9.** Stage 2 ranks by an attention estimate times `||V_i W_O||_1`. Line 3
# computes `Abar`, the window's mean attention; line 4 max-pools it into `Abar'`, which stage 1 (line 8) ranks
# by; line 9 writes the stage-2 score with `Abar`, *before* pooling. Read literally (`stage2="window"`), stage 2
# sees a retrieved needle only where the window's queries look: on the key's tokens, not on the digits after
# them. The authors' code, kvpress's `CriticalKVPress` (an earlier version of it names the paper's first author
# as its reviewer), multiplies the value norms by the host's *pooled* score instead, the same score stage 1
# ranks by. Max pooling (SnapKV's kernel of 7) hands a key token's vote to its three neighbours on either side,
# so the pooled stage 2 keeps the digits next to a retrieved key that the un-pooled one drops: in Exercise 4's
# count on this sample, the pooled reading keeps at least as many digits as the literal one in 8 of 8 (layer, KV
# head). We take the authors' code as the default, since it is what they ran, and keep the literal reading as
# the ablation `stage2="window"`; every comparison below shows both.
#
# Why neither reading rescues the value here: the observation window (the question's tokens) barely looks at
# the value. The figure shows, in layer 3 around the needle: the window's mean attention `Abar` (the literal
# stage 2; `policy.last[layer]["abar"]`), the same after SnapKV's pooling (the default stage 2), the attention
# of the first answer token's query in the full cache (what decoding actually asks for), and the projected
# value norms `P` (one line per query head).

# %%
# needs: two_stage
layer = 3
policy = make_policy("critical_kv", budget=256)
prefill(model, ids, KVCache(cfg, policy))
abar = policy.last[layer]["abar"][0]                                  # (H, T) window attention, not pooled
pooled = pool1d(abar, policy.inner.kernel, policy.inner.pooling)      # (H, T) SnapKV's pooled vote, per query
full = trace(model, sample, MODE, None, record_probs=True)           # full cache, first decode step
full_cache = KVCache(cfg)
prefill(model, ids, full_cache)
P = projected_value_norms(full_cache.layers[layer].v, W_O[layer], cfg.n_head)[0]      # (H, T)
span = torch.arange(start - 14, start + len(value_ids) + 4)
fig, axes = plt.subplots(4, 1, figsize=(10, 8.2), dpi=80, sharex=True)
for h in range(cfg.n_head):
    axes[0].plot(abar[h, span].tolist(), marker=".", label=f"query head {h} (KV head {h // G})")
    axes[1].plot(pooled[h, span].tolist(), marker=".")
    axes[2].plot(full.probs[layer][h, span].tolist(), marker=".")
    axes[3].plot(P[h, span].tolist(), marker=".")
axes[0].set(ylabel="window Abar\n(literal stage 2)", title=f"layer {layer}, around the needle (value digits shaded)")
axes[1].set(ylabel="pooled vote\n(default stage 2)")
axes[2].set(ylabel="first answer\nquery's attention")
axes[3].set(ylabel="P = ||v W_O^(h)||_1", xlabel="prompt token (the needle's key, then its value)")
axes[3].set_xticks(range(len(span)), [repr(tok.decode([sample.prompt_ids[p]]))[1:-1] for p in span.tolist()],
                   rotation=90)
for ax in axes:
    ax.axvspan(14 - 0.5, 14 + len(value_ids) - 0.5, color="gold", alpha=0.3)
axes[0].legend(fontsize=7, ncol=2)
plt.tight_layout()
plt.show()
mass = lambda a: float(a[:, digits].sum(-1).mean())                 # noqa: E731  mean over query heads
print(f"layer {layer}: attention mass on the 6 digits, mean over query heads: window Abar {mass(abar):.3f}, "
      f"pooled vote {mass(pooled):.3f}, first answer query {mass(full.probs[layer]):.3f}")
T_s = len(sample.prompt_ids)
P_kv = P[:, :T_s].view(cfg.n_kv_head, G, T_s).mean(1)                # (H_kv, T) group-mean value norm
stage2 = {"literal: Abar x P": (abar * P[:, :T_s]).view(cfg.n_kv_head, G, T_s).mean(1),
          "default: pooled x P": pooled.view(cfg.n_kv_head, G, T_s).mean(1) * P_kv}
for name, score in stage2.items():                                    # (H_kv, T) stage-2 score per KV head
    rank = score.argsort(-1, descending=True).argsort(-1)             # 0 = ranked first
    print(f"stage 2, {name:<20} rank of the value digits (of {T_s}) per KV head: "
          + "; ".join(f"KV head {j}: {rank[j, digits].tolist()}" for j in range(cfg.n_kv_head)))

# %% [markdown]
# The figure shows why the value norms cannot help much: in layer 3 the window's queries look at the needle's
# key, the first answer token's query at its value. The window's queries put 0.003 of their attention (mean
# over query heads) on the six digits, and what they do attend to is the key ("royal-field"). Pooling moves
# some of the key's vote onto the digits next to it (0.007 on the six digits), which is why the pooled stage 2
# ranks the value's first digit at 216 of 494 in KV head 1 and the literal one at 493. The first answer
# token's query, in the two query heads of KV head 1, puts almost all of its attention on the value's first
# digit (0.519 on the six digits, mean over the four query heads). The question looks at the *key*; the
# answer copies the *value*. What fails on this sample is the observation window as a stand-in for the
# decoding queries, which both stages and both readings inherit; pooling only softens it.
#
# ## 3. Algorithm 1 with the true query
#
# Sections 3-4 of the paper reason about one known query. Before bringing in the observation window, test
# exactly that: at the first decode step of the full cache, for every layer and query head, choose `b`
# of the entries either by attention top-k (`alpha = 1`) or by Algorithm 1 (`alpha = 0.25`), using that
# step's *true* attention `A` and the layer's projected values, and compute `L` (Eq. 5) and `theta`
# (Eq. 8) for both. No proxy, no pooling, no window: if the criterion helps anywhere, it helps here.

# %%
# needs: output_perturbation, perturbation_bound, two_stage
def algorithm1_vs_topk(model, tok, tasks: list[str], n_samples: int, length: int, ratios: list[float]) -> dict:
    """(ratio, layer) -> rows [L_topk, theta_topk, mass_topk, L_alg1, theta_alg1, mass_alg1], one row per
    (sample, query head): attention top-k (alpha = 1) vs Algorithm 1 (alpha = 0.25) on the true attention of
    the full cache's first decode step, b = round(ratio * length)."""
    cfg = model.config
    w_o = [block.attn.o_proj.weight.detach() for block in model.blocks]     # (D, H*d) per layer
    rows = {}
    for task in tasks:
        for i in range(n_samples):
            s = make_sample(task, tok, length, seed=i)
            full = trace(model, s, MODE, None, record_probs=True)        # first decode step's attention
            cache = KVCache(cfg)
            prefill(model, torch.tensor([s.prompt_ids]), cache)
            decode_step(model, torch.tensor([s.target_ids[0]]), cache)  # the same step: its values
            for l in range(cfg.n_layer):
                for h in range(cfg.n_head):
                    A = full.probs[l][h].double()                         # (T+1,)
                    vw = projected_values(cache.layers[l].v, w_o[l], h, cfg.n_head)[0].double()   # (T+1, D)
                    Pn = vw.abs().sum(-1)
                    for ratio in ratios:
                        row = []
                        for alpha in (1.0, 0.25):
                            keep = torch.zeros_like(A, dtype=torch.bool)
                            keep[perturbation_constrained_select(A, Pn, round(ratio * length), alpha)] = True
                            row += [float(output_perturbation(A, keep, vw)), float(perturbation_bound(A, keep, Pn)),
                                    float(A[keep].sum())]
                        rows.setdefault((ratio, l), []).append(row)
    return rows


alg1 = algorithm1_vs_topk(model, tok, TASKS, N_SAMPLES, LENGTH, HEAD_RATIOS)
print(f"{'keep':>5} {'layer':>5} | {'Alg.1 L lower':>13} {'Alg.1 theta lower':>17} | {'mean L top-k':>12} "
      f"{'mean L Alg.1':>12} | {'kept mass top-k':>15} {'Alg.1':>6}")
for ratio in HEAD_RATIOS:
    for l in range(cfg.n_layer):
        x = torch.tensor(alg1[(ratio, l)])
        print(f"{ratio:>5} {l:>5} | {float((x[:, 3] < x[:, 0]).float().mean()):>13.2f} "
              f"{float((x[:, 4] < x[:, 1]).float().mean()):>17.2f} | {float(x[:, 0].mean()):>12.3f} "
              f"{float(x[:, 3].mean()):>12.3f} | {float(x[:, 2].mean()):>15.2f} {float(x[:, 5].mean()):>6.2f}")
    x = torch.cat([torch.tensor(alg1[(ratio, l)]) for l in range(cfg.n_layer)])
    print(f"{ratio:>5} {'all':>5} | {float((x[:, 3] < x[:, 0]).float().mean()):>13.2f} "
          f"{float((x[:, 4] < x[:, 1]).float().mean()):>17.2f} | {float(x[:, 0].mean()):>12.3f} "
          f"{float(x[:, 3].mean()):>12.3f} |")
print(f"({len(TASKS) * N_SAMPLES} samples x {cfg.n_head} query heads per layer; 'lower' = fraction of (sample, head) "
      "pairs where Algorithm 1's value is strictly lower)")

# %% [markdown]
# With the true query, on this model, Algorithm 1 loses to attention top-k: in the committed run it lowers
# `L` in 29% (keep ratio 0.1) and 26% (0.25) of the (sample, head) pairs, with a higher mean `L` in every
# layer, and it lowers even Theorem 2's bound `theta` in only 14% and 10%. Why the bound does not follow:
# Theorem 3 replaces the factor `2 - 1/m` (with `m` the kept mass) by `2 - 1/sigma`, with `sigma` the mass
# stage 1 secured, and so treats `m` as fixed; but every entry stage 2 picks for its value instead of its
# attention lowers `m`, and `theta` (like `L = (1 - m) ||o_dropped - o_kept||_1`) grows as `m` falls.
# Attention here is not concentrated enough for that to be negligible: keeping 10% of the entries by
# attention keeps 67% of the mass on average (51% in layer 0, 61% in layer 2), keeping 25% keeps 79%.
# The paper's argument leans on a power law (§3.5: "a small subset of cache entries accounts for the
# majority of the attention weights"), which holds in our layer 1 (90-95% of the mass kept) and not in
# the others; even in layer 1 Algorithm 1 lowers `L` in only 31-39% of the pairs.
#
# ## 4. Inside SnapKV and AdaKV (Algorithm 2), head by head
#
# Now the real thing: `critical_kv` (CriticalSnapKV) and `critical_kv(adakv(snapkv))` (CriticalAdaKV)
# against their hosts, each in three settings: the default (pooled stage 2, `alpha = 0.25`), the literal
# reading of Algorithm 2 line 9 (`stage2="window"`, otherwise the same), and kvpress's settings
# (`preset_options(..., "kvpress")`: pooled stage 2, `alpha = 0.5` of the whole budget, `epsilon = 1e-4`, and
# SnapKV's window 64, kernel 5, average pooling). Each runs through the harness on the same samples (question
# in the prompt): the per-head output perturbation `L_h = ||(o_full - o) W_O^(h)||_1` at the first decode
# step (`projected_output_l1`, the paper's §5.1 quantity), the final hidden state's relative error (the
# harness's `perturbation`, §5.2), the answer's KL and accuracy. The same loop runs the `alpha` ablation's
# ends (0: stage 2 only; 1: the host itself) and records Assumption 1's `sigma` for `critical_kv` (stage 1,
# and so `sigma`, is the same in both readings). The metrics (acc, KL, pert, lost, keep ratio) and the two
# modes are defined in the glossary of notebook 01 (01_baselines).

# %%
# needs: two_stage
VARIANTS = {                          # label -> (method spec, options)
    "snapkv": ("snapkv", {}),
    "critical_kv": ("critical_kv", {}),                               # pooled stage 2 (the authors' code)
    "critical_kv literal": ("critical_kv", LITERAL),                  # Algorithm 2 line 9 read literally
    "critical_kv kvpress": ("critical_kv", KVPRESS),                  # kvpress's settings
    "adakv": ("adakv", {}),
    "critical_kv(adakv)": ("critical_kv(adakv(snapkv))", {}),
    "crit(adakv) literal": ("critical_kv(adakv(snapkv))", LITERAL),
    "crit(adakv) kvpress": ("critical_kv(adakv(snapkv))", KVPRESS_ADA),
    "snapkv kvpress": ("snapkv", preset_options("snapkv", "kvpress")),   # the kvpress rows' own hosts
    "adakv kvpress": ("adakv", preset_options("adakv", "kvpress")),
    "alpha=0": ("critical_kv", {"alpha": 0.0}),                       # stage 2 only (Appendix D)
    "alpha=1": ("critical_kv", {"alpha": 1.0}),                       # stage 1 only: SnapKV itself
}
res = {}                              # (label, ratio) -> {metric: [one value per sample]}
t_loop = time.time()
for task in TASKS:
    for i in range(N_SAMPLES):
        s = make_sample(task, tok, LENGTH, seed=i)
        full = trace(model, s, MODE, None, record_probs=True)
        for ratio in HEAD_RATIOS:
            b = round(ratio * LENGTH)
            for label, (spec, opts) in VARIANTS.items():
                policy = make_policy(spec, budget=b, **opts)
                tr = trace(model, s, MODE, policy)
                m = compare_traces(full, tr, G)
                acc, _ = greedy_accuracy(model, tok, s, tr)
                r = res.setdefault((label, ratio), {})
                r.setdefault("head_l1", []).append(torch.stack(
                    [projected_output_l1(full.outs[l], tr.outs[l], W_O[l]) for l in range(cfg.n_layer)]))  # (L, H)
                for key, value in [("pert", m["perturbation"]), ("kl", m["kl"]), ("acc", acc)]:
                    r.setdefault(key, []).append(value)
                if label == "critical_kv":    # Assumption 1: window attention and the decode query's
                    r.setdefault("sigma_window", []).append(torch.stack([policy.last[l]["sigma"][0]
                                                                         for l in range(cfg.n_layer)]))
                    dec = torch.zeros(cfg.n_layer, cfg.n_head)
                    for l in range(cfg.n_layer):
                        stage1 = policy.last[l]["stage1_pos"][0]          # (H_kv, T) positions, -1 elsewhere
                        for h in range(cfg.n_head):
                            in_stage1 = torch.isin(full.attended[l][h // G], stage1[h // G])
                            dec[l, h] = assumption1_sigma(full.probs[l][h], in_stage1)
                    r.setdefault("sigma_decode", []).append(dec)
print(f"{len(VARIANTS)} variants x {len(HEAD_RATIOS)} keep ratios x {len(TASKS) * N_SAMPLES} samples: "
      f"{time.time() - t_loop:.0f} s")

# %% [markdown]
# ### 4.1 Head-wise: in how many heads is the perturbation lower with the selection?
#
# The paper (§5.1, Figure 2) compares each head's output perturbation with and without the selection and
# counts the heads where it is lower: 819 of 1,024 heads for Llama-3.1-8B and 748 for Mistral-7B with
# SnapKV, 74.3% on average over its four cases. We count (layer, head) pairs by their mean over samples
# (16 heads here), and also every (sample, layer, head) triple.

# %%
# needs: two_stage
PAIRS = [("snapkv", "critical_kv"), ("snapkv", "critical_kv literal"), ("snapkv kvpress", "critical_kv kvpress"),
         ("adakv", "critical_kv(adakv)"), ("adakv", "crit(adakv) literal"), ("adakv kvpress", "crit(adakv) kvpress"),
         ("snapkv", "alpha=0"), ("snapkv", "alpha=1")]            # (host, selection): kvpress's against its own host
HOST_OF = {crit: host for host, crit in PAIRS}
print(f"{'keep':>5}  {'selection':<20}{'vs':<15}| {'heads lower (mean)':>18} {'triples lower':>13} {'equal':>6} | "
      f"lower per layer (triples)")
headwise = {}
for ratio in HEAD_RATIOS:
    for host, crit in PAIRS:
        a, c = torch.stack(res[(host, ratio)]["head_l1"]), torch.stack(res[(crit, ratio)]["head_l1"])   # (S, L, H)
        headwise[(ratio, crit)] = float((c.mean(0) < a.mean(0)).float().mean())
        per_layer = " ".join(f"{float(x):.2f}" for x in (c < a).float().mean((0, 2)))
        print(f"{ratio:>5}  {crit:<20}{host:<15}| {headwise[(ratio, crit)]:>18.2f} "
              f"{float((c < a).float().mean()):>13.2f} {float((c == a).float().mean()):>6.2f} | {per_layer}")

# %%
# needs: two_stage
READINGS = [("critical_kv", "pooled stage 2 (default)"), ("critical_kv literal", "literal stage 2")]
fig, axes = plt.subplots(len(READINGS), len(HEAD_RATIOS), figsize=(5 * len(HEAD_RATIOS), 4.2 * len(READINGS)),
                         dpi=80, squeeze=False)
for row, (crit, reading) in enumerate(READINGS):
    for ax, ratio in zip(axes[row], HEAD_RATIOS):
        a = torch.stack(res[("snapkv", ratio)]["head_l1"]).mean(0)    # (L, H) mean over samples
        c = torch.stack(res[(crit, ratio)]["head_l1"]).mean(0)
        for l in range(cfg.n_layer):
            ax.scatter(a[l].tolist(), c[l].tolist(), label=f"layer {l}", s=30)
        top = float(torch.cat([a, c]).max()) * 1.05
        ax.plot([0, top], [0, top], "k--", lw=0.8)
        ax.set(xlabel="SnapKV: per-head L (mean over samples)", ylabel=f"CriticalSnapKV, {reading}:\nper-head L",
               title=f"{reading}, keep {ratio}: {headwise[(ratio, crit)]:.0%} of heads below")
        ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Not reproduced at our scale, in either reading: with the selection, the per-head perturbation (mean over 30
# samples) is lower in 44% (keep ratio 0.1) and 31% (0.25) of the 16 heads for CriticalSnapKV with the default
# pooled stage 2, 38% and 38% with the literal one; for CriticalAdaKV in 50% and 44% pooled, 56% and 38%
# literal; against the paper's 74%. Counted per (sample, layer, head), it is a coin toss at keep ratio 0.1
# (0.50-0.56 of the triples) and a loss at 0.25 (0.36-0.43). At kvpress's settings, against SnapKV and AdaKV at
# kvpress's settings, the selection is its host in every head at keep ratio 0.1 (the budget of 51 is smaller
# than kvpress's 64-token window, which takes all of it) and lower in 31% and 44% of the heads at 0.25. At 0.25 both
# readings lose most in layer 0 (0.15-0.17 of its triples lower), the
# layer where Assumption 1 fails (section 4.3). `alpha=1` equals SnapKV in every head, as it must.
#
# ### 4.2 Final hidden state, KL, accuracy, and the alpha ablation
#
# The paper's §5.2 (Figure 3) reports a lower final-layer perturbation with the selection at every budget,
# and Appendix D (Table 5) that `alpha = 0` (stage 2 only) is slightly worse than 0.25 but still better
# than SnapKV. Per layer, `sum_h L_h` shows where the difference builds up.

# %%
# needs: two_stage
print(f"{'keep':>5}  {'variant':<20}| {'final pert':>10} {'KL':>7} {'acc':>6} | {'sum_h L_h per layer':>28}")
for ratio in HEAD_RATIOS:
    for label in VARIANTS:
        r = res[(label, ratio)]
        per_layer = torch.stack(r["head_l1"]).mean(0).sum(-1)           # (L,)
        print(f"{ratio:>5}  {label:<20}| {sum(r['pert']) / len(r['pert']):>10.3f} {sum(r['kl']) / len(r['kl']):>7.3f} "
              f"{sum(r['acc']) / len(r['acc']):>6.2f} | " + " ".join(f"{float(x):>6.2f}" for x in per_layer))
    print()
n = len(TASKS) * N_SAMPLES
print(f"mean over {n} samples ({len(TASKS)} tasks x {N_SAMPLES}), question in the prompt, {LENGTH} tokens. "
      "alpha=1 must equal snapkv exactly (the wrapper with a zero stage 2).")


def versus(results: dict, label: str, host: str, ratio: float, key: str, per_task: int) -> str:
    """``label`` minus ``host``, paired sample by sample (each task's samples resampled): "d [95%] verdict"."""
    split = lambda xs: [xs[t:t + per_task] for t in range(0, len(xs), per_task)]      # noqa: E731
    return describe(*paired_difference(split(results[(label, ratio)][key]), split(results[(host, ratio)][key])),
                    decimals=3)


print("\nwith the selection minus without, paired by sample: difference [95% interval] and the noise rule's verdict")
for ratio in HEAD_RATIOS:
    for host, crit in PAIRS[:-1]:                                       # alpha=1 is snapkv itself
        print(f"{ratio:>5}  {crit:<20} vs {host:<14}| " + " | ".join(
            f"{name} {versus(res, crit, host, ratio, key, N_SAMPLES):<32}"
            for name, key in [("pert", "pert"), ("KL", "kl"), ("acc", "acc")]))

# %% [markdown]
# The two readings part ways in the answer, not in the final hidden state. At keep ratio 0.25 every
# selection moves the final hidden state a little less than its host (SnapKV 0.865 -> 0.827 pooled, 0.835
# literal; AdaKV 0.855 -> 0.823 pooled, 0.757 literal): lower beyond noise for both pooled selections and for
# the literal CriticalAdaKV, within noise for the literal CriticalSnapKV (at 0.1 everything is about 1.0: the
# hidden state is lost either way). In KL the default pooled stage 2 is lower than its host, beyond noise
# (SnapKV 5.131 -> 4.835, -0.296 [-0.495, -0.136]; AdaKV 5.011 -> 4.876, -0.135 [-0.199, -0.075]), and the
# literal one higher, beyond noise (5.619, +0.488 [+0.044, +0.969]; 5.605, +0.594 [+0.138, +1.083]).
# Accuracy follows within noise (pooled 0.12 and 0.13 against 0.11 and 0.13; literal 0.07 and 0.09, 30
# answers each). At 0.1, where accuracy is 0.00-0.04 for everyone, CriticalSnapKV's KL is lower than SnapKV's
# in both readings (7.038 pooled, 6.935 literal, against 7.308) and CriticalAdaKV's within noise of AdaKV's.
# The earlier version of this notebook, run with the literal reading as the default, found "KL rises"; that
# was the literal reading. The per-layer sums show where both readings spend their stage-2 budget: the
# selection's perturbation is larger in layer 0 (2.87 -> 4.34 pooled, 4.18 literal, at 0.25) and layer 3.
#
# The `alpha` ablation (default pooled stage 2) at keep ratio 0.25: `alpha = 0` (stage 2 only) and 0.25 are
# about equal (KL 4.821 and 4.835, accuracy 0.12 and 0.12), both lower in KL than `alpha = 1` (SnapKV, 5.131)
# beyond noise and level with it in accuracy (0.11, within noise): the paper's Appendix D order between
# 0 and 0.25 is not visible here, its "both better than SnapKV" is, in KL.
#
# kvpress's settings, against SnapKV and AdaKV at kvpress's settings: at keep ratio 0.1 CriticalKV is its host
# (the 64-token window takes the whole budget of 51); at 0.25 its KL is lower but within noise (5.973 -> 5.750,
# -0.223 [-0.564, +0.054]; 5.749 -> 5.647, -0.103 [-0.236, +0.050]). kvpress's hosts are themselves worse than
# ours on this model (KL 5.973 and 5.749 against 5.131 and 5.011): a wider window leaves less of the budget to
# the prompt.
#
# ### 4.3 How often does Assumption 1 hold?
#
# Theorem 3 needs the stage-1 set to carry more than half of the attention (`sigma > 0.5`). The paper
# finds it in most heads, except a few in the first layer (Appendix A, Figure 4). We measure `sigma` for
# `critical_kv` per layer, over (sample, query head) pairs, in two ways: on the window attention `Abar`
# (the un-pooled mean of the window's queries, in both readings; the stage-1 set includes SnapKV's window,
# which the window attends to a lot), and on the attention of the first decode step's query in the full
# cache, the one whose output is perturbed. Stage 1 ranks by the host's pooled score in both readings, so
# `sigma` is the same for the literal one.

# %%
# needs: two_stage
print(f"{'keep':>5} {'layer':>5} | {'sigma > 0.5 on Abar':>19} {'mean':>6} | "
      f"{'sigma > 0.5, decode query':>25} {'mean':>6}")
for ratio in HEAD_RATIOS:
    sw = torch.stack(res[("critical_kv", ratio)]["sigma_window"])      # (S, L, H)
    sd = torch.stack(res[("critical_kv", ratio)]["sigma_decode"])
    for l in range(cfg.n_layer):
        print(f"{ratio:>5} {l:>5} | {float((sw[:, l] > 0.5).float().mean()):>19.2f} {float(sw[:, l].mean()):>6.2f} | "
              f"{float((sd[:, l] > 0.5).float().mean()):>25.2f} {float(sd[:, l].mean()):>6.2f}")

# %% [markdown]
# Not in most heads: on the window attention `sigma > 0.5` in 17% (0.1) and 33% (0.25) of the (sample,
# head) pairs, on the decode query in 40% and 46%. It holds in layer 1 (67-94% of the pairs) and in at most
# 47% elsewhere; it fails in layer 0 (0% on `Abar`, 28-37% on the decode query) as the paper finds for some
# of its first-layer heads, but here in layers 2 and 3 as well. Where it fails, `2 - 1/sigma <= 0` and
# Theorem 3 no longer says that large `A * P` lowers the bound.
#
# ## 5. Accuracy and KL against the keep ratio, both modes
#
# `methods.evaluation.compare.run` (the function behind `python -m methods.compare`) on the default suite, for the two
# hosts and both with the selection.

# %%
# needs: two_stage
t_cmp = time.time()
METHODS_C = [Variant(label, *VARIANTS[label]) for label in VARIANTS if not label.startswith("alpha")]
HOSTS_C = [(host, crit) for host, crit in PAIRS[:6]]                 # (host, with a selection)
budgets = [round(r * LENGTH) for r in COMPARE_RATIOS]
records = run(model, tok, METHODS_C, budgets, TASKS, MODES, N_SAMPLES, LENGTH, seed=0, progress=False)


def cell_records(method: str, mode: str, budget: int | None) -> list[dict]:
    """The records of one (method, mode, budget) cell, one per task, in the order of TASKS."""
    by_task = {r["task"]: r for r in records if (r["method"], r["mode"], r["budget"]) == (method, mode, budget)}
    return [by_task[t] for t in TASKS]


def acc_groups(method: str, mode: str, budget: int | None) -> list[list[float]]:
    return [r["accuracies"] for r in cell_records(method, mode, budget)]     # per task, each sample's accuracy


mean = lambda xs: sum(xs) / len(xs)                                     # noqa: E731
cell_mean = lambda method, mode, budget, key: mean([r[key] for r in cell_records(method, mode, budget)])  # noqa: E731
print(f"{'mode':<19}{'keep':>5}  {'selection':<20}| acc host -> selection, difference [95% paired]  "
      f"| KL host -> selection")
for mode in MODES:
    for ratio, b in zip(COMPARE_RATIOS, budgets):
        for host, crit in HOSTS_C:
            d = describe(*paired_difference(acc_groups(crit, mode, b), acc_groups(host, mode, b)))
            print(f"{mode:<19}{ratio:>5}  {crit:<20}| {cell_mean(host, mode, b, 'accuracy'):.2f} -> "
                  f"{cell_mean(crit, mode, b, 'accuracy'):.2f}  {d:<34}| {cell_mean(host, mode, b, 'kl'):.3f} -> "
                  f"{cell_mean(crit, mode, b, 'kl'):.3f}")
        print()
print(f"\n{len(TASKS)} tasks x {N_SAMPLES} samples per mode, {LENGTH} tokens, seed 0: {time.time() - t_cmp:.0f} s")

# %%
# needs: two_stage
def style(label: str) -> dict:
    """Colour by reading (host, pooled, literal, kvpress), line and marker by host (SnapKV, AdaKV)."""
    reading = ("host " if label not in HOST_OF else "") + ("kvpress" if "kvpress" in label else "literal"
                                                           if "literal" in label else "pooled")
    color = {"host pooled": "black", "host kvpress": "gray", "pooled": "C0", "literal": "C3", "kvpress": "C2"}[reading]
    return dict(color=color, ls="--" if "adakv" in label else "-", marker="s" if "adakv" in label else "o")


def pretty(label: str) -> str:
    """'crit(adakv) literal' -> 'CriticalAdaKV, literal'."""
    host = "AdaKV" if "adakv" in label else "SnapKV"
    if label not in HOST_OF:
        return host + (", kvpress" if "kvpress" in label else "")
    return f"Critical{host}, " + ("kvpress" if "kvpress" in label else "literal" if "literal" in label else "pooled")


fig, axes = plt.subplots(2, len(MODES), figsize=(11, 7.5), dpi=80, sharex=True)
for col, mode in enumerate(MODES):
    for j, v in enumerate(METHODS_C):
        method = v.label
        xs = [r + 0.004 * (j - 4.5) for r in COMPARE_RATIOS]           # side by side: the lines overlap
        accs = [cell_mean(method, mode, b, "accuracy") for b in budgets]
        n = [sum(len(g) for g in acc_groups(method, mode, b)) for b in budgets]                  # answers per point
        lo, hi = zip(*[wilson(a, k) for a, k in zip(accs, n)])
        axes[0, col].errorbar(xs, accs, yerr=[[a - x for a, x in zip(accs, lo)], [x - a for a, x in zip(accs, hi)]],
                              capsize=3, label=pretty(method), **style(method))
        axes[1, col].plot(xs, [cell_mean(method, mode, b, "kl") for b in budgets], label=pretty(method),
                          **style(method))
    axes[0, col].set(title=mode.replace("_", " "), ylabel="accuracy (mean over tasks, 95% interval)",
                     ylim=(-0.03, 1.03))
    axes[1, col].set(xlabel="keep ratio", ylabel="KL(full || method)")
    for row in range(2):
        axes[row, col].grid(alpha=0.3)
axes[0, 0].legend(fontsize=7, loc="upper left", ncol=2)
plt.tight_layout()
plt.show()

# %% [markdown]
# The figure shows the two readings on either side of their host in KL (blue, the default pooled stage 2,
# below the black host lines; red, the literal one, above them) and all of them close in accuracy, in both
# modes. Accuracy on this model is low for every prompt-compressing method (SnapKV is the weak baseline here,
# see the README). With the pooled stage 2 it is level with the host: every one of the 8 (host, keep ratio,
# mode) cells within noise (0.11 -> 0.12, 0.13 -> 0.13 with the question in the prompt at 0.25; 0.25 -> 0.24,
# 0.22 -> 0.22 after the context at 0.5), and its KL is below the host's in all 8 cells (e.g. 4.423 -> 4.012
# and 4.725 -> 4.477 with the question in the prompt at 0.5). With the literal stage 2 accuracy is lower in 7
# of the 8 cells, beyond noise in two, both after the context at keep ratio 0.5 (SnapKV 0.25 -> 0.18, AdaKV
# 0.22 -> 0.14), and its KL is above the host's in all 8. kvpress's settings, against their own hosts (gray): accuracy
# within noise in all 8
# cells, KL lower in 7 of 8 (e.g. 5.973 -> 5.750 and 4.266 -> 4.007 over SnapKV). (This table's KL has no interval: the
# records
# keep means only; section 4.2 has the paired intervals for the question in the prompt. Keep ratio 0.1 is left
# out here: every method answers 0.00-0.04 there, section 4.2.) The paper's LongBench gains are small too
# (SnapKV on Llama-3.1-8B, b = 256: 45.09 -> 45.66 of 100), on 7-8B models with far more concentrated
# attention.
#
# ## 6. What the paper claims, what we measure
#
# On the bundled model, with the default pooled stage 2 (the authors' code):
#
# * **Lower perturbation in most heads** (§5.1): not reproduced in either reading (31-50% of the 16 heads
#   pooled, 38-56% literal). Algorithm 1 loses to attention top-k even with the true query (section 3), and
#   Assumption 1 fails in most heads (section 4.3): the model's attention is too spread out.
# * **Lower final-layer perturbation** (§5.2): reproduced at keep ratio 0.25, by little (lower beyond noise for
#   both pooled selections); at 0.1 the hidden state is lost for every method.
# * **Better answers** (Tables 1 and 3): in KL, reproduced with the pooled stage 2 at keep ratio 0.25 (lower
#   beyond noise over both hosts), in accuracy within noise (level with the hosts). The earlier verdict "not
#   reproduced", when this notebook ran the literal reading by default, was the literal reading's: it raises
#   the KL beyond noise over both hosts and lowers accuracy beyond noise in two cells after the context.
# * **`alpha = 0` slightly worse than 0.25, both better than SnapKV** (Appendix D): 0 and 0.25 about equal,
#   both lower than SnapKV in KL beyond noise; accuracy within noise.
# * **kvpress's settings** (not in the paper), against SnapKV and AdaKV at kvpress's settings: KL lower but
#   within noise at keep ratio 0.25 (5.973 -> 5.750, 5.749 -> 5.647); at 0.1 the selection is its host.
#
# The summary below is computed from the cells above (the committed notebook is a normal run: 6 tasks x 5
# samples, 512 tokens; tiny mode prints smaller, noisier numbers).

# %%
# needs: output_perturbation, perturbation_bound, two_stage
for ratio in HEAD_RATIOS:
    alg = torch.cat([torch.tensor(alg1[(ratio, l)]) for l in range(cfg.n_layer)])
    sw = torch.stack(res[("critical_kv", ratio)]["sigma_window"])
    sd = torch.stack(res[("critical_kv", ratio)]["sigma_decode"])
    print(f"keep ratio {ratio}:")
    print(f"  Algorithm 1, true query: lower L than attention top-k in "
          f"{float((alg[:, 3] < alg[:, 0]).float().mean()):.0%} "
          f"of (sample, head) pairs (kept mass of top-k: {float(alg[:, 2].mean()):.2f})")
    print(f"  heads with lower perturbation: CriticalSnapKV {headwise[(ratio, 'critical_kv')]:.0%}, "
          f"CriticalAdaKV {headwise[(ratio, 'critical_kv(adakv)')]:.0%}; literal reading "
          f"{headwise[(ratio, 'critical_kv literal')]:.0%} and {headwise[(ratio, 'crit(adakv) literal')]:.0%}; "
          f"kvpress {headwise[(ratio, 'critical_kv kvpress')]:.0%} and {headwise[(ratio, 'crit(adakv) kvpress')]:.0%}"
          "   (paper: ~74%)")
    for host, crit in PAIRS[:6]:
        print(f"  final hidden perturbation {host} {mean(res[(host, ratio)]['pert']):.3f} -> {crit} "
              f"{mean(res[(crit, ratio)]['pert']):.3f}; KL {mean(res[(host, ratio)]['kl']):.3f} -> "
              f"{mean(res[(crit, ratio)]['kl']):.3f} ({versus(res, crit, host, ratio, 'kl', N_SAMPLES)})")
    print(f"  Assumption 1 (sigma > 0.5): {float((sw > 0.5).float().mean()):.0%} of (sample, head) on Abar, "
          f"{float((sd > 0.5).float().mean()):.0%} on the decode query; layer 0: "
          f"{float((sd[:, 0] > 0.5).float().mean()):.0%}")
    print("  alpha ablation, final perturbation / accuracy: " + ", ".join(
        f"{lab} {mean(res[(lab, ratio)]['pert']):.3f} / {mean(res[(lab, ratio)]['acc']):.2f}"
        for lab in ["alpha=0", "critical_kv", "alpha=1"]))
print(f"\nnotebook run time: {time.time() - T0:.0f} s")

# %% [markdown]
# ## 7. On the real model: SmolLM2-135M
#
# Everything above ran on a 0.87M-parameter model trained on synthetic retrieval, whose attention is
# spread out (section 3: the top 10% of the entries carry 67% of the mass). The paper measured 7-8B models.
# SmolLM2-135M-Instruct is a real, if small, language model: 30 layers, 9 query heads sharing 3 KV heads
# (`G = 3`), head dimension 64, hidden size 576. Its default suite is `passkey` and `niah_single_docs` (a
# needle among paragraphs of Python's documentation), which the full cache answers (1.00 in section 7.3). This
# section re-measures the claims on it with the same library code: §7.1 what each selection keeps of a real
# passage, §7.2 the head-wise perturbation of the paper's §5.1, §7.3 the final-layer perturbation of its §5.2
# and accuracy and KL (its Tables 1 and 3) in both modes, §7.4 Assumption 1, §7.5 Algorithm 1 with the true
# query (section 3), and §7.6 the claims in numbers.
#
# The same eight variants as sections 4-5: each host alone; CriticalKV over it with the default pooled stage 2
# (`alpha = 0.25`, the authors' code); the literal reading (`stage2="window"`, otherwise the same); and
# kvpress's settings (`preset_options`: `alpha = 0.5` of the whole budget, `epsilon = 1e-4`, SnapKV's window
# 64, kernel 5, average pooling). Budgets are per layer and KV head.

# %%
# needs: two_stage
t_real = time.time()                                              # one torch thread, as above: on a shared
                                                                  # 2-core machine two threads can be slower
real, rtok, rcard = load("smollm2-135m")
rcfg = real.config
G_REAL = rcfg.n_head // rcfg.n_kv_head                            # 3 query heads per KV head
W_O_REAL = [block.attn.o_proj.weight.detach() for block in real.blocks]   # (576, 9*64) per layer

LENGTH_REAL = 256 if TINY else 512                                # tokens per sample
SUITE_REAL = ["passkey", "niah_single_docs"]                 # the full cache answers both at 512 tokens
TASKS_REAL = SUITE_REAL[:1] if TINY else SUITE_REAL
N_REAL = 1 if TINY else 3                                         # samples per task (and mode in 7.3)
RATIOS_REAL = [0.25] if TINY else [0.1, 0.25]
BUDGETS_REAL = [round(r * LENGTH_REAL) for r in RATIOS_REAL]      # 51 and 128 of 512 tokens
VARIANTS_REAL = {k: v for k, v in VARIANTS.items() if not k.startswith("alpha")}   # the ten of section 5
print(f"SmolLM2-135M: {rcfg.n_layer} layers, {rcfg.n_head} query heads, {rcfg.n_kv_head} KV heads, "
      f"d_model {rcfg.d_model}; suite {TASKS_REAL}, {LENGTH_REAL} tokens, {N_REAL} sample(s) per task, "
      f"keep ratios {RATIOS_REAL}")

# %% [markdown]
# ### 7.1 What the selections keep of a real passage
#
# A `niah_single_docs` sample: a sentence "The special magic number for KEY is: VALUE." hidden among
# documentation paragraphs, the question at the end of the prompt. At keep ratio 0.25, which prompt
# positions does each selection keep? The strips show layers 0, 10, 20 and 29 (three KV heads each; kept
# positions dark, the needle's 12 preceding tokens light orange, its value digits red, SnapKV's 32-token
# window right of the dotted line); the line plot counts the value digits kept in every layer.

# %%
# needs: two_stage
sample_r = make_sample("niah_single_docs", rtok, LENGTH_REAL, seed=0)
span = needle_spans(sample_r, rtok)[0]                            # (key start, value start, value end)
ids_r = torch.tensor([sample_r.prompt_ids])                       # (1, T)
b_view = round(0.25 * LENGTH_REAL)
VIEW = ["snapkv", "critical_kv", "critical_kv literal", "critical_kv kvpress"]
VIEW_NAMES = {"snapkv": "SnapKV", "critical_kv": "CriticalSnapKV, pooled stage 2 (default)",
              "critical_kv literal": "CriticalSnapKV, literal stage 2 (un-pooled window)",
              "critical_kv kvpress": "CriticalSnapKV at kvpress's settings (window 64)"}
SHOW = [0, 10, 20, 29] if rcfg.n_layer == 30 else [0, rcfg.n_layer - 1]
caches_view = {}
print(f"{len(sample_r.prompt_ids)} prompt tokens, value {sample_r.answers[0]} at positions {span[1]}..{span[2] - 1}; "
      f"budget {b_view} per KV head")
for label in VIEW:                                                # what each one keeps after the prompt
    spec, opts = VARIANTS_REAL[label]
    caches_view[label] = KVCache(rcfg, make_policy(spec, budget=b_view, **opts))
    prefill(real, ids_r, caches_view[label])
policies = [None] + [make_policy(VARIANTS_REAL[label][0], budget=b_view, **VARIANTS_REAL[label][1]) for label in VIEW]
trs = traces(real, sample_r, MODE, policies, [False] * len(policies))   # one prompt pass, answers side by side
for label, (acc, said) in zip(["full cache"] + VIEW, greedy_accuracies(real, rtok, sample_r, trs)):
    print(f"{label:<16} answers {said.strip()[:40]!r:<44} correct: {acc:.0f}")


def layers_view(cache: KVCache, layers: list[int]) -> SimpleNamespace:
    """The same cache restricted to some layers, for `plot_kept` (it reads `.layers`)."""
    return SimpleNamespace(layers=[cache.layers[l] for l in layers])


# %%
# needs: two_stage
T_r = len(sample_r.prompt_ids)
fig, axes = plt.subplots(len(VIEW) + 1, 1, figsize=(11, 2.2 * len(VIEW) + 3), dpi=80,
                         gridspec_kw={"height_ratios": [1] * len(VIEW) + [1.3]})
for ax, label in zip(axes, VIEW):
    window = make_policy(VARIANTS_REAL[label][0], budget=b_view, **VARIANTS_REAL[label][1]).window
    plot_kept(ax, layers_view(caches_view[label], SHOW), T_r, [span], title=VIEW_NAMES[label], window=window)
    ax.set_ylabel("layer, KV head")
    fig.colorbar(ax.images[0], ax=ax, ticks=[0, 1], pad=0.01).ax.set_yticklabels(["evicted", "kept"], fontsize=7)
    ax.set_yticks(range(len(SHOW) * rcfg.n_kv_head),
                  [f"L{l} KV{h}" for l in SHOW for h in range(rcfg.n_kv_head)], fontsize=7)
n_value = span[2] - span[1]
for label in VIEW:
    mask = kept_mask(caches_view[label], T_r)                     # (L, H_kv, T) bool
    axes[-1].plot(mask[:, :, span[1]:span[2]].sum(-1).float().mean(-1).tolist(), marker=".",
                  label=VIEW_NAMES[label])
axes[-1].set(xlabel="layer", ylabel=f"value digits kept\n(of {n_value}, mean over KV heads)",
             ylim=(-0.2, n_value + 0.2), title="value digits kept in every layer")
axes[-1].legend(fontsize=8)
axes[-1].grid(alpha=0.3)
plt.tight_layout()
plt.show()
for label in VIEW:
    mask = kept_mask(caches_view[label], T_r)[:, :, span[1]:span[2]]      # (L, H_kv, value tokens)
    per_block = " / ".join(f"{float(mask[list(b)].sum(-1).float().mean()):.1f}"
                           for b in [range(0, 10), range(10, 20), range(20, rcfg.n_layer)])
    print(f"{VIEW_NAMES[label]}: value complete in {int(mask.all(-1).sum())} of {mask.shape[0] * mask.shape[1]} "
          f"(layer, KV head), no digit in {int((~mask.any(-1)).sum())}; digits kept per KV head, mean over layers "
          f"0-9 / 10-19 / 20-29: {per_block} of {mask.shape[-1]}")

# %% [markdown]
# The strips show the two readings keeping different tokens. On this sample SnapKV and both readings answer
# 6122 (at keep ratio 0.25 enough of the needle survives); kvpress's settings answer "61". SnapKV keeps the
# needle's sentence in blocks (its pooling keeps a strong token's neighbours): the four value digits are
# complete in 26 of the 90 (layer, KV head) pairs and absent from 13. The default pooled stage 2 keeps what
# SnapKV keeps and a little more (complete in 33, absent from 13; 2.9 of the 4 digits per KV head in layers
# 0-9, as SnapKV). The literal reading spends its stage-2 budget on isolated tokens all over the prompt (the
# speckled strips) and loses the value where SnapKV has it: complete in 13 pairs, absent from 44, and 0.4 of
# the 4 digits per KV head in layers 0-9. This is section 2's finding on a real model: the un-pooled window
# attention times the value norm does not point at the tokens the answer copies, the pooled vote does, through
# the key next to them. kvpress's settings (window 64, kernel 5, average pooling: a wider window in a budget of
# 128, a flatter vote) keep the value complete in only 5 pairs.
#
# ### 7.2 Head-wise: in how many of the 270 heads is the perturbation lower?
#
# The measurement of section 4.1: every selection and its host traced on the same samples (question in the
# prompt; `harness.traces` runs the prompt once for all of them), the per-head perturbation
# `L_h = ||(o_full,h - o_h) W_O^(h)||_1` at the first decode step, and the fraction of the 30 x 9 (layer,
# query head) pairs where the selection's mean over samples is below the host's (the paper's §5.1, Figure 2:
# 74.3% of heads on average). The same traces give the final hidden state's relative error and the KL used
# in section 7.3, and `critical_kv`'s stage-1 sets for section 7.4. Each selection is compared with its own
# host: kvpress's with SnapKV and AdaKV at kvpress's settings.

# %%
# needs: two_stage
res_r = {}                             # (label, ratio) -> {metric: [one value per sample]}
t_loop = time.time()
for task in TASKS_REAL:
    for i in range(N_REAL):
        s = make_sample(task, rtok, LENGTH_REAL, seed=i)
        keys = [(label, ratio) for ratio in RATIOS_REAL for label in VARIANTS_REAL]
        policies = [make_policy(VARIANTS_REAL[label][0], budget=round(ratio * LENGTH_REAL), **VARIANTS_REAL[label][1])
                    for label, ratio in keys]
        full, *trs = traces(real, s, MODE, [None] + policies, [True] + [False] * len(policies))
        for (label, ratio), policy, tr in zip(keys, policies, trs):
            m = compare_traces(full, tr, G_REAL)
            r = res_r.setdefault((label, ratio), {})
            r.setdefault("head_l1", []).append(torch.stack(
                [projected_output_l1(full.outs[l], tr.outs[l], W_O_REAL[l]) for l in range(rcfg.n_layer)]))  # (L, H)
            r.setdefault("pert", []).append(m["perturbation"])
            r.setdefault("kl", []).append(m["kl"])
            if label == "critical_kv":    # Assumption 1 on the window attention and on the decode query
                r.setdefault("sigma_window", []).append(torch.stack([policy.last[l]["sigma"][0]
                                                                     for l in range(rcfg.n_layer)]))   # (L, H)
                dec = torch.zeros(rcfg.n_layer, rcfg.n_head)
                for l in range(rcfg.n_layer):
                    stage1 = policy.last[l]["stage1_pos"][0]              # (H_kv, T) positions, -1 elsewhere
                    for h in range(rcfg.n_head):
                        in_stage1 = torch.isin(full.attended[l][h // G_REAL], stage1[h // G_REAL])
                        dec[l, h] = assumption1_sigma(full.probs[l][h], in_stage1)
                r.setdefault("sigma_decode", []).append(dec)
print(f"{len(VARIANTS_REAL)} variants x {len(RATIOS_REAL)} keep ratios x {len(TASKS_REAL) * N_REAL} samples: "
      f"{time.time() - t_loop:.0f} s")

# %%
# needs: two_stage
PAIRS_REAL = PAIRS[:6]                                             # each selection with its host
BLOCKS = [range(0, 10), range(10, 20), range(20, rcfg.n_layer)]   # layers 0-9, 10-19, 20-29
gen = torch.Generator().manual_seed(0)                            # bootstrap: draw each task's samples again
BOOT = (torch.randint(N_REAL, (1000, len(TASKS_REAL), N_REAL), generator=gen)
        + torch.arange(len(TASKS_REAL))[:, None] * N_REAL).flatten(1)   # (1000, S) sample indices
print(f"{'keep':>5}  {'selection':<19}{'vs':<15}| {'heads lower (mean)':>18} {'95% interval':>14} "
      f"{'triples lower':>13} | triples lower in layers 0-9 / 10-19 / 20-29")
headwise_r, headwise_ci = {}, {}
for ratio in RATIOS_REAL:
    for host, crit in PAIRS_REAL:
        a = torch.stack(res_r[(host, ratio)]["head_l1"])              # (S, L, H)
        c = torch.stack(res_r[(crit, ratio)]["head_l1"])
        headwise_r[(ratio, crit)] = float((c.mean(0) < a.mean(0)).float().mean())
        boot = (c[BOOT].mean(1) < a[BOOT].mean(1)).float().mean((1, 2))   # (1000,) the fraction, resampled
        lo, hi = headwise_ci[(ratio, crit)] = torch.quantile(boot, torch.tensor([0.025, 0.975])).tolist()
        blocks = " / ".join(f"{float((c < a)[:, list(b)].float().mean()):.2f}" for b in BLOCKS)
        print(f"{ratio:>5}  {crit:<19}{host:<15}| {headwise_r[(ratio, crit)]:>18.3f}   [{lo:.2f}, {hi:.2f}] "
              f"{float((c < a).float().mean()):>13.3f} | {blocks}")
print(f"(heads lower: of the {rcfg.n_layer} x {rcfg.n_head} (layer, query head) pairs, by their mean over "
      f"{len(TASKS_REAL) * N_REAL} samples, with a 95% bootstrap interval over the samples; triples: every "
      "(sample, layer, head); paper: 74.3%)")

# %%
# needs: two_stage
ratio = RATIOS_REAL[-1]
fig, axes = plt.subplots(1, 1 + len(RATIOS_REAL), figsize=(6 + 5 * len(RATIOS_REAL), 4.6), dpi=80)
a = torch.stack(res_r[("snapkv", ratio)]["head_l1"]).mean(0)        # (L, H) mean over samples
c = torch.stack(res_r[("critical_kv", ratio)]["head_l1"]).mean(0)
layer_of = torch.arange(rcfg.n_layer)[:, None].expand_as(a)          # (L, H) each head's layer
points = axes[0].scatter(a.flatten().tolist(), c.flatten().tolist(), c=layer_of.flatten().tolist(), cmap="viridis",
                         s=14, label="one (layer, query head)")
top = float(torch.cat([a, c]).max()) * 1.05
axes[0].plot([0, top], [0, top], "k--", lw=0.8, label="equal perturbation")
axes[0].set(xscale="log", yscale="log", xlabel="SnapKV: per-head L (mean over samples)",
            ylabel="CriticalSnapKV: per-head L",
            title=f"keep ratio {ratio}: {headwise_r[(ratio, 'critical_kv')]:.0%} of heads below the diagonal")
fig.colorbar(points, ax=axes[0], label="layer")
axes[0].legend(fontsize=8, loc="upper left")
for ax, ratio in zip(axes[1:], RATIOS_REAL):
    for host, crit in PAIRS_REAL:
        a = torch.stack(res_r[(host, ratio)]["head_l1"])            # (S, L, H)
        c = torch.stack(res_r[(crit, ratio)]["head_l1"])
        st = style(crit)
        ax.plot((c < a).float().mean((0, 2)).tolist(), marker=".", ls=st["ls"], color=st["color"],
                label=pretty(crit))
    ax.axhline(0.743, color="gray", lw=1, label="paper: 74.3% of heads")
    ax.axhline(0.5, color="black", lw=0.6, ls="--")
    ax.set(xlabel="layer", ylabel="fraction of (sample, query head)\nwith lower L", ylim=(-0.02, 1.02),
           title=f"keep ratio {ratio}: where the per-head L is lower")
    ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# The figure shows, at left, the default CriticalSnapKV's per-head perturbation against SnapKV's at keep ratio
# 0.25, and, per layer, how often each selection is below its host, against the paper's 74.3% and the coin
# toss. Partly reproduced, in both readings. The default pooled stage 2
# lowers the per-head perturbation (mean over samples) in 61.1% (keep ratio 0.1, 95% bootstrap interval over
# the samples 51-67%) and 56.7% (0.25; 32-67%) of the 270 heads over SnapKV, 40.0% (37-47%) and 70.4% (48-73%)
# over AdaKV; the literal one in 70.0% (64-71%) and 41.9% (30-61%) over SnapKV, 52.6% (47-57%) and 78.5%
# (71-81%) over AdaKV. Counted per (sample, layer, head), the pooled selections are lower in 0.412-0.524 of the
# triples, the literal ones in 0.512-0.628: at the first decode step the literal reading wins a little more
# often (by heads in 3 of the 4 (host, keep ratio) cells, by triples in all 4). That is better than on the tiny model
# (section 4.1: 31-56% of
# heads), and short of the paper's clear majority except in one or two cells. At kvpress's settings, against its own
# hosts, the selection is lower in 64.8%
# (CriticalSnapKV, 51-73%) and 70.7% (CriticalAdaKV, 56-79%) of the heads at keep ratio 0.25; at 0.1 it is its
# host exactly (0.0%: every head equal), since the budget of 51 is smaller than kvpress's 64-token window.
#
# ### 7.3 The final hidden state, KL and accuracy
#
# §5.2 (Figure 3) reports a lower final-layer output perturbation with the selection at every budget, and
# Tables 1 and 3 small gains in answer quality. First the traces of section 7.2, sample by sample (question in the
# prompt): the final hidden state's relative error at the first decode step and the answer's KL, each
# selection's paired difference from its host, and in how many samples it is below.

# %%
# needs: output_perturbation, perturbation_bound, two_stage
n_r = len(TASKS_REAL) * N_REAL


def versus_host(label: str, ratio: float, key: str) -> str:
    """The selection minus its host, paired sample by sample: difference [95% interval], verdict, count below."""
    host = HOST_OF[label]
    below = sum(x < y for x, y in zip(res_r[(label, ratio)][key], res_r[(host, ratio)][key]))
    return f"{versus(res_r, label, host, ratio, key, N_REAL):<34} {below}/{n_r}"


print(f"{'keep':>5}  {'variant':<19}| {'final pert':>10}  {'vs host: difference [95%], below in':<44}| "
      f"{'KL':>6}  vs host")
for ratio in RATIOS_REAL:
    for label in VARIANTS_REAL:
        is_host = label not in HOST_OF
        print(f"{ratio:>5}  {label:<19}| {mean(res_r[(label, ratio)]['pert']):>10.3f}  "
              f"{'' if is_host else versus_host(label, ratio, 'pert'):<44}| {mean(res_r[(label, ratio)]['kl']):>6.3f}  "
              f"{'' if is_host else versus_host(label, ratio, 'kl')}")
print(f"mean over {n_r} samples, question in the prompt, {LENGTH_REAL} tokens; difference from the host (snapkv or "
      "adakv) with its 95% paired bootstrap interval; 'below in': samples where the selection is lower")

# %% [markdown]
# Then `methods.evaluation.compare.run` in both modes, with greedy answers: accuracy per task, KL and `pert`
# (the same final hidden state error) per cell, and `format_intervals`: each cell's 95% interval, its paired
# difference from the full cache, and which methods are within noise of the best at each keep ratio.

# %%
# needs: two_stage
t_cmp = time.time()
METHODS_REAL = [Variant(label, spec, opts) for label, (spec, opts) in VARIANTS_REAL.items()]
records_r = run(real, rtok, METHODS_REAL, BUDGETS_REAL, TASKS_REAL, MODES, N_REAL, LENGTH_REAL, seed=0,
                progress=False, workers=1)
print(format_tables(records_r))
print(format_intervals(records_r))
print(f"\n{N_REAL} samples per task and mode, {LENGTH_REAL} tokens, seed 0: {time.time() - t_cmp:.0f} s")

# %%
# needs: output_perturbation, perturbation_bound, two_stage
mean_of = lambda key, method, mode, budget: mean([r[key] for r in records_r              # noqa: E731
                                                 if (r["method"], r["mode"], r["budget"]) == (method, mode, budget)])
fig, axes = plt.subplots(3, len(MODES), figsize=(11, 9), dpi=80, sharex=True)
for col, mode in enumerate(MODES):
    for j, label in enumerate(VARIANTS_REAL):
        xs = [r + 0.003 * (j - 4.5) for r in RATIOS_REAL]             # side by side: several lines coincide
        accs = [mean_of("accuracy", label, mode, b) for b in BUDGETS_REAL]
        n = [sum(len(r["accuracies"]) for r in records_r if (r["method"], r["mode"], r["budget"]) == (label, mode, b))
             for b in BUDGETS_REAL]                                   # answers per point
        lo, hi = zip(*[wilson(a, k) for a, k in zip(accs, n)])
        axes[0, col].errorbar(xs, accs, yerr=[[a - x for a, x in zip(accs, lo)], [x - a for a, x in zip(accs, hi)]],
                              capsize=2, label=pretty(label), **style(label))
        for row, key in [(1, "kl"), (2, "perturbation")]:
            axes[row, col].plot(xs, [mean_of(key, label, mode, b) for b in BUDGETS_REAL], label=pretty(label),
                                **style(label))
    axes[0, col].axhline(mean_of("accuracy", "full", mode, None), color="black", lw=0.8, label="full cache")
    axes[0, col].set(title=mode.replace("_", " "), ylabel="accuracy (mean over tasks, 95% interval)", ylim=(-0.03, 1.1))
    axes[1, col].set(ylabel="KL(full || method)")
    axes[2, col].set(xlabel="keep ratio", ylabel="final hidden state\nrelative error")
    for row in range(3):
        axes[row, col].grid(alpha=0.3)
fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)   # below the panels
plt.tight_layout(rect=(0, 0.06, 1, 1))
plt.show()

# %% [markdown]
# **Final-layer perturbation (§5.2): reproduced in direction, small, in both readings.** With the question in
# the prompt, every selection of either reading lowers the final hidden state's error at the first decode step
# at both keep ratios. The pooled stage 2 is lower beyond noise in three of the four cells (SnapKV 0.171 ->
# 0.131 and 0.056 -> 0.047; AdaKV 0.155 -> 0.143) and within noise in the fourth (0.072 -> 0.062); the literal
# one in two (0.171 -> 0.148; 0.072 -> 0.051).
#
# **KL: the readings part ways.** The default pooled stage 2 lowers the answer's KL: beyond noise in three of
# the four cells with the question in the prompt (SnapKV 0.572 -> 0.478 at keep ratio 0.25; AdaKV 1.093 ->
# 0.996 and 0.593 -> 0.514), within noise in the fourth (1.165 -> 1.141). The literal one raises it in all four,
# every interval above 0 (SnapKV 1.165 -> 1.595 and 0.572 -> 0.706; AdaKV 1.093 -> 1.528 and 0.593 -> 0.890;
# lower in 0-2 of the 6 samples). After the context (the table's KL, means only) the pooled reading is below its
# host in three of the four cells (1.586 -> 1.432 and 1.669 -> 1.486 at 0.25), the literal one about level or
# above (1.706 and 1.714). kvpress's settings, against SnapKV and AdaKV at kvpress's settings: at 0.25 the KL
# goes 1.252 -> 1.142 and 1.219 -> 1.112, both lower beyond noise (4 and 6 of 6 samples), and the final hidden
# state 0.117 -> 0.094 (within noise) and 0.110 -> 0.081 (lower); at 0.1 it is its host (KL 3.204 for all
# four). Those hosts are far behind ours here (KL 1.252 against SnapKV's 0.572 at 0.25, 3.204 against 1.165 at
# 0.1): with budgets of 51 and 128, a 64-token window leaves little or nothing for the rest of the prompt.
#
# **Accuracy (Tables 1 and 3): inconclusive.** The full cache answers all 12 (6 per mode); every compressed
# cell scores 0.00-0.33 with the question in the prompt and 0.17 after the context, and `format_intervals`
# puts every method within noise of the best at each keep ratio: 6 answers per cell cannot show the
# paper's gains (SnapKV on Llama-3.1-8B, b = 256: 45.09 -> 45.66 of 100).
#
# Why the perturbation falls in both readings while the KL falls only in one: §5.1-5.2 measure the *first*
# decode step, whose query reads the question like the observation window's queries, the ones stage 2 ranks
# by in either reading. The KL averages over every answer token, and the later ones copy the value digits,
# which the literal reading drops in the early layers (section 7.1) and the pooled one keeps with the key next
# to them.
#
# ### 7.4 Assumption 1 on SmolLM2
#
# As in section 4.3: `sigma`, the attention mass on `critical_kv`'s stage-1 set, on the window attention
# `Abar` (un-pooled, in both readings) and on the first decode query of the full cache, per layer. Stage 1 is
# the same in both readings, and so is `sigma`.

# %%
# needs: two_stage
print(f"{'keep':>5} | {'sigma > 0.5 on Abar':>19} {'mean':>6} | {'sigma > 0.5, decode query':>25} {'mean':>6} | "
      f"decode query, layers 0 / 1-9 / 10-19 / 20-29")
for ratio in RATIOS_REAL:
    sw = torch.stack(res_r[("critical_kv", ratio)]["sigma_window"])   # (S, L, H)
    sd = torch.stack(res_r[("critical_kv", ratio)]["sigma_decode"])
    blocks = " / ".join(f"{float((sd[:, list(b)] > 0.5).float().mean()):.2f}"
                        for b in [range(0, 1), range(1, 10), range(10, 20), range(20, rcfg.n_layer)])
    print(f"{ratio:>5} | {float((sw > 0.5).float().mean()):>19.3f} {float(sw.mean()):>6.2f} | "
          f"{float((sd > 0.5).float().mean()):>25.3f} {float(sd.mean()):>6.2f} | {blocks}")

fig, ax = plt.subplots(figsize=(8, 3.6), dpi=80)
for ratio in RATIOS_REAL:
    for key, name in [("sigma_window", "window Abar"), ("sigma_decode", "first decode query")]:
        s = torch.stack(res_r[("critical_kv", ratio)][key])             # (S, L, H)
        ax.plot((s > 0.5).float().mean((0, 2)).tolist(), marker=".", ls="-" if key == "sigma_decode" else ":",
                label=f"{name}, keep {ratio}")
ax.set(xlabel="layer", ylabel="fraction of (sample, head)\nwith sigma > 0.5", ylim=(-0.02, 1.02),
       title="Assumption 1: stage 1 secures more than half of the attention")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# Reproduced, with the paper's exception. The stage-1 set carries more than half of the attention in 70.5%
# (keep ratio 0.1) and 89.2% (0.25) of the (sample, head) pairs on the window attention, 71.9% and 86.2% on
# the decode query, against 17-46% on the tiny model (section 4.3). Where it fails is layer 0 (22-24% on the
# decode query), as the paper finds for some of its first-layer heads (Appendix A, Figure 4), and at keep
# ratio 0.1 layers 1-9 (48%).
#
# ### 7.5 Algorithm 1 with the true query
#
# Section 3's test on SmolLM2 (the same helper): at the first decode step of the full cache, in every layer
# and query head, Algorithm 1 (`alpha = 0.25`) against attention top-k with that step's own attention.

# %%
# needs: output_perturbation, perturbation_bound, two_stage
alg1_r = algorithm1_vs_topk(real, rtok, TASKS_REAL, N_REAL, LENGTH_REAL, RATIOS_REAL)
print(f"{'keep':>5} {'layers':>7} | {'Alg.1 L lower':>13} {'Alg.1 theta lower':>17} | {'mean L top-k':>12} "
      f"{'mean L Alg.1':>12} | {'kept mass top-k':>15} {'Alg.1':>6}")
for ratio in RATIOS_REAL:
    for name, block in [("0", [0]), ("1-9", range(1, 10)), ("10-19", range(10, 20)),
                        ("20-29", range(20, rcfg.n_layer)), ("all", range(rcfg.n_layer))]:
        x = torch.cat([torch.tensor(alg1_r[(ratio, l)]) for l in block])
        print(f"{ratio:>5} {name:>7} | {float((x[:, 3] < x[:, 0]).float().mean()):>13.3f} "
              f"{float((x[:, 4] < x[:, 1]).float().mean()):>17.3f} | {float(x[:, 0].mean()):>12.3f} "
              f"{float(x[:, 3].mean()):>12.3f} | {float(x[:, 2].mean()):>15.2f} {float(x[:, 5].mean()):>6.2f}")
print(f"({n_r} samples x {rcfg.n_head} query heads per layer; 'lower' = fraction of (sample, head) pairs where "
      "Algorithm 1's value is strictly lower)")

# %% [markdown]
# With the true query, Algorithm 1 now wins slightly more often than it loses: lower `L` than attention
# top-k in 52% (keep ratio 0.1) and 60% (0.25) of the (sample, head) pairs, a lower mean `L` (12.129 -> 12.028,
# 4.791 -> 4.704), and a lower bound `theta` in 57.8% and 69.1%. On the tiny model it lost (25-29%, section 3).
# The difference is concentration: here attention top-k keeps 93% and 97% of the mass (67% and 79% on the
# tiny model), so the entries stage 2 picks for their values cost little mass. Layer 0, whose attention is
# spread out (58-77% kept), is where Algorithm 1 still loses (lower `L` in 26-28%).
#
# ### 7.6 The claims on SmolLM2, in numbers
#
# SmolLM2-135M, `passkey` and `niah_single_docs`, 512 tokens, 3 samples per task (and per mode in 7.3), keep
# ratios 0.1 and 0.25 (budgets 51 and 128, SnapKV's 32-token window included); the default pooled stage 2
# first, the literal reading after it:
#
# * **Lower output perturbation in most heads** (§5.1, Figure 2; paper: 74.3% of heads). Pooled: CriticalSnapKV
#   61.1% (keep 0.1) and 56.7% (0.25) of the 270 heads, CriticalAdaKV 40.0% and 70.4%. Literal: 70.0% and
#   41.9%, 52.6% and 78.5%. *Partly reproduced* in both: near the paper in one or two of the 4 cells.
# * **Lower final-layer perturbation** (§5.2, Figure 3; paper: at every budget). Lower in all 4 cells with the
#   question in the prompt in both readings, beyond noise in 3 (pooled) and 2 (literal). *Reproduced in
#   direction*, by little.
# * **Better answers** (the paper's Tables 1 and 3: +0.57 of 100 for SnapKV on Llama-3.1-8B, b = 256).
#   Accuracy: every difference within noise (6 answers per cell), *inconclusive*. KL: with the pooled stage 2,
#   lower in all 4 cells, beyond noise in 3 (-0.024 to -0.097): *reproduced*. With the literal one, higher in
#   all 4, beyond noise (+0.134 to +0.435). The earlier verdict "not reproduced", from the version of this
#   notebook that ran the literal reading by default, was the literal reading's.
# * **Assumption 1 holds, except in some first-layer heads** (Appendix A, Figure 4). 70.5% (0.1) and 89.2%
#   (0.25) of the (sample, head) pairs on the window attention; layer 0: 22-24% on the decode query.
#   *Reproduced*.
# * **kvpress's settings** (not in the paper), against SnapKV and AdaKV at kvpress's settings: KL lower at keep
#   0.25 over both hosts, beyond noise (-0.110 and -0.107), heads lower 64.8% and 70.7%; at 0.1 the selection is
#   its host (the 64-token window takes the whole budget of 51). Those hosts are far behind ours on this model
#   (KL 1.252 against 0.572 at 0.25).
#
# The cell below prints these numbers from the runs above.

# %%
# needs: output_perturbation, perturbation_bound, two_stage
for ratio, budget in zip(RATIOS_REAL, BUDGETS_REAL):
    alg = torch.cat([torch.tensor(alg1_r[(ratio, l)]) for l in range(rcfg.n_layer)])
    sw = torch.stack(res_r[("critical_kv", ratio)]["sigma_window"])
    sd = torch.stack(res_r[("critical_kv", ratio)]["sigma_decode"])
    print(f"SmolLM2-135M, keep ratio {ratio} ({budget} of {LENGTH_REAL} tokens):")
    print(f"  §5.1 heads with lower perturbation (of {rcfg.n_layer * rcfg.n_head}; paper 74.3%): " + ", ".join(
        f"{crit} {headwise_r[(ratio, crit)]:.1%} [{headwise_ci[(ratio, crit)][0]:.0%}, "
        f"{headwise_ci[(ratio, crit)][1]:.0%}]" for _, crit in PAIRS_REAL))
    for host, crit in PAIRS_REAL:
        print(f"  §5.2 final hidden perturbation (question in prompt) {host} {mean(res_r[(host, ratio)]['pert']):.3f}"
              f" -> {crit} {mean(res_r[(crit, ratio)]['pert']):.3f} ({versus_host(crit, ratio, 'pert')}); "
              f"KL {mean(res_r[(host, ratio)]['kl']):.3f} -> {mean(res_r[(crit, ratio)]['kl']):.3f} "
              f"({versus_host(crit, ratio, 'kl')})")
    for mode in MODES:
        print(f"  accuracy, {mode}: " + ", ".join(
            f"{label} {mean_of('accuracy', label, mode, budget):.2f}" for label in VARIANTS_REAL)
            + f" (full {mean_of('accuracy', 'full', mode, None):.2f}; {n_r} answers per cell)")
    print(f"  Assumption 1 (sigma > 0.5): {float((sw > 0.5).float().mean()):.0%} of (sample, head) on Abar, "
          f"{float((sd > 0.5).float().mean()):.0%} on the decode query")
    print(f"  Algorithm 1 with the true query: lower L than attention top-k in "
          f"{float((alg[:, 3] < alg[:, 0]).float().mean()):.0%} of (sample, head) pairs "
          f"(kept mass of top-k {float(alg[:, 2].mean()):.2f})")
print(f"\nsection 7 run time: {time.time() - t_real:.0f} s")

# %% [markdown]
# ## Exercises
#
# ### Exercise 1: the perturbation and its bound by hand
#
# Recompute, for the hand example of section 1 and Algorithm 1's choice (entries 0 and 2), the perturbation
# `L = ||(A - A') V W_O||_1` with `A' = N*A / sum(N*A)` (Eq. 5-6) and Theorem 2's bound
# `theta = C - (2 - 1/sum(N*A)) sum(N*A*P)` with `P_i = ||V_i W_O||_1` and `C = sum(A*P)` (Eq. 8), with
# tensor operations only (no `output_perturbation`, `perturbation_bound` or `renormalized_attention`). Call
# them `my_L` and `my_theta` (floats).

# %%
# needs: output_perturbation, perturbation_bound
ex_attn = torch.tensor([0.5, 0.2, 0.18, 0.12], dtype=torch.float64)                 # the hand example of section 1
ex_vw = torch.tensor([[1.0], [0.1], [-2.0], [1.0]], dtype=torch.float64) \
    @ torch.tensor([[1.0, 0.5]], dtype=torch.float64)                             # V W_O, one row per entry
ex_keep = torch.tensor([True, False, True, False])                                  # Algorithm 1's choice
# BEGIN SOLUTION [critical_kv] kept mass m = (N*A).sum(); A' = N*A/m; L = ((A - A') @ VW).abs().sum(); theta from Eq. 8
kept = ex_attn * ex_keep                                  # N*A
m_kept = kept.sum()                                       # the kept attention mass
my_L = float(((ex_attn - kept / m_kept) @ ex_vw).abs().sum())
P_ex = ex_vw.abs().sum(-1)                                # ||V_i W_O||_1
my_theta = float((ex_attn * P_ex).sum() - (2 - 1 / m_kept) * (kept * P_ex).sum())
# END SOLUTION
assert abs(my_L - float(output_perturbation(ex_attn, ex_keep, ex_vw))) < 1e-9, \
    f"my_L = {my_L:.4f}, the library's L = {float(output_perturbation(ex_attn, ex_keep, ex_vw)):.4f}: " \
    "renormalise the kept attention (A' sums to 1) and take the L1 norm of (A - A') V W_O"
assert abs(my_theta - float(perturbation_bound(ex_attn, ex_keep, ex_vw.abs().sum(-1)))) < 1e-9, \
    f"my_theta = {my_theta:.4f} differs from Theorem 2's bound: C = sum(A*P), then minus (2 - 1/m) sum(N*A*P)"
print(f"L = {my_L:.3f}, theta = {my_theta:.3f}")

# %% [markdown]
# ### Exercise 2: concentrated attention
#
# Section 3 says the criterion needs most of the attention mass inside the kept set. Build a head by hand
# (`torch.softmax(logits * temperature)`) and find the temperature at which Algorithm 1 starts to beat
# attention top-k in most random draws of `V` (use `output_perturbation` and
# `perturbation_constrained_select`).
#
# ### Exercise 3: the right query
#
# Section 2 shows that the window's queries barely look at the value digits. Set `window=8`
# (`make_policy("critical_kv", 256, window=8)`: the window then holds only the end of the question) and
# rerun the digit table. Does stage 2 see the digits now?

# %%
# Exercise 3, your code here, e.g.
# cache = KVCache(cfg, make_policy("critical_kv", budget=256, window=8)); prefill(model, ids, cache)
# print([int(torch.isin(digits, p).sum()) for layer in cache.layers for p in layer.pos[0]])

# %% [markdown]
# ### Exercise 4: the two readings of Algorithm 2 line 9
#
# The default `stage2="host"` multiplies SnapKV's *pooled* vote by the value norm (the authors' code); the
# literal `stage2="window"` multiplies the un-pooled window attention. Everything else is the same, stage 1
# included. On the sample of section 2, count per (layer, KV head) how many of the value's digits and of the
# 12 tokens before them each reading keeps (`kept_digits` and `kept_before`, one list per reading, keys
# `"host"` and `"window"`), and in how many (layer, KV head) the pooled reading keeps at least as many digits.
# Then try `kernel=1` (no pooling: `make_policy("critical_kv", 256, kernel=1)`): do the two readings agree?

# %%
# needs: two_stage
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
# ### Exercise 5: over H2O
#
# `critical_kv(h2o)` has no window, so stage 2 weighs H2O's accumulated attention by the value norm at every
# decode step. Run `python -m methods.compare --methods h2o "critical_kv(h2o)" --samples 3` and compare
# accuracy and KL.
