"""The paged KV cache: every layer's K/V in pools of blocks, and attention over them (chapters 03 and 05).

Chapter 03 stores chapter 01's K and V in a pool of fixed-size blocks. The bookkeeping (which block
holds which tokens) is in ``labkit.memory.paging``, free of tensors; the classes here add the pools
and the attention over them, through the one method ``Decoder.forward`` asks of a cache,
``attend(layer_idx, q, k, v)``:

* ``KVPool``: every layer's K/V block pools, and paged attention for a pass that the caller
  describes (``meta``, an ``AttentionMetadata``); chapter 05's engine drives it with the scheduler's plan;
* ``PagedKVCache``: a ``KVPool`` with a block table per sequence (chapter 03), and ``generate_paged``.

Chapter 04's ``PrefixCachedPool`` (``labkit.caches.prefix_cached``) is a third ``KVPool``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..checks import check_flag, check_int, check_token_ids
from ..kernels import cpu, fallback, paged_attention
from ..kernels.device import DEVICE, RUNTIME
from ..memory.blocks import blocks_needed
from ..memory.formats import check_tensor_scales, kv_quant
from ..memory.paging import BlockAllocator, BlockTable, OutOfBlocksError
from ..model.decoder import Decoder, DecoderConfig, check_config, check_decoder, check_vocab
from .contiguous import Generation


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

    def cpu_plan(self, block_size: int, per_kv: int) -> cpu.BatchPlan:
        """The CPU path's plan of this pass (``labkit.kernels.cpu.plan_batch``): made at layer 0, read by every
        layer. ``per_kv``: query heads per KV head."""
        plan = self.__dict__.get("_cpu_plan")
        if plan is None:
            plan = self.__dict__["_cpu_plan"] = cpu.plan_batch(self.block_tables, self.seq_lens, self.cu_seqlens_q,
                                                                block_size, self.slot_mapping, per_kv)
        return plan


class KVPool:
    """Every layer's K and V block pool, and paged attention over it.

    ``k_caches[layer]`` and ``v_caches[layer]`` are ``[num_blocks, block_size, num_kv_heads,
    head_dim]``: block ids mean the same block in every layer. ``attend`` is the decoder's cache
    protocol for a pass described by ``self.meta``: ``write_kv`` stores the new K and V in their
    slots, then the decode kernel (one new token per sequence) or the prefill kernel (several)
    reads each sequence's blocks. The caches of chapters 03 to 05 differ only in who decides the
    block tables; they all attend through this class. ``use_triton``: the Triton kernels (True), or
    the CPU's batched PyTorch path (False: ``labkit.kernels.cpu``, the references' arithmetic, planned
    once per pass and read by every layer, much faster than Triton's interpreter on a CPU). None, the
    default, takes the kernels where they compile (a CUDA GPU) and the batched path elsewhere
    (``RUNTIME.triton_by_default``): Triton's interpreter runs only when asked for.

    ``kv_cache_dtype`` (appendix A3, ``labkit.memory.formats``): "auto" stores K and V in ``dtype``; a scheme
    such as "int8_per_block" stores codes in ``k_caches``/``v_caches`` and float32 scales in
    ``k_scales``/``v_scales`` (one tensor per layer), while ``dtype`` stays the type attention
    computes in. Per-tensor scales start at 1.0 (vLLM's default); ``set_scales`` puts calibrated
    ones in (``labkit.caches.quant_quality.calibrate_kv_scales``).
    """

    def __init__(self, config: DecoderConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 use_triton: bool | None = None, kv_cache_dtype: str = "auto"):
        check_config(config)
        check_int("num_blocks", num_blocks, 1)
        check_int("block_size", block_size, 1)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
        kq = kv_quant(kv_cache_dtype)
        self.config, self.block_size, self.dtype = config, block_size, dtype
        self.device = torch.device(device) if device is not None else DEVICE
        self.use_triton = (RUNTIME.triton_by_default(self.device) if use_triton is None
                           else check_flag("use_triton", use_triton))
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
        ``labkit.caches.quant_quality.calibrate_kv_scales``. Only for a per-tensor scheme; set them before
        anything is written."""
        if self.kv_quant is None or self.kv_quant.scales != "tensor":
            raise ValueError(f"set_scales is for a per-tensor kv_cache_dtype, this pool is {self.kv_cache_dtype!r}")
        layers = len(self.k_caches)
        for name, values in (("k_scales", k_scales), ("v_scales", v_scales)):
            if not isinstance(values, (list, tuple)) or len(values) != layers or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) for x in values):
                raise ValueError(f"{name} must be {layers} finite numbers > 0 (one per layer), got {values!r}")
            check_tensor_scales(self.kv_quant, **{f"{name}[{i}]": x for i, x in enumerate(values)})
        for layer in range(layers):
            self.k_scales[layer].fill_(float(k_scales[layer]))
            self.v_scales[layer].fill_(float(v_scales[layer]))

    def rope_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The positions the model turns q and k to (RoPE) before ``attend``: the tokens' own. A pool whose
        attention turns them itself (``labkit.caches.stepwise.StepwiseKV``) returns zeros instead."""
        return positions

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
        meta = self.meta
        self._check_qkv(q, k, v, None if meta is None else meta.slot_mapping.numel())
        kc, vc, kw = self.k_caches[layer_idx], self.v_caches[layer_idx], self._kv_args(layer_idx)
        shape, dtype, heads = q.shape, q.dtype, q.shape[2:]
        if not self.use_triton:  # the CPU's batched path, planned once per pass
            plan = meta.cpu_plan(self.block_size, self.config.group_size)
            q, k, v = (t if t.dtype == self.dtype else t.to(self.dtype) for t in (q, k, v))  # the pool's dtype
            cpu.write_kv(k, v, kc, vc, plan, **kw)
            q = q.reshape(-1, *heads)
            out = cpu.paged_attention(q, kc, vc, plan, **kw).view(shape)
            return out if out.dtype == dtype else out.to(dtype)
        flat = lambda t: t.reshape(-1, *t.shape[2:]).to(self.dtype).contiguous()  # noqa: E731
        q, k, v = flat(q), flat(k), flat(v)
        paged_attention.write_kv(k, v, kc, vc, meta.slot_mapping, **kw)
        if meta.decode_only:
            out = paged_attention.paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, **kw)
        else:
            out = paged_attention.paged_prefill_attention(q, kc, vc, meta.block_tables, meta.seq_lens,
                                                          meta.cu_seqlens_q, **kw)
        return out.view(shape).to(dtype)

    def kernel_backend(self) -> str:
        """What ``attend`` runs on this machine, in words: the Triton kernels (compiled, or in
        Triton's interpreter) or their PyTorch references, and why the references when they run.

        A chapter prints this rather than assuming it: ``use_triton=True`` still runs the
        references where Triton cannot run (``labkit.kernels.fallback.fallback_reason``), or for a kernel whose
        compiled launch failed on this GPU.
        """
        if not self.use_triton:
            return "the batched PyTorch path of labkit.kernels.cpu"
        why = fallback.fallback_reason(self.dtype, self.device,
                                       *(() if self.kv_quant is None else (self.kv_cache_dtype,)))
        if why is not None:
            return f"the kernels' PyTorch references ({why})"
        where = "compiled for the GPU" if RUNTIME.triton_mode == "compiled" else "in Triton's interpreter on the CPU"
        # a quantized pool's launches carry its scheme's name; its prefill runs the plain kernel
        ours = ((lambda k: " " not in k) if self.kv_quant is None else
                (lambda k: k.endswith(f" {self.kv_cache_dtype}") or k == "paged_prefill_attention"))
        failed = sorted(k for k, dtype, head_dim in fallback.failed_launches
                        if dtype == self.dtype and head_dim == self.config.head_dim and ours(k))
        return f"the Triton kernels, {where}" + (f" (the PyTorch reference for {', '.join(failed)}: "
                                                 "its launch failed here)" if failed else "")


class PagedKVCache(KVPool):
    """A paged KV cache for ``labkit.model.decoder.Decoder``: the block pools plus a block table per sequence.

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
                 batch_size: int = 1, *, use_triton: bool | None = None, kv_cache_dtype: str = "auto"):
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
                   use_triton: bool | None = None, kv_cache_dtype: str = "auto",
                   kv_scales: tuple[list[float], list[float]] | None = None) -> list[Generation]:
    """Greedy decoding of several prompts of different lengths on one paged pool.

    Each prompt is prefilled on its own (its blocks come from the shared pool); then all
    sequences decode together, one token each per step, as one batch with ragged lengths.
    By default the pool holds exactly the blocks the prompts and their new tokens need.
    ``kv_cache_dtype`` quantizes the pool (``labkit.memory.formats``); ``kv_scales`` = (K scales, V scales)
    per layer for a per-tensor scheme (``labkit.caches.quant_quality.calibrate_kv_scales``), else vLLM's
    default of 1.0.
    """
    check_decoder(model)
    check_int("max_new_tokens", max_new_tokens, 1)
    if isinstance(prompts, (str, bytes)) or not prompts:
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    for prompt in prompts:
        check_vocab(check_token_ids("prompts", prompt, 1), model.config.vocab_size, "prompts")
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
