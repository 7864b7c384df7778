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
# # 08 · Moving the cache
#
# **Part II, beyond the article.** (DRAFT on branch wip-42: prose to be finished; numbers computed.)
#
# **The message.** A block is worth moving when its bytes cross the link in less time than computing it
# again would add to the step that needs it, and chapters 02 and 06 already give both numbers.
#
# Chapter 04 ends where memory ends: an evicted prefix block is gone, and the next request that needs
# it computes it again. Serving systems now keep such blocks elsewhere (vLLM's OffloadingConnector in
# CPU memory, LMCache on CPU, disk and remote stores, SGLang's HiCache, Mooncake's pooled store), and
# move K/V between machines on purpose: one pool of replicas computes prompts, another generates
# (DistServe, Mooncake). The reported gains are large; they are not universal. In one SGLang report
# (sgl-project/sglang#26305) a hit in a file tier took 2,450 ms where computing the prefix again took
# 1,725 ms.
#
# **What you will learn**
#
# - the price of moving a prefix (its bytes over a link, plus a latency) against the price of computing
#   it again (not a step of its own: the *extra* it adds to the step the request needs anyway);
# - where the two cross, per model, device and tier, and on this machine, measured;
# - a second tier in labkit's cache, simulated and real: evicted blocks kept, found after the pool,
#   loaded only when it pays, a damaged copy refused;
# - the same rule a second time: prefill on one pool, decode on another, and what the link costs.

# %%
from labkit.teaching.diagrams import roadmap

roadmap("07");  # TODO: roadmap("08") with the second tier and the second pool drawn

# %% [markdown]
# **You need:** chapter 02 (bytes per token), chapter 04 (the hash chain, eviction), chapter 06 (the cost
# model, TTFT), chapter 07 (replicas).
#
# **Time:** about 30 minutes to read and run; about 55 minutes for the exercises.

# %%
import json

import matplotlib.pyplot as plt
import numpy as np

import labkit
from labkit.serving.sim.costmodel import CostModel
from labkit.serving.sim.tiers import (TIERS, break_even_table, prefix_recompute_seconds, recompute_seconds,
                                      reload_seconds)
from labkit.teaching.results import committed_result

print(labkit.describe())

# %% [markdown]
# ## The price of moving, and the price of computing again
#
# Reloading H tokens costs their bytes over the tier's link plus a fixed latency. Recomputing them is not
# a step of its own: the request needs a step for the part of its prompt no tier holds (at least its last
# token), and that step reads all the weights anyway. What recomputing costs is the *extra* time the H
# tokens add to it.

# %%
# NBVAL_CHECK_OUTPUT
cm = CostModel("Llama-3-8B", "H100 SXM")
bpt = cm.kv_bytes_per_token
H = np.unique(np.geomspace(1, 32768, 60).astype(int))
extra = np.array([prefix_recompute_seconds(int(h), cm) for h in H])
whole = np.array([recompute_seconds(int(h), cm) for h in H])
shown = ["PCIe 5.0 x16 (host to GPU)", "Network 100 Gb/s (RDMA)", "NVMe SSD (PCIe 4.0)"]
reload = {name: np.array([reload_seconds(int(h), bpt, TIERS[name]) for h in H]) for name in shown}
print(f"{cm.model.shape.name} on {cm.device.name}: {bpt / 1024:.0f} KiB of K/V per token")
for name in shown:
    t = TIERS[name]
    print(f"  {name:<28} {bpt / t.bandwidth * 1e6:6.2f} us per token + {t.latency * 1e6:.0f} us")
print(f"  recomputing, once compute-bound: {cm.flops_per_token / cm.device.peak_flops * 1e6:.2f} us per token")
assert bpt == 131072

# %%
fig, ax = plt.subplots(figsize=(7, 3.8))
ax.loglog(H, extra * 1e3, "k-", lw=2, label="recompute: the extra in the step")
ax.loglog(H, whole * 1e3, "k:", label="recompute as a step of its own (the trap)")
for name in shown:
    ax.loglog(H, reload[name] * 1e3, label=f"reload over {name}")
