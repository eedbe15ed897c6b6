"""Public tests of the ``tensor_attention`` assignment, one per task: pair scores, the softmax over pairs, the
factored output, the two-matrix cache's append. Run them with ``python -m course.grade tensor_attention``. The
random inputs are drawn from the run's seed (printed with the score)."""

import adapters as A
import torch
from oracle import assert_close, check_tensor, generator, points, whole_copy_s


def random(*shape, seed=0):
    """Random numbers of one test's case ``seed``, drawn from the run's seed (``oracle.generator``)."""
    return torch.randn(*shape, generator=generator("tensor attention", seed))


BIG_N, BIG_D = 512, 1024              # the Kronecker product of two 512-row matrices of 1024: 1 GiB of fp32
GROWTH = 256 << 20                    # what the process running your code may add while it runs, at most


def no_kronecker_product(fn, n1, n2, d, lead, what, at_scale=True):
    """fn() (its answer, checked by the test), then (``at_scale``) ``what`` at a size where the Kronecker product
    K1 (x) K2 (n1 n2 d numbers a sequence) holds 1 GiB and the factored form a few MiB: the memory of a fresh
    process running your code, read from outside it (``adapters.watch``), may grow by at most ``GROWTH`` from
    before your code is imported to the end of the call (memory set aside earlier counts too)."""
    out = fn()
    if not at_scale:
        return out
    g = generator("tensor attention at scale", what)
    K1, K2 = (torch.randn(1, BIG_N, BIG_D, generator=g) for _ in range(2))
    if what == "pair_scores":
        args = (torch.randn(1, 1, BIG_D, generator=g), K1, K2, 0.03)
    else:
        args = (torch.softmax(torch.randn(1, 1, BIG_N * BIG_N, generator=g), -1).view(1, 1, BIG_N, BIG_N), K1, K2)
    with A.watch(fresh=True) as watch:
        got = (A.scores if what == "pair_scores" else A.output)(*args)
    kron = BIG_N * BIG_N * BIG_D * 4
    assert watch.peak_bytes < GROWTH, \
        f"{what} at n1 = n2 = {BIG_N}, d = {BIG_D}: the process running your code grew by " \
        f"{watch.peak_bytes >> 20} MiB (the Kronecker product K1 (x) K2 holds {kron >> 20} MiB; at most " \
        f"{GROWTH >> 20} MiB is allowed): factor it instead (Chen et al. §3.2, the module docstring)"
    if what == "pair_scores":                 # the answer at that size too, from the factored forms (a few MiB)
        q, K1, K2, scale = args
        want, atol = (q[..., None, :] * K1[:, None]) @ K2[:, None].transpose(-1, -2) * scale, 1e-4  # (1, 1, n1, n2)
    else:                                     # entries of about 0.003: fp32's rounding here is about 3e-9
        P, V1, V2 = args
        want, atol = ((P @ V2[:, None]) * V1[:, None]).sum(-2), 1e-6                            # (1, 1, d)
    assert_close(got, want, rtol=1e-4, atol=atol, what=f"{what} at n1 = n2 = {BIG_N}, d = {BIG_D}")
    return out


@points(2, task="pair_scores")
def test_pair_scores_without_the_kronecker_product():
    q, K1, K2 = random(2, 3, 8), random(2, 5, 8, seed=1), random(2, 4, 8, seed=2)
    assert_close(A.scores(q, K1, K2, 0.5), torch.einsum("btd,bad,bcd->btac", q, K1, K2) * 0.5, rtol=1e-5, atol=1e-5,
                 what="the pair scores S (B, Tq, n1, n2) with n1 = 5, n2 = 4, scale 0.5: S[t, a, b] = scale <q_t, "
                 "K1[a] * K2[b]> (K1's row a down, K2's row b across)")
    qm = random(2, 3, 2, 8, seed=3).transpose(1, 2)                # (B, H, Tq, d) as the model has it: a transpose
    K1h, K2h = random(2, 2, 5, 8, seed=6), random(2, 2, 4, 8, seed=7)
    assert_close(A.scores(qm, K1h, K2h, 0.5), torch.einsum("bhtd,bhad,bhcd->bhtac", qm, K1h, K2h) * 0.5, rtol=1e-5,
                 atol=1e-5, what="queries as the model hands them over, q (2, 2, 3, 8) a transpose of (B, Tq, H, d), "
                 "not contiguous (.view cannot flatten it, .reshape and broadcasting can): S (B, H, Tq, n1, n2)")
    no_kronecker_product(lambda: None, 5, 4, 8, 2, "pair_scores")           # then at scale, in its own process


