"""
How much attention goes to *rebuilt* entries: positions a method attends to through an approximation (KVReviver's
sketch estimates, Yuan et al., arXiv 2512.17917, Algorithm 4), not through their raw key and value.

A rebuilt key much longer than a real one draws a large logit whatever token it stands for, and the softmax
hands it mass the full cache would give elsewhere. Per layer, at the first decode step:

* ``method_mass``: the attention probability the method puts on its rebuilt positions (mean over query heads);
* ``full_mass``: the full cache's probability on those very positions (what the real tokens deserved);
* ``key_norm_ratio``: the mean length of the rebuilt keys over that of the real keys of the same positions.

    full, method = traces(model, sample, mode, [None, policy], [True, True])
    rows = rebuilt_attention_mass(full, method, model.config.group_size)   # one dict per layer

What counts as rebuilt, and how to read the numbers: experiments/README.md, section
"analysis/rebuilt_attention.py: attention on rebuilt entries".
"""

from __future__ import annotations

import torch
from torch import Tensor

from nanollm.cache import KVCache
from nanollm.policy import CachePolicy

from ..evaluation.protocol import Trace


def rebuilt_mask(method: Trace, layer: int) -> Tensor:
    """(H_kv, T_att) bool: which entries the method attended to at the first decode step of ``layer`` were not
    its raw key and value (attended positions absent from the positions it stores exactly)."""
    attended, exact = method.attended[layer], method.pos[layer]          # (H_kv, T_att), (H_kv, T_stored)
    return torch.stack([~torch.isin(attended[h], exact[h]) for h in range(attended.shape[0])])


def rebuilt_attention_mass(full: Trace, method: Trace, group_size: int) -> list[dict]:
    """Per layer: the method's attention mass on its rebuilt entries and the full cache's on the same positions.

    full, method : traces of the same sample and mode, both recorded with ``record_probs=True``.
    group_size : query heads per KV head (query head h reads KV head h // group_size).

    Returns [{"layer", "method_mass", "full_mass", "n_rebuilt", "method_heads", "full_heads"}]: the masses as
    means over query heads and per query head (lists of H), n_rebuilt the mean over KV heads of the rebuilt
    positions.
    """
    rows = []
    for layer, probs in method.probs.items():                             # (H, T_att) over method.attended
        rebuilt = rebuilt_mask(method, layer)                             # (H_kv, T_att)
        full_pos, full_probs = full.attended[layer][0], full.probs[layer]  # (N,) every position; (H, N)
        own, deserved = [], []
        for h in range(probs.shape[0]):
            kv = h // group_size
            own.append(float(probs[h][rebuilt[kv]].sum()))
            positions = method.attended[layer][kv][rebuilt[kv]]
            deserved.append(float(full_probs[h][torch.isin(full_pos, positions)].sum()))
        rows.append({"layer": layer, "method_mass": sum(own) / len(own), "full_mass": sum(deserved) / len(deserved),
                     "n_rebuilt": float(rebuilt.sum(-1).float().mean()), "method_heads": own, "full_heads": deserved})
    return rows


@torch.no_grad()
def key_norm_ratio(policy: CachePolicy, cache: KVCache, full: KVCache) -> list[float]:
    """Per layer: mean ||k|| of the entries ``policy.attend_kv`` rebuilds now (positions not stored exactly)
    over the mean ||k|| of the full cache's keys at the same positions (batch row 0; NaN where nothing is
    rebuilt). ``cache`` and ``full`` must have seen the same tokens."""
    ratios = []
    for layer, store in enumerate(cache.layers):
        entries = policy.attend_kv(layer, store)                          # k (B, H_kv, T, d), pos (B, H_kv, T)
        exact = policy.exact_positions(layer, store)[0]                   # (H_kv, T_stored)
        rebuilt_norms, real_norms = [], []
        for h in range(entries.pos.shape[1]):
            pos = entries.pos[0, h]
            rebuilt = ~torch.isin(pos, exact[h])
            rebuilt_norms.append(entries.k[0, h][rebuilt].norm(dim=-1))
            real = full.layers[layer]                                     # every position, in order
            real_norms.append(real.k[0, h][pos[rebuilt]].norm(dim=-1))
        rebuilt_k, real_k = torch.cat(rebuilt_norms), torch.cat(real_norms)
        ratios.append(float(rebuilt_k.mean() / real_k.mean()) if rebuilt_k.numel() else float("nan"))
    return ratios
