"""
Where a results file came from: the command, the settings that can change its numbers, and the code.

Every command that writes a results file records, at the top of its text output and under ``"provenance"``
in its JSON: ``command`` (how it was run), ``threads``, ``dtype``, ``seed``, ``versions`` (Python, torch,
numpy, the platform), ``commit`` (the git commit, with ``+changes`` when a tracked file outside ``results/``
differs from it; ``unknown`` outside a git checkout) and ``date`` (UTC, to the minute).
``tests/test_results_reproduce.py`` re-runs one small cell of each committed results table from them.

    prov = provenance(argv, prog=ap.prog, threads=1, dtype="float32", seed=0)   # argv: main's arguments
    print(header(prov))                              # "# command: python -m ...", one line per field
    json.dumps({"provenance": prov, "records": records})

Details: nanollm/inside.md, section "cli/provenance.py: where a results file came from".
"""

from __future__ import annotations

import datetime
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import numpy
import torch

ROOT = Path(__file__).resolve().parents[2]          # the repository (when installed from a checkout)


def command_line(args: list[str] | None = None, prog: str | None = None) -> str:
    """The command as a user would type it: ``prog`` (default: ``python -m package.module`` for a module run
    with -m, else ``python script``) and ``args``, the arguments after it (default ``sys.argv[1:]``)."""
    args = sys.argv[1:] if args is None else args
    if prog is None:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        prog = f"python -m {spec.name.removesuffix('.__main__')}" if spec is not None else f"python {sys.argv[0]}"
    return " ".join([prog] + [shlex.quote(str(a)) for a in args])


def head_commit(root: Path = ROOT) -> str | None:
    """The checked-out commit, read from ``.git`` (no git needed): HEAD, a loose ref, or packed-refs. In a
    ``git worktree`` checkout ``.git`` is a file naming the worktree's own folder (its HEAD), whose
    ``commondir`` names the repository's folder (the refs)."""
    git = common = root / ".git"
    try:
        if git.is_file():                                 # "gitdir: /repo/.git/worktrees/NAME"
            git = (root / git.read_text().strip().removeprefix("gitdir: ")).resolve()
            common = (git / (git / "commondir").read_text().strip()).resolve() \
                if (git / "commondir").is_file() else git
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head                                   # a detached HEAD is the commit itself
        ref = head[5:]
        for folder in (git, common):
            if (folder / ref).is_file():
                return (folder / ref).read_text().strip()
        for line in (common / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return None


def tree_changed(root: Path = ROOT) -> bool | None:
    """Whether tracked files outside ``results/`` differ from the commit (``git status``; the results files
    are what a run rewrites); None when git cannot say."""
    try:
        out = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                              ".", ":(exclude)results"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.strip())


def git_commit(root: Path = ROOT) -> str:
    """The commit, ``+changes`` appended when tracked files differ from it (``+changes?`` when that could not
    be checked); ``unknown`` outside a git checkout."""
    commit = head_commit(root)
    if commit is None:
        return "unknown"
    changed = tree_changed(root)
    return commit + ("+changes" if changed else "" if changed is False else "+changes?")


def provenance(args: list[str] | None = None, *, prog: str | None = None, threads: int, dtype: str,
               seed: int | None) -> dict:
    """The record described in the module docstring. ``args``: the command's arguments after its name
    (default ``sys.argv[1:]``); ``prog``: its name (default: from ``__main__``, see ``command_line``)."""
    return {"command": command_line(args, prog), "threads": threads, "dtype": dtype, "seed": seed,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "numpy": numpy.__version__,
                         "platform": f"{platform.system()} {platform.machine()}"},
            "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def header(prov: dict) -> str:
    """The record as ``# key: value`` lines, for the top of a text results file."""
    versions = ", ".join(f"{k} {v}" for k, v in prov["versions"].items())
    lines = [f"# command: {prov['command']}",
             f"# threads: {prov['threads']}, dtype: {prov['dtype']}, seed: {prov['seed']}",
             f"# versions: {versions}",
             f"# commit: {prov['commit']}, {prov['date']}"]
    return "\n".join(lines)
