"""
Why a tensor-attention cache cannot be compressed below Omega(n) bits in general: the Index problem, run.

Paper: Chen et al., "Time and Memory Trade-off of KV-Cache Compression in Tensor Transformer Decoding", 2025,
https://arxiv.org/abs/2503.11108 (Theorem 4.1: a four-matrix cache that decodes exactly needs Omega(n d) bits
for d = Omega(log n); the reduction from the Index problem, Lemma 3.11), generalising Haris & Onak's Theta(n d)
bound for standard attention (2025).

Alice writes a cache from her n bits x; if Bob reads any x_j off one attention output, the cache holds at least n
bits. Our construction (``make_instance``): K1[a] = r_a, K2[a] = u_a random +-1 vectors in R^d, d = ceil(C log2 n),
V2 = 1, V1[a] = 2 x_a - 1 on its first w coordinates; Bob's query q_j = c (r_j * u_j) makes the pair (j, j) win the
softmax. ``accuracy_vs_bits`` compresses the cache (keep k of the n rows, or one majority sign per group of g
tokens) and sets Bob's accuracy against the verbatim line 1/2 + s / (2N) and the Fano bound N (1 - H(p)) <= s.
Why it works, what is counted, the bound's proof: ``methods/tensor_attention/README.md``, "The Index problem: the
memory lower bound, run".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .attention import four_cache_attention, pair_scores


@dataclass
class IndexInstance:
    """Alice's bits and her full four-matrix cache, and Bob's queries (float64).

    x (n, w) int64 in {0, 1}; K1 = R, K2 = U, V1, V2 (n, d); queries (n, d), row j is Bob's query for
    index j; margin: min over j of (score of pair (j, j) - largest other pair score) / c, >= 2 by
    construction."""
    x: Tensor
    K1: Tensor
    K2: Tensor
    V1: Tensor
    V2: Tensor
    queries: Tensor
    c: float
    margin: float

    @property
    def n(self) -> int:
        return self.x.shape[0]

    @property
    def d(self) -> int:
        return self.K1.shape[1]

    @property
    def bits_per_token(self) -> int:
        return self.x.shape[1]


def default_dim(n: int, C: float = 4.0) -> int:
    """d = ceil(C log2 n): the d = Omega(log n) regime of the lower bound."""
    return math.ceil(C * math.log2(n))


def _margin(q: Tensor, K1: Tensor, K2: Tensor, c: float, chunk: int = 32) -> float:
    """min over j of (s_j(j, j) - max_{(a, b) != (j, j)} s_j(a, b)) / c, queries in chunks."""
    n = q.shape[0]
    worst = math.inf
    for j0 in range(0, n, chunk):
        j = torch.arange(j0, min(j0 + chunk, n))
        S = pair_scores(q[j], K1, K2, 1.0) / c                                   # (chunk, n, n)
        own = S[torch.arange(len(j)), j, j].clone()
        S[torch.arange(len(j)), j, j] = -math.inf
        worst = min(worst, float((own - S.flatten(1).max(1).values).min()))
    return worst


def make_instance(n: int, d: int | None = None, c: float = 1.0, bits_per_token: int = 1, seed: int = 0,
                  max_redraws: int = 20) -> IndexInstance:
    """Alice's random bits and cache for the Index reduction (module docstring), seeded.

    d defaults to ``default_dim(n)`` = ceil(4 log2 n). The sign vectors are redrawn (at most
    ``max_redraws`` times) until every index's own pair beats all others by at least 2 (times c); the bits
    x are drawn once, independently of the vectors."""
    if not (isinstance(n, int) and n >= 2):
        raise ValueError(f"n must be an int >= 2, got {n!r}")
    d = default_dim(n) if d is None else d
    if not (isinstance(d, int) and d >= 1):
        raise ValueError(f"d must be a positive int, got {d!r}")
    if not (isinstance(c, (int, float)) and math.isfinite(c) and c > 0):
        raise ValueError(f"c (the query scale) must be a finite number > 0, got {c!r}")
    if not (isinstance(bits_per_token, int) and 1 <= bits_per_token <= d):
        raise ValueError(f"bits_per_token must be an int in [1, d={d}], got {bits_per_token!r}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(2, (n, bits_per_token), generator=g)                       # (n, w)
    signs = lambda: 2.0 * torch.randint(2, (n, d), generator=g, dtype=torch.float64) - 1   # noqa: E731
    for _ in range(max_redraws):
        R, U = signs(), signs()                                                   # (n, d) each
        queries = c * R * U                                                       # (n, d)
        margin = _margin(queries, R, U, c)
        if margin >= 2:
            break
    else:
        raise ValueError(f"no draw in {max_redraws} separated every index's pair (d={d} is too small for "
                         f"n={n}: take a larger d)")
    V1 = torch.ones(n, d, dtype=torch.float64)
    V1[:, :bits_per_token] = 2.0 * x - 1
    return IndexInstance(x, R, U, V1, torch.ones(n, d, dtype=torch.float64), queries, float(c), margin)


def retrieve(instance: IndexInstance, cache_rows: Tensor | None = None, V1: Tensor | None = None,
             chunk: int = 32) -> Tensor:
    """Bob's answers for every index j: the bits (n, w) he reads off four-matrix tensor attention
    (``four_cache_attention``, scale 1) of his query q_j over the cache.

    ``cache_rows``: indices of the token rows the cache kept (None: all n). ``V1``: a replacement (n, d) for
    Alice's V1 (a quantised one); the kept rows are taken from it. Bob decodes x_j[i] = [o_j[i] > 0]."""
    inst = instance
    rows = torch.arange(inst.n) if cache_rows is None else torch.as_tensor(cache_rows, dtype=torch.long)
    if rows.dim() != 1 or (len(rows) and (rows.min() < 0 or rows.max() >= inst.n)):
        raise ValueError(f"cache_rows must be a 1-D list of token indices in [0, {inst.n}), got {rows.tolist()}")
    if len(rows.unique()) != len(rows):
        raise ValueError("cache_rows must not repeat a token index")
    V1 = inst.V1 if V1 is None else V1
    if V1.shape != inst.V1.shape:
        raise ValueError(f"V1 must have shape {tuple(inst.V1.shape)}, got {tuple(V1.shape)}")
    w = inst.bits_per_token
    if len(rows) == 0:                                       # an empty cache: nothing to attend, output 0
        return torch.zeros(inst.n, w, dtype=torch.long)
    K1, K2, V1k, V2 = inst.K1[rows], inst.K2[rows], V1[rows], inst.V2[rows]
    out = torch.cat([four_cache_attention(inst.queries[j0:j0 + chunk], K1, K2, V1k, V2, 1.0)
                     for j0 in range(0, inst.n, chunk)])                          # (n, d)
    return (out[:, :w] > 0).long()


