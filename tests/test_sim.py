"""labkit.serving.sim.costmodel, labkit.serving.sim.workloads and labkit.serving.sim.simulator (chapter 06).

The simulator is checked three ways: against chapter 05's real engine (the same
schedule and the same blocks at every step), against itself (skip-ahead must give
exactly what stepping through every iteration gives), and against plain
references (the cost model's sums, percentiles, Fig. 2's shares by brute force).
"""

from __future__ import annotations

import math
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest

import labkit  # noqa: F401
from labkit.memory.capacity import TEACHING_MODEL, ModelShape
from labkit.memory.pool_plan import plan_pool, reservation_shares
from labkit.model.decoder import Decoder, DecoderConfig
from labkit.serving.engine import Engine
from labkit.serving.scheduler import Scheduler
from labkit.serving.sim.costmodel import DEVICES, CostModel, ModelCost, get_device, get_model_cost
from labkit.serving.sim.percentiles import latency_percentiles, weighted_percentile
from labkit.serving.sim.realtime import MeasuredRun
from labkit.serving.sim.simulator import Simulator, step_sums
from labkit.serving.sim.work import work_sums
from labkit.serving.sim.workloads import (ALPACA, SHAREGPT, RequestSpec, long_document_questions, make_workload,
                                          poisson_arrivals, sharegpt_like)
from labkit.units import GiB

# --------------------------------------------------------------------------- cost model


def test_weights_match_a_real_decoders_parameters():
    """ModelCost counts the matrices of labkit's Decoder exactly (norms aside)."""
    cfg = DecoderConfig(vocab_size=211, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                        num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    model = Decoder.random(cfg, seed=0)
    matrices = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name)
    shape = ModelShape("tiny", num_layers=3, num_kv_heads=2, head_dim=16, num_attention_heads=6)
    cost = ModelCost(shape, hidden_size=48, intermediate_size=80, vocab_size=211)
    assert cost.num_params == matrices
    # Per token, every matrix but the embedding table is multiplied: 2 operations per weight.
    embedding = model.model.embed_tokens.weight.numel()
    assert cost.flops_per_token == 2 * (matrices - embedding)


def test_teaching_model_weights_are_llama3_8b_sized():
    cost = get_model_cost("teaching model")
    assert cost.shape.bytes_per_token() == 131072
    assert 8.0e9 < cost.num_params < 8.1e9  # Llama-3-8B: 8.03 billion
    assert 14.9 * GiB < cost.weight_bytes < 15 * GiB  # so 17 GiB covers weights + workspace + reserve


def brute_force_step(model: ModelCost, device, work, overhead=0.0):
    """Bytes and operations of one step token by token, in float64."""
    moved = float(model.weight_bytes)
    flops = 0.0
    for context, new in work:
        moved += (context + new) * model.shape.bytes_per_token()
        for p in range(context, context + new):  # the token at position p sees p + 1 positions
            flops += model.flops_per_token + model.attention_flops_per_pair * (p + 1)
    return max(moved / device.memory_bandwidth, flops / device.peak_flops) + overhead


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_step_time_matches_token_by_token_sum(device):
    rng = random.Random(device)
    cost = CostModel("Llama-3-8B", device, overhead_s=1e-3)
    for _ in range(5):
        work = [(rng.randrange(0, 3000), rng.choice([1, 1, 1, rng.randrange(1, 600)]))
                for _ in range(rng.randrange(1, 12))]
        expected = brute_force_step(cost.model, cost.device, work, 1e-3)
        assert math.isclose(cost.step(work).time_s, expected, rel_tol=1e-12)
        new = sum(n for _, n in work)
        ctx = sum(c for c, _ in work)
        pairs = sum(n * c + n * (n + 1) / 2 for c, n in work)
        assert math.isclose(cost.time_from_sums(new, ctx, pairs), expected, rel_tol=1e-12)
        assert math.isclose(float(cost.times_from_sums(new, np.array([ctx]), np.array([pairs]))[0]), expected,
                            rel_tol=1e-12)


def test_decode_is_memory_bound_and_long_prefill_compute_bound():
    cost = CostModel("teaching model", "H100 SXM")
    assert cost.step([(1000, 1)] * 8).bound == "memory"
    assert cost.step([(0, 8192)]).bound == "compute"
    # Concurrency: the weight read is shared, the history read is not.
    one, many = cost.decode_step_time(1, 4096), cost.decode_step_time(64, 4096)
    assert many < 64 * one                      # per-token cost falls with the batch...
    assert many > one                           # ...but every sequence adds its history
    assert math.isclose(cost.memory_bound_step(64, 64 * 4096) - cost.memory_bound_step(1, 4096),
                        63 * 4097 * cost.kv_bytes_per_token / cost.device.memory_bandwidth, rel_tol=1e-12)


