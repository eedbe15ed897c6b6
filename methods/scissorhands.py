"""
Scissorhands: a fixed-budget cache that drops the tokens whose attention kept falling below average.

Paper: Liu, Desai, Liao, Wang, Xie, Xu, Kyrillidis, Shrivastava, "Scissorhands: Exploiting the Persistence
of Importance Hypothesis for LLM KV Cache Compression at Test Time", NeurIPS 2023,
https://arxiv.org/abs/2305.17118 (persistence of importance: §3.2; the budget cache: §4, Algorithms 1-2;
the error bound: Theorem 4.1, Appendix B.2-B.3, in ``experiments/analysis/scissorhands_theory.py``).

Attention maps repeat, so a token that got less than average attention in most recent steps is unlikely to
matter again. Per layer and KV head, after each step's attention (Algorithm 2), with A_i[j] the mean over the
group's G query heads of the attention query i gives token j:
    low_i[j] = A_i[j] < 1 / (entries query i attended);   I[j] = low flags of token j among the last w queries
    if the cache holds n > B: drop ceil((n - B) / m) * m tokens with the largest I, never one of the r most recent
Defaults w = 400, r = min(10, B - 1), m = 1. Ties, long prompts, GQA: ``methods/README.md``, its choices table;
the counters' ring buffer: its section "How each method is built".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from nanollm.checks import check_budget, check_int, check_number
from nanollm.policy import Needs, ScoringPolicy, StepContext, select_topk

from .rules import DecodeRule, own_hooks

LOW = "scissorhands_low"      # per-slot ring buffer of the last w low/high flags, (B, H_kv, T, w) bool
COUNT = "scissorhands_count"  # per-slot number of low flags in that buffer (the counter I), (B, H_kv, T)
ATTN = "scissorhands_attn"    # per-slot attention of the step's last query (group mean), (B, H_kv, T)
DEFAULT_RECENT = 10           # cold-compress's recent window (methods/README.md)


# ---------------------------------------------------------------------------------------------------------
# The rule, as pure functions

def divided(total: Tensor, n: int) -> Tensor:
    """``total / n`` rounded as one division, eagerly on every device, for fp32 (or fp64) totals. Not written
    so: on CUDA, PyTorch divides by a Python number by multiplying by its reciprocal (as CUDA's ``mean``
    does), which for n = 3 can land an ulp away, enough to flip a flag where the attention is exactly 1/n.
    By a divisor tensor on total's device it divides, there as on a CPU (on a GPU the divisor's fill is a
    launch of its own; compiled, inductor may take the divisor for a constant and multiply again)."""
    return total / torch.full((), n, dtype=total.dtype, device=total.device)


def group_mean(x: Tensor, n_kv_head: int) -> Tensor:
    """(B, H, ...) -> (B, H_kv, ...): the mean over the G query heads that read each KV head (h // G); x itself
    when G = 1. The sum divided by G (``divided``), which rounds alike on every device and in the kernel."""
    B, H = x.shape[:2]
    if H == n_kv_head:                  # one query head per KV head: nothing to average
        return x
    G = H // n_kv_head
    return divided(x.view(B, n_kv_head, G, *x.shape[2:]).sum(dim=2), G)


def low_flags(attn: Tensor, visible: Tensor, threshold: float | None = None) -> Tensor:
    """Which attended tokens were unimportant for each query (Algorithm 2's indicator).

    attn : (B, H_kv, Tn, T) attention of each query over the slots (group mean).
    visible : (B, H_kv, Tn, T) bool, the slots each query attended (valid, not in its future).
    threshold : tau; None = 1 / (slots the query attended), the uniform level: its True entries of ``visible``,
        those with attention 0 too, counted in its own batch row and KV head.
    Returns (B, H_kv, Tn, T) bool: attended and attn < tau. A slot a query did not attend is never low.
    """
    # BEGIN SOLUTION [scissorhands:low_flags] Algorithm 2 (§4): below the uniform level, or below tau if one is given
    if threshold is None:
        threshold = 1.0 / visible.sum(-1, keepdim=True).clamp(min=1)           # (B, H_kv, Tn, 1)
    return visible & (attn < threshold)
    # END SOLUTION


def push_history(history: Tensor, flags: Tensor, q_pos: Tensor) -> None:
    """Write the step's flags into the ring buffer, in place: the flag of the query at position q goes to
    column q % w. Only the last w queries of the step matter (older columns would be overwritten).

    history : (B, H_kv, T, w) bool; flags : (B, H_kv, Tn, T) bool; q_pos : (Tn,) consecutive positions.
    """
    w = history.shape[-1]
    rows = flags[:, :, -w:]                                                    # (B, H_kv, <=w, T)
    if rows.shape[2] == 1:                                                     # a decode step: one column
        history[..., int(q_pos[-1]) % w] = rows[:, :, 0]
    else:
        history[..., q_pos[-w:] % w] = rows.transpose(2, 3)                    # distinct columns


def push_column(history: Tensor, counts: Tensor, flags: Tensor, column: int | Tensor) -> None:
    """A decode step's flags (B, H_kv, T) over one column of the ring buffer, in place, the counters moved by
    the flags in minus the flags that column held (``unimportance`` kept up to date without a sum over w).
    history : (B, H_kv, T, w) bool; counts : (B, H_kv, T) int32; column : the query's position mod w, an int,
    or a tensor of one per row (B,) or for all (1,) (rows of their own, or a counter on the device)."""
    if isinstance(column, int):
        out = history[..., column]                                             # (B, H_kv, T) a view
        counts.sub_(out.int()).add_(flags)
        out.copy_(flags)
    else:
        at = column.view(-1, 1, 1, 1).expand(*history.shape[:3], 1)           # (B, H_kv, T, 1)
        counts.sub_(history.gather(3, at)[..., 0].int()).add_(flags)
        history.scatter_(3, at, flags[..., None])


def unimportance(history: Tensor) -> Tensor:
    """(B, H_kv, T, w) ring buffer -> (B, H_kv, T) long, low flags among the last w queries (the counter I)."""
    return history.sum(-1)


def keep_score(counts: Tensor, attn: Tensor, pos: Tensor) -> Tensor:
    """Higher = keep: fewer low flags first, then the higher attention of the step's last query (Algorithm 2).

    counts : (B, H_kv, T) counters I; attn : (B, H_kv, T) the last query's attention; pos : (B, H_kv, T)
    (-1 = empty slot). Returns (B, H_kv, T) float64, -inf on the empty slots. The order is exactly
    lexicographic, per batch row and KV head (scores compare only within one): slot i ranks above slot j iff
    I_i < I_j, or I_i == I_j and attn_i > attn_j; equal (I, attn) score equal. The r most recent slots are
    protected by the policy, not here. ``select_topk`` ranks a float32 copy, so the order must survive it exactly
    for counters up to w = 400 and T up to a few thousand slots (however close two attentions are).
    """
    # BEGIN SOLUTION [scissorhands:keep_score] Algorithm 2 (§4): counters first, the last query's attention breaks ties
    T = counts.shape[-1]
    a = attn.float().contiguous()
    rank = torch.searchsorted(a.sort(dim=-1).values, a)                        # slots strictly lower: 0..T-1
    score = (rank - counts * T).double()                                       # -I*T + rank: integers
    return score.masked_fill(pos < 0, float("-inf"))
    # END SOLUTION


def n_dropped(n_slots: int, budget: int, drop: int, n_recent: int) -> int:
    """Tokens to drop from a layer holding ``n_slots``: 0 within budget, else m at a time (Algorithm 2),
    as often as needed to get back within ``budget``; m is cut to ``budget - n_recent``."""
    # BEGIN SOLUTION [scissorhands:n_dropped] Algorithm 2 (§4): m at a time, as often as needed; m leaves room for r
    excess = n_slots - budget
    if excess <= 0:
        return 0
    m = min(drop, budget - n_recent)
    return math.ceil(excess / m) * m
    # END SOLUTION


def evict_one(pos: Tensor, counts: Tensor, attn: Tensor, recent_from: int | Tensor) -> Tensor:
    """The slot each head drops at a one-token decode step (m = 1), (B, H_kv, 1): among the held slots before
    ``recent_from`` (an int, or (B, 1, 1) for rows of their own), the most low flags, then the lowest
    attention of the step's last query (NaN last), then the latest position; a few passes, no sort.
    pos, counts, attn : (B, H_kv, T), -1 in pos for an empty slot."""
    # `out`: the slots ruled out so far (each masked tensor op is one launch on a GPU: no `where`, whose
    # scalar is a launch of its own, and no `~`)
    out = (pos < 0) | (pos >= recent_from)                                    # empty or recent: no candidate
    counts = counts.masked_fill(out, -1)                                      # a candidate counts >= 0
    out |= counts != counts.amax(dim=-1, keepdim=True)                        # fewer than the most low flags
    attn = attn.nan_to_num(nan=float("inf")).masked_fill(out, float("inf"))  # NaN: ranked last
    out |= attn != attn.amin(dim=-1, keepdim=True)                            # more than the least attention
    return pos.masked_fill(out, -1).argmax(dim=-1, keepdim=True)              # then the latest position


def scissorhands_keep(counts: Tensor, attn: Tensor, pos: Tensor, seen: int, budget: int, drop: int = 1,
                      n_recent: int = 0) -> Tensor:
    """The whole rule (Algorithm 2) on one layer's tables, counts, attn, pos (B, H_kv, T): idx (B, H_kv, K)
    ascending, K = T - n_dropped(T, ...), the recent window and the best by ``keep_score``."""
    policy = ScissorhandsPolicy(budget, n_recent=n_recent, drop=drop)
    K = pos.shape[-1] - n_dropped(pos.shape[-1], budget, drop, n_recent)
    return select_topk(policy.rank(keep_score(counts, attn, pos), pos, seen), K, pos)


# ---------------------------------------------------------------------------------------------------------
# The policy

@dataclass
class ScissorhandsPolicy(ScoringPolicy):
    """Budget cache (Algorithms 1-2): drop the tokens most often below average attention, m at a time.

    Parameters
    ----------
    budget : B, tokens kept per layer per KV head, the recent window included.
    history_window : w, the number of most recent queries whose flags are counted (400).
    n_recent : r, the most recent tokens that are never dropped; None = min(10, budget - 1). Must be < B.
    drop : m, tokens dropped per compression (1: the cache stays at B once full). Cut to B - r.
    threshold : tau, attention below which a token counts as unimportant; None = 1 / (entries attended).
    """

    budget: int
    history_window: int = 400              # w (cold-compress); see the module docstring
    n_recent: int | None = None            # r: None -> min(10, budget - 1)
    drop: int = 1                          # m: Appendix B.2's setting
    threshold: float | None = None         # tau: None -> uniform level 1 / (entries attended)
    compress_on: ClassVar[tuple[str, ...]] = ("prefill", "decode")   # Algorithm 1: whenever the cache is full

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_int("history_window", self.history_window)
        check_int("drop", self.drop)
        if self.n_recent is None:
            self.n_recent = min(DEFAULT_RECENT, self.budget - 1)
        check_int("n_recent", self.n_recent, 0, high=self.budget - 1,
                  what=" (budget - 1: the recent window must leave room for the tokens the counters choose)")
        if self.threshold is not None:
            check_number("threshold", self.threshold, 0, 1, open_low=True, what=" or None (1 / entries attended)")

    def needs(self, phase: str) -> Needs:
        """The probabilities of the step's last w queries: only their flags stay in the history."""
        return Needs(rows=self.history_window)

    def observe(self, ctx: StepContext) -> None:
        """Push the step's low flags (and keep the last query's attention for the tie-break)."""
        kv, pos = ctx.kv, ctx.kv.pos
        B, H_kv, T = pos.shape
        attn = group_mean(ctx.probs.float(), H_kv)                                   # (B, H_kv, R, T)
        q_pos = ctx.q_pos[-attn.shape[2]:]                                     # (R,) the last R queries
        kp = pos[:, :, None, :]                                                # (B, H_kv, 1, T)
        visible = kp >= 0                                                      # the step's last query sees all
        if len(q_pos) > 1:                                                     # (B, H_kv, R, T): earlier rows
            visible = visible & (kp <= q_pos.view(1, 1, -1, 1))
        if ctx.phase == "prefill":                                             # no history yet
            kv.set_state(LOW, torch.zeros(B, H_kv, T, self.history_window, dtype=torch.bool,
                                          device=pos.device), fill=False)
            kv.set_state(COUNT, torch.zeros(B, H_kv, T, dtype=torch.int32, device=pos.device), fill=0)
            kv.set_state(ATTN, torch.zeros(B, H_kv, T, device=pos.device), fill=0.0)
        w, state = self.history_window, kv.state
        flags = low_flags(attn, visible, self.threshold)[:, :, -w:]           # (B, H_kv, <=w, T)
        if len(q_pos) == 1:                                    # a decode step: one column (the query is at seen - 1)
            push_column(state[LOW], state[COUNT], flags[:, :, 0], (ctx.seen - 1) % w)
        else:
            leaving = state[LOW][..., q_pos[-w:] % w].sum(dim=-1, dtype=torch.int32)   # (B, H_kv, T)
            state[COUNT].add_(flags.sum(dim=2, dtype=torch.int32) - leaving)   # flags in - flags out
            push_history(state[LOW], flags, q_pos)
        state[ATTN].copy_(attn[:, :, -1])                                      # the step's last query

    def score(self, ctx: StepContext) -> Tensor:
        return keep_score(ctx.kv.state[COUNT], ctx.kv.state[ATTN], ctx.kv.pos)

    def evict(self, ctx: StepContext) -> Tensor:
        """A decode step that drops one token per head (m = 1): the most low flags, then the lowest attention
        of the step's last query, then the latest position, in a few passes, without ``keep_score``'s sort."""
        if len(ctx.kv) - self.n_keep(ctx) != 1:
            return super().evict(ctx)
        state = ctx.kv.state
        return evict_one(ctx.kv.pos, state[COUNT], state[ATTN], ctx.seen - self.n_recent)

    def protected(self, n_prompt: int, seen: int) -> list[range]:
        return [range(max(0, seen - self.n_recent), seen)]                    # the n_recent most recent

    def decode_rule(self) -> DecodeRule | str:
        """The decode step's rule for the fast paths (``methods/rules.py``), or why this policy has none."""
        if not self.evicts_in_place or not own_hooks(self, ScissorhandsPolicy, "observe", "evict", "score",
                                                     "protected", "n_keep"):
            return "its class changes Scissorhands' hooks"
        if min(self.drop, self.budget - self.n_recent) != 1:
            return "it drops m > 1 tokens at a time, then none for m - 1 steps (the step handles m = 1)"
        return DecodeRule("scissors", self.budget, n_recent=self.n_recent, window=self.history_window,
                          threshold=self.threshold)

    def n_keep(self, ctx: StepContext) -> int:
        """Entries per head after this step's compression (<= budget; fewer when m > 1)."""
        T = len(ctx.kv)
        return T - n_dropped(T, self.budget, self.drop, self.n_recent)

    def head_budgets(self, ctx: StepContext) -> Tensor:
        B, H_kv, _ = ctx.kv.pos.shape
        return torch.full((B, H_kv), self.n_keep(ctx), dtype=torch.long, device=ctx.kv.pos.device)
