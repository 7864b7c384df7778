"""labkit.serving.scheduler: the article's budget pass, preemption, prefix hits and copy-on-write.

The scheduler holds no tensors, so these tests check it with a *symbolic* KV pool: the
"K/V" written at a slot is the token prefix it was computed from. After every step each
scheduled request's block table must lead to exactly its own prefixes, position by
position; that catches a wrong prefix hit, a missing copy-on-write, a block freed while
in use, or a stale slot after a preemption. A deterministic "model" picks each next
token from the whole sequence, so a request's output must not depend on the schedule.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.memory.blocks import blocks_needed, extra_blocks
from labkit.memory.paging import BlockAllocator
from labkit.memory.prefix import PrefixCache, block_hash, hash_chain
from labkit.serving.request import Request, RequestStatus
from labkit.serving.scheduler import Scheduler, plan_iteration
from labkit.serving.sim.skipahead import advance_decodes
from labkit.serving.variants.forking import ForkingScheduler
from labkit.serving.variants.priority import PriorityScheduler
from labkit.serving.variants.reservation import ALLOCATIONS, ReservingScheduler, check_allocation, scheduler_class

VOCAB = 50


def next_token(tokens: list[int]) -> int:
    """A deterministic stand-in for a model: the next token depends on the whole sequence."""
    h = 17
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def reference_output(prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_new_tokens:
        t = next_token(tokens)
        out.append(t)
        tokens.append(t)
        if t == eos:
            break
    return out


class SymbolicPool:
    """slot -> the token prefix whose last K/V the slot holds."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.slots: dict[int, tuple[int, ...]] = {}

    def execute(self, step) -> list[int]:
        bs = self.block_size
        for src, dst in step.copies:  # copy-on-write comes before any write
            for off in range(bs):
                if src * bs + off in self.slots:
                    self.slots[dst * bs + off] = self.slots[src * bs + off]
                else:
                    self.slots.pop(dst * bs + off, None)
        for chunk in step.chunks:
            tokens = chunk.request.all_token_ids
            assert chunk.token_ids == tokens[chunk.start:chunk.seq_len]
            for pos, slot in zip(chunk.positions, chunk.slot_mapping):
                assert slot == chunk.block_table[pos // bs] * bs + pos % bs
                self.slots[slot] = tuple(tokens[:pos + 1])
        for chunk in step.chunks:  # attention reads every earlier position through the block table
            tokens = chunk.request.all_token_ids
            for pos in range(chunk.seq_len):
                slot = chunk.block_table[pos // bs] * bs + pos % bs
                assert self.slots.get(slot) == tuple(tokens[:pos + 1]), f"wrong K/V at position {pos}"
        return [next_token(c.request.all_token_ids[:c.seq_len]) for c in step.sampling_chunks]


def slots_held(sched: Scheduler, r: Request) -> int:
    """The slots a running request's blocks must cover, counted here (not asked of the scheduler):
    paged, its computed tokens; reserving, its whole reservation from admission on."""
    reserve = getattr(sched, "reserve", None)
    if reserve == "max_len":
        return sched.max_model_len
    if reserve == "exact":  # its whole sequence, which stops at max_model_len tokens
        return min(len(r.prompt_token_ids) + r.max_new_tokens, sched.max_model_len or 1 << 30) - 1
    return r.num_computed_tokens


def check_ref_counts(sched: Scheduler) -> None:
    """Every block's reference count equals the number of running block tables holding it."""
    held = [0] * sched.num_blocks
    for r in sched.running:
        assert r.block_table is not None
        assert len(r.block_table.block_ids) == -(-slots_held(sched, r) // sched.block_size)
        for b in r.block_table.block_ids:
            held[b] += 1
    for r in sched.waiting:
        assert r.block_table is None and r.num_computed_tokens == 0
    assert held == sched.allocator.ref_counts


def run(sched: Scheduler, arrivals: dict[int, list[Request]], max_steps: int = 10_000,
        pool: SymbolicPool | None = None):
    """Drive the scheduler to completion; check every step. Returns the list of steps.

    Pass the same ``pool`` to later runs on the same scheduler: cached blocks keep their K/V.
    """
    pool = pool or SymbolicPool(sched.block_size)
    steps, t = [], 0
    while sched.has_unfinished() or any(k >= t for k in arrivals):
        for r in arrivals.get(t, []):
            sched.add_request(r)
        t += 1
        running_before = list(sched.running)
        step = sched.schedule()
        # budgets
        assert step.num_tokens <= sched.max_num_batched_tokens
        assert step.stats.scheduled_tokens == step.num_tokens
        assert 0 <= step.stats.free_blocks <= sched.num_blocks
        # preemption takes the newest running requests, newest first
        k = len(step.preempted)
        if k:
            assert step.preempted == running_before[::-1][:k]
            if not isinstance(sched, PriorityScheduler):  # back to the front of the queue (a key re-sorts it)
                assert all(sched.waiting[i] is r for i, r in enumerate(reversed(step.preempted)))
        # every candidate's turn, as recorded, follows the article's rules
        for d in step.decisions:
            assert d.tokens == min(d.num_new_tokens, d.token_budget)
            if d.outcome == "preempted":  # a running request that had to give its own blocks back
                assert not d.waiting and d.request in step.preempted
            else:
                assert d.outcome == ("stop" if d.tokens == 0 else "skipped" if d.needed > d.free_blocks else "planned")
        assert [d.request for d in step.decisions if d.outcome == "planned"] == [c.request for c in step.chunks]
        assert all(d.outcome != "stop" for d in step.decisions[:-1])  # the pass ends at a stop
        waiting_turns = [d.outcome for d in step.decisions if d.waiting]
        if sched.head_of_line and "skipped" in waiting_turns:  # nobody after a skipped waiting request
            assert waiting_turns.index("skipped") == len(waiting_turns) - 1
        # a request appears at most once and always continues where it stopped
        ids = [id(c.request) for c in step.chunks]
        assert len(ids) == len(set(ids))
        sampled = pool.execute(step)
        sched.postprocess(step, sampled)
        check_ref_counts(sched)
        steps.append(step)
        assert len(steps) <= max_steps, "a request starved"
    return steps


# ------------------------------------------------------------------ extra_blocks


def brute_extra_blocks(num_computed: int, table_len: int, tokens: int, bs: int, shared_tail: bool,
                       revived: int) -> int:
    """Count the blocks to take one position at a time."""
    if tokens == 0:
        return 0
    have = set(range(table_len))
    new = {p // bs for p in range(num_computed, num_computed + tokens)} - have
    copy = int(shared_tail and num_computed % bs != 0)
    return len(new) + copy + revived


def make_request(num_computed: int, bs: int, extra_tokens: int = 5) -> Request:
    """A request with ``num_computed`` tokens computed and ``extra_tokens`` to go (no blocks: plans only)."""
    r = Request(list(range(1, num_computed + extra_tokens + 1)), 4)
    r.num_computed_tokens = num_computed
    return r


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_extra_blocks_at_block_boundaries(bs):
    for computed in [0, bs - 1, bs, bs + 1, 2 * bs]:
        table_len = blocks_needed(computed, bs)
        for tokens in [0, 1, bs - 1, bs, bs + 1, 3 * bs]:
            for shared in (False, True):
                got = extra_blocks(computed, table_len, tokens, bs, shared_tail=shared)
                assert got == brute_extra_blocks(computed, table_len, tokens, bs, shared, 0), (computed, tokens)


def test_extra_blocks_examples():
    bs = 16
    # the article's 37-token request: prefill needs 3 blocks
    assert extra_blocks(0, 0, 37, bs) == 3
    # decoding the 38th token: the tail block has 11 empty slots, nothing new
    assert extra_blocks(37, 3, 1, bs) == 0
    # decoding token 49 after exactly three full blocks: one new block
    assert extra_blocks(48, 3, 1, bs) == 1
    # the same 38th token when another request shares the partly filled tail: copy it first
    assert extra_blocks(37, 3, 1, bs, shared_tail=True) == 1
    # a shared tail that is full is never written again: no copy
    assert extra_blocks(48, 3, 1, bs, shared_tail=True) == 1
    # a prefix hit on 2 cached blocks that wait in the free queue
    assert extra_blocks(32, 2, 5, bs, revived_blocks=2) == 3


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(0, 40), st.integers(0, 30), st.booleans(), st.integers(0, 3))
def test_extra_blocks_matches_brute_force(bs, computed, tokens, shared, revived):
    table_len = blocks_needed(computed, bs)
    assert extra_blocks(computed, table_len, tokens, bs, shared_tail=shared, revived_blocks=revived) \
        == brute_extra_blocks(computed, table_len, tokens, bs, shared, revived)


# ------------------------------------------------------------------ plan_iteration


@st.composite
def candidates(draw):
    bs = draw(st.integers(1, 8))
    reqs = []
    for _ in range(draw(st.integers(0, 8))):
        computed = draw(st.integers(0, 30))
        chunk = draw(st.integers(1, 30))
        reqs.append((make_request(computed, bs, extra_tokens=chunk), draw(st.booleans())))
    return bs, reqs


@settings(max_examples=300, deadline=None)
@given(candidates(), st.integers(0, 20), st.integers(1, 64))  # a step computes >= 1 token
def test_plan_never_exceeds_budgets(cands, free_blocks, token_budget):
    bs, with_tails = cands
    reqs = [r for r, _ in with_tails]
    shared = {id(r): tail for r, tail in with_tails}

    def needed(r, n):
        return extra_blocks(r.num_computed_tokens, blocks_needed(r.num_computed_tokens, bs), n, bs,
                            shared_tail=shared[id(r)])
    before = [(r.num_computed_tokens, r.block_table) for r in reqs]
    reserved = []
    plan = plan_iteration(reqs, free_blocks, token_budget, bs, reserve=lambda r, n: reserved.append((r, n)),
                          needed=needed)
    assert reserved == plan  # reserve is called exactly for the planned requests, in order
    assert sum(n for _, n in plan) <= token_budget
    assert sum(needed(r, n) for r, n in plan) <= free_blocks
    # replay the pass: each planned request got min(num_new_tokens, budget left); each skipped one did not fit
    free, budget, planned = free_blocks, token_budget, dict((id(r), n) for r, n in plan)
    order = [id(r) for r, _ in plan]
    assert order == [id(r) for r in reqs if id(r) in planned]  # candidate order is kept
    for r in reqs:
        tokens = min(r.num_new_tokens, budget)
        if tokens == 0:
            assert all(id(x) not in planned for x in reqs[reqs.index(r):])
            break
        need = needed(r, tokens)
        if id(r) in planned:
            assert planned[id(r)] == tokens and need <= free
            free, budget = free - need, budget - tokens
        else:
            assert need > free
    # planning alone changes no request
    assert before == [(r.num_computed_tokens, r.block_table) for r in reqs]


def test_order_decides_who_gets_space_first():
    bs = 4
    big = make_request(0, bs, extra_tokens=12)      # 12 prompt tokens: 3 blocks
    small = make_request(0, bs, extra_tokens=4)     # 4 tokens: 1 block
    plan_a = plan_iteration([big, small], free_blocks=3, token_budget=16, block_size=bs)
    plan_b = plan_iteration([small, big], free_blocks=3, token_budget=16, block_size=bs)
    assert [r for r, _ in plan_a] == [big]    # first come takes all 3 blocks
    assert [r for r, _ in plan_b] == [small]  # the other order: big no longer fits and is skipped


def test_bad_input_names_the_parameter():
    r = make_request(0, 4)
    with pytest.raises(ValueError, match="token_budget"):
        plan_iteration([r], 4, -1, 4)
    with pytest.raises(ValueError, match="free_blocks"):
        plan_iteration([r], -1, 4, 4)
    with pytest.raises(ValueError, match="block_size"):
        plan_iteration([r], 4, 4, 0)
    with pytest.raises(ValueError, match="block_size"):
        extra_blocks(0, 0, 1, 0)
    with pytest.raises(ValueError, match="tokens"):
        extra_blocks(0, 0, -1, 4)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request([], 4)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request([1, -2], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request([1, 2], 0)
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(8, 0, 16)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(8, 4, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(0, 4, 16)
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(block_size=8, prefix_cache=PrefixCache(BlockAllocator(4), 4))
    with pytest.raises(ValueError, match="prefix_cache"):
        Scheduler(block_size=4, prefix_cache="not a prefix cache")
    with pytest.raises(ValueError, match="priority"):
        PriorityScheduler(4, 4, 16, priority=3)
    shared = PrefixCache(BlockAllocator(6), 4)
    assert Scheduler(block_size=4, prefix_cache=shared).num_blocks == 6
    sched = Scheduler(4, 4, 16)
    with pytest.raises(ValueError, match="max_new_tokens"):  # 14 + 4 - 1 slots need 5 blocks of 4 > 4
        sched.add_request(list(range(14)), 4)
    assert not sched.has_unfinished()  # nothing was queued
    sched.add_request([1, 2, 3], 2)
    step = sched.schedule()
    free = sched.allocator.num_free
    with pytest.raises(ValueError, match="sampled_token_ids"):
        sched.postprocess(step, [])
    with pytest.raises(ValueError, match="sampled_token_ids"):
        sched.postprocess(step, [-1])
    assert sched.allocator.num_free == free and step.chunks[0].request.output_token_ids == []


# ------------------------------------------------------------------ the scheduler end to end


def test_chunked_prefill_splits_a_long_prompt():
    sched = Scheduler(16, 4, max_num_batched_tokens=8, enable_prefix_caching=False)
    r = sched.add_request(list(range(1, 21)), 3)   # 20 prompt tokens, budget 8
    steps = run(sched, {})
    assert [s.chunks[0].num_tokens for s in steps] == [8, 8, 4, 1, 1]
    assert [s.chunks[0].samples for s in steps] == [False, False, True, True, True]
    assert r.output_token_ids == reference_output(r.prompt_token_ids, 3)
    assert sched.allocator.num_free == 16


def test_running_requests_come_before_waiting_ones():
    sched = Scheduler(32, 4, max_num_batched_tokens=6, enable_prefix_caching=False)
    a = sched.add_request([1] * 5, 4)
    pool = SymbolicPool(4)
    step = sched.schedule()
    sched.postprocess(step, pool.execute(step))
    b = sched.add_request([2] * 9, 4)
    step = sched.schedule()
    assert [(c.request, c.num_tokens) for c in step.chunks] == [(a, 1), (b, 5)]  # decode first, then a chunk


def test_prefix_hit_skips_cached_tokens_and_survives_finish():
    bs = 4
    shared = [7] * 8 + [3] * 4                      # 12 tokens = 3 full blocks
    sched = Scheduler(16, bs, max_num_batched_tokens=64)
    first = Request(shared + [1, 2], 2)
    pool = SymbolicPool(bs)
    steps = run(sched, {0: [first]}, pool=pool)
    assert steps[0].stats.prefix_hit_tokens == 0
    assert sched.allocator.num_free == 16 and sched.prefix_cache.num_cached_blocks == 3  # freed, still cached
    second = Request(shared + [9], 2)
    steps = run(sched, {0: [second]}, pool=pool)
    assert steps[0].stats.prefix_hit_tokens == 12 and steps[0].chunks[0].num_tokens == 1
    assert second.output_token_ids == reference_output(second.prompt_token_ids, 2)
    off = Scheduler(16, bs, max_num_batched_tokens=64, enable_prefix_caching=False)
    pool = SymbolicPool(bs)
    run(off, {0: [Request(shared + [1], 2)]}, pool=pool)
    steps = run(off, {0: [Request(shared + [9], 2)]}, pool=pool)
    assert steps[0].stats.prefix_hit_tokens == 0 and steps[0].num_tokens == 13


def test_preemption_by_recompute():
    # 3 requests of 6 prompt tokens + 6 new ones; 4-token blocks; a pool of 6 blocks cannot hold
    # all three at full length (3 blocks each), so the newest running request is preempted.
    bs = 4
    sched = Scheduler(6, bs, max_num_batched_tokens=32, enable_prefix_caching=False)
    reqs = [Request([i + 1] * 6, 6) for i in range(3)]
    steps = run(sched, {0: reqs})
    preempted = [r for s in steps for r in s.preempted]
    assert preempted and preempted[0] is reqs[2]
    assert all(r.output_token_ids == reference_output(r.prompt_token_ids, 6) for r in reqs)
    assert sched.allocator.num_free == 6
    # the preempted request was recomputed: it computed more tokens than it has
    computed = sum(c.num_tokens for s in steps for c in s.chunks if c.request is reqs[2])
    assert computed > 6 + 6 - 1


def test_fork_copies_the_shared_tail_on_write():
    bs = 4
    sched = ForkingScheduler(16, bs, max_num_batched_tokens=32)
    parent = sched.add_request([5, 6, 7, 8, 9, 10], 4)   # 6 tokens: the tail block is half full
    pool = SymbolicPool(bs)
    step = sched.schedule()
    sched.postprocess(step, pool.execute(step))
    child = sched.fork(parent)
    assert sched.allocator.ref_counts[parent.block_table.block_ids[-1]] == 2
    free = sched.allocator.num_free
    step = sched.schedule()
    assert len(step.copies) == 1 and step.stats.copies == 1
    src, dst = step.copies[0]
    assert src == child.block_table.block_ids[-1] and dst == parent.block_table.block_ids[-1]
    assert sched.allocator.num_free == free - 1     # the private copy; the child writes in place
    sched.postprocess(step, pool.execute(step))
    while sched.has_unfinished():
        step = sched.schedule()
        sched.postprocess(step, pool.execute(step))
        check_ref_counts(sched)
    assert parent.output_token_ids == child.output_token_ids == reference_output(parent.prompt_token_ids, 4)
    assert sched.allocator.num_free == 16
    with pytest.raises(ValueError, match="running"):
        sched.fork(parent)


def test_priority_reorders_the_waiting_queue():
    sched = PriorityScheduler(5, 4, max_num_batched_tokens=64, enable_prefix_caching=False,
                              priority=lambda r: len(r.prompt_token_ids))
    long = sched.add_request([1] * 12, 2)
    short = sched.add_request([2] * 3, 2)
    step = sched.schedule()
    assert [c.request for c in step.chunks] == [short, long]
    fcfs = Scheduler(4, 4, max_num_batched_tokens=64, enable_prefix_caching=False)
    long, short = fcfs.add_request([1] * 12, 2), fcfs.add_request([2] * 3, 2)
    step = fcfs.schedule()
    assert [c.request for c in step.chunks] == [long, short]  # 3 + 1 blocks: both fit, oldest first
    assert [d.request for d in step.decisions] == [long, short]


def test_a_waiting_request_that_does_not_fit_blocks_the_queue_behind_it():
    """Head of line (vLLM): a skipped waiting request ends admission for the step;
    the article's rule (head_of_line=False) lets the smaller one behind it pass."""
    for hol, expected in ((True, []), (False, ["short"])):
        sched = Scheduler(6, 4, max_num_batched_tokens=64, enable_prefix_caching=False, head_of_line=hol)
        pool = SymbolicPool(4)
        first = sched.add_request([3] * 8, 4)           # 2 blocks, then 3 while decoding
        step = sched.schedule()
        sched.postprocess(step, pool.execute(step))
        long = sched.add_request([1] * 20, 2)           # 5 blocks: only 4 are free
        short = sched.add_request([2] * 3, 2)           # 1 block
        step = sched.schedule()
        names = {id(long): "long", id(short): "short"}
        assert [names[id(c.request)] for c in step.chunks if c.request is not first] == expected
        assert [d.outcome for d in step.decisions if d.waiting] == ["skipped"] + (["planned"] if not hol else [])
        sched.postprocess(step, pool.execute(step))
        assert long.status is RequestStatus.WAITING


def serve_small_stream_behind_a_big_request(head_of_line: bool, steps: int = 200) -> tuple[int | None, int]:
    """Small requests (3 prompt + 7 new tokens) arrive every other step; at step 6 a big one
    (20 + 4 tokens, 6 of the pool's 8 blocks) joins the queue. Returns the step that admits
    the big request (None: never) and the longest queue seen."""
    sched = Scheduler(8, 4, max_num_batched_tokens=64, enable_prefix_caching=False, head_of_line=head_of_line)
    pool = SymbolicPool(4)
    big, admitted, longest = None, None, 0
    for t in range(steps):
        if t % 2 == 0:
            sched.add_request([1 + t % 30] * 3, 7)
        if t == 6:
            big = sched.add_request(list(range(1, 21)), 4)
        step = sched.schedule()
        if admitted is None and any(c.request is big for c in step.chunks):
            admitted = t
        sched.postprocess(step, pool.execute(step))
        check_ref_counts(sched)
        longest = max(longest, len(sched.waiting))
    return admitted, longest


def test_no_starvation_with_continuing_arrivals_of_small_requests():
    admitted, longest = serve_small_stream_behind_a_big_request(head_of_line=True)
    # Once the big request heads the queue nobody passes it; the running small ones finish
    # within 1 + 7 steps and give back their blocks, so it waits at most that long.
    assert admitted is not None and admitted - 6 <= 1 + 7
    assert longest <= 8  # the queue drains again afterwards
    # The article's rule alone: the small requests take every block that frees up.
    starved, _ = serve_small_stream_behind_a_big_request(head_of_line=False)
    assert starved is None


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    budget = draw(st.integers(1, 40))
    max_len = draw(st.integers(4, 30))
    num_blocks = draw(st.integers(blocks_needed(max_len, bs), blocks_needed(max_len, bs) * 4))
    seed = draw(st.integers(0, 10**6))
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, max_len - 2))] for _ in range(2)]
    arrivals: dict[int, list[Request]] = {}
    for _ in range(draw(st.integers(1, 8))):
        prefix = rng.choice(prefixes + [[]])
        new = rng.randrange(1, max(2, max_len // 3))
        room = max(1, max_len - new - len(prefix))
        prompt = (prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, room + 1))])[:max_len - new]
        eos = rng.randrange(VOCAB) if rng.random() < 0.3 else None
        arrivals.setdefault(rng.randrange(0, 6), []).append(Request(prompt, new, eos))
    caching = draw(st.booleans())
    priority = draw(st.sampled_from([None, lambda r: len(r.prompt_token_ids), lambda r: -r.max_new_tokens]))
    hol = draw(st.booleans())
    gate = draw(st.booleans())
    cls, extra = (Scheduler, {}) if priority is None else (PriorityScheduler, {"priority": priority})
    return cls(num_blocks, bs, budget, enable_prefix_caching=caching, head_of_line=hol,
               full_sequence_must_fit=gate, **extra), arrivals


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_random_workloads_finish_correctly_and_return_every_block(workload):
    sched, arrivals = workload
    reqs = [r for rs in arrivals.values() for r in rs]
    total = sum(len(r.prompt_token_ids) + r.max_new_tokens for r in reqs)
    run(sched, arrivals, max_steps=10 * total + 10)
    for r in reqs:
        assert r.status is RequestStatus.FINISHED
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.max_new_tokens, r.eos_token_id)
    assert sched.allocator.num_free == sched.num_blocks   # every block is back in the pool
    assert sched.allocator.ref_counts == [0] * sched.num_blocks


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10**6))
def test_fcfs_the_oldest_running_request_always_advances(seed):
    """No starvation: under FCFS the oldest running request gets tokens every step (it is never
    preempted and is first in line), so requests finish in a bounded number of steps."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    sched = Scheduler(rng.randrange(4, 10), bs, rng.randrange(4, 24), enable_prefix_caching=rng.random() < 0.5)
    cap = sched.num_blocks * bs
    reqs = []
    for _ in range(rng.randrange(2, 10)):
        new = rng.randrange(1, 6)
        reqs.append(Request([rng.randrange(VOCAB) for _ in range(rng.randrange(1, max(2, cap - new)))], new))
    for r in reqs:
        sched.add_request(r)
    pool = SymbolicPool(bs)
    while sched.has_unfinished():
        oldest = sched.running[0] if sched.running else None
        step = sched.schedule()
        if oldest is not None:
            assert oldest not in step.preempted and step.chunks and step.chunks[0].request is oldest
        assert step.chunks, "a step with unfinished requests planned nothing"
        sched.postprocess(step, pool.execute(step))
    assert all(r.is_finished for r in reqs)


# -- issue 11: bugs at the edges ------------------------------------------------------------------

def test_finishing_a_waiting_request_cancels_it_cleanly():
    sched = Scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=8)
    a = sched.add_request([1, 2, 3, 4, 5], 3)
    b = sched.add_request([6, 7, 8], 2)
    sched.finish(b)  # cancelled before it ever ran
    assert b.status is RequestStatus.FINISHED and b not in sched.waiting and b.request_id not in sched.requests
    step = sched.schedule()
    assert [c.request for c in step.chunks] == [a]
    assert sched.allocator.num_used == blocks_needed(5, 4)


def test_prefix_caching_off_ignores_a_shared_cache_that_has_names():
    """A prefix cache that already names blocks, handed to a scheduler with caching off: no hit,
    no crash, and no block held by nobody."""
    cache = PrefixCache(BlockAllocator(8), block_size=4)
    table, _ = cache.allocate([1, 2, 3, 4, 5, 6, 7, 8, 9])
    cache.cache_full_blocks(table)
    cache.release(table)
    sched = Scheduler(block_size=4, max_num_batched_tokens=16, prefix_cache=cache, enable_prefix_caching=False)
    r = sched.add_request([1, 2, 3, 4, 5, 6, 7, 8, 9], 1)
    step = sched.schedule()
    assert step.chunks[0].num_cached_tokens == 0 and step.chunks[0].start == 0
    sched.postprocess(step, [0])
    assert r.is_finished and sched.allocator.num_used == 0


def test_a_request_whose_last_token_needs_no_slot_fits():
    """The last sampled token is never fed back, so it needs no K/V slot: 3 prompt tokens and
    2 new tokens need 4 slots, one block of 4."""
    sched = Scheduler(num_blocks=1, block_size=4, max_num_batched_tokens=8)
    r = sched.add_request([1, 2, 3], 2)
    outputs = []
    while sched.has_unfinished():
        step = sched.schedule()
        outputs.append(sched.postprocess(step, [7] * len(step.sampling_chunks)))
    assert r.output_token_ids == [7, 7]
    with pytest.raises(ValueError, match="max_new_tokens"):
        Scheduler(num_blocks=1, block_size=4).add_request([1, 2, 3], 3)


def test_a_request_id_is_used_once():
    sched = Scheduler(num_blocks=8, block_size=4)
    sched.add_request(Request([1, 2], 2, request_id="a"))
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(Request([3, 4], 2, request_id="a"))
    assert len(sched.waiting) == 1


def test_two_forks_sharing_a_tail_need_one_copy_not_two():
    """The first fork to write copies the shared tail; the second then owns it alone. The pass
    must count one copy, so nobody is preempted when one block is free."""
    bs = 4
    sched = ForkingScheduler(3, bs, max_num_batched_tokens=32)
    parent = sched.add_request([5, 6, 7, 8, 9, 10], 4)   # 6 tokens: 2 blocks, the tail half full
    pool = SymbolicPool(bs)
    step = sched.schedule()
    sched.postprocess(step, pool.execute(step))
    child = sched.fork(parent)
    assert sched.allocator.num_free == 1
    step = sched.schedule()
    assert step.preempted == [] and len(step.copies) == 1
    assert {c.request.request_id for c in step.chunks} == {parent.request_id, child.request_id}
    sched.postprocess(step, pool.execute(step))
    check_ref_counts(sched)


def _decoding_scheduler(seed: int, stop_ids: list[int] | None = None,
                        max_model_len: int | None = None) -> tuple[Scheduler, list[Request]]:
    """A scheduler whose running requests have all reached the decode phase, nobody waiting."""
    rng = random.Random(seed)
    sched = Scheduler(num_blocks=60, block_size=4, max_num_batched_tokens=64, max_model_len=max_model_len)
    shared = [rng.randrange(VOCAB) for _ in range(6)]
    requests = [sched.add_request(shared + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))],
                                  rng.randrange(2, 25), stop_ids) for _ in range(5)]
    while any(r.status is RequestStatus.WAITING or not r.output_token_ids for r in requests):
        step = sched.schedule()
        sched.postprocess(step, [next_token(c.request.all_token_ids) for c in step.sampling_chunks])
    assert not sched.waiting
    return sched, requests


def _state(sched: Scheduler, requests: list[Request]) -> tuple:
    return (sched.num_steps, [r.status for r in requests], [list(r.output_token_ids) for r in requests],
            [r.num_computed_tokens for r in requests],
            [None if r.block_table is None else list(r.block_table.block_ids) for r in requests],
            list(sched.allocator.free_block_ids()),  # names by content (content ids are numbered as named)
            {b: (n.block_hash, n.parent_hash, n.token_ids) for b, n in sched.allocator.names.items()})


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_steps", [1, 3, 9, 40])
@pytest.mark.parametrize("stop_ids", [None, list(range(0, VOCAB, 6))], ids=["no-eos", "eos"])
@pytest.mark.parametrize("max_model_len", [None, 20])
def test_advance_decodes_does_what_as_many_steps_do(seed, num_steps, stop_ids, max_model_len):
    """The simulator's skip-ahead: k decode steps at once leave the scheduler exactly as k real steps,
    also when requests stop on a sampled token (one in six ids is a stop id) or at max_model_len tokens."""
    stepped, stepped_reqs = _decoding_scheduler(seed, stop_ids, max_model_len)
    skipped, skipped_reqs = _decoding_scheduler(seed, stop_ids, max_model_len)
    used = []
    for _ in range(num_steps):
        if not stepped.running:
            break
        step = stepped.schedule()
        assert not step.preempted and all(c.num_tokens == 1 for c in step.chunks)
        used.append(step.stats.used_blocks)
        stepped.postprocess(step, [next_token(c.request.all_token_ids) for c in step.sampling_chunks])

    def next_tokens(r: Request, n: int) -> list[int]:
        out = []
        for _ in range(n):
            out.append(next_token(r.all_token_ids + out))
        return out

    asked = []
    stretch = advance_decodes(skipped, num_steps, next_tokens,
                              lambda s, new, active, ctx: asked.append(s) or active > 0)
    assert stretch.used_blocks == used and asked[:len(used)] == list(range(len(used)))
    assert _state(skipped, skipped_reqs) == _state(stepped, stepped_reqs)


def test_advance_decodes_stops_where_may_run_says_no():
    sched, requests = _decoding_scheduler(0)
    before = _state(sched, requests)
    stretch = advance_decodes(sched, 10, lambda r, n: [1] * n, lambda s, new, active, ctx: False)
    assert stretch.used_blocks == [] and _state(sched, requests) == before


def test_a_request_stops_on_any_of_several_eos_ids():
    """Chat models list several stop tokens: the scheduler finishes a request on whichever comes first."""
    sched = Scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=16)
    r = sched.add_request([1, 2, 3], 10, eos_token_id=[7, 9])
    assert r.stop_token_ids == {7, 9}
    step = sched.schedule()
    sched.postprocess(step, [5])
    step = sched.schedule()
    sched.postprocess(step, [9])  # the second id ends it too
    assert r.status is RequestStatus.FINISHED and r.output_token_ids == [5, 9]
    with pytest.raises(ValueError, match="eos_token_id"):
        Request([1], 2, eos_token_id=[7, -1])


# -- issue 19: vLLM's full-sequence admission gate -------------------------------------------------

def _gate_case(gate: bool) -> tuple[Scheduler, Request, Request]:
    """A holds 2 of 6 blocks; B's 20-token prompt needs 5 blocks of 4, and 4 are free."""
    sched = Scheduler(6, 4, max_num_batched_tokens=8, enable_prefix_caching=False, full_sequence_must_fit=gate)
    a = sched.add_request(list(range(1, 8)), 2)           # 7 tokens: 2 blocks
    b = sched.add_request(list(range(10, 30)), 3)         # 20 tokens: 5 blocks
    return sched, a, b


