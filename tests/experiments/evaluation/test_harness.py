"""The evaluation's protocol (through the notebooks' API, ``harness.py``), its two engines, its records and the
compare CLI, on a tiny random-init checkpoint (no training needed)."""

import json
import types

import pytest
import torch

from experiments.evaluation.compare import RunSpec, run
from experiments.evaluation.compare import main as compare_main
from experiments.evaluation.harness import compare_traces, greedy_from_traces, trace, traces
from methods import METHODS, make_policy
from nanollm import CachePolicy, LayerKV, preset
from nanollm.data.evaluate import MODES, answer_ids
from nanollm.data.tasks import corpus, make_sample
from nanollm.generation import prefill
from nanollm.io import checkpoint
from nanollm.io.tokenizer import Tokenizer

LENGTH = 200


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, make_model):
    torch.set_num_threads(1)
    tok = Tokenizer.train(corpus(60_000, seed=0), 512)
    model = make_model(preset("TINY"), seed=1)
    folder = tmp_path_factory.mktemp("ckpt")
    checkpoint.save(model, tok, folder, card={"name": "tiny-random", "default_suite": ["niah_single_noise"]})
    return folder


@pytest.fixture(scope="module")
def loaded(ckpt):
    return checkpoint.load(ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_full_vs_full_is_zero(loaded, mode):
    model, tok, _ = loaded
    s = make_sample("niah_single_noise", tok, LENGTH, seed=0)
    a = trace(model, s, mode, None, record_probs=True)
    m = compare_traces(a, a, model.config.group_size)
    assert m["kl"] == 0 and m["perturbation"] == 0 and m["lost_mass"] == 0
    assert torch.tensor(m["attn_l1"]).abs().max() == 0
    assert m["kv_bytes"] == model.config.kv_bytes_per_token() * (s.n_tokens - 1)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_budget_covering_everything_matches_full(loaded, name):
    model, tok, _ = loaded
    s = make_sample("niah_single_noise", tok, LENGTH, seed=1)
    full = trace(model, s, "question_after_context", None, record_probs=True)
    tr = trace(model, s, "question_after_context", make_policy(name, budget=LENGTH))
    assert torch.equal(full.logits, tr.logits)
    m = compare_traces(full, tr, model.config.group_size)
    assert m["kl"] == 0 and m["perturbation"] == 0 and m["lost_mass"] == 0


def test_lost_mass_matches_a_mask(loaded):
    """lost_mass = full-attention probability on the positions StreamingLLM dropped, recomputed by hand."""
    model, tok, _ = loaded
    s = make_sample("niah_single_noise", tok, LENGTH, seed=2)
    full = trace(model, s, "question_in_prompt", None, record_probs=True)
    budget, n_sink = 24, 4
    tr = trace(model, s, "question_in_prompt", make_policy("streaming_llm", budget=budget, n_sink=n_sink))
    m = compare_traces(full, tr, model.config.group_size)
    seen = len(s.prompt_ids) + 1                              # the prompt + the first answer token
    kept = set(range(n_sink)) | set(range(seen - (budget - n_sink) - 1, seen))
    # after the prompt: sinks + last budget-n_sink prompt tokens; the first answer token is appended before
    # attention, so the first decode step sees budget + 1 entries
    lost = []
    for layer, probs in full.probs.items():
        pos = full.pos[layer][0].tolist()
        drop = torch.tensor([p not in kept for p in pos])
        lost += [float(probs[h][drop].sum()) for h in range(probs.shape[0])]
    assert m["lost_mass"] == pytest.approx(sum(lost) / len(lost), abs=1e-6)
    assert 0 < m["lost_mass"] < 1 and m["kv_bytes"] < full.kv_bytes


def test_trace_argmax_is_free_greedy_generation(loaded):
    """Why greedy_accuracy may reuse the trace: teacher forcing on the greedy tokens reproduces them exactly."""
    model, tok, _ = loaded
    for mode in MODES:
        s = make_sample("niah_single_noise", tok, LENGTH, seed=3)
        policy = lambda: make_policy("h2o", budget=40)   # noqa: E731
        greedy = answer_ids(model, s, mode, policy(), max_new_tokens=8)           # free-running, no stop
        s.target_ids = greedy
        tr = trace(model, s, mode, policy())
        assert torch.equal(tr.logits.argmax(-1), torch.tensor(greedy))


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_from_the_trace_equals_a_fresh_greedy_answer(loaded, method):
    """greedy_accuracy continues from the trace's copy of the cache where greedy leaves the reference: the
    answer must be token for token the one a fresh prefill + greedy generation gives."""
    model, tok, _ = loaded
    V = model.config.vocab_size
    for mode in MODES:
        s = make_sample("niah_single_noise", tok, LENGTH, seed=5)
        policy = lambda: make_policy(method, budget=40)   # noqa: E731
        fresh = answer_ids(model, s, mode, policy(), stop_id=tok.eot_id)
        free = answer_ids(model, s, mode, policy(), max_new_tokens=8)             # no stop
        leave = lambda m: free[:m] + [(free[m] + 1) % V] + free[m + 1:]            # noqa: E731
        for target, m in [(leave(3), 3), (leave(0), 0), (free, 7)]:              # leaves at 3, at 0, never
            s.target_ids = target
            tr = trace(model, s, mode, policy())
            assert tr.fork[0] == m
            assert greedy_from_traces(model, tok, s, [tr]) == [fresh], (mode, m)
            assert tr.fork is None and tr.prediction == tok.decode(fresh)    # the fork is used once


@pytest.mark.slow
def test_run_records_and_determinism(loaded, monkeypatch):
    """Two runs of the same command, one of them in worker processes: the same records, timings aside. The
    workers have left on the pool's last message when the pool's block ends, so its ``Pool.terminate`` signals
    none (a SIGTERM that reached a worker's other thread left it waiting for the queue's lock: the run hung)."""
    import multiprocessing.pool
    exit_codes, leave = [], multiprocessing.pool.Pool.__exit__
    monkeypatch.setattr(multiprocessing.pool.Pool, "__exit__",
                        lambda pool, *exc: exit_codes.append([p.exitcode for p in pool._pool]) or leave(pool, *exc))
    model, tok, _ = loaded
    kw = dict(methods=["full", "snapkv", "streaming_llm"], budgets=[20, 60], tasks=["niah_single_noise"],
              modes=MODES, samples=2, length=LENGTH, progress=False)
    a, b = run(model, tok, RunSpec(**kw)), run(model, tok, RunSpec(workers=2, **kw))       # b: two worker processes
    assert exit_codes == [[0, 0]], exit_codes
    assert len(a) == 2 * (1 + 2 * 2)
    fields = {"method", "budget", "keep_ratio", "task", "mode", "accuracy", "kl", "perturbation", "kv_bytes",
              "decode_ms_per_token", "n_samples"}
    for r in a:
        assert fields <= set(r) and 0 <= r["accuracy"] <= 1 and r["n_samples"] == 2
    timing = {"decode_ms_per_token", "compress_ms"}
    assert [{k: v for k, v in r.items() if k not in timing} for r in a] == \
        [{k: v for k, v in r.items() if k not in timing} for r in b]
    full = [r for r in a if r["method"] == "full"]
    assert all(r["keep_ratio"] == 1.0 and r["kl"] == 0 for r in full)


@pytest.mark.slow
def test_cli_json_plot_and_errors(ckpt, tmp_path, capsys):
    out = tmp_path / "r.json"
    compare_main(["--checkpoint", str(ckpt), "--methods", "full", "streaming_llm", "adakv(h2o)", "--keep-ratios",
                  "0.2", "--samples", "1", "--length", str(LENGTH), "--json", str(out), "--plot",
                  str(tmp_path / "p.png"), "--quiet"])
    saved = json.loads(out.read_text())
    records = saved["records"]
    assert {r["method"] for r in records} == {"full", "streaming_llm", "adakv(h2o)"}   # named as written
    assert saved["provenance"]["command"].startswith("python -m experiments.compare --checkpoint")
    assert saved["provenance"]["threads"] == 1 and saved["provenance"]["seed"] == 0
    assert saved["preset"] == "ours" and all(r["preset"] == "ours" for r in records)
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "niah_single_noise" in {r["task"] for r in records}          # the card's default suite
    for bad, msg in [(["--methods", "nope"], "unknown method"), (["--methods", "snapkv(h2o)"], "not a wrapper"),
                     (["--budgets", "0"], "budgets must be positive"), (["--tasks", "nope"], "unknown task"),
                     (["--length", "100000"], "--length must be")]:
        with pytest.raises(SystemExit):
            compare_main(["--checkpoint", str(ckpt), *bad, "--quiet"])
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        compare_main(["--checkpoint", str(tmp_path / "missing"), "--quiet"])
    assert stop.value.code == 2 and "no checkpoint" in capsys.readouterr().err


def test_a_gpu_run_takes_the_one_group_engine_and_a_worker_per_cpu():
    """Where the command names neither: on a CPU the fast engine, on a GPU one group (but the fast engine with
    --time-alone, which the batched ones refuse); a worker per CPU on either, on a GPU no more than fit in its
    memory; one per rank under torchrun; what the command names is kept."""
    from experiments.evaluation.workers import default_workers, engine_and_workers
    cpus = default_workers()
    assert engine_and_workers(None, None, "cpu", 1, False) == ("fast", cpus)
    assert engine_and_workers(None, None, "cuda", 1, False) == ("one-group", cpus)
    assert engine_and_workers(None, None, "cuda:1", 1, True) == ("fast", cpus)
    assert engine_and_workers(None, None, "cuda", 4, False) == ("one-group", 1)
    assert engine_and_workers("plain", 3, "cuda", 1, False) == ("plain", 3)
    assert engine_and_workers("batched", None, "cuda", 1, False, that_fit=1) == ("batched", 1)   # a large model
    assert engine_and_workers(None, None, "cuda", 1, False, that_fit=10**6) == ("one-group", cpus)


def test_several_processes_on_a_gpu_without_mps_are_told_of_it(monkeypatch, tmp_path):
    """A line where several workers share a GPU and MPS's control daemon is not running (its pipe absent);
    none where it runs, for one worker, or on a CPU."""
    from experiments.evaluation.workers import without_mps
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    note = without_mps("cuda", 12)
    assert note and "12 worker processes" in note and "nvidia-cuda-mps-control -d" in note
    assert without_mps("cuda:0", 1) is None and without_mps("cpu", 12) is None
    (tmp_path / "control").touch()                          # the daemon's control pipe
    assert without_mps("cuda", 12) is None


def test_workers_that_a_gpu_holds(make_model, monkeypatch):
    """The GPU's memory, less a tenth, over what one worker holds: its weights, four times its caches' K/V and
    CUDA's own; at least one (the device's memory stubbed: no GPU needed). SmolLM2's shape on an H200's
    143,771 MiB gives the 12 workers that ran its main job there (fastpath/README.md)."""
    from types import SimpleNamespace

    from experiments.evaluation import workers
    model = make_model(preset("TINY"), seed=0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = model.config.kv_bytes_per_token(4) * 100                    # one cache of 100 tokens, fp32
    worker = weights + 4 * 3 * kv + 2**30
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=int(5 * worker / 0.9) + 1))
    assert workers.workers_that_fit(model, "cuda", 3, 100) == 5
    assert workers.workers_that_fit(model, "cuda", 3, 10**7) == 1                # caches beyond the GPU: one
    smollm2 = SimpleNamespace(config=SimpleNamespace(kv_bytes_per_token=lambda b: 2 * 30 * 3 * 64 * b),
                              parameters=lambda: iter([torch.empty(134_515_008, device="meta")]))   # 135M, fp32
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=143771 << 20))
    assert workers.workers_that_fit(smollm2, "cuda", 25, 2048) == 12
    variants = [workers.Variant(m, m) for m in ["full", "streaming_llm", "h2o", "snapkv", "adakv(h2o)"]]
    assert workers.caches_per_worker(variants, [10, 20, 40]) == 1 + 4 * 3      # the full cache once
    assert workers.caches_per_worker(variants, [10, 20, 40], together=2) == 2 * 13


