"""Hidden tests of the ``critical_kv`` assignment (the grader's; not in a student copy).

The references below are loops written without the library. The test of the policy runs the instructor's
CriticalKV here, in the test process, with the student's two_stage_masks in place of its own, and compares
with the same run of the instructor's alone. Every random input is drawn from the run's seed
(``oracle.generator``)."""

import math

import adapters as A
import torch
from oracle import assert_close, check_tensor, generator, patched, points, reference

LOWEST = torch.finfo(torch.float32).min

# ---------------------------------------------------------------------------------------------------------
# References, by loops over plain Python numbers


def rows(x):
    """(..., n) -> list of rows (lists), and the leading shape."""
    return x.reshape(-1, x.shape[-1]).tolist(), x.shape[:-1]


def perturbation_by_loop(attn, keep, projected):
    """Eq. 5 row by row: A' = N*A / sum(N*A); L = sum_d |sum_i (A_i - A'_i) VW_id|. (...)."""
    a, lead = rows(attn)
    n, _ = rows(keep)
    vw = projected.reshape(-1, *projected.shape[-2:]).tolist()
    out = []
    for ar, nr, pr in zip(a, n, vw):
        mass = sum(x for x, k in zip(ar, nr) if k)
        diff = [x - (x / mass if k else 0.0) for x, k in zip(ar, nr)]
        out.append(sum(abs(sum(d * row[c] for d, row in zip(diff, pr))) for c in range(len(pr[0]))))
    return torch.tensor(out, dtype=torch.float64).view(lead)


def bound_by_loop(attn, keep, vnorm):
    """Eq. 8 row by row: theta = sum A P - (2 - 1 / sum N A) sum N A P. (...)."""
    a, lead = rows(attn)
    n, _ = rows(keep)
    p, _ = rows(vnorm)
    out = []
    for ar, nr, pr in zip(a, n, p):
        mass = sum(x for x, k in zip(ar, nr) if k)
        kept = sum(x * y for x, k, y in zip(ar, nr, pr) if k)
        out.append(sum(x * y for x, y in zip(ar, pr)) - (2 - 1 / mass) * kept)
    return torch.tensor(out, dtype=torch.float64).view(lead)


def two_stage_by_loop(first, second, budgets, n_first, valid=None):
    """Algorithm 1 row by row: the valid entries sorted by ``first`` (NaN and -inf the lowest valid scores, ties:
    the earlier entry), the top n_first; then the rest sorted by ``second`` up to the budget."""
    T = first.shape[-1]
    lead = first.shape[:-1]
    valid = torch.ones(first.shape, dtype=torch.bool) if valid is None else valid
    f, _ = rows(first.float())
    s, _ = rows(second.float())
    v, _ = rows(valid)
    b = torch.as_tensor(budgets).expand(lead).flatten().tolist()
    n1 = torch.as_tensor(n_first).expand(lead).flatten().tolist()

    def key(x):
        return LOWEST if math.isnan(x) or x == -math.inf else x

    stage1, keep = [], []
    for r in range(len(f)):
        idx = [j for j in range(T) if v[r][j]]
        budget = min(b[r], len(idx))
        take = min(n1[r], budget)
        one = set(sorted(idx, key=lambda j: (-key(f[r][j]), j))[:take])
        two = sorted((j for j in idx if j not in one), key=lambda j: (-key(s[r][j]), j))[:budget - take]
        stage1.append([j in one for j in range(T)])
        keep.append([j in one or j in two for j in range(T)])
    return torch.tensor(stage1).view(first.shape), torch.tensor(keep).view(first.shape)


def instance(g, shape, n, D):
    """Attention that differs per row (softmax of random logits), projected values, kept sets of every size."""
    attn = torch.softmax(torch.randn(*shape, n, generator=g) * 2, -1)
    projected = torch.randn(*shape, n, D, generator=g) * torch.rand(*shape, n, 1, generator=g) * 3
    keep = torch.rand(*shape, n, generator=g) < torch.rand(*shape, 1, generator=g)
    keep[..., 0] |= ~keep.any(-1)                                             # at least one kept entry
    keep.view(-1, n)[0] = True                                                # a row keeping everything
    return attn, projected, keep


# ---------------------------------------------------------------------------------------------------------
# output_perturbation

