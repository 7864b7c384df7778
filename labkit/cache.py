"""The KV caches that hold tensors: contiguous (chapter 01), paged (chapter 03), prefix-cached (chapter 04).

Chapter 01: a contiguous cache that grows as tokens are processed.

During *prefill* the model processes the whole prompt at once and every layer
stores the prompt's keys and values. During *decode* each step feeds a single
new token: its own K and V are appended first, then its query attends over
everything stored, itself included. Earlier positions never see later tokens (causal attention), so the
stored K and V never change: they can be kept instead of recomputed.

The price is memory: per layer, K and V of shape [batch, seq_len, Hkv, D].

Chapters 03 and 04 store the same K and V in a pool of fixed-size blocks. Their
bookkeeping (which block holds which tokens, which blocks are shared or cached) is
in ``labkit.paging`` and ``labkit.prefix``, free of tensors; the classes here add the
pools and the attention over them. All of them implement the one method
``Decoder.forward`` asks of a cache, ``attend(layer_idx, q, k, v)``:

* ``KVCache``: contiguous per-layer tensors, one batch of equal-length sequences;
* ``KVPool``: every layer's K/V block pools, and paged attention for a pass that the
  caller describes (``meta``); chapter 05's engine drives it with the scheduler's plan;
* ``PagedKVCache``: a ``KVPool`` with a block table per sequence (chapter 03);
* ``PrefixKVCache``: a ``KVPool`` whose blocks a ``PrefixCache`` shares between
  successive requests, one sequence at a time (chapter 04).
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from . import quant
from .checks import check_flag, check_int, check_token_ids, parse_stop_token_ids
from .model import Decoder, DecoderConfig, causal_attention
from .paging import BlockAllocator, BlockTable, OutOfBlocksError, blocks_needed
from .prefix import CacheKey, CachedBlockTable, PrefixCache


class KVCache:
    """Per-layer K and V tensors [batch, seq_len, num_key_value_heads, head_dim], grown by concatenation.

    Implements the one method ``Decoder.forward`` asks of a cache: ``attend``.
    """

    def __init__(self, config: DecoderConfig):
        _check_config(config)
        self.config = config
        self.k: list[torch.Tensor | None] = [None] * config.num_hidden_layers
        self.v: list[torch.Tensor | None] = [None] * config.num_hidden_layers

    @property
    def seq_len(self) -> int:
        """Tokens stored so far (read from the last layer, which is written last)."""
        last = self.k[-1]
        return 0 if last is None else last.shape[1]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append this layer's new K, V; attend ``q`` over every stored position."""
        cfg = self.config
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < cfg.num_hidden_layers:
            raise ValueError(f"layer_idx must be an integer in [0, {cfg.num_hidden_layers - 1}], got {layer_idx!r}")
        expected = (cfg.num_key_value_heads, cfg.head_dim)
        if k.dim() != 4 or tuple(k.shape[2:]) != expected or k.shape != v.shape:
            raise ValueError(f"k and v must be [batch, new, {expected[0]}, {expected[1]}], "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        stored = self.k[layer_idx]
        kv_len = k.shape[1] + (0 if stored is None else stored.shape[1])
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[1] > kv_len \
                or tuple(q.shape[2:]) != (cfg.num_attention_heads, cfg.head_dim):
            raise ValueError(f"q must be [batch, q_len, {cfg.num_attention_heads}, {cfg.head_dim}] with k's batch "
                             f"{k.shape[0]} and q_len <= the {kv_len} positions stored, "
                             f"got {tuple(getattr(q, 'shape', ()))}")
        if stored is not None and stored.shape[0] != k.shape[0]:
            raise ValueError(f"k and v must have the cache's batch size {stored.shape[0]}, got {k.shape[0]}")
        if self.k[layer_idx] is None:
            self.k[layer_idx], self.v[layer_idx] = k, v
        else:
            self.k[layer_idx] = torch.cat([self.k[layer_idx], k], dim=1)
            self.v[layer_idx] = torch.cat([self.v[layer_idx], v], dim=1)
        return causal_attention(q, self.k[layer_idx], self.v[layer_idx])

    @property
    def nbytes(self) -> int:
        """Bytes held by all stored K and V tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


@dataclass
class Generation:
    """Greedy generation: the new tokens and the logits that chose each of them."""

    tokens: list[int]
    logits: torch.Tensor  # [max_new_tokens, vocab_size]
    cache_tokens: int  # positions held in the KV cache at the end (0 without a cache)


@torch.no_grad()
def generate(model: Decoder, prompt_ids: list[int], max_new_tokens: int, use_cache: bool = True,
             eos_token_id: int | Sequence[int] | None = None) -> Generation:
    """Greedy decoding of one sequence.

    With ``use_cache`` the prompt is prefilled once and every later step feeds one
    token. Without it, every step recomputes the whole sequence from scratch: the
    same tokens, at a cost that grows with the square of the length. Generation stops
    after ``max_new_tokens``, or right after a token of ``eos_token_id`` (one id or several;
    None: never early), which is kept in the output as transformers' ``generate`` keeps it.
    """
    _check_model(model)
    check_int("max_new_tokens", max_new_tokens, 1)
    _check_vocab(check_token_ids("prompt_ids", prompt_ids, 1), model.config.vocab_size)
    check_flag("use_cache", use_cache)
    stop = set(parse_stop_token_ids(eos_token_id, vocab_size=model.config.vocab_size))
    device = model.lm_head.weight.device
    cache = KVCache(model.config) if use_cache else None
    tokens = list(prompt_ids)
    feed = tokens  # prefill: the whole prompt
    all_logits = []
    for _ in range(max_new_tokens):
        ids = torch.tensor([feed], device=device)
        logits = model(ids, cache=cache)[0, -1]
        all_logits.append(logits)
        tokens.append(int(logits.argmax()))
        if tokens[-1] in stop:
            break
        feed = tokens[-1:] if use_cache else tokens  # decode: one token, or everything again
    return Generation(tokens[len(prompt_ids):], torch.stack(all_logits), cache.seq_len if cache else 0)


# ----------------------------------------------------------------------------- paged (chapter 03)

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
        width = max(len(row) for row in block_tables)  # shorter rows padded with block 0, never read
        table = torch.tensor([list(row) + [0] * (width - len(row)) for row in block_tables], dtype=torch.int32)
        cu = torch.tensor([0] + list(q_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return cls(torch.tensor(slot_mapping, dtype=torch.int64, device=device), table.to(device),
                   torch.tensor(seq_lens, dtype=torch.int32, device=device), cu.to(device))

    @cached_property
    def decode_only(self) -> bool:
        """Every sequence adds exactly one token (a pure decode step): the decode kernel's case.

        Counting tokens is not enough: ``q_lens`` [2, 0] has as many tokens as sequences.
        Computed once per pass, not once per layer.
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
    PyTorch references instead (same results, much faster than Triton's interpreter on a CPU; decode
    rows in their batched form, ``kernels.paged_decode_attention_batched``, even in a step that
    also runs prompt chunks: ``kernels.paged_attention_batched``).

    ``kv_cache_dtype`` (appendix A3, ``labkit.quant``): "auto" stores K and V in ``dtype``; a scheme
    such as "int8_per_block" stores codes in ``k_caches``/``v_caches`` and float32 scales in
    ``k_scales``/``v_scales`` (one tensor per layer), while ``dtype`` stays the type attention
    computes in. Per-tensor scales start at 1.0 (vLLM's default); ``set_scales`` puts calibrated
    ones in (``quant.calibrate``).
    """

    def __init__(self, config: DecoderConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 use_triton: bool = True, kv_cache_dtype: str = "auto"):
        _check_config(config)
        check_int("num_blocks", num_blocks, 1)
        check_int("block_size", block_size, 1)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
        kq = quant.kv_quant(kv_cache_dtype)
        from .device import DEVICE

        self.config, self.block_size, self.dtype = config, block_size, dtype
        self.device = torch.device(device) if device is not None else DEVICE
        self.use_triton = check_flag("use_triton", use_triton)
        self.kv_cache_dtype, self.kv_quant = kv_cache_dtype, kq
        layers, heads, head_dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        if kq is None:
            shape = (num_blocks, block_size, heads, head_dim)
            self.k_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]
            self.v_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]
            self.k_scales: list[torch.Tensor | None] = [None] * layers
            self.v_scales: list[torch.Tensor | None] = [None] * layers
        else:
            k = [kq.empty_pool(num_blocks, block_size, heads, head_dim, self.device) for _ in range(layers)]
            v = [kq.empty_pool(num_blocks, block_size, heads, head_dim, self.device) for _ in range(layers)]
            self.k_caches, self.k_scales = [d for d, _ in k], [s for _, s in k]
            self.v_caches, self.v_scales = [d for d, _ in v], [s for _, s in v]
        self.meta: AttentionMetadata | None = None  # set before each forward pass

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer, with the scales kept per block or per token.

        Per-tensor scales are not counted here: 8 bytes per layer, whatever the number of blocks.
        """
        k = self.k_caches[0]
        data = 2 * len(self.k_caches) * k[0].numel() * k.element_size()
        if self.kv_quant is None or self.kv_quant.scales == "tensor":
            return data
        return data + 2 * len(self.k_scales) * self.k_scales[0][0].numel() * 4

    def set_scales(self, k_scales: list[float], v_scales: list[float]) -> None:
        """Per-tensor scales, one per layer for K and one for V (vLLM's k_scale, v_scale), e.g. from
        ``quant.calibrate``. Only for a per-tensor scheme; set them before anything is written."""
        if self.kv_quant is None or self.kv_quant.scales != "tensor":
            raise ValueError(f"set_scales is for a per-tensor kv_cache_dtype, this pool is {self.kv_cache_dtype!r}")
        layers = len(self.k_caches)
        for name, values in (("k_scales", k_scales), ("v_scales", v_scales)):
            if not isinstance(values, (list, tuple)) or len(values) != layers or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                    for x in values):
                raise ValueError(f"{name} must be {layers} finite numbers > 0 (one per layer), got {values!r}")
        for layer in range(layers):
            self.k_scales[layer].fill_(float(k_scales[layer]))
            self.v_scales[layer].fill_(float(v_scales[layer]))

    def _kv_args(self, layer_idx: int) -> dict:
        """The cache-format arguments of the kernels for one layer."""
        if self.kv_quant is None:
            return {}
        return dict(kv_cache_dtype=self.kv_cache_dtype, k_scale=self.k_scales[layer_idx],
                    v_scale=self.v_scales[layer_idx])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` gets ``src``'s K and V in every layer, before anything writes."""
        if copies:
            n = self.k_caches[0].shape[0]
            if not all(type(b) is int and 0 <= b < n for pair in copies for b in pair) \
                    or not all(len(pair) == 2 for pair in copies):
                raise ValueError(f"copies must be (src, dst) pairs of block ids in [0, {n - 1}], got {copies!r}")
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            scales = [] if self.kv_quant is None or self.kv_quant.scales == "tensor" else self.k_scales + self.v_scales
            for cache in self.k_caches + self.v_caches + scales:  # a block's scales travel with it
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
        decode = kernels.paged_decode_attention if self.use_triton else kernels.paged_decode_attention_batched
        prefill = kernels.paged_prefill_attention if self.use_triton else kernels.paged_attention_batched
        kc, vc, kw = self.k_caches[layer_idx], self.v_caches[layer_idx], self._kv_args(layer_idx)
        flat = lambda t: t.reshape(-1, *t.shape[2:]).to(self.dtype).contiguous()  # noqa: E731
        write_kv(flat(k), flat(v), kc, vc, meta.slot_mapping, **kw)
        if meta.decode_only:
            out = decode(flat(q), kc, vc, meta.block_tables, meta.seq_lens, **kw)
        else:
            out = prefill(flat(q), kc, vc, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, **kw)
        return out.view(q.shape).to(q.dtype)

    def kernel_backend(self) -> str:
        """What ``attend`` runs on this machine, in words: the Triton kernels (compiled, or in
        Triton's interpreter) or their PyTorch references, and why the references when they run.

        A chapter prints this rather than assuming it: ``use_triton=True`` still runs the
        references where Triton cannot run (``kernels.fallback_reason``), or for a kernel whose
        compiled launch failed on this GPU.
        """
        from . import kernels
        from .device import RUNTIME

        if not self.use_triton:
            return "the kernels' PyTorch references (use_triton=False)"
        why = kernels.fallback_reason(self.dtype, self.device, *(() if self.kv_quant is None else (self.kv_cache_dtype,)))
        if why is not None:
            return f"the kernels' PyTorch references ({why})"
        where = "compiled for the GPU" if RUNTIME.triton_mode == "compiled" else "in Triton's interpreter on the CPU"
        # a quantized pool's launches carry its scheme's name; its prefill runs the plain kernel
        ours = ((lambda k: " " not in k) if self.kv_quant is None else
                (lambda k: k.endswith(f" {self.kv_cache_dtype}") or k == "paged_prefill_attention"))
        failed = sorted(k for k, dtype, head_dim in kernels._failed_launches
                        if dtype == self.dtype and head_dim == self.config.head_dim and ours(k))
        return f"the Triton kernels, {where}" + (f" (the PyTorch reference for {', '.join(failed)}: "
                                                 "its launch failed here)" if failed else "")


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

    def __init__(self, config: DecoderConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 batch_size: int = 1, *, use_triton: bool = True, kv_cache_dtype: str = "auto"):
        check_int("batch_size", batch_size, 0)
        super().__init__(config, num_blocks, block_size, dtype, device, use_triton, kv_cache_dtype)
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
        """Bytes of the whole pool (allocated up front, used or not), with any per-tensor scales."""
        fixed = 0 if self.kv_quant is None or self.kv_quant.scales != "tensor" else 8 * len(self.k_caches)
        return self.bytes_per_block * self.allocator.num_blocks + fixed

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
def generate_paged(model: Decoder, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16,
                   num_blocks: int | None = None, dtype: torch.dtype = torch.float32, *,
                   use_triton: bool = True, kv_cache_dtype: str = "auto",
                   kv_scales: tuple[list[float], list[float]] | None = None) -> list[Generation]:
    """Greedy decoding of several prompts of different lengths on one paged pool.

    Each prompt is prefilled on its own (its blocks come from the shared pool); then all
    sequences decode together, one token each per step, as one batch with ragged lengths.
    By default the pool holds exactly the blocks the prompts and their new tokens need.
    ``kv_cache_dtype`` quantizes the pool (``labkit.quant``); ``kv_scales`` = (K scales, V scales)
    per layer for a per-tensor scheme (``quant.calibrate``), else vLLM's default of 1.0.
    """
    _check_model(model)
    check_int("max_new_tokens", max_new_tokens, 1)
    if isinstance(prompts, (str, bytes)) or not prompts:
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    for prompt in prompts:
        _check_vocab(check_token_ids("prompts", prompt, 1), model.config.vocab_size, "prompts")
    if num_blocks is None:
        num_blocks = sum(blocks_needed(len(p) + max_new_tokens, block_size) for p in prompts)
    device = model.lm_head.weight.device
    cache = PagedKVCache(model.config, num_blocks, block_size, dtype=dtype, device=device, batch_size=0,
                         use_triton=use_triton, kv_cache_dtype=kv_cache_dtype)
    if kv_scales is not None:
        cache.set_scales(*kv_scales)
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


# ----------------------------------------------------------------------------- prefix-cached (chapter 04)

class PrefixKVCache(KVPool):
    """Paged K/V pools for ``labkit.model.Decoder`` whose blocks a ``PrefixCache`` manages, one sequence at a time.

    ``begin`` gives the sequence a block table whose cached prefix is filled already; the model
    runs on the *remaining* tokens only, and ``attend`` writes their K/V and attends over the
    whole sequence (``KVPool.attend``). ``reuse=False`` never names a block: caching turned off.
    """

    def __init__(self, config, num_blocks: int, block_size: int, *, dtype=None, device=None,
                 model_name: str = "teaching-model", reuse: bool = True):
        check_int("block_size", block_size, 1)
        check_flag("reuse", reuse)
        if not isinstance(model_name, str):
            raise ValueError(f"model_name must be a string (it names the weights in every block hash), "
                             f"got {model_name!r}")
        super().__init__(config, num_blocks, block_size, torch.float32 if dtype is None else dtype, device)
        self.reuse = bool(reuse)
        self.model_name = model_name
        self.prefix = PrefixCache(BlockAllocator(num_blocks), block_size)
        self.table: CachedBlockTable | None = None
        self.seq_len = 0  # tokens of the current sequence whose K/V are in the pool

    def key(self, adapter: str | None = None, salt: str | None = None, *, model=None) -> CacheKey:
        """The computation identity of this pool (model, dtype, layout, RoPE base, adapter, salt).

        ``model``: the module whose weights compute the K/V; its identity joins the name, so two
        models never share blocks through one pool.
        """
        name = self.model_name if model is None else f"{self.model_name} (weights #{_weights_id(model)})"
        return CacheKey(model=name, adapter=adapter, cache_dtype=str(self.dtype).replace("torch.", ""),
                        cache_layout="NHD", rope_theta=float(self.config.rope_theta), salt=salt)

    def begin(self, prompt_ids: Sequence[int], key: CacheKey | None = None) -> int:
        """Start a sequence for ``prompt_ids``; return how many prompt tokens are already cached."""
        if self.table is not None:
            raise ValueError("a sequence is running: call end() before begin()")
        self.table, num_cached = self.prefix.allocate(prompt_ids, key or self.key())
        if self.reuse:  # one admission, one lookup: counted as vLLM's scheduler counts it
            self.prefix.stats.record(len(prompt_ids), num_cached)
        self.seq_len = num_cached
        return num_cached

    def extend(self, token_ids: Sequence[int]) -> None:
        """Reserve slots for decode tokens; copy a shared tail block first (copy-on-write)."""
        self.copy_blocks(self.prefix.append(self._running(), token_ids))

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
            slots = table.slots(start, start + num_new)
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
    """One request's greedy output; prompt tokens found in the cache (``num_cached_tokens``) and
    computed (``num_prefill_tokens``); one-token passes after the prefill (``num_decode_steps``)."""

    tokens: list[int]
    logits: torch.Tensor  # [max_new_tokens, vocab_size]
    num_cached_tokens: int
    num_prefill_tokens: int
    num_decode_steps: int


def generate_with_prefix_cache(model, kv: PrefixKVCache, prompt_ids: Sequence[int], max_new_tokens: int,
                               key: CacheKey | None = None) -> PrefixGeneration:
    """Greedy decoding of one request on ``kv``: prefill only the uncached suffix, then decode.

    Reuses blocks named by earlier requests of the same ``model`` on ``kv`` (``key`` defaults to
    ``kv.key(model=model)``) and names its own full blocks for later ones.
    """
    _check_model(model)
    if not isinstance(kv, PrefixKVCache):
        raise ValueError(f"kv must be a labkit.cache.PrefixKVCache, got {type(kv).__name__}")
    check_int("max_new_tokens", max_new_tokens, 1)
    prompt = check_token_ids("prompt_ids", prompt_ids, 1)
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


def _check_config(config: object) -> None:
    if not isinstance(config, DecoderConfig):
        raise ValueError(f"config must be a labkit.model.DecoderConfig, got {type(config).__name__}")


def _check_model(model: object) -> None:
    if not isinstance(model, Decoder):
        raise ValueError(f"model must be a labkit.model.Decoder, got {type(model).__name__}")


def _check_vocab(tokens: tuple[int, ...], vocab_size: int, name: str = "prompt_ids") -> None:
    """Every id must name a row of the embedding table: [0, vocab_size)."""
    if tokens and max(tokens) >= vocab_size:
        bad = next(t for t in tokens if t >= vocab_size)
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size - 1}] (the model's vocab_size is "
                         f"{vocab_size}), found {bad}")
