# %% [markdown]
# # 03 · Paged blocks
#
# Chapter 02 priced one token of cache. A serving system holds many requests at once, each of
# unknown final length, and must decide *where* their tokens go. Reserving the longest possible
# sequence for every request wastes most of the memory; PagedAttention (Kwon et al., SOSP 2023)
# hands out memory in small fixed-size blocks instead, the way an operating system pages memory.
# This chapter builds that allocator and the attention kernels that read through it.
#
# **You will learn**
#
# - how blocks, block tables and slots work, and the article's numbers: a 16-token block of the
#   teaching model is 2 MiB, and a 37-token request takes 3 blocks with 1.375 MiB of empty tail;
# - how much memory holds real tokens with a reservation at the maximum length, and with paging;
# - what the block size trades: tail waste against block-table entries and kernel efficiency;
# - what paging does **not** do: it neither compresses elements nor makes attention sparse;
# - how a paged-attention kernel in Triton walks a block table, step by step, proven against
#   a plain PyTorch reference (interpreted on a CPU, compiled on a GPU);
# - what the compiler makes of it for a T4 and an H100, without either GPU: registers, shared
#   memory, occupancy, and why decode is bound by memory bandwidth;
# - that chapter 01's decoder produces the same tokens on the paged cache.

# %%
import inspect
import math
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

import labkit
from labkit import kernels
from labkit.cache import generate, generate_paged
from labkit.model import Decoder, DecoderConfig, causal_attention
from labkit.paging import BlockAllocator, BlockTable, OutOfBlocksError, blocks_needed
from labkit.units import format_bytes

torch.set_num_threads(2)
print(labkit.describe())
ON_GPU = labkit.RUNTIME.triton_mode == "compiled"

# %% [markdown]
# ## 1. A block of the teaching model
#
# A *block* holds the K and V of `block_size` consecutive tokens of one sequence, in every layer.
# With the article's teaching model (32 layers, 8 KV heads, head dimension 128, 2-byte elements),
# one token costs 128 KiB, so a 16-token block costs 2 MiB. A request takes whole blocks: a
# 37-token request needs ceil(37 / 16) = 3 of them, and its last block has empty slots.
#
# The pool below has 8 blocks and has already served traffic: three earlier requests took two
# blocks each, and the first and the third have finished. Free blocks are now scattered, as they
# are in any pool that has run for a while.

# %%
# NBVAL_CHECK_OUTPUT
from labkit.capacity import TEACHING_MODEL  # chapter 02: 32 layers, 8 KV heads, head dim 128, 2 bytes

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
# The allocator handed out three *physical* blocks, the first three of its free queue (the most
# recently freed first). The request's **block table** lists them in *logical* order: token `p`
# lives in logical block `p // 16`, at offset `p % 16`. Numbering every token position of the pool
# gives the **slot**: `block_id * block_size + offset`. Kernels write and read K and V by slot.

# %%
print("block table:", request.block_ids)
for p in (0, 15, 16, 36):
    print(f"token {p:2d} -> logical block {p // BLOCK}, offset {p % BLOCK:2d} -> slot {request.slot(p)}")
assert request.slot(36) == request.block_ids[2] * BLOCK + 4
# Logical order is not physical order: the blocks are not consecutive, and slot != position.
assert request.block_ids != sorted(request.block_ids) and any(request.slot(p) != p for p in range(37))

# %% [markdown]
# Logical block 1 (tokens 16 to 31) sits *before* logical block 0 in the pool, and token 0 lives
# in slot 80: the block table alone knows the order.

# %% [markdown]
# When the pool runs out, the allocator refuses the whole request and changes nothing: a
# scheduler (chapter 05) can then wait or preempt, without half-allocated requests to clean up.

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
# Before paging, serving systems gave each request one contiguous region. The final length of a
# request is unknown when it starts (it stops when the model emits its end token), so the region
# had to be sized for the longest allowed sequence, or some guess of it. Everything beyond the
# tokens actually produced is reserved but never used.
#
# Let's measure that on a realistic mix. We draw 1,000 requests from chapter 06's ShareGPT-like
# workload (`labkit.workloads`): log-normal prompt and output lengths with the means of the
# ShareGPT conversations used in the PagedAttention paper (161 prompt tokens and 338 output tokens
# on average), each side capped at 1,024 tokens, so no request exceeds a 2,048-token limit.
# Each request is looked at during every decode step of its life: after step `t` it holds
# `prompt + t` live tokens. `labkit.pool.reservation_shares` divides the live tokens by what the
# request has reserved meanwhile, summed over all requests and steps, under the four policies of
# the paper's Figure 2 (chapter 06 redoes that figure with the same function):
#
# - **reserve max length**: every request reserves the 2,048-token limit;
# - **reserve power of two**: its final length rounded up to a power of two (a length known
#   within a factor of 2);
# - **reserve exact length (oracle)**: exactly its final length, as if the end were known;
# - **paged**: only the 16-token blocks its live tokens occupy.

# %%
from labkit.pool import reservation_shares
from labkit.workloads import SHAREGPT, sharegpt_like

MAX_LEN = SHAREGPT.max_prompt_len + SHAREGPT.max_output_len
requests = sharegpt_like(1000, arrival_rate=1.0, seed=0)
lengths = np.array([r.prompt_len + r.output_len for r in requests])
assert MAX_LEN == 2048 and lengths.max() <= MAX_LEN

shares = reservation_shares(requests, max_len=MAX_LEN, block_size=16)
print(f"{len(lengths)} requests, mean final length {lengths.mean():.0f} tokens, longest {lengths.max()}")
for name, share in shares.items():
    print(f"{name:30s}: {share:6.1%} of reserved memory holds token states")
values = list(shares.values())
assert values == sorted(values) and shares["paged, 16-token blocks"] > 0.95
assert [f"{v:.1%}" for v in values] == ["21.4%", "40.8%", "61.4%", "98.3%"]  # quoted in the summary

