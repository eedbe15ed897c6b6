"""
Package an assignment's autograder for Gradescope.

    python -m course.gradescope cache --out dist        # writes dist/cache-autograder.zip

The zip is the instructors' alone (it holds the reference solution; students see none of its files):

* ``setup.sh``: run once when Gradescope builds the image; installs ``course/autograder_requirements.txt``
  (pinned for Gradescope's default image, Ubuntu 22.04 with Python 3.10) in a virtual environment every user
  can read;
* ``run_autograder``: run for each submission; grades ``/autograder/submission`` with the hidden tests into
  ``/autograder/results/results.json`` (``AUTOGRADER_SOURCE``, ``AUTOGRADER_SUBMISSION``,
  ``AUTOGRADER_RESULTS`` and ``AUTOGRADER_PYTHON`` change its paths);
* ``grader/``: the grader, the assignment's adapters, its public and hidden tests and the reference library,
  readable by root alone once ``run_autograder`` runs;
* ``README.md``: how to upload it. More: course/README.md, section "The course's files".
"""

from __future__ import annotations

import os
import sys
import tempfile
import zipfile
from pathlib import Path

from .assignments import ASSIGNMENTS, ROOT, Assignment, check_name, command_line, get, parser
from .grade import (
    HIDDEN_VISIBILITY,
    PER_TEST_S,
    RESTART_S,
    RUN_BASE_S,
    check_per_test_s,
    marks_of,
    run_limit_s,
)

GRADER = ("course/__init__.py", "course/grade.py", "course/assignments.py", "course/markers.py",
          "course/oracle.py", "course/model_adapters.py", "course/sandbox/__init__.py", "course/sandbox/confine.py",
          "course/sandbox/remote.py", "course/sandbox/student_process.py", "course/sandbox/jail.py",
          "course/launchers.py", "course/submit.py", "course/handout.py", "course/lesson.py")
# grade.py, what it imports, what the tests use, and what lays a pack (course.submit) over a pristine copy
LIBRARY = ("nanollm", "methods", "kernels")     # the reference library, for the hidden tests' test process
PINS = ROOT / "course" / "autograder_requirements.txt"     # what the grader and the library import, pinned
IMAGE, IMAGE_PYTHON = "Ubuntu 22.04", (3, 10)   # Gradescope's default base image and its python3, the pins' target
TIMEOUT_S = 600          # Gradescope's default autograder timeout (its "Autograder timeout" setting)
MARGIN_S = 60            # of it, left for unpacking the upload, copying it, starting Python and Gradescope's own steps
MEMORY_GB, CPUS = 3, 2   # what the README asks to set: the grade of `cache` peaked at 1.7 GiB RSS (1.5 GiB PSS)


def tests_in(assignment: Assignment) -> int:
    """The public and hidden test functions the grader runs (each under its own time limit)."""
    return sum(len(marks_of(t)) for t in assignment.tests(hidden=True))


def default_per_test_s(assignment: Assignment, timeout_s: float = TIMEOUT_S) -> float:
    """The longest time limit a test may have so that a submission whose every test hangs still ends, with a
    line of feedback for each test, within ``timeout_s`` less ``MARGIN_S`` (``grade.run_limit_s``); at most
    ``grade.PER_TEST_S``, whole seconds."""
    return min(float(PER_TEST_S), float(int((timeout_s - MARGIN_S - RUN_BASE_S) / tests_in(assignment) - RESTART_S)))