@points(2, task="pair_softmax")
def test_softmax_runs_over_all_pairs_of_a_query():
    S = random(2, 3, 4, 5)
    allowed = torch.rand(3, 4, 5, generator=generator("pair softmax mask")) > 0.3
    allowed[:, 0, 0] = True
    P = A.softmax_over_pairs(S, allowed)
    want = torch.softmax(S.masked_fill(~allowed, float("-inf")).flatten(-2), -1).view_as(S)
    assert_close(P, want, rtol=1e-5, atol=1e-6, what="P (B, Tq, n1, n2) = exp(S[t, a, b]) / the sum over the allowed "
                 "pairs of query t: each query's probabilities sum to 1 over its pairs, 0 on a masked pair")
    assert_close(P.masked_fill(allowed, 0.0), torch.zeros_like(S), what="P on the masked pairs, exactly 0")
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1e-2), (torch.float64, 1e-12)):
        low = A.softmax_over_pairs(S.to(dtype), allowed)
        check_tensor(low, S.shape, dtype, f"P of {dtype} scores, with the mask (a model run in {dtype} multiplies it "
                     "with values of that dtype: keep it)")
        exact = torch.softmax(S.to(dtype).double().masked_fill(~allowed, float("-inf")).flatten(-2), -1).view_as(S)
        assert_close(low.double(), exact, atol=tol, what=f"P of {dtype} scores with the mask (masked pairs filled "
                     "with -inf, which every dtype holds; -1e9 does not fit in float16)")
    flat = A.softmax_over_pairs(torch.zeros(1, 1, 1, 256, 256, dtype=torch.float16))
    assert abs(float(flat.float().sum()) - 1) < 1e-2, (
        f"float16, 256 x 256 equal scores: P sums to {float(flat.float().sum()):.4g}, not 1 (65,536 terms of exp(0) "
        "summed in float16 overflow its 65,504: sum in float32, as torch.softmax does)")
    big = A.softmax_over_pairs(torch.tensor([[[[100.0, 0.0]]]]))
    assert_close(big, torch.tensor([[[[1.0, 0.0]]]]), atol=1e-6, what="no mask (allowed=None), scores 100 and 0: "
                 "P is 1 and 0 (exp(100) overflows float32: subtract the largest score first, as softmax does)")


@points(2, task="factored_output")
def test_factored_output_equals_the_sum_over_pairs():
    P = torch.softmax(random(2, 3, 20), -1).view(2, 3, 5, 4)
    V1, V2 = random(2, 5, 8, seed=4), random(2, 4, 8, seed=5)
    assert_close(A.output(P, V1, V2), torch.einsum("btac,bad,bcd->btd", P, V1, V2), rtol=1e-5, atol=1e-6,
                 what="the output o (B, Tq, d), o_t = sum over (a, b) of P[t, a, b] V1[a] * V2[b]")
    one = A.output(torch.full((1, 1, 1, 1, 1), 2.0), torch.ones(1, 1, 1, 1), torch.full((1, 1, 1, 1), 3.0))
    assert_close(one, torch.full((1, 1, 1, 1), 6.0), what="P of shape (1, 1, 1, 1, 1) (two leading dimensions, one "
                 "pair) holding 2, V1 = 1, V2 = 3: o = 2 x 1 x 3 = 6, shape (1, 1, 1, 1); P is used as given, "
                 "not normalised again")
    exact = torch.einsum("btac,bad,bcd->btd", P.double(), V1.double(), V2.double())
    for dtype, tol in ((torch.bfloat16, 5e-2), (torch.float64, 1e-12)):
        low = A.output(P.to(dtype), V1.to(dtype), V2.to(dtype))
        check_tensor(low, (2, 3, 8), dtype, f"o of {dtype} P, V1 and V2 (a model run in {dtype} adds it to its "
                     "residual stream: keep the dtype)")
        assert_close(low.double(), exact, atol=tol, rtol=tol, what=f"o of {dtype} P, V1 and V2")
    no_kronecker_product(lambda: None, 5, 4, 8, 2, "factored_output")       # then at scale, in its own process


PAIR_TOKENS, PAIR_D = 384, 32    # appends of one token: 147,456 pair rows of 32 numbers, 75 MiB of K~ and V~ at the end
PAIR_COPIES = 32                 # the CPU your process may spend, in copies of that final K~ and V~


