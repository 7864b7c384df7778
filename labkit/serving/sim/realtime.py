"""The engine serving requests on the wall clock, each added when its arrival time comes (appendix A6).

A simulator's prediction is tested by serving the same workload for real: ``serve_in_real_time``
adds each request when the clock reaches its ``arrival_time``, steps the engine, and records when
every token came out. A ``MeasuredRun`` holds the latencies, measured as the simulator defines them
(time to first token, the intervals between tokens), and their percentiles in the simulator's
definition (``labkit.serving.sim.percentiles``), so that the two can be set side by side.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..engine import Engine
from .measure import StepSample, engine_requests, timed_step
from .percentiles import latency_percentiles
from .workloads import RequestSpec


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
        """p50, p90 and p99 of ``ttft`` (``labkit.serving.sim.percentiles``, as the simulator reports them)."""
        return latency_percentiles(self.ttft)

    def itl_percentiles(self) -> dict[str, float]:
        """p50, p90 and p99 of ``itl`` (NaN when no request produced a second token)."""
        return latency_percentiles(self.itl)


def serve_in_real_time(engine: Engine, specs: Sequence[RequestSpec]) -> MeasuredRun:
    """The engine serves ``specs``, each added when the wall clock reaches its ``arrival_time``.

    Requests ignore end-of-sequence tokens and stop after ``output_len`` tokens, as the
    simulator's do. While nothing is running the loop sleeps until the next arrival.
    ``engine``: an idle ``Engine``; ``specs``: ``RequestSpec`` objects with distinct ``request_id`` values
    (the outputs come back in their order), every one checked before the clock starts.
    """
    requests = engine_requests(engine, specs)
    if len({s.request_id for s in specs}) != len(specs):
        raise ValueError("specs must have distinct request_id values (the outputs are returned in their order)")
    pending = deque(sorted(zip(specs, requests), key=lambda p: (p[0].arrival_time, p[0].request_id)))
    origin = pending[0][0].arrival_time
    start = time.perf_counter()
    clock = lambda: origin + time.perf_counter() - start  # noqa: E731  (the workload's time axis)
    running: list[tuple[RequestSpec, object, list[float]]] = []
    steps: list[StepSample] = []
    while pending or engine.has_unfinished():
        while pending and pending[0][0].arrival_time <= clock():
            spec, request = pending.popleft()
            engine.scheduler.add_request(request)
            running.append((spec, request, []))
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0].arrival_time - clock()))
            continue
        sample = timed_step(engine)
        steps.append(sample)
        now = clock()
        for _, request, times in running:
            times.extend([now] * (len(request.output_token_ids) - len(times)))
    ttft = np.array([times[0] - spec.arrival_time for spec, _, times in running])
    itl = np.concatenate([np.diff(times) for _, _, times in running])
    order = sorted(range(len(running)), key=lambda i: running[i][0].request_id)
    return MeasuredRun(ttft, itl, steps, [list(running[i][1].output_token_ids) for i in order])