SETUP = """\
#!/usr/bin/env bash
# Gradescope runs this once, in the unpacked zip, when it builds the autograder's image: Python and the
# pinned requirements in a virtual environment (run_autograder uses it).
set -euo pipefail
cd "$(dirname "$0")"
umask 022                                   # the student's code runs as nobody, which must read Python
venv="${AUTOGRADER_VENV:-/autograder/venv}"
if ! python3 -m venv "$venv"; then          # the base image lacks Python or its venv module
    apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip
    python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (@MAJOR@, @MINOR@))'; then
    echo "error: setup.sh: requirements.txt pins versions for Python @MAJOR@.@MINOR@ (@IMAGE@, Gradescope's" \
         "default base image), but this image's python3 is" \
         "$("$venv/bin/python" -c 'import platform; print(platform.python_version())'): choose @IMAGE@" >&2
    exit 1
fi
"$venv/bin/pip" install --no-cache-dir --upgrade pip
"$venv/bin/pip" install --no-cache-dir -r requirements.txt
chmod -R o+rX "$venv"                       # and should an image's umask have been stricter
dir="$venv"
while dir="$(dirname "$dir")" && [ "$dir" != / ]; do chmod o+x "$dir"; done
"""

RUN = """\
#!/usr/bin/env bash
# Gradescope runs this for each submission: a student copy of the repository, graded with the hidden tests
# of {name!r}. The paths (environment variables, Gradescope's defaults):
#   AUTOGRADER_SOURCE      the unpacked zip                        (/autograder/source)
#   AUTOGRADER_SUBMISSION  the student's upload                    (/autograder/submission)
#   AUTOGRADER_RESULTS     the results file Gradescope reads       (/autograder/results/results.json)
#   AUTOGRADER_PYTHON      Python with the pinned requirements     (/autograder/venv/bin/python, from setup.sh)
set -euo pipefail
source_dir="${{AUTOGRADER_SOURCE:-/autograder/source}}"
submission="${{AUTOGRADER_SUBMISSION:-/autograder/submission}}"
results="${{AUTOGRADER_RESULTS:-/autograder/results/results.json}}"
python="${{AUTOGRADER_PYTHON:-/autograder/venv/bin/python}}"
[ -n "${{AUTOGRADER_PYTHON:-}}" ] || [ -x "$python" ] || python=python3

# the copy's root: the upload itself, or the one folder inside it that holds the assignment's adapters
root="$submission"
if [ ! -f "$root/course/{name}/adapters.py" ]; then
    found="$(find "$submission" -maxdepth 4 -path "*/course/{name}/adapters.py" -print -quit)"
    [ -z "$found" ] || root="$(dirname "$(dirname "$(dirname "$found")")")"
fi

# the grader's files (the hidden tests) readable by root alone: the student's code runs as nobody
chmod -R go-rwx "$source_dir"

# grade a scratch copy, so the upload stays as it came; the grade is written in the private scratch folder
# and moved into place after grading, so only the grader's results can reach Gradescope
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/copy" "$(dirname "$results")"
cp -R "$root/." "$work/copy/"
rm -f "$results"
cd "$source_dir/grader"
status=0
"$python" -m course.grade {name} --student "$work/copy" --per-test-s {per_test_s:g} \
    --hidden-visibility {hidden} --json "$work/results.json" \
    2> "$work/stderr" || status=$?
cat "$work/stderr" >&2
why=""
if [ -e "$results" ] || [ -L "$results" ]; then          # written while grading, not by the grader: no grade
    rm -f "$results"
    why="a results file appeared while grading (not written by the grader)"
elif [ "$status" -ne 0 ] || [ ! -f "$work/results.json" ]; then     # refused (not a copy of {name!r}?)
    why="$(tail -n 3 "$work/stderr")"
fi
if [ -n "$why" ]; then                                    # say why, score 0
    "$python" -c 'import json, sys; json.dump({{"score": 0, "output": "not graded: " + sys.argv[1]}},
                  open(sys.argv[2], "x"))' "$why" "$results"
else
    mv "$work/results.json" "$results"
fi
"""

