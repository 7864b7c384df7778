"""The prefix cache: share the K/V blocks of a common prompt prefix (chapter 04).

Many requests start with the same tokens: a system prompt, a few-shot template,
one long report that several questions are asked about. The keys and values of
those tokens depend only on the tokens before them (causal attention) and on
the computation itself, so a serving engine can compute them once, keep the
blocks, and point every later request's block table at them.

How a block is recognised. Only *full* blocks are cached. Block ``i`` of a
sequence is named by a hash chain::

    hash_i = H(hash_{i-1}, token ids of block i, extra keys)

The parent hash makes the name depend on the *whole* prefix, not just the block's
own tokens: the same sentence after a different earlier text gets a different
name, as it must, because its K/V differ. The extra keys (``CacheKey``) hold
everything else that changes the numbers: the weights and adapter, the cache
dtype and layout, the position-encoding settings, an optional salt that keeps
two tenants apart. ``H`` is SHA-256 over a canonical JSON encoding, so a name is
the same in every process and on every run.

A hash is only an index. On a hit the cache compares the stored token ids, the
stored extra keys and the stored parent entry with the request's, so even a
hash collision (try a deliberately weak ``hash_fn``) can only cause a miss,
never a wrong reuse.

Lifetime of a block. A block's reference count (``BlockAllocator``) says how
many block tables hold it. A full block gets its name as soon as its tokens are
scheduled (``cache_full_blocks``; vLLM does it in ``KVCacheManager.allocate_slots``), every
full block, identical twins included. When the last table holding a named block
ends, the block goes back to the free queue *still named*, at the back: a later
request can revive it (``allocator.revive``). Unnamed blocks go to the front and are
reused first. Only when ``allocator.allocate`` hands a named block out again is its
name dropped (an eviction), so eviction is least recently used; tables release
tail first, so the leaves of a prefix are evicted before its root.

Copy-on-write. ``fork`` gives a second sequence the same blocks (parallel
sampling, beam search). When one of them appends into a partly filled tail
block that the other also holds, it first gets a private copy of that block:
``append`` returns the ``(src, dst)`` block pairs whose K/V the caller must copy.

Typical use, with K/V written by the caller::

    cache = PrefixCache(BlockAllocator(64), block_size=16)
    table, num_cached = cache.allocate(prompt_ids, key)
    # compute K/V for prompt_ids[num_cached:], write them at table.slot(p)
    cache.cache_full_blocks(table)           # name the full blocks: reusable from now on
    result = cache.append(table, [next_id])  # decode: one more slot
    cache.release(table)                     # finished: blocks stay cached
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import weakref
from dataclasses import astuple, dataclass
from typing import Callable, Sequence

from .checks import check_int
from .paging import AttentionMetadata, BlockAllocator, BlockTable, KVPool, OutOfBlocksError, blocks_needed

__all__ = [
    "CacheKey",
    "block_hash",
    "hash_chain",
    "PrefixMatch",
    "AppendResult",
    "PrefixCacheStats",
    "CachedBlock",
    "tail_is_shared",
    "CachedBlockTable",
    "PrefixCache",
    "OutOfBlocksError",
    "PrefixKVCache",
    "PrefixGeneration",
    "generate_with_prefix_cache",
]


@dataclass(frozen=True)
class CacheKey:
    """Everything besides the token ids that changes a block's K/V ("extra keys").

    Two requests may share a block only when all of these are equal. Fields:

    * ``model``: which weights computed the K/V (a name or checkpoint hash).
    * ``adapter``: the LoRA / adapter id, ``None`` for the base model.
    * ``cache_dtype`` and ``cache_layout``: how the K/V are stored; a block in
      float16 cannot be read as bfloat16 or fp8, nor an ``NHD`` block as ``HND``.
    * ``rope_theta`` and ``rope_scaling``: position-encoding settings; a
      different base frequency rotates every key differently.
    * ``attention``: the attention rule that produced the hidden states, e.g.
      ``"causal"`` or ``"sliding-4096"`` (a window changes every later layer's input).
    * ``salt``: an optional string that keeps tenants apart even for equal prompts
      (reuse can leak timing information between users).
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
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string or None, got {value!r}")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) \
                or not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be a finite number > 0, got {self.rope_theta!r}")
        # One spelling per value: 10000 and 10000.0 must give the same block hash, and the hash
        # encodes the fields as JSON, where they would differ ("10000" vs "10000.0").
        object.__setattr__(self, "rope_theta", float(self.rope_theta))


