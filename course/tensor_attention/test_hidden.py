"""Hidden tests of the ``tensor_attention`` assignment (the grader's; not in a student copy). Each task is graded
alone against loops over pairs written here: several heads and rows, non-square pair grids, masks, several
cases; the two-matrix cache over chunks and single tokens at scattered positions. Every random input is drawn
from the run's seed (``oracle.generator``)."""

import math

import adapters as A
import torch
from oracle import assert_close, check_tensor, generator, points
from test_public import check_pairs_computed_once, no_kronecker_product, random

# -- the oracles: loops over pairs ------------------------------------------------------------------------

def scores_by_loop(q, K1, K2, scale):
    """S[..., t, a, b] = scale * sum_j q[t, j] K1[a, j] K2[b, j], one pair at a time."""
    *lead, Tq, d = q.shape
    n1, n2 = K1.shape[-2], K2.shape[-2]
    S = torch.empty(*lead, Tq, n1, n2, dtype=torch.float64)
    for t in range(Tq):
        for a in range(n1):
            for b in range(n2):
                S[..., t, a, b] = scale * (q[..., t, :] * K1[..., a, :] * K2[..., b, :]).double().sum(-1)
    return S


def softmax_by_loop(S, allowed):
    """exp(S - max) over the allowed pairs of each query, divided by their sum; 0 elsewhere."""
    allowed = torch.ones_like(S, dtype=torch.bool) if allowed is None else allowed.expand(S.shape)
    flat, ok = S.double().reshape(-1, S.shape[-2] * S.shape[-1]), allowed.reshape(-1, S.shape[-2] * S.shape[-1])
    P = torch.zeros_like(flat)
    for r in range(flat.shape[0]):
        top = max(flat[r, j] for j in range(flat.shape[1]) if ok[r, j])
        for j in range(flat.shape[1]):
            if ok[r, j]:
                P[r, j] = math.exp(flat[r, j] - top)
        P[r] /= P[r].sum()
    return P.view(S.shape)


def output_by_loop(P, V1, V2):
    """o[..., t] = sum over every pair (a, b) of P[t, a, b] V1[a] * V2[b]."""
    *lead, Tq, n1, n2 = P.shape
    o = torch.zeros(*lead, Tq, V1.shape[-1], dtype=torch.float64)
    for a in range(n1):
        for b in range(n2):
            o += P[..., :, a, b, None].double() * (V1[..., None, a, :] * V2[..., None, b, :]).double()
    return o


# -- task pair_scores -------------------------------------------------------------------------------------

@points(4, task="pair_scores")
def test_pair_scores_over_heads_and_non_square_grids():
    """Rows x heads (2, 3), 2 queries, n1 = 6 first keys by n2 = 5 second keys, d = 16; scales 1/sqrt(d) and
    0.37; three seeds: S[t, a, b] = scale * <q_t, K1[a] * K2[b]>, and never the Kronecker product."""
    for seed, (n1, n2, scale) in enumerate([(6, 5, 0.25), (6, 5, 0.37), (3, 7, 1.0)]):
        q, K1, K2 = random(2, 3, 2, 16, seed=seed), random(2, 3, n1, 16, seed=10 + seed), \
            random(2, 3, n2, 16, seed=20 + seed)
        if seed == 1:                                   # laid out as the model's projection leaves them
            q = random(2, 2, 3, 16, seed=seed).transpose(1, 2)
        got = no_kronecker_product(lambda: A.scores(q, K1, K2, scale), n1, n2, 16, 6, "pair_scores",
                                   at_scale=seed == 0)
        assert_close(got, scores_by_loop(q, K1, K2, scale).float(), rtol=1e-4, atol=1e-5,
                     what=f"n1={n1}, n2={n2}, scale {scale}: the pair scores S (..., Tq, n1, n2), S[t, a, b] = scale * "
                     "<q_t, K1[a] * K2[b]>")


# -- task pair_softmax ------------------------------------------------------------------------------------

