"""The real vLLM beside labkit (appendix A4, parts 1 and 2), on a small workload.

Skipped unless ``make vllm`` has run (vLLM's own environment and the model folder). One run of the
driver starts two offline engines: the start-up one (a 1 GiB budget, max_model_len 2,048) and a small
pool that preempts; labkit predicts the first's log and serves the second's workload with its Engine.
Under 3 minutes on 2 cores (two vLLM start-ups of about 25 s each).
"""

import pytest
import torch

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.serving.sim.fit import model_cost
from labkit.vllm_bridge import compare, predict, real

pytestmark = pytest.mark.skipif(not real.is_available(), reason="needs `make vllm` (vLLM's environment)")

BLOCK, BUDGET, SEQS, POOL = 32, 128, 8, 10  # labkit's pool; vLLM's has one block more, its null block


@pytest.fixture(scope="module")
def both():
    from labkit.model.pretrained import from_pretrained, load_tokenizer, real_model
    from labkit.serving.engine import Engine

    path = real_model()
    prompts = compare.chat_workload(load_tokenizer(path), num_requests=6, num_repeats=2)
    max_tokens = [12] * len(prompts)
    runs = [{"engine": real.engine_args(block_size=BLOCK, max_model_len=2048)},
            {"engine": real.engine_args(block_size=BLOCK, max_model_len=POOL * BLOCK, max_num_seqs=SEQS,
                                        max_num_batched_tokens=BUDGET, num_gpu_blocks_override=POOL + 1),
             "prompts": prompts, "max_tokens": max_tokens, "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}]
    theirs = real.run_offline(runs, kv_cache_gib=1, threads=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = from_pretrained(path, dtype=torch.float32)
        engine = Engine(model, num_blocks=POOL, block_size=BLOCK, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS,
                        use_triton=False)
        ours = compare.serve_with_engine(engine, prompts, max_tokens)
    finally:
        torch.set_num_threads(threads)
    return theirs, ours, model


def test_part_1_the_start_up_log_is_predicted(both):
    theirs, _, model = both
    start_up, small = theirs["runs"]
    shape = model_cost(model.config, dtype_bytes=4).shape
    report = predict.kv_cache_report(shape, predict.cpu_kv_cache_bytes(1), block_size=BLOCK, max_model_len=2048,
                                     device_type="cpu")
    assert report.log_lines()[-1] in start_up["log"]
    assert start_up["counters"]["num_gpu_blocks"] == report.num_gpu_blocks == 728
    overridden = predict.kv_cache_report(shape, predict.cpu_kv_cache_bytes(1), block_size=BLOCK, max_model_len=POOL * BLOCK,
                                         device_type="cpu", num_gpu_blocks_override=POOL + 1)
    assert all(line in small["log"] for line in overridden.log_lines())


def test_part_2_one_workload_through_both_engines(both):
    theirs, ours, _ = both
    small = theirs["runs"][1]
    assert small["outputs"] == ours["outputs"]  # fp32 greedy: every token of every request
    assert small["num_cached_tokens"] == ours["num_cached_tokens"]
    assert {k: small["counters"][k] for k in ours["counters"]} == ours["counters"]
    assert ours["counters"]["num_preemptions"] >= 1 and ours["counters"]["prefix_cache_hits"] > 0
    # a repeat finds more than a system prompt
    assert max(ours["num_cached_tokens"]) > sorted(ours["num_cached_tokens"])[-3]
    schedule, preempted = compare.vllm_schedule(small["steps"])
    assert schedule == ours["schedule"] and preempted == ours["preempted"]  # step by step
