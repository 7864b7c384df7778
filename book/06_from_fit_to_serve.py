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
# Chapter 02 turned a model's shape into bytes per token, and a device's memory into a number of
# sequences. That number answers "how much fits?". A user asks something else: "how long until my
# first token, and how fast do the others come?". This chapter goes from the first question to the
# second. It carves a real pool out of a device, prices every engine step with a roofline cost
# model, and serves synthetic traffic through the very scheduler, allocator and prefix cache of
# chapters 03 to 05, without a GPU.
#
# **What you will learn**
#
# - how a device's memory becomes a KV pool (§06: 24 GiB − 17 GiB = 7 GiB = seven 8,192-token
#   sequences of the teaching model), what the bookkeeping takes from it, and why vLLM's log says
#   "7.00x" while six sequences run in full;
# - why fitting is not serving: a roofline model of one step, where concurrency spreads the weight
#   read over more sequences but multiplies the history read;
# - the measurements that tell whether a setting serves well: cache occupancy, reusable-token
#   ratio, time to first token (TTFT), time per output token (TPOT) and inter-token latency (ITL),
#   with the length distributions beside them;
# - that a setting that serves many short requests well can fail long-document questions, and
#   that a setting can help one workload while hurting the other, in numbers;
# - how far the simulator's latencies are from a real engine's, measured.
#
# The details of vLLM's start-up log (its memory budget, its refusals, tensor parallelism and
# sliding windows) are in [appendix A2](A2_vllm_start_up.ipynb).

# %%
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import NullFormatter

import labkit
from labkit import workloads
from labkit.capacity import GiB, TEACHING_MODEL, format_bytes
from labkit.costmodel import DEVICES, MODEL_COSTS, CostModel
from labkit.paging import blocks_needed
from labkit.pool import plan_pool, reservation_shares
from labkit.sim import Simulator

print(labkit.describe())

# %% [markdown]
# ## From a device to a pool
#
# Before the cache gets a byte, the device holds the weights, the activations of the largest step
# (the *workspace*) and a safety reserve. What is left becomes the KV pool, cut into blocks.
# The article's example: a 24 GiB device with 17 GiB set aside for those three.

# %%
# NBVAL_CHECK_OUTPUT
pool = plan_pool(device_bytes=24 * GiB, set_aside_bytes=17 * GiB, model=TEACHING_MODEL, block_size=16,
                 max_model_len=8192)
print(pool.describe())
assert pool.pool_bytes == 7 * GiB and pool.num_blocks == 3584 and pool.sequences_that_fit == 7

# %% [markdown]
# Seven sequences of 8,192 tokens, as §06 says. Each is 512 blocks of 2 MiB, 1 GiB in all.
#
# ## What the bookkeeping takes
#
# The pool is not the only thing on the device that grows with the cache. An engine keeps, next to
# the K/V blocks, tensors that tell the attention kernel where everything is:
#
# - a **block table** per sequence slot: one int32 block id per block the sequence may hold
#   (chapter 03), sized for the longest allowed sequence and for every slot the engine may run;
# - the **sequence lengths** (int32 per slot);
# - the **slot mapping** of one step: where each new token's K and V go (int64 per token).
#
# Take the limits vLLM picks for its offline `LLM` class on a GPU under 70 GiB: 256 sequence
# slots and 8,192 tokens per step, with 8,192-token sequences. These are defaults *per GPU size*:
# vLLM 0.33.0 gives GPUs of 70 GiB or more four times the slots and twice the step
# (`vllm/engine/arg_utils.py: EngineArgs.get_batch_defaults`; [appendix A2](A2_vllm_start_up.ipynb)
# has the table), so on a larger GPU both the bookkeeping and the workspace grow. With these limits
# the bookkeeping is:

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
# Under 600 KiB, against a 7 GiB pool: the share printed above. Yet it costs a whole sequence, because the pool
# held *exactly* seven: 7 × 512 = 3,584 blocks. Losing one block leaves room for six full
# sequences and 511 blocks for shorter ones. Any capacity figure that lands on a round number is
# fragile in the same way. Engines also keep per-block metadata on the host (a reference count, a
# hash, free-queue links): it grows with the pool but lives in CPU memory.
#
# ## What vLLM prints, and what its seven counts
#
# vLLM does the same subtraction when it starts: it loads the weights, profiles its largest step,
# and gives the KV cache what is left of its budget, `ceil(device × gpu_memory_utilization)`.
# `labkit.vllm` redoes that arithmetic the way vLLM 0.33.0's code does. On the article's
# idealised device (all 24 GiB usable, `gpu_memory_utilization=1.0`) it prints the two lines
# below. That makes two answers to "how many 8,192-token sequences?": the six printed above, and
# vLLM's "7.00x". The cell computes what each one counts:

# %%
# NBVAL_CHECK_OUTPUT
from labkit import vllm

available = vllm.available_kv_bytes(gpu_total_bytes=24 * GiB, gpu_memory_utilization=1.0, non_kv_bytes=17 * GiB)
report = vllm.kv_cache_report(TEACHING_MODEL, available, block_size=16, max_model_len=8192)
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
at_default = vllm.kv_cache_report(TEACHING_MODEL, vllm.available_kv_bytes(24 * GiB, 0.92, 17 * GiB), max_model_len=8192)
print(f"\nat vLLM's default gpu_memory_utilization=0.92: {at_default.max_concurrency:.2f}x")
assert f"{at_default.max_concurrency:.2f}" == "5.08"

# %% [markdown]
# Both accountings end at six full sequences at once, one block short of seven, for two different
# reasons:
#
# - **This book** pays the block tables, lengths and slot mapping out of the pool (577 KiB, one
#   block). **vLLM** keeps them outside the KV pool: its `BlockTable` tensors
#   (`vllm/v1/worker/block_table.py`) are made with the model runner, *before* the profiling run
#   measures the memory, so they sit in the 17 GiB of non-KV memory and the pool keeps all 3,584
#   blocks.
# - vLLM's block pool then holds block 0 back as the **null block** (a placeholder that block
#   tables point at where a block was skipped, e.g. behind a sliding window), so 3,583 blocks can
#   be handed out: six requests of 512 blocks and 511 blocks over.
# - The log's "**Maximum concurrency**" divides *all* the blocks, the null block included, by the
#   blocks one request needs (`max_concurrency = num_blocks / blocks per request`,
#   `vllm/v1/core/kv_cache_utils.py: get_max_concurrency_for_kv_cache_config`): 3,584 / 512 = 7.00,
#   the article's seven. It is a division of memory, not a promise that seven full requests run.
#
# A real GPU never starts at `gpu_memory_utilization=1.0` (vLLM first checks that the free memory
# covers the budget, and free memory is below the total once the CUDA context exists). Its
# default, 0.92, leaves 8% more outside the cache, and on this device the log says 5.08x (the
# cell's last line). [Appendix A2](A2_vllm_start_up.ipynb) rebuilds the rest of the log: the
# refusal of a `max_model_len` that does not fit, tensor parallelism, MLA, and sliding windows.

