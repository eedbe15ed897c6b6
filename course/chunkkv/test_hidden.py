"""Hidden tests of the ``chunkkv`` assignment (the grader's; not in a student copy).

The references below are loops written without the library. The tests of the policy run the instructor's
ChunkKV here, in the test process, with the student's function in place of the graded one (and the
instructor's for the other task, so each task is graded alone), and compare with the same run of the
instructor's alone. Every random input is drawn from the run's seed (``oracle.generator``)."""

import adapters as A
import torch
from oracle import assert_close, check_tensor, generator, patched, points, reference

# ---------------------------------------------------------------------------------------------------------
# References, by loops over plain Python numbers


def chunk_keep_by_loop(scores, pos, free, n_free, chunk_size, shared, remainder):
    """Algorithm 1 head by head: chunk sums of the free votes (added over the heads when shared), whole chunks
    best first (ties: the earlier chunk) until one does not fit; then the remainder's best single tokens."""
    B, H, T = scores.shape
    s = torch.where(free, scores.double(), 0.0).tolist()                     # votes of the free slots
    p, f, room = pos.tolist(), free.tolist(), n_free.tolist()
    keep = [[[False] * T for _ in range(H)] for _ in range(B)]
    for b in range(B):
        sums = [{} for _ in range(H)]                          # per head: chunk -> (summed votes, free slots)
        for h in range(H):
            for j in range(T):
                if f[b][h][j]:
                    total, n = sums[h].get(p[b][h][j] // chunk_size, (0.0, 0))
                    sums[h][p[b][h][j] // chunk_size] = (total + s[b][h][j], n + 1)
        for h in range(H):
            score = {k: sum(sums[g].get(k, (0.0, 0))[0] for g in range(H)) if shared else v[0]
                     for k, v in sums[h].items()}
            left, chosen = room[b][h], set()
            for k in sorted(score, key=lambda k: (-score[k], k)):
                if sums[h][k][1] > left:
                    break
                chosen.add(k)
                left -= sums[h][k][1]
            for j in range(T):
                keep[b][h][j] = f[b][h][j] and p[b][h][j] // chunk_size in chosen
            if remainder == "tokens":
                token = [sum(s[b][g][j] for g in range(H)) if shared else s[b][h][j] for j in range(T)]
                rest = sorted((j for j in range(T) if f[b][h][j] and not keep[b][h][j]), key=lambda j: (-token[j], j))
                for j in rest[:left]:
                    keep[b][h][j] = True
    return torch.tensor(keep, dtype=torch.bool)


ADAPTER = {"chunk_keep_mask": "chunk_mask", "holds_position": "holds"}     # the adapter of each library function


def holds_by_pairs(chosen, pos, seen):
    """Every slot against every chosen position of its head."""
    return (pos[..., :, None] == chosen[..., None, :]).any(-1) & (pos >= 0)


def instance(g, B, H, T, seen, chunk_size):
    """Random votes (multiples of 1/16: sums exact, ties happen), positions in any order with empty slots,
    protected slots, and room for some of the free slots in each head."""
    pos = torch.stack([torch.randperm(seen, generator=g)[:T] for _ in range(B * H)]).view(B, H, T)
    pos[torch.rand(B, H, T, generator=g) < 0.1] = -1
    scores = torch.randint(0, 16, (B, H, T), generator=g).float() / 16
    free = (pos >= 0) & (torch.rand(B, H, T, generator=g) < 0.85)
    scores[~free] = float("inf")                             # as the policy passes them: protected +inf,
    scores[pos < 0] = float("-inf")                          # empty -inf
    n_free = (torch.rand(B, H, generator=g) * (free.sum(-1) + 1)).long()
    return scores, pos, free, n_free


def edge_layouts():
    """(what, votes, positions, free, n_free, chunk size) of one row of 2 KV heads each, as the policy passes them
    (protected +inf, empty -inf): 20 tied chunks (an unstable sort or topk reorders them), votes closer than
    float16 tells apart, heads holding different positions, a protected first position (the chunks stay 4k to
    4k + 3), a head whose only free slots in a chunk are none, and rooms that differ between the heads."""
    inf, ar = float("inf"), lambda n: torch.arange(n).expand(1, 2, n)                 # noqa: E731
    split = torch.tensor([[[0, 1, 2, 3, -1, -1, -1, -1], list(range(4, 12))]])
    first_protected = torch.tensor([inf, 0.125, 0.125, 0.25, 1.0, 0.125, 0.125, 0.125]).expand(1, 2, 8)
    half_protected = torch.tensor([[[1.0, 1.0, 0.125, 0.125], [inf, inf, 0.25, 0.125]]])
    front = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.125, 0.125, 0.125, 0.125]).expand(1, 2, 8)
    near = torch.tensor([[[0.25, 0.25000003, 0.0625, 0.0625], [2.0, 2.0002, 0.0625, 0.0625]]])
    cases = [("20 tied chunks", torch.ones(1, 2, 20), ar(20), torch.tensor([[4, 7]]), 1),
             ("near ties", near, ar(4), torch.tensor([[1, 1]]), 1),
             ("near ties in one head", near * torch.tensor([[[1.0], [0.0]]]), ar(4), torch.tensor([[1, 1]]), 1),
             ("heads holding other positions", torch.ones(1, 2, 8).masked_fill(split < 0, -inf), split,
              torch.tensor([[4, 4]]), 4),
             ("position 0 protected", first_protected, ar(8), torch.tensor([[4, 3]]), 4),
             ("a head's chunk all protected", half_protected, ar(4), torch.tensor([[2, 2]]), 2),
             ("rooms that differ", front, ar(8), torch.tensor([[4, 8]]), 4)]
    return [(what, votes, pos, votes.isfinite(), n_free, size) for what, votes, pos, n_free, size in cases]


