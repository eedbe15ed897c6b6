"""
KV-cache methods: one file per method, each a ``nanollm.policy.CachePolicy`` dataclass, and the registry.

    from methods import METHODS, make_policy
    policy = make_policy("snapkv", budget=64, window=16)     # == METHODS["snapkv"](budget=64, window=16)

``METHODS`` is an explicit dict, name -> policy class. Every class takes ``budget`` (tokens kept per layer
per KV head, protected tokens included) plus its own options, with paper defaults. Tests and notebooks
iterate over it: registering a method here puts it under tests/test_policy_contract.py.

Contract declarations a policy may add (all optional; the contract test reads them with defaults):

    slack(n_prompt, n_decoded) -> int     entries per KV head allowed beyond ``budget`` after a prompt of
                                          n_prompt tokens and n_decoded later tokens (default 0); the
                                          layer total must stay <= H_kv * (budget + slack)
    head_slack(n_kv_head) -> int          extra entries one KV head may hold when heads get unequal
                                          budgets (AdaKV); the layer total is unaffected (default 0)
    protected_positions(n_prompt, seen)   positions every KV head must still hold (sinks, windows)
"""

from __future__ import annotations

import dataclasses

from nanollm.policy import CachePolicy, check_budget

from .adakv import AdaKVPolicy
from .full import FullPolicy
from .h2o import H2OPolicy
from .snapkv import SnapKVPolicy
from .streaming_llm import StreamingLLMPolicy

METHODS: dict[str, type[CachePolicy]] = {
    "full": FullPolicy,                    # keeps everything: the reference
    "streaming_llm": StreamingLLMPolicy,   # sinks + recent window (Xiao et al. 2024)
    "h2o": H2OPolicy,                      # accumulated-attention heavy hitters + recent (Zhang et al. 2023)
    "snapkv": SnapKVPolicy,                # observation-window vote at prefill (Li et al. 2024)
    "adakv": AdaKVPolicy,                  # SnapKV scores, head-adaptive budgets (Feng et al. 2025)
}


def method_options(name: str) -> list[str]:
    """The options ``make_policy(name, budget, **options)`` accepts besides ``budget``."""
    cls = METHODS[name]
    return [f.name for f in dataclasses.fields(cls) if f.init and f.name != "budget"]


def make_policy(name: str, budget: int, **options) -> CachePolicy:
    """A fresh policy of method ``name`` keeping ``budget`` tokens per layer per KV head.

    Raises ValueError for an unknown method or option (naming the valid ones) and for ``budget <= 0``.
    """
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}")
    check_budget(budget)
    valid = method_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for method {name!r}; valid options: {valid}")
    return METHODS[name](budget=budget, **options)


__all__ = ["METHODS", "AdaKVPolicy", "FullPolicy", "H2OPolicy", "SnapKVPolicy", "StreamingLLMPolicy",
           "make_policy", "method_options"]
