"""
Check that the Gradescope zips build and grade on the Python of Gradescope's default image.

    python -m course.image_check --python ~/.pyenv/versions/3.10.13/bin/python            # every assignment
    python -m course.image_check cache kernels --python /usr/bin/python3.10

Three steps, each timed, as Gradescope would take them (it needs the package index, so it is not a test):
**resolve** (pip resolves the zip's ``requirements.txt`` for that Python on Linux x86_64, wheels only),
**build** (``setup.sh`` in the unpacked zip, with ``--python`` as ``python3``, into a fresh virtual
environment) and **grade** (each assignment's ``run_autograder`` on the reference: full marks, and on its
untouched student copy: 0). More: course/README.md, section "The course's files".

It prints one line a step and the versions installed, and exits 1 if a step failed. Nothing is written
outside a temporary folder (``--keep`` names one to keep instead) but the file ``--record`` names: the lines,
under the run's provenance (results/gradescope_image.txt is one).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from . import gradescope, handout
from .assignments import ASSIGNMENTS, ROOT, command_line, get, parser

GLIBC = 35          # Ubuntu 22.04's glibc is 2.35: it installs a wheel tagged for any glibc up to it
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC, 4, -1)] + \
            ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]


def run(cmd: list[str], log: Path, **kw) -> tuple[int, float]:
    """Run ``cmd``, its output appended to ``log``; (exit status, seconds)."""
    t0 = time.perf_counter()
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw).returncode
    return rc, time.perf_counter() - t0


def resolve(requirements: Path, work: Path, log: Path) -> tuple[bool, str, float]:
    """Step 1: (ok, "name==version ..." as resolved, seconds)."""
    major, minor = gradescope.IMAGE_PYTHON
    report = work / "resolved.json"
    rc, s = run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                 "--only-binary=:all:", "--python-version", f"{major}.{minor}", "--implementation", "cp",
                 *(arg for tag in PLATFORMS for arg in ("--platform", tag)), "--target", str(work / "target"),
                 "--report", str(report), "-r", str(requirements)], log)
    if rc or not report.exists():
        return False, f"pip exited {rc}", s
    installed = json.loads(report.read_text())["install"]
    names = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in installed)
    return True, " ".join(names), s


def build(source: Path, python: Path, venv: Path, log: Path) -> tuple[bool, str, float]:
    """Step 2: setup.sh with ``python3`` being ``python``; (ok, what the environment holds, seconds)."""
    bin_dir = python.parent                 # its own folder, when python3 there is it: the environment's
    if (bin_dir / "python3").resolve() != python.resolve():     # python then points into Python's prefix, as
        bin_dir = source.parent / "bin"                         # on the image, and the grader's room binds it
        bin_dir.mkdir()
        (bin_dir / "python3").symlink_to(python)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "AUTOGRADER_VENV": str(venv)}
    rc, s = run(["bash", str(source / "setup.sh")], log, env=env, cwd=source)
    if rc:
        return False, f"setup.sh exited {rc}", s
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import platform, torch, numpy, pytest, tqdm; "
                            "print(platform.python_version(), torch.__version__, numpy.__version__, pytest.__version__,"
                            " tqdm.__version__)"], capture_output=True, text=True)
    if probe.returncode:
        return False, probe.stderr.strip().splitlines()[-1], s
    python_v, *versions = probe.stdout.split()
    return True, f"Python {python_v}; torch {versions[0]}, numpy {versions[1]}, pytest {versions[2]}, " \
                 f"tqdm {versions[3]}", s


def grade_one(source: Path, python: Path, submission: Path, results: Path, log: Path) -> tuple[dict | None, float]:
    """run_autograder on ``submission`` with ``python``; (results.json or None, seconds)."""
    env = {**os.environ, "AUTOGRADER_SOURCE": str(source), "AUTOGRADER_SUBMISSION": str(submission),
           "AUTOGRADER_RESULTS": str(results), "AUTOGRADER_PYTHON": str(python)}
    rc, s = run(["bash", str(source / "run_autograder")], log, env=env, cwd=results.parent)
    return (json.loads(results.read_text()) if rc == 0 and results.exists() else None), s


def full_copy(out: Path) -> Path:
    """Every file of the repository, solutions and all: what should get full marks."""
    for rel in handout.repository_files():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, out / rel)
    return out


def student_copy(assignment, out: Path) -> Path:
    """The untouched student copy (what should get 0)."""
    handout.student_copy(assignment, out)
    return out


def say(lines: list[str], line: str) -> None:
    """Print ``line`` and keep it for ``--record``."""
    print(line, flush=True)
    lines.append(line)


def unpack(zip_path: Path, source: Path) -> Path:
    """Unpack a zip as Gradescope does, keeping the files' modes (setup.sh and run_autograder run)."""
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(source)
        for info in z.infolist():
            os.chmod(source / info.filename, (info.external_attr >> 16) & 0o777)
    return source


