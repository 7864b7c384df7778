# %% [markdown]
# # 00 · Start here
#
# **The message.** This book follows one data structure, the KV cache, from why it grows to what a
# server can hold and serve, and every number in it is computed by code you can run.
#
# **KV Cache Labs** is an executable textbook about one data structure: the key-value cache of a
# transformer language model, and how it decides what a long-context LLM server can hold and how
# fast it can serve. Every number in the book is computed by the code beside it, every figure is
# checked when the book is tested, and every kernel is compared with a plain reference.
#
# In this notebook you will:
#
# - see the map of the book,
# - learn how the notebooks, exercises and widgets work,
# - check your environment: which device runs the code, and how Triton runs its kernels.
#
# **Time:** about 15 minutes to read and run; about 5 minutes for the warm-up exercise.

# %% [markdown]
# ## The map
#
# Every chapter and appendix opens with this figure, the article's pipeline, its own part
# highlighted. Under each part are the chapters and appendices that work on it. Part II goes
# beyond the article, and so does its figure: a router in front of N copies of the server, each
# with its own pool and its own prefix cache; under the KV blocks a second tier that keeps what the
# pool evicts; and a second pool that decodes what the first prefilled, its K/V sent over a link:

# %%
from labkit.teaching.diagrams import roadmap

roadmap("00");  # the whole map, nothing highlighted

# %% [markdown]
# **Part I · the article.** Six chapters, one per section of the article, and a capstone.
#
# | chapter | question | what you build with `labkit` | reading | exercises |
# |---|---|---|---|---|
# | 01 · why the cache grows | what does a model keep per token, and why? | a tiny Llama-style decoder; prefill, decode, a growing cache; the real model in it | about 35 min | about 75 min |
# | 02 · cost per token | how many bytes does one token cost? | the byte formula, GQA, real model presets, a capacity explorer | about 25 min | about 80 min |
# | 03 · paging | how do we stop reserving memory we never use? | a block allocator, block tables, slots; paged attention checked against its reference | about 30 min | about 90 min |
# | 04 · prefix reuse | when may two requests share cached state? | a prefix cache with block hashes, reference counts, copy-on-write | about 40 min | about 75 min |
# | 05 · capacity in the scheduler | who gets memory this iteration? | `plan_iteration` with a token and block budget; a small engine | about 40 min | about 85 min |
# | 06 · from fit to serve | does fitting in memory mean serving fast? | a serving simulator: occupancy, reuse, latency | about 35 min | about 90 min |
# | C1 · your own engine (the capstone) | do my pieces make an engine? | your `decode_step`, `Pager`, `cached_tokens` and `plan_step` serving the real model, checked against labkit's and transformers' | about 10 min | about 10 min |
#
# **Part II · beyond the article.** What changes when one server is not enough.
#
# | chapter | question | what you build with `labkit` | reading | exercises |
# |---|---|---|---|---|
# | 07 · many replicas | behind a router, is a request's prefix still found? | a cluster of simulated servers behind a router (round-robin, least loaded, session, cache-aware) on Mooncake's conversation trace; a real two-replica run behind vllm-router (optional: `make cluster`) | about 25 min | about 55 min |
# | 08 · moving the cache | when is a block worth moving rather than computing again? | the break-even between reloading a prefix and computing it again, per tier; a second tier behind the prefix cache, simulated on Mooncake's trace and real (checked block files on disk); prefill and decode on two pools, the K/V handed over | about 25 min | about 55 min |
#
# **The appendices.** Each deepens the chapter it names.
#
# | appendix | question | what you build with `labkit` | reading | exercises |
# |---|---|---|---|---|
# | A1 · the paged kernels (appendix to 03) | how do the paged kernels walk a block table, and what does a GPU make of them? | the Triton kernels step by step, compiler reports, occupancy, a roofline, split-K | about 35 min | about 20 min |
# | A2 · vLLM's start-up log (appendix to 02, 06) | what will vLLM print, and why may it refuse to start? | vLLM 0.33.0's KV-cache arithmetic, tensor and pipeline parallelism | about 20 min | about 10 min |
# | A3 · fewer bytes per token (appendix to 02) | what does an fp8, int8 or int4 cache cost in quality, and what do windows and latent caches save? | a quantized paged cache, its Triton decode, a measurement on the real model | about 35 min | about 60 min |
# | A4 · the real vLLM on your CPU (appendix to A2, 05, 06) | does the real vLLM do what the book predicts? | vLLM run beside labkit (optional: `make vllm`) | about 35 min | about 5 min |
# | A5 · vLLM's scheduler, step by step (appendix to 05) | which waiting requests does vLLM admit, and why? | admission rules (head of line, the whole-sequence gate), priority, recompute or swap, a step-by-step comparison with vLLM | about 25 min | about 5 min |
# | A6 · measuring a server (appendix to 06) | is a simulated result a measurement? | rate sweeps over several draws, the paper's headline, the simulator calibrated on the real engine | about 35 min | about 5 min |
# | A7 · a model in one file (appendix to 01) | what does a GGUF file hold, and what must a loader undo? | the file's metadata and tensors, a 4-bit block decoded by hand, RoPE's two row orders checked | about 15 min | about 5 min |
#
# Read in order, the chapters and the capstone take about 215 minutes to read and run and about 505
# minutes for their exercises, about 12 hours in all; Part II, beyond the article, takes about 50 and
# 110 minutes more; the appendices take about 200 and 110 minutes more. CONTRIBUTING.md says how these
# times are estimated.
#
# The six chapters of Part I follow one article's six sections and build on each other; read them in
# order. Part II starts where the article stops and builds on Part I (chapter 07 needs 04 and 06;
# chapter 08 needs 02, 04, 06 and 07).
# Each appendix deepens the chapter it names and can be skipped on a first reading.

