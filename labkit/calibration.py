"""The simulator against a measured engine (appendix A6; the simulator is chapter 06's).

Chapter 06's simulator times each step with a roofline (``labkit.costmodel``) and datasheet
figures, so its latencies are a model's. This module checks the model against a real
measurement, in three steps:

1. **Measure** steps: the book's ``Engine`` serves real requests on the machine at hand, and
   every step is timed together with what the cost model reads from it, ``step_sums``:
   Σ new tokens, Σ context tokens and Σ attention pairs (``measure_steps``). The machine's
   memory bandwidth is measured apart, by one copy (``measure_stream_bandwidth``).
2. **Fit** the rest: with the bandwidth pinned to that measurement, the arithmetic rate and the
   fixed overhead per step for which the roofline, ``max(bytes / bandwidth, flops / peak) +
   overhead``, best predicts the measured times (``fit_steps``). The result, a ``StepFit``,
   keeps its residuals and says which share of a decode step is the weight read: the roofline's
   memory side, now a measurement and not a free parameter. A fit that may move the bandwidth too
   (``fit_device`` without ``memory_bandwidth``) can trade it against the overhead and land on a
   bandwidth the machine does not have.
3. **Predict and compare**: the simulator, with the fitted device, serves a workload that the
   engine then serves for real, requests arriving on the wall clock (``serve_in_real_time``);
   their time to first token and inter-token latency are compared.

The fit is made on one set of requests and tested on another, so the comparison is a
prediction, not a fit to the data it is judged on.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .capacity import MiB, ModelShape
from .checks import check_int, check_number
from .costmodel import CostModel, Device, ModelCost
from .sim import step_sums
from .workloads import RequestSpec, poisson_arrivals

__all__ = ["StepSample", "MeasuredRun", "StepFit", "model_cost", "measure_steps", "measure_stream_bandwidth",
           "fit_steps", "fit_device", "serve_in_real_time", "chat_requests"]


@dataclass(frozen=True)
class StepSample:
    """One measured engine step: what the cost model reads from it, and how long it took."""

    new_tokens: int
    context_tokens: int
    pairs: float
    seconds: float
    num_requests: int = 0  # requests in the step (0: not recorded); a decode step has one new token each

    @property
    def is_decode(self) -> bool:
        """Every request in the step computes one token: no prompt chunk."""
        return 0 < self.num_requests == self.new_tokens


@dataclass
class MeasuredRun:
    """Latencies measured while the engine served a workload. Times in seconds.

    ``ttft``: per request, from its arrival to the end of the step that produced its first token
    (the simulator's definition). ``itl``: every interval between two tokens of one request.
    ``steps``: the samples of every step of the run.
    """

    ttft: np.ndarray
    itl: np.ndarray
    steps: list[StepSample]
    outputs: list[list[int]]

    def ttft_percentiles(self) -> dict[str, float]:
        return {f"p{q}": float(np.percentile(self.ttft, q)) for q in (50, 90, 99)}

    def itl_percentiles(self) -> dict[str, float]:
        return {f"p{q}": float(np.percentile(self.itl, q, method="inverted_cdf")) for q in (50, 90, 99)}


def model_cost(config, dtype_bytes: int, name: str = "") -> ModelCost:
    """The cost model's view of a ``labkit.model.DecoderConfig`` served with ``dtype_bytes``-byte
    weights and cache (4 for float32 on a CPU, 2 for bfloat16)."""
    shape = ModelShape(name or "decoder", num_layers=config.num_hidden_layers,
                       num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                       dtype_bytes=dtype_bytes, num_attention_heads=config.num_attention_heads)
    return ModelCost(shape, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                     vocab_size=config.vocab_size, tie_word_embeddings=config.tie_word_embeddings)


def _timed_step(engine) -> StepSample:
    """Run one engine step; what it computed, and how long it took."""
    start = time.perf_counter()
    step = engine.step()
    seconds = time.perf_counter() - start
    return StepSample(*step_sums(step), seconds, len(step.chunks))


def measure_steps(engine, specs: Sequence[RequestSpec]) -> list[StepSample]:
    """Serve ``specs`` at once (arrival times ignored; no early stop), timing every step that ran the model."""
    if not specs:
        raise ValueError("specs must hold at least one RequestSpec")
    for spec in specs:
        engine.add_request(spec.prompt_token_ids, spec.output_len, eos_token_id=())
    samples = []
    while engine.has_unfinished():
        sample = _timed_step(engine)
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


def _predict(cost: ModelCost, samples: Sequence[StepSample], bandwidth: np.ndarray,
             peak: np.ndarray) -> np.ndarray:
    """Roofline time without overhead, for every (bandwidth, peak) pair and every sample: [pairs, samples]."""
    new = np.array([s.new_tokens for s in samples], dtype=np.float64)
    context = np.array([s.context_tokens for s in samples], dtype=np.float64)
    pairs = np.array([s.pairs for s in samples], dtype=np.float64)
    moved = cost.weight_bytes + (context + new) * cost.shape.bytes_per_token()
    flops = cost.flops_per_token * new + cost.attention_flops_per_pair * pairs
    return np.maximum(moved[None, :] / bandwidth[:, None], flops[None, :] / peak[:, None])


def _physical_memory() -> float:
    """This machine's memory in bytes (the fitted device's capacity; the simulator sizes its pool itself)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float(2**30)


