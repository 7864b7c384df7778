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
# # 02 · What each token costs
#
# **The message.** One token's cache costs 2 × layers × KV heads × head dimension × bytes per
# element, counted with the KV heads and never the query heads, and a device's KV pool divided by
# that cost times the length says how many sequences fit.
#
# Chapter 01 showed that the cache grows by one entry per token. Before we can decide how to
# *manage* that memory (chapters 03 to 05), we need to know how big an entry is. It turns out
# to be a product of four numbers you can read off any model's `config.json`.
#
# **What you will learn**
#
# - to derive the bytes one token adds to the cache, and to check the formula on real caches;
# - to reproduce the article's table: 128 KiB per token, 1 GiB for an 8,192-token request, and
#   3 GiB when three requests reserve their maximum length up front;
# - why the formula takes the number of **KV heads**, not query heads (GQA), and how large the
#   mistake is;
# - how real models compare, per token and at their own context limits;
# - how many sequences fit on a device, with an explorer you can play with.
#
# Two appendices take the formula further: [A2](A2_vllm_start_up.ipynb) splits the cache over
# several devices and reads vLLM's start-up log, and [A3](A3_fewer_bytes_per_element.ipynb) stores
# fewer bytes per token (8-bit and 4-bit elements, sliding windows, a latent cache).

# %%
from labkit.teaching.diagrams import roadmap

roadmap("02");  # the article's pipeline, this chapter's part highlighted

# %% [markdown]
# **You need:** chapter 01: the cache keeps one key and one value per layer, per KV head and per
# token, and several query heads can share one KV head (GQA).
#
# **Time:** about 25 minutes to read and run; about 80 minutes for the exercises.

# %%
import torch
import matplotlib.pyplot as plt

import labkit
from labkit.caches.contiguous import KVCache
from labkit.memory import capacity
from labkit.memory.capacity import PRESETS, TEACHING_MODEL
from labkit.model.decoder import Decoder, DecoderConfig
from labkit.units import GiB, KiB, MiB, format_bytes

print(labkit.describe())

# %% [markdown]
# ## 1. Deriving the formula
#
# Take one token and follow it through the model. In every one of the **L** layers, the
# attention block projects the token to a key and a value for each of the **Hkv** KV heads. Each
# of those vectors has **D** elements (the head dimension), and each element takes **b** bytes.
# The cache keeps all of them, so one token costs
#
# $$\mathrm{bytes\_per\_token} = 2 \times L \times H_{kv} \times D \times b,$$
#
# where the 2 counts K and V. A sequence whose cache holds **T** tokens costs
# $M_{kv} = T \times \mathrm{bytes\_per\_token}$. Nothing else in the model enters: not the hidden
# size, not the vocabulary, not the number of parameters.
#
# The article's teaching model has 32 layers, 8 KV heads, head dimension 128 and 2-byte elements
# (bf16 or fp16). It is a model for arithmetic, not a measured checkpoint.

# %%
# NBVAL_CHECK_OUTPUT
L, H_kv, D, b = TEACHING_MODEL.num_layers, TEACHING_MODEL.num_kv_heads, TEACHING_MODEL.head_dim, TEACHING_MODEL.dtype_bytes
per_token = capacity.bytes_per_token(L, H_kv, D, b)
print(f"2 (K and V) x {L} layers x {H_kv} KV heads x {D} dims x {b} bytes = {format_bytes(per_token, 'bytes')}")
print(f"= {format_bytes(per_token)} per token")
assert per_token == 2 * L * H_kv * D * b == 131_072 == 128 * KiB

# %% [markdown]
# The element size can also be given as a dtype, the way a `config.json` states it:

# %%
for dtype in ["float32", "bfloat16", torch.float16, "fp8"]:
    print(f"{str(dtype):15} {format_bytes(capacity.bytes_per_token(L, H_kv, D, dtype=dtype)):>8} per token")

# %% [markdown]
# ## 2. Checking the formula against real caches
#
# A formula is only as good as its check, and the check must not be built from the formula. So we
# run real models, prefill real prompts into chapter 01's `KVCache`, and read the bytes of the
# tensors the layers actually stored, then compare with the formula. `KVCache.nbytes` adds them up,
# tensor by tensor (elements × bytes per element), and knows nothing of layers, heads or the formula.
#
# First chapter 01's small random decoder. Its weights are float32, so its cache elements take
# 4 bytes.

