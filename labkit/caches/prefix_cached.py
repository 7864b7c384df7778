"""A paged pool whose blocks the prefix cache shares between requests (chapter 04).

``PrefixCachedPool`` is a ``KVPool`` (``labkit.caches.paged``) whose block tables come from a
``PrefixCache`` (``labkit.memory.prefix``, the bookkeeping: hashes, reference counts, eviction): a
request that starts like an earlier one points its table at the blocks that already hold those K/V,
and the model runs on the rest of its prompt only. ``generate_with_prefix_cache`` serves one request
at a time on it; chapter 05's engine serves many at once.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from ..checks import check_flag, check_int, check_token_ids
from ..memory.paging import BlockAllocator
from ..memory.prefix import CachedBlockTable, CacheKey, PrefixCache
from ..model.decoder import check_decoder, check_vocab
from .paged import AttentionMetadata, KVPool


class PrefixCachedPool(KVPool):
    """Paged K/V pools for a ``Decoder`` whose blocks a ``PrefixCache`` manages, one sequence at a time.

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


def generate_with_prefix_cache(model, kv: PrefixCachedPool, prompt_ids: Sequence[int], max_new_tokens: int,
                               key: CacheKey | None = None) -> PrefixGeneration:
    """Greedy decoding of one request on ``kv``: prefill only the uncached suffix, then decode.

    Reuses blocks named by earlier requests of the same ``model`` on ``kv`` (``key`` defaults to
    ``kv.key(model=model)``) and names its own full blocks for later ones.
    """
    check_decoder(model)
    if not isinstance(kv, PrefixCachedPool):
        raise ValueError(f"kv must be a labkit.caches.prefix_cached.PrefixCachedPool, got {type(kv).__name__}")
    check_int("max_new_tokens", max_new_tokens, 1)
    prompt = check_token_ids("prompt_ids", prompt_ids, 1)
    check_vocab(prompt, model.config.vocab_size)  # before begin(): a bad id must change nothing
    device = model.lm_head.weight.device
    num_cached = kv.begin(prompt, key or kv.key(model=model))
    try:
        with torch.no_grad():
            last = torch.tensor([len(prompt) - num_cached - 1], device=device)  # logits of the last token only
            logits = model(torch.tensor([prompt[num_cached:]], device=device), cache=kv, logits_indices=last)[0, -1]
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
