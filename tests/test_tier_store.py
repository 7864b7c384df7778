"""A second tier with real K/V (``labkit.caches.tier_store``) behind a real engine
(``labkit.serving.tiered_engine``): a prefix evicted from the pool comes back from the tier, and the greedy
tokens are those of the engine without a tier and of generating each prompt alone; a damaged copy is refused
and recomputed, never read into attention."""

from __future__ import annotations

import errno
import os
import random

import pytest
import torch

import labkit  # first: sets up Triton's interpreter without a GPU
from labkit.caches.block_files import BlockFileError
from labkit.caches.contiguous import generate
from labkit.caches.paged import KVPool
from labkit.caches.tier_store import DiskTierStore, MemoryTierStore
from labkit.memory.prefix import CacheKey, CachedBlock
from labkit.model.decoder import Decoder, DecoderConfig
from labkit.serving.engine import Engine
from labkit.serving.tiered_engine import TieredEngine

CONFIG = DecoderConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
BS, NEW = 4, 4
rng = random.Random(0)
PREFIX = [rng.randrange(97) for _ in range(12)]         # 3 full blocks, shared
PROMPTS = [PREFIX + [rng.randrange(97) for _ in range(3)] for _ in range(3)]
FILLERS = [[rng.randrange(97) for _ in range(20)] for _ in range(2)]  # each takes the whole pool: evicts the prefix


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder.random(CONFIG, seed=3).to(labkit.DEVICE)


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    return [generate(model, p, NEW).tokens for p in PROMPTS]


def poisoned(engine: Engine) -> Engine:
    for cache in engine.backend.k_caches + engine.backend.v_caches:
        cache.fill_(float("nan"))  # a slot read before it is written (or loaded) shows up
    return engine


def serve(engine: Engine, between=None) -> list[list[int]]:
    """Each prompt alone, the filler between them, so the shared prefix leaves the pool each time."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        if i:
            engine.generate([FILLERS[i - 1]], NEW)
            if between is not None:
                between(engine)
        out += engine.generate([prompt], NEW)
    return out


def tiered(model, tmp_path=None, capacity: int = 16, **kw) -> TieredEngine:
    return poisoned(TieredEngine(model, num_blocks=6, block_size=BS, max_num_batched_tokens=64, tier_blocks=capacity,
                                 tier_dir=tmp_path, prepare=False, **kw))


def test_the_prefix_comes_back_from_disk_with_the_same_tokens(model, reference, tmp_path):
    plain = poisoned(Engine(model, num_blocks=6, block_size=BS, max_num_batched_tokens=64, prepare=False))
    assert serve(plain) == reference
    assert plain.scheduler.prefix_cache.stats.hits == 0  # the filler evicted the prefix every time
    engine = tiered(model, tmp_path)
    assert serve(engine) == reference
    store = engine.tier
    assert isinstance(store, DiskTierStore) and store.stats.loaded_blocks == 6 and store.stats.refused == 0
    assert store.stats.loaded_tokens == 24 == sum(s.tier_hit_tokens for s in engine.stats)
    assert engine.scheduler.prefix_cache.stats.hits == 0 and engine.scheduler.tier_stats.hits == 24  # apart
    assert sum(s.prefix_hit_tokens for s in engine.stats) == 0
    assert sum(s.load_s for s in engine.stats) > 0 and store.bytes_read >= 6 * engine.backend.bytes_per_block
    assert store.bytes_written > 0 and len(list(tmp_path.glob("*.kvblock"))) == len(store)
    assert engine.scheduler.allocator.num_free == 6


def test_host_memory_gives_the_same_tokens(model, reference):
    engine = tiered(model)
    assert serve(engine) == reference
    assert isinstance(engine.tier, MemoryTierStore) and engine.tier.stats.loaded_blocks == 6


@pytest.mark.parametrize("how", ["cut short", "a flipped byte", "missing"])
def test_a_damaged_file_is_refused_and_the_block_recomputed(model, reference, tmp_path, how):
    def damage(engine):
        if damage.done:
            return
        damage.done = True
        first = min(engine.tier.entries.values(), key=lambda e: e.entry_id)  # the prefix's first block
        path = engine.tier.path(first)
        data = bytearray(path.read_bytes())
        if how == "cut short":
            path.write_bytes(bytes(data[:-5]))
        elif how == "a flipped byte":
            data[-10] ^= 0xFF
            path.write_bytes(bytes(data))
        else:
            path.unlink()
    damage.done = False
    engine = tiered(model, tmp_path)
    assert serve(engine, damage) == reference
    stats = engine.tier.stats
    assert stats.refused == 1
    # the second prompt recomputed the whole prefix (its chain starts at the refused block); the third loads
    # the recomputed copy
    assert stats.loaded_requests == 1 and stats.loaded_blocks == 3


def test_the_refusal_names_the_file(model, tmp_path):
    engine = tiered(model, tmp_path)
    engine.generate([PROMPTS[0]], NEW)
    engine.generate([FILLERS[0]], NEW)
    entry = next(iter(engine.tier.entries.values()))
    engine.tier.path(entry).write_bytes(b"junk")
    with pytest.raises(BlockFileError, match=f"{entry.entry_id}.kvblock.*not a block file"):
        engine.tier.fetch(entry)


def test_a_block_evicted_from_the_tier_is_no_longer_hit(model, reference, tmp_path):
    """The pool frees a table's blocks tail first (as vLLM does, so tails are evicted first): the tier takes the
    prefix's third block, then its second and first; with room for two it drops the third, and a hit stops there."""
    engine = tiered(model, tmp_path, capacity=2)
    assert serve(engine) == reference
    stats = engine.tier.stats
    assert stats.evictions > 0 and len(engine.tier) == 2
    assert (stats.loaded_requests, stats.loaded_blocks) == (2, 4)  # two blocks each time, never the third
    assert len(list(tmp_path.glob("*.kvblock"))) == 2  # dropped blocks leave no file