# %%
model = Decoder.random()
cfg = model.config
shape = capacity.ModelShape.from_config(cfg.to_dict(), name="chapter-01 decoder", dtype=torch.float32)
prompt = torch.randint(0, cfg.vocab_size, (1, 37), generator=torch.Generator().manual_seed(0))
cache = KVCache(cfg)
with torch.no_grad():
    logits = model(prompt, cache=cache)
print(f"{shape.num_layers} layers; layer 0 stores K {tuple(cache.k[0].shape)} and V {tuple(cache.v[0].shape)}, "
      f"{cache.k[0].dtype}")
print(f"after a 37-token prefill: {cache.nbytes:,} bytes stored; formula: {shape.cache_bytes(37):,}")
assert cache.nbytes == shape.cache_bytes(37)

# %% [markdown]
# One decode step feeds one token, and the stored tensors grow by exactly one token's worth:

# %%
before = cache.nbytes
with torch.no_grad():
    model(logits[:, -1:].argmax(-1), cache=cache)
print(f"one decode step added {cache.nbytes - before:,} bytes; bytes_per_token: {shape.bytes_per_token():,}")
assert cache.nbytes - before == shape.bytes_per_token()

# %% [markdown]
# Now the teaching model's own cache shape: 32 layers, 32 query heads sharing 8 KV heads of
# dimension 128, in bfloat16. A full model of that shape (hidden size 4,096) would not run quickly
# here, but the formula claims the hidden size does not matter: only the K and V projections'
# outputs are stored, `KV heads × head_dim` numbers each. So we build two real decoders with the
# teaching model's attention shape and a small hidden size and MLP (64 and 256), prefill prompts of
# ragged lengths into each, and compare what they store with the formula for the teaching model.

