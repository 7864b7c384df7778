# %% [markdown]
# # 03 · Paged blocks
#
# **The message.** Handing out cache memory in small fixed-size blocks, found through a block table,
# lets a server fill almost all the memory it reserves with real tokens, where reserving each
# request's longest possible length leaves most of it empty.
#
# Chapter 02 priced one token of cache. A serving system holds many requests at once, each of
# unknown final length, and must decide *where* their tokens go. PagedAttention (Kwon et al., SOSP
# 2023) hands out memory in small fixed-size blocks, the way an operating system pages memory. This
# chapter builds that allocator, measures what it saves, and checks that attention read through a
# block table gives the same answer.
#
# **What you will learn**
#
# - how blocks, block tables and slots work, and the article's numbers: a 16-token block of the
#   teaching model is 2 MiB, and a 37-token request takes 3 blocks with 1.375 MiB of empty tail;
# - how much memory holds real tokens with a reservation at the maximum length, and with paging,
#   and how contiguous reservations also lose free memory to holes;
# - what the block size trades: tail waste against block-table entries;
# - what paging does **not** do: it neither compresses elements nor makes attention sparse, and
#   attention over scattered blocks equals attention over one contiguous tensor;
# - that chapter 01's decoder produces the same tokens on the paged cache.
#
# How labkit's Triton kernels walk a block table, step by step, and what a GPU makes of them, is
# appendix [A1 · the paged kernels](A1_under_the_compiler.ipynb).

# %%
from labkit.teaching.diagrams import roadmap

roadmap("03");  # the article's pipeline, this chapter's part highlighted

# %% [markdown]
# **You need:** chapter 02: bytes per token, and the teaching model's 128 KiB per token; chapter 01:
# the decoder, its cache and greedy generation.
#
# **Time:** about 30 minutes to read and run; about 90 minutes for the exercises.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

import labkit
from labkit.caches.contiguous import generate
from labkit.caches.paged import generate_paged
from labkit.kernels.cpu import paged_decode_attention_batched
from labkit.kernels.paged_attention import paged_decode_attention, write_kv
from labkit.kernels.reference import gather_kv, paged_decode_attention_ref, paged_prefill_attention_ref
from labkit.memory.blocks import blocks_needed
from labkit.memory.paging import BlockAllocator, BlockTable, OutOfBlocksError
from labkit.model.decoder import Decoder, DecoderConfig, causal_attention
from labkit.units import format_bytes

torch.set_num_threads(2)
print(labkit.describe())
ON_GPU = labkit.RUNTIME.triton_mode == "compiled"

# %% [markdown]
# ## 1. A block of the teaching model
#
# A *block* holds the K and V of `block_size` consecutive tokens of one sequence, in every layer.
# With the teaching model (128 KiB per token) a 16-token block is 2 MiB, and a 37-token request
# needs ceil(37 / 16) = 3 blocks, the last partly empty. The pool below has 8 blocks and has served
# traffic: three earlier requests took two blocks each, and the first and third have finished, so
# the free blocks are scattered, as in any pool that has run for a while.

# %%
# NBVAL_CHECK_OUTPUT
from labkit.memory.capacity import TEACHING_MODEL  # chapter 02: 32 layers, 8 KV heads, head dim 128, 2 bytes

per_token = TEACHING_MODEL.bytes_per_token()
BLOCK = 16
per_block = BLOCK * per_token

allocator = BlockAllocator(num_blocks=8)
earlier = [BlockTable(BLOCK) for _ in range(3)]
for table in earlier:
    table.append(2 * BLOCK, allocator)  # two blocks each: 0-1, 2-3, 4-5
earlier[0].release(allocator)
earlier[2].release(allocator)  # blocks 0, 1, 4, 5, 6, 7 are free; 2 and 3 still hold earlier[1]

request = BlockTable(block_size=BLOCK)
request.append(37, allocator)  # make room for 37 tokens
tail_bytes = request.empty_slots * per_token

print(f"one token            : {format_bytes(per_token)}")
print(f"one {BLOCK}-token block  : {format_bytes(per_block)}")
print(f"37 tokens            : ceil(37 / {BLOCK}) = {len(request.block_ids)} blocks = "
      f"{format_bytes(len(request.block_ids) * per_block)}")
print(f"empty slots, last block: {request.empty_slots} = {format_bytes(tail_bytes)}")
assert per_block == 2 * 2**20 and len(request.block_ids) == blocks_needed(37, 16) == 3
assert request.empty_slots == 11 and tail_bytes == 1.375 * 2**20

# %% [markdown]
# That is all of paging's bookkeeping, and it fits on a page of `labkit.memory.paging`. The allocator keeps
# the free blocks in one queue and hands out its front; the block's reference count (how many block
# tables hold it) becomes 1:

