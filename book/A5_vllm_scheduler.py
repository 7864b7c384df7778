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
# # A5 · vLLM's scheduler, step by step
#
# **The message.** The order in which waiting requests are admitted decides who waits, and vLLM's two
# admission rules keep a large request from starving and a half-admitted prompt from being preempted,
# at the cost of some idle blocks.
#
# An appendix to [chapter 05](05_scheduler.ipynb), whose budget pass spends two budgets per step,
# tokens and blocks. vLLM runs that same pass, but it decides which *waiting* requests the pass may
# see: it admits them in queue order and stops at the first one that does not fit, and it admits a
# request only when the blocks for every token it knows so far are free. This appendix measures
# what each of those rules buys and what it costs, shows that the queue's order (not paging)
# decides who waits, prices the two ways out of a preemption, and checks that labkit's `Scheduler`
# makes vLLM's own decisions, step for step.
#
# **What you will learn**
#
# - that a priority order moves waiting time between requests, and who pays for it;
# - why the article's "skip what does not fit" can starve a large request forever, and how vLLM's
#   head-of-line rule prevents it;
# - what vLLM's admission gate checks, why it is on by default, and the regime where it costs time;
# - what a preemption costs by recompute and by swapping to CPU memory;
# - how closely labkit's `Scheduler` follows vLLM 0.33.0's, measured on the same workloads.

# %%
from labkit.teaching.diagrams import roadmap

roadmap("A5");  # the article's pipeline, this appendix's part highlighted

# %% [markdown]
# **You need:** chapter 05: the two budgets of a step, `extra_blocks`, the budget pass and
# preemption; chapter 04: prefix hits.
#
# **Time:** about 25 minutes to read and run; about 5 minutes for the exercise.

# %%
import matplotlib.pyplot as plt
import numpy as np

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.memory import capacity
from labkit.serving.dry_run import dry_run, named_requests
from labkit.serving.scheduler import Scheduler
from labkit.serving.sim.costmodel import CostModel
from labkit.serving.sim.simulator import Simulator
from labkit.serving.sim.workloads import RequestSpec
from labkit.serving.variants.priority import PriorityScheduler
from labkit.units import format_bytes

# %% [markdown]
# `dry_run` (`labkit.serving.dry_run`, as in chapter 05) drives a scheduler without a model: it adds each
# request at its arrival step, and feeds token 0 back for every token the step samples.
#
# ## 1. The order decides who waits
#
# Chapter 05 planned one step in two orders: first come, first served admitted a long prompt and
# kept a short one waiting; shortest prompt first did the opposite. Over a whole run the order moves
# waiting time between requests. `PriorityScheduler` (`labkit.serving.variants.priority`, a variant beside the core)
# re-sorts its waiting queue by a `priority` key before each step. Here are ten requests with
# mixed lengths, two arriving per step, in a pool of 16 blocks of 4 tokens with a budget of 16
# tokens, under both orders. The wait is counted in steps until each request's first token (1 means
# it got its first token in the step it arrived):

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
    steps = dry_run(sched, arrivals)
    arrived = {r.request_id: t for t, rs in arrivals.items() for r in rs}
    first = {}
    for step in steps:
        for c in step.sampling_chunks:
            first.setdefault(c.request.request_id, step.index)
    return reqs, {name: first[name] - arrived[name] for name in arrived}


