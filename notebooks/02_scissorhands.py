# %% [markdown]
# # 02 Scissorhands: a budget cache built on the persistence of importance
#
# Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache
# Compression at Test Time", NeurIPS 2023, [arXiv 2305.17118](https://arxiv.org/abs/2305.17118).
#
# **The question.** Can a KV cache of fixed size keep the model's quality if it drops the right tokens as it
# goes? Scissorhands bets that importance persists: the tokens one decoding step attends to strongly are mostly
# those later steps attend to (§3). So a token that got *less than average* attention at most recent steps can go.
#
# **Before this lesson**: lesson 00 (`KVCache`, `prefill`) and lesson 01 (caches that evict: H2O, StreamingLLM).
# Symbols: the book's [table](README.md); metrics: its [glossary](README.md#metrics).

# %% tags=["setup"]
from preamble import TINY  # the repository importable, one torch thread, seed 0; TINY: a quick run

# %% [markdown]
# ## 1. The idea, built by hand
#
# $T$, $t$, $n$ and $B$ are the book's; Scissorhands adds:
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $A_i$ | the tokens the query at position $i$ attends (full cache: $0 \dots i$) | `visible`; its size `n_visible` |
# | $a_{i,n}$ | attention of query $i$ on token $n$ (a KV head's: mean over its $G$ query heads) | `attn` |
# | $w$ | the observers: the last $w$ queries | `w`, `history_window` |
# | $r$ | the most recent tokens, never dropped | `n_recent` |
# | $m$ | tokens dropped at once | `drop` |
# | $\mathrm{low}_{i,n}$ | 1 if $a_{i,n}$ is below the uniform level $1/\lvert A_i \rvert$ | `low_flags` |
# | $I_n$ | the counter: token $n$'s low flags over the last $w$ queries | `counts`, `unimportance` |
#
# A token that query $i$ does not attend is never low. Over its budget $B$, a layer drops the tokens with the most
# low flags, never one of the $r$ most recent (§4, Algorithm 2); of equal counts, which the paper leaves open, ours
# drops the one the last query attends least. After step $t$, with $m = 1$, Scissorhands keeps:
#
# $$\mathrm{low}_{i,n} = \big[\, n \in A_i \text{ and } a_{i,n} < \tfrac{1}{|A_i|} \,\big], \qquad
#   I_n = \sum_{i = t - w + 1}^{t} \mathrm{low}_{i,n}, \qquad
#   \text{the last } r \text{ and the } B - r \text{ others with the smallest } I_n
#   \text{ (ties: the largest } a_{t,n} \text{)}$$
#
# The toy: $T = 6$ tokens, queries at positions 3, 4 and 5, $w = 3$, $B = 4$, $r = 1$, so two tokens go at once
# (as after a prompt, read whole and then cut to $B$; the counters do not change within a step).

# %%
import matplotlib.pyplot as plt
import torch

toy_attn = torch.tensor([[.50, .05, .40, .05, 0, 0],       # query at position 3 (sees tokens 0-3)
                         [.45, .05, .30, .10, .10, 0],     # position 4
                         [.40, .02, .08, .20, .10, .20]]).view(1, 1, 3, 6)   # position 5; (1, KV head, query, token)
q_pos = torch.tensor([3, 4, 5])
visible = (torch.arange(6) <= q_pos[:, None]).view(1, 1, 3, 6)   # what each query sees
fig, ax = plt.subplots(figsize=(6, 2.2))
im = ax.imshow(toy_attn[0, 0].masked_fill(~visible[0, 0], float("nan")), cmap="Blues", vmin=0, vmax=1)
for i, j in visible[0, 0].nonzero().tolist():             # each weight a query sees, written in its cell
    ax.text(j, i, f"{toy_attn[0, 0, i, j]:.2f}", ha="center", va="center", fontsize=9)
ax.set_yticks(range(3), [f"query at {p} (level 1/{p + 1})" for p in q_pos.tolist()])
ax.set(xlabel="token", title="The toy's attention: compare each row with its uniform level")
fig.colorbar(im, ax=ax, label="attention")
plt.show()

# %% [markdown]
# Each row is a query, blank where it cannot see the token. Token 1 is below its row's level in all three rows,
# tokens 3 and 4 in two, token 2 only in the last (`.08 < 1/6`).
#
# The library (`methods/scissorhands.py`) has `low_flags`, `push_history` (each token's last $w$ flags),
# `unimportance` ($I_n$) and `scissorhands_keep` (Algorithm 2, with $m$); `library_keep` chains them on one head:

