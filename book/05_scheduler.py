# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Capacity in the scheduler
#
# Chapters 03 and 04 built the memory: a pool of fixed-size blocks, block tables, shared prefixes.
# None of that says *which* request gets the next free block. A serving engine decides that once
# per iteration (a *step*): it picks requests and a number of tokens for each, and the model
# computes all of them in one batched forward pass. This chapter writes that decision down, runs
# it, and then builds a small engine on top of it that ties the whole book together.
#
# **What you will learn**
#
# - why every step has two budgets, tokens of compute and blocks of memory, and how the article's
#   `plan_iteration` spends both;
# - what `extra_blocks` counts: new blocks, a shared tail block copied before it is written, and
#   cached blocks revived from the free queue;
# - that the order of the candidates decides who gets memory first, and paging decides nothing
#   about priority;
# - what an engine does when blocks run out: preemption by recompute, and swapping as the
#   alternative;
# - why vLLM admits a waiting request only when its whole prompt fits, not just its first chunk,
#   and how close labkit's scheduler comes to vLLM's own (step for step, on the same workloads);
# - how chapters 01 to 04 become one engine (decoder, paged cache, prefix cache, scheduler, Triton
#   kernels), and a proof that batching, chunking, reuse and preemption change no token.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import Patch

import labkit
from labkit import capacity
from labkit.cache import generate
from labkit.engine import Engine
from labkit.model import Decoder, DecoderConfig
from labkit.paging import blocks_needed
from labkit.priority import PriorityScheduler
from labkit.scheduler import Request, Scheduler, extra_blocks, plan_iteration
from labkit.units import format_bytes

torch.set_num_threads(2)
print(labkit.describe())

# %% [markdown]
# ## Two budgets per step
#
# A step computes some tokens: a few hundred prompt tokens of a new request (prefill), one token
# for each request that is already generating (decode), or both at once. Two things bound it.
#
# - **Tokens.** The forward pass has a cost that grows with the number of tokens in it. Engines cap
#   it with a *token budget* (vLLM calls it `max_num_batched_tokens`). A prompt longer than what is
#   left of the budget is not refused: it is cut, and the rest waits for the next step. That is
#   *chunked prefill*.
# - **Blocks.** Every computed token leaves its keys and values in a slot of the pool, and the slot
#   must belong to a block that the request holds *before* the pass writes it. So the step must
#   also fit in the free blocks.
#
# The article's §05 puts both budgets into one pass over the candidates. Here is its pseudocode,
# quoted unchanged from the source article (`next_chunk` is what the request would compute next,
# `reserve_blocks` takes the blocks from the pool):
#
# ```python
# def plan_iteration(candidates, free_blocks, token_budget, block_size):
#     plan = []
#     for request in candidates:
#         tokens = min(request.next_chunk, token_budget)
#         if tokens == 0:
#             break
#         needed = extra_blocks(request, tokens, block_size)
#         if needed > free_blocks:
#             continue
#         reserve_blocks(request, needed)
#         plan.append((request, tokens))
#         free_blocks -= needed
#         token_budget -= tokens
#     return plan
# ```
#
# Fourteen lines, and both budgets are there: `token_budget` shrinks by the tokens each candidate
# gets, `free_blocks` by the blocks it needs. `labkit.scheduler.plan_iteration` keeps that skeleton
# and adds what a working scheduler needs around it. Its lines, a few at a time, read from the
# installed labkit each time this cell runs. First the token budget:

# %%
from labkit.show import excerpt

excerpt(plan_iteration, "for request in candidates", "continue  # nothing to compute now")

# %% [markdown]
# The article's `next_chunk` is `num_new_tokens` here: the rest of the prompt while a request
# prefills, one token while it decodes, and after a preemption its prompt *and* the outputs it had.
# The one change is the `continue`: a request with nothing to compute *now* (its last token is
# still being sampled) is passed over, where the article's `break` would end the pass for everyone
# behind it with budget left. Next, the blocks (and a note of whether the request is still
# waiting, which matters further down):

# %%
excerpt(plan_iteration, "waiting = request.status", "blocks = extra_blocks(")

# %% [markdown]
# The article calls `extra_blocks(request, ...)` directly. labkit takes a `needed` hook instead,
# because only the `Scheduler` knows what the count depends on: a prefix hit that revives cached
# blocks, a tail block shared with a forked twin (chapter 04). Without the hook the request is
# judged on its own, from the blocks it holds. Then the case the article leaves out, a *running*
# request that does not fit:

# %%
excerpt(plan_iteration, "preempted = False", "# a preempted twin")

# %% [markdown]
# A running request cannot simply be skipped: it holds blocks and must grow to finish. The
# `make_room` hook lets the scheduler preempt the newest running request (a section below) and
# returns the free blocks after it; a waiting request is never given that power. The end of the
# pass follows the article's lines, with two additions:

# %%
excerpt(plan_iteration, 'outcome = ("stop"', "token_budget -= tokens")

# %% [markdown]
# `break` when the budget is spent, `continue` when the blocks do not fit, then reserve, plan and
# subtract both budgets, as in the article. The additions: every turn is written to `decisions` when
# asked (the step tables below print them; they record, they decide nothing), and `reserve` is a
# hook that may be absent: the `Scheduler` passes one that allocates the blocks, while this chapter
# also calls `plan_iteration` without it, to ask "what *would* be planned?" without touching a pool.
# The function also checks its arguments (`check_int`) before the loop. What is *not* in it is as
# telling: vLLM's two admission rules for waiting requests (both in sections below) live in the
# `Scheduler`, which decides which candidates to offer; the pass itself stays the article's.
#
# Three rules follow from the code:
#
# 1. each candidate asks for `min(num_new_tokens, token_budget)` tokens, where `num_new_tokens` counts
#    the tokens it still has to compute: the rest of its prompt while prefilling, one while decoding;
# 2. when the token budget is spent (`tokens == 0`), the pass **stops** (a candidate with nothing
#    to compute *now*, whose last token is still being sampled, is merely passed over);
# 3. a candidate whose blocks do not fit is **skipped** (`continue`), and a later, smaller
#    candidate may still get in.
#
# Rule 3 has a price, starvation, and labkit's `Scheduler` adds one refinement for *waiting*
# requests to avoid it; a section below measures both.

# %% [markdown]
# ## What a step takes from the pool: `extra_blocks`
#
# How many free blocks does computing `tokens` more tokens of a request use? Positions
# `num_computed_tokens ... num_computed_tokens + tokens - 1` need
# `ceil((num_computed_tokens + tokens) / block_size)` blocks, and the request already holds some.
# Two more cases add blocks:
#
# - **a shared tail.** If the block the next token goes into is partly filled *and* another request
#   holds it too (chapter 04's fork: parallel sampling, beam search), writing into it would change
#   the other request's history. The writer first gets a private copy: one more block
#   (copy-on-write);
# - **revived blocks.** A prefix hit (chapter 04) may point at cached blocks that no request holds
#   any more. They sit in the free queue, and taking them back uses free blocks like new ones.
#
# `extra_blocks` is a pure function of what it is given: the tokens computed so far, the blocks
# held, the tokens to compute, the block size, and the two facts the scheduler looks up just
# before the request's turn (is the tail shared? how many hit blocks sit in the free queue?).
#
# The article's figure from chapter 03 is the first row below: a 37-token prompt in 16-token
# blocks needs 3 blocks; decoding its 38th token needs none, since the tail block has 11 empty
# slots.

# %%
# NBVAL_CHECK_OUTPUT
BS = 16
cases = [  # (what, tokens computed, blocks held, tokens to compute, shared tail, revived blocks)
    ("prefill a 37-token prompt", 0, 0, 37, False, 0),
    ("decode token 38", 37, 3, 1, False, 0),
    ("decode token 49 (3 blocks are full)", 48, 3, 1, False, 0),
    ("decode token 38, tail shared", 37, 3, 1, True, 0),
    ("decode token 49, full tail shared", 48, 3, 1, True, 0),
    ("prefix hit of 2 free cached blocks + 5 tokens", 32, 2, 5, False, 2),
]
needed = [extra_blocks(c, h, t, BS, shared_tail=sh, revived_blocks=rv) for _, c, h, t, sh, rv in cases]
print(f"{'case':<46} {'computed':>8} {'held':>4} {'tokens':>6} {'extra_blocks':>12}")
for (what, computed, held, tokens, _, _), n in zip(cases, needed):
    print(f"{what:<46} {computed:>8} {held:>4} {tokens:>6} {n:>12}")
assert needed == [3, 0, 1, 1, 1, 3]

# %% [markdown]
# A full shared block never needs a copy: nobody writes into it again. Only a *partly filled*
# shared tail does.
#
# ## The pass, iteration by iteration
#
# Four requests arrive together in a small pool: 8 blocks of 4 tokens, a budget of 12 tokens per
# step. A has a 10-token prompt, B 14, C 5 and D 3; they want 3, 2, 2 and 3 new tokens. The
# `Scheduler` keeps a *running* list (admitted, holding blocks) and a *waiting* queue (first come,
# first served), and offers the running requests first. Every `Step` records each candidate's turn
# in the pass: what it asked for, what it needed, what was left, and the outcome. For this walk the
# scheduler follows the article's pass to the letter (`head_of_line=False`; the default is
# explained below).

