"""
The policy contract, checked for every method registered in ``methods.METHODS``.

Registering a method puts it under these tests; give it "easy"/"hard" options in ``TEST_OPTIONS`` below
(unlisted methods run with their defaults). Every wrapper is also crossed with every scorer
(``adakv(h2o)``, ...). Every case runs one fixed script on a TINY random-init model with GQA (4 query
heads, 2 KV heads) and on TINY_GPT2 (MHA), fp32, batch 2, weights scaled (conftest ``INIT_STD``) so that
attention is peaked and "kept = top-scored" is not decided by ties:

    prefill(48 tokens) -> 2 decode steps -> extend(6-token chunk) -> 2 decode steps      (58 tokens)

and asserts:
* identity at full budget: with ``budget >=`` all 58 tokens, every step's logits equal the full
  cache's bit-for-bit (``torch.equal``), prefill, decode and extend alike;
* budget respected: after every step each layer and KV head holds at most ``budget`` valid entries,
  plus what the policy declares (``slack``, ``head_slack``: ``nanollm.policy.CachePolicy``), and the layer
  holds at most ``H_kv * (budget + slack)``;
* well-formed cache: storage at KV-head granularity, k/v/pos of one length, valid positions unique
  and < tokens seen (in any slot order: evicting in place reuses slots), protected positions present;
* the same on both storage paths: forcing attention's general masked path everywhere (instead of the
  mask-free fast paths on dense storage) gives the same logits (1e-5) and the same kept positions;
* rows independent: each row of a batch keeps what it would keep alone, with the same logits;
* determinism and reuse: two fresh runs keep identical entries; after ``reset()`` a policy that saw
  sequence A gives on sequence B exactly what a fresh one gives;
* kept = top-scored: at every compression of a scoring policy, each KV head keeps its protected entries
  and, of the others, the highest ``score``s (ties: the earlier slot), as many as it keeps;
* no NaN/inf at tiny budgets (1, 3: smaller than the sinks and windows);
* clear errors: budget <= 0, unknown method, unknown option.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import nanollm.attention as attention
from methods import METHODS, make_policy, method_options, scorers, wrappers
from nanollm import FullCache, KVCache, Transformer, decode_step, extend, prefill, preset
from nanollm.policy import CachePolicy, Needs, ScoringPolicy, select_topk
from nanollm.wrapper import PolicyWrapper
from tests.methods.knorm import KnormPolicy

# Per-method option sets: [easy, hard, ...]. Defaults are the paper's; "hard" ones push the edge cases.
TEST_OPTIONS: dict[str, list[dict]] = {
    "full": [{}],
    "streaming_llm": [{}, {"n_sink": 1}, {"n_sink": 0}],
    "h2o": [{}, {"n_recent": 0}],
    "snapkv": [{}, {"window": 8, "kernel": 3}, {"window": 4, "kernel": 1, "pooling": "avg"}],
    "adakv": [{}, {"window": 8, "kernel": 3}, {"window": 2, "kernel": 5, "pooling": "avg",
                                               "alpha_safeguard": 0.0}],
    "chunkkv": [{}, {"window": 8, "chunk_size": 4, "reuse": 1}, {"window": 3, "chunk_size": 7, "reuse": 2,
                                                                 "per_head": True, "remainder": "none"}],
    "critical_kv": [{}, {"window": 8, "kernel": 3, "alpha": 0.0},
                    {"inner": "adakv(snapkv)", "window": 4, "alpha": 0.5, "stage2": "host", "epsilon": 1e-4},
                    {"inner": "adakv(h2o)"}, {"inner": "adakv(snapkv)", "alpha_safeguard": 0.0}],
    "scissorhands": [{}, {"history_window": 1, "n_recent": 0}, {"history_window": 3, "drop": 4, "threshold": 0.05}],
}
TEST_OPTIONS["kvreviver"] = [{}, {"candidate_share": 0.3, "vague_share": 0.3, "recent_slack": 2},
                              {"candidate_share": 0.0, "rows": 1, "replace_rate": 1.0}]

# Options of a wrapper when it is crossed with a scorer (the scorer keeps its defaults).
WRAPPER_OPTIONS: dict[str, list[dict]] = {
    "adakv": [{}, {"alpha_safeguard": 0.0}],
    "chunkkv": [{}, {"chunk_size": 3, "reuse": 1, "per_head": True, "remainder": "none"}],
    "critical_kv": [{}, {"alpha": 0.5, "stage2": "host", "epsilon": 1e-4}],
}

N_PROMPT, N_CHUNK, BATCH = 48, 6, 2
TOTAL = N_PROMPT + 2 + N_CHUNK + 2          # tokens seen at the end of the script


# A test-only scorer, kvpress's KnormPress in 23 lines (tests/methods/knorm.py): a new scoring method takes a
# score and nothing else to run alone and inside every wrapper. Registered for each test (``registered``) under
# a name no method of the project takes (a method of yours registered as "knorm" is tested as itself).
TEST_ONLY = "test_knorm"
assert TEST_ONLY not in METHODS, f"{TEST_ONLY!r} is the contract tests' own scorer: register yours under another name"
TEST_METHODS = {**METHODS, TEST_ONLY: KnormPolicy}


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    monkeypatch.setitem(METHODS, TEST_ONLY, KnormPolicy)


def cases():
    """Every method with each of its option sets, and every wrapper over every scorer. The fast tier runs
    one option set per method (the first) and the test-only scorer inside AdaKV; the rest, and the cross
    product, are the slow tier."""
    for name in TEST_METHODS:
        for i, opts in enumerate(TEST_OPTIONS.get(name, [{}])):
            yield pytest.param(name, opts, id=f"{name}-{i}", marks=() if i == 0 else pytest.mark.slow)
    for wrapper in wrappers():
        for scorer in [*scorers(), TEST_ONLY]:
            for i, opts in enumerate(WRAPPER_OPTIONS.get(wrapper, [{}])):
                spec = f"{wrapper}({scorer})"
                fast = spec == f"adakv({TEST_ONLY})" and i == 0
                yield pytest.param(spec, opts, id=f"{spec}-{i}", marks=() if fast else pytest.mark.slow)


@pytest.fixture(scope="module", params=["TINY", "TINY_GPT2"])
def model(request, make_model) -> Transformer:
    return make_model(preset(request.param), seed=0)


def make_seq(seed: int, n_prompt: int = N_PROMPT) -> dict:
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, 512, (BATCH, n), generator=g)

    return {"prompt": ids(n_prompt), "dec1": ids(2), "chunk": ids(N_CHUNK), "dec2": ids(2)}


def run_script(model: Transformer, cache: KVCache, seq: dict, check=None) -> tuple[list, list]:
    """Teacher-forced script; returns every step's logits and every layer's stored positions."""
    logits, kept = [], []

    def record(out: torch.Tensor) -> None:
        logits.append(out)
        kept.append([layer.pos.clone() for layer in cache.layers])
        if check is not None:
            check(cache)

    record(prefill(model, seq["prompt"], cache))
    for t in seq["dec1"].T:
        record(decode_step(model, t, cache))
    record(extend(model, seq["chunk"], cache))
    for t in seq["dec2"].T:
        record(decode_step(model, t, cache))
    return logits, kept


def check_cache(cache: KVCache, policy: CachePolicy, n_prompt: int) -> None:
    """Budget respected (+ declared slack) and well-formed storage, after one step."""
    cfg = cache.config
    seen, H_kv = cache.seen, cfg.n_kv_head
    budget = policy.budget
    slack = policy.slack(n_prompt, seen - n_prompt)
    head_slack = policy.head_slack(H_kv)
    protected = set(policy.protected_positions(n_prompt, seen))
    for li, layer in enumerate(cache.layers):
        k, v, pos = layer.k, layer.v, layer.pos
        assert pos.shape[:2] == (BATCH, H_kv), f"layer {li}: storage must be per KV head, got {pos.shape}"
        assert k.shape[:3] == v.shape[:3] == pos.shape, f"layer {li}: k/v/pos lengths differ"
        counts = (pos >= 0).sum(-1)                                    # (B, H_kv)
        assert int(counts.max()) <= budget + slack + head_slack, \
            f"layer {li}: a head holds {int(counts.max())} > budget {budget} + slack {slack} + {head_slack}"
        assert int(counts.sum(-1).max()) <= H_kv * (budget + slack), \
            f"layer {li}: {int(counts.sum(-1).max())} entries > H_kv * (budget + slack)"
        for b in range(BATCH):
            for h in range(H_kv):
                p = pos[b, h][pos[b, h] >= 0]
                assert p.unique().numel() == p.numel(), f"layer {li} head {h}: a position held twice: {p}"
                assert p.numel() == 0 or int(p.max()) < seen, f"layer {li}: a position beyond tokens seen"
                missing = protected - set(p.tolist())
                assert not missing, f"layer {li} row {b} head {h}: protected positions {sorted(missing)} evicted"


# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,opts", list(cases()))
def test_identity_at_full_budget(model, name, opts):
    seq = make_seq(1)
    ref, ref_kept = run_script(model, KVCache(model.config, FullCache()), seq)
    out, kept = run_script(model, KVCache(model.config, make_policy(name, TOTAL, **opts)), seq)
    for step, (a, b) in enumerate(zip(ref, out)):
        assert torch.equal(a, b), f"step {step}: logits differ from the full cache, max abs diff " \
                                  f"{(a - b).abs().max().item():.3g}"
    for a, b in zip(ref_kept[-1], kept[-1]):
        assert torch.equal(a, b), "a budget covering every token must keep every token, in order"


@pytest.mark.parametrize("budget", [1, 3, 12, 30])
@pytest.mark.parametrize("name,opts", list(cases()))
def test_budget_and_wellformed(model, name, opts, budget):
    policy = make_policy(name, budget, **opts)
    cache = KVCache(model.config, policy)
    logits, _ = run_script(model, cache, make_seq(2), check=lambda c: check_cache(c, policy, N_PROMPT))
    for step, x in enumerate(logits):
        assert torch.isfinite(x).all(), f"step {step}: non-finite logits at budget {budget}"


@pytest.mark.parametrize("name,opts", list(cases()))
def test_prompt_shorter_than_default_windows(model, name, opts):
    """A 20-token prompt (shorter than SnapKV's 32-token window) compressed to 8 entries per head."""
    n_prompt = 20
    policy = make_policy(name, 8, **opts)
    cache = KVCache(model.config, policy)
    logits, _ = run_script(model, cache, make_seq(6, n_prompt=n_prompt),
                           check=lambda c: check_cache(c, policy, n_prompt))
    assert all(torch.isfinite(x).all() for x in logits)


# Wrappers whose rule is not a top-k of ``score``: ChunkKV keeps whole chunks by their summed score, CriticalKV
# refines the host's choice by the output perturbation. Their own tests check their rules.
OTHER_RULES = ("chunkkv", "critical_kv")


def top_k_cases():
    """The cases whose outermost policy selects by a top-k of its score."""
    for case in cases():
        outer = case.values[0].split("(")[0]
        if issubclass(TEST_METHODS[outer], (ScoringPolicy, PolicyWrapper)) and outer not in OTHER_RULES:
            yield case


@pytest.mark.parametrize("budget", [3, 12, 30])
@pytest.mark.parametrize("name,opts", list(top_k_cases()))
def test_kept_entries_are_the_top_scored(model, name, opts, budget):
    """At every compression, each KV head keeps its protected entries and, of the others, the ones with the
    highest score (ties: the earlier position), as many as it keeps: the rule of every scoring policy, whatever
    decides how many a head keeps (a uniform budget, AdaKV's shared one, Scissorhands' m at a time)."""
    policy = make_policy(name, budget=budget, **opts)
    select, compressions = policy.select, []

    def checked_select(ctx):
        scores = policy.keep_scores(ctx)                                # (B, H_kv, T), protected at +inf
        idx = select(ctx)                                                        # (B, H_kv, K), -1 = none
        for b in range(idx.shape[0]):
            for h in range(idx.shape[1]):
                kept = idx[b, h][idx[b, h] >= 0]
                if len(kept):
                    top = select_topk(scores[b, h].view(1, 1, -1), len(kept), ctx.kv.pos[b, h].view(1, 1, -1))
                    assert kept.tolist() == top.flatten().tolist(), \
                        f"layer {ctx.layer} row {b} head {h}: kept {kept.tolist()}, top-scored {top.flatten().tolist()}"
        compressions.append(ctx.layer)
        return idx

    policy.select = checked_select
    run_script(model, KVCache(model.config, policy), make_seq(5))
    assert compressions, f"{name} never compressed"


@pytest.mark.parametrize("budget", [12, 30])
@pytest.mark.parametrize("name,opts", list(cases()))
def test_same_on_both_attends(model, name, opts, budget, monkeypatch):
    """Which attend serves the prompt changes nothing a method sees: the prompt through the general masked
    ``attend`` instead of ``attend_prompt`` gives the same logits (fp32, 1e-5) and keeps exactly the same
    positions, and the budget and well-formedness checks hold on it too."""
    seq = make_seq(4)
    fast_logits, fast_kept = run_script(model, KVCache(model.config, make_policy(name, budget, **opts)), seq)

    def prompt_through_attend(q, k, v, needs=Needs()):
        pos = torch.arange(q.shape[2])
        return attention.attend(q, k, v, pos, pos.expand(*k.shape[:3]), needs)
    monkeypatch.setattr(attention, "attend_prompt", prompt_through_attend)
    policy = make_policy(name, budget, **opts)
    logits, kept = run_script(model, KVCache(model.config, policy), seq,
                              check=lambda c: check_cache(c, policy, N_PROMPT))
    for step, (a, b) in enumerate(zip(fast_logits, logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"step {step}: logits differ between paths")
    for step, (a, b) in enumerate(zip(fast_kept, kept)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}: kept positions differ between paths"


@pytest.mark.parametrize("name,opts", list(cases()))
def test_rows_of_a_batch_are_independent(model, name, opts):
    """Each row of a batch is compressed as if it ran alone: the same kept positions (valid entries per
    head) and the same logits (fp32, 1e-5) as a one-row run of that row."""
    seq = make_seq(5)
    both_logits, both_kept = run_script(model, KVCache(model.config, make_policy(name, 12, **opts)), seq)
    for r in range(BATCH):
        logits, kept = run_script(model, KVCache(model.config, make_policy(name, 12, **opts)),
                                  {k: v[r:r + 1] for k, v in seq.items()})
        for step, (a, b) in enumerate(zip(both_logits, logits)):
            torch.testing.assert_close(a[r:r + 1], b, rtol=0, atol=1e-5, msg=f"row {r}, step {step}: logits")
        for step, (a, b) in enumerate(zip(both_kept, kept)):
            for layer, (x, y) in enumerate(zip(a, b)):
                for h in range(x.shape[1]):
                    mine, alone = x[r, h][x[r, h] >= 0], y[0, h][y[0, h] >= 0]
                    assert torch.equal(mine, alone), f"row {r}, step {step}, layer {layer}, head {h}: kept differ"


@pytest.mark.parametrize("name,opts", list(cases()))
def test_deterministic(model, name, opts):
    seq = make_seq(3)
    a_logits, a_kept = run_script(model, KVCache(model.config, make_policy(name, 12, **opts)), seq)
    b_logits, b_kept = run_script(model, KVCache(model.config, make_policy(name, 12, **opts)), seq)
    for a, b in zip(a_logits, b_logits):
        assert torch.equal(a, b)
    for step_a, step_b in zip(a_kept, b_kept):
        for a, b in zip(step_a, step_b):
            assert torch.equal(a, b), "same inputs, same seed: kept entries must be identical"


@pytest.mark.parametrize("name,opts", list(cases()))
def test_reset_makes_policy_reusable(model, name, opts):
    seq_a, seq_b = make_seq(4, n_prompt=40), make_seq(5)
    used = make_policy(name, 12, **opts)
    cache = KVCache(model.config, used)
    run_script(model, cache, seq_a)
    cache.reset()                                       # resets the policy too
    b_after_a, kept_after_a = run_script(model, cache, seq_b)
    b_fresh, kept_fresh = run_script(model, KVCache(model.config, make_policy(name, 12, **opts)), seq_b)
    for a, b in zip(b_after_a, b_fresh):
        assert torch.equal(a, b), "state from sequence A leaked into sequence B"
    for step_a, step_b in zip(kept_after_a, kept_fresh):
        for a, b in zip(step_a, step_b):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name,opts", list(cases()))
def test_policy_reused_in_a_new_cache(model, name, opts):
    """A policy handed to a second, fresh cache (as ``generate(..., policy=p)`` twice does) behaves as new."""
    seq_a, seq_b = make_seq(7, n_prompt=40), make_seq(8)
    used = make_policy(name, 12, **opts)
    run_script(model, KVCache(model.config, used), seq_a)
    again, _ = run_script(model, KVCache(model.config, used), seq_b)
    fresh, _ = run_script(model, KVCache(model.config, make_policy(name, 12, **opts)), seq_b)
    for a, b in zip(again, fresh):
        assert torch.equal(a, b), "state from an earlier cache leaked into a new one"


# ---------------------------------------------------------------------------------------------------------
# Registry and errors

@pytest.mark.parametrize("name", list(METHODS))
def test_registered_policy_shape(name):
    cls = METHODS[name]
    assert issubclass(cls, (CachePolicy, PolicyWrapper)) and dataclasses.is_dataclass(cls)
    assert "budget" in {f.name for f in dataclasses.fields(cls)}
    policy = make_policy(name, 7)
    assert isinstance(policy, cls) and policy.budget == 7
    doc = __import__(cls.__module__, fromlist=["_"]).__doc__
    assert doc and "Paper:" in doc, f"{cls.__module__} needs a paper-card module docstring (a line 'Paper: ...')"


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("budget", [0, -3])
def test_nonpositive_budget_rejected(name, budget):
    with pytest.raises(ValueError, match="budget"):
        make_policy(name, budget)
    with pytest.raises(ValueError, match="budget"):
        METHODS[name](budget=budget)


def test_unknown_method_names_choices():
    with pytest.raises(ValueError) as e:
        make_policy("no_such_method", 8)
    for name in METHODS:
        assert repr(name) in str(e.value)


@pytest.mark.parametrize("name", list(METHODS))
def test_unknown_option_names_valid_ones(name):
    with pytest.raises(ValueError) as e:
        make_policy(name, 8, no_such_option=1)
    assert "no_such_option" in str(e.value)
    for opt in method_options(name):
        assert opt in str(e.value)