def test_the_gate_admits_a_request_only_when_its_whole_sequence_fits():
    sched, a, b = _gate_case(True)
    assert sched.full_sequence_must_fit  # on by default: checked below with the default too
    step = sched.schedule()
    assert [(c.request, c.num_tokens) for c in step.chunks] == [(a, 7)]
    turn = step.decisions[-1]
    assert (turn.request, turn.needed, turn.free_blocks, turn.outcome) == (b, 5, 4, "skipped")
    assert b.status is RequestStatus.WAITING and b.block_table is None and sched.allocator.num_free == 4
    # without the gate B gets the last budget token and a block, as the article's pass has it
    sched, a, b = _gate_case(False)
    step = sched.schedule()
    assert [(c.request, c.num_tokens) for c in step.chunks] == [(a, 7), (b, 1)]
    assert Scheduler(4).full_sequence_must_fit is True


def test_the_gate_counts_a_preempted_requests_outputs_and_its_prefix_hit():
    """vLLM's allocate_slots(full_sequence_must_fit=True) counts min(num_tokens, max_model_len) tokens
    after the hit: prompt and outputs so far, less the cached blocks (those it revives count too)."""
    bs = 4
    sched = Scheduler(8, bs, max_num_batched_tokens=64)
    a = sched.add_request(list(range(1, 13)), 1)          # 12 tokens, 3 full blocks, cached when done
    run(sched, {})
    assert a.is_finished and sched.prefix_cache.num_cached_blocks == 3
    r = Request(list(range(1, 13)) + [40, 41, 42, 43, 44], 2)
    hit = sched.prefix_cache.match(r.all_token_ids)
    assert hit.num_cached_tokens == 12
    sched._hits[r.request_id], r.num_computed_tokens = hit, hit.num_cached_tokens  # its turn, as _candidates sets it
    assert sched._extra_blocks(r, 1) == 3 + 1   # whole sequence: 3 revived + 2 new fit; the chunk: 3 + 1
    r.output_token_ids = [7] * 16               # as if preempted after 16 outputs: 33 tokens, 9 blocks
    assert sched._extra_blocks(r, 1) == 3 + 6   # the whole sequence does not fit: its need is reported
    sched.full_sequence_must_fit = False
    assert sched._extra_blocks(r, 1) == 3 + 1


