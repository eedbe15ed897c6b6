"""
SubGen: softmax attention from a sublinear sketch of a stream of (key, value) rows, when the keys cluster.

Paper: Zandieh, Han, Mirrokni & Karbasi, "SubGen: Token Generation in Sublinear Time and Memory", 2024,
https://arxiv.org/abs/2402.06082 . Used for tensor attention by Chen et al., arXiv 2503.11108, §5.1
(SubGen4Cache / SubGen2Cache, Lemmas 5.1 and 5.2).

o = sum_j exp(<q, k_j>) v_j / Z is estimated in two parts. Z: a key joins the nearest cluster within ``delta`` of
its centre, or opens one; a cluster keeps its count c_i and a reservoir S_i of ``per_cluster`` keys, and
Z_hat = sum_i (c_i / |S_i|) sum_{k in S_i} exp(<q, k>). The numerator: ``value_samples`` = s rows drawn with
p_j = ||v_j||^2 / W by weighted reservoirs, numerator_hat = (W / s) sum exp(<q, k>) v / ||v||^2 (unbiased). A
sketch as large as its stream is exact. ``subgen_pairs`` streams a two-matrix cache's pair rows through it; a
decoder that goes on generating still needs the factor rows for the next token's pairs (``nbytes`` leaves them
out). The bound, which parts are our reading of the paper, the caveats: ``methods/tensor_attention/README.md``,
"SubGen: a sketch of the pair rows".
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .attention import four_cache_attention, kron_rows, two_cache_attention


class SubGen:
    """A SubGen sketch of a stream of (key, value) rows of dimension d (see the module docstring).

    ``update(keys, values)`` feeds rows (m, d) in stream order; ``attend(q, scale)`` estimates softmax
    attention of q (d,) or (Tq, d) over every row seen so far. All randomness comes from one
    ``torch.Generator`` seeded with ``seed``: the same stream and seed give the same sketch.
    """

    def __init__(self, d: int, delta: float, per_cluster: int, value_samples: int, seed: int = 0,
                 dtype: torch.dtype = torch.float64) -> None:
        if not (isinstance(d, int) and d >= 1):
            raise ValueError(f"d must be a positive int, got {d!r}")
        if not (isinstance(delta, (int, float)) and math.isfinite(delta) and delta > 0):
            raise ValueError(f"delta (the cluster radius) must be a finite number > 0, got {delta!r}")
        if not (isinstance(per_cluster, int) and per_cluster >= 1):
            raise ValueError(f"per_cluster must be an int >= 1, got {per_cluster!r}")
        if not (isinstance(value_samples, int) and value_samples >= 1):
            raise ValueError(f"value_samples must be an int >= 1, got {value_samples!r}")
        self.d, self.delta = d, float(delta)
        self.per_cluster, self.value_samples = per_cluster, value_samples
        self.dtype = dtype
        self.gen = torch.Generator().manual_seed(seed)
        # keys: clusters
        self._centres = torch.empty(16, d, dtype=dtype)          # (capacity, d), first n_clusters rows used
        self.counts: list[int] = []                              # keys seen per cluster
        self._samples: list[Tensor] = []                         # per cluster (per_cluster, d), the first
                                                                 # min(count, per_cluster) rows used
        # values: l2 samples
        self.n_seen = 0                                          # rows seen
        self.total_weight = 0.0                                  # W = sum ||v_j||^2
        self._vk = torch.zeros(value_samples, d, dtype=dtype)    # (s, d) sampled keys
        self._vv = torch.zeros(value_samples, d, dtype=dtype)    # (s, d) their values

    @property
    def n_clusters(self) -> int:
        return len(self.counts)

    @property
    def exact_values(self) -> bool:
        """Whether the value buffer still holds every pair verbatim (it fits: n_seen <= value_samples)."""
        return self.n_seen <= self.value_samples

    def _filled(self) -> list[int]:
        """Used rows of each cluster's sample: every key until the reservoir is full."""
        return [min(c, self.per_cluster) for c in self.counts]

    # ------------------------------------------------------------------------------------------------
    # streaming

    def update(self, keys: Tensor, values: Tensor) -> None:
        """Feed rows (m, d) of keys and values, row 0 first."""
        if keys.dim() != 2 or keys.shape != values.shape or keys.shape[1] != self.d:
            raise ValueError(f"keys and values must both be (m, {self.d}), got {tuple(keys.shape)} and "
                             f"{tuple(values.shape)}")
        keys, values = keys.to(self.dtype), values.to(self.dtype)
        for k, v in zip(keys, values):
            self._add_key(k)
            self._add_pair(k, v)

    def _add_key(self, k: Tensor) -> None:
        """Online clustering and the per-cluster reservoir (Algorithm R)."""
        i = -1
        if self.n_clusters:
            dist2 = ((self._centres[:self.n_clusters] - k) ** 2).sum(-1)           # (n_clusters,)
            nearest = int(dist2.argmin())
            if float(dist2[nearest]) <= self.delta ** 2:
                i = nearest
        if i < 0:                                                                   # open a cluster
            if self.n_clusters == self._centres.shape[0]:
                self._centres = torch.cat([self._centres, torch.empty_like(self._centres)])
            i = self.n_clusters
            self._centres[i] = k
            self.counts.append(0)
            self._samples.append(torch.empty(self.per_cluster, self.d, dtype=self.dtype))
        self.counts[i] += 1
        if self.counts[i] <= self.per_cluster:                                      # reservoir not full
            self._samples[i][self.counts[i] - 1] = k
        else:                                                                       # keep with prob t / c
            slot = int(torch.randint(self.counts[i], (1,), generator=self.gen))
            if slot < self.per_cluster:
                self._samples[i][slot] = k

    def _add_pair(self, k: Tensor, v: Tensor) -> None:
        """l2 sampling of (key, value) pairs: verbatim while it fits, then s weighted reservoirs of size 1."""
        s = self.value_samples
        w = float(v @ v)
        self.n_seen += 1
        self.total_weight += w
        if self.n_seen <= s:
            self._vk[self.n_seen - 1], self._vv[self.n_seen - 1] = k, v
            return
        if self.n_seen == s + 1:
            # The buffer overflows: draw s rows from it with probability ||v||^2 / W (with replacement), the
            # state s independent size-one reservoirs would be in now, and go on streaming from there.
            weights = (self._vv ** 2).sum(-1)                                       # (s,)
            if float(weights.sum()) > 0:
                idx = torch.multinomial(weights, s, replacement=True, generator=self.gen)
                self._vk, self._vv = self._vk[idx], self._vv[idx]
        if w > 0:
            replace = torch.rand(s, generator=self.gen, dtype=self.dtype) < w / self.total_weight   # (s,)
            self._vk[replace], self._vv[replace] = k, v

    # ------------------------------------------------------------------------------------------------
    # queries

    def _cluster_keys(self) -> tuple[Tensor, Tensor]:
        """The sampled keys of every cluster (N, d) and each one's weight c_i / |S_i| (N,)."""
        filled = self._filled()
        keys = torch.cat([smp[:f] for smp, f in zip(self._samples, filled)])
        weights = torch.cat([torch.full((f,), c / f, dtype=self.dtype) for c, f in zip(self.counts, filled)])
        return keys, weights

    def _value_pairs(self) -> tuple[Tensor, Tensor, Tensor]:
        """The stored (key, value) pairs (s', d) each and the factor each term is multiplied by (s',):
        1 while the buffer is verbatim, W / (s ||v||^2) once it holds l2 samples."""
        if self.exact_values:
            n = self.n_seen
            return self._vk[:n], self._vv[:n], torch.ones(n, dtype=self.dtype)
        norms2 = (self._vv ** 2).sum(-1)                                            # (s,)
        coef = torch.where(norms2 > 0, self.total_weight / (self.value_samples * norms2.clamp_min(1e-300)),
                           torch.zeros_like(norms2))
        return self._vk, self._vv, coef

    def _check_query(self, q: Tensor) -> Tensor:
        if self.n_seen == 0:
            raise ValueError("the sketch is empty: feed rows with update() before attending")
        if q.dim() not in (1, 2) or q.shape[-1] != self.d:
            raise ValueError(f"q must be ({self.d},) or (Tq, {self.d}), got {tuple(q.shape)}")
        return q.to(self.dtype)

    def normaliser(self, q: Tensor, scale: float = 1.0, shift: Tensor | float = 0.0) -> Tensor:
        """Z_hat * exp(-shift) = sum_i (c_i / |S_i|) sum_{k in S_i} exp(scale <q, k> - shift). q (d,) or
        (Tq, d) -> () or (Tq,). ``shift`` (same leading shape) only guards against overflow."""
        q = self._check_query(q)
        keys, weights = self._cluster_keys()                                        # (N, d), (N,)
        return _weighted_exp_sum(weights, scale * q @ keys.T, torch.as_tensor(shift, dtype=self.dtype))

    def attend(self, q: Tensor, scale: float = 1.0) -> Tensor:
        """o_hat = numerator_hat / Z_hat for q (d,) or (Tq, d) -> (d,) or (Tq, d)."""
        q = self._check_query(q)
        ck, weights = self._cluster_keys()
        vk, vv, coef = self._value_pairs()
        s_c, s_v = scale * q @ ck.T, scale * q @ vk.T                               # (..., N), (..., s')
        shift = torch.maximum(s_c.max(-1).values, s_v.max(-1).values)              # (...,) common, cancels
        numerator = (torch.exp(s_v - shift[..., None]) * coef) @ vv                 # (..., d)
        return numerator / _weighted_exp_sum(weights, s_c, shift)[..., None]       # the normaliser's sum

    # ------------------------------------------------------------------------------------------------
    # memory

    def stored_rows(self) -> int:
        """d-vectors held: cluster centres, sampled keys, and the key and value of each stored pair."""
        return self.n_clusters + sum(self._filled()) + 2 * min(self.n_seen, self.value_samples)

    def numbers(self) -> int:
        """Numbers held: the rows above times d, one count per cluster, and the two stream totals (n, W)."""
        return self.stored_rows() * self.d + self.n_clusters + 2

    def nbytes(self, bytes_per_number: int | None = None) -> int:
        """Bytes of ``numbers()`` at ``bytes_per_number`` (default: the sketch's dtype, 8 for float64)."""
        per = torch.empty(0, dtype=self.dtype).element_size() if bytes_per_number is None else bytes_per_number
        return self.numbers() * per


