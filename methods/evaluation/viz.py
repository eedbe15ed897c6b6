"""
Pictures of what a method keeps: which prompt tokens survive in each layer and KV head, the needle marked.

Used by the method notebooks. Two views of one compressed cache:

* ``kept_text``: the needle's sentence as text, evicted tokens replaced by a placeholder, per layer and
  KV head (is the value kept whole, or fragmented?);
* ``plot_kept``: a strip per (layer, KV head) over the whole prompt, kept tokens dark, the needle's
  positions highlighted.

    cache = KVCache(model.config, make_policy("snapkv", budget=256))
    prefill(model, torch.tensor([sample.prompt_ids]), cache)
    spans = needle_spans(sample, tok)
    print(kept_text(tok, sample.prompt_ids, cache, spans[0]))
"""

from __future__ import annotations

import torch
from torch import Tensor

from nanollm.cache import KVCache

QUICK_MODE = ("Quick mode (NANOLLM_TINY=1): smaller models, prompts and sample counts. The text describes the "
              "committed normal run; the numbers printed here, and the stories they tell, may differ from it.")


def print_mode(tiny: bool) -> None:
    """Every notebook's first cell says which run this is: in quick mode, that its prose describes another."""
    print(QUICK_MODE if tiny else "Normal run: the numbers the text quotes are this run's.")


def _find(seq: list[int], sub: list[int]) -> int:
    """First index of ``sub`` in ``seq`` (ValueError if absent)."""
    for i in range(len(seq) - len(sub) + 1):
        if seq[i:i + len(sub)] == sub:
            return i
    raise ValueError("sub-sequence not found in the context")


def needle_spans(sample, tok, before: int = 12) -> list[tuple[int, int, int]]:
    """For every answer of a sample, (start, value_start, end): the ``before`` tokens in front of the value
    (the needle's key and wording) from ``start``, the value's tokens from ``value_start`` to ``end``
    (exclusive), as positions in the context (= positions in the prompt)."""
    spans = []
    for answer in sample.answers:
        ids = tok.encode(answer)
        v = _find(sample.context_ids, ids)
        spans.append((max(0, v - before), v, v + len(ids)))
    return spans


def kept_mask(cache: KVCache, n_tokens: int, row: int = 0) -> Tensor:
    """(n_layer, H_kv, n_tokens) bool: whether layer l, KV head h holds the raw entry of each position."""
    L, H_kv = len(cache.layers), cache.layers[0].pos.shape[1]
    mask = torch.zeros(L, H_kv, n_tokens, dtype=torch.bool)
    for l, layer in enumerate(cache.layers):
        for h in range(H_kv):
            p = layer.pos[row, h]
            p = p[(p >= 0) & (p < n_tokens)]
            mask[l, h, p] = True
    return mask


def kept_text(tok, ids: list[int], cache: KVCache, span: tuple[int, int, int], missing: str = "_") -> str:
    """One line per (layer, KV head): the span's tokens, each evicted one shown as ``missing``, followed by
    how many of the value's tokens were kept."""
    start, v, end = span
    mask = kept_mask(cache, end)
    lines = [f"{'':>9}  {tok.decode(ids[start:end])!r}"]
    for l in range(mask.shape[0]):
        for h in range(mask.shape[1]):
            parts = [tok.decode([ids[i]]) if mask[l, h, i] else missing for i in range(start, end)]
            value_kept = int(mask[l, h, v:end].sum())
            lines.append(f"L{l} KV{h}:  {''.join(parts)!r}   value {value_kept}/{end - v}")
    return "\n".join(lines)


def plot_kept(ax, cache: KVCache, n_tokens: int, spans: list[tuple[int, int, int]] = (), title: str = "",
              window: int = 0) -> None:
    """Kept (dark) vs evicted (light) positions, one row per (layer, KV head); needles shaded (keys light
    orange, values red); the last ``window`` prompt positions marked with a dotted line."""
    mask = kept_mask(cache, n_tokens)                                   # (L, H_kv, T)
    L, H_kv, T = mask.shape
    ax.imshow(mask.reshape(L * H_kv, T).float().numpy(), aspect="auto", cmap="Greys", vmin=-0.15, vmax=1.3,
              interpolation="nearest")
    for start, v, end in spans:
        ax.axvspan(start - 0.5, v - 0.5, color="orange", alpha=0.25, lw=0)
        ax.axvspan(v - 0.5, end - 0.5, color="red", alpha=0.35, lw=0)
    if window:
        ax.axvline(T - window - 0.5, color="tab:blue", ls=":", lw=1)
    ax.set_yticks(range(L * H_kv), [f"L{l} KV{h}" for l in range(L) for h in range(H_kv)], fontsize=7)
    kept = int(mask.sum()) / (L * H_kv)
    ax.set(title=f"{title}  ({kept:.0f} of {T} positions kept per head)", xlabel="prompt position")
