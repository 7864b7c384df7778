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
# # A3 · Fewer bytes per element: an fp8, int8 or int4 KV cache
#
# An appendix to [chapter 02](02_cost_per_token.ipynb), whose formula for one token's cache is
# 2 × L × Hkv × D × b. Chapter 02 noted that an 8-bit cache halves b, and appendix A2 showed vLLM
# doubling its concurrency with `kv_cache_dtype="fp8"`. Every other cache in this book stores at
# least 2 bytes per element. Here we build caches that store 1 byte, or half of one, run the real
# model on them, and measure what the saved bytes cost.
#
# **What you will learn**
#
# - what a *code* and a *scale* are, and how fp8 (e4m3), int8 and int4 differ in the error they make;
# - where the scales can live (one per layer, as vLLM's `k_scale` and `v_scale`; one per block and
#   head; one per 32 elements) and what each placement adds to the byte formula;
# - how labkit's paged cache keeps scales beside its blocks, and how the Triton decode kernel turns
#   codes back into numbers after loading them and before the dot products;
# - what each scheme costs on SmolLM2-135M: next-token loss on held-out text, and how long greedy
#   decoding stays identical to a bfloat16 cache;
# - which GPUs cannot run an fp8 kernel, and what labkit runs there instead.

# %%
from labkit.teaching.diagrams import roadmap

roadmap("A3");  # the article's pipeline, this appendix's part highlighted

# %% [markdown]
# **You need:** chapter 02: the byte formula; chapter 03: the paged pool and its decode kernel;
# chapter 01: the real model.
#
# **Time:** about 30 minutes to read and run.

# %%
import json

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
from labkit.units import format_bytes

# %% [markdown]
# ## 1. A code and a scale
#
# A quantized cache stores each element as a small *code* and keeps, elsewhere, a *scale* that turns
# codes back into numbers: x ≈ code × scale. int8 keeps codes from −127 to 127, int4 from −7 to 7;
# the scale is chosen so that the largest |x| maps to the largest code, and every other value is
# divided by the scale and rounded to the nearest integer. fp8's codes are floating-point numbers
# themselves, e4m3: 4 bits of exponent, 3 of mantissa, largest value 448. Between two powers of two
# it has 8 steps, so its error is *relative*, about 3% on average and at most one part in 16, while
# int8's is *absolute*, at most half a scale step whatever the value.
#
# Quantize values from 0.01 to 10 with the scale set by the largest, 10:

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

# %% [markdown]
# With one scale for everything, int8 and int4 lose the small values: 0.01 is below half a step and
# becomes 0. fp8 keeps every value within 1/16 of itself. Real keys and values are not spread that
# widely inside one head, but a few channels can be much larger than the rest (KIVI, in the
# references, finds this in keys), and those set the scale for everything else. That is why it
# matters where the scales live.
#
# ## 2. Where the scales live, and what they cost
#
# `labkit.memory.formats` offers three placements for each element format, named `"<element>_per_<scales>"`:
#
# - **per tensor**: one scale for all of a layer's K, one for its V. This is vLLM's
#   `kv_cache_dtype="fp8"`: `BaseKVCacheMethod.process_weights_after_loading`
#   (`vllm/model_executor/layers/quantization/kv_cache.py`, vLLM 0.33.0) reads `k_scale` and
#   `v_scale` from the checkpoint, duplicates a single `kv_scale` to both, and uses 1.0 when the
#   checkpoint has none (it logs a warning). labkit starts at 1.0 too; `quant_quality.calibrate_kv_scales` measures
#   each layer's max |K| and max |V| on sample text, as the tools that write such checkpoints do.
#   The scales are fixed before serving: a later value past them is clamped.
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
# vLLM's own 8-bit and 4-bit alternatives to per-tensor scales, `int8_per_token_head` and
# `int4_per_token_head`, keep two float32 scales per token and head in the page
# (`TritonAttentionBackend.customize_spec`, `vllm/v1/attention/backends/triton_attn.py`):
# 8 bytes per head and token, 1/32 of an int8 head of 128 elements (`labkit.vllm_bridge.predict.page_size_bytes`).
#
# ## 3. What each placement keeps of the real keys and values
#
# Which placement fits depends on the numbers. Run SmolLM2-135M-Instruct, the book's real model, over
# 256 tokens of text with a cache that records each layer's K and V, then push them through every
# scheme and measure the relative error ‖x̂ − x‖ / ‖x‖, averaged over every third layer (per-tensor
# scales from each layer's own max |x| here):

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

