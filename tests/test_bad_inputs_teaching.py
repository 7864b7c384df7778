"""Bad input to the book's checkers (issue 38): the checkers' own arguments, and the reader's answers.

Two kinds, two channels. A bad argument to a checker itself (an exercise name that is not a string, no
cases, a ``forbid`` entry the watch cannot see, a quiz keyed by something other than its question
numbers) is the chapter's bug: a row of ``CASES``, refused with a ``ValueError`` naming the parameter,
before anything runs, all state unchanged (``test_bad_inputs.run_case``). An answer of the wrong
shape (``42`` where a function is expected, a letter that is not one of a question's choices) is the
reader's: the ordinary tests below check that it gets a ❌ saying what was expected.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.memory.blocks import blocks_needed
from labkit.teaching import answers, build_it, guards, quizzes
from labkit.teaching.exercises import Exercises
from test_bad_inputs import On, run_case

ROOT = Path(__file__).resolve().parent.parent


def paging_checker() -> Exercises:
    return Exercises("03_paging")


def _twice(x):
    return 2 * x


def _one_case() -> list:
    return [((1,), 2)]


def _right_kv_quant() -> tuple:
    return (lambda x: x, lambda x, s: x, lambda c, s: c)


CASES = [
    # (label, call, args, kwargs, exception, parameter)
    # --- Exercises: the checker of a chapter
    ("Exercises chapter not a string", Exercises, (3,), {}, ValueError, "chapter"),
    ("Exercises chapter empty", Exercises, ("",), {}, ValueError, "chapter"),
    ("Exercises strict 'yes'", Exercises, ("03_paging",), {"strict": "yes"}, ValueError, "strict"),
    ("check unknown value exercise", On(paging_checker, "check"), ("Exercise 9", 5), {}, ValueError, "name"),
    ("check unknown value exercise, stub answer", On(paging_checker, "check"), ("Exercise 9", None), {},
     ValueError, "name"),
    ("check chapter without value exercises", On(lambda: Exercises("05_scheduler"), "check"), ("Exercise 1", 5), {},
     ValueError, "chapter"),
    ("check name not a string", On(paging_checker, "check"), (42, 5, 5), {}, ValueError, "name"),
    ("check rel_tol negative", On(paging_checker, "check"), ("e", 5, 5), {"rel_tol": -0.1}, ValueError, "rel_tol"),
    ("check rel_tol NaN", On(paging_checker, "check"), ("e", 5, 5), {"rel_tol": math.nan}, ValueError, "rel_tol"),
    ("check hint not a string", On(paging_checker, "check"), ("e", 5, 5), {"hint": 3}, ValueError, "hint"),
    ("check_function no cases", On(paging_checker, "check_function"), ("f", _twice, []), {}, ValueError, "cases"),
    ("check_function no cases, stub answer", On(paging_checker, "check_function"), ("f", None, []), {}, ValueError,
     "cases"),
    ("check_function cases a number", On(paging_checker, "check_function"), ("f", _twice, 42), {}, ValueError,
     "cases"),
    ("check_function case args not a tuple", On(paging_checker, "check_function"), ("f", _twice, [(1, 2)]), {},
     ValueError, "cases"),
    ("check_function case of three", On(paging_checker, "check_function"), ("f", _twice, [((1,), 2, 3)]), {},
     ValueError, "cases"),
    ("check_function rel_tol inf", On(paging_checker, "check_function"), ("f", _twice, _one_case()),
     {"rel_tol": math.inf}, ValueError, "rel_tol"),
    ("check_function forbid a builtin", On(paging_checker, "check_function"), ("f", _twice, _one_case()),
     {"forbid": [len]}, ValueError, "forbid"),
    ("check_function forbid a number", On(paging_checker, "check_function"), ("f", _twice, _one_case()),
     {"forbid": [42]}, ValueError, "forbid"),
    ("check_function forbid a name", On(paging_checker, "check_function"), ("f", _twice, _one_case()),
     {"forbid": "blocks_needed"}, ValueError, "forbid"),
    ("check_function expects a string", On(paging_checker, "check_function"), ("f", _twice, _one_case()),
     {"expects": "f(x)"}, ValueError, "expects"),
    ("check_function unknown keyword", On(paging_checker, "check_function"), ("f", _twice, _one_case()),
     {"tolerance": 0.1}, TypeError, "tolerance"),
    ("check_behaviour verify a number", On(paging_checker, "check_behaviour"), ("b", _twice, 42), {}, ValueError,
     "verify"),
    ("check_behaviour verify None, stub answer", On(paging_checker, "check_behaviour"), ("b", None, None), {},
     ValueError, "verify"),
    ("check_behaviour forbid a number", On(paging_checker, "check_behaviour"), ("b", _twice, lambda fn: []),
     {"forbid": [blocks_needed, 3]}, ValueError, "forbid"),
    ("check_behaviour expects a class", On(paging_checker, "check_behaviour"), ("b", _twice, lambda fn: []),
     {"expects": object}, ValueError, "expects"),
    ("check_behaviour name None", On(paging_checker, "check_behaviour"), (None, _twice, lambda fn: []), {},
     ValueError, "name"),
    # --- quizzes
    ("quiz question 5 of 4", On(paging_checker, "quiz"), ({5: "a"},), {}, ValueError, "answers"),
    ("quiz question 0", On(paging_checker, "quiz"), ({0: "a", 1: "b"},), {}, ValueError, "answers"),
    ("quiz question '1'", On(paging_checker, "quiz"), ({"1": "a"},), {}, ValueError, "answers"),
    ("quiz question True", On(paging_checker, "quiz"), ({True: "b"},), {}, ValueError, "answers"),
    ("quiz answers a list", On(paging_checker, "quiz"), (["b", 15, "a", "a"],), {}, ValueError, "answers"),
    ("quiz of a chapter without one", On(lambda: Exercises("A5_vllm_scheduler"), "quiz"), ({1: "a"},), {},
     ValueError, "chapter"),
    ("verdicts chapter a list", quizzes.verdicts, (["03_paging"], {}), {}, ValueError, "chapter"),
    # --- answers
    ("answers.expected unknown name", answers.expected, ("02_cost_per_token", "Exercise 9"), {}, ValueError, "name"),
    ("answers.expected unknown chapter", answers.expected, ("02_costs", "Exercise 1"), {}, ValueError, "chapter"),
    ("answers.lookup name a list", answers.lookup, ("02_cost_per_token", ["Exercise 1"]), {}, ValueError, "name"),
    # --- build_it
    ("kv_quant_cases seed negative", build_it.kv_quant_cases, (), {"seed": -1}, ValueError, "seed"),
    ("kv_quant_cases seed a string", build_it.kv_quant_cases, ("0",), {}, ValueError, "seed"),
    ("kv_quant_cases no draws", build_it.kv_quant_cases, (), {"draws": 0}, ValueError, "draws"),
    ("kv_quant_problems no cases", build_it.kv_quant_problems, (_right_kv_quant(), []), {}, ValueError, "cases"),
    ("kv_quant_problems cases missing keys", build_it.kv_quant_problems,
     (_right_kv_quant(), [{"x": torch.zeros(3, 2, 1, 4)}]), {}, ValueError, "cases"),
    ("kv_quant_problems cases a dict", build_it.kv_quant_problems, (_right_kv_quant(), {"x": 1}), {}, ValueError,
     "cases"),
    ("plan_step_check takes no seed", build_it.plan_step_check, (), {"seed": 1}, TypeError, "seed"),
    # --- guards
    ("Metered fn a number", guards.Metered, (42, 1), {}, ValueError, "fn"),
    ("Metered limit negative", guards.Metered, (_twice, -1), {}, ValueError, "limit"),
    ("Metered limit 1.5", guards.Metered, (_twice, 1.5), {}, ValueError, "limit"),
    ("calls_made of a function", guards.calls_made, (_twice,), {}, ValueError, "metered"),
    ("torch_generator of a seed", guards.torch_generator, (42,), {}, ValueError, "rng"),
    ("draws_hidden_cases of a number", guards.draws_hidden_cases, (42,), {}, ValueError, "checker"),
    ("draws_hidden_cases of a checker without rng", guards.draws_hidden_cases, (lambda: [],), {}, ValueError,
     "checker"),
    ("draws_hidden_cases rng keyword-only", guards.draws_hidden_cases, (lambda *, rng: [],), {}, ValueError,
     "checker"),
    ("given_copies of a number", guards.given_copies, (42,), {}, ValueError, "fn"),
    ("Watch forbid a number", guards.Watch, ([42],), {}, ValueError, "forbid"),
    ("function_shape name with a space", guards.function_shape, ("plan step", "running"), {}, ValueError, "name"),
    ("function_shape parameter a number", guards.function_shape, ("plan_step", 5), {}, ValueError, "parameters"),
    ("class_shape parameters a string", guards.class_shape, ("Pager", "num_blocks"), {}, ValueError, "parameters"),
    ("class_shape method parameter a number", guards.class_shape, ("Pager", ("num_blocks",)), {"free": (1,)},
     ValueError, "methods"),
]


@pytest.mark.parametrize("label, call, args, kwargs, exc, param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused(label, call, args, kwargs, exc, param):
    run_case(call, args, kwargs, exc, param)


def test_the_labels_are_unique():
    assert len({c[0] for c in CASES}) == len(CASES)


def test_a_refused_checker_call_prints_nothing(capsys):
    """Refused before any work: not even the "not solved yet" line of a stub answer."""
    with pytest.raises(ValueError, match="cases"):
        Exercises("03_paging").check_function("f", None, [])
    assert capsys.readouterr().out == ""


# --------------------------------------------------------------------------- the reader's answer: a ❌, not an error


def test_a_quiz_answer_of_the_wrong_kind_says_what_was_expected(capsys):
    """A letter not among the choices, a number for a letter, a letter for a number: each a ❌ saying
    what kind of answer the question takes, counted as wrong; a NumPy number is a number."""
    import numpy as np

    lines, wrong, open_ = quizzes.verdicts("03_paging", {1: "d", 2: "15", 3: 1, 4: True})
    assert lines == ["❌ Question 1: expected one of the letters 'a', 'b', 'c'; got 'd'.",
                     "❌ Question 2: expected a number; got str '15'.",
                     "❌ Question 3: expected one of the letters 'a', 'b'; got 1.",
                     "❌ Question 4: expected one of the letters 'a', 'b'; got True."]
    assert (wrong, open_) == (4, 0)
    lines, wrong, _ = quizzes.verdicts("03_paging", {2: math.nan})
    assert lines[1] == "❌ Question 2: expected a number; got float nan." and wrong == 1
    lines, wrong, _ = quizzes.verdicts("03_paging", {1: " B", 2: np.int64(15)})
    assert lines[0].startswith("✅ Question 1") and lines[1].startswith("✅ Question 2") and wrong == 0
    with pytest.raises(AssertionError, match="1 wrong"):
        Exercises("03_paging", strict=True).quiz({1: "b", 2: 15, 3: "a", 4: "z"})
    assert "expected one of the letters 'a', 'b'; got 'z'" in capsys.readouterr().out


@pytest.mark.parametrize("stem", sorted(quizzes.QUIZZES))
def test_each_questions_choices_are_the_letters_the_book_offers(stem):
    """``Question.choices`` (the answer and each wrong letter) is exactly what the chapter's text lists."""
    block = (ROOT / "book" / f"{stem}.py").read_text().split("**Quiz.**")[1].split("# %%")[0]
    items = re.split(r"\n# (\d)\. ", block)
    texts = {int(items[i]): items[i + 1] for i in range(1, len(items), 2)}
    for number, question in enumerate(quizzes.QUIZZES[stem], start=1):
        assert question.choices == tuple(sorted(set(re.findall(r"\(([a-e])\)", texts[number])))), (stem, number)


