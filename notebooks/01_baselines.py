# %% [markdown]
# # 01 Baselines: four ways to choose what a KV cache keeps
#
# Every results table in this project compares a method against the full cache and against four
# baselines: **StreamingLLM**, **H2O**, **SnapKV** and **AdaKV**. They are the four simplest answers to
# the question every KV-cache method answers: with room for `budget` entries per layer and KV head,
# which tokens stay?
#
# **You will learn**
#
# 1. what each baseline keeps of one small attention matrix, in a picture;
# 2. each rule written from its paper in a few lines, checked against the library;
# 3. how often each answers on real passages with a real model, SmolLM2-135M.
#
# The metrics of the results tables (acc, KL, pert, lost, ...) are defined in the glossary, this notebook's
# appendix, which the later notebooks link to. Code: `methods/streaming_llm.py`, `methods/h2o.py`,
# `methods/snapkv.py`, `methods/adakv.py` (the methods), `methods/evaluation/harness.py` (the metrics).

# %%
import math
import os
import sys
import time

TINY = os.environ.get("NANOLLM_TINY") == "1"      # CI runs the notebook in a quick tiny mode
if not os.path.isdir("methods") and os.path.isdir(os.path.join("..", "methods")):
    sys.path.insert(0, os.path.abspath(".."))      # opened from notebooks/: make the repo importable

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from methods import make_policy
from methods.adakv import adaptive_keep_mask, mask_to_indices
from methods.analysis.persistence import record_attention
from methods.evaluation.intervals import describe, paired_difference, wilson
from methods.evaluation.viz import needle_spans, print_mode
from methods.h2o import STATE as H2O_SCORE
from methods.h2o import H2OPolicy, received_attention
from methods.snapkv import SnapKVPolicy, snapkv_scores
from methods.streaming_llm import StreamingLLMPolicy, sinks_and_recent
from nanollm import KVCache, decode_step, load, prefill, select_topk
from nanollm.data.evaluate import MODES, answer
from nanollm.data.tasks import make_sample, string_match_all

torch.set_num_threads(1)                           # a tiny model is dispatch-bound: one thread is fastest
t_start = time.time()
model, tok, card = load("retrieval-llama")         # the bundled 0.87M-parameter model, 4 layers, 2 KV heads
LENGTH = 256 if TINY else 512                      # tokens per sample, in the exercises
BUDGET = LENGTH // 4                               # keep ratio 0.25, in exercise 4
SPECS = ["streaming_llm", "h2o", "snapkv", "adakv"]    # the four baselines, with their default options
NAMES = {"full": "full cache", "streaming_llm": "StreamingLLM", "h2o": "H2O", "snapkv": "SnapKV", "adakv": "AdaKV"}
G = model.config.group_size                        # query heads per KV head
print(f"the bundled model: {model.config.n_layer} layers, {model.config.n_head} query heads sharing "
      f"{model.config.n_kv_head} KV heads; samples of {LENGTH} tokens in the exercises")
print_mode(TINY)                                   # quick mode: the text describes another run

# %% [markdown]
# ## 1. What each baseline keeps, on a toy layer
#
# A toy layer first: sixteen prompt tokens, 4 query heads sharing 2 KV heads (query heads 0-1 read KV head 0,
# 2-3 read KV head 1), and a made-up causal attention. Every query puts weight on token 0, a *sink*; the
# queries at positions 6-11 attend token 5, an early *heavy hitter*; the last four queries (the *observation
# window*, `w = 4` here) attend token 9 in KV head 0's query heads and spread over tokens 2, 3, 7 and 8 in
# KV head 1's.

# %%
T_TOY, H_TOY, HKV_TOY, W_TOY, B_TOY = 16, 4, 2, 4, 6
logits = torch.zeros(1, H_TOY, T_TOY, T_TOY)
logits[..., 0] += 3.0                                             # a sink for every query
logits[:, :, 6:12, 5] += 4.0                                      # an early heavy hitter
logits[:, :2, 12:, 9] += 5.0                                      # window of KV head 0: one token
logits[:, 2:, 12:, [2, 3, 7, 8]] += 3.0                           # window of KV head 1: spread out
causal = torch.ones(T_TOY, T_TOY, dtype=torch.bool).tril()
toy_probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)    # (1, H, T, T) the prompt's attention
toy_pos = torch.arange(T_TOY).expand(1, HKV_TOY, T_TOY)               # (1, H_kv, T) positions of the slots
demo_ids = torch.randint(model.config.vocab_size, (1, 22), generator=torch.Generator().manual_seed(0))
demo_maps = record_attention(model, demo_ids)           # the bundled model's attention: n_layer x (H, 22, 22)

