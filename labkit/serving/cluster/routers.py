"""Routers: which replica serves a request (chapter 07).

A router sees a request when it arrives and knows only what it kept itself: how many requests it
has sent to each replica that have not finished (their **load**, as ``vllm-router`` counts it) and,
for the cache-aware rule, which prompts it sent where. It does not read the replicas' caches.

* ``RoundRobin``: the next replica in turn. A follow-up lands where its conversation is cached
  about 1/N of the time.
* ``LeastLoaded``: the replica with the fewest unfinished requests.
* ``Session``: a request's first ``session_tokens`` tokens, hashed, name its replica, so requests
  that begin alike always meet (``vllm-router``'s ``consistent_hash`` keys on a session header or
  the request; Mooncake's trace has no sessions, so its prefix stands in).
* ``CacheAware``: the rule of SGLang's router, which ``vllm-router`` inherited
  (``src/policies/cache_aware.rs``, ``CacheAwarePolicy``): if the load is imbalanced, the least
  loaded replica; else the replica whose remembered prompts match the longest prefix, if that
  match is more than ``cache_threshold`` of the prompt; else the least loaded. ``cache_aware_choice``
  is that decision alone. The real router remembers request *text* in an approximate radix tree per
  replica; this one remembers each prompt's full blocks of tokens (its hash chain).

Ties go to the lowest index among the least loaded, so every router is deterministic.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import Sequence

from ...checks import check_choice, check_int, check_number
from ..sim.workloads import RequestSpec

__all__ = ["CACHE_THRESHOLD", "BALANCE_ABS_THRESHOLD", "BALANCE_REL_THRESHOLD", "is_imbalanced",
           "cache_aware_choice", "Router", "RoundRobin", "LeastLoaded", "Session", "CacheAware", "ROUTERS",
           "make_router"]

# vllm-router's defaults for --policy cache_aware (the same as SGLang's router; its CLI's CacheAware config).
CACHE_THRESHOLD = 0.3        # --cache-threshold: the match must cover more than this share of the prompt
BALANCE_ABS_THRESHOLD = 64   # --balance-abs-threshold: imbalanced when max load - min load > 64 ...
BALANCE_REL_THRESHOLD = 1.5  # --balance-rel-threshold: ... and max load > 1.5 x min load


def _least_loaded(loads: Sequence[int]) -> int:
    return min(range(len(loads)), key=lambda i: (loads[i], i))


def is_imbalanced(loads: Sequence[int], balance_abs_threshold: float = BALANCE_ABS_THRESHOLD,
                  balance_rel_threshold: float = BALANCE_REL_THRESHOLD) -> bool:
    """Both of the router's conditions: ``max - min > balance_abs_threshold`` and
    ``max > min * balance_rel_threshold``."""
    hi, lo = max(loads), min(loads)
    return hi - lo > balance_abs_threshold and hi > lo * balance_rel_threshold


def cache_aware_choice(match_tokens: Sequence[int], loads: Sequence[int], prompt_len: int, *,
                       cache_threshold: float = CACHE_THRESHOLD, balance_abs_threshold: float = BALANCE_ABS_THRESHOLD,
                       balance_rel_threshold: float = BALANCE_REL_THRESHOLD) -> int:
    """The cache-aware decision: the replica (an index) for a prompt of ``prompt_len`` tokens.

    ``match_tokens[i]``: how many leading tokens of the prompt replica ``i`` is believed to hold, in
    whole blocks; ``loads[i]``: its unfinished requests. Imbalanced load (``is_imbalanced``) sends the
    request to the least loaded replica whatever the match. Otherwise the longest match wins if it
    covers more than ``cache_threshold`` of the prompt (ties: the least loaded of them); a weaker match
    is not worth a busier replica, and the least loaded wins.
    """
    if not isinstance(loads, (list, tuple)) or not loads:
        raise ValueError("loads must be a non-empty list of request counts, one per replica")
    if not isinstance(match_tokens, (list, tuple)) or len(match_tokens) != len(loads):
        raise ValueError(f"match_tokens must be a list of {len(loads)} token counts, one per replica")
    check_int("prompt_len", prompt_len, 1)
    for i, (m, n) in enumerate(zip(match_tokens, loads)):
        check_int(f"loads[{i}]", n, 0)
        if check_int(f"match_tokens[{i}]", m, 0) > prompt_len:
            raise ValueError(f"match_tokens[{i}] must be in [0, {prompt_len}] (the prompt's length), got {m}")
    check_number("cache_threshold", cache_threshold, 0)
    if cache_threshold > 1:
        raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
    check_number("balance_abs_threshold", balance_abs_threshold, 0, finite=True)
    check_number("balance_rel_threshold", balance_rel_threshold, 0, finite=True)
    if is_imbalanced(loads, balance_abs_threshold, balance_rel_threshold):
        return _least_loaded(loads)
    best = max(match_tokens)
    if best / prompt_len > cache_threshold:
        return min((i for i, m in enumerate(match_tokens) if m == best), key=lambda i: (loads[i], i))
    return _least_loaded(loads)  # a weak match is not worth a longer queue


class Router:
    """A routing rule. ``reset(num_replicas)`` before a run; ``choose(spec, loads)`` returns the replica
    for a request arriving now, given each replica's unfinished requests; the router may remember it."""

    name = "router"

    def reset(self, num_replicas: int) -> None:
        self.num_replicas = check_int("num_replicas", num_replicas, 1)

    def choose(self, spec: RequestSpec, loads: Sequence[int]) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RoundRobin(Router):
    """Replica 0, 1, ..., N - 1, 0, ... in arrival order."""

    name = "round_robin"

    def reset(self, num_replicas: int) -> None:
        super().reset(num_replicas)
        self.turn = 0

    def choose(self, spec: RequestSpec, loads: Sequence[int]) -> int:
        i, self.turn = self.turn, (self.turn + 1) % self.num_replicas
        return i


