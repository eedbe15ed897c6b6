"""
A lesson's exercise: a cell where the learner writes, a check that reads only what they wrote, and the
reference answer out of sight after it. Three code cells, in this order::

    # %%                                      1. the learner's cell: a stub, and one line on what goes there
    my_keep = None                            # replace None: the kept positions, ascending

    # %%                                      2. the check: a function of the learner's answer, called on it
    @exercise("Exercise 1")
    def check_keep(keep):
        library = scissorhands_keep(...).flatten().tolist()
        assert len(keep) == len(library), "m tokens go at a time, as often as it takes to get within B"
        assert keep == library, "of the others, the fewest low flags stay; a tie goes to more attention"
    check_keep(my_keep)

    # %%                                      3. the reference (collapsed on the page): its own names
    reference_keep = ...
    check_keep(reference_keep)

What the check says:

* while an argument is still ``None`` or ``...`` (or a list, tuple or dict holding one), "not answered yet",
  and the notebook goes on, so a fresh lesson runs from top to bottom;
* on a wrong answer, it stops the cell with ``NotRightYet`` and the hint of the first ``assert`` that failed:
  where to look, never the answer;
* on a right one, "right", and what the check function returns, if anything (a sentence on what it means).

The learner's names start with ``my_`` and the reference's with ``reference_``, the rest the same
(``my_keep``, ``reference_keep``): the reference never overwrites an answer, the check never reads the
reference, and the tests (``tests/notebooks/test_exercises.py``) put the reference's answer and a plausible
wrong one in the learner's place and run the check cell again.

A lesson's by-hand build (a method's step written out, then asserted equal to the library) says where its
result first differs with ``where_differs``.

A check that hands the learner's function the lesson's tensors calls it through ``on_copies``: otherwise a
function that writes into its input could change the tensors the check then compares with, and pass. A function
of the lesson's that a check computes with is marked ``@lesson_function``: a learner's cell that defines another
under its name is told so, instead of being checked against their own.
"""

from __future__ import annotations

import functools


class NotRightYet(AssertionError):
    """A learner's answer that fails its exercise's check; the message is the check's hint."""


