"""Public tests of the ``kvreviver`` assignment: the count sketch's insert (Algorithm 1) and query (Algorithm 2),
each in its three implementations (``VagueSketch``'s method, the plain function and the Triton kernel of
kernels/count_sketch.py), against a brute-force count sketch written here, token by token and row by row.
Run them with ``python -m course.grade kvreviver``.

Each task is graded alone: a test of ``query`` writes the cells itself (no ``insert``). The Triton kernels are
launched by the grader's own wrappers (``launchers.py``), each ``@triton.jit`` function read from your file
alone and checked to be Triton's language, so a kernel earns its points by what it computes itself: keep the
kernels' names and arguments. While one of the two PyTorch implementations (the method, the plain function)
runs, the other and the kernels are taken away in your process (they raise), so that each computes its answer
itself (a check of honest mistakes: code in your process could undo it). The expected cells and estimates use
hashes computed here (``sketch_hashes``), never your sketch's methods. The random inputs (tokens, positions, the
sketches' seeds) are drawn from the run's seed (printed with the score).
"""

import adapters as A
import launchers
import torch
from oracle import assert_close, generator, points, taken_away, written

H_KV, D = 2, 3                      # a cell holds a whole token (keys or values of every KV head): 6 numbers


def randn(*shape, seed):
    """Random numbers of one test's case ``seed``, drawn from the run's seed (``oracle.generator``)."""
    return torch.randn(*shape, generator=generator("kvreviver", seed))


def drawn(low, high, case):
    """An integer in [low, high) of one test's case, drawn from the run's seed: a sketch's seed, a first position."""
    return int(torch.randint(low, high, (1,), generator=generator("kvreviver integer", case)))


PRIME = 2_147_483_647              # the modulus of the sketch's universal hashes (methods/kvreviver_sketch.py)


def sketch_hashes(rows, width, seed, pos):
    """(cells h_i(J), signs g_i(J)), both (rows, n), of positions pos (n,), computed here as ``VagueSketch``'s
    given ``buckets`` and ``signs`` do: h_i(J) = (a_i J + c_i) mod PRIME mod width, g_i(J) = 1 - 2 ((a'_i J +
    c'_i) mod PRIME mod 2), the coefficients drawn from the seed."""
    coef = torch.randint(1, PRIME, (4, rows, 1), generator=torch.Generator().manual_seed(seed))
    J = pos.view(1, -1).long()
    return (coef[0] * J + coef[1]) % PRIME % width, 1.0 - 2.0 * ((coef[2] * J + coef[3]) % PRIME % 2).float()


def check_hashes(sketch, pos, cells, signs):
    """Your sketch hashes pos as the expected values assume (its ``buckets`` and ``signs`` are given code)."""
    got_cells, got_signs = A.hashes(sketch, pos)
    for name, got, want in (("cells", got_cells, cells), ("signs", got_signs, signs)):
        assert_close(got, want, what=f"your sketch's given hashes changed: the {name} (rows, n) of positions "
                     f"{pos.tolist()[:6]}... (VagueSketch.buckets and signs, the coefficients drawn from the seed)")


def random_hashes(rows, n, width, seed):
    """cells (rows, n) in [0, width) with every cell of every row used (collisions: n > width), signs +-1."""
    g = generator("kvreviver hashes", seed)
    cells = torch.stack([torch.randperm(n, generator=g) % width for _ in range(rows)])
    signs = torch.randint(0, 2, (rows, n), generator=g).float() * 2 - 1
    return cells, signs


# -- the oracle: a count sketch by brute force --------------------------------------------------------------

def brute_insert(key, value, cells, signs, k, v):
    """Algorithm 1, one token and one row at a time, in place: key[i, h_i(J)] += k_J and
    value[i, h_i(J)] += g_i(J) v_J. key, value (r, b, H_kv, d); cells, signs (r, n); k, v (n, H_kv, d)."""
    for i in range(cells.shape[0]):
        for j in range(cells.shape[1]):
            key[i, int(cells[i, j])] += k[j].float()
            value[i, int(cells[i, j])] += float(signs[i, j]) * v[j].float()