# %% [markdown]
# 8-bit codes keep K and V within 1% to 3%, and int8 does better than fp8 here: with a scale that
# fits, int8's 255 evenly spaced steps are finer than fp8's 3-bit mantissa for all but the smallest
# values. At 4 bits there are only 15 steps and the placement decides: one scale per layer leaves
# most values a few steps each, and the error falls by half from one scale per layer to one per
# 32 elements. Section 6 turns these errors into what a reader of the model's output notices.
#
# ## 4. Codes and scales beside the blocks
#
# `KVPool(..., kv_cache_dtype=...)` (chapter 03's pool) stores a quantized cache: for every layer,
# `k_caches` and `v_caches` hold the codes in the paged layout (int4: head_dim / 2 bytes per head),
# and `k_scales` and `v_scales` the scales. `write_kv` (chapter 03's scatter) quantizes as it writes.
# A per-block scale grows with the block: write a token, then one four times as large into the next
# slot of the same block:

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
# size, but now on a coarser grid, rounded a second time. That is the price of a scale shared by
# tokens that arrive at different times. Per-tensor scales never change, and per-group scales
# belong to one token, so neither touches earlier tokens; vLLM's per-token-head scales avoid it
# the same way. A pool keeps its scales beside its blocks in every other sense too:
# `copy_blocks` (chapter 04's copy-on-write) copies a block's scales with its codes.
#
# ## 5. The kernel: dequantize after the load, before the dot
#
# Decode is memory-bound (chapter 06): each step reads every cached K and V once. The saving is
# real only if the kernel reads the small codes and widens them in registers. labkit's decode
# kernel (chapter 03) does exactly that: where it loaded a K or V tile, a quantized pool calls this
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
# `tests/test_quant.py` checks every scheme this way, with poisoned pools and scales, and checks the
# kernel's writes byte for byte against `formats.write_quantized`. `benchmarks/kernels_static.py`
# compiles the new launches ahead of time for five GPU generations, as it does the others
# ([appendix A1](A1_under_the_compiler.ipynb)). The decode launches over quantized pools, from the
# committed table:

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
# No launch spills or overflows shared memory. fp8 is missing below sm89: Triton converts e4m3 only
# from compute capability 8.9 (Ada, Hopper), and refuses `fp8e4nv` for a T4, an A100 or an A10. On
# those GPUs `fallback_reason` says so and labkit runs the PyTorch reference, which
# dequantizes and then attends; int8 and int4 are plain integers and compile everywhere. On the
# FMA path (float32, or any dtype on a T4) the quantized decode runs on 8 warps with its loads not
# pipelined: with two stages in flight, ptxas spilled up to 7 KiB of registers at head_dim 256
# (`labkit.kernels.launch.launch_settings(..., quantized=True)`).
#
# Prefill, bound by its matrix products rather than by reading K and V, takes a simpler path:
# PyTorch dequantizes the blocks it reads into a scratch pool, and the 16-bit kernel reads that.
#
# ## 6. What it costs on the real model
#
# Two measurements, both through the paged cache with attention in bfloat16, so that only the
# storage differs from the bfloat16 cache:
#
# - **next-token loss** (mean cross-entropy, in nats) on a held-out text of 3,312 tokens: chapter I
#   of B. M. Gardiner's *The French Revolution 1789–1795* (1921, public domain, shipped in
#   `labkit/data/`). The text goes in 512-token chunks; every prediction reads the stored K and V of
#   all earlier tokens and of its own, as a decode step would. Per-tensor scales are calibrated on
#   the book's preface, never on the held-out text;
# - **greedy agreement** with the bfloat16 cache: 24 chat prompts, 64 new tokens each. Once two
#   greedy outputs differ they condition on different text, so only the tokens before the first
#   divergence count; the table gives their share and the mean position of the first divergence.
#
# The full run (`benchmarks/kv_quant_quality.py`) takes tens of minutes on a CPU, so this notebook
# reads its committed results file. First, a smaller version that runs here: the loss on the first
# 256 held-out tokens for three schemes.

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
# came before the CPU path learned to dequantize as the kernels do, codes times scale in float32
# rounded once to bfloat16 (it used to round the scale to bfloat16 first); the small run above uses
# the new arithmetic, so its last digits need not match a rerun of the table.

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
# Read the table from the top. The float32 and bfloat16 caches differ by under a thousandth of a
# nat: rounding K and V to bfloat16 costs nothing visible, so it is a fair baseline. The int8 rows
# sit just as close to it, whatever the placement of their scales. fp8 costs more, about two
# hundredths of a nat with one scale per layer or per block and half that with one per 32
# elements: section 3's larger error, from a 3-bit mantissa that no scale can refine. fp8 with
# vLLM's default scale of 1.0 does as well as a calibrated one here, because e4m3's error is
# relative and SmolLM2's K and V stay far inside ±448; keys that grew past 448 would be clamped,
# which is what a checkpoint's scales are for.
#
# Greedy agreement tells the same story less kindly. A small change flips a near-tie sooner or
# later, and after the first flip two greedy texts part ways: even the float32 cache parts from the
# bfloat16 one in a few outputs (mean first divergence 59 of 64 tokens). The 8-bit caches part after
# about 19 to 37 tokens on average, int8 with groups of 32 lasting longest; int4 within 5. Read
# that column against the float32 row, not against 100%: a divergence gives a different text, not
# necessarily a worse one; the loss measures worse.
#
# At 4 bits the placement decides. One scale per layer costs close to a nat and most outputs part
# from the bfloat16 ones within a few tokens; per block is better; per group of 32 is the best
# int4 cache, at a quarter more bytes than its codes, and still costs more than any 8-bit one. On
# this small model int4 is a real trade, not a free one.
#
# ## 7. Back to capacity
#
# On the article's 7 GiB pool (chapter 02, section 8), the teaching model fits 7 sequences of 8,192
# tokens in bfloat16. The capacity explorer of chapter 02 now has a "KV cache dtype" menu with the
# three schemes this appendix recommends; here is what it computes:

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
# fourteenth sequence out by a few KiB. vLLM's `int8_per_token_head` pays 1/32 in scales and fits 13
# too. At 4 bits the placements part ways: labkit's groups of 32 spend 4 bytes per 32 elements and fit
# 22, vLLM's `int4_per_token_head` spends 4 bytes per head of 128 and fits 26, with coarser scales. The numbers of sequences are what the pool holds; whether they are served fast enough is
# chapter 06's question, and a quantized decode reads half the bytes per step, which helps there too.