# %% [markdown]
# ## Fitting is not serving
#
# Suppose the six sequences fit and run. Every decode step must read all of the weights once and
# the whole history of every sequence, and a new request must wait until one of them finishes. A
# roofline model prices this. For one step on a device with memory bandwidth $W$ and peak
# arithmetic rate $P$:
#
# $$t_{\text{step}} = \max\Big(\frac{\text{bytes read and written}}{W},\ \frac{\text{operations}}{P}\Big)$$
#
# - bytes: the weights once, the K/V history of every scheduled sequence, and the new K/V;
# - operations: about 2 per weight per token (a multiply and an add), plus attention: for each new
#   token, $4 \times \text{layers} \times \text{query heads} \times \text{head dim}$ per position it
#   attends to.
#
# The device figures are **datasheet** peaks, which real kernels do not reach: the model gives a
# lower bound on time, good for comparing settings, not for promising latencies.

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
# The article gives the teaching model's cache shape only. Its numbers (32 layers, 8 KV heads, head
# dimension 128) are Llama-3-8B's, so we give it Llama-3-8B's weights: 8.03 billion parameters,
# just under 15 GiB in bf16, which is why 17 GiB for weights, workspace and reserve is plausible.
#
# Should the per-step weight read include the embedding table? Strictly, no: a step looks up only
# the rows of its new tokens, a few KiB, while the output head, a matrix of the same size, is
# multiplied in full and read every step. labkit's cost model counts every weight, the embedding
# table included, so it overstates a step's weight read by the table's size:

# %%
table_bytes = teaching.vocab_size * teaching.hidden_size * teaching.shape.dtype_bytes
print(f"embedding table {format_bytes(table_bytes)} of {format_bytes(teaching.weight_bytes)} weights: "
      f"the weight read is overstated by {table_bytes / teaching.weight_bytes:.1%}")
assert not teaching.tie_word_embeddings and 0.06 < table_bytes / teaching.weight_bytes < 0.07

# %% [markdown]
# A step dominated by the weight read is therefore priced up to the 6.5% printed above too slow; steps dominated by
# the history read, or by arithmetic, much less. We keep the simpler count: every comparison in
# this chapter is between settings of the same model, and each of their steps is overstated by the
# same bytes.
#
# What do the six sequences cost per step on a 24 GiB, RTX-4090-class card?

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
# request *can* start: paging gives it any of the 511 free blocks, and they hold 8,176 tokens. It
# cannot *finish* as a full 8,192-token sequence beside the six: when the pool runs out, the
# scheduler preempts a request (chapter 05), which later recomputes its whole history, almost a
# second of prefill at this length. Either way, the seventh request's latency is set by *other*
# requests' lengths, not by the memory formula. Fitting answered "how many"; serving asks "how
# fast, for whom, under which traffic".
#
# ## Concurrency: shared weights, multiplied history
#
# Batching sequences into one step is the engine's main lever. The weights are read once per step
# however many sequences share it, so the first few extra sequences are nearly free. But each
# sequence also reads its own history every step, and that part grows with the batch.

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
# With 512-token contexts, 64 sequences decode in about the time of one: the weights dominate, so
# concurrency multiplies throughput. With 8,192-token contexts, history equals the weights at
# about 15 sequences; beyond that every added sequence slows everyone's next token. The curves turn
# dotted where the batch no longer fits in §06's 7 GiB pool (the dots): six sequences of 8,192
# tokens, so on this card the 8,192-token curve beyond six is what a larger pool would give, not
# a setting you can run. (Prefix sharing
# saves *memory* for a shared document, but a standard paged kernel still reads the shared blocks
# once per sequence; kernels that read a shared prefix once for the whole batch exist, and go
# beyond this book.)
#
# ## Workloads, and the lengths to keep beside every result
#
# A simulation is only as good as its traffic. `labkit.workloads` draws requests with Poisson
# arrivals (independent users: exponential gaps) and prompt and output lengths from a
# **log-normal** distribution. Real lengths are positive and right-skewed, most short and a few very
# long, and a log-normal has that shape with two parameters. We fix its mean to the dataset means
# reported in the PagedAttention paper and choose the spread ourselves (the paper shows
# histograms, not parameters): an assumption, stated. We also clip prompt and output to
# `max_prompt_len` / `max_output_len` tokens each (1,024 for both profiles), so a request fits a
# 2,048-token context: again the book's choice, not something the paper reports about its traces.
# vLLM's serving benchmark *drops* such ShareGPT samples instead of clipping them
# (`vllm/benchmarks/datasets/datasets.py: is_valid_sequence`), so our lengths are not the ones it
# would send.

# %%
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
# `labkit.sim.Simulator` serves a workload with chapter 05's `Scheduler`, on a real
# `BlockAllocator` and `PrefixCache`. Nothing is computed: sampled tokens are synthetic ids, and
# each step lasts what the cost model says. Between events (an arrival, a finish, a block running
# out) the steps are all alike, one token per running request, so the simulator applies such a
# stretch at once; the tests check that this gives exactly what stepping through every iteration
# gives, and that chapter 05's real engine plans the same steps with the same blocks.
#
# Here: 400 ShareGPT-like requests at 4 per second, on the teaching model with §06's 7 GiB pool, given
# as the 3,583 blocks vLLM's block pool can hand out (its null block held back, as computed above).
# The share of the held blocks that carries live tokens comes from the allocator's own blocks; chapter
# 03 set that share beside reserving memory up front
# ([How much reserved memory holds tokens](03_paging.ipynb#how-much-reserved-memory-holds-tokens)).
# Like vLLM, the scheduler runs at most `max_num_seqs`
# requests at once (labkit's default, 256); the others wait. Also like vLLM, a waiting request is
# admitted only when blocks for its whole prompt are free, not just for its first chunk (chapter 05).
#
# ### Three latencies: TTFT, TPOT and ITL
#
# A user waits first for the answer to start, then for each next token. Serving benchmarks name
# three measurements for that, and vLLM's (`vllm bench serve`; `calculate_metrics` in
# `vllm/benchmarks/serve.py`, vLLM 0.33.0) reports all three:
#
# - **TTFT**, *time to first token*: from a request's arrival to its first output token, i.e.
#   queueing plus prefill. One sample per request.
# - **ITL**, *inter-token latency*: the time between two consecutive output tokens of one request.
#   This is the article's "inter-token interval". Every interval of every request is one sample,
#   all pooled together.
# - **TPOT**, *time per output token*: for one request, (its end-to-end latency − its TTFT) /
#   (its output tokens − 1), the mean of its own intervals. One sample per request (vLLM skips
#   requests with a single output token).
#
# TPOT and ITL average the same intervals differently. TPOT weighs every request the same, however
# long its answer; ITL weighs every token, so long answers dominate it. And a single stall (a step
# shared with a long prefill chunk, a preemption) is one large sample in the ITL tail, but is
# averaged over the whole answer in its request's TPOT. `SimResult.itl` holds every interval (with
# a weight when the simulator applies several identical steps at once), so both can be computed.

# %%
serve = Simulator(cost, num_blocks=report.num_gpu_blocks - null_block, block_size=16, max_num_batched_tokens=2048)
print(serve)  # vLLM's num_gpu_blocks less its null block
assert serve.num_blocks == 3583
chat_run = serve.run(workloads.sharegpt_like(400, arrival_rate=4.0, seed=1))

# %%
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
# The medians of TPOT and ITL are close: most intervals are one decode step. Their tails differ:
# the ITL p99 is well above the TPOT p99, because the few long intervals (steps that also carried
# another request's prefill) are single samples in the ITL, but each is spread over a whole answer
# in its request's TPOT. A reader of a benchmark must know which of the two it quotes.