@points(3, task="output_perturbation")
def test_perturbation_against_a_loop():
    g = generator("perturbation loop")
    for shape, n, D in (((2, 3), 9, 5), ((4,), 16, 1), ((), 7, 3)):
        attn, projected, keep = instance(g, shape, n, D)
        # atol: a row that keeps everything has L = 0, which float32 rounding of A - A' makes up to ~3e-6
        assert_close(A.perturbation(attn, keep, projected), perturbation_by_loop(attn, keep, projected).float(),
                     rtol=1e-5, atol=1e-5, detail=lambda at: f"that row keeps {int(keep[at].sum())} of {n}",
                     what=f"attn {tuple(attn.shape)}, projected {tuple(projected.shape)}: output_perturbation, one L "
                     f"per row, L = ||(A - A') V W_O||_1 (an L1 norm over the D = {D} outputs of the change, A' "
                     "renormalised over the kept)")
    attn = torch.softmax(torch.tensor([10.0] + [0.0] * 11), -1).repeat(2, 3, 1).double()   # a sink: the kept
    keep = torch.arange(12) >= 8                                            # last 4 hold 2e-4 of the mass
    projected = torch.randn(2, 12, 3, 5, generator=g, dtype=torch.float64).transpose(1, 2)    # (2, 3, 12, 5)
    got = A.perturbation(attn, keep.expand(2, 3, 12), projected)
    check_tensor(got, (2, 3), torch.float64, "L of float64 inputs, over 2 x 3 heads")
    assert_close(got, perturbation_by_loop(attn, keep.expand(2, 3, 12), projected), rtol=1e-9, atol=1e-12,
                 what="float64, a sink holding nearly all the attention and the kept entries 2e-4 of it, projected "
                 "values laid out heads-second (a transpose of (2, 12, 3, 5)): one L per (batch, head)")


@points(2, task="output_perturbation")
def test_renormalized_attention_is_the_masked_softmax():
    g = generator("renormalized loop")
    logits = torch.randn(2, 3, 10, generator=g) * 3
    keep = torch.rand(2, 3, 10, generator=g) > 0.4
    keep[..., 2] = True
    want = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)       # Theorem 1: a softmax over the kept
    assert_close(A.renormalized(torch.softmax(logits, -1), keep), want, rtol=1e-5, atol=1e-6,
                 what="Theorem 1: A' (2, 3, 10) is the softmax over the kept entries only (zero elsewhere, summing to "
                 "1 over the kept)")


# ---------------------------------------------------------------------------------------------------------
# perturbation_bound

@points(2, task="perturbation_bound")
def test_bound_on_hand_cases():
    # A = (0.4, 0.3, 0.2, 0.1), P = (1, 5, 2, 10): C = 0.4 + 1.5 + 0.4 + 1 = 3.3; the entries in an order and P at
    # a scale drawn from the run's seed (theta is linear in P)
    g = generator("bound hand")
    order, scale = torch.randperm(4, generator=g), 0.5 + float(torch.rand(1, generator=g))
    attn = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 4, dtype=torch.float64)[:, order]
    vnorm = torch.tensor([[1.0, 5.0, 2.0, 10.0]] * 4, dtype=torch.float64)[:, order] * scale
    keep = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)[:, order]
    # mass 0.7, sum N A P 1.9: 3.3 - (2 - 1/0.7) 1.9; mass 0.3: 3.3 - (2 - 1/0.3) 1.4; mass 0.5: 3.3 - 0 * 1.4; 0
    want = torch.tensor([3.3 - (2 - 1 / 0.7) * 1.9, 3.3 - (2 - 1 / 0.3) * 1.4, 3.3, 0.0], dtype=torch.float64) * scale
    # asked together with 1 to 4 rows drawn from the seed, checked by the loop: a table of the hand rows' answers
    # (keyed by what the order and scale leave of them) earned these points on every seed before
    drawn_attn, projected, drawn_keep = instance(g, (int(torch.randint(1, 5, (1,), generator=g)),), 4, 3)
    drawn_vnorm = projected.abs().sum(-1).double()
    attn, keep = torch.cat([attn, drawn_attn.double()]), torch.cat([keep, drawn_keep])
    vnorm, want = torch.cat([vnorm, drawn_vnorm]), torch.cat([want, bound_by_loop(drawn_attn, drawn_keep, drawn_vnorm)])
    assert_close(A.bound(attn, keep, vnorm), want, atol=1e-6, rtol=1e-9,
                 detail=lambda at: f"keep {keep[at].int().tolist()}, mass {float((attn[at] * keep[at]).sum()):.1f}",
                 what=f"Eq. 8 in float64 on A = {attn[0].tolist()}, P = {[round(x, 5) for x in vnorm[0].tolist()]} "
                 f"(rows 0-3) and {len(want) - 4} drawn rows: theta = C - (2 - 1/mass) sum N A P, one per row")


