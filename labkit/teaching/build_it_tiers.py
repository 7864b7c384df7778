"""Chapter 08's "build it" exercise: reload a prefix from the second tier, or compute it again.

The reader writes ``reload_or_recompute(tier_tokens, cached_tokens, suffix_tokens, bytes_per_token, tier,
cost_model) -> bool``: a request's prompt starts with ``cached_tokens`` found in the pool (GPU memory),
then ``tier_tokens`` found in the second ``tier``, then ``suffix_tokens`` found nowhere, which the
request's next step computes anyway. True when loading the tier's tokens takes less time than computing
them again in that step:

* loading costs ``tier_tokens × bytes_per_token / tier.bandwidth + tier.latency``
  (``labkit.serving.sim.tiers.reload_seconds``);
* recomputing costs the step's *extra* time, priced by the roofline ``cost_model``::

      extra = step(tier_tokens + suffix_tokens new after cached_tokens)
              - step(suffix_tokens new after cached_tokens + tier_tokens)

  the rule of ``tiers.prefix_recompute_seconds``, with the pool's tokens as the context of both steps
  (their attention makes each recomputed token dearer);
* nothing found in the tier (``tier_tokens == 0``) is never loaded; a tie recomputes (strictly less).

labkit's own answer is :func:`reload_or_recompute`, built on ``reload_seconds`` and ``recompute_seconds``;
every expected answer is computed with it *before* the reader's code runs.

The hidden cases (``reload_cases``) are drawn afresh each run (``guards.draws_hidden_cases``): the edges
every time, each drawn until the tempting mistake it is built for answers otherwise (a slow tier on a long
prefix, a prefix where the latency tips the answer, a miss after an eviction from the tier, a fast tier on
a prefix that rides along the weight read, a long pool hit whose attention makes recomputing dearer, an
exact tie), then random cases over the tier presets (``TIERS`` and :data:`SLOW_TIER`), the cost model's
models and devices, bytes per token from ``labkit.memory.capacity`` (bf16, fp8, int4) and token counts
up to 64k. ``WRONG_DECISIONS`` holds the mistakes, each the solution with one rule changed, which the
checker must refuse (``tests/test_build_it_tiers.py``).
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..checks import check_int
from ..memory.capacity import kv_bytes_per_token
from ..serving.sim.costmodel import DEVICES, MODEL_COSTS, CostModel
from ..serving.sim.tiers import (TIERS, Tier, break_even_tokens, prefix_recompute_seconds, recompute_seconds,
                                 reload_seconds)
from .guards import AnswerShape, draws_hidden_cases, function_shape

__all__ = ["SHAPE", "SLOW_TIER", "TierCase", "reload_or_recompute", "reload_cases", "reload_problems",
           "reload_check", "WRONG_DECISIONS"]

Verify = Callable[[Any], list[str]]

SHAPE: AnswerShape = function_shape("reload_or_recompute", "tier_tokens", "cached_tokens", "suffix_tokens",
                                    "bytes_per_token", "tier", "cost_model")

#: a tier slower per token than a GPU's arithmetic, for the hidden cases (``TIERS`` holds none)
SLOW_TIER = Tier("Network 10 Gb/s (TCP)", 1.25e9, 50e-6,
                 source="10 Gb/s Ethernet line rate = 1.25 GB/s before protocol overhead; latency 50 us assumed "
                        "(a TCP round trip within a rack)")

_TIERS = [*TIERS.values(), SLOW_TIER]
_FAST = [t for t in _TIERS if t.bandwidth >= 30e9]
_CACHE_DTYPES = ("auto", "auto", "fp8_per_tensor", "int4_per_group")  # bf16 twice as often
_MAX = 1 << 16  # token counts up to 64k


@dataclass(frozen=True)
class TierCase:
    """One hidden case: what ``reload_or_recompute`` is called with, what it should return, and why.

    ``kind`` names the rule it tests, in words (it opens the ❌); ``reload_s`` and ``extra_s`` are the two
    costs labkit computes (seconds), shown when an answer fails.
    """

    kind: str
    tier_tokens: int
    cached_tokens: int
    suffix_tokens: int
    bytes_per_token: float
    tier: Tier
    cost_model: CostModel
    reload_s: float
    extra_s: float
    expected: bool

    def args(self) -> tuple:
        """The arguments of ``reload_or_recompute``, in order, as fresh copies."""
        return copy.deepcopy((self.tier_tokens, self.cached_tokens, self.suffix_tokens, self.bytes_per_token,
                              self.tier, self.cost_model))


# --------------------------------------------------------------------------- labkit's answer


def reload_or_recompute(tier_tokens: int, cached_tokens: int, suffix_tokens: int, bytes_per_token: float,
                        tier: Tier, cost_model: CostModel) -> bool:
    """Whether loading the ``tier_tokens`` found in ``tier`` (after ``cached_tokens`` found in the pool) takes
    less time than computing them again in the step that computes the last ``suffix_tokens`` (at least one:
    the token whose logits the request samples) anyway. Nothing in the tier: False; a tie: False."""
    tier_tokens = check_int("tier_tokens", tier_tokens, 0)
    cached_tokens = check_int("cached_tokens", cached_tokens, 0)
    suffix_tokens = check_int("suffix_tokens", suffix_tokens, 1)
    load = reload_seconds(tier_tokens, bytes_per_token, tier)  # checks bytes_per_token and tier
    extra = prefix_recompute_seconds(tier_tokens, cost_model, suffix_tokens, cached_tokens)  # checks cost_model
    return tier_tokens > 0 and load < extra


# --------------------------------------------------------------------------- the hidden cases


def _case(kind: str, tier_tokens: int, cached_tokens: int, suffix_tokens: int, bytes_per_token: float,
          tier: Tier, cost_model: CostModel) -> TierCase:
    return TierCase(kind, tier_tokens, cached_tokens, suffix_tokens, bytes_per_token, tier, cost_model,
                    reload_seconds(tier_tokens, bytes_per_token, tier),
                    prefix_recompute_seconds(tier_tokens, cost_model, suffix_tokens, cached_tokens),
                    reload_or_recompute(tier_tokens, cached_tokens, suffix_tokens, bytes_per_token, tier, cost_model))


def _refutes(mistake: str, case: TierCase) -> bool:
    """Whether the answer with ``mistake`` gets ``case`` wrong."""
    return WRONG_DECISIONS[mistake](*case.args()) != case.expected


def _setup(rng: random.Random) -> tuple[CostModel, float]:
    """A model and device of the cost model's presets (with a per-step overhead now and then), and the bytes
    per token of that model's cache stored as bf16, fp8 or int4 (``labkit.memory.capacity``)."""
    overhead = rng.choice([0.0, 0.0, rng.uniform(1e-5, 2e-3)])
    cm = CostModel(rng.choice(sorted(MODEL_COSTS)), rng.choice(sorted(DEVICES)), overhead_s=overhead)
    return cm, kv_bytes_per_token(cm.model.shape, rng.choice(_CACHE_DTYPES))


