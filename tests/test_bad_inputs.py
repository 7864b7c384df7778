"""Every bad input refused: one row a case, across labkit's public modules.

The book's rule (CONTRIBUTING.md): bad input raises ``ValueError`` or ``TypeError`` that
names the parameter (and its allowed range), and leaves all state unchanged. Each row of
``CASES`` is one bad call:

    (label, call, args, kwargs, exception type, parameter name the message must contain)

``call`` is a function or class, or ``On(factory, "method")`` for a method of a fresh object
that ``factory()`` builds. Every row checks, besides the exception and the name, that the
object it acts on and every argument it was given are exactly as they were before the call
(a deep snapshot: tensors element by element, objects attribute by attribute).

The newer modules' rows (issue 38) are in the tables beside this one (``TABLES``). Run
``python tests/test_bad_inputs.py`` for the count of rows refused correctly over all of them, without
pytest (the issue's "before and after" figure). Issue 20's note: against the code before it
(commit d847dcb), 146 of these 193 rows were refused correctly; 9 of the other 47 only because
a parameter was renamed (``tensor_parallel`` became ``tensor_parallel_size``, ``pipeline_parallel``
``pipeline_parallel_size``) or a function is new (``checks.check_bytes``, ``predict.check_max_model_len``),
and 38 were real faults: accepted, a wrong exception type, or a message naming another parameter.
After it, 193 of 193. A review then found 64 more faults in model, prefix, scheduler, sim, engine and
cache (the rows after "issue 20's review"): against the code before their fix (commit b31555c),
193 of these 257 rows were refused correctly; after it, 257 of 257. Issue 38 added 268 rows for the
newer modules (formats and the quantized kernels, prepack, the simulator's calibration, the vLLM
bridge, the build-it checkers and quizzes, max_model_len), 6 here and the rest in the tables beside
this one; against the code before it 240 of them were mishandled. After it, 573 of 573.
"""

from __future__ import annotations

import enum
import math
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit import checks, units
from labkit.caches import contiguous, paged, prefix_cached, quant_quality
from labkit.kernels import launch, paged_attention, reference
from labkit.memory import blocks, capacity, formats, paging, pool_plan, prefix
from labkit.memory.capacity import PRESETS, TEACHING_MODEL, ModelShape
from labkit.model import decoder, pretrained
from labkit.serving import engine, request, scheduler
from labkit.serving.sim import costmodel, fit, measure, percentiles, simulator, skipahead, workloads
from labkit.serving.variants import forking, priority, reservation
from labkit.teaching import diagrams, excerpts
from labkit.teaching.widgets import load_explorer, paging_stepper, prefix_stepper
from labkit.units import GiB
from labkit.vllm_bridge import compare, predict, real


@dataclass(frozen=True)
class On:
    """A method of a fresh object: ``factory()`` builds it, then ``getattr(obj, method)`` is called."""

    factory: Callable[[], Any]
    method: str

    def __repr__(self) -> str:
        return f"On({getattr(self.factory, '__name__', 'factory')}, {self.method!r})"


# ---------------------------------------------------------------------------------------------- objects


def allocator_with_one_used() -> paging.BlockAllocator:
    alloc = paging.BlockAllocator(4)
    alloc.allocate()  # block 0 in use, 1..3 free
    return alloc


def table_of_five_tokens() -> paging.BlockTable:
    table = paging.BlockTable(4)
    table.append(5, paging.BlockAllocator(4))
    return table


def teaching_shape() -> ModelShape:
    return TEACHING_MODEL


def cost_model() -> costmodel.CostModel:
    return costmodel.CostModel("teaching model", "RTX 4090 (24 GiB)")


def a_pool_plan() -> pool_plan.PoolPlan:
    return pool_plan.plan_pool()


def tiny_config(**changes) -> decoder.DecoderConfig:
    return decoder.DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, **changes)


def tiny_decoder() -> decoder.Decoder:
    return decoder.Decoder.random(tiny_config())


TINY_MODEL = decoder.Decoder.random(tiny_config(), seed=0)


def idle_engine() -> engine.Engine:
    """An idle engine over the tiny model (vocabulary of 32 ids, 16 blocks of 4 tokens)."""
    return engine.Engine(TINY_MODEL, num_blocks=16, block_size=4, use_triton=False)


def busy_engine() -> engine.Engine:
    """An engine that still has a request of its own to serve."""
    e = idle_engine()
    e.add_request([1, 2, 3], 2, eos_token_id=())
    return e


def prefix_cache() -> prefix.PrefixCache:
    return prefix.PrefixCache(paging.BlockAllocator(8), 4)


def paged_cache() -> paged.PagedKVCache:
    return paged.PagedKVCache(tiny_config(), num_blocks=4, block_size=4)


def int8_pool() -> paged.KVPool:
    return paged.KVPool(tiny_config(), 4, 4, use_triton=False, kv_cache_dtype="int8_per_tensor")


def int8_block_pool() -> paged.KVPool:
    return paged.KVPool(tiny_config(), 4, 4, use_triton=False, kv_cache_dtype="int8_per_block")


def a_request() -> request.Request:
    """A waiting request of 3 prompt tokens and 1 output token (num_tokens 4)."""
    return request.Request([1, 2, 3], 4, output_token_ids=[5])


def small_scheduler() -> scheduler.Scheduler:
    sched = scheduler.Scheduler(num_blocks=8, block_size=4)
    sched.add_request([1, 2, 3], 4)
    return sched


def capped_scheduler() -> scheduler.Scheduler:
    """A scheduler with max_model_len 16 and one request queued."""
    sched = scheduler.Scheduler(num_blocks=8, block_size=4, max_model_len=16)
    sched.add_request([1, 2, 3], 4)
    return sched


def forking_scheduler() -> forking.ForkingScheduler:
    sched = forking.ForkingScheduler(num_blocks=8, block_size=4)
    sched.add_request([1, 2, 3], 4)
    return sched


def kv_cache() -> contiguous.KVCache:
    return contiguous.KVCache(tiny_config())


def kv_pool() -> paged.KVPool:
    return paged.KVPool(tiny_config(), 4, 4, use_triton=False)


# A small paged-attention problem: 2 sequences, 2 query heads, 1 KV head, head_dim 8, 16-token blocks.
def _kv(num_blocks: int = 4, block_size: int = 16, heads: int = 1, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (num_blocks, block_size, heads, dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


K_CACHE, V_CACHE = _kv()
Q = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(1))
BLOCK_TABLES = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
SEQ_LENS = torch.tensor([20, 5], dtype=torch.int32)
CU_SEQLENS = torch.tensor([0, 1, 2], dtype=torch.int32)
K_NEW = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(2))
V_NEW = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(3))
SLOTS = torch.tensor([0, 1, 2], dtype=torch.int64)

ATTN = (Q, K_CACHE, V_CACHE, BLOCK_TABLES, SEQ_LENS)
# The same problem in quantized pools (appendix A3): int8 codes with per-block scales, int4 with group scales.
INT8_BLOCK = formats.kv_quant("int8_per_block")
(QK_CACHE, QK_SCALE), (QV_CACHE, QV_SCALE) = (INT8_BLOCK.empty_pool(4, 16, 1, 8) for _ in range(2))
Q_KW = dict(kv_cache_dtype="int8_per_block", k_scale=QK_SCALE, v_scale=QV_SCALE)
INT4 = formats.kv_quant("int4_per_group")
(K4_CACHE, K4_SCALE), (V4_CACHE, V4_SCALE) = (INT4.empty_pool(4, 16, 1, 8) for _ in range(2))
# causal_attention's shapes: q [batch, q_len, Hq, D], k and v [batch, kv_len, Hkv, D]
Q4 = torch.randn(1, 3, 2, 8, generator=torch.Generator().manual_seed(4))
K4 = torch.randn(1, 3, 1, 8, generator=torch.Generator().manual_seed(5))
V4 = torch.randn(1, 3, 1, 8, generator=torch.Generator().manual_seed(6))
KEY = prefix.CacheKey()
WEIGHTS = (np.array([1.0, 2.0]), np.array([1.0, 1.0]))
RNG = lambda: np.random.default_rng(0)  # noqa: E731
GOOD_SPEC = dict(request_id=0, arrival_time=0.0, prompt_token_ids=[1, 2, 3], output_len=4)
LLAMA = PRESETS["Llama-3-8B"]
DEEPSEEK = PRESETS["DeepSeek-V3"]
SHAPE_40Q_8KV = ModelShape("40q-8kv", 32, 8, 128, 2, num_attention_heads=40, max_position_embeddings=8192)
PROFILE = dict(name="p", prompt_mean=10.0, output_mean=10.0, prompt_sigma=0.5, output_sigma=0.5)
REPORT = dict(max_model_len=8192)
nan, inf = math.nan, math.inf


