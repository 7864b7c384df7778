"""Measured engine steps: what the cost model reads from a step, and how long it took (appendix A6).

Chapter 06's simulator times each step with a roofline (``labkit.serving.sim.costmodel``) and
datasheet figures, so its latencies are a model's. To check the model against a real engine, the
book's ``Engine`` serves real requests on the machine at hand and every step is timed together with
what the cost model reads from it (``step_sums``: Σ new tokens, Σ context tokens and Σ attention
pairs): ``measure_steps``. Which steps a calibration times decides what a fit can learn from them,
so ``measure_step_grid`` chooses them: decodes at several batch sizes and prompt chunks of several
lengths. The machine's memory bandwidth is measured apart, by one copy (``measure_stream_bandwidth``).
``labkit.serving.sim.fit`` fits the rest of the roofline to these samples;
``labkit.serving.sim.realtime`` serves requests on the wall clock to test the fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ...checks import check_int, check_number
from ...memory.blocks import blocks_needed
from ...units import MiB
from ..engine import Engine
from ..request import Request
from .simulator import step_sums
from .workloads import RequestSpec, check_specs


@dataclass(frozen=True)
class StepSample:
    """One measured engine step: what the cost model reads from it, and how long it took.

    Counts are integers >= 0, ``pairs`` and ``seconds`` finite numbers >= 0, all checked when the sample
    is built: a NaN time would make every fit to it NaN.
    """

    new_tokens: int
    context_tokens: int
    pairs: float
    seconds: float
    num_requests: int = 0  # requests in the step (0: not recorded); a decode step has one new token each

    def __post_init__(self) -> None:
        for name in ("new_tokens", "context_tokens", "num_requests"):
            check_int(name, getattr(self, name), 0)
        check_number("pairs", self.pairs, 0, finite=True)
        check_number("seconds", self.seconds, 0, finite=True)
        if self.num_requests > self.new_tokens:
            raise ValueError(f"num_requests must be <= new_tokens ({self.new_tokens}): each request in a step "
                             f"computes at least one token, got {self.num_requests}")

    @property
    def is_decode(self) -> bool:
        """Every request in the step computes one token: no prompt chunk."""
        return 0 < self.num_requests == self.new_tokens


def check_engine(engine: object) -> Engine:
    """``engine`` if it is an idle ``labkit.serving.engine.Engine``: TypeError for anything else, ValueError
    while it still has unfinished requests (their steps would be timed with the new ones)."""
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a labkit.serving.engine.Engine, got {type(engine).__name__}")
    if engine.has_unfinished():
        raise ValueError("engine must be idle: it still has unfinished requests, whose steps would be timed too")
    return engine


def engine_requests(engine: Engine, specs: object) -> list[Request]:
    """One ``Request`` of ``engine`` per spec (no early stop), every one checked (its tokens in the model's
    vocabulary, its length within the pool) before any is queued; the engine is checked first."""
    check_engine(engine)
    return [engine.make_request(spec.prompt_token_ids, spec.output_len, eos_token_id=())
            for spec in check_specs("specs", specs)]


def timed_step(engine: Engine) -> StepSample:
    """Run one engine step; what it computed, and how long it took."""
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a labkit.serving.engine.Engine, got {type(engine).__name__}")
    start = time.perf_counter()
    step = engine.step()
    seconds = time.perf_counter() - start
    return StepSample(*step_sums(step), seconds, len(step.chunks))


def measure_steps(engine: Engine, specs: Sequence[RequestSpec]) -> list[StepSample]:
    """Serve ``specs`` at once (arrival times ignored; no early stop), timing every step that ran the model.

    ``engine``: an idle ``Engine``; ``specs``: a list of ``RequestSpec``, all checked before any is queued.
    """
    for request in engine_requests(engine, specs):
        engine.scheduler.add_request(request)
    samples = []
    while engine.has_unfinished():
        sample = timed_step(engine)
        if sample.new_tokens:
            samples.append(sample)
    return samples


def _check_sizes(name: str, values: object) -> tuple[int, ...]:
    """``values`` as a non-empty tuple of integers >= 1, else ValueError naming ``name``."""
    if not isinstance(values, (list, tuple, range)) or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty list or tuple of integers >= 1, got {values!r}")
    return tuple(check_int(name, v, 1) for v in values)


def measure_step_grid(engine: Engine, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
                      chunk_lens: Sequence[int] = (24, 48, 96), decode_steps: int = 4, prompt_len: int = 8,
                      rounds: int = 2, seed: int = 0) -> list[StepSample]:
    """Steps of chosen shapes, timed: decodes at every batch size, prompt chunks of several lengths.

    A fit learns only what its steps vary: fitted to decodes of a few requests, it predicts those and
    nothing else. So the steps are chosen, and run in short bursts:

    - for each batch size ``B`` in ``batch_sizes``, ``B`` requests with ``prompt_len``-token prompts
      arrive at once; one step computes their prompts together (``B × prompt_len`` new tokens from
      ``B`` requests), then ``decode_steps`` steps decode all ``B`` (one new token each);
    - for each length ``L`` in ``chunk_lens``, one request with an ``L``-token prompt and a
      one-token reply: one step with ``L`` new tokens and nothing cached.

    The grid runs ``rounds`` times in turn and every step is kept: a busy spell on a shared machine
    slows the steps of one round, not every step of one shape, so a median over a shape's steps
    stands. One untimed step runs first: what the first step of a fresh engine pays once is not a
    step's cost.
    The prompts are token ids drawn at random (``seed``) from the model's vocabulary: a step's time
    does not depend on which tokens, and prompts drawn at random share no block, so the prefix cache
    leaves every token to compute (a second grid on the same engine needs another seed: the same seed
    draws the same prompts, and the cache would find them).

    ``engine``: an idle ``Engine`` whose token budget holds the longest chunk and the largest batch's
    prompts in one step, whose ``max_num_seqs`` holds the largest batch, and whose pool holds it to the
    end (all checked before anything runs). Returns the ``StepSample`` of every timed step, in order:
    ``rounds × len(batch_sizes) × (1 + decode_steps) + rounds × len(chunk_lens)`` of them.
    """
    check_engine(engine)
    batch_sizes, chunk_lens = _check_sizes("batch_sizes", batch_sizes), _check_sizes("chunk_lens", chunk_lens)
    decode_steps, prompt_len = check_int("decode_steps", decode_steps, 1), check_int("prompt_len", prompt_len, 1)
    rounds, rng = check_int("rounds", rounds, 1), np.random.default_rng(check_int("seed", seed, 0))
    sched = engine.scheduler
    budget, widest = sched.max_num_batched_tokens, max(batch_sizes)
    if max(chunk_lens) > budget:
        raise ValueError(f"chunk_lens must be <= the engine's token budget (max_num_batched_tokens = {budget}), "
                         f"so that each chunk is one step; got {max(chunk_lens)}")
    if widest * prompt_len > budget:
        raise ValueError(f"batch_sizes × prompt_len must be <= the engine's token budget (max_num_batched_tokens = "
                         f"{budget}), so that a batch's prompts are one step; got {widest} × {prompt_len}")
    if widest > sched.max_num_seqs:
        raise ValueError(f"batch_sizes must be <= the engine's max_num_seqs ({sched.max_num_seqs}), got {widest}")
    held = widest * blocks_needed(prompt_len + decode_steps, sched.block_size)
    if held > sched.num_blocks:
        raise ValueError(f"batch_sizes: {widest} requests of {prompt_len} + {decode_steps} tokens need {held} "
                         f"blocks, more than the engine's pool of {sched.num_blocks}")
    if (chunk_blocks := blocks_needed(max(chunk_lens), sched.block_size)) > sched.num_blocks:
        raise ValueError(f"chunk_lens: a prompt of {max(chunk_lens)} tokens needs {chunk_blocks} blocks, more than "
                         f"the engine's pool of {sched.num_blocks}")
    vocab = engine.model.config.vocab_size

    def requests(count: int, length: int, replies: int) -> list[Request]:
        """``count`` requests with prompts of ``length`` random tokens, made (and checked) but not queued."""
        return [engine.make_request(rng.integers(0, vocab, length).tolist(), replies, eos_token_id=())
                for _ in range(count)]

    def run(burst: list[Request]) -> list[StepSample]:
        """The burst's requests at once, served to the end; every step that computed a token, timed."""
        for request in burst:
            engine.scheduler.add_request(request)
        samples = []
        while engine.has_unfinished():
            samples.append(timed_step(engine))
        return [s for s in samples if s.new_tokens]

    # Every request is made, and so checked against the vocabulary and the pool, before any runs.
    bursts = []
    for _ in range(rounds):
        bursts += [requests(size, prompt_len, decode_steps + 1) for size in batch_sizes]  # prompts, then decodes
        bursts += [requests(1, length, 1) for length in chunk_lens]                      # one prompt chunk each
    run(requests(1, prompt_len, 1))  # untimed: the first step of a fresh engine
    return [sample for burst in bursts for sample in run(burst)]


def measure_stream_bandwidth(nbytes: int = 256 * MiB, repeats: int = 5) -> float:
    """This machine's memory bandwidth in bytes per second, measured by one copy.

    A buffer of ``nbytes`` (float32) is copied into another ``repeats`` times; each copy reads
    and writes every byte, so it moves ``2 × nbytes``, as the STREAM benchmark's *Copy* counts
    it. The fastest copy wins: on a shared machine other programs only ever slow a copy down.
    The buffer must be far larger than the processor's caches (256 MiB against tens of MiB), or
    the copy measures the cache. It runs on PyTorch's current number of threads: set them as the
    engine you calibrate runs (one thread reads more slowly than all of them).

    This is the memory side of the roofline, measured once, so that a fit of step times cannot
    trade it against the fixed overhead (``fit_steps``).
    """
    nbytes = check_int("nbytes", nbytes, MiB)
    repeats = check_int("repeats", repeats, 1)
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: the pages are mapped here, not inside a timed copy
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best
