"""Chapter 07's build-it checker (``labkit.teaching.build_it_routing``): the cache-aware routing decision.

The chapter's solution and labkit's own ``route`` pass; each of ``WRONG_ROUTES`` (the solution with
one rule changed) gets a ❌ on every draw, at the case built for its mistake, and the ❌ names that
case; the draws hold every edge; bad arguments to the checker raise ``ValueError`` naming them.
"""

from __future__ import annotations

import random

import numpy
import pytest
import torch

from labkit.serving.cluster.routers import CacheAware, cache_aware_choice, is_imbalanced
from labkit.teaching import build_it_routing
from labkit.teaching.build_it_routing import (WRONG_ROUTES, RouteCase, route, route_cases, route_check,
                                              route_problems)
from labkit.teaching.exercises import Exercises
from test_exercise_checkers import chapter

FORBID = [cache_aware_choice, is_imbalanced, CacheAware]  # what the chapter's checker forbids


def solution(*args, **kwargs):
    """The chapter's solution, as book/07_many_replicas.py writes it (no labkit), read from the book."""
    return chapter("07_many_replicas")[0]["route"](*args, **kwargs)


# mistake -> the kinds of case built to refute it: each must fail on every draw
REFUTED_BY = {
    "ignores_load": ["a tie in the match, broken by load", "imbalanced loads (both thresholds passed)"],
    "ignores_match": ["a match share one block over the threshold"],
    "counts_tokens": ["a match long in tokens but short in whole blocks", "a partial block against a whole one",
                      "a prompt shorter than one block"],
    "at_least_threshold": ["a match share exactly at the threshold (0.25",
                           "a match share exactly at the threshold (0.5"],
    "or_imbalance": ["loads apart by more than the absolute threshold, not the relative one",
                     "loads apart by more than the relative threshold, not the absolute one",
                     "loads apart by exactly the absolute threshold"],
    "highest_index": ["an empty history", "a tie in the match and in load"],
}


def test_the_solution_and_labkits_route_pass_and_agree():
    for seed in range(40):
        cases = route_cases(seed=seed)
        assert route_problems(solution, cases) == []
        assert route_problems(route, cases) == []
    for _ in range(10):  # fresh draws
        assert route_check()(solution) == []


def test_the_solution_passes_the_chapters_checker_strictly(capsys):
    ex = Exercises("07_many_replicas", strict=True)
    ex.check_behaviour("Exercise 1", solution, route_check(), forbid=FORBID)
    assert capsys.readouterr().out.startswith("✅ Exercise 1")


def test_labkits_route_is_refused_where_the_chapter_forbids_it(capsys):
    Exercises("07_many_replicas").check_behaviour("Exercise 1", route, route_check(), forbid=FORBID)
    assert capsys.readouterr().out.startswith("❌ Exercise 1")


@pytest.mark.parametrize("mistake", sorted(WRONG_ROUTES))
def test_each_wrong_answer_fails_on_every_draw_at_its_case(mistake, capsys):
    wrong = WRONG_ROUTES[mistake]
    for seed in range(25):
        problems = route_problems(wrong, route_cases(seed=seed))
        for kind in REFUTED_BY[mistake]:
            assert any(f", {kind}" in p for p in problems), (mistake, kind, problems[:2])
        assert all(p.startswith("case ") and "expected replica" in p for p in problems)
    Exercises("07_many_replicas").check_behaviour("Exercise 1", wrong, route_check(), forbid=FORBID)
    out = capsys.readouterr().out
    assert out.startswith("❌ Exercise 1: not yet. case ") and "expected replica" in out, out


def test_every_wrong_answer_is_refuted_by_every_fresh_draw():
    for _ in range(30):
        cases = route_cases()
        for mistake, wrong in WRONG_ROUTES.items():
            assert route_problems(wrong, cases), mistake


