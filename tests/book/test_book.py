"""
The book (``python book/build.py``), built once into a temporary folder from the committed files, then read
twice: as files (every page is there, every internal link and anchor resolves, nothing loads a script,
stylesheet or font from outside the site) and in headless Chromium (the equations typeset, as many as the
sources hold; every image loads; no request leaves the site; each lesson lists the others; search finds each
method's lesson by its name).

They run in the slow tier (``--runslow``) and need the book's extra (``pip install -e ".[book]" && npm ci
--prefix book``) and Chromium (Debian's ``chromium`` package, found on the PATH, or the browser that
``NANOKV_CHROMIUM`` names; Playwright drives it, no browser is downloaded). Where one is missing they skip
with one line saying what; CI installs both and sets ``NANOKV_BOOK=required``, so there a missing one fails.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from course.assignments import ASSIGNMENTS

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"book_{name}", ROOT / "book" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build, pages = load("build"), load("pages")
CHROMIUM = os.environ.get("NANOKV_CHROMIUM") or next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))),
                                                      None)          # NANOKV_CHROMIUM: another Chromium or Chrome
# The lessons, and the word a reader would search for to find each method's lesson.
LESSONS = sorted(Path(p).relative_to(ROOT).as_posix() for p in glob.glob(str(ROOT / "notebooks/[0-9][0-9]_*.ipynb")))
SEARCHES = {"StreamingLLM": "notebooks/01_baselines", "SnapKV": "notebooks/01_baselines",
            "Scissorhands": "notebooks/02_scissorhands", "CriticalKV": "notebooks/04_perturbation_selection",
            "ChunkKV": "notebooks/05_chunkkv", "KVReviver": "notebooks/06_kvreviver"}


def lacking() -> list[str]:
    lacks = build.missing()
    if importlib.util.find_spec("playwright") is None:
        lacks.append('Playwright (pip install -e ".[book]")')
    if CHROMIUM is None:
        lacks.append("Chromium (apt-get install chromium, or NANOKV_CHROMIUM=its path)")
    return lacks


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if lacks := lacking():
        why = "the book's tests need " + " and ".join(lacks)
        if os.environ.get("NANOKV_BOOK") == "required":
            pytest.fail(why + " (NANOKV_BOOK=required)")
        pytest.skip(why)
    out = tmp_path_factory.mktemp("book") / "site"
    done = subprocess.run([sys.executable, "book/build.py", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return out


def sources() -> list[str]:
    """Every file the book renders, by its path in the repository."""
    return sorted({Path(p).relative_to(ROOT).as_posix() for pattern in pages.PAGES
                   for p in glob.glob(str(ROOT / pattern))})


def committed(*patterns: str) -> list[str]:
    """The repository's committed files matching ``patterns`` (git's pathspecs)."""
    return subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


def html_of(site: Path, source: str) -> Path:
    return site / Path(source).with_suffix(".html")


@pytest.mark.slow
def test_every_page_is_built(site):
    """Every committed notebook and Markdown file is a page of the book (a new guide cannot be left out)."""
    assert sorted(set(committed("*.ipynb", "*.md")) - set(sources())) == []
    assert [p for p in sources() if not html_of(site, p).is_file()] == []
    assert 'url=book/index.html' in (site / "index.html").read_text()
    unshown = [f for f in committed("results/*.png") if not (site / "_images" / Path(f).name).is_file()]
    assert unshown == [], "a committed figure no page shows"


@pytest.mark.slow
def test_the_home_page_lists_the_assignments_in_the_lessons_order(site):
    home = (site / "book" / "index.html").read_text()
    listed = list(dict.fromkeys(re.findall(r'href="\.\./course/(\w+)/sheet\.html"', home)))  # page, then sidebar
    assert listed == sorted(ASSIGNMENTS, key=lambda name: ASSIGNMENTS[name].notebook), listed


@pytest.mark.slow
def test_answers_are_collapsed(site):
    """Every exercise's answer in a lesson or lab (a cell the notebook collapses) and every model answer of a
    course sheet is in a closed <details> of its page, output included; a lesson's set-up cell is collapsed
    too, its code only."""
    wrong = []
    for source in sources():
        if source.endswith(".ipynb"):
            cells = json.loads((ROOT / source).read_text())["cells"]
            want = sum(1 for c in cells if c.get("metadata", {}).get("jupyter", {}).get("source_hidden"))
            setup = sum(1 for c in cells if "setup" in c.get("metadata", {}).get("tags", []))   # code only
            kind = '<details class="admonition hide above-input"'
        elif source.startswith("course/") and source.endswith("sheet.md"):
            want, kind = (ROOT / source).read_text().count("<!-- BEGIN SOLUTION"), '<details class="answer">'
            setup = 0
        else:
            continue
        page = html_of(site, source).read_text()
        if page.count(kind) != want + setup or "<details open" in page:
            wrong.append(f"{source}: {want} answers and {setup} set-up cell, {page.count(kind)} collapsed")
        answers = page.split(kind)[1 + setup:]                          # the set-up cell comes first; its output
        for block in answers if kind.startswith("<details class=\"admonition") else []:       # stays in sight
            after = re.split(r'<div class="cell[ "]', block.split("</details>", 1)[1])[0]   # the rest of its cell
            if "cell_output" in after:                                   # the answer's output is inside it too
                wrong.append(f"{source}: an answer's output is outside its collapsed block")
    assert wrong == []


# -- offline: what a built file would load from outside the site ----------------------------------------------

SCHEME = r"(?:https?:)?//"
LOADS = [
    # an element that loads what its src / href names: a script, stylesheet, font (preload), image, frame
    re.compile(r"<(?:script|link|img|image|use|iframe|source|embed|object|video|audio)\b[^>]*?"
               rf"\b(?:src|href|xlink:href|data|srcset|poster)\s*=\s*[\"']?{SCHEME}[^\"'\s>]+", re.I),
    re.compile(rf"http-equiv=[\"']?refresh[\"']?\s+content=[\"'][^\"']*url=[\"']?{SCHEME}[^\"'\s>]+", re.I),
    re.compile(rf"url\(\s*[\"']?{SCHEME}[^\"')\s]+", re.I),                            # CSS url(...)
    re.compile(rf"@import\s+[\"']{SCHEME}[^\"']+", re.I),                              # CSS @import "..."
    # a script building the address of a script, stylesheet or font
    re.compile(rf"[\"'`]{SCHEME}[^\"'`\s]+\.(?:m?js|css|woff2?|ttf|otf|eot)(?:\?[^\"'`\s]*)?[\"'`]", re.I),
    re.compile(r"[\"'`](?:https?:)?//(?:cdn\.jsdelivr\.net|unpkg\.com|cdnjs\.cloudflare\.com|fonts\.googleapis\.com"
               r"|fonts\.gstatic\.com|cdn\.mathjax\.org|ajax\.googleapis\.com|code\.jquery\.com)\b[^\"'`\s]*", re.I),
]


def outside_loads(folder: Path) -> list[str]:
    """'file: address' for every script, stylesheet, font or image outside the site that a built page,
    stylesheet, script or source map would load (a link a reader clicks, to a paper, is not one)."""
    found = []
    for path in sorted(folder.rglob("*")):
        if path.suffix in (".html", ".svg", ".css", ".js", ".mjs", ".map", ".json") and path.is_file():
            text = path.read_text(errors="replace")
            urls = {re.search(rf"{SCHEME}[^\"'`)\s>]+", m.group(0)).group(0) for rule in LOADS
                    for m in rule.finditer(text)}
            found += [f"{path.relative_to(folder)}: {url}" for url in sorted(urls)]
    return found


@pytest.mark.slow
def test_no_built_file_loads_anything_from_outside_the_site(site):
    assert outside_loads(site) == []


def test_the_offline_check_finds_what_a_page_would_fetch(tmp_path):
    """Each way a page could fetch from outside is found; a paper link and a data: URL are not."""
    (tmp_path / "page.html").write_text(
        '<script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js"></script>\n'
        "<link rel='stylesheet' href='//fonts.googleapis.com/css?family=Lato'>\n"
        '<img srcset="https://example.org/a.png 2x">\n'
        '<meta http-equiv="refresh" content="0; url=https://example.org/">\n'
        '<a href="https://arxiv.org/abs/2305.17118">the paper</a> <img src="data:image/png;base64,AAAA">\n')
    (tmp_path / "style.css").write_text(
        '@import "https://example.org/theme.css";\n'
        "a { background: url(data:image/svg+xml,%3csvg xmlns='http://www.w3.org/2000/svg') }\n"
        "@font-face { src: url('https://example.org/lato.woff2') }\n")
    (tmp_path / "app.js").write_text('const s = "https://example.org/x/loader.js"; // see https://example.org\n'
                                     "fetch('https://unpkg.com/some-package');\n")
    assert outside_loads(tmp_path) == [
        "app.js: https://example.org/x/loader.js", "app.js: https://unpkg.com/some-package",
        "page.html: //fonts.googleapis.com/css?family=Lato",
        "page.html: https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js", "page.html: https://example.org/",
        "page.html: https://example.org/a.png",
        "style.css: https://example.org/lato.woff2", "style.css: https://example.org/theme.css"]


# -- links: every internal one reaches a file, and its anchor an element of that page --------------------------

class Links(HTMLParser):
    """A page's ids, and the addresses its links, images and scripts name."""

    def __init__(self):
        super().__init__()
        self.ids, self.targets = set(), []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        for name in ("href", "src"):
            if attrs.get(name):
                self.targets.append(attrs[name])


