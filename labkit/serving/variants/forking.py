"""Parallel sampling: several answers to one prompt, sharing its blocks (chapters 04 and 05).

``fork`` gives a running request a twin that holds every one of its blocks (one more
reference each, no copy). The two write into the same partly filled tail block at their next
token, so the first to write gets a private copy first (copy-on-write, ``labkit.memory.prefix``); full
blocks stay shared for good. vLLM v1 does it differently: its parallel sampling makes
independent child requests (``vllm/v1/engine/parallel_sampling.py``) that share the prompt's
full blocks through the prefix cache and each compute their own last, partial block.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from ..request import Request, RequestStatus
from ..scheduler import Scheduler
from ..step import Step

__all__ = ["ForkingScheduler"]


class ForkingScheduler(Scheduler):
    """A ``Scheduler`` whose running requests can ``fork``. A twin forked while a step is in flight is its
    parent as that step leaves it: it gets the token its parent samples in that step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fork_ids = itertools.count(1)
        self._twins: dict[int, list[Request]] = {}  # id(request sampling in the step in flight) -> its twins

    def fork(self, request: Request) -> Request:
        """A twin of a running request sharing all its blocks; its id is ``(parent id, "fork", n)``."""
        if not isinstance(request, Request) or request.status is not RequestStatus.RUNNING \
                or self.requests.get(request.request_id) is not request:
            raise ValueError("request must be a running request of this scheduler")
        if len(self.running) >= self.max_num_seqs:
            raise ValueError(f"max_num_seqs: {self.max_num_seqs} requests run already")
        child_id = (request.request_id, "fork", next(self._fork_ids))
        while child_id in self.requests:
            child_id = (request.request_id, "fork", next(self._fork_ids))
        child = Request(list(request.prompt_token_ids), request.max_new_tokens, request.eos_token_id,
                        request_id=child_id, output_token_ids=list(request.output_token_ids),
                        num_computed_tokens=request.num_computed_tokens,
                        block_table=self.prefix_cache.fork(request.block_table), status=RequestStatus.RUNNING,
                        max_model_len=request.max_model_len)
        self.running.append(child)
        self.requests[child.request_id] = child
        if id(request) in self._twins:  # its token is being sampled: the twin gets it too
            self._twins[id(request)].append(child)
            self._twins[id(child)] = self._twins[id(request)]
        return child

    def schedule(self) -> Step:
        step = super().schedule()
        self._twins = {id(c.request): [] for c in step.sampling_chunks}
        return step

    def postprocess(self, step: Step, sampled_token_ids: Sequence[int]) -> list[Request]:
        """As ``Scheduler.postprocess``, and each twin forked meanwhile gets its parent's token."""
        twins = [(twin, token) for c, token in zip(step.sampling_chunks, sampled_token_ids)
                 for twin in self._twins.get(id(c.request), ())]
        finished = super().postprocess(step, sampled_token_ids)  # checks the arguments first
        self._twins = {}
        for twin, token in twins:
            if twin.status is RequestStatus.RUNNING and twin.append_output(token):
                self.finish(twin)
                finished.append(twin)
        step.stats.finished = len(finished)
        return finished