# %%
def serve(scheduler, arrivals, max_steps=500):
    """Drive a Scheduler without a model (every sampled token is 0). `arrivals`: {step: [Request]}."""
    steps, t = [], 0
    while scheduler.has_unfinished() or any(k >= t for k in arrivals):
        for r in arrivals.get(t, []):
            scheduler.add_request(r)
        t += 1
        step = scheduler.schedule()
        scheduler.postprocess(step, [0] * len(step.sampling_chunks))
        steps.append(step)
        assert len(steps) <= max_steps
    return steps


def named_requests(specs):
    """Requests with readable names and distinct token ids (so no prefix is shared)."""
    reqs, next_id = [], 1
    for name, prompt_len, max_new in specs:
        reqs.append(Request(list(range(next_id, next_id + prompt_len)), max_new, request_id=name))
        next_id += prompt_len
    return reqs


def show_step(step):
    preempted = ", ".join(r.request_id for r in step.preempted) or "-"
    print(f"step {step.index}   (preempted in this step: {preempted})")
    print(f"  {'req':<4}{'queue':<9}{'num_new_tokens':>15}{'tokens':>8}{'needed':>8}{'free':>6}{'budget':>8}  outcome")
    for d in step.decisions:
        print(f"  {d.request.request_id:<4}{'waiting' if d.waiting else 'running':<9}{d.num_new_tokens:>15}"
              f"{d.tokens:>8}{d.needed:>8}{d.free_blocks:>6}{d.token_budget:>8}  {d.outcome}")
    s = step.stats
    print(f"  -> {s.scheduled_tokens} tokens, {s.used_blocks} blocks in use, {s.free_blocks} free, "
          f"{s.finished} finished\n")


walk = Scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=12, enable_prefix_caching=False,
                 head_of_line=False)
walk_reqs = named_requests([("A", 10, 3), ("B", 14, 2), ("C", 5, 2), ("D", 3, 3)])
walk_steps = serve(walk, {0: walk_reqs})

# %%
# NBVAL_CHECK_OUTPUT
for step in walk_steps:
    show_step(step)

# %% [markdown]
# Read it step by step:
#
# - **Step 1.** A takes all 10 prompt tokens and 3 blocks. B gets only the 2 tokens left in the
#   budget: its prompt is split (chunked prefill). C's turn finds the budget spent: the pass stops.
# - **Step 2.** Running requests first: A decodes 1 token, B continues its prompt with 11 more.
#   The budget is spent again before C.
# - **Step 3.** Only 1 block is free. C needs 2 for its 5 tokens: **skipped**. D needs 1: it gets
#   in *ahead of* C, which arrived first. A reaches its 3 tokens and finishes; its blocks go back.
# - **Steps 4 and 5.** With A's blocks free, C is admitted; everyone finishes and the pool is whole.
#
# The claims, checked:

# %%
budget = walk.max_num_batched_tokens
assert all(s.num_tokens <= budget for s in walk_steps)
assert [c.num_tokens for c in walk_steps[0].chunks] == [10, 2]            # B's prompt is cut to fit
assert [d.outcome for d in walk_steps[2].decisions] == ["planned", "planned", "skipped", "planned"]
assert walk.allocator.num_free == walk.num_blocks                          # every block came back
assert [len(r.output_token_ids) for r in walk_reqs] == [3, 2, 2, 3]

# %% [markdown]
# ## Who gets space first: the order, not the paging
#
# The allocator hands out whichever block is free; it has no idea which request matters more.
# Priority lives entirely in the order of the candidates. The same three waiting requests, the same
# 4 free blocks, two orders:

# %%
# NBVAL_CHECK_OUTPUT
def fresh_trio():
    return named_requests([("L", 12, 4), ("S1", 4, 4), ("S2", 3, 4)])  # one long prompt, two short ones


def planned(plan):
    return [(r.request_id, n) for r, n in plan]


L, S1, S2 = fresh_trio()
fcfs_plan = plan_iteration([L, S1, S2], free_blocks=4, token_budget=32, block_size=4)
short_plan = plan_iteration(sorted([L, S1, S2], key=lambda r: r.num_new_tokens), free_blocks=4,
                            token_budget=32, block_size=4)
print("first come, first served:", planned(fcfs_plan))
print("shortest prompt first:   ", planned(short_plan))
assert planned(fcfs_plan) == [("L", 12), ("S1", 4)]
assert planned(short_plan) == [("S2", 3), ("S1", 4)]

# %% [markdown]
# Under first-come-first-served the long request L takes 3 of the 4 blocks and S2 waits; shortest
# first admits both short ones and L waits. Same pool, same blocks, same `plan_iteration`: only
# the order changed. Over a whole run the choice moves waiting time between requests.
# `PriorityScheduler` (`labkit.priority`, a variant beside the core) re-sorts its waiting queue by a
# `priority` key before each step; here is a run of ten requests with
# mixed lengths under both orders, measured in steps until each one's first token (1 means it got
# its first token in the step it arrived):

# %%
def workload():
    rng = np.random.default_rng(5)
    specs = [(f"R{i}", int(rng.integers(3, 31)), int(rng.integers(2, 9))) for i in range(10)]
    reqs = named_requests(specs)
    arrivals = {}
    for i, r in enumerate(reqs):
        arrivals.setdefault(i // 2, []).append(r)  # two new requests per step
    return reqs, arrivals


def first_token_waits(priority):
    reqs, arrivals = workload()
    cls, key = (Scheduler, {}) if priority is None else (PriorityScheduler, {"priority": priority})
    sched = cls(num_blocks=16, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False, **key)
    steps = serve(sched, arrivals)
    arrived = {r.request_id: t for t, rs in arrivals.items() for r in rs}
    first = {}
    for step in steps:
        for c in step.sampling_chunks:
            first.setdefault(c.request.request_id, step.index)
    return reqs, steps, sched, {name: first[name] - arrived[name] for name in arrived}


reqs_f, steps_f, sched_f, waits_fcfs = first_token_waits(None)
reqs_s, steps_s, sched_s, waits_short = first_token_waits(lambda r: len(r.prompt_token_ids))

# %%
# NBVAL_CHECK_OUTPUT
names = list(waits_fcfs)
prompt_len = {r.request_id: len(r.prompt_token_ids) for r in reqs_f}
print(f"{'request':<8}{'prompt':>7}{'FCFS wait':>11}{'shortest-first wait':>21}")
for n in names:
    print(f"{n:<8}{prompt_len[n]:>7}{waits_fcfs[n]:>11}{waits_short[n]:>21}")
mean_f, mean_s = np.mean(list(waits_fcfs.values())), np.mean(list(waits_short.values()))
longest = max(names, key=prompt_len.get)
print(f"mean wait: FCFS {mean_f:.2f} steps, shortest-first {mean_s:.2f} steps; "
      f"longest prompt {longest}: {waits_fcfs[longest]} vs {waits_short[longest]} steps")
assert mean_s < mean_f  # shortest first lowers the mean wait...
assert waits_short[longest] >= waits_fcfs[longest]  # the long request pays for the short ones

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
x = np.arange(len(names))
ax.bar(x - 0.2, [waits_fcfs[n] for n in names], 0.4, label="first come, first served")
ax.bar(x + 0.2, [waits_short[n] for n in names], 0.4, label="shortest prompt first")
ax.set_xticks(x, [f"{n}\n({prompt_len[n]})" for n in names])
ax.set_xlabel("request (prompt length in tokens)")
ax.set_ylabel("steps until first token")
ax.set_title("The candidate order, not paging, decides who waits (scheduler only, no model)")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Skipping, and the starvation it allows
#
# Rule 3 keeps the pool busy: blocks a large request cannot use yet go to smaller ones behind it.
# But it also lets small requests overtake a large one again and again. With a finite set of
# requests everyone finishes eventually. Under a never-ending stream of small requests, every block
# that frees up may be taken by a newcomer before the large request ever sees enough of them free.
#
# vLLM's scheduler therefore stops admitting at the first *waiting* request that does not fit, and
# labkit's `Scheduler` does the same by default (`head_of_line=True`): once a waiting request is
# skipped, the requests queued behind it are not offered in that step. `plan_iteration` itself is
# unchanged (running requests keep the article's rule); the scheduler simply stops handing it
# waiting candidates. Here is the stream: 8 blocks of 4 tokens, a small request (3 prompt tokens,
# 7 new ones) every other step, and at step 6 a large one (20 + 4 tokens) that needs 5 blocks to
# start.

# %%
# NBVAL_CHECK_OUTPUT
def small_stream(head_of_line, steps=200):
    """Returns the step that admits the large request (None: never), the small requests'
    mean wait for their first token, and the output tokens produced in `steps` steps."""
    sched = Scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False,
                      head_of_line=head_of_line)
    big, admitted, arrived, first, small = None, None, {}, {}, []
    for t in range(steps):
        if t % 2 == 0:
            small.append(sched.add_request([1 + t % 30] * 3, 7))
            arrived[small[-1].request_id] = t
        if t == 6:
            big = sched.add_request(list(range(1, 21)), 4)
        step = sched.schedule()
        for c in step.sampling_chunks:
            first.setdefault(c.request.request_id, t)
        if admitted is None and any(c.request is big for c in step.chunks):
            admitted = t
        sched.postprocess(step, [0] * len(step.sampling_chunks))
    waits = [first[i] - t0 for i, t0 in arrived.items() if i in first]
    small_outputs = sum(len(r.output_token_ids) for r in small)
    return admitted, float(np.mean(waits)), small_outputs, len(big.output_token_ids)