def test_a_waiting_requests_blocks_are_hashed_once_however_long_it_waits():
    """Each step looks a waiting request's prefix hit up again (after the requests before it named their
    blocks), from the chain its last look found (vLLM keeps ``Request.block_hashes``): each of its full blocks
    is hashed once while it waits, and the hit it is admitted with is the one a fresh look finds."""
    hashed: dict[tuple, int] = {}

    def counting(parent, tokens, key):
        hashed[tuple(tokens)] = hashed.get(tuple(tokens), 0) + 1
        return block_hash(parent, tokens, key)

    sched = Scheduler(block_size=4, max_num_batched_tokens=8, prefix_cache=PrefixCache(BlockAllocator(6), 4,
                                                                                       hash_fn=counting))
    first = sched.add_request(list(range(1, 21)), 4)        # 20 prompt tokens, 4 outputs: all 6 blocks in the end
    waiting = sched.add_request(list(range(1, 9)) + list(range(50, 58)), 2)  # shares 2 blocks, then 2 of its own
    own = [tuple(range(50, 58))[i:i + 4] for i in (0, 4)]
    looks = 0
    while waiting.status is RequestStatus.WAITING:
        step = sched.schedule()
        looks += 1
        if waiting.status is RequestStatus.WAITING:
            assert [hashed.get(block, 0) for block in own] == [1, 1], looks
            fresh = hash_chain(waiting.all_token_ids, 4)  # hashed apart, not counted
            assert sched._hits[waiting.request_id] == sched.prefix_cache.match(
                waiting.all_token_ids, block_hashes=fresh)
        sched.postprocess(step, [7] * len(step.sampling_chunks))
    assert looks > 3 and first.status is not RequestStatus.WAITING
    assert waiting.request_id not in sched._hits  # admitted: its hit was taken
    while sched.has_unfinished():
        step = sched.schedule()
        sched.postprocess(step, [7] * len(step.sampling_chunks))
    assert sched._hits == {}


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_random_workloads_with_the_gate_off_still_finish(workload):
    sched, arrivals = workload
    sched.full_sequence_must_fit = not sched.full_sequence_must_fit
    run(sched, arrivals, max_steps=10_000)
    assert sched.allocator.num_free == sched.num_blocks


