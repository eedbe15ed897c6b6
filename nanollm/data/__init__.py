"""
The synthetic long-context tasks the bundled models are trained and evaluated on.

    words.py      the word lists the tasks draw from
    tasks.py      RULER-style samples (needles, variable tracking, common words): context, question, answer
    evaluate.py   answering a sample with a cache and a policy, in the two modes, and scoring the answer
"""
