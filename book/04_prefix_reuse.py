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
# # 04 · Which prefixes can be shared
#
# **The message.** Requests may share the cached K/V of a common prefix only when everything that
# computed them is identical (every earlier token, the positions, the model, the cache's format),
# and then sharing saves prefill work and memory without changing one output token.
#
# A research assistant reads one long report, then answers many questions about it. Every one of
# those requests starts with the same thousands of tokens. Chapter 03 put each sequence's keys and
# values in blocks of a shared pool; this chapter lets several sequences point at the *same*
# blocks, computes the common prefix once, and proves that the answers do not change.
#
# **What you will learn**
#
# - why the K/V of a prefix can be reused, and exactly when they cannot (a *computation* must be
#   identical, not just the text);
# - how a serving engine names a block: a hash chain over the parent block, the block's tokens and
#   the settings that change the numbers;
# - reference counts, copy-on-write of a shared tail block, and least-recently-used eviction of
#   blocks that finished requests leave behind;
# - that a decoder prefilling only the uncached suffix produces the same tokens and logits;
# - what reuse saves (prefill work and memory) and what it does not (decode steps).
# - why a real chat model's shared system prompt hits the cache, and why one extra space in it does not.

# %%
from labkit.teaching.diagrams import roadmap

roadmap("04");  # the article's pipeline, this chapter's part highlighted

# %% [markdown]
# **You need:** chapter 03: blocks, block tables and the block allocator; chapter 01: causal
# attention, and the real model (SmolLM2-135M-Instruct) with its chat template.
#
# **Time:** about 40 minutes to read and run; about 75 minutes for the exercises.

# %%
import zlib

import matplotlib.pyplot as plt
import torch

import labkit
from labkit.caches.contiguous import generate
from labkit.caches.prefix_cached import PrefixCachedPool, generate_with_prefix_cache
from labkit.memory import capacity
from labkit.memory.paging import BlockAllocator
from labkit.memory.prefix import CacheKey, PrefixCache, block_hash, hash_chain
from labkit.model.decoder import Decoder, DecoderConfig
from labkit.units import GiB, format_bytes

torch.set_num_threads(2)
print(labkit.describe())

# %% [markdown]
# ## Why a prefix can be reused at all
#
# Attention is causal: position `i` sees only positions `0..i`. So the keys and values of a prompt's
# first 4,096 tokens depend on those tokens and on the model, and on nothing after them. Two requests
# that begin with the same report produce the same K/V for it, bit for bit, whatever questions
# follow. Compute them once, keep the blocks, and point the second request's block table at them:
# that is *prefix caching* (vLLM's automatic prefix caching, SGLang's RadixAttention).
#
# The same argument says what may **not** be shared: the K/V at position `i` depend on *every*
# earlier token, on the weights (and any adapter), on the position encoding and on how the cache
# stores numbers. Equal-looking text is not enough.

# %% [markdown]
# ## Naming a block: the hash chain
#
# Only *full* blocks are shared. Block `i` of a prompt is named after three things:
#
# ```
# hash_i = SHA-256(hash_{i-1}, token ids of block i, extra keys)
# ```
#
# The parent hash makes the name stand for the *whole* prefix up to the block's end. The extra keys
# (`CacheKey`) carry everything else that changes the numbers: model, adapter, cache dtype and
# layout, RoPE settings, the attention rule, and an optional salt that keeps tenants apart.

# %%
# NBVAL_CHECK_OUTPUT
block_size = 4
key = CacheKey()
prompt = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6]
chain = hash_chain(prompt, block_size, key)
print(f"{len(prompt)} tokens, block size {block_size}: {len(chain)} full blocks get names "
      f"(the last {len(prompt) % block_size} tokens do not)")
for i, h in enumerate(chain):
    print(f"  block {i}: tokens {prompt[i * block_size:(i + 1) * block_size]} -> {h[:16]}...")

edited = [0] + prompt[1:]  # change only the first token
edited_chain = hash_chain(edited, block_size, key)
print("names that change when only token 0 changes:", [a != b for a, b in zip(chain, edited_chain)])
assert all(a != b for a, b in zip(chain, edited_chain))
assert chain[0] == block_hash(None, prompt[:4], key) and chain[1] == block_hash(chain[0], prompt[4:8], key)
assert hash_chain(prompt, block_size, CacheKey(rope_theta=10000)) == chain  # 10000 and 10000.0: one key

# %% [markdown]
# Changing token 0 renames every later block too, though block 1 holds the same tokens as before:
# its K/V were computed after a different token 0. In `labkit.memory.prefix` the chain is one
# loop over the full blocks, each name made from the one before (after any names the caller holds,
# `block_hashes`: a waiting request keeps its chain, as vLLM keeps `Request.block_hashes` in
# `vllm/v1/request.py`):

# %%
from labkit.teaching.excerpts import excerpt

excerpt(hash_chain, "parent = hashes[-1]", "hashes.append(parent)")

# %% [markdown]
# ## The article's figure: two long requests sharing half their tokens
#
# With the teaching model of chapter 02 a token costs 128 KiB and a 16-token block 2 MiB. Requests
# A and B, of 8,192 tokens each, share their first 4,096 (a report) and differ after that (their
# questions and answers). We run the real `PrefixCache` bookkeeping on a pool of 16-token blocks
# (without tensors, which would take gigabytes) and count the blocks the pool holds.

# %%
# NBVAL_CHECK_OUTPUT
shape = capacity.TEACHING_MODEL
block_bytes = 16 * capacity.bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes)
report_tokens = list(range(4096))
request_a = report_tokens + [100_000 + i for i in range(4096)]
request_b = report_tokens + [200_000 + i for i in range(4096)]


