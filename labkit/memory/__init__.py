"""The KV cache's memory as bookkeeping: blocks, tables, the prefix cache and capacity (chapters 02-04, 08).

Nothing here holds K or V: these modules count and name blocks (``labkit.caches`` adds the tensors).

* ``blocks``: ``blocks_needed`` (every block count in labkit) and ``extra_blocks`` (what one more
  step of a request takes from the pool);
* ``paging``: ``BlockAllocator`` (free queue, reference counts) and ``BlockTable`` (slot mapping);
* ``prefix``: ``PrefixCache``: block hashes, sharing, copy-on-write, LRU eviction, vLLM's counters;
* ``capacity``: chapter 02's byte formula, GQA, presets, sharding, what fits;
* ``pool_plan``: one device's pool (``plan_pool``) and the PagedAttention paper's Fig. 2;
* ``formats``: caches of fewer bytes per element (fp8, int8, int4; scales per tensor, block or group);
* ``tiered``: a second tier behind the prefix cache (``TierStore``, ``TieredPrefixCache``): evicted
  blocks' names kept elsewhere and found after the pool (08).
"""
