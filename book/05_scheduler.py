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
# **The message.** Every step spends two budgets, tokens of compute and blocks of memory: the tokens
# set how much work a step does, the blocks how many requests run at once, and when blocks run out
# the scheduler preempts a request and computes it again later.
#
# Chapters 03 and 04 built the memory; none of it says *which* request gets the next free block.
# An engine decides that once per *step*: it picks requests and a number of tokens for each, and
# the model computes them all in one batched forward pass. This chapter writes that decision down,
# runs it, and builds a small engine on it that ties the book together.
#
# **What you will learn**
#
# - how the article's `plan_iteration` spends both budgets in one pass, and what `extra_blocks` counts;
# - how to read a step: chunked prefill, decode tokens, skipped requests, the candidates' order;
# - how the pool's size decides how many requests run, and what a preemption costs;
# - how chapters 01 to 04 become one engine that changes no token.
#
# vLLM's admission rules, priority, swapping and a comparison with vLLM's scheduler are in
# [appendix A5](A5_vllm_scheduler.ipynb).

# %%
from labkit.teaching.diagrams import roadmap

roadmap("05");  # the article's pipeline, this chapter's part highlighted

# %% [markdown]
# **You need:** chapters 03 and 04: free blocks, block tables, prefix hits and copy-on-write;
# chapter 01: prefill and decode.
#
# **Time:** about 40 minutes to read and run; about 85 minutes for the exercises.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import Patch

import labkit
from labkit.caches.contiguous import generate
from labkit.memory.blocks import blocks_needed, extra_blocks
from labkit.memory.paging import BlockAllocator
from labkit.memory.prefix import PrefixCache
from labkit.model.decoder import Decoder, DecoderConfig
from labkit.serving.engine import Engine
from labkit.serving.request import Request
from labkit.serving.scheduler import Scheduler, plan_iteration
from labkit.serving.variants.priority import PriorityScheduler
from labkit.teaching.excerpts import excerpt

torch.set_num_threads(2)
print(labkit.describe())

# %% [markdown]
# ## Two budgets per step
#
# A step computes prompt tokens of new requests (prefill), one token for each request already
# generating (decode), or both. Two things bound it.
#
# - **Tokens.** Engines cap the tokens of one forward pass with a *token budget* (vLLM's
#   `max_num_batched_tokens`). A longer prompt is cut, and the rest waits: *chunked prefill*.
# - **Blocks.** Every computed token's K/V need a slot in a block the request holds *before* the
#   pass writes it.
#
# The article's §05 spends both in one pass over the candidates (quoted unchanged; `next_chunk` is
# what the request would compute next):
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
# `labkit.serving.scheduler.plan_iteration` keeps that skeleton. Its lines, read from the installed labkit;
# first the tokens each candidate asks for:

# %%
excerpt(plan_iteration, "for request in candidates", "continue  # nothing to compute now")

# %% [markdown]
# `num_new_tokens` is the rest of the prompt while a request prefills, one token while it decodes.
# A request whose last token is still being sampled is passed over (`continue`), where the article's
# `break` would end the pass for everyone behind it. Then the blocks those tokens take:

# %%
excerpt(plan_iteration, "if tokens ==", "blocks = extra_blocks(")

# %% [markdown]
# The `needed` hook lets the `Scheduler` count what only it knows (a prefix hit, a shared tail).
# Last, the decision and the two budgets it spends:

# %%
excerpt(plan_iteration, 'outcome = ("stop"', '"planned")')
excerpt(plan_iteration, 'if outcome != "planned"', "token_budget -=")

# %% [markdown]
# So: each candidate asks for `min(num_new_tokens, token_budget)` tokens; when the budget is spent
# the pass **stops** (`break`); a candidate whose blocks do not fit is **skipped** (`continue`), and
# a later, smaller one may still get in. `"preempted"` is for running requests (below).
#
# ## What a step takes from the pool: `extra_blocks`
#
# Computing `tokens` more tokens needs `ceil((num_computed_tokens + tokens) / block_size)` blocks,
# less those held. Two cases add blocks: a partly filled tail shared with another request (chapter
# 04's fork) is first copied (copy-on-write); and cached blocks of a prefix hit that nobody holds
# sit in the free queue, so reviving them uses free blocks. The first row is chapter 03's 37-token
# prompt: 3 blocks of 16; its 38th token needs none (11 empty slots in the tail).

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
# Four requests arrive together: 8 blocks of 4 tokens, a budget of 12 tokens. W has a 10-token
# prompt, X 14, Y 5 and Z 3; they want 3, 2, 2 and 3 new tokens. The `Scheduler` offers its
# *running* requests first, then its *waiting* queue in arrival order; every `Step` records each
# turn. With `head_of_line=False` it skips a waiting request that does not fit and goes on to the
# next, as the article's pass does (vLLM stops at the first one instead: appendix A5).