# -- issue 19: operations between schedule() and postprocess() -----------------------------------

def _two_decoding(pool: SymbolicPool | None = None, num_blocks: int = 16) -> tuple[Scheduler, Request, Request]:
    sched = ForkingScheduler(num_blocks, 4, max_num_batched_tokens=32)
    a = sched.add_request([1, 2, 3, 4, 5], 6)
    b = sched.add_request([6, 7, 8], 6)
    step = sched.schedule()
    sched.postprocess(step, (pool or SymbolicPool(4)).execute(step))
    return sched, a, b


def _finish_all(sched: Scheduler, pool: SymbolicPool, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        step = sched.schedule()
        assert step.chunks, "a step with unfinished requests planned nothing (a stall)"
        sched.postprocess(step, pool.execute(step))
        check_ref_counts(sched)
    assert not sched.has_unfinished() and sched.allocator.num_free == sched.num_blocks


def test_a_twin_forked_mid_step_gets_its_parents_token_and_nothing_stalls():
    pool = SymbolicPool(4)
    sched, a, b = _two_decoding(pool)
    step = sched.schedule()
    child = sched.fork(a)                     # while the step is in flight
    sched.postprocess(step, pool.execute(step))
    assert child.output_token_ids == a.output_token_ids and len(a.output_token_ids) == 2
    step = sched.schedule()                   # before the fix: 0 new tokens read as "budget spent"
    assert {c.request for c in step.chunks} == {a, b, child}
    sched.postprocess(step, pool.execute(step))
    _finish_all(sched, pool)
    for r in (a, b, child):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 6)


