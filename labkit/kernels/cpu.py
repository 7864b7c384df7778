"""Paged attention on a CPU: the same arithmetic as the references, a whole batch per call.

The references loop over sequences, a dozen small operations each, for every layer. On a CPU that
loop, not the arithmetic, dominates a step of a real model, and Triton's interpreter is far slower
still. Here a pass is planned once (``plan_batch``): which pool slots each sequence reads, where each
query row sits, what it may see. Every layer then reads all the sequences' slots in one
``index_select`` and attends with one ``scaled_dot_product_attention`` call per group of sequences:
one group for the decode rows (one new token each), one for the prompt chunks (padded to the longest
chunk). ``labkit.caches.paged.KVPool`` runs this with ``use_triton=False`` (on a CPU, the default),
building the plan at layer 0 and reusing it in the other layers. vLLM's GPU model runner also builds
its attention metadata once per step, before the forward pass (``GPUModelRunner._prepare_inputs``,
``vllm/v1/worker/gpu_model_runner.py``). ``tests/test_kernels.py`` holds all of it to the references.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..memory.blocks import blocks_needed
from .reference import compute_dtype, dequantize_blocks, write_kv_ref


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


@dataclass(frozen=True)
class Group:
    """Sequences attended to in one call: ``n`` of them, ``q_max`` query rows each, ``width`` key positions each.

    ``q_rows`` [n * q_max]: the row of the pass's queries each padded row takes (a chunk shorter than
    ``q_max`` repeats its last row). ``keep``: the padded rows that are queries of their own, and
    ``rows`` the pass's rows they go back to (None, None: all of them, no repeats). ``slots`` [n * width]:
    the pool slots read, ``token_slots``. ``mask`` [n, 1, q_max * per_kv, width]: key position ``p`` is
    visible to a query at position ``t`` when ``p <= t`` (causal; a sequence's padding lies past its last
    query), row ``j * per_kv + i`` for query ``j``'s ``i``-th head of a KV head (``paged_attention``).
    """

    n: int
    q_max: int
    width: int
    q_rows: torch.Tensor
    keep: torch.Tensor | None
    rows: torch.Tensor | None
    slots: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class BatchPlan:
    """One pass over a paged pool, planned once for all its layers (``plan_batch``).

    The kernels' inputs (``block_tables``, ``seq_lens``, ``cu_seqlens_q``, ``slot_mapping``) and GQA's
    group (``per_kv``, query heads per KV head), then what every layer reads alike: the attention
    ``groups`` (``in_order``: one group whose rows are the pass's rows in order, so nothing is gathered or
    scattered) and the writes (``written``: the slots that take a token, ``written_from``: which tokens,
    None meaning all; slot -1 takes none).
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor
    per_kv: int
    groups: tuple[Group, ...]
    in_order: bool
    written: torch.Tensor
    written_from: torch.Tensor | None


def _group(selected: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
           q_lens: torch.Tensor, block_size: int, per_kv: int) -> Group:
    q_len, seq_len, start = q_lens[selected], seq_lens[selected].long(), cu_seqlens_q[:-1][selected].long()
    q_max = int(q_len.max())
    j = torch.arange(q_max, device=q_lens.device)[None, :]
    last = torch.minimum(j, (q_len - 1)[:, None])  # a padded row repeats its chunk's last query
    q_rows = (start[:, None] + last).reshape(-1)
    real = (j < q_len[:, None]).reshape(-1)
    keep = None if bool(real.all()) else real.nonzero().flatten()
    slots = token_slots(block_tables[selected], seq_len, block_size)
    position = seq_len[:, None] - q_len[:, None] + last  # of each padded query row
    mask = torch.arange(slots.shape[1], device=q_lens.device)[None, None, :] <= position[:, :, None]
    if q_max > 1:  # each query's row repeated for the heads that share a KV head; one row broadcasts
        mask = mask.repeat_interleave(per_kv, dim=1)
    return Group(len(selected), q_max, slots.shape[1], q_rows, keep, None if keep is None else q_rows[keep],
                 slots.reshape(-1), mask[:, None])


