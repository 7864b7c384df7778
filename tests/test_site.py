"""The book's website (`make site`), built from the committed notebooks and read in headless Chromium.

The site is built once for this file, the way `make site` builds it (Sphinx with -W: a warning
fails the build), into a temporary folder, with every proxy pointing at a closed port so that
any download would fail. Every expected number comes from the committed notebooks: how many
figures a page must show is the number of image outputs its notebook stores, so the tests follow
the chapters as they gain or lose cells, and new chapters are found in the folders.

The browser test serves the site from 127.0.0.1 (the search page needs http, not file://),
refuses every request that leaves it, and opens the front page, every chapter and every solutions
page. It saves a screenshot of chapter 03, site_chapter.png, in pytest's tmp_path for the test.
Chromium is Debian's, driven by playwright as in test_browser.py (skipped, with instructions,
when it is missing).
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import tomllib
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from test_browser import CHROMIUM, CHROMIUM_ARGS, isolated_env

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "site"))
import kvlabs_site  # noqa: E402

SIDES = kvlabs_site.SIDES
NOTEBOOKS = [p for side in SIDES for p in sorted((ROOT / side).glob("*.ipynb"))]
IMAGE_MIMES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")
SITE_TITLE = "KV Cache Labs"  # html_title in site/conf.py


def page_of(notebook: Path) -> str:
    """The page a notebook becomes, relative to the site's root."""
    return f"{notebook.parent.name}/{notebook.stem}.html"


def cells(notebook: Path) -> list[dict]:
    return json.loads(notebook.read_text())["cells"]


def outputs(notebook: Path) -> list[dict]:
    return [o for c in cells(notebook) if c["cell_type"] == "code" for o in c.get("outputs", [])]


def image_outputs(notebook: Path) -> int:
    """Figures the notebook stores: outputs with an image (one figure each, whatever its formats)."""
    return sum(any(m in o.get("data", {}) for m in IMAGE_MIMES) for o in outputs(notebook))


def widget_outputs(notebook: Path) -> int:
    return sum(kvlabs_site.is_widget_output(o) for o in outputs(notebook))


def title_of(notebook: Path) -> str:
    """The page title: the notebook's first heading, marked on a solutions page."""
    for cell in cells(notebook):
        first = "".join(cell["source"]).split("\n")[0]
        if cell["cell_type"] == "markdown" and first.startswith("# "):
            title = first[2:].strip()
            return f"{title} (solutions)" if notebook.parent.name == "solutions" else title
    raise AssertionError(f"{notebook}: no '# ' title")


def badge_link(notebook: Path) -> str:
    """Where the notebook's own "Open in Colab" badge points."""
    (link,) = re.findall(r"\]\((https://colab\.research\.google\.com/github/[^)]+)\)", "".join(cells(notebook)[0]["source"]))
    return link


def site_options() -> list[str]:
    """The sphinx-build options of `make site`, read from the Makefile so that the two cannot drift."""
    text = (ROOT / "Makefile").read_text()
    (options,) = re.findall(r"^SITE_OPTS\s*:?=\s*(.+)$", text, re.M)
    return options.split()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built as `make site` builds it, offline, into a temporary folder."""
    if importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_nb") is None:
        pytest.fail("the website's builder is missing: `make setup` installs it (requirements/site.txt)")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ)
    for var in ["http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"]:
        env[var] = "http://127.0.0.1:9"  # the discard port: any download fails at once
    for var in ["no_proxy", "NO_PROXY"]:
        env.pop(var, None)
    result = subprocess.run([sys.executable, "-m", "sphinx", *site_options(), "-d", str(out / "doctrees"),
                             str(ROOT / "site"), str(out / "html")],
                            capture_output=True, text=True, env=env, cwd=ROOT)
    assert result.returncode == 0, f"the site did not build:\n{result.stdout[-3000:]}\n{result.stderr}"
    assert "WARNING" not in result.stderr, result.stderr
    return out / "html"


def test_site_options_fail_on_any_warning():
    assert "-W" in site_options() and "--keep-going" in site_options()


def test_pages_workflow_runs_make_site_and_readme_links_its_address():
    """The workflow cannot run here, so it must do nothing but `make site`; the README's "Read
    online" address is where GitHub Pages publishes the repository of the notebooks' badges."""
    workflow = (ROOT / ".github/workflows/book.yml").read_text()
    assert re.findall(r"^\s*- run: (.+)$", workflow, re.M) == ["make site"]
    assert re.search(r"upload-pages-artifact@\S+\n\s+with:\n\s+path: _build/html$", workflow, re.M)
    assert re.search(r"^site: .*\n\t.* site _build/html$", (ROOT / "Makefile").read_text(), re.M)
    owner, name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"] \
        .removeprefix("https://github.com/").rstrip("/").split("/")
    assert f"**Read online:** <https://{owner}.github.io/{name}/>" in (ROOT / "README.md").read_text()