HashFn = Callable[["str | None", "tuple[int, ...]", CacheKey], str]


def block_hash(parent_hash: str | None, token_ids: Sequence[int], key: CacheKey) -> str:
    """The name of one full block: SHA-256 of (parent hash, token ids, extra keys), as hex.

    The encoding is canonical JSON (no whitespace, fields in a fixed order), so the
    same block gets the same name in every process, unlike Python's salted ``hash``.
    ``parent_hash`` is ``None`` for a sequence's first block.
    """
    payload = json.dumps([parent_hash, [int(t) for t in token_ids], list(astuple(key))],
                         separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def hash_chain(token_ids: Sequence[int], block_size: int, key: CacheKey = CacheKey(),
               hash_fn: HashFn = block_hash) -> list[str]:
    """The hash of every *full* block of ``token_ids``; a partial last block has no name."""
    check_int("block_size", block_size, 1)
    tokens = _check_token_ids(token_ids)
    _check_key(key)
    hashes: list[str] = []
    parent = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_fn(parent, tokens[start:start + block_size], key)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class PrefixMatch:
    """What the cache holds of a prompt: the leading full blocks that can be reused.

    ``block_ids`` are physical blocks, one per reused logical block; ``num_cached_tokens``
    = ``len(block_ids) * block_size``; ``block_hashes`` is the prompt's whole hash chain
    (every full block, hit or not).
    """

    block_ids: tuple[int, ...]
    num_cached_tokens: int
    block_hashes: tuple[str, ...]
    entry_ids: tuple[int, ...] = ()

    @property
    def num_cached_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class AppendResult:
    """What ``PrefixCache.append`` did: the new tokens' slots and any copy-on-write.

    ``slot_mapping[i]`` is the pool slot of the i-th appended token. ``copies`` lists
    ``(src_block, dst_block)`` pairs: copy the K/V of ``src`` into ``dst`` (all layers)
    before writing the new tokens, because ``dst`` replaced a shared block.
    """

    slot_mapping: list[int]
    copies: list[tuple[int, int]]


@dataclass
class PrefixCacheStats:
    """Counters since the cache was made, in tokens and in blocks.

    A *hit* is a prompt token whose K/V were found in the cache and not recomputed;
    a *miss* is a prompt token that had to be computed. An *eviction* is a named
    block whose name was dropped because its K/V are overwritten (or ``evict``).
    """

    requests: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the cache (0.0 before any request)."""
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else 0.0


@dataclass(frozen=True)
class CachedBlock:
    """The name of one full block whose K/V are in the pool (``allocator.names[block_id]``).

    ``entry_id`` identifies the block's *content* (its tokens, key and whole prefix):
    identical blocks share it. ``parent_entry`` is the content id of the block before it
    (``None`` for a first block); checking it on a hit verifies the whole prefix, block by
    block, whatever the hash function.
    """

    block_id: int
    block_hash: str
    parent_hash: str | None
    token_ids: tuple[int, ...]
    key: CacheKey
    entry_id: int
    parent_entry: int | None


def tail_is_shared(table: BlockTable, allocator: BlockAllocator) -> bool:
    """The copy-on-write test: the table's last block is partly filled and another table holds it too.

    The next token written there would change the other table's history, so the writer
    first gets a private copy. A full shared block never needs one: nobody writes into it.
    """
    return bool(table.num_tokens % table.block_size) and allocator.ref_counts[table.block_ids[-1]] > 1


class CachedBlockTable(BlockTable):
    """A ``BlockTable`` that also remembers its tokens and computation key.

    Made by ``PrefixCache.allocate`` or ``PrefixCache.fork``; grow it with that cache's
    ``append`` (``BlockTable.append`` would not record the tokens, so it is refused).
    ``token_ids[i]`` is the token at position ``i``; ``block_hashes`` and ``entry_ids``
    name the leading full blocks already named (by this table or found in the cache).
    """

    def __init__(self, block_size: int, key: CacheKey, owner: "PrefixCache"):
        super().__init__(block_size)
        self.key = key
        self.token_ids: list[int] = []
        self.block_hashes: list[str] = []
        self.entry_ids: list[int] = []
        self.owner = owner

    @property
    def num_named_blocks(self) -> int:
        return len(self.block_hashes)

    def append(self, n: int, allocator: BlockAllocator) -> list[int]:
        raise ValueError("a CachedBlockTable grows with PrefixCache.append(table, token_ids), "
                         "which records the tokens and copies a shared tail first")


class PrefixCache:
    """Hash-named full blocks, shared by reference count and evicted least recently used.

    The names live on the ``allocator`` (``allocator.names``), which drops a block's name
    whenever it hands the block out again; this class keeps the index from hash to blocks
    and the tables' token ids. Like vLLM v1, every full block gets its name, identical
    twins included (``vllm/v1/core/block_pool.py``, ``BlockHashToBlockMap``: one hash may map
    to several blocks), so a block table only ever grows at its end; a lookup takes the
    oldest twin.

    ``allocator``: the pool (one prefix cache per allocator). ``block_size``: tokens per
    block. ``hash_fn``: ``block_hash`` by default; tests pass a weak one to show that
    collisions cannot cause wrong reuse.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, *, hash_fn: HashFn = block_hash):
        if not isinstance(allocator, BlockAllocator):
            raise ValueError(f"allocator must be a labkit.paging.BlockAllocator, got {type(allocator).__name__}")
        check_int("block_size", block_size, 1)
        if not callable(hash_fn):
            raise ValueError("hash_fn must be callable (parent_hash, token_ids, key) -> str")
        if allocator.on_evict is not None or allocator.names:
            raise ValueError("allocator must not serve another prefix cache already")
        self.allocator = allocator
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.stats = PrefixCacheStats()
        self._by_hash: dict[str, dict[int, None]] = {}  # block hash -> its named blocks, oldest first
        self._next_entry = 0
        allocator.on_evict = self._on_evict

    # ------------------------------------------------------------------ queries
    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose K/V carry a name (in use or free)."""
        return len(self.allocator.names)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self.allocator.names

    def cached_block(self, block_id: int) -> CachedBlock | None:
        """The name of ``block_id``, or ``None`` when it carries none."""
        return self.allocator.names.get(block_id)

    def cached_block_ids(self) -> list[int]:
        return sorted(self.allocator.names)

    def evictable_block_ids(self) -> list[int]:
        """Named blocks no sequence holds, in the order ``allocate`` would evict them."""
        return [b for b in self.allocator.free_block_ids() if b in self.allocator.names]

    def block_hashes(self, token_ids: Sequence[int], key: CacheKey = CacheKey()) -> list[str]:
        """The hash chain of ``token_ids``' full blocks under this cache's block size and hash."""
        return hash_chain(token_ids, self.block_size, key, self.hash_fn)

    def match(self, token_ids: Sequence[int], key: CacheKey = CacheKey()) -> PrefixMatch:
        """The longest run of leading full blocks of ``token_ids`` that the cache holds.

        Capped so that at least one token is left to compute: the model must run on
        the last prompt token to produce the logits of the first output token (vLLM's
        ``KVCacheManager.get_computed_blocks``: ``max_cache_hit_length = num_tokens - 1``).
        No side effects: nothing is counted, taken or reordered.
        """
        tokens = _check_token_ids(token_ids, min_len=1)
        _check_key(key)
        hashes = hash_chain(tokens, self.block_size, key, self.hash_fn)
        bs = self.block_size
        block_ids: list[int] = []
        entries: list[int] = []
        for i in range((len(tokens) - 1) // bs):
            entry = self._lookup(hashes[i], tokens[i * bs:(i + 1) * bs], key, entries[-1] if entries else None)
            if entry is None:
                break
            block_ids.append(entry.block_id)
            entries.append(entry.entry_id)
        return PrefixMatch(tuple(block_ids), len(block_ids) * bs, tuple(hashes), tuple(entries))

    def free_blocks_needed(self, token_ids: Sequence[int], key: CacheKey = CacheKey()) -> int:
        """How many blocks of the allocator's free pool ``allocate(token_ids, key)`` would use.

        Fresh blocks for the uncached rest, plus cached hits that sit in the free queue
        (reviving them takes them out of it). Hits that another sequence holds cost nothing.
        """
        return self._free_blocks_needed(_check_token_ids(token_ids, min_len=1), self.match(token_ids, key))

    def _free_blocks_needed(self, tokens: tuple[int, ...], m: PrefixMatch) -> int:
        revived = sum(1 for b in m.block_ids if self.allocator.ref_counts[b] == 0)
        return blocks_needed(len(tokens), self.block_size) - m.num_cached_blocks + revived

    def extra_blocks(self, table: CachedBlockTable, num_new_tokens: int) -> int:
        """Free blocks that ``append``-ing ``num_new_tokens`` tokens to ``table`` would use:
        new blocks, plus one for a copy of a shared, partly filled tail (copy-on-write)."""
        self._check_table(table)
        check_int("num_new_tokens", num_new_tokens, 0)
        copy = num_new_tokens > 0 and tail_is_shared(table, self.allocator)
        return table.new_blocks_for(num_new_tokens) + int(copy)

    # ----------------------------------------------------------------- changes
    def allocate(self, token_ids: Sequence[int], key: CacheKey = CacheKey(), *,
                 lookup: bool = True) -> tuple[CachedBlockTable, int]:
        """A block table for a new prompt: cached blocks first, fresh blocks for the rest.

        Returns ``(table, num_cached_tokens)``: the caller computes K/V only for
        ``token_ids[num_cached_tokens:]``, writes them at ``table.slot(p)`` and calls
        ``cache_full_blocks(table)`` (an engine does it when it allocates, as vLLM does). Cached blocks
        in use get one more reference; free cached blocks are revived with ``allocator.revive``.
        ``lookup=False``: no hit (prefix caching off). All-or-nothing: on ``OutOfBlocksError``
        the allocator, the cache and its counters are unchanged.
        """
        tokens = _check_token_ids(token_ids, min_len=1)
        _check_key(key)
        m = self.match(tokens, key) if lookup else PrefixMatch((), 0, ())
        needed = self._free_blocks_needed(tokens, m)
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(f"prompt of {len(tokens)} tokens needs {needed} free blocks, "
                                   f"{self.allocator.num_free} of {self.allocator.num_blocks} are free")
        for b in m.block_ids:  # revive or share the hits first, so the fresh blocks cannot evict them
            if self.allocator.ref_counts[b] == 0:
                self.allocator.revive(b)
            else:
                self.allocator.incref(b)
        num_fresh = blocks_needed(len(tokens), self.block_size) - m.num_cached_blocks
        table = CachedBlockTable(self.block_size, key, self)
        table.block_ids = list(m.block_ids) + self.allocator.allocate_many(num_fresh)
        table.num_tokens = len(tokens)
        table.token_ids = list(tokens)
        table.block_hashes = list(m.block_hashes[:m.num_cached_blocks])
        table.entry_ids = list(m.entry_ids)
        s = self.stats
        s.requests += 1
        s.hit_tokens += m.num_cached_tokens
        s.miss_tokens += len(tokens) - m.num_cached_tokens
        s.hit_blocks += m.num_cached_blocks
        s.miss_blocks += num_fresh
        return table, m.num_cached_tokens

    def append(self, table: CachedBlockTable, token_ids: Sequence[int]) -> AppendResult:
        """Reserve slots for ``token_ids`` at the end of ``table``; copy a shared tail first.

        New blocks come from the allocator (evicting the least recently used named free
        block when it hands one out). If the tail block is partly filled and another table
        holds it too, a private block replaces it in this table and ``(src, dst)`` is
        reported in ``copies``. All-or-nothing on ``OutOfBlocksError``.
        """
        tokens = _check_token_ids(token_ids)
        n = len(tokens)
        needed, new = self.extra_blocks(table, n), table.new_blocks_for(n)
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(f"appending {n} tokens needs {needed} free blocks, "
                                   f"{self.allocator.num_free} of {self.allocator.num_blocks} are free")
        copies: list[tuple[int, int]] = []
        if needed > new:  # the tail is shared: copy it first
            src, dst = table.block_ids[-1], self.allocator.allocate()
            self.allocator.free(src)  # drop our reference; the other holders keep theirs
            table.block_ids[-1] = dst
            copies.append((src, dst))
        if new:
            table.block_ids.extend(self.allocator.allocate_many(new))
        start = table.num_tokens
        table.num_tokens += n
        table.token_ids.extend(tokens)
        return AppendResult([table.slot(p) for p in range(start, start + n)], copies)

    def cache_full_blocks(self, table: CachedBlockTable, num_computed_tokens: int | None = None) -> int:
        """Name the full blocks among the first ``num_computed_tokens`` tokens, so others can reuse them.

        vLLM names a block as soon as its tokens are scheduled (``KVCacheManager.allocate_slots``
        calls ``cache_blocks``): a request admitted later in the same step may share it, since
        the pass writes every chunk's K/V before any chunk attends. Default: all of the
        table's tokens. A block whose identical twin is named already is named too.
        Returns how many blocks got a name.
        """
        self._check_table(table)
        if num_computed_tokens is None:
            num_computed_tokens = table.num_tokens
        if type(num_computed_tokens) is not int or not 0 <= num_computed_tokens <= table.num_tokens:
            raise ValueError(f"num_computed_tokens must be an integer in [0, {table.num_tokens}], "
                             f"got {num_computed_tokens!r}")
        bs, names = self.block_size, self.allocator.names
        first = table.num_named_blocks
        for i in range(first, num_computed_tokens // bs):
            parent_hash = table.block_hashes[-1] if table.block_hashes else None
            parent_entry = table.entry_ids[-1] if table.entry_ids else None
            tokens = tuple(table.token_ids[i * bs:(i + 1) * bs])
            h = self.hash_fn(parent_hash, tokens, table.key)
            twin = self._lookup(h, tokens, table.key, parent_entry)
            if twin is not None:
                entry_id = twin.entry_id
            else:
                entry_id, self._next_entry = self._next_entry, self._next_entry + 1
            block_id = table.block_ids[i]
            names[block_id] = CachedBlock(block_id, h, parent_hash, tokens, table.key, entry_id, parent_entry)
            self._by_hash.setdefault(h, {})[block_id] = None
            table.block_hashes.append(h)
            table.entry_ids.append(entry_id)
        return max(0, num_computed_tokens // bs - first)

    def fork(self, table: CachedBlockTable) -> CachedBlockTable:
        """A second table holding the same blocks (one more reference each): parallel sampling."""
        self._check_table(table)
        child = CachedBlockTable(self.block_size, table.key, self)
        for b in table.block_ids:
            self.allocator.incref(b)
        child.block_ids, child.num_tokens = list(table.block_ids), table.num_tokens
        child.token_ids, child.block_hashes = list(table.token_ids), list(table.block_hashes)
        child.entry_ids = list(table.entry_ids)
        return child

    def release(self, table: CachedBlockTable) -> None:
        """The sequence ended: drop its references, tail first. Named blocks stay cached."""
        self._check_table(table)
        table.release(self.allocator)
        table.token_ids, table.block_hashes, table.entry_ids = [], [], []

    def evict(self, num_blocks: int = 1) -> list[int]:
        """Drop the names of the ``num_blocks`` least recently used named free blocks now; returns them.

        Engines evict lazily (when ``allocate`` hands a block out); this is the same
        decision made eagerly, e.g. to show it. The blocks stay free.
        """
        check_int("num_blocks", num_blocks, 0)
        victims = self.evictable_block_ids()[:num_blocks]
        for b in victims:
            self.allocator.forget(b)
        return victims

    def clear(self) -> int:
        """Forget every named block that no sequence holds (e.g. after a weight update).

        Blocks that running sequences hold keep their names. Returns how many were dropped.
        """
        victims = [b for b in self.allocator.names if self.allocator.ref_counts[b] == 0]
        for b in victims:
            self.allocator.forget(b)
        self.stats.evicted_blocks -= len(victims)  # a clear is not an eviction
        return len(victims)

    # ----------------------------------------------------------------- helpers
    def _lookup(self, h: str, tokens: Sequence[int], key: CacheKey, parent_entry: int | None) -> CachedBlock | None:
        """The oldest block named ``h`` that really is this block after this parent, else ``None``."""
        for block_id in self._by_hash.get(h, ()):
            entry = self.allocator.names[block_id]
            if entry.parent_entry == parent_entry and entry.token_ids == tuple(tokens) and entry.key == key:
                return entry
        return None  # a miss, a hash collision or a stale child: verified, so never a wrong reuse

    def _on_evict(self, block_id: int, entry: CachedBlock) -> None:
        """The allocator dropped ``block_id``'s name: take it out of the index."""
        twins = self._by_hash[entry.block_hash]
        del twins[block_id]
        if not twins:
            del self._by_hash[entry.block_hash]
        self.stats.evicted_blocks += 1

    def _check_table(self, table: object) -> None:
        if not isinstance(table, CachedBlockTable):
            raise ValueError(f"table must be a CachedBlockTable made by PrefixCache.allocate or fork, "
                             f"got {type(table).__name__}")
        if table.block_size != self.block_size:
            raise ValueError(f"table.block_size must equal this cache's block_size {self.block_size}, "
                             f"got {table.block_size}")
        if table.owner is not self:
            raise ValueError("table must have been made by this PrefixCache (allocate or fork)")