def blocks_held(share: bool) -> tuple[int, int, PrefixCache]:
    """Prefill A, then B, on a fresh 16-token pool; return (blocks used, B's cached tokens)."""
    cache = PrefixCache(BlockAllocator(1024), block_size=16)
    table_a, _ = cache.allocate(request_a)
    if share:
        cache.cache_full_blocks(table_a)  # name A's full blocks (an engine does it as it allocates them)
    table_b, hit = cache.allocate(request_b)
    return cache.allocator.num_used, hit, cache


used_without, _, _ = blocks_held(share=False)
used_with, hit_b, cache_ab = blocks_held(share=True)
shared = sum(1 for b in range(1024) if cache_ab.allocator.ref_counts[b] == 2)
private = used_with - shared
print(f"block: 16 tokens = {format_bytes(block_bytes)}")
print(f"without sharing : {used_without} blocks = {format_bytes(used_without * block_bytes, 'GiB')}")
print(f"with sharing    : {used_with} blocks = {format_bytes(used_with * block_bytes, 'GiB')}")
print(f"  shared prefix : {shared} blocks (reference count 2) = {format_bytes(shared * block_bytes, 'GiB')}")
print(f"  two suffixes  : {private} blocks = 2 x {format_bytes(private // 2 * block_bytes, 'GiB')}")
print(f"B found {hit_b:,} of its {len(request_b):,} prompt tokens in the cache")
assert used_without * block_bytes == 2 * GiB and used_with * block_bytes == 1.5 * GiB
assert shared * block_bytes == 0.5 * GiB and private * block_bytes == GiB and hit_b == 4096

# %% [markdown]
# 2 GiB become 1.5 GiB: one copy of the report, two private suffixes. `allocate` does it for each new
# prompt: find the hit, count the blocks the rest needs (refusing, all or nothing, when the pool is
# short), then share the hit's blocks and append fresh ones for the rest:

# %%
excerpt(PrefixCache.allocate, "m = self.match(tokens, key) if lookup", "self._append(table, tokens[")

# %% [markdown]
# Sharing is a reference count. A hit block that a table holds gets one more reference; a cached
# block that no one holds any more is taken back out of the free queue (*revived*):

# %%
excerpt(PrefixCache.share, "for b in hit.block_ids:", "self.allocator.incref(b) if")

# %% [markdown]
# Before it admits a request, an engine must know whether its blocks fit: `match` finds the hit,
# and `hit_extra_blocks` counts what the rest takes from the free pool. A third request on the
# same report:

# %%
# NBVAL_CHECK_OUTPUT
request_3 = report_tokens + [300_000 + i for i in range(4096)]
hit_3 = cache_ab.match(request_3)
needed_3 = cache_ab.hit_extra_blocks(hit_3, len(request_3) - hit_3.num_cached_tokens)
empty = PrefixCache(BlockAllocator(1024), block_size=16)
alone = empty.hit_extra_blocks(empty.match(request_3), len(request_3))
print(f"a third request on the same report needs {needed_3} free blocks ({format_bytes(needed_3 * block_bytes)}); "
      f"on an empty cache {alone} ({format_bytes(alone * block_bytes)})")
assert needed_3 == 256 and alone == 512

# %% [markdown]
# One rule caps every hit. Prefill must end by running the model on the *last* prompt token, whose
# logits give the first output token, and a cached block holds K and V, not logits. So `match` looks
# up only the full blocks among the first `len - 1` tokens, each verified against its parent entry,
# and the first miss ends the hit (vLLM 0.33.0 does the same: `max_cache_hit_length =
# request.num_tokens - 1` in `KVCacheManager.get_computed_blocks`):

# %%
excerpt(PrefixCache.match, "for i in range((len(tokens) - 1) // bs)", "entries.append")

# %% [markdown]
# Ask the cache for request A again, all 512 of its blocks cached:

# %%
# NBVAL_CHECK_OUTPUT
again = cache_ab.match(request_a).num_cached_tokens
longer = cache_ab.match(request_a + [7]).num_cached_tokens
print(f"A again ({len(request_a):,} tokens, all cached): hit {again:,} tokens, {len(request_a) - again} to compute")
print(f"A plus one more token ({len(request_a) + 1:,} tokens): hit {longer:,} tokens, {len(request_a) + 1 - longer} to compute")
assert again == (len(request_a) - 1) // 16 * 16 == 8176 and longer == len(request_a)

# %% [markdown]
# The identical prompt recomputes its last block, 16 tokens, for one token's logits; with one more
# prompt token all 512 blocks hit. (vLLM's comment at that line names computing only the final token
# as a possible improvement.)

# %% [markdown]
# ## A picture: block tables pointing at shared blocks
#
# The step-through story further down runs a small scenario on a real `PrefixCache` with 4-token
# blocks and an 8-block pool. Its step 3: A and B asked different questions about the same 8-token
# report, and A' is a second sample forked from A. The top row is the pool (the number is each
# block's reference count, orange = shared); each row below is a block table, with a line from each
# logical block to its physical block.

# %%
from labkit.teaching.widgets.prefix_stepper import PrefixStepper, draw_snapshot, static_figure, story

snaps = story()
fig, ax = plt.subplots(figsize=(7, 3.5))
draw_snapshot(ax, snaps[3], title="Three sequences, one copy of the report: blocks 0 and 1 have 3 references")
plt.show()
assert snaps[3].ref_counts[:3] == (3, 3, 2)

# %% [markdown]
# ## Proof, not assertion: the same answers with and without reuse
#
# Now with tensors. `PrefixCachedPool` keeps a paged K/V pool per layer (chapter 03) and lets a
# `PrefixCache` manage its blocks: for a new request it looks up the cached prefix, and the decoder
# runs **only on the remaining tokens**, which attend over the cached prefix and themselves. We
# write a short "report", turn words into token ids with a toy tokenizer, and ask four questions
# about it, each three ways: with reuse, with reuse off (no block ever named), and with chapter 01's
# contiguous cache.