def _toctrees(page: Path) -> list[tuple[str, list[str]]]:
    """Each toctree of a MyST page: its caption and its entries, in order."""
    trees = re.findall(r"^```\{toctree\}\n(.*?)^```$", page.read_text(), re.M | re.S)
    found = []
    for body in trees:
        caption = re.search(r"^:caption: (.+)$", body, re.M)
        entries = [line.strip() for line in body.splitlines() if line.strip() and not line.startswith(":")]
        found.append((caption.group(1) if caption else "", entries))
    return found


@pytest.mark.parametrize("page, side", [("index.md", "chapters"), ("solutions.md", "solutions")])
def test_site_lists_the_notebooks_part_by_part(page, side):
    """The contents go Part I (the chapters of the article and the capstone), Part II (beyond the article),
    the appendices, each notebook under its part (``labkit.teaching.diagrams.book_part``) exactly once."""
    from fnmatch import fnmatchcase

    from labkit.teaching.diagrams import BOOK_PARTS, book_part

    trees = [(caption, entries) for caption, entries in _toctrees(ROOT / "site" / page)
             if all(e.startswith(f"{side}/") for e in entries)]
    assert [c for c, _ in trees] == ["Part I · the article", "Part II · beyond the article", "Appendices"]
    assert [c for c, _ in trees][:2] == [BOOK_PARTS["I"], BOOK_PARTS["II"]]
    for notebook in sorted((ROOT / side).glob("*.ipynb")):
        doc = f"{side}/{notebook.stem}"
        (under,) = [i for i, (_, entries) in enumerate(trees) if any(fnmatchcase(doc, e) for e in entries)]
        assert under == ["I", "II", "A"].index(book_part(notebook.stem[:2])), doc
    # every pattern finds a notebook: Sphinx warns about one that matches nothing, and `make site` fails on it
    for _, entries in trees:
        for entry in entries:
            assert any(fnmatchcase(f"{side}/{p.stem}", entry) for p in (ROOT / side).glob("*.ipynb")), entry


@pytest.mark.browser  # builds the site: left out of `make test-fast`, as the browser tests are
def test_site_has_a_page_per_notebook_and_lists_every_chapter(site):
    index = (site / "index.html").read_text()
    solutions = (site / "solutions.html").read_text()
    for notebook in NOTEBOOKS:
        assert (site / page_of(notebook)).is_file(), f"no page for {notebook.name}"
        listing = index if notebook.parent.name == "chapters" else solutions
        assert f'href="{page_of(notebook)}"' in listing, f"{page_of(notebook)} missing from the contents"


class _Within(HTMLParser):
    """The text and the pictures inside a page's ``div`` elements of one class (MyST-NB's
    ``cell_input`` holds a code cell's source, ``cell_output`` its outputs)."""

    def __init__(self, cls: str):
        super().__init__(convert_charrefs=True)
        self.cls, self.depth, self.text, self.images = cls, 0, [], 0

    def handle_starttag(self, tag, attrs):
        if self.depth and tag == "img":
            self.images += 1
        if tag != "div":
            return
        if self.depth:
            self.depth += 1
        elif self.cls in (dict(attrs).get("class") or "").split():
            self.depth = 1

    def handle_endtag(self, tag):
        if tag == "div" and self.depth:
            self.depth -= 1

    def handle_data(self, data):
        if self.depth:
            self.text.append(data)


def within(page: Path, cls: str) -> _Within:
    parser = _Within(cls)
    parser.feed(page.read_text())
    return parser


def code_of(page: Path) -> str:
    """The code a page shows (highlighting only wraps words in spans: lines stay whole)."""
    return "".join(within(page, "cell_input").text)


def code_lines(notebook: Path) -> set[str]:
    return {line.strip() for c in cells(notebook) if c["cell_type"] == "code" for line in "".join(c["source"]).split("\n")}


@pytest.mark.browser  # builds the site: left out of `make test-fast`, as the browser tests are
def test_solutions_are_apart_from_the_chapters(site):
    """A chapter page's code shows no line of a solution; the solutions page of that chapter shows them all."""
    shown = 0
    for chapter in sorted((ROOT / "chapters").glob("*.ipynb")):
        solution = ROOT / "solutions" / chapter.name
        only_solved = {line for line in code_lines(solution) - code_lines(chapter) if len(line) >= 12}
        chapter_text, solution_text = code_of(site / page_of(chapter)), code_of(site / page_of(solution))
        leaked = sorted(line for line in only_solved if line in chapter_text)
        assert not leaked, f"{page_of(chapter)} shows solution lines: {leaked[:3]}"
        assert all(line in solution_text for line in only_solved), page_of(solution)
        shown += len(only_solved)
    assert shown, "no chapter has a solution line to hide"