@dataclass(frozen=True)
class StepFit:
    """A device fitted to measured steps, with what it leaves unexplained.

    ``device``: the measured (pinned) bandwidth and the fitted arithmetic rate; ``overhead_s``: the
    fitted fixed cost per step; ``samples``: the steps it was fitted to; ``cost``: the model.
    """

    device: Device
    overhead_s: float
    samples: tuple[StepSample, ...]
    cost: ModelCost

    def cost_model(self) -> CostModel:
        """The chapter-06 ``CostModel`` with this device and overhead (for the ``Simulator``)."""
        return CostModel(self.cost, self.device, overhead_s=self.overhead_s)

    @property
    def measured(self) -> np.ndarray:
        """Measured seconds of every sample."""
        return np.array([s.seconds for s in self.samples])

    @property
    def predicted(self) -> np.ndarray:
        """The fitted roofline's seconds for every sample."""
        base = _predict(self.cost, self.samples, np.array([self.device.memory_bandwidth]),
                        np.array([self.device.peak_flops]))[0]
        return base + self.overhead_s

    @property
    def residuals(self) -> np.ndarray:
        """Measured minus predicted seconds, per sample: what the fit leaves unexplained."""
        return self.measured - self.predicted

    @property
    def weight_read_s(self) -> float:
        """Seconds to stream the weights once at the measured bandwidth: the floor of every step."""
        return self.cost.weight_bytes / self.device.memory_bandwidth

    def weight_read_share(self) -> float:
        """Share of a median decode step (one token per request, no prompt chunk) that is the weight read.

        Falls back to the steps of fewest new tokens when no sample recorded its requests.
        """
        decodes = [s.seconds for s in self.samples if s.is_decode]
        if not decodes:
            fewest = min(s.new_tokens for s in self.samples)
            decodes = [s.seconds for s in self.samples if s.new_tokens == fewest]
        return self.weight_read_s / float(np.median(decodes))


def _checked_seconds(samples: Sequence[StepSample]) -> np.ndarray:
    if len(samples) < 3:
        raise ValueError(f"samples must hold at least 3 measured steps, got {len(samples)}")
    seconds = np.array([s.seconds for s in samples], dtype=np.float64)
    if not (np.isfinite(seconds).all() and (seconds > 0).all()):
        raise ValueError("samples must have finite step times > 0")
    return seconds


def _best_on_grid(samples: Sequence[StepSample], cost: ModelCost, seconds: np.ndarray, bandwidth: np.ndarray,
                  peak: np.ndarray) -> tuple[float, float, float]:
    """The (bandwidth, peak) pair of the grid, and its overhead, whose roofline + overhead has the
    smallest mean squared *relative* error; each pair's overhead is the median of what its roofline
    leaves unexplained (at least 0)."""
    base = _predict(cost, samples, bandwidth, peak)
    overhead = np.maximum(np.median(seconds[None, :] - base, axis=1), 0.0)
    error = (((base + overhead[:, None]) - seconds[None, :]) / seconds[None, :]) ** 2
    best = int(np.argmin(error.mean(axis=1)))
    return float(bandwidth[best]), float(peak[best]), float(overhead[best])


def fit_steps(samples: Sequence[StepSample], cost: ModelCost, memory_bandwidth: float,
              name: str = "this CPU (fitted)", grid: int = 512) -> StepFit:
    """Fit the arithmetic rate and the fixed overhead per step; the bandwidth is a measurement.

    ``memory_bandwidth`` (bytes per second, from ``measure_stream_bandwidth``) is held fixed. Then
    a search over the arithmetic rate (1 GFLOP/s to 10 PFLOP/s, ``grid`` log-spaced values) picks,
    with each rate's overhead the median of what the roofline leaves unexplained, the rate whose
    predictions have the smallest mean squared relative error. Two free numbers, each pinned by its
    own steps: the prompt chunks (many tokens) set the arithmetic rate, the decodes the overhead.
    """
    seconds = _checked_seconds(samples)
    bandwidth = check_number("memory_bandwidth", memory_bandwidth, 0, strict=True, finite=True)
    grid = check_int("grid", grid, 2)
    peak = np.logspace(9, 16, grid)
    _, best_peak, overhead = _best_on_grid(samples, cost, seconds, np.full(grid, bandwidth), peak)
    device = Device(name, memory_bytes=_physical_memory(), memory_bandwidth=bandwidth, peak_flops=best_peak,
                    source="bandwidth measured by a copy, arithmetic rate fitted to measured steps "
                           "(labkit.calibration)")
    return StepFit(device, overhead, tuple(samples), cost)


