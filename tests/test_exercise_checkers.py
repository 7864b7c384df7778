"""Answers written to game the exercise checkers, each of which must get a ❌.

The checkers are taken from the book itself: ``tools/make_notebooks.py`` makes the solutions
notebook of a chapter, and the cells of one exercise run here as a reader's notebook runs them,
with only the names they need from the chapter's earlier cells (found with ``symtable``). The
cells' ``ex`` records each checker call (and runs it: the solution must pass, strictly); each row
below then replays the same call with a wrong answer in place of the solution.

Each row is a hole a review found in the checkers (issue 31), or one next to it.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib.util
import io
import linecache
import sys
import symtable
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest

from labkit.teaching.exercises import Exercises

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("make_notebooks", ROOT / "tools" / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE_NOTEBOOKS = _generator()


class Recorder(Exercises):
    """The chapter's ``ex``: runs each checker (strictly on the solutions side) and keeps its arguments."""

    def __init__(self, chapter: str, strict: bool):
        super().__init__(chapter, strict=strict)
        self.calls: dict[str, tuple[str, tuple, dict]] = {}

    def check_function(self, name, fn, cases, **kwargs):
        cases = cases if isinstance(cases, list) else list(cases)  # build_it.Cases keep their shape
        self.calls[name] = ("check_function", (cases,), kwargs)
        return super().check_function(name, fn, cases, **kwargs)

    def check_behaviour(self, name, solution, verify, **kwargs):
        self.calls[name] = ("check_behaviour", (verify,), kwargs)
        return super().check_behaviour(name, solution, verify, **kwargs)


def _names(source: str) -> tuple[set[str], set[str]]:
    """(names a top-level statement reads from the module, names it binds there)."""
    top = symtable.symtable(source, "<cell>", "exec")
    reads, binds = set(), set()
    for sym in top.get_symbols():
        if sym.is_referenced():
            reads.add(sym.get_name())
        if sym.is_assigned() or sym.is_imported():
            binds.add(sym.get_name())
    stack = list(top.get_children())
    while stack:  # functions and classes read module names too (their globals)
        table = stack.pop()
        reads |= {s.get_name() for s in table.get_symbols() if s.is_global() and s.is_referenced()}
        stack += table.get_children()
    return reads - set(dir(builtins)), binds


def _statements(cells: list[str]) -> list[str]:
    import ast

    out = []
    for cell in cells:
        try:
            tree = ast.parse(cell)
        except SyntaxError:  # IPython magics (the Colab cell): nothing an exercise needs
            continue
        lines = cell.splitlines(True)
        for stmt in tree.body:  # a decorated definition starts at its first decorator, not at `def`
            first = min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])
            out.append("".join(lines[first - 1:stmt.end_lineno]) if first < stmt.lineno
                       else ast.get_source_segment(cell, stmt))
    return out


def exercise_namespace(stem: str, numbers: list[int], side: str = "solutions") -> tuple[dict[str, Any], Recorder]:
    """Run the cells of exercises ``numbers`` of ``book/<stem>.py`` (one side) with what they need."""
    nb = MAKE_NOTEBOOKS.generate(ROOT / "book" / f"{stem}.py", side)
    cells = nb.cells
    start = next(i for i, c in enumerate(cells) if c.cell_type == "code" and "Exercises(" in c.source)
    wanted: list[str] = []
    for n in numbers:
        first = next(i for i, c in enumerate(cells) if c.cell_type == "markdown"
                     and c.source.lstrip().startswith(f"**Exercise {n}"))
        for c in cells[first + 1:]:
            if c.cell_type == "markdown" and c.source.lstrip().startswith(("**Exercise", "**Quiz", "## ")):
                break
            if c.cell_type == "code":
                wanted.append(c.source)
    begin = next(i for i, c in enumerate(cells) if c.cell_type == "markdown"
                 and c.source.lstrip().startswith(f"**Exercise {numbers[0]}"))
    context = _statements([c.source for c in cells[:begin] if c.cell_type == "code"])
    facts = [_names(s) for s in context]
    needed: set[str] = set()
    for source in _statements(wanted):
        reads, binds = _names(source)
        needed |= reads
    needed -= {name for source in _statements(wanted) for name in _names(source)[1]} | {"ex"}
    chosen: set[int] = set()
    todo = [(name, len(context)) for name in needed]
    while todo:  # the last statement before each use that binds the name, and what it needs in turn
        name, before = todo.pop()
        for i in range(before - 1, -1, -1):
            if name in facts[i][1]:
                if i not in chosen:
                    chosen.add(i)
                    todo += [(n, i) for n in facts[i][0]]
                break
    ex = Recorder(stem, strict=side == "solutions")
    module = types.ModuleType(f"book_{stem}_{side}")  # a module of its own, as a notebook's __main__ (Triton looks it up)
    sys.modules[module.__name__] = module
    ns: dict[str, Any] = vars(module)
    ns["ex"] = ex
    for n, source in enumerate([context[i] for i in sorted(chosen)] + wanted):
        filename = f"<book/{stem}.py, cell {n}>"  # in linecache, as IPython keeps a cell (Triton reads the source)
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), ns)
    return ns, ex


