# %% [markdown]
# # 05 ChunkKV: keep whole chunks, not scattered tokens
#
# Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference",
# NeurIPS 2025, [arXiv 2502.00299](https://arxiv.org/abs/2502.00299).
#
# Token-level selection ranks every token on its own. A fact in the context ("the special magic number
# for calm-otter is: `4821733`") is several tokens, and the paper argues that such a ranking keeps some of
# them and drops others. ChunkKV ranks **chunks** of consecutive tokens by the sum of their votes and keeps
# whole chunks (Algorithm 1). Its second idea, reusing one layer's kept indices in the next (Algorithm 2),
# appears here only as a setting.
#
# **You will learn**
#
# 1. Algorithm 1, built in a dozen lines, checked against the library and drawn on a toy;
# 2. how often SnapKV, ChunkKV and H2O keep a needle's value whole on the bundled model.
#
# The method's code is `methods/chunkkv.py`. **Before this lesson**: lesson 01 (SnapKV's observation window
# and its votes, H2O) and lesson 02 (eviction to a budget $B$); the symbols are the book's
# ([notebooks/README.md](README.md)).

# %% tags=["setup"]
from preamble import TINY                          # True in the quick mode; the committed outputs are a full run

from nanollm import load

model, tok, card = load("retrieval-llama")         # the bundled 0.87M-parameter model, 4 layers, 2 KV heads

# %% [markdown]
# ## 1. Algorithm 1: whole chunks, ranked by their summed votes
#
# ChunkKV scores tokens as SnapKV does (lesson 01): the queries of the observation window vote for the
# earlier tokens by the attention they give them. It cuts the positions into a fixed grid of chunks, scores
# each chunk by its summed votes, and keeps whole chunks, best first, while they fit in the room the budget
# leaves beside the window (the paper's §3, Algorithm 1). The symbols:
#
# | symbol | meaning | in the code |
# |---|---|---|
# | $T$ | tokens of the prompt | `T` |
# | $n$ | a token's position, $0 \le n < T$ | the index into `votes` |
# | $t$ | a voting query's position, one of the last $w$ | - |
# | $H_{kv}$, $j$ | a layer's KV heads, and one of them | in the library's scorer |
# | $\mathcal{H}_j$, $h$ | the $G = H / H_{kv}$ query heads that read KV head $j$, and one | in the library's scorer |
# | $a^{h}_{t,n}$ | attention weight of query $t$ on token $n$ in query head $h$ | in the library's scorer |
# | $w$ | the observation window: the last $w$ prompt tokens, whose queries vote; always kept | `window` |
# | $s_n$ | the vote of token $n$ (one per layer: summed over its KV heads) | `votes` |
# | $c$ | tokens per chunk | `c` (the library's `chunk_size`) |
# | $i$, $\mathcal{C}_i$ | a chunk's index, and its positions $ic, \dots, ic + c - 1$ | `i`, `chunks[i]` |
# | $\sigma_i$ | the score of chunk $i$ | `chunk_score[i]` |
# | $B$, $B - w$ | tokens kept per layer and KV head (window included); the room for chunks | `budget`, `room` |
#
# $$s_n \;=\; \sum_{j=1}^{H_{kv}} \frac{1}{G} \sum_{h \in \mathcal{H}_j} \; \sum_{t=T-w}^{T-1} a^{h}_{t,n}, \qquad
#   \sigma_i \;=\; \sum_{n \in \mathcal{C}_i} s_n, \qquad
#   \text{keep chunks in decreasing order of } \sigma_i \text{ while }
#   \sum_{\text{kept } i} |\mathcal{C}_i| \;\le\; B - w .$$
#
# The sum over $j$ gives one ranking per layer: all KV heads of a layer keep the same chunks. The cell below
# writes the choice for one head's tokens outside the window and checks it on a 12-token toy against the
# library's `chunk_keep_mask`.

# %%
import torch

from methods.chunkkv import chunk_keep_mask


def choose_chunks(votes, c, room):
    """The kept positions (sorted) of one head: whole chunks of c tokens, best summed vote first, while they fit."""
    # BEGIN SOLUTION [chunkkv:chunk_ranking] Algorithm 1, one head: sigma_i = chunk i's summed votes; whole chunks first
    T = len(votes)                                                     # votes: (T,) one vote per free token
    chunks = [list(range(start, min(start + c, T))) for start in range(0, T, c)]   # chunk i: [i c, i c + c)
    chunk_score = [float(votes[chunk].sum()) for chunk in chunks]     # sigma_i: the chunk's summed vote
    kept = []
    for i in sorted(range(len(chunks)), key=lambda i: -chunk_score[i]):   # best first (ties: the earlier chunk)
        if len(kept) + len(chunks[i]) > room:
            break                                                      # the first chunk that does not fit ends it
        kept += chunks[i]
    return sorted(kept)
    # END SOLUTION


