"""
The lesson in a student copy: a notebook cell that needs an unfinished task says which, and the others run.

In the reference notebook such a cell names the tasks in its cell tags (``# %% tags=["needs:window_vote"]``);
``python -m course.handout NAME`` turns them, in the student's notebook, into a call and a note at its top::

    from course.lesson import needs; needs("baselines", "sinks_and_recent", "window_vote")
    # runs once tasks sinks_and_recent (sheet task 1) and window_vote (sheet task 3) are done

``needs`` raises ``NotImplementedError("runs once task window_vote (sheet task 3) is done: ...")`` while
the task's code in the student's library still holds the stub the copy was handed out with
(``course.markers.strip`` writes it), and does nothing once the stub is gone. More: course/README.md,
section "The course's files".
"""

from __future__ import annotations

import re
from pathlib import Path

from .assignments import ROOT, get
from .markers import NOT_HANDED_OUT, find_regions

NEEDS = "needs:"                     # the prefix of a cell tag naming a task: "needs:window_vote"


def needed(tags: list[str]) -> list[str]:
    """The tasks a cell's tags say it needs, in order: ["needs:a", "x", "needs:b"] -> ["a", "b"]."""
    return [t[len(NEEDS):] for t in tags if t.startswith(NEEDS)]
DEF = re.compile(r"^(?P<indent>[ \t]*)(?:async[ \t]+)?(?:def|class)[ \t]+(?P<name>\w+)")


def stub(assignment: str, task: str) -> re.Pattern:
    """The start of the line ``course.markers.strip`` writes in place of a task's region:
    ``raise NotImplementedError('<assignment>, task <task>: <hint>')``."""
    return re.compile(r"^[ \t]*raise NotImplementedError\(['\"]" + re.escape(f"{assignment}, task {task}: "))


def unfinished(assignment: str, task: str, root: Path = ROOT) -> list[tuple[Path, int]]:
    """(file, 1-based line) of every stub of ``task`` still in the library files of ``root``: none once the
    student has written the task's code."""
    pattern = stub(assignment, task)
    return [(root / rel, n) for rel in get(assignment).library if (root / rel).exists()
            for n, line in enumerate((root / rel).read_text().splitlines(), 1) if pattern.search(line)]


def enclosing(lines: list[str], n: int) -> list[str]:
    """The names of the functions and classes around 1-based line ``n``, innermost first."""
    indent, names = len(lines[n - 1]) - len(lines[n - 1].lstrip()), []
    for line in reversed(lines[:n - 1]):
        m = DEF.match(line)
        if m and len(m["indent"]) < indent:
            names.append(m["name"])
            indent = len(m["indent"])
    return names


def sheet_number(assignment: str, task: str, root: Path = ROOT) -> int | None:
    """The number of ``task`` in the sheet's list of tasks: the item that says "task `TASK`", else the first
    item whose opening line names, in backticks, the task or the function its code sits in (its stub in a
    copy, its region in the reference). None where no item does."""
    sheet = root / "course" / assignment / "sheet.md"
    if not sheet.exists():
        return None
    tasks = sheet.read_text().split("## Tasks", 1)[-1].split("\n## ", 1)[0]
    items = re.findall(r"^(\d+)\. (.*(?:\n(?!\d+\. ).*)*)", tasks, flags=re.M)      # (number, the item's text)
    for number, text in items:
        if f"task `{task}`" in text:
            return int(number)
    places = unfinished(assignment, task, root) + [
        (r.path, r.begin) for rel in get(assignment).library if (root / rel).exists()
        for r in find_regions(root / rel) if r.assignment == assignment and r.task == task]
    names = [task] + [name for path, n in places for name in enclosing(path.read_text().splitlines(), n)[:1]]
    for name in names:
        named = re.compile(r"`(?:\w+\.)*" + re.escape(name) + r"(?:\(\))?`")
        for number, text in items:
            if named.search(text.split("\n", 1)[0]):
                return int(number)
    return None


def describe(assignment: str, tasks: list[str], root: Path = ROOT) -> str:
    """'task a (sheet task 1)', or 'tasks a (sheet task 1) and b (sheet task 3)'."""
    named = []
    for task in tasks:
        number = sheet_number(assignment, task, root)
        named.append(task if number is None else f"{task} (sheet task {number})")
    text = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1]
    return ("task " if len(tasks) == 1 else "tasks ") + text


def needs(assignment: str, *tasks: str, root: Path = ROOT) -> None:
    """Raise ``NotImplementedError`` naming each of ``tasks`` whose code in ``root``'s library is still the
    handed-out stub; nothing once they are all done."""
    todo = {t: unfinished(assignment, t, root) for t in tasks}
    todo = {t: places for t, places in todo.items() if places}
    later = [t for t, places in todo.items()
             if any(NOT_HANDED_OUT in path.read_text().splitlines()[n - 1] for path, n in places)]
    if later:
        raise NotImplementedError(
            f"needs assignment {assignment}'s {describe(assignment, later, root)}, not handed out yet: this copy "
            "holds a stub of its code (the cell's output in the committed notebook shows what it prints)")
    if todo:
        where = sorted({str(path.relative_to(root)) for places in todo.values() for path, _ in places})
        raise NotImplementedError(
            f"runs once {describe(assignment, list(todo), root)} {'is' if len(todo) == 1 else 'are'} done: "
            f"{', '.join(where)} still raise{'s' if len(where) == 1 else ''} NotImplementedError "
            f"(course/{assignment}/sheet.md, Tasks); write {'it' if len(todo) == 1 else 'them'}, then run this cell "
            "again")


def call(assignment: str, tasks: list[str], root: Path = ROOT) -> list[str]:
    """The two lines a student copy's cell starts with where its tags say ``needs:...``: the call, and the note."""
    names = ", ".join(f'"{t}"' for t in tasks)
    return [f'from course.lesson import needs; needs("{assignment}", {names})',
            f"# runs once {describe(assignment, tasks, root)} {'is' if len(tasks) == 1 else 'are'} done"]