def test_cli_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        compare_main(["--help"])
    text = capsys.readouterr().out
    for flag in ["--methods", "--budgets", "--keep-ratios", "--tasks", "--modes", "--samples", "--length",
                 "--seed", "--device", "--json", "--plot", "--checkpoint", "--threads", "--preset", "--engine"]:
        assert flag in text


def test_h2o_scores_are_reported_as_extra_bytes(loaded):
    model, tok, _ = loaded
    s = make_sample("niah_single_noise", tok, LENGTH, seed=4)
    tr = trace(model, s, "question_in_prompt", make_policy("h2o", budget=30))
    per_entry = 4 * model.config.n_layer * model.config.n_kv_head            # one fp32 score per entry
    assert tr.extra_bytes == 30 * per_entry
    assert trace(model, s, "question_in_prompt", make_policy("snapkv", budget=30)).extra_bytes == 0


class RebuildFirstToken(CachePolicy):
    """Evicts position 0 at prefill and attends to an exact copy of it rebuilt in ``attend_kv``."""

    def __init__(self):
        self.aside = {}

    def attend_kv(self, layer, store):
        if layer not in self.aside:
            return store
        k0, v0 = self.aside[layer]
        pos0 = torch.zeros_like(store.pos[..., :1])
        return LayerKV(torch.cat([k0, store.k], 2), torch.cat([v0, store.v], 2), torch.cat([pos0, store.pos], 2))

    def on_prefill(self, ctx):
        self.aside[ctx.layer] = (ctx.kv.k[:, :, :1].clone(), ctx.kv.v[:, :, :1].clone())
        B, H_kv, T = ctx.kv.pos.shape
        ctx.kv.keep(torch.arange(1, T).expand(B, H_kv, T - 1))

    def reset(self):
        self.aside = {}


