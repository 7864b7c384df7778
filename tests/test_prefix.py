"""Tests for labkit.memory.prefix: hash chain, matching, sharing, copy-on-write, eviction.

The property tests model the K/V pool as a dict slot -> content, where the content of
a token's slot is (computation key, the whole token prefix up to and including it):
exactly what K/V depend on. If the cache ever reused a block computed after another
prefix or under another key, or let an append overwrite a block someone else holds,
reading a table's slots back would show it.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from labkit.memory.paging import BlockAllocator, BlockTable, OutOfBlocksError
from labkit.memory.prefix import CachedBlockTable, CacheKey, PrefixCache, PrefixCacheStats, block_hash, hash_chain


def reference_chain(tokens, block_size, key):
    """A plain re-statement of the hash chain, written independently of labkit."""
    out, parent = [], None
    fields = [key.model, key.adapter, key.cache_dtype, key.cache_layout, key.rope_theta, key.rope_scaling,
              key.attention, key.salt]
    for i in range(len(tokens) // block_size):
        blob = json.dumps([parent, list(tokens[i * block_size:(i + 1) * block_size]), fields], separators=(",", ":"))
        parent = hashlib.sha256(blob.encode()).hexdigest()
        out.append(parent)
    return out


def evictable(cache: PrefixCache) -> list[int]:
    """Named blocks no sequence holds, in the order the allocator would evict them (front of the free queue first)."""
    return [b for b in cache.allocator.free_block_ids() if b in cache.allocator.names]


def snapshot(cache: PrefixCache):
    a = cache.allocator
    return (list(a.ref_counts), list(a._free), {h: dict(b) for h, b in cache.index._blocks.items()}, dict(a.names),
            repr(cache.stats), a.num_evictions)


# ------------------------------------------------------------------------------------------ hashes
def test_hash_chain_matches_reference_and_is_stable():
    key = CacheKey(adapter="legal-lora", salt="tenant-7")
    tokens = [5, 1, 9, 2, 2, 8, 0, 3, 4, 4]
    assert hash_chain(tokens, 4, key) == reference_chain(tokens, 4, key)
    assert len(hash_chain(tokens, 4, key)) == 2  # the partial third block has no name
    assert hash_chain(tokens, 4, key) == hash_chain(list(tokens), 4, CacheKey(adapter="legal-lora", salt="tenant-7"))


def test_a_known_chain_is_extended_and_not_hashed_again():
    """``block_hashes``: the chain of a shorter run of the same tokens is kept; only the blocks after it are
    hashed, and the result is the chain hashed from scratch. ``match`` takes it too, and finds the same hit."""
    hashed = []

    def counting(parent, tokens, key):
        hashed.append(tuple(tokens))
        return block_hash(parent, tokens, key)

    tokens = list(range(1, 19))  # 4 full blocks of 4 and a partial fifth
    first = hash_chain(tokens[:9], 4, CacheKey(), counting)
    assert len(hashed) == 2
    grown = hash_chain(tokens, 4, CacheKey(), counting, first)
    assert grown == hash_chain(tokens, 4) and hashed[2:] == [tuple(tokens[8:12]), tuple(tokens[12:16])]
    assert hash_chain(tokens, 4, CacheKey(), counting, grown) == grown and len(hashed) == 4
    cache = make()
    table, _ = cache.allocate(tokens[:12])
    cache.cache_full_blocks(table, 12)
    assert cache.match(tokens, CacheKey(), grown) == cache.match(tokens) != cache.match(tokens[:5])
    assert cache.match(tokens, CacheKey(), first).num_cached_tokens == 12


def test_hash_depends_on_parent_tokens_and_every_key_field():
    tokens = [1, 2, 3, 4]
    base = block_hash(None, tokens, CacheKey())
    assert block_hash("0" * 64, tokens, CacheKey()) != base
    assert block_hash(None, [1, 2, 3, 5], CacheKey()) != base
    for change in (dict(model="other"), dict(adapter="a"), dict(cache_dtype="bfloat16"), dict(cache_layout="HND"),
                   dict(rope_theta=500000.0), dict(rope_scaling="yarn"), dict(attention="sliding-4096"),
                   dict(salt="s")):
        assert block_hash(None, tokens, CacheKey(**change)) != base, change


def test_same_block_after_different_prefix_has_different_name():
    a = hash_chain([7, 7, 1, 2, 3, 4], 2)
    b = hash_chain([9, 9, 1, 2, 3, 4], 2)
    assert all(x != y for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------ match
def make(num_blocks=16, block_size=4, **kw):
    return PrefixCache(BlockAllocator(num_blocks), block_size, **kw)


def prefill(cache, tokens, key=CacheKey()):
    table, hit = cache.allocate(tokens, key)
    cache.cache_full_blocks(table)
    return table, hit


def test_match_is_capped_so_one_token_is_computed_and_has_no_side_effects():
    cache = make()
    t, _ = prefill(cache, list(range(8)))  # exactly two blocks
    before = snapshot(cache)
    m = cache.match(list(range(8)))
    assert m.num_cached_tokens == 4 and m.block_ids == (t.block_ids[0],)
    assert cache.match(list(range(9))).num_cached_tokens == 8
    assert cache.match(list(range(3))).num_cached_tokens == 0
    assert snapshot(cache) == before


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_hits_are_the_longest_cached_run_of_full_blocks(block_size):
    import random
    rng = random.Random(block_size)
    cache = make(num_blocks=64, block_size=block_size)
    shared = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
    first = shared + [rng.randrange(50) for _ in range(5)]
    prefill(cache, first)
    second = shared + [99, 98, 97]
    _, hit = cache.allocate(second)
    common = len(shared)  # first and second agree exactly on `shared` (99 never appears in first)
    assert hit == min(common // block_size, (len(second) - 1) // block_size) * block_size


def test_reuse_refused_for_other_prefix_key_and_short_prefixes():
    cache = make(num_blocks=64, block_size=4)
    report = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    prefill(cache, report + [7])
    assert cache.allocate(report + [8])[1] == 12
    assert cache.allocate([0] + report + [8])[1] == 0            # same text after another prefix
    assert cache.allocate(report + [8], CacheKey(adapter="x"))[1] == 0
    assert cache.allocate(report + [8], CacheKey(cache_dtype="bfloat16"))[1] == 0
    short = make(block_size=16)
    prefill(short, report + [7])                                  # 13 tokens < one block: nothing named
    assert short.num_cached_blocks == 0 and short.allocate(report + [8])[1] == 0


def test_weak_hash_collisions_never_cause_wrong_reuse():
    collide = lambda parent, tokens, key: "same"  # noqa: E731  every block gets the same name
    cache = make(block_size=2, hash_fn=collide)
    prefill(cache, [1, 2, 3, 4, 5])                   # both blocks are named "same"
    assert cache.num_cached_blocks == 2
    assert cache.allocate([1, 2, 9])[1] == 2          # the verified one of the two is found...
    assert cache.allocate([3, 4, 1, 2, 0])[1] == 0    # ...and [3, 4] is never reused as a first block
    prefill(cache, [7, 8, 1])
    assert cache.allocate([7, 8, 9])[1] == 2          # verified: reused
    assert cache.allocate([7, 8, 9], CacheKey(adapter="a"))[1] == 0


# ------------------------------------------------------------------------------------- allocation
def test_allocate_shares_in_use_blocks_and_revives_free_cached_ones():
    cache = make(num_blocks=8, block_size=4)
    a = cache.allocator
    t1, _ = prefill(cache, list(range(10)))
    t2, hit = cache.allocate(list(range(10)))
    assert hit == 8 and t2.block_ids[:2] == t1.block_ids[:2] and t2.block_ids[2] != t1.block_ids[2]
    assert [a.ref_counts[b] for b in t1.block_ids] == [2, 2, 1]
    cache.release(t1)
    cache.release(t2)
    assert a.num_free == 8 and cache.num_cached_blocks == 2  # finished, still cached
    t3, hit = cache.allocate(list(range(9)))
    assert hit == 8 and [a.ref_counts[b] for b in t3.block_ids] == [1, 1, 1]
    assert cache.stats == PrefixCacheStats()  # allocate counts nothing: whoever admits a request records it


def test_stats_count_each_admission_once_and_preempted_ones_apart():
    """vLLM's PrefixCacheStats: requests, queries (every token the request knows) and hits at the first
    admission; a request admitted again after a preemption goes to the preempted_* counters."""
    stats = PrefixCacheStats()
    stats.record(40, 16)
    stats.record(40, 0)
    stats.record(45, 32, preempted=True)   # re-finding its own blocks is no hit
    assert (stats.requests, stats.queries, stats.hits) == (2, 80, 16) and stats.hit_rate == 0.2
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 45, 32)
    assert PrefixCacheStats().hit_rate == 0.0


def test_hit_extra_blocks_predicts_what_allocate_takes():
    cache = make(num_blocks=12, block_size=4)
    t, _ = prefill(cache, list(range(12)))
    cache.release(t)
    other, _ = prefill(cache, [50] * 6)
    for prompt in ([*range(12), 1], list(range(5)), [50] * 9, [60] * 3, list(range(4))):
        hit = cache.match(prompt)
        predicted = cache.hit_extra_blocks(hit, len(prompt) - hit.num_cached_tokens)
        free = cache.allocator.num_free
        table, _ = cache.allocate(prompt)
        assert free - cache.allocator.num_free == predicted, prompt
        cache.release(table)


def test_eviction_is_least_recently_used_and_counted():
    cache = make(num_blocks=4, block_size=2)
    a_table, _ = prefill(cache, [1, 1, 1])   # block A1 cached
    b_table, _ = prefill(cache, [2, 2, 2])   # block B1 cached
    a_block, b_block = a_table.block_ids[0], b_table.block_ids[0]
    cache.release(a_table)                   # A freed first: least recently used
    cache.release(b_table)
    assert evictable(cache) == [a_block, b_block]
    cache.allocate([3, 3, 3, 3, 3])          # 3 fresh blocks: the 2 uncached free ones first, then A
    assert a_block not in cache.allocator.names and b_block in cache.allocator.names
    assert cache.allocator.num_evictions == 1
    assert cache.match([1, 1, 1]).num_cached_tokens == 0 and cache.match([2, 2, 2]).num_cached_tokens == 2


def test_eviction_and_clear_only_touch_unreferenced_blocks():
    cache = make(num_blocks=8, block_size=2)
    keep, _ = prefill(cache, [1, 2, 3])
    gone, _ = prefill(cache, [4, 5, 6, 7, 8])
    first, second = gone.block_ids[:2]
    cache.release(gone)                                  # tail first: [6, 7] is freed before [4, 5]
    assert evictable(cache) == [second, first]
    a = cache.allocator
    taken = a.allocate_many(a.num_free - 1)              # every unnamed free block, then the oldest named one
    assert second in taken and first not in taken and a.num_evictions == 1
    a.free_blocks(taken)
    assert cache.match([4, 5, 6, 7, 0]).num_cached_tokens == 2
    names, free = dict(a.names), evictable(cache)
    assert cache.clear() is False and a.names == names and evictable(cache) == free  # a block in use: refused
    assert keep.block_ids[0] in a.names
    assert cache.match([1, 2, 0]).num_cached_tokens == 2
    cache.release(keep)
    assert cache.clear() is True and cache.num_cached_blocks == 0
    assert cache.allocator.num_free == 8 and a.num_evictions == 1  # clearing is not evicting


def test_clear_after_a_weight_update_never_serves_old_blocks():
    """Issue 38's repro: three requests hold their blocks, the cache is cleared (the weights changed),
    then the same prompt arrives. Clearing must be refused while blocks are held (vLLM's
    ``reset_prefix_cache``), and once it succeeds nothing of the old K/V is found again."""
    from labkit.serving.scheduler import Scheduler
    sched = Scheduler(num_blocks=32, block_size=4)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks, 12 tokens a later request could hit
    for _ in range(3):
        sched.add_request(prompt, 4)
    step = sched.schedule()
    sched.postprocess(step, [7] * len(step.sampling_chunks))
    cache = sched.prefix_cache
    names = dict(cache.allocator.names)
    assert len(names) == 3 and cache.allocator.num_used > 0
    assert cache.clear() is False and cache.allocator.names == names  # refused, all state unchanged
    for r in list(sched.running):
        sched.finish(r)
    assert cache.clear() is True and not cache.allocator.names
    again = sched.add_request(prompt, 4)
    sched.schedule()
    assert again.num_cached_tokens == 0  # the old K/V is not reused


def test_copy_on_write_of_a_shared_tail():
    cache = make(num_blocks=8, block_size=4)
    parent, _ = prefill(cache, [1, 2, 3, 4, 5, 6])       # tail block half full
    child = cache.fork(parent)
    tail = parent.block_ids[-1]
    assert cache.extra_blocks(child, 1) == 1
    copies = cache.append(child, [7])
    assert copies == [(tail, child.block_ids[-1])] and child.block_ids[-1] != tail
    assert parent.block_ids[-1] == tail and cache.allocator.ref_counts[tail] == 1
    assert child.slots(6, 7) == [child.block_ids[-1] * 4 + 2]
    again = cache.append(child, [8, 9])                   # private now: no second copy
    assert again == [] and len(child.block_ids) == 3
    assert cache.append(parent, [7]) == []                # parent holds its tail alone


def test_out_of_blocks_changes_nothing():
    cache = make(num_blocks=3, block_size=2)
    t, _ = prefill(cache, [1, 2, 3])
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError):
        cache.allocate([1, 2, 5, 6, 7, 8, 9])
    assert snapshot(cache) == before
    child = cache.fork(t)
    cache.append(child, [4])                              # uses the last free block (copy-on-write)
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError):
        cache.append(t, [4, 5])                           # fills the tail, then needs one more block
    assert snapshot(cache) == before and t.num_tokens == 3 and t.token_ids == [1, 2, 3]


@pytest.mark.parametrize("call, param", [
    (lambda c, t, other: c.allocate("abc"), "token_ids"),
    (lambda c, t, other: c.allocate([1, -2]), "token_ids"),
    (lambda c, t, other: c.allocate([1, 2.0]), "token_ids"),
    (lambda c, t, other: c.allocate([True]), "token_ids"),
    (lambda c, t, other: c.allocate([]), "token_ids"),
    (lambda c, t, other: c.allocate([1], key="lora"), "key"),
    (lambda c, t, other: c.match([1], key=None), "key"),
    (lambda c, t, other: c.match((1, 2, -3)), "token_ids"),
    (lambda c, t, other: c.share(c.match([1, 2, 3, 4, 9]), [1, 2], CacheKey()), "hit"),
    (lambda c, t, other: c.hit_extra_blocks("hit", 2), "hit"),
    (lambda c, t, other: c.append(t, [3, -1]), "token_ids"),
    (lambda c, t, other: c.append(BlockTable(4), [1]), "table"),
    (lambda c, t, other: c.append(other["small_blocks"], [1]), "table.*another PrefixCache"),
    (lambda c, t, other: c.release(other["other_cache"]), "table"),
    (lambda c, t, other: c.fork(other["other_cache"]), "table"),
    (lambda c, t, other: c.cache_full_blocks(t, t.num_tokens + 1), "num_computed_tokens"),
    (lambda c, t, other: c.extra_blocks(t, -3), "num_new_tokens"),
])
def test_bad_input_raises_value_error_and_changes_nothing(call, param):
    cache = make(num_blocks=8, block_size=4)
    table, _ = prefill(cache, [1, 2, 3, 4, 5])
    other = {"small_blocks": PrefixCache(BlockAllocator(2), 2).allocate([9])[0],
             "other_cache": make().allocate([1])[0]}
    before = snapshot(cache), list(table.block_ids), list(table.token_ids)
    with pytest.raises(ValueError, match=param):
        call(cache, table, other)
    assert (snapshot(cache), list(table.block_ids), list(table.token_ids)) == before


def test_constructor_checks():
    with pytest.raises(ValueError, match="allocator"):
        PrefixCache(object(), 4)
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(BlockAllocator(2), 0)
    with pytest.raises(ValueError, match="rope_theta"):
        CacheKey(rope_theta=-1.0)
    for bad in (float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="rope_theta must be a finite number > 0"):
            CacheKey(rope_theta=bad)
    with pytest.raises(ValueError, match="adapter"):
        CacheKey(adapter=3)


def test_article_figure_two_sequences_sharing_half():
    """§04: two 8,192-token sequences sharing 4,096 tokens hold 768 blocks of 16 = 1.5 GiB."""
    bytes_per_token = 2 * 32 * 8 * 128 * 2
    cache = make(num_blocks=1024, block_size=16)
    report = list(range(4096))
    a, _ = prefill(cache, report + [10_000 + i for i in range(4096)])
    b, hit = cache.allocate(report + [20_000 + i for i in range(4096)])
    assert hit == 4096
    held = cache.allocator.num_used
    assert held == 768 and held * 16 * bytes_per_token == 3 * 2 ** 29   # 1.5 GiB
    assert len(set(a.block_ids) & set(b.block_ids)) == 256               # 0.5 GiB shared


# ----------------------------------------------------------------------------- property tests
VOCAB = st.integers(0, 2)
def test_cache_key_normalises_numbers_so_equal_keys_hash_equal():
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    as_int, as_float = CacheKey(rope_theta=500000), CacheKey(rope_theta=500000.0)
    assert as_int == as_float and hash(as_int) == hash(as_float)
    assert type(as_int.rope_theta) is float
    assert block_hash(None, tokens, as_int) == block_hash(None, tokens, as_float)
    assert hash_chain(tokens, 4, as_int) == hash_chain(tokens, 4, as_float)
    assert block_hash(None, tokens, CacheKey(rope_theta=10000)) == block_hash(None, tokens, CacheKey())
    assert block_hash(None, tokens, as_int) != block_hash(None, tokens, CacheKey())  # a different value still differs


KEYS = [CacheKey(), CacheKey(adapter="lora-1")]


class PrefixMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / name / finish / evict / clear against a pool model."""

    hash_fn = staticmethod(block_hash)

    @initialize(num_blocks=st.integers(2, 10), block_size=st.integers(1, 3))
    def setup(self, num_blocks, block_size):
        self.cache = PrefixCache(BlockAllocator(num_blocks), block_size, hash_fn=self.hash_fn)
        self.tables: list[CachedBlockTable] = []
        self.pool: dict[int, tuple] = {}  # slot -> (key, prefix tuple): what the K/V there encode

    def _write(self, table, start):
        for p in range(start, table.num_tokens):
            self.pool[table.slot(p)] = (table.key, tuple(table.token_ids[:p + 1]))

    @rule(tokens=st.lists(VOCAB, min_size=1, max_size=9), key_idx=st.integers(0, 1), commit=st.booleans())
    def allocate(self, tokens, key_idx, commit):
        before = snapshot(self.cache)
        hit = self.cache.match(tokens, KEYS[key_idx])
        predicted = self.cache.hit_extra_blocks(hit, len(tokens) - hit.num_cached_tokens)
        free = self.cache.allocator.num_free
        try:
            table, hit = self.cache.allocate(tokens, KEYS[key_idx])
        except OutOfBlocksError:
            assert predicted > free and snapshot(self.cache) == before
            return
        assert free - self.cache.allocator.num_free == predicted
        self._write(table, hit)  # compute only the uncached suffix
        if commit:
            self.cache.cache_full_blocks(table)
        self.tables.append(table)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), tokens=st.lists(VOCAB, min_size=0, max_size=5))
    def append(self, data, tokens):
        self.append_to(data.draw(st.sampled_from(self.tables)), tokens)

    def append_to(self, table, tokens):
        others = {id(t): [self.pool.get(t.slot(p)) for p in range(t.num_tokens)] for t in self.tables if t is not table}
        before = snapshot(self.cache), list(table.block_ids)
        try:
            copies = self.cache.append(table, tokens)
        except OutOfBlocksError:
            assert (snapshot(self.cache), list(table.block_ids)) == before
            return
        bs = self.cache.block_size
        for src, dst in copies:  # copy-on-write: the caller copies the K/V
            for off in range(bs):
                if src * bs + off in self.pool:
                    self.pool[dst * bs + off] = self.pool[src * bs + off]
        self._write(table, table.num_tokens - len(tokens))
        self.cache.cache_full_blocks(table)
        for t in self.tables:  # what every other sequence reads (shared blocks included) is untouched
            if t is not table:
                assert [self.pool.get(t.slot(p)) for p in range(t.num_tokens)] == others[id(t)]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        self.tables.append(self.cache.fork(data.draw(st.sampled_from(self.tables))))

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), a=st.lists(VOCAB, min_size=1, max_size=3), b=st.lists(VOCAB, min_size=1, max_size=3))
    def fork_and_diverge(self, data, a, b):
        """Parallel sampling: two sharers append different tokens into their shared tail."""
        parent = data.draw(st.sampled_from(self.tables))
        self.tables.append(self.cache.fork(parent))
        self.append_to(self.tables[-1], a)
        self.append_to(parent, b)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def finish(self, data):
        table = data.draw(st.sampled_from(self.tables))
        self.tables.remove(table)
        self.cache.release(table)

    @rule(n=st.integers(0, 3))
    def evict(self, n):
        """Take n free blocks and give them back: the allocator evicts what it hands out (the one eviction path)."""
        a = self.cache.allocator
        a.free_blocks(a.allocate_many(min(n, a.num_free)))

    @rule()
    def clear(self):
        self.cache.clear()

    @invariant()
    def ref_counts_equal_holders(self):
        a = self.cache.allocator
        for b in range(a.num_blocks):
            holders = sum(t.block_ids.count(b) for t in self.tables)
            assert a.ref_counts[b] == holders
            assert a.is_free(b) == (holders == 0)
        assert a.num_free + a.num_used == a.num_blocks

    @invariant()
    def every_table_reads_its_own_prefix(self):
        for t in self.tables:
            assert len(t.block_ids) == -(-t.num_tokens // self.cache.block_size)
            for p in range(t.num_tokens):
                assert self.pool.get(t.slot(p)) == (t.key, tuple(t.token_ids[:p + 1]))

    @invariant()
    def cached_blocks_hold_what_their_entry_names(self):
        bs = self.cache.block_size
        for b, entry in self.cache.allocator.names.items():
            key, prefix = self.pool[b * bs + bs - 1]
            assert key == entry.key and prefix[-bs:] == entry.token_ids

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for t in self.tables:
            self.cache.release(t)
        self.cache.clear()
        a = self.cache.allocator
        assert a.num_free == a.num_blocks and all(r == 0 for r in a.ref_counts)
        assert self.cache.num_cached_blocks == 0


class WeakHashMachine(PrefixMachine):
    """The same, with a hash that collides all the time: verification must still prevent wrong reuse."""

    hash_fn = staticmethod(lambda parent, tokens, key: str(sum(tokens) % 2))


_settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = _settings
TestWeakHashMachine = WeakHashMachine.TestCase
TestWeakHashMachine.settings = _settings


# ------------------------------------------------------------------------- with real tensors
def test_prefix_kv_cache_reuse_gives_the_same_tokens_and_logits():
    import torch

    from labkit.caches.contiguous import generate
    from labkit.caches.prefix_cached import PrefixCachedPool, generate_with_prefix_cache
    from labkit.model.decoder import Decoder, DecoderConfig

    cfg = DecoderConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    model = Decoder.random(cfg, seed=3)
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 97, (13,), generator=gen).tolist()   # ragged: not a multiple of the block size
    prompts = [shared + torch.randint(0, 97, (n,), generator=gen).tolist() for n in (1, 4, 7)]
    on = PrefixCachedPool(cfg, num_blocks=32, block_size=4, reuse=True)
    off = PrefixCachedPool(cfg, num_blocks=32, block_size=4, reuse=False)
    for i, prompt in enumerate(prompts):
        a = generate_with_prefix_cache(model, on, prompt, 2)
        b = generate_with_prefix_cache(model, off, prompt, 2)
        ref = generate(model, prompt, 2)
        assert a.num_cached_tokens == (0 if i == 0 else 12) and b.num_cached_tokens == 0
        assert a.num_prefill_tokens == len(prompt) - a.num_cached_tokens and a.num_decode_steps == 1
        assert a.tokens == b.tokens == ref.tokens
        torch.testing.assert_close(a.logits.double(), ref.logits.double(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)
    assert off.prefix.num_cached_blocks == 0 and off.prefix.allocator.num_free == 32
    assert on.prefix.allocator.num_free == 32 and on.prefix.num_cached_blocks > 0  # released, still cached


def test_generate_with_prefix_cache_rejects_out_of_vocab_ids_and_changes_nothing():
    import copy

    import torch

    from labkit.caches.prefix_cached import PrefixCachedPool, generate_with_prefix_cache
    from labkit.model.decoder import Decoder, DecoderConfig

    cfg = DecoderConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    model = Decoder.random(cfg, seed=1)
    kv = PrefixCachedPool(cfg, num_blocks=8, block_size=4)
    shared = list(range(10, 19))
    generate_with_prefix_cache(model, kv, shared, 2)  # two full blocks now cached

    def state():
        p = kv.prefix
        return (copy.deepcopy(p.stats), {h: dict(b) for h, b in p.index._blocks.items()},  # noqa: SLF001
                sorted(p.allocator.names), list(p.allocator.ref_counts),
                list(p.allocator._free), kv.table, kv.seq_len, [c.clone() for c in kv.k_caches])  # noqa: SLF001

    before = state()
    # The bad id sits after the cached prefix: a lookup would hit before the model ever saw it.
    for bad in (50, 10**6):
        with pytest.raises(ValueError, match=r"prompt_ids must hold token ids in \[0, 49\] .*found " + str(bad)):
            generate_with_prefix_cache(model, kv, shared + [3, bad], 2)
        after = state()
        assert after[:-1] == before[:-1]
        assert all(torch.equal(a, b) for a, b in zip(after[-1], before[-1]))
    assert generate_with_prefix_cache(model, kv, shared + [3, 49], 1).num_cached_tokens == 8  # 49 is fine


def test_prefix_kv_cache_checks_its_use():
    from labkit.caches.prefix_cached import PrefixCachedPool
    from labkit.model.decoder import DecoderConfig

    cfg = DecoderConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    kv = PrefixCachedPool(cfg, num_blocks=4, block_size=2)
    with pytest.raises(ValueError, match="begin"):
        kv.extend([1])
    kv.begin([1, 2, 3])
    with pytest.raises(ValueError, match="end"):
        kv.begin([1])
    kv.end()
    assert kv.prefix.allocator.num_free == 4
    assert kv.key().cache_dtype == "float32" and kv.key(adapter="x").adapter == "x"


# ------------------------------------------------------------------------------- the widget
def test_story_is_consistent_and_shows_every_event():
    from labkit.teaching.widgets.prefix_stepper import story

    snaps = story()
    for s in snaps:
        for b, ref in enumerate(s.ref_counts):
            assert ref == sum(ids.count(b) for _, ids, _ in s.tables)
    kinds = {"copies": [i for i, s in enumerate(snaps) if s.copies],
             "evicted": [i for i, s in enumerate(snaps) if s.evicted],
             "shared": [i for i, s in enumerate(snaps) if max(s.ref_counts) > 1]}
    assert all(kinds.values()), kinds
    idle = [s for s in snaps if not s.tables and sum(s.cached)]
    assert idle, "some step should show cached blocks with no sequence holding them"


def test_stepper_widget_and_static_figure():
    import matplotlib

    matplotlib.use("Agg")
    from labkit.teaching.widgets.prefix_stepper import PrefixStepper, static_figure, story

    w = PrefixStepper()
    first = w.caption.value
    w.slider.value = 4
    assert w.caption.value != first and "copy" in w.caption.value
    fig = static_figure(story(), [1, 2, 3])
    assert len([ax for ax in fig.axes if ax.patches]) == 3


# -- issue 11: bugs at the edges ------------------------------------------------------------------

def test_a_cached_table_cannot_take_blocks_behind_the_caches_back():
    """BlockTable.append(n, allocator) would hand out a cached free block without dropping its
    name, so match() would still offer a block that is being overwritten."""
    cache = PrefixCache(BlockAllocator(2), block_size=4)
    t, _ = cache.allocate([1, 2, 3, 4, 5])
    cache.cache_full_blocks(t)
    cache.release(t)  # block of [1, 2, 3, 4] is free but still named
    other, _ = cache.allocate([9])
    try:
        other.append(4, cache.allocator)  # one more block: the named one is next in the free queue
    except (ValueError, TypeError, AttributeError):
        pass
    # whatever happened, the cache never offers a block someone is writing over
    m = cache.match([1, 2, 3, 4, 5])
    assert all(cache.allocator.ref_counts[b] == 0 for b in m.block_ids)


def test_two_models_never_share_kv_through_one_prefix_pool():
    """The pool's blocks are named with the model that computed them: a second model must not reuse
    the first model's K/V (and must produce exactly what it produces without a cache)."""
    import torch

    from labkit.caches.contiguous import generate
    from labkit.caches.prefix_cached import PrefixCachedPool, generate_with_prefix_cache
    from labkit.model.decoder import Decoder, DecoderConfig

    cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    first, second = Decoder.random(cfg, seed=0), Decoder.random(cfg, seed=1)
    kv = PrefixCachedPool(cfg, num_blocks=32, block_size=4)
    prompt = list(range(1, 19))
    generate_with_prefix_cache(first, kv, prompt, 3)
    out = generate_with_prefix_cache(second, kv, prompt, 3)
    plain = generate(second, prompt, 3)
    assert out.num_cached_tokens == 0
    assert out.tokens == plain.tokens
    assert torch.allclose(out.logits, plain.logits, atol=1e-4)
    assert generate_with_prefix_cache(second, kv, prompt, 3).num_cached_tokens == 16  # its own blocks do hit


def test_stepper_says_what_an_evicted_block_held():
    """Issue 22: blocks 1 and 4 are evicted at step 7 and again at step 9. The ids are the same
    because the free queue hands them out again; the contents differ, and the stepper says so."""
    from labkit.teaching.widgets.prefix_stepper import caption_text, story

    snaps = story()
    c_arrives, d_arrives = snaps[7], snaps[9]
    assert c_arrives.evicted == d_arrives.evicted == (1, 4)
    assert c_arrives.evicted_held == ("tokens 5-8 of the report", "tokens 9-12 of A'")
    assert d_arrives.evicted_held == ("tokens 25-28 of C", "tokens 21-24 of C")
    assert d_arrives.stats.hits - snaps[8].stats.hits == 4  # only the report's first block survived
    assert "block 1, which held tokens 5-8 of the report" in caption_text(c_arrives)
    assert all(len(s.evicted_held) == len(s.evicted) for s in snaps)
