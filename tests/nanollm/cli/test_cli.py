"""
The command lines, used the way a new user would, mistakes included.

* Every bad input is rejected before any work: one line ``error: ...`` on stderr that names the flag or
  file, exit status 2, no traceback, and no file created or changed. Each case runs as ``python -m ...``
  would, in a process of its own (a fork of one that has imported torch: forked.py) in an empty temporary
  folder, which also checks that the commands work from outside the repository.
* Every file is written atomically: a write that fails part-way (a full disk, simulated with the file-size
  limit ``RLIMIT_FSIZE``, or an error raised mid-write) leaves the previous file and no temporary file.
* A training run interrupted between saves resumes to exactly the weights of an uninterrupted run.
* Every flag of every command has a help text that gives its default, and no help cites a flag or file
  that does not exist.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanollm import preset
from nanollm.io import checkpoint, files
from nanollm.io.hf import export_hf

pytestmark = pytest.mark.slow        # commands in subprocesses: the fast tier (-m "not slow") skips them

ROOT = Path(__file__).resolve().parents[3]
BUNDLED = ROOT / "nanollm" / "checkpoints" / "retrieval-llama"


def cli_env() -> dict[str, str]:
    """The environment of a command: this checkout importable, one torch thread (as in the rest of the suite)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p),
                OMP_NUM_THREADS="1")


def run_cli(args: list[str], cwd: Path, file_size_limit: int | None = None, timeout: int = 120):
    """``python ARGS`` in ``cwd`` with this checkout importable; optionally with a file-size limit (a full disk)."""
    env = cli_env()

    def limit_file_size():                  # runs in the child: writes past the limit fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limit_file_size if file_size_limit else None)


def fork_server(preexec_fn=None, default_timeout: int = 60):
    """A ``forked.py`` server (``preexec_fn`` runs in it before it starts) and a ``run(args, cwd)`` that has it
    fork a command: yields ``run``, then stops the server (a fixture's body)."""
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forked.py"))], env=cli_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=preexec_fn)

    def run(args: list[str], cwd: Path, timeout: int = default_timeout) -> subprocess.CompletedProcess:
        server.stdin.write(json.dumps({"args": args, "cwd": str(cwd), "timeout": timeout}) + "\n")
        server.stdin.flush()
        done = json.loads(server.stdout.readline())
        return subprocess.CompletedProcess(args, done["returncode"], done["stdout"], done["stderr"])
    yield run
    server.stdin.close()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def run_forked():
    """``run_cli`` without the import of torch each time: the command runs in a fork of a process that has
    imported it (forked.py), with its own argv, folder, output and exit status."""
    yield from fork_server()


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder`` (hidden ones included), with a hash of each file's bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def assert_one_error_line(result, *names: str) -> str:
    assert result.returncode == 2, f"exit status {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    return lines[0]


# ----------------------------------------------------------------------------------------------------------
# Folders the bad inputs point at (outside the folder each command runs in)

@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("inputs")
    model, tok, _ = checkpoint.load("retrieval-llama")
    export_hf(model, base / "hf", tokenizer=tok)                       # a Hugging Face folder
    export_hf(model, base / "hf_no_tokenizer")                         # ... without a tokenizer
    export_hf(model, base / "hf_bad_config")
    (base / "hf_bad_config" / "config.json").write_text('{"model_type": "llama", ')     # cut short
    return {name: str(base / name) for name in ("hf", "hf_no_tokenizer", "hf_bad_config")}


def fake_run(cwd: Path, recipe: str = "tiny") -> None:
    """A training run folder ``run`` of the tiny recipe (its state is never read by the rejected commands)."""
    from nanollm.cli.train import TRAIN_PRESETS
    (cwd / "run").mkdir()
    (cwd / "run" / "train_config.json").write_text(json.dumps(dataclasses.asdict(TRAIN_PRESETS[recipe]), indent=1))
    (cwd / "run" / "state.pt").write_bytes(b"not read")
    (cwd / "run" / "log.jsonl").write_text('{"step": 1}\n')


def a_file(cwd: Path) -> None:
    (cwd / "notes.txt").write_text("my notes\n")