def _check_key(key: object) -> None:
    if not isinstance(key, CacheKey):
        raise ValueError(f"key must be a labkit.prefix.CacheKey, got {type(key).__name__}")


def _check_token_ids(token_ids: object, min_len: int = 0) -> tuple[int, ...]:
    """``token_ids`` as a tuple of ints >= 0, or ValueError naming the parameter."""
    if not isinstance(token_ids, (list, tuple, range)):
        raise ValueError(f"token_ids must be a list or tuple of integers >= 0, got {type(token_ids).__name__} "
                         "(convert a tensor with .tolist())")
    tokens = tuple(token_ids)
    # Exactly int (a bool is a subclass of int, and is refused), then min() for the sign; both run in C.
    if tokens and (set(map(type, tokens)) != {int} or min(tokens) < 0):
        bad = next(t for t in tokens if type(t) is not int or t < 0)
        raise ValueError(f"token_ids must hold integers >= 0, found {bad!r}")
    if len(tokens) < min_len:
        raise ValueError(f"token_ids must hold at least {min_len} token(s), got {len(tokens)}")
    return tokens


def _check_vocab(tokens: tuple[int, ...], vocab_size: int) -> None:
    """Every id must name a row of the embedding table: [0, vocab_size)."""
    if tokens and max(tokens) >= vocab_size:
        bad = next(t for t in tokens if t >= vocab_size)
        raise ValueError(f"prompt_ids must hold token ids in [0, {vocab_size - 1}] (the model's vocab_size is "
                         f"{vocab_size}), found {bad}")


