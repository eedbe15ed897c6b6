"""
Full cache: the reference every method is measured against.

Paper: none; plain KV caching keeps every key and value of every token. With a budget that covers the
sequence, every method's logits must equal these bit for bit in fp32. ``budget`` is accepted, so that
``make_policy("full", budget)`` works like every other method, and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanollm.checks import check_budget
from nanollm.policy import FullCache


@dataclass
class FullPolicy(FullCache):
    """Keep every token (``nanollm.policy.FullCache`` with the registry's constructor signature).

    Parameters
    ----------
    budget : ignored; accepted for a uniform ``make_policy(name, budget)``. None is allowed.
    """

    budget: int | None = None

    def __post_init__(self) -> None:
        if self.budget is not None:
            check_budget(self.budget)

    def slack(self, n_prompt: int, n_decoded: int) -> int:
        """Entries per KV head beyond ``budget``: everything above it, since nothing is evicted."""
        return max(0, n_prompt + n_decoded - (self.budget or 0))

    def protected_positions(self, n_prompt: int, seen: int) -> list[int]:
        """Every position is kept."""
        return list(range(seen))
