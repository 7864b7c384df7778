"""Paged attention in Triton, and the plain PyTorch references that define it (chapter 03).

A paged KV cache stores every layer's keys and values in one pool of blocks,
``k_cache`` and ``v_cache`` shaped ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Sequence ``i`` owns the blocks listed in row ``i`` of ``block_tables`` (int32
``[num_seqs, max_blocks_per_seq]``); its token at position ``p`` lives in block
``block_tables[i, p // block_size]`` at offset ``p % block_size``. ``seq_lens``
(int32 ``[num_seqs]``) says how many positions of each sequence are valid.
Entries of a block table past ``ceil(seq_len / block_size)`` are never read.

Three operations work on that layout:

* ``write_kv``: scatter the new tokens' K and V into their slots
  (``slot = block_id * block_size + offset``; slot -1 means "skip this token").
* ``paged_decode_attention``: one new query per sequence attends over all of
  its cached positions. Each Triton program serves one (sequence, KV head) pair and
  all the query heads that share that KV head (GQA), walking the block table
  ``BLOCK_N`` tokens at a time with an online softmax. For long contexts with few
  sequences the walk is split into chunks processed in parallel (flash-decoding,
  "split-K"), and the chunks' partial results are merged by their log-sum-exp.
* ``paged_prefill_attention``: many new queries per sequence (a prompt, a chunk of a
  prompt, or the suffix after a prefix-cache hit), causal, reading earlier positions
  from the paged cache.

Each has a ``*_ref`` twin in plain PyTorch that gathers the blocks into a contiguous
tensor and runs textbook attention. The references are the definition; the tests
prove the kernels against them. The public functions check their arguments, then
run the Triton kernel, or the reference when Triton cannot run here
(``fallback_reason`` says why) or when a compiled kernel fails to compile or launch on
this GPU; either way a RuntimeWarning says so, once per reason. In the interpreter a
failing kernel is a bug and raises. Index tensors (``block_tables``, ``seq_lens``,
``cu_seqlens_q``, ``slot_mapping``) may be strided views: the wrappers hand the kernels
dense copies. The caches must be dense in head_dim; other strides are fine.

Paging changes *where* K and V live, not what attention computes: no element is
compressed and no position is skipped.

A pool may also hold fewer bytes per element (appendix A3, ``labkit.quant``): with
``kv_cache_dtype`` set to a scheme such as ``"int8_per_block"``, ``k_cache``/``v_cache`` hold
codes (fp8, int8, or two int4 codes per byte) and ``k_scale``/``v_scale`` their float32 scales.
``write_kv`` quantizes as it writes; the decode kernel loads the codes and multiplies them by
their scales in registers, before the dot products; prefill, compute-bound, dequantizes the
blocks it reads into a scratch pool and runs the 16/32-bit kernel. Triton compiles fp8 (e4m3)
only from compute capability 8.9: on older GPUs ``fallback_reason`` says so and the PyTorch
reference runs.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F

from . import quant
from .checks import check_int
from .device import RUNTIME
from .model import causal_attention
from .quant import KVQuant, kv_quant

try:  # Triton is optional: without it every public function uses its reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
T = TypeVar("T")
LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); exp2 is the cheaper instruction on a GPU


# ----------------------------------------------------------------------------------------------
# The references: plain PyTorch, the definition of what the kernels compute
# ----------------------------------------------------------------------------------------------

def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's K (or V) as a contiguous tensor [seq_len, num_kv_heads, head_dim].

    Take the sequence's first ceil(seq_len / block_size) blocks in block-table order,
    lay them end to end, and cut after ``seq_len`` tokens: the empty tail of the
    last block is dropped.
    """
    block_size = cache.shape[1]
    n_blocks = -(-int(seq_len) // block_size)
    blocks = cache[block_table[:n_blocks].long()]  # [n_blocks, block_size, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[: int(seq_len)]


def _attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last q_len positions; q [q_len, Hq, D], k/v [kv_len, Hkv, D].

    The same textbook attention the chapter-01 decoder uses, for one sequence.
    """
    return causal_attention(q[None], k[None], v[None], scale)[0]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (the tests' reference); everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dequantize_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                      kv_cache_dtype: str, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks the sequences read, dequantized into a small pool of ``dtype``, and the block
    tables renumbered for it: quantized pools in, what the 16/32-bit references and kernels read out.

    Only the first ceil(seq_len / block_size) entries of each table are read (and renumbered);
    the rest point at block 0 of the small pool and stay unread.
    """
    kq = kv_quant(kv_cache_dtype)
    num_blocks, block_size = k_cache.shape[:2]
    width = -(-int(seq_lens.max()) // block_size) if seq_lens.numel() else 1
    used = torch.arange(width, device=seq_lens.device)[None, :] < (-(-seq_lens.long() // block_size))[:, None]
    table = block_tables[:, :width].long().clamp(0, num_blocks - 1)
    ids = table[used].unique()
    renumber = torch.zeros(num_blocks, dtype=torch.long, device=table.device)
    renumber[ids] = torch.arange(len(ids), device=table.device)
    tables = torch.where(used, renumber[table], 0).to(torch.int32)
    pick = (lambda s: s) if kq.scales == "tensor" else (lambda s: s[ids])
    return (quant.dequantize_pool(k_cache[ids], pick(k_scale), kq, dtype),
            quant.dequantize_pool(v_cache[ids], pick(v_scale), kq, dtype), tables)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float | None = None, *, kv_cache_dtype: str = "auto",
                               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference decode attention: gather each sequence's K/V, then plain attention.

    q [num_seqs, num_heads, head_dim] -> out of the same shape and dtype. Computes in
    float32 (float64 for float64 inputs). A quantized pool (``kv_cache_dtype``, see
    ``labkit.quant``) is dequantized first, in that same precision: dequantize, then attend.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ct = _compute_dtype(q.dtype)
    if kv_cache_dtype != "auto":
        k_cache, v_cache, block_tables = dequantize_blocks(k_cache, v_cache, k_scale, v_scale, kv_cache_dtype,
                                                           block_tables, seq_lens, ct)
    out = torch.empty_like(q)
    for i, n in enumerate(seq_lens.tolist()):
        k = gather_kv(k_cache, block_tables[i], n).to(ct)
        v = gather_kv(v_cache, block_tables[i], n).to(ct)
        out[i] = _attention_ref(q[i : i + 1].to(ct), k, v, scale)[0].to(q.dtype)
    return out


def token_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Every sequence's slots, position by position: int64 [num_seqs, width * block_size].

    Position ``p`` of sequence ``i`` lives in slot ``block_tables[i, p // block_size] * block_size
    + p % block_size`` (chapter 03's slot mapping, read backwards). Positions at or past
    ``seq_lens[i]`` (a block's empty tail, or a shorter sequence's padding) point at the
    sequence's first slot instead: real, finite data that the attention mask then hides, so
    a pool whose free slots hold NaN can never leak into a result (0 x NaN is NaN).
    """
    width = -(-int(seq_lens.max()) // block_size) if seq_lens.numel() else 1  # blocks of the longest
    pos = torch.arange(width * block_size, device=block_tables.device)
    table = block_tables[:, :width].long()
    slots = table[:, pos // block_size] * block_size + pos % block_size
    return torch.where(pos[None, :] < seq_lens[:, None].long(), slots, slots[:, :1])


def paged_decode_attention_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                   scale: float | None = None, *, kv_cache_dtype: str = "auto",
                                   k_scale: torch.Tensor | None = None,
                                   v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention in a handful of PyTorch operations for the whole batch: the CPU's fast path.

    The reference above loops over sequences, a dozen small operations each, for every layer;
    on a CPU that loop, not the arithmetic, dominates a decode step of a real model. Here the
    pool is seen as one row per slot (``[num_blocks * block_size, Hkv, D]``), every sequence's
    slots are read in one ``index_select`` (``token_slots``), padded to the longest sequence,
    and one ``scaled_dot_product_attention`` call attends with a mask that hides the padding,
    GQA included (``enable_gqa``: query head ``h`` reads KV head ``h // group``). It is what
    transformers does on a CPU, with the gather in place of its contiguous cache. The same
    arithmetic as the reference; ``tests/test_kernels.py`` checks it against the reference on
    ragged lengths, shuffled block tables and a NaN-poisoned pool. A quantized pool is
    dequantized first (``dequantize_blocks``), in q's dtype, as the kernels see it.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ct = _compute_dtype(q.dtype)
    if kv_cache_dtype != "auto":
        k_cache, v_cache, block_tables = dequantize_blocks(k_cache, v_cache, k_scale, v_scale, kv_cache_dtype,
                                                           block_tables, seq_lens, q.dtype)
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    slots = token_slots(block_tables.clamp(0, num_blocks - 1), seq_lens.to(q.device), block_size)
    k = k_cache.reshape(-1, num_kv_heads, head_dim).index_select(0, slots.view(-1))  # one row per slot
    v = v_cache.reshape(-1, num_kv_heads, head_dim).index_select(0, slots.view(-1))
    k = k.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2).to(ct)  # [seqs, Hkv, positions, D]
    v = v.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2).to(ct)
    visible = torch.arange(slots.shape[1], device=q.device)[None, :] < seq_lens.to(q.device)[:, None].long()
    out = F.scaled_dot_product_attention(q.to(ct)[:, :, None, :], k, v, attn_mask=visible[:, None, None, :],
                                         scale=scale, enable_gqa=True)  # [seqs, Hq, 1, D]
    return out[:, :, 0, :].to(q.dtype)


def paged_attention_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            scale: float | None = None, **kv_args) -> torch.Tensor:
    """A mixed step on the CPU: the decode rows in one batched call, each prompt chunk on its own.

    The arguments of ``paged_prefill_attention_ref``. With continuous batching many steps are
    mixed: a request that finished frees a slot, a waiting one is admitted, and its prompt
    chunk runs beside fifteen single decode tokens. Sending all sixteen sequences through the
    per-sequence loop would make such a step several times a decode step; here the sequences
    with one new token go through ``paged_decode_attention_batched`` together, and only the
    chunks of more than one token through the reference, one sequence at a time.
    """
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    single = q_lens == 1
    out = torch.empty_like(q)
    if bool(single.any()):
        rows = cu_seqlens_q[:-1][single].long()
        out[rows] = paged_decode_attention_batched(q[rows], k_cache, v_cache, block_tables[single],
                                                   seq_lens[single], scale, **kv_args)
    cu = cu_seqlens_q.tolist()
    for i in (q_lens > 1).nonzero().flatten().tolist():
        lo, hi = cu[i], cu[i + 1]
        out[lo:hi] = paged_prefill_attention_ref(q[lo:hi], k_cache, v_cache, block_tables[i:i + 1], seq_lens[i:i + 1],
                                                 cu_seqlens_q.new_tensor([0, hi - lo]), scale, **kv_args)
    return out


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, scale: float | None = None, *,
                                kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference prefill attention over a paged cache, variable-length and causal.

    q [total_query_tokens, num_heads, head_dim]: sequence i owns rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``, which are its *last* q_len positions, so
    query j sits at position ``seq_lens[i] - q_len + j`` and sees keys up to it.
    Their K/V must already be in the cache (``write_kv`` first). A quantized pool is dequantized
    first, as in ``paged_decode_attention_ref``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ct = _compute_dtype(q.dtype)
    if kv_cache_dtype != "auto" and seq_lens.numel():
        k_cache, v_cache, block_tables = dequantize_blocks(k_cache, v_cache, k_scale, v_scale, kv_cache_dtype,
                                                           block_tables, seq_lens, ct)
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for i, n in enumerate(seq_lens.tolist()):
        lo, hi = cu[i], cu[i + 1]
        if hi == lo:
            continue
        k = gather_kv(k_cache, block_tables[i], n).to(ct)
        v = gather_kv(v_cache, block_tables[i], n).to(ct)
        out[lo:hi] = _attention_ref(q[lo:hi].to(ct), k, v, scale).to(q.dtype)
    return out


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, *, kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """Reference scatter, in place: token t goes to block ``slot // block_size``, offset ``slot % block_size``.

    Tokens whose slot is -1 are skipped (padding, or positions a prefix cache already holds).
    A quantized pool is written by ``labkit.quant.write_quantized`` (codes and scales).
    """
    if kv_cache_dtype != "auto":
        kq = kv_quant(kv_cache_dtype)
        quant.write_quantized(k, k_cache, k_scale, slot_mapping, kq)
        quant.write_quantized(v, v_cache, v_scale, slot_mapping, kq)
        return
    keep = slot_mapping >= 0  # seen as one row per slot, the pool takes each token at its slot
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


# ----------------------------------------------------------------------------------------------
# When can the kernels run?
# ----------------------------------------------------------------------------------------------

FP8_CAPABILITY = (8, 9)  # Triton's float8e4nv (e4m3) compiles from Ada (L4, RTX 40) and Hopper on


def kv_format_reason(kv_cache_dtype: str, capability: tuple[int, int] | None) -> str | None:
    """None when the kernels can read and write ``kv_cache_dtype`` on a GPU of ``capability``
    (None: the interpreter); else why not, naming the fallback.

    Triton compiles e4m3 conversions (``cvt.rn.f16x2.e4m3x2`` and back) only for compute
    capability 8.9 and up; for sm75 to sm86 it refuses ("type fp8e4nv not supported in this
    architecture"). int8 and int4 codes are plain integers and compile everywhere.
    """
    kq = kv_quant(kv_cache_dtype)
    if kq is None or kq.element != "fp8" or capability is None or capability >= FP8_CAPABILITY:
        return None
    return (f"{kv_cache_dtype}: Triton compiles fp8 (e4m3) only from compute capability "
            f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}, this GPU is {capability[0]}.{capability[1]}; the PyTorch "
            "reference (dequantize, then attend) runs instead")


def fallback_reason(dtype: torch.dtype, device: torch.device | str, kv_cache_dtype: str = "auto") -> str | None:
    """None when the Triton kernels run for this dtype, device and cache format; else why the reference runs."""
    device = torch.device(device)
    if triton is None:
        return "Triton is not installed"
    if not RUNTIME.kernels_can_run(dtype):
        return f"{dtype} kernels cannot run here: {RUNTIME.reason}"
    why = kv_format_reason(kv_cache_dtype, RUNTIME.capability if RUNTIME.triton_mode == "compiled" else None)
    if why is not None:
        return why
    if RUNTIME.triton_mode == "interpreter" and device.type != "cpu":
        return f"Triton's interpreter runs on CPU tensors, these are on {device}"
    if RUNTIME.triton_mode == "compiled" and device.type != "cuda":
        return f"compiled Triton kernels need CUDA tensors, these are on {device}"
    return None


_warned: set[str] = set()
# Kernels that failed to compile or launch on this GPU, keyed by (kernel, dtype, head_dim): not retried.
_failed_launches: dict[tuple[str, torch.dtype, int], str] = {}


def _warn_once(reason: str, stacklevel: int = 4) -> None:
    """Say once per distinct reason that the reference runs instead of Triton."""
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"labkit.kernels runs its PyTorch reference instead of Triton: {reason}",
                      RuntimeWarning, stacklevel=stacklevel)


def _use_reference(dtype: torch.dtype, device: torch.device | str, kv_cache_dtype: str = "auto") -> bool:
    """True when the reference must run instead of Triton; says why, once per reason."""
    reason = fallback_reason(dtype, device, *(() if kv_cache_dtype == "auto" else (kv_cache_dtype,)))
    if reason is not None:
        _warn_once(reason)
    return reason is not None


def _interpreted() -> bool:
    return RUNTIME.triton_mode == "interpreter"


def _launch_or_reference(kernel: str, dtype: torch.dtype, head_dim: int,
                         launch: Callable[[], T], reference: Callable[[], T]) -> T:
    """Run ``launch`` (a Triton launch); on a GPU, fall back to ``reference`` if it cannot compile or launch.

    A compiled Triton may not support every GPU or dtype (an old architecture, bf16 on a
    new one before the compiler learns it). Then the first launch raises, we warn once,
    naming the error, and this (kernel, dtype, head_dim) uses the PyTorch reference from
    then on. In the interpreter there is no such excuse: a failure there is a bug in the
    kernel or its arguments, and it propagates.
    """
    key = (kernel, dtype, head_dim)
    if _interpreted():
        return launch()
    if key not in _failed_launches:
        try:
            return launch()
        except Exception as err:  # noqa: BLE001 - any compiler or driver error: the reference still works
            _failed_launches[key] = f"{type(err).__name__}: {err}"
    _warn_once(f"the {kernel} kernel failed to compile or launch for {dtype}, head_dim {head_dim} "
               f"({_failed_launches[key]})")
    return reference()


# ----------------------------------------------------------------------------------------------
# Argument checks: ValueError naming the argument, before anything runs
# ----------------------------------------------------------------------------------------------

def _check_tensor(name: str, t: object, dim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    return t


def _check_caches(k_cache: object, v_cache: object, like: str, ref: torch.Tensor) -> None:
    """The two pools: same shape and strides, ``ref``'s dtype and device, head_dim contiguous.

    ``like`` names the tensor the caches must agree with (q for attention, k for write_kv).
    Only the last dimension must be dense: the kernels address blocks, slots and heads
    through strides, so a pool that is a view into a larger buffer works.
    """
    _check_tensor("k_cache", k_cache, 4, SUPPORTED_DTYPES)
    _check_tensor("v_cache", v_cache, 4, SUPPORTED_DTYPES)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    _check_pair_layout("k_cache", k_cache, "v_cache", v_cache, like, ref)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != ref.dtype:
            raise ValueError(f"{name} dtype ({t.dtype}) must equal {like}'s dtype ({ref.dtype})")
    if not 1 <= k_cache.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"k_cache head_dim must be in [1, {MAX_HEAD_DIM}], got {k_cache.shape[3]}")


def _check_device(name: str, t: torch.Tensor, like: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {like}'s device ({ref.device}), got {t.device}")


def _dense(t: torch.Tensor) -> torch.Tensor:
    """Index tensors (block_tables, seq_lens, cu_seqlens_q, slot_mapping) as the kernels read them.

    The kernels find entry i of an index vector at ``ptr + i`` and entry (s, j) of a block
    table at ``ptr + s * stride(0) + j``: a strided view such as ``block_tables[:, ::2]``
    would be read wrongly. These tensors are tiny, so a dense copy (a no-op when already
    dense) is cheaper than a kernel that handles every stride.
    """
    return t.contiguous()


def _check_scale(scale: object) -> None:
    if scale is not None and (isinstance(scale, bool) or
                              not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0)):
        raise ValueError(f"scale must be None or a finite number > 0, got {scale!r}")


def _check_out(out: object, q: torch.Tensor) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        got = f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}"
        raise ValueError(f"out must be None or a tensor shaped like q {tuple(q.shape)} with dtype {q.dtype} on "
                         f"{q.device}, got {got}")
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous in head_dim (stride 1 in its last dimension)")


def _check_kv_format(kv_cache_dtype: object, k_cache: object, v_cache: object, k_scale: object, v_scale: object,
                     head_dim: int, like: str, ref: torch.Tensor) -> KVQuant | None:
    """The pools and scales of ``kv_cache_dtype`` (``labkit.quant``); returns its scheme (None for "auto").

    "auto": k_cache and v_cache hold ``ref``'s dtype, and there are no scales. A quantized scheme:
    the pools hold its codes, [num_blocks, block_size, num_kv_heads, head_dim] (head_dim / 2 bytes
    for int4, so head_dim must be even), and k_scale/v_scale are float32 tensors of the scheme's
    scale shape, on ``ref``'s device, alike in shape and strides, dense in their last dimension.
    """
    kq = kv_quant(kv_cache_dtype)
    if kq is None:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale and v_scale must be None when kv_cache_dtype is 'auto' (no quantization)")
        _check_caches(k_cache, v_cache, like, ref)
        if k_cache.shape[3] != head_dim:
            raise ValueError(f"{like} head_dim must equal k_cache head_dim {k_cache.shape[3]}, got {head_dim}")
        return None
    kq.check_head_dim(head_dim)
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    _check_tensor("k_cache", k_cache, 4, (kq.storage_dtype,))
    _check_tensor("v_cache", v_cache, 4, (kq.storage_dtype,))
    expected = kq.storage_shape(k_cache.shape[0], k_cache.shape[1], k_cache.shape[2], head_dim)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, {expected[3]}] for "
                             f"{kq.name} with head_dim {head_dim}, got {tuple(t.shape)}")
    _check_pair_layout("k_cache", k_cache, "v_cache", v_cache, like, ref)
    want = kq.scale_shape(k_cache.shape[0], k_cache.shape[1], k_cache.shape[2], head_dim)
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != want:
            got = f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
            raise ValueError(f"{name} must be a float32 tensor of shape {want} for {kq.name} (scales per "
                             f"{kq.scales}), got {got}")
    _check_pair_layout("k_scale", k_scale, "v_scale", v_scale, like, ref, last_dim="its last dimension")
    return kq


def _check_pair_layout(k_name: str, k: torch.Tensor, v_name: str, v: torch.Tensor, like: str, ref: torch.Tensor,
                       last_dim: str = "head_dim") -> None:
    """K's and V's tensors (pools of codes, or their scales): one set of strides, since the kernels index
    both with the same offsets; on ``like``'s device; dense in their last dimension."""
    if v.stride() != k.stride():
        raise ValueError(f"{v_name} must have the strides of {k_name} {k.stride()}, got {v.stride()}")
    for name, t in ((k_name, k), (v_name, v)):
        if t.device != ref.device:
            raise ValueError(f"{name} must be on {like}'s device ({ref.device}), got {t.device}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in {last_dim} (stride 1), got strides {t.stride()}")


def _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, num_seqs: int, kv_cache_dtype: str = "auto",
                          k_scale=None, v_scale=None) -> KVQuant | None:
    """Shared checks of the two attention functions; ``q`` already checked for dim and dtype.
    Returns the cache's quantization scheme (None for a 16/32-bit pool)."""
    kq = _check_kv_format(kv_cache_dtype, k_cache, v_cache, k_scale, v_scale, q.shape[-1], "q", q)
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if q.shape[-2] % num_kv_heads:
        raise ValueError(f"q num_heads ({q.shape[-2]}) must be a multiple of num_kv_heads ({num_kv_heads})")
    _check_tensor("block_tables", block_tables, 2, (torch.int32,))
    _check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    _check_device("block_tables", block_tables, "q", q)
    _check_device("seq_lens", seq_lens, "q", q)
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(f"block_tables and seq_lens must have num_seqs={num_seqs} rows, got "
                         f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    if num_seqs == 0:
        return kq
    capacity = block_tables.shape[1] * block_size
    lens = seq_lens.long()
    if int(lens.min()) < 1 or int(lens.max()) > capacity:
        raise ValueError(f"seq_lens must lie in [1, {capacity}] (max_blocks_per_seq {block_tables.shape[1]} x "
                         f"block_size {block_size}), got {seq_lens.tolist()}")
    # Only the blocks a sequence uses must be valid ids; later entries (padding) are never read.
    used = torch.arange(block_tables.shape[1], device=q.device)[None, :] < (-(-lens // block_size))[:, None]
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables entries in use must be block ids in [0, {num_blocks - 1}], got "
                         f"{int(ids.min())}..{int(ids.max())}")
    return kq


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

# How a kernel reads the pool (KV_FORMAT) and where its scales live (SCALES): tl.constexpr codes.
KV_FORMATS = {None: 0, "fp8": 1, "int8": 2, "int4": 3}
SCALE_KINDS = {"tensor": 0, "block": 1, "group": 2}


def _format_constexprs(kq: KVQuant | None) -> dict:
    """The quantization constexprs of the attention kernels (a 16/32-bit pool: KV_FORMAT 0)."""
    if kq is None:
        return dict(KV_FORMAT=0, SCALES=0, GROUP_SIZE=quant.GROUP_SIZE)
    return dict(KV_FORMAT=KV_FORMATS[kq.element], SCALES=SCALE_KINDS[kq.scales], GROUP_SIZE=kq.group_size)


if triton is not None:

    @triton.jit
    def _round_half_even(x):
        """Nearest integer, ties to the even one, as torch.round: floor, then one up past one half."""
        r = tl.floor(x)
        f = x - r
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)

    @triton.jit
    def _load_dequantized(cache_ptr, scale_ptr, block_id, offset, kv_head, valid, head_dim,
                          stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          KV_FORMAT: tl.constexpr, SCALES: tl.constexpr, GROUP_SIZE: tl.constexpr):
        """K or V of BLOCK_N positions as float32 [BLOCK_N, BLOCK_D]: load the codes, times their scales.

        ``block_id`` and ``offset`` [BLOCK_N] locate each position; masked positions read code 0 and
        scale 0 (the caller masks them again). Every load is of consecutive addresses. int4: a row's
        BLOCK_D / 2 bytes, each split into its low nibble (element 2i) and high one (2i + 1), stored
        as code + 8, then interleaved back (``tl.join``). Group scales: BLOCK_D / GROUP_SIZE per row,
        each widened over its group.
        """
        row = block_id.to(tl.int64) * stride_cb + offset * stride_cs + kv_head * stride_ch
        if KV_FORMAT == 3:
            i = tl.arange(0, BLOCK_D // 2)
            mask = valid[:, None] & (i < head_dim // 2)[None, :]
            byte = tl.load(cache_ptr + row[:, None] + i[None, :], mask=mask, other=8).to(tl.int32)
            x = tl.reshape(tl.join((byte & 15) - 8, (byte >> 4) - 8), [BLOCK_N, BLOCK_D]).to(tl.float32)
        else:
            d = tl.arange(0, BLOCK_D)
            mask = valid[:, None] & (d < head_dim)[None, :]
            if KV_FORMAT == 1:
                x = tl.load(cache_ptr + row[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(cache_ptr + row[:, None] + d[None, :], mask=mask, other=0).to(tl.float32)
        if SCALES == 0:  # one scale for the whole layer
            x = x * tl.load(scale_ptr)
        elif SCALES == 1:  # one per (block, KV head)
            s = tl.load(scale_ptr + block_id.to(tl.int64) * stride_sb + kv_head * stride_sh, mask=valid, other=0.0)
            x = x * s[:, None]
        else:  # one per group of GROUP_SIZE elements of each position
            NUM_G: tl.constexpr = BLOCK_D // GROUP_SIZE if BLOCK_D > GROUP_SIZE else 1
            g = tl.arange(0, NUM_G)
            srow = block_id.to(tl.int64) * stride_sb + offset * stride_ss + kv_head * stride_sh
            s = tl.load(scale_ptr + srow[:, None] + g[None, :], mask=valid[:, None] & (g * GROUP_SIZE < head_dim)[None, :],
                        other=0.0)
            x = x * tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, NUM_G, BLOCK_D // NUM_G]), [BLOCK_N, BLOCK_D])
        return x

    @triton.jit
    def _round_to_e4m3(y):
        """|y| <= 448 rounded to the nearest fp8 e4m3 number, ties to even, still as float32.

        e4m3 keeps 3 mantissa bits, so between 2^e and 2^(e+1) its numbers are 2^(e-3) apart; below
        2^-6 (subnormal) they are 2^-9 apart. Read e from y's float32 bits, divide by the step (a
        power of two: exact), round, multiply back. The cast to float8e4nv that follows is then
        exact: Triton's interpreter rounds that cast wrongly when the rounding carries into the
        exponent (31.4 became 16, not 32), and a GPU rounds it as this does.
        """
        exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 255) - 127
        step = (((tl.maximum(exponent, -6) - 3) + 127) << 23).to(tl.float32, bitcast=True)
        return _round_half_even(y / step) * step

    @triton.jit
    def _encode(y, KV_FORMAT: tl.constexpr):
        """Values already divided by their scale and clamped to ±qmax, as fp8 or int8 codes."""
        if KV_FORMAT == 1:
            code = _round_to_e4m3(y).to(tl.float8e4nv)
        else:
            code = _round_half_even(y).to(tl.int8)
        return code  # one return: a compiled jit function must return one type

    @triton.jit
    def _load_values(x_ptr, order_ptr, start, j, j_mask, head, stride_xt, stride_xh, e, e_mask,
                     STEP: tl.constexpr, FIRST: tl.constexpr):
        """New K or V rows [BLOCK_R, BLOCK_E] as float32: run row j is token order[start + j]; lane e
        holds element STEP * e + FIRST (int4: even elements, then odd ones)."""
        token = tl.load(order_ptr + start + j, mask=j_mask, other=0).to(tl.int64)
        ptr = x_ptr + token[:, None] * stride_xt + head * stride_xh + (STEP * e + FIRST)[None, :]
        return tl.load(ptr, mask=j_mask[:, None] & e_mask[None, :], other=0.0).to(tl.float32)

    @triton.jit
    def _group_scales(a, QMAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, LANES: tl.constexpr):
        """Per-row scales of every LANES consecutive lanes of |values| ``a`` [BLOCK_R, BLOCK_E]: the group's
        max over qmax, as [BLOCK_R, BLOCK_E // LANES] and broadcast back to [BLOCK_R, BLOCK_E]."""
        g = tl.max(tl.reshape(a, [BLOCK_R, BLOCK_E // LANES, LANES]), axis=2) / QMAX
        wide = tl.reshape(tl.broadcast_to(g[:, :, None], [BLOCK_R, BLOCK_E // LANES, LANES]), [BLOCK_R, BLOCK_E])
        return g, wide

    @triton.jit
    def _write_kv_quant_kernel(
        x_ptr, cache_ptr, scale_ptr, order_ptr, runs_ptr,
        stride_xt, stride_xh,
        stride_cb, stride_cs, stride_ch,
        stride_sb, stride_ss, stride_sh,
        head_dim,
        QMAX: tl.constexpr, KV_FORMAT: tl.constexpr, SCALES: tl.constexpr, GROUP_SIZE: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    ):
        """One program per (run, KV head): quantize the new tokens of one run into one block of one pool.

        A run (a row of ``runs``: block id, first offset, start in ``order``, count) is the new
        tokens that land in consecutive slots of one block; row j of the run is token
        ``order[start + j]`` going to offset ``first + j``. Rows are handled BLOCK_R at a time;
        each lane of a row is one element (int4: one byte, i.e. elements 2e and 2e + 1).

        Per tensor: divide by the layer's fixed scale, clamp, round. Per group: each row's scales
        from its own values, stored beside it. Per block: first the new rows' max |x|; the block's
        scale becomes max(old, that / qmax), where the old one counts only when ``first`` > 0;
        the block's earlier rows are decoded with the old scale and encoded again with the new.
        """
        run = tl.program_id(0)
        head = tl.program_id(1)
        block_id = tl.load(runs_ptr + run * 4).to(tl.int64)
        first = tl.load(runs_ptr + run * 4 + 1)
        start = tl.load(runs_ptr + run * 4 + 2)
        count = tl.load(runs_ptr + run * 4 + 3)
        STEP: tl.constexpr = 2 if KV_FORMAT == 3 else 1  # elements per lane
        LANES: tl.constexpr = GROUP_SIZE // STEP  # lanes per scale group
        r = tl.arange(0, BLOCK_R)
        e = tl.arange(0, BLOCK_E)
        e_mask = e < head_dim // STEP
        block_ptr = cache_ptr + block_id * stride_cb + head * stride_ch
        block_scale_ptr = scale_ptr + block_id * stride_sb + head * stride_sh

        if SCALES == 0:
            scale = tl.load(scale_ptr)
        elif SCALES == 1:
            old = tl.where(first > 0, tl.load(block_scale_ptr), 0.0)
            amax = tl.full([], 0.0, tl.float32)
            for j0 in range(0, count, BLOCK_R):
                j = j0 + r
                j_mask = j < count
                a = tl.abs(_load_values(x_ptr, order_ptr, start, j, j_mask, head, stride_xt, stride_xh, e, e_mask,
                                        STEP, 0))
                if KV_FORMAT == 3:
                    a = tl.maximum(a, tl.abs(_load_values(x_ptr, order_ptr, start, j, j_mask, head, stride_xt,
                                                          stride_xh, e, e_mask, STEP, 1)))
                amax = tl.maximum(amax, tl.max(tl.max(a, axis=1), axis=0))
            scale = tl.maximum(old, amax / QMAX)
            new_divisor = tl.where(scale > 0, scale, 1.0)
            for o0 in range(0, first, BLOCK_R):  # the block's earlier rows: decode, encode for the new scale
                o = o0 + r
                mask = (o < first)[:, None] & e_mask[None, :]
                ptr = block_ptr + o[:, None] * stride_cs + e[None, :]
                codes = tl.load(ptr, mask=mask)  # masked lanes are never stored
                if KV_FORMAT == 3:
                    byte = codes.to(tl.int32)
                    lo = ((byte & 15) - 8).to(tl.float32) * old / new_divisor
                    hi = ((byte >> 4) - 8).to(tl.float32) * old / new_divisor
                    packed = (_round_half_even(lo).to(tl.int32) + 8) | ((_round_half_even(hi).to(tl.int32) + 8) << 4)
                    tl.store(ptr, packed.to(tl.uint8), mask=mask)
                else:
                    y = tl.minimum(tl.maximum(codes.to(tl.float32) * old / new_divisor, -QMAX), QMAX)
                    tl.store(ptr, _encode(y, KV_FORMAT), mask=mask)
            tl.store(block_scale_ptr, scale)

        for j0 in range(0, count, BLOCK_R):  # the new rows
            j = j0 + r
            j_mask = j < count
            mask = j_mask[:, None] & e_mask[None, :]
            offset = first + j
            ptr = block_ptr + offset[:, None] * stride_cs + e[None, :]
            lo = _load_values(x_ptr, order_ptr, start, j, j_mask, head, stride_xt, stride_xh, e, e_mask, STEP, 0)
            if KV_FORMAT == 3:
                hi = _load_values(x_ptr, order_ptr, start, j, j_mask, head, stride_xt, stride_xh, e, e_mask, STEP, 1)
                a = tl.maximum(tl.abs(lo), tl.abs(hi))
            else:
                hi = lo
                a = tl.abs(lo)
            if SCALES == 2:  # each row's own scales, one per LANES lanes, stored beside it
                g, s = _group_scales(a, QMAX, BLOCK_R, BLOCK_E, LANES)
                gi = tl.arange(0, BLOCK_E // LANES)
                row_scales = scale_ptr + block_id * stride_sb + offset * stride_ss + head * stride_sh
                tl.store(row_scales[:, None] + gi[None, :], g,
                         mask=j_mask[:, None] & (gi * GROUP_SIZE < head_dim)[None, :])
            else:
                s = tl.zeros([BLOCK_R, BLOCK_E], tl.float32) + scale
            divisor = tl.where(s > 0, s, 1.0)
            lo = tl.minimum(tl.maximum(lo / divisor, -QMAX), QMAX)
            if KV_FORMAT == 3:
                hi = tl.minimum(tl.maximum(hi / divisor, -QMAX), QMAX)
                packed = (_round_half_even(lo).to(tl.int32) + 8) | ((_round_half_even(hi).to(tl.int32) + 8) << 4)
                tl.store(ptr, packed.to(tl.uint8), mask=mask)
            else:
                tl.store(ptr, _encode(lo, KV_FORMAT), mask=mask)

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_cb, stride_cs, stride_ch,
        num_kv_heads, head_dim, block_size,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One program per new token: copy its [num_kv_heads, head_dim] K and V into its slot."""
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        keep = (tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot) >= 0  # slot -1: store nothing
        mask = (heads < num_kv_heads) & (dims < head_dim) & keep
        block_id = slot // block_size
        offset = slot % block_size
        dst = block_id * stride_cb + offset * stride_cs + heads * stride_ch + dims
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        out_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
        stride_qs, stride_qh,
        stride_cb, stride_cs, stride_ch,
        stride_sb, stride_ss, stride_sh,
        stride_bt,
        stride_os, stride_oh,
        stride_ps, stride_ph, stride_pk, stride_ls, stride_lh,
        qk_scale_log2,
        group_size, head_dim, block_size, tokens_per_split,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
        KV_FORMAT: tl.constexpr, SCALES: tl.constexpr, GROUP_SIZE: tl.constexpr,
    ):
        """One program per (sequence, KV head, split): the group's queries against one stretch of keys.

        Step by step:
          1. load the ``group_size`` query heads that share this KV head: a [BLOCK_G, BLOCK_D] tile;
          2. walk the positions [lo, hi) ``BLOCK_N`` at a time; for each position look up its
             physical block in the block table and gather K and V rows from the pool;
          3. scores = q @ K^T, masked beyond seq_len; online softmax keeps a running maximum ``m``,
             a running denominator ``l`` and an unnormalised output ``acc``;
          4. without SPLIT write acc / l; with SPLIT write it plus log2-sum-exp for the merge kernel.

        A quantized pool (KV_FORMAT > 0) changes step 2 only: the K and V codes are multiplied by
        their scales right after the load (``_load_dequantized``), before the dot products.
        """
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + seq)
        lo = split * tokens_per_split
        hi = tl.minimum(lo + tokens_per_split, seq_len)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        q_head = kv_head * group_size + g  # the query heads of this KV head's group
        g_mask = g < group_size
        d_mask = d < head_dim  # head dims like 80 or 96 are padded to a power of two
        q = tl.load(q_ptr + seq * stride_qs + q_head[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        elif KV_FORMAT == 0:
            q = q.to(k_cache_ptr.dtype.element_ty)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        n = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            pos = start + n
            valid = pos < hi
            # The paging: position -> (logical block, offset) -> physical block -> row of the pool.
            block_id = tl.load(block_tables_ptr + seq * stride_bt + pos // block_size, mask=valid, other=0)
            if KV_FORMAT == 0:
                row = block_id.to(tl.int64) * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
                kv_mask = valid[:, None] & d_mask[None, :]
                k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
                if UPCAST:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
            else:  # codes times scales, in float32; on tensor cores then rounded to q's 16-bit type
                k = _load_dequantized(k_cache_ptr, k_scale_ptr, block_id, pos % block_size, kv_head, valid, head_dim,
                                      stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                                      BLOCK_N, BLOCK_D, KV_FORMAT, SCALES, GROUP_SIZE)
                v = _load_dequantized(v_cache_ptr, v_scale_ptr, block_id, pos % block_size, kv_head, valid, head_dim,
                                      stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                                      BLOCK_N, BLOCK_D, KV_FORMAT, SCALES, GROUP_SIZE)
                if not UPCAST:
                    k = k.to(q_ptr.dtype.element_ty)
                    v = v.to(q_ptr.dtype.element_ty)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2  # [BLOCK_G, BLOCK_N]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)  # rescale what was summed under the old maximum
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if UPCAST:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        out_mask = g_mask[:, None] & d_mask[None, :]
        if SPLIT:
            # A split past the end of a short sequence saw no keys: l = 0, lse = -inf, weight 0 in the merge.
            has_keys = l_i > 0
            o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            base = seq * stride_ps + q_head * stride_ph + split * stride_pk
            tl.store(part_out_ptr + base[:, None] + d[None, :], o, mask=out_mask)
            tl.store(part_lse_ptr + seq * stride_ls + q_head * stride_lh + split, lse, mask=g_mask)
        else:
            o = acc / l_i[:, None]
            tl.store(out_ptr + seq * stride_os + q_head[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _merge_splits_kernel(
        part_out_ptr, part_lse_ptr, out_ptr,
        stride_ps, stride_ph, stride_pk, stride_ls, stride_lh,
        stride_os, stride_oh,
        num_splits, head_dim,
        BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One program per (sequence, query head): merge the splits' partial outputs.

        Split k holds o_k = (sum_j p_j v_j) / l_k and lse_k = log2(l_k) + m_k. The exact
        full softmax output is sum_k w_k o_k with w_k = 2^(lse_k - lse_max) / sum 2^(...).
        The splits are read ``BLOCK_K`` at a time with a running maximum, the online softmax
        once more, so any number of splits fits in a fixed tile. Split 0 always saw keys, so
        the running maximum is finite after the first chunk.
        """
        seq = tl.program_id(0)
        head = tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        m_i = tl.full([], float("-inf"), dtype=tl.float32)
        l_i = tl.full([], 0.0, dtype=tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for first in range(0, num_splits, BLOCK_K):
            k = first + tl.arange(0, BLOCK_K)
            k_mask = k < num_splits
            lse = tl.load(part_lse_ptr + seq * stride_ls + head * stride_lh + k, mask=k_mask, other=float("-inf"))
            o = tl.load(part_out_ptr + seq * stride_ps + head * stride_ph + k[:, None] * stride_pk + d[None, :],
                        mask=k_mask[:, None] & (d[None, :] < head_dim), other=0.0)
            m_new = tl.maximum(m_i, tl.max(lse, axis=0))
            alpha = tl.exp2(m_i - m_new)
            w = tl.exp2(lse - m_new)
            l_i = l_i * alpha + tl.sum(w, axis=0)
            acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
            m_i = m_new
        tl.store(out_ptr + seq * stride_os + head * stride_oh + d, (acc / l_i).to(out_ptr.dtype.element_ty),
                 mask=d < head_dim)

    @triton.jit
    def _paged_prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr,
        stride_qt, stride_qh,
        stride_cb, stride_cs, stride_ch,
        stride_bt,
        stride_ot, stride_oh,
        qk_scale_log2,
        group_size, head_dim, block_size,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """One program per (sequence, tile of BLOCK_M queries, query head): causal flash attention.

        Query j of a sequence with q_len new tokens and seq_len tokens in all sits at position
        ``seq_len - q_len + j``: the new tokens are the last ones. It sees keys 0..its position,
        so the walk over keys stops after the tile's last query position.
        """
        seq = tl.program_id(0)
        tile = tl.program_id(1)
        head = tl.program_id(2)
        kv_head = head // group_size
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        if tile * BLOCK_M < q_len:
            seq_len = tl.load(seq_lens_ptr + seq)
            m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            m_mask = m < q_len
            q_pos = seq_len - q_len + m
            d = tl.arange(0, BLOCK_D)
            d_mask = d < head_dim
            q = tl.load(q_ptr + (q_start + m[:, None]).to(tl.int64) * stride_qt + head * stride_qh + d[None, :],
                        mask=m_mask[:, None] & d_mask[None, :], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            else:
                q = q.to(k_cache_ptr.dtype.element_ty)

            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            n = tl.arange(0, BLOCK_N)
            hi = tl.minimum(seq_len, seq_len - q_len + tile * BLOCK_M + BLOCK_M)  # causal: nothing later
            for start in range(0, hi, BLOCK_N):
                pos = start + n
                valid = pos < hi
                block_id = tl.load(block_tables_ptr + seq * stride_bt + pos // block_size, mask=valid, other=0)
                row = block_id.to(tl.int64) * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
                kv_mask = valid[:, None] & d_mask[None, :]
                k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
                if UPCAST:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
                s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if UPCAST:
                    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            o = acc / l_i[:, None]
            tl.store(out_ptr + (q_start + m[:, None]).to(tl.int64) * stride_ot + head * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


# ----------------------------------------------------------------------------------------------
# Launch settings
# ----------------------------------------------------------------------------------------------

MIN_TOKENS_PER_SPLIT = 256  # a split shorter than this costs more to merge than it saves
MERGE_BLOCK_K = 16  # the merge kernel reads this many splits per step


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _num_programs_target(device: torch.device) -> int:
    """How many programs keep the device busy: the GPU's multiprocessor count; a small number on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device | str = "cpu",
                      block_n: int = 64, target_programs: int | None = None) -> tuple[int, int]:
    """Split-K plan for decode: ``(num_splits, tokens_per_split)``.

    Decode launches one program per (sequence, KV head). With many sequences that
    fills the GPU; with one long sequence it leaves most multiprocessors idle while one
    program walks 32k positions. Then the positions are cut into ``num_splits`` chunks
    handled in parallel, each at least ``MIN_TOKENS_PER_SPLIT`` long, and merged.
    ``target_programs`` (default: the device's multiprocessor count; 8 on a CPU) is how many
    programs keep the device busy.
    """
    num_seqs = check_int("num_seqs", num_seqs, 1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
    max_seq_len = check_int("max_seq_len", max_seq_len, 1)
    block_n = check_int("block_n", block_n, 1)
    if target_programs is not None:
        check_int("target_programs", target_programs, 1)
    target = target_programs or _num_programs_target(torch.device(device))
    programs = num_seqs * num_kv_heads
    if programs >= target or max_seq_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1, max(max_seq_len, 1)
    splits = min(-(-target // programs), max_seq_len // MIN_TOKENS_PER_SPLIT)
    tokens_per_split = -(-max_seq_len // splits)
    tokens_per_split = -(-tokens_per_split // block_n) * block_n  # whole BLOCK_N steps
    return -(-max_seq_len // tokens_per_split), tokens_per_split


@dataclass(frozen=True)
class LaunchSettings:
    """How one attention launch is cut up: tile sizes, warps per program and pipeline depth.

    ``block_m`` query rows per program (prefill; decode's rows are the GQA group padded to
    ``block_g``), ``block_n`` keys per step of the walk over the block table, ``block_d``
    head_dim padded to a power of two (80 and 96 become 128, the padding masked off).
    ``num_warps`` warps of 32 threads run one program; ``num_stages`` is how many steps of K/V
    loads are in flight at once (software pipelining through shared memory). ``upcast``
    converts loads to float32 before any arithmetic, and ``dot_precision`` is what ``tl.dot``
    may use for float32 products ("ieee": exact float32, never TF32).
    """

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    upcast: bool
    dot_precision: str = "ieee"

    def constexprs(self) -> dict:
        """The settings the kernels take as ``tl.constexpr`` plus the launch options."""
        return dict(BLOCK_D=self.block_d, BLOCK_N=self.block_n, UPCAST=self.upcast,
                    DOT_PRECISION=self.dot_precision, num_warps=self.num_warps, num_stages=self.num_stages)


def launch_settings(kernel: str, dtype: torch.dtype, head_dim: int,
                    capability: tuple[int, int] | None, max_len: int = 128, quantized: bool = False) -> LaunchSettings:
    """Tiles, warps and stages for ``kernel`` ("decode" or "prefill") on a GPU of ``capability``.

    Compiled, one rule decides everything: do the products run on **tensor cores**? They do
    for float16 and bfloat16 from compute capability 8.0 (A100, A10, L4, RTX 30/40, H100).
    They do not for float32 (labkit asks for exact float32 products), and not at all on a
    7.5 GPU (T4): Triton 3.9 turns every ``tl.dot`` there into float32 FMAs, whatever the
    input type, so labkit upcasts every load and computes in float32 on the FP32 units.

    * Tensor cores: a step reads 64 keys (32 when head_dim > 128), prefill tiles 64 queries
      on 8 warps, decode's padded group of 16 rows on 4, with 3 stages of loads in flight
      (asynchronous copies, compute capability 8.0 and up).
    * FMAs: every product and operand sits in registers, so the tiles shrink and the work is
      spread over more threads: 32 keys on 8 warps (16 keys on 4 warps when head_dim > 128:
      with 8, ptxas spilled there on sm86/sm89), 16 query rows, 2 stages; 1 stage on compute
      capability 7.5, which has no asynchronous copy to overlap with.

    With these tiles every launch compiles for sm75, sm80, sm86, sm89 and sm90 without a
    register spill and within each GPU's shared memory per block (64 KiB on a T4, 99 KiB on
    sm86/sm89). Larger ones were tried and failed: 64-key tiles overflow a T4's shared memory
    on the FMA path, and 4 warps spill registers there; 64-query prefill tiles on 4 warps
    spill on sm80/sm86. ``benchmarks/kernels_static.py`` compiles every combination ahead of
    time and tests/test_kernels_static.py a subset, so a change here that spills or overflows
    fails a test, GPU or not. Which tiles run *fastest* only a GPU can tell.

    ``quantized``: decode over a quantized pool (appendix A3). Dequantizing a tile takes more
    registers; on the FMA path ptxas spilled with the settings above (up to 7 KiB on sm86 at
    head_dim 256 with two stages; 8 bytes on sm90 at head_dim 128 with 32-key steps). There a step
    reads 16 keys, its loads are not pipelined (1 stage), and 8 warps share the work; the
    tensor-core path keeps its settings.

    Interpreted there are no registers or warps, only Python steps: one step as wide as the
    sequence (up to 128 keys), float32 throughout (the interpreter's bfloat16 is inexact).
    """
    _check_launch_args(kernel, dtype, head_dim, capability, max_len)
    if not isinstance(quantized, bool):
        raise ValueError(f"quantized must be True or False, got {quantized!r}")
    block_d = max(16, _next_pow2(head_dim))
    if capability is None:  # Triton's interpreter on the CPU
        return LaunchSettings(block_m=64, block_n=min(128, max(16, _next_pow2(max_len))), block_d=block_d,
                              num_warps=1, num_stages=1, upcast=True)
    wide = block_d > 128
    if dtype != torch.float32 and capability >= (8, 0):  # tensor cores, float32 accumulation
        return LaunchSettings(block_m=64, block_n=32 if wide else 64, block_d=block_d,
                              num_warps=8 if kernel == "prefill" else 4, num_stages=3, upcast=False,
                              dot_precision="tf32")  # only float32 inputs look at it; these are 16-bit
    if quantized:
        return LaunchSettings(block_m=16, block_n=16, block_d=block_d, num_warps=8, num_stages=1, upcast=True)
    return LaunchSettings(block_m=16, block_n=16 if wide else 32, block_d=block_d, num_warps=4 if wide else 8,
                          num_stages=2 if capability >= (8, 0) else 1, upcast=True)


KERNELS = ("decode", "prefill")


def _check_launch_args(kernel: object, dtype: object, head_dim: object, capability: object, max_len: object) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
    if check_int("head_dim", head_dim, 1) > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if capability is not None and not (isinstance(capability, tuple) and len(capability) == 2
                                       and all(type(c) is int and c >= 0 for c in capability)):
        raise ValueError(f"capability must be None (the interpreter) or a (major, minor) pair of integers such as "
                         f"(8, 0), got {capability!r}")
    check_int("max_len", max_len, 1)


def _launch_capability() -> tuple[int, int] | None:
    """The compute capability the kernels are compiled for; None in the interpreter."""
    return None if _interpreted() else (RUNTIME.capability or (8, 0))


def _group_tile(group_size: int) -> int:
    """Decode's query rows per program: the GQA group, padded to 16 when compiled (tl.dot's minimum)."""
    return _next_pow2(group_size) if _interpreted() else max(16, _next_pow2(group_size))


# ----------------------------------------------------------------------------------------------
# Launchers: no checks (the public functions check), so benchmarks can time the bare kernel
# ----------------------------------------------------------------------------------------------

def _write_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_h, block_d = _next_pow2(num_kv_heads), _next_pow2(head_dim)
    # A copy: give each thread 16 bytes (one 128-bit load and store), with 1 to 8 warps.
    num_warps = min(8, max(1, block_h * block_d * k.element_size() // (32 * 16)))
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim, k_cache.shape[1],
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=num_warps,
    )


def write_runs(slot_mapping: torch.Tensor, block_size: int, kq: KVQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """How a quantized write is cut into programs: ``(order, runs)``.

    ``order``: the kept tokens (slot >= 0) sorted by slot. ``runs`` int64 [num_runs, 4]: block id,
    first offset, start in ``order``, count. A run is tokens that land in consecutive slots of one
    block. Per block, all the tokens written into a block must form one run (a block is filled in
    order: its scale covers the slots before the first new one); a gap raises ValueError naming
    slot_mapping.
    """
    kept = (slot_mapping >= 0).nonzero().flatten()
    order = kept[slot_mapping[kept].argsort()]
    slots = slot_mapping[order].long()
    blocks = slots // block_size
    starts = torch.ones_like(slots, dtype=torch.bool)
    starts[1:] = (slots[1:] != slots[:-1] + 1) | (blocks[1:] != blocks[:-1])
    starts = starts.nonzero().flatten()
    counts = torch.diff(starts, append=torch.tensor([len(slots)], device=slots.device))
    if kq.scales == "block" and bool((blocks[starts][1:] == blocks[starts][:-1]).any()):
        raise ValueError(f"slot_mapping must send the tokens written into one block of a {kq.name} cache to "
                         "consecutive slots: a block is filled in order, its scale covering the slots before "
                         "the first new one")
    return order, torch.stack([blocks[starts], slots[starts] % block_size, starts, counts], dim=1)


def _write_kv_quant_triton(x, cache, scale, order, runs, kq: KVQuant) -> None:
    """Quantize one of K or V into its pool: one program per (run, KV head)."""
    if runs.shape[0] == 0:
        return
    head_dim = x.shape[-1]
    step = 2 if kq.element == "int4" else 1
    lanes = kq.group_size // step
    block_e = _next_pow2(head_dim // step)
    if kq.scales == "group":
        block_e = max(block_e, lanes)  # whole groups of lanes: the kernel reshapes them
    gs = _scale_strides(scale, kq)
    _write_kv_quant_kernel[(runs.shape[0], x.shape[1])](
        x, cache, scale, order, runs,
        x.stride(0), x.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2),
        *gs, head_dim,
        QMAX=kq.qmax, KV_FORMAT=KV_FORMATS[kq.element], SCALES=SCALE_KINDS[kq.scales], GROUP_SIZE=kq.group_size,
        # at most 2,048 lanes a tile over 4 warps: 16 rows of 256 lanes spilled on sm90 (fp8, per block)
        BLOCK_R=min(16, _next_pow2(cache.shape[1]), max(1, 2048 // block_e)), BLOCK_E=block_e, num_warps=4,
    )


def _scale_strides(scale: torch.Tensor | None, kq: KVQuant | None) -> tuple[int, int, int]:
    """(block, slot, head) strides of a scale tensor; 0 where the scheme has no such axis."""
    if kq is None or kq.scales == "tensor":
        return 0, 0, 0
    if kq.scales == "block":
        return scale.stride(0), 0, scale.stride(1)
    return scale.stride(0), scale.stride(1), scale.stride(2)


def _decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, tokens_per_split,
                   max_len, out=None, kq: KVQuant | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    settings = launch_settings("decode", q.dtype, head_dim, _launch_capability(), min(max_len, tokens_per_split),
                               quantized=kq is not None)
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    if kq is None:
        k_scale = v_scale = q  # unused: a 16/32-bit pool has no scales
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, k_scale, v_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *_scale_strides(k_scale, kq),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if num_splits > 1 else 0,
        part_lse.stride(0), part_lse.stride(1),
        scale * LOG2E,
        group, head_dim, k_cache.shape[1], tokens_per_split,
        BLOCK_G=_group_tile(group), SPLIT=num_splits > 1, **settings.constexprs(), **_format_constexprs(kq),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out,
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            num_splits, head_dim,
            BLOCK_K=min(MERGE_BLOCK_K, _next_pow2(num_splits)), BLOCK_D=settings.block_d, num_warps=4,
        )
    return out


def _prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_q_len,
                    max_len, out=None) -> torch.Tensor:
    total, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    if total == 0:
        return out
    settings = launch_settings("prefill", q.dtype, head_dim, _launch_capability(), max_len)
    block_m = min(settings.block_m, max(16, _next_pow2(max_q_len)))  # short queries: a smaller tile
    _paged_prefill_kernel[(num_seqs, -(-max_q_len // block_m), num_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale * LOG2E,
        group, head_dim, k_cache.shape[1],
        BLOCK_M=block_m, **settings.constexprs(),
    )
    return out


# ----------------------------------------------------------------------------------------------
# The public functions
# ----------------------------------------------------------------------------------------------

def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Scatter new keys and values into their cache slots, in place.

    k, v: [num_tokens, num_kv_heads, head_dim], the dtype of the caches (any strides).
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], dense in head_dim.
    slot_mapping: int32 or int64 [num_tokens]; token t goes to slot ``slot_mapping[t]``
    (block ``slot // block_size``, offset ``slot % block_size``); -1 skips the token.

    kv_cache_dtype: "auto" (the pools hold k's dtype) or a scheme of ``labkit.quant``: the pools
    hold its codes and k_scale/v_scale its scales, and the write quantizes (per block it may
    also rescale the block's earlier codes and raise its scale; the tokens written into one block
    must then fill consecutive slots).
    """
    _check_tensor("k", k, 3, SUPPORTED_DTYPES)
    _check_tensor("v", v, 3, SUPPORTED_DTYPES)
    _check_device("v", v, "k", k)
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v must match k's shape {tuple(k.shape)} and dtype {k.dtype}, got {tuple(v.shape)} {v.dtype}")
    kq = _check_kv_format(kv_cache_dtype, k_cache, v_cache, k_scale, v_scale, k.shape[-1], "k", k)
    if k.shape[1] != k_cache.shape[2]:
        raise ValueError(f"k must be [num_tokens, {k_cache.shape[2]}, {k.shape[2]}] to match k_cache's "
                         f"{k_cache.shape[2]} KV heads, got {tuple(k.shape)}")
    if kq is not None and kq.scales == "tensor":
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (math.isfinite(float(t)) and float(t) > 0):
                raise ValueError(f"{name} must hold a finite scale > 0 for {kq.name}, got {float(t)!r}")
    _check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64))
    _check_device("slot_mapping", slot_mapping, "k", k)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must have num_tokens={k.shape[0]} entries, got {slot_mapping.shape[0]}")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if k.shape[0]:
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(f"slot_mapping entries must be -1 (skip) or slots in [0, {num_slots - 1}], "
                             f"got {lo}..{hi}")
        kept = slot_mapping[slot_mapping >= 0]
        if kept.unique().numel() != kept.numel():
            raise ValueError("slot_mapping must not send two tokens to the same slot")
    # The kernel reads k and v rows through their strides but needs head_dim dense.
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    slot_mapping = _dense(slot_mapping)
    if kq is not None:
        order, runs = write_runs(slot_mapping, k_cache.shape[1], kq)  # checks a per-block write first
        kw = dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
        if _use_reference(k.dtype, k.device, kv_cache_dtype):
            write_kv_ref(k, v, k_cache, v_cache, slot_mapping, **kw)
            return

        def launch() -> None:
            _write_kv_quant_triton(k, k_cache, k_scale, order, runs, kq)
            _write_kv_quant_triton(v, v_cache, v_scale, order, runs, kq)

        _launch_or_reference(f"write_kv {kq.name}", k.dtype, k.shape[-1], launch,
                             lambda: write_kv_ref(k, v, k_cache, v_cache, slot_mapping, **kw))
        return
    if _use_reference(k.dtype, k.device):
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    _launch_or_reference("write_kv", k.dtype, k.shape[-1],
                         lambda: _write_kv_triton(k, v, k_cache, v_cache, slot_mapping),
                         lambda: write_kv_ref(k, v, k_cache, v_cache, slot_mapping))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
                           *, num_splits: int | None = None, out: torch.Tensor | None = None,
                           kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new query per sequence over its paged K/V.

    q: [num_seqs, num_heads, head_dim] (float32, float16 or bfloat16);
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype, dense in head_dim;
    block_tables: int32 [num_seqs, max_blocks_per_seq]; seq_lens: int32 [num_seqs], each >= 1
    and counting the query's own position, whose K/V are already in the cache.
    scale: default 1 / sqrt(head_dim). num_splits: None picks the split-K plan with
    ``choose_num_splits``; 1 forces a single pass; k > 1 forces k chunks.
    out: where to write the result (shaped like q), or None for a new tensor. Returns out.
    kv_cache_dtype, k_scale, v_scale: a quantized pool (see ``write_kv``); the kernel dequantizes
    each K/V tile after loading it, and the products run in q's dtype (float32 when upcast).
    """
    _check_tensor("q", q, 3, SUPPORTED_DTYPES)
    _check_scale(scale)
    _check_out(out, q)
    kq = _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, q.shape[0], kv_cache_dtype,
                               k_scale, v_scale)
    kw = dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be None or an integer >= 1, got {num_splits!r}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if q.shape[0] == 0:
        return torch.empty_like(q) if out is None else out
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables, seq_lens = _dense(block_tables), _dense(seq_lens)

    def reference() -> torch.Tensor:
        result = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, **kw)
        return result if out is None else out.copy_(result)

    if _use_reference(q.dtype, q.device, kv_cache_dtype):
        return reference()
    max_len = int(seq_lens.max())
    block_n = launch_settings("decode", q.dtype, q.shape[-1], _launch_capability(), max_len,
                              quantized=kq is not None).block_n
    if num_splits is None:
        num_splits, per_split = choose_num_splits(q.shape[0], k_cache.shape[2], max_len, q.device, block_n)
    else:
        per_split = -(-max_len // num_splits)
        num_splits = -(-max_len // per_split)  # never an empty split at the end
    return _launch_or_reference(
        "paged_decode_attention" + (f" {kq.name}" if kq else ""), q.dtype, q.shape[-1],
        lambda: _decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, per_split,
                               max_len, out, kq, k_scale, v_scale),
        reference)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            scale: float | None = None, *, out: torch.Tensor | None = None,
                            kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of many new queries per sequence over the paged cache (variable length).

    q: [total_query_tokens, num_heads, head_dim]; sequence i owns rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` (int32 [num_seqs + 1], starting at 0), its last
    q_len positions. seq_lens[i] is the sequence's whole length including those queries,
    whose K/V must already be written (``write_kv``). A whole prompt, a chunk of one, and
    a suffix after a prefix-cache hit are all this one call. Returns out shaped like q
    (written into ``out`` when given).

    A quantized pool (``kv_cache_dtype``, ``k_scale``, ``v_scale``): the blocks the sequences read
    are dequantized into a scratch pool of q's dtype (``dequantize_blocks``), which the 16/32-bit
    kernel then reads. Prefill is bound by its matrix products, not by reading K/V, so this copy
    costs little there; decode, bound by the reads, dequantizes in registers instead.
    """
    _check_tensor("q", q, 3, SUPPORTED_DTYPES)
    _check_scale(scale)
    _check_out(out, q)
    _check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
    _check_device("cu_seqlens_q", cu_seqlens_q, "q", q)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have num_seqs + 1 >= 1 entries")
    num_seqs = cu_seqlens_q.shape[0] - 1
    _check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"cu_seqlens_q must have num_seqs + 1 = {seq_lens.shape[0] + 1} entries (one more than "
                         f"seq_lens), got {cu_seqlens_q.shape[0]}")
    kq = _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, kv_cache_dtype,
                               k_scale, v_scale)
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != q.shape[0] or (num_seqs and int(q_lens.min()) < 0):
        raise ValueError(f"cu_seqlens_q must start at 0, never decrease and end at total_query_tokens="
                         f"{q.shape[0]}, got {cu_seqlens_q.tolist()}")
    if num_seqs and bool((q_lens > seq_lens.long()).any()):
        raise ValueError(f"each sequence's query count (from cu_seqlens_q) must be <= its seq_lens entry, got "
                         f"q_lens {q_lens.tolist()} and seq_lens {seq_lens.tolist()}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if num_seqs == 0 or q.shape[0] == 0:
        return torch.empty_like(q) if out is None else out
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables, seq_lens, cu_seqlens_q = _dense(block_tables), _dense(seq_lens), _dense(cu_seqlens_q)
    if kq is not None:  # PyTorch dequantizes (fp8 included, on any GPU), then the 16/32-bit kernel reads
        k_cache, v_cache, block_tables = dequantize_blocks(k_cache, v_cache, k_scale, v_scale, kv_cache_dtype,
                                                           block_tables, seq_lens, q.dtype)

    def reference() -> torch.Tensor:
        result = paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale)
        return result if out is None else out.copy_(result)

    if _use_reference(q.dtype, q.device):
        return reference()
    return _launch_or_reference(
        "paged_prefill_attention", q.dtype, q.shape[-1],
        lambda: _prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                                int(q_lens.max()), int(seq_lens.max()), out),
        reference)