def parsed(path: Path, cache: dict) -> Links:
    if path not in cache:
        cache[path] = Links()
        cache[path].feed(path.read_text(errors="replace"))
    return cache[path]


def broken_links(site: Path) -> list[str]:
    pages, broken = {}, []
    for page in sorted(p for p in site.rglob("*.html") if "_static" not in p.relative_to(site).parts):
        for target in parsed(page, pages).targets:
            parts = urlsplit(target)
            if parts.scheme or target.startswith("//") or (not parts.path and not parts.fragment):
                continue                                  # outside the site (the offline test's business), or "#"
            path = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if path.is_dir():
                path = path / "index.html"
            if not path.is_relative_to(site.resolve()):
                broken.append(f"{page.relative_to(site)} -> {target}: outside the site")
            elif not path.is_file():
                broken.append(f"{page.relative_to(site)} -> {target}: no such file")
            elif parts.fragment and path.suffix == ".html" and unquote(parts.fragment) not in parsed(path, pages).ids:
                broken.append(f"{page.relative_to(site)} -> {target}: no such anchor")
    return broken


@pytest.mark.slow
def test_every_internal_link_resolves(site):
    assert broken_links(site) == []


def test_the_link_check_finds_a_missing_page_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.html").write_text('<h1 id="top">A</h1><a href="b.html#top">b</a><a href="b.html#nowhere">b</a>'
                                     '<img src="_images/gone.png"><a href="#top">up</a><a href="https://x.org">x</a>'
                                     '<a href="../a.html">out</a><a href="/etc/hostname">out</a>')
    (tmp_path / "b.html").write_text('<section id="top"><a href="a.html">a</a></section>')
    assert broken_links(tmp_path) == ["a.html -> b.html#nowhere: no such anchor",
                                      "a.html -> _images/gone.png: no such file",
                                      "a.html -> ../a.html: outside the site",
                                      "a.html -> /etc/hostname: outside the site"]