_CHAPTERS = {"01_why_the_cache_grows": [2, 3], "02_cost_per_token": [3, 4], "03_paging": [1, 3, 4],
             "04_prefix_reuse": [1, 2], "05_scheduler": [1, 2, 3], "06_from_fit_to_serve": [2, 3, 4],
             "07_many_replicas": [1], "08_moving_the_cache": [1], "A1_under_the_compiler": [2],
             "A3_fewer_bytes_per_element": [2]}
_LOADED: dict[str, tuple[dict[str, Any], Recorder]] = {}


def chapter(stem: str) -> tuple[dict[str, Any], Recorder]:
    if stem not in _LOADED:
        _LOADED[stem] = exercise_namespace(stem, _CHAPTERS[stem])
    return _LOADED[stem]


def verdict(stem: str, exercise: str, answer: Any) -> str:
    """The line the chapter's checker prints for ``answer``, replayed with the chapter's own cases."""
    _, ex = chapter(stem)
    method, args, kwargs = ex.calls[exercise]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        getattr(Exercises(stem), method)(exercise, answer, *args, **kwargs)
    return out.getvalue()


# --------------------------------------------------------------------------- the wrong answers


class EqualsEverything:
    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


def _tail(blocks: int, n: int, bs: int) -> tuple[int, int]:
    return blocks, blocks * bs - n


def blocks_per_request_03(ns, request):
    from labkit.vllm_bridge import predict
    return lambda n, bs: _tail(predict._blocks_per_request(None, bs, n, 0), n, bs)


def extra_blocks_helper_03(ns, request):
    from labkit.memory.blocks import _extra_blocks
    return lambda n, bs: _tail(_extra_blocks(0, 0, n, bs), n, bs)


def setprofile_off_03(ns, request):
    def answer(n, bs):
        sys.setprofile(None)
        return _tail(ns["blocks_needed"](n, bs), n, bs)
    return answer


def setprofile_toggle_03(ns, request):
    set_profile, get_profile = sys.setprofile, sys.getprofile

    def answer(n, bs):
        watch = get_profile()
        set_profile(None)
        blocks = ns["blocks_needed"](n, bs)
        set_profile(watch)  # put the checker's profiler back, as if nothing happened
        return _tail(blocks, n, bs)
    return answer


def worker_thread_03(ns, request):
    def answer(n, bs):
        out = []
        t = threading.Thread(target=lambda: out.append(ns["blocks_needed"](n, bs)))
        t.start()
        t.join()
        return _tail(out[0], n, bs)
    return answer


def unwatched_thread_03(ns, request):
    def answer(n, bs):
        hook, threading._profile_hook = threading._profile_hook, None  # new threads start unwatched
        out = []
        t = threading.Thread(target=lambda: out.append(ns["blocks_needed"](n, bs)))
        t.start()
        t.join()
        threading._profile_hook = hook
        return _tail(out[0], n, bs)
    return answer


def raw_thread_03(ns, request):
    import _thread

    def answer(n, bs):
        done = threading.Event()
        out = []
        _thread.start_new_thread(lambda: (out.append(ns["blocks_needed"](n, bs)), done.set()), ())
        done.wait(5)
        return _tail(out[0], n, bs)
    return answer


def process_03(ns, request):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    def answer(n, bs):  # a fresh interpreter: no profiler comes with it (a fork would copy the parent's)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return _tail(pool.submit(ns["blocks_needed"], n, bs).result(), n, bs)
    return answer


def process_pool_made_before_03(ns, request):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
    pool.submit(int).result()  # its worker process exists before the checker starts
    request.addfinalizer(pool.shutdown)
    return lambda n, bs: _tail(pool.submit(ns["blocks_needed"], n, bs).result(), n, bs)


def always_equal_03(ns, request):
    return lambda n, bs: EqualsEverything()


