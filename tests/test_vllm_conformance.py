"""labkit's block pool, prefix cache and scheduler against vLLM v1's own test scenarios.

Each test re-expresses, in labkit's API, a scenario of vLLM's ``tests/v1/core/test_prefix_caching.py``
or ``tests/v1/core/test_scheduler.py`` (vllm-project/vllm, read at commit 003df29; sources of
vLLM 0.33.0) and names the test it mirrors. vLLM reserves block 0 as its "null block", so its
block ids start at 1; labkit has none, so every id below is vLLM's minus one. vLLM's
``KVCacheManager.allocate_slots`` is labkit's ``PrefixCache.allocate`` / ``append`` followed by
``cache_full_blocks`` (vLLM's ``cache_blocks``), which is what ``Scheduler`` does when it reserves a chunk.
Where labkit differs on purpose, the test says so.
"""

from __future__ import annotations

import pytest

from labkit.memory.paging import BlockAllocator, OutOfBlocksError
from labkit.memory.prefix import CacheKey, PrefixCache, hash_chain
from labkit.serving.request import Request, RequestStatus
from labkit.serving.scheduler import Scheduler

COMMON = [i for i in range(3) for _ in range(16)]  # three full blocks of 16, as in vLLM's tests


def evictable(cache: PrefixCache) -> list[int]:
    """Named blocks no sequence holds, in the order the allocator would evict them (front of the free queue first)."""
    return [b for b in cache.allocator.free_block_ids() if b in cache.allocator.names]


def cache_of(num_blocks: int, block_size: int = 16) -> PrefixCache:
    return PrefixCache(BlockAllocator(num_blocks), block_size)


def allocate_slots(cache: PrefixCache, tokens: list[int], key: CacheKey = CacheKey()):
    """vLLM's get_computed_blocks + allocate_slots for a new request: allocate, then name full blocks."""
    table, hit = cache.allocate(tokens, key)
    cache.cache_full_blocks(table)
    return table, hit


def free_queue(cache: PrefixCache) -> list[int]:
    return list(cache.allocator.free_block_ids())


# ----------------------------------------------------------------------------- test_prefix_caching.py


def test_prefill():
    """test_prefix_caching.py::test_prefill: hits while in use and while free, the free queue's
    order (unnamed partial blocks first, named ones last, tail first), and eviction in that order."""
    cache = cache_of(10)
    t0, hit = allocate_slots(cache, COMMON + [3] * 7)
    assert hit == 0 and t0.block_ids == [0, 1, 2, 3]
    chain = hash_chain(COMMON + [3] * 7, 16)
    assert [cache.allocator.names.get(b).block_hash for b in (0, 1, 2)] == chain
    assert cache.allocator.names.get(3) is None and cache.allocator.ref_counts[:4] == [1, 1, 1, 1]

    t1, hit = allocate_slots(cache, COMMON + [3] * 5)  # hit while the blocks are in use
    assert hit == 48 and t1.block_ids == [0, 1, 2, 4]
    assert cache.allocator.ref_counts[:3] == [2, 2, 2] and cache.allocator.num_free == 5
    cache.release(t0)
    cache.release(t1)
    assert free_queue(cache) == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]

    t2, hit = allocate_slots(cache, COMMON + [3] * 6)  # hit on free named blocks
    assert hit == 48 and t2.block_ids == [0, 1, 2, 4]  # the partial block 4 is reused first
    assert cache.allocator.num_free == 6
    cache.release(t2)

    t3, hit = allocate_slots(cache, [99] * 160)  # a miss that needs the whole pool: the eviction order
    assert hit == 0 and t3.block_ids == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]
    assert cache.allocator.num_free == 0


def test_same_step_admissions_share_blocks_named_at_allocation():
    """test_prefix_caching.py::test_prefill, "cache hit in the common prefix when the original block
    is still in use": req1 hits right after req0's allocate_slots, before any forward pass. So two
    identical prompts admitted in the same step share the prefix (vLLM names full blocks when it
    allocates them: KVCacheManager.allocate_slots -> cache_blocks)."""
    sched = Scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    a = sched.add_request(list(range(1, 10)), 2)
    b = sched.add_request(list(range(1, 10)), 2)
    step = sched.schedule()
    assert [(c.request, c.num_cached_tokens, c.num_tokens) for c in step.chunks] == [(a, 0, 9), (b, 8, 1)]
    assert step.chunks[1].block_table[:2] == step.chunks[0].block_table[:2]
    assert sched.allocator.num_used == 3 + 1


