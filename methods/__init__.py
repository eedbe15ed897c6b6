"""
KV-cache methods: one file per method, each a ``nanollm.policy.CachePolicy`` dataclass, and the registry.

    from . import METHODS, make_policy
    policy = make_policy("snapkv", budget=64, window=16)      # == METHODS["snapkv"](budget=64, window=16)
    policy = make_policy("adakv(h2o)", budget=64)             # a wrapper around another scorer
    policy = make_policy("adakv", budget=64, inner="h2o")     # the same policy

``METHODS`` is an explicit dict, name -> policy class: registering a method here puts it under the contract tests
and the compare CLI. Every class takes ``budget`` (tokens kept per layer per KV head, protected tokens included)
plus its own options, with paper defaults. Scorers (``ScoringPolicy``: StreamingLLM, H2O, SnapKV, Scissorhands) rank
entries; wrappers (``PolicyWrapper``: AdaKV, ChunkKV, CriticalKV) turn an ``inner`` scorer's scores into a
selection, their ``default_inner`` when named alone; KVReviver and the full cache are policies of their own. A
*method spec* (``"adakv(snapkv)"``) names a method in Python, on the command line and in the JSON records alike;
``make_policy`` gives each option to the outermost policy that has it. A name ``MODULE:CLASS`` is a policy class
of one's own, imported (``"adakv(mine:KeyNorm)"``). More: ``methods/README.md``.
"""

from __future__ import annotations

import dataclasses

import nanollm.interrupt  # noqa: F401  (first: Ctrl-C while a command starts is one line, nanollm/interrupt.py)
from nanollm import cli
from nanollm.checks import check_budget
from nanollm.policy import CachePolicy, ScoringPolicy
from nanollm.wrapper import PolicyWrapper

from .adakv import AdaKVPolicy
from .chunkkv import ChunkKVPolicy
from .critical_kv import CriticalKVPolicy
from .full import FullPolicy
from .h2o import H2OPolicy
from .kvreviver import KVReviverPolicy
from .scissorhands import ScissorhandsPolicy
from .snapkv import SnapKVPolicy
from .streaming_llm import StreamingLLMPolicy

METHODS: dict[str, type[CachePolicy]] = {
    "full": FullPolicy,                    # keeps everything: the reference
    "streaming_llm": StreamingLLMPolicy,   # sinks + recent window (Xiao et al. 2024)
    "h2o": H2OPolicy,                      # accumulated-attention heavy hitters + recent (Zhang et al. 2023)
    "snapkv": SnapKVPolicy,                # observation-window vote at prefill (Li et al. 2024)
    "adakv": AdaKVPolicy,                  # head-adaptive budgets over a scorer (Feng et al. 2025)
    "chunkkv": ChunkKVPolicy,              # whole chunks of tokens + layer-wise index reuse (Liu et al. 2025)
    "kvreviver": KVReviverPolicy,          # evicted tokens in a count sketch, rebuilt every step (Yuan et al. 2025)
    "critical_kv": CriticalKVPolicy,       # perturbation-constrained two-stage selection over a host (Feng et al. 2025)
    "scissorhands": ScissorhandsPolicy,    # drop the tokens most often below average attention (Liu et al. 2023)
}


def policy_class(name: str) -> type[CachePolicy]:
    """The class a name in a method spec stands for: a registered name, or ``MODULE:CLASS``, a policy dataclass
    (a ``CachePolicy`` or a ``PolicyWrapper``) with a ``budget`` field, imported from a module of the folder
    the command runs in or of the Python path."""
    if name in METHODS:
        return METHODS[name]
    if ":" not in name:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}, wrap a scorer: {wrappers()} "
                         f"(one of {scorers()}), or name a policy class of your own as MODULE:CLASS")
    module, _, attr = name.partition(":")
    try:
        cls = cli.imported(module, attr)
    except Exception as e:                             # the user's module: any error (syntax too), in one line
        raise ValueError(f"method {name!r}: cannot import {attr!r} from module {module!r} "
                         f"({type(e).__name__}: {e})") from None
    if not (isinstance(cls, type) and issubclass(cls, (CachePolicy, PolicyWrapper)) and dataclasses.is_dataclass(cls)
            and "budget" in {f.name for f in dataclasses.fields(cls)}):
        raise ValueError(f"method {name!r}: {attr} is not a policy dataclass with a budget field (a subclass of "
                         "nanollm.policy.CachePolicy, ScoringPolicy or nanollm.wrapper.PolicyWrapper)")
    return cls