def pool_made_before_05(ns, request):
    pool = ThreadPoolExecutor(1)
    pool.submit(int).result()  # its worker thread runs before the checker starts
    return lambda c, held, t, bs, shared: pool.submit(ns["extra_blocks"], c, held, t, bs, shared_tail=shared).result()


def blocks_per_request_05(ns, request):
    from labkit.vllm_bridge import predict

    def answer(c, held, t, bs, shared):
        if t == 0:
            return 0
        return max(0, predict._blocks_per_request(None, bs, c + t, 0) - held) + (1 if shared and c % bs else 0)
    return answer


def ignores_held_05(ns, request):
    def answer(c, held, t, bs, shared):
        if t == 0:
            return 0
        return max(0, -(-(c + t) // bs) - -(-c // bs)) + (1 if shared and c % bs else 0)
    return answer


def times_from_sums_06(ns, request):
    from labkit.serving.sim.costmodel import DEVICES, CostModel, Device
    models = {d.memory_bandwidth: CostModel("teaching model", Device(d.name, d.memory_bytes, d.memory_bandwidth, 1e30))
              for d in DEVICES.values()}  # made before the check: the answer only calls the method
    return lambda b, c, bw: float(models[bw].times_from_sums(b, [b * c], [0])[0]) * 1e3


def predict_06(ns, request):
    import numpy as np
    from labkit.serving.sim.costmodel import MODEL_COSTS
    from labkit.serving.sim.fit import _predict
    from labkit.serving.sim.measure import StepSample
    return lambda b, c, bw: float(_predict(MODEL_COSTS["teaching model"], [StepSample(b, b * c, 0.0, 0.0)],
                                           np.array([bw]), np.array([1e30]))[0, 0]) * 1e3


def model_shape_01(ns, request):
    from labkit.memory.capacity import ModelShape
    return lambda L, h, d, t, e: ModelShape("mine", L, h, d, e).cache_bytes(t)


def measured_01(ns, request):
    import torch
    return lambda L, h, d, t, e: ns["measured_bytes"](L, h, d, t, torch.float32 if e == 4 else torch.float16)


def causal_attention_01(ns, request):
    """The step's RoPE and append done right, its attention handed to labkit's."""
    torch, rope_cos_sin, apply_rope = ns["torch"], ns["rope_cos_sin"], ns["apply_rope"]

    def decode_step(k_cache, v_cache, q, k, v, inv_freq):
        cos, sin = rope_cos_sin(torch.tensor([[k_cache.shape[0]]]), inv_freq)
        q, k = (apply_rope(x[None, None], cos, sin) for x in (q, k))
        k_cache, v_cache = torch.cat([k_cache, k[0]]), torch.cat([v_cache, v[None]])
        return k_cache, v_cache, ns["causal_attention"](q, k_cache[None], v_cache[None])[0, 0]
    return decode_step


def rewrites_request_04(ns, request):
    shared = ns["CacheKey"]()

    def cache_key_for(request):
        request["tenant"], request["adapter"] = "everyone", None  # the checker then compares with these
        return shared
    return cache_key_for


def key_prompt_list_05(ns, request):
    return lambda request: request.prompt_token_ids


def key_largest_id_05(ns, request):
    return lambda request: max(request.prompt_token_ids)


def key_sum_05(ns, request):
    return lambda request: sum(request.prompt_token_ids)


def _bisect(curve, target, lo, hi, tol):
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if curve(mid) <= target else (lo, mid)
    return lo, hi


def reset_counter_06(ns, request):
    def find_rate(curve, target, lo, hi, tol):
        (calls,) = [c.cell_contents for c in curve.__closure__ if isinstance(c.cell_contents, list)]

        def free(rate):
            calls.clear()  # every call looks like the first
            return curve(rate)
        return _bisect(free, target, lo, hi, tol / 1000)
    return find_rate


def uncounted_curve_06(ns, request):
    def find_rate(curve, target, lo, hi, tol):
        raw = [c.cell_contents for c in curve.__closure__ if callable(c.cell_contents)][0]
        return _bisect(raw, target, lo, hi, tol / 1000)
    return find_rate


def pasted_intervals_06(ns, request):
    @functools.cache
    def searched_once() -> tuple[float, float]:  # the simulator's bracket from an earlier run, pasted
        return _bisect(ns["ttft_p99"], 1.0, 1.0, 16.0, 0.25)

    def find_rate(curve, target, lo, hi, tol):
        seen = curve(8.0)  # one call tells the three cases apart
        return (3.25, 3.5) if seen == 5.0 else (12.5, 12.75) if seen == 0.5 else searched_once()
    return find_rate


def pytorch_kernel_a1(ns, request):
    import triton

    reference = ns["window_reference"]

    class PyTorchKernel(triton.runtime.KernelInterface):
        def run(self, q, k_cache, v_cache, block_tables, seq_lens, out, window, *rest, grid, warmup, **kwargs):
            out.copy_(reference(q, k_cache, v_cache, block_tables, seq_lens, window).to(out.dtype))
    return PyTorchKernel()


def replaced_run_a1(ns, request):
    kernel = pytorch_kernel_a1(ns, request)
    real = ns["triton"].jit(ns["window_decode_kernel"].fn)  # a genuine @triton.jit kernel...
    real.run = kernel.run  # ...whose launch computes in PyTorch
    return real


def patched_triton_a1(ns, request):
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    fake = pytorch_kernel_a1(ns, request).run
    mp = request.getfixturevalue("monkeypatch")
    mp.setattr(InterpretedFunction, "run", lambda self, *a, **k: fake(*a, **k))
    mp.setattr(JITFunction, "run", lambda self, *a, **k: fake(*a, **k))
    return ns["window_decode_kernel"]


ROWS: list[tuple[str, str, str, Callable, str]] = [
    # (hole, chapter, exercise, wrong answer, what the ❌ must say)
    ("sys.setprofile(None)", "03_paging", "Exercise 1", setprofile_off_03, "sys.setprofile"),
    ("profiler switched off and put back", "03_paging", "Exercise 1", setprofile_toggle_03, "watch"),
    ("library in a worker thread", "03_paging", "Exercise 1", worker_thread_03, "blocks_needed"),
    ("library in a thread pool made before the check", "05_scheduler", "Exercise 1", pool_made_before_05,
     "extra_blocks"),
    ("a thread started with threading's hook removed", "03_paging", "Exercise 1", unwatched_thread_03, "watch"),
    ("a thread started with _thread", "03_paging", "Exercise 1", raw_thread_03, "_thread"),
    ("library in another process", "03_paging", "Exercise 1", process_03, "process"),
    ("library in a process pool made before the check", "03_paging", "Exercise 1", process_pool_made_before_03,
     "process"),
    ("sibling helper vllm._blocks_per_request", "03_paging", "Exercise 1", blocks_per_request_03,
     "_blocks_per_request"),
    ("sibling helper prefix._extra_blocks", "03_paging", "Exercise 1", extra_blocks_helper_03, "_extra_blocks"),
    ("sibling helper vllm._blocks_per_request", "05_scheduler", "Exercise 1", blocks_per_request_05,
     "_blocks_per_request"),
    ("sibling helper CostModel.times_from_sums", "06_from_fit_to_serve", "Exercise 2", times_from_sums_06,
     "times_from_sums"),
    ("sibling helper calibration._predict", "06_from_fit_to_serve", "Exercise 2", predict_06, "_predict"),
    ("sibling helper ModelShape.cache_bytes", "01_why_the_cache_grows", "Exercise 2", model_shape_01, "ModelShape"),
    ("the checker's own measuring helper", "01_why_the_cache_grows", "Exercise 2", measured_01, "measured_bytes"),
    ("labkit's causal_attention in the step", "01_why_the_cache_grows", "Exercise 3", causal_attention_01,
     "causal_attention"),
    ("an answer equal to everything", "03_paging", "Exercise 1", always_equal_03, "plain value"),
    ("a rewritten request and one shared CacheKey", "04_prefix_reuse", "Exercise 2", rewrites_request_04,
     "reused"),
    ("key = the prompt list", "05_scheduler", "Exercise 3", key_prompt_list_05, "admitted in the order"),
    ("key = the largest token id", "05_scheduler", "Exercise 3", key_largest_id_05, "admitted in the order"),
    ("key = the sum of the token ids", "05_scheduler", "Exercise 3", key_sum_05, "admitted in the order"),
    ("held ignored", "05_scheduler", "Exercise 1", ignores_held_05, "gave"),
    ("call counter reset through the closure", "06_from_fit_to_serve", "Exercise 4", reset_counter_06,
     "__closure__"),
    ("uncounted curve read through the closure", "06_from_fit_to_serve", "Exercise 4", uncounted_curve_06,
     "__closure__"),
    ("pasted intervals", "06_from_fit_to_serve", "Exercise 4", pasted_intervals_06, "bracket"),
    ("a KernelInterface that computes in PyTorch", "A1_under_the_compiler", "Exercise 2", pytorch_kernel_a1,
     "triton.jit"),
    ("a @triton.jit kernel whose run computes in PyTorch", "A1_under_the_compiler", "Exercise 2", replaced_run_a1,
     "triton.jit"),
    ("Triton's launch replaced by PyTorch", "A1_under_the_compiler", "Exercise 2", patched_triton_a1, "launch"),
]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the refused threads
@pytest.mark.parametrize("hole, stem, exercise, wrong, says", ROWS,
                         ids=[f"{r[1][:2]} {r[2][-1]}: {r[0]}" for r in ROWS])
def test_a_gamed_answer_gets_a_cross(hole, stem, exercise, wrong, says, request):
    ns, _ = chapter(stem)
    out = verdict(stem, exercise, wrong(ns, request))
    assert out.startswith(f"❌ {exercise}"), f"{hole}: {out!r}"
    assert says in out, f"{hole}: {out!r}"
    assert sys.getprofile() is None and threading._profile_hook is None  # the watch is gone


@pytest.mark.parametrize("stem", sorted(_CHAPTERS))
def test_the_solutions_pass_and_the_stubs_wait(stem, capsys):
    """Loading a chapter ran every checker of its exercises with the solution, in strict mode; the
    chapters/ side, with the reader's stubs, gets ⏳ from each."""
    _, ex = chapter(stem)
    assert sorted(ex.calls) == sorted(f"Exercise {n}" for n in _CHAPTERS[stem])
    capsys.readouterr()
    exercise_namespace(stem, _CHAPTERS[stem], side="chapters")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(_CHAPTERS[stem]) and all(line.startswith("⏳ Exercise") for line in lines), lines


# the book's own function exercises (check_function with the chapter's cases), by the arguments each case passes
FUNCTION_EXERCISES = [("01_why_the_cache_grows", "Exercise 2", 5), ("03_paging", "Exercise 1", 2),
                      ("03_paging", "Exercise 3", 3), ("05_scheduler", "Exercise 1", 5),
                      ("06_from_fit_to_serve", "Exercise 2", 3)]


@pytest.mark.parametrize("stem, exercise, num_args", FUNCTION_EXERCISES, ids=[f"{s[:2]} {e}" for s, e, _ in
                                                                               FUNCTION_EXERCISES])
def test_a_function_answer_of_the_wrong_shape_is_told_what_was_expected(stem, exercise, num_args):
    """Issue 38: a number, or a function taking other arguments, is told what the cases call, not that
    "your code raised TypeError" (which the checker caused by calling it)."""
    _, ex = chapter(stem)
    assert ex.calls[exercise][0] == "check_function"
    for answer, got in ((42, "got int 42"), (lambda: None, "got function <lambda>(), which cannot be called with "
                                                           f"{num_args} arguments")):
        out = verdict(stem, exercise, answer)
        assert out.startswith(f"❌ {exercise}: not yet. expected a function of {num_args} arguments, as the cases "
                              "call it: f("), out
        assert got in out and "your code raised" not in out, out


# The book's own behaviour checkers (a verifier written in the chapter) declare their answer's shape too.
BEHAVIOUR_EXERCISES = [("04_prefix_reuse", "Exercise 2", "cache_key_for(request)"),
                       ("05_scheduler", "Exercise 3", "shortest_prompt_first(request)"),
                       ("06_from_fit_to_serve", "Exercise 4", "find_rate(curve, target_s, lo, hi, tol)")]


@pytest.mark.parametrize("stem, exercise, signature", BEHAVIOUR_EXERCISES, ids=[f"{s[:2]} {e}" for s, e, _ in
                                                                                BEHAVIOUR_EXERCISES])
def test_a_behaviour_answer_of_the_wrong_shape_is_told_what_was_expected(stem, exercise, signature):
    """Issue 38: the chapter's verifier never runs on a number or on a function with other parameters."""
    _, ex = chapter(stem)
    assert ex.calls[exercise][0] == "check_behaviour"
    for answer, got in ((42, "got int 42"), (lambda: None, "got function <lambda>()")):
        out = verdict(stem, exercise, answer)
        assert f"expected a function {signature}" in out and got in out and "your code raised" not in out, out


# --------------------------------------------------------------------------- the helpers, one by one


def test_a_metered_function_keeps_its_count_and_its_function_out_of_reach():
    import copy
    import pickle

    from labkit.teaching.guards import Metered, TooManyCalls, calls_made

    m = Metered(lambda x: 2 * x, limit=2)
    assert not hasattr(m, "__closure__") and not hasattr(m, "__dict__") and not hasattr(m, "__wrapped__")
    assert [a for a in dir(m) if not a.startswith("__")] == []
    assert copy.copy(m) is m and copy.deepcopy([m])[0] is m  # a copy counts on the same meter
    with pytest.raises(TypeError):
        pickle.dumps(m)
    assert (m(1), m(2)) == (2, 4)
    with pytest.raises(TooManyCalls):
        m(3)
    assert calls_made(m) == 3  # the refused call counts too


def test_hidden_cases_differ_from_run_to_run():
    import random

    import torch

    from labkit.teaching.guards import hidden_rng, torch_generator

    draws = set()
    for _ in range(5):
        random.seed(0), torch.manual_seed(0)  # what a cell might do: it does not reach the hidden generator
        draws.add(tuple(hidden_rng().random() for _ in range(3)))
    assert len(draws) == 5
    assert not torch.equal(torch.rand(4, generator=torch_generator(hidden_rng())),
                           torch.rand(4, generator=torch_generator(hidden_rng())))


def test_a_function_answer_gets_copies_of_its_inputs(capsys):
    def rewrites(xs):
        xs.append(99)
        return len(xs)

    given = [1, 2, 3]
    Exercises("x").check_function("f", rewrites, [((given,), 4)])
    assert "✅" in capsys.readouterr().out and given == [1, 2, 3]

    seen = []
    Exercises("x").check_behaviour("b", rewrites, lambda fn: [] if (fn(given), seen.append(list(given))) else [])
    assert seen == [[1, 2, 3]]


def test_answers_are_compared_as_plain_values(capsys):
    import numpy as np
    import torch

    ex = Exercises("x")
    ex.check("v", np.int64(3), 3)
    ex.check("v", (1, [2.0, 3.0]), (1, [2.0, 3.0 + 1e-12]), rel_tol=1e-9)
    ex.check("v", torch.ones(2, 3), torch.ones(2, 3))
    assert capsys.readouterr().out.count("✅") == 3

    class Three(int):
        def __eq__(self, other):
            return True

    ex.check("v", Three(4), 3)
    ex.check("v", torch.ones(1), torch.ones(3))  # allclose would broadcast; the shapes differ
    out = capsys.readouterr().out
    assert out.count("❌") == 2 and "of type `Three`" in out


def test_logging_in_an_answer_is_no_process(capsys):
    """``logging`` asks ``multiprocessing`` for the process name: that is not handing work to a process."""
    import logging

    from labkit.memory.blocks import blocks_needed

    def logs(n, bs):
        logging.getLogger("a reader").warning("computing %d tokens", n)
        return -(-n // bs)

    Exercises("x").check_function("f", logs, [((5, 4), 2)], forbid=[blocks_needed])
    assert "✅" in capsys.readouterr().out


def test_the_watch_puts_back_a_profiler_it_found(capsys):
    """cProfile (a C profiler) and a Python profiler are both running again after a check."""
    import cProfile

    from labkit.memory.blocks import blocks_needed

    def sum_blocks(n, bs):
        return -(-n // bs)

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        Exercises("x").check_function("f", sum_blocks, [((5, 4), 2)], forbid=[blocks_needed])
        assert sys.getprofile() is profiler
    finally:
        profiler.disable()
    calls = []

    def python_profiler(frame, event, arg):
        calls.append(event)

    sys.setprofile(python_profiler)
    try:
        Exercises("x").check_function("f", sum_blocks, [((5, 4), 2)], forbid=[blocks_needed])
        after = sys.getprofile()
    finally:
        sys.setprofile(None)
    assert after is python_profiler and calls and capsys.readouterr().out.count("✅") == 2


def test_triton_launches_records_the_kernel_that_ran():
    triton = pytest.importorskip("triton")
    import torch
    import triton.language as tl

    import labkit  # noqa: F401  (the interpreter where there is no GPU)
    from labkit.teaching.guards import is_triton_kernel, triton_launches

    @triton.jit
    def double(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

    x = torch.arange(4.0, device=labkit.DEVICE)
    with triton_launches() as launched:
        double[(1,)](x, 4, BLOCK=4)
    assert [fn for fn, _ in launched] == [double.fn] and x.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert is_triton_kernel(double) and not is_triton_kernel(double.fn)
