"""Capacity in the scheduler: which requests run in the next step, and with how many tokens (chapter 05).

A serving engine runs in *steps* (iterations). Each step the scheduler picks
requests and a number of tokens for each; the model then computes those tokens
in one batched forward pass. Two budgets bound a step:

* a **token budget** (``max_num_batched_tokens``): the compute of one pass, and
* the **free blocks** of the KV pool: every token computed leaves its K and V in
  a slot, and a slot lives in a block that must exist before the pass writes it.

``plan_iteration`` is the budget pass of the article's §05, line for line. Each
candidate asks for ``min(next_chunk, token_budget)`` tokens; when the budget is
spent the pass stops; a candidate whose ``extra_blocks`` exceed the free blocks is
skipped; otherwise its blocks are reserved and both budgets shrink. A prompt
longer than the budget is therefore split over several steps (chunked prefill),
and a decoding request asks for one token per step.

``Scheduler`` keeps the state around that pass, and nothing else (no tensors):

* ``Request``: token ids, how many of them are computed (have K/V in the pool),
  the block table, the status (waiting, running, finished).
* the *running* list (oldest first) and the *waiting* queue (first come, first
  served). Running requests are candidates before waiting ones. One rule is added
  to the article's pass, as in vLLM: once a waiting request is skipped because its
  blocks do not fit, no request behind it is admitted in that step (``head_of_line``).
  Otherwise small newcomers could take every block that frees up, and a large
  request at the head of the queue would wait forever.
* a ``PrefixCache`` (chapter 04): a waiting request's cached prefix is looked up
  just before its turn; those tokens count as computed and are not recomputed.
* **preemption by recompute** (as vLLM does): when the running requests' next
  tokens cannot all get blocks, the newest running request gives all its blocks
  back and returns to the *front* of the waiting queue; later its tokens are
  computed again (its full blocks often survive in the prefix cache).

``schedule()`` returns a ``Step``: for each scheduled request a ``ScheduledChunk``
(token ids, positions, slot mapping, block table), the copy-on-write block pairs
to apply before writing, the preempted requests and the step's statistics.
After the model ran, ``postprocess(step, sampled_token_ids)`` appends the sampled
tokens, finishes requests and releases their blocks. Chapter 05's engine drives
it with a real model; chapter 06's simulator with synthetic tokens and a cost model.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

from .checks import check_int
from .paging import BlockAllocator, blocks_needed
from .prefix import CachedBlockTable, CacheKey, PrefixCache

__all__ = [
    "RequestStatus",
    "Request",
    "extra_blocks",
    "plan_iteration",
    "Decision",
    "ScheduledChunk",
    "StepStats",
    "Step",
    "Scheduler",
]


class RequestStatus(enum.Enum):
    WAITING = "waiting"    # in the queue: holds no blocks (or only a tentative prefix hit)
    RUNNING = "running"    # admitted: holds blocks, gets tokens every step it fits
    FINISHED = "finished"  # done: its blocks went back (cached full blocks stay cached)


_request_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation request and its scheduling state.

    ``prompt_token_ids`` (at least one id >= 0) and ``max_new_tokens`` (>= 1) come from
    the user; ``eos_token_id`` optionally ends the request early. The rest is state:

    * ``output_token_ids``: tokens sampled so far.
    * ``num_computed_tokens``: leading tokens whose K/V are in the pool (or will be
      once the current step runs). ``next_chunk`` = tokens known but not yet computed:
      the rest of the prompt while prefilling, 1 while decoding.
    * ``block_table``: the physical blocks holding those K/V, in logical order.
    * ``num_cached_tokens``: tokens of the last admission served by the prefix cache.
    * ``shared_tail`` and ``revived_blocks``: set by the scheduler just before the
      request's turn in ``plan_iteration``, read by ``extra_blocks`` (see there).
    """

    prompt_token_ids: list[int]
    max_new_tokens: int
    eos_token_id: int | None = None
    request_id: Any = field(default_factory=lambda: next(_request_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    shared_tail: bool = False
    revived_blocks: int = 0
    table: CachedBlockTable | None = field(default=None, repr=False)  # the scheduler's block table object

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_token_ids, (list, tuple, range)) or len(self.prompt_token_ids) < 1:
            raise ValueError(f"prompt_token_ids must be a non-empty list of token ids >= 0, "
                             f"got {self.prompt_token_ids!r}")
        for t in self.prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"prompt_token_ids must hold integers >= 0, found {t!r}")
        self.prompt_token_ids = list(self.prompt_token_ids)
        check_int("max_new_tokens", self.max_new_tokens, 1)
        if self.eos_token_id is not None:
            check_int("eos_token_id", self.eos_token_id, 0)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Tokens known so far: the prompt and the outputs."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def next_chunk(self) -> int:
        """Tokens known but not computed yet: what this request would like to compute next."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Still computing its prompt (or, after a preemption, its prompt and earlier outputs)."""
        return self.next_chunk > 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def extra_blocks(request: Request, tokens: int, block_size: int) -> int:
    """Free blocks that computing ``tokens`` more tokens of ``request`` takes from the pool.

    Three terms, each a block that must leave the free pool before the step writes:

    * **new blocks** for the slots: positions ``[num_computed_tokens, num_computed_tokens
      + tokens)`` need ``blocks_needed(num_computed_tokens + tokens)`` blocks, of which
      ``len(block_table)`` are already in the table;
    * **copy-on-write**: +1 when the next token lands in a partly filled tail block that
      another request also holds (``shared_tail``): it gets a private copy first;
    * **revived blocks**: a waiting request's prefix hit may point at cached blocks that
      no one holds; they sit in the free queue, and taking them uses free blocks too.
    """
    check_int("tokens", tokens, 0)
    check_int("block_size", block_size, 1)
    if tokens == 0:
        return 0
    new = max(0, blocks_needed(request.num_computed_tokens + tokens, block_size) - len(request.block_table))
    copy = 1 if request.shared_tail and request.num_computed_tokens % block_size else 0
    return new + copy + request.revived_blocks