reqs_f, waits_fcfs = first_token_waits(None)
reqs_s, waits_short = first_token_waits(lambda r: len(r.prompt_token_ids))

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
assert waits_short[longest] > waits_fcfs[longest]  # the long request pays for the short ones

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
# Shortest first lowers the mean wait printed above, and the longest prompt waits longer than under
# first come, first served: the short requests' gain is paid by the long ones. vLLM's own
# priority policy (`--scheduling-policy priority`) also orders its queue by a key, but when it must
# preempt it takes the running request of lowest priority; `PriorityScheduler` still preempts the
# newest.
#
# ## 2. Skipping, and the starvation it allows
#
# The article's pass *skips* a candidate whose blocks do not fit (`continue`): blocks a large
# request cannot use yet go to smaller ones behind it. That keeps the pool busy, but it also lets
# small requests overtake a large one again and again. With a finite set of requests everyone
# finishes eventually. Under a never-ending stream of small requests, every block that frees up
# may be taken by a newcomer before the large request ever sees enough of them free.
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
# rule it is admitted after the few steps printed above, once the small requests already running
# finish, and the small ones behind it wait a little longer for their first token while the pool
# drains. The small requests produce the same number of tokens under both rules, so head of line
# produces *more* in 200 steps: it adds the large request's 4, which the article's rule never
# produced. This stream is light enough that the small requests lose only waiting time; under a
# heavier one, blocks left idle while the queue waits for the large request would cost output too.
#
# Chapter 05's walk shows that cost on four requests: W (a 10-token prompt, 3 new tokens), X (14,
# 2), Y (5, 2) and Z (3, 3) in 8 blocks of 4 tokens, with a budget of 12 tokens. In its step 3, only
# 1 block is free: the article's rule skips Y and plans Z; head of line stops at Y.

# %%
def walk(head_of_line):
    sched = Scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=12, enable_prefix_caching=False,
                      head_of_line=head_of_line)
    return dry_run(sched, {0: named_requests([("W", 10, 3), ("X", 14, 2), ("Y", 5, 2), ("Z", 3, 3)])})


walk_steps, hol_walk_steps = walk(False), walk(True)
print("step 3, article's rule:", [(d.request.request_id, d.outcome) for d in walk_steps[2].decisions])
print("step 3, head of line:  ", [(d.request.request_id, d.outcome) for d in hol_walk_steps[2].decisions])
print(f"steps to serve all four: {len(walk_steps)} (article's rule), {len(hol_walk_steps)} (head of line)")
assert [d.outcome for d in walk_steps[2].decisions] == ["planned", "planned", "skipped", "planned"]
assert [d.outcome for d in hol_walk_steps[2].decisions] == ["planned", "planned", "skipped"]
assert len(hol_walk_steps) == len(walk_steps) + 1

# %% [markdown]
# Under head of line, Z is not even offered (three turns, not four), and the four requests need one
# step more: the price of serving in arrival order.
#
# ## 3. Admitting a whole sequence: vLLM's gate
#
# vLLM admits a waiting request only when the blocks for every token it knows so far are free: its
# prompt, and for a request that was preempted the outputs it had already produced (at most
# `max_model_len` tokens in all), less the tokens its prefix hit already holds. The outputs still to
# come are not counted. The article's pass asks a waiting request only for the blocks of the chunk
# it computes *now*. With chunked prefill and a tight pool that invites trouble: a 600-token prompt
# admitted with a 256-token chunk takes 16 blocks, the next step 16 more, and when the pool runs dry
# halfway through its prompt, someone is preempted, and the chunks already computed for it are
# thrown away. vLLM refuses to start a prompt it cannot finish prefilling: `SchedulerConfig.scheduler_reserve_full_isl`
# (`vllm/config/scheduler.py`, vLLM 0.33.0) is `True` by default, and the scheduler's waiting loop
# passes it to `KVCacheManager.allocate_slots` as `full_sequence_must_fit`
# (`vllm/v1/core/kv_cache_manager.py`). When the known sequence does not fit, admission stops for
# the step. Only the first chunk is allocated: the gate checks, it does not reserve. labkit's
# `Scheduler` does the same by default (`full_sequence_must_fit=True`); `False` is the article's
# chunk-only rule. Here is the check, in `Scheduler._extra_blocks`:

# %%
from labkit.teaching.excerpts import excerpt

excerpt(Scheduler._extra_blocks, "if self.full_sequence_must_fit", "return whole")

