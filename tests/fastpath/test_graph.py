"""The graph-capturable decode step (fastpath/graph.py) computes what the lean step computes, keeps what it keeps,
and falls back to it, saying so, where a method has no in-graph rule."""

import shutil
from types import SimpleNamespace

import pytest
import torch

import fastpath.graph as graph_module
import kernels
import kernels.decode_attention as kernel_module
from fastpath.graph import BF16_TOL, GraphDecoder, eviction_rule
from fastpath.lean import LeanDecoder
from methods import make_policy
from methods.rules import DecodeRule
from nanollm import KVCache, preset
from nanollm.generation import prefill
from tests.conftest import one_fast

PREFILL_ONLY = [None, "full", "snapkv", "adakv", "chunkkv", "critical_kv", "critical_kv(adakv(snapkv))",
                "chunkkv(snapkv)", "adakv(chunkkv)"]
FALLBACK = ["kvreviver", "adakv(h2o)", "chunkkv(streaming_llm)", "adakv(scissorhands)"]


def tokens(n: int = 34, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (2, n), generator=torch.Generator().manual_seed(seed))


def steps_both(model, x, spec=None, budget=12, n_prompt=20, graph=None, check_entries=True, **options):
    """Logits (B, steps, V) of the lean step and of the graph step over the same tokens, each with its own
    cache; and the lean cache and the graph decoder, to compare what they hold."""
    def new_cache():
        return KVCache(model.config, make_policy(spec, budget, **options) if spec else None)
    ca, cb = new_cache(), new_cache()
    lean, graph = LeanDecoder(model), graph or GraphDecoder(model)
    with torch.no_grad():
        prefill(model, x[:, :n_prompt], ca)
        prefill(model, x[:, :n_prompt], cb)
    graph.start(cb, x.shape[1] - n_prompt)
    ref, out = [], []
    for t in range(n_prompt, x.shape[1]):
        ref.append(lean.step(x[:, t], ca))
        out.append(graph.step(x[:, t]))
        if check_entries and graph.fallback is None:    # the same entries kept after every step
            assert_same_entries(ca, graph)
            if graph.rule.kind == "scissors":           # and Scissorhands' counters and ring buffer
                assert_same_state(ca, graph)
    return torch.stack(ref, 1), torch.stack(out, 1), ca, graph


def held(pos: torch.Tensor) -> list:
    """(B, H_kv, T) positions -> per row and head, the sorted positions held (empty slots left out)."""
    return [[sorted(p for p in head.tolist() if p >= 0) for head in row] for row in pos]


