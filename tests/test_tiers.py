"""The second tier's break-even (issue 42): reload a prefix, or compute it again.

Reload is linear plus a fixed latency; recompute is what the simulator charges for the same chunk; the
break-even is the first prefix length at which reloading is cheaper, checked at H - 1 and H directly.
"""

from __future__ import annotations

import math

import pytest

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.serving.sim.costmodel import CostModel, Device
from labkit.serving.sim.tiers import (TIERS, Tier, break_even_table, break_even_tokens, get_tier,
                                      prefix_recompute_seconds, recompute_seconds, reload_seconds)
from labkit.serving.sim.work import work_sums

H100 = CostModel("Llama-3-8B", "H100 SXM")
BPT = H100.kv_bytes_per_token  # 128 KiB: 2 x 32 layers x 8 KV heads x 128 x 2 bytes
# A device whose memory is so fast that even a one-token prefill is compute-bound: no weight-read floor.
COMPUTE_BOUND = CostModel("Llama-3-8B", Device("compute-bound", 80e9, 1e18, 1e15, source="made up"))


def test_presets_are_valid_and_cited():
    assert len(TIERS) >= 7
    for name, t in TIERS.items():
        assert t.name == name and t.bandwidth > 0 and math.isfinite(t.bandwidth) and t.latency >= 0
        assert len(t.source) > 30, name
        assert t.latency == 0 or "assumed" in t.source, f"{name}: its latency is an assumption, said so"
    assert get_tier("PCIe 4.0 x16 (host to GPU)").bandwidth == 31.5e9
    assert TIERS["GPU HBM (H100 SXM)"].bandwidth == 3.35e12
    assert TIERS["NVLink (H100, GPU to GPU)"].bandwidth == 450e9
    assert TIERS["Network 100 Gb/s (RDMA)"].bandwidth == 100e9 / 8
    with pytest.raises(ValueError, match="tier must be one of"):
        get_tier("floppy")


def test_reload_is_linear_plus_latency():
    t = Tier("t", 1e9, 1e-4)
    assert reload_seconds(0, BPT, t) == 0.0
    for n in (1, 7, 1000):
        assert reload_seconds(n, BPT, t) == pytest.approx(n * BPT / 1e9 + 1e-4, rel=1e-12)
    assert reload_seconds(2000, BPT, t) - reload_seconds(1000, BPT, t) == pytest.approx(1000 * BPT / 1e9)


@pytest.mark.parametrize("tokens,context", [(1, 0), (17, 0), (512, 0), (100, 300), (4096, 1000)])
def test_recompute_is_what_the_simulator_charges(tokens, context):
    assert recompute_seconds(tokens, H100, context) == H100.time_from_sums(*work_sums([(context, tokens)]))
    assert recompute_seconds(tokens, H100, context) \
        == H100.time_from_sums(tokens, context, tokens * context + tokens * (tokens + 1) / 2)
    if context == 0:
        assert recompute_seconds(tokens, H100) == pytest.approx(H100.prefill_time(tokens), rel=1e-12)
    assert recompute_seconds(0, H100) == 0.0


def test_prefix_recompute_is_the_extra_time_of_the_step():
    assert prefix_recompute_seconds(100, H100) == recompute_seconds(101, H100) - recompute_seconds(1, H100, 100)
    assert prefix_recompute_seconds(100, H100) == 0.0  # memory-bound: the tokens ride along the weight read
    assert prefix_recompute_seconds(100, H100, suffix_tokens=0) == recompute_seconds(100, H100) > 4e-3
    assert prefix_recompute_seconds(4096, H100) > 4096 * H100.flops_per_token / H100.device.peak_flops * 0.9


@pytest.mark.parametrize("tier", list(TIERS.values()), ids=list(TIERS))
def test_break_even_is_the_first_prefix_where_reload_is_cheaper(tier):
    H = break_even_tokens(BPT, tier, H100)
    assert H is not None and H > 1
    assert reload_seconds(H, BPT, tier) < prefix_recompute_seconds(H, H100)
    assert not reload_seconds(H - 1, BPT, tier) < prefix_recompute_seconds(H - 1, H100)
    assert all(not reload_seconds(h, BPT, tier) < prefix_recompute_seconds(h, H100) for h in range(1, H, 7))


