# %% [markdown]
# # A1 · The paged kernels and what a GPU makes of them
#
# **The message.** A paged decode kernel follows the block table itself, loading each block where
# it lies and folding it into an online softmax, and on a GPU its speed is bounded by memory
# bandwidth, not by arithmetic.
#
# This appendix deepens [chapter 03](03_paging.ipynb), where a PyTorch reference (gather the blocks,
# then attend) defined attention over a paged cache and one call of labkit's kernel matched it.
# Here are the kernels themselves, in Triton, walked through and proved equal to their references
# (in Triton's interpreter when there is no GPU); then what a GPU makes of them: registers, shared
# memory, programs sharing a multiprocessor, waiting on memory or on arithmetic. None of that
# changes what paging is; all of it decides how fast a paged kernel can be. Chapter 04 does not
# need this appendix.
#
# **What you will learn**
#
# - how labkit's paged kernels walk a block table: one program of the decode kernel by hand, then
#   the Triton kernel (block-table lookup, masked loads, online softmax) and chunked prefill, each
#   checked against its reference;
# - how to compile a Triton kernel for a GPU that is not there and read what the compiler reports
#   (registers, shared memory, spills), and why a T4 runs every product on its FP32 units while an
#   A100 or H100 uses tensor cores;
# - how many programs fit on one multiprocessor (occupancy), and what limits them;
# - why decode attention is bound by memory bandwidth, drawn as a roofline, and what the tile sizes trade;
# - why a long context with a small batch splits its keys across programs (split-K, flash-decoding);
# - how to change what a decode kernel attends to, a sliding window, inside the kernel itself.

# %%
from labkit.teaching.diagrams import roadmap

roadmap("A1");  # the article's pipeline, this appendix's part highlighted

# %% [markdown]
# **You need:** chapter 03: blocks, block tables, slots, the pool layout and the reference
# (`gather_kv`, then attention); chapter 01: attention with GQA. Knowing what a GPU's registers and
# shared memory are helps, but each is explained where it is used.
#
# **Time:** about 35 minutes to read and run; about 20 minutes for the exercises.

# %%
import json
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

import labkit
from labkit.kernels.fallback import fallback_reason
from labkit.kernels.launch import LOG2E, choose_num_splits, launch_settings
from labkit.kernels.paged_attention import paged_decode_attention, paged_prefill_attention, write_kv
from labkit.kernels.reference import gather_kv, paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref
from labkit.kernels.triton_paged import paged_decode_kernel
from labkit.model.decoder import causal_attention
from labkit.serving.sim.costmodel import DEVICES, Device
from labkit.teaching.excerpts import excerpt
from labkit.teaching.results import committed_result

torch.set_num_threads(2)
print(labkit.describe())
ON_GPU = labkit.RUNTIME.triton_mode == "compiled"

# %% [markdown]
# ## 1. The kernels, step by step
#
# Chapter 03's reference gathers a sequence's blocks into one contiguous copy before attention reads
# them. A kernel reads each block where it lies instead. `labkit.kernels` holds three Triton
# kernels, each defined by a PyTorch reference in `labkit.kernels.reference`:
#
# | function | what it does |
# |---|---|
# | `write_kv(k, v, k_cache, v_cache, slot_mapping)` | scatters new tokens' K and V into their slots |
# | `paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)` | one new query per sequence |
# | `paged_prefill_attention(..., cu_seqlens_q)` | many new queries per sequence, causal |
#
# The shapes are those vLLM 0.33.0's flash-attention backend hands its kernel: pools
# `[num_blocks, block_size, num_kv_heads, head_dim]` (there two views of one tensor that holds K and
# V side by side), int32 `block_tables` `[num_seqs, max_blocks_per_seq]` and `seq_lens`
# `[num_seqs]`. Other backends order the axes inside a block their own way (the FlashInfer backend
# offers `NHD` and `HND`); blocks, tables and slots carry over. On this machine:

# %%
print(labkit.RUNTIME.reason)
why = fallback_reason(torch.float32, labkit.DEVICE)
print("float32 kernels:", "Triton" if why is None else f"PyTorch reference, because {why}")