# %%
fig, ax = plt.subplots(figsize=(7, 3.4))
ax.barh(list(shares), [100 * s for s in shares.values()], color=["C3", "C1", "C2", "C0"])
for i, s in enumerate(shares.values()):
    ax.text(100 * s + 1, i, f"{s:.1%}", va="center")
ax.set_xlim(0, 110)
ax.set_xlabel("share of reserved KV memory holding token states (%)")
ax.set_title("Paging leaves almost nothing reserved but unused")
ax.invert_yaxis()
fig.tight_layout()
plt.show()

# %% [markdown]
# Reserving the maximum leaves most of the memory empty; even an oracle that knows every final
# length wastes the slots a request has reserved but not yet filled, and paging holds live tokens
# in almost all of it. The paper measured the same effect in real systems: 20.4% to 38.2% of KV
# memory held token states in the systems it compared against, 96.3% in vLLM (its Figure 2). Our
# reservation shares come out higher than the paper's because this count leaves one waste out:
# the holes *between* reservations.
#
# ### External fragmentation: free memory in pieces too small
#
# A contiguous reservation needs one run of free slots. As requests of different lengths come and
# go, the free memory breaks into holes, and a request can be refused while the free slots add up
# to far more than it needs. This is the *external fragmentation* that paging removes in an
# operating system, and it is the point of the analogy. Below, a first-fit allocator (each request
# takes the first hole large enough for its exact final length, the oracle's best case) serves the
# same requests over a pool of 16,384 slots: a request arrives every 16 steps and holds its slots
# for as many steps as it has output tokens (one token per step), so on average the live requests
# ask for a little less than the whole pool (printed below). A request that does not fit is refused. A paged allocator with 16-token blocks serves the same
# stream on 1,024 blocks (the same slots).

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
mean_demand = np.mean([r.output_len * (r.prompt_len + r.output_len) for r in requests]) / GAP
print(f"average demand: {mean_demand:,.0f} slots of {POOL_SLOTS:,}")
worst = (0, 0)  # (free slots in total, largest hole) at a refusal with enough free in total
for i, r in enumerate(requests):
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
    print(f"{kind:9s}: refused {refused[kind, True] + refused[kind, False]:3d} of {len(requests)} requests, "
          f"{refused[kind, True]:3d} of them while enough slots were free in total")
print(f"first fit, worst refusal: {worst[0]:,} slots free in total, the largest hole {worst[1]:,} slots")
assert refused["first fit", True] > 0 and refused["paged", True] == 0 and worst[0] > 4 * worst[1]
assert refused["first fit", True] + refused["first fit", False] > refused["paged", False]

# %% [markdown]
# Every request first fit refused came while the pool had enough free slots for it; at the worst
# moment printed above, several thousand slots were free but no hole was larger than about a
# thousand. The paged allocator, on the same slots and the same stream, refused fewer, and only
# when too few blocks were free in total: any free block can take any logical block, so a request
# fits whenever enough blocks are free. With paging the only waste left is the tail of each
# request's last block: less than one block per request, whatever its length.
#
# ## 3. Choosing the block size
#
# Smaller blocks waste less in the tail (about half a block per request on average), but a
# request then needs more blocks: longer block tables, more entries for the kernel to look up,
# and smaller pieces of memory for it to read. Larger blocks waste more. We expect them to read
# faster on a GPU too (fewer lookups, longer contiguous runs per lookup), but that is a hypothesis
# this book has not measured: `python benchmarks/paged_attention.py --block-sizes 16 32 64 128` on a
# GPU is the experiment that would test it.

# %%
block_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
tail_waste = [1 - list(reservation_shares(requests, MAX_LEN, block_size=bs).values())[-1] for bs in block_sizes]
entries = [(-(-lengths // bs)).mean() for bs in block_sizes]
for bs, waste, n in zip(block_sizes, tail_waste, entries):
    print(f"block {bs:3d}: tail waste {waste:6.2%}, block-table entries per request {n:7.1f}")
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
ax.set_title("Bigger blocks: fewer entries to look up, more empty tail")
fig.tight_layout()
plt.show()

# %% [markdown]
# The paper found 16 to 128 tokens worked best on ShareGPT, 16 to 32 on Alpaca (shorter requests,
# so the tail matters more), and used 16 as its default.
#
# ## 4. What paging does not change
#
# Paging changes where K and V live and how memory is handed out. It does not change the numbers:
# every element is stored at full precision (no compression), and attention still reads every
# position of the sequence (nothing becomes sparse). A paged cache holds exactly the bytes of a
# contiguous one, plus the empty tail slots and a small block table.
#
# We can check both claims. Scatter a sequence's keys into shuffled blocks of a pool, then gather
# them back through the block table: the result is bit-identical to the contiguous keys, and
# attention over it equals attention over the contiguous tensor.

# %%
gen = torch.Generator().manual_seed(0)
seq_len, block_size, num_kv_heads, head_dim = 37, 16, 2, 64
k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float16)
v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float16)

pool_k = torch.zeros(8, block_size, num_kv_heads, head_dim, dtype=torch.float16)  # 8 blocks
pool_v = torch.zeros_like(pool_k)
table = torch.tensor([5, 2, 7], dtype=torch.int32)  # three blocks, anywhere in the pool
slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size for p in range(seq_len)])
kernels.write_kv(k, v, pool_k, pool_v, slots)

back = kernels.gather_kv(pool_k, table, seq_len)
print("gathered keys identical to the contiguous keys:", torch.equal(back, k))
print("elements stored per position:", back[0].numel(), "of dtype", back.dtype, "(as before)")
assert torch.equal(back, k) and torch.equal(kernels.gather_kv(pool_v, table, seq_len), v)

q = torch.randn(1, 8, head_dim, generator=gen, dtype=torch.float16)
paged_out = kernels.paged_decode_attention(q, pool_k, pool_v, table[None], torch.tensor([seq_len], dtype=torch.int32))
dense_out = causal_attention(q[None].float(), k[None].float(), v[None].float())[0].half()
print("max |paged - contiguous| attention output:", f"{(paged_out.float() - dense_out.float()).abs().max():.1e}")
assert torch.allclose(paged_out.float(), dense_out.float(), atol=2e-3)