README = """\
# Autograder of {name!r}: {title}

Made by `python -m course.gradescope {name}`. Upload this zip as a Gradescope programming
assignment's autograder (an Ubuntu base image); students upload the zip `python -m course.submit {name}` writes
in their copy (their graded files, as the sheet says); a whole student copy (the folder `python -m course.handout
{name}` wrote, with their work), uploaded as it is or zipped in a folder, grades the same.
`setup.sh` installs `requirements.txt` in `/autograder/venv`; `run_autograder` grades each submission with the
public and hidden tests in `grader/` and writes `/autograder/results/results.json` (hidden tests are shown
after the grades are published). The written questions are graded by hand from the sheet's rubric.

Gradescope's settings for it (the assignment's "Autograder settings"):

* **Autograder timeout: {timeout_s:g} s** or more (Gradescope's default is 600 s). Each of the {tests} tests may
  run {per_test_s:g} s; a submission whose every test hangs ends after at most {worst_s:g} s, with a line of
  feedback for each test.
* **Memory: {memory} GB** or more (Gradescope's default, 768 MB, is too little): the grader, its test process and
  the student's process together peaked at 1.7 GiB resident on `cache`, whose tests append 128 MiB to a cache.
* **CPUs: {cpus}** (the grader's processes take turns; more does not speed a grade up much).
* **Base image: {image}**, Gradescope's default, whose `python3` is Python {python_minor}: `requirements.txt` pins
  versions for it (`setup.sh` refuses another Python in one line). The torch it installs is the CPU build, from
  PyTorch's index; setup takes a few minutes.
"""


def requirements() -> str:
    """The zip's ``requirements.txt``: exact versions for the image's Python (``PINS``)."""
    return PINS.read_text()


def pinned(name: str) -> str | None:
    """The version ``requirements()`` pins for the package ``name`` (None if it pins none)."""
    for line in requirements().splitlines():
        package, _, rest = line.partition("==")
        if rest and package.strip() == name:
            return rest.split(";")[0].strip()
    return None


def pinned_interpreter_problem() -> str | None:
    """Why Triton's CPU interpreter could not run the kernels under the pinned Triton and numpy (one line), or
    None (``kernels.interpreter_problem``; imports this repository's ``kernels``)."""
    import kernels
    return kernels.interpreter_problem(pinned("triton") or "", pinned("numpy") or "")


def contents(assignment: Assignment, per_test_s: float | None = None, timeout_s: float = TIMEOUT_S,
             hidden: str = "after_published") -> dict[str, tuple[str | bytes, int]]:
    """Path in the zip -> (content, Unix mode). ``per_test_s``: each test's time limit (default
    ``default_per_test_s``)."""
    per = default_per_test_s(assignment, timeout_s) if per_test_s is None else per_test_s
    major, minor = IMAGE_PYTHON
    setup = SETUP.replace("@MAJOR@", str(major)).replace("@MINOR@", str(minor)).replace("@IMAGE@", IMAGE)
    files = {"setup.sh": (setup, 0o755),
             "run_autograder": (RUN.format(name=assignment.name, per_test_s=per, hidden=hidden), 0o755),
             "requirements.txt": (requirements(), 0o644),
             "README.md": (README.format(name=assignment.name, title=assignment.title, image=IMAGE,
                                         python_minor=f"{major}.{minor}",
                                         timeout_s=timeout_s, tests=tests_in(assignment), per_test_s=per,
                                         worst_s=run_limit_s(tests_in(assignment), per), memory=MEMORY_GB,
                                         cpus=CPUS), 0o644)}
    for rel in [*GRADER, *reference_library(), *(str(p.relative_to(ROOT)) for p in [assignment.folder / "adapters.py",
                                                                                   *assignment.tests(hidden=True)])]:
        files[f"grader/{rel}"] = ((ROOT / rel).read_bytes(), 0o644)
    return files


def reference_library() -> list[str]:
    """The library's Python files (the reference solution): the hidden tests run its policies in the test
    process with the student's function in place of the graded one (oracle.reference)."""
    return sorted(str(f.relative_to(ROOT)) for package in LIBRARY for f in (ROOT / package).rglob("*.py")
                  if "__pycache__" not in f.parts)