# %% [markdown]
# ## Summary
#
# - A quantized cache stores codes and scales: x ≈ code × scale. fp8 (e4m3) errs relatively, about
#   3%; int8 and int4 err absolutely, by up to half a scale step, which small values do not survive.
# - The byte formula keeps its shape: b = 1 for fp8 and int8, 0.5 for int4, plus the scales: nothing
#   per token per tensor, 1/512 per 16-token block at 8 bits, 1/8 per group of 32 at 8 bits and 1/4
#   at 4 bits.
# - vLLM's `fp8` keeps one `k_scale` and one `v_scale` per layer, read from the checkpoint or 1.0.
# - labkit's paged pool keeps codes in the block layout and scales beside them; `write_kv`
#   quantizes, a per-block scale grows and re-encodes the block, and the decode kernel dequantizes
#   each tile after loading it and before the dot products. fp8 needs compute capability 8.9; below
#   it labkit names the reference it runs.
# - On SmolLM2-135M, int8 changes the next-token loss by about a thousandth of a nat and fp8 by one
#   or two hundredths; int4 costs a tenth of a nat or more even with groups of 32, and close to a
#   nat with one scale per layer.
#
# ## What you can now do
#
# - Size a quantized cache with scales included (`capacity.kv_bytes_per_token`), and compare it with
#   vLLM's own kv_cache_dtype in chapter 02's explorer.
# - Predict which placement of scales a model's keys need, from the spread of their values.
# - Run the real model on any of nine quantized caches (`KVPool(..., kv_cache_dtype=...)`) and
#   measure its loss and greedy agreement (`quant_quality.next_token_loss`, `quant_quality.greedy_agreement`).
# - Read a Triton kernel that widens codes in registers, and say where it cannot compile.
#
# Back to [chapter 02](02_cost_per_token.ipynb), section 7, where an 8-bit cache first halved b.

# %% [markdown]
# ## Exercise

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
# code fits int8; rounding to the nearest integer keeps the error within half a step, where
# truncation would double it and bias it towards zero. The clamp matters only when the scale was
# fixed earlier, as a per-tensor scale is: without it, 200 becomes −56 when cast to int8. Broadcasting
# the scales as `[num_blocks, 1, num_kv_heads, 1]` gives every slot and element its own block's scale.

# %% [markdown]
# ## References
#
# - vLLM 0.33.0 ([github.com/vllm-project/vllm](https://github.com/vllm-project/vllm)): per-tensor
#   scales in `vllm/model_executor/layers/quantization/kv_cache.py` (`BaseKVCacheMethod`), defaults
#   in `vllm/model_executor/layers/attention/attention.py` (`set_default_quant_scales`), the
#   accepted dtypes in `vllm/config/cache.py` (`CacheDType`), the per-token-head page in
#   `vllm/v1/attention/backends/triton_attn.py` (`TritonAttentionBackend.customize_spec`). vLLM's
#   first fp8 cache (e5m2, without scales) came in pull request
#   [#2279](https://github.com/vllm-project/vllm/pull/2279).
# - P. Micikevicius et al., "FP8 Formats for Deep Learning", arXiv 2209.05433 (2022): the e4m3 and
#   e5m2 formats, e4m3's largest value 448.
# - Z. Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024
#   (arXiv 2402.02750): keys quantized per channel and values per token, for the outlier channels of
#   section 3.
# - Triton: `tl.float8e4nv` needs compute capability 8.9 (the compiler's message, seen in section 5).
# - The held-out text: B. M. Gardiner, *The French Revolution 1789–1795* (Longmans, Green & Co., 1921),
#   as transcribed by Project Gutenberg (eBook #71688); see `labkit/data/README.md`.