# %% [markdown]
# ## Words and symbols
#
# Each name below has one meaning throughout the book. The chapter in brackets is where it is built.
#
# **The model's shape** (chapter 02). One token costs 2 × L × Hkv × D × b bytes of cache:
#
# | symbol | meaning | teaching model |
# |---|---|---|
# | L | layers (`num_hidden_layers`) | 32 |
# | Hkv | KV heads per layer (`num_key_value_heads`); with grouped-query attention (GQA) several query heads share one | 8 |
# | D | elements per head (`head_dim`) | 128 |
# | b | bytes per element (2 for bf16 or fp16, 1 for fp8 or int8) | 2 |
# | T | tokens in a sequence's cache | |
# | 2 | one key and one value | |
#
# **Memory** (chapter 03).
#
# - **block**: room for the K and V of `block_size` consecutive tokens of one sequence, in *every*
#   layer, named by one *block id*. The book's blocks hold 16 tokens unless a cell says otherwise:
#   2 MiB for the teaching model.
# - **page**: one block of *one* layer. The word comes from vLLM's code (`page_size_bytes`,
#   appendix A2): 64 KiB for the teaching model, and a block is one page in each of its 32 layers.
#   Where chapter 03 speaks of "16-token pages" it means the article's sense, paging as an operating
#   system does it: the 16-token blocks themselves. The two words count the same tokens; a page is
#   a block's share of one layer.
# - **slot**: the place of one token in the pool: `block_id × block_size + offset`.
# - **slot mapping**: the slots of the tokens a step writes, in order; the kernel that stores new
#   keys and values scatters them there.
# - **block table**: one sequence's list of block ids, in the order of its tokens: entry *i* holds
#   tokens *i* × `block_size` to (*i* + 1) × `block_size` − 1.
#
# **Serving** (chapters 04 to 08).
#
# - **hit**: prompt tokens whose K and V are found in the prefix cache and are not computed again;
#   only full blocks hit, and never the prompt's last token, which is computed to give the first
#   output (chapter 04).
# - **step**: one iteration of the engine: the scheduler picks requests and a number of tokens for
#   each, and the model computes all of them in one batched forward pass (chapter 05).
# - **chunk**: the tokens of one request computed in one step: part or all of a prompt (prefill),
#   or one token (decode). A prompt longer than the step's token budget is prefilled in several
#   chunks (chapter 05).
# - **preemption**: taking a running request's blocks back when a step cannot get the blocks it
#   needs. The request returns to the front of the waiting queue and later recomputes what it lost
#   (chapter 05).
# - **TTFT**, time to first token: from a request's arrival to its first output token (chapter 06).
# - **TPOT**, time per output token: for one request, (its end-to-end latency − its TTFT) / (its
#   output tokens − 1); every request weighs the same (chapter 06).
# - **ITL**, inter-token latency: each interval between two consecutive output tokens of a
#   request, all requests' intervals pooled, so that long answers weigh more (chapter 06).
# - **replica**: one of several servers of the same model behind one address; each has its own
#   pool and its own prefix cache, and none reads another's (chapter 07).
# - **router**: what sends each request to one replica, by a policy: round-robin, least loaded,
#   or cache-aware (chapter 07).
# - **second tier**: storage behind the pool (host memory, a disk, another machine) that keeps the
#   blocks the pool evicts; a block found there is reloaded only when its bytes cross the link in
#   less time than computing it again would take (chapter 08).
# - **disaggregation**: prefill on one pool of replicas, decode on another; the K/V a prefill wrote
#   crosses a link to the decode pool (chapter 08).
#
# Requests **A, B and C** are chapter 02's three, of 8,192, 4,096 and 2,048 tokens, the sizes the
# article reasons with. Elsewhere letters name the requests of one example only (chapter 04's A and
# B share a report; chapter 05's walks are W, X, Y, Z and P, Q, R), and each example introduces its own.
#
# The words for memory, in code (chapter 03 builds these classes): a pool of 8 blocks, where an
# earlier request holds 2 blocks, and a 37-token request in 16-token blocks.