def plan_iteration(candidates: Iterable[Request], free_blocks: int, token_budget: int, block_size: int,
                   reserve: Callable[[Request, int], None] | None = None) -> list[tuple[Request, int]]:
    """The article's budget pass: which candidates get how many tokens this step.

    Candidates are visited in order, so the order decides who gets space first; paging
    itself decides no priority. Every candidate has at least one token to compute, so
    ``tokens`` is 0 only when the budget is spent, and the pass stops there. A candidate
    whose blocks do not fit is skipped (a later, smaller one may still fit).

    ``reserve(request, tokens)`` is called where the article reserves the blocks (the
    ``Scheduler`` allocates them there); without it the pass only plans and changes nothing.
    Returns ``[(request, tokens), ...]`` in the order they were planned.
    """
    check_int("free_blocks", free_blocks, 0)
    check_int("token_budget", token_budget, 0)
    check_int("block_size", block_size, 1)
    plan = []
    for request in candidates:
        tokens = min(request.next_chunk, token_budget)
        if tokens == 0:
            break
        needed = extra_blocks(request, tokens, block_size)
        if needed > free_blocks:
            continue
        if reserve is not None:
            reserve(request, tokens)
        plan.append((request, tokens))
        free_blocks -= needed
        token_budget -= tokens
    return plan


