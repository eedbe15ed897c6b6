"""
KVReviver: evicted tokens go into a count sketch, from which every step rebuilds them for full attention.

Paper: Yuan et al., "KVReviver: Reversible KV Cache Compression with Sketch-Based Token Reconstruction", 2025,
https://arxiv.org/abs/2512.17917  (the Vague sketch: Algorithms 1-2; Recent / Candidate / Vague storage:
Algorithm 3; rebuilding the cache: Algorithm 4; defaults: Tables 2-3; error analysis: Lemmas 1-2).

An evicting method forgets for good. KVReviver keeps, per layer, Recent (R: the newest tokens, raw), Candidate
(C: the highest accumulated attention, raw) and Vague (V: every other token summed into r x b sketch cells), and
before each attention rebuilds all N positions, raw from R and C, the sketch's median for V (Algorithm 4).
The sketch (Algorithms 1-2), per row i with a bucket hash h_i and a sign hash g_i:
    insert:  cell[i, h_i(J)].key += k_J          cell[i, h_i(J)].value += g_i(J) v_J
    query:   k^_J = median_i cell[i, h_i(J)].key    v^_J = median_i g_i(J) cell[i, h_i(J)].value
Budget = raw slots + cells per layer per KV head, split 0.45 / 0.45 / 0.1 (Tables 2-3). Algorithm 3's rebalancing,
revived tokens, ``per_kv_head`` and ``layer_budgets``: ``methods/README.md``, "How each method is built"; how the
paper's open points are resolved: its table "Choices where papers and implementations differ".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from nanollm.checks import check_budget, check_flag, check_int, check_number
from nanollm.policy import CachePolicy, Needs, StepContext
from nanollm.storage import LayerKV

PRIME = 2_147_483_647          # 2^31 - 1, modulus of the universal hashes
REBUILD_CHUNK = 512            # vague positions rebuilt at a time on a CPU (Algorithm 4): their r rows of
                               # gathered cells stay in its cache instead of making r copies of the context


def lower_median(x: Tensor) -> Tensor:
    """(r, ...) -> (...): the element-wise median over dim 0, the lower of the two middle values for an even r
    (as ``torch.median``), by sorting the r rows with element-wise min / max (odd-even transposition: r rounds
    of compare-exchange), ~20x faster than ``median``. For the paper's r = 3, the middle of three directly:
    max(min(a, b), min(max(a, b), c)), 4 element-wise passes. A median only selects: no rounding either way."""
    if x.shape[0] == 3:
        a, b, c = x.unbind(0)
        return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))
    rows = list(x.unbind(0))
    for i in range(len(rows)):
        for j in range(i % 2, len(rows) - 1, 2):
            rows[j], rows[j + 1] = torch.minimum(rows[j], rows[j + 1]), torch.maximum(rows[j], rows[j + 1])
    return rows[(len(rows) - 1) // 2]


class VagueSketch:
    """A count sketch of whole tokens for one sequence and layer (Yuan et al., arXiv 2512.17917, Algorithms
    1-2), batched over tokens.

    cells: key, value (r, b, H_kv, d), fp32 (sums of many tokens). Tokens are identified by position J.
    (``fastpath/sketch.py`` runs insert and query on the Triton kernels of ``kernels/count_sketch.py``.)
    """

    def __init__(self, rows: int, width: int, n_kv_head: int, head_dim: int, seed: int, injective: bool = False,
                 device=None) -> None:
        if width < 1:
            raise ValueError(f"a sketch needs at least one cell per row, got width {width}")
        self.rows, self.width, self.injective = rows, width, injective
        self.key = torch.zeros(rows, width, n_kv_head, head_dim, device=device)
        self.value = torch.zeros_like(self.key)
        g = torch.Generator().manual_seed(seed)
        self.coef = torch.randint(1, PRIME, (4, rows, 1), generator=g).to(device)   # a, c (bucket); a', c' (sign)
        self.covered = 0                    # positions below it are hashed once, in the tables (``cover``)
        self.cell_table = self.sign_table = None

    def buckets(self, pos: Tensor) -> Tensor:
        """h_i(J) for every row i: pos (n,) -> (r, n)."""
        J = pos.view(1, -1).long()
        if self.injective:
            return J.expand(self.rows, -1)
        if self.covered:        # the caller promised every J < covered (else an IndexError; on a GPU, an assert)
            return self.cell_table.index_select(1, J[0])
        return self.hash_cells(J)

    def signs(self, pos: Tensor) -> Tensor:
        """g_i(J) in {+1, -1}: (n,) -> (r, n)."""
        J = pos.view(1, -1).long()
        if self.injective:
            return torch.ones(self.rows, J.shape[1], device=J.device)
        if self.covered:
            return self.sign_table.index_select(1, J[0])
        return self.hash_signs(J)

    def hash_cells(self, J: Tensor) -> Tensor:
        """The bucket hash h_i(J) = ((a_i J + c_i) mod p) mod b: J (1, n) int64 -> (r, n)."""
        return (self.coef[0] * J + self.coef[1]) % PRIME % self.width

    def hash_signs(self, J: Tensor) -> Tensor:
        """The sign hash g_i(J) = 1 - 2 (((a'_i J + c'_i) mod p) mod 2): J (1, n) int64 -> (r, n) of +-1."""
        return 1.0 - 2.0 * ((self.coef[2] * J + self.coef[3]) % PRIME % 2).float()

    def cover(self, n: int) -> None:
        """Hash every position below ``n`` once, into tables that ``buckets`` and ``signs`` then read: one
        lookup each instead of 4 and 7 operations (on a GPU each is a kernel launch, and a decode step hashes
        every evicted position again to rebuild it). The caller promises to ask for no position at or above
        ``n`` until it covers more: ``n`` is a count the host knows (positions seen), so no host wait. The
        tables grow by doubling; their values are the formulas', so nothing else changes. They are not counted
        in the method's memory (``slot_nbytes``, ``extra_nbytes``): like RoPE's angles, a cache of a function of
        the position, which a fused kernel could compute from the four coefficients instead."""
        if self.injective or n <= self.covered:
            return
        J = torch.arange(max(n, 2 * self.covered, 256), device=self.coef.device).view(1, -1)
        self.cell_table, self.sign_table = self.hash_cells(J), self.hash_signs(J)   # (r, n) each
        self.covered = J.shape[1]

    def insert(self, pos: Tensor, k: Tensor, v: Tensor, sign: float = 1.0) -> None:
        """Algorithm 1: add tokens at positions pos (n,) with k, v (n, H_kv, d) to every row (sign -1:
        subtract): cell[i, h_i(J)].key += k_J, cell[i, h_i(J)].value += g_i(J) v_J for every row i. Tokens
        that share a cell are all summed into it."""
        # BEGIN SOLUTION [kvreviver:insert] KVReviver Algorithm 1 (a count sketch, Charikar et al. 2002), every row
        cells, signs = self.buckets(pos), self.signs(pos)                        # (r, n) each
        k, v = sign * k.float(), sign * v.float()                                # (n, H_kv, d)
        (r, n), (H_kv, d) = cells.shape, self.key.shape[2:]
        flat = (-1, H_kv, d)                                                     # the cells as (r * b) rows
        rows = torch.arange(self.rows, device=cells.device).view(-1, 1)
        idx = (rows * self.width + cells.long()).reshape(-1)                     # (r * n,): row i's cell c
        g = signs.to(self.value.dtype)[..., None, None]                          # (r, n, 1, 1): g_i(J)
        k_rows = k.to(self.key.dtype).unsqueeze(0).expand(r, n, H_kv, d)        # (r, n, H_kv, d): k_J
        v_rows = v.to(self.value.dtype).unsqueeze(0) * g                         # (r, n, H_kv, d): g_i(J) v_J
        # index_add_ sums every token sent to a cell (an indexed += would keep only one of them)
        self.key.view(flat).index_add_(0, idx, k_rows.reshape(flat))
        self.value.view(flat).index_add_(0, idx, v_rows.reshape(flat))
        # END SOLUTION

    def query(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Algorithm 2: estimates (n, H_kv, d) of k and v, the element-wise median over the r rows:
        k^_J = median_i cell[i, h_i(J)].key, v^_J = median_i g_i(J) cell[i, h_i(J)].value; for an even r the
        lower of the two middle values (as ``torch.median``)."""
        # BEGIN SOLUTION [kvreviver:query] KVReviver Algorithm 2: the count sketch's estimate, a median over rows
        cells, signs = self.buckets(pos), self.signs(pos)                        # (r, n) each
        (r, n), (H_kv, d) = cells.shape, self.key.shape[2:]
        flat = (-1, H_kv, d)                                                     # the cells as (r * b) rows
        rows = torch.arange(self.rows, device=cells.device).view(-1, 1)
        idx = (rows * self.width + cells.long()).reshape(-1)                     # (r * n,): row i's cell c
        g = signs.to(self.value.dtype)[..., None, None]                          # (r, n, 1, 1): g_i(J)
        k = self.key.reshape(flat).index_select(0, idx).view(r, n, H_kv, d)     # (r, n, H_kv, d): cells
        v = self.value.reshape(flat).index_select(0, idx).view(r, n, H_kv, d) * g   # signed cells
        return lower_median(k), lower_median(v)                                  # the lower median for even r
        # END SOLUTION

    def delete(self, pos: Tensor, k: Tensor, v: Tensor) -> None:
        """Remove tokens by subtracting what is known of them (in a swap: their estimates)."""
        self.insert(pos, k, v, sign=-1.0)

    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes


def c_first(scores: Tensor, recent: Tensor) -> Tensor:
    """(..., T) the slots of C by ascending score (ties by slot, NaN last, as a stable sort leaves them), then
    R's slots (``recent``, (..., T) bool), row by row: C's order without picking its slots out, which would
    make the host wait."""
    order = scores.argsort(dim=-1, stable=True)
    return order.gather(-1, recent.gather(-1, order).to(torch.uint8).argsort(dim=-1, stable=True))


def overflow_slots(scores: Tensor, recent: Tensor, n_out: int) -> tuple[Tensor, Tensor]:
    """Algorithm 3's C -> V overflow, row by row: of the raw slots scored ``scores`` (..., T), the ``n_out``
    lowest of C (slots not ``recent``) leave for the sketch. Returns the leaving slots (..., n_out) and the
    staying ones (..., T - n_out), ascending. (One rule for every caller: the policy's one sequence and
    group at a time, the fast path's every layer at once.)"""
    order = c_first(scores, recent)
    return order[..., :n_out], order[..., n_out:].sort(dim=-1).values


def swap_test(scores: Tensor, p: Tensor, recent_from: int, rate: float) -> Tensor:
    """The swap loop's first test, row by row: does V's best score beat C's lowest by ``rate``? scores
    (..., N) by position, p (..., T) the raw slots' positions (R: from ``recent_from`` on) -> (...) bool.
    NaN as the loop's comparisons rank it: V's NaN first (its max is NaN: no swap), C's NaN after every
    number (an empty C: +inf)."""
    inf = float("inf")
    s_raw = scores.gather(-1, p).nan_to_num(nan=inf, posinf=inf, neginf=-inf)   # (..., T) by slot
    c_low = s_raw.masked_fill(p >= recent_from, inf).amin(dim=-1)
    v_best = scores.scatter(-1, p, -inf).amax(dim=-1)                            # a raw position is not in V
    return c_low * rate < v_best


