"""Skip ahead: many pure-decode steps of the scheduler at once, for the simulator (chapter 06).

Most steps of a busy server are alike: the same requests each decode one token, nobody
arrives, finishes or is preempted. Stepping through them one by one costs the simulator most
of its time, so it plans such a stretch and runs it at once. ``advance_decodes`` leaves the
scheduler exactly as many ``schedule()`` + ``postprocess()`` calls would: the allocator sees
the same events in the same order, so the blocks, names and evictions are the same (the tests
compare both ways). ``plan_stretch`` decides when a stretch is safe and times its steps.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ...checks import check_int
from ...memory.blocks import blocks_needed
from ...memory.paging import tail_is_shared
from ..request import Request
from ..scheduler import Scheduler
from ..step import Step

__all__ = ["DecodeStretch", "advance_decodes", "Stretch", "plan_stretch"]


@dataclass
class DecodeStretch:
    """What ``advance_decodes`` did: per step, the blocks in use after its reservations; the requests
    finished, by step; each running request's block table (its own list: read it before the next step)."""

    used_blocks: list[int]
    finished: dict[int, list[Request]]
    block_tables: list[list[int]]


def advance_decodes(sched: Scheduler, max_steps: int, next_tokens: Callable[[Request, int], Sequence[int]],
                    may_run: Callable[[int, int, int, int], bool]) -> DecodeStretch:
    """Up to ``max_steps`` pure-decode steps of ``sched`` at once, as many ``schedule()`` + ``postprocess()`` would.

    The caller checks that the steps are pure decode (every running request computes one token
    per step, nobody waiting can be admitted). ``next_tokens(request, n)``: the next ``n`` tokens it
    samples (asked ahead for a request with stop ids, to find its last step). Before step ``s``,
    ``may_run(s, new_blocks, active, context)`` is asked (the blocks the step takes, the requests
    still running, their tokens computed so far); the stretch ends at the first no. Each step, the
    requests that start a new block take it, in running order, then the finishing ones release
    theirs. A request's tokens are appended by the scheduler's own ``_append`` at its next new block,
    its finish or the end: in between they touch nothing shared.
    """
    if not isinstance(sched, Scheduler):
        raise ValueError(f"sched must be a labkit.serving.scheduler.Scheduler, got {type(sched).__name__}")
    check_int("max_steps", max_steps, 1)
    for name, fn in (("next_tokens", next_tokens), ("may_run", may_run)):
        if not callable(fn):
            raise ValueError(f"{name} must be callable, got {type(fn).__name__}")
    if sched._step is not None:
        raise ValueError(f"step {sched._step.index} is in flight: postprocess it before advance_decodes")
    bs, running = sched.block_size, list(sched.running)
    computed = [r.num_computed_tokens for r in running]
    sampled = [len(r.output_token_ids) for r in running]
    last = [r.max_output_tokens - n - 1 for r, n in zip(running, sampled)]  # the step of its last token
    ahead: dict[int, Sequence[int]] = {}  # tokens asked ahead, for requests that stop on a token
    for j, r in enumerate(running):
        if r.stop_token_ids:
            ahead[j] = next_tokens(r, last[j] + 1)
            last[j] = next((s for s, t in enumerate(ahead[j]) if t in r.stop_token_ids), last[j])
    # Request j starts a block in step s when (computed[j] + s) % bs == 0. It takes a fresh one there when
    # its table holds just the blocks its tokens fill (paged); a whole reservation never grows.
    new_block: list[list[int]] = [[] for _ in range(bs)]
    takes = [len(r.block_table.block_ids) == blocks_needed(c, bs) for r, c in zip(running, computed)]
    num_new_block = [0] * bs  # of them, those still running that take a fresh block
    for j, c in enumerate(computed):
        new_block[c % bs].append(j)
        num_new_block[c % bs] += takes[j]
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
            num_new_block[computed[j] % bs] -= takes[j]
        s += 1
    for j, end in enumerate(last):
        if end >= s:
            catch_up(j, s)
    sched.num_steps += s
    return stretch


