"""Hidden tests of the ``scissorhands`` assignment (the grader's; not in a student copy).

The references below are loops written without the library. The tests of the evictions run the instructor's
policy here, in the test process, with the student's function in place of the graded one (and the instructor's
for the other tasks, so each task is graded alone), and compare with the same run of the instructor's alone.
Every random input is drawn from the run's seed (``oracle.generator``)."""

from contextlib import contextmanager
from types import SimpleNamespace

import adapters as A
import torch
from oracle import assert_close, check_tensor, generator, patched, points, reference

# ---------------------------------------------------------------------------------------------------------
# References, by loops over plain Python numbers


def level(n_seen):
    """The uniform level 1 / n as float32 computes it (the library's attention is float32): a softmax of equal
    scores over n slots gives exactly this, which is not below it."""
    return float(torch.tensor(1.0) / max(n_seen, 1))


def low_flags_by_loop(attn, visible, threshold=None):
    """Algorithm 2's indicator, one query row at a time: attended and below tau (default 1 / slots attended)."""
    out = [[[[bool(s and x < tau) for x, s in zip(row, seen)]
             for row, seen in zip(rows, sees)
             for tau in [threshold if threshold is not None else level(sum(seen))]]   # once per query row
            for rows, sees in zip(a_b, v_b)]
           for a_b, v_b in zip(attn.tolist(), visible.tolist())]
    return torch.tensor(out, dtype=torch.bool).view(visible.shape)


def keep_score_by_pairs(counts, attn, pos):
    """Each slot's score = how many slots of its head rank strictly below it (more flags, or as many and less
    attention), every pair compared in float64; empty slots -inf."""
    c, a = counts.double(), attn.double()                              # (B, H_kv, T): i along -2, j along -1 below
    below = (c[..., None, :] > c[..., None]) | ((c[..., None, :] == c[..., None]) & (a[..., None, :] < a[..., None]))
    return below.sum(-1).double().masked_fill(pos < 0, float("-inf"))


def n_dropped_by_loop(n_slots, budget, drop, n_recent):
    """Drop m = min(drop, budget - n_recent) at a time until the layer is within budget."""
    m, dropped = min(drop, budget - n_recent), 0
    while n_slots - dropped > budget:
        dropped += m
    return dropped


# ---------------------------------------------------------------------------------------------------------
# The policy: the instructor's Scissorhands, run here in the test process. For the task a test grades it calls
# the student's function (each call answered by the student's process), for the others its own, so each task is
# graded alone; the same run with no function of the student's is what the policy must keep.

ADAPTER = {"low_flags": "unimportant", "keep_score": "keep_order", "n_dropped": "tokens_to_drop"}


@contextmanager
def students(task):
    """Within: the instructor's ``methods.scissorhands`` calls the student's ``task`` (None: none of the
    student's) in place of its own. Yields the list of those calls, to check the policy made some."""
    calls = []

    def student(*args):
        calls.append(1)
        return getattr(A, ADAPTER[task])(*args)
    with patched(reference("methods.scissorhands"), **({task: student} if task else {})):
        yield calls


def kept_per_step(task, options, seed=0, n_prompt=14, n_new=6, rows=2):
    """The sorted positions every batch row, layer and KV head keeps after the prefill and after each decode step
    of the instructor's Scissorhands with the student's ``task`` (the tokens are given, not generated, so two runs
    stay aligned; the rows hold different prompts), and how many times the policy called the student's ``task``."""
    R = reference("course.model_adapters")
    model = R.tiny_model(seed=seed)
    ids = torch.randint(0, 512, (rows, n_prompt + n_new), generator=generator("scissorhands prompt", seed))
    cache = R.new_cache(model, "scissorhands", **options)
    steps = []
    with students(task) as calls:
        R.run_prefill(model, ids[:, :n_prompt], cache)
        for t in range(n_prompt, n_prompt + n_new + 1):
            steps.append({(row, layer): [sorted(set(R.kept_positions(cache, layer)[row, h].tolist()) - {-1})
                                         for h in range(2)] for row in range(rows) for layer in range(2)})
            if t < n_prompt + n_new:
                R.run_decode(model, ids[:, t], cache)
    return steps, len(calls)


