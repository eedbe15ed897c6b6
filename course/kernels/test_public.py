"""Public tests of the ``kernels`` assignment: the online softmax of each range (checked on the partials m, l,
acc the kernels write, before any merge) and the merge of the ranges' partials (given by the test), against
plain PyTorch written here. Without a GPU the kernels run in Triton's interpreter (the grader sets
``TRITON_INTERPRET=1``). Run them with ``python -m course.grade kernels``.

Each task is graded alone: the online-softmax tests merge nothing (they read each range's partials), the
merge tests build their partials themselves. Each test checks every implementation of its task. The random
inputs are drawn from the run's seed (printed with the score).

The kernels are launched by the grader's own wrappers (``launchers.py``: the grid, the buffers and the
arguments of the library's wrappers), each ``@triton.jit`` function read from your file alone and checked to be
Triton's language: keep the kernels' names and arguments. ``merge_splits`` (PyTorch) is called through the
adapters, with the merge kernels taken away in your process meanwhile (they raise), so that it computes its
answer itself (a check of honest mistakes: code in your process could undo it).
"""

import math

import adapters as A
import launchers
import torch
from oracle import assert_close, generator, points, taken_away

LOG2E = math.log2(math.e)
MERGE_FUNCTIONS = ("kernels.decode_attention._merge_splits_kernel", "kernels.decode_attention.merge_splits_triton",
                   "kernels.count_sketch._merge_splits_kernel", "kernels.count_sketch.merge_sketch_splits_triton",
                   "kernels.tensor_decode.tensor_decode_combine_kernel")


def pytorch_merge(m, l, acc):
    """Your ``merge_splits``, with the merge kernels of your library taken away meanwhile."""
    with taken_away(A, *MERGE_FUNCTIONS):
        return A.merge(m, l, acc)


def randn(*shape, seed, scale=1.0):
    """Random numbers of one test's case ``seed``, drawn from the run's seed (``oracle.generator``)."""
    return torch.randn(*shape, generator=generator("kernels", seed)) * scale


