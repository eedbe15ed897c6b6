"""Hidden tests of the ``baselines`` assignment (the grader's; not in a student copy).

Each task is graded alone: its tests build what it reads themselves (hand-made attention, a storage, a tiny
model) and compare with an oracle written here, by loops, never with another task's code. Inputs are
chosen where mistakes show: query heads that differ within and across GQA groups, group sizes 1 to 3, several
decode and extend steps with evictions, budgets below the window and the sinks, several cases, all drawn from
the run's seed (``oracle.generator``). For each task one test sweeps every regime and is worth half of the
task's points (AdaKV's allocation and its ties test 2 points each, so that a ranking that breaks ties another
way loses half the task).
"""

import adapters as A
import torch
from oracle import assert_close, check_tensor, generator, patched, points, reference
from test_public import check_close

# -- StreamingLLM ---------------------------------------------------------------------------------------

def streaming_oracle(budget: int, n_sink: int, seen: int) -> list[int]:
    """§3.2 by enumeration: position p < seen is kept iff it is one of the S first or the R last."""
    S = min(n_sink, budget - 1)                  # the newest token always fits
    R = budget - S
    return [p for p in range(seen) if p < S or p >= seen - R]


def short(positions: list[int], n: int = 12) -> str:
    """A list of positions, its first ``n`` and the count of the rest."""
    return str(positions) if len(positions) <= n else f"{str(positions[:n])[:-1]}, ... ({len(positions) - n} more)]"


@points(3, task="sinks_and_recent")
def test_streaming_llm_ranges_in_every_regime():
    """Fewer tokens than the budget, exactly the budget, more; budgets below the sinks (the sinks shrink so
    the newest token fits), no sinks, a budget of 1; budgets, sinks and lengths drawn from the run's seed; and
    the keep mask over heads holding different positions in any slot order, with empty slots."""
    g = generator("streaming regimes")

    def draw(low, high):
        return int(torch.randint(low, high, (1,), generator=g))
    cases = [(budget, n_sink, seen) for budget in (1, 2, 3, 4, 5, 8) for n_sink in (0, 1, 2, 4, 6)
             for seen in (1, 2, 3, 5, 8, 9, 13, 30)]
    cases += [(draw(1, 65), draw(0, 10), draw(1, 2000)) for _ in range(40)]
    for budget, n_sink, seen in cases:
        got = sorted({p for r in A.streaming_ranges(budget, n_sink, seen) for p in r})
        want = streaming_oracle(budget, n_sink, seen)
        S = min(n_sink, budget - 1)
        assert got == want, (f"budget {budget}, n_sink {n_sink}, seen {seen}: the ranges name {short(got)}, expected "
                             f"{short(want)} (S = {S} sinks from position 0, R = {budget - S} most recent, only "
                             "positions already seen)")
    held = [list(range(12)), [0, 1, 2, 5, 7, 8, 9, 10, 11, -1, -1, -1]]
    pos = torch.tensor([[h[i] for i in torch.randperm(12, generator=g).tolist()] for h in held])[None]   # (1, 2, 12)
    for budget, n_sink in [(5, 2), (3, 4), (4, 0)]:
        keep = A.streaming_mask(pos, seen=12, budget=budget, n_sink=n_sink)
        want = torch.tensor([[[int(p) in set(streaming_oracle(budget, n_sink, 12)) for p in h] for h in pos[0]]])
        assert_close(keep, want, what=f"budget {budget}, n_sink {n_sink}, after 12 tokens, KV heads holding the "
                     f"positions {pos[0].tolist()}: keep (B, H_kv, T) is True where a slot holds a sink or one of the "
                     "most recent positions, and never at an empty slot (-1)")