def test_a_request_finished_mid_step_gets_no_token_and_the_others_do():
    pool = SymbolicPool(4)
    sched, a, b = _two_decoding(pool)
    step = sched.schedule()
    sampled = pool.execute(step)
    sched.finish(a)                           # an abort while the model runs
    out_a = list(a.output_token_ids)
    assert sched.postprocess(step, sampled) == []
    assert a.output_token_ids == out_a and len(b.output_token_ids) == 2
    _finish_all(sched, pool)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 6)


def test_a_fork_never_takes_an_id_in_use():
    probe = Request([1], 1).request_id        # the module-wide counter hands out probe + 1 next
    sched = ForkingScheduler(16, 4, max_num_batched_tokens=32)
    parent = sched.add_request(Request([1, 2, 3], 4, request_id=probe + 1))
    other = sched.add_request(Request([4, 5, 6], 4, request_id=probe + 2))
    pool = SymbolicPool(4)
    step = sched.schedule()
    sched.postprocess(step, pool.execute(step))
    child = sched.fork(parent)
    assert child.request_id not in (parent.request_id, other.request_id)
    assert sched.requests[parent.request_id] is parent and sched.requests[child.request_id] is child
    sched.finish(parent)
    _finish_all(sched, pool)


def test_postprocess_takes_only_the_step_in_flight_and_only_once():
    pool = SymbolicPool(4)
    sched, a, b = _two_decoding(pool)
    step = sched.schedule()
    sampled = pool.execute(step)
    sched.postprocess(step, sampled)
    outputs = [list(a.output_token_ids), list(b.output_token_ids)]
    with pytest.raises(ValueError, match="step must be the step"):
        sched.postprocess(step, sampled)
    assert [a.output_token_ids, b.output_token_ids] == outputs