# ---------------------------------------------------------------------------------------------
# Prefix reuse with real tensors: the decoder's cache protocol on top of a PrefixCache
# ---------------------------------------------------------------------------------------------

class PrefixKVCache(KVPool):
    """Paged K/V pools for ``labkit.model.Decoder`` whose blocks are managed by a ``PrefixCache``.

    One sequence runs at a time (batch 1): ``begin`` gives it a block table whose cached
    prefix is already filled, the model then runs on the *remaining* tokens only, and
    ``attend`` writes their K/V and attends over the whole sequence (``KVPool.attend``:
    ``write_kv``, then the paged kernels). ``reuse=False`` never names a block, so nothing
    ever hits: the same code with prefix caching turned off, for comparisons.
    """

    def __init__(self, config, num_blocks: int, block_size: int, *, dtype=None, device=None,
                 model_name: str = "teaching-model", reuse: bool = True):
        import torch

        check_int("block_size", block_size, 1)
        super().__init__(config, num_blocks, block_size, torch.float32 if dtype is None else dtype, device)
        self.reuse = bool(reuse)
        self.model_name = model_name
        self.prefix = PrefixCache(BlockAllocator(num_blocks), block_size)
        self.table: CachedBlockTable | None = None
        self.seq_len = 0  # tokens of the current sequence whose K/V are in the pool

    def key(self, adapter: str | None = None, salt: str | None = None, *, model=None) -> CacheKey:
        """The computation identity of this pool: model, dtype, layout, RoPE base; plus adapter and salt.

        ``model``: the module whose weights compute the K/V; its identity joins the model
        name, so two models never share blocks through one pool.
        """
        name = self.model_name if model is None else f"{self.model_name} (weights #{_weights_id(model)})"
        return CacheKey(model=name, adapter=adapter, cache_dtype=str(self.dtype).replace("torch.", ""),
                        cache_layout="NHD", rope_theta=float(self.config.rope_theta), salt=salt)

    def begin(self, prompt_ids: Sequence[int], key: CacheKey | None = None) -> int:
        """Start a sequence for ``prompt_ids``; return how many prompt tokens are already cached."""
        if self.table is not None:
            raise ValueError("a sequence is running: call end() before begin()")
        self.table, num_cached = self.prefix.allocate(prompt_ids, key or self.key())
        self.seq_len = num_cached
        return num_cached

    def extend(self, token_ids: Sequence[int]) -> None:
        """Reserve slots for decode tokens; copy a shared tail block first (copy-on-write)."""
        self.copy_blocks(self.prefix.append(self._running(), token_ids).copies)

    def end(self) -> None:
        """The sequence finished: release its blocks (its full blocks stay cached)."""
        self.prefix.release(self._running())
        self.table, self.seq_len = None, 0

    def _running(self) -> CachedBlockTable:
        if self.table is None:
            raise ValueError("no sequence is running: call begin(prompt_ids) first")
        return self.table

    def attend(self, layer_idx: int, q, k, v):
        """Write the new tokens' K/V into their slots, then attend over the whole sequence."""
        table = self._running()
        start = self.seq_len
        self._check_qkv(q, k, v, k.shape[0] * k.shape[1] if k.dim() == 4 else None)
        batch, num_new = k.shape[:2]
        if batch != 1:
            raise ValueError(f"q, k, v must have batch 1 (one sequence at a time), got batch {batch}")
        if start + num_new > table.num_tokens:
            raise ValueError(f"{num_new} new tokens after {start} exceed the {table.num_tokens} reserved slots "
                             "(begin() or extend() first)")
        if layer_idx == 0:
            slots = [table.slot(p) for p in range(start, start + num_new)]
            self.meta = AttentionMetadata.build([table.block_ids], [start + num_new], [num_new], slots, self.device)
        out = super().attend(layer_idx, q, k, v)
        if layer_idx == self.config.num_hidden_layers - 1:  # the last layer: these tokens are done
            self.seq_len = start + num_new
            if self.reuse:
                self.prefix.cache_full_blocks(table, self.seq_len)
        return out