# %% [markdown]
# ### One program of the decode kernel, by hand
#
# The kernel launches one *program* per (sequence, KV head). It loads the query heads of that KV
# head's group and walks the positions `BLOCK_N` at a time: find each position's physical block and
# row, load K, compute the scores `q @ K^T * scale` (masking positions past `seq_len`), and update an
# **online softmax**, a running maximum `m`, denominator `l` and unnormalised output `acc`, rescaled
# by `exp(m_old - m_new)` when the maximum grows. At the end it writes `acc / l`. Here is one
# program in plain PyTorch, printing each step:

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
reference = paged_decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens)
print("matches the reference:", torch.allclose(by_hand.double(), reference[0, 2:4], atol=1e-5))
assert torch.allclose(by_hand.double(), reference[0, 2:4], atol=1e-5)

# %% [markdown]
# ### The Triton kernel
#
# `paged_decode_kernel` in `labkit/kernels/triton_paged.py` does the same with whole tiles (the GQA group and
# head dimension padded to powers of two, with masks) and with `exp2`, the scale folded into
# `log2(e)`. **The paging:** each position's physical block from the block table, its row in the
# pool, and masked loads of K and V from wherever they lie, with no contiguous copy:

# %%
excerpt(paged_decode_kernel, "# The paging:", "v = tl.load")

# %% [markdown]
# **The mask and the online softmax:** positions past the end score `-inf`; what was summed under
# an older, smaller maximum is rescaled by `alpha = 2^(m_old - m_new)` before the tile's terms are
# added:

# %%
excerpt(paged_decode_kernel, "s = tl.where(valid", "m_i = m_new")

# %% [markdown]
# **The end:** the output is divided by the denominator and stored in the output's dtype:

# %%
excerpt(paged_decode_kernel, "o = acc / l_i[:, None]", "o.to(out_ptr")

# %% [markdown]
# On the example, against the float64 reference (on a CPU Triton interprets the kernel in NumPy; on
# a GPU it compiles it, and the rest of this appendix shows what a GPU makes of it):

# %%
out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
err = (out.double() - reference).abs().max().item()
print(f"Triton decode vs float64 reference: max error {err:.1e}")
assert err < 1e-5

# %% [markdown]
# ### Prefill, in chunks or all at once
#
# `paged_prefill_attention` takes many new queries per sequence, its last `q_len` positions, each
# seeing the positions up to its own. So a prompt can be prefilled whole or in chunks (chapter 05),
# and the part after a cached prefix (chapter 04) is a chunk that starts late. Its reference, where
# sequence `i` owns the query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`:

# %%
excerpt(paged_prefill_attention_ref, "lo, hi = cu[i]", "out[lo:hi]")

# %% [markdown]
# New tokens reach the pool through `write_kv`: one indexed store by slot (the pool seen as one row
# per slot), skipping a slot of -1 (padding, or a position a prefix cache already holds):

# %%
excerpt(write_kv_ref, "keep = slot_mapping", "v_cache.view")

# %% [markdown]
# A 20-token prompt written in two chunks into three scattered blocks, against contiguous causal
# attention:

# %%
n = 20
k_new = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
v_new = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
q_new = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen)
table = torch.tensor([[3, 8, 1]], dtype=torch.int32)
slots = torch.tensor([int(table[0, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)])

outs = []
for lo, hi in [(0, 12), (12, 20)]:  # two chunks: 12 tokens, then 8
    write_kv(k_new[lo:hi], v_new[lo:hi], k_cache, v_cache, slots[lo:hi])
    outs.append(paged_prefill_attention(
        q_new[lo:hi], k_cache, v_cache, table, torch.tensor([hi], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, hi - lo], dtype=torch.int32)))
chunked = torch.cat(outs)
dense = causal_attention(q_new[None], k_new[None], v_new[None])[0]
print(f"chunked paged prefill vs contiguous causal attention: max difference {(chunked - dense).abs().max():.1e}")
assert torch.allclose(chunked, dense, atol=1e-5)


