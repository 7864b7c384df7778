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
# # A2 · vLLM's start-up log, line by line
#
# **The message.** What vLLM logs about its KV cache when it starts, and why it refuses to start, is
# arithmetic you can do beforehand: the device's memory times `gpu_memory_utilization`, minus
# everything that is not cache, divided into blocks and then into worst-case requests.
#
# An appendix to [chapter 06](06_from_fit_to_serve.ipynb), which carves a KV pool out of a device:
# memory minus weights, workspace and reserve, and to [chapter 02](02_cost_per_token.ipynb), whose
# bytes per token it splits over several GPUs. vLLM does the same subtraction every time it starts,
# and prints the result in two lines of its log. This appendix rebuilds those lines with
# `labkit.vllm_bridge.predict`, which follows vLLM 0.33.0's own code (every function names the file
# it follows), so you can predict them before you rent the GPU, and read them when a server refuses
# to start.
#
# **What you will learn**
#
# - how vLLM's "Available KV cache memory" and "GPU KV cache size ... Maximum concurrency" lines
#   follow from the device, `gpu_memory_utilization` and the memory outside the cache;
# - why a real GPU never starts at `gpu_memory_utilization=1.0`, and what the default 0.92 costs;
# - why vLLM refuses a `max_model_len`, what its message proposes, and three ways out;
# - how tensor and pipeline parallelism split the cache over GPUs, why heads are replicated when GPUs
#   outnumber KV heads, and what MLA changes;
# - where vLLM reserves more than the model needs (sliding-window layers), and why the batch size
#   you run with changes the concurrency it promises.

# %%
from labkit.teaching.diagrams import roadmap

roadmap("A2");  # the article's pipeline, this appendix's part highlighted

# %% [markdown]
# **You need:** chapter 02: bytes per token and the KV heads (GQA); chapter 06, its first section: a
# device's memory minus weights, workspace and reserve becomes the KV pool;
# [appendix A3](A3_fewer_bytes_per_element.ipynb): the 8-bit cache (its sections 1 and 2), sliding
# windows and a latent cache (its section 7).
#
# **Time:** about 20 minutes to read and run; about 10 minutes for the exercises.

# %%
from labkit.memory import capacity
from labkit.memory.capacity import PRESETS, TEACHING_MODEL, kv_heads_per_device
from labkit.memory.pool_plan import plan_pool
from labkit.serving.sim.costmodel import DEVICES, MODEL_COSTS
from labkit.units import GiB, KiB, format_bytes
from labkit.vllm_bridge import predict

pool = plan_pool(device_bytes=24 * GiB, set_aside_bytes=17 * GiB, model=TEACHING_MODEL, block_size=16,
                 max_model_len=8192)  # chapter 06's pool: 7 GiB, 3,584 blocks, seven 8,192-token sequences
print(pool.describe())

# %% [markdown]
# ## The batch limits vLLM picks
#
# Two engine limits shape everything below: how many requests may run at once (`max_num_seqs`) and
# how many tokens one step may carry (`max_num_batched_tokens`, whose activations are the
# *workspace*). vLLM 0.33.0 picks them per entry point and per GPU (`vllm/engine/arg_utils.py:
# EngineArgs.get_batch_defaults`):
#
# | GPU (total memory) | entry point | `max_num_seqs` | `max_num_batched_tokens` |
# |---|---|---|---|
# | under 70 GiB, an A100, or a GB10 | offline `LLM` class | 256 | 8,192 |
# | under 70 GiB, an A100, or a GB10 | `vllm serve` | 256 | 2,048 |
# | 70 to 160 GiB, other GPUs | offline `LLM` class | 1,024 | 16,384 |
# | 70 to 160 GiB, other GPUs | `vllm serve` | 1,024 | 8,192 |
# | 160 GiB or more | either | 1,024 | 16,384 |
#
# Chapter 06 sized its bookkeeping with the first row. A larger GPU gets four times the sequence
# slots and twice the step, so its block tables and its activation peak grow with it.
#
# ## Reading vLLM's start-up log
#
# vLLM does chapter 06's subtraction when it starts. It loads the weights, runs one profiling step at
# its largest batch, and hands everything left inside its budget to the KV cache. Then it logs what
# it got. `labkit.vllm_bridge.predict` redoes that arithmetic the way vLLM's code does it (vLLM 0.33.0; every
# function names the file it follows). The budget is `ceil(device × gpu_memory_utilization)`, and
# the non-KV memory is the article's 17 GiB. We start on the article's **idealised device**: all
# 24 GiB usable and `gpu_memory_utilization=1.0`, so the budget is the whole device. A real GPU
# never starts with 1.0 (below), but the arithmetic after the budget is the same:

# %%
# NBVAL_CHECK_OUTPUT
available = predict.available_kv_bytes(gpu_total_bytes=24 * GiB, gpu_memory_utilization=1.0, non_kv_bytes=17 * GiB)
report = predict.kv_cache_report(TEACHING_MODEL, available, block_size=16, max_model_len=8192)
print(*report.log_lines(), sep="\n")
print(f"page: {report.page_size_bytes:,} B per layer; block: {format_bytes(report.bytes_per_block[0])}; "
      f"blocks: {report.num_gpu_blocks:,}")
assert available == pool.pool_bytes and report.num_gpu_blocks == pool.num_blocks == 3584
assert report.max_concurrency == pool.sequences_that_fit == 7

# %% [markdown]
# These are vLLM's own words. "7.0 GiB" is §06's pool; "57,344 tokens" is 3,584 blocks of 16
# tokens; "7.00x" is §06's seven sequences (chapter 06 says what that seven counts: all 3,584
# blocks, vLLM's null block included, over 512 blocks per request). vLLM counts a *page* as one block of one layer
# (65,536 bytes here, `vllm/v1/kv_cache_interface.py: AttentionSpec.page_size_bytes`), and one
# block id covers that page in all 32 layers: 2 MiB. Older versions word it differently: vLLM 0.10.2
# printed "7.00 GiB" and put the token count and the concurrency on two separate lines.
#
# **`gpu_memory_utilization`** is the share of the device vLLM may use. Its default is 0.92 in
# vLLM 0.33.0 (0.9 in 0.10.2). On a real GPU 1.0 does not start at all: before it sizes anything,
# vLLM checks that the device's *free* memory covers the budget and otherwise raises "Free memory
# on device ... is less than desired GPU memory utilization" (`vllm/v1/worker/utils.py:
# request_memory`). Once the CUDA context exists, free memory is always below the total, so
# 1.0 is refused. The 8% the default leaves is a reserve *on top of* what the profiling run
# found, so on §06's device the default shrinks the pool:

# %%
# NBVAL_CHECK_OUTPUT
default = predict.available_kv_bytes(24 * GiB, 0.92, 17 * GiB)
print(*predict.kv_cache_report(TEACHING_MODEL, default, max_model_len=8192).log_lines(), sep="\n")
print()
try:
    predict.kv_cache_report(TEACHING_MODEL, default, max_model_len=65_536)
except predict.KVCacheTooSmallError as refusal:
    print("ValueError:", refusal)
    too_long = refusal
assert too_long.estimated_max_model_len == 41_584 and too_long.needed_bytes == 8 * GiB

# %% [markdown]
# The second call asks for 65,536-token requests, and vLLM refuses to start: one such request
# needs 4,096 blocks, 8 GiB, and only 5.08 GiB are there. (The teaching model states no context
# limit, so only memory stands in the way. vLLM checks against the pool minus one block, the
# *null block* its block pool keeps back, so a pool of exactly one request is refused too.) The message carries the fix: the longest `max_model_len` that fits, found by a binary
# search, is 41,584 tokens. Three ways out, each computed. The second, raising the utilization to
# 1.0, is arithmetic on the idealised device only: a real GPU refuses 1.0 before this check is
# reached, as said above.

