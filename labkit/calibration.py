"""The simulator against a measured engine (chapter 06).

Chapter 06's simulator times each step with a roofline (``labkit.costmodel``) and datasheet
figures, so its latencies are a model's. This module checks the model against a real
measurement, in three steps:

1. **Measure** steps: the book's ``Engine`` serves real requests on the machine at hand, and
   every step is timed together with what the cost model reads from it, ``step_sums``:
   Σ new tokens, Σ context tokens and Σ attention pairs (``measure_steps``).
2. **Fit** a device to those steps: the memory bandwidth, the arithmetic rate and the fixed
   overhead per step for which the roofline, ``max(bytes / bandwidth, flops / peak) +
   overhead``, best predicts the measured times (``fit_device``). On a CPU the fixed overhead
   is large (Python, and a few hundred small operations per step, whatever their size).
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

from .capacity import ModelShape
from .costmodel import Device, ModelCost
from .sim import step_sums
from .workloads import RequestSpec

__all__ = ["StepSample", "MeasuredRun", "model_cost", "measure_steps", "fit_device", "serve_in_real_time"]


@dataclass(frozen=True)
class StepSample:
    """One measured engine step: what the cost model reads from it, and how long it took."""

    new_tokens: int
    context_tokens: int
    pairs: float
    seconds: float


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
    return StepSample(*step_sums(step), seconds)


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


def fit_device(samples: Sequence[StepSample], cost: ModelCost, name: str = "this CPU (fitted)",
               grid: int = 64) -> tuple[Device, float]:
    """The device and fixed overhead per step that best predict the measured step times.

    A grid search over the memory bandwidth (1 GB/s to 10 TB/s) and the arithmetic rate
    (1 GFLOP/s to 10 PFLOP/s), log-spaced; for each pair, the overhead is the median of what the
    roofline leaves unexplained (at least 0), and the pair whose predictions have the smallest
    mean squared *relative* error wins. Returns ``(Device, overhead_s)`` for a ``CostModel``.
    """
    if len(samples) < 3:
        raise ValueError(f"samples must hold at least 3 measured steps, got {len(samples)}")
    seconds = np.array([s.seconds for s in samples], dtype=np.float64)
    if not (np.isfinite(seconds).all() and (seconds > 0).all()):
        raise ValueError("samples must have finite step times > 0")
    bandwidth, peak = (a.ravel() for a in np.meshgrid(np.logspace(9, 13, grid), np.logspace(9, 16, grid),
                                                      indexing="ij"))
    base = _predict(cost, samples, bandwidth, peak)
    overhead = np.maximum(np.median(seconds[None, :] - base, axis=1), 0.0)
    error = (((base + overhead[:, None]) - seconds[None, :]) / seconds[None, :]) ** 2
    best = int(np.argmin(error.mean(axis=1)))
    device = Device(name, memory_bytes=_physical_memory(), memory_bandwidth=float(bandwidth[best]),
                    peak_flops=float(peak[best]), source="fitted to measured engine steps (labkit.calibration)")
    return device, float(overhead[best])


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
