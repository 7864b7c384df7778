"""labkit.memory.capacity: the byte formula against real tensors and plain references; presets; sharding; capacity."""

from __future__ import annotations

import random
import re

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from labkit.caches.contiguous import KVCache
from labkit.memory import capacity
from labkit.memory.blocks import blocks_needed
from labkit.memory.capacity import PRESETS, TEACHING_MODEL, ModelShape
from labkit.model.decoder import Decoder, DecoderConfig
from labkit.units import GiB, KiB, MiB, format_bytes


def allocated_bytes(length: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """The plain reference: allocate one K and one V tensor [length, Hkv, D] per layer and count."""
    return sum(torch.empty(length, num_kv_heads, head_dim, dtype=dtype).nbytes for _ in range(2 * num_layers))


# ------------------------------------------------------------------ the formula


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_formula_matches_allocated_tensors_for_random_shapes(dtype):
    rng = random.Random(str(dtype))
    for _ in range(20):
        layers, heads, dim, length = rng.randint(1, 6), rng.randint(1, 9), rng.randint(1, 40), rng.randint(0, 23)
        expected = allocated_bytes(length, layers, heads, dim, dtype)
        assert capacity.cache_bytes(length, layers, heads, dim, dtype=dtype) == expected
        assert capacity.cache_bytes(length, layers, heads, dim, dtype.itemsize) == expected
        shape = ModelShape("random", layers, heads, dim, dtype_bytes=dtype.itemsize)
        assert shape.cache_bytes(length) == expected
        if length:
            assert capacity.bytes_per_token(layers, heads, dim, dtype=dtype) == expected // length


def test_teaching_model_matches_allocated_bf16_tensors():
    for length in [1, 3, 16, 37]:
        assert TEACHING_MODEL.cache_bytes(length) == allocated_bytes(length, 32, 8, 128, torch.bfloat16)


@pytest.mark.parametrize("prompt_len", [1, 5, 37])
def test_formula_matches_the_chapter_01_cache_after_prefill_and_decode(prompt_len):
    model = Decoder.random(DecoderConfig(num_hidden_layers=3, num_key_value_heads=4, hidden_size=128))
    shape = ModelShape.from_config(model.config.to_dict(), dtype=torch.float32)
    cache = KVCache(model.config)
    ids = torch.randint(0, model.config.vocab_size, (2, prompt_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids, cache=cache)
        assert cache.nbytes == 2 * shape.cache_bytes(prompt_len)  # batch of 2 sequences
        model(ids[:, :1], cache=cache)
    assert cache.nbytes == 2 * shape.cache_bytes(prompt_len + 1)


def test_element_size_agrees_with_torch_for_every_torch_name():
    for name, size in capacity.DTYPE_BYTES.items():
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            assert size == torch.empty((), dtype=dtype).element_size(), name
    assert capacity.element_size("torch.bfloat16") == 2
    assert capacity.element_size("BF16") == 2


def test_a_sequence_takes_whole_blocks():
    assert TEACHING_MODEL.block_bytes(16) == 16 * TEACHING_MODEL.bytes_per_token()
    for length in [1, 15, 16, 17, 37]:
        n = blocks_needed(length, 16)
        assert n * TEACHING_MODEL.block_bytes(16) >= TEACHING_MODEL.cache_bytes(length)
        assert (n - 1) * TEACHING_MODEL.block_bytes(16) < TEACHING_MODEL.cache_bytes(length)


# ------------------------------------------------------------------ the article's figures, as printed


def test_format_bytes_prints_the_articles_figures():
    t = TEACHING_MODEL
    f = format_bytes
    assert f(t.bytes_per_token(), "bytes") == "131,072 bytes"
    assert f(t.bytes_per_token()) == "128 KiB"
    assert f(t.cache_bytes(8192)) == "1 GiB"
    assert f(t.cache_bytes(4096), "GiB") == "0.5 GiB"
    assert f(t.cache_bytes(2048), "GiB") == "0.25 GiB"
    assert f(t.cache_bytes(8192 + 4096 + 2048)) == "1.75 GiB"
    assert f(3 * t.cache_bytes(8192)) == "3 GiB"
    assert f(t.block_bytes(16)) == "2 MiB"
    assert f((blocks_needed(37, 16) * 16 - 37) * t.bytes_per_token()) == "1.375 MiB"
    assert f(3 * t.block_bytes(16)) == "6 MiB"


def test_format_bytes_with_a_unit_parses_back_to_the_value():
    rng = random.Random(1)
    for unit, size in [("KiB", KiB), ("MiB", MiB), ("GiB", GiB)]:
        for _ in range(30):
            n = rng.randint(0, 2**40)
            text = format_bytes(n, unit)
            assert text.endswith(" " + unit)
            assert abs(float(text.split()[0].replace(",", "")) - n / size) <= 0.0005 + 1e-12
    with pytest.raises(ValueError, match="unit must be one of"):
        format_bytes(1, "GB")


# ------------------------------------------------------------------ presets and config.json


# transformers' own config classes: an independent reading of the same config.json keys.
HF_CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                     "gemma2": "Gemma2Config", "deepseek_v3": "DeepseekV3Config"}


def hf_config(excerpt: dict):
    """The excerpt loaded by the transformers class its model_type names."""
    import transformers

    cls = getattr(transformers, HF_CONFIG_CLASSES[excerpt["model_type"]])
    return cls(**{k: v for k, v in excerpt.items() if not k.startswith("_") and k != "torch_dtype"})


@pytest.mark.parametrize("name", list(capacity.PRESET_CONFIGS))
def test_presets_are_read_from_their_config_excerpts_as_transformers_reads_them(name):
    """Each preset is ModelShape.from_config applied to its config.json excerpt, and agrees with transformers.

    The excerpts in capacity.PRESET_CONFIGS are transcribed by hand from the public
    config.json files named in each preset's source (they cannot be downloaded here),
    so this test cannot prove the transcription right; FACTS.md's sizes are checked in
    the next test. What it does check is the parsing path: the preset is exactly what
    from_config makes of the excerpt, and from_config reads every key the way
    transformers' own config class for that model_type does (head_dim derived from
    hidden_size, GQA heads, sliding-window layers, MLA ranks, the context limit).
    """
    excerpt, preset = capacity.PRESET_CONFIGS[name], PRESETS[name]
    assert preset == ModelShape.from_config(excerpt, name=name, dtype="bfloat16", source=preset.source)
    assert excerpt["_name_or_path"] in preset.source

    hf = hf_config(excerpt)
    assert preset.num_layers == hf.num_hidden_layers
    assert preset.max_position_embeddings == hf.max_position_embeddings
    assert preset.dtype_bytes == 2  # every preset assumes a bf16 cache, as served
    if preset.latent:  # MLA: one latent vector of kv_lora_rank + qk_rope_head_dim per token and layer
        assert (preset.num_kv_heads, preset.head_dim) == (1, hf.kv_lora_rank + hf.qk_rope_head_dim)
        return
    assert preset.num_attention_heads == hf.num_attention_heads
    assert preset.num_kv_heads == hf.num_key_value_heads
    assert preset.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:  # transformers lists, layer by layer, which ones use the window
        expected = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    else:  # MistralConfig: one window for every layer, when there is one
        expected = tuple(range(hf.num_hidden_layers)) if getattr(hf, "sliding_window", None) else ()
    assert preset.sliding_layers == expected
    assert preset.sliding_window == (hf.sliding_window if expected else None)


def test_from_config_reads_the_context_limit():
    cfg = capacity.PRESET_CONFIGS["Llama-3-8B"]
    assert ModelShape.from_config(cfg).max_position_embeddings == cfg["max_position_embeddings"]
    without = {k: v for k, v in cfg.items() if k != "max_position_embeddings"}
    assert ModelShape.from_config(without).max_position_embeddings is None


def test_beyond_context_is_a_comparison_with_max_position_embeddings():
    rng = random.Random(11)
    for _ in range(50):
        limit = rng.choice([None, rng.randint(1, 200_000)])
        shape = ModelShape("m", 2, 2, 8, max_position_embeddings=limit)
        for length in [0, 1, rng.randint(0, 300_000)] + ([limit - 1, limit, limit + 1] if limit else []):
            assert shape.beyond_context(length) == (limit is not None and length > limit)
            assert shape.cache_bytes(length) == length * shape.bytes_per_token()  # the bytes do not change
    shard = capacity.shard(PRESETS["Llama-3-70B"], tensor_parallel_size=8, pipeline_parallel_size=2)
    assert shard.max_position_embeddings == PRESETS["Llama-3-70B"].max_position_embeddings


def test_preset_sizes_match_the_facts_table():
    expected_kib = {"Llama-3-8B": 128, "Llama-3-70B": 320, "Mistral-7B-v0.1": 128, "Qwen2.5-7B": 56,
                    "Gemma-2-9B": 336, "teaching model": 128}
    for name, kib in expected_kib.items():
        assert PRESETS[name].bytes_per_token() == kib * KiB, name
    assert PRESETS["DeepSeek-V3"].bytes_per_token() / KiB == pytest.approx(68.6, abs=0.05)
    assert PRESETS["DeepSeek-V3"].bytes_per_token() == 61 * (512 + 64) * 2  # no factor 2


def test_from_config_defaults_and_overrides():
    mha = ModelShape.from_config({"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": None, "torch_dtype": "float16"})
    assert (mha.num_kv_heads, mha.head_dim, mha.dtype_bytes) == (4, 64, 2)
    cfg = dict(capacity.PRESET_CONFIGS["Llama-3-8B"])
    assert ModelShape.from_config(cfg, dtype="fp8").dtype_bytes == 1
    # A float32 checkpoint is served in 16 bits (vLLM's dtype "auto"); dtype= keeps float32 on request.
    assert ModelShape.from_config(cfg | {"dtype": "float32", "torch_dtype": None}).dtype_bytes == 2
    assert ModelShape.from_config(cfg | {"torch_dtype": "float32"}, dtype="float32").dtype_bytes == 4
    gemma_new = capacity.PRESET_CONFIGS["Gemma-2-9B"] | {"layer_types": ["sliding_attention", "full_attention"] * 21}
    assert ModelShape.from_config(gemma_new).sliding_layers == tuple(range(0, 42, 2))
    with pytest.raises(ValueError, match="torch_dtype"):
        ModelShape.from_config({k: v for k, v in cfg.items() if k != "torch_dtype"})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelShape.from_config({"num_attention_heads": 4, "hidden_size": 64, "torch_dtype": "bf16"})
    with pytest.raises(ValueError, match="num_kv_heads must be an integer >= 1, got 0"):
        ModelShape.from_config(cfg | {"num_key_value_heads": 0})


def test_one_config_one_answer_through_both_paths():
    # Gemma 2's config.json says float32; vLLM serves it in bf16. As a dict through kv_cache_report
    # and through ModelShape.from_config it is the same shape: 2 × 16 × 8 × 256 × 2 = 131,072 B pages.
    from labkit.vllm_bridge import predict
    config = capacity.PRESET_CONFIGS["Gemma-2-9B"]
    shape = ModelShape.from_config(config)
    assert shape.dtype_bytes == 2 and shape == ModelShape.from_config(config, dtype="bfloat16")
    by_dict = predict.kv_cache_report(config, 20 * GiB, max_model_len=8192)
    by_shape = predict.kv_cache_report(shape, 20 * GiB, max_model_len=8192)
    assert by_dict == by_shape and by_dict.page_size_bytes == 131_072


def test_from_config_reads_the_chapter_01_decoder_config_dict():
    cfg = DecoderConfig(num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=2, hidden_size=128)
    shape = ModelShape.from_config(cfg.to_dict(), dtype=torch.bfloat16)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes) == (5, 2, 16, 2)


