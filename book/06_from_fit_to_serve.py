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
# # 06 · From fitting to serving
#
# **The message.** Fitting is not serving: once requests arrive, occupancy, reuse and latency
# decide how well a pool serves them.
#
# Chapter 02 turned a model's shape into bytes per token and a device's memory into a
# number of sequences: that answers "how much fits?". A user asks "how long until my first token,
# and how fast do the others come?". This chapter carves the article's pool out of a device, prices
# every engine step with a roofline, and serves synthetic traffic through the scheduler, allocator
# and prefix cache of chapters 03 to 05, without a GPU.
#
# **What you will learn**
#
# - how a device's memory becomes a KV pool (§06: 24 GiB − 17 GiB = 7 GiB = seven 8,192-token
#   sequences of the teaching model), and why six of them run in full;
# - why concurrency spreads the weight read over more sequences but multiplies the history read;
# - the measurements that tell whether a setting serves well: cache occupancy, reusable-token
#   ratio, time to first token (TTFT), time per output token (TPOT) and inter-token latency (ITL),
#   with the length distributions beside them;
# - that one setting can help long-document questions and hurt many short requests.
#
# [Appendix A2](A2_vllm_start_up.ipynb) reads vLLM's start-up log; [appendix
# A6](A6_measuring_a_server.ipynb) measures a server further: rate sweeps, several draws, the
# paper's headline, and the simulator against a real engine.

# %%
from labkit.teaching.diagrams import roadmap

roadmap("06");  # the article's pipeline, this chapter's part highlighted

# %% [markdown]
# **You need:** chapter 02: bytes per token and capacity; chapter 05: steps, the token budget and
# preemption; chapter 04: prefix hits.
#
# **Time:** about 35 minutes to read and run; about 90 minutes for the exercises.

# %%
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import NullFormatter

import labkit
from labkit.memory.blocks import blocks_needed
from labkit.memory.capacity import TEACHING_MODEL
from labkit.memory.pool_plan import plan_pool
from labkit.serving.sim import workloads
from labkit.serving.sim.costmodel import DEVICES, MODEL_COSTS, CostModel
from labkit.serving.sim.simulator import Simulator
from labkit.units import GiB, format_bytes

print(labkit.describe())


# %% [markdown]
# ## From a device to a pool
#
# Before the cache gets a byte, the device holds the weights, the activations of the largest step
# (the *workspace*) and a safety reserve. What is left becomes the KV pool, cut into blocks. The
# article's example sets aside 17 GiB of a 24 GiB device:

# %%
# NBVAL_CHECK_OUTPUT
pool = plan_pool(device_bytes=24 * GiB, set_aside_bytes=17 * GiB, model=TEACHING_MODEL, block_size=16,
                 max_model_len=8192)
print(pool.describe())
assert pool.pool_bytes == 7 * GiB and pool.num_blocks == 3584 and pool.sequences_that_fit == 7


# %% [markdown]
# Seven sequences of 8,192 tokens, as §06 says: each is 512 blocks of 2 MiB. But an engine also
# keeps tensors that tell the attention kernel where everything is: a **block table** per sequence
# slot (chapter 03), the **sequence lengths**, and the step's **slot mapping**. Sized for vLLM's
# limits for its offline `LLM` class on a GPU under 70 GiB (256 slots, 8,192 tokens per step;
# appendix A2 has the table per GPU size), and paid from the pool:

# %%
# NBVAL_CHECK_OUTPUT
for name, size in pool.management.items():
    print(f"{name:<26} {format_bytes(size):>10}")
print(f"{'total':<26} {format_bytes(pool.management_bytes):>10}")
print(f"blocks left in the pool:   {pool.num_blocks_after_management:,} (was {pool.num_blocks:,})")
print(f"8,192-token sequences:     {pool.sequences_after_management} (was {pool.sequences_that_fit})")
print(f"host-side block metadata:  {format_bytes(pool.host_metadata_bytes())} (CPU memory, not the pool)")
assert pool.management_bytes == 256 * 512 * 4 + 256 * 4 + 8192 * 8
print(f"share of the pool:         {pool.management_bytes / pool.pool_bytes:.3%}")
assert pool.num_blocks_after_management == 3583 and pool.sequences_after_management == 6
assert pool.management_bytes < 600 * 1024 and round(pool.management_bytes / pool.pool_bytes, 5) == 0.00008


# %% [markdown]
# Under 600 KiB against a 7 GiB pool, yet it costs a whole sequence: the pool held *exactly* seven,
# so losing one block leaves six full sequences and 511 blocks for shorter ones. Any capacity
# figure that lands on a round number is fragile in the same way.
#
# vLLM's log counts the same pool differently. `labkit.vllm_bridge.predict` redoes its arithmetic (vLLM 0.33.0)
# on the article's idealised device (all 24 GiB usable, `gpu_memory_utilization=1.0`):

# %%
# NBVAL_CHECK_OUTPUT
from labkit.vllm_bridge import predict

available = predict.available_kv_bytes(gpu_total_bytes=24 * GiB, gpu_memory_utilization=1.0, non_kv_bytes=17 * GiB)
report = predict.kv_cache_report(TEACHING_MODEL, available, block_size=16, max_model_len=8192)
print(*report.log_lines(), sep="\n")
per_request = report.blocks_per_request  # 8,192 tokens / 16 = 512 blocks
null_block = 1                           # vllm/v1/core/block_pool.py: BlockPool keeps block 0 back
counts = [
    ("blocks in the 7 GiB pool", pool.num_blocks, ""),
    ("this book: bookkeeping paid from the pool", pool.num_blocks_after_management,
     f"{pool.num_blocks_after_management // per_request} full sequences"),
    ("vLLM: blocks it can hand out (less its null block)", report.num_gpu_blocks - null_block,
     f"{(report.num_gpu_blocks - null_block) // per_request} full sequences"),
    ("vLLM's 'Maximum concurrency': all blocks / 512", report.num_gpu_blocks, f"{report.max_concurrency:.2f}x"),
]
print()
for label, blocks, meaning in counts:
    print(f"{label:<52} {blocks:>6,} blocks  {meaning}".rstrip())