def test_decode():
    """test_prefix_caching.py::test_decode: decode tokens fill the tail without a new block; a block
    gets its name as soon as its last token is scheduled, the new tail has none."""
    cache = cache_of(10)
    table, _ = allocate_slots(cache, COMMON + [3] * 7)
    assert table.block_ids == [0, 1, 2, 3]
    assert cache.append(table, [8] * 4) == [] and table.block_ids == [0, 1, 2, 3]
    cache.cache_full_blocks(table)
    assert cache.allocator.names.get(table.block_ids[-1]) is None
    cache.append(table, [7] * (9 + 10))
    cache.cache_full_blocks(table)
    assert len(table.block_ids) == 5
    names = cache.allocator.names
    assert table.block_ids[-2] in names and table.block_ids[-1] not in names


def test_evict():
    """test_prefix_caching.py::test_evict: after a request ends its partial block goes to the front
    of the free queue and its named blocks to the back, tail first; a hit revives them."""
    cache = cache_of(10)
    t0, _ = allocate_slots(cache, list(range(5 * 16 + 7)))
    assert len(t0.block_ids) == 6
    t1, _ = allocate_slots(cache, list(range(87, 87 + 3 * 16)))
    assert len(t1.block_ids) == 3 and cache.allocator.num_free == 1
    cache.release(t0)
    assert free_queue(cache) == [5, 9, 4, 3, 2, 1, 0]
    cache.release(t1)
    assert free_queue(cache) == [5, 9, 4, 3, 2, 1, 0, 8, 7, 6]
    t2, hit = allocate_slots(cache, list(range(2 * 16 + 3)))
    assert hit == 32 and t2.block_ids == [0, 1, 5] and cache.allocator.num_free == 7


def test_hash_block_correct_reuse():
    """test_prefix_caching.py::test_hash_block_correct_reuse: a named block handed out again for
    other tokens loses its name."""
    cache = cache_of(1)
    table, _ = allocate_slots(cache, list(range(16)))
    assert table.block_ids[0] in cache.allocator.names
    cache.release(table)
    table, hit = allocate_slots(cache, list(range(15)))
    assert hit == 0 and table.block_ids[0] not in cache.allocator.names and cache.allocator.num_evictions == 1


def test_computed_blocks_not_evicted():
    """test_prefix_caching.py::test_computed_blocks_not_evicted: a request's own hit is taken before
    its fresh blocks, so the fresh blocks evict another cached block, not the hit."""
    cache = cache_of(2)
    t0, _ = allocate_slots(cache, list(range(16)))
    t1, _ = allocate_slots(cache, list(range(16, 32)))
    assert (t0.block_ids, t1.block_ids) == ([0], [1])
    cache.release(t0)
    cache.release(t1)
    t2, hit = allocate_slots(cache, list(range(32)))
    assert hit == 16 and t2.block_ids == [0, 1]


def test_basic_prefix_caching_disabled():
    """test_prefix_caching.py::test_basic_prefix_caching_disabled: without caching nothing is found,
    and a pool that is full refuses the next request."""
    cache = cache_of(4, block_size=4)
    t1, hit = cache.allocate(list(range(10)), lookup=False)
    assert hit == 0 and len(t1.block_ids) == 3
    cache.release(t1)
    t2, hit = cache.allocate(list(range(16)), lookup=False)
    assert hit == 0 and len(t2.block_ids) == 4 and cache.num_cached_blocks == 0
    with pytest.raises(OutOfBlocksError):
        cache.allocate(list(range(4)), lookup=False)
    # the same through the scheduler: caching off never hits, even on a prompt it has just served
    sched = Scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    for _ in range(2):
        sched.add_request(list(range(10)), 1)
    assert [c.num_cached_tokens for c in sched.schedule().chunks] == [0, 0]
    assert sched.prefix_cache.num_cached_blocks == 0


def test_prefill_not_enough_free_blocks_with_computed_blocks():
    """test_prefix_caching.py::test_prefill_not_enough_free_blocks_with_computed_blocks: when the
    fresh blocks do not fit, the hit blocks are not touched (reference counts, free queue)."""
    cache = cache_of(10)
    t0, _ = allocate_slots(cache, COMMON)
    t1, hit = allocate_slots(cache, COMMON * 2)
    assert hit == 48 and t1.block_ids[:3] == t0.block_ids
    part1 = list(t1.block_ids)
    cache.release(t1)
    assert [cache.allocator.ref_counts[b] for b in part1] == [1, 1, 1, 0, 0, 0]
    allocate_slots(cache, [7] * 32)
    assert cache.allocator.num_free == 5
    assert cache.match(COMMON * 3).block_ids == tuple(part1)
    before = (list(cache.allocator.ref_counts), free_queue(cache), repr(cache.stats))
    with pytest.raises(OutOfBlocksError):
        cache.allocate(COMMON * 3)  # 6 blocks hit (3 of them free), 3 fresh: 6 free blocks needed, 5 free
    assert (list(cache.allocator.ref_counts), free_queue(cache), repr(cache.stats)) == before


