"""Chapter 08's build-it checker (``labkit.teaching.build_it_tiers``): reload a prefix, or compute it again.

labkit's own answer and a reader's, written from the tier's bandwidth and latency and the cost model's
``time_from_sums`` alone, pass; each of ``WRONG_DECISIONS`` (the solution with one rule changed) gets a ❌
on every draw, at the case built for its mistake, and the ❌ names that case; the draws hold every edge;
bad arguments to the checker raise ``ValueError`` naming them.
"""

from __future__ import annotations

import random

import numpy
import pytest
import torch

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.serving.sim.costmodel import CostModel
from labkit.serving.sim.tiers import (TIERS, break_even_table, break_even_tokens, prefix_recompute_seconds,
                                      recompute_seconds, reload_seconds)
from labkit.teaching import build_it_tiers
from labkit.teaching.build_it_tiers import (SLOW_TIER, WRONG_DECISIONS, TierCase, reload_cases, reload_check,
                                            reload_or_recompute, reload_problems)
from labkit.teaching.exercises import Exercises

# what the chapter's checker forbids: labkit's pieces of the answer
FORBID = [reload_seconds, recompute_seconds, prefix_recompute_seconds, break_even_tokens, break_even_table]


def solution(tier_tokens, cached_tokens, suffix_tokens, bytes_per_token, tier, cost_model):
    """A reader's answer, as the chapter's solution writes it: the tier's two numbers and the roofline."""
    if tier_tokens == 0:
        return False  # nothing in the tier to load

    def step(new, context):  # one step computing `new` tokens after `context` cached ones
        pairs = new * context + new * (new + 1) / 2
        return cost_model.time_from_sums(new, context, pairs)

    load = tier_tokens * bytes_per_token / tier.bandwidth + tier.latency
    extra = step(tier_tokens + suffix_tokens, cached_tokens) - step(suffix_tokens, cached_tokens + tier_tokens)
    return load < extra


# mistake -> the kind of case built to refute it: each must fail on every draw
REFUTED_BY = {
    "whole_step": "a fast tier on a prefix the step computes almost free",
    "no_latency": "a short prefix, where the tier's latency decides",
    "loads_on_miss": "a miss in the tier",
    "pool_as_tier": "a long pool hit before the tier's tokens",
    "tokens_over_bandwidth": "a slow tier on a long prefix",
    "at_most": "a tie",
}


def test_the_solution_and_labkits_answer_pass_and_agree():
    for seed in range(40):
        cases = reload_cases(seed=seed)
        assert reload_problems(solution, cases) == []
        assert reload_problems(reload_or_recompute, cases) == []
        assert all(c.expected == solution(*c.args()) for c in cases)
    for _ in range(10):  # fresh draws
        assert reload_check()(solution) == []


def test_the_solution_passes_the_chapters_checker_strictly(capsys):
    ex = Exercises("08_moving_the_cache", strict=True)
    ex.check_behaviour("Exercise 1", solution, reload_check(), forbid=FORBID)
    assert capsys.readouterr().out.startswith("✅ Exercise 1")


def test_labkits_answer_is_refused_where_the_chapter_forbids_it(capsys):
    Exercises("08_moving_the_cache").check_behaviour("Exercise 1", reload_or_recompute, reload_check(), forbid=FORBID)
    out = capsys.readouterr().out
    assert out.startswith("❌ Exercise 1") and "reload_seconds" in out, out


@pytest.mark.parametrize("mistake", sorted(WRONG_DECISIONS))
def test_each_wrong_answer_fails_on_every_draw_at_its_case(mistake, capsys):
    wrong = WRONG_DECISIONS[mistake]
    for seed in range(25):
        problems = reload_problems(wrong, reload_cases(seed=seed))
        assert any(f", {REFUTED_BY[mistake]}" in p for p in problems), (mistake, problems[:2])
        assert all(p.startswith("case ") and ": expected " in p and "extra compute" in p for p in problems)
    Exercises("08_moving_the_cache").check_behaviour("Exercise 1", wrong, reload_check(), forbid=FORBID)
    out = capsys.readouterr().out
    assert out.startswith("❌ Exercise 1: not yet. case ") and "expected " in out, out


def test_every_wrong_answer_is_refuted_by_every_fresh_draw():
    for _ in range(30):
        cases = reload_cases()
        for mistake, wrong in WRONG_DECISIONS.items():
            assert reload_problems(wrong, cases), mistake


def test_the_hidden_cases_hold_every_edge():
    for seed in range(10):
        cases = reload_cases(seed=seed)
        kinds = [c.kind for c in cases]
        for wanted in list(REFUTED_BY.values()) + ["random"]:
            assert any(k.startswith(wanted) for k in kinds), (seed, wanted)
        assert kinds.count("random") == 12
        edge = {k.split(" (")[0].split(":")[0].split(",")[0]: c for k, c in zip(kinds, cases)}
        slow = edge["a slow tier on a long prefix"]
        assert slow.tier is SLOW_TIER and slow.tier_tokens >= 8192 and not slow.expected
        short = edge["a short prefix"]
        assert short.tier_tokens <= 1024 and short.cached_tokens == 0 and not short.expected
        assert short.tier_tokens * short.bytes_per_token / short.tier.bandwidth < short.extra_s  # the bytes alone win
        miss = edge["a miss in the tier"]
        assert miss.tier_tokens == 0 and miss.reload_s == miss.extra_s == 0.0 and not miss.expected
        fast = edge["a fast tier on a prefix the step computes almost free"]
        assert fast.tier.bandwidth >= 30e9 and not fast.expected
        assert fast.reload_s < recompute_seconds(fast.tier_tokens, fast.cost_model, fast.cached_tokens)  # whole step
        pool = edge["a long pool hit before the tier's tokens"]
        assert pool.expected and not reload_or_recompute(pool.tier_tokens, 0, *pool.args()[2:])
        tie = edge["a tie"]
        assert tie.reload_s == tie.extra_s > 0 and not tie.expected
        assert tie.tier.latency + tie.tier_tokens * (tie.bytes_per_token / tie.tier.bandwidth) == tie.extra_s
    randoms = [c for seed in range(20) for c in reload_cases(seed=seed) if c.kind == "random"]
    assert {c.expected for c in randoms} == {True, False}
    assert {c.tier.name for c in randoms} == set(TIERS) | {SLOW_TIER.name}
    assert max(c.tier_tokens for c in randoms) > 32768 and any(c.tier_tokens == 0 for c in randoms)
    assert len({c.bytes_per_token for c in randoms}) > 6  # several models and cache types
    assert len({c.cost_model.device.name for c in randoms}) == 4


