"""Hand-written mutants of the ``scissorhands`` assignment (instructor-only): plausible student mistakes, one per
mutant, for ``python -m course.mutants scissorhands``. Each must lose at least half of its task's points."""

from course.mutants import Mutant

MUTANTS = [
    # low_flags: Algorithm 2's indicator
    Mutant("low at or below the level (<= for <)", "low_flags", "attn <= threshold", "attn < threshold"),
    Mutant("high flags instead of low ones (> for <)", "low_flags", "attn > threshold", "attn < threshold"),
    Mutant("the level over every slot, not the attended ones", "low_flags",
           "1.0 / visible.shape[-1]", "1.0 / visible.sum(-1, keepdim=True).clamp(min=1)"),
    Mutant("the level counts the queries, not the slots (wrong axis)", "low_flags",
           "visible.sum(-2, keepdim=True)", "visible.sum(-1, keepdim=True)"),
    Mutant("unattended slots can be low (no visible mask)", "low_flags",
           "return attn < threshold", "return visible & (attn < threshold)"),
    Mutant("a given threshold is ignored", "low_flags", "if True:", "if threshold is None:"),
    Mutant("the level of the last query for every query", "low_flags",
           "1.0 / visible[..., -1:, :].sum(-1, keepdim=True).clamp(min=1)",
           "1.0 / visible.sum(-1, keepdim=True).clamp(min=1)"),
    Mutant("the level counts only the attended slots with non-zero attention", "low_flags",
           "1.0 / (visible & (attn > 0)).sum(-1, keepdim=True).clamp(min=1)",
           "1.0 / visible.sum(-1, keepdim=True).clamp(min=1)"),
    Mutant("the level counts the attended slots of every batch row", "low_flags",
           "visible.sum((0, -1), keepdim=True)", "visible.sum(-1, keepdim=True)"),
    Mutant("calls the shipped persistence.heavy (square causal attention only)", "low_flags",
           "from experiments.analysis.persistence import heavy\n"
           "B, H_kv, Tn, T = attn.shape\n"
           "return visible & ~heavy(attn.reshape(B * H_kv, Tn, T)).view(B, H_kv, Tn, T)"),
    Mutant("the level in float64 (a uniform float32 softmax row falls below it)", "low_flags",
           "1.0 / visible.sum(-1, keepdim=True).clamp(min=1).double()",
           "1.0 / visible.sum(-1, keepdim=True).clamp(min=1)"),
    Mutant("a margin against float noise (below the level by more than 1e-6)", "low_flags",
           "return visible & (attn < threshold - 1e-6)", "return visible & (attn < threshold)"),
    Mutant("the level as the mean attention over the attended slots (the row's sum rounds above 1)", "low_flags",
           "(attn * visible).sum(-1, keepdim=True) / visible.sum(-1, keepdim=True).clamp(min=1)",
           "1.0 / visible.sum(-1, keepdim=True).clamp(min=1)"),

    # keep_score: the lexicographic order
    Mutant("counters plus attention as one float (not exact in float32)", "keep_score",
           "return (attn.double() - counts).masked_fill(pos < 0, float(\"-inf\"))"),
    Mutant("more low flags kept first (sign of the counters)", "keep_score",
           "rank + counts * T", "rank - counts * T"),
    Mutant("lower attention kept first on a tie", "keep_score", "(T - 1 - rank) - counts * T", "rank - counts * T"),
    Mutant("counters not scaled by T (attention outweighs them)", "keep_score", "rank - counts", "rank - counts * T"),
    Mutant("T read from the heads' axis", "keep_score", "T = counts.shape[1]", "T = counts.shape[-1]"),
    Mutant("attention ranked across the KV heads (wrong axis)", "keep_score",
           "a.sort(dim=1).values", "a.sort(dim=-1).values"),
    Mutant("a head's attention ranked across the batch rows", "keep_score",
           "h = a.transpose(0, 1).reshape(a.shape[1], -1)\n"
           "rank = torch.searchsorted(h.sort(dim=-1).values, h).view(a.shape[1], a.shape[0], T).transpose(0, 1)",
           "rank = torch.searchsorted(a.sort(dim=-1).values, a)"),
    Mutant("row 0's attention ranking for every batch row", "keep_score",
           "rank = torch.searchsorted(a[0].sort(dim=-1).values, a[0])",
           "rank = torch.searchsorted(a.sort(dim=-1).values, a)"),
    Mutant("empty slots not set to -inf", "keep_score",
           "return score", "return score.masked_fill(pos < 0, float(\"-inf\"))"),
    Mutant("counters only, attention ignored", "keep_score",
           "return (-counts).double().masked_fill(pos < 0, float(\"-inf\"))"),
    Mutant("the score in float16", "keep_score",
           "score = (rank - counts * T).half()", "score = (rank - counts * T).double()"),
    Mutant("attention ranked by a double argsort (equal attentions ranked by slot, the later higher)", "keep_score",
           "a.argsort(dim=-1, stable=True).argsort(dim=-1)", "torch.searchsorted(a.sort(dim=-1).values, a)"),
    Mutant("lexicographic order by two stable argsorts, ranked by argsort (equal keys by slot, the earlier higher)",
           "keep_score",
           "by_attn = attn.float().argsort(dim=-1, descending=True, stable=True)\n"
           "order = by_attn.gather(-1, counts.gather(-1, by_attn).argsort(dim=-1, stable=True))\n"
           "rank = order.argsort(dim=-1)\n"
           "return (counts.shape[-1] - 1 - rank).double().masked_fill(pos < 0, float(\"-inf\"))"),
    Mutant("counters scaled by a fixed 1000, not by T", "keep_score", "rank - counts * 1000", "rank - counts * T"),
    Mutant("counters scaled by the held slots, not by T (ranks count the empty ones too)", "keep_score",
           "rank - counts * (pos >= 0).sum(-1, keepdim=True)", "rank - counts * T"),
    Mutant("one float64 key, attention - 2 I, ranked exactly (the key rounds tiny attentions together)", "keep_score",
           "key = attn.double() - 2.0 * counts.double()\n"
           "rank = torch.searchsorted(key.sort(dim=-1).values, key)\n"
           "return rank.double().masked_fill(pos < 0, float(\"-inf\"))"),

    # n_dropped: m at a time
    Mutant("m not cut to budget - n_recent", "n_dropped", "m = drop", "m = min(drop, budget - n_recent)"),
    Mutant("m cut to the budget, not budget - n_recent", "n_dropped", "m = min(drop, budget)",
           "m = min(drop, budget - n_recent)"),
    Mutant("rounds down: one compression too few", "n_dropped",
           "return excess // m * m", "return math.ceil(excess / m) * m"),
    Mutant("drops exactly the excess, not m at a time", "n_dropped",
           "return excess", "return math.ceil(excess / m) * m"),
    Mutant("one compression of m, whatever the excess", "n_dropped", "return m", "return math.ceil(excess / m) * m"),
    Mutant("off by one: the budget counts as over", "n_dropped",
           "excess = n_slots - budget + 1", "excess = n_slots - budget"),
    Mutant("m one short of budget - n_recent", "n_dropped", "m = min(drop, budget - n_recent - 1)",
           "m = min(drop, budget - n_recent)"),
    Mutant("rounds up by int(x + 0.999) (wrong when m is over 1000)", "n_dropped",
           "return int(excess / m + 0.999) * m", "return math.ceil(excess / m) * m"),
    Mutant("m the larger of drop and budget - n_recent", "n_dropped", "m = max(drop, budget - n_recent)",
           "m = min(drop, budget - n_recent)"),
]

ACCEPTABLE = {
    "off_by_one at methods/scissorhands.py: 1 -> 2":
        "clamp(min=2) changes tau only for a query that attended one slot; a softmax over one slot gives it "
        "attention 1, below neither 1 nor 1/2: the same flags on every attention the policy sees",
    "off_by_one at methods/scissorhands.py: 1 -> 0":
        "clamp(min=0) changes tau only for a query that attended nothing (1/0 = inf); it has no slot to flag",
    "compare at methods/scissorhands.py: excess <= 0 -> excess < 0":
        "equivalent: at excess = 0 the formula gives ceil(0 / m) * m = 0 as the early return does",
    "off_by_one at methods/scissorhands.py: 0 -> -1":
        "equivalent: excess <= -1 lets excess = 0 through to ceil(0 / m) * m = 0",
}