# %% [markdown]
# ## 5. Block tables in a running system
#
# Requests arrive, grow by one token per step and finish, all on one pool. Because every request
# takes its next block wherever one is free, a request's blocks end up scattered across the pool,
# interleaved with other requests'. The block table is what keeps its order.
#
# `labkit.widgets.paging_stepper.simulate` runs a small scripted workload on a real
# `BlockAllocator` (5 requests, a pool of 16 blocks of 4 tokens) and records the pool after every
# step. Here is the mapping at step 7:

# %%
from labkit.widgets.paging_stepper import DEFAULT_WORKLOAD, PagingStepper, draw_block_tables, simulate, static_figure

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
ax.set_title("Logical blocks in order, physical blocks wherever they were free", fontsize=10)
plt.show()

# %% [markdown]
# Step through the whole run. Each box is a physical block; its thin cells are its token slots,
# coloured when they hold a token. Watch a request take a new block only when its last one is
# full, and a finished request's blocks become free for the next one.

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
# ## 6. The kernels, step by step
#
# Paging moves the problem into the attention kernel: the keys of a sequence are no longer one
# tensor but blocks scattered over a pool. `labkit.kernels` holds three Triton kernels, each with
# a PyTorch reference that defines it:
#
# | function | what it does |
# |---|---|
# | `write_kv(k, v, k_cache, v_cache, slot_mapping)` | scatters new tokens' K and V into their slots |
# | `paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)` | one new query per sequence |
# | `paged_prefill_attention(..., cu_seqlens_q)` | many new queries per sequence, causal |
#
# The cache layout follows vLLM: `k_cache` and `v_cache` are `[num_blocks, block_size,
# num_kv_heads, head_dim]`, `block_tables` is int32 `[num_seqs, max_blocks_per_seq]` and
# `seq_lens` is int32 `[num_seqs]`. A caveat on "follows vLLM": vLLM's design document on paged
# attention ("vLLM Paged Attention" on docs.vllm.ai) explains one kernel, its original CUDA kernel
# `csrc/attention/attention_kernels.cu`, with a layout of its own. It does not fix the layout of
# every current backend: in vLLM 0.33.0 the FlashInfer backend, for one, keeps blocks as `NHD`
# (tokens before heads) or `HND` (heads before tokens), chosen with `VLLM_KV_CACHE_LAYOUT`
# (`vllm/v1/attention/backends/flashinfer.py`). Blocks, block tables and slots carry over to every
# backend; the order of the axes inside a block is each backend's choice. On this machine the kernels run
# as follows:

# %%
print(labkit.RUNTIME.reason)
why = kernels.fallback_reason(torch.float32, labkit.DEVICE)
print("float32 kernels:", "Triton" if why is None else f"PyTorch reference, because {why}")

# %% [markdown]
# ### The reference: gather, then attend
#
# The reference decode is short: gather each sequence's blocks into a contiguous tensor, then
# run textbook attention (with each KV head repeated for its group of query heads, GQA).

# %%
print(inspect.getsource(kernels.gather_kv))
print(inspect.getsource(kernels.paged_decode_attention_ref))

# %% [markdown]
# Gathering copies every key and value once more before attention reads them: fine for a
# definition, wasteful for a kernel. The Triton kernel never builds the contiguous tensor. It
# reads each block where it lies.
#
# ### One program of the decode kernel, by hand
#
# The kernel launches one *program* per (sequence, KV head). A program loads the query heads that
# share its KV head (a GQA group), then walks the sequence's positions `BLOCK_N` at a time:
#
# 1. for each position, find its physical block in the block table and its row in the pool;
# 2. load those K rows and compute the scores `q @ K^T * scale`, masking positions past `seq_len`;
# 3. update an **online softmax**: a running maximum `m`, a running denominator `l` and an
#    unnormalised output `acc`, rescaled by `exp(m_old - m_new)` whenever the maximum grows;
# 4. at the end, write `acc / l`.
#
# Here are those steps in plain PyTorch for one program, printing what it does at each step.
# The kernel below does the same thing in Triton.

