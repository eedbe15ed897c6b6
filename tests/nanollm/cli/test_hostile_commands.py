"""
The commands that write files, used against themselves: an output named after an input, Ctrl-C or
``kill`` in the middle of a run, and sizes the machine cannot give.

* An output path (``--json``, ``--plot``, ``--out``) that is one of the command's inputs (the checkpoint's
  file, anything in its folder, however spelled: ``..``, a symbolic or a hard link), or lies in the bundled
  checkpoints, is refused before any work, in one line; the input is left as it was.
* Ctrl-C or SIGTERM during a run ends in ``error: interrupted``, exit status 130: no traceback, neither the
  command's nor its worker processes', and no process left behind.
* ``--threads`` and ``--workers`` beyond the machine's cores, a ``--kbytes`` beyond the bench's maximum and
  a file name longer than the file system takes are refused before any work, in one line.
* A results file that appears while ``experiments.compare`` runs is replaced whole, as a named file is.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from nanollm.io import fetch
from nanollm.io.files import atomic_write_text
from tests.commands import refused
from tests.nanollm.cli.test_cli import BUNDLED, ROOT, snapshot
from tests.nanollm.io.test_gguf import llama_gguf, tokenizer_metadata

CORES = os.cpu_count() or 1


def command(module: str):
    """The ``main`` of ``python -m module``, and the module (to replace its work by a failure)."""
    mod = importlib.import_module(module)
    return mod.main, mod


def no_work(monkeypatch, mod, *names: str) -> None:
    """Make ``mod``'s work functions (and torch's thread count) fail the test: a refusal comes before them."""
    for name in names:
        monkeypatch.setattr(mod, name, lambda *a, name=name, **kw: pytest.fail(f"{mod.__name__}.{name} ran first"))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: pytest.fail(f"torch.set_num_threads({n}) ran"))


@pytest.fixture
def ck(tmp_path) -> Path:
    """A copy of the bundled checkpoint, a folder a command reads."""
    return Path(shutil.copytree(BUNDLED, tmp_path / "ck"))


# ----------------------------------------------------------------------------------------------------------
# 1. No output path may be an input

# (module, argv with {ck} for the checkpoint folder, the work that must not run)
WRITERS = [
    ("experiments.evaluation.compare", ["--checkpoint", "{ck}", "--json", "{ck}/model.safetensors"], "run_main"),
    ("experiments.evaluation.compare", ["--checkpoint", "{ck}", "--plot", "{ck}/figure.png"], "run_main"),
    ("experiments.evaluation.language_modelling", ["--checkpoint", "{ck}", "--json", "{ck}/model.safetensors"], "load"),
    ("experiments.evaluation.language_modelling", ["--checkpoint", "{ck}", "--plot", "{ck}/ppl.svg"], "load"),
    ("experiments.evaluation.throughput", ["--checkpoint", "{ck}", "--length", "256", "--json", "{ck}/card.json"],
     "load"),
    ("experiments.evaluation.bench", ["--checkpoint", "{ck}", "--contexts", "64", "--prompt-queries", "8",
                                  "--json", "{ck}/tokenizer.json"], "run_bench"),
    ("experiments.evaluation.bench", ["--checkpoint", "{ck}", "--contexts", "64", "--prompt-queries", "8",
                                  "--plot", "{ck}/bench.png"], "run_bench"),
    ("experiments.speed", ["--checkpoint", "{ck}", "--contexts", "64", "--json", "{ck}/model.safetensors"],
     "run_speed"),
    ("experiments.bench", ["--vs-transformers", "{ck}", "--json", "{ck}/nanollm_config.json"], "run_bench"),
    ("nanollm.cli.hf", ["{ck}", "{ck}/hf"], "load"),
    ("experiments.analysis.kvreviver_ablation", ["--checkpoint", "{ck}", "--out", "{ck}/tokenizer.json"],
     "load_config"),
    ("experiments.analysis.kvreviver_ablation", ["--checkpoint", "{ck}", "--json", "{ck}/report.json"], "load_config"),
]


@pytest.mark.parametrize("module, argv, work", WRITERS, ids=[f"{m}:{a[-2]}" for m, a, _ in WRITERS])
def test_an_output_in_the_checkpoint_folder_is_refused_before_any_work(monkeypatch, capsys, ck, module, argv, work):
    main, mod = command(module)
    no_work(monkeypatch, mod, work)
    before = snapshot(ck)
    err = refused(capsys, main, [a.format(ck=ck) for a in argv])
    assert str(ck) in err and "reads" in err, err
    assert snapshot(ck) == before


def test_a_gguf_named_as_the_output_is_refused(monkeypatch, capsys, tmp_path, tiny_model):
    """``--checkpoint X.gguf --json X.gguf`` would replace the model by its own results."""
    from experiments.evaluation import language_modelling
    metadata, _ = tokenizer_metadata()
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(llama_gguf(tiny_model, metadata))
    before = gguf.read_bytes()
    no_work(monkeypatch, language_modelling, "load")
    err = refused(capsys, language_modelling.main, ["--checkpoint", str(gguf), "--length", "8", "--json", str(gguf)])
    assert "--json" in err and "x.gguf" in err
    assert gguf.read_bytes() == before


def spellings(ck: Path, tmp_path: Path) -> list[str]:
    """Other names of the weights of ``ck``: through ``..``, a symbolic link, a hard link, a linked folder."""
    weights = ck / "model.safetensors"
    (tmp_path / "link.json").symlink_to(weights)
    os.link(weights, tmp_path / "hard.json")
    (tmp_path / "into").symlink_to(ck, target_is_directory=True)
    return [f"{ck}/../ck/model.safetensors", str(tmp_path / "link.json"), str(tmp_path / "hard.json"),
            str(tmp_path / "into" / "results.json")]


def test_an_input_under_another_name_is_refused(monkeypatch, capsys, ck, tmp_path):
    from experiments.evaluation import compare
    no_work(monkeypatch, compare, "run_main")
    before = snapshot(ck)
    for out in spellings(ck, tmp_path):
        err = refused(capsys, compare.main, ["--checkpoint", str(ck), "--json", out])
        assert "--json" in err, err
    linked = tmp_path / "linked-ck"                                     # the checkpoint named through a link
    linked.symlink_to(ck, target_is_directory=True)
    refused(capsys, compare.main, ["--checkpoint", str(linked), "--json", str(ck / "results.json")])
    assert snapshot(ck) == before


@pytest.mark.parametrize("module, argv, work", [
    ("experiments.evaluation.compare", ["--checkpoint", "retrieval-llama", "--json", "{b}/model.safetensors"],
     "run_main"),
    ("experiments.evaluation.compare", ["--checkpoint", "{ck}", "--json", "{b}/results.json"], "run_main"),
    ("fastpath.bench", ["--quick", "--json", "{b}/model.safetensors"], "copy_bandwidth"),
    ("experiments.bench", ["--json", "{b}/bench.json"], "run_bench"),
    ("nanollm.cli.hf", ["{ck}", "{b}/hf-export"], "load"),
])
def test_nothing_is_written_into_the_bundled_checkpoints(monkeypatch, capsys, ck, module, argv, work):
    main, mod = command(module)
    no_work(monkeypatch, mod, work)
    before = snapshot(BUNDLED.parent)
    err = refused(capsys, main, [a.format(ck=ck, b=BUNDLED) for a in argv])
    assert "bundled" in err or "reads" in err, err
    assert snapshot(BUNDLED.parent) == before


def test_peer_kvpress_refuses_the_fetched_model_as_its_report(monkeypatch, capsys):
    from experiments.evaluation import peer_kvpress
    if not fetch.is_fetched(peer_kvpress.CHECKPOINT):
        pytest.skip(f"{peer_kvpress.CHECKPOINT} is not fetched")
    no_work(monkeypatch, peer_kvpress, "import_kvpress")
    weights = fetch.target(peer_kvpress.CHECKPOINT)
    size = weights.stat().st_size
    err = refused(capsys, peer_kvpress.main, ["--out", str(weights), "--samples", "1"])
    assert "--out" in err and "reads" in err
    assert weights.stat().st_size == size


def test_an_output_elsewhere_is_still_accepted(ck, tmp_path):
    from nanollm import cli
    cli.not_an_input(tmp_path / "results.json", [ck, "retrieval-llama", "smollm2-135m", None], "--json")
    cli.not_an_input(tmp_path / "ck-export", [ck], "out")


# ----------------------------------------------------------------------------------------------------------
# 3. Flags beyond what the machine has

# (module, argv, the work that must not run)
THREADS = [
    ("experiments.evaluation.compare", ["--threads", "999"], "run_main"),
    ("experiments.evaluation.compare", ["--workers", "999"], "run_main"),
    ("experiments.evaluation.bench", ["--threads", "999"], "run_bench"),
    ("experiments.evaluation.throughput", ["--checkpoint", "retrieval-llama", "--length", "256", "--threads", "999"],
     "load"),
    ("experiments.evaluation.peer_kvpress", ["--out", "{tmp}/report.txt", "--threads", "999"], "import_kvpress"),
    ("experiments.bench", ["--threads", "999999"], "run_bench"),
    ("experiments.speed", ["--checkpoint", "retrieval-llama", "--contexts", "64", "--threads", "999"], "run_speed"),
    ("experiments.analysis.kvreviver_ablation", ["--checkpoint", "retrieval-llama", "--threads", "999"], "load_config"),
]


@pytest.mark.parametrize("module, argv, work", THREADS, ids=[f"{m}:{a[-2]}" for m, a, _ in THREADS])
def test_threads_or_workers_beyond_the_cores_are_refused(monkeypatch, capsys, tmp_path, module, argv, work):
    main, mod = command(module)
    no_work(monkeypatch, mod, work)
    err = refused(capsys, main, [a.format(tmp=tmp_path) for a in argv])
    assert argv[-2] in err and f"at most {CORES}" in err, err


def test_as_many_threads_as_cores_are_accepted():
    from experiments.evaluation import compare
    args = compare.parser().parse_args(["--threads", str(CORES), "--workers", str(CORES)])
    assert args.threads == args.workers == CORES


def test_the_tokenizer_bench_refuses_a_text_larger_than_its_maximum(monkeypatch, capsys):
    from nanollm.cli import tokenizer
    no_work(monkeypatch, tokenizer, "corpus", "bench")
    err = refused(capsys, tokenizer.main, ["bench", "--kbytes", "100000000"])
    assert "--kbytes" in err and f"at most {tokenizer.MAX_KBYTES}" in err
    with pytest.raises(SystemExit):
        tokenizer.main(["--help"])
    assert f"at most {tokenizer.MAX_KBYTES}" in " ".join(capsys.readouterr().out.split())


def name_max(folder: Path) -> int:
    return os.pathconf(folder, "PC_NAME_MAX")


@pytest.mark.parametrize("flag, suffix", [("--json", ".json"), ("--plot", ".png")])
def test_a_file_name_longer_than_the_file_system_takes_is_refused(monkeypatch, capsys, tmp_path, flag, suffix):
    from experiments.evaluation import compare
    no_work(monkeypatch, compare, "run_main")
    out = tmp_path / ("a" * 300 + suffix)
    err = refused(capsys, compare.main, [flag, str(out)])
    assert flag in err and "too long" in err, err
    # the atomic write's temporary file is 14 characters longer than the name: a name that leaves it no room
    out = tmp_path / ("b" * (name_max(tmp_path) - 13 - len(suffix)) + suffix)
    err = refused(capsys, compare.main, [flag, str(out)])
    assert flag in err and "too long" in err, err
    assert list(tmp_path.iterdir()) == []


def test_the_longest_name_accepted_can_be_written(tmp_path):
    from nanollm import cli
    path = cli.output_file(str(tmp_path / ("c" * (name_max(tmp_path) - 14 - 5) + ".json")))
    atomic_write_text(path, "{}")
    assert path.read_text() == "{}"


def test_an_output_folder_with_a_name_too_long_is_refused(monkeypatch, capsys, tmp_path):
    from nanollm.cli import hf
    no_work(monkeypatch, hf, "load")
    err = refused(capsys, hf.main, ["retrieval-llama", str(tmp_path / ("d" * 300) / "export")])
    assert "out" in err and "too long" in err, err


# ----------------------------------------------------------------------------------------------------------
# 4. A results file that appears during the run

def test_a_results_file_written_meanwhile_is_replaced_whole(monkeypatch, capsys, tmp_path):
    """``experiments.compare --json`` replaces a named file (results are regenerated under their name); a file
    another run writes there meanwhile is replaced by one atomic rename: never mixed, no temporary file."""
    from experiments.evaluation import compare
    out = tmp_path / "results.json"
    run = compare.run

    def another_run_writes_meanwhile(*args, **kwargs):
        out.write_text('{"records": "the other run"}')
        return run(*args, **kwargs)
    monkeypatch.setattr(compare, "run", another_run_writes_meanwhile)
    compare.main(["--samples", "1", "--tasks", "niah_single_prose", "--methods", "snapkv", "--keep-ratios", "0.5",
                  "--length", "256", "--modes", "question_in_prompt", "--workers", "1", "--quiet",
                  "--json", str(out)])
    capsys.readouterr()
    assert json.loads(out.read_text())["records"][0]["method"] in ("full", "snapkv")
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


# ----------------------------------------------------------------------------------------------------------
# 2. Ctrl-C and SIGTERM mid-run (subprocesses)

def alive(group: int) -> list[str]:
    """The processes of process group ``group`` that still run (zombies aside): pid and command line."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
            fields = rest.rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid} {cmdline[:120]}")
    return found


