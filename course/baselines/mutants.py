"""Hand-written mutants of the ``baselines`` assignment (instructor-only): plausible student mistakes, one per
mutant, for ``python -m course.mutants baselines``. Each must lose at least half of its task's points."""

from course.mutants import Mutant

NAN_AS_MINUS_INF = 's = torch.nan_to_num(scores.float(), nan=float("-inf"), neginf=float("-inf"))'   # adakv's

MUTANTS = [
    # sinks_and_recent: StreamingLLM's ranges (§3.2)
    Mutant("one recent token too few", "sinks_and_recent",
           "range(max(0, seen - R + 1), seen)", "range(max(0, seen - R), seen)"),
    Mutant("the window one token behind (the newest left out)", "sinks_and_recent",
           "range(max(0, seen - R - 1), seen - 1)", "range(max(0, seen - R), seen)"),
    Mutant("the sinks never shrink (S = n_sink)", "sinks_and_recent", "S = n_sink", "S = min(n_sink, budget - 1)"),
    Mutant("the sinks shrink to the budget, not budget - 1", "sinks_and_recent",
           "S = min(n_sink, budget)", "S = min(n_sink, budget - 1)"),
    Mutant("the window is the whole budget (R = budget)", "sinks_and_recent", "R = budget", "R = budget - S"),
    Mutant("sinks not yet seen are named", "sinks_and_recent", "range(0, S)", "range(0, min(S, seen))"),
    Mutant("the window may start before position 0", "sinks_and_recent",
           "range(seen - R, seen)", "range(max(0, seen - R), seen)"),
    Mutant("the window ends at seen + 1", "sinks_and_recent",
           "range(max(0, seen - R), seen + 1)", "range(max(0, seen - R), seen)"),
    Mutant("an unclamped window: R = budget - n_sink from seen - R (the sinks' cut ignored, before position 0)",
           "sinks_and_recent",
           "S = min(n_sink, budget - 1)\n"
           "R = budget - n_sink\n"
           "return [range(0, min(S, seen)), range(seen - R, seen)]"),
    Mutant("the window kept at least 1 beside uncut sinks (S = n_sink: more than the budget)", "sinks_and_recent",
           "S = n_sink\n"
           "R = max(budget - S, 1)\n"
           "return [range(0, min(S, seen)), range(max(0, seen - R), seen)]"),

    # h2o_observe: Algorithm 1's accumulated attention
    Mutant("H2O's GQA heads grouped as view(B, G, H_kv, T)", "h2o_observe",
           "view(B, H // n_kv_head, n_kv_head, T).mean(dim=1)", "view(B, n_kv_head, H // n_kv_head, T).mean(dim=2)"),
    Mutant("the sum over the group, not the mean", "h2o_observe",
           "view(B, n_kv_head, H // n_kv_head, T).sum(dim=2)", "view(B, n_kv_head, H // n_kv_head, T).mean(dim=2)"),
    Mutant("the max over the group, not the mean", "h2o_observe",
           "view(B, n_kv_head, H // n_kv_head, T).amax(dim=2)", "view(B, n_kv_head, H // n_kv_head, T).mean(dim=2)"),
    Mutant("the first query head of each group only", "h2o_observe",
           "view(B, n_kv_head, H // n_kv_head, T)[:, :, 0]", "view(B, n_kv_head, H // n_kv_head, T).mean(dim=2)"),
    Mutant("no GQA grouping: the mean over every query head", "h2o_observe",
           "return col_sums.float().mean(dim=1, keepdim=True).expand(B, n_kv_head, T)",
           "return col_sums.float().view(B, n_kv_head, H // n_kv_head, T).mean(dim=2)"),
    Mutant("a constant score (every slot an equal share)", "h2o_observe",
           "return torch.full((B, n_kv_head, T), float(col_sums.float().sum()) / (B * H * T))",
           "return col_sums.float().view(B, n_kv_head, H // n_kv_head, T).mean(dim=2)"),
    Mutant("decode overwrites the scores instead of adding", "h2o_observe",
           "ctx.kv.state[STATE].copy_(received)", "ctx.kv.state[STATE].add_(received)"),
    Mutant("new slots start at 1", "h2o_observe", "fill=1.0", "fill=0.0"),
    Mutant("prefill scores normalised by the number of queries", "h2o_observe",
           "set_state(STATE, received / ctx.kv.pos.shape[-1], fill=0.0)", "set_state(STATE, received, fill=0.0)"),
    Mutant("H2O's batch rows mixed: view(n_kv_head, -1, T) over the rows and heads together", "h2o_observe",
           "view(n_kv_head, -1, T).mean(dim=1).expand(B, n_kv_head, T)",
           "view(B, n_kv_head, H // n_kv_head, T).mean(dim=2)"),
    Mutant("KV heads counted from the batch axis", "h2o_observe",
           "received_attention(ctx.col_sums, ctx.kv.pos.shape[0])",
           "received_attention(ctx.col_sums, ctx.kv.pos.shape[1])"),

    # window_vote: SnapKV's score (§4.1-4.2)
    Mutant("SnapKV averages the window instead of summing it", "window_vote",
           "probs_window.float().mean(dim=2)", "probs_window.float().sum(dim=2)"),
    Mutant("the last window query's attention only", "window_vote",
           "probs_window.float()[:, :, -1]", "probs_window.float().sum(dim=2)"),
    Mutant("pools after the group mean", "window_vote",
           "vote = probs_window.float().sum(dim=2)\n"
           "B, H, Tp = vote.shape\n"
           "vote = vote.view(B, n_kv_head, H // n_kv_head, Tp).mean(dim=2)\n"
           "return pool1d(vote, kernel, pooling)",
           "vote = probs_window.float().sum(dim=2)                              # (B, H, Tp) summed over the window\n"
           "vote = pool1d(vote, kernel, pooling)                                # neighbours of a strong token\n"
           "B, H, Tp = vote.shape\n"
           "return vote.view(B, n_kv_head, H // n_kv_head, Tp).mean(dim=2)      # (B, H_kv, Tp) per KV head"),
    Mutant("SnapKV's GQA heads grouped as view(B, G, H_kv, Tp)", "window_vote",
           "vote.view(B, H // n_kv_head, n_kv_head, Tp).mean(dim=1)",
           "vote.view(B, n_kv_head, H // n_kv_head, Tp).mean(dim=2)"),
    Mutant("average pooling ignores the padding", "window_vote",
           "count_include_pad=False", "count_include_pad=True"),
    Mutant("pooling padded on the left only (causal)", "window_vote",
           "out = F.max_pool1d(F.pad(flat, (kernel - 1, 0), value=float(\"-inf\")), kernel, stride=1)",
           "out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)"),
    Mutant("the window's own votes pooled too", "window_vote",
           "own = window_vote(rows[..., T - w:], n_kv_head, kernel, pooling)",
           "own = window_vote(rows[..., T - w:], n_kv_head, 1, pooling)"),
    Mutant("pooled across the prefix / window boundary", "window_vote",
           "return torch.cat([window_vote(rows, n_kv_head, kernel, pooling)[..., :T - w], own], dim=-1)",
           "return torch.cat([window_vote(rows[..., :T - w], n_kv_head, kernel, pooling), own], dim=-1)"),
    Mutant("the first w rows vote, not the last", "window_vote",
           "rows = probs[:, :, :w, :]", "rows = probs[:, :, -w:, :]"),
    Mutant("a window longer than the prompt is not cut", "window_vote", "w = window", "w = min(window, T)"),
    Mutant("calls CriticalKV's window attention (a mean, not a sum)", "window_vote",
           "from types import SimpleNamespace\n"
           "from methods.critical_kv import CriticalKVPolicy\n"
           "vote = CriticalKVPolicy.window_attention(\n"
           "    SimpleNamespace(stage2=\"window\", window=probs_window.shape[2]),\n"
           "    SimpleNamespace(probs=probs_window, kv=[0] * probs_window.shape[-1], attended_pos=None))",
           "vote = probs_window.float().sum(dim=2)"),

    # adakv: Algorithm 1's allocation with its safeguard
    Mutant("AdaKV without its safeguard", "adakv", "s = s", "s = s.scatter(-1, safe, float(\"inf\"))"),
    Mutant("the safeguard over the whole layer, not per head", "adakv",
           "B, H_kv, T = scores.shape\n"
           "flat = torch.nan_to_num(scores.float(), nan=float(\"-inf\")).reshape(B, H_kv * T)\n"
           "if n_safe > 0:\n"
           "    safe = torch.sort(flat, dim=-1, descending=True, stable=True).indices[:, :H_kv * n_safe]\n"
           "    flat = flat.scatter(-1, safe, float(\"inf\"))\n"
           "top = torch.sort(flat, dim=-1, descending=True, stable=True).indices[:, :H_kv * budget]\n"
           "return torch.zeros(B, H_kv * T, dtype=torch.bool).scatter(1, top, True).view(B, H_kv, T)"),
    Mutant("a budget per head, no shared pool", "adakv",
           "B, H_kv, T = scores.shape\n"
           "s = torch.nan_to_num(scores.float(), nan=float(\"-inf\"))\n"
           "top = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :budget]\n"
           "return torch.zeros(B, H_kv, T, dtype=torch.bool).scatter(-1, top, True)"),
    Mutant("the safeguard keeps each head's worst", "adakv",
           "torch.sort(s, dim=-1, descending=False, stable=True).indices[..., :n_safe]",
           "torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :n_safe]"),
    Mutant("the safeguard on top of the pool (H_kv * (budget + n_safe))", "adakv",
           "indices[:, :H_kv * (budget + n_safe)]", "indices[:, :H_kv * budget]"),
    Mutant("the pool is one head's budget", "adakv", "indices[:, :budget]", "indices[:, :H_kv * budget]"),
    Mutant("torch.topk for the stable sorts (ties broken another way than the earlier entry)", "adakv",
           "s = torch.nan_to_num(scores.float(), nan=float(\"-inf\"))\n"
           "if n_safe > 0:\n"
           "    s = s.scatter(-1, s.topk(n_safe, dim=-1).indices, float(\"inf\"))\n"
           "top = s.reshape(B, H_kv * T).topk(H_kv * budget, dim=-1).indices\n"
           "mask = torch.zeros(B, H_kv * T, dtype=torch.bool, device=scores.device)\n"
           "return mask.scatter(1, top, True).view(B, H_kv, T)"),
    Mutant("NaN scores not counted as -inf", "adakv", "s = scores.float()",
           NAN_AS_MINUS_INF),
    Mutant("NaN scores become 0 (nan_to_num's default), above every negative score", "adakv",
           "s = torch.nan_to_num(scores.float())", NAN_AS_MINUS_INF),
    Mutant("-inf made the lowest float (nan_to_num's default), above NaN", "adakv",
           "s = torch.nan_to_num(scores.float(), nan=float(\"-inf\"))", NAN_AS_MINUS_INF),
    Mutant("the safeguard adds 1 to a head's best (scores read as attention, at most 1), not +inf", "adakv",
           "s = s.scatter(-1, safe, s.gather(-1, safe) + 1.0)", "s = s.scatter(-1, safe, float(\"inf\"))"),
    Mutant("the safeguard's sort without stable=True (ties in any order past 16 entries)", "adakv",
           "safe = torch.sort(s, dim=-1, descending=True).indices[..., :n_safe]",
           "safe = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :n_safe]"),
    Mutant("calls CriticalKV's two stages over the whole layer", "adakv",
           "B, H_kv, T = scores.shape\n"
           "from methods.critical_kv import two_stage_masks\n"
           "flat = torch.nan_to_num(scores.float(), nan=float(\"-inf\")).reshape(B, H_kv * T)\n"
           "return two_stage_masks(flat, flat, H_kv * budget, H_kv * n_safe)[1].view(B, H_kv, T)"),
]

ACCEPTABLE = {
    "compare at methods/adakv.py: n_safe > 0 -> n_safe >= 0": "equivalent: with n_safe = 0 the safeguard picks no "
    "entry, so running it changes nothing",
    "off_by_one at methods/adakv.py: 0 -> -1": "equivalent: n_safe > -1 differs from n_safe > 0 only at n_safe = 0, "
    "where the safeguard picks no entry",
    "-inf made the lowest float (nan_to_num's default), above NaN": "it differs only at a cut between a NaN and a "
    "-inf score (the docstring's 'NaN counts as -inf'), which one hidden test checks: 2 of the task's 5 points",
}