# %%
# NBVAL_CHECK_OUTPUT
def teaching_shaped_decoder(hidden_size: int) -> Decoder:
    """A random bf16 decoder with the teaching model's cache shape and a small hidden size."""
    tcfg = DecoderConfig(vocab_size=256, hidden_size=hidden_size, intermediate_size=hidden_size,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    return Decoder.random(tcfg, seed=hidden_size).to(torch.bfloat16)


decoders = {hidden: teaching_shaped_decoder(hidden) for hidden in (64, 256)}
print(f"{'prefill T':>10}{'hidden 64':>14}{'hidden 256':>14}{'formula':>14}   (bytes stored)")
for length in [1, 3, 16, 37]:
    stored = []
    for m in decoders.values():
        c = KVCache(m.config)
        ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            m(ids, cache=c)
        assert all(k.dtype == torch.bfloat16 and k.shape == (1, length, 8, 128) for k in c.k + c.v)
        stored.append(c.nbytes)
    print(f"{length:>10}{stored[0]:>14,}{stored[1]:>14,}{TEACHING_MODEL.cache_bytes(length):>14,}")
    assert stored[0] == stored[1] == TEACHING_MODEL.cache_bytes(length)

# %% [markdown]
# ## 3. The article's table
#
# Three independent requests, their lengths counted in cached tokens. At 128 KiB per token,
# 8,192 tokens take exactly 1 GiB (8,192 × 128 KiB = 1,048,576 KiB). Sizes are in binary units:
# 1 GiB = 1,024 MiB.

# %%
# NBVAL_CHECK_OUTPUT
requests = {"A": 8192, "B": 4096, "C": 2048}
sizes = {name: TEACHING_MODEL.cache_bytes(n) for name, n in requests.items()}
print(f"{'request':8}{'cache length':>16}{'tensor memory':>16}")
for name, n in requests.items():
    print(f"{name:8}{n:>9,} tokens{format_bytes(sizes[name], 'GiB'):>16}")
total_tokens, total_bytes = sum(requests.values()), sum(sizes.values())
print(f"{'total':8}{total_tokens:>9,} tokens{format_bytes(total_bytes, 'GiB'):>16}")
assert [sizes[r] for r in "ABC"] == [GiB, GiB // 2, GiB // 4]
assert total_tokens == 14_336 and total_bytes == 1.75 * GiB

# %% [markdown]
# Now suppose a server reserves contiguous room for the longest request it allows, 8,192 tokens,
# the moment each request arrives. The reservation does not care how long a request turns out to be:

# %%
# NBVAL_CHECK_OUTPUT
reserved = len(requests) * TEACHING_MODEL.cache_bytes(8192)
unused = reserved - total_bytes
print(f"reserved up front: 3 x 8,192 tokens = {format_bytes(reserved)}")
print(f"holding token state: {format_bytes(total_bytes)}")
print(f"reserved but unused: {format_bytes(unused)} ({unused / reserved:.0%} of the reservation)")
assert reserved == 3 * GiB and unused == 1.25 * GiB

# %% [markdown]
# The 1.25 GiB is not in any tensor's values: it is room set aside for tokens that have not come
# (and, for B and C, never will). Chapter 03 removes most of it by allocating in small blocks.

# %%
fig, ax = plt.subplots(figsize=(7, 3.0))
names = list(requests)
used = [sizes[n] / GiB for n in names]
ax.barh(names, [1.0] * 3, color="lightgrey", label="reserved, unused")
ax.barh(names, used, color="C0", label="holding K and V")
ax.set_xlabel("memory (GiB)")
ax.set_xlim(0, 1.45)
ax.invert_yaxis()
ax.set_title(f"Reserving 8,192 tokens each: {format_bytes(reserved)} held, {format_bytes(total_bytes)} used")
ax.legend(loc="center right")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 4. The GQA mistake
#
# With grouped-query attention, several query heads share one K/V head: Llama-3-8B has 32 query
# heads but only 8 KV heads, so each KV head serves a group of 4. The cache stores only the KV
# heads. Plugging the query-head count into the formula overstates the cache by the group size:

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'model':17}{'query heads':>12}{'KV heads':>10}{'right':>12}{'mistake':>12}{'factor':>8}")
for name in ["Llama-3-8B", "Llama-3-70B", "Qwen2.5-7B", "Gemma-2-9B"]:
    p = PRESETS[name]
    right, wrong = p.bytes_per_token(), p.query_head_mistake()
    assert wrong // right == p.num_attention_heads // p.num_kv_heads
    print(f"{name:17}{p.num_attention_heads:>12}{p.num_kv_heads:>10}{format_bytes(right):>12}"
          f"{format_bytes(wrong):>12}{wrong // right:>7}x")

# %% [markdown]
# Take request A (8,192 tokens) on Llama-3-8B, and a device of 80 GiB with 20 GiB set aside for
# the weights and workspace. The mistake plans a much bigger cache per request, and so a capacity
# planner would admit far fewer sequences than actually fit:

# %%
# NBVAL_CHECK_OUTPUT
llama8 = PRESETS["Llama-3-8B"]
a_right = llama8.cache_bytes(8192)
a_wrong = 8192 * llama8.query_head_mistake()
fit_right = capacity.sequences_that_fit(a_right, device_bytes=80 * GiB, reserved_bytes=20 * GiB)
fit_wrong = capacity.sequences_that_fit(a_wrong, device_bytes=80 * GiB, reserved_bytes=20 * GiB)
print(f"request A on Llama-3-8B: {format_bytes(a_right)} (KV heads), {format_bytes(a_wrong)} (query heads)")
print(f"sequences admitted in the 60 GiB pool: {fit_right} (KV heads), {fit_wrong} (query heads), "
      f"{fit_wrong / fit_right:.0%} of what fits")
assert a_wrong == 4 * a_right and fit_wrong * 4 == fit_right

# %% [markdown]
# ## 5. Real models side by side
#
# `capacity.PRESETS` holds shapes read from each model's `config.json`. So that the chapter runs
# without a network, `capacity.PRESET_CONFIGS` keeps an excerpt of each, transcribed by hand from
# the public file on the Hugging Face Hub, and every preset is built from its excerpt by
# `ModelShape.from_config`, the same function that reads any Llama-style config dict (the files are
# listed under References). Llama-3-8B's excerpt has no `head_dim`, so `from_config` derives it as
# `hidden_size // num_attention_heads`:

# %%
llama3_8b_config = capacity.PRESET_CONFIGS["Llama-3-8B"]
from_json = capacity.ModelShape.from_config(llama3_8b_config, name="Llama-3-8B", dtype="bfloat16",
                                            source=PRESETS["Llama-3-8B"].source)
fields = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"]
print(", ".join(f"{k} {llama3_8b_config[k]:,}" for k in fields))
print(f"-> head_dim {llama3_8b_config['hidden_size']} // {llama3_8b_config['num_attention_heads']} = "
      f"{from_json.head_dim}; {format_bytes(from_json.bytes_per_token())} per token")
assert from_json == PRESETS["Llama-3-8B"]
assert from_json.head_dim == llama3_8b_config["hidden_size"] // llama3_8b_config["num_attention_heads"]

# %% [markdown]
# The table uses the article's formula for every model: 2-byte elements, and no sliding windows
# applied, though Mistral-7B and Gemma-2-9B keep only a window of recent tokens in some layers
# (appendix A3 counts them). DeepSeek-V3 is the exception in kind: it caches one latent vector per
# token and layer, with no factor 2 (the "lat" in the table; appendix A3 again). Each model was also
# built for a longest context, its `config.json`'s `max_position_embeddings`: 8,192 tokens for
# Llama-3 and Gemma-2, far more for others. The formula would give bytes for any length, but a
# request longer than the model's limit is not one it can serve, so the last column takes each model
# at its own limit (the teaching model has none; "-" in the table).

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'model':16}{'L':>4}{'Hkv':>5}{'D':>5}{'per token':>11}{'8K request':>12}{'max context':>13}"
      f"{'at max context':>16}")