ax.set(xlabel="prefix length H (tokens)", ylabel="time (ms)")
ax.legend(fontsize=7)
plt.show()

# %% [markdown]
# Below a few hundred tokens the extra is almost nothing: the prefix rides along the weight read that
# the step pays anyway, and every reload loses. Above the ridge, recomputing costs about 15 us a token
# on an H100; PCIe and a fast network move a token in less, a PCIe 4.0 NVMe drive in more, so from the
# disk only the quadratic attention of a very long prefix could make moving pay.

# %%
# NBVAL_CHECK_OUTPUT
rows = break_even_table(["Llama-3-8B"], list(TIERS.values()), ["H100 SXM", "RTX 4090 (24 GiB)"])
print(f"{'device':<18} {'tier':<28} {'reload us/token':>15} {'break-even H':>13}")
for r in rows:
    h = r["break_even_tokens"]
    print(f"{r['device']:<18} {r['tier']:<28} {r['reload_s_per_token'] * 1e6:>15.2f} {h if h else 'never':>13}")
nvme = next(r for r in rows if r["device"] == "H100 SXM" and r["tier"].startswith("NVMe"))
assert nvme["break_even_tokens"] > 8192  # beyond Llama-3-8B's context: from this disk, never in practice

# %% [markdown]
# ## Measured on this machine
#
# TODO: the committed benchmark (benchmarks/tier_ttft.py): TTFT on SmolLM2 with recompute, a pool hit and a
# tier hit (block files read with O_DIRECT), the disk's read bandwidth, and the throttled sweep whose
# crossing sits beside the formula's.

# %% [markdown]
# ## A second tier in labkit
#
# `labkit.memory.tiered.TieredPrefixCache` is chapter 04's cache with a `TierStore` behind it: when the
# allocator hands out a named block, the block's name and K/V go to the store first; a later `match`
# walks the chain through the pool, then on through the store (`num_external_tokens`, vLLM's
# `num_external_computed_tokens`), and loads only if chapter 08's rule says it pays. The pool's hits are
# counted as before; the tier's apart, as vLLM counts its connector's.

# %%
# NBVAL_CHECK_OUTPUT
from labkit.serving.sim.mooncake import read_mooncake_trace
from labkit.serving.sim.simulator import Simulator
from labkit.serving.sim.tiers import Tier
from labkit.serving.variants.tiered import TieredSimulator

specs = read_mooncake_trace(one_in=40, time_scale=0.5)
a100 = CostModel("Llama-3-8B", "A100 80GB SXM")
settings = dict(pool_bytes=16 * 2 ** 30, block_size=512, max_num_batched_tokens=8192)
runs = {"no second tier": Simulator(a100, **settings).run(specs)}
for name in ("PCIe 4.0 x16 (host to GPU)", "NVMe SSD (PCIe 4.0)"):
    runs[name] = TieredSimulator(a100, tier=TIERS[name], tier_blocks=100_000, **settings).run(specs)
runs["a 1 GB/s link"] = TieredSimulator(a100, tier=Tier("1 GB/s", 1e9, 1e-4, source="assumed"), tier_blocks=100_000,
                                        **settings).run(specs)
print(f"{len(specs)} requests of Mooncake's trace; 16 GiB pool")
print(f"{'':<28} {'pool hits':>9} {'tier hits':>9} {'TTFT p50':>9} {'TTFT p90':>9}")
for name, r in runs.items():
    pool = r.scheduler.prefix_cache.stats
    tier = getattr(r.scheduler, "tier_stats", None)
    p = r.ttft_percentiles()
    print(f"{name:<28} {pool.hits / pool.queries:>9.3f} {(tier.hits / tier.queries if tier else 0):>9.3f} "
          f"{p['p50']:>8.2f}s {p['p90']:>8.2f}s")
assert runs["PCIe 4.0 x16 (host to GPU)"].ttft_percentiles()["p50"] < runs["no second tier"].ttft_percentiles()["p50"]

