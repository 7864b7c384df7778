"""A second tier behind the prefix cache, without tensors (``labkit.memory.tiered``) and in the scheduler and
the simulator (``labkit.serving.variants.tiered``)."""

from __future__ import annotations

import numpy as np
import pytest

from labkit.memory.paging import BlockAllocator
from labkit.memory.prefix import CacheKey, PrefixCache
from labkit.memory.tiered import TieredMatch, TieredPrefixCache, TierLoadError, TierStore
from labkit.serving.sim.costmodel import CostModel
from labkit.serving.sim.simulator import Simulator
from labkit.serving.sim.tiers import Tier
from labkit.serving.sim.workloads import long_document_questions
from labkit.serving.variants.tiered import TieredSimulator

BS = 4


def served(cache: PrefixCache, tokens: list[int]) -> int:
    """One request through ``cache`` as the scheduler serves it: admitted, computed, named, released."""
    hit = cache.match(tokens)
    start = hit.num_cached_tokens + hit.num_external_tokens
    table = cache.share(hit, tokens[:start], CacheKey())
    cache._append(table, tokens[start:])
    cache.cache_full_blocks(table)
    cache.release(table)
    return start


def tiered(num_blocks: int = 4, capacity: int = 100, **kwargs) -> TieredPrefixCache:
    return TieredPrefixCache(BlockAllocator(num_blocks), BS, TierStore(capacity), **kwargs)


A = list(range(1, 13))          # 3 full blocks
B = list(range(100, 113))       # 3 full blocks and one token


def test_an_evicted_block_is_found_in_the_tier_after_the_pool():
    cache = tiered()
    assert served(cache, A + [0]) == 0       # A's three blocks named, and a partial one
    assert served(cache, B) == 0             # B takes the pool: A's blocks are evicted into the tier
    assert cache.store.stats.puts == 3 and len(cache.store) == 3
    hit = cache.match(A + [7])
    assert isinstance(hit, TieredMatch) and hit.num_cached_tokens == 0 and hit.num_external_tokens == 12
    assert served(cache, A + [7]) == 12
    s = cache.store.stats
    assert (s.loaded_requests, s.loaded_tokens, s.loaded_blocks) == (1, 12, 3)
    assert served(cache, A + [8]) == 12 and cache.store.stats.loaded_requests == 1  # now a pool hit: no load


def test_the_pool_is_searched_first_and_the_tier_goes_on_from_it():
    cache = tiered(num_blocks=5)
    served(cache, A + [0])
    served(cache, A[:4] + B)                 # shares A's first block; evicts A's later blocks to the tier
    hit = cache.match(A + [7])
    assert hit.num_cached_tokens == 4 and hit.num_external_tokens == 8


def test_a_block_dropped_from_the_tier_is_no_longer_hit():
    cache = tiered(capacity=2)
    served(cache, A + [0])
    served(cache, B)                         # three puts into a tier of two: the first put, A's tail, goes
    assert cache.store.stats.evictions == 1 and len(cache.store) == 2
    assert cache.match(A + [7]).num_external_tokens == 8  # the pool evicts tail first, so the tier drops it first


def test_worth_loading_can_refuse_and_a_refused_copy_is_dropped():
    cache = tiered(worth_loading=lambda cached, external, total: False)
    served(cache, A + [0])
    served(cache, B)
    assert cache.match(A + [7]).num_external_tokens == 0 and served(cache, A + [7]) == 0

    class Damaged(TierStore):
        def fetch(self, entry):
            if entry.token_ids[0] == 5:      # A's second block
                raise TierLoadError("damaged")

    cache = TieredPrefixCache(BlockAllocator(4), BS, Damaged(100))
    served(cache, A + [0])
    served(cache, B)
    assert cache.match(A + [7]).num_external_tokens == 4      # the first block only
    assert cache.store.stats.refused == 1 and len(cache.store) == 2