assert available == pool.pool_bytes and report.num_gpu_blocks == pool.num_blocks == 3584 and per_request == 512
assert report.max_concurrency == report.num_gpu_blocks / per_request == 7.0
assert pool.sequences_after_management == (report.num_gpu_blocks - null_block) // per_request == 6
at_default = predict.kv_cache_report(TEACHING_MODEL, predict.available_kv_bytes(24 * GiB, 0.92, 17 * GiB), max_model_len=8192)
print(f"\nat vLLM's default gpu_memory_utilization=0.92: {at_default.max_concurrency:.2f}x")
assert f"{at_default.max_concurrency:.2f}" == "5.08"


# %% [markdown]
# Both accountings end at six full sequences. vLLM keeps its block tables outside the pool (they
# exist before its profiling run measures memory), but holds block 0 back as a **null block**, so
# 3,583 blocks can be handed out. Its "Maximum concurrency" divides *all* 3,584 blocks by 512:
# the article's seven, a division of memory, not a promise (`vllm/v1/core/kv_cache_utils.py:
# get_max_concurrency_for_kv_cache_config`). At its default utilization, 0.92, the log says 5.08x.
# The simulations in this book hand out every block of their pool; a null block would change them
# by one block.
#
# ## Fitting is not serving
#
# Suppose the six sequences run. Every decode step reads all of the weights once and the whole
# history of every sequence, and a new request waits until one of them finishes. A roofline
# prices one step on a device with memory bandwidth $W$ and peak arithmetic rate $P$:
#
# $$t_{\text{step}} = \max\Big(\frac{\text{bytes read and written}}{W},\ \frac{\text{operations}}{P}\Big)$$
#
# - bytes: the weights once, the K/V history of every scheduled sequence, and the new K/V;
# - operations: about 2 per weight per token, plus attention: $4 \times \text{layers} \times
#   \text{query heads} \times \text{head dim}$ per new token and position attended to.
#
# The device figures are **datasheet** peaks, which real kernels do not reach: the model is a lower
# bound on time, good for comparing settings ([appendix A6](A6_measuring_a_server.ipynb) checks it
# against a real engine).

# %%
print(f"{'device (datasheet)':<20} {'memory':>8} {'bandwidth':>12} {'bf16 dense':>14}")
for d in DEVICES.values():
    print(f"{d.name:<20} {format_bytes(d.memory_bytes):>8} {d.memory_bandwidth / 1e12:>8.3f} TB/s "
          f"{d.peak_flops / 1e12:>9.1f} TFLOPS")
print()
for name, m in MODEL_COSTS.items():
    print(f"{name:<16} {m.num_params / 1e9:5.2f} B weights = {format_bytes(m.weight_bytes):>11} in bf16, "
          f"KV {format_bytes(m.shape.bytes_per_token())}/token")
teaching = MODEL_COSTS["teaching model"]
assert round(teaching.num_params / 1e9, 2) == 8.03 and 14 * GiB < teaching.weight_bytes < 15 * GiB  # quoted below


# %% [markdown]
# The article gives only the teaching model's cache shape, which is Llama-3-8B's, so we give it
# Llama-3-8B's weights: 8.03 billion parameters, under 15 GiB in bf16, which makes 17 GiB for
# weights, workspace and reserve plausible. What do the six sequences cost per step on a 24 GiB,
# RTX-4090-class card?

# %%
cost = CostModel("teaching model", "RTX 4090 (24 GiB)")
full = cost.step([(8191, 1)] * 6)  # six sequences at 8,191 tokens each decode their next token
alone = cost.step([(8191, 1)])
prefill = cost.step([(0, 8192)])
print(f"decode step, 6 sequences of 8,192: {full.time_s * 1e3:.1f} ms ({full.bound}-bound), "
      f"{full.bytes_moved / GiB:.1f} GiB read")
print(f"decode step, 1 sequence of 8,192:  {alone.time_s * 1e3:.1f} ms")
print(f"prefill of one 8,192-token prompt: {prefill.time_s * 1e3:.0f} ms ({prefill.bound}-bound)")
print(f"tokens/s: {6 / full.time_s:.0f} for the six together, {1 / full.time_s:.0f} for each")
assert full.bound == "memory" and prefill.bound == "compute"
free_for_a_seventh = pool.num_blocks_after_management - 6 * pool.blocks_per_sequence
print(f"free blocks beside the six: {free_for_a_seventh} = {free_for_a_seventh * 16:,} tokens")
assert free_for_a_seventh == 511 and 0.5 < prefill.time_s < 1  # quoted below
assert round(full.bytes_moved / GiB) == 21 and round(full.time_s * 1e3) == 22  # the figures in the text below


# %% [markdown]
# Six long sequences read about 21 GiB per step, so each gets a token every 22 ms or so. A seventh
# request *can* start in the 511 free blocks, but cannot finish as a full 8,192-token sequence
# beside the six: when the pool runs out the scheduler preempts a request (chapter 05), which later
# recomputes its history, most of a second of prefill at this length. Its latency is set by *other*
# requests' lengths, not by the memory formula.
#
# ## Concurrency: shared weights, multiplied history
#
# The weights are read once per step however many sequences share it, so the first extra
# sequences are nearly free. But each sequence also reads its own history every step:

# %%
batches = np.arange(1, 129)
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
fits = {}
for i, context in enumerate((512, 2048, 8192)):
    times = np.array([cost.decode_step_time(int(b), context) for b in batches])
    # how many sequences of this length the 7 GiB pool holds (after its bookkeeping)
    fits[context] = pool.num_blocks_after_management // blocks_needed(context, 16)
    inside = batches <= fits[context]
    for ax, y in ((left, times * 1e3), (right, batches / times)):
        ax.plot(batches[inside], y[inside], color=f"C{i}", label=f"context {context:,}")
        ax.plot(batches[~inside], y[~inside], color=f"C{i}", linestyle=":", alpha=0.6)
        if fits[context] < batches[-1]:
            ax.plot(fits[context], y[fits[context] - 1], "o", color=f"C{i}")
left.set_xlabel("sequences in the step")
left.set_ylabel("step time = inter-token latency, ITL (ms)")
left.set_title("Every sequence adds its history to every step (roofline)")
right.set_xlabel("sequences in the step")
right.set_ylabel("tokens/s (all sequences)")
right.set_title("Throughput gains flatten as history dominates (roofline)")
left.legend(title="solid: fits in the 7 GiB pool", title_fontsize=8, fontsize=8)
fig.tight_layout()
plt.show()