def keep_rows(n: int, k: int, seed: int = 0) -> Tensor:
    """A seeded random subset of k of the n token indices, sorted."""
    if not (isinstance(k, int) and 0 <= k <= n):
        raise ValueError(f"k must be an int in [0, n={n}], got {k!r}")
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].sort().values


def majority_v1(instance: IndexInstance, group: int) -> Tensor:
    """V1 quantised to one sign per group of ``group`` consecutive tokens and bit coordinate: the group's
    majority (ties to +1); the other coordinates stay 1. (n, d)."""
    if not (isinstance(group, int) and group >= 1):
        raise ValueError(f"group must be an int >= 1, got {group!r}")
    inst = instance
    V1 = inst.V1.clone()
    for a0 in range(0, inst.n, group):
        ones = inst.x[a0:a0 + group].sum(0)                                       # (w,)
        size = min(group, inst.n - a0)
        V1[a0:a0 + group, :inst.bits_per_token] = torch.where(2 * ones >= size, 1.0, -1.0)
    return V1


# ----------------------------------------------------------------------------------------------------------
# The curves


def binary_entropy(p: float) -> float:
    """H(p) in bits."""
    return 0.0 if p <= 0 or p >= 1 else -p * math.log2(p) - (1 - p) * math.log2(1 - p)