def _tokens(rng: random.Random, low: int = 0) -> int:
    """A token count from ``low`` to 64k, spread over the scales (a few, a few thousand, tens of thousands)."""
    return max(low, rng.choice([0, rng.randint(1, 64), rng.randint(1, 4096), rng.randint(1, _MAX)]))


def _until(rng: random.Random, draw: Callable[[random.Random], TierCase | None], what: str) -> TierCase:
    """The first case ``draw`` accepts (it returns None to draw again)."""
    for _ in range(10_000):
        case = draw(rng)
        if case is not None:
            return case
    raise RuntimeError(f"no case found for {what}")  # never seen: each draw succeeds often


def _slow(rng: random.Random) -> TierCase | None:
    # A slow tier: its bytes cost more per token than the arithmetic, so a long prefix recomputes; judged
    # by tokens / bandwidth (bytes per token forgotten) it would load.
    cm, b = _setup(rng)
    case = _case("a slow tier on a long prefix", rng.randint(8192, _MAX), rng.randint(0, 4096),
                 rng.choice([1, rng.randint(1, 512)]), b, SLOW_TIER, cm)
    return case if not case.expected and _refutes("tokens_over_bandwidth", case) else None


def _latency(rng: random.Random) -> TierCase | None:
    # The shortest prefix whose bytes alone load faster than it computes: the latency tips it to recompute.
    cm, b = _setup(rng)
    tier = rng.choice([t for t in _TIERS if t.latency > 0])
    suffix = rng.choice([1, rng.randint(1, 64), rng.randint(1, 4096)])
    h = break_even_tokens(b, Tier("bytes only", tier.bandwidth, 0.0), cm, max_tokens=1024, suffix_tokens=suffix)
    if h is None:
        return None
    case = _case("a short prefix, where the tier's latency decides", h, 0, suffix, b, tier, cm)
    return case if not case.expected and _refutes("no_latency", case) else None


def _miss(rng: random.Random) -> TierCase:
    # The prefix's blocks were evicted from the tier: nothing to load, whatever the tier.
    cm, b = _setup(rng)
    return _case("a miss in the tier (its blocks were evicted): nothing to load", 0, _tokens(rng),
                 _tokens(rng, 1), b, rng.choice(_TIERS), cm)