def test_schedule_refuses_while_a_step_is_in_flight():
    pool = SymbolicPool(4)
    sched, a, b = _two_decoding(pool)
    step = sched.schedule()
    before = (sched.num_steps, a.num_computed_tokens, b.num_computed_tokens, sched.allocator.num_free)
    with pytest.raises(ValueError, match="in flight"):
        sched.schedule()
    assert (sched.num_steps, a.num_computed_tokens, b.num_computed_tokens, sched.allocator.num_free) == before
    sched.postprocess(step, pool.execute(step))
    _finish_all(sched, pool)


def test_bad_switches_and_keys_are_refused_at_construction():
    with pytest.raises(ValueError, match="cache_key"):
        Scheduler(8, cache_key="k")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        Scheduler(8, enable_prefix_caching="no")
    with pytest.raises(ValueError, match="full_sequence_must_fit"):
        Scheduler(8, full_sequence_must_fit=None)
    cache = PrefixCache(BlockAllocator(8), 16)
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(4, prefix_cache=cache)
    assert Scheduler(prefix_cache=cache).num_blocks == 8


def test_stop_ids_accept_numpy_integers_and_refuse_bools():
    import numpy as np

    r = Request([1, 2], 3, np.int64(2))
    assert r.stop_token_ids == {2} and type(r.eos_token_id) is int
    assert Request([1, 2], 3, [np.int32(4), 5]).stop_token_ids == {4, 5}
    for bad in (True, [1, True], -1, "2", 2.0):
        with pytest.raises(ValueError, match="eos_token_id"):
            Request([1, 2], 3, bad)


# -- the mid-step fuzzer: aborts and forks between schedule() and postprocess() ------------------

def _fuzz_once(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    num_blocks = rng.randrange(6, 16)
    sched = ForkingScheduler(num_blocks, bs, rng.randrange(4, 40), max_num_seqs=rng.randrange(2, 8),
                             enable_prefix_caching=rng.random() < 0.7, full_sequence_must_fit=rng.random() < 0.7)
    cap = num_blocks * bs
    shared = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 2 * bs + 1))]
    pending = []
    for _ in range(rng.randrange(2, 9)):
        new = rng.randrange(1, 6)
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 10))]
        prompt = prompt[:max(1, cap - new)]
        pending.append((rng.randrange(0, 8), Request(prompt, new, rng.randrange(VOCAB) if rng.random() < 0.3 else None)))
    aborted: set[int] = set()
    pool = SymbolicPool(bs)
    for t in range(400):
        for at, r in pending:
            if at == t:
                sched.add_request(r)
        if not sched.has_unfinished() and t > 8:
            break
        if not sched.has_unfinished():
            continue
        step = sched.schedule()
        assert step.chunks, f"seed {seed}: a stall at step {step.index}"
        sampled = pool.execute(step)
        for _ in range(rng.choice([0, 0, 1, 2])):  # mid-step operations
            live = list(sched.requests.values())
            if rng.random() < 0.5 and live:
                victim = rng.choice(live)
                aborted.add(id(victim))
                sched.finish(victim)
            elif sched.running and len(sched.running) < sched.max_num_seqs:
                pending.append((-1, sched.fork(rng.choice(sched.running))))
        sched.postprocess(step, sampled)
        check_ref_counts(sched)
    assert not sched.has_unfinished(), f"seed {seed}: unfinished after 400 steps"
    assert sched.allocator.num_free == num_blocks and sched.allocator.ref_counts == [0] * num_blocks
    for _, r in pending:
        if id(r) not in aborted:
            assert r.output_token_ids == reference_output(r.prompt_token_ids, r.max_new_tokens, r.eos_token_id)


def test_mid_step_fuzzer_no_stall_no_error():
    for seed in range(400):
        _fuzz_once(seed)


# ------------------------------------------------------------------ reservations (the paper's baselines)