def _weighted_exp_sum(weights: Tensor, scores: Tensor, shift: Tensor) -> Tensor:
    """sum_i weights_i exp(scores_i - shift) over the last axis: the normaliser Z_hat times exp(-shift).
    scores (..., N), shift (...)."""
    return (weights * torch.exp(scores - shift[..., None])).sum(-1)


# ----------------------------------------------------------------------------------------------------------
# A SubGen-style tensor-attention cache: the pair rows of a two-matrix cache, streamed through the sketch


def pair_rows(K1: Tensor, K2: Tensor, V1: Tensor, V2: Tensor, i: int) -> tuple[Tensor, Tensor]:
    """The 2i+1 pair rows token i (0-based) adds to a two-matrix cache: (a, i) for a <= i, then (i, b) for
    b < i (the order ``TwoCache.append`` uses). Returns keys, values (2i+1, d)."""
    keys = torch.cat([kron_rows(K1[:i + 1], K2[i:i + 1]), kron_rows(K1[i:i + 1], K2[:i])])
    values = torch.cat([kron_rows(V1[:i + 1], V2[i:i + 1]), kron_rows(V1[i:i + 1], V2[:i])])
    return keys, values


def subgen_pairs(K1: Tensor, K2: Tensor, V1: Tensor, V2: Tensor, delta: float, per_cluster: int,
                 value_samples: int, seed: int = 0) -> SubGen:
    """Stream the n^2 pair rows of tensor-attention factors (n, d) each, token by token, into a SubGen and
    return it: an approximate two-matrix cache. Its ``attend(q, scale)`` estimates
    ``two_cache_attention(q, kron_rows(K1, K2), kron_rows(V1, V2), scale)``. The factor rows themselves
    are not kept (see the module docstring: a decoder that goes on generating needs them)."""
    shapes = {tuple(t.shape) for t in (K1, K2, V1, V2)}
    if len(shapes) != 1 or K1.dim() != 2:
        raise ValueError(f"K1, K2, V1, V2 must all be (n, d), got {[tuple(t.shape) for t in (K1, K2, V1, V2)]}")
    n, d = K1.shape
    sketch = SubGen(d, delta, per_cluster, value_samples, seed=seed, dtype=K1.dtype)
    for i in range(n):
        sketch.update(*pair_rows(K1, K2, V1, V2, i))
    return sketch


