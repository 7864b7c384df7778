"""Measured engine steps: what the cost model reads from a step, and how long it took (appendix A6).

Chapter 06's simulator times each step with a roofline (``labkit.serving.sim.costmodel``) and
datasheet figures, so its latencies are a model's. To check the model against a real engine, the
book's ``Engine`` serves real requests on the machine at hand and every step is timed together with
what the cost model reads from it (``step_sums``: Σ new tokens, Σ context tokens and Σ attention
pairs): ``measure_steps``. The machine's memory bandwidth is measured apart, by one copy
(``measure_stream_bandwidth``). ``labkit.serving.sim.fit`` fits the rest of the roofline to these
samples; ``labkit.serving.sim.realtime`` serves requests on the wall clock to test the fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ...checks import check_int, check_number
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
