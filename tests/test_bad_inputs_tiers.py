"""Bad inputs to chapter 08's modules (the second tier, block files, the hand-over, the split), refused: one
row a case.

The rows follow ``tests/test_bad_inputs.py`` (its ``run_case``: the exception type, the parameter named in
the message, the object and every argument unchanged). Each module's own tests check a few of these calls
for the name alone; here each is also checked to leave the engine, pool, store, allocator and arguments as
they were: a refused ``TieredEngine`` prepares no model, a refused ``DiskTierStore`` or ``TieredEngine``
creates no folder, a refused ``hand_over`` queues nothing and frees nothing, a refused ``TieredPrefixCache``
does not hook the allocator's evictions.
"""

from __future__ import annotations

import atexit
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.caches import block_files, tier_store
from labkit.caches.paged import KVPool
from labkit.memory import tiered
from labkit.memory.paging import BlockAllocator
from labkit.serving import handoff, tiered_engine
from labkit.serving.cluster import disagg
from labkit.serving.engine import Engine
from labkit.serving.sim import tiers
from labkit.serving.sim.workloads import RequestSpec
from labkit.serving.variants import tiered as tiered_variant
from test_bad_inputs import TINY_MODEL, On, cost_model, int8_pool, kv_pool, run_case, tiny_config

nan, inf = math.nan, math.inf
PCIE = tiers.TIERS["PCIe 4.0 x16 (host to GPU)"]
BPT = 131072
TIER = dict(name="t", bandwidth=1e9, latency=1e-5)
FOLDER = Path(tempfile.mkdtemp(prefix="labkit-bad-tiers-"))  # rows that must not create anything inside it
atexit.register(shutil.rmtree, FOLDER, True)
SPECS = [RequestSpec(0, 0.0, [1, 2, 3, 4, 5], 2), RequestSpec(1, 0.1, [1, 2, 3, 6], 2)]
SETTINGS = dict(pool_bytes=2 ** 30, block_size=16, max_num_batched_tokens=512)


def a_block_file() -> Path:
    """Block 0 of a fresh pool written under the name "b0"."""
    path = FOLDER / "b0.kvblock"
    block_files.write_block(kv_pool(), 0, "b0", path)
    return path


BLOCK_FILE = a_block_file()


def tiny_engine(**kwargs) -> Engine:
    return Engine(TINY_MODEL, num_blocks=16, block_size=4, use_triton=False, prepare=False, **kwargs)


def decode_engine() -> handoff.DecodeEngine:
    return handoff.DecodeEngine(TINY_MODEL, 16, 4, use_triton=False, prepare=False)


# A prefill engine with one request planned and run (its K/V written), one planned but not run, and a decode
# engine: module-level, so each row's snapshot covers both engines and the request.
PREFILL = tiny_engine(max_num_batched_tokens=4)
HANDED = PREFILL.add_request([1, 2, 3, 4, 5, 6, 7, 8, 9], 2, eos_token_id=())
PREFILL.step()
IN_FLIGHT = tiny_engine(max_num_batched_tokens=4)
PLANNED = IN_FLIGHT.add_request([1, 2, 3, 4, 5, 6, 7, 8, 9], 2, eos_token_id=())
IN_FLIGHT.step()
IN_FLIGHT.scheduler.schedule()  # planned, not run: num_computed_tokens counts slots not written yet
DECODE = decode_engine()
STRANGER = tiny_engine().add_request([1, 2, 3], 2, eos_token_id=())