# %%
gen = torch.Generator().manual_seed(1)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 32, 8
lens = [21, 5]
k_cache = torch.randn(10, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
v_cache = torch.randn(10, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
block_tables = torch.tensor([[7, 2, 9], [4, 0, 0]], dtype=torch.int32)  # row 1 uses one block; 0s are padding
seq_lens = torch.tensor(lens, dtype=torch.int32)
q = torch.randn(2, NUM_HEADS, HEAD_DIM, generator=gen)


def one_program(seq: int, kv_head: int, block_n: int = 16, verbose: bool = True) -> torch.Tensor:
    """The decode kernel's work for one (sequence, KV head), in plain PyTorch."""
    group = NUM_HEADS // NUM_KV_HEADS
    heads = range(kv_head * group, (kv_head + 1) * group)
    qg = q[seq, heads]  # [group, D]: the query heads sharing this KV head
    scale = 1 / math.sqrt(HEAD_DIM)
    m = torch.full((group,), -math.inf)
    l = torch.zeros(group)
    acc = torch.zeros(group, HEAD_DIM)
    n = int(seq_lens[seq])
    for start in range(0, n, block_n):
        pos = torch.arange(start, start + block_n)
        valid = pos < n
        block_id = block_tables[seq, (pos // BLOCK_SIZE).clamp(max=block_tables.shape[1] - 1)]
        block_id = torch.where(valid, block_id, 0)  # the kernel masks this load
        k = k_cache[block_id, pos % BLOCK_SIZE, kv_head]  # [block_n, D]: rows gathered from the pool
        v = v_cache[block_id, pos % BLOCK_SIZE, kv_head]
        s = (qg @ k.T * scale).masked_fill(~valid, -math.inf)
        m_new = torch.maximum(m, s.max(dim=1).values)
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[:, None])
        l = l * alpha + p.sum(dim=1)
        acc = acc * alpha[:, None] + p @ v
        m = m_new
        if verbose:
            print(f"positions {start}..{min(start + block_n, n) - 1}: physical blocks "
                  f"{sorted(set(block_id[valid].tolist()), key=block_id[valid].tolist().index)}, "
                  f"running max {m.numpy().round(2)}, denominator {l.numpy().round(2)}")
    return acc / l[:, None]


by_hand = one_program(seq=0, kv_head=1)
reference = kernels.paged_decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens)
print("matches the reference:", torch.allclose(by_hand.double(), reference[0, 2:4], atol=1e-5))
assert torch.allclose(by_hand.double(), reference[0, 2:4], atol=1e-5)

# %% [markdown]
# ### The Triton kernel
#
# Now the real kernel. Each line of the loop corresponds to a line of `one_program`. Two details
# differ: Triton works with whole tiles (the GQA group padded to a power of two, head dimensions
# like 80 padded to 128 with a mask), and it uses `exp2` with the scale folded into `log2(e)`,
# the cheaper instruction on a GPU. Loads are upcast to float32 in the interpreter (its bfloat16
# arithmetic is not exact) and on a T4 (no tensor cores for Triton there, see "What the compiler
# made of the kernel" below); from compute capability 8.0 on, fp16 and bf16 tiles go to the
# tensor cores with float32 accumulation.

# %%
source = inspect.getsource(kernels._paged_decode_kernel.fn)
print(source[source.index("    seq = tl.program_id(0)"):])

# %% [markdown]
# Run it on the example above and compare with the float64 reference. On a CPU Triton interprets
# the kernel: the same code, one program after another, in NumPy.

# %%
out = kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
err = (out.double() - reference).abs().max().item()
print(f"Triton decode vs float64 reference: max error {err:.1e}")
assert err < 1e-5

# %% [markdown]
# ### Long contexts: split-K (flash-decoding)
#
# One program per (sequence, KV head) is plenty of parallel work with 64 sequences × 8 KV heads.
# With one sequence of 32k tokens it is 8 programs, and most of a GPU's multiprocessors sit idle
# while each walks 32k positions. The fix: cut the positions into chunks, run one program per
# chunk, and merge. Each chunk returns its normalised output `o_k` and its log-sum-exp
# `lse_k = m_k + log l_k`; the exact result is the average of the `o_k` weighted by `exp(lse_k)`.
# Check the merge rule on the example in plain PyTorch:

# %%
def partial(qg, k, v):
    """Normalised attention output and log-sum-exp of queries qg [G, D] over keys k, v [n, D]."""
    s = qg @ k.T / math.sqrt(qg.shape[-1])
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


keys = kernels.gather_kv(k_cache, block_tables[0], lens[0])[:, 0].double()  # KV head 0 of sequence 0
values = kernels.gather_kv(v_cache, block_tables[0], lens[0])[:, 0].double()
qg = q[0, 0:2].double()
o1, lse1 = partial(qg, keys[:12], values[:12])  # chunk 1: positions 0..11
o2, lse2 = partial(qg, keys[12:], values[12:])  # chunk 2: positions 12..20
w = torch.softmax(torch.stack([lse1, lse2]), dim=0)  # exp(lse_k) / sum
merged = w[0, :, None] * o1 + w[1, :, None] * o2
print("merged chunks equal one pass:", torch.allclose(merged, reference[0, 0:2]))
assert torch.allclose(merged, reference[0, 0:2])

# %% [markdown]
# `paged_decode_attention` chooses the number of chunks itself (`choose_num_splits`): only when
# there are fewer programs than multiprocessors and the context is long enough for each chunk to
# hold at least `MIN_TOKENS_PER_SPLIT` positions. Here is its plan for a GPU with 132
# multiprocessors (an H100 SXM), then a forced split on our example, which gives the same answer:

# %%
# NBVAL_CHECK_OUTPUT
for shape in [(1, 8, 32768), (4, 8, 32768), (16, 8, 8192), (64, 8, 4096)]:
    splits, per_split = kernels.choose_num_splits(*shape, target_programs=132)
    print(f"{shape[0]:3d} sequences x {shape[1]} KV heads x {shape[2]:6,d} tokens: "
          f"{splits:2d} split(s) of {per_split:6,d} tokens -> {shape[0] * shape[1] * splits:4d} programs")
assert kernels.choose_num_splits(1, 8, 32768, target_programs=132)[0] > 1
assert kernels.choose_num_splits(64, 8, 4096, target_programs=132)[0] == 1

# %%
split_out = kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, num_splits=3)
print(f"3 splits vs one pass: max difference {(split_out - out).abs().max():.1e}")
assert torch.allclose(split_out, out, atol=1e-6)

# %% [markdown]
# ### Prefill, in chunks or all at once
#
# `paged_prefill_attention` handles many new queries per sequence: the new tokens are the *last*
# `q_len` positions, their K and V are written first, and each query sees the positions up to its
# own. So a prompt can be processed in one go or in chunks (chapter 05's chunked prefill), and
# the part after a cached prefix (chapter 04) is just a chunk that starts late. Its reference is
# the decode reference with more queries: gather, then causal attention of the last `q_len`
# positions. New tokens reach the cache through `write_kv`, whose reference is one indexed store:

# %%
print(inspect.getsource(kernels.paged_prefill_attention_ref))
print(inspect.getsource(kernels.write_kv_ref))

# %% [markdown]
# Write a 20-token prompt into three scattered blocks in two chunks, attend after each, and
# compare with contiguous causal attention:

# %%
n = 20
k_new = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
v_new = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
q_new = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen)
table = torch.tensor([[3, 8, 1]], dtype=torch.int32)
slots = torch.tensor([int(table[0, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)])

outs = []
for lo, hi in [(0, 12), (12, 20)]:  # two chunks: 12 tokens, then 8
    kernels.write_kv(k_new[lo:hi], v_new[lo:hi], k_cache, v_cache, slots[lo:hi])
    outs.append(kernels.paged_prefill_attention(
        q_new[lo:hi], k_cache, v_cache, table, torch.tensor([hi], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, hi - lo], dtype=torch.int32)))