# %% [markdown]
# ## Occupancy, and a pool under pressure
#
# The same run over time: the share of the pool its requests hold, and the latencies as
# distributions.

# %%
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
# In the 7 GiB pool this traffic never holds more than the maximum occupancy printed above: the pool
# is never under pressure, and no request is preempted. The same 400 requests in a 1 GiB pool:

# %%
tight_run = Simulator(cost, pool_bytes=1 * GiB, block_size=16, max_num_batched_tokens=2048).run(
    workloads.sharegpt_like(400, arrival_rate=4.0, seed=1))
show(tight_run)
assert chat_run.used_blocks.max() / chat_run.num_blocks < 0.5 and chat_run.preemptions.sum() == 0
assert tight_run.used_blocks.max() == tight_run.num_blocks and tight_run.preemptions.sum() > 100
assert tight_run.ttft_percentiles()["p50"] > 10 and chat_run.ttft_percentiles()["p50"] < 0.1
assert tight_run.mean_occupancy > 0.8

# %% [markdown]
# Now the pool is full at its peak and mostly full on average; requests are preempted hundreds of
# times and recompute their history, and TTFT grows from tens of milliseconds to more than ten
# seconds at the median, because new requests wait for blocks. The ITL median hardly moves: a request that runs still gets a token
# every step. Pressure on the pool shows first in TTFT.
#
# ## Turning up the load
#
# Now a smaller pool, 2 GiB (what a larger model or a longer context limit would leave), with the
# same ShareGPT-like traffic at rising arrival rates. At low load every request starts at once and
# its TTFT is its own prefill. As the rate grows, more sequences share each step, the pool fills,
# running requests are preempted to make room and recomputed later (ITL p99 jumps), and new
# requests wait: TTFT leaves the prefill behind by orders of magnitude while the median ITL hardly
# moves.
#
# Tail percentiles move from one draw of the traffic to the next, so each rate is served with
# three seeds of 100 requests, and the figure shows the median and the range. With 100 requests a
# TTFT p99 is the single slowest request, so the figure shows TTFT p90; ITL pools tens of thousands
# of intervals per run, so its p99 is well defined.

# %%
rates, sweep_seeds = [2, 5, 8, 11, 14], (2, 3, 4)
sweep = {(rate, seed): Simulator(cost, pool_bytes=2 * GiB, max_num_batched_tokens=2048).run(
    workloads.sharegpt_like(100, arrival_rate=rate, seed=seed)) for rate in rates for seed in sweep_seeds}


def across_seeds(measure) -> np.ndarray:
    """One row per rate: the minimum, median and maximum of ``measure(run)`` over the seeds."""
    values = np.array([[measure(sweep[rate, seed]) for seed in sweep_seeds] for rate in rates])
    return np.stack([values.min(axis=1), np.median(values, axis=1), values.max(axis=1)], axis=1)


curves = {
    "TTFT p50": across_seeds(lambda r: r.ttft_percentiles()["p50"] * 1e3),
    "TTFT p90": across_seeds(lambda r: r.ttft_percentiles()["p90"] * 1e3),
    "ITL p50": across_seeds(lambda r: r.itl_percentiles()["p50"] * 1e3),
    "ITL p99": across_seeds(lambda r: r.itl_percentiles()["p99"] * 1e3),
}
occupancy = {"mean": across_seeds(lambda r: r.mean_occupancy),
             "peak": across_seeds(lambda r: r.used_blocks.max() / r.num_blocks)}
running = across_seeds(lambda r: r.num_running.mean())
preempted = across_seeds(lambda r: r.preemptions.sum())

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
for i, (label, c) in enumerate(curves.items()):
    left.plot(rates, c[:, 1], marker="os"[i % 2], color=f"C{i}", label=label)
    left.fill_between(rates, c[:, 0], c[:, 2], color=f"C{i}", alpha=0.2)
left.set_yscale("log")
left.set_xlabel("arrival rate (requests/s)")
left.set_ylabel("latency (ms)")
left.set_title("Queueing shows in TTFT first (simulated)")
left.legend(fontsize=8, title="median, range of 3 seeds", title_fontsize=8, loc="upper left")
for i, (label, c) in enumerate(occupancy.items()):
    right.plot(rates, c[:, 1], marker="o", color=f"C{i}", label=f"{label} occupancy")
    right.fill_between(rates, c[:, 0], c[:, 2], color=f"C{i}", alpha=0.2)
right.set_xlabel("arrival rate (requests/s)")
right.set_ylabel("share of the 2 GiB pool")
right.set_ylim(0, 1.05)
right.legend(fontsize=8, loc="lower right")
right.set_title("The pool peaks full; its mean levels off (simulated)")
fig.tight_layout()
plt.show()
print("median [min-max] over seeds 2, 3, 4; 100 requests each")
print(f"{'rate':>4}{'TTFT p90 (ms)':>20}{'ITL p99 (ms)':>17}{'mean occupancy':>19}{'running':>9}{'preempted':>13}")
for i, rate in enumerate(rates):
    t, d, o, p = curves["TTFT p90"][i], curves["ITL p99"][i], occupancy["mean"][i], preempted[i]
    print(f"{rate:>4}{f'{t[1]:,.0f} [{t[0]:,.0f}-{t[2]:,.0f}]':>20}{f'{d[1]:.0f} [{d[0]:.0f}-{d[2]:.0f}]':>17}"
          f"{f'{o[1]:.0%} [{o[0]:.0%}-{o[2]:.0%}]':>19}{running[i, 1]:>9.0f}{f'{p[1]:.0f} [{p[0]:.0f}-{p[2]:.0f}]':>13}")
itl_p99 = np.array([[sweep[rate, seed].itl_percentiles()["p99"] for rate in rates] for seed in sweep_seeds])
print(f"seeds whose ITL p99 ever falls as the rate grows: {int((np.diff(itl_p99, axis=1) < 0).any(axis=1).sum())} of 3")
assert curves["TTFT p90"][-1, 1] > 10 * curves["TTFT p90"][0, 1]
assert np.all(np.diff(curves["TTFT p90"][:, 1]) > 0)  # the median over seeds rises with the rate
assert curves["ITL p50"][:, 2].max() < 1.5 * curves["ITL p50"][:, 0].min()  # the median interval hardly moves
print(f"ITL p50 from {curves['ITL p50'][:, 0].min():.1f} to {curves['ITL p50'][:, 2].max():.1f} ms across rates and seeds")
assert np.all(np.diff(curves["ITL p99"][:, 1]) > 0) and running[-1, 1] - running[2, 1] < 0.2 * running[2, 1]
ttft_p90 = {rate: sorted(sweep[rate, seed].ttft_percentiles()["p90"] for seed in sweep_seeds) for rate in rates}
assert ttft_p90[5][1] < 0.1 < 1 < ttft_p90[5][2]                   # at 5 req/s one draw of three queues
assert np.all(occupancy["peak"][2:, 0] == 1) and np.all(preempted[2:, 0] > 0)  # from 8 req/s: full, preempting
assert all(ttft_p90[r][1] > 1 and ttft_p90[r][0] < 0.25 for r in rates[2:])    # two draws in seconds, one not
p99_range = curves["ITL p99"][:, 2] - curves["ITL p99"][:, 0]
assert curves["ITL p99"][-1, 1] - curves["ITL p99"][-2, 1] < min(p99_range[-2:])  # 11 -> 14 req/s: within the spread