for p in PRESETS.values():
    heads = "lat" if p.latent else p.num_kv_heads
    limit = p.max_position_embeddings
    at_limit = format_bytes(p.cache_bytes(limit, apply_window=False)) if limit else "-"
    print(f"{p.name:16}{p.num_layers:>4}{heads:>5}{p.head_dim:>5}{format_bytes(p.bytes_per_token()):>11}"
          f"{format_bytes(p.cache_bytes(8192, apply_window=False)):>12}{f'{limit:,}' if limit else '-':>13}"
          f"{at_limit:>16}")
assert all(not p.beyond_context(8192) for p in PRESETS.values())  # the 8K column is within every limit
assert [p.max_position_embeddings for p in PRESETS.values() if p.name.startswith(("Llama-3", "Gemma-2"))] == [8192] * 3
assert PRESETS["Llama-3-70B"].bytes_per_token() == 320 * KiB
assert PRESETS["Qwen2.5-7B"].bytes_per_token() == 56 * KiB
assert PRESETS["Gemma-2-9B"].bytes_per_token() == 336 * KiB

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
order = sorted(PRESETS.values(), key=lambda p: p.bytes_per_token())
ax.barh([p.name for p in order], [p.bytes_per_token() / KiB for p in order], color="C0")
for i, p in enumerate(order):
    ax.text(p.bytes_per_token() / KiB, i, " " + format_bytes(p.bytes_per_token()), va="center", fontsize="small")
ax.set_xlabel("KV cache per token (KiB)")
ax.set_xlim(0, 400)
lo, hi = order[0], order[-1]
ax.set_title(f"Per-token cost differs {hi.bytes_per_token() // lo.bytes_per_token()}x: "
             f"{format_bytes(lo.bytes_per_token())} ({lo.name}) to {format_bytes(hi.bytes_per_token())} ({hi.name})")
fig.tight_layout()
plt.show()
assert (lo.name, hi.name) == ("Qwen2.5-7B", "Gemma-2-9B")
assert PRESETS["Gemma-2-9B"].bytes_per_token() == 6 * PRESETS["Qwen2.5-7B"].bytes_per_token()

# %% [markdown]
# The size in a model's name does not predict its cache: Gemma-2-9B, a model of 9 billion
# parameters, stores 6 times more per token than Qwen2.5-7B, a model of 7 billion, because it keeps
# 8 KV heads of dimension 256 in 42 layers, against 4 heads of 128 in 28.

# %% [markdown]
# ## 6. From bytes to capacity
#
# How many sequences fit on one device? Subtract what the device needs for other things (the
# weights, the activation workspace, a safety margin) and divide what is left, the KV pool, by
# the bytes of one sequence. The article's closing example, previewed here: a 24 GiB device with
# 17 GiB set aside leaves a 7 GiB pool, room for seven 8,192-token sequences of the teaching
# model, before any block-table overhead, and without any promise about latency.