# %% [markdown]
# `request.num_tokens` counts the prompt and the outputs so far; `hit_extra_blocks` turns the tokens
# after the prefix hit into free blocks (cached blocks no one holds count too, as chapter 05's
# `extra_blocks` does). `max_model_len` counts tokens, prompt and outputs, as vLLM counts it: a prompt
# of `max_model_len` tokens is refused before it is queued, and a request stops once it holds
# `max_model_len` tokens (`check_stop` in `vllm/v1/core/sched/utils.py`), so the cap holds by construction.
#
# The same workload both ways: 24 prompts of 300 to 700 tokens arriving 0 to 40 ms apart, 8 to
# 63 new tokens each, a pool of 64 blocks of 16 tokens (1,024 slots), prefix caching off, and two
# token budgets. Chapter 06's `Simulator` serves it: labkit's `Scheduler`, each step timed with the
# roofline model of the teaching model on an RTX 4090, so that the first-token times (TTFT) count
# what the steps computed, recomputed tokens included.

# %%
# NBVAL_CHECK_OUTPUT
rtx4090 = CostModel("teaching model", "RTX 4090 (24 GiB)")


def long_prompts(seed=0, n=24):
    """Long prompts and short answers, arriving 0, 20 or 40 ms apart."""
    rng = np.random.default_rng(seed)
    specs, t = [], 0.0
    for i in range(n):
        prompt = rng.integers(0, 1000, int(rng.integers(300, 700))).tolist()
        specs.append(RequestSpec(i, t, prompt, int(rng.integers(8, 64))))
        t += int(rng.integers(0, 3)) * 0.020
    return specs


gate_runs = {(gate, budget): Simulator(rtx4090, num_blocks=64, block_size=16, max_num_batched_tokens=budget,
                                       enable_prefix_caching=False, full_sequence_must_fit=gate).run(long_prompts())
             for budget in (256, 64) for gate in (True, False)}
print(f"{'budget':>6}  {'admission':<22}{'preemptions':>12}{'recomputed':>11}{'TTFT p50':>10}{'TTFT p90':>10}"
      f"{'all served':>11}")
for (gate, budget), g in gate_runs.items():
    print(f"{budget:>6}  {'whole sequence (vLLM)' if gate else 'chunk only':<22}{g.preemptions.sum():>12}"
          f"{g.recomputed_tokens:>11,}{np.percentile(g.ttft, 50):>9.2f}s{np.percentile(g.ttft, 90):>9.2f}s"
          f"{g.makespan:>10.2f}s")
on, off = gate_runs[True, 256], gate_runs[False, 256]
assert on.preemptions.sum() == on.recomputed_tokens == 0
assert off.preemptions.sum() > 100 and off.recomputed_tokens > 30_000
assert np.percentile(on.ttft, 50) < np.percentile(off.ttft, 50) and on.makespan < off.makespan
on64, off64 = gate_runs[True, 64], gate_runs[False, 64]
assert on64.preemptions.sum() == 0 and off64.preemptions.sum() > 50 and off64.recomputed_tokens > 10_000
assert off64.makespan < on64.makespan and np.percentile(off64.ttft, 50) < np.percentile(on64.ttft, 50)

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
for ax, budget in zip(axes, (256, 64)):
    for gate in (True, False):
        ttft = np.sort(gate_runs[gate, budget].ttft)
        ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), drawstyle="steps-post",
                label="whole sequence (vLLM)" if gate else "chunk only")
    ax.set_xlabel("time to first token (s, roofline model)")
    ax.set_title(f"Budget {budget} tokens per step")
    ax.legend(fontsize=8)
axes[0].set_ylabel("share of requests")
fig.suptitle("The gate brings first tokens earlier at 256 tokens per step; at 64, mostly later")
fig.tight_layout()
plt.show()