@points(3, task="perturbation_bound")
def test_bound_against_a_loop_and_above_the_perturbation():
    g = generator("bound loop")
    for shape, n, D in (((2, 3), 9, 5), ((5,), 16, 2), ((), 6, 4)):
        attn, projected, keep = instance(g, shape, n, D)
        vnorm = projected.abs().sum(-1)
        got = A.bound(attn, keep, vnorm)
        assert_close(got, bound_by_loop(attn, keep, vnorm).float(), rtol=1e-4, atol=1e-5,
                     detail=lambda at: f"that row keeps {int(keep[at].sum())} of {n}, mass "
                     f"{float((attn[at] * keep[at]).sum()):.3f}",
                     what=f"attn {tuple(attn.shape)}: perturbation_bound, one theta per row, theta = sum A P - "
                     "(2 - 1/mass) sum N A P")
        L = perturbation_by_loop(attn, keep, projected)
        assert (L <= got.double() + 1e-4).all(), "Theorem 2: theta is never below the true perturbation L"


# ---------------------------------------------------------------------------------------------------------
# two_stage

@points(3, task="two_stage")
def test_two_stage_masks_against_a_loop():
    g = generator("two stage loop")
    for trial in range(30):
        B, H, T = 2, 3, 8 + trial % 9 if trial % 2 else 17 + trial % 16   # past 16: an unstable sort moves ties
        first = torch.randn(B, H, T, generator=g)
        second = torch.randn(B, H, T, generator=g) * 4
        first[..., 1::3] = first[..., ::3][..., :first[..., 1::3].shape[-1]]       # ties
        second[0, 0, :3] = second[0, 0, 3]
        first[1, 2, -2:] = float("inf")                                               # protected, kept first
        first[0, 1, :2] = second[1, 0, 1:3] = float("nan")                           # NaN: the lowest valid
        second[0, :, -1] = first[1, :2, -1] = float("-inf")                          # -inf: the lowest valid too
        valid = torch.rand(B, H, T, generator=g) < 0.85
        valid[..., 0] = False                                                         # an empty slot first
        budgets = torch.randint(0, T + 3, (B, H), generator=g) if trial % 2 else 1 + trial % T
        n_first = torch.randint(0, T, (B, H), generator=g) if trial % 3 else trial % 4
        got = A.stages(first, second, budgets, n_first, valid if trial % 4 else None)
        want = two_stage_by_loop(first, second, budgets, n_first, valid if trial % 4 else None)
        if not isinstance(got, tuple) or len(got) != 2:
            raise AssertionError(f"two_stage_masks returns two masks (stage 1, kept), got {type(got).__name__}")
        for name, x, y in (("stage1", got[0], want[0]), ("keep", got[1], want[1])):
            def detail(at, x=x, y=y):
                b, h = at[:2]
                bb = budgets if isinstance(budgets, int) else int(budgets[b, h])
                nf = n_first if isinstance(n_first, int) else int(n_first[b, h])
                return (f"batch {b}, head {h}: budget {bb}, n_first {nf}, "
                        f"{int(valid[b, h].sum()) if trial % 4 else T} valid of {T}; {name} holds "
                        f"{x[b, h].nonzero().flatten().tolist()}, expected {y[b, h].nonzero().flatten().tolist()}")
            assert_close(x, y, detail=detail, what=(
                f"trial {trial}: {name}, a (..., T) bool mask; stage 1 is the top n_first valid entries by `first` "
                "(capped at the budget, itself capped at the valid entries), stage 2 the best of the other valid "
                "entries by `second`; NaN and -inf rank lowest, ties go to the earlier entry"))

    first = torch.randn(2, 3, 12, generator=g)                                    # distinct first scores
    second = torch.zeros(2, 3, 12)                                                # stage 2: one tie throughout
    budgets, n_first = torch.randint(3, 12, (2, 3), generator=g), torch.randint(0, 3, (2, 3), generator=g)
    got, want = A.stages(first, second, budgets, n_first)[1], two_stage_by_loop(first, second, budgets, n_first)[1]
    assert_close(got, want, detail=lambda at: f"budget {int(budgets[at[:2]])}, n_first {int(n_first[at[:2]])}",
                 what="every second score equal: stage 2 fills the budget with the earliest entries stage 1 left, "
                 "in order of position, not of first score (the kept set, (2, 3, 12))")

    first = torch.tensor([[1.0, 1.0 + 1e-12, 0.5, 1e-300, 1e-300 * 3]], dtype=torch.float64)   # equal in float32
    second = torch.tensor([[0.0, 0.0, 0.0, 1e-300, 1e-300 * 2]], dtype=torch.float64)
    for budget, n in ((1, 1), (2, 1), (3, 0)):
        got = A.stages(first, second, budget, n)
        want = two_stage_by_loop(first, second, budget, n)
        for name, x, y in (("stage1", got[0], want[0]), ("keep", got[1], want[1])):
            assert_close(x, y, detail=lambda at, x=x, y=y: f"{name} holds {x[0].nonzero().flatten().tolist()}, "
                         f"expected {y[0].nonzero().flatten().tolist()}", what=(
                f"float64 scores, budget {budget}, n_first {n}: {name}; scores are ranked in float32, as the "
                "docstring says (a float64 score rounded first), so scores equal in float32 tie: the earlier wins"))


