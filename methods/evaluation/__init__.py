"""
Measuring the methods against the full cache on the same model, prompts and decoding.

    harness.py        one sample through the full cache and every method: traces, metrics, greedy answers
    side_by_side.py   one prompt pass and one decode step for many caches at once, each cache's numbers
                      the same whichever caches run beside it (``FanOut``, ``step_many``)
    shards.py         one evaluation over several processes or machines (``torchrun``)
    compare.py        the main job's engine: every method x budget x task x mode, records, tables, plot
                      (the command is ``python -m methods.compare``)
    intervals.py      95% intervals of the accuracies, and which differences are within noise
    language_modelling.py  perplexity and KL under compression over a long natural text
                      (``python -m methods.evaluation.language_modelling``)
    bench.py          decode-step time and bytes read at long contexts (``python -m methods.evaluation.bench``)
    throughput.py     many caches decoded one by one against batched (``python -m methods.evaluation.throughput``)
    viz.py            pictures of which tokens a cache kept
    generate.py       ``python -m methods.evaluation.generate``: nanollm's generation command with ``--method``
"""