def test_lost_mass_counts_rebuilt_entries_as_lost(loaded):
    """A rebuilt entry is not attended *exactly*: lost mass is the full attention on position 0, even
    though here the rebuilt copy is exact and the outputs match the full cache."""
    model, tok, _ = loaded
    s = make_sample("niah_single_noise", tok, LENGTH, seed=5)
    full = trace(model, s, "question_in_prompt", None, record_probs=True)
    tr = trace(model, s, "question_in_prompt", RebuildFirstToken())
    m = compare_traces(full, tr, model.config.group_size)
    on_first = sum(float(p[:, 0].sum()) for p in full.probs.values()) / sum(p.shape[0] for p in full.probs.values())
    assert m["kl"] < 1e-8 and m["perturbation"] < 1e-5
    assert m["lost_mass"] == pytest.approx(on_first, rel=1e-5) and on_first > 0


def test_run_records_variants_under_their_labels(loaded):
    from experiments.evaluation.compare import Variant
    model, tok, _ = loaded
    records = run(model, tok, RunSpec(["snapkv", Variant("snapkv w4", "snapkv", {"window": 4})], [40],
                  ["niah_single_noise"], ["question_in_prompt"], 1, LENGTH, progress=False))
    by = {r["method"]: r for r in records}
    assert set(by) == {"full", "snapkv", "snapkv w4"}
    assert by["snapkv"]["kv_bytes"] == by["snapkv w4"]["kv_bytes"]        # same budget, another window
    tr = trace(model, make_sample("niah_single_noise", tok, LENGTH, seed=0), "question_in_prompt",
               make_policy("snapkv", budget=40, window=4))
    assert by["snapkv w4"]["kl"] == pytest.approx(
        compare_traces(trace(model, make_sample("niah_single_noise", tok, LENGTH, seed=0), "question_in_prompt",
                             None, record_probs=True), tr, model.config.group_size)["kl"])