def test_the_cases_are_drawn_afresh_and_no_global_seed_replays_them(monkeypatch):
    def drawn():
        random.seed(0)
        numpy.random.seed(0)
        torch.manual_seed(0)
        return repr(reload_cases())
    assert drawn() != drawn()
    assert repr(reload_cases(seed=5)) == repr(reload_cases(seed=5))
    monkeypatch.setattr(random, "SystemRandom", lambda *args: random.Random(0))  # a generator seeded alike
    assert repr(reload_cases()) != repr(reload_cases())  # the checker took its own when it was defined


def test_an_answer_of_the_wrong_shape_or_type_is_told_what_was_expected():
    verify = reload_check()
    assert verify(42) == ["expected a function reload_or_recompute(tier_tokens, cached_tokens, suffix_tokens, "
                          "bytes_per_token, tier, cost_model); got int 42"]
    assert "cannot be called with" in verify(lambda tier_tokens, cached_tokens: False)[0]
    problems = verify(lambda *args: int(solution(*args)))
    assert problems[0].startswith("case 1 of ") and "a bool; got int" in problems[0]
    assert verify(lambda *args: numpy.bool_(solution(*args))) == []  # a NumPy bool is a bool

    def mutating(tier_tokens, cached_tokens, suffix_tokens, bytes_per_token, tier, cost_model):
        out = solution(tier_tokens, cached_tokens, suffix_tokens, bytes_per_token, tier, cost_model)
        cost_model.overhead_s = 1.0
        return out
    assert verify(mutating) == []  # each call gets its own copies


def test_the_reference_is_labkits_functions_put_together():
    cm = CostModel("Llama-3-8B", "H100 SXM")
    pcie = TIERS["PCIe 4.0 x16 (host to GPU)"]
    b = cm.kv_bytes_per_token
    for tokens in (1, 64, 1000, 5000):
        extra = prefix_recompute_seconds(tokens, cm, suffix_tokens=1)  # no pool hit: tiers.py's own rule
        assert reload_or_recompute(tokens, 0, 1, b, pcie, cm) == (reload_seconds(tokens, b, pcie) < extra)
    h = break_even_tokens(b, pcie, cm)
    assert not reload_or_recompute(h - 1, 0, 1, b, pcie, cm) and reload_or_recompute(h, 0, 1, b, pcie, cm)
    assert reload_or_recompute(0, 1000, 1, b, pcie, cm) is False


@pytest.mark.parametrize("call, parameter", [
    (lambda: reload_check(seed=-1), "seed"), (lambda: reload_cases(seed="0"), "seed"),
    (lambda: reload_check(random_cases=-1), "random_cases"), (lambda: reload_cases(random_cases=2.5), "random_cases"),
    (lambda: reload_problems(solution, []), "cases"), (lambda: reload_problems(solution, "cases"), "cases"),
    (lambda: reload_problems(solution, [("args", True)]), "cases"),
    (lambda: reload_or_recompute(-1, 0, 1, 1024, SLOW_TIER, CostModel()), "tier_tokens"),
    (lambda: reload_or_recompute(1.5, 0, 1, 1024, SLOW_TIER, CostModel()), "tier_tokens"),
    (lambda: reload_or_recompute(1, -1, 1, 1024, SLOW_TIER, CostModel()), "cached_tokens"),
    (lambda: reload_or_recompute(1, 0, 0, 1024, SLOW_TIER, CostModel()), "suffix_tokens"),
    (lambda: reload_or_recompute(1, 0, 1, 0, SLOW_TIER, CostModel()), "bytes_per_token"),
    (lambda: reload_or_recompute(1, 0, 1, float("nan"), SLOW_TIER, CostModel()), "bytes_per_token"),
    (lambda: reload_or_recompute(1, 0, 1, 1024, "PCIe", CostModel()), "tier"),
    (lambda: reload_or_recompute(1, 0, 1, 1024, SLOW_TIER, "H100"), "cost_model"),
    (lambda: reload_or_recompute(0, 0, 1, 1024, SLOW_TIER, "H100"), "cost_model"),  # checked on a miss too
])
def test_bad_arguments_raise_value_error_naming_them(call, parameter):
    with pytest.raises(ValueError, match=rf"^{parameter} must"):
        call()


def test_a_case_is_what_reload_or_recompute_returns_for_it():
    case = reload_cases(seed=1)[0]
    assert type(case) is TierCase and case.expected == reload_or_recompute(*case.args())
    args = case.args()
    assert args[5] is not case.cost_model  # args() hands out copies
    assert build_it_tiers.SHAPE.name == "reload_or_recompute"