def check_edge_layouts(g, shared):
    """Each of ``edge_layouts`` asked with 1 to 3 rows drawn from the seed after it, against the loop."""
    for what, *case, chunk_size in edge_layouts():
        T = case[1].shape[-1]
        drawn = instance(g, int(torch.randint(1, 4, (1,), generator=g)), 2, T, T + 4, chunk_size)
        args = [torch.cat([a, d]) for a, d in zip(case, drawn)]
        try:
            got = A.chunk_mask(*args, chunk_size, shared, "none")
        except (IndexError, RuntimeError) as e:
            raise AssertionError(f"{what} (chunks of {chunk_size}, shared={shared}): chunk_keep_mask failed: "
                                 f"{str(e)[:100]}") from None
        want = chunk_keep_by_loop(*args, chunk_size, shared, "none")
        pos = args[1]
        assert_close(got, want, detail=lambda at, got=got, want=want, pos=pos: (
            f"batch {at[0]}, KV head {at[1]}: kept {sorted(pos[at[:2]][got[at[:2]]].tolist())}, expected "
            f"{sorted(pos[at[:2]][want[at[:2]]].tolist())}"),
            what=f"{what}, chunks of {chunk_size}, shared={shared} (row 0; the rows after it drawn): the keep mask, "
            "whole chunks of positions by summed free votes, ties to the earlier chunk, each head within its room")