def test_cost_model_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="device"):
        get_device("TPU v9")
    with pytest.raises(ValueError, match="model"):
        CostModel("GPT-5", "L4")
    with pytest.raises(ValueError, match="overhead_s"):
        CostModel(overhead_s=-1)
    with pytest.raises(ValueError, match="work"):
        CostModel().step([(0, 0)])
    with pytest.raises(ValueError, match="batch_size"):
        CostModel().decode_step_time(0, 10)


# --------------------------------------------------------------------------- workloads


@pytest.mark.parametrize("profile", [SHAREGPT, ALPACA])
def test_length_means_match_the_papers_datasets(profile):
    w = make_workload(20000, 5.0, profile, seed=11)
    prompts = np.array([r.prompt_len for r in w])
    outputs = np.array([r.output_len for r in w])
    assert abs(prompts.mean() / profile.prompt_mean - 1) < 0.03
    assert abs(outputs.mean() / profile.output_mean - 1) < 0.03
    assert prompts.min() >= 1 and prompts.max() <= profile.max_prompt_len
    assert outputs.min() >= 1 and outputs.max() <= profile.max_output_len
    assert np.median(outputs) < outputs.mean()  # right-skewed, as real lengths are


def test_poisson_arrivals_and_seeds():
    times = poisson_arrivals(50000, 8.0, np.random.default_rng(0))
    gaps = np.diff(times)
    assert times[0] == 0 and np.all(gaps >= 0)
    assert abs(gaps.mean() * 8.0 - 1) < 0.02
    assert abs(gaps.std() / gaps.mean() - 1) < 0.03  # exponential: std = mean
    a, b, c = sharegpt_like(50, 2.0, seed=3), sharegpt_like(50, 2.0, seed=3), sharegpt_like(50, 2.0, seed=4)
    assert [(r.arrival_time, r.prompt_token_ids, r.output_len) for r in a] == \
        [(r.arrival_time, r.prompt_token_ids, r.output_len) for r in b]
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


def test_shared_prefixes_share_exact_token_ids():
    w = make_workload(400, 3.0, ALPACA, shared_prefix_len=100, prefix_share=0.25, seed=5)
    sharing = [r for r in w if r.prefix_len]
    assert 0.15 < len(sharing) / len(w) < 0.35
    doc = sharing[0].prompt_token_ids[:100]
    assert all(r.prompt_token_ids[:100] == doc and r.prompt_len > 100 for r in sharing)
    others = [r for r in w if not r.prefix_len]
    assert all(r.prompt_token_ids[:100] != doc for r in others)


def test_workload_bad_input_names_the_parameter():
    for rate in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="arrival_rate"):
            sharegpt_like(10, rate)
    with pytest.raises(ValueError, match="prefix_share"):
        make_workload(10, 1.0, prefix_share=1.5)
    with pytest.raises(ValueError, match="lengths"):
        make_workload(10, 1.0, "MMLU")


# --------------------------------------------------------------------------- §06 and Fig. 2


def test_section_06_pool():
    plan = plan_pool(24 * GiB, 17 * GiB, TEACHING_MODEL, block_size=16)
    assert plan.pool_bytes == 7 * GiB
    assert plan.num_blocks == 3584 and plan.block_bytes == 2 * 2**20
    assert plan.sequences_that_fit == 7
    # 256 sequence slots x 512 int32 entries + lengths + one step's int64 slot mapping.
    assert plan.management_bytes == 256 * 512 * 4 + 256 * 4 + 8192 * 8
    assert plan.num_blocks_after_management == 3583
    assert plan.sequences_after_management == 6
    # Without bookkeeping that large, nothing is lost.
    assert plan_pool(max_num_seqs=1, max_num_batched_tokens=1).num_blocks_after_management == 3583


