"""Prefill on one engine, decode on another: a request's K/V handed over, for real (chapter 08).

``labkit.serving.cluster.disagg`` splits prefill from decode in the simulator. Here two real engines, each
with its own pool, do it with the real model. ``hand_over(prefill, request, decode)``:

1. **claims** ``c = min(request.num_computed_tokens, prompt_len - 1)`` tokens: only K/V that were really
   written, and never the last prompt token, whose logits the decode engine needs for its first token.
   The claim rule (vLLM PR #53314): the scheduler advances ``num_computed_tokens`` when it *plans* a chunk
   (``Scheduler._append``), so while a step is in flight the count includes slots nobody has written yet.
   A hand-over then is refused. Between steps, the count is exact, even halfway through a chunked
   prefill: the decode engine computes whatever was not handed over. vLLM 0.33.0 sends
   ``get_block_ids_for_computed_tokens`` for ``num_computed_tokens``, which it reads as the tokens
   actually processed;
2. **copies** the first ``c // block_size`` full blocks out of the prefill pool into the decode engine's
   ``KVInbox``. The copies are named by the *decode* cache's own hash chain, with content ids of its own
   (negative). Blocks the decode pool already holds are not sent: like vLLM's decode side, it asks only
   for what its prefix cache lacks;
3. **finishes** (aborts) the request on the prefill engine. Its blocks go back only now, *after* the copy,
   which is vLLM's ``delay_free`` (``request_finished``). Freed first, they could be handed to another
   request and overwritten before the copy;
4. **queues** the same prompt, with the same limits, on the decode engine. Its admission walks its pool,
   then its tier (the inbox). It takes the delivered blocks onto fresh block ids of its own (the same
   K/V) and computes the rest: at least the last prompt token, which samples the first output.

The move costs ``transfer_bytes`` over the link (``labkit.serving.sim.tiers.reload_seconds`` prices it).
Here the copy is synchronous and within one process; NIXL or Mooncake move the bytes between machines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..caches.paged import KVPool
from ..caches.tier_store import MemoryTierStore
from ..memory.blocks import blocks_needed
from ..memory.prefix import CacheKey, CachedBlock, PrefixCache, hash_chain
from .engine import Engine
from .request import Request
from .tiered_engine import TieredEngine

__all__ = ["KVInbox", "DecodeEngine", "Handoff", "hand_over", "transfer_bytes"]


@dataclass
class _Delivery:
    entry_id: int
    parent_hash: str | None
    token_ids: tuple[int, ...]
    key: CacheKey
    parts: list[torch.Tensor]  # every layer's K then V, as labkit.caches.block_files.copy_block takes them


class KVInbox(MemoryTierStore):
    """A decode engine's second tier: the host-memory tier of its own evicted blocks, plus the blocks handed to
    it (``deliver``). This is the simulator's ``HandoffInbox`` with real K/V. A delivered block is found by
    its hash, tokens and key (its hash chains its whole prefix). It is used once: the admission that loads it
    names the pool block, and later requests find it there. ``received_blocks`` and ``bytes_received``
    count what arrived. A delivery nobody loads (the request aborted before its admission, or its blocks
    computed meanwhile by another) stays in ``delivered``; labkit does not expire it."""

    def __init__(self, pool: KVPool, capacity: int):
        super().__init__(pool, capacity)
        self.delivered: dict[str, _Delivery] = {}  # block hash -> a block waiting for its admission
        self._next_id = -1
        self.received_blocks = self.bytes_received = 0

    def deliver(self, block_hash: str, parent_hash: str | None, token_ids: tuple[int, ...], key: CacheKey,
                parts: list[torch.Tensor]) -> None:
        """A block's K/V arrived, named ``block_hash`` by this engine's chain (a repeat of a waiting one is kept once)."""
        if block_hash not in self.delivered:
            self.delivered[block_hash] = _Delivery(self._next_id, parent_hash, token_ids, key, parts)
            self._next_id -= 1
            self.received_blocks += 1
            self.bytes_received += self.pool.bytes_per_block

    def get(self, h: Any, tokens, key: CacheKey, parent_entry: int | None) -> CachedBlock | None:
        d = self.delivered.get(h)
        if d is not None and d.token_ids == tuple(tokens) and d.key == key:
            return CachedBlock(-1, h, d.parent_hash, d.token_ids, key, d.entry_id, parent_entry)
        return super().get(h, tokens, key, parent_entry)  # a block this engine evicted and kept

    def fetch(self, entry: CachedBlock) -> Any:
        d = self.delivered.get(entry.block_hash)
        if d is not None and d.entry_id == entry.entry_id:
            return entry.block_hash, d.parts  # read when admitted: a request matched but not admitted finds it again
        return super().fetch(entry)

    def load(self, payload: Any, block_id: int) -> None:
        if isinstance(payload, tuple):  # a delivery: copied in, then forgotten (one use)
            block_hash, payload = payload
            del self.delivered[block_hash]
        super().load(payload, block_id)


class DecodeEngine(TieredEngine):
    """A ``TieredEngine`` that can take requests handed over (``hand_over``): its tier is a ``KVInbox`` in host
    memory, with room for ``tier_blocks`` evicted blocks (default: ``num_blocks``). Other arguments are the
    ``TieredEngine``'s, except ``tier_dir``: the inbox is in memory."""

    def __init__(self, model, num_blocks: int, block_size: int = 16, max_num_batched_tokens: int = 256, *,
                 tier_blocks: int | None = None, **engine_kwargs):
        for name in ("tier_dir", "direct_io"):
            if engine_kwargs.get(name):
                raise ValueError(f"{name} cannot be set on a DecodeEngine (its KVInbox keeps blocks in memory)")
        super().__init__(model, num_blocks, block_size, max_num_batched_tokens,
                         tier_blocks=num_blocks if tier_blocks is None else tier_blocks, **engine_kwargs)

    def new_store(self, tier_blocks: int, tier_dir, direct_io: bool) -> KVInbox:
        """The tier is a ``KVInbox``: this engine's evicted blocks, and the blocks handed over to it."""
        return KVInbox(self.backend, tier_blocks)


