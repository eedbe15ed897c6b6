"""
What a decode-time method declares about its one-token decode step: the rule every path runs.

A method that evicts while decoding (StreamingLLM, H2O, Scissorhands) writes its rule once, in its own file,
as tensor operations over fixed shapes: slots (B, H_kv, C) whose empty ones have position -1, so that the
same function serves the reading path's policy (``evict``), the batched evaluation's rows
(``experiments/evaluation/row_hooks.py``) and the graph and fused steps (``fastpath/graph.py``, ``fused.py``,
whose Triton kernels keep these functions as their references). Its policy's ``decode_rule()`` says which
rule and with what numbers, or why it has none; the fast paths read that, never the policy's type.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeRule:
    """What a one-token decode step empties after its attention: ``kind`` "none" (nothing: prefill-only
    methods), "sinks" (StreamingLLM, ``streaming_llm.evict_oldest``: the oldest position at or after
    ``n_sink``), "heavy" (H2O, ``h2o.evict_lowest``: the lowest score outside the ``n_recent`` latest) or
    "scissors" (Scissorhands, ``scissorhands.evict_one``: the most low flags outside the ``n_recent``
    latest), once a head holds more than ``budget`` entries."""

    kind: str = "none"
    budget: int = 0
    n_sink: int = 0          # StreamingLLM's S = min(n_sink, budget - 1), as ``sinks_and_recent``
    n_recent: int = 0        # H2O's and Scissorhands' recent window
    window: int = 0          # Scissorhands' w, the queries its ring buffer remembers
    threshold: float | None = None   # Scissorhands' tau (None: 1 / entries attended)

    def capacity(self, n: int, max_new_tokens: int) -> int:
        """Slots a layer holding n slots after the prompt needs for ``max_new_tokens`` more: every new token
        a slot of its own, or, evicting, at most budget + 1 (the step attends over budget + 1, then empties
        one, which the next token takes)."""
        if self.kind == "none":
            return n + max_new_tokens
        return max(n, min(n + max_new_tokens, self.budget + 1))

    def unbudgeted(self) -> DecodeRule:
        """The rule but for its budget and recent window: caches whose rules agree on it step as one."""
        return DecodeRule(self.kind, n_sink=self.n_sink, window=self.window, threshold=self.threshold)


def own_hooks(policy, cls, *names: str) -> bool:
    """Whether ``policy``'s class runs ``cls``'s own ``names`` (a subclass that changes one runs another rule,
    which its declaration does not describe)."""
    return all(getattr(type(policy), name) is getattr(cls, name) for name in names)
