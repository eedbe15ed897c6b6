"""
Tensor attention and its two KV-cache layouts: four matrices (K1, K2, V1, V2) or two (K~, V~).

Paper: tensor attention, Sanford, Hsu & Telgarsky, NeurIPS 2023, https://arxiv.org/abs/2306.02896, and Alman & Song
2024, https://arxiv.org/abs/2310.04064; its caches, Chen et al., "Time and Memory Trade-off of KV-Cache Compression
in Tensor Transformer Decoding", 2025, https://arxiv.org/abs/2503.11108 (§3.2, Definitions 3.1, 3.6-3.8).

A query scores *pairs* of earlier tokens, s_t(a, b) = tau <q_t, k1_a * k2_b> (* element-wise), takes the softmax
over all t^2 pairs and mixes P_t(a, b) (v1_a * v2_b). The four-matrix cache stores K1, K2, V1, V2 (4 n d numbers),
the two-matrix cache the pair rows K~ = K1 (/) K2, V~ = V1 (/) V2 (2 n^2 d). Three decode paths: "four-naive"
rebuilds the pair rows every step (as Chen et al.'s Theorem 4.3 charges it); "four" factors them, S = (K1 * q) K2^T
and o = 1^T (V1 * (P V2)), the same Theta(n^2 d) work from O(n d) memory; "two" grows K~, V~ by token i+1's 2i+1
rows. tau = 1/sqrt(d), learned absolute positions, k2 = 1 + k2_proj(x) and v2 = 1 + v2_proj(x) (all-ones rows give
standard attention). In the decoder: ``ModelConfig.attention = "methods.tensor_attention:TensorAttention"``,
``tensor_cache(config, layout)``. The bounds and the choices: ``methods/tensor_attention/README.md``, "How the
attention and its two caches work".
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor

from nanollm.cache import KVCache
from nanollm.config import ModelConfig
from nanollm.policy import Needs

# ----------------------------------------------------------------------------------------------------------
# The math, for any leading dimensions (batch, heads): queries (..., Tq, d), factors (..., n, d).


def kron_rows(A: Tensor, B: Tensor) -> Tensor:
    """Column-wise Kronecker product (Chen et al., Definition 3.1): (..., n1, d), (..., n2, d) ->
    (..., n1*n2, d), row a*n2 + b = A[a] * B[b]: a-major, as Definition 3.6 numbers the pairs ((a-1) i + b);
    Definition 3.1 numbers them b-major (i1 + (i2-1) n1). The order does not matter: the softmax and the
    output sum run over all pairs."""
    return (A[..., :, None, :] * B[..., None, :, :]).flatten(-3, -2)


def pair_scores(q: Tensor, K1: Tensor, K2: Tensor, scale: float) -> Tensor:
    """S[t, a, b] = scale * <q_t, K1[a] * K2[b]> for all pairs, without forming K1 (/) K2 (no temporary of
    n1 n2 d numbers per query). q (..., Tq, d), K1 (..., n1, d), K2 (..., n2, d) -> (..., Tq, n1, n2)."""
    # BEGIN SOLUTION [tensor_attention:pair_scores] Chen et al. Def. 3.6's pair scores, factored as the module doc says
    qk1 = (q * scale)[..., :, None, :] * K1[..., None, :, :]                  # (..., Tq, n1, d)
    S = qk1.flatten(-3, -2) @ K2.transpose(-1, -2)                           # (..., Tq*n1, n2): one matmul
    return S.unflatten(-2, qk1.shape[-3:-1])                                 # (..., Tq, n1, n2)
    # END SOLUTION


def pair_softmax(S: Tensor, allowed: Tensor | None = None) -> Tensor:
    """Softmax over all pairs of each query (the last two dimensions together). ``allowed`` (broadcast to
    S, bool): True where a pair may be attended, False masks it out (probability exactly 0); None: every pair.
    Scores may be large: subtract each query's largest before exp, as torch.softmax does."""
    # BEGIN SOLUTION [tensor_attention:pair_softmax] Chen et al. Def. 3.6: one softmax over all n1 n2 pairs of a query
    if allowed is not None:
        S = S.masked_fill(~allowed, float("-inf"))
    return torch.softmax(S.flatten(-2), dim=-1).view(S.shape)
    # END SOLUTION