# %%
for context in (512, 2048, 8192):
    print(f"context {context:>5,}: history read equals the weight read at "
          f"{cost.breakeven_batch(context):6.1f} sequences; 64 sequences decode "
          f"{64 / cost.decode_step_time(64, context):7,.0f} tokens/s vs {1 / cost.decode_step_time(1, context):4.0f} alone")
assert cost.decode_step_time(64, 512) < 1.5 * cost.decode_step_time(1, 512)   # short: nearly free
assert cost.decode_step_time(64, 8192) > 3 * cost.decode_step_time(1, 8192)   # long: history dominates
assert round(cost.breakeven_batch(8192)) == 15                                  # quoted below
print("sequences the 7 GiB pool holds: " + ", ".join(f"{n} of {c:,} tokens" for c, n in fits.items()))
assert fits[8192] == 6 and fits[512] > 64


# %% [markdown]
# With 512-token contexts, 64 sequences decode in about the time of one. With 8,192-token contexts,
# history equals the weights at about 15 sequences, and beyond that every added sequence slows
# everyone's next token. The curves turn dotted where the batch no longer fits §06's pool (the
# dots): six sequences of 8,192 tokens.
#
# ## Workloads, and the lengths to keep beside every result
#
# `labkit.serving.sim.workloads` draws requests with Poisson arrivals and **log-normal** prompt and output
# lengths (positive and right-skewed: most short, a few very long), with the means the
# PagedAttention paper reports for ShareGPT and Alpaca. The spread, and the clip at 1,024 tokens
# each, are the book's choices (vLLM's benchmark drops such samples instead of clipping them).

# %%
# NBVAL_SKIP_IN_SOLUTIONS
# NBVAL_CHECK_OUTPUT
chat = workloads.sharegpt_like(10_000, arrival_rate=4.0, seed=0)
instruct = workloads.alpaca_like(10_000, arrival_rate=4.0, seed=0)
paper = {p.name: (p.prompt_mean, p.output_mean) for p in (workloads.SHAREGPT, workloads.ALPACA)}
assert workloads.SHAREGPT.max_prompt_len == workloads.SHAREGPT.max_output_len == 1024
print(f"{'workload':<14} {'prompt mean':>12} {'(paper)':>8} {'output mean':>12} {'(paper)':>8} "
      f"{'prompt p50/p99':>15} {'output p50/p99':>15}")
for name, w in (("ShareGPT-like", chat), ("Alpaca-like", instruct)):
    s = workloads.length_stats(w)
    print(f"{name:<14} {s['prompt_mean']:12.1f} {paper[name][0]:8.2f} {s['output_mean']:12.1f} "
          f"{paper[name][1]:8.2f} {s['prompt_p50']:7.0f}/{s['prompt_p99']:<7.0f} {s['output_p50']:7.0f}/{s['output_p99']:<7.0f}")
    assert abs(s["prompt_mean"] / paper[name][0] - 1) < 0.03 and abs(s["output_mean"] / paper[name][1] - 1) < 0.03

# %%
# NBVAL_SKIP_IN_SOLUTIONS
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
for ax, (name, w) in zip(axes, (("ShareGPT-like", chat), ("Alpaca-like", instruct))):
    bins = np.geomspace(1, 1024, 40)
    ax.hist([r.prompt_len for r in w], bins=bins, alpha=0.6, label="prompt")
    ax.hist([r.output_len for r in w], bins=bins, alpha=0.6, label="output")
    ax.set_xscale("log")
    ax.set_xlabel("length (tokens, log scale)")
    ax.set_ylabel("requests")
    ax.set_title(f"{name} (synthetic): skewed, with a long tail")
    ax.legend()
fig.tight_layout()
plt.show()


# %% [markdown]
# ## Serving a workload
#
# `labkit.serving.sim.simulator.Simulator` serves a workload with chapter 05's `Scheduler`, on a real
# `BlockAllocator` and `PrefixCache`. Nothing is computed: tokens are synthetic ids, and each step
# lasts what the cost model says (the tests check that it plans the same steps as chapter 05's
# engine). Here, 400 ShareGPT-like requests arrive at 4 per second into the 7 GiB pool, with at
# most 256 running at once (`max_num_seqs`).
#
# A user waits first for the answer to start, then for each next token. vLLM's serving benchmark
# (`vllm/benchmarks/serve.py: calculate_metrics`) reports three measurements:
#
# - **TTFT**, *time to first token*: from arrival to the first output token, queueing plus
#   prefill. One sample per request.
# - **ITL**, *inter-token latency*, the article's "inter-token interval": every interval between
#   two tokens of a request, all pooled.
# - **TPOT**, *time per output token*: per request, (end-to-end latency − TTFT) / (output tokens −
#   1), the mean of its own intervals.
#
# TPOT weighs every request the same; ITL weighs every token, so a single stall is one large
# sample in the ITL tail but is averaged over a whole answer in TPOT.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
serve = Simulator(cost, pool_bytes=pool.pool_bytes, block_size=16, max_num_batched_tokens=2048)
print(serve)  # every block of the 7 GiB pool: the convention of every simulation in the book
assert serve.num_blocks == pool.num_blocks == 3584
chat_run = serve.run(workloads.sharegpt_like(400, arrival_rate=4.0, seed=1))

# %%
# NBVAL_SKIP_IN_SOLUTIONS
def tpot(result) -> np.ndarray:
    """Time per output token of every request with more than one output token (vLLM's TPOT)."""
    many = result.output_len > 1
    return (result.finish - result.first_token)[many] / (result.output_len[many] - 1)


def tpot_percentiles(result) -> dict[str, float]:
    return {f"p{q}": float(np.percentile(tpot(result), q)) for q in (50, 90, 99)}