article_rule, head_of_line = small_stream(False), small_stream(True)
for label, (admitted, wait, small_out, big_out) in [("article's rule (skip)", article_rule),
                                                    ("head of line (vLLM)", head_of_line)]:
    big_wait = "never admitted" if admitted is None else f"admitted after {admitted - 6} steps"
    print(f"{label:<22}: large request {big_wait:<22} small requests wait {wait:.2f} steps on average; "
          f"output tokens in 200 steps: {small_out} small + {big_out} large")
assert article_rule[0] is None                   # starved for all 200 steps
assert head_of_line[0] is not None and head_of_line[0] - 6 <= 1 + 7  # at most one small request's life
assert head_of_line[1] > article_rule[1]         # the small ones pay for it
assert head_of_line[2] == article_rule[2] and head_of_line[3] == 4 and article_rule[3] == 0

# %% [markdown]
# Under the article's rule the large request never runs: at no step of the 200 are 5 blocks free
# when its turn comes, because small requests took each freed block first. With the head-of-line
# rule it waits only until the small requests already running finish, and the small ones behind it
# wait a little longer for their first token while the pool drains. Neither rule is free: skipping
# puts free blocks to use at once and keeps small requests moving; the head-of-line rule guarantees
# that every request is served, in arrival order, and sometimes leaves blocks idle. The token
# counts explain why head of line produces *more* tokens in 200 steps: the small requests produce
# the same number under both rules, and head of line adds the large request's 4, which the
# article's rule never produced. The stream is light enough that the small requests lose only
# waiting time, not output; under a heavier one, the idle blocks would cost output too. The walk from
# the start of the chapter shows that cost: with the head-of-line rule, D stays behind C in step 3
# and the four requests need one step more.

# %%
hol_walk = Scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=12, enable_prefix_caching=False)
hol_walk_steps = serve(hol_walk, {0: named_requests([("A", 10, 3), ("B", 14, 2), ("C", 5, 2), ("D", 3, 3)])})
print("step 3, article's rule:", [(d.request.request_id, d.outcome) for d in walk_steps[2].decisions])
print("step 3, head of line:  ", [(d.request.request_id, d.outcome) for d in hol_walk_steps[2].decisions])
print(f"steps to serve all four: {len(walk_steps)} (article's rule), {len(hol_walk_steps)} (head of line)")
assert [d.outcome for d in hol_walk_steps[2].decisions] == ["planned", "planned", "skipped"]
assert len(hol_walk_steps) == len(walk_steps) + 1

# %% [markdown]
# ## A chart of iterations
#
# The same ten requests under first-come-first-served, step by step: which requests got tokens
# (a prompt chunk or a decode token), which were waiting, and how many blocks were in use.

# %%
def iteration_grid(reqs, arrivals, steps):
    """codes[request, step]: 0 absent, 1 waiting, 2 decode token, 3 prompt chunk, 4 preempted."""
    row = {r.request_id: i for i, r in enumerate(reqs)}
    arrived = {r.request_id: t for t, rs in arrivals.items() for r in rs}
    last = {c.request.request_id: j for j, step in enumerate(steps) for c in step.chunks}
    codes = np.zeros((len(reqs), len(steps)), dtype=int)
    for name, i in row.items():
        codes[i, arrived[name]:last[name] + 1] = 1  # present from arrival to its last step
    for j, step in enumerate(steps):
        for c in step.chunks:
            codes[row[c.request.request_id], j] = 2 if (c.num_tokens == 1 and c.samples) else 3
        for r in step.preempted:
            codes[row[r.request_id], j] = 4
    return codes


_, arrivals_f = workload()
codes = iteration_grid(reqs_f, arrivals_f, steps_f)
colors = ["white", "#dddddd", "tab:blue", "tab:orange", "tab:red"]
labels = ["", "waiting", "decode token", "prompt chunk", "preempted"]
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
ax1.imshow(codes, aspect="auto", interpolation="nearest",
           cmap=plt.matplotlib.colors.ListedColormap(colors), vmin=0, vmax=4,
           extent=(0.5, len(steps_f) + 0.5, len(reqs_f) - 0.5, -0.5))
ax1.set_yticks(range(len(reqs_f)), [r.request_id for r in reqs_f])
ax1.set_ylabel("request")
ax1.set_title("Which requests got tokens in each step (FCFS, 16 blocks, 16-token budget; no model)")
ax1.legend(handles=[Patch(color=c, label=l) for c, l in zip(colors[1:], labels[1:])], loc="upper left",
           bbox_to_anchor=(1.01, 1), fontsize=8)
used = [s.stats.used_blocks for s in steps_f]
ax2.step(range(1, len(steps_f) + 1), used, where="mid", label="blocks in use")
ax2.axhline(sched_f.num_blocks, color="gray", linestyle="--", label="pool size")
ax2.set_xlabel("step")
ax2.set_ylabel("blocks")
ax2.set_ylim(0, sched_f.num_blocks + 1)
ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
ax2.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
fig.tight_layout()
plt.show()
assert max(used) <= sched_f.num_blocks and sched_f.allocator.num_free == sched_f.num_blocks
assert any(s.preempted for s in steps_f) and (codes == 3).any() and (codes == 2).any()

# %% [markdown]
# Patterns to look for: orange cells (prompt chunks) share steps with blue ones (decode tokens),
# since a step mixes prefill and decode; grey cells are requests kept waiting; and red cells mark
# requests that lost their blocks, the subject of the next section. What keeps the grey ones
# waiting? Both budgets do, and the step records tell which one ended each step's admissions:

# %%
# NBVAL_CHECK_OUTPUT
def why_waiting(steps):
    """For the steps that ended with requests waiting: what stopped the first one not admitted."""
    reasons = {"token budget spent": 0, "blocks did not fit": 0, "a preemption in the step": 0}
    for step in steps:
        if not step.stats.num_waiting:
            continue
        turns = [d for d in step.decisions if d.waiting and d.outcome != "planned"]
        if step.preempted:
            reasons["a preemption in the step"] += 1
        elif not turns or turns[0].outcome == "stop":  # a stop can also come before any waiting turn
            reasons["token budget spent"] += 1
        else:
            reasons["blocks did not fit"] += 1
    return reasons


reasons_f = why_waiting(steps_f)
print(reasons_f)
assert reasons_f["token budget spent"] > 0 and reasons_f["blocks did not fit"] > 0

# %% [markdown]
# Both budgets keep requests waiting here: in some steps the 16-token budget is spent before a
# waiting request's turn comes, in others its blocks do not fit in the pool.
#
# ## When blocks run out: preemption
#
# A request that is already running holds blocks and needs one more every `block_size` tokens.
# Skipping it is not enough: if every running request waited for a block that only another
# running request could free, none would ever move. Engines **preempt**. When a running request's
# turn comes and its blocks do not fit, the *newest* running request gives back all its blocks and
# goes to the *front* of the waiting queue, again until the request fits or was itself the newest
# (the `make_room` hook of `plan_iteration`; its turn is then recorded as `preempted`). The victim's
# K/V are simply dropped: when it comes back, its prompt and the tokens it had already generated
# are computed again (**recompute**, what vLLM does). In the same step no waiting request is
# admitted, so the freed blocks go to the requests that needed them. The whole rule is one loop of
# `Scheduler._make_room`:

# %%
excerpt(Scheduler._make_room, "while self._extra_blocks", "return self.allocator.num_free")

# %% [markdown]
# Three requests, 6 blocks of 4 tokens: A and B (6-token prompts, 6 new tokens each) need 3 blocks
# apiece at full length, so C (3 + 4 tokens) cannot stay.

# %%
# NBVAL_CHECK_OUTPUT
pre = Scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=12, enable_prefix_caching=False)
pre_reqs = named_requests([("A", 6, 6), ("B", 6, 6), ("C", 3, 4)])
pre_steps = serve(pre, {0: pre_reqs})
for step in pre_steps[2:7]:
    show_step(step)

