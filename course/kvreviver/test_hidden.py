"""Hidden tests of the ``kvreviver`` assignment (the grader's; not in a student copy): any number of rows and
cells, several inserts and deletes, and KVReviver itself over several decode steps: the instructor's policy,
run in this process, with one operation of its sketch yours (each call checked against the instructor's own on
the same cells) and the other the instructor's. The expected cells and estimates come from the instructor's
hashes (``VagueSketch.buckets`` and ``signs`` of the reference library), never from your sketch's. Every random
input (tokens, positions, prompts, the sketches' seeds) is drawn from the run's seed (``oracle.generator``)."""

import adapters as A
import launchers
import torch
from oracle import address, assert_close, assert_greedy_is_uncached, generator, points, reference
from test_public import (
    H_KV,
    INSERTS,
    QUERIES,
    D,
    brute_query,
    check_cells,
    check_estimates,
    check_insert,
    check_query,
    check_untouched,
    check_wide_insert,
    drawn,
    randn,
    random_hashes,
    without,
)


def reference_hashes(rows, width, seed, pos):
    """(cells, signs) (rows, n) of positions pos (n,) by the instructor's ``VagueSketch`` of that seed."""
    sketch = reference("methods.kvreviver_sketch").VagueSketch(rows, width, 1, 1, seed)
    return sketch.buckets(pos), sketch.signs(pos)


def sketch_with_yours(operation, calls):
    """The instructor's ``VagueSketch`` class, in this process, with your ``operation`` ("insert" or "query") in
    place of its own: each sketch keeps one of yours (the same rows, width and seed) and, at each call of the
    operation, writes its cells into yours, runs yours on them, checks the result against its own operation on
    the same cells (the instructor's hashes), and goes on with yours. ``calls`` counts your calls."""
    base = reference("methods.kvreviver_sketch").VagueSketch

    class WithYours(base):
        def __init__(self, rows, width, n_kv_head, head_dim, seed, injective=False, device=None):
            super().__init__(rows, width, n_kv_head, head_dim, seed, injective, device)
            self.yours = A.new_sketch(rows, width, n_kv_head, head_dim, seed=seed, injective=injective)

        def insert(self, pos, k, v, sign=1.0):
            if operation != "insert":
                return super().insert(pos, k, v, sign)
            calls.append(pos.numel())
            your_k, your_v = A.cells(self.yours)                 # your sketch's own tensors: our writes reach them
            your_k.copy_(self.key), your_v.copy_(self.value)
            super().insert(pos, k, v, sign)                      # the expected cells
            (A.insert if sign > 0 else A.delete)(self.yours, pos, k, v)
            got_k, got_v = A.cells(self.yours)
            what = f"KVReviver's call {len(calls)} of your {'delete' if sign < 0 else 'insert'} (positions " \
                f"{pos.tolist()[:8]}, {self.rows} x {self.width} cells)"
            cells = self.buckets(pos)
            check_cells(f"{what}, keys", got_k, self.key, cells)
            check_cells(f"{what}, values (g_i(J) v_J)", got_v, self.value, cells)
            self.key.copy_(got_k), self.value.copy_(got_v)       # the policy goes on with your cells

        def query(self, pos):
            if operation != "query":
                return super().query(pos)
            calls.append(pos.numel())
            your_k, your_v = A.cells(self.yours)
            your_k.copy_(self.key), your_v.copy_(self.value)
            want_k, want_v = super().query(pos)                  # the expected estimates
            got_k, got_v = A.query(self.yours, pos)
            what = f"KVReviver's call {len(calls)} of your query (positions {pos.tolist()[:8]}, {self.rows} x " \
                f"{self.width} cells)"
            check_untouched(what, self.yours, self.key, self.value)
            cells, signs = self.buckets(pos), self.signs(pos)
            check_estimates(f"{what}, keys", got_k, want_k, self.key, cells, signs, values=False)
            check_estimates(f"{what}, values", got_v, want_v, self.value, cells, signs, values=True)
            return got_k, got_v                                  # the policy goes on with your estimates

    return WithYours