def fano_accuracy(bits: float, info_bits: int) -> float:
    """The largest average accuracy p in [1/2, 1] with info_bits * (1 - H(p)) <= bits: the most any cache of
    ``bits`` bits can give Bob over ``info_bits`` independent uniform bits (module docstring)."""
    if bits >= info_bits:
        return 1.0
    if bits <= 0:
        return 0.5
    lo, hi = 0.5, 1.0
    for _ in range(60):                                      # 1 - H(p) increases on [1/2, 1]
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if info_bits * (1 - binary_entropy(mid)) <= bits else (lo, mid)
    return lo


def verbatim_accuracy(bits: float, info_bits: int) -> float:
    """1/2 + bits / (2 info_bits): keep ``bits`` of the bits exactly, guess the rest."""
    return min(1.0, 0.5 + bits / (2 * info_bits))


def majority_accuracy(size: int) -> float:
    """P(x_j = majority of its group) for ``size`` uniform bits, ties to 1 (exact, by binomial counts)."""
    others = [math.comb(size - 1, b) / 2 ** (size - 1) for b in range(size)]     # P(b ones among the others)
    right_if_one = sum(p for b, p in enumerate(others) if 2 * (b + 1) >= size)
    right_if_zero = sum(p for b, p in enumerate(others) if 2 * b < size)
    return (right_if_one + right_if_zero) / 2


def accuracy_vs_bits(n: int = 128, d: int | None = None, c: float = 1.0, bits_per_token: int = 1,
                     keep=(0.0, 0.125, 0.25, 0.5, 0.75, 1.0), groups=(3, 5, 9, 17), trials: int = 2,
                     seed: int = 0) -> list[dict]:
    """Bob's accuracy against the cache's bits, for both compressed caches (module docstring), averaged
    over ``trials`` seeded instances. One dict per cache:

        scheme      "rows" (keep a fraction ``param`` of the token rows) or "majority" (group size ``param``)
        bits        s, the x-dependent bits the cache holds; info_bits N = n * bits_per_token
        accuracy    Bob's measured accuracy over all N bits, mean over trials
        expected    its expectation (1/2 + k / (2n); the majority formula)
        verbatim    1/2 + s / (2N)
        fano        the most any s-bit cache allows (``fano_accuracy``)
    """
    if not (isinstance(trials, int) and trials >= 1):
        raise ValueError(f"trials must be an int >= 1, got {trials!r}")
    if any(not 0 <= f <= 1 for f in keep):
        raise ValueError(f"keep fractions must lie in [0, 1], got {list(keep)}")
    instances = [make_instance(n, d, c, bits_per_token, seed=seed + t) for t in range(trials)]
    N = n * bits_per_token
    rows = []

    def record(scheme: str, param, bits: int, expected: float, accs: list[float]) -> None:
        rows.append({"scheme": scheme, "param": param, "bits": bits, "info_bits": N,
                     "accuracy": sum(accs) / len(accs), "expected": expected,
                     "verbatim": verbatim_accuracy(bits, N), "fano": fano_accuracy(bits, N)})

    for f in keep:
        k = round(f * n)
        accs = [float((retrieve(inst, keep_rows(n, k, seed=seed + t)) == inst.x).double().mean())
                for t, inst in enumerate(instances)]
        record("rows", f, k * bits_per_token, 0.5 + k / (2 * n), accs)
    for g in groups:
        sizes = [min(g, n - a0) for a0 in range(0, n, g)]
        expected = sum(s * majority_accuracy(s) for s in sizes) / n
        accs = [float((retrieve(inst, V1=majority_v1(inst, g)) == inst.x).double().mean()) for inst in instances]
        record("majority", g, len(sizes) * bits_per_token, expected, accs)
    return rows
