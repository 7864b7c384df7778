"""The engine's seams for the book's build-it pieces: the reader's code serves the real model (the capstone).

Chapters 01 to 05 each have the reader write one piece behind a small interface. Four of them are the
decisions an engine makes at every step, and ``Engine(model, ..., pieces=Pieces(...))`` makes them
with whatever it is given:

| seam | chapter | the interface | labkit's own |
|---|---|---|---|
| attention | 01 | ``decode_step(k_cache, v_cache, q, k, v, inv_freq)`` | ``labkit.caches.stepwise.decode_step`` |
| blocks and slots | 03 | ``Pager(num_blocks, block_size)``: ``append``, ``free``, ``num_free`` | ``Pager`` here |
| prefix hit | 04 | ``cached_tokens(token_ids, block_size, key, cached)`` | ``cached_tokens`` here |
| who runs | 05 | ``plan_step(running, waiting, free_blocks, token_budget, block_size)`` | ``plan_step`` here |

labkit's answers are built on the classes the chapters teach (``BlockAllocator`` and ``BlockTable``, the hash
chain, ``plan_iteration``), which stay free of the exercises' shapes.

A field left ``None`` is labkit's piece, so ``Pieces()`` is labkit's engine of the article. The model,
the K/V pools, sampling and the loop are ``Engine``'s, unchanged: ``PiecesScheduler`` (here) plans each
step with ``plan_step`` on rows it builds from its requests, takes every block and slot from a ``Pager``
(through ``PagerPool``) and counts hits with ``cached_tokens``; ``StepwiseKV`` attends with the step.

The interfaces know nothing of sharing: a ``Pager`` sequence owns its blocks alone, and a preempted
``plan_step`` row gives back all it holds. Prefix sharing fits them exactly, this way:

* **Blocks.** Each full block of a prompt is a ``Pager`` sequence of its own (one block), with a count of
  the requests holding it and, once its tokens are scheduled, its name (chapter 04's hash chain); the
  rest of a request's slots are one more ``Pager`` sequence. A block goes back to the ``Pager`` when its
  count reaches zero, and its name goes with it: the cache names the blocks of live requests only.
* **Rows.** A request's blocks that others hold too are left out of its running row: ``computed`` less
  their tokens, ``held`` less their count. The row then needs exactly the new blocks its tokens take,
  and preempting it frees at least ``held``. A waiting row's length is what remains after its hit:
  whole blocks held by running requests, which cost nothing free.

What this scheduler does not do, unlike ``Scheduler`` (vLLM's rules): keep freed blocks named until
evicted, admit only requests whose whole prompt fits, block the queue behind a request that does not
fit, cap the running requests (``max_num_seqs``), name blocks of outputs, or let a request admitted
later in a step hit blocks named earlier in it (hits are counted when the step's rows are built).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

from ..caches.stepwise import decode_step
from ..checks import check_int, check_token_ids
from ..memory.blocks import extra_blocks
from ..memory.paging import BlockAllocator, BlockTable, OutOfBlocksError
from ..memory.prefix import CacheKey, block_hash, hash_chain
from .request import Request, RequestStatus
from .scheduler import Scheduler, plan_iteration
from .step import ScheduledChunk, Step, StepStats

__all__ = ["Pager", "cached_tokens", "plan_step", "plan_rows", "SEAMS", "Pieces", "PagerPool", "PiecesScheduler"]


# --------------------------------------------------------------------------- labkit's answers to the exercises


class Pager:
    """Chapter 03's exercise interface, answered with labkit's own classes: one ``BlockTable`` per sequence
    over one ``BlockAllocator``. The capstone's engine takes its blocks from any class with these four
    methods, this one or the reader's.

    ``append(seq_id, n)``: room for ``n`` more tokens of ``seq_id`` (new or not); their slots, or ``None``
    when too few blocks are free, nothing changed. ``free(seq_id)``: its blocks go back. ``num_free()``.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.allocator, self.block_size = BlockAllocator(num_blocks), check_int("block_size", block_size, 1)
        self.tables: dict[object, BlockTable] = {}

    def num_free(self) -> int:
        return self.allocator.num_free

    def append(self, seq_id: object, n: int) -> list[int] | None:
        table = self.tables.get(seq_id) or BlockTable(self.block_size)
        try:
            slots = table.append(check_int("n", n, 0), self.allocator)
        except OutOfBlocksError:
            return None  # all or nothing: the table is unchanged
        self.tables[seq_id] = table
        return slots

    def free(self, seq_id: object) -> None:
        if seq_id not in self.tables:
            raise ValueError(f"seq_id must be a sequence that holds blocks, got {seq_id!r}")
        self.tables.pop(seq_id).release(self.allocator)