def folder_without_config() -> str:
    """A folder that exists and holds no config.json: this test's own."""
    return str(__import__("pathlib").Path(__file__).resolve().parent)


# ---------------------------------------------------------------------------------------------- the table

CASES: list[tuple[str, Any, tuple, dict, type, str]] = [
    # ---- checks
    ("check_int negative", checks.check_int, ("n", -1, 0), {}, ValueError, "n"),
    ("check_int bool", checks.check_int, ("n", True, 0), {}, ValueError, "n"),
    ("check_int float", checks.check_int, ("n", 1.5, 0), {}, ValueError, "n"),
    ("check_number nan", checks.check_number, ("x", nan, 0), {}, ValueError, "x"),
    ("check_number str", checks.check_number, ("x", "1", 0), {}, ValueError, "x"),
    ("check_number strict", checks.check_number, ("x", 0, 0), {"strict": True}, ValueError, "x"),
    ("check_bytes inf", checks.check_bytes, ("device_bytes", inf), {}, ValueError, "device_bytes"),
    ("check_bytes zero positive", checks.check_bytes, ("device_bytes", 0), {"positive": True}, ValueError,
     "device_bytes"),
    ("check_token_ids negative", checks.check_token_ids, ("ids", [1, -2]), {}, ValueError, "ids"),
    ("check_token_ids bool", checks.check_token_ids, ("ids", [True]), {}, ValueError, "ids"),
    ("check_token_ids str", checks.check_token_ids, ("ids", "abc"), {}, ValueError, "ids"),
    ("check_token_ids too short", checks.check_token_ids, ("ids", []), {"min_len": 1}, ValueError, "ids"),
    # ---- units
    ("format_bytes unit", units.format_bytes, (1024, "XB"), {}, ValueError, "unit"),
    ("format_bytes str", units.format_bytes, ("12",), {}, ValueError, "n"),
    ("format_bytes nan", units.format_bytes, (nan,), {}, ValueError, "n"),
    # ---- capacity: the formula
    ("bytes_per_token layers", capacity.bytes_per_token, (0, 8, 128, 2), {}, ValueError, "num_layers"),
    ("bytes_per_token kv heads", capacity.bytes_per_token, (32, 0, 128, 2), {}, ValueError, "num_kv_heads"),
    ("bytes_per_token head_dim", capacity.bytes_per_token, (32, 8, 0, 2), {}, ValueError, "head_dim"),
    ("bytes_per_token dtype_bytes", capacity.bytes_per_token, (32, 8, 128, 0), {}, ValueError, "dtype_bytes"),
    ("bytes_per_token no dtype", capacity.bytes_per_token, (32, 8, 128), {}, ValueError, "dtype_bytes"),
    ("bytes_per_token both dtypes", capacity.bytes_per_token, (32, 8, 128, 2), {"dtype": "bf16"}, ValueError,
     "dtype"),
    ("bytes_per_token dtype name", capacity.bytes_per_token, (32, 8, 128), {"dtype": "float64"}, ValueError,
     "dtype"),
    ("cache_bytes length", capacity.cache_bytes, (-1, 32, 8, 128, 2), {}, ValueError, "length"),
    ("element_size bool dtype", capacity.element_size, (torch.bool,), {}, ValueError, "dtype"),
    ("element_size complex", capacity.element_size, (torch.complex64,), {}, ValueError, "dtype"),
    # ---- capacity: ModelShape
    ("ModelShape layers", ModelShape, ("m", 0, 8, 128), {}, ValueError, "num_layers"),
    ("ModelShape GQA groups", ModelShape, ("m", 2, 8, 128), {"num_attention_heads": 12}, ValueError,
     "num_attention_heads"),
    ("ModelShape latent heads", ModelShape, ("m", 2, 2, 128), {"latent": True}, ValueError, "num_kv_heads"),
    ("ModelShape sliding layer index", ModelShape, ("m", 2, 2, 8), {"sliding_window": 4, "sliding_layers": (5,)},
     ValueError, "sliding_layers"),
    ("ModelShape layers without window", ModelShape, ("m", 2, 2, 8), {"sliding_layers": (0,)}, ValueError,
     "sliding_window"),
    ("ModelShape window zero", ModelShape, ("m", 2, 2, 8), {"sliding_window": 0}, ValueError, "sliding_window"),
    ("ModelShape context", ModelShape, ("m", 2, 2, 8), {"max_position_embeddings": 0}, ValueError,
     "max_position_embeddings"),
    ("ModelShape.cache_bytes length", On(teaching_shape, "cache_bytes"), (-1,), {}, ValueError, "length"),
    ("ModelShape.block_bytes", On(teaching_shape, "block_bytes"), (0,), {}, ValueError, "block_size"),
    ("ModelShape.beyond_context", On(teaching_shape, "beyond_context"), (-5,), {}, ValueError, "length"),
    ("ModelShape.with_dtype", On(teaching_shape, "with_dtype"), ("int4",), {}, ValueError, "dtype"),
    ("from_config no layers", ModelShape.from_config, ({"num_attention_heads": 4},), {}, ValueError,
     "num_hidden_layers"),
    ("from_config no dtype", ModelShape.from_config,
     ({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64},), {}, ValueError, "torch_dtype"),
    ("from_config kv heads", ModelShape.from_config, (capacity.PRESET_CONFIGS["Llama-3-8B"]
                                                      | {"num_key_value_heads": 0},), {}, ValueError, "num_kv_heads"),
    # ---- capacity: sharding and fitting
    ("kv_heads_per_device 8 on 5", capacity.kv_heads_per_device, (8, 5), {}, ValueError, "tensor_parallel_size"),
    ("kv_heads_per_device 8 on 12", capacity.kv_heads_per_device, (8, 12), {}, ValueError, "tensor_parallel_size"),
    ("kv_heads_per_device tp 0", capacity.kv_heads_per_device, (8, 0), {}, ValueError, "tensor_parallel_size"),
    ("kv_heads_per_device heads 0", capacity.kv_heads_per_device, (0, 1), {}, ValueError, "num_kv_heads"),
    ("pipeline_stages too many", capacity.pipeline_stages, (4, 5), {}, ValueError, "pipeline_parallel_size"),
    ("pipeline_stages layers", capacity.pipeline_stages, (0, 1), {}, ValueError, "num_layers"),
    ("shard tp 3", capacity.shard, (TEACHING_MODEL, 3), {}, ValueError, "tensor_parallel_size"),
    ("shard pp 33", capacity.shard, (TEACHING_MODEL, 1, 33), {}, ValueError, "pipeline_parallel_size"),
    ("shard not a shape", capacity.shard, ("Llama-3-8B", 1), {}, TypeError, "shape"),
    ("kv_pool_bytes device 0", capacity.kv_pool_bytes, (0, 0), {}, ValueError, "device_bytes"),
    ("kv_pool_bytes reserve too big", capacity.kv_pool_bytes, (10, 11), {}, ValueError, "reserved_bytes"),
    ("kv_pool_bytes device inf", capacity.kv_pool_bytes, (inf, 0), {}, ValueError, "device_bytes"),
    ("kv_pool_bytes reserve negative", capacity.kv_pool_bytes, (10, -1), {}, ValueError, "reserved_bytes"),
    ("sequences_that_fit zero bytes", capacity.sequences_that_fit, (0, 10, 0), {}, ValueError,
     "bytes_per_sequence"),
    ("sequences_that_fit nan device", capacity.sequences_that_fit, (1, nan, 0), {}, ValueError, "device_bytes"),
    # ---- vllm
    ("available total 0", predict.available_kv_bytes, (0, 0.9, 0), {}, ValueError, "gpu_total_bytes"),
    ("available utilization 0", predict.available_kv_bytes, (GiB, 0, 0), {}, ValueError, "gpu_memory_utilization"),
    ("available utilization 1.5", predict.available_kv_bytes, (GiB, 1.5, 0), {}, ValueError,
     "gpu_memory_utilization"),
    ("available non-KV negative", predict.available_kv_bytes, (GiB, 0.9, -1), {}, ValueError, "non_kv_bytes"),
    ("available non-KV inf", predict.available_kv_bytes, (GiB, 0.9, inf), {}, ValueError, "non_kv_bytes"),
    ("report unknown model", predict.kv_cache_report, ("Llama-9", 8 * GiB), REPORT, ValueError, "model"),
    ("report block 24", predict.kv_cache_report, ("Llama-3-8B", 8 * GiB), REPORT | {"block_size": 24}, ValueError,
     "block_size"),
    ("report block 0", predict.kv_cache_report, ("Llama-3-8B", 8 * GiB), REPORT | {"block_size": 0}, ValueError,
     "block_size"),
    ("report max_model_len 0", predict.kv_cache_report, ("Llama-3-8B", 8 * GiB), {"max_model_len": 0}, ValueError,
     "max_model_len"),
    ("report max_model_len past the model's", predict.kv_cache_report, ("Llama-3-8B", 20 * GiB),
     {"max_model_len": 65_536}, ValueError, "max_model_len"),
    ("report batched tokens 0", predict.kv_cache_report, ("Llama-3-8B", 8 * GiB),
     REPORT | {"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens"),
    ("report TP 5 on 8 KV heads", predict.kv_cache_report, (SHAPE_40Q_8KV, 40 * GiB),
     REPORT | {"tensor_parallel_size": 5}, ValueError, "tensor_parallel_size"),
    ("report TP 3 on 32 heads", predict.kv_cache_report, ("Llama-3-8B", 8 * GiB), REPORT | {"tensor_parallel_size": 3},
     ValueError, "tensor_parallel_size"),
    ("report PP 33", predict.kv_cache_report, ("Llama-3-8B", 8 * GiB), REPORT | {"pipeline_parallel_size": 33},
     ValueError, "pipeline_parallel_size"),
    ("report dtype fp4", predict.kv_cache_report, ("Llama-3-8B", 8 * GiB), REPORT | {"kv_cache_dtype": "fp4"},
     ValueError, "kv_cache_dtype"),
    ("report MLA per-token-head", predict.kv_cache_report, ("DeepSeek-V3", 40 * GiB),
     {"max_model_len": 4096, "kv_cache_dtype": "fp8_per_token_head"}, ValueError, "kv_cache_dtype"),
    ("report fp8_ds_mla without MLA", predict.kv_cache_report, ("Llama-3-8B", 8 * GiB),
     REPORT | {"kv_cache_dtype": "fp8_ds_mla"}, ValueError, "kv_cache_dtype"),
    ("report batches 0", predict.kv_cache_report, ("Llama-3-8B", 8 * GiB), REPORT | {"batches_in_flight": 0},
     ValueError, "batches_in_flight"),
    ("report available nan", predict.kv_cache_report, ("Llama-3-8B", nan), REPORT, ValueError, "available_kv_bytes"),
    ("report available per stage", predict.kv_cache_report, ("Llama-3-8B", [GiB, GiB]), REPORT, ValueError,
     "available_kv_bytes"),
    ("report negative available: vLLM's refusal", predict.kv_cache_report, ("Llama-3-8B", -GiB), REPORT, ValueError,
     "gpu_memory_utilization"),
    ("report allow-long not a bool", predict.kv_cache_report, ("Llama-3-8B", 8 * GiB),
     REPORT | {"allow_long_max_model_len": "1"}, TypeError, "allow_long_max_model_len"),
    ("get_pp_indices rank too big", predict.get_pp_indices, (61, 4, 4), {}, ValueError, "pp_rank"),
    ("get_pp_indices rank negative", predict.get_pp_indices, (61, -1, 4), {}, ValueError, "pp_rank"),
    ("get_pp_indices too many stages", predict.get_pp_indices, (4, 0, 5), {}, ValueError, "pipeline_parallel_size"),
    ("page_size_bytes not a shape", predict.page_size_bytes, ("Llama-3-8B",), {}, TypeError, "shape"),
    ("page_size_bytes block 0", predict.page_size_bytes, (LLAMA, 0), {}, ValueError, "block_size"),
    ("page_size_bytes MLA int8 per head", predict.page_size_bytes, (DEEPSEEK, 64, "int8_per_token_head"), {},
     ValueError, "kv_cache_dtype"),
    ("check_max_model_len 0", predict.check_max_model_len, (LLAMA, 0), {}, ValueError, "max_model_len"),
    # ---- kernels
    ("launch_settings kernel", launch.launch_settings, ("bogus", torch.float16, 128, (8, 0)), {}, ValueError,
     "kernel"),
    ("launch_settings head_dim 0", launch.launch_settings, ("decode", torch.float16, 0, (8, 0)), {}, ValueError,
     "head_dim"),
    ("launch_settings head_dim 512", launch.launch_settings, ("decode", torch.float16, 512, (8, 0)), {},
     ValueError, "head_dim"),
    ("launch_settings dtype", launch.launch_settings, ("decode", torch.int8, 64, (8, 0)), {}, ValueError, "dtype"),
    ("launch_settings capability", launch.launch_settings, ("decode", torch.float16, 64, (8,)), {}, ValueError,
     "capability"),
    ("launch_settings max_len", launch.launch_settings, ("decode", torch.float16, 64, (8, 0), 0), {}, ValueError,
     "max_len"),
    ("choose_num_splits no seqs", launch.choose_num_splits, (0, 8, 4096), {}, ValueError, "num_seqs"),
    ("choose_num_splits no heads", launch.choose_num_splits, (1, 0, 4096), {}, ValueError, "num_kv_heads"),
    ("choose_num_splits no length", launch.choose_num_splits, (1, 8, 0), {}, ValueError, "max_seq_len"),
    ("choose_num_splits target 0", launch.choose_num_splits, (1, 8, 4096), {"target_programs": 0}, ValueError,
     "target_programs"),
    ("write_kv slot out of range", paged_attention.write_kv, (K_NEW, V_NEW, K_CACHE, V_CACHE,
                                                              torch.tensor([0, 1, 64])), {}, ValueError, "slot_mapping"),
    ("write_kv duplicate slots", paged_attention.write_kv, (K_NEW, V_NEW, K_CACHE, V_CACHE, torch.tensor([0, 5, 5])), {},
     ValueError, "slot_mapping"),
    ("write_kv k dims", paged_attention.write_kv, (K_NEW[0], V_NEW[0], K_CACHE, V_CACHE, SLOTS[:1]), {}, ValueError, "k"),
    ("write_kv v dtype", paged_attention.write_kv, (K_NEW, V_NEW.double(), K_CACHE, V_CACHE, SLOTS), {}, ValueError, "v"),
    ("decode seq_lens 0", paged_attention.paged_decode_attention,
     (Q, K_CACHE, V_CACHE, BLOCK_TABLES, torch.tensor([0, 5], dtype=torch.int32)), {}, ValueError, "seq_lens"),
    ("decode seq_lens past the table", paged_attention.paged_decode_attention,
     (Q, K_CACHE, V_CACHE, BLOCK_TABLES, torch.tensor([40, 5], dtype=torch.int32)), {}, ValueError, "seq_lens"),
    ("decode scale", paged_attention.paged_decode_attention, ATTN, {"scale": -1.0}, ValueError, "scale"),
    ("decode num_splits", paged_attention.paged_decode_attention, ATTN, {"num_splits": 0}, ValueError, "num_splits"),
    ("decode q int", paged_attention.paged_decode_attention, (Q.long(),) + ATTN[1:], {}, ValueError, "q"),
    ("decode block id", paged_attention.paged_decode_attention,
     (Q, K_CACHE, V_CACHE, torch.tensor([[0, 9], [2, 3]], dtype=torch.int32), SEQ_LENS), {}, ValueError,
     "block_tables"),
    ("decode block_tables int64", paged_attention.paged_decode_attention,
     (Q, K_CACHE, V_CACHE, BLOCK_TABLES.long(), SEQ_LENS), {}, ValueError, "block_tables"),
    ("decode out shape", paged_attention.paged_decode_attention, ATTN, {"out": torch.empty(3, 2, 8)}, ValueError, "out"),
    ("decode heads not a multiple", paged_attention.paged_decode_attention,
     (torch.randn(2, 3, 8), *_kv(heads=2), BLOCK_TABLES, SEQ_LENS), {}, ValueError, "num_kv_heads"),
    ("prefill cu_seqlens end", paged_attention.paged_prefill_attention,
     ATTN + (torch.tensor([0, 1, 3], dtype=torch.int32),), {}, ValueError, "cu_seqlens_q"),
    ("prefill cu_seqlens length", paged_attention.paged_prefill_attention,
     ATTN + (torch.tensor([0, 2], dtype=torch.int32),), {}, ValueError, "cu_seqlens_q"),
    ("prefill v_cache shape", paged_attention.paged_prefill_attention,
     (Q, K_CACHE, V_CACHE[:2], BLOCK_TABLES, SEQ_LENS, CU_SEQLENS), {}, ValueError, "v_cache"),
    # ---- quantized pools (appendix A3): nothing written, no scale changed
    ("write_kv unknown kv dtype", paged_attention.write_kv, (K_NEW, V_NEW, QK_CACHE, QV_CACHE, SLOTS),
     Q_KW | {"kv_cache_dtype": "int3_per_block"}, ValueError, "kv_cache_dtype"),
    ("write_kv scale shape", paged_attention.write_kv, (K_NEW, V_NEW, QK_CACHE, QV_CACHE, SLOTS),
     Q_KW | {"k_scale": torch.zeros(4)}, ValueError, "k_scale"),
    ("write_kv scale dtype", paged_attention.write_kv, (K_NEW, V_NEW, QK_CACHE, QV_CACHE, SLOTS),
     Q_KW | {"v_scale": QV_SCALE.double()}, ValueError, "v_scale"),
    ("write_kv scales without a format", paged_attention.write_kv, (K_NEW, V_NEW, K_CACHE, V_CACHE, SLOTS),
     {"k_scale": QK_SCALE, "v_scale": QV_SCALE}, ValueError, "k_scale"),
    ("write_kv int4 odd head_dim", paged_attention.write_kv, (K_NEW[..., :7], V_NEW[..., :7], K4_CACHE, V4_CACHE, SLOTS),
     {"kv_cache_dtype": "int4_per_group", "k_scale": K4_SCALE, "v_scale": V4_SCALE}, ValueError, "head_dim"),
    ("write_kv codes of another format", paged_attention.write_kv, (K_NEW, V_NEW, K4_CACHE, V4_CACHE, SLOTS),
     Q_KW, ValueError, "k_cache"),
    ("write_kv per-block gap", paged_attention.write_kv, (K_NEW, V_NEW, QK_CACHE, QV_CACHE, torch.tensor([0, 1, 3])),
     Q_KW, ValueError, "slot_mapping"),
    ("write_kv per-tensor scale 0", paged_attention.write_kv, (K_NEW, V_NEW, *formats.kv_quant("int8_per_tensor").empty_pool(
        4, 16, 1, 8)[:1], formats.kv_quant("int8_per_tensor").empty_pool(4, 16, 1, 8)[0], SLOTS),
     {"kv_cache_dtype": "int8_per_tensor", "k_scale": torch.zeros(1), "v_scale": torch.ones(1)}, ValueError,
     "k_scale"),
    # the reference write checks the scales as the kernel's does: one rule, in labkit.memory.formats
    ("write_kv_ref per-tensor scale nan", reference.write_kv_ref, (K_NEW, V_NEW, *formats.kv_quant(
        "int8_per_tensor").empty_pool(4, 16, 1, 8)[:1], formats.kv_quant("int8_per_tensor").empty_pool(4, 16, 1, 8)[0],
        SLOTS), {"kv_cache_dtype": "int8_per_tensor", "k_scale": torch.ones(1), "v_scale": torch.full((1,), nan)},
     ValueError, "v_scale"),
    ("decode unknown kv dtype", paged_attention.paged_decode_attention, (Q, QK_CACHE, QV_CACHE, BLOCK_TABLES, SEQ_LENS),
     Q_KW | {"kv_cache_dtype": "fp8"}, ValueError, "kv_cache_dtype"),
    ("decode scale shape", paged_attention.paged_decode_attention, (Q, QK_CACHE, QV_CACHE, BLOCK_TABLES, SEQ_LENS),
     Q_KW | {"v_scale": QV_SCALE[:, :, None]}, ValueError, "v_scale"),
    ("prefill scale missing", paged_attention.paged_prefill_attention,
     (Q, QK_CACHE, QV_CACHE, BLOCK_TABLES, SEQ_LENS, CU_SEQLENS), Q_KW | {"k_scale": None}, ValueError, "k_scale"),
    ("launch_settings quantized", launch.launch_settings, ("decode", torch.float16, 64, (8, 0)),
     {"quantized": "yes"}, ValueError, "quantized"),
    ("KVPool unknown kv dtype", paged.KVPool, (tiny_config(), 4, 4), {"kv_cache_dtype": "int2"}, ValueError,
     "kv_cache_dtype"),
    ("KVPool.set_scales length", On(int8_pool, "set_scales"), ([0.1, 0.1], [0.1]), {}, ValueError, "k_scales"),
    ("KVPool.set_scales nan", On(int8_pool, "set_scales"), ([0.1], [nan]), {}, ValueError, "v_scales"),
    ("KVPool.set_scales per block", On(int8_block_pool, "set_scales"), ([0.1], [0.1]), {}, ValueError,
     "kv_cache_dtype"),
    ("kv_bytes_per_token dtype", capacity.kv_bytes_per_token, (TEACHING_MODEL, "int4"), {}, ValueError,
     "kv_cache_dtype"),
    ("kv_cache_bytes length", capacity.kv_cache_bytes, (TEACHING_MODEL, -1, "int8_per_block"), {}, ValueError,
     "length"),
    ("quant.kv_quant", formats.kv_quant, ("e4m3",), {}, ValueError, "kv_cache_dtype"),
    ("KVQuant.bytes_per_token odd", On(lambda: formats.kv_quant("int4_per_tensor"), "bytes_per_token"), (2, 2, 9),
     {}, ValueError, "head_dim"),
    ("quant.greedy_agreement lengths", quant_quality.greedy_agreement, ([[1]], [[1], [2]]), {}, ValueError, "references"),
    ("quant.sample_text name", quant_quality.sample_text, ("novel",), {}, ValueError, "name"),
    ("quant.next_token_loss one token", quant_quality.next_token_loss, (tiny_decoder(), [1]), {}, ValueError, "token_ids"),
    # ---- paging
    ("blocks_needed tokens", blocks.blocks_needed, (-1, 16), {}, ValueError, "num_tokens"),
    ("blocks_needed block_size", blocks.blocks_needed, (1, 0), {}, ValueError, "block_size"),
    ("BlockAllocator 0", paging.BlockAllocator, (0,), {}, ValueError, "num_blocks"),
    ("allocator free unknown id", On(allocator_with_one_used, "free"), (99,), {}, ValueError, "block_id"),
    ("allocator double free", On(allocator_with_one_used, "free"), (1,), {}, ValueError, "block_id"),
    ("allocator free_blocks all-or-nothing", On(allocator_with_one_used, "free_blocks"), ([0, 0],), {},
     ValueError, "block_id"),
    ("allocator incref free block", On(allocator_with_one_used, "incref"), (2,), {}, ValueError, "block_id"),
    ("allocator revive used block", On(allocator_with_one_used, "revive"), (0,), {}, ValueError, "block_id"),
    ("allocator allocate_many negative", On(allocator_with_one_used, "allocate_many"), (-1,), {}, ValueError, "n"),
    ("allocator is_free bool", On(allocator_with_one_used, "is_free"), (True,), {}, ValueError, "block_id"),
    ("BlockTable block_size 0", paging.BlockTable, (0,), {}, ValueError, "block_size"),
    ("table slot past the end", On(table_of_five_tokens, "slot"), (5,), {}, ValueError, "position"),
    ("table slots past the end", On(table_of_five_tokens, "slots"), (0, 100), {}, ValueError, "stop"),
    ("table slots reversed", On(table_of_five_tokens, "slots"), (3, 1), {}, ValueError, "stop"),
    ("table slots negative start", On(table_of_five_tokens, "slots"), (-1, 2), {}, ValueError, "start"),
    ("table new_blocks_for negative", On(table_of_five_tokens, "new_blocks_for"), (-1,), {}, ValueError, "n"),
    # ---- pool
    ("plan_pool device negative", pool_plan.plan_pool, (), {"device_bytes": -1}, ValueError, "device_bytes"),
    ("plan_pool device inf", pool_plan.plan_pool, (), {"device_bytes": inf}, ValueError, "device_bytes"),
    ("plan_pool set aside too big", pool_plan.plan_pool, (), {"set_aside_bytes": 25 * GiB}, ValueError,
     "set_aside_bytes"),
    ("plan_pool no whole block", pool_plan.plan_pool, (), {"set_aside_bytes": 24 * GiB - 1}, ValueError,
     "set_aside_bytes"),
    ("plan_pool block 0", pool_plan.plan_pool, (), {"block_size": 0}, ValueError, "block_size"),
    ("plan_pool max_num_seqs 0", pool_plan.plan_pool, (), {"max_num_seqs": 0}, ValueError, "max_num_seqs"),
    ("plan_pool model", pool_plan.plan_pool, (), {"model": "teaching model"}, TypeError, "model"),
    ("PoolPlan.host_metadata_bytes", On(a_pool_plan, "host_metadata_bytes"), (-1,), {}, ValueError,
     "bytes_per_block"),
    ("reservation_shares empty", pool_plan.reservation_shares, ([],), {}, ValueError, "requests"),
    ("reservation_shares max_len 0", pool_plan.reservation_shares, ([workloads.RequestSpec(**GOOD_SPEC)],),
     {"max_len": 0}, ValueError, "max_len"),
    ("reservation_shares max_len short", pool_plan.reservation_shares, ([workloads.RequestSpec(**GOOD_SPEC)],),
     {"max_len": 5}, ValueError, "max_len"),
    # ---- workloads
    ("RequestSpec output_len 0", workloads.RequestSpec, (), GOOD_SPEC | {"output_len": 0}, ValueError,
     "output_len"),
    ("RequestSpec request_id", workloads.RequestSpec, (), GOOD_SPEC | {"request_id": -1}, ValueError,
     "request_id"),
    ("RequestSpec empty prompt", workloads.RequestSpec, (), GOOD_SPEC | {"prompt_token_ids": []}, ValueError,
     "prompt_token_ids"),
    ("RequestSpec negative token", workloads.RequestSpec, (), GOOD_SPEC | {"prompt_token_ids": [1, -1]},
     ValueError, "prompt_token_ids"),
    ("RequestSpec prefix_len", workloads.RequestSpec, (), GOOD_SPEC | {"prefix_len": 5}, ValueError, "prefix_len"),
    ("LengthProfile mean", workloads.LengthProfile, (), PROFILE | {"prompt_mean": -1.0}, ValueError,
     "prompt_mean"),
    ("LengthProfile sigma", workloads.LengthProfile, (), PROFILE | {"output_sigma": 0.0}, ValueError,
     "output_sigma"),
    ("LengthProfile max below mean", workloads.LengthProfile, (), PROFILE | {"max_prompt_len": 5}, ValueError,
     "max_prompt_len"),
    ("poisson_arrivals count", workloads.poisson_arrivals, (-1, 1.0, RNG()), {}, ValueError, "num_requests"),
    ("poisson_arrivals rate", workloads.poisson_arrivals, (3, 0.0, RNG()), {}, ValueError, "arrival_rate"),
    ("make_workload prefix_share", workloads.make_workload, (5, 1.0), {"prefix_share": 1.5}, ValueError,
     "prefix_share"),
    ("make_workload profile name", workloads.make_workload, (5, 1.0), {"lengths": "nope"}, ValueError, "lengths"),
    ("make_workload profile type", workloads.make_workload, (5, 1.0), {"lengths": 5}, TypeError, "lengths"),
    ("make_workload seed", workloads.make_workload, (5, 1.0), {"seed": -1}, ValueError, "seed"),
    ("make_workload vocab", workloads.make_workload, (5, 1.0), {"vocab_size": 1}, ValueError, "vocab_size"),
    ("make_workload prefixes", workloads.make_workload, (5, 1.0), {"num_prefixes": 0}, ValueError, "num_prefixes"),
    ("length_stats empty", workloads.length_stats, ([],), {}, ValueError, "requests"),
    # ---- costmodel
    ("Device memory", costmodel.Device, ("x", 0, 1, 1), {}, ValueError, "memory_bytes"),
    ("get_device", costmodel.get_device, ("nope",), {}, ValueError, "device"),
    ("get_model_cost", costmodel.get_model_cost, ("nope",), {}, ValueError, "model"),
    ("CostModel overhead", costmodel.CostModel, (), {"overhead_s": -1.0}, ValueError, "overhead_s"),
    ("CostModel.step empty chunk", On(cost_model, "step"), ([(0, 0)],), {}, ValueError, "work"),
    ("CostModel.decode_step_time batch", On(cost_model, "decode_step_time"), (0, 10), {}, ValueError,
     "batch_size"),
    ("CostModel.decode_step_time context", On(cost_model, "decode_step_time"), (1, -1), {}, ValueError,
     "context_len"),
    ("CostModel.prefill_time prompt", On(cost_model, "prefill_time"), (0,), {}, ValueError, "prompt_len"),
    ("CostModel.prefill_time chunk", On(cost_model, "prefill_time"), (10,), {"chunk": 0}, ValueError, "chunk"),
    # ---- model (configuration) and pretrained
    ("DecoderConfig vocab 0", decoder.DecoderConfig, (), {"vocab_size": 0}, ValueError, "vocab_size"),
    ("DecoderConfig groups", decoder.DecoderConfig, (), {"num_attention_heads": 6, "num_key_value_heads": 4},
     ValueError, "num_attention_heads"),
    ("DecoderConfig odd head_dim", decoder.DecoderConfig, (), {"head_dim": 3}, ValueError, "head_dim"),
    ("DecoderConfig rope_theta", decoder.DecoderConfig, (), {"rope_theta": -1.0}, ValueError, "rope_theta"),
    ("DecoderConfig rms_norm_eps", decoder.DecoderConfig, (), {"rms_norm_eps": 0.0}, ValueError, "rms_norm_eps"),
    ("DecoderConfig.from_dict model_type", decoder.DecoderConfig.from_dict, ({"model_type": "gpt2"},), {},
     ValueError, "model_type"),
    ("DecoderConfig.from_dict activation", decoder.DecoderConfig.from_dict, ({"hidden_act": "gelu"},), {},
     ValueError, "hidden_act"),
    ("Decoder.forward float ids", On(tiny_decoder, "forward"), (torch.zeros(1, 3),), {}, ValueError, "input_ids"),
    ("Decoder.forward id past vocab", On(tiny_decoder, "forward"), (torch.tensor([[1, 40]]),), {}, ValueError,
     "input_ids"),
    ("from_pretrained int dtype", pretrained.from_pretrained, ("unused",), {"dtype": torch.int8}, ValueError,
     "dtype"),
    ("from_pretrained no config.json", pretrained.from_pretrained, (folder_without_config(),), {},
     ValueError, "path_or_repo_id"),
    # ---- cache, prefix, scheduler, sim, engine: rows their current code already refuses correctly
    ("generate no prompt", contiguous.generate, (tiny_decoder(), [], 2), {}, ValueError, "prompt_ids"),
    ("KVPool blocks 0", paged.KVPool, (tiny_config(), 0, 4), {}, ValueError, "num_blocks"),
    ("PagedKVCache.free_sequence unknown", On(paged_cache, "free_sequence"), (99,), {}, ValueError, "seq_id"),
    ("hash_chain block 0", prefix.hash_chain, ([1, 2, 3], 0), {}, ValueError, "block_size"),
    ("PrefixCache block 0", prefix.PrefixCache, (paging.BlockAllocator(4), 0), {}, ValueError, "block_size"),
    ("PrefixCache.share hit", On(prefix_cache, "share"), ("hit", [1], KEY), {}, ValueError, "hit"),
    ("scheduler Request empty prompt", request.Request, ([], 4), {}, ValueError, "prompt_token_ids"),
    ("scheduler Request max_new_tokens", request.Request, ([1, 2], 0), {}, ValueError, "max_new_tokens"),
    ("Scheduler block 0", scheduler.Scheduler, (), {"num_blocks": 8, "block_size": 0}, ValueError, "block_size"),
    ("Simulator block 0", simulator.Simulator, (), {"num_blocks": 8, "block_size": 0}, ValueError, "block_size"),
    ("Simulator blocks 0", simulator.Simulator, (), {"num_blocks": 0}, ValueError, "num_blocks"),
    ("Engine model", engine.Engine, ("not a model", 8), {}, ValueError, "model"),
    # ---- model, prefix, scheduler, sim, engine, cache: issue 20's review (refused correctly since)
    ("causal_attention 2-D q", decoder.causal_attention, (Q4[0, :, 0], K4, V4), {}, ValueError, "q"),
    ("causal_attention k and v shapes differ", decoder.causal_attention, (Q4, K4, V4[:, :2]), {}, ValueError, "v"),
    ("causal_attention head_dim differs", decoder.causal_attention, (Q4, K4[..., :4], V4[..., :4]), {}, ValueError,
     "head_dim"),
    ("causal_attention kv shorter than q", decoder.causal_attention, (Q4, K4[:, :2], V4[:, :2]), {}, ValueError,
     "kv_len"),
    ("causal_attention batch differs", decoder.causal_attention, (Q4, K4.expand(2, -1, -1, -1), V4.expand(2, -1, -1, -1)),
     {}, ValueError, "batch"),
    ("causal_attention int q", decoder.causal_attention, (Q4.long(), K4.long(), V4.long()), {}, ValueError, "q"),
    ("causal_attention scale negative", decoder.causal_attention, (Q4, K4, V4), {"scale": -1.0}, ValueError, "scale"),
    ("DecoderConfig rope_theta str", decoder.DecoderConfig, (), {"rope_theta": "x"}, ValueError, "rope_theta"),
    ("DecoderConfig rope_theta inf", decoder.DecoderConfig, (), {"rope_theta": inf}, ValueError, "rope_theta"),
    ("DecoderConfig rms_norm_eps str", decoder.DecoderConfig, (), {"rms_norm_eps": "x"}, ValueError, "rms_norm_eps"),
    ("DecoderConfig tie_word_embeddings str", decoder.DecoderConfig, (), {"tie_word_embeddings": "no"}, ValueError,
     "tie_word_embeddings"),
    ("DecoderConfig qkv_bias str", decoder.DecoderConfig, (), {"qkv_bias": "no"}, ValueError, "qkv_bias"),
    ("Decoder.random seed -1", decoder.Decoder.random, (tiny_config(),), {"seed": -1}, ValueError, "seed"),
    ("Decoder.random config dict", decoder.Decoder.random, ({"vocab_size": 32},), {}, TypeError, "config"),
    ("Decoder config dict", decoder.Decoder, ({"vocab_size": 32},), {}, TypeError, "config"),
    ("Decoder.forward negative positions", On(tiny_decoder, "forward"), (torch.tensor([[1, 2]]),),
     {"positions": torch.tensor([[-1, 0]])}, ValueError, "positions"),
    ("Decoder.forward positions list", On(tiny_decoder, "forward"), (torch.tensor([[1, 2]]),),
     {"positions": [[0, 1]]}, ValueError, "positions"),
    ("extra_blocks computed -1", blocks.extra_blocks, (-1, 0, 1, 4), {}, ValueError, "num_computed_tokens"),
    ("extra_blocks held -1", blocks.extra_blocks, (0, -1, 1, 4), {}, ValueError, "num_blocks_held"),
    ("extra_blocks revived -1", blocks.extra_blocks, (0, 0, 1, 4), {"revived_blocks": -1}, ValueError,
     "revived_blocks"),
    ("extra_blocks shared_tail str", blocks.extra_blocks, (1, 1, 1, 4), {"shared_tail": "no"}, ValueError,
     "shared_tail"),
    ("block_hash negative token", prefix.block_hash, (None, [-1], KEY), {}, ValueError, "token_ids"),
    ("block_hash float token", prefix.block_hash, (None, [1.5], KEY), {}, ValueError, "token_ids"),
    ("block_hash empty block", prefix.block_hash, (None, [], KEY), {}, ValueError, "token_ids"),
    ("block_hash parent int", prefix.block_hash, (5, [1], KEY), {}, ValueError, "parent_hash"),
    ("block_hash key", prefix.block_hash, (None, [1], "k"), {}, ValueError, "key"),
    ("hash_chain hash_fn", prefix.hash_chain, ([1, 2, 3, 4], 2, KEY), {"hash_fn": 3}, ValueError, "hash_fn"),
    ("hash_chain block_hashes too long", prefix.hash_chain, ([1, 2, 3, 4], 2, KEY), {"block_hashes": ["a"] * 3},
     ValueError, "block_hashes"),
    ("hash_chain block_hashes str", prefix.hash_chain, ([1, 2, 3, 4], 2, KEY), {"block_hashes": "ab"}, ValueError,
     "block_hashes"),
    ("PrefixCache.match block_hashes too long", On(prefix_cache, "match"), ([1, 2, 3],), {"block_hashes": ["a"]},
     ValueError, "block_hashes"),
    ("PrefixCache.hit_extra_blocks hit", On(prefix_cache, "hit_extra_blocks"), ("h", 1), {}, ValueError, "hit"),
    ("PrefixCache.allocate lookup str", On(prefix_cache, "allocate"), ([1, 2],), {"lookup": "no"}, ValueError,
     "lookup"),
    ("plan_iteration token_budget 0", scheduler.plan_iteration, ([a_request()], 4, 0, 4), {}, ValueError,
     "token_budget"),
    ("Request.token_ids reversed", On(a_request, "token_ids"), (2, 1), {}, ValueError, "stop"),
    ("Request.token_ids past the end", On(a_request, "token_ids"), (0, 100), {}, ValueError, "stop"),
    ("Request.token_ids negative start", On(a_request, "token_ids"), (-1, 2), {}, ValueError, "start"),
    ("Request num_computed_tokens -1", request.Request, ([1, 2], 2), {"num_computed_tokens": -1}, ValueError,
     "num_computed_tokens"),
    ("Request num_computed_tokens past the tokens", request.Request, ([1, 2], 2), {"num_computed_tokens": 5},
     ValueError, "num_computed_tokens"),
    ("Request status str", request.Request, ([1, 2], 2), {"status": "running"}, ValueError, "status"),
    ("Request output id negative", request.Request, ([1, 2], 2), {"output_token_ids": [-1]}, ValueError,
     "output_token_ids"),
    ("Request request_id unhashable", request.Request, ([1, 2], 2), {"request_id": [1]}, ValueError, "request_id"),
    ("advance_decodes max_steps 0", skipahead.advance_decodes, (small_scheduler(), 0, lambda r, n: [1] * n,
                                                               lambda *a: True), {}, ValueError, "max_steps"),
    ("advance_decodes sched", skipahead.advance_decodes, ("s", 1, lambda r, n: [1] * n, lambda *a: True), {},
     ValueError, "sched"),
    ("advance_decodes may_run", skipahead.advance_decodes, (small_scheduler(), 1, lambda r, n: [1] * n, 3), {},
     ValueError, "may_run"),
    ("PriorityScheduler priority 3", priority.PriorityScheduler, (8, 4), {"priority": 3}, ValueError, "priority"),
    ("ReservingScheduler reserve paged", reservation.ReservingScheduler, (8, 4), {"reserve": "paged",
                                                                                "max_model_len": 8}, ValueError,
     "reserve"),
    ("ReservingScheduler max_len without max_model_len", reservation.ReservingScheduler, (8, 4), {}, ValueError,
     "max_model_len"),
    ("check_allocation orca", reservation.check_allocation, ("orca", 8), {}, ValueError, "allocation"),
    ("ForkingScheduler.fork a waiting request", On(forking_scheduler, "fork"), (request.Request([1], 1),), {},
     ValueError, "request"),
    ("Scheduler.postprocess nothing in flight", On(small_scheduler, "postprocess"), (None, []), {}, ValueError,
     "step"),
    ("weighted_percentile q 101", percentiles.weighted_percentile, WEIGHTS + (101,), {}, ValueError, "q"),
    ("weighted_percentile q -1", percentiles.weighted_percentile, WEIGHTS + (-1,), {}, ValueError, "q"),
    ("weighted_percentile q nan", percentiles.weighted_percentile, WEIGHTS + (nan,), {}, ValueError, "q"),
    ("weighted_percentile empty", percentiles.weighted_percentile, (np.array([]), np.array([]), 50), {}, ValueError,
     "values"),
    ("weighted_percentile lengths differ", percentiles.weighted_percentile, (WEIGHTS[0], np.array([1.0]), 50), {},
     ValueError, "weights"),
    ("weighted_percentile negative weight", percentiles.weighted_percentile, (WEIGHTS[0], np.array([-1.0, 1.0]), 50), {},
     ValueError, "weights"),
    ("Simulator.run not specs", On(lambda: simulator.Simulator(num_blocks=64), "run"), ([1],), {}, ValueError,
     "requests"),
    ("Simulator.run progress str", On(lambda: simulator.Simulator(num_blocks=64), "run"),
     ([workloads.RequestSpec(**GOOD_SPEC)],), {"progress": "no"}, ValueError, "progress"),
    ("Engine use_triton str", engine.Engine, (tiny_decoder(), 8), {"use_triton": "no"}, ValueError, "use_triton"),
    ("Engine prepare str", engine.Engine, (tiny_decoder(), 8), {"prepare": "yes"}, ValueError, "prepare"),
    ("Engine prepare None", engine.Engine, (tiny_decoder(), 8), {"prepare": None}, ValueError, "prepare"),
    ("Engine scheduler_cls", engine.Engine, (tiny_decoder(), 8), {"scheduler_cls": dict}, ValueError,
     "scheduler_cls"),
    ("generate negative token", contiguous.generate, (tiny_decoder(), [-1], 1), {}, ValueError, "prompt_ids"),
    ("generate token past vocab", contiguous.generate, (tiny_decoder(), [99], 1), {}, ValueError, "prompt_ids"),
    ("generate str prompt", contiguous.generate, (tiny_decoder(), "ab", 1), {}, ValueError, "prompt_ids"),
    ("generate model", contiguous.generate, ("m", [1], 1), {}, ValueError, "model"),
    ("generate use_cache str", contiguous.generate, (tiny_decoder(), [1], 1), {"use_cache": "no"}, ValueError,
     "use_cache"),
    ("generate_paged token past vocab", paged.generate_paged, (tiny_decoder(), [[99]], 1), {}, ValueError,
     "prompts"),
    ("generate_with_prefix_cache kv", prefix_cached.generate_with_prefix_cache, (tiny_decoder(), "kv", [1], 1), {},
     ValueError, "kv"),
    ("KVCache config", contiguous.KVCache, ("c",), {}, ValueError, "config"),
    ("KVCache.attend 2-D q", On(kv_cache, "attend"), (0, Q4[0, :, 0], K4, V4), {}, ValueError, "q"),
    ("KVPool.copy_blocks past the pool", On(kv_pool, "copy_blocks"), ([(0, 9)],), {}, ValueError, "copies"),
    ("KVPool.copy_blocks negative", On(kv_pool, "copy_blocks"), ([(0, -1)],), {}, ValueError, "copies"),
    ("PrefixCachedPool reuse str", prefix_cached.PrefixCachedPool, (tiny_config(), 4, 4), {"reuse": "no"}, ValueError, "reuse"),
    ("PrefixCachedPool model_name int", prefix_cached.PrefixCachedPool, (tiny_config(), 4, 4), {"model_name": 3}, ValueError,
     "model_name"),
    # ---- widgets
    ("paging stepper prompt_len", paging_stepper.Request, ("A", 0, -1, 3), {}, ValueError, "prompt_len"),
    ("paging stepper arrival", paging_stepper.Request, ("A", -1, 1, 3), {}, ValueError, "arrival"),
    ("paging stepper max_steps", paging_stepper.simulate, (), {"max_steps": 0}, ValueError, "max_steps"),
    ("paging stepper empty workload", paging_stepper.simulate, ([],), {}, ValueError, "workload"),
    ("paging stepper num_blocks", paging_stepper.simulate, (), {"num_blocks": 0}, ValueError, "num_blocks"),
    ("paging stepper block_size", paging_stepper.simulate, (), {"block_size": 0}, ValueError, "block_size"),
    ("load explorer rate", load_explorer.explore, (0.0, 512, 16, 1.0), {}, ValueError, "arrival_rate"),
    ("load explorer system prompt", load_explorer.explore, (1.0, -1, 16, 1.0), {}, ValueError, "system_prompt_len"),
    ("prefix stepper blocks", prefix_stepper.story, (0,), {}, ValueError, "num_blocks"),
    # issue 22: the book's figure and excerpt helpers
    ("diagram empty prompt", diagrams.prefill_decode_diagram, ([], [1], 2), {}, ValueError, "prompt_tokens"),
    ("diagram num_layers", diagrams.prefill_decode_diagram, ([1], [1], 0), {}, ValueError, "num_layers"),
    ("roadmap chapter", diagrams.roadmap, ("09",), {}, ValueError, "chapter"),
    ("excerpt first marker gone", excerpts.excerpt, (blocks.blocks_needed, "no such line"), {}, ValueError, "first"),
    ("excerpt last marker gone", excerpts.excerpt, (blocks.blocks_needed, "def", "no such line"), {}, ValueError, "last"),
    # issue 29: vLLM on a CPU, the pinned fit, the real vLLM's settings
    ("cpu budget 1.5 GiB", predict.cpu_kv_cache_bytes, (1.5,), {}, ValueError, "kvcache_space_gib"),
    ("report cpu block 16", predict.kv_cache_report, ("Llama-3-8B", 8 * GiB),
     REPORT | {"block_size": 16, "device_type": "cpu"}, ValueError, "block_size"),
    ("report device tpu", predict.kv_cache_report, ("Llama-3-8B", 8 * GiB), REPORT | {"device_type": "tpu"}, ValueError,
     "device_type"),
    ("report override 0", predict.kv_cache_report, ("Llama-3-8B", 8 * GiB), REPORT | {"num_gpu_blocks_override": 0},
     ValueError, "num_gpu_blocks_override"),
    ("stream bandwidth 1 KiB", measure.measure_stream_bandwidth, (1024,), {}, ValueError, "nbytes"),
    ("fit_steps bandwidth nan", fit.fit_steps, ([measure.StepSample(1, 0, 1.0, 0.1)] * 3,
     fit.model_cost(tiny_config(), 4), float("nan")), {}, ValueError, "memory_bandwidth"),
    ("fit_steps 2 samples", fit.fit_steps, ([measure.StepSample(1, 0, 1.0, 0.1)] * 2,
     fit.model_cost(tiny_config(), 4), 1e10), {}, ValueError, "samples"),
    ("real vLLM block 0", real.engine_args, (), {"block_size": 0}, ValueError, "block_size"),
    ("real vLLM override 1", real.engine_args, (), {"num_gpu_blocks_override": 1}, ValueError,
     "num_gpu_blocks_override"),
    ("real vLLM prefix caching str", real.engine_args, (), {"enable_prefix_caching": "no"}, ValueError,
     "enable_prefix_caching"),
    ("real vLLM threads 0", real.vllm_env, (), {"threads": 0}, ValueError, "threads"),
    ("chat workload repeats", compare.chat_workload, (None, 2, 2), {}, ValueError, "num_repeats"),
    # issue 38: max_model_len counted in tokens, as vLLM counts it
    ("Request max_model_len 0", request.Request, ([1, 2], 1), {"max_model_len": 0}, ValueError, "max_model_len"),
    ("Request max_model_len str", request.Request, ([1, 2], 1), {"max_model_len": "16"}, ValueError, "max_model_len"),
    ("Request prompt as long as max_model_len", request.Request, ([1] * 16, 1), {"max_model_len": 16}, ValueError,
     "prompt_token_ids"),
    ("Scheduler prompt as long as max_model_len", On(capped_scheduler, "add_request"), ([1] * 16, 1), {}, ValueError,
     "prompt_token_ids"),
    ("Scheduler prompt past max_model_len", On(capped_scheduler, "add_request"), ([1] * 40, 1), {}, ValueError,
     "prompt_token_ids"),
    ("Scheduler request of another max_model_len", On(capped_scheduler, "add_request"),
     (request.Request([1, 2], 1, max_model_len=32),), {}, ValueError, "max_model_len"),
]


# ---------------------------------------------------------------------------------------------- the checks


def snapshot(x: Any, depth: int = 0, seen: set[int] | None = None) -> Any:
    """A comparable deep copy of ``x``'s state: tensors by value, objects attribute by attribute."""
    seen = set() if seen is None else seen
    if isinstance(x, torch.Tensor):
        # bit for bit: an uninitialised tensor may hold NaN, which equals nothing as a number
        return ("tensor", str(x.dtype), tuple(x.shape), x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).tolist())
    if isinstance(x, np.ndarray):
        return ("array", str(x.dtype), x.tolist())
    if isinstance(x, float):
        return repr(x)  # NaN equals itself this way
    if x is None or isinstance(x, (bool, int, str, bytes, torch.dtype, torch.device, enum.Enum, range)):
        return x
    if depth > 8 or id(x) in seen:
        return ("seen", type(x).__name__)
    seen = seen | {id(x)}
    if isinstance(x, dict):
        return ("dict", [(repr(k), snapshot(v, depth + 1, seen)) for k, v in x.items()])
    if isinstance(x, (list, tuple, deque)):
        return (type(x).__name__, [snapshot(v, depth + 1, seen) for v in x])
    if isinstance(x, (set, frozenset)):
        return ("set", sorted(repr(v) for v in x))
    if isinstance(x, torch.nn.Module):
        return ("module", [(k, snapshot(v, depth + 1, seen)) for k, v in x.state_dict().items()])
    if isinstance(x, np.random.Generator):
        return ("rng", repr(x.bit_generator.state))
    if callable(x) and not hasattr(x, "__dict__"):
        return ("callable", repr(x))
    state = getattr(x, "__dict__", None)
    if state is not None:
        return (type(x).__name__, snapshot(state, depth + 1, seen))
    return ("repr", repr(x))