def scorers() -> list[str]:
    """Registered methods that rank entries and can sit inside a wrapper."""
    return [n for n, c in METHODS.items() if issubclass(c, ScoringPolicy) and not issubclass(c, PolicyWrapper)]


def wrappers() -> list[str]:
    """Registered methods that wrap an inner scorer."""
    return [n for n, c in METHODS.items() if issubclass(c, PolicyWrapper)]


def method_chain(spec: str) -> list[str]:
    """The names in a method spec, outermost first: ``"adakv(h2o)"`` -> ``["adakv", "h2o"]``; a wrapper named
    without an inner gets its default (``"adakv"`` -> ``["adakv", "snapkv"]``). Errors name the problem."""
    if not isinstance(spec, str):
        raise ValueError(f"a method must be named by a string such as 'snapkv' or 'adakv(h2o)', got {spec!r}")
    s = spec.replace(" ", "")
    chain = s.replace(")", "").split("(")
    if s != "(".join(chain) + ")" * (len(chain) - 1):
        raise ValueError(f"unbalanced brackets in method {spec!r}")
    for name in chain:
        policy_class(name)                                 # a registered name or MODULE:CLASS, or a ValueError
    while issubclass(policy_class(chain[-1]), PolicyWrapper):
        chain.append(policy_class(chain[-1]).default_inner)
    for outer, inner in zip(chain, chain[1:]):
        if not issubclass(policy_class(outer), PolicyWrapper):
            raise ValueError(f"{outer!r} is not a wrapper, so it cannot take {inner!r} inside; wrappers: {wrappers()}")
        if not issubclass(policy_class(inner), (ScoringPolicy, PolicyWrapper)):
            raise ValueError(f"{inner!r} does not score entries, so {outer!r} cannot wrap it; scorers: {scorers()}")
    return chain


def _own_options(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(policy_class(name)) if f.init and f.name not in ("budget", "inner")]


def method_options(spec: str) -> list[str]:
    """The options ``make_policy(spec, budget, **options)`` accepts besides ``budget``."""
    chain = method_chain(spec)
    return [opt for i, name in enumerate(chain) for opt in _own_options(name)
            if opt not in {o for outer in chain[:i] for o in _own_options(outer)}]


def make_policy(name: str, budget: int, inner: str | None = None, **options) -> CachePolicy:
    """A fresh policy for the method spec ``name`` keeping ``budget`` tokens per layer per KV head.

    ``inner`` (optional) names the scorer inside a wrapper: ``make_policy("adakv", 64, inner="h2o")`` is
    ``make_policy("adakv(h2o)", 64)``. Each option goes to the outermost policy of the chain that has it.
    Raises ValueError for an unknown method or option (naming the valid ones) and for ``budget <= 0``;
    ``"full"`` keeps everything, and takes ``budget=None``.
    """
    spec = name if inner is None else f"{name}({inner})"
    chain = method_chain(spec)
    if chain != ["full"] or budget is not None:          # the full cache alone may go without a budget
        check_budget(budget)
    n_named = spec.count("(") + 1                       # the rest of the chain are default inner scorers
    left, own = dict(options), []
    for i, n in enumerate(chain):
        defaults = getattr(policy_class(chain[i - 1]), "default_inner_options", {}) if i >= n_named else {}
        own.append({**defaults, **{k: left.pop(k) for k in _own_options(n) if k in left}})
    if left:
        raise ValueError(f"unknown option(s) {sorted(left)} for method {spec!r}; valid options: "
                         f"{method_options(spec)}")
    policy = policy_class(chain[-1])(budget=budget, **own[-1])
    for n, opts in zip(reversed(chain[:-1]), reversed(own[:-1])):
        policy = policy_class(n)(budget=budget, inner=policy, **opts)
    return policy


__all__ = ["METHODS", "AdaKVPolicy", "ChunkKVPolicy", "CriticalKVPolicy", "FullPolicy", "H2OPolicy",
           "KVReviverPolicy", "ScissorhandsPolicy", "SnapKVPolicy", "StreamingLLMPolicy", "make_policy",
           "method_chain", "method_options", "policy_class", "scorers", "wrappers"]
