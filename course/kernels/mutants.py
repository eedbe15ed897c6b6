"""Hand-written mutants of the ``kernels`` assignment (instructor-only, like test_hidden.py): plausible
mistakes in the online softmax (decode_attention.py's split kernel, count_sketch.py's base-2 step) and in the
merge of the ranges (merge_splits and the three merge kernels), and calls to the other implementations (which
the tests take away while one is graded). ``python -m course.mutants kernels`` grades them with the
catalogue's."""

from course.mutants import Mutant

MUTANTS = [
    # -- online_softmax: the decode kernel's loop body (decode_attention.py) -----------------------------------
    Mutant("no running max: exp of the raw scores", "online_softmax",
           old='m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)',
           new="m_safe = tl.zeros_like(m_new)"),
    Mutant("no guard for a range without tokens (exp(-inf - -inf) = nan)", "online_softmax",
           old='m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)',
           new="m_safe = m_new"),
    Mutant("the rescale inverted: exp(m_new - m)", "online_softmax",
           old="alpha = tl.exp(m - m_safe)", new="alpha = tl.exp(m_safe - m)"),
    Mutant("acc not rescaled (fp32 path)", "online_softmax",
           old='acc = acc * alpha[:, None] + tl.dot(p, vb, input_precision="ieee")',
           new='acc = acc + tl.dot(p, vb, input_precision="ieee")'),
    Mutant("acc not rescaled (16-bit path)", "online_softmax",
           old="acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)",
           new="acc = acc + tl.dot(p.to(vb.dtype), vb)"),
    Mutant("padding counted in the max (as a score of 0)", "online_softmax",
           old="m_new = tl.maximum(m, tl.max(s, axis=1))",
           new="m_new = tl.maximum(m, tl.max(tl.where(valid[None, :], s, 0.0), axis=1))"),
    Mutant("exp(s) * exp(-m) for exp(s - m) (overflows at large scores)", "online_softmax",
           old="p = tl.exp(s - m_safe[:, None])", new="p = tl.exp(s) * tl.exp(-m_safe[:, None])"),
    Mutant("each block normalised on its own (a softmax per block)", "online_softmax",
           old="p = tl.exp(s - m_safe[:, None])",
           new="p = tl.exp(s - m_safe[:, None])\np = p / tl.sum(p, axis=1)[:, None]"),
    Mutant("the scale applied a second time (q is already scaled)", "online_softmax",
           old="m_new = tl.maximum(m, tl.max(s, axis=1))",
           new="s = s * scale\nm_new = tl.maximum(m, tl.max(s, axis=1))"),
    Mutant("the mask left out of the 16-bit path's scores", "online_softmax",
           old='s = tl.where(valid[None, :], s, float("-inf"))',
           new='s = tl.where(valid[None, :] | (not DOT_FP32), s, float("-inf"))'),
    Mutant("the decode kernel calls count_sketch.py's online-softmax step (in base 2)", "online_softmax",
           old="m_new = tl.maximum(m, tl.max(s, axis=1))",
           new="from kernels.count_sketch import _online_softmax_step\n"
               "m2, l, acc = _online_softmax_step(q.to(tl.float32) * 1.4426950408889634, kb.to(tl.float32),\n"
               "                                  vb.to(tl.float32), valid, m * 1.4426950408889634, l, acc)\n"
               "m_new = m2 / 1.4426950408889634"),
    Mutant("the fp32 products in tf32 (tl.dot without input_precision='ieee': a GPU's default)", "online_softmax",
           old='s = tl.dot(q, tl.trans(kb), input_precision="ieee")', new="s = tl.dot(q, tl.trans(kb))"),
    Mutant("the padding masked for m and p only: s, stored for H2O, holds 0 there (not -inf)", "online_softmax",
           old="m = m_new", new="m = m_new\ns = tl.where(valid[None, :], s, 0.0)"),
    Mutant("the 16-bit path's weights in float16 whatever the cache (a GPU's bfloat16 cache)", "online_softmax",
           old="acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)",
           new="acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), vb)"),
    # -- online_softmax: count_sketch.py's base-2 step -----------------------------------------------------------
    Mutant("base e in the base-2 step (exp for exp2)", "online_softmax",
           old="p = tl.exp2(s - m_new[:, None])", new="p = tl.exp(s - m_new[:, None])"),
    Mutant("the base-2 step does not rescale l", "online_softmax",
           old="l_i = l_i * alpha + tl.sum(p, axis=1)", new="l_i = l_i + tl.sum(p, axis=1)"),
    Mutant("the base-2 step does not rescale acc", "online_softmax",
           old="acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)",
           new="acc = acc + tl.sum(p[:, :, None] * v[None, :, :], axis=1)"),
    Mutant("the base-2 step returns the old max", "online_softmax",
           old="return m_new, l_i, acc", new="return m_i, l_i, acc"),
    Mutant("the base-2 step scores with the wrong axis of k", "online_softmax",
           old="s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)",
           new="s = tl.sum(q[:, None, :] * tl.trans(k)[None, :, :], axis=2)"),

    # -- merge_splits: merge_splits (PyTorch) ------------------------------------------------------------------
    Mutant("no common max: weights exp(m)", "merge_splits",
           old="w = torch.exp(m - M)", new="w = torch.exp(m)"),
    Mutant("an empty range's m = -inf read as 0 before the max", "merge_splits",
           old="M = m.max(dim=1, keepdim=True).values",
           new="M = torch.where(m == float(\"-inf\"), 0.0, m).max(dim=1, keepdim=True).values"),
    Mutant("the mean of the ranges' outputs acc / l", "merge_splits",
           old="return (w[..., None] * acc).sum(1) / (w * l).sum(1)[..., None]",
           new="return (acc / l[..., None]).nan_to_num().mean(1)"),
    Mutant("l summed without the weights", "merge_splits",
           old="return (w[..., None] * acc).sum(1) / (w * l).sum(1)[..., None]",
           new="return (w[..., None] * acc).sum(1) / l.sum(1)[..., None]"),
    Mutant("the range with the largest max only", "merge_splits",
           old="return (w[..., None] * acc).sum(1) / (w * l).sum(1)[..., None]",
           new="best = m.argmax(dim=1, keepdim=True)\n"
               "return acc.gather(1, best[..., None].expand(-1, -1, -1, acc.shape[-1]))[:, 0] / "
               "l.gather(1, best)[:, 0, :, None]"),
    Mutant("the max over the query heads instead of the ranges", "merge_splits",
           old="M = m.max(dim=1, keepdim=True).values", new="M = m.max(dim=2, keepdim=True).values"),
    Mutant("merge_splits calls decode_attention.py's merge kernel", "merge_splits",
           old="M = m.max(dim=1, keepdim=True).values",
           new="return merge_splits_triton(m.contiguous(), l.contiguous(), acc.contiguous())"),
    Mutant("merge_splits launches _merge_splits_kernel itself", "merge_splits",
           old="M = m.max(dim=1, keepdim=True).values",
           new="out = torch.empty(acc.shape[0], acc.shape[2], acc.shape[3])\n"
               "_merge_splits_kernel[(acc.shape[0], acc.shape[2])](m.contiguous(), l.contiguous(), acc.contiguous(),"
               " out, acc.shape[1], G=acc.shape[2], D=acc.shape[3], BLOCK_S=32)\n"
               "return out"),
    Mutant("merge_splits calls count_sketch.py's merge kernel (base 2)", "merge_splits",
           old="M = m.max(dim=1, keepdim=True).values",
           new="from kernels.count_sketch import merge_sketch_splits_triton\n"
               "R, S, G, d = acc.shape\n"
               "out = merge_sketch_splits_triton((m * 1.4426950408889634).contiguous(), l.contiguous(),\n"
               "                                 acc.contiguous(), torch.empty(R * G, d))\n"
               "return out.view(R, G, d)"),
    Mutant("merge_splits calls tensor_decode.py's combine kernel", "merge_splits",
           old="M = m.max(dim=1, keepdim=True).values",
           new="from kernels.tensor_decode import tensor_decode_combine_kernel\n"
               "R, S, G, d = acc.shape\n"
               "out = torch.empty(R * G, d)\n"
               "tensor_decode_combine_kernel[(R * G,)](m.transpose(1, 2).contiguous(), l.transpose(1, 2).contiguous(),"
               "\n    acc.transpose(1, 2).contiguous(), out, d, SPLITS=S, SPLITS_P2=next_pow2(S), BLOCK_D=d)\n"
               "return out.view(R, G, d)"),
    # -- merge_splits: the three merge kernels -----------------------------------------------------------------
    Mutant("decode merge kernel: only the first block of ranges", "merge_splits",
           old="    w = tl.exp(tl.load(m_ptr + row, mask=ok, other=float(\"-inf\")) - M_all)",
           new="    w = tl.exp(tl.load(m_ptr + row, mask=ok, other=float(\"-inf\")) - M_all)\n"
               "    w = tl.where(first == 0, w, 0.0)"),
    Mutant("decode merge kernel: exp2 for exp", "merge_splits",
           old="w = tl.exp(tl.load(m_ptr + row, mask=ok, other=float(\"-inf\")) - M_all)",
           new="w = tl.exp2(tl.load(m_ptr + row, mask=ok, other=float(\"-inf\")) - M_all)"),
    Mutant("decode merge kernel: masked ranges count as a max of 0", "merge_splits",
           old="M = tl.maximum(M, tl.load(m_ptr + (r * n_splits + first + sp) * G + g,\n"
               "                              mask=first + sp < n_splits, other=float(\"-inf\")))",
           new="M = tl.maximum(M, tl.load(m_ptr + (r * n_splits + first + sp) * G + g,\n"
               "                              mask=first + sp < n_splits, other=0.0))"),
    Mutant("decode merge kernel: the query heads' rows mixed up (g * n_splits)", "merge_splits",
           old="row = (r * n_splits + first + sp) * G + g",
           new="row = r * n_splits * G + g * n_splits + first + sp"),
    Mutant("decode merge kernel: l summed without the weights", "merge_splits",
           old="l_sum += w * tl.load(l_ptr + row, mask=ok, other=0.0)\n"
               "    acc = tl.load(",
           new="l_sum += tl.load(l_ptr + row, mask=ok, other=0.0)\n"
               "    acc = tl.load("),
    Mutant("sketch merge kernel: exp for exp2 (base e)", "merge_splits",
           old="w = tl.exp2(tl.load(m_ptr + row, mask=ok, other=float(\"-inf\")) - M_all)",
           new="w = tl.exp(tl.load(m_ptr + row, mask=ok, other=float(\"-inf\")) - M_all)"),
    Mutant("sketch merge kernel: no common max", "merge_splits",
           old="w = tl.exp2(tl.load(m_ptr + row, mask=ok, other=float(\"-inf\")) - M_all)",
           new="w = tl.exp2(tl.load(m_ptr + row, mask=ok, other=float(\"-inf\")))"),
    Mutant("sketch merge kernel: the padded group's stride forgotten (G for G_PAD)", "merge_splits",
           old="row = (h * n_splits + first + sp) * G_PAD + g",
           new="row = (h * n_splits + first + sp) * G + g"),
    Mutant("tensor combine kernel: no common max", "merge_splits",
           old="w = tl.exp(m - tl.max(m, axis=0))", new="w = tl.exp(m)"),
    Mutant("tensor combine kernel: l summed without the weights", "merge_splits",
           old="o = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)",
           new="o = tl.sum(w[:, None] * acc, axis=0) / tl.sum(l, axis=0)"),
    Mutant("tensor combine kernel: masked splits loaded as m = 0", "merge_splits",
           old='m = tl.load(m_ptr + part, mask=mask_s, other=float("-inf"))',
           new="m = tl.load(m_ptr + part, mask=mask_s, other=0.0)"),
    Mutant("the 16-bit path's scores accumulated in float16 (out_dtype)", "online_softmax",
           old="s = tl.dot(q, tl.trans(kb))",
           new="s = tl.dot(q, tl.trans(kb), out_dtype=tl.float16).to(tl.float32)"),
    Mutant("decode merge kernel: the max over the first block of ranges only", "merge_splits",
           old="M_all = tl.max(M, axis=0)\nl_sum = tl.zeros([BLOCK_S], tl.float32)",
           new="M_all = tl.max(tl.load(m_ptr + (r * n_splits + sp) * G + g, mask=sp < n_splits, "
               "other=float(\"-inf\")), axis=0)\nl_sum = tl.zeros([BLOCK_S], tl.float32)"),
    Mutant("tensor combine kernel: every range weighted by the first range's max", "merge_splits",
           old="w = tl.exp(m - tl.max(m, axis=0))", new="w = tl.exp(m - tl.load(m_ptr + pid_bh * SPLITS))"),
    Mutant("sketch merge kernel: the store not masked to the d columns (D_PAD written)", "merge_splits",
           old="out.to(out_ptr.dtype.element_ty),\n         mask=offs_d < D)", new="out.to(out_ptr.dtype.element_ty))"),
    Mutant("sketch merge kernel: the output's strides ignored (rows of D)", "merge_splits",
           old="tl.store(out_ptr + (h * G + g) * stride_oh + offs_d * stride_od,",
           new="tl.store(out_ptr + (h * G + g) * D + offs_d,"),
    Mutant("tensor combine kernel: the store not masked to the d columns (BLOCK_D written)", "merge_splits",
           old="o.to(out_ptr.dtype.element_ty), mask=offs_d < d)", new="o.to(out_ptr.dtype.element_ty))"),
]

ACCEPTABLE: dict[str, str] = {}