def test_pool_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="set_aside_bytes"):
        plan_pool(24 * GiB, 25 * GiB)
    with pytest.raises(ValueError, match="set_aside_bytes"):
        plan_pool(24 * GiB, 24 * GiB - 1)  # a pool smaller than one block
    with pytest.raises(ValueError, match="device_bytes"):
        plan_pool(-1, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        Simulator(num_blocks=0)
    with pytest.raises(ValueError, match="pool_bytes"):
        Simulator(pool_bytes=2**20)  # half a 16-token block of the teaching model
    with pytest.raises(ValueError, match="num_blocks"):
        Simulator()


def test_reservation_shares_match_a_brute_force_count():
    rng = random.Random(0)
    specs = [RequestSpec(i, 0.0, [1] * rng.randrange(1, 60), rng.randrange(1, 70)) for i in range(40)]
    shares = reservation_shares(specs, max_len=256, block_size=16)
    live = {k: 0 for k in shares}
    reserved = {k: 0 for k in shares}
    for r in specs:
        total = r.prompt_len + r.output_len
        pow2 = 1
        while pow2 < total:
            pow2 *= 2
        for t in range(1, r.output_len + 1):
            n = r.prompt_len + t
            for k, slots in zip(shares, (256, pow2, total, -(-n // 16) * 16)):
                live[k] += n
                reserved[k] += slots
    for k in shares:
        assert math.isclose(shares[k], live[k] / reserved[k], rel_tol=1e-12)
    values = list(shares.values())
    assert values == sorted(values)  # each policy wastes less than the one before


def test_weighted_percentile_equals_repeating_values():
    rng = np.random.default_rng(0)
    values = rng.random(50)
    weights = rng.integers(1, 6, size=50)
    repeated = np.repeat(values, weights)
    for q in (0, 10, 50, 90, 99, 100):
        assert weighted_percentile(values, weights.astype(float), q) == \
            np.percentile(repeated, q, method="inverted_cdf")


def test_the_simulator_and_a_measured_run_read_percentiles_by_one_definition():
    """One percentile definition (issue 37): a simulated run's and a measured run's TTFT and ITL
    percentiles are ``latency_percentiles``, the inverted CDF. Ten TTFTs of 1..10 s: the p50 is 5 s, a
    value that occurred (linear interpolation, numpy's default, would say 5.5 s)."""
    ttft = np.arange(1.0, 11.0)
    assert latency_percentiles(ttft)["p50"] == 5.0 != np.percentile(ttft, 50)
    measured = MeasuredRun(ttft=ttft, itl=ttft / 10, steps=[], outputs=[])
    assert measured.ttft_percentiles() == latency_percentiles(ttft)
    assert measured.itl_percentiles() == latency_percentiles(ttft / 10)
    specs = sharegpt_like(40, arrival_rate=20.0, seed=3)
    result = Simulator(CostModel("teaching model", "A100 80GB SXM"), num_blocks=400).run(specs)
    assert result.ttft_percentiles() == latency_percentiles(result.ttft)
    assert result.itl_percentiles() == latency_percentiles(result.itl, result.itl_weight)
    for q in (50, 90, 99):
        assert result.ttft_percentiles()[f"p{q}"] == np.percentile(result.ttft, q, method="inverted_cdf")
        repeated = np.repeat(result.itl, result.itl_weight.astype(int))
        assert result.itl_percentiles()[f"p{q}"] == np.percentile(repeated, q, method="inverted_cdf")


def test_vllms_steps_and_labkits_are_summed_by_one_rule():
    """The step recorder of vLLM's driver and the simulator's ``step_sums`` both call ``work_sums``: the same
    three sums for the same chunks, one a vLLM ``SchedulerOutput``, the other a labkit ``Step``."""
    from labkit.vllm_bridge import driver  # imports only the standard library, and work.py by its path

    sched = Scheduler(32, 4, 16)
    for prompt in ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10], list(range(20, 40))):
        sched.add_request(prompt, 3)
    step = sched.schedule()
    sched.postprocess(step, [0] * len(step.sampling_chunks))
    step = sched.schedule()  # decodes beside a chunk of the long prompt
    new = [c for c in step.chunks if c.start == 0]
    cached = [c for c in step.chunks if c.start > 0]
    vllm_output = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=c.request.request_id, num_computed_tokens=c.start) for c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[c.request.request_id for c in cached],
                                              num_computed_tokens=[c.start for c in cached]),
        num_scheduled_tokens={c.request.request_id: c.num_tokens for c in step.chunks})
    assert cached and driver.step_sums(vllm_output) == step_sums(step)
    k, start = 3, 5
    assert work_sums([(start, k)]) == (k, start, k * start + k * (k + 1) / 2)  # a chunk's causal pairs


def test_itl_percentiles_are_nan_without_a_second_token():
    """One output token each: no interval to measure. weighted_percentile refuses empty input, the
    result says NaN (as before that check), and the summary still has its row."""
    specs = [RequestSpec(request_id=i, arrival_time=0.1 * i, prompt_token_ids=[1, 2, 3], output_len=1)
             for i in range(3)]
    result = Simulator(num_blocks=16).run(specs)
    assert len(result.itl) == 0
    assert all(math.isnan(v) for v in result.itl_percentiles().values())
    assert math.isnan(result.summary()["ITL p50 (ms)"])


# --------------------------------------------------------------------------- the simulator

# More random systems for the skip-ahead check: SIM_RANDOM_SEEDS=600 pytest tests/test_sim.py -k random
RANDOM_SEEDS = int(os.environ.get("SIM_RANDOM_SEEDS", "24"))

SMALL = DecoderConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)