@points(1, task="sinks_and_recent")
def test_streaming_llm_decodes_with_sinks_and_window():
    """Prefill, decode steps and an extend chunk through a StreamingLLM cache on a GQA model: after every step
    each layer, row and KV head holds exactly the S sinks and the R most recent tokens: 3 sinks and 4 recent
    (budget 7), then 4 sinks asked for with a budget of 3 (cut to 2 so that the newest token fits, R = 1). The
    instructor's model, cache and policy run here, calling your ``sinks_and_recent``."""
    R = reference("course.baselines.adapters")                               # in this process, not yours
    calls = []

    def student_sinks_and_recent(*args):
        calls.append(1)
        return [range(r.start, r.stop) for r in A.streaming_ranges(*args)]
    model = R.tiny_model()
    ids = torch.randint(0, 512, (2, 21), generator=generator("streaming decode"))
    for budget, n_sink, prompt, chunks in [(7, 3, 12, (1, 1, 3, 1, 2, 1)), (3, 4, 6, (1, 2, 1))]:
        S = min(n_sink, budget - 1)
        with patched(R.method("streaming_llm"), sinks_and_recent=student_sinks_and_recent):
            cache = R.new_cache(model, R.streaming_policy(budget, n_sink))
            R.run_prefill(model, ids[:, :prompt], cache)
        seen = prompt
        for chunk in chunks:
            with patched(R.method("streaming_llm"), sinks_and_recent=student_sinks_and_recent):
                if chunk == 1:
                    R.run_decode(model, ids[:, seen], cache)
                else:
                    R.run_extend(model, ids[:, seen:seen + chunk], cache)
            seen += chunk
            want = list(range(S)) + list(range(seen - (budget - S), seen))
            assert calls, "StreamingLLM's policy never called your sinks_and_recent"
            for layer in range(2):
                pos = R.kept_positions(cache, layer)
                for b in range(2):
                    for h in range(pos.shape[1]):
                        got = sorted(p for p in pos[b, h].tolist() if p >= 0)      # any slot order; -1 = empty
                        assert got == want, (f"budget {budget}, n_sink {n_sink}: after {seen} tokens layer {layer} "
                                             f"row {b} KV head {h} holds {got}, expected the sinks {want[:S]} and "
                                             f"the {budget - S} most recent {want[S:]}")


# -- H2O ------------------------------------------------------------------------------------------------

def h2o_run(G: int, seed: int, budget: int, n_recent: int, chunks: list[int]) -> None:
    """Drive H2O over a prefill of chunks[0] tokens and a step per further chunk (1: decode, more: extend),
    with hand-made attention (every query head different), against a brute-force H2O: per (row, KV head) a
    dict position -> score; after each step the recent positions, then the best scores (ties: earlier). The
    storage may hold them in any slot order (a decode step refills the slot it emptied)."""
    g = generator("h2o run", seed)
    B, H_kv, d = 3, 2, 4                        # B != H_kv: a mix-up of the two shows
    H = G * H_kv
    policy = A.h2o_policy(budget, n_recent)
    store = A.new_storage(torch.randn(B, H_kv, chunks[0], d, generator=g),
                          torch.randn(B, H_kv, chunks[0], d, generator=g), torch.arange(chunks[0]))
    held = [[list(range(chunks[0])) for _ in range(H_kv)] for _ in range(B)]     # oracle: positions held
    score = [[{} for _ in range(H_kv)] for _ in range(B)]                         # oracle: position -> score
    seen = 0
    for step, chunk in enumerate(chunks):
        phase = "prefill" if step == 0 else "decode"
        if step > 0:
            new = torch.arange(seen, seen + chunk)
            A.storage_append(store, torch.randn(B, H_kv, chunk, d, generator=g),
                             torch.randn(B, H_kv, chunk, d, generator=g), new)
            for b in range(B):
                for j in range(H_kv):
                    held[b][j] += new.tolist()
        seen += chunk
        T = len(held[0][0])
        slots = A.storage_positions(store)                                      # (B, H_kv, slots), -1 = empty
        weight = torch.arange(1, H + 1, dtype=torch.float32).view(1, H, 1)         # heads differ in scale
        col_sums = torch.rand(B, H, slots.shape[-1], generator=g) * weight
        col_sums = col_sums.masked_fill(slots.repeat_interleave(G, dim=1) < 0, 0.0)   # an empty slot gets none
        for b in range(B):
            for j in range(H_kv):
                for slot, p in enumerate(slots[b, j].tolist()):
                    if p < 0:
                        continue
                    r = sum(float(col_sums[b, j * G + i, slot]) for i in range(G)) / G   # query heads jG..jG+G-1
                    score[b][j][p] = r if phase == "prefill" else score[b][j].get(p, 0.0) + r
        A.h2o_step(policy, store, col_sums, phase, seen, chunk)
        what = f"H2O with {G} query heads per KV head, seed {seed}, after {seen} tokens ({phase} of {chunk})"
        for b in range(B):
            for j in range(H_kv):
                if T > budget:
                    best = sorted(held[b][j], key=lambda p: (p < seen - n_recent, -score[b][j][p], p))
                    held[b][j] = sorted(best[:budget])
                got = sorted(p for p in A.storage_positions(store)[b, j].tolist() if p >= 0)
                assert got == held[b][j], (f"{what}: row {b} KV head {j} keeps positions {got}, expected "
                                           f"{held[b][j]} (the {n_recent} most recent, then the highest scores)")
        slots = A.storage_positions(store)
        want = torch.tensor([[[score[b][j].get(p, 0.0) for p in slots[b, j].tolist()] for j in range(H_kv)]
                             for b in range(B)])
        check_close(A.h2o_scores(store).masked_fill(slots < 0, 0.0), want, what, "a slot's score: the mean over its KV "
                    "head's query heads of the attention it received, summed over every step since it arrived",
                    axes=("row", "KV head", "slot"))
        for b in range(B):                                                     # the oracle's own keys
            for j in range(H_kv):
                score[b][j] = {p: score[b][j][p] for p in held[b][j]}


