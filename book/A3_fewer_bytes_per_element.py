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
# # A3 · Fewer bytes per token: quantized, windowed and latent caches
#
# **The message.** A token's cache shrinks with fewer bits per element, fewer tokens kept or a smaller
# vector per token, and each way costs something: on the real model an int8 cache almost nothing,
# fp8 a little and int4 a measurable loss that finer scales reduce.
#
# An appendix to [chapter 02](02_cost_per_token.ipynb), whose formula for one token's cache is 2 × L
# × Hkv × D × b. Here we build caches that store 1 byte per element, or half of one, run the real
# model on them, and measure what the saved bytes cost. Section 7 adds the two other ways real
# models store less per token, which chapter 02 left out: sliding windows and a latent cache.
#
# **What you will learn**
#
# - what a *code* and a *scale* are, and how fp8 (e4m3), int8 and int4 differ in the error they make;
# - where the scales can live (one per layer, as vLLM's `k_scale` and `v_scale`; one per block and
#   head; one per 32 elements) and what each placement adds to the byte formula;
# - how the paged cache keeps scales beside its blocks, and where the decode kernel turns codes back
#   into numbers (and on which GPUs it cannot, for fp8);
# - what each scheme costs on SmolLM2-135M, in next-token loss and in greedy agreement;
# - what a sliding window and a latent (MLA) cache change in the formula.

# %%
from labkit.teaching.diagrams import roadmap

roadmap("A3");  # the article's pipeline, this appendix's part highlighted

# %% [markdown]
# **You need:** chapter 02: the byte formula, the model presets (section 5) and a device's pool
# (section 6); chapter 03: the paged pool; appendix A1: its decode kernel; chapter 01: the real model.
#
# **Time:** about 35 minutes to read and run; about 60 minutes for the exercises.

# %%
import json
import math

import matplotlib.pyplot as plt
import torch

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.caches import quant_quality
from labkit.caches.paged import KVPool
from labkit.kernels import triton_paged
from labkit.kernels.fallback import fallback_reason
from labkit.kernels.paged_attention import paged_decode_attention, write_kv
from labkit.kernels.reference import paged_decode_attention_ref, write_kv_ref
from labkit.memory import capacity, formats
from labkit.memory.capacity import PRESETS, TEACHING_MODEL
from labkit.model.decoder import DecoderConfig
from labkit.teaching import build_it
from labkit.teaching.results import committed_result
from labkit.units import GiB, format_bytes
from labkit.vllm_bridge import predict

# %% [markdown]
# ## 1. A code and a scale
#
# A quantized cache stores each element as a small *code* and keeps, elsewhere, a *scale* that turns
# codes back into numbers: x ≈ code × scale. int8 keeps codes from −127 to 127, int4 from −7 to 7;
# the scale is chosen so that the largest |x| maps to the largest code, and every other value is
# divided by the scale and rounded to the nearest integer. Their error is *absolute*: at most half a
# scale step, whatever the value.
#
# fp8's codes are floating-point numbers themselves, e4m3: 4 bits of exponent, 3 of mantissa,
# largest value 448. Between two powers of two it has 8 evenly spaced numbers, so for its *normal*
# numbers, from 2⁻⁶ to 448, the error is *relative*: at most half a step, 1/16 of the power of two
# below the value. Under 2⁻⁶ there are only *subnormal* numbers, 2⁻⁹ apart; there the error is
# absolute, and a code of 2⁻¹⁰ or less becomes 0. Rounded to nearest, values spread evenly on a log
# scale over the normal range:

# %%
# NBVAL_CHECK_OUTPUT
e4m3 = torch.finfo(torch.float8_e4m3fn)
spread = torch.empty(100_000, dtype=torch.float64).uniform_(math.log(e4m3.smallest_normal), math.log(e4m3.max),
                                                            generator=torch.Generator().manual_seed(0))
normal = spread.exp().float()
error = (formats.dequantize(formats.quantize(normal, 1.0, "fp8"), 1.0) - normal).abs() / normal
print(f"e4m3 normal numbers, {e4m3.smallest_normal:g} (2^-6) to {e4m3.max:g}: mean relative error "
      f"{error.mean():.2%} (1/(64 ln 2) = {1 / (64 * math.log(2)):.2%} in theory),\n"
      f"  largest {error.max():.1%} (1/16 = {1 / 16:.2%})")
tiny = torch.tensor([2**-6, 2**-8, 2**-9, 1.1 * 2**-10, 2**-10, 2**-11])
kept = formats.dequantize(formats.quantize(tiny, 1.0, "fp8"), 1.0)
print("code      " + "".join(f"{v:>11.3e}" for v in tiny.tolist()))
print("stored as " + "".join(f"{v:>11.3e}" for v in kept.tolist()))
print(f"scale set by the largest |x|: relative error down to |x|max / {448 * 2**6:,}, 0 at |x|max / {448 * 2**10:,} "
      "and below")
assert abs(error.mean() - 1 / (64 * math.log(2))) < 2e-4  # 1/(64 ln 2) = 2.25% for log-uniform values
assert error.max() <= 1 / 16
assert kept[2] == 2**-9 and kept[3] == 2**-9 and kept[4] == 0 and kept[5] == 0  # 2^-10 and below: 0
assert kept[1] == 2**-8 and e4m3.smallest_normal == 2**-6