def library_keeps(votes, c, room):                 # the library's choice for one head: every slot competes
    # free: no slot is protected (no window here); n_free: the room; remainder "none": whole chunks only, as
    # Algorithm 1's loop takes them (the library's default, used in section 2, fills what is left with tokens)
    T = len(votes)
    keep = chunk_keep_mask(votes.view(1, 1, T), pos=torch.arange(T).view(1, 1, T),
                           free=torch.ones(1, 1, T, dtype=torch.bool), n_free=torch.tensor([[room]]),
                           chunk_size=c, shared=True, remainder="none")                 # (1, 1, T) bool
    return keep[0, 0].nonzero().flatten().tolist()


toy = torch.tensor([.1, .1, .1, .1, .5, 0, 0, 0, .2, .2, .2, .1])   # 12 votes: 3 chunks of 4
assert choose_chunks(toy, 4, 9) == library_keeps(toy, 4, 9), f"built {choose_chunks(toy, 4, 9)}"
print(f"chunks of 4, room for 9 tokens: the toy keeps {choose_chunks(toy, 4, 9)} (chunk 2, then chunk 1)")

# %% tags=["needs:chunk_ranking"]
gen = torch.Generator().manual_seed(0)                                # the same check on 200 random heads
for _ in range(200):                                                  # random votes, chunk size and room
    T, c = int(torch.randint(1, 40, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
    votes, room = torch.rand(T, generator=gen), int(torch.randint(0, T + 1, (1,), generator=gen))
    assert choose_chunks(votes, c, room) == library_keeps(votes, c, room), \
        f"c = {c}, room {room}: built {choose_chunks(votes, c, room)}, library {library_keeps(votes, c, room)}"
print("the built choice equals the library's on 200 random heads")

# %% [markdown]
# ### 1.1 The choice, drawn
#
# A toy needle: 24 mostly small votes, a key (positions 8-10) the window attends to, two of its tokens strongly,
# its four-digit
# value (11-14) attended weakly, and a few loud tokens elsewhere. Room for 8 tokens, chosen one token at a time
# (`c = 1`) and in chunks of 4.

# %% tags=["needs:chunk_ranking"]
import matplotlib.pyplot as plt

needle = torch.tensor([.01, .10, .02, .01, .02, .09, .01, .02, .05, .30, .25, .07,    # 24 votes: the key at 8-10,
                       .06, .05, .04, .02, .01, .02, .11, .01, .01, .04, .01, .09])   # its value's digits at 11-14
T, ROOM, KEY, VALUE = len(needle), 8, (8, 11), (11, 15)
fig, axes = plt.subplots(2, 1, figsize=(10, 4.6), sharex=True, sharey=True, layout="constrained")
for ax, c in zip(axes, [1, 4]):
    keep = torch.tensor(library_keeps(needle, c, ROOM))                # the kept positions
    ax.axvspan(KEY[0] - 0.5, KEY[1] - 0.5, color="orange", alpha=0.25, lw=0)
    ax.axvspan(VALUE[0] - 0.5, VALUE[1] - 0.5, color="red", alpha=0.25, lw=0)
    ax.bar(range(T), needle, color=["black" if n in keep else "lightgray" for n in range(T)], edgecolor="gray")
    for start in range(0, T, c) if c > 1 else []:                     # the chunk grid and each chunk's sigma_i
        ax.axvline(start - 0.5, color="tab:blue", ls=":", lw=1)
        ax.text(start + c / 2 - 0.5, 0.33, rf"$\sigma$ = {needle[start:start + c].sum():.2f}", ha="center", fontsize=9)
    digits = sum(int(n in keep) for n in range(*VALUE))
    ax.set(title=f"chunks of {c}: {digits} of the value's 4 digits kept", ylabel="window vote", ylim=(0, 0.38))
axes[1].set(xlabel="token position", xticks=range(0, T, 2))
plt.show()

# %% [markdown]
# The figure shows the same 24 votes under each rule: black bars kept, grey evicted, the key orange, its value
# red, each chunk labelled with its score $\sigma_i$. One token at a time (top), the room goes to loud tokens
# and the value keeps only two digits. In chunks of 4 (bottom) the key's chunk (8-11) and the next (12-15)
# score best and together hold the key and the whole value, though the value straddles the grid.
#
# ## 2. Does a needle's value survive whole?
#
# A single-needle sample of the bundled model's suite, compressed to `BUDGET = LENGTH // 2` entries per layer
# and KV head by SnapKV (window 32, max pooling over 7); by ChunkKV with the library's defaults (the same
# window's raw attention as votes, chunks of 10, the room left after the last whole chunk filled with the best
# single tokens of other chunks, our addition to the paper's whole chunks, and reuse depth 2: layers 1 and 3
# reuse the choice of layers 0 and 2, Algorithm 2); and by H2O (attention summed over the whole prompt, plus
# the most recent `budget // 2` tokens).

# %% tags=["needs:chunk_ranking", "needs:holds_position"]
from methods import make_policy
from nanollm import KVCache, generate, prefill
from nanollm.data.tasks import make_sample

LENGTH = 256 if TINY else 512                      # tokens per sample (asked for)
sample = make_sample("niah_single_noise", tok, LENGTH, seed=1)
ids = torch.tensor([sample.prompt_ids])            # (1, T) the prompt, question included
BUDGET = LENGTH // 2
specs = ["snapkv", "chunkkv", "h2o"]
for spec in specs:                                 # each keeps BUDGET entries per layer and KV head
    out = generate(model, ids, max_new_tokens=len(sample.target_ids), policy=make_policy(spec, budget=BUDGET))
    print(f"{spec:8} answers {tok.decode(out[0].tolist())!r:28} expected {sample.answers}")

# %% [markdown]
# SnapKV answers 9999999; ChunkKV and H2O answer 196238. The next cell counts, over the suite's single-needle
# samples, how often each (layer, KV head) pair keeps the needle's whole value.

# %% tags=["needs:chunk_ranking", "needs:holds_position"]
from experiments.evaluation.viz import kept_mask, needle_spans

SAMPLES = 1 if TINY else 10                        # samples per single-needle task
TASKS = card["default_suite"][:1] if TINY else card["default_suite"]
needles = [make_sample(t, tok, LENGTH, seed=i) for t in TASKS if t in ("niah_single_noise", "niah_single_prose")
           for i in range(SAMPLES)]
values = [needle_spans(s, tok)[0][1:] for s in needles]          # each value's prompt positions [v, end)


def kept_whole(spec, budget, s, v, end):           # (n_layer, H_kv) bool: sample s's value [v, end) kept whole
    cache = KVCache(model.config, make_policy(spec, budget=budget))
    prefill(model, torch.tensor([s.prompt_ids]), cache)
    return kept_mask(cache, end)[:, :, v:end].all(-1)


lengths = [end - v for v, end in values]
share = {spec: torch.stack([kept_whole(spec, BUDGET, s, *ve) for s, ve in zip(needles, values)]).float().mean()
         for spec in specs}                                       # over samples, layers and KV heads
print(f"{len(needles)} single-needle samples, values of {min(lengths)} to {max(lengths)} digits (one token each); "
      "the value kept whole, share of (layer, KV head) pairs: " + ", ".join(f"{k} {x:.0%}" for k, x in share.items()))

# %% [markdown]
# **Chunks keep a fact whole far more often than single tokens.** ChunkKV keeps the value whole in 98% of the
# (layer, KV head) pairs (with reuse, every second layer repeats the choice of the one before it), SnapKV, which votes
# with the same window but keeps tokens one by one after pooling, in 43%, and H2O in 39%. Keeping the value
# whole is not answering: H2O keeps it whole less often than SnapKV, yet answered the sample above, which
# SnapKV did not; Exercise 2 asks what budget each method needs to answer. The
# [lab](labs/05_chunkkv_claims.ipynb) tests whether this makes a model answer more, on SmolLM2-135M, a small
# model trained on text: with the same votes, chunks of 10 answer more than single tokens, beyond noise, when
# the question is in the prompt and the cache keeps a quarter or half of it.
#
# ## Exercises
#
# Each exercise: a cell where you replace the `None`, a check that gives a hint when the answer is wrong, and
# the reference answer, collapsed.
#
# ### Exercise 1: when does one chunk hold the whole value?
#
# Write `my_in_one_chunk(v, end, c)`: whether one chunk of `c` positions (the grid of section 1: chunk $i$ is
# positions $ic, \dots, ic + c - 1$) holds the whole value at prompt positions `[v, end)`. Section 2's 20
# single-needle values are 4 to 7 digits, one token per digit. Guess first what share of them one chunk of 1,
# 5, 10 or 20 tokens holds; once your function is right, the check prints the shares.
# Then, in a sentence: why is the share below 1 even for chunks longer than every value, and how can ChunkKV
# still keep a value whole that straddles two chunks?

# %%
my_in_one_chunk = None          # replace None: a function (v, end, c) -> bool (write def my_in_one_chunk(...))

# %% tags=["needs:chunk_ranking"]
from exercises import exercise, lesson_function


@exercise("Exercise 1")
def check_in_one_chunk(in_one_chunk):
    for v in range(24):
        for end in range(v + 1, v + 8):
            for c in (1, 2, 3, 4, 5, 10, 20):                              # 20: the longest the shares use
                votes = torch.zeros(end + c)
                votes[v:end] = 1.0                                       # every vote on the value
                kept = library_keeps(votes, c, c)                        # room for one chunk: the best one
                said = bool(in_one_chunk(v, end, c))
                assert said == all(n in kept for n in range(v, end)), \
                    f"chunks of {c}, a value at positions {v} to {end - 1}: you said {said}; chunk i holds positions " \
                    "i c to i c + c - 1, and end is one past the value's last position"
    return "share of section 2's needle values inside one chunk: " + ", ".join(
        f"c={c}: {sum(bool(in_one_chunk(v, end, c)) for v, end in values) / len(values):.2f}" for c in (1, 5, 10, 20))


check_in_one_chunk(my_in_one_chunk)

# %% tags=["needs:chunk_ranking"]
# BEGIN SOLUTION [chunkkv] the value lies in one chunk when its first and its last position have the same chunk index
def reference_in_one_chunk(v, end, c):
    return v // c == (end - 1) // c
# END SOLUTION


check_in_one_chunk(reference_in_one_chunk)
print("The grid is fixed and the needle falls anywhere: a value of L tokens lies in one chunk of c >= L only if it "
      "starts in the first c - L + 1 positions of a chunk. A value that straddles a boundary is kept whole when "
      "both its chunks are chosen, as in section 1.1's toy, where the key's chunk and the next held the value.")

# %% [markdown]
# ### Exercise 2: the smallest budget
#
# On the grid 8, 16, ..., `BUDGET`, find the smallest budget at which ChunkKV answers section 2's sample (scan
# upward from 8), and the same for H2O; `answers` below says whether a method answers at a budget. Then, in a
# sentence: does this sample show ChunkKV needing less cache than H2O?

# %%
@lesson_function
def answers(spec, budget):                         # does spec, keeping budget entries, answer section 2's sample?
    out = generate(model, ids, max_new_tokens=len(sample.target_ids), policy=make_policy(spec, budget=budget))
    return all(a in tok.decode(out[0].tolist()) for a in sample.answers)


# %%
my_smallest_budget = {"chunkkv": None, "h2o": None}     # replace each None: the smallest budget on the grid


# %% tags=["needs:chunk_ranking", "needs:holds_position"]
@exercise("Exercise 2")
def check_smallest_budget(smallest):
    assert sorted(smallest) == ["chunkkv", "h2o"], "one budget for 'chunkkv' and one for 'h2o'"
    for spec, b in smallest.items():
        assert b in range(8, BUDGET + 1, 8), f"{spec}: a budget on the grid 8, 16, ..., BUDGET"
        b = int(b)                                                       # 88.0 is 88
        right = [answers(spec, x) for x in range(8, b + 1, 8)]
        assert right[-1], f"{spec}: at budget {b} it does not answer yet; scan upward from 8 until it does"
        assert not any(right[:-1]), f"{spec}: not the smallest budget of the grid at which it answers; run the " \
            "scan itself rather than trying budgets"


check_smallest_budget(my_smallest_budget)

# %% tags=["needs:chunk_ranking", "needs:holds_position"]
# BEGIN SOLUTION [chunkkv] scan range(8, BUDGET + 1, 8) and keep the first budget at which answers(spec, budget)
reference_smallest_budget = {spec: next(b for b in range(8, BUDGET + 1, 8) if answers(spec, b))
                             for spec in ("chunkkv", "h2o")}
# END SOLUTION
check_smallest_budget(reference_smallest_budget)
ours, theirs = reference_smallest_budget["chunkkv"], reference_smallest_budget["h2o"]
print(f"{reference_smallest_budget}. {'No' if ours > theirs else 'Yes'}: ChunkKV first answers at {ours} entries, "
      f"H2O at {theirs}. A chosen chunk keeps a fact whole, but choosing it still rests on the votes, and a chunk "
      "spends ten entries where H2O spends one. One sample on a tiny model: the lab compares the two over the suite.")

# %% [markdown]
# **Go further**: [labs/05_chunkkv_claims.ipynb](labs/05_chunkkv_claims.ipynb) measures index reuse
# (Algorithm 2), the chunk-size and reuse-depth ablations, and ChunkKV against SnapKV and H2O, on the bundled
# model and on SmolLM2.