def check_pairs_computed_once(what):
    """Def. 3.8's rows computed once, read from outside your code: the CPU seconds of the process running it
    (``adapters.watch``, from /proc) while ``PAIR_TOKENS`` tokens are appended one at a time, each followed by a
    read of one of the rows it added through ``cache.kt.t``, ``cache.vt.t`` and ``cache.pair_pos()`` (the
    library's names, as the cache's own ``attend`` reads them, whatever the adapters say), against copying the
    final K~ and V~ once. Appending each token's 2n + 1 rows costs about one such copy in all (a few more for
    the buffers' doubling); rebuilding the n^2 rows at every append or every read costs about n / 3 copies,
    128 here. Nothing your process reports counts here."""
    B, H, N, d = 1, 2, PAIR_TOKENS, PAIR_D
    total = 2 * B * H * N * N * d * 4
    copy = whole_copy_s(total)
    limit = PAIR_COPIES * copy + 0.5
    g = generator("pair growth", what)
    k1, k2, v1, v2 = (torch.randn(B, H, N, d, generator=g) for _ in range(4))
    picks = torch.rand(N, generator=generator("pair growth reads", what))
    cache = A.new_two_cache()
    with A.watch() as watch:
        for n in range(N):
            A.two_cache_append(cache, k1[:, :, n:n + 1], k2[:, :, n:n + 1], v1[:, :, n:n + 1], v2[:, :, n:n + 1],
                               torch.tensor([n]))
            r = n * n + int(picks[n] * (2 * n + 1))          # one of the 2n + 1 rows token n added, after the n^2
            kt, vt, a, b = A.harness("read_pair_row", cache, r, (n + 1) ** 2)
            assert max(a, b) == n, f"{what}: after {n + 1} tokens (one at a time), row {r} holds pair ({a}, {b}): " \
                f"the {2 * n + 1} rows of token {n}'s pairs go after the {n * n} stored before"
            assert_close(kt, k1[:, :, a] * k2[:, :, b], rtol=1e-5, atol=1e-6, what=f"{what}: after {n + 1} tokens, "
                         f"K~'s row {r}, pair ({a}, {b}), read from cache.kt.t")
            assert_close(vt, v1[:, :, a] * v2[:, :, b], rtol=1e-5, atol=1e-6, what=f"{what}: after {n + 1} tokens, "
                         f"V~'s row {r}, pair ({a}, {b}), read from cache.vt.t")
            if n % 32 == 31 and watch.cpu_so_far() > limit:
                break                                # over the limit already: no need to wait for the rest
    assert watch.cpu_s < limit, \
        f"{what}: appending {n + 1} of {N} tokens one at a time ({total >> 20} MiB of K~ and V~ at the end) took " \
        f"{watch.cpu_s:.2f} s of CPU in the process running your code, {watch.cpu_s / copy:.0f} " \
        f"times what copying the final K~ and V~ once takes (at most {PAIR_COPIES} for all): are the pair rows " \
        "computed again at each append or each read (cache.kt.t)? Def. 3.8: each row once, appended after those " \
        "stored (read from outside your process)"


@points(2, task="two_cache_append")
def test_two_cache_holds_every_pair_once():
    """A prompt of 3 tokens, then one more, at positions drawn from the run's seed: 16 pair rows, row (a, b) =
    K1[a] * K2[b] and V1[a] * V2[b]; the 9 rows of the prompt stay where they are."""
    k1, k2, v1, v2 = (random(1, 2, 4, 8, seed=s) for s in range(4))
    positions = torch.randperm(1000, generator=generator("two cache positions")).narrow(0, 0, 4).sort().values
    for first in (3, 2):                                # 3 tokens then 1, then 2 and 2
        check_two_cache(k1, k2, v1, v2, positions, first)
    check_pairs_computed_once("two_cache_holds_every_pair_once")


def check_two_cache(k1, k2, v1, v2, positions, first):
    """Append tokens [0, first) then [first, 4) and check the pair rows."""
    cache = A.new_two_cache()
    A.two_cache_append(cache, k1[:, :, :first], k2[:, :, :first], v1[:, :, :first], v2[:, :, :first],
                       positions[:first])
    before = [t.clone() for t in A.two_cache_pairs(cache)]
    A.two_cache_append(cache, k1[:, :, first:], k2[:, :, first:], v1[:, :, first:], v2[:, :, first:],
                       positions[first:])
    Kt, Vt, pa, pb = A.two_cache_pairs(cache)
    token = {int(p): i for i, p in enumerate(positions)}
    for name, x in (("a", pa), ("b", pb)):
        check_tensor(x, (16,), positions.dtype, f"the positions {name} of the pair rows (a, b), one per row")
    assert sorted(zip(pa.tolist(), pb.tolist())) == [(int(a), int(b)) for a in positions for b in positions], \
        f"the pair rows' positions (a, b) must be every pair of the 4 tokens at {positions.tolist()} once; got " \
        f"{list(zip(pa.tolist(), pb.tolist()))}"
    a, b = [token[int(p)] for p in pa], [token[int(p)] for p in pb]
    split = f"{first} tokens, then {4 - first}"
    assert_close(Kt, k1[:, :, a] * k2[:, :, b], rtol=1e-5, atol=1e-6, what=f"{split}: K~ (B, H, pairs, d), the row "
                 "of pair (a, b) is K1[a] * K2[b]")
    assert_close(Vt, v1[:, :, a] * v2[:, :, b], rtol=1e-5, atol=1e-6, what=f"{split}: V~ (B, H, pairs, d), the row "
                 "of pair (a, b) is V1[a] * V2[b]")
    P = before[0].shape[2]
    for name, x, y in zip(("K~", "V~", "a", "b"), (Kt, Vt, pa, pb), before, strict=True):
        assert_close(x[..., :P, :] if x.dim() == 4 else x[:P], y, what=f"{split}: {name} of the first {P} pair rows, "
                     f"those of the first {first} tokens, as they were before: the new pairs go after them (Def. 3.8)")