# %%
from methods.scissorhands import low_flags, push_history, scissorhands_keep, unimportance


def library_keep(attn, budget, n_recent):
    """The library's decision on (1, 1, w, n) attention of the last w queries: flags, history, counters, keep."""
    w, n = attn.shape[-2:]
    q, p = torch.arange(n - w, n), torch.arange(n).view(1, 1, n)
    history = torch.zeros(1, 1, n, w, dtype=torch.bool)                # per token, its last w flags
    push_history(history, low_flags(attn, p.view(1, 1, 1, n) <= q.view(1, 1, w, 1)), q)
    keep = scissorhands_keep(unimportance(history), attn[:, :, -1], p, seen=n, budget=budget, n_recent=n_recent)
    return keep.flatten().tolist()

# %% [markdown]
# Your loops must choose as the library does: on the toy, on a head whose $r$ most recent tokens get little
# attention (they stay anyway), on a single query (many tied counts), and on 300 random heads:

# %%
def causal(scores):
    """(w, T) scores of the last w queries -> their attention, each query seeing the tokens up to its position."""
    w, T = scores.shape
    return scores.masked_fill(torch.arange(T) > torch.arange(T - w, T)[:, None], -1e9).softmax(-1)


g = torch.Generator().manual_seed(0)
cases = [(toy_attn[0, 0], 4, 1, "the toy"),                                  # (attn, B, r, what the case is)
         (causal(torch.randn(4, 12, generator=g) - 9 * (torch.arange(12) >= 9)), 6, 3,
          "the r most recent get little attention and stay"),
         (causal(torch.randn(1, 12, generator=g)), 5, 0, "one query: counts of 0 or 1, so many ties")]
for T in torch.randint(2, 17, (300,), generator=g).tolist():            # 300 random heads of 2-16 tokens
    w, r = int(torch.randint(1, T + 1, (1,), generator=g)), int(torch.randint(0, min(3, T), (1,), generator=g))
    cases.append((causal(torch.randn(w, T, generator=g) * 2), int(torch.randint(r + 1, T + 1, (1,), generator=g)), r,
                  "a random head; a flag: a_{i,n} < 1 / |A_i|, |A_i| the tokens query i sees"))

# %%
def keep_by_hand(attn, budget, n_recent):
    """attn: (w, T) the last w queries over T tokens, query i seeing tokens 0 .. T - w + i.
    Returns the kept positions, ascending: the best B - r by (I, -last attention), then the r most recent."""
    # BEGIN SOLUTION [scissorhands:keep_score] flag a_{i,n} < 1 / |A_i|; keep the fewest flags, ties by last attention
    w, T = attn.shape
    counts = [0] * T                                      # I[n]: low flags among the last w queries
    for i in range(w):
        n_visible = T - w + i + 1                         # query i attends tokens 0 .. n_visible - 1: |A_i|
        for n in range(n_visible):
            counts[n] += int(attn[i, n] < 1 / n_visible)  # below the uniform level: a low flag
    older = range(T - n_recent)                           # the r most recent are never dropped
    best = sorted(older, key=lambda n: (counts[n], -float(attn[-1, n])))   # fewest flags, then most attention
    return sorted(best[:budget - n_recent]) + list(range(T - n_recent, T))
    # END SOLUTION


for attn, budget, r, what in cases:
    mine, theirs = [int(n) for n in keep_by_hand(attn, budget, r)], library_keep(attn[None, None], budget, r)
    case = f"{what} (T = {attn.shape[1]}, w = {attn.shape[0]}, B = {budget}, r = {r}): kept {mine}, library {theirs}"
    assert mine == sorted(set(mine)), f"{case}: return distinct positions, ascending"
    assert len(mine) == budget and mine[budget - r:] == theirs[budget - r:], f"{case}: keep B, the r most recent too"
    assert mine == theirs, f"{case}: of the others, the fewest low flags stay, a tie to the larger last attention"
print("toy: kept by hand", keep_by_hand(toy_attn[0, 0], 4, 1), "| by the library", library_keep(toy_attn, 4, 1))
print(f"by hand == the library in all {len(cases)} cases")

