"""Chapter 07's machinery: Mooncake's trace read into requests, the paper's Fig. 9 reproduced, routers,
and N simulated replicas on one clock (``labkit.serving.sim.mooncake``, ``labkit.serving.cluster``)."""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pytest

from labkit.memory.paging import BlockAllocator
from labkit.memory.prefix import PrefixCache
from labkit.serving.cluster.cluster import simulate
from labkit.serving.cluster.routers import (BALANCE_ABS_THRESHOLD, CacheAware, LeastLoaded, RoundRobin, Router, Session,
                                            cache_aware_choice, is_imbalanced, make_router)
from labkit.serving.sim.costmodel import CostModel
from labkit.serving.sim.mooncake import (FIG9_CONVERSATION, TRACE_BLOCK_SIZE, TraceRequest, block_token_ids,
                                         lru_hit_rates, read_mooncake_trace, read_trace, sample_conversations,
                                         trace_prompt, trace_reuse)
from labkit.serving.sim.simulator import Simulator, SimRun
from labkit.serving.sim.workloads import RequestSpec, long_document_questions


@pytest.fixture(scope="module")
def trace():
    return read_trace()


@pytest.fixture(scope="module")
def small_trace(trace):
    """About 70 requests from the trace's first 3,000, whole conversations, with their reuse."""
    return sample_conversations(trace[:3000], 40)


# ----------------------------------------------------------------------------- the trace


def test_the_shipped_trace_is_mooncakes(trace):
    assert len(trace) == 12031
    assert trace[0] == TraceRequest(0.0, 6758, 500, tuple(range(14)))
    assert trace[-1].timestamp_ms == 3536999
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in trace)
    mean_in = sum(r.input_length for r in trace) / len(trace)
    assert round(mean_in) == 12035  # the README of the trace: avg input 12,035 tokens


def test_block_tokens_spell_the_id_in_every_aligned_pair():
    a, b = block_token_ids(5), block_token_ids(32005)  # same low digit: only the pair tells them apart
    assert len(a) == TRACE_BLOCK_SIZE and a[0] == b[0]
    assert all(a[i:i + 2] != b[i:i + 2] for i in range(0, 512, 2))
    assert block_token_ids(7) == block_token_ids(7)
    assert block_token_ids(9, 5) == [9, 0, 9, 0, 9]