def assert_lean_logits(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """A step's logits against the lean step's: fp32 within 1e-5, bf16 within BF16_TOL of the largest |logit|."""
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    else:
        assert (out.float() - ref.float()).abs().max() <= BF16_TOL * ref.float().abs().max()


def assert_same_entries(cache: KVCache, graph: GraphDecoder) -> None:
    for i, store in enumerate(cache.layers):
        assert held(store.pos) == held(graph.kv.pos[i]), f"layer {i} holds other positions"


@pytest.mark.parametrize("spec", PREFILL_ONLY)
def test_prefill_only_methods_decode_in_the_graph_step(tiny_model, spec):
    """Budget 12 below the 20-token prompt: the lean step's logits over 14 steps, fp32 within 1e-5."""
    ref, out, cache, graph = steps_both(tiny_model, tokens(), spec)
    assert graph.fallback is None and graph.rule.kind == "none"
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert_same_entries(cache, graph)


@pytest.mark.parametrize("spec,n_prompt,options", [
    ("streaming_llm", 20, {}), ("streaming_llm", 8, {}), ("streaming_llm", 20, {"n_sink": 0}),
    ("streaming_llm", 20, {"n_sink": 30}),                     # more sinks than the budget: cut to budget - 1
    ("h2o", 20, {}), ("h2o", 8, {}), ("h2o", 20, {"n_recent": 0}), ("h2o", 20, {"n_recent": 12}),
    ("scissorhands", 20, {}), ("scissorhands", 8, {}), ("scissorhands", 20, {"n_recent": 0}),
    ("scissorhands", 20, {"history_window": 3}),              # the ring buffer wraps within the 20 steps
    ("scissorhands", 20, {"history_window": 5, "threshold": 0.05})])
def test_decode_time_eviction_in_the_graph_step(tiny_model, spec, n_prompt, options):
    """StreamingLLM, H2O and Scissorhands evict inside the step: the same logits and, after every step, the
    same kept positions as the lean step's policy (a prompt of 8 below the budget 12 fills the room first);
    Scissorhands' counters and ring buffer also hold what the lean policy's do, slot for slot."""
    x = tokens(40)
    ref, out, cache, graph = steps_both(tiny_model, x, spec, 12, n_prompt, **options)
    assert graph.fallback is None
    assert graph.rule.kind == {"streaming_llm": "sinks", "h2o": "heavy", "scissorhands": "scissors"}[spec]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert_same_entries(cache, graph)
    assert graph.kv.k.shape[3] == 13 and all(len(p) == 12 for row in held(graph.kv.pos[0]) for p in row)


def assert_same_state(cache: KVCache, graph: GraphDecoder) -> None:
    """Scissorhands' per-slot state in the graph's buffers, by position, equals the lean cache's."""
    from methods.scissorhands import ATTN, COUNT, LOW
    for i, store in enumerate(cache.layers):
        low = graph.kv.low[i].transpose(-1, -2)                            # (B, H_kv, C, w) as the lean path's
        for name, buffer in ((LOW, low), (COUNT, graph.kv.count[i]), (ATTN, graph.kv.attn[i])):
            lean = by_position(store.pos, store.state[name])
            ours = by_position(graph.kv.pos[i], buffer)
            assert lean.keys() == ours.keys(), name
            for key in lean:
                torch.testing.assert_close(ours[key], lean[key], rtol=0, atol=1e-6, msg=f"layer {i} {name} {key}")


def by_position(pos: torch.Tensor, state: torch.Tensor) -> dict:
    """(B, H_kv, T) positions and (B, H_kv, T, ...) per-slot state -> {(row, head, position): its state}."""
    return {(b, h, p): state[b, h, t] for b, row in enumerate(pos.tolist()) for h, head in enumerate(row)
            for t, p in enumerate(head) if p >= 0}


def test_scissorhands_dropping_several_at_a_time_falls_back(tiny_model, capsys):
    """m = 2 drops two tokens, then none for a step: not the step's one-slot rule, so the lean step."""
    ref, out, _, graph = steps_both(tiny_model, tokens(26), "scissorhands", drop=2)
    assert "m > 1" in capsys.readouterr().out and graph.fallback is not None
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("spec", FALLBACK)
def test_other_methods_fall_back_to_the_lean_step_saying_so(tiny_model, spec, capsys):
    ref, out, cache, graph = steps_both(tiny_model, tokens(26), spec)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"graph step: {spec} falls back to the lean step (")
    assert graph.fallback is not None and graph.kv is None
    torch.testing.assert_close(out, ref, rtol=0, atol=0)          # it is the lean step


def test_the_rules_come_from_what_a_policy_declares():
    assert eviction_rule(None).kind == "none"
    for spec in PREFILL_ONLY[1:]:
        assert eviction_rule(make_policy(spec, 16)).kind == "none", spec
    assert eviction_rule(make_policy("streaming_llm", 16, n_sink=4)).n_sink == 4
    assert eviction_rule(make_policy("streaming_llm", 3, n_sink=4)).n_sink == 2        # budget - 1
    assert eviction_rule(make_policy("h2o", 16)).n_recent == 8
    assert "attend_kv" in eviction_rule(make_policy("kvreviver", 16))
    for spec in FALLBACK:
        assert isinstance(eviction_rule(make_policy(spec, 16)), str), spec


@pytest.mark.parametrize("mistake", ["slot", "position"])
def test_the_comparison_sees_an_off_by_one(tiny_model, mistake):
    """A check of the check: a write slot one early (each new entry over the last prompt entry) or a position
    one behind (RoPE and the stored positions of the previous token) moves the logits far beyond 1e-5."""
    x = tokens(26)
    ref, out, _, _ = steps_both(tiny_model, x, "snapkv")
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    graph = GraphDecoder(tiny_model)
    original = graph.start

    def start_off_by_one(cache, n):
        original(cache, n)
        getattr(graph.kv, mistake).sub_(1)
    graph.start = start_off_by_one
    _, wrong, _, _ = steps_both(tiny_model, x, "snapkv", graph=graph, check_entries=False)
    assert (wrong - ref).abs().max() > 1e-2