# %%
tiny = DecoderConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = Decoder.random(tiny, seed=0)


def encode(text: str) -> list[int]:
    """A toy tokenizer: one token per word, the id a checksum of the word."""
    return [zlib.crc32(word.encode()) % tiny.vocab_size for word in text.lower().split()]


report = encode("quarterly report : revenue rose twelve percent while costs fell and the new plant opened "
                "in march ; margins improved in every region except the north where demand was flat")
questions = [encode(q) for q in ("question : why did margins improve ?",
                                 "question : which region lagged ?",
                                 "question : when did the plant open ?",
                                 "question : summarise the report in one line")]
print(f"report: {len(report)} tokens; questions: {[len(q) for q in questions]} tokens")

# %%
# NBVAL_CHECK_OUTPUT
proof_block_size, max_new_tokens = 4, 3
with_reuse = PrefixCachedPool(tiny, num_blocks=64, block_size=proof_block_size, reuse=True)
without_reuse = PrefixCachedPool(tiny, num_blocks=64, block_size=proof_block_size, reuse=False)
results = []
print("request  prompt  cached  prefilled  decode steps  tokens (reuse / off / contiguous)   same")
for r, question in enumerate(questions):
    prompt = report + question
    on = generate_with_prefix_cache(model, with_reuse, prompt, max_new_tokens)
    off = generate_with_prefix_cache(model, without_reuse, prompt, max_new_tokens)
    plain = generate(model, prompt, max_new_tokens)
    same = on.tokens == off.tokens == plain.tokens
    results.append((on, off, plain))
    print(f"{r:>7}  {len(prompt):>6}  {on.num_cached_tokens:>6}  {on.num_prefill_tokens:>9}  "
          f"{on.num_decode_steps:>12}  {on.tokens} / {off.tokens} / {plain.tokens}   {same}")
    assert same
max_diff = max(float((on.logits - off.logits).abs().max()) for on, off, _ in results)
max_diff_plain = max(float((on.logits - plain.logits).abs().max()) for on, _, plain in results)
print(f"largest |logit difference|: reuse vs off below 1e-4: {max_diff < 1e-4}; "
      f"reuse vs contiguous below 1e-4: {max_diff_plain < 1e-4}")
assert max_diff < 1e-4 and max_diff_plain < 1e-4
assert results[0][0].num_cached_tokens == 0


def common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


for r in range(1, len(questions)):  # what each request could reuse: full blocks of its common prefix with request 0
    common = common_prefix_len(report + questions[0], report + questions[r])
    assert results[r][0].num_cached_tokens == common // proof_block_size * proof_block_size

# %% [markdown]
# The first request finds nothing and names its full blocks; the next three find the blocks of the
# report (and of "question :", which every question begins with) and prefill only the rest. The
# tokens agree three ways and the logits to float32 rounding: the cached K/V *are* the K/V the model
# would compute.
#
# ## What reuse saves, and what it does not
#
# Reuse skips **prefill** work for the cached tokens, and their memory. It does nothing for
# **decode**: every output token is still one forward pass that reads the whole history.

# %%
# NBVAL_CHECK_OUTPUT
prefill_on = [on.num_prefill_tokens for on, _, _ in results]
prefill_off = [off.num_prefill_tokens for _, off, _ in results]
decode_on = [on.num_decode_steps for on, _, _ in results]
decode_off = [off.num_decode_steps for _, off, _ in results]
print(f"prefill tokens computed: {sum(prefill_on)} with reuse, {sum(prefill_off)} without "
      f"({1 - sum(prefill_on) / sum(prefill_off):.0%} skipped)")
print(f"decode steps           : {sum(decode_on)} with reuse, {sum(decode_off)} without")
print(f"prefix-cache hit rate  : {with_reuse.prefix.stats.hit_rate:.0%} of prompt tokens")
assert decode_on == decode_off and sum(prefill_on) < sum(prefill_off)

