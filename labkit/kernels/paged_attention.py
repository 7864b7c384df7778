"""Paged attention's three operations, as a serving engine calls them (chapter 03, appendix A1).

* ``write_kv``: scatter the new tokens' K and V into their slots (``slot = block_id * block_size +
  offset``; slot -1 means "skip this token");
* ``paged_decode_attention``: one new query per sequence attends over all of its cached positions;
* ``paged_prefill_attention``: many new queries per sequence (a prompt, a chunk of one, or the
  suffix after a prefix-cache hit), causal, reading earlier positions from the paged cache.

Each checks its arguments (``labkit.kernels.arguments``), then runs the Triton kernel
(``labkit.kernels.triton_paged``, launched by ``labkit.kernels.launch``), or its ``*_ref`` twin in
plain PyTorch (``labkit.kernels.reference``) where Triton cannot run here or a compiled launch fails
(``labkit.kernels.fallback``). The references are the definition; the tests prove the kernels against
them. Index tensors (``block_tables``, ``seq_lens``, ``cu_seqlens_q``, ``slot_mapping``) may be strided
views: the kernels get dense copies. The caches must be dense in head_dim; other strides are fine.

A pool may also hold fewer bytes per element (appendix A3, ``labkit.memory.formats``): with
``kv_cache_dtype`` set to a scheme such as ``"int8_per_block"``, ``k_cache``/``v_cache`` hold codes
(fp8, int8, or two int4 codes per byte) and ``k_scale``/``v_scale`` their float32 scales.
``write_kv`` quantizes as it writes; the decode kernel loads the codes and multiplies them by their
scales in registers, before the dot products; prefill, compute-bound, dequantizes the blocks it
reads into a scratch pool and runs the 16/32-bit kernel. Triton compiles fp8 (e4m3) only from compute
capability 8.9: on older GPUs ``fallback_reason`` says so and the PyTorch reference runs.
"""

from __future__ import annotations

import math

import torch

from ..memory.formats import check_slot_mapping, check_tensor_scales
from . import launch
from .arguments import (SUPPORTED_DTYPES, check_attention_args, check_device, check_kv_format, check_out, check_scale,
                        check_tensor, dense)
