"""
Scissorhands' theory, made executable: the single-head model of Theorems 3.1 and 4.1, the closed-form
budget bound, its failure probability, the form of the bound before the proof's last simplifications, and
the Monte-Carlo experiment the bound is about. What the code shows: the simulated dropped attention mass
stays below the proof's intermediate form but not below its closed form at moderate budgets, the closed
form turns negative at small budgets, and the failure probability is vacuous unless T_min is very large.

Paper: Liu, Desai, Liao, Wang, Xie, Xu, Kyrillidis, Shrivastava, "Scissorhands: Exploiting the Persistence
of Importance Hypothesis for LLM KV Cache Compression at Test Time", NeurIPS 2023,
https://arxiv.org/abs/2305.17118  (the model: Appendix B.1, eq. (5)-(6); Theorem 4.1 = Theorem B.2 with
its proof in Appendix B.2, eq. (8)-(10); the dropped attention mass: Theorem B.3, eq. (11), Appendix B.3).
The budget cache itself is ``methods/scissorhands.py``; the lab notebooks/labs/02_scissorhands_claims plots this.

The model, the theorem, the intermediate form, why the bound fails and the unit norm: experiments/README.md,
section "analysis/scissorhands_theory.py: Theorem 4.1, executable".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from methods.scissorhands import keep_score, low_flags, push_history, unimportance
from nanollm.policy import select_topk

# ---------------------------------------------------------------------------------------------------------
# The bound (Theorem 4.1 / B.2, Theorem B.3)

def _check(keep: float, k: float, eps: float) -> None:
    if not 0 < eps < 1:
        raise ValueError(f"eps must lie in (0, 1), got {eps!r}")
    if not keep <= 1:
        raise ValueError(f"keep = B / T_max must be at most 1, got {keep!r}")
    if not keep > eps:
        raise ValueError(f"the bound needs keep = B / T_max > eps (the term (1 - eps) / (B/T_max - eps) must be "
                         f"positive), got B / T_max = {keep!r} <= eps = {eps!r}")
    if not k > 2:
        raise ValueError(f"the power-law exponent k must be > 2 (Theorem 4.1), got {k!r}")


def _shape(keep: float, k: float, eps: float) -> float:
    """k - (k - 1) ((1 - eps) / (keep - eps))^(1 / (k - 1)), the factor shared by eq. (11) and Theorem 4.1."""
    return k - (k - 1) * ((1 - eps) / (keep - eps)) ** (1 / (k - 1))


def dropped_mass_bound(keep: float, k: float, eps: float) -> float:
    """Delta_max of Theorem B.3, eq. (11): the closed-form bound on the expected dropped attention mass."""
    _check(keep, k, eps)
    return (1 - keep) / (0.98 * (1 - eps) ** 2) * _shape(keep, k, eps)


def theorem41_bound(keep: float, k: float, eps: float) -> float:
    """Theorem 4.1: the bound on E ||x_t - x~_t|| (2 Delta_max, rounded up to the constant 2.1)."""
    _check(keep, k, eps)
    return 2.1 * (1 - keep) / (1 - eps) ** 2 * _shape(keep, k, eps)


def failure_probability(t_min: int, t_max: int, keep: float, k: float, eps: float, b: float, u: float) -> float:
    """One minus Theorem 4.1's "with probability at least": the union bound's failure terms (can exceed 1,
    then the guarantee says nothing)."""
    _check(keep, k, eps)
    first = t_max * math.exp(-eps ** 2 * b ** 2 * (t_min - 1) / ((k - 2) ** 2 * (u - b) ** 2))
    second = t_max * math.exp(-2 * (t_min - 1) * (1 - keep) ** 2 / (1 - eps) ** 2)
    return first + second


def power_law_mean_factor(k: float, b: float, u: float) -> float:
    """D of Appendix B.3, with E[v] = D / (k - 2) for v ~ c (x + b)^(-k) on [0, u - b]."""
    return (b ** (2 - k) - (k - 1) * u ** (2 - k) + (k - 2) * b * u ** (1 - k)) / (b ** (1 - k) - u ** (1 - k))


def intermediate_dropped_mass_bound(keep: float, k: float, eps: float, b: float, u: float) -> float:
    """The dropped-mass bound of Appendix B.3 before its last two simplifications (see the module doc)."""
    _check(keep, k, eps)
    gamma = b * (((keep - eps) / (1 - eps)) ** (-1 / (k - 1)) - 1)
    return (b * (1 - keep) - (k - 1) * (keep - eps) * gamma) / (power_law_mean_factor(k, b, u) * (1 - eps) ** 2)


# ---------------------------------------------------------------------------------------------------------
# The Monte-Carlo experiment: attention weights from the truncated power law, keep the top B

def sample_power_law(shape, k: float, b: float, u: float, generator: torch.Generator | None = None) -> Tensor:
    """Draws from f(x) = c (x + b)^(-k) on [0, u - b], by the inverse CDF:
    x = (b^(1-k) - U (b^(1-k) - u^(1-k)))^(1/(1-k)) - b,  U ~ Uniform(0, 1). float64."""
    U = torch.rand(shape, generator=generator, dtype=torch.float64)
    return (b ** (1 - k) - U * (b ** (1 - k) - u ** (1 - k))) ** (1 / (1 - k)) - b


def dropped_mass(weights: Tensor, budget: int) -> Tensor:
    """Attention mass outside the top ``budget`` of each row of normalised ``weights`` (..., n)."""
    kept = weights.topk(min(budget, weights.shape[-1]), dim=-1).values.sum(-1)
    return 1 - kept / weights.sum(-1)


def simulate_dropped_mass(keep: float, k: float, b: float, u: float, T: int = 2000, seeds: int = 200,
                          seed: int = 0) -> tuple[float, float]:
    """Mean and standard error, over ``seeds`` draws, of the mass a top-B cache drops at step T: T - 1
    weights beta_j = v_j / sum v, B = round(keep * T) kept (Theorem B.3's setting)."""
    g = torch.Generator().manual_seed(seed)
    lost = dropped_mass(sample_power_law((seeds, T - 1), k, b, u, g), round(keep * T))
    return float(lost.mean()), float(lost.std() / math.sqrt(seeds))


def fit_power_law(v: Tensor, ks: Tensor | None = None, bs: Tensor | None = None) -> tuple[float, float, float]:
    """Maximum-likelihood (k, b, u) of the truncated power law for samples ``v`` >= 0 (grid search over
    k and b, u - b = max(v), the likelihood's maximiser for the upper end). Returns (k, b, u)."""
    v = v.double().flatten()
    ks = torch.linspace(2.05, 12, 200, dtype=torch.float64) if ks is None else ks
    bs = torch.logspace(-4, 1, 120, dtype=torch.float64) * v.mean() if bs is None else bs
    K, Bs = ks.view(-1, 1), bs.view(1, -1)
    U = Bs + v.max()
    log_c = torch.log(K - 1) - torch.log(Bs ** (1 - K) - U ** (1 - K))
    ll = len(v) * log_c - K * torch.log(v.view(-1, 1, 1) + Bs).sum(0)          # (len(ks), len(bs))
    i = int(ll.argmax())
    kk, bb = float(ks[i // len(bs)]), float(bs[i % len(bs)])
    return kk, bb, bb + float(v.max())


# ---------------------------------------------------------------------------------------------------------
# The single-layer, single-head model of eq. (5)-(6)

@dataclass
class ToyModel:
    """Weights of eq. (5)-(6), row-vector convention: W_Q, W_K, W_V (d, p), W_O (p, d), W_1 (d, h), W_2 (h, d)."""
    W_Q: Tensor
    W_K: Tensor
    W_V: Tensor
    W_O: Tensor
    W_1: Tensor
    W_2: Tensor

    def F(self, x: Tensor) -> Tensor:
        """eq. (6): x + relu(x W_1) W_2."""
        return x + torch.relu(x @ self.W_1) @ self.W_2

    def spectral_product(self) -> float:
        """lambda_V lambda_O (1 + lambda_1 lambda_2)(1 + lambda_Q lambda_K): Theorem 4.1 needs <= 1/2."""
        lam = {n: float(torch.linalg.matrix_norm(getattr(self, n), ord=2)) for n in
               ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2")}
        return lam["W_V"] * lam["W_O"] * (1 + lam["W_1"] * lam["W_2"]) * (1 + lam["W_Q"] * lam["W_K"])


def make_toy_model(d: int = 32, p: int = 32, hidden: int = 64, qk_norm: float = 200.0, mlp_norm: float = 1.0,
                   seed: int = 0) -> ToyModel:
    """Gaussian weights rescaled to chosen spectral norms: lambda_Q = lambda_K = sqrt(qk_norm),
    lambda_1 = lambda_2 = sqrt(mlp_norm), and W_V, W_O scaled so that Theorem 4.1's product is exactly 1/2."""
    g = torch.Generator().manual_seed(seed)

    def draw(rows: int, cols: int, norm: float) -> Tensor:
        W = torch.randn(rows, cols, generator=g, dtype=torch.float64)
        return W * (norm / torch.linalg.matrix_norm(W, ord=2))

    vo = math.sqrt(0.5 / ((1 + mlp_norm) * (1 + qk_norm)))
    return ToyModel(draw(d, p, math.sqrt(qk_norm)), draw(d, p, math.sqrt(qk_norm)), draw(d, p, vo), draw(p, d, vo),
                    draw(d, hidden, math.sqrt(mlp_norm)), draw(hidden, d, math.sqrt(mlp_norm)))


def run_toy(model: ToyModel, x0: Tensor, T: int, cache: str = "full", budget: int | None = None,
            history_window: int = 400, n_recent: int = 0, drop: int = 1, threshold: float | None = None,
            normalize: bool = True) -> dict:
    """Generate tokens x_1 .. x_T from the prompt x0 (T0, d) with one of three caches.

    cache : "full" (eq. (5)); "oracle" (Theorem 4.1's assumption (3): the top ``budget`` of the current
        weights beta_t over *every* earlier token, so a token left out before may come back); "counter"
        (the budget cache of Algorithms 1-2: at most ``budget`` tokens; when full, before the new token
        is added, drop ``drop`` by the counters of ``methods/scissorhands.py``; never the ``n_recent`` newest).
    normalize : divide each new token by its norm (the theorem's ||x_t|| = 1); False runs x_{t+1} = F(a_t)
        as written, and the generated tokens shrink (see the module docstring).
    Returns {"x": (T, d) tokens (row t-1 is x_t), "dropped": (T,) beta mass outside the kept set at each
    step (0 before compression, nan for the prompt), "beta": (T, T) the unrestricted weights beta_{t,j}}.
    """
    T0, d = x0.shape
    if not 2 <= T0 <= T:
        raise ValueError(f"the prompt x0 must hold 2 .. T = {T} tokens, got {T0}")
    if cache not in ("full", "oracle", "counter"):
        raise ValueError(f"cache must be 'full', 'oracle' or 'counter', got {cache!r}")
    if cache != "full" and (budget is None or not 0 <= n_recent < budget or T0 - 1 > budget):
        raise ValueError(f"a budget cache needs budget > n_recent >= 0 and a prompt that fits (T0 - 1 <= budget); "
                         f"got budget={budget}, n_recent={n_recent}, T0={T0}")
    x = torch.zeros(T, d, dtype=torch.float64)
    x[:T0] = x0 / x0.norm(dim=-1, keepdim=True)
    dropped = torch.full((T,), float("nan"), dtype=torch.float64)
    beta_all = torch.zeros(T, T, dtype=torch.float64)
    kept = torch.arange(T0 - 2)                                  # counter cache (0-based rows) before step T0
    history = torch.zeros(1, 1, T, history_window, dtype=torch.bool)
    last = torch.zeros(1, 1, T, dtype=torch.float64)
    for t in range(T0, T + 1):                                   # query x_t (row t-1) attends x_1 .. x_{t-1}
        q = x[t - 1] @ model.W_Q                                 # (p,)
        logits = (x[:t - 1] @ model.W_K) @ q / t                 # (t-1,) the 1/t temperature
        beta = torch.softmax(logits, -1)                         # unrestricted weights of this model
        beta_all[t - 1, :t - 1] = beta
        if cache == "full" or (cache == "oracle" and t - 1 <= budget):
            S = torch.arange(t - 1)
        elif cache == "oracle":
            S = beta.topk(budget).indices.sort().values
        else:                                                    # the counter cache, newest row so far t - 3
            if len(kept) >= budget:                              # Algorithm 1: full -> compress first
                pos = kept.view(1, 1, -1)
                score = keep_score(unimportance(history)[..., kept], last[..., kept], pos)
                m = min(drop, budget - n_recent)
                keep = select_topk(score.masked_fill(pos >= t - 2 - n_recent, float("inf")), len(kept) - m)
                kept = kept[keep[0, 0]]
            kept = torch.cat([kept, torch.tensor([t - 2])])      # then the newest token x_{t-1}
            S = kept
        alpha = torch.softmax(logits[S], -1)                     # attention over the kept set
        dropped[t - 1] = 1 - beta[S].sum()
        if cache == "counter":                                   # Algorithm 2's flags, as the policy keeps them
            attn = torch.zeros(1, 1, 1, T, dtype=torch.float64)
            attn[..., S] = alpha
            visible = torch.zeros(1, 1, 1, T, dtype=torch.bool)
            visible[..., S] = True
            push_history(history, low_flags(attn, visible, threshold), torch.tensor([t - 1]))
            last = attn[:, :, 0]
        if t < T:
            a = alpha @ x[S] @ model.W_V @ model.W_O             # eq. (5)
            y = model.F(a)
            x[t] = y / y.norm() if normalize else y              # unit norm, the theorem's assumption
    return {"x": x, "dropped": dropped, "beta": beta_all}