# %%
# NBVAL_CHECK_OUTPUT
fit = capacity.sequences_that_fit(TEACHING_MODEL.cache_bytes(8192), device_bytes=24 * GiB, reserved_bytes=17 * GiB)
print(f"pool {format_bytes(capacity.kv_pool_bytes(24 * GiB, 17 * GiB))}: {fit} sequences of 8,192 tokens")
assert fit == 7

# %% [markdown]
# ### The capacity explorer
#
# Pick a preset, then move the sliders. The readout gives bytes per token, bytes per request and
# the number of sequences that fit; the plot shows that number against the context length, with
# your request count as a dashed line. The explorer applies the article's formula (no windows), and
# its "KV cache dtype" menu offers appendix A3's 8-bit and 4-bit caches beside float32 and bfloat16.
# Lengths past the preset's `max_position_embeddings` get a warning, and the plot draws them dotted.
#
# Below the table, **vLLM would print** the two start-up lines vLLM computes for the same device
# (`labkit.vllm_bridge.predict`): the pool is device × `gpu_memory_utilization` (its own slider) −
# set aside, cut into 16-token blocks, with `max_model_len` = the context length. When one request
# would not fit, or the context passes the model's limit, the box shows vLLM's refusal instead.
# [Appendix A2](A2_vllm_start_up.ipynb) reads these lines and refusals one by one, and explains why
# a real GPU refuses a utilization of 1.0 (the article's idealised device, the slider's start) and
# why vLLM's concurrency for Mistral and Gemma 2, whose windows it budgets its own way, differs
# from "sequences that fit".
#
# Try: Qwen2.5-7B at its limit of 131,072 tokens on an 80 GiB device with 20 GiB set aside; then
# switch the KV cache dtype to fp8; then pick Llama-3-8B, whose limit is far shorter; then set
# aside more than the device has.

# %%
from labkit.teaching.widgets.capacity_explorer import CapacityExplorer

assert PRESETS["Qwen2.5-7B"].max_position_embeddings == 131_072 == 128 * 1024
CapacityExplorer()

# %% [markdown]
# Without a live kernel the sliders do nothing. The static figure asks the explorer's question for
# real models, each on a device that can hold its weights: the 80 GiB device of section 4, with
# 20 GiB set aside for weights and workspace, which leaves a 60 GiB KV pool. The 20 GiB hold the
# bfloat16 weights of the models of 7 to 9 billion parameters (checked below with a 10% margin over
# the count in each name). Llama-3-70B and DeepSeek-V3 are left out: their weights alone outgrow
# one such device. For each model, the bars count the sequences of 8,192 tokens (within every one
# of these models' context limits) that fit in the pool, by the article's formula.

# %%
# NBVAL_CHECK_OUTPUT
device, set_aside, context = 80 * GiB, 20 * GiB, 8192
pool = capacity.kv_pool_bytes(device, set_aside)
billions_in_name = {"Qwen2.5-7B": 7, "Mistral-7B-v0.1": 7, "Llama-3-8B": 8, "Gemma-2-9B": 9}
for name, billions in billions_in_name.items():
    assert f"-{billions}B" in name  # the count in the model's name
    assert 1.1 * billions * 1e9 * 2 < set_aside  # bf16 weights, even 10% above the name's count, fit
    assert not PRESETS[name].beyond_context(context)
fit_formula = {n: capacity.sequences_that_fit(PRESETS[n].cache_bytes(context, apply_window=False), device, set_aside)
               for n in billions_in_name}
print(f"KV pool: {format_bytes(device)} - {format_bytes(set_aside)} = {format_bytes(pool)}; "
      f"sequences of {context:,} tokens that fit:")
print(f"{'model':17}{'per sequence':>14}{'fit':>6}")
for n in billions_in_name:
    print(f"{n:17}{format_bytes(PRESETS[n].cache_bytes(context, apply_window=False)):>14}{fit_formula[n]:>6}")
assert fit_formula == {"Qwen2.5-7B": 137, "Mistral-7B-v0.1": 60, "Llama-3-8B": 60, "Gemma-2-9B": 22}

# %%
names = sorted(billions_in_name, key=fit_formula.get)
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.barh(names, [fit_formula[n] for n in names], color="C0")
for r, n in enumerate(names):
    ax.text(fit_formula[n], r, f" {fit_formula[n]}", va="center", fontsize="small")