def test_a_weak_hash_never_reuses_the_wrong_block():
    cache = TieredPrefixCache(BlockAllocator(4), BS, TierStore(100), hash_fn=lambda parent, tokens, key: 0)
    served(cache, A + [0])
    served(cache, B)
    other = [1, 2, 3, 4, 9, 9, 9, 9, 9, 10, 11, 12, 0]        # A's first block, then other tokens
    assert cache.match(other).num_external_tokens == 4


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="capacity"):
        TierStore(0)
    with pytest.raises(ValueError, match="store"):
        TieredPrefixCache(BlockAllocator(4), BS, None)
    with pytest.raises(ValueError, match="worth_loading"):
        TieredPrefixCache(BlockAllocator(4), BS, TierStore(3), worth_loading=3)
    with pytest.raises(ValueError, match="tier"):
        TieredSimulator(CostModel(), tier="fast", tier_blocks=3, num_blocks=40)
    with pytest.raises(ValueError, match="tier_blocks"):
        TieredSimulator(CostModel(), tier=Tier("t", 1e9, 0.0, source="test"), tier_blocks=0, num_blocks=40)


# ----------------------------------------------------------------------------- the simulator


def _workload():
    return long_document_questions(40, arrival_rate=8.0, document_len=512, num_documents=6, seed=3)


SETTINGS = dict(num_blocks=80, block_size=16, max_num_batched_tokens=256)


@pytest.mark.parametrize("skip_ahead", [True, False])
def test_the_tier_in_the_simulator(skip_ahead):
    specs = _workload()
    cm = CostModel("Llama-3-8B", "A100 80GB SXM")
    alone = Simulator(cm, skip_ahead=skip_ahead, **SETTINGS).run(specs)
    fast = TieredSimulator(cm, tier=Tier("fast", 1e12, 0.0, source="test"), tier_blocks=10_000,
                           skip_ahead=skip_ahead, **SETTINGS).run(specs)
    slow = TieredSimulator(cm, tier=Tier("slow", 1e6, 1e-3, source="test"), tier_blocks=10_000,
                           skip_ahead=skip_ahead, **SETTINGS).run(specs)
    store = fast.scheduler.prefix_cache.store.stats
    assert store.puts > 0 and store.loaded_tokens > 0
    assert slow.scheduler.prefix_cache.store.stats.loaded_tokens == 0          # never worth it: recomputed
    assert np.array_equal(slow.ttft, alone.ttft) and np.array_equal(slow.step_end, alone.step_end)
    assert fast.ttft.mean() < alone.ttft.mean()
    # The pool's counters hold the pool's hits only, the tier's its own; a request's first hit holds both.
    pool, tier = fast.scheduler.prefix_cache.stats, fast.scheduler.tier_stats
    assert fast.hit_tokens.sum() == pool.hits + tier.hits and tier.hits > 0 and pool.queries == tier.queries
    assert tier.hits + tier.preempted_hits == store.loaded_tokens


def test_skip_ahead_changes_nothing_with_a_tier():
    specs = _workload()
    tier = Tier("fast", 1e11, 1e-5, source="test")
    a, b = (TieredSimulator(CostModel(), tier=tier, tier_blocks=10_000, skip_ahead=s, **SETTINGS).run(specs)
            for s in (True, False))
    assert np.array_equal(a.ttft, b.ttft) and np.array_equal(a.hit_tokens, b.hit_tokens)


def test_a_cluster_of_tiered_replicas_counts_each_tier_apart():
    from labkit.serving.cluster.cluster import simulate

    specs = _workload()
    tier = Tier("fast", 1e12, 0.0, source="test")
    plain = simulate(specs, 2, "round_robin", cost_model=CostModel(), **SETTINGS)
    tiered = simulate(specs, 2, "round_robin", cost_model=CostModel(), simulator=TieredSimulator, tier=tier,
                      tier_blocks=10_000, **SETTINGS)
    assert list(plain.tier_hits) == [0, 0] and tiered.tier_hits.sum() > 0
    assert tiered.hits.sum() + tiered.tier_hits.sum() == tiered.hit_tokens.sum()
    with pytest.raises(ValueError, match="simulator"):
        simulate(specs, 2, simulator=dict, **SETTINGS)
