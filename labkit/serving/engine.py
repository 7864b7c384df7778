"""A small serving engine: the book's pieces in one loop (chapter 05).

Each ``Engine.step()`` follows what vLLM v1 does each iteration (``vllm/v1/engine/core.py``,
``EngineCore.step``: schedule, execute the model, update from the output):

1. ``Scheduler.schedule()`` (chapter 05) picks requests and token counts within the
   token budget and the free blocks, admits waiting requests with their prefix-cache
   hits (chapter 04), preempts when blocks run out, and assigns every new token a slot.
2. labkit only: copy-on-write pairs are applied to the K/V pools (block ``src`` -> ``dst``,
   all layers). They come from ``ForkingScheduler.fork`` (``labkit.serving.variants.forking``, pass
   ``scheduler_cls=ForkingScheduler``), chapter 04's way to sample several
   answers from one prompt: the twins share every block, and the first to write into a
   shared, partly filled tail gets a private copy. vLLM v1 does no such copy: its parallel
   sampling makes independent child requests (``vllm/v1/engine/parallel_sampling.py``),
   which share the prompt's full blocks through the prefix cache (when it is on) and each
   compute their own last, partial block.
3. The step's tokens from *all* requests are flattened into one batch ``[1, total_tokens]``
   with explicit positions: prompt chunks and single decode tokens side by side, as vLLM v1
   batches them. (nano-vllm does not mix them: each of its steps is prefill only or decode only.)
4. The decoder (chapter 01, prepared once at load: ``labkit.model.fused.prepare``) runs once.
   Its attention goes through ``KVPool.attend`` (chapter 03): the new K/V are scattered into
   their slots, then attention reads each request's blocks, request ``i`` owning query rows
   ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``: the Triton paged-attention kernels on a GPU, the
   batched PyTorch path on a CPU (``labkit.kernels.cpu``, planned once for all layers).
5. The logits at the last token of each chunk that reaches the end of its known tokens
   (and only there: ``logits_indices``, as vLLM computes them) are turned into the next token
   (greedy), and ``Scheduler.postprocess`` appends them, finishes requests and releases their
   blocks. A request also finishes on an end-of-sequence token: a real model's
   ``config.eos_token_id`` (a chat model may list several).

Nothing here decides *who* runs: that is all in ``labkit.serving.scheduler``, the same code that
chapter 06's simulator drives without a model.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..caches.paged import AttentionMetadata, KVPool
from ..caches.stepwise import StepwiseKV
from ..checks import check_flag, parse_stop_token_ids
from ..memory.prefix import CacheKey
from ..model import fused
from ..model.decoder import Decoder
from .pieces import Pieces, PiecesScheduler
from .request import Request
from .scheduler import Scheduler
from .step import Step, StepStats

__all__ = ["Engine"]


class Engine:
    """A continuous-batching engine: decoder + paged K/V + prefix cache + scheduler + attention kernels.

    ``model``: a ``labkit.model.decoder.Decoder``. ``num_blocks`` blocks of ``block_size`` tokens
    form the K/V pool; ``max_num_batched_tokens`` is the token budget of a step and
    ``max_num_seqs`` the most requests running at once.
    ``enable_prefix_caching``, ``full_sequence_must_fit`` (vLLM's admission gate, on by default):
    passed to the scheduler, an instance of ``scheduler_cls`` (a ``Scheduler`` or a variant of it,
    such as ``labkit.serving.variants.forking.ForkingScheduler``). ``dtype``: of the
    K/V pool (default: the model's). ``use_triton``: the Triton kernels (True) or the CPU's batched
    PyTorch path (False); None picks the kernels on a GPU and the batched path on a CPU
    (``labkit.caches.paged.KVPool``). Greedy decoding; ``stats`` holds one ``StepStats`` per step.

    ``prepare`` (default True): the model is prepared once, in place, as vLLM prepares one after loading
    it (``labkit.model.fused.prepare``): on a CPU in float32 its q/k/v and gate/up projections are fused
    and every multiply is prepacked for oneDNN; anywhere else it is left as it is. Its outputs stay the
    plain model's up to the order of float32 sums; ``prepare=False`` runs the model as given.

    ``pieces`` (the capstone, ``labkit.serving.pieces``): the four decisions of a step made by the book's
    build-it pieces, the reader's or labkit's (``Pieces()``: labkit's in every seam). The scheduler is then a
    ``PiecesScheduler`` (the article's rules, asked of ``plan_step``; ``max_num_seqs`` and
    ``full_sequence_must_fit`` do not apply) and the pool a ``StepwiseKV`` (attention by ``decode_step``,
    token by token); the model, sampling and this loop are the same.

    End of sequence: a request stops after ``max_new_tokens`` or after emitting one of its
    ``eos_token_id`` (default: the model's ``config.eos_token_id``, one id or a list; pass
    ``()`` to ignore it). The EOS token is part of the output, as in transformers' ``generate``.
    """

    def __init__(self, model: Decoder, num_blocks: int, block_size: int = 16, max_num_batched_tokens: int = 256,
                 *, max_num_seqs: int = 256, enable_prefix_caching: bool = True,
                 full_sequence_must_fit: bool = True, scheduler_cls: type[Scheduler] = Scheduler,
                 dtype: torch.dtype | None = None, use_triton: bool | None = None, prepare: bool = True,
                 pieces: Pieces | None = None):
        if not isinstance(model, Decoder):
            raise ValueError(f"model must be a labkit.model.decoder.Decoder, got {type(model).__name__}")
        self.model = model
        weight = model.lm_head.weight
        self.dtype = dtype or weight.dtype
        cfg = model.config
        key = CacheKey(model=f"labkit Decoder {id(model):#x}",  # these weights, in this process
                       cache_dtype=str(self.dtype).removeprefix("torch."), rope_theta=float(cfg.rope_theta))
        if not (isinstance(scheduler_cls, type) and issubclass(scheduler_cls, Scheduler)):
            raise ValueError(f"scheduler_cls must be labkit.serving.scheduler.Scheduler or a subclass, "
                             f"got {scheduler_cls!r}")
        check_flag("prepare", prepare)
        if pieces is None:
            self.scheduler = scheduler_cls(num_blocks, block_size, max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                           enable_prefix_caching=enable_prefix_caching, cache_key=key,
                                           full_sequence_must_fit=full_sequence_must_fit)
            self.backend = KVPool(cfg, num_blocks, block_size, self.dtype, weight.device, use_triton)
        else:  # the capstone: the four pieces decide, labkit's where a seam is None (labkit.serving.pieces)
            if not isinstance(pieces, Pieces) or scheduler_cls is not Scheduler:
                raise ValueError(f"pieces must be None or a labkit.serving.pieces.Pieces, with the default "
                                 f"scheduler_cls, got {type(pieces).__name__} and {scheduler_cls.__name__}")
            pieces = pieces.resolved()
            self.scheduler = PiecesScheduler(pieces, num_blocks, block_size, max_num_batched_tokens,
                                             enable_prefix_caching=enable_prefix_caching, cache_key=key)
            self.backend = StepwiseKV(pieces.decode_step, cfg, num_blocks, block_size, self.dtype, weight.device,
                                      where=pieces.where)
        self.stats: list[StepStats] = []
        if prepare:  # last: a refused argument leaves the model as it was
            fused.prepare(model)

    def add_request(self, prompt_token_ids: Sequence[int], max_new_tokens: int,
                    eos_token_id: int | Sequence[int] | None = None, request_id: Any = None) -> Request:
        """Queue a prompt; it runs in the coming steps. Returns its ``Request``.

        ``eos_token_id``: the id(s) that end it early; None means the model's ``config.eos_token_id``.
        ``request_id``: its name (hashable, unique among unfinished requests); None numbers it.
        """
        return self.scheduler.add_request(self.make_request(prompt_token_ids, max_new_tokens, eos_token_id,
                                                            request_id))

    def _eos_ids(self, eos_token_id: int | Sequence[int] | None) -> tuple[int, ...]:
        """The stop ids, checked against the vocabulary (empty: never stop early)."""
        if eos_token_id is None:
            eos_token_id = self.model.config.eos_token_id
        return parse_stop_token_ids(eos_token_id, vocab_size=self.model.config.vocab_size)

    def make_request(self, prompt_token_ids: Sequence[int], max_new_tokens: int,
                     eos_token_id: int | Sequence[int] | None = None, request_id: Any = None) -> Request:
        """A checked ``Request``, not queued yet (``add_request`` queues one); it stops on any of its EOS ids."""
        ids = list(prompt_token_ids) if isinstance(prompt_token_ids, (list, tuple, range)) else prompt_token_ids
        eos = self._eos_ids(eos_token_id)
        request = (Request(ids, max_new_tokens, eos or None) if request_id is None else
                   Request(ids, max_new_tokens, eos or None, request_id=request_id))
        vocab = self.model.config.vocab_size
        if max(request.prompt_token_ids) >= vocab:
            raise ValueError(f"prompt_token_ids must lie in [0, {vocab - 1}] (vocab_size)")
        self.scheduler.check_fits(request)
        return request

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @torch.inference_mode()  # as vLLM runs its model: no autograd bookkeeping on any tensor
    def step(self) -> Step:
        """Schedule, run the model once on every scheduled token, sample, update."""
        step = self.scheduler.schedule()
        sampled: list[int] = []
        if step.chunks:
            self.backend.copy_blocks(step.copies)
            device = self.backend.device
            input_ids = torch.tensor([[t for c in step.chunks for t in c.token_ids]], device=device)
            positions = self.backend.rope_positions(
                torch.tensor([[p for c in step.chunks for p in c.positions]], device=device))
            self.backend.meta = AttentionMetadata.build(
                [c.block_table for c in step.chunks], [c.seq_len for c in step.chunks],
                [c.num_tokens for c in step.chunks], [s for c in step.chunks for s in c.slot_mapping], device)
            ends, end = [], 0  # the last token of each chunk that samples: only there are logits needed
            for c in step.chunks:
                end += c.num_tokens
                if c.samples:
                    ends.append(end - 1)
            logits = self.model(input_ids, positions, cache=self.backend,
                                logits_indices=torch.tensor(ends, dtype=torch.long, device=device))[0]
            sampled = logits.argmax(dim=-1).tolist()
        elif self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler planned nothing although requests are unfinished")
        self.scheduler.postprocess(step, sampled)
        self.stats.append(step.stats)
        return step

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None = None) -> list[list[int]]:
        """Serve every prompt to completion; the generated token ids of each, in prompt order.

        Each stops after ``max_new_tokens`` or at an ``eos_token_id`` (None: the model's).
        """
        if not prompts:
            raise ValueError("prompts must hold at least one prompt")
        # all checked before any is queued
        requests = [self.make_request(p, max_new_tokens, eos_token_id) for p in prompts]
        for request in requests:
            self.scheduler.add_request(request)
        while self.has_unfinished():
            self.step()
        return [list(r.output_token_ids) for r in requests]
