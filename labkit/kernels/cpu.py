"""Paged attention on a CPU: the same arithmetic as the references, a whole batch per call.

The references loop over sequences, a dozen small operations each, for every layer. On a CPU that
loop, not the arithmetic, dominates a decode step of a real model, and Triton's interpreter is far
slower still. These functions read every sequence's slots in one ``index_select`` and attend with one
``scaled_dot_product_attention`` call; ``labkit.caches.paged.KVPool`` runs them with
``use_triton=False``. ``tests/test_kernels.py`` holds them to the references.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..memory.blocks import blocks_needed
from .reference import compute_dtype, dequantize_blocks, paged_prefill_attention_ref


def token_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Every sequence's slots, position by position: int64 [num_seqs, width * block_size].

    Position ``p`` of sequence ``i`` lives in slot ``block_tables[i, p // block_size] * block_size
    + p % block_size`` (chapter 03's slot mapping, read backwards). Positions at or past
    ``seq_lens[i]`` (a block's empty tail, or a shorter sequence's padding) point at the
    sequence's first slot instead: real, finite data that the attention mask then hides, so
    a pool whose free slots hold NaN can never leak into a result (0 x NaN is NaN).
    """
    width = blocks_needed(int(seq_lens.max()), block_size) if seq_lens.numel() else 1  # the longest's blocks
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

    The reference loops over sequences, a dozen small operations each, for every layer;
    on a CPU that loop, not the arithmetic, dominates a decode step of a real model. Here the
    pool is seen as one row per slot (``[num_blocks * block_size, Hkv, D]``), every sequence's
    slots are read in one ``index_select`` (``token_slots``), padded to the longest sequence,
    and one ``scaled_dot_product_attention`` call attends with a mask that hides the padding,
    GQA included (``enable_gqa``: query head ``h`` reads KV head ``h // group``). It is what
    transformers does on a CPU, with the gather in place of its contiguous cache. The same
    arithmetic as the reference; ``tests/test_kernels.py`` checks it against the reference on
    ragged lengths, shuffled block tables and a NaN-poisoned pool. A quantized pool is
    dequantized first (``dequantize_blocks``) into q's dtype as the compiled kernels see it: each
    code × its scale in float32, rounded once to q's dtype (``labkit.memory.formats.dequantize``).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ct = compute_dtype(q.dtype)
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