# %% [markdown]
# Token 1 was low three times and goes. Tokens 3 and 4 tie at two low flags; the last query gives token 4 less
# (`.10` vs `.20`), so it goes. Token 2 stays although the last query gave it only `.08`: it was low once.

# %% [markdown]
# ## 2. What Scissorhands keeps of a needle
#
# Do the counters keep what is needed later? On the bundled model: a needle (a key and a value of a few digits)
# hidden in noise, then a question about it, `LENGTH` tokens in all, with the cache cut to a quarter
# ($B$ = `BUDGET`) by Scissorhands (defaults $w = 400$, $r = 10$, $m = 1$) and by H2O. `make_policy` builds a
# policy from a method's name.

# %% tags=["needs:low_flags", "needs:keep_score", "needs:n_dropped"]
from methods import make_policy
from experiments.evaluation.viz import needle_spans, plot_kept
from nanollm import KVCache, load, prefill
from nanollm.data.tasks import make_sample

model, tok, _ = load("retrieval-llama")   # the bundled model: 0.87M parameters, 4 layers, 4 query heads, 2 KV heads
LENGTH = 256 if TINY else 512                                     # tokens per sample, prompt and answer
sample = make_sample("niah_single_noise", tok, LENGTH, seed=0)
ids, N = torch.tensor([sample.prompt_ids]), len(sample.prompt_ids)   # (1, N): the prompt
spans = needle_spans(sample, tok)                                 # per needle: (start, value start, end)
start, v, end = spans[0]
print(f"the needle: {tok.decode(sample.prompt_ids[start:end])!r}, its value at positions {v}-{end - 1} of {N}")
BUDGET = LENGTH // 4
caches = {spec: KVCache(model.config, make_policy(spec, budget=BUDGET)) for spec in ["scissorhands", "h2o"]}
fig, axes = plt.subplots(2, 1, figsize=(11, 4.6), sharex=True, layout="constrained")
for ax, (spec, cache) in zip(axes, caches.items()):
    prefill(model, ids, cache)
    plot_kept(ax, cache, N, spans, title=spec)
    fig.colorbar(ax.images[0], ax=ax, ticks=[0, 1], pad=0.01).ax.set_yticklabels(["evicted", "kept"], fontsize=9)
plt.show()

# %% [markdown]
# Rows are layers and KV heads (`L0 KV1`: layer 0, KV head 1), columns prompt positions, dark where the cache
# holds them; orange marks the needle's key, red its value. Scissorhands keeps mostly recent tokens and only a
# few of the value's digits; H2O keeps the whole value in two rows.
#
# Two things work against the needle. Age: a token at position $n$ was seen by only $T - n$ queries, so it has at
# most $T - n$ low flags, while an older one had $w$ chances to be low. Strength: the value is heavy for the few
# queries that look it up and below average for all others; a count ignores how strong those few were, a sum
# (H2O) does not. Exercise 2 removes the age. (Whether the model still answers: the lab; the library's choices
# where the paper is silent: `methods/README.md`.)

# %% [markdown]
# ## 3. On the real model: SmolLM2-135M
#
# The paper (§5) reports, on OPT models in language modelling, "up to 5X" less KV cache memory "without
# compromising model quality". Here, on SmolLM2-135M (fetched by `python -m nanollm.cli.fetch smollm2-135m`),
# `language_modelling.run` starts each method from the first $B$ tokens of a text ($B$ = the keep ratio times half
# its `LM_LENGTH` tokens), decodes the second half evicting as it goes, and scores each method against the full
# cache's next-token distributions ([metrics glossary](README.md#metrics)); `cache at end` counts the entries per
# layer and KV head at the last token.

# %% tags=["needs:low_flags", "needs:keep_score", "needs:n_dropped"]
from experiments.evaluation import language_modelling

real_model, real_tok, _ = load("smollm2-135m")
LM_LENGTH, LM_KEEP = (64, 0.5) if TINY else (512, 0.2)           # tokens of text; keep 0.2 = 5x compression
lm_records = language_modelling.run(real_model, real_tok, ["full", "scissorhands", "h2o", "streaming_llm"],
                                    [LM_KEEP], LM_LENGTH, progress=False)
print(language_modelling.format_table(lm_records))
print(f"{LM_LENGTH - 1 - LM_LENGTH // 2} predictions scored per method, positions {LM_LENGTH // 2 + 1}-{LM_LENGTH - 1}")

