"""Paged KV memory: a pool of fixed-size blocks and a block table per sequence (chapter 03).

PagedAttention splits each sequence's cache into blocks of ``block_size`` token
slots. Blocks are taken from one fixed pool as a sequence grows and returned when
it ends, so nothing is reserved for tokens that may never come. A sequence's
*block table* maps its logical blocks (token ``i`` lives in logical block
``i // block_size``) to physical blocks anywhere in the pool. The *slot* of a
token is ``block_id * block_size + i % block_size``: the row it occupies when the
pool is viewed as one long array of token slots.

Blocks carry reference counts so that several sequences can share one block
(chapter 04's prefix cache). Freed blocks are reused front first: a block nobody
can find again goes to the front of the free queue, one that carries a prefix-cache
name to the back, so cached blocks are evicted least recently used first (vLLM v1's
``BlockPool.free_blocks``).

``PagedKVCache`` puts it together for the chapter-01 decoder: per layer one K and one
V pool shaped ``[num_blocks, block_size, num_kv_heads, head_dim]``, a block table per
sequence, and ``attend`` (the decoder's cache protocol) built from the Triton kernels
of ``labkit.kernels``: ``write_kv`` stores the new tokens in their slots, then
``paged_prefill_attention`` or ``paged_decode_attention`` reads through the block tables.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch

from .checks import check_int

if TYPE_CHECKING:  # imported lazily at run time: the kernels module loads Triton
    from .cache import Generation
    from .model import Decoder, DecoderConfig


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs. Nothing was allocated."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    check_int("num_tokens", num_tokens, 0)
    check_int("block_size", block_size, 1)
    return -(-num_tokens // block_size)


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
        """The free blocks, lazily, in the order ``allocate`` hands them out.

        Read it before allocating or freeing again: the queue must not change during the walk.
        """
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
        block_ids = list(block_ids)
        drops = Counter(self._check_id(b) for b in block_ids) if len(set(block_ids)) < len(block_ids) else None
        for b in block_ids:
            if self.ref_counts[self._check_id(b)] < (drops[b] if drops else 1):
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
        if not isinstance(position, int) or not 0 <= position < self.num_tokens:
            raise ValueError(f"position must be an integer in [0, {self.num_tokens - 1}], got {position!r}")
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def new_blocks_for(self, n: int) -> int:
        """How many blocks appending ``n`` tokens would allocate."""
        check_int("n", n, 0)
        return -(-(self.num_tokens + n) // self.block_size) - len(self.block_ids)  # ceil, as blocks_needed

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
        """Drop this sequence's reference to each of its blocks, tail first; the table becomes empty."""
        allocator.free_blocks(reversed(self.block_ids))
        self.block_ids, self.num_tokens = [], 0


@dataclass
class AttentionMetadata:
    """The kernels' inputs for one forward pass over a paged pool.

    The pass's new tokens are flattened sequence after sequence: sequence ``i`` owns
    rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``, which are its *last* positions, and
    ``slot_mapping[t]`` is the pool slot where token ``t``'s K and V go.
    """

    slot_mapping: torch.Tensor  # int64 [total_new_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor      # int32 [num_seqs], including the new tokens
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]

    @classmethod
    def build(cls, block_tables: list[list[int]], seq_lens: list[int], q_lens: list[int],
              slot_mapping: list[int], device: torch.device) -> "AttentionMetadata":
        """From plain lists (what a scheduler or a block table produces) to the kernels' tensors."""
        width = max(len(row) for row in block_tables)
        table = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for i, row in enumerate(block_tables):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return cls(torch.tensor(slot_mapping, dtype=torch.int64, device=device), table.to(device),
                   torch.tensor(seq_lens, dtype=torch.int32, device=device), cu.to(device))

    @property
    def decode_only(self) -> bool:
        """Every sequence adds exactly one token (a pure decode step): the decode kernel's case.

        Counting tokens is not enough: ``q_lens`` [2, 0] has as many tokens as sequences.
        """
        q_lens = self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]
        return bool((q_lens == 1).all())