def interrupt(args: list[str], sig: int, when, tmp: Path, whole_group: bool = True, timeout: float = 120):
    """Run ``python ARGS`` with its temporary files in ``tmp``; once ``when(process, its output so far)`` is
    true, send ``sig`` to the process (or, as Ctrl-C does, to its whole process group). Returns (exit
    status, stderr, processes left in the group)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(tmp))
    p = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    out, err = bytearray(), bytearray()
    readers = [threading.Thread(target=lambda f=f, b=b: [b.extend(x) for x in iter(lambda: f.read1(4096), b"")])
               for f, b in ((p.stdout, out), (p.stderr, err))]
    for r in readers:
        r.start()
    try:
        deadline = time.time() + timeout
        while not when(p, (out + err).decode(errors="replace")):
            assert p.poll() is None and time.time() < deadline, f"ended before the signal:\n{err.decode()}"
            time.sleep(0.02)
        os.killpg(p.pid, sig) if whole_group else os.kill(p.pid, sig)
        rc = p.wait(timeout=60)
        for r in readers:
            r.join(10)
        left = alive(p.pid)
        for _ in range(100):                        # the multiprocessing resource tracker leaves on its own
            if not left:
                break
            time.sleep(0.05)
            left = alive(p.pid)
        return rc, err.decode(errors="replace"), left
    finally:
        for line in alive(p.pid):
            os.kill(int(line.split()[0]), signal.SIGKILL)


def assert_interrupted(rc: int, err: str, left: list[str]) -> None:
    assert rc == 130, (rc, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.rstrip().splitlines()[-1].split("\r")[-1] == "error: interrupted", err
    assert left == [], left


COMPARE = ["-m", "experiments.compare", "--tasks", "niah_single_prose", "--methods", "snapkv", "--keep-ratios",
           "0.5", "--length", "512", "--samples", "40"]


def started(p, err: str) -> bool:
    return re.search(r"\| *0/80 \[", err) is not None      # the progress bar at 0: the jobs are starting


def jobs_done(p, err: str) -> bool:
    return re.search(r"\| *[1-9][0-9]*/80 \[", err) is not None      # some jobs done


@pytest.mark.slow
@pytest.mark.parametrize("workers", [["--workers", "2"], []], ids=["--workers 2", "default workers"])
@pytest.mark.parametrize("when", [pytest.param(started, id="as the workers start", marks=pytest.mark.heavy),
                                  pytest.param(jobs_done, id="mid-run")])        # CI's time: one moment
def test_ctrl_c_stops_compare_and_its_workers_in_one_line(workers, when, tmp_path):
    assert_interrupted(*interrupt(COMPARE + workers, signal.SIGINT, when, tmp_path))
    assert list(tmp_path.glob("compare-*")) == []          # the workers' copy of the model is removed


IDLE_WORKER = """
import multiprocessing, time
from nanollm import cli
with cli.errors():
    with multiprocessing.get_context("spawn").Pool(2, initializer=cli.worker_leaves_on_sigterm) as pool:
        for _ in pool.imap(time.sleep, [0.1, 60]):   # one worker is soon idle, the other sleeps
            print("one done", flush=True)
