"""
A decode step a CUDA graph can capture: fixed shapes, counters on the device, no host in the loop.

``GraphDecoder.start`` copies a prefilled ``KVCache`` once into a ``StaticKV`` of fixed capacity C per head:
k, v (L, B, H_kv, C, d); pos (L, B, H_kv, C), -1 for an empty slot; slot (L, B, H_kv), where each head writes
next; position (1,), the next token's; for H2O, score (L, B, H_kv, C) fp32; for Scissorhands, low
(L, B, H_kv, w, C) bool, count (L, B, H_kv, C) int32 and attn (L, B, H_kv, C) fp32. Prefill-only methods,
StreamingLLM, H2O and Scissorhands (m = 1) decode on it; other policies fall back to the lean step, saying so.
Checked against the lean step, logits and kept positions, by ``tests/fastpath/test_graph.py``.

    graph = GraphDecoder(model)
    logits = prefill(model, ids, cache)[:, -1]           # the prompt: the reading path
    graph.start(cache, max_new_tokens=32)                # copy the cache into fixed-capacity buffers
    logits = graph.step(token)                           # each new token: captured once, then replayed

How it works: fastpath/inside.md, section "graph.py: the decode step in a CUDA graph".
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import kernels
from kernels.cache_write import reference_write_entry
from kernels.decode_attention import masked_decode_attention_triton
from methods import METHODS
from methods.h2o import STATE as H2O_STATE
from methods.h2o import evict_lowest
from methods.rules import DecodeRule
from methods.scissorhands import ATTN as SC_ATTN
from methods.scissorhands import COUNT as SC_COUNT
from methods.scissorhands import LOW as SC_LOW
from methods.scissorhands import divided, evict_one, low_flags, push_column
from methods.streaming_llm import evict_oldest
from nanollm.attention import group_scores, rope_cos_sin
from nanollm.cache import KVCache
from nanollm.generation import generate
from nanollm.model import Transformer
from nanollm.policy import CachePolicy, Needs, ScoringPolicy
from nanollm.storage import LayerKV

from .lean import LeanDecoder

WARMUP = 2              # eager steps on a side stream before a shape is captured (PyTorch's recipe: a few)
BF16_TOL = 2e-2         # bf16: |graph - lean| <= BF16_TOL * max |logit|, a few bf16 roundings (2^-8 each)


def policy_chain(policy: CachePolicy | None) -> list:
    """The policy and the policies it wraps, outermost first (``[]`` for the plain cache)."""
    chain = []
    while policy is not None:
        chain.append(policy)
        policy = getattr(policy, "inner", None)
    return chain


def spec_of(policy: CachePolicy | None) -> str:
    """The method spec of a policy, e.g. ``critical_kv(adakv(snapkv))``; the class name if unregistered."""
    names = {cls: name for name, cls in METHODS.items()}
    chain = policy_chain(policy)
    if not chain:
        return "the plain cache"
    spec = [names.get(type(p), type(p).__name__) for p in chain]
    return "(".join(spec) + ")" * (len(spec) - 1)


def decodes_as_stored(policy: CachePolicy | None) -> bool:
    """Whether a decode step under ``policy`` only appends and attends over the storage, as declared: no
    policy in the chain rebuilds the entries (``attend_kv``) or has a decode hook of its own, no scorer
    observes anything, ``compress_on`` has no "decode" and ``needs("decode")`` asks for nothing."""
    chain = policy_chain(policy)
    for p in chain:
        cls = type(p)
        if getattr(cls, "attend_kv", CachePolicy.attend_kv) is not CachePolicy.attend_kv:
            return False
        if getattr(cls, "on_decode", CachePolicy.on_decode) not in (CachePolicy.on_decode, ScoringPolicy.step):
            return False
        if getattr(cls, "observe", ScoringPolicy.observe) is not ScoringPolicy.observe:
            return False
    return not chain or ("decode" not in getattr(policy, "compress_on", ()) and policy.needs("decode") == Needs())


def eviction_rule(policy: CachePolicy | None) -> DecodeRule | str:
    """The in-graph rule of a policy's decode steps, as its class declares it (``decode_rule``, looked up on
    the class: a wrapper that does not declare one falls back), or why there is none (a str)."""
    if decodes_as_stored(policy):
        return DecodeRule("none")
    declared = getattr(type(policy), "decode_rule", None)
    if declared is not None:
        return declared(policy)
    if any(getattr(type(p), "attend_kv", CachePolicy.attend_kv) is not CachePolicy.attend_kv
           for p in policy_chain(policy)):
        return "it rebuilds the entries it attends to at every step (attend_kv)"
    return "its decode-time compression has no tensor form over fixed shapes here"


@dataclass
class StaticKV:
    """Every layer's entries in fixed-capacity buffers, and the counters, all on the device (shapes in the
    module docstring). Built from a prefilled ``KVCache`` by ``allocate`` then ``load``."""

    k: Tensor
    v: Tensor
    pos: Tensor
    slot: Tensor
    position: Tensor
    score: Tensor | None = None
    low: Tensor | None = None
    count: Tensor | None = None
    attn: Tensor | None = None

    @staticmethod
    def shape(cache: KVCache, max_new_tokens: int, rule: DecodeRule) -> tuple:
        """(L, B, H_kv, C, d, dtype, device) of the buffers for ``cache``, checked: a prefix is stored, every
        layer is a ``LayerKV`` with no slot waiting to be refilled (as after ``prefill`` or ``extend``)."""
        if cache.seen == 0:
            raise ValueError("a decode step needs a cache that already holds a prefix; use prefill() first")
        for store in cache.layers:
            if type(store) is not LayerKV or store.k is None:
                raise ValueError(f"the graph step copies LayerKV storage, got {type(store).__name__}")
            if store.free is not None:
                raise ValueError("start the graph step on a cache right after prefill() or extend(): this one "
                                 "has slots emptied by a decode step, waiting for the next token")
        B, H_kv, _, d = cache.layers[0].k.shape
        C = max(rule.capacity(store.n, max_new_tokens) for store in cache.layers)
        k = cache.layers[0].k
        return len(cache.layers), B, H_kv, C, d, k.dtype, k.device

    @classmethod
    def allocate(cls, L: int, B: int, H_kv: int, C: int, d: int, dtype: torch.dtype, device,
                 rule: DecodeRule) -> "StaticKV":
        # zeros, not empty: an empty slot's v is multiplied by its probability 0, and 0 * NaN would be NaN
        per_slot = (L, B, H_kv, C)
        scissors = rule.kind == "scissors"
        return cls(k=torch.zeros(*per_slot, d, dtype=dtype, device=device),
                   v=torch.zeros(*per_slot, d, dtype=dtype, device=device),
                   pos=torch.full(per_slot, -1, dtype=torch.long, device=device),
                   slot=torch.zeros(L, B, H_kv, dtype=torch.long, device=device),
                   position=torch.zeros(1, dtype=torch.long, device=device),
                   score=torch.zeros(per_slot, dtype=torch.float32, device=device) if rule.kind == "heavy" else None,
                   low=torch.zeros(L, B, H_kv, rule.window, C, dtype=torch.bool, device=device) if scissors else None,
                   count=torch.zeros(per_slot, dtype=torch.int32, device=device) if scissors else None,
                   attn=torch.zeros(per_slot, dtype=torch.float32, device=device) if scissors else None)

    def load(self, cache: KVCache) -> None:
        """Copy the cache in, in place (a captured graph keeps reading these same buffers): layer i's n slots
        first, the rest empty; its next token goes to slot n; the position is ``cache.seen``."""
        self.pos.fill_(-1)
        for i, store in enumerate(cache.layers):
            n = store.n
            self.k[i, :, :, :n] = store.k
            self.v[i, :, :, :n] = store.v
            self.pos[i, :, :, :n] = store.pos
            self.slot[i] = n
            if self.score is not None:
                self.score[i].zero_()
                self.score[i, :, :, :n] = store.state[H2O_STATE]
            if self.low is not None:                    # Scissorhands' state, its fill values 0 (attn is read
                for t in (self.low[i], self.count[i], self.attn[i]):   # only after a step overwrites it:
                    t.zero_()                                          # copied for the tests' comparison)
                self.low[i, :, :, :, :n] = store.state[SC_LOW].transpose(-1, -2)     # (B, H_kv, w, n)
                self.count[i, :, :, :n] = store.state[SC_COUNT]
                self.attn[i, :, :, :n] = store.state[SC_ATTN]
        self.position.fill_(cache.seen)


class _Shape:
    """What one captured shape keeps alive: the buffers, the static token, the graph and its output."""

    def __init__(self, kv: StaticKV, token: Tensor) -> None:
        self.kv, self.token = kv, token
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Tensor | None = None
        self.warm = 0


# -- a layer's attention over the buffers, in pieces: views of layer i's k, v (B, H_kv, C, d), pos (B, H_kv, C),
# slot (B, H_kv), score (B, H_kv, C); position (1,); updated in place

# write_entry(kb, vb, pos, slot, k, v, position): the new entry k, v (B, H_kv, 1, d) and its position into each
# head's ``slot`` (``LayerKV.append``), three scatters; the fused step writes them in one kernel launch
write_entry = reference_write_entry


def attend_masked(q: Tensor, kb: Tensor, vb: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """q (B, H, 1, d) over every slot whose position is >= 0 (each is in the query's past): the output
    (B, H, 1, d) and the probabilities (B, H_kv, G, C), empty slots at exactly 0."""
    B, H, _, d = q.shape
    scores = group_scores(q, kb)[:, :, :, 0]                               # (B, H_kv, G, C)
    probs = torch.softmax(scores.masked_fill((pos < 0)[:, :, None], float("-inf")), dim=-1)
    return (probs @ vb).view(B, H, 1, d), probs


def empty_one(pos: Tensor, slot: Tensor, victim: Tensor, budget: int) -> None:
    """Where a head holds more than ``budget`` entries, empty its slot ``victim`` (B, H_kv) (``LayerKV.evict``)
    and send the next token there; elsewhere the next token takes the next slot."""
    over = (pos >= 0).sum(-1) > budget                                     # (B, H_kv)
    held = pos.gather(2, victim[..., None])                                # (B, H_kv, 1)
    pos.scatter_(2, victim[..., None], torch.where(over[..., None], -1, held))
    slot.copy_(torch.where(over, victim, slot + 1))


def evict_sinks(pos: Tensor, slot: Tensor, n_sink: int, budget: int) -> None:
    """StreamingLLM: the oldest position at or after the sinks (``streaming_llm.evict_oldest``)."""
    empty_one(pos, slot, evict_oldest(pos, n_sink)[..., 0], budget)


def slot_probabilities(q: Tensor, kb: Tensor, pos: Tensor) -> Tensor:
    """What each slot received from each query head of the step's query (B, H, 1, d): (B, H_kv, C, G) fp32,
    empty slots 0. The probabilities of ``attend_masked``, with the product taken as slots x heads (C x G, a
    tall product the GPU libraries tile well) instead of G x C."""
    B, H, _, d = q.shape
    H_kv = kb.shape[1]
    qg = q.reshape(B, H_kv, H // H_kv, d) / math.sqrt(d)                  # (B, H_kv, G, d)
    scores = kb @ qg.transpose(-1, -2)                                     # (B, H_kv, C, G)
    return torch.softmax(scores.masked_fill((pos < 0)[..., None], float("-inf")), dim=-2).float()


def received_attention(q: Tensor, kb: Tensor, pos: Tensor) -> Tensor:
    """H2O's statistic: what each slot received, averaged over each KV head's G query heads (B, H_kv, C),
    rounded as a ``mean`` rounds on each device (on CUDA, the sum times 1/G), as the lean step's."""
    probs = slot_probabilities(q, kb, pos)
    return probs.sum(dim=-1) / probs.shape[-1]


def attend_heavy(q: Tensor, kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, score: Tensor, position: Tensor,
                 n_recent: int, budget: int, output: bool = True) -> Tensor | None:
    """H2O: attend, add what each entry received (the mean over each KV head's G query heads) to its score,
    then empty the lowest score outside the ``n_recent`` latest, the later position on a tie
    (``h2o.evict_lowest``). Returns the output (B, H, 1, d), or None with ``output=False`` (the
    kernel attends instead; only the probabilities are computed here)."""
    if output:
        out, probs = attend_masked(q, kb, vb, pos)
        received = probs.float().mean(dim=2)                               # (B, H_kv, C)
    else:
        out, received = None, received_attention(q, kb, pos)
    score.scatter_(2, slot[:, :, None], 0.0)             # the new entry starts at 0 (its fill value)...
    score += received                                    # ...and every entry gets what it received now
    empty_one(pos, slot, evict_lowest(score, pos, position + 1 - n_recent)[..., 0], budget)
    return out


def attend_scissors(q: Tensor, kb: Tensor, vb: Tensor, pos: Tensor, slot: Tensor, low: Tensor, count: Tensor,
                    attn: Tensor, position: Tensor, rule: DecodeRule, output: bool = True) -> Tensor | None:
    """Scissorhands (``ScissorhandsPolicy.observe`` then ``evict``): attend; the new entry's counter and ring
    buffer start empty (their fill values); the step's low flags (attention below the threshold, among the
    slots held) replace row ``position mod w`` of the ring buffer, each counter moving by its flag in and the
    flag that row held; the step's attention is kept; then the slot ``evict_one`` picks is emptied.
    low (B, H_kv, w, C), count and attn (B, H_kv, C) are updated in place. Returns the output (B, H, 1, d),
    or None with ``output=False`` (the kernel attends instead; only the probabilities are computed here)."""
    if output:
        out, probs = attend_masked(q, kb, vb, pos)
        received = divided(probs.float().sum(dim=2), probs.shape[2])       # (B, H_kv, C): group_mean's
    else:                                                                  # the same division
        out, received = None, divided(slot_probabilities(q, kb, pos).sum(dim=-1), q.shape[1] // kb.shape[1])
    B, H_kv, w, C = low.shape
    at = slot[:, :, None]                                                  # (B, H_kv, 1) the new entry's slot
    count.scatter_(2, at, 0)
    low.scatter_(3, at[:, :, None].expand(B, H_kv, w, 1), False)
    held = pos >= 0                                                        # the step's query saw every one
    flags = low_flags(received[:, :, None], held[:, :, None], rule.threshold)[:, :, 0]     # (B, H_kv, C)
    push_column(low.transpose(-1, -2), count, flags, position % w)        # its column: a contiguous row of C
    attn.copy_(received)
    empty_one(pos, slot, evict_one(pos, count, attn, position + 1 - rule.n_recent)[..., 0], rule.budget)
    return out


class GraphDecoder:
    """Decode steps of a Llama-flavour ``Transformer`` over a ``StaticKV``, captured in a CUDA graph per
    shape on a GPU, eager on a CPU; policies without an in-graph rule decode with the lean step."""

    def __init__(self, model: Transformer) -> None:
        self.lean = LeanDecoder(model)          # the stacked weights (biases, Qwen3's q/k norms), and the fallback
        self.model, self.config = model, model.config
        self.shapes: dict[tuple, _Shape] = {}           # (L, B, H_kv, C, d, dtype, device, rule) -> buffers
        self.captures = 0                               # graphs captured so far (one per shape)
        self.source = None                              # a weak reference to the cache start() took
        self.cache: KVCache | None = None               # that cache, held only where the lean step decodes it
        self.fallback: str | None = None                # why the current sequence decodes with the lean step
        self.current: _Shape | None = None
        self.rule = DecodeRule()
        self.seen = self.left = 0                       # host-side mirrors: tokens seen, steps left

    @property
    def kv(self) -> StaticKV | None:
        return None if self.current is None else self.current.kv

    def start(self, cache: KVCache, max_new_tokens: int) -> bool:
        """Take a prefilled cache for up to ``max_new_tokens`` steps: copy it into the buffers of its shape
        (allocated on first use) and return True, or print why its policy falls back to the lean step and
        return False. From here ``step`` feeds this sequence; the cache itself is left as it was (and, on the
        graph path, not kept: drop it to free its memory)."""
        self.source, self.cache, self.current = weakref.ref(cache), None, None
        self.seen, self.left = cache.seen, max_new_tokens
        rule = eviction_rule(cache.policy)
        if isinstance(rule, str):
            self.cache, self.fallback = cache, rule
            print(f"graph step: {spec_of(cache.policy)} falls back to the lean step ({rule})")
            return False
        self.fallback, self.rule = None, rule
        shape = StaticKV.shape(cache, max_new_tokens, rule)
        key = (*shape, rule)
        if key not in self.shapes:
            L, B, H_kv, C, d, dtype, device = shape
            self.shapes[key] = _Shape(StaticKV.allocate(L, B, H_kv, C, d, dtype, device, rule),
                                      torch.zeros(B, dtype=torch.long, device=device))
        self.current = self.shapes[key]
        self.current.kv.load(cache)
        return True

    def took(self, cache: KVCache) -> bool:
        """Whether ``cache`` is the one the last ``start`` took."""
        return self.source is not None and self.source() is cache

    def forget(self) -> None:
        """Drop every shape's buffers and graphs (their memory goes back to the allocator)."""
        self.shapes.clear()
        self.source = self.cache = self.current = None

    @torch.no_grad()
    def step(self, token: Tensor, cache: KVCache | None = None) -> Tensor:
        """Logits (B, V) after feeding ``token`` (B,) or (B, 1) to the sequence ``start`` took (``cache``, if
        given, must be that one: ``generate``'s ``step`` signature)."""
        if self.source is None or (cache is not None and not self.took(cache)):
            raise ValueError("call start(cache, max_new_tokens) with this cache first")
        if self.fallback is not None:
            return self.lean.step(token, self.cache)
        if self.left <= 0:
            raise ValueError("the static cache is full: start() it with a larger max_new_tokens")
        if self.seen + 1 > self.config.max_seq_len:
            raise ValueError(f"{self.seen} tokens seen + 1 new exceeds the model's max_seq_len="
                             f"{self.config.max_seq_len}")
        cur = self.current
        cur.token.copy_(token.reshape(-1))
        out = self._replay(cur) if cur.token.is_cuda else self.decode(cur.token)
        self.seen += 1
        self.left -= 1
        return out

    def _replay(self, cur: _Shape) -> Tensor:
        """The step on a GPU: eager warm-up steps on a side stream, then one capture, then replays."""
        if cur.graph is None and cur.warm < WARMUP:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.decode(cur.token)
            torch.cuda.current_stream().wait_stream(side)
            cur.warm += 1
            return out.clone()
        if cur.graph is None:                   # capture records the kernels without running them
            cur.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cur.graph):
                cur.out = self.decode(cur.token)
            self.captures += 1
        cur.graph.replay()
        return cur.out.clone()                  # the graph's output is overwritten by the next replay

    def decode(self, token: Tensor) -> Tensor:
        """The step itself, what a graph captures: logits (B, V) for ``token`` (B,) over ``self.kv``,
        updated in place. Fixed shapes, no host synchronisation, no branch on tensor data."""
        kv = self.current.kv
        x = F.embedding(token, self.model.tok_emb.weight)                             # (B, D)
        cos, sin = rope_cos_sin(kv.position, self.lean.inv_freq, x.dtype)            # (1, d) each
        logits, _ = self.lean.forward(x, cos, sin, F.linear, self._attend)
        self.advance(kv)
        return logits

    def advance(self, kv: StaticKV) -> None:
        """After a step: the next position; without eviction, every layer's next slot (one kernel for all)."""
        kv.position += 1
        if self.rule.kind == "none":            # a branch on the rule, fixed for the sequence, not on data
            kv.slot += 1

    # The pieces of a layer's attention (the functions above), held as attributes so that ``fused.py`` can
    # put compiled versions of some of them in their place.
    write = staticmethod(write_entry)
    attend_heavy = staticmethod(attend_heavy)
    attend_scissors = staticmethod(attend_scissors)
    evict_sinks = staticmethod(evict_sinks)

    def _attend(self, i: int, attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Layer i: q (B, H, 1, d), the new k, v (B, H_kv, 1, d). Write, attend over C slots, evict.
        Returns (B, H, 1, d)."""
        kv = self.current.kv
        self.write(kv.k[i], kv.v[i], kv.pos[i], kv.slot[i], k, v, kv.position)
        return self._attend_written(i, attn, q)

    def _attend_written(self, i: int, attn, q: Tensor) -> Tensor:
        """``_attend`` once layer i's buffers hold the step's entry: attend over C slots, evict."""
        kv, rule = self.current.kv, self.rule
        kb, vb, pos, slot = kv.k[i], kv.v[i], kv.pos[i], kv.slot[i]       # views (B, H_kv, C, d), (B, H_kv, C)
        d = q.shape[-1]
        if d >= 16 and d & (d - 1) == 0 and kernels.serves(q):
            out = masked_decode_attention_triton(q[:, :, 0], kb, vb, pos).unsqueeze(2)   # (B, H, 1, d)
        else:
            out = None
        if rule.kind == "heavy":
            # H2O needs the probabilities themselves: attend_heavy computes them (and the output too, where
            # the kernel did not), adds them to the scores and evicts
            computed = self.attend_heavy(q, kb, vb, pos, slot, kv.score[i], kv.position, rule.n_recent,
                                         rule.budget, output=out is None)
            return out if out is not None else computed
        if rule.kind == "scissors":             # the same: Scissorhands' flags need the probabilities
            computed = self.attend_scissors(q, kb, vb, pos, slot, kv.low[i], kv.count[i], kv.attn[i], kv.position,
                                            rule, output=out is None)
            return out if out is not None else computed
        if out is None:
            out = attend_masked(q, kb, vb, pos)[0]
        if rule.kind == "sinks":
            self.evict_sinks(pos, slot, rule.n_sink, rule.budget)
        return out                              # (rule "none": every layer's slot advances after the step)

    def generate(self, ids: Tensor, max_new_tokens: int, policy: CachePolicy | None = None,
                 cache: KVCache | None = None, stop_ids: list[int] | tuple = ()) -> Tensor:
        """Greedy continuation (B, n) of ids (B, T), as ``nanollm.generate``: the prompt through the reading
        path, every new token through ``step``."""
        cache = cache if cache is not None else KVCache(self.config, policy=policy)

        def step(token: Tensor, c: KVCache) -> Tensor:
            if not self.took(c):
                self.start(c, max_new_tokens)
            return self.step(token, c)
        return generate(self.model, ids, max_new_tokens, cache=cache, stop_ids=stop_ids, step=step)