def ranges(n, block_n, splits):
    """The token ranges [a, b) the kernels cut n tokens into: whole blocks of ``block_n``, at most ``splits``
    ranges of equally many blocks (the last one shorter), none empty of blocks."""
    blocks = -(-n // block_n)
    per = -(-blocks // max(1, min(splits, blocks)))
    return [(a * block_n, min((a + per) * block_n, n)) for a in range(0, blocks, per)]


ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}   # a unit in the last place, relative, at most


def partials_by_range(s, v, bounds, p_dtype=None):
    """Each range's (m, l, acc) from scores s (G, T) and values v (T, d): m = the max score, l = sum exp(s - m),
    acc = sum exp(s - m) v; a range with no score (all -inf, or empty) gives m = -inf, l = 0, acc = 0.
    ``p_dtype``: the weights rounded to it before they multiply v (a 16-bit cache); then also each acc entry's
    slack, 1e-5 + ULP * sum p |v|: the kernel's weights, a float32 rounding away from the test's before they are
    rounded to 16 bits, may each land one unit in the last place away. -> (splits, G), (splits, G),
    (splits, G, d)[, (splits, G, d)]."""
    ms, ls, accs, slacks = [], [], [], []
    for a, b in bounds:
        x = s[:, a:b]
        m = x.max(-1).values if b > a else torch.full((s.shape[0],), float("-inf"))
        p = torch.exp(x - torch.where(m == float("-inf"), 0.0, m)[:, None])
        ms.append(m)
        ls.append(p.sum(-1))
        accs.append((p.to(p_dtype).float() if p_dtype else p) @ v[a:b])
        slacks.append(1e-5 + ULP[p_dtype] * (p @ v[a:b].abs()) if p_dtype else None)
    return (torch.stack(ms), torch.stack(ls), torch.stack(accs)) + ((torch.stack(slacks),) if p_dtype else ())


def check_partials(what, got, want, bounds, meaning, rtol=1e-5, atol=1e-5, acc_slack=None):
    """got, want: (m, l, acc), each (splits, G[, d]) of one (sequence, KV head). ``acc_slack``: each acc entry's
    own atol (``partials_by_range``), where p is rounded to the values' type before its product with them (m and
    l stay float32's)."""
    for name, g, w, what_it_is in zip(("m", "l", "acc"), got, want, meaning):
        tol = (0.0, acc_slack) if name == "acc" and acc_slack is not None else (rtol, atol)

        def detail(at):
            a, b = bounds[at[0]]
            feature = f", feature {at[2]}" if len(at) > 2 else ""
            return f"range {at[0]} (tokens {a}..{b - 1}), query head {at[1]} of the group{feature}"
        assert_close(g, w, rtol=tol[0], atol=tol[1], detail=detail,
                     what=f"{what}: {name} (splits, G[, d]), {what_it_is}")


DECODE_MEANING = ("the max of its scores q k / sqrt(d); -inf for a range without tokens",
                  "the sum of exp(score - m); 0 without tokens", "the sum of exp(score - m) v; 0 without tokens")
SKETCH_MEANING = ("in base 2: the max of its scores q k * scale * log2(e)", "the sum of 2^(score - m)",
                  "the sum of 2^(score - m) v")


def check_decode(q, k, v, block_n, splits, idx=None, dtype=torch.float32, tag="", rtol=1e-5, gpu_bf16=False):
    """decode_attention.py's split kernel: every (sequence, KV head)'s partials against the test's, and the
    scores it leaves in ``s`` (stored for H2O). ``gpu_bf16``: a bfloat16 cache through the 16-bit path, as a GPU
    takes it (on a CPU the library multiplies bfloat16 in fp32)."""
    B, H, d = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    k, v = k.to(dtype), v.to(dtype)
    sixteen = dtype == torch.float16 or gpu_bf16       # multiplied in its own type: q and p rounded to it
    m, l, acc, stored = launchers.decode_partials(A, q.to(dtype), k, v, idx, block_n, splits, not sixteen)
    n = k.shape[2] if idx is None else idx.shape[2]
    bounds = ranges(n, block_n, splits)
    qs = q.to(dtype).float() * (1 / math.sqrt(d))                         # (B, H, d), as the kernel loads it
    if sixteen:
        qs = qs.to(dtype).float()
    cache = f"{'selected rows' if idx is not None else 'contiguous'} {str(dtype)[6:]} cache" + \
        (" on a GPU's 16-bit path" if gpu_bf16 else "") + \
        (" (fp32 tl.dot in tf32 unless input_precision='ieee', as on a GPU)" if dtype == torch.float32 else "")
    for b in range(B):
        for h in range(H_kv):
            rows = torch.arange(n) if idx is None else idx[b, h]
            kk, vv = k[b, h, rows.clamp(min=0)].float(), v[b, h, rows.clamp(min=0)].float()   # (n, d)
            s = (qs[b, h * G:(h + 1) * G] @ kk.T).masked_fill(rows[None, :] < 0, float("-inf"))  # (G, n)
            want = partials_by_range(s, vv, bounds, dtype if sixteen else None)
            got = (m[b * H_kv + h], l[b * H_kv + h], acc[b * H_kv + h])
            what = f"online softmax{tag}, decode kernel ({cache}, block_n {block_n}, {len(bounds)} range(s)), " \
                f"sequence {b}, KV head {h}"
            check_partials(what, got, want[:3], bounds, DECODE_MEANING, rtol, rtol, want[3] if sixteen else None)
            assert_close(stored[b * H_kv + h], s, rtol=rtol, atol=rtol,
                         detail=lambda at: f"query head {at[0]} of the group, token {at[1]}",
                         what=f"{what}: the scores s (G, n) left for H2O's fused step, q k / sqrt(d) with the "
                         "padding at -inf")


def check_sketch(q, k, v, block_n, splits, tag="", rtol=1e-5):
    """count_sketch.py's fused kernel over raw tokens (q (H, d), k, v (H_kv, n, d)): partials in base 2."""
    H, d = q.shape
    H_kv, n, _ = k.shape
    G = H // H_kv
    scale = 1 / math.sqrt(d)
    m, l, acc = launchers.sketch_partials(A, q, k, v, scale, block_n, splits)
    bounds = ranges(n, block_n, splits)
    for h in range(H_kv):
        s = q[h * G:(h + 1) * G] @ k[h].T * scale * LOG2E                     # (G, n) in base 2
        m_w, _, _ = partials_by_range(s, v[h], bounds)
        _, l_w, acc_w = partials_by_range(s / LOG2E, v[h], bounds)          # 2^(x - m) = exp((x - m) / log2(e))
        check_partials(f"online softmax{tag}, count_sketch.py's fused kernel (block_n {block_n}, {len(bounds)} "
                       f"ranges), KV head {h}", (m[h], l[h], acc[h]), (m_w, l_w, acc_w), bounds, SKETCH_MEANING,
                       rtol=rtol, atol=max(rtol, 1e-4))


def check_online_softmax(B, H, H_kv, d, n, seed, k_scale=1.0, k_shift=0.0, q_shift=0.0, tag="", rtol=1e-5,
                         dtypes=(torch.float32, torch.float16, torch.bfloat16)):
    """One case through every implementation: the decode kernel over a contiguous cache (fp32, fp16 and bf16,
    one range and several) and over selected rows with padding (one head's last range all padding), and the
    fused sketch kernel over the first sequence's raw tokens. ``rtol``: of the fp32 checks (large scores carry
    larger rounding); ``dtypes``: of the contiguous cache (the interpreter's fp16 products are too coarse for
    scores in the hundreds)."""
    u = torch.ones(d) / math.sqrt(d)
    q = randn(B, H, d, seed=seed) + q_shift * u
    k = randn(B, H_kv, n, d, seed=seed + 1, scale=k_scale) + k_shift * u
    v = randn(B, H_kv, n, d, seed=seed + 2)
    for dtype in dtypes:
        for splits in (1, 3):
            check_decode(q, k, v, 16, splits, dtype=dtype, tag=tag, rtol=rtol)
    if torch.bfloat16 in dtypes:
        check_decode(q, k, v, 16, 3, dtype=torch.bfloat16, tag=tag, rtol=rtol, gpu_bf16=True)
    g = generator("kernels rows", seed)
    K = 3 * 16
    idx = torch.stack([torch.randperm(n, generator=g)[:K] if K <= n else torch.randint(0, n, (K,), generator=g)
                       for _ in range(B * H_kv)]).view(B, H_kv, K)
    idx[0, 0, 20:] = -1                             # its third range holds only padding
    idx[-1, -1, 3:9] = -1                           # padding inside a range
    check_decode(q, k, v, 16, 3, idx=idx, tag=tag, rtol=rtol)
    check_sketch(q[0], k[0], v[0], 16, 2, tag=tag, rtol=rtol)


def merge_case(R, G, d, bounds, seed, spread=3.0, shifts=None, row_shifts=None, head_shifts=None):
    """Scores s (R, G, T) and values v (R, T, d), the partials of ``bounds`` and the answer softmax(s) v.
    ``shifts``: a constant added to each range's scores (ranges far apart); ``row_shifts``, ``head_shifts``:
    to each row's, to each query head's."""
    T = max(b for _, b in bounds)
    s, v = randn(R, G, T, seed=seed, scale=spread), randn(R, T, d, seed=seed + 1)
    for (a, b), c in zip(bounds, shifts or [0.0] * len(bounds)):
        s[:, :, a:b] += c
    for r, c in enumerate(row_shifts or [0.0] * R):
        s[r] += c
    for g, c in enumerate(head_shifts or [0.0] * G):
        s[:, g] += c
    parts = [partials_by_range(s[r], v[r], bounds) for r in range(R)]
    m, l, acc = (torch.stack([p[i] for p in parts]) for i in range(3))      # (R, splits, G[, d])
    return m, l, acc, torch.softmax(s, dim=-1) @ v


def far_below_zero_case(seed):
    """3 query heads (a group the sketch kernel pads to 4), 5 ranges (a block of ranges padded to 8), the
    scores of the first row near -300 (a weight exp(m) without the common max underflows to 0), of the next
    row near +300 (a merge that reads a range too many takes the next row's); the query heads' scores 250
    apart (each head needs its own max)."""
    bounds = [(0, 4), (4, 10), (10, 11), (11, 17), (17, 20)]
    return merge_case(3, 3, 16, bounds, seed=seed, shifts=[-10.0, -30.0, -20.0, -15.0, -40.0],
                      row_shifts=[-290.0, 310.0, -290.0], head_shifts=[0.0, 250.0, -250.0])


MERGES = (("merge_splits (PyTorch)", pytorch_merge),
          ("decode_attention.py's _merge_splits_kernel", lambda *p: launchers.merge_kernel(A, *p)),
          ("count_sketch.py's _merge_splits_kernel", lambda *p: launchers.merge_sketch_kernel(A, *p)),
          ("tensor_decode.py's tensor_decode_combine_kernel", lambda *p: launchers.merge_tensor_kernel(A, *p)))


def merge_atol(m, l, acc):
    """The merge's absolute tolerance: 1e-5, plus what float32 rounding of numbers as large as the ranges' max
    scores puts into each weight. A merge that rounds m * log2(e) (base 2), or m + log(l) (a log-sum-exp, as
    FlashAttention-2's split-KV combine), near |m| = 550 moves every weight by about 3e-5 relatively (half a unit
    in the last place there), and the output by that times the ranges' outputs acc / l: 2^-22 |m| |acc / l|
    allows four such halves. In 300 seeds of these tests a log-sum-exp merge, and one in base 2, used at most
    0.09 of this tolerance (26 and 20 seeds failed an atol of 1e-5; the reference, 0.013)."""
    big = m[m.isfinite()].abs().max().item() if m.isfinite().any() else 0.0
    out = (acc / l.clamp(min=1e-30)[..., None]).abs().max().item()
    return 1e-5 + 2.0 ** -22 * big * out


def check_merge(m, l, acc, want, tag):
    """Every implementation of the merge against softmax over all ranges' scores at once, within ``merge_atol``
    (count_sketch.py's works in base 2: m * log2(e), rounded to float32)."""
    atol = merge_atol(m, l, acc)
    for name, merge in MERGES:
        if name.startswith("decode_attention") and acc.shape[-1] & (acc.shape[-1] - 1):
            continue                     # decode_attention.py's kernels take a power-of-two head dimension
        got = merge(m.clone(), l.clone(), acc.clone())
        assert_close(got, want, rtol=1e-4, atol=atol,
                     detail=lambda at: f"row {at[0]}, query head {at[1]}, feature {at[2]}; the ranges' m there: "
                     f"{[round(x, 2) for x in m[at[0], :, at[1]].tolist()[:6]]}...",
                     what=f"merge ({tag}), {name}: the output (R, G, d) = sum_s exp(m_s - M) acc_s / "
                     "sum_s exp(m_s - M) l_s, M = max_s m_s")


# -- the tests -----------------------------------------------------------------------------------------------

@points(3, task="online_softmax")
def test_each_range_keeps_its_max_sum_and_weighted_values():
    """40 tokens in blocks of 16 (a ragged last block), 1 or 3 ranges, 4 query heads over 2 KV heads; selected
    rows with padding; the fused sketch kernel's 2 ranges."""
    check_online_softmax(B=1, H=4, H_kv=2, d=16, n=40, seed=1)
    check_online_softmax(B=1, H=2, H_kv=1, d=16, n=20, seed=3, k_shift=20.0, q_shift=20.0, rtol=5e-4,
                         tag=" (scores near 100: exp of the score less the running max)", dtypes=(torch.float32,))
    q1, k1 = torch.ones(1, 16), torch.zeros(1, 17, 16)
    k1[0, 16] = 0.25                             # tokens 0..15 score 0, token 16 scores 1: the max comes late
    check_sketch(q1, k1, randn(1, 17, 16, seed=7), 16, 1, tag=" (the max in the second block)")


@points(3, task="merge_splits")
def test_merge_splits():
    """Three ranges of different lengths and an empty one; 40 ranges of two tokens (more than a block of ranges
    in the kernels); a head dimension of 12 (padded in the kernels that take it); 3 query heads, scores near
    -300."""
    bounds = [(0, 7), (7, 15), (15, 15), (15, 20)]
    check_merge(*merge_case(2, 2, 16, bounds, seed=0), tag="4 ranges, one empty")
    check_merge(*merge_case(2, 2, 16, [(2 * i, 2 * i + 2) for i in range(40)], seed=1), tag="40 ranges")
    check_merge(*merge_case(3, 1, 12, [(0, 5), (5, 6), (6, 11)], seed=6), tag="d = 12")
    v1 = randn(1, 1, 1, 16, seed=8)
    m, l = torch.tensor([[[-120.0], [float("-inf")]]]), torch.tensor([[[1.0], [0.0]]])
    check_merge(m, l, torch.cat([v1, torch.zeros(1, 1, 1, 16)], dim=1), v1[:, 0],
                tag="one range at m = -120 and an empty one (m = -inf, l = 0): M is -120, not 0")
    check_merge(*far_below_zero_case(seed=8), tag="3 query heads, rows of scores near -300 and +300")
    pairs = [(2 * i, 2 * i + 2) for i in range(40)]
    check_merge(*merge_case(2, 2, 16, [(0, 0)] * 32 + pairs[:8], seed=10),
                tag="40 ranges, the first 32 empty (a block of ranges with no token: M comes from the next)")
    check_merge(*merge_case(2, 2, 16, pairs, seed=11, shifts=[0.0] * 35 + [100.0] + [0.0] * 4),
                tag="40 ranges, range 35 scoring 100 above the others (M is the max over every range)")
    check_merge(*merge_case(2, 2, 16, [(0, 4), (4, 9), (9, 12)], seed=12, shifts=[0.0, 100.0, 0.0]),
                tag="3 ranges, the second 100 above the first (M is not the first range's m)")