def check(names: list[str], python: Path, work: Path, lines: list[str]) -> bool:
    """All three steps in the folder ``work``: one environment (every zip pins the same requirements), each
    assignment's zip graded with it; prints a line a step."""
    log = work / "log.txt"
    zips = {name: gradescope.write_zip(get(name), work / "dist") for name in names}
    first = unpack(zips[names[0]], work / "image" / "source")
    ok, said, s = resolve(first / "requirements.txt", work, log)
    image_python = "%d.%d" % gradescope.IMAGE_PYTHON
    say(lines, f"resolve  {'ok' if ok else 'FAILED'}  {s:6.1f} s  for Python {image_python} on Linux x86_64 "
               f"(glibc 2.{GLIBC}), wheels only: {said}")
    if not ok:
        return False
    venv = work / "image" / "venv"
    ok, said, s = build(first, python, venv, log)
    say(lines, f"build    {'ok' if ok else 'FAILED'}  {s:6.1f} s  setup.sh in a fresh environment: {said}")
    if not ok:
        return False
    good, reference = True, full_copy(work / "full")
    for name in names:
        source = unpack(zips[name], work / name / "source")
        for label, copy, full_marks in [("reference", reference, True),
                                        ("untouched", student_copy(get(name), work / name / "copy"), False)]:
            (work / name / label).mkdir()
            results, s = grade_one(source, venv / "bin" / "python", copy, work / name / label / "results.json", log)
            if results is None:
                say(lines, f"grade    FAILED  {s:6.1f} s  {name}, {label}: run_autograder wrote no results")
                good = False
                continue
            if "tests" not in results:                  # not graded: the grader said why
                say(lines, f"grade    FAILED  {s:6.1f} s  {name}, {label} copy: {results.get('output', '')[:300]}")
                good = False
                continue
            total = sum(t["max_score"] for t in results["tests"])
            right = results["score"] == total > 0 if full_marks else results["score"] == 0 and total > 0
            good &= right
            say(lines, f"grade    {'ok' if right else 'FAILED'}  {s:6.1f} s  {name}, {label} copy: "
                  f"{results['score']:g}/{total:g} ({len(results['tests'])} tests)")
    return good


@command_line
def main(argv: list[str] | None = None) -> int:
    p = parser("python -m course.image_check", __doc__)
    p.add_argument("assignments", nargs="*", metavar="ASSIGNMENT",
                   help="the assignments whose zips to grade with the one environment (default: all of them): "
                        + ", ".join(ASSIGNMENTS))
    p.add_argument("--python", required=True, type=Path,
                   help="a Python %d.%d interpreter (the image's python3) to build the environment with"
                        % gradescope.IMAGE_PYTHON)
    p.add_argument("--keep", type=Path, default=None,
                   help="a new folder to do the work in and keep (default: a temporary one, removed)")
    p.add_argument("--record", type=Path, default=None,
                   help="a new file to write the printed lines into, under the run's provenance (default: none)")
    args = p.parse_args(argv)
    names = args.assignments or list(ASSIGNMENTS)
    for name in names:
        get(name)
    python = args.python.expanduser()
    probe = subprocess.run([str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True) if python.is_file() else None
    wanted = "%d.%d" % gradescope.IMAGE_PYTHON
    if probe is None or probe.returncode:
        raise SystemExit(f"error: --python {python}: not a Python interpreter")
    if probe.stdout.strip() != wanted:
        raise SystemExit(f"error: --python {python} is Python {probe.stdout.strip()}; the image's is {wanted}")
    for flag, path in [("--keep", args.keep), ("--record", args.record)]:
        if path is not None and path.exists():
            raise SystemExit(f"error: {flag} {path} exists; name a new one (nothing is overwritten)")
    if args.record is not None and not args.record.parent.is_dir():
        raise SystemExit(f"error: --record {args.record}: no folder {args.record.parent}")
    from nanollm.cli.provenance import header, provenance
    prov = provenance(argv, prog="python -m course.image_check", threads="-", dtype="-", seed=None)   # the code now
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="image-check-") as tmp:
        work = Path(tmp)
        if args.keep is not None:
            args.keep.mkdir(parents=True)
            work = args.keep.resolve()
        ok = check(names, python.resolve(), work, lines)
        if not ok:                                  # the log's end says why
            print("".join((work / "log.txt").read_text().splitlines(keepends=True)[-20:]), file=sys.stderr)
    if args.record is not None:
        args.record.write_text(header(prov) + "\n" + "\n".join(lines) + "\n")
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