def unanswered(value) -> bool:
    """Whether ``value`` is still a stub: None or ``...``, or a list, tuple or dict holding one."""
    if value is None or value is Ellipsis:
        return True
    if isinstance(value, dict):
        return any(unanswered(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(v is None or v is Ellipsis for v in value)
    return False


def calls(function, *names: str) -> list[str]:
    """Those of ``names`` that ``function``'s code refers to, sorted: how a check refuses an answer written with
    the library call the exercise asks the learner to do without. Functions defined inside it, and functions of
    the notebook it calls, are read too (a helper of the learner's that made the call was not seen), and an answer
    that is a forbidden function under another name (``my_leaves_at = streaming_keep``) is that function."""
    import functools

    bound = []                                       # a partial's function and the functions it was given
    while isinstance(function, functools.partial):
        bound += [a for a in (*function.args, *function.keywords.values()) if callable(a)]
        function = function.func
    if not hasattr(function, "__code__") and hasattr(type(function).__call__, "__code__"):
        function = type(function).__call__           # an object called as a function: its class's __call__
    space = getattr(function, "__globals__", {})
    forbidden = {id(space[n]): n for n in names if callable(space.get(n))}     # the functions themselves
    found = {forbidden[id(f)] for f in (function, *bound) if id(f) in forbidden}
    todo, seen = [f.__code__ for f in (function, *bound) if hasattr(f, "__code__")], set()
    while todo:
        code = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        found |= set(names) & set(code.co_names)
        found |= {forbidden[id(space[n])] for n in code.co_names if n in space and id(space[n]) in forbidden}
        todo += [c for c in code.co_consts if hasattr(c, "co_names")]                # nested functions, lambdas
        todo += [space[n].__code__ for n in code.co_names if callable(space.get(n)) and hasattr(space[n], "__code__")
                 and getattr(space[n], "__module__", None) == function.__module__]    # the notebook's own
    return sorted(found)


def on_copies(function, *args):
    """``function(*args)`` with each tensor argument copied first (and each tensor in a list or tuple argument),
    so that an answer writing into its input (``kept = attn; kept[~keep] = 0`` makes no copy) changes neither
    the lesson's tensors nor the ones the check compares with; an answer that did write into one is refused,
    with the argument's name."""
    import inspect

    import torch

    def copied(x):
        if isinstance(x, torch.Tensor):
            return x.clone()
        return type(x)(copied(v) for v in x) if isinstance(x, (list, tuple)) else x

    def same(a, b) -> bool:                                      # NaN equals NaN; a list the answer grew differs
        if isinstance(a, torch.Tensor):                          # (x != x: NaN, for any dtype)
            return a.shape == b.shape and bool(((a == b) | (a != a) & (b != b)).all())
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return True

    copies = [copied(a) for a in args]
    said = function(*copies)
    try:
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = [n for n, p in inspect.signature(function).parameters.items() if p.kind in positional]
    except (TypeError, ValueError):
        names = []
    for i, (before, after) in enumerate(zip(args, copies)):
        name = f"`{names[i]}`" if i < len(names) else f"argument {i + 1}"
        assert same(before, after), f"your function changed its input {name} in place: work on a copy " \
            "(`x = y` makes none; `y.clone()`, or an operation that is not in place, does)"
    return said


def where_differs(mine, theirs, dims: tuple[str, ...], rtol: float = 1e-5, atol: float = 1e-6) -> str:
    """Where a tensor built by hand first differs from the library's, in words, for a check's message: its shape
    where the shapes differ, else the first entry that differs (its index named by ``dims``, as
    ``("KV head", "token")``), both values and how many entries differ; "" where none does."""
    import torch

    mine = torch.as_tensor(mine)
    if mine.shape != theirs.shape:
        return f"shape {tuple(mine.shape)} by hand, {tuple(theirs.shape)} in the library"
    if mine.dtype == torch.bool or theirs.dtype == torch.bool:
        off = mine.bool() != theirs.bool()
    else:
        off = ~torch.isclose(mine.double(), theirs.double(), rtol=rtol, atol=atol)
    if not off.any():
        return ""
    first = [int(i) for i in off.nonzero()[0]]
    where = ", ".join(f"{name} {i}" for name, i in zip(dims, first)) or "the value"
    a, b = mine[tuple(first)], theirs[tuple(first)]
    shown = (bool(a), bool(b)) if mine.dtype == torch.bool else (f"{float(a):.4g}", f"{float(b):.4g}")
    return f"{where}: {shown[0]} by hand, {shown[1]} in the library ({int(off.sum())} of {off.numel()} entries differ)"


LESSON_FUNCTIONS: dict[str, object] = {}           # name -> the lesson's function a check computes with


def lesson_function(function):
    """Mark a function of the lesson that a check computes its truth with (``@lesson_function`` on its ``def``).
    A learner's cell that defines another function under its name would change what the check compares with,
    so that a wrong answer made with the wrong function passed: the check then says so instead (``exercise``)."""
    LESSON_FUNCTIONS[function.__name__] = function
    return function


def names_read(function) -> set[str]:
    """The global names ``function``'s code reads, in functions and lambdas defined inside it too."""
    names, todo = set(), [function.__code__]
    while todo:
        code = todo.pop()
        names |= set(code.co_names)
        todo += [c for c in code.co_consts if hasattr(c, "co_names")]
    return names


def raised_inside(error: BaseException, answers) -> bool:
    """Whether ``error`` came out of one of the learner's functions among ``answers`` (a bug of theirs, whose
    traceback they need), not out of the check reading what an answer is or gave."""
    codes = {a.__code__ for a in answers if hasattr(a, "__code__")}
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return False


def exercise(title: str):
    """Turn ``check(answer, ...)``, a function whose asserts carry hints, into the exercise's check (see above).
    The check returns nothing, so a cell that ends with it shows only what it printed. An answer of a kind the
    check cannot read (a string for a number, a function that returns None) is not right yet either, with the
    error as the hint; an error raised inside the learner's own function keeps its traceback, and a cell that
    needs an unfinished task (``NotImplementedError``) stops as it would anywhere."""
    def wrap(check):
        @functools.wraps(check)
        def run(*answers):
            if any(unanswered(a) for a in answers):
                print(f"{title}: not answered yet (fill in the cell above, then run this cell again)")
                return
            redefined = sorted(n for n in names_read(check) & set(LESSON_FUNCTIONS)
                               if check.__globals__.get(n) is not LESSON_FUNCTIONS[n])
            if redefined:
                raise NotRightYet(f"{title}: this check computes with the lesson's {', '.join(redefined)}, which "
                                  "your cells define again: give yours another name, and run the lesson's cell "
                                  "that defines it again")
            try:
                said = check(*answers)
            except AssertionError as e:
                raise NotRightYet(f"{title}: not right yet. {e}") from None
            except NotImplementedError:
                raise
            except (TypeError, ValueError, IndexError, KeyError, AttributeError, RuntimeError) as e:
                if raised_inside(e, answers):
                    raise
                raise NotRightYet(f"{title}: not right yet. The check could not read your answer "
                                  f"({type(e).__name__}: {e}): give the kind of value the cell asks for (a "
                                  "function: what it returns)") from None
            print(f"{title}: right." + (f" {said}" if said else ""))
        return run
    return wrap