# %% [markdown]
# ## 2. Compiling for a GPU that is not there
#
# Nothing below needs a GPU: we can still say what a T4 or an H100 would run. Triton compiles
# ahead of time for a target that is not present (`triton.compile(..., target=GPUTarget("cuda",
# 75, 32))`, with NVIDIA's `ptxas` from the triton wheel). `benchmarks/kernels_static.py` records the launches labkit's public
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
STATIC = committed_result("kernels_static.json")
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
# Three things to read in it, one section each.
#
# ## 3. Tensor cores, or not
#
# On the H100, float16 and bfloat16 tiles go to the tensor cores
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
# ## 4. Occupancy
#
# A multiprocessor holds several programs at once and switches between their
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
# ## 5. Why decode is bound by memory: a roofline
#
# For each cached token, decode reads one K row and one V row
# per KV head (2 × head_dim elements) and does, for each of the `g` query heads sharing them,
# one dot product for the score and one multiply-add row for the output: 4 × g × head_dim
# floating-point operations. Its arithmetic intensity is therefore `2g / bytes_per_element`
# FLOP per byte, whatever the context length. A GPU is memory-bound below its *ridge point*,
# peak FLOP/s divided by memory bandwidth:

# %%
# NBVAL_CHECK_OUTPUT
h100 = DEVICES["H100 SXM"]
t4 = Device("T4", 16 * 2**30, 320e9, 8.1e12,  # Triton runs a T4's products on the FP32 units
            source="NVIDIA T4 datasheet: 16 GB GDDR6, 320 GB/s, FP32 8.1 TFLOPS")


def intensity(queries_per_kv_row: int, head_dim: int = 128, bytes_per_element: int = 2) -> float:
    """FLOPs per byte of K and V read: each K/V row pair serves this many queries."""
    return 4 * queries_per_kv_row * head_dim / (2 * head_dim * bytes_per_element)


for g in (1, 4, 8):
    print(f"decode, GQA group {g}: {intensity(g):3.0f} FLOP/byte")
for device, capability, units in ((t4, (7, 5), "FP32 FMAs"), (h100, (9, 0), "bf16 tensor cores")):
    rows = launch_settings("prefill", torch.float16, 128, capability).block_m
    print(f"{device.name:8s} ridge point {device.ridge_point:4.0f} FLOP/byte ({units}); its prefill tile of "
          f"{rows} queries: {intensity(rows):3.0f} FLOP/byte")
    assert intensity(8) < intensity(rows) < device.ridge_point

# %% [markdown]
# A *roofline* draws the same comparison. A kernel of intensity `I` FLOP per byte can at best
# reach `min(peak FLOP/s, I × bandwidth)`: the slanted part of each GPU's line is the memory
# roof, the flat part the arithmetic roof, and they meet at the ridge point. Circles, squares and
# triangles are decode with GQA groups of 1, 4 and 8; diamonds are each GPU's prefill tile. These
# are datasheet numbers, not measurements: real kernels land below the roof.

# %%
fig, ax = plt.subplots(figsize=(7, 3.8))
x = np.geomspace(0.5, 2000, 200)
for device, colour in ((t4, "C1"), (h100, "C0")):
    ax.plot(x, np.minimum(device.peak_flops, x * device.memory_bandwidth) / 1e12, color=colour,
            label=f"{device.name}: ridge at {device.ridge_point:.0f} FLOP/byte")
    ax.axvline(device.ridge_point, color=colour, ls=":", lw=0.8)
for g, marker in ((1, "o"), (4, "s"), (8, "^")):
    for device, colour in ((t4, "C1"), (h100, "C0")):
        ax.plot(intensity(g), intensity(g) * device.memory_bandwidth / 1e12, marker, color=colour, ms=6)
    ax.annotate(f"decode, group {g}", (intensity(g), intensity(g) * h100.memory_bandwidth / 1e12),
                textcoords="offset points", xytext=(6, -12), fontsize=8)
