"""One workload through both engines: labkit's side of the comparison with the real vLLM (appendix A4).

``chat_workload`` builds chat prompts that exercise the prefix cache three ways (shared system
prompts, repeats); ``labkit.vllm_bridge.real.run_offline`` serves them with vLLM, and
``serve_with_engine`` with the book's ``Engine``, reporting what vLLM reports: outputs, each request's
prefix hit at its first admission, the counters, and the schedule step by step (``vllm_schedule``
turns vLLM's recorded steps into the same shape).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from ..checks import check_int
from ..model.pretrained import chat_token_ids
from ..serving.engine import Engine
from ..serving.request import Request


# Two system prompts of more than two blocks of 32 tokens once templated: requests that share one share
# its full blocks through the prefix cache.
SYSTEM_PROMPTS = (
    "You are a patient teacher of computer science at an evening school. The students are adults who work "
    "during the day and are new to the subject; some have never written a program. You answer their questions "
    "in plain words, without jargon, and you never use lists or code. When a question has a short answer, give "
    "the short answer. Keep every answer short: one or two sentences at most.",
    "You are the travel assistant of a small tourist office in a fishing town on the coast. Visitors ask you "
    "about the town, the weather, the beaches, the boats and the trains to the city. You know the town well "
    "and you like it. Answer briefly and kindly, in one sentence, and suggest something to see or to eat in the "
    "town when you can.",
)
QUESTIONS = (
    ("What does a CPU do?", "What is a cache in a processor?", "Why is memory bandwidth important?",
     "What is a GPU good at?", "What does an operating system do?", "What is a compiler?",
     "Why do programs use threads?", "What is a hash table?"),
    ("Is the beach open in winter?", "When does the first train leave?", "Where can I rent a bicycle?",
     "Is it windy in the afternoon?", "Can I swim near the harbour?", "Where is the market?",
     "How far is the lighthouse?", "What should I pack for a day trip?"),
)


def chat_workload(tokenizer, num_requests: int = 12, num_repeats: int = 2) -> list[list[int]]:
    """Chat prompts (token ids, the chat template applied) that exercise the prefix cache three ways.

    Questions alternate between the two system prompts (shared prefixes of two full blocks or more);
    the last ``num_repeats`` prompts repeat the first ones exactly (a whole prompt found, but for its
    last token, which is computed again to give logits).
    """
    num_requests = check_int("num_requests", num_requests, 1)
    num_repeats = check_int("num_repeats", num_repeats, 0)
    if num_repeats >= num_requests or num_requests - num_repeats > sum(len(q) for q in QUESTIONS):
        raise ValueError(f"num_repeats must be below num_requests ({num_requests}), and at most "
                         f"{sum(len(q) for q in QUESTIONS)} prompts are distinct")
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise TypeError(f"tokenizer must be a Hugging Face tokenizer with a chat template "
                        f"(labkit.model.pretrained.load_tokenizer), got {type(tokenizer).__name__}")
    prompts = []
    for i in range(num_requests - num_repeats):
        system, question = SYSTEM_PROMPTS[i % 2], QUESTIONS[i % 2][i // 2]
        prompts.append(chat_token_ids(tokenizer, [{"role": "system", "content": system},
                                                  {"role": "user", "content": question}]))
    return prompts + [list(p) for p in prompts[:num_repeats]]


def serve_with_engine(engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> dict[str, Any]:
    """labkit's ``Engine`` serves the prompts as ``labkit.vllm_bridge.real.run_offline`` has vLLM serve
    them: all submitted at once, greedy, each stopping at ``max_tokens`` or the model's end-of-sequence
    token. The same report: ``outputs``, ``num_cached_tokens`` (each request's hit at its *first*
    admission, as vLLM's ``RequestOutput`` keeps it and labkit's ``Request`` too), ``counters``
    (prefix-cache queries and hits of first admissions, preemptions) and ``steps``.

    ``engine``: an idle ``Engine`` (a fresh one, for counters of this workload alone); every prompt and
    count is checked before any request is queued."""
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a labkit.serving.engine.Engine, got {type(engine).__name__}")
    if engine.has_unfinished():
        raise ValueError("engine must be idle: it still has unfinished requests, which the report would mix in")
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of prompts (token ids), got {type(prompts).__name__}")
    if not isinstance(max_tokens, (list, tuple)) or len(max_tokens) != len(prompts):
        raise ValueError(f"max_tokens must be a list of one count per prompt ({len(prompts)}), got {max_tokens!r}")
    requests = _checked_requests(engine, prompts, max_tokens)
    for r in requests:
        engine.scheduler.add_request(r)
    index = {r.request_id: i for i, r in enumerate(requests)}
    schedule, preempted = [], []
    while engine.has_unfinished():
        step = engine.step()
        schedule.append({index[c.request.request_id]: c.num_tokens for c in step.chunks})
        preempted.append(sorted(index[r.request_id] for r in step.preempted))
    stats = engine.scheduler.prefix_cache.stats
    return {"outputs": [list(r.output_token_ids) for r in requests],
            "num_cached_tokens": [r.num_cached_tokens for r in requests],
            "counters": {"prefix_cache_queries": stats.queries, "prefix_cache_hits": stats.hits,
                         "num_preemptions": sum(r.num_preemptions for r in requests)},
            "schedule": schedule, "preempted": preempted}


def _checked_requests(engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[Request]:
    """Every request checked (its tokens, its count, its fit in the pool) before any is queued, as
    ``Engine.generate`` does; a refusal names the request's place in ``prompts`` and ``max_tokens``."""
    requests = []
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        try:
            requests.append(engine.make_request(prompt, n))
        except ValueError as err:
            raise ValueError(f"prompts[{i}] with max_tokens[{i}] = {n!r}: {err}") from None
    return requests


