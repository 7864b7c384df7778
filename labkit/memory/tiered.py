"""A second tier behind the prefix cache: evicted blocks kept elsewhere, found after the pool (chapter 08).

Chapter 04's cache forgets a block when the pool hands it out again: the next request that needs
it computes it again. A **second tier** (host memory, a disk, another machine) keeps it instead.
When the allocator evicts a named block, ``TieredPrefixCache`` puts the block's name, and through
the store its K/V, into a ``TierStore`` before anything overwrites it. A later ``match`` walks the
hash chain through the pool first, then on through the store. What it finds there is
``num_external_tokens``: vLLM's ``num_external_computed_tokens``, which its KV connector reports
(``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``). Admission then takes fresh pool blocks
for them, the store copies the K/V in, and each block gets its stored name back, so the chain goes
on from it.

Whether to load at all is the caller's rule (``worth_loading``): chapter 08 loads only when moving the
bytes costs less than computing the tokens again (``labkit.serving.sim.tiers``). The memory layer
knows no costs, so the rule comes in as a function.

A store here holds names only, which is all a simulator needs. A store that holds K/V
(``labkit.caches.tier_store``) overrides ``save``, ``fetch``, ``load`` and ``drop``; ``fetch`` reads and
checks a block when ``match`` finds it, so a damaged copy is refused (``TierLoadError``) before any
token is counted as computed, and that block is computed again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..checks import check_int
from .paging import BlockAllocator
from .prefix import CacheKey, CachedBlock, CachedBlockTable, PrefixCache, PrefixMatch, block_hash

__all__ = ["TierLoadError", "TierStats", "TierStore", "TieredMatch", "TieredPrefixCache"]


class TierLoadError(RuntimeError):
    """A block the tier holds cannot be used (a damaged or missing copy): the message says which and why."""


@dataclass
class TierStats:
    """What the tier did, counted apart from the pool's hits (as vLLM counts its connector's apart):
    ``puts`` (evicted blocks it took), ``evictions`` (blocks it dropped for room), ``loaded_requests``,
    ``loaded_tokens`` and ``loaded_blocks`` (what admissions took from it), ``refused`` (copies it could not use)."""

    puts: int = 0
    evictions: int = 0
    loaded_requests: int = 0
    loaded_tokens: int = 0
    loaded_blocks: int = 0
    refused: int = 0


class TierStore:
    """Named blocks a pool evicted, the least recently used dropped beyond ``capacity`` blocks.

    Each block is kept under its content id (``CachedBlock.entry_id``) and found by its hash, its tokens,
    its key and its parent's content id, as the pool's own index finds blocks. This store keeps names
    only; a subclass that keeps K/V overrides the four payload methods.
    """

    def __init__(self, capacity: int):
        self.capacity = check_int("capacity", capacity, 1)
        self.entries: OrderedDict[int, CachedBlock] = OrderedDict()  # entry id -> name, least recent first
        self._by_hash: dict[Any, dict[int, None]] = {}
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, block_id: int, entry: CachedBlock) -> None:
        """The pool is about to reuse ``block_id``, named ``entry``: keep it (its K/V still in the block)."""
        if entry.entry_id in self.entries:
            self.entries.move_to_end(entry.entry_id)
            return
        self.save(block_id, entry)
        self.entries[entry.entry_id] = entry
        self._by_hash.setdefault(entry.block_hash, {})[entry.entry_id] = None
        self.stats.puts += 1
        while len(self.entries) > self.capacity:
            self.discard(next(iter(self.entries.values())))
            self.stats.evictions += 1

    def get(self, h: Any, tokens: Sequence[int], key: CacheKey, parent_entry: int | None) -> CachedBlock | None:
        """The stored block named ``h`` that really is these tokens after this parent, else None."""
        for entry_id in self._by_hash.get(h, ()):
            entry = self.entries[entry_id]
            if entry.parent_entry == parent_entry and entry.token_ids == tuple(tokens) and entry.key == key:
                self.entries.move_to_end(entry_id)
                return entry
        return None

    def discard(self, entry: CachedBlock) -> None:
        """Forget a stored block (dropped for room, or refused)."""
        del self.entries[entry.entry_id]
        twins = self._by_hash[entry.block_hash]
        del twins[entry.entry_id]
        if not twins:
            del self._by_hash[entry.block_hash]
        self.drop(entry)

    # The payload: a store of names only moves nothing.
    def save(self, block_id: int, entry: CachedBlock) -> None:
        """Keep the K/V of pool block ``block_id`` (still intact) for ``entry``."""

    def fetch(self, entry: CachedBlock) -> Any:
        """Read and check ``entry``'s K/V; raise ``TierLoadError`` if they cannot be used."""
        return None

    def load(self, payload: Any, block_id: int) -> None:
        """Copy a fetched payload into pool block ``block_id``."""

    def drop(self, entry: CachedBlock) -> None:
        """Free what ``entry``'s K/V occupied."""