def cached_tokens(token_ids: Sequence[int], block_size: int, key: CacheKey, cached: object) -> int:
    """Chapter 04's exercise interface: how many leading tokens of ``token_ids`` a cache holding the block
    names ``cached`` (anything with ``in``) serves. Full blocks are named along the hash chain and the walk
    stops at the first name missing, even when later ones are there (their parent was evicted: a later
    name is a hit only together with every name before it). At most ``(len - 1) // block_size`` blocks:
    the last token is always computed, its logits give the next token.

    ``PrefixCache.match`` walks the same chain over its index, and also checks each hit's tokens, key
    and parent; the capstone's engine counts its hits with this function or the reader's.
    """
    tokens = check_token_ids("token_ids", token_ids, 1)
    hit = 0
    for name in hash_chain(tokens[:(len(tokens) - 1) // block_size * block_size], block_size, key):
        if name not in cached:
            break
        hit += block_size
    return hit


def plan_step(running: Sequence[tuple], waiting: Sequence[tuple], free_blocks: int, token_budget: int,
              block_size: int) -> tuple[list[tuple[Any, int]], list[Any]]:
    """Chapter 05's exercise interface, answered by ``plan_iteration``: one step's plan on plain rows.

    ``running``: ``(name, computed, held, new_tokens)`` oldest first; ``waiting``: ``(name, prompt_len)`` in
    order. Nothing is shared: a row needs ``extra_blocks(computed, held, tokens)`` blocks, and a preempted
    row gives back all ``held``. A running row that does not fit preempts the newest running row until it
    fits or was itself the newest (``Scheduler._make_room``'s rule); nobody waiting is visited in a step
    with a preemption; a waiting row that does not fit is skipped, and a smaller one behind it may run (the
    article's rule: no head-of-line blocking). Returns ``([(name, tokens)], [names preempted])``, both in
    the order decided. The capstone's engine plans with this or the reader's.
    """
    return plan_rows(running, waiting, free_blocks, token_budget, block_size)


def plan_rows(running: Sequence[tuple], waiting: Sequence[tuple], free_blocks: int, token_budget: int,
              block_size: int, victim: int = -1) -> tuple[list[tuple[Any, int]], list[Any]]:
    """``plan_step``, with ``victim`` the index in the running rows that a preemption takes: -1, the newest
    (vLLM's rule); ``labkit.teaching.capstone.oldest_first`` passes 0, the mistake it shows."""
    live = [SimpleNamespace(name=n, computed=c, held=h, num_new_tokens=t, status=RequestStatus.RUNNING)
            for n, c, h, t in running]
    queue = [SimpleNamespace(name=n, computed=0, held=0, num_new_tokens=p, status=RequestStatus.WAITING)
             for n, p in waiting]
    state, preempted = {"free": free_blocks}, []

    def candidates() -> Iterator[SimpleNamespace]:
        i = 0
        while i < len(live):  # the list shrinks from the end when one is preempted
            yield live[i]
            i += 1
        if not preempted:
            yield from queue

    def needed(row: SimpleNamespace, tokens: int) -> int:
        return extra_blocks(row.computed, row.held, tokens, block_size)

    def reserve(row: SimpleNamespace, tokens: int) -> None:
        state["free"] -= needed(row, tokens)

    def make_room(row: SimpleNamespace, tokens: int) -> int:
        while needed(row, tokens) > state["free"]:
            gone = live.pop(victim)
            state["free"] += gone.held
            gone.status = RequestStatus.WAITING
            preempted.append(gone.name)
            if gone is row:
                break
        return state["free"]

    plan = plan_iteration(candidates(), free_blocks, token_budget, block_size, reserve, needed, None, make_room)
    return [(row.name, tokens) for row, tokens in plan], preempted


# --------------------------------------------------------------------------- the seams


#: the four seams, in the order of the chapters that build them
SEAMS = ("decode_step", "Pager", "cached_tokens", "plan_step")


@dataclass
class Pieces:
    """The four pieces an engine's step is made of; ``None`` takes labkit's (``labkit()`` lists them).

    ``where``: the engine keeps it current before it calls a piece (``step``, ``request``, and for the
    attention step ``layer`` and ``position``), so that a checker can say where a piece went wrong.
    """

    decode_step: Callable[..., Any] | None = None
    Pager: type | None = None
    cached_tokens: Callable[..., int] | None = None
    plan_step: Callable[..., Any] | None = None
    where: dict = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def labkit() -> "Pieces":
        """labkit's own answers to the four exercises."""
        return Pieces(decode_step, Pager, cached_tokens, plan_step)

    def resolved(self) -> "Pieces":
        """These pieces, labkit's in every seam left ``None``; ``where`` is shared, not copied."""
        own = Pieces.labkit()
        for seam in SEAMS:
            piece = getattr(self, seam)
            if piece is not None and not callable(piece):
                raise ValueError(f"{seam} must be None (labkit's) or callable, got {type(piece).__name__}")
        return Pieces(**{seam: getattr(self, seam) or getattr(own, seam) for seam in SEAMS}, where=self.where)


class PagerPool:
    """A prefix-cached pool whose every block comes from a ``Pager`` (the module's "Blocks").

    ``tables[request_id]``: the request's block ids, logical block by logical block. ``refs``: for each
    block that is a ``Pager`` sequence of its own (a full prompt block), how many requests hold it.
    ``names``: block hash -> block, for the named blocks of live requests (``cached_tokens`` looks here).
    """

    def __init__(self, pager_class: type, num_blocks: int, block_size: int, key: CacheKey):
        self.pager, self.num_blocks, self.block_size, self.key = pager_class(num_blocks, block_size), num_blocks, \
            block_size, key
        self.tables: dict[Any, list[int]] = {}
        self.refs: dict[int, int] = {}
        self.names: dict[str, int] = {}
        self._block_seq: dict[int, tuple] = {}    # block -> its Pager sequence id
        self._block_name: dict[int, str] = {}     # named block -> its hash
        self._chain: dict[Any, list[str]] = {}    # request -> hashes of its full prompt blocks so far
        self._ids = itertools.count()
        self.blocks_taken = 0                     # blocks the Pager handed out, over the run

    @property
    def num_free(self) -> int:
        return self.pager.num_free()

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self.names)

    def row(self, request: Request) -> tuple[Any, int, int, int]:
        """Its running row ``(name, computed, held, new_tokens)``, blocks others hold too left out."""
        table = self.tables[request.request_id]
        shared = sum(1 for b in table if self.refs.get(b, 0) > 1)
        return (request.request_id, request.num_computed_tokens - shared * self.block_size, len(table) - shared,
                request.num_new_tokens)

    def admit(self, request: Request, hit: int) -> None:
        """A waiting request takes the ``hit`` leading tokens' blocks, found by name; it holds them too."""
        hashes = hash_chain(request.all_token_ids[:hit], self.block_size, self.key)
        if any(h not in self.names for h in hashes):
            raise ValueError(f"cached_tokens said {hit} tokens of request {request.request_id!r} are cached, "
                             f"but block {next(i for i, h in enumerate(hashes) if h not in self.names)} has no name")
        self.tables[request.request_id] = [self.names[h] for h in hashes]
        self._chain[request.request_id] = hashes
        for b in self.tables[request.request_id]:
            self.refs[b] += 1

    def reserve(self, request: Request, start: int, stop: int) -> list[int]:
        """Slots for positions ``[start, stop)`` (the table holds ``start`` already): a full prompt block
        is one ``Pager`` sequence of ``block_size`` tokens, the later positions go on the request's own."""
        bs, rid = self.block_size, request.request_id
        table, full = self.tables.setdefault(rid, []), len(request.prompt_token_ids) // bs * bs
        slots = []
        for pos in range(start, min(stop, full)):
            if pos // bs == len(table):
                seq = ("block", next(self._ids))
                got = self._append(seq, bs)
                table.append(got[0] // bs)
                self.refs[table[-1]], self._block_seq[table[-1]] = 1, seq
            slots.append(table[pos // bs] * bs + pos % bs)
        if stop > max(start, full):
            first = max(start, full)
            got = self._append(("request", rid), stop - first)
            for pos, slot in zip(range(first, stop), got):
                if pos // bs == len(table):
                    table.append(slot // bs)
            slots += got
        self._name(request, min(stop, full))
        return slots

    def release(self, request: Request) -> None:
        """The request lets go: a block nobody holds goes back to the ``Pager``, with its name."""
        rid = request.request_id
        table, held_own = self.tables.pop(rid, []), False
        self._chain.pop(rid, None)
        for b in table:
            if b not in self.refs:
                held_own = True
                continue
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                self.pager.free(self._block_seq.pop(b))
                if (name := self._block_name.pop(b, None)) is not None:
                    del self.names[name]
        if held_own:
            self.pager.free(("request", rid))

    def _append(self, seq: tuple, n: int) -> list[int]:
        free = self.pager.num_free()
        got = self.pager.append(seq, n)
        if type(got) is not list or len(got) != n:
            raise RuntimeError(f"Pager.append({seq!r}, {n}) returned {got!r} with num_free() = {free}: the plan "
                               f"counted on those blocks")
        self.blocks_taken += free - self.pager.num_free()
        return got

    def _name(self, request: Request, upto: int) -> None:
        """Name the request's full prompt blocks before ``upto`` (their tokens are scheduled). A name held by
        another block already stays with that block, and this one stays unnamed: one block per name, so ``names``
        stays a dict. vLLM names such twins too (``vllm/v1/core/block_pool.py``, ``BlockHashToBlockMap``: it does
        not de-duplicate). Here, when the named twin's last holder leaves, its name goes and the unnamed twin's
        later blocks keep theirs: a gap in the chain, which the capstone's "notes-b again" meets."""
        rid, bs = request.request_id, self.block_size
        chain, table = self._chain.setdefault(rid, []), self.tables[rid]
        while len(chain) < upto // bs:
            j = len(chain)
            chain.append(block_hash(chain[-1] if chain else None, request.prompt_token_ids[j * bs:(j + 1) * bs],
                                    self.key))
            if chain[-1] not in self.names and table[j] not in self._block_name:
                self.names[chain[-1]], self._block_name[table[j]] = table[j], chain[-1]


class PiecesScheduler(Scheduler):
    """The article's scheduler, every decision made by a piece (``Pieces``, resolved: no ``None`` left).

    Each ``schedule()`` builds the rows (the module's "Rows"; a waiting request's hit from
    ``cached_tokens``), asks ``plan_step``, then carries the plan out: preempts (newest last), admits the
    waiting it planned, and reserves every planned chunk's slots in the ``PagerPool``. Queues, requests,
    ``postprocess`` and ``finish`` are the core ``Scheduler``'s; its own allocator and prefix cache stay
    unused. ``StepStats`` count what happened, as they do for the core.
    """

    def __init__(self, pieces: Pieces, num_blocks: int, block_size: int = 16, max_num_batched_tokens: int = 256,
                 *, enable_prefix_caching: bool = True, cache_key: CacheKey = CacheKey()):
        super().__init__(num_blocks, block_size, max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
                         cache_key=cache_key, head_of_line=False, full_sequence_must_fit=False)
        if not isinstance(pieces, Pieces) or any(getattr(pieces, seam) is None for seam in SEAMS):
            raise ValueError("pieces must be Pieces with every seam filled: pass Pieces(...).resolved()")
        self.pieces = pieces
        self.pool = PagerPool(pieces.Pager, num_blocks, block_size, cache_key)

    def schedule(self) -> Step:
        """Plan the next step with ``plan_step`` and carry it out. ValueError while a step is in flight."""
        if self._step is not None:
            raise ValueError(f"step {self._step.index} is in flight: postprocess it before the next schedule()")
        step = Step(self.num_steps + 1, [], [], [], StepStats(self.num_steps + 1))
        where, pool, bs = self.pieces.where, self.pool, self.block_size
        where.clear()
        where["step"] = step.index
        hits = {}  # the pieces only answer: nothing changes until the plan is checked
        for request in self.waiting:
            where["request"] = request.request_id
            hits[request.request_id] = (self.pieces.cached_tokens(request.all_token_ids, bs, self.cache_key,
                                                                  pool.names.keys())
                                        if self.enable_prefix_caching else 0)
            if type(hits[request.request_id]) is not int or not 0 <= hits[request.request_id] < request.num_tokens \
                    or hits[request.request_id] % bs:
                raise ValueError(f"cached_tokens, step {step.index}, request {request.request_id!r}: returned "
                                 f"{hits[request.request_id]!r}; whole blocks of {bs}, fewer than its "
                                 f"{request.num_tokens} tokens")
        where.pop("request", None)
        running = [pool.row(r) for r in self.running]
        waiting = [(r.request_id, r.num_tokens - hits[r.request_id]) for r in self.waiting]
        plan = self.pieces.plan_step(running, waiting, pool.num_free, self.max_num_batched_tokens, bs)
        planned, preempted = self._checked_plan(step.index, plan, hits)
        self.num_steps, self._step = step.index, step
        for victim in preempted:
            self.running.remove(victim)
            self._release(victim, RequestStatus.WAITING)
            victim.num_preemptions += 1
            self.waiting.appendleft(victim)
            step.preempted.append(victim)
        for request, tokens in planned:
            num_cached = 0
            if request.status is RequestStatus.WAITING:
                num_cached = request.num_computed_tokens = hits[request.request_id]
                pool.admit(request, num_cached)
                step.stats.add_hit(num_cached, request.admit(num_cached))
                self.waiting.remove(request)
                self.running.append(request)
            start = request.num_computed_tokens
            where["request"] = request.request_id
            slots = pool.reserve(request, start, start + tokens)
            request.num_computed_tokens += tokens
            step.chunks.append(ScheduledChunk(request, request.token_ids(start, start + tokens), start, slots,
                                              list(pool.tables[request.request_id]),
                                              start + tokens == request.num_tokens, num_cached))
        where["chunks"] = [c.request.request_id for c in step.chunks]
        step.stats.count(step, pool, pool, len(self.running), len(self.waiting))
        return step

    def _checked_plan(self, index: int, plan: Any, hits: dict) -> tuple[list[tuple[Request, int]], list[Request]]:
        """``plan_step``'s answer as requests, or ValueError saying what it broke (before anything changes)."""
        ok = type(plan) is tuple and len(plan) == 2 and all(type(x) is list for x in plan)
        planned, preempted = plan if ok else ([], [])
        by_id = {r.request_id: r for r in list(self.running) + list(self.waiting)}
        running_ids = [r.request_id for r in self.running]
        problem = "" if ok else f"it returned {type(plan).__name__}, not ([(name, tokens)], [names])"
        if not problem and (any(n not in running_ids for n in preempted) or len(set(preempted)) < len(preempted)):
            problem = f"preempted {preempted!r}: names of running requests, each once"
        names = [p[0] if type(p) is tuple and len(p) == 2 else None for p in planned]
        if not problem and (len(set(names)) < len(names) or any(n not in by_id or n in preempted for n in names)):
            problem = f"planned {planned!r}: (name, tokens) of requests not preempted, each once"
        if not problem:
            for name, tokens in planned:
                r = by_id[name]
                new = r.num_new_tokens if r.status is RequestStatus.RUNNING else r.num_tokens - hits[name]
                if type(tokens) is not int or not 1 <= tokens <= new:
                    problem = f"planned {tokens!r} tokens for {name!r}, which has {new} to compute"
                elif r.status is RequestStatus.WAITING and preempted:
                    problem = f"admitted {name!r} in a step with a preemption"
        if not problem and sum(t for _, t in planned) > self.max_num_batched_tokens:
            problem = f"planned {sum(t for _, t in planned)} tokens, over the budget of {self.max_num_batched_tokens}"
        if problem:
            raise ValueError(f"plan_step, step {index}: {problem}")
        return [(by_id[n], t) for n, t in planned], [by_id[n] for n in preempted]

    def _release(self, request: Request, status: RequestStatus) -> None:
        """Preempted or finished: its blocks go back through the ``PagerPool``; set its ``status``."""
        self.pool.release(request)
        request.num_computed_tokens, request.status = 0, status
