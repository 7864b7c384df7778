"""Checkers for the exercises at the end of each chapter.

A reader's unsolved stub never breaks a chapter: the checker says "not solved
yet" and names the notebook in solutions/ that holds the answer. In solutions/
the notebook sets ``ex.strict = True``, and there a checker that does not pass
raises, so the notebook tests (nbval) fail.

Expected values are always computed, usually with labkit itself, never typed in, and never in
the reader's cell: a value exercise's is looked up by its name (``labkit.teaching.answers``), the
hidden cases of a "build it" exercise come from ``labkit.teaching.build_it``, a quiz's answers from
``labkit.teaching.quizzes``.

The rules that keep a checker honest, each tried against answers written to game it
(``tests/test_exercise_checkers.py``):

* what the reader hands in is checked for its shape first (a function taking the arguments the
  cases pass, a class with the methods the checker calls: ``guards.AnswerShape``), so ``42`` gets a
  ❌ saying what was expected, never "your code raised" for an error the checker caused;
* any error in the reader's code (other than the stub's ``NotImplementedError``) becomes a ❌
  with the error's type, its message and the hint, never a traceback that hides the verdict;
* an answer is compared as a plain value (numbers, strings, tuples, lists, dicts, tensors),
  so an object that claims to equal everything is refused;
* a function answer gets *copies* of its inputs: rewriting what it was handed changes nothing
  the checker compares against;
* hidden cases are drawn afresh on every run, from the operating system (``guards.hidden_rng``,
  ``guards.draws_hidden_cases``), so an answer fitted to one draw, or pasted from an earlier run,
  fails the next, and a cell that seeds Python's, NumPy's or PyTorch's generators replays nothing;
  a notebook still prints the same verdict line every time;
* ``forbid=`` names the labkit functions (or whole classes) that the exercise asks the reader to
  write. Handing one in under a new name, or calling it from inside the answer, is refused.
  The check watches the calls themselves (``guards.Watch``, a profiler): in the checker's thread, in
  every thread the answer starts, in the workers of thread pools made before, and on Python
  3.12+ in every running thread. An answer that switches the watch off, starts another
  process, or starts a thread the watch cannot see gets a ❌ too;
* ``Metered`` hands an answer a function that counts its calls and keeps the count, and the
  function behind it, out of the answer's reach;
* ``triton_launches`` records which Triton kernels really ran, so a kernel exercise can tell a
  launched kernel from an imitation that computes in PyTorch.

All of this runs in the reader's own Python process, so it guards against shortcuts, not
against an answer that sets out to take the checker apart (``ctypes``, or reading the
checker's frames and private tables): the point is learning, not security.

Bad arguments to a checker itself (an exercise name that is not a string, no cases, a ``forbid``
entry the watch cannot see, an unknown value exercise) are the chapter's bug, not the reader's:
they raise ``ValueError`` naming the parameter, before anything runs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
from typing import Any, Callable, Iterable

import torch

from ..checks import check_flag, check_number
from . import answers, quizzes
from .guards import (AnswerShape, Refused, Watch, accepts, arguments, check_forbid, code_of, described,
                     function_name, functions_of, given_copies)


# --------------------------------------------------------------------------- comparing answers


class _NotPlain(TypeError):
    """An answer of a type the checker does not compare (it could claim to equal anything)."""


_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain types only, so comparing it runs no code of the reader's.

    Numbers, strings, tuples, lists, dicts, sets, tensors (copied, on the CPU), NumPy scalars and
    arrays, and dataclasses (as their type's name and fields). Subclasses are not plain: an
    ``int`` subclass may redefine ``==``. Anything else raises ``_NotPlain``.
    """
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind in (tuple, list):
        return kind(_plain(v) for v in value)
    if kind is dict:
        return {_plain(k): _plain(v) for k, v in value.items()}
    if kind in (set, frozenset):
        return kind(_plain(v) for v in value)
    if isinstance(value, torch.Tensor) and kind.__module__.startswith("torch"):  # torch's own tensor types
        return value.detach().cpu().clone()
    if kind.__module__ == "numpy":  # NumPy's own scalars and arrays, not a subclass defined elsewhere
        if hasattr(value, "item") and getattr(value, "shape", None) == ():
            return _plain(value.item())
        if kind.__name__ == "ndarray" and value.dtype.kind in "biuf":
            return torch.as_tensor(value.copy())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (kind.__qualname__,) + tuple(_plain(getattr(value, f.name)) for f in dataclasses.fields(value))
    raise _NotPlain(f"of type `{kind.__name__}`")


def _close(got: Any, expected: Any, rel_tol: float) -> bool:
    """Whether two plain values are equal: floats within ``rel_tol``, tensors of one shape elementwise."""
    if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        try:
            got, expected = torch.as_tensor(got), torch.as_tensor(expected)
            return got.shape == expected.shape and bool(torch.allclose(
                got.double(), expected.double(), rtol=max(rel_tol, 1e-9), atol=1e-9))
        except (TypeError, ValueError, RuntimeError):  # a reader's answer of the wrong kind
            return False
    if isinstance(expected, float) or isinstance(got, float):
        try:
            return math.isclose(float(got), float(expected), rel_tol=rel_tol, abs_tol=1e-12)
        except (TypeError, ValueError):
            return False
    if type(expected) in (tuple, list) and type(got) is type(expected):
        return len(got) == len(expected) and all(_close(g, e, rel_tol) for g, e in zip(got, expected))
    if type(expected) is dict and type(got) is dict:
        return got.keys() == expected.keys() and all(_close(got[k], expected[k], rel_tol) for k in expected)
    return got == expected


