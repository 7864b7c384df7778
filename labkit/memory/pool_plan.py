"""The KV pool of one device: what fits before anything is served (chapters 03 and 06).

:func:`plan_pool` carves a device's memory into a pool of KV blocks and counts the
bookkeeping an engine keeps beside them (§06's 24 GiB example). :func:`reservation_shares`
redoes the PagedAttention paper's Fig. 2: how much of the memory reserved for requests
holds live token states when each request reserves its maximum length, a power of two,
its exact length, or (paging) only the blocks its tokens fill. Whether what fits is also
served well is ``labkit.serving.sim.simulator``'s question.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..checks import check_bytes, check_int
from ..units import GiB, format_bytes
from .blocks import blocks_needed
from .capacity import TEACHING_MODEL, ModelShape

__all__ = ["PoolPlan", "plan_pool", "reservation_shares", "RESERVATION_POLICIES", "PAPER_FIG2"]


@dataclass(frozen=True)
class PoolPlan:
    """A device's memory turned into a KV pool, with the bookkeeping counted.

    ``management`` lists the device-side tensors an engine keeps *besides* the
    K/V blocks, sized for its limits: the block tables (one int32 entry per
    block a sequence may hold, for every sequence slot), the sequence lengths
    (int32) and the slot mapping of one step (int64 per scheduled token). If they
    come out of the pool, the pool loses whole blocks.
    """

    model: ModelShape
    device_bytes: float
    set_aside_bytes: float
    block_size: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int

    @property
    def pool_bytes(self) -> float:
        return self.device_bytes - self.set_aside_bytes

    @property
    def block_bytes(self) -> int:
        return self.model.block_bytes(self.block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, before any bookkeeping."""
        return int(self.pool_bytes // self.block_bytes)

    @property
    def blocks_per_sequence(self) -> int:
        """Blocks one sequence of ``max_model_len`` tokens holds."""
        return blocks_needed(self.max_model_len, self.block_size)

    @property
    def sequences_that_fit(self) -> int:
        """Sequences of ``max_model_len`` tokens the bare pool holds (the formula's answer)."""
        return self.num_blocks // self.blocks_per_sequence

    @property
    def management(self) -> dict[str, int]:
        """Bytes of each device-side bookkeeping tensor."""
        return {
            "block tables (int32)": 4 * self.max_num_seqs * self.blocks_per_sequence,
            "sequence lengths (int32)": 4 * self.max_num_seqs,
            "slot mapping (int64)": 8 * self.max_num_batched_tokens,
        }

    @property
    def management_bytes(self) -> int:
        return sum(self.management.values())

    @property
    def num_blocks_after_management(self) -> int:
        """Whole blocks left when the bookkeeping is paid out of the pool."""
        return int((self.pool_bytes - self.management_bytes) // self.block_bytes)

    @property
    def sequences_after_management(self) -> int:
        return self.num_blocks_after_management // self.blocks_per_sequence

    def host_metadata_bytes(self, bytes_per_block: int = 48) -> int:
        """Host (CPU) memory for per-block metadata: reference count, hash, free-queue links...

        ``bytes_per_block`` is an estimate (4 ref count + 32 hash + 8 links + 4 id):
        host memory, so it does not shrink the pool, but it grows with the pool.
        """
        return check_int("bytes_per_block", bytes_per_block, 0) * self.num_blocks

    def describe(self) -> str:
        lines = [
            f"device {format_bytes(self.device_bytes)} - set aside {format_bytes(self.set_aside_bytes)} "
            f"= pool {format_bytes(self.pool_bytes)}",
            f"block of {self.block_size} tokens = {format_bytes(self.block_bytes)}: {self.num_blocks:,} blocks",
            f"one sequence of {self.max_model_len:,} tokens = {self.blocks_per_sequence:,} blocks "
            f"= {format_bytes(self.blocks_per_sequence * self.block_bytes)}: "
            f"{self.sequences_that_fit} sequences fit",
        ]
        return "\n".join(lines)


def plan_pool(device_bytes: float = 24 * GiB, set_aside_bytes: float = 17 * GiB, model: ModelShape = TEACHING_MODEL,
              block_size: int = 16, max_num_seqs: int = 256, max_model_len: int = 8192,
              max_num_batched_tokens: int = 8192) -> PoolPlan:
    """The KV pool left on a device after the weights, the workspace and a reserve (``set_aside_bytes``).

    Defaults are §06's example: a 24 GiB device, 17 GiB set aside, the teaching
    model, 16-token blocks; the engine limits (256 sequence slots, 8,192-token
    sequences and steps) are typical engine defaults, not from the article.
    """
    check_bytes("device_bytes", device_bytes, positive=True)
    check_bytes("set_aside_bytes", set_aside_bytes)
    if not isinstance(model, ModelShape):
        raise TypeError(f"model must be a labkit.memory.capacity.ModelShape, got {type(model).__name__}")
    if set_aside_bytes > device_bytes:
        raise ValueError(f"set_aside_bytes must be in [0, device_bytes = {format_bytes(device_bytes)}], "
                         f"got {format_bytes(set_aside_bytes)}")
    for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                        ("max_model_len", max_model_len), ("max_num_batched_tokens", max_num_batched_tokens)):
        check_int(name, value, 1)
    plan = PoolPlan(model, device_bytes, set_aside_bytes, block_size, max_num_seqs, max_model_len,
                    max_num_batched_tokens)
    if plan.num_blocks < 1:
        raise ValueError(f"set_aside_bytes leaves a pool of {format_bytes(plan.pool_bytes)}, smaller than one "
                         f"block ({format_bytes(plan.block_bytes)}): it must leave at least one block")
    return plan


# Share of KV memory holding token states in the PagedAttention paper's Fig. 2 (Kwon et al. 2023).
PAPER_FIG2 = {"reserve max length": 0.204, "reserve power of two": 0.268, "reserve exact length (oracle)": 0.382,
              "paged, 16-token blocks": 0.963}
RESERVATION_POLICIES = tuple(PAPER_FIG2)


def reservation_shares(requests: Sequence, max_len: int = 2048, block_size: int = 16) -> dict[str, float]:
    """The share of reserved KV slots that hold live token states, under four policies.

    ``requests``: anything with a ``prompt_len`` and an ``output_len`` (a ``RequestSpec`` of
    ``labkit.serving.sim.workloads``).

    Every request is looked at during each of its decode steps: after step ``t``
    (``t = 1 .. output_len``) it holds ``prompt_len + t`` live tokens. What it has
    reserved meanwhile depends on the policy:

    * **max length**: ``max_len`` slots, whatever the request (Orca (Max));
    * **power of two**: the next power of two at or above its final length
      (a length known within a factor of 2: Orca (Pow2));
    * **oracle**: exactly its final length ``prompt_len + output_len`` (Orca (Oracle));
    * **paged**: only the blocks its live tokens occupy, ``ceil(live / block_size)``
      blocks (vLLM): waste is at most one partly filled block.

    The share is Σ live / Σ reserved over all (request, step) pairs, i.e. the
    average over time when requests run side by side. External fragmentation
    (holes between contiguous reservations) is not modelled, so the three
    reservation policies come out *higher* here than in a real system.
    """
    if not requests:
        raise ValueError("requests must hold at least one request")
    check_int("max_len", max_len, 1)
    check_int("block_size", block_size, 1)
    prompt = np.array([r.prompt_len for r in requests], dtype=np.float64)
    output = np.array([r.output_len for r in requests], dtype=np.float64)
    total = prompt + output
    if total.max() > max_len:
        raise ValueError(f"max_len must be at least the longest request ({int(total.max())} tokens), got {max_len}")
    live = (output * prompt + output * (output + 1) / 2).sum()  # Σ_r Σ_t (prompt + t)
    pow2 = 2.0 ** np.ceil(np.log2(total))
    # Paged: every live length the requests pass through, rounded up to whole blocks.
    lengths = np.concatenate([np.arange(p + 1, p + o + 1) for p, o in zip(prompt.astype(np.int64),
                                                                           output.astype(np.int64))])
    paged = float((blocks_needed(lengths, block_size) * block_size).sum())
    return {
        "reserve max length": live / (output * max_len).sum(),
        "reserve power of two": live / (output * pow2).sum(),
        "reserve exact length (oracle)": live / (output * total).sum(),
        "paged, 16-token blocks" if block_size == 16 else f"paged, {block_size}-token blocks": live / paged,
    }