def show(result):
    """The article's four measurements, with the length distributions beside them."""
    t, i, o = result.ttft_percentiles(), result.itl_percentiles(), tpot_percentiles(result)
    print(f"TTFT  p50 {t['p50'] * 1e3:7.1f} ms   p90 {t['p90'] * 1e3:7.1f} ms   p99 {t['p99'] * 1e3:8.1f} ms")
    print(f"TPOT  p50 {o['p50'] * 1e3:7.1f} ms   p90 {o['p90'] * 1e3:7.1f} ms   p99 {o['p99'] * 1e3:8.1f} ms")
    print(f"ITL   p50 {i['p50'] * 1e3:7.1f} ms   p90 {i['p90'] * 1e3:7.1f} ms   p99 {i['p99'] * 1e3:8.1f} ms")
    print(f"cache occupancy {result.mean_occupancy:.1%} on average, {result.used_blocks.max() / result.num_blocks:.1%} "
          f"at most; live tokens fill {result.live_token_share:.1%} of the held slots")
    print(f"prompt tokens from the prefix cache {result.reuse_ratio:.1%} (reusable {result.reusable_ratio:.1%})")
    print(f"throughput {result.output_tokens_per_s:,.0f} output tokens/s, {result.requests_per_s:.2f} requests/s, "
          f"{int(result.preemptions.sum())} preemptions")
    print(f"lengths: prompt mean {result.prompt_len.mean():.0f} (p99 {np.percentile(result.prompt_len, 99):.0f}), "
          f"output mean {result.output_len.mean():.0f} (p99 {np.percentile(result.output_len, 99):.0f})")


show(chat_run)
assert chat_run.live_token_share > 0.95  # the allocator's own blocks agree with chapter 03's paged share
# TPOT and ITL are two averages of the same intervals: weighted by tokens, they sum to the same time.
many = chat_run.output_len > 1
assert np.isclose((tpot(chat_run) * (chat_run.output_len[many] - 1)).sum(), (chat_run.itl * chat_run.itl_weight).sum())
assert tpot_percentiles(chat_run)["p99"] < chat_run.itl_percentiles()["p99"]  # stalls are averaged away in TPOT


# %% [markdown]
# The medians of TPOT and ITL are close: most intervals are one decode step. The ITL p99 is well
# above the TPOT p99: steps that also carried another request's prefill are single samples in the
# ITL. A reader of a benchmark must know which of the two it quotes.
#
# ## Occupancy, and a pool under pressure

#
# The same run over time: the share of the pool its requests hold, and the latencies as
# distributions.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
left.step(chat_run.step_start, chat_run.used_blocks / chat_run.num_blocks, where="post", label="blocks held")
left.step(chat_run.step_start, chat_run.live_tokens / (chat_run.num_blocks * 16), where="post", label="live tokens")
left.set_xlabel("simulated time (s)")
left.set_ylabel("share of the pool")
left.set_title("Occupancy follows the traffic (simulated)")
left.legend()
for values, label in ((chat_run.ttft, "time to first token (TTFT)"),
                      (np.repeat(chat_run.itl, chat_run.itl_weight.astype(int)), "inter-token latency (ITL)")):
    right.plot(np.sort(values) * 1e3, np.linspace(0, 1, len(values)), label=label)
right.set_xscale("log")
lo, hi = right.get_xlim()
ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000) if lo <= t <= hi]
right.set_xticks(ticks, [f"{t:,}" for t in ticks])
right.xaxis.set_minor_formatter(NullFormatter())
assert len(ticks) >= 3
right.set_xlabel("latency (ms, log scale)")
right.set_ylabel("share of requests / tokens")
right.set_title("TTFT spreads with prompt length and queueing (simulated)")
right.legend()
fig.tight_layout()
plt.show()


# %% [markdown]
# This traffic never holds more than the peak printed above, so nothing is preempted. The same 400
# requests in a 1 GiB pool:

# %%
# NBVAL_SKIP_IN_SOLUTIONS
tight_run = Simulator(cost, pool_bytes=1 * GiB, block_size=16, max_num_batched_tokens=2048).run(
    workloads.sharegpt_like(400, arrival_rate=4.0, seed=1))
show(tight_run)
assert chat_run.used_blocks.max() / chat_run.num_blocks < 0.5 and chat_run.preemptions.sum() == 0
assert tight_run.used_blocks.max() == tight_run.num_blocks and tight_run.preemptions.sum() > 100
assert tight_run.ttft_percentiles()["p50"] > 10 and chat_run.ttft_percentiles()["p50"] < 0.1
assert tight_run.mean_occupancy > 0.8
assert abs(tight_run.itl_percentiles()["p50"] / chat_run.itl_percentiles()["p50"] - 1) < 0.1  # ITL p50 hardly moves


# %% [markdown]
# Now the pool is full at its peak and mostly full on average; requests are preempted hundreds of
# times and recompute their history, and TTFT grows from tens of milliseconds to more than ten
# seconds at the median, because new requests wait for blocks. The ITL median hardly moves: a
# request that runs still gets a token every step. Pressure on the pool shows first in TTFT.
# ([Appendix A6](A6_measuring_a_server.ipynb) turns up the arrival rate, over several draws.)
#
# ## Long documents against many short requests
#
# §06 warns that a setting that suits long-document reuse need not suit many distinct short
# requests. Two workloads:
#
# - **long-document questions**: each prompt is one of four 4,096-token documents followed by a
#   short question (the reusable part is the document);
# - **distinct short requests**: prompts and answers of about 48 tokens, sharing nothing.
#
# First the memory the pool gets: each workload with a 2 GiB and with §06's 7 GiB pool, everything
# else equal (1,024 tokens per step, at most 256 requests running).

# %%
# NBVAL_SKIP_IN_SOLUTIONS
docs = workloads.long_document_questions(100, arrival_rate=3.0, num_documents=4, seed=3)
short = workloads.distinct_short_requests(400, arrival_rate=80.0, seed=4)
runs = [(w, p, b) for w in ("long-document questions", "distinct short requests")
        for p, b in ((2, 1024), (7, 1024), (2, 128))]
grid = {}
for wname, pool_gib, budget in runs:
    w = docs if wname.startswith("long") else short
    grid[wname, pool_gib, budget] = Simulator(cost, pool_bytes=pool_gib * GiB, max_num_batched_tokens=budget).run(w)