def factored_output(P: Tensor, V1: Tensor, V2: Tensor) -> Tensor:
    """o_t = sum_{a,b} P[t, a, b] V1[a] * V2[b], without forming V1 (/) V2 (no temporary of n1 n2 d numbers
    per query). P (..., Tq, n1, n2), V1 (..., n1, d), V2 (..., n2, d) -> (..., Tq, d). P is used as given:
    any weights, zeros and unnormalised ones too."""
    # BEGIN SOLUTION [tensor_attention:factored_output] Chen et al. Def. 3.6's output, factored as the module doc says
    PV2 = (P.flatten(-3, -2) @ V2).unflatten(-2, P.shape[-3:-1])             # (..., Tq, n1, d)
    return (V1[..., None, :, :] * PV2).sum(-2)                               # (..., Tq, d)
    # END SOLUTION


def four_cache_attention(q: Tensor, K1: Tensor, K2: Tensor, V1: Tensor, V2: Tensor, scale: float,
                         allowed: Tensor | None = None) -> Tensor:
    """Tensor attention from the four factor matrices, factored: O(Tq n^2 d) time, nothing of size n^2 d.
    ``allowed`` (..., Tq, n, n) bool or None."""
    return factored_output(pair_softmax(pair_scores(q, K1, K2, scale), allowed), V1, V2)


def two_cache_attention(q: Tensor, Kt: Tensor, Vt: Tensor, scale: float, allowed: Tensor | None = None) -> Tensor:
    """Tensor attention from the pair matrices K~, V~ (..., P, d): ordinary attention over P = n^2 pair
    rows. ``allowed`` (..., Tq, P) bool or None."""
    S = (q * scale) @ Kt.transpose(-1, -2)                                   # (..., Tq, P)
    if allowed is not None:
        S = S.masked_fill(~allowed, float("-inf"))
    return torch.softmax(S, dim=-1) @ Vt                                     # (..., Tq, d)


def naive_four_cache_attention(q: Tensor, K1: Tensor, K2: Tensor, V1: Tensor, V2: Tensor, scale: float,
                               allowed: Tensor | None = None) -> Tensor:
    """The path Theorem 4.3 charges the four-matrix cache: build K1 (/) K2 and V1 (/) V2 (n^2 d each), then
    attend over them as the two-matrix cache does. ``allowed`` (..., Tq, n, n) bool or None."""
    allowed = None if allowed is None else allowed.flatten(-2)
    return two_cache_attention(q, kron_rows(K1, K2), kron_rows(V1, V2), scale, allowed)


def causal_tensor_attention(q: Tensor, k1: Tensor, k2: Tensor, v1: Tensor, v2: Tensor,
                            max_elements: int = 1 << 24) -> Tensor:
    """The training path: every query t of a sequence over the pairs (a, b), a, b <= t. All (B, H, T, d).

    Queries go in chunks so that a chunk's scores (B, H, Tc, t1, t1) stay below ``max_elements``; the chunk
    ending at t1 only looks at the first t1 tokens. Time O(T^3 d) per head, as for any exact tensor
    attention (Alman & Song 2024 discuss when it can be approximated faster).
    """
    B, H, T, d = q.shape
    scale = 1.0 / math.sqrt(d)
    outs, t0 = [], 0
    while t0 < T:
        t1 = t0 + 1
        while t1 < T and B * H * (t1 + 1 - t0) * (t1 + 1) ** 2 <= max_elements:
            t1 += 1
        t = torch.arange(t0, t1, device=q.device)
        seen = torch.arange(t1, device=q.device)[None, :] <= t[:, None]              # (Tc, t1)
        allowed = seen[:, :, None] & seen[:, None, :]                                # (Tc, t1, t1)
        outs.append(four_cache_attention(q[:, :, t0:t1], k1[:, :, :t1], k2[:, :, :t1], v1[:, :, :t1],
                                         v2[:, :, :t1], scale, allowed))
        t0 = t1
    return torch.cat(outs, dim=2)