# %% [markdown]
# The ranges show how much one draw moves the result. Near the knee the draw decides: at 5
# requests/s one seed already queues and the other two do not. From 8 requests/s the pool is full
# at its peak in every draw and requests are preempted; in two draws of three TTFT p90 runs into
# seconds, while the lightest draw stays under a quarter of a second even at 14 requests/s.
#
# The ITL p99 rises from one decode step (about 18 ms) to several times that, because more steps
# carry a prompt chunk (a new request's, or a preempted one's computed again) beside the decodes.
# Then it levels off with the occupancy and the running requests: once the pool is the limit the
# batch stops growing, and more traffic only lengthens the queue. In these draws it never falls as
# the rate grows (the count above), but from 11 to 14 requests/s its median moves by less than
# the range across draws at either rate: past the knee, which draw you serve matters more to the
# ITL tail than a little more traffic. Mean occupancy stays below 100% because it averages over
# the ramp-up and the drain as well.

# %% [markdown]
# ## The paper's headline: one pool, reserved or paged
#
# Chapter 03 counted the slots that hold tokens when each request reserves memory up front (the
# PagedAttention paper's Fig. 2). The paper's evaluation asks what the empty slots cost a server:
# it serves the same traces with vLLM and with Orca, which reserves memory for each request when
# it admits it, and finds that vLLM serves 2–4× the throughput at the same latency, because many
# more requests fit in a batch. The simulator can run that experiment on our traffic.
# `Simulator(..., allocation=...)` chooses how a request takes its blocks:
#
# - `"max_len"`: at admission, blocks for `max_model_len` tokens, all at once, and never more
#   (Orca (Max));
# - `"exact"`: at admission, blocks for exactly its own final length, prompt + output − 1 (Orca
#   (Oracle): it knows every answer's length in advance, which no real server does);
# - `"paged"`: one block whenever its tokens need one (vLLM). This is the default.
#
# A reserving request never grows, so it is never preempted: it waits until its whole reservation
# is free. Everything else stays the same: the scheduler, the 2 GiB pool of the last section, the
# 2,048-token budget, the cost model. `max_model_len` is 2,048, the limit chapter 03 reserved for
# and the longest sequence our ShareGPT-like requests can reach (1,024 + 1,024). The traffic is 300
# requests arriving at 20 per second, far more than any of the three can serve, so a queue forms
# and the pool, not the arrivals, limits the batch. Prefix caching is off: these prompts share
# nothing.

# %%
headline_specs = workloads.sharegpt_like(300, arrival_rate=20.0, seed=1)
headline = {allocation: Simulator(cost, pool_bytes=2 * GiB, max_num_batched_tokens=2048, enable_prefix_caching=False,
                                  allocation=allocation, max_model_len=2048).run(headline_specs)
            for allocation in ("max_len", "exact", "paged")}
print(f"{headline['paged'].num_blocks:,} blocks of 16 tokens; reserving 2,048 tokens takes "
      f"{blocks_needed(2048, 16)} of them per request")

# %% [markdown]
# For each run, the batch (requests running in a step, averaged over the steps, and its largest
# value), the throughput, the median TTFT, and the share of the slots in held blocks that hold a
# token's K/V, measured on the allocator's blocks over time (`SimResult.live_token_share`).

# %%
labels = {"max_len": "reserve max length", "exact": "reserve exact length", "paged": "paged (vLLM)"}
print(f"{'allocation':<21} {'batch':>6} {'max':>4} {'req/s':>6} {'output tok/s':>12} {'TTFT p50':>9} "
      f"{'held slots holding K/V':>23}")
for allocation, run in headline.items():
    print(f"{labels[allocation]:<21} {run.num_running.mean():6.1f} {run.num_running.max():4d} "
          f"{run.requests_per_s:6.2f} {run.output_tokens_per_s:12,.0f} {np.median(run.ttft):8.1f}s "
          f"{run.live_token_share:23.1%}")
for allocation, run in headline.items():
    print(f"{labels[allocation]}: requests waiting in {(run.num_waiting > 0).mean():.0%} of the steps, "
          f"{int(run.preemptions.sum())} preemptions, {run.recomputed_tokens / run.step_tokens.sum():.0%} "
          f"of the computed tokens recomputed")
batch_gain = headline["paged"].num_running.mean() / headline["max_len"].num_running.mean()
speedup = headline["paged"].requests_per_s / headline["max_len"].requests_per_s
oracle_speedup = headline["paged"].requests_per_s / headline["exact"].requests_per_s
print(f"paged against reserve max length: {batch_gain:.1f}x the batch, {speedup:.1f}x the throughput")
print(f"paged against the exact-length oracle: {oracle_speedup:.1f}x the throughput")
batch = {a: run.num_running.mean() for a, run in headline.items()}
assert batch["max_len"] < batch["exact"] < batch["paged"]
assert headline["max_len"].num_running.max() == headline["max_len"].num_blocks // blocks_needed(2048, 16) == 8
assert 2 <= speedup <= 4 and speedup < batch_gain and oracle_speedup > 1.2
assert headline["max_len"].preemptions.sum() == headline["exact"].preemptions.sum() == 0
assert headline["paged"].preemptions.sum() > 100
assert all((run.num_waiting > 0).mean() > 0.5 for run in headline.values())  # a queue: memory limits the batch
# Chapter 03's count for these 300 requests: the share measured while serving agrees within 2 points.
counted = reservation_shares(headline_specs, max_len=2048, block_size=16)
for run, policy in zip(headline.values(), ("reserve max length", "reserve exact length (oracle)",
                                           "paged, 16-token blocks")):
    assert abs(run.live_token_share - counted[policy]) < 0.02
# The figures quoted below.
assert (round(batch_gain, 1), round(speedup, 1), round(oracle_speedup, 1)) == (3.9, 3.2, 1.3)
assert [round(run.live_token_share * 100) for run in headline.values()] == [21, 60, 98]
assert headline["paged"].preemptions.sum() == 375
assert round(headline["paged"].recomputed_tokens / headline["paged"].step_tokens.sum() * 100) == 35
assert [round(float(np.median(headline[a].ttft)), 1) for a in ("max_len", "paged")] == [88.5, 14.5]

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
for allocation, run in headline.items():
    left.step(run.step_start, run.num_running, where="post", label=labels[allocation], linewidth=1)
    right.plot(np.sort(run.finish), np.arange(1, len(run.finish) + 1), label=labels[allocation])
