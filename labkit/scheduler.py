"""Capacity in the scheduler: which requests run in the next step, and with how many tokens (chapter 05).

An engine runs in *steps*: each step the scheduler picks requests and a number of tokens for
each, and the model computes them in one batched pass. Two budgets bound a step: the **token
budget** (``max_num_batched_tokens``) and the **free blocks** of the KV pool (every computed
token's K/V need a slot before the pass writes it). ``plan_iteration`` is the article's budget
pass, line for line: a prompt longer than the budget is split over steps (chunked prefill), a
decoding request asks for one token. What a turn takes from the pool is ``extra_blocks``
(in ``labkit.prefix``, beside the copy-on-write test it counts).

``Scheduler`` keeps the state around that pass and follows vLLM v1 (``vllm/v1/core/sched/
scheduler.py``, ``Scheduler.schedule``, vLLM 0.33.0): running requests first, oldest first, then
waiting ones in order, at most ``max_num_seqs`` running; a waiting request is admitted only when
blocks for its whole known sequence are free (``full_sequence_must_fit``), and nobody is admitted
behind one that was not; full blocks are named when allocated, so a request admitted later in the
same step shares them; when a running request cannot grow, the newest running request is
**preempted by recompute** (its blocks go back, it returns to the front of the queue).

``allocation="max_len"`` or ``"exact"`` turns the paged scheduler into the systems the PagedAttention
paper compares against (Orca (Max) and Orca (Oracle)): each admitted request takes blocks for its whole
reservation at once and never grows, so chapter 03's reserved-but-empty slots cost concurrency.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

from .checks import check_choice, check_flag, check_int, check_token_ids, parse_stop_token_ids
from .paging import BlockAllocator, blocks_needed
from .prefix import CachedBlockTable, CacheKey, PrefixCache, PrefixMatch, extra_blocks

__all__ = ["RequestStatus", "Request", "extra_blocks", "plan_iteration", "Decision", "ScheduledChunk",
           "StepStats", "Step", "Scheduler", "ALLOCATIONS", "check_allocation", "DecodeStretch", "advance_decodes"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"    # in the queue: holds no blocks
    RUNNING = "running"    # admitted: holds blocks, gets tokens every step it fits
    FINISHED = "finished"  # done or cancelled: its blocks went back (named full blocks stay cached)


_request_ids = itertools.count()
_NO_HIT = PrefixMatch((), 0, ())

# How a request takes KV memory: block by block as its tokens need them (vLLM), or all at admission, for
# max_model_len tokens (Orca (Max)) or for exactly its longest sequence (Orca (Oracle)).
ALLOCATIONS = ("paged", "max_len", "exact")


def check_allocation(allocation: object, max_model_len: object, num_blocks: int,
                     block_size: int) -> tuple[str, int | None]:
    """``(allocation, max_model_len)`` checked: one of ``ALLOCATIONS``, and ``None`` or an integer >= 1
    that fits the pool of ``num_blocks`` blocks (required with ``"max_len"``: what every request reserves)."""
    check_choice("allocation", allocation, ALLOCATIONS)
    if max_model_len is not None or allocation == "max_len":
        if max_model_len is None:
            raise ValueError("max_model_len must be an integer >= 1 with allocation='max_len', got None")
        max_model_len = check_int("max_model_len", max_model_len, 1)
        if blocks_needed(max_model_len, block_size) > num_blocks:
            raise ValueError(f"max_model_len must fit the pool ({num_blocks} blocks of {block_size} tokens), "
                             f"got {max_model_len}")
    return allocation, max_model_len


@dataclass(eq=False)
class Request:
    """One generation request and its scheduling state.

    ``num_computed_tokens``: leading tokens whose K/V are in the pool (or will be once the
    current step runs; for a waiting request during its turn, its prefix hit). ``block_table``:
    the blocks holding them (chapter 04's ``CachedBlockTable``), ``None`` while it holds none.
    ``num_cached_tokens``: tokens of the last admission served by the prefix cache.
    """

    prompt_token_ids: list[int]
    max_new_tokens: int
    eos_token_id: int | Sequence[int] | None = None  # one stop id or several (chat models list a few)
    request_id: Any = field(default_factory=lambda: next(_request_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: CachedBlockTable | None = field(default=None, repr=False)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    stop_token_ids: frozenset[int] = field(init=False, repr=False)  # eos_token_id as a set

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(check_token_ids("prompt_token_ids", self.prompt_token_ids, 1))
        check_int("max_new_tokens", self.max_new_tokens, 1)
        self.output_token_ids = list(check_token_ids("output_token_ids", self.output_token_ids))
        check_int("num_computed_tokens", self.num_computed_tokens, 0)
        if self.num_computed_tokens > self.num_tokens:
            raise ValueError(f"num_computed_tokens must be in [0, {self.num_tokens}] (the tokens known), "
                             f"got {self.num_computed_tokens}")
        if not isinstance(self.status, RequestStatus):
            raise ValueError(f"status must be a RequestStatus, got {self.status!r}")
        if self.block_table is not None and not isinstance(self.block_table, CachedBlockTable):
            raise ValueError(f"block_table must be None or a CachedBlockTable, got {type(self.block_table).__name__}")
        check_int("num_cached_tokens", self.num_cached_tokens, 0)
        check_int("num_preemptions", self.num_preemptions, 0)
        try:
            hash(self.request_id)
        except TypeError:
            raise ValueError(f"request_id must be hashable (a dict key), got {self.request_id!r}") from None
        ids = parse_stop_token_ids(self.eos_token_id)
        self.eos_token_id = ids[0] if len(ids) == 1 else (ids or None)
        self.stop_token_ids = frozenset(ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Tokens known so far: the prompt and the outputs."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_new_tokens(self) -> int:
        """How many tokens are known but not computed yet: the rest of the prompt while
        prefilling, 1 while decoding. A count, not a list."""
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, stop: int) -> list[int]:
        """The tokens at positions ``[start, stop)`` (while decoding, without copying the whole history);
        ``0 <= start <= stop <= num_tokens``."""
        p = len(self.prompt_token_ids)
        if not (type(start) is int and type(stop) is int and 0 <= start <= stop <= p + len(self.output_token_ids)):
            check_int("start", start, 0)
            check_int("stop", stop, 0)
            raise ValueError(f"start and stop must satisfy 0 <= start <= stop <= {self.num_tokens} (num_tokens), "
                             f"got start={start!r}, stop={stop!r}")
        return self.output_token_ids[start - p:stop - p] if start >= p else self.all_token_ids[start:stop]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class Decision:
    """One candidate's turn in a step's budget pass, as ``plan_iteration`` saw it.

    ``tokens`` = min(num_new_tokens, ``token_budget``) and ``needed`` = its ``extra_blocks``,
    against the ``free_blocks`` and ``token_budget`` left at its turn (after any preemption it
    caused). ``outcome`` is ``"planned"``, ``"skipped"`` (needed > free_blocks), ``"preempted"``
    (a running request that had to give its own blocks back) or ``"stop"`` (the budget is spent).
    """

    request: Request
    waiting: bool
    num_new_tokens: int
    tokens: int
    needed: int
    free_blocks: int
    token_budget: int
    outcome: str


def plan_iteration(candidates: Iterable[Request], free_blocks: int, token_budget: int, block_size: int,
                   reserve: Callable[[Request, int], None] | None = None,
                   needed: Callable[[Request, int], int] | None = None,
                   decisions: list[Decision] | None = None,
                   make_room: Callable[[Request, int], int] | None = None) -> list[tuple[Request, int]]:
    """The article's budget pass: which candidates get how many tokens this step.

    Candidates are visited in order, so the order decides who gets space first; paging
    itself decides no priority. The pass stops when the token budget is spent; a candidate
    with nothing to compute now is passed over. A candidate whose blocks do not fit is
    skipped (a later, smaller one may still fit).

    ``needed(request, tokens)``: its ``extra_blocks`` (default: judged on its own, no
    sharing); ``reserve(request, tokens)`` is called where the article reserves the blocks
    (the ``Scheduler`` allocates them there); without it the pass only plans.
    ``make_room(request, tokens)``: asked when a *running* candidate does not fit; it may
    free blocks (the ``Scheduler`` preempts, perhaps this candidate itself) and returns the
    free blocks now. Each turn is appended to ``decisions`` when given. Returns
    ``[(request, tokens), ...]`` in order.
    """
    check_int("free_blocks", free_blocks, 0)
    check_int("token_budget", token_budget, 1)  # a step computes at least one token
    check_int("block_size", block_size, 1)
    plan = []
    for request in candidates:
        num_new_tokens = request.num_new_tokens
        tokens = min(num_new_tokens, token_budget)
        if tokens == 0 and token_budget:
            continue  # nothing to compute now: its last token is still being sampled
        waiting = request.status is RequestStatus.WAITING
        if tokens == 0:
            blocks = 0
        elif needed is not None:
            blocks = needed(request, tokens)
        else:  # judged on its own: no sharing, no revival
            held = len(request.block_table.block_ids) if request.block_table is not None else 0
            blocks = extra_blocks(request.num_computed_tokens, held, tokens, block_size)
        preempted = False
        if blocks > free_blocks and make_room is not None and not waiting:
            free_blocks = make_room(request, tokens)
            preempted = request.status is RequestStatus.WAITING  # it gave its own blocks back
            if needed is not None and not preempted:
                blocks = needed(request, tokens)  # a preempted twin may have shared its tail
        outcome = ("stop" if tokens == 0 else "preempted" if preempted
                   else "skipped" if blocks > free_blocks else "planned")
        if decisions is not None:
            decisions.append(Decision(request, waiting, num_new_tokens, tokens, blocks, free_blocks,
                                      token_budget, outcome))
        if tokens == 0:
            break
        if outcome != "planned":
            continue
        if reserve is not None:
            reserve(request, tokens)
        plan.append((request, tokens))
        free_blocks -= blocks
        token_budget -= tokens
    return plan


@dataclass
class ScheduledChunk:
    """One request's share of a step: which tokens to compute and where their K/V go.

    ``token_ids`` sit at positions ``start, start + 1, ...``; ``slot_mapping[i]`` is the
    pool slot (``block_id * block_size + offset``) where token i's K/V are written;
    ``block_table`` lists the request's blocks after this step's reservation, and
    ``seq_len`` = ``start + num_tokens`` positions are valid after the step. ``samples``:
    the chunk reaches the last known token, so the model's output at its last position
    is the next token (a chunk in the middle of a prompt samples nothing).
    """

    request: Request
    token_ids: list[int]
    start: int
    slot_mapping: list[int]
    block_table: list[int]
    samples: bool
    num_cached_tokens: int = 0  # prefix-hit tokens skipped when this request was admitted this step

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.num_tokens)

    @property
    def seq_len(self) -> int:
        return self.start + self.num_tokens


@dataclass
class StepStats:
    """What one step did, for tables and charts."""

    step: int
    scheduled_tokens: int = 0          # tokens computed this step (<= max_num_batched_tokens)
    prefill_tokens: int = 0            # of which part of a prompt (chunks of more than one token or not sampling)
    decode_tokens: int = 0             # of which single decode tokens
    num_scheduled: int = 0             # requests that got tokens
    prefix_hit_tokens: int = 0         # tokens of newly admitted requests found in the prefix cache
    preemptions: int = 0               # running requests sent back to the waiting queue
    copies: int = 0                    # copy-on-write block copies
    free_blocks: int = 0               # free blocks after the step's reservations (cached ones included)
    used_blocks: int = 0               # blocks held by at least one request
    cached_blocks: int = 0             # blocks named in the prefix cache (used or free)
    num_running: int = 0
    num_waiting: int = 0
    finished: int = 0                  # requests finished by this step (set by postprocess)

    def count(self, step: "Step", scheduler: "Scheduler") -> None:
        """Fill in what ``step`` plans, and the scheduler's pool and queues once it was planned."""
        total, decode = step.num_tokens, sum(1 for c in step.chunks if c.num_tokens == 1 and c.samples)
        self.scheduled_tokens, self.prefill_tokens, self.decode_tokens = total, total - decode, decode
        self.num_scheduled, self.preemptions, self.copies = len(step.chunks), len(step.preempted), len(step.copies)
        self.prefix_hit_tokens = sum(c.num_cached_tokens for c in step.chunks)
        self.free_blocks, self.used_blocks = scheduler.allocator.num_free, scheduler.allocator.num_used
        self.cached_blocks = scheduler.prefix_cache.num_cached_blocks
        self.num_running, self.num_waiting = len(scheduler.running), len(scheduler.waiting)


@dataclass
class Step:
    """The plan of one step, ready for a model (or a simulator) to execute.

    Apply ``copies`` (copy every layer's K/V of block ``src`` into block ``dst``) before
    writing this step's K/V. ``preempted`` requests lost their blocks in this step.
    ``decisions`` records every candidate's turn in the budget pass (chapter 05's tables).
    """

    index: int
    chunks: list[ScheduledChunk]
    copies: list[tuple[int, int]]
    preempted: list[Request]
    stats: StepStats
    decisions: list[Decision] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sampling_chunks(self) -> list[ScheduledChunk]:
        """The chunks that produce a token; ``postprocess`` takes one id per chunk, in this order."""
        return [c for c in self.chunks if c.samples]


class Scheduler:
    """Continuous batching over a paged KV pool with a prefix cache (no tensors).

    ``num_blocks``: the pool size, or pass a ``prefix_cache`` (and its allocator) to share one.
    ``max_num_batched_tokens``: the token budget of a step; ``max_num_seqs``: the most requests
    running at once (default 256, what vLLM's ``EngineArgs`` picks on GPUs below 70 GiB; its
    ``SchedulerConfig`` class default is 128, and H100, H200 and GPUs of 160 GiB or more get 1,024).
    ``enable_prefix_caching``: look up and name full blocks. ``priority``: ``None`` is first come,
    first served; a key function reorders the queue before each step (smaller first).
    ``cache_key``: the computation identity for prefix hashing. ``head_of_line``: ``True`` (as
    vLLM) admits nobody behind a waiting request that was not admitted; ``False`` is the article's
    rule, a later, smaller request may pass it. ``full_sequence_must_fit``: ``True`` (vLLM's
    default, ``SchedulerConfig.scheduler_reserve_full_isl``) admits a waiting request only when
    blocks for its whole known sequence (prompt and outputs so far, after its prefix hit) are free,
    not just for the chunk it computes now; ``False`` asks only for the chunk, and a long prompt
    admitted piece by piece may have to be preempted before it is done. ``allocation``: ``"paged"``
    (vLLM) takes a block when a token needs one; ``"max_len"`` (Orca (Max)) takes blocks for
    ``max_model_len`` tokens at admission, ``"exact"`` (Orca (Oracle), which knows the length) for
    prompt + max_new_tokens - 1: such a request never grows, so it is never preempted, and waits
    until its whole reservation is free. ``max_model_len``: the longest sequence a request may
    reach (``None``: the pool's size), and the reservation of ``"max_len"``.

    Each step: ``step = schedule()``, run the model on ``step.chunks``, then
    ``postprocess(step, sampled_token_ids)``, once. In between, ``finish`` (an abort) and ``fork``
    are safe, as with vLLM's asynchronous front end: a request finished meanwhile gets no token,
    and a twin forked meanwhile gets the token its parent samples.
    """

    def __init__(self, num_blocks: int | None = None, block_size: int = 16, max_num_batched_tokens: int = 256,
                 *, max_num_seqs: int = 256, enable_prefix_caching: bool = True,
                 prefix_cache: PrefixCache | None = None, priority: Callable[[Request], Any] | None = None,
                 cache_key: CacheKey = CacheKey(), head_of_line: bool = True, full_sequence_must_fit: bool = True,
                 allocation: str = "paged", max_model_len: int | None = None):
        check_int("block_size", block_size, 1)
        check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        check_int("max_num_seqs", max_num_seqs, 1)
        flags = [check_flag(name, value) for name, value in (
            ("enable_prefix_caching", enable_prefix_caching), ("head_of_line", head_of_line),
            ("full_sequence_must_fit", full_sequence_must_fit))]
        if not isinstance(cache_key, CacheKey):
            raise ValueError(f"cache_key must be a labkit.prefix.CacheKey, got {type(cache_key).__name__}")
        if prefix_cache is None:
            prefix_cache = PrefixCache(BlockAllocator(check_int("num_blocks", num_blocks, 1)), block_size)
        elif not isinstance(prefix_cache, PrefixCache) or prefix_cache.block_size != block_size:
            raise ValueError(f"prefix_cache must be a PrefixCache with block_size {block_size}")
        elif num_blocks is not None:
            raise ValueError("num_blocks must be None when prefix_cache is given (its allocator sets the pool)")
        allocation, max_model_len = check_allocation(allocation, max_model_len, prefix_cache.allocator.num_blocks,
                                                     block_size)
        if priority is not None and not callable(priority):
            raise ValueError("priority must be None (first come, first served) or a key function of a Request")
        self.prefix_cache, self.allocator = prefix_cache, prefix_cache.allocator
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching, self.head_of_line, self.full_sequence_must_fit = flags
        self.priority, self.cache_key = priority, cache_key
        self.allocation, self.max_model_len = allocation, max_model_len
        self._reserves = allocation != "paged"  # tested on the hot path
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.requests: dict[Any, Request] = {}  # unfinished requests by request_id
        self.num_steps = 0
        # During one schedule(): id(request) -> its prefix hit; the chunks, copies and preemptions so far.
        self._hits: dict[int, PrefixMatch] = {}
        self._chunks: list[ScheduledChunk] = []
        self._copies: list[tuple[int, int]] = []
        self._preempted: list[Request] = []
        # The step handed out and not postprocessed yet; id(request) -> the requests its sampled token goes to.
        self._in_flight: Step | None = None
        self._samplers: dict[int, list[Request]] = {}
        self._fork_ids = itertools.count(1)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request | Sequence[int], max_new_tokens: int | None = None,
                    eos_token_id: int | Sequence[int] | None = None) -> Request:
        """Queue a ``Request`` (or build one from prompt ids and ``max_new_tokens``); returns it."""
        if not isinstance(request, Request):
            if max_new_tokens is None:
                raise ValueError("max_new_tokens must be given (an integer >= 1) with prompt token ids")
            request = Request(request if isinstance(request, (list, tuple, range)) else list(request),
                              max_new_tokens, eos_token_id)
        self.check_fits(request)
        self.waiting.append(request)
        self.requests[request.request_id] = request
        return request

    def check_fits(self, request: Request) -> None:
        """ValueError unless ``request`` is new, its id unused, and it fits alone in the pool (else it
        would wait forever): prompt + max_new_tokens - 1 slots (the last token is never fed back)."""
        if not isinstance(request, Request):
            raise ValueError(f"request must be a Request, got {type(request).__name__}")
        if (request.status is not RequestStatus.WAITING or request.num_computed_tokens
                or request.block_table is not None or request.output_token_ids):
            raise ValueError("request must be new: waiting, not queued yet, nothing computed, no blocks")
        if request.request_id in self.requests:
            raise ValueError(f"request_id must be unique among unfinished requests, got {request.request_id!r} twice")
        longest = len(request.prompt_token_ids) + request.max_new_tokens - 1
        if self.max_model_len is not None and longest > self.max_model_len:
            raise ValueError(f"max_new_tokens: prompt ({len(request.prompt_token_ids)}) + max_new_tokens "
                             f"({request.max_new_tokens}) - 1 slots exceed max_model_len ({self.max_model_len})")
        need = blocks_needed(longest, self.block_size)
        if need > self.num_blocks:
            raise ValueError(f"max_new_tokens: prompt ({len(request.prompt_token_ids)}) + max_new_tokens "
                             f"({request.max_new_tokens}) - 1 slots need {need} blocks of {self.block_size}, "
                             f"more than the pool's {self.num_blocks}")

    def reserved_tokens(self, request: Request) -> int:
        """Slots ``request`` takes at admission: ``max_model_len`` (``"max_len"``), its longest sequence
        prompt + max_new_tokens - 1 (``"exact"``: the last token is never fed back), 0 (``"paged"``)."""
        if self.allocation == "max_len":
            return self.max_model_len
        return len(request.prompt_token_ids) + request.max_new_tokens - 1 if self._reserves else 0

    def fork(self, request: Request) -> Request:
        """A twin of a running request sharing all its blocks (parallel sampling; copy-on-write later).

        Its id is ``(parent id, "fork", n)``, unused by any unfinished request. Forked while a step is
        in flight, the twin is the parent as that step leaves it: it gets the token the parent samples.
        """
        if not isinstance(request, Request) or request.status is not RequestStatus.RUNNING \
                or self.requests.get(request.request_id) is not request:
            raise ValueError("request must be a running request of this scheduler")
        if self._reserves:  # the twin would share the reserved blocks it is about to write
            raise ValueError(f"fork needs allocation='paged', got {self.allocation!r}")
        if len(self.running) >= self.max_num_seqs:
            raise ValueError(f"max_num_seqs: {self.max_num_seqs} requests run already")
        child_id = (request.request_id, "fork", next(self._fork_ids))
        while child_id in self.requests:
            child_id = (request.request_id, "fork", next(self._fork_ids))
        child = Request(list(request.prompt_token_ids), request.max_new_tokens, request.eos_token_id,
                        request_id=child_id, output_token_ids=list(request.output_token_ids),
                        num_computed_tokens=request.num_computed_tokens,
                        block_table=self.prefix_cache.fork(request.block_table), status=RequestStatus.RUNNING)
        self.running.append(child)
        self.requests[child.request_id] = child
        if id(request) in self._samplers:  # its token is being sampled: the twin gets it too
            self._samplers[id(request)].append(child)
            self._samplers[id(child)] = self._samplers[id(request)]
        return child

    # ------------------------------------------------------------------ one step
    def schedule(self) -> Step:
        """Plan the next step: the budget pass over the running requests (preempting the newest when
        one cannot grow), then, if nobody was preempted, over the waiting ones (as in vLLM: the
        freed blocks go to the running). ValueError while the previous step awaits ``postprocess``."""
        if self._in_flight is not None:
            raise ValueError(f"step {self._in_flight.index} is in flight: postprocess it before the next schedule()")
        self.num_steps += 1
        self._chunks, self._copies, self._hits, self._preempted = [], [], {}, []
        if self.priority is not None:
            self.waiting = deque(sorted(self.waiting, key=self.priority))
        decisions: list[Decision] = []
        plan_iteration(self._candidates(), self.allocator.num_free, self.max_num_batched_tokens, self.block_size,
                       self._reserve, self._extra_blocks, decisions, self._make_room)
        for request in self.waiting:  # those not admitted: drop their tentative prefix hit
            request.num_computed_tokens = 0
        step = Step(self.num_steps, self._chunks, self._copies, self._preempted, StepStats(self.num_steps), decisions)
        step.stats.count(step, self)
        self._in_flight = step
        self._samplers = {id(c.request): [c.request] for c in step.chunks if c.samples}
        return step

    def postprocess(self, step: Step, sampled_token_ids: Sequence[int]) -> list[Request]:
        """After the model ran: one sampled token per chunk of ``step.sampling_chunks``, in order,
        appended to its request (and to twins forked meanwhile; not to requests finished meanwhile);
        finish and release. Returns the finished requests (named full blocks stay cached)."""
        if self._in_flight is None or step is not self._in_flight:
            raise ValueError("step must be the step the last schedule() returned, postprocessed once")
        sampling = step.sampling_chunks
        if len(sampled_token_ids) != len(sampling):
            raise ValueError(f"sampled_token_ids must hold one id per sampling chunk ({len(sampling)}), "
                             f"got {len(sampled_token_ids)}")
        check_token_ids("sampled_token_ids", sampled_token_ids)
        finished, samplers = [], self._samplers
        self._in_flight, self._samplers = None, {}
        for chunk, token in zip(sampling, sampled_token_ids):
            for request in samplers[id(chunk.request)]:
                if request.status is not RequestStatus.RUNNING:
                    continue  # finished (aborted) while the step ran
                request.output_token_ids.append(token)
                if len(request.output_token_ids) >= request.max_new_tokens or token in request.stop_token_ids:
                    self.finish(request)
                    finished.append(request)
        step.stats.finished = len(finished)
        return finished

    def finish(self, request: Request) -> None:
        """Done, or cancelled (any time, a step in flight too): release its blocks (named full blocks stay cached)."""
        if not isinstance(request, Request) or self.requests.get(request.request_id) is not request:
            raise ValueError("request must be an unfinished request of this scheduler")
        (self.running if request.status is RequestStatus.RUNNING else self.waiting).remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]
        self.finished.append(request)

    # ------------------------------------------------------------------ helpers
    def _candidates(self) -> Iterator[Request]:
        """Running requests (oldest first; the list shrinks from the end when one is preempted), then,
        unless someone was preempted, waiting ones in order while fewer than ``max_num_seqs`` run.
        Lazily: a waiting request's prefix hit is looked up just before its turn, after the requests
        before it named their blocks. With ``head_of_line`` it stops after the first waiting request
        that was not admitted (else smaller ones behind it could starve it)."""
        i = 0
        while i < len(self.running):
            yield self.running[i]
            i += 1
        if self._preempted:
            return
        for request in list(self.waiting):
            if len(self.running) >= self.max_num_seqs:
                return
            if self.enable_prefix_caching:
                hit = self._hits[id(request)] = self.prefix_cache.match(request.all_token_ids, self.cache_key)
                request.num_computed_tokens = hit.num_cached_tokens
            yield request
            if self.head_of_line and request.status is RequestStatus.WAITING:
                return

    def _extra_blocks(self, request: Request, tokens: int) -> int:
        """``extra_blocks`` of ``request`` now: after its prefix hit if waiting, on its table if running.
        With ``full_sequence_must_fit``, a waiting request whose whole sequence does not fit in the free
        blocks reports that need instead (vLLM's ``KVCacheManager.allocate_slots`` returns None)."""
        if request.status is RequestStatus.WAITING:
            hit = self._hits.get(id(request), _NO_HIT)
            if self._reserves:  # the whole reservation, at admission
                return self.prefix_cache.hit_extra_blocks(hit, self.reserved_tokens(request) - hit.num_cached_tokens)
            if self.full_sequence_must_fit:
                whole = self.prefix_cache.hit_extra_blocks(hit, request.num_tokens - hit.num_cached_tokens)
                if whole > self.allocator.num_free:
                    return whole
            return self.prefix_cache.hit_extra_blocks(hit, tokens)
        return self.prefix_cache.extra_blocks(request.block_table, tokens)

    def _make_room(self, request: Request, tokens: int) -> int:
        """vLLM's rule when a running request cannot grow: preempt the newest running request until it
        can, or until it was the newest itself. Returns the free blocks now. (A request holding blocks
        cannot just wait: if each waited for another's, none would move.)"""
        while self._extra_blocks(request, tokens) > self.allocator.num_free:
            victim = self.running.pop()
            self._release(victim)
            victim.status = RequestStatus.WAITING
            victim.num_preemptions += 1
            self.waiting.appendleft(victim)
            self._preempted.append(victim)
            if victim is request:
                break
        return self.allocator.num_free

    def _reserve(self, request: Request, tokens: int) -> None:
        """Take the blocks ``plan_iteration`` counted (admitting a waiting request); record the chunk."""
        start, num_cached = request.num_computed_tokens, 0
        chunk_ids = request.token_ids(start, start + tokens)
        if request.status is RequestStatus.WAITING:  # admit: prefix hit + fresh blocks in one go
            request.block_table, num_cached = self.prefix_cache.allocate(
                request.all_token_ids[:start + tokens], self.cache_key, lookup=self.enable_prefix_caching)
            request.num_cached_tokens, request.status = num_cached, RequestStatus.RUNNING
            if self._reserves:  # the rest of the reservation: the table never grows again
                table = request.block_table
                more = blocks_needed(self.reserved_tokens(request), self.block_size) - len(table.block_ids)
                table.block_ids.extend(self.allocator.allocate_many(more))
            self.waiting.remove(request)
            self.running.append(request)
            request.num_computed_tokens = start + tokens
            self._name_full_blocks(request)
        else:
            self._copies.extend(self._append(request, chunk_ids))
        table = request.block_table
        self._chunks.append(ScheduledChunk(request, chunk_ids, start, table.slots(start, start + tokens),
                                           list(table.block_ids), samples=start + tokens == request.num_tokens,
                                           num_cached_tokens=num_cached))

    def _append(self, request: Request, token_ids: list[int]) -> list[tuple[int, int]]:
        """Slots for a running request's next tokens; returns the copy-on-write pairs."""
        copies = self.prefix_cache.grow(request.block_table, token_ids)
        request.num_computed_tokens += len(token_ids)
        self._name_full_blocks(request)
        return copies

    def _name_full_blocks(self, request: Request) -> None:
        """vLLM's ``allocate_slots`` calls ``cache_blocks``: a request admitted later in the step shares them."""
        table = request.block_table
        if self.enable_prefix_caching and request.num_computed_tokens // self.block_size > table.num_named_blocks:
            self.prefix_cache.cache_full_blocks(table, request.num_computed_tokens)

    def _release(self, request: Request) -> None:
        """Drop the request's references; blocks others hold, and named full blocks, stay."""
        if request.block_table is not None:
            self.prefix_cache.release(request.block_table)
        request.block_table, request.num_computed_tokens = None, 0