@points(3, task="pair_softmax")
def test_pair_softmax_with_masks_and_large_scores():
    """Rows x heads (2, 3), 4 queries over a 3 x 5 pair grid: no mask; the causal mask of tensor attention
    (pair (a, b) seen by query t iff a, b <= t, broadcast over rows and heads); scores of size 100 (no overflow);
    masks broadcast over the pairs too ((n2,) and (Tq, n1, 1)), as the docstring allows."""
    S = random(2, 3, 4, 3, 5) * 3
    t = torch.arange(4)
    causal = (torch.arange(3) <= t[:, None])[:, :, None] & (torch.arange(5) <= t[:, None])[:, None, :]  # (4, 3, 5)
    for what, scores, allowed in (("no mask", S, None), ("the causal mask", S, causal),
                                  ("scores of size 100", S * 33, causal),
                                  ("a mask of K2's tokens alone, shape (n2,)", S, torch.arange(5) < 3),
                                  ("a mask of K1's tokens per query, shape (Tq, n1, 1)", S, causal[..., :1])):
        P = A.softmax_over_pairs(scores, allowed)
        assert_close(P, softmax_by_loop(scores, allowed).float(), rtol=1e-4, atol=1e-6,
                     what=f"{what}: P (..., Tq, n1, n2), P[t, a, b] is exp(S[t, a, b]) over exp(S) summed across every "
                     "pair (a', b') query t may attend (0 on a masked pair, never NaN)")
        if allowed is not None:
            assert_close(P.masked_fill(allowed, 0.0), torch.zeros_like(scores),
                         what=f"{what}: P on the masked pairs, exactly 0")
    for dtype, tol in ((torch.float16, 2e-3), (torch.float64, 1e-12)):
        P = A.softmax_over_pairs(S.to(dtype), causal)
        check_tensor(P, S.shape, dtype, f"the causal mask over {dtype} scores: P, in the scores' dtype")
        assert_close(P.double(), softmax_by_loop(S.to(dtype), causal), atol=tol,
                     what=f"the causal mask over {dtype} scores: P against the loop")
    P = A.softmax_over_pairs(torch.zeros(1, 2, 300, 300, dtype=torch.float16))
    assert_close(P.float().sum((-1, -2)), torch.ones(1, 2), atol=1e-2, what="float16, 90,000 equal pair scores per "
                 "query (their exp summed in float16 would overflow): each query's P sums to 1")


# -- task factored_output ---------------------------------------------------------------------------------

@points(3, task="factored_output")
def test_factored_output_over_heads_and_non_square_grids():
    """Rows x heads (2, 3), 2 queries, n1 = 4 by n2 = 6 pairs (and 5 by 3), d = 8; probabilities with zeros
    (masked pairs) and, since the output is linear in P, unnormalised weights: never the Kronecker product."""
    for seed, (n1, n2) in enumerate([(4, 6), (5, 3)]):
        P = torch.softmax(random(2, 3, 2, n1 * n2, seed=seed), -1).view(2, 3, 2, n1, n2)
        P[..., 0, -1, :] = 0.0
        V1, V2 = random(2, 3, n1, 8, seed=10 + seed), random(2, 3, n2, 8, seed=20 + seed)
        for what, weights in (("probabilities", P), ("unnormalised weights", P * 3 - 0.2)):
            got = no_kronecker_product(lambda: A.output(weights, V1, V2), n1, n2, 8, 6, "factored_output",
                                       at_scale=seed == 0 and weights is P)
            assert_close(got, output_by_loop(weights, V1, V2).float(), rtol=1e-4, atol=1e-5,
                         what=f"n1={n1}, n2={n2}, {what}: the output o (..., Tq, d), o_t = sum_(a, b) P[t, a, b] "
                         "V1[a] * V2[b]")
    P, V1, V2 = (t.double() for t in (P, random(2, 3, 5, 8, seed=30), random(2, 3, 3, 8, seed=31)))
    got = A.output(P, V1, V2)
    check_tensor(got, (2, 3, 2, 8), torch.float64, "the output of float64 weights and values, in float64")
    assert_close(got, output_by_loop(P, V1, V2), rtol=1e-12, atol=1e-12, what="float64 weights and values: o")


# -- task two_cache_append --------------------------------------------------------------------------------

CHUNKS = [4, 1, 3, 1]                                       # a prompt, a token, a chunk, a token


def scattered_positions(case):
    """9 increasing positions with gaps (as after a gap in the positions), drawn from the run's seed."""
    return torch.randperm(200, generator=generator("two cache positions", case))[:9].sort().values


def tokens(seed):
    """Factors of 9 tokens: k1, k2, v1, v2, each (2, 3, 9, 8) (rows x heads, every head different)."""
    return [random(2, 3, 9, 8, seed=seed + s) for s in range(4)]


def fill(cache, factors, positions, check=None):
    """Append the tokens chunk by chunk at ``positions``; after each, call check(n tokens stored, rows stored
    before)."""
    n = 0
    for m in CHUNKS:
        before = [t.clone() for t in A.two_cache_pairs(cache)] if n else None
        A.two_cache_append(cache, *(f[:, :, n:n + m] for f in factors), positions[n:n + m])
        n += m
        if check is not None:
            check(n, before)