left.set_xlabel("simulated time (s)")
left.set_ylabel("requests in the batch")
left.set_title("Paging fits more requests in a 2 GiB pool (simulated)", fontsize=10)
left.legend(fontsize=8)
right.set_xlabel("simulated time (s)")
right.set_ylabel("requests finished")
right.set_title("and serves the same 300 requests sooner (simulated)", fontsize=10)
right.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Reserving 2,048 tokens per request, the 2 GiB pool holds at most 8 requests, and it runs 8 from
# the first seconds to the drain at the end: every finish frees one reservation for the next
# request in the queue. Paging runs 3.9× as many requests per step on average and serves the same
# requests 3.2× as fast, inside the 2–4× the paper reports against Orca (the paper compares at
# equal latency; here both servers are overloaded, and we compare how fast each works through the
# same queue). The batch grows more than the throughput because a decode step is memory-bound (the
# roofline above): a larger batch shares the weight read, but every extra request adds its own
# history to the bytes each step reads.
#
# The last column is chapter 03's share, now measured on the allocator while serving: about 21% of
# the held slots hold a token when each request reserves the maximum, 60% when it reserves its
# exact length, and 98% when paged. Chapter 03's count knows no time and no queue, yet it agrees
# with these to within two points for the same requests (the cell checks it). The empty rest of
# each maximum-length reservation is what the smaller batch pays for. Even the oracle, which knows
# every answer's length, fills only 60% of its slots: a reservation holds the whole future answer
# from the first step on, while paging holds only the tokens computed so far. Paging serves 1.3×
# the oracle's throughput.
#
# Paging pays in another currency. It admits a request when the tokens it knows so far fit, so
# when the pool runs out, a running request is preempted and later recomputes its history: 375
# times here, and 35% of all the tokens the paged run computed were recomputations. Reserving never
# preempts. Paging still serves the requests sooner: the memory it does not leave empty is worth
# more than the work it repeats.
#
# The queue shows in the median TTFT of the table: 88.5 s of waiting for a first token when every
# request reserves the maximum, 14.5 s when paged.

# %% [markdown]
# ## Long documents against many short requests
#
# §06 ends with a warning: a setting that suits long-document reuse need not suit many distinct
# short requests. Two workloads:
#
# - **long-document questions**: each prompt is one of four 4,096-token documents followed by a
#   short question (the reusable part is the document);
# - **distinct short requests**: prompts and answers of about 48 tokens, sharing nothing.
#
# First one setting, the memory the KV pool gets: each workload is served with a 2 GiB pool and
# with §06's 7 GiB pool, everything else equal (a 1,024-token budget per step, and at most 256
# requests running at once, the `max_num_seqs` vLLM picks on GPUs under 70 GiB).

# %%
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
# For distinct short requests, a 2 GiB pool serves exactly as well as 7 GiB: the runs are identical
# (every TTFT and every interval, checked above), because even the small pool never ran out of
# blocks, so the memory could go to something else. For long-document questions the same 2 GiB
# breaks the service. The four documents alone take all of it; with questions running on top, the
# pool evicts documents that the next question needs, reuse falls, questions wait in the queue until
# their whole prompt fits (vLLM's admission gate, chapter 05: nobody is preempted), and TTFT goes from
# tens of milliseconds to seconds, at the median and in the tail.
#
# The pool size is a setting that one workload needs and the other does not care about. Is there
# one that helps one and *hurts* the other? The token budget of a step, measured in the 2 GiB pool:

# %%
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
# A small budget (128 tokens per step) helps the long-document questions in the tight pool: TTFT
# falls at the median and at p90, while the reuse ratio hardly moves (why, below). For distinct
# short requests the same budget
# hurts: the decode tokens of the running requests take a large share of the 128 tokens, what is
# left does not cover a burst of new prompts, and they queue for the next steps: TTFT at p50, p90
# and p99 grows. (The small budget does smooth the ITL tail of both workloads, since no long prompt
# chunk stalls the decodes: the price is paid in TTFT.) The direction is not universal either: in
# the 7 GiB pool, where no document is evicted, a small budget only slows the document prefills. A
# setting is good *for a workload and a pool*, and only a measurement says which.
#
# ### Five seeds, and the mechanism
#
# A p99 over 100 requests is the single worst request, and it comes from one random draw of the
# traffic. So the same comparison again, on five draws of each workload (seeds 3 to 7 for the
# documents, 4 to 8 for the short requests, the first being the run above), with what explains
# the difference next to the latencies: for the documents the cached blocks evicted, the reuse
# ratio, the preemptions and the tokens they recomputed; for the short requests the share of steps
# whose token budget was spent to the last token and the mean length of the waiting queue.

# %%
def budget_run(kind: str, seed: int, budget: int):
    w = (workloads.long_document_questions(100, arrival_rate=3.0, num_documents=4, seed=seed) if kind == "docs"
         else workloads.distinct_short_requests(400, arrival_rate=80.0, seed=seed))
    return Simulator(cost, pool_bytes=2 * GiB, max_num_batched_tokens=budget).run(w)


seeds = {"docs": range(3, 8), "short": range(4, 9)}
above = {"docs": "long-document questions", "short": "distinct short requests"}  # the first seed: the runs above
budget_runs = {(kind, b): [grid[above[kind], 2, b]] + [budget_run(kind, sd, b) for sd in seeds[kind][1:]]
               for kind in seeds for b in (1024, 128)}


def spread(values, fmt):
    values = np.asarray(values, dtype=float)
    return f"{fmt(np.median(values)):>7} [{fmt(values.min())}-{fmt(values.max())}]"


ms = lambda v: f"{v * 1e3:,.0f}"  # noqa: E731
count = lambda v: f"{v:,.0f}"  # noqa: E731
measures = {  # what a run is judged by, and how to print it
    "TTFT p50 (ms)": (lambda r, b: r.ttft_percentiles()["p50"], ms),
    "TTFT p99 (ms)": (lambda r, b: r.ttft_percentiles()["p99"], ms),
    "preemptions": (lambda r, b: r.preemptions.sum(), count),
    "recomputed tokens": (lambda r, b: r.recomputed_tokens, count),
    "evicted blocks": (lambda r, b: r.scheduler.allocator.num_evictions, count),
    "reuse ratio": (lambda r, b: r.reuse_ratio, lambda v: f"{v:.1%}"),
    "steps, budget full": (lambda r, b: np.mean(r.step_tokens == b), lambda v: f"{v:.0%}"),
    "waiting (mean)": (lambda r, b: np.average(r.num_waiting, weights=r.step_time), lambda v: f"{v:.1f}"),
}
for kind, title in (("docs", "long-document questions"), ("short", "distinct short requests")):
    print(f"{title}, 2 GiB pool: median [min-max] over five seeds")
    print(f"{'':<20}{'budget 1,024':>24}{'budget 128':>24}")
    for label, (get, fmt) in measures.items():
        print(f"{label:<20}" + "".join(f"{spread([get(r, b) for r in budget_runs[kind, b]], fmt):>24}"
                                       for b in (1024, 128)))
    print()

pairs = {kind: list(zip(budget_runs[kind, 1024], budget_runs[kind, 128])) for kind in seeds}
docs_p99 = {b: np.array([r.ttft_percentiles()["p99"] for r in budget_runs["docs", b]]) for b in (1024, 128)}
assert docs_p99[1024].max() / docs_p99[1024].min() > 1.5 > np.median(docs_p99[1024]) / np.median(docs_p99[128])
# Documents: in every draw, the small budget gives lower TTFT; nobody is preempted with either budget,
# and the cache's measures move by a few percent, either way.
for big, small in pairs["docs"]:
    assert small.ttft_percentiles()["p50"] < big.ttft_percentiles()["p50"]
    assert small.ttft_percentiles()["p99"] < big.ttft_percentiles()["p99"]
    assert small.preemptions.sum() == big.preemptions.sum() == 0 == small.recomputed_tokens
    assert abs(small.reuse_ratio - big.reuse_ratio) < 0.01
    assert abs(np.log(small.scheduler.allocator.num_evictions / big.scheduler.allocator.num_evictions)) < 0.05
