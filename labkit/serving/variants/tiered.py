"""Chapter 05's scheduler over a prefix cache with a second tier, and the simulator that times its loads
(chapter 08).

``TieredScheduler`` changes one thing: after each ``schedule()`` it records, in the step's stats, the
tokens its admissions loaded from the tier (``tier_hit_tokens``) and the seconds the loads took
(``load_s``, from ``load_seconds``). The pool's hits are counted as before
(``prefix_cache.stats``, vLLM's counting); the tier's apart (``prefix_cache.store.stats``), as vLLM
counts its KV connector's (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``:
``connector_prefix_cache_stats``): ``tier_stats``, its loads after a preemption apart.

Loads here are *synchronous*: the step that admits a request lasts its compute plus its loads. vLLM's
OffloadingConnector loads asynchronously by default, parking the request (``WAITING_FOR_REMOTE_KVS``)
while others run; so for a request's own TTFT this is what happens, and for the requests batched with
it the step time is an upper bound.

``TieredSimulator`` is chapter 06's ``Simulator`` with such a scheduler: a ``Tier`` (bandwidth, latency)
of ``tier_blocks`` blocks, and the rule of chapter 08: load only when moving the bytes takes less time
than computing the tokens again inside the step the request needs anyway.
"""

from __future__ import annotations

from typing import Callable

from ...checks import check_int
from ...memory.paging import BlockAllocator
from ...memory.prefix import PrefixCacheStats
from ...memory.tiered import TieredPrefixCache, TierStore
from ..request import Request, RequestStatus
from ..scheduler import Scheduler
from ..sim.simulator import Simulator, _fast_block_hash
from ..sim.tiers import Tier, prefix_recompute_seconds, reload_seconds
from ..step import Step

__all__ = ["TieredScheduler", "TieredSimulator", "worth_loading_rule"]


class TieredScheduler(Scheduler):
    """A ``Scheduler`` over a ``TieredPrefixCache``; ``load_seconds(tokens)`` prices one admission's load."""

    def __init__(self, *args, load_seconds: Callable[[int], float] = lambda tokens: 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.prefix_cache, TieredPrefixCache):
            raise ValueError("prefix_cache must be a labkit.memory.tiered.TieredPrefixCache")
        if not callable(load_seconds):
            raise ValueError("load_seconds must be callable (tokens) -> seconds")
        self.load_seconds = load_seconds
        self.tier_stats = PrefixCacheStats()  # the tier's hits, apart from the pool's (vLLM's connector_prefix_cache_stats)

    def schedule(self) -> Step:
        self._loaded: list[int] = []
        step = super().schedule()
        step.stats.tier_hit_tokens = sum(self._loaded)
        step.stats.load_s = float(sum(self.load_seconds(n) for n in self._loaded))
        return step

    def _reserve(self, request: Request, tokens: int) -> None:
        admitting = request.status is RequestStatus.WAITING
        super()._reserve(request, tokens)
        if admitting and self.enable_prefix_caching:  # every admission, as vLLM records its connector's hits
            loads = self.prefix_cache.loads_in_step
            n = loads.pop()[1] if loads and loads[-1][0] is request.block_table else 0
            self.tier_stats.record(request.num_tokens, n, request.num_preemptions > 0)
            if n:
                self._loaded.append(n)


def worth_loading_rule(cost_model, bytes_per_token: float, tier: Tier) -> Callable[[int, int, int], bool]:
    """Chapter 08's rule as ``worth_loading(cached, external, prompt)``: load the ``external`` tokens found in
    the tier after ``cached`` pool tokens when moving them takes less time than the extra compute of making
    them again, in the step that computes the prompt's remaining tokens anyway (at least its last one)."""
    def worth_loading(cached: int, external: int, prompt: int) -> bool:
        extra = prefix_recompute_seconds(external, cost_model, max(1, prompt - cached - external), cached)
        return reload_seconds(external, bytes_per_token, tier) < extra
    return worth_loading


class TieredSimulator(Simulator):
    """chapter 06's ``Simulator`` whose pool spills evicted blocks to a ``tier`` of ``tier_blocks`` blocks;
    a later hit there is loaded (and its time added to the step) when chapter 08's rule says it pays."""

    def __init__(self, cost_model=None, *, tier: Tier, tier_blocks: int, **settings):
        if not isinstance(tier, Tier):
            raise ValueError(f"tier must be a labkit.serving.sim.tiers.Tier, got {type(tier).__name__}")
        self.tier, self.tier_blocks = tier, check_int("tier_blocks", tier_blocks, 1)
        if settings.get("allocation", "paged") != "paged":
            raise ValueError("allocation must be 'paged' with a second tier")
        super().__init__(cost_model, **settings)

    def new_scheduler(self) -> Scheduler:
        bytes_per_token = self.cost_model.model.shape.block_bytes(self.block_size) / self.block_size
        cache = TieredPrefixCache(BlockAllocator(self.num_blocks), self.block_size, TierStore(self.tier_blocks),
                                  worth_loading=worth_loading_rule(self.cost_model, bytes_per_token, self.tier),
                                  hash_fn=_fast_block_hash)
        return super().new_scheduler(cache, TieredScheduler,
                                     load_seconds=lambda n: reload_seconds(n, bytes_per_token, self.tier))
