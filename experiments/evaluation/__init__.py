"""
Measuring the methods against the full cache on the same model, prompts and decoding.

The plain path, read in this order (the folder's README lists every other file and tells how to add a
method, a task or a metric):

    task.py           a task: its samples, prompt chunks, reference answer, answer length and scorer
    engine.py         the plain engine: fill caches with a prompt, step them by one token
    protocol.py       teacher forcing, then greedy answers from forks; ``run_job``, the main loop
    metrics.py        one entry per metric: what it reads, how it reduces; ``rescore`` from a records file

A keep ratio R, in every command, sets a budget: ``budget_for(R, N)`` entries per layer and KV head, N the
command's context length; ``compare`` records beside the ratio asked for (``keep_ratio``) the share of each
sample's compressed tokens it kept (``realised_keep_ratio``): README.md, "Keep ratio".
"""


def budget_for(keep_ratio: float, tokens: int) -> int:
    """The budget (tokens kept per layer per KV head) of a keep ratio over ``tokens``: at least one."""
    return max(1, round(keep_ratio * tokens))


def keep_ratio(budget: int | None, tokens: int) -> float:
    """The keep ratio a budget realises over ``tokens``, to four decimals (None, the full cache: 1.0)."""
    return 1.0 if budget is None else round(budget / tokens, 4)