# %%
A, B, C = pre_reqs
victim_step = next(s for s in pre_steps if s.preempted)
assert victim_step.preempted == [C] and C.num_preemptions == 1
computed_by_C = sum(c.num_tokens for s in pre_steps for c in s.chunks if c.request is C)
print(f"C computed {computed_by_C} tokens for a sequence of {len(C.prompt_token_ids)} + "
      f"{len(C.output_token_ids)} tokens: the recompute cost of its preemption")
# without the preemption: 3 prompt tokens + 3 outputs fed back; with it, 4 of those computed twice
assert computed_by_C == (3 + 3) + 4
assert all(r.is_finished for r in pre_reqs) and pre.allocator.num_free == 6

# %% [markdown]
# In step 4, A and B each need a new block and only one is free: C, the newest, is preempted and
# both fit. C waits at the head of the queue (skipped while its 5 tokens need 2 blocks) until A and
# B finish, then computes its 3 prompt tokens *and both earlier outputs* in one 5-token chunk. With
# prefix caching on, the full blocks of a preempted request often survive in the cache, and the
# recompute shrinks to a prefix hit.
#
# **Swapping** is the other way out: copy the victim's blocks to CPU memory and copy them back
# later, instead of recomputing. It trades compute for transfers. For the article's teaching model
# the bytes are easy to count, and chapter 06's roofline cost model prices both ways out. A swap
# moves the bytes out and back over PCIe 4.0 x16 (16 GT/s on 16 lanes with 128b/130b encoding:
# 31.5 GB/s each way, the link of an RTX 4090; a datasheet peak, as the cost model's are); a
# recompute is one prefill of the same tokens on the RTX 4090 of the cost model (the teaching
# model with Llama-3-8B's weights).

# %%
# NBVAL_CHECK_OUTPUT
from labkit.costmodel import CostModel

per_token = capacity.TEACHING_MODEL.bytes_per_token()
PCIE4_X16 = 16e9 * 16 / 8 * 128 / 130  # bytes/s each way
rtx4090 = CostModel("teaching model", "RTX 4090 (24 GiB)")
print(f"{'tokens':>7} {'K/V bytes':>10} {'swap out + in':>14} {'recompute (prefill)':>20}")
ratios = []
for tokens in (2_048, 8_192, 32_768):
    swap_s = 2 * tokens * per_token / PCIE4_X16
    recompute_s = rtx4090.prefill_time(tokens)
    print(f"{tokens:>7,} {format_bytes(tokens * per_token):>10} {swap_s * 1e3:>11.0f} ms {recompute_s * 1e3:>17.0f} ms")
    ratios.append(swap_s / recompute_s)
assert all(r < 0.1 for r in ratios) and ratios == sorted(ratios, reverse=True)  # "about a tenth", then less
assert 8_192 * per_token == 2**30 and round(PCIE4_X16 / 1e9, 1) == 31.5

# %% [markdown]
# On these datasheet figures a swap takes under a tenth of the recompute's time, and the gap grows
# with the length, since attention makes a prefill grow faster than linearly while the bytes grow
# linearly. The swap has other costs: it holds that much CPU memory, competes for the link with
# everything else the server moves, and its copies must be scheduled around the steps. vLLM's v1
# engine recomputes: `Scheduler._preempt_request` (`vllm/v1/core/sched/scheduler.py`, vLLM 0.33.0)
# frees the request's blocks and sets its `num_computed_tokens` to 0. Either way, preemption is a
# cost the pool size decides: chapter 06 measures it.
#
# ## Admitting a whole prompt: vLLM's gate
#
# The article's pass asks a waiting request only for the blocks of the chunk it computes *now*.
# With chunked prefill and a tight pool that invites trouble: a 600-token prompt admitted with a
# 256-token chunk takes 16 blocks, the next step 16 more, and when the pool runs dry halfway
# through its prompt, someone is preempted, and the chunks already computed for it are thrown
# away. vLLM refuses to start what it cannot finish: `SchedulerConfig.scheduler_reserve_full_isl`
# (`vllm/config/scheduler.py`, vLLM 0.33.0) is `True` by default, and the scheduler's waiting loop
# passes it to `KVCacheManager.allocate_slots` as `full_sequence_must_fit`
# (`vllm/v1/core/kv_cache_manager.py`). A waiting request is then admitted only when the blocks for
# its whole known sequence (its prompt, and for a preempted request the outputs it had, less its
# prefix hit) are free; otherwise admission stops for the step. Only the first chunk is allocated:
# the gate checks, it does not reserve. labkit's `Scheduler` does the same by default
# (`full_sequence_must_fit=True`); `False` is the article's chunk-only rule.
#
# The same workload both ways: 24 prompts of 300 to 700 tokens arriving 0 to 2 steps apart, 8 to
# 63 new tokens each, a pool of 64 blocks of 16 tokens (1,024 slots), prefix caching off, and two
# token budgets. Each step is timed with chapter 06's roofline model of the teaching model on an
# RTX 4090 (`rtx4090` above), so that the first-token times (TTFT) count what the steps computed,
# recomputed tokens included.

# %%
# NBVAL_CHECK_OUTPUT
def long_prompts(seed=0, n=24):
    """{arrival step: [Request]}: long prompts, a few short answers."""
    rng = np.random.default_rng(seed)
    arrivals, t = {}, 0
    for i in range(n):
        prompt = rng.integers(0, 1000, int(rng.integers(300, 700))).tolist()
        arrivals.setdefault(t, []).append(Request(prompt, int(rng.integers(8, 64)), request_id=f"R{i}"))
        t += int(rng.integers(0, 3))
    return arrivals


def gate_run(gate, budget):
    """Serve long_prompts() with or without the gate; time every step with the cost model."""
    arrivals = long_prompts()
    sched = Scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=budget, enable_prefix_caching=False,
                      full_sequence_must_fit=gate)
    clock, t, arrived, first, timeline = 0.0, 0, {}, {}, []
    while sched.has_unfinished() or any(k >= t for k in arrivals):
        for r in arrivals.get(t, []):
            sched.add_request(r)
            arrived[r.request_id] = clock
        t += 1
        step = sched.schedule()
        if step.chunks:
            clock += rtx4090.step([(c.start, c.num_tokens) for c in step.chunks]).time_s
        for c in step.sampling_chunks:
            first.setdefault(c.request.request_id, clock)
        sched.postprocess(step, [0] * len(step.sampling_chunks))
        timeline.append((clock, step.stats.used_blocks, len(step.preempted), step.num_tokens))
    reqs = [r for rs in arrivals.values() for r in rs]
    useful = sum(len(r.prompt_token_ids) + len(r.output_token_ids) - 1 for r in reqs)  # each computed once
    ttft = np.array([first[r.request_id] - arrived[r.request_id] for r in reqs])
    return dict(preemptions=sum(p for *_, p, _ in timeline), recomputed=sum(n for *_, n in timeline) - useful,
                ttft=ttft, makespan=clock, timeline=np.array(timeline))


gate_runs = {(gate, budget): gate_run(gate, budget) for budget in (256, 64) for gate in (True, False)}
print(f"{'budget':>6}  {'admission':<22}{'preemptions':>12}{'recomputed':>11}{'TTFT p50':>10}{'TTFT p90':>10}"
      f"{'all served':>11}")
for (gate, budget), g in gate_runs.items():
    print(f"{budget:>6}  {'whole sequence (vLLM)' if gate else 'chunk only':<22}{g['preemptions']:>12}"
          f"{g['recomputed']:>11,}{np.percentile(g['ttft'], 50):>9.2f}s{np.percentile(g['ttft'], 90):>9.2f}s"
          f"{g['makespan']:>10.2f}s")
on, off = gate_runs[True, 256], gate_runs[False, 256]
assert on["preemptions"] == on["recomputed"] == 0 and off["preemptions"] > 100 and off["recomputed"] > 30_000
assert np.percentile(on["ttft"], 50) < np.percentile(off["ttft"], 50) and on["makespan"] < off["makespan"]
on64, off64 = gate_runs[True, 64], gate_runs[False, 64]
assert on64["preemptions"] == 0 and off64["preemptions"] > 50 and off64["recomputed"] > 10_000
assert off64["makespan"] < on64["makespan"] and np.percentile(off64["ttft"], 50) < np.percentile(on64["ttft"], 50)

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
for (gate, budget), g in gate_runs.items():
    if budget != 256:
        continue
    tl, label = g["timeline"], "whole sequence (vLLM)" if gate else "chunk only"
    ax1.step(tl[:, 0], np.cumsum(tl[:, 2]), where="post", label=label)
    ax2.plot(np.sort(g["ttft"]), np.arange(1, len(g["ttft"]) + 1) / len(g["ttft"]), drawstyle="steps-post", label=label)