chunked = torch.cat(outs)
dense = causal_attention(q_new[None], k_new[None], v_new[None])[0]
print(f"chunked paged prefill vs contiguous causal attention: max difference {(chunked - dense).abs().max():.1e}")
assert torch.allclose(chunked, dense, atol=1e-5)

# %% [markdown]
# ### Timing
#
# On a GPU this cell times the compiled decode kernel against PyTorch's
# `scaled_dot_product_attention` on the same K and V laid out contiguously, and reports the
# bandwidth it reaches (decode reads every K and V byte once; its speed is the speed of reading).
# On a CPU the kernel is interpreted: the time says nothing about a GPU, so the cell only shows
# that the interpreted kernel runs. `benchmarks/paged_attention.py` runs the full grid.

# %%
# NBVAL_IGNORE_OUTPUT
if ON_GPU:
    import triton

    B, CTX, HQ, HKV, D = 32, 4096, 32, 8, 128
    dtype = torch.float16
    nb = B * CTX // 16
    kc = torch.randn(nb, 16, HKV, D, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    bt = torch.randperm(nb, device="cuda").view(B, -1).int()
    sl = torch.full((B,), CTX, device="cuda", dtype=torch.int32)
    qq = torch.randn(B, HQ, D, device="cuda", dtype=dtype)
    ms = triton.testing.do_bench(lambda: kernels.paged_decode_attention(qq, kc, vc, bt, sl))
    kd = kc[bt.long()].view(B, CTX, HKV, D).transpose(1, 2).contiguous()  # the same K/V, contiguous
    vd = vc[bt.long()].view(B, CTX, HKV, D).transpose(1, 2).contiguous()
    ms_sdpa = triton.testing.do_bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(qq[:, :, None], kd, vd, enable_gqa=True))
    gbs = 2 * kc.numel() * kc.element_size() / (ms * 1e-3) / 1e9
    print(f"paged decode {ms:.3f} ms ({gbs:.0f} GB/s of K/V read), contiguous SDPA {ms_sdpa:.3f} ms")
else:
    t0 = time.perf_counter()
    kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    print(f"interpreted on the CPU in {time.perf_counter() - t0:.2f} s: correct, but no measure of GPU speed")

# %% [markdown]
# ### What the compiler made of the kernel
#
# The kernels above never met a GPU on the machine this book was written on, yet we can say
# what a T4 or an H100 would run. Triton compiles ahead of time for any target without the GPU
# being there (`triton.compile(..., target=GPUTarget("cuda", 75, 32))`, with NVIDIA's `ptxas`
# from the triton wheel). `benchmarks/kernels_static.py` records the launches labkit's public
# functions make (grid, arguments, tile sizes, warps and pipeline stages, exactly as a GPU would
# get them), compiles each one for five GPU generations and reads what the compiler reports:
# registers per thread, shared memory per program, bytes spilled from registers to memory, and
# the width of the loads in the PTX. `tests/test_kernels_static.py` compiles a subset on every
# test run and fails on a compile error, on shared memory over a GPU's limit, or on any spill.
#
# This is **static analysis, not timing**: it says whether a launch compiles, fits and spills,
# and how many programs can share a multiprocessor; it says nothing about how fast they run.
# Here is the table for decode and prefill at head dimension 128 (GQA group 4, 16-token blocks),
# on a T4 (sm75) against an H100 (sm90):

# %%
# NBVAL_CHECK_OUTPUT
import json
from pathlib import Path

STATIC = next((p / "benchmarks" / "results" / "kernels_static.json" for p in (Path.cwd(), *Path.cwd().parents)
               if (p / "benchmarks" / "results" / "kernels_static.json").exists()), None)
if STATIC is None:  # a pip install (Colab) has labkit but not the repository's benchmarks/
    print("benchmarks/results/kernels_static.json ships with the repository: clone it to see this table.")
else:
    static = json.loads(STATIC.read_text())
    gpus = static["meta"]["gpus"]
    # The file lists each compiled binary once, and every launch with the name of its binary.
    everything = [{**launch, **static["binaries"][launch["binary"]]} for launch in static["launches"]]
    chosen = {}
    for r in everything:
        kind, dtype, d, g, bs = r["case"].split()
        if (r["gpu"] in ("sm75", "sm90") and kind in ("decode", "prefill_long") and r["kernel"] in ("decode", "prefill")
                and (d, g, bs) == ("d128", "g4", "bs16")):
            chosen[(r["kernel"], dtype, r["gpu"])] = r
    print(f"{'kernel':8s} {'dtype':5s} {'GPU':5s} {'tiles (rows x keys)':>19s} {'warps':>5s} {'stages':>6s} "
          f"{'regs':>4s} {'shared':>9s} {'spills':>6s} {'warps/SM':>9s} {'tensor-core ops':>15s}")
    for (kernel, dtype, gpu), r in sorted(chosen.items()):
        tile = f"{r['tiles'].get('BLOCK_M', r['tiles'].get('BLOCK_G'))} x {r['tiles']['BLOCK_N']}"
        print(f"{kernel:8s} {dtype:5s} {gpu:5s} {tile:>19s} "
              f"{r['num_warps']:5d} {r['num_stages']:6d} {r['registers']:4d} "
              f"{r['shared_bytes'] / 1024:5.1f} KiB {r['spill_bytes']:6d} "
              f"{r['warps_per_sm']:3d} of {gpus[gpu]['max_warps_per_sm']:2d} {r['tensor_core_ops']:15d}")
    print(f"\nthe whole grid: {len(everything)} launches ({static['meta']['binaries']} distinct binaries) on "
          f"{len(gpus)} GPU generations; spills in {sum(r.get('spill_bytes', 0) > 0 for r in everything)}, "
          f"shared memory over the limit in "
          f"{sum(r.get('shared_bytes', 0) > gpus[r['gpu']]['shared_per_block'] for r in everything)}, "
          f"compile errors in {sum('error' in r for r in everything)}")
    assert not any(r["problems"] for r in everything)  # no compile error, overflow or spill anywhere
    # A T4 has no tensor-core instruction in any of them: every product is a float32 FMA.
    assert all(r["tensor_core_ops"] == 0 and r["fp32_fma"] > 0 for k, r in chosen.items() if k[2] == "sm75")
    assert all(r["tensor_core_ops"] > 0 for k, r in chosen.items() if k[2] == "sm90" and k[1] != "fp32")

