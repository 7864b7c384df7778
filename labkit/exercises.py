"""Checkers for the exercises at the end of each chapter.

A reader's unsolved stub never breaks a chapter: the checker says "not solved
yet" and names the notebook in solutions/ that holds the answer. In solutions/
the notebook calls ``Exercises(..., strict=True)``, and there a checker that does
not pass raises, so the notebook tests (nbval) fail.

Expected values are always computed, usually with labkit itself, never typed in.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch


def _close(got: Any, expected: Any, rel_tol: float) -> bool:
    if isinstance(expected, float) or isinstance(got, float):
        try:
            return math.isclose(float(got), float(expected), rel_tol=rel_tol, abs_tol=1e-12)
        except (TypeError, ValueError):
            return False
    if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        try:
            return bool(torch.allclose(torch.as_tensor(got).double(), torch.as_tensor(expected).double(),
                                       rtol=max(rel_tol, 1e-9), atol=1e-9))
        except (TypeError, ValueError, RuntimeError):  # a reader's answer of the wrong kind or shape
            return False
    return got == expected


class Exercises:
    """The exercise checker of one chapter, e.g. ``ex = Exercises("03_paging")``."""

    def __init__(self, chapter: str, strict: bool = False):
        self.chapter = chapter
        self.strict = strict

    # Checkers print their verdict and return None, so a notebook cell shows only the message.
    def _not_solved(self, name: str) -> None:
        msg = f"⏳ {name}: not solved yet. The worked answer is in solutions/{self.chapter}.ipynb."
        if self.strict:
            raise AssertionError(msg)
        print(msg)

    def _wrong(self, name: str, detail: str, hint: str) -> None:
        msg = f"❌ {name}: not yet. {detail}" + (f" Hint: {hint}" if hint else "")
        if self.strict:
            raise AssertionError(msg)
        print(msg)

    def check(self, name: str, answer: Any, expected: Any, *, rel_tol: float = 0.0, hint: str = "") -> None:
        """Compare a value the reader computed with the expected one."""
        if answer is None or answer is Ellipsis:
            return self._not_solved(name)
        if not _close(answer, expected, rel_tol):
            return self._wrong(name, f"Your answer was {answer!r}.", hint)
        print(f"✅ {name}: correct.")

    def check_function(self, name: str, fn: Callable[..., Any], cases: Iterable[tuple[tuple, Any]], *,
                       rel_tol: float = 0.0, hint: str = "") -> None:
        """Call the reader's ``fn(*args)`` for each ``(args, expected)`` case."""
        cases = list(cases)
        for args, expected in cases:
            try:
                got = fn(*args)
            except NotImplementedError:
                return self._not_solved(name)
            if got is None or got is Ellipsis:
                return self._not_solved(name)
            if not _close(got, expected, rel_tol):
                shown = ", ".join(repr(a) if not hasattr(a, "shape") else f"<tensor {tuple(a.shape)}>" for a in args)
                return self._wrong(name, f"{getattr(fn, '__name__', 'fn')}({shown}) gave {got!r}.", hint)
        print(f"✅ {name}: correct on all {len(cases)} cases.")

    def check_behaviour(self, name: str, solution: Any, verify: Callable[[Any], list[str]], *,
                        hint: str = "") -> None:
        """Run the reader's ``solution`` (a function, a policy, a setting) and judge what it *does*.

        ``verify(solution)`` exercises it on cases built by the chapter (a workload, a stream,
        random tensors) and returns the list of broken expectations, each a sentence; an
        empty list passes. A stub (``None``, ``...``, or a function raising
        ``NotImplementedError``) counts as not solved yet.
        """
        if solution is None or solution is Ellipsis:
            return self._not_solved(name)
        try:
            problems = list(verify(solution))
        except NotImplementedError:
            return self._not_solved(name)
        if problems:
            shown = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
            return self._wrong(name, shown + ".", hint)
        print(f"✅ {name}: the behaviour is right.")
