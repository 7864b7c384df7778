"""What the cost model reads from one engine step, as three sums (chapter 06).

A step computes ``k`` new tokens of a request after ``start`` tokens already in its cache. The
roofline (``labkit.serving.sim.costmodel``) needs three numbers of the whole step: Σ new tokens (the
weights' work and the K/V written), Σ context tokens (the K/V read) and Σ query-key pairs (the
attention's work: a chunk makes ``k * start + k * (k + 1) / 2`` pairs, its causal triangle included).

This module imports nothing, on purpose: the same function counts labkit's steps (``step_sums`` in
``labkit.serving.sim.simulator``) and vLLM's (the step recorder in ``labkit/vllm_bridge/driver.py``,
which runs in vLLM's own environment and loads this file by its path), so that both engines' steps
are measured by one rule.
"""


def work_sums(chunks) -> tuple[int, int, float]:
    """Σ new tokens, Σ context tokens and Σ query-key pairs of a step's ``(start, num_tokens)`` chunks."""
    new = ctx = 0
    pairs = 0.0
    for start, k in chunks:
        new += k
        ctx += start
        pairs += k * start + k * (k + 1) / 2
    return new, ctx, pairs


def add_span(spans: list[list[int]], start: int, end: int) -> int:
    """Add positions ``[start, end)`` to a request's computed ``spans`` (sorted, disjoint); returns how many
    of them it had computed before. A request continuing where it stopped only extends its last span."""
    if spans and spans[-1][1] == start:
        spans[-1][1] = end
        return 0
    again = sum(max(0, min(e, end) - max(s, start)) for s, e in spans)
    merged = sorted(spans + [[start, end]])
    spans[:] = merged[:1]
    for s, e in merged[1:]:
        if s <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], e)
        else:
            spans.append([s, e])
    return again