# %%
# NBVAL_CHECK_OUTPUT
from labkit.memory.paging import BlockAllocator, BlockTable

pool = BlockAllocator(num_blocks=8)
earlier, request = BlockTable(block_size=16), BlockTable(block_size=16)
earlier.append(20, pool)                  # 20 tokens: 2 blocks
slot_mapping = request.append(37, pool)   # 37 tokens: 3 blocks, and the slots they are written to
print(f"block table of the 37-token request: {request.block_ids}")
print(f"token 0 -> slot {request.slot(0)}, token 16 -> slot {request.slot(16)}, token 36 -> slot {request.slot(36)}")
print(f"slot mapping of its last 5 tokens: {slot_mapping[-5:]}; empty slots in its last block: {request.empty_slots}")
assert request.slot(36) == request.block_ids[36 // 16] * 16 + 36 % 16 and request.empty_slots == 11
assert slot_mapping == [b * 16 + i for b in request.block_ids for i in range(16)][:37]
assert not set(request.block_ids) & set(earlier.block_ids)  # a block belongs to one sequence here

# %% [markdown]
# ## How the notebooks work
#
# - Run cells from the top (**Run ▸ Run All Cells**). Each chapter imports `labkit`, the book's
#   small Python package; the chapters teach with it rather than hiding it, so open
#   `labkit/` whenever you want to see how something is done.
# - Cells that end in `assert ...` check a claim the text just made. If one fails, the claim is
#   wrong for your settings, and that is worth knowing.
# - **Exercises** close every chapter. Each has a checker cell: until you solve it, the checker says
#   *not solved yet* and points to the worked answer in `solutions/`. Nothing later depends on
#   your answers, so an unsolved exercise never breaks a chapter.
# - **Widgets** (sliders and menus) need a live kernel. Each widget has a static figure beside it,
#   so a reader of a rendered page sees the same story.
# - Without a GPU, the Triton kernels of chapters 03 to 05 run in Triton's *interpreter*, which
#   executes the kernel body on the CPU. It is slow, so the chapters pick small shapes there and
#   larger ones on a GPU.

# %% [markdown]
# ## Your environment
#
# `import labkit` decides where code runs. Without a CUDA GPU it switches Triton's interpreter on
# *before* any kernel is defined; that ordering matters, because Triton reads the switch when a
# kernel is decorated.

# %%
import os

import labkit

print(labkit.describe())

# %%
# The decision in code: the interpreter is on exactly when there is no GPU to compile for.
if labkit.RUNTIME.triton_mode == "interpreter":
    assert labkit.DEVICE.type == "cpu" and os.environ["TRITON_INTERPRET"] == "1"
elif labkit.RUNTIME.triton_mode == "compiled":
    assert labkit.DEVICE.type == "cuda"
print(f"kernels: {labkit.RUNTIME.triton_mode}; tensors live on: {labkit.DEVICE}")

# %% [markdown]
# A first taste of the book's arithmetic: five sizes you will meet again, each computed from the
# article's *teaching model* (32 layers, 8 KV heads of dimension 128, 2-byte elements; chapter 02).
# The chapters measure memory in binary units (1 KiB = 1,024 bytes, 1 MiB = 1,024 KiB,
# 1 GiB = 1,024 MiB), printed by `labkit.units.format_bytes`:

# %%
# NBVAL_CHECK_OUTPUT
from labkit.memory.capacity import bytes_per_token
from labkit.units import format_bytes

per_token = bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
block_tokens, request_tokens = 16, 37
empty_slots = -(-request_tokens // block_tokens) * block_tokens - request_tokens  # 3 blocks hold 48 slots
sizes = [
    ("one token's K and V (chapter 02)", per_token),
    (f"one block of {block_tokens} tokens (chapter 03)", block_tokens * per_token),
    (f"the {empty_slots} empty slots in the last block of a {request_tokens}-token request (chapter 03)",
     empty_slots * per_token),
    ("request A: 8,192 tokens (chapter 02)", 8192 * per_token),
    ("requests A + B + C: 8,192 + 4,096 + 2,048 tokens (chapter 02)", (8192 + 4096 + 2048) * per_token),
]
for what, n in sizes:
    print(f"{n:>13,} bytes = {format_bytes(n):>9}  {what}")
# Half a gibibyte is 512 MiB; the book writes sizes in a common unit when it compares them:
print(f"{2**29:>13,} bytes = {format_bytes(2**29)} = {format_bytes(2**29, unit='GiB')}")
assert per_token == 131_072 and empty_slots == 11
assert [format_bytes(n) for _, n in sizes] == ["128 KiB", "2 MiB", "1.375 MiB", "1 GiB", "1.75 GiB"]
assert format_bytes(2**29, unit="GiB") == "0.5 GiB"

# %% [markdown]
# ## A widget, and its static twin
#
# Move the slider: the label shows how many bytes one token's keys and values take in a
# 32-layer model with the number of KV heads you choose (chapter 02 explains the formula).
# Below it, the same relation as a static figure.

# %%
import ipywidgets as widgets
from IPython.display import display


def per_token_bytes(kv_heads: int) -> str:
    return format_bytes(bytes_per_token(num_layers=32, num_kv_heads=kv_heads, head_dim=128, dtype_bytes=2))


slider = widgets.IntSlider(value=8, min=1, max=32, description="KV heads")
label = widgets.Label(f"bytes per token: {per_token_bytes(8)}")
slider.observe(lambda change: setattr(label, "value", f"bytes per token: {per_token_bytes(change['new'])}"), "value")
display(widgets.VBox([slider, label]))

# %%
import matplotlib.pyplot as plt

heads = list(range(1, 33))
fig, ax = plt.subplots(figsize=(7, 3))
ax.plot(heads, [bytes_per_token(32, h, 128, 2) / 1024 for h in heads], marker=".")
ax.set(xlabel="KV heads", ylabel="KiB per token", title="Bytes per token grow linearly with KV heads")
plt.show()

# %% [markdown]
# ## How an exercise looks
#
# Exercises are cells you complete. Try this one: replace `None` with the number of bytes in one
# GiB, then run the cell and the checker.

# %%
from labkit.teaching.exercises import Exercises

ex = Exercises("00_start_here")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/, a checker that fails makes the notebook tests fail

# %%
# BEGIN SOLUTION
bytes_per_gib = 1024**3
# END SOLUTION
# BEGIN STUB
bytes_per_gib = None  # replace None with an expression
# END STUB
ex.check("Warm-up", bytes_per_gib, hint="1 GiB = 1,024 MiB, 1 MiB = 1,024 KiB, 1 KiB = 1,024 bytes.")

# %% [markdown]
# ## Summary
#
# - The book is six chapters, one per section of the article, and a capstone (Part I); chapters
#   that go beyond the article (Part II); and appendices that deepen them. Each is a notebook built
#   on `labkit`.
# - Each word of the glossary above has one meaning in every chapter.
# - `import labkit` picks the device and, without a GPU, runs Triton kernels in the interpreter.
# - Exercises have checkers; worked answers live in `solutions/`.

# %% [markdown]
# ## References
#
# - The source article: *长上下文推理中的 KV Cache：容量、分页与复用边界* ("The KV cache in
#   long-context inference: capacity, paging and the limits of reuse"), a Chinese essay in six
#   sections; the copy the book follows gives no author or link. Its figures (the sizes above among
#   them) carry over into the chapters; its sentences do not.
# - Woosuk Kwon, Zhuohan Li, et al., *Efficient Memory Management for Large Language Model Serving
#   with PagedAttention*, SOSP 2023, [arXiv:2309.06180](https://arxiv.org/abs/2309.06180): the
#   paged KV cache of chapters 03 to 06.
# - vLLM, the serving engine the book compares itself with: documentation at
#   [docs.vllm.ai](https://docs.vllm.ai/), code at
#   [github.com/vllm-project/vllm](https://github.com/vllm-project/vllm). Each chapter names the
#   files and the vLLM version it read.
# - Triton's interpreter (`TRITON_INTERPRET=1`), which runs this book's kernels on a CPU:
#   [triton-lang.org](https://triton-lang.org/) and
#   [github.com/triton-lang/triton](https://github.com/triton-lang/triton).

# %% [markdown]
# Next: **01 · why the cache grows**.
