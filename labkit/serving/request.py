"""A generation request and where it stands (chapter 05).

A request is a prompt, a limit on new tokens and the stop ids, plus the state the scheduler keeps
for it: which tokens are known, how many of them have K/V in the pool (``num_computed_tokens``),
and the blocks that hold them (``block_table``). vLLM keeps the same in ``vllm/v1/request.py``.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..checks import check_int, check_token_ids, parse_stop_token_ids
from ..memory.prefix import CachedBlockTable

__all__ = ["RequestStatus", "Request", "check_prompt_fits"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"    # in the queue: holds no blocks
    RUNNING = "running"    # admitted: holds blocks, gets tokens every step it fits
    FINISHED = "finished"  # done or cancelled: its blocks went back (named full blocks stay cached)


_request_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation request and its scheduling state.

    ``num_computed_tokens``: leading tokens whose K/V are in the pool (or will be once the
    current step runs; for a waiting request during its turn, its prefix hit). ``block_table``:
    the blocks holding them (chapter 04's ``CachedBlockTable``), ``None`` while it holds none.
    ``num_cached_tokens``: prompt tokens the prefix cache served at its *first* admission (vLLM's
    ``Request.num_cached_tokens``); an admission after a preemption re-finds its own blocks, which is no hit.
    """

    prompt_token_ids: list[int]
    max_new_tokens: int
    eos_token_id: int | Sequence[int] | None = None  # one stop id or several (chat models list a few)
    request_id: Any = field(default_factory=lambda: next(_request_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: CachedBlockTable | None = field(default=None, repr=False)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    max_model_len: int | None = None  # the most tokens (prompt + outputs) it may reach; the scheduler sets it
    stop_token_ids: frozenset[int] = field(init=False, repr=False)  # eos_token_id as a set

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(check_token_ids("prompt_token_ids", self.prompt_token_ids, 1))
        check_int("max_new_tokens", self.max_new_tokens, 1)
        self.output_token_ids = list(check_token_ids("output_token_ids", self.output_token_ids))
        check_int("num_computed_tokens", self.num_computed_tokens, 0)
        if self.num_computed_tokens > self.num_tokens:
            raise ValueError(f"num_computed_tokens must be in [0, {self.num_tokens}] (the tokens known), "
                             f"got {self.num_computed_tokens}")
        if not isinstance(self.status, RequestStatus):
            raise ValueError(f"status must be a RequestStatus, got {self.status!r}")
        if self.block_table is not None and not isinstance(self.block_table, CachedBlockTable):
            raise ValueError(f"block_table must be None or a CachedBlockTable, got {type(self.block_table).__name__}")
        check_int("num_cached_tokens", self.num_cached_tokens, 0)
        check_int("num_preemptions", self.num_preemptions, 0)
        if self.max_model_len is not None:
            check_prompt_fits(len(self.prompt_token_ids), check_int("max_model_len", self.max_model_len, 1))
        try:
            hash(self.request_id)
        except TypeError:
            raise ValueError(f"request_id must be hashable (a dict key), got {self.request_id!r}") from None
        ids = parse_stop_token_ids(self.eos_token_id)
        self.eos_token_id = ids[0] if len(ids) == 1 else (ids or None)
        self.stop_token_ids = frozenset(ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Tokens known so far: the prompt and the outputs."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_new_tokens(self) -> int:
        """How many tokens are known but not computed yet: the rest of the prompt while
        prefilling, 1 while decoding. A count, not a list."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_output_tokens(self) -> int:
        """The most outputs it can reach: ``max_new_tokens``, or fewer where ``max_model_len`` stops it first.
        vLLM 0.33.0 counts ``max_model_len`` in tokens: ``check_stop`` (``vllm/v1/core/sched/utils.py``)
        finishes a request once ``num_tokens >= max_model_len``, so a longer ``max_new_tokens`` is capped."""
        if self.max_model_len is None:
            return self.max_new_tokens
        return min(self.max_new_tokens, self.max_model_len - len(self.prompt_token_ids))

    @property
    def max_len(self) -> int:
        """The most slots it can need: prompt + ``max_output_tokens`` - 1 (the last sampled token is never fed
        back, so it needs no K/V). At most ``max_model_len - 1``."""
        return len(self.prompt_token_ids) + self.max_output_tokens - 1

    def token_ids(self, start: int, stop: int) -> list[int]:
        """The tokens at positions ``[start, stop)`` (while decoding, without copying the whole history);
        ``0 <= start <= stop <= num_tokens``."""
        p = len(self.prompt_token_ids)
        if not (type(start) is int and type(stop) is int and 0 <= start <= stop <= p + len(self.output_token_ids)):
            check_int("start", start, 0)
            check_int("stop", stop, 0)
            raise ValueError(f"start and stop must satisfy 0 <= start <= stop <= {self.num_tokens} (num_tokens), "
                             f"got start={start!r}, stop={stop!r}")
        return self.output_token_ids[start - p:stop - p] if start >= p else self.all_token_ids[start:stop]

    def admit(self, num_hit: int) -> bool:
        """Running from now on, its first ``num_hit`` tokens found in the prefix cache. Returns whether it was
        preempted before: then it re-finds its own blocks, which is no hit, and ``num_cached_tokens`` keeps its
        first admission's, as in vLLM 0.33.0 (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``
        sets it once, while it is still -1). The scheduler calls this once per admission."""
        preempted = self.num_preemptions > 0
        if not preempted:
            self.num_cached_tokens = num_hit
        self.status = RequestStatus.RUNNING
        return preempted

    def append_output(self, token_id: int) -> bool:
        """Append a sampled token; True when it ends the request (``max_output_tokens`` reached or a stop id,
        which is kept in the output, as in transformers' ``generate``)."""
        self.output_token_ids.append(token_id)
        return len(self.output_token_ids) >= self.max_output_tokens or token_id in self.stop_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def check_prompt_fits(prompt_len: int, max_model_len: int) -> None:
    """ValueError unless a prompt of ``prompt_len`` tokens leaves room in ``max_model_len`` for one output:
    vLLM refuses it before queuing it (``vllm/v1/engine/input_processor.py``, ``_validate_prompt_len``)."""
    if prompt_len >= max_model_len:
        raise ValueError(f"prompt_token_ids: a prompt of {prompt_len} tokens must be shorter than max_model_len "
                         f"({max_model_len}), which counts the prompt and at least one output token")
