"""
Sphinx's settings for the book (``python book/build.py``): the committed lessons, labs, course sheets and the
folders' guides, read from where they live in the repository (the source folder is the repository's root;
only the files named in ``PAGES`` are read), rendered with their committed outputs (nothing is executed).

Offline by construction: MathJax is served from the site (its runtime and fonts, copied from the npm
package that ``npm ci --prefix book`` installs), and nothing that would load a script, stylesheet or font
from outside the site is enabled (``tests/book/test_book.py`` checks every built file).
"""

from __future__ import annotations

import posixpath
import re
import shutil
import sys
from pathlib import Path

from sphinx import addnodes
from sphinx.transforms.post_transforms import SphinxPostTransform
from sphinx.util.nodes import make_refnode

BOOK = Path(__file__).resolve().parent
sys.path.insert(0, str(BOOK))                              # reader.py: how a notebook is read
from pages import PAGES  # noqa: E402  (the files the book renders)

MATHJAX = BOOK / "node_modules" / "mathjax" / "es5"          # npm's mathjax@3.2.2 (book/package.json)
# What the site serves of it: the loader, TeX input, HTML output and the hidden MathML that screen readers
# read, the extensions TeX loads on demand (\boldsymbol, ...), and the fonts the output loads, all by their
# path relative to the loader. Not the combined tex-chtml.js: its menu would fetch speech data from a CDN.
MATHJAX_PARTS = ["startup.js", "core.js", "input/tex.js", "input/tex/extensions", "output/chtml.js",
                 "output/chtml/fonts/tex.js", "output/chtml/fonts/woff-v2", "a11y/assistive-mml.js"]

project = "nanoKV: KV-cache compression from scratch"
author = "the nanoKV authors"
copyright = "2026, " + author
root_doc = "book/index"
include_patterns = PAGES
exclude_patterns = ["_build", "**/node_modules", "**/.ipynb_checkpoints"]

extensions = ["myst_nb"]
nb_execution_mode = "off"                      # the committed outputs, as the tests checked them
nb_ipywidgets_js = {}                          # no widget scripts (they would come from a CDN)
nb_custom_formats = {".ipynb": "reader.read_notebook"}     # an exercise's answer stays collapsed
nb_code_prompt_show, nb_code_prompt_hide = "Show the answer", "Hide the answer"    # the only collapsed cells
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3                       # the pages link to each other's sections by their slugs

html_theme = "sphinx_book_theme"
html_title = "nanoKV"
html_theme_options = {"show_toc_level": 2, "use_download_button": False, "use_fullscreen_button": False,
                      "navbar_persistent": []}      # one search field, the sidebar's (not a second in the header)
html_static_path = ["static"]                  # book.css: a wide equation scrolls instead of being cut off
html_css_files = ["book.css"]
html_copy_source = False
html_show_sourcelink = False
mathjax_path = "mathjax/startup.js"             # relative to _static: served by the site itself
# textmacros: \_ and the like inside \text{...}, as LaTeX reads them (n_\text{kv\_head} in 00)
mathjax3_config = {"loader": {"load": ["input/tex", "output/chtml", "a11y/assistive-mml", "[tex]/textmacros"]},
                   "tex": {"packages": {"[+]": ["textmacros"]}}}


HOME = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="0; url=book/index.html">
<title>nanoKV</title></head><body><a href="book/index.html">nanoKV: the book</a></body></html>
"""


def finish(app, exception) -> None:
    """After a build: MathJax's parts into the site's _static/mathjax, and index.html at the site's top
    leading to the home page (book/index.html: the pages keep their repository paths)."""
    if exception is not None or app.builder.format != "html":
        return
    (Path(app.outdir) / "index.html").write_text(HOME)
    out = Path(app.outdir) / "_static" / "mathjax"
    shutil.rmtree(out, ignore_errors=True)             # what an earlier build copied, exactly this build's parts
    for part in MATHJAX_PARTS:
        source, target = MATHJAX / part, out / part
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            shutil.copy2(source, target)


class FolderLinks(SphinxPostTransform):
    """A link to a folder ("notebooks/") lists the folder in a repository viewer. In the book it leads to the
    folder's README where the book has one, else to the home page, whose contents list every folder's pages."""
    default_priority = 8                               # before MyST resolves its links (9)

    def run(self, **kwargs) -> None:
        for node in list(self.document.findall(addnodes.pending_xref)):
            target = node.get("reftarget", "")
            if node.get("reftype") != "myst" or not target.endswith("/") or ":" in target:
                continue
            here = node.get("refdoc", self.env.docname)
            readme = posixpath.normpath(posixpath.join(posixpath.dirname(here), target, "README"))
            page = readme if readme in self.env.all_docs else self.config.root_doc
            node.replace_self(make_refnode(self.app.builder, here, page, None, node[0].deepcopy()))


ANSWER_BEGIN = re.compile(r"^([ \t]*)<!-- BEGIN SOLUTION \[[^\]]*\][^>]*-->[ \t]*$", flags=re.M)
ANSWER_END = re.compile(r"^([ \t]*)<!-- END SOLUTION -->[ \t]*$", flags=re.M)


def collapse_answers(app, docname: str, source: list[str]) -> None:
    """A course sheet's model answers (its ``<!-- BEGIN SOLUTION -->`` regions, which a student copy drops)
    are shown collapsed, as the lessons' answers are: the reader opens one with a click. The file is not
    changed; only the text the book reads."""
    if re.fullmatch(r"course/[^/]+/sheet", docname):
        text = ANSWER_BEGIN.sub(r'\1<details class="answer"><summary>Model answer</summary>\n', source[0])
        source[0] = ANSWER_END.sub(r"\n\1</details>", text)


def setup(app):
    app.add_post_transform(FolderLinks)
    app.connect("source-read", collapse_answers)
    app.connect("build-finished", finish)