def test_reset_prefix_cache():
    """test_prefix_caching.py::test_reset_prefix_cache: while any block is in use the reset is refused
    (False, nothing changed), as vLLM's ``BlockPool.reset_prefix_cache``; after every request ended,
    clearing drops every name, and no later prompt hits."""
    cache = cache_of(10)
    t0, _ = allocate_slots(cache, COMMON + [3] * 7)
    t1, hit = allocate_slots(cache, COMMON + [4] * 7)
    assert hit == 48 and t1.block_ids[3] == 4
    assert cache.clear() is False and cache.num_cached_blocks == 3  # in use: refused
    cache.release(t0)
    assert cache.clear() is False and cache.num_cached_blocks == 3  # t1 still holds blocks
    cache.release(t1)
    assert cache.clear() is True and cache.num_cached_blocks == 0 and cache.allocator.num_evictions == 0
    assert cache.match(COMMON + [3]).num_cached_tokens == 0


def test_cache_key_salting():
    """test_prefix_caching.py::test_cache_key_salting: equal tokens under another salt never hit;
    the same salt does. (labkit puts the salt in every block's key, vLLM in the first block's
    extra keys; through the parent hash both separate the whole chain.)"""
    cache = cache_of(11)
    allocate_slots(cache, COMMON + [3] * 11, CacheKey(salt="salt1"))
    assert cache.match(COMMON + [4] * 11, CacheKey(salt="salt1")).num_cached_tokens == 48
    assert cache.match(COMMON + [4] * 11, CacheKey(salt="salt2")).num_cached_tokens == 0
    assert hash_chain(COMMON, 16, CacheKey(salt="salt1"))[0] != hash_chain(COMMON, 16, CacheKey(salt="salt2"))[0]


def test_prefill_plp_duplicate_blocks_keep_their_names():
    """test_prefix_caching.py::test_prefill_plp: a request that does not look up the cache computes
    duplicates of cached blocks; they get the same hashes under other block ids, and both stay named
    (block tables are append-only). A later hit takes the oldest twin."""
    cache = cache_of(10)
    t0, _ = allocate_slots(cache, COMMON + [3] * 7)
    t2, hit = cache.allocate(COMMON + [3] * 6, lookup=False)
    cache.cache_full_blocks(t2)
    assert hit == 0 and t2.block_ids[:3] != t0.block_ids[:3]
    assert t2.block_hashes == t0.block_hashes
    assert cache.num_cached_blocks == 6 and cache.allocator.ref_counts[t2.block_ids[0]] == 1
    assert cache.match(COMMON + [5]).block_ids == tuple(t0.block_ids[:3])


def test_maybe_evict_cached_block():
    """test_prefix_caching.py::test_maybe_evict_cached_block: two blocks under one hash; evicting one
    leaves the other findable, evicting both forgets the hash."""
    cache = cache_of(4, block_size=4)
    first, _ = allocate_slots(cache, [1, 2, 3, 4, 0])
    twin, _ = cache.allocate([1, 2, 3, 4, 0], lookup=False)
    cache.cache_full_blocks(twin)
    oldest, newer = first.block_ids[0], twin.block_ids[0]
    cache.release(first)
    cache.release(twin)
    assert cache.match([1, 2, 3, 4, 9]).block_ids == (oldest,)
    assert set(evictable(cache)) == {oldest, newer}
    a = cache.allocator
    taken = a.allocate_many(a.num_free - 1)  # every unnamed free block, then one of the twins: evicted
    assert a.num_evictions == 1 and len({oldest, newer} & set(taken)) == 1
    assert cache.match([1, 2, 3, 4, 9]).num_cached_tokens == 4  # the other twin
    taken.append(a.allocate())
    assert cache.match([1, 2, 3, 4, 9]).num_cached_tokens == 0 and cache.num_cached_blocks == 0


# ----------------------------------------------------------------------------- test_scheduler.py


