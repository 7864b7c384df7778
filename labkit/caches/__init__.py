"""KV caches that hold tensors, each behind the decoder's one method, ``attend`` (chapters 01, 03, 04, 08, A3).

* ``contiguous``: ``KVCache``, per-layer tensors grown by concatenation, and greedy ``generate``;
* ``paged``: ``KVPool`` (every layer's block pools and paged attention), ``PagedKVCache`` (a block
  table per sequence) and ``generate_paged``;
* ``prefix_cached``: ``PrefixCachedPool``, whose blocks a ``PrefixCache`` shares between requests,
  and ``generate_with_prefix_cache``;
* ``stepwise``: ``StepwiseKV``, attention by chapter 01's ``decode_step``, token by token (the capstone);
* ``quant_quality``: what a quantized cache costs the real model (scales, loss, greedy agreement);
* ``block_files``: one KV block in a checked file (its name, the pool's shape, a SHA-256), ``BlockFileError``;
* ``tier_store``: second tiers that hold K/V, ``DiskTierStore`` (block files) and ``MemoryTierStore`` (chapter 08).
"""