@points(3, task="two_cache_append")
def test_two_cache_pairs_grow_by_the_new_rows_only():
    """Chunks of 4, 1, 3 and 1 tokens at scattered positions: after each, every pair of the stored tokens once,
    row (a, b) = K1[a] * K2[b] and V1[a] * V2[b] with its positions; the rows stored before stay where they are."""
    k1, k2, v1, v2 = tokens(0)
    positions = scattered_positions(0)
    cache = A.new_two_cache()
    index = {int(p): i for i, p in enumerate(positions)}

    def check(n, before):
        Kt, Vt, pa, pb = A.two_cache_pairs(cache)
        for name, x in (("a", pa), ("b", pb)):
            check_tensor(x, (n * n,), positions.dtype, f"after {n} tokens, the positions {name} of the pair rows "
                         "(a, b), one per row")
        want = sorted((int(a), int(b)) for a in positions[:n] for b in positions[:n])
        got = sorted(zip(pa.tolist(), pb.tolist()))
        assert got == want, f"after {n} tokens the positions (a, b) of the pair rows must be each pair of stored " \
            f"tokens once: {len(got)} rows, {len(set(got))} distinct, expected {len(want)}; e.g. missing " \
            f"{sorted(set(want) - set(got))[:3]}, extra {sorted(set(got) - set(want))[:3]}"
        a, b = [index[int(p)] for p in pa], [index[int(p)] for p in pb]
        assert_close(Kt, k1[:, :, a] * k2[:, :, b], rtol=1e-5, atol=1e-6,
                     what=f"after {n} tokens, K~ (B, H, pairs, d): pair (a, b)'s row is K1[a] * K2[b]")
        assert_close(Vt, v1[:, :, a] * v2[:, :, b], rtol=1e-5, atol=1e-6,
                     what=f"after {n} tokens, V~ (B, H, pairs, d): pair (a, b)'s row is V1[a] * V2[b]")
        if before is not None:
            P = before[0].shape[2]
            for name, x, y in zip(("K~", "V~", "a", "b"), (Kt, Vt, pa, pb), before, strict=True):
                assert_close(x[..., :P, :] if x.dim() == 4 else x[:P], y, what=f"after {n} tokens, {name} of the {P} "
                             "pair rows stored before, as they were: a two-matrix cache appends the new pairs after "
                             "them (Def. 3.8: rows computed once)")

    fill(cache, (k1, k2, v1, v2), positions, check)
    check_pairs_computed_once("two_cache_pairs_grow_by_the_new_rows_only")


def attention_by_loop(q, q_pos, k1, k2, v1, v2, pos):
    """Tensor attention of each query over the pairs (a, b) of tokens with positions <= its own, by loops."""
    B, H, Tq, d = q.shape
    out = torch.empty(B, H, Tq, d)
    for t in range(Tq):
        seen = [i for i in range(len(pos)) if pos[i] <= q_pos[t]]
        pairs = [(a, b) for a in seen for b in seen]
        s = torch.stack([(q[:, :, t] * k1[:, :, a] * k2[:, :, b]).sum(-1) / math.sqrt(d) for a, b in pairs], -1)
        p = torch.softmax(s, -1)
        out[:, :, t] = sum(p[..., j, None] * v1[:, :, a] * v2[:, :, b] for j, (a, b) in enumerate(pairs))
    return out


@points(3, task="two_cache_append")
def test_two_cache_attention_equals_loops_over_pairs():
    """Attention through the two-matrix cache (ordinary attention over its pair rows, masked by their positions)
    after each chunk: the chunk's own queries (each sees the pairs of tokens at or before it) equal loops over
    pairs, computed here from the rows the cache holds and by the cache's own ``attend``; two cases."""
    for seed in (0, 7):
        k1, k2, v1, v2 = tokens(seed)
        q = random(2, 3, 9, 8, seed=seed + 5)
        positions = scattered_positions(seed)
        cache = A.new_two_cache()

        def check(n, before):
            m = next(c for c, total in zip(CHUNKS, [4, 5, 8, 9]) if total == n)
            qs, qp = q[:, :, n - m:n], positions[n - m:n]
            want = attention_by_loop(qs, qp, k1[:, :, :n], k2[:, :, :n], v1[:, :, :n], v2[:, :, :n], positions[:n])
            where = f"case {seed}, queries at {qp.tolist()} over {n} tokens at {positions[:n].tolist()}"
            Kt, Vt, pa, pb = A.two_cache_pairs(cache)    # attention here, over the rows your append stored
            for name, x in (("a", pa), ("b", pb)):
                check_tensor(x, (Kt.shape[2],), positions.dtype, f"{where}: the positions {name}, one per pair row")
            seen = torch.maximum(pa, pb)[None, :] <= qp[:, None]                    # (Tq, P)
            scores = (qs @ Kt.transpose(-1, -2) / math.sqrt(qs.shape[-1])).masked_fill(~seen, float("-inf"))
            assert_close(torch.softmax(scores, -1) @ Vt, want, rtol=1e-4, atol=1e-5, what=f"{where}: ordinary "
                         "attention over the pair rows the cache holds (K~, V~ and their positions)")
            got = A.two_cache_attend(cache, qs, qp)
            assert_close(got, want, rtol=1e-4, atol=1e-5, what=f"{where}: the output (B, H, Tq, d)")

        fill(cache, (k1, k2, v1, v2), positions, check)
    check_pairs_computed_once("two_cache_attention_equals_loops_over_pairs")
