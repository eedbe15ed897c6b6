"""
Plausible slips in each lesson's by-hand builds: the cells where the reader writes a method's step by hand (a
course region with a task, ``# BEGIN SOLUTION [cache:mask] ...``) and the lesson asserts it equal to the library.
``test_by_hand.py`` writes each slip into its region and runs the lesson: a check must refuse it.

A slip is a course ``Mutant`` (``course/mutants.py``): in the region of its task, the text ``old`` (exactly once)
becomes ``new``; its name says what the mistake is.
"""

from __future__ import annotations

from course.mutants import Mutant

SLIPS: dict[str, list[Mutant]] = {
    "00_nanollm_kv_cache": [
        Mutant("used set to the step's size, not advanced by it", "append", "used = n_new", "used = end"),
        Mutant("positions not stored", "append", "_ = k, v, pos", "pos_buf[:, :, used:end] = k, v, pos"),
        Mutant("empty slots (-1) attended", "mask", "", "(pos[:, :, None, :] >= 0) & "),
        Mutant("the mask from slot numbers, not the stored positions", "mask",
               "visible = torch.arange(pos.shape[-1]) <= q_pos[:, None]",
               "visible = (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= q_pos[:, None])"),
        Mutant("< for <=: a query does not see its own token", "mask", "< q_pos", "<= q_pos"),
        Mutant("KV heads repeated, not interleaved, for their query heads", "mask",
               "repeat(1, group, *[1] * (t.dim() - 2))", "repeat_interleave(group, dim=1)"),
    ],
    "01_baselines": [
        Mutant("the sinks not cut by a small budget", "sinks_and_recent",
               "sinks = n_sink", "sinks = min(n_sink, budget - 1)"),
        Mutant("one recent token too few", "sinks_and_recent", "p > seen - recent", "p >= seen - recent"),
        Mutant("query head h given to KV head h % H_kv", "h2o_observe", "scores[h % n_kv_head,", "scores[h // G,"),
        Mutant("attention averaged over the queries, not summed", "h2o_observe", "probs[h].mean(0)", "probs[h].sum(0)"),
        Mutant("summed over a group's query heads, not averaged", "h2o_observe", "+= received", "+= received / G"),
        Mutant("the window's votes averaged, not summed", "window_vote",
               "probs[:, T - window:, :T - window].mean(1)", "probs[:, T - window:, :T - window].sum(1)"),
        Mutant("average pooling, not max", "window_vote", ".mean(-1)", ".max(-1).values"),
        Mutant("query heads grouped interleaved", "window_vote",
               "pooled.view(H // n_kv_head, n_kv_head, -1).mean(0)",
               "pooled.view(n_kv_head, H // n_kv_head, -1).mean(1)"),
        Mutant("the group's votes averaged before the pooling, not after", "window_vote",
               "votes = probs[:, T - window:, :T - window].sum(1).view(n_kv_head, H // n_kv_head, -1).mean(1)"
               ".repeat_interleave(H // n_kv_head, 0)",
               "votes = probs[:, T - window:, :T - window].sum(1)"),
        Mutant("no safeguard", "adakv", "", '        ranked[j, best] = float("inf")\n'),
        Mutant("the budget of one head for the whole layer", "adakv", "pairs[:budget]", "pairs[:H_kv * budget]"),
    ],
    "02_scissorhands": [
        Mutant("the uniform level over all tokens, not those the query sees", "keep_score", "1 / T)", "1 / n_visible)"),
        Mutant("the uniform level one token off", "keep_score", "1 / (n_visible + 1))", "1 / n_visible)"),
        Mutant("the uniform level one token off, the other way", "keep_score",
               "1 / max(n_visible - 1, 1))", "1 / n_visible)"),
        Mutant("at the level is low (<= for <)", "keep_score", "attn[i, n] <= 1", "attn[i, n] < 1"),
        Mutant("the r most recent not protected", "keep_score", "older = range(T)", "older = range(T - n_recent)"),
        Mutant("ties broken by the least attention", "keep_score", "float(attn[-1, n])", "-float(attn[-1, n])"),
        Mutant("ties broken by the earliest token, not the last attention", "keep_score",
               "(counts[n], n)", "(counts[n], -float(attn[-1, n]))"),
        Mutant("later tokens flagged (the causal mask forgotten)", "keep_score",
               "for n in range(T):", "for n in range(n_visible):"),
    ],
    "03_tensor_attention": [
        Mutant("one softmax per row a, not over all pairs", "pair_softmax",
               "P / P.sum(1, keepdim=True)", "P / P.sum()"),
        Mutant("no scale", "pair_softmax", "(q * K1[a] * K2[b]).sum()", "scale * (q * K1[a] * K2[b]).sum()"),
        Mutant("pairs (b, a) for (a, b)", "pair_softmax", "(q * K1[b] * K2[a])", "(q * K1[a] * K2[b])"),
    ],
    "04_perturbation_selection": [
        Mutant("stage 1 rounds alpha B, not floor", "two_stage",
               "n_first = round(alpha * budget)", "n_first = int(alpha * budget)"),
        Mutant("stage 1's entries not kept through stage 2", "two_stage",
               "    pass", '    score[stage1] = float("inf")'),
        Mutant("stage 2 ranks by P alone", "two_stage", "score = vnorm.clone()", "score = attn * vnorm"),
    ],
    "05_chunkkv": [
        Mutant("a chunk scored by its best vote", "chunk_ranking",
               "float(votes[chunk].max())", "float(votes[chunk].sum())"),
        Mutant("a chunk scored by its mean vote", "chunk_ranking",
               "float(votes[chunk].mean())", "float(votes[chunk].sum())"),
        Mutant("a chunk that does not fit skipped, not the end", "chunk_ranking",
               "            continue", "            break"),
    ],
    "06_kvreviver": [
        Mutant("values added without their signs", "insert",
               "cell_v[i, h[i, J]] += v[J]", "cell_v[i, h[i, J]] += g[i, J] * v[J]"),
        Mutant("keys signed too", "insert", "cell_k[i, h[i, J]] += g[i, J] * k[J]", "cell_k[i, h[i, J]] += k[J]"),
        Mutant("the mean over rows, not the median", "query", "k_rows.mean(dim=0)", "k_rows.median(dim=0).values"),
        Mutant("the minimum over rows (count-min), not the median", "query",
               "k_rows.min(dim=0).values", "k_rows.median(dim=0).values"),
        Mutant("the sign not applied when reading", "query",
               "v_rows = cell_v[rows, h]", "v_rows = g[..., None] * cell_v[rows, h]"),
    ],
    "07_kernels": [
        Mutant("the running output not rescaled", "online_softmax",
               "a = a + p", "a = torch.exp(m - m_new)[:, None] * a + p"),
        Mutant("the running sum not rescaled", "online_softmax", "l = l + p", "l = torch.exp(m - m_new) * l + p"),
        Mutant("the sums added without their weights", "merge_splits",
               "sum(l for m, l, _ in ranges)", "sum(torch.exp(m - M) * l for m, l, _ in ranges)"),
        Mutant("each range normalised, then averaged", "merge_splits",
               "return sum(a / l[:, None] for m, l, a in ranges) / len(ranges)",
               "return top / sum(torch.exp(m - M) * l for m, l, _ in ranges)[:, None]"),
    ],
}