def test_charging_the_weight_read_to_the_prefix_makes_every_reload_win_at_once():
    for tier in TIERS.values():
        assert break_even_tokens(BPT, tier, H100, suffix_tokens=0) == 1


def test_a_slow_tier_never_wins():
    slow = Tier("slow", 1e6, 0.0)  # 1 MB/s: 0.13 s a token, far above the arithmetic's 15 us
    assert break_even_tokens(BPT, slow, H100, max_tokens=1 << 14) is None
    assert break_even_tokens(BPT, slow, COMPUTE_BOUND, max_tokens=1 << 14) is None


def test_a_fast_tier_without_latency_wins_from_one_token():
    fast = Tier("fast", 1e15, 0.0)
    assert BPT / fast.bandwidth < COMPUTE_BOUND.flops_per_token / COMPUTE_BOUND.device.peak_flops
    assert break_even_tokens(BPT, fast, COMPUTE_BOUND) == 1
    # ... and the same tier with a latency loses the shortest prefixes.
    assert break_even_tokens(BPT, Tier("fast, 1 ms", 1e15, 1e-3), COMPUTE_BOUND) > 1


def test_the_table():
    rows = break_even_table(["Llama-3-8B"], [TIERS["PCIe 4.0 x16 (host to GPU)"]], ["H100 SXM"])
    (row,) = rows
    assert row["bytes_per_token"] == 131072
    assert row["reload_s_per_token"] == pytest.approx(131072 / 31.5e9)
    assert row["recompute_s_per_token"] == pytest.approx(H100.flops_per_token / 989.4e12)
    assert row["break_even_tokens"] == break_even_tokens(BPT, TIERS["PCIe 4.0 x16 (host to GPU)"], H100)


@pytest.mark.parametrize("call,name", [
    (lambda: reload_seconds(-1, BPT, TIERS["GPU HBM (H100 SXM)"]), "tokens"),
    (lambda: reload_seconds(1.5, BPT, TIERS["GPU HBM (H100 SXM)"]), "tokens"),
    (lambda: reload_seconds(1, 0, TIERS["GPU HBM (H100 SXM)"]), "bytes_per_token"),
    (lambda: reload_seconds(1, BPT, "PCIe"), "tier"),
    (lambda: recompute_seconds(-1, H100), "tokens"),
    (lambda: recompute_seconds(1, H100, -1), "context_tokens"),
    (lambda: recompute_seconds(1, "H100"), "cost_model"),
    (lambda: prefix_recompute_seconds(1, H100, -1), "suffix_tokens"),
    (lambda: Tier("t", 0, 0), "bandwidth"),
    (lambda: Tier("t", -1e9, 0), "bandwidth"),
    (lambda: Tier("t", math.nan, 0), "bandwidth"),
    (lambda: Tier("t", math.inf, 0), "bandwidth"),
    (lambda: Tier("t", 1e9, -1e-6), "latency"),
    (lambda: Tier("t", 1e9, math.nan), "latency"),
    (lambda: Tier("", 1e9, 0), "name"),
    (lambda: break_even_tokens(BPT, None, H100), "tier"),
    (lambda: break_even_tokens(BPT, TIERS["GPU HBM (H100 SXM)"], object()), "cost_model"),
    (lambda: break_even_tokens(BPT, TIERS["GPU HBM (H100 SXM)"], H100, max_tokens=0), "max_tokens"),
    (lambda: break_even_tokens(math.nan, TIERS["GPU HBM (H100 SXM)"], H100), "bytes_per_token"),
    (lambda: break_even_table([], list(TIERS.values()), ["H100 SXM"]), "models"),
    (lambda: break_even_table(["Llama-3-8B"], ["PCIe"], ["H100 SXM"]), "tier"),
])
def test_bad_inputs_name_the_parameter(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        call()