@dataclass
class Decision:
    """One candidate's turn in a step's budget pass, as ``plan_iteration`` saw it.

    ``tokens`` = min(next_chunk, ``token_budget``) and ``needed`` = its ``extra_blocks``,
    against the ``free_blocks`` and ``token_budget`` left at its turn. ``outcome`` is
    ``"planned"``, ``"skipped"`` (needed > free_blocks) or ``"stop"`` (the budget is spent).
    """

    request: Request
    waiting: bool
    next_chunk: int
    tokens: int
    needed: int
    free_blocks: int
    token_budget: int
    outcome: str


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

    ``num_blocks``: the pool size, or pass ``allocator`` (a ``BlockAllocator``) or
    ``prefix_cache`` (a ``PrefixCache``) to share one. ``block_size``: tokens per block.
    ``max_num_batched_tokens``: the token budget of one step. ``enable_prefix_caching``:
    look up and register full blocks (off: nothing is ever committed, so nothing hits).
    ``priority``: ``None`` serves the waiting queue first come, first served; a key
    function reorders it before each step (smaller first), e.g. shortest prompt first.
    ``cache_key``: the computation identity for prefix hashing (chapter 04).
    ``head_of_line``: ``True`` (as vLLM): once a waiting request does not get its
    blocks, no request behind it in the queue is admitted in that step, so no request
    starves. ``False``: the article's rule, a later, smaller request may pass it.

    Use: ``add_request`` any time; each step ``step = schedule()``, run the model on
    ``step.chunks``, then ``postprocess(step, sampled_token_ids)``.
    """

    def __init__(self, num_blocks: int | None = None, block_size: int = 16, max_num_batched_tokens: int = 256,
                 *, enable_prefix_caching: bool = True, allocator: BlockAllocator | None = None,
                 prefix_cache: PrefixCache | None = None, priority: Callable[[Request], Any] | None = None,
                 cache_key: CacheKey = CacheKey(), head_of_line: bool = True):
        check_int("block_size", block_size, 1)
        check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        if prefix_cache is not None:
            if prefix_cache.block_size != block_size:
                raise ValueError(f"block_size must equal prefix_cache.block_size {prefix_cache.block_size}, "
                                 f"got {block_size}")
            allocator = prefix_cache.allocator
        if allocator is None:
            check_int("num_blocks", num_blocks, 1)
            allocator = BlockAllocator(num_blocks)
        elif not isinstance(allocator, BlockAllocator):
            raise ValueError(f"allocator must be a labkit.paging.BlockAllocator, got {type(allocator).__name__}")
        if priority is not None and not callable(priority):
            raise ValueError("priority must be None (first come, first served) or a key function of a Request")
        self.allocator = allocator
        self.prefix_cache = prefix_cache or PrefixCache(allocator, block_size)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.priority = priority
        self.cache_key = cache_key
        self.head_of_line = bool(head_of_line)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.num_steps = 0
        self._chunks: list[ScheduledChunk] = []   # filled by _reserve during one schedule()
        self._copies: list[tuple[int, int]] = []
        self._decisions: list[Decision] = []      # filled by _candidates during one schedule()
        self._budget_left = max_num_batched_tokens

    # ------------------------------------------------------------------ requests
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def add_request(self, request: Request | Sequence[int], max_new_tokens: int | None = None,
                    eos_token_id: int | None = None) -> Request:
        """Queue a ``Request`` (or build one from prompt ids and ``max_new_tokens``); returns it.

        Refuses a request that could not fit even alone in the whole pool, as engines do
        ("max seq len is larger than the KV cache"): it would wait forever.
        """
        if not isinstance(request, Request):
            if max_new_tokens is None:
                raise ValueError("max_new_tokens must be given (an integer >= 1) with prompt token ids")
            request = Request(list(request) if not isinstance(request, (list, tuple, range)) else request,
                              max_new_tokens, eos_token_id)
        self.check_fits(request)
        self.waiting.append(request)
        return request

    def check_fits(self, request: Request) -> None:
        """ValueError unless ``request`` is new and its whole length fits in the pool."""
        if not isinstance(request, Request):
            raise ValueError(f"request must be a Request, got {type(request).__name__}")
        if (request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.table is not None
                or request.output_token_ids or any(request is r for r in self.waiting)):
            raise ValueError("request must be new: waiting, not queued yet, nothing computed, no blocks")
        need = blocks_needed(len(request.prompt_token_ids) + request.max_new_tokens, self.block_size)
        if need > self.num_blocks:
            raise ValueError(f"max_new_tokens: prompt ({len(request.prompt_token_ids)}) + max_new_tokens "
                             f"({request.max_new_tokens}) tokens need {need} blocks of {self.block_size}, "
                             f"more than the pool's {self.num_blocks}")

    def fork(self, request: Request) -> Request:
        """A twin of a running request that shares all of its blocks (parallel sampling, beam search).

        Nothing is copied now. The first of the two that writes into their shared, partly
        filled tail block gets a private copy of it first (copy-on-write): one of the cases
        ``extra_blocks`` counts, and a ``(src, dst)`` pair in that step's ``copies``.
        """
        if not isinstance(request, Request) or request.status is not RequestStatus.RUNNING \
                or not any(request is r for r in self.running):
            raise ValueError("request must be a running request of this scheduler")
        child = Request(list(request.prompt_token_ids), request.max_new_tokens, request.eos_token_id)
        child.output_token_ids = list(request.output_token_ids)
        child.num_computed_tokens = request.num_computed_tokens
        child.table = self.prefix_cache.fork(request.table)
        child.block_table = list(child.table.block_ids)
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        return child

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> Step:
        """Plan the next step: preempt if the running requests cannot grow, then the budget pass."""
        self.num_steps += 1
        self._chunks, self._copies, self._decisions = [], [], []
        self._budget_left = self.max_num_batched_tokens  # what plan_iteration's token budget is down to
        preempted = self._preempt_until_running_fit()
        if self.priority is not None:
            self.waiting = deque(sorted(self.waiting, key=self.priority))
        # After a preemption no waiting request is admitted this step (as in vLLM): the
        # blocks just freed go to the running requests that needed them, not to newcomers.
        plan = plan_iteration(self._candidates(include_waiting=not preempted), self.allocator.num_free,
                              self.max_num_batched_tokens, self.block_size, reserve=self._reserve)
        for request in self.waiting:  # those not admitted: drop their tentative prefix hit
            self._forget_lookup(request)
        chunks, copies, decisions = self._chunks, self._copies, self._decisions
        self._chunks, self._copies, self._decisions = [], [], []
        assert [d.request for d in decisions if d.outcome == "planned"] == [r for r, _ in plan]
        stats = StepStats(
            step=self.num_steps,
            scheduled_tokens=sum(c.num_tokens for c in chunks),
            prefill_tokens=sum(c.num_tokens for c in chunks if c.num_tokens > 1 or not c.samples),
            decode_tokens=sum(1 for c in chunks if c.num_tokens == 1 and c.samples),
            num_scheduled=len(chunks),
            prefix_hit_tokens=sum(c.num_cached_tokens for c in chunks),
            preemptions=len(preempted),
            copies=len(copies),
            free_blocks=self.allocator.num_free,
            used_blocks=self.allocator.num_used,
            cached_blocks=self.prefix_cache.num_cached_blocks,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
        )
        return Step(self.num_steps, chunks, copies, preempted, stats, decisions)

    def postprocess(self, step: Step, sampled_token_ids: Sequence[int]) -> list[Request]:
        """After the model ran: append one sampled token per sampling chunk; finish and release.

        ``sampled_token_ids`` holds one id per chunk of ``step.sampling_chunks``, in order.
        Full blocks computed in this step are registered in the prefix cache first, so a
        finished request's blocks stay reusable. Returns the requests that finished.
        """
        sampling = step.sampling_chunks
        if len(sampled_token_ids) != len(sampling):
            raise ValueError(f"sampled_token_ids must hold one id per sampling chunk ({len(sampling)}), "
                             f"got {len(sampled_token_ids)}")
        for t in sampled_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"sampled_token_ids must hold integers >= 0, found {t!r}")
        if self.enable_prefix_caching:
            for chunk in step.chunks:
                request = chunk.request
                if request.status is RequestStatus.RUNNING and request.table is not None:
                    self.prefix_cache.commit(request.table, request.num_computed_tokens)
        finished = []
        for chunk, token in zip(sampling, sampled_token_ids):
            request = chunk.request
            request.output_token_ids.append(token)
            if len(request.output_token_ids) >= request.max_new_tokens or token == request.eos_token_id:
                self.finish(request)
                finished.append(request)
        step.stats.finished = len(finished)
        return finished

    # ------------------------------------------------------------------ helpers
    def _candidates(self, include_waiting: bool = True) -> Iterator[Request]:
        """Running requests first (oldest first), then the waiting queue in order.

        A generator, so that each request's shared tail and prefix hit are looked at
        just before its turn, after the requests before it reserved their blocks.
        With ``head_of_line``, the first waiting request that ``plan_iteration`` skips
        (its blocks did not fit) ends the waiting candidates of this step: the article's
        ``continue`` would let smaller requests behind it take the blocks that free up,
        step after step, and a large request could wait forever.
        """
        for request in list(self.running):
            self._refresh_tail(request)
            self._record_turn(request, waiting=False)
            yield request
        if not include_waiting:
            return
        for request in list(self.waiting):
            self._look_up_prefix(request)
            self._record_turn(request, waiting=True)
            yield request
            if self.head_of_line and request.status is RequestStatus.WAITING:
                return  # it did not fit: nobody queued behind it may pass it (no starvation)

    def _record_turn(self, request: Request, waiting: bool) -> None:
        """Note what ``plan_iteration`` is about to see for ``request`` (for ``Step.decisions``)."""
        budget = self._budget_left
        free = self.allocator.num_free
        tokens = min(request.next_chunk, budget)
        needed = extra_blocks(request, tokens, self.block_size)
        outcome = "stop" if tokens == 0 else "skipped" if needed > free else "planned"
        self._decisions.append(Decision(request, waiting, request.next_chunk, tokens, needed, free, budget,
                                        outcome))

    def _refresh_tail(self, request: Request) -> None:
        table = request.table
        request.shared_tail = bool(table is not None and table.block_ids
                                   and table.num_tokens % self.block_size
                                   and self.allocator.ref_counts[table.block_ids[-1]] > 1)

    def _look_up_prefix(self, request: Request) -> None:
        """Tentatively count a waiting request's cached prefix as computed (no references taken)."""
        self._forget_lookup(request)
        if not self.enable_prefix_caching:
            return
        match = self.prefix_cache.match(request.all_token_ids, self.cache_key)
        request.num_computed_tokens = match.num_cached_tokens
        request.block_table = list(match.block_ids)
        request.revived_blocks = sum(1 for b in match.block_ids if self.allocator.ref_counts[b] == 0)

    def _forget_lookup(self, request: Request) -> None:
        request.num_computed_tokens, request.block_table = 0, []
        request.revived_blocks, request.shared_tail = 0, False

    def _reserve(self, request: Request, tokens: int) -> None:
        """Take the blocks ``plan_iteration`` counted, and record the chunk for the step."""
        free_before = self.allocator.num_free
        needed = extra_blocks(request, tokens, self.block_size)
        start = request.num_computed_tokens
        chunk_ids = request.all_token_ids[start:start + tokens]
        num_cached = 0
        if request.status is RequestStatus.WAITING:  # admit: prefix hit + fresh blocks in one go
            table, num_cached = self.prefix_cache.allocate(request.all_token_ids[:start + tokens], self.cache_key)
            assert num_cached == start, "the prefix hit changed between lookup and reservation"
            slot_mapping = [table.slot(p) for p in range(start, start + tokens)]
            request.table, request.num_cached_tokens = table, num_cached
            request.status = RequestStatus.RUNNING
            self.waiting.remove(request)
            self.running.append(request)
        else:
            result = self.prefix_cache.append(request.table, chunk_ids)
            slot_mapping = result.slot_mapping
            self._copies.extend(result.copies)
        assert free_before - self.allocator.num_free == needed, "extra_blocks disagrees with the allocation"
        request.num_computed_tokens = start + tokens
        self._budget_left -= tokens
        request.block_table = list(request.table.block_ids)
        request.revived_blocks, request.shared_tail = 0, False
        self._chunks.append(ScheduledChunk(request, chunk_ids, start, slot_mapping, list(request.block_table),
                                           samples=start + tokens == request.num_tokens,
                                           num_cached_tokens=num_cached))

    def _preempt_until_running_fit(self) -> list[Request]:
        """vLLM's rule: while the running requests' next tokens need more blocks than are free,
        preempt the newest running request (recompute later).

        The same budget pass as ``plan_iteration`` over the running requests only, but
        where a running request does not fit it is not skipped: running requests hold
        blocks, and if each waited for another's, none would ever move.
        """
        preempted: list[Request] = []
        while self.running:
            free, budget = self.allocator.num_free, self.max_num_batched_tokens
            short = False
            for request in self.running:
                self._refresh_tail(request)
                tokens = min(request.next_chunk, budget)
                if tokens == 0:
                    break
                needed = extra_blocks(request, tokens, self.block_size)
                if needed > free:
                    short = True
                    break
                free -= needed
                budget -= tokens
            if not short:
                break
            victim = self.running.pop()  # the newest
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def _preempt(self, request: Request) -> None:
        """Free all of ``request``'s blocks and put it at the front of the waiting queue."""
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """A running request is done: release its blocks (cached full blocks stay) and move it to finished."""
        self._release(request)
        request.status = RequestStatus.FINISHED
        self.running.remove(request)
        self.finished.append(request)

    def _release(self, request: Request) -> None:
        """Drop the request's references; blocks others hold, and cached full blocks, stay."""
        if request.table is not None:
            self.prefix_cache.release(request.table)
        request.table = None
        request.block_table, request.num_computed_tokens = [], 0
        request.revived_blocks, request.shared_tail = 0, False
