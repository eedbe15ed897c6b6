"""
Shared pytest fixtures: a tiny random-init decoder in both flavours, in fp32, on CPU; and the real model,
SmolLM2-135M-Instruct, when it has been fetched (``python -m nanollm.cli.fetch smollm2-135m``, part of the
README's set-up): its tests are skipped, saying so, where it has not.

Two tiers, the pytest documentation's way. Bare ``python -m pytest`` runs the fast tier (in a process per
core: ``pytest_cmdline_main`` below): no subprocess, no notebook execution, no benchmark, one option set per
method in the contract matrix. ``--runslow`` adds
the slow tier (``@pytest.mark.slow``: commands in subprocesses, notebooks, the linter, the real model, the
whole contract matrix). Timing benchmarks (``@pytest.mark.bench``) run
only with ``--runbench``, and the heavy end-to-end checks (``@pytest.mark.heavy``: re-running the committed
real-model results, every assignment's shipped-function mutants and student notebook; the slow tier keeps
one or two of each) only with ``--runheavy``, to keep the slow tier well within CI's half hour on two cores
(CI runs it in two processes, ``-n 2 --dist loadfile``); run them before committing a results file or a course
change.
A fast-tier test that starts a subprocess fails, saying it belongs to the slow one.

No checkpoint is downloaded: equivalence tests (cached vs uncached, policy path vs plain path) only need
*some* fixed weights, so a seeded random init is enough.

The weights are redrawn with a larger standard deviation (``INIT_STD``) than GPT-2's 0.02: at 0.02 the
tiny model's logits and attention are almost uniform, so greedy decoding repeats one token and a masking
bug would hardly change the output. At 0.1 attention is peaked and greedy tokens vary, while fp32
cached-vs-uncached differences stay around 3e-6 (well under the 1e-5 tolerance).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import signal
import subprocess
import sys

import pytest
import torch

# A shell without job control (a script, ``bash -c "... &"``) starts a background command with SIGINT ignored,
# and processes inherit an ignored signal: the commands the Ctrl-C tests start would then never hear it. A
# handler, unlike an ignored signal, is reset to the default when a child starts, so restore Python's own.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Triton kernels (kernels/) are checked in Triton's CPU interpreter where there is no GPU. The variable is
# read when a kernel is defined, so it is set here, before any test module imports a kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanollm import ModelConfig, Transformer, preset
from nanollm.cli import provenance

INIT_STD = 0.1   # std of every weight matrix; norms keep their init (ones / zeros)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"    # Triton's kernels run in its CPU interpreter: slowly


def one_fast(*cases):
    """Parametrize cases of a test that runs Triton's kernels: where they run in the interpreter, the first case
    stays in the fast tier and the others go to the slow tier (which CI runs), so an edit-and-test loop stays
    short and nothing stops being tested; on a GPU every case is fast. A case is a value, or a tuple for several
    parameters."""
    slow = [pytest.mark.slow] if INTERPRETED else []
    return [pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=slow if i else [])
            for i, case in enumerate(cases)]


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true",
                     help="also run the slow tier: subprocesses, notebooks, the linter, the whole contract matrix")
    parser.addoption("--runbench", action="store_true", help="also run the timing benchmarks (marker bench)")
    parser.addoption("--runheavy", action="store_true",
                     help="also run the heavy end-to-end checks (marker heavy): re-running the committed real-model "
                          "results, every assignment's shipped-function mutants and student notebook")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite or a folder runs on every core, at most four processes (pytest-xdist, where installed);
    a file or a test runs in this process, which starts soonest, and so do ``--pdb`` and ``-s`` (whose prints
    a worker would keep). ``-n N`` chooses."""
    from experiments.evaluation.workers import default_workers  # the cores this process may use
    if (config.pluginmanager.hasplugin("xdist") and config.option.numprocesses is None
            and not hasattr(config, "workerinput") and not config.option.usepdb and not config.option.collectonly
            and config.option.capture != "no"
            and not all(os.path.isfile(arg.split("::")[0]) for arg in config.args) and default_workers() > 1):
        config.option.numprocesses = min(4, default_workers())


def pytest_report_header(config):
    """Where the kernel tests run in Triton's interpreter and it cannot run them here, say why at the top."""
    import kernels
    if kernels.interpreting() and (problem := kernels.interpreter_problem()):
        return f"the kernel tests with loops will fail: {problem}"
    return None


def pytest_collection_modifyitems(config, items):
    skips = {"slow": (config.getoption("--runslow"), pytest.mark.skip(reason="slow tier: run with --runslow")),
             "bench": (config.getoption("--runbench"), pytest.mark.skip(reason="benchmark: run with --runbench")),
             "heavy": (config.getoption("--runheavy"), pytest.mark.skip(reason="heavy check: run with --runheavy"))}
    for item in items:
        for marker, (wanted, skip) in skips.items():
            # the marker itself, not a keyword: a keyword is also the name of a folder above the test, so a
            # checkout in a folder named slow would make every test slow
            if item.get_closest_marker(marker) is not None and not wanted:
                item.add_marker(skip)


