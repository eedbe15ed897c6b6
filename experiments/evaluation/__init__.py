"""
Measuring the methods against the full cache on the same model, prompts and decoding.

The plain path, read in this order (``README.md`` here tells how to add a method, a task or a metric):

    task.py           a task: its samples, prompt chunks, reference answer, answer length and scorer
    engine.py         the plain engine: fill caches with a prompt, step them by one token
    protocol.py       teacher forcing, then greedy answers from forks; ``run_job``, the main loop
    metrics.py        one entry per metric: what it reads, how it reduces; ``rescore`` from a records file

Beside it:

    side_by_side.py   the fast engine (``--engine fast``, the default): one prompt pass and one decode
                      step for many caches at once, each cache's numbers the same whichever run beside it
    batched.py        the batched engine (``--engine batched``): the caches' attention batched too, for a GPU
    engines.py        the engines by name (``make_engine``)
    launches.py       the tensor operations (a GPU's launches) of one sample of the main job, by phase and method
    together.py       several samples' decode steps taken as one (``--together``)
    harness.py        the protocol as the notebooks call it (model and sample in, traces out)
    compare.py        the main job: every method x budget x task x mode, records, tables, plot
                      (the command is ``python -m experiments.compare``)
    shards.py         one evaluation over several processes or machines (``torchrun``)
    intervals.py      95% intervals of the accuracies, and which differences are within noise
    language_modelling.py  perplexity and KL under compression over a long natural text
    bench.py          decode-step time and bytes read at long contexts (``python -m experiments.evaluation.bench``)
    throughput.py     many caches decoded one by one against batched (``python -m experiments.evaluation.throughput``)
    rescore.py        the answers a results file keeps, scored again (``python -m experiments.evaluation.rescore``)
    viz.py            pictures of which tokens a cache kept
    generate.py       ``python -m experiments.evaluation.generate``: nanollm's generation command with ``--method``

A keep ratio R, in every command, sets a budget: ``budget_for(R, N)`` entries per layer and KV head, N the
command's context length (``--length`` in ``compare``, the context in ``bench``, the text's first half in
``language_modelling``). ``compare`` keeps one budget for every sample of a run, and records beside the
ratio it asked for (``keep_ratio``) the share of each sample's compressed tokens it kept
(``realised_keep_ratio``), which is larger: a prompt is shorter than ``--length`` (README.md, "Keep ratio").
"""


def budget_for(keep_ratio: float, tokens: int) -> int:
    """The budget (tokens kept per layer per KV head) of a keep ratio over ``tokens``: at least one."""
    return max(1, round(keep_ratio * tokens))


def keep_ratio(budget: int | None, tokens: int) -> float:
    """The keep ratio a budget realises over ``tokens``, to four decimals (None, the full cache: 1.0)."""
    return 1.0 if budget is None else round(budget / tokens, 4)