# %% [markdown]
# With a budget of 256 tokens, the chunk-only rule admits prompt after prompt piece by piece, runs
# the pool dry, and preempts over and over: the preemptions and the tens of thousands of tokens
# computed twice in the table. The gate keeps a prompt in the queue until all its blocks are free:
# no request is preempted, nothing is computed twice, and the first tokens come *earlier* (the left
# panel), because the steps no longer carry work that is thrown away. That is the over-admission
# and "KV cache thrashing with chunked prefill" that vLLM's docstring names as the reason for the
# default.
#
# The gate is not free in every regime. With a budget of 64 tokens the waste still happens without
# the gate (the second pair of rows), but it costs less time: a 64-token chunk adds little to a step
# that reads all the weights anyway, and the chunk-only rule keeps more requests decoding at once,
# so there most of its first tokens come sooner (the right panel, from the median up) and it serves
# the whole workload sooner.
# The gate buys predictability, and saves compute whenever the steps are not almost free. It is not
# a reservation of the *answer*: the outputs a request will produce are not counted, so a request
# can still be preempted while it decodes (chapter 06 sees it happen).
#
# ## 4. Two ways out of a preemption: recompute or swap
#
# When a running request cannot grow, chapter 05's scheduler preempts the newest and drops its K/V:
# it will compute them again (**recompute**). **Swapping** is the other way out: copy the victim's
# blocks to CPU memory and back later. It trades compute for transfers. For the article's teaching
# model the bytes are easy to count, and chapter 06's roofline cost model prices both. A swap moves
# the bytes out and back over PCIe 4.0 x16 (16 GT/s on 16 lanes with 128b/130b encoding: 31.5 GB/s
# each way, the link of an RTX 4090; a datasheet peak, as the cost model's are); a recompute is one
# prefill of the same tokens on the RTX 4090 of the cost model (the teaching model with
# Llama-3-8B's weights).

# %%
# NBVAL_CHECK_OUTPUT
per_token = capacity.TEACHING_MODEL.bytes_per_token()
PCIE4_X16 = 16e9 * 16 / 8 * 128 / 130  # bytes/s each way
print(f"{'tokens':>7} {'K/V bytes':>10} {'swap out + in':>14} {'recompute (prefill)':>20}")
ratios = []
for tokens in (2_048, 8_192, 32_768):
    swap_s = 2 * tokens * per_token / PCIE4_X16
    recompute_s = rtx4090.prefill_time(tokens)
    print(f"{tokens:>7,} {format_bytes(tokens * per_token):>10} {swap_s * 1e3:>11.0f} ms {recompute_s * 1e3:>17.0f} ms")
    ratios.append(swap_s / recompute_s)
print(f"swap / recompute: {', '.join(f'{r:.3f}' for r in ratios)}")
assert all(r < 0.1 for r in ratios) and ratios == sorted(ratios, reverse=True)  # "under a tenth", then less
assert 8_192 * per_token == 2**30 and round(PCIE4_X16 / 1e9, 1) == 31.5

# %% [markdown]
# On these datasheet figures a swap takes under a tenth of the recompute's time (the ratios in the
# last line), and the gap grows with the length, since attention makes a prefill grow faster than
# linearly while the bytes grow linearly. The swap has other costs: it holds that much CPU memory,
# competes for the link with everything else the server moves, and its copies must be scheduled
# around the steps. vLLM's v1 engine recomputes: `Scheduler._preempt_request`
# (`vllm/v1/core/sched/scheduler.py`, vLLM 0.33.0) frees the request's blocks and sets its
# `num_computed_tokens` to 0, and the prefix cache often still holds its full blocks when it
# returns.
#
# ## 5. labkit's scheduler against vLLM's own
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
from labkit.teaching.results import committed_result

CONFORMANCE = committed_result("vllm_scheduler_2026-11-30.md")
if CONFORMANCE is None:  # a pip install (Colab) has labkit but not the repository's benchmarks/
    print("benchmarks/results/vllm_scheduler_2026-11-30.md ships with the repository: clone it to see this table.")
else:
    tables = CONFORMANCE.read_text().split("```")[1::2]  # with the gate, then chunk-only admission
    for label, table in zip(["labkit with the gate", "labkit with chunk-only admission"], tables):
        rows = table.strip().splitlines()
        print(f"{label}:\n{rows[0]}\n{rows[-1]}")
    now, before = (t.strip().splitlines()[-1].split() for t in tables)  # the "all" rows
    assert now[2] == now[4] == "100.0%" and now[5] == "386/386"
    preempted, in_vllm = map(int, before[5].replace(",", "").split("/"))
    assert float(before[2].rstrip("%")) < 200 / 3 and 4.5 < preempted / in_vllm < 5.5  # "two in three", "five times"