ax.set_yticks(range(len(names)), [f"{n}\n{format_bytes(PRESETS[n].bytes_per_token())}/token" for n in names])
ax.set_xlabel(f"sequences of {context:,} tokens that fit")
ax.set_xlim(0, 1.15 * max(fit_formula.values()))
ax.set_title(f"One {format_bytes(pool)} pool ({format_bytes(device)} device): "
             f"{min(fit_formula.values())} to {max(fit_formula.values())} sequences of {context:,} tokens")
fig.tight_layout()
plt.show()

# %% [markdown]
# The same pool holds 22 sequences of Gemma-2-9B and 137 of Qwen2.5-7B: the bytes per token, not
# the size of the model, decide how many conversations a device can keep. (The article's own
# example, seven 8,192-token sequences of the teaching model in a 7 GiB pool on a 24 GiB device, is
# the explorer's starting setting.)

# %% [markdown]
# One number to carry into chapter 03, which allocates the cache in blocks of 16 token slots: the
# bytes of one such block of the teaching model.

# %%
# NBVAL_CHECK_OUTPUT
print(f"TEACHING_MODEL.block_bytes(16) = {TEACHING_MODEL.block_bytes(16):,} bytes = "
      f"{format_bytes(TEACHING_MODEL.block_bytes(16))}")
assert TEACHING_MODEL.block_bytes(16) == 16 * per_token == 2 * MiB

# %% [markdown]
# ## Summary
#
# - One token costs `2 × L × Hkv × D × b` bytes; a sequence costs its cached length times that.
#   For the teaching model: 131,072 bytes = 128 KiB per token, 1 GiB per 8,192 tokens.
# - Measured on real caches after real prefills (chapter 01's decoder, and bf16 decoders with the
#   teaching model's attention shape and two hidden sizes), the bytes stored equal the formula
#   exactly, and the hidden size changes nothing.
# - Reserving the maximum length up front held 3 GiB for 1.75 GiB of state; 1.25 GiB was
#   reservation, not data.
# - Use KV heads, not query heads: the mistake overstates the cache by the GQA group size, and a
#   planner that makes it admits only a group's share of the sequences that fit.
# - A model's `max_position_embeddings` bounds the requests worth sizing: the formula gives bytes
#   for any length, not the model's ability to serve it.
# - In one 60 GiB pool, from 22 (Gemma-2-9B) to 137 (Qwen2.5-7B) sequences of 8,192 tokens fit:
#   bytes per token, not model size, set the count. The explorer asks the same for any setting and
#   shows what vLLM would print (appendix A2 reads those lines).
# - Next, chapter 03 replaces whole-sequence reservations with blocks of 16 tokens:
#   `TEACHING_MODEL.block_bytes(16)` is 2 MiB (printed above).

# %% [markdown]
# ## Exercises

# %%
from labkit.teaching.exercises import Exercises

ex = Exercises("02_cost_per_token")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/ a failing checker fails the notebook tests

# %% [markdown]
# **Exercise 1.** Using only the formula and the numbers in Qwen2.5-7B's `config.json`
# (28 layers, 28 query heads, 4 KV heads, hidden size 3584, bf16), how many bytes does one
# token add to its cache?