# %%
from labkit.serving.dry_run import dry_run, named_requests  # a scheduler run without a model: token 0 each time


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
walk_reqs = named_requests([("W", 10, 3), ("X", 14, 2), ("Y", 5, 2), ("Z", 3, 3)])
walk_steps = dry_run(walk, {0: walk_reqs})

# %%
# NBVAL_CHECK_OUTPUT
for step in walk_steps:
    show_step(step)

# %% [markdown]
# Read it step by step:
#
# - **Step 1.** W takes its 10 prompt tokens and 3 blocks; X gets the 2 tokens left (chunked
#   prefill); at Y the budget is spent: stop.
# - **Step 2.** W decodes 1 token, X continues with 11; the budget is spent again before Y.
# - **Step 3.** 1 block is free. Y needs 2: **skipped**. Z needs 1 and gets in *ahead of* Y. W
#   finishes; its blocks go back.
# - **Steps 4 and 5.** Y is admitted; everyone finishes and the pool is whole.

# %%
budget = walk.max_num_batched_tokens
assert all(s.num_tokens <= budget for s in walk_steps)
assert [c.num_tokens for c in walk_steps[0].chunks] == [10, 2]            # X's prompt is cut to fit
assert [d.outcome for d in walk_steps[2].decisions] == ["planned", "planned", "skipped", "planned"]
assert walk.allocator.num_free == walk.num_blocks                          # every block came back
assert [len(r.output_token_ids) for r in walk_reqs] == [3, 2, 2, 3]

# %% [markdown]
# ## Who gets space first: the order, not the paging
#
# The allocator hands out whichever block is free; it has no idea which request matters more.
# Priority lives in the order of the candidates. Three waiting requests, 4 free blocks, two orders:

# %%
# NBVAL_CHECK_OUTPUT
def planned(plan):
    return [(r.request_id, n) for r, n in plan]


L, S1, S2 = named_requests([("L", 12, 4), ("S1", 4, 4), ("S2", 3, 4)])  # one long prompt, two short ones
fcfs_plan = plan_iteration([L, S1, S2], free_blocks=4, token_budget=32, block_size=4)
short_plan = plan_iteration(sorted([L, S1, S2], key=lambda r: r.num_new_tokens), free_blocks=4,
                            token_budget=32, block_size=4)
print("first come, first served:", planned(fcfs_plan))
print("shortest prompt first:   ", planned(short_plan))
assert planned(fcfs_plan) == [("L", 12), ("S1", 4)]
assert planned(short_plan) == [("S2", 3), ("S1", 4)]

# %% [markdown]
# First come, first served gives L 3 of the 4 blocks and S2 waits; shortest first admits both short
# ones and L waits. Only the order changed (over a whole run: appendix A5).
#
# ## The blocks decide how many run
#
# Ten requests with prompts of 3 to 30 tokens arrive two per step, with a 16-token budget, in pools
# of several sizes. How many requests run (hold blocks) in each step?