def run_case(call: Any, args: tuple, kwargs: dict, exc: type, param: str) -> None:
    """The call raises ``exc`` naming ``param``, and changes neither its object nor its arguments."""
    target = call
    if isinstance(call, On):
        obj = call.factory()
        target = getattr(obj, call.method)
    else:
        obj = None
    before = snapshot((obj, args, kwargs))
    with pytest.raises(exc) as err:
        target(*args, **kwargs)
    assert param in str(err.value), f"the message does not name {param!r}: {err.value}"
    assert snapshot((obj, args, kwargs)) == before, "state changed although the call was refused"


@pytest.mark.parametrize("label, call, args, kwargs, exc, param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused(label, call, args, kwargs, exc, param):
    run_case(call, args, kwargs, exc, param)


def test_the_table_is_large_and_covers_every_public_module():
    assert len(CASES) >= 100
    assert len({c[0] for c in CASES}) == len(CASES)  # one label a case
    modules = set()
    for _, call, *_ in CASES:
        fn = call.factory if isinstance(call, On) else call
        modules.add(getattr(fn, "__module__", "") or "")
    covered = {m for m in modules if m.startswith("labkit.")}
    for name in ("checks", "units", "memory.blocks", "memory.capacity", "memory.formats", "memory.paging",
                 "memory.pool_plan", "memory.prefix", "model.decoder", "kernels.paged_attention", "kernels.launch",
                 "caches.contiguous", "caches.paged", "caches.prefix_cached", "caches.quant_quality",
                 "serving.request", "serving.scheduler", "serving.engine", "serving.sim.workloads",
                 "serving.sim.costmodel", "serving.sim.simulator", "serving.sim.percentiles", "vllm_bridge.predict",
                 "teaching.widgets.paging_stepper", "teaching.widgets.load_explorer", "teaching.widgets.prefix_stepper",
                 "teaching.diagrams", "teaching.excerpts"):
        assert f"labkit.{name}" in covered, name


# The tables of the newer modules (issue 38) live beside this one, each in its own file; together:
TABLES = ("test_bad_inputs", "test_bad_inputs_quant", "test_bad_inputs_prepack", "test_bad_inputs_sim",
          "test_bad_inputs_vllm_bridge", "test_bad_inputs_teaching", "test_bad_inputs_tiers")


def all_cases() -> list[tuple]:
    """Every row of every table (imported when asked: the other tables import this module)."""
    import importlib
    return [row for name in TABLES for row in (CASES if name == __name__ else importlib.import_module(name).CASES)]


def test_every_table_together_covers_the_newer_modules_and_has_unique_labels():
    rows = all_cases()
    assert len({c[0] for c in rows}) == len(rows) and len(rows) >= len(CASES) + 74 + 40
    modules = {getattr(c[1].factory if isinstance(c[1], On) else c[1], "__module__", "") for c in rows}
    for name in ("model.prepack", "model.fused", "memory.formats", "caches.quant_quality", "kernels.reference", "serving.sim.fit",
                 "serving.sim.measure", "serving.sim.realtime", "serving.sim.workloads", "vllm_bridge.real",
                 "vllm_bridge.record", "vllm_bridge.compare", "teaching.build_it", "teaching.exercises",
                 "teaching.quizzes"):
        assert f"labkit.{name}" in modules, name


def test_the_state_check_can_fail():
    """The snapshot sees a change deep inside an object: the state check is not vacuous."""
    alloc = allocator_with_one_used()
    before = snapshot(alloc)
    alloc.allocate()
    assert snapshot(alloc) != before
    t = torch.zeros(3)
    before = snapshot(t)
    t[1] = 1
    assert snapshot(t) != before


def count_refused() -> int:
    """Print every row of every table not refused correctly, and the count; returns 0."""
    failures, rows = [], all_cases()
    for label, call, args, kwargs, exc, param in rows:
        try:
            run_case(call, args, kwargs, exc, param)
        except BaseException as e:  # noqa: BLE001 - a row that fails is counted, whatever the reason
            failures.append((label, f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"))
    for label, why in failures:
        print(f"NOT REFUSED CORRECTLY  {label}: {why}")
    print(f"{len(rows) - len(failures)} of {len(rows)} bad inputs refused correctly")
    return 0


if __name__ == "__main__":  # the count, without pytest: python tests/test_bad_inputs.py
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import test_bad_inputs  # the module the other tables import, not a second copy of it (__main__)
    sys.exit(test_bad_inputs.count_refused())