for device, capability, colour in ((t4, (7, 5), "C1"), (h100, (9, 0), "C0")):
    rows = launch_settings("prefill", torch.float16, 128, capability).block_m
    ax.plot(intensity(rows), intensity(rows) * device.memory_bandwidth / 1e12, "D", color=colour, ms=6)
    ax.annotate(f"prefill tile, {rows} queries", (intensity(rows), intensity(rows) * device.memory_bandwidth / 1e12),
                textcoords="offset points", xytext=(6, -12), fontsize=8)
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("arithmetic intensity (FLOP per byte of K/V read)")
ax.set_ylabel("attainable TFLOP/s")
ax.set_title("Decode sits on the memory roof of both GPUs (roofline, datasheet figures)")
ax.legend(loc="lower right", fontsize=8)
fig.tight_layout()
plt.show()
assert all(intensity(g) < min(t4.ridge_point, h100.ridge_point) for g in (1, 4, 8))

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
# ## 6. What the tiles trade
#
# `labkit.kernels.launch.launch_settings` picks them (read it: one short
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
# ## 7. Timing, on a GPU
#
# Only a GPU can say how fast the kernel is. On one, this cell times the compiled decode kernel
# against PyTorch's `scaled_dot_product_attention` on the same K and V laid out contiguously, and
# reports the bandwidth it reaches (decode reads every K and V byte once; its speed is the speed of
# reading), to set beside the memory roof above. Without a GPU the kernel is interpreted, one
# program after another in NumPy, and a time would say nothing about a GPU, so the cell says so
# instead. `benchmarks/paged_attention.py` runs the full grid of shapes and block sizes.

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
    ms = triton.testing.do_bench(lambda: paged_decode_attention(qq, kc, vc, bt, sl))
    kd = kc[bt.long()].view(B, CTX, HKV, D).transpose(1, 2).contiguous()  # the same K/V, contiguous
    vd = vc[bt.long()].view(B, CTX, HKV, D).transpose(1, 2).contiguous()
    ms_sdpa = triton.testing.do_bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(qq[:, :, None], kd, vd, enable_gqa=True))
    gbs = 2 * kc.numel() * kc.element_size() / (ms * 1e-3) / 1e9
    print(f"measured on this machine's GPU ({torch.cuda.get_device_name()}): paged decode {ms:.3f} ms "
          f"({gbs:.0f} GB/s of K/V read), contiguous SDPA {ms_sdpa:.3f} ms")
else:
    print("No GPU here: Triton interprets the kernels, and a time would measure the interpreter, not a GPU.")

# %% [markdown]
# ## 8. Long contexts: split-K (flash-decoding)
#
# Section 1's decode kernel runs one program per (sequence, KV head). With 64 sequences × 8 KV
# heads that is plenty of parallel work. With one sequence of 32k tokens it is 8 programs, and most
# of a GPU's multiprocessors sit idle while each walks 32k positions. The fix: cut the positions
# into chunks, run one program per chunk, and merge. Each chunk returns its normalised output `o_k`
# and its log-sum-exp `lse_k = m_k + log l_k`; the exact result is the average of the `o_k`
# weighted by `exp(lse_k)`. The merge rule, checked in plain PyTorch on section 1's example and its
# float64 `reference`:

# %%
def partial(qg, k, v):
    """Normalised attention output and log-sum-exp of queries qg [G, D] over keys k, v [n, D]."""
    s = qg @ k.T / math.sqrt(qg.shape[-1])
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


keys = gather_kv(k_cache, block_tables[0], lens[0])[:, 0].double()  # KV head 0 of sequence 0
values = gather_kv(v_cache, block_tables[0], lens[0])[:, 0].double()
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
    splits, per_split = choose_num_splits(*shape, target_programs=132)
    print(f"{shape[0]:3d} sequences x {shape[1]} KV heads x {shape[2]:6,d} tokens: "
          f"{splits:2d} split(s) of {per_split:6,d} tokens -> {shape[0] * shape[1] * splits:4d} programs")
assert choose_num_splits(1, 8, 32768, target_programs=132)[0] > 1
assert choose_num_splits(64, 8, 4096, target_programs=132)[0] == 1

# %%
out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
split_out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, num_splits=3)
print(f"3 splits vs one pass: max difference {(split_out - out).abs().max():.1e}")
assert torch.allclose(split_out, out, atol=1e-6)