# %%
# NBVAL_CHECK_OUTPUT
def workload():
    rng = np.random.default_rng(5)
    specs = [(f"R{i}", int(rng.integers(3, 31)), int(rng.integers(2, 9))) for i in range(10)]
    reqs = named_requests(specs)
    arrivals = {}
    for i, r in enumerate(reqs):
        arrivals.setdefault(i // 2, []).append(r)  # two new requests per step
    return reqs, arrivals


def run_pool(num_blocks):
    reqs, arrivals = workload()
    sched = Scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    return reqs, arrivals, sched, dry_run(sched, arrivals)


pools = {n: run_pool(n) for n in (10, 12, 16, 24, 32, 64)}
print(f"{'pool (blocks)':>13}{'most running':>14}{'mean running':>14}{'preemptions':>13}{'tokens computed':>17}"
      f"{'steps':>7}")
rows = {}
for n, (_, _, _, steps) in pools.items():
    running = [s.stats.num_running for s in steps]
    rows[n] = (max(running), float(np.mean(running)), sum(s.stats.preemptions for s in steps),
               sum(s.num_tokens for s in steps), len(steps))
    print(f"{n:>13}{rows[n][0]:>14}{rows[n][1]:>14.2f}{rows[n][2]:>13}{rows[n][3]:>17}{rows[n][4]:>7}")
means = [rows[n][1] for n in pools]
assert means == sorted(means) and rows[10][1] < rows[32][1] / 2  # more blocks, more requests at once
assert rows[10][2] > 0 and rows[32][2] == 0 and rows[10][3] > rows[32][3]  # a small pool preempts, recomputes
assert rows[10][4] == max(r[4] for r in rows.values())  # and takes the most steps
assert rows[32] == rows[64]  # past 32 blocks the token budget and the arrivals decide, not the pool

# %% [markdown]
# The smallest pool runs fewer than half as many requests at once, on average, as 32 blocks; it
# preempts, computes tokens twice, and takes the most steps. Past 32 blocks nothing changes: the
# token budget and the arrivals are the limit then. The 16-block run, step by step:

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


reqs_f, arrivals_f, sched_f, steps_f = pools[16]
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
# Prompt chunks share steps with decode tokens; grey cells are requests kept waiting; red marks a
# request that lost its blocks (next section). Which budget kept the grey ones waiting?

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
# Both: in some steps the token budget is spent before a waiting request's turn, in others its
# blocks do not fit.
#
# ## When blocks run out: preemption
#
# A running request needs one more block every `block_size` tokens. Skipping it is not enough: if
# each running request waited for a block only another could free, none would move. Engines
# **preempt**: when a running request does not fit, `plan_iteration` asks the scheduler to make room:

# %%
excerpt(plan_iteration, "if blocks > free_blocks and make_room", "preempted = request.status")

# %% [markdown]
# The `Scheduler` takes all the blocks of the *newest* running request and puts it at the *front*
# of the waiting queue, until the request fits or was itself the newest. This is vLLM v1's rule
# under first come, first served (`Scheduler.schedule` pops the last of its running list): the
# requests that came first keep going. The victim's K/V are
# dropped: its prompt and outputs are computed again later (**recompute**, as in vLLM v1). No
# waiting request is admitted in that step. The rule is one loop:

# %%
excerpt(Scheduler._make_room, "while self._extra_blocks", "return self.allocator.num_free")

# %% [markdown]
# Three requests, 6 blocks of 4 tokens: P and Q (6-token prompts, 6 new tokens each) need 3 blocks
# apiece, so R (3 + 4 tokens) cannot stay. This scheduler keeps vLLM's defaults: it admits a waiting
# request only when blocks for all the tokens it knows so far (its prompt plus the outputs it had
# before a preemption, at most `max_model_len`) are free, and nobody passes it in the queue
# ([appendix A5](A5_vllm_scheduler.ipynb) measures both rules).

# %%
# NBVAL_CHECK_OUTPUT
pre = Scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=12, enable_prefix_caching=False)
pre_reqs = named_requests([("P", 6, 6), ("Q", 6, 6), ("R", 3, 4)])
pre_steps = dry_run(pre, {0: pre_reqs})
for step in pre_steps[2:7]:
    show_step(step)

# %%
P, Q, R = pre_reqs
victim_step = next(s for s in pre_steps if s.preempted)
assert victim_step.preempted == [R] and R.num_preemptions == 1
computed_by_R = sum(c.num_tokens for s in pre_steps for c in s.chunks if c.request is R)
print(f"R computed {computed_by_R} tokens for a sequence of {len(R.prompt_token_ids)} + "
      f"{len(R.output_token_ids)} tokens: the recompute cost of its preemption")
# without the preemption: 3 prompt tokens + 3 outputs fed back; with it, 4 of those computed twice
assert computed_by_R == (3 + 3) + 4
assert all(r.is_finished for r in pre_reqs) and pre.allocator.num_free == 6

# %% [markdown]
# In step 4, P and Q each need a new block and one is free: R, the newest, is preempted. It waits
# (its 5 known tokens need 2 blocks) until P and Q finish, then computes its 3 prompt tokens *and
# both earlier outputs* in one chunk. With prefix caching on, its full blocks often survive in the
# cache and the recompute shrinks to a hit. Swapping to CPU memory is the other way out (A5).
#
# ## A small engine
#
# Now the whole book in one loop. `labkit.serving.engine.Engine` holds a `Decoder` (chapter 01), one K/V
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
# The attention backend, `KVPool.attend`, is where the model meets the pool. Each layer it does
# two things: scatter the new keys and values into their slots (the slot mapping the scheduler
# assigned), and attend over each request's blocks. On a GPU the Triton kernels of chapter 03 do it.
# A step that holds only decode tokens takes the decode kernel (one query per request); any prompt
# chunk in the step takes the prefill kernel, which handles queries of every length:

# %%
excerpt(labkit.caches.paged.KVPool.attend, "paged_attention.write_kv(", "meta.cu_seqlens_q")

# %% [markdown]
# On a CPU (the default there, `use_triton=None`) the same arithmetic runs in PyTorch, batched:
# layer 0 plans the pass once (`labkit.kernels.cpu.plan_batch`: every request's slots and what each
# query may see), and every layer reuses the plan for one gather and one attention call per group,
# the decode rows in one group, the prompt chunks in another:

# %%
excerpt(labkit.caches.paged.KVPool.attend, "if not self.use_triton", "out = cpu.paged_attention")

# %% [markdown]
# A research assistant's load: four questions about the same 24-token report, in a pool of 24
# blocks of 4 tokens, with a budget of 16 tokens per step. (Small: this run asks for chapter 03's
# Triton kernels, `use_triton=True`, which without a GPU run in Triton's interpreter.)

# %%
cfg = DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
model = Decoder.random(cfg, seed=0).to(labkit.DEVICE)
gen = torch.Generator().manual_seed(0)
report = torch.randint(0, cfg.vocab_size, (24,), generator=gen).tolist()
questions = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (3, 5, 2, 4)]
prompts = [report + q for q in questions]
NEW = 5

POOL = 24
engine = Engine(model, num_blocks=POOL, block_size=4, max_num_batched_tokens=16, use_triton=True)
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
# False`, the article's rule); one more run keeps vLLM's gate. Still the same tokens. (These runs
# take the engine's default: on a CPU the batched PyTorch path, the arithmetic of the references that
# chapter 03 proves equal to the Triton kernels, and much quicker than Triton's interpreter.)

# %%
def run_engine(**kw):
    e = Engine(model, block_size=4, max_num_batched_tokens=16, **kw)
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
# a few sentences, so here every reply reaches the limit (a fifth, short question below ends on its own).
#
# The pool is made tight on purpose: the four prompts fit (so vLLM's gate admits them all), but not
# the four prompts with all their replies, so the scheduler must preempt a running request on the
# way and recompute it later. On a CPU the engine runs its batched PyTorch path (a 30-layer model
# through Triton's interpreter would take minutes); on a GPU, the Triton kernels.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
from labkit.model.pretrained import chat_token_ids, from_pretrained, load_tokenizer, real_model, to_transformers

path = real_model()
real = from_pretrained(path, dtype=torch.float32, device=labkit.DEVICE)
tokenizer = load_tokenizer(path)
system = {"role": "system", "content": "You are a helpful assistant. Explain things clearly, in a few sentences."}
asks = ["How does a CPU work?", "Describe the water cycle.", "How do vaccines work?", "Why do we have seasons?"]
chat_prompts = [chat_token_ids(tokenizer, [system, {"role": "user", "content": q}]) for q in asks]
REPLY, BLOCK = 16, 16


def distinct_blocks(sequences: list[list[int]]) -> tuple[int, int]:
    """The blocks all the sequences hold at once in one prefix cache (shared full blocks once), and how
    many of those every sequence shares: labkit's own bookkeeping, without tensors."""
    cache = PrefixCache(BlockAllocator(sum(blocks_needed(len(s), BLOCK) for s in sequences)), BLOCK)
    held = []
    for s in sequences:
        table, _ = cache.allocate(s)
        cache.cache_full_blocks(table)
        held.append(set(table.block_ids))
    return cache.allocator.num_used, len(set.intersection(*held))


prompt_blocks, common = distinct_blocks(chat_prompts)
full_blocks, _ = distinct_blocks([p + [0] * REPLY for p in chat_prompts])  # any reply tokens: none is shared
tight = full_blocks - 2
assert prompt_blocks <= tight < full_blocks
real_engine = Engine(real, num_blocks=tight, block_size=BLOCK, max_num_batched_tokens=256)
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
short_ask = "What is the capital of France? Answer in one word."
short = chat_token_ids(tokenizer, [system, {"role": "user", "content": short_ask}])
whole = real_engine.generate([short], REPLY)[0]  # the same engine, its pool free again
ids = torch.tensor([short], device=labkit.DEVICE)
assert whole == reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=REPLY, do_sample=False,
                                   eos_token_id=stop, pad_token_id=stop)[0, len(short):].tolist()
