"""
The model commands (``train``, ``card``, ``hf``) against sizes, a full disk and Ctrl-C (issue 59).

* ``train --tokens-per-step`` beyond what the machine can hold, a ``--lr`` above ``train.MAX_LR`` and a
  ``--seed`` torch cannot take are refused in one line before any work.
* On a full disk (the file-size limit ``RLIMIT_FSIZE``, in a subprocess) ``hf``, ``card --out`` and
  ``train`` fail in one line and leave nothing they created: no new folder, no file of theirs in a folder
  the user had (which stays).
* Ctrl-C (SIGINT to the whole process group, as a terminal sends it) during ``card --in-place`` with worker
  processes ends in ``error: interrupted`` and nothing else: no worker's traceback, no process left, the
  card and the temporary folder as they were.
"""

from __future__ import annotations

import re
import resource
import shutil
import signal
import time
from pathlib import Path

import pytest

from nanollm.cli import train as train_cli
from tests.commands import refused
from tests.nanollm.cli.test_cli import BUNDLED, fork_server, snapshot
from tests.nanollm.cli.test_hostile_commands import assert_interrupted, interrupt, no_work

# ----------------------------------------------------------------------------------------------------------
# 1. Sizes and values refused before any work


def test_tokens_per_step_beyond_the_memory_is_refused_before_any_work(monkeypatch, capsys, tmp_path):
    """A trillion tokens per step would grow the step-0 batch by 17 MB/s until memory runs out."""
    no_work(monkeypatch, train_cli, "train", "check_run_folder")
    err = refused(capsys, train_cli.main, ["--preset", "tiny", "--out", str(tmp_path / "run"),
                                           "--tokens-per-step", "1000000000000"])
    assert "--tokens-per-step" in err and "GiB" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_batch_that_fits_is_accepted(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(train_cli, "train", lambda cfg, *a, **kw: ran.append(cfg.tokens_per_step))
    train_cli.main(["--preset", "tiny", "--out", str(tmp_path / "run"), "--tokens-per-step", "100000"])
    assert ran == [100000]


@pytest.mark.parametrize("lr", ["1e300", "1.5"])
def test_an_absurd_learning_rate_is_refused_before_any_work(monkeypatch, capsys, tmp_path, lr):
    """``--lr 1e300`` ended in a traceback from inside AdamW (a step size that overflows a float)."""
    no_work(monkeypatch, train_cli, "train", "check_run_folder")
    err = refused(capsys, train_cli.main, ["--preset", "tiny", "--out", str(tmp_path / "run"), "--lr", lr])
    assert "--lr" in err and f"{train_cli.MAX_LR:g}" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_seed_torch_cannot_take_is_refused_before_any_work(monkeypatch, capsys, tmp_path):
    """``--seed 10**23`` failed in torch.manual_seed, after the run folder was made."""
    no_work(monkeypatch, train_cli, "train", "check_run_folder")
    err = refused(capsys, train_cli.main, ["--preset", "tiny", "--out", str(tmp_path / "run"),
                                           "--seed", str(10**23)])
    assert "--seed" in err and "2**64" in err, err


# ----------------------------------------------------------------------------------------------------------
# 2. A full disk: nothing the failed command created is left

FULL_DISK = 100_000       # bytes: the tokenizers and configs fit, the weights and the training state do not


@pytest.fixture(scope="module")
def run_full():
    """``forked.py`` (commands in forks of a process that has imported torch) under the file-size limit
    ``FULL_DISK``: each command's writes past it fail with EFBIG, as on a full disk."""
    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (FULL_DISK, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    yield from fork_server(limit_file_size, default_timeout=120)


MODEL_COMMANDS = {
    "hf": ["-m", "nanollm.cli.hf", "retrieval-llama", "{out}"],
    "card --out": ["-m", "nanollm.cli.card", "retrieval-llama", "--out", "{out}", "--tasks", "niah_single_noise",
                   "--lengths", "256", "--samples", "1", "--workers", "1"],
    "train": ["-m", "nanollm.cli.train", "--preset", "tiny", "--out", "{out}", "--max-steps", "2", "--quiet",
              "--device", "cpu"],                           # not CUDA where the machine has it
}


@pytest.mark.slow
@pytest.mark.parametrize("existing", [False, True], ids=["a new folder", "an empty folder the user had"])
@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_a_full_disk_leaves_nothing_the_command_created(run_full, tmp_path, command, existing):
    out = tmp_path / "out" / "model"                   # new: both folders are the command's own
    if existing:
        out.mkdir(parents=True)
    before = snapshot(tmp_path)
    result = run_full([a.format(out=out) for a in MODEL_COMMANDS[command]], cwd=tmp_path)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("error: ") and "File too large" in last, result.stderr
    assert snapshot(tmp_path) == before                 # the user's folder stays, empty; a new one is gone


# ----------------------------------------------------------------------------------------------------------
# 3. Ctrl-C during card --in-place with worker processes

def bar_shown(delay: float):
    """Once the card's progress bar is shown (its workers are starting), after ``delay`` more seconds."""
    seen = []

    def when(p, err: str) -> bool:
        if "card:" in err and not seen:
            seen.append(time.time())
        return bool(seen) and time.time() >= seen[0] + delay
    return when


def jobs_done(p, err: str) -> bool:
    return re.search(r"\| *[1-9]/4 \[", err) is not None       # some of the 4 jobs are done, not all


@pytest.mark.slow
@pytest.mark.parametrize("when", [pytest.param(bar_shown(0), id="as the workers start", marks=pytest.mark.heavy),
                                  pytest.param(bar_shown(0.5), id="0.5 s later", marks=pytest.mark.heavy),
                                  pytest.param(bar_shown(2), id="2 s later", marks=pytest.mark.heavy),
                                  pytest.param(jobs_done, id="mid-run")])       # CI: one moment; --runheavy: all
def test_ctrl_c_stops_card_and_its_workers_in_one_line(tmp_path, when):
    ck = Path(shutil.copytree(BUNDLED, tmp_path / "ck"))
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    before = snapshot(ck)
    rc, err, left = interrupt(["-m", "nanollm.cli.card", str(ck), "--in-place", "--tasks", "niah_single_noise",
                               "niah_multikey", "--lengths", "256", "--samples", "8", "--workers", "2"],
                              signal.SIGINT, when, temporary)
    assert_interrupted(rc, err, left)
    assert snapshot(ck) == before                       # the card as it was
    # no temporary file left (torch's compile cache, which any run of the model makes, aside)
    assert [p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_")] == []