def fit_device(samples: Sequence[StepSample], cost: ModelCost, name: str = "this CPU (fitted)",
               grid: int = 64, memory_bandwidth: float | None = None) -> tuple[Device, float]:
    """The device and fixed overhead per step that best predict the measured step times.

    With ``memory_bandwidth`` (measured, ``measure_stream_bandwidth``): ``fit_steps``, which fits
    only the arithmetic rate and the overhead. Without it, the bandwidth is fitted as well: a
    grid search over the bandwidth (1 GB/s to 10 TB/s) and the arithmetic rate (1 GFLOP/s to
    10 PFLOP/s), log-spaced. On a CPU, whose steps are mostly fixed cost, that free fit can buy a
    smaller overhead with a bandwidth many times the machine's, so prefer the pinned one.
    Returns ``(Device, overhead_s)`` for a ``CostModel``.
    """
    if memory_bandwidth is not None:
        fit = fit_steps(samples, cost, memory_bandwidth, name, grid)
        return fit.device, fit.overhead_s
    seconds = _checked_seconds(samples)
    bandwidth, peak = (a.ravel() for a in np.meshgrid(np.logspace(9, 13, grid), np.logspace(9, 16, grid),
                                                      indexing="ij"))
    best_bandwidth, best_peak, overhead = _best_on_grid(samples, cost, seconds, bandwidth, peak)
    device = Device(name, memory_bytes=_physical_memory(), memory_bandwidth=best_bandwidth,
                    peak_flops=best_peak, source="fitted to measured engine steps (labkit.calibration)")
    return device, overhead


CHAT_SYSTEM = "You are a helpful assistant. Answer in one short sentence."
CHAT_ASKS = ["What is the capital of France?", "Name three primary colours.", "What does a CPU do?",
             "How do you say hello in Spanish?", "Why is the sky blue?", "Who wrote Hamlet?",
             "What is water made of?", "How far away is the Moon?", "What is a GPU?", "Why do cats purr?",
             "What is DNA?", "What is gravity?", "What is a volcano?", "Why do leaves fall?"]


def chat_requests(tokenizer) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """Appendix A6's calibration workload on the real model: 14 short chat questions with replies of 8
    to 24 tokens (seeded). The first 6 arrive at once, to measure and fit steps on; the other 8 arrive
    as a Poisson stream at 5 requests/s, to test the fitted simulator's prediction on."""
    from .pretrained import chat_token_ids

    chat = [chat_token_ids(tokenizer, [{"role": "system", "content": CHAT_SYSTEM}, {"role": "user", "content": q}])
            for q in CHAT_ASKS]
    lengths = np.random.default_rng(0).integers(8, 25, len(CHAT_ASKS)).tolist()
    arrivals = poisson_arrivals(8, 5.0, np.random.default_rng(1))
    fit_specs = [RequestSpec(i, 0.0, chat[i], lengths[i]) for i in range(6)]
    test_specs = [RequestSpec(i, float(arrivals[i - 6]), chat[i], lengths[i]) for i in range(6, 14)]
    return fit_specs, test_specs


def serve_in_real_time(engine, specs: Sequence[RequestSpec]) -> MeasuredRun:
    """The engine serves ``specs``, each added when the wall clock reaches its ``arrival_time``.

    Requests ignore end-of-sequence tokens and stop after ``output_len`` tokens, as the
    simulator's do. While nothing is running the loop sleeps until the next arrival.
    """
    if not specs:
        raise ValueError("specs must hold at least one RequestSpec")
    pending = deque(sorted(specs, key=lambda s: (s.arrival_time, s.request_id)))
    origin = pending[0].arrival_time
    start = time.perf_counter()
    clock = lambda: origin + time.perf_counter() - start  # noqa: E731  (the workload's time axis)
    running: list[tuple[RequestSpec, object, list[float]]] = []
    steps: list[StepSample] = []
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_time <= clock():
            spec = pending.popleft()
            request = engine.add_request(spec.prompt_token_ids, spec.output_len, eos_token_id=())
            running.append((spec, request, []))
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0].arrival_time - clock()))
            continue
        sample = _timed_step(engine)
        steps.append(sample)
        now = clock()
        for _, request, times in running:
            times.extend([now] * (len(request.output_token_ids) - len(times)))
    ttft = np.array([times[0] - spec.arrival_time for spec, _, times in running])
    itl = np.concatenate([np.diff(times) for _, _, times in running])
    order = sorted(range(len(running)), key=lambda i: running[i][0].request_id)
    return MeasuredRun(ttft, itl, steps, [list(running[i][1].output_token_ids) for i in order])
