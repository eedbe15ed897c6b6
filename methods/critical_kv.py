"""
Perturbation-constrained selection (CriticalKV): keep the entries whose removal perturbs the attention *output*
least, weighing each entry's attention A_i by its projected value norm P_i = ||V_i W_O||_1.

Paper: Feng, Lv, Cao, Xie, Zhou, "Identify Critical KV Cache in LLM Inference from an Output Perturbation
Perspective", 2025, https://arxiv.org/abs/2502.03805  (masked softmax: Theorem 1, Eq. 6; the bound: Theorem 2,
Eq. 8; two-stage selection: §3.4, Algorithm 1; Assumption 1, Theorem 3: §3.5; inside observation-window methods:
§3.6, Algorithm 2; settings: §4.2). Keeping the entries of a 0/1 mask N bounds the L1 output perturbation by

    theta = C - (2 - 1 / sum_i N_i A_i) * sum_i N_i A_i P_i,      C = sum_i A_i P_i       (Theorem 2, Eq. 8)

Once the kept mass passes 1/2 (Assumption 1) the bound shrinks fastest by keeping the largest A_i P_i (Theorem 3):
Algorithm 1, budget b: S1 = top_{floor(alpha b)}(A), S2 = top_{b - |S1|}(A P) outside S1, keep S1 ∪ S2. As a wrapper
(Algorithm 2) it runs per KV head in its host's budgets after the host's protected entries (SnapKV by default;
``critical_kv(adakv(snapkv))`` = CriticalAdaKV). Defaults: alpha = 0.25 of the free budget (§4.2), stage 2 by the
host's pooled score (``stage2="host"``, the authors' code). The rest: ``methods/README.md``, "How each method is built".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from nanollm.checks import check_budget, check_number, is_int
from nanollm.policy import Needs, ScoringPolicy, StepContext
from nanollm.wrapper import PolicyWrapper

from .adakv import mask_to_indices
from .snapkv import SnapKVPolicy

STAGE2 = ("host", "window")      # stage-2 attention: the host's (pooled) score, or the un-pooled window attention
ALPHA_OF = ("free", "budget")     # alpha's share of the free budget b - |protected|, or of the whole budget b


# ---------------------------------------------------------------------------------------------------------
# The perturbation and its bound (§3.3), for one query: attn (..., n), keep (..., n) bool.

def renormalized_attention(attn: Tensor, keep: Tensor) -> Tensor:
    """Theorem 1 (Eq. 6): the softmax over the kept entries only, A' = N*A / sum_i N_i A_i. (..., n)."""
    # BEGIN SOLUTION [critical_kv:output_perturbation] Theorem 1 (§3.3, Eq. 6): attention renormalised over the kept
    kept = attn * keep
    return kept / kept.sum(-1, keepdim=True)
    # END SOLUTION


def output_perturbation(attn: Tensor, keep: Tensor, projected: Tensor) -> Tensor:
    """Eq. 5: L = ||(A - A') V W_O||_1 for projected values ``projected`` = V W_O (..., n, D). Returns (...)."""
    # BEGIN SOLUTION [critical_kv:output_perturbation] Eq. 5 (§3.3): the L1 norm of the output's change
    diff = attn - renormalized_attention(attn, keep)                       # (..., n)
    return (diff.unsqueeze(-2) @ projected).squeeze(-2).abs().sum(-1)      # (..., D) -> (...)
    # END SOLUTION


def perturbation_bound(attn: Tensor, keep: Tensor, vnorm: Tensor) -> Tensor:
    """Theorem 2 (Eq. 8): theta = C - (2 - 1/sum(N*A)) * sum(N*A*P), C = sum(A*P), P = ||V_i W_O||_1. (...)."""
    # BEGIN SOLUTION [critical_kv:perturbation_bound] Theorem 2 (§3.3), Eq. 8, per row over the last axis
    C = (attn * vnorm).sum(-1)
    kept_mass = (attn * keep).sum(-1)
    return C - (2 - 1 / kept_mass) * (attn * keep * vnorm).sum(-1)
    # END SOLUTION


def assumption1_sigma(attn: Tensor, stage1: Tensor) -> Tensor:
    """Assumption 1: sigma = sum_i N'_i A_i, the attention mass on the stage-1 set. Theorem 3 needs > 0.5."""
    return (attn * stage1).sum(-1)


