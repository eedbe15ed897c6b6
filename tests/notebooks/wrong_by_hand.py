"""
Plausible slips in each lesson's by-hand builds: the cells where the reader writes a method's step by hand (a
course region with a task, ``# BEGIN SOLUTION [cache:mask] ...``) and the lesson asserts it equal to the library.
``test_by_hand.py`` writes each slip into its region and runs the lesson: a check must refuse it.

A slip replaces the text ``old`` (exactly once in the region) with ``new``; ``why`` says what the mistake is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slip:
    region: str          # the region's id, "assignment:task"
    why: str
    old: str
    new: str


SLIPS: dict[str, list[Slip]] = {
    "00_nanollm_kv_cache": [
        Slip("cache:append", "used set to the step's size, not advanced by it", "used = end", "used = n_new"),
        Slip("cache:append", "positions not stored", "pos_buf[:, :, used:end] = k, v, pos",
             "_ = k, v, pos"),
        Slip("cache:mask", "empty slots (-1) attended", "(pos[:, :, None, :] >= 0) & ", ""),
        Slip("cache:mask", "the mask from slot numbers, not the stored positions",
             "visible = (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= q_pos[:, None])",
             "visible = torch.arange(pos.shape[-1]) <= q_pos[:, None]"),
        Slip("cache:mask", "< for <=: a query does not see its own token", "<= q_pos", "< q_pos"),
        Slip("cache:mask", "KV heads repeated, not interleaved, for their query heads",
             "repeat_interleave(group, dim=1)", "repeat(1, group, *[1] * (t.dim() - 2))"),
    ],
    "01_baselines": [
        Slip("baselines:sinks_and_recent", "the sinks not cut by a small budget", "sinks = min(n_sink, budget - 1)",
             "sinks = n_sink"),
        Slip("baselines:sinks_and_recent", "one recent token too few", "p >= seen - recent", "p > seen - recent"),
        Slip("baselines:h2o_observe", "query head h given to KV head h % H_kv", "scores[h // G,",
             "scores[h % n_kv_head,"),
        Slip("baselines:h2o_observe", "attention averaged over the queries, not summed", "probs[h].sum(0)",
             "probs[h].mean(0)"),
        Slip("baselines:h2o_observe", "summed over a group's query heads, not averaged", "+= received / G",
             "+= received"),
        Slip("baselines:window_vote", "the window's votes averaged, not summed",
             "probs[:, T - window:, :T - window].sum(1)", "probs[:, T - window:, :T - window].mean(1)"),
        Slip("baselines:window_vote", "average pooling, not max", ".max(-1).values", ".mean(-1)"),
        Slip("baselines:window_vote", "query heads grouped interleaved",
             "pooled.view(n_kv_head, H // n_kv_head, -1).mean(1)",
             "pooled.view(H // n_kv_head, n_kv_head, -1).mean(0)"),
        Slip("baselines:adakv", "no safeguard", '        ranked[j, best] = float("inf")\n', ""),
        Slip("baselines:adakv", "the budget of one head for the whole layer", "pairs[:H_kv * budget]",
             "pairs[:budget]"),
    ],
    "02_scissorhands": [
        Slip("scissorhands:keep_score", "the uniform level over all tokens, not those the query sees",
             "1 / n_visible)", "1 / T)"),
        Slip("scissorhands:keep_score", "the uniform level one token off", "1 / n_visible)", "1 / (n_visible + 1))"),
        Slip("scissorhands:keep_score", "the uniform level one token off, the other way", "1 / n_visible)",
             "1 / max(n_visible - 1, 1))"),
        Slip("scissorhands:keep_score", "at the level is low (<= for <)", "attn[i, n] < 1", "attn[i, n] <= 1"),
        Slip("scissorhands:keep_score", "the r most recent not protected", "older = range(T - n_recent)",
             "older = range(T)"),
        Slip("scissorhands:keep_score", "ties broken by the least attention", "-float(attn[-1, n])",
             "float(attn[-1, n])"),
        Slip("scissorhands:keep_score", "ties broken by the earliest token, not the last attention",
             "(counts[n], -float(attn[-1, n]))", "(counts[n], n)"),
        Slip("scissorhands:keep_score", "later tokens flagged (the causal mask forgotten)",
             "for n in range(n_visible):", "for n in range(T):"),
    ],
    "03_tensor_attention": [
        Slip("tensor_attention:pair_softmax", "one softmax per row a, not over all pairs", "P / P.sum()",
             "P / P.sum(1, keepdim=True)"),
        Slip("tensor_attention:pair_softmax", "no scale", "scale * (q * K1[a] * K2[b]).sum()",
             "(q * K1[a] * K2[b]).sum()"),
        Slip("tensor_attention:pair_softmax", "pairs (b, a) for (a, b)", "(q * K1[a] * K2[b])", "(q * K1[b] * K2[a])"),
    ],
    "04_perturbation_selection": [
        Slip("critical_kv:two_stage", "stage 1 rounds alpha b, not floor", "n_first = int(alpha * b)",
             "n_first = round(alpha * b)"),
        Slip("critical_kv:two_stage", "stage 1's entries not kept through stage 2",
             '    score[stage1] = float("inf")', "    pass"),
        Slip("critical_kv:two_stage", "stage 2 ranks by P alone", "score = attn * vnorm", "score = vnorm.clone()"),
    ],
    "05_chunkkv": [
        Slip("chunkkv:chunk_ranking", "a chunk scored by its best vote", "float(votes[chunk].sum())",
             "float(votes[chunk].max())"),
        Slip("chunkkv:chunk_ranking", "a chunk scored by its mean vote", "float(votes[chunk].sum())",
             "float(votes[chunk].mean())"),
        Slip("chunkkv:chunk_ranking", "a chunk that does not fit skipped, not the end", "            break",
             "            continue"),
    ],
    "06_kvreviver": [
        Slip("kvreviver:insert", "values added without their signs", "cell_v[i, h[i, J]] += g[i, J] * v[J]",
             "cell_v[i, h[i, J]] += v[J]"),
        Slip("kvreviver:insert", "keys signed too", "cell_k[i, h[i, J]] += k[J]",
             "cell_k[i, h[i, J]] += g[i, J] * k[J]"),
        Slip("kvreviver:query", "the mean over rows, not the median", "k_rows.median(dim=0).values",
             "k_rows.mean(dim=0)"),
        Slip("kvreviver:query", "the minimum over rows (count-min), not the median", "k_rows.median(dim=0).values",
             "k_rows.min(dim=0).values"),
        Slip("kvreviver:query", "the sign not applied when reading", "v_rows = g[..., None] * cell_v[rows, h]",
             "v_rows = cell_v[rows, h]"),
    ],
    "07_kernels": [
        Slip("kernels:online_softmax", "the running output not rescaled",
             "a = torch.exp(m - m_new)[:, None] * a + p", "a = a + p"),
        Slip("kernels:online_softmax", "the running sum not rescaled", "l = torch.exp(m - m_new) * l + p",
             "l = l + p"),
        Slip("kernels:merge_splits", "the sums added without their weights",
             "sum(torch.exp(m - M) * l for m, l, _ in ranges)", "sum(l for m, l, _ in ranges)"),
        Slip("kernels:merge_splits", "each range normalised, then averaged",
             "return top / sum(torch.exp(m - M) * l for m, l, _ in ranges)[:, None]",
             "return sum(a / l[:, None] for m, l, a in ranges) / len(ranges)"),
    ],
}