class LeastLoaded(Router):
    """The replica with the fewest unfinished requests (vLLM router's shortest queue)."""

    name = "least_loaded"

    def choose(self, spec: RequestSpec, loads: Sequence[int]) -> int:
        return _least_loaded(loads)


class Session(Router):
    """Affinity: the first ``session_tokens`` prompt tokens, hashed (CRC-32), modulo N."""

    name = "session"

    def __init__(self, session_tokens: int = 1024):
        self.session_tokens = check_int("session_tokens", session_tokens, 1)

    def choose(self, spec: RequestSpec, loads: Sequence[int]) -> int:
        key = ",".join(map(str, spec.prompt_token_ids[:self.session_tokens])).encode()
        return zlib.crc32(key) % self.num_replicas

    def __repr__(self) -> str:
        return f"Session(session_tokens={self.session_tokens})"


class CacheAware(Router):
    """``cache_aware_choice`` over what this router sent where: per replica, the full blocks of
    ``block_size`` tokens of every prompt it sent (their hash chain), the least recently sent
    forgotten past ``max_blocks`` (None: never), as vllm-router's tree evicts past ``--max-tree-size``."""

    name = "cache_aware"

    def __init__(self, *, block_size: int = 16, cache_threshold: float = CACHE_THRESHOLD,
                 balance_abs_threshold: float = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD, max_blocks: int | None = None):
        self.block_size = check_int("block_size", block_size, 1)
        self.thresholds = dict(cache_threshold=cache_threshold, balance_abs_threshold=balance_abs_threshold,
                               balance_rel_threshold=balance_rel_threshold)
        cache_aware_choice([0], [0], 1, **self.thresholds)  # checks the thresholds now
        self.max_blocks = None if max_blocks is None else check_int("max_blocks", max_blocks, 1)

    def reset(self, num_replicas: int) -> None:
        super().reset(num_replicas)
        self.memory: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def chain(self, tokens: Sequence[int]) -> list[int]:
        """The names of the prompt's full blocks: each hashes its parent's name and its tokens."""
        bs, names, parent = self.block_size, [], 0
        for i in range(len(tokens) // bs):
            parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            names.append(parent)
        return names

    def match_tokens(self, names: Sequence[int]) -> list[int]:
        """Per replica, the leading blocks of ``names`` it was sent before, in tokens."""
        out = []
        for memory in self.memory:
            k = 0
            while k < len(names) and names[k] in memory:
                k += 1
            out.append(k * self.block_size)
        return out

    def choose(self, spec: RequestSpec, loads: Sequence[int]) -> int:
        names = self.chain(spec.prompt_token_ids)
        i = cache_aware_choice(self.match_tokens(names), list(loads), spec.prompt_len, **self.thresholds)
        memory = self.memory[i]
        for h in names:
            memory[h] = None
            memory.move_to_end(h)
        while self.max_blocks is not None and len(memory) > self.max_blocks:
            memory.popitem(last=False)
        return i

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.thresholds.items())
        return f"CacheAware(block_size={self.block_size}, {args}, max_blocks={self.max_blocks})"


ROUTERS = {cls.name: cls for cls in (RoundRobin, LeastLoaded, Session, CacheAware)}


def make_router(router: str | Router, **settings) -> Router:
    """A router from its name (``ROUTERS``) and settings, or a ``Router`` given as is."""
    if isinstance(router, Router):
        if settings:
            raise ValueError("router settings go with a router name, not with a Router object")
        return router
    return ROUTERS[check_choice("router", router, tuple(ROUTERS))](**settings)
