"""
How the book reads a committed notebook: as Jupyter wrote it, except that a code cell written collapsed
(``metadata.jupyter.source_hidden``: an exercise's answer, see ``notebooks/build.py``) is shown collapsed in
the book too, its output with it (myst-nb's ``hide-cell`` tag: the reader opens it with a click; the output
of an answer's check can state the answer).
"""

from __future__ import annotations

import nbformat


def read_notebook(text: str) -> nbformat.NotebookNode:
    notebook = nbformat.reads(text, as_version=4)
    for cell in notebook.cells:
        if cell.get("metadata", {}).get("jupyter", {}).get("source_hidden"):
            tags = cell.metadata.setdefault("tags", [])
            if "hide-cell" not in tags:
                tags.append("hide-cell")
    return notebook
