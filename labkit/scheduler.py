"""Capacity in the scheduler: which requests run in the next step, and with how many tokens (chapter 05).

A serving engine runs in *steps* (iterations). Each step the scheduler picks
requests and a number of tokens for each; the model then computes those tokens
in one batched forward pass. Two budgets bound a step:

* a **token budget** (``max_num_batched_tokens``): the compute of one pass, and
* the **free blocks** of the KV pool: every token computed leaves its K and V in
  a slot, and a slot lives in a block that must exist before the pass writes it.

``plan_iteration`` is the budget pass of the article's §05, line for line. Each
candidate asks for ``min(num_new_tokens, token_budget)`` tokens; when the budget is
spent the pass stops; a candidate whose ``extra_blocks`` exceed the free blocks is
skipped; otherwise its blocks are reserved and both budgets shrink. A prompt
longer than the budget is therefore split over several steps (chunked prefill),
and a decoding request asks for one token per step.

``Scheduler`` keeps the state around that pass, and nothing else (no tensors).
It follows vLLM v1 (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``, vLLM 0.33.0):

* running requests (oldest first) are candidates before waiting ones (first come,
  first served), and at most ``max_num_seqs`` requests run at once;
* once a waiting request does not get its blocks, nobody queued behind it is
  admitted in that step (``head_of_line``): otherwise small newcomers could take
  every block that frees up and a large request would wait forever;
* a waiting request's cached prefix (chapter 04) is looked up just before its
  turn; those tokens are not computed again. Full blocks get their names when
  they are *allocated* (``KVCacheManager.allocate_slots`` calls ``cache_blocks``),
  so a request admitted later in the same step already shares them;
* **preemption by recompute**: when the running requests' next tokens cannot all
  get blocks, the newest running request gives all its blocks back and returns to
  the *front* of the waiting queue; later its tokens are computed again (its full
  blocks often survive in the prefix cache). No one is admitted in that step.

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
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

from .checks import check_int
from .paging import BlockAllocator, blocks_needed
from .prefix import CachedBlockTable, CacheKey, PrefixCache, PrefixMatch, tail_is_shared

__all__ = ["RequestStatus", "Request", "extra_blocks", "plan_iteration", "Decision", "ScheduledChunk",
           "StepStats", "Step", "Scheduler"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"    # in the queue: holds no blocks
    RUNNING = "running"    # admitted: holds blocks, gets tokens every step it fits
    FINISHED = "finished"  # done or cancelled: its blocks went back (named full blocks stay cached)


_request_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation request and its scheduling state.

    ``prompt_token_ids`` (at least one id >= 0) and ``max_new_tokens`` (>= 1) come from
    the user; ``eos_token_id`` optionally ends the request early. The rest is state:

    * ``output_token_ids``: tokens sampled so far.
    * ``num_computed_tokens``: leading tokens whose K/V are in the pool (or will be
      once the current step runs). For a waiting request, during its turn in a step:
      the tokens its prefix-cache hit would give it.
    * ``block_table``: the physical blocks holding those K/V (chapter 04's
      ``CachedBlockTable``), ``None`` while the request holds no blocks.
    * ``num_cached_tokens``: tokens of the last admission served by the prefix cache.
    """

    prompt_token_ids: list[int]
    max_new_tokens: int
    eos_token_id: int | None = None
    request_id: Any = field(default_factory=lambda: next(_request_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: CachedBlockTable | None = field(default=None, repr=False)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_token_ids, (list, tuple, range)) or len(self.prompt_token_ids) < 1:
            raise ValueError(f"prompt_token_ids must be a non-empty list of token ids >= 0, "
                             f"got {self.prompt_token_ids!r}")
        for t in self.prompt_token_ids:
            if type(t) is not int or t < 0:
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
    def num_new_tokens(self) -> int:
        """How many tokens are known but not computed yet: the rest of the prompt while
        prefilling, 1 while decoding. A count, not a list."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def extra_blocks(num_computed_tokens: int, num_blocks_held: int, tokens: int, block_size: int, *,
                 shared_tail: bool = False, revived_blocks: int = 0) -> int:
    """Free blocks that computing ``tokens`` more tokens of a request takes from the pool.

    Three terms, each a block that must leave the free pool before the step writes:

    * **new blocks** for the slots: positions ``[num_computed_tokens, num_computed_tokens
      + tokens)`` need ``blocks_needed(num_computed_tokens + tokens)`` blocks, of which the
      request holds ``num_blocks_held``;
    * **copy-on-write**: +1 when the next token lands in a partly filled tail block that
      another request also holds (``shared_tail``): it gets a private copy first;
    * **revived blocks**: a waiting request's prefix hit may point at cached blocks that
      no one holds; they sit in the free queue, and taking them uses free blocks too.
    """
    check_int("tokens", tokens, 0)
    check_int("block_size", block_size, 1)
    if tokens == 0:
        return 0
    new = max(0, blocks_needed(num_computed_tokens + tokens, block_size) - num_blocks_held)
    copy = 1 if shared_tail and num_computed_tokens % block_size else 0
    return new + copy + revived_blocks


def _own_blocks(request: Request, tokens: int, block_size: int) -> int:
    """``extra_blocks`` of a request judged on its own: no sharing, no revival."""
    held = len(request.block_table.block_ids) if request.block_table is not None else 0
    return extra_blocks(request.num_computed_tokens, held, tokens, block_size)


@dataclass
class Decision:
    """One candidate's turn in a step's budget pass, as ``plan_iteration`` saw it.

    ``tokens`` = min(num_new_tokens, ``token_budget``) and ``needed`` = its ``extra_blocks``,
    against the ``free_blocks`` and ``token_budget`` left at its turn. ``outcome`` is
    ``"planned"``, ``"skipped"`` (needed > free_blocks) or ``"stop"`` (the budget is spent).
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
                   decisions: list[Decision] | None = None) -> list[tuple[Request, int]]:
    """The article's budget pass: which candidates get how many tokens this step.

    Candidates are visited in order, so the order decides who gets space first; paging
    itself decides no priority. Every candidate has at least one token to compute, so
    ``tokens`` is 0 only when the budget is spent, and the pass stops there. A candidate
    whose blocks do not fit is skipped (a later, smaller one may still fit).

    ``needed(request, tokens)``: its ``extra_blocks`` (default: judged on its own, no
    sharing); ``reserve(request, tokens)`` is called where the article reserves the blocks
    (the ``Scheduler`` allocates them there); without it the pass only plans. Each turn is
    appended to ``decisions`` when given. Returns ``[(request, tokens), ...]`` in order.
    """
    check_int("free_blocks", free_blocks, 0)
    check_int("token_budget", token_budget, 0)
    check_int("block_size", block_size, 1)
    plan = []
    for request in candidates:
        tokens = min(request.num_new_tokens, token_budget)
        blocks = 0 if tokens == 0 else needed(request, tokens) if needed else _own_blocks(request, tokens, block_size)
        if decisions is not None:
            outcome = "stop" if tokens == 0 else "skipped" if blocks > free_blocks else "planned"
            decisions.append(Decision(request, request.status is RequestStatus.WAITING, request.num_new_tokens,
                                      tokens, blocks, free_blocks, token_budget, outcome))
        if tokens == 0:
            break
        if blocks > free_blocks:
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
    ``max_num_batched_tokens``: the token budget of one step. ``max_num_seqs``: at most
    this many requests run at once (vLLM's default, 256). ``enable_prefix_caching``:
    look up and name full blocks (off: nothing is looked up or named). ``priority``:
    ``None`` serves the waiting queue first come, first served; a key function reorders
    it before each step (smaller first). ``cache_key``: the computation identity for
    prefix hashing (chapter 04). ``head_of_line``: ``True`` (as vLLM): once a waiting
    request does not get its blocks, no request behind it is admitted in that step.
    ``False``: the article's rule, a later, smaller request may pass it.

    Use: ``add_request`` any time; each step ``step = schedule()``, run the model on
    ``step.chunks``, then ``postprocess(step, sampled_token_ids)``.
    """

    def __init__(self, num_blocks: int | None = None, block_size: int = 16, max_num_batched_tokens: int = 256,
                 *, max_num_seqs: int = 256, enable_prefix_caching: bool = True,
                 allocator: BlockAllocator | None = None, prefix_cache: PrefixCache | None = None,
                 priority: Callable[[Request], Any] | None = None, cache_key: CacheKey = CacheKey(),
                 head_of_line: bool = True):
        check_int("block_size", block_size, 1)
        check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        check_int("max_num_seqs", max_num_seqs, 1)
        if prefix_cache is not None:
            if not isinstance(prefix_cache, PrefixCache) or prefix_cache.block_size != block_size:
                raise ValueError(f"prefix_cache must be a PrefixCache with block_size {block_size}")
            allocator = prefix_cache.allocator
        if allocator is None:
            allocator = BlockAllocator(check_int("num_blocks", num_blocks, 1))
        elif not isinstance(allocator, BlockAllocator):
            raise ValueError(f"allocator must be a labkit.paging.BlockAllocator, got {type(allocator).__name__}")
        if priority is not None and not callable(priority):
            raise ValueError("priority must be None (first come, first served) or a key function of a Request")
        self.allocator = allocator
        self.prefix_cache = prefix_cache or PrefixCache(allocator, block_size)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.priority = priority
        self.cache_key = cache_key
        self.head_of_line = bool(head_of_line)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.requests: dict[Any, Request] = {}  # unfinished requests by request_id
        self.num_steps = 0
        self._hits: dict[int, PrefixMatch] = {}  # id(request) -> its prefix hit, during one schedule()
        self._last_needed = 0  # extra_blocks of the turn plan_iteration is at
        self._chunks: list[ScheduledChunk] = []  # filled by _reserve during one schedule()
        self._copies: list[tuple[int, int]] = []

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
            request = Request(request if isinstance(request, (list, tuple, range)) else list(request),
                              max_new_tokens, eos_token_id)
        self.check_fits(request)
        self.waiting.append(request)
        self.requests[request.request_id] = request
        return request

    def check_fits(self, request: Request) -> None:
        """ValueError unless ``request`` is new, its id unused, and its whole length fits in the pool.

        The last sampled token is never fed back, so it needs no slot: prompt +
        max_new_tokens - 1 slots.
        """
        if not isinstance(request, Request):
            raise ValueError(f"request must be a Request, got {type(request).__name__}")
        if (request.status is not RequestStatus.WAITING or request.num_computed_tokens
                or request.block_table is not None or request.output_token_ids):
            raise ValueError("request must be new: waiting, not queued yet, nothing computed, no blocks")
        if request.request_id in self.requests:
            raise ValueError(f"request_id must be unique among unfinished requests, got {request.request_id!r} twice")
        need = blocks_needed(len(request.prompt_token_ids) + request.max_new_tokens - 1, self.block_size)
        if need > self.num_blocks:
            raise ValueError(f"max_new_tokens: prompt ({len(request.prompt_token_ids)}) + max_new_tokens "
                             f"({request.max_new_tokens}) - 1 slots need {need} blocks of {self.block_size}, "
                             f"more than the pool's {self.num_blocks}")

    def fork(self, request: Request) -> Request:
        """A twin of a running request that shares all of its blocks (parallel sampling, beam search).

        Nothing is copied now. The first of the two that writes into their shared, partly
        filled tail block gets a private copy of it first (copy-on-write): one of the cases
        ``extra_blocks`` counts, and a ``(src, dst)`` pair in that step's ``copies``.
        """
        if not isinstance(request, Request) or request.status is not RequestStatus.RUNNING \
                or self.requests.get(request.request_id) is not request:
            raise ValueError("request must be a running request of this scheduler")
        if len(self.running) >= self.max_num_seqs:
            raise ValueError(f"max_num_seqs: {self.max_num_seqs} requests run already")
        child = Request(list(request.prompt_token_ids), request.max_new_tokens, request.eos_token_id)
        child.output_token_ids = list(request.output_token_ids)
        child.num_computed_tokens = request.num_computed_tokens
        child.block_table = self.prefix_cache.fork(request.block_table)
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        self.requests[child.request_id] = child
        return child

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> Step:
        """Plan the next step: preempt if the running requests cannot grow, then the budget pass."""
        self.num_steps += 1
        self._chunks, self._copies, self._hits = [], [], {}
        preempted = self._preempt_until_running_fit()
        if self.priority is not None:
            self.waiting = deque(sorted(self.waiting, key=self.priority))
        # After a preemption no waiting request is admitted this step (as in vLLM): the
        # blocks just freed go to the running requests that needed them, not to newcomers.
        decisions: list[Decision] = []
        plan_iteration(self._candidates(include_waiting=not preempted), self.allocator.num_free,
                       self.max_num_batched_tokens, self.block_size, self._reserve, self._extra_blocks, decisions)
        for request in self.waiting:  # those not admitted: drop their tentative prefix hit
            request.num_computed_tokens = 0
        chunks, copies = self._chunks, self._copies
        self._chunks, self._copies, self._hits = [], [], {}
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
        Returns the requests that finished (their named full blocks stay cached).
        """
        sampling = step.sampling_chunks
        if len(sampled_token_ids) != len(sampling):
            raise ValueError(f"sampled_token_ids must hold one id per sampling chunk ({len(sampling)}), "
                             f"got {len(sampled_token_ids)}")
        for t in sampled_token_ids:
            if type(t) is not int or t < 0:
                raise ValueError(f"sampled_token_ids must hold integers >= 0, found {t!r}")
        finished = []
        for chunk, token in zip(sampling, sampled_token_ids):
            request = chunk.request
            request.output_token_ids.append(token)
            if len(request.output_token_ids) >= request.max_new_tokens or token == request.eos_token_id:
                self.finish(request)
                finished.append(request)
        step.stats.finished = len(finished)
        return finished

    def finish(self, request: Request) -> None:
        """The request is done, or cancelled while waiting: release its blocks (named full
        blocks stay cached) and move it to ``finished``."""
        if not isinstance(request, Request) or self.requests.get(request.request_id) is not request:
            raise ValueError("request must be an unfinished request of this scheduler")
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]
        self.finished.append(request)

    # ------------------------------------------------------------------ helpers
    def _candidates(self, include_waiting: bool = True) -> Iterator[Request]:
        """Running requests first (oldest first), then the waiting queue in order.

        A generator: a waiting request's prefix hit is looked up just before its turn,
        after the requests before it reserved (and named) their blocks. It stops offering
        waiting requests when ``max_num_seqs`` run, and, with ``head_of_line``, after the
        first waiting request the pass skipped: the article's ``continue`` would let
        smaller requests behind it take the blocks that free up, step after step.
        """
        yield from list(self.running)
        if not include_waiting:
            return
        for request in list(self.waiting):
            if len(self.running) >= self.max_num_seqs:
                return
            if self.enable_prefix_caching:
                hit = self.prefix_cache.match(request.all_token_ids, self.cache_key)
                self._hits[id(request)] = hit
                request.num_computed_tokens = hit.num_cached_tokens
            yield request
            if self.head_of_line and request.status is RequestStatus.WAITING:
                return  # it did not fit: nobody queued behind it may pass it (no starvation)

    def _extra_blocks(self, request: Request, tokens: int, dropped: Counter | None = None) -> int:
        """``extra_blocks`` of ``request`` now: its prefix hit if waiting, its shared tail if running.

        ``dropped``: references that copy-on-writes planned earlier in a dry run will drop
        (after the first of two forks copies their shared tail, the second owns it alone).
        """
        if request.status is RequestStatus.WAITING:
            hit = self._hits.get(id(request), PrefixMatch((), 0, ()))
            refs = self.allocator.ref_counts
            self._last_needed = extra_blocks(hit.num_cached_tokens, hit.num_cached_blocks, tokens, self.block_size,
                                             revived_blocks=sum(1 for b in hit.block_ids if refs[b] == 0))
            return self._last_needed
        table = request.block_table
        shared = tail_is_shared(table, self.allocator)
        if shared and dropped:
            shared = self.allocator.ref_counts[table.block_ids[-1]] - dropped[table.block_ids[-1]] > 1
        self._last_needed = extra_blocks(request.num_computed_tokens, len(table.block_ids), tokens,
                                         self.block_size, shared_tail=shared)
        return self._last_needed

    def _reserve(self, request: Request, tokens: int) -> None:
        """Take the blocks ``plan_iteration`` counted, name the full ones, record the chunk."""
        free_before = self.allocator.num_free
        needed = self._last_needed  # what plan_iteration just counted for this turn
        start, prompt_len = request.num_computed_tokens, len(request.prompt_token_ids)
        chunk_ids = (request.output_token_ids[start - prompt_len:start - prompt_len + tokens] if start >= prompt_len
                     else request.all_token_ids[start:start + tokens])  # (decode: no copy of the whole history)
        num_cached = 0
        if request.status is RequestStatus.WAITING:  # admit: prefix hit + fresh blocks in one go
            table, num_cached = self.prefix_cache.allocate(request.all_token_ids[:start + tokens], self.cache_key,
                                                           lookup=self.enable_prefix_caching)
            if num_cached != start:
                raise RuntimeError(f"the prefix hit changed between lookup ({start}) and reservation ({num_cached})")
            slot_mapping = [table.slot(p) for p in range(start, start + tokens)]
            request.block_table, request.num_cached_tokens = table, num_cached
            request.status = RequestStatus.RUNNING
            self.waiting.remove(request)
            self.running.append(request)
        else:
            result = self.prefix_cache.append(request.block_table, chunk_ids)
            slot_mapping = result.slot_mapping
            self._copies.extend(result.copies)
        if free_before - self.allocator.num_free != needed:
            raise RuntimeError(f"extra_blocks said {needed} blocks, the allocation took "
                               f"{free_before - self.allocator.num_free}")
        request.num_computed_tokens = start + tokens
        table = request.block_table
        if self.enable_prefix_caching and request.num_computed_tokens // self.block_size > table.num_named_blocks:
            # vLLM: allocate_slots -> cache_blocks, so a request admitted later in this step shares them
            self.prefix_cache.cache_full_blocks(table, request.num_computed_tokens)
        self._chunks.append(ScheduledChunk(request, chunk_ids, start, slot_mapping,
                                           list(request.block_table.block_ids),
                                           samples=start + tokens == request.num_tokens,
                                           num_cached_tokens=num_cached))

    def _preempt_until_running_fit(self) -> list[Request]:
        """vLLM's rule: while the running requests' next tokens need more blocks than are free,
        preempt the newest running request (recompute later).

        The budget pass itself, as a dry run over the running requests: if it would skip
        one, the running requests do not fit. A running request is not simply skipped:
        it holds blocks, and if each waited for another's, none would ever move.
        """
        preempted: list[Request] = []
        while self.running:
            dropped: Counter = Counter()  # references that the copy-on-writes counted so far drop
            turns = []

            def needed(request: Request, tokens: int) -> int:
                turns.append(request)
                blocks = self._extra_blocks(request, tokens, dropped)
                if blocks > request.block_table.new_blocks_for(tokens):  # a copy: one reference less on the tail
                    dropped[request.block_table.block_ids[-1]] += 1
                return blocks

            plan = plan_iteration(self.running, self.allocator.num_free, self.max_num_batched_tokens,
                                  self.block_size, needed=needed)
            if len(plan) == len(turns):  # nobody was skipped (after a skip the counts no longer matter)
                break
            victim = self.running.pop()  # the newest
            self._release(victim)
            victim.status = RequestStatus.WAITING
            victim.num_preemptions += 1
            self.waiting.appendleft(victim)
            preempted.append(victim)
        return preempted

    def _release(self, request: Request) -> None:
        """Drop the request's references; blocks others hold, and named full blocks, stay."""
        if request.block_table is not None:
            self.prefix_cache.release(request.block_table)
        request.block_table, request.num_computed_tokens = None, 0