assert any(s.reuse_ratio > b.reuse_ratio for b, s in pairs["docs"]) and any(s.reuse_ratio < b.reuse_ratio for b, s in pairs["docs"])
# Short requests: in every draw the small budget is spent to the last token in many steps, requests
# queue, and TTFT grows; the large budget never fills and nobody waits.
for big, small in pairs["short"]:
    assert small.ttft_percentiles()["p50"] > big.ttft_percentiles()["p50"]
    assert small.ttft_percentiles()["p99"] > 2 * big.ttft_percentiles()["p99"]
    assert np.mean(small.step_tokens == 128) > 0.35 and np.mean(big.step_tokens == 1024) == 0
    assert np.average(small.num_waiting, weights=small.step_time) > 1 > np.average(big.num_waiting, weights=big.step_time)
# The step in flight when a question arrives: at a random moment, a step of length d is hit with weight d.
in_flight = {b: float((r.step_time ** 2).sum() / r.step_time.sum()) for b, r in ((1024, docs_small), (128, docs_128))}
print(f"documents, seed 3: the step in flight at a random moment lasts {in_flight[1024] * 1e3:.0f} ms on average "
      f"with a budget of 1,024 and {in_flight[128] * 1e3:.0f} ms with 128")
assert in_flight[128] < in_flight[1024]
short_runs = budget_runs["short", 1024]
recycled = np.median([r.scheduler.allocator.num_evictions / r.num_blocks for r in short_runs])
print(f"short requests: nothing reused, yet the evicted blocks are {recycled:.1f}x the pool's "
      f"{short_runs[0].num_blocks:,} blocks (median over the seeds)")
assert all(r.reuse_ratio == 0 < r.scheduler.allocator.num_evictions for r in short_runs)

# %% [markdown]
# The direction holds in all five draws of each workload, and the spread says how much one draw
# can move the tail: the documents' TTFT p99 varies by a factor of about two across seeds,
# more than the budget changes it, which is why one seed could not settle the question.
#
# The mechanism, shown rather than asserted. For the documents, the cache does not explain it: the
# evicted blocks and the reuse ratio move by about a percent, in either direction from seed to
# seed, and nothing is preempted with either budget, because a question is admitted only when its
# whole prompt fits in the pool (vLLM's admission gate, chapter 05; under the article's chunk-only
# admission the small budget let documents in 128 tokens at a time and then preempted them when
# the pool ran dry). What the small budget changes is the step: no step carries more than 128
# tokens of a document, so steps are shorter (the step in flight at a random moment, printed above
# for the first seed). The gain in TTFT is larger than that difference, since a question also waits
# behind the questions ahead of it; these measurements show the shorter steps, not how the gain
# builds up in the queue. For the short requests, the small budget is spent to the last token in
# a large share of the steps, and the waiting queue that is empty with 1,024 tokens holds requests
# on average: they wait for budget, not for memory.
#
# Why are blocks evicted from a cache that nobody reuses? With prefix caching on, every full block
# gets a name (its hash) when it is computed, and a finished request's named blocks return to the
# free queue *still named*, in case a later prompt matches them. When the allocator has no
# unnamed free block left, it hands out the least recently freed named one and drops its name:
# that is the one event `num_evictions` counts (`BlockAllocator.allocate` in `labkit/paging.py`). The short requests share nothing, so no later request
# could have used those blocks: here an eviction is the pool recycling freed memory, and costs
# nothing. Over a run the pool is recycled about once (the ratio printed above).
#
# ## Reusable against reused
#
# The article's reusable-token ratio counts the prompt tokens that *could* come from the cache: the
# full blocks of a prefix that another request shares. The reuse ratio counts what *did*. For the
# long-document questions in the 7 GiB pool:

# %%
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
# achieved. Part of the gap is unavoidable: the first question on each document computes it. In the
# 7 GiB pool that is the whole gap. In the 2 GiB pool documents are evicted between questions and
# computed again, and the gap grows by the amount printed. (Timing can add to it as well: a block
# gets its name when the step that computes it is scheduled, as in vLLM, so a question admitted in
# that same step shares it, but one admitted while later parts of its document still wait to be
# computed cannot use those blocks yet.) Note also the ITL:
# long-document decodes are slower per step than short ones at the same batch size, because every
# sequence reads its history of more than 4,096 tokens every step:

# %%
batch = 16
long_ctx, short_ctx = 4096 + 32 + 64, 48 + 24
t_long, t_short = cost.decode_step_time(batch, long_ctx), cost.decode_step_time(batch, short_ctx)
print(f"{batch} sequences decoding: {t_long * 1e3:.1f} ms per step at {long_ctx:,} tokens of history, "
      f"{t_short * 1e3:.1f} ms at {short_ctx}")
assert t_long > 1.3 * t_short

# %% [markdown]
# Occupancy and the reuse ratio explain the differences; TTFT and ITL measure them; the length
# distributions say which workload you have.
#
# ## Explore the load
#
# The explorer serves 100 ShareGPT-like requests that all start with the same **system prompt**
# (the instructions a chat service puts in front of every conversation), for the arrival rate,
# system-prompt length, block size and pool size you choose, with prefix caching on or off. A
# longer system prompt makes every prompt longer; with caching on it is computed once and shared.
# A change takes under a second while the pool is roomy and several seconds when it is overloaded
# (preemption makes the scheduler work every step).

# %%
from labkit.widgets.load_explorer import SYSTEM_PROMPT_LEN, explore, load_explorer

load_explorer(cost)

# %% [markdown]
# For readers without a live kernel, one of its experiments: the explorer's workload, 80 requests
# with a 512-token system prompt in a 2 GiB pool, served with prefix caching on and with it off.
# The prompts are the same in both; only the sharing differs. (Comparing a workload with a system
# prompt against one without would compare different prompts: the system prompt makes them longer.)

# %%
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
# With caching on, the system prompt is computed once and then read from the cache (the reuse ratio
# printed above); each request prefills only its own tokens and holds one shared copy of the
# system prompt, so TTFT p99 stays under a tenth of a second at every rate. With caching off, every
# request computes and stores its own copy: the pool fills, requests are preempted, and from
# 3 requests/s on TTFT p99 runs into seconds.

# %% [markdown]
# The figures quoted in the summary, checked:

# %%
assert format_bytes(pool.management_bytes) == "577 KiB"
assert docs_128.ttft_percentiles()["p50"] < docs_small.ttft_percentiles()["p50"]
assert short_128.ttft_percentiles()["p50"] > short_small.ttft_percentiles()["p50"]