# %% [markdown]
# ## Summary
#
# - labkit's decode kernel runs one program per (sequence, KV head): it looks each position's
#   physical block up in the block table, loads K and V where they lie, masks what lies past the
#   end and keeps an online softmax (running maximum, denominator, unnormalised output). The
#   prefill kernel does the same for many causal queries, whole or in chunks; `write_kv` stores by
#   slot. Each matches its PyTorch reference.
# - Triton compiles a kernel for a GPU that is absent; the compiler's report (registers, shared
#   memory, spills) says whether each of labkit's launches fits a T4 or an H100. All of them do,
#   without spills. That is static analysis, not timing.
# - On a T4 Triton 3.9 has no tensor-core path: every product is a float32 FMA, so labkit upcasts
#   loads there and runs bfloat16 too. From compute capability 8.0 on, 16-bit tiles use tensor cores.
# - Occupancy is set by the scarcest resource of a multiprocessor: shared memory for the decode
#   launch on a T4, registers on an H100. It bounds how much latency can be hidden, not the speed.
# - Decode attention does `2g / bytes_per_element` FLOP per byte of K/V, far below both GPUs' ridge
#   points: its time is the time to read the cache. That is why paging, which changes only where
#   the bytes lie, need not cost much: a paged kernel reads the same bytes, in block-sized pieces,
#   plus its block table. (The PagedAttention paper measured its own paged attention kernel 20–26%
#   slower than a contiguous one, in the kernel alone.)
# - A few long sequences leave most multiprocessors idle with one program per (sequence, KV head);
#   split-K cuts the positions into chunks and merges their outputs exactly, weighted by their
#   log-sum-exp (`choose_num_splits` decides when it pays).
#
# ## What you can now do
#
# - Read a paged-attention kernel in Triton (block-table lookup, masked loads, online softmax) and
#   check it against its PyTorch reference in the interpreter.
# - Change what a decode kernel attends to, such as a sliding window, inside the kernel itself.
# - Compile a Triton kernel for a GPU you do not have, and read its registers, shared memory and
#   spills (`benchmarks/kernels_static.py`, `tests/test_kernels_static.py`).
# - Say whether a GPU runs a kernel's products on tensor cores or on FP32 units, from its compute
#   capability and the dtype.
# - Work out how many programs share a multiprocessor, and which resource limits them.
# - Place a kernel on a roofline from its FLOPs per byte, and tell whether memory or arithmetic
#   bounds it.
#
# Back to [chapter 03](03_paging.ipynb), or on to [chapter 04](04_prefix_reuse.ipynb).

# %% [markdown]
# ## Exercises

# %%
from labkit.teaching.exercises import Exercises
from labkit.teaching.guards import draws_hidden_cases, is_triton_kernel, torch_generator, triton_launches

ex = Exercises("A1_under_the_compiler")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/ a failing checker fails the notebook tests

# %% [markdown]
# **Exercise 1.** Section 5 found decode attention far below the H100's ridge point even with 8
# query heads per KV head. How many query heads would have to share one KV head (the GQA group `g`)
# before bfloat16 decode attention reached the H100's ridge point, `h100.ridge_point` FLOP per byte?
# Give the smallest whole `g`, computed from the ridge point and the intensity formula of section 5.