def lower_median(x):
    """The middle of the sorted rows, the lower of the two middle ones for an even count: x (r, ...)."""
    return x.sort(dim=0).values[(x.shape[0] - 1) // 2]


def brute_query(key, value, cells, signs):
    """Algorithm 2, one token at a time: the lower median over the rows of its cells, values times g_i(J)."""
    r, n = cells.shape
    k_hat, v_hat = torch.empty(n, *key.shape[2:]), torch.empty(n, *key.shape[2:])
    for j in range(n):
        k_hat[j] = lower_median(torch.stack([key[i, int(cells[i, j])] for i in range(r)]))
        v_hat[j] = lower_median(torch.stack([float(signs[i, j]) * value[i, int(cells[i, j])] for i in range(r)]))
    return k_hat, v_hat


# -- every implementation computes its answer itself ----------------------------------------------------------

INSERTS = ("reference_sketch_insert", "sketch_insert_triton", "_sketch_insert_kernel")
QUERIES = ("reference_sketch_query", "sketch_query_triton", "_sketch_query_kernel", "_sketch_estimate",
           "_sketch_row")


def without(*names):
    """Inside the block, the functions ``names`` of kernels/count_sketch.py raise (if that file imports)."""
    return taken_away(A, *(f"kernels.count_sketch.{n}" for n in names))


# -- checks with messages that say what went wrong -----------------------------------------------------------

def check_cells(what, got, want, cells, atol=1e-5):
    """got == want, cell by cell (NaN is wrong), or an error naming the first wrong cell and the tokens sent to it."""
    def detail(at):
        return f"row {at[0]}, cell {at[1]}, head {at[2]}, feature {at[3]}: the sum over the tokens " \
            f"{(cells[at[0]] == at[1]).nonzero().flatten().tolist()} hashed there"
    assert_close(got, want, atol=atol, rtol=1e-5, detail=detail, what=f"{what}: the cells (rows, width, H_kv, d)")


def check_estimates(what, got, want, key, cells, signs, values):
    """got == want, token by token (NaN is wrong), or an error naming the first wrong token and its rows' cells."""
    def detail(at):
        j, h, e = at
        read = [(float(signs[i, j]) if values else 1.0) * key[i, int(cells[i, j]), h, e].item()
                for i in range(cells.shape[0])]
        return f"token {j} (cells {cells[:, j].tolist()}, signs {signs[:, j].tolist()}), head {h}, feature {e}: the " \
            f"lower median of its rows' {'signed values' if values else 'keys'} {[round(x, 4) for x in read]}"
    assert_close(got, want, atol=1e-6, rtol=1e-5, detail=detail, what=f"{what}: the estimates (n, H_kv, d)")


def check_untouched(what, sketch, key, value):
    """A query reads the sketch's cells and leaves them as they were (key, value)."""
    got_k, got_v = A.cells(sketch)
    for name, got, want in (("keys", got_k, key), ("values", got_v, value)):
        assert_close(got, want, what=f"{what}: the {name} cells after the query, as they were (a query reads the "
                     "cells and leaves them)")


def check_insert(rows, width, batches, case, delete=True, hashes=sketch_hashes):
    """Tokens inserted in ``batches`` (sizes) into an empty sketch, then (``delete``) the first batch's first
    half deleted, by all three implementations against the oracle, on the hashes ``hashes(rows, width, seed,
    pos)`` (the plain function and the kernel write into the test's cells: ``written``). The sketch's seed, the
    positions and the tokens are those of ``case``, drawn from the run's seed; the first batch's tokens are a
    transpose (not contiguous: ``.view`` cannot flatten them)."""
    seed = drawn(0, 1 << 31, ("sketch", case))
    sketch = A.new_sketch(rows, width, H_KV, D, seed=seed)
    pos, start = [], drawn(0, 1 << 20, ("first position", case))
    for b, n in enumerate(batches):
        pos.append(torch.arange(start, start + 3 * n, 3))
        start += 3 * n
    toks = [(randn(n, H_KV, D, seed=("insert", case, b, "k")), randn(n, H_KV, D, seed=("insert", case, b, "v")))
            for b, n in enumerate(batches)]
    toks[0] = tuple(t.transpose(0, 1).contiguous().transpose(0, 1) for t in toks[0])   # (n, H_kv, d) laid out
    #                                       (H_kv, n, d): a transpose, as KVReviver hands evicted tokens over
    if len(batches) > 1:                 # a batch of fp16 tokens: the cells stay fp32
        toks[1] = tuple(t.half() for t in toks[1])
    want_k, want_v = torch.zeros(rows, width, H_KV, D), torch.zeros(rows, width, H_KV, D)
    ref_k, ref_v = written(torch.zeros(rows, width, H_KV, D)), written(torch.zeros(rows, width, H_KV, D))
    ker_k, ker_v = written(torch.zeros(rows, width, H_KV, D)), written(torch.zeros(rows, width, H_KV, D))
    for p, (k, v) in zip(pos, toks):
        cells, signs = hashes(rows, width, seed, p)
        check_hashes(sketch, p, cells, signs)
        brute_insert(want_k, want_v, cells, signs, k, v)
        with without(*INSERTS):
            A.insert(sketch, p, k, v)
        with without(*INSERTS[1:]):
            A.reference_insert(ref_k, ref_v, cells, signs, k, v)
        launchers.sketch_insert(A, ker_k, ker_v, cells, signs, k, v, block_n=4)
    every = torch.cat(pos)
    all_cells, _ = hashes(rows, width, seed, every)
    for what, (got_k, got_v) in (("reference_sketch_insert", (ref_k, ref_v)),
                                 ("_sketch_insert_kernel (the kernel)", (ker_k, ker_v))):
        check_cells(f"{what}, keys", got_k, want_k, all_cells)
        check_cells(f"{what}, values (g_i(J) v_J)", got_v, want_v, all_cells)
    if delete:                           # VagueSketch.delete is insert with sign -1
        half = len(pos[0]) // 2
        p, (k, v) = pos[0][:half], (t[:half] for t in toks[0])
        k, v = k.clone(), v.clone()
        cells, signs = hashes(rows, width, seed, p)
        brute_insert(want_k, want_v, cells, signs, -k, -v)
        with without(*INSERTS):
            A.delete(sketch, p, k, v)
    got_k, got_v = A.cells(sketch)
    what = "VagueSketch.insert" + (" (then delete, an insert with sign -1)" if delete else "")
    check_cells(f"{what}, keys", got_k, want_k, all_cells)
    check_cells(f"{what}, values (g_i(J) v_J)", got_v, want_v, all_cells)


def check_wide_insert(case, rows=2, width=3, n=5, H_kv=2, d=640):
    """The kernel's insert of tokens of H_kv d = 1,280 numbers: two blocks of 1,024 features (the grid's third
    axis), each written at its own offset."""
    cells, signs = random_hashes(rows, n, width, ("wide", case))
    k, v = randn(n, H_kv, d, seed=("wide", case, "k")), randn(n, H_kv, d, seed=("wide", case, "v"))
    want_k, want_v = torch.zeros(rows, width, H_kv, d), torch.zeros(rows, width, H_kv, d)
    brute_insert(want_k, want_v, cells, signs, k, v)
    key, value = written(torch.zeros(rows, width, H_kv, d)), written(torch.zeros(rows, width, H_kv, d))
    launchers.sketch_insert(A, key, value, cells, signs, k, v)
    what = f"_sketch_insert_kernel (the kernel), tokens of {H_kv} x {d} = {H_kv * d} numbers (two feature blocks)"
    check_cells(f"{what}, keys", key, want_k, cells)
    check_cells(f"{what}, values (g_i(J) v_J)", value, want_v, cells)


def check_query(rows, width, n, case, hashes=sketch_hashes):
    """Random cells (not from an insert) read back at n positions by all three implementations; the sketch's
    expected estimates on the hashes ``hashes(rows, width, seed, pos)``. The sketch's seed, the cells and the
    positions are those of ``case``, drawn from the run's seed."""
    seed = drawn(0, 1 << 31, ("sketch", case))
    sketch = A.new_sketch(rows, width, H_KV, D, seed=seed)
    key = randn(rows, width, H_KV, D, seed=("cells", case, "k"))
    value = randn(rows, width, H_KV, D, seed=("cells", case, "v"))
    cells_k, cells_v = A.cells(sketch)          # your sketch's own tensors: the test's writes reach them
    cells_k.copy_(key), cells_v.copy_(value)    # (every expected value comes from the test's key and value)
    start = drawn(0, 1 << 20, ("first position", case))
    pos = torch.arange(start, start + 5 * n, 5)
    cells, signs = hashes(rows, width, seed, pos)
    check_hashes(sketch, pos, cells, signs)
    want_k, want_v = brute_query(key, value, cells, signs)
    with without(*QUERIES):
        got = A.query(sketch, pos)
    check_untouched(f"VagueSketch.query, {rows} rows", sketch, key, value)
    ref_cells, ref_signs = random_hashes(rows, n, width, case)          # the functions take any hashes
    ref_want = brute_query(key, value, ref_cells, ref_signs)
    with without(*QUERIES[1:]):
        ref = A.reference_query(key.clone(), value.clone(), ref_cells, ref_signs)
    ker = launchers.sketch_query(A, key.clone(), value.clone(), ref_cells, ref_signs, block_n=4)
    for what, (k_hat, v_hat), (k_want, v_want), (c, s) in (
            (f"VagueSketch.query, {rows} rows", got, (want_k, want_v), (cells, signs)),
            (f"reference_sketch_query, {rows} rows", ref, ref_want, (ref_cells, ref_signs)),
            (f"_sketch_query_kernel (the kernel), {rows} rows", ker, ref_want, (ref_cells, ref_signs))):
        check_estimates(f"{what}, keys", k_hat, k_want, key, c, s, values=False)
        check_estimates(f"{what}, values", v_hat, v_want, value, c, s, values=True)


# -- the tests -----------------------------------------------------------------------------------------------

@points(3, task="insert")
def test_insert_sums_every_token_of_a_cell():
    """14 then 9 tokens into 4 cells per row (about 6 tokens a cell), some deleted again: each cell holds the sum
    of its tokens' keys, and of their values times the row's sign."""
    check_insert(rows=3, width=4, batches=(14, 9), case=1)
    check_wide_insert(case=1)
    sketch = A.new_sketch(2, 8, H_KV, D, seed=0, injective=True)   # token J in cell J of every row, sign +1
    k, v = randn(4, H_KV, D, seed=("injective", "k")), randn(4, H_KV, D, seed=("injective", "v"))
    with without(*INSERTS):
        A.insert(sketch, torch.arange(4), k, v)
    want = torch.zeros(2, 2, 8, H_KV, D)
    want[:, :, :4] = torch.stack([k, v])[:, None]
    got_k, got_v = A.cells(sketch)                      # two tensors, unpacked: an empty answer checks nothing
    for name, got, w in (("keys", got_k, want[0]), ("values", got_v, want[1])):
        assert_close(got, w, what=f"VagueSketch.insert into an injective sketch (injective=True: token J in cell J of "
                     f"every row, sign +1), 2 rows of 8 cells, tokens 0..3: the {name}; insert hashes through the "
                     "sketch's own buckets and signs, which know it")


@points(3, task="query")
def test_query_is_the_lower_median_of_signed_cells():
    """Cells written by the test: a token's key is the median over the rows of its cells; its value the median
    of the cells times the signs g_i(J) (the lower middle for an even number of rows)."""
    for rows, case, n in ((3, 2, 12), (2, 3, 12), (4, 1, 12), (5, 4, 10), (6, 5, 10)):   # 10: a block partly empty
        check_query(rows, width=5, n=n, case=case)
    sketch = A.new_sketch(2, 8, H_KV, D, seed=0, injective=True)   # token J in cell J of every row, sign +1
    cells_k, cells_v = A.cells(sketch)
    cells_k.copy_(torch.arange(8.0).view(1, 8, 1, 1).expand_as(cells_k))
    cells_v.copy_(-torch.arange(8.0).view(1, 8, 1, 1).expand_as(cells_v))
    with without(*QUERIES):
        k_hat, v_hat = A.query(sketch, torch.tensor([1, 5]))
    for name, got, want in (("keys", k_hat, [1.0, 5.0]), ("values", v_hat, [-1.0, -5.0])):
        assert_close(got, torch.tensor(want).view(2, 1, 1).expand(2, H_KV, D), what=f"VagueSketch.query of an "
                     f"injective sketch (token J in cell J, sign +1) whose cell J holds J (keys) and -J (values), "
                     f"positions 1 and 5: the {name}; query hashes through the sketch's own buckets and signs")
    tie = torch.tensor([1.0, 0.0, 0.0, 2.0]).view(4, 1, 1, 1).expand(4, 1, H_KV, D).contiguous()   # 4 rows, 1 cell
    one_cell, plus = torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1)
    with without(*QUERIES[1:]):
        ref = A.reference_query(tie.clone(), tie.clone(), one_cell, plus)
    ker = launchers.sketch_query(A, tie.clone(), tie.clone(), one_cell, plus, block_n=4)
    for what, (k_hat, _) in (("reference_sketch_query", ref), ("_sketch_query_kernel (the kernel)", ker)):
        assert_close(k_hat, torch.zeros(1, H_KV, D), what=f"{what}, one token in 4 rows whose cells read 1, 0, 0, 2 "
                     "(two rows tie at 0): the lower median, 0, as torch.median gives")