class KVPool:
    """Every layer's K and V block pool, and paged attention over it.

    ``k_caches[layer]`` and ``v_caches[layer]`` are ``[num_blocks, block_size, num_kv_heads,
    head_dim]``: block ids mean the same block in every layer. ``attend`` is the decoder's cache
    protocol for a pass described by ``self.meta``: ``write_kv`` stores the new K and V in their
    slots, then the decode kernel (one new token per sequence) or the prefill kernel (several)
    reads each sequence's blocks. The caches of chapters 03 to 05 differ only in who decides the
    block tables; they all attend through this class. ``use_triton=False`` runs the kernels'
    PyTorch references instead (same results, much faster than Triton's interpreter on a CPU).
    """

    def __init__(self, config: "DecoderConfig", num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 use_triton: bool = True):
        check_int("num_blocks", num_blocks, 1)
        check_int("block_size", block_size, 1)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
        from .device import DEVICE

        self.config, self.block_size, self.dtype = config, block_size, dtype
        self.device = torch.device(device) if device is not None else DEVICE
        self.use_triton = bool(use_triton)
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(config.num_hidden_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(config.num_hidden_layers)]
        self.meta: AttentionMetadata | None = None  # set before each forward pass

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer."""
        k = self.k_caches[0]
        return 2 * len(self.k_caches) * k[0].numel() * k.element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` gets ``src``'s K and V in every layer, before anything writes."""
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            for cache in self.k_caches + self.v_caches:
                cache[dst] = cache[src]

    def _check_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_tokens: int | None) -> None:
        """q [batch, new, Hq, D], k and v [batch, new, Hkv, D], batch x new = ``num_tokens`` (None: not planned)."""
        cfg = self.config
        expected = (cfg.num_key_value_heads, cfg.head_dim)
        if k.dim() != 4 or tuple(k.shape[2:]) != expected or k.shape != v.shape:
            raise ValueError(f"k and v must be [batch, new, {expected[0]}, {expected[1]}], "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        if num_tokens is None or q.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != cfg.head_dim \
                or q.shape[2] != cfg.num_attention_heads or q.shape[0] * q.shape[1] != num_tokens:
            raise ValueError(f"q must be [batch, new, {cfg.num_attention_heads}, {cfg.head_dim}] with batch x new = "
                             f"the {num_tokens or 0} tokens of this pass, got {tuple(q.shape)}")

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [batch, new, Hq, D], k and v [batch, new, Hkv, D], flattened in the order of ``self.meta``."""
        from . import kernels

        meta = self.meta
        self._check_qkv(q, k, v, None if meta is None else meta.slot_mapping.numel())
        write_kv = kernels.write_kv if self.use_triton else kernels.write_kv_ref
        decode = kernels.paged_decode_attention if self.use_triton else kernels.paged_decode_attention_ref
        prefill = kernels.paged_prefill_attention if self.use_triton else kernels.paged_prefill_attention_ref
        kc, vc = self.k_caches[layer_idx], self.v_caches[layer_idx]
        flat = lambda t: t.reshape(-1, *t.shape[2:]).to(self.dtype).contiguous()  # noqa: E731
        write_kv(flat(k), flat(v), kc, vc, meta.slot_mapping)
        if meta.decode_only:
            out = decode(flat(q), kc, vc, meta.block_tables, meta.seq_lens)
        else:
            out = prefill(flat(q), kc, vc, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q)
        return out.view(q.shape).to(q.dtype)


class PagedKVCache(KVPool):
    """A paged KV cache for ``labkit.model.Decoder``: the block pools plus a block table per sequence.

    Sequences are added with ``add_sequence`` and finish with ``free_sequence``; ``select``
    says which of them are the rows of the next ``model(...)`` call (its batch).

    A forward pass calls ``attend`` once per layer. Layer 0 appends the new tokens to the
    selected block tables (all-or-nothing: ``OutOfBlocksError`` leaves everything as it was)
    and builds the pass's slot mapping and block tables; every layer then writes its K/V
    there and attends (``KVPool.attend``).

    ``seq_len`` is the length of the selected sequences when they all have the same length
    (what ``Decoder.forward`` uses for default positions); for a ragged batch pass
    ``positions=cache.positions(num_new)`` to the model.
    """

    def __init__(self, config: "DecoderConfig", num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 batch_size: int = 1):
        check_int("batch_size", batch_size, 0)
        super().__init__(config, num_blocks, block_size, dtype, device)
        self.allocator = BlockAllocator(num_blocks)
        self.tables: dict[int, BlockTable] = {}
        self.active: list[int] = []
        self._next_id = 0
        self._next_layer = 0  # the layer the forward pass in progress reaches next
        self.select([self.add_sequence() for _ in range(batch_size)])

    # -- sequences ---------------------------------------------------------------------------
    def add_sequence(self) -> int:
        """Start an empty sequence (no blocks yet); return its id."""
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self.tables[seq_id] = BlockTable(self.block_size)
        return seq_id

    def free_sequence(self, seq_id: int) -> None:
        """The sequence finished: its blocks go back to the pool."""
        self._check_seq(seq_id)
        self.tables.pop(seq_id).release(self.allocator)
        self.active = [s for s in self.active if s != seq_id]

    def select(self, seq_ids: list[int]) -> None:
        """The sequences that are rows 0, 1, ... of the next forward pass."""
        for seq_id in seq_ids:
            self._check_seq(seq_id)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must not repeat a sequence, got {seq_ids}")
        self.active = list(seq_ids)

    def _check_seq(self, seq_id: object) -> None:
        if seq_id not in self.tables:
            raise ValueError(f"seq_id must be one of the live sequences {sorted(self.tables)}, got {seq_id!r}")

    # -- lengths and positions ---------------------------------------------------------------
    def seq_lens(self) -> list[int]:
        """Tokens stored for each selected sequence."""
        return [self.tables[s].num_tokens for s in self.active]

    @property
    def seq_len(self) -> int:
        """The common length of the selected sequences (``Decoder.forward``'s default start position)."""
        lens = set(self.seq_lens())
        if len(lens) > 1:
            raise ValueError(f"the selected sequences have different lengths {self.seq_lens()}: "
                             "pass positions=cache.positions(num_new) to the model")
        return lens.pop() if lens else 0

    def positions(self, num_new: int) -> torch.Tensor:
        """Positions [batch, num_new] of the next tokens of each selected sequence."""
        check_int("num_new", num_new, 1)
        start = torch.tensor(self.seq_lens(), device=self.device, dtype=torch.long)[:, None]
        return start + torch.arange(num_new, device=self.device)[None, :]

    # -- memory ------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (allocated up front, used or not)."""
        return self.bytes_per_block * self.allocator.num_blocks

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks that sequences hold."""
        return self.bytes_per_block * self.allocator.num_used

    # -- the decoder's cache protocol --------------------------------------------------------
    def _plan(self, batch: int, num_new: int) -> AttentionMetadata:
        """Layer 0 of a forward pass: grow the selected block tables; build the kernels' inputs."""
        if batch != len(self.active):
            raise ValueError(f"the batch has {batch} rows but {len(self.active)} sequences are selected "
                             "(cache.select)")
        tables = [self.tables[s] for s in self.active]
        need = sum(t.new_blocks_for(num_new) for t in tables)
        if need > self.allocator.num_free:  # all-or-nothing across the whole batch
            raise OutOfBlocksError(f"need {need} blocks, only {self.allocator.num_free} of "
                                   f"{self.allocator.num_blocks} are free")
        slots = [slot for t in tables for slot in t.append(num_new, self.allocator)]
        return AttentionMetadata.build([t.block_ids for t in tables], [t.num_tokens for t in tables],
                                       [num_new] * batch, slots, self.device)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this layer's new K, V [batch, new, Hkv, D] into their slots; attend q [batch, new, Hq, D]."""
        cfg = self.config
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < cfg.num_hidden_layers:
            raise ValueError(f"layer_idx must be an integer in [0, {cfg.num_hidden_layers - 1}], got {layer_idx!r}")
        if layer_idx == 0:  # check q, k and v before the block tables grow
            self._check_qkv(q, k, v, k.shape[0] * k.shape[1] if k.dim() == 4 else None)
            self.meta = self._plan(*k.shape[:2])
        elif self.meta is None or layer_idx != self._next_layer:
            raise ValueError(f"layer_idx {layer_idx} came out of order: a forward pass calls layers 0, 1, 2, ...")
        self._next_layer = layer_idx + 1
        return super().attend(layer_idx, q, k, v)


@torch.no_grad()
def generate_paged(model: "Decoder", prompts: list[list[int]], max_new_tokens: int, block_size: int = 16,
                   num_blocks: int | None = None, dtype: torch.dtype = torch.float32) -> list["Generation"]:
    """Greedy decoding of several prompts of different lengths on one paged pool.

    Each prompt is prefilled on its own (its blocks come from the shared pool); then all
    sequences decode together, one token each per step, as one batch with ragged lengths.
    By default the pool holds exactly the blocks the prompts and their new tokens need.
    """
    from .cache import Generation

    check_int("max_new_tokens", max_new_tokens, 1)
    if not prompts or any(len(p) < 1 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    if num_blocks is None:
        num_blocks = sum(blocks_needed(len(p) + max_new_tokens, block_size) for p in prompts)
    device = model.lm_head.weight.device
    cache = PagedKVCache(model.config, num_blocks, block_size, dtype=dtype, device=device, batch_size=0)
    seq_ids = [cache.add_sequence() for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for row, (seq_id, prompt) in enumerate(zip(seq_ids, prompts)):  # prefill, one prompt at a time
        cache.select([seq_id])
        last = model(torch.tensor([prompt], device=device), cache=cache)[0, -1]
        logits[row].append(last)
        tokens[row].append(int(last.argmax()))
    cache.select(seq_ids)
    for _ in range(max_new_tokens - 1):  # decode, the whole batch at once
        feed = torch.tensor([[t[-1]] for t in tokens], device=device)
        step = model(feed, positions=cache.positions(1), cache=cache)[:, -1]
        for row in range(len(prompts)):
            logits[row].append(step[row])
            tokens[row].append(int(step[row].argmax()))
    held = cache.seq_lens()  # positions in the cache at the end, as Generation reports them
    for seq_id in seq_ids:
        cache.free_sequence(seq_id)
    return [Generation(tokens=t, logits=torch.stack(lg), cache_tokens=n) for t, lg, n in zip(tokens, logits, held)]