# %% [markdown]
# A tier slower than the link of a faster device can still pay: on the A100 the arithmetic of a token
# costs more than reading its K/V from the NVMe drive, so the disk tier takes most of the PCIe tier's
# gain. A 1 GB/s link never pays here, and the rule never loads from it: that run is the run without a
# tier, step for step.
#
# ## The real model with a disk tier
#
# `labkit.serving.tiered_engine.TieredEngine` is the book's engine with such a cache over its own pool:
# evicted blocks are written to files (`labkit.caches.block_files`: a header naming the block and the
# pool's shape, then the K/V, then nothing else: a SHA-256 guards the bytes) and read back on a hit.

# %%
# NBVAL_CHECK_OUTPUT
import tempfile

import torch

from labkit.caches.block_files import BlockFileError
from labkit.model.pretrained import chat_token_ids, from_pretrained, load_tokenizer, real_model
from labkit.serving.engine import Engine
from labkit.serving.tiered_engine import TieredEngine

path = real_model()
smol = from_pretrained(path, dtype=torch.float32, device=labkit.DEVICE)
tokenizer = load_tokenizer(path)
from labkit.caches.quant_quality import sample_text

report = sample_text("held_out")[:1500]  # a passage of a public-domain history book (appendix A3's)
system = {"role": "system", "content": "Answer in one short sentence, from the report.\n\n" + report}
asks = ["Who is the report about?", "What happened first?", "Summarise it in five words."]
filler = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Count to twenty. " * 20}]
prompts = [chat_token_ids(tokenizer, [system, {"role": "user", "content": q}]) for q in asks]
pushing = chat_token_ids(tokenizer, filler)
order = [prompts[0], pushing, prompts[1], pushing, prompts[2]]  # the filler pushes the report out of the pool
POOL = (max(map(len, order)) + 16) // 16 + 1
plain = Engine(smol, num_blocks=POOL, block_size=16, max_num_batched_tokens=512)
want = [plain.generate([p], 8)[0] for p in order]
with tempfile.TemporaryDirectory() as tier_dir:
    tiered = TieredEngine(smol, num_blocks=POOL, block_size=16, max_num_batched_tokens=512, tier_blocks=256,
                          tier_dir=tier_dir)
    got = [tiered.generate([p], 8)[0] for p in order]
    stats = tiered.tier.stats
    print(f"pool of {POOL} blocks of 16 tokens; report prompts of {len(prompts[0])} tokens")
    print(f"blocks written to the tier: {stats.puts}; loaded back: {stats.loaded_blocks} "
          f"({stats.loaded_tokens} tokens, {tiered.tier.read_mode} reads)")
    print(f"tokens equal to the engine without a tier: {got == want}")
    assert got == want and stats.loaded_blocks > 0

# %% [markdown]
# TODO: a damaged file refused (BlockFileError), the block recomputed, tokens still equal; the measured TTFT.
#
# ## Moving on purpose: prefill here, decode there
#
# In one pool, a long prompt's prefill shares its steps with every other request's decode, and each
# of their next tokens waits for it. DistServe and Mooncake split the work: prefill replicas compute
# prompts, decode replicas only generate, and each prompt's K/V cross a link between them. The move
# costs the prompt's bytes over the link (chapter 02 again); it buys decode steps no prefill
# interrupts. `labkit.serving.cluster.disagg.simulate_split` runs it; `goodput` is DistServe's measure,
# the share of requests that meet both a TTFT target and a time-per-output-token (TPOT) target.

# %%
# NBVAL_CHECK_OUTPUT
from labkit.serving.cluster.cluster import simulate
from labkit.serving.cluster.disagg import goodput, simulate_split
from labkit.serving.sim.workloads import RequestSpec


def long_prompts(n, rate, prompt=4000, out=256, seed=0):
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    return [RequestSpec(i, float(t[i] - t[0]), rng.integers(0, 32000, prompt).tolist(), out) for i in range(n)]