# The compilers a kernel test runs on a GPU start processes of their own (Triton's first compile asks
# `ldconfig -p` where libcuda is and runs the C compiler; torch.compile's inductor runs it too): those are the
# compilers' business, not the test's, so the guard below lets a process start when a frame of one of these
# packages asks for it.
def where(module: str) -> str | None:
    """The folder of a package (with a trailing separator), or a module's file; None if it is not installed."""
    spec = importlib.util.find_spec(module) if importlib.util.find_spec(module.split(".")[0]) else None
    if spec is None or spec.origin is None:
        return None
    return os.path.dirname(spec.origin) + os.sep if spec.submodule_search_locations else spec.origin


COMPILERS = tuple(p for p in map(where, ("triton", "torch._inductor", "torch.utils.cpp_extension")) if p)


def started_by_a_compiler() -> bool:
    """Whether a frame of Triton's or torch's compilers is on the stack of the process starting now."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(COMPILERS):
            return True
        frame = frame.f_back
    return False


@pytest.fixture(autouse=True)
def no_subprocess_in_the_fast_tier(request, monkeypatch):
    """The fast tier starts no process: a test that does is marked slow (the compilers' own are theirs)."""
    if request.node.get_closest_marker("slow") is not None:
        return
    popen_init = subprocess.Popen.__init__

    def refuse(self, *args, **kwargs):
        if started_by_a_compiler():
            return popen_init(self, *args, **kwargs)
        raise AssertionError(f"{request.node.nodeid} starts a subprocess: mark it @pytest.mark.slow")
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(provenance, "tree_changed", lambda root=None: None)   # a results file's `git status`


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models are dispatch-bound: one intra-op thread is faster, and two threads on a shared 2-core box
    can stall every op on an OpenMP barrier."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_model(config: ModelConfig, seed: int = 0, std: float = INIT_STD) -> Transformer:
    """A seeded random-init ``Transformer`` in fp32 and eval mode, weight matrices drawn from N(0, std²)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:                      # linear and embedding matrices (tied lm_head included)
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.float().eval()


@pytest.fixture(scope="session", name="make_model")
def make_model_fixture():
    """The ``make_model(config, seed=0, std=INIT_STD)`` factory, for tests that need another config."""
    return make_model


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Tests run on CPU: fp32 equivalence tests must be exact and reproducible on any machine."""
    return torch.device("cpu")


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    """The TINY preset: Llama flavour with GQA (4 query heads sharing 2 KV heads), 2 layers, d_model 64."""
    cfg = preset("TINY")
    assert cfg.flavour == "llama" and cfg.n_head == 4 and cfg.n_kv_head == 2
    return cfg


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg: ModelConfig, device: torch.device) -> Transformer:
    """Seeded random-init TINY Llama model, fp32, eval mode. Shared by the session: do not modify it."""
    return make_model(tiny_cfg, seed=0).to(device)


@pytest.fixture(scope="session")
def tiny_gpt2_model(device: torch.device) -> Transformer:
    """Seeded random-init TINY_GPT2 model (learned positions, LayerNorm, GELU, MHA), fp32, eval mode."""
    return make_model(preset("TINY_GPT2"), seed=0).to(device)


@pytest.fixture(scope="module")
def bundled():
    """(model, tokenizer, card) of the bundled retrieval-llama checkpoint, loaded once a test module."""
    from nanollm.io.checkpoint import load
    return load("retrieval-llama")


@functools.cache
def smollm2_missing() -> str | None:
    """Why SmolLM2-135M-Instruct cannot be loaded here (its GGUF file is not fetched), or None where it can.
    Asked once a session: ``is_fetched`` reads the whole file for its SHA-256."""
    from nanollm.io import fetch
    if fetch.is_fetched("smollm2-135m"):
        return None
    return (f"smollm2-135m is not fetched ({fetch.target('smollm2-135m')}): run "
            "`python -m nanollm.cli.fetch smollm2-135m` (the README's set-up does)")


@pytest.fixture(scope="session")
def smollm2_file():
    """The path of SmolLM2-135M-Instruct's GGUF file in the cache; the test is skipped if it is not fetched."""
    from nanollm.io import fetch
    if why := smollm2_missing():
        pytest.skip(why)
    return fetch.target("smollm2-135m")                     # is_fetched checked its size and SHA-256


@pytest.fixture(scope="session")
def smollm2(smollm2_file):
    """(model, tokenizer) of SmolLM2-135M-Instruct, fp32, eval mode. Shared by the session: do not modify it."""
    from nanollm.io.checkpoint import load
    model, tok, _ = load(smollm2_file)
    return model, tok
