"""What the paged kernels compute, in plain PyTorch: the definition the kernels are tested against.

Each function gathers a sequence's blocks into a contiguous tensor (``gather_kv``) and runs the
textbook attention of chapter 01 (``labkit.model.decoder.causal_attention``), one sequence at a
time, in float32 (float64 for float64 inputs). Slow and obviously right: ``tests/test_kernels.py``
holds every kernel to these on random data, ragged lengths and shuffled block tables. A quantized
pool (``kv_cache_dtype``, ``labkit.memory.formats``) is dequantized first, then attended to.
"""

from __future__ import annotations

import math

import torch

from ..memory import formats
from ..memory.blocks import blocks_needed
from ..model.decoder import causal_attention


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's K (or V) as a contiguous tensor [seq_len, num_kv_heads, head_dim].

    Take the sequence's first ceil(seq_len / block_size) blocks in block-table order,
    lay them end to end, and cut after ``seq_len`` tokens: the empty tail of the
    last block is dropped.
    """
    block_size = cache.shape[1]
    n_blocks = blocks_needed(int(seq_len), block_size)
    blocks = cache[block_table[:n_blocks].long()]  # [n_blocks, block_size, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[: int(seq_len)]


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last q_len positions; q [q_len, Hq, D], k/v [kv_len, Hkv, D].

    The same textbook attention the chapter-01 decoder uses, for one sequence.
    """
    return causal_attention(q[None], k[None], v[None], scale)[0]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
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
    kq = formats.kv_quant(kv_cache_dtype)
    num_blocks, block_size = k_cache.shape[:2]
    width = blocks_needed(int(seq_lens.max()), block_size) if seq_lens.numel() else 1
    used = torch.arange(width, device=seq_lens.device)[None, :] < blocks_needed(seq_lens.long(), block_size)[:, None]
    table = block_tables[:, :width].long().clamp(0, num_blocks - 1)
    ids = table[used].unique()
    renumber = torch.zeros(num_blocks, dtype=torch.long, device=table.device)
    renumber[ids] = torch.arange(len(ids), device=table.device)
    tables = torch.where(used, renumber[table], 0).to(torch.int32)
    pick = (lambda s: s) if kq.scales == "tensor" else (lambda s: s[ids])
    return (formats.dequantize_pool(k_cache[ids], pick(k_scale), kq, dtype),
            formats.dequantize_pool(v_cache[ids], pick(v_scale), kq, dtype), tables)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float | None = None, *, kv_cache_dtype: str = "auto",
                               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference decode attention: gather each sequence's K/V, then plain attention.

    q [num_seqs, num_heads, head_dim] -> out of the same shape and dtype. Computes in
    float32 (float64 for float64 inputs). A quantized pool (``kv_cache_dtype``, see
    ``labkit.memory.formats``) is dequantized first, in that same precision: dequantize, then attend.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ct = compute_dtype(q.dtype)
    if kv_cache_dtype != "auto":
        k_cache, v_cache, block_tables = dequantize_blocks(k_cache, v_cache, k_scale, v_scale, kv_cache_dtype,
                                                           block_tables, seq_lens, ct)
    out = torch.empty_like(q)
    for i, n in enumerate(seq_lens.tolist()):
        k = gather_kv(k_cache, block_tables[i], n).to(ct)
        v = gather_kv(v_cache, block_tables[i], n).to(ct)
        out[i] = attention_ref(q[i : i + 1].to(ct), k, v, scale)[0].to(q.dtype)
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
    ct = compute_dtype(q.dtype)
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
        out[lo:hi] = attention_ref(q[lo:hi].to(ct), k, v, scale).to(q.dtype)
    return out


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, *, kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """Reference scatter, in place: token t goes to block ``slot // block_size``, offset ``slot % block_size``.

    Tokens whose slot is -1 are skipped (padding, or positions a prefix cache already holds).
    A quantized pool is written by ``labkit.memory.formats.write_quantized_kv`` (codes and scales), after
    K's and V's arguments are both checked (``formats.check_write``: the pools, their scales, per tensor
    finite and > 0, as ``write_kv`` checks them), so a refused write changes neither pool.

    Non-finite values in a quantized pool: NaN is stored as int code 0 or fp8 NaN, ±inf saturates to
    ±qmax, and scales come from the finite values only (``labkit.memory.formats``' "Non-finite values").
    """
    if kv_cache_dtype != "auto":
        kq = formats.kv_quant(kv_cache_dtype)
        formats.write_quantized_kv(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, kq)
        return
    keep = slot_mapping >= 0  # seen as one row per slot, the pool takes each token at its slot
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))