# -- in the browser -----------------------------------------------------------------------------------------

DISPLAY = {"math_block", "math_block_label", "amsmath", "math_inline_double"}    # MyST's docutils math_block
INLINE = {"math_inline", "math_single"}                                           # ... and its math


@functools.cache
def myst_parser():
    """MyST's Markdown parser with the book's extensions (built once: it reads book/conf.py)."""
    from markdown_it.renderer import RendererHTML
    from myst_parser.config.main import MdParserConfig
    from myst_parser.parsers.mdit import create_md_parser
    conf = load("conf")
    return create_md_parser(MdParserConfig(enable_extensions=set(conf.myst_enable_extensions)), RendererHTML)


def math_in(source: str) -> tuple[int, int]:
    """(display, inline) equations of a page's source, as MyST's parser reads them with the book's settings
    (each notebook cell on its own, as myst-nb reads them)."""
    md = myst_parser()
    text = (ROOT / source).read_text()
    texts = ["".join(c["source"]) for c in json.loads(text)["cells"] if c["cell_type"] == "markdown"] \
        if source.endswith(".ipynb") else [text]
    tokens = [t for text in texts for token in md.parse(text) for t in [token, *(token.children or [])]]
    return sum(t.type in DISPLAY for t in tokens), sum(t.type in INLINE for t in tokens)


@pytest.fixture(scope="module")
def browser(site):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield chromium
        chromium.close()


TYPESET = """() => (window.MathJax && MathJax.startup && MathJax.startup.promise)
    ? MathJax.startup.promise.then(() => true, () => false) : false"""
LOOK = """() => ({
    display: document.querySelectorAll('mjx-container[display="true"]').length,
    inline: document.querySelectorAll('mjx-container:not([display="true"])').length,
    errors: Array.from(document.querySelectorAll('mjx-merror')).map(e => e.textContent.slice(0, 80)),
    raw: Array.from(document.querySelectorAll('mjx-container'))                     // its text holds a backslash
        .map(c => (c.querySelector('mjx-assistive-mml') || c).textContent)
        .filter(t => t.includes(String.fromCharCode(92))),
    images: document.images.length,
    unloaded: Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src),
    nav: Array.from(document.querySelectorAll('nav.bd-links a:not(.current)')).map(a => a.href),
    current: document.querySelectorAll('nav.bd-links a.current').length,
    prev: document.querySelectorAll('a.left-prev').length, next: document.querySelectorAll('a.right-next').length,
})"""