def kept_by_hand(task, options, seed=0, n_prompt=10, n_new=12, n_head=8, n_kv_head=4):
    """The same for one layer (the only one in each step's list) of the instructor's policy driven by hand: the
    attention of each query head is a random row of multiples of 1/8 over the slots its query sees, so counters
    and attentions tie exactly; with m > 1 a decode step ranks by ``keep_score`` and later tokens refill the
    emptied slots, so slot order is not position order."""
    S, N = reference("methods.scissorhands"), reference("nanollm")
    g = generator("scissorhands by hand", seed)
    policy, kv, steps = S.ScissorhandsPolicy(**options), N.LayerKV(), []
    with students(task) as calls:
        for s in range(n_new + 1):
            q_pos = torch.arange(n_prompt) if s == 0 else torch.tensor([n_prompt + s - 1])   # the step's tokens
            kv.append(torch.zeros(1, n_kv_head, len(q_pos), 2), torch.zeros(1, n_kv_head, len(q_pos), 2), q_pos)
            kp = kv.pos.repeat_interleave(n_head // n_kv_head, dim=1)[0]                 # (H, T) per query head
            sees = (kp[:, None, :] >= 0) & (kp[:, None, :] <= q_pos[None, :, None])      # (H, Tq, T)
            probs = torch.stack([dyadic_rows(g, len(q_pos), sees[h], parts=8) for h in range(n_head)])[None]
            w = min(policy.history_window, len(q_pos))                                    # the rows it needs
            policy.step(SimpleNamespace(kv=kv, probs=probs[:, :, -w:], q_pos=q_pos, q=probs.new_zeros(1, n_head,
                        len(q_pos), 2), phase="prefill" if s == 0 else "decode", seen=n_prompt + s, layer=0))
            steps.append({(0, 0): [sorted(set(kv.pos[0, h].tolist()) - {-1}) for h in range(n_kv_head)]})
    return steps, len(calls)


def assert_same_evictions(task, options, seeds=(0, 1), by_hand=False):
    """A decode of the instructor's policy with the student's ``task`` keeps, at every step, what the same decode
    keeps with the instructor's ``task``: through the tiny model, or one layer driven by hand (``by_hand``)."""
    run, what = (kept_by_hand, "driven by hand (exact ties)") if by_hand else (kept_per_step, "of the tiny model")
    for seed in seeds:
        got, calls = run(task, options, seed)
        assert calls, f"{options}, seed {seed}: the policy never called your {task} (the test should make it)"
        want, _ = run(None, options, seed)
        for step, (g, w) in enumerate(zip(got, want)):
            for (row, layer), heads in w.items():
                for h in range(len(heads)):
                    assert g[(row, layer)][h] == heads[h], (
                        f"{options}, seed {seed}, a decode {what}: after "
                        f"{'the prefill' if step == 0 else f'decode step {step}'}, batch row {row}, layer {layer}, "
                        f"KV head {h} keeps positions {g[(row, layer)][h]} with your {task}; with the reference "
                        f"{task} the same decode keeps {heads[h]}")


# ---------------------------------------------------------------------------------------------------------
# low_flags

def dyadic_rows(g, n_rows, visible, parts=16):
    """Attention rows over the visible slots, multiples of 1 / parts summing to 1 (exact in binary)."""
    attn = torch.zeros(visible.shape)
    for i in range(n_rows):
        slots = visible[i].nonzero().flatten()
        cuts = torch.randint(0, parts + 1, (len(slots) - 1,), generator=g).sort().values
        bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([parts])])
        attn[i, slots] = (bounds[1:] - bounds[:-1]).float() / parts
    return attn


