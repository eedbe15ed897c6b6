"""
The fast engine: fill many caches with one prompt pass and step them by one token at once, each cache
getting the numbers it would get alone (``--engine fast``, the default).

    FanOut        the policy of one prompt pass that serves many caches (each gets its own storage)
    extend_many   a chunk after the shared prompt onto every cache in one pass
    step_many     one decode step for many caches: the products over all rows in blocks of ``ROWS``

A product's rounding depends on its shape, so every product runs on blocks of the same shape, padded with
zero rows: a cache's numbers do not depend on the caches beside it
(``tests/experiments/evaluation/test_side_by_side.py``). How it works: ``inside.md``, "side_by_side.py".
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from fastpath.lean import LeanDecoder
from fastpath.reviver import every_layer_at_once_on
from fastpath.sketch import use_kernels_on
from nanollm.attention import prompt_statistics, rope_cos_sin
from nanollm.cache import KVCache, LayerKV
from nanollm.generation import prefill
from nanollm.policy import CachePolicy, Needs, StepContext

from . import prefill_layers
from .engine import PlainEngine

ROWS = 16     # the rows of every product in step_many: 25 caches take two blocks (see the module docstring)


def blocked_linear(t: Tensor, w: Tensor, rows: int = ROWS) -> Tensor:
    """``F.linear(t, w)`` for t (R, D_in), w (D_out, D_in), computed in blocks of exactly ``rows`` rows (the
    last block padded with zero rows), so every row goes through the same kernel whatever R is. (R, D_out)."""
    R = t.shape[0]
    padded = torch.cat([t, t.new_zeros((-R) % rows, t.shape[1])])                     # (ceil(R/rows)*rows, D_in)
    return torch.cat([F.linear(block, w) for block in padded.split(rows)])[:R]


class SharedPrefillUnsupported(Exception):
    """A policy the shared prompt pass cannot serve (``FastEngine.fill`` then runs the prompts one by one)."""


class FanOut(CachePolicy):
    """The policy of one prompt pass that serves many caches (``FastEngine.fill``).

    The prompt's attention is exact whatever the method (a policy compresses only after a layer's prompt
    attention), so every method's prompt pass computes the same keys, values and outputs, layer after
    layer; only the policies' hooks differ. This policy lets the pass compute the outputs alone, and at
    each layer hands every cache its own copy of the layer's storage and the statistics its policy asks
    for (``prompt_statistics`` with that policy's ``needs``: the very call ``attention.attend_prompt`` makes for
    it), then runs that policy's ``on_prefill``. Each policy sees what its own prompt pass would show it
    (a test compares them bit for bit), for one forward pass instead of one per method. The caches that
    ``prefill_layers.waits`` names are the exception: their hooks wait and take a run of layers at once,
    with the statistics but not the queries and outputs, which those methods do not read at prefill.

    Two assumptions, which every registered method meets: a policy's prefill hook does not draw from the
    global random generator (the hooks of different policies now interleave, layer by layer), and
    ``reset()`` forgets everything (the fallback starts every policy again).
    """

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = caches
        self.runs: dict[Needs, prefill_layers.Run] = {}  # the caches that take layers at once: what waits

    def needs(self, phase: str) -> Needs:
        return Needs()                                   # the shared pass computes only the output

    def on_prefill(self, ctx: StepContext) -> None:
        store = ctx.kv
        if not isinstance(store, LayerKV) or not torch.equal(store.pos, ctx.q_pos.expand_as(store.pos)):
            raise SharedPrefillUnsupported("not a plain causal prompt over LayerKV storage")
        stats: dict[Needs, tuple] = {}
        waiting: dict[Needs, list[KVCache]] = {}         # prefill_layers.py: these caches' hooks wait

        def statistics(needs: Needs) -> tuple:           # (probs, col_sums), as attend() computes them
            if needs not in stats:
                stats[needs] = (None, None) if needs == Needs() else prompt_statistics(ctx.q, store.k, needs)
            return stats[needs]
        for cache in self.caches:
            needs = cache.policy.needs("prefill")
            if prefill_layers.waits(cache) and store.k.shape[0] == 1:
                waiting.setdefault(needs, []).append(cache)
                continue
            own = copy.deepcopy(store)
            if cache.policy.attend_kv(ctx.layer, own) is not own:
                raise SharedPrefillUnsupported("a policy attends to rebuilt entries at prefill")
            probs, col_sums = (None if t is None else t.clone() for t in statistics(needs))
            cache.policy.on_prefill(replace(ctx, q=ctx.q.clone(), out=ctx.out.clone(), kv=own, probs=probs,
                                            col_sums=col_sums, attended_pos=own.pos))
            cache.layers[ctx.layer] = own
        for needs, caches in waiting.items():            # a run of layers waits, then one hook takes them all
            run = self.runs.setdefault(needs, prefill_layers.Run())
            run.add(ctx.layer, store, statistics(needs))
            if ctx.layer == len(caches[0].layers) - 1 or run.held >= prefill_layers.HELD_BYTES:
                prefill_layers.compress(caches, self.runs.pop(needs), ctx)


@torch.no_grad()
def step_many(lean: LeanDecoder, tokens: list[Tensor], caches: list[KVCache],
              own_seconds: list[float] | None = None) -> tuple[Tensor, Tensor]:
    """One decode step for each of several independent sequences, side by side: ``tokens[n]`` (B_n,) onto
    ``caches[n]`` (each cache with its own policy, length and position). Returns the logits (sum B_n, V)
    and hidden states (sum B_n, D), the caches' rows one after the other.

    The matrix products run over all rows at once in fixed-size blocks (``blocked_linear``), the attention
    per cache, the rest once over all rows: each cache's numbers are the same whichever other caches are
    stepped with it (bit for bit, tested), and agree with ``lean.step(tokens[n], caches[n])`` to float
    rounding (see the module docstring).

    ``own_seconds[n]``, if given, gets the time of cache n's attention added (its storage, attention and
    policy hooks: the work that differs between caches); the rest of the step is shared by every row.
    """
    model = lean.model
    if not caches or len(tokens) != len(caches):
        raise ValueError(f"one token tensor per cache: {len(tokens)} token tensors, {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("a cache appears twice: each cache takes one step")
    for cache in caches:
        lean.check_step(cache)
    tokens = [t.view(-1) for t in tokens]
    ids = torch.cat(tokens)                                                            # (R,) all rows
    rows, row_pos, first = [], [], 0                     # each cache's rows; every row's position
    for t, cache in zip(tokens, caches):
        rows.append(slice(first, first + len(t)))
        row_pos += [cache.seen] * len(t)
        first += len(t)
    x = F.embedding(ids, model.tok_emb.weight)                                         # (R, D): one position each
    cos, sin = rope_cos_sin(torch.tensor(row_pos, device=ids.device), lean.inv_freq, x.dtype)   # (R, d) each
    cos, sin = cos[:, None], sin[:, None]                                              # (R, 1, d) each
    pos = [torch.arange(c.seen, c.seen + 1, device=ids.device) for c in caches]       # (1,) per cache

    def attend(i: int, attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:               # (R, H, 1, d)
        outs = []
        for n, (cache, r) in enumerate(zip(caches, rows)):
            t0 = time.perf_counter()
            outs.append(lean.attend(cache, i, attn, q[r], k[r], v[r], pos[n]))
            if own_seconds is not None:
                own_seconds[n] += time.perf_counter() - t0
        return torch.cat(outs)

    logits, h = lean.forward(x, cos, sin, blocked_linear, attend)
    for cache in caches:
        cache.seen += 1
    return logits, h


@torch.no_grad()
def extend_many(lean: LeanDecoder, chunk: Tensor, caches: list[KVCache]) -> Tensor:
    """``extend`` the same chunk of tokens (T,) onto each of several one-sequence caches that have seen the same
    number of tokens (the question after a shared prompt), side by side as ``step_many`` steps them: each
    cache's T rows one after the other, the products over all N * T rows in blocks, the attention (and its
    policy's hooks) per cache over its T queries, as ``extend`` runs it. Returns the logits of each cache's
    last position (N, V).

    A cache's numbers do not depend on the caches beside it (bit for bit, tested) and agree with ``extend``
    (the model's own forward pass, its products over T rows) to float rounding."""
    if not caches or len({id(c) for c in caches}) != len(caches):
        raise ValueError("extend_many needs caches, each once")
    seen, T = caches[0].seen, chunk.numel()
    for cache in caches:
        if cache.seen == 0 or cache.seen != seen or cache.layers[0].k.shape[0] != 1:
            raise ValueError("extend_many extends one-sequence caches that hold prefixes of the same length")
    N, device = len(caches), lean.model.tok_emb.weight.device
    ids = chunk.view(1, -1).to(device)                                                 # (1, T)
    lean.model.check_ids(ids, seen)                  # extend's checks: at least one id, in the vocabulary, fits
    x = F.embedding(ids[0].repeat(N), lean.model.tok_emb.weight)                       # (N * T, D) cache by cache
    pos = torch.arange(seen, seen + T, device=device)                                  # (T,) every cache's
    cos, sin = rope_cos_sin(pos, lean.inv_freq, x.dtype)                               # (T, d) each
    cos, sin = cos.repeat(N, 1)[:, None], sin.repeat(N, 1)[:, None]                    # (N * T, 1, d) each

    def attend(i: int, attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:               # (N * T, H, 1, d)
        outs = []
        for n, cache in enumerate(caches):
            def own(t: Tensor) -> Tensor:                 # cache n's T rows as one sequence: (1, H, T, d)
                return t[n * T:(n + 1) * T].transpose(0, 2)
            out = cache.attend(i, attn, own(q), pos, (own(k), own(v)))               # causal over the chunk
            outs.append(out.transpose(0, 2))                                           # (T, H, 1, d)
        return torch.cat(outs)

    last = torch.arange(T - 1, N * T, T, device=device)                                # each cache's last row
    later = [prefill_layers.Later(c) for c in caches if prefill_layers.waits(c, "decode")]
    for stand_in in later:                           # their hooks wait, to run over layers at once
        stand_in.cache.policy = stand_in
    try:
        logits, _ = lean.forward(x, cos, sin, blocked_linear, attend, logits_of=last)  # (N, V)
    finally:
        for stand_in in later:
            stand_in.cache.policy = stand_in.policy
    for stand_in in later:                           # the layers still kept
        stand_in.run()
    for cache in caches:
        cache.seen += T
    return logits


class FastEngine(PlainEngine):
    """``PlainEngine``'s ``fill`` and ``step``, fast, with the same numbers to float rounding (a test compares
    ``experiments.compare``'s records under both):

    * ``fill``: one prompt pass for every cache (``FanOut``), when it can serve every policy; else the plain
      engine's ``fill``, one pass per cache. A further chunk (the question after the context) is
      extended onto every cache at once (``extend_many``: one pass, the attention per cache).
    * ``step``: all the caches in one ``step_many`` of the lean decoder (``fastpath/lean.py``). The seconds
      given to a cache are its own attention (storage, attention, its policy's hooks) plus an equal share
      of the rest of the step, the products and element-wise work done once for every row: they add up to
      the step's time, and shrink as more caches share it.
    * on a GPU where the kernels serve (``kernels.serves``), KVReviver's sketch inserts and queries on its
      Triton kernels (``fastpath/sketch.py``): one launch each where the PyTorch sketch takes about ten. Its
      atomic adds sum a cell's tokens in an order that may change from run to run, so its records are equal
      to the CPU's to float rounding, as the attention kernel's are.
    * on every device, KVReviver compresses every layer at the step's end, at once, and (on a GPU) rebuilds
      the next step's entries for every layer at once (``fastpath/reviver.py``): about an eighth of its
      operations and one host wait a step instead of one a layer, with the same numbers to the last bit.

    It takes the models ``LeanDecoder`` takes (llama flavour, standard attention); ``engines.make_engine`` says so in
    one line for another model. The policies' hooks interleave, cache after cache and layer after layer,
    so a policy must not draw from the global random generator (its draws would depend on the caches beside
    it): every ``fill`` and ``step`` checks that torch's and Python's global generators are where they were,
    and raises if not. ``alone=True`` steps the caches one at a time, so that each cache's seconds are its
    own step's, not a share (slower; the numbers are the same)."""
    name = "fast"

    def __init__(self, model, alone: bool = False) -> None:
        super().__init__(model)
        self.lean = LeanDecoder(model)
        self.alone = alone

    @torch.no_grad()
    def fill(self, policies: list[CachePolicy], chunks: list[list[int]]) -> tuple[list[KVCache], Tensor]:
        use_kernels_on(policies, self.model.tok_emb.weight)     # on a GPU: KVReviver's sketch on its kernels
        every_layer_at_once_on(policies)                        # KVReviver compresses every layer at once
        caches = [KVCache(self.model.config, policy=p) for p in policies]
        try:
            with global_generators_untouched("the shared prompt pass"):
                logits = prefill(self.model, torch.tensor([chunks[0]], device=self.device),
                                 KVCache(self.model.config, policy=FanOut(caches)))
        except SharedPrefillUnsupported:                 # one prompt pass per cache; a new cache resets its policy
            return super().fill(policies, chunks)
        for cache in caches:
            cache.seen = len(chunks[0])
        self.prompt_passes = 1
        return caches, self.extend_all(caches, logits[0, -1].repeat(len(caches), 1), chunks)

    def extend_rest(self, cache: KVCache, logits: Tensor, chunks: list[list[int]]) -> Tensor:
        """The fallback ``fill`` (one prompt pass per cache) extends each cache as the shared one does, so
        that both give a cache the same numbers, bit for bit."""
        return self.extend_all([cache], logits[0, -1][None], chunks)[0]

    def extend_all(self, caches: list[KVCache], last: Tensor, chunks: list[list[int]]) -> Tensor:
        """The chunks after the first (the question after the context) onto every cache at once
        (``extend_many``); ``last`` (N, V) the logits before them. Returns the last logits (N, V)."""
        for chunk in chunks[1:]:
            with global_generators_untouched("the pass over the question"):
                last = extend_many(self.lean, torch.tensor(chunk), caches)
        return last

    @torch.no_grad()
    def step(self, caches: list[KVCache], tokens: list[int]) -> tuple[Tensor, Tensor, list[float]]:
        tokens = [torch.tensor([t], device=self.device) for t in tokens]
        if self.alone:                                   # each cache's own step, timed alone
            self.caches_per_step, outs, seconds = 1, [], []
            for token, cache in zip(tokens, caches):
                t0 = time.perf_counter()
                outs.append(step_many(self.lean, [token], [cache]))
                seconds.append(time.perf_counter() - t0)
            return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]), seconds
        own = [0.0] * len(caches)
        self.caches_per_step = len(caches)
        t0 = time.perf_counter()
        with global_generators_untouched("a decode step"):
            logits, hidden = step_many(self.lean, tokens, caches, own)
        shared = (time.perf_counter() - t0 - sum(own)) / len(caches)
        return logits, hidden, [s + shared for s in own]


@contextlib.contextmanager
def global_generators_untouched(what: str):
    """Raises if the code in the block moved torch's global random generator or Python's ``random``: the fast
    engine runs the policies' hooks interleaved, so a draw there would depend on the other caches."""
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    yield
    if not torch.equal(torch.get_rng_state(), torch_state) or random.getstate() != python_state:
        raise RuntimeError(f"a policy drew from the global random generator during {what}: the fast engine runs "
                           "every cache's hooks interleaved, so the draw would depend on the caches beside it; "
                           "give the policy a torch.Generator of its own, or run --engine plain")