# %% [markdown]
# About 2.25% on average for normal codes. With the scale set by the largest |x|, they cover every
# value down to |x|max / 28,672; from |x|max / 458,752 down, values are 0. Quantize values from
# 0.01 to 10 with the scale set by the largest, 10:

# %%
# NBVAL_CHECK_OUTPUT
x = torch.tensor([10.0, 3.3, 1.0, 0.31, 0.1, 0.03, 0.01])
print(f"{'x':>6s}" + "".join(f"{e:>16s}" for e in formats.ELEMENTS))
rows = {}
for element, (bits, qmax, _) in formats.ELEMENTS.items():
    scale = float(x.abs().max()) / qmax
    rows[element] = formats.dequantize(formats.quantize(x, scale, element), scale)
for i, value in enumerate(x.tolist()):
    print(f"{value:6.2f}" + "".join(f"{rows[e][i].item():9.4f} ({abs(rows[e][i].item() / value - 1):4.0%})"
                                    for e in formats.ELEMENTS))
assert rows["int4"][-1] == 0 and rows["int8"][-1] == 0 < rows["fp8"][-1]  # small values vanish on an integer grid
assert all(abs(rows["fp8"][i] / x[i] - 1) <= 1 / 16 for i in range(len(x)))
assert (x / (10 / 448)).min() >= e4m3.smallest_normal  # every code here is a normal e4m3 number

# %% [markdown]
# With one scale for everything, int8 and int4 lose the small values: 0.01 is below half a step and
# becomes 0. fp8 keeps each within 1/16 of itself: even 0.01 is a code of 0.448, a normal number.
# Real keys and values are not spread that widely inside one head, but a few channels can be much
# larger than the rest, and those set the scale for everything else. That is why it matters where
# the scales live.
#
# ## 2. Where the scales live, and what they cost
#
# `labkit.memory.formats` offers three placements for each element format, named `"<element>_per_<scales>"`:
#
# - **per tensor**: one scale for all of a layer's K, one for its V: vLLM's `kv_cache_dtype="fp8"`.
#   In vLLM 0.33.0 a plain checkpoint (unquantized weights) has no scales, and both are 1.0
#   (`set_default_quant_scales`, called from `Attention.process_weights_after_loading`, in
#   `vllm/model_executor/layers/attention/attention.py`); the only log line is the info
#   `CacheConfig` prints for any fp8 cache, that it "may cause accuracy drop without a proper
#   scaling factor" (`vllm/config/cache.py`). A quantized checkpoint brings `k_scale` and `v_scale`
#   (`vllm/model_executor/layers/quantization/kv_cache.py: BaseKVCacheMethod`); only one that lacks
#   them gets 1.0 and a warning. labkit starts at 1.0 too; `quant_quality.calibrate_kv_scales`
#   measures each layer's max |K| and |V| on sample text, as the tools that write such checkpoints
#   do. The scales are fixed before serving: later values past them are clamped.
# - **per block**: one scale per block and KV head, the largest |x| written into the block so far,
#   over qmax. A write that raises it re-encodes the block's earlier codes for the new scale.
# - **per group**: one scale for every 32 consecutive elements of a token's head, set when the
#   token is written.
#
# Scales are float32, 4 bytes. The byte formula keeps its shape with b = 1 (fp8, int8) or b = 0.5
# (int4, two codes per byte) and adds the scales: nothing per token for per-tensor scales (8 bytes
# per layer in all), 2 × L × Hkv × 4 / block_size per token for per-block scales, 2 × L × Hkv ×
# ⌈D / 32⌉ × 4 for per-group ones. `capacity.kv_bytes_per_token` computes it:

# %%
# NBVAL_CHECK_OUTPUT
smol = capacity.ModelShape("SmolLM2-135M", num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=2)
models = [smol, PRESETS["Llama-3-8B"]]
print(f"{'kv_cache_dtype':16s}" + "".join(f"{m.name:>22s}" for m in models) + f"{'scales share':>14s}")
for name in ("auto",) + formats.KV_CACHE_DTYPES[1:]:
    cells = [capacity.kv_bytes_per_token(m, name) for m in models]
    data = 0 if name == "auto" else 2 * 32 * 8 * 128 * formats.kv_quant(name).bits / 8
    share = "" if name == "auto" else f"{cells[1] / data - 1:.2%}"
    label = "bfloat16" if name == "auto" else name
    print(f"{label:16s}" + "".join(f"{format_bytes(c, 'bytes'):>22s}" for c in cells) + f"{share:>14s}")
assert capacity.kv_bytes_per_token(smol, "int8_per_tensor") * 2 == smol.bytes_per_token() == 23_040
assert capacity.kv_bytes_per_token(PRESETS["Llama-3-8B"], "int8_per_block") == 64 * 1024 * (1 + 1 / 512)