def in_the_browser(browser, site: Path, source: str) -> tuple[list[str], dict]:
    """What is wrong with a page as Chromium shows it (the equations, the images, requests that leave the
    site), and what it saw."""
    page = browser.new_page()
    away, failed = [], []
    page.on("request", lambda r: away.append(r.url) if not r.url.startswith(("file:", "data:", "blob:")) else None)
    page.on("requestfailed", lambda r: failed.append(r.url))         # a file of the site that is not there
    try:
        page.goto(html_of(site, source).as_uri(), wait_until="load")
        display, inline = math_in(source)
        typeset = page.evaluate(TYPESET)                                # waits for the typesetting where it runs
        seen = page.evaluate(LOOK)
    finally:
        page.close()
    problems = [f"requested {url}" for url in away] + [f"image did not load: {src}" for src in seen["unloaded"]]
    problems += [f"could not load {url}" for url in failed if url not in away]
    if display + inline and not typeset:
        problems.append("MathJax did not start")
    if (seen["display"], seen["inline"]) != (display, inline):
        problems.append(f"typeset {seen['display']} display and {seen['inline']} inline equations; the source "
                        f"has {display} and {inline}")
    problems += [f"MathJax could not read: {e}" for e in seen["errors"]]
    problems += [f"an equation shows a TeX command as text: {t[:80]}" for t in seen["raw"]]
    return problems, seen


@pytest.mark.slow
def test_pages_in_the_browser(site, browser):
    """Every page: its equations typeset (as many display and inline ones as its source), no error in one and
    no TeX command left as text in one (a backslash), every image loaded, no request outside the site. Each
    lesson's page lists every other lesson, marks itself, and links the pages before and after it."""
    problems, totals = [], {"display": 0, "inline": 0, "images": 0}
    lessons = {html_of(site, lesson).as_uri() for lesson in LESSONS}
    for source in sources():
        found, seen = in_the_browser(browser, site, source)
        problems += [f"{source}: {p}" for p in found]
        totals = {k: totals[k] + seen[k] for k in totals}
        if source in LESSONS:
            if missing := lessons - {html_of(site, source).as_uri()} - set(seen["nav"]):
                problems.append(f"{source}: the navigation lacks {sorted(missing)}")
            if not seen["current"]:
                problems.append(f"{source}: the navigation does not mark the page")
            if not (seen["prev"] and seen["next"]):
                problems.append(f"{source}: no link to the previous and next pages")
    assert problems == []
    assert min(totals.values()) > 0, totals                     # it saw equations of both kinds, and images


@pytest.mark.slow
def test_without_its_mathjax_the_site_fails_the_browser_check(site, browser, tmp_path):
    """The site serves MathJax itself: a copy without it shows its equations as raw TeX, and the check says so;
    a copy without MathJax's fonts typesets them in the wrong glyphs, and the check says so too."""
    copy = tmp_path / "site"
    shutil.copytree(site, copy, ignore=shutil.ignore_patterns("_images", "_downloads"))
    shutil.rmtree(copy / "_static" / "mathjax")
    problems, _ = in_the_browser(browser, copy, "notebooks/02_scissorhands.ipynb")
    assert "MathJax did not start" in problems and any(p.startswith("typeset 0 display and 0 inline") for p in problems)
    shutil.copytree(site / "_static" / "mathjax", copy / "_static" / "mathjax",      # its fonts alone missing:
                    ignore=shutil.ignore_patterns("woff-v2"))                         # the math is typeset, badly
    problems, _ = in_the_browser(browser, copy, "notebooks/02_scissorhands.ipynb")
    assert any(p.startswith("could not load") and p.endswith(".woff") for p in problems), problems


@pytest.mark.slow
@pytest.mark.parametrize("word", sorted(SEARCHES))
def test_search_finds_each_method_s_lesson_by_its_name(site, browser, word):
    """The method's lesson is one of the first two results (the other, where it is not the lesson, is its lab:
    both carry the name in their title)."""
    page = browser.new_page()
    try:
        page.goto((site / "search.html").as_uri() + f"?q={word}", wait_until="load")
        page.wait_for_selector("#search-results ul.search li a", timeout=30_000)
        found = page.eval_on_selector_all("#search-results ul.search li a", "links => links.map(a => a.href)")
    finally:
        page.close()
    first = [url.split("#")[0].split("?")[0] for url in found[:2]]
    assert html_of(site, SEARCHES[word] + ".ipynb").as_uri() in first, found[:5]