fig, axes = plt.subplots(1, H_TOY, figsize=(14, 3.6), sharey=True)
for h, ax in enumerate(axes):
    im = ax.imshow(toy_probs[0, h].numpy(), cmap="magma_r", vmin=0, vmax=1, interpolation="nearest")
    ax.set(title=f"query head {h} (KV head {h // (H_TOY // HKV_TOY)})", xlabel="key position (token attended)",
           xticks=range(0, T_TOY, 3))
    ax.axhline(T_TOY - W_TOY - 0.5, color="tab:blue", ls=":", lw=1)
axes[0].set_ylabel("query position")
fig.suptitle("The toy layer's attention: row = query, column = the token it attends (dotted: the window starts)")
fig.colorbar(im, ax=axes, label="attention probability", shrink=0.8)
plt.show()

# %% [markdown]
# The sink is the dark first column of every head, the heavy hitter the block in column 5, and below the
# dotted line the window's rows, which differ between the two KV heads. The four baselines read this matrix
# in four ways: **StreamingLLM** ignores it and keeps the first tokens and the most recent ones; **H2O**
# keeps the columns with the most attention in total; **SnapKV** keeps the columns the window's rows attend;
# **AdaKV** takes SnapKV's scores but lets one KV head use more than its share. With 6 entries per KV head:

# %% tags=["needs:sinks_and_recent", "needs:h2o_observe", "needs:window_vote", "needs:adakv"]
h2o_scores = received_attention(toy_probs.sum(2), HKV_TOY)             # column sums, GQA group mean
snap = snapkv_scores(toy_probs, HKV_TOY, window=W_TOY, kernel=3, pooling="max")
snapkv = SnapKVPolicy(B_TOY, window=W_TOY, kernel=3)


def kept_by(policy, scores):      # a scorer's rank (its protected slots at +inf), then each head's top budget
    return select_topk(policy.rank(scores, toy_pos, T_TOY), B_TOY)