assert whole[-1] == stop and len(whole) < REPLY  # it ended on its own: the whole reply
print(f"{short_ask}\n  -> {tokenizer.decode(whole, skip_special_tokens=True)!r} ({len(whole)} tokens, the last "
      f"<|im_end|>: a complete reply, equal to transformers')")

# %% [markdown]
# ### More requests than slots
#
# Continuous batching (Orca, vLLM) pays off when requests outnumber the slots and their lengths
# vary: a static batch holds its slots until its longest member ends; the engine hands a freed slot
# to a waiting request at the next step. `benchmarks/real_model.py --workload 64` measures it on this
# model: 64 chat requests, outputs of 8 to 128 tokens, all submitted at once, at most 16 running on
# both sides, against transformers' `generate` in static batches of 16 in arrival order (committed
# results: it runs for minutes). Both sides run with the same multiplies (the GEMM column:
# `nn.Linear`, or weights prepacked as `Engine` does by default; the next section), like for like:

# %%
# NBVAL_CHECK_OUTPUT
import json

from labkit.teaching.results import committed_result

BATCHING = committed_result("real_model_64_*.json")
if BATCHING is None:  # a pip install (Colab) has labkit but not the repository's benchmarks/
    print("benchmarks/results/real_model_64_*.json ships with the repository: clone it to see this table.")
