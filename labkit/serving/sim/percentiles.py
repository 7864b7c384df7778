"""Latency percentiles, defined once: for the simulator, for measured runs, and for the chapters.

A percentile here is the **inverted CDF**: the ``q``-th percentile of a set of latencies is the
smallest latency at or below which at least ``q`` % of them lie. It is always a latency that
occurred, never one interpolated between two requests, and it extends to weighted samples, which the
simulator needs (one interval of a skipped-ahead stretch stands for every request that decoded in
it). NumPy calls it ``np.percentile(values, q, method="inverted_cdf")``. vLLM's benchmark client
(``vllm bench serve``) interpolates linearly, NumPy's default; the two differ by less than the gap
between two neighbouring samples.

``SimResult`` (``labkit.serving.sim.simulator``) and ``MeasuredRun`` (``labkit.serving.sim.realtime``)
both report ``latency_percentiles``, so a prediction and a measurement are read the same way.
"""

from __future__ import annotations

import math

import numpy as np

from ...checks import check_number

QUANTILES = (50, 90, 99)


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values`` where each value counts ``weights`` times.

    The lower value at a tie (no interpolation), so ``weighted_percentile(v, ones, q)``
    equals ``np.percentile(v, q, method="inverted_cdf")``. ``values``: at least one;
    ``weights``: one finite weight >= 0 per value, not all zero.
    """
    check_number("q", q, 0)
    if q > 100:
        raise ValueError(f"q must be a percentile in [0, 100], got {q!r}")
    values, weights = np.asarray(values), np.asarray(weights)
    if values.ndim != 1 or len(values) == 0:
        raise ValueError(f"values must be a 1-D array of at least one value, got shape {values.shape}")
    if weights.shape != values.shape or not (np.isfinite(weights).all() and (weights >= 0).all()
                                             and weights.sum() > 0):
        raise ValueError(f"weights must hold one finite weight >= 0 per value ({len(values)}), not all zero, "
                         f"got shape {weights.shape}")
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    rank = q / 100 * cum[-1]
    index = int(np.searchsorted(cum, rank, side="left"))
    return float(values[order][min(index, len(values) - 1)])


def percentile(values: np.ndarray, q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, each counted once: ``weighted_percentile`` with equal weights."""
    values = np.asarray(values)
    return weighted_percentile(values, np.ones(values.shape), q)


def latency_percentiles(values: np.ndarray, weights: np.ndarray | None = None) -> dict[str, float]:
    """``{"p50", "p90", "p99"}`` of ``values`` (each counted ``weights`` times; once without weights), by
    the inverted CDF. NaN for every key when there are no values (nothing was measured)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return {f"p{q}": math.nan for q in QUANTILES}
    weights = np.ones_like(values) if weights is None else np.asarray(weights, dtype=np.float64)
    return {f"p{q}": weighted_percentile(values, weights, q) for q in QUANTILES}
