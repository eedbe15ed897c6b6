"""
Write an assignment's student copy, or its instructor pack.

    python -m course.handout cache --out ~/hw-cache                 # the student copy
    python -m course.handout cache --solutions --out ~/hw-cache-key # the instructor pack

The student copy is the whole repository (the files git tracks) with this assignment's solution regions
replaced by ``raise NotImplementedError("<hint>")`` (``course.markers``), the topic notebook rebuilt
from its stripped source without outputs, every sheet's model answers removed, and no hidden tests. Every
other line of the library is unchanged, so the rest of the code still reads and runs. Students install it
with the README's two set-up commands, run the notebook, and check themselves with
``python -m course.grade <name>`` (public tests only: the hidden ones are not in the copy).

The instructor pack holds the solution notebook (the committed one, executed with the solutions), the
sheet with its model answers, the adapters, the public and hidden tests, and ``solutions.md``: every
region's file, lines, hint and code, and how to grade.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .assignments import ASSIGNMENTS, ROOT, Assignment, command_line, get
from .markers import find_regions, strip


def repository_files() -> list[str]:
    """The files of the repository, relative to the root: what git tracks plus new files it does not
    ignore (so an uncommitted change is handed out as it is); without git, every file but caches."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split("\n")
        return sorted({f for f in out if f and (ROOT / f).is_file()})
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "__pycache__", ".pytest_cache", ".ipynb_checkpoints"}
        return sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                      if p.is_file() and not skip & set(p.parts) and not any(s.endswith(".egg-info") for s in p.parts))


def notebook_builder():
    """``notebooks/build.py`` as a module (it is a script, not part of a package)."""
    spec = importlib.util.spec_from_file_location("notebook_build", ROOT / "notebooks" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_out(out: Path) -> Path:
    """The output folder, made absolute; a one-line error if it is not empty or lies inside the repository
    (where the repository's own tests and linter would pick the copy up)."""
    out = out.expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"error: {out} exists and is not empty; name a new folder (nothing is overwritten)")
    if out == ROOT or ROOT in out.parents:
        raise SystemExit(f"error: {out} is inside the repository {ROOT}; write the copy outside it")
    return out


def student_copy(assignment: Assignment, out: Path, stub: str = "raise") -> list[Path]:
    """Write the student copy into ``out`` (new or empty). Returns the files that were changed."""
    hidden = {str(p.relative_to(ROOT)) for a in ASSIGNMENTS.values() for p in a.folder.glob("test_hidden.py")}
    notebook = f"notebooks/{assignment.notebook}"
    sources = {str(p.relative_to(ROOT)) for p in assignment.sources()}
    changed = []
    for rel in repository_files():
        if rel in hidden or rel == f"{notebook}.ipynb":     # no hidden tests; the notebook is rebuilt below
            continue
        src, dst = ROOT / rel, out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel in sources and any(r.assignment == assignment.name for r in find_regions(src)):
            dst.write_text(strip(src, assignment.name, stub=stub))
            changed.append(dst)
        elif src.name == "sheet.md" and src.parent.parent == ROOT / "course" and find_regions(src):
            dst.write_text(strip(src, find_regions(src)[0].assignment))     # no sheet's model answers
            changed.append(dst)
        else:
            shutil.copy2(src, dst)
    source = out / f"{notebook}.py"
    if source.exists():                  # the notebook from its stripped source, without outputs
        import nbformat
        nbformat.write(notebook_builder().read_percent(source), out / f"{notebook}.ipynb")
        changed.append(out / f"{notebook}.ipynb")
    return changed


def instructor_pack(assignment: Assignment, out: Path) -> list[Path]:
    """Write the solution notebook, the sheet with answers, every test and ``solutions.md`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    notebook = ROOT / "notebooks" / f"{assignment.notebook}.ipynb"
    for src in [notebook, assignment.sheet, assignment.folder / "adapters.py", *assignment.tests()]:
        if src.exists():
            shutil.copy2(src, out / src.name)
            written.append(out / src.name)
    lines = [f"# Solutions: {assignment.title}", ""]
    for r in assignment.regions():
        text = r.path.read_text().splitlines()
        fence = "markdown" if r.path.suffix == ".md" else "python"
        lines += [f"## `{r.path.relative_to(ROOT)}`, lines {r.begin + 1}-{r.end - 1}", "", f"Hint: {r.hint}", "",
                  f"```{fence}", *r.body(text), "```", ""]
    lines += ["## Grading", "",
              "From a checkout of the repository (the grader takes its tests from there, never from the copy):", "",
              "```bash", f"python -m course.handout {assignment.name} --out hw   # the copy to hand out",
              f"python -m course.grade {assignment.name} --student SUBMISSION --json results.json", "```", "",
              "The written questions are graded by hand from the rubric in sheet.md; model answers are in it.", ""]
    (out / "solutions.md").write_text("\n".join(lines))
    written.append(out / "solutions.md")
    return written


def write_new_folder(out: Path, write) -> list[Path]:
    """``write(folder)`` into a hidden folder beside ``out``, renamed to ``out`` only once complete: an error
    (a file in the way, a read-only place, a full disk) is one line and leaves nothing behind."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:
        raise SystemExit(f"error: --out {out}: cannot write there ({e.strerror or e})") from None
    try:
        files = write(tmp)
        if out.exists():
            out.rmdir()                                   # check_out let it through: it is empty
        os.rename(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"error: --out {out}: writing the copy failed ({e.strerror or e}); nothing was left "
                         "behind") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / f.relative_to(tmp) for f in files]


@command_line
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m course.handout", description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="assignments: " + "; ".join(f"{a.name} ({a.title})" for a in ASSIGNMENTS.values()))
    p.add_argument("assignment", help="which assignment: " + ", ".join(ASSIGNMENTS))
    p.add_argument("--out", required=True, type=Path,
                   help="a new (or empty) folder outside the repository; nothing is overwritten")
    p.add_argument("--solutions", action="store_true",
                   help="write the instructor pack (solution notebook, sheet with answers, public and hidden "
                        "tests, solutions.md) instead of the student copy")
    p.add_argument("--json", action="store_true", help="print the written files as JSON (for scripts)")
    args = p.parse_args(argv)
    assignment = get(args.assignment)
    out = check_out(args.out)
    if not assignment.regions():
        raise SystemExit(f"error: assignment {assignment.name!r} has no solution regions")
    files = write_new_folder(out, lambda tmp: instructor_pack(assignment, tmp) if args.solutions
                             else student_copy(assignment, tmp))
    if args.json:
        print(json.dumps([str(f) for f in files]))
        return
    if args.solutions:
        print(f"instructor pack for {assignment.name!r} in {out}:")
        for f in files:
            print(f"  {f.relative_to(out)}")
    else:
        print(f"student copy of {assignment.name!r} in {out} ({len(assignment.regions())} regions replaced in "
              f"{len(files)} files):")
        for f in files:
            print(f"  {f.relative_to(out)}")
        print(f"next: cd {out}, read course/{assignment.name}/sheet.md, then "
              f"`python -m course.grade {assignment.name}` runs the public tests")


if __name__ == "__main__":
    sys.exit(main())