# %%
from labkit.teaching.excerpts import excerpt

excerpt(BlockAllocator.allocate, "if not self._free", "self.ref_counts[block_id] = 1")

# %% [markdown]
# A request asks for all its new blocks at once and gets all or none, so a refusal leaves nothing
# half-allocated for a scheduler (chapter 05) to clean up:

# %%
excerpt(BlockAllocator.allocate_many, "if n > self.num_free", "return")

# %% [markdown]
# A sequence's block table grows by whole blocks, only when its new tokens no longer fit the last
# one, and returns their *slot mapping*, the pool slots their K and V will be written to:

# %%
excerpt(BlockTable.append, "new = allocator", "return self.slots")

# %% [markdown]
# A slot numbers every token position of the pool: token `p` lives in logical block
# `p // block_size`, at offset `p % block_size`, and the table turns the logical block into a
# physical one:

# %%
excerpt(BlockTable.slot, "return self.block_ids")

# %% [markdown]
# When a sequence finishes, each of its blocks loses one reference; a block that no table holds
# any more returns to the free queue, at the front, to be reused first (a block that chapter 04 has
# *named* goes to the back instead, so that its K/V can still be found):

# %%
excerpt(BlockAllocator.free_blocks, "for b in block_ids:", "return unnamed + named")

# %% [markdown]
# Our request got the front of the free queue, the most recently freed blocks first, so its block
# table is not in pool order:

# %%
print("block table:", request.block_ids)
for p in (0, 15, 16, 36):
    print(f"token {p:2d} -> logical block {p // BLOCK}, offset {p % BLOCK:2d} -> slot {request.slot(p)}")
assert request.slot(36) == request.block_ids[2] * BLOCK + 4
# Logical order is not physical order: the blocks are not consecutive, and slot != position.
assert request.block_ids != sorted(request.block_ids) and any(request.slot(p) != p for p in range(37))
assert request.block_ids[1] < request.block_ids[0] and request.slot(0) == 80  # quoted below

# %% [markdown]
# Logical block 1 sits *before* logical block 0 in the pool, and token 0 lives in slot 80: only the
# block table knows the order. When the pool runs short, the whole request is refused and nothing
# changes:

# %%
other = BlockTable(BLOCK)
before = (allocator.num_free, list(other.block_ids))
try:
    other.append(4 * BLOCK, allocator)  # 4 blocks, but only 3 are free
except OutOfBlocksError as err:
    print("refused:", err)
assert (allocator.num_free, list(other.block_ids)) == before == (3, [])
request.release(allocator)  # the request finishes: its blocks go back to the pool
earlier[1].release(allocator)
print("free blocks after every request finished:", allocator.num_free)
assert allocator.num_free == 8

# %% [markdown]
# ## 2. Reserving the maximum against paging
#
# Before paging, a serving system gave each request one contiguous region. A request's final length
# is unknown when it starts, so the region was sized for the longest allowed sequence, or a guess of
# it, and whatever the request never filled was wasted.
#
# ### How much reserved memory holds tokens
#
# We measure that on 10,000 chat-like requests drawn by labkit's `sharegpt_like`, whose prompt and
# output lengths are log-normal with the means of the ShareGPT conversations in the PagedAttention
# paper (161 and 338 tokens), each capped at 1,024 tokens (it also draws arrival times, unused
# here). After decode step `t` a request holds `prompt + t` live tokens.
# `labkit.memory.pool_plan.reservation_shares` divides the live tokens by what the requests
# reserved, summed over all requests and steps, under the four policies of the paper's
# Figure 2: reserve the 2,048-token limit (Orca (Max)); reserve the final length rounded up to a
# power of two (Orca (Pow2)); reserve exactly the final length, as if it were known (Orca (Oracle));
# or hold only the 16-token blocks the live tokens fill (vLLM).

# %%
# NBVAL_CHECK_OUTPUT
from labkit.memory.pool_plan import PAPER_FIG2, reservation_shares
from labkit.serving.sim.workloads import SHAREGPT, sharegpt_like

MAX_LEN = SHAREGPT.max_prompt_len + SHAREGPT.max_output_len
requests = sharegpt_like(10_000, arrival_rate=4.0, seed=0)  # the arrival times are not used here
lengths = np.array([r.prompt_len + r.output_len for r in requests])
assert MAX_LEN == 2048 and lengths.max() <= MAX_LEN
assert (round(SHAREGPT.prompt_mean), round(SHAREGPT.output_mean), SHAREGPT.max_output_len) == (161, 338, 1024)

