"""The expected values of the book's value exercises, by chapter and exercise name.

A value exercise asks for one number (or a pair, a list). If its checker cell held the
expected value, pasting that expression would pass, so the cell holds only the reader's
answer: ``ex.check("Exercise 1", answer_1)``. ``Exercises.check`` then asks ``expected``
here, which computes the value with labkit itself, never types it in.

Each entry is a function of no arguments returning ``(expected, rel_tol)``; it may build
small models or pools, so it runs only when its exercise is checked.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["expected", "lookup", "EXERCISES"]


def _warm_up() -> tuple[Any, float]:
    return 2**30, 0.0


def _cache_positions_01() -> tuple[Any, float]:
    """Chapter 01, Exercise 1: positions in the cache after a 20-token prompt and 5 generated tokens."""
    from ..caches.contiguous import generate
    from ..model.decoder import Decoder, DecoderConfig

    return generate(Decoder.random(DecoderConfig(), seed=0), list(range(20)), 5).cache_tokens, 0.0


def _qwen_per_token_02() -> tuple[Any, float]:
    from ..memory.capacity import PRESETS

    return PRESETS["Qwen2.5-7B"].bytes_per_token(), 0.0


def _query_head_mistake_02() -> tuple[Any, float]:
    from ..memory.capacity import PRESETS

    llama = PRESETS["Llama-3-70B"]
    return 8192 * (llama.query_head_mistake() - llama.bytes_per_token()), 0.0


def _sharded_gemma_a2() -> tuple[Any, float]:
    """Appendix A2, Exercise 2: Gemma-2-9B's bytes per token on each of 16 tensor-parallel devices."""
    from ..memory.capacity import PRESETS, shard

    return shard(PRESETS["Gemma-2-9B"], tensor_parallel_size=16).bytes_per_token(), 0.0


def _tail_bytes_03() -> tuple[Any, float]:
    """Chapter 03, Exercise 2: bytes of empty tail slots of section 2's 10,000 requests in 32-token blocks."""
    from ..memory.blocks import blocks_needed
    from ..memory.capacity import TEACHING_MODEL
    from ..memory.paging import BlockAllocator, BlockTable
    from ..serving.sim.workloads import sharegpt_like

    empty = 0
    for r in sharegpt_like(10_000, arrival_rate=4.0, seed=0):
        n = r.prompt_len + r.output_len
        table = BlockTable(32)
        table.append(n, BlockAllocator(blocks_needed(n, 32) + 1))
        empty += table.empty_slots
    return empty * TEACHING_MODEL.bytes_per_token(), 0.0


def _three_requests_04() -> tuple[Any, float]:
    """Chapter 04, Exercise 3: three 8,192-token requests sharing 4,096 tokens, prefilled into one pool."""
    from ..memory.capacity import TEACHING_MODEL
    from ..memory.paging import BlockAllocator
    from ..memory.prefix import PrefixCache

    cache = PrefixCache(BlockAllocator(2048), block_size=16)
    shared = list(range(4096))
    for r in range(3):
        table, _ = cache.allocate(shared + [(r + 1) * 100_000 + i for i in range(4096)])
        cache.cache_full_blocks(table)
    return cache.allocator.num_used * TEACHING_MODEL.block_bytes(16), 0.0


def _recompute_05() -> tuple[Any, float]:
    """Chapter 05's quiz: the chunk that brings back a preempted request with 3 prompt tokens and 3 outputs."""
    from ..serving.request import Request

    request = Request([1, 2, 3], 8)
    request.output_token_ids = [7, 7, 7]
    return request.num_new_tokens, 0.0


def _pool_32_06() -> tuple[Any, float]:
    from ..memory.pool_plan import plan_pool

    return plan_pool(block_size=32).sequences_after_management, 0.0


def _concurrency_a2() -> tuple[Any, float]:
    from ..memory.capacity import TEACHING_MODEL
    from ..units import GiB
    from ..vllm_bridge import predict

    report = predict.kv_cache_report(TEACHING_MODEL, predict.available_kv_bytes(24 * GiB, 0.92, 17 * GiB),
                                     max_model_len=4096)
    return report.max_concurrency, 1e-12


def _cpu_report_a4() -> Any:
    """Appendix A4: vLLM's report for the real model in float32 with 3 GiB of CPU KV space."""
    from ..model import gguf, gguf_decoder
    from ..model.pretrained import real_model
    from ..serving.sim.fit import model_cost
    from ..vllm_bridge import predict

    config = gguf_decoder.decoder_config(gguf.read_gguf(real_model()))
    shape = model_cost(config, dtype_bytes=4).shape
    return predict.kv_cache_report(shape, predict.cpu_kv_cache_bytes(3), block_size=64, max_model_len=4096,
                                   device_type="cpu")