fig, ax = plt.subplots(figsize=(6, 3.4))
x = torch.arange(len(results)).numpy()
ax.bar(x - 0.2, prefill_off, width=0.4, label="reuse off")
ax.bar(x + 0.2, prefill_on, width=0.4, label="reuse on")
ax.set_xlabel("request")
ax.set_ylabel("prefill tokens computed")
ax.set_xticks(x)
ax.set_ylim(0, max(prefill_off + prefill_on) * 1.35)
ax.yaxis.set_major_locator(plt.MaxNLocator(integer=True))
ax.legend(ncol=2, loc="upper center", fontsize=8)
ax.set_title(f"Reuse removes prefill work for the shared report\n(decode steps: {sum(decode_off)} either way)",
             fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## When reuse must not happen
#
# Each case below reaches the same lookup, and each must miss. First the reason, measured on the
# model: take the question after the report, and after the report with only its first word changed
# (same length, so every question token keeps its position). Layer 0 computes keys from each token
# and its position alone, so there they agree exactly; from layer 1 on, attention has mixed the
# earlier tokens into every hidden state, and the keys differ.

# %%
def stored_keys(prompt: list[int]) -> list[torch.Tensor]:
    """The keys every layer stores for ``prompt`` (a contiguous cache, no reuse involved)."""
    from labkit.caches.contiguous import KVCache

    kv = KVCache(tiny)
    with torch.no_grad():
        model(torch.tensor([prompt]), cache=kv)
    return [k[0] for k in kv.k]


text = questions[0]
edited_report = encode("annual") + report[1:]
assert len(edited_report) == len(report) and edited_report != report
after_report = stored_keys(report + text)
after_edited = stored_keys(edited_report + text)
diffs = [float((a[-len(text):] - b[-len(text):]).abs().max()) for a, b in zip(after_report, after_edited)]
for layer, d in enumerate(diffs):
    print(f"layer {layer}: largest difference in the question's keys = {d:.3f}")
assert diffs[0] == 0.0 and all(d > 0.1 for d in diffs[1:])

# %% [markdown]
# The position is a reuse condition of its own. Keep the report and move the question four tokens
# later: even in layer 0 its keys change, because RoPE rotates each key by an angle proportional to
# its position. The rotation keeps each key's length, so the check finds equal norms and different
# vectors. A block's K/V are valid only where they were computed, which the hash chain guarantees,
# since a block's name covers every token before it.

# %%
shifted = stored_keys(report + encode("please answer this :") + text)
here, there = after_report[0][-len(text):], shifted[0][-len(text):]
print(f"layer 0, the question 4 positions later: largest key difference {float((here - there).abs().max()):.3f}, "
      f"largest difference in key norms {float((here.norm(dim=-1) - there.norm(dim=-1)).abs().max()):.1e}")
assert len(encode("please answer this :")) == 4
assert float((here - there).abs().max()) > 0.1
assert torch.allclose(here.norm(dim=-1), there.norm(dim=-1), atol=1e-5)

# %% [markdown]
# Now the four cases, on one `PrefixCache` that has seen the report followed by a question:
#
# 1. the report's text after a different earlier prefix (a changed system prompt or template);
# 2. a request served with a different adapter (LoRA);
# 3. a pool that stores K/V in another dtype (bfloat16 instead of float32);
# 4. a prompt whose shared part is shorter than one block: with 16-token blocks, a 12-token
#    shared prefix gives a 0% hit rate, a common surprise for engine users.

# %%
# NBVAL_CHECK_OUTPUT
base = with_reuse.key()  # model, float32 pool, NHD layout, RoPE base, causal attention
bf16_pool = PrefixCachedPool(tiny, num_blocks=4, block_size=4, dtype=torch.bfloat16)
print("extra keys of the float32 pool:", base)
cache = PrefixCache(BlockAllocator(64), block_size=4)
seen, _ = cache.allocate(report + questions[0], base)
cache.cache_full_blocks(seen)
probe = report + questions[1]
cases = {
    "same report, same settings (control)": (probe, base, cache),
    "same report after another prefix": (encode("system : be brief") + probe, base, cache),
    "different adapter id": (probe, with_reuse.key(adapter="finance-lora"), cache),
    "different cache dtype (bfloat16 pool)": (probe, bf16_pool.key(), cache),
}
big_blocks = PrefixCache(BlockAllocator(64), block_size=16)
short_prefix = report[:12]
seen16, _ = big_blocks.allocate(short_prefix + questions[0], base)
big_blocks.cache_full_blocks(seen16)
cases["12 shared tokens, 16-token blocks"] = (short_prefix + questions[1], base, big_blocks)
hits = {}
for name, (tokens, k, c) in cases.items():
    hits[name] = c.match(tokens, k).num_cached_tokens
    print(f"{name:<38} reusable tokens {hits[name]:>3} of {len(tokens):>3}  ({hits[name] / len(tokens):.0%})")
assert hits["same report, same settings (control)"] == common_prefix_len(report + questions[0], probe) // 4 * 4
assert all(v == 0 for n, v in hits.items() if "control" not in n)

# %% [markdown]
# The control hits; every other case misses, each for a reason the hash chain encodes: the parent
# hash (case 1), the extra keys (cases 2 and 3), and "full blocks only" (case 4: the 12 shared
# tokens never filled a 16-token block, so none got a name).
#
# A hash is only an index: on a hit, `match` compares the stored token ids, extra keys and parent
# entry with the request's. With a deliberately terrible hash that gives every block the same name,
# collisions cost hits but never cause a wrong reuse.

# %%
weak = PrefixCache(BlockAllocator(16), block_size=4, hash_fn=lambda parent, tokens, key: "same name")
t, _ = weak.allocate([1, 2, 3, 4, 9])
weak.cache_full_blocks(t)
assert weak.match([1, 2, 3, 4, 5]).num_cached_tokens == 4   # verified: a real hit
assert weak.match([5, 6, 7, 8, 9]).num_cached_tokens == 0   # same name, other tokens: refused
print("a colliding name is refused after comparing the stored tokens")

# %% [markdown]
# With SHA-256 a collision would need about 2^128 blocks before it became likely; the comparison is
# there so that correctness never rests on luck.
#
# ## Sharing, copy-on-write, finishing and eviction, step by step
#
# A finished request drops its references, but its full blocks **stay cached**: they sit in the
# free queue with their names, and a later request can revive them. A freed block without a name
# goes to the *front* of the queue (chapter 03), a named one to the *back*; only when the pool hands
# out a named block is its name dropped: an *eviction*, least recently used first. (Dashboards that
# show KV usage falling to 0% after requests end count referenced blocks, not cached ones.) When two
# sequences share a partly filled tail block (a fork for parallel sampling), the first to write into
# it gets a private copy: *copy-on-write*; `append` returns the `(src, dst)` pair for the engine to
# copy in every layer.
#
# Move the slider to step through the story.

# %%
PrefixStepper(snaps)

# %% [markdown]
# Without a live kernel the slider does nothing; here are four of its steps.

# %%
fig = static_figure(snaps, [2, 4, 7, 9])
plt.show()

# %%
# NBVAL_CHECK_OUTPUT
for i in (2, 4, 6, 7, 9):
    s = snaps[i]
    print(f"step {i}: copies {list(s.copies)}, evicted {list(s.evicted)}, blocks in use "
          f"{sum(r > 0 for r in s.ref_counts)}, cached {sum(s.cached)}; {s.caption}")
    for b, what in zip(s.evicted, s.evicted_held):
        print(f"         block {b} had held {what}")
assert snaps[4].copies and snaps[7].evicted and sum(snaps[6].ref_counts) == 0 and sum(snaps[6].cached) >= 2
assert snaps[7].evicted == snaps[9].evicted and snaps[7].evicted_held != snaps[9].evicted_held

# %% [markdown]
# Blocks 1 and 4 are evicted twice, at steps 7 and 9, and that is no double count: an eviction drops
# a *name*, the content a block held, and the physical block goes straight back to work. At step 7
# C, unrelated text, needs 7 of the 8 blocks: the 5 free unnamed ones, then the two cached blocks at
# the front of the queue, 4 and 1 (the tail of A' and the report's second block). C frees its blocks tail
# first, so its last two, in 1 and 4 again, are the least recently used; at step 9 D finds block 0
# (a 4-token hit) and takes 1 and 4 once more, dropping C's names.

# %% [markdown]
# ## With a real model: one system prompt, four conversations
#
# Chat requests very often share a *system prompt*: every conversation begins with the same
# instructions, wrapped by the chat template in the same special tokens. Here is SmolLM2-135M-Instruct
# (chapter 01) with its own tokenizer and chat template, on this chapter's `PrefixCachedPool`. Four
# questions share one system prompt. A fifth prompt has the same system prompt with **one more
# space** in it: to a reader the same text, to the tokenizer other tokens.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
import time

from labkit.model.pretrained import chat_token_ids, from_pretrained, load_tokenizer, real_model

path = real_model()
chat_model = from_pretrained(path, dtype=torch.float32, device=labkit.DEVICE)  # 4-bit weights, dequantized
tokenizer = load_tokenizer(path)
SYSTEM = ("You are a helpful assistant for the engineers who run a language-model server. They are "
          "busy, so answer in one short, plain sentence, without lists, and say so when you do not know.")
QUESTIONS = ["What is the capital of France?", "Which planet is the largest?",
             "What does a graphics card do?", "Why is the sky blue?"]
print(f"{path.name}: {chat_model.config.num_hidden_layers} layers, vocabulary of {len(tokenizer):,} tokens")

# %% [markdown]
# The prompts, as token ids. `chat_token_ids` applies the chat template and tokenises the result.
# In the tokens of a byte-level BPE tokenizer, `Ġ` stands for a space and `Ċ` for a newline.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
# NBVAL_CHECK_OUTPUT
def chat(system: str, question: str) -> list[int]:
    return chat_token_ids(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": question}])


spaced = SYSTEM.replace("You ", "You  ", 1)  # one more space
prompts = {f"question {i + 1}": chat(SYSTEM, q) for i, q in enumerate(QUESTIONS)}
prompts["question 2, one more space"] = chat(spaced, QUESTIONS[1])
first = prompts["question 1"]
for name, ids in prompts.items():
    print(f"{name:<27}: {len(ids):>3} tokens, {common_prefix_len(first, ids):>3} in common with question 1")
edit_at = common_prefix_len(first, prompts["question 2, one more space"])
print("around the extra space:", tokenizer.convert_ids_to_tokens(first[edit_at - 2:edit_at + 2]), "->",
      tokenizer.convert_ids_to_tokens(prompts["question 2, one more space"][edit_at - 2:edit_at + 2]))
assert prompts["question 2, one more space"] != prompts["question 2"]
assert edit_at < common_prefix_len(first, prompts["question 2"])

# %% [markdown]
# `generate_with_prefix_cache`, which served the toy model above, now serves the five prompts one
# after the other on one pool of 16-token blocks, each reply cut at 8 tokens; chapter 01's
# `generate`, on its contiguous cache, gives the tokens to compare with.
#
# The table also gives each request's time to first token, that is, its prefill. Such a time
# misleads in two ways. The first forward pass of a process can pay one-off costs, so an untimed
# round of prefills warms the model up first. And a busy machine adds noise, so each mode then
# serves the prompts three times, the modes taking turns at going first, and the table keeps each
# request's fastest.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
ran_on = {}


def serve(reuse: bool, max_new_tokens: int) -> dict[str, tuple]:
    """The prompts in order on one fresh pool: (each one's generation, the seconds it took).
    With ``max_new_tokens=1`` a call is the prefill alone, and its time the time to first token."""
    kv = PrefixCachedPool(chat_model.config, num_blocks=64, block_size=16, reuse=reuse, device=labkit.DEVICE)
    ran_on["attention"] = kv.kernel_backend()
    out = {}
    for name, ids in prompts.items():
        start = time.perf_counter()
        out[name] = (generate_with_prefix_cache(chat_model, kv, ids, max_new_tokens), time.perf_counter() - start)
    return out


warm_up = serve(False, 1)  # the process's first prefills, with their one-off costs: not in the table
runs = {True: {name: [] for name in prompts}, False: {name: [] for name in prompts}}
for order in ((True, False), (False, True)):  # prefill only, each mode first once
    for reuse in order:
        for name, (out, t) in serve(reuse, 1).items():
            runs[reuse][name].append(t)
            assert reuse or out.num_cached_tokens == 0  # reuse off: no block is ever named, none found
ttft = {reuse: {name: min(times) for name, times in by_name.items()} for reuse, by_name in runs.items()}
cached_run = serve(True, 8)
eos = chat_model.config.eos_token_id
whole = ["question 1", "question 2", "question 2, one more space"]  # three replies shown whole below
plain = {name: generate(chat_model, ids, 64 if name in whole else 8, eos_token_id=eos).tokens
         for name, ids in prompts.items()}
where = torch.cuda.get_device_name() if labkit.DEVICE.type == "cuda" else "the CPU"
print(f"times measured in this run on {where} ({torch.get_num_threads()} PyTorch threads); "
      f"attention ran {ran_on['attention']}")
print(f"{'request':<27} {'cached':>9}  {'first token, reuse on / off':>28}  same 8 tokens")
for name in prompts:
    reply = cached_run[name][0]
    assert reply.tokens == plain[name][:8]  # reuse changes no output token
    print(f"{name:<27} {reply.num_cached_tokens:>3} of {len(prompts[name]):>3}  "
          f"{1000 * ttft[True][name]:>11.0f} ms / {1000 * ttft[False][name]:>6.0f} ms  {'yes':>13}")
hits = {name: cached_run[name][0].num_cached_tokens for name in prompts}
computed = sum(len(p) - hits[n] for n, p in prompts.items())
print(f"prefill tokens computed: {computed} with reuse, {sum(map(len, prompts.values()))} without; "
      f"time to first token, summed: {1000 * sum(ttft[True].values()):.0f} ms with reuse, "
      f"{1000 * sum(ttft[False].values()):.0f} ms without")
for name in prompts:  # a hit is every full block before the first token that differs from an earlier prompt
    earlier = list(prompts)[:list(prompts).index(name)]
    common = max((common_prefix_len(prompts[name], prompts[n]) for n in earlier), default=0)
    assert hits[name] == min(common, len(prompts[name]) - 1) // 16 * 16
reused = [name for name in prompts if hits[name]]  # questions 2 to 4: their prefill is shorter, so faster
assert reused == ["question 2", "question 3", "question 4"]
assert sum(ttft[True][n] for n in reused) < sum(ttft[False][n] for n in reused)
# The extra space sits inside the first block: not even that block is reused.
assert edit_at == 4 and hits["question 2, one more space"] == 0  # quoted below
assert hits["question 1"] == 0 and len(first) == len(prompts["question 2, one more space"]) == 62 and len(first) // 16 == 3

# %% [markdown]
# Questions 2 to 4 reuse the blocks of the system prompt that question 1 computed, prefill only the
# rest, and get their first token sooner (the times change from machine to machine; the token
# counts do not). Every reply begins with the same 8 tokens as chapter 01's generation without any
# reuse. The fifth prompt reads the same to a person, yet it finds **nothing**, 0 of its 62
# tokens: the extra space comes right after the 4 tokens it shares with question 1 (printed
# above), inside the first 16-token block, so even that block's name differs, and the chain
# carries the difference into every later name.
#
# Question 1 is a miss either way, and computes the same 62 tokens with reuse on or off. Any gap
# between its two times is not caching: the only extra work, hashing and naming its three full
# blocks, is timed below on the pool's `PrefixCache` alone, without the model.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
import statistics

key = PrefixCachedPool(chat_model.config, num_blocks=1, block_size=16).key(model=chat_model)


def bookkeeping_ms(reuse: bool, repeats: int = 50) -> float:
    """Median time of the pool's bookkeeping for question 1 on a fresh cache, without the model:
    allocate its block table, name its full blocks (reuse on only), release it."""
    times = []
    for _ in range(repeats):
        cache = PrefixCache(BlockAllocator(64), block_size=16)
        start = time.perf_counter()
        table, _ = cache.allocate(first, key)
        if reuse:
            cache.cache_full_blocks(table)
        cache.release(table)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


book_on, book_off = bookkeeping_ms(True), bookkeeping_ms(False)
miss_on, miss_off = 1000 * ttft[True]["question 1"], 1000 * ttft[False]["question 1"]
cold = 1000 * warm_up["question 1"][1]
print(f"question 1, bookkeeping alone: {book_on:.2f} ms with reuse, {book_off:.2f} ms without "
      f"(+{book_on - book_off:.2f} ms: {(book_on - book_off) / miss_on:.3%} of its prefill)")
for reuse in (True, False):
    print(f"question 1, reuse {'on ' if reuse else 'off'}: first token after "
          f"{', '.join(f'{1000 * t:.0f}' for t in runs[reuse]['question 1'])} ms in its two runs")
print(f"the process's first prefill (question 1, in the untimed round): {cold:.0f} ms, "
      f"{cold / min(miss_on, miss_off):.1f}x the fastest warm one")
assert book_on - book_off < min(1.0, 0.01 * min(miss_on, miss_off))

# %% [markdown]
# Hashing and naming three blocks costs a fraction of a millisecond (first line), too little to
# see in a prefill. What moves the times is the machine. The process's very first prefill can pay
# one-off costs (the last line says how much in this run); timed, they would weigh on whichever mode
# ran first, which is why an untimed round comes first and the modes take turns. And the same prefill, repeated,
# spreads over the range the middle lines show: a gap between question 1's two times, in either
# direction, is that spread, not the cache.
#
# The replies so far were cut at 8 tokens. Here are three of them whole, as `generate` continued
# them until the model ended its turn:

# %%
# NBVAL_SKIP_IN_SOLUTIONS
for name in whole:
    print(f"{name:<27}: {tokenizer.decode(plain[name], skip_special_tokens=True)!r} ({len(plain[name])} tokens)")
eos_ids = {eos} if isinstance(eos, int) else set(eos)
assert all(plain[name][-1] in eos_ids for name in whole)  # every reply ended by itself, none was cut
assert plain["question 2"] != plain["question 2, one more space"]
assert all("Saturn" in tokenizer.decode(plain[n]) for n in whole[1:])  # wrong both times, as said below

# %% [markdown]
# The same question, after a system prompt that differs by one space, gets a **different reply**.
# That is the plainest evidence that a space changes the computation: other token ids, other K/V in
# every layer, other logits. (Both replies also contradict themselves and settle on Saturn; the
# largest planet is Jupiter. A 135M-parameter model holds few facts firmly.) An engine can reuse only what is
# identical in token ids from the first token on, so templates and system prompts that vary by a
# space, a date or a user name defeat the cache.

# %% [markdown]
# ## Two designs: a hash chain (vLLM) and a radix tree (SGLang)
#
# Both find the longest cached prefix; they organise it differently.
#
# | | hash chain per block (vLLM) | radix tree of tokens (SGLang RadixAttention) |
# |---|---|---|
# | unit of sharing | full blocks only | any token boundary with `page_size=1`; page-aligned prefixes with larger pages |
# | lookup | hash each full block, look names up one by one | walk the tree from the root, matching tokens |
# | eviction | LRU over free cached blocks | LRU over leaves no running request locks |
# | easy | names come from the tokens alone, so processes can share blocks across workers or a disk tier if all seed the chain alike (vLLM 0.33.0, `kv_cache_utils.py`, `init_none_hash`) | partial-block prefixes, scheduling by longest shared prefix |
# | harder | sharing below one block | bookkeeping of splits and merges; distributing the tree |
#
# The book's `PrefixCache` is the hash-chain design; its entry check (parent entry and tokens) is a
# tree edge in disguise, which is why collisions cannot hurt it.
#
# ## Summary
#
# - Causal attention makes the K/V of a prefix a function of that prefix and the computation only,
#   so requests that begin with the same tokens can share them.
# - A block is named by a hash chain: parent name, its tokens, and the extra keys (model, adapter,
#   cache dtype and layout, position encoding, attention rule, salt). Only full blocks get names; a
#   hit is capped so that at least one prompt token is computed to produce logits.
# - `allocate` matches, counts, then shares the hit's blocks by reference count and appends fresh
#   ones; two 8,192-token requests sharing 4,096 tokens hold 1.5 GiB instead of 2 GiB.
# - Prefilling only the uncached suffix gives the same tokens and logits: reuse saves prefill work
#   and memory, never decode steps.
# - A shared tail is copied on write; finished requests leave cached blocks, evicted least recently
#   used first.
# - Reuse must not cross a different earlier prefix, adapter, cache dtype or layout, or position. A
#   prefix shorter than one block cannot be reused at all.
# - With a real model, four conversations with one system prompt share its blocks, and their
#   replies begin with the same tokens as without reuse. One extra space in the system prompt leaves nothing to reuse,
#   and the model answers it differently.
#
# Next, chapter 05 puts these blocks into the scheduler's decisions.
#
# ## Exercises

# %%
from labkit.teaching.exercises import Exercises
from labkit.teaching.guards import draws_hidden_cases, function_shape, torch_generator

ex = Exercises("04_prefix_reuse")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/, every checker must pass

# %% [markdown]
# **Exercise 1 (build it).** Write `cached_tokens(token_ids, block_size, key, cached)`: how many
# leading prompt tokens a cache holding the block names `cached` (a set) serves. Name the full blocks
# with `block_hash(parent_hash, block_tokens, key)` (the first block's parent is `None`), stop at the
# first name not in `cached`, even if later ones are there (their parent was evicted), and leave at
# least one prompt token to compute. `PrefixCache.match` judges it on prompts drawn afresh: served
# whole, one token longer, changed midway, under another key, shorter than a block.

# %%
def cached_tokens(token_ids: list[int], block_size: int, key: CacheKey, cached: set[str]) -> int:
    # BEGIN SOLUTION
    parent, hit = None, 0
    usable = (len(token_ids) - 1) // block_size  # full blocks before the last token: it must be computed
    for i in range(usable):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], key)
        if parent not in cached:
            break  # every later name depends on this one: no later block can hit
        hit += block_size
    return hit
    # END SOLUTION