def run_side_by_side(yours, budget=16, steps=6, seed=7, **options):
    """The instructor's KVReviver on the tiny model, run here, with your sketch operation (``yours``: insert or
    query) and without (the reference alone), fed the same tokens (a 28-token prompt, then ``steps`` decode
    steps): each of your calls matches the instructor's on the same cells, and the logits of every step and the
    sketches' cells at the end agree. The prompt and the sketches' hashes are drawn from the run's seed."""
    R = reference("course.model_adapters")
    model = R.tiny_model("llama", seed=seed)
    g = generator("kvreviver side by side", seed)
    ids = torch.randint(0, 512, (1, 28 + steps), generator=g)
    options["seed"] = int(torch.randint(0, 1 << 30, (1,), generator=g))     # the hashes' seed
    caches = {"yours": R.new_cache(model, "kvreviver", budget, **options),
              "reference": R.new_cache(model, "kvreviver", budget, **options)}
    calls = []
    caches["yours"].policy.sketch_class = sketch_with_yours(yours, calls)
    logits = {}
    with without(*(INSERTS if yours == "insert" else QUERIES)):
        for name, cache in caches.items():
            out = [R.run_prefill(model, ids[:, :28], cache)[:, -1]]
            out += [R.run_decode(model, ids[:, t], cache) for t in range(28, 28 + steps)]
            logits[name] = out
    sketches = {name: cache.policy._sketch for name, cache in caches.items()}
    assert sketches["reference"].get(0), "the run must evict tokens into the sketch"
    assert calls, f"KVReviver never called your {yours}"
    for step, (got, want) in enumerate(zip(logits["yours"], logits["reference"])):
        assert_close(got, want, rtol=1e-4, atol=1e-5, what=(
            f"KVReviver with your {yours} and the instructor's {'query' if yours == 'insert' else 'insert'}: the "
            f"logits of step {step} (0 = prefill) against those with the instructor's sketch"))
    for layer in range(2):
        for mine, theirs in zip(sketches["yours"][layer], sketches["reference"][layer]):
            for part, got, want in (("keys", mine.key, theirs.key), ("values", mine.value, theirs.value)):
                assert_close(got, want, rtol=1e-4, atol=1e-5, what=(
                    f"KVReviver with your {yours}: after {steps} decode steps the {part} of layer {layer}'s sketch "
                    "against the instructor's"))


@points(3, task="insert")
def test_insert_for_any_number_of_rows_and_cells():
    """One row; one cell per row (every token in it); five rows: several inserts, fp16 tokens, deletes; in place."""
    for rows, width, batches, case in ((1, 3, (7,), 4), (2, 1, (5, 6), 5), (5, 3, (9, 4), 6)):
        check_insert(rows, width, batches, case, hashes=reference_hashes)
    check_wide_insert(case=2, rows=3, width=2, n=7, H_kv=4, d=320)
    check_insert_in_place(case=3)


def check_insert_in_place(case):
    """The sheet's "in place": the tensors the sketch holds before an insert are those it holds after, so code
    that holds them (the kernels, a fast path) sees the tokens. (Where your process holds them: ``address``.)"""
    sketch = A.new_sketch(2, 3, H_KV, D, seed=drawn(0, 1 << 31, ("in place", case)))
    before = [address(t) for t in A.cells(sketch)]
    k, v = randn(5, H_KV, D, seed=("in place", case, "k")), randn(5, H_KV, D, seed=("in place", case, "v"))
    with without(*INSERTS):
        A.insert(sketch, torch.arange(5) * 7, k, v)
    for part, then, now in zip(("keys", "values"), before, [address(t) for t in A.cells(sketch)]):
        assert now == then, f"VagueSketch.insert: after an insert the sketch's {part} are a new tensor; add into " \
            "its cells in place (the sheet: \"in place\"), so that code holding the cells sees the tokens"


@points(2, task="insert")
def test_kvreviver_evicts_into_your_sketch():
    """Six decode steps of eviction into a 3 x 3 sketch (many tokens a cell), then into an injective one (token J
    in cell J: the sketch's own buckets and signs, not the hash functions), queried by the instructor's."""
    run_side_by_side("insert", sketch_width=3)
    run_side_by_side("insert", sketch_width=64, injective_hash=True)


