"""The book's website from the committed, executed notebooks: a small Sphinx extension.

`make site` builds the website with Sphinx, MyST-NB and sphinx-book-theme. Nothing is executed:
every output and figure on a page is the one stored in ``chapters/`` or ``solutions/``. This
extension does the three things that the stock tools do not:

* **Mirror.** Sphinx reads only files under its source folder (``site/``), so the notebooks are
  copied to ``site/chapters/`` and ``site/solutions/`` (ignored by git) before Sphinx looks for
  documents. A notebook is copied only when its bytes changed, so Sphinx rebuilds only the pages
  that changed, and a copy whose notebook is gone is removed. The table of contents globs these
  folders part by part (``index.md``: Part I, ``0[0-6]_*`` and the capstone ``C*``; Part II,
  ``0[7-9]_*``; the appendices, ``A*``), so a new chapter (``chapters/A8_*.ipynb``, say) appears
  in its part without editing the site.
* **Widgets.** A widget needs a live kernel. The notebooks store a widget output as a bare model
  id (``application/vnd.jupyter.widget-view+json``), which a static page would show as an empty
  box. Each such output becomes a note that the live widget runs in JupyterLab, Binder or Colab;
  the static figure the chapter puts beside every widget stays where it is.
* **Pages.** The "Open in Colab" badge and the Colab install cell that open every notebook give
  way to the theme's launch buttons, which point at the same repository and branch. A solutions
  page says so in its title and links back to its chapter, so no reader lands on one by mistake.

The committed notebooks are never changed: the mirror is a byte copy, and the changes above are
made to the text that Sphinx reads (the ``source-read`` event).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

SIDES = ("chapters", "solutions")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE_CLASS = "kvlabs-widget-note"
WIDGET_NOTE_TEXT = ("The live widget runs in JupyterLab, Binder or Colab: use the launch button at "
                    "the top of this page, or <code>make lab</code>. On this page, the static figure "
                    "beside this cell shows the same.")


def mirror_notebooks(repo_root: Path, site_dir: Path) -> list[Path]:
    """Copy ``repo_root/{chapters,solutions}/*.ipynb`` to the same folders under ``site_dir``.

    Copies only files whose bytes differ (Sphinx compares modification times, so untouched pages
    are not rebuilt) and deletes copies of notebooks that no longer exist. Returns the copies.
    """
    copies = []
    for side in SIDES:
        source, target = repo_root / side, site_dir / side
        target.mkdir(exist_ok=True)
        wanted = {p.name: p for p in sorted(source.glob("*.ipynb"))}
        for stale in target.glob("*.ipynb"):
            if stale.name not in wanted:
                stale.unlink()
        for name, path in wanted.items():
            copy = target / name
            if not copy.exists() or copy.read_bytes() != path.read_bytes():
                shutil.copyfile(path, copy)
            copies.append(copy)
    return copies


def widget_note() -> dict[str, Any]:
    """The output that stands in for a widget on a static page (an admonition, in the theme's style)."""
    html = (f'<div class="admonition note {WIDGET_NOTE_CLASS}"><p class="admonition-title">Live widget</p>'
            f"<p>{WIDGET_NOTE_TEXT}</p></div>")
    plain = "Live widget: it runs in JupyterLab, Binder or Colab. The static figure beside this cell shows the same."
    return {"output_type": "display_data", "metadata": {}, "data": {"text/html": html, "text/plain": plain}}


def is_widget_output(output: dict[str, Any]) -> bool:
    return WIDGET_VIEW in output.get("data", {})


def is_colab_header(cell: dict[str, Any]) -> bool:
    """The badge cell and the install cell that tools/make_notebooks.py puts first in every notebook."""
    source = "".join(cell.get("source", ""))
    if cell["cell_type"] == "markdown":
        return "colab-badge.svg" in source and "colab.research.google.com" in source
    return cell["cell_type"] == "code" and 'if "google.colab" in sys.modules:' in source


def _retitle_solution(cells: list[dict[str, Any]], stem: str) -> None:
    """Mark a solutions page as such in its title, and link it to its chapter."""
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        lines = "".join(cell["source"]).split("\n")
        if lines and lines[0].startswith("# "):
            title = lines[0][2:].strip()
            note = (f"This page is chapter [{title}](../chapters/{stem}.ipynb) with every exercise solved. "
                    "Try the exercises in the chapter first.")
            cell["source"] = "\n".join([f"# {title} (solutions)", "", "```{note}", note, "```", *lines[1:]])
            return


def prepare_notebook(notebook: dict[str, Any], side: str, stem: str) -> dict[str, Any]:
    """The notebook as the website shows it (a new dict; ``notebook`` is left unchanged)."""
    notebook = json.loads(json.dumps(notebook))
    # The saved widget state would only make MyST-NB load the widget manager from a CDN.
    notebook.get("metadata", {}).pop("widgets", None)
    cells = [cell for i, cell in enumerate(notebook["cells"]) if not (i < 2 and is_colab_header(cell))]
    for cell in cells:
        if cell["cell_type"] == "code":
            cell["outputs"] = [widget_note() if is_widget_output(o) else o for o in cell.get("outputs", [])]
    if side == "solutions":
        _retitle_solution(cells, stem)
    notebook["cells"] = cells
    return notebook


def _mirror_on_config(app, config) -> None:
    mirror_notebooks(Path(app.srcdir).parent, Path(app.srcdir))


def _prepare_on_read(app, docname: str, source: list[str]) -> None:
    side, _, stem = docname.partition("/")
    if side in SIDES and app.env.doc2path(docname).suffix == ".ipynb":
        source[0] = json.dumps(prepare_notebook(json.loads(source[0]), side, stem), ensure_ascii=False)


def setup(app):
    app.connect("config-inited", _mirror_on_config)
    app.connect("source-read", _prepare_on_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