# %% [markdown]
# ## The simulator against a measured engine
#
# Every latency above came from the roofline of `labkit.costmodel`: datasheet peaks, and a fixed
# overhead per step that was an assumption (0 ms). Those figures are simulated, and the titles of
# their plots say so. How far is such a model from a real engine? Here the book's engine
# (chapter 05) serves the real model, SmolLM2-135M-Instruct (chapter 01), on the CPU this notebook
# runs on, and the simulator is checked against it in three steps (`labkit.calibration`):
#
# 1. **Measure.** The engine serves 6 chat requests at once, with a budget of 64 tokens per step,
#    so its steps mix prompt chunks and decodes. Every step is timed, together with the three sums
#    the cost model reads from it: new tokens, tokens already cached, and query-key pairs.
# 2. **Fit.** A device for this CPU: the memory bandwidth, the arithmetic rate and the fixed
#    overhead per step for which the roofline best predicts the measured times.
# 3. **Predict, then measure.** Eight *other* requests arrive as a Poisson process of 5 per second.
#    The simulator, with the fitted device, predicts their TTFT and ITL; then the engine serves
#    them for real, each request added when the wall clock reaches its arrival time.
#
# On a CPU the engine uses the kernels' PyTorch references (chapter 03 proves them equal to the
# Triton kernels), in float32 (the cost model counts 4-byte weights and cache here), on one thread.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
import torch

from labkit.calibration import fit_device, measure_steps, model_cost, serve_in_real_time
from labkit.engine import Engine
from labkit.pretrained import chat_token_ids, from_pretrained, load_tokenizer, real_model

torch.set_num_threads(1)  # one thread: steady timings even when another program shares the CPU
model_path = real_model()
smol = from_pretrained(model_path, dtype=torch.float32)
smol_tokenizer = load_tokenizer(model_path)
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
ASKS = ["What is the capital of France?", "Name three primary colours.", "What does a CPU do?",
        "How do you say hello in Spanish?", "Why is the sky blue?", "Who wrote Hamlet?",
        "What is water made of?", "How far away is the Moon?", "What is a GPU?", "Why do cats purr?",
        "What is DNA?", "What is gravity?", "What is a volcano?", "Why do leaves fall?"]