@points(3, task="query")
def test_query_for_any_number_of_rows():
    """One row (the cell itself), two and four rows (the lower median), three and five rows, 10 tokens over 3
    cells; cells of whole numbers, whose rows tie, read by all three implementations."""
    for rows, case in ((1, 4), (2, 5), (5, 6), (3, 7), (4, 9)):
        check_query(rows, width=3, n=10, case=case, hashes=reference_hashes)
    for rows, case in ((3, 10), (4, 11), (5, 12), (6, 13), (8, 14), (16, 15)):   # the kernels take up to 16 rows
        check_query_of_tied_rows(rows, case)
    for rows, case in ((3, 16), (4, 17), (5, 18)):
        check_method_query_of_tied_rows(rows, case)


def check_method_query_of_tied_rows(rows, case, width=3, n=10):
    """VagueSketch.query on cells of whole numbers from -3 to 3, so that some of a token's rows tie and others do
    not (rows reading 1, 0, 0: the lower median is 0): the lower median, as torch.median gives it, ties included."""
    seed = drawn(0, 1 << 31, ("tied sketch", case))
    sketch = A.new_sketch(rows, width, H_KV, D, seed=seed)
    key = randn(rows, width, H_KV, D, seed=("tied method", case, "k")).mul(1.5).round().clamp(-3, 3)
    value = randn(rows, width, H_KV, D, seed=("tied method", case, "v")).mul(1.5).round().clamp(-3, 3)
    cells_k, cells_v = A.cells(sketch)          # your sketch's own tensors: the test's writes reach them
    cells_k.copy_(key), cells_v.copy_(value)
    pos = torch.arange(n) * 5 + drawn(0, 1 << 20, ("tied first position", case))
    cells, signs = reference_hashes(rows, width, seed, pos)
    want_k, want_v = brute_query(key, value, cells, signs)
    with without(*QUERIES):
        got_k, got_v = A.query(sketch, pos)
    what = f"VagueSketch.query, {rows} rows of whole-number cells (rows that tie)"
    check_untouched(what, sketch, key, value)
    check_estimates(f"{what}, keys", got_k, want_k, key, cells, signs, values=False)
    check_estimates(f"{what}, values", got_v, want_v, value, cells, signs, values=True)


def check_query_of_tied_rows(rows, case, width=3, n=10):
    """Cells of whole numbers from -3 to 3, so a token's rows often hold equal numbers, read back by
    reference_sketch_query and the kernel: the lower median still, as torch.median gives it."""
    key = randn(rows, width, H_KV, D, seed=("tied cells", case, "k")).mul(1.5).round().clamp(-3, 3)
    value = randn(rows, width, H_KV, D, seed=("tied cells", case, "v")).mul(1.5).round().clamp(-3, 3)
    cells, signs = random_hashes(rows, n, width, ("tied", case))
    want_k, want_v = brute_query(key, value, cells, signs)
    with without(*QUERIES[1:]):
        ref = A.reference_query(key.clone(), value.clone(), cells, signs)
    ker = launchers.sketch_query(A, key.clone(), value.clone(), cells, signs, block_n=4)
    for what, (k_hat, v_hat) in (("reference_sketch_query", ref), ("_sketch_query_kernel (the kernel)", ker)):
        what = f"{what}, {rows} rows of whole-number cells (rows that tie)"
        check_estimates(f"{what}, keys", k_hat, want_k, key, cells, signs, values=False)
        check_estimates(f"{what}, values", v_hat, want_v, value, cells, signs, values=True)


@points(2, task="query")
def test_kvreviver_rebuilds_from_your_sketch():
    """With an injective hash (a cell per token) KVReviver is exactly full attention: the uncached forward pass,
    greedy over three decode steps; with collisions (3 x 3 cells), your query equals the instructor's."""
    R = reference("course.model_adapters")
    model = R.tiny_model("llama", seed=6)
    ids = torch.randint(0, 512, (1, 30), generator=generator("kvreviver exact"))
    cache = R.new_cache(model, "kvreviver", 20, sketch_width=64, injective_hash=True)
    calls = []
    cache.policy.sketch_class = sketch_with_yours("query", calls)
    with without(*QUERIES):
        assert_greedy_is_uncached(R, model, ids, cache, 3, what="KVReviver with an exact sketch and your query,")
    assert calls, "KVReviver never called your query"
    assert cache.layers[0].pos.shape[-1] < ids.shape[1] + 3, "tokens must have been evicted into the sketch"
    run_side_by_side("query", sketch_width=3, seed=8)