# %%
# BEGIN SOLUTION
answer_1 = math.ceil(h100.ridge_point * 2 / 2)  # 2g / b >= ridge, with b = 2 bytes
# END SOLUTION
# BEGIN STUB
answer_1 = None  # replace None with your expression
# END STUB
ex.check("Exercise 1", answer_1,
         hint="decode does 2g / bytes_per_element FLOP per byte: solve 2g / 2 >= ridge point for g, and round up.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** Each K and V row read serves `g` queries, 4 × g × D FLOPs for 2 × D × b
# bytes, so the intensity is 2g / b and grows only with the group. At b = 2 it equals g, so g must
# reach the ridge point itself, hundreds of query heads per KV head, where real models share one KV
# head among 4 to 8. No GQA group brings decode near the arithmetic roof: batching many sequences
# does not help either, since each sequence reads its own cache.

# %% [markdown]
# **Exercise 2 (inside the kernel).** Models such as Mistral and Gemma give some layers a
# *sliding window*: a new token attends only to the last `window` positions, itself included,
# positions `max(0, seq_len - window)` to `seq_len - 1`. Below is a complete paged decode kernel
# in Triton, section 1's `paged_decode_kernel` cut to its bones (no splits, no padding of the group
# or the head dimension, float32 only, products as broadcasts instead of `tl.dot`). It takes a
# `window` argument and ignores it. Change the kernel so that it attends to the window only.
#
# There are two ways. One masks the scores of positions before the window, as `valid` masks
# those past the end; beware a tile in which *every* position is masked: the online softmax then
# computes `exp2(-inf - (-inf))`, which is NaN. The other never visits those positions at all.
# The checker launches your kernel (interpreted on a CPU, compiled on a GPU) on random pools with
# ragged lengths drawn afresh on every run, a shuffled block table and GQA, into an output filled
# with NaN, and compares it with a float64 PyTorch softmax over the windowed positions, for
# windows shorter and longer than the sequences. It also records what Triton launched: the output
# must come from your kernel, not from PyTorch.

# %%
import triton  # after `import labkit`, which switched on the interpreter if there is no GPU
import triton.language as tl


@triton.jit
def window_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    window, scale_log2, max_blocks,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (sequence, KV head). Contiguous float32 tensors: q and out
    [num_seqs, NUM_KV_HEADS * GROUP, HEAD_DIM], pools [num_blocks, BLOCK_SIZE, NUM_KV_HEADS,
    HEAD_DIM], block_tables int32 [num_seqs, max_blocks], seq_lens int32 [num_seqs]."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    heads = kv_head * GROUP + tl.arange(0, GROUP)  # the query heads that share this KV head
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (seq * NUM_KV_HEADS * GROUP + heads[:, None]) * HEAD_DIM + d[None, :])  # [GROUP, HEAD_DIM]

    m_i = tl.full([GROUP], float("-inf"), dtype=tl.float32)  # running maximum of the scores
    l_i = tl.zeros([GROUP], dtype=tl.float32)  # running denominator
    acc = tl.zeros([GROUP, HEAD_DIM], dtype=tl.float32)  # running, unnormalised output
    # BEGIN SOLUTION
    first = tl.maximum(seq_len - window, 0)  # the window's first position: earlier ones are never read
    # END SOLUTION
    # BEGIN STUB
    first = 0  # Exercise 2: the walk starts at position 0, whatever `window` says
    # END STUB
    for start in range(first, seq_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < seq_len
        # The paging: position -> logical block -> physical block -> row of the pool.
        block_id = tl.load(block_tables_ptr + seq * max_blocks + pos // BLOCK_SIZE, mask=valid, other=0)
        row = ((block_id * BLOCK_SIZE + pos % BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale_log2  # [GROUP, BLOCK_N], in log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    tl.store(out_ptr + (seq * NUM_KV_HEADS * GROUP + heads[:, None]) * HEAD_DIM + d[None, :], acc / l_i[:, None])

# %%
def run_window_kernel(kernel, q, k_cache, v_cache, block_tables, seq_lens, window, block_n=32):
    """Launch ``kernel`` over a batch, one program per (sequence, KV head), into a NaN-filled output."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    out = torch.full_like(q, float("nan"))  # a program that stores nothing leaves NaN behind
    kernel[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out,
        window, LOG2E / math.sqrt(head_dim), block_tables.shape[1],
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, BLOCK_N=block_n)
    return out


def window_reference(q, k_cache, v_cache, block_tables, seq_lens, window):
    """Plain float64 attention of each sequence's query over its last ``window`` positions."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, n in enumerate(seq_lens.tolist()):
        k = gather_kv(k_cache, block_tables[i], n).double().repeat_interleave(num_heads // num_kv_heads, 1)
        v = gather_kv(v_cache, block_tables[i], n).double().repeat_interleave(num_heads // num_kv_heads, 1)
        scores = torch.einsum("hd,phd->hp", q[i].double().cpu(), k.cpu()) / math.sqrt(q.shape[-1])
        scores[:, : max(0, n - window)] = float("-inf")  # outside the window
        out[i] = torch.einsum("hp,phd->hd", scores.softmax(-1), v.cpu())
    return out


@draws_hidden_cases
def check_window_kernel(rng, kernel) -> list[str]:
    """Ragged lengths drawn afresh, a shuffled block table, GQA (8 query heads on 2 KV heads), three windows."""
    if not is_triton_kernel(kernel):  # compiled (JITFunction) or interpreted, as @triton.jit made it
        return ["expected the @triton.jit kernel itself (not a subclass, nothing of it replaced)"]
    device = "cuda" if ON_GPU else "cpu"
    g = torch_generator(rng)
    block_size, heads, kv_heads, d = 8, 8, 2, 16
    lengths = [1, block_size * rng.randint(1, 4), rng.randint(40, 64), rng.randint(2, 64), rng.randint(2, 64)]
    rng.shuffle(lengths)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    max_blocks = -(-max(lengths) // block_size)
    num_blocks = len(lengths) * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g)
    block_tables = torch.randperm(num_blocks, generator=g)[: len(lengths) * max_blocks].view(len(lengths), -1).int()
    q = torch.randn(len(lengths), heads, d, generator=g)
    args = [t.to(device) for t in (q, k_cache, v_cache, block_tables, seq_lens)]
    problems, unchanged = [], True
    # A window shorter than the longest sequence, a window of one token, a window longer than them all.
    for window in (rng.randint(2, 30), 1, max(lengths) + rng.randint(0, 8)):
        with triton_launches() as launched:  # the output must come from a launch of this very kernel
            got = run_window_kernel(kernel, *args, window).double().cpu()
        if [fn for fn, _ in launched] != [kernel.fn]:
            return [f"window {window}: the output did not come from one launch of your kernel "
                    f"(Triton launched {[getattr(fn, '__name__', fn) for fn, _ in launched]})"]
        want = window_reference(q, k_cache, v_cache, block_tables, seq_lens, window)
        everything = window_reference(q, k_cache, v_cache, block_tables, seq_lens, 10**6)
        shorter = seq_lens > window  # sequences whose window leaves positions out
        if shorter.any() and not torch.allclose(got[shorter], everything[shorter], atol=1e-5):
            unchanged = False  # the window changed something
        bad = [int(s) for s in range(len(lengths)) if not torch.allclose(got[s], want[s], atol=1e-5)]
        if got.isnan().any():
            problems.append(f"window {window}: NaN in the output of sequence(s) "
                            f"{sorted({int(s) for s in got.isnan().nonzero()[:, 0]})} (a tile where every score "
                            "was -inf, or a program that stored nothing?)")
        elif bad:
            problems.append(f"window {window}: sequence(s) of {[lengths[s] for s in bad]} tokens differ from "
                            f"the reference by up to {(got[bad] - want[bad]).abs().max():.1e}")
    if unchanged and problems:
        raise NotImplementedError  # the kernel still attends to every position: not started yet
    return problems


ex.check_behaviour("Exercise 2", window_decode_kernel, check_window_kernel,
                   hint="the window is positions max(0, seq_len - window) .. seq_len - 1: start the loop at the "
                        "first of them (tl.maximum), or mask the scores before it and guard the all-masked tile.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** Starting the walk at `max(0, seq_len - window)` means the kernel never
# loads a position outside the window, so no score needs masking and no tile is ever all `-inf`;
# the existing `pos < seq_len` mask still handles the last, partly filled tile. It also reads only
# `window` positions instead of `seq_len`: in a memory-bound decode, a sliding window saves
# bandwidth, not just arithmetic.

# %% [markdown]
# ## References
#
# - Triton, [triton-lang.org](https://triton-lang.org/): the language of the kernels, and its
#   interpreter, which runs them on a CPU.
# - Tri Dao, *FlashAttention-2*, [arXiv:2307.08691](https://arxiv.org/abs/2307.08691): the online
#   softmax the kernels use; Tri Dao et al., *Flash-Decoding for long-context inference* (2023),
#   [crfm.stanford.edu/2023/10/12/flashdecoding.html](https://crfm.stanford.edu/2023/10/12/flashdecoding.html):
#   the split-K decode of section 8.
# - vLLM 0.33.0, [github.com/vllm-project/vllm](https://github.com/vllm-project/vllm):
#   `vllm/v1/attention/backends/flash_attn.py` for the shapes its kernel reads and
#   `vllm/v1/attention/backends/flashinfer.py` for the `NHD`/`HND` layouts, both in section 1.
# - Triton's ahead-of-time compiler: `triton.compile` with `triton.backends.compiler.GPUTarget`
#   ([github.com/triton-lang/triton](https://github.com/triton-lang/triton), Triton 3.9); the
#   resource report from NVIDIA's `cuobjdump --dump-resource-usage`, shipped in the triton wheel.
# - NVIDIA, *CUDA C++ Programming Guide*, "Compute Capabilities": registers, shared memory per
#   block and per multiprocessor, and resident warps for compute capabilities 7.5 to 9.0.
# - NVIDIA T4 datasheet (16 GB GDDR6, 320 GB/s, 8.1 TFLOPS FP32) and NVIDIA H100 datasheet (the
#   H100 SXM figures of `labkit.serving.sim.costmodel.DEVICES`).
# - S. Williams, A. Waterman, D. Patterson, "Roofline: an insightful visual performance model for
#   multicore architectures", *Communications of the ACM* 52(4), 2009: the roofline of section 5.
# - W. Kwon et al., "Efficient Memory Management for Large Language Model Serving with
#   PagedAttention", SOSP 2023 (arXiv 2309.06180): its kernel measured 20–26% slower than a
#   contiguous one.