@settings(max_examples=80, deadline=None)
@given(workloads(), st.sampled_from(["max_len", "exact"]), st.integers(0, 9))
def test_reservations_hold_their_whole_length_and_never_preempt(workload, allocation, spare):
    """Orca (Max) and Orca (Oracle): every running request holds blocks for its whole reservation at
    every step (``run`` counts them in ``check_ref_counts``), nobody is preempted, and every request
    still gets its own tokens, also with prefix hits inside the reservation."""
    drawn, arrivals = workload
    reqs = [r for rs in arrivals.values() for r in rs]
    longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in reqs)  # tokens, as vLLM counts max_model_len
    max_model_len = min(longest + spare, drawn.num_blocks * drawn.block_size)
    sched = ReservingScheduler(drawn.num_blocks, drawn.block_size, drawn.max_num_batched_tokens,
                               enable_prefix_caching=drawn.enable_prefix_caching, head_of_line=drawn.head_of_line,
                               full_sequence_must_fit=drawn.full_sequence_must_fit, reserve=allocation,
                               max_model_len=max_model_len)
    total = sum(len(r.prompt_token_ids) + r.max_new_tokens for r in reqs)
    steps = run(sched, arrivals, max_steps=10 * total + 10)
    assert not any(step.preempted for step in steps)
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.max_new_tokens, r.eos_token_id)
        assert r.num_preemptions == 0
    assert sched.allocator.num_free == sched.num_blocks and sched.allocator.ref_counts == [0] * sched.num_blocks


def _serve_all_at_once(allocation: str) -> tuple[list[int], list[list[int]], int]:
    """Twelve requests at once in a 40-block pool: the most running in a step, every output, preemptions."""
    rng = random.Random(5)
    reqs = [Request([rng.randrange(VOCAB) for _ in range(rng.randrange(4, 20))], rng.randrange(4, 20))
            for _ in range(12)]
    cls, variant = scheduler_class(allocation)
    sched = cls(40, 4, 64, enable_prefix_caching=False, max_model_len=48, **variant)
    running = []
    for step in run(sched, {0: reqs}):
        running.append(step.stats.num_running)
        if allocation == "max_len":  # a plain count: 12 blocks of 4 slots for each of them, no sharing
            assert sched.allocator.num_used == 12 * len(sched.running)
    return running, [r.output_token_ids for r in reqs], sum(r.num_preemptions for r in reqs)


def test_reserving_admits_fewer_requests_at_once_than_paging_with_the_same_tokens():
    """The same twelve requests: reserving 48 slots each runs at most 3 at once (40 // 12 blocks),
    the exact length more, paging most; each request's tokens are the same whatever the allocation."""
    runs = {a: _serve_all_at_once(a) for a in ALLOCATIONS}
    peak = {a: max(running) for a, (running, _, _) in runs.items()}
    assert peak["max_len"] == 3 < peak["exact"] < peak["paged"]
    assert runs["max_len"][1] == runs["exact"][1] == runs["paged"][1]
    assert runs["max_len"][2] == runs["exact"][2] == 0
    mean = {a: sum(running) / len(running) for a, (running, _, _) in runs.items()}
    assert mean["max_len"] < mean["exact"] < mean["paged"]


def test_a_reserving_request_waits_for_its_whole_reservation():
    """Admission asks for the reservation, not for the prompt: 10 free blocks of 4 slots hold a
    5-token prompt, but not a 48-slot reservation (12 blocks)."""
    sched = ReservingScheduler(14, 4, 64, enable_prefix_caching=False, reserve="max_len", max_model_len=48)
    sched.add_request([1] * 5, 3)
    first = sched.schedule()
    sched.postprocess(first, [2])
    sched.add_request([3] * 5, 3)
    step = sched.schedule()
    turn = next(d for d in step.decisions if d.waiting)
    assert (turn.needed, turn.free_blocks, turn.outcome) == (12, 2, "skipped")
    assert len(sched.running) == 1 and sched.allocator.num_used == 12


def test_allocation_bad_values_are_refused_and_nothing_changes():
    for bad in ("max", "Paged", None, 1):
        with pytest.raises(ValueError, match="allocation must be one of 'paged', 'max_len', 'exact'"):
            check_allocation(bad, 48)
    for bad in ("paged", "max", None):
        with pytest.raises(ValueError, match="reserve must be one of 'max_len', 'exact'"):
            ReservingScheduler(8, reserve=bad, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 1 with allocation='max_len'"):
        check_allocation("max_len", None)
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 1 with reserve='max_len'"):
        ReservingScheduler(8, reserve="max_len")
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="max_model_len"):
            ReservingScheduler(8, reserve="max_len", max_model_len=bad)
    with pytest.raises(ValueError, match="max_model_len must fit the pool"):
        ReservingScheduler(8, block_size=4, reserve="max_len", max_model_len=33)
    sched = ReservingScheduler(16, 4, reserve="exact", max_model_len=20)
    kept = sched.add_request([1, 2, 3], 4)
    sched.add_request([1] * 15, 7)  # capped: it stops at 20 tokens, 5 outputs
    with pytest.raises(ValueError, match="max_model_len"):  # a prompt of 20 tokens leaves no room for an output
        sched.add_request([1] * 20, 1)
    kept_too = list(sched.requests)
    assert list(sched.waiting)[0] is kept and list(sched.requests) == kept_too and len(kept_too) == 2
    assert not hasattr(sched, "fork")  # a reservation is never shared: forking is another variant


# ------------------------------------------------------------------ prefix-cache counters, as vLLM keeps them


def test_a_preempted_request_refinding_its_own_blocks_is_counted_apart():
    """Two requests, no shared token, one preemption: vLLM's PrefixCacheStats (recorded at admission by
    KVCacheManager.record_prefix_cache_stats) counts 2 requests and 0 hits; B's re-admission, which finds
    its own 2 named blocks again, goes to preempted_requests / preempted_hits."""
    sched = Scheduler(5, 4, 64)
    a = sched.add_request(list(range(1, 9)), 4)
    b = sched.add_request(list(range(20, 28)), 3)
    steps = run(sched, {})
    assert sum(len(s.preempted) for s in steps) == 1 and b.num_preemptions == 1 and a.num_preemptions == 0
    stats = sched.prefix_cache.stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 16, 0) and stats.hit_rate == 0
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 8 + 1, 8)
    assert sum(s.stats.prefix_hit_tokens for s in steps) == 0 and sum(s.stats.preempted_hit_tokens for s in steps) == 8
    assert a.num_cached_tokens == b.num_cached_tokens == 0  # the first admission's hit, as vLLM's Request keeps it


def test_the_first_admissions_hit_is_counted_once_and_read_everywhere():
    """One count of the first-admission hit (issue 37): the request keeps it (``num_cached_tokens``), the
    steps that admitted it add it up (``prefix_hit_tokens``), the prefix cache's counters record it, and a
    re-admission after a preemption changes none of them, whatever it re-finds."""
    shared = list(range(1, 9))
    sched = Scheduler(5, 4, 64)
    first = sched.add_request(shared + [50, 51], 6)
    second = sched.add_request(shared + [60, 61], 6)  # finds the 8 shared tokens, then is preempted
    steps = run(sched, {})
    assert second.num_preemptions >= 1
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 8)
    stats = sched.prefix_cache.stats
    assert stats.hits == sum(s.stats.prefix_hit_tokens for s in steps) == 8
    assert stats.preempted_hits == sum(s.stats.preempted_hit_tokens for s in steps) > 0


