"""Attention one token at a time, by chapter 01's decode step (the capstone).

Chapter 01's exercise is one decode step of one layer for one sequence,
``decode_step(k_cache, v_cache, q, k, v, inv_freq) -> (k_cache, v_cache, out)``: rotate the new token's
``q`` and ``k`` to its position, which is the cache length (RoPE), append ``k`` and ``v``, attend over
every cached position. ``decode_step`` here is labkit's own answer; ``StepwiseKV`` is a ``KVPool`` whose
``attend`` runs such a step, labkit's or the reader's, for every new token of every sequence in a pass:

1. gather the sequence's cached K and V from its blocks into ``[T, Hkv, D]`` (its block table);
2. step through the chunk's tokens, each one's cache the one the step before returned;
3. scatter the appended rows into the chunk's slots (its slot mapping), for the next pass to gather.

The step rotates ``q`` and ``k`` itself, so the model must hand them over unrotated: ``rope_positions``
gives it position 0 for every token, a turn by 0 (cos 1, sin 0) that changes nothing. The K stored in the
pool are the step's rotated keys, as in every other pool. One Python call per token, layer and sequence
makes this a path for reading and checking, not for speed: the batched path computes the same numbers.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..model.decoder import DecoderConfig, apply_rope, rope_cos_sin, rope_inv_freq
from .paged import KVPool

__all__ = ["decode_step", "StepwiseKV"]

DecodeStep = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def decode_step(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step of one layer, labkit's answer to chapter 01's exercise.

    ``k_cache``, ``v_cache`` ``[T, Hkv, D]`` (keys rotated at positions 0 .. T - 1), ``q`` ``[Hq, D]``, ``k``,
    ``v`` ``[Hkv, D]``, ``inv_freq`` ``[D / 2]``. The new token is token T: ``q`` and ``k`` turn there with the
    decoder's ``rope_cos_sin`` and ``apply_rope``. One query needs no mask: it sees every cached position.
    Query head ``h`` reads KV head ``h // group``, as a view ``[Hkv, group, D]`` with no copy.
    Returns the caches with the new row appended and ``out`` ``[Hq, D]``.
    """
    cos, sin = rope_cos_sin(torch.tensor([[k_cache.shape[0]]], device=q.device), inv_freq)
    q, k = (apply_rope(x[None, None], cos, sin)[0, 0] for x in (q, k))  # apply_rope takes [batch, seq, ...]
    k_cache, v_cache = torch.cat([k_cache, k[None].to(k_cache.dtype)]), torch.cat([v_cache, v[None].to(v_cache.dtype)])
    heads = k_cache.shape[1]
    scores = q.view(heads, -1, q.shape[-1]) @ k_cache.permute(1, 2, 0) / q.shape[-1] ** 0.5  # [Hkv, group, T + 1]
    out = scores.softmax(dim=-1) @ v_cache.transpose(0, 1)  # [Hkv, group, D]
    return k_cache, v_cache, out.reshape(q.shape)


class StepwiseKV(KVPool):
    """A ``KVPool`` whose attention is a decode step run token by token (the module's three steps).

    ``step``: a function with ``decode_step``'s signature. ``where`` (a dict, shared with whoever asks):
    before each call it holds ``layer``, ``sequence`` (the pass's sequence index) and ``position``, so a
    checker can say where a step went wrong. The pass is described by ``meta``, as for every ``KVPool``.
    """

    def __init__(self, step: DecodeStep, config: DecoderConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 where: dict | None = None):
        if not callable(step):
            raise ValueError(f"step must be a function like decode_step(k_cache, v_cache, q, k, v, inv_freq), "
                             f"got {type(step).__name__}")
        super().__init__(config, num_blocks, block_size, dtype, device, use_triton=False)
        self.step, self.where = step, {} if where is None else where
        self.inv_freq = rope_inv_freq(config, self.device)

    def rope_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Position 0 for every token: the step applies RoPE itself, at the cache length."""
        return torch.zeros_like(positions)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [batch, new, Hq, D], k and v [batch, new, Hkv, D] (unrotated), flattened in the order of ``meta``."""
        meta = self.meta
        self._check_qkv(q, k, v, None if meta is None else meta.slot_mapping.numel())
        heads, d, bs = self.config.num_key_value_heads, self.config.head_dim, self.block_size
        k_pool, v_pool = (c[layer_idx].view(-1, heads, d) for c in (self.k_caches, self.v_caches))  # slot rows
        flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
        out, rows = torch.empty_like(flat[0]), list(zip(*(t.unbind(0) for t in flat)))  # each token's q, k, v
        cu, seq_lens = meta.cu_seqlens_q.tolist(), meta.seq_lens.tolist()
        for i, seq_len in enumerate(seq_lens):
            first, last = cu[i], cu[i + 1]
            start = seq_len - (last - first)  # positions cached before this pass
            pos = torch.arange(start, device=self.device)
            past = meta.block_tables[i].to(self.device).long()[pos // bs] * bs + pos % bs  # their slots
            k_cache, v_cache = k_pool[past], v_pool[past]
            for t in range(first, last):
                self.where.update(layer=layer_idx, sequence=i, position=start + t - first)
                k_cache, v_cache, out[t] = self.step(k_cache, v_cache, *rows[t], self.inv_freq.clone())
            slots = meta.slot_mapping[first:last]
            k_pool[slots], v_pool[slots] = k_cache[start:].to(self.dtype), v_cache[start:].to(self.dtype)
        return out.view(q.shape)