# ----------------------------------------------------------------------------------------------------------
# Storage: rows that grow in place (capacity doubling), so appending costs the new rows, not a copy of all.


class Rows:
    """A tensor that grows along one dimension (``dim``: 2 for (B, H, n, d) rows, 0 for (n,) positions)
    without copying what is stored: the buffer doubles when full, so appends cost O(new rows) amortised."""

    def __init__(self, dim: int = 2) -> None:
        self.dim = dim
        self._buf: Tensor | None = None
        self.n = 0

    @property
    def t(self) -> Tensor:
        return self._buf.narrow(self.dim, 0, self.n)

    def append(self, rows: Tensor) -> None:
        m = rows.shape[self.dim]
        if self._buf is None or self.n + m > self._buf.shape[self.dim]:
            shape = list(rows.shape)
            shape[self.dim] = max(2 * self.n, self.n + m, 16)
            buf = rows.new_empty(shape)
            if self._buf is not None:
                buf.narrow(self.dim, 0, self.n).copy_(self.t)
            self._buf = buf
        self._buf.narrow(self.dim, self.n, m).copy_(rows)
        self.n += m

    def nbytes(self) -> int:
        """Bytes in use (the buffer holds up to twice as many right after it doubles)."""
        return 0 if self._buf is None else self.t.nbytes


class FourCache:
    """Four-matrix cache: K1, K2, V1, V2 (B, H, n, d) and the tokens' positions (n,). 4 n d numbers.

    ``naive=True`` attends by building K1 (/) K2 and V1 (/) V2 at every step (``naive_four_cache_attention``);
    otherwise factored (``four_cache_attention``). Both read the same stored numbers. ``decode_step``, when
    given, computes a decode step's output instead (``fn(q (B, H, d), k1, k2, v1, v2, scale) -> (B, H, d)``, or
    None where it cannot): how ``fastpath/tensor.py`` puts the Triton kernel in, the library never does."""

    def __init__(self, config: ModelConfig | None = None, naive: bool = False, decode_step=None) -> None:
        self.naive = naive
        self.decode_step = decode_step
        self.k1, self.k2, self.v1, self.v2 = Rows(), Rows(), Rows(), Rows()
        self._pos = Rows(dim=0)
        self.last = -1                            # the latest stored position

    def __len__(self) -> int:
        return self.k1.n

    @property
    def pos(self) -> Tensor:
        return self._pos.t

    def append(self, k1: Tensor, k2: Tensor, v1: Tensor, v2: Tensor, pos: Tensor) -> None:
        for store, rows in zip((self.k1, self.k2, self.v1, self.v2), (k1, k2, v1, v2)):
            store.append(rows)
        self._pos.append(pos)
        self.last = max(self.last, int(pos.max()))

    def attend(self, q: Tensor, q_pos: Tensor) -> Tensor:
        """q (B, H, Tq, d) at positions q_pos (Tq,) over the stored tokens -> (B, H, Tq, d)."""
        scale = 1.0 / math.sqrt(q.shape[-1])
        factors = (self.k1.t, self.k2.t, self.v1.t, self.v2.t)                   # (B, H, n, d) each
        masked = q.shape[2] > 1 or self.last > int(q_pos.max())   # a decode step sees every stored token: no mask
        if not masked and not self.naive and self.decode_step is not None:
            out = self.decode_step(q[:, :, 0], *factors, scale)                  # (B, H, d), or None
            if out is not None:
                return out.unsqueeze(2)
        allowed = None
        if masked:
            seen = self.pos[None, :] <= q_pos[:, None]                            # (Tq, n)
            allowed = seen[:, :, None] & seen[:, None, :]                         # (Tq, n, n)
        attend = naive_four_cache_attention if self.naive else four_cache_attention
        return attend(q, *factors, scale, allowed)

    def nbytes(self) -> int:
        """Bytes of K1, K2, V1, V2: 4 n d numbers per row and head."""
        return sum(s.nbytes() for s in (self.k1, self.k2, self.v1, self.v2))

    def pos_nbytes(self) -> int:
        """Bytes of the positions (bookkeeping, reported apart as for the standard cache)."""
        return self._pos.nbytes()

    def state_nbytes(self) -> int:
        return 0


