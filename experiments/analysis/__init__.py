"""
The papers' analyses, apart from the methods: measurements and theorems a notebook or a test checks, which
no policy needs to run.

    persistence.py           Scissorhands §3 and Appendix A: recorded attention maps, heavy tokens and their
                             persistence, the MLP block's input/output cosine (Figure 10)
    scissorhands_theory.py   Scissorhands' Theorem 4.1: the single-head model, the bound, a Monte-Carlo check
    layer_similarity.py      ChunkKV §3.3: how similar adjacent layers' kept positions are (Jaccard)
    rebuilt_attention.py     KVReviver Algorithm 4: attention mass on entries rebuilt from the sketch, key norms
"""
