"""Prefill here, decode there, in the simulator (``labkit.serving.cluster.disagg``)."""

from __future__ import annotations

import numpy as np
import pytest

from labkit.serving.cluster.disagg import goodput, simulate_split
from labkit.serving.sim.costmodel import CostModel
from labkit.serving.sim.tiers import Tier
from labkit.serving.sim.workloads import RequestSpec

CM = CostModel("Llama-3-8B", "H100 SXM")
SETTINGS = dict(num_blocks=400, block_size=16, max_num_batched_tokens=512)


def workload(n=12, prompt=300, out=20, gap=0.01, seed=0):
    rng = np.random.default_rng(seed)
    return [RequestSpec(i, i * gap, rng.integers(0, 32000, prompt + 7 * i).tolist(), out) for i in range(n)]


def test_each_request_moves_once_and_decodes_from_its_handed_blocks():
    specs = workload()
    link = Tier("link", 1e9, 1e-4, source="test")
    r = simulate_split(specs, 2, 2, link=link, cost_model=CM, **SETTINGS)
    bpt = CM.model.shape.block_bytes(16) / 16
    prompt = np.array([s.prompt_len for s in specs])[r.request_ids]
    assert np.all(r.handoff >= r.prefill_end + prompt * bpt / 1e9 + 1e-4 - 1e-12)  # the transfer, at least
    assert np.all(r.first_token > r.handoff) and np.all(r.ttft > 0)
    assert list(r.output_len) == [20] * len(specs)
    loaded = sum(d.scheduler.tier_stats.hits for d in r.decode)
    assert loaded == sum((p - 1) // 16 * 16 for p in prompt)  # every full block before the last token
    assert sum(d.scheduler.prefix_cache.stats.hits for d in r.decode) == 0  # nothing shared: no pool hit


def test_a_slow_link_makes_requests_wait_for_it():
    specs = workload(gap=0.0)
    fast = simulate_split(specs, 1, 1, link=Tier("fast", 1e12, 0.0, source="test"), cost_model=CM, **SETTINGS)
    slow = simulate_split(specs, 1, 1, link=Tier("slow", 1e8, 0.0, source="test"), cost_model=CM, **SETTINGS)
    assert slow.ttft.mean() > fast.ttft.mean() + 0.5
    assert np.all(np.diff(np.sort(slow.handoff)) > 0)  # one transfer after another on the link


def test_goodput_counts_requests_within_both_targets():
    assert goodput(np.array([0.1, 0.2, 3.0]), np.array([0.01, 0.2, 0.01]), 1.0, 0.05) == pytest.approx(1 / 3)
    assert goodput(np.array([0.1]), np.array([np.nan]), 1.0, 0.05) == 1.0
    for args, name in [((np.array([]), np.array([]), 1, 1), "ttft"), ((np.ones(2), np.ones(2), 0, 1), "ttft_target"),
                       ((np.ones(2), np.ones(2), 1, -1), "tpot_target")]:
        with pytest.raises(ValueError, match=name):
            goodput(*args)
    for kwargs, name in [({"prefill": 0}, "prefill"), ({"decode": 0}, "decode"), ({"link": 3}, "link")]:
        with pytest.raises(ValueError, match=name):
            simulate_split(workload(2), **{"link": Tier("l", 1e9, 0.0, source="t"), **kwargs}, **SETTINGS)