def write_zip(assignment: Assignment, out: Path, per_test_s: float | None = None, timeout_s: float = TIMEOUT_S,
              hidden: str = "after_published") -> Path:
    """Write ``out/<name>-autograder.zip`` (a new file; written beside it, then renamed into place)."""
    path = out / f"{assignment.name}-autograder.zip"
    if path.exists():
        raise SystemExit(f"error: {path} exists; name another --out folder (nothing is overwritten)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=out)
        os.close(fd)
    except OSError as e:
        raise SystemExit(f"error: --out {out}: cannot write there ({e.strerror or e})") from None
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            for name, (data, mode) in contents(assignment, per_test_s, timeout_s, hidden).items():
                info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
                info.external_attr, info.compress_type = (0o100000 | mode) << 16, zipfile.ZIP_DEFLATED
                z.writestr(info, data)
        os.rename(tmp, path)
    except OSError as e:
        raise SystemExit(f"error: --out {out}: writing the zip failed ({e.strerror or e})") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


@command_line
def main(argv: list[str] | None = None) -> None:
    p = parser("python -m course.gradescope", __doc__)
    p.add_argument("assignment", help="which assignment: " + ", ".join(ASSIGNMENTS))
    p.add_argument("--out", required=True, type=Path, help="the folder to write <assignment>-autograder.zip into")
    p.add_argument("--timeout-s", type=float, default=TIMEOUT_S,
                   help=f"the autograder timeout you set on Gradescope, in seconds (default {TIMEOUT_S}, Gradescope's "
                        "own): the per-test limit is sized to it")
    p.add_argument("--per-test-s", type=float, default=None,
                   help="one test's time limit in seconds (default: the longest that lets a submission whose every "
                        f"test hangs end within --timeout-s less {MARGIN_S} s, at most {PER_TEST_S})")
    p.add_argument("--hidden-visibility", choices=HIDDEN_VISIBILITY, default=HIDDEN_VISIBILITY[0],
                   help="when students see the hidden tests' results: once you publish the grades (default), or "
                        "once the due date has passed")
    args = p.parse_args(argv)
    assignment = get(args.assignment)
    if not (args.timeout_s > MARGIN_S + RUN_BASE_S and args.timeout_s < 1e7):
        raise SystemExit(f"error: --timeout-s must be more than {MARGIN_S + RUN_BASE_S} s, got {args.timeout_s:g}")
    if not assignment.tests(hidden=True):
        raise SystemExit(f"error: assignment {assignment.name!r} has no tests")
    if assignment.interpreter and (why := pinned_interpreter_problem()):
        raise SystemExit(f"error: {PINS.relative_to(ROOT)} pins versions under which {why}; every grade of "
                         f"{assignment.name!r} would fail")
    per = default_per_test_s(assignment, args.timeout_s) if args.per_test_s is None else args.per_test_s
    check_per_test_s(per)
    worst = run_limit_s(tests_in(assignment), per)
    if worst + MARGIN_S > args.timeout_s:
        raise SystemExit(f"error: with --per-test-s {per:g}, a submission whose every test hangs runs up to "
                         f"{worst:g} s, past --timeout-s {args.timeout_s:g} less {MARGIN_S} s: Gradescope would stop "
                         "it with no feedback; use a smaller --per-test-s or a larger --timeout-s (set on Gradescope "
                         "too)")
    check_name(args.out.expanduser(), "--out")
    path = write_zip(assignment, args.out.expanduser().resolve(), per, args.timeout_s, args.hidden_visibility)
    print(f"wrote {path}: upload it as the autograder of {assignment.name!r}; set Gradescope's autograder timeout to "
          f"{args.timeout_s:g} s or more and its memory to {MEMORY_GB} GB (README.md inside says how)")


if __name__ == "__main__":
    sys.exit(main())
