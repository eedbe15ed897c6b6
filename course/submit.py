"""
Pack a student's work on one assignment for hand-in: the graded files only, not the whole copy.

    python -m course.submit cache                       # in the student copy: writes cache-submission.zip
    python -m course.submit cache --copy ~/hw-cache --out ~/cache-submission.zip

The pack holds the assignment's library files (where its tasks are written), its ``adapters.py`` (a student
who restructured the code points them at it), ``writeup.md`` (the written answers) and ``measure/figure.png``
(the figure of ``python -m course.measure``, which the writeup shows), at their paths in the copy, and
``course-submission.json``, which names the assignment and the files. Upload it to Gradescope as it is. The
grader lays the pack over a pristine student copy of the assignment, made from the grader's own reference files
(``lay_over``), and grades that: nothing else the student changed reaches the grade, and a pack is a few
kilobytes where the whole copy is tens of megabytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from .assignments import ASSIGNMENTS, Assignment, command_line, get, refuse

MANIFEST = "course-submission.json"
STUB = re.compile(r"raise NotImplementedError\(.*#\s*your code here")     # a task still as handed out


def graded_files(assignment: Assignment) -> list[str]:
    """The files a pack holds, relative to the copy: the library files, the adapters, then what the written part
    needs, the answers and the figure of ``python -m course.measure`` (those two only where they are)."""
    return [*assignment.library, f"course/{assignment.name}/adapters.py", *written_files(assignment)]


def written_files(assignment: Assignment) -> list[str]:
    """The written answers and the measurement's figure that ``writeup.md`` shows."""
    return [f"course/{assignment.name}/writeup.md", f"course/{assignment.name}/measure/figure.png"]


def stubs_left(copy: Path, assignment: Assignment) -> int:
    """How many of the handed-out stubs are still in the copy's library files."""
    return sum(len(STUB.findall((copy / rel).read_text())) for rel in assignment.library if (copy / rel).exists())


def pack(copy: Path, assignment: Assignment, out: Path) -> list[str]:
    """Write the pack of ``copy`` to ``out`` (a new zip file). Returns the files it holds."""
    files = [rel for rel in graded_files(assignment) if (copy / rel).is_file()]
    missing = [rel for rel in graded_files(assignment) if rel not in files and rel not in written_files(assignment)]
    if missing:
        raise SystemExit(f"error: {copy} has no {missing[0]}; is it a student copy of {assignment.name!r}?")
    if out.exists():
        raise SystemExit(f"error: {out} exists; name another --out (nothing is overwritten)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr(MANIFEST, json.dumps({"assignment": assignment.name, "files": files}, indent=1) + "\n")
            for rel in files:
                z.write(copy / rel, rel)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return files


def is_pack(folder: Path) -> bool:
    """Whether ``folder`` is an unpacked pack (it holds the manifest), not a whole student copy."""
    return (folder / MANIFEST).is_file()


def first_link(folder: Path) -> Path | None:
    """The first link inside ``folder``, to a file or to a folder; None if it holds none."""
    for parent, folders, files in os.walk(folder):              # a link to a folder is listed, not followed
        for entry in folders + files:
            if os.path.islink(os.path.join(parent, entry)):
                return Path(parent, entry)
    return None


def lay_over(pack_dir: Path, name: str, into: Path) -> Path:
    """A pristine student copy of ``name`` (``course.handout``, from this checkout's files) in ``into`` with the
    pack's graded files in place of its own. Only the files ``graded_files`` names are taken from the pack. A
    pack holding a link is refused: the copy is made as the grader's user, before the room, and a link (a
    folder ``methods`` -> ``/proc/self/cwd/methods``) would read the grader's own solutions into it."""
    from . import handout
    if (link := first_link(pack_dir)) is not None:
        raise SystemExit(f"error: {pack_dir} holds a link, {link.relative_to(pack_dir)} -> {os.readlink(link)}: "
                         "a pack of python -m course.submit holds plain files only")
    assignment = get(name)
    try:
        manifest = json.loads((pack_dir / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {pack_dir / MANIFEST}: not a pack's manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("assignment") != name:
        of = manifest.get("assignment") if isinstance(manifest, dict) else None
        raise SystemExit(f"error: {pack_dir} is a pack of {of!r}, not of {name!r}")
    handout.student_copy(assignment, into)
    for rel in graded_files(assignment):
        src = pack_dir / rel
        if src.is_file() and not src.is_symlink():
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, into / rel)
    return into


@command_line
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m course.submit", description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="assignments: " + ", ".join(ASSIGNMENTS))
    p.error = refuse
    p.add_argument("assignment", help="which assignment: " + ", ".join(ASSIGNMENTS))
    p.add_argument("--copy", type=Path, default=Path("."), help="the student copy (default: this folder)")
    p.add_argument("--out", type=Path, default=None,
                   help="the pack to write, a new file (default: ASSIGNMENT-submission.zip in the copy's folder)")
    args = p.parse_args(argv)
    assignment = get(args.assignment)
    copy = args.copy.expanduser().resolve()
    out = (args.out.expanduser() if args.out else copy / f"{assignment.name}-submission.zip").resolve()
    files = pack(copy, assignment, out)
    left = stubs_left(copy, assignment)
    print(f"wrote {out}: {len(files)} files ({', '.join(files)})")
    if left:
        print(f"note: {left} stub(s) of the handed-out tasks are still in the library files; their tests will fail")
    writeup, figure = written_files(assignment)
    if writeup not in files:
        print(f"note: no {writeup}: hand in the written answers as your instructor says")
    if figure not in files:
        print(f"note: no {figure}: question 3 wants it (python -m course.measure {assignment.name})")


if __name__ == "__main__":
    sys.exit(main())