def _fast(rng: random.Random) -> TierCase | None:
    # A fast tier, a prefix short enough to ride along the step's weight read: the extra is (nearly) nothing,
    # the whole step is milliseconds.
    cm, b = _setup(rng)
    case = _case("a fast tier on a prefix the step computes almost free (the extra, not the whole step)",
                 rng.randint(1, 256), rng.randint(0, 4096), rng.randint(1, 16), b, rng.choice(_FAST), cm)
    return case if not case.expected and _refutes("whole_step", case) else None


def _pool(rng: random.Random) -> TierCase | None:
    # Without a pool hit the tier's tokens recompute; after a long one, attention over it makes each of them
    # dearer, and loading wins. The pool's tokens are not the tier's: they are neither loaded nor recomputed.
    cm, b = _setup(rng)
    tier, tokens, suffix = rng.choice(_TIERS), rng.randint(16, 4096), rng.choice([1, rng.randint(1, 4096)])
    if reload_or_recompute(tokens, 0, suffix, b, tier, cm) \
            or not reload_or_recompute(tokens, _MAX, suffix, b, tier, cm):
        return None
    lo, hi = 0, _MAX  # recompute at lo, load at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if reload_or_recompute(tokens, mid, suffix, b, tier, cm) else (mid, hi)
    case = _case("a long pool hit before the tier's tokens (its attention makes recomputing them dearer)",
                 tokens, rng.randint(hi, min(_MAX, 2 * hi)), suffix, b, tier, cm)
    return case if case.expected and _refutes("pool_as_tier", case) else None


def _tie(rng: random.Random) -> TierCase | None:
    # A made-up tier whose reload costs exactly the extra compute. Every number is exact in floating point:
    # the bandwidth is a power of two (so tokens × bytes / bandwidth is exact) and each subtraction is of
    # numbers within a factor 2 (Sterbenz), so `reload < extra`, `reload + step_b < step_a` and the like
    # all see the same tie.
    cm, _ = _setup(rng)
    b = float(cm.kv_bytes_per_token)
    tokens, cached = rng.randint(256, 8192), rng.randint(0, 8192)
    suffix = rng.randint(tokens, 4 * tokens)
    step_a = recompute_seconds(tokens + suffix, cm, cached)
    step_b = recompute_seconds(suffix, cm, cached + tokens)
    extra = step_a - step_b
    if not (extra > 0 and step_a / 2 <= step_b):
        return None
    bandwidth = 2.0 ** math.ceil(math.log2(tokens * b / extra))  # tokens × b / bandwidth in (extra / 2, extra]
    latency = extra - tokens * b / bandwidth
    tier = Tier("made up, at the break-even", bandwidth, latency)
    case = _case("a tie: the reload costs exactly the extra compute (a tie recomputes)", tokens, cached, suffix,
                 b, tier, cm)
    ok = case.reload_s == case.extra_s == latency + tokens * (b / bandwidth) and step_b + case.reload_s == step_a
    return case if ok and _refutes("at_most", case) else None


def _targeted(rng: random.Random) -> list[TierCase]:
    """The edges, drawn afresh each run; in each, the mistake named in its comment answers otherwise."""
    return [_until(rng, _slow, "a slow tier"), _until(rng, _latency, "the latency"), _miss(rng),
            _until(rng, _fast, "a fast tier"), _until(rng, _pool, "a pool hit"), _until(rng, _tie, "a tie")]


def _random_case(rng: random.Random) -> TierCase:
    """Any tier preset, model, device and cache type; token counts up to 64k; never within a hair of a tie
    (a tie is a targeted case: here the answer must not hang on the order of a sum)."""
    while True:
        cm, b = _setup(rng)
        case = _case("random", _tokens(rng), _tokens(rng), _tokens(rng, 1), b, rng.choice(_TIERS), cm)
        if case.tier_tokens == 0 or not math.isclose(case.reload_s, case.extra_s, rel_tol=1e-9):
            return case


def _draw(rng: random.Random, seed: int | None, random_cases: int) -> list[TierCase]:
    if seed is not None:
        rng = random.Random(check_int("seed", seed, 0))
    check_int("random_cases", random_cases, 0)
    return _targeted(rng) + [_random_case(rng) for _ in range(random_cases)]


@draws_hidden_cases
def reload_cases(rng, seed: int | None = None, random_cases: int = 12) -> list[TierCase]:
    """The hidden cases: every edge (``_targeted``), then ``random_cases`` random ones, each with labkit's
    expected answer. ``seed`` None: a fresh draw; an int replays one draw (for tests)."""
    return _draw(rng, seed, random_cases)


# --------------------------------------------------------------------------- judging an answer


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.6g} ms"


