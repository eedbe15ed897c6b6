"""
fastpath: the same decoder, faster, plugged in from above. The reading path (``nanollm/``) never imports it.

    attention.py   a decode step without a mask where none is needed, split over CPU threads on long
                   caches, or computed by the split-K Triton kernel on a GPU (``kernels.serves``);
                   ``FastAttention``, what a layer's attention looks like to the cache with that step
    lean.py        ``LeanDecoder``: a decode step with fewer, larger operations (stacked weights, no module
                   calls), for tiny models whose step is bound by dispatch, not bytes
    sketch.py      KVReviver's count sketch on the Triton kernels of ``kernels/count_sketch.py``
    graph.py       ``GraphDecoder``: a decode step over fixed-capacity buffers with its counters on the device,
                   captured once per shape in a CUDA graph and replayed per token (eager on a CPU); prefill-only
                   methods, StreamingLLM, H2O and Scissorhands decode on it, the others fall back to the lean
                   step, saying so
    fused.py       ``FusedGraphDecoder``: the graph step with its element-wise work compiled by inductor
    skinny.py      ``SkinnyGraphDecoder``: the fused step with its products, and the norms, SwiGLU, residual
                   adds, RoPE and the write around them, in ``kernels/skinny_matmul.py`` and ``skinny_qkv.py``
    tune.py        the split kernel's launch (tokens per block, programs per SM, warps, stages) timed on
                   the GPU at hand, the fastest kept for every later launch (``python -m fastpath.bench --tune``);
                   the skinny kernel's per product
    e2e.py         whole decode steps timed (``python -m fastpath.bench --e2e``): lean, graph, fused and skinny step,
                   full cache vs keep 0.1, transformers' StaticCache step, at the copy bandwidth of the same run
    gpu_check.sh   what a GPU must show, in stages of under ten minutes: ``--e2e``, the tests, the main job
                   (``compare``), the fast tier (``suite``)

Each computes what the reading path computes: ``tests/fastpath/`` compares them (bit for bit on CPU where
the arithmetic is the same, at float tolerance where the kernels or stacked products sum in another order).

The graph, fused and skinny steps are tested on a CPU (their logits equal the lean step's; ``torch.compile`` with
``fullgraph=True`` traces the graph step whole in the slow tier) and on a GPU, where ``fastpath/README.md``
has what they measured (``bash fastpath/gpu_check.sh results/decode_e2e.json`` on an H100 or H200).
"""