def test_direct_io_reads_the_same_bytes(model, reference, tmp_path):
    """With whatever this file system takes: O_DIRECT, else dropping the cached pages (fadvise)."""
    try:
        engine = tiered(model, tmp_path, direct_io=True)
    except ValueError as err:
        pytest.skip(f"this file system takes neither O_DIRECT nor posix_fadvise: {err}")
    assert engine.tier.read_mode in ("direct", "fadvise")
    assert serve(engine) == reference and engine.tier.stats.loaded_blocks == 6


def test_o_direct_reads_the_bytes_a_cached_read_reads(tmp_path):
    pool = random_pool()
    entry = CachedBlock(0, "h0", None, (1, 2, 3, 4), CacheKey(), 7, None)
    try:
        direct = DiskTierStore(pool, tmp_path / "direct", 2, direct_io=True)
    except ValueError as err:
        pytest.skip(f"this file system takes neither O_DIRECT nor posix_fadvise: {err}")
    if direct.read_mode != "direct":
        pytest.skip("this file system refuses O_DIRECT (tmpfs, some overlayfs); the fallback is tested below")
    cached = DiskTierStore(pool, tmp_path / "cached", 2)
    for store in (direct, cached):
        store.put(0, entry)
    assert direct._read(direct.path(entry)) == cached._read(cached.path(entry))
    assert all(torch.equal(a, b) for a, b in zip(direct.fetch(entry), cached.fetch(entry)))


# ---- a file system without O_DIRECT (tmpfs, overlayfs) and a system without posix_fadvise, simulated


def random_pool() -> KVPool:
    pool = KVPool(CONFIG, num_blocks=3, block_size=BS, use_triton=False)
    for c in pool.k_caches + pool.v_caches:
        c.copy_(torch.randn(c.shape))
    return pool


def recorded_fadvise(monkeypatch) -> list[int]:
    """``os.posix_fadvise`` replaced by a recorder (present whether or not this system has one)."""
    calls = []
    monkeypatch.setattr(os, "POSIX_FADV_DONTNEED", getattr(os, "POSIX_FADV_DONTNEED", 4), raising=False)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: calls.append(advice), raising=False)
    return calls


def refuse_o_direct(monkeypatch, at: str) -> None:
    """O_DIRECT refused with EINVAL, as tmpfs refuses it at the open (``at="open"``) and some file systems only at
    the first read (``at="read"``); an ``O_DIRECT`` constant is made up where this system has none."""
    monkeypatch.setattr(os, "O_DIRECT", getattr(os, "O_DIRECT", 0o40000), raising=False)
    real_open, direct = os.open, os.O_DIRECT

    def open_(path, flags, *args, **kwargs):
        if flags & direct:
            if at == "open":
                raise OSError(errno.EINVAL, "Invalid argument", str(path))
            flags &= ~direct
        return real_open(path, flags, *args, **kwargs)

    def readv(fd, buffers):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "open", open_)
    if at == "read":
        monkeypatch.setattr(os, "readv", readv)


def test_without_o_direct_the_tier_drops_cached_pages_before_each_read(model, reference, tmp_path, monkeypatch):
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    calls = recorded_fadvise(monkeypatch)
    engine = tiered(model, tmp_path, direct_io=True)
    assert engine.tier.read_mode == "fadvise"
    calls.clear()  # the probe's
    assert serve(engine) == reference and engine.tier.stats.loaded_blocks == 6
    # one after each write (its pages flushed, then dropped), one before each read
    assert calls == [os.POSIX_FADV_DONTNEED] * (engine.tier.stats.puts + engine.tier.stats.loaded_blocks)
    assert not list(tmp_path.glob(".direct_io_probe"))