@pytest.mark.browser  # builds the site: left out of `make test-fast`, as the browser tests are
def test_pages_show_the_stored_figures_and_no_widget_json(site):
    for notebook in NOTEBOOKS:
        html = (site / page_of(notebook)).read_text()
        assert within(site / page_of(notebook), "cell_output").images == image_outputs(notebook), page_of(notebook)
        assert html.count(kvlabs_site.WIDGET_NOTE_CLASS) == widget_outputs(notebook), page_of(notebook)
        assert "widget-view+json" not in html and "widget-state+json" not in html, page_of(notebook)


def script_sources(html: str) -> list[str]:
    return re.findall(r"<script[^>]*\ssrc=\"([^\"]+)\"", html)


@pytest.mark.browser  # builds the site: left out of `make test-fast`, as the browser tests are
def test_maths_renders_with_the_mathjax_shipped_in_the_site(site):
    """A page with maths loads MathJax from the site itself (sphinx-mathjax-offline), never from a CDN:
    offline, a CDN's MathJax never arrives and the page shows raw TeX such as ``\\[ ... \\]``."""
    with_maths = 0
    for path in sorted(site.rglob("*.html")):
        if "_static" in path.relative_to(site).parts:
            continue
        html = path.read_text()
        remote = [s for s in script_sources(html) if s.startswith(("http:", "https:", "//"))]
        assert not remote, f"{path.relative_to(site)} loads scripts from another host: {remote}"
        if 'class="math' in html:
            with_maths += 1
            mathjax = [s for s in script_sources(html) if "mathjax" in s.lower()]
            assert mathjax, f"{path.relative_to(site)} has maths and no MathJax"
            for src in mathjax:
                assert (path.parent / src.split("?")[0]).resolve().is_file(), f"{path.relative_to(site)}: {src} is missing"
    assert with_maths, "no page has maths: the check above checked nothing"


