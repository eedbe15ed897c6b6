# %% [markdown]
# # 01 Baselines: four ways to choose what a KV cache keeps
#
# **Before this lesson**: lesson 00 ([00_nanollm_kv_cache.ipynb](00_nanollm_kv_cache.ipynb)): the KV cache,
# and how a method evicts its entries.
#
# A compressed KV cache keeps a fixed number of entries, the *budget*, per layer and KV head. Every later method
# is compared with four simple rules for choosing them: **StreamingLLM**, **H2O**, **SnapKV** and **AdaKV**. We
# build each from its paper, check it against the library, and ask: **what does each rule keep, and why?**

# %% tags=["setup"]
from preamble import TINY

# %% [markdown]
# ## 1. What each rule reads: a toy layer
#
# Sixteen prompt tokens, 4 query heads sharing 2 KV heads (query heads 0-1 read KV head 0, 2-3 read KV head
# 1), and a made-up causal attention: every query attends token 0, a *sink*; queries 6-11 attend token 5, an
# early *heavy hitter*; the last four queries, the *observation window*, attend token 9 in KV head 0 and spread
# over tokens 2, 3, 7 and 8 in KV head 1 (a little less each, and each less than the sink 0).

# %%
import torch

T_TOY, H_TOY, HKV_TOY, W_TOY, B_TOY = 16, 4, 2, 4, 6      # tokens, query heads, KV heads, window, budget
logits = torch.zeros(1, H_TOY, T_TOY, T_TOY)
logits[..., 0] += 3.0                                             # a sink for every query
logits[:, :, 6:12, 5] += 4.0                                      # an early heavy hitter
logits[:, :2, 12:, 9] += 5.0                                      # window of KV head 0: one token
logits[:, 2:, 12:, [2, 3, 7, 8]] += torch.tensor([2.9, 2.8, 2.7, 2.6])   # window of KV head 1: spread out
toy_probs = logits.masked_fill(~torch.ones(T_TOY, T_TOY, dtype=torch.bool).tril(), float("-inf")).softmax(-1)

# %% [markdown]
# StreamingLLM ignores this attention, H2O sums its columns, SnapKV reads only the window's rows, and AdaKV
# shares SnapKV's budget unequally among the KV heads.
#
# ## 2. Build them: each rule in a few lines
#
# Symbols, besides the shared ones of [notebooks/README.md](README.md):
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $j$ | a KV head | `j` |
# | $\mathcal{G}_j$ | the $G$ query heads of KV head $j$: $jG, \dots, (j+1)G - 1$ | `h // G == j` |
# | $t$ | a query's position, any of those a sum runs over (not only the newest) | a row of `probs` |
# | $a^h_{t,n}$ | $a_{t,n}$ in query head $h$ | `probs[h, t, n]` |
# | $s_{j,n}$ | token $n$'s score in KV head $j$ (higher stays) | `scores` |
# | $u^h_n$, $P$ | SnapKV's vote for $n$ in query head $h$; its pooling width | `votes`, `kernel` |
#
# ### 2.1 StreamingLLM: attention sinks and a recent window
#
# Xiao et al., ICLR 2024, [arXiv 2309.17453](https://arxiv.org/abs/2309.17453). Trained models dump surplus
# attention on the first few tokens (§3.1); evicting these *sinks* breaks the model. So the rolling cache of
# §3.2 keeps the first $S$ tokens ($S = 4$ by default) and the $B - S$ most recent ones. After $T$ tokens:
#
# $$\text{keep} \;=\; \{0, \dots, S-1\} \;\cup\; \{T-(B-S), \dots, T-1\} \qquad \text{(§3.2)}$$
#
# A budget of at most `n_sink` entries cuts the sinks so that the newest token still fits:
# $S = \min(\texttt{n\_sink}, B - 1)$.

# %%
from methods.streaming_llm import sinks_and_recent


def streaming_keep(seen, budget, n_sink):
    """The positions StreamingLLM keeps after `seen` tokens, ascending."""
    # BEGIN SOLUTION [baselines:sinks_and_recent] §3.2: the first S positions and the last budget - S ones
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
# tokens, the *heavy hitters*, receive most of the attention and tend to stay important. A token's score is
# the attention it has received from every query so far, averaged over its KV head's $G$ query heads:
#
# $$s_{j,n} \;=\; \frac{1}{G} \sum_{h \in \mathcal{G}_j} \; \sum_{t=n}^{T-1} a^h_{t,n}
# \qquad \text{(Algorithm 1, §4)}$$
#
# (The paper's models have one KV head per query head. Averaging over the group, here and in SnapKV, is how
# kvpress, NVIDIA's library of these methods, adapts the rule to grouped-query attention, and how we do.)
#
# In a cache, every step keeps the `budget // 2` most recent tokens and the best-scored others; an evicted
# token's score is gone. The code below evicts nothing: it adds the scores up step by step on the toy read as a
# 13-token prompt, then three decode steps. A causal row does not depend on later tokens, so each step's
# attention is a slice of the toy's map, and the sums are its column sums (the library's `received_attention`).

