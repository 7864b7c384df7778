"""One workload through both engines: labkit's side of the comparison with the real vLLM (appendix A4).

``chat_workload`` builds chat prompts that exercise the prefix cache three ways (shared system
prompts, repeats); ``labkit.vllm_bridge.real.run_offline`` serves them with vLLM, and
``serve_with_engine`` with the book's ``Engine``, reporting what vLLM reports: outputs, each request's
prefix hit at its first admission, the counters, and the schedule step by step (``vllm_schedule``
turns vLLM's recorded steps into the same shape).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..checks import check_int
from ..model.pretrained import chat_token_ids


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
    prompts = []
    for i in range(num_requests - num_repeats):
        system, question = SYSTEM_PROMPTS[i % 2], QUESTIONS[i % 2][i // 2]
        prompts.append(chat_token_ids(tokenizer, [{"role": "system", "content": system},
                                                  {"role": "user", "content": question}]))
    return prompts + [list(p) for p in prompts[:num_repeats]]


def serve_with_engine(engine, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> dict[str, Any]:
    """labkit's ``Engine`` serves the prompts as ``labkit.vllm_bridge.real.run_offline`` has vLLM serve
    them: all submitted at once, greedy, each stopping at ``max_tokens`` or the model's end-of-sequence
    token. The same report: ``outputs``, ``num_cached_tokens`` (each request's hit at its *first*
    admission, as vLLM's ``RequestOutput`` keeps it and labkit's ``Request`` too), ``counters``
    (prefix-cache queries and hits of first admissions, preemptions) and ``steps``."""
    requests = [engine.add_request(p, n) for p, n in zip(prompts, max_tokens)]
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


def vllm_schedule(steps: Sequence[dict[str, Any]]) -> tuple[list[dict[int, int]], list[list[int]]]:
    """vLLM's recorded steps as :func:`serve_with_engine` reports labkit's: per step, the tokens each
    request was given (by prompt index: the offline ``LLM`` names request ``i`` "i-<suffix>") and the
    requests preempted."""
    number = lambda request_id: int(str(request_id).split("-")[0])  # noqa: E731
    return ([{number(r): n for r, n in s["scheduled"].items()} for s in steps],
            [sorted(number(r) for r in s["preempted"]) for s in steps])