from .fallback import launch_or_reference, use_reference
from .launch import choose_num_splits, launch_capability, launch_settings, write_runs
from .reference import dequantize_blocks, paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Scatter new keys and values into their cache slots, in place.

    k, v: [num_tokens, num_kv_heads, head_dim], the dtype of the caches (any strides).
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], dense in head_dim.
    slot_mapping: int32 or int64 [num_tokens]; token t goes to slot ``slot_mapping[t]``
    (block ``slot // block_size``, offset ``slot % block_size``); -1 skips the token.

    kv_cache_dtype: "auto" (the pools hold k's dtype) or a scheme of ``labkit.memory.formats``: the pools
    hold its codes and k_scale/v_scale its scales, and the write quantizes (per block it may
    also rescale the block's earlier codes and raise its scale; the tokens written into one block
    must then fill consecutive slots). Non-finite K or V: NaN is stored as int code 0 or fp8 NaN,
    ±inf saturates to ±qmax, and scales come from the finite values only, so no other element's code
    is spoiled (``labkit.memory.formats``' "Non-finite values"); kernel and reference agree bit for bit.
    """
    check_tensor("k", k, 3, SUPPORTED_DTYPES)
    check_tensor("v", v, 3, SUPPORTED_DTYPES)
    check_device("v", v, "k", k)
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v must match k's shape {tuple(k.shape)} and dtype {k.dtype}, got {tuple(v.shape)} {v.dtype}")
    kq = check_kv_format(kv_cache_dtype, k_cache, v_cache, k_scale, v_scale, k.shape[-1], "k", k)
    if k.shape[1] != k_cache.shape[2]:
        raise ValueError(f"k must be [num_tokens, {k_cache.shape[2]}, {k.shape[2]}] to match k_cache's "
                         f"{k_cache.shape[2]} KV heads, got {tuple(k.shape)}")
    check_tensor_scales(kq, k_scale=k_scale, v_scale=v_scale)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64))
    check_device("slot_mapping", slot_mapping, "k", k)
    check_slot_mapping(slot_mapping, k.shape[0], k_cache.shape[0] * k_cache.shape[1])
    # The kernel reads k and v rows through their strides but needs head_dim dense.
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    slot_mapping = dense(slot_mapping)
    if kq is not None:
        order, runs = write_runs(slot_mapping, k_cache.shape[1], kq)  # checks a per-block write first
        kw = dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
        if use_reference(k.dtype, k.device, kv_cache_dtype):
            write_kv_ref(k, v, k_cache, v_cache, slot_mapping, **kw)
            return

        def write_both() -> None:
            launch.write_kv_quant_triton(k, k_cache, k_scale, order, runs, kq)
            launch.write_kv_quant_triton(v, v_cache, v_scale, order, runs, kq)

        launch_or_reference(f"write_kv {kq.name}", k.dtype, k.shape[-1], write_both,
                            lambda: write_kv_ref(k, v, k_cache, v_cache, slot_mapping, **kw))
        return
    if use_reference(k.dtype, k.device):
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    launch_or_reference("write_kv", k.dtype, k.shape[-1],
                        lambda: launch.write_kv_triton(k, v, k_cache, v_cache, slot_mapping),
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
    check_tensor("q", q, 3, SUPPORTED_DTYPES)
    check_scale(scale)
    check_out(out, q)
    kq = check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, q.shape[0], kv_cache_dtype,
                              k_scale, v_scale)
    kw = dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be None or an integer >= 1, got {num_splits!r}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if q.shape[0] == 0:
        return torch.empty_like(q) if out is None else out
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables, seq_lens = dense(block_tables), dense(seq_lens)

    def reference() -> torch.Tensor:
        result = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, **kw)
        return result if out is None else out.copy_(result)

    if use_reference(q.dtype, q.device, kv_cache_dtype):
        return reference()
    max_len = int(seq_lens.max())
    block_n = launch_settings("decode", q.dtype, q.shape[-1], launch_capability(), max_len,
                              quantized=kq is not None).block_n
    if num_splits is None:
        num_splits, per_split = choose_num_splits(q.shape[0], k_cache.shape[2], max_len, q.device, block_n)
    else:
        per_split = -(-max_len // num_splits)
        num_splits = -(-max_len // per_split)  # never an empty split at the end
    return launch_or_reference(
        "paged_decode_attention" + (f" {kq.name}" if kq else ""), q.dtype, q.shape[-1],
        lambda: launch.decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, per_split,
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
    check_tensor("q", q, 3, SUPPORTED_DTYPES)
    check_scale(scale)
    check_out(out, q)
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
    check_device("cu_seqlens_q", cu_seqlens_q, "q", q)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have num_seqs + 1 >= 1 entries")
    num_seqs = cu_seqlens_q.shape[0] - 1
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"cu_seqlens_q must have num_seqs + 1 = {seq_lens.shape[0] + 1} entries (one more than "
                         f"seq_lens), got {cu_seqlens_q.shape[0]}")
    kq = check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, kv_cache_dtype,
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
    block_tables, seq_lens, cu_seqlens_q = dense(block_tables), dense(seq_lens), dense(cu_seqlens_q)
    if kq is not None:  # PyTorch dequantizes (fp8 included, on any GPU), then the 16/32-bit kernel reads
        k_cache, v_cache, block_tables = dequantize_blocks(k_cache, v_cache, k_scale, v_scale, kv_cache_dtype,
                                                           block_tables, seq_lens, q.dtype)

    def reference() -> torch.Tensor:
        result = paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale)
        return result if out is None else out.copy_(result)

    if use_reference(q.dtype, q.device):
        return reference()
    return launch_or_reference(
        "paged_prefill_attention", q.dtype, q.shape[-1],
        lambda: launch.prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                                      int(q_lens.max()), int(seq_lens.max()), out),
        reference)