def table(keys):
    """One row per run; latencies in ms."""
    print(f"{'workload':<10}{'pool':>7}{'budget':>7}{'TTFT p50':>9}{'p90':>7}{'p99':>7}{'ITL p50':>8}{'p99':>5}"
          f"{'occup.':>7}{'reuse':>7}{'reusable':>9}{'preempt':>8}")
    for key in keys:
        (wname, pool_gib, budget), r = key, grid[key]
        t, i = r.ttft_percentiles(), r.itl_percentiles()
        name = "documents" if wname.startswith("long") else "short"
        print(f"{name:<10}{pool_gib:>3} GiB{budget:>7}{t['p50'] * 1e3:>9.0f}{t['p90'] * 1e3:>7.0f}{t['p99'] * 1e3:>7.0f}"
              f"{i['p50'] * 1e3:>8.1f}{i['p99'] * 1e3:>5.0f}{r.mean_occupancy:>7.1%}{r.reuse_ratio:>7.1%}"
              f"{r.reusable_ratio:>9.1%}{int(r.preemptions.sum()):>8d}")


assert all(r.scheduler.max_num_seqs == 256 for r in grid.values())
print("latencies in ms; documents = long-document questions, short = distinct short requests")
table([k for k in grid if k[2] == 1024])
for wname, w in (("long-document questions", docs), ("distinct short requests", short)):
    s = workloads.length_stats(w)
    print(f"  {wname}: prompt mean {s['prompt_mean']:.0f} tokens, output mean {s['output_mean']:.0f} tokens")
short_small, short_big = grid["distinct short requests", 2, 1024], grid["distinct short requests", 7, 1024]
docs_small, docs_big = grid["long-document questions", 2, 1024], grid["long-document questions", 7, 1024]
assert np.array_equal(short_small.ttft, short_big.ttft) and np.array_equal(short_small.itl, short_big.itl)
assert short_small.preemptions.sum() == 0 and short_small.used_blocks.max() < short_small.num_blocks
assert docs_small.ttft_percentiles()["p90"] > 10 * docs_big.ttft_percentiles()["p90"]     # 2 GiB is not enough
assert docs_small.ttft_percentiles()["p50"] > 10 * docs_big.ttft_percentiles()["p50"]
assert docs_small.reuse_ratio < docs_big.reuse_ratio and docs_small.preemptions.sum() == 0  # vLLM's gate
doc_bytes = 4 * 4096 * TEACHING_MODEL.bytes_per_token()
print(f"four documents of 4,096 tokens: {format_bytes(doc_bytes)} of K/V")
assert doc_bytes == 2 * GiB


# %% [markdown]
# For distinct short requests, 2 GiB serves exactly as well as 7 GiB (every TTFT and interval
# identical, checked above): even the small pool never ran out. For long-document questions the
# same 2 GiB breaks the service: the four documents alone fill it, documents the next question
# needs are evicted, reuse falls, questions wait until their whole prompt fits (vLLM's admission
# gate, chapter 05), and TTFT goes from tens of milliseconds to seconds.
#
# Is there a setting that helps one workload and *hurts* the other? The token budget of a step, in
# the 2 GiB pool:

# %%
# NBVAL_SKIP_IN_SOLUTIONS
table([k for k in grid if k[1] == 2])
docs_128 = grid["long-document questions", 2, 128]
short_128 = grid["distinct short requests", 2, 128]
for label, base, small in (("long-document questions", docs_small, docs_128),
                           ("distinct short requests", short_small, short_128)):
    t0, t1 = base.ttft_percentiles(), small.ttft_percentiles()
    print(f"{label}: budget 1,024 -> 128 changes TTFT p50 {t0['p50'] * 1e3:.0f} -> {t1['p50'] * 1e3:.0f} ms, "
          f"p90 {t0['p90'] * 1e3:.0f} -> {t1['p90'] * 1e3:.0f} ms, reuse {base.reuse_ratio:.1%} -> "
          f"{small.reuse_ratio:.1%}")
# a budget of 128 is better for long-document questions in this pool...
assert docs_128.ttft_percentiles()["p50"] < docs_small.ttft_percentiles()["p50"]
assert docs_128.ttft_percentiles()["p90"] < docs_small.ttft_percentiles()["p90"]
assert docs_128.reuse_ratio > docs_small.reuse_ratio
# ...and worse for distinct short requests
assert short_128.ttft_percentiles()["p50"] > 1.5 * short_small.ttft_percentiles()["p50"]
assert short_128.ttft_percentiles()["p99"] > 2 * short_small.ttft_percentiles()["p99"]
running = float(np.average(short_small.num_running, weights=short_small.step_time))
step_s = float(np.median(short_small.step_time))
print(f"distinct short requests: {running:.0f} requests running on average, steps of {step_s * 1e3:.0f} ms, "
      f"{80.0 * step_s:.1f} arrivals per step with prompts of {short_small.prompt_len.mean():.0f} tokens "
      f"on average (p99 {np.percentile(short_small.prompt_len, 99):.0f})")
assert 128 - running < 2 * np.percentile(short_small.prompt_len, 99)  # a burst of prompts overflows the budget


# %% [markdown]
# A budget of 128 tokens per step helps the long-document questions in the tight pool (TTFT falls
# at p50 and p90, shorter steps, reuse nearly unchanged) and hurts the distinct short requests: the
# running requests' decodes take a large share of the 128 tokens, what is left does not cover a
# burst of new prompts, and TTFT grows at p50, p90 and p99. A setting is good *for a workload and a
# pool*, and only a measurement says which. ([Appendix A6](A6_measuring_a_server.ipynb) repeats
# this comparison over five draws and shows its mechanism.)
#
# ## Reusable against reused
#
# The article's reusable-token ratio counts the prompt tokens that *could* come from the cache: the
# full blocks of a prefix that another request shares. The reuse ratio counts what *did*. For the
# long-document questions in the 7 GiB pool:

# %%
# NBVAL_SKIP_IN_SOLUTIONS
total_prompt = docs_big.prompt_len.sum()
first_reads = 4 * 4096 / total_prompt  # somebody has to compute each document once
print(f"reusable {docs_big.reusable_ratio:.1%}, reused {docs_big.reuse_ratio:.1%}, "
      f"each document computed once: {first_reads:.1%} of the prompt tokens")
missing = docs_big.reusable_ratio - docs_big.reuse_ratio
print(f"gap {missing:.1%}: {first_reads:.1%} for the first reads, {missing - first_reads:.1%} for questions "
      f"admitted while their document was still being computed (or after it was evicted)")