def test_prepare_notebook_replaces_widgets_and_keeps_the_rest():
    notebook = json.loads((ROOT / "chapters" / "03_paging.ipynb").read_text())
    shown = kvlabs_site.prepare_notebook(notebook, "chapters", "03_paging")
    assert "widgets" in notebook["metadata"] and "widgets" not in shown["metadata"]
    kept = [o for c in notebook["cells"][2:] if c["cell_type"] == "code" for o in c["outputs"]]
    after = [o for c in shown["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert len(after) == len(kept)
    for before, now in zip(kept, after):
        assert now == (kvlabs_site.widget_note() if kvlabs_site.is_widget_output(before) else before)
    assert any(kvlabs_site.is_widget_output(o) for o in kept), "chapter 03 should hold a widget"
    assert not any(kvlabs_site.is_colab_header(c) for c in shown["cells"])


@pytest.fixture(scope="module")
def served(site):
    """The built site over http on 127.0.0.1, on a free port."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _Ids(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.ids.update(value for name, value in attrs if name in ("id", "name") and value)


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    parser = _Ids()
    parser.feed(path.read_text())
    return frozenset(parser.ids)


def broken_internal_links(site: Path, base: str, hrefs: list[str]) -> list[str]:
    """The links into the site whose file, or whose #anchor in that file, does not exist."""
    broken = []
    for href in hrefs:
        if not href.startswith(base):
            continue
        parts = urlsplit(href)
        path = site / unquote(parts.path).lstrip("/")
        if path.is_dir():
            path = path / "index.html"
        if not path.is_file():
            broken.append(href)
        elif parts.fragment and path.suffix == ".html" and unquote(parts.fragment) not in anchors(path):
            broken.append(href)
    return broken


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=(
    f"Chromium not found at {CHROMIUM}: install it with `apt-get install chromium` "
    "(Debian/Ubuntu; `playwright install` cannot download browsers here)"))
def test_site_in_chromium(site, served, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    repo = meta["project"]["urls"]["Repository"].removeprefix("https://github.com/").rstrip("/")
    branch = meta["tool"]["kvlabs"]["branch"]
    front_title = (ROOT / "README.md").read_text().split("\n")[0].removeprefix("# ").strip()
    pages = [("index.html", front_title, None), ("solutions.html", "Solutions", None)]
    pages += [(page_of(n), title_of(n), n) for n in NOTEBOOKS]

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS,
                                     env=isolated_env(tmp_path / "state"))
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        # As offline as the build: whatever a page asks of another host (MathJax's CDN) is refused.
        context.route(re.compile(rf"^(?!{re.escape(served)})"), lambda route: route.abort())
        page = context.new_page()
        page.set_default_timeout(30_000)
        failed: list[str] = []
        page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
        try:
            for rel, title, notebook in pages:
                page.goto(served + rel, wait_until="load")
                # Sphinx typesets quotes (smartquotes): "vLLM's" in a notebook is "vLLM’s" on the page.
                assert page.title().replace("\N{RIGHT SINGLE QUOTATION MARK}", "'") == f"{title} \N{EM DASH} {SITE_TITLE}", rel

                # Every figure the notebook stores is on the page and was loaded.
                figures = page.locator(".cell_output img")
                expected = image_outputs(notebook) if notebook else 0
                assert figures.count() == expected, f"{rel}: {figures.count()} figures, the notebook stores {expected}"
                sizes = figures.evaluate_all("imgs => imgs.map(i => i.complete ? i.naturalWidth : 0)")
                assert all(w > 0 for w in sizes), f"{rel}: a figure did not load ({sizes})"

                # No empty output box: each shows text or a picture. Widgets left a note, not a model id.
                empty = page.locator(".cell_output").evaluate_all(
                    "outs => outs.filter(o => !o.textContent.trim() && !o.querySelector('img')).length")
                assert empty == 0, f"{rel}: {empty} empty output boxes"
                notes = page.locator(f".{kvlabs_site.WIDGET_NOTE_CLASS}")
                assert notes.count() == (widget_outputs(notebook) if notebook else 0), rel
                for i in range(notes.count()):
                    assert "runs in JupyterLab, Binder or Colab" in notes.nth(i).inner_text(), rel
                assert page.locator(".jupyter-widgets, .widget-subarea, script[type*='jupyter.widget']").count() == 0
                content = page.content()
                assert "widget-view+json" not in content and "model_id" not in content, rel

                # Maths typeset by the site's own MathJax: no raw TeX is left in the prose.
                if page.locator(".math").count():
                    page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise")
                    page.evaluate("() => MathJax.startup.promise")
                    assert page.locator("mjx-container").count() == page.locator(".math").count(), rel
                    assert page.locator("mjx-merror").count() == 0, f"{rel}: MathJax could not read some TeX"
                typeset = page.locator("mjx-container").evaluate_all("els => els.map(e => e.textContent)")
                assert not [t for t in typeset if "\\" in t], f"{rel}: a TeX command was left as text: {typeset}"
                prose = page.evaluate("() => { const a = document.querySelector('article').cloneNode(true); "
                                      "a.querySelectorAll('pre, code, .cell_input, .cell_output').forEach(e => e.remove()); "
                                      "return a.innerText; }")
                raw = [tex for tex in ("\\[", "\\(", "$$") if tex in prose]
                assert not raw, f"{rel}: raw TeX {raw} on the page"

                # No internal link leads nowhere, anchors included.
                hrefs = page.locator("a[href]").evaluate_all("links => links.map(a => a.href)")
                broken = broken_internal_links(site, served, hrefs)
                assert not broken, f"{rel}: broken links {broken}"

                # Launch buttons open this notebook in Binder and in Colab, where its own badge points.
                if notebook:
                    path = f"{notebook.parent.name}/{notebook.name}"
                    binder = f"https://mybinder.org/v2/gh/{repo}/{branch}?urlpath=lab/tree/{path}"
                    assert page.locator(f'a[href="{binder}"]').count() == 1, f"{rel}: no Binder button"
                    assert page.locator(f'a[href="{badge_link(notebook)}"]').count() == 1, f"{rel}: no Colab button"
                    if notebook.stem.startswith("03_") and notebook.parent.name == "chapters":
                        shot = tmp_path / "site_chapter.png"
                        page.screenshot(path=str(shot))
                        print(f"screenshot: {shot}")
            assert not failed, f"requests that failed: {failed}"

            # The search page finds the block table, on every chapter page that names it.
            page.goto(served + "search.html?q=block+table")
            sync_api.expect(page.locator(".search-summary")).to_contain_text("Search finished", timeout=30_000)
            found = page.locator("#search-results ul.search li a").evaluate_all(
                "links => links.map(a => new URL(a.href).pathname.replace(/^\\//, ''))")
            naming = [page_of(n) for n in NOTEBOOKS if "block table" in page_text(n)]
            assert naming, "no notebook says 'block table'"
            missing = [p for p in naming if p not in found]
            assert not missing, f"searching 'block table' missed {missing}; found {found}"
        except Exception:
            page.screenshot(path=str(tmp_path / "failure.png"))
            print(f"failure screenshot: {tmp_path / 'failure.png'}")
            raise
        finally:
            browser.close()


def page_text(notebook: Path) -> str:
    """The notebook's prose, in lower case, the words Sphinx indexes for search."""
    prose = " ".join("".join(c["source"]) for c in cells(notebook) if c["cell_type"] == "markdown")
    return re.sub(r"\s+", " ", prose).lower()
