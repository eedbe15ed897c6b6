"""
KVReviver: evicted tokens go into a count sketch, from which every step rebuilds them for full attention.

Paper: Yuan et al., "KVReviver: Reversible KV Cache Compression with Sketch-Based Token Reconstruction", 2025,
https://arxiv.org/abs/2512.17917  (Recent / Candidate / Vague storage: Algorithm 3; rebuilding the cache:
Algorithm 4; defaults: Tables 2-3).

An evicting method forgets for good. KVReviver keeps, per layer, Recent (R: the newest tokens, raw), Candidate
(C: the highest accumulated attention, raw) and Vague (V: every other token summed into r x b cells of a count
sketch, ``methods/kvreviver_sketch.py``, Algorithms 1-2), and before each attention rebuilds all N positions, raw
from R and C, the sketch's estimate for V (Algorithm 4). Budget = raw slots + cells per layer per KV head, split
0.45 / 0.45 / 0.1 (Tables 2-3); the appendix's per-layer budgets are ``methods/kvreviver_budgets.py``. Algorithm
3's rebalancing, revived tokens, ``per_kv_head`` and ``layer_budgets``: ``methods/README.md``, "How each method
is built"; the paper's open points: its table "Choices where papers and implementations differ".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from methods.kvreviver_sketch import VagueSketch
from nanollm.checks import check_budget, check_flag, check_int, check_number
from nanollm.policy import CachePolicy, Needs, StepContext
from nanollm.storage import LayerKV

REBUILD_CHUNK = 512            # vague positions rebuilt at a time on a CPU (Algorithm 4): their r rows of
                               # gathered cells stay in its cache instead of making r copies of the context


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
    per_kv_head : each KV head keeps its own C and its own sketch, chosen by its own scores (methods/README.md,
        table "Choices ...", row "granularity"); False = one selection per layer, shared by the KV heads (the
        paper's).
    layer_budgets : one budget per layer, used instead of ``budget`` in each (split the same way); None = the
        same ``budget`` everywhere. The appendix ("Fisher Information") allocates the layers' budgets by the
        Fisher information of W_K and W_V: ``methods.kvreviver_budgets`` computes such a tuple.
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
