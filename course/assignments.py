"""
The assignments: one per topic, each a folder ``course/<name>/`` with

* ``sheet.md``: the goal, the paper section to read, the tasks with their points, the CPU-minute budget, the
  written questions and their rubric (model answers in solution regions);
* ``adapters.py``: the only door the tests use into a student's code (CS336-style): a student who
  restructures the code points the adapters at it, and the tests never change;
* ``test_public.py``: the tests a student gets; ``test_hidden.py``: the tests only the grader has.

The solution regions live where the code belongs, in the library's own files and in the notebooks, marked
with ``course.markers``; ``SOURCES`` lists where each assignment's regions are, and a test checks that the
markers found in the repository are exactly these.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from .markers import Region, find_regions

ROOT = Path(__file__).resolve().parents[1]
COURSE = ROOT / "course"
SCANNED = ("nanollm", "methods", "kernels", "notebooks")    # where regions may be (besides the sheets)


@dataclass(frozen=True)
class Assignment:
    name: str
    title: str
    library: tuple[str, ...]     # library files with solution regions, relative to the root
    notebook: str                # the notebook of the topic (its exercises may hold regions too)
    interpreter: bool = False    # its tests run Triton kernels, in Triton's CPU interpreter
    requires: tuple[str, ...] = ()   # the assignments whose code its tests and notebook run: due before it

    def prerequisites(self) -> list[str]:
        """``requires`` and theirs, in order, without this one."""
        out, todo = [], list(self.requires)
        while todo:
            name = todo.pop(0)
            if name not in out and name != self.name:
                out.append(name)
                todo += list(ASSIGNMENTS[name].requires)
        return out

    @property
    def folder(self) -> Path:
        return COURSE / self.name

    @property
    def sheet(self) -> Path:
        return self.folder / "sheet.md"

    def tests(self, hidden: bool = True) -> list[Path]:
        names = ["test_public.py"] + (["test_hidden.py"] if hidden else [])
        return [self.folder / n for n in names if (self.folder / n).exists()]

    def sources(self) -> list[Path]:
        """Every file that may hold this assignment's regions: library files, the notebook, the sheet."""
        return [ROOT / p for p in self.library] + [ROOT / "notebooks" / f"{self.notebook}.py", self.sheet]

    def regions(self) -> list[Region]:
        return [r for p in self.sources() if p.exists() for r in find_regions(p) if r.assignment == self.name]


ASSIGNMENTS = {a.name: a for a in [
    Assignment("cache", "The KV cache: store, mask by position, decode",
               ("nanollm/storage.py", "nanollm/attention.py"), "00_nanollm_kv_cache"),
    Assignment("baselines", "The four baselines: StreamingLLM, H2O, SnapKV, AdaKV",
               ("methods/streaming_llm.py", "methods/h2o.py", "methods/snapkv.py", "methods/adakv.py"),
               "01_baselines", requires=("cache",)),
    Assignment("scissorhands", "Scissorhands: counting unimportance in a history window",
               ("methods/scissorhands.py",), "02_scissorhands", requires=("cache", "baselines")),
    Assignment("tensor_attention", "Tensor attention: attention over pairs, factored",
               ("methods/tensor_attention/attention.py",), "03_tensor_attention", requires=("cache",)),
    Assignment("critical_kv", "CriticalKV: the output perturbation, its bound, two-stage selection",
               ("methods/critical_kv.py",), "04_perturbation_selection", requires=("cache", "baselines")),
    Assignment("chunkkv", "ChunkKV: keep whole chunks", ("methods/chunkkv.py",), "05_chunkkv",
               requires=("cache", "baselines")),
    Assignment("kvreviver", "KVReviver: a count sketch of evicted tokens",
               ("methods/kvreviver_sketch.py", "kernels/count_sketch.py"), "06_kvreviver", interpreter=True,
               requires=("cache", "baselines")),
    Assignment("kernels", "Split-K decode attention in Triton",
               ("kernels/decode_attention.py", "kernels/count_sketch.py", "kernels/tensor_decode.py"), "07_kernels",
               interpreter=True, requires=("cache",)),
]}


def get(name: str) -> Assignment:
    """The assignment called ``name``, or a one-line error listing the names."""
    if name not in ASSIGNMENTS:
        raise SystemExit(f"error: no assignment {name!r}; choose one of: {', '.join(ASSIGNMENTS)}")
    return ASSIGNMENTS[name]


def scanned_files() -> list[Path]:
    """Every file of the repository that may hold a region: Python under ``SCANNED``, and the sheets."""
    files = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py")) if "__pycache__" not in p.parts]
    return files + sorted(COURSE.glob("*/sheet.md"))


def command_line(main):
    """A course command's ``main``: a refusal (``SystemExit("error: ...")``) is printed as that one line on
    stderr and ends with exit status 2, as the library's command lines do; Ctrl-C or SIGTERM ends in
    ``error: interrupted`` (exit status 130) once the command's cleanups (``finally`` blocks: temporary folders,
    the grader's processes) have run."""
    def run(argv=None):
        on_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, interrupted) if on_main else None
        try:
            return main(argv)
        except KeyboardInterrupt:
            sys.stderr.write("error: interrupted\n")
            raise SystemExit(130) from None
        except SystemExit as e:
            if isinstance(e.code, str) and e.code.startswith("error: "):
                sys.stderr.write(" ".join(e.code.split()) + "\n")
                raise SystemExit(2) from None
            raise
        finally:
            if on_main:
                signal.signal(signal.SIGTERM, previous)
    run.__doc__, run.__name__ = main.__doc__, main.__name__
    return run


def refuse(message: str):
    """argparse's errors as the course's one ``error:`` line (exit status 2)."""
    raise SystemExit(f"error: {message}")


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A command's parser: its docstring's first paragraph the description, the rest the epilog (as written),
    errors as ``refuse``'s one line."""
    p = argparse.ArgumentParser(prog=prog, description=doc.strip().split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(doc.strip().split("\n\n")[1:]))
    p.error = refuse
    return p


def interrupted(signum, frame):
    raise KeyboardInterrupt                 # SIGTERM cleans up as Ctrl-C does


def check_name(path: Path, flag: str) -> None:
    """Every name in ``path`` fits the file system (``NAME_MAX`` bytes of the nearest existing folder, 255 on
    most): checked before any work, so a longer one is a line naming the flag, not a traceback from the first
    ``stat``."""
    base = next((p for p in [path, *path.parents] if os.path.isdir(p)), Path("/"))
    try:
        longest = os.pathconf(base, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):         # no pathconf (Windows), or no answer
        longest = 255
    for name in path.parts:
        if len(os.fsencode(name)) > longest:
            raise SystemExit(f"error: {flag}: the name {name[:40]}... has {len(os.fsencode(name))} bytes; this file "
                             f"system takes at most {longest}")