ax1.set_xlabel("time (s, roofline model)")
ax1.set_ylabel("preemptions so far")
ax1.set_title("Preemptions, budget 256 (roofline)")
ax2.set_xlabel("time to first token (s, roofline model)")
ax2.set_ylabel("share of requests")
ax2.set_title("TTFT, budget 256 (roofline)")
for ax in (ax1, ax2):
    ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# With a budget of 256 tokens, the chunk-only rule admits prompt after prompt piece by piece, runs
# the pool dry, and preempts over and over: the preemptions and the tens of thousands of tokens
# computed twice in the table. The gate keeps a prompt in the queue until all its blocks are free:
# no request is preempted, nothing is computed twice, and the first tokens come *earlier*, because
# the steps no longer carry work that is thrown away. That is the over-admission and "KV cache
# thrashing with chunked prefill" that vLLM's docstring names as the reason for the default.
#
# The gate is not free in every regime. With a budget of 64 tokens the waste still happens without
# the gate (the second pair of rows), but it costs less time: a 64-token chunk adds little to a step
# that reads all the weights anyway, and the chunk-only rule keeps more requests decoding at once,
# so there its first tokens come sooner and it serves the whole workload sooner. The gate buys
# predictability, and saves compute whenever the steps are not almost free: an admitted
# request is not preempted for want of its own prompt's blocks. It is not a reservation of the
# *answer*: the outputs a request will produce are not counted, so a request can still be
# preempted while it decodes (chapter 06 sees it happen).
#
# ### labkit's scheduler against vLLM's own
#
# How close are the two schedulers, rule for rule? `benchmarks/vllm_scheduler.py` serves the same
# random workloads (shared system prompts, exact repeats, long documents, stop tokens, caching on
# and off, `max_num_seqs` 4 to 256, budgets 64 to 2,048, pools that preempt) with labkit's
# `Scheduler` and with vLLM 0.33.0's real v1 `Scheduler`, built as vLLM's own tests build it
# (`tests/v1/core/utils.py: create_scheduler`, async scheduling off, a fake model runner whose
# output tokens are fixed by request and position), and compares every step. Its table ships with
# the repository (command: `python benchmarks/vllm_scheduler.py --vllm-src /tmp/vllm_src`, with
# vLLM's unzipped wheel; vLLM is never a dependency of labkit):

# %%
# NBVAL_CHECK_OUTPUT
from pathlib import Path

CONFORMANCE = next((p / "benchmarks" / "results" / "vllm_scheduler_2026-11-30.md"
                    for p in (Path.cwd(), *Path.cwd().parents)
                    if (p / "benchmarks" / "results" / "vllm_scheduler_2026-11-30.md").exists()), None)
if CONFORMANCE is None:  # a pip install (Colab) has labkit but not the repository's benchmarks/
    print("benchmarks/results/vllm_scheduler_2026-11-30.md ships with the repository: clone it to see this table.")
else:
    tables = CONFORMANCE.read_text().split("```")[1::2]  # this labkit, then the commit before issue 19
    for label, table in zip(["labkit now", "labkit before (chunk-only admission)"], tables):
        rows = table.strip().splitlines()
        print(f"{label}:\n{rows[0]}\n{rows[-1]}")
    assert "100.0%" in tables[0].strip().splitlines()[-1]

# %% [markdown]
# Every step schedules the same requests with the same token counts, every admission finds the same
# prefix hit, the same requests are preempted in the same steps, and every request finishes in the
# same step as in vLLM. Before the gate, labkit preempted about five times as often as vLLM on the
# same workloads (the second pair of lines), and agreed on fewer than two steps in three. Switching
# the gate off (`full_sequence_must_fit=False`) brings that older table back cell for cell: on these
# workloads the gate is the whole difference. What the comparison leaves out is what
# `create_scheduler` leaves off: multimodal inputs, LoRA, speculative decoding, KV connectors,
# structured output, asynchronous scheduling, and vLLM's priority policy (labkit's `priority` key
# reorders the queue, but still preempts the newest request).
#
# ## A small engine
#
# Now the whole book in one loop. `labkit.engine.Engine` holds a `Decoder` (chapter 01), one K/V
# pool per layer shaped `[num_blocks, block_size, num_kv_heads, head_dim]` (chapter 03), and a
# `Scheduler` with its prefix cache (chapters 04 and 05). Each `step()`:
#
# 1. asks the scheduler for a `Step`: chunks of tokens, their positions and slot mappings, the
#    block tables, copy-on-write pairs;
# 2. copies the shared tail blocks that must become private (every layer);
# 3. flattens every chunk's tokens into one batch `[1, total_tokens]` with explicit positions;
# 4. runs the decoder once; in each layer `attend` calls `write_kv` and then the paged attention
#    kernel, request `i` owning query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]` (a decode token is
#    simply a chunk of length 1);
# 5. takes the argmax at the last token of every chunk that reached the end of its prompt, and
#    hands the new tokens back to `scheduler.postprocess`.
#
# The attention backend, `KVPool.attend`, is where the model meets the pool. It picks the Triton
# kernels or their PyTorch references once, by a flag of the pool:

# %%
excerpt(labkit.cache.KVPool.attend, "write_kv = ", "prefill = ")

# %% [markdown]
# and then does two things per layer: scatter the new keys and values into their slots (the slot
# mapping the scheduler assigned), and attend over each request's blocks. A step that holds only
# decode tokens takes the decode kernel (one query per request); any prompt chunk in the step takes
# the prefill kernel, which handles queries of every length, a decode token included:

# %%
excerpt(labkit.cache.KVPool.attend, "write_kv(flat(k)", "out = prefill(")

# %% [markdown]
# A research assistant's load: four questions about the same 24-token report, in a pool of 24
# blocks of 4 tokens, with a budget of 16 tokens per step. (Small, because without a GPU the
# Triton kernels run in the interpreter.)

# %%
cpu = labkit.RUNTIME.triton_mode != "compiled"
cfg = DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
model = Decoder.random(cfg, seed=0).to(labkit.DEVICE)
gen = torch.Generator().manual_seed(0)
report = torch.randint(0, cfg.vocab_size, (24,), generator=gen).tolist()
questions = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (3, 5, 2, 4)]
prompts = [report + q for q in questions]
NEW = 5

POOL = 24
engine = Engine(model, num_blocks=POOL, block_size=4, max_num_batched_tokens=16)
served = [engine.add_request(p, NEW) for p in prompts]  # in arrival order
steps = []
while engine.has_unfinished():
    steps.append(engine.step())
outputs = [r.output_token_ids for r in served]
print(f"{len(engine.stats)} steps; attention ran {engine.backend.kernel_backend()}")

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'step':>4}{'tokens':>8}{'prefill':>9}{'decode':>8}{'prefix hits':>13}{'free blocks':>13}"
      f"{'preempted':>11}{'finished':>10}")
for s in engine.stats:
    print(f"{s.step:>4}{s.scheduled_tokens:>8}{s.prefill_tokens:>9}{s.decode_tokens:>8}{s.prefix_hit_tokens:>13}"
          f"{s.free_blocks:>13}{s.preemptions:>11}{s.finished:>10}")
for i, r in enumerate(served):
    print(f"request {i}: {r.num_cached_tokens:>2} of {len(r.prompt_token_ids)} prompt tokens from the prefix cache")
hits = sum(s.prefix_hit_tokens for s in engine.stats)
assert hits == sum(r.num_cached_tokens for r in served) > 0

# %% [markdown]
# The first request computes the report, 16 tokens per step. A full block gets its name as soon as
# a step schedules its last token, before the model runs, as in vLLM (`KVCacheManager.allocate_slots`
# calls `cache_blocks`, vLLM 0.33.0): the forward pass writes every chunk's K/V of a layer before any
# chunk attends, so a request admitted in that same step already reads them. So even the request
# admitted while the report is still being computed reuses all of the report's full blocks:

# %%
report_blocks = len(report) // 4
print(f"the report fills {report_blocks} blocks ({report_blocks * 4} tokens); prefix hits per request, "
      f"in arrival order: {[r.num_cached_tokens for r in served]} tokens")
assert [r.num_cached_tokens for r in served][1:] == [report_blocks * 4] * (len(served) - 1)

# %% [markdown]
# Now the proof. Chapter 01's `generate` runs each prompt alone on a contiguous cache, with plain
# PyTorch attention. The engine mixed the prompts in one batch, cut prompts into chunks, reused
# the report's blocks, and ran Triton kernels. The tokens must be identical:

# %%
alone = [generate(model, p, NEW).tokens for p in prompts]
for p, a, o in zip(prompts, alone, outputs):
    print(f"prompt of {len(p)} tokens: alone {a}  engine {o}")
assert outputs == alone
assert engine.scheduler.allocator.num_free == POOL

# %% [markdown]
# And the same work without prefix caching, and with a pool too small for everyone at once. To make
# the scheduler preempt, the small-pool runs admit by the first chunk alone (`full_sequence_must_fit=
# False`, the article's rule); one more run keeps vLLM's gate. Still the same tokens. (On a CPU these
# runs call the kernels' PyTorch references, which chapter 03 proves equal to the Triton kernels, to
# keep the chapter quick.)

