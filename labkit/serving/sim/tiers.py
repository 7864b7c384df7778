"""Where a cache block can live, and when moving it beats computing it again (chapter 08).

A prefix cache keeps blocks in GPU memory until they are evicted. A second *tier* (the host's
CPU memory, a local SSD, another machine over the network) can hold them longer; when a request
asks for a prefix held there, the server has two ways to get its K/V into GPU memory:

* **reload** it: ``H × bytes_per_token`` bytes over the tier's link, plus a fixed ``latency``
  (a copy launched, a read issued, a message answered)::

      reload_seconds(H) = H × bytes_per_token / bandwidth + latency

* **recompute** it: prefill those H tokens again, which the roofline cost model
  (``labkit.serving.sim.costmodel``) prices as it prices any step of the simulator.

Moving wins when reloading is cheaper. Two facts shape the answer:

1. A prefill step of few tokens is *memory-bound*: it reads all the weights whatever the
   number of tokens (chapter 06). The request still needs a step for the part of its prompt
   that no tier holds (at least its last token, whose logits it samples), and that step reads
   the weights anyway. So the honest price of recomputing the prefix is the *extra* time of
   computing it in that step::

      extra(H) = step(H + suffix new tokens) - step(suffix new tokens after H cached)

   Below the device's ridge point the extra is almost nothing (the tokens ride along the
   weight read), and any reload, which costs bytes and latency, loses. Charging the whole
   step to the prefix (``suffix_tokens=0``) is the trap: it makes every reload win from H = 1.

2. Above the ridge, recomputing costs ``flops_per_token / peak_flops`` per token plus the
   attention, which grows with the square of H; reloading costs ``bytes_per_token / bandwidth``
   per token plus its fixed latency. The latency keeps short prefixes cheaper to recompute; a
   tier slower per token than the arithmetic loses on the linear part and can win only once
   the quadratic attention has grown large enough, possibly beyond any real context
   (:func:`break_even_tokens` returns None then).

Tier figures are link or datasheet rates (:data:`TIERS`, each with its ``source``); real copies
reach less, and the latencies are assumptions, labelled as such. ``benchmarks/tier_breakeven.py``
measures both sides for the book's real model on a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ...checks import check_int, check_number
from .costmodel import DEVICES, CostModel
from .work import work_sums

__all__ = ["Tier", "TIERS", "get_tier", "reload_seconds", "recompute_seconds", "prefix_recompute_seconds",
           "break_even_tokens", "break_even_table"]


@dataclass(frozen=True)
class Tier:
    """A place a cache block can be reloaded from: its ``bandwidth`` (bytes per second, decimal as
    datasheets write it: 1 GB/s = 10**9 B/s), its fixed ``latency`` per reload (seconds) and where the
    figures come from (``source``)."""

    name: str
    bandwidth: float
    latency: float
    source: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        check_number("bandwidth", self.bandwidth, 0, strict=True, finite=True)
        check_number("latency", self.latency, 0, finite=True)
        if not isinstance(self.source, str):
            raise ValueError(f"source must be a string (where the figures come from), got {self.source!r}")


# Link rates per direction. Latencies are assumptions (the order of one copy launch, one read, one
# round trip), said so in each source.
TIERS: dict[str, Tier] = {t.name: t for t in [
    Tier("GPU HBM (H100 SXM)", DEVICES["H100 SXM"].memory_bandwidth, 0.0,
         source="NVIDIA H100 datasheet: 3.35 TB/s HBM3 (the H100 SXM device preset); latency assumed 0: "
                "the cache's own memory, a reference row"),
    Tier("PCIe 4.0 x16 (host to GPU)", 31.5e9, 10e-6,
         source="PCI-SIG PCIe 4.0: 16 GT/s per lane, 128b/130b encoding, 31.5 GB/s per direction on x16 "
                "(quoted as 32 GB/s, 64 GB/s both ways); a link rate, measured pinned copies reach less; "
                "latency 10 us assumed (one copy launched)"),
    Tier("PCIe 5.0 x16 (host to GPU)", 63.0e9, 10e-6,
         source="PCI-SIG PCIe 5.0: 32 GT/s per lane, 128b/130b encoding, 63 GB/s per direction on x16 "
                "(quoted as 64 GB/s, 128 GB/s both ways); a link rate, measured pinned copies reach less; "
                "latency 10 us assumed"),
    Tier("NVLink (H100, GPU to GPU)", 450e9, 5e-6,
         source="NVIDIA H100 SXM datasheet: NVLink 900 GB/s, the sum of both directions: 450 GB/s each way; "
                "latency 5 us assumed"),
    Tier("NVMe SSD (PCIe 4.0)", 7.45e9, 100e-6,
         source="Samsung 990 PRO datasheet: sequential read up to 7,450 MB/s (2 TB model); a best case, "
                "large sequential reads; latency 100 us assumed (one flash read plus the I/O stack)"),
    Tier("Network 100 Gb/s (RDMA)", 12.5e9, 10e-6,
         source="100 Gb/s Ethernet or InfiniBand line rate = 12.5 GB/s before protocol overhead; "
                "latency 10 us assumed (one RDMA read with its software)"),
    Tier("Network 400 Gb/s (RDMA)", 50e9, 10e-6,
         source="400 Gb/s Ethernet or InfiniBand NDR line rate = 50 GB/s before protocol overhead; "
                "latency 10 us assumed"),
]}


def get_tier(name: str) -> Tier:
    """A tier preset by name; ValueError listing the names when it is unknown."""
    if name not in TIERS:
        raise ValueError(f"tier must be one of {sorted(TIERS)}, got {name!r}")
    return TIERS[name]


def _check_tier(tier: object) -> Tier:
    if not isinstance(tier, Tier):
        raise ValueError(f"tier must be a labkit.serving.sim.tiers.Tier (or see TIERS), got {type(tier).__name__}")
    return tier


def _check_cost_model(cost_model: object) -> CostModel:
    if not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a labkit.serving.sim.costmodel.CostModel, "
                         f"got {type(cost_model).__name__}")
    return cost_model


def reload_seconds(tokens: int, bytes_per_token: float, tier: Tier) -> float:
    """Time to bring ``tokens`` tokens' K/V from ``tier``: ``tokens × bytes_per_token / bandwidth + latency``.

    Nothing to move (``tokens == 0``) costs nothing: no copy is issued.
    """
    tokens = check_int("tokens", tokens, 0)
    bytes_per_token = check_number("bytes_per_token", bytes_per_token, 0, strict=True, finite=True)
    tier = _check_tier(tier)
    return 0.0 if tokens == 0 else tokens * bytes_per_token / tier.bandwidth + tier.latency


def recompute_seconds(tokens: int, cost_model: CostModel, context_tokens: int = 0) -> float:
    """What the simulator charges for one step that prefills ``tokens`` new tokens after ``context_tokens``
    cached ones: ``cost_model.time_from_sums`` of that one chunk's sums (``labkit.serving.sim.work``)."""
    tokens = check_int("tokens", tokens, 0)
    context_tokens = check_int("context_tokens", context_tokens, 0)
    cost_model = _check_cost_model(cost_model)
    return cost_model.time_from_sums(*work_sums([(context_tokens, tokens)]))


