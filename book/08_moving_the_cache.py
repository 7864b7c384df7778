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
# **Part II, beyond the article.**
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

roadmap("08");  # the second tier under the pool, and a decode pool fed over a link

# %% [markdown]
# **You need:** chapter 02 (bytes per token), chapter 04 (the hash chain, eviction), chapter 06 (the cost
# model, TTFT), chapter 07 (replicas).
#
# **Time:** about 25 minutes to read and run; about 55 minutes for the exercises.

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
# What moves the break-even is the bytes per token (chapter 02): fewer bytes per token cross faster, the
# arithmetic stays the same. And below the ridge, computing a prefix again adds nothing at all:

# %%
# NBVAL_CHECK_OUTPUT
from labkit.serving.sim.tiers import break_even_tokens

slow_tiers = ("NVMe SSD (PCIe 4.0)", "Network 100 Gb/s (RDMA)")
moved = {}
for label, b in (("fp8 cache (1 byte an element)", bpt // 2), ("bf16 cache, 8 KV heads", bpt),
                 ("bf16 cache, 32 KV heads", 4 * bpt)):
    moved[label] = [break_even_tokens(b, TIERS[n], cm) for n in slow_tiers]
    print(f"{label:<31}" + "".join(f"  {n.split(' (')[0]}: {h:>7,}" for n, h in zip(slow_tiers, moved[label])))
print(f"128 tokens on {cm.device.name}: recomputed inside the step {prefix_recompute_seconds(128, cm) * 1e3:.2f} ms, "
      f"as a step of their own {recompute_seconds(128, cm) * 1e3:.2f} ms, reloaded over PCIe 5.0 "
      f"{reload_seconds(128, bpt, TIERS['PCIe 5.0 x16 (host to GPU)']) * 1e3:.2f} ms")
first, second, third = moved.values()
assert all(a < b < c for a, b, c in zip(first, second, third)) and prefix_recompute_seconds(128, cm) == 0.0

# %% [markdown]
# ## Measured on this machine
#
# Both sides can be measured here, on the book's SmolLM2 (float32, one thread): `benchmarks/tier_ttft.py`
# times a request's first token three ways, for prefixes of H tokens and a 16-token question: nothing
# cached (recompute), the prefix in the pool, and the prefix pushed out of a small pool into a disk tier
# and read back with `O_DIRECT` (so this machine's page cache does not serve it; the host's still may).
# It runs for two minutes, so the chapter reads its committed result.

# %%
# NBVAL_CHECK_OUTPUT
bench = json.loads(committed_result("tier_ttft_*.json").read_text())
print(f"{bench['model']}; {bench['threads']} thread; {bench['date_utc']}; reads: {bench['read_mode']}")
print(f"{'H':>5} {'recompute':>10} {'pool hit':>9} {'tier hit':>9}   tokens equal (3 ways, transformers)")
for h, row in bench["ttft"].items():
    print(f"{h:>5} {row['recompute']['ttft_s'] * 1e3:>8.0f}ms {row['pool hit']['ttft_s'] * 1e3:>7.0f}ms "
          f"{row['tier hit']['ttft_s'] * 1e3:>7.0f}ms   {row['tokens_equal']}, {row['equals_transformers']}")
read = bench["tier_read"]
print(f"the tier's reads: {read['bandwidth_GBps']:.2f} GB/s with the checksum, {read['raw_bandwidth_GBps']:.2f} GB/s "
      f"raw; {bench['bytes_per_token'] / 1024:.0f} KiB of K/V per token")
assert all(r["tokens_equal"] and r["equals_transformers"] for r in bench["ttft"].values())
assert all(r["pool hit"]["ttft_s"] < r["tier hit"]["ttft_s"] < r["recompute"]["ttft_s"] for r in bench["ttft"].values())

# %% [markdown]
# On this CPU recomputing costs about 2.5 ms a token and the disk moves a token in about 0.1 ms: the
# tier wins from the first block, as the formula says (it puts the break-even at 8 to 9 tokens, under one
# block). To see the crossing itself, the benchmark slows the tier down on purpose: a tier that sleeps
# until its bytes have taken `bytes / B`, over a range of B, at H = 256. Where its TTFT meets the
# recompute's is the measured break-even bandwidth; the formula's is
# `B* = H × bytes_per_token / (extra − L)`, with `extra` the recompute's extra time and `L` what a
# load costs besides the bytes (checksums, copies into the pool).

# %%
# NBVAL_CHECK_OUTPUT
sweep = bench["sweep"]
points = sweep["points"]
print(f"H = {sweep['h']}: {sweep['bytes'] / 1e6:.1f} MB in {sweep['blocks']} block files; recompute "
      f"{sweep['recompute_s'] * 1e3:.0f} ms, pool hit {sweep['pool_s'] * 1e3:.0f} ms, L = {sweep['fixed_cost_s'] * 1e3:.1f} ms")
print(f"measured crossing: {sweep['measured_b_star_MBps']:.2f} MB/s")
for how, f in sweep["formula"].items():
    print(f"  formula, extra from {how:<44}: {f['b_star_MBps']:5.2f} MB/s (measured / formula {f['ratio']:.3f})")
ratio = sweep["formula"]["measured (recompute - pool hit)"]["ratio"]
assert abs(ratio - 1) <= sweep["tolerance"]

# %%
fig, ax = plt.subplots(figsize=(6, 3.4))
ax.semilogx([pt["bandwidth_MBps"] for pt in points], [pt["ttft_s"] * 1e3 for pt in points], "o-",
            label="tier hit, throttled to B")
ax.axhline(sweep["recompute_s"] * 1e3, color="k", ls="--", label="recompute")
ax.axvline(sweep["measured_b_star_MBps"], color="C0", ls=":", label="measured crossing")
ax.axvline(sweep["formula"]["measured (recompute - pool hit)"]["b_star_MBps"], color="C3", ls=":",
           label="the formula's")
ax.set(xlabel="tier bandwidth B (MB/s)", ylabel="TTFT (ms)")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# The crossing lands within a few percent of the formula (the tolerance stated in advance was ±20%).
# Two measured numbers (what recomputing adds, what a load costs besides its bytes) and the byte
# formula of chapter 02 predict where moving stops paying.

# %% [markdown]
# ## A second tier in labkit
#
# `labkit.memory.tiered.TieredPrefixCache` is chapter 04's cache with a `TierStore` behind it: when the
# allocator hands out a named block, the block's name and K/V go to the store first; a later `match`
# walks the chain through the pool, then on through the store (`num_external_tokens`, vLLM's
# `num_external_computed_tokens`), and loads only if chapter 08's rule says it pays. The pool's hits are
# counted as before; the tier's apart, as vLLM counts its connector's.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
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
# The drive that never pays on an H100 pays on the A100, whose arithmetic is three times slower: there
# a token costs more to compute than to read from the drive, and the disk tier takes most of the PCIe
# tier's gain. A 1 GB/s link never pays here, and the rule never loads from it: that run is the run without a
# tier, step for step.
#
# ## The real model with a disk tier
#
# `labkit.serving.tiered_engine.TieredEngine` is the book's engine with such a cache over its own pool:
# evicted blocks are written to files (`labkit.caches.block_files`: a header naming the block and the
# pool's shape, then the K/V, then nothing else: a SHA-256 guards the bytes) and read back on a hit.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
# NBVAL_CHECK_OUTPUT
import tempfile
from pathlib import Path

import torch

from labkit.caches.block_files import BlockFileError, decode_block
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
# A copy that is not exactly what was written must never reach attention: wrong K/V give wrong tokens
# and no error. Each file carries its block's name, the pool's shape and a SHA-256 of its bytes; a file
# cut short or with one flipped bit is refused when the tier finds it, and the block is computed again.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
# NBVAL_CHECK_OUTPUT
with tempfile.TemporaryDirectory() as tier_dir:
    tiered = TieredEngine(smol, num_blocks=POOL, block_size=16, max_num_batched_tokens=512, tier_blocks=256,
                          tier_dir=tier_dir)
    first = [tiered.generate([p], 8)[0] for p in order[:2]]  # the report's blocks are now files
    victim = sorted(Path(tier_dir).glob("*.kvblock"))[0]
    data = bytearray(victim.read_bytes())
    data[-1000] ^= 0x01  # one flipped bit
    victim.write_bytes(bytes(data))
    name = json.loads(data[12:12 + int.from_bytes(data[8:12], "little")])["name"]  # the block the file says it holds
    try:
        decode_block(tiered.backend, name, victim)
    except BlockFileError as err:
        print("refused:", str(err).replace(str(tier_dir), "<tier>"))
    rest = [tiered.generate([p], 8)[0] for p in order[2:]]
    print(f"copies refused while serving: {tiered.tier.stats.refused}; tokens equal to the engine without a tier: "
          f"{first + rest == want}")
    assert tiered.tier.stats.refused >= 1 and first + rest == want

# %% [markdown]
# ## Moving on purpose: prefill here, decode there
#
# In one pool, a long prompt's prefill shares its steps with every other request's decode, and each
# of their next tokens waits for it. DistServe and Mooncake split the work: prefill replicas compute
# prompts, decode replicas only generate, and each prompt's K/V cross a link between them. The move
# costs the prompt's bytes over the link (chapter 02 again); it buys decode steps no prefill
# interrupts. `labkit.serving.cluster.disagg.simulate_split` runs it; `goodput` is DistServe's measure,
# the share of requests that meet both a TTFT target and a time-per-output-token (TPOT) target.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
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
table = {}
for rate in (2, 4, 6):
    work = long_prompts(80, rate)
    both = simulate(work, 2, "least_loaded", cost_model=a100, **split_settings)
    tpot = np.empty(len(work))
    for i, r in enumerate(both.replicas):
        tpot[both.assignment == i] = (r.finish - r.first_token) / np.maximum(r.output_len - 1, 1)
    row = [goodput(both.ttft, tpot, TTFT_TARGET, TPOT_TARGET)]
    for link in links.values():
        s = simulate_split(work, 1, 1, link=link, cost_model=a100, **split_settings)
        row.append(goodput(s.ttft, s.tpot, TTFT_TARGET, TPOT_TARGET))
    print(f"{rate:>5} {row[0]:>22.2f} " + " ".join(f"{g:>20.2f}" for g in row[1:]))
    table[rate] = row
combined, fast, slow = (np.array([table[r][k] for r in sorted(table)]) for k in range(3))
assert fast[1] > combined[1] + 0.3          # at 4 a second: splitting keeps decodes undisturbed
assert np.all(slow < 0.5) and np.all(slow < fast)  # a 10 Gb/s link eats the gain
assert max(combined[2], fast[2]) < 0.5      # at 6 a second: one prefill replica is not enough

# %% [markdown]
# At 2 requests a second both ways meet the targets. At 4, the combined pool's decodes keep waiting
# behind 4,000-token prefills and most requests miss the 15 ms TPOT target; the split pool's decodes run
# undisturbed and most requests meet both. At 6 the one prefill replica is the bottleneck: splitting needs
# the right ratio of prefill to decode replicas for its load. Over a 10 Gb/s link a 4,000-token prompt
# (500 MiB of K/V) takes 0.4 s to move, and the link, not the GPUs, decides: the transfer eats the gain.
#
# The real engine does the same move. `labkit.serving.handoff.hand_over(prefill, request, decode)` copies
# a request's K/V from one engine's pool into another's (new block ids, the same K/V), and the decode
# engine goes on. It claims only the tokens whose K/V were really written: under chunked prefill a request
# may be half computed, and a hand-over that claimed its whole prompt would hand over empty slots, whose
# garbage attention reads without any error (vLLM PR #53314 fixed that in vLLM's connector).

# %%
# NBVAL_SKIP_IN_SOLUTIONS
# NBVAL_CHECK_OUTPUT
from labkit.serving.handoff import DecodeEngine, hand_over

prefill_engine = Engine(smol, num_blocks=64, block_size=16, max_num_batched_tokens=128)
decode_engine = DecodeEngine(smol, num_blocks=64, block_size=16, max_num_batched_tokens=128)
request = prefill_engine.add_request(prompts[0], 8)
prefill_engine.step()  # one chunk of 128 tokens: the prompt is not all computed yet
computed = request.num_computed_tokens
moved = hand_over(prefill_engine, request, decode_engine)
print(f"prompt of {len(prompts[0])} tokens, {computed} computed by the prefill engine: "
      f"claimed {moved.claimed_tokens}, {moved.sent_blocks} full blocks moved ({moved.bytes / 1e6:.1f} MB)")
while decode_engine.has_unfinished():
    decode_engine.step()
print(f"tokens equal to one engine's: {moved.request.output_token_ids == want[0]}")
assert moved.claimed_tokens == 128 and moved.request.output_token_ids == want[0]

# %% [markdown]
# ## Summary
#
# - Moving a prefix costs its bytes over the link plus a latency; computing it again costs only what it
#   adds to the step the request needs anyway, nearly nothing below the ridge point.
# - Per model, device and tier the two cross at a prefix length: a few hundred tokens for PCIe on an
#   H100, never in practice for a PCIe 4.0 drive there; on this machine the measured crossing of a
#   throttled disk tier lands within a few percent of the formula's.
# - labkit's second tier keeps evicted blocks (names and K/V), finds them after the pool, loads only
#   when it pays, counts its hits apart, and refuses a damaged copy.
# - Splitting prefill from decode is the same rule used on purpose: it keeps decodes undisturbed when the
#   link is fast and the pools are sized to the load; a slow link eats the gain.
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

# %% [markdown]
# **Quiz.** Answer with a letter.
# 1. Two models have the same weights and the same arithmetic per token; one keeps 8 KV heads (GQA), the
#    other as many KV heads as query heads (32). From the same tier, a reload pays from a shorter prefix
#    for (a) the model with 32 KV heads; (b) the GQA model; (c) both alike.
# 2. The cache is stored in fp8 (one byte an element) instead of bf16. A tier's break-even prefix length
#    moves (a) to shorter prefixes; (b) to longer prefixes; (c) nowhere: the arithmetic is the same.
# 3. A request finds 128 tokens of its prefix in a tier and must still compute its last prompt token.
#    On an H100 (Llama-3-8B), computing those 128 tokens again costs (a) about 4.8 ms, a 128-token
#    prefill step; (b) more than reloading them over PCIe 5.0; (c) nothing, or next to it.
# 4. A hand-over claims the tokens a prefill request's `num_computed_tokens` counts while its chunk's step
#    is still in flight, so some claimed slots were never written. The decode engine (a) raises an error
#    at its first step; (b) attends over those slots and may sample other tokens, with no error;
#    (c) finds them missing and computes them again, only slower.

# %%
# BEGIN SOLUTION
quiz = {1: "b", 2: "a", 3: "c", 4: "b"}
# END SOLUTION
# BEGIN STUB
quiz = {1: None, 2: None, 3: None, 4: None}  # a letter each
# END STUB
ex.quiz(quiz)

# %% [markdown]
# ## What you can now do
#
# - Price a prefix's move (bytes over a link, plus a latency) against its recompute (the extra in the step
#   that needs it), and find where they cross for a model, a device and a tier.
# - Measure both sides on a real engine, and check the crossing against the formula within a stated tolerance.
# - Put a second tier behind a prefix cache: evicted blocks kept, found after the pool, loaded only when it
#   pays, counted apart, a damaged copy refused.
# - Split prefill from decode, move a request's written K/V between engines, and read goodput against the link.

# %% [markdown]
# ## References
#
# - Ruoyu Qin et al., *Mooncake: Trading More Storage for Less Computation*, FAST '25 (a pooled KV store and
#   disaggregated prefill and decode).
# - Yinmin Zhong et al., *DistServe: Disaggregating Prefill and Decoding for Goodput-optimized Large Language
#   Model Serving*, OSDI 2024, [arXiv:2401.09670](https://arxiv.org/abs/2401.09670): goodput, 7.4x more
#   requests within latency targets.
# - LMCache, [arXiv:2510.09665](https://arxiv.org/abs/2510.09665); vLLM's OffloadingConnector (vLLM blog,
#   2026-01); SGLang's HiCache (LMSYS, 2025-09-10); the counter-example sgl-project/sglang#26305.
# - vLLM 0.33.0: `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`: `num_external_computed_tokens`,
#   `connector_prefix_cache_stats`; `_update_waiting_for_remote_kv`; `_connector_finished`), vLLM PR #53314
#   (under chunked prefill, claim only written tokens).