class RebuildAlways(CachePolicy):
    """Attends to a rebuilt copy of the storage at every step, the prompt included: the one prompt pass of
    ``traces`` cannot serve it (it hands every policy the storage itself), so ``traces`` falls back."""

    def attend_kv(self, layer, store):
        return LayerKV(store.k, store.v, store.pos)


def same_trace(a, b) -> None:
    assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
    for x, y in ((a.outs, b.outs), (a.pos, b.pos), (a.probs, b.probs), (a.attended, b.attended)):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert (a.kv_bytes, a.extra_bytes, a.fork[0]) == (b.kv_bytes, b.extra_bytes, b.fork[0])
    assert a.fork[1].seen == b.fork[1].seen
    for la, lb in zip(a.fork[1].layers, b.fork[1].layers):            # the caches greedy decoding continues
        assert torch.equal(la.k, lb.k) and torch.equal(la.v, lb.v) and torch.equal(la.pos, lb.pos)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_one_prompt_pass_gives_the_same_traces(loaded, mode, monkeypatch):
    """The fast engine's ``traces`` (one prompt pass for every policy, ``side_by_side.FanOut``, then the
    answers side by side, ``step_many``) equals separate ``trace`` calls bit for bit: the full cache and every
    registered method at two budgets; with a policy the shared pass cannot serve, it falls back to one pass
    per policy, with the same result. The greedy continuations side by side are each the one alone."""
    import experiments.evaluation.side_by_side as side_by_side
    model, tok, _ = loaded
    s = make_sample("niah_single_noise", tok, LENGTH, seed=6)
    passes = []
    import experiments.evaluation.engine as engine
    for module in (side_by_side, engine):                             # the shared pass, and the fallback's
        monkeypatch.setattr(module, "prefill", lambda *a: passes.append(1) or prefill(*a))

    def policies(extra=()):
        return [None] + [make_policy(n, budget=b) for n in sorted(METHODS) if n != "full" for b in (30, 120)] + \
            list(extra)

    flags = [True] + [False] * (len(policies()) - 1)
    shared = traces(model, s, mode, policies(), flags)
    assert len(passes) == 1                                           # one prompt pass served them all
    alone = [trace(model, s, mode, p, f) for p, f in zip(policies(), flags)]
    for a, b in zip(shared, alone):
        same_trace(a, b)
    passes.clear()
    with_fallback = traces(model, s, mode, policies([RebuildAlways()]), flags + [False])
    assert len(passes) == 1 + len(flags) + 1                          # the shared pass gave up: one each
    for a, b in zip(with_fallback, shared):
        same_trace(a, b)
    same_trace(with_fallback[-1], trace(model, s, mode, RebuildAlways()))
    forks = [tr.fork[0] for tr in shared]
    answers = greedy_from_traces(model, tok, s, shared)
    assert answers == [greedy_from_traces(model, tok, s, [b])[0] for b in alone]
    assert sum(len(a) > m + 1 for a, m in zip(answers, forks)) > 5   # generated past the fork
    assert greedy_from_traces(model, tok, s, shared) == answers       # kept: asked again, the same