def kept_per_step(options, task=None, spec="chunkkv", seed=0, n_prompt=30, n_new=0):
    """The sorted positions every layer keeps after the prefill and after each decode step (the tokens are
    given; two prompts), per (batch row, KV head), of the instructor's policy run here in the test process with
    the student's ``task`` (None: none of the student's) in place of its own; and how many times the policy
    called the student's ``task``."""
    K, R = reference("methods.chunkkv"), reference("course.model_adapters")
    calls = []

    def student(*args):
        calls.append(1)
        return getattr(A, ADAPTER[task])(*args)
    model = R.tiny_model(seed=seed)
    ids = torch.randint(0, 512, (2, n_prompt + n_new), generator=generator("chunkkv prompt", seed))
    cache = R.new_cache(model, spec, **options)
    steps = []
    with patched(K, **({task: student} if task else {})):
        R.run_prefill(model, ids[:, :n_prompt], cache)
        for t in range(n_prompt, n_prompt + n_new + 1):
            steps.append([[sorted(set(R.kept_positions(cache, layer)[b, h].tolist()) - {-1})
                           for b in range(2) for h in range(2)] for layer in range(2)])
            if t < n_prompt + n_new:
                R.run_decode(model, ids[:, t], cache)
    return steps, len(calls)


def step_name(step):
    return "the prefill" if step == 0 else f"decode step {step}"


# ---------------------------------------------------------------------------------------------------------
# chunk_ranking

