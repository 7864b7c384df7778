"""How long a notebook takes: reading time and exercise time, estimated apart (CONTRIBUTING.md, "Time").

Run ``python tools/time_estimate.py`` after regenerating the notebooks: it prints, for every notebook of
``chapters/``, the two numbers its opener must state and the sums 00's map states, part by part: Part I
(the article's chapters and the capstone), Part II (beyond the article) and the appendices, as
``labkit.teaching.diagrams.book_part`` tells them apart. tests/test_book_shape.py
holds the openers and the map to these numbers.

Reading: the prose at 200 words a minute (words counted as tests/test_book_shape.py counts them) plus the
code at 20 lines a minute (lines that are neither blank nor only a comment), rounded up to 5 minutes.
The cells run in seconds on a laptop's CPU, inside that time.

Exercises: a fixed allowance per kind, summed and rounded up to 5 minutes. A "build it" exercise (the
heading says so) is 45 minutes; any other exercise that writes a function, a class or a kernel is 15; an
exercise whose answer is a value is 5; a quiz question is 2.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS_PER_MINUTE = 200
CODE_LINES_PER_MINUTE = 20
BUILD_IT, FUNCTION, VALUE, QUIZ_QUESTION = 45, 15, 5, 2  # minutes each


def _up_to_5(minutes: float) -> int:
    return 5 * math.ceil(minutes / 5)


def reading_minutes(notebook: Path) -> int:
    """Prose words / 200 + code lines / 20, rounded up to 5 minutes."""
    cells = json.loads(notebook.read_text())["cells"]
    words = sum(len(re.findall(r"\w+", "".join(c["source"]))) for c in cells if c["cell_type"] == "markdown")
    code = sum(1 for c in cells if c["cell_type"] == "code" for line in "".join(c["source"]).splitlines()
               if line.strip() and not line.strip().startswith("#"))
    return _up_to_5(words / WORDS_PER_MINUTE + code / CODE_LINES_PER_MINUTE)


def exercise_kinds(source: Path) -> dict[str, str]:
    """Each exercise of a book source (``"Exercise 2"``, ``"Warm-up"``) and its kind: ``"build it"``,
    ``"function"`` or ``"value"``, read from its heading and from the checker that judges it."""
    text = source.read_text()
    built = set(re.findall(r"\*\*(Exercise \d+) \(build it\)\.\*\*", text))
    kinds: dict[str, str] = {}
    for checker, label in re.findall(r'^ex\.(check|check_function|check_behaviour)\("([^"]+)"', text, re.M):
        name = re.match(r"Exercise \d+|[^(]+", label).group(0).strip()  # "Exercise 1 (blocks)": one exercise
        kinds.setdefault(name, "build it" if name in built else "value" if checker == "check" else "function")
    return kinds


def exercise_minutes(source: Path) -> int:
    """The allowances of a source's exercises and quiz questions, summed, rounded up to 5 minutes."""
    from labkit.teaching.quizzes import QUIZZES

    each = {"build it": BUILD_IT, "function": FUNCTION, "value": VALUE}
    total = sum(each[k] for k in exercise_kinds(source).values())
    return _up_to_5(total + QUIZ_QUESTION * len(QUIZZES.get(source.stem, [])))


#: The parts 00's map sums apart, in its order: (the words it names them by, the key ``part_of`` gives).
PARTS = (("chapters and the capstone", "I"), ("Part II", "II"), ("appendices", "A"))


def part_of(key: str) -> str:
    """The part a notebook counts with: "I" (chapters 01 to 06 and the capstone C1, which closes Part I),
    "II" (chapter 07 on, beyond the article) or "A" (the appendices); ``key`` is its first two characters."""
    from labkit.teaching.diagrams import book_part

    return book_part(key)


def estimates() -> dict[str, tuple[int, int]]:
    """``{"01": (reading, exercises), ...}`` for every notebook of chapters/."""
    return {nb.stem[:2]: (reading_minutes(nb), exercise_minutes(ROOT / "book" / f"{nb.stem}.py"))
            for nb in sorted((ROOT / "chapters").glob("*.ipynb"))}


def main() -> None:
    found = estimates()
    for part, key in PARTS:
        rows = {k: v for k, v in found.items() if part_of(k) == key}
        for key, (read, work) in rows.items():
            print(f"{key}: about {read} minutes to read and run, about {work} minutes for the exercises")
        rows.pop("00", None)  # 00's map sums the chapters after it
        print(f"{part}: {sum(r for r, _ in rows.values())} minutes to read, "
              f"{sum(w for _, w in rows.values())} for the exercises\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
