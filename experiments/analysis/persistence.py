"""
Scissorhands' observations, measured on a model (Liu et al., NeurIPS 2023, arXiv 2305.17118): the attention
a full cache computes at every step (§3.1, Appendix A.1), which tokens are *heavy* (pulled more than the
uniform level) and whether they stay heavy ("persistence of importance", §3.2), and Appendix A.2's cosine
similarity of the MLP block's input and output (Figure 10).

None of this is needed to run the method (``methods/scissorhands.py``); notebook 02 and the tests use it to
check the hypothesis the method rests on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from nanollm.cache import KVCache
from nanollm.policy import CachePolicy, Needs, StepContext


class AttentionRecorder(CachePolicy):
    """Keeps everything and records batch row 0's attention probabilities at every step, per layer:
    ``steps[layer]`` is a list of (H, Tn, T) tensors (the prompt's rows first)."""

    def __init__(self) -> None:
        self.steps: dict[int, list[Tensor]] = {}

    def needs(self, phase: str) -> Needs:
        return Needs(rows=None)                 # every row: an analysis of short sequences

    def on_prefill(self, ctx: StepContext) -> None:
        self.steps[ctx.layer] = [ctx.probs[0].float().clone()]

    def on_decode(self, ctx: StepContext) -> None:
        self.steps[ctx.layer].append(ctx.probs[0].float().clone())

    def reset(self) -> None:
        self.steps = {}

    def matrix(self, layer: int) -> Tensor:
        """(H, N, N) every recorded query row over every position (zeros in the future), N = tokens seen."""
        rows = self.steps[layer]
        N = rows[-1].shape[-1]
        out = torch.zeros(rows[0].shape[0], N, N)
        i = 0
        for r in rows:                                                         # (H, Tn, T), T <= N
            out[:, i:i + r.shape[1], :r.shape[2]] = r
            i += r.shape[1]
        return out


@torch.no_grad()
def record_attention(model, ids: Tensor) -> list[Tensor]:
    """Full-cache attention of a prompt (1, N), one (H, N, N) matrix per layer. Row s is what the query at
    position s attends: the attention a full-cache decode would compute at that position."""
    recorder = AttentionRecorder()
    model(ids, cache=KVCache(model.config, recorder))
    return [recorder.matrix(layer) for layer in range(model.config.n_layer)]


def heavy(attn: Tensor, level: float = 1.0) -> Tensor:
    """(H, N, N) attention -> bool, token j is heavy for query s if attn >= level / (s + 1): ``level`` times
    the uniform level over the s + 1 tokens query s attends (level 1 is the complement of Algorithm 2's
    low flag; a larger level asks for a stronger pull)."""
    N = attn.shape[-1]
    uniform = 1.0 / torch.arange(1, N + 1, dtype=attn.dtype).view(N, 1)
    return (attn >= level * uniform) & torch.ones(N, N, dtype=torch.bool).tril()


def persistence_step(hv: Tensor, delta: int, start: int) -> tuple[Tensor, Tensor]:
    """Of the tokens heavy at step s, the fraction still heavy at step s + delta (mean over s >= start),
    and the base rate: the fraction of *all* tokens <= s heavy at step s + delta. Per head: (H,), (H,)."""
    H, N, _ = hv.shape
    ratios, bases = [], []
    for s in range(start, N - delta):
        now, later = hv[:, s, :s + 1], hv[:, s + delta, :s + 1]                 # (H, s + 1)
        ratios.append((now & later).sum(-1) / now.sum(-1).clamp(min=1))
        bases.append(later.sum(-1) / (s + 1))
    return torch.stack(ratios).float().mean(0), torch.stack(bases).float().mean(0)


def persistence_halves(hv: Tensor, split: int) -> tuple[Tensor, Tensor, Tensor]:
    """The sequence-level version: the tokens before ``split`` that any later step finds heavy, and the
    fraction of them that some step before ``split`` had already found heavy. Per head (H,):
    (ratio, base rate = |heavy early| / split, size of the late heavy set / split)."""
    early = hv[:, :split, :split].any(1)                                       # (H, split)
    late = hv[:, split:, :split].any(1)
    ratio = (early & late).sum(-1) / late.sum(-1).clamp(min=1)
    return ratio.float(), early.float().mean(-1), late.float().mean(-1)


PERSISTENCE_COLUMNS = ("step ratio, delta 1", "base rate", "step ratio, delta 50", "base rate", "sequence ratio",
                       "base rate", "share heavy at a step")


def persistence_by_layer(model, prompts: list[list[int]], levels: tuple[float, ...] = (1, 3),
                         start: int = 64) -> dict[float, Tensor]:
    """Both persistence measurements for every layer, at each ``level``: {level: (n_layer, 7)}, the columns of
    ``PERSISTENCE_COLUMNS`` (the step-to-step ratio and its base rate at delta = 1 and 50, over steps >= ``start``;
    the sequence-level ratio and base rate, split at the middle; the share of the tokens heavy at a step),
    each the mean over a layer's query heads, then over the ``prompts`` (lists of token ids)."""
    out: dict[float, list[Tensor]] = {level: [] for level in levels}
    for ids in prompts:
        maps = record_attention(model, torch.tensor([ids]))                   # n_layer x (H, N, N)
        for level in levels:
            rows = []
            for attn in maps:
                hv = heavy(attn, level)                                         # (H, N, N) bool
                N = hv.shape[-1]
                r1, b1 = persistence_step(hv, 1, start)
                r50, b50 = persistence_step(hv, 50, start)
                rh, bh, _ = persistence_halves(hv, N // 2)
                share = (hv.sum(-1) / torch.arange(1, N + 1))[:, start:].mean(-1)             # (H,)
                rows.append(torch.stack([r1, b1, r50, b50, rh, bh, share]).mean(-1))     # (7,): mean over heads
            out[level].append(torch.stack(rows))                                 # (n_layer, 7)
    return {level: torch.stack(tables).mean(0) for level, tables in out.items()}


@torch.no_grad()
def block_cosine(model, ids: Tensor) -> list[dict]:
    """Appendix A.2's check, per layer: cosine similarity and norms of the MLP sub-block's input h and
    output F(h) = h + mlp(norm(h)) (the paper's F, eq. (6)), and of the whole block's input and output;
    means over positions of ``ids`` (1, N)."""
    seen: list[dict] = [{} for _ in model.blocks]
    hooks = []
    for rec, block in zip(seen, model.blocks):
        hooks.append(block.register_forward_hook(lambda m, i, o, rec=rec: rec.update(x=i[0], out=o)))
        hooks.append(block.mlp_norm.register_forward_hook(lambda m, i, o, rec=rec: rec.update(h=i[0])))
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    return [{"cos_mlp": float(F.cosine_similarity(r["h"], r["out"], dim=-1).mean()),
             "cos_block": float(F.cosine_similarity(r["x"], r["out"], dim=-1).mean()),
             "norm_in": float(r["h"].norm(dim=-1).mean()), "norm_out": float(r["out"].norm(dim=-1).mean())}
            for r in seen]