shares = reservation_shares(requests, max_len=MAX_LEN, block_size=16)
print(f"{len(lengths):,} requests, mean final length {lengths.mean():.0f} tokens, longest {lengths.max()}")
print(f"{'policy':<32} {'ours':>6} {'paper':>6}   share of reserved KV memory holding token states")
for policy, ours in shares.items():
    print(f"{policy:<32} {ours:6.1%} {PAPER_FIG2[policy]:6.1%}")
values = list(shares.values())
assert values == sorted(values) and shares["paged, 16-token blocks"] > 0.95
assert all(shares[p] > PAPER_FIG2[p] for p in list(shares)[:3])  # our reservations look better: see below
assert [f"{v:.1%}" for v in values] == ["21.5%", "40.3%", "61.3%", "98.3%"]  # quoted in the text and summary

# %%
fig, ax = plt.subplots(figsize=(7, 3.6))
ypos = np.arange(len(shares))
ax.barh(ypos - 0.2, [100 * s for s in shares.values()], height=0.4, color="C0", label="this count (synthetic workload)")
ax.barh(ypos + 0.2, [100 * PAPER_FIG2[p] for p in shares], height=0.4, color="0.6", label="the paper's Fig. 2 (measured)")
for y, policy in zip(ypos, shares):
    ax.text(100 * shares[policy] + 1, y - 0.2, f"{shares[policy]:.1%}", va="center", fontsize=8)
    ax.text(100 * PAPER_FIG2[policy] + 1, y + 0.2, f"{PAPER_FIG2[policy]:.1%}", va="center", fontsize=8)
