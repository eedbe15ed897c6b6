"""
Why KVReviver collapses on SmolLM2, taken apart: which part of it breaks, by how much, and why.

KVReviver (Yuan et al., arXiv 2512.17917) keeps Recent and Candidate raw and sums every other token into a
count sketch, rebuilt for every attention (Algorithms 1-4). Under the language-modelling protocol
(``experiments/evaluation/language_modelling.py``) its perplexity explodes. This module swaps one part at a
time (ablations, each a small subclass of ``KVReviverPolicy``: the method's file stays as the paper reads),
checks Lemma 2 at the paper's own setting against the error measured on SmolLM2's keys and values
(``lemma2``, ``key_mean_ratio``), and tries a repair of ours, **not the paper's** (``CentredSketch``).

    python -m experiments.analysis.kvreviver_ablation --out results/kvreviver_ablation.txt \\
        --json results/kvreviver_ablation.json

Every number comes out of this code; ``tests/experiments/analysis/test_kvreviver_ablation.py`` checks the
variants. Each variant, Lemma 2's check and the repair: experiments/README.md, section
"analysis/kvreviver_ablation.py: KVReviver taken apart".
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
from torch import Tensor
from tqdm import tqdm

from methods import make_policy
from methods.kvreviver import KVReviverPolicy
from methods.kvreviver_budgets import allocate, fisher_information
from methods.kvreviver_sketch import VagueSketch
from nanollm import cli, load
from nanollm.cache import KVCache
from nanollm.cli.provenance import header, provenance
from nanollm.data.tasks import docs_paragraphs
from nanollm.generation import prefill
from nanollm.io.checkpoint import load_config, load_tokenizer
from nanollm.io.files import atomic_write_text
from nanollm.policy import CachePolicy
from nanollm.storage import LayerKV

from ..evaluation.engines import make_engine
from ..evaluation.language_modelling import Scores, budgets_and_fill, stream_scored, text_ids

DEFAULT_KEEP_RATIOS = [0.2, 0.5]
DEFAULT_LENGTH = 512
LEMMA_LENGTH, LEMMA_KEEP = 2048, 0.1          # the paper's setting: 2k-token contexts at a 10% budget
CALIBRATION_FROM, CALIBRATION_TOKENS = 2048, 512   # Fisher's text: after the 2k the Lemma 2 check reads


def median_of_three_normals() -> float:
    """Lemma 2's constant, Var(median of 3 i.i.d. N(0, 1)) = integral x^2 6 Phi(x) (1 - Phi(x)) phi(x) dx, by
    the trapezoid rule on [-10, 10]: about 0.4487, the paper's 0.448. (The median's density is
    6 F (1 - F) f; Lemma 1 and Eq. 2 print a 3 in front, which would give half of 0.448 and a density that
    integrates to 1/2.)"""
    x = torch.linspace(-10, 10, 200_001, dtype=torch.float64)
    phi = torch.exp(-x ** 2 / 2) / math.sqrt(2 * math.pi)
    Phi = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    return float(torch.trapezoid(x ** 2 * 6 * Phi * (1 - Phi) * phi, x))


LEMMA2 = median_of_three_normals()


# ---------------------------------------------------------------------------------------------------------
# Ablations: the same bookkeeping, one part taken away

class ShadowKV(KVReviverPolicy):
    """KVReviver with a shadow copy of every token's true key and value (by position), so that ``attend_kv``
    can put the true keys (``true_keys``) and / or values (``true_values``) in place of what Algorithm 4
    rebuilds. Everything else, the scores, Recent / Candidate / Vague, the sketch and its swaps, runs as
    shipped; it only sees other attention."""

    true_keys: ClassVar[bool] = True
    true_values: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self._shadow: dict[int, tuple[Tensor, Tensor]] = {}        # layer -> k, v (B, H_kv, N, d) by position

    def reset(self) -> None:
        super().reset()
        self._shadow = {}

    def _record(self, layer: int, store: LayerKV) -> tuple[Tensor, Tensor]:
        """The shadow of ``layer`` brought up to date with the step's new tokens (the newest slots of the
        storage, raw and in order); before the first compression the storage is every token in order."""
        if layer not in self._sketch:                                 # nothing evicted yet: the store is all
            self._shadow[layer] = (store.k.clone(), store.v.clone())
            return self._shadow[layer]
        k, v = self._shadow[layer]
        seen, n_old = int(store.pos.max()) + 1, k.shape[2]
        if seen > n_old:
            new = seen - n_old
            expect = torch.arange(n_old, seen, device=store.pos.device)
            if not bool((store.pos[..., -new:] == expect).all()):
                raise RuntimeError("the newest storage slots are not the new positions in order")
            k = torch.cat([k, store.k[:, :, -new:]], dim=2)
            v = torch.cat([v, store.v[:, :, -new:]], dim=2)
            self._shadow[layer] = (k, v)
        return k, v

    def attend_kv(self, layer: int, store: LayerKV) -> LayerKV:
        true_k, true_v = self._record(layer, store)                   # (B, H_kv, N, d) each
        rebuilt = super().attend_kv(layer, store)                     # what Algorithm 4 gives, pos (B, H_kv, T)
        index = rebuilt.pos.unsqueeze(-1)                             # (B, H_kv, T, 1)
        k = true_k.gather(2, index.expand(-1, -1, -1, true_k.shape[-1])) if self.true_keys else rebuilt.k
        v = true_v.gather(2, index.expand(-1, -1, -1, true_v.shape[-1])) if self.true_values else rebuilt.v
        return LayerKV(k, v, rebuilt.pos)


class TrueKV(ShadowKV):
    """Every attended slot with its true key and value: with the sketch this is the full cache's attention,
    whatever the bookkeeping does."""


class TrueKeys(ShadowKV):
    """True keys, the sketch's values (and the revived tokens' estimated values)."""
    true_values: ClassVar[bool] = False


class TrueValues(ShadowKV):
    """The sketch's keys, true values."""
    true_keys: ClassVar[bool] = False