@pytest.mark.parametrize("at", ["open", "read"])
def test_a_file_system_that_refuses_o_direct_falls_back_to_fadvise(tmp_path, monkeypatch, at):
    refuse_o_direct(monkeypatch, at)
    calls = recorded_fadvise(monkeypatch)
    pool = random_pool()
    store = DiskTierStore(pool, tmp_path, 2, direct_io=True)
    assert store.read_mode == "fadvise" and not list(tmp_path.iterdir())  # the probe file removed
    entry = CachedBlock(0, "h0", None, (1, 2, 3, 4), CacheKey(), 7, None)
    store.put(0, entry)
    calls.clear()
    parts = store.fetch(entry)
    assert calls == [os.POSIX_FADV_DONTNEED]
    store.load(parts, 2)
    assert all(torch.equal(c[2], c[0]) for c in pool.k_caches + pool.v_caches)


def test_without_o_direct_or_fadvise_direct_io_is_refused_and_cached_reads_work(model, reference, tmp_path,
                                                                                monkeypatch):
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    with pytest.raises(ValueError, match="direct_io=True needs O_DIRECT or posix_fadvise"):
        DiskTierStore(random_pool(), tmp_path / "tier", 2, direct_io=True)
    assert not (tmp_path / "tier").exists()  # refused: no folder left behind
    with pytest.raises(ValueError, match="direct_io"):
        tiered(model, tmp_path / "tier", direct_io=True)
    engine = tiered(model, tmp_path / "tier")
    assert engine.tier.read_mode == "cached"
    assert serve(engine) == reference and engine.tier.stats.loaded_blocks == 6


def test_a_store_round_trip_leaves_the_pool_alone_until_loaded(tmp_path):
    pool = KVPool(CONFIG, num_blocks=3, block_size=BS, use_triton=False)
    for c in pool.k_caches + pool.v_caches:
        c.copy_(torch.randn(c.shape))
    entry = CachedBlock(0, "h0", None, (1, 2, 3, 4), CacheKey(), 7, None)
    for store in (DiskTierStore(pool, tmp_path, 2), MemoryTierStore(pool, 2)):
        store.put(0, entry)
        before = [c.clone() for c in pool.k_caches + pool.v_caches]
        payload = store.fetch(entry)
        assert all(torch.equal(a, b) for a, b in zip(before, pool.k_caches + pool.v_caches))
        store.load(payload, 2)
        assert all(torch.equal(c[2], c[0]) for c in pool.k_caches + pool.v_caches)
        store.discard(entry)
    assert not list(tmp_path.glob("*.kvblock"))


def test_bad_inputs_name_themselves(model, tmp_path):
    pool = KVPool(CONFIG, num_blocks=3, block_size=BS, use_triton=False)
    for make, name in [(lambda: DiskTierStore(None, tmp_path, 2), "pool"),
                       (lambda: MemoryTierStore("pool", 2), "pool"),
                       (lambda: DiskTierStore(pool, 3, 2), "directory"),
                       (lambda: DiskTierStore(pool, tmp_path / "f" / "x", 2), "directory"),
                       (lambda: DiskTierStore(pool, tmp_path, 0), "capacity"),
                       (lambda: MemoryTierStore(pool, 1.5), "capacity"),
                       (lambda: DiskTierStore(pool, tmp_path, 2, direct_io="yes"), "direct_io"),
                       (lambda: TieredEngine(model, 6, BS, tier_blocks=0), "tier_blocks"),
                       (lambda: TieredEngine(model, 6, BS, tier_blocks=2, tier_dir=5), "tier_dir"),
                       (lambda: TieredEngine(model, 6, BS, tier_blocks=2, direct_io=True), "direct_io"),
                       (lambda: TieredEngine(model, 6, BS, tier_blocks=2, worth_loading=3), "worth_loading"),
                       (lambda: TieredEngine(model, 6, BS, tier_blocks=2, enable_prefix_caching=False),
                        "enable_prefix_caching")]:
        (tmp_path / "f").write_text("a file, not a folder")
        with pytest.raises(ValueError, match=name):
            make()


@pytest.mark.parametrize("seed", [1, 2, 3])  # 1 and 3 preempt (1 reloads after it), 2 chunks
def test_batched_chunked_and_preempted_requests_keep_their_tokens(model, tmp_path, seed):
    """Waves of requests sharing prefixes, several at once in a small pool with a small budget: chunked prompts,
    preemptions, evictions into a small tier and loads out of it change no token."""
    r = random.Random(seed)
    prefixes = [[r.randrange(97) for _ in range(r.randrange(4, 20))] for _ in range(3)]
    nb, budget = r.randrange(8, 14), r.choice([4, 8, 64])
    engine = poisoned(TieredEngine(model, nb, BS, budget, tier_blocks=r.randrange(4, 20), tier_dir=tmp_path,
                                   prepare=False))
    for _ in range(4):
        wave = [r.choice(prefixes) + [r.randrange(97) for _ in range(r.randrange(1, 6))] for _ in range(3)]
        assert engine.generate(wave, 5) == [generate(model, p, 5).tokens for p in wave]
    assert engine.tier.stats.loaded_blocks > 0 and engine.scheduler.allocator.num_free == nb
