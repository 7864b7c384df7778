"""Before paging: reserve a request's whole KV space when it is admitted (chapters 03 and 06).

The PagedAttention paper compares vLLM with systems that give each request one contiguous
region, sized at admission: Orca (Max) reserves room for ``max_model_len`` tokens for every request
(vLLM's own per-request budget, ``cdiv(max_model_len, block_size)`` blocks), Orca (Oracle) exactly
the slots its longest sequence needs (``Request.max_len``: prompt + outputs - 1, the outputs capped
by ``max_model_len``, as if the output length were known). ``ReservingScheduler`` plays both on the paged pool: through the
``_admission_slots`` hook an admitted request takes blocks for its whole reservation at once, so
its table never grows, it is never preempted, and a request waits until its whole reservation is
free. The slots reserved but not yet written are chapter 03's waste, paid here in concurrency.
"""

from __future__ import annotations

from ...checks import check_choice
from ..request import Request
from ..scheduler import Scheduler

__all__ = ["ALLOCATIONS", "RESERVATIONS", "check_allocation", "ReservingScheduler", "scheduler_class"]

# How a request takes KV memory: block by block as its tokens need them (vLLM), or all at admission.
ALLOCATIONS = ("paged", "max_len", "exact")
RESERVATIONS = ALLOCATIONS[1:]


def check_allocation(allocation: object, max_model_len: object) -> str:
    """``allocation`` checked: one of ``ALLOCATIONS``; ``"max_len"`` needs a ``max_model_len``."""
    check_choice("allocation", allocation, ALLOCATIONS)
    if allocation == "max_len" and max_model_len is None:
        raise ValueError("max_model_len must be an integer >= 1 with allocation='max_len', got None")
    return allocation


class ReservingScheduler(Scheduler):
    """A ``Scheduler`` whose requests take their whole reservation at admission.

    ``reserve="max_len"`` (Orca (Max)) reserves ``max_model_len`` slots per request (required), the room a
    request of ``max_model_len`` tokens is given; ``"exact"`` (Orca (Oracle)) reserves ``request.max_len``.
    """

    def __init__(self, *args, reserve: str = "max_len", **kwargs):
        check_choice("reserve", reserve, RESERVATIONS)
        if reserve == "max_len" and kwargs.get("max_model_len") is None:
            raise ValueError("max_model_len must be an integer >= 1 with reserve='max_len', got None")
        super().__init__(*args, **kwargs)
        self.reserve = reserve

    def reserved_tokens(self, request: Request) -> int:
        """The slots ``request`` holds from admission to its end."""
        return self.max_model_len if self.reserve == "max_len" else request.max_len

    def _admission_slots(self, request: Request, tokens: int) -> int:
        return self.reserved_tokens(request)


def scheduler_class(allocation: str) -> tuple[type[Scheduler], dict]:
    """The scheduler class and extra arguments for an ``allocation`` of ``ALLOCATIONS``."""
    return (Scheduler, {}) if allocation == "paged" else (ReservingScheduler, {"reserve": allocation})