else:
    bench = json.loads(BATCHING.read_text())
    runs = {}
    for r in bench["runs"]:  # the run of median wall time, per side and GEMM, all requests at once
        if r["arrivals"] == "closed":
            runs.setdefault((r["side"], r["gemm"]), []).append(r)
    runs = {k: sorted(v, key=lambda r: r["wall_s"])[(len(v) - 1) // 2] for k, v in runs.items()}
    print(f"{bench['command']} ({bench['date']}); {len(bench['lengths'])} requests, {sum(bench['lengths'])} "
          f"output tokens, {bench['slots']} slots")
    print(f"{'side':<16}{'GEMM':<11}{'wall s':>7}{'tokens/s':>9}{'steps':>6}{'ms/step':>8}{'done mean':>10}")
    for (side, gemm), r in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{side:<16}{gemm:<11}{r['wall_s']:>7.1f}{r['tokens_per_s']:>9.1f}{r['steps']:>6}"
              f"{r['ms_per_step']:>8.0f}{r['done_mean_s']:>10.1f}")
    static_steps, engine_steps = runs["static batches", "packed"]["steps"], runs["engine", "packed"]["steps"]
    step_ratio = static_steps / engine_steps
    print(f"steps: static {static_steps} = {' + '.join(map(str, bench['batch_longest']))} (each batch's longest "
          f"member), engine {engine_steps}: {step_ratio:.2f}x fewer")
    for gemm in ("packed", "nn.Linear"):
        speedup = runs["engine", gemm]["tokens_per_s"] / runs["static batches", gemm]["tokens_per_s"]
        cost = runs["engine", gemm]["ms_per_step"] / runs["static batches", gemm]["ms_per_step"]
        print(f"{gemm}: the engine serves {speedup:.2f}x the tokens per second; its step costs {cost:.2f}x "
              f"a static step's")
        assert abs(speedup / step_ratio - 1) < 0.1  # like for like, the speed-up is the step ratio
    assert static_steps == sum(bench["batch_longest"]) > engine_steps == bench["fcfs_steps"]
    assert bench["tokens_equal_static"] == len(bench["lengths"])

# %% [markdown]
# With the same multiplies, the engine's speed-up is the step ratio: a static batch takes as many
# steps as its longest member, the engine the fewest a first-come-first-served schedule can.
# Scheduling buys fewer steps for the same tokens; no step got cheaper. Step by step:

# %%
if BATCHING is not None:
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for side, color in (("engine", "C0"), ("static batches", "C1")):
        busy = bench["traces"][f"{side} closed"]["busy"]  # the schedule, whatever the multiplies
        ax.step(range(1, len(busy) + 1), busy, where="pre", color=color, label=f"{side}: {len(busy)} steps")
    ax.set(xlabel="step", ylabel="slots computing a useful token",
           title="64 requests, 16 slots: the slots doing useful work, step by step")
    ax.legend()
    plt.show()
    static_busy = bench["traces"]["static batches closed"]["busy"]
    engine_busy = bench["traces"]["engine closed"]["busy"]
    assert (len(static_busy), len(engine_busy)) == (static_steps, engine_steps)
    print(f"mean slots in use per step: engine {np.mean(engine_busy):.1f}, static batches "
          f"{np.mean(static_busy):.1f} of {bench['slots']}")
    assert np.mean(engine_busy) > np.mean(static_busy)
    drop = next(k for k, b in enumerate(engine_busy) if b < bench["slots"])  # the queue has run dry
    assert all(a >= b for a, b in zip(engine_busy[drop:], engine_busy[drop + 1:]))

# %% [markdown]
# In a static batch the useful slots fall like a staircase as short requests end, and a new batch
# starts only at the bottom. The engine stays at 16 until the queue runs dry, then only falls. (The
# benchmark's record also holds runs with Poisson arrivals, where a static batch first waits to fill.)
#
# ### What makes a step fast
#
# Scheduling decides how many steps; the model decides what each costs. `benchmarks/vllm_cpu.py`
# serves 16 chat requests with this engine and with the real vLLM (appendix A4) on one thread of the
# same CPU, taking turns, and checks every token. The model is prepared once, when it loads, as vLLM
# prepares one (`process_weights_after_loading`, `vllm/model_executor/layers/linear.py`; here
# `from_pretrained` and `Engine` both call `labkit.model.fused.prepare` on a CPU in
# float32: q, k and v one multiply, gate and up another, every weight reordered for oneDNN; norms
# and RoPE in fewer operations); attention is planned once per step; a step runs in
# `torch.inference_mode()`, as vLLM's does. The second row is chapter 01's model (`prepare=False`):

# %%
# NBVAL_CHECK_OUTPUT
SPEED = committed_result("vllm_cpu_*.json")
if SPEED is None:
    print("benchmarks/results/vllm_cpu_*.json ships with the repository: clone it to see this table.")
else:
    speed = json.loads(SPEED.read_text())
    print(f"{speed['command']} ({speed['date']}), {speed['rounds']} rounds, each engine's fastest")
    print(f"{'engine':<52}{'tokens/s':>9}{'ms/step':>8}{'fixed ms':>9}{'same tokens':>12}")
    for e in speed["engines"]:
        print(f"{e['name']:<52}{e['tokens_per_s']:>9.1f}{e['ms_per_step']:>8.0f}{e['fixed_ms']:>9.0f}"
              f"{e['tokens_equal']:>9} of {speed['requests']}")
    print(f"labkit over vLLM in process: {speed['ratio_to_vllm_in_process']:.2f}x (rounds: "
          f"{', '.join(f'{r:.2f}' for r in speed['ratio_per_round'])})")
    multiplies = speed["breakdown"][0]["multiplies"]
    print(f"{multiplies} multiplies per step ({7 * (multiplies - 1) // 4 + 1} unfused); a decode step of:")
    for b in speed["breakdown"]:
        print(f"{b['batch']:>4} running: {b['step_ms']:5.1f} ms = multiplies {b['multiplies_ms']:5.1f} + "
              f"attention {b['attention_ms']:4.1f} + the rest {b['rest_ms']:4.1f} "
              f"(the rest run alone: {b['rest_alone_ms']:.1f} ms, {b['rest_alone_share']:.0%})")
    engines = {e["name"]: e for e in speed["engines"]}
    assert all(e["tokens_equal"] == speed["requests"] for e in speed["engines"])
    assert engines["labkit Engine"]["tokens_per_s"] > 1.3 * engines[
        "labkit Engine, model as loaded (prepare=False)"]["tokens_per_s"]
    assert speed["ratio_to_vllm_in_process"] > 0.9  # within a tenth of vLLM's speed
    assert max(speed["ratio_per_round"]) > 1  # and faster than vLLM in some rounds
    assert all(b["multiplies_ms"] > b["attention_ms"] + b["rest_ms"] for b in speed["breakdown"])
    assert all(b["rest_alone_share"] < 0.1 for b in speed["breakdown"])

# %% [markdown]
# The book's engine serves at vLLM's speed, give or take the machine's drift (the rounds), with the
# same tokens ("fixed ms": fitted as in appendix A6). A step is mostly its multiplies, the same
# oneDNN multiplies in both engines. Then attention: vLLM's C++ kernel
# (`vllm/v1/attention/backends/cpu_attn.py`) reads each request's blocks in place, labkit's PyTorch
# path copies them first. The rest, run alone, is under a tenth of a step.


# %% [markdown]
# ## Summary
#
# - A step has two budgets: tokens and free blocks. `plan_iteration` gives each candidate
#   `min(num_new_tokens, budget)` tokens, stops when the budget is spent, and skips a candidate whose
#   `extra_blocks` do not fit; prompts are chunked, and a step mixes prefill and decode.
# - `extra_blocks` counts new blocks, a copy of a shared, partly filled tail, and revived cached blocks.
# - The candidate order decides who gets memory first; paging has no notion of priority.
# - The blocks decide how many requests run at once; a pool too small preempts and recomputes.
# - A running request that cannot grow preempts the newest, which is recomputed later (vLLM v1);
#   with prefix caching on, the cache absorbs most of that recompute.
# - The engine built from chapters 01 to 05 gives exactly the tokens of generating each prompt alone,
#   and serves a real model with transformers' greedy tokens.
# - With more requests than slots, the engine refills a slot in the step after it frees, where a
#   static batch waits for its longest member: fewer steps for the same tokens. With the same
#   multiplies on both sides, that step ratio is the speed-up.
# - A step's cost is mostly its multiplies. Prepared once as vLLM prepares a model (fused, packed),
#   with attention planned once per step, the engine serves at vLLM's speed, give or take the
#   machine's drift.
#
# [Appendix A5](A5_vllm_scheduler.ipynb) follows vLLM's scheduler further. Chapter 06 drives this
# `Scheduler` with a cost model: fitting in memory is one thing; serving fast enough is another.

# %% [markdown]
# ## Exercises

# %%
from labkit.teaching.exercises import Exercises
from labkit.teaching.guards import draws_hidden_cases, function_shape

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


from labkit.memory.blocks import _extra_blocks  # extra_blocks without its checks: refused in answers too
from labkit.memory.paging import BlockTable
from labkit.memory.pool_plan import PoolPlan
from labkit.vllm_bridge import predict


@draws_hidden_cases
def ex1_cases(rng) -> list:
    """Two block sizes drawn afresh; a request with nothing computed, a full tail and a partly filled one;
    no token, one, exactly the rest of the tail, and many; shared tail or not. It holds the blocks its
    computed tokens fill, sometimes one or two more (a reservation); and once, for each block size,
    one more with many tokens to come."""
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
                  forbid=[extra_blocks, _extra_blocks, blocks_needed, predict._blocks_per_request, BlockTable,
                          PrefixCache, PoolPlan])

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** After the step the request holds `ceil((num_computed + tokens) / block_size)`
# blocks, so the new ones are that less what it holds (never negative: a decode token that fits in
# the tail needs none). A copy is owed only when the next token lands in a *partly* filled tail that
# someone else holds (`num_computed % block_size != 0`); a full shared block is never written again.

