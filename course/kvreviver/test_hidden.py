"""Hidden tests of the ``kvreviver`` assignment (the grader's; not in a student copy): any number of rows and
cells, several inserts and deletes, and KVReviver itself over several decode steps, with one operation of the
sketch yours and the other the brute-force oracle of test_public.py."""

import adapters as A
import torch
from oracle import assert_greedy_is_uncached, points
from test_public import INSERTS, QUERIES, brute_insert, brute_query, check_insert, check_query, without


def oracle_sketch(insert=True, query=True):
    """Your ``VagueSketch`` (its hashes and cells) with ``insert`` and / or ``query`` done by the oracle (a
    subclass made beside your code, whose methods call these functions of the test)."""
    def oracle_insert(self, pos, k, v, sign=1.0):
        cells, signs = A.hashes(self, pos)
        brute_insert(*A.cells(self), cells, signs, sign * k.float(), sign * v.float())

    def oracle_query(self, pos):
        cells, signs = A.hashes(self, pos)
        return brute_query(*A.cells(self), cells, signs)

    methods = {**({"insert": oracle_insert} if insert else {}), **({"query": oracle_query} if query else {})}
    return A.harness("subclass", A.sketch_class(), methods)


def run_side_by_side(yours, budget=16, steps=6, seed=7, **options):
    """KVReviver on the tiny model with your sketch operation (``yours``: insert or query) and with the oracle
    alone, fed the same tokens (a 28-token prompt, then ``steps`` decode steps): the logits of every step and
    the sketches' cells at the end must agree."""
    model = A.tiny_model(seed=seed)
    ids = torch.randint(0, 512, (1, 28 + steps), generator=torch.Generator().manual_seed(seed))
    caches = {"yours": A.kvreviver_cache(model, budget, oracle_sketch(**{yours: False}), **options),
              "oracle": A.kvreviver_cache(model, budget, oracle_sketch(), **options)}
    logits = {}
    with without(*(INSERTS if yours == "insert" else QUERIES)):
        for name, cache in caches.items():
            out = [A.run_prefill(model, ids[:, :28], cache)[:, -1]]
            out += [A.run_decode(model, ids[:, t], cache) for t in range(28, 28 + steps)]
            logits[name] = out
    assert A.sketches(caches["oracle"], 0), "the run must evict tokens into the sketch"
    for step, (got, want) in enumerate(zip(logits["yours"], logits["oracle"])):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), \
            (f"KVReviver with your {yours} and the oracle's {'query' if yours == 'insert' else 'insert'}: the logits "
             f"of step {step} (0 = prefill) differ from the oracle sketch's by "
             f"{(got - want).abs().max().item():.3g}")
    for layer in range(2):
        for s, (mine, theirs) in enumerate(zip(A.sketches(caches["yours"], layer),
                                               A.sketches(caches["oracle"], layer))):
            for part, got, want in zip(("keys", "values"), A.cells(mine), A.cells(theirs)):
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), \
                    (f"KVReviver with your {yours}: after {steps} decode steps the {part} of layer {layer}'s "
                     f"sketch differ from the oracle's by {(got - want).abs().max().item():.3g}")


@points(3, task="insert")
def test_insert_for_any_number_of_rows_and_cells():
    """One row; one cell per row (every token in it); five rows: several inserts, fp16 tokens, deletes."""
    for rows, width, batches, seed in ((1, 3, (7,), 4), (2, 1, (5, 6), 5), (5, 3, (9, 4), 6)):
        check_insert(rows, width, batches, seed)


@points(2, task="insert")
def test_kvreviver_evicts_into_your_sketch():
    """Six decode steps of eviction into a 3 x 3 sketch (many tokens a cell), queried by the oracle."""
    run_side_by_side("insert", sketch_width=3)


@points(3, task="query")
def test_query_for_any_number_of_rows():
    """One row (the cell itself), two and four rows (the lower median), three and five rows, 10 tokens over 3
    cells."""
    for rows, seed in ((1, 4), (2, 5), (5, 6), (3, 7), (4, 9)):
        check_query(rows, width=3, n=10, seed=seed)


@points(2, task="query")
def test_kvreviver_rebuilds_from_your_sketch():
    """With an injective hash (a cell per token) KVReviver is exactly full attention: the uncached forward pass,
    greedy over three decode steps; with collisions (3 x 3 cells), your query equals the oracle's."""
    model = A.tiny_model(seed=6)
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(5))
    cache = A.kvreviver_cache(model, 20, oracle_sketch(query=False), sketch_width=64, injective_hash=True)
    with without(*QUERIES):
        assert_greedy_is_uncached(A, model, ids, cache, 3, what="KVReviver with an exact sketch and your query,")
    assert A.kept_positions(cache, 0).shape[-1] < ids.shape[1] + 3, "tokens must have been evicted into the sketch"
    run_side_by_side("query", sketch_width=3, seed=8)