ada = adaptive_keep_mask(snapkv.rank(snap, toy_pos, T_TOY), B_TOY, n_safe=int(0.2 * B_TOY))  # window first
toy_kept = {
    "StreamingLLM (2 sinks)": kept_by(StreamingLLMPolicy(B_TOY, n_sink=2), toy_pos.float()),
    "H2O (3 recent)": kept_by(H2OPolicy(B_TOY, n_recent=B_TOY // 2), h2o_scores),
    "SnapKV (w = 4, pool 3)": kept_by(snapkv, snap),
    "AdaKV (over SnapKV)": mask_to_indices(ada),
}
toy_image = torch.zeros(len(toy_kept) * HKV_TOY, T_TOY)
for i, idx in enumerate(toy_kept.values()):
    for h in range(HKV_TOY):
        toy_image[i * HKV_TOY + h, idx[0, h][idx[0, h] >= 0]] = 1.0
fig, ax = plt.subplots(figsize=(10, 3.4))
im = ax.imshow(toy_image.numpy(), cmap="Greys", vmin=-0.15, vmax=1.3, aspect="auto", interpolation="nearest")
ax.set_yticks(range(len(toy_image)), [f"{n}, KV {h}" for n in toy_kept for h in range(HKV_TOY)], fontsize=8)
for row in range(HKV_TOY, len(toy_image), HKV_TOY):
    ax.axhline(row - 0.5, color="tab:gray", lw=0.8)
ax.set(title=f"What each rule keeps of the toy layer: {B_TOY} of {T_TOY} tokens per KV head (AdaKV: on average)",
       xlabel="token position", xticks=range(T_TOY))
cb = fig.colorbar(im, ax=ax, ticks=[0, 1])
cb.ax.set_yticklabels(["evicted", "kept"])
plt.tight_layout()
plt.show()

# %% [markdown]
# StreamingLLM keeps the same positions in both KV heads, whatever the attention says. H2O keeps the sink and
# the heavy hitter (token 5) in both heads, its 3 recent tokens, and one token the window attended (9 in KV
# head 0, 2 in KV head 1). SnapKV never sees token 5, which the window does not attend: after the window it
# has room for two prefix tokens per head, token 9 and its pooled neighbour 8 in KV head 0, and in KV head 1,
# whose window spreads its attention, the sink and its neighbour 1. AdaKV ranks the layer's (head, token)
# pairs together: KV head 0's plateau around token 9 outranks what KV head 1 has after its sink, so KV head 0
# gets 7 entries and KV head 1 gets 5.
#
# ## 2. Build them: each rule in a few lines
#
# Each rule below is written from its paper, run on the toy, and compared with the library's function
# (`methods/`). In a student copy of the notebook these four cells are tasks 1-4 of the assignment
# `baselines` (`course/baselines/sheet.md`); the cells after them run once the tasks are done.
#
# ### 2.1 StreamingLLM: attention sinks and a recent window
#
# Xiao et al., ICLR 2024, [arXiv 2309.17453](https://arxiv.org/abs/2309.17453). Softmax attention has to put
# its mass somewhere, and trained models dump the surplus on the first few tokens whatever they say (§3.1);
# evicting those sinks breaks the model. So the rolling cache of §3.2 keeps the first `S = 4` tokens and the
# `R = budget - S` most recent ones. No attention is read; the kept set depends only on positions, and it
# rolls at every decode step. After `T` tokens seen:
#
# $$\text{keep} \;=\; \{0, \dots, S-1\} \;\cup\; \{T-R, \dots, T-1\}, \qquad R = \text{budget} - S
# \qquad \text{(§3.2)}$$

# %%
# BEGIN SOLUTION [baselines:sinks_and_recent] §3.2: the first S positions and the last budget - S ones
def streaming_keep(seen, budget, n_sink):
    """The positions StreamingLLM keeps after `seen` tokens, ascending."""
    sinks = min(n_sink, budget - 1)                    # a small budget cuts the sinks: the newest token must fit
    recent = budget - sinks
    return [p for p in range(seen) if p < sinks or p >= seen - recent]
# END SOLUTION


for seen, budget, n_sink in [(T_TOY, B_TOY, 2), (T_TOY, B_TOY, 4), (5, 8, 4), (100, 3, 4), (1, 1, 4)]:
    library = sorted({p for r in sinks_and_recent(budget, n_sink, seen) for p in r})
    assert streaming_keep(seen, budget, n_sink) == library, f"seen {seen}, budget {budget}, {n_sink} sinks"
print("StreamingLLM on the toy (2 sinks) keeps", streaming_keep(T_TOY, B_TOY, 2), "- the library agrees")

# %% [markdown]
# ### 2.2 H2O: heavy hitters by accumulated attention
#
# Zhang et al., NeurIPS 2023, [arXiv 2306.14048](https://arxiv.org/abs/2306.14048), §4 and Algorithm 1. A few
# tokens ("heavy hitters") receive most of the attention, and a token attended a lot so far tends to stay
# important. Every cached token `j` carries the attention it has received: the prompt's column sums, then
# each decode step's probabilities added on, averaged over the `G` query heads of its KV head. The cache
# keeps the `budget // 2` most recent tokens and the highest scores among the others, at every step:
#
# $$s_j \;=\; \frac{1}{G} \sum_{h \in \text{group}(j)} \; \sum_{\text{steps}} \;
# \sum_{i \,\in\, \text{queries of the step}} A_h[i, j] \qquad \text{(Algorithm 1, §4)}$$
#
# The check runs the toy as a 13-token prompt and three decode steps, and a 20-token prompt and two decode steps
# of the bundled model through the library's H2O cache (a budget that evicts nothing, so the scores can be
# compared slot by slot).

# %%
# BEGIN SOLUTION [baselines:h2o_observe] Algorithm 1: attention received, summed over queries and steps, mean per group
def h2o_scores(steps, n_kv_head):
    """steps: each step's attention (H, n_queries, T_step), T_step growing -> (H_kv, T) accumulated scores."""
    H, T = steps[0].shape[0], steps[-1].shape[-1]
    G = H // n_kv_head
    scores = torch.zeros(n_kv_head, T)
    for probs in steps:                                # the prompt, then every decode step
        for h in range(H):
            received = probs[h].sum(0)                 # (T_step,) what each key received in this step
            scores[h // G, :len(received)] += received / G     # a new key starts at 0
    return scores
# END SOLUTION


toy_steps = [toy_probs[0, :, :13, :13]] + [toy_probs[0, :, i:i + 1, :i + 1] for i in range(13, T_TOY)]
assert torch.allclose(h2o_scores(toy_steps, HKV_TOY), received_attention(toy_probs.sum(2), HKV_TOY)[0]), \
    "the toy's accumulated scores differ from its column sums, mean over each KV head's query heads"
cache = KVCache(model.config, H2OPolicy(budget=64))                  # the library's H2O, nothing evicted
prefill(model, demo_ids[:, :20], cache)
for t in (20, 21):
    decode_step(model, demo_ids[:, t], cache)
for layer, a in enumerate(demo_maps):
    steps = [a[:, :20, :20], a[:, 20:21, :21], a[:, 21:22, :22]]     # the prompt's rows, then one row per step
    assert torch.allclose(h2o_scores(steps, model.config.n_kv_head), cache.layers[layer].state[H2O_SCORE][0],
                          atol=1e-5), f"layer {layer}: the scores differ from the library's H2O cache"
print("H2O's scores on the toy, KV head 0:", [round(x, 2) for x in h2o_scores(toy_steps, HKV_TOY)[0].tolist()])

# %% [markdown]
# ### 2.3 SnapKV: the observation window votes, once, at prefill
#
# Li et al., NeurIPS 2024, [arXiv 2404.14469](https://arxiv.org/abs/2404.14469). The last `w = 32` prompt
# tokens (the *observation window*, which usually holds the question) vote: each earlier token's score is the
# attention the window's queries give it, summed over the window (§4.1); a max pooling of width `K = 7`
# then lets a strong token's neighbours come with it (§4.2). Each KV head keeps the whole window plus its
# top-voted prefix tokens. It compresses **the prompt only, once**: tokens decoded or extended later are all
# kept. For a prefix token `j < T - w`:
#
# $$v_h[j] = \sum_{i=T-w}^{T-1} A_h[i, j], \qquad
# s[j] \;=\; \frac{1}{G} \sum_{h \in \text{group}} \; \max_{|k - j| \le \lfloor K/2 \rfloor} v_h[k]
# \qquad \text{(§4.1, §4.2)}$$

# %%
# BEGIN SOLUTION [baselines:window_vote] §4.1: the window's rows vote for the prefix; §4.2: max pooling; mean per group
def snapkv_votes(probs, n_kv_head, window, kernel):
    """probs (H, T, T) one layer's prompt attention -> (H_kv, T - window) the prefix tokens' pooled votes."""
    H, T, _ = probs.shape
    votes = probs[:, T - window:, :T - window].sum(1)            # (H, T - w) summed over the window's queries
    half = kernel // 2
    pooled = torch.stack([votes[:, max(0, j - half):j + half + 1].max(-1).values
                          for j in range(T - window)], dim=-1)   # (H, T - w) the best of each neighbourhood
    return pooled.view(n_kv_head, H // n_kv_head, -1).mean(1)   # (H_kv, T - w)
# END SOLUTION


library = snapkv_scores(toy_probs, HKV_TOY, window=W_TOY, kernel=3, pooling="max")[0, :, :T_TOY - W_TOY]
assert torch.allclose(snapkv_votes(toy_probs[0], HKV_TOY, W_TOY, 3), library), "the toy's votes differ"
for layer, a in enumerate(demo_maps):                               # the bundled model's attention
    library = snapkv_scores(a[None], model.config.n_kv_head, window=8, kernel=7, pooling="max")[0, :, :22 - 8]
    assert torch.allclose(snapkv_votes(a, model.config.n_kv_head, 8, 7), library, atol=1e-6), f"layer {layer} differs"
votes = snapkv_votes(toy_probs[0], HKV_TOY, W_TOY, 3)
print("SnapKV's votes on the toy's prefix, KV head 1:", [round(x, 2) for x in votes[1].tolist()])

# %% [markdown]
# ### 2.4 AdaKV: one budget pool per layer, shared by the heads
#
# Feng et al., NeurIPS 2025, [arXiv 2407.11550](https://arxiv.org/abs/2407.11550), the adaptive allocation
# (Algorithm 1), as NVIDIA's kvpress library realises it. A head whose attention is concentrated needs few
# entries, a head whose attention is spread out needs many. AdaKV takes any scorer's per-head scores `s_j`
# (SnapKV's, by default: `adakv` = `adakv(snapkv)`), gives every head its own top `n_safe = int(0.2 * budget)`
# (the safeguard), then keeps the layer-wide top `H_kv * budget` (head, token) pairs, so heads end up with
# unequal counts:
#
# $$\tilde s_j[t] = +\infty \ \text{ for } t \in \operatorname{top}_{n_\text{safe}}(s_j), \qquad
# \text{keep} = \operatorname{top}_{H_{kv} \cdot \text{budget}} \big\{ \tilde s_j[t] \big\}_{j,\,t}
# \qquad \text{(Algorithm 1)}$$

# %%
# BEGIN SOLUTION [baselines:adakv] Algorithm 1: every head's own best n_safe first, then the layer's best H_kv * budget
def adakv_keep(scores, budget, n_safe):
    """scores (H_kv, T) one layer's per-head scores -> (H_kv, T) bool: the (head, token) pairs AdaKV keeps."""
    H_kv, T = scores.shape
    pairs = [(j, t) for j in range(H_kv) for t in range(T)]      # the whole layer, head by head
    ranked = scores.clone()
    for j in range(H_kv):                                        # the safeguard: each head's own best n_safe
        best = sorted(range(T), key=lambda t: -scores[j, t])[:n_safe]   # stable: ties go to the earlier token
        ranked[j, best] = math.inf
    pairs = sorted(pairs, key=lambda jt: -ranked[jt])            # one ranking for the layer (stable)
    keep = torch.zeros(H_kv, T, dtype=torch.bool)
    for j, t in pairs[:H_kv * budget]:
        keep[j, t] = True
    return keep
# END SOLUTION


gen = torch.Generator().manual_seed(0)
for scale in (1.0, 10.0):                 # heads of equal scale, then KV head 0's scores ten times larger
    scores = torch.rand(HKV_TOY, T_TOY, generator=gen) * torch.tensor([[scale], [1.0]])
    for n_safe in (0, 1, B_TOY):
        assert torch.equal(adakv_keep(scores, B_TOY, n_safe), adaptive_keep_mask(scores[None], B_TOY, n_safe)[0]), \
            f"scale {scale}, safeguard {n_safe}: another choice than the library's"
    print(f"KV head 0's scores x{scale:g}: entries per KV head {adakv_keep(scores, B_TOY, 1).sum(-1).tolist()} "
          f"(safeguard 1), {adakv_keep(scores, B_TOY, B_TOY).sum(-1).tolist()} (safeguard = budget)")


# %% [markdown]
# The last line shows the failure mode AdaKV's safeguard exists for: a head whose scores are on a larger scale
# takes most of the pool (11 entries; the other head keeps 1), and only the safeguard leaves the other head anything.
#
# ## 3. Real passages with SmolLM2-135M
#
# From here on the notebook uses the library's four methods, on a real model reading natural text:
# SmolLM2-135M (30 layers, 9 query heads sharing 3 KV heads) on `niah_single_docs` prompts, consecutive
# paragraphs of Python's documentation with one magic-number sentence inside and the question at the end of
# the prompt. Each baseline keeps a quarter of the sample's length. Each seed puts the needle at another depth
# among other paragraphs; every passage gets one greedy answer per method, scored as the tables score it (acc,
# see the glossary).

# %%
real, real_tok, real_card = load("smollm2-135m")         # 30 layers, 9 query heads, 3 KV heads (its card), fp32
LENGTH_REAL = 192 if TINY else 320                       # a passage of a few hundred tokens
BUDGET_REAL = LENGTH_REAL // 4                           # keep ratio 0.25
PASSAGES = 2 if TINY else 8                              # seeds 1, 2, ...
print(f"{PASSAGES} passages of at most {LENGTH_REAL} tokens, budget {BUDGET_REAL} entries per layer and KV head")

# %% tags=["needs:sinks_and_recent", "needs:h2o_observe", "needs:window_vote", "needs:adakv"]
t0 = time.time()
real_acc, real_answers = {s: [] for s in ["full"] + SPECS}, {}
for seed in range(1, PASSAGES + 1):
    s = make_sample("niah_single_docs", real_tok, LENGTH_REAL, seed=seed)
    for spec in ["full"] + SPECS:
        policy = None if spec == "full" else make_policy(spec, budget=BUDGET_REAL)
        said = answer(real, real_tok, s, MODES[0], policy, max_new_tokens=len(s.target_ids))
        real_acc[spec].append(string_match_all(said, s.answers))
        real_answers[spec, seed] = said
    n, (_, s_v, s_end) = len(s.prompt_ids), needle_spans(s, real_tok)[0]
    who = ", ".join(NAMES[x] for x in real_acc if real_acc[x][-1] == 1) or "none"
    print(f"passage {seed}: {n} tokens, value at {s_v}-{s_end - 1}; recent tokens from {n - (BUDGET_REAL - 4)} "
          f"(StreamingLLM), from {n - BUDGET_REAL // 2} (H2O); answered by {who}")
n_ok = {spec: int(sum(a)) for spec, a in real_acc.items()}
bounds = {spec: wilson(n_ok[spec] / PASSAGES, PASSAGES) for spec in real_acc}
fig, ax = plt.subplots(figsize=(7, 3.6))
x = range(len(real_acc))
means = [n_ok[s] / PASSAGES for s in real_acc]
ax.bar(x, means, color=["black"] + [f"C{i}" for i in range(len(SPECS))], alpha=0.8,
       yerr=[[m - bounds[s][0] for m, s in zip(means, real_acc)], [bounds[s][1] - m for m, s in zip(means, real_acc)]],
       capsize=4)
ax.set_xticks(list(x), [NAMES[s] for s in real_acc])
ax.set(title=f"SmolLM2-135M, {PASSAGES} passages, keep 0.25: share answered (95% Wilson interval)",
       ylabel="accuracy (share of passages)", ylim=(0, 1.05), xlabel="cache")
plt.tight_layout()
plt.show()
for spec in SPECS:
    lo_, hi_ = bounds[spec]
    against_h2o = "" if spec == "h2o" else \
        f"; against H2O: {describe(*paired_difference([real_acc[spec]], [real_acc['h2o']]))}"
    print(f"{NAMES[spec]:13} answers {n_ok[spec]} of {PASSAGES} [{lo_:.2f}, {hi_:.2f}]; against the full cache "
          f"({n_ok['full']} of {PASSAGES}): {describe(*paired_difference([real_acc[spec]], [real_acc['full']]))}"
          + against_h2o)
print(f"({time.time() - t0:.0f} s)")


# %% [markdown]
# The bars are the share of the passages each cache answers, with its 95% interval: StreamingLLM answers 4 of
# the 8 passages, H2O 3, SnapKV and AdaKV 2, against the full cache's 7. Every baseline is distinguishably
# below the full cache, and with 8 passages none is distinguishable from H2O (each paired 95% interval
# contains 0). What decides is where the needle sits: StreamingLLM answers exactly the passages whose value
# lies in its recent window, H2O exactly those whose value lies in its recent half (the last `budget // 2`
# tokens), and no baseline answers the three passages whose needle is near the start (1, 5 and 6).
#
# **Verdict**: on real text the four baselines keep what is recent or what every query attends (for H2O, the
# start of the passage), and lose an old fact. On the bundled model, trained on needles, H2O's accumulated
# attention does keep an old needle's value, and H2O leads the other three from keep 0.25 up (the lab): one
# model's ranking of the baselines does not carry over to another.

# %% [markdown]
# ## Exercises
#
# Exercises 1-3 check themselves: write the missing lines, run the cell, and the `assert` after them tells
# you whether the library agrees. Work on a copy of the notebook (see the README).
#
# ### Exercise 1: StreamingLLM's kept positions after decoding
#
# A prompt, then five decoded tokens, through a StreamingLLM cache with `budget = 40` and `n_sink = 4`.
# Compute, with tensor operations and from `ex_seen`, `EX_BUDGET` and `EX_SINKS` only, the positions every
# layer and KV head must hold now: `expected`, a 1-D tensor of positions in ascending order.

# %% tags=["needs:sinks_and_recent", "needs:h2o_observe", "needs:window_vote", "needs:adakv"]
def entries_per_head(cache, layer=0):
    pos = cache.layers[layer].pos[0]                                     # (H_kv, T), -1 = empty slot
    return (pos >= 0).sum(-1).tolist()


ex_sample = make_sample("niah_single_prose", tok, LENGTH, seed=7)
EX_BUDGET, EX_SINKS = 40, 4
ex_cache = KVCache(model.config, make_policy("streaming_llm", budget=EX_BUDGET, n_sink=EX_SINKS))
prefill(model, torch.tensor([ex_sample.prompt_ids]), ex_cache)
for token in ex_sample.target_ids[:5]:
    decode_step(model, torch.tensor([token]), ex_cache)
ex_seen = ex_cache.seen
print(f"tokens seen: {ex_seen}; entries per KV head in layer 0: {entries_per_head(ex_cache)}")

# BEGIN SOLUTION [baselines] the sinks (never the whole budget: the newest token must fit), then the most recent
n_s = min(EX_SINKS, EX_BUDGET - 1)
expected = torch.cat([torch.arange(n_s), torch.arange(ex_seen - (EX_BUDGET - n_s), ex_seen)])
# END SOLUTION
assert all(torch.equal(kv.pos[0, h][kv.pos[0, h] >= 0].sort().values, expected) for kv in ex_cache.layers
           for h in range(kv.pos.shape[1])), \
    "some layer or KV head holds other positions than `expected`: the sinks are positions 0..S-1 and the " \
    "window is the last budget - S positions *seen* (prompt and decoded tokens), ending at ex_seen - 1"
print("Exercise 1: correct,", expected.tolist())

# %% [markdown]
# ### Exercise 2: what H2O keeps
#
# `ex_maps[l]` is the full-cache attention of the prompt in layer `l`, shape `(H, N, N)` (row = query,
# column = key). Compute H2O's prefill scores `ex_scores[l]`, shape `(H_kv, N)` (section 2.2, with tensor
# operations this time), then `ex_kept[l]`, shape `(H_kv, EX_H2O_BUDGET)`: the positions H2O keeps,
# ascending: the `n_recent = budget // 2` most recent ones and the highest-scored of the others. The checks
# compare them with `ex_h2o_all` (a budget that keeps everything, so its per-slot scores are the prefill
# scores of every position) and with `ex_h2o` (the budget applied).

# %% tags=["needs:sinks_and_recent", "needs:h2o_observe", "needs:window_vote", "needs:adakv"]
ex_ids = torch.tensor([ex_sample.prompt_ids])
ex_N = ex_ids.shape[1]
ex_maps = record_attention(model, ex_ids)                          # n_layer x (H, N, N)
H_kv = model.config.n_kv_head
EX_H2O_BUDGET = 64
ex_h2o_all = KVCache(model.config, make_policy("h2o", budget=ex_N))
prefill(model, ex_ids, ex_h2o_all)
ex_h2o = KVCache(model.config, make_policy("h2o", budget=EX_H2O_BUDGET))
prefill(model, ex_ids, ex_h2o)
print(f"{ex_N} prompt tokens, {len(ex_maps)} layers, attention {tuple(ex_maps[0].shape)}, G = {G}")

# BEGIN SOLUTION [baselines] attention received, summed over queries, averaged per GQA group; the recent half stays
ex_scores = [a.sum(1).view(H_kv, G, ex_N).mean(1) for a in ex_maps]
ex_kept = []
for s in ex_scores:
    s = s.clone()
    s[:, ex_N - EX_H2O_BUDGET // 2:] = float("inf")                  # the recent window is always kept
    ex_kept.append(s.topk(EX_H2O_BUDGET, dim=-1).indices.sort(-1).values)
# END SOLUTION
assert all(torch.allclose(s, kv.state[H2O_SCORE][0], atol=1e-4) for s, kv in zip(ex_scores, ex_h2o_all.layers)), \
    "ex_scores differ from H2O's prefill scores: sum over the queries (dim 1 of (H, N, N)), not the keys, " \
    "then the mean (not the sum) over each group of G query heads"
assert all(torch.equal(k, kv.pos[0]) for k, kv in zip(ex_kept, ex_h2o.layers)), \
    "ex_kept differs from what H2O kept: the last budget // 2 positions always stay, the rest are the " \
    "highest scores of the older positions, sorted ascending per KV head"
print("Exercise 2: correct; layer 0, KV head 0 keeps", ex_kept[0][0, :12].tolist(), "...")

# %% [markdown]
# ### Exercise 3: what SnapKV keeps
#
# From the same `ex_maps`, compute what SnapKV (window `w = 32`, max pooling of width 7, budget
# `EX_SNAP_BUDGET`) keeps in each layer, `ex_snap_kept[l]` of shape `(H_kv, EX_SNAP_BUDGET)`, ascending: the
# votes of section 2.3 (with `F.max_pool1d`, stride 1, padding 3, this time), the top `EX_SNAP_BUDGET - w`
# prefix positions (on equal votes the earlier position wins: a *stable* descending sort), and the window.

# %% tags=["needs:sinks_and_recent", "needs:h2o_observe", "needs:window_vote", "needs:adakv"]
EX_SNAP_BUDGET, EX_W = 64, 32
ex_snap = KVCache(model.config, make_policy("snapkv", budget=EX_SNAP_BUDGET, window=EX_W, kernel=7, pooling="max"))
prefill(model, ex_ids, ex_snap)
print(f"SnapKV keeps {entries_per_head(ex_snap)} entries per KV head in layer 0 of a {ex_N}-token prompt")

# BEGIN SOLUTION [baselines] window rows over prefix columns, summed; max_pool1d(7, 1, 3); group mean; stable top-k
ex_snap_kept = []
for a in ex_maps:
    votes = a[:, -EX_W:, :ex_N - EX_W].sum(1)                                  # (H, N - w)
    votes = F.max_pool1d(votes[:, None], 7, stride=1, padding=3)[:, 0]         # clusters neighbours
    votes = votes.view(H_kv, G, -1).mean(1)                                    # (H_kv, N - w)
    top = torch.sort(votes, dim=-1, descending=True, stable=True).indices[:, :EX_SNAP_BUDGET - EX_W]
    window = torch.arange(ex_N - EX_W, ex_N).expand(H_kv, EX_W)
    ex_snap_kept.append(torch.cat([top.sort(-1).values, window], dim=-1))
# END SOLUTION
assert all(torch.equal(k, kv.pos[0]) for k, kv in zip(ex_snap_kept, ex_snap.layers)), \
    "ex_snap_kept differs from SnapKV's kept positions: votes come from the last w query rows over the " \
    "prefix columns only; pool before the group mean; ties go to the earlier position; the window is kept whole"
print("Exercise 3: correct; layer 3, KV head 1 keeps the prefix positions",
      ex_snap_kept[-1][1, :EX_SNAP_BUDGET - EX_W].tolist())


# %% [markdown]
# ### Exercise 4: what the safeguard does
#
# AdaKV gives every head its own top `int(alpha_safeguard * budget)` entries before the layer-wide
# ranking (`alpha_safeguard = 0.2` by default). Build `make_policy("adakv", budget=BUDGET,
# alpha_safeguard=a)` for `a` in `0.0, 0.2, 1.0`, prefill the needle prompt
# `make_sample("niah_single_noise", tok, LENGTH, seed=1)` (the one the lab's section 1 studies), and print
# `entries_per_head(cache, layer)` for every layer. Which value of `a` makes AdaKV exactly SnapKV (compare
# the kept positions with `torch.equal`)? With `a = 0`, does some head lose its whole budget except the
# observation window, and does the greedy answer (`answer(model, tok, sample, MODES[0], policy)`) change?
#
# ### Exercise 5: StreamingLLM without sinks, H2O without a recent window
#
# On the same needle, measure KL and lost (the glossary, A.4 and A.6) with `traces` and `compare_traces` from
# `methods.evaluation.harness`, as the lab's section 1.2 does, for `make_policy("streaming_llm",
# budget=BUDGET, n_sink=0)` and `make_policy("h2o", budget=BUDGET, n_recent=0)` against the defaults. How do
# KL and lost change? §3.1 of the StreamingLLM paper says a window without sinks collapses; does it on this
# model, at this budget?

# %%
print(f"notebook ran in {time.time() - t_start:.0f} s")

# %% [markdown]
# ## Appendix: metrics glossary
#
# The tables of `python -m methods.compare` (and of every notebook) have one row per method and keep ratio,
# and the columns below, each one entry of `METRICS` in `methods/evaluation/metrics.py`. For each sample and
# mode, `traces` (`methods/evaluation/harness.py`) runs the prompt, then feeds the **reference** answer one
# token at a time (teacher forcing) through the full cache and through each method's cache, so all of them
# see the same tokens; `compare_traces` measures a method's trace against the full cache's.
# `tests/methods/evaluation/test_glossary.py` recomputes each metric by hand from two traces, as worded
# here, and checks that the library agrees.
#
# ### A.1 Budget and keep ratio
#
# * **budget**: tokens kept per layer and KV head, protected tokens (sinks, recent or observation windows)
#   included. For AdaKV it is the *average* per KV head: the layer keeps `H_kv * budget` entries, split
#   unequally. SnapKV and AdaKV compress the prompt only, so what comes after it (the decoded answer, and in
#   the second mode below the question) is appended and kept on top of `budget`. StreamingLLM and H2O bring
#   every layer back to `budget` after every step.
# * **keep ratio** (`keep`): `budget / tokens seen` (`nanollm/policy.py`). A table's `keep` is
#   `round(budget / length, 4)`, with `length` the requested sample length, an upper bound on its tokens
#   (context, question and answer); so `budget = round(keep * length)`, e.g. `round(0.1 * 512) = 51`. The
#   prompt is shorter than `length`, so a prefill method keeps a slightly larger share of the prompt (the
#   lab's section 1 prints it).
#
# ### A.2 The two modes
#
# * **question_in_prompt**: `prefill(context + question)`, then decode. The cache is compressed with the
#   question in it, so SnapKV's observation window is essentially the question.
# * **question_after_context**: `prefill(context)`, compressed before the question is known, then
#   `extend(question)` onto the compressed cache, then decode. An evicted fact cannot come back when the
#   question asks for it, and SnapKV's window is the end of the context, not the question.
#
# ### A.3 acc
#
# RULER's `string_match_all` of the **greedy** answer (`nanollm/data/tasks.py`): the fraction of the
# reference strings found in the answer, case-insensitive, a digit string only as a whole number (`12345` is
# not found inside `123456`). The answer is decoded up to the end-of-text token or the task's answer length.
# A table cell is the mean over samples, `mean acc` the mean over tasks, and its interval is Wilson's over all
# the row's answers. A difference between two rows is distinguishable when its paired 95% bootstrap interval
# excludes 0 (`methods/evaluation/intervals.py`).
#
# ### A.4 KL
#
# `KL(full || method)` of the next-token distributions, in nats, averaged over the answer positions: at
# position `m` both caches have seen the prompt and the reference answer's first `m` tokens, and
#
# $$\text{KL} = \frac{1}{M} \sum_{m} \sum_{v} p_\text{full}(v \mid m)
# \big(\log p_\text{full}(v \mid m) - \log p_\text{method}(v \mid m)\big).$$
#
# It does not depend on greedy decoding going right, so it separates methods that all answer wrong.
#
# ### A.5 pert (and attn_l1)
#
# `pert`: the relative error of the **final hidden state** (after the final norm, the input of the output
# layer) at the **first decode step**, the step that feeds the first answer token:
# `pert = ||h_full - h_method||_2 / ||h_full||_2`. With the question in the prompt it is the first step where a
# prefill compression can show, since the prompt's own attention is exact (after the context, the question's
# `extend` already reads the compressed cache). The records also hold `attn_l1`, not a table column: per layer
# and query head at the same step, `||o_full - o_method||_1` of the head's output before `W_O`. CriticalKV
# (notebook 04) minimises a bound on a related quantity, that difference projected through each head's slice
# of `W_O` (its Eq. 5).
#
# ### A.6 lost
#
# The full cache's attention mass, at the first decode step, on the positions the method does **not** hold
# exactly: for each layer and query head, the sum of `p_full(j)` over the positions `j` whose raw key and value
# are not in the method's storage of that head's KV group, then the mean over layers and query heads. It uses
# the full cache's probabilities, not the method's (which renormalise over what was kept), and an entry a
# method rebuilds approximately (KVReviver) counts as lost. It is a share in [0, 1]: 0 means that nothing the
# full cache attends was dropped.
#
# ### A.7 KV KiB and step ms
#
# `KV KiB`: the peak bytes of stored keys and values over all layers during a trace (AdaKV's padding slots
# included, see `methods/adakv.py`); a table cell is the largest peak over the row's samples and tasks, where
# the other columns are means. `step ms`: a rough time per decode step, all the methods of a sample stepping
# side by side; `python -m methods.evaluation.bench` is the benchmark.

# %% [markdown]
# **Go further**: [labs/01_baselines_compared.ipynb](labs/01_baselines_compared.ipynb) takes the library's four
# baselines further: which positions each keeps of one needle on the bundled model, and why SnapKV keeps the
# question's key but not the answer; one SmolLM2 passage up close, token by token; and accuracy, KL and memory
# on the bundled model's task suite at three keep ratios in both modes, with paired intervals.

# %%
from methods.evaluation.viz import print_run_time  # the whole notebook, from its first cell

print_run_time()
