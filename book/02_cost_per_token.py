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
# - how real models compare, and what tensor and pipeline parallelism leave on each device;
# - how many sequences fit on a device, with an explorer you can play with.

# %%
from labkit.teaching.diagrams import roadmap

roadmap("02");  # the article's pipeline, this chapter's part highlighted

# %% [markdown]
# **You need:** chapter 01: the cache keeps one key and one value per layer, per KV head and per
# token, and several query heads can share one KV head (GQA).
#
# **Time:** about 35 minutes to read and run.

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
# The table uses the article's formula for every model (no sliding windows applied, 2-byte
# elements). DeepSeek-V3 is the exception in kind: its latent cache has no factor 2 (section 7).
# Each model was also built for a longest context, its `config.json`'s `max_position_embeddings`:
# 8,192 tokens for Llama-3 and Gemma-2, far more for others. The formula would give bytes for any
# length, but a request longer than the model's limit is not one it can serve, so the last column
# takes each model at its own limit (the teaching model has none; "-" in the table).

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
# ## 6. Split across devices
#
# A model too big for one device is split. The cache follows the split:
#
# - **tensor parallelism** (TP) gives each device a share of the attention heads, and with them
#   a share of the KV heads. When there are more devices than KV heads, a head cannot be cut:
#   each device keeps one whole KV head, and heads are *replicated*. Either way the numbers must
#   divide: the devices divide the KV heads, or the KV heads divide the devices. vLLM builds its
#   K and V projections that way (`vllm/model_executor/layers/linear.py: QKVParallelLinear`) and
#   refuses to start otherwise, so 8 KV heads on 5 devices are refused, here as there
#   (`capacity.kv_heads_per_device`, the one rule both this chapter and chapter 06 use);
# - **pipeline parallelism** (PP) gives each device (stage) a range of layers, and the cache of
#   only those layers. When the layers do not divide evenly, vLLM gives the extra layers to the
#   stages *before* the last (`vllm/distributed/utils.py: get_pp_indices`), and so does
#   `capacity.pipeline_stages`: 61 layers on 4 stages are 15, 15, 16, 15.
#
# `capacity.shard` returns the busiest device's share as a `ModelShape`, so the same formula
# applies per device. Llama-3-70B has 8 KV heads and 80 layers:

