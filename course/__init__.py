"""
The course: one assignment per topic, graded by tests against full attention.

* ``markers``: the solution regions in the library and notebooks (``# BEGIN SOLUTION [name] hint``).
* ``assignments``: the registry, where each assignment's regions, sheet and tests are.
* ``handout``: ``python -m course.handout NAME --out DIR`` writes a student copy (or, with ``--solutions``,
  the instructor pack).
* ``grade``: ``python -m course.grade NAME --student DIR`` runs the public and hidden tests through the
  student's adapters and writes a score table and Gradescope-style JSON.
* ``oracle``: full attention without the library, and the ``points`` decorator.

Each assignment's folder holds its ``sheet.md``, ``adapters.py``, ``test_public.py`` and ``test_hidden.py``.
"""