# %% [markdown]
# Every step schedules the same requests with the same token counts, every admission finds the same
# prefix hit, the same requests are preempted in the same steps, and every request finishes in the
# same step as in vLLM. Admitting by the chunk alone, labkit preempted about five times as often as
# vLLM on the same workloads (the second pair of lines) and agreed on fewer than two steps in three:
# on these workloads the gate is the whole difference. What the comparison leaves out is what
# `create_scheduler` leaves off: multimodal inputs, LoRA, speculative decoding, KV connectors,
# structured output, asynchronous scheduling, and vLLM's priority policy.
#
# ## Summary
#
# - The order of the waiting queue decides who waits: shortest first lowers the mean wait, and the
#   long requests pay for it.
# - The article's pass skips what does not fit, and under a steady stream of small requests a large
#   one can starve. vLLM stops admitting at the first waiting request that does not fit: nobody
#   starves, at the cost of idle blocks and a longer wait for the small ones.
# - vLLM's gate admits a waiting request only when blocks for all its known tokens (prompt and
#   earlier outputs, after the prefix hit) are free. With chunked prefill and a tight pool it removes
#   the preemptions and the recomputed prompts; with very small chunks, admitting by the chunk can
#   still be faster.
# - A preemption costs a recompute (vLLM v1) or, by swapping, two copies over the link and CPU
#   memory; on datasheet figures the copies take under a tenth of the recompute's time.
# - labkit's `Scheduler` and vLLM 0.33.0's make the same decisions in every step of the benchmark's
#   workloads, and the gate was the whole difference before.
#
# Back to [chapter 05](05_scheduler.ipynb#when-blocks-run-out-preemption), or on to chapter 06, which
# drives this scheduler with a clock.
#
# ## What you can now do
#
# - Choose an admission rule (skip, head of line, whole-sequence gate) and a priority order, and
#   measure what each does to waiting times, starvation and recomputed tokens.
# - Count the blocks vLLM's gate asks of a waiting request, a preempted one included.
# - Compare a preemption's recompute with a swap on a link's datasheet bandwidth.
# - Read a step-by-step comparison of two schedulers, and say what it leaves out.

# %% [markdown]
# ## Exercise

# %%
from labkit.teaching.exercises import Exercises

ex = Exercises("A5_vllm_scheduler")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/ a failing checker fails the notebook tests

# %% [markdown]
# **Exercise 1.** A request with a 600-token prompt was preempted after it had produced 14 tokens.
# It waits to come back, with prefix caching on: its first 256 tokens are found in the cache, in
# 16 blocks of 16 tokens that another running request still holds. How many free blocks must the
# pool have for vLLM's gate to admit it? Answer with a number.

# %%
# BEGIN SOLUTION
answer_1 = -(-(600 + 14) // 16) - 256 // 16  # blocks for every known token, less the blocks of the hit
# END SOLUTION
# BEGIN STUB
answer_1 = None  # replace None with your answer
# END STUB

ex.check("Exercise 1", answer_1,
         hint="the gate counts the prompt and the outputs so far, in blocks, less the blocks of the prefix hit.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** The gate counts every token the request knows: 614 of them need 39 blocks.
# The 16 blocks of the hit are held by another request, so they take nothing from the free blocks;
# 23 must be free.

# %% [markdown]
# ## References
#
# - vLLM 0.33.0: documentation at [docs.vllm.ai](https://docs.vllm.ai/), code at
#   [github.com/vllm-project/vllm](https://github.com/vllm-project/vllm). The files read:
#   `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`, `Scheduler._preempt_request`),
#   `vllm/v1/core/kv_cache_manager.py` (`KVCacheManager.allocate_slots`, `full_sequence_must_fit`),
#   `vllm/config/scheduler.py` (`scheduler_reserve_full_isl`) and `tests/v1/core/utils.py`
#   (`create_scheduler`).
# - Woosuk Kwon, Zhuohan Li, et al., *Efficient Memory Management for Large Language Model Serving
#   with PagedAttention*, SOSP 2023, [arXiv:2309.06180](https://arxiv.org/abs/2309.06180):
#   preemption by swapping or by recomputation.
# - The source article's §05, whose pass (`plan_iteration`) this appendix wraps in vLLM's rules;
#   see chapter 05's references.
