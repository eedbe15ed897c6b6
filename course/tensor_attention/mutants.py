"""Hand-written mutants of the ``tensor_attention`` assignment (instructor-only: not in a student copy): the
mistakes a student makes in the pair scores, the softmax over pairs, the factored output and the two-matrix
cache's append, and calls to shipped code that computes an answer (``kron_rows``: the Kronecker product the
tasks must avoid). ``python -m course.mutants tensor_attention`` grades each with the hidden tests."""

from course.mutants import Mutant

SCORES, SOFTMAX, OUTPUT, APPEND = "pair_scores", "pair_softmax", "factored_output", "two_cache_append"

MUTANTS = [
    # -- pair_scores
    Mutant("calls the shipped kron_rows: forms K1 (/) K2 (n1 n2 d numbers)", SCORES,
           "S = (q * scale) @ kron_rows(K1, K2).transpose(-1, -2)\n"
           "return S.unflatten(-1, (K1.shape[-2], K2.shape[-2]))"),
    Mutant("an einsum over all three factors at once (torch forms the n1 n2 d product)", SCORES,
           "return scale * (q[..., :, None, None, :] * K1[..., None, :, None, :] * K2[..., None, None, :, :]).sum(-1)"),
    Mutant("no scale", SCORES, "qk1 = q[..., :, None, :] * K1[..., None, :, :]",
           "qk1 = (q * scale)[..., :, None, :] * K1[..., None, :, :]"),
    Mutant("scaled by 1/sqrt(scale)", SCORES, "(q / scale ** 0.5)", "(q * scale)"),
    Mutant("K1 and K2 swapped: S indexed [t, b, a]", SCORES,
           "qk1 = (q * scale)[..., :, None, :] * K2[..., None, :, :]\n"
           "    S = qk1.flatten(-3, -2) @ K1.transpose(-1, -2)\n"
           "    return S.unflatten(-2, qk1.shape[-3:-1])",
           "qk1 = (q * scale)[..., :, None, :] * K1[..., None, :, :]                  # (..., Tq, n1, d)\n"
           "    S = qk1.flatten(-3, -2) @ K2.transpose(-1, -2)                           "
           "# (..., Tq*n1, n2): one matmul\n"
           "    return S.unflatten(-2, qk1.shape[-3:-1])                                 # (..., Tq, n1, n2)"),
    Mutant("the rows unflattened (n1, Tq): queries and first keys mixed up", SCORES,
           "S.unflatten(-2, qk1.shape[-3:-1][::-1])", "S.unflatten(-2, qk1.shape[-3:-1])"),
    Mutant("q times K1 summed over d first (a standard attention score times K2)", SCORES,
           "qk1 = (q * scale)[..., :, None, :] * K1[..., None, :, :].sum(-1, keepdim=True)",
           "qk1 = (q * scale)[..., :, None, :] * K1[..., None, :, :]"),
    Mutant("every query scored as the first: q[..., :1, :]", SCORES,
           "(q[..., :1, :] * scale)[..., :, None, :] * K1[..., None, :, :]\n"
           "    qk1 = qk1.expand(*q.shape[:-2], q.shape[-2], *qk1.shape[-2:])",
           "(q * scale)[..., :, None, :] * K1[..., None, :, :]"),

    Mutant("queries, keys and pairs flattened with .view and bmm (the model's queries are a transpose)", SCORES,
           "Tq, d = q.shape[-2:]\n"
           "qk1 = ((q * scale).view(-1, Tq, 1, d) * K1.view(-1, 1, K1.shape[-2], d)).view(-1, Tq * K1.shape[-2], d)\n"
           "S = torch.bmm(qk1, K2.view(-1, K2.shape[-2], d).transpose(1, 2))\n"
           "return S.view(*q.shape[:-2], Tq, K1.shape[-2], K2.shape[-2])"),

    # -- pair_softmax
    Mutant("softmax written by hand, its sum in the scores' dtype (float16 overflows past 65,504)", SOFTMAX,
           "if allowed is not None:\n"
           "    S = S.masked_fill(~allowed, float(\"-inf\"))\n"
           "E = (S - S.amax((-2, -1), keepdim=True)).exp()\n"
           "return E / E.sum((-2, -1), keepdim=True)"),
    Mutant("softmax in float32, never cast back to the scores' dtype", SOFTMAX,
           "torch.softmax(S.flatten(-2).float(), dim=-1)", "torch.softmax(S.flatten(-2), dim=-1)"),
    Mutant("masked pairs filled with -1e9, not -inf (float16 cannot hold it)", SOFTMAX,
           "S.masked_fill(~allowed, -1e9)", "S.masked_fill(~allowed, float(\"-inf\"))"),
    Mutant("a softmax over the last axis only (b), not over all pairs", SOFTMAX,
           "return torch.softmax(S, dim=-1)", "return torch.softmax(S.flatten(-2), dim=-1).view(S.shape)"),
    Mutant("two softmaxes, one per pair axis", SOFTMAX,
           "return torch.softmax(torch.softmax(S, dim=-1), dim=-2)",
           "return torch.softmax(S.flatten(-2), dim=-1).view(S.shape)"),
    Mutant("the mask ignored", SOFTMAX, "if False:", "if allowed is not None:"),
    Mutant("the mask inverted: allowed pairs masked out", SOFTMAX, "S.masked_fill(allowed,", "S.masked_fill(~allowed,"),
    Mutant("masked pairs set to 0, not -inf", SOFTMAX, "S.masked_fill(~allowed, 0.0)",
           "S.masked_fill(~allowed, float(\"-inf\"))"),
    Mutant("exp / sum without subtracting the maximum (overflows)", SOFTMAX,
           "E = S.exp()\n    return E / E.sum((-1, -2), keepdim=True)",
           "return torch.softmax(S.flatten(-2), dim=-1).view(S.shape)"),
    Mutant("allowed=None unsupported: the mask applied without checking for None", SOFTMAX,
           "S = S.masked_fill(~allowed, float(\"-inf\"))",
           "if allowed is not None:\n    S = S.masked_fill(~allowed, float(\"-inf\"))"),
    Mutant("the softmax over the queries and pairs of a row together", SOFTMAX,
           "return torch.softmax(S.flatten(-3), dim=-1).view(S.shape)",
           "return torch.softmax(S.flatten(-2), dim=-1).view(S.shape)"),

    # -- factored_output
    Mutant("the output in float32 whatever the inputs' dtype", OUTPUT,
           "P, V1, V2 = P.float(), V1.float(), V2.float()\n"
           "PV2 = (P.flatten(-3, -2) @ V2).unflatten(-2, P.shape[-3:-1])",
           "PV2 = (P.flatten(-3, -2) @ V2).unflatten(-2, P.shape[-3:-1])"),
    Mutant("calls the shipped kron_rows: forms V1 (/) V2 (n1 n2 d numbers)", OUTPUT,
           "return P.flatten(-2) @ kron_rows(V1, V2)"),
    Mutant("V1 and V2 swapped", OUTPUT,
           "PV2 = (P.transpose(-1, -2).flatten(-3, -2) @ V1).unflatten(-2, P.shape[-3:-1])\n"
           "return (V2[..., None, :, :] * PV2).sum(-2)"),
    Mutant("the mean over a, not the sum", OUTPUT, ".mean(-2)", ".sum(-2)"),
    Mutant("summed over d, not over a", OUTPUT, ".sum(-1)", ".sum(-2)"),
    Mutant("V1 not weighted in: sum over a of P @ V2", OUTPUT, "(PV2).sum(-2)", "(V1[..., None, :, :] * PV2).sum(-2)"),
    Mutant("P renormalised over each row a", OUTPUT,
           "(P / P.sum(-1, keepdim=True).clamp_min(1e-30)).flatten(-3, -2)", "P.flatten(-3, -2)"),
    Mutant("V1 of the first token only", OUTPUT, "V1[..., None, :1, :]", "V1[..., None, :, :]"),
    Mutant("P normalised again over all its pairs (a no-op on a softmax)", OUTPUT,
           "(P / P.sum((-2, -1), keepdim=True)).flatten(-3, -2)", "P.flatten(-3, -2)"),
    Mutant("one leading dimension only: P taken as (B, Tq, n1, n2)", OUTPUT,
           "B, Tq, n1, n2 = P.shape\n"
           "PV2 = (P.reshape(B, Tq * n1, n2) @ V2).view(B, Tq, n1, -1)\n"
           "return (V1[:, None] * PV2).sum(2)"),

    # -- two_cache_append: the whole TwoCache.append
    Mutant("rebuilds every pair from the shipped kron_rows at each append (earlier rows move)", APPEND,
           "self.factors.append(k1, k2, v1, v2, pos)\n"
           "f = self.factors\n"
           "self.kt, self.vt = Rows(), Rows()\n"
           "self._pos_a, self._pos_b = Rows(dim=0), Rows(dim=0)\n"
           "self.kt.append(kron_rows(f.k1.t, f.k2.t))\n"
           "self.vt.append(kron_rows(f.v1.t, f.v2.t))\n"
           "self._pos_a.append(f.pos.repeat_interleave(len(f)))\n"
           "self._pos_b.append(f.pos.repeat(len(f)))"),
    Mutant("old_k2 read after the factors grew: (new, new) pairs twice", APPEND,
           "f.append(k1, k2, v1, v2, pos)\n        if n:\n            old_k2, old_v2, old_pos = f.k2.t, f.v2.t, f.pos",
           "if n:       # views of the first n rows (an append writes after them or into a new buffer: they stay "
           "valid)\n            old_k2, old_v2, old_pos = f.k2.t, f.v2.t, f.pos\n"
           "        f.append(k1, k2, v1, v2, pos)"),
    Mutant("only (old a, new b) and (new a, old b): the (new, new) pairs missing", APPEND,
           "self.kt.append(kron_rows(f.k1.t[..., :n, :], k2))\n"
           "        self.vt.append(kron_rows(f.v1.t[..., :n, :], v2))\n"
           "        self._pos_a.append(f.pos[:n].repeat_interleave(m))\n"
           "        self._pos_b.append(pos.repeat(n))",
           "self.kt.append(kron_rows(f.k1.t, k2))\n"
           "        self.vt.append(kron_rows(f.v1.t, v2))\n"
           "        self._pos_a.append(f.pos.repeat_interleave(m))\n"
           "        self._pos_b.append(pos.repeat(n + m))"),
    Mutant("the positions of a row's b taken with repeat_interleave (a's layout)", APPEND,
           "self._pos_b.append(pos.repeat_interleave(n + m))", "self._pos_b.append(pos.repeat(n + m))"),
    Mutant("(new a, old b) rows: the positions of a taken with repeat, not repeat_interleave", APPEND,
           "self._pos_a.append(pos.repeat(n))", "self._pos_a.append(pos.repeat_interleave(n))"),
    Mutant("(new a, old b) rows get positions (old, new)", APPEND,
           "self._pos_a.append(old_pos.repeat(m))\n            self._pos_b.append(pos.repeat_interleave(n))",
           "self._pos_a.append(pos.repeat_interleave(n))\n            self._pos_b.append(old_pos.repeat(m))"),
    Mutant("V~ rows built from the keys' second factor", APPEND,
           "self.vt.append(kron_rows(f.v1.t, k2))", "self.vt.append(kron_rows(f.v1.t, v2))"),
    Mutant("token indices as positions (0..n-1), not the given positions", APPEND,
           "self._pos_a.append(torch.arange(n + m).repeat_interleave(m))\n"
           "        self._pos_b.append(torch.arange(n, n + m).repeat(n + m))",
           "self._pos_a.append(f.pos.repeat_interleave(m))\n"
           "        self._pos_b.append(pos.repeat(n + m))"),
    Mutant("the factor rows not stored (the next pairs see no old token)", APPEND,
           "f.append(k1[..., :0, :], k2[..., :0, :], v1[..., :0, :], v2[..., :0, :], pos[:0])",
           "f.append(k1, k2, v1, v2, pos)"),
    Mutant("a chunk adds the pairs of its first token only", APPEND,
           "n, m = len(f), 1\n        k1, k2, v1, v2, pos = k1[..., :1, :], k2[..., :1, :], v1[..., :1, :], "
           "v2[..., :1, :], pos[:1]",
           "n, m = len(f), len(pos)"),
]

ACCEPTABLE: dict[str, str] = {}