@dataclass
class Stretch:
    """A run of pure-decode steps done at once: per step its start and end time, the requests decoding
    (``active``), their tokens already in the cache (``context``) and the blocks in use; ``finished``
    by step; and per request of ``running`` (in running order) its step of the last token."""

    running: list[Request]
    last: list[int]
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    active: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    used_blocks: list[int] = field(default_factory=list)
    finished: dict[int, list[Request]] = field(default_factory=dict)
    schedule: list[list[tuple]] = field(default_factory=list)  # with record_schedule: as SimResult.schedule

    @property
    def num_steps(self) -> int:
        return len(self.ends)


def plan_stretch(sched: Scheduler, step: Step, clock: float, next_arrival: float, first_tokens: int,
                 step_time: Callable[[int, int, float], float], next_tokens: Callable[[Request, int], Sequence[int]],
                 record_schedule: bool = False) -> Stretch | None:
    """Run the pure-decode steps that follow ``step`` (just postprocessed, ending at ``clock``) at once;
    ``None`` when the next step is not one. ``step_time(new, context, pairs)``: a step's time.

    A *pure-decode* step gives every running request one token and does nothing else. The coming
    steps are pure decode while no request arrives (``next_arrival``), every running request is
    decoding (its prompt done), the token budget covers them all, the free blocks cover their new
    blocks (else the scheduler would preempt), and no waiting request can be admitted. That last
    point is easy when nobody waits. When requests wait, ``step`` must itself have been pure decode
    (no admission, first token (``first_tokens``), preemption, copy or finish: the scheduler just
    judged them inadmissible), and the stretch ends before anything could change that judgement: a
    request finishing (it frees blocks) or the allocator handing out a cached block (that could
    shrink a prefix hit). With nobody waiting, requests may finish inside the stretch.
    """
    alloc, running = sched.allocator, list(sched.running)
    if not running or len(running) > sched.max_num_batched_tokens:
        return None
    waiting = bool(sched.waiting)
    if waiting and (step.preempted or step.copies or first_tokens or len(step.chunks) != len(running)
                    or any(c.num_tokens != 1 or not c.samples for c in step.chunks)):
        return None  # the step just done was not pure decode
    for r in running:
        if r.num_computed_tokens != r.num_tokens - 1 or not r.output_token_ids:
            return None  # still prefilling (its last prompt token would give its first token)
        if tail_is_shared(r.block_table, alloc):  # it would be copied on write: step normally
            return None
    computed = [r.num_computed_tokens for r in running]
    held = [len(r.block_table.block_ids) for r in running]  # a whole reservation, or the blocks filled
    last = [r.max_output_tokens - len(r.output_token_ids) - 1 for r in running]
    k_max = min(last) if waiting else max(last) + 1
    if k_max < 1:
        return None
    out = Stretch(running, last)

    def may_run(s: int, new_blocks: int, active: int, context: int) -> bool:
        now = out.ends[-1] if out.ends else clock
        if now >= next_arrival:
            return False  # the request arriving by now is a candidate of this step: step normally
        front = list(itertools.islice(alloc.free_block_ids(), new_blocks))
        if len(front) < new_blocks:
            return False  # the scheduler would preempt
        if waiting and any(b in alloc.names for b in front):
            return False  # the allocator would evict a cached block while requests wait
        out.starts.append(now)
        out.ends.append(now + step_time(active, context, context + active))
        out.active.append(active)
        out.context.append(context)
        return True

    done = advance_decodes(sched, k_max, next_tokens, may_run)
    if not out.ends:
        return None
    out.used_blocks, out.finished = done.used_blocks, done.finished
    if record_schedule:  # each table at step s: the blocks filled so far, or the whole reservation
        bs = sched.block_size
        for s in range(out.num_steps):
            out.schedule.append([(r.request_id, computed[j] + s, 1,
                                  tuple(done.block_tables[j][:max(held[j], blocks_needed(computed[j] + s + 1, bs))]))
                                 for j, r in enumerate(running) if s <= last[j]])
    return out
