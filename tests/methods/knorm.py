"""A test-only scorer: keep the keys with the smallest L2 norm (kvpress's KnormPress, after Devoto et al.,
"A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", 2024). It exists to show what a
new scoring method costs over the existing wrappers: a score, and nothing else. Whether its premise (a small key
norm draws attention) holds on a model: ``python -m experiments.analysis.key_norm``."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from nanollm.checks import check_budget
from nanollm.policy import ScoringPolicy, StepContext


@dataclass
class KnormPolicy(ScoringPolicy):
    budget: int

    def __post_init__(self) -> None:
        check_budget(self.budget)

    def score(self, ctx: StepContext) -> Tensor:
        return -ctx.kv.k.float().norm(dim=-1)          # (B, H_kv, T): a smaller key norm ranks higher