_weights_ids: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_next_weights_id = itertools.count()


def _weights_id(model) -> int:
    """A number for ``model`` that no other live or later model gets (``id`` can be reused)."""
    if model not in _weights_ids:
        _weights_ids[model] = next(_next_weights_id)
    return _weights_ids[model]


@dataclass
class PrefixGeneration:
    """One request's greedy output, and what the prefix cache saved it.

    ``num_cached_tokens``: prompt tokens found in the cache (not computed);
    ``num_prefill_tokens``: prompt tokens the model ran on; ``num_decode_steps``: forward
    passes of one token each after the prefill (reuse never shortens these).
    """

    tokens: list[int]
    logits: "object"  # torch.Tensor [max_new_tokens, vocab_size]
    num_cached_tokens: int
    num_prefill_tokens: int
    num_decode_steps: int


def generate_with_prefix_cache(model, kv: PrefixKVCache, prompt_ids: Sequence[int], max_new_tokens: int,
                               key: CacheKey | None = None) -> PrefixGeneration:
    """Greedy decoding of one request on ``kv``: prefill only the uncached suffix, then decode.

    Blocks named by earlier requests of the same ``model`` on the same ``kv`` are reused
    (when ``kv.reuse``; ``key`` defaults to ``kv.key(model=model)``);
    this request's own full blocks are named for later ones. Its blocks are released at the
    end and stay cached until evicted.
    """
    import torch

    check_int("max_new_tokens", max_new_tokens, 0)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    prompt = _check_token_ids(prompt_ids, min_len=1)
    _check_vocab(prompt, model.config.vocab_size)  # before begin(): a bad id must change nothing
    device = model.lm_head.weight.device
    num_cached = kv.begin(prompt, key or kv.key(model=model))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([prompt[num_cached:]], device=device), cache=kv)[0, -1]
            out_logits, tokens = [logits], [int(logits.argmax())]
            for _ in range(max_new_tokens - 1):
                kv.extend(tokens[-1:])
                logits = model(torch.tensor([tokens[-1:]], device=device), cache=kv)[0, -1]
                out_logits.append(logits)
                tokens.append(int(logits.argmax()))
    finally:
        kv.end()
    return PrefixGeneration(tokens, torch.stack(out_logits), num_cached, len(prompt) - num_cached,
                            max_new_tokens - 1)