@points(2, task="two_stage")
def test_alpha_one_is_attention_topk_and_alpha_zero_is_a_times_p():
    """Alpha 1 keeps the attention top-k, alpha 0 the top-k of A * P; in between, both stages of Algorithm 1:
    the instructor's ``perturbation_constrained_select``, run here with your ``two_stage_masks``."""
    C, calls = reference("methods.critical_kv"), []

    def student_two_stage_masks(*args):
        calls.append(1)
        return A.stages(*args)

    def select(*args):
        with patched(C, two_stage_masks=student_two_stage_masks):
            return C.perturbation_constrained_select(*args)
    g = generator("alpha")
    attn = torch.softmax(torch.randn(3, 16, generator=g), -1)
    vnorm = torch.rand(3, 16, generator=g) * 3
    vnorm[torch.arange(3), attn.argmax(-1)] = 0.01     # the top attention entry last by A * P: the stages differ
    for row in range(3):
        for alpha, score, what in ((1.0, attn[row], "the attention top-k"), (0.0, attn[row] * vnorm[row],
                                                                              "the top-k of A * P")):
            want = sorted(score.topk(5).indices.tolist())
            got = select(attn, vnorm, 5, alpha)
            check_tensor(got, (3, 5), torch.long, f"budget 5, alpha = {alpha}: the kept entries of each row")
            assert got[row].tolist() == want, \
                f"row {row}, budget 5, alpha = {alpha}: Algorithm 1 is {what}, {want}; got {got[row].tolist()}"
    for alpha in (0.25, 0.5):                           # and in between, both stages: floor(alpha b) first
        keep = two_stage_by_loop(attn, attn * vnorm, 5, int(alpha * 5))[1]
        got = select(attn, vnorm, 5, alpha)
        check_tensor(got, (3, 5), torch.long, f"budget 5, alpha = {alpha}: the kept entries of each row")
        for row in range(3):
            want = keep[row].nonzero().flatten().tolist()
            assert got[row].tolist() == want, \
                f"row {row}, budget 5, alpha = {alpha}: Algorithm 1 keeps the top {int(alpha * 5)} by attention, " \
                f"then the rest by A * P, {want}; got {got[row].tolist()}"
    check_tensor(select(attn, vnorm, 40, 0.25), (3, 16), torch.long,
                 "a budget of 40 over 16 entries keeps all 16: the kept entries of each row")
    assert calls, "Algorithm 1 never called your two_stage_masks"


def kept_per_step(spec, options, students, seed=0, n_prompt=24, n_new=0):
    """The sorted positions every layer and KV head keeps after the prefill and after each decode step of the
    instructor's policy, run here in the test process, calling the student's two_stage_masks if ``students`` (the
    instructor's otherwise); and how many times it called the student's."""
    C, R = reference("methods.critical_kv"), reference("course.model_adapters")
    calls = []

    def student_two_stage_masks(*args):
        calls.append(1)
        return A.stages(*args)
    model = R.tiny_model(seed=seed)
    ids = torch.randint(0, 512, (1, n_prompt + n_new), generator=generator("critical kv prompt", seed))
    cache = R.new_cache(model, spec, **options)
    steps = []
    with patched(C, **({"two_stage_masks": student_two_stage_masks} if students else {})):
        R.run_prefill(model, ids[:, :n_prompt], cache)
        for t in range(n_prompt, n_prompt + n_new + 1):
            steps.append([[sorted(set(R.kept_positions(cache, layer)[0, h].tolist()) - {-1}) for h in range(2)]
                          for layer in range(2)])
            if t < n_prompt + n_new:
                R.run_decode(model, ids[:, t], cache)
    return steps, len(calls)


@points(2, task="two_stage")
def test_critical_kv_keeps_the_reference_entries():
    for spec, options, n_new in (("critical_kv", {"budget": 10, "window": 4, "alpha": 0.25}, 0),
                                 ("critical_kv(adakv(snapkv))", {"budget": 9, "window": 3, "alpha": 0.5}, 0),
                                 ("critical_kv(h2o)", {"budget": 8, "alpha": 0.4}, 4)):
        got, calls = kept_per_step(spec, options, students=True, n_new=n_new)
        assert calls, f"{spec} {options}: the policy never called your two_stage_masks (the test should make it)"
        want, _ = kept_per_step(spec, options, students=False, n_new=n_new)
        for step, (g, w) in enumerate(zip(got, want)):
            for layer in range(2):
                for h in range(2):
                    assert g[layer][h] == w[layer][h], (
                        f"{spec} {options}: after {'the prefill of 24' if step == 0 else f'decode step {step}'}, "
                        f"layer {layer}, KV head {h} (GQA: 2 query heads each) keeps {g[layer][h]} with your "
                        f"two_stage_masks; with the reference two_stage_masks it keeps {w[layer][h]}")
