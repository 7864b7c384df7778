# %% [markdown]
# # 00 · Start here
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

# %% [markdown]
# ## The map
#
# | chapter | question | what you build with `labkit` |
# |---|---|---|
# | 01 · why the cache grows | what does a model keep per token, and why? | a tiny Llama-style decoder; prefill, decode, a growing cache |
# | 02 · cost per token | how many bytes does one token cost? | the byte formula, GQA, real model presets, a capacity explorer |
# | 03 · paging | how do we stop reserving memory we never use? | a block allocator, block tables, Triton paged-attention kernels |
# | 04 · prefix reuse | when may two requests share cached state? | a prefix cache with block hashes, reference counts, copy-on-write |
# | 05 · capacity in the scheduler | who gets memory this iteration? | `plan_iteration` with a token and block budget; a small engine |
# | 06 · from fit to serve | does fitting in memory mean serving fast? | a serving simulator: occupancy, reuse, latency |
# | A1 · under the compiler (appendix to 03) | what does a GPU make of the paged kernels? | compiler reports, occupancy, a roofline of decode |
# | A2 · vLLM's start-up log (appendix to 06) | what will vLLM print, and why may it refuse to start? | vLLM 0.33.0's KV-cache arithmetic |
# | A3 · fewer bytes per element (appendix to 02) | what does an fp8, int8 or int4 cache cost in quality? | a quantized paged cache, its Triton decode, a measurement on the real model |
# | A4 · the real vLLM on your CPU (appendix to A2, 05, 06) | does the real vLLM do what the book predicts? | vLLM run beside labkit (optional: `make vllm`) |
#
# The chapters follow one article's six sections and build on each other; read them in order.

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
# 1 GiB = 1,024 MiB), printed by `labkit.format_bytes`:

# %%
# NBVAL_CHECK_OUTPUT
from labkit.capacity import bytes_per_token

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
    print(f"{n:>13,} bytes = {labkit.format_bytes(n):>9}  {what}")
# Half a gibibyte is 512 MiB; the book writes sizes in a common unit when it compares them:
print(f"{2**29:>13,} bytes = {labkit.format_bytes(2**29)} = {labkit.format_bytes(2**29, unit='GiB')}")
assert per_token == 131_072 and empty_slots == 11
assert [labkit.format_bytes(n) for _, n in sizes] == ["128 KiB", "2 MiB", "1.375 MiB", "1 GiB", "1.75 GiB"]
assert labkit.format_bytes(2**29, unit="GiB") == "0.5 GiB"

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
    return labkit.format_bytes(bytes_per_token(num_layers=32, num_kv_heads=kv_heads, head_dim=128, dtype_bytes=2))


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
from labkit.exercises import Exercises

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
# - The book is six chapters, each a notebook built on `labkit`.
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