# --------------------------------------------------------------------------- the checkers


def _error_text(err: BaseException) -> str:
    text = str(err).strip().split("\n")[0]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _short(value: Any) -> str:
    """A value for a verdict line: tensors by shape and first numbers, long reprs cut."""
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.flatten()[:4].tolist()}...>"
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _shown(args: tuple) -> str:
    return ", ".join(f"<tensor {tuple(a.shape)}>" if isinstance(a, torch.Tensor) else repr(a) for a in args)


_BY_NAME = object()  # ``check`` without ``expected``: look the value up by the exercise's name


def _check_text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    return value


def _check_cases(cases: Any) -> list[tuple[tuple, Any]]:
    """``cases`` as a list of ``(args, expected)`` pairs, ``args`` a tuple or list; at least one."""
    if isinstance(cases, (str, bytes)) or not hasattr(cases, "__iter__"):
        raise ValueError(f"cases must be a list of (args, expected) pairs, got {type(cases).__name__}")
    cases = list(cases)
    if not cases:
        raise ValueError("cases must hold at least one (args, expected) pair, got none: a checker with no "
                         "case passes every answer")
    for case in cases:
        if type(case) not in (tuple, list) or len(case) != 2 or type(case[0]) not in (tuple, list):
            raise ValueError(f"cases must be (args, expected) pairs with args a tuple, got {_short(case)}")
    return cases


def _check_expects(expects: Any) -> AnswerShape | None:
    if expects is not None and not isinstance(expects, AnswerShape):
        raise ValueError(f"expects must be None or an AnswerShape (guards.function_shape, guards.class_shape), "
                         f"got {type(expects).__name__}")
    return expects


def _call_problem(fn: Any, cases: list[tuple[tuple, Any]]) -> str:
    """'' when ``fn`` can be called as every case calls it, else what was expected (no shape was named)."""
    for args, _ in cases:
        if not callable(fn) or not accepts(fn, len(args)):
            got = described(fn) + (f", which cannot be called with {arguments(len(args))}" if callable(fn) else "")
            return f"expected a function of {arguments(len(args))}, as the cases call it: f({_shown(args)}); got {got}"
    return ""