ax.set_yticks(ypos, list(shares))
ax.set_xlim(0, 115)
ax.set_xlabel("share of reserved KV memory holding token states (%)")
ax.set_title("Paging leaves almost nothing reserved but unused\n(counted on 10,000 synthetic requests)", fontsize=10)
ax.invert_yaxis()
ax.legend(loc="upper right", fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Reserving the maximum leaves most of the memory empty; even the oracle wastes what a request has
# reserved but not yet filled; paging wastes at most the tail of one block per request, so its share
# is close to the paper's 96.3% whatever the allocator. Our reservation shares come out higher than
# the paper's, for four reasons:
#
# - **Holes between reservations are not counted.** The paper measured allocators, in which
#   reservations of different sizes leave free holes that no request fits into (next subsection).
#   `reservation_shares` counts each request's own reservation only, so its shares are upper bounds.
# - **Power-of-two rounding.** The paper's Orca is not the Orca system itself but the authors' own
#   reimplementation, with an assumed buddy allocator (§6.5), which hands out regions in powers of
#   two. Rounding the oracle's exact lengths up to powers of two is the table's second row: 61.3%
#   falls to 40.3%.
# - **Lengths.** Ours are synthetic log-normals with the paper's means, not the ShareGPT trace.
# - **Weighting.** We weight every request by its decode steps; the paper sampled a running system.
#
# ### External fragmentation: free memory in pieces too small
#
# A contiguous reservation needs one run of free slots. As requests of different lengths come and
# go, the free memory breaks into holes, and a request can be refused while the free slots add up to
# far more than it needs. Below, a first-fit allocator (a deliberate reduction written here, not
# labkit: each request takes the first hole that holds its exact final length, the oracle's best
# case) and labkit's paged allocator serve the first 2,000 of the same requests on the same 16,384
# slots. A request arrives every 16 steps and holds its slots for as many steps as it has output
# tokens; on average, the live requests ask for a little less than the whole pool (printed below).
# Here the paged allocator, too, reserves each request's final length on arrival instead of growing
# block by block, so contiguity is the only difference between the two: the demo isolates external
# fragmentation.

# %%
def first_fit(holes: list[list[int]], size: int) -> int | None:
    """Take ``size`` contiguous slots from the first hole ``[start, length]`` that holds them."""
    for hole in holes:
        if hole[1] >= size:
            start = hole[0]
            hole[0] += size
            hole[1] -= size
            return start
    return None


def give_back(holes: list[list[int]], start: int, size: int) -> list[list[int]]:
    """Return ``[start, start + size)`` and merge it with its neighbours."""
    merged = []
    for s_, n_ in sorted([h for h in holes if h[1] > 0] + [[start, size]]):
        if merged and merged[-1][0] + merged[-1][1] == s_:
            merged[-1][1] += n_
        else:
            merged.append([s_, n_])
    return merged


POOL_SLOTS = 16_384
GAP = 16  # steps between arrivals
holes, contiguous_live = [[0, POOL_SLOTS]], []  # contiguous_live: (finish step, start, size)
paged_pool, paged_live = BlockAllocator(POOL_SLOTS // 16), []
refused = {("first fit", True): 0, ("first fit", False): 0, ("paged", True): 0, ("paged", False): 0}
stream = requests[:2000]
mean_demand = np.mean([r.output_len * (r.prompt_len + r.output_len) for r in stream]) / GAP
print(f"average demand: {mean_demand:,.0f} slots of {POOL_SLOTS:,}")
worst = (0, 0)  # (free slots in total, largest hole) at a refusal with enough free in total
for i, r in enumerate(stream):
    step = i * GAP
    for kind, live in (("contiguous", contiguous_live), ("paged", paged_live)):
        for item in [x for x in live if x[0] <= step]:  # requests that finished by now
            live.remove(item)
            if kind == "contiguous":
                holes = give_back(holes, item[1], item[2])
            else:
                item[1].release(paged_pool)
    size = r.prompt_len + r.output_len
    start = first_fit(holes, size)
    if start is not None:
        contiguous_live.append((step + r.output_len, start, size))
    else:
        free_total, largest = sum(h[1] for h in holes), max(h[1] for h in holes)
        enough = free_total >= size
        refused["first fit", enough] += 1
        if enough and free_total - largest > worst[0] - worst[1]:
            worst = (free_total, largest)
    table = BlockTable(16)
    try:
        table.append(size, paged_pool)
        paged_live.append((step + r.output_len, table))
    except OutOfBlocksError:
        refused["paged", paged_pool.num_free >= blocks_needed(size, 16)] += 1

for kind in ("first fit", "paged"):
    print(f"{kind:9s}: refused {refused[kind, True] + refused[kind, False]:3d} of {len(stream):,} requests, "
          f"{refused[kind, True]:3d} of them while enough slots were free in total")
print(f"first fit, worst refusal: {worst[0]:,} slots free in total, the largest hole {worst[1]:,} slots")
assert refused["first fit", True] > 0 and refused["paged", True] == 0 and worst[0] > 4 * worst[1]
assert refused["first fit", True] + refused["first fit", False] > refused["paged", False]
assert refused["first fit", False] == 0  # "every request first fit refused", below
refused_total = {kind: refused[kind, True] + refused[kind, False] for kind in ("first fit", "paged")}
assert (refused_total["paged"], refused_total["first fit"]) == (117, 129)  # quoted below

# %% [markdown]
# Every refusal of first fit came while enough slots were free in total; at the worst one, the free
# slots added up to more than four times the largest hole. The paged allocator refused 117 requests
# against first fit's 129, each only when too few blocks were free: any free block can take any
# logical block. Its 117 are the price of reserving final lengths on a pool this busy, not of
# fragmentation; holding only the blocks the live tokens fill (section 2) would ask for less.
#
# ## 3. Choosing the block size
#
# Smaller blocks waste less in the tail, but a request then needs more of them: longer block tables
# and more lookups for the kernel. `reservation_shares` gives the paged share of the pool that holds
# tokens for any block size; the rest of what paging holds is the empty tails of last blocks:

# %%
block_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
paged_share = {bs: list(reservation_shares(requests, max_len=MAX_LEN, block_size=bs).values())[-1] for bs in block_sizes}
tail_waste = [1 - paged_share[bs] for bs in block_sizes]
entries = [np.mean([blocks_needed(int(n), bs) for n in lengths]) for bs in block_sizes]
for bs, waste, n in zip(block_sizes, tail_waste, entries):
    print(f"block {bs:3d}: tail waste {waste:6.2%}, block-table entries per request {n:7.1f}")
assert paged_share[16] == shares["paged, 16-token blocks"]
assert all(a <= b for a, b in zip(tail_waste, tail_waste[1:]))  # waste grows with the block size
assert all(a >= b for a, b in zip(entries, entries[1:]))  # entries shrink with it

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(block_sizes, [100 * w for w in tail_waste], "o-", color="C3", label="tail waste")
ax.set_xscale("log", base=2)
ax.set_xticks(block_sizes, [str(bs) for bs in block_sizes])
ax.set_xlabel("block size (tokens)")
ax.set_ylabel("tail waste (% of reserved memory)", color="C3")
ax2 = ax.twinx()
ax2.plot(block_sizes, entries, "s--", color="C0", label="block-table entries")
ax2.set_yscale("log")
ax2.set_ylabel("block-table entries per request", color="C0")
ax.set_title("Bigger blocks: fewer entries to look up, more empty tail\n(counted on 10,000 synthetic requests)",
             fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# The paper found 16 to 128 tokens best on ShareGPT and 16 to 32 on Alpaca (shorter requests, so
# the tail matters more), and uses 16 by default. That bigger blocks also read faster on a GPU is a
# hypothesis this book has not measured (`python benchmarks/paged_attention.py --block-sizes 16 32
# 64 128` on a GPU would).
#
# ## 4. What paging does not change
#
# Paging changes where K and V live, not what they are: no element is compressed, and attention
# still reads every position (nothing becomes sparse). To see it, put a 37-token sequence's keys
# and values into three scattered blocks of a pool shaped `[num_blocks, block_size, num_kv_heads,
# head_dim]` (the shape vLLM's flash-attention kernel reads). labkit's `write_kv(k, v, k_cache,
# v_cache, slot_mapping)` stores each token's K and V at its slot, the pool seen as one row per slot:

# %%
gen = torch.Generator().manual_seed(0)
seq_len, block_size, num_kv_heads, head_dim = 37, 16, 2, 64
k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float16)
v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float16)

pool_k = torch.zeros(8, block_size, num_kv_heads, head_dim, dtype=torch.float16)  # 8 blocks
pool_v = torch.zeros_like(pool_k)
table = torch.tensor([5, 2, 7], dtype=torch.int32)  # three blocks, anywhere in the pool
slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size for p in range(seq_len)])
write_kv(k, v, pool_k, pool_v, slots)
print("slots of tokens 0, 16 and 36:", slots[[0, 16, 36]].tolist())
assert torch.equal(pool_k.view(-1, num_kv_heads, head_dim)[slots], k)  # each token's K sits at its slot

