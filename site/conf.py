"""Sphinx configuration of the book's website. Build it with `make site` (into _build/html).

The pages are the committed, executed notebooks of chapters/ and solutions/, shown with their
stored outputs: nothing is executed and nothing is downloaded. kvlabs_site.py (beside this file)
mirrors the notebooks into this folder and replaces widget outputs with a note.
"""

import re
import sys
import tomllib
from pathlib import Path

SITE = Path(__file__).resolve().parent
ROOT = SITE.parent
sys.path.insert(0, str(SITE))

# The repository and branch of the notebooks' Colab badges, read from the same place as
# tools/make_notebooks.py reads them: pyproject.toml.
_meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
REPOSITORY = _meta["project"]["urls"]["Repository"].rstrip("/")
BRANCH = _meta["tool"]["kvlabs"]["branch"]
if not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", REPOSITORY):
    raise ValueError(f"pyproject.toml [project.urls] Repository must be https://github.com/OWNER/NAME, got {REPOSITORY}")

project = "KV Cache Labs"
author = "the KV Cache Labs authors"
copyright = "the KV Cache Labs authors, MIT licence"

# sphinx-mathjax-offline (requirements/site.txt) copies MathJax 3.2.2 into _static/mathjax and points
# the pages at it: maths renders with no CDN, so `make site` offline shows no raw TeX.
extensions = ["myst_nb", "kvlabs_site", "sphinx.ext.mathjax", "sphinx-mathjax-offline"]
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
suppress_warnings = []  # `make site` runs with -W: a warning fails the build

# MyST-NB: show what the notebooks hold, never run them.
nb_execution_mode = "off"
nb_ipywidgets_js = {}  # no widget manager from a CDN: kvlabs_site.py replaces widget outputs
nb_merge_streams = True
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

html_theme = "sphinx_book_theme"
html_title = "KV Cache Labs"
html_static_path = ["_static"]
html_css_files = ["kvlabs.css"]
html_last_updated_fmt = None
html_theme_options = {
    "repository_url": REPOSITORY,
    "repository_branch": BRANCH,
    "path_to_docs": "",  # site/chapters/X.ipynb mirrors chapters/X.ipynb: the same path from the root
    "use_repository_button": True,
    "use_download_button": True,
    "launch_buttons": {
        "binderhub_url": "https://mybinder.org",
        "colab_url": "https://colab.research.google.com",
        "notebook_interface": "jupyterlab",
    },
    "show_toc_level": 2,
    "navbar_persistent": [],  # one search field, in the sidebar (not a second one in a header bar)
    "navigation_with_keys": False,
}
