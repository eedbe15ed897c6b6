"""
PolicyWrapper: a method built around another (AdaKV, ChunkKV, CriticalKV, the evaluation's ``Probe``). The
decoder never sees it: it calls a policy's hooks (``nanollm/policy.py``), and a wrapper's are its inner
scorer's with the wrapper's own selection.
"""

from __future__ import annotations

from typing import ClassVar

from .policy import CachePolicy, ScoringPolicy


class PolicyWrapper:
    """A policy built around another, ``inner``: a subclass (a dataclass with an ``inner`` field) defines
    what it changes, and every other attribute is the inner policy's. Around a scoring policy the hooks are
    the scorer's (``ScoringPolicy.step``) with the wrapper's ``select``: AdaKV, ChunkKV and CriticalKV
    change only how the inner scores become a kept set."""

    inner: CachePolicy
    default_inner: ClassVar[str] = "snapkv"
    evicts_in_place: ClassVar[bool] = False     # its own ``select`` decides: it compacts at every compression

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "inner":      # not set yet (dataclass init, copy)
            raise AttributeError(name)
        return getattr(self.inner, name)

    on_prefill = on_decode = ScoringPolicy.step      # the inner scorer's hooks, with this wrapper's select

    def check_inner(self, default) -> None:
        """``default()`` if no inner policy was given; it must rank entries, with the same budget."""
        self.inner = default() if self.inner is None else self.inner
        if not isinstance(self.inner, (ScoringPolicy, PolicyWrapper)):
            raise ValueError(f"inner must be a scoring policy, got {type(self.inner).__name__}")
        if self.inner.budget != self.budget:
            raise ValueError(f"inner budget {self.inner.budget} differs from the wrapper's budget {self.budget}")