# %% [markdown]
# `gather_kv` reads them back in order. It indexes the pool with the first
# `ceil(seq_len / block_size)` ids of the block table, so the blocks come out in logical order
# wherever they lie, lays them end to end and cuts off the empty tail:

# %%
excerpt(gather_kv, "block_size = cache.shape[1]", "return")

# %%
back = gather_kv(pool_k, table, seq_len)
print("gathered keys identical to the contiguous keys:", torch.equal(back, k))
print("elements stored per position:", back[0].numel(), "of dtype", back.dtype, "(as before)")
assert torch.equal(back, k) and torch.equal(gather_kv(pool_v, table, seq_len), v)

# %% [markdown]
# Attention over a paged cache is *defined* by that gather: the reference, `paged_decode_attention_ref`,
# gathers each sequence's K and V and runs chapter 01's attention over them, each KV head repeated
# for its group of query heads (GQA):

# %%
excerpt(paged_decode_attention_ref, "for i, n in", "out[i] =")

# %% [markdown]
# `paged_decode_attention`, the call an engine makes, must give the same output. It runs a Triton
# kernel (interpreted on a CPU) that reads each block where it lies instead of copying it out first;
# appendix [A1](A1_under_the_compiler.ipynb) walks through it. One new query with 8 heads on the
# 2 KV heads, against the reference and against chapter 01's attention over the contiguous K and V:

# %%
q = torch.randn(1, 8, head_dim, generator=gen, dtype=torch.float16)
seq_lens = torch.tensor([seq_len], dtype=torch.int32)
paged_out = paged_decode_attention(q, pool_k, pool_v, table[None], seq_lens)
ref_out = paged_decode_attention_ref(q, pool_k, pool_v, table[None], seq_lens)
dense_out = causal_attention(q[None].float(), k[None].float(), v[None].float())[0].half()
print(f"max |paged - reference| : {(paged_out.float() - ref_out.float()).abs().max():.1e}")
print(f"max |paged - contiguous|: {(paged_out.float() - dense_out.float()).abs().max():.1e}")
assert torch.allclose(paged_out.float(), ref_out.float(), atol=2e-3)
assert torch.allclose(paged_out.float(), dense_out.float(), atol=2e-3)

# %% [markdown]
# ## 5. Block tables in a running system
#
# Requests arrive, grow by one token per step and finish on one pool. Each takes its next block
# wherever one is free, so its blocks end up scattered and interleaved with other requests'.
# `labkit.teaching.widgets.paging_stepper.simulate` runs five requests on a real `BlockAllocator` (16 blocks
# of 4 tokens) and records the pool after every step. Step 7:

# %%
from labkit.teaching.widgets.paging_stepper import (DEFAULT_WORKLOAD, PagingStepper, draw_block_tables, simulate,
                                                    static_figure)

STEP_BLOCK = 4
snapshots = simulate(num_blocks=16, block_size=STEP_BLOCK)
snap = snapshots[7]
for name in sorted(snap.tables):
    print(f"{name}: {snap.lengths[name]:2d} tokens, block table {snap.tables[name]}")
assert all(blocks_needed(snap.lengths[n], STEP_BLOCK) == len(snap.tables[n]) for n in snap.tables)
# Every request of the workload arrived once and finished once, and the pool ends empty.
names = sorted(r.name for r in DEFAULT_WORKLOAD)
for verb in ("arrives", "finishes"):
    assert sorted(e.split()[0] for s in snapshots for e in s.events if f" {verb}" in e) == names, verb
