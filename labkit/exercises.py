"""Checkers for the exercises at the end of each chapter.

A reader's unsolved stub never breaks a chapter: the checker says "not solved
yet" and names the notebook in solutions/ that holds the answer. In solutions/
the notebook calls ``Exercises(..., strict=True)``, and there a checker that does
not pass raises, so the notebook tests (nbval) fail.

Expected values are always computed, usually with labkit itself, never typed in.

Two rules keep a checker honest:

* any error in the reader's code (other than the stub's ``NotImplementedError``) becomes a ❌
  with the error's type, its message and the hint, never a traceback that hides the verdict;
* ``forbid=`` names labkit functions the exercise asks the reader to write: handing one in
  under a new name, or calling it from inside the answer, is refused. The check watches the
  calls themselves (``sys.setprofile``), so a wrapper or a lambda around the library function
  is caught as well as the function itself.
"""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

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


class _ForbiddenCall(Exception):
    """Raised inside a checker when the reader's answer runs a library function it should replace."""

    def __init__(self, fn: Callable[..., Any]):
        super().__init__(f"{fn.__module__}.{fn.__qualname__}")
        self.fn = fn


def _code_of(fn: Callable[..., Any]) -> Any:
    """The code object a call to ``fn`` runs (through functools.wraps and bound methods)."""
    fn = getattr(fn, "__func__", fn)
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return getattr(fn, "__code__", None)


def _runs_inside(frame: Any, code: Any) -> bool:
    """Whether ``code`` is on the call stack above ``frame``."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


@contextmanager
def _refuse_calls(forbid: Iterable[Callable[..., Any]], answer: Any = None) -> Iterator[None]:
    """Raise ``_ForbiddenCall`` as soon as one of ``forbid`` starts running, under any name.

    With ``answer`` (the reader's function), only calls made while it runs count, so a checker may
    still use the library function to compute what it expects.
    """
    inside = _code_of(answer) if answer is not None else None
    codes = {_code_of(f): f for f in forbid if _code_of(f) is not None}
    if not codes:
        yield
        return
    previous = sys.getprofile()

    def profile(frame, event, arg):  # noqa: ANN001 (sys.setprofile's signature)
        if event == "call" and frame.f_code in codes and (inside is None or _runs_inside(frame, inside)):
            sys.setprofile(None)  # the exception unwinds through frames we no longer need to watch
            raise _ForbiddenCall(codes[frame.f_code])

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)


def _error_text(err: BaseException) -> str:
    text = str(err).strip().split("\n")[0]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


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

    def _forbidden(self, name: str, fn: Callable[..., Any], hint: str) -> None:
        return self._wrong(name, f"your answer uses labkit's own `{fn.__module__}.{fn.__qualname__}`; "
                                 "the exercise is to write it yourself.", hint)

    def _crashed(self, name: str, err: BaseException, hint: str) -> None:
        return self._wrong(name, f"your code raised {_error_text(err)}.", hint)

    def check_function(self, name: str, fn: Callable[..., Any], cases: Iterable[tuple[tuple, Any]], *,
                       rel_tol: float = 0.0, hint: str = "",
                       forbid: Iterable[Callable[..., Any]] = ()) -> None:
        """Call the reader's ``fn(*args)`` for each ``(args, expected)`` case.

        ``forbid``: the library functions this exercise rebuilds; an answer that is one of them,
        or calls one, gets a ❌.
        """
        cases, forbid = list(cases), list(forbid)
        if fn is None or fn is Ellipsis:
            return self._not_solved(name)
        for banned in forbid:
            if _code_of(fn) is not None and _code_of(fn) is _code_of(banned):
                return self._forbidden(name, banned, hint)
        for args, expected in cases:
            try:
                with _refuse_calls(forbid, answer=fn):
                    got = fn(*args)
            except NotImplementedError:
                return self._not_solved(name)
            except _ForbiddenCall as err:
                return self._forbidden(name, err.fn, hint)
            except Exception as err:  # the reader's bug: a verdict, not a traceback
                return self._crashed(name, err, hint)
            if got is None or got is Ellipsis:
                return self._not_solved(name)
            if not _close(got, expected, rel_tol):
                shown = ", ".join(repr(a) if not hasattr(a, "shape") else f"<tensor {tuple(a.shape)}>" for a in args)
                return self._wrong(name, f"{getattr(fn, '__name__', 'fn')}({shown}) gave {got!r}.", hint)
        print(f"✅ {name}: correct on all {len(cases)} cases.")

    def check_behaviour(self, name: str, solution: Any, verify: Callable[[Any], list[str]], *,
                        hint: str = "", forbid: Iterable[Callable[..., Any]] = ()) -> None:
        """Run the reader's ``solution`` (a function, a policy, a setting) and judge what it *does*.

        ``verify(solution)`` exercises it on cases built by the chapter (a workload, a stream,
        random tensors) and returns the list of broken expectations, each a sentence; an
        empty list passes. A stub (``None``, ``...``, or a function raising
        ``NotImplementedError``) counts as not solved yet; any other error is a ❌ with the hint.
        ``forbid`` works as in ``check_function``, while ``verify`` runs.
        """
        forbid = list(forbid)
        if solution is None or solution is Ellipsis:
            return self._not_solved(name)
        for banned in forbid:
            if _code_of(solution) is not None and _code_of(solution) is _code_of(banned):
                return self._forbidden(name, banned, hint)
        try:
            with _refuse_calls(forbid, answer=solution if callable(solution) else None):
                problems = list(verify(solution))
        except NotImplementedError:
            return self._not_solved(name)
        except _ForbiddenCall as err:
            return self._forbidden(name, err.fn, hint)
        except Exception as err:  # the reader's bug: a verdict, not a traceback
            return self._crashed(name, err, hint)
        if problems:
            shown = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
            return self._wrong(name, shown + ".", hint)
        print(f"✅ {name}: the behaviour is right.")