def test_one_shape_one_set_of_buffers(tiny_model):
    """A second sequence of the same shape is copied into the same buffers (on a GPU: replays the same
    graph); another shape gets its own; the logits stay the lean step's."""
    graph = GraphDecoder(tiny_model)
    for seed in (0, 1):
        ref, out, _, _ = steps_both(tiny_model, tokens(30, seed), "snapkv", graph=graph)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert len(graph.shapes) == 1
    ref, out, _, _ = steps_both(tiny_model, tokens(30, 2), "snapkv", budget=10, graph=graph)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert len(graph.shapes) == 2


@pytest.mark.parametrize("spec", [None, "snapkv", "h2o", "scissorhands"])
def test_generate_equals_the_lean_generate(tiny_model, spec):
    x = tokens(16, 3)
    lean = LeanDecoder(tiny_model).generate(x, 12, cache=KVCache(tiny_model.config, make_policy(spec, 10)
                                                                 if spec else None))
    graph = GraphDecoder(tiny_model)
    assert torch.equal(graph.generate(x, 12, policy=make_policy(spec, 10) if spec else None), lean)


@pytest.mark.parametrize("spec", [None, "snapkv", "adakv", "streaming_llm", "h2o", "scissorhands"])
def test_bf16_within_the_documented_tolerance(make_model, tiny_cfg, spec):
    """bf16: within BF16_TOL of the largest |logit| (both paths round every product to bf16)."""
    model = make_model(tiny_cfg, seed=1).to(torch.bfloat16)
    ref, out, cache, graph = steps_both(model, tokens(34, 1), spec)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref.float()).abs().max() <= BF16_TOL * ref.float().abs().max()
    assert_same_entries(cache, graph)


def test_clear_errors(tiny_model, make_model):
    graph = GraphDecoder(tiny_model)
    with pytest.raises(ValueError, match="start"):
        graph.step(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="prefix"):
        graph.start(KVCache(tiny_model.config), 4)
    cache = KVCache(tiny_model.config, make_policy("h2o", 8))
    with torch.no_grad():
        prefill(tiny_model, tokens(12)[:, :10], cache)
        LeanDecoder(tiny_model).step(tokens(12)[:, 10], cache)          # a slot emptied, waiting
    with pytest.raises(ValueError, match="right after prefill"):
        graph.start(cache, 4)
    cache = KVCache(tiny_model.config)
    with torch.no_grad():
        prefill(tiny_model, tokens(12)[:, :10], cache)
    graph.start(cache, 1)
    graph.step(tokens()[:, 10])
    with pytest.raises(ValueError, match="larger max_new_tokens"):
        graph.step(tokens()[:, 11])
    with pytest.raises(ValueError, match="llama-flavour"):
        GraphDecoder(make_model(preset("TINY_GPT2")))
    short = make_model(preset("TINY", max_seq_len=12))
    cache, graph = KVCache(short.config), GraphDecoder(short)
    with torch.no_grad():
        prefill(short, tokens(12)[:, :10], cache)
    graph.start(cache, 5)
    graph.step(tokens()[:, 10])
    graph.step(tokens()[:, 11])
    with pytest.raises(ValueError, match="max_seq_len"):
        graph.step(tokens()[:, 12])


# -- the attention through the kernel -----------------------------------------------------------------------

through_kernels = pytest.mark.skipif(
    not kernels.HAS_TRITON or not kernels.interpreting(),
    reason="needs Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on a machine without a GPU)")


def fused_eager(model):
    from fastpath.fused import FusedGraphDecoder
    torch._dynamo.reset()
    return FusedGraphDecoder(model, backend="eager")


@through_kernels
@pytest.mark.parametrize("make_graph", one_fast(fused_eager, GraphDecoder), ids=["fused", "graph"])
@pytest.mark.parametrize("spec,budget", one_fast(("h2o", 8), (None, 12), ("adakv", 12), ("streaming_llm", 8),
                                                 ("scissorhands", 8)))