class NaiveFourCache(FourCache):
    """The four-matrix cache attended the way Theorem 4.3 charges it (Kronecker products rebuilt per step)."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__(config, naive=True)


class TwoCache:
    """Two-matrix cache: pair rows K~ = K1 (/) K2 and V~ = V1 (/) V2 (B, H, n^2, d) with each row's token
    positions (a, b), plus the factor rows (a ``FourCache``) that the next token's pairs are made from.

    Appending token i+1 (0-based: n old tokens) adds 2n+1 rows: (a, new) for every old a, (new, b) for
    every old b, and (new, new). A chunk of m new tokens adds (n+m)^2 - n^2 rows at once."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        self.factors = FourCache(config)
        self.kt, self.vt = Rows(), Rows()
        self._pos_a, self._pos_b = Rows(dim=0), Rows(dim=0)

    def __len__(self) -> int:
        return len(self.factors)

    def pairs(self) -> int:
        return self.kt.n

    def append(self, k1: Tensor, k2: Tensor, v1: Tensor, v2: Tensor, pos: Tensor) -> None:
        """Store m new tokens, factors (B, H, m, d) each at positions pos (m,): their factor rows, and their
        pair rows (B, H, (n+m)^2 - n^2, d) in K~ and V~ after those stored (which never move), with the
        positions (a, b) of every new pair row. The order of the new rows among themselves is free. Read the
        old factor rows before appending the new ones to ``self.factors`` (its rows then include them)."""
        # BEGIN SOLUTION [tensor_attention:two_cache_append] Chen et al. Def. 3.7-3.8: the pairs a new token adds
        f = self.factors
        n, m = len(f), len(pos)
        if n:       # views of the first n rows (an append writes after them or into a new buffer: they stay valid)
            old_k2, old_v2, old_pos = f.k2.t, f.v2.t, f.pos
        f.append(k1, k2, v1, v2, pos)
        # (every a, new b): a runs over the old and the new tokens, (n + m) * m rows
        self.kt.append(kron_rows(f.k1.t, k2))
        self.vt.append(kron_rows(f.v1.t, v2))
        self._pos_a.append(f.pos.repeat_interleave(m))
        self._pos_b.append(pos.repeat(n + m))
        if n:                                                     # (new a, old b): m * n rows
            self.kt.append(kron_rows(k1, old_k2))
            self.vt.append(kron_rows(v1, old_v2))
            self._pos_a.append(pos.repeat_interleave(n))
            self._pos_b.append(old_pos.repeat(m))
        # END SOLUTION

    def pair_pos(self) -> tuple[Tensor, Tensor]:
        """Token positions (a, b) of every pair row, (n^2,) each."""
        return self._pos_a.t, self._pos_b.t

    def attend(self, q: Tensor, q_pos: Tensor) -> Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        allowed = None
        if q.shape[2] > 1 or self.factors.last > int(q_pos.max()):      # a decode step: no mask
            pa, pb = self.pair_pos()
            allowed = torch.maximum(pa, pb)[None, :] <= q_pos[:, None]           # (Tq, n^2)
        return two_cache_attention(q, self.kt.t, self.vt.t, scale, allowed)

    def pair_nbytes(self) -> int:
        """Bytes of K~ and V~: 2 n^2 d numbers per row and head."""
        return self.kt.nbytes() + self.vt.nbytes()

    def factor_nbytes(self) -> int:
        """Bytes of the factor rows kept to build the next tokens' pairs: 4 n d numbers per row and head."""
        return self.factors.nbytes()

    def nbytes(self) -> int:
        return self.pair_nbytes() + self.factor_nbytes()

    def pos_nbytes(self) -> int:
        """Bytes of the positions: (a, b) of every pair row and the tokens' own (bookkeeping, not counted in
        ``nbytes``; 16 n^2 bytes per layer in int64 next to the pairs' 8 n^2 d per head in fp32)."""
        return self._pos_a.nbytes() + self._pos_b.nbytes() + self.factors.pos_nbytes()

    def state_nbytes(self) -> int:
        return 0


