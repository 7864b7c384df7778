"""The prefix cache: share the K/V blocks of a common prompt prefix (chapter 04).

The K/V of a prompt's first tokens depend only on those tokens (causal attention) and on
the computation, so requests that start alike (a system prompt, one long report asked
several questions) can point their block tables at the same blocks. Only *full* blocks are
cached, each named by a hash chain ``hash_i = H(hash_{i-1}, token ids of block i, extra
keys)``: the parent makes the name depend on the whole prefix, the extra keys (``CacheKey``)
on everything else that changes the numbers. A hit is verified against the stored tokens,
key and parent, so a hash collision can cause a miss, never a wrong reuse.

As in vLLM v1, a full block is named as soon as its tokens are scheduled, identical twins
included, and a freed block keeps its name in the free queue until the allocator hands it
out again (an eviction, least recently used first). ``fork`` shares a table's blocks
(parallel sampling); the first writer into a shared, partly filled tail gets a private copy.

Typical use, with K/V written by the caller::

    cache = PrefixCache(BlockAllocator(64), block_size=16)
    table, num_cached = cache.allocate(prompt_ids, key)  # K/V needed for prompt_ids[num_cached:]
    cache.cache_full_blocks(table)                        # reusable from now on
    copies = cache.append(table, [next_id])               # decode: one more slot (copy a shared tail first)
    cache.release(table)                                  # finished: named blocks stay cached
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import astuple, dataclass
from typing import Callable, Sequence

from ..checks import check_flag, check_int, check_token_ids
from .blocks import _extra_blocks
from .paging import BlockAllocator, BlockTable, OutOfBlocksError, tail_is_shared

__all__ = ["CacheKey", "block_hash", "hash_chain", "PrefixMatch", "PrefixCacheStats", "CachedBlock",
           "CachedBlockTable", "BlockHashIndex", "PrefixCache"]


@dataclass(frozen=True)
class CacheKey:
    """Everything besides the token ids that changes a block's K/V ("extra keys"): blocks are shared
    only when all are equal. The weights (``model``) and ``adapter``; how the K/V are stored
    (``cache_dtype``, ``cache_layout``); the position encoding (``rope_theta``, ``rope_scaling``);
    the ``attention`` rule (a sliding window changes every later layer's input); and a ``salt``
    that keeps tenants apart even for equal prompts (reuse can leak timing between users).
    """

    model: str = "teaching-model"
    adapter: str | None = None
    cache_dtype: str = "float16"
    cache_layout: str = "NHD"
    rope_theta: float = 10000.0
    rope_scaling: str | None = None
    attention: str = "causal"
    salt: str | None = None

    def __post_init__(self) -> None:
        for name in ("model", "cache_dtype", "cache_layout", "attention"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("adapter", "rope_scaling", "salt"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string or None, got {getattr(self, name)!r}")
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 0):
            raise ValueError(f"rope_theta must be a finite number > 0, got {theta!r}")
        object.__setattr__(self, "rope_theta", float(theta))  # 10000 and 10000.0: one name


HashFn = Callable[["str | None", "tuple[int, ...]", CacheKey], str]


def block_hash(parent_hash: str | None, token_ids: Sequence[int], key: CacheKey) -> str:
    """The name of one full block: SHA-256 of (parent hash, token ids, extra keys), as hex.

    The encoding is canonical JSON (no whitespace, fields in a fixed order), so the
    same block gets the same name in every process, unlike Python's salted ``hash``.
    ``parent_hash`` is ``None`` for a sequence's first block.
    """
    if parent_hash is not None and not isinstance(parent_hash, str):
        raise ValueError(f"parent_hash must be None (a first block) or a block hash (str), got {parent_hash!r}")
    check_token_ids("token_ids", token_ids, 1)
    _check_key(key)
    payload = json.dumps([parent_hash, [int(t) for t in token_ids], list(astuple(key))],
                         separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def hash_chain(token_ids: Sequence[int], block_size: int, key: CacheKey = CacheKey(),
               hash_fn: HashFn = block_hash, block_hashes: Sequence[str] = ()) -> list[str]:
    """The hash of every *full* block of ``token_ids``; a partial last block has no name.

    ``block_hashes``: the chain already worked out for the same tokens, or for a shorter run of them (a
    request's, before its latest tokens: a request only grows); only the blocks after it are hashed. vLLM
    keeps each request's chain so, extended as tokens arrive (``Request.block_hashes``, ``vllm/v1/request.py``).
    That it is this chain is the caller's word: only its length is checked.
    """
    check_int("block_size", block_size, 1)
    tokens = check_token_ids("token_ids", token_ids)
    _check_key(key)
    if not callable(hash_fn):
        raise ValueError("hash_fn must be callable (parent_hash, token_ids, key) -> block hash")
    if not isinstance(block_hashes, (list, tuple)) or len(block_hashes) > len(tokens) // block_size:
        raise ValueError(f"block_hashes must be a list of at most {len(tokens) // block_size} block hashes (the chain "
                         f"of the first full blocks of these tokens), got {block_hashes!r:.80}")
    hashes = list(block_hashes)
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        parent = hash_fn(parent, tokens[start:start + block_size], key)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class PrefixMatch:
    """The leading full blocks of a prompt that the cache holds (``block_ids``, one per reused
    logical block), and the prompt's whole hash chain (``block_hashes``, hit or not)."""

    block_ids: tuple[int, ...]
    num_cached_tokens: int
    block_hashes: tuple[str, ...]
    entry_ids: tuple[int, ...] = ()
    num_external_tokens: int = 0  # found beyond the pool, after its hits (a second tier; vLLM's connector)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.block_ids)


@dataclass
class PrefixCacheStats:
    """Counters since the cache was made, as vLLM keeps them (``vllm/v1/metrics/stats.py``,
    ``PrefixCacheStats``): each admitted request is recorded once, its *query* being all the
    tokens it knows and its *hits* those found in the cache. A request admitted again after a
    preemption goes to the ``preempted_*`` counters, so re-finding its own blocks is no hit.
    (Evictions are counted by the allocator: ``allocator.num_evictions``.)"""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of queried tokens (first admissions) found in the cache; 0.0 before any request."""
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hits: int, preempted: bool = False) -> None:
        """One admission of a request that knows ``num_tokens`` tokens, ``num_hits`` of them found."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass(frozen=True)
class CachedBlock:
    """The name of one full block whose K/V are in the pool (``allocator.names[block_id]``).

    ``entry_id`` identifies its *content* (tokens, key and whole prefix): identical blocks share
    it. Checking ``parent_entry`` on a hit verifies the whole prefix, whatever the hash function.
    """

    block_id: int
    block_hash: str
    parent_hash: str | None
    token_ids: tuple[int, ...]
    key: CacheKey
    entry_id: int
    parent_entry: int | None


class CachedBlockTable(BlockTable):
    """A ``BlockTable`` that remembers its ``token_ids`` and ``key``, and the hashes and content ids
    of its leading named blocks. Made by ``PrefixCache.allocate`` or ``fork``; grown by its ``append``."""

    def __init__(self, owner: "PrefixCache", key: CacheKey, block_ids: Sequence[int], token_ids: Sequence[int],
                 block_hashes: Sequence[str] = (), entry_ids: Sequence[int] = ()):
        super().__init__(owner.block_size)
        self.owner, self.key, self.block_ids, self.num_tokens = owner, key, list(block_ids), len(token_ids)
        self.token_ids, self.block_hashes, self.entry_ids = list(token_ids), list(block_hashes), list(entry_ids)

    @property
    def num_named_blocks(self) -> int:
        return len(self.block_hashes)

    def append(self, n: int, allocator: BlockAllocator) -> list[int]:
        raise ValueError("a CachedBlockTable grows with PrefixCache.append(table, token_ids), "
                         "which records the tokens and copies a shared tail first")


class BlockHashIndex:
    """Block hash -> the named blocks that carry it, oldest first (vLLM's ``BlockHashToBlockMap``).

    Identical twins share a hash (two requests computed the same block in one step), so a hash
    maps to several blocks. ``lookup`` verifies tokens, extra keys and parent, so a hash
    collision can cause a miss, never a wrong reuse.
    """

    def __init__(self, names: dict[int, CachedBlock]):
        self.names = names  # block id -> its name: the allocator's, the one truth
        self._blocks: dict[str, dict[int, None]] = {}

    def add(self, entry: CachedBlock) -> None:
        self.names[entry.block_id] = entry
        self._blocks.setdefault(entry.block_hash, {})[entry.block_id] = None

    def remove(self, block_id: int, entry: CachedBlock) -> None:
        """``block_id`` lost its name (the allocator calls this on an eviction)."""
        twins = self._blocks[entry.block_hash]
        del twins[block_id]
        if not twins:
            del self._blocks[entry.block_hash]

    def lookup(self, h: str, tokens: Sequence[int], key: CacheKey, parent_entry: int | None) -> CachedBlock | None:
        """The oldest block named ``h`` that really is this block after this parent, else ``None``."""
        for block_id in self._blocks.get(h, ()):
            entry = self.names[block_id]
            if entry.parent_entry == parent_entry and entry.token_ids == tuple(tokens) and entry.key == key:
                return entry
        return None


class PrefixCache:
    """Hash-named full blocks, shared by reference count and evicted least recently used.

    The names live on the ``allocator`` (``allocator.names``), indexed by hash in ``index``. A block
    loses its name only when the allocator hands it out again (an eviction) or on ``clear``. As in
    vLLM v1, identical twins are named too, so a block table only grows at its end. ``hash_fn``:
    ``block_hash`` by default; tests pass a weak one to show that collisions cannot cause wrong reuse.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, *, hash_fn: HashFn = block_hash):
        if not isinstance(allocator, BlockAllocator):
            raise ValueError(f"allocator must be a labkit.memory.paging.BlockAllocator, got {type(allocator).__name__}")
        check_int("block_size", block_size, 1)
        if not callable(hash_fn):
            raise ValueError("hash_fn must be callable (parent_hash, token_ids, key) -> str")
        if allocator.on_evict is not None or allocator.names:
            raise ValueError("allocator must not serve another prefix cache already")
        self.allocator, self.block_size, self.hash_fn = allocator, block_size, hash_fn
        self.stats = PrefixCacheStats()  # recorded by whoever admits a request (the scheduler, as vLLM's)
        self.index = BlockHashIndex(allocator.names)
        self._entry_ids = itertools.count()
        allocator.on_evict = self.index.remove

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose K/V carry a name (in use or free)."""
        return len(self.allocator.names)

    def match(self, token_ids: Sequence[int], key: CacheKey = CacheKey(), block_hashes: Sequence = ()) -> PrefixMatch:
        """The longest run of leading full blocks of ``token_ids`` the cache holds (no side effects). One token is
        left to compute, its logits giving the first output (vLLM's ``max_cache_hit_length = num_tokens - 1``).
        ``block_hashes``: their chain as far as the caller knows it (``hash_chain``), kept by one asking again."""
        tokens = check_token_ids("token_ids", token_ids, 1)
        _check_key(key)
        hashes, bs = hash_chain(tokens, self.block_size, key, self.hash_fn, block_hashes), self.block_size
        block_ids: list[int] = []
        entries: list[int] = []
        for i in range((len(tokens) - 1) // bs):
            entry = self.index.lookup(hashes[i], tokens[i * bs:(i + 1) * bs], key, entries[-1] if entries else None)
            if entry is None:
                break
            block_ids.append(entry.block_id)
            entries.append(entry.entry_id)
        return PrefixMatch(tuple(block_ids), len(block_ids) * bs, tuple(hashes), tuple(entries))

    def hit_extra_blocks(self, hit: PrefixMatch, tokens: int) -> int:
        """``extra_blocks`` of a new request computing ``tokens`` tokens after its prefix ``hit``: fresh
        blocks, and cached ones that no one holds, revived from the free queue. What ``allocate`` takes."""
        if not isinstance(hit, PrefixMatch):
            raise ValueError(f"hit must be a PrefixMatch (from match), got {type(hit).__name__}")
        check_int("tokens", tokens, 0)
        revived = sum(1 for b in hit.block_ids if self.allocator.ref_counts[b] == 0)
        return _extra_blocks(hit.num_cached_tokens, hit.num_cached_blocks, tokens, self.block_size, revived=revived)

    def extra_blocks(self, table: CachedBlockTable, num_new_tokens: int) -> int:
        """Free blocks that ``append``-ing ``num_new_tokens`` tokens to ``table`` would use: new blocks,
        plus a private copy of a shared, partly filled tail."""
        self._check_table(table)
        check_int("num_new_tokens", num_new_tokens, 0)
        return _extra_blocks(table.num_tokens, len(table.block_ids), num_new_tokens, self.block_size,
                             tail_is_shared(table, self.allocator))

    def allocate(self, token_ids: Sequence[int], key: CacheKey = CacheKey(), *,
                 lookup: bool = True) -> tuple[CachedBlockTable, int]:
        """A block table for a new prompt: cached blocks first, fresh blocks for the rest. Returns ``(table,
        num_cached_tokens)``: the caller computes K/V for ``token_ids[num_cached_tokens:]`` only.
        ``lookup=False``: no hit (prefix caching off). All-or-nothing: on ``OutOfBlocksError`` nothing changed."""
        tokens = check_token_ids("token_ids", token_ids, 1)
        _check_key(key)
        check_flag("lookup", lookup)
        m = self.match(tokens, key) if lookup else PrefixMatch((), 0, ())
        needed = self.hit_extra_blocks(m, len(tokens) - m.num_cached_tokens)
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(f"prompt of {len(tokens)} tokens needs {needed} free blocks, "
                                   f"{self.allocator.num_free} of {self.allocator.num_blocks} are free")
        table = self.share(m, tokens[:m.num_cached_tokens], key)  # the hits first: fresh blocks cannot evict them
        self._append(table, tokens[m.num_cached_tokens:])
        return table, m.num_cached_tokens

    def share(self, hit: PrefixMatch, token_ids: Sequence[int], key: CacheKey) -> CachedBlockTable:
        """A new block table holding the blocks of a fresh ``hit`` (from ``match``; ``token_ids``: its
        tokens), one more reference each: a cached block that no one held is revived from the free queue."""
        if not isinstance(hit, PrefixMatch) or len(token_ids) != hit.num_cached_tokens:
            raise ValueError(f"hit must be a PrefixMatch of as many tokens as token_ids ({len(token_ids)})")
        for b in hit.block_ids:
            self.allocator.incref(b) if self.allocator.ref_counts[b] else self.allocator.revive(b)
        return CachedBlockTable(self, key, hit.block_ids, token_ids, hit.block_hashes[:hit.num_cached_blocks],
                                hit.entry_ids)

    def append(self, table: CachedBlockTable, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Reserve slots for ``token_ids`` at the end of ``table`` (``table.slots`` gives them); a shared,
        partly filled tail is first replaced by a private copy. Returns the ``(src, dst)`` blocks whose K/V
        must be copied (every layer) before the new K/V are written. All-or-nothing on ``OutOfBlocksError``."""
        self._check_table(table)
        return self._append(table, check_token_ids("token_ids", token_ids))

    def _append(self, table: CachedBlockTable, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """``append`` on checked arguments (the scheduler's hot path: its requests' tokens are checked)."""
        n = len(token_ids)
        copy = n > 0 and tail_is_shared(table, self.allocator)
        needed = _extra_blocks(table.num_tokens, len(table.block_ids), n, self.block_size, copy)
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(f"appending {n} tokens needs {needed} free blocks, "
                                   f"{self.allocator.num_free} of {self.allocator.num_blocks} are free")
        copies = []
        if copy:  # first a private copy of the shared tail
            src, dst = table.block_ids[-1], self.allocator.allocate()
            self.allocator.free(src)  # drop our reference; the other holders keep theirs
            table.block_ids[-1] = dst
            copies.append((src, dst))
        if needed > copy:
            table.block_ids.extend(self.allocator.allocate_many(needed - copy))
        table.num_tokens += n
        table.token_ids.extend(token_ids)
        return copies

    def cache_full_blocks(self, table: CachedBlockTable, num_computed_tokens: int | None = None) -> int:
        """Name the full blocks among the first ``num_computed_tokens`` (default: all) tokens; returns how many.
        (The scheduler names them when their tokens are scheduled, as vLLM's ``allocate_slots`` does.)"""
        self._check_table(table)
        n = table.num_tokens if num_computed_tokens is None else num_computed_tokens
        if type(n) is not int or not 0 <= n <= table.num_tokens:
            raise ValueError(f"num_computed_tokens must be an integer in [0, {table.num_tokens}], got {n!r}")
        bs, first = self.block_size, table.num_named_blocks
        for i in range(first, n // bs):
            parent_hash, parent_entry = (table.block_hashes[-1], table.entry_ids[-1]) if i else (None, None)
            tokens = tuple(table.token_ids[i * bs:(i + 1) * bs])
            h = self.hash_fn(parent_hash, tokens, table.key)
            twin = self.index.lookup(h, tokens, table.key, parent_entry)  # an identical block: same content id
            entry_id = twin.entry_id if twin is not None else next(self._entry_ids)
            self.index.add(CachedBlock(table.block_ids[i], h, parent_hash, tokens, table.key, entry_id, parent_entry))
            table.block_hashes.append(h)
            table.entry_ids.append(entry_id)
        return max(0, n // bs - first)

    def fork(self, table: CachedBlockTable) -> CachedBlockTable:
        """A second table holding the same blocks (one more reference each): parallel sampling."""
        self._check_table(table)
        for b in table.block_ids:
            self.allocator.incref(b)
        return CachedBlockTable(self, table.key, table.block_ids, table.token_ids, table.block_hashes, table.entry_ids)

    def release(self, table: CachedBlockTable) -> None:
        """The sequence ended: drop its references, tail first. Named blocks stay cached."""
        self._check_table(table)
        table.release(self.allocator)
        table.token_ids, table.block_hashes, table.entry_ids = [], [], []

    def clear(self) -> bool:
        """Forget every name (after a weight update, say); not counted as evictions. As vLLM 0.33.0's ``BlockPool.
        reset_prefix_cache``: refused (False, nothing changed) while a sequence holds a block; else True."""
        in_use = self.allocator.num_used > 0
        for b in [] if in_use else list(self.allocator.names):
            self.allocator.forget(b)
        return not in_use

    def _check_table(self, table: object) -> None:
        if not isinstance(table, CachedBlockTable) or table.owner is not self:
            got = "one made by another PrefixCache" if isinstance(table, CachedBlockTable) else type(table).__name__
            raise ValueError(f"table must be a CachedBlockTable made by this PrefixCache (allocate or fork), got {got}")


def _check_key(key: object) -> None:
    if not isinstance(key, CacheKey):
        raise ValueError(f"key must be a labkit.memory.prefix.CacheKey, got {type(key).__name__}")