# %%
# BEGIN SOLUTION
answer_1 = 2 * 28 * 4 * (3584 // 28) * 2
# END SOLUTION
# BEGIN STUB
answer_1 = None  # replace None with your expression
# END STUB
qwen = capacity.PRESET_CONFIGS["Qwen2.5-7B"]  # the numbers quoted in the exercise
assert (qwen["num_hidden_layers"], qwen["num_attention_heads"], qwen["num_key_value_heads"], qwen["hidden_size"],
        qwen["torch_dtype"]) == (28, 28, 4, 3584, "bfloat16")
ex.check("Exercise 1", answer_1, hint="head_dim = hidden_size / query heads; then use the KV heads.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** `config.json` gives no `head_dim`, so it is the hidden size shared out among
# the query heads: 3584 / 28 = 128. The cache then stores K and V (the 2) for the 4 KV heads in each
# of the 28 layers, at 2 bytes each: 57,344 bytes, 56 KiB per token.

# %% [markdown]
# **Exercise 2.** A colleague sized Llama-3-70B's cache with its 64 query heads instead of its
# 8 KV heads. For one 8,192-token request (its longest context), by how many bytes is the estimate
# too large?

# %%
# BEGIN SOLUTION
answer_2 = 8192 * 2 * 80 * (64 - 8) * 128 * 2
# END SOLUTION
# BEGIN STUB
answer_2 = None  # replace None with your expression
# END STUB
llama70 = PRESETS["Llama-3-70B"]  # the numbers quoted in the exercise
assert (llama70.num_attention_heads, llama70.num_kv_heads, llama70.max_position_embeddings) == (64, 8, 8192)
ex.check("Exercise 2", answer_2)

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** The mistaken and the right estimate differ only in the head count, so the
# excess is the formula with 64 − 8 = 56 heads in place of 8: per token 2 × 80 × 56 × 128 × 2 bytes,
# times 8,192 tokens. It is 7 times the true cache, since the group size is 64 / 8 = 8.

# %% [markdown]
# **Exercise 3.** Write `fits(device_gib, reserved_gib, context_len)`: how many sequences of
# `context_len` tokens of the teaching model fit in the pool of a device with `device_gib` GiB,
# of which `reserved_gib` GiB are set aside. Use plain arithmetic, not `labkit.memory.capacity`. The
# checker draws devices, reserves and lengths afresh, among them a pool that holds a whole number of
# sequences exactly and one too small for a single sequence.

# %%
def fits(device_gib, reserved_gib, context_len):
    # BEGIN SOLUTION
    pool = (device_gib - reserved_gib) * 1024**3
    return int(pool // (context_len * 2 * 32 * 8 * 128 * 2))
    # END SOLUTION


from labkit.teaching import build_it

ex.check_function("Exercise 3", fits, build_it.fits_cases(),
                  forbid=[capacity.sequences_that_fit, capacity.kv_pool_bytes, capacity.cache_bytes,
                          capacity.ModelShape.cache_bytes, capacity.ModelShape.bytes_per_token],
                  hint="pool = (device - reserved) GiB in bytes; one sequence = context_len × 131,072 bytes.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** The pool is what the reservation leaves, converted from GiB to bytes; one
# sequence costs its length times the teaching model's 131,072 bytes per token (2 × 32 × 8 × 128 × 2).
# Integer division counts only whole sequences: a sequence that does not fit entirely cannot run.

# %% [markdown]
# **Exercise 4 (build it).** Write `bytes_per_token_from_config(config)`: the bytes one token adds
# to the cache of the model a `config.json` dict describes, every element in the file's `torch_dtype`
# (`"float32"` 4 bytes, `"bfloat16"` and `"float16"` 2). Two keys may be missing: without
# `num_key_value_heads` the model has one KV head per query head (no GQA); without `head_dim` it is
# `hidden_size // num_attention_heads`. When `head_dim` is there, it wins: Gemma-2-9B's is 256, not
# 3584 // 16 = 224. The checker draws configs with and without each key, in each dtype.

# %%
def bytes_per_token_from_config(config: dict) -> int:
    # BEGIN SOLUTION
    query_heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", query_heads)  # no key: one KV head per query head
    head_dim = config.get("head_dim", config["hidden_size"] // query_heads)  # no key: hidden size shared out
    element = {"float32": 4, "bfloat16": 2, "float16": 2}[config["torch_dtype"]]
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * element  # K and V, every layer
    # END SOLUTION


gemma_config = capacity.PRESET_CONFIGS["Gemma-2-9B"]  # the numbers quoted in the exercise
assert (gemma_config["head_dim"], gemma_config["hidden_size"], gemma_config["num_attention_heads"]) == (256, 3584, 16)
ex.check_function("Exercise 4", bytes_per_token_from_config, build_it.config_bytes_cases(),
                  forbid=[capacity.ModelShape.from_config, capacity.ModelShape.bytes_per_token,
                          capacity.bytes_per_token, capacity.ModelShape.cache_bytes, capacity.cache_bytes],
                  hint="config.get(key, default) for the two keys that may be missing; then 2 × L × Hkv × D × b.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** It is the formula with each factor read the way `ModelShape.from_config` reads
# it: the KV heads where the file names them (falling back to the query heads, which is plain
# multi-head attention, not the GQA mistake), `head_dim` where the file gives it (falling back to the
# hidden size shared out among the query heads), and the element size of the dtype.

# %% [markdown]
# **Quiz.** Answer with a letter or a number.
# 1. Which doubles the cache per token? (a) twice the query heads; (b) twice the KV heads;
#    (c) twice the hidden size, `head_dim` and KV heads unchanged.
# 2. A planner sizes Llama-3-8B (32 query heads, 8 KV heads) with its query heads. The sequences
#    it admits are (a) four times what fits; (b) what fits; (c) a quarter of what fits.
# 3. The teaching model on a 24 GiB device with 17 GiB set aside holds 7 sequences of 8,192 tokens.
#    On a 31 GiB device with the same 17 GiB set aside it holds (a) 9; (b) 14; (c) 7.
# 4. The teaching model's cache per token, in KiB?

# %%
# BEGIN SOLUTION
quiz = {1: "b", 2: "c", 3: "b", 4: 128}
# END SOLUTION
# BEGIN STUB
quiz = {1: None, 2: None, 3: None, 4: None}  # a letter or a number each
# END STUB
ex.quiz(quiz)

# %% [markdown]
# ## What you can now do
#
# - Compute a model's KV bytes per token from its `config.json`: layers, KV heads, head dimension
#   and dtype, with `head_dim` derived when the file does not give it.
# - Spot the GQA mistake (query heads in place of KV heads) and say by what factor it overstates.
# - Count how many sequences of a given length fit in a device's pool after weights and reserve,
#   and check a model's `max_position_embeddings` before sizing a request past it.
# - Use the explorer to ask the same of any model, dtype and device, and see what vLLM would print.

# %% [markdown]
# ## References
#
# - The source article: *长上下文推理中的 KV Cache：容量、分页与复用边界* ("The KV cache in
#   long-context inference: capacity, paging and the limits of reuse"), section 02 (the formula, the
#   teaching model, requests A, B and C, the 3 GiB reservation) and section 06 (the 24 GiB device
#   with a 7 GiB pool). The copy the book follows gives no author or link.
# - Woosuk Kwon, Zhuohan Li, et al., *Efficient Memory Management for Large Language Model Serving
#   with PagedAttention*, SOSP 2023, [arXiv:2309.06180](https://arxiv.org/abs/2309.06180): reserving
#   the maximum length up front, the waste that chapter 03 removes.
# - Joshua Ainslie et al., *GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
#   Checkpoints*, 2023, [arXiv:2305.13245](https://arxiv.org/abs/2305.13245): grouped-query attention
#   (section 4).
# - The models' `config.json` files on the Hugging Face Hub, transcribed in
#   `labkit.memory.capacity.PRESET_CONFIGS` (each preset's `source` says which fields):
#   [meta-llama/Meta-Llama-3-8B](https://huggingface.co/meta-llama/Meta-Llama-3-8B),
#   [meta-llama/Meta-Llama-3-70B](https://huggingface.co/meta-llama/Meta-Llama-3-70B),
#   [mistralai/Mistral-7B-v0.1](https://huggingface.co/mistralai/Mistral-7B-v0.1),
#   [Qwen/Qwen2.5-7B](https://huggingface.co/Qwen/Qwen2.5-7B),
#   [google/gemma-2-9b](https://huggingface.co/google/gemma-2-9b),
#   [deepseek-ai/DeepSeek-V3](https://huggingface.co/deepseek-ai/DeepSeek-V3).
# - vLLM documentation: [Conserving Memory](https://docs.vllm.ai/en/latest/configuration/conserving_memory/)
#   (what to change when the cache does not fit; the explorer's refusal points there).
# - vLLM code, read in version 0.33.0 ([github.com/vllm-project/vllm](https://github.com/vllm-project/vllm)),
#   for the explorer's "vLLM would print" lines (`labkit.vllm_bridge.predict`, appendix A2):
#   `vllm/v1/kv_cache_interface.py` (`AttentionSpec.page_size_bytes`, `MLAAttentionSpec`, `SlidingWindowSpec`),
#   `vllm/v1/core/kv_cache_planning.py` (`get_kv_cache_configs`, `_check_enough_kv_cache_memory`),
#   `vllm/v1/core/kv_cache_utils.py` (`get_max_concurrency_for_kv_cache_config`) and
#   `vllm/v1/worker/gpu_worker.py` (`Worker.determine_available_memory`).