# %% [markdown]
# Per-block scales cost 1/512 of an 8-bit cache with 16-token blocks; per-group scales cost 1/8 of it
# and a quarter of an int4 cache, which is why int4 with groups of 32 saves 69% of bf16, not 75%.
#
# vLLM's alternatives to per-tensor scales are `fp8_per_token_head`, `int8_per_token_head` and
# `int4_per_token_head`, all three in the Triton backend's `supported_kv_cache_dtypes`
# (`vllm/v1/attention/backends/triton_attn.py`). They compute one float32 scale for the K and one
# for the V of every token and head as they write it, and keep both in the page beside the codes
# (`TritonAttentionBackend.customize_spec`). `int4_per_token_head` also rotates each head (a
# Hadamard transform) and hides a 4-bit zero point in its scale
# (`vllm/v1/attention/ops/int4_per_token_head.py`). For the teaching model, page bytes of one token
# and layer from `labkit.vllm_bridge.predict.page_size_bytes`, per KV head:

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'kv_cache_dtype':20s}{'bytes per head and token':>26s}{'of which scales':>17s}")
head_bytes = {}
for name in ("auto", "fp8", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"):
    head_bytes[name] = predict.page_size_bytes(TEACHING_MODEL, 1, name) // TEACHING_MODEL.num_kv_heads
    data = 2 * 128 * (2 if name == "auto" else 0.5 if name.startswith("int4") else 1)  # K and V of 128 elements
    print(f"{name:20s}{head_bytes[name]:>26,}{head_bytes[name] - data:>17,.0f}")
fp8 = TEACHING_MODEL.with_dtype("fp8")
print(f"teaching model, fp8: {format_bytes(fp8.bytes_per_token())} per token, "
      f"request A {format_bytes(fp8.cache_bytes(8192))}")
assert 2 * fp8.cache_bytes(8192) == TEACHING_MODEL.cache_bytes(8192)  # an 8-bit cache halves b
assert predict.page_size_bytes(TEACHING_MODEL, 1, "fp8_per_token_head") == 8 * 264  # 8 KV heads, 1 token
assert predict.page_size_bytes(TEACHING_MODEL, 1, "fp8") == 8 * 256
scales = head_bytes["int8_per_token_head"] - head_bytes["fp8"]
assert scales == 8 and 32 * scales == 2 * 128 and 16 * scales == 128  # 1/32 of K and V, 1/16 of one head
assert head_bytes["fp8_per_token_head"] == head_bytes["int8_per_token_head"] == 264
assert head_bytes["int4_per_token_head"] == 2 * 64 + 8  # two codes per byte, the same 8 bytes of scales

# %% [markdown]
# Plain `fp8` halves bf16's 512 bytes. A per-token-head dtype adds 8 bytes of scales: at 8 bits,
# 1/32 of the 256 bytes of K and V together, or 1/16 of one head's K; at 4 bits, 8 bytes on 128.
#
# ## 3. What each placement keeps of the real keys and values
#
# Run SmolLM2-135M-Instruct, the book's real model, over 256 tokens of text with a cache that
# records each layer's K and V, then push them through every scheme and measure the relative error
# ‖x̂ − x‖ / ‖x‖, averaged over every third layer (per-tensor scales from each layer's own max |x|):

# %%
# NBVAL_SKIP_IN_SOLUTIONS
from labkit.model.pretrained import from_pretrained, load_tokenizer, real_model

model, tokenizer = from_pretrained(real_model()), load_tokenizer(real_model())
calibration = tokenizer(quant_quality.sample_text("calibration"), add_special_tokens=False)["input_ids"]
held_out = tokenizer(quant_quality.sample_text("held_out"), add_special_tokens=False)["input_ids"]


class Recorder(quant_quality.AmaxObserver):
    """A cache that keeps each layer's K and V [tokens, Hkv, D] and attends plainly."""

    def __init__(self, num_layers):
        super().__init__(num_layers)
        self.kv = [None] * num_layers

    def attend(self, layer_idx, q, k, v):
        self.kv[layer_idx] = (k[0], v[0])
        return super().attend(layer_idx, q, k, v)


recorder = Recorder(model.config.num_hidden_layers)
with torch.no_grad():
    model(torch.tensor([calibration[:256]]), cache=recorder)
layers = recorder.kv[::3]
errors = {name: [sum(quant_quality.relative_error(kv[i], formats.kv_quant(name)) for kv in layers) / len(layers)
                 for i in (0, 1)] for name in formats.KV_CACHE_DTYPES[1:]}
print(f"relative error of K and V, mean over layers {list(range(0, len(recorder.kv), 3))}")
for name, (k_err, v_err) in errors.items():
    print(f"  {name:16s} K {k_err:6.1%}   V {v_err:6.1%}")
assert errors["int4_per_group"][0] < errors["int4_per_block"][0] < errors["int4_per_tensor"][0]
assert max(errors["int8_per_tensor"]) < max(errors["fp8_per_tensor"]) < 0.05 < min(errors["int4_per_group"])
print(f"largest |K| {max(recorder.k_amax):.1f}, largest |V| {max(recorder.v_amax):.1f}")
assert max(recorder.k_amax + recorder.v_amax) < 448 / 10  # far inside fp8's ±448 (section 6)

# %% [markdown]
# 8-bit codes keep K and V within 3% (int8 within 2%), and int8 does better than fp8 here: with a
# scale that fits, int8's 255 evenly spaced steps are finer than fp8's 3-bit mantissa for all but
# the smallest values. At 4 bits there are only 15 steps and the placement decides: one scale per
# layer leaves most values a few steps each, and the error falls by half or more from one scale per
# layer to one per 32 elements.
#
# KIVI (in the references) found outlier channels like these in keys, and answers with a placement
# that is none of the three: keys quantized per channel across a group of tokens, values per
# token, both at 2 bits with a zero point beside each scale, and the most recent tokens kept in full
# precision until they fill a group. labkit does not build it.
#
# ## 4. Codes and scales beside the blocks
#
# `KVPool(..., kv_cache_dtype=...)` (chapter 03's pool) keeps, for every layer, the codes in
# `k_caches` and `v_caches` (int4: head_dim / 2 bytes per head) and the scales in `k_scales` and
# `v_scales`; `write_kv` quantizes as it writes. A per-block scale grows with the block: write a
# token, then one four times as large into the next slot of the same block:

# %%
# NBVAL_CHECK_OUTPUT
smol_config = DecoderConfig(vocab_size=49_152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                            num_key_value_heads=3)  # SmolLM2-135M's attention shape: head_dim 64
pool = KVPool(smol_config, num_blocks=4, block_size=16, kv_cache_dtype="int8_per_block", use_triton=False)
print(f"layer 0: k_caches {tuple(pool.k_caches[0].shape)} {pool.k_caches[0].dtype}, "
      f"k_scales {tuple(pool.k_scales[0].shape)} {pool.k_scales[0].dtype}; "
      f"{pool.bytes_per_block:,} bytes per block (bf16: {16 * smol.bytes_per_token():,})")
token = torch.linspace(-1, 1, 64).repeat(3, 1)[None]  # one token: 3 KV heads x 64, max |x| = 1
kc, vc, ks, vs = pool.k_caches[0], pool.v_caches[0], pool.k_scales[0], pool.v_scales[0]
for slot, factor in ((0, 1.0), (1, 4.0)):
    write_kv_ref(token * factor, token * factor, kc, vc, torch.tensor([slot]),
                 kv_cache_dtype="int8_per_block", k_scale=ks, v_scale=vs)
    print(f"after slot {slot}: block 0's scale {ks[0, 0].item() * 127:.0f}/127, "
          f"slot 0's last code {kc[0, 0, 0, -1].item()}")
assert ks[0, 0] == 4 / 127 and kc[0, 0, 0, -1] == 32  # slot 0's codes were re-encoded for the larger scale

# %% [markdown]
# Slot 0's largest code drops from 127 to 32 when slot 1 raises the scale: its values keep their
# size, but now on a coarser grid, rounded a second time: the price of a scale shared by tokens that
# arrive at different times. Per-tensor scales never change, and per-group and vLLM's
# per-token-head scales belong to one token, so none of them touches earlier tokens. `copy_blocks`
# (chapter 04's copy-on-write) copies a block's scales with its codes.
#
# ## 5. The kernel: dequantize after the load, before the dot
#
# Decode is memory-bound (chapter 06): each step reads every cached K and V once. The saving is
# real only if the kernel reads the small codes and widens them in registers. labkit's decode
# kernel (appendix A1) does exactly that: where it loaded a K or V tile, a quantized pool calls this
# function, and everything after it, the online softmax included, is unchanged:

# %%
from labkit.teaching.excerpts import excerpt

excerpt(triton_paged._load_dequantized, "row = block_id", "return x")

# %% [markdown]
# The int4 branch loads a row's bytes once and splits each into its two nibbles; `tl.join` lays
# them side by side again, element 2i then 2i + 1. Run it (in Triton's interpreter without a GPU)
# on an int4 pool with groups of 32, ragged lengths and a shuffled block table, against a float64
# reference that dequantizes first and then attends:

# %%
gen = torch.Generator().manual_seed(0)
q4 = formats.kv_quant("int4_per_group")
(kc, ks), (vc, vs) = q4.empty_pool(8, 16, 2, 64), q4.empty_pool(8, 16, 2, 64)
lens, table = torch.tensor([37, 5], dtype=torch.int32), torch.tensor([[6, 2, 7], [0, 0, 0]], dtype=torch.int32)
slots = torch.cat([table[0, torch.arange(37) // 16] * 16 + torch.arange(37) % 16, torch.arange(5)])
k_new, v_new = torch.randn(42, 2, 64, generator=gen), torch.randn(42, 2, 64, generator=gen)
kw = dict(kv_cache_dtype="int4_per_group", k_scale=ks, v_scale=vs)
write_kv(k_new, v_new, kc, vc, slots, **kw)
q = torch.randn(2, 8, 64, generator=gen)  # GQA: 8 query heads on 2 KV heads
out = paged_decode_attention(q, kc, vc, table, lens, **kw)
reference = paged_decode_attention_ref(q.double(), kc, vc, table, lens, **kw)
print(f"runs: {fallback_reason(q.dtype, q.device, 'int4_per_group') or 'the Triton kernel'}; "
      f"max |kernel - reference| = {(out.double() - reference).abs().max():.1e}")
assert torch.allclose(out.double(), reference, atol=1e-5)

# %% [markdown]
# `tests/test_quant.py` checks every scheme this way, with poisoned pools and scales, and the
# kernel's writes byte for byte against `formats.write_quantized`. `benchmarks/kernels_static.py`
# compiles the launches ahead of time for five GPU generations ([appendix A1](A1_under_the_compiler.ipynb));
# the decode launches over quantized pools, from the committed table:

# %%
# NBVAL_CHECK_OUTPUT
STATIC = committed_result("kernels_static.json")
if STATIC is None:  # a pip install (Colab) has labkit but not the repository's benchmarks/
    print("benchmarks/results/kernels_static.json ships with the repository: clone it to see this table.")
else:
    static = json.loads(STATIC.read_text())
    rows = [{**launch, **static["binaries"][launch["binary"]]} for launch in static["launches"]]
    quantized = [r for r in rows if r["case"].split()[0].startswith(("decode_", "write_kv_"))
                 and r["case"].split()[0] != "decode_split"]
    print(f"{'GPU':5s} {'launches':>8s} {'max registers':>13s} {'max shared':>10s} {'spills':>6s}   formats")
    for gpu in static["meta"]["gpus"]:
        mine = [r for r in quantized if r["gpu"] == gpu]
        elements = sorted({r["case"].split()[0].split("_")[-3] for r in mine})
        print(f"{gpu:5s} {len(mine):8d} {max(r['registers'] for r in mine):13d} "
              f"{max(r['shared_bytes'] for r in mine) / 1024:6.1f} KiB {max(r['spill_bytes'] for r in mine):6d}   "
              f"{', '.join(elements)}")
    for f in static["fallbacks"][:1]:
        print(f"\nnot launched on {sorted({f['gpu'] for f in static['fallbacks']})}: {f['fallback']}")
    assert not any(r["problems"] for r in quantized)

# %% [markdown]
# No launch spills or overflows shared memory. fp8 is missing below sm89 because labkit's fp8 is
# e4m3 (`fp8e4nv` in Triton), which Triton converts only from compute capability 8.9 (Ada, Hopper).
# On a T4, an A100 or an A10 `fallback_reason` says so and labkit runs the PyTorch reference, which
# dequantizes and then attends; int8 and int4 are plain integers and compile everywhere. The other
# fp8, e5m2 (5 exponent bits, 2 of mantissa, twice e4m3's step), Triton accepts on every GPU, as
# its NVIDIA backend's options say below, and vLLM calls `fp8_e5m2` "the only fp8 KV dtype usable
# on Ampere" (`vllm/model_executor/layers/attention/attention.py: _init_kv_cache_quant`). labkit
# offers only e4m3.
#
# Prefill, bound by its matrix products rather than by reading K and V, takes a simpler path:
# PyTorch dequantizes the blocks it reads into a scratch pool, and the 16-bit kernel reads that.

# %%
# NBVAL_CHECK_OUTPUT
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend

fp8_types = {cc: CUDABackend(GPUTarget("cuda", cc, 32)).parse_options({"enable_fp_fusion": True}).supported_fp8_dtypes
             for cc in (75, 80, 86, 89, 90)}
for cc, types in fp8_types.items():
    print(f"sm{cc}: Triton's fp8 types {', '.join(types)}")
assert all("fp8e5" in types for types in fp8_types.values())  # e5m2 on every GPU
assert [cc for cc, types in fp8_types.items() if "fp8e4nv" in types] == [89, 90]  # e4m3 from sm89

# %% [markdown]
# ## 6. What it costs on the real model
#
# Two measurements, both through the paged cache with attention in bfloat16, so that only the
# storage differs:
#
# - **next-token loss** (mean cross-entropy, in nats) on 3,312 held-out tokens (see References), in
#   512-token chunks, every prediction reading the stored K and V as a decode step would;
#   per-tensor scales are calibrated on other text;
# - **greedy agreement** with the bfloat16 cache over 24 prompts of 64 new tokens: the share of
#   tokens before the first divergence, and its mean position.
#
# The full run (`benchmarks/kv_quant_quality.py`) takes tens of minutes on a CPU, so this notebook
# reads its committed results. First, a small version that runs here: the loss on 256 held-out
# tokens for three schemes.

# %%
# NBVAL_SKIP_IN_SOLUTIONS
live = {}
for name in ("auto", "int8_per_block", "int4_per_group"):
    live[name] = quant_quality.next_token_loss(model, held_out[:256], name)
    print(f"{'bfloat16' if name == 'auto' else name:16s} loss {live[name]:.3f} nats "
          f"({live[name] - live['auto']:+.3f})")
assert abs(live["int8_per_block"] - live["auto"]) < 0.02 < live["int4_per_group"] - live["auto"]

# %% [markdown]
# The full table, from `benchmarks/results/kv_quant_quality.json`. Its run (dated in its first line)
# rounded the scale to bfloat16 before multiplying; the small run above rounds once, as the kernels
# do, so a rerun of the table may differ in its last digits.

# %%
# NBVAL_CHECK_OUTPUT
RESULTS = None if STATIC is None else STATIC.parent / "kv_quant_quality.json"
if RESULTS is None:
    print("benchmarks/results/kv_quant_quality.json ships with the repository: clone it to see this table.")
else:
    quality = json.loads(RESULTS.read_text())
    meta, table = quality["meta"], quality["rows"]
    print(f"{meta['model']}, {meta['held_out_tokens']:,} held-out tokens, {meta['prompts']} prompts x "
          f"{meta['new_tokens']} tokens; `{meta['command']}`, {meta['date'][:10]}")
    print(f"{'scheme':26s} {'bytes/token':>11s} {'vs bf16':>7s} {'loss':>7s} {'increase':>9s} {'agreement':>9s} "
          f"{'1st divergence':>14s}")
    for r in table:
        print(f"{r['scheme']:26s} {r['bytes_per_token']:11,.0f} {r['bytes_vs_bf16']:7.3f} {r['loss']:7.4f} "
              f"{r['loss_increase']:+9.4f} {r['agreement']:9.1%} {r['mean_first_divergence']:14.1f}")
    by = {r["scheme"]: r for r in table}
    assert by["bfloat16"]["bytes_per_token"] == 23_040 and by["int4_per_group"]["bytes_per_token"] == 7_200
    assert max(abs(by[n]["loss_increase"]) for n in ("int8_per_tensor", "int8_per_block", "int8_per_group")) < 0.01
    assert by["int4_per_group"]["loss_increase"] < by["int4_per_block"]["loss_increase"] \
        < by["int4_per_tensor"]["loss_increase"]
    eight = [by[f"{e}_per_{p}"] for e in ("fp8", "int8") for p in ("tensor", "block", "group")]
    assert all(0.005 < by[f"fp8_per_{p}"]["loss_increase"] < 0.03 for p in ("tensor", "block", "group"))
    assert 0.1 < by["int4_per_group"]["loss_increase"] and by["int4_per_tensor"]["loss_increase"] > 0.5
    assert 18 < min(r["mean_first_divergence"] for r in eight) < max(r["mean_first_divergence"] for r in eight) < 37 \
        < by["float32"]["mean_first_divergence"] and by["int4_per_group"]["mean_first_divergence"] < 5

# %%
if RESULTS is not None:
    colours = {"fp8": "C0", "int8": "C1", "int4": "C2"}
    markers = {"tensor": "o", "block": "s", "group": "^"}
    fig, ax = plt.subplots(figsize=(7, 3.5))
    floor = 1e-3
    for r in table:
        element, _, placement = r["scheme"].partition("_per_")
        x_kib, y = r["bytes_per_token"] / 1024, max(r["loss_increase"], floor)
        if element in colours:
            hollow = "scale 1.0" in placement
            ax.scatter(x_kib, y, marker=markers[placement.split(",")[0]], color=colours[element],
                       facecolors="none" if hollow else colours[element], label=None)
        else:
            ax.scatter(x_kib, y, marker="D", color="grey")
        if element not in ("fp8", "int8"):  # the 8-bit points sit on top of each other: the legend names them
            ax.annotate(r["scheme"].replace("_per_", " per "), (x_kib, y), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")
    for element, colour in colours.items():
        ax.scatter([], [], color=colour, label=element)
    for placement, marker in markers.items():
        ax.scatter([], [], color="black", marker=marker, facecolors="none", label=f"per {placement}")
    ax.set_yscale("log")
    ax.set_xlabel("KV cache per token (KiB), scales included")
    ax.set_ylabel(f"loss increase (nats, ≥ {floor:g})")
    ax.set_title("int8 costs almost nothing, fp8 a little; int4 costs loss, least with fine scales")
    ax.legend(fontsize="small", ncol=2, loc="center right")
    fig.tight_layout()
    plt.show()

# %% [markdown]
# The float32 and bfloat16 caches differ by under a thousandth of a nat, so bfloat16 is a fair
# baseline; the int8 rows sit just as close to it, whatever the placement of their scales. fp8 costs
# about two hundredths of a nat with one scale per layer or per block and half that with one per 32
# elements: section 3's larger error, from a 3-bit mantissa that no scale can refine. fp8 with
# vLLM's default scale of 1.0 does as well as a calibrated one here: SmolLM2's K and V stay far
# inside ±448. That need not hold elsewhere: under a scale of 1.0, values below 2⁻⁶ are subnormal
# codes (section 1), and values past 448 are clamped, which is what a checkpoint's scales are for.
#
# Greedy agreement tells the same story less kindly. After the first flipped near-tie two greedy
# texts part ways: even the float32 cache parts from the bfloat16 one in a few outputs (mean first
# divergence 59 of 64 tokens). The 8-bit caches part after about 19 to 37 tokens on average, int8
# with groups of 32 lasting longest; int4 within 5. A divergence gives a different text, not
# necessarily a worse one; the loss measures worse.
#
# At 4 bits the placement decides: one scale per layer costs close to a nat, per block half as
# much, and per group of 32, the best int4 cache at a quarter more bytes than its codes, still
# costs more than any 8-bit one. On this small model int4 is a real trade, not a free one.
#
# ## 7. Fewer tokens, or one vector: sliding windows and a latent cache
#
# Chapter 02's formula also assumes that every layer keeps K and V for every token. Two kinds of
# real models do not.
#
# **Sliding-window layers** attend only to the last W tokens, so they keep only W. Mistral-7B-v0.1
# has a window in every layer; Gemma-2-9B alternates windowed layers with global ones. Past the
# window their caches stop growing, or grow at half the rate; each at its window and at its limit:

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
# In chapter 02's 60 GiB pool (an 80 GiB device, 20 GiB set aside), the window changes what fits
# only for the models that have one:

# %%
# NBVAL_CHECK_OUTPUT
device, set_aside, context = 80 * GiB, 20 * GiB, 8192
fit_formula, fit_window = {}, {}
for name in ("Qwen2.5-7B", "Mistral-7B-v0.1", "Llama-3-8B", "Gemma-2-9B"):
    shape = PRESETS[name]
    fit_formula[name] = capacity.sequences_that_fit(shape.cache_bytes(context, apply_window=False), device, set_aside)
    fit_window[name] = capacity.sequences_that_fit(shape.cache_bytes(context), device, set_aside)
    print(f"{name:17s} {fit_formula[name]:4d} sequences of {context:,} tokens by the formula, "
          f"{fit_window[name]:4d} with the window")
assert fit_formula == {"Qwen2.5-7B": 137, "Mistral-7B-v0.1": 60, "Llama-3-8B": 60, "Gemma-2-9B": 22}
assert fit_window == {"Qwen2.5-7B": 137, "Mistral-7B-v0.1": 120, "Llama-3-8B": 60, "Gemma-2-9B": 30}
assert fit_window["Mistral-7B-v0.1"] == 2 * fit_formula["Mistral-7B-v0.1"]  # the window halves its 8K cache

# %% [markdown]
# Mistral-7B's window of 4,096 tokens halves each 8,192-token cache and doubles what fits (60 to
# 120); Gemma-2-9B's windowed half of the layers takes it from 22 to 30. (vLLM budgets a window layer
# for more than its window; appendix A2 counts what it reserves.)
#
# **A latent cache.** DeepSeek-V3's multi-head latent attention (MLA) stores, per token and layer,
# one compressed vector (`kv_lora_rank` elements) plus a small key for the rotary position part
# (`qk_rope_head_dim` elements), shared by all its query heads: no separate K and V, so no factor 2.
# A full K and V for every head, as multi-head attention caches them, would cost far more:

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

# %% [markdown]
# Exercise 2 asks you to write both changes into the formula.
#
# ## 8. Back to capacity
#
# On the article's 7 GiB pool (chapter 02, section 6), the teaching model fits 7 sequences of 8,192
# tokens in bfloat16. Chapter 02's capacity explorer has a "KV cache dtype" menu with the three
# schemes this appendix recommends; here is what it computes:

# %%
# NBVAL_CHECK_OUTPUT
from labkit.teaching.widgets.capacity_explorer import KV_DTYPES, Setting

for label, kv in KV_DTYPES:
    shape = TEACHING_MODEL.with_dtype(kv) if kv in ("float32", "bfloat16") else TEACHING_MODEL
    s = Setting(shape, 8192, 7, 24, 17, kv_cache_dtype=kv)
    print(f"{label:36s} {format_bytes(s.bytes_per_token):>13s} per token, {s.sequences_that_fit:3d} sequences; "
          f"vLLM {s.vllm_kv_cache_dtype!r}: {s.vllm_lines()[1].split('request: ')[1]}")
assert Setting(TEACHING_MODEL, 8192, 7, 24, 17, kv_cache_dtype="int4_per_group").sequences_that_fit == 22

# %% [markdown]
# int8 with per-block scales fits 13 rather than 14: its scales, 1/512 of the pool, push the
# fourteenth out. vLLM's `int8_per_token_head` pays 1/32 in scales and fits 13 too. At 4 bits the
# placements part ways: labkit's groups of 32 spend 4 bytes per 32 elements and fit 22; vLLM's
# `int4_per_token_head` spends 4 bytes per 128 and fits 26, with coarser scales. Whether they are
# served fast enough is chapter 06's question; a quantized decode reads half the bytes per step,
# which helps there too.

# %% [markdown]
# ## Summary
#
# - A quantized cache stores codes and scales: x ≈ code × scale. fp8 (e4m3) errs relatively for
#   normal codes, about 2.25% on average and at most 1/16, and codes of 2⁻¹⁰ or less become 0; int8
#   and int4 err absolutely, by up to half a scale step, which small values do not survive.
# - The byte formula keeps its shape: b = 1 for fp8 and int8, 0.5 for int4, plus the scales: nothing
#   per token per tensor, 1/512 per 16-token block at 8 bits, 1/8 per group of 32 at 8 bits and 1/4
#   at 4 bits; vLLM's `*_per_token_head` dtypes add 8 bytes per head and token.
# - vLLM's `fp8` keeps one `k_scale` and one `v_scale` per layer: a quantized checkpoint's, or 1.0.
# - labkit's decode kernel dequantizes each tile between the load and the dot products; e4m3 needs
#   compute capability 8.9 in Triton (e5m2 does not), and below it labkit runs its reference.
# - On SmolLM2-135M, int8 changes the next-token loss by about a thousandth of a nat and fp8 by one
#   or two hundredths; int4 costs a tenth of a nat or more even with groups of 32.
# - A sliding-window layer keeps at most its window; a latent (MLA) cache keeps one vector per token
#   and layer, with no factor 2.
#
# ## What you can now do
#
# - Size a quantized, windowed or latent cache (`capacity.kv_bytes_per_token`, Exercise 2), and
#   compare it with vLLM's kv_cache_dtype in chapter 02's explorer.
# - Predict which placement of scales a model's keys need, from the spread of their values.
# - Run the real model on a quantized cache (`KVPool(..., kv_cache_dtype=...)`) and measure its
#   loss and greedy agreement (`quant_quality`).
#
# Back to [chapter 02](02_cost_per_token.ipynb), whose explorer offers these caches in its menu.

# %% [markdown]
# ## Exercises

# %%
from labkit.teaching.exercises import Exercises

ex = Exercises("A3_fewer_bytes_per_element")

# %%
# SOLUTIONS ONLY
ex.strict = True  # in solutions/ a failing checker fails the notebook tests

# %% [markdown]
# **Exercise 1.** Write int8 quantization with per-block scales, as labkit's `int8_per_block` cache
# stores it. `x` is the K (or V) of a pool, `[num_blocks, block_size, num_kv_heads, head_dim]`, float32.
#
# - `block_scales(x)`: one scale per block and KV head, `[num_blocks, num_kv_heads]`: the largest
#   |x| in that block and head, over 127.
# - `quantize(x, scales)`: int8 codes shaped like `x` for per-block `scales`: x / scale rounded to the
#   nearest integer (`torch.round`), clamped to −127..127. A block whose scale is 0 (all zeros) gets
#   codes 0. The checker also passes scales too small for the values, as a scale fixed before larger
#   values arrived would be.
# - `dequantize(codes, scales)`: float32 values, codes × their block's scale.
#
# The checker draws random pools (an all-zero block and an outlier included) and compares with
# labkit's answers; it refuses labkit's own `formats.quantize` and `formats.dequantize`.

# %%
def block_scales(x: torch.Tensor) -> torch.Tensor:
    # BEGIN SOLUTION
    return x.abs().amax(dim=(1, 3)) / 127  # over the block's slots and the head's elements
    # END SOLUTION


def quantize(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # BEGIN SOLUTION
    s = scales[:, None, :, None]  # [num_blocks, 1, num_kv_heads, 1]: broadcast over slots and elements
    y = x / torch.where(s > 0, s, torch.ones_like(s))  # an all-zero block: 0 / 1 = 0
    return torch.round(y).clamp(-127, 127).to(torch.int8)  # clamp before the cast: int8 would wrap
    # END SOLUTION


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # BEGIN SOLUTION
    return codes.float() * scales[:, None, :, None]
    # END SOLUTION


cases = build_it.kv_quant_cases()  # a fresh random draw each run
ex.check_behaviour("Exercise 1", (block_scales, quantize, dequantize), lambda answer: build_it.kv_quant_problems(answer, cases),
                   forbid=[formats.quantize, formats.dequantize, formats.dequantize_pool, formats.write_quantized],
                   hint="scales: amax over dims 1 and 3; quantize: divide by the scale broadcast as "
                        "[num_blocks, 1, num_kv_heads, 1], round, clamp to ±127, then .to(torch.int8).")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** Each block and head gets the scale that maps its largest |x| to 127, so every
# code fits int8; rounding to nearest keeps the error within half a step. The clamp matters only for
# a scale fixed earlier: without it, 200 becomes −56 when cast to int8. Broadcasting the scales as
# `[num_blocks, 1, num_kv_heads, 1]` gives every slot and element its own block's scale.

# %% [markdown]
# **Exercise 2 (build it).** Write `sequence_bytes(shape, length)`: the cache of one sequence of
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


ex.check_function("Exercise 2", sequence_bytes, build_it.sequence_bytes_cases(),
                  forbid=[capacity.ModelShape.cache_bytes, capacity.ModelShape.bytes_per_token,
                          capacity.ModelShape.bytes_per_token_per_layer, capacity.ModelShape.kv_factor,
                          capacity.ModelShape.block_bytes, capacity.bytes_per_token, capacity.cache_bytes],
                  hint="window layers keep min(length, window) tokens; the others keep all; latent: factor 1.")

# %% [markdown]
# SOLUTIONS ONLY
# **Why this works.** It is `labkit/memory/capacity.py: ModelShape.cache_bytes` with `kv_factor` and
# `bytes_per_token_per_layer` written out: each layer's bytes per token times the tokens it keeps.

# %% [markdown]
# ## References
#
# - vLLM 0.33.0 ([github.com/vllm-project/vllm](https://github.com/vllm-project/vllm)), the files
#   sections 2 and 5 name: `vllm/model_executor/layers/quantization/kv_cache.py`,
#   `vllm/model_executor/layers/attention/attention.py`, `vllm/config/cache.py` (`CacheDType`, the
#   accepted dtypes), `vllm/v1/attention/backends/triton_attn.py` and
#   `vllm/v1/attention/ops/int4_per_token_head.py`; its documentation's
#   [Quantized KV Cache](https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache/).
#   vLLM's first fp8 cache (e5m2, without scales) came in pull request
#   [#2279](https://github.com/vllm-project/vllm/pull/2279).
# - P. Micikevicius et al., "FP8 Formats for Deep Learning", arXiv 2209.05433 (2022): the e4m3 and
#   e5m2 formats, e4m3's largest value 448.
# - Z. Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024
#   (arXiv 2402.02750): outlier channels in keys; keys quantized per channel and values per token,
#   at 2 bits with zero points, the most recent tokens kept in full precision (section 3).
# - DeepSeek-AI, *DeepSeek-V3 Technical Report*, 2024, [arXiv:2412.19437](https://arxiv.org/abs/2412.19437):
#   multi-head latent attention (section 7).
# - Triton 3.9: `tl.float8e4nv` (e4m3) from compute capability 8.9, `tl.float8e5` (e5m2) on every
#   NVIDIA target (`triton/backends/nvidia/compiler.py: CUDABackend.parse_options`, section 5).
# - The held-out text: B. M. Gardiner, *The French Revolution 1789–1795* (Longmans, Green & Co., 1921),
#   as transcribed by Project Gutenberg (eBook #71688); see `labkit/data/README.md`.