def test_query_head_mistake_is_off_by_the_group_size():
    for p in PRESETS.values():
        if p.num_attention_heads is None:
            with pytest.raises(ValueError, match="num_attention_heads"):
                p.query_head_mistake()
            continue
        assert p.query_head_mistake() * p.num_kv_heads == p.bytes_per_token() * p.num_attention_heads


# ------------------------------------------------------------------ extensions beyond the article


def test_eight_bit_cache_halves_bf16_and_quarters_fp32():
    for p in PRESETS.values():
        assert 2 * p.with_dtype("fp8").bytes_per_token() == p.bytes_per_token()
        assert p.with_dtype(torch.float32).bytes_per_token() == 2 * p.bytes_per_token()


def test_sliding_window_against_a_per_layer_loop():
    rng = random.Random(5)
    for _ in range(40):
        layers, window = rng.randint(1, 12), rng.randint(1, 50)
        sliding = tuple(sorted(rng.sample(range(layers), rng.randint(0, layers))))
        shape = ModelShape("w", layers, rng.randint(1, 4), rng.choice([8, 16]), 2,
                           sliding_window=window if sliding else rng.choice([None, window]), sliding_layers=sliding)
        for length in [0, 1, window - 1, window, window + 1, rng.randint(0, 200)]:
            if length < 0:
                continue
            per_layer = [min(length, window) if i in sliding else length for i in range(layers)]
            expected = sum(per_layer) * shape.bytes_per_token_per_layer()
            assert shape.cache_bytes(length) == expected
            assert shape.cache_bytes(length, apply_window=False) == length * shape.bytes_per_token()