def test_a_chunked_prompt_is_one_query_of_all_its_tokens():
    """Two 40-token prompts sharing 16 tokens, a budget of 8: the hit is 16 of 80 queried tokens (20%),
    not 16 of the tokens in the chunks that admitted them."""
    shared = list(range(1, 17))
    sched = Scheduler(32, 4, 8)
    a = sched.add_request(shared + list(range(100, 124)), 2)
    b = sched.add_request(shared + list(range(200, 224)), 2)
    run(sched, {})
    stats = sched.prefix_cache.stats
    assert b.num_cached_tokens == 16 and a.num_cached_tokens == 0
    assert (stats.requests, stats.queries, stats.hits) == (2, 80, 16) and stats.hit_rate == 0.2


def test_prefix_caching_off_records_no_lookup():
    sched = Scheduler(16, 4, 64, enable_prefix_caching=False)
    sched.add_request([1, 2, 3, 4, 5], 2)
    run(sched, {})
    assert sched.prefix_cache.stats == type(sched.prefix_cache.stats)()


@pytest.mark.parametrize("seed", range(4))
def test_freed_slot_is_refilled_at_the_next_step(seed):
    """More requests than slots (issue 32): with ``max_num_seqs`` slots and room for everything else,
    the scheduler takes exactly as many steps as the ideal first-come-first-served schedule, in which
    each request in turn takes the slot that frees first and a freed slot is refilled at the next
    step. A slot left empty for a step, or a request admitted out of order, would take more."""
    import heapq

    from labkit.serving.dry_run import dry_run, named_requests

    rng = random.Random(seed)
    slots, lengths = 4, [rng.randint(1, 30) for _ in range(17)]
    sched = Scheduler(num_blocks=400, block_size=4, max_num_batched_tokens=64, max_num_seqs=slots,
                      enable_prefix_caching=False)
    steps = dry_run(sched, {0: named_requests((f"r{i}", rng.randint(2, 9), n) for i, n in enumerate(lengths))})
    free_at = [0] * slots
    for n in lengths:
        heapq.heappush(free_at, heapq.heappop(free_at) + n)
    assert len(steps) == max(free_at)
    static = sum(max(lengths[lo:lo + slots]) for lo in range(0, len(lengths), slots))
    assert len(steps) < static


# ------------------------------------------------------------------ max_model_len, counted in tokens as vLLM counts it


def test_max_model_len_counts_tokens_and_stops_a_request_there():
    """Issue 38's example: a 10-token prompt, max_model_len 16. vLLM's ``check_stop`` finishes a request once
    ``num_tokens >= max_model_len``: 6 outputs (16 tokens), not 7, and a larger ``max_new_tokens`` is capped."""
    for max_new_tokens in (7, 8, 100):
        sched = Scheduler(8, 4, 64, max_model_len=16)
        r = sched.add_request(list(range(1, 11)), max_new_tokens)
        run(sched, {})
        assert r.is_finished and len(r.output_token_ids) == 6 and r.num_tokens == 16
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 6, None)
        assert (r.max_output_tokens, r.max_len) == (6, 15)
    sched = Scheduler(8, 4, 64, max_model_len=16)
    r = sched.add_request(list(range(1, 11)), 5)  # shorter than the cap: max_new_tokens decides
    run(sched, {})
    assert len(r.output_token_ids) == 5 and r.max_len == 14
    r = Scheduler(8, 4, 64, max_model_len=16).add_request(list(range(1, 16)), 9)  # 15 tokens: room for one output
    assert r.max_output_tokens == 1


def test_a_prompt_as_long_as_max_model_len_is_refused_before_it_is_queued():
    """vLLM's ``_validate_prompt_len`` refuses a prompt of ``max_model_len`` tokens or more (a generating
    request needs room for one output); the scheduler is left as it was."""
    sched = Scheduler(8, 4, 64, max_model_len=16)
    for n in (16, 17):
        with pytest.raises(ValueError, match=r"prompt_token_ids: a prompt of \d+ tokens must be shorter than max_model_len \(16\)"):
            sched.add_request(list(range(1, n + 1)), 1)
    assert not sched.has_unfinished() and not sched.requests
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request([1] * 16, 1, max_model_len=16)
    with pytest.raises(ValueError, match=r"request.max_model_len must be None or the scheduler's \(16\)"):
        sched.add_request(Request([1, 2], 1, max_model_len=32))


def test_the_pool_check_counts_the_capped_sequence():
    """A request whose ``max_new_tokens`` alone would overflow the pool is accepted when max_model_len caps it
    within the pool (6 blocks of 4 hold 24 slots; max_model_len 24 stops it at 23 slots)."""
    sched = Scheduler(6, 4, 64, max_model_len=24)
    r = sched.add_request([1] * 10, 1000)
    run(sched, {})
    assert len(r.output_token_ids) == 14 and r.num_tokens == 24
    with pytest.raises(ValueError, match="more than the pool's 6"):
        Scheduler(6, 4, 64).add_request([1] * 10, 1000)


def test_a_reservation_of_the_exact_length_is_the_capped_length():
    """Orca (Oracle) reserves the slots the request can really need: capped by max_model_len too."""
    sched = ReservingScheduler(20, 4, 64, enable_prefix_caching=False, reserve="exact", max_model_len=16)
    r = sched.add_request(list(range(1, 11)), 50)
    sched.schedule()
    assert sched.reserved_tokens(r) == 15 and len(r.block_table.block_ids) == 4


@settings(max_examples=60, deadline=None)
@given(workloads(), st.integers(2, 30))
def test_random_workloads_stop_at_max_model_len(workload, max_model_len):
    """Random workloads under a max_model_len that often binds: every request ends with
    ``min(max_new_tokens, max_model_len - prompt)`` outputs (fewer at a stop id), tokens as served alone."""
    drawn, arrivals = workload
    max_model_len = min(max_model_len, drawn.num_blocks * drawn.block_size)
    arrivals = {t: [r for r in rs if len(r.prompt_token_ids) < max_model_len] for t, rs in arrivals.items()}
    sched = Scheduler(drawn.num_blocks, drawn.block_size, drawn.max_num_batched_tokens,
                      enable_prefix_caching=drawn.enable_prefix_caching, max_model_len=max_model_len)
    run(sched, arrivals, max_steps=10_000)
    for r in (r for rs in arrivals.values() for r in rs):
        cap = min(r.max_new_tokens, max_model_len - len(r.prompt_token_ids))
        assert r.output_token_ids == reference_output(r.prompt_token_ids, cap, r.eos_token_id)
        assert r.num_tokens <= max_model_len
    assert sched.allocator.num_free == sched.num_blocks


def test_a_twin_stops_at_max_model_len_as_its_parent_does():
    """Parallel sampling under a cap: the twin inherits the parent's max_model_len and stops with it."""
    sched = ForkingScheduler(16, 4, max_num_batched_tokens=32, max_model_len=10)
    parent = sched.add_request([5, 6, 7, 8, 9, 10], 50)
    pool = SymbolicPool(4)
    step = sched.schedule()
    sched.postprocess(step, pool.execute(step))
    child = sched.fork(parent)
    while sched.has_unfinished():
        step = sched.schedule()
        sched.postprocess(step, pool.execute(step))
    assert len(parent.output_token_ids) == len(child.output_token_ids) == 4 and child.num_tokens == 10