def test_add_requests_and_finish_request():
    """test_scheduler.py::test_add_requests, test_finish_request and test_get_num_unfinished_requests:
    queued requests are known by id; finishing (aborting) a waiting request takes it off the queue."""
    sched = Scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=256)
    requests = [Request([i] * 10, 4, request_id=str(i)) for i in range(10)]
    for i, r in enumerate(requests):
        sched.add_request(r)
        assert r.request_id in sched.requests and len(sched.waiting) == i + 1
    for i, r in enumerate(requests):
        sched.finish(r)
        assert r.request_id not in sched.requests and len(sched.waiting) == 9 - i
        assert r.status is RequestStatus.FINISHED
    assert not sched.has_unfinished()


def test_schedule():
    """test_scheduler.py::test_schedule: with enough budget every waiting request is scheduled with
    its whole prompt in the first step, and moves to running in order."""
    for caching in (False, True):
        sched = Scheduler(num_blocks=100, block_size=16, max_num_batched_tokens=8192,
                          enable_prefix_caching=caching)
        requests = [sched.add_request(list(range(i, i + 10)), 4) for i in range(10)]
        step = sched.schedule()
        assert [(c.request, c.num_tokens) for c in step.chunks] == [(r, 10) for r in requests]
        assert not sched.waiting and sched.running == requests


def test_schedule_order_and_max_num_seqs():
    """test_scheduler.py::test_schedule_order (chunked prefill on, max_num_seqs=3): two 800-token
    requests take the 1,024-token budget, the second one chunked. And max_num_seqs caps admission."""
    sched = Scheduler(num_blocks=200, block_size=16, max_num_batched_tokens=1024, max_num_seqs=3)
    long = [sched.add_request([k] * 800, 4) for k in (1, 2)]
    for k in (3, 4):
        sched.add_request([k] * 10, 4)
    step = sched.schedule()
    assert [(c.request, c.num_tokens) for c in step.chunks] == [(long[0], 800), (long[1], 224)]
    capped = Scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=1024, max_num_seqs=3)
    for k in range(5):
        capped.add_request([k] * 10, 4)
    assert len(capped.schedule().chunks) == 3 and len(capped.running) == 3 and len(capped.waiting) == 2


def test_preempt_back_to_waiting():
    """test_scheduler.py::test_preempt_during_execution: two 80-token requests fill a 10-block pool;
    when the first needs a new block, the newest running request is preempted: its blocks go back and
    it returns to the front of the waiting queue, to be recomputed."""
    sched = Scheduler(num_blocks=10, block_size=16, max_num_batched_tokens=200, enable_prefix_caching=False)
    r0 = sched.add_request([1] * 80, 4)
    r1 = sched.add_request([2] * 80, 4)
    step = sched.schedule()
    assert [len(c.block_table) for c in step.chunks] == [5, 5] and sched.allocator.num_free == 0
    sched.postprocess(step, [0, 0])
    step = sched.schedule()
    assert step.preempted == [r1] and r1.status is RequestStatus.WAITING and list(sched.waiting) == [r1]
    assert r1.block_table is None and r1.num_computed_tokens == 0 and r1.num_preemptions == 1
    assert sched.running == [r0] and [c.request for c in step.chunks] == [r0]


def test_stop_via_eos():
    """test_scheduler.py::test_stop_via_update_from_output (stop token): a request ends on its EOS
    token, which is part of its output; its blocks go back."""
    sched = Scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    r = sched.add_request([1, 2, 3], 10, eos_token_id=7)
    sched.postprocess(sched.schedule(), [5])
    finished = sched.postprocess(sched.schedule(), [7])
    assert finished == [r] and r.output_token_ids == [5, 7] and sched.allocator.num_used == 0


def test_engine_stays_token_identical_when_same_step_requests_share():
    """The engine side of naming at allocation: the second prompt reads K/V that the same forward
    pass writes (write_kv stores every chunk's K/V of a layer before any chunk attends), so its
    tokens equal greedy decoding without any cache."""
    from labkit.caches.contiguous import generate
    from labkit.model.decoder import Decoder, DecoderConfig
    from labkit.serving.engine import Engine

    cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Decoder.random(cfg, seed=3)
    engine = Engine(model, num_blocks=16, block_size=4, max_num_batched_tokens=64, use_triton=False)
    prompt = [5, 9, 2, 7, 1, 3, 8, 4, 6]
    outputs = engine.generate([prompt, prompt], max_new_tokens=4, eos_token_id=())
    assert engine.stats[0].prefix_hit_tokens == 8
    assert outputs == [generate(model, prompt, 4, use_cache=False).tokens] * 2
