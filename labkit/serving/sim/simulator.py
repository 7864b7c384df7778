"""From fitting to serving: a serving simulator (chapter 06).

Chapter 02's formula and ``labkit.memory.pool_plan`` say how many sequences *fit*; whether they are
*served* well is answered here by simulation. :class:`Simulator` serves a workload with
**labkit's own scheduler** (chapter 05), allocator and prefix cache: no tensors and no
model, synthetic output ids, and each step timed by the roofline cost model
(``labkit.serving.sim.costmodel``). It reports TTFT, ITL, throughput, occupancy and reuse, its
percentiles as ``labkit.serving.sim.percentiles`` defines them.

Speed. Most steps are alike: the same requests each decode one token, nobody arrives,
finishes or is preempted. After a real step the simulator runs such a stretch at once
(``labkit.serving.sim.skipahead``, the same allocations and names in the same order). The result is
identical to stepping (``skip_ahead=False``); the tests check it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ...checks import check_flag, check_int, check_number
from ...memory.paging import BlockAllocator
from ...memory.prefix import PrefixCache
from ...units import format_bytes
from ..request import Request
from ..scheduler import Scheduler
from ..step import Step
from ..variants.reservation import check_allocation, scheduler_class
from .costmodel import CostModel
from .percentiles import latency_percentiles
from .skipahead import plan_stretch
from .work import add_span, work_sums
from .workloads import RequestSpec

__all__ = ["Simulator", "SimResult", "SimRun", "check_requests", "step_sums"]


# =========================================================================== results


@dataclass
class SimResult:
    """What a simulated run measured. Times are seconds since the first arrival.

    Per request (arrays in arrival order, ties by ``request_id``): ``arrival``, ``first_token`` (end of the
    step that sampled its first token), ``finish``, ``prompt_len``, ``output_len`` (the tokens it generated:
    its spec's, or fewer where ``max_model_len`` stopped it),
    ``hit_tokens`` (prompt tokens found in the prefix cache when first admitted),
    ``preemptions``. Per step: ``step_start``, ``step_end``, ``step_tokens``,
    ``num_running``, ``num_waiting``, ``used_blocks`` (held by a request) and
    ``live_tokens`` (K/V of unfinished requests). ``itl`` / ``itl_weight``: every
    interval between two tokens of one request, with how many tokens it stands for.
    ``recomputed_tokens``: the work lost to preemption, the token positions a request computed
    again, each counted once per extra time (prefix-hit positions it computes for the first time
    after a preemption are not among them).
    ``schedule`` (with ``record_schedule``): per step, ``(request_id, start, num_tokens,
    block_table)`` of each scheduled request; ``queued_at_step``: the first step in
    which each request was a candidate; ``scheduler``: the scheduler after the run; ``requests``: its
    ``Request`` objects, in arrival order (their output tokens).
    """

    num_blocks: int
    block_size: int
    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    hit_tokens: np.ndarray
    shared_prefix_len: np.ndarray
    preemptions: np.ndarray
    step_start: np.ndarray
    step_end: np.ndarray
    step_tokens: np.ndarray
    num_running: np.ndarray
    num_waiting: np.ndarray
    used_blocks: np.ndarray
    live_tokens: np.ndarray
    itl: np.ndarray
    itl_weight: np.ndarray
    recomputed_tokens: int = 0
    schedule: list = field(default_factory=list, repr=False)
    skipped_steps: int = 0
    queued_at_step: np.ndarray | None = field(default=None, repr=False)
    scheduler: Scheduler | None = field(default=None, repr=False)
    requests: list[Request] = field(default_factory=list, repr=False)

    # ------------------------------------------------------------ latency
    @property
    def ttft(self) -> np.ndarray:
        """Time to first token of every request: queueing + prefill."""
        return self.first_token - self.arrival

    def ttft_percentiles(self) -> dict[str, float]:
        """p50, p90 and p99 of ``ttft`` (``labkit.serving.sim.percentiles``)."""
        return latency_percentiles(self.ttft)

    def itl_percentiles(self) -> dict[str, float]:
        """p50, p90 and p99 of the intervals, each counted as often as its weight; NaN when no request
        produced a second token (no interval to measure)."""
        return latency_percentiles(self.itl, self.itl_weight)

    # ------------------------------------------------------------ throughput
    @property
    def makespan(self) -> float:
        """From the first arrival to the last token."""
        return float(self.finish.max() - self.arrival.min())

    @property
    def num_steps(self) -> int:
        return len(self.step_start)

    @property
    def output_tokens_per_s(self) -> float:
        return float(self.output_len.sum() / self.makespan)

    @property
    def requests_per_s(self) -> float:
        return len(self.arrival) / self.makespan

    # ------------------------------------------------------------ memory
    @property
    def step_time(self) -> np.ndarray:
        return self.step_end - self.step_start

    @property
    def mean_occupancy(self) -> float:
        """Time-average share of the pool's blocks held by requests (idle time counts as 0)."""
        return float((self.used_blocks * self.step_time).sum() / (self.num_blocks * self.makespan))

    @property
    def live_token_share(self) -> float:
        """Of the slots in held blocks, the share holding live K/V (time-average while busy).

        With prefix sharing one block serves several requests, so this can exceed 1.
        """
        held = (self.used_blocks * self.block_size * self.step_time).sum()
        return float((self.live_tokens * self.step_time).sum() / held) if held else 0.0

    @property
    def reuse_ratio(self) -> float:
        """Share of prompt tokens served from the prefix cache instead of computed."""
        return float(self.hit_tokens.sum() / self.prompt_len.sum())

    @property
    def reusable_ratio(self) -> float:
        """Share of prompt tokens that *could* be reused: full blocks of a prefix another request shares."""
        reusable = (self.shared_prefix_len // self.block_size) * self.block_size
        return float(np.minimum(reusable, self.prompt_len - 1).sum() / self.prompt_len.sum())

    def summary(self) -> dict[str, float]:
        """The chapter's measurements in one row (milliseconds for latencies)."""
        ttft, itl = self.ttft_percentiles(), self.itl_percentiles()
        row = {f"TTFT {k} (ms)": v * 1e3 for k, v in ttft.items()}
        row.update({f"ITL {k} (ms)": v * 1e3 for k, v in itl.items()})
        row.update({"output tokens/s": self.output_tokens_per_s, "requests/s": self.requests_per_s,
                    "mean occupancy": self.mean_occupancy, "reuse ratio": self.reuse_ratio,
                    "preemptions": int(self.preemptions.sum()), "steps": self.num_steps})
        return row


# =========================================================================== the simulator


def _fast_block_hash(parent_hash, token_ids, key) -> int:
    """Python's tuple hash as the prefix cache's block name: fast, and safe because
    ``PrefixCache`` verifies token ids, extra keys and parent on every hit."""
    return hash((parent_hash, tuple(token_ids), key))


class Simulator:
    """Serve a workload with labkit's scheduler, timing each step with a roofline cost model.

    ``cost_model``: a :class:`labkit.serving.sim.costmodel.CostModel` (its model sets the block
    bytes). The pool is ``num_blocks`` blocks, or ``pool_bytes`` of memory (at least
    one block). ``block_size``, ``max_num_batched_tokens``, ``max_num_seqs`` (at most this
    many requests run at once; 256 is what vLLM 0.33.0's ``EngineArgs.get_batch_defaults`` picks on
    GPUs under 70 GiB and on any A100 or GB10, 1,024 from 70 GiB up; on a CPU 256 for the offline
    ``LLM`` and 128 for ``vllm serve``, times the world size),
    ``enable_prefix_caching`` and ``full_sequence_must_fit`` (vLLM's admission gate, on by
    default), ``allocation`` and ``max_model_len`` (``"max_len"`` reserves ``max_model_len`` tokens per
    request at admission, as the systems before paging did) go to the ``Scheduler``.
    ``skip_ahead=False`` steps through every iteration (slow, the reference); ``record_schedule``
    keeps, for every step, what each request was
    given: ``(request_id, start, num_tokens, block_table)``.
    """

    def __init__(self, cost_model: CostModel | None = None, *, num_blocks: int | None = None,
                 pool_bytes: float | None = None, block_size: int = 16, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 256, enable_prefix_caching: bool = True, skip_ahead: bool = True,
                 record_schedule: bool = False, full_sequence_must_fit: bool = True, allocation: str = "paged",
                 max_model_len: int | None = None):
        self.cost_model = cost_model if cost_model is not None else CostModel()
        if not isinstance(self.cost_model, CostModel):
            raise ValueError(f"cost_model must be a labkit.serving.sim.costmodel.CostModel, "
                             f"got {type(cost_model).__name__}")
        check_int("block_size", block_size, 1)
        check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        check_int("max_num_seqs", max_num_seqs, 1)
        if (num_blocks is None) == (pool_bytes is None):
            raise ValueError("give exactly one of num_blocks (an integer >= 1) or pool_bytes (bytes >= one block)")
        block_bytes = self.cost_model.model.shape.block_bytes(block_size)
        if pool_bytes is not None:
            check_number("pool_bytes", pool_bytes, 0)
            if not math.isfinite(pool_bytes) or pool_bytes < block_bytes:
                raise ValueError(f"pool_bytes must hold at least one block of {block_size} tokens "
                                 f"({format_bytes(block_bytes)}), got {format_bytes(pool_bytes)}")
            num_blocks = int(pool_bytes // block_bytes)
        check_int("num_blocks", num_blocks, 1)
        check_allocation(allocation, max_model_len)
        self.num_blocks = num_blocks
        self.allocation, self.max_model_len = allocation, max_model_len
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = check_flag("enable_prefix_caching", enable_prefix_caching)
        self.full_sequence_must_fit = check_flag("full_sequence_must_fit", full_sequence_must_fit)
        self.skip_ahead = check_flag("skip_ahead", skip_ahead)
        self.record_schedule = check_flag("record_schedule", record_schedule)
        self.new_scheduler()  # the scheduler checks the rest (max_model_len fits the pool) now

    def __repr__(self) -> str:
        return (f"Simulator({self.num_blocks:,} blocks of {self.block_size} tokens, budget "
                f"{self.max_num_batched_tokens} tokens/step, at most {self.max_num_seqs} running, prefix caching "
                f"{'on' if self.enable_prefix_caching else 'off'}"
                f"{'' if self.full_sequence_must_fit else ', chunk-only admission'}"
                f"{'' if self.allocation == 'paged' else f', {self.allocation!r} allocation'}"
                f"{'' if self.max_model_len is None else f', max_model_len {self.max_model_len:,}'}"
                f", {self.cost_model!r})")

    def new_scheduler(self, cache: PrefixCache | None = None, cls: type | None = None, **variant) -> Scheduler:
        """A fresh chapter-05 scheduler over a fresh allocator and prefix cache; a variant gives its own (08's tier)."""
        cache = cache or PrefixCache(BlockAllocator(self.num_blocks), self.block_size, hash_fn=_fast_block_hash)
        cls, variant = (cls, variant) if cls else scheduler_class(self.allocation)  # or the paper's reservations
        return cls(block_size=self.block_size, max_num_batched_tokens=self.max_num_batched_tokens,
                   max_num_seqs=self.max_num_seqs, enable_prefix_caching=self.enable_prefix_caching,
                   prefix_cache=cache, full_sequence_must_fit=self.full_sequence_must_fit,
                   max_model_len=self.max_model_len, **variant)

    def run(self, requests: Sequence[RequestSpec], progress: bool = False) -> SimResult:
        """Serve ``requests`` (arriving at their ``arrival_time``) to completion."""
        check_flag("progress", progress)
        run = SimRun(self, progress, total=len(requests) if hasattr(requests, "__len__") else None)
        for spec, request in check_requests(requests, run.sched):
            run.add(spec, request)
        run.advance()
        if run.bar is not None:
            run.bar.close()
        return run.result()


def step_sums(step: Step) -> tuple[int, int, float]:
    """What the cost model reads from a step: Σ new tokens, Σ context tokens (already in the cache
    before the step) and Σ attention pairs (``labkit.serving.sim.work``, from each chunk's start and size)."""
    return work_sums((c.start, c.num_tokens) for c in step.chunks)


# Synthetic output ids: unique per (request, position), above any vocabulary, so no two
# requests ever produce the same full block by accident.
_OUTPUT_ID_BASE = 1 << 20
_OUTPUT_ID_STRIDE = 1 << 16


def _output_id(index: int, position: int) -> int:
    return _OUTPUT_ID_BASE + index * _OUTPUT_ID_STRIDE + position


def _output_ids(index: int, position: int, n: int) -> range:
    """The next ``n`` synthetic outputs of request ``index`` from ``position`` on."""
    return range(_output_id(index, position), _output_id(index, position + n))


def check_requests(specs: Sequence[RequestSpec], sched: Scheduler) -> list[tuple[RequestSpec, Request]]:
    """``(spec, its Request)`` sorted by arrival (ties by ``request_id``), every one checked before any is served."""
    if isinstance(specs, (str, bytes)) or not hasattr(specs, "__len__") or len(specs) == 0:
        raise ValueError("requests must be a list of at least one RequestSpec")
    bad = next((s for s in specs if not isinstance(s, RequestSpec)), None)
    if bad is not None:  # before sorting them by arrival_time
        raise ValueError(f"requests must hold RequestSpec objects, got {type(bad).__name__}")
    if len({s.request_id for s in specs}) != len(specs):
        raise ValueError("requests must have distinct request_id values")
    return sorted(((s, _check_spec(s, sched)) for s in specs), key=lambda p: (p[0].arrival_time, p[0].request_id))


def _check_spec(spec: RequestSpec, sched: Scheduler) -> Request:
    """The scheduler's ``Request`` for one spec, refused (ValueError) if it can never run on ``sched``."""
    if not isinstance(spec, RequestSpec):
        raise ValueError(f"requests must hold RequestSpec objects, got {type(spec).__name__}")
    if spec.output_len >= _OUTPUT_ID_STRIDE:
        raise ValueError(f"output_len must be < {_OUTPUT_ID_STRIDE}, got {spec.output_len}")
    request = Request(spec.prompt_token_ids, spec.output_len, request_id=spec.request_id)
    sched.check_fits(request)
    return request


class SimRun:
    """One simulated server fed requests as they arrive: the event loop, the records, the skip-ahead.
    ``Simulator.run`` adds a whole workload and serves it. A cluster (chapter 07) keeps one per replica on
    one clock: before each arrival at ``t`` every replica runs the steps that *start* before ``t``
    (``advance(until=t)``), then one gets the request (``add``). A request arriving mid-step waits for its end."""

    def __init__(self, sim: Simulator, progress: bool = False, total: int | None = None):
        self.sim, self.cost, self.sched = sim, sim.cost_model, sim.new_scheduler()
        # Per request: its spec and Request, the ends of its first token's step and of its last, its latest token,
        # the step from which it was a candidate, the [start, end) positions it computed; index: id(Request) -> place.
        self.specs, self.requests, self.first_token, self.finish, self.last_token = [], [], [], [], []
        self.queued_at_step, self.spans, self.index = [], [], {}
        # Per step (plain lists while running: cheaper than numpy one value at a time; arrays at the end).
        self.steps: dict[str, list] = {k: [] for k in ("start", "end", "tokens", "running", "waiting", "used", "live")}
        self.itl: list[float] = []         # every interval between two tokens of one request ...
        self.itl_weight: list[int] = []    # ... and how many such intervals it stands for
        self.schedule: list = []
        self.skipped_steps = self._first_tokens = self.recomputed = self.num_finished = 0
        self.clock, self._next = 0.0, 0   # the time; the first request in specs not yet given to the scheduler
        self.bar = None
        if progress:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, desc="requests served", unit="req", mininterval=0.5)

    @property
    def load(self) -> int:
        """Requests given to this server and not finished: what a router counts as its load."""
        return len(self.specs) - self.num_finished

    def add(self, spec: RequestSpec, request: Request | None = None) -> None:
        """Queue a request (in arrival order); it joins the scheduler at its arrival or the end of the step then.
        ``request``: the spec's ``Request`` where ``check_requests`` made it (else it is made and checked here)."""
        ok = isinstance(request, Request) and request.request_id == spec.request_id and not request.output_token_ids
        request = request if ok else _check_spec(spec, self.sched)
        if self.specs and spec.arrival_time < self.specs[-1].arrival_time:
            raise ValueError(f"requests must be added in arrival order: {spec.arrival_time} after "
                             f"{self.specs[-1].arrival_time}")
        self.index[id(request)] = len(self.specs)
        for values, value in ((self.specs, spec), (self.requests, request), (self.first_token, None),
                              (self.finish, None), (self.last_token, 0.0), (self.queued_at_step, 0), (self.spans, [])):
            values.append(value)

    def advance(self, until: float = math.inf) -> None:
        """Run every step that starts before ``until`` (``math.inf``: to the end of what was added)."""
        sched, specs = self.sched, self.specs
        while True:
            while self._next < len(specs) and specs[self._next].arrival_time <= self.clock:
                sched.add_request(self.requests[self._next])
                self.queued_at_step[self._next] = sched.num_steps + 1  # a candidate from this step on
                self._next += 1
            if not sched.has_unfinished():
                if self._next == len(specs) or specs[self._next].arrival_time > until:
                    return
                self.clock = specs[self._next].arrival_time  # idle until the next arrival
                continue
            if self.clock >= until:
                return
            step = sched.schedule()
            if not step.chunks:
                raise RuntimeError("the scheduler planned nothing although requests are unfinished")
            end = self.clock + self.cost.time_from_sums(*step_sums(step)) + step.stats.load_s  # a tier's loads
            self._record_step(step, self.clock, end)
            self.clock = end
            if self.sim.skip_ahead:
                pending = specs[self._next].arrival_time if self._next < len(specs) else math.inf
                self.clock = self._skip(self.clock, min(pending, until), step)

    def _record_step(self, step: Step, start: float, end: float) -> None:
        sampled, self._first_tokens = [], 0
        for c in step.chunks:
            r = c.request
            i = self.index[id(r)]
            self.recomputed += add_span(self.spans[i], c.start, c.start + c.num_tokens)
            if c.samples:
                sampled.append(_output_id(i, len(r.output_token_ids)))
                if self.first_token[i] is None:
                    self.first_token[i] = end
                    self._first_tokens += 1
                else:
                    self.itl.append(end - self.last_token[i])
                    self.itl_weight.append(1)
                self.last_token[i] = end
        if self.sim.record_schedule:
            self.schedule.append([(c.request.request_id, c.start, c.num_tokens, tuple(c.block_table))
                                  for c in step.chunks])
        stats = step.stats
        self._add_steps(start=[start], end=[end], tokens=[stats.scheduled_tokens], running=[stats.num_running],
                        waiting=[stats.num_waiting], used=[stats.used_blocks],
                        live=[sum(r.num_computed_tokens for r in self.sched.running)])
        self._finished(self.sched.postprocess(step, sampled), end)

    def _finished(self, requests: list[Request], at: float) -> None:
        for r in requests:
            self.finish[self.index[id(r)]] = at
        self.num_finished += len(requests)
        if self.bar is not None and requests:
            self.bar.update(len(requests))

    def _skip(self, clock: float, next_arrival: float, step: Step) -> float:
        """Run the coming pure-decode steps at once (``skipahead``) and record them; returns the clock."""
        stretch = plan_stretch(self.sched, step, clock, next_arrival, self._first_tokens, self.cost.time_from_sums,
                               lambda r, n: _output_ids(self.index[id(r)], len(r.output_token_ids), n),
                               self.sim.record_schedule)
        if stretch is None:
            return clock
        k, ends = stretch.num_steps, stretch.ends
        self._add_steps(start=stretch.starts, end=ends, tokens=stretch.active, running=stretch.active,
                        waiting=[len(self.sched.waiting)] * k, used=stretch.used_blocks,
                        live=[c + a for c, a in zip(stretch.context, stretch.active)])
        # Everyone's first interval runs from its own last token (a request the token budget
        # left out of the previous step has waited longer); later ones are the step times, one
        # interval standing for every request decoding in that step.
        for r, last in zip(stretch.running, stretch.last):
            i = self.index[id(r)]
            self.itl.append(ends[0] - self.last_token[i])
            self.itl_weight.append(1)
            self.last_token[i] = ends[min(k, last + 1) - 1]
            self.spans[i][-1][1] += min(k, last + 1)  # its decodes: new positions after its last chunk
        self.itl.extend(np.subtract(ends[1:], stretch.starts[1:]).tolist())
        self.itl_weight.extend(stretch.active[1:])
        for s, finished in stretch.finished.items():
            self._finished(finished, ends[s])
        self.schedule.extend(stretch.schedule)
        self.skipped_steps += k
        return ends[-1]

    def _add_steps(self, **columns: list) -> None:
        for name, values in columns.items():
            self.steps[name].extend(values)

    def result(self) -> SimResult:
        specs = self.specs
        steps = {k: np.array(v, dtype=np.float64 if k in ("start", "end") else np.int64) for k, v in self.steps.items()}
        prompt_len = np.array([sp.prompt_len for sp in specs])
        output_len = np.array([len(r.output_token_ids) for r in self.requests])  # max_model_len may stop one early
        step_tokens = steps["tokens"]
        hit_tokens = np.array([r.num_cached_tokens for r in self.requests], dtype=np.int64)  # first admissions
        return SimResult(
            num_blocks=self.sim.num_blocks, block_size=self.sim.block_size,
            arrival=np.array([sp.arrival_time for sp in specs]),
            first_token=np.array(self.first_token, dtype=np.float64), finish=np.array(self.finish, dtype=np.float64),
            prompt_len=prompt_len, output_len=output_len, hit_tokens=hit_tokens,
            shared_prefix_len=np.array([sp.prefix_len for sp in specs]),
            preemptions=np.array([r.num_preemptions for r in self.requests]),
            step_start=steps["start"], step_end=steps["end"], step_tokens=step_tokens,
            num_running=steps["running"], num_waiting=steps["waiting"], used_blocks=steps["used"],
            live_tokens=steps["live"], itl=np.array(self.itl, dtype=np.float64),
            itl_weight=np.array(self.itl_weight, dtype=np.float64),
            recomputed_tokens=self.recomputed, schedule=self.schedule,
            skipped_steps=self.skipped_steps, queued_at_step=np.array(self.queued_at_step, dtype=np.int64),
            scheduler=self.sched,
            requests=self.requests)