# %% [markdown]
# Three things to read in it.
#
# **Tensor cores, or not.** On the H100, float16 and bfloat16 tiles go to the tensor cores
# (the `mma`/`wgmma` instructions counted in the last column) with float32 accumulation. On the
# T4 that column is zero for every dtype, but the table alone does not say why: labkit's sm75
# launches upcast every load to float32 (`LaunchSettings.upcast`), so their `tl.dot` never sees a
# 16-bit operand. The evidence for the upcast is one bare 16-bit `tl.dot` of a 32 × 32 × 32 tile,
# without any conversion, compiled by Triton for sm75 and, for contrast, sm80
# (`benchmarks/kernels_static.py --bare-dot`, tested by `tests/test_kernels_static.py`), with its
# instructions counted in the PTX and in the machine code (SASS):

# %%
# NBVAL_CHECK_OUTPUT
BARE_DOT = None if STATIC is None else STATIC.parent / "bare_dot.json"
if BARE_DOT is not None:
    bare = json.loads(BARE_DOT.read_text())
    print(f"one tl.dot, {bare['rows'][0]['tile']}^3 multiply-adds, Triton {bare['meta']['triton']}, 4 warps")
    print(f"{'GPU':5s} {'dtype':5s} {'PTX fma.rn.f32':>14s} {'PTX mma':>7s} {'SASS FFMA':>9s} {'SASS HMMA':>9s}")
    for r in bare["rows"]:
        print(f"{r['gpu']:5s} {r['dtype']:5s} {r['ptx_fma_f32']:14d} {r['ptx_mma']:7d} {r['sass_ffma']:9d} "
              f"{r['sass_hmma']:9d}")
    t4 = [r for r in bare["rows"] if r["gpu"] == "sm75"]
    assert all(r["ptx_mma"] == r["sass_hmma"] == 0 and r["sass_ffma"] == 32**3 // 128 for r in t4)
    assert all(r["sass_hmma"] > 0 and r["sass_ffma"] == 0 for r in bare["rows"] if r["gpu"] == "sm80")

# %% [markdown]
# On sm75 the 16-bit product has no tensor-core instruction at all: 32,768 multiply-adds spread over
# 128 threads are 256 float32 FMAs each, float16 included. The same source becomes `mma`
# (`HMMA` in SASS) on sm80. So Triton 3.9 has no tensor-core path on a T4, and labkit loses
# nothing by upcasting there; it runs bfloat16 on a T4 too: it loads bfloat16 (two bytes an
# element, like float16), converts to float32 (a shift, exact) and computes on the FP32 units,
# the same instructions float16 gets there. `labkit.describe()` says which case a machine is in.
#
# **Occupancy.** A multiprocessor holds several programs at once and switches between their
# warps while loads are in flight. How many fit is limited by its registers (65,536 32-bit
# registers, shared by all resident threads), its shared memory, and a cap on warps. The column
# "warps/SM" is that count for each launch: registers per thread times 32 threads per warp times
# warps per program must fit in the register file, and the program's shared memory (plus 1 KiB
# the driver reserves per block from sm80 on) must fit in the multiprocessor's. Occupancy is a
# ceiling on latency hiding, not a speed: a memory-bound kernel needs enough bytes in flight,
# which it gets from resident warps *or* from deep pipelines (`num_stages`) in fewer warps.
#
# Here is that arithmetic for the float16 decode launch of the table, on each GPU:

# %%
# NBVAL_CHECK_OUTPUT
if STATIC is not None:
    for gpu in ("sm75", "sm90"):
        r, g = chosen[("decode", "fp16", gpu)], gpus[gpu]
        regs_per_warp = -(-r["registers"] * 32 // g["register_unit"]) * g["register_unit"]  # allocated per warp
        programs = {
            "registers": g["registers_per_sm"] // (regs_per_warp * r["num_warps"]),
            "shared memory": g["shared_per_sm"] // (r["shared_bytes"] + g["reserved_shared_per_block"]),
            "warp cap": g["max_warps_per_sm"] // r["num_warps"],
            "block cap": g["max_blocks_per_sm"],
        }
        fits = min(programs.values())
        print(f"{gpu}: programs per multiprocessor allowed by " + ", ".join(f"{k} {v}" for k, v in programs.items())
              + f" -> {fits} x {r['num_warps']} warps = {fits * r['num_warps']} of {g['max_warps_per_sm']} warps")
        assert fits * r["num_warps"] == r["warps_per_sm"]
        assert min(programs, key=programs.get) == {"sm75": "shared memory", "sm90": "registers"}[gpu]

# %% [markdown]
# On the T4 shared memory is the limit: one program fits on a multiprocessor, a quarter of its
# warps. On the H100 registers are: three programs. Neither figure says the kernel is slow; a
# decode program keeps several K/V steps in flight (the pipeline stages), and what counts for a
# memory-bound kernel is the bytes in flight per multiprocessor.
#
# **Why decode is bound by memory.** For each cached token, decode reads one K row and one V row
# per KV head (2 x head_dim elements) and does, for each of the `g` query heads sharing them,
# one dot product for the score and one multiply-add row for the output: 4 x g x head_dim
# floating-point operations. Its arithmetic intensity is therefore `2g / bytes_per_element`
# FLOP per byte, whatever the context length. A GPU is memory-bound below its *ridge point*,
# peak FLOP/s divided by memory bandwidth:

# %%
# NBVAL_CHECK_OUTPUT
from labkit.costmodel import DEVICES, Device

h100 = DEVICES["H100 SXM"]
t4 = Device("T4", 16 * 2**30, 320e9, 8.1e12,  # Triton runs a T4's products on the FP32 units
            source="NVIDIA T4 datasheet: 16 GB GDDR6, 320 GB/s, FP32 8.1 TFLOPS")


def intensity(queries_per_kv_row: int, head_dim: int = 128, bytes_per_element: int = 2) -> float:
    """FLOPs per byte of K and V read: each K/V row pair serves this many queries."""
    return 4 * queries_per_kv_row * head_dim / (2 * head_dim * bytes_per_element)


for g in (1, 4, 8):
    print(f"decode, GQA group {g}: {intensity(g):3.0f} FLOP/byte")
for device, capability, units in ((t4, (7, 5), "FP32 FMAs"), (h100, (9, 0), "bf16 tensor cores")):
    rows = kernels.launch_settings("prefill", torch.float16, 128, capability).block_m
    print(f"{device.name:8s} ridge point {device.ridge_point:4.0f} FLOP/byte ({units}); its prefill tile of "
          f"{rows} queries: {intensity(rows):3.0f} FLOP/byte")
    assert intensity(8) < intensity(rows) < device.ridge_point

# %% [markdown]
# Even with a group of 8 query heads per KV head, decode does fewer operations per byte than
# either GPU's ridge point, even the T4's without tensor cores: its time is the time to read the
# cache. That is why labkit can give a T4 float32 arithmetic for free in decode, and why the
# padding of a GQA group to 16 rows for `tl.dot` (wasted multiplications) costs nothing there.
# Prefill reuses each K/V row it reads once per query of its tile: more work per byte, but with
# these tiles still below both ridge points, counted as if every tile read its K/V from memory.
# On a GPU, other query tiles and query heads of the same sequence read the same blocks, and
# many of those re-reads hit the L2 cache, which a static count cannot see: whether prefill
# ends up waiting on arithmetic (likelier on a T4, without tensor cores) is for a timing on a
# GPU to say.
#
# **What the tiles trade.** `labkit.kernels.launch_settings` picks them (read it: one short
# function). A longer key tile (`BLOCK_N`) means fewer steps and more bytes in flight per step,
# but more registers for K, V and the scores, and more shared memory; each extra pipeline stage
# keeps one more step of K/V loads in flight in shared memory; more query rows per tile
# (`BLOCK_M`) raise prefill's reuse of each K/V byte, at the price of a larger accumulator. On the tensor-core path the
# operands live in shared memory and registers stay moderate; on the FMA path (float32, and every
# dtype on a T4) every operand and product sits in registers, so labkit halves the key tile and
# spreads the work over more warps. An earlier version of these kernels used the tensor-core tiles
# everywhere: compiled for a T4 they overflowed its 64 KiB of shared memory or spilled
# registers to memory, and on those GPUs labkit would have quietly run its PyTorch reference
# instead of Triton. The table above is how we know the current tiles do not.

# %% [markdown]
# ## 7. The decoder on the paged cache
#
# `labkit.cache.PagedKVCache` implements chapter 01's cache protocol, `attend(layer_idx, q, k,
# v)`, with these kernels: per layer one K pool and one V pool (`KVPool`, which chapters 04 and
# 05 reuse), a block table per sequence, `write_kv` for the new tokens, then prefill or decode
# attention. `generate_paged` prefills
# several prompts of different lengths on one pool and then decodes them together as one batch.
# The tokens must be those of chapter 01's contiguous cache.

# %%
model = Decoder.random(DecoderConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                     num_key_value_heads=2), seed=0)
prompts = [[1, 2, 3, 4, 5], list(range(10, 27)), [7]]
paged_runs = generate_paged(model, prompts, max_new_tokens=6, block_size=8)
for prompt, run in zip(prompts, paged_runs):
    contiguous = generate(model, prompt, 6)
    diff = (run.logits - contiguous.logits).abs().max().item()
    print(f"prompt of {len(prompt):2d} tokens -> {run.tokens}  same as contiguous: "
          f"{run.tokens == contiguous.tokens}, max logit difference {diff:.1e}")
    assert run.tokens == contiguous.tokens and diff < 1e-4

# %% [markdown]
# ## Summary
#
# - A block holds `block_size` tokens of K and V in every layer; for the teaching model a
#   16-token block is 2 MiB, and a 37-token request takes 3 blocks, 11 slots (1.375 MiB) empty.
# - A block table maps a sequence's logical blocks to physical blocks anywhere in the pool; a
#   token's slot is `block_id * block_size + offset`. Blocks are taken as a sequence grows and
#   returned when it finishes; an allocation that cannot be met changes nothing.
# - Reserving the maximum length leaves most memory unused on a realistic mix (21.4% holds tokens),
#   and even an exact-length oracle only 61.4%; 16-token pages hold 98.3%. Bigger blocks waste more
#   tail but need fewer table entries.
# - Contiguous reservations also fragment the free memory: first fit refuses requests while enough
#   slots are free in total; a paged allocator refuses only when too few blocks are free.
# - Paging neither compresses K/V elements nor makes attention sparse: every position is stored
#   at full precision and read.
# - The Triton decode kernel walks the block table with an online softmax, one program per
#   (sequence, KV head), and splits long contexts into chunks merged by log-sum-exp; the prefill
#   kernel does the same for many causal queries. Both match their PyTorch references, and the
#   decoder produces the same tokens on the paged cache.
# - Compiled ahead of time for sm75 to sm90, every launch fits in shared memory without spills
#   (static analysis, not timing). Decode does a few FLOPs per byte read, far below any GPU's
#   ridge point: it is bound by memory bandwidth. A T4 computes every dtype, bf16 included, on
#   its FP32 units.
#
# ## Exercises

# %%
from labkit.exercises import Exercises

ex = Exercises("03_paging")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/, every checker must pass

# %% [markdown]
# **Exercise 1.** Write `blocks_and_tail(num_tokens, block_size)` returning a pair: the number
# of blocks a request of `num_tokens` tokens takes, and the number of empty slots in its last
# block. (For 37 tokens and 16-token blocks: `(3, 11)`.)

# %%
def blocks_and_tail(num_tokens: int, block_size: int) -> tuple[int, int]:
    # BEGIN SOLUTION
    blocks = -(-num_tokens // block_size)
    return blocks, blocks * block_size - num_tokens
    # END SOLUTION


def _allocated(num_tokens: int, block_size: int) -> tuple[int, int]:
    table = BlockTable(block_size)
    table.append(num_tokens, BlockAllocator(blocks_needed(num_tokens, block_size) + 1))
    return len(table.block_ids), table.empty_slots


ex.check_function("Exercise 1", blocks_and_tail,
                  [((n, bs), _allocated(n, bs)) for n, bs in [(37, 16), (32, 16), (1, 16), (100, 7), (0, 8)]])

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
ex.check("Exercise 2", answer_2,
         expected=int(((-(-lengths // 32)) * 32 - lengths).sum()) * per_token)

# %% [markdown]
# **Exercise 3.** Write the gather of the reference yourself: `gather(cache, block_table, seq_len)`
# returns the sequence's K (or V) as a contiguous tensor `[seq_len, num_kv_heads, head_dim]`, from
# a pool `cache` `[num_blocks, block_size, num_kv_heads, head_dim]` and the sequence's block table
# (a 1-D tensor of block ids, possibly longer than needed).

# %%
def gather(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    # BEGIN SOLUTION
    block_size = cache.shape[1]
    rows = [cache[int(block_table[p // block_size]), p % block_size] for p in range(seq_len)]
    return torch.stack(rows)
    # END SOLUTION


def _gather_cases():
    g = torch.Generator().manual_seed(3)
    for seq_len, block_size in [(1, 4), (8, 4), (9, 4), (30, 8)]:
        cache = torch.randn(12, block_size, 2, 4, generator=g)
        table = torch.randperm(12, generator=g)[:-(-seq_len // block_size) + 1].int()
        yield (cache, table, seq_len), kernels.gather_kv(cache, table, seq_len)


ex.check_function("Exercise 3", gather, _gather_cases())

# %% [markdown]
# **Exercise 4 (change what decode attends to).** Models such as Mistral and Gemma give some
# layers a *sliding window*: a new token attends only to the last `window` positions, itself
# included. Write `window_decode(q, k_cache, v_cache, block_table, seq_len, window)` for one
# sequence: `q` is `[num_heads, head_dim]`, the pools are `[num_blocks, block_size, num_kv_heads,
# head_dim]` and `block_table` a 1-D tensor of block ids. Return the attention output
# `[num_heads, head_dim]` over positions `max(0, seq_len - window)` to `seq_len - 1` only. The
# checker runs it on random pools with ragged lengths, scattered block tables and GQA, and compares
# it with a plain float64 softmax over the windowed positions.

# %%
def window_decode(q, k_cache, v_cache, block_table, seq_len, window):
    # BEGIN SOLUTION
    k = kernels.gather_kv(k_cache, block_table, seq_len)[-window:]  # [W, kv_heads, head_dim]
    v = kernels.gather_kv(v_cache, block_table, seq_len)[-window:]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [W, heads, head_dim]
    scores = torch.einsum("hd,whd->hw", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("hw,whd->hd", scores.softmax(-1), v)
    # END SOLUTION
    # BEGIN STUB
    raise NotImplementedError("your code here")
    # END STUB


def check_window(fn) -> list[str]:
    """Random pools, ragged lengths, windows shorter and longer than the sequence."""
    g, problems = torch.Generator().manual_seed(4), []
    for seq_len, window, block_size, heads, kv_heads in [(37, 8, 16, 8, 2), (37, 64, 16, 8, 2), (5, 1, 4, 4, 4),
                                                         (100, 33, 8, 6, 2), (16, 16, 16, 2, 1)]:
        d = 16
        k_cache = torch.randn(20, block_size, kv_heads, d, generator=g, dtype=torch.float64)
        v_cache = torch.randn(20, block_size, kv_heads, d, generator=g, dtype=torch.float64)
        table = torch.randperm(20, generator=g)[:blocks_needed(seq_len, block_size)].int()
        q = torch.randn(heads, d, generator=g, dtype=torch.float64)
        got = fn(q, k_cache, v_cache, table, seq_len, window)
        # The reference reads every position through the table and masks those outside the window.
        pos = torch.arange(seq_len)
        k_all = torch.stack([k_cache[int(table[p // block_size]), p % block_size] for p in pos])
        v_all = torch.stack([v_cache[int(table[p // block_size]), p % block_size] for p in pos])
        kv_head = torch.arange(heads) // (heads // kv_heads)
        scores = torch.einsum("hd,phd->hp", q, k_all[:, kv_head]) / d ** 0.5
        scores[:, pos < seq_len - window] = float("-inf")
        want = torch.einsum("hp,phd->hd", scores.softmax(-1), v_all[:, kv_head])
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            problems.append(f"seq_len {seq_len}, window {window}: expected a tensor of shape {tuple(want.shape)}")
        elif not torch.allclose(got.double(), want, atol=1e-9):
            problems.append(f"seq_len {seq_len}, window {window}: max difference "
                            f"{(got.double() - want).abs().max():.1e} from the reference")
    return problems


ex.check_behaviour("Exercise 4", window_decode, check_window,
                   hint="gather through the block table, keep the last `window` positions, repeat each KV "
                        "head for its query heads, then softmax.")

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
#   [github.com/vllm-project/vllm](https://github.com/vllm-project/vllm); this chapter read
#   `vllm/v1/attention/backends/flashinfer.py` of vLLM 0.33.0 for the `NHD`/`HND` layouts.
# - Tri Dao et al., *Flash-Decoding for long-context inference* (2023),
#   [crfm.stanford.edu/2023/10/12/flashdecoding.html](https://crfm.stanford.edu/2023/10/12/flashdecoding.html):
#   the split-K decode of section 6; Tri Dao, *FlashAttention-2*,
#   [arXiv:2307.08691](https://arxiv.org/abs/2307.08691): the online softmax the kernels use.
# - Triton, [triton-lang.org](https://triton-lang.org/): the language of the kernels, and its
#   interpreter, which runs them on a CPU.