def tiny_workload(seed: int, n: int, shared: int, max_prompt: int, max_output: int, spread: float):
    """Requests with ids < 97 (the tiny model's vocabulary); odd ones share a prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(SMALL.vocab_size) for _ in range(shared)]
    specs, t = [], 0.0
    for i in range(n):
        own = [rng.randrange(SMALL.vocab_size) for _ in range(rng.randrange(1, max_prompt))]
        uses = i % 2 == 1
        specs.append(RequestSpec(i, t, (prefix if uses else []) + own, rng.randrange(1, max_output),
                                 shared if uses else 0))
        t += rng.random() * spread
    return specs


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder.random(SMALL, seed=3)


ENGINE_CASES = [(0, 16, 32, 0.01), (1, 12, 16, 0.003), (2, 40, 64, 0.05), (3, 9, 8, 0.0), (4, 10, 3, 0.02),
                (5, 30, 1, 0.001)]


@pytest.mark.parametrize("gate", [True, False], ids=["full-sequence", "chunk-only"])
@pytest.mark.parametrize("seed, num_blocks, budget, spread", ENGINE_CASES)
def test_simulator_and_engine_make_the_same_schedule(model, seed, num_blocks, budget, spread, gate):
    """Chapter 05's engine (a real model, real K/V) and the simulator (synthetic tokens)
    plan the same steps: the same requests, token counts and block tables at every step."""
    specs = tiny_workload(seed, 8, shared=9, max_prompt=24, max_output=14, spread=spread)
    sim = Simulator(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, record_schedule=True,
                    full_sequence_must_fit=gate)
    result = sim.run(specs)
    assert result.scheduler.full_sequence_must_fit is gate
    engine = Engine(model, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, use_triton=False,
                    full_sequence_must_fit=gate)
    order = sorted(range(len(specs)), key=lambda i: (specs[i].arrival_time, i))
    by_engine_id, k, trace = {}, 0, []
    while k < len(order) or engine.has_unfinished():
        step_no = engine.scheduler.num_steps + 1
        while k < len(order) and result.queued_at_step[k] <= step_no:
            spec = specs[order[k]]
            request = engine.add_request(spec.prompt_token_ids, spec.output_len)
            by_engine_id[request.request_id] = spec.request_id
            k += 1
        step = engine.step()
        trace.append([(by_engine_id[c.request.request_id], c.start, c.num_tokens, tuple(c.block_table))
                      for c in step.chunks])
    assert trace == result.schedule
    assert engine.scheduler.allocator.num_free == num_blocks


def test_the_engine_comparison_covers_hits_preemption_and_chunks(monkeypatch):
    """The workloads above do exercise what could make the two differ: prefix hits,
    preemption, recomputation, skip-ahead, chunked prefill (a chunk that ends inside the
    prompt) and a waiting request that blocks the queue behind it (head of line)."""
    blocked = []

    class Recording(Scheduler):
        def schedule(self):
            step = super().schedule()
            turns = [d for d in step.decisions if d.waiting]
            if turns and turns[-1].outcome == "skipped" and self.waiting[-1] is not turns[-1].request:
                blocked.append(step.index)  # someone queued behind the skipped request was not tried
            return step

    monkeypatch.setattr("labkit.serving.sim.simulator.scheduler_class", lambda allocation: (Recording, {}))
    results, mid_prompt_chunks = [], 0
    for s, nb, b, sp in ENGINE_CASES:
        specs = tiny_workload(s, 8, shared=9, max_prompt=24, max_output=14, spread=sp)
        r = Simulator(num_blocks=nb, block_size=4, max_num_batched_tokens=b, record_schedule=True).run(specs)
        prompt_len = {sp_.request_id: sp_.prompt_len for sp_ in specs}
        mid_prompt_chunks += sum(1 for step in r.schedule for rid, start, n, _ in step
                                 if start + n < prompt_len[rid])
        results.append(r)
    assert sum(r.hit_tokens.sum() for r in results) > 0
    assert sum(r.preemptions.sum() for r in results) > 0
    assert sum(r.recomputed_tokens for r in results) > 0
    assert any(r.skipped_steps for r in results)
    assert mid_prompt_chunks > 0
    assert blocked


def assert_same_run(a, b):
    for name in ("first_token", "finish", "hit_tokens", "preemptions", "step_start", "step_end", "step_tokens",
                 "num_running", "num_waiting", "used_blocks", "live_tokens", "queued_at_step"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    # Interval lists are grouped differently (one per token vs one per stretch): compare as multisets.
    for x, y in ((a.itl, a.itl_weight), (b.itl, b.itl_weight)):
        assert len(x) == len(y)
    ua, ca = np.unique(a.itl, return_inverse=True)
    ub, cb = np.unique(b.itl, return_inverse=True)
    assert np.array_equal(ua, ub)
    assert np.array_equal(np.bincount(ca, a.itl_weight), np.bincount(cb, b.itl_weight))
    assert a.schedule == b.schedule
    sa, sb = a.scheduler, b.scheduler
    assert sa.allocator.ref_counts == sb.allocator.ref_counts
    assert list(sa.allocator._free) == list(sb.allocator._free)  # same LRU order
    assert sorted(sa.allocator.names) == sorted(sb.allocator.names)
    assert sa.prefix_cache.stats == sb.prefix_cache.stats and sa.allocator.num_evictions == sb.allocator.num_evictions
    assert [r.output_token_ids for r in a.requests] == [r.output_token_ids for r in b.requests]


WORKLOADS = {
    "chat, roomy pool": (lambda: sharegpt_like(60, 6.0, seed=1), dict(num_blocks=2000)),
    "chat, tight pool (preemption, queue)": (lambda: sharegpt_like(60, 30.0, seed=2),
                                             dict(num_blocks=130, max_num_batched_tokens=512)),
    "long document, shared prefix": (lambda: long_document_questions(30, 3.0, document_len=700, seed=3),
                                     dict(num_blocks=400, max_num_batched_tokens=256)),
    "mixed, small blocks, no caching": (lambda: make_workload(50, 20.0, ALPACA, shared_prefix_len=40,
                                                              prefix_share=0.5, seed=4),
                                        dict(num_blocks=120, block_size=4, enable_prefix_caching=False)),
    "mixed, eviction pressure": (lambda: make_workload(50, 15.0, ALPACA, shared_prefix_len=64,
                                                       prefix_share=0.6, seed=5),
                                 dict(num_blocks=60, block_size=8, max_num_batched_tokens=128)),
    "chat, 4 seats (max_num_seqs, queue)": (lambda: sharegpt_like(40, 20.0, seed=6),
                                            dict(num_blocks=2000, max_num_seqs=4)),
    # reservations (the PagedAttention paper's baselines): a request never grows after admission
    "chat, reserve max length": (lambda: sharegpt_like(60, 30.0, seed=2),
                                 dict(num_blocks=400, allocation="max_len", max_model_len=2048)),
    "mixed, reserve exact, shared prefixes, eviction": (
        lambda: make_workload(50, 15.0, ALPACA, shared_prefix_len=64, prefix_share=0.6, seed=5),
        dict(num_blocks=60, block_size=8, max_num_batched_tokens=128, allocation="exact")),
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_skip_ahead_gives_exactly_what_stepping_gives(name):
    make, settings = WORKLOADS[name]
    specs = make()
    cost = CostModel("teaching model", "L4", overhead_s=2e-4)
    stepped = Simulator(cost, skip_ahead=False, record_schedule=True, **settings).run(specs)
    skipped = Simulator(cost, skip_ahead=True, record_schedule=True, **settings).run(specs)
    assert stepped.skipped_steps == 0 and skipped.skipped_steps > 0
    assert_same_run(stepped, skipped)
    assert skipped.scheduler.allocator.num_free == settings["num_blocks"]  # every block came back
    if settings.get("allocation", "paged") != "paged":  # a reservation never grows: a queue, no preemption
        assert skipped.preemptions.sum() == 0 and skipped.num_waiting.max() > 0


def test_skip_ahead_covers_preemption_waiting_and_eviction():
    runs = {name: Simulator(CostModel("teaching model", "L4", overhead_s=2e-4), **s).run(make())
            for name, (make, s) in WORKLOADS.items()}
    assert runs["chat, tight pool (preemption, queue)"].preemptions.sum() > 0
    assert runs["chat, tight pool (preemption, queue)"].num_waiting.max() > 0
    assert runs["long document, shared prefix"].reuse_ratio > 0.8
    assert runs["mixed, eviction pressure"].scheduler.allocator.num_evictions > 0
    assert runs["mixed, small blocks, no caching"].reuse_ratio == 0
    seats = runs["chat, 4 seats (max_num_seqs, queue)"]
    assert seats.num_running.max() == 4 and seats.num_waiting.max() > 0


def test_one_request_alone_is_timed_by_the_cost_model():
    cost = CostModel("teaching model", "A100 80GB SXM")
    prompt, output = 300, 20
    spec = RequestSpec(0, 1.5, list(range(1, prompt + 1)), output)
    result = Simulator(cost, num_blocks=100, max_num_batched_tokens=128).run([spec])
    # Prefill in chunks of 128: the first token comes with the last chunk.
    assert math.isclose(result.ttft[0], cost.prefill_time(prompt, 128), rel_tol=1e-12)
    expected_itl = [cost.decode_step_time(1, prompt + t) for t in range(output - 1)]
    assert np.allclose(np.repeat(result.itl, result.itl_weight.astype(int)), expected_itl, rtol=1e-12)
    assert math.isclose(result.finish[0] - 1.5, cost.prefill_time(prompt, 128) + sum(expected_itl), rel_tol=1e-12)
    assert result.num_steps == 3 + output - 1


def test_metrics_on_a_run():
    specs = sharegpt_like(80, 5.0, seed=7)
    result = Simulator(num_blocks=3584).run(specs)
    assert np.all(result.first_token >= result.arrival) and np.all(result.finish >= result.first_token)
    assert result.itl_weight.sum() == sum(s.output_len - 1 for s in specs)
    assert 0 < result.mean_occupancy < 1
    assert result.live_token_share <= 1  # no sharing: live tokens never exceed held slots
    p = result.ttft_percentiles()
    assert p["p50"] <= p["p90"] <= p["p99"]
    assert result.recomputed_tokens == 0 and result.reuse_ratio == 0
    assert math.isclose(result.output_tokens_per_s * result.makespan, sum(s.output_len for s in specs))


def test_simulator_bad_input():
    with pytest.raises(ValueError, match="requests"):
        Simulator(num_blocks=10).run([])
    with pytest.raises(ValueError, match="max_new_tokens"):  # cannot fit even alone in the pool
        Simulator(num_blocks=2, block_size=4).run([RequestSpec(0, 0.0, [1] * 5, 10)])
    with pytest.raises(ValueError, match="block_size"):
        Simulator(num_blocks=10, block_size=0)
    with pytest.raises(ValueError, match="cost_model"):
        Simulator("teaching model", num_blocks=10)


@pytest.mark.parametrize("seed", range(RANDOM_SEEDS))
def test_skip_ahead_on_random_small_systems(seed):
    """Random pools, block sizes, budgets, arrival spreads and prefix sharing: always identical."""
    rng = random.Random(seed)
    bs = rng.choice([2, 3, 4, 8])
    specs = tiny_workload(seed, rng.randrange(3, 14), shared=rng.choice([0, 5, 12]), max_prompt=rng.randrange(2, 30),
                          max_output=rng.randrange(2, 40), spread=rng.choice([0.0, 0.002, 0.02, 0.2]))
    need = max(-(-(s.prompt_len + s.output_len) // bs) for s in specs)
    settings = dict(num_blocks=need + rng.randrange(0, 3 * need), block_size=bs,
                    max_num_batched_tokens=rng.choice([1, 3, 8, 32, 256]),
                    enable_prefix_caching=rng.random() < 0.8, max_num_seqs=rng.choice([1, 2, 5, 256]))
    cost = CostModel("teaching model", rng.choice(sorted(DEVICES)), overhead_s=rng.choice([0.0, 1e-3]))
    stepped = Simulator(cost, skip_ahead=False, record_schedule=True, **settings).run(specs)
    skipped = Simulator(cost, skip_ahead=True, record_schedule=True, **settings).run(specs)
    assert_same_run(stepped, skipped)
    assert skipped.scheduler.allocator.num_free == settings["num_blocks"]




@pytest.mark.parametrize("seed", range(RANDOM_SEEDS // 3))
def test_skip_ahead_on_random_small_systems_with_reservations(seed):
    rng = random.Random(1000 + seed)
    bs = rng.choice([2, 3, 4, 8])
    specs = tiny_workload(seed, rng.randrange(3, 14), shared=rng.choice([0, 5, 12]), max_prompt=rng.randrange(2, 30),
                          max_output=rng.randrange(2, 40), spread=rng.choice([0.0, 0.002, 0.02, 0.2]))
    longest = max(s.prompt_len + s.output_len - 1 for s in specs)
    max_model_len = longest + rng.randrange(0, 2 * bs)
    settings = dict(num_blocks=-(-max_model_len // bs) * rng.randrange(1, 4), block_size=bs,
                    max_num_batched_tokens=rng.choice([1, 3, 8, 32, 256]),
                    enable_prefix_caching=rng.random() < 0.8, max_num_seqs=rng.choice([1, 2, 5, 256]),
                    allocation=rng.choice(["max_len", "exact"]), max_model_len=max_model_len)
    cost = CostModel("teaching model", rng.choice(sorted(DEVICES)), overhead_s=rng.choice([0.0, 1e-3]))
    stepped = Simulator(cost, skip_ahead=False, record_schedule=True, **settings).run(specs)
    skipped = Simulator(cost, skip_ahead=True, record_schedule=True, **settings).run(specs)
    assert_same_run(stepped, skipped)
    assert skipped.preemptions.sum() == 0
    assert skipped.scheduler.allocator.num_free == settings["num_blocks"]


def test_paging_batches_more_requests_than_reserving_on_one_workload():
    """The PagedAttention paper's comparison in small: one chat workload, one pool; reserving the
    maximum length per request runs the fewest at once, paging the most, and serves it fastest.
    Every request gets the same tokens in the three runs, and a reserving run holds its
    reservations all the time: blocks held = running requests x blocks per reservation."""
    specs = sharegpt_like(80, 40.0, seed=3)
    runs = {a: Simulator(num_blocks=1024, enable_prefix_caching=False, allocation=a, max_model_len=2048).run(specs)
            for a in ("max_len", "exact", "paged")}
    mean = {a: r.num_running.mean() for a, r in runs.items()}
    assert runs["max_len"].num_running.max() == 1024 // 128
    assert mean["max_len"] < mean["exact"] < mean["paged"]
    assert runs["max_len"].requests_per_s < runs["exact"].requests_per_s < runs["paged"].requests_per_s
    assert np.array_equal(runs["max_len"].used_blocks, 128 * runs["max_len"].num_running)
    tokens = {a: sorted((r.request_id, tuple(r.output_token_ids)) for r in run.requests)
              for a, run in runs.items()}
    assert tokens["max_len"] == tokens["exact"] == tokens["paged"]
    assert runs["max_len"].preemptions.sum() == runs["exact"].preemptions.sum() == 0


def test_simulator_refuses_a_bad_allocation():
    with pytest.raises(ValueError, match="allocation must be one of 'paged', 'max_len', 'exact'"):
        Simulator(num_blocks=10, allocation="orca")
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 1 with allocation='max_len'"):
        Simulator(num_blocks=10, allocation="max_len")
    with pytest.raises(ValueError, match="max_model_len must fit the pool"):
        Simulator(num_blocks=10, block_size=16, allocation="max_len", max_model_len=161)
    sim = Simulator(num_blocks=10, block_size=16, allocation="exact", max_model_len=100)
    with pytest.raises(ValueError, match="max_model_len"):  # no room for an output
        sim.run([RequestSpec(0, 0.0, [1] * 100, 12)])
    assert "'exact' allocation, max_model_len 100" in repr(sim)


@pytest.mark.parametrize("allocation", ["paged", "exact", "max_len"])
def test_the_simulator_stops_a_request_at_max_model_len(allocation):
    """A 90-token prompt asking for 12 outputs under max_model_len 100 gets 10 (vLLM's check_stop), and the
    result counts the 10: output tokens/s, the per-request output_len and the steps agree."""
    sim = Simulator(num_blocks=10, block_size=16, allocation=allocation, max_model_len=100)
    run = sim.run([RequestSpec(0, 0.0, [1] * 90, 12), RequestSpec(1, 0.0, [2] * 20, 12)])
    assert run.output_len.tolist() == [10, 12]
    assert [len(r.output_token_ids) for r in run.requests] == [10, 12]
    assert int(run.step_tokens.sum()) == 90 + 9 + 20 + 11 + run.recomputed_tokens


def test_load_explorer_updates_with_its_controls():
    import matplotlib
    matplotlib.use("Agg")
    from labkit.teaching.widgets.load_explorer import explore, load_explorer, readout

    box = load_explorer()
    rate, system, block, pool, caching, table = box.children[:6]
    assert table.value == readout(explore(rate.value, system.value, block.value, pool.value))
    system.value = 256
    rate.value = 6.0
    expected = readout(explore(6.0, 256, block.value, pool.value))
    assert table.value == expected and "load-readout" in expected
    pool.value = 3.0
    block.value = 128
    caching.value = False
    assert table.value == readout(explore(6.0, 256, 128, 3.0, enable_prefix_caching=False))


def test_load_explorer_system_prompt_is_shared_and_only_sharing_changes_with_caching():
    """The slider means a shared system prompt: every request starts with the same tokens, and turning
    prefix caching off keeps the prompts and changes only what is reused."""
    from labkit.teaching.widgets.load_explorer import explore

    on = explore(2.0, 256, 16, 2.0, num_requests=30)
    off = explore(2.0, 256, 16, 2.0, num_requests=30, enable_prefix_caching=False)
    none = explore(2.0, 0, 16, 2.0, num_requests=30)
    assert np.array_equal(on.prompt_len, none.prompt_len + 256) and np.array_equal(on.prompt_len, off.prompt_len)
    assert on.reuse_ratio > 0.3 and off.reuse_ratio == 0 and none.reuse_ratio == 0


# --------------------------------------------------------------------------- issue 11: bad inputs

def _alarm(seconds: int):
    """Fail instead of hanging (POSIX only)."""
    import signal

    def boom(*_):
        raise TimeoutError("did not return")
    signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)


@pytest.mark.parametrize("arrival", [math.nan, -5.0, math.inf, None, "0.5"])
def test_a_request_spec_refuses_a_bad_arrival_time_when_built(arrival):
    """Issue 38, bug 5: the spec checks its own arrival time, so no loop that waits for it sees a NaN."""
    with pytest.raises(ValueError, match="arrival_time"):
        RequestSpec(0, arrival, [1, 2, 3], 2)


def test_the_simulator_never_serves_a_negative_arrival():
    """Before issue 38 the Simulator served a request arriving at -5.0 s, before its clock's origin."""
    requests = sharegpt_like(5, 1.0, seed=0)
    _alarm(20)
    try:
        with pytest.raises(ValueError, match="arrival_time"):
            requests[2] = RequestSpec(requests[2].request_id, -5.0, requests[2].prompt_token_ids, 3)
            Simulator(num_blocks=512).run(requests)
        with pytest.raises(ValueError, match="arrival_time"):
            requests[2] = RequestSpec(requests[2].request_id, math.nan, requests[2].prompt_token_ids, 3)
            Simulator(num_blocks=512).run(requests)
    finally:
        import signal
        signal.alarm(0)
    assert Simulator(num_blocks=512).run(requests).arrival.min() == 0.0  # the workload itself is served


def test_duplicate_request_ids_are_refused_before_serving():
    requests = sharegpt_like(3, 1.0, seed=0)
    requests[2] = RequestSpec(requests[0].request_id, requests[2].arrival_time, requests[2].prompt_token_ids, 3)
    with pytest.raises(ValueError, match="request_id"):
        Simulator(num_blocks=512).run(requests)


def test_an_infinite_overhead_is_refused():
    with pytest.raises(ValueError, match="overhead_s"):
        CostModel(overhead_s=math.inf)


@pytest.mark.parametrize("pool", [math.nan, math.inf])
def test_pool_bytes_must_be_finite(pool):
    from labkit.memory import capacity
    with pytest.raises(ValueError, match="pool_bytes"):
        Simulator(pool_bytes=pool)
    with pytest.raises(ValueError, match="device_bytes"):
        capacity.sequences_that_fit(1024, pool, 0)


def test_a_bool_dtype_has_no_cache_bytes():
    import torch

    from labkit.memory.capacity import bytes_per_token
    with pytest.raises(ValueError, match="dtype"):
        bytes_per_token(32, 8, 128, dtype=torch.bool)


def test_the_gate_spares_long_documents_their_preemptions():
    """vLLM's full-sequence admission (the default) against chunk-only admission: long prompts in a
    tight pool with a small budget. Chunk-only admits them piece by piece and preempts them."""
    cost = CostModel()
    w = long_document_questions(60, 8.0, document_len=1024, num_documents=4, seed=1)
    runs = {gate: Simulator(cost, num_blocks=200, max_num_batched_tokens=128, full_sequence_must_fit=gate).run(w)
            for gate in (True, False)}
    assert runs[False].preemptions.sum() > 0 and runs[False].recomputed_tokens > 0
    assert 3 * runs[True].preemptions.sum() < runs[False].preemptions.sum()
    assert runs[True].recomputed_tokens < runs[False].recomputed_tokens
    with pytest.raises(ValueError, match="full_sequence_must_fit"):
        Simulator(cost, num_blocks=16, full_sequence_must_fit="yes")


# --------------------------------------------------------------------------- work lost to preemption


def computed_again(schedule: list) -> tuple[int, int]:
    """From a recorded schedule alone: the positions each request computed more than once (each extra time
    counted), and the positions a request computed for the first time after a preemption that lay below its
    first chunk (prefix hits at its first admission, evicted by the time it came back)."""
    seen: dict[int, dict[int, int]] = {}
    first_start: dict[int, int] = {}
    late_hits = 0
    for step in schedule:
        for rid, start, n, _ in step:
            counts = seen.setdefault(rid, {})
            first_start.setdefault(rid, start)
            for p in range(start, start + n):
                late_hits += p < first_start[rid] and p not in counts
                counts[p] = counts.get(p, 0) + 1
    return sum(c - 1 for counts in seen.values() for c in counts.values()), late_hits


def preempting_workload(seed: int) -> tuple[list[RequestSpec], dict]:
    """A few requests, many sharing a prefix, in a pool just large enough: preemptions and prefix hits."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 97) for _ in range(rng.choice([4, 9, 16]))]
    specs, t = [], 0.0
    for i in range(rng.randrange(3, 12)):
        own = [rng.randrange(1, 97) for _ in range(rng.randrange(1, 20))]
        uses = rng.random() < 0.6
        specs.append(RequestSpec(i, t, (prefix if uses else []) + own, rng.randrange(1, 30),
                                 len(prefix) if uses else 0))
        t += rng.random() * rng.choice([0.0, 0.002, 0.02])
    bs = rng.choice([2, 4])
    need = max(-(-(s.prompt_len + s.output_len) // bs) for s in specs)
    return specs, dict(num_blocks=need + rng.randrange(0, need), block_size=bs,
                       max_num_batched_tokens=rng.choice([4, 8, 32, 256]), skip_ahead=rng.random() < 0.5)


def test_recomputed_tokens_are_the_positions_computed_again():
    """Issue 38, bug 9: ``recomputed_tokens`` is the work lost to preemption, counted from the schedule.

    Before the fix it was every step token beyond the first admission's plan, so a prefix hit evicted
    while its request was preempted, and then computed, counted as "computed again" (24 of these 400
    runs). The sample must hold such runs, and runs with real recomputation, or it checks nothing."""
    cost = CostModel("teaching model", "L4")
    late_runs = recomputing_runs = 0
    for seed in range(400):
        specs, settings = preempting_workload(seed)
        run = Simulator(cost, record_schedule=True, **settings).run(specs)
        again, late = computed_again(run.schedule)
        assert sum(n for step in run.schedule for _, _, n, _ in step) == run.step_tokens.sum()  # the whole schedule
        assert run.recomputed_tokens == again, f"seed {seed}"
        assert run.recomputed_tokens == 0 or run.preemptions.sum() > 0
        late_runs += late > 0
        recomputing_runs += again > 0
    assert late_runs >= 5 and recomputing_runs >= 100
