"""A cluster of simulated servers behind a router, on one clock (chapter 07).

``simulate(requests, replicas=N, router=...)`` runs N of chapter 06's servers (``SimRun``: labkit's
scheduler, allocator and prefix cache, timed by the cost model), each with its own pool and its own
prefix cache. Requests are taken in arrival order. Before each one, every replica runs the steps
that start before it arrives; the router then reads their loads and picks one. So a router sees a
replica as of its step in flight, whose blocks vLLM has already named when the step was scheduled.

With one replica this *is* ``Simulator.run``: the same steps at the same times
(``tests/test_cluster.py`` holds that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...checks import check_int
from ..sim.costmodel import CostModel
from ..sim.percentiles import latency_percentiles
from ..sim.simulator import Simulator, SimResult, SimRun, check_requests
from ..sim.workloads import RequestSpec, check_specs
from .routers import Router, make_router

__all__ = ["ClusterResult", "simulate"]


@dataclass
class ClusterResult:
    """What a cluster measured. ``replicas``: each replica's ``SimResult`` (its requests in arrival
    order); ``assignment``: for every request, in arrival order, the replica that served it;
    ``request_ids``: their ids in that order; ``hits`` / ``queries``: each replica's prefix-cache
    counters, counted as vLLM counts them (prompt tokens found and asked for at each first admission);
    ``router``: the router, as it ended; ``tier_hits``: with a second tier, what each replica loaded from it."""

    replicas: list[SimResult]
    assignment: np.ndarray
    request_ids: np.ndarray
    hits: np.ndarray
    queries: np.ndarray
    router: Router
    tier_hits: np.ndarray | None = None  # per replica, prompt tokens loaded from a second tier (chapter 08)

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def _gather(self, name: str) -> np.ndarray:
        """A per-request array of the replicas', back in arrival order."""
        out = np.empty(len(self.assignment), dtype=np.float64)
        for i, result in enumerate(self.replicas):
            out[self.assignment == i] = getattr(result, name)
        return out

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found in a replica's prefix cache over prompt tokens asked for, all replicas."""
        return float(self.hits.sum() / self.queries.sum())

    @property
    def replica_hit_rates(self) -> np.ndarray:
        """Each replica's own hit rate (NaN for a replica that served nothing)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.hits / self.queries

    @property
    def hit_tokens(self) -> np.ndarray:
        """Every request's prompt tokens found at its first admission, in arrival order."""
        return self._gather("hit_tokens").astype(np.int64)

    @property
    def ttft(self) -> np.ndarray:
        """Every request's time to first token, in arrival order."""
        return self._gather("ttft")

    def ttft_percentiles(self) -> dict[str, float]:
        return latency_percentiles(self.ttft)

    @property
    def itl(self) -> tuple[np.ndarray, np.ndarray]:
        """Every interval between two tokens of one request, all replicas, with its weight."""
        return (np.concatenate([r.itl for r in self.replicas]), np.concatenate([r.itl_weight for r in self.replicas]))

    def itl_percentiles(self) -> dict[str, float]:
        return latency_percentiles(*self.itl)

    @property
    def makespan(self) -> float:
        return float(self._gather("finish").max() - self._gather("arrival").min())

    @property
    def output_tokens_per_s(self) -> float:
        return float(sum(r.output_len.sum() for r in self.replicas) / self.makespan)

    @property
    def requests_per_replica(self) -> np.ndarray:
        return np.bincount(self.assignment, minlength=self.num_replicas)

    @property
    def load_imbalance(self) -> float:
        """The busiest replica's prompt tokens computed (not found in its cache) over the mean: 1.0 is even."""
        work = np.array([(r.prompt_len - r.hit_tokens).sum() for r in self.replicas], dtype=np.float64)
        return float(work.max() / work.mean()) if work.mean() else 1.0

    def per_replica(self) -> list[dict[str, float]]:
        """One row per replica: its requests, hit rate, TTFT and ITL p50/p90 (ms), output tokens per second
        of the cluster's makespan, and its share of the prompt tokens computed (NaN where it served none)."""
        rows, computed = [], np.array([(r.prompt_len - r.hit_tokens).sum() for r in self.replicas], dtype=np.float64)
        for i, r in enumerate(self.replicas):
            ttft, itl = latency_percentiles(r.ttft), latency_percentiles(r.itl, r.itl_weight)
            rows.append({"replica": i, "requests": len(r.arrival), "hit rate": float(self.replica_hit_rates[i]),
                         "TTFT p50 (ms)": ttft["p50"] * 1e3, "TTFT p90 (ms)": ttft["p90"] * 1e3,
                         "ITL p50 (ms)": itl["p50"] * 1e3, "ITL p90 (ms)": itl["p90"] * 1e3,
                         "output tokens/s": float(r.output_len.sum() / self.makespan),
                         "share of prefill": float(computed[i] / computed.sum()) if computed.sum() else math.nan})
        return rows

    def summary(self) -> dict[str, float]:
        """The chapter's row: hit rate, TTFT and ITL p50/p90 (ms), throughput, imbalance."""
        ttft, itl = self.ttft_percentiles(), self.itl_percentiles()
        return {"replicas": self.num_replicas, "router": self.router.name, "hit rate": self.hit_rate,
                "TTFT p50 (ms)": ttft["p50"] * 1e3, "TTFT p90 (ms)": ttft["p90"] * 1e3,
                "ITL p50 (ms)": itl["p50"] * 1e3, "ITL p90 (ms)": itl["p90"] * 1e3,
                "output tokens/s": self.output_tokens_per_s, "load imbalance": self.load_imbalance}