# %% [markdown]
# At keep 0.2 the cache holds 51 entries while the scored positions have seen 257-511 tokens: 5x to 10x
# compression. Scissorhands does best (perplexity x1.161, KL 0.234, top-1 agreement 0.761; H2O x1.225,
# StreamingLLM x1.226), yet 1.161 times the full cache's perplexity is not "without compromising model quality"
# (in a harsh setting: a fixed budget, one text). It leads here though it lost the needle, plausibly because
# running text needs mostly recent tokens and a few old ones that many queries attend, which stay above average.

# %% [markdown]
# ## Exercises
#
# Each exercise has a cell to fill (replace the `None`), a check cell, and a collapsed reference answer.
#
# ### Exercise 1: dropping m at a time
#
# With $m = 3$ (`drop=3`) a cache over its budget drops three tokens at once, falling below $B$, so it takes the
# next steps without compressing. The rule: cut $m$ to $B - r$, then drop $m$ tokens as many times as it takes to
# be within $B$ ($\lceil (T - B) / m \rceil \cdot m$ in all): the most low flags first, of equal counts the least
# last attention, never the $r$ most recent. Write `my_keep(counts, last, B, m, r)`: from the counters $I_n$
# (`counts`, a list by position) and the last query's attention (`last`, a list), return the kept positions,
# ascending, without the library's `scissorhands_keep`, `keep_score`, `n_dropped`, `evict_one` or its policy. The
# next cell computes the toy's `counts` and `last`; with $B = 4$, $m = 3$ and $r = 1$, which tokens stay?

# %% tags=["needs:low_flags", "needs:keep_score", "needs:n_dropped"]
history = torch.zeros(1, 1, 6, 3, dtype=torch.bool)      # the toy's last w = 3 flags per token
push_history(history, low_flags(toy_attn, visible), q_pos)
counts, last = unimportance(history).flatten().tolist(), toy_attn[0, 0, -1].tolist()
import math                                               # math.ceil, if you need it


# %%
my_keep = None                   # replace None: a function (counts, last, B, m, r) -> kept positions (def my_keep)

# %% tags=["needs:low_flags", "needs:keep_score", "needs:n_dropped"]
from exercises import calls, exercise, lesson_function, on_copies


@exercise("Exercise 1")
def check_keep(keep_rule):
    library = calls(keep_rule, "scissorhands_keep", "keep_score", "n_dropped", "evict_one", "ScissorhandsPolicy")
    assert not library, f"from the counters and the attention alone: your function calls {', '.join(library)} " \
        "(yours by that name too: rename it)"
    g = torch.Generator().manual_seed(1)
    cases = [(counts, last, 4, 3, 1)] + [(torch.randint(0, 4, (T,), generator=g).tolist(),
                                          torch.rand(T, generator=g).tolist(), B, m, r)
                                         for T, B, m, r in ((8, 5, 2, 1), (10, 6, 4, 2), (7, 3, 1, 0), (9, 4, 3, 2),
                                                             (8, 5, 4, 2), (5, 5, 2, 1), (3, 5, 2, 1))]
    for c, a, B, m, r in cases:
        T = len(c)
        truth = scissorhands_keep(torch.tensor(c).view(1, 1, T), torch.tensor(a).view(1, 1, T),
                                  torch.arange(T).view(1, 1, T), seen=T, budget=B, drop=m, n_recent=r)
        library, keep = truth.flatten().tolist(), [int(n) for n in on_copies(keep_rule, c, a, B, m, r)]
        where = f"{T} tokens, B = {B}, m = {m}, r = {r}"
        assert len(keep) == len(library), f"{where}: you kept {len(keep)}; m tokens go at a time, as many times " \
                                          "as it takes to get within B (m cut to B - r; none when T <= B); the r " \
                                          "recent count in B"
        assert keep == sorted(keep), f"{where}: list the kept positions in ascending order"
        assert set(range(T - r, T)) <= set(keep), f"{where}: the r most recent tokens always stay"
        assert keep == library, f"{where}: of the tokens before the r recent, the fewest low flags stay, and a tie " \
                                "goes to the one the last query attends more"


check_keep(my_keep)

