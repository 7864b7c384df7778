"""Prefill here, decode there: disaggregated serving in the simulator (chapter 08).

In one pool a long prefill and the decodes share every step: a 4,000-token prompt makes every other
request's next token wait for it. DistServe and Mooncake split the work: **prefill replicas** only
compute prompts, **decode replicas** only generate, and each finished prompt's K/V travel from one
to the other. The move costs the prompt's bytes over the link (chapter 02's formula, a ``Tier`` of
``labkit.serving.sim.tiers`` as the link); what it buys is decode steps no prefill interrupts.

``simulate_split`` runs it on chapter 06's servers:

1. the prefill replicas serve every request with one output token (the prompt's first token ends it),
   requests dealt out in turn;
2. each prompt's K/V then cross the link, one transfer after another on the link of the decode replica
   it goes to (the least loaded at its prefill's end), ``prompt bytes / bandwidth + latency`` each;
3. the decode replica admits the request with the prompt's full blocks already in hand (a
   ``HandoffInbox``, the second tier's hook of ``labkit.memory.tiered``): it computes the rest of
   the last block and the last prompt token, samples the first token and goes on, as vLLM's decode
   side does (``vllm/v1/core/sched/scheduler.py``, ``_update_waiting_for_remote_kv``:
   ``num_computed_tokens = num_tokens - 1``). The TTFT a user sees is therefore the prefill, the
   transfer and the decode's first step.

``goodput`` is DistServe's measure: the share of requests that meet both a TTFT target and a
time-per-output-token target.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ...checks import check_int, check_number
from ...memory.paging import BlockAllocator
from ...memory.prefix import CacheKey, CachedBlock, hash_chain
from ...memory.tiered import TieredPrefixCache, TierStore
from ..scheduler import Scheduler
from ..sim.costmodel import CostModel
from ..sim.simulator import Simulator, SimResult, SimRun, _fast_block_hash, check_requests
from ..sim.tiers import Tier, reload_seconds
from ..sim.workloads import RequestSpec, check_specs
from ..variants.tiered import TieredScheduler

__all__ = ["HandoffInbox", "SplitResult", "simulate_split", "goodput"]


class HandoffInbox(TierStore):
    """The blocks handed over to a decode replica: ``deliver(tokens)`` makes a prompt's full blocks (all
    before its last token) findable, named by this replica's own hash chain with content ids of its own
    (negative, apart from its cache's), each chained to whatever block precedes it here."""

    def __init__(self, block_size: int, hash_fn=_fast_block_hash, key: CacheKey = CacheKey()):
        super().__init__(capacity=1 << 62)
        self.block_size, self.hash_fn, self.key = block_size, hash_fn, key
        self._delivered: dict[Any, tuple[Any, tuple[int, ...]]] = {}  # block hash -> (parent hash, tokens)
        self._ids = itertools.count(-1, -1)

    def deliver(self, token_ids: Sequence[int]) -> int:
        """A prompt's K/V arrived; returns how many tokens of it a match can now find (full blocks only)."""
        bs, usable = self.block_size, (len(token_ids) - 1) // self.block_size
        hashes = hash_chain(token_ids, bs, self.key, self.hash_fn)[:usable]
        for i, h in enumerate(hashes):
            self._delivered[h] = (hashes[i - 1] if i else None, tuple(token_ids[i * bs:(i + 1) * bs]))
        return usable * bs

    def get(self, h: Any, tokens: Sequence[int], key: CacheKey, parent_entry: int | None) -> CachedBlock | None:
        found = super().get(h, tokens, key, parent_entry)  # blocks this replica evicted and kept
        if found is not None or h not in self._delivered or key != self.key:
            return found
        parent_hash, delivered = self._delivered.pop(h)  # one use: once loaded, the pool names it
        if delivered != tuple(tokens):
            return None
        return CachedBlock(-1, h, parent_hash, delivered, key, next(self._ids), parent_entry)


class _DecodeSimulator(Simulator):
    """A decode replica: chapter 06's server whose prefix cache looks in a ``HandoffInbox`` after its pool."""

    def new_scheduler(self) -> Scheduler:
        self.inbox = HandoffInbox(self.block_size)
        cache = TieredPrefixCache(BlockAllocator(self.num_blocks), self.block_size, self.inbox, hash_fn=_fast_block_hash)
        return super().new_scheduler(cache, TieredScheduler)


@dataclass
class SplitResult:
    """What a split cluster measured, per request in the order of ``request_ids``: ``arrival``,
    ``prefill_end`` (its first token on the prefill side), ``handoff`` (its K/V on the decode side),
    ``first_token`` and ``finish`` (the decode side's), ``output_len``; and each pool's ``SimResult``s."""

    request_ids: np.ndarray
    arrival: np.ndarray
    prefill_end: np.ndarray
    handoff: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    output_len: np.ndarray
    prefill: list[SimResult]
    decode: list[SimResult]

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        """Each request's mean time per output token after its first (NaN for one-token answers)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.output_len > 1, (self.finish - self.first_token) / (self.output_len - 1), np.nan)


def simulate_split(requests: Sequence[RequestSpec], prefill: int = 1, decode: int = 1, *, link: Tier,
                   cost_model: CostModel | None = None, **simulator_settings) -> SplitResult:
    """Serve ``requests`` on ``prefill`` prefill replicas and ``decode`` decode replicas joined by ``link``."""
    check_int("prefill", prefill, 1)
    check_int("decode", decode, 1)
    if not isinstance(link, Tier):
        raise ValueError(f"link must be a labkit.serving.sim.tiers.Tier, got {type(link).__name__}")
    specs = check_specs("requests", requests)
    p_sim = Simulator(cost_model, **simulator_settings)
    d_sim = _DecodeSimulator(cost_model, **simulator_settings)
    order = [s for s, _ in check_requests(specs, p_sim.new_scheduler())]
    # 1. Prefill: every prompt to its first token, dealt out in turn.
    p_runs = [SimRun(p_sim) for _ in range(prefill)]
    for k, spec in enumerate(order):
        p_runs[k % prefill].add(RequestSpec(spec.request_id, spec.arrival_time, spec.prompt_token_ids, 1,
                                            spec.prefix_len))
    for run in p_runs:
        run.advance()
    p_results = [run.result() for run in p_runs]
    prefill_end = {}
    for k, spec in enumerate(order):
        r = p_results[k % prefill]
        prefill_end[spec.request_id] = float(r.first_token[(k // prefill)])
    # 2. The transfers, in the order prefills end, each on its decode replica's link.
    bytes_per_token = d_sim.cost_model.model.shape.block_bytes(d_sim.block_size) / d_sim.block_size
    d_runs = [SimRun(d_sim) for _ in range(decode)]
    link_free, handoff = [0.0] * decode, {}
    pending: list[tuple[float, int, RequestSpec, int]] = []  # (hand-off time, order, spec, replica)
    for spec in sorted(order, key=lambda s: (prefill_end[s.request_id], s.request_id)):
        end = prefill_end[spec.request_id]
        i = min(range(decode), key=lambda j: (d_runs[j].load + sum(1 for p in pending if p[3] == j), j))
        start = max(end, link_free[i])
        link_free[i] = start + reload_seconds(spec.prompt_len, bytes_per_token, link)
        handoff[spec.request_id] = link_free[i]
        heapq.heappush(pending, (link_free[i], spec.request_id, spec, i))
    # 3. Decode: each request arrives with its prompt's blocks in the replica's inbox.
    while pending:
        t, _, spec, i = heapq.heappop(pending)
        for run in d_runs:
            run.advance(until=t)
        d_runs[i].sched.prefix_cache.store.deliver(spec.prompt_token_ids)
        d_runs[i].add(RequestSpec(spec.request_id, t, spec.prompt_token_ids, spec.output_len, spec.prefix_len))
    for run in d_runs:
        run.advance()
    d_results = [run.result() for run in d_runs]
    where = {}
    for result, run in zip(d_results, d_runs):
        for j, s in enumerate(run.specs):
            where[s.request_id] = (result, j)
    ids = np.array([s.request_id for s in order])
    first = np.array([where[r][0].first_token[where[r][1]] for r in ids])
    finish = np.array([where[r][0].finish[where[r][1]] for r in ids])
    outs = np.array([where[r][0].output_len[where[r][1]] for r in ids])
    return SplitResult(ids, np.array([s.arrival_time for s in order]), np.array([prefill_end[r] for r in ids]),
                       np.array([handoff[r] for r in ids]), first, finish, outs, p_results, d_results)


def goodput(ttft: np.ndarray, tpot: np.ndarray, ttft_target: float, tpot_target: float) -> float:
    """DistServe's SLO attainment: the share of requests whose TTFT is at most ``ttft_target`` and whose time per
    output token is at most ``tpot_target`` (seconds; a one-token answer has no TPOT and meets that target)."""
    ttft, tpot = np.asarray(ttft, dtype=np.float64), np.asarray(tpot, dtype=np.float64)
    if ttft.ndim != 1 or ttft.shape != tpot.shape or ttft.size == 0:
        raise ValueError("ttft and tpot must be 1-D arrays of one value per request, of the same length")
    check_number("ttft_target", ttft_target, 0, strict=True, finite=True)
    check_number("tpot_target", tpot_target, 0, strict=True, finite=True)
    ok = (ttft <= ttft_target) & (np.isnan(tpot) | (tpot <= tpot_target))
    return float(ok.mean())
