"""Paged KV memory: a pool of fixed-size blocks and a block table per sequence (chapter 03).

PagedAttention splits each sequence's cache into blocks of ``block_size`` token
slots, taken from one fixed pool as the sequence grows and returned when it ends.
A sequence's *block table* maps its logical block ``i // block_size`` to a physical
block anywhere in the pool; the *slot* of token ``i`` is
``block_id * block_size + i % block_size``, its row in the pool seen as one long array.

Blocks carry reference counts so that several sequences can share one (chapter 04).
This module is bookkeeping only, like vLLM's ``KVCacheManager``; the K/V tensors and the
attention over them (``KVPool``, ``PagedKVCache``, ``generate_paged``) are in ``labkit.caches.paged``,
and the arithmetic of block counts in ``labkit.memory.blocks``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Callable, Iterable, Iterator

from ..checks import check_int
from .blocks import blocks_needed


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs. Nothing was allocated."""


class BlockAllocator:
    """A fixed pool of ``num_blocks`` physical blocks with O(1) allocate and free (vLLM's ``BlockPool``).

    Every block has a reference count: 0 when free, else how many block tables hold it.
    A block may also carry a *name* (``names[block_id]``): chapter 04's prefix cache names
    a full block so that later requests can find its K/V. A named block keeps its name while
    it sits free; ``allocate`` hands out the front of the free queue and drops the name of the
    block it hands out (an *eviction*; ``on_evict(block_id, name)`` is told).

    The free queue's order is vLLM v1's (``vllm/v1/core/block_pool.py``, ``BlockPool.free_blocks``,
    vLLM 0.33.0): a freed block without a name goes to the *front*, to be reused first (its K/V
    can never be found again); a named one goes to the *back*, so cached blocks are evicted
    least recently freed first (LRU).
    """

    def __init__(self, num_blocks: int):
        check_int("num_blocks", num_blocks, 1)
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.names: dict[int, object] = {}  # block id -> its name, for named (cached) blocks
        self.on_evict: Callable[[int, object], None] | None = None
        self.num_evictions = 0
        # The free queue, front first. An OrderedDict gives O(1) pop and push at both ends
        # and removal from the middle (``revive``).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def free_block_ids(self) -> Iterator[int]:
        """The free blocks, lazily, in the order ``allocate`` hands them out (do not change the queue meanwhile)."""
        return iter(self._free)

    def is_free(self, block_id: int) -> bool:
        return self._check_id(block_id) in self._free

    def allocate(self) -> int:
        """Take the block at the front of the free queue, dropping its name; its reference count becomes 1."""
        if not self._free:
            raise OutOfBlocksError(f"all {self.num_blocks} blocks are in use")
        block_id, _ = self._free.popitem(last=False)
        self.ref_counts[block_id] = 1
        if block_id in self.names:  # its K/V are about to be overwritten: an eviction
            self.num_evictions += 1
            self.forget(block_id)
        return block_id

    def allocate_many(self, n: int) -> list[int]:
        """Take ``n`` blocks, or none at all if fewer than ``n`` are free."""
        check_int("n", n, 0)
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} blocks, only {self.num_free} of {self.num_blocks} are free")
        return [self.allocate() for _ in range(n)]

    def revive(self, block_id: int) -> None:
        """Take one specific free block, keeping its name (a prefix-cache hit on a freed block)."""
        if self._check_id(block_id) not in self._free:
            raise ValueError(f"block_id {block_id} is not free (reference count {self.ref_counts[block_id]})")
        del self._free[block_id]
        self.ref_counts[block_id] = 1

    def incref(self, block_id: int) -> None:
        """One more block table holds ``block_id`` (sharing)."""
        if self.ref_counts[self._check_id(block_id)] == 0:
            raise ValueError(f"block_id {block_id} is free: allocate or revive it before sharing it")
        self.ref_counts[block_id] += 1

    def free(self, block_id: int) -> bool:
        """Drop one reference; the block returns to the pool when none remain. True if it did."""
        return bool(self.free_blocks([block_id]))

    def free_blocks(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference to each block, in order; returns those that became free.

        Pass a table's blocks tail first (as vLLM does): the unnamed ones go to the front of
        the queue in that order, the named ones to the back in that order, so a prefix's
        leaves are evicted before its root. All-or-nothing: a double free changes nothing.
        """
        block_ids = [self._check_id(b) for b in block_ids]
        for b, drops in Counter(block_ids).items():
            if self.ref_counts[b] < drops:
                raise ValueError(f"block_id {b} is already free (double free)")
        unnamed, named = [], []
        for b in block_ids:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                (named if b in self.names else unnamed).append(b)
        for b in reversed(unnamed):  # to the front, keeping their order
            self._free[b] = None
            self._free.move_to_end(b, last=False)
        for b in named:
            self._free[b] = None
        return unnamed + named

    def forget(self, block_id: int) -> None:
        """Drop ``block_id``'s name (its K/V are being overwritten, or the cache is cleared)."""
        name = self.names.pop(block_id)
        if self.on_evict is not None:
            self.on_evict(block_id, name)

    def _check_id(self, block_id: object) -> int:
        if type(block_id) is not int or not 0 <= block_id < self.num_blocks:  # not bool, not float
            raise ValueError(f"block_id must be an integer in [0, {self.num_blocks - 1}], got {block_id!r}")
        return block_id


class BlockTable:
    """One sequence's logical-to-physical block map and its token count."""

    def __init__(self, block_size: int):
        check_int("block_size", block_size, 1)
        self.block_size = block_size
        self.block_ids: list[int] = []
        self.num_tokens = 0

    def slot(self, position: int) -> int:
        """The pool slot of the token at ``position``: block_id * block_size + offset."""
        if type(position) is not int or not 0 <= position < self.num_tokens:  # not bool, not float
            raise ValueError(f"position must be an integer in [0, {self.num_tokens - 1}], got {position!r}")
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, start: int, stop: int) -> list[int]:
        """The pool slots of positions ``[start, stop)``: the slot mapping of those tokens, block by block.

        ``0 <= start <= stop <= num_tokens``: only positions the table holds have slots.
        """
        start, stop = check_int("start", start, 0), check_int("stop", stop, 0)
        if start > self.num_tokens:
            raise ValueError(f"start must be in [0, num_tokens={self.num_tokens}], got {start}")
        if not start <= stop <= self.num_tokens:
            raise ValueError(f"stop must be in [start={start}, num_tokens={self.num_tokens}], got {stop}")
        bs, out = self.block_size, []
        for i in range(start // bs, blocks_needed(stop, bs)):
            base = self.block_ids[i] * bs
            out.extend(range(base + max(start - i * bs, 0), base + min(stop - i * bs, bs)))
        return out

    def new_blocks_for(self, n: int) -> int:
        """How many blocks appending ``n`` tokens would allocate."""
        return blocks_needed(self.num_tokens + check_int("n", n, 0), self.block_size) - len(self.block_ids)

    def append(self, n: int, allocator: BlockAllocator) -> list[int]:
        """Make room for ``n`` more tokens; return their slots (the slot mapping).

        All-or-nothing: when the pool cannot supply the new blocks it raises
        ``OutOfBlocksError`` and this table is unchanged.
        """
        new = allocator.allocate_many(self.new_blocks_for(n))
        self.block_ids.extend(new)
        start = self.num_tokens
        self.num_tokens += n
        return self.slots(start, self.num_tokens)

    @property
    def empty_slots(self) -> int:
        """Allocated but unused slots in the last block (the tail waste)."""
        return len(self.block_ids) * self.block_size - self.num_tokens

    def release(self, allocator: BlockAllocator) -> None:
        """Drop this sequence's reference to each of its blocks, tail first; the table becomes empty."""
        allocator.free_blocks(reversed(self.block_ids))
        self.block_ids, self.num_tokens = [], 0


def tail_is_shared(table: BlockTable, allocator: BlockAllocator) -> bool:
    """The copy-on-write test: the table's last block is partly filled and another table holds it too.

    The next token written there would change the other table's history, so the writer first
    gets a private copy.
    """
    return bool(table.num_tokens % table.block_size) and allocator.ref_counts[table.block_ids[-1]] > 1
