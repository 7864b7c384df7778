"""The kernels' argument checks: a ValueError naming the argument, before anything runs.

A kernel that reads past a pool or through a wrong stride does not fail: it returns numbers. So the
public functions of ``labkit.kernels.paged_attention`` check every tensor's rank, dtype, device,
shape and layout first, and every block id a sequence will read, with these helpers.
"""

from __future__ import annotations

import math

import torch

from ..memory.blocks import blocks_needed
from ..memory.formats import KVQuant, check_pool, kv_quant

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def check_tensor(name: str, t: object, dim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    return t


def check_caches(k_cache: object, v_cache: object, like: str, ref: torch.Tensor) -> None:
    """The two pools: same shape and strides, ``ref``'s dtype and device, head_dim contiguous.

    ``like`` names the tensor the caches must agree with (q for attention, k for write_kv).
    Only the last dimension must be dense: the kernels address blocks, slots and heads
    through strides, so a pool that is a view into a larger buffer works.
    """
    check_tensor("k_cache", k_cache, 4, SUPPORTED_DTYPES)
    check_tensor("v_cache", v_cache, 4, SUPPORTED_DTYPES)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    check_pair_layout("k_cache", k_cache, "v_cache", v_cache, like, ref)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != ref.dtype:
            raise ValueError(f"{name} dtype ({t.dtype}) must equal {like}'s dtype ({ref.dtype})")
    if not 1 <= k_cache.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"k_cache head_dim must be in [1, {MAX_HEAD_DIM}], got {k_cache.shape[3]}")


def check_device(name: str, t: torch.Tensor, like: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {like}'s device ({ref.device}), got {t.device}")


def dense(t: torch.Tensor) -> torch.Tensor:
    """Index tensors (block_tables, seq_lens, cu_seqlens_q, slot_mapping) as the kernels read them.

    The kernels find entry i of an index vector at ``ptr + i`` and entry (s, j) of a block
    table at ``ptr + s * stride(0) + j``: a strided view such as ``block_tables[:, ::2]``
    would be read wrongly. These tensors are tiny, so a dense copy (a no-op when already
    dense) is cheaper than a kernel that handles every stride.
    """
    return t.contiguous()


def check_scale(scale: object) -> None:
    if scale is not None and (isinstance(scale, bool) or
                              not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0)):
        raise ValueError(f"scale must be None or a finite number > 0, got {scale!r}")


def check_out(out: object, q: torch.Tensor) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        got = f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}"
        raise ValueError(f"out must be None or a tensor shaped like q {tuple(q.shape)} with dtype {q.dtype} on "
                         f"{q.device}, got {got}")
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous in head_dim (stride 1 in its last dimension)")


def check_kv_format(kv_cache_dtype: object, k_cache: object, v_cache: object, k_scale: object, v_scale: object,
                    head_dim: int, like: str, ref: torch.Tensor) -> KVQuant | None:
    """The pools and scales of ``kv_cache_dtype`` (``labkit.memory.formats``); returns its scheme (None for "auto").

    "auto": k_cache and v_cache hold ``ref``'s dtype, and there are no scales. A quantized scheme:
    the pools hold its codes, [num_blocks, block_size, num_kv_heads, head_dim] (head_dim / 2 bytes
    for int4, so head_dim must be even), and k_scale/v_scale are float32 tensors of the scheme's
    scale shape (``labkit.memory.formats.check_pool``, the rule the reference write checks too), on
    ``ref``'s device, alike in shape and strides, dense in their last dimension.
    """
    kq = kv_quant(kv_cache_dtype)
    if kq is None:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale and v_scale must be None when kv_cache_dtype is 'auto' (no quantization)")
        check_caches(k_cache, v_cache, like, ref)
        if k_cache.shape[3] != head_dim:
            raise ValueError(f"{like} head_dim must equal k_cache head_dim {k_cache.shape[3]}, got {head_dim}")
        return None
    kq.check_head_dim(head_dim)
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    check_pool(kq, head_dim, "k_cache", k_cache, "k_scale", k_scale)
    check_pool(kq, head_dim, "v_cache", v_cache, "v_scale", v_scale)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    check_pair_layout("k_cache", k_cache, "v_cache", v_cache, like, ref)
    check_pair_layout("k_scale", k_scale, "v_scale", v_scale, like, ref, last_dim="its last dimension")
    return kq


def check_pair_layout(k_name: str, k: torch.Tensor, v_name: str, v: torch.Tensor, like: str, ref: torch.Tensor,
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


def check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, num_seqs: int, kv_cache_dtype: str = "auto",
                         k_scale=None, v_scale=None) -> KVQuant | None:
    """Shared checks of the two attention functions; ``q`` already checked for dim and dtype.
    Returns the cache's quantization scheme (None for a 16/32-bit pool)."""
    kq = check_kv_format(kv_cache_dtype, k_cache, v_cache, k_scale, v_scale, q.shape[-1], "q", q)
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if q.shape[-2] % num_kv_heads:
        raise ValueError(f"q num_heads ({q.shape[-2]}) must be a multiple of num_kv_heads ({num_kv_heads})")
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    check_device("block_tables", block_tables, "q", q)
    check_device("seq_lens", seq_lens, "q", q)
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
    used = torch.arange(block_tables.shape[1], device=q.device)[None, :] < blocks_needed(lens, block_size)[:, None]
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables entries in use must be block ids in [0, {num_blocks - 1}], got "
                         f"{int(ids.min())}..{int(ids.max())}")
    return kq