assert snapshots[-1].used_blocks == 0
# The picture's point: some request's blocks are not one consecutive run of the pool.
assert any(t != list(range(t[0], t[0] + len(t))) for t in snap.tables.values())

fig, ax = plt.subplots(figsize=(8, 3.5))
draw_block_tables(snap, ax)
ax.set_title("Logical blocks in order, physical blocks wherever they were free (simulated, step 7)", fontsize=10)
plt.show()

# %% [markdown]
# Step through the whole run. Each box is a physical block, its thin cells token slots, coloured
# when they hold a token: a request takes a new block only when its last one is full.

# %%
PagingStepper(num_blocks=16, block_size=STEP_BLOCK).widget

# %% [markdown]
# The same run at three moments, for readers without a live kernel:

# %%
fig = static_figure(snapshots, [2, 7, 13], STEP_BLOCK)
plt.show()
print("blocks in use per step:", [s.used_blocks for s in snapshots])
tail = [s.used_blocks * STEP_BLOCK - s.used_slots for s in snapshots]
print("empty slots in reserved blocks per step:", tail)
for s, empty in zip(snapshots, tail):
    # No block is in two tables, and the only waste is each running request's last-block tail.
    assert sum(len(t) for t in s.tables.values()) == s.used_blocks
    assert 0 <= empty <= (STEP_BLOCK - 1) * len(s.tables)

# %% [markdown]
# ## 6. The decoder on the paged cache
#
# `labkit.caches.paged.PagedKVCache` implements chapter 01's cache protocol, `attend(layer_idx, q, k, v)`,
# with `write_kv` and paged attention: a K and a V pool per layer (`KVPool`, reused by chapters 04
# and 05) and a block table per sequence. `generate_paged` prefills three prompts of different
# lengths on one pool, then decodes them as one batch; the tokens must be those of chapter 01's
# contiguous cache:

# %%
model = Decoder.random(DecoderConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                     num_key_value_heads=2), seed=0)
prompts = [[1, 2, 3, 4, 5], list(range(10, 27)), [7]]
paged_runs = generate_paged(model, prompts, max_new_tokens=4, block_size=8, use_triton=True)  # labkit's Triton kernels
for prompt, run in zip(prompts, paged_runs):
    contiguous = generate(model, prompt, 4)
    diff = (run.logits - contiguous.logits).abs().max().item()
    print(f"prompt of {len(prompt):2d} tokens -> {run.tokens}  same as contiguous: "
          f"{run.tokens == contiguous.tokens}, max logit difference {diff:.1e}")
    assert run.tokens == contiguous.tokens and diff < 1e-4

# %% [markdown]
# ## Summary
#
# - A block holds `block_size` tokens of K and V in every layer: 2 MiB for 16 tokens of the teaching
#   model; a 37-token request takes 3 blocks, 11 slots (1.375 MiB) empty.
# - `BlockAllocator` hands out the front of a free queue, all of a request's new blocks or none, and
#   takes a block back when its last reference drops. A block table maps logical blocks to physical
#   ones anywhere in the pool; a token's slot is `block_id * block_size + offset`.
# - On 10,000 ShareGPT-like requests, reserving the maximum leaves 21.5% of the reserved memory
#   holding tokens, an exact-length oracle 61.3%, 16-token blocks 98.3%. The paper measured 20.4% to
#   38.2% on its own reimplementation of Orca, lower than our counts: its allocator also loses the
#   holes between reservations and rounds to powers of two.
# - Contiguous reservations fragment the free memory. With both allocators reserving final lengths,
#   first fit refused 129 of 2,000 requests, each while enough slots were free in total; the paged
#   allocator refused 117, each only when too few blocks were free.
# - Bigger blocks waste more tail but need fewer block-table entries.
# - Paging neither compresses K/V nor makes attention sparse: attention over scattered blocks equals
#   its reference (gather, then attend) and attention over contiguous K and V, and the decoder
#   produces the same tokens on the paged cache.
#
# ## Exercises

# %%
from labkit.teaching.exercises import Exercises
from labkit.teaching.guards import draws_hidden_cases, torch_generator

ex = Exercises("03_paging")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/, every checker must pass

# %% [markdown]
# **Exercise 1.** Write `blocks_and_tail(num_tokens, block_size)` returning a pair: the number
# of blocks a request of `num_tokens` tokens takes, and the number of empty slots in its last
# block. (For 37 tokens and 16-token blocks: `(3, 11)`.) Write the arithmetic yourself: the
# checker refuses labkit's `blocks_needed`, `BlockTable` and every other labkit function that
# counts blocks, and draws its cases afresh on every run.