# A request id of vLLM's offline LLM: the prompt's index, then "-" and a suffix of its own ("3-a4607f2b").
REQUEST_ID = re.compile(r"(\d+)(-.*)?")


def _prompt_index(request_id: object) -> int:
    match = REQUEST_ID.fullmatch(str(request_id))
    if match is None:
        raise ValueError(f"steps must name requests as vLLM's offline LLM does, '<prompt index>-<suffix>' "
                         f"(e.g. '3-a4607f2b'), got the request id {request_id!r}")
    return int(match.group(1))


def vllm_schedule(steps: Sequence[dict[str, Any]]) -> tuple[list[dict[int, int]], list[list[int]]]:
    """vLLM's recorded steps as :func:`serve_with_engine` reports labkit's: per step, the tokens each
    request was given (by prompt index: the offline ``LLM`` names request ``i`` "i-<suffix>") and the
    requests preempted.

    ``steps``: the driver's records, a list of ``{"scheduled": {request id: tokens}, "preempted": [request
    ids]}`` (``run_offline``'s ``steps``); anything else is refused, naming ``steps`` and that form.
    """
    form = "a list of {'scheduled': {request id: tokens}, 'preempted': [request ids]} (run_offline's steps)"
    if not isinstance(steps, (list, tuple)):
        raise ValueError(f"steps must be {form}, got {type(steps).__name__}")
    for i, s in enumerate(steps):
        if not (isinstance(s, dict) and isinstance(s.get("scheduled"), dict)
                and isinstance(s.get("preempted"), (list, tuple))):
            raise ValueError(f"steps must be {form}; steps[{i}] is {s!r}")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in s["scheduled"].values()):
            raise ValueError(f"steps[{i}]['scheduled'] must give each request a whole number of tokens >= 1, "
                             f"got {s['scheduled']!r}")
    return ([{_prompt_index(r): n for r, n in s["scheduled"].items()} for s in steps],
            [sorted(_prompt_index(r) for r in s["preempted"]) for s in steps])
