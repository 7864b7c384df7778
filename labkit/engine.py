"""A small serving engine: the book's pieces in one loop (chapter 05).

Each ``Engine.step()`` does what a real engine (vLLM, nano-vllm) does each iteration:

1. ``Scheduler.schedule()`` (chapter 05) picks requests and token counts within the
   token budget and the free blocks, admits waiting requests with their prefix-cache
   hits (chapter 04), preempts when blocks run out, and assigns every new token a slot.
2. Copy-on-write pairs are applied to the K/V pools (block ``src`` -> ``dst``, all layers).
3. The step's tokens from *all* requests are flattened into one batch ``[1, total_tokens]``
   with explicit positions: prompt chunks and single decode tokens side by side.
4. The decoder (chapter 01) runs once. Its attention goes through
   ``PagedAttentionBackend.attend``: ``write_kv`` scatters the new K/V into their slots,
   then the Triton paged-attention kernels (chapter 03) attend over each request's
   blocks, request ``i`` owning query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``.
5. The logits at the last token of each chunk that reaches the end of its known tokens
   are turned into the next token (greedy), and ``Scheduler.postprocess`` appends them,
   finishes requests and releases their blocks.

Nothing here decides *who* runs: that is all in ``labkit.scheduler``, the same code that
chapter 06's simulator drives without a model.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .device import DEVICE
from . import kernels
from .model import Decoder, DecoderConfig
from .prefix import CacheKey
from .scheduler import Request, Scheduler, Step, StepStats

__all__ = ["PagedAttentionBackend", "Engine"]


class PagedAttentionBackend:
    """The K/V pools of every layer, and the decoder's ``attend`` for one flattened step.

    ``k_caches[layer]`` and ``v_caches[layer]`` are ``[num_blocks, block_size, num_kv_heads,
    head_dim]``. Before each forward pass the engine calls ``prepare(step)``, which turns the
    scheduler's plan into the kernels' int32 tensors (slot mapping, block tables, sequence
    lengths, query offsets); every layer's ``attend`` then writes and attends with them.
    ``use_triton=False`` calls the kernels' plain PyTorch references instead (same results,
    much faster than Triton's interpreter on a CPU).
    """

    def __init__(self, config: DecoderConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 use_triton: bool = True):
        self.config, self.block_size, self.dtype = config, block_size, dtype
        self.use_triton = bool(use_triton)
        if self.use_triton:
            self._write_kv = kernels.write_kv
            self._decode = kernels.paged_decode_attention
            self._prefill = kernels.paged_prefill_attention
        else:
            self._write_kv = kernels.write_kv_ref
            self._decode = kernels.paged_decode_attention_ref
            self._prefill = kernels.paged_prefill_attention_ref
        self.device = torch.device(device) if device is not None else DEVICE
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(config.num_hidden_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(config.num_hidden_layers)]
        self._meta: dict[str, Any] | None = None

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer."""
        k = self.k_caches[0]
        return 2 * len(self.k_caches) * k[0].numel() * k.element_size()

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` gets ``src``'s K/V in every layer, before anything writes."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.k_caches + self.v_caches:
            cache[dst] = cache[src]

    def prepare(self, step: Step) -> None:
        """Build the kernels' inputs for the step's chunks, in chunk order."""
        chunks = step.chunks
        max_blocks = max(len(c.block_table) for c in chunks)
        block_tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
        for row, c in enumerate(chunks):
            block_tables[row, :len(c.block_table)] = torch.tensor(c.block_table, dtype=torch.int32)
        q_lens = [c.num_tokens for c in chunks]
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        dev = self.device
        self._meta = {
            "slot_mapping": torch.tensor([s for c in chunks for s in c.slot_mapping], dtype=torch.int64, device=dev),
            "block_tables": block_tables.to(dev),
            "seq_lens": torch.tensor([c.seq_len for c in chunks], dtype=torch.int32, device=dev),
            "cu_seqlens_q": torch.tensor(cu, dtype=torch.int32, device=dev),
            "decode_only": all(n == 1 for n in q_lens),
        }

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [1, total_tokens, Hq, D], k and v [1, total_tokens, Hkv, D]: write K/V, then attend."""
        meta = self._meta
        if meta is None:
            raise ValueError("call prepare(step) before the forward pass")
        if q.dim() != 4 or q.shape[0] != 1 or q.shape[1] != meta["slot_mapping"].shape[0]:
            raise ValueError(f"q must be [1, {meta['slot_mapping'].shape[0]}, num_heads, head_dim] "
                             f"(the step's tokens flattened), got {tuple(q.shape)}")
        kc, vc = self.k_caches[layer_idx], self.v_caches[layer_idx]
        self._write_kv(k[0].to(self.dtype).contiguous(), v[0].to(self.dtype).contiguous(), kc, vc, meta["slot_mapping"])
        qc = q[0].to(self.dtype)
        if meta["decode_only"]:  # every request adds one token: the decode kernel (split-K when long)
            out = self._decode(qc, kc, vc, meta["block_tables"], meta["seq_lens"])
        else:  # prompt chunks and decode tokens together: variable-length causal attention
            out = self._prefill(qc, kc, vc, meta["block_tables"], meta["seq_lens"], meta["cu_seqlens_q"])
        return out[None].to(q.dtype)


class Engine:
    """A continuous-batching engine: decoder + paged K/V + prefix cache + scheduler + Triton kernels.

    ``model``: a ``labkit.model.Decoder``. ``num_blocks`` blocks of ``block_size`` tokens
    form the K/V pool; ``max_num_batched_tokens`` is the token budget of a step.
    ``enable_prefix_caching``, ``priority``: passed to the ``Scheduler``. ``dtype``: of the
    K/V pool (default: the model's). ``use_triton``: the Triton kernels (default) or their
    PyTorch references. Greedy decoding; ``stats`` holds one ``StepStats`` per step.
    """

    def __init__(self, model: Decoder, num_blocks: int, block_size: int = 16, max_num_batched_tokens: int = 256,
                 *, enable_prefix_caching: bool = True, priority: Callable[[Request], Any] | None = None,
                 dtype: torch.dtype | None = None, use_triton: bool = True):
        if not isinstance(model, Decoder):
            raise ValueError(f"model must be a labkit.model.Decoder, got {type(model).__name__}")
        self.model = model
        weight = model.lm_head.weight
        self.dtype = dtype or weight.dtype
        cfg = model.config
        key = CacheKey(model=f"Decoder(seed weights id {id(model)})",
                       cache_dtype=str(self.dtype).removeprefix("torch."), rope_theta=float(cfg.rope_theta))
        self.scheduler = Scheduler(num_blocks, block_size, max_num_batched_tokens,
                                   enable_prefix_caching=enable_prefix_caching, priority=priority, cache_key=key)
        self.backend = PagedAttentionBackend(cfg, num_blocks, block_size, self.dtype, weight.device, use_triton)
        self.stats: list[StepStats] = []

    def add_request(self, prompt_token_ids: Sequence[int], max_new_tokens: int,
                    eos_token_id: int | None = None) -> Request:
        """Queue a prompt; it runs in the coming steps. Returns its ``Request``."""
        return self.scheduler.add_request(self._make_request(prompt_token_ids, max_new_tokens, eos_token_id))

    def _make_request(self, prompt_token_ids: Sequence[int], max_new_tokens: int,
                      eos_token_id: int | None = None) -> Request:
        """A checked ``Request`` (not queued yet)."""
        ids = list(prompt_token_ids) if isinstance(prompt_token_ids, (list, tuple, range)) else prompt_token_ids
        request = Request(ids, max_new_tokens, eos_token_id)
        vocab = self.model.config.vocab_size
        if max(request.prompt_token_ids) >= vocab:
            raise ValueError(f"prompt_token_ids must lie in [0, {vocab - 1}] (vocab_size)")
        self.scheduler.check_fits(request)
        return request

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @torch.no_grad()
    def step(self) -> Step:
        """Schedule, run the model once on every scheduled token, sample, update."""
        step = self.scheduler.schedule()
        sampled: list[int] = []
        if step.chunks:
            self.backend.copy_blocks(step.copies)
            device = self.backend.device
            input_ids = torch.tensor([[t for c in step.chunks for t in c.token_ids]], device=device)
            positions = torch.tensor([[p for c in step.chunks for p in c.positions]], device=device)
            self.backend.prepare(step)
            logits = self.model(input_ids, positions, cache=self.backend)[0]
            ends, end = [], 0
            for c in step.chunks:
                end += c.num_tokens
                if c.samples:
                    ends.append(end - 1)
            sampled = logits[ends].argmax(dim=-1).tolist()
        elif self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler planned nothing although requests are unfinished")
        self.scheduler.postprocess(step, sampled)
        self.stats.append(step.stats)
        return step

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Serve every prompt to completion; the generated token ids of each, in prompt order."""
        if not prompts:
            raise ValueError("prompts must hold at least one prompt")
        requests = [self._make_request(p, max_new_tokens) for p in prompts]  # all checked before any is queued
        for request in requests:
            self.scheduler.add_request(request)
        while self.has_unfinished():
            self.step()
        return [list(r.output_token_ids) for r in requests]