@dataclass
class DecodeStretch:
    """What ``advance_decodes`` did: per step, the blocks in use after its reservations;
    the requests finished, by step; each running request's block table (its own list: read it
    before the next step)."""

    used_blocks: list[int]
    finished: dict[int, list[Request]]
    block_tables: list[list[int]]


def advance_decodes(sched: Scheduler, max_steps: int, next_tokens: Callable[[Request, int], Sequence[int]],
                    may_run: Callable[[int, int, int, int], bool]) -> DecodeStretch:
    """Up to ``max_steps`` pure-decode steps of ``sched`` at once, as many ``schedule()`` + ``postprocess()`` would.

    For chapter 06's simulator, which checks that the steps are pure decode (every running
    request computes one token per step, nobody waiting can be admitted). ``next_tokens(request,
    n)``: the next ``n`` tokens it samples (asked ahead for a request with stop ids, to find its
    last step). Before step ``s``, ``may_run(s, new_blocks, active, context)`` is asked (the blocks
    the step takes, the requests still running, their tokens computed so far); the stretch ends
    at the first no. The allocator sees the same events in the same order as when stepping: each
    step, the requests that start a new block, in running order, then the finishing ones release
    theirs. Each request's tokens are appended by ``Scheduler._append`` (the stepping code) at its
    next new block, its finish or the end: in between they touch nothing shared.
    """
    if not isinstance(sched, Scheduler):
        raise ValueError(f"sched must be a labkit.scheduler.Scheduler, got {type(sched).__name__}")
    check_int("max_steps", max_steps, 1)
    for name, fn in (("next_tokens", next_tokens), ("may_run", may_run)):
        if not callable(fn):
            raise ValueError(f"{name} must be callable, got {type(fn).__name__}")
    if sched._in_flight is not None:
        raise ValueError(f"step {sched._in_flight.index} is in flight: postprocess it before advance_decodes")
    bs, running = sched.block_size, list(sched.running)
    computed = [r.num_computed_tokens for r in running]
    sampled = [len(r.output_token_ids) for r in running]
    last = [r.max_new_tokens - n - 1 for r, n in zip(running, sampled)]  # the step of its last token
    ahead: dict[int, Sequence[int]] = {}  # tokens asked ahead, for requests that stop on a token
    for j, r in enumerate(running):
        if r.stop_token_ids:
            ahead[j] = next_tokens(r, last[j] + 1)
            last[j] = next((s for s, t in enumerate(ahead[j]) if t in r.stop_token_ids), last[j])
    new_block: list[list[int]] = [[] for _ in range(bs)]  # request j starts a block in step s
    for j, c in enumerate(computed):                      # when (c + s) % bs == 0
        new_block[c % bs].append(j)
    grows = not sched._reserves  # a request holding its reservation never takes a fresh block
    num_new_block = [len(group) * grows for group in new_block]  # of them, those still running that take one
    finishing: dict[int, list[int]] = {}
    for j, end in enumerate(last):
        finishing.setdefault(end, []).append(j)
    # The tables' lists grow in place; releasing a table gives it a new, empty one.
    stretch = DecodeStretch([], {}, [r.block_table.block_ids for r in running])

    def catch_up(j: int, steps: int) -> None:  # request j after `steps` steps: its tokens sampled, computed
        r, stop, have = running[j], computed[j] + steps, len(running[j].output_token_ids) - sampled[j]
        r.output_token_ids.extend(ahead[j][have:steps] if j in ahead else next_tokens(r, steps - have))
        if stop > r.num_computed_tokens:
            sched._append(r, r.token_ids(r.num_computed_tokens, stop))

    active, context, s = len(running), sum(computed), 0
    while s < max_steps and may_run(s, num_new_block[-s % bs], active, context):
        for j in new_block[-s % bs]:
            if s <= last[j]:
                catch_up(j, s + 1)
        stretch.used_blocks.append(sched.allocator.num_used)
        context += active
        for j in finishing.get(s, ()):
            catch_up(j, s + 1)
            sched.finish(running[j])
            stretch.finished.setdefault(s, []).append(running[j])
            active, context = active - 1, context - computed[j] - s - 1
            num_new_block[computed[j] % bs] -= grows
        s += 1
    for j, end in enumerate(last):
        if end >= s:
            catch_up(j, s)
    sched.num_steps += s
    return stretch

