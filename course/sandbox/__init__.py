"""
The grader's sandbox: where a student's code runs, apart from the tests that judge it.

    confine.py          the limits and the room a graded process gets (``confine.start``, ``room``)
    jail.py             the room itself: a private file system and namespaces (run as a program)
    remote.py           the tests' stand-in for the adapters, which asks the student's process
    student_process.py  the student's process: it imports the copy and answers the stand-in

``course/grade.py`` drives them; course/README.md, section "Threat model", says what they hold off.
"""