def prefix_recompute_seconds(tokens: int, cost_model: CostModel, suffix_tokens: int = 1,
                             context_tokens: int = 0) -> float:
    """The extra time of computing ``tokens`` prompt tokens again, inside the step the request needs anyway
    for its ``suffix_tokens`` uncached tokens: ``step(tokens + suffix) - step(suffix after the tokens)``, both
    after ``context_tokens`` already in the pool (a hit there comes before the tokens in question).

    ``suffix_tokens=0`` charges the whole step, weight read included, to the prefix (see the module's
    docstring: it flatters every reload).
    """
    tokens = check_int("tokens", tokens, 0)
    suffix_tokens = check_int("suffix_tokens", suffix_tokens, 0)
    cost_model = _check_cost_model(cost_model)
    return recompute_seconds(tokens + suffix_tokens, cost_model, context_tokens) \
        - recompute_seconds(suffix_tokens, cost_model, context_tokens + tokens)


def _extra_array(h: np.ndarray, cm: CostModel, suffix: int) -> np.ndarray:
    """``prefix_recompute_seconds`` for many prefix lengths at once (the roofline of ``time_from_sums``)."""
    def steps(new: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        pairs = new * ctx + new * (new + 1) / 2
        moved = cm.weight_bytes + (ctx + new) * cm.kv_bytes_per_token
        flops = cm.flops_per_token * new + cm.attention_flops_per_pair * pairs
        t = np.maximum(moved / cm.device.memory_bandwidth, flops / cm.device.peak_flops) + cm.overhead_s
        return np.where(new == 0, 0.0, t)
    return steps(h + suffix, np.zeros_like(h)) - steps(np.full_like(h, suffix), h)


def break_even_tokens(bytes_per_token: float, tier: Tier, cost_model: CostModel, max_tokens: int = 1 << 20,
                      suffix_tokens: int = 1) -> int | None:
    """The smallest prefix length H (tokens) whose reload is cheaper than its recompute, or None up to
    ``max_tokens``.

    Reload is ``reload_seconds(H)``: linear in H plus a fixed latency. Recompute is
    ``prefix_recompute_seconds(H)``: nearly free while the step is memory-bound, then linear in the
    weights' arithmetic plus quadratic in attention. So a short prefix is cheaper to recompute (the
    latency, and the weight read the step pays anyway); when the tier's per-token cost
    (``bytes_per_token / bandwidth``) is below the per-token arithmetic (``flops_per_token / peak_flops``)
    reload wins from a few hundred or thousand tokens on; when it is above, only the quadratic attention
    can make reload win, at a length that may exceed ``max_tokens`` (None).
    """
    bytes_per_token = check_number("bytes_per_token", bytes_per_token, 0, strict=True, finite=True)
    tier = _check_tier(tier)
    cost_model = _check_cost_model(cost_model)
    max_tokens = check_int("max_tokens", max_tokens, 1)
    suffix_tokens = check_int("suffix_tokens", suffix_tokens, 0)
    for start in range(1, max_tokens + 1, 1 << 16):  # in slices, to keep memory small
        h = np.arange(start, min(start + (1 << 16), max_tokens + 1), dtype=np.float64)
        wins = np.flatnonzero(h * bytes_per_token / tier.bandwidth + tier.latency
                              < _extra_array(h, cost_model, suffix_tokens))
        for i in wins:  # the scalar functions have the last word (rounding at the very edge)
            H = int(h[i])
            if reload_seconds(H, bytes_per_token, tier) < prefix_recompute_seconds(H, cost_model, suffix_tokens):
                return H
    return None


def break_even_table(models: list[str], tiers: list[Tier], devices: list[str], suffix_tokens: int = 1,
                     max_tokens: int = 1 << 20) -> list[dict]:
    """One row per (model, device, tier), for a chapter's table.

    Each row: the per-token reload cost (``bytes_per_token / bandwidth``, seconds), the per-token recompute
    cost above the ridge (``flops_per_token / peak_flops``), the prefill length at which a step turns
    compute-bound (``ridge_tokens``: the weight read's time in tokens of arithmetic), and the break-even H
    (None: never within ``max_tokens``). Bytes per token are the model preset's (bf16).
    """
    for name, value in (("models", models), ("tiers", tiers), ("devices", devices)):
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"{name} must be a non-empty list, got {value!r}")
    for t in tiers:
        _check_tier(t)
    rows = []
    for model in models:
        for device in devices:
            cm = CostModel(model, device)
            per_token_recompute = cm.flops_per_token / cm.device.peak_flops
            ridge = cm.weight_bytes / cm.device.memory_bandwidth / per_token_recompute
            for tier in tiers:
                rows.append(dict(
                    model=cm.model.shape.name, device=cm.device.name, tier=tier.name,
                    bytes_per_token=cm.kv_bytes_per_token,
                    reload_s_per_token=cm.kv_bytes_per_token / tier.bandwidth, latency_s=tier.latency,
                    recompute_s_per_token=per_token_recompute, ridge_tokens=math.ceil(ridge),
                    break_even_tokens=break_even_tokens(cm.kv_bytes_per_token, tier, cm, max_tokens,
                                                        suffix_tokens)))
    return rows