CASES = [
    # ---- serving.sim.tiers
    ("Tier name empty", tiers.Tier, (), TIER | {"name": ""}, ValueError, "name"),
    ("Tier bandwidth 0", tiers.Tier, (), TIER | {"bandwidth": 0}, ValueError, "bandwidth"),
    ("Tier bandwidth inf", tiers.Tier, (), TIER | {"bandwidth": inf}, ValueError, "bandwidth"),
    ("Tier bandwidth a string", tiers.Tier, (), TIER | {"bandwidth": "1e9"}, ValueError, "bandwidth"),
    ("Tier latency negative", tiers.Tier, (), TIER | {"latency": -1e-6}, ValueError, "latency"),
    ("Tier latency nan", tiers.Tier, (), TIER | {"latency": nan}, ValueError, "latency"),
    ("Tier source an int", tiers.Tier, (), TIER | {"source": 5}, ValueError, "source"),
    ("get_tier unknown", tiers.get_tier, ("PCIe",), {}, ValueError, "tier"),
    ("reload_seconds tokens -1", tiers.reload_seconds, (-1, BPT, PCIE), {}, ValueError, "tokens"),
    ("reload_seconds tokens a bool", tiers.reload_seconds, (True, BPT, PCIE), {}, ValueError, "tokens"),
    ("reload_seconds bytes_per_token 0", tiers.reload_seconds, (4, 0, PCIE), {}, ValueError, "bytes_per_token"),
    ("reload_seconds bytes_per_token inf", tiers.reload_seconds, (4, inf, PCIE), {}, ValueError, "bytes_per_token"),
    ("reload_seconds tier a name", tiers.reload_seconds, (4, BPT, "PCIe 4.0 x16 (host to GPU)"), {}, ValueError,
     "tier"),
    ("recompute_seconds tokens 1.5", tiers.recompute_seconds, (1.5, cost_model()), {}, ValueError, "tokens"),
    ("recompute_seconds context_tokens -1", tiers.recompute_seconds, (4, cost_model(), -1), {}, ValueError,
     "context_tokens"),
    ("recompute_seconds cost_model a name", tiers.recompute_seconds, (4, "teaching model"), {}, ValueError,
     "cost_model"),
    ("prefix_recompute_seconds tokens -1", tiers.prefix_recompute_seconds, (-1, cost_model()), {}, ValueError,
     "tokens"),
    ("prefix_recompute_seconds suffix_tokens -1", tiers.prefix_recompute_seconds, (4, cost_model(), -1), {},
     ValueError, "suffix_tokens"),
    ("prefix_recompute_seconds cost_model None", tiers.prefix_recompute_seconds, (4, None), {}, ValueError,
     "cost_model"),
    ("break_even_tokens bytes_per_token nan", tiers.break_even_tokens, (nan, PCIE, cost_model()), {}, ValueError,
     "bytes_per_token"),
    ("break_even_tokens tier None", tiers.break_even_tokens, (BPT, None, cost_model()), {}, ValueError, "tier"),
    ("break_even_tokens cost_model a name", tiers.break_even_tokens, (BPT, PCIE, "teaching model"), {}, ValueError,
     "cost_model"),
    ("break_even_tokens max_tokens 0", tiers.break_even_tokens, (BPT, PCIE, cost_model()), {"max_tokens": 0},
     ValueError, "max_tokens"),
    ("break_even_tokens suffix_tokens -1", tiers.break_even_tokens, (BPT, PCIE, cost_model()),
     {"suffix_tokens": -1}, ValueError, "suffix_tokens"),
    ("break_even_table models empty", tiers.break_even_table, ([], [PCIE], ["H100 SXM"]), {}, ValueError, "models"),
    ("break_even_table devices a string", tiers.break_even_table, (["Llama-3-8B"], [PCIE], "H100 SXM"), {},
     ValueError, "devices"),
    ("break_even_table tiers of names", tiers.break_even_table, (["Llama-3-8B"], ["PCIe"], ["H100 SXM"]), {},
     ValueError, "tier"),
    ("break_even_table suffix_tokens -1", tiers.break_even_table, (["Llama-3-8B"], [PCIE], ["H100 SXM"]),
     {"suffix_tokens": -1}, ValueError, "suffix_tokens"),
    # ---- memory.tiered
    ("TierStore capacity 0", tiered.TierStore, (0,), {}, ValueError, "capacity"),
    ("TierStore capacity 1.5", tiered.TierStore, (1.5,), {}, ValueError, "capacity"),
    ("TieredPrefixCache store a dict", tiered.TieredPrefixCache, (BlockAllocator(4), 4, {}), {}, ValueError,
     "store"),
    ("TieredPrefixCache worth_loading True", tiered.TieredPrefixCache, (BlockAllocator(4), 4, tiered.TierStore(2)),
     {"worth_loading": True}, ValueError, "worth_loading"),
    ("TieredPrefixCache block_size 0 (the allocator not hooked)", tiered.TieredPrefixCache,
     (BlockAllocator(4), 0, tiered.TierStore(2)), {}, ValueError, "block_size"),
    # ---- caches.block_files
    ("write_block pool a config", block_files.write_block, (tiny_config(), 0, "b", FOLDER / "x.kvblock"), {},
     ValueError, "pool"),
    ("write_block quantized pool", block_files.write_block, (int8_pool(), 0, "b", FOLDER / "x.kvblock"), {},
     ValueError, "pool"),
    ("write_block block_id 4 of 4", block_files.write_block, (kv_pool(), 4, "b", FOLDER / "x.kvblock"), {},
     ValueError, "block_id"),
    ("write_block block_id -1", block_files.write_block, (kv_pool(), -1, "b", FOLDER / "x.kvblock"), {},
     ValueError, "block_id"),
    ("write_block name empty", block_files.write_block, (kv_pool(), 0, "", FOLDER / "x.kvblock"), {}, ValueError,
     "name"),
    ("write_block name an int", block_files.write_block, (kv_pool(), 0, 7, FOLDER / "x.kvblock"), {}, ValueError,
     "name"),
    ("read_block pool None", block_files.read_block, (None, 0, "b0", BLOCK_FILE), {}, ValueError, "pool"),
    ("read_block block_id 4 of 4", block_files.read_block, (kv_pool(), 4, "b0", BLOCK_FILE), {}, ValueError,
     "block_id"),
    ("read_block block_id 1.0", block_files.read_block, (kv_pool(), 1.0, "b0", BLOCK_FILE), {}, ValueError,
     "block_id"),
    ("read_block name None", block_files.read_block, (kv_pool(), 0, None, BLOCK_FILE), {}, ValueError, "name"),
    # ---- caches.tier_store
    ("MemoryTierStore pool a string", tier_store.MemoryTierStore, ("pool", 2), {}, ValueError, "pool"),
    ("MemoryTierStore quantized pool", tier_store.MemoryTierStore, (int8_pool(), 2), {}, ValueError, "pool"),
    ("MemoryTierStore capacity 0", tier_store.MemoryTierStore, (kv_pool(), 0), {}, ValueError, "capacity"),
    ("DiskTierStore pool None (no folder made)", tier_store.DiskTierStore, (None, FOLDER / "new", 2), {},
     ValueError, "pool"),
    ("DiskTierStore capacity 0 (no folder made)", tier_store.DiskTierStore, (kv_pool(), FOLDER / "new", 0), {},
     ValueError, "capacity"),
    ("DiskTierStore direct_io a string (no folder made)", tier_store.DiskTierStore, (kv_pool(), FOLDER / "new", 2),
     {"direct_io": "yes"}, ValueError, "direct_io"),
    ("DiskTierStore directory an int", tier_store.DiskTierStore, (kv_pool(), 3, 2), {}, ValueError, "directory"),
    ("DiskTierStore directory empty", tier_store.DiskTierStore, (kv_pool(), "", 2), {}, ValueError, "directory"),
    ("DiskTierStore directory under a file", tier_store.DiskTierStore, (kv_pool(), BLOCK_FILE / "sub", 2), {},
     ValueError, "directory"),
    # ---- serving.variants.tiered
    ("TieredSimulator tier a name", tiered_variant.TieredSimulator, (cost_model(),),
     {"tier": "PCIe 4.0 x16 (host to GPU)", "tier_blocks": 8} | SETTINGS, ValueError, "tier"),
    ("TieredSimulator tier_blocks 0", tiered_variant.TieredSimulator, (cost_model(),),
     {"tier": PCIE, "tier_blocks": 0} | SETTINGS, ValueError, "tier_blocks"),
    ("TieredSimulator contiguous allocation", tiered_variant.TieredSimulator, (cost_model(),),
     {"tier": PCIE, "tier_blocks": 8, "allocation": "contiguous"} | SETTINGS, ValueError, "allocation"),
    ("TieredSimulator block_size 0", tiered_variant.TieredSimulator, (cost_model(),),
     {"tier": PCIE, "tier_blocks": 8} | SETTINGS | {"block_size": 0}, ValueError, "block_size"),
    # ---- serving.tiered_engine (the model neither prepared nor changed, no folder made)
    ("TieredEngine tier_blocks 0", tiered_engine.TieredEngine, (TINY_MODEL, 16, 4), {"tier_blocks": 0}, ValueError,
     "tier_blocks"),
    ("TieredEngine tier_dir empty", tiered_engine.TieredEngine, (TINY_MODEL, 16, 4), {"tier_blocks": 4,
                                                                                     "tier_dir": ""},
     ValueError, "tier_dir"),
    ("TieredEngine direct_io without tier_dir", tiered_engine.TieredEngine, (TINY_MODEL, 16, 4),
     {"tier_blocks": 4, "direct_io": True}, ValueError, "direct_io"),
    ("TieredEngine direct_io 1", tiered_engine.TieredEngine, (TINY_MODEL, 16, 4),
     {"tier_blocks": 4, "tier_dir": FOLDER / "new", "direct_io": 1}, ValueError, "direct_io"),
    ("TieredEngine worth_loading a number", tiered_engine.TieredEngine, (TINY_MODEL, 16, 4),
     {"tier_blocks": 4, "worth_loading": 0.5}, ValueError, "worth_loading"),
    ("TieredEngine prefix caching off", tiered_engine.TieredEngine, (TINY_MODEL, 16, 4),
     {"tier_blocks": 4, "enable_prefix_caching": False}, ValueError, "enable_prefix_caching"),
    ("TieredEngine num_blocks 0 (no folder made)", tiered_engine.TieredEngine, (TINY_MODEL, 0, 4),
     {"tier_blocks": 4, "tier_dir": FOLDER / "new"}, ValueError, "num_blocks"),
    # ---- serving.handoff (nothing queued on decode, nothing freed on prefill)
    ("hand_over a step in flight", handoff.hand_over, (IN_FLIGHT, PLANNED, DECODE), {}, ValueError, "prefill"),
    ("hand_over prefill a string", handoff.hand_over, ("prefill", HANDED, DECODE), {}, ValueError, "prefill"),
    ("hand_over decode a plain Engine", handoff.hand_over, (PREFILL, HANDED, tiny_engine()), {}, ValueError,
     "decode"),
    ("hand_over decode the prefill engine", handoff.hand_over, (PREFILL, HANDED, PREFILL), {}, ValueError,
     "decode"),
    ("hand_over another engine's request", handoff.hand_over, (PREFILL, STRANGER, DECODE), {}, ValueError,
     "request"),
    ("hand_over request a prompt", handoff.hand_over, (PREFILL, [1, 2, 3], DECODE), {}, ValueError, "request"),
    ("transfer_bytes tokens -1", handoff.transfer_bytes, (PREFILL, -1), {}, ValueError, "tokens"),
    ("DecodeEngine tier_dir", handoff.DecodeEngine, (TINY_MODEL, 16, 4), {"tier_dir": FOLDER / "new"}, ValueError,
     "tier_dir"),
    # ---- serving.cluster.disagg
    ("simulate_split prefill 0", disagg.simulate_split, (SPECS, 0, 1), {"link": PCIE, "cost_model": cost_model()}
     | SETTINGS, ValueError, "prefill"),
    ("simulate_split decode 1.5", disagg.simulate_split, (SPECS, 1, 1.5), {"link": PCIE, "cost_model": cost_model()}
     | SETTINGS, ValueError, "decode"),
    ("simulate_split link a name", disagg.simulate_split, (SPECS, 1, 1), {"link": "NVLink", "cost_model":
                                                                         cost_model()} | SETTINGS,
     ValueError, "link"),
    ("simulate_split requests of ints", disagg.simulate_split, ([1, 2], 1, 1), {"link": PCIE, "cost_model":
                                                                               cost_model()} | SETTINGS,
     ValueError, "requests"),
    ("goodput empty", disagg.goodput, (np.array([]), np.array([]), 1.0, 0.05), {}, ValueError, "ttft"),
    ("goodput lengths differ", disagg.goodput, (np.ones(3), np.ones(2), 1.0, 0.05), {}, ValueError, "ttft"),
    ("goodput 2-D", disagg.goodput, (np.ones((2, 2)), np.ones((2, 2)), 1.0, 0.05), {}, ValueError, "ttft"),
    ("goodput ttft_target 0", disagg.goodput, (np.ones(2), np.ones(2), 0.0, 0.05), {}, ValueError, "ttft_target"),
    ("goodput tpot_target nan", disagg.goodput, (np.ones(2), np.ones(2), 1.0, nan), {}, ValueError, "tpot_target"),
]


