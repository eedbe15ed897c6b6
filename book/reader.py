"""
How the book reads a committed notebook: as Jupyter wrote it, with two changes to what the page shows.

* A code cell written collapsed (``metadata.jupyter.source_hidden``: an exercise's answer, see
  ``notebooks/build.py``) is shown collapsed in the book too, its output with it (myst-nb's ``hide-cell`` tag:
  the reader opens it with a click; the output of an answer's check can state the answer). A lesson's set-up
  cell (tagged ``setup``: its imports) is shown collapsed too, its output in sight.
* An output is data, shown as data: text (escaped) or a picture (an ``<img>``). myst-nb would copy an output
  of type ``text/html``, ``text/markdown`` (which may hold HTML) or ``application/javascript`` into the page as
  it is, and the reader's browser would run any script in it. The committed lessons hold no such output (only
  text and PNG figures), so every output of another type than ``SHOWN`` loses it: the output keeps its other
  types (a text/plain stand-in, usually), or, having none, shows the dropped content as plain text.
"""

from __future__ import annotations

import json

import nbformat

SHOWN = ("text/plain", "image/png", "image/jpeg", "image/gif")     # types myst-nb shows as text or <img>


def parse(text: str, name: str = "the notebook") -> nbformat.NotebookNode:
    """``text`` read as a Jupyter notebook (version 4), or a one-line ValueError naming ``name``."""
    try:
        notebook = nbformat.reads(text, as_version=4, capture_validation_error={})
        nbformat.validate(notebook)
    except Exception as e:                   # nbformat's errors have no common base: JSON, schema, version
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"{name}: not a notebook nbformat can read ({why})") from None
    return notebook


def show_as_data(notebook: nbformat.NotebookNode) -> list[str]:
    """Drop from every output the types a browser would run or render as markup (anything not in ``SHOWN``);
    an output left with nothing shows the dropped content as plain text. Also drop the notebook's widget
    state (a script block). Returns the dropped types, one entry per output changed."""
    dropped = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            unsafe = [kind for kind in data if kind not in SHOWN]
            if not unsafe:
                continue
            removed = {kind: data.pop(kind) for kind in unsafe}
            if not data:
                data["text/plain"] = "\n".join(value if isinstance(value, str) else json.dumps(value, indent=1)
                                               for value in removed.values())
            dropped.append(", ".join(unsafe))
    if notebook.metadata.pop("widgets", None) is not None:
        dropped.append("widget state")
    return dropped


def read_notebook(text: str) -> nbformat.NotebookNode:
    """myst-nb's reader for the book's notebooks (``nb_custom_formats`` in ``conf.py``)."""
    notebook = parse(text)
    show_as_data(notebook)
    for cell in notebook.cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.get("metadata", {}).get("jupyter", {}).get("source_hidden"):
            hide = "hide-cell"                   # an exercise's answer: its code and its output
        elif "setup" in tags:
            hide = "hide-input"                  # a lesson's first cell: imports; what it prints stays in sight
        else:
            continue
        tags = cell.metadata.setdefault("tags", [])
        if hide not in tags:
            tags.append(hide)
    return notebook