assert docs_big.reusable_ratio > docs_big.reuse_ratio > 0.9
assert missing >= first_reads - 1e-12
gap_small = docs_small.reusable_ratio - docs_small.reuse_ratio
print(f"in the 2 GiB pool: reused {docs_small.reuse_ratio:.1%}, gap {gap_small:.1%}, "
      f"of which {gap_small - first_reads:.1%} beyond the first reads")
assert gap_small > missing + 0.05  # evictions cost reuse


# %% [markdown]
# The reusable ratio is an upper bound that the workload sets; the reuse ratio is what the engine
# achieved. The first question on each document must compute it: in the 7 GiB pool that is the
# whole gap. In the 2 GiB pool documents are evicted between questions and computed again, and the
# gap grows. Long-document decodes are also slower per step than short ones at the same batch,
# because every sequence reads its history of more than 4,096 tokens:

# %%
# NBVAL_SKIP_IN_SOLUTIONS
batch = 16
long_ctx, short_ctx = 4096 + 32 + 64, 48 + 24
t_long, t_short = cost.decode_step_time(batch, long_ctx), cost.decode_step_time(batch, short_ctx)
print(f"{batch} sequences decoding: {t_long * 1e3:.1f} ms per step at {long_ctx:,} tokens of history, "
      f"{t_short * 1e3:.1f} ms at {short_ctx}")
assert t_long > 1.3 * t_short


# %% [markdown]
# ## Explore the load
#
# The explorer serves 100 ShareGPT-like requests that all start with the same **system prompt**,
# for the arrival rate, system-prompt length, block size and pool size you choose, with prefix
# caching on or off. With caching on the system prompt is computed once and shared.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
from labkit.teaching.widgets.load_explorer import SYSTEM_PROMPT_LEN, explore, load_explorer

load_explorer(cost)


# %% [markdown]
# For readers without a live kernel, one of its experiments: 80 requests with a 512-token system
# prompt in a 2 GiB pool, the same prompts with prefix caching on and off.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
caching_rates = (1, 3, 6, 9)
caching = {(on, rate): explore(rate, SYSTEM_PROMPT_LEN, 16, 2.0, enable_prefix_caching=on, num_requests=80,
                               cost_model=cost)
           for on in (True, False) for rate in caching_rates}
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
for on, style in ((True, "o-"), (False, "s--")):
    label = f"prefix caching {'on' if on else 'off'}"
    left.plot(caching_rates, [caching[on, r].ttft_percentiles()["p99"] * 1e3 for r in caching_rates], style,
              label=label)
    right.plot(caching_rates, [caching[on, r].mean_occupancy for r in caching_rates], style, label=label)
left.set_yscale("log")
left.set_xlabel("arrival rate (requests/s)")
left.set_ylabel("TTFT p99 (ms)")
left.set_title(f"{SYSTEM_PROMPT_LEN}-token system prompt: sharing keeps TTFT low (simulated)", fontsize=10)
left.legend(fontsize=8)
right.set_xlabel("arrival rate (requests/s)")
right.set_ylabel("mean pool occupancy")
right.set_ylim(0, 1.05)
right.set_title("...and the 2 GiB pool emptier (simulated)", fontsize=10)
fig.tight_layout()
plt.show()
for rate in caching_rates:
    on, off = caching[True, rate], caching[False, rate]
    print(f"{rate} req/s: TTFT p99 {on.ttft_percentiles()['p99'] * 1e3:7.0f} ms on, {off.ttft_percentiles()['p99'] * 1e3:7.0f} ms "
          f"off; occupancy {on.mean_occupancy:.0%} / {off.mean_occupancy:.0%}; reuse {on.reuse_ratio:.0%}; "
          f"preemptions {int(on.preemptions.sum())} / {int(off.preemptions.sum())}")
    assert np.array_equal(on.prompt_len, off.prompt_len)  # the same prompts: only the sharing differs
    assert on.ttft_percentiles()["p99"] < off.ttft_percentiles()["p99"] and on.mean_occupancy < off.mean_occupancy
assert all(caching[True, r].ttft_percentiles()["p99"] < 0.1 for r in caching_rates)
assert all(caching[False, r].ttft_percentiles()["p99"] > 1 for r in caching_rates[1:])


# %% [markdown]
# With caching on, each request prefills only its own tokens and holds one shared copy of the
# system prompt, so TTFT p99 stays under a tenth of a second at every rate. With caching off, every
# request stores its own copy: the pool fills, requests are preempted, and from 3 requests/s on
# TTFT p99 runs into seconds.
#
# The figures quoted in the summary, checked:

# %%
# NBVAL_SKIP_IN_SOLUTIONS
assert format_bytes(pool.management_bytes) == "577 KiB"
assert docs_128.ttft_percentiles()["p50"] < docs_small.ttft_percentiles()["p50"]
assert short_128.ttft_percentiles()["p50"] > short_small.ttft_percentiles()["p50"]


# %% [markdown]
# ## Summary
#
# - A device's memory minus weights, workspace and reserve is the KV pool: 24 − 17 = 7 GiB, 3,584
#   blocks, seven 8,192-token sequences of the teaching model. The bookkeeping (577 KiB) costs a
#   whole sequence when the count was exact: six remain. vLLM's "7.00x" divides all blocks, its
#   null block included; it too runs six in full.
# - A roofline step time shows why fitting is not serving: weights are read once per step, history
#   once per sequence per step. Concurrency is nearly free for short contexts and expensive for
#   long ones.
# - To judge a setting, measure cache occupancy, the reusable-token ratio, TTFT, TPOT and ITL, and
#   keep the input and output length distributions beside them. Pressure on the pool shows first
#   in TTFT.
# - The same pool can be plenty for distinct short requests and break long-document questions; in
#   that pool a 128-token budget helps the documents and hurts the short requests. Capacity
#   formulas say what fits; workload experiments say how fast it is served, and for whom.
# - The reusable-token ratio bounds the reuse ratio; first reads and evictions make the gap.
# - These latencies are simulated. [Appendix A6](A6_measuring_a_server.ipynb) measures them over
#   several draws, runs the paper's headline, and checks the simulator against a real engine.

# %% [markdown]
# ## Exercises

# %%
from labkit.teaching.exercises import Exercises
from labkit.teaching.guards import Metered, TooManyCalls, calls_made, draws_hidden_cases, function_shape