@pytest.mark.parametrize("label, call, args, kwargs, exc, param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused(label, call, args, kwargs, exc, param):
    run_case(call, args, kwargs, exc, param)
    assert not (FOLDER / "new").exists() and not (FOLDER / "x.kvblock").exists(), "a refused call left a file"


def test_the_table_covers_chapter_08s_modules_and_has_unique_labels():
    assert len({c[0] for c in CASES}) == len(CASES)
    modules = {getattr(c[1].factory if isinstance(c[1], On) else c[1], "__module__", "") for c in CASES}
    assert {"labkit.serving.sim.tiers", "labkit.memory.tiered", "labkit.caches.block_files",
            "labkit.caches.tier_store", "labkit.serving.variants.tiered", "labkit.serving.tiered_engine",
            "labkit.serving.handoff", "labkit.serving.cluster.disagg"} <= modules


def test_the_allocator_of_a_refused_tiered_cache_is_not_hooked():
    """``run_case``'s snapshot sees a bound method only by its repr: this says it outright."""
    alloc = BlockAllocator(4)
    hook = getattr(alloc, "on_evict", None)
    with pytest.raises(ValueError, match="block_size"):
        tiered.TieredPrefixCache(alloc, 0, tiered.TierStore(2))
    assert getattr(alloc, "on_evict", None) is hook


def test_good_inputs_still_work():
    """The checks refuse only what is wrong: the same calls with good values run."""
    assert tiers.Tier(**TIER).bandwidth == 1e9 and tiers.reload_seconds(0, BPT, PCIE) == 0.0
    assert tiers.break_even_tokens(BPT, PCIE, cost_model(), max_tokens=1 << 14) is not None
    pool = kv_pool()
    assert block_files.read_block(pool, 1, "b0", BLOCK_FILE) == pool.bytes_per_block
    assert tier_store.DiskTierStore(kv_pool(), FOLDER / "store", 2).read_mode == "cached"
    assert tier_store.MemoryTierStore(kv_pool(), 2).capacity == 2
    assert disagg.goodput(np.ones(2), np.array([nan, 0.01]), 1.0, 0.05) == 1.0
    prefill, decode = tiny_engine(max_num_batched_tokens=4), decode_engine()
    request = prefill.add_request([1, 2, 3, 4, 5, 6, 7, 8, 9], 2, eos_token_id=())
    prefill.step()  # 4 tokens written: one full block of 4 handed over
    h = handoff.hand_over(prefill, request, decode)
    assert (h.claimed_tokens, h.tokens) == (4, 4) and decode.has_unfinished() and not prefill.has_unfinished()
