"""Chapter 07's "build it" exercise: the cache-aware routing decision, judged on hidden cases.

The reader writes ``route(prompt, sent, loads, block_size, cache_threshold, balance_abs_threshold,
balance_rel_threshold) -> int``, the replica a request goes to, from what a router can know:

* ``prompt``: the request's token ids;
* ``sent[i]``: the prompts (token-id lists) the router sent to replica ``i`` before;
* ``loads[i]``: replica ``i``'s unfinished requests.

Two steps. First, per replica, the **match**: the longest prefix the prompt shares with any prompt
sent there, counted only in whole blocks of ``block_size`` tokens that both prompts hold in full
(a prefix cache names full blocks, each by its parent's name and its own tokens, so a partial
block never hits, and two blocks from two different prompts never join into one match). Then the
**decision** of SGLang's router, which ``vllm-router``'s ``cache_aware`` policy inherited: if the
load is imbalanced (``max - min > balance_abs_threshold`` *and* ``max > min * balance_rel_threshold``),
the least loaded replica; else, if the longest match covers *more than* ``cache_threshold`` of the
prompt, the replica with it (ties: the least loaded of them, then the lowest index); else the least
loaded (ties: the lowest index).

labkit's own: ``CacheAware``'s memory of each replica's block chain gives the matches, and
``cache_aware_choice`` the decision (``labkit.serving.cluster.routers``); ``route`` here is those two
put together, and every expected replica is computed with them *before* the reader's code runs.

The hidden cases (``route_cases``) are drawn afresh each run (``guards.draws_hidden_cases``): the
edges every time, each built so that one tempting mistake picks another replica, then random
clusters of 2 to 6 replicas with conversations sharing prefixes of random block counts, ragged
prompt lengths and loads. Thresholds at an exact boundary are powers of two over a prompt a
multiple of four blocks long, so ``match / len(prompt) > t`` and ``match > t * len(prompt)``
agree. ``WRONG_ROUTES`` holds the mistakes, each the solution with one rule changed, which the
checker must refuse (``tests/test_build_it_routing.py``).
"""

from __future__ import annotations

import copy
import numbers
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Sequence

from ..checks import check_int
from ..serving.cluster.routers import (BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD, CACHE_THRESHOLD, CacheAware,
                                       cache_aware_choice)
from .guards import AnswerShape, draws_hidden_cases, function_shape

__all__ = ["SHAPE", "RouteCase", "route", "route_cases", "route_problems", "route_check", "WRONG_ROUTES"]

Verify = Callable[[Any], list[str]]

SHAPE: AnswerShape = function_shape("route", "prompt", "sent", "loads", "block_size", "cache_threshold",
                                    "balance_abs_threshold", "balance_rel_threshold")

_VOCAB = 50_000


@dataclass(frozen=True)
class RouteCase:
    """One hidden case: what ``route`` is called with, what it should return, and what the case is for.

    ``kind`` names the rule it tests, in words (it opens the ❌); ``match`` is each replica's match in
    whole blocks, in tokens, shown when an answer fails; ``thresholds`` are
    ``(cache_threshold, balance_abs_threshold, balance_rel_threshold)``.
    """

    kind: str
    prompt: list
    sent: list
    loads: list
    block_size: int
    thresholds: tuple
    match: list
    expected: int

    def args(self) -> tuple:
        """The arguments of ``route``, in order, as fresh copies."""
        return copy.deepcopy((self.prompt, self.sent, self.loads, self.block_size, *self.thresholds))


# --------------------------------------------------------------------------- labkit's answer


def route(prompt: Sequence[int], sent: Sequence[Sequence[Sequence[int]]], loads: Sequence[int], block_size: int,
          cache_threshold: float = CACHE_THRESHOLD, balance_abs_threshold: float = BALANCE_ABS_THRESHOLD,
          balance_rel_threshold: float = BALANCE_REL_THRESHOLD) -> int:
    """The replica ``CacheAware`` sends ``prompt`` to after it sent ``sent[i]`` to replica ``i``.

    The router's memory is filled with each sent prompt's chain of full blocks, the prompt's chain is
    matched against it (``CacheAware.match_tokens``), and ``cache_aware_choice`` decides.
    """
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError(f"prompt must be a non-empty list of token ids, got {prompt!r}")
    if not isinstance(loads, (list, tuple)) or not loads:
        raise ValueError("loads must be a non-empty list of request counts, one per replica")
    if not isinstance(sent, (list, tuple)) or len(sent) != len(loads) or \
            not all(isinstance(h, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in h) for h in sent):
        raise ValueError(f"sent must be a list of {len(loads)} lists of prompts (token-id lists), one per replica")
    thresholds = dict(cache_threshold=cache_threshold, balance_abs_threshold=balance_abs_threshold,
                      balance_rel_threshold=balance_rel_threshold)
    router = CacheAware(block_size=check_int("block_size", block_size, 1), **thresholds)
    router.reset(len(loads))
    for memory, history in zip(router.memory, sent):
        for p in history:
            memory.update(dict.fromkeys(router.chain(p)))
    match = router.match_tokens(router.chain(prompt))
    return cache_aware_choice(match, list(loads), len(prompt), **thresholds)


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _matches(prompt: Sequence[int], sent: Sequence[Sequence[Sequence[int]]], block_size: int,
             whole_blocks: bool = True) -> list[int]:
    """Per replica, the longest prefix shared with a prompt sent there, in whole blocks (or in tokens)."""
    cut = (lambda n: n // block_size * block_size) if whole_blocks else (lambda n: n)
    return [max((cut(_shared(prompt, p)) for p in history), default=0) for history in sent]


# --------------------------------------------------------------------------- the hidden cases


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(_VOCAB) for _ in range(n)]


