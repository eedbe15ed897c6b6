"""The labs' first cell, ``from preamble import TINY``, runs the lessons' preamble (``notebooks/preamble.py``:
the repository importable, ``TINY``, one thread and a fixed seed) from here, the folder Jupyter runs a lab in."""

from __future__ import annotations

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "lessons_preamble", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "preamble.py"))
_lessons = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_lessons)

ROOT, TINY = _lessons.ROOT, _lessons.TINY