# %%
def run_engine(**kw):
    e = Engine(model, block_size=4, max_num_batched_tokens=16, use_triton=not cpu, **kw)
    return e.generate(prompts, NEW), e.stats, e.backend.kernel_backend()




out_off, stats_off, backend = run_engine(num_blocks=POOL, enable_prefix_caching=False)
out_small, stats_small, _ = run_engine(num_blocks=10, full_sequence_must_fit=False)
out_small_off, stats_small_off, _ = run_engine(num_blocks=10, enable_prefix_caching=False, full_sequence_must_fit=False)
out_gated, stats_gated, _ = run_engine(num_blocks=10, enable_prefix_caching=False)
print(f"attention in the first run: {engine.backend.kernel_backend()}; in these four: {backend}")
computed = {}
for label, st in [("24 blocks, caching on", engine.stats), ("24 blocks, caching off", stats_off),
                  ("10 blocks, caching on", stats_small), ("10 blocks, caching off", stats_small_off),
                  ("10 blocks, caching off, gate", stats_gated)]:
    computed[label] = sum(s.scheduled_tokens for s in st)
    print(f"{label:<29}: {len(st):>2} steps, {computed[label]:>3} tokens computed, "
          f"{sum(s.preemptions for s in st)} preemptions")
assert out_off == alone and out_small == alone and out_small_off == alone and out_gated == alone
assert computed["24 blocks, caching off"] > computed["24 blocks, caching on"]
assert sum(s.preemptions for s in stats_small) > 0 and sum(s.preemptions for s in stats_small_off) > 0
assert sum(s.preemptions for s in stats_gated) == 0
assert computed["10 blocks, caching off, gate"] == computed["24 blocks, caching off"]
assert len(stats_gated) <= len(stats_small_off)  # no recompute, and no more steps
recompute = computed["10 blocks, caching off"] - computed["24 blocks, caching off"]
hidden = computed["10 blocks, caching on"] - computed["24 blocks, caching on"]
print(f"tokens the preemptions cost: {recompute} with caching off, {hidden} with caching on")
assert recompute > hidden >= 0

# %% [markdown]
# Prefix caching cut the tokens computed; the small pool with chunk-only admission forced
# preemptions. With caching off, the preempted requests computed their prompts and earlier outputs
# again: the extra tokens printed above are the price of recompute. With caching on, most of a
# preempted request's full blocks were still in the cache when it came back, so its preemptions
# cost only the few tokens printed beside it: the prefix cache absorbs the recompute, which is why
# the caching-off runs are the ones that show it. With vLLM's gate the small pool takes the prompts
# nearly one at a time: nothing is preempted or computed twice, and it needs no more steps.
# None of it changed an output token. That is the contract of every mechanism in this book: it
# changes *where* K/V live and *when* they are computed, never what attention computes.
#
# ## The engine with a real model
#
# The engine never looks inside the model: it needs a `Decoder`, and `from_pretrained` (chapter 01)
# makes one from a real model file. So the same `Engine` serves SmolLM2-135M-Instruct (the 4-bit GGUF
# file that `make setup` installs, dequantized to float32 here): four chat requests at once, which
# share a system prompt, with the model's tokenizer and chat template. A reply ends at the model's
# end-of-turn token (`eos_token_id`, `<|im_end|>` for SmolLM2; a config may list several, as Llama 3's
# chat models do, and the engine stops on any of them) or after 16 tokens; these questions ask for
# a few sentences, so here every reply reaches the limit.
#
# The pool is made tight on purpose: the four prompts fit (so vLLM's gate admits them all), but not
# the four prompts with all their replies, so the scheduler must preempt a running request on the
# way and recompute it later. On a CPU the engine calls the kernels' PyTorch references (a 30-layer
# model through Triton's interpreter would take minutes); on a GPU, the Triton kernels.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
from labkit.pretrained import chat_token_ids, from_pretrained, load_tokenizer, real_model, to_transformers