def _branch(rng: random.Random, base: list[int], shared: int, length: int) -> list[int]:
    """``length`` tokens whose first ``shared`` are ``base``'s and whose next one differs from ``base``'s."""
    tail = _tokens(rng, length - shared)
    if tail and shared < len(base):
        tail[0] = (base[shared] + 1 + rng.randrange(_VOCAB - 1)) % _VOCAB
    return base[:shared] + tail


_DEFAULTS = (CACHE_THRESHOLD, BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD)


def _case(kind: str, prompt: list, sent: list, loads: list, bs: int, thresholds: tuple = _DEFAULTS) -> RouteCase:
    return RouteCase(kind, prompt, sent, loads, bs, thresholds, _matches(prompt, sent, bs),
                     route(prompt, sent, loads, bs, *thresholds))


def _targeted(rng: random.Random) -> list[RouteCase]:
    """The edges, drawn afresh each run; in each, the mistake named in its comment picks another replica."""
    cases = []

    def setup(blocks: int = 4) -> tuple[int, int, list[int]]:
        bs = rng.choice([2, 4, 8, 16])
        return bs, rng.randint(3, 6), _tokens(rng, blocks * bs)

    def empty(n: int) -> list[list]:
        return [[] for _ in range(n)]

    # No history: the least loaded, ties to the lowest index (highest index fails).
    bs, n, prompt = setup()
    low = rng.randint(0, 8)
    loads = [low + rng.randint(1, 20) for _ in range(n)]
    i, j = sorted(rng.sample(range(n), 2))
    loads[i] = loads[j] = low
    cases.append(_case("an empty history (no replica was sent anything)", prompt, empty(n), loads, bs))

    # A tie in the match broken by load: the less loaded of the two (ignoring load fails, so does the
    # least loaded overall, a third replica without the prefix).
    bs, n, prompt = setup()
    i, j, k = rng.sample(range(n), 3)
    i, j = sorted((i, j))  # the lower index has the higher load: ignoring load picks it
    sent = empty(n)
    sent[i], sent[j] = [_branch(rng, prompt, 3 * bs, 5 * bs)], [_branch(rng, prompt, 3 * bs + bs // 2, 4 * bs)]
    sent[k] = [_branch(rng, prompt, bs - 1, 3 * bs)]  # less than a block: no match
    loads = [rng.randint(10, 20) for _ in range(n)]
    loads[i], loads[j], loads[k] = 14, 12, 5
    cases.append(_case("a tie in the match, broken by load", prompt, sent, loads, bs))

    # A tie in match and load: the lower index of the two (highest index fails).
    bs, n, prompt = setup()
    i, j = sorted(rng.sample(range(n), 2))
    sent = empty(n)
    sent[i] = sent[j] = [_branch(rng, prompt, 2 * bs, 6 * bs)]
    loads = [rng.randint(8, 20) for _ in range(n)]
    loads[i] = loads[j] = 7
    cases.append(_case("a tie in the match and in load", prompt, sent, loads, bs))

    # The match share exactly at the threshold: not more, so the least loaded (>= fails).
    for t, blocks in ((0.25, 4), (0.5, 8)):
        bs, n, prompt = setup(blocks)
        i = rng.randrange(n)
        sent = empty(n)
        sent[i] = [_branch(rng, prompt, int(t * blocks) * bs + rng.randrange(bs), len(prompt))]
        loads = [rng.randint(0, 10) for _ in range(n)]
        loads[i] = 11
        cases.append(_case(f"a match share exactly at the threshold ({t}, so not more than it)", prompt, sent, loads,
                           bs, (t, BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD)))
        one_more = list(sent)
        one_more[i] = [_branch(rng, prompt, (int(t * blocks) + 1) * bs, len(prompt) + bs)]
        cases.append(_case(f"a match share one block over the threshold ({t})", prompt, one_more, loads, bs,
                           (t, BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD)))

    # Loads apart, the prefix on the busiest replica: imbalanced only when both conditions hold (OR fails).
    for kind, lo, hi in (("loads apart by more than the absolute threshold, not the relative one", 200, 290),
                         ("loads apart by more than the relative threshold, not the absolute one", 4, 40),
                         ("loads apart by exactly the absolute threshold (so not more than it)", 10, 74),
                         ("imbalanced loads (both thresholds passed): the least loaded", 10, 120)):
        bs, n, prompt = setup()
        i = rng.randrange(n)
        sent = empty(n)
        sent[i] = [_branch(rng, prompt, len(prompt), len(prompt) + rng.randint(0, 3 * bs))]
        loads = [rng.randint(lo, hi) for _ in range(n)]
        loads[i], loads[(i + rng.randint(1, n - 1)) % n] = hi, lo
        cases.append(_case(kind, prompt, sent, loads, bs))

    # Long in tokens, short in whole blocks: 1 block and bs - 1 tokens of a 4-block prompt is a share of
    # 0.25, under 0.3; in tokens it is 7/16 or more (counting tokens fails).
    bs, n, prompt = setup()
    bs = max(bs, 4)
    prompt = _tokens(rng, 4 * bs)
    i, k = rng.sample(range(n), 2)
    sent = empty(n)
    sent[i] = [_branch(rng, prompt, 2 * bs - 1, 4 * bs)]
    loads = [rng.randint(6, 12) for _ in range(n)]
    loads[i], loads[k] = 9, 2
    cases.append(_case("a match long in tokens but short in whole blocks (a partial block does not count)",
                       prompt, sent, loads, bs))

    # A partial block against a whole one: 2 blocks and bs - 1 tokens tie with 2 blocks; the less loaded wins.
    bs, n, prompt = setup()
    i, j = sorted(rng.sample(range(n), 2))
    sent = empty(n)
    sent[i], sent[j] = [_branch(rng, prompt, 3 * bs - 1, 5 * bs)], [_branch(rng, prompt, 2 * bs, 3 * bs)]
    loads = [rng.randint(9, 15) for _ in range(n)]
    loads[i], loads[j] = 8, 3
    cases.append(_case("a partial block against a whole one (both match 2 whole blocks)", prompt, sent, loads, bs))

    # A prompt shorter than one block, sent before whole: no full block, no match.
    bs, n, _ = setup()
    prompt = _tokens(rng, rng.randint(1, bs - 1))
    i = rng.randrange(n)
    sent = empty(n)
    sent[i] = [prompt + _tokens(rng, rng.randint(0, 2 * bs))]
    loads = [rng.randint(0, 6) for _ in range(n)]
    loads[i] = 7
    cases.append(_case("a prompt shorter than one block (no block to match)", prompt, sent, loads, bs))
    return cases


def _random_case(rng: random.Random) -> RouteCase:
    """A cluster of 2 to 6 replicas, conversations sharing prefixes of random block counts, ragged lengths."""
    bs, n = rng.choice([2, 4, 8, 16]), rng.randint(2, 6)
    bases = [_tokens(rng, bs * rng.randint(1, 8) + rng.randrange(bs)) for _ in range(rng.randint(1, 4))]

    def drawn() -> list[int]:
        base = rng.choice(bases)
        shared = rng.choice([len(base), len(base), rng.randint(0, len(base)), bs * rng.randint(0, len(base) // bs)])
        return _branch(rng, base, shared, max(1, shared + rng.choice([0, rng.randint(1, 3 * bs)])))

    sent = [[drawn() for _ in range(rng.choice([0, 1, 2, 2, 3]))] for _ in range(n)]
    loads = {"light": lambda: [rng.randint(0, 20) for _ in range(n)],
             "busy": lambda: [rng.randint(40, 160) for _ in range(n)],
             "one hot": lambda: [rng.choice([rng.randint(0, 30), rng.randint(100, 200)]) for _ in range(n)]}
    thresholds = rng.choice([_DEFAULTS, _DEFAULTS, (0.5, 16, 2.0), (0.125, 32, 1.25)])
    while True:  # exactly at the cache threshold is a targeted case; here a share is always clear of it
        prompt = drawn()
        if all(Fraction(m, len(prompt)) != Fraction(str(thresholds[0])) for m in _matches(prompt, sent, bs)):
            break
    return _case("random", prompt, sent, rng.choice(list(loads.values()))(), bs, thresholds)


def _draw(rng: random.Random, seed: int | None, random_cases: int) -> list[RouteCase]:
    if seed is not None:
        rng = random.Random(check_int("seed", seed, 0))
    check_int("random_cases", random_cases, 0)
    return _targeted(rng) + [_random_case(rng) for _ in range(random_cases)]


@draws_hidden_cases
def route_cases(rng, seed: int | None = None, random_cases: int = 12) -> list[RouteCase]:
    """The hidden cases: every edge (``_targeted``), then ``random_cases`` random clusters, each with
    labkit's expected replica. ``seed`` None: a fresh draw; an int replays one draw (for tests)."""
    return _draw(rng, seed, random_cases)


# --------------------------------------------------------------------------- judging an answer


def _where(number: int, count: int, case: RouteCase) -> str:
    t, a, r = case.thresholds
    return (f"case {number} of {count}, {case.kind}: a prompt of {len(case.prompt)} tokens, blocks of "
            f"{case.block_size}, {len(case.loads)} replicas with loads {case.loads} whose histories match "
            f"{case.match} of its tokens in whole blocks, thresholds cache {t}, balance {a} and {r}")


def route_problems(answer: Any, cases: list[RouteCase]) -> list[str]:
    """What the reader's ``route`` gets wrong on ``cases``, one sentence per failing case (none: right).

    Only the reader's function runs here; each call gets fresh copies of the case's arguments. An answer
    of another shape gets one sentence saying what was expected, before any case runs.
    """
    if type(cases) is not list or not cases or not all(type(c) is RouteCase for c in cases):
        raise ValueError(f"cases must be a non-empty list from route_cases(), got {type(cases).__name__}")
    if problem := SHAPE.problem(answer):
        return [problem]
    problems = []
    for number, case in enumerate(cases, start=1):
        got = answer(*case.args())
        if type(got) is bool or not isinstance(got, numbers.Integral):
            problems.append(f"{_where(number, len(cases), case)}: expected replica {case.expected}, an int; "
                            f"got {type(got).__name__} {got!r}"[:600])
        elif int(got) != case.expected:
            problems.append(f"{_where(number, len(cases), case)}: expected replica {case.expected}, got {int(got)}")
    return problems


@draws_hidden_cases
def route_check(rng, seed: int | None = None, random_cases: int = 12) -> Verify:
    """``verify(route) -> list of problems`` for ``Exercises.check_behaviour``, on cases drawn now."""
    cases = _draw(rng, seed, random_cases)

    def verify(answer: Callable) -> list[str]:
        return route_problems(answer, cases)

    return verify


# --------------------------------------------------------------------------- mistakes the checker must refuse


def _decided(prompt: Sequence[int], sent: Sequence, loads: Sequence[int], block_size: int, cache_threshold: float,
             balance_abs_threshold: float, balance_rel_threshold: float, *, mistake: str) -> int:
    """The solution written out, with the one ``mistake`` named (a key of ``WRONG_ROUTES``)."""
    match = _matches(prompt, sent, block_size, whole_blocks=mistake != "counts_tokens")
    ids = range(len(loads))
    order = (lambda i: (loads[i], -i)) if mistake == "highest_index" else (lambda i: (loads[i], i))
    least = min(ids, key=order)
    if mistake == "ignores_match":
        return least
    best = max(match)
    if mistake == "ignores_load":
        return match.index(best)
    hi, lo = max(loads), min(loads)
    apart, ratio = hi - lo > balance_abs_threshold, hi > lo * balance_rel_threshold
    if (apart or ratio) if mistake == "or_imbalance" else (apart and ratio):
        return least
    share = best / len(prompt)
    if share >= cache_threshold if mistake == "at_least_threshold" else share > cache_threshold:
        return min((i for i in ids if match[i] == best), key=order)
    return least


def _wrong(mistake: str, doc: str) -> Callable[..., int]:
    def wrong_route(prompt, sent, loads, block_size, cache_threshold=CACHE_THRESHOLD,
                    balance_abs_threshold=BALANCE_ABS_THRESHOLD, balance_rel_threshold=BALANCE_REL_THRESHOLD):
        return _decided(prompt, sent, loads, block_size, cache_threshold, balance_abs_threshold,
                        balance_rel_threshold, mistake=mistake)

    wrong_route.__name__ = wrong_route.__qualname__ = mistake
    wrong_route.__doc__ = doc
    return wrong_route


#: mistake -> a ``route`` with that one mistake; the checker refuses each on every draw
WRONG_ROUTES: dict[str, Callable[..., int]] = {m: _wrong(m, d) for m, d in (
    ("ignores_load", "Always the longest match (ties: the lowest index): no imbalance check, no threshold."),
    ("ignores_match", "Always the least loaded: the prefix never decides."),
    ("counts_tokens", "Matches counted in tokens, partial blocks included, as a text-matching router counts."),
    ("at_least_threshold", "A match share equal to cache_threshold wins (>=, not >)."),
    ("or_imbalance", "Imbalanced when either load condition holds (OR, not AND)."),
    ("highest_index", "Ties broken by the highest index, not the lowest."))}