def test_the_plain_and_fast_engines_trace_alike(loaded):
    """The two engines of every trace: the same storage, the same fork, logits and hidden state to float
    rounding (the plain one runs the model's own forward per cache, the fast one lean products in blocks)."""
    model, tok, _ = loaded
    s = make_sample("niah_single_noise", tok, LENGTH, seed=7)
    policies = lambda: [None, make_policy("h2o", budget=40), make_policy("snapkv", budget=40)]   # noqa: E731
    fast = traces(model, s, MODES[1], policies(), [True, False, False])
    plain = traces(model, s, MODES[1], policies(), [True, False, False], engine="plain")
    for a, b in zip(fast, plain):
        assert torch.allclose(a.logits, b.logits, atol=1e-4) and torch.allclose(a.hidden, b.hidden, atol=1e-5)
        assert (a.kv_bytes, a.extra_bytes, a.fork[0]) == (b.kv_bytes, b.extra_bytes, b.fork[0])
        assert all(torch.equal(a.pos[k], b.pos[k]) for k in a.pos)
    assert greedy_from_traces(model, tok, s, fast) == greedy_from_traces(model, tok, s, plain)
    assert type(fast[0].engine).__name__ == "FastEngine" and type(plain[0].engine).__name__ == "PlainEngine"


def test_a_worker_out_of_gpu_memory_is_one_line_that_names_the_workers(monkeypatch, capsys):
    """A worker whose GPU memory runs out (SmolLM2's main job, one group in 16 processes on an H200) raises
    one ``error:`` line through ``cli.errors`` that says what to change, not its traceback."""
    from experiments.evaluation import workers
    from nanollm import cli

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 42.00 MiB.")
    monkeypatch.setattr(workers, "run_jobs", out_of_memory)
    monkeypatch.setattr(workers, "engine_for", lambda *args, **kwargs: None)
    monkeypatch.setitem(workers._WORKER, "shared", (None, None, [], [], 192, 0, ("batched", False)))
    monkeypatch.setitem(workers._WORKER, "workers", 16)
    with pytest.raises(SystemExit) as stop, cli.errors():
        workers._run_jobs_in_worker([("niah_single_noise", 0, "question_in_prompt")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert "ran out of memory with 16 worker processes" in err and "fewer --workers" in err, err
    assert "a shorter --length" in workers.out_of_memory(1)                 # one process: what fits is the work
    assert "--engine batched" in workers.out_of_memory(1) and "--engine batched" in workers.out_of_memory(16)
    assert "--engine batched" not in workers.out_of_memory(16, engine="batched")   # not to one running it


def test_a_batch_out_of_gpu_memory_runs_once_more_after_the_memory_goes_back(monkeypatch):
    """On a GPU that workers share, a batch whose memory runs out is run again from its start, after the
    process gives back what it held (its engine's last groups, the allocator's free blocks), and again after
    every batch; a batch that runs out twice stops the command (the test above)."""
    from experiments.evaluation import workers
    tries, given_back = [], []

    def run_jobs(*args):
        tries.append(args[-1])
        if len(tries) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 42.00 MiB.")
        return ["the batch's results"]
    engine = types.SimpleNamespace(groups=["a group"])
    engine.release = lambda: setattr(engine, "groups", [])
    monkeypatch.setattr(workers, "run_jobs", run_jobs)
    monkeypatch.setattr(workers, "engine_for", lambda *args, **kwargs: engine)
    monkeypatch.setitem(workers._ENGINE, "engine", engine)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: given_back.append(list(engine.groups)))
    jobs = [("niah_single_noise", 0, "question_in_prompt")]
    assert workers.some_jobs(None, None, [], [], 192, 0, ("batched", False), jobs) == ["the batch's results"]
    assert tries == [jobs, jobs] and given_back == [[], []]      # after the failed try, and after the batch


def test_one_process_out_of_gpu_memory_is_one_line_too(monkeypatch, capsys):
    """Without workers the same: the run stops with one ``error:`` line that names what to shrink."""
    from experiments.evaluation import compare, workers
    from nanollm import cli, load

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 42.00 MiB.")
    monkeypatch.setattr(workers, "run_jobs", out_of_memory)
    model, tok, _ = load("retrieval-llama")
    with pytest.raises(SystemExit) as stop, cli.errors():
        compare.run(model, tok, compare.RunSpec(["full"], [48], ["niah_single_noise"], ["question_in_prompt"], 1, 192,
                    progress=False))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "a shorter --length" in err, err


def test_a_task_file_s_sample_runs_through_the_harness_with_its_task(loaded, tmp_path):
    """A task file's sample is scored by the file's rules when its task is given, and refused in one line
    naming the fix when it is not; ``compare_traces`` says when the full cache's trace lacks probabilities."""
    from experiments.evaluation.harness import greedy_accuracies
    from experiments.evaluation.task_file import FileTask
    model, tok, _ = loaded
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"context": "The capital of France is Paris. " * 3, "question": " Capital?",
                                "answers": ["Paris"], "scorer": "exact_match", "answer_tokens": 3}) + "\n")
    task = FileTask(path)
    sample = task.sample(tok, LENGTH, 0)
    with pytest.raises(ValueError, match="pass its task, task=FileTask"):
        traces(model, sample, "question_in_prompt", [None], [False])
    trs = traces(model, sample, "question_in_prompt", [None, make_policy("h2o", 16)], [False, False], task=task)
    scored = greedy_accuracies(model, tok, sample, trs, task=task)
    assert [s for s, _ in scored] == [float(p.strip() == "Paris") for _, p in scored]     # exact_match, the file's
    assert all(len(tr.prediction_ids) <= 3 for tr in trs)                                  # answer_tokens, the file's
    with pytest.raises(ValueError, match="record_probs True"):
        compare_traces(trs[0], trs[1])
