"""The book's shape, checked so that it cannot drift back: short chapters that open the same way.

Issue 26 re-cut the book for a learner: one message per chapter, at most 3,500 words of prose in
each chapter and appendix (what deepens a message moves to an appendix), and every chapter and
appendix opens with the roadmap figure, what the reader needs from earlier chapters and a time
estimate, right after its title cell.
"""

from __future__ import annotations

import importlib.util
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
    assert {"00", "01", "02", "03", "04", "05", "06", "07", "08", "A1", "A2", "C1"} <= names


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


def _message(source: Path) -> str:
    """The paragraph after '**The message.**' in a notebook's title cell ('' when there is none)."""
    title = jupytext.read(source).cells[0].source
    match = re.search(r"^\*\*The message\.\*\* (.+?)(?:\n\s*\n|\Z)", title, re.M | re.S)
    return " ".join(match.group(1).split()) if match else ""


@pytest.mark.parametrize("source", sorted((ROOT / "book").glob("*.py")), ids=lambda p: p.stem)
def test_every_notebook_opens_with_its_message_in_one_sentence(source):
    message = _message(source)
    assert message, f"{source.name}: its title cell has no '**The message.** ...' paragraph"
    ends = re.findall(r"[.!?](?=\s|$)", message)
    assert len(ends) == 1 and message.endswith("."), f"{source.name}: the message is {len(ends)} sentences: {message!r}"


def test_one_sentence_means_one_sentence(tmp_path):
    two = tmp_path / "two.py"
    two.write_text("# %% [markdown]\n# # 09 · X\n#\n# **The message.** One thing. And another.\n")
    one = tmp_path / "one.py"
    one.write_text("# %% [markdown]\n# # 09 · X\n#\n# **The message.** One thing, 3.5 times\n# over.\n#\n# More.\n")
    assert len(re.findall(r"[.!?](?=\s|$)", _message(two))) == 2
    assert _message(one) == "One thing, 3.5 times over."


TIME = re.compile(r"^# \*\*Time:\*\* about (\d+) minutes to read[^;]*; about (\d+) minutes for the (?:warm-up )?"
                  r"exercises?\.", re.M)


def _stated_time(source: Path) -> re.Match | None:
    """The opener's time line, its markdown continuation lines joined (a line opening a new bold field stays apart)."""
    return TIME.search(re.sub(r"\n# (?!\*\*)", " ", source.read_text()))


def _time_estimate():
    spec = importlib.util.spec_from_file_location("time_estimate", ROOT / "tools" / "time_estimate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("source", sorted((ROOT / "book").glob("*.py")), ids=lambda p: p.stem)
def test_every_opener_states_reading_and_exercise_time_as_the_method_estimates_them(source):
    """Issue 39: reading and exercises apart, each as CONTRIBUTING.md's method gives it (tools/time_estimate.py)."""
    estimate = _time_estimate()
    stated = _stated_time(source)
    assert stated, f"{source.name}: no '**Time:** about N minutes to read ...; about M minutes for the exercises.'"
    notebook = ROOT / "chapters" / f"{source.stem}.ipynb"
    expected = (estimate.reading_minutes(notebook), estimate.exercise_minutes(source))
    assert tuple(map(int, stated.groups())) == expected, \
        f"{source.name}: the method gives {expected[0]} minutes to read and {expected[1]} for the exercises"


def test_the_time_method_tells_the_kinds_of_exercise_apart():
    estimate = _time_estimate()
    kinds = {k: estimate.exercise_kinds(ROOT / "book" / f"{k}.py")
             for k in ("01_why_the_cache_grows", "03_paging", "A4_real_vllm_on_cpu")}
    assert kinds["01_why_the_cache_grows"] == {"Exercise 1": "value", "Exercise 2": "function", "Exercise 3": "build it"}
    assert list(kinds["03_paging"].values()) == ["function", "value", "function", "build it"]
    assert kinds["A4_real_vllm_on_cpu"] == {"Exercise 1": "value"}  # its two parts are one exercise
    # 01: 5 + 15 + 45 and four quiz questions at 2 = 73, rounded up to 75
    assert estimate.exercise_minutes(ROOT / "book" / "01_why_the_cache_grows.py") == 75


def test_start_here_states_every_notebooks_time_and_their_sum():
    """00's map gives each chapter's and appendix's reading and exercise time as its opener states them,
    and the sums of each part: Part I (the chapters and the capstone), Part II and the appendices."""
    start = (ROOT / "book" / "00_start_here.py").read_text()
    rows = {k: (int(r), int(e)) for k, r, e in
            re.findall(r"^# \| ([0-9A-Z]\d) · .*\| about (\d+) min \| about (\d+) min \|$", start, re.M)}
    stated = {p.stem[:2]: tuple(map(int, m.groups())) for p in SOURCES
              if (m := _stated_time(p))}
    assert rows == stated and len(rows) == len(SOURCES)
    part_of = _time_estimate().part_of  # the capstone closes Part I: it counts with the chapters
    assert {part_of(k) for k in stated} == {"I", "II", "A"}
    read = {p: sum(v[0] for k, v in stated.items() if part_of(k) == p) for p in ("I", "II", "A")}
    work = {p: sum(v[1] for k, v in stated.items() if part_of(k) == p) for p in ("I", "II", "A")}
    prose = " ".join(start.replace("# ", "").split())
    assert (f"the chapters and the capstone take about {read['I']} minutes to read and run and about {work['I']} "
            f"minutes for their exercises, about {round((read['I'] + work['I']) / 60)} hours in all") in prose
    assert f"Part II, beyond the article, takes about {read['II']} and {work['II']} minutes more" in prose
    assert f"the appendices take about {read['A']} and {work['A']} minutes more" in prose
    # each part has its own table, in the book's order, and every row sits under its part's heading
    headings = [m.start() for m in re.finditer(r"^# \*\*(Part I · |Part II · |The appendices)", start, re.M)]
    assert len(headings) == 3 and headings == sorted(headings), "00's map: Part I, Part II, the appendices"
    for key in rows:
        at = re.search(rf"^# \| {key} · ", start, re.M).start()
        assert sum(at > h for h in headings) == {"I": 1, "II": 2, "A": 3}[part_of(key)], key
