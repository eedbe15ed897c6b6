"""
KVReviver's per-layer budgets: a layer's share of the slots in proportion to the Fisher information of its key
and value projections (Yuan et al., arXiv 2512.17917, appendix "Fisher Information"; the formula is not given,
ours follows Palu's recipe, which the appendix cites).

    budgets = fisher_layer_budgets(model, calibration_ids, budget=64)      # a tuple, one per layer
    policy = make_policy("kvreviver", budget=64, layer_budgets=budgets)    # the same total slots
"""

from __future__ import annotations

import torch
from torch import Tensor

from nanollm.checks import check_budget


def fisher_information(model, ids: Tensor, chunk: int = 128) -> list[float]:
    """Per layer, the empirical Fisher information of W_K and W_V, summed (Yuan et al., appendix "Fisher
    Information": a layer's is the sum of its key and value weight matrices'; the formula is not given).

    Our reading, Palu's recipe that the appendix cites: split ``ids`` (T,) into chunks of ``chunk`` tokens; for
    each chunk take the gradient of its mean next-token negative log-likelihood with respect to W_K and W_V,
    square it entry by entry and add over chunks and entries:  F_l = sum_chunks (||dL/dW_K,l||^2 +
    ||dL/dW_V,l||^2). Deterministic (no sampling, no dropout); the model's weights are left as they were."""
    ids = ids.view(-1)
    if ids.numel() < 2:
        raise ValueError(f"Fisher information needs at least 2 tokens of calibration text, got {ids.numel()}")
    weights = [(block.attn.k_proj.weight, block.attn.v_proj.weight) for block in model.blocks]
    was_training, flags = model.training, [p.requires_grad for p in model.parameters()]
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    for wk, wv in weights:
        wk.requires_grad_(True), wv.requires_grad_(True)
    fisher = torch.zeros(len(weights), dtype=torch.float64)
    try:
        with torch.enable_grad():
            for start in range(0, ids.numel() - 1, chunk):
                piece = ids[start:start + chunk + 1].view(1, -1)                 # (1, <= chunk + 1)
                if piece.shape[1] < 2:
                    break
                logits = model(piece[:, :-1])                                    # (1, T, vocab)
                loss = torch.nn.functional.cross_entropy(logits[0].float(), piece[0, 1:])
                grads = torch.autograd.grad(loss, [w for pair in weights for w in pair])
                for layer in range(len(weights)):
                    gk, gv = grads[2 * layer], grads[2 * layer + 1]
                    fisher[layer] += float(gk.double().pow(2).sum() + gv.double().pow(2).sum())
    finally:
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)
        model.train(was_training)
    return fisher.tolist()


def allocate(weights: list[float], budget: int, minimum: int = 1) -> tuple[int, ...]:
    """``len(weights) * budget`` slots shared out in proportion to ``weights``, each layer at least
    ``minimum``: the minimums first, the rest by largest remainder (ties to the lower layer), so the budgets
    sum exactly to the uniform total."""
    L = len(weights)
    total, w = L * budget, torch.tensor(weights, dtype=torch.float64)
    if L == 0 or total < L * minimum:
        raise ValueError(f"{L} layers at least {minimum} slots each do not fit in {total} slots")
    if not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"layer weights must be finite, >= 0 and not all 0, got {weights}")
    share = (total - L * minimum) * w / w.sum()                                  # (L,) slots beyond the minimum
    extra = share.floor().long()
    left = (total - L * minimum) - int(extra.sum())                              # < L slots left by the floors
    order = sorted(range(L), key=lambda i: (-(float(share[i]) - int(extra[i])), i))
    for i in order[:left]:
        extra[i] += 1
    return tuple(int(minimum + e) for e in extra)


def fisher_layer_budgets(model, ids: Tensor, budget: int, chunk: int = 128) -> tuple[int, ...]:
    """Per-layer budgets for ``KVReviverPolicy(layer_budgets=...)``: the uniform total ``n_layer * budget``
    shared in proportion to each layer's Fisher information of W_K and W_V on the calibration text ``ids``
    (``fisher_information``), at least 1 slot per layer."""
    check_budget(budget)
    return allocate(fisher_information(model, ids, chunk), budget)