def a_model(cwd: Path) -> None:
    """A Hugging Face folder ``llama`` that nanollm did not write (a downloaded model, say)."""
    from nanollm.io.safetensors import save_file
    (cwd / "llama").mkdir()
    (cwd / "llama" / "config.json").write_text('{"model_type": "llama"}')
    save_file({"model.norm.weight": torch.ones(4)}, cwd / "llama" / "model.safetensors", metadata={"format": "pt"})


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")

# (id, command line, words the error line must contain, setup of the folder the command runs in)
GEN, MGEN = ["-m", "nanollm.cli.generate"], ["-m", "experiments.evaluation.generate"]
# train picks CUDA where there is one: these run on the CPU everywhere
TRAIN = ["-m", "nanollm.cli.train", "--quiet", "--device", "cpu"]
CARD, BENCH = ["-m", "nanollm.cli.card"], ["-m", "experiments.bench"]
HF, TOK, COMPARE = ["-m", "nanollm.cli.hf"], ["-m", "nanollm.cli.tokenizer"], ["-m", "experiments.compare", "--quiet"]
BUILD = [str(ROOT / "notebooks" / "build.py")]
BAD_INPUTS = [
    # generation
    ("generate: missing checkpoint", GEN + ["--checkpoint", "nope"], ["nope"], None),
    ("generate: unknown task", GEN + ["--task", "niah_single"], ["--task"], None),
    ("generate: length 0", GEN + ["--length", "0"], ["--length"], None),
    ("generate: length beyond the model", GEN + ["--length", "5000"], ["--length", "1024"], None),
    ("generate: empty prompt", GEN + ["--prompt", ""], ["--prompt"], None),
    ("generate: max-new-tokens beyond the model", GEN + ["--max-new-tokens", "2000"], ["--max-new-tokens"], None),
    ("generate: temperature nan", GEN + ["--temperature", "nan"], ["--temperature"], None),
    ("generate: temperature inf", GEN + ["--temperature", "inf"], ["--temperature"], None),
    ("generate: top-k when greedy", GEN + ["--top-k", "5"], ["--top-k", "--temperature"], None),
    ("generate: budget without method", GEN + ["--budget", "64"], ["--budget"], None),
    ("generate: Hugging Face folder without tokenizer", GEN + ["--checkpoint", "{hf_no_tokenizer}"],
     ["--checkpoint", "tokenizer"], None),
    ("generate: corrupt config.json", GEN + ["--checkpoint", "{hf_bad_config}"], ["config.json"], None),
    ("experiments.evaluation.generate: unknown method", MGEN + ["--method", "nope", "--budget", "64"],
     ["--method", "nope"], None),
    ("experiments.evaluation.generate: method without budget", MGEN + ["--method", "h2o"], ["--budget"], None),
    ("experiments.evaluation.generate: budget 0", MGEN + ["--method", "h2o", "--budget", "0"], ["--budget"], None),
    ("experiments.evaluation.generate: budget without method", MGEN + ["--budget", "64"], ["--budget", "--method"],
     None),
    # training
    ("train: existing run without --resume", TRAIN + ["--preset", "tiny", "--out", "run"],
     ["--out", "--resume", "--force"], fake_run),
    ("train: --resume and --force", TRAIN + ["--preset", "tiny", "--out", "run", "--resume", "--force"],
     ["--resume", "--force"], fake_run),
    ("train: resume with another recipe", TRAIN + ["--preset", "tiny", "--out", "run", "--resume", "--lr", "1e-3"],
     ["--resume", "lr"], fake_run),
    ("train: out holds other files", TRAIN + ["--preset", "tiny", "--out", "."], ["--out"], a_file),
    ("train: max-steps 0", TRAIN + ["--max-steps", "0"], ["--max-steps"], None),
    ("train: tokens-per-step 0", TRAIN + ["--tokens-per-step", "0"], ["--tokens-per-step"], None),
    ("train: lr -1", TRAIN + ["--lr", "-1"], ["--lr"], None),
    ("train: lr 0", TRAIN + ["--lr", "0"], ["--lr"], None),
    ("train: init of another shape", TRAIN + ["--preset", "tiny", "--out", "new", "--init", "retrieval-llama"],
     ["--init", "n_layer (4 vs 2)"], None),
    ("train: export to a file", TRAIN + ["--preset", "tiny", "--out", "new", "--export", "notes.txt"],
     ["--export", "notes.txt"], a_file),
    # model cards
    ("card: samples 0", CARD + ["retrieval-llama", "--samples", "0"], ["--samples"], None),
    ("card: length beyond the model", CARD + ["retrieval-llama", "--lengths", "2000"], ["--lengths", "1024"], None),
    ("card: out holds other files", CARD + ["retrieval-llama", "--out", "."], ["--out"], a_file),
    ("card: in-place on a run", CARD + ["run", "--in-place"], ["--in-place"], fake_run),
    # decode benchmark
    ("bench: one context", BENCH + ["--contexts", "128"], ["--contexts"], None),
    ("bench: json in a missing folder", BENCH + ["--json", "nodir/bench.json"], ["--json", "nodir"], None),
    ("bench: json is a folder", BENCH + ["--json", "."], ["--json", "folder"], None),
    # tokenizer benchmark
    ("tokenizer: kbytes 0", TOK + ["bench", "--kbytes", "0"], ["--kbytes"], None),
    ("tokenizer: Hugging Face tokenizer", TOK + ["bench", "--checkpoint", "{hf}"], ["--checkpoint"], None),
    # Hugging Face export
    ("hf: from a Hugging Face folder", HF + ["{hf}", "out"], ["Hugging Face"], None),
    ("hf: out holds other files", HF + ["retrieval-llama", "."], ["out"], a_file),
    ("hf: out is a model it did not write", HF + ["retrieval-llama", "llama"], ["llama"], a_model),
    # compare
    ("compare: length 0", COMPARE + ["--length", "0"], ["--length"], None),
    ("compare: threads 0", COMPARE + ["--threads", "0"], ["--threads"], None),
    ("compare: cuda without CUDA", COMPARE + ["--device", "cuda"], ["--device", "cuda"], NO_CUDA),
    ("compare: unknown device", COMPARE + ["--device", "foo"], ["--device", "foo"], None),
    ("compare: json in a missing folder", COMPARE + ["--json", "nodir/r.json"], ["--json", "nodir"], None),
    ("compare: plot is a folder", COMPARE + ["--plot", "."], ["--plot", "folder"], None),
    ("compare: plot of unknown format", COMPARE + ["--plot", "fig.foo"], ["--plot", ".foo"], None),
    ("compare: plot without suffix", COMPARE + ["--plot", "fig"], ["--plot", "suffix"], None),
    ("compare: Hugging Face folder without tokenizer", COMPARE + ["--checkpoint", "{hf_no_tokenizer}"],
     ["--checkpoint", "tokenizer"], None),
    # notebooks
    ("build: missing source", BUILD + ["nope.py"], ["nope.py"], None),
    ("build: tiny without executing", BUILD + ["--tiny", "--no-execute"], ["--tiny", "--no-execute"], None),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0], marks=[NO_CUDA] if c[3] is NO_CUDA else [])
                                  for c in BAD_INPUTS])
