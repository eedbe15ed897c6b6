"""
The explicit KV cache: every layer's storage (its attention module's choice: ``LayerKV`` for the standard
one), the number of tokens seen, and the policy, whose hooks it calls at the right moments.
"""

from __future__ import annotations

from torch import Tensor

from .attention import attention_class
from .config import ModelConfig
from .policy import CachePolicy, StepContext
from .storage import LayerKV

__all__ = ["KVCache", "LayerKV"]


class KVCache:
    """All layers' storage, the tokens seen, and the policy (None: store everything, call nothing).
    ``new_storage`` (``config -> storage``) overrides the module's layout (tensor attention has several)."""

    def __init__(self, config: ModelConfig, policy: CachePolicy | None = None, new_storage=None) -> None:
        self.config = config
        self.policy = policy
        if policy is not None:          # a new cache is a new sequence: nothing may leak from an earlier one
            policy.reset()
        self._new_storage = new_storage or attention_class(config.attention).new_storage
        self.layers = [self._new_storage(config) for _ in range(config.n_layer)]
        self.seen = 0                   # tokens processed so far; the next token gets position `seen`

    def attend(self, layer: int, module, q: Tensor, pos: Tensor, new: tuple) -> Tensor:
        """Called by layer ``layer``'s attention module: store the step's entries ``new`` (``(k, v)``), attend
        with its queries q (B, H, Tn, d) at positions pos (Tn,), run the policy. Returns (B, H, Tn, d)."""
        store = self.layers[layer]
        phase = "prefill" if self.seen == 0 else "decode"   # `extend` chunks count as decode steps
        store.append(*new, pos)
        if self.policy is None:
            return module.attend_entries(q, store, pos)[0]
        entries = self.policy.attend_kv(layer, store)
        attended_pos = entries.pos          # now: the hook below may evict from the storage
        out, probs, col_sums = module.attend_entries(q, entries, pos, self.policy.needs(phase))
        ctx = StepContext(layer=layer, phase=phase, q=q, q_pos=pos, probs=probs, out=out, kv=store,
                          attn=module, config=self.config, seen=self.seen + q.shape[2],
                          attended_pos=attended_pos, col_sums=col_sums)
        (self.policy.on_prefill if phase == "prefill" else self.policy.on_decode)(ctx)     # the phase's hook
        return out

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)                 # K and V bytes stored

    def state_nbytes(self) -> int:
        return sum(layer.state_nbytes() for layer in self.layers)           # methods' per-slot state

    def reset(self) -> None:
        """Forget everything (the policy too), ready for a new sequence: the cache as new."""
        self.__init__(self.config, self.policy, self._new_storage)