class NoSwaps(KVReviverPolicy):
    """Algorithm 3 without its swap loop: a token that entered the sketch stays there (it is still rebuilt
    for every attention), and no estimate ever takes a Candidate slot."""

    def _swap(self, sketch, scores, k, v, p, recent_from, approx, max_swaps):
        return k, v, p


class SwapsAtOnce(KVReviverPolicy):
    """Algorithm 3's swaps with the sketch updated once per step: every revived token's estimate is read
    before the step's swaps, then all of them leave the sketch and C's tokens enter it, each as one tensor
    operation. The paper prints the swap as a loop and notes that its code replaces the loops by tensor
    operations; the shipped method follows the printed loop, where a token revived later in a step is read
    after the earlier swaps changed the cells it may share with them. The same swaps in that step either
    way; the estimates of such tokens differ, and with them the cells and the steps after."""

    def _exchange(self, sketch, c, j, k, v, p):
        jk, jv = sketch.query(j)                                                 # (m, G, d), before any swap
        sketch.delete(j, jk, jv)
        sketch.insert(p[c], k[:, c].transpose(0, 1), v[:, c].transpose(0, 1))
        k[:, c], v[:, c], p[c] = jk.transpose(0, 1).to(k.dtype), jv.transpose(0, 1).to(v.dtype), j


# ---------------------------------------------------------------------------------------------------------
# The repair (ours, not the paper's): the others' mean out of a cell, the rest shrunk by Lemma 2's noise