def projected_values(v: Tensor, w_o: Tensor, head: int, n_head: int) -> Tensor:
    """Query head ``head``'s projected values V W_O^(h) (the rows of Theorem 2's script-V): (B, T, D).

    v : (B, H_kv, T, d) stored values; w_o : (D, H*d) ``o_proj.weight``, whose columns h*d..(h+1)*d are
    head h's, so W_O^(h) = w_o[:, h*d:(h+1)*d]^T, shape (d, D); query head h reads KV head h // (H // H_kv).
    """
    B, H_kv, T, d = v.shape
    w_h = w_o[:, head * d:(head + 1) * d].float()                          # (D, d) = W_O^(h)^T
    return v[:, head // (n_head // H_kv)].float() @ w_h.T                  # (B, T, D)


def projected_value_norms(v: Tensor, w_o: Tensor, n_head: int) -> Tensor:
    """P_h,i = ||v_{h // G, i} W_O^(h)||_1 for every query head h and entry i (Algorithm 1 line 3, per head).

    v : (B, H_kv, T, d) stored values; w_o : (D, H*d) the output projection's weight; n_head : H.
    Returns (B, H, T) float32, computed head by head (never a (B, H, T, D) tensor), as kvpress does.
    """
    norms = [projected_values(v, w_o, h, n_head).abs().sum(-1) for h in range(n_head)]   # each (B, T)
    return torch.stack(norms, dim=1)                                      # (B, H, T)


def projected_output_l1(out_full: Tensor, out: Tensor, w_o: Tensor) -> Tensor:
    """Per-head output perturbation L_h = ||(o_full,h - o_h) W_O^(h)||_1 (Definition 1, Eq. 3) from two
    attention outputs before W_O, (..., H, d) each (e.g. ``harness.Trace.outs[layer]``). Returns (..., H)."""
    *lead, H, d = out.shape
    w = w_o.float().view(w_o.shape[0], H, d)                              # (D, H, d)
    diff = (out_full - out).float()                                       # (..., H, d)
    return torch.einsum("...hd,Dhd->...hD", diff, w).abs().sum(-1)


# ---------------------------------------------------------------------------------------------------------
# Algorithm 1: two-stage selection

def two_stage_masks(first: Tensor, second: Tensor, budgets: Tensor | int, n_first: Tensor | int,
                    valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Algorithm 1's two stages on per-head scores: the top ``n_first`` by ``first``, then the best by
    ``second`` among the rest, ``budgets`` in all.

    Parameters
    ----------
    first : (..., T) stage-1 ranking (attention; +inf = kept first, e.g. a protected window).
    second : (..., T) stage-2 ranking (attention * projected value norm).
    budgets : (...) or int, entries kept per row (capped at the valid entries).
    n_first : (...) or int, entries stage 1 picks, its +inf entries included (capped at ``budgets``).
    valid : (..., T) bool, entries that may be kept (False: empty slots); None = all.

    Returns
    -------
    (stage1, keep) : (..., T) bool each; ``stage1`` is a subset of ``keep``. Scores are ranked in float32 (a
    float64 score rounded first); NaN and -inf scores count as the lowest valid scores (below every finite one,
    above every invalid entry); ties go to the earlier entry (a stable sort), so the result is deterministic.
    """
    # BEGIN SOLUTION [critical_kv:two_stage] §3.4, Algorithm 1: stage 1 by the first ranking, stage 2 by the second
    valid = torch.ones_like(first, dtype=torch.bool) if valid is None else valid
    lead = first.shape[:-1]
    budgets = torch.as_tensor(budgets, device=first.device).expand(lead)
    budgets = torch.minimum(budgets, valid.sum(-1))
    n_first = torch.minimum(torch.as_tensor(n_first, device=first.device).expand(lead), budgets)
    lowest = torch.finfo(torch.float32).min

    def ranking(s: Tensor) -> Tensor:      # valid entries above every empty slot, NaN the lowest valid score
        s = torch.nan_to_num(s.float(), nan=lowest, neginf=lowest)
        return s.masked_fill(~valid, float("-inf"))

    def ranks(scores: Tensor) -> Tensor:   # rank in a stable descending sort (0 = best; ties: earlier first)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        steps = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
        return torch.empty_like(order).scatter_(-1, order, steps)

    stage1 = (ranks(ranking(first)) < n_first[..., None]) & valid                  # stage 1
    s2 = ranking(second).masked_fill(stage1, float("inf"))                          # stage 1 stays first
    keep = (ranks(s2) < budgets[..., None]) & valid                                 # stage 2 fills the rest
    # END SOLUTION
    return stage1, keep


def perturbation_constrained_select(attn: Tensor, vnorm: Tensor, budget: int, alpha: float = 0.25) -> Tensor:
    """Algorithm 1 for one query per row: top floor(alpha * b) by attention, then the rest by A * P.

    Parameters
    ----------
    attn : (..., n) attention weights A.
    vnorm : (..., n) projected value norms P_i = ||V_i W_O||_1 (``projected_value_norms``).
    budget : b, entries kept per row (all if b >= n).
    alpha : stage-1 share (§4.2: 0.25). 1 = attention top-k; 0 = stage 2 only (Appendix D's ablation).

    Returns
    -------
    idx : (..., min(b, n)) kept entries, ascending.
    """
    check_budget(budget)
    b = min(budget, attn.shape[-1])
    _, keep = two_stage_masks(attn, attn * vnorm, b, int(alpha * b))
    return mask_to_indices(keep)


# ---------------------------------------------------------------------------------------------------------
# Algorithm 2: the wrapper

@dataclass
class CriticalKVPolicy(PolicyWrapper):
    """Perturbation-constrained selection inside any host method's per-head budgets (SnapKV by default).

    Parameters
    ----------
    budget : entries kept per layer per KV head (the host decides how they are allocated).
    alpha : share of each head's free budget picked by the host's own ranking (stage 1); the rest is picked
        by attention x projected value norm (stage 2). §4.2: 0.25. 1 = the host alone.
    alpha_of : "free" (alpha of b - |protected|, so alpha = 1 is exactly the host) or "budget" (kvpress:
        stage 1 takes floor(alpha * b) entries counting the protected window, at least the window).
    stage2 : "host" (the host's pooled score as the attention estimate, as the authors' code runs it) or
        "window" (Algorithm 2 line 9 read literally: the un-pooled window attention of the innermost
        observation-window scorer; the host's score when there is none).
    epsilon : added to the stage-2 attention estimate, a per-query mean, before weighting (kvpress: 1e-4;
        the paper: 0).
    inner : the host policy, same ``budget``; None = ``SnapKVPolicy`` with its defaults.
        ``make_policy("critical_kv(adakv(snapkv))", ...)`` is CriticalAdaKV.
    """

    budget: int
    alpha: float = 0.25          # §4.2 (kvpress first_stage_ratio: 0.5)
    alpha_of: str = "free"       # (kvpress: "budget")
    stage2: str = "host"         # Algorithm 2, line 9, as the authors' code reads it ("window": literally)
    epsilon: float = 0.0         # the paper has none (kvpress: 1e-4)
    inner: ScoringPolicy | None = None
    default_inner: ClassVar[str] = "snapkv"
    last: dict = field(default_factory=dict, init=False, repr=False, compare=False)   # diagnostics

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_number("alpha", self.alpha, 0, 1, what=" (stage-1 share of the budget)")
        if self.stage2 not in STAGE2:
            raise ValueError(f"stage2 must be one of {STAGE2}, got {self.stage2!r}")
        if self.alpha_of not in ALPHA_OF:
            raise ValueError(f"alpha_of must be one of {ALPHA_OF}, got {self.alpha_of!r}")
        check_number("epsilon", self.epsilon, 0, float("inf"), open_high=True)
        self.check_inner(lambda: SnapKVPolicy(budget=self.budget))

    @property
    def window(self) -> int | None:
        """The observation window of the innermost scorer (SnapKV's ``window``), None if it has none."""
        w = getattr(self.inner, "window", None)                           # a wrapper reads through to its inner
        return w if is_int(w) else None

    def needs(self, phase: str) -> Needs:
        """The inner policy's needs, plus the window's rows of the attention where stage 2 reads them."""
        needs = self.inner.needs(phase)
        if self.stage2 == "window" and self.window is not None and phase in self.compress_on:
            needs = needs | Needs(rows=self.window)
        return needs

    def window_attention(self, ctx: StepContext) -> Tensor | None:
        """(B, H, T) Abar: the mean attention of the last ``window`` queries (Algorithm 2 line 3, not pooled),
        or None where there is none to read (a host without a window, or probs over rebuilt entries). Stage 2
        uses it when ``stage2="window"``; Assumption 1's sigma is measured on it either way."""
        w = self.window
        if w is None or ctx.probs is None:
            return None
        if ctx.probs.shape[-1] != len(ctx.kv) or (ctx.attended_pos is not None
                                                  and not torch.equal(ctx.attended_pos, ctx.kv.pos)):
            return None                                                    # probs refer to rebuilt entries
        w = min(w, ctx.probs.shape[2])
        return ctx.probs[:, :, -w:, :].float().mean(dim=2)                 # (B, H, T)

    def window_queries(self, ctx: StepContext) -> int:
        """How many queries the host's score sums over: the window's (SnapKV's vote is a sum over them), 1
        for hosts without a window. Dividing by it makes the score a per-query mean, where epsilon is added."""
        w = self.window
        if w is None or ctx.probs is None:
            return 1
        return max(1, min(w, ctx.probs.shape[2], ctx.probs.shape[-1]))

    def stage_scores(self, ctx: StepContext) -> dict:
        """Everything the two stages need, per KV head: ``first`` (B, H_kv, T) the host's ranking with its
        protected entries at +inf, ``second`` (B, H_kv, T) the stage-2 score, ``budgets`` and ``n_first``
        (B, H_kv), ``valid`` (B, H_kv, T) non-empty slots, ``abar`` (B, H, T) the window attention or None."""
        kv = ctx.kv
        B, H_kv, T = kv.pos.shape
        valid = kv.pos >= 0
        host = self.inner.keep_scores(ctx)             # (B, H_kv, T) pooled for SnapKV; protected +inf, empty -inf
        prot = valid & (host == float("inf"))
        budgets = self.inner.head_budgets(ctx)                             # (B, H_kv): b_j
        n_prot = torch.minimum(prot.sum(-1), budgets)
        free = budgets - n_prot                                            # b'_j
        if self.alpha_of == "free":
            n_first = n_prot + torch.floor(self.alpha * free.double()).long()   # keep_j + floor(alpha * b'_j)
        else:
            n_first = torch.maximum(n_prot, torch.floor(self.alpha * budgets.double()).long())   # kvpress

        n_head = ctx.q.shape[1]
        G = n_head // H_kv
        vnorm = projected_value_norms(kv.v, ctx.attn.o_proj.weight, n_head)   # (B, H, T): P
        abar = self.window_attention(ctx)                                  # (B, H, T) or None
        if self.stage2 == "host" or abar is None:   # the host's score as a per-query mean (the authors' code)
            mean_score = host / self.window_queries(ctx)                   # (B, H_kv, T)
            second = (mean_score + self.epsilon) * vnorm.view(B, H_kv, G, T).mean(2)
        else:                      # Algorithm 2 line 9: mean over the group of (Abar_h + eps) * P_h
            second = ((abar + self.epsilon) * vnorm).view(B, H_kv, G, T).mean(2)
        return {"first": host.masked_fill(prot, float("inf")), "second": second, "budgets": budgets,
                "n_first": n_first, "valid": valid, "abar": abar}

    def keep_masks(self, ctx: StepContext) -> tuple[Tensor, Tensor, Tensor | None]:
        """(stage1, keep, abar): stage-1 and kept slots (B, H_kv, T) bool, and the window attention used."""
        s = self.stage_scores(ctx)
        stage1, keep = two_stage_masks(s["first"], s["second"], s["budgets"], s["n_first"], s["valid"])
        return stage1, keep, s["abar"]

    def select(self, ctx: StepContext) -> Tensor:
        """Kept slots (B, H_kv, K), ascending, padded with -1 when the host's head budgets differ."""
        stage1, keep, abar = self.keep_masks(ctx)
        pos = ctx.kv.pos
        sigma = None
        if abar is not None:       # Assumption 1 on the window attention, per query head
            G = abar.shape[1] // pos.shape[1]
            sigma = assumption1_sigma(abar, stage1.repeat_interleave(G, dim=1))   # (B, H)
        self.last[ctx.layer] = {"stage1_pos": pos.masked_fill(~stage1, -1),
                                "stage2_pos": pos.masked_fill(~(keep & ~stage1), -1),
                                "sigma": sigma, "abar": abar}
        return mask_to_indices(keep)

    def reset(self) -> None:
        self.last = {}
        self.inner.reset()