class Split(NamedTuple):
    """How one layer's slot budget is shared out: b cells per sketch row, C's and R's budgets, R's slack."""
    budget: int
    width: int
    candidate: int
    raw: int
    recent: int
    slack: int


@dataclass
class KVReviverPolicy(CachePolicy):
    """Recent / Candidate raw slots + a count sketch of everything else, rebuilt before every attention.

    Parameters
    ----------
    budget : slots per layer (per KV head): raw tokens + sketch cells.
    rows : sketch rows r (the paper fixes 3).
    vague_share, candidate_share : shares of ``budget`` for the sketch cells and C (0.1, 0.45; Tables
        2-3); R gets the rest, minus ``slack``.
    replace_rate : hysteresis of the swap between C and V (1.1).
    recent_slack : Algorithm 3's Slack, tokens R may exceed its budget by before moving its oldest into C
        in one go (not given in the paper; ours: 0).
    sketch_width : b, cells per row, given explicitly: the cells then come *on top of* ``budget`` (for
        experiments on the sketch alone); None = floor(vague_share * budget / rows), taken from the budget.
    injective_hash : h_i(J) = J (exact reconstruction if b > every position; for tests).
    seed : seed of the hashes (each layer uses seed + layer).
    per_kv_head : each KV head keeps its own C and its own sketch, chosen by its own scores (see the module
        docstring, "Granularity"); False = one selection per layer, shared by the KV heads (the paper's).
    layer_budgets : one budget per layer, used instead of ``budget`` in each (split the same way); None = the
        same ``budget`` everywhere. The appendix ("Fisher Information") allocates the layers' budgets by the
        Fisher information of W_K and W_V: ``fisher_layer_budgets`` computes such a tuple.
    """

    budget: int
    rows: int = 3                    # the paper's r
    vague_share: float = 0.10        # Table 2
    candidate_share: float = 0.45    # Table 3 (equal split with Recent)
    replace_rate: float = 1.1        # parameter settings: insensitive in [1.0, 1.5]
    recent_slack: int = 0            # Algorithm 3's Slack; not given in the paper
    sketch_width: int | None = None
    injective_hash: bool = False
    seed: int = 0
    per_kv_head: bool = False
    layer_budgets: tuple[int, ...] | None = None
    # per-layer state: dense scores by position, (B, N) shared or (B, H_kv, N) per KV head; R size; the
    # sketches (B * S, see ``groups``); revived flags (as the scores); peak rebuilt bytes
    _scores: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _recent: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _sketch: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _approx: dict = field(default_factory=dict, init=False, repr=False, compare=False)   # revived, bool
    # per layer: the buffers (scores, revived) that _scores and _approx view, with room for later positions
    # (so a table read at one step is updated in place by the next: clone it to keep it)
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # per layer, at the end of its last compression: (positions seen, raw slots kept), so that the host knows
    # how many positions the next rebuild covers without reading the device (a GPU would make it wait)
    _compressed_at: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    rebuilt_nbytes: int = field(default=0, init=False, repr=False, compare=False)
    sketch_class: ClassVar[type] = VagueSketch       # a subclass's own; ``use_sketch`` sets one per policy
    swaps: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_int("rows", self.rows)
        check_int("recent_slack", self.recent_slack, low=0)
        check_int("seed", self.seed, low=0)
        for name in ("vague_share", "candidate_share"):
            check_number(name, getattr(self, name), 0, 1)
        if self.vague_share + self.candidate_share > 1.0:
            raise ValueError("vague_share + candidate_share must be <= 1, got "
                             f"{self.vague_share + self.candidate_share}")
        check_number("replace_rate", self.replace_rate, 1)
        if self.sketch_width is not None:
            check_int("sketch_width", self.sketch_width, low=0, what=" or None")
        check_flag("injective_hash", self.injective_hash)
        check_flag("per_kv_head", self.per_kv_head)
        if self.layer_budgets is not None:
            if isinstance(self.layer_budgets, (str, bytes)) or not hasattr(self.layer_budgets, "__len__") \
                    or len(self.layer_budgets) == 0:
                raise ValueError(f"layer_budgets must be a list of budgets, one per layer, got {self.layer_budgets!r}")
            self.layer_budgets = tuple(self.layer_budgets)
            for b in self.layer_budgets:
                check_budget(b)
        for budget in (self.budget,) + (self.layer_budgets or ()):
            split = self.split(budget)
            if split.raw - split.candidate < 1:
                raise ValueError(f"budget {budget} leaves no room for Recent after Candidate ({split.candidate}) "
                                 f"and the sketch ({self.rows} x {split.width}); raise budget or lower "
                                 "candidate_share / vague_share / sketch_width")

    def use_sketch(self, sketch_class: type) -> None:
        """Build this policy's sketches as ``sketch_class`` (``VagueSketch``'s constructor and methods), as
        ``fastpath/sketch.py`` puts in the Triton kernels' one; before the first compression only."""
        if self._sketch:
            raise RuntimeError("use_sketch: the policy has made its sketches already (call it before it runs)")
        self.sketch_class = sketch_class

    # -- the split of the slot budget -----------------------------------------------------------------
    def split(self, budget: int) -> Split:
        """The split of ``budget`` slots: b = floor(vague_share * budget / r) cells per row (or ``sketch_width``,
        then on top of the budget, an experiment knob), C = floor(candidate_share * budget), the raw slots
        (budget minus the cells), and R.budget: the raw slots C leaves, minus the slack (the slack is cut at
        tiny budgets so R >= 1)."""
        width = self.sketch_width if self.sketch_width is not None else int(self.vague_share * budget) // self.rows
        candidate = int(self.candidate_share * budget)
        raw = budget - (self.rows * width if self.sketch_width is None else 0)
        recent = max(1, raw - candidate - self.recent_slack)
        return Split(budget, width, candidate, raw, recent, raw - candidate - recent)

    def layer_split(self, layer: int) -> Split:
        """The split of ``layer``'s budget: ``budget``, or its entry of ``layer_budgets``."""
        if self.layer_budgets is None:
            return self.split(self.budget)
        if layer >= len(self.layer_budgets):
            raise ValueError(f"layer_budgets has {len(self.layer_budgets)} entries, the model has more layers "
                             f"(layer {layer}); give one budget per layer")
        return self.split(self.layer_budgets[layer])

    @property
    def width(self) -> int:
        """b, cells per sketch row (of ``budget``; a layer's own: ``layer_split(layer).width``)."""
        return self.split(self.budget).width

    @property
    def candidate_budget(self) -> int:
        return self.split(self.budget).candidate

    @property
    def raw_budget(self) -> int:
        """Raw slots (R + its slack + C): the budget minus the sketch cells (unless ``sketch_width`` was given:
        then the cells come on top, an experiment knob)."""
        return self.split(self.budget).raw

    @property
    def recent_budget(self) -> int:
        """R.budget: the raw slots C leaves, minus the slack (the slack is cut at tiny budgets so R >= 1)."""
        return self.split(self.budget).recent

    @property
    def slack_in_effect(self) -> int:
        return self.split(self.budget).slack

    # -- selection groups: the KV heads that share R, C and V ------------------------------------------
    def groups(self, n_kv_head: int) -> int:
        """S, the selection groups of a layer: 1 (every KV head shares R, C and V) or H_kv (``per_kv_head``).
        Group s holds the H_kv / S consecutive KV heads s * H_kv / S, ...; its sketch of sequence b is
        ``_sketch[layer][b * S + s]``."""
        return n_kv_head if self.per_kv_head else 1

    @staticmethod
    def by_group(table: Tensor) -> Tensor:
        """A per-position table, (B, N) shared or (B, H_kv, N) per KV head, as a (B, S, N) view: writes
        into the view reach the table."""
        return table if table.dim() == 3 else table.unsqueeze(1)

    # -- Algorithm 4: rebuild the layer's cache for the attention --------------------------------------
    def attend_kv(self, layer: int, store: LayerKV) -> LayerKV:
        sketches = self._sketch.get(layer)
        if not sketches:                                # nothing in a sketch: the storage is the whole cache
            return store
        B, H_kv, _, d = store.k.shape
        S = self.groups(H_kv)
        G = H_kv // S                                   # KV heads per group
        seen_then, kept_then = self._compressed_at[layer]
        seen = seen_then + store.n - kept_then          # positions 0..seen-1: those appended since, included
        for sketch in sketches:
            sketch.cover(seen)                          # hash tables for every position asked below
        raw_pos = store.pos[:, ::G]                     # (B, S, T) each group's raw positions (its first head's)
        in_v = torch.ones(B, S, seen, dtype=torch.uint8, device=store.pos.device)
        in_v.scatter_(2, raw_pos, 0)                                             # (B, S, N) 1: not in R or C
        # (B, S, n_V) V's positions, ascending: a stable sort puts them first (no host wait, as a mask's
        # index would make: the host knows there are seen - T)
        vague = in_v.argsort(dim=-1, descending=True, stable=True)[..., :seen - store.n]
        # every position 0..N-1 is raw or vague exactly once per head: write each entry at its position's slot
        k = store.k.new_empty(B, H_kv, seen, d)
        v = store.v.new_empty(B, H_kv, seen, store.v.shape[-1])
        for b in range(B):
            for s in range(S):
                heads = slice(s * G, (s + 1) * G)
                k[b, heads].index_copy_(1, raw_pos[b, s], store.k[b, heads])    # raw entries, as stored
                v[b, heads].index_copy_(1, raw_pos[b, s], store.v[b, heads])
                chunks = vague[b, s].split(REBUILD_CHUNK) if k.is_cpu else [vague[b, s]]   # on a GPU: at once
                for part in chunks:                                              # rebuilt entries
                    k_hat, v_hat = sketches[b * S + s].query(part)              # (n, G, d) each
                    k[b, heads].index_copy_(1, part, k_hat.transpose(0, 1).to(k.dtype))
                    v[b, heads].index_copy_(1, part, v_hat.transpose(0, 1).to(v.dtype))
        pos = torch.arange(seen, device=in_v.device).expand(B, H_kv, seen)
        rebuilt = LayerKV(k, v, pos)                    # every position 0..seen-1 once, in order
        self.rebuilt_nbytes = max(self.rebuilt_nbytes, rebuilt.nbytes())
        return rebuilt

    # -- scores and Algorithm 3 -------------------------------------------------------------------------
    def _accumulate(self, ctx: StepContext) -> None:
        """Add the attention every position received in this step, over the query rows and all query heads
        (or, ``per_kv_head``, each KV head's G query heads)."""
        B, H = ctx.q.shape[:2]
        H_kv = ctx.kv.pos.shape[1]
        lead = (B, H_kv) if self.per_kv_head else (B,)                           # a table's leading axes
        if ctx.phase == "prefill":                     # a new sequence: fresh scores, no sketch yet
            self._tables[ctx.layer] = (torch.zeros(*lead, ctx.seen, device=ctx.q.device),
                                       torch.zeros(*lead, ctx.seen, dtype=torch.bool, device=ctx.q.device))
            self._recent[ctx.layer] = 0
            self._sketch.pop(ctx.layer, None)
        elif ctx.seen > self._tables[ctx.layer][0].shape[-1]:   # full: twice the room, new positions at 0
            self._tables[ctx.layer] = tuple(torch.cat([t, t.new_zeros(*lead, max(ctx.seen, 2 * t.shape[-1])
                                                                       - t.shape[-1])], dim=-1)
                                            for t in self._tables[ctx.layer])
        # the tables by position 0..seen-1: views of the buffers, whose positions past seen are still 0 (a step
        # adds a position without copying the tables: on a GPU a cat and a fill, two launches, per layer)
        scores, approx = self._tables[ctx.layer]
        self._scores[ctx.layer], self._approx[ctx.layer] = scores[..., :ctx.seen], approx[..., :ctx.seen]
        attended = ctx.attended_pos if ctx.attended_pos is not None else ctx.kv.pos   # (B, H_kv, T_att)
        if self.per_kv_head:                                                     # (B, H_kv, T_att) per group
            received = ctx.col_sums.reshape(B, H_kv, H // H_kv, -1).sum(dim=2)
            self._scores[ctx.layer].scatter_add_(2, attended, received)
        else:                                                                    # (B, T_att) over all heads
            received = ctx.col_sums.sum(dim=1)
            self._scores[ctx.layer].scatter_add_(1, attended[:, 0], received)

    def needs(self, phase: str) -> Needs:
        """Column sums at every step: the attention every position received (the score of Algorithm 3)."""
        return Needs(col_sums=True)

    def on_prefill(self, ctx: StepContext) -> None:
        self._accumulate(ctx)
        self._compress(ctx)

    def on_decode(self, ctx: StepContext) -> None:
        self._accumulate(ctx)
        self._compress(ctx)

    def _compress(self, ctx: StepContext) -> None:
        """Algorithm 3 for every sequence of the batch and selection group: R.push, R -> C overflow, C -> V
        overflow, swaps."""
        layer, store = ctx.layer, ctx.kv
        split = self.layer_split(layer)                                          # this layer's budgets
        self._recent[layer] += ctx.q.shape[2]                                    # R.Push(new tokens)
        if ctx.seen <= split.budget and layer not in self._sketch:               # every token fits raw
            return
        if self._recent[layer] > split.recent + split.slack:                     # R overflows into C
            self._recent[layer] = split.recent
        B, H_kv, T, d = store.k.shape
        S = self.groups(H_kv)
        G = H_kv // S                                                            # KV heads per group
        if layer not in self._sketch:                   # first compression: one sketch per sequence and group
            self._sketch[layer] = [self.sketch_class(self.rows, split.width, G, d, self.seed + layer,
                                                   self.injective_hash, store.k.device)
                                   for _ in range(B * S)] if split.width > 0 else []   # no cells: V forgets
        for sketch in self._sketch[layer]:
            sketch.cover(ctx.seen)                                               # hash tables (positions < seen)
        recent_from = ctx.seen - self._recent[layer]                             # R = positions >= this
        # every position from recent_from on is raw (R: appended, never moved), so C holds the other T - R
        n_out = T - self._recent[layer] - split.candidate                        # same in every row, head
        scores, approx = self.by_group(self._scores[layer]), self.by_group(self._approx[layer])   # (B, S, N)
        new_k, new_v, new_pos = [], [], []
        for b in range(B):
            for s in range(S):
                heads = slice(s * G, (s + 1) * G)
                sketch = self._sketch[layer][b * S + s] if self._sketch[layer] else None
                k, v, p = store.k[b, heads], store.v[b, heads], store.pos[b, s * G]   # (G, T, d), (T,)
                k, v, p = self._overflow(sketch, scores[b, s], k, v, p, recent_from, n_out)
                if sketch is not None:
                    k, v, p = self._swap(sketch, scores[b, s], k, v, p, recent_from, approx[b, s],
                                         split.candidate)
                new_k.append(k), new_v.append(v), new_pos.append(p.expand(G, -1))
        T_new = new_pos[0].shape[-1]                                             # the same in every group
        # buffers of one slot more (its position -1; its k and v unset, written by the next append before any
        # read): the next step's new entry goes there, in place, not into buffers of twice the size with every
        # entry copied over (``LayerKV.append``)
        k = store.k.new_empty(B * S, G, T_new + 1, d)
        v = store.v.new_empty(B * S, G, T_new + 1, store.v.shape[-1])
        p = store.pos.new_full((B * S, G, T_new + 1), -1)
        for buffer, parts in ((k, new_k), (v, new_v), (p, new_pos)):
            buffer[:, :, :T_new] = parts[0] if len(parts) == 1 else torch.stack(parts)
        store.replace(k.view(B, H_kv, T_new + 1, d), v.view(B, H_kv, T_new + 1, -1), p.view(B, H_kv, T_new + 1),
                      n=T_new)
        self._compressed_at[layer] = (ctx.seen, T_new)

    def _overflow(self, sketch: VagueSketch | None, scores: Tensor, k: Tensor, v: Tensor, p: Tensor,
                  recent_from: int, n_out: int) -> tuple[Tensor, Tensor, Tensor]:
        """C -> V for one sequence and group: the ``n_out`` lowest-scored tokens of C (slots before
        ``recent_from``) go into the sketch (none: forgotten). scores (N,) by position; k, v (G, T, d);
        p (T,). Returns the kept entries, in their order (those given when ``n_out <= 0``)."""
        if n_out <= 0:
            return k, v, p
        out, kept = overflow_slots(scores[p], p >= recent_from, n_out)           # C's n_out lowest; the rest
        if sketch is not None:
            sketch.insert(p[out], k[:, out].transpose(0, 1), v[:, out].transpose(0, 1))
        return k[:, kept], v[:, kept], p[kept]

    def _swap(self, sketch: VagueSketch, scores: Tensor, k: Tensor, v: Tensor, p: Tensor,
              recent_from: int, approx: Tensor, max_swaps: int) -> tuple[Tensor, Tensor, Tensor]:
        """Algorithm 3's swap loop for one sequence, its decisions taken at once. The loop revives V's best
        token while its score beats C's minimum by ``replace_rate``, C's minimum going into the sketch in
        exchange, at most ``max_swaps`` (C's budget) times. Each swap takes the next of C's lowest and the next
        of V's highest, and once a pair fails the loop is over (a token just swapped can never win it back, as
        rate >= 1), so the i-th swap pairs C's i-th lowest with V's i-th highest, for the pairs before the first
        that fails. The sketch is then updated swap by swap, as the loop does: a revived token's estimate is
        read after the step's earlier swaps changed the cells it may share with them (a small sketch shares
        many). A NaN score, which a model's attention never gives, is ranked as the loop's comparisons leave
        it: a NaN at the top of V stops the loop at once; C's NaN come after its numbers (``c_first``).
        Returns the entries in position order (those given, untouched, when nothing is swapped)."""
        n_vague = scores.shape[0] - p.shape[0]                                   # every other position
        n = min(max_swaps, p.shape[0], n_vague)
        if n == 0:
            return k, v, p
        # the loop's first test, alone: most steps swap nothing, and this asks 10 operations where the whole
        # decision asks 22 (on a GPU, each a launch)
        if not bool(swap_test(scores, p, recent_from, self.replace_rate)):
            return k, v, p
        in_raw = torch.zeros(scores.shape[0], dtype=torch.uint8, device=p.device)
        in_raw[p] = 1
        vague = in_raw.argsort(stable=True)[:n_vague]                            # V's positions, ascending
        c_order = c_first(scores[p], p >= recent_from)                          # (T,) C ascending, then R
        # a pair with one of R's slots fails (its score +inf), as a pair past C's end did
        c_scores = scores[p][c_order].masked_fill(p[c_order] >= recent_from, float("inf"))
        v_scores, v_order = scores[vague].sort(descending=True, stable=True)   # V descending, by position
        wins = c_scores[:n] * self.replace_rate < v_scores[:n]                  # (n,) each pair's test
        # a prefix: C ascends, V descends (no NaN in V: the test above stopped there), so once a pair fails all do
        m = int(wins.sum())
        if m == 0:
            return k, v, p                                                       # the first pair fails
        c, j = c_order[:m], vague[v_order[:m]]                                   # (m,) C's slots, V's positions
        k, v, p = k.clone(), v.clone(), p.clone()
        self._exchange(sketch, c, j, k, v, p)
        approx[j] = True                                                         # a view of the table, in place
        self.swaps += m
        order = p.argsort()                                                      # back to position order
        return k[:, order], v[:, order], p[order]

    def _exchange(self, sketch: VagueSketch, c: Tensor, j: Tensor, k: Tensor, v: Tensor, p: Tensor) -> None:
        """The sketch side of m swaps, in place on k, v (G, T, d) and p (T,): C's slots c (m,) go into the
        sketch and V's positions j (m,) come out as estimates into those slots, one swap after the other as
        the loop of Algorithm 3 reads: the i-th estimate after the first i - 1 swaps changed the cells.
        (The paper notes that its code replaces the loops by tensor operations; the ablation ``SwapsAtOnce``
        reads every estimate before the step's swaps.)"""
        for ci, ji in zip(c.view(-1, 1), j.view(-1, 1)):
            jk, jv = sketch.query(ji)                                            # (1, G, d) estimates
            sketch.delete(ji, jk, jv)                                            # the residuals stay as noise
            sketch.insert(p[ci], k[:, ci].transpose(0, 1), v[:, ci].transpose(0, 1))
            k[:, ci], v[:, ci], p[ci] = jk.transpose(0, 1).to(k.dtype), jv.transpose(0, 1).to(v.dtype), ji

    # -- bookkeeping and the contract --------------------------------------------------------------------
    def exact_positions(self, layer: int, store: LayerKV) -> Tensor:
        """Stored positions, -1 for revived tokens (their raw slot holds the sketch's estimate)."""
        if layer not in self._approx:
            return store.pos
        G = store.pos.shape[1] // self.groups(store.pos.shape[1])                       # KV heads per group
        table, p = self.by_group(self._approx[layer]), store.pos[:, ::G]               # (B, S, N), (B, S, T)
        N = table.shape[-1]
        approx = table.gather(2, p.clamp(0, N - 1)) & (p >= 0) & (p < N)               # (B, S, T)
        return store.pos.masked_fill(approx.repeat_interleave(G, dim=1), -1)   # tokens newer than the table: raw

    def reset(self) -> None:
        self._scores, self._recent, self._sketch, self._approx, self._compressed_at = {}, {}, {}, {}, {}
        self._tables = {}
        self.rebuilt_nbytes, self.swaps = 0, 0

    def slot_nbytes(self) -> int:
        """Bytes of the sketch cells: they stand in for stored tokens, so they count with the K/V bytes."""
        return sum(s.nbytes() for sketches in self._sketch.values() for s in sketches)

    def extra_nbytes(self) -> int:
        """Bytes of the dense per-token score tables (one float per position seen, per layer and sequence)."""
        return sum(s.nbytes for s in self._scores.values())

    def protected_positions(self, n_prompt: int, seen: int) -> list[int]:
        """The Recent part: at least the ``recent_budget`` newest positions stay raw (with ``layer_budgets``,
        the smallest layer's)."""
        recent = min(self.split(b).recent for b in self.layer_budgets or (self.budget,))
        return list(range(max(0, seen - recent), seen))

    def parts(self, layer: int, store: LayerKV, row: int = 0, head: int = 0) -> dict:
        """Sizes of R and C (raw slots), V (tokens held only by the sketch) and the sketch cells of one layer
        and KV head (per head, cells of that head)."""
        seen = self._scores[layer].shape[-1]
        raw = store.pos[row, head]
        recent_from = seen - self._recent[layer]
        cells = self.rows * self.layer_split(layer).width if self._sketch.get(layer) else 0
        return {"R": int((raw >= recent_from).sum()), "C": int((raw < recent_from).sum()),
                "V": seen - raw.numel(), "cells": cells}


# -- the appendix's per-layer budgets ----------------------------------------------------------------------
def fisher_information(model, ids: Tensor, chunk: int = 128) -> list[float]:
    """Per layer, the empirical Fisher information of W_K and W_V, summed (Yuan et al., appendix "Fisher
    Information": a layer's is the sum of its key and value weight matrices'; the formula is not given).

    Our reading, Palu's recipe that the appendix cites: split ``ids`` (T,) into chunks of ``chunk`` tokens; for
    each chunk take the gradient of its mean next-token negative log-likelihood with respect to W_K and W_V,
    square it entry by entry and add over chunks and entries:  F_l = sum_chunks (||dL/dW_K,l||^2 +
    ||dL/dW_V,l||^2). Deterministic (no sampling, no dropout); the model's weights are left as they were."""
    ids = ids.view(-1)
    if ids.numel() < 2:
        raise ValueError(f"Fisher information needs at least 2 tokens of calibration text, got {ids.numel()}")
    weights = [(block.attn.k_proj.weight, block.attn.v_proj.weight) for block in model.blocks]
    was_training, flags = model.training, [p.requires_grad for p in model.parameters()]
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    for wk, wv in weights:
        wk.requires_grad_(True), wv.requires_grad_(True)
    fisher = torch.zeros(len(weights), dtype=torch.float64)
    try:
        with torch.enable_grad():
            for start in range(0, ids.numel() - 1, chunk):
                piece = ids[start:start + chunk + 1].view(1, -1)                 # (1, <= chunk + 1)
                if piece.shape[1] < 2:
                    break
                logits = model(piece[:, :-1])                                    # (1, T, vocab)
                loss = torch.nn.functional.cross_entropy(logits[0].float(), piece[0, 1:])
                grads = torch.autograd.grad(loss, [w for pair in weights for w in pair])
                for layer in range(len(weights)):
                    gk, gv = grads[2 * layer], grads[2 * layer + 1]
                    fisher[layer] += float(gk.double().pow(2).sum() + gv.double().pow(2).sum())
    finally:
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)
        model.train(was_training)
    return fisher.tolist()