# ----------------------------------------------------------------------------------------------------------
# The notebook's experiment: error against memory on clusterable synthetic factors


def clustered_factors(n: int, d: int, clusters: int, noise: float, generator: torch.Generator,
                      dtype: torch.dtype = torch.float64) -> tuple[Tensor, ...]:
    """Synthetic tensor-attention factors (n, d) each. K1 and K2: ``clusters`` Gaussian centres each, every
    token a random centre plus N(0, noise^2) per coordinate, so the pair keys k1_a * k2_b fall into about
    clusters^2 tight groups. V1, V2 = 1 + N(0, 1/4): values with a common direction (the tensor model's
    ``v2 = 1 + projection``), so the exact output is not close to zero."""
    def clustered() -> Tensor:
        centres = torch.randn(clusters, d, generator=generator, dtype=dtype)
        which = torch.randint(clusters, (n,), generator=generator)
        return centres[which] + noise * torch.randn(n, d, generator=generator, dtype=dtype)

    K1, K2 = clustered(), clustered()
    V1 = 1 + 0.5 * torch.randn(n, d, generator=generator, dtype=dtype)
    V2 = 1 + 0.5 * torch.randn(n, d, generator=generator, dtype=dtype)
    return K1, K2, V1, V2


def error_vs_memory(n: int = 32, d: int = 16, clusters: int = 3, noise: float = 0.05, delta: float = 1.0,
                    settings=((1, 4), (2, 16), (4, 64), (16, 256)), queries: int = 8,
                    query_norm: float = 4.0, seeds: int = 2, seed: int = 0) -> list[dict]:
    """SubGen over the pair rows of a seeded clusterable instance, for each (per_cluster, value_samples).

    Instance: ``clustered_factors(n, d, clusters, noise)``; ``queries`` random directions of norm
    ``query_norm``, scale 1/sqrt(d). The exact reference is ``two_cache_attention`` over kron_rows(K1, K2),
    kron_rows(V1, V2) (and ``four_cache_attention``, the same output from the factors; checked here).
    Each setting runs ``seeds`` sketch seeds on the same instance. One dict per setting:

        per_cluster, value_samples, n_clusters  the sketch's parameters and the clusters it found
        stored_bytes     the sketch's numbers at 4 bytes each (``SubGen.numbers``)
        two_cache_bytes  2 n^2 d * 4: the pair matrices K~, V~ (fp32)
        four_cache_bytes 4 n d * 4: the factors K1, K2, V1, V2 (fp32)
        rel_error        ||o_hat - o|| / ||o||, mean over queries and seeds
        bound_error      ||o_hat - o|| / (||softmax(K~ q)||_2 ||V~||_op), mean: the quantity the paper's
                         theorem bounds by eps

    A setting with per_cluster and value_samples at least n^2 keeps every row and is exact (tested). Note
    what the byte columns show at this toy size: the four-matrix cache (4 n d numbers) is smaller than any
    useful pair sketch; a sketch of the n^2 pair rows pays off against the two-matrix cache only.
    """
    g = torch.Generator().manual_seed(seed)
    K1, K2, V1, V2 = clustered_factors(n, d, clusters, noise, g)
    Kt, Vt = kron_rows(K1, K2), kron_rows(V1, V2)                                 # (n^2, d)
    q = torch.randn(queries, d, generator=g, dtype=torch.float64)
    q = query_norm * q / q.norm(dim=-1, keepdim=True)                             # (queries, d)
    scale = 1.0 / math.sqrt(d)
    exact = two_cache_attention(q, Kt, Vt, scale)                                 # (queries, d)
    torch.testing.assert_close(exact, four_cache_attention(q, K1, K2, V1, V2, scale))
    p_norm = torch.softmax(scale * q @ Kt.T, dim=-1).norm(dim=-1)                 # (queries,)
    v_op = torch.linalg.matrix_norm(Vt, ord=2)
    rows = []
    for per_cluster, value_samples in settings:
        rel, bound, stored, found = [], [], 0, 0
        for s in range(seeds):
            sketch = subgen_pairs(K1, K2, V1, V2, delta, per_cluster, value_samples, seed=seed + s)
            err = (sketch.attend(q, scale) - exact).norm(dim=-1)                 # (queries,)
            rel.append(err / exact.norm(dim=-1))
            bound.append(err / (p_norm * v_op))
            stored, found = max(stored, sketch.numbers() * 4), sketch.n_clusters
        rows.append({"per_cluster": per_cluster, "value_samples": value_samples, "n_clusters": found,
                     "stored_bytes": stored, "two_cache_bytes": 2 * n * n * d * 4,
                     "four_cache_bytes": 4 * n * d * 4, "rel_error": float(torch.cat(rel).mean()),
                     "bound_error": float(torch.cat(bound).mean())})
    return rows
