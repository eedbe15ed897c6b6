"""
Pictures of what a method keeps: which prompt tokens survive in each layer and KV head, the needle marked.

    kept_text         the needle's sentence, evicted tokens replaced by a placeholder, per layer and KV head
    plot_kept         a strip per (layer, KV head) over the prompt, kept tokens dark, the needle highlighted
    plot_persistence  Scissorhands' persistence ratios per layer (``experiments.analysis.persistence``)

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
    """A notebook's first cell warns in quick mode that its prose describes another run; a normal run, whose
    numbers the prose quotes, prints nothing."""
    if tiny:
        print(QUICK_MODE)


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
    every = -(-L * H_kv // 16)                                         # at most 16 row labels, each legible
    rows = range(0, L * H_kv, every)
    ax.set_yticks(rows, [f"L{r // H_kv} KV{r % H_kv}" for r in rows], fontsize=9)
    per_strip = mask.sum(-1).flatten()                                 # (L * H_kv,) kept per strip
    mean = " on average" if int(per_strip.min()) != int(per_strip.max()) else ""   # AdaKV's heads differ
    ax.set(title=f"{title}  ({float(per_strip.float().mean()):.0f} of {T} positions kept per head{mean})",
           xlabel="prompt position")


def plot_persistence(pers: dict[float, Tensor], paper: float, title: str):
    """Three panels (step to step at delta = 1 and 50, over the sequence), one line per level and layer for the
    ratio (solid) and one for its base rate (dashed, paler), and the paper's level ``paper`` dotted; ``pers``
    is ``persistence_by_layer``'s result. Returns the figure."""
    import matplotlib.pyplot as plt

    n_layer = next(iter(pers.values())).shape[0]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True, layout="constrained")
    colours = dict(zip(pers, ["tab:blue", "tab:red", "tab:green"]))
    for ax, (col, panel) in zip(axes, [(0, "step to step, delta = 1"), (2, "step to step, delta = 50"),
                                       (4, "over the sequence (second half vs first)")]):
        for level, table in pers.items():
            ax.plot(range(n_layer), table[:, col], "o-", color=colours[level], label=f"ratio, level {level:g}")
            ax.plot(range(n_layer), table[:, col + 1], "o--", color=colours[level], alpha=0.5,
                    label=f"base rate, level {level:g}")
        ax.axhline(paper, color="gray", ls=":", lw=1)
        ax.set(title=panel, xlabel="layer", ylim=(0, 1.05), xticks=range(0, n_layer, max(1, n_layer // 6)))
    axes[0].set_ylabel("persistence ratio")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=9)
    fig.suptitle(title)
    return fig