class CentredSketch(VagueSketch):
    """A ``VagueSketch`` that also counts its cells' tokens and keeps their mean (NOT in the paper).

    With ``count[i, c]`` tokens in cell c of row i, the sum of their signs ``signed[i, c]`` and the mean
    key mu_k and value mu_v of the tokens in the sketch, row i's cell of token J gives
        k_J - mu_k + sum_o (k_o - mu_k)              = cell_k - count * mu_k          (keys, no signs)
        v_J - mu_v + sum_o g_J g_o (v_o - mu_v)     = g_J (cell_v - signed * mu_v)   (values, signed)
    over the other tokens o of the cell: errors made of *centred* tokens, whose common mean no longer adds
    up. The query takes the median over rows (Algorithm 2) of these, multiplies it by
    ``lambda = 1 / (1 + LEMMA2 * n)``, n the median over rows of the others in J's cells (the Wiener factor
    when a row's error has n times a token's variance and the median of 3 keeps LEMMA2 of it, Lemma 2),
    and adds the mean back. A token alone in its cells comes back exactly; a token in a crowded cell comes
    back near the mean instead of as a sum of noise.

    ``centre_keys``, ``centre_values`` and ``shrink`` switch the parts (subclasses set them). Memory: two
    numbers per cell and one key and value sum per sketch, next to the cells' r x b tokens."""

    centre_keys: ClassVar[bool] = True
    centre_values: ClassVar[bool] = True
    shrink: ClassVar[bool] = True

    def __init__(self, rows: int, width: int, n_kv_head: int, head_dim: int, seed: int, injective: bool = False,
                 device=None) -> None:
        super().__init__(rows, width, n_kv_head, head_dim, seed, injective, device)
        self.count = torch.zeros(rows, width, device=device)         # (r, b): tokens per cell
        self.signed = torch.zeros(rows, width, device=device)        # (r, b): sum of their signs
        self.key_sum = torch.zeros(n_kv_head, head_dim, device=device)
        self.value_sum = torch.zeros_like(self.key_sum)
        self.n = 0.0                                                  # tokens in the sketch

    def insert(self, pos: Tensor, k: Tensor, v: Tensor, sign: float = 1.0) -> None:
        super().insert(pos, k, v, sign)
        cells, signs = self.buckets(pos).long(), self.signs(pos)     # (r, n) each
        self.count.scatter_add_(1, cells, torch.full(cells.shape, sign, device=self.count.device))
        self.signed.scatter_add_(1, cells, sign * signs.to(self.signed.dtype))
        self.key_sum += sign * k.float().sum(0)                      # (H_kv, d)
        self.value_sum += sign * v.float().sum(0)
        self.n += sign * pos.numel()

    def means(self) -> tuple[Tensor, Tensor]:
        """mu_k, mu_v (H_kv, d): the mean key and value of the tokens in the sketch."""
        n = max(self.n, 1.0)
        return self.key_sum / n, self.value_sum / n

    def query(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        cells, signs = self.buckets(pos).long(), self.signs(pos)     # (r, n)
        (r, n), (H_kv, d) = cells.shape, self.key.shape[2:]
        rows = torch.arange(self.rows, device=cells.device).view(-1, 1)
        idx = (rows * self.width + cells).reshape(-1)                # (r * n,)
        g = signs.to(self.value.dtype)[..., None, None]              # (r, n, 1, 1)
        k = self.key.reshape(-1, H_kv, d).index_select(0, idx).view(r, n, H_kv, d)
        v = self.value.reshape(-1, H_kv, d).index_select(0, idx).view(r, n, H_kv, d)
        count = self.count[rows, cells][..., None, None]             # (r, n, 1, 1) tokens in J's cell of row i
        signed = self.signed[rows, cells][..., None, None]
        mu_k, mu_v = self.means()                                    # (H_kv, d)
        k = k - count * mu_k if self.centre_keys else k - mu_k       # (r, n, H_kv, d): row i's k_J - mu_k
        v = g * (v - signed * mu_v) if self.centre_values else g * v - mu_v
        k, v = k.median(dim=0).values, v.median(dim=0).values       # (n, H_kv, d): Algorithm 2's median
        if self.shrink:
            others = (self.count[rows, cells] - 1).clamp(min=0).median(dim=0).values   # (n,)
            lam = (1.0 / (1.0 + LEMMA2 * others))[:, None, None]                         # (n, 1, 1)
            k, v = lam * k, lam * v
        return k + mu_k, v + mu_v

    def nbytes(self) -> int:
        return super().nbytes() + self.count.nbytes + self.signed.nbytes + self.key_sum.nbytes + \
            self.value_sum.nbytes


class CentredKeySketch(CentredSketch):
    """Only the keys' mean taken out (values as the paper's), no shrinking."""
    centre_values: ClassVar[bool] = False
    shrink: ClassVar[bool] = False


class CentredKeys(KVReviverPolicy):
    """Repair, step 1 (ours): keys sketched with the others' mean taken out of their cells."""
    sketch_class: ClassVar[type] = CentredKeySketch


class CentredShrunk(KVReviverPolicy):
    """Repair (ours): keys and values centred, estimates shrunk towards the mean by Lemma 2's factor."""
    sketch_class: ClassVar[type] = CentredSketch


# ---------------------------------------------------------------------------------------------------------
# The variants of the table

@dataclass
class Variant:
    """A row of the table: a name, what it changes, and its policy for a budget (``context`` holds what some
    need: the layers' Fisher information)."""
    name: str
    note: str
    make: Callable[[int, dict], CachePolicy] = field(repr=False)
    ours: bool = False                     # a repair of ours, not the paper's


def _kvr(**options) -> Callable[[int, dict], CachePolicy]:
    return lambda budget, context: KVReviverPolicy(budget, **options)


VARIANTS = [
    Variant("shipped", "KVReviver as the paper describes it (Algorithms 1-4, split 0.45/0.45/0.1)", _kvr()),
    Variant("true K/V", "every attended slot with its true key and value, same bookkeeping",
            lambda b, c: TrueKV(b)),
    Variant("no swaps", "Algorithm 3's swap loop disabled", lambda b, c: NoSwaps(b)),
    Variant("swaps at once", "the step's swaps as one tensor operation: estimates read before any swap",
            lambda b, c: SwapsAtOnce(b)),
    Variant("true K, sketch V", "true keys, the sketch's values", lambda b, c: TrueKeys(b)),
    Variant("sketch K, true V", "the sketch's keys, true values", lambda b, c: TrueValues(b)),
    Variant("no sketch", "Recent / Candidate alone (sketch_width=0: leaving C = forgotten)", _kvr(sketch_width=0)),
    Variant("H2O", "heavy hitters + recent window, the same slots", lambda b, c: make_policy("h2o", budget=b)),
    *[Variant(f"width {w} on top", f"{w} cells per row on top of the budget (sketch_width={w})",
              _kvr(sketch_width=w)) for w in (8, 32, 128, 512)],
    Variant("Fisher budgets", "per-layer budgets by the Fisher information of W_K, W_V (appendix), same total",
            lambda b, c: KVReviverPolicy(b, layer_budgets=allocate(c["fisher"], b))),
    Variant("centred keys", "ours: keys' mean taken out of their cells", lambda b, c: CentredKeys(b), ours=True),
    Variant("centred+shrunk", "ours: keys and values centred, estimates shrunk by Lemma 2's factor",
            lambda b, c: CentredShrunk(b), ours=True),
]
VARIANT_NAMES = [v.name for v in VARIANTS]


def calibration_ids(tok, n: int = CALIBRATION_TOKENS, start: int = CALIBRATION_FROM) -> Tensor:
    """Fisher's calibration text: tokens ``start .. start + n`` of the help topics, after the text the table
    scores (the first 512) and the one Lemma 2 reads (the first 2048)."""
    ids = tok.encode("\n".join(docs_paragraphs()))
    if len(ids) < start + n:
        raise ValueError(f"the help topics have {len(ids)} tokens, fewer than {start + n}")
    return torch.tensor(ids[start:start + n])


# ---------------------------------------------------------------------------------------------------------
# The language-modelling protocol, with policies made here

def lm_ablation(model, tok, variants: list[Variant], keep_ratios: list[float], length: int = DEFAULT_LENGTH,
                context: dict | None = None, bar=None) -> list[dict]:
    """``language_modelling.run`` for policies built by ``variants`` (its own text, budgets, fill, stepping and
    scores: the full cache over the prefix then the scored half, each decode-time cache filled with its
    budget's first tokens then stepped; every variant here compresses as it decodes). One record per
    (variant, keep ratio) and one for the full cache."""
    engine = make_engine("fast", model)
    ids, half, context = text_ids(tok, length), length // 2, context or {}
    budgets, fill = budgets_and_fill(keep_ratios, length)
    bar = bar if bar is not None else tqdm(disable=True)
    full, _ = engine.fill([make_policy("full", budget=None)], [ids[:half]])
    full_logp, full_scores = {}, Scores()

    def on_full(i: int, pos: int, logp: Tensor) -> None:
        full_logp[pos] = logp.clone()
        full_scores.add(logp, logp, ids[pos])

    stream_scored(engine, ids, full, half, half + 1, on_full, bar)
    full_ppl = math.exp(full_scores.nll / full_scores.n)
    records = [{"kind": "lm", "variant": "full", "keep_ratio": 1.0, "budget": None, "length": length,
                "scored_tokens": full_scores.n, "perplexity": full_ppl, "ppl_ratio": 1.0, "kl": 0.0,
                "top1_agreement": 1.0, "swaps": 0}]
    for k in keep_ratios:
        policies = [v.make(budgets[k], context) for v in variants]
        caches, _ = engine.fill(policies, [ids[:fill[k]]])
        scores = [Scores() for _ in variants]
        stream_scored(engine, ids, caches, fill[k], half + 1,
                lambda i, pos, logp: scores[i].add(logp, full_logp[pos], ids[pos]), bar)
        for v, policy, s in zip(variants, policies, scores):
            ppl = math.exp(s.nll / s.n)
            records.append({"kind": "lm", "variant": v.name, "keep_ratio": k, "budget": budgets[k],
                            "length": length, "scored_tokens": s.n, "perplexity": ppl, "ppl_ratio": ppl / full_ppl,
                            "kl": s.kl / s.n, "top1_agreement": s.agree / s.n,
                            "swaps": getattr(policy, "swaps", 0), "ours": v.ours,
                            "layer_budgets": list(getattr(policy, "layer_budgets", None) or []) or None})
    return records


def lm_steps(keep_ratios: list[float], length: int) -> int:
    """Decode steps ``lm_ablation`` takes (for a progress bar)."""
    _, fill = budgets_and_fill(keep_ratios, length)
    return (length - 1 - length // 2) + sum(length - 1 - fill[k] for k in keep_ratios)


# ---------------------------------------------------------------------------------------------------------
# Lemma 2 at the paper's setting

@torch.no_grad()
def key_mean_ratio(cache: KVCache) -> list[dict]:
    """Per layer, how far keys and values are from zero-mean: ||mean_t k_t|| / sqrt(mean_t ||k_t||^2) per KV
    head (batch row 0), averaged over KV heads. 0 for zero-mean tokens, 1 for tokens that are all equal."""
    rows = []
    for layer, store in enumerate(cache.layers):
        def ratio(x: Tensor) -> float:                                # (H_kv, T, d)
            return float((x.mean(1).norm(dim=-1) / x.pow(2).sum(-1).mean(1).sqrt()).mean())
        rows.append({"layer": layer, "key_mean_ratio": ratio(store.k[0].float()),
                     "value_mean_ratio": ratio(store.v[0].float())})
    return rows


@torch.no_grad()
def lemma2(model, tok, length: int = LEMMA_LENGTH, keep: float = LEMMA_KEEP,
           policies: dict[str, Callable[[int], KVReviverPolicy]] | None = None) -> list[dict]:
    """Lemma 2's prediction against the measured reconstruction error, per layer, at the paper's setting.

    The first ``length`` tokens of the help topics go through one prompt pass with the full cache and with
    each policy (default: the shipped KVReviver at budget ``round(keep * length)``); its rebuilt cache
    (Algorithm 4) is compared with the full one at the positions held only by the sketch (V). Per layer:
    a = |V| tokens in the sketch, b cells per row, a/b tokens per cell; the predicted MSE per coordinate over
    the tokens' per-coordinate variance, ``LEMMA2 * a/b`` (median of 3 rows, each carrying a/b others), and
    the paper's bound ``a pi / N`` (N = r b); the measured MSE / variance for keys and values, and the
    error's norm over the true tokens' (root mean squares over V's tokens and KV heads)."""
    ids = torch.tensor([text_ids(tok, length)], device=next(model.parameters()).device)
    budget = max(1, round(keep * length))
    policies = policies or {"shipped": lambda b: KVReviverPolicy(b)}
    full = KVCache(model.config)
    prefill(model, ids, full)
    rows = []
    for name, make in policies.items():
        policy = make(budget)
        cache = KVCache(model.config, policy)
        prefill(model, ids, cache)
        for layer, store in enumerate(cache.layers):
            rebuilt = policy.attend_kv(layer, store)
            b = policy.layer_split(layer).width
            if b == 0 or rebuilt.pos.shape[-1] != length:
                raise ValueError(f"budget {budget} leaves the sketch no cell (b = {b}); raise the keep ratio")
            vague = ~torch.isin(rebuilt.pos[0, 0], store.pos[0, 0])               # (N,) held by the sketch only
            a = int(vague.sum())
            row = {"kind": "lemma2", "policy": name, "layer": layer, "length": length, "budget": budget,
                   "tokens_in_sketch": a, "width": b, "rows": policy.rows,
                   "tokens_per_cell": a / b, "predicted": LEMMA2 * a / b, "bound": math.pi * a / (policy.rows * b)}
            for part, true, est in (("key", full.layers[layer].k[0], rebuilt.k[0]),
                                    ("value", full.layers[layer].v[0], rebuilt.v[0])):
                t, e = true.float()[:, vague], est.float()[:, vague]             # (H_kv, a, d)
                var = true.float().var(dim=1).mean()                             # per-coordinate variance
                row[f"{part}_mse"] = float(((e - t) ** 2).mean() / var)
                row[f"{part}_error_norm"] = float(((e - t).pow(2).sum(-1).mean() / t.pow(2).sum(-1).mean()).sqrt())
            rows.append(row)
    for row, ratio in zip(rows, key_mean_ratio(full) * len(policies)):
        row.update(ratio)
    return rows


# ---------------------------------------------------------------------------------------------------------
# Text

def _num(x: float, decimals: int = 3) -> str:
    return f"{x:.{decimals}f}" if abs(x) < 1e4 else f"{x:.2e}"


def format_lm(records: list[dict]) -> str:
    """The ablation table: one row per variant, perplexity / full cache's at each keep ratio, then KL and
    swaps."""
    lm = [r for r in records if r.get("kind") == "lm" and r["variant"] != "full"]
    keeps = sorted({r["keep_ratio"] for r in lm})
    budgets = {r["keep_ratio"]: r["budget"] for r in lm}
    names = list(dict.fromkeys(r["variant"] for r in lm))
    by = {(r["variant"], r["keep_ratio"]): r for r in lm}
    head = f"{'variant':<20}" + "".join(f"{f'ppl/full @{budgets[k]}':>16}" for k in keeps) + \
        "".join(f"{f'KL @{budgets[k]}':>10}" for k in keeps) + "".join(f"{f'swaps @{budgets[k]}':>12}" for k in keeps)
    lines = [head, "-" * len(head)]
    for n in names:
        rs = [by[n, k] for k in keeps]
        label = n + (" *" if rs[0].get("ours") else "")
        lines.append(f"{label:<20}" + "".join(f"{'x' + _num(r['ppl_ratio'], 4 if r['ppl_ratio'] < 10 else 3):>16}"
                                             for r in rs)
                     + "".join(f"{r['kl']:>10.3f}" for r in rs) + "".join(f"{r['swaps']:>12}" for r in rs))
    full = next(r for r in records if r.get("kind") == "lm" and r["variant"] == "full")
    lines.append(f"\nfull cache perplexity {full['perplexity']:.3f} over the last {full['scored_tokens']} "
                 f"predictions of {full['length']} tokens; budgets = keep x {full['length'] // 2} "
                 f"(keep {' / '.join(str(k) for k in keeps)}); * = a repair of ours, not the paper's; swaps = "
                 "tokens revived from the sketch, all layers.")
    return "\n".join(lines)


def format_lemma(rows: list[dict]) -> str:
    """Lemma 2 per layer, then its summary."""
    shipped = [r for r in rows if r["policy"] == "shipped"]
    r0 = shipped[0]
    head = f"{'layer':>5}{'a':>6}{'b':>4}{'a/b':>8}{'Lemma 2':>9}{'bound':>8}{'key MSE':>11}{'value MSE':>11}" \
           f"{'|dk|/|k|':>10}{'|dv|/|v|':>10}{'|mean k|/rms':>14}"
    lines = [f"Lemma 2 at the paper's setting: {r0['length']} tokens, budget {r0['budget']} "
             f"({r0['budget'] / r0['length']:.0%}), split 0.45 / 0.45 / 0.1: {r0['rows']} rows x {r0['width']} cells. "
             f"MSE per coordinate / the tokens' per-coordinate variance over the tokens held only by the sketch; "
             f"Lemma 2 = {LEMMA2:.4f} a/b (median of 3 normals), bound = a pi / N.", head, "-" * len(head)]
    for r in shipped:
        lines.append(f"{r['layer']:>5}{r['tokens_in_sketch']:>6}{r['width']:>4}{r['tokens_per_cell']:>8.1f}"
                     f"{r['predicted']:>9.1f}{r['bound']:>8.1f}{_num(r['key_mse'], 1):>11}{_num(r['value_mse'], 1):>11}"
                     f"{r['key_error_norm']:>10.2f}{r['value_error_norm']:>10.2f}{r['key_mean_ratio']:>14.2f}")
    med = lambda xs: float(torch.tensor(xs).median())                # noqa: E731  lower median
    lines.append(f"\nmedian over layers: a/b = {med([r['tokens_per_cell'] for r in shipped]):.1f} tokens per cell; "
                 f"predicted MSE/var {med([r['predicted'] for r in shipped]):.1f}, measured keys "
                 f"{_num(med([r['key_mse'] for r in shipped]), 1)}, "
                 f"values {_num(med([r['value_mse'] for r in shipped]), 1)}; "
                 f"|mean k| / rms |k| = {med([r['key_mean_ratio'] for r in shipped]):.2f} "
                 f"(values {med([r['value_mean_ratio'] for r in shipped]):.2f}).")
    for name in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "shipped"):
        mine = [r for r in rows if r["policy"] == name]
        lines.append(f"{name + ' (ours)':<28} median over layers: key MSE/var "
                     f"{_num(med([r['key_mse'] for r in mine]), 2)}, "
                     f"value {_num(med([r['value_mse'] for r in mine]), 2)}; "
                     f"|dk|/|k| {med([r['key_error_norm'] for r in mine]):.2f}, "
                     f"|dv|/|v| {med([r['value_error_norm'] for r in mine]):.2f}")
    return "\n".join(lines)


def format_fisher(fisher: list[float], keep_budgets: dict[float, int]) -> str:
    """The layers' Fisher information and the budgets it gives."""
    total = sum(fisher)
    lines = ["Fisher information of W_K + W_V per layer (share of the total) and the per-layer budgets it gives "
             "(appendix; our reading in methods/README.md):",
             "layer " + " ".join(f"{i:>4}" for i in range(len(fisher))),
             "share " + " ".join(f"{f / total:>4.2f}" for f in fisher)]
    for k, b in keep_budgets.items():
        alloc = allocate(fisher, b)
        lines.append(f"@{b:<4} " + " ".join(f"{x:>4}" for x in alloc) + f"   (sum {sum(alloc)} = {len(fisher)} x {b})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# The command

def parser() -> cli.ArgumentParser:
    """The command line (also read back by the tests from the results file's recorded command)."""
    ap = cli.ArgumentParser(
        prog="python -m experiments.analysis.kvreviver_ablation",
        description="Why KVReviver collapses: ablations (true K/V, no swaps, true keys or values, no sketch, wider "
                    "sketches, the appendix's Fisher budgets, a repair of ours) under the language-modelling "
                    "protocol, Lemma 2 predicted vs measured at the paper's setting, and the keys' mean.")
    ap.add_argument("--checkpoint", default="smollm2-135m",
                    help="fetched model's name, bundled checkpoint, nanollm or Hugging Face folder, or GGUF file "
                         "(default %(default)s)")
    ap.add_argument("--variants", nargs="+", default=None, metavar="NAME", choices=VARIANT_NAMES,
                    help=f"rows of the table (default: all): {', '.join(repr(n) for n in VARIANT_NAMES)}")
    ap.add_argument("--keep-ratios", nargs="+", type=float, default=DEFAULT_KEEP_RATIOS, metavar="R",
                    help="budgets as fractions of the prefix (the text's first half), each in (0, 1] "
                         f"(default {' '.join(map(str, DEFAULT_KEEP_RATIOS))})")
    ap.add_argument("--length", type=cli.positive_int, default=DEFAULT_LENGTH,
                    help="tokens of text of the language-modelling table (default %(default)s)")
    ap.add_argument("--lemma-length", type=cli.non_negative_int, default=LEMMA_LENGTH,
                    help="tokens of text for the Lemma 2 check, 0 to skip it (default %(default)s, the paper's 2k)")
    ap.add_argument("--lemma-keep", type=float, default=LEMMA_KEEP,
                    help="budget of the Lemma 2 check as a fraction of its text (default %(default)s, the paper's)")
    ap.add_argument("--threads", type=cli.threads_or_workers, default=1,
                    help="torch CPU threads, at most the CPU cores (default %(default)s)")
    ap.add_argument("--out", type=cli.output_file, default=None, metavar="PATH",
                    help="write the text report (provenance header, tables) to PATH (default: print only)")
    ap.add_argument("--json", type=cli.output_file, default=None, metavar="PATH",
                    help='write {"provenance": ..., "records": [...]} to PATH (default: none)')
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)

    with cli.errors(args.debug):
        if any(not 0 < r <= 1 for r in args.keep_ratios):
            cli.fail(f"--keep-ratios must lie in (0, 1], got {args.keep_ratios}")
        if not 0 < args.lemma_keep <= 1:
            cli.fail(f"--lemma-keep must lie in (0, 1], got {args.lemma_keep}")
        cli.check_outputs({"--out": args.out, "--json": args.json}, inputs=[args.checkpoint])
        config = load_config(args.checkpoint)
        for flag, n in (("--length", args.length), ("--lemma-length", args.lemma_length)):
            if n and not 4 <= n <= config.max_seq_len:
                cli.fail(f"{flag} must be in [4, {config.max_seq_len}] (the model's maximum positions), got {n}")
        tok = load_tokenizer(args.checkpoint)
        if tok is None:
            cli.fail(f"--checkpoint {args.checkpoint} has no supported tokenizer, which the text needs")
        variants = [v for v in VARIANTS if args.variants is None or v.name in args.variants]
        try:
            text_ids(tok, max(args.length, args.lemma_length))
            calib = calibration_ids(tok) if any(v.name == "Fisher budgets" for v in variants) else None
        except ValueError as e:
            cli.fail(str(e))
        torch.set_num_threads(args.threads)
        model, tok, _ = load(args.checkpoint)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        prov = provenance(argv, prog=ap.prog, threads=args.threads, dtype=dtype, seed=0)
        t0 = time.time()
        context, records, parts = {}, [], []
        if calib is not None:
            context["fisher"] = fisher_information(model, calib)
            records.append({"kind": "fisher", "fisher": context["fisher"], "calibration_tokens": len(calib),
                            "calibration_from": CALIBRATION_FROM})
        bar = tqdm(total=lm_steps(args.keep_ratios, args.length) + (1 if args.lemma_length else 0),
                   disable=args.quiet, desc="kvreviver ablation", unit="step", dynamic_ncols=True)
        records += lm_ablation(model, tok, variants, args.keep_ratios, args.length, context, bar)
        parts.append(f"KVReviver ablations under the language-modelling protocol "
                     f"(experiments/evaluation/language_modelling.py), {args.checkpoint}:\n" + format_lm(records))
        for v in variants:
            parts[-1] += f"\n  {v.name + (' *' if v.ours else ''):<20}{v.note}"
        if calib is not None:
            parts.append(format_fisher(context["fisher"], {k: max(1, round(k * (args.length // 2)))
                                                           for k in args.keep_ratios}))
        if args.lemma_length:
            rows = lemma2(model, tok, args.lemma_length, args.lemma_keep,
                          {"shipped": KVReviverPolicy, "centred+shrunk": CentredShrunk})
            records += rows
            parts.append(format_lemma(rows))
            bar.update(1)
        bar.close()
        text = header(prov) + "\n\n" + "\n\n".join(parts) + f"\n\n{time.time() - t0:.0f} s.\n"
        print(text)
        if args.out:
            atomic_write_text(args.out, text)
            print(f"report written to {args.out}")
        if args.json:
            atomic_write_text(args.json, json.dumps({"provenance": prov, "records": records}, indent=1))
            print(f"records written to {args.json}")


if __name__ == "__main__":
    main()