# %%
# BEGIN SOLUTION [scissorhands] m at a time: ceil((T - B) / m) * m tokens go; keep the r recent and the best of the rest
def reference_keep(counts, last, B, m, r):
    T = len(counts)
    m = min(m, B - r)                                      # m leaves room for the r recent
    n_keep = T - math.ceil((T - B) / m) * m if T > B else T
    best = sorted(range(T - r), key=lambda n: (counts[n], -last[n]))     # fewest low flags, then most attention
    return sorted(best[:n_keep - r]) + list(range(T - r, T))
# END SOLUTION


check_keep(reference_keep)
print("the toy with m = 3 keeps", reference_keep(counts, last, 4, 3, 1))

# %% [markdown]
# ### Exercise 2: a short history window
#
# With $w = 8$ every token older than the last 8 queries has been observed exactly 8 times: age no longer counts.
# Build a cache with `make_policy("scissorhands", budget=BUDGET, history_window=8)`, prefill it with `ids`, and
# store `recent_share(cache)` (defined in the next cell) in `my_recent_share`. Then count, over every layer and
# KV head, the needle's value entries (kept positions in `[v, end)`) that survive now; the reference counts them.

# %% tags=["needs:low_flags", "needs:keep_score", "needs:n_dropped"]
@lesson_function                 # the check below computes with it
def recent_share(cache):
    """The share of a cache's kept entries, over its layers and KV heads, in the last BUDGET prompt positions."""
    if cache.layers[0].pos is None:
        raise ValueError("this cache holds nothing yet: prefill it with ids first")
    return sum(float((layer.pos >= N - BUDGET).float().mean()) for layer in cache.layers) / len(cache.layers)


print(f"w = 400: a share of {recent_share(caches['scissorhands']):.2f} in the last {BUDGET} positions")


# %%
my_recent_share = None                  # replace None: recent_share of the cache built with history_window=8


# %% tags=["needs:low_flags", "needs:keep_score", "needs:n_dropped"]
@exercise("Exercise 2")
def check_recent_share(share):
    assert isinstance(share, float), f"store the number recent_share returns, not a {type(share).__name__}"
    assert 0 <= share <= 1, "a share lies between 0 and 1"
    short = KVCache(model.config, make_policy("scissorhands", budget=BUDGET, history_window=8))
    prefill(model, ids, short)
    right = abs(share - recent_share(short)) <= 1e-4
    assert right or abs(share - recent_share(caches["scissorhands"])) > 1e-4, \
        "that is the default window's share (w = 400): build the cache with history_window=8"
    assert right, "build the cache with make_policy(\"scissorhands\", " \
        "budget=BUDGET, history_window=8), prefill it with ids, and store recent_share's value unrounded"


check_recent_share(my_recent_share)

# %% tags=["needs:low_flags", "needs:keep_score", "needs:n_dropped"]
# BEGIN SOLUTION [scissorhands] a KVCache with make_policy("scissorhands", budget=BUDGET, history_window=8), prefilled
short_window = KVCache(model.config, make_policy("scissorhands", budget=BUDGET, history_window=8))
prefill(model, ids, short_window)
reference_recent_share = recent_share(short_window)
# END SOLUTION
check_recent_share(reference_recent_share)
print(f"w = 8: a share of {reference_recent_share:.2f} in the last {BUDGET} positions (w = 400: "
      f"{recent_share(caches['scissorhands']):.2f})")
kept = {name: [int(((layer.pos >= v) & (layer.pos < end)).sum()) for layer in cache.layers]
        for name, cache in [("w = 400", caches["scissorhands"]), ("w = 8", short_window)]}
print(f"the needle's value, entries kept per layer (of {end - v} tokens x {model.config.n_kv_head} KV heads): {kept}")
print(f"A short window spreads the kept entries over the prompt and keeps {sum(kept['w = 8'])} of the value's "
      f"{len(short_window.layers) * model.config.n_kv_head * (end - v)} entries (w = 400: {sum(kept['w = 400'])}): "
      "more digits survive, but most of the value is still dropped, and lab 02 (section 1.1) finds the answers no "
      "better at w = 8: what fails is the count, which weighs the few queries that retrieve the needle like any other.")

# %% [markdown]
# **Go further**: [labs/02_scissorhands_claims.ipynb](labs/02_scissorhands_claims.ipynb): accuracy and KL
# against StreamingLLM and H2O, the history window and drop count, Theorem 4.1, the paper's Figure 10, and
# whether importance persists.
