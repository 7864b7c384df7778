"""Chapter 05's engine with a second tier behind its prefix cache: real K/V moved out and back (chapter 08).

``TieredEngine`` is an ``Engine`` whose scheduler is a ``TieredScheduler`` over a ``TieredPrefixCache``,
wired to the engine's own ``KVPool`` through a store that holds real K/V
(``labkit.caches.tier_store``): block files in ``tier_dir``, or host memory when ``tier_dir`` is None.
Everything else is the engine's loop, unchanged:

1. the allocator hands out a free block that still carries a name (an eviction): the store copies its
   K/V out first (a file write, or a clone);
2. ``schedule`` matches a waiting request: the pool's blocks, then the tier's, each tier block read
   and checked now (a damaged file is refused: the request computes that block and what follows);
3. the request is admitted: fresh pool blocks, the staged K/V copied in, the blocks named again;
   it computes only the tokens after them, as if it had found them in the pool.

The step's ``stats.load_s`` is the time the store really spent reading, checking and copying in during
``schedule`` (measured, not priced as the simulator prices it; reads for a waiting request that is then not
admitted count too, they were spent), ``tier_hit_tokens`` the tokens loaded.
Writes are synchronous here and counted apart (``store.write_s``, ``store.bytes_written``); vLLM's
offloading connector overlaps both with the model's steps.
"""

from __future__ import annotations

import os
from typing import Callable

from ..caches.tier_store import DiskTierStore, MemoryTierStore
from ..checks import check_flag, check_int
from ..memory.paging import BlockAllocator
from ..memory.tiered import TieredPrefixCache, TierStore
from ..model import fused
from .engine import Engine
from .scheduler import Scheduler
from .step import Step
from .variants.tiered import TieredScheduler

__all__ = ["TieredEngine", "MeasuredTieredScheduler"]


class MeasuredTieredScheduler(TieredScheduler):
    """A ``TieredScheduler`` whose ``load_s`` is measured on its store (read, check, copy in) during ``schedule``."""

    def _spent(self) -> float:
        store = self.prefix_cache.store
        return getattr(store, "read_s", 0.0) + getattr(store, "load_s", 0.0)

    def schedule(self) -> Step:
        before = self._spent()
        step = super().schedule()
        step.stats.load_s = self._spent() - before
        return step


class TieredEngine(Engine):
    """An ``Engine`` whose evicted blocks go to a second tier of ``tier_blocks`` blocks and come back on a hit.

    ``tier_dir``: a folder for block files (``DiskTierStore``, ``direct_io`` passed on), or None to keep the
    blocks in host memory (``MemoryTierStore``). ``worth_loading(cached, external, prompt) -> bool``: whether
    to load what the tier found (default: always; ``labkit.serving.variants.tiered.worth_loading_rule`` is
    chapter 08's rule). Every other argument is the ``Engine``'s; the scheduler is always a
    ``MeasuredTieredScheduler`` with prefix caching on, and ``pieces`` is not available.
    """

    def __init__(self, model, num_blocks: int, block_size: int = 16, max_num_batched_tokens: int = 256, *,
                 tier_blocks: int, tier_dir: str | os.PathLike | None = None, direct_io: bool = False,
                 worth_loading: Callable[[int, int, int], bool] | None = None, **engine_kwargs):
        check_int("tier_blocks", tier_blocks, 1)
        if tier_dir is not None and (not isinstance(tier_dir, (str, os.PathLike)) or not str(tier_dir)):
            raise ValueError(f"tier_dir must be None or a folder (str or os.PathLike), got {tier_dir!r}")
        check_flag("direct_io", direct_io)
        if direct_io and tier_dir is None:
            raise ValueError("direct_io=True needs a tier_dir (host memory is not read through a file system)")
        if worth_loading is not None and not callable(worth_loading):
            raise ValueError("worth_loading must be callable (cached_tokens, external_tokens, prompt_tokens) -> bool")
        for name, allowed in (("scheduler_cls", Scheduler), ("pieces", None), ("enable_prefix_caching", True)):
            if name in engine_kwargs and engine_kwargs[name] is not allowed:
                raise ValueError(f"{name} cannot be changed in a TieredEngine (a second tier needs the prefix "
                                 f"cache and the tiered scheduler)")
        prepare = check_flag("prepare", engine_kwargs.pop("prepare", True))
        super().__init__(model, num_blocks, block_size, max_num_batched_tokens, prepare=False, **engine_kwargs)
        store = self.new_store(tier_blocks, tier_dir, direct_io)
        plain = self.scheduler
        cache = TieredPrefixCache(BlockAllocator(plain.num_blocks), plain.block_size, store,
                                  worth_loading=worth_loading)
        self.scheduler = MeasuredTieredScheduler(
            None, plain.block_size, plain.max_num_batched_tokens, max_num_seqs=plain.max_num_seqs,
            prefix_cache=cache, cache_key=plain.cache_key, full_sequence_must_fit=plain.full_sequence_must_fit,
            max_model_len=plain.max_model_len)
        if prepare:  # last, as the Engine does: a refused argument leaves the model as it was
            fused.prepare(model)

    def new_store(self, tier_blocks: int, tier_dir: str | os.PathLike | None, direct_io: bool) -> TierStore:
        """Hook: the second tier over this engine's pool (block files in ``tier_dir``, else host memory)."""
        if tier_dir is None:
            return MemoryTierStore(self.backend, tier_blocks)
        return DiskTierStore(self.backend, tier_dir, tier_blocks, direct_io=direct_io)

    @property
    def tier(self) -> DiskTierStore | MemoryTierStore:
        """The second tier: its blocks, ``stats`` (puts, loads, refusals) and what it moved."""
        return self.scheduler.prefix_cache.store