def test_the_kernel_attends_over_the_buffers_with_empty_slots(tiny_model, spec, budget, make_graph, monkeypatch):
    """Where ``kernels.serves`` says so (patched here to take CPU tensors, through the interpreter), the
    step's attention is the masked split-K kernel over the fixed buffers: the room not yet written, AdaKV's
    per-head padding and StreamingLLM's emptied slots are masked by position (H2O's and Scissorhands'
    probabilities come from ``slot_probabilities`` beside it), and the logits and kept entries stay the lean
    step's (which attends in PyTorch) within 1e-5; the fused step's compiled pieces (traced by dynamo alone
    here) likewise."""
    calls = []
    real = kernel_module.masked_decode_attention_triton

    def counted(*args, **kw):
        calls.append(args[1].shape)
        return real(*args, **kw)
    monkeypatch.setattr(graph_module, "masked_decode_attention_triton", counted)
    monkeypatch.setattr(graph_module, "kernels", SimpleNamespace(serves=lambda t: True))   # the graph step's only
    ref, out, cache, graph = steps_both(tiny_model, tokens(28), spec, budget, graph=make_graph(tiny_model))
    assert len(calls) == 8 * tiny_model.config.n_layer                      # every layer of every step
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert_same_entries(cache, graph)


def test_received_attention_is_the_mean_of_the_probabilities():
    """H2O's statistic from the tall product (slots x heads) equals the mean over each group's query heads of
    ``attend_masked``'s probabilities, empty slots at 0."""
    g = torch.Generator().manual_seed(0)
    B, H, H_kv, C, d = 2, 8, 2, 11, 16
    q, kb, vb = torch.randn(B, H, 1, d, generator=g), torch.randn(B, H_kv, C, d, generator=g), \
        torch.randn(B, H_kv, C, d, generator=g)
    pos = torch.arange(C).repeat(B, H_kv, 1)
    pos[0, 1, 3] = pos[1, 0, 9:] = -1
    got = graph_module.received_attention(q, kb, pos)
    torch.testing.assert_close(got, graph_module.attend_masked(q, kb, vb, pos)[1].mean(dim=2), rtol=0, atol=1e-6)
    assert (got[pos < 0] == 0).all() and got.shape == (B, H_kv, C)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("output", [True, False], ids=["attending", "beside the kernel"])
def test_scissorhands_flags_a_uniform_attention_low_on_every_device(device, output):
    """A zero query gives each of 19 slots exactly 1/19 from each of 3 query heads; their mean, the sum divided
    by 3, rounds an ulp below 1/19 on every device, so the graph step flags every slot low, as the lean step
    (``scissorhands.group_mean``) and the kernel do, whether it attends or only computes the probabilities
    beside the kernel (on CUDA, a division by a Python number would multiply by 1/3 and get 1/19: none low)."""
    B, H, H_kv, C, d, w = 1, 3, 1, 19, 16, 4

    def step(dev):
        g = torch.Generator().manual_seed(0)
        q = torch.zeros(B, H, 1, d, device=dev)
        kb, vb = (torch.randn(B, H_kv, C, d, generator=g).to(dev) for _ in range(2))
        pos = torch.arange(C, device=dev).repeat(B, H_kv, 1)                 # every slot held
        slot = torch.full((B, H_kv), C - 1, device=dev)                      # the step's entry: the last
        low = torch.zeros(B, H_kv, w, C, dtype=torch.bool, device=dev)
        count = torch.zeros(B, H_kv, C, dtype=torch.int32, device=dev)
        attn = torch.zeros(B, H_kv, C, device=dev)
        rule = DecodeRule("scissors", budget=C - 1, n_recent=2, window=w)
        graph_module.attend_scissors(q, kb, vb, pos, slot, low, count, attn, torch.tensor([C - 1], device=dev),
                                     rule, output=output)
        return low[:, :, (C - 1) % w], attn
    flags, attn = step(device)
    assert flags.all()                                                     # every slot below fp32's 1/19
    assert torch.equal(attn.cpu(), step("cpu")[1])


# -- the step as one graph ------------------------------------------------------------------------------------

def compiled_steps(model, spec, backend):
    """The graph step's own function under torch.compile(fullgraph=True): a break (a .item(), a branch on a
    tensor) is an error. Returns the lean logits and the compiled step's."""
    x = tokens(30)
    ca, cb = (KVCache(model.config, make_policy(spec, 12) if spec else None) for _ in range(2))
    lean, graph = LeanDecoder(model), GraphDecoder(model)
    with torch.no_grad():
        prefill(model, x[:, :20], ca)
        prefill(model, x[:, :20], cb)
    assert graph.start(cb, 10)
    step = torch.compile(graph.decode, fullgraph=True, backend=backend)
    ref, out = [], []
    with torch.no_grad():
        for t in range(20, 30):
            ref.append(lean.step(x[:, t], ca))
            out.append(step(x[:, t]))
    return torch.stack(ref), torch.stack(out)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["snapkv", "streaming_llm", "h2o", "scissorhands"])
