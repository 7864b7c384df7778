"""The cost model fitted to measured steps: the simulator calibrated on a real engine (appendix A6).

With the machine's bandwidth pinned to a measurement (``labkit.serving.sim.measure``), the
arithmetic rate and the fixed overhead per step are the two numbers for which the roofline,
``max(bytes / bandwidth, flops / peak) + overhead``, best predicts the measured step times
(``fit_steps``). The result, a ``StepFit``, keeps its residuals and says which share of a decode step
is the weight read: the roofline's memory side, now a measurement and not a free parameter. A fit
that may move the bandwidth too (``fit_device`` without ``memory_bandwidth``) can trade it against
the overhead and land on a bandwidth the machine does not have.

A fit learns only what its steps vary, so appendix A6 fits to chosen steps (decodes of 1 to 16
requests, prompt chunks of several lengths: ``labkit.serving.sim.measure.measure_step_grid``) and
tests the result on other requests served on the wall clock (``labkit.serving.sim.realtime``): the
comparison is a prediction, not a fit to the data it is judged on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...checks import check_int, check_number
from ...memory.capacity import ModelShape
from ...model.decoder import DecoderConfig
from .costmodel import CostModel, Device, ModelCost
from .measure import StepSample


def model_cost(config: DecoderConfig, dtype_bytes: int, name: str = "") -> ModelCost:
    """The cost model's view of a ``labkit.model.decoder.DecoderConfig`` served with ``dtype_bytes``-byte
    weights and cache (4 for float32 on a CPU, 2 for bfloat16; 1 and 8 for 8- and 64-bit types)."""
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"config must be a labkit.model.decoder.DecoderConfig (a Decoder's .config), "
                        f"got {type(config).__name__}")
    if check_int("dtype_bytes", dtype_bytes, 1) not in (1, 2, 4, 8):
        raise ValueError(f"dtype_bytes must be one of 1, 2, 4, 8 (bytes per element), got {dtype_bytes}")
    _check_name(name, allow_empty=True)
    shape = ModelShape(name or "decoder", num_layers=config.num_hidden_layers,
                       num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                       dtype_bytes=dtype_bytes, num_attention_heads=config.num_attention_heads)
    return ModelCost(shape, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                     vocab_size=config.vocab_size, tie_word_embeddings=config.tie_word_embeddings)


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


def _check_name(name: object, allow_empty: bool = False) -> str:
    """``name`` if it is a string (non-empty unless ``allow_empty``): the label of a model or device."""
    if not isinstance(name, str) or not (name or allow_empty):
        raise ValueError(f"name must be a {'' if allow_empty else 'non-empty '}string, got {name!r}")
    return name


def _check_fit_inputs(samples: object, cost: object, name: object) -> np.ndarray:
    """Every input of a fit checked before any work: the samples' step times (seconds), as an array."""
    if not isinstance(samples, (list, tuple)):
        raise ValueError(f"samples must be a list of StepSample (measure_steps), got {type(samples).__name__}")
    bad = next((s for s in samples if not isinstance(s, StepSample)), None)
    if bad is not None:
        raise ValueError(f"samples must hold StepSample objects, got {type(bad).__name__}")
    if not isinstance(cost, ModelCost):
        raise TypeError(f"cost must be a labkit.serving.sim.costmodel.ModelCost (model_cost(config, dtype_bytes), "
                        f"or costmodel.get_model_cost(name)), got {type(cost).__name__}")
    _check_name(name)
    return _checked_seconds(samples)


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
    seconds = _check_fit_inputs(samples, cost, name)
    bandwidth = check_number("memory_bandwidth", memory_bandwidth, 0, strict=True, finite=True)
    grid = check_int("grid", grid, 2)
    peak = np.logspace(9, 16, grid)
    _, best_peak, overhead = _best_on_grid(samples, cost, seconds, np.full(grid, bandwidth), peak)
    device = Device(name, memory_bytes=_physical_memory(), memory_bandwidth=bandwidth, peak_flops=best_peak,
                    source="bandwidth measured by a copy, arithmetic rate fitted to measured steps "
                           "(labkit.serving.sim.fit)")
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
    seconds = _check_fit_inputs(samples, cost, name)
    grid = check_int("grid", grid, 2)
    bandwidth, peak = (a.ravel() for a in np.meshgrid(np.logspace(9, 13, grid), np.logspace(9, 16, grid),
                                                      indexing="ij"))
    best_bandwidth, best_peak, overhead = _best_on_grid(samples, cost, seconds, bandwidth, peak)
    device = Device(name, memory_bytes=_physical_memory(), memory_bandwidth=best_bandwidth,
                    peak_flops=best_peak, source="fitted to measured engine steps (labkit.serving.sim.fit)")
    return device, overhead