path = real_model()
real = from_pretrained(path, dtype=torch.float32, device=labkit.DEVICE)
tokenizer = load_tokenizer(path)
system = {"role": "system", "content": "You are a helpful assistant. Explain things clearly, in a few sentences."}
asks = ["How does a CPU work?", "Describe the water cycle.", "How do vaccines work?", "Why do we have seasons?"]
chat_prompts = [chat_token_ids(tokenizer, [system, {"role": "user", "content": q}]) for q in asks]
REPLY, BLOCK = 16, 16
# Blocks for the prompts alone, and for the prompts with full replies (shared system-prompt blocks once).
shortest = min(len(p) for p in chat_prompts)
common = next((i for i in range(shortest) if len({p[i] for p in chat_prompts}) > 1), shortest) // BLOCK
prompt_blocks = common + sum(-(-len(p) // BLOCK) - common for p in chat_prompts)
full_blocks = common + sum(-(-(len(p) + REPLY) // BLOCK) - common for p in chat_prompts)
tight = full_blocks - 2
assert prompt_blocks <= tight < full_blocks
real_engine = Engine(real, num_blocks=tight, block_size=BLOCK, max_num_batched_tokens=256, use_triton=not cpu)
replies = real_engine.generate(chat_prompts, REPLY)  # stops at config.eos_token_id
print(f"attention ran {real_engine.backend.kernel_backend()}")

# %%
# NBVAL_SKIP_IN_SOLUTIONS
# NBVAL_CHECK_OUTPUT
stop = real.config.eos_token_id
print(f"pool: {tight} blocks of {BLOCK} tokens; the prompts need {prompt_blocks}, prompts and full replies "
      f"{full_blocks} (the shared system-prompt block{'s' if common != 1 else ''} counted once)")
st = real_engine.stats
print(f"{len(st)} steps, {sum(s.preemptions for s in st)} preemption(s), {sum(s.prefix_hit_tokens for s in st)} "
      f"prompt tokens from the prefix cache at first admission, {sum(s.preempted_hit_tokens for s in st)} re-found "
      f"after a preemption (vLLM counts those apart), {sum(s.scheduled_tokens for s in st)} tokens computed for "
      f"{sum(map(len, chat_prompts))} prompt and {sum(map(len, replies))} reply tokens")
print(f"replies: {[len(r) for r in replies]} tokens; {sum(r[-1] == stop for r in replies)} ended at <|im_end|>, "
      f"the others at the limit of {REPLY}")
assert sum(s.preemptions for s in st) > 0

# %% [markdown]
# The replies, and the check that makes them trustworthy: transformers' own Llama implementation
# (`to_transformers` hands it the same tensors) generates each reply alone, greedily, with its
# own attention and its own cache. Batching, chunking, prefix reuse, paging and the preemption
# must not have changed a single token:

# %%
# NBVAL_SKIP_IN_SOLUTIONS
reference = to_transformers(real)
for q, p, r in zip(asks, chat_prompts, replies):
    ids = torch.tensor([p], device=labkit.DEVICE)
    alone_hf = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=REPLY, do_sample=False,
                                  eos_token_id=stop, pad_token_id=stop)[0, len(p):].tolist()
    assert r == alone_hf, q
    print(f"{q}\n  -> {tokenizer.decode(r, skip_special_tokens=True)!r} ({len(r)} tokens)")
print("engine == transformers' generate, token for token, for all four requests")

# %% [markdown]
# ### More requests than slots
#
# Continuous batching (Orca, vLLM) pays off when requests outnumber the slots and their lengths
# vary: a static batch holds its slots until its longest member ends; the engine hands a freed slot
# to a waiting request at the next step. `benchmarks/real_model.py --workload 64` measures it on this
# model: 64 chat requests, outputs of 8 to 128 tokens, at most 16 running on both sides, against
# transformers' `generate` in static batches of 16 in arrival order. It runs for minutes; the
# chapter reads its committed results.

# %%
# NBVAL_CHECK_OUTPUT
import json
from pathlib import Path

BATCHING = next((sorted((p / "benchmarks" / "results").glob("real_model_64_*.json"))[-1]
                 for p in (Path.cwd(), *Path.cwd().parents)
                 if list((p / "benchmarks" / "results").glob("real_model_64_*.json"))), None)
if BATCHING is None:  # a pip install (Colab) has labkit but not the repository's benchmarks/
    print("benchmarks/results/real_model_64_*.json ships with the repository: clone it to see this table.")
else:
    bench = json.loads(BATCHING.read_text())
    runs = {}
    for r in bench["runs"]:  # the run of median wall time, per side and arrival pattern
        runs.setdefault((r["side"], r["arrivals"]), []).append(r)
    runs = {k: sorted(v, key=lambda r: r["wall_s"])[(len(v) - 1) // 2] for k, v in runs.items()}
    print(f"{bench['command']} ({bench['date']}); {len(bench['lengths'])} requests, {sum(bench['lengths'])} "
          f"output tokens, {bench['slots']} slots; Poisson rate {bench['poisson_rate']:.2f} requests/s")
    print(f"{'side':<16}{'arrivals':<9}{'wall s':>8}{'tokens/s':>10}{'steps':>7}{'ms/step':>9}"
          f"{'done mean':>11}{'done p90':>10}{'TTFT p50':>10}{'TTFT p90':>10}")
    for (side, arrivals), r in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{side:<16}{arrivals:<9}{r['wall_s']:>8.1f}{r['tokens_per_s']:>10.1f}{r['steps']:>7}"
              f"{r['ms_per_step']:>9.0f}{r['done_mean_s']:>11.1f}{r['done_p90_s']:>10.1f}{r['ttft_p50_s']:>10.2f}"
              f"{r['ttft_p90_s']:>10.2f}")
    eng, sta = runs["engine", "closed"], runs["static batches", "closed"]
    print(f"steps: static {sta['steps']} = {' + '.join(map(str, bench['batch_longest']))} (each batch's longest "
          f"member), engine {eng['steps']}: {sta['steps'] / eng['steps']:.2f}x fewer; a step costs "
          f"{eng['ms_per_step'] / sta['ms_per_step']:.2f}x as much; speed-up "
          f"{eng['tokens_per_s'] / sta['tokens_per_s']:.2f}x")
    assert sta["steps"] == sum(bench["batch_longest"]) > eng["steps"]
    assert bench["tokens_equal_static"] == len(bench["lengths"])
    assert runs["engine", "poisson"]["ttft_p90_s"] < runs["static batches", "poisson"]["ttft_p90_s"]

# %% [markdown]
# A static batch takes as many steps as its longest member; the engine's speed-up is the step
# ratio divided by the ratio of step costs. The figure shows the slots doing useful work.

# %%
if BATCHING is not None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2), sharey=True)
    for ax, arrivals in zip(axes, ("closed", "poisson")):
        for side, color in (("engine", "C0"), ("static batches", "C1")):
            t = bench["traces"][f"{side} {arrivals}"]
            ax.step(t["step_end"], t["busy"], where="pre", color=color, label=side)
        ax.set_title("all 64 at once" if arrivals == "closed" else "Poisson arrivals")
        ax.set_xlabel("seconds")
    axes[0].set_ylabel("slots computing a useful token")
    axes[0].legend()
    plt.show()
    static_busy = bench["traces"]["static batches closed"]["busy"]
    engine_busy = bench["traces"]["engine closed"]["busy"]
    print(f"mean slots in use per step: engine {np.mean(engine_busy):.1f}, static batches "
          f"{np.mean(static_busy):.1f} of {bench['slots']}")
    assert np.mean(engine_busy) > np.mean(static_busy)
    drop = next(k for k, b in enumerate(engine_busy) if b < bench["slots"])  # the queue has run dry
    assert all(a >= b for a, b in zip(engine_busy[drop:], engine_busy[drop + 1:]))

# %% [markdown]
# In a static batch the useful slots fall like a staircase as short requests end, and a new batch
# starts only at the bottom. The engine stays at 16 until the queue runs dry, then only falls. With
# Poisson arrivals a static batch also waits to fill before its first token: its TTFT shows it.


# %% [markdown]
# ## Summary
#
# - A step has two budgets: tokens (compute) and free blocks (memory). `plan_iteration` gives each
#   candidate `min(num_new_tokens, budget)` tokens, stops when the budget is spent, and skips a
#   candidate whose `extra_blocks` do not fit.
# - Skipping lets small requests overtake a large one, forever under a steady stream. labkit's
#   `Scheduler`, like vLLM, stops admitting at the first waiting request that does not fit:
#   no starvation, at the cost of a longer wait for the small ones.
# - `extra_blocks` counts the new blocks for the slots, a private copy of a shared, partly filled
#   tail (copy-on-write), and cached blocks revived from the free queue by a prefix hit.
# - Long prompts are split across steps (chunked prefill), and one step mixes prompt chunks with
#   decode tokens.
# - A full block gets its prefix-cache name when a step schedules it, as in vLLM, so a request
#   admitted in the same step already shares it; finished requests release their blocks, and
#   blocks still shared, or cached, stay.
# - The candidate order decides who gets memory first; paging has no notion of priority.
# - A waiting request is admitted only when blocks for its whole known sequence are free, as in
#   vLLM (`scheduler_reserve_full_isl`, on by default): with chunked prefill and a tight pool,
#   admitting by the first chunk alone preempts over and over and computes prompts twice.
# - On the same workloads, labkit's `Scheduler` and vLLM 0.33.0's own v1 `Scheduler` schedule the
#   same tokens for the same requests in every step, with the same hits, preemptions and finishes
#   (`benchmarks/vllm_scheduler.py`).
# - When a running request cannot grow, the newest is preempted and recomputed later (vLLM v1 does
#   the same). With caching off the recompute shows in the tokens computed; with caching on, the
#   prefix cache absorbs most of it. Swapping to CPU memory is the alternative: on datasheet figures
#   it takes under a tenth of the recompute's time for the teaching model, but holds CPU memory.
# - The engine built from chapters 01 to 05 gives exactly the tokens of generating each prompt
#   alone, with batching, chunking, prefix reuse and preemption all at work.
# - The same engine serves a real model (SmolLM2-135M-Instruct, `from_pretrained`) unchanged, in a
#   pool tight enough to preempt, stops each reply at the model's end-of-turn token, and gives
#   transformers' greedy tokens, token for token.
#
# Chapter 06 drives this same `Scheduler` with synthetic requests and a cost model to ask the next
# question: fitting in memory is one thing; serving fast enough is another.

# %% [markdown]
# ## Exercises

# %%
from labkit.exercises import Exercises, hidden_rng

ex = Exercises("05_scheduler")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/ a failing checker fails the notebook tests

# %% [markdown]
# **Exercise 1.** Write `blocks_to_take(num_computed, held, tokens, block_size, shared_tail)`: the
# free blocks a request that has computed `num_computed` tokens and holds `held` blocks uses to
# compute `tokens` more, when `shared_tail` says whether another request shares its tail block.
# A request may hold more blocks than its computed tokens fill (a reservation gave it some ahead).
# Mind the block boundaries, and remember when a shared tail really must be copied. (No prefix hits
# here; do not call `labkit`: the checker refuses its block counts, and draws its cases afresh on
# every run.)

# %%
def blocks_to_take(num_computed, held, tokens, block_size, shared_tail):
    # BEGIN SOLUTION
    if tokens == 0:
        return 0
    new = max(0, -(-(num_computed + tokens) // block_size) - held)
    copy = 1 if shared_tail and num_computed % block_size else 0
    return new + copy
    # END SOLUTION


from labkit import vllm
from labkit.paging import BlockTable
from labkit.pool import PoolPlan
from labkit.prefix import PrefixCache, _extra_blocks  # extra_blocks without its checks: refused in answers too


def ex1_cases() -> list:
    """Two block sizes drawn afresh; a request with nothing computed, a full tail and a partly filled one;
    no token, one, exactly the rest of the tail, and many; shared tail or not. It holds the blocks its
    computed tokens fill, sometimes one or two more (a reservation); and once, for each block size,
    one more with many tokens to come."""
    rng = hidden_rng()
    cases = []
    for bs in (rng.randint(2, 8), rng.randint(9, 32)):
        k = rng.randint(1, 6)
        for computed in (0, k * bs, k * bs + rng.randint(1, bs - 1)):
            tail = -computed % bs  # free slots in the last block
            for tokens in (0, 1, tail or bs, rng.randint(bs + 1, 4 * bs)):
                for shared in (False, True):
                    held = blocks_needed(computed, bs) + rng.choice((0, 0, 1, 2))
                    cases.append((computed, held, tokens, bs, shared))
        computed = k * bs + rng.randint(1, bs - 1)
        cases.append((computed, blocks_needed(computed, bs) + 1, 2 * bs, bs, False))  # a reserved block to use
    return [(args, extra_blocks(*args[:4], shared_tail=args[4])) for args in cases]


ex.check_function("Exercise 1", blocks_to_take, ex1_cases(),
                  hint="new blocks = ceil((num_computed + tokens) / block_size) - held; a copy only for a partly "
                       "filled shared tail.",
                  forbid=[extra_blocks, _extra_blocks, blocks_needed, vllm._blocks_per_request, BlockTable,
                          PrefixCache, PoolPlan])

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** After the step the request holds `ceil((num_computed + tokens) / block_size)`
# blocks, so the new ones are that less what it holds (never negative: a decode token that fits in
# the tail needs none). A copy is owed only when the next token lands in a *partly* filled tail that
# someone else holds (`num_computed % block_size != 0`); a full shared block is never written again.

# %% [markdown]
# **Exercise 2.** One iteration by hand. Blocks hold 4 tokens; 3 blocks are free; the token budget
# is 10. The candidates, in order:
#
# | request | computed | blocks held | num_new_tokens | shared tail |
# |---|---|---|---|---|
# | P | 7 | 2 | 1 | yes |
# | Q | 8 | 2 | 1 | no |
# | R | 0 | 0 | 9 | no |
# | S | 0 | 0 | 4 | no |
# | T | 0 | 0 | 2 | no |
#
# Which requests get tokens this step, and how many? Answer as a list of `(name, tokens)` pairs in
# the order `plan_iteration` plans them.

# %%
# BEGIN SOLUTION
# P: 1 token, tail shared and partly filled (7 % 4 = 3) -> 1 copy; free 2, budget 9
# Q: 1 token at position 8 -> a new block; free 1, budget 8
# R: min(9, 8) = 8 tokens -> 2 blocks > 1 free: skipped
# S: 4 tokens -> 1 block; free 0, budget 4
# T: 2 tokens -> 1 block > 0 free: skipped
answer_2 = [("P", 1), ("Q", 1), ("S", 4)]
# END SOLUTION
# BEGIN STUB
answer_2 = None  # e.g. [("P", 1), ...]
# END STUB
ex2_rows = {"P": (7, 2, 1, True), "Q": (8, 2, 1, False), "R": (0, 0, 9, False), "S": (0, 0, 4, False),
            "T": (0, 0, 2, False)}  # name: (computed, blocks held, num_new_tokens, shared tail), as in the table
ex2 = named_requests([(name, computed + chunk, 8) for name, (computed, _, chunk, _) in ex2_rows.items()])
for r in ex2:
    r.num_computed_tokens = ex2_rows[r.request_id][0]


def ex2_needed(r, tokens):
    computed, held, _, shared = ex2_rows[r.request_id]
    return extra_blocks(computed, held, tokens, 4, shared_tail=shared)


ex.check("Exercise 2", answer_2, expected=planned(plan_iteration(ex2, 3, 10, 4, needed=ex2_needed)),
         hint="Work through the candidates in order, keeping the free blocks and the budget left.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** The pass keeps two running totals and visits the candidates once, in order.
# R loses to the blocks while budget remains (its 8 tokens need 2 blocks, 1 is free), so it is
# skipped, not a stop, and S behind it still fits; T, with budget left too, then finds no block.

# %% [markdown]
# **Exercise 3.** In the preemption example above, suppose C had produced 3 tokens (not 2) before it
# was preempted. How many tokens must it compute in the chunk that brings it back (prefix caching
# off)? Answer with a number.

# %%
# BEGIN SOLUTION
answer_3 = 3 + 3  # its prompt and every output: the last output's K/V were never computed either
# END SOLUTION
# BEGIN STUB
answer_3 = None  # replace None with your answer
# END STUB
ex3 = Request([1, 2, 3], 8)  # a preempted request holds nothing and has computed nothing
ex3.output_token_ids = [7, 7, 7]
ex.check("Exercise 3", answer_3, expected=ex3.num_new_tokens,
         hint="After a preemption nothing is computed: num_new_tokens = prompt + outputs.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** Recompute drops every block, so `num_computed_tokens` falls to 0 and the
# request must compute all its known tokens again: the 3 prompt tokens and the 3 outputs. The last
# output's K/V did not exist before the preemption either (a sampled token is fed to the model in
# the step after), so it belongs in the chunk like the others, and the chunk that ends at it samples
# the next token.

# %% [markdown]
# **Exercise 4 (a scheduling policy).** The `PriorityScheduler` takes a `priority`: a key function of a
# `Request`, used to sort the waiting queue before every step (smaller first). Write
# `shortest_prompt_first(request)` so that requests with shorter prompts are admitted first. The
# checker serves nine requests of consecutive prompt lengths (between 8 and 22 tokens, random
# token ids, drawn afresh on every run) that all arrive at once, in a pool with room for all of
# them but a token budget of only 20 tokens per step, so that the prompts start about one per step
# and their order shows. It does so for two arrival orders (longest first, and shuffled), records
# the order in which the requests are admitted (their first chunk), and checks that it is the
# order of prompt length, token for token; and, for longest first, that the mean step of the first
# tokens comes sooner than first come, first served.

# %%
def shortest_prompt_first(request: Request):
    # BEGIN SOLUTION
    return len(request.prompt_token_ids)
    # END SOLUTION
    # BEGIN STUB
    raise NotImplementedError("your code here")
    # END STUB


def ex4_arrivals() -> dict[str, list[list[int]]]:
    """Nine prompts of consecutive lengths from a random start, of random token ids, in two arrival
    orders: longest first, and shuffled."""
    rng = hidden_rng()
    start = rng.randint(8, 14)
    lengths = list(range(start, start + 9))
    shuffled = lengths.copy()
    while shuffled == lengths:
        rng.shuffle(shuffled)
    prompts = {n: [rng.randrange(1, 50_000) for _ in range(n)] for n in lengths}
    return {"longest first": [prompts[n] for n in reversed(lengths)], "shuffled": [prompts[n] for n in shuffled]}


def admissions(priority, prompts: list[list[int]]) -> tuple[list[int], float]:
    """Serve these prompts, all arriving at step 0: the prompt lengths in the order the scheduler
    admitted them (across steps, and within a step in its planning order), and the mean step of
    the first tokens."""
    cls, key = (Scheduler, {}) if priority is None else (PriorityScheduler, {"priority": priority})
    sched = cls(num_blocks=128, block_size=4, max_num_batched_tokens=20, enable_prefix_caching=False, **key)
    for prompt in prompts:
        sched.add_request(list(prompt), 2)
    admitted, first = {}, {}
    while sched.has_unfinished():
        step = sched.schedule()
        for c in step.chunks:  # dicts keep insertion order: the first chunk of each request, in order
            admitted.setdefault(c.request.request_id, len(c.request.prompt_token_ids))
        for c in step.sampling_chunks:
            first.setdefault(c.request.request_id, sched.num_steps)
        sched.postprocess(step, [0] * len(step.sampling_chunks))
    return list(admitted.values()), float(np.mean(list(first.values())))


def check_policy(fn) -> list[str]:
    problems = []
    for name, prompts in ex4_arrivals().items():
        lengths = [len(p) for p in prompts]
        (order, mean_first), (_, mean_fcfs) = admissions(fn, prompts), admissions(None, prompts)
        if order != sorted(lengths):
            problems.append(f"arrival order {name} {lengths}: admitted in the order {order}")
        elif name == "longest first" and mean_first >= mean_fcfs:
            problems.append(f"arrival order {name}: first tokens at step {mean_first:.2f} on average, "
                            f"first come first served {mean_fcfs:.2f}")
    return problems


ex.check_behaviour("Exercise 4", shortest_prompt_first, check_policy,
                   hint="the key is compared with < : return something that grows with the prompt's length, "
                        "one token at a time.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** The scheduler sorts its waiting queue by the key before every step, and the
# prompt length in tokens orders every pair of these requests, even two that differ by one token.
# A coarser key (tens of tokens, say) ties them, the sort keeps their arrival order, and the
# checker sees that order in the admissions.

# %% [markdown]
# ## What you can now do
#
# - Plan one scheduler step by hand: give each candidate its tokens and blocks within the token
#   budget and the free blocks, and say which turns stop the pass and which are skipped.
# - Count the free blocks a step takes from the pool, new slots, a copy-on-write of a shared tail
#   and revived cached blocks included.
# - Predict what a preemption by recompute costs, and compare it with swapping on a link's datasheet
#   bandwidth.
# - Choose an admission rule (skip, head of line, whole-sequence gate) and a priority order, and
#   measure what each does to waiting times, starvation and recomputed tokens.
# - Serve real prompts through an engine built from the book's parts, and prove that batching,
#   chunking, reuse and preemption leave every token unchanged.


# %% [markdown]
# ## References
#
# - The source article: *长上下文推理中的 KV Cache：容量、分页与复用边界* ("The KV cache in
#   long-context inference: capacity, paging and the limits of reuse"), a Chinese essay in six
#   sections; the copy the book follows gives no author or link. Its §05 pass over the candidates
#   (`plan_iteration`, `extra_blocks`) carries over into this chapter; its sentences do not.
# - Woosuk Kwon, Zhuohan Li, et al., *Efficient Memory Management for Large Language Model Serving
#   with PagedAttention*, SOSP 2023, [arXiv:2309.06180](https://arxiv.org/abs/2309.06180):
#   scheduling and preemption by swapping or recomputation.
# - vLLM, the serving engine the book compares itself with: documentation at
#   [docs.vllm.ai](https://docs.vllm.ai/), code at
#   [github.com/vllm-project/vllm](https://github.com/vllm-project/vllm). This chapter read vLLM
#   0.33.0: `vllm/v1/core/sched/scheduler.py` (`Scheduler._preempt_request`) and
#   `vllm/v1/core/kv_cache_manager.py` (`KVCacheManager.allocate_slots`).
# - Gyeong-In Yu et al., *Orca: A Distributed Serving System for Transformer-Based Generative
#   Models*, OSDI 2022: iteration-level scheduling, the step-by-step batching this chapter builds.