# %%
# NBVAL_CHECK_OUTPUT
fixes = {
    "max_model_len=41,584": dict(available=default, max_model_len=41_584, kv_cache_dtype="auto"),
    "gpu_memory_utilization=1.0 (idealised)": dict(available=available, max_model_len=65_536,
                                                   kv_cache_dtype="auto"),
    "kv_cache_dtype='fp8'": dict(available=default, max_model_len=65_536, kv_cache_dtype="fp8"),
}
started = {}
for label, f in fixes.items():
    try:
        r = predict.kv_cache_report(TEACHING_MODEL, f["available"], max_model_len=f["max_model_len"],
                                    kv_cache_dtype=f["kv_cache_dtype"])
        started[label] = r.max_concurrency
        print(f"{label}: starts\n  {r.log_lines()[1]}")
    except predict.KVCacheTooSmallError as e:
        print(f"{label}: refused, needs {predict.format_gib(e.needed_bytes)} GiB, has "
              f"{predict.format_gib(e.available_bytes)} GiB")
assert list(started) == ["max_model_len=41,584", "kv_cache_dtype='fp8'"]
assert [f"{x:.2f}" for x in started.values()] == ["1.00", "1.27"]

# %% [markdown]
# Shortening `max_model_len` to the estimate starts, with room for a single request. Raising the
# utilization to 1.0 is not enough even on the idealised device, 7 GiB being still under 8 GiB;
# on a real GPU vLLM would stop earlier, at `request_memory`. An 8-bit cache (per-tensor fp8)
# halves every page and starts with room for about 1.27 requests. The other levers are fewer
# bytes outside the cache: smaller or quantized weights, a smaller `max_num_batched_tokens` (a
# smaller activation peak), or more GPUs.
#
# A real model can be refused before memory is counted at all. Llama-3-8B has the teaching model's
# cache shape, but its `config.json` states a limit, `max_position_embeddings` 8,192, and vLLM
# checks `max_model_len` against it when it reads the config (`vllm/config/model.py:
# _get_and_verify_max_len`). The escape hatch is an environment variable,
# `VLLM_ALLOW_LONG_MAX_MODEL_LEN=1` (`allow_long_max_model_len=True` here); then the memory check
# decides as before. vLLM's message, cut before its warning about positions past the limit:

# %%
# NBVAL_CHECK_OUTPUT
try:
    predict.kv_cache_report("Llama-3-8B", default, max_model_len=65_536)
except ValueError as refusal:
    config_refusal = refusal
    print("ValueError:", str(refusal).split(" VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used")[0])
assert not isinstance(config_refusal, predict.KVCacheTooSmallError)  # the config check, not the memory check
try:
    predict.kv_cache_report("Llama-3-8B", default, max_model_len=65_536, allow_long_max_model_len=True)
except predict.KVCacheTooSmallError as refusal:
    print(f"with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1: refused for memory, estimate {refusal.estimated_max_model_len:,}")
    assert refusal.estimated_max_model_len == too_long.estimated_max_model_len  # the teaching model's shape

# %% [markdown]
# The override says only that positions past the trained limit are allowed; vLLM's own warning
# adds that a RoPE model then produces NaN there. The memory arithmetic does not change.
#
# ## More GPUs: tensor and pipeline parallelism
#
# A model too big for one device is split, and its cache follows the split:
#
# - **tensor parallelism** (TP) gives each device a share of the attention heads, and with them a
#   share of the KV heads. A KV head cannot be cut: when the devices outnumber the KV heads, each
#   keeps one whole head, and heads are *replicated*. So the numbers must divide one way or the
#   other. vLLM builds its K and V projections that way (`vllm/model_executor/layers/linear.py:
#   QKVParallelLinear`: `num_kv_heads / tp_size` heads per device, or one head and `tp_size /
#   num_kv_heads` copies, both through `divide`, which asserts the division is exact), and so does
#   `capacity.kv_heads_per_device`: 8 KV heads on 5 devices are refused here as there;
# - **pipeline parallelism** (PP) gives each device (a stage) a range of layers, and the cache of
#   only those layers. When the layers do not divide evenly, vLLM adds the extra layers to the
#   stages before the last, from the one next to it backwards (`vllm/distributed/utils.py:
#   get_pp_indices`), and so does `capacity.pipeline_stages`: 61 layers on 4 stages are 15, 15, 16, 15.
#
# `capacity.shard` returns the busiest device's share as a `ModelShape`, so chapter 02's formula
# applies per device. Llama-3-70B has 8 KV heads and 80 layers:

# %%
# NBVAL_CHECK_OUTPUT
big = PRESETS["Llama-3-70B"]
print(f"{'TP':>3}{'PP':>4}{'devices':>9}{'KV heads/dev':>14}{'layers/dev':>12}{'per token/dev':>15}{'all devices':>13}")
per_device = {}
for tp, pp in [(1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (1, 2), (1, 4), (8, 2)]:
    dev = capacity.shard(big, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    per_device[tp, pp] = dev.bytes_per_token()
    print(f"{tp:>3}{pp:>4}{tp * pp:>9}{dev.num_kv_heads:>14}{dev.num_layers:>12}"
          f"{format_bytes(dev.bytes_per_token()):>15}{format_bytes(tp * pp * dev.bytes_per_token()):>13}")
assert per_device[8, 1] == big.bytes_per_token() // 8
assert per_device[16, 1] == per_device[8, 1]  # 16 devices, 8 KV heads: each head lives on 2 devices
assert per_device[1, 4] == big.bytes_per_token() // 4
for tp in [1, 2, 4, 8]:  # only divided: the total stays at the model's per-token cost
    assert tp * per_device[tp, 1] == big.bytes_per_token() == 320 * KiB
assert per_device[16, 1] == 40 * KiB and 16 * per_device[16, 1] == 2 * big.bytes_per_token() == 640 * KiB
assert [len(stage) for stage in capacity.pipeline_stages(61, 4)] == [15, 15, 16, 15]
try:
    capacity.shard(big, tensor_parallel_size=5)  # 8 KV heads on 5 devices: neither divides the other
except ValueError as refusal:
    print(f"\nTP=5: ValueError: {refusal}")

# %% [markdown]
# Read the last column. Up to TP=8 the total over all devices stays at the model's per-token cost:
# the cache is only divided. At TP=16 each device holds as much as at TP=8, and the total doubles:
# the replication is real memory.
#
# Now vLLM's own lines for it. Llama-3-70B's weights do not fit one 80 GiB GPU. Spread over 8 or 16
# H100s with tensor parallelism, each GPU holds a share of the weights. We assume 5 GiB per GPU for
# activations and CUDA graphs (an assumption; vLLM measures it).
#
# One caveat on the device: we give each H100 its datasheet's 80 GiB, but vLLM multiplies the
# total memory *CUDA reports*, which is below the datasheet figure (the driver and, where it is
# on, ECC take their share). Every GiB less of total is 0.92 GiB less for the cache, so the
# tokens and the concurrency in the last two columns are an **upper bound** on what vLLM would
# print:

# %%
# NBVAL_CHECK_OUTPUT
h100 = DEVICES["H100 SXM"]
llama70 = MODEL_COSTS["Llama-3-70B"]
print("last two columns: what vLLM would print at most, with 80 GiB per GPU")
print(f"{'GPUs':>4} {'KV heads/GPU':>12} {'page':>8} {'weights/GPU':>12} {'KV memory/GPU':>14} {'tokens':>10} "
      f"{'concurrency':>12}")
tp_reports = {}
for tp in (8, 16):
    kv_memory = predict.available_kv_bytes(h100.memory_bytes, 0.92, llama70.weight_bytes / tp + 5 * GiB)
    r = predict.kv_cache_report("Llama-3-70B", kv_memory, max_model_len=8192, tensor_parallel_size=tp)
    tp_reports[tp] = r
    print(f"{tp:>4} {kv_heads_per_device(8, tp):>12} {format_bytes(r.page_size_bytes):>8} "
          f"{format_bytes(llama70.weight_bytes / tp):>12} {format_bytes(kv_memory):>14} {r.gpu_kv_cache_tokens:>10,} "
          f"{r.max_concurrency:>11.2f}x")
assert tp_reports[8].page_size_bytes == tp_reports[16].page_size_bytes  # 16 GPUs, 8 KV heads: replicated
assert tp_reports[16].max_concurrency < 2 * tp_reports[8].max_concurrency
smaller = predict.available_kv_bytes(h100.memory_bytes - GiB, 0.92, llama70.weight_bytes / 8 + 5 * GiB)
assert predict.kv_cache_report("Llama-3-70B", smaller, max_model_len=8192, tensor_parallel_size=8).max_concurrency \
    < tp_reports[8].max_concurrency  # less reported memory, less concurrency: the column is an upper bound

# %% [markdown]
# At 16 GPUs the page stays the size it had at 8, each head being stored twice. Twice the GPUs do
# not give twice the tokens: the second engine holds more only because each GPU carries half as
# much weight, not because its cache got denser.
#
# DeepSeek-V3's latent cache (MLA) is one "head" of 512 + 64 elements per token and layer, with no
# separate V (`MLAAttentionSpec`: head_size_v = 0; appendix A3, section 7). Tensor parallelism
# cannot split it at all: every GPU keeps the whole latent cache of its layers, as `capacity.shard`
# does too. The block size depends on which attention backend serves it. On Hopper vLLM 0.33.0 tries
# FLASH_ATTN_MLA first, which takes any multiple of 16 tokens but only a 16-bit cache, so with the
# default dtype the block is 16; with an fp8 cache FLASH_ATTN_MLA declines and FlashMLA, which wants
# 64-token blocks, takes over (`vllm/platforms/cuda.py: _get_backend_priorities`; the backends'
# `supported_kv_cache_dtypes`). No MLA backend of 0.33.0 takes the per-token-head 8-bit dtypes. With
# 40 GiB of cache per GPU (assumed), at its full context of 163,840 tokens:

# %%
# NBVAL_CHECK_OUTPUT
for dtype, block in (("auto", 16), ("fp8", 64)):  # FLASH_ATTN_MLA, then FlashMLA
    r = predict.kv_cache_report("DeepSeek-V3", 40 * GiB, block_size=block, max_model_len=163_840,
                                tensor_parallel_size=8, kv_cache_dtype=dtype)
    print(f"kv_cache_dtype={dtype!r}, block {block}: page {r.page_size_bytes:,} B x "
          f"{PRESETS['DeepSeek-V3'].num_layers} layers\n  {r.log_lines()[1]}")
assert r.page_size_bytes == 64 * 576  # fp8: one byte per latent element, the same on all 8 GPUs
mla = PRESETS["DeepSeek-V3"]
assert capacity.shard(mla, tensor_parallel_size=8).bytes_per_token() == mla.bytes_per_token()  # never split
try:
    predict.kv_cache_report("DeepSeek-V3", 40 * GiB, max_model_len=163_840, kv_cache_dtype="fp8_per_token_head")
except ValueError as refusal:
    print(f"kv_cache_dtype='fp8_per_token_head': ValueError: {refusal}")

# %% [markdown]
# ## What the model needs, and what vLLM reserves
#
# `labkit.memory.capacity` keeps the physics: a sliding-window layer needs only its window. vLLM
# budgets a window layer for more (`SlidingWindowSpec.max_admission_blocks_per_request`): the last
# window − 1 tokens plus every token scheduled but not yet processed, because a chunk of up to
# `max_num_batched_tokens` is written into the cache *before* the window slides past the old
# tokens, plus one block, since the window need not start on a block boundary. vLLM 0.33.0 counts
# two batches in flight on a GPU (asynchronous scheduling). Gemma 2 mixes window and full layers:
# vLLM puts its 21 window layers and its 21 full layers in two groups with their own block tables
# (`vllm/v1/core/kv_cache_planning.py: _get_kv_cache_groups_uniform_page_size`). Side by side, with
# 20 GiB for the cache and 2,048 batched tokens, `vllm serve`'s default on a GPU under 70 GiB
# (the offline `LLM` class takes 8,192 there, as the table at the top says; the window budget
# grows with it, as the last lines show):

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'model':<16} {'max_model_len':>13} {'needs':>10} {'fit':>5} {'vLLM reserves':>14} {'vLLM':>7}")
side = {}
for name, model_len in [("Mistral-7B-v0.1", 32_768), ("Gemma-2-9B", 8192)]:
    shape = PRESETS[name]
    needs = shape.cache_bytes(model_len)  # the window applied: the physics
    r = predict.kv_cache_report(name, 20 * GiB, max_model_len=model_len, max_num_batched_tokens=2048)
    reserves = r.blocks_per_request * r.bytes_per_block[0]  # each block id costs a page in every layer of a group
    side[name] = needs, reserves, r
    print(f"{name:<16} {model_len:>13,} {format_bytes(needs):>10} {20 * GiB // needs:>5} "
          f"{format_bytes(reserves):>14} {r.max_concurrency:>6.2f}x")
assert side["Mistral-7B-v0.1"][0] == PRESETS["Mistral-7B-v0.1"].cache_bytes(4096)  # only the window
assert side["Mistral-7B-v0.1"][2].blocks_per_request == -(-(4095 + 2 * 2048) // 16) + 1 == 513
assert side["Gemma-2-9B"][2].blocks_per_request == 512 + 513
assert 20 * GiB // side["Mistral-7B-v0.1"][0] == 40 and 2 < side["Mistral-7B-v0.1"][1] / side["Mistral-7B-v0.1"][0] < 2.01
print()
by_budget = {budget: predict.kv_cache_report("Mistral-7B-v0.1", 20 * GiB, max_model_len=32_768,
                                             max_num_batched_tokens=budget) for budget in (2048, 8192)}
for budget, r in by_budget.items():
    print(f"Mistral-7B-v0.1, max_num_batched_tokens={budget:,}: {r.blocks_per_request:,} blocks per request, "
          f"{r.max_concurrency:.2f}x")
assert [f"{r.max_concurrency:.2f}" for r in by_budget.values()] == ["19.96", "7.99"]
assert by_budget[8192].blocks_per_request == -(-(4095 + 2 * 8192) // 16) + 1 == 1281

# %% [markdown]
# Mistral needs its 4,096-token window in each layer, 512 MiB per request, so 40 requests would
# fit in 20 GiB. vLLM reserves 513 blocks per request for the window layers (4,095 + 2 × 2,048
# tokens, rounded up, plus one block), just over twice as much, and promises 19.96 requests. With
# the `LLM` class's 8,192 batched tokens the window layers are budgeted for 4,095 + 2 × 8,192 =
# 20,479 tokens, 1,281 blocks, and the promise falls to 7.99 requests: pass the batch size your
# engine really runs with. For
# Gemma 2 the full layers need their 8,192 tokens either way; the window layers get 513 blocks,
# where the window would need 256. Neither is waste while a request runs: vLLM frees the blocks
# behind the window as it goes. The difference is the *guarantee*: the "Maximum concurrency" line
# counts worst-case requests that can all be admitted at once.

# %% [markdown]
# ## Summary
#
# - vLLM's budget is `ceil(total × gpu_memory_utilization)`; what the profiling run does not use
#   inside it becomes the KV cache. On §06's idealised device (all 24 GiB, utilization 1.0) the log
#   reads "Available KV cache memory: 7.0 GiB" and "57,344 tokens ... 7.00x"; at the default 0.92,
#   5.08x. A real GPU refuses 1.0 before sizing anything, since free memory is below the total.
# - A page is one block of one layer; one block id covers that page in every layer of its group.
# - vLLM refuses a `max_model_len` past the model's own limit (unless overridden) and one whose
#   single request does not fit the pool less its null block; the message gives the longest that
#   fits. A shorter context, an 8-bit cache, or less memory outside the cache are the ways out.
# - Tensor parallelism divides the KV heads until each GPU holds one, then replicates them, so
#   doubling the GPUs past the KV-head count does not double the tokens; pipeline parallelism
#   divides the layers, the extra ones going to the stages before the last; MLA's latent cache is
#   never split.
# - vLLM budgets a sliding-window layer for its window plus the tokens in flight (two batches on a
#   GPU), so its "Maximum concurrency" for Mistral-7B falls from 19.96x to 7.99x when the batch grows
#   from 2,048 to 8,192 tokens: pass the batch size you will really run.
#
# Back to [chapter 06](06_from_fit_to_serve.ipynb#fitting-is-not-serving), where the pool starts serving.

# %% [markdown]
# ## Exercises

# %%
from labkit.teaching.exercises import Exercises

ex = Exercises("A2_vllm_start_up")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/ a failing checker fails the notebook tests

# %% [markdown]
# **Exercise 1.** Predict vLLM's "Maximum concurrency" for the teaching model on §06's device
# (24 GiB, 17 GiB outside the cache) at vLLM's default `gpu_memory_utilization=0.92`, with
# 16-token blocks and `max_model_len=4096`, by hand: the budget (rounded up to whole bytes), the
# KV memory, whole blocks of 2 MiB, and blocks per request. Give the float vLLM prints before
# rounding.

# %%
# BEGIN SOLUTION
import math

kv_bytes = math.ceil(24 * GiB * 0.92) - 17 * GiB                          # budget minus what is not cache
block_bytes = 16 * TEACHING_MODEL.bytes_per_token()                        # 2 MiB: one page x 32 layers
answer_1 = (kv_bytes // block_bytes) / (4096 // 16)                        # all blocks / blocks per request
# END SOLUTION
# BEGIN STUB
answer_1 = None  # replace None with your computation
# END STUB
ex.check("Exercise 1", answer_1,
         hint="whole blocks of 16 x 131,072 bytes in ceil(24 GiB x 0.92) - 17 GiB, over 4,096 / 16 blocks.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** vLLM hands the KV cache whatever its budget leaves after the profiled non-KV
# memory, cuts it into whole blocks (one page per layer each), and its concurrency line divides all
# of those blocks, the null block included, by the blocks one request of `max_model_len` tokens needs.

# %% [markdown]
# **Exercise 2.** Gemma-2-9B (42 layers, 8 KV heads of dimension 256, bf16) runs with tensor
# parallelism over 16 GPUs. How many bytes per token does each GPU's cache hold, by chapter 02's
# formula (no windows)? (Think about what happens to a KV head when there are more GPUs than heads.)

# %%
# BEGIN SOLUTION
answer_2 = 2 * 42 * 1 * 256 * 2
# END SOLUTION
# BEGIN STUB
answer_2 = None  # replace None with your expression
# END STUB
gemma = PRESETS["Gemma-2-9B"]  # the numbers quoted in the exercise
assert (gemma.num_layers, gemma.num_kv_heads, gemma.head_dim, gemma.dtype_bytes) == (42, 8, 256, 2)
ex.check("Exercise 2", answer_2, hint="each GPU keeps one whole KV head of every layer")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** A KV head cannot be cut in two: with 16 GPUs and 8 KV heads, each head is
# copied onto 2 GPUs, so every GPU holds exactly 1 KV head of each of Gemma-2-9B's 42 layers, with
# `head_dim` 256 in bf16. Past the KV-head count, more GPUs stop shrinking the per-GPU cache.

# %% [markdown]
# ## References
#
# - vLLM 0.33.0, the version every function named here follows: documentation at
#   [docs.vllm.ai](https://docs.vllm.ai/), code at
#   [github.com/vllm-project/vllm](https://github.com/vllm-project/vllm). The files read:
#   `vllm/engine/arg_utils.py`, `vllm/v1/worker/utils.py`, `vllm/v1/worker/gpu_worker.py`,
#   `vllm/v1/kv_cache_interface.py`, `vllm/v1/core/kv_cache_utils.py`,
#   `vllm/v1/core/kv_cache_planning.py`, `vllm/v1/core/block_pool.py`, `vllm/config/model.py`,
#   `vllm/model_executor/layers/linear.py`, `vllm/distributed/utils.py` and `vllm/platforms/cuda.py`.
# - The source article's §06 (24 GiB − 17 GiB = 7 GiB, seven 8,192-token sequences), whose
#   device this appendix starts from; see chapter 06's references.