@points(3, task="low_flags")
def test_low_flags_against_a_loop():
    g = generator("low flags loop")
    B, H_kv, Tn, T = 2, 3, 5, 31
    visible = torch.rand(B, H_kv, Tn, T, generator=g) < 0.7           # any pattern: holes, evicted, not causal
    visible[0, 0, 0] = False                                            # a query that attended nothing
    visible[1, 2, :, :4] = True                                         # 4 or more slots, dyadic attention
    attn = torch.rand(B, H_kv, Tn, T, generator=g) * visible
    attn = attn / attn.sum(-1, keepdim=True).clamp(min=1e-9)
    attn[1, 2] = dyadic_rows(g, Tn, visible[1, 2])                     # some entries exactly at the level
    attn[1, 1, :, :] = torch.where(visible[1, 1], 0.125, 0.0)           # exactly the threshold below
    visible[0, 1, :, :] = torch.arange(T) < torch.tensor([31, 25, 29, 9, 3])[:, None]  # float32 1/25: below 1/25
    attn[0, 1] = torch.softmax(torch.zeros(Tn, T).masked_fill(~visible[0, 1], float("-inf")), -1)   # uniform
    visible[0, 2, 0] = torch.arange(T) < 4
    attn[0, 2, 0] = torch.softmax(torch.tensor([0.0, 0.0, 0.0, 1e-6] + [0.0] * (T - 4)).masked_fill(
        ~visible[0, 2, 0], float("-inf")), -1)                           # three a hair below 1/4
    for threshold in (None, 0.125, 0.3):
        def detail(at):
            n = int(visible[at[:3]].sum())
            tau = f"1/{n} (the query attended {n} slots)" if threshold is None else f"{threshold}"
            return f"attended {bool(visible[at])}, attention {float(attn[at]):.6g}, tau = {tau}"
        assert_close(A.unimportant(attn, visible, threshold), low_flags_by_loop(attn, visible, threshold),
                     detail=detail, what=f"threshold={threshold}: the low flags (B, H_kv, Tn, T), low meaning "
                     "attended and strictly below tau")


def counters(steps, n_kv_head, history_window, threshold):
    """The counters I (B, H_kv, T) after the instructor's Scissorhands, calling your ``low_flags``, observed a
    prompt (steps[0]: (B, H, Tn, T), its last Tn queries) and decode steps (steps[s]: (B, H, 1, T + s)), with
    nothing evicted; and how many times it called yours."""
    S, N = reference("methods.scissorhands"), reference("nanollm")
    policy = S.ScissorhandsPolicy(budget=1 << 20, history_window=history_window, threshold=threshold)
    B, _, _, T = steps[0].shape
    kv = N.LayerKV()
    with students("low_flags") as calls:
        for s, probs in enumerate(steps):
            new = torch.arange(T) if s == 0 else torch.tensor([T + s - 1])
            kv.append(torch.zeros(B, n_kv_head, len(new), 2), torch.zeros(B, n_kv_head, len(new), 2), new)
            seen = len(kv)
            policy.observe(SimpleNamespace(kv=kv, probs=probs, q_pos=torch.arange(seen - probs.shape[2], seen),
                                           phase="prefill" if s == 0 else "decode", seen=seen))
    return kv.state[S.COUNT], len(calls)