@dataclass(frozen=True)
class TieredMatch(PrefixMatch):
    """A ``PrefixMatch`` that goes on into the tier: ``loads`` are the stored names and fetched payloads of
    its ``num_external_tokens``, in chain order."""

    loads: tuple[tuple[CachedBlock, Any], ...] = field(default=(), repr=False)


class TieredPrefixCache(PrefixCache):
    """chapter 04's ``PrefixCache`` with a ``TierStore`` behind it.

    ``worth_loading(cached_tokens, external_tokens, prompt_tokens) -> bool``: whether to load what the tier
    holds after the pool's hit (default: always); if not, the request computes those tokens again.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, store: TierStore, *,
                 worth_loading: Callable[[int, int, int], bool] | None = None, hash_fn=block_hash):
        if not isinstance(store, TierStore):
            raise ValueError(f"store must be a labkit.memory.tiered.TierStore, got {type(store).__name__}")
        if worth_loading is not None and not callable(worth_loading):
            raise ValueError("worth_loading must be callable (cached_tokens, external_tokens, prompt_tokens) -> bool")
        super().__init__(allocator, block_size, hash_fn=hash_fn)
        self.store, self.worth_loading = store, worth_loading
        self.loads_in_step: list[tuple[CachedBlockTable, int]] = []  # (table, tokens) of each load, until taken
        allocator.on_evict = self._evicted

    def _evicted(self, block_id: int, entry: CachedBlock) -> None:
        self.index.remove(block_id, entry)
        self.store.put(block_id, entry)  # before the new owner writes the block

    def match(self, token_ids: Sequence[int], key: CacheKey = CacheKey(), block_hashes: Sequence = ()) -> PrefixMatch:
        """The pool's hit, then the run of following full blocks the tier holds, if ``worth_loading`` says the
        run pays; only then is each block read and checked (a refused copy leaves the tier and ends the run
        there, and the shorter run is judged again)."""
        hit = super().match(token_ids, key, block_hashes)
        tokens, bs = list(token_ids), self.block_size
        run: list[CachedBlock] = []
        parent = hit.entry_ids[-1] if hit.entry_ids else None
        for i in range(hit.num_cached_blocks, (len(tokens) - 1) // bs):
            entry = self.store.get(hit.block_hashes[i], tokens[i * bs:(i + 1) * bs], key, parent)
            if entry is None:
                break
            run.append(entry)
            parent = entry.entry_id
        while run and self._worth(hit.num_cached_tokens, len(run) * bs, len(tokens)):
            loads = []
            for entry in run:
                try:
                    loads.append((entry, self.store.fetch(entry)))
                except TierLoadError:
                    self.store.discard(entry)
                    self.store.stats.refused += 1
                    break
            if len(loads) == len(run):
                return TieredMatch(hit.block_ids, hit.num_cached_tokens, hit.block_hashes,
                                   hit.entry_ids + tuple(e.entry_id for e in run), len(run) * bs, tuple(loads))
            run = run[:len(loads)]
        return hit

    def _worth(self, cached: int, external: int, total: int) -> bool:
        return self.worth_loading is None or bool(self.worth_loading(cached, external, total))

    def share(self, hit: PrefixMatch, token_ids: Sequence[int], key: CacheKey) -> CachedBlockTable:
        """The pool's blocks as chapter 04 shares them, then fresh blocks for the tier's, their K/V loaded
        and their stored names given back (same content ids: the chain goes on from them)."""
        if not isinstance(hit, TieredMatch):
            return super().share(hit, token_ids, key)
        pool = hit.num_cached_tokens
        if len(token_ids) != pool + hit.num_external_tokens:
            raise ValueError(f"token_ids must be the hit's {pool + hit.num_external_tokens} tokens, got {len(token_ids)}")
        local = PrefixMatch(hit.block_ids, pool, hit.block_hashes, hit.entry_ids[:hit.num_cached_blocks])
        table = super().share(local, list(token_ids[:pool]), key)
        self._append(table, list(token_ids[pool:]))
        for (entry, payload), b in zip(hit.loads, table.block_ids[hit.num_cached_blocks:]):
            self.store.load(payload, b)
            self.index.add(CachedBlock(b, entry.block_hash, entry.parent_hash, entry.token_ids, entry.key,
                                       entry.entry_id, entry.parent_entry))
            table.block_hashes.append(entry.block_hash)
            table.entry_ids.append(entry.entry_id)
        stats = self.store.stats
        stats.loaded_requests += 1
        stats.loaded_tokens += hit.num_external_tokens
        stats.loaded_blocks += len(hit.loads)
        self.loads_in_step.append((table, hit.num_external_tokens))
        return table