def _smallest_group_a1() -> tuple[Any, float]:
    """Appendix A1, Exercise 1: the smallest GQA group whose decode intensity (2g / b FLOP per byte of
    K and V, b = 2) reaches the H100's ridge point."""
    from ..serving.sim.costmodel import DEVICES

    ridge = DEVICES["H100 SXM"].ridge_point
    return next(g for g in range(1, 100_000) if 2 * g / 2 >= ridge), 0.0


def _gate_blocks_a5() -> tuple[Any, float]:
    """Appendix A5, Exercise 1: the free blocks vLLM's gate asks of a request with a 600-token prompt and
    14 outputs, whose first 256 tokens another running request holds (blocks of 16), from a real
    PrefixCache."""
    from ..memory.paging import BlockAllocator
    from ..memory.prefix import PrefixCache

    cache = PrefixCache(BlockAllocator(256), 16)
    tokens = list(range(1, 600 + 14 + 1))
    holder, _ = cache.allocate(tokens[:256 + 1])  # the other request: the hit's blocks and one more token
    cache.cache_full_blocks(holder)
    hit = cache.match(tokens)
    return cache.hit_extra_blocks(hit, len(tokens) - hit.num_cached_tokens), 0.0


def _recomputed_share_a6() -> tuple[Any, float]:
    """Appendix A6, Exercise 1: the share of the paged headline run's computed tokens that were
    recomputations (the run of A6's headline section: 300 ShareGPT-like requests at 20/s, 2 GiB)."""
    from ..serving.sim import workloads
    from ..serving.sim.costmodel import CostModel
    from ..serving.sim.simulator import Simulator
    from ..units import GiB

    cost = CostModel("teaching model", "RTX 4090 (24 GiB)")
    run = Simulator(cost, pool_bytes=2 * GiB, max_num_batched_tokens=2048, enable_prefix_caching=False,
                    allocation="paged", max_model_len=2048).run(
        workloads.sharegpt_like(300, arrival_rate=20.0, seed=1))
    return float(run.recomputed_tokens / run.step_tokens.sum()), 1e-9


def _embedding_bytes_a7() -> tuple[int, float]:
    """The bytes the book's GGUF file stores for its token embedding, read from the file itself."""
    from ..model.gguf import read_gguf
    from ..model.pretrained import real_model

    return read_gguf(real_model()).tensors["token_embd.weight"].num_bytes, 0.0


EXERCISES: dict[tuple[str, str], Callable[[], tuple[Any, float]]] = {
    ("00_start_here", "Warm-up"): _warm_up,
    ("01_why_the_cache_grows", "Exercise 1"): _cache_positions_01,
    ("02_cost_per_token", "Exercise 1"): _qwen_per_token_02,
    ("02_cost_per_token", "Exercise 2"): _query_head_mistake_02,
    ("03_paging", "Exercise 2"): _tail_bytes_03,
    ("04_prefix_reuse", "Exercise 3"): _three_requests_04,
    ("06_from_fit_to_serve", "Exercise 1"): _pool_32_06,
    ("A1_under_the_compiler", "Exercise 1"): _smallest_group_a1,
    ("A2_vllm_start_up", "Exercise 1"): _concurrency_a2,
    ("A2_vllm_start_up", "Exercise 2"): _sharded_gemma_a2,
    ("A4_real_vllm_on_cpu", "Exercise 1 (blocks)"): lambda: (_cpu_report_a4().num_gpu_blocks, 0.0),
    ("A4_real_vllm_on_cpu", "Exercise 1 (concurrency)"): lambda: (_cpu_report_a4().max_concurrency, 1e-9),
    ("A5_vllm_scheduler", "Exercise 1"): _gate_blocks_a5,
    ("A6_measuring_a_server", "Exercise 1 (oracle)"): lambda: (0.0, 0.0),
    ("A6_measuring_a_server", "Exercise 1 (paged)"): _recomputed_share_a6,
    ("A7_a_model_in_one_file", "Exercise 1"): _embedding_bytes_a7,
}


def lookup(chapter: str, name: str) -> Callable[[], tuple[Any, float]]:
    """The function computing value exercise ``name`` of ``chapter``, without running it; ValueError
    naming the parameter when there is no such exercise."""
    chapters = sorted({c for c, _ in EXERCISES})
    if chapter not in chapters:
        raise ValueError(f"chapter must be one of the chapters with value exercises, {chapters}, got {chapter!r}")
    if not isinstance(name, str) or (chapter, name) not in EXERCISES:
        raise ValueError(f"name must be one of the value exercises of chapter {chapter!r}, "
                         f"{sorted(n for c, n in EXERCISES if c == chapter)}, got {name!r}")
    return EXERCISES[(chapter, name)]


def expected(chapter: str, name: str) -> tuple[Any, float]:
    """``(expected value, relative tolerance)`` of value exercise ``name`` in ``chapter``."""
    return lookup(chapter, name)()