TENSOR_ATTENTION = "methods.tensor_attention:TensorAttention"      # what ModelConfig.attention names
LAYOUTS = {"four": FourCache, "four-naive": NaiveFourCache, "two": TwoCache}


def tensor_cache(config: ModelConfig, layout: str = "four", decode_step=None) -> KVCache:
    """An empty cache for a tensor-attention model with the given layout ("four", "four-naive", "two");
    ``decode_step`` goes to each layer's four-matrix storage (``FourCache``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown tensor-attention cache layout {layout!r}; choose one of {sorted(LAYOUTS)}")
    if config.attention != TENSOR_ATTENTION:
        raise ValueError(f"tensor_cache is for tensor-attention models; this config's attention is "
                         f"{config.attention!r}")
    if decode_step is not None and layout != "four":
        raise ValueError(f"a decode_step is for the factored four-matrix layout, not {layout!r}")
    new_storage = LAYOUTS[layout] if decode_step is None else (lambda c: FourCache(c, decode_step=decode_step))
    return KVCache(config, new_storage=new_storage)


# ----------------------------------------------------------------------------------------------------------
# The attention module for the nanollm decoder.


class TensorAttention(nn.Module):
    """Multi-head tensor attention: five projections per head (q, k1, k2, v1, v2), pairs of earlier tokens.
    Weight names: q/k1/k2/v1/v2/o_proj. k2 = 1 + k2_proj(x), v2 = 1 + v2_proj(x) (see the module doc)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        if config.flavour != "gpt2":
            raise ValueError("tensor attention needs learned absolute positions (flavour='gpt2'): rotary "
                             "embeddings give no relative-position score for a pair of keys")
        if config.n_kv_head != config.n_head:
            raise ValueError(f"tensor attention keeps one set of factors per query head: n_kv_head "
                             f"({config.n_kv_head}) must equal n_head ({config.n_head})")
        self.config = config
        self.layer_idx = layer_idx
        H, d, D = config.n_head, config.head_dim, config.d_model
        for name in ("q_proj", "k1_proj", "k2_proj", "v1_proj", "v2_proj"):
            setattr(self, name, nn.Linear(D, H * d, bias=config.bias))
        self.o_proj = nn.Linear(H * d, D, bias=config.bias)

    @classmethod
    def new_storage(cls, config: ModelConfig) -> FourCache:
        """The default layout: the four-matrix cache, attended factored (``tensor_cache`` picks another)."""
        return FourCache(config)

    @staticmethod
    def attend_entries(q: Tensor, entries, q_pos: Tensor,
                       needs: Needs = Needs()) -> tuple[Tensor, None, None]:
        """The step's queries (B, H, Tq, d) over a ``FourCache`` or ``TwoCache``. No attention statistics:
        the cache-eviction policies of this repository select token rows of a standard ``LayerKV``."""
        if needs != Needs():
            raise ValueError("tensor attention does not report attention statistics to a policy")
        return entries.attend(q, q_pos), None, None

    def projections(self, x: Tensor) -> tuple[Tensor, ...]:
        """x (B, T, D) -> q, k1, k2, v1, v2, each (B, H, T, d)."""
        B, T, _ = x.shape
        H, d = self.config.n_head, self.config.head_dim
        heads = lambda t: t.view(B, T, H, d).transpose(1, 2)              # noqa: E731
        q, k1, v1 = heads(self.q_proj(x)), heads(self.k1_proj(x)), heads(self.v1_proj(x))
        k2, v2 = 1 + heads(self.k2_proj(x)), 1 + heads(self.v2_proj(x))
        return q, k1, k2, v1, v2

    def forward(self, x: Tensor, pos: Tensor, rope, cache: KVCache | None = None) -> Tensor:
        B, T, _ = x.shape
        q, k1, k2, v1, v2 = self.projections(x)
        if cache is None:
            y = causal_tensor_attention(q, k1, k2, v1, v2)
        else:
            if cache.policy is not None:
                raise ValueError("tensor attention caches take no eviction policy: the policies here select "
                                 "token rows of the standard attention's storage")
            y = cache.attend(self.layer_idx, self, q, pos, (k1, k2, v1, v2))
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