# %%
def blocks_and_tail(num_tokens: int, block_size: int) -> tuple[int, int]:
    # BEGIN SOLUTION
    blocks = -(-num_tokens // block_size)
    return blocks, blocks * block_size - num_tokens
    # END SOLUTION


from labkit.memory.blocks import _extra_blocks, extra_blocks
from labkit.memory.pool_plan import PoolPlan
from labkit.memory.prefix import PrefixCache
from labkit.vllm_bridge import predict


def _allocated(num_tokens: int, block_size: int) -> tuple[int, int]:
    table = BlockTable(block_size)
    table.append(num_tokens, BlockAllocator(blocks_needed(num_tokens, block_size) + 1))
    return len(table.block_ids), table.empty_slots


@draws_hidden_cases
def ex1_cases(rng) -> list:
    """An empty request, one-token blocks, then exact fits and partly filled tails at random sizes."""
    sizes = [(0, rng.randint(1, 64)), (rng.randint(1, 50), 1)]
    for _ in range(4):
        bs, k = rng.randint(2, 64), rng.randint(1, 20)
        sizes += [(k * bs, bs), (k * bs + rng.randint(1, bs - 1), bs)]
    return [((n, bs), _allocated(n, bs)) for n, bs in sizes]


ex.check_function("Exercise 1", blocks_and_tail, ex1_cases(),
                  forbid=[blocks_needed, BlockTable, extra_blocks, _extra_blocks, predict._blocks_per_request,
                          PrefixCache, PoolPlan, _allocated])

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** `-(-n // b)` is the ceiling of `n / b` in integer arithmetic, with no
# floating-point rounding; those blocks hold `blocks * b` slots, and the tail is whatever the `n`
# tokens leave empty: between 0 and `b - 1` slots, and 0 for an empty request or an exact fit.

# %% [markdown]
# **Exercise 2.** With the teaching model (128 KiB per token), how many bytes of empty tail slots
# do the requests in `lengths` (section 2) hold in total with 32-token blocks?

# %%
# BEGIN SOLUTION
answer_2 = int(sum(blocks_and_tail(int(n), 32)[1] for n in lengths)) * per_token
# END SOLUTION
# BEGIN STUB
answer_2 = None  # replace None with your expression
# END STUB
ex.check("Exercise 2", answer_2)

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** Each request's tail comes from Exercise 1's function with 32-token blocks;
# the tails add up to a number of empty slots, and each slot would hold one token's 128 KiB. With
# tails spread evenly over 0 to 31 slots, expect about 15.5 empty slots per request.

# %% [markdown]
# **Exercise 3.** Write the gather of the reference yourself: `gather(cache, block_table, seq_len)`
# returns the sequence's K (or V) as a contiguous tensor `[seq_len, num_kv_heads, head_dim]`, from
# a pool `cache` `[num_blocks, block_size, num_kv_heads, head_dim]` and the sequence's block table
# (a 1-D tensor of block ids, possibly longer than needed), as section 4's `gather_kv` does. The
# checker compares with `gather_kv`, so it refuses it, under any name.

# %%
def gather(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    # BEGIN SOLUTION
    block_size = int(cache.shape[1])  # token slots per block
    rows = [cache[int(block_table[p // block_size]), p % block_size] for p in range(seq_len)]
    return torch.stack(rows)
    # END SOLUTION


@draws_hidden_cases
def _gather_cases(rng):
    """Random pools and shuffled tables: one token, an exact fit, one token past it, and a random length."""
    g = torch_generator(rng)
    for kind in ("one", "exact", "one past", "random"):
        block_size = rng.choice([2, 4, 8, 16])
        seq_len = {"one": 1, "exact": block_size * rng.randint(1, 4), "one past": block_size * rng.randint(1, 4) + 1,
                   "random": rng.randint(2, 60)}[kind]
        needed = -(-seq_len // block_size)
        cache = torch.randn(needed + 4, block_size, rng.choice([1, 2, 4]), rng.choice([4, 8]), generator=g)
        table = torch.randperm(needed + 4, generator=g)[:needed + 1].int()  # one entry more than needed
        yield (cache, table, seq_len), gather_kv(cache, table, seq_len)


ex.check_function("Exercise 3", gather, _gather_cases(),
                  forbid=[gather_kv, paged_decode_attention_ref, paged_prefill_attention_ref,
                          paged_decode_attention_batched])

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** Token `p` lives in logical block `p // block_size` at offset
# `p % block_size`; the table turns the logical block into a physical one, so reading the rows in
# order of `p` rebuilds the sequence whatever order its blocks have in the pool. Table entries
# past the last needed block are never read.

# %% [markdown]
# **Exercise 4 (build it).** Write the bookkeeping of paging: `Pager(num_blocks, block_size)` with
# `append(seq_id, n)`, which makes room for `n` more tokens of a sequence (new or not) and returns
# their slots, or returns `None` and changes nothing when too few blocks are free; `free(seq_id)`,
# which returns its blocks; and `num_free()`. The checker replays random operations, the pool filled
# exactly and one token over included, against labkit's `BlockAllocator` and `BlockTable`.

# %%
class Pager:
    def __init__(self, num_blocks: int, block_size: int):
        # BEGIN SOLUTION
        self.block_size = block_size
        self.free_ids = list(range(num_blocks))  # any free block will do
        self.tables: dict = {}  # seq_id -> (block ids, tokens)
        # END SOLUTION

    def num_free(self) -> int:
        # BEGIN SOLUTION
        return len(self.free_ids)
        # END SOLUTION

    def append(self, seq_id, n: int) -> list[int] | None:
        # BEGIN SOLUTION
        blocks, tokens = self.tables.get(seq_id, ([], 0))
        bs = self.block_size
        new = -(-(tokens + n) // bs) - len(blocks)  # ceil: the blocks it will hold, less those it holds
        if new > len(self.free_ids):
            return None  # all or nothing: nothing taken yet
        blocks = blocks + [self.free_ids.pop() for _ in range(new)]
        self.tables[seq_id] = (blocks, tokens + n)
        return [blocks[p // bs] * bs + p % bs for p in range(tokens, tokens + n)]
        # END SOLUTION

    def free(self, seq_id) -> None:
        # BEGIN SOLUTION
        blocks, _ = self.tables.pop(seq_id)
        self.free_ids.extend(blocks)
        # END SOLUTION


from labkit.teaching import build_it

ex.check_behaviour("Exercise 4", Pager, build_it.pager_check(), forbid=[BlockAllocator, BlockTable, blocks_needed],
                   hint="new blocks = ceil((tokens + n) / block_size) - blocks held; slot = block * block_size + offset.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** It mirrors `labkit/memory/paging.py`: `BlockTable.new_blocks_for` (the ceiling),
# `BlockAllocator.allocate_many` (refuse before taking anything), `BlockTable.slot`, and
# `BlockTable.release`. Which free block comes next does not matter; the offset does.

# %% [markdown]
# **Quiz.** Answer with a letter or a number.
# 1. Paging changes (a) the bytes per token; (b) where K/V sit and how much is held; (c) which
#    positions attention reads.
# 2. How many slots does a 33-token request leave empty with 16-token blocks?
# 3. Bigger blocks mean (a) more tail waste, fewer table entries; (b) less waste, more entries.
# 4. First fit refuses a request while enough memory is free in total because (a) the free memory
#    is split into holes; (b) its block table is full.

# %%
# BEGIN SOLUTION
quiz = {1: "b", 2: 15, 3: "a", 4: "a"}
# END SOLUTION
# BEGIN STUB
quiz = {1: None, 2: None, 3: None, 4: None}  # a letter or a number each
# END STUB
ex.quiz(quiz)

# %% [markdown]
# ## What you can now do
#
# - Compute how many blocks a request takes and how much of its last block is empty, and turn a
#   token's position into its slot through a block table.
# - Measure how much reserved KV memory holds tokens under a reservation policy, and explain why
#   paging's share is close to 100% while contiguous reservations also lose memory to holes.
# - Choose a block size by weighing tail waste against block-table entries.
# - Write K/V into a pool by slot, gather them back through a block table, and check that paged
#   attention equals its reference and attention over contiguous K and V.
# - Write the bookkeeping of paging yourself: allocation all or nothing, slots, freeing.
#
# On to [chapter 04](04_prefix_reuse.ipynb), or first into the kernels with
# [appendix A1](A1_under_the_compiler.ipynb).

# %% [markdown]
# ## References
#
# - The source article: *长上下文推理中的 KV Cache：容量、分页与复用边界* ("The KV cache in
#   long-context inference: capacity, paging and the limits of reuse"), a Chinese essay in six
#   sections; the copy the book follows gives no author or link. Its figures (2 MiB blocks, the 37-token
#   request) carry over into this chapter; its sentences do not.
# - Woosuk Kwon, Zhuohan Li, et al., *Efficient Memory Management for Large Language Model Serving
#   with PagedAttention*, SOSP 2023, [arXiv:2309.06180](https://arxiv.org/abs/2309.06180): blocks
#   and block tables, the waste of reservation (its Figure 2) and its measurements of block sizes.
# - vLLM, the serving engine the book compares itself with: documentation at
#   [docs.vllm.ai](https://docs.vllm.ai/) (the design document "vLLM Paged Attention"), code at
#   [github.com/vllm-project/vllm](https://github.com/vllm-project/vllm).
# - Triton, [triton-lang.org](https://triton-lang.org/): the language of the kernels, and its
#   interpreter, which runs them on a CPU.