chat = [chat_token_ids(smol_tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in ASKS]
lengths = np.random.default_rng(0).integers(8, 25, len(ASKS)).tolist()  # reply lengths, 8 to 24 tokens
fit_specs = [workloads.RequestSpec(i, 0.0, chat[i], lengths[i]) for i in range(6)]
arrivals = workloads.poisson_arrivals(8, 5.0, np.random.default_rng(1))
test_specs = [workloads.RequestSpec(i, float(arrivals[i - 6]), chat[i], lengths[i]) for i in range(6, 14)]
cpu_engine = lambda: Engine(smol, num_blocks=128, block_size=16, max_num_batched_tokens=64,  # noqa: E731
                            use_triton=labkit.RUNTIME.triton_mode == "compiled")
smol_cost = model_cost(smol.config, dtype_bytes=4, name="SmolLM2-135M-Instruct (float32)")
print(f"{smol_cost.shape.name}: {smol_cost.num_params:,} parameters = {format_bytes(smol_cost.weight_bytes)} "
      f"read per step; {smol_cost.shape.bytes_per_token():,} bytes of cache per token")
print(f"fit on {len(fit_specs)} requests sent at once; test on {len(test_specs)} others arriving over "
      f"{arrivals[-1] - arrivals[0]:.1f} s")

# %%
# NBVAL_SKIP_IN_SOLUTIONS
samples = measure_steps(cpu_engine(), fit_specs)
cpu_device, cpu_overhead = fit_device(samples, smol_cost)
cpu_cost = CostModel(smol_cost, cpu_device, overhead_s=cpu_overhead)
measured_s = np.array([x.seconds for x in samples])
predicted_s = np.array([cpu_cost.time_from_sums(x.new_tokens, x.context_tokens, x.pairs) for x in samples])
print(f"{len(samples)} steps measured, {min(x.new_tokens for x in samples)} to "
      f"{max(x.new_tokens for x in samples)} tokens each")
print(f"fitted device: {cpu_device.memory_bandwidth / 1e9:.1f} GB/s, {cpu_device.peak_flops / 1e9:.1f} GFLOP/s, "
      f"overhead {1000 * cpu_overhead:.0f} ms per step")
print(f"step time predicted / measured: median {np.median(predicted_s / measured_s):.2f}, "
      f"from {np.min(predicted_s / measured_s):.2f} to {np.max(predicted_s / measured_s):.2f}")
decode_s = np.median([x.seconds for x in samples if x.new_tokens <= len(fit_specs)])
print(f"the fixed overhead is {cpu_overhead / decode_s:.0%} of a median decode step ({1000 * decode_s:.0f} ms)")
assert cpu_overhead >= 0.5 * decode_s  # on a CPU, most of a small step is fixed cost

# %%
# NBVAL_SKIP_IN_SOLUTIONS
fig, ax = plt.subplots(figsize=(6, 3.6))
kinds = np.array([x.new_tokens > 16 for x in samples])
ax.scatter(1000 * measured_s[~kinds], 1000 * predicted_s[~kinds], label="decode steps (few tokens)")
ax.scatter(1000 * measured_s[kinds], 1000 * predicted_s[kinds], label="steps with a prompt chunk")
top = 1000 * max(measured_s.max(), predicted_s.max()) * 1.05
ax.plot([0, top], [0, top], color="grey", lw=0.8, ls="--", label="prediction = measurement")
ax.set(xlabel="measured step time (ms)", ylabel="fitted roofline (ms)", xlim=(0, top), ylim=(0, top))
ax.set_title("Engine steps measured on the CPU running this notebook, and the fitted roofline", fontsize=9)
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# The fitted device is the CPU as the engine sees it. Most of a small step's time is the fixed
# overhead (more than half of a decode step, the cell checks): Python, and a few hundred small
# operations per step whatever their size, which the 0 ms of the GPU presets above leave out. The
# bandwidth and arithmetic rate are only the values that best fit these steps, not measurements of
# the machine's memory or arithmetic: with so much of the time fixed, the fit cannot pin them down
# well. Each dot is one measured step, against the time the fitted roofline gives it; the dashed
# line is a perfect prediction. Now the prediction: the
# simulator (chapter 06's `Simulator`, the chapter-05 scheduler with synthetic tokens) with this
# device, then the engine serving the same eight requests for real.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
predicted = Simulator(cpu_cost, num_blocks=128, block_size=16, max_num_batched_tokens=64).run(test_specs)
measured = serve_in_real_time(cpu_engine(), test_specs)
rows = [("TTFT", predicted.ttft_percentiles(), measured.ttft_percentiles()),
        ("ITL", predicted.itl_percentiles(), measured.itl_percentiles())]
print(f"{'':<6}{'simulated':>12}{'measured':>12}{'simulated / measured':>24}")
for name, sim_p, real_p in rows:
    for q in ("p50", "p90"):
        print(f"{name} {q:<4}{1000 * sim_p[q]:>9.0f} ms{1000 * real_p[q]:>9.0f} ms{sim_p[q] / real_p[q]:>24.2f}")
ratios = [sim_p["p50"] / real_p["p50"] for _, sim_p, real_p in rows]
print(f"p50s within 25% of the measurement: {all(abs(r - 1) <= 0.25 for r in ratios)}")
assert all(0.5 <= r <= 2 for r in ratios)  # a busy machine widens the gap; past a factor of 2 the model is wrong
assert [len(o) for o in measured.outputs] == [s.output_len for s in test_specs]

# %% [markdown]
# The table sets the simulator's prediction beside the measurement, for time to first token and
# inter-token latency, and the last line says whether both medians came within the 25% the book
# aims for. The measurement is a single run on the wall clock, and a busy machine moves it (the
# tests run this notebook beside others), so the cell fails only past a factor of 2.
# The p90s are printed too; they can move more from one run to the next: in the engine a step
# costs a little more with every request it carries (Python work per request, which a fixed
# overhead does not capture), and the wall clock adds whatever else the machine was doing.
# So the simulator's figures for the GPUs above are *simulated*: right in their comparisons (more
# traffic, less memory, another budget), and only as good in absolute terms as the device figures
# and the overhead they are given. `benchmarks/real_model.py` measures the engine further.

# %% [markdown]
# ## Summary
#
# - A device's memory minus weights, workspace and reserve is the KV pool: 24 − 17 = 7 GiB, 3,584
#   blocks, seven 8,192-token sequences of the teaching model. Block tables, lengths and slot
#   mappings (577 KiB here, sized by batch limits that vLLM picks per GPU size) cost a whole
#   sequence when the count was exact: six remain.
# - vLLM's log says "7.00x" for the same pool: it keeps its block tables outside the pool, and
#   divides all 3,584 blocks by 512, its null block included. It can hand out 3,583: six full
#   sequences at once in either accounting ([appendix A2](A2_vllm_start_up.ipynb) reads the rest
#   of its log).
# - A roofline step time (bytes over bandwidth, operations over peak, whichever is slower) shows why
#   fitting is not serving: weights are read once per step, history once per sequence per step.
#   Concurrency is nearly free for short contexts and expensive for long ones.
# - The paper's headline, simulated: serving the same queue from a 2 GiB pool, paged allocation
#   runs 3.9× the batch and 3.2× the throughput of reserving the maximum length per request (the
#   paper reports 2–4× against Orca), and 1.3× the exact-length oracle's throughput. It pays with
#   preemptions, which reserving never needs.
# - To judge a setting, measure cache occupancy, the reusable-token ratio, TTFT, TPOT and ITL (p50,
#   p90, p99) over several seeds, and keep the input and output length distributions beside them.
#   TPOT is a per-request mean of its intervals; ITL pools every interval, so stalls show in its tail.
# - Under pool pressure (the same chat traffic in 1 GiB) requests are preempted hundreds of times
#   and TTFT grows to seconds while the median ITL hardly moves.
# - The same pool size can be plenty for distinct short requests and break long-document
#   questions; in that tight pool a small token budget (128) helps the documents (shorter steps,
#   lower TTFT) and hurts the short requests (higher TTFT). Capacity formulas say what fits;
#   workload experiments say how fast it is served, and for whom.
# - The reusable-token ratio bounds the reuse ratio from above; first reads and evictions make
#   the gap. With a shared system prompt, prefix caching keeps TTFT p99 lower and the pool emptier
#   than the same prompts served without it.
# - All of those latencies are simulated. Fitted to steps of the real engine serving
#   SmolLM2-135M-Instruct on the CPU that runs this notebook, the same simulator predicts the TTFT
#   and ITL of other requests, measured on the wall clock; the book aims for medians within 25%.

# %% [markdown]
# ## Exercises

# %%
from labkit.exercises import Exercises, Metered, TooManyCalls, calls_made, hidden_rng

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


from labkit import calibration


def ex2_cases() -> list:
    """A single sequence, then batches and contexts drawn afresh, each on a device drawn afresh."""
    rng = hidden_rng()
    settings = [(1, rng.randint(0, 200))] + [(rng.randint(2, 256), rng.randint(1, 16_384)) for _ in range(4)]
    return [((b, c, DEVICES[d].memory_bandwidth), CostModel("teaching model", d).memory_bound_step(b, b * c) * 1e3)
            for (b, c), d in zip(settings, (rng.choice(sorted(DEVICES)) for _ in settings))]


ex.check_function("Exercise 2", decode_ms, ex2_cases(),
                  rel_tol=1e-9, hint="bytes = weights + batch × (context + 1) × 131,072; divide by the bandwidth.",
                  forbid=[CostModel, calibration._predict])

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


from labkit import build_it
from labkit.sim import SimResult

ex.check_behaviour("Exercise 3", latencies, build_it.latencies_check(), forbid=[Simulator, SimResult],
                   hint="TTFT counts from the arrival; TPOT divides by the token count less one; ITL pools intervals.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** It mirrors `labkit/sim.py: _Run._record_step` (the first token's step end,
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


def check_search(fn, limit: int = 10) -> list[str]:
    """Run the search on two made-up curves whose threshold the checker draws, then on the simulator
    with a workload drawn afresh. The search gets each curve behind a counter it cannot reset."""
    rng = hidden_rng()
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
# 4. Paging beats reserving the maximum mainly because (a) more sequences fit, so batches grow;
#    (b) attention gets faster.

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
# - Turn a device's memory, the weights, the workspace and a reserve into a KV pool in blocks, and
#   say what the bookkeeping and vLLM's null block take from it.
# - Price one engine step with a roofline and say when adding a sequence to the batch is nearly free
#   and when it slows everyone's next token.
# - Judge a serving setting by TTFT, TPOT and ITL percentiles, occupancy and reuse, over several
#   seeds, with the length distributions beside them.
# - Show with a simulation what paging buys over reserving the maximum length (batch and
#   throughput), and that one setting (the pool size, the token budget) can help one workload and
#   hurt another.
# - Search a simulator for the highest load that keeps a latency promise, in a handful of runs.

# %% [markdown]
# ## References
#
# - The source article: *长上下文推理中的 KV Cache：容量、分页与复用边界* ("The KV cache in
#   long-context inference: capacity, paging and the limits of reuse"), a Chinese essay in six
#   sections; the copy the book follows gives no author or link. Its §06 (24 GiB − 17 GiB = 7 GiB,
#   occupancy, reusable-token ratio, TTFT, inter-token interval) is this chapter's outline; its
#   sentences do not carry over.
# - Woosuk Kwon, Zhuohan Li, et al., *Efficient Memory Management for Large Language Model Serving
#   with PagedAttention*, SOSP 2023, [arXiv:2309.06180](https://arxiv.org/abs/2309.06180): the
#   ShareGPT and Alpaca length means of the workloads (chapter 03 redoes its Figure 2).
# - vLLM, the serving engine the book compares itself with: documentation at
#   [docs.vllm.ai](https://docs.vllm.ai/), code at
#   [github.com/vllm-project/vllm](https://github.com/vllm-project/vllm). This chapter read vLLM
#   0.33.0: `vllm/engine/arg_utils.py` (`EngineArgs.get_batch_defaults`) for the engine limits,
#   `vllm/v1/worker/block_table.py`, `vllm/v1/core/block_pool.py` and `vllm/v1/core/kv_cache_utils.py`
#   (`get_max_concurrency_for_kv_cache_config`) for its count of seven, and
#   `vllm/benchmarks/serve.py` (`calculate_metrics`) for TTFT, TPOT and ITL.
# - SGLang's RadixAttention (Lianmin Zheng et al., *SGLang: Efficient Execution of Structured
#   Language Model Programs*, NeurIPS 2024, [arXiv:2312.07104](https://arxiv.org/abs/2312.07104)):
#   the other design of prefix reuse that chapter 04 compares with vLLM's, whose effect the
#   long-document workload measures.