@dataclass(frozen=True)
class Handoff:
    """What a hand-over did: ``request`` (the decode engine's, queued), ``claimed_tokens`` (``c``), ``tokens``
    (the full blocks of ``c`` the decode engine finds ready), ``sent_blocks`` (those copied; the rest it
    already held) and ``bytes`` (what crossed the link)."""

    request: Request
    claimed_tokens: int
    tokens: int
    sent_blocks: int
    bytes: int


def transfer_bytes(engine: Engine, tokens: int) -> int:
    """The bytes that moving ``tokens`` tokens of K/V takes: whole blocks of ``engine``'s pool, every layer's K and V."""
    if not isinstance(engine, Engine) or not isinstance(engine.backend, KVPool):
        raise ValueError(f"engine must be a labkit Engine with a KVPool, got {type(engine).__name__}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
    return blocks_needed(tokens, engine.scheduler.block_size) * engine.backend.bytes_per_block


def _check(prefill: object, request: object, decode: object) -> None:
    if not isinstance(prefill, Engine) or not isinstance(prefill.backend, KVPool) or \
            prefill.backend.k_scales[0] is not None:
        raise ValueError(f"prefill must be a labkit Engine with an unquantized KVPool, got {type(prefill).__name__}")
    if not isinstance(decode, DecodeEngine) or decode is prefill:
        raise ValueError(f"decode must be a labkit.serving.handoff.DecodeEngine other than prefill, "
                         f"got {type(decode).__name__}")
    if (decode.scheduler.cache_key, decode.scheduler.block_size) != (prefill.scheduler.cache_key,
                                                                     prefill.scheduler.block_size):
        raise ValueError("decode must serve the same model object, K/V dtype and block_size as prefill "
                         "(the K/V are copied as they are)")
    if not isinstance(request, Request) or prefill.scheduler.requests.get(request.request_id) is not request:
        raise ValueError("request must be an unfinished request of the prefill engine")
    if prefill.scheduler._step is not None:
        raise ValueError("prefill has a step in flight: its num_computed_tokens counts slots not written yet "
                         "(the claim rule); hand over after postprocess")


def hand_over(prefill: Engine, request: Request, decode: DecodeEngine) -> Handoff:
    """Move ``request`` from ``prefill`` to ``decode`` with the K/V it has really computed (module docstring)."""
    _check(prefill, request, decode)
    sched, bs, key = prefill.scheduler, prefill.scheduler.block_size, prefill.scheduler.cache_key
    prompt, table = request.prompt_token_ids, request.block_table
    held = len(table.block_ids) * bs if table is not None else 0
    claimed = min(request.num_computed_tokens, len(prompt) - 1, held)  # the claim rule: written slots only
    full = claimed // bs
    eos = request.eos_token_id if request.eos_token_id is not None else ()
    moved = decode.make_request(prompt, request.max_new_tokens, eos, request.request_id)  # checked before any change
    cache, inbox = decode.scheduler.prefix_cache, decode.tier
    have = PrefixCache.match(cache, prompt, key).num_cached_blocks  # the decode pool's own blocks (no tier reads)
    hashes = hash_chain(prompt[:full * bs], bs, key, cache.hash_fn)
    src = prefill.backend
    sent = 0
    for i in range(min(have, full), full):
        b = table.block_ids[i]
        parts = [c[b].to(decode.backend.device, copy=True)
                 for layer in range(len(src.k_caches)) for c in (src.k_caches[layer], src.v_caches[layer])]
        before = inbox.received_blocks
        inbox.deliver(hashes[i], hashes[i - 1] if i else None, tuple(prompt[i * bs:(i + 1) * bs]), key, parts)
        sent += inbox.received_blocks - before
    sched.finish(request)  # delay_free: the prefill pool's blocks go back only after the copy
    decode.scheduler.add_request(moved)
    return Handoff(moved, claimed, full * bs, sent, sent * src.bytes_per_block)
