"""Hand-written mutants of the ``critical_kv`` assignment (instructor-only): plausible student mistakes, one per
mutant, for ``python -m course.mutants critical_kv``. Each must lose at least half of its task's points."""

from course.mutants import Mutant

MUTANTS = [
    # output_perturbation: Theorem 1's A' and Eq. 5's L
    Mutant("A' not renormalised (the kept attention as it is)", "output_perturbation",
           "return kept", "return kept / kept.sum(-1, keepdim=True)"),
    Mutant("A' renormalised by the dropped mass", "output_perturbation",
           "return kept / (attn * ~keep).sum(-1, keepdim=True).clamp(min=1e-9)",
           "return kept / kept.sum(-1, keepdim=True)"),
    Mutant("the L2 norm of the change", "output_perturbation", ".pow(2).sum(-1).sqrt()", ".abs().sum(-1)"),
    Mutant("the change of the attention, not of the output", "output_perturbation",
           "return diff.abs().sum(-1)", "return (diff.unsqueeze(-2) @ projected).squeeze(-2).abs().sum(-1)"),
    Mutant("abs after the sum over the outputs", "output_perturbation", ".sum(-1).abs()", ".abs().sum(-1)"),
    Mutant("abs inside the sum over the entries (the triangle inequality)", "output_perturbation",
           "return (diff[..., None] * projected).abs().sum((-1, -2))",
           "return (diff.unsqueeze(-2) @ projected).squeeze(-2).abs().sum(-1)"),
    Mutant("the largest output change (L-infinity)", "output_perturbation", ".abs().amax(-1)", ".abs().sum(-1)"),
    Mutant("the mean over the outputs", "output_perturbation", ".abs().mean(-1)", ".abs().sum(-1)"),
    Mutant("2-D input only: torch.bmm over the rows (no other leading shape)", "output_perturbation",
           "torch.bmm(diff.unsqueeze(1), projected).squeeze(1)", "(diff.unsqueeze(-2) @ projected).squeeze(-2)"),
    Mutant("the dropped entries' output instead of the change", "output_perturbation",
           "diff = attn * ~keep", "diff = attn - renormalized_attention(attn, keep)"),
    Mutant("A' with a guard against 0 added to the kept mass", "output_perturbation",
           "return kept / (kept.sum(-1, keepdim=True) + 1e-6)", "return kept / kept.sum(-1, keepdim=True)"),
    Mutant("L in float32 whatever the inputs' type", "output_perturbation",
           "attn, projected = attn.float(), projected.float()\ndiff = attn - renormalized_attention(attn, keep)",
           "diff = attn - renormalized_attention(attn, keep)"),
    Mutant("the rows flattened with .view (fails on a transposed projected)", "output_perturbation",
           "n, D = projected.shape[-2:]\n"
           "return (diff.reshape(-1, 1, n) @ projected.view(-1, n, D)).view(*diff.shape[:-1], D).abs().sum(-1)",
           "return (diff.unsqueeze(-2) @ projected).squeeze(-2).abs().sum(-1)"),

    # perturbation_bound: Eq. 8
    Mutant("theta in float32 whatever the inputs' type", "perturbation_bound",
           "attn, vnorm = attn.float(), vnorm.float()\nC = (attn * vnorm).sum(-1)", "C = (attn * vnorm).sum(-1)"),
    Mutant("1 - 1/mass for 2 - 1/mass", "perturbation_bound", "(1 - 1 / kept_mass)", "(2 - 1 / kept_mass)"),
    Mutant("2 + 1/mass (a sign)", "perturbation_bound", "(2 + 1 / kept_mass)", "(2 - 1 / kept_mass)"),
    Mutant("C over the kept entries only", "perturbation_bound",
           "C = (attn * keep * vnorm).sum(-1)", "C = (attn * vnorm).sum(-1)"),
    Mutant("the kept mass over every entry", "perturbation_bound",
           "kept_mass = attn.sum(-1)", "kept_mass = (attn * keep).sum(-1)"),
    Mutant("the second sum over every entry, not the kept", "perturbation_bound",
           "* (attn * vnorm).sum(-1)", "* (attn * keep * vnorm).sum(-1)"),
    Mutant("plus for minus", "perturbation_bound", "return C + (2", "return C - (2"),
    Mutant("C dropped", "perturbation_bound", "return -(2", "return C - (2"),
    Mutant("P dropped from the kept term", "perturbation_bound",
           "* (attn * keep).sum(-1)", "* (attn * keep * vnorm).sum(-1)"),
    Mutant("the mass squared", "perturbation_bound", "(2 - 1 / kept_mass ** 2)", "(2 - 1 / kept_mass)"),

    # two_stage: Algorithm 1
    Mutant("stage 2 ignores stage 1 (the budget's top by the second ranking)", "two_stage",
           "s2 = ranking(second)", "s2 = ranking(second).masked_fill(stage1, float(\"inf\"))"),
    Mutant("n_first not capped at the budget", "two_stage",
           "n_first = torch.as_tensor(n_first, device=first.device).expand(lead)",
           "n_first = torch.minimum(torch.as_tensor(n_first, device=first.device).expand(lead), budgets)"),
    Mutant("the protected (+inf) entries counted on top of n_first", "two_stage",
           "n_first = torch.minimum(torch.as_tensor(n_first, device=first.device).expand(lead)"
           " + torch.isposinf(first).sum(-1), budgets)",
           "n_first = torch.minimum(torch.as_tensor(n_first, device=first.device).expand(lead), budgets)"),
    Mutant("NaN not moved to the bottom", "two_stage",
           "s = torch.nan_to_num(s.float(), neginf=lowest)",
           "s = torch.nan_to_num(s.float(), nan=lowest, neginf=lowest)"),
    Mutant("-inf left below the empty slots", "two_stage",
           "s = torch.nan_to_num(s.float(), nan=lowest, neginf=float(\"-inf\"))",
           "s = torch.nan_to_num(s.float(), nan=lowest, neginf=lowest)"),
    Mutant("the lowest scores first (ascending)", "two_stage", "descending=False", "descending=True"),
    Mutant("one entry too many in stage 1 (<= for <)", "two_stage",
           "(ranks(ranking(first)) <= n_first[..., None])", "(ranks(ranking(first)) < n_first[..., None])"),
    Mutant("stage 1 by the second ranking", "two_stage", "ranks(ranking(second)) < n_first",
           "ranks(ranking(first)) < n_first"),
    Mutant("the budget counted after stage 1 (n_first + budget kept)", "two_stage",
           "(ranks(s2) < (budgets + n_first)[..., None])", "(ranks(s2) < budgets[..., None])"),
    Mutant("empty slots compete", "two_stage", "return s", "return s.masked_fill(~valid, float(\"-inf\"))"),
    Mutant("empty slots ranked with NaN and -inf, not below them", "two_stage",
           "return torch.nan_to_num(s.float().masked_fill(~valid, float(\"-inf\")), nan=lowest, neginf=lowest)",
           "s = torch.nan_to_num(s.float(), nan=lowest, neginf=lowest)\n"
           "    return s.masked_fill(~valid, float(\"-inf\"))"),
    Mutant("empty slots compete for the budget (ranked last, kept when the budget exceeds the valid entries)",
           "two_stage",
           "valid = torch.ones_like(first, dtype=torch.bool) if valid is None else valid\n"
           "lead = first.shape[:-1]\n"
           "budgets = torch.as_tensor(budgets, device=first.device).expand(lead)\n"
           "n_first = torch.minimum(torch.as_tensor(n_first, device=first.device).expand(lead), budgets)\n"
           "lowest = torch.finfo(torch.float32).min\n"
           "\n"
           "def ranking(s: Tensor) -> Tensor:\n"
           "    s = torch.nan_to_num(s.float(), nan=lowest, neginf=lowest)\n"
           "    return s.masked_fill(~valid, float(\"-inf\"))\n"
           "\n"
           "def ranks(scores: Tensor) -> Tensor:\n"
           "    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices\n"
           "    steps = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)\n"
           "    return torch.empty_like(order).scatter_(-1, order, steps)\n"
           "\n"
           "stage1 = (ranks(ranking(first)) < n_first[..., None]) & valid\n"
           "s2 = ranking(second).masked_fill(stage1, float(\"inf\"))\n"
           "keep = ranks(s2) < budgets[..., None]"),
    Mutant("stage 2's budget - n_first ranked over every entry, stage 1's too (an overlap keeps fewer)", "two_stage",
           "keep = stage1 | ((ranks(ranking(second)) < (budgets - n_first)[..., None]) & valid)",
           "keep = (ranks(s2) < budgets[..., None]) & valid"),
    Mutant("stage 2 by the first ranking", "two_stage",
           "s2 = ranking(first).masked_fill", "s2 = ranking(second).masked_fill"),
    Mutant("an unstable sort (stable=True left out: ties in any order)", "two_stage",
           "descending=True)", "descending=True, stable=True)"),
    Mutant("torch.topk for the stable sort (ties in topk's order)", "two_stage",
           "order = scores.topk(scores.shape[-1], dim=-1).indices",
           "order = torch.sort(scores, dim=-1, descending=True, stable=True).indices"),
    Mutant("ties to the later entry", "two_stage",
           "order = scores.shape[-1] - 1 - torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices",
           "order = torch.sort(scores, dim=-1, descending=True, stable=True).indices"),
    Mutant("stage 1 ranks NaN and -inf as they are (only stage 2 cleans them)", "two_stage",
           "stage1 = (ranks(first.float().masked_fill(~valid, float(\"-inf\"))) < n_first[..., None]) & valid",
           "stage1 = (ranks(ranking(first)) < n_first[..., None]) & valid"),
    Mutant("stage 1 pushed below stage 2's scores, which then takes budget - n_first", "two_stage",
           "keep = stage1 | (ranks(s2.masked_fill(stage1, lowest)) < (budgets - n_first)[..., None]) & valid",
           "keep = (ranks(s2) < budgets[..., None]) & valid"),
    Mutant("stage 2's ties broken by the first score, not by position", "two_stage",
           "by_first = torch.sort(ranking(first), dim=-1, descending=True, stable=True).indices\n"
           "order = by_first.gather(-1, torch.sort(s2.gather(-1, by_first), dim=-1, descending=True, "
           "stable=True).indices)\n"
           "steps = torch.arange(s2.shape[-1]).expand_as(order)\n"
           "keep = (torch.empty_like(order).scatter_(-1, order, steps) < budgets[..., None]) & valid",
           "keep = (ranks(s2) < budgets[..., None]) & valid"),
]

ACCEPTABLE = {
    "drop_term at methods/critical_kv.py: (ranks(ranking(first)) < n_first[..., None]... -> "
    "ranks(ranking(first)) < n_first[..., None]":
        "equivalent: empty slots rank below every valid entry and n_first is at most the number of valid "
        "entries, so the first n_first ranks are valid without the & valid",
}
