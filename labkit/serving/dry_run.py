"""A scheduler run without a model: what chapter 05 and appendix A5 watch step by step.

The scheduler decides who runs and how many tokens each computes; the model only supplies the
sampled tokens. Replacing the model by "every sampled token is 0" leaves every decision in place,
so a run of many steps takes milliseconds and its ``Step`` records can be read, charted and
compared (with vLLM's own scheduler, in A5).
"""

from __future__ import annotations

from typing import Iterable, Mapping

from .request import Request
from .step import Step


def dry_run(scheduler, arrivals: Mapping[int, list[Request]], max_steps: int = 500) -> list[Step]:
    """Run ``scheduler`` until every request has finished; ``arrivals``: {step: [Request]} added before
    that step is planned. Every sampled token is 0. Returns the steps, in order."""
    steps, t = [], 0
    while scheduler.has_unfinished() or any(k >= t for k in arrivals):
        for r in arrivals.get(t, []):
            scheduler.add_request(r)
        t += 1
        step = scheduler.schedule()
        scheduler.postprocess(step, [0] * len(step.sampling_chunks))
        steps.append(step)
        if len(steps) > max_steps:
            raise RuntimeError(f"no end after max_steps={max_steps} steps: is a request too large for the pool?")
    return steps


def named_requests(specs: Iterable[tuple[str, int, int]]) -> list[Request]:
    """Requests from ``(name, prompt_len, max_new_tokens)``, named for reading, with distinct token ids
    (so that no prefix is shared)."""
    reqs, next_id = [], 1
    for name, prompt_len, max_new in specs:
        reqs.append(Request(list(range(next_id, next_id + prompt_len)), max_new, request_id=name))
        next_id += prompt_len
    return reqs
