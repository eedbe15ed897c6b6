"""
Build the book: the lessons, their labs, the course sheets and the folders' guides as a website that works
offline, from the committed files (nothing is executed, nothing is fetched)::

    pip install -e ".[book]" && npm ci --prefix book    # once: Sphinx, myst-nb, the theme; MathJax from npm
    python book/build.py                                # writes _build/book/ (open _build/book/book/index.html)

The pages are the repository's own files, read where they live (``book/pages.py`` lists them): the notebooks
with their committed outputs, figures included, and the Markdown guides. Sphinx turns them into pages with
navigation, search and the equations typeset by MathJax, which the site serves itself. A warning fails the
build, so a link to a page or a section that does not exist cannot reach the site.

The build writes nothing but ``--out``. Every page is checked before Sphinx reads one (a regular file of a
page's size: a FIFO would hang the build, a link to /dev/zero fill the memory). The site is built in a private
folder beside ``--out``, with Sphinx's working files, myst-nb's ``jupyter_execute`` and the temporary files
inside it; only a finished site is moved to ``--out``, and the private folder is removed whatever happens (a
failure, a full disk, Ctrl-C), so a failed build leaves ``--out`` as it was. A notebook output that a browser
would run (HTML, JavaScript) is shown as text instead, and the build says so (``book/reader.py``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

BOOK = Path(__file__).resolve().parent
ROOT = BOOK.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BOOK))                  # pages.py, reader.py

from pages import PAGES  # noqa: E402

from nanollm import cli  # noqa: E402
from nanollm.io.files import read_text  # noqa: E402

OUT = ROOT / "_build" / "book"
EXTRA = ["sphinx", "myst_nb", "sphinx_book_theme"]           # pip install -e ".[book]"
MATHJAX = BOOK / "node_modules" / "mathjax" / "es5" / "startup.js"    # npm ci --prefix book
MAX_PAGE_MB = 64        # a page read whole; the largest, a lab with its figures, is about 1.2 MB


def missing() -> list[str]:
    """What the book needs and this machine lacks, by the command that installs it."""
    lacks = []
    if any(importlib.util.find_spec(name) is None for name in EXTRA):
        lacks.append('its Python packages (pip install -e ".[book]")')
    if not MATHJAX.is_file():
        lacks.append("MathJax (npm ci --prefix book)")
    return lacks


def is_a_book(folder: Path) -> bool:
    """A folder an earlier build wrote (Sphinx leaves its .buildinfo there): it may be written over."""
    return (folder / ".buildinfo").is_file()


def page_files(source: Path) -> list[Path]:
    """The files the book renders from the folder ``source`` (``PAGES``; pathlib's ``*`` matches hidden names
    too, as Sphinx's does)."""
    return sorted({path for pattern in PAGES for path in source.glob(pattern)})


def check_pages(source: Path) -> None:
    """Every page, before Sphinx reads any: a regular file (a FIFO or a device is refused by kind before a
    byte is read), at most ``MAX_PAGE_MB``, UTF-8; a notebook one that nbformat reads. A notebook output that a
    browser would run is named in one line per notebook (the page shows it as text: ``reader.show_as_data``)."""
    texts = {path: read_text(path, "book page", MAX_PAGE_MB) for path in page_files(source)}
    import reader  # nbformat: after the checks that need nothing
    for path, text in texts.items():
        if path.suffix == ".ipynb":
            if dropped := reader.show_as_data(reader.parse(text, str(path))):
                print(f"book: {path.relative_to(source)}: {len(dropped)} output(s) a browser would run "
                      f"({', '.join(sorted(set(dropped)))}) shown as text instead")


def run_sphinx(source: Path, site: Path, doctrees: Path) -> None:
    """Sphinx's HTML build of ``source`` into ``site`` (every page, a fresh environment, warnings as errors).
    Its own errors become one line; its warnings are printed as they come, one line each."""
    from sphinx._cli.util.colour import disable_colour, terminal_supports_colour  # as sphinx-build does
    from sphinx.application import Sphinx
    from sphinx.errors import SphinxError
    from sphinx.util.docutils import docutils_namespace, patch_docutils
    if not terminal_supports_colour():
        disable_colour()                            # no colour codes in a log or a pipe
    try:
        with patch_docutils(BOOK), docutils_namespace():
            app = Sphinx(source, BOOK, site, doctrees, "html", status=None, warning=sys.stderr, freshenv=True,
                         warningiserror=True)
            app.build(force_all=True)
    except SphinxError as e:                        # an extension's handler failed (orig_exc: what it raised)
        cli.fail(f"the book did not build: {getattr(e, 'orig_exc', None) or e}")
    if app.statuscode:
        cli.fail("the book did not build (Sphinx's warnings are above; a warning fails the build)")


def nearest_folder(path: Path) -> Path:
    """The nearest folder above ``path`` that exists (where a new ``path`` would be made)."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    return parent


def move_into_place(site: Path, out: Path, old: Path) -> None:
    """``site`` renamed to ``out``; an earlier ``out`` (a book, or an empty folder) is first moved aside to
    ``old`` (removed with the private folder), and put back if the rename fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        os.rename(out, old)
    try:
        os.rename(site, out)
    except BaseException:
        if old.exists() and not out.exists():
            os.rename(old, out)
        raise


def build(source: Path, out: Path) -> int:
    """The book of the pages under ``source`` (the repository; a test's small one) written to ``out``, a
    folder ``main`` checked. Returns the number of pages written. Everything the build writes but the site
    goes to a private folder beside ``out``, removed at the end, whatever happens."""
    check_pages(source)
    work = Path(tempfile.mkdtemp(prefix=".book-build-", dir=nearest_folder(out)))
    saved = tempfile.tempdir
    try:
        (work / "tmp").mkdir()
        tempfile.tempdir = str(work / "tmp")        # Sphinx's and docutils' temporary files
        run_sphinx(source, work / "site", work / "doctrees")   # myst-nb writes work/jupyter_execute beside it
        tempfile.tempdir = saved
        move_into_place(work / "site", out, work / "old")
    finally:
        tempfile.tempdir = saved
        shutil.rmtree(work, ignore_errors=True)
    return sum(1 for _ in out.rglob("*.html"))


def main(argv: list[str] | None = None, source: Path = ROOT) -> None:
    p = cli.ArgumentParser(prog="python book/build.py", description=__doc__.split("\n\n")[0].strip().rstrip(":") + ".")
    p.add_argument("--out", default=str(OUT),
                   help="the folder to write the site to: new, empty, or one this command wrote before "
                        "(default _build/book)")
    args = p.parse_args(argv)
    with cli.errors(args.debug):
        out = cli.output_folder(args.out, "--out", may_hold=is_a_book)
        cli.not_an_input(out, [], "--out")          # not in the bundled checkpoints, however it is spelled
        target = Path(os.path.realpath(out))        # a link to a folder: the folder is replaced
        if os.path.ismount(target):
            cli.fail(f"--out {out} is a mount point; give a folder inside it (the site is built beside --out, "
                     "then moved into place)")
        if lacks := missing():
            cli.fail("the book needs " + " and ".join(lacks))
        t0 = time.time()
        pages = build(source, target)
        print(f"wrote {pages} pages to {out} in {time.time() - t0:.1f} s: open {out / 'book' / 'index.html'}")


if __name__ == "__main__":
    main()