def test_bad_input_is_one_error_line_and_changes_nothing(case, folders, tmp_path, run_forked):
    _, args, names, setup = case
    if setup is not None and setup is not NO_CUDA:
        setup(tmp_path)
    args = [a.format(**folders) for a in args]
    before, bundled = snapshot(tmp_path), snapshot(BUNDLED)
    result = run_forked(args, cwd=tmp_path, timeout=60)
    assert_one_error_line(result, *names)
    assert snapshot(tmp_path) == before, "the folder it ran in changed"
    assert snapshot(BUNDLED) == bundled, "the bundled checkpoint changed"
    assert not result.stdout.strip(), result.stdout


def test_debug_shows_the_traceback(tmp_path):
    result = run_cli(GEN + ["--checkpoint", "nope", "--debug"], cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" in result.stderr


# ----------------------------------------------------------------------------------------------------------
# What used to crash or mislead, now right

def test_generate_runs_with_no_arguments_and_checks_the_answer(tmp_path):
    result = run_cli(GEN, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--- generated:" in result.stdout and "matches the expected answer: 1 of 1" in result.stdout
    assert not list(tmp_path.iterdir())


def test_generate_leaves_room_for_long_answers(tmp_path):
    """Multi-query answers take ~60 tokens: the default answer length is the task's, not 32."""
    result = run_cli(GEN + ["--task", "niah_multiquery", "--length", "256"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "matches the expected answer: 4 of 4" in result.stdout, result.stdout


def test_card_writes_only_where_told(tmp_path, capsys):
    from nanollm.cli.card import main as card_main
    quick = ["--samples", "1", "--tasks", "niah_single_noise", "--lengths", "256", "--workers", "1", "--seed", "7"]
    bundled = snapshot(BUNDLED)
    card_main(["retrieval-llama", *quick])                            # a bundled name, no --out: print only
    assert snapshot(BUNDLED) == bundled
    assert "was not written" in capsys.readouterr().out
    card_main(["retrieval-llama", "--out", str(tmp_path / "ck"), *quick])
    card = json.loads((tmp_path / "ck" / "card.json").read_text())
    assert card["name"] == "retrieval-llama" and card["default_suite"] == ["niah_single_noise"]
    assert "--tasks niah_single_noise" in card["eval_command"] and "--seed 7" in card["eval_command"]
    model, _, _ = checkpoint.load(tmp_path / "ck")                    # a complete checkpoint
    (tmp_path / "ck" / "card.json").unlink()                          # no card: named after its folder
    card_main([str(tmp_path / "ck"), "--in-place", *quick])
    assert json.loads((tmp_path / "ck" / "card.json").read_text())["name"] == "ck"


def test_plot_is_written_under_the_name_given(tmp_path):
    from experiments.evaluation.report import plot
    records = [{"method": m, "keep_ratio": k, "mode": "question_in_prompt", "accuracy": a}
               for m, k, a in [("full", 1.0, 1.0), ("h2o", 0.5, 0.8), ("h2o", 0.25, 0.5)]]
    plot(records, tmp_path / "fig.svg")
    assert [p.name for p in tmp_path.iterdir()] == ["fig.svg"] and b"<svg" in (tmp_path / "fig.svg").read_bytes()


def test_export_hf_checks_the_tokenizer_before_writing(folders, tmp_path):
    """A Hugging Face folder's tokenizer (tiktoken inside) is re-exported with the same ids; a tokenizer that
    is not byte-level BPE is a clear error before any file is written."""
    model, tok, _ = checkpoint.load(folders["hf"])
    export_hf(model, tmp_path / "again", tokenizer=tok)
    _, again, _ = checkpoint.load(tmp_path / "again")
    text = "Hello world, 123 times! " * 3
    assert again.encode(text) == tok.encode(text) and again.eot_id == tok.eot_id
    with pytest.raises(ValueError, match="byte-level BPE tokenizers, not object"):
        export_hf(model, tmp_path / "out", tokenizer=object())
    assert not (tmp_path / "out").exists()


def test_bench_with_one_context_fits_no_line():
    from experiments.bench import format_result, run_bench
    result = run_bench(preset("TINY"), contexts=[16], repeats=1, steps=1)
    assert result.fit == {} and "no fit" in format_result(result)


# ----------------------------------------------------------------------------------------------------------
# Atomic writes: a failure part-way leaves the previous file

def test_atomic_open_keeps_the_old_file_when_a_write_fails(tmp_path):
    path = tmp_path / "records.json"
    path.write_text("old")
    with pytest.raises(OSError, match="No space"):
        with files.atomic_open(path, "w") as f:
            f.write("[{" * 512)                                  # half of the new file ...
            raise OSError(errno.ENOSPC, "No space left on device")   # ... then the disk is full
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["records.json"]
    files.atomic_write_text(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["records.json"]


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "hf"
    assert run_cli(HF + ["retrieval-llama", str(out)], cwd=out.parent).returncode == 0
    return out


def test_full_disk_leaves_the_previous_export(hf_export):
    """The weights (3.4 MB) do not fit under a 1 MB file-size limit: the export fails, the old one stays."""
    before = snapshot(hf_export.parent)
    result = run_cli(HF + ["retrieval-llama", str(hf_export), "--dtype", "bfloat16"], cwd=hf_export.parent,
                     file_size_limit=1 << 20)
    assert_one_error_line(result, "File too large")
    assert snapshot(hf_export.parent) == before
    checkpoint.load(hf_export)


def test_full_disk_leaves_the_previous_json(tmp_path):
    old = '[{"method": "full"}]'
    (tmp_path / "r.json").write_text(old)
    result = run_cli(COMPARE + ["--methods", "full", "--samples", "1", "--length", "128", "--tasks",
                                "niah_single_noise", "--json", "r.json"], cwd=tmp_path, file_size_limit=256)
    assert_one_error_line(result, "File too large")
    assert (tmp_path / "r.json").read_text() == old and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_full_disk_leaves_the_previous_training_state(tmp_path):
    from nanollm.cli.train import TRAIN_PRESETS, train
    train(TRAIN_PRESETS["tiny"], tmp_path / "run", max_steps=2, quiet=True)
    before = snapshot(tmp_path)
    result = run_cli(TRAIN + ["--preset", "tiny", "--out", "run", "--resume"], cwd=tmp_path,
                     file_size_limit=64 << 10)
    assert result.returncode == 2 and "File too large" in result.stderr and "Traceback" not in result.stderr
    assert snapshot(tmp_path)["run/state.pt"] == before["run/state.pt"]
    assert sorted(snapshot(tmp_path)) == sorted(before)                 # no temporary file left behind
    assert torch.load(tmp_path / "run" / "state.pt", weights_only=True)["step"] == 2


# ----------------------------------------------------------------------------------------------------------
# Training: run folders are never reused silently, and an interrupted run resumes to the same weights

def test_train_interrupted_between_saves_resumes_to_the_same_state(tmp_path, monkeypatch):
    """Six steps saved every two; the first run crashes in step 6, after step 5 was taken and logged but not
    saved. Resuming redoes steps 5 and 6 from the state of step 4: the weights, the optimizer state and the
    log equal an uninterrupted run's, bit for bit (CPU, one thread, data seeded by the step number)."""
    import nanollm.cli.train as train_mod
    cfg = dataclasses.replace(train_mod.TRAIN_PRESETS["tiny"], stages=[[6, 200, 256, 1.1]])
    train_mod.train(cfg, tmp_path / "whole", quiet=True)

    real_lr_at = train_mod.lr_at

    def crash_in_step_6(step, c):
        if step == 5:                                  # 0-based: the sixth step is starting
            raise KeyboardInterrupt
        return real_lr_at(step, c)

    monkeypatch.setattr(train_mod, "lr_at", crash_in_step_6)
    with pytest.raises(KeyboardInterrupt):
        train_mod.train(cfg, tmp_path / "cut", quiet=True)
    monkeypatch.setattr(train_mod, "lr_at", real_lr_at)
    assert torch.load(tmp_path / "cut" / "state.pt", weights_only=True)["step"] == 4
    assert len((tmp_path / "cut" / "log.jsonl").read_text().splitlines()) == 5
    with pytest.raises(ValueError, match="--resume"):
        train_mod.train(cfg, tmp_path / "cut", quiet=True)             # neither --resume nor --force
    train_mod.train(cfg, tmp_path / "cut", quiet=True, resume=True)

    whole = torch.load(tmp_path / "whole" / "state.pt", weights_only=True)
    cut = torch.load(tmp_path / "cut" / "state.pt", weights_only=True)
    assert cut["step"] == whole["step"] == 6
    assert all(torch.equal(cut["model"][k], v) for k, v in whole["model"].items())
    for i, per_param in whole["opt"]["state"].items():                # AdamW's step, exp_avg, exp_avg_sq
        assert all(torch.equal(cut["opt"]["state"][i][k], v) for k, v in per_param.items())
    drop_time = lambda path: [{k: v for k, v in json.loads(line).items() if k != "time"}   # noqa: E731
                              for line in path.read_text().splitlines()]
    assert drop_time(tmp_path / "cut" / "log.jsonl") == drop_time(tmp_path / "whole" / "log.jsonl")


def test_train_force_starts_over(tmp_path):
    from nanollm.cli.train import TRAIN_PRESETS, train
    cfg = TRAIN_PRESETS["tiny"]
    train(cfg, tmp_path / "run", max_steps=3, quiet=True)
    train(dataclasses.replace(cfg, lr=1e-3), tmp_path / "run", max_steps=1, quiet=True, force=True)
    assert torch.load(tmp_path / "run" / "state.pt", weights_only=True)["step"] == 1
    assert len((tmp_path / "run" / "log.jsonl").read_text().splitlines()) == 1
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["lr"] == 1e-3


# ----------------------------------------------------------------------------------------------------------
# Help texts: complete and true

COMMANDS = ["nanollm.cli.generate", "experiments.evaluation.generate", "nanollm.cli.train", "nanollm.cli.card",
            "experiments.bench", "nanollm.cli.hf", "nanollm.cli.tokenizer", "experiments.compare",
            "experiments.evaluation.bench", "experiments.evaluation.language_modelling",
            "experiments.evaluation.peer_kvpress",
            "experiments.evaluation.throughput", "experiments.evaluation.rescore", "experiments.evaluation.launches",
            "experiments.evaluation.convert", "fastpath.profile", "nanollm.cli.timed", "notebooks/build.py"]
DUMP_PARSERS = """
import importlib, importlib.util, json, sys
from nanollm import cli


class Parsed(Exception):
    pass

def stop(self, *args, **kwargs):
    raise Parsed(self)

cli.ArgumentParser.parse_args = stop           # build each parser, parse nothing
out = {}
for name in sys.argv[2:]:
    if name.endswith(".py"):
        spec = importlib.util.spec_from_file_location("build", sys.argv[1] + "/" + name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(name)
    try:
        module.main([])
    except Parsed as p:
        parser = p.args[0]
    out[name] = {"text": parser.format_help(), "flags": [f for a in parser._actions for f in a.option_strings],
                 "actions": [{"flags": a.option_strings, "help": a.help, "default": a.default}
                             for a in parser._actions if a.option_strings and a.dest != "help"]}
print(json.dumps(out, default=repr))
"""


@pytest.fixture(scope="module")
def parsers(tmp_path_factory) -> dict:
    result = run_cli(["-c", DUMP_PARSERS, str(ROOT), *COMMANDS], cwd=tmp_path_factory.mktemp("help"))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_complete_and_true(parsers, command):
    parser = parsers[command]
    for action in parser["actions"]:
        assert action["help"], f"{command} {action['flags']} has no help"
        if action["default"] not in (None, False):
            assert "default" in action["help"].lower(), f"{command} {action['flags']}: help gives no default"
    text = parser["text"]
    for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", text):
        assert flag in parser["flags"], f"{command} --help mentions {flag}, which it does not have"
    for path in re.findall(r"\b[\w.-]+/[\w./-]*\.(?:py|md)\b", text):
        assert (ROOT / path).exists(), f"{command} --help cites {path}, which the repository does not have"


def test_a_reader_that_stops_reading_ends_the_command_quietly(monkeypatch, capsys):
    """``python -m ... | head``: when standard output's reader has gone, the command stops with the shell's
    status for it (141) and no "error: [Errno 32] Broken pipe" line; a broken pipe elsewhere stays an error."""
    from nanollm import cli
    read, write = os.pipe()
    os.close(read)                                                      # the reader went away
    stdout = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    with pytest.raises(SystemExit) as stop:
        with cli.errors():
            print("a line", flush=True)
    assert stop.value.code == 141 and "Broken pipe" not in capsys.readouterr().err
    monkeypatch.undo()
    stdout.close()
    with pytest.raises(SystemExit) as stop:                             # another pipe: an error line, status 2
        with cli.errors():
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
    assert stop.value.code == 2 and "error: [Errno 32] Broken pipe" in capsys.readouterr().err
