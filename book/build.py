"""
Build the book: the lessons, their labs, the course sheets and the folders' guides as a website that works
offline, from the committed files (nothing is executed, nothing is fetched)::

    pip install -e ".[book]" && npm ci --prefix book    # once: Sphinx, myst-nb, the theme; MathJax from npm
    python book/build.py                                # writes _build/book/ (open _build/book/index.html)

The pages are the repository's own files, read where they live (``book/pages.py`` lists them): the notebooks
with their committed outputs, figures included, and the Markdown guides. Sphinx turns them into pages with
navigation, search and the equations typeset by MathJax, which the site serves itself. A warning fails the
build, so a link to a page or a section that does not exist cannot reach the site.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
from pathlib import Path

BOOK = Path(__file__).resolve().parent
ROOT = BOOK.parent
sys.path.insert(0, str(ROOT))

from nanollm import cli  # noqa: E402

OUT = ROOT / "_build" / "book"
EXTRA = ["sphinx", "myst_nb", "sphinx_book_theme"]           # pip install -e ".[book]"
MATHJAX = BOOK / "node_modules" / "mathjax" / "es5" / "startup.js"    # npm ci --prefix book


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


def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(prog="python book/build.py", description=__doc__.split("\n\n")[0].strip().rstrip(":") + ".")
    p.add_argument("--out", default=str(OUT),
                   help="the folder to write the site to: new, empty, or one this command wrote before "
                        "(default _build/book)")
    args = p.parse_args(argv)
    with cli.errors(args.debug):
        out = cli.output_folder(args.out, "--out", may_hold=is_a_book)
        if lacks := missing():
            cli.fail("the book needs " + " and ".join(lacks))
        from sphinx.cmd.build import build_main
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix="book-doctrees-") as doctrees:    # Sphinx's working files
            code = build_main(["-b", "html", "-c", str(BOOK), "-E", "-a", "-W", "--keep-going", "-q",
                               "-d", doctrees, str(ROOT), str(out)])
        if code:
            cli.fail("the book did not build (Sphinx's messages are above; a warning fails the build)")
        pages = sum(1 for _ in out.rglob("*.html"))
        print(f"wrote {pages} pages to {out} in {time.time() - t0:.1f} s: open {out / 'index.html'}")


if __name__ == "__main__":
    main()