# %% [markdown]
# **Exercise 2 (build it).** Write the pass: `plan_step(running, waiting, free_blocks, token_budget,
# block_size)`, with `running` as `(name, computed, held, new_tokens)` oldest first and `waiting` as
# `(name, prompt_len)`. Visit the running, then, unless one was preempted, the waiting; give each
# `min(new_tokens, budget)` tokens and stop when the budget is spent. Its blocks (Exercise 1, nothing
# shared) not free: skip a waiting one; a running one preempts the newest running request (its blocks
# return) until it fits or has preempted itself. Return `([(name, tokens)], [names preempted])`.

# %%
def plan_step(running, waiting, free_blocks, token_budget, block_size):
    # BEGIN SOLUTION
    planned, preempted, live = [], [], list(running)

    def blocks(computed, held, tokens):  # Exercise 1, nothing shared
        return max(0, -(-(computed + tokens) // block_size) - held)

    i = 0
    while i < len(live) and token_budget:  # running first, oldest first
        name, computed, held, new = live[i]
        tokens = min(new, token_budget)
        while blocks(computed, held, tokens) > free_blocks:
            victim = live.pop()  # the newest running request gives its blocks back
            free_blocks += victim[2]
            preempted.append(victim[0])
            if victim[0] == name:
                break
        if name not in preempted:
            planned.append((name, tokens))
            free_blocks -= blocks(computed, held, tokens)
            token_budget -= tokens
        i += 1
    for name, prompt_len in [] if preempted else waiting:
        tokens = min(prompt_len, token_budget)
        if tokens == 0:
            break  # the budget is spent: stop
        if blocks(0, 0, tokens) <= free_blocks:  # else skipped: a smaller one behind may fit
            planned.append((name, tokens))
            free_blocks -= blocks(0, 0, tokens)
            token_budget -= tokens
    return planned, preempted
    # END SOLUTION


from labkit.teaching import build_it

ex.check_behaviour("Exercise 2", plan_step, build_it.plan_step_check(),
                   forbid=[plan_iteration, Scheduler, extra_blocks, _extra_blocks, blocks_needed, PrefixCache],
                   hint="two running totals; a waiting request that does not fit is skipped, a running one "
                        "preempts from the end of the running list.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** It is `labkit/serving/scheduler.py: plan_iteration` (the budget, the skip, the stop)
# with `Scheduler._make_room` (pop the newest running request until the candidate fits) and
# `Scheduler._candidates` (no waiting request in a step that preempted), on plain rows.

# %% [markdown]
# **Exercise 3 (a scheduling policy).** The `PriorityScheduler` sorts its waiting queue before every
# step by a key function of a `Request` (smaller first). Write `shortest_prompt_first(request)` so
# that shorter prompts are admitted first. The checker serves nine prompts of consecutive lengths,
# all arriving at once, 20 tokens per step, in two arrival orders, and checks the order of admission.

# %%
def shortest_prompt_first(request: Request):
    # BEGIN SOLUTION
    return len(request.prompt_token_ids)
    # END SOLUTION
    # BEGIN STUB
    raise NotImplementedError("your code here")
    # END STUB


@draws_hidden_cases
def ex4_arrivals(rng) -> dict[str, list[list[int]]]:
    """Nine prompts of consecutive lengths from a random start, of random token ids, in two arrival
    orders: longest first, and shuffled."""
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


ex.check_behaviour("Exercise 3", shortest_prompt_first, check_policy,
                   expects=function_shape("shortest_prompt_first", "request"),
                   hint="the key is compared with < : return something that grows with the prompt's length, "
                        "one token at a time.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** The prompt length in tokens orders every pair of these requests, even two
# that differ by one token; a coarser key ties them, and the sort keeps their arrival order.

# %% [markdown]
# **Quiz.** Answer with a letter or a number.
# 1. A candidate's blocks do not fit, budget remains: the pass (a) stops; (b) skips it.
# 2. A running request cannot grow: preempt (a) the oldest; (b) the newest; (c) the longest.
# 3. Preempted after 3 outputs of a 3-token prompt, caching off: how many tokens come back?
# 4. Admitting only when the whole sequence fits (a) avoids preempting a long prompt halfway;
#    (b) saves compute on every request.

# %%
# BEGIN SOLUTION
quiz = {1: "b", 2: "b", 3: 6, 4: "a"}
# END SOLUTION
# BEGIN STUB
quiz = {1: None, 2: None, 3: None, 4: None}  # a letter or a number each
# END STUB
ex.quiz(quiz)

# %% [markdown]
# ## What you can now do
#
# - Plan one step by hand: each candidate's tokens and blocks, which turns stop, which are skipped.
# - Count the free blocks a step takes, copy-on-write and revived cached blocks included.
# - Say how a pool's size limits the requests that run at once, and what a preemption recomputes.
# - Serve prompts through an engine built from the book's parts, and prove no token changed.


# %% [markdown]
# ## References
#
# - The source article: *长上下文推理中的 KV Cache：容量、分页与复用边界* ("The KV cache in
#   long-context inference: capacity, paging and the limits of reuse"), no author or link in the
#   copy the book follows. Its §05 pass (`plan_iteration`, `extra_blocks`) carries over; its
#   sentences do not.
# - Woosuk Kwon, Zhuohan Li, et al., *Efficient Memory Management for Large Language Model Serving
#   with PagedAttention*, SOSP 2023, [arXiv:2309.06180](https://arxiv.org/abs/2309.06180):
#   scheduling and preemption.
# - vLLM 0.33.0 ([docs.vllm.ai](https://docs.vllm.ai/),
#   [github.com/vllm-project/vllm](https://github.com/vllm-project/vllm)):
#   `vllm/v1/core/sched/scheduler.py` (`Scheduler._preempt_request`) and
#   `vllm/v1/core/kv_cache_manager.py` (`KVCacheManager.allocate_slots`).
# - Gyeong-In Yu et al., *Orca: A Distributed Serving System for Transformer-Based Generative
#   Models*, OSDI 2022: iteration-level scheduling, the step-by-step batching this chapter builds.