class Exercises:
    """The exercise checker of one chapter, e.g. ``ex = Exercises("03_paging")``."""

    def __init__(self, chapter: str, strict: bool = False):
        if not isinstance(chapter, str) or not chapter:
            raise ValueError(f"chapter must be the chapter's name, such as '03_paging', got {chapter!r}")
        self.chapter = chapter
        self.strict = check_flag("strict", strict)

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

    def _refused(self, name: str, reason: str, hint: str) -> None:
        return self._wrong(name, f"your answer {reason}.", hint)

    def _crashed(self, name: str, err: BaseException, hint: str) -> None:
        return self._wrong(name, f"your code raised {_error_text(err)}.", hint)

    def _not_plain(self, name: str, err: _NotPlain, hint: str) -> None:
        return self._wrong(name, f"your answer is {err}; give a plain value (a number, a string, a tuple, a list, "
                                 "a dict or a tensor).", hint)

    def _handed_in(self, name: str, answer: Any, forbid: list[Any], hint: str) -> bool:
        """Refuse an answer that *is* a forbidden function under another name."""
        code = code_of(answer)
        for item in forbid:
            for f in functions_of(item):
                if code is f.__code__:
                    self._refused(name, f"is `{function_name(f)}` itself; the exercise is to write it yourself", hint)
                    return True
        return False

    def check(self, name: str, answer: Any, expected: Any = _BY_NAME, *, rel_tol: float | None = None,
              hint: str = "") -> None:
        """Compare a value the reader computed with the expected one.

        A chapter's cell gives no ``expected``: the value is computed out of the reader's sight, from the
        chapter and the exercise's name (``labkit.teaching.answers``), with that exercise's tolerance.
        """
        _check_text("name", name)
        _check_text("hint", hint)
        if rel_tol is not None:
            check_number("rel_tol", rel_tol, 0.0, finite=True)
        compute = answers.lookup(self.chapter, name) if expected is _BY_NAME else None
        if answer is None or answer is Ellipsis:
            return self._not_solved(name)
        if compute is not None:
            expected, tol = compute()
            rel_tol = tol if rel_tol is None else rel_tol
        rel_tol = 0.0 if rel_tol is None else rel_tol
        try:
            got = _plain(answer)
        except _NotPlain as err:
            return self._not_plain(name, err, hint)
        if not _close(got, _plain(expected), rel_tol):
            return self._wrong(name, f"Your answer was {got!r}.", hint)
        print(f"✅ {name}: correct.")

    def check_function(self, name: str, fn: Callable[..., Any], cases: Iterable[tuple[tuple, Any]], *,
                       rel_tol: float = 0.0, hint: str = "", forbid: Iterable[Any] = (),
                       expects: AnswerShape | None = None) -> None:
        """Call the reader's ``fn(*args)`` for each ``(args, expected)`` case.

        ``fn`` gets deep copies of ``args``, and its result is compared as a plain value.
        ``forbid``: the library functions (or classes) this exercise rebuilds; an answer that is
        one of them, or calls one, in any thread, gets a ❌. ``expects``: the function's shape, for
        the ❌ an answer of another shape gets before any case runs (``build_it.Cases`` carry theirs;
        without one, ``fn`` must take as many arguments as the cases pass).
        """
        _check_text("name", name)
        _check_text("hint", hint)
        check_number("rel_tol", rel_tol, 0.0, finite=True)
        expects = _check_expects(expects) or getattr(cases, "expects", None)
        cases, forbid = _check_cases(cases), check_forbid(forbid)
        if fn is None or fn is Ellipsis:
            return self._not_solved(name)
        problem = expects.problem(fn) if expects is not None else _call_problem(fn, cases)
        if problem:
            return self._wrong(name, problem + ".", hint)
        if self._handed_in(name, fn, forbid, hint):
            return None
        for args, expected in cases:
            watch = Watch(forbid, answer=fn)
            given = copy.deepcopy(args)
            try:
                with watch:
                    got = _plain(fn(*given))  # made plain while watched: nothing of the answer's runs later
            except Refused:
                pass  # the watch holds the reason
            except NotImplementedError:
                if watch.violation is None:
                    return self._not_solved(name)
            except _NotPlain as err:
                if watch.violation is None:
                    return self._not_plain(name, err, hint)
            except Exception as err:  # the reader's bug: a verdict, not a traceback
                if watch.violation is None:
                    return self._crashed(name, err, hint)
            if watch.violation is not None:
                return self._refused(name, watch.violation, hint)
            if got is None or got is Ellipsis:
                return self._not_solved(name)
            if not _close(got, _plain(expected), rel_tol):
                return self._wrong(name, f"{getattr(fn, '__name__', 'fn')}({_shown(args)}) gave {_short(got)}, "
                                         f"expected {_short(_plain(expected))}.", hint)
        print(f"✅ {name}: correct on all {len(cases)} cases.")

    def check_behaviour(self, name: str, solution: Any, verify: Callable[[Any], list[str]], *,
                        hint: str = "", forbid: Iterable[Any] = (), expects: AnswerShape | None = None) -> None:
        """Run the reader's ``solution`` (a function, a policy, a setting) and judge what it *does*.

        ``verify(solution)`` exercises it on cases built by the chapter (a workload, a stream,
        random tensors) and returns the list of broken expectations, each a sentence; an
        empty list passes. A function ``solution`` is handed to ``verify`` wrapped so that it
        gets deep copies of its arguments (``given_copies``). A stub (``None``, ``...``, or a
        function raising ``NotImplementedError``) counts as not solved yet; any other error is
        a ❌ with the hint. ``forbid`` works as in ``check_function``, while ``verify`` runs.
        ``expects``: the solution's shape, checked before ``verify`` runs (``build_it``'s verifiers
        check their own first).
        """
        _check_text("name", name)
        _check_text("hint", hint)
        if not callable(verify):
            raise ValueError(f"verify must be a function verify(solution) -> list of problems, got "
                             f"{type(verify).__name__}")
        expects, forbid = _check_expects(expects), check_forbid(forbid)
        if solution is None or solution is Ellipsis:
            return self._not_solved(name)
        if expects is not None and (problem := expects.problem(solution)):
            return self._wrong(name, problem + ".", hint)
        if self._handed_in(name, solution, forbid, hint):
            return None
        handed = given_copies(solution) if isinstance(solution, (types.FunctionType, types.MethodType)) else solution
        watch = Watch(forbid, answer=solution if callable(solution) else None)
        problems: list[str] = []
        try:
            with watch:
                problems = list(verify(handed))
        except Refused:
            pass
        except NotImplementedError:
            if watch.violation is None:
                return self._not_solved(name)
        except Exception as err:  # the reader's bug: a verdict, not a traceback
            if watch.violation is None:
                return self._crashed(name, err, hint)
        if watch.violation is not None:
            return self._refused(name, watch.violation, hint)
        if problems:
            shown = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
            return self._wrong(name, shown + ".", hint)
        print(f"✅ {name}: the behaviour is right.")

    def quiz(self, answers: dict[int, Any]) -> None:
        """Check the chapter's quiz: one line per question, with its feedback (``labkit.teaching.quizzes``).

        ``answers`` maps the question's number to a letter (multiple choice) or a number. A question
        left at ``None`` is not answered yet; in solutions/ (``strict``) every answer must be right.
        """
        lines, wrong, open_ = quizzes.verdicts(self.chapter, answers)
        for line in lines:
            print(line)
        if self.strict and (wrong or open_):
            raise AssertionError(f"quiz: {wrong} wrong, {open_} not answered")