# %%
from methods.h2o import received_attention


def h2o_scores(steps, n_kv_head):
    """steps: each step's attention (H, n_queries, T_step), T_step growing -> (H_kv, T) accumulated scores."""
    # BEGIN SOLUTION [baselines:h2o_observe] Algorithm 1: attention received, summed over queries and steps, group mean
    H, T = steps[0].shape[0], steps[-1].shape[-1]
    G = H // n_kv_head
    scores = torch.zeros(n_kv_head, T)
    for probs in steps:                                # the prompt, then every decode step
        for h in range(H):
            received = probs[h].sum(0)                 # (T_step,) what each key received in this step
            scores[h // G, :len(received)] += received / G     # a new key starts at 0
    return scores
    # END SOLUTION


toy_steps = [toy_probs[0, :, :13, :13]] + [toy_probs[0, :, i:i + 1, :i + 1] for i in range(13, T_TOY)]  # (H, q, T)
column_sums = toy_probs.sum(2)                                      # (1, H, T) summed over the queries
assert torch.allclose(h2o_scores(toy_steps, HKV_TOY), received_attention(column_sums, HKV_TOY)[0]), \
    "the toy's accumulated scores differ from its column sums, mean over each KV head's query heads"
for j, row in enumerate(h2o_scores(toy_steps, HKV_TOY)):                   # (T,) one KV head's scores
    print(f"H2O's scores on the toy, KV head {j}:", [round(x, 2) for x in row.tolist()])

# %% [markdown]
# ### 2.3 SnapKV: the observation window votes, once, at prefill
#
# Li et al., NeurIPS 2024, [arXiv 2404.14469](https://arxiv.org/abs/2404.14469). The prompt's last $w$ tokens
# ($w = 32$ by default), the *observation window*, usually hold the question. They vote: token $n$'s vote
# $u^h_n$ is the attention the window's queries give it (§4.1). A max pooling of width $P$ ($P = 7$ by default)
# gives token $n$ the best vote of its neighbours $n'$, so a strong token's neighbours come with it (§4.2). For a
# prefix token $n < T - w$:
#
# $$u^h_n = \sum_{t=T-w}^{T-1} a^h_{t,n}, \qquad
# s_{j,n} \;=\; \frac{1}{G} \sum_{h \in \mathcal{G}_j} \; \max_{|n' - n| \le \lfloor P/2 \rfloor,\; n' < T - w} u^h_{n'}
# \qquad \text{(§4.1, §4.2)}$$
#
# Each KV head keeps the window (a cache ranks it at $+\infty$) and its $B - w$ best-scored prefix tokens. SnapKV
# compresses **the prompt only, once**: tokens decoded later are all kept.

# %%
from exercises import where_differs
from methods.snapkv import SnapKVPolicy, snapkv_scores


def snapkv_votes(probs, n_kv_head, window, kernel):
    """probs (H, T, T) one layer's prompt attention -> (H_kv, T - window) the prefix tokens' pooled votes."""
    # BEGIN SOLUTION [baselines:window_vote] §4.1: the window's rows vote for the prefix; §4.2: max-pool; group mean
    H, T, _ = probs.shape
    votes = probs[:, T - window:, :T - window].sum(1)            # (H, T - w) summed over the window's queries
    half = kernel // 2
    pooled = torch.stack([votes[:, max(0, n - half):n + half + 1].max(-1).values     # votes ends at T - w: n' < T - w
                          for n in range(T - window)], dim=-1)   # (H, T - w) the best of each neighbourhood
    return pooled.view(n_kv_head, H // n_kv_head, -1).mean(1)   # (H_kv, T - w)
    # END SOLUTION


RULE = "summed over the window's queries, max-pooled over the kernel's neighbours, averaged over a KV head's group"
for P in (3, 1):                                                    # the toy, pooled over 3 neighbours, then not
    # the library also scores the window's own tokens, which a cache then ranks at +inf: keep the prefix's
    library = snapkv_scores(toy_probs, HKV_TOY, window=W_TOY, kernel=P, pooling="max")[0, :, :T_TOY - W_TOY]
    mine = snapkv_votes(toy_probs[0], HKV_TOY, W_TOY, P)
    assert not (off := where_differs(mine, library, ("KV head", "token"))), f"the toy's votes, P = {P}: {off}; {RULE}"
    for j, row in enumerate(mine):                                          # (T - w,) one KV head's scores
        print(f"SnapKV's scores of the toy's prefix, P = {P}, KV head {j}:", [round(x, 2) for x in row.tolist()])
noise = torch.rand(logits.shape, generator=torch.Generator().manual_seed(0))      # the heads of a group differ
noisy = (logits + noise).masked_fill(~torch.ones(T_TOY, T_TOY, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
assert not (off := where_differs(snapkv_votes(noisy[0], HKV_TOY, W_TOY, 3), snapkv_scores(
    noisy, HKV_TOY, window=W_TOY, kernel=3, pooling="max")[0, :, :T_TOY - W_TOY], ("KV head", "token"))), \
    f"noisy heads, P = 3: {off}; {RULE} (pool each query head's votes, then average)"
print("snapkv_votes equals the library's snapkv_scores on the toy, pooled and not, and on noisy heads")

# %% [markdown]
# ### 2.4 AdaKV: one budget pool per layer, shared by the heads
#
# Feng et al., NeurIPS 2025, [arXiv 2407.11550](https://arxiv.org/abs/2407.11550), Algorithm 1. A head whose
# attention is concentrated needs few entries; one whose attention is spread out needs many. AdaKV takes any
# rule's scores $s_{j,n}$ (SnapKV's by default) and keeps the layer's $H_{kv} B$ best (head, token) pairs,
# whichever heads they fall in. First, a *safeguard* gives every KV head its own
# $n_\text{safe} = \lfloor 0.2 B \rfloor$ best (none below $B = 5$). As kvpress does, it counts the entries the rule
# always keeps: inside SnapKV, each head's window is its best. The check below shows what the safeguard is for: with
# KV head 0's scores ten times larger, that head takes all 12 entries of the pool when $n_\text{safe} = 0$.
#
# $$\tilde s_{j,n} = \begin{cases} +\infty & n \text{ among the } n_\text{safe} \text{ best of head } j \\
# s_{j,n} & \text{otherwise} \end{cases}, \qquad \text{keep the } H_{kv} B \text{ largest } \tilde s_{j,n}
# \qquad \text{(Algorithm 1, the safeguard as kvpress counts it)}$$

# %%
from methods.adakv import adaptive_keep_mask


def adakv_keep(scores, budget, n_safe):
    """scores (H_kv, T) one layer's per-head scores -> (H_kv, T) bool: the (head, token) pairs AdaKV keeps."""
    # BEGIN SOLUTION [baselines:adakv] Algorithm 1: each head's best n_safe first, then the layer's best H_kv * budget
    H_kv, T = scores.shape
    pairs = [(j, n) for j in range(H_kv) for n in range(T)]      # the whole layer, head by head
    ranked = scores.clone()
    for j in range(H_kv):                                        # the safeguard: each head's own best n_safe
        best = sorted(range(T), key=lambda n: -scores[j, n])[:n_safe]   # stable: ties go to the earlier token
        ranked[j, best] = float("inf")
    pairs = sorted(pairs, key=lambda jn: -ranked[jn])            # one ranking for the layer (stable)
    keep = torch.zeros(H_kv, T, dtype=torch.bool)
    for j, n in pairs[:H_kv * budget]:
        keep[j, n] = True
    return keep
    # END SOLUTION


gen = torch.Generator().manual_seed(0)
for scale in (1.0, 10.0):                 # heads of equal scale, then KV head 0's scores ten times larger
    scores = torch.rand(HKV_TOY, T_TOY, generator=gen) * torch.tensor([[scale], [1.0]])
    for n_safe in (0, 1, B_TOY):
        mine, library = adakv_keep(scores, B_TOY, n_safe), adaptive_keep_mask(scores[None], B_TOY, n_safe)[0]
        assert not (off := where_differs(mine, library, ("KV head", "token"))), \
            f"scale {scale}, safeguard {n_safe}: kept? {off}; each head's best n_safe, then the layer's best"
        if scale == 10.0:                                        # KV head 0's scores ten times larger
            print(f"KV head 0 ten times larger, safeguard {n_safe}: entries kept per KV head {mine.sum(-1).tolist()}")
print("adakv_keep makes the library's choice for both scales and safeguards 0, 1 and B_TOY")

# %% [markdown]
# ### 2.5 What each rule keeps of the toy
#
# The functions you built, on the whole toy read as one prompt (StreamingLLM's choice is in section 2.1), with a
# budget of `B_TOY` per KV head. What a rule always keeps (H2O's `B_TOY // 2` recent tokens, SnapKV's window) is
# scored $+\infty$, then each KV head keeps its best scores; SnapKV's votes are not pooled ($P = 1$), so that no
# tie decides what is kept. AdaKV on these SnapKV scores is the exercise.

# %% tags=["needs:sinks_and_recent", "needs:h2o_observe", "needs:window_vote", "needs:adakv"]
def best(scores, budget):
    """scores (H_kv, T) -> (H_kv, budget) each KV head's best-scored positions, ascending."""
    return scores.topk(budget, dim=-1).indices.sort(-1).values


h2o = h2o_scores([toy_probs[0]], HKV_TOY)                         # (H_kv, T) the prompt as one step
h2o[:, T_TOY - B_TOY // 2:] = float("inf")                         # the recent half always stays
window = torch.full((HKV_TOY, W_TOY), float("inf"))                # (H_kv, w) the window always stays
snap = torch.cat([snapkv_votes(toy_probs[0], HKV_TOY, W_TOY, 1), window], -1)   # (H_kv, T), P = 1
toy_kept = {"H2O": best(h2o, B_TOY).tolist(), "SnapKV": best(snap, B_TOY).tolist()}
print(f"B_TOY = {B_TOY} entries per KV head")
for name, rows in toy_kept.items():
    print(f"{name:7}", "   ".join(f"KV head {j}: {row}" for j, row in enumerate(rows)))

# %% [markdown]
# **H2O** keeps the sink 0, the heavy hitter 5, the 3 recent tokens, and one more: 9 in KV head 0, 2 in KV
# head 1, the tokens the window attends. Token 5 stays on the attention it received long before the window.
#
# **SnapKV** drops token 5, which the window does not attend, and keeps the two prefix tokens the window
# attends most: the sink 0 and 9 in KV head 0, the sink 0 and 2 in KV head 1.
#
# ## Exercises
#
# ### Exercise 1: how AdaKV shares the layer's budget
#
# Hand AdaKV section 2.5's SnapKV scores (the window at $+\infty$, the votes not pooled) with `B_TOY` = 6 entries per
# KV head: 12 in the layer, and a safeguard of $\lfloor 0.2 \cdot 6 \rfloor = 1$, which each head's window already
# holds (its $+\infty$ entries are its best). How many entries does AdaKV give each KV head? Read it off section
# 2.3's $P = 1$ scores, without code, and write `my_entries = [KV head 0's, KV head 1's]`. The check under it asks
# the library and hints when the answer is wrong; the reference answer is collapsed below it.

# %%
my_entries = None               # replace None: [entries of KV head 0, entries of KV head 1]

# %% tags=["needs:sinks_and_recent", "needs:h2o_observe", "needs:window_vote", "needs:adakv"]
from exercises import exercise


@exercise("Exercise 1")
def check_entries(entries):
    pos = torch.arange(T_TOY).expand(1, HKV_TOY, T_TOY)               # (1, H_kv, T) positions of the slots
    ranked = SnapKVPolicy(B_TOY, window=W_TOY, kernel=1).rank(        # the library's SnapKV, window at +inf
        snapkv_scores(toy_probs, HKV_TOY, window=W_TOY, kernel=1, pooling="max"), pos, T_TOY)
    right = adaptive_keep_mask(ranked, B_TOY, int(0.2 * B_TOY))[0].sum(-1).tolist()   # (H_kv,) entries per KV head
    assert len(entries) == HKV_TOY, "two counts: KV head 0's, then KV head 1's"
    assert sum(entries) == HKV_TOY * B_TOY, "the layer holds 2 x 6 = 12 entries, shared by its two KV heads"
    assert [int(n) for n in entries] == right, "each window takes its 4 entries (+inf); the 4 others go to the " \
        "layer's 4 highest prefix scores, whichever KV head they are in"
    return "The free entries follow the scores: KV head 1, whose window spreads its attention, gets most of them, " \
        "and KV head 0 loses its sink (nothing in SnapKV or AdaKV protects a sink, only the window's attention to it)"


check_entries(my_entries)

# %% tags=["needs:sinks_and_recent", "needs:h2o_observe", "needs:window_vote", "needs:adakv"]
# BEGIN SOLUTION [baselines] each window's 4, then the layer's 4 best prefix votes: 9 in KV head 0, three in 1
votes = snapkv_votes(toy_probs[0], HKV_TOY, W_TOY, 1)                # (H_kv, T - w) the prefix's votes, P = 1
kept = adakv_keep(torch.cat([votes, window], -1), B_TOY, 1)         # (H_kv, T) the window at +inf
reference_entries = kept.sum(-1).tolist()
# END SOLUTION
check_entries(reference_entries)
for j in range(HKV_TOY):                                            # the free entries: the layer's 4 best votes
    free = [round(v, 2) for v in votes[j][kept[j, :T_TOY - W_TOY]].tolist()]
    print(f"KV head {j}: {reference_entries[j]} entries, the window's {W_TOY} and the prefix votes {free}")

# %% [markdown]
# **Go further**: [labs/01_baselines_compared.ipynb](labs/01_baselines_compared.ipynb): the four rules on one
# needle with the bundled model, and on real passages with SmolLM2-135M: accuracy, KL and memory at three keep
# ratios.
