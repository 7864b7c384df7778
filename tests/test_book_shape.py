"""The book's shape, checked so that it cannot drift back: short chapters that open the same way.

Issue 26 re-cut the book for a learner: one message per chapter, at most 3,500 words of prose in
each chapter and appendix (what deepens a message moves to an appendix), and every chapter and
appendix opens with the roadmap figure, what the reader needs from earlier chapters and a time
estimate, right after its title cell.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_WORDS = 3500
NOTEBOOKS = sorted((ROOT / "chapters").glob("*.ipynb"))
SOURCES = sorted(p for p in (ROOT / "book").glob("*.py") if not p.name.startswith("00_"))


def prose_words(notebook: Path) -> int:
    """Words of markdown prose in a notebook, counted as regex ``\\w+`` tokens (numbers and
    identifiers count too: a reader reads them)."""
    cells = json.loads(notebook.read_text())["cells"]
    return sum(len(re.findall(r"\w+", "".join(c["source"]))) for c in cells if c["cell_type"] == "markdown")


def test_prose_words_counts_markdown_only(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": ["# 01 · A title\n", "3,500 words_here."]},
                    {"cell_type": "code", "source": ["print('not prose at all')"]}]}
    (tmp_path / "x.ipynb").write_text(json.dumps(nb))
    assert prose_words(tmp_path / "x.ipynb") == 6  # 01 A title 3 500 words_here


def test_there_are_chapters_and_appendices():
    names = {p.stem[:2] for p in NOTEBOOKS}
    assert {"00", "01", "02", "03", "04", "05", "06", "A1", "A2"} <= names


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_keeps_to_the_word_limit(notebook):
    words = prose_words(notebook)
    assert words <= MAX_WORDS, (f"{notebook.name}: {words:,} words of prose, the limit is {MAX_WORDS:,}: "
                                "move what deepens the chapter's message to an appendix")


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_every_chapter_opens_with_the_roadmap_its_prerequisites_and_a_time(source):
    from labkit.teaching.diagrams import ROADMAP_CHAPTERS

    cells = jupytext.read(source).cells
    title, figure, opener = cells[0], cells[1], cells[2]
    chapter = source.stem[:2]
    assert title.cell_type == "markdown" and title.source.startswith(f"# {chapter} · "), source.name
    assert chapter in ROADMAP_CHAPTERS, f"labkit.teaching.diagrams.ROADMAP_CHAPTERS has no {chapter}"
    assert figure.cell_type == "code" and f'roadmap("{chapter}")' in figure.source, \
        f"{source.name}: the cell after the title must draw roadmap({chapter!r})"
    assert opener.cell_type == "markdown", source.name
    assert re.search(r"^\*\*You need:\*\* \S", opener.source, re.M), f"{source.name}: no '**You need:**'"
    assert re.search(r"^\*\*Time:\*\* about \d+ minutes", opener.source, re.M), f"{source.name}: no '**Time:** about N minutes'"
