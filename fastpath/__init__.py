"""
fastpath: the same decoder, faster, plugged in from above. The reading path (``nanollm/``) never imports it.

    attention.py   a decode step without a mask where none is needed, split over CPU threads on long
                   caches, or computed by the split-K Triton kernel on a GPU (``kernels.serves``);
                   ``FastAttention``, what a layer's attention looks like to the cache with that step
    lean.py        ``LeanDecoder``: a decode step with fewer, larger operations (stacked weights, no module
                   calls), for tiny models whose step is bound by dispatch, not bytes
    sketch.py      KVReviver's count sketch on the Triton kernels of ``kernels/count_sketch.py``

Each computes what the reading path computes: ``tests/fastpath/`` compares them (bit for bit on CPU where
the arithmetic is the same, at float tolerance where the kernels or stacked products sum in another order).
"""