split_settings = dict(pool_bytes=40 * 2 ** 30, block_size=16, max_num_batched_tokens=8192)
TTFT_TARGET, TPOT_TARGET = 1.0, 0.015
links = {"NVLink": TIERS["NVLink (H100, GPU to GPU)"], "10 Gb/s": Tier("10 Gb/s", 1.25e9, 1e-5, source="line rate")}
print(f"{'rate':>5} {'combined (2 replicas)':>22} " + " ".join(f"{'1P:1D over ' + n:>20}" for n in links))
for rate in (2, 4, 6):
    work = long_prompts(120, rate)
    both = simulate(work, 2, "least_loaded", cost_model=a100, **split_settings)
    tpot = np.empty(len(work))
    for i, r in enumerate(both.replicas):
        tpot[both.assignment == i] = (r.finish - r.first_token) / np.maximum(r.output_len - 1, 1)
    row = [goodput(both.ttft, tpot, TTFT_TARGET, TPOT_TARGET)]
    for link in links.values():
        s = simulate_split(work, 1, 1, link=link, cost_model=a100, **split_settings)
        row.append(goodput(s.ttft, s.tpot, TTFT_TARGET, TPOT_TARGET))
    print(f"{rate:>5} {row[0]:>22.2f} " + " ".join(f"{g:>20.2f}" for g in row[1:]))

# %% [markdown]
# TODO: read the table (where splitting wins, where the link eats the gain, the prefill side's share);
# the real hand-over on SmolLM2 (labkit.serving.handoff.hand_over: tokens equal, new block ids) and the
# claim rule of chunked prefill (vLLM PR #53314: claim only the tokens whose K/V were written).
#
# ## Exercises

# %%
from labkit.teaching.exercises import Exercises

ex = Exercises("08_moving_the_cache")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/, every checker must pass

# %% [markdown]
# **Exercise 1 (build it).** Write `reload_or_recompute(tier_tokens, cached_tokens, suffix_tokens,
# bytes_per_token, tier, cost_model)`: True when loading the `tier_tokens` a request found in the second
# `tier`, after the `cached_tokens` it found in the pool, takes less time than computing them again in the
# step that computes its last `suffix_tokens` anyway. Loading costs `tier_tokens × bytes_per_token /
# tier.bandwidth + tier.latency`. Recomputing costs the *extra* time of that step, priced by
# `cost_model.time_from_sums(new, context, pairs)`: a step computing `new` tokens after `context` cached ones
# makes `new × context + new × (new + 1) / 2` query-key pairs, and the extra is the step of
# `tier_tokens + suffix_tokens` new tokens after `cached_tokens`, less the step of `suffix_tokens` after
# `cached_tokens + tier_tokens`. Nothing in the tier is never loaded; a tie recomputes.

# %%
def reload_or_recompute(tier_tokens, cached_tokens, suffix_tokens, bytes_per_token, tier, cost_model) -> bool:
    # BEGIN SOLUTION
    if tier_tokens == 0:
        return False  # the blocks were evicted from the tier: nothing to load

    def step(new, context):  # one step computing `new` tokens after `context` cached ones
        return cost_model.time_from_sums(new, context, new * context + new * (new + 1) / 2)

    load = tier_tokens * bytes_per_token / tier.bandwidth + tier.latency
    extra = step(tier_tokens + suffix_tokens, cached_tokens) - step(suffix_tokens, cached_tokens + tier_tokens)
    return load < extra  # a tie recomputes
    # END SOLUTION
    # BEGIN STUB
    raise NotImplementedError("your code here")
    # END STUB


from labkit.serving.sim.tiers import break_even_tokens
from labkit.teaching.build_it_tiers import reload_check

ex.check_behaviour("Exercise 1", reload_or_recompute, reload_check(),
                   forbid=[reload_seconds, recompute_seconds, prefix_recompute_seconds, break_even_tokens,
                           break_even_table],
                   hint="recomputing costs the extra time the tokens add to the step the request needs anyway, "
                        "not a step of their own; the latency is paid on every load; bytes cross the link, not "
                        "tokens; the pool's tokens are context, neither loaded nor recomputed; a miss loads "
                        "nothing; a tie recomputes.")