def plan_batch(block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
               block_size: int, slot_mapping: torch.Tensor | None = None, per_kv: int = 1) -> BatchPlan:
    """Plan a pass (the kernels' arguments): sequences with one new token form the decode group, those
    with more the chunk group, those with none are left out. ``slot_mapping``: where the pass's K and V
    go (None: nowhere, an attention-only call). ``per_kv``: query heads per KV head (GQA's group)."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    groups = tuple(_group(selected, block_tables, seq_lens, cu_seqlens_q, q_lens, block_size, per_kv)
                   for selected in ((q_lens == 1).nonzero().flatten(), (q_lens > 1).nonzero().flatten())
                   if selected.numel())
    total = int(cu_seqlens_q[-1]) if cu_seqlens_q.numel() else 0
    in_order = (len(groups) == 1 and groups[0].keep is None and groups[0].q_rows.numel() == total
                and bool((groups[0].q_rows == torch.arange(total, device=q_lens.device)).all()))
    if slot_mapping is None:
        slot_mapping = torch.full((0,), -1, dtype=torch.long, device=q_lens.device)
    kept = slot_mapping >= 0
    written_from = None if bool(kept.all()) else kept.nonzero().flatten()
    written = slot_mapping.long() if written_from is None else slot_mapping[written_from].long()
    return BatchPlan(block_tables, seq_lens, cu_seqlens_q, slot_mapping, per_kv, groups, in_order, written,
                     written_from)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: BatchPlan,
             **kv_args) -> None:
    """``write_kv_ref`` with the plan's slots: token ``t``'s K and V (``[..., Hkv, D]``, tokens in the pass's
    order) into their slots, in place. A quantized pool (``kv_args``) is written by the reference itself."""
    k, v = k.reshape(-1, *k.shape[-2:]), v.reshape(-1, *v.shape[-2:])
    if kv_args.get("kv_cache_dtype", "auto") != "auto":
        write_kv_ref(k, v, k_cache, v_cache, plan.slot_mapping, **kv_args)
        return
    for new, cache in ((k, k_cache), (v, v_cache)):  # seen as one row per slot, the pool takes each token
        if plan.written_from is not None:
            new = new.index_select(0, plan.written_from)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, plan.written, new if new.dtype == cache.dtype
                                                      else new.to(cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: BatchPlan,
                    scale: float | None = None, *, kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the pass's queries q [rows, Hq, D] over the pool, one call per group of ``plan``.

    Each group's K and V are read in one ``index_select`` (one row per slot of the pool seen as
    ``[num_blocks * block_size, Hkv, D]``), and one ``scaled_dot_product_attention`` call attends with
    the group's mask. GQA is folded into the query length: query head ``h`` reads KV head ``h // g``
    (``g`` query heads per KV head), so each KV head attends with its ``g`` heads' rows as
    ``q_max * g`` queries of its own, as the Triton kernels run one program per (sequence, KV head);
    a few long attention problems cost a CPU less than many short ones.
    It computes in float32 (float64 for float64 inputs), as the references do. A quantized pool is
    dequantized first (``dequantize_blocks``) into q's dtype as the compiled kernels see it: each code
    × its scale in float32, rounded once to q's dtype (``labkit.memory.formats.dequantize``); its tables
    are then renumbered, so such a pass is planned again here.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if kv_cache_dtype != "auto":
        k_cache, v_cache, tables = dequantize_blocks(k_cache, v_cache, k_scale, v_scale, kv_cache_dtype,
                                                     plan.block_tables, plan.seq_lens, q.dtype)
        plan = plan_batch(tables, plan.seq_lens, plan.cu_seqlens_q, k_cache.shape[1], per_kv=plan.per_kv)
    ct, (num_kv_heads, head_dim), num_heads = compute_dtype(q.dtype), k_cache.shape[2:], q.shape[1]
    if num_heads != num_kv_heads * plan.per_kv:
        raise ValueError(f"q has {num_heads} heads, but the plan was made for {plan.per_kv} per KV head "
                         f"({num_kv_heads} KV heads)")
    keys, values = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    cast = (lambda t: t) if q.dtype == ct and k_cache.dtype == ct else (lambda t: t.to(ct))  # noqa: E731
    out = None if plan.in_order else torch.empty_like(q)
    for g in plan.groups:
        shape = (g.n, g.width, num_kv_heads, head_dim)
        k = cast(keys.index_select(0, g.slots).view(shape).transpose(1, 2))  # [n, Hkv, width, D]
        v = cast(values.index_select(0, g.slots).view(shape).transpose(1, 2))
        rows = q if plan.in_order else q.index_select(0, g.q_rows)
        folded = (g.n, num_kv_heads, g.q_max * plan.per_kv, head_dim)
        if g.q_max == 1:  # one query per sequence: [n, Hq, D] is already [n, Hkv, per_kv, D]
            rows = rows.reshape(folded)
        else:  # [n, q_max, Hkv, per_kv, D] -> [n, Hkv, q_max * per_kv, D]
            rows = rows.view(g.n, g.q_max, num_kv_heads, plan.per_kv, head_dim).transpose(1, 2).reshape(folded)
        o = F.scaled_dot_product_attention(cast(rows), k, v, attn_mask=g.mask, scale=scale)
        if g.q_max > 1:
            o = o.view(g.n, num_kv_heads, g.q_max, plan.per_kv, head_dim).transpose(1, 2)
        o = o.reshape(-1, num_heads, head_dim)  # [n * q_max, Hq, D]
        o = o if o.dtype == q.dtype else o.to(q.dtype)
        if plan.in_order:
            return o
        if g.keep is None:
            out.index_copy_(0, g.q_rows, o)
        else:
            out.index_copy_(0, g.rows, o.index_select(0, g.keep))
    return out if out is not None else torch.empty_like(q)


def paged_decode_attention_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                   scale: float | None = None, **kv_args) -> torch.Tensor:
    """Decode attention for the whole batch, the arguments of ``paged_decode_attention_ref``: one query
    row per sequence, planned here (``plan_batch``) and attended in one call (``paged_attention``).

    It is what transformers does on a CPU, with the gather in place of its contiguous cache. The same
    arithmetic as the reference; ``tests/test_kernels.py`` checks it against the reference on ragged
    lengths, shuffled block tables and a NaN-poisoned pool.
    """
    cu = torch.arange(seq_lens.numel() + 1, dtype=torch.int32, device=seq_lens.device)
    plan = plan_batch(block_tables.clamp(0, k_cache.shape[0] - 1), seq_lens.to(q.device), cu, k_cache.shape[1],
                      per_kv=q.shape[1] // k_cache.shape[2])
    return paged_attention(q, k_cache, v_cache, plan, scale, **kv_args)


def paged_attention_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            scale: float | None = None, **kv_args) -> torch.Tensor:
    """A mixed step, the arguments of ``paged_prefill_attention_ref``: the decode rows in one call, the
    prompt chunks in another, each padded to the longest (``plan_batch``, ``paged_attention``).

    With continuous batching many steps are mixed: a request that finished frees a slot, a waiting
    one is admitted, and its prompt chunk runs beside fifteen single decode tokens. Padding those
    fifteen to the chunk's length would multiply their work; a group of their own keeps it at one row each.
    """
    plan = plan_batch(block_tables.clamp(0, k_cache.shape[0] - 1), seq_lens, cu_seqlens_q, k_cache.shape[1],
                      per_kv=q.shape[1] // k_cache.shape[2])
    return paged_attention(q, k_cache, v_cache, plan, scale, **kv_args)
