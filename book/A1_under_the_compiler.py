# %% [markdown]
# # A1 · Under the compiler: what a GPU makes of the paged kernels
#
# This appendix deepens [chapter 03](03_paging.ipynb), section 6, "The kernels, step by step".
# There the paged-attention kernels were written in Triton and proved equal to their PyTorch
# references, run by Triton's interpreter when there is no GPU. A kernel is also a program for a
# particular GPU: it needs registers and shared memory, it shares a multiprocessor with other
# programs, and it waits either on memory or on arithmetic. None of that changes what paging is;
# all of it decides how fast a paged kernel can be. Chapter 03 can be read without this appendix.
#
# **You will learn**
#
# - how to compile a Triton kernel for a GPU that is not there, and read what the compiler
#   reports: registers per thread, shared memory per program, spills;
# - why a T4 (compute capability 7.5) runs every product of these kernels on its FP32 units,
#   while an A100 or H100 (8.0 and up) uses tensor cores;
# - how many programs fit on one multiprocessor (occupancy), and what limits them on a T4 and on
#   an H100;
# - why decode attention is bound by memory bandwidth: its arithmetic intensity against each
#   GPU's ridge point, drawn as a roofline;
# - what labkit's tile sizes trade, and how to time the kernel when a GPU is present;
# - why a long context with a small batch splits its keys across programs (split-K, flash-decoding).

# %%
from labkit.teaching.diagrams import roadmap

roadmap("A1");  # the article's pipeline, this appendix's part highlighted

# %% [markdown]
# **You need:** chapter 03, section 6: the paged-attention kernels in Triton. Knowing what a GPU's
# registers and shared memory are helps, but each is explained where it is used.
#
# **Time:** about 20 minutes to read and run.

# %%
import json

import matplotlib.pyplot as plt
import numpy as np
import torch

import labkit
from labkit.kernels.launch import choose_num_splits, launch_settings
from labkit.kernels.paged_attention import paged_decode_attention
from labkit.kernels.reference import gather_kv, paged_decode_attention_ref
from labkit.serving.sim.costmodel import DEVICES, Device
from labkit.teaching.results import committed_result

print(labkit.describe())
ON_GPU = labkit.RUNTIME.triton_mode == "compiled"

# %% [markdown]
# ## 1. Compiling for a GPU that is not there
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
# ## 2. Tensor cores, or not
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
# ## 3. Occupancy
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
# ## 4. Why decode is bound by memory: a roofline
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
# ## 5. What the tiles trade
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
# ## 6. Timing, on a GPU
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
# ## 7. Long contexts: split-K (flash-decoding)
#
# Chapter 03's decode kernel runs one program per (sequence, KV head). With 64 sequences × 8 KV
# heads that is plenty of parallel work. With one sequence of 32k tokens it is 8 programs, and most
# of a GPU's multiprocessors sit idle while each walks 32k positions. The fix: cut the positions
# into chunks, run one program per chunk, and merge. Each chunk returns its normalised output `o_k`
# and its log-sum-exp `lse_k = m_k + log l_k`; the exact result is the average of the `o_k`
# weighted by `exp(lse_k)`. Here is chapter 03's small example again (two sequences of 21 and 5
# tokens in scattered 8-token blocks), and the merge rule checked on it in plain PyTorch:

# %%
import math

gen = torch.Generator().manual_seed(1)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 32, 8
lens = [21, 5]
k_cache = torch.randn(10, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
v_cache = torch.randn(10, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
block_tables = torch.tensor([[7, 2, 9], [4, 0, 0]], dtype=torch.int32)  # row 1 uses one block; 0s are padding
seq_lens = torch.tensor(lens, dtype=torch.int32)
q = torch.randn(2, NUM_HEADS, HEAD_DIM, generator=gen)
reference = paged_decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens)


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
# ## Exercise

# %%
from labkit.teaching.exercises import Exercises

ex = Exercises("A1_under_the_compiler")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/ a failing checker fails the notebook tests

# %% [markdown]
# **Exercise 1.** Section 4 found decode attention far below the H100's ridge point even with 8
# query heads per KV head. How many query heads would have to share one KV head (the GQA group `g`)
# before bfloat16 decode attention reached the H100's ridge point, `h100.ridge_point` FLOP per byte?
# Give the smallest whole `g`, computed from the ridge point and the intensity formula of section 4.

# %%
# BEGIN SOLUTION
import math

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
# ## References
#
# - Triton's ahead-of-time compiler: `triton.compile` with `triton.backends.compiler.GPUTarget`
#   ([github.com/triton-lang/triton](https://github.com/triton-lang/triton), Triton 3.9); the
#   resource report from NVIDIA's `cuobjdump --dump-resource-usage`, shipped in the triton wheel.
# - NVIDIA, *CUDA C++ Programming Guide*, "Compute Capabilities": registers, shared memory per
#   block and per multiprocessor, and resident warps for compute capabilities 7.5 to 9.0.
# - NVIDIA T4 datasheet (16 GB GDDR6, 320 GB/s, 8.1 TFLOPS FP32) and NVIDIA H100 datasheet (the
#   H100 SXM figures of `labkit.serving.sim.costmodel.DEVICES`).
# - S. Williams, A. Waterman, D. Patterson, "Roofline: an insightful visual performance model for
#   multicore architectures", *Communications of the ACM* 52(4), 2009: the roofline of section 4.
# - W. Kwon et al., "Efficient Memory Management for Large Language Model Serving with
#   PagedAttention", SOSP 2023 (arXiv 2309.06180): its kernel measured 20–26% slower than a
#   contiguous one.
