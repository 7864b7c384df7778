"""What keeps an exercise checker honest: fresh hidden cases, copies, counted calls, and a watch on calls.

``labkit.teaching.exercises`` judges a reader's answer with these:

* ``hidden_rng``, ``draws_hidden_cases``: a checker's hidden cases are drawn afresh on every run, from
  the operating system; a cell that seeds the global generators, or reassigns a module attribute once
  the checker is defined, cannot replay them;
* ``given_copies``: an answer gets deep copies of its inputs, so rewriting them changes nothing the
  checker compares against;
* ``Metered``: a function that counts its calls, with the count and the function out of the answer's reach;
* ``triton_launches``: which Triton kernels really ran, so a kernel exercise can tell a launched
  kernel from an imitation that computes in PyTorch;
* ``Watch``: a profiler that refuses the functions an exercise asks the reader to write
  (``forbid=``), in every thread the answer starts, and anything that would slip past it
  (another process, switching the watch off);
* ``AnswerShape``: what the reader must hand in (a function with these parameters, a class with
  these methods), checked before any hidden case runs, so that ``42`` gets "expected a function
  plan_step(...); got int 42" and not an error the checker itself caused.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import inspect
import os
import random
import sys
import threading
import types
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch

from ..checks import check_int


# --------------------------------------------------------------------------- hidden cases and copies


def hidden_rng() -> random.Random:
    """A random generator for a checker's hidden cases: every number it gives comes from the operating system.

    ``random.SystemRandom`` reads ``os.urandom`` at each draw. It has no seed and no state: its
    ``seed`` does nothing, and seeding the global generators in a notebook cell (``random.seed``,
    ``numpy.random.seed``, ``torch.manual_seed``) does not reach it. Every run draws new cases, so
    no answer can be fitted to them; build the cases so that each run covers the same kinds (edges
    included), and the verdict line stays the same.
    """
    return random.SystemRandom()


Checker = TypeVar("Checker", bound=Callable[..., Any])


def draws_hidden_cases(checker: Checker) -> Checker:
    """A checker that draws its cases from a generator of its own: ``checker(rng, ...)`` is called as
    ``checker(...)``, and each call gets a new ``random.SystemRandom`` (see ``hidden_rng``).

    The generator's class is taken once, here, when the checker is defined, and kept in the
    wrapper: a cell that later reassigns ``hidden_rng`` (in this module or in the checker's), or
    ``random.SystemRandom``, cannot fix or replay what the checker draws. (A cell can still take
    the checker apart, rewriting its code; the guards stop shortcuts, not sabotage.)
    """
    parameters = list(inspect.signature(checker).parameters.values()) \
        if isinstance(checker, types.FunctionType) else []
    if not parameters or parameters[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                    inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise ValueError(f"checker must be a function whose first parameter takes the generator (rng), got "
                         f"{described(checker)}")
    system_random = random.SystemRandom  # bound now: reassigning a module attribute later does not reach it

    @functools.wraps(checker)
    def with_its_own_generator(*args: Any, **kwargs: Any) -> Any:
        return checker(system_random(), *args, **kwargs)

    signature = inspect.signature(checker)
    with_its_own_generator.__signature__ = signature.replace(parameters=parameters[1:])  # what a caller passes
    return with_its_own_generator  # type: ignore[return-value]


def torch_generator(rng: random.Random) -> torch.Generator:
    """A ``torch.Generator`` seeded from ``rng``, for random tensors in hidden cases."""
    if not isinstance(rng, random.Random):
        raise ValueError(f"rng must be a random.Random (hidden_rng()), got {type(rng).__name__}")
    return torch.Generator().manual_seed(rng.getrandbits(62))


def given_copies(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, called with deep copies of its arguments: what the answer rewrites stays its own.

    Objects that must stay shared (such as a ``Metered`` function) return themselves from
    ``__deepcopy__``.
    """
    if not callable(fn):
        raise ValueError(f"fn must be a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def with_copies(*args: Any, **kwargs: Any) -> Any:
        return fn(*copy.deepcopy(args), **copy.deepcopy(kwargs))

    return with_copies


# --------------------------------------------------------------------------- a function that counts its calls


class TooManyCalls(Exception):
    """Raised by a ``Metered`` function at each call past its limit."""


class _Meter:
    def __init__(self, fn: Callable[..., Any], limit: int):
        self.fn, self.limit, self.calls = fn, limit, 0


_METERS: "weakref.WeakKeyDictionary[Metered, _Meter]" = weakref.WeakKeyDictionary()


class Metered:
    """``fn`` behind a counter: the answer may call it ``limit`` times, and cannot undo a call.

    The function and its count are kept in a table private to this module, not in the object:
    it has no attributes, no closure, cannot be copied (a copy is the object itself) or pickled,
    so an answer can neither reset the count nor reach the uncounted function. The checker
    reads the count with ``calls_made``.
    """

    __slots__ = ("__weakref__",)

    def __init__(self, fn: Callable[..., Any], limit: int):
        if not callable(fn):
            raise ValueError(f"fn must be a function, got {type(fn).__name__}")
        _METERS[self] = _Meter(fn, check_int("limit", limit, 0))

    def __call__(self, *args: Any) -> Any:
        meter = _METERS[self]
        meter.calls += 1
        if meter.calls > meter.limit:
            raise TooManyCalls(f"more than {meter.limit} calls")
        return meter.fn(*args)

    def __repr__(self) -> str:
        return "<a function that counts its calls>"

    def __copy__(self) -> "Metered":
        return self

    def __deepcopy__(self, memo: dict) -> "Metered":
        return self

    def __reduce__(self) -> Any:
        raise TypeError("a Metered function cannot be pickled")


def calls_made(metered: Metered) -> int:
    """How many times ``metered`` was called, refused calls included."""
    if not isinstance(metered, Metered):
        raise ValueError(f"metered must be a Metered function, got {type(metered).__name__}")
    return _METERS[metered].calls


# --------------------------------------------------------------------------- Triton kernels that really ran


def _triton_classes() -> tuple[type, ...]:
    """The classes ``@triton.jit`` makes: compiled (``JITFunction``) and interpreted."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return JITFunction, InterpretedFunction


def is_triton_kernel(kernel: object) -> bool:
    """Whether ``kernel`` is what ``@triton.jit`` returns, untouched: not a subclass, no ``run`` of its own."""
    if importlib.util.find_spec("triton") is None:
        return False
    return type(kernel) in _triton_classes() and "run" not in vars(kernel)


def _from_triton(fn: Callable[..., Any]) -> bool:
    import triton

    code = getattr(fn, "__code__", None)
    return code is not None and code.co_filename.startswith(os.path.dirname(triton.__file__))


@contextmanager
def triton_launches() -> Iterator[list[tuple[Callable[..., Any], Any]]]:
    """Record ``(python function, grid)`` of every Triton kernel launched while the block runs.

    It wraps the two places a launch ends up, ``JITFunction.run`` (compiled) and the
    interpreter's ``GridExecutor`` (every program of the grid run on the CPU), and records a
    launch once it has run. If either was replaced by something outside Triton, nothing is
    recorded: an output is the work of a kernel only if the kernel is on this list.
    """
    from triton.runtime import interpreter, jit

    launched: list[tuple[Callable[..., Any], Any]] = []
    compiled_run, interpreted_call = jit.JITFunction.run, interpreter.GridExecutor.__call__
    honest = _from_triton(compiled_run) and _from_triton(interpreted_call)

    def recording_run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001 (Triton's signature)
        kernel = compiled_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        if honest and not warmup and kernel is not None:
            launched.append((self.fn, grid))
        return kernel

    def recording_call(self, *args, **kwargs):  # noqa: ANN001
        interpreted_call(self, *args, **kwargs)
        originals = {id(rewritten): fn for fn, rewritten in interpreter.InterpretedFunction.rewritten_fn.items()}
        if honest:
            launched.append((originals.get(id(self.fn), self.fn), self.grid))

    jit.JITFunction.run, interpreter.GridExecutor.__call__ = recording_run, recording_call
    try:
        yield launched
    finally:
        jit.JITFunction.run, interpreter.GridExecutor.__call__ = compiled_run, interpreted_call


# --------------------------------------------------------------------------- watching the answer's calls


class Refused(BaseException):
    """Raised inside a checker when the answer does what the watch refuses.

    A ``BaseException``, so an answer's ``except Exception`` does not swallow it; the watch
    also records the reason, so even a swallowed refusal gives a ❌.
    """


def functions_of(item: Any) -> list[types.FunctionType]:
    """The Python functions behind a forbid entry: a function, a method, a property, or a whole class."""
    if isinstance(item, type):
        return [f for klass in item.__mro__[:-1]  # the class and its bases, not ``object``
                for attr in vars(klass).values() if not isinstance(attr, type) for f in functions_of(attr)]
    if isinstance(item, property):
        return [f for g in (item.fget, item.fset, item.fdel) if g is not None for f in functions_of(g)]
    if isinstance(item, (staticmethod, classmethod)):
        return functions_of(item.__func__)
    if isinstance(item, functools.cached_property):
        return functions_of(item.func)
    fn = getattr(item, "__func__", item)  # a bound method: its function
    found = []
    while True:
        if isinstance(fn, types.FunctionType):
            found.append(fn)
        if not hasattr(fn, "__wrapped__"):
            return found
        fn = fn.__wrapped__  # functools.wraps: the wrapper and the function it wraps


def check_forbid(forbid: Iterable[Any]) -> list[Any]:
    """``forbid`` as a list, each entry something the watch can see: a Python function, a method, a
    property or a class. A builtin (or a number) has no Python code to watch, so it would forbid nothing."""
    if isinstance(forbid, (str, bytes)) or not hasattr(forbid, "__iter__"):
        raise ValueError(f"forbid must be a list of functions or classes, got {type(forbid).__name__}")
    items = list(forbid)
    for item in items:
        if not functions_of(item):
            raise ValueError(f"forbid must hold Python functions, methods, properties or classes (what the "
                             f"watch can see), got {item!r}")
    return items


def code_of(fn: Any) -> Any:
    """The code object a call to the reader's ``fn`` runs first (through functools.wraps, bound
    methods, functools.partial and callable objects)."""
    if isinstance(fn, functools.partial):
        return code_of(fn.func)
    inner = getattr(fn, "__func__", fn)
    while hasattr(inner, "__wrapped__"):
        inner = inner.__wrapped__
    if isinstance(inner, types.FunctionType):
        return inner.__code__
    call = getattr(type(fn), "__call__", None)  # a callable object: its __call__
    return call.__code__ if isinstance(call, types.FunctionType) else None


def _runs_inside(frame: Any, code: Any) -> bool:
    """Whether ``code`` is on the call stack at ``frame`` or above it."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def function_name(fn: Callable[..., Any]) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _process_entry_points() -> dict[Any, str]:
    """The Python functions through which work reaches another process, where no watch can follow:
    starting one, and sending to one started before (a pipe, a queue, a pool)."""
    import multiprocessing.connection
    import multiprocessing.pool
    import multiprocessing.process
    import multiprocessing.queues
    import subprocess
    from concurrent.futures import process

    reason = "hands work to another process (`{}`), where the checker cannot watch it"
    functions = [multiprocessing.process.BaseProcess.start, multiprocessing.connection._ConnectionBase.send,
                 multiprocessing.connection._ConnectionBase.send_bytes, multiprocessing.queues.Queue.put,
                 multiprocessing.pool.Pool._check_running, process.ProcessPoolExecutor.submit, subprocess.Popen.__init__]
    return {f.__code__: reason.format(function_name(f)) for f in functions}


def _refused_builtins() -> dict[Any, str]:
    """C functions an answer may not call while watched, each with the reason."""
    import _thread

    refused: dict[Any, str] = {sys.setprofile: "switches the checker's watch off (`sys.setprofile`)",
                               sys.getprofile: "reads the checker's watch (`sys.getprofile`)"}
    if hasattr(sys, "_setprofileallthreads"):  # Python 3.12+
        refused[sys._setprofileallthreads] = "switches the checker's watch off (`sys._setprofileallthreads`)"
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve"):
        if hasattr(os, name):
            refused[getattr(os, name)] = f"starts another process (`os.{name}`), where the checker cannot watch it"
    try:
        import _posixsubprocess

        refused[_posixsubprocess.fork_exec] = "starts another process (`_posixsubprocess.fork_exec`), where the " \
                                              "checker cannot watch it"
    except ImportError:  # not on Windows
        pass
    for name in ("start_new", "start_new_thread", "start_joinable_thread"):  # the alias first: the name wins
        if hasattr(_thread, name):
            refused[getattr(_thread, name)] = (f"starts a thread with `_thread.{name}`, where the checker cannot "
                                               "watch it (threading.Thread is watched)")
    return refused


_THREAD_START = threading.Thread.start.__code__
_BOOTSTRAP_INNER = threading.Thread._bootstrap_inner.__code__


def _refused_functions() -> dict[Any, str]:
    """Python functions an answer may not call while watched (code object: reason)."""
    refused = {f.__code__: f"changes the checker's watch (`threading.{f.__name__}`)"
               for f in (getattr(threading, n, None) for n in ("setprofile", "getprofile", "setprofile_all_threads"))
               if f is not None}
    return {**refused, **_process_entry_points()}


def _work_item_class() -> type | None:
    """``concurrent.futures``' work item: its ``run`` is what a pool's worker thread calls."""
    try:
        from concurrent.futures import thread
    except ImportError:
        return None
    return getattr(thread, "_WorkItem", None)


class Watch:
    """A profiler that refuses the forbidden functions while the reader's answer runs.

    ``sys.setprofile`` reports every function call of one thread to a callback; the watch
    installs itself in the checker's thread, in threads started while it is open
    (``threading.setprofile``), on Python 3.12+ in every running thread, and around each job a
    ``concurrent.futures`` thread pool runs (its workers may predate the check). A call is the
    answer's when the answer's code is on the stack, or when it happens in another thread.

    It refuses: the forbidden functions; switching the watch off or reading it; starting a
    process or sending it work (nothing there can be watched); starting a thread outside
    ``threading``; and a thread the answer started that ran without the watch. After the answer it checks that it is still the
    profiler everywhere it put itself. ``violation`` says what went wrong, or is ``None``.

    Only a watch with something to forbid profiles anything; an empty one costs nothing.
    """

    def __init__(self, forbid: Iterable[Any], answer: Any = None):
        banned = {f.__code__: f"calls `{function_name(f)}`; the exercise is to write it yourself"
                  for item in check_forbid(forbid) for f in functions_of(item)}
        # What each watched code object means, by id (a cheap key: this is looked up at every call).
        self._codes: dict[int, tuple[Any, str | None]] = {}
        if banned:
            global _REFUSED_FUNCTIONS
            if _REFUSED_FUNCTIONS is None:
                _REFUSED_FUNCTIONS = _refused_functions()
            for code, reason in {**_REFUSED_FUNCTIONS, **banned}.items():
                self._codes[id(code)] = (code, reason)
            self._codes[id(_THREAD_START)] = (_THREAD_START, None)  # a thread starts: note it
        self.inside = code_of(answer) if answer is not None else None
        self.violation: str | None = None
        self._open = False
        self._thread = 0
        self._started: list[threading.Thread] = []  # threads started while open
        self._ran: set[int] = set()  # threads that ran their target under the watch

    # The profile callback: kept short, it runs at every call while the answer runs.
    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self._open:
            sys.setprofile(None)  # a thread that outlived the check: stop watching it
            return
        if event == "call":
            entry = self._codes.get(id(frame.f_code))
            if entry is None:
                back = frame.f_back
                if back is not None and back.f_code is _BOOTSTRAP_INNER:
                    self._ran.add(threading.get_ident())  # a new thread's run(): it is watched
            elif entry[1] is None:
                self._started.append(frame.f_locals.get("self"))  # threading.Thread.start
            elif self._by_answer(frame):
                self._refuse(entry[1])
        elif event == "c_call":
            try:
                reason = _REFUSED.get(arg)
            except TypeError:  # an unhashable callable: nothing refused
                return
            if reason is None or frame.f_code in _OWN_CODES:
                return
            if frame.f_code is _THREAD_START and "thread" in reason:
                return  # threading.Thread.start itself: its thread gets the watch
            if self._by_answer(frame):
                self._refuse(reason)

    def _by_answer(self, frame: Any) -> bool:
        if threading.get_ident() != self._thread:
            return True  # another thread: only the answer starts threads or hands them work while watched
        return self.inside is None or _runs_inside(frame, self.inside)

    def _refuse(self, reason: str) -> None:
        if self.violation is None:
            self.violation = reason
        sys.setprofile(None)  # the exception unwinds through frames there is no need to watch
        raise Refused(reason)

    def _watched_job(self, run: Callable[[Any], None]) -> Callable[[Any], None]:
        """A thread pool job's ``run``, under the watch (the pool's worker may be older than the check)."""
        def run_watched(item: Any) -> None:
            _run_watched(self, run, item)

        return run_watched

    def __enter__(self) -> "Watch":
        if not self._codes:
            return self
        self._thread = threading.get_ident()
        self._previous = (sys.getprofile(), threading._profile_hook)
        self._work_item = _work_item_class()
        if self._work_item is not None:
            self._job_run = self._work_item.run
            self._watched_run = self._watched_job(self._job_run)
            self._work_item.run = self._watched_run
        self._open = True
        threading.setprofile(self)
        if hasattr(threading, "setprofile_all_threads"):  # Python 3.12+: threads already running too
            threading.setprofile_all_threads(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: Any) -> bool:
        if not self._codes:
            return False
        tampered = sys.getprofile() is not self or threading._profile_hook is not self or \
            (self._work_item is not None and vars(self._work_item).get("run") is not self._watched_run)
        for t in self._started:  # each thread the answer started must have run under the watch
            if t is not None and t.ident not in self._ran and self.violation is None:
                t.join(timeout=1.0)  # it may not have reached its target yet
                if t.ident not in self._ran and self.violation is None:
                    self.violation = "starts a thread that ran without the checker's watch"
        self._open = False
        _restore_profiler(self._previous[0])
        threading.setprofile(self._previous[1])
        if self._work_item is not None:
            self._work_item.run = self._job_run
        if tampered and self.violation is None:
            self.violation = "switched off or replaced the checker's watch (sys.setprofile / threading.setprofile)"
        return False


def _restore_profiler(previous: Any) -> None:
    """Put back the profiler this thread had: a Python callback, or a C profiler such as cProfile's."""
    if previous is None or callable(previous):
        sys.setprofile(previous)
    elif callable(getattr(previous, "enable", None)):  # cProfile.Profile: it installs itself
        sys.setprofile(None)
        previous.enable()
    else:
        sys.setprofile(None)


def _run_watched(watch: Watch, run: Callable[[Any], None], item: Any) -> None:
    """``run(item)`` with ``watch`` as this thread's profiler, then the profiler it had before."""
    previous = sys.getprofile()
    sys.setprofile(watch)
    try:
        run(item)
    finally:
        _restore_profiler(previous)


_REFUSED = _refused_builtins()
_REFUSED_FUNCTIONS: dict[Any, str] | None = None  # _refused_functions(), made by the first watch
_OWN_CODES = {Watch.__enter__.__code__, Watch.__exit__.__code__, _run_watched.__code__, _restore_profiler.__code__}


# --------------------------------------------------------------------------- the shape of an answer


def accepts(fn: Any, num_args: int) -> bool:
    """Whether ``fn`` can be called with ``num_args`` positional arguments (``inspect.signature`` and
    ``bind``: nothing of ``fn`` runs). A callable without a readable signature (some builtins) is given
    the benefit of the doubt: calling it will tell."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*range(num_args))
    except TypeError:
        return False
    return True


def arguments(n: int) -> str:
    """``1 argument``, ``2 arguments``: for the messages."""
    return f"{n} argument" + ("" if n == 1 else "s")


def described(value: Any) -> str:
    """What the reader handed in, in a few words: ``int 42``, ``function <lambda>()``, ``class Pager``."""
    if isinstance(value, type):
        return f"class {value.__name__}"
    if callable(value):
        try:
            signature = str(inspect.signature(value))
        except (TypeError, ValueError):
            signature = "(...)"
        kind = "function" if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)) \
            else type(value).__name__
        return f"{kind} {getattr(value, '__name__', type(value).__name__)}{signature}"
    if type(value).__repr__ is object.__repr__:  # "<__main__.Pager object at 0x7f...>" says no more
        return f"{type(value).__name__} object"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:80] + '...'}"


def _method_accepts(cls: type, method: str, num_args: int) -> bool:
    """Whether ``cls().method`` takes ``num_args`` arguments, read from the class (no instance is made)."""
    static = inspect.getattr_static(cls, method)
    if isinstance(static, types.FunctionType):  # a plain method: ``self`` comes first
        return accepts(static, num_args + 1)
    return accepts(getattr(cls, method), num_args)  # a staticmethod, a classmethod, something callable


@dataclass(frozen=True)
class AnswerShape:
    """What an exercise asks the reader to hand in: a function ``name(parameters)``, or, with
    ``methods`` (method name, its parameters after ``self``), a class built as ``name(parameters)``.

    ``problem(answer)`` says, before any hidden case runs, how the answer differs from that shape
    ("expected a function plan_step(running, ...); got int 42"), or returns ``""``. The checker
    calls the answer positionally, so each parameter must take a positional argument; the names are
    the exercise's, for the message (the reader's may differ).
    """

    name: str
    parameters: tuple[str, ...]
    methods: tuple[tuple[str, tuple[str, ...]], ...] | None = None  # None: a function

    def __post_init__(self) -> None:
        lists = [self.parameters, *(p for _, p in self.methods or ())]
        names = [self.name, *(m for m, _ in self.methods or ()), *(n for names in lists for n in names)]
        if not all(type(x) is tuple for x in lists) or \
                not all(isinstance(n, str) and n.isidentifier() for n in names):
            raise ValueError(f"name, parameters and methods must be Python names (parameters a tuple of them), "
                             f"got {self.name!r}, {self.parameters!r}, {self.methods!r}")

    def __str__(self) -> str:
        call = f"{self.name}({', '.join(self.parameters)})"
        if self.methods is None:
            return f"a function {call}"
        listed = ", ".join(f"{m}({', '.join(p)})" for m, p in self.methods)
        return f"a class {call} with the methods {listed}"

    def problem(self, answer: Any) -> str:
        why = self._function_problem(answer) if self.methods is None else self._class_problem(answer)
        return f"expected {self}; got {why}" if why else ""

    def _function_problem(self, answer: Any) -> str:
        if not callable(answer):
            return described(answer)
        if not accepts(answer, len(self.parameters)):
            return f"{described(answer)}, which cannot be called with {arguments(len(self.parameters))}"
        return ""

    def _class_problem(self, answer: Any) -> str:
        if not isinstance(answer, type):
            instance = all(callable(getattr(answer, m, None)) for m, _ in self.methods)
            return described(answer) + (" (an instance: hand in the class itself)" if instance else "")
        if not accepts(answer, len(self.parameters)):
            return f"{described(answer)}, which cannot be built with {arguments(len(self.parameters))}"
        for method, parameters in self.methods:
            if not callable(getattr(answer, method, None)):
                return f"{described(answer)}, which has no method {method}"
            if not _method_accepts(answer, method, len(parameters)):
                return f"{described(answer)}, whose {method} cannot be called with ({', '.join(parameters)})"
        return ""


def function_shape(name: str, *parameters: str) -> AnswerShape:
    """The shape of a function answer: ``function_shape("plan_step", "running", "waiting", ...)``."""
    return AnswerShape(name, parameters)


def class_shape(name: str, parameters: tuple[str, ...], **methods: tuple[str, ...]) -> AnswerShape:
    """The shape of a class answer: ``class_shape("Pager", ("num_blocks", "block_size"), free=("seq_id",))``."""
    return AnswerShape(name, parameters, tuple(methods.items()))