def test_the_step_traces_as_one_graph(tiny_model, spec):
    """Dynamo traces the step of every rule whole (fullgraph=True; AOT autograd's functionalisation of the
    in-place writes included), and the traced step matches the lean one."""
    torch._dynamo.reset()
    ref, out = compiled_steps(tiny_model, spec, "aot_eager")
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_the_step_compiles_with_inductor(tiny_model):
    """torch.compile's default backend (inductor, C++ on a CPU) over H2O's step, the one with the most
    operations: it compiles whole and matches (about a minute on two cores)."""
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("inductor needs a C++ compiler on a CPU and none is installed")
    torch._dynamo.reset()
    ref, out = compiled_steps(tiny_model, "h2o", None)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


# -- on a GPU: captured, replayed ----------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("spec", [None, "snapkv", "critical_kv(adakv(snapkv))", "streaming_llm", "h2o",
                                  "scissorhands"])
def test_captured_and_replayed_on_a_gpu(make_model, tiny_cfg, spec, monkeypatch):
    """fp32 on CUDA: the first steps eager, one capture, then replays; the lean step's logits within 1e-5 (its
    attention in PyTorch too, NANOKV_NO_TRITON=1, so both sum alike); a second sequence of the same shape
    replays the same graph."""
    monkeypatch.setenv("NANOKV_NO_TRITON", "1")
    model = make_model(tiny_cfg, seed=1).cuda()
    graph = GraphDecoder(model)
    for seed in (0, 1):
        ref, out, cache, _ = steps_both(model, tokens(34, seed).cuda(), spec, graph=graph)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        assert_same_entries(cache, graph)
        assert graph.captures == 1 and graph.current.graph is not None


@cuda
@pytest.mark.parametrize("spec", [None, "snapkv", "streaming_llm", "h2o"])
def test_bf16_on_a_gpu(make_model, tiny_cfg, spec, monkeypatch):
    monkeypatch.setenv("NANOKV_NO_TRITON", "1")
    model = make_model(tiny_cfg, seed=1).cuda().to(torch.bfloat16)
    ref, out, _, graph = steps_both(model, tokens(34, 1).cuda(), spec)
    assert graph.captures == 1
    assert (out.float() - ref.float()).abs().max() <= BF16_TOL * ref.float().abs().max()


@cuda
@pytest.mark.parametrize("dtype,spec", [(dtype, spec) for dtype in (torch.float32, torch.bfloat16)
                                         for spec in (None, "snapkv", "streaming_llm")]
                         + [(torch.float32, "h2o"), (torch.float32, "scissorhands")])
def test_captured_with_the_kernel_on_a_gpu(make_model, tiny_cfg, spec, dtype):
    """The default on CUDA: the masked split-K kernel inside the captured graph (the lean step takes the
    contiguous kernel with the plain cache, PyTorch with a policy): fp32 within 1e-5, bf16 within BF16_TOL."""
    model = make_model(tiny_cfg, seed=1).cuda().to(dtype)
    ref, out, cache, graph = steps_both(model, tokens(34, 2).cuda(), spec)
    assert graph.captures == 1 and graph.current.graph is not None
    assert_lean_logits(out, ref, dtype)
    assert_same_entries(cache, graph)


@cuda
@pytest.mark.parametrize("spec", ["h2o", None, "streaming_llm", "scissorhands"])
def test_the_step_never_waits_for_the_host(make_model, tiny_cfg, spec):
    """Eager on CUDA under torch's sync debug mode "error": no operation of the step synchronises (the kernel
    for every rule; H2O's probabilities and eviction beside it)."""
    model = make_model(tiny_cfg, seed=0).cuda()
    cache = KVCache(model.config, make_policy(spec, 12) if spec else None)
    with torch.no_grad():
        prefill(model, tokens().cuda()[:, :20], cache)
    graph = GraphDecoder(model)
    graph.start(cache, 4)
    token = tokens().cuda()[:, 20]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            graph.decode(token)
    finally:
        torch.cuda.set_sync_debug_mode("default")