def test_an_answer_shape_reads_the_signature_without_running_the_answer():
    ran = []

    def spy(a, b):
        ran.append((a, b))

    class Pool:
        def __init__(self, n):
            ran.append(n)

        def take(self, k):
            ran.append(k)

        @staticmethod
        def size():
            return 0

    pool = guards.class_shape("Pool", ("n",), take=("k",), size=())
    assert guards.function_shape("f", "a", "b").problem(spy) == "" and pool.problem(Pool) == "" and ran == []
    assert guards.function_shape("f", "a").problem(spy) == \
        "expected a function f(a); got function spy(a, b), which cannot be called with 1 argument"
    assert guards.function_shape("f", "a", "b").problem(lambda *args: None) == ""  # *args takes anything
    assert guards.function_shape("f", "a").problem(None) == "expected a function f(a); got NoneType None"
    assert "which cannot be built with 2 arguments" in \
        guards.class_shape("Pool", ("n", "m"), take=("k",)).problem(Pool)
    assert "whose size cannot be called with (k)" in guards.class_shape("Pool", ("n",), size=("k",)).problem(Pool)


def test_check_behaviour_checks_a_named_shape_before_verify_runs(capsys):
    """A chapter's own verifier can name the shape with ``expects=``: verify never sees the bad answer."""
    seen = []

    def verify(fn):
        seen.append(fn)
        return [] if fn(3) == 6 else ["wrong"]

    shape = guards.function_shape("double", "x")
    ex = Exercises("x")
    ex.check_behaviour("b", 42, verify, expects=shape)
    ex.check_behaviour("b", lambda x, y: 0, verify, expects=shape)
    ex.check_behaviour("b", _twice, verify, expects=shape)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "❌ b: not yet. expected a function double(x); got int 42."
    assert out[1].startswith("❌ b: not yet. expected a function double(x); got function <lambda>(x, y), which")
    assert out[2] == "✅ b: the behaviour is right." and len(seen) == 1
    ex.check_function("f", _twice, [((1,), 2)], expects=guards.function_shape("double", "x", "y"))
    assert capsys.readouterr().out.startswith("❌ f: not yet. expected a function double(x, y); got function "
                                              "_twice(x), which cannot be called with 2 arguments")