@points(3, task="chunk_ranking")
def test_chunk_choice_against_a_loop():
    g = generator("chunk choice loop")
    for trial in range(40):
        chunk_size = 1 + trial % 5
        shared, remainder = trial % 2 == 0, ("none", "tokens")[trial // 2 % 2]
        T = 17 + trial % 7
        args = instance(g, 2, 3, T, T + 6, chunk_size)
        scores, pos, free, n_free = args
        got = A.chunk_mask(*args, chunk_size, shared, remainder)
        want = chunk_keep_by_loop(*args, chunk_size, shared, remainder)

        def detail(at, got=got, want=want, pos=pos, n_free=n_free):
            b, h = at[:2]
            return (f"batch {b}, KV head {h}, n_free {int(n_free[b, h])}: kept positions "
                    f"{sorted(pos[b, h][got[b, h]].tolist())}, expected {sorted(pos[b, h][want[b, h]].tolist())}")
        assert_close(got, want, detail=detail, what=(
            f"chunk size {chunk_size}, shared={shared}, remainder={remainder!r} (positions in any order, protected "
            f"slots, a last partial chunk): the keep mask (B, H_kv, T), whole chunks by the sum of their free votes"
            f"{' added over the KV heads' if shared else ''}, best first until one does not fit"))
    check_edge_layouts(g, shared=False)


@points(2, task="chunk_ranking")
def test_shared_ranking_sums_votes_over_heads_and_protected_slots_never_compete():
    """Hand cases, each head's slots in an order and the votes at a power-of-two scale drawn from the run's seed
    (a chunk is made of positions, and the scale changes no sum nor tie), each asked together with rows drawn
    from the seed, checked against the loop: an answer recorded for a hand case alone is never asked for (a table
    keyed by the positions and the votes over their largest earned this test's points on every seed)."""
    g = generator("shared ranking")

    def among_drawn_rows(scores, pos, free, n_free, chunk_size, shared):
        """The keep mask of the hand case's rows, asked with 1 to 3 rows of ``instance`` after them."""
        B, H, T = pos.shape
        drawn_rows = instance(g, int(torch.randint(1, 4, (1,), generator=g)), H, T, T + 4, chunk_size)
        args = [torch.cat([a, d]) for a, d in zip((scores, pos, free, n_free), drawn_rows)]
        mask = A.chunk_mask(*args, chunk_size, shared, "none")
        check_tensor(mask, args[1].shape, torch.bool, "chunk_keep_mask's mask (B, H_kv, T)")
        assert_close(mask[B:], chunk_keep_by_loop(*drawn_rows, chunk_size, shared, "none"), what=(
            f"the rows drawn beside the hand case (chunks of {chunk_size}, shared={shared}; random votes, positions in "
            "any order, protected and empty slots): whole chunks by their summed free votes, best first"))
        return mask[:B]

    def drawn(scores, pos, *more):
        """The same case with each (row, head)'s slots in a drawn order and the votes scaled."""
        order = torch.stack([torch.randperm(pos.shape[-1], generator=g) for _ in range(pos[..., 0].numel())])
        order = order.view(pos.shape)
        scale = 2.0 ** int(torch.randint(-6, 7, (1,), generator=g))
        return (scores.expand(pos.shape).gather(-1, order) * scale,
                *(t.expand(pos.shape).gather(-1, order) for t in (pos, *more)))

    scores = torch.tensor([[[1.0, 1.0, 0.0, 0.0, 0.2, 0.2], [1.5, 0.0, 1.5, 0.0, 0.0, 0.0]],     # chunks of 2
                           [[1.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0, 0.0, 0.0]]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [4, 1, 5, 0, 2, 3]]).expand(2, 2, 6)  # head 1: positions out of order
    scores, pos = drawn(scores, pos)
    free = torch.ones(2, 2, 6, dtype=torch.bool)
    n_free = torch.tensor([[2, 2], [2, 2]])
    for shared, want, why in (
            (False, [[[0, 1], [4, 5]], [[0, 1], [4, 5]]], "per head: chunk k holds positions 2k, 2k + 1 (whatever "
             "their slots); each head keeps its own best chunk"),
            (True, [[[4, 5], [4, 5]], [[0, 1], [0, 1]]], "shared: a chunk's votes are added over the heads of the "
             "same batch row, chunk by chunk (row 0: positions [4, 5] get 0.4 + 3.0, [0, 1] 2.0 + 0; row 1: [0, 1] "
             "2.0, [4, 5] 1.0, times a scale), and both heads keep the winner")):
        mask = among_drawn_rows(scores, pos, free, n_free, 2, shared)
        got = [[sorted(pos[b, h][mask[b, h]].tolist()) for h in range(2)] for b in range(2)]
        assert got == want, f"{why}: kept positions per (row, head) {got}, expected {want}"
    scores, pos, free = drawn(torch.tensor([[[5.0, 5.0, 0.1, 0.1, 0.2, 0.2]]]), torch.arange(6).view(1, 1, 6),
                              torch.tensor([[[False, False, True, True, True, True]]]))
    keep = among_drawn_rows(scores, pos, free, torch.tensor([[2]]), 2, False)
    got = sorted(pos[keep].tolist())
    assert got == [4, 5], f"protected slots (free False) neither compete nor count: expected positions [4, 5], got " \
        f"{got}"
    scores, pos, free = drawn(torch.tensor([[[9.0, 9.0, 1.0, 0.125, 0.125, 0.25, 0.5]]]),   # chunks of 3, one partial
                              torch.arange(7).view(1, 1, 7),
                              torch.tensor([[[False, False, True, True, True, True, True]]]))
    for n_free, want in ((1, [2]), (2, [2]), (4, [2, 3, 4, 5]), (5, [2, 3, 4, 5, 6])):
        keep = among_drawn_rows(scores, pos, free, torch.tensor([[n_free]]), 3, False)
        got = sorted(pos[keep].tolist())
        assert got == want, (
            f"a chunk takes as much room as its free slots (chunk 0: 1, chunk 1: 3, the last: 1); chunks 1 and 2 tie "
            f"(0.5 times a scale), the earlier first: with room for {n_free} expected positions {want}, got {got}")
    check_edge_layouts(g, shared=True)


@points(2, task="chunk_ranking")
def test_kept_chunks_follow_the_reference():
    for spec, options, n_new in (
            ("chunkkv", {"budget": 15, "chunk_size": 4, "window": 4, "reuse": 1, "remainder": "none"}, 0),
            ("chunkkv", {"budget": 17, "chunk_size": 3, "window": 5, "reuse": 1, "remainder": "tokens",
                         "per_head": True}, 0),
            ("chunkkv", {"budget": 3, "chunk_size": 4, "window": 4, "reuse": 1}, 0),    # budget below the window
            ("chunkkv(h2o)", {"budget": 13, "chunk_size": 4, "reuse": 1, "per_head": True}, 4)):   # evicts each step
        for seed in (0, 1):
            got, calls = kept_per_step(options, "chunk_keep_mask", spec=spec, seed=seed, n_new=n_new)
            assert calls, f"{spec} {options}: the policy never called your chunk_keep_mask (the test should make it)"
            want, _ = kept_per_step(options, spec=spec, seed=seed, n_new=n_new)
            for step, (g, w) in enumerate(zip(got, want)):
                for layer in range(2):
                    for bh in range(4):
                        assert g[layer][bh] == w[layer][bh], (
                            f"{spec} {options}, seed {seed}, after {step_name(step)}: layer {layer}, batch row "
                            f"{bh // 2}, KV head {bh % 2} keeps {g[layer][bh]} with your chunk_keep_mask; with the "
                            f"reference chunk_keep_mask it keeps {w[layer][bh]}")


# ---------------------------------------------------------------------------------------------------------
# holds_position

@points(3, task="holds_position")
def test_holds_against_every_pair():
    g = generator("holds loop")
    for trial in range(20):
        B, H, T, K, seen = 2, 3, 12 + trial, 5 + trial % 7, 30 + trial
        pos = torch.stack([torch.randperm(seen, generator=g)[:T] for _ in range(B * H)]).view(B, H, T)
        pos[torch.rand(B, H, T, generator=g) < 0.15] = -1                      # empty slots
        chosen = torch.stack([torch.randperm(seen, generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
        chosen[torch.rand(B, H, K, generator=g) < 0.2] = -1                    # padding
        chosen[0, 0, 0] = seen - 1                                             # the last position
        assert_close(A.holds(chosen, pos, seen), holds_by_pairs(chosen, pos, seen),
                     detail=lambda at, pos=pos, chosen=chosen: f"slot {at[2]} holds position {int(pos[at])}; that "
                     f"head chose {sorted(chosen[at[:2]].tolist())} (-1 is nothing)",
                     what=f"seen {seen}: holds_position (B, H_kv, T), whether each slot's position is among those its "
                     "row and head chose")
    chosen = torch.tensor([[[0, 3, -1, 6], [1, -1, 2, 2]], [[9, -1, -1, -1], [5, 0, -1, 8]]])   # -1 after 0;
    pos = torch.tensor([[[0, 1, 3, 5, -1], [1, 6, 2, 0, 4]], [[0, 1, 2, 3, 4], [4, 3, 0, 1, -1]]])  # none holds 8, 9
    assert_close(A.holds(chosen, pos, 10), holds_by_pairs(chosen, pos, 10), what="seen 10, padding (-1) after "
                 "position 0 and twice in a row, a position chosen twice, positions 8 and 9 chosen where no slot holds "
                 "them: whether each slot's position was chosen")


@points(2, task="holds_position")
def test_reusing_layers_keep_the_first_layers_positions():
    for spec, options, n_new in (("chunkkv", {"budget": 14, "chunk_size": 4, "window": 4, "per_head": True}, 0),
                                 ("chunkkv(h2o)", {"budget": 13, "chunk_size": 4, "per_head": True}, 5)):
        # the instructor's policy with your holds_position: layer 0 selects, layer 1 looks its positions up
        steps, calls = kept_per_step({**options, "reuse": 2}, "holds_position", spec=spec, n_new=n_new)
        assert calls, f"{spec} {options} with reuse = 2: the policy never called your holds_position"
        for step, kept in enumerate(steps):
            for bh in range(4):
                assert kept[1][bh] == kept[0][bh], (
                    f"{spec} {options} with reuse = 2, after {step_name(step)}: layer 1 reuses layer 0's choice, so "
                    f"batch row {bh // 2}, KV head {bh % 2} keeps layer 0's positions {kept[0][bh]}; it keeps "
                    f"{kept[1][bh]}")
