"""A priority order for the waiting queue (chapter 05).

The budget pass visits candidates in order, so the queue's order decides who is admitted
first; paging itself has no notion of priority. ``PriorityScheduler`` re-sorts the waiting
queue by a key before each step (smaller first; ``sorted`` is stable, so ties keep their
arrival order). Preemption is unchanged: the newest running request gives its blocks back.
(vLLM's ``--scheduling-policy priority`` keeps a heap of (priority, arrival) and preempts the
running request of lowest priority instead.)
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

from ..request import Request
from ..scheduler import Scheduler
from ..step import Step

__all__ = ["PriorityScheduler"]


class PriorityScheduler(Scheduler):
    """A ``Scheduler`` that admits waiting requests in the order of ``priority(request)``, smallest first."""

    def __init__(self, *args, priority: Callable[[Request], Any], **kwargs):
        if not callable(priority):
            raise ValueError("priority must be a key function of a Request (smaller runs first)")
        super().__init__(*args, **kwargs)
        self.priority = priority

    def schedule(self) -> Step:
        if self._step is None:  # else super() refuses, and the queue stays as it was
            self.waiting = deque(sorted(self.waiting, key=self.priority))
        return super().schedule()