# %%
# NBVAL_CHECK_OUTPUT
big = PRESETS["Llama-3-70B"]
print(f"{'TP':>3}{'PP':>4}{'devices':>9}{'KV heads/dev':>14}{'layers/dev':>12}{'per token/dev':>15}{'all devices':>13}")
per_device = {}
for tp, pp in [(1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (1, 2), (1, 4), (8, 2)]:
    dev = capacity.shard(big, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    per_device[tp, pp] = dev.bytes_per_token()
    print(f"{tp:>3}{pp:>4}{tp * pp:>9}{dev.num_kv_heads:>14}{dev.num_layers:>12}"
          f"{format_bytes(dev.bytes_per_token()):>15}{format_bytes(tp * pp * dev.bytes_per_token()):>13}")
assert per_device[8, 1] == big.bytes_per_token() // 8
assert per_device[16, 1] == per_device[8, 1]  # 16 devices, 8 KV heads: each head lives on 2 devices
assert per_device[1, 4] == big.bytes_per_token() // 4
for tp in [1, 2, 4, 8]:  # only divided: the total stays at the model's per-token cost
    assert tp * per_device[tp, 1] == big.bytes_per_token() == 320 * KiB
assert per_device[16, 1] == 40 * KiB and 16 * per_device[16, 1] == 2 * big.bytes_per_token() == 640 * KiB
assert [len(s) for s in capacity.pipeline_stages(61, 4)] == [15, 15, 16, 15]
try:
    capacity.shard(big, tensor_parallel_size=5)  # 8 KV heads on 5 devices: neither divides the other
except ValueError as refusal:
    print(f"\nTP=5: ValueError: {refusal}")

# %% [markdown]
# Read the last column. Up to TP=8 the total over all devices stays at the model's per-token cost:
# the cache is only divided. At TP=16 each device holds as much as at TP=8, and the total doubles:
# the replication is real memory. The same happens to a latent MLA cache (next section), which has
# a single "head" and is therefore kept whole on every TP device.

# %% [markdown]
# ## 7. Beyond the article: quantized, windowed and latent caches
#
# The article's formula assumes an unquantized cache and no sliding window, and that every
# layer stores separate K and V. Three common departures, each a small change to the formula:
#
# **An 8-bit cache** (e.g. vLLM's `kv_cache_dtype="fp8"`) halves `b`. With vLLM's plain `"fp8"`
# the scales are *per tensor*: one for K and one for V in each layer, a few bytes per layer, left
# out here. Its per-token-head variants (`"fp8_per_token_head"`, `"int8_per_token_head"`) store two
# 4-byte scales with every head of every token instead: 264 bytes per head and token where 256
# hold the data, for a head dimension of 128 (`labkit.vllm_bridge.predict.page_size_bytes` counts them).
# [Appendix A3](A3_fewer_bytes_per_element.ipynb) builds fp8, int8 and int4 caches and measures what
# they cost on the real model.

# %%
fp8 = TEACHING_MODEL.with_dtype("fp8")
print(f"teaching model, 8-bit cache: {format_bytes(fp8.bytes_per_token())} per token, "
      f"request A {format_bytes(fp8.cache_bytes(8192))}")
assert 2 * fp8.cache_bytes(8192) == TEACHING_MODEL.cache_bytes(8192)
from labkit.vllm_bridge import predict
assert predict.page_size_bytes(TEACHING_MODEL, 1, "fp8_per_token_head") == 8 * 264  # 8 KV heads, 1 token
assert predict.page_size_bytes(TEACHING_MODEL, 1, "fp8") == 8 * 256

# %% [markdown]
# **Sliding-window layers** attend only to the last W tokens, so they need to keep only W.
# Mistral-7B-v0.1 uses a window in every layer; Gemma-2-9B alternates local (windowed) layers
# with global ones. Past the window, their caches stop growing, or grow at half the rate. Each
# model is taken at its window and at its own context limit:

# %%
# NBVAL_CHECK_OUTPUT
for name in ["Mistral-7B-v0.1", "Gemma-2-9B"]:
    p = PRESETS[name]
    print(f"{name}: window {p.sliding_window:,} tokens in {len(p.sliding_layers)} of {p.num_layers} layers, "
          f"max_position_embeddings {p.max_position_embeddings:,}")
    for length in [p.sliding_window, p.max_position_embeddings]:
        print(f"  {length:>7,} tokens: {format_bytes(p.cache_bytes(length, apply_window=False)):>10} "
              f"plain formula, {format_bytes(p.cache_bytes(length)):>10} with the window")
mistral, gemma = PRESETS["Mistral-7B-v0.1"], PRESETS["Gemma-2-9B"]
assert mistral.cache_bytes(mistral.max_position_embeddings) == mistral.cache_bytes(mistral.sliding_window)
assert 2 * len(gemma.sliding_layers) == gemma.num_layers  # half the layers are local
growth = gemma.cache_bytes(gemma.max_position_embeddings) - gemma.cache_bytes(gemma.sliding_window)
assert 2 * growth == gemma.cache_bytes(gemma.max_position_embeddings, apply_window=False) - gemma.cache_bytes(
    gemma.sliding_window, apply_window=False)  # past the window: half the rate

# %% [markdown]
# **A latent cache.** DeepSeek-V3's multi-head latent attention (MLA) stores, per token and layer,
# one compressed vector (`kv_lora_rank` elements) plus a small key for the rotary position part
# (`qk_rope_head_dim` elements), shared by all its query heads. There is no separate K and V, so no
# factor 2. Had it cached a full K (`qk_nope_head_dim + qk_rope_head_dim` elements) and V
# (`v_head_dim` elements) for every head, as plain multi-head attention does, each token would
# cost dozens of times as much. All the numbers come from its `config.json` excerpt:

# %%
# NBVAL_CHECK_OUTPUT
mla, ds = PRESETS["DeepSeek-V3"], capacity.PRESET_CONFIGS["DeepSeek-V3"]
layers, heads, b = ds["num_hidden_layers"], ds["num_attention_heads"], mla.dtype_bytes
latent_dim = ds["kv_lora_rank"] + ds["qk_rope_head_dim"]
k_dim, v_dim = ds["qk_nope_head_dim"] + ds["qk_rope_head_dim"], ds["v_head_dim"]
full_mha = layers * heads * (k_dim + v_dim) * b  # layers x heads x (K dims + V dims) x bytes
print(f"latent: {ds['kv_lora_rank']} + {ds['qk_rope_head_dim']} = {latent_dim} elements per token and layer, "
      f"{layers} layers")
print(f"DeepSeek-V3 latent cache: {mla.bytes_per_token():,} bytes = {format_bytes(mla.bytes_per_token())} per token")
print(f"full K ({k_dim} dims) and V ({v_dim} dims) for {heads} heads: {format_bytes(full_mha)} per token, "
      f"{full_mha / mla.bytes_per_token():.0f}x more")
assert mla.bytes_per_token() == layers * latent_dim * b  # no factor 2
assert capacity.shard(mla, tensor_parallel_size=8).bytes_per_token() == mla.bytes_per_token()  # replicated

# %% [markdown]
# ## 8. From bytes to capacity
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
# your request count as a dashed line. (The explorer applies the article's formula: no windows.)
# Below the table, **vLLM would print** the two start-up lines vLLM computes for the same device
# (`labkit.vllm_bridge.predict`, chapter 06): the pool is device × `gpu_memory_utilization` (its own slider) −
# set aside, cut into 16-token blocks (a utilization of 1.0 is the article's idealised device: a
# real GPU refuses it, as chapter 06 explains), with `max_model_len` = the context length. For
# Mistral and Gemma 2 it budgets the windows as vLLM does, so its concurrency differs from
# "sequences that fit"; when one request would not fit, it shows vLLM's refusal instead.
# Lengths past the preset's `max_position_embeddings` get a warning, and the plot draws them dotted;
# vLLM refuses such a `max_model_len` outright (chapter 06), and the box says so.
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
# one such device, and section 6 showed how their caches split over several. For each model, the
# bars count the sequences of 8,192 tokens (within every one of these models' context limits) that
# fit in the pool: by the article's formula, and with the model's sliding window applied as in
# section 7.

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
fit_window = {n: capacity.sequences_that_fit(PRESETS[n].cache_bytes(context), device, set_aside)
              for n in billions_in_name}
print(f"KV pool: {format_bytes(device)} - {format_bytes(set_aside)} = {format_bytes(pool)}; "
      f"sequences of {context:,} tokens that fit:")
print(f"{'model':17}{'per sequence':>14}{'fit':>6}{'with window':>13}")
for n in billions_in_name:
    print(f"{n:17}{format_bytes(PRESETS[n].cache_bytes(context, apply_window=False)):>14}{fit_formula[n]:>6}"
          f"{fit_window[n]:>13}")
assert fit_formula == {"Qwen2.5-7B": 137, "Mistral-7B-v0.1": 60, "Llama-3-8B": 60, "Gemma-2-9B": 22}
assert fit_window == {"Qwen2.5-7B": 137, "Mistral-7B-v0.1": 120, "Llama-3-8B": 60, "Gemma-2-9B": 30}
assert fit_window["Mistral-7B-v0.1"] == 2 * fit_formula["Mistral-7B-v0.1"]  # the window halves its 8K cache

# %%
names = sorted(billions_in_name, key=fit_formula.get)
rows = range(len(names))
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.barh([r + 0.2 for r in rows], [fit_formula[n] for n in names], height=0.4, color="C0",
        label="article's formula (no window)")
ax.barh([r - 0.2 for r in rows], [fit_window[n] for n in names], height=0.4, color="C1",
        label="with the model's sliding window")
for r, n in zip(rows, names):
    ax.text(fit_formula[n], r + 0.2, f" {fit_formula[n]}", va="center", fontsize="small")
    ax.text(fit_window[n], r - 0.2, f" {fit_window[n]}", va="center", fontsize="small")
ax.set_yticks(list(rows), [f"{n}\n{format_bytes(PRESETS[n].bytes_per_token())}/token" for n in names])
ax.set_xlabel(f"sequences of {context:,} tokens that fit")
ax.set_xlim(0, 1.25 * max(fit_window.values()))
ax.set_title(f"One {format_bytes(pool)} pool ({format_bytes(device)} device): "
             f"{min(fit_formula.values())} to {max(fit_formula.values())} sequences of {context:,} tokens")
ax.legend(loc="lower right", fontsize="small")
fig.tight_layout()
plt.show()

# %% [markdown]
# The same pool holds 22 sequences of Gemma-2-9B and 137 of Qwen2.5-7B: the bytes per token, not
# the size of the model, decide how many conversations a device can keep. Sliding windows change
# the count only for the models that have them: Mistral-7B's window of 4,096 tokens halves each
# 8,192-token cache and doubles what fits (60 to 120), and Gemma-2-9B's windowed half of the layers
# takes it from 22 to 30. (The article's own example, seven 8,192-token sequences of the teaching model in
# a 7 GiB pool on a 24 GiB device, is the explorer's starting setting.)

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
# - Use KV heads, not query heads: the mistake overstates the cache by the GQA group size.
# - Tensor parallelism divides the KV heads until there is one per device, then replicates them;
#   pipeline parallelism divides the layers.
# - Beyond the article, 8-bit caches halve the bytes, sliding windows cap the length per layer,
#   and a latent MLA cache drops the factor 2 and the per-head copies.
# - A model's `max_position_embeddings` bounds the requests worth sizing: the formula gives bytes
#   for any length, not the model's ability to serve it.
# - In one 60 GiB pool, from 22 (Gemma-2-9B) to 137 (Qwen2.5-7B) sequences of 8,192 tokens fit:
#   bytes per token, not model size, set the count.
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
# of which `reserved_gib` GiB are set aside. Use plain arithmetic, not `labkit.memory.capacity`.

# %%
def fits(device_gib, reserved_gib, context_len):
    # BEGIN SOLUTION
    pool = (device_gib - reserved_gib) * 1024**3
    return int(pool // (context_len * 2 * 32 * 8 * 128 * 2))
    # END SOLUTION


def expected_fits(device_gib, reserved_gib, context_len):
    return capacity.sequences_that_fit(TEACHING_MODEL.cache_bytes(context_len), device_gib * GiB, reserved_gib * GiB)


ex.check_function("Exercise 3", fits, [((d, r, t), expected_fits(d, r, t))
                                       for d, r, t in [(24, 17, 8192), (80, 20, 131072), (80, 20, 5000), (141, 16.5, 32768)]],
                  forbid=[capacity.sequences_that_fit, capacity.kv_pool_bytes, capacity.cache_bytes,
                          capacity.ModelShape.cache_bytes, capacity.ModelShape.bytes_per_token],
                  hint="pool = (device - reserved) GiB in bytes; one sequence = context_len × 131,072 bytes.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** The pool is what the reservation leaves, converted from GiB to bytes; one
# sequence costs its length times the teaching model's 131,072 bytes per token (2 × 32 × 8 × 128 × 2).
# Integer division counts only whole sequences: a sequence that does not fit entirely cannot run.

# %% [markdown]
# **Exercise 4.** Gemma-2-9B runs with tensor parallelism over 16 devices. It has 8 KV heads.
# How many bytes per token does each device's cache hold? (Think about what happens to a KV head
# when there are more devices than heads.)

# %%
# BEGIN SOLUTION
answer_4 = 2 * 42 * 1 * 256 * 2
# END SOLUTION
# BEGIN STUB
answer_4 = None  # replace None with your expression
# END STUB
assert PRESETS["Gemma-2-9B"].num_kv_heads == 8  # as the exercise says
ex.check("Exercise 4", answer_4, hint="each device keeps one whole KV head of every layer")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** A KV head cannot be cut in two: with 16 devices and 8 KV heads, each head is
# copied onto 2 devices, so every device holds exactly 1 KV head of each of Gemma-2-9B's 42 layers,
# with `head_dim` 256 in bf16. Past the KV-head count, more devices stop shrinking the per-device cache.

# %% [markdown]
# **Exercise 5 (build it).** Write `sequence_bytes(shape, length)`: the cache of one sequence of
# `length` tokens for a `ModelShape` whose `sliding_layers` keep at most `sliding_window` tokens and
# whose `latent` cache stores one vector per token and layer (no factor 2), from its fields alone.
# The checker draws plain, windowed and latent models at lengths 0, 1, the window and one over it.

# %%
def sequence_bytes(shape: capacity.ModelShape, length: int) -> int:
    # BEGIN SOLUTION
    factor = 1 if shape.latent else 2  # K and V, or one latent vector
    per_layer = factor * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes  # one token, one layer
    windowed = len(shape.sliding_layers)
    kept = min(length, shape.sliding_window) if windowed else length  # a window layer keeps the last W
    return ((shape.num_layers - windowed) * length + windowed * kept) * per_layer
    # END SOLUTION


from labkit.teaching import build_it

ex.check_function("Exercise 5", sequence_bytes, build_it.sequence_bytes_cases(),
                  forbid=[capacity.ModelShape.cache_bytes, capacity.ModelShape.bytes_per_token,
                          capacity.ModelShape.bytes_per_token_per_layer, capacity.ModelShape.kv_factor,
                          capacity.ModelShape.block_bytes, capacity.bytes_per_token, capacity.cache_bytes],
                  hint="window layers keep min(length, window) tokens; the others keep all; latent: factor 1.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** It is `labkit/memory/capacity.py: ModelShape.cache_bytes` with `kv_factor` and
# `bytes_per_token_per_layer` written out: each layer's bytes per token times the tokens it keeps.

# %% [markdown]
# **Quiz.** Answer with a letter or a number.
# 1. Which doubles the cache per token? (a) twice the query heads; (b) twice the KV heads;
#    (c) twice the hidden size, `head_dim` and KV heads unchanged.
# 2. 8 KV heads on 16 devices instead of 8: the cache per device (a) halves; (b) stays; (c) doubles.
# 3. An 8-bit cache instead of bf16: the sequences a pool holds (a) double; (b) stay; (c) halve.
# 4. The teaching model's cache per token, in KiB?

# %%
# BEGIN SOLUTION
quiz = {1: "b", 2: "b", 3: "a", 4: 128}
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
# - Count how many sequences of a given length fit in a device's pool after weights and reserve.
# - Work out the per-device cache under tensor and pipeline parallelism, including when KV heads are
#   replicated.
# - Say what an 8-bit cache, a sliding window or a latent (MLA) cache changes in the formula.

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
# - DeepSeek-AI, *DeepSeek-V3 Technical Report*, 2024, [arXiv:2412.19437](https://arxiv.org/abs/2412.19437):
#   multi-head latent attention (section 7).
# - The models' `config.json` files on the Hugging Face Hub, transcribed in
#   `labkit.memory.capacity.PRESET_CONFIGS` (each preset's `source` says which fields):
#   [meta-llama/Meta-Llama-3-8B](https://huggingface.co/meta-llama/Meta-Llama-3-8B),
#   [meta-llama/Meta-Llama-3-70B](https://huggingface.co/meta-llama/Meta-Llama-3-70B),
#   [mistralai/Mistral-7B-v0.1](https://huggingface.co/mistralai/Mistral-7B-v0.1),
#   [Qwen/Qwen2.5-7B](https://huggingface.co/Qwen/Qwen2.5-7B),
#   [google/gemma-2-9b](https://huggingface.co/google/gemma-2-9b),
#   [deepseek-ai/DeepSeek-V3](https://huggingface.co/deepseek-ai/DeepSeek-V3).
# - vLLM documentation: [Quantized KV Cache](https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache/)
#   (`kv_cache_dtype="fp8"`, per-tensor scales; section 7) and
#   [Conserving Memory](https://docs.vllm.ai/en/latest/configuration/conserving_memory/) (what to
#   change when the cache does not fit; the explorer's refusal points there).
# - vLLM code, read in version 0.33.0 ([github.com/vllm-project/vllm](https://github.com/vllm-project/vllm)):
#   `vllm/distributed/utils.py: get_pp_indices` (pipeline stages, section 6); for the explorer's
#   "vLLM would print" lines (`labkit.vllm_bridge.predict`, chapter 06): `vllm/v1/kv_cache_interface.py`
#   (`AttentionSpec.page_size_bytes`, `MLAAttentionSpec`, `SlidingWindowSpec`),
#   `vllm/v1/core/kv_cache_planning.py` (`get_kv_cache_configs`, `_check_enough_kv_cache_memory`),
#   `vllm/v1/core/kv_cache_utils.py` (`get_max_concurrency_for_kv_cache_config`) and
#   `vllm/v1/worker/gpu_worker.py` (`Worker.determine_available_memory`).
