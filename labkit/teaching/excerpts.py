"""Show a few lines of labkit's own code in a chapter, instead of a whole function.

A chapter teaches from the lines that carry an idea: ``excerpt(plan_iteration, "budget", "break")``
prints the lines from the first one containing ``"budget"`` through the next one containing
``"break"``, dedented, with their line numbers in the file. The excerpt is read from the code each
time the notebook runs, so it cannot drift from what labkit does; if the markers are no longer
there, it raises instead of printing something else.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any


def excerpt_lines(obj: Any, first: str, last: str | None = None) -> tuple[int, list[str]]:
    """``(number of the first line in its file, the lines)`` from ``first`` through ``last``.

    ``first`` and ``last`` are substrings of a line; ``last`` is searched from the ``first`` line
    on (``None``: only that one line). A Triton kernel (a ``JITFunction``) is read through ``.fn``.
    """
    obj = getattr(obj, "fn", obj)
    lines, start = inspect.getsourcelines(obj)
    starts = [i for i, line in enumerate(lines) if first in line]
    if not starts:
        raise ValueError(f"first={first!r} is on no line of {getattr(obj, '__qualname__', obj)}")
    i = starts[0]
    if last is None:
        return start + i, [lines[i]]
    ends = [j for j in range(i, len(lines)) if last in lines[j]]
    if not ends:
        raise ValueError(f"last={last!r} is on no line of {getattr(obj, '__qualname__', obj)} "
                         f"at or after the one with first={first!r}")
    return start + i, lines[i:ends[0] + 1]


def excerpt(obj: Any, first: str, last: str | None = None) -> None:
    """Print the lines of ``obj``'s source from ``first`` through ``last``, numbered and dedented."""
    number, lines = excerpt_lines(obj, first, last)
    body = textwrap.dedent("".join(lines)).rstrip("\n").split("\n")
    where = inspect.getsourcefile(getattr(obj, "fn", obj)) or "?"
    print(f"# {where.split('labkit/')[-1] if 'labkit/' in where else where}, "
          f"line {number}{f'-{number + len(body) - 1}' if len(body) > 1 else ''}")
    width = len(str(number + len(body)))
    for k, line in enumerate(body):
        print(f"{number + k:>{width}}  {line}".rstrip())