ex = Exercises("06_from_fit_to_serve")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/ a failing checker fails the notebook tests

# %% [markdown]
# **Exercise 1.** Keep §06's device (24 GiB, 17 GiB set aside) and the same engine limits (256
# sequence slots, 8,192-token sequences, 8,192-token steps), but use 32-token blocks. The block
# tables get half as many entries. How many 8,192-token sequences fit once the bookkeeping is paid
# out of the pool? Compute it step by step (pool bytes, bookkeeping bytes, whole blocks left,
# blocks per sequence) without `plan_pool`.

# %%
# BEGIN SOLUTION
block_bytes = 32 * TEACHING_MODEL.bytes_per_token()                       # 4 MiB
blocks_per_seq = 8192 // 32                                              # 256
bookkeeping = 256 * blocks_per_seq * 4 + 256 * 4 + 8192 * 8              # tables + lengths + slot mapping
blocks_left = int((7 * GiB - bookkeeping) // block_bytes)                # 1,791
answer_1 = blocks_left // blocks_per_seq
# END SOLUTION
# BEGIN STUB
answer_1 = None  # replace None with your computation
# END STUB
ex.check("Exercise 1", answer_1, hint="Whole blocks: floor((pool - bookkeeping) / block bytes); a sequence needs 8,192 / 32 blocks.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** The pool holds whole blocks only, so any bookkeeping at all costs at least one
# of them: 7 GiB is exactly 1,792 blocks of 4 MiB, the 321 KiB of tables take one, and 1,791 blocks
# hold six sequences of 256 blocks, not seven. Halving the block tables did not change the answer.

# %% [markdown]
# **Exercise 2.** Write `decode_ms(batch, context, bandwidth)`: the memory-side time, in
# milliseconds, of one decode step of the teaching model (with its Llama-3-8B weights, 2 bytes
# each) for `batch` sequences that each hold `context` tokens, on a device with `bandwidth` bytes
# per second. Read the weights once, each sequence's history, and write one new token's K/V per
# sequence. Use `MODEL_COSTS["teaching model"].weight_bytes` for the weights. The checker draws
# batches, contexts and devices afresh on every run, and refuses the cost model's own step times.

# %%
def decode_ms(batch, context, bandwidth):
    # BEGIN SOLUTION
    weights = MODEL_COSTS["teaching model"].weight_bytes
    kv_per_token = TEACHING_MODEL.bytes_per_token()
    return (weights + batch * (context + 1) * kv_per_token) / bandwidth * 1e3
    # END SOLUTION


from labkit.serving.sim import fit


@draws_hidden_cases
def ex2_cases(rng) -> list:
    """A single sequence, then batches and contexts drawn afresh, each on a device drawn afresh."""
    settings = [(1, rng.randint(0, 200))] + [(rng.randint(2, 256), rng.randint(1, 16_384)) for _ in range(4)]
    return [((b, c, DEVICES[d].memory_bandwidth), CostModel("teaching model", d).memory_bound_step(b, b * c) * 1e3)
            for (b, c), d in zip(settings, (rng.choice(sorted(DEVICES)) for _ in settings))]


ex.check_function("Exercise 2", decode_ms, ex2_cases(),
                  rel_tol=1e-9, hint="bytes = weights + batch × (context + 1) × 131,072; divide by the bandwidth.",
                  forbid=[CostModel, fit._predict])

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** A decode step reads every weight once, however many sequences share it, and each
# sequence's whole history plus the K/V of its one new token; at these sizes the bytes, not the
# arithmetic, set the time, so bytes over bandwidth is the step (the cost model's memory side).

# %% [markdown]
# **Exercise 3 (build it).** Write `latencies(arrivals, steps)`: request `i` arrives at `arrivals[i]`;
# each step is `(start, end, sampled)`, and every request in `sampled` gets a token at `end`. Return
# `(ttft, tpot, itl)`: per request its TTFT and TPOT (the mean interval between its tokens; `None`
# for one token), and every interval between two tokens of one request, sorted. The checker builds
# traces with the simulator, a late arrival and a one-token request included.

# %%
def latencies(arrivals: list[float], steps: list[tuple[float, float, list[int]]]):
    # BEGIN SOLUTION
    first, last, count, itl = {}, {}, {}, []
    for _, end, sampled in steps:  # walk the clock: each token lands at its step's end
        for i in sampled:
            if i in first:
                itl.append(end - last[i])  # an interval between two of its tokens
            else:
                first[i] = end
            last[i], count[i] = end, count.get(i, 0) + 1
    ttft = [first[i] - arrival for i, arrival in enumerate(arrivals)]  # queueing included
    tpot = [None if count[i] == 1 else (last[i] - first[i]) / (count[i] - 1) for i in range(len(arrivals))]
    return ttft, tpot, sorted(itl)
    # END SOLUTION


from labkit.serving.sim.simulator import SimResult
from labkit.teaching import build_it

ex.check_behaviour("Exercise 3", latencies, build_it.latencies_check(), forbid=[Simulator, SimResult],
                   hint="TTFT counts from the arrival; TPOT divides by the token count less one; ITL pools intervals.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** It mirrors `labkit/serving/sim/simulator.py: _Run._record_step` (the first token's step end,
# then one interval per later token) and `SimResult.ttft`; TPOT is the mean of a request's intervals.

# %% [markdown]
# **Exercise 4 (a search through the simulator).** `ttft_p99(rate)` below serves 100 ShareGPT-like
# requests at `rate` per second in a 2 GiB pool; each call is one simulation. Write
# `find_rate(curve, target_s, lo, hi, tol)`: for a rising `curve` with `curve(lo) <= target_s <
# curve(hi)`, return `(a, b)`, `lo <= a < b <= hi`, `b - a <= tol`, `curve(a) <= target_s <
# curve(b)`, in at most 10 calls. The checker tries two made-up curves and `ttft_p99` on a fresh
# workload, and counts the calls.

# %%
def ttft_p99(rate: float, seed: int = 5) -> float:
    """TTFT p99 (seconds) of 100 ShareGPT-like requests at ``rate`` requests/s in a 2 GiB pool."""
    run = Simulator(cost, pool_bytes=2 * GiB, max_num_batched_tokens=2048).run(
        workloads.sharegpt_like(100, arrival_rate=rate, seed=seed))
    return run.ttft_percentiles()["p99"]


def find_rate(curve, target_s: float, lo: float, hi: float, tol: float) -> tuple[float, float]:
    # BEGIN SOLUTION
    while hi - lo > tol:  # invariant: curve(lo) <= target_s < curve(hi)
        mid = (lo + hi) / 2
        if curve(mid) <= target_s:
            lo = mid
        else:
            hi = mid
    return lo, hi
    # END SOLUTION
    # BEGIN STUB
    raise NotImplementedError("your code here")
    # END STUB


@draws_hidden_cases
def check_search(rng, fn, limit: int = 10) -> list[str]:
    """Run the search on two made-up curves whose threshold the checker draws, then on the simulator
    with a workload drawn afresh. The search gets each curve behind a counter it cannot reset."""
    lo, hi, tol, target = 1.0, 16.0, 0.25, 1.0

    def step_at(threshold: float):
        """A made-up curve: 0.5 s up to ``threshold`` requests/s, 5 s past it."""
        return lambda rate: 0.5 if rate <= threshold else 5.0

    memo: dict[float, float] = {}
    seed = rng.randrange(10**6)  # a fresh workload moves the rate that meets the target
    while not ttft_p99(lo, seed) <= target < ttft_p99(hi, seed):  # the promise made to the search
        seed = rng.randrange(10**6)

    def simulated(rate: float) -> float:
        if rate not in memo:
            memo[rate] = ttft_p99(rate, seed)
        return memo[rate]

    cases = [("a made-up curve with a step below 8 req/s", step_at(rng.uniform(lo + tol, 8.0))),
             ("a made-up curve with a step above 8 req/s", step_at(rng.uniform(8.0, hi - tol))),
             ("ttft_p99 on a workload drawn for this run", simulated)]
    for label, curve in cases:
        metered = Metered(curve, limit)  # no closure, no attributes: the count and the curve stay the checker's
        try:
            answer = fn(metered, target, lo, hi, tol)
        except TooManyCalls:
            answer = None
        pair = type(answer) is tuple and len(answer) == 2 and \
            all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in answer)
        a, b = (float(x) for x in answer) if pair else (None, None)  # plain floats, before counting the calls
        if calls_made(metered) > limit:
            return [f"{label}: more than {limit} calls"]
        if not pair:
            return [f"{label}: return a pair of numbers (a, b), got {answer!r}"]
        if not lo <= a < b <= hi or b - a > tol:
            return [f"{label}: ({a:g}, {b:g}) is not an interval of width <= {tol} in [{lo}, {hi}]"]
        if not curve(a) <= target < curve(b):  # the checker's own evaluations, not counted
            return [f"{label}: the curve is {curve(a):.2f} s at {a:g} req/s and {curve(b):.2f} s at {b:g} req/s, "
                    f"which does not bracket the target {target} s (search the curve you are given)"]
    return []


ex.check_behaviour("Exercise 4", find_rate, check_search,
                   expects=function_shape("find_rate", "curve", "target_s", "lo", "hi", "tol"),
                   hint="bisect the curve you are given: keep lo at or under the target and hi above it, "
                        "halve the interval with each call.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** Each call halves the interval while keeping `curve(lo) <= target_s <
# curve(hi)`: after n calls it is 15 / 2ⁿ wide, so six calls bring it under 0.25.

# %% [markdown]
# **Quiz.** Answer with a letter or a number.
# 1. One request stalls once: which shows it? (a) TPOT p99; (b) ITL p99.
# 2. In a decode step, the batch shares (a) the weight read; (b) each history read.
# 3. About how many 4,096-token sequences make the teaching model's history read equal its weight read?
# 4. The same 400 requests in a 1 GiB pool instead of 7 GiB: what grows most? (a) the TTFT median;
#    (b) the ITL median; (c) the TPOT median.

# %%
# BEGIN SOLUTION
quiz = {1: "b", 2: "a", 3: 30, 4: "a"}
# END SOLUTION
# BEGIN STUB
quiz = {1: None, 2: None, 3: None, 4: None}  # a letter or a number each
# END STUB
ex.quiz(quiz)


# %% [markdown]
# ## What you can now do
#
# - Turn a device's memory into a KV pool in blocks, and say what the bookkeeping and vLLM's null
#   block take from it.
# - Price one engine step with a roofline and say when adding a sequence is nearly free and when
#   it slows everyone's next token.
# - Judge a serving setting by TTFT, TPOT and ITL percentiles, occupancy and reuse, with the length
#   distributions beside them, and show that one setting can help one workload and hurt another.
# - Search a simulator for the highest load that keeps a latency promise, in a handful of runs.
#
# Next, the [capstone](C1_your_own_engine.ipynb): your pieces from chapters 01 to 05 serve the real model.

# %% [markdown]
# ## References
#
# - The source article: *长上下文推理中的 KV Cache：容量、分页与复用边界* ("The KV cache in
#   long-context inference: capacity, paging and the limits of reuse"), a Chinese essay in six
#   sections; the copy the book follows gives no author or link. Its §06 (24 GiB − 17 GiB = 7 GiB,
#   occupancy, reusable-token ratio, TTFT, inter-token interval) is this chapter's outline.
# - Woosuk Kwon, Zhuohan Li, et al., *Efficient Memory Management for Large Language Model Serving
#   with PagedAttention*, SOSP 2023, [arXiv:2309.06180](https://arxiv.org/abs/2309.06180): the
#   ShareGPT and Alpaca length means of the workloads.
# - vLLM 0.33.0: [docs.vllm.ai](https://docs.vllm.ai/),
#   [github.com/vllm-project/vllm](https://github.com/vllm-project/vllm): `vllm/engine/arg_utils.py`
#   (`EngineArgs.get_batch_defaults`), `vllm/v1/core/block_pool.py` and
#   `vllm/v1/core/kv_cache_utils.py` for its count of seven, `vllm/benchmarks/serve.py`
#   (`calculate_metrics`) for TTFT, TPOT and ITL.
# - SGLang's RadixAttention (Lianmin Zheng et al., NeurIPS 2024,
#   [arXiv:2312.07104](https://arxiv.org/abs/2312.07104)): the other design of prefix reuse that
#   chapter 04 compares with vLLM's.