@points(2, task="low_flags")
def test_counters_over_several_steps_count_the_last_w_queries():
    g = generator("counters")
    B, H, H_kv, T, Tn, n_decode, w = 2, 4, 2, 6, 4, 5, 3
    steps, rows = [], []                  # rows: (query position, probabilities (B, H, T_final)) in order
    for s in range(n_decode + 1):
        n_q, width = (Tn, T) if s == 0 else (1, T + s)
        q_pos = torch.arange(width - n_q, width)
        visible = q_pos[:, None] >= torch.arange(width)[None, :]                 # causal
        probs = torch.stack([torch.stack([dyadic_rows(g, n_q, visible) for _ in range(H)]) for _ in range(B)])
        steps.append(probs)
        rows += [(int(q_pos[i]), probs[:, :, i]) for i in range(n_q)]
    final = T + n_decode
    for threshold in (None, 0.125):
        got, calls = counters(steps, H_kv, w, threshold)
        assert calls, "Scissorhands' observe never called your low_flags"
        want = torch.zeros(B, H_kv, final, dtype=torch.long)
        for q, p in rows[-w:]:                                            # the last w queries
            attn = p.view(B, H_kv, H // H_kv, -1).double().mean(2)         # the group's mean, (B, H_kv, q + 1)
            seen = torch.ones(B, H_kv, 1, q + 1, dtype=torch.bool)
            flags = low_flags_by_loop(attn[:, :, None], seen, threshold)[:, :, 0]
            want[..., :q + 1] += flags.long()
        assert_close(got, want.int(), what=(
            f"threshold={threshold}, w = {w}, after a prompt and {n_decode} decode steps (GQA: 4 query heads over "
            f"2 KV heads, the group's mean attention): the counters (B, H_kv, T), each position's low flags among "
            f"the last {w} queries, the slots each query attended only"))


@points(2, task="low_flags")
def test_eviction_follows_the_low_flags():
    assert_same_evictions("low_flags", {"budget": 8, "history_window": 4, "n_recent": 2})
    assert_same_evictions("low_flags", {"budget": 9, "history_window": 6, "n_recent": 1, "threshold": 0.08},
                          seeds=(2,))
    assert_same_evictions("low_flags", {"budget": 6, "history_window": 4, "n_recent": 1, "drop": 2}, by_hand=True)


# ---------------------------------------------------------------------------------------------------------
# keep_score

@points(3, task="keep_score")
def test_keep_score_orders_by_the_counters_then_the_attention():
    g = generator("keep score loop")
    B, H_kv, T = 2, 3, 40
    counts = torch.randint(0, 6, (B, H_kv, T), generator=g) * 80            # up to w = 400, many ties
    attn = torch.rand(B, H_kv, T, generator=g)
    attn[..., 1::4] = attn[..., ::4]                                         # equal attentions
    attn[..., 2::4] = torch.nextafter(attn[..., ::4], torch.tensor(2.0))     # the next float32 up
    counts[..., 2::4] = counts[..., ::4]
    counts[1, 1] = torch.arange(T) % 3 * 400 // 2                           # other counters in one head
    counts[0, 0] = torch.arange(T) // 2 % 2                                  # counters one apart
    pos = torch.randperm(T, generator=g).expand(B, H_kv, T).clone()
    pos[0, 2, 5:9] = -1                                                      # empty slots
    counts[0, 2] = torch.arange(T) % 2                                       # counters one apart beside them,
    attn[0, 2, 5:11] = 0.0                                                   # the empty and two held at 0
    counts[1, 0] = 400                                                       # one counter for all: tiny attentions
    attn[1, 0, ::2] = 1e-10 * (1 + 1e-5 * torch.arange(T // 2, dtype=torch.float32))
    attn[1, 0, 1:6:2] = torch.tensor([0.0, 1e-30, 1e-37])
    assert_lexicographic(A.keep_order(counts, attn, pos), counts, attn, pos)
    T = 1200                                                                 # more slots than a fixed scale
    counts = torch.randint(0, 3, (1, 2, T), generator=g)
    attn = torch.rand(1, 2, T, generator=g) * (torch.rand(1, 2, T, generator=g) < 0.9)   # some at 0
    counts[0, 1] = torch.arange(T) % 2
    attn[0, 1] = torch.arange(T) / T                                         # the I = 1 slots reach higher
    pos = torch.arange(T).expand(1, 2, T)
    assert_lexicographic(A.keep_order(counts, attn, pos), counts, attn, pos)


def assert_lexicographic(got, counts, attn, pos):
    """``got`` orders every pair of held slots as the pairwise reference, also in float32; -inf where empty."""
    B, H_kv, T = counts.shape
    want = keep_score_by_pairs(counts, attn, pos)
    check_tensor(got, want.shape, torch.float64, "keep_score's scores (B, H_kv, T)")
    empty = pos < 0
    assert_close(got.masked_fill(~empty, 0.0), torch.zeros_like(want).masked_fill(empty, float("-inf")),
                 what="keep_score's scores, the stored slots' set to 0 here: -inf at every empty slot (pos -1)")
    assert torch.isfinite(got[~empty]).all(), f"T = {T}: a stored slot has a finite score"
    for kind, s in (("", got.double()), (" in float32 (select_topk ranks a float32 copy)", got.float().double())):
        for b in range(B):
            for h in range(H_kv):
                idx = (~empty[b, h]).nonzero().flatten()
                sg, sw = s[b, h, idx], want[b, h, idx]
                agree = torch.sign(sg[:, None] - sg[None, :]) == torch.sign(sw[:, None] - sw[None, :])
                if not agree.all():
                    i, j = (int(idx[k]) for k in (~agree).nonzero()[0].tolist())
                    expected = "equal scores" if want[b, h, i] == want[b, h, j] else \
                        f"slot {i if want[b, h, i] > want[b, h, j] else j} higher"
                    raise AssertionError(
                        f"the order must be exactly lexicographic{kind}: T = {T}, batch {b}, KV head {h}: slot {i} "
                        f"(I = {int(counts[b, h, i])}, attention {float(attn[b, h, i]):.9g}) and slot {j} "
                        f"(I = {int(counts[b, h, j])}, attention {float(attn[b, h, j]):.9g}) score "
                        f"{float(s[b, h, i])} and {float(s[b, h, j])}; expected {expected}")


@points(2, task="keep_score")
def test_eviction_follows_the_keep_score():
    assert_same_evictions("keep_score", {"budget": 8, "history_window": 4, "n_recent": 2})
    assert_same_evictions("keep_score", {"budget": 6, "history_window": 20, "n_recent": 0, "drop": 2}, seeds=(2,))
    assert_same_evictions("keep_score", {"budget": 6, "history_window": 4, "n_recent": 1, "drop": 2}, by_hand=True)


# ---------------------------------------------------------------------------------------------------------
# n_dropped

@points(3, task="n_dropped")
def test_n_dropped_against_a_loop():
    """Every small case (budgets up to 12, up to 30 slots), and cases of up to a few thousand slots drawn from the
    run's seed."""
    g = generator("n_dropped loop")
    small = [(n_slots, budget, drop, n_recent) for budget in range(1, 13) for n_recent in range(budget)
             for drop in range(1, 9) for n_slots in range(0, 31)]
    drawn = []
    for _ in range(200):
        budget, drop = (int(x) for x in torch.randint(1, 2000, (2,), generator=g))
        n_recent = int(torch.randint(0, budget, (1,), generator=g))
        drawn.append((int(torch.randint(0, 3 * budget + 50, (1,), generator=g)), budget, drop, n_recent))
    large_m = [(budget + k, budget, drop, n_recent) for budget, drop, n_recent in ((2000, 1500, 0), (4000, 3999, 1),
                                                                                 (3000, 2500, 400)) for k in (1, 2, 3)]
    for n_slots, budget, drop, n_recent in small + large_m + drawn:
        got = A.tokens_to_drop(n_slots, budget, drop, n_recent)
        want = n_dropped_by_loop(n_slots, budget, drop, n_recent)
        assert isinstance(got, int) and got == want, (
            f"n_dropped(n_slots={n_slots}, budget={budget}, drop={drop}, n_recent={n_recent}): m = min(drop, budget - "
            f"n_recent) = {min(drop, budget - n_recent)} tokens at a time, as many times as it takes to hold at most "
            f"{budget}: expected {want}, got {got!r}")


@points(2, task="n_dropped")
def test_decode_drops_m_at_a_time():
    # budgets, windows and drops drawn from the run's seed (fixed ones were answered from a table on every seed):
    # one where the drop fits beside the recent window, one where m is cut to budget - n_recent
    g = generator("n_dropped options")
    draw = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=g))          # noqa: E731
    budget, n_recent = draw(6, 10), draw(1, 4)
    for drop in (draw(1, budget - n_recent), draw(budget - n_recent + 1, budget + 2)):
        options = {"budget": budget, "history_window": 4, "n_recent": n_recent, "drop": drop}
        m = min(options["drop"], options["budget"] - options["n_recent"])
        steps, calls = kept_per_step("n_dropped", options)
        assert calls, f"{options}: the policy never called your n_dropped"
        size = 13
        for step, kept in enumerate(steps):
            seen = 14 + step
            size = size + 1 - n_dropped_by_loop(size + 1, options["budget"], options["drop"], options["n_recent"])
            for (row, layer), heads in kept.items():
                for h, held in enumerate(heads):
                    assert len(held) == size, (
                        f"{options}: a full layer drops m = {m} at once, then refills: after "
                        f"{'the prefill of 14' if step == 0 else f'decode step {step}'} batch row {row}, layer "
                        f"{layer}, KV head {h} should hold {size} tokens, it holds {len(held)}")
                    recent = set(range(seen - options["n_recent"], seen))
                    assert recent <= set(held), f"{options}: the {options['n_recent']} most recent are kept"
    assert_same_evictions("n_dropped", {"budget": 8, "history_window": 4, "n_recent": 5, "drop": 6}, seeds=(0,))