def simulate(requests: Sequence[RequestSpec], replicas: int = 1, router: str | Router = "round_robin", *,
             router_settings: dict | None = None, cost_model: CostModel | None = None,
             simulator: type[Simulator] = Simulator, **simulator_settings) -> ClusterResult:
    """Serve ``requests`` on ``replicas`` identical servers behind ``router``.

    ``router``: ``"round_robin"``, ``"least_loaded"``, ``"session"``, ``"cache_aware"`` (with
    ``router_settings``, e.g. ``{"block_size": 512}``) or a ``Router``. Every other keyword is a
    ``Simulator`` setting (``num_blocks`` or ``pool_bytes``, ``block_size``, ``max_num_batched_tokens``,
    ...) and applies to each replica: N replicas have N times the memory and N times the compute.
    ``simulator``: the server each replica is, ``Simulator`` or a subclass such as chapter 08's
    ``TieredSimulator`` (its ``tier`` and ``tier_blocks`` among the settings: a second tier per replica).
    """
    check_int("replicas", replicas, 1)
    specs = check_specs("requests", requests)
    if router_settings is not None and not isinstance(router_settings, dict):
        raise ValueError(f"router_settings must be a dict of the router's settings, got {router_settings!r}")
    if not (isinstance(simulator, type) and issubclass(simulator, Simulator)):
        raise ValueError(f"simulator must be labkit's Simulator or a subclass, got {simulator!r}")
    sim = simulator(cost_model, **simulator_settings)
    chosen = make_router(router, **(router_settings or {}))
    runs = [SimRun(sim) for _ in range(replicas)]
    order = check_requests(specs, runs[0].sched)  # every one fits a server, checked before any is served
    chosen.reset(replicas)
    assignment = np.empty(len(order), dtype=np.int64)
    for k, (spec, request) in enumerate(order):
        for run in runs:
            run.advance(until=spec.arrival_time)
        i = chosen.choose(spec, [run.load for run in runs])
        if type(i) is not int or not 0 <= i < replicas:
            raise ValueError(f"router {chosen!r} chose {i!r}, not a replica in [0, {replicas - 1}]")
        runs[i].add(spec, request)
        assignment[k] = i
    for run in runs:
        run.advance(until=math.inf)
    results = [run.result() for run in runs]
    stats = [run.sched.prefix_cache.stats for run in runs]
    tier = [getattr(run.sched, "tier_stats", None) for run in runs]  # a second tier's hits, counted apart
    return ClusterResult(results, assignment, np.array([s.request_id for s, _ in order]),
                         np.array([s.hits for s in stats], dtype=np.int64),
                         np.array([s.queries for s in stats], dtype=np.int64), chosen,
                         np.array([t.hits if t else 0 for t in tier], dtype=np.int64))
