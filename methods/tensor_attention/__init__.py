"""
Tensor attention: another attention module for the nanollm decoder, its two cache layouts, and the
experiments around them (its benchmark is ``experiments/tensor_attention_bench.py``).

    attention.py       the module (five projections; a query scores pairs of tokens), the four- and two-matrix
                       caches, the three decode paths (``tensor_cache(config, "four" | "four-naive" | "two")``)
    index_problem.py   Theorem 4.1/4.2's Index problem: how many bits a cache needs to answer it
    subgen.py          SubGen-style compression of the pair attention (clustered keys, sampled values)
    match3.py          a task only pairs of tokens solve: train and evaluate tensor vs standard models
                       (``python -m methods.tensor_attention.match3``); the bundled models are in checkpoints/

A model names the module as ``ModelConfig.attention = "methods.tensor_attention:TensorAttention"``, so the
names below are what this package exports.
"""

from .attention import (
                        LAYOUTS,
                        TENSOR_ATTENTION,
                        FourCache,
                        NaiveFourCache,
                        Rows,
                        TensorAttention,
                        TwoCache,
                        causal_tensor_attention,
                        factored_output,
                        four_cache_attention,
                        kron_rows,
                        naive_four_cache_attention,
                        pair_scores,
                        pair_softmax,
                        tensor_cache,
                        two_cache_attention,
)

__all__ = ["LAYOUTS", "TENSOR_ATTENTION", "FourCache", "NaiveFourCache", "Rows", "TensorAttention", "TwoCache",
           "causal_tensor_attention", "factored_output", "four_cache_attention", "kron_rows",
           "naive_four_cache_attention", "pair_scores", "pair_softmax", "tensor_cache", "two_cache_attention"]