@pytest.mark.parametrize("block_size", [512, 16])
def test_labkits_hash_chain_finds_exactly_the_reuse_the_trace_encodes(small_trace, block_size):
    """A cache that forgets nothing, fed the prompts in order: every request's hit is its longest
    common prefix with an earlier prompt, in whole blocks, leaving its last token to compute."""
    cache = PrefixCache(BlockAllocator(60_000 * 512 // block_size), block_size)
    earlier: list[TraceRequest] = []
    for r in small_trace:
        table, hit = cache.allocate(trace_prompt(r))
        cache.cache_full_blocks(table)
        cache.release(table)
        lcp = 0
        for e in earlier:
            j = 0
            while j < min(len(e.hash_ids), len(r.hash_ids)) and e.hash_ids[j] == r.hash_ids[j]:
                j += 1
            lcp = max(lcp, min(j * 512, e.input_length, r.input_length))
        assert hit == min(lcp // block_size, (r.input_length - 1) // block_size) * block_size
        earlier.append(r)
    reused = trace_reuse(small_trace)
    assert sum(reused) > 0.25 * sum(r.input_length for r in small_trace)  # the slice has reuse to find


def test_read_mooncake_trace_gives_the_simulators_requests(small_trace):
    specs = read_mooncake_trace(limit=3000, one_in=40, time_scale=0.5, max_output_len=64)
    assert len(specs) == len(small_trace)
    assert [s.prompt_len for s in specs] == [r.input_length for r in small_trace]
    assert [s.arrival_time for s in specs] == [r.timestamp_ms / 2000 for r in small_trace]
    assert [s.output_len for s in specs] == [min(r.output_length, 64) for r in small_trace]
    assert [s.prefix_len for s in specs] == trace_reuse(small_trace)


def test_bad_trace_files_are_refused_with_their_line(tmp_path):
    good = {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}
    for bad, says in [({**good, "hash_ids": [0]}, "need 2"), ({**good, "input_length": 0}, "input_length"),
                      ({**good, "hash_ids": [0, -1]}, "hash_ids"), ({"timestamp": 0}, "not a trace request")]:
        path = tmp_path / "t.jsonl.gz"
        with gzip.open(path, "wt") as f:
            f.write(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=f"line 2.*{says}|{says}.*"):
            read_trace(path)
    with pytest.raises(ValueError, match="path"):
        read_trace(tmp_path / "missing.jsonl")
    for kwargs, name in [({"limit": 0}, "limit"), ({"block_size": 0}, "block_size")]:
        with pytest.raises(ValueError, match=name):
            read_trace(**kwargs)
    with pytest.raises(ValueError, match="time_scale"):
        read_mooncake_trace(limit=5, time_scale=0)
    with pytest.raises(ValueError, match="one_in"):
        read_mooncake_trace(limit=5, one_in=0)
    with pytest.raises(ValueError, match="hash_id"):
        block_token_ids(32000 ** 2)


# ----------------------------------------------------------------------------- Fig. 9


def test_fig9_reproduced_beside_the_papers_curve(trace):
    """labkit's LRU curve on the released trace: the paper's shape (flat below 10^6 tokens, the rise
    to 5x10^7, flat after), about 0.03 below it everywhere."""
    capacities = [c for c, _ in FIG9_CONVERSATION]
    ours = lru_hit_rates(trace, capacities)
    gaps = [paper - mine for (_, paper), mine in zip(FIG9_CONVERSATION, ours)]
    assert all(0 <= g <= 0.035 for g in gaps), gaps
    assert ours == sorted(ours)  # LRU keeps what a smaller LRU keeps: the curve never falls
    unbounded = lru_hit_rates(trace, [1e12])[0]
    rule = sum(min(k, (r.input_length - 1) // 512 * 512) for k, r in zip(trace_reuse(trace), trace))
    assert unbounded == pytest.approx(rule / sum(r.input_length for r in trace), abs=1e-12)
    with pytest.raises(ValueError, match="capacities_tokens"):
        lru_hit_rates(trace, [100])


# ----------------------------------------------------------------------------- routers


def _spec(i, tokens, t=0.0, out=4):
    return RequestSpec(i, t, list(tokens), out)


def test_cache_aware_choice_follows_the_routers_rule():
    assert cache_aware_choice([0, 40, 40], [3, 2, 1], 100) == 2           # best match, least loaded of the tied
    assert cache_aware_choice([0, 30, 0], [3, 2, 1], 100) == 2            # 30% is not above the threshold
    assert cache_aware_choice([0, 31, 0], [3, 2, 1], 100) == 1
    assert cache_aware_choice([90, 0], [100, 30], 100) == 1               # 100 - 30 > 64 and 100 > 45
    assert cache_aware_choice([90, 0], [100, 70], 100) == 0               # 100 - 70 = 30: balanced
    assert cache_aware_choice([90, 0], [200, 140], 100) == 0              # 200 > 140 x 1.5 fails: balanced
    assert is_imbalanced([BALANCE_ABS_THRESHOLD + 1, 0]) and not is_imbalanced([BALANCE_ABS_THRESHOLD, 0])
    for args, name in [(([1], [0, 0], 5), "match_tokens"), (([6], [0], 5), r"match_tokens\[0\]"),
                       (([1], [-1], 5), r"loads\[0\]"), (([1], [0], 0), "prompt_len")]:
        with pytest.raises(ValueError, match=name):
            cache_aware_choice(*args)
    with pytest.raises(ValueError, match="cache_threshold"):
        cache_aware_choice([1], [0], 5, cache_threshold=1.5)


def test_routers_decide_as_documented():
    rr, ll, se = RoundRobin(), LeastLoaded(), Session(session_tokens=4)
    for r in (rr, ll, se):
        r.reset(3)
    assert [rr.choose(_spec(i, [1, 2]), [0, 0, 0]) for i in range(5)] == [0, 1, 2, 0, 1]
    assert ll.choose(_spec(0, [1]), [2, 1, 1]) == 1
    a, b = se.choose(_spec(0, [1, 2, 3, 4, 5]), [0] * 3), se.choose(_spec(1, [1, 2, 3, 4, 9, 9]), [9] * 3)
    assert a == b
    ca = CacheAware(block_size=2)
    ca.reset(2)
    first = ca.choose(_spec(0, [1, 2, 3, 4, 5]), [0, 0])
    assert first == 0 and ca.match_tokens(ca.chain([1, 2, 3, 4, 7, 7])) == [4, 0]
    assert ca.choose(_spec(1, [1, 2, 3, 4, 7, 7]), [1, 0]) == 0           # 4 of 6 tokens: above 0.3
    assert ca.choose(_spec(2, [8, 8, 3]), [1, 0]) == 1                    # no match: the least loaded
    with pytest.raises(ValueError, match="router must be one of"):
        make_router("fastest")
    with pytest.raises(ValueError, match="session_tokens"):
        Session(session_tokens=0)


# ----------------------------------------------------------------------------- the cluster


def _workload():
    return long_document_questions(24, arrival_rate=40.0, document_len=96, num_documents=2, seed=7)


@pytest.mark.parametrize("skip_ahead", [True, False])
def test_one_replica_is_the_simulator(skip_ahead):
    specs = _workload()
    settings = dict(num_blocks=40, block_size=16, max_num_batched_tokens=64, skip_ahead=skip_ahead)
    alone = Simulator(CostModel(), **settings).run(specs)
    cluster = simulate(specs, 1, "cache_aware", cost_model=CostModel(), **settings)
    mine = cluster.replicas[0]
    assert alone.preemptions.sum() > 0 and alone.hit_tokens.sum() > 0  # the case is not trivial
    for name in ("arrival", "first_token", "finish", "hit_tokens", "preemptions", "step_start", "step_end",
                 "step_tokens", "num_running", "num_waiting", "used_blocks", "itl", "itl_weight"):
        assert np.array_equal(getattr(mine, name), getattr(alone, name)), name
    assert cluster.hit_rate == alone.scheduler.prefix_cache.stats.hit_rate
    assert np.array_equal(cluster.ttft, alone.ttft)


def test_cache_aware_beats_round_robin_on_the_trace():
    specs = read_mooncake_trace(one_in=40, time_scale=0.5)
    settings = dict(cost_model=CostModel("Llama-3-8B", "A100 80GB SXM"), pool_bytes=16 * 2 ** 30, block_size=512,
                    max_num_batched_tokens=8192)
    for n in (2,):  # and 1 to 16 replicas in the committed sweep, one row of which the next test reruns
        rr = simulate(specs, n, "round_robin", **settings)
        ca = simulate(specs, n, "cache_aware", router_settings={"block_size": 512}, **settings)
        assert ca.hit_rate > rr.hit_rate + 0.1, (n, ca.hit_rate, rr.hit_rate)
        assert list(rr.requests_per_replica) == [len(specs) // n + (i < len(specs) % n) for i in range(n)]
        assert rr.hits.sum() <= rr.queries.sum() and rr.queries.sum() == sum(s.prompt_len for s in specs)
        for result in (rr, ca):  # the per-replica rows add up to the cluster's
            rows = result.per_replica()
            assert sum(r["requests"] for r in rows) == len(specs)
            assert sum(r["share of prefill"] for r in rows) == pytest.approx(1.0)
            assert [r["hit rate"] for r in rows] == pytest.approx(list(result.hits / result.queries))
            assert sum(r["output tokens/s"] for r in rows) == pytest.approx(result.output_tokens_per_s)


def test_the_committed_sweep_reruns():
    """The chapter reads benchmarks/results/cluster_sweep_*.json; one of its rows, rerun, is the same."""
    import runpy
    from pathlib import Path

    from labkit.teaching.results import committed_result

    sweep = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks" / "cluster_sweep.py"))
    SETUP, run_point = sweep["SETUP"], sweep["run_point"]

    record = json.loads(committed_result("cluster_sweep_*.json").read_text())
    assert record["setup"] == json.loads(json.dumps(SETUP))
    row = next(r for r in record["rows"] if r["replicas"] == 16 and r["router"] == "cache_aware")
    result = run_point(read_mooncake_trace(**SETUP["workload"]), 16, "cache_aware")
    assert result.hit_rate == pytest.approx(row["hit rate"], abs=1e-12)
    assert result.summary()["TTFT p90 (ms)"] == pytest.approx(row["TTFT p90 (ms)"], rel=1e-9)
    assert result.requests_per_replica.tolist() == row["requests per replica"]


def test_cluster_bad_input_changes_nothing():
    specs = _workload()[:3]
    for kwargs, name in [({"replicas": 0}, "replicas"), ({"router": "nearest"}, "router"),
                         ({"router_settings": 3}, "router_settings"), ({"num_blocks": 0}, "num_blocks"),
                         ({"router": "cache_aware", "router_settings": {"cache_threshold": 2}}, "cache_threshold")]:
        with pytest.raises(ValueError, match=name):
            simulate(specs, **{"num_blocks": 40, **kwargs})
    with pytest.raises(ValueError, match="requests"):
        simulate([], num_blocks=40)

    class Off(Router):
        def choose(self, spec, loads):
            return len(loads)

    with pytest.raises(ValueError, match="chose 2"):
        simulate(specs, 2, Off(), num_blocks=40)
    run = SimRun(Simulator(num_blocks=40))
    run.add(_spec(0, [1, 2, 3], t=1.0))
    with pytest.raises(ValueError, match="arrival order"):
        run.add(_spec(1, [1, 2, 3], t=0.5))
    assert len(run.specs) == 1 and run.load == 1
