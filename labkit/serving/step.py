"""What one scheduler step hands the model (chapter 05): the chunks to compute, where their K/V go,
the copies to make first, every turn of the budget pass, and counts for tables and charts (vLLM's
``SchedulerOutput``, ``vllm/v1/core/sched/output.py``). The scheduler fills these in; nothing here
knows the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request

__all__ = ["Decision", "ScheduledChunk", "StepStats", "Step"]


@dataclass
class Decision:
    """One candidate's turn in a step's budget pass: ``tokens`` = min(num_new_tokens, token_budget),
    ``needed`` its ``extra_blocks``, against the ``free_blocks`` and ``token_budget`` left at its turn.
    ``outcome``: ``"planned"``, ``"skipped"`` (needed > free_blocks), ``"preempted"`` (a running
    request that had to give its own blocks back) or ``"stop"`` (the budget is spent)."""

    request: Request
    waiting: bool
    num_new_tokens: int
    tokens: int
    needed: int
    free_blocks: int
    token_budget: int
    outcome: str


@dataclass
class ScheduledChunk:
    """One request's share of a step: ``token_ids`` at positions ``start, start + 1, ...``, and
    ``slot_mapping[i]``, the pool slot (``block_id * block_size + offset``) of token i's K/V.
    ``block_table``: the request's blocks after this step's reservation. ``samples``: the chunk
    reaches the last known token, so the model's output at its last position is the next token.
    ``num_cached_tokens``: prefix-hit tokens skipped when this request was admitted this step."""

    request: Request
    token_ids: list[int]
    start: int
    slot_mapping: list[int]
    block_table: list[int]
    samples: bool
    num_cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.num_tokens)

    @property
    def seq_len(self) -> int:
        """Positions with K/V once the step ran: ``start + num_tokens``."""
        return self.start + self.num_tokens


@dataclass
class StepStats:
    """What one step did, for tables and charts."""

    step: int
    scheduled_tokens: int = 0          # tokens computed this step (<= max_num_batched_tokens)
    prefill_tokens: int = 0            # of which part of a prompt (chunks of more than one token or not sampling)
    decode_tokens: int = 0             # of which single decode tokens
    num_scheduled: int = 0             # requests that got tokens
    prefix_hit_tokens: int = 0         # tokens found in the prefix cache by requests admitted for the first time
    preempted_hit_tokens: int = 0      # tokens re-found by requests admitted again after a preemption
    preemptions: int = 0               # running requests sent back to the waiting queue
    copies: int = 0                    # copy-on-write block copies
    free_blocks: int = 0               # free blocks after the step's reservations (cached ones included)
    used_blocks: int = 0               # blocks held by at least one request
    cached_blocks: int = 0             # blocks named in the prefix cache (used or free)
    num_running: int = 0
    num_waiting: int = 0
    finished: int = 0                  # requests finished by this step (set by postprocess)
    tier_hit_tokens: int = 0           # tokens loaded from a second tier by requests admitted this step
    load_s: float = 0.0                # the seconds those loads took (a tiered scheduler sets both)

    def add_hit(self, num_hit: int, preempted: bool) -> None:
        """A request admitted this step found ``num_hit`` tokens in the prefix cache; after a preemption
        they are its own blocks again (``preempted_hit_tokens``), not a hit."""
        if preempted:
            self.preempted_hit_tokens += num_hit
        else:
            self.prefix_hit_tokens += num_hit

    def count(self, step: "Step", allocator, prefix_cache, num_running: int, num_waiting: int) -> None:
        """Fill in what ``step`` plans, the pool (a ``BlockAllocator`` and its ``PrefixCache``) and the queues,
        once it was planned."""
        total, decode = step.num_tokens, sum(1 for c in step.chunks if c.num_tokens == 1 and c.samples)
        self.scheduled_tokens, self.prefill_tokens, self.decode_tokens = total, total - decode, decode
        self.num_scheduled, self.preemptions, self.copies = len(step.chunks), len(step.preempted), len(step.copies)
        self.free_blocks, self.used_blocks = allocator.num_free, allocator.num_used
        self.cached_blocks = prefix_cache.num_cached_blocks
        self.num_running, self.num_waiting = num_running, num_waiting


@dataclass
class Step:
    """The plan of one step, ready for a model (or a simulator) to execute. Apply ``copies`` (every
    layer's K/V of block ``src`` into block ``dst``) before writing this step's K/V. ``preempted``:
    requests that lost their blocks in this step; ``decisions``: every turn of the budget pass."""

    index: int
    chunks: list[ScheduledChunk]
    copies: list[tuple[int, int]]
    preempted: list[Request]
    stats: StepStats
    decisions: list[Decision] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sampling_chunks(self) -> list[ScheduledChunk]:
        """The chunks that produce a token; ``postprocess`` takes one id per chunk, in this order."""
        return [c for c in self.chunks if c.samples]