def test_the_hidden_cases_hold_every_edge():
    cases = route_cases(seed=3)
    kinds = [c.kind for c in cases]
    for wanted in [k for ks in REFUTED_BY.values() for k in ks] + ["random"]:
        assert any(k.startswith(wanted) for k in kinds), wanted
    assert kinds.count("random") == 12 and len(route_cases(seed=3, random_cases=0)) == len(cases) - 12
    edges = {c.kind: c for c in cases}
    empty = next(c for k, c in edges.items() if k.startswith("an empty history"))
    assert all(h == [] for h in empty.sent)
    at = next(c for k, c in edges.items() if k.startswith("a match share exactly at the threshold (0.25"))
    assert max(at.match) == len(at.prompt) // 4  # exactly the share 0.25
    partial = next(c for k, c in edges.items() if k.startswith("a match long in tokens"))
    assert max(partial.match) == partial.block_size and partial.expected == min(
        range(len(partial.loads)), key=lambda i: (partial.loads[i], i))  # 1 block: under the threshold
    apart = next(c for k, c in edges.items() if k.startswith("loads apart by more than the absolute"))
    hi, lo = max(apart.loads), min(apart.loads)
    assert hi - lo > 64 and not hi > 1.5 * lo
    apart = next(c for k, c in edges.items() if k.startswith("loads apart by more than the relative"))
    hi, lo = max(apart.loads), min(apart.loads)
    assert not hi - lo > 64 and hi > 1.5 * lo
    sizes = {len(c.loads) for seed in range(20) for c in route_cases(seed=seed) if c.kind == "random"}
    assert sizes == {2, 3, 4, 5, 6}
    assert any(len(c.prompt) % c.block_size for c in cases)  # ragged lengths


def test_the_cases_are_drawn_afresh_and_no_global_seed_replays_them():
    def drawn():
        random.seed(0)
        numpy.random.seed(0)
        torch.manual_seed(0)
        return repr(route_cases())
    assert drawn() != drawn()
    assert repr(route_cases(seed=5)) == repr(route_cases(seed=5))


def test_an_answer_of_the_wrong_shape_or_type_is_told_what_was_expected(capsys):
    verify = route_check()
    assert verify(42) == ["expected a function route(prompt, sent, loads, block_size, cache_threshold, "
                          "balance_abs_threshold, balance_rel_threshold); got int 42"]
    assert "cannot be called with" in verify(lambda prompt, sent: 0)[0]
    problems = verify(lambda *args: "0")
    assert problems[0].startswith("case 1 of ") and "an int; got str '0'" in problems[0]
    assert verify(lambda *args: numpy.int64(solution(*args))) == []  # a NumPy integer is an int

    def mutating(prompt, sent, loads, *rest):
        out = solution(prompt, sent, loads, *rest)
        prompt.clear(), sent.clear(), loads.clear()
        return out
    assert verify(mutating) == []  # each call gets its own copies


@pytest.mark.parametrize("call, parameter", [
    (lambda: route_check(seed=-1), "seed"), (lambda: route_cases(seed="0"), "seed"),
    (lambda: route_check(random_cases=-1), "random_cases"), (lambda: route_cases(random_cases=2.5), "random_cases"),
    (lambda: route_problems(solution, []), "cases"), (lambda: route_problems(solution, "cases"), "cases"),
    (lambda: route_problems(solution, [("args", 0)]), "cases"),
    (lambda: route([], [[]], [0], 4), "prompt"), (lambda: route([1], [[]], [], 4), "loads"),
    (lambda: route([1], [[], []], [0], 4), "sent"), (lambda: route([1], [[1]], [0], 4), "sent"),
    (lambda: route([1], [[]], [0], 0), "block_size"),
    (lambda: route([1], [[]], [0], 4, cache_threshold=1.5), "cache_threshold"),
    (lambda: route([1], [[]], [-1], 4), "loads"),
])
def test_bad_arguments_raise_value_error_naming_them(call, parameter):
    with pytest.raises(ValueError, match=parameter):
        call()


def test_a_case_is_what_route_returns_for_it():
    case = route_cases(seed=1)[0]
    assert type(case) is RouteCase and case.expected == route(*case.args())
    args = case.args()
    args[0].append(1)
    assert args[0] != case.prompt  # args() hands out copies
    assert build_it_routing.SHAPE.name == "route"