def test_latent_cache_has_no_factor_two():
    latent = ModelShape("mla", 4, 1, 96, 2, latent=True)
    plain = ModelShape("mqa", 4, 1, 96, 2)
    assert 2 * latent.bytes_per_token() == plain.bytes_per_token()
    assert latent.cache_bytes(7) == 7 * 4 * 96 * 2
    with pytest.raises(ValueError, match="num_kv_heads must be 1"):
        ModelShape("bad", 4, 2, 96, 2, latent=True)


# ------------------------------------------------------------------ sharding


def reference_device_bytes(shape: ModelShape, tp: int, pp: int, length: int) -> list[int]:
    """Place every (layer, KV head) on devices one by one and count each device's bytes."""
    per_head_layer = shape.kv_factor * shape.head_dim * shape.dtype_bytes
    counts = [[0] * tp for _ in range(pp)]
    # vLLM's get_pp_indices: the last stage takes layers // pp; each earlier stage one more while the
    # remainder lasts, counting back from the second-to-last stage.
    extra = shape.num_layers % pp
    sizes = [shape.num_layers // pp + (1 if pp - 1 - extra <= s < pp - 1 else 0) for s in range(pp)]
    stage_of = [s for s in range(pp) for _ in range(sizes[s])]
    for layer in range(shape.num_layers):
        tokens = min(length, shape.sliding_window) if layer in shape.sliding_layers else length
        for rank in range(tp):
            if tp <= shape.num_kv_heads:
                heads = shape.num_kv_heads // tp  # rank holds heads [rank*h, (rank+1)*h)
            else:
                heads = 1  # rank holds head rank // (tp // Hkv), replicated
            counts[stage_of[layer]][rank] += heads * tokens * per_head_layer
    return [c for stage in counts for c in stage]


@pytest.mark.parametrize("name", list(PRESETS))
def test_shard_is_the_busiest_device_of_a_head_by_head_placement(name):
    shape = PRESETS[name]
    rng = random.Random(name)
    tps = [t for t in [1, 2, 4, 8, 16, 32] if t % shape.num_kv_heads == 0 or shape.num_kv_heads % t == 0]
    for tp in tps:
        for pp in [1, 2, 3, 4, 7]:
            device = capacity.shard(shape, tp, pp)
            for length in [1, 4096, rng.randint(1, 40000)]:
                ref = reference_device_bytes(shape, tp, pp, length)
                assert device.cache_bytes(length) == max(ref), (tp, pp, length)
            assert device.bytes_per_token() == max(reference_device_bytes(
                replace_window(shape), tp, pp, 1))


def replace_window(shape: ModelShape) -> ModelShape:
    from dataclasses import replace
    return replace(shape, sliding_window=None, sliding_layers=())


def test_tensor_parallel_replicates_when_devices_outnumber_kv_heads():
    p = PRESETS["Llama-3-70B"]
    assert capacity.kv_heads_per_device(8, 8) == capacity.kv_heads_per_device(8, 16) == 1
    assert capacity.shard(p, 16).bytes_per_token() == capacity.shard(p, 8).bytes_per_token()
    assert capacity.shard(PRESETS["DeepSeek-V3"], 8).bytes_per_token() == PRESETS["DeepSeek-V3"].bytes_per_token()
    with pytest.raises(ValueError, match=r"tensor_parallel_size must divide num_kv_heads \(8\)"):
        capacity.kv_heads_per_device(8, 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must divide num_kv_heads \(8\)"):
        capacity.kv_heads_per_device(8, 5)  # vLLM's QKVParallelLinear: divide(8, 5) fails
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be a multiple of num_kv_heads \(8\)"):
        capacity.kv_heads_per_device(8, 12)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        capacity.kv_heads_per_device(8, 0)


def test_pipeline_stages_cover_every_layer_once():
    for layers in [1, 7, 32, 61, 80]:
        for pp in range(1, min(layers, 9) + 1):
            stages = capacity.pipeline_stages(layers, pp)
            assert [i for s in stages for i in s] == list(range(layers))
            assert max(map(len, stages)) - min(map(len, stages)) <= 1
    with pytest.raises(ValueError, match=r"pipeline_parallel_size must be in \[1, 4\]"):
        capacity.pipeline_stages(4, 5)


def test_pipeline_stages_follow_vllms_get_pp_indices():
    # vllm/distributed/utils.py get_pp_indices (vLLM 0.33.0): partitions[-i] += 1 for i in 2 .. remainder + 1.
    assert [len(s) for s in capacity.pipeline_stages(61, 4)] == [15, 15, 16, 15]
    assert [len(s) for s in capacity.pipeline_stages(80, 3)] == [27, 27, 26]
    assert [len(s) for s in capacity.pipeline_stages(7, 4)] == [2, 2, 2, 1]
    assert capacity.pipeline_stages(10, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    for layers in [1, 7, 32, 42, 61, 80]:
        for pp in range(1, min(layers, 9) + 1):
            assert len(capacity.pipeline_stages(layers, pp)[-1]) == layers // pp  # never an extra on the last


# ------------------------------------------------------------------ capacity


def test_sequences_that_fit_the_articles_device():
    assert capacity.kv_pool_bytes(24 * GiB, 17 * GiB) == 7 * GiB
    assert capacity.sequences_that_fit(TEACHING_MODEL.cache_bytes(8192), 24 * GiB, 17 * GiB) == 7


def test_sequences_that_fit_against_integer_division():
    rng = random.Random(7)
    for _ in range(200):
        per_seq, device = rng.randint(1, 2**32), rng.randint(1, 2**40)
        reserved = rng.randint(0, device)
        assert capacity.sequences_that_fit(per_seq, device, reserved) == (device - reserved) // per_seq
    assert capacity.sequences_that_fit(GiB, 1.5 * GiB, 0.25 * GiB) == 1  # fractional GiB are fine


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_layers=0), "num_layers must be an integer >= 1, got 0"),
    (dict(num_kv_heads=-2), "num_kv_heads must be an integer >= 1, got -2"),
    (dict(head_dim=2.5), "head_dim must be an integer >= 1, got 2.5"),
    (dict(length=3.5), "length must be an integer >= 0, got 3.5"),
    (dict(length=-1), "length must be an integer >= 0, got -1"),
    (dict(length=True), "length must be an integer >= 0, got True"),
    (dict(dtype="float12"), "dtype must be one of"),
    (dict(dtype=None, dtype_bytes=0), "dtype_bytes must be an integer >= 1, got 0"),
    (dict(dtype_bytes=2), "give exactly one of dtype_bytes"),
    (dict(dtype=None), "give exactly one of dtype_bytes"),
])
def test_cache_bytes_refuses_bad_input(kwargs, message):
    args = dict(length=8, num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16") | kwargs
    with pytest.raises(ValueError, match=re.escape(message)):
        capacity.cache_bytes(**args)


def test_capacity_refuses_bad_memory_sizes():
    with pytest.raises(ValueError, match=r"reserved_bytes must be in \[0, device_bytes="):
        capacity.sequences_that_fit(GiB, 24 * GiB, 25 * GiB)
    for device in [0, 0.0, -1, float("nan"), float("inf"), "24 GiB", True]:
        with pytest.raises(ValueError, match=re.escape(f"device_bytes must be a finite number of bytes > 0, got {device!r}")):
            capacity.kv_pool_bytes(device, 0)
        with pytest.raises(ValueError, match="device_bytes must be a finite number of bytes > 0"):
            capacity.sequences_that_fit(1, device, 0)
    assert capacity.kv_pool_bytes(GiB, GiB) == 0  # a device may have nothing left for the cache
    with pytest.raises(ValueError, match="reserved_bytes must be a finite number of bytes >= 0, got -1"):
        capacity.kv_pool_bytes(GiB, -1)
    with pytest.raises(ValueError, match="reserved_bytes must be a finite number of bytes >= 0"):
        capacity.kv_pool_bytes(GiB, float("nan"))
    with pytest.raises(ValueError, match="bytes_per_sequence must be an integer >= 1"):
        capacity.sequences_that_fit(0, GiB, 0)


def test_model_shape_refuses_bad_fields():
    with pytest.raises(ValueError, match="head_dim must be an integer >= 1"):
        ModelShape("x", 2, 2, 0)
    with pytest.raises(ValueError, match=r"sliding_layers must hold distinct layer indices in \[0, 1\]"):
        ModelShape("x", 2, 2, 8, sliding_window=4, sliding_layers=(2,))
    with pytest.raises(ValueError, match=r"distinct layer indices in \[0, 1\], got \[1, 1\]"):
        ModelShape("x", 2, 2, 8, sliding_window=4, sliding_layers=(1, 1))
    with pytest.raises(ValueError, match="sliding_layers needs a sliding_window"):
        ModelShape("x", 2, 2, 8, sliding_layers=(0,))
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        TEACHING_MODEL.block_bytes(0)
    with pytest.raises(ValueError, match="max_position_embeddings must be an integer >= 1, got 0"):
        ModelShape("x", 2, 2, 8, max_position_embeddings=0)
    with pytest.raises(ValueError, match="length must be an integer >= 0, got -1"):
        TEACHING_MODEL.beyond_context(-1)


@pytest.mark.parametrize("heads, kv_heads", [(12, 8), (7, 2), (4, 8), (1, 3)])
def test_query_heads_must_be_a_multiple_of_kv_heads(heads, kv_heads):
    message = re.escape(f"num_attention_heads must be a multiple of num_kv_heads ({kv_heads})") + r".*got " + str(heads)
    with pytest.raises(ValueError, match=message):
        ModelShape("x", 2, kv_heads, 8, num_attention_heads=heads)
    config = {"num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": 8, "torch_dtype": "bfloat16"}
    with pytest.raises(ValueError, match=message):
        ModelShape.from_config(config)
    for groups in [1, 2, 3]:  # whole groups are fine
        assert ModelShape("x", 2, kv_heads, 8, num_attention_heads=groups * kv_heads).num_kv_heads == kv_heads


# ------------------------------------------------------------------ the explorer widget (without a browser)


def test_explorer_readout_follows_its_sliders():
    from labkit.teaching.widgets.capacity_explorer import CapacityExplorer

    explorer = CapacityExplorer()
    fit = re.search(r'class="capacity-fit">([\d,]+)<', explorer.readout.value).group(1)
    assert int(fit.replace(",", "")) == 7
    explorer.sliders["device_gib"].value = 80
    explorer.sliders["context_len"].value = 32768
    expected = capacity.sequences_that_fit(TEACHING_MODEL.cache_bytes(32768), 80 * GiB, 17 * GiB)
    fit = re.search(r'class="capacity-fit">([\d,]+)<', explorer.readout.value).group(1)
    assert int(fit.replace(",", "")) == expected

    explorer.preset.value = "Qwen2.5-7B"
    assert [explorer.sliders[k].value for k in ("num_layers", "num_kv_heads", "head_dim")] == [28, 4, 128]
    assert explorer.setting.shape.bytes_per_token() == PRESETS["Qwen2.5-7B"].bytes_per_token()
    explorer.preset.value = "DeepSeek-V3"
    assert explorer.setting.shape.bytes_per_token() == PRESETS["DeepSeek-V3"].bytes_per_token()

    explorer.sliders["reserved_gib"].value = 100
    assert "capacity-error" in explorer.readout.value and "more than" in explorer.readout.value


def test_explorer_warns_past_the_presets_context_limit():
    from labkit.teaching.widgets.capacity_explorer import CapacityExplorer

    explorer = CapacityExplorer(preset="Llama-3-8B", context_len=8192, device_gib=80, reserved_gib=20)
    limit = PRESETS["Llama-3-8B"].max_position_embeddings
    assert "capacity-context-warning" not in explorer.readout.value
    explorer.sliders["context_len"].value = limit + 512
    assert "capacity-context-warning" in explorer.readout.value and f"({limit:,})" in explorer.readout.value
    explorer.kv_dtype.value = "fp8_per_tensor"  # the same model with an 8-bit cache: same limit
    assert explorer.setting.shape.max_position_embeddings == limit
    assert "capacity-context-warning" in explorer.readout.value
    explorer.sliders["num_layers"].value = 16  # a custom model: no known limit
    assert explorer.setting.shape.name == "custom" and explorer.setting.shape.max_position_embeddings is None
    assert "capacity-context-warning" not in explorer.readout.value
    explorer.preset.value = "Qwen2.5-7B"
    explorer.sliders["context_len"].value = PRESETS["Qwen2.5-7B"].max_position_embeddings
    assert "capacity-context-warning" not in explorer.readout.value


def test_static_figure_draws_lengths_past_the_limit_dotted():
    from labkit.teaching.widgets.capacity_explorer import CONTEXTS, static_figure

    fig = static_figure(["Gemma-2-9B", "Qwen2.5-7B"], 60 * GiB)
    lines = [line for line in fig.axes[0].get_lines() if len(line.get_xdata())]
    dotted = [line for line in lines if line.get_linestyle() == ":"]
    limit = PRESETS["Gemma-2-9B"].max_position_embeddings
    assert len(dotted) == 1  # Qwen2.5-7B's limit is the plot's last length: nothing beyond it
    assert dotted[0].get_xdata()[0] == limit and dotted[0].get_xdata()[-1] == CONTEXTS[-1]
    solid = [line for line in lines if line.get_linestyle() == "-"]
    assert max(solid[0].get_xdata()) == limit and max(solid[1].get_xdata()) == CONTEXTS[-1]


def test_explorer_shows_what_vllm_would_print():
    from labkit.teaching.widgets.capacity_explorer import CapacityExplorer
    from labkit.vllm_bridge import predict

    explorer = CapacityExplorer()  # the article's device: 24 GiB, 17 GiB set aside, utilization 1.0
    assert "Available KV cache memory: 7.0 GiB" in explorer.readout.value
    assert "Maximum concurrency for 8,192 tokens per request: 7.00x" in explorer.readout.value
    explorer.sliders["gpu_memory_utilization"].value = 0.92
    assert "Available KV cache memory: 5.08 GiB" in explorer.readout.value
    explorer.preset.value = "Gemma-2-9B"  # the windows are budgeted as vLLM does: not the plain formula
    expected = predict.kv_cache_report("Gemma-2-9B", predict.available_kv_bytes(24 * GiB, 0.92, 17 * GiB),
                                       max_model_len=8192).log_lines()
    assert explorer.setting.vllm_lines() == expected
    explorer.sliders["context_len"].value = 131072  # past Gemma 2's 8,192: vLLM's config check refuses first
    assert explorer.setting.vllm_lines()[0].startswith("ValueError: User-specified max_model_len (131072) is "
                                                       "greater than the derived max_model_len")
    explorer.preset.value = "teaching model"  # no stated limit: the cache is what is too small
    explorer.sliders["context_len"].value = 131072
    assert explorer.setting.vllm_lines()[0].startswith("ValueError: To serve at least one request")
    assert "estimated maximum model length is" in explorer.readout.value


def test_explorer_kv_dtype_menu_follows_the_formula_and_vllm():
    """The KV cache dtype menu (appendix A3): bytes from capacity.kv_cache_bytes, scales included, and
    vLLM's readout started with its nearest kv_cache_dtype, MLA's fp8 block and refusals included."""
    from labkit.teaching.widgets.capacity_explorer import KV_DTYPES, CapacityExplorer
    from labkit.vllm_bridge import predict

    explorer = CapacityExplorer()
    assert explorer.kv_dtype.value == "bfloat16" and explorer.setting.bytes_per_token == 128 * 1024
    fits = {}
    for _, kv in KV_DTYPES:
        explorer.kv_dtype.value = kv
        s = explorer.setting
        quantized = kv not in ("float32", "bfloat16")
        want = capacity.kv_cache_bytes(TEACHING_MODEL, 8192, kv if quantized else "auto") if quantized else \
            TEACHING_MODEL.with_dtype(kv).cache_bytes(8192)
        assert s.bytes_per_request == want, kv
        fit = re.search(r'class="capacity-fit">([\d,]+)<', explorer.readout.value).group(1)
        fits[kv] = int(fit.replace(",", ""))
        assert fits[kv] == capacity.sequences_that_fit(want, 24 * GiB, 17 * GiB)
    # 7 GiB: 3 float32 sequences of 8,192 tokens, 7 bf16, 14 fp8, 13 int8 (its scales push one out), 22 int4
    assert fits == {"float32": 3, "bfloat16": 7, "fp8_per_tensor": 14, "int8_per_block": 13, "int4_per_group": 22}
    explorer.kv_dtype.value = "int4_per_group"
    assert "kv_cache_dtype=int4_per_token_head" in explorer.readout.value
    expected = predict.kv_cache_report(TEACHING_MODEL, 7 * GiB, max_model_len=8192,
                                       kv_cache_dtype="int4_per_token_head").log_lines()
    assert explorer.setting.vllm_lines() == expected
    explorer.preset.value = "DeepSeek-V3"  # MLA: fp8 on FlashMLA's 64-token blocks; int8/int4 refused
    explorer.kv_dtype.value = "fp8_per_tensor"
    assert explorer.setting.vllm_block_size == 64 and "block_size=64" in explorer.readout.value
    explorer.kv_dtype.value = "int8_per_block"
    assert explorer.setting.vllm_lines()[0].startswith("ValueError: kv_cache_dtype must be one of")
    explorer.kv_dtype.value = "bfloat16"
    assert explorer.setting.vllm_block_size == 16


def test_kv_bytes_per_token_adds_the_scales():
    """b = 1 or 0.5, plus float32 scales: per tensor none per token, per block 4 bytes per head and
    block, per group 4 bytes per 32 elements."""
    llama = PRESETS["Llama-3-8B"]  # 32 layers, 8 KV heads, head_dim 128
    heads = 2 * 32 * 8
    assert capacity.kv_bytes_per_token(llama) == 128 * 1024
    assert capacity.kv_bytes_per_token(llama, "fp8_per_tensor") == capacity.kv_bytes_per_token(llama, "int8_per_tensor") \
        == 64 * 1024
    assert capacity.kv_bytes_per_token(llama, "int8_per_block") == 64 * 1024 + heads * 4 / 16
    assert capacity.kv_bytes_per_token(llama, "int8_per_block", block_size=32) == 64 * 1024 + heads * 4 / 32
    assert capacity.kv_bytes_per_token(llama, "int4_per_group") == 32 * 1024 + heads * 4 * 4
    assert capacity.kv_bytes_per_token(llama, "int4_per_tensor") == 32 * 1024
    # a sequence: whole blocks of per-block scales
    assert capacity.kv_cache_bytes(llama, 17, "int8_per_block") == 17 * 64 * 1024 + 2 * heads * 4
    assert capacity.kv_cache_bytes(llama, 17) == llama.cache_bytes(17)
    mla = PRESETS["DeepSeek-V3"]  # one latent vector: no factor 2, and 576 / 32 = 18 groups
    assert capacity.kv_bytes_per_token(mla, "int4_per_group") == 61 * (576 / 2 + 18 * 4)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        capacity.kv_bytes_per_token(llama, "int3")