from labkit.memory.prefix import BlockHashIndex, CachedBlockTable
from labkit.teaching import build_it

ex.check_function("Exercise 1", cached_tokens, build_it.cached_tokens_cases(),
                  forbid=[hash_chain, PrefixCache, CachedBlockTable, BlockHashIndex, PrefixCachedPool],
                  hint="walk full blocks from the first, each name made from the one before; stop at a miss; "
                       "at most (len - 1) // block_size blocks.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** It mirrors `labkit/memory/prefix.py`: `hash_chain` (each name from its parent) and
# `PrefixCache.match`, whose loop runs over `(len(tokens) - 1) // block_size` blocks (vLLM's
# `max_cache_hit_length = num_tokens - 1`) and breaks at the first miss. A block after the miss may
# still be cached, but a request's computed tokens are one count from its start (vLLM's
# `num_computed_tokens`) and the missing block must be computed, so nothing after it is reused; vLLM's
# `FullAttentionManager.find_longest_cache_hit` breaks there too. The key enters every name, so another
# adapter or salt misses from the first block.

# %% [markdown]
# **Exercise 2 (decide who may share).** A service hosts several tenants; some requests use an
# adapter (a LoRA). Tenants must never share cached blocks (a hit is measurably faster, so sharing
# would leak whether another tenant sent the same text), while requests of one tenant with the same
# adapter should share as much as the cache allows. Write `cache_key_for(request)`, returning the
# `CacheKey` under which a request's blocks are named. A request is a dict with `"tenant"`,
# `"adapter"` (a name or `None`) and `"prompt"`. The checker serves a stream of 40 requests from
# three tenants (two of them with the same system prompt), drawn afresh, through a
# real `PrefixCache` under your keys, and checks every hit: no block may cross a tenant or an
# adapter, and every hit the rules allow must happen. Your function gets a copy of each request.

# %%
def cache_key_for(request: dict) -> CacheKey:
    # BEGIN SOLUTION
    return CacheKey(adapter=request["adapter"], salt=request["tenant"])
    # END SOLUTION
    # BEGIN STUB
    raise NotImplementedError("your code here")
    # END STUB


@draws_hidden_cases
def tenant_stream(rng, n: int = 40) -> list[dict]:
    g = torch_generator(rng)
    system = {"acme": list(range(1000, 1040)), "globex": list(range(1000, 1040)),  # the same system prompt
              "initech": list(range(2000, 2024))}
    stream = []
    for i in range(n):
        tenant = ["acme", "globex", "initech"][int(torch.randint(3, (1,), generator=g))]
        adapter = [None, None, "legal"][int(torch.randint(3, (1,), generator=g))]
        question = [5000 + 50 * i + j for j in range(int(torch.randint(3, 30, (1,), generator=g)))]
        stream.append({"tenant": tenant, "adapter": adapter, "prompt": system[tenant] + question})
    return stream


def check_isolation(fn) -> list[str]:
    cache, problems, served = PrefixCache(BlockAllocator(1024), block_size=16), [], []
    for i, request in enumerate(tenant_stream()):
        key = fn(request)  # check_behaviour hands fn a copy of the request: this one stays as drawn
        if type(key) is not CacheKey:
            return [f"cache_key_for must return a CacheKey, got {key!r}"]
        hit = cache.match(request["prompt"], key).num_cached_tokens
        # What the rules allow: full blocks shared with an earlier request of the same tenant and adapter,
        # leaving at least one token to compute.
        same = [r["prompt"] for r in served if (r["tenant"], r["adapter"]) == (request["tenant"], request["adapter"])]
        allowed = max((common_prefix_len(p, request["prompt"]) for p in same), default=0)
        allowed = min(allowed, len(request["prompt"]) - 1) // 16 * 16
        if hit > allowed:
            problems.append(f"request {i} ({request['tenant']}, adapter {request['adapter']}) reused {hit} tokens, "
                            f"only {allowed} are its own tenant's and adapter's")
        elif hit < allowed:
            problems.append(f"request {i} ({request['tenant']}, adapter {request['adapter']}) reused {hit} tokens, "
                            f"{allowed} were allowed")
        table, _ = cache.allocate(request["prompt"], key)
        cache.cache_full_blocks(table)
        served.append(request)
    return problems


ex.check_behaviour("Exercise 2", cache_key_for, check_isolation, expects=function_shape("cache_key_for", "request"),
                   hint="CacheKey has a field for the adapter and one (salt) that keeps tenants apart.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** The extra keys enter every block's name, so two requests share a block only
# when their keys are equal. The tenant as `salt` separates acme from globex even though their
# system prompts are the same tokens, and the adapter keeps a LoRA's K/V apart from the base
# model's; the rest of the key is left at the default, so one tenant with one adapter still shares.

# %% [markdown]
# **Exercise 3.** Three requests of 8,192 tokens each share their first 4,096 tokens (the teaching
# model, 16-token blocks). How many bytes does the pool hold once all three are prefilled?

# %%
# BEGIN SOLUTION
answer_3 = (4096 + 3 * 4096) * capacity.bytes_per_token(32, 8, 128, 2)
# END SOLUTION
# BEGIN STUB
answer_3 = None  # a number of bytes
# END STUB
ex.check("Exercise 3", answer_3, hint="one copy of the shared prefix, one private suffix per request")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** The 4,096 shared tokens fill 256 whole blocks, stored once with a reference
# count of 3; each request adds its own 4,096 tokens. That is 16,384 tokens at 128 KiB each, 2 GiB,
# against 3 GiB without sharing.

# %% [markdown]
# **Quiz.** Answer with a letter or a number.
# 1. A 64-token prompt is wholly cached (16-token blocks). How many tokens are reused?
# 2. Changing one token in block 3 renames (a) block 3 only; (b) block 3 and every later block;
#    (c) every block.
# 3. Reuse saves (a) prefill work and memory; (b) decode steps; (c) both.
# 4. The same tokens four positions later: reusable? (a) yes; (b) no.

# %%
# BEGIN SOLUTION
quiz = {1: 48, 2: "b", 3: "a", 4: "b"}
# END SOLUTION
# BEGIN STUB
quiz = {1: None, 2: None, 3: None, 4: None}  # a letter or a number each
# END STUB
ex.quiz(quiz)

# %% [markdown]
# ## What you can now do
#
# - Name a prompt's blocks with a hash chain, and say which blocks a changed token renames.
# - Predict a prefix hit in tokens: full blocks only, identical tokens from the first one on, the
#   same extra keys, and at least one prompt token left to compute.
# - Count the memory that sharing saves for requests with a common prefix, and the blocks a new
#   request takes from the free pool.
# - Trace reference counts, copy-on-write and least-recently-used eviction through a pool, and
#   choose the cache keys that keep tenants and adapters apart.
# - Prove on a model that prefilling only the uncached suffix gives the same tokens and logits.

# %% [markdown]
# ## References
#
# - The source article: *长上下文推理中的 KV Cache：容量、分页与复用边界* ("The KV cache in
#   long-context inference: capacity, paging and the limits of reuse"), a Chinese essay in six
#   sections; the copy the book follows gives no author or link. Its figure of two 8,192-token
#   requests sharing 4,096 tokens carries over into this chapter; its sentences do not.
# - Woosuk Kwon, Zhuohan Li, et al., *Efficient Memory Management for Large Language Model Serving
#   with PagedAttention*, SOSP 2023, [arXiv:2309.06180](https://arxiv.org/abs/2309.06180): sharing
#   blocks by reference count, and copy-on-write.
# - vLLM, the serving engine the book compares itself with: documentation at
#   [docs.vllm.ai](https://docs.vllm.ai/) (the design document on automatic prefix caching), code
#   at [github.com/vllm-project/vllm](https://github.com/vllm-project/vllm). This chapter read vLLM
#   0.33.0: `vllm/v1/core/block_pool.py` (`BlockHashToBlockMap`) and
#   `vllm/v1/core/kv_cache_manager.py` (`KVCacheManager.get_computed_blocks`).
# - Lianmin Zheng et al., *SGLang: Efficient Execution of Structured Language Model Programs*,
#   NeurIPS 2024, [arXiv:2312.07104](https://arxiv.org/abs/2312.07104): RadixAttention, the radix
#   tree of cached prefixes that the last section compares with vLLM's hash chain.