def allocate(weights: list[float], budget: int, minimum: int = 1) -> tuple[int, ...]:
    """``len(weights) * budget`` slots shared out in proportion to ``weights``, each layer at least
    ``minimum``: the minimums first, the rest by largest remainder (ties to the lower layer), so the budgets
    sum exactly to the uniform total."""
    L = len(weights)
    total, w = L * budget, torch.tensor(weights, dtype=torch.float64)
    if L == 0 or total < L * minimum:
        raise ValueError(f"{L} layers at least {minimum} slots each do not fit in {total} slots")
    if not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"layer weights must be finite, >= 0 and not all 0, got {weights}")
    share = (total - L * minimum) * w / w.sum()                                  # (L,) slots beyond the minimum
    extra = share.floor().long()
    left = (total - L * minimum) - int(extra.sum())                              # < L slots left by the floors
    order = sorted(range(L), key=lambda i: (-(float(share[i]) - int(extra[i])), i))
    for i in order[:left]:
        extra[i] += 1
    return tuple(int(minimum + e) for e in extra)


def fisher_layer_budgets(model, ids: Tensor, budget: int, chunk: int = 128) -> tuple[int, ...]:
    """Per-layer budgets for ``KVReviverPolicy(layer_budgets=...)``: the uniform total ``n_layer * budget``
    shared in proportion to each layer's Fisher information of W_K and W_V on the calibration text ``ids``
    (``fisher_information``), at least 1 slot per layer."""
    check_budget(budget)
    return allocate(fisher_information(model, ids, chunk), budget)