def _where(number: int, count: int, case: TierCase) -> str:
    t, cm = case.tier, case.cost_model
    return (f"case {number} of {count}, {case.kind}: {case.tier_tokens:,} tokens in the tier after "
            f"{case.cached_tokens:,} in the pool, {case.suffix_tokens:,} computed in the step anyway, "
            f"{case.bytes_per_token:g} bytes per token, tier {t.name!r} ({t.bandwidth / 1e9:.4g} GB/s, latency "
            f"{t.latency * 1e6:.4g} us), {cm.model.shape.name} on {cm.device.name}: reload "
            f"{_ms(case.reload_s)}, extra compute {_ms(case.extra_s)}")


def _answer(expected: bool) -> str:
    return f"{expected} ({'load' if expected else 'recompute'})"


def reload_problems(answer: Any, cases: list[TierCase]) -> list[str]:
    """What the reader's ``reload_or_recompute`` gets wrong on ``cases``, one sentence per failing case
    (none: right).

    Only the reader's function runs here; each call gets fresh copies of the case's arguments. An answer
    of another shape gets one sentence saying what was expected, before any case runs.
    """
    if type(cases) is not list or not cases or not all(type(c) is TierCase for c in cases):
        raise ValueError(f"cases must be a non-empty list from reload_cases(), got {type(cases).__name__}")
    if problem := SHAPE.problem(answer):
        return [problem]
    problems = []
    for number, case in enumerate(cases, start=1):
        got = answer(*case.args())
        if not isinstance(got, (bool, np.bool_)):
            problems.append(f"{_where(number, len(cases), case)}: expected {_answer(case.expected)}, a bool; "
                            f"got {type(got).__name__} {got!r}"[:800])
        elif bool(got) != case.expected:
            problems.append(f"{_where(number, len(cases), case)}: expected {_answer(case.expected)}, "
                            f"got {_answer(bool(got))}")
    return problems


@draws_hidden_cases
def reload_check(rng, seed: int | None = None, random_cases: int = 12) -> Verify:
    """``verify(reload_or_recompute) -> list of problems`` for ``Exercises.check_behaviour``, on cases
    drawn now."""
    cases = _draw(rng, seed, random_cases)

    def verify(answer: Callable) -> list[str]:
        return reload_problems(answer, cases)

    return verify


# --------------------------------------------------------------------------- mistakes the checker must refuse


def _decided(tier_tokens: int, cached_tokens: int, suffix_tokens: int, bytes_per_token: float, tier: Tier,
             cost_model: CostModel, *, mistake: str) -> bool:
    """The solution written out as a reader writes it (the tier's two numbers and ``time_from_sums``, none
    of the functions the chapter forbids), with the one ``mistake`` named (a key of ``WRONG_DECISIONS``)."""
    def step(new: int, context: int) -> float:
        return cost_model.time_from_sums(new, context, new * context + new * (new + 1) / 2)

    if mistake == "pool_as_tier":
        tier_tokens, cached_tokens = tier_tokens + cached_tokens, 0
    if tier_tokens == 0:
        return mistake == "loads_on_miss"
    moved = tier_tokens if mistake == "tokens_over_bandwidth" else tier_tokens * bytes_per_token
    load = moved / tier.bandwidth + (0.0 if mistake == "no_latency" else tier.latency)
    extra = step(tier_tokens, cached_tokens) if mistake == "whole_step" else \
        step(tier_tokens + suffix_tokens, cached_tokens) - step(suffix_tokens, cached_tokens + tier_tokens)
    return load <= extra if mistake == "at_most" else load < extra


def _wrong(mistake: str, doc: str) -> Callable[..., bool]:
    def wrong_decision(tier_tokens, cached_tokens, suffix_tokens, bytes_per_token, tier, cost_model):
        return _decided(tier_tokens, cached_tokens, suffix_tokens, bytes_per_token, tier, cost_model,
                        mistake=mistake)

    wrong_decision.__name__ = wrong_decision.__qualname__ = mistake
    wrong_decision.__doc__ = doc
    return wrong_decision


#: mistake -> a ``reload_or_recompute`` with that one mistake; the checker refuses each on every draw
WRONG_DECISIONS: dict[str, Callable[..., bool]] = {m: _wrong(m, d) for m, d in (
    ("whole_step", "Recomputing is charged the whole step of the tier's tokens, weight read included "
                   "(suffix_tokens ignored), not the extra time they add to the step the request needs anyway."),
    ("no_latency", "Loading costs the bytes over the bandwidth only: the tier's latency is dropped."),
    ("loads_on_miss", "A miss in the tier (tier_tokens == 0, its blocks evicted) still loads."),
    ("pool_as_tier", "The pool's tokens are counted as the tier's: cached_tokens + tier_tokens loaded or "
                     "recomputed from the start."),
    ("tokens_over_bandwidth", "A tier judged by its link rate: tokens / bandwidth, bytes per token forgotten."),
    ("at_most", "A tie loads (<=, not <)."))}
