"""Capacity in the scheduler: which requests run in the next step, and with how many tokens (chapter 05).

An engine runs in *steps*: each step the scheduler picks requests and a number of tokens for
each, and the model computes them in one batched pass. Two budgets bound a step: the **token
budget** (``max_num_batched_tokens``) and the **free blocks** of the KV pool (every computed
token's K/V need a slot before the pass writes it). ``plan_iteration`` is the article's budget
pass, line for line: a prompt longer than the budget is split over steps (chunked prefill), a
decoding request asks for one token. What a turn takes from the pool is ``extra_blocks``
(in ``labkit.memory.blocks``, beside the block arithmetic it uses).

``Scheduler`` keeps the state around that pass and decides as vLLM v1's ``Scheduler.schedule``
does (``vllm/v1/core/sched/scheduler.py``, vLLM 0.33.0): running requests first, oldest first,
then waiting ones in order; a request is admitted only when blocks for everything it knows so far
are free; when a running request cannot grow, the newest running request is **preempted by
recompute** (its blocks go back, it returns to the front of the queue).

Variants live beside this core, each in a module of ``labkit.serving.variants``: ``priority`` (a
priority order for the queue), ``forking`` (parallel sampling: twins that share blocks) and
``reservation`` (the PagedAttention paper's baselines, which reserve at admission); the simulator's
``labkit.serving.sim.skipahead`` runs many decode steps at once.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..checks import check_flag, check_int, check_token_ids
from ..memory.blocks import blocks_needed, extra_blocks
from ..memory.paging import BlockAllocator
from ..memory.prefix import CacheKey, PrefixCache, PrefixMatch
from .request import Request, RequestStatus, check_prompt_fits
from .step import Decision, ScheduledChunk, Step, StepStats

__all__ = ["plan_iteration", "Scheduler"]

_NO_HIT = PrefixMatch((), 0, ())


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


class Scheduler:
    """Continuous batching over a paged KV pool with a prefix cache (no tensors).

    A pool of ``num_blocks`` blocks of ``block_size`` tokens (or a shared ``prefix_cache``); a step computes
    at most ``max_num_batched_tokens`` tokens, and at most ``max_num_seqs`` requests run at once.
    ``enable_prefix_caching`` and ``cache_key``: chapter 04's sharing. ``head_of_line`` and
    ``full_sequence_must_fit``: the admission rules (``_candidates``, ``_extra_blocks``). ``max_model_len``: the
    most tokens (prompt + outputs) a request may reach; it stops there, as in vLLM. Each step: ``step =
    schedule()``, run the model on ``step.chunks``, then ``postprocess(step, sampled_token_ids)``; ``finish``
    (an abort) is safe in between. ``_admission_slots`` is the one hook a variant (``variants.reservation``) changes.
    """

    def __init__(self, num_blocks: int | None = None, block_size: int = 16, max_num_batched_tokens: int = 256,
                 *, max_num_seqs: int = 256, enable_prefix_caching: bool = True,
                 prefix_cache: PrefixCache | None = None, cache_key: CacheKey = CacheKey(),
                 head_of_line: bool = True, full_sequence_must_fit: bool = True, max_model_len: int | None = None):
        prefix_cache = _checked_settings(num_blocks, block_size, max_num_batched_tokens, max_num_seqs,
                                         enable_prefix_caching, prefix_cache, cache_key, head_of_line,
                                         full_sequence_must_fit, max_model_len)
        self.prefix_cache, self.allocator, self.block_size = prefix_cache, prefix_cache.allocator, block_size
        self.num_blocks, self.max_num_batched_tokens = self.allocator.num_blocks, max_num_batched_tokens
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.enable_prefix_caching, self.head_of_line = bool(enable_prefix_caching), bool(head_of_line)
        self.full_sequence_must_fit, self.cache_key = bool(full_sequence_must_fit), cache_key
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[Any, Request] = {}  # unfinished requests by request_id
        self.num_steps, self._step = 0, None     # _step: being planned, or handed out and not postprocessed
        self._hits: dict[Any, PrefixMatch] = {}  # request_id -> its latest prefix hit, while it waits

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request | Sequence[int], max_new_tokens: int | None = None,
                    eos_token_id: int | Sequence[int] | None = None) -> Request:
        """Queue a ``Request`` (or one built from prompt ids, ``max_new_tokens`` and stop ids); returns it."""
        if not isinstance(request, Request):
            request = Request(list(request), max_new_tokens, eos_token_id)
        self.check_fits(request)
        request.max_model_len = self.max_model_len or request.max_model_len  # vLLM's cap, if the engine sets one
        self.waiting.append(request)
        self.requests[request.request_id] = request
        return request

    def check_fits(self, request: Request) -> None:
        """ValueError unless ``request`` is new, its id unused, and it fits ``max_model_len`` and the pool alone."""
        _check_fits(request, self)

    def schedule(self) -> Step:
        """Plan the next step: the budget pass over the running requests (preempting the newest when
        one cannot grow), then, if nobody was preempted, over the waiting ones (as in vLLM: the
        freed blocks go to the running). ValueError while the previous step awaits ``postprocess``."""
        if self._step is not None:
            raise ValueError(f"step {self._step.index} is in flight: postprocess it before the next schedule()")
        self.num_steps += 1
        step = self._step = Step(self.num_steps, [], [], [], StepStats(self.num_steps))
        plan_iteration(self._candidates(), self.allocator.num_free, self.max_num_batched_tokens, self.block_size,
                       self._reserve, self._extra_blocks, step.decisions, self._make_room)
        for request in self.waiting:  # those not admitted: drop their tentative prefix hit
            request.num_computed_tokens = 0
        step.stats.count(step, self.allocator, self.prefix_cache, len(self.running), len(self.waiting))
        return step

    def postprocess(self, step: Step, sampled_token_ids: Sequence[int]) -> list[Request]:
        """After the model ran: one sampled token per chunk of ``step.sampling_chunks``, in order, appended to
        its request (not to one finished meanwhile). Returns the requests that finished (``finish``)."""
        if self._step is None or step is not self._step:
            raise ValueError("step must be the step the last schedule() returned, postprocessed once")
        sampling = step.sampling_chunks
        if len(sampled_token_ids) != len(sampling):
            raise ValueError(f"sampled_token_ids must hold one id per sampling chunk ({len(sampling)}), "
                             f"got {len(sampled_token_ids)}")
        check_token_ids("sampled_token_ids", sampled_token_ids)
        self._step, finished = None, []
        for chunk, token in zip(sampling, sampled_token_ids):
            request = chunk.request  # (if it finished, aborted, while the step ran: no token)
            if request.status is RequestStatus.RUNNING and request.append_output(token):
                self.finish(request)
                finished.append(request)
        step.stats.finished = len(finished)
        return finished

    def finish(self, request: Request) -> None:
        """Done, or cancelled (any time, a step in flight too): release its blocks (named full blocks stay cached)."""
        if not isinstance(request, Request) or self.requests.get(request.request_id) is not request:
            raise ValueError("request must be an unfinished request of this scheduler")
        (self.running if request.status is RequestStatus.RUNNING else self.waiting).remove(request)
        self._release(request, RequestStatus.FINISHED)
        del self.requests[request.request_id]
        self._hits.pop(request.request_id, None)

    def _candidates(self) -> Iterator[Request]:
        """Running requests, oldest first (the list shrinks from the end when one is preempted); then,
        unless someone was preempted, waiting ones in order while fewer than ``max_num_seqs`` run.
        Lazily: a waiting request's prefix hit is looked up just before its turn, after the requests
        before it named their blocks. With ``head_of_line`` (vLLM) nobody is admitted behind a waiting
        request that was not; without it (the article's rule) a smaller one may pass it."""
        i = 0
        while i < len(self.running):
            yield self.running[i]
            i += 1
        if self._step.preempted:
            return
        for request in list(self.waiting):
            if len(self.running) >= self.max_num_seqs:
                return
            if self.enable_prefix_caching:  # its chain from its last look, as vLLM keeps Request.block_hashes
                hit = self._hits[request.request_id] = self.prefix_cache.match(
                    request.all_token_ids, self.cache_key, self._hits.get(request.request_id, _NO_HIT).block_hashes)
                request.num_computed_tokens = hit.num_cached_tokens + hit.num_external_tokens
            yield request
            if self.head_of_line and request.status is RequestStatus.WAITING:
                return  # not admitted: nobody behind it is

    def _extra_blocks(self, request: Request, tokens: int) -> int:
        """The free blocks ``request`` takes to compute ``tokens`` more tokens: on its table if running; after
        its prefix hit if waiting. There ``full_sequence_must_fit`` (vLLM's default: its ``allocate_slots`` returns
        None) asks for all the tokens it knows, so that a long prompt is not admitted to be preempted halfway."""
        if request.status is not RequestStatus.WAITING:
            return self.prefix_cache.extra_blocks(request.block_table, tokens)
        hit = self._hits.get(request.request_id, _NO_HIT)
        if self.full_sequence_must_fit:
            whole = self.prefix_cache.hit_extra_blocks(hit, request.num_tokens - hit.num_cached_tokens)
            if whole > self.allocator.num_free:
                return whole
        return self.prefix_cache.hit_extra_blocks(hit, self._admission_slots(request, tokens) - hit.num_cached_tokens)

    def _make_room(self, request: Request, tokens: int) -> int:
        """A running request cannot grow: preempt the newest running request until it can, or until it was the
        newest itself (holding blocks, it cannot wait: if each waited for another's, none would move)."""
        while self._extra_blocks(request, tokens) > self.allocator.num_free:
            victim = self.running.pop()
            self._release(victim, RequestStatus.WAITING)
            victim.num_preemptions += 1
            self.waiting.appendleft(victim)
            self._step.preempted.append(victim)
            if victim is request:
                break
        return self.allocator.num_free

    def _reserve(self, request: Request, tokens: int) -> None:
        """Take the blocks the pass counted and record the chunk. A waiting request is admitted first: it
        takes its prefix hit (``start`` tokens), then fresh blocks for the slots it holds from now on."""
        start, num_cached = request.num_computed_tokens, 0
        if request.status is RequestStatus.WAITING:
            hit, num_cached = self._hits.pop(request.request_id, _NO_HIT), start
            table = request.block_table = self.prefix_cache.share(hit, request.all_token_ids[:start], self.cache_key)
            table.block_ids += self.allocator.allocate_many(
                blocks_needed(self._admission_slots(request, tokens), self.block_size) - len(table.block_ids))
            preempted = request.admit(start)  # the request keeps its first admission's hit, as vLLM counts it
            self._step.stats.add_hit(hit.num_cached_tokens, preempted)  # the pool's hits; a tier counts its own
            if self.enable_prefix_caching:  # once per admission, as vLLM's record_prefix_cache_stats
                self.prefix_cache.stats.record(request.num_tokens, hit.num_cached_tokens, preempted)
            self.waiting.remove(request)
            self.running.append(request)
        chunk_ids, table, stop = request.token_ids(start, start + tokens), request.block_table, start + tokens
        self._step.copies.extend(self._append(request, chunk_ids))
        self._step.chunks.append(ScheduledChunk(request, chunk_ids, start, table.slots(start, stop),
                                                list(table.block_ids), stop == request.num_tokens, num_cached))

    def _admission_slots(self, request: Request, tokens: int) -> int:
        """Hook: the slots a waiting request holds once admitted for ``tokens`` tokens (paged: to the chunk's end)."""
        return request.num_computed_tokens + tokens

    def _append(self, request: Request, token_ids: list[int]) -> list[tuple[int, int]]:
        """Slots for a running request's next tokens, and names for the blocks they fill (vLLM's
        ``allocate_slots`` calls ``cache_blocks``: a request admitted later in the step shares them).
        Returns the copy-on-write pairs."""
        table = request.block_table
        copies = self.prefix_cache._append(table, token_ids)
        request.num_computed_tokens += len(token_ids)
        if self.enable_prefix_caching and request.num_computed_tokens // self.block_size > table.num_named_blocks:
            self.prefix_cache.cache_full_blocks(table, request.num_computed_tokens)
        return copies

    def _release(self, request: Request, status: RequestStatus) -> None:
        """Drop the request's references (blocks others hold, and named full blocks, stay); set its ``status``."""
        if request.block_table is not None:
            self.prefix_cache.release(request.block_table)
        request.block_table, request.num_computed_tokens, request.status = None, 0, status


def _checked_settings(num_blocks: object, block_size: object, max_num_batched_tokens: object, max_num_seqs: object,
                      enable_prefix_caching: object, prefix_cache: object, cache_key: object, head_of_line: object,
                      full_sequence_must_fit: object, max_model_len: object) -> PrefixCache:
    """The ``Scheduler``'s settings checked (ValueError naming the first bad one); returns its prefix cache."""
    for name, value in (("block_size", block_size), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_num_seqs", max_num_seqs)):
        check_int(name, value, 1)
    for name, value in (("enable_prefix_caching", enable_prefix_caching), ("head_of_line", head_of_line),
                        ("full_sequence_must_fit", full_sequence_must_fit)):
        check_flag(name, value)
    if not isinstance(cache_key, CacheKey):
        raise ValueError(f"cache_key must be a labkit.memory.prefix.CacheKey, got {type(cache_key).__name__}")
    if prefix_cache is None:
        prefix_cache = PrefixCache(BlockAllocator(check_int("num_blocks", num_blocks, 1)), block_size)
    elif not isinstance(prefix_cache, PrefixCache) or prefix_cache.block_size != block_size:
        raise ValueError(f"prefix_cache must be a PrefixCache with block_size {block_size}")
    elif num_blocks is not None:
        raise ValueError("num_blocks must be None when prefix_cache is given (its allocator sets the pool)")
    pool = prefix_cache.allocator.num_blocks
    if max_model_len is not None and blocks_needed(check_int("max_model_len", max_model_len, 1), block_size) > pool:
        raise ValueError(f"max_model_len must fit the pool ({pool} blocks of {block_size} tokens), "
                         f"got {max_model_len}")
    return prefix_cache


def _check_fits(request: object, sched: Scheduler) -> None:
    if not isinstance(request, Request):
        raise ValueError(f"request must be a Request, got {type(request).__name__}")
    if (request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids
            or request.block_table is not None):
        raise ValueError("request must be new: waiting, not queued yet, nothing computed, no blocks")
    if request.request_id in sched.requests:
        raise ValueError(f"request_id must be unique among unfinished requests, got {request.request_id!r} twice")
    slots, limit = request.max_len, sched.max_model_len
    if limit is not None:
        if request.max_model_len not in (None, limit):
            raise ValueError(f"request.max_model_len must be None or the scheduler's ({limit}), "
                             f"got {request.max_model_len}")
        check_prompt_fits(len(request.prompt_token_ids), limit)
        slots = min(slots, limit - 1)  # it stops at max_model_len tokens: the last is never fed back
    if (need := blocks_needed(slots, sched.block_size)) > sched.num_blocks:
        raise ValueError(f"max_new_tokens: prompt ({len(request.prompt_token_ids)}) + outputs - 1 = {slots} slots "
                         f"need {need} blocks of {sched.block_size}, more than the pool's {sched.num_blocks}")