"""


@pytest.mark.slow
def test_sigterm_to_the_group_with_an_idle_worker_does_not_hang(tmp_path):
    # An idle worker waits for a job holding the pool's queue lock; ended by SIGTERM on the spot it would
    # keep the lock, and Pool.terminate would wait for it for ever (CI saw compare hang so).
    def idle(p, out):
        if "one done" in out:
            time.sleep(1)                           # the idle worker is back in its wait for a job
            return True
        return False
    assert_interrupted(*interrupt(["-c", IDLE_WORKER], signal.SIGTERM, idle, tmp_path, whole_group=True))


@pytest.mark.slow
def test_a_run_in_workers_ends_quietly_and_quiet_is_short():
    # The pool's workers leave on SIGTERM only from their job loop: the one Pool.terminate sends at the end of
    # a run reaches them on their way out, where an exception would print their exit handlers' traceback
    # (every run did so before); --quiet prints each mode's verdict per keep ratio, not the tables.
    run = subprocess.run([sys.executable, "-m", "experiments.compare", "--methods", "snapkv", "chunkkv",
                          "--keep-ratios", "0.5", "--tasks", "niah_multikey", "--samples", "2", "--workers", "2",
                          "--quiet"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stderr == "", run.stderr[-2000:]
    verdicts = [line for line in run.stdout.splitlines() if line.startswith("[") and " keep " in line]
    assert [line.split(" keep")[0] for line in verdicts] == ["[question_in_prompt]", "[question_after_context]"]
    full = [line for line in run.stdout.splitlines() if line.startswith("[") and " full cache: " in line]
    assert [line.split(" full")[0] for line in full] == ["[question_in_prompt]", "[question_after_context]"]
    assert len(run.stdout.splitlines()) < 14 and "exact paired test" in verdicts[0]


@pytest.mark.slow
@pytest.mark.parametrize("whole_group", [False, True], ids=["kill PID", "kill the group"])
def test_sigterm_stops_compare_and_its_workers_in_one_line(whole_group, tmp_path):
    assert_interrupted(*interrupt(COMPARE + ["--workers", "2"], signal.SIGTERM, jobs_done, tmp_path, whole_group))
    assert list(tmp_path.glob("compare-*")) == []


def loading_torch(p, err: str) -> bool:
    """The process has started loading torch's libraries: it is importing, before its ``main``."""
    try:
        return "libtorch" in Path(f"/proc/{p.pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("when", [loading_torch, lambda p, err: "MiB;" in err], ids=["while loading", "mid-run"])
def test_ctrl_c_stops_the_kernel_bench_in_one_line(when, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")    # the CPU's path on any machine (a GPU's ends sooner)
    rc, err, left = interrupt(["-m", "fastpath.bench", "--quick", "--json", str(tmp_path / "bench.json")],
                              signal.SIGINT, when, tmp_path)
    assert_interrupted(rc, err, left)
    assert list(tmp_path.glob("*bench.json*")) == []


def test_mutants_refuse_more_jobs_than_cores(capsys):
    """``course.mutants --jobs 999`` would start 999 graders at once (two processes each)."""
    from course import mutants
    with pytest.raises(SystemExit) as e:
        mutants.main(["cache", "--jobs", str(CORES + 1)])
    assert "--jobs must be at most" in str(e.value.code) + capsys.readouterr().err