@points(4, task="h2o_observe")
def test_h2o_scores_over_steps_with_evictions():
    """Group sizes 1, 2, 3; a prompt over the budget and one under it; decode steps and extend chunks; heavy
    hitters only (no recent window) and with one."""
    h2o_run(G=2, seed=0, budget=6, n_recent=2, chunks=[9, 1, 3, 1, 2])
    h2o_run(G=3, seed=1, budget=5, n_recent=1, chunks=[7, 1, 1, 4, 1])
    h2o_run(G=1, seed=2, budget=4, n_recent=0, chunks=[3, 2, 1, 3])
    h2o_run(G=2, seed=3, budget=7, n_recent=3, chunks=[5, 1, 4, 1, 1])


@points(2, task="h2o_observe")
def test_h2o_scores_are_the_attention_received():
    """A GQA model with a budget covering the sequence (nothing evicted): after a prefill, decode steps and an
    extend chunk, every score is the mean over its KV head's query heads of the attention its slot received,
    summed over the steps, recorded here by the instructor's library (the same seeded model and prompt,
    a cache that keeps everything) rather than by your adapters."""
    model = A.tiny_model(seed=1)
    ids = torch.randint(0, 512, (2, 16), generator=generator("h2o received"))
    chunks = [10, 1, 3, 1, 1]
    R = reference("course.baselines.adapters")                               # in this process, not yours
    received = R.received_by_step(R.tiny_model(seed=1), ids, chunks)
    cache = A.new_cache(model, A.h2o_policy(64))
    A.run_prefill(model, ids[:, :10], cache)
    seen = 10
    for chunk in chunks[1:]:
        if chunk == 1:
            A.run_decode(model, ids[:, seen], cache)
        else:
            A.run_extend(model, ids[:, seen:seen + chunk], cache)
        seen += chunk
    for layer in range(2):
        want = torch.zeros(2, 2, seen, dtype=torch.float64)
        for sums in received[layer]:                                            # (B, H, T so far)
            B, H, T = sums.shape
            want[..., :T] += sums.double().view(B, 2, H // 2, T).mean(2)
        check_close(A.h2o_scores(cache.layers[layer]), want, f"H2O's scores in layer {layer} after {seen} tokens",
                    "per slot, the mean over its KV head's query heads of the attention it received, summed over "
                    "the steps", axes=("row", "KV head", "position"), tol=1e-4)


# -- SnapKV ---------------------------------------------------------------------------------------------

def pool_oracle(x: list[float], kernel: int, pooling: str) -> list[float]:
    """Stride-1 pooling of width ``kernel`` centred on each token; average pooling counts the zero padding."""
    half, n = kernel // 2, len(x)
    if pooling == "max":
        return [max(x[u] for u in range(max(0, t - half), min(n, t + half + 1))) for t in range(n)]
    return [sum(x[u] for u in range(max(0, t - half), min(n, t + half + 1))) / kernel for t in range(n)]


def snapkv_oracle(probs: torch.Tensor, n_kv_head: int, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """§4.1-4.2 by loops: each query head's votes are its last w rows summed; the prefix votes pooled, the
    window's own not; a KV head's score is the mean over its query heads. (B, H, R, T) -> (B, H_kv, T)."""
    B, H, R, T = probs.shape
    w, G = min(window, T), H // n_kv_head
    rows = probs.double().tolist()
    out = torch.zeros(B, n_kv_head, T, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            vote = [sum(rows[b][h][R - w + i][t] for i in range(w)) for t in range(T)]
            scored = pool_oracle(vote[:T - w], kernel, pooling) + vote[T - w:]
            out[b, h // G] += torch.tensor(scored, dtype=torch.float64) / G
    return out


def vote_oracle(probs_window: torch.Tensor, n_kv_head: int, kernel: int, pooling: str) -> torch.Tensor:
    """``window_vote`` by loops: each query head's window rows summed, pooled over all Tp tokens, then the mean
    over the KV head's query heads. (B, H, w, Tp) -> (B, H_kv, Tp)."""
    B, H, w, Tp = probs_window.shape
    G, rows = H // n_kv_head, probs_window.double().tolist()
    out = torch.zeros(B, n_kv_head, Tp, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            vote = [sum(rows[b][h][i][t] for i in range(w)) for t in range(Tp)]
            out[b, h // G] += torch.tensor(pool_oracle(vote, kernel, pooling), dtype=torch.float64) / G
    return out


def window_rows(g: torch.Generator, B: int, H: int, R: int, T: int) -> torch.Tensor:
    """The attention of the last R of T causal queries (B, H, R, T), peaked, every head different."""
    logits = torch.randn(B, H, R, T, generator=g) * 2.5
    future = torch.arange(T)[None, :] > torch.arange(T - R, T)[:, None]                # (R, T)
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


@points(5, task="window_vote")
def test_snapkv_scores_in_every_regime():
    """Group sizes 1 to 3, one and two KV heads, windows shorter than the prompt, equal to it and longer, more
    rows than the window, kernels 1, 3 and 5, max and average pooling, two seeds: the scores themselves, and
    ``window_vote``'s votes over the window's rows, against loops."""
    for seed in (0, 1):
        g = generator("snapkv regimes", seed)
        for H_kv, G in [(2, 1), (2, 2), (2, 3), (1, 3)]:
            for T, window in [(13, 4), (9, 9), (7, 10), (16, 3)]:
                R = min(T, window + 2)
                probs = window_rows(g, 3, H_kv * G, R, T)                       # 3 rows: B != H_kv
                for kernel in (1, 3, 5):
                    for pooling in ("max", "avg"):
                        got = A.snapkv_scores(probs, H_kv, window, kernel, pooling)
                        what = (f"SnapKV's scores, {H_kv} KV heads of {G} query heads, T = {T}, window {window}, "
                                f"{pooling} pooling of width {kernel}")
                        check_close(got, snapkv_oracle(probs, H_kv, window, kernel, pooling), what,
                                    "the last w rows summed per query head; the prefix's votes pooled, the "
                                    "window's own not; then the mean over the KV head's query heads",
                                    axes=("row", "KV head", "token"))
                        rows = probs[:, :, R - min(window, T):, :]              # (3, H, w, T): the window's rows
                        check_close(A.snapkv_vote(rows, H_kv, kernel, pooling),
                                    vote_oracle(rows, H_kv, kernel, pooling),
                                    f"window_vote, {H_kv} KV heads of {G} query heads, {rows.shape[2]} window rows "
                                    f"over {T} tokens, {pooling} pooling of width {kernel}",
                                    "each query head's window rows summed, pooled over every token; then the mean "
                                    "over the KV head's query heads", axes=("row", "KV head", "token"))


@points(1, task="window_vote")
def test_snapkv_pooling():
    """Widths 1 to 7 (also wider than the sequence), max and average (the zero padding counts), any leading
    shape."""
    g = generator("snapkv pooling")
    for shape in [(9,), (2, 3, 11), (1, 4)]:
        x = torch.rand(*shape, generator=g)
        for kernel in (1, 3, 5, 7):
            for pooling in ("max", "avg"):
                rows = x.reshape(-1, shape[-1]).double().tolist()
                want = torch.tensor([pool_oracle(r, kernel, pooling) for r in rows]).view(shape)
                check_close(A.snapkv_pool(x, kernel, pooling), want,
                            f"{pooling} pooling of width {kernel} over a tensor of shape {shape}",
                            "stride 1, centred, padding width // 2 on each side; the average counts the padding",
                            axes=("index",) * len(shape))


@points(2, task="window_vote")
def test_snapkv_keeps_the_window_and_each_heads_top_votes():
    """Budgets above the window, equal to it, below it, covering the prompt; 2 query heads per KV head. The
    instructor's SnapKV prefill runs here, calling your ``snapkv_scores``."""
    R, calls = reference("course.baselines.adapters"), []                  # in this process, not yours

    def student_snapkv_scores(*args):
        calls.append(1)
        return A.snapkv_scores(*args)
    g = generator("snapkv select")
    T, w = 16, 4
    probs = window_rows(g, 2, 4, w, T)
    for pooling in ("max", "avg"):
        scores = snapkv_oracle(probs, 2, w, 3, pooling)
        for budget in (9, 4, 2, 16):
            with patched(R.method("snapkv"), snapkv_scores=student_snapkv_scores):
                got = R.snapkv_select(probs, 2, budget, w, kernel=3, pooling=pooling)
            assert calls or budget >= T, "SnapKV's prefill never called your snapkv_scores"
            check_tensor(got, (2, 2, min(budget, T)), torch.long, f"SnapKV, budget {budget}, window {w}, {pooling} "
                         "pooling: the kept token indices (B, H_kv, K)")
            for b in range(2):
                for h in range(2):
                    window = list(range(T - min(w, budget), T)) if T > budget else list(range(T))
                    prefix = sorted(range(T - w), key=lambda t: (-float(scores[b, h, t]), t))
                    want = sorted(prefix[:max(0, min(budget, T) - len(window))] + window)
                    assert got[b, h].tolist() == want, (
                        f"SnapKV, budget {budget}, window {w}, {pooling} pooling: row {b} KV head {h} keeps "
                        f"{got[b, h].tolist()}, expected {want} (the window, or its last `budget` tokens; then the "
                        "prefix tokens with the best votes)")


# -- AdaKV ----------------------------------------------------------------------------------------------

def adakv_oracle(scores: torch.Tensor, budget: int, n_safe: int) -> list[set]:
    """Per row, the (head, slot) pairs kept: each head's n_safe best first (ties: the earlier slot), then the
    best of all the layer's entries, H_kv * budget in all (ties: the earlier head, then slot). NaN is -inf."""
    B, H_kv, T = scores.shape
    s = torch.nan_to_num(scores.double(), nan=float("-inf"), neginf=float("-inf")).tolist()
    kept = []
    for b in range(B):
        forced = {(h, t) for h in range(H_kv) for t in sorted(range(T), key=lambda t: (-s[b][h][t], t))[:n_safe]}
        key = {(h, t): float("inf") if (h, t) in forced else s[b][h][t] for h in range(H_kv) for t in range(T)}
        order = sorted(key, key=lambda ht: (-key[ht], ht))
        kept.append(set(order[:H_kv * budget]))
    return kept


def check_adakv(scores: torch.Tensor, budget: int, n_safe: int, what: str) -> None:
    mask = A.adakv_mask(scores, budget, n_safe)
    check_tensor(mask, scores.shape, torch.bool, f"{what}: the keep mask (B, H_kv, T)")
    for b, want in enumerate(adakv_oracle(scores, budget, n_safe)):
        got = {(h, t) for h, t in torch.nonzero(mask[b]).tolist()}
        if got != want:
            per_head = [sum(1 for x in got if x[0] == h) for h in range(scores.shape[1])]
            should = [sum(1 for x in want if x[0] == h) for h in range(scores.shape[1])]
            raise AssertionError(f"{what}: row {b} keeps {per_head} entries per head, expected {should}; wrongly "
                                 f"kept {sorted(got - want)[:4]}, missing {sorted(want - got)[:4]} (each head's "
                                 f"{n_safe} best first, then the layer's best, {budget} per head on average)")


@points(2, task="adakv")
def test_adakv_allocates_across_heads_with_a_safeguard():
    """Heads of very different scales, so that the safeguard changes what is kept (checked here); safeguards
    0, 1, 2 and the whole budget; 2 and 4 KV heads; four cases, the third with each head's scores of eight values
    only (ties within a head: the earlier slot), the fourth with scores below 0 and above 1 (a score is any number,
    a safeguarded entry outranks them all); the last head of row 1 has two NaN scores (never kept, below any
    negative score)."""
    for case in range(4):
        g = generator("adakv allocation", case)
        for H_kv, T, budget, n_safe in [(4, 12, 4, 1), (4, 10, 3, 2), (2, 9, 3, 1), (4, 8, 3, 3), (2, 7, 2, 0)]:
            scale = torch.logspace(0, -3, H_kv).view(1, H_kv, 1)                # head 0 outscores the rest
            scores = torch.rand(2, H_kv, T, generator=g)
            scores = (scores * 8).ceil() / 8 * scale if case == 2 else scores * scale
            if case == 3:
                scores = torch.randn(2, H_kv, T, generator=g) * 4 * scale - 1
            scores[1, -1, -2:] = float("nan")
            if 0 < n_safe < budget and case < 3:
                assert adakv_oracle(scores, budget, n_safe) != adakv_oracle(scores, budget, 0)   # the test's own check
            check_adakv(scores, budget, n_safe, f"AdaKV, {H_kv} KV heads, {T} slots, budget {budget}, "
                                                f"safeguard {n_safe}, case {case}")


@points(2, task="adakv")
def test_adakv_ties_infinities_and_nan():
    """Ties go to the earlier (head, slot), in the safeguard (a head's best tied) and in the layer's pool (entries
    of several heads tied at the cut): scores of three values only, several budgets and safeguards, one head of
    20 slots (past 16, a sort without stable=True moves ties on a CPU); +inf
    (protected) entries are kept first, NaN counts as -inf, and a budget covering every slot keeps them all."""
    g = generator("adakv ties")
    for H_kv, T, budget, n_safe in [(3, 8, 3, 1), (2, 10, 4, 2), (4, 6, 2, 1), (3, 9, 5, 0), (2, 20, 3, 2)]:
        ties = torch.randint(0, 3, (2, H_kv, T), generator=g).float() / 2
        check_adakv(ties, budget, n_safe, f"AdaKV with tied scores (0, 0.5 and 1 only), {H_kv} KV heads, {T} slots, "
                                          f"budget {budget}, safeguard {n_safe}")
    special = torch.randn(2, 3, 8, generator=g) * 3                           # below 0 and above 1 too
    special[0, 2, 6:] = float("inf")
    special[1, 0, :3] = float("nan")
    special[1, 1, 4] = float("-inf")
    check_adakv(special, 3, 1, "AdaKV with +inf, -inf and NaN scores")
    check_adakv(special, 8, 2, "AdaKV with a budget covering every slot")
    nan, inf = float("nan"), float("inf")
    check_adakv(torch.tensor([[[nan, -inf]]]), 1, 0, "AdaKV at a cut between NaN and -inf (equal: the earlier slot)")
    check_adakv(torch.tensor([[[nan, nan, 1.0], [5.0, 6.0, 7.0]]]), 2, 2, "AdaKV with a safeguard that takes a NaN "
                "entry (a head's n_safe best, NaN among them when it has fewer valid scores)")
