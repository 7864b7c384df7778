"""Paged KV memory: a pool of fixed-size blocks and a block table per sequence (chapter 03).

PagedAttention splits each sequence's cache into blocks of ``block_size`` token
slots. Blocks are taken from one fixed pool as a sequence grows and returned when
it ends, so nothing is reserved for tokens that may never come. A sequence's
*block table* maps its logical blocks (token ``i`` lives in logical block
``i // block_size``) to physical blocks anywhere in the pool. The *slot* of a
token is ``block_id * block_size + i % block_size``: the row it occupies when the
pool is viewed as one long array of token slots.

Blocks carry reference counts so that several sequences can share one block
(chapter 04's prefix cache). The free queue is kept in least-recently-freed
order, which chapter 04 uses for LRU eviction of cached blocks.
"""

from __future__ import annotations

from collections import OrderedDict


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs. Nothing was allocated."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    _check_int("num_tokens", num_tokens, 0)
    _check_int("block_size", block_size, 1)
    return -(-num_tokens // block_size)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class BlockAllocator:
    """A fixed pool of ``num_blocks`` physical blocks with O(1) allocate and free.

    Every block has a reference count: 0 when free, else how many block tables hold it.
    """

    def __init__(self, num_blocks: int):
        _check_int("num_blocks", num_blocks, 1)
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Free blocks, least recently freed first. An OrderedDict gives O(1) pop from
        # the front, append at the back and removal from the middle (see ``take``).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def is_free(self, block_id: int) -> bool:
        self._check_id(block_id)
        return block_id in self._free

    def allocate(self) -> int:
        """Take the least recently freed block; its reference count becomes 1."""
        if not self._free:
            raise OutOfBlocksError(f"all {self.num_blocks} blocks are in use")
        block_id, _ = self._free.popitem(last=False)
        self.ref_counts[block_id] = 1
        return block_id

    def allocate_many(self, n: int) -> list[int]:
        """Take ``n`` blocks, or none at all if fewer than ``n`` are free."""
        _check_int("n", n, 0)
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} blocks, only {self.num_free} of {self.num_blocks} are free")
        return [self.allocate() for _ in range(n)]

    def take(self, block_id: int) -> None:
        """Take one specific free block (a prefix-cache hit on a freed, still-cached block)."""
        self._check_id(block_id)
        if block_id not in self._free:
            raise ValueError(f"block_id {block_id} is not free (reference count {self.ref_counts[block_id]})")
        del self._free[block_id]
        self.ref_counts[block_id] = 1

    def incref(self, block_id: int) -> None:
        """One more block table holds ``block_id`` (sharing)."""
        self._check_id(block_id)
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"block_id {block_id} is free: allocate or take it before sharing it")
        self.ref_counts[block_id] += 1

    def free(self, block_id: int) -> bool:
        """Drop one reference; the block returns to the pool when none remain. True if it did."""
        self._check_id(block_id)
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"block_id {block_id} is already free (double free)")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self._free[block_id] = None  # most recently freed: evicted last
            return True
        return False

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id must be an integer in [0, {self.num_blocks - 1}], got {block_id!r}")


class BlockTable:
    """One sequence's logical-to-physical block map and its token count."""

    def __init__(self, block_size: int):
        _check_int("block_size", block_size, 1)
        self.block_size = block_size
        self.block_ids: list[int] = []
        self.num_tokens = 0

    def slot(self, position: int) -> int:
        """The pool slot of the token at ``position``: block_id * block_size + offset."""
        if not isinstance(position, int) or not 0 <= position < self.num_tokens:
            raise ValueError(f"position must be an integer in [0, {self.num_tokens - 1}], got {position!r}")
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def new_blocks_for(self, n: int) -> int:
        """How many blocks appending ``n`` tokens would allocate."""
        _check_int("n", n, 0)
        return blocks_needed(self.num_tokens + n, self.block_size) - len(self.block_ids)

    def append(self, n: int, allocator: BlockAllocator) -> list[int]:
        """Make room for ``n`` more tokens; return their slots (the slot mapping).

        All-or-nothing: when the pool cannot supply the new blocks it raises
        ``OutOfBlocksError`` and this table is unchanged.
        """
        new = allocator.allocate_many(self.new_blocks_for(n))
        self.block_ids.extend(new)
        start = self.num_tokens
        self.num_tokens += n
        return [self.slot(p) for p in range(start, start + n)]

    @property
    def empty_slots(self) -> int:
        """Allocated but unused slots in the last block (the tail waste)."""
        return len(self.block_ids) * self.block_size - self.num_tokens

    def release(self, allocator: BlockAllocator) -> None:
        """Drop this sequence's reference to each of its blocks; the table becomes empty."""
        for block_id in self.block_ids:
            allocator.free(block_id)
        self.block_ids, self.num_tokens = [], 0
